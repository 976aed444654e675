"""Many models and clusters: `calibrate --manifest` under mpirun, manifest
errors, the job scripts against stand-ins for sbatch, squeue, scontrol and
the launcher (slurm_scripts: arguments, NUL-separated file lists, signals
passed on, requeueing), and slurm/kqsvd-submit on a real single-node SLURM
with a job killed half-way (scancel, and kill -9 of one rank) and
resubmitted, and one stopped by the time-limit signal that requeues itself."""
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
            ":1: 7 fields, expected NAME MODEL_H5 OUTPUT_H5 SHARD_GLOB"),
           ("nine fields", "x a/model.h5 out/x.h5 a/shard-*.h5 0.1 a/shard-*.h5 a b c\n",
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


# ---- the job scripts, SLURM stood in for -------------------------------------

STUBS = {
    # Each records its arguments, one per line, a blank line after a call.
    "sbatch": 'printf "%s\\n" "$@" "" >> "$STUB_DIR/sbatch.calls"; echo 4242',
    "scontrol": 'printf "%s\\n" "$@" "" >> "$STUB_DIR/scontrol.calls"',
    # Lists the jobs for the first STUB_LIVE calls, as for a requeued task.
    "squeue": 'echo x >> "$STUB_DIR/squeue.calls"\n'
              '[ "$(wc -l < "$STUB_DIR/squeue.calls")" -gt "${STUB_LIVE:-0}" ] || echo 4242_0',
    # The launcher: its arguments NUL-separated; with STUB_SIGNAL, waits
    # for USR1 and exits 75 as kqsvd calibrate does after its checkpoint.
    # The model jobs' Python (KQSVD_HF_PYTHON), when run without a launcher.
    "hf-python": 'printf "%s\\0" "$@" > "$STUB_DIR/python.args"',
    "launch": 'printf "%s\\0" "$@" > "$STUB_DIR/launch.args"\n'
              'if [ -n "${STUB_SIGNAL:-}" ]; then\n'
              '  trap \'echo USR1 > "$STUB_DIR/launch.signal"; exit 75\' USR1\n'
              '  touch "$STUB_DIR/launch.ready"\n'
              '  while :; do sleep 0.05; done\n'
              'fi',
}


def stubs(wd):
    d = os.path.join(wd, "bin")
    os.makedirs(d)
    for name, body in STUBS.items():
        with open(os.path.join(d, name), "w") as f:
            f.write("#!/usr/bin/env bash\n" + body + "\n")
        os.chmod(os.path.join(d, name), 0o755)
    return d


def calls(path):
    """The recorded calls: a list of argument lists."""
    if not os.path.exists(path):
        return []
    return [c.split("\n") for c in open(path).read().split("\n\n") if c]


def run_job(env, template, signal_=None, timeout=30):
    """A template run by bash as SLURM would, signalled once the launcher runs."""
    p = subprocess.Popen(["bash", os.path.join(ROOT, "slurm", template)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if signal_:
        ready = os.path.join(env["STUB_DIR"], "launch.ready")
        t0 = time.time()
        while not os.path.exists(ready) and time.time() - t0 < 10:
            time.sleep(0.02)
        os.remove(ready)
        p.send_signal(signal_)
    out, _ = p.communicate(timeout=timeout)
    return p.returncode, out


def slurm_scripts():
    """kqsvd-submit's sbatch options (--requeue, --signal-lead), --wait
    through a requeue, refusals; calibrate.sbatch and evaluate.sbatch in
    array mode: every file name reaches kqsvd as one argument, USR1 and TERM
    reach the launcher as USR1, and an exit code of 75 after USR1 requeues
    the job when asked to.  No SLURM needed."""
    wd = workdir("slurm_scripts")
    stub = stubs(wd)
    for n in ("a/model.h5", "a/s 0 --force.h5", "a/s-1.h5", "v/-v 0.h5"):
        os.makedirs(os.path.dirname(os.path.join(wd, n)), exist_ok=True)
        open(os.path.join(wd, n), "w").close()
    os.makedirs(os.path.join(wd, "out"))
    mpath = os.path.join(wd, "m.txt")
    with open(mpath, "w") as f:
        f.write("x a/model.h5 out/x.h5 a/s*.h5 0.2 v/*.h5\n")
    env = dict(os.environ, PATH=stub + ":" + os.environ["PATH"], STUB_DIR=wd, KQSVD_POLL="1")
    real = os.path.realpath(wd)

    submit_cmd = [os.path.join(ROOT, "slurm", "kqsvd-submit"), mpath]
    t0 = time.time()
    p = subprocess.run(submit_cmd + ["--requeue", "--signal-lead", "240", "--evaluate", "--wait"],
                       capture_output=True, text=True, env=dict(env, STUB_LIVE="2"), timeout=60)
    took = time.time() - t0
    cal, ev = (calls(os.path.join(wd, "sbatch.calls")) + [[], []])[:2]
    check("--requeue" in cal and "--signal=B:USR1@240" in cal and cal[-1].endswith("calibrate.sbatch")
          and any(a.startswith("--export=") and "KQSVD_REQUEUE=1" in a for a in cal),
          f"calibrate's sbatch: {cal}")
    check("--requeue" in ev and not any(a.startswith("--signal") for a in ev)
          and "--dependency=aftercorr:4242" in ev, f"evaluate's sbatch: {ev}")
    # squeue listed the task twice (a requeued task is pending again), then
    # not; no job wrote a status, so both read as never run.
    sq = os.path.join(wd, "squeue.calls")
    polls = open(sq).read().count("x\n") if os.path.exists(sq) else 0
    check(polls == 3 and took >= 2, f"--wait polled squeue {polls} times in {took:.1f} s")
    check(p.returncode == 1 and "FAILED (never ran)" in p.stdout, f"--wait: {p.returncode} {p.stdout}")
    for args, needle in ((["--poll", "0"], "'0' is not a positive whole number"),
                         (["--signal-lead", "70000"], "at most 65535"),
                         (["--signal-lead", "x"], "'x' is not a positive")):
        p = subprocess.run(submit_cmd + args, capture_output=True, text=True, env=env, timeout=30)
        check(p.returncode == 2 and needle in p.stderr, f"{args}: {p.returncode} {p.stderr}")
    p = subprocess.run(submit_cmd[:1] + ["--help"], capture_output=True, text=True, timeout=30)
    check("--requeue" in p.stderr and "--poll S" in p.stderr and "set -e" not in p.stderr,
          f"--help: {p.stderr}")
    fifo = os.path.join(wd, "fifo.txt")
    os.mkfifo(fifo)
    p = subprocess.run(submit_cmd[:1] + [fifo], capture_output=True, text=True, env=env, timeout=30)
    check(p.returncode == 2 and "is not a regular file" in p.stderr, f"FIFO manifest: {p.stderr}")
    check(len(calls(os.path.join(wd, "sbatch.calls"))) == 2, "a refused submission called sbatch")

    # The templates in array mode, as kqsvd-submit sets them up.
    sub, logs = os.path.join(wd, "sub"), os.path.join(wd, "logs")
    os.makedirs(sub)
    os.makedirs(logs)
    with open(os.path.join(sub, "manifest.tsv"), "w") as f:
        f.write(run(["manifest", mpath, "--lists", sub]).stdout)
    job = dict(env, KQSVD_SUBMISSION=sub, KQSVD_LOGDIR=logs, KQSVD_CKPT_DIR=os.path.join(wd, "ck"),
               KQSVD_ROOT=ROOT, KQSVD_LAUNCH=os.path.join(stub, "launch"), SLURM_ARRAY_JOB_ID="77",
               SLURM_ARRAY_TASK_ID="0", SLURM_JOB_ID="78", KQSVD_REQUEUE="0")
    status = os.path.join(logs, "x.calibrate.status")
    largs = os.path.join(wd, "launch.args")
    rc, out = run_job(job, "calibrate.sbatch")
    got = open(largs).read().split("\0")[:-1]
    want = [os.environ["KQSVD"], "calibrate", "--progress", "lines", "--model", f"{real}/a/model.h5",
            "--out", f"{real}/out/x.h5", "--checkpoint", os.path.join(wd, "ck", "x"), "--skip-done",
            "--ranks", "eps:0.2", f"{real}/a/s 0 --force.h5", f"{real}/a/s-1.h5"]
    check(rc == 0 and got == want, f"calibrate.sbatch: {rc} {out}\n{got}\nvs {want}")
    check(open(status).read().strip() == "0", "calibrate status")
    rc, out = run_job(job, "evaluate.sbatch")
    got = open(largs).read().split("\0")[:-1]
    check(rc == 0 and got[-1] == f"{real}/v/-v 0.h5" and "--json" in got, f"evaluate.sbatch: {got}")

    # Signals: USR1 (the time-limit warning) and TERM (scancel, preemption).
    for sig, requeue, want_status, want_requeue in (
            (signal.SIGUSR1, "0", "75", False), (signal.SIGUSR1, "1", "requeued", True),
            (signal.SIGTERM, "1", "75", False)):
        name = f"{signal.Signals(sig).name} with KQSVD_REQUEUE={requeue}"
        for f in ("launch.signal", "scontrol.calls"):
            if os.path.exists(os.path.join(wd, f)):
                os.remove(os.path.join(wd, f))
        rc, _ = run_job(dict(job, STUB_SIGNAL="1", KQSVD_REQUEUE=requeue), "calibrate.sbatch", sig)
        check(rc == 75, f"{name}: exit code {rc}")
        check(os.path.exists(os.path.join(wd, "launch.signal")), f"{name}: the launcher got no USR1")
        st = open(status).read()
        check(st.startswith(want_status), f"{name}: status {st!r}")
        sc = calls(os.path.join(wd, "scontrol.calls"))
        check(sc == ([["requeue", "78"]] if want_requeue else []), f"{name}: scontrol {sc}")
    log = open(os.path.join(logs, "x.calibrate.log")).read()
    check("SIGUSR1: passing it on" in log and "requeueing job 78" in log and
          "exit code 75 (after SIGTERM)" in log, f"calibrate log:\n{log}")
    model_lines(wd, env, job, stub)
    finish("slurm_scripts")


def model_lines(wd, env, job, stub):
    """Manifest lines naming a model (hf:): calibrate.sbatch launches
    calibrate_hf on the ranks with the line's fields, evaluate.sbatch runs
    kqsvd.quality alone on held-out text; a missing Python fails the task,
    and kqsvd-submit refuses to submit when it cannot import the model
    stack."""
    real = os.path.realpath(wd)
    for n in ("hf/m/config.json", "hf/calib.txt", "hf/valid.txt"):
        os.makedirs(os.path.dirname(os.path.join(wd, n)), exist_ok=True)
        open(os.path.join(wd, n), "w").close()
    mpath = os.path.join(wd, "hf.txt")
    with open(mpath, "w") as f:
        f.write("h hf:hf/m out/h.h5 hf/calib.txt 64 12 budget:0.4\n"
                "g hf:hf/m out/g.h5 hf/calib.txt 32 5 0.2 hf/valid.txt\n")
    sub = os.path.join(wd, "sub-hf")
    os.makedirs(sub)
    with open(os.path.join(sub, "manifest.tsv"), "w") as f:
        f.write(run(["manifest", mpath, "--lists", sub]).stdout)
    python = os.path.join(stub, "hf-python")
    job = dict(job, KQSVD_SUBMISSION=sub, KQSVD_HF_PYTHON=python)
    model = ["--model", f"{real}/hf/m"]
    rc, out = run_job(job, "calibrate.sbatch")
    got = open(os.path.join(wd, "launch.args")).read().split("\0")[:-1]
    want = [python, "-m", "kqsvd.calibrate_hf", *model, "--text", f"{real}/hf/calib.txt",
            "--seq-len", "64", "--num-seqs", "12", "--out", f"{real}/out/h.h5", "--checkpoint",
            os.path.join(wd, "ck", "h"), "--skip-done", "--ranks", "budget:0.4"]
    check(rc == 0 and got == want, f"calibrate.sbatch, hf: line: {rc} {out}\n{got}\nvs {want}")
    for task, text, seqs, policy in (("0", "calib.txt", "8", "budget:0.4"),
                                     ("1", "valid.txt", "5", "eps:0.2")):
        if os.path.exists(os.path.join(wd, "launch.args")):
            os.remove(os.path.join(wd, "launch.args"))
        rc, out = run_job(dict(job, SLURM_ARRAY_TASK_ID=task), "evaluate.sbatch")
        got = open(os.path.join(wd, "python.args")).read().split("\0")[:-1]
        name = "hg"[int(task)]
        want = ["-m", "kqsvd.quality", *model, "--text", f"{real}/hf/{text}", "--split",
                "validation", "--seq-len", "64" if task == "0" else "32", "--num-seqs", seqs,
                "--proj", f"{real}/out/{name}.h5", "--ranks", policy, "--json",
                f"{real}/out/{name}.quality.json", "--force"]
        check(rc == 0 and got == want and not os.path.exists(os.path.join(wd, "launch.args")),
              f"evaluate.sbatch, hf: line {task}: {rc} {out}\n{got}\nvs {want}")
    rc, _ = run_job(dict(job, KQSVD_HF_PYTHON=os.path.join(wd, "no-python")), "calibrate.sbatch")
    log = open(os.path.join(job["KQSVD_LOGDIR"], "h.calibrate.log")).read()
    check(rc == 1 and "no-python not found: run scripts/hf-env.sh or set KQSVD_HF_PYTHON" in log,
          f"missing Python: {rc} {log[-500:]}")

    before = len(calls(os.path.join(wd, "sbatch.calls")))
    submit = [os.path.join(ROOT, "slurm", "kqsvd-submit"), mpath]
    p = subprocess.run(submit, capture_output=True, text=True, timeout=60,
                       env=dict(env, KQSVD_HF_PYTHON="/bin/false"))
    check(p.returncode == 2 and "h names a model (hf:), whose job runs /bin/false" in p.stderr
          and len(calls(os.path.join(wd, "sbatch.calls"))) == before,
          f"kqsvd-submit without the model stack: {p.returncode} {p.stderr}")
    p = subprocess.run(submit, capture_output=True, text=True, timeout=60,
                       env=dict(env, KQSVD_HF_PYTHON=python))
    cal = calls(os.path.join(wd, "sbatch.calls"))[-1]
    check(p.returncode == 0 and any(a.startswith("--export=") and f"KQSVD_HF_PYTHON={python}" in a
                                    for a in cal), f"kqsvd-submit, hf: lines: {p.stderr} {cal}")


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


# The model of the kill-and-resume tests: a few seconds on 2 ranks.
BIG = dict(layers=2, heads=8, kv_heads=2, head_dim=128, seq_len=2048, min_seq_len=2048,
           dtype="bf16", seed=23)


def requeue_on_signal(env, wd, model, shards, ref):
    """The time-limit warning (USR1 to the batch shell, as --signal=B:USR1@LEAD
    sends it; here from scancel) stops calibrate at a checkpoint with exit
    code 75 (the C side's contract); with --requeue the job requeues itself,
    resumes, and ends with an uninterrupted run's output; --wait and the
    evaluation after it wait through the requeue."""
    sub = os.path.join(wd, "requeue")
    os.makedirs(os.path.join(sub, "out"))
    # One sequence after the calibration set's, to evaluate on in seconds.
    synth(os.path.join(sub, "valid"), seqs=1, shards=1, skip_seqs=48, **BIG)
    mpath = os.path.join(sub, "m.txt")
    with open(mpath, "w") as f:
        f.write(f"big {model} out/big.h5 {os.path.dirname(shards[0])}/shard-*.h5 0.1 valid/shard-*.h5\n")
    e = dict(env, KQSVD_CALIBRATE_ARGS="--checkpoint-every 0")
    p = subprocess.Popen([os.path.join(ROOT, "slurm", "kqsvd-submit"), mpath, "--ntasks-per-node", "2",
                          "--requeue", "--signal-lead", "120", "--evaluate", "--wait"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e)
    first = p.stdout.readline()
    job = first.split("job array ")[1].split(",")[0] + "_0" if "job array " in first else None
    check(job, f"requeue: submission: {first}")
    ckdir = os.path.join(sub, "kqsvd-checkpoints", "big")
    t0 = time.time()
    while job and time.time() - t0 < 120 and not glob.glob(os.path.join(ckdir, "rank-*.h5")):
        time.sleep(0.05)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job or "0"], env=env)
    # SLURM holds a requeued job back for two minutes (its BeginTime); the
    # test lets it start after 2 s (a node refuses a job whose credential
    # was revoked within the same second).
    t0, requeued = time.time(), False
    while job and time.time() - t0 < 60:
        q = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True,
                           env=env).stdout.strip()
        if q == "PENDING":
            time.sleep(2)
            subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env)
            requeued = True
            break
        if not q:
            break
        time.sleep(0.1)
    log_path = os.path.join(sub, "kqsvd-logs", "big.calibrate.log")
    log = lambda: open(log_path).read() if os.path.exists(log_path) else ""  # noqa: E731
    check(requeued, "requeue: the job was not requeued after USR1 (kqsvd calibrate must exit with "
                    f"75 after saving its checkpoint on SIGUSR1):\n{log()[-3000:]}")
    try:
        out, err = p.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
    check(p.returncode == 0 and "FAILED" not in out, f"requeue: --wait: {p.returncode}\n{out}\n{err}")
    text = log()
    check("exit code 75" not in text.split("requeueing job")[-1] and "requeueing job" in text and
          "run 2" in text and "resuming" in text, f"requeue: log:\n{text[-3000:]}")
    show = subprocess.run(["scontrol", "show", "job", job or "0"], capture_output=True, text=True,
                          env=env).stdout
    check("Restarts=1" in show, f"requeue: scontrol show job: {show}")
    out_h5 = os.path.join(sub, "out", "big.h5")
    check(os.path.exists(os.path.join(sub, "out", "big.report.json")), "requeue: no evaluation")
    if check(os.path.exists(out_h5), "requeue: no output"):
        worst, where = max_rel_diff(load_proj(ref), load_proj(out_h5))
        check(worst == 0.0, f"requeue: output differs from an uninterrupted run: {worst} at {where}")
    print("requeue: stopped by USR1, requeued, resumed, identical to the uninterrupted run", flush=True)


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
    env["KQSVD_POLL"] = "1"
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
        model, shards = synth(os.path.join(wd, "big"), seqs=48, shards=4, **BIG)
        ref = os.path.join(wd, "ref.h5")
        calibrate(model, ref, shards, np_=2)
        for how in ("scancel", "kill9"):
            kill_and_resume(env, wd, how, model, shards, ref)
        requeue_on_signal(env, wd, model, shards, ref)
    finally:
        if own:
            subprocess.run([os.path.join(ROOT, "slurm", "local-cluster.sh"), "stop", own])
    finish("slurm")
