"""Judging a run: the sanitizer reports in its logs and stderr (and
whether one is contained in kqsvd's header-check child), its stderr without
mpirun's notices, its output against the reference, the files it left
behind, the verdict, the failure kinds of the summary, and checking a
folder of sanitizer logs (--check-logs)."""
import glob
import json
import os
import re
import signal
import sys

import h5py
import numpy as np

from .runner import ROOT


SAN_RE = re.compile(r"ERROR: (AddressSanitizer|LeakSanitizer): ([\w-]+)|(\S+): runtime error: (.*)")
FRAME_RE = re.compile(r"#\d+ 0x[0-9a-f]+ +(?:in (\S+) )?\(?([^\s)]+)")


def sanitizer_reports(d, stderr):
    """[(kind, contained)] of the sanitizer reports of a run (log files under
    d/san, and stderr).  Contained: raised inside a library (libhdf5) in the
    child process that kqsvd forks to read a file's headers first
    (io/isolate.c), whose end kqsvd reports as a clean error."""
    texts = []
    for p in sorted(glob.glob(os.path.join(d, "san", "*"))):
        with open(p, errors="replace") as fh:
            t = fh.read()
        if t.strip():
            texts.append(t)
    if "Sanitizer" in stderr or "runtime error:" in stderr:
        texts.append(stderr)
    return [k for t in texts for k in sanitizer_reports_text(t)]


def sanitizer_reports_text(t):
    """[(kind, contained)] of the report in one process's sanitizer output
    (a process stops at its first report), [] when it holds none."""
    m = SAN_RE.search(t)
    if not m:
        return []
    frames = [fm.groups() for fm in FRAME_RE.finditer(t[m.end():])]
    frames = [(fn or "?", loc) for fn, loc in frames
              if not ("libsanitizer" in loc or (fn or "").startswith(("__interceptor", "__asan")))]
    if m.group(1):
        what = f"{m.group(1)} {m.group(2)}"
    else:
        what = f"UBSan {m.group(4)[:70]} at {os.path.relpath(m.group(3), ROOT)}"
    # The first frame in kqsvd's code or in libhdf5 (not in libc's memmove
    # and the like) says where it happened.
    first = next((f for f in frames if ROOT in f[1] or "libhdf5" in f[1]), frames[0] if frames else None)
    where = ""
    if first:
        fn, loc = first
        if m.group(1) == "LeakSanitizer":
            fn, loc = next((f for f in frames if ROOT in f[1]), first)
        where = f" in {fn} ({os.path.basename(loc.split('+')[0])})"
    contained = bool(first) and "libhdf5" in first[1] \
        and any(fn == "kqsvd_h5_isolate" for fn, _ in frames)
    return [(what + where, contained)]


MPI_NOISE = re.compile(r"^-{20,}$")


def stderr_lines(err):
    """stderr without mpirun's boxed notices."""
    lines, inside = [], False
    for ln in err.splitlines():
        if MPI_NOISE.match(ln.strip()):
            inside = not inside
            continue
        if not inside and ln.strip():
            lines.append(ln)
    return lines


def compare_proj(a, b):
    """True when every dataset of the two projections files is identical."""
    with h5py.File(a, "r") as fa, h5py.File(b, "r") as fb:
        for g in ("kqsvd", "ksvd", "eigen", "spectra"):
            if g not in fb:
                return False
            for k in fa[g]:
                if k not in fb[g] or not np.array_equal(fa[g][k][...], fb[g][k][...]):
                    return False
    return True


def leftovers(d, out, ok, runner):
    bad = []
    for root, dirs, fs in os.walk(d):
        for n in fs + dirs:
            if ".tmp" in n:
                bad.append(os.path.relpath(os.path.join(root, n), d))
    if not ok:
        for root, dirs, fs in os.walk(out):
            for n in fs:
                if runner != "manifest":
                    bad.append(os.path.relpath(os.path.join(root, n), d))
    return bad


def judge(ctx, info, r, d, argv, mentions, out, res):
    rc, sout, serr, secs, timed_out = res
    fails, warns = [], []
    kinds = []
    for k, contained in sanitizer_reports(d, serr):
        if contained:
            warns.append(f"contained: {k}")
        else:
            fails.append(f"sanitizer: {k}")
            kinds.append(k)
    lines = stderr_lines(serr)
    sig = re.search(r"exited on signal (\d+)|terminated with signal (\d+)|signal (\d+) \(", serr)
    if timed_out:
        fails.append(f"timeout after {ctx.timeout} s (hang)")
    elif rc is not None and rc < 0:
        fails.append(f"killed by signal {-rc} ({signal.Signals(-rc).name})")
    elif sig and not kinds:
        fails.append(f"rank killed by signal {next(g for g in sig.groups() if g)}")
    elif rc not in (0, 1, 2) and not kinds:
        fails.append(f"exit code {rc}")
    ok = rc == 0 and not timed_out
    if rc in (1, 2) and not timed_out:
        err_lines = [ln for ln in lines if re.match(r"kqsvd( \S+)?: error: ", ln)]
        if not err_lines:
            fails.append("no 'kqsvd CMD: error:' line")
        else:
            text = "\n".join(lines)
            if not any(m in text for m in mentions):
                fails.append("error does not name the mutated file")
            if len(err_lines) > 1:
                fails.append(f"{len(err_lines)} error lines")
            extra = [ln for ln in lines if not ln.startswith(("kqsvd", "mpirun", "mpiexec"))
                     and r["target"] != "manifest"]
            if extra:
                fails.append(f"stray stderr: {extra[0][:60]}")
        if r["expect"] == "same":
            fails.append("refused a valid input")
    if ok:
        if r["expect"] == "refuse":
            fails.append("accepted an invalid input")
        if r["runner"] == "evaluate":
            rep = os.path.join(out, "report.json")
            try:
                json.load(open(rep))
            except Exception as e:  # noqa: BLE001
                fails.append(f"exit 0 without a readable report ({type(e).__name__})")
        elif r["runner"] in ("calibrate", "resume", "resume2"):
            p = os.path.join(out, "proj.h5")
            if not os.path.isfile(p):
                fails.append("exit 0 without an output")
            else:
                try:
                    same = compare_proj(info["ref2" if r["np"] == 2 else "ref"], p)
                except Exception as e:  # noqa: BLE001
                    same = None
                    fails.append(f"exit 0 with an unreadable output ({type(e).__name__})")
                if same is False:
                    if r["runner"].startswith("resume"):
                        fails.append("resumed from a corrupt checkpoint: output differs")
                    elif r["expect"] in ("same", "valid"):
                        fails.append("valid variant gives another output")
                    elif r.get("neutral"):
                        warns.append("metadata edit accepted, output differs")
    left = leftovers(d, out, ok, r["runner"])
    if left:
        fails.append(f"left behind: {', '.join(left[:3])}")
    return fails, warns, secs


def group_of(reason):
    """Failure kinds, for the summary: addresses and sizes left out."""
    reason = re.sub(r"timeout after [\d.]+ s", "timeout", reason)
    return re.sub(r"left behind: .*", "left behind", reason)


def tree(folder):
    return [os.path.relpath(os.path.join(root, n), folder)
            for root, dirs, files in os.walk(folder) for n in dirs + files]


def check_logs(folder):
    bad = contained = 0
    for p in sorted(glob.glob(os.path.join(folder, "*"))):
        with open(p, errors="replace") as fh:
            text = fh.read()
        for kind, inside in sanitizer_reports_text(text):
            if inside:
                contained += 1
                continue
            bad += 1
            print(f"--- {p}: {kind}\n" + "\n".join(text.splitlines()[:40]), file=sys.stderr)
    print(f"sanitizer logs: {bad} reports"
          + (f", {contained} more inside libhdf5 in kqsvd's header-check child" if contained else ""))
    return 1 if bad else 0
