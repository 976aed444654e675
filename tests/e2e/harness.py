"""Helpers shared by the end-to-end scenarios: running kqsvd (under mpiexec
when asked), making sets, loading outputs.  Configured by the environment
that tests/CMakeLists.txt sets: KQSVD, KQSVD_MPIEXEC, KQSVD_MPIEXEC_FLAGS,
KQSVD_MPIEXEC_PREFLAGS, KQSVD_TEST_READ, KQSVD_WORK."""
import glob
import hashlib
import os
import shlex
import shutil
import stat
import subprocess
import sys

import h5py
import numpy as np

KQSVD = os.environ["KQSVD"]
MPIEXEC = os.environ.get("KQSVD_MPIEXEC", "mpiexec")
NPFLAG = os.environ.get("KQSVD_MPIEXEC_FLAGS", "-n")
PREFLAGS = shlex.split(os.environ.get("KQSVD_MPIEXEC_PREFLAGS", ""))
WORK = os.environ.get("KQSVD_WORK", "/tmp/kqsvd-e2e")

FAILURES = []


def check(cond, msg):
    if not cond:
        FAILURES.append(msg)
        print("FAIL:", msg, flush=True)
    return cond


def finish(name):
    print(f"{name}: {len(FAILURES)} failures", flush=True)
    sys.exit(1 if FAILURES else 0)


def workdir(name):
    d = os.path.join(WORK, name)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    return d


def run(args, np_=None, expect=0, timeout=300, env=None):
    """Runs kqsvd ARGS (under mpiexec with np_ ranks when given)."""
    cmd = [KQSVD] + [str(a) for a in args]
    if np_ is not None:
        cmd = [MPIEXEC, NPFLAG, str(np_)] + PREFLAGS + cmd
    e = dict(os.environ)
    e.update(env or {})
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=e)
    if expect is not None and (p.returncode != 0) != (expect != 0):
        print("command:", " ".join(cmd))
        print("stdout:", p.stdout)
        print("stderr:", p.stderr)
        raise SystemExit(f"exit code {p.returncode}, expected {'non-zero' if expect else 0}")
    return p


def synth(out, **opts):
    args = ["synth", "--out", out, "--progress", "off"]
    for k, v in opts.items():
        flag = "--" + k.replace("_", "-")
        args += [flag] if v is True else [flag, v]
    run(args)
    return os.path.join(out, "model.h5"), sorted(glob.glob(os.path.join(out, "shard-*.h5")))


def small_set(name, **opts):
    """A fresh work folder holding a synthetic set: (folder, model, shards)."""
    wd = workdir(name)
    return (wd, *synth(os.path.join(wd, "set"), **opts))


def calibrate(model, out, shards, np_=1, extra=(), env=None, expect=0):
    return run(["calibrate", "--progress", "off", "--model", model, "--out", out,
                *extra, *shards], np_=np_, env=env, expect=expect)


def load_proj(path):
    """Every dataset of a projections file, as {"group/name": array}."""
    out = {}
    with h5py.File(path, "r") as f:
        for g in ("kqsvd", "ksvd", "eigen", "spectra"):
            for k in f[g]:
                out[f"{g}/{k}"] = f[g][k][...]
        out["attrs"] = dict(f.attrs)
    return out


def max_rel_diff(a, b):
    """max |a - b| / max |a| over every dataset of two load_proj dicts."""
    worst, where = 0.0, None
    for k, x in a.items():
        if k == "attrs":
            continue
        y = b[k]
        scale = np.abs(x).max() or 1.0
        d = np.abs(x.astype(np.float64) - y.astype(np.float64)).max() / scale
        if d > worst:
            worst, where = d, k
    return worst, where


def special_outputs(folder):
    """Names an output must never replace, made in `folder` (a new one):
    {path: S_IS* test of what stat() must still find there}.  A twin of
    /dev/null (mknod needs root: left out otherwise, saying so), a FIFO, a
    link to the twin."""
    os.makedirs(folder)
    fifo = os.path.join(folder, "fifo.h5")
    os.mkfifo(fifo)
    found = {fifo: stat.S_ISFIFO}
    if os.geteuid() != 0:
        print("special_outputs: no device node, mknod needs root", flush=True)
        return found
    node, link = os.path.join(folder, "null.h5"), os.path.join(folder, "link.h5")
    os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    os.symlink(node, link)
    found.update({node: stat.S_ISCHR, link: stat.S_ISCHR})
    return found


def digests(paths):
    return {p: hashlib.sha256(open(p, "rb").read()).hexdigest() for p in paths}


def refused_output(name, args, opt, path, inputs, *words, code=2):
    """kqsvd ARGS (one process) refuses output `path` of option `opt`: exit
    `code` and one stderr line naming both and `words`, and nothing changed:
    no new name in path's folder, the node still what it was (when
    special_outputs made it), the inputs byte for byte."""
    folder = os.path.dirname(path) or "."
    before, sums = sorted(os.listdir(folder)), digests(inputs)
    kinds = {p: os.stat(p).st_mode for p in (path,) if os.path.exists(p)}
    p = run(args, expect=None)
    lines = p.stderr.strip().splitlines()
    check(p.returncode == code and len(lines) == 1 and "Traceback" not in p.stderr and
          all(w in lines[0] for w in (f"{opt} {path}", *words)),
          f"{name}: expected exit {code} and one line naming {opt} {path} {words}, got exit "
          f"{p.returncode}: {p.stderr[:600]}")
    check(sorted(os.listdir(folder)) == before, f"{name}: {folder} changed: "
          f"{sorted(set(os.listdir(folder)) ^ set(before))}")
    for q, mode in kinds.items():
        check(stat.S_IFMT(os.stat(q).st_mode) == stat.S_IFMT(mode), f"{name}: {q} was replaced")
    check(digests(inputs) == sums, f"{name}: an input changed")
    print(f"{name}: {lines[0] if lines else p.stderr}", flush=True)
    return p
