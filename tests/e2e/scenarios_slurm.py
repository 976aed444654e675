"""Many models and clusters: `calibrate --manifest` under mpirun, manifest
errors, and slurm/kqsvd-submit on a real single-node SLURM with a job
killed half-way (scancel, and kill -9 of one rank) and resubmitted."""
import glob
import os
import shutil
import signal
import subprocess
import time

import numpy as np

from harness import calibrate, check, finish, load_proj, max_rel_diff, run, synth, workdir
from reference import load_set, rank_rule, svals

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))


def two_models(wd):
    """Two synthetic models that differ in every size, and a manifest."""
    a = synth(os.path.join(wd, "a"), layers=2, heads=6, kv_heads=2, head_dim=16, seqs=8,
              seq_len=90, shards=3, dtype="bf16", seed=21)
    b = synth(os.path.join(wd, "b"), layers=3, heads=4, kv_heads=4, head_dim=8, seqs=5,
              seq_len=70, shards=2, dtype="f32", causal=0, seed=22)
    os.makedirs(os.path.join(wd, "out"), exist_ok=True)
    path = os.path.join(wd, "models.txt")
    with open(path, "w") as f:
        f.write("# two models\n"
                "alpha  a/model.h5  out/alpha.h5  a/shard-*.h5\n"
                "\n"
                "beta   b/model.h5  out/beta.h5   b/shard-*.h5  0.2   # its own eps\n")
    return path, a, b


def check_against_reference(name, proj, model, shards, eps):
    """Ranks by the rule and spectra from full matrices (tests/e2e/reference.py)."""
    K, V, Q = load_set(shards)
    p = load_proj(proj)
    L, Hkv = K.shape[0], K.shape[1]
    for l in range(L):
        rk = rank_rule(np.array([svals(K[l, g]) for g in range(Hkv)]), eps)
        check(p["kqsvd/rank_k"][l] == rk, f"{name}: layer {l} rank_k {p['kqsvd/rank_k'][l]} vs {rk}")
        for g in range(Hkv):
            s = svals(K[l, g])
            check(np.abs(p["spectra/K"][l, g] - s).max() <= 1e-10 * s[0], f"{name}: spectrum K {l},{g}")


def manifest():
    """calibrate --manifest on 3 ranks equals one run per model; reruns skip."""
    wd = workdir("manifest")
    path, (ma, sa), (mb, sb) = two_models(wd)
    p = run(["calibrate", "--progress", "off", "--manifest", path, "--checkpoint",
             os.path.join(wd, "ckpt")], np_=3)
    check("2 models calibrated" in p.stdout, f"summary: {p.stdout}")
    for name, model, shards, eps in (("alpha", ma, sa, 0.1), ("beta", mb, sb, 0.2)):
        out = os.path.join(wd, "out", name + ".h5")
        one = os.path.join(wd, name + "-single.h5")
        calibrate(model, one, shards, np_=3, extra=["--eps", str(eps)])
        worst, where = max_rel_diff(load_proj(one), load_proj(out))
        check(worst == 0.0, f"{name}: manifest output differs from a single run by {worst} at {where}")
        check_against_reference(name, out, model, shards, eps)
    check(not glob.glob(os.path.join(wd, "ckpt", "*", "*.h5")), "checkpoints left after success")
    mtime = os.path.getmtime(os.path.join(wd, "out", "alpha.h5"))
    p = run(["calibrate", "--progress", "off", "--manifest", path], np_=2)
    check("0 models calibrated, 2 already done" in p.stdout, f"rerun: {p.stdout}")
    check(os.path.getmtime(os.path.join(wd, "out", "alpha.h5")) == mtime, "rerun rewrote alpha")
    # A changed input is noticed.
    os.utime(sb[0], None)
    p = run(["calibrate", "--progress", "off", "--manifest", path], np_=2)
    check("1 model calibrated, 1 already done" in p.stdout, f"after touching a shard: {p.stdout}")

    bad = [("too few fields", "x a/model.h5 out/x.h5\n", ":1: 3 fields"),
           ("no shards", "x a/model.h5 out/x.h5 nope/*.h5\n", ":1: SHARD_GLOB"),
           ("bad eps", "x a/model.h5 out/x.h5 a/shard-*.h5 2\n", ":1: EPS '2'"),
           ("bad policy", "x a/model.h5 out/x.h5 a/shard-*.h5 best:3\n", ":1: EPS 'best:3'"),
           ("bad name", "x/y a/model.h5 out/x.h5 a/shard-*.h5\n", ":1: NAME 'x/y'"),
           ("same name", "x a/model.h5 out/x.h5 a/shard-*.h5\n# c\nx b/model.h5 out/y.h5 b/shard-*.h5\n",
            ":3: NAME 'x' is already used on line 1"),
           ("same output", "x a/model.h5 out/x.h5 a/shard-*.h5\ny b/model.h5 out/x.h5 b/shard-*.h5\n",
            ":2: OUTPUT_H5"),
           ("output is an input", "x a/model.h5 a/shard-0000.h5 a/shard-*.h5\n", ":1: OUTPUT_H5"),
           ("missing model", "x nope.h5 out/x.h5 a/shard-*.h5\n", ":1: MODEL_H5"),
           ("empty", "# nothing\n", "names no model"),
           ("seven fields", "x a/model.h5 out/x.h5 a/shard-*.h5 0.1 a/shard-*.h5 extra\n",
            ":1: too many fields"),
           ("one output spelled twice", "x a/model.h5 out/x.h5 a/shard-*.h5\n"
            "y b/model.h5 ./out//x.h5 b/shard-*.h5\n", ":2: OUTPUT_H5"),
           ("output folder missing", "x a/model.h5 nodir/x.h5 a/shard-*.h5\n", ":1: OUTPUT_H5"),
           ("validation glob", "x a/model.h5 out/x.h5 a/shard-*.h5 0.1 nope/*.h5\n", ":1: VALID_GLOB"),
           ("output is the manifest", "x a/model.h5 bad.txt a/shard-*.h5\n", ":1: OUTPUT_H5")]
    for k, (name, text, needle) in enumerate(bad):
        mpath = os.path.join(wd, "bad.txt")
        with open(mpath, "w") as f:
            f.write(text)
        # The parser is shared; calibrate under MPI is tried on a few.
        cmds = [(["manifest", mpath], None)]
        if k % 4 == 0:
            cmds.append((["calibrate", "--manifest", mpath], 2))
        for cmd, np_ in cmds:
            p = run(cmd, np_=np_, expect=1)
            check(needle in p.stderr and "bad.txt" in p.stderr, f"{name}: {cmd[0]}: {p.stderr}")
    p = run(["calibrate", "--manifest", path, "--model", ma], expect=1)
    check("--manifest names the models" in p.stderr, f"--manifest with --model: {p.stderr}")
    finish("manifest")


# ---- SLURM ------------------------------------------------------------------

def slurm_up(env):
    try:
        p = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, env=env,
                           timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return p.returncode == 0 and any(s in p.stdout for s in ("idle", "mixed", "alloc"))


def submit(env, manifest_path, *extra, timeout=300):
    return subprocess.run([os.path.join(ROOT, "slurm", "kqsvd-submit"), manifest_path,
                           "--ntasks-per-node", "2", *extra], capture_output=True, text=True,
                          env=env, timeout=timeout)


def wait_gone(env, job, timeout=60):
    t0 = time.time()
    while time.time() - t0 < timeout:
        p = subprocess.run(["squeue", "-h", "-j", job, "-o", "%i"], capture_output=True,
                           text=True, env=env)
        if not p.stdout.strip():
            return True
        time.sleep(0.5)
    return False


def kill_and_resume(env, wd, how, model, shards, ref):
    """Stop a calibration once checkpoints exist (scancel, or kill -9 of one
    rank), resubmit: the output equals an uninterrupted run's, bit for bit."""
    sub = os.path.join(wd, how)
    os.makedirs(os.path.join(sub, "out"))
    mpath = os.path.join(sub, "m.txt")
    with open(mpath, "w") as f:
        f.write(f"big {model} out/big.h5 {os.path.dirname(shards[0])}/shard-*.h5\n")
    e = dict(env, KQSVD_CALIBRATE_ARGS="--checkpoint-every 0")
    p = submit(e, mpath)
    check(p.returncode == 0, f"{how}: submit: {p.stderr}")
    job = p.stdout.split("job array ")[1].split(",")[0]
    if how == "scancel":  # a second job on the same model is refused
        p = submit(e, mpath)
        check(p.returncode != 0 and "still has job" in p.stderr, f"double submission: {p.stderr}")
    ckdir = os.path.join(sub, "kqsvd-checkpoints", "big")
    t0 = time.time()
    while time.time() - t0 < 120 and not glob.glob(os.path.join(ckdir, "rank-*.h5")):
        time.sleep(0.05)
    check(glob.glob(os.path.join(ckdir, "rank-*.h5")), f"{how}: no checkpoint appeared")
    if how == "scancel":
        subprocess.run(["scancel", job], env=env)
    else:  # kill -9 of one rank
        pids = subprocess.run(["pgrep", "-f", "kqsvd calibrate.*out/big.h5"], capture_output=True,
                              text=True).stdout.split()
        check(pids, f"{how}: no rank found to kill")
        if pids:
            os.kill(int(pids[-1]), signal.SIGKILL)
    check(wait_gone(env, job), f"{how}: job {job} did not end")
    out = os.path.join(sub, "out", "big.h5")
    check(not os.path.exists(out), f"{how}: an output appeared although the job was killed")
    status = open(os.path.join(sub, "kqsvd-logs", "big.calibrate.status")).read().strip()
    check(status != "0", f"{how}: the killed job's status reads as success")
    p = submit(e, mpath, "--wait")
    check(p.returncode == 0, f"{how}: resubmission failed:\n{p.stdout}\n{p.stderr}")
    log = open(os.path.join(sub, "kqsvd-logs", "big.calibrate.log")).read()
    check("resuming" in log, f"{how}: the second run did not resume:\n{log[-2000:]}")
    worst, where = max_rel_diff(load_proj(ref), load_proj(out))
    check(worst == 0.0, f"{how}: resumed output differs from an uninterrupted run: {worst} at {where}")
    print(f"{how}: resumed, identical to the uninterrupted run", flush=True)


def slurm():
    """kqsvd-submit on a real SLURM: two models with --evaluate --wait, a
    refused manifest, and kill-and-resume.  Uses the cluster of SLURM_CONF
    when one answers, else starts a private one (root, slurm-wlm, munge)."""
    wd = workdir("slurm")
    env = dict(os.environ)
    own = None
    if not slurm_up(env):
        if os.geteuid() != 0 or not shutil.which("munged", path=os.environ["PATH"] + ":/usr/sbin"):
            print("slurm: SKIPPED, no SLURM answering and none can be started here "
                  "(needs root and Debian's slurm-wlm and munge)")
            raise SystemExit(77)
        own = os.path.join(wd, "cluster")
        env["SLURM_CONF"] = os.path.join(own, "slurm.conf")
    env["PATH"] = env["PATH"] + ":/usr/sbin"
    env["KQSVD"] = os.environ["KQSVD"]
    try:
        if own:
            p = subprocess.run([os.path.join(ROOT, "slurm", "local-cluster.sh"), "start", own],
                               capture_output=True, text=True)
            if p.returncode != 0:
                raise SystemExit(f"cannot start a local SLURM: {p.stderr}")
        path, (ma, sa), (mb, sb) = two_models(wd)
        p = submit(env, path, "--evaluate", "--wait")
        check(p.returncode == 0, f"submit --wait:\n{p.stdout}\n{p.stderr}")
        print(p.stdout, flush=True)
        for name, model, shards, eps in (("alpha", ma, sa, 0.1), ("beta", mb, sb, 0.2)):
            out = os.path.join(wd, "out", name + ".h5")
            check(os.path.exists(out), f"{name}: no output")
            if os.path.exists(out):
                check_against_reference(name, out, model, shards, eps)
            check(os.path.exists(os.path.join(wd, "out", name + ".report.json")), f"{name}: no report")
            check(os.path.exists(os.path.join(wd, "kqsvd-logs", name + ".calibrate.log")), f"{name}: no log")
        # Submitted again: both are done already and are not recomputed.
        mtimes = [os.path.getmtime(os.path.join(wd, "out", n + ".h5")) for n in ("alpha", "beta")]
        p = submit(env, path, "--wait")
        check(p.returncode == 0, f"resubmission: {p.stdout} {p.stderr}")
        check(mtimes == [os.path.getmtime(os.path.join(wd, "out", n + ".h5")) for n in ("alpha", "beta")],
              "a resubmitted, finished model was computed again")
        check("already made" in open(os.path.join(wd, "kqsvd-logs", "alpha.calibrate.log")).read(),
              "the log does not say the model was already made")
        # A bad manifest: refused, nothing submitted.
        bad = os.path.join(wd, "bad.txt")
        with open(bad, "w") as f:
            f.write("alpha a/model.h5 out/x.h5 a/shard-*.h5\nbeta b/model.h5 out/y.h5 missing/*.h5\n")
        before = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, env=env).stdout
        p = submit(env, bad)
        check(p.returncode != 0 and "bad.txt:2:" in p.stderr and "nothing submitted" in p.stderr,
              f"bad manifest: {p.returncode} {p.stderr}")
        after = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, env=env).stdout
        check(before == after, "a job was submitted for a bad manifest")
        # A failing job makes --wait fail.
        fail = os.path.join(wd, "fail.txt")
        with open(fail, "w") as f:
            f.write("broken a/model.h5 out/broken.h5 b/shard-*.h5\n")
        p = submit(env, fail, "--wait")
        check(p.returncode != 0 and "FAILED" in p.stdout, f"failing job: {p.returncode} {p.stdout}")
        # Big enough to take a few seconds on 2 ranks.
        model, shards = synth(os.path.join(wd, "big"), layers=2, heads=8, kv_heads=2,
                              head_dim=128, seqs=48, seq_len=2048, min_seq_len=2048, shards=4,
                              dtype="bf16", seed=23)
        ref = os.path.join(wd, "ref.h5")
        calibrate(model, ref, shards, np_=2)
        for how in ("scancel", "kill9"):
            kill_and_resume(env, wd, how, model, shards, ref)
    finally:
        if own:
            subprocess.run([os.path.join(ROOT, "slurm", "local-cluster.sh"), "stop", own])
    finish("slurm")
