"""Evaluation scenarios: `kqsvd evaluate` against the brute-force reference,
its independence of rank count and blocking, the rank policies, bad input,
memory, and the figures."""
import json
import os
import re
import shutil
import subprocess
import sys

import h5py
import numpy as np

from eval_reference import METHODS, METRICS, compare, evaluate as ref_evaluate, report_ranks
from harness import (calibrate, check, finish, refused_output, run, special_outputs, synth,
                     workdir)
from reference import rank_rule

SIZES = dict(layers=2, head_dim=8, seq_len=40, min_seq_len=9)


def split_sets(wd, name, cal_seqs=8, val_seqs=5, shards=(2, 3), **opts):
    """Calibration and validation sets of one synthetic model, disjoint
    (the validation set starts after the calibration sequences)."""
    o = dict(SIZES, **opts)
    model, cal = synth(os.path.join(wd, name + "-cal"), seqs=cal_seqs, shards=shards[0], **o)
    _, val = synth(os.path.join(wd, name + "-val"), seqs=val_seqs, shards=shards[1],
                   skip_seqs=cal_seqs, **o)
    return model, cal, val


def evaluate(model, proj, shards, np_=1, extra=(), expect=0, json_path=None):
    """Runs kqsvd evaluate; returns (process, report dict or None)."""
    args = ["evaluate", "--progress", "off", "--model", model, "--proj", proj]
    if json_path:
        args += ["--json", json_path]
    p = run(args + list(extra) + list(shards), np_=np_, expect=expect)
    rep = None
    if json_path and expect == 0:
        with open(json_path) as f:
            rep = json.load(f)
    return p, rep


def matches_reference(name, model, proj, val, rep, tol=1e-9):
    ref = ref_evaluate(model, proj, val, report_ranks(rep))
    worst, where = compare(rep, ref)
    check(worst <= tol, f"{name}: deviates from the brute-force reference by {worst:.2e} at {where}")
    print(f"{name}: largest deviation from the reference {worst:.2e}", flush=True)
    return ref


def check_report_shape(name, rep, L, tokens, nseq):
    check(rep["tokens"] == tokens and rep["sequences"] == nseq, f"{name}: tokens/sequences")
    for m in METHODS:
        layers = rep["methods"][m]["layers"]
        check([x["layer"] for x in layers] == list(range(L)), f"{name}: {m} layer list")
        for k in METRICS:
            mean = sum(x[k] for x in layers) / L
            check(abs(rep["methods"][m]["mean"][k] - mean) <= 1e-15 * max(mean, 1e-300) + 1e-300,
                  f"{name}: {m} mean {k}")


def set_tokens(shards):
    t = s = 0
    for path in shards:
        with h5py.File(path, "r") as f:
            t += int(f["seq_lens"][...].sum())
            s += len(f["seq_lens"])
    return t, s


def eval_reference():
    """Every metric, causal GQA bf16 and non-causal MHA f32, against brute force."""
    wd = workdir("eval_reference")
    cases = [("causal-gqa-bf16", dict(heads=6, kv_heads=2, dtype="bf16", causal=1, seed=3), 6),
             ("noncausal-mha-f32", dict(heads=3, kv_heads=3, dtype="f32", causal=0, seed=4), 40)]
    for name, opts, block in cases:
        model, cal, val = split_sets(wd, name, **opts)
        proj = os.path.join(wd, name + ".h5")
        calibrate(model, proj, cal, np_=2, extra=["--beta", "3"])
        rj = os.path.join(wd, name + ".json")
        p, rep = evaluate(model, proj, val, np_=3, extra=["--block-rows", str(block)], json_path=rj)
        tokens, nseq = set_tokens(val)
        check_report_shape(name, rep, SIZES["layers"], tokens, nseq)
        check(rep["beta"] == 3.0 and rep["causal"] == opts["causal"], f"{name}: report extensions")
        with h5py.File(proj, "r") as f:
            for m in METHODS:
                check([tuple(x) for x in report_ranks(rep)[m]] ==
                      list(zip(f[m]["rank_k"][...], f[m]["rank_v"][...])),
                      f"{name}: default ranks are those stored in the projections")
        matches_reference(name, model, proj, val, rep)
        for line in ("err_kq", "err_out", "mean"):
            check(line in p.stdout, f"{name}: table lacks {line}:\n{p.stdout}")
        # Every method at rank d reproduces attention exactly.
        d = SIZES["head_dim"]
        _, rep = evaluate(model, proj, val, np_=2, extra=["--ranks", f"fixed:{d}"],
                          json_path=os.path.join(wd, name + "-full.json"))
        worst = max(x[k] for m in METHODS for x in rep["methods"][m]["layers"] for k in METRICS)
        check(worst < 1e-20, f"{name}: at rank d the largest error is {worst:.2e}, not 0")
        # Other policies, still against the reference at the ranks they chose.
        for pol in ("fixed:3", "budget:0.3", "eps:0.02"):
            _, rep = evaluate(model, proj, val, np_=3, extra=["--ranks", pol],
                              json_path=os.path.join(wd, f"{name}-{pol}.json"))
            check(rep["rank_policy"] == pol, f"{name}: rank_policy {rep['rank_policy']} vs {pol}")
            matches_reference(f"{name} {pol}", model, proj, val, rep)

    # Degenerate heads: a KV group with nothing at all and a rank-deficient one.
    model, cal, val = split_sets(wd, "degen", heads=4, kv_heads=2, dtype="f64", seed=6)
    for path in cal + val:
        with h5py.File(path, "r+") as f:
            K, V, Q = f["keys"], f["values"], f["queries"]
            K[0, 0], V[0, 0], Q[0, 0:2] = 0.0, 0.0, 0.0
            v = V[1, 1]
            V[1, 1] = np.outer(v[:, 0], np.arange(1.0, v.shape[1] + 1))  # rank 1
    proj = os.path.join(wd, "degen.h5")
    calibrate(model, proj, cal, np_=2)
    _, rep = evaluate(model, proj, val, np_=2, extra=["--block-rows", "7"],
                      json_path=os.path.join(wd, "degen.json"))
    check(all(np.isfinite(x[k]) for m in METHODS for x in rep["methods"][m]["layers"]
              for k in METRICS), "degenerate heads: non-finite errors")
    matches_reference("degenerate heads", model, proj, val, rep)
    finish("eval_reference")


def eval_ranks():
    """The report does not depend on rank count or row blocking."""
    wd = workdir("eval_ranks")
    model, cal, val = split_sets(wd, "set", heads=4, kv_heads=2, dtype="bf16", seed=8,
                                 val_seqs=7, shards=(2, 3))
    proj = os.path.join(wd, "proj.h5")
    calibrate(model, proj, cal, np_=2)
    # One sequence cut into more blocks than ranks: some ranks' ranges lie
    # inside it, so three or more ranks' partial sums make up one sequence.
    _, one = synth(os.path.join(wd, "one"), layers=SIZES["layers"], head_dim=SIZES["head_dim"],
                   heads=4, kv_heads=2, dtype="bf16", seed=8, seqs=1, seq_len=40, min_seq_len=40,
                   shards=1, skip_seqs=8)
    _, a = evaluate(model, proj, one, np_=1, json_path=os.path.join(wd, "one1.json"))
    _, b = evaluate(model, proj, one, np_=7, extra=["--block-rows", "2"],
                    json_path=os.path.join(wd, "one7.json"))
    worst, where = compare(b, {m: a["methods"][m] for m in METHODS})
    check(worst <= 1e-12, f"one sequence over 7 ranks: {worst:.2e} at {where}")
    _, base = evaluate(model, proj, val, np_=1, json_path=os.path.join(wd, "np1.json"))
    for np_, block in ((2, 256), (3, 5), (4, 11), (7, 3), (1, 1)):
        _, rep = evaluate(model, proj, val, np_=np_, extra=["--block-rows", str(block)],
                          json_path=os.path.join(wd, f"np{np_}-b{block}.json"))
        worst, where = compare(rep, {m: base["methods"][m] for m in METHODS})
        check(worst <= 1e-12, f"np {np_}, --block-rows {block}: differs from np 1 by {worst:.2e} at {where}")
        print(f"np {np_} block {block}: {worst:.2e}", flush=True)
    finish("eval_ranks")


def eval_policies():
    """calibrate --ranks stores what the policy defines; evaluate re-chooses."""
    wd = workdir("eval_policies")
    model, cal, val = split_sets(wd, "set", heads=4, kv_heads=2, dtype="f32", seed=9, layers=3)
    L, d = 3, SIZES["head_dim"]
    for pol in ("budget:0.35", "fixed:5", "eps:0.2"):
        proj = os.path.join(wd, pol.replace(":", "-") + ".h5")
        p = calibrate(model, proj, cal, extra=["--ranks", pol])
        with h5py.File(proj, "r") as f:
            ap = f.attrs["rank_policy"]
            check((ap.decode() if isinstance(ap, bytes) else ap) == pol, f"{pol}: rank_policy attribute")
            eps = float(f.attrs["eps"])
            rk = {m: f[m]["rank_k"][...] for m in METHODS}
            rv = {m: f[m]["rank_v"][...] for m in METHODS}
            sk = {m: f[m]["sigma_k"][...] for m in METHODS}
            sv = {m: f[m]["sigma_v"][...] for m in METHODS}
            sK, sV = f["spectra/K"][...], f["spectra/V"][...]
        kind, val_ = pol.split(":")
        if kind == "budget":
            check(np.isnan(eps), f"{pol}: eps attribute should be NaN")
            for m in METHODS:
                used = int(rk[m].sum() + rv[m].sum())
                check(used <= float(val_) * 2 * d * L + 1e-9, f"{pol} {m}: {used} columns")
                # Optimal: no single column moved between layers lowers the tail energy.
                def tail(s, r):
                    return float(np.mean([(x[r:] ** 2).sum() / max((x ** 2).sum(), 1e-300) for x in s]))
                sides = [(sk[m][l], rk[m][l]) for l in range(L)] + [(sv[m][l], rv[m][l]) for l in range(L)]
                best = sum(tail(s, r) for s, r in sides)
                for i, (si, ri) in enumerate(sides):
                    for j, (sj, rj) in enumerate(sides):
                        if i != j and ri > 1 and rj < d:
                            alt = best - tail(si, ri) - tail(sj, rj) + tail(si, ri - 1) + tail(sj, rj + 1)
                            check(alt >= best - 1e-12, f"{pol} {m}: moving a column {i}->{j} helps")
            check(len({tuple(rk[m]) + tuple(rv[m]) for m in METHODS}) > 1,
                  f"{pol}: every method got the same ranks, not its own")
        elif kind == "fixed":
            for m in METHODS:
                check((rk[m] == int(val_)).all() and (rv[m] == int(val_)).all(), f"{pol} {m}")
        else:
            check(abs(eps - 0.2) < 1e-15, f"{pol}: eps attribute")
            for l in range(L):
                for m in METHODS:
                    check(rk[m][l] == rank_rule(sK[l], 0.2) and rv[m][l] == rank_rule(sV[l], 0.2),
                          f"{pol} layer {l} {m}")
        check(pol in p.stdout, f"{pol}: calibrate's summary does not name the policy")
        # evaluate without --ranks uses the stored ones ...
        _, rep = evaluate(model, proj, val, json_path=proj + ".json")
        for m in METHODS:
            check(report_ranks(rep)[m] == list(zip(rk[m].tolist(), rv[m].tolist())), f"{pol}: stored ranks")
        check(rep["rank_policy"] == pol, f"{pol}: report rank_policy")
    # ... and --ranks on any projections gives the same as calibrating with it.
    _, a = evaluate(model, os.path.join(wd, "fixed-5.h5"), val, extra=["--ranks", "budget:0.35"],
                    json_path=os.path.join(wd, "re.json"))
    with h5py.File(os.path.join(wd, "budget-0.35.h5"), "r") as f:
        for m in METHODS:
            check(report_ranks(a)[m] == list(zip(f[m]["rank_k"][...].tolist(), f[m]["rank_v"][...].tolist())),
                  f"evaluate --ranks budget:0.35 vs calibrate's, {m}")
    finish("eval_policies")


def eval_bad_input():
    """One clear message, a non-zero exit and no report, for each mistake."""
    wd = workdir("eval_bad_input")
    model, cal, val = split_sets(wd, "set", heads=4, kv_heads=2, dtype="bf16", seed=1)
    proj = os.path.join(wd, "proj.h5")
    calibrate(model, proj, cal)
    # Projections of a model with another head_dim.
    other = os.path.join(wd, "other-proj.h5")
    om, oc = synth(os.path.join(wd, "other"), layers=2, heads=4, kv_heads=2, head_dim=4, seqs=2,
                   seq_len=10, shards=1)
    calibrate(om, other, oc)
    nan = os.path.join(wd, "nan.h5")
    shutil.copy(val[0], nan)
    with h5py.File(nan, "r+") as f:
        q = f["queries"][...]
        q[1, 3, 5, 2] = 0x7fc0  # a bfloat16 NaN
        f["queries"][...] = q
    broken = os.path.join(wd, "broken.h5")
    shutil.copy(proj, broken)
    with h5py.File(broken, "r+") as f:
        del f["ksvd/value_up"]
    nanproj = os.path.join(wd, "nanproj.h5")
    shutil.copy(proj, nanproj)
    with h5py.File(nanproj, "r+") as f:
        f["eigen/key_down"][1, 0, 2, 3] = np.nan
    rep = os.path.join(wd, "report.json")
    cases = [
        ("projections of another shape", [], other, ["other-proj.h5", "head_dim"]),
        ("missing dataset", [], broken, ["broken.h5", "ksvd/value_up"]),
        ("NaN in the projections", [], nanproj, ["nanproj.h5", "eigen/key_down", "layer 1"]),
        ("NaN in a validation shard", [], None, ["nan.h5", "queries", "layer 1, head 3"]),
        ("fixed rank above d", ["--ranks", "fixed:9"], None, ["fixed:9", "head_dim"]),
        ("budget too small", ["--ranks", "budget:0.01"], None, ["budget:0.01"]),
        ("bad policy", ["--ranks", "best:3"], None, ["--ranks", "best:3"]),
        ("report over an input", ["--json", val[0]], None, ["is also an input"]),
        ("no shards", [], None, ["no validation cache shards"]),
        ("report into a missing folder", ["--json", os.path.join(wd, "nope", "r.json")], None,
         ["nope", "does not exist"]),
    ]
    for name, extra, proj_over, needles in cases:
        files = val if name != "NaN in a validation shard" else [nan]
        if name == "no shards":
            files = []
        args = ["evaluate", "--progress", "off", "--model", model, "--proj", proj_over or proj,
                "--json", rep] + extra + files
        p = run(args, np_=2, expect=1, timeout=60)
        err = p.stderr
        for n in needles:
            check(n in err, f"{name}: message lacks '{n}':\n{err}")
        check("kqsvd evaluate: error" in err, f"{name}: no error line:\n{err}")
        check("wrote" not in p.stdout or name == "report into a missing folder", f"{name}: {p.stdout}")
        left = [f for f in os.listdir(wd) if f.startswith("report.json")]
        check(not left, f"{name}: left {left} behind")
        print(f"{name}: {err.strip().splitlines()[0][:140]}", flush=True)
    # Reports: never over a device, a FIFO or a link to a device, nor in a
    # folder nobody may write to, --force or not; over a report only with it.
    ev = ["evaluate", "--progress", "off", "--model", model, "--proj", proj]
    inputs = [model, proj, *val]
    nodes = special_outputs(os.path.join(wd, "special"))
    ro = os.path.join(wd, "ro")
    os.makedirs(ro)
    os.chmod(ro, 0o555)
    for extra in ([], ["--force"]):
        for path in nodes:
            refused_output(f"--json {os.path.basename(path)} {' '.join(extra)}",
                           [*ev, "--json", path, *extra, *val], "--json", path, inputs,
                           "is not a regular file (a device, FIFO or socket)")
        in_ro = os.path.join(ro, "r.json")
        refused_output(f"--json in a mode-0555 folder {' '.join(extra)}",
                       [*ev, "--json", in_ro, *extra, *val], "--json", in_ro, inputs,
                       f"the folder {ro} is read-only (mode 0555)")
    for path, is_kind in nodes.items():
        check(is_kind(os.stat(path).st_mode), f"{path} is no longer what it was")
    os.chmod(ro, 0o755)
    with open(rep, "w") as f:
        f.write("an earlier report\n")
    refused_output("--json over a report", [*ev, "--json", rep, *val], "--json", rep, inputs,
                   "already exists; give --force to replace it")
    check(open(rep).read() == "an earlier report\n", "a report replaced without --force")
    p = run([*ev, "--json", rep, "--force", *val])
    check(f"wrote {rep}" in p.stdout and json.load(open(rep))["proj"] == proj,
          f"--json over a report with --force: {p.stdout[-300:]}")
    finish("eval_bad_input")


def eval_memory():
    """4096-token sequences within a small --mem-limit; memory independent of
    the number of sequences."""
    wd = workdir("eval_memory")
    o = dict(layers=1, heads=2, kv_heads=1, head_dim=16, seq_len=4096, min_seq_len=4096, seed=2)
    model, cal = synth(os.path.join(wd, "cal"), seqs=1, shards=1, **o)
    proj = os.path.join(wd, "proj.h5")
    calibrate(model, proj, cal)
    rss = {}
    for n in (1, 3):
        _, val = synth(os.path.join(wd, f"val{n}"), seqs=n, shards=1, skip_seqs=1, **o)
        # Each run in a fresh child so ru_maxrss is its own.
        code = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); "
                "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
        cmd = [sys.executable, "-c", code, os.environ["KQSVD"], "evaluate",
               "--progress", "off", "--mem-limit", "256", "--model", model, "--proj", proj] + val
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        check(p.returncode == 0, f"{n} sequences of 4096 tokens under --mem-limit 256: {p.stderr}")
        rss[n] = int(p.stdout.strip().splitlines()[-1]) / 1024.0
        print(f"{n} x 4096 tokens: peak RSS {rss[n]:.1f} MiB", flush=True)
    check(rss[3] <= rss[1] * 1.1 + 4, f"memory grows with the sequences: {rss}")
    check(rss[1] <= 256, f"peak RSS {rss[1]:.0f} MiB exceeds --mem-limit 256")
    # One head's full T x T scores alone would take 128 MiB.
    check(rss[1] < 4096 * 4096 * 8 / 2**20, f"peak RSS {rss[1]:.0f} MiB: a T x T buffer?")
    # A limit that the default blocks exceed: smaller blocks, unless they were given.
    p = run(["evaluate", "--progress", "lines", "--mem-limit", "68", "--model", model, "--proj",
             proj] + val)
    rows = re.search(r"units of (\d+) query rows", p.stderr)
    check(rows and int(rows.group(1)) < 256, f"--mem-limit 68 kept blocks of {rows and rows.group(1)} rows")
    p = run(["evaluate", "--progress", "off", "--mem-limit", "68", "--block-rows", "4096", "--model",
             model, "--proj", proj] + val, expect=1)
    check("--mem-limit 68" in p.stderr and "--block-rows" in p.stderr, f"fixed blocks over the limit: {p.stderr}")
    finish("eval_memory")


def png_size(path):
    """(width, height) of a PNG file, or None when it is not one."""
    with open(path, "rb") as f:
        head = f.read(24)
    if head[:8] != b"\x89PNG\r\n\x1a\n" or head[12:16] != b"IHDR":
        return None
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


def figures():
    """examples/sweep_beta.sh and examples/plot_reports.py: one report per
    beta, invariance of kqsvd and ksvd to beta, and the PNG figures."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("figures: SKIPPED, no matplotlib (Debian: python3-matplotlib)")
        raise SystemExit(77)
    wd = workdir("figures")
    model, cal, val = split_sets(wd, "set", heads=4, kv_heads=2, dtype="bf16", seed=12)
    here = os.path.dirname(os.path.abspath(__file__))
    script = os.path.join(here, "..", "..", "examples", "sweep_beta.sh")
    out = os.path.join(wd, "out")
    env = dict(os.environ, MPIEXEC=os.environ.get("KQSVD_MPIEXEC", "mpiexec"),
               MPIEXEC_FLAGS=os.environ.get("KQSVD_MPIEXEC_PREFLAGS", ""))
    p = subprocess.run(["sh", script, "--betas", "1,4", "--np", "2", "--model", model,
                        "--calib", " ".join(cal), "--valid", " ".join(val), "--out", out],
                       capture_output=True, text=True, env=env, timeout=300)
    check(p.returncode == 0, f"sweep_beta.sh failed:\n{p.stdout}\n{p.stderr}")
    reps = {}
    for b in (1, 4):
        with open(os.path.join(out, f"report-beta{b}.json")) as f:
            reps[b] = json.load(f)
        check(reps[b]["beta"] == b, f"report-beta{b}.json has beta {reps[b]['beta']}")
    for m in ("kqsvd", "ksvd"):
        check(reps[1]["methods"][m] == reps[4]["methods"][m], f"{m} changed with beta")
    check(reps[1]["methods"]["eigen"] != reps[4]["methods"]["eigen"], "eigen did not change with beta")
    # A failing evaluation fails the sweep, and leaves no report behind.
    other, ocal = synth(os.path.join(wd, "other"), layers=1, heads=2, kv_heads=1, head_dim=4,
                        seqs=2, seq_len=10, shards=1)
    p = subprocess.run(["sh", script, "--betas", "1", "--np", "1", "--model", model,
                        "--calib", " ".join(cal), "--valid", " ".join(ocal), "--out", out],
                       capture_output=True, text=True, env=env, timeout=300)
    check(p.returncode != 0, f"sweep_beta.sh exits 0 when evaluate fails:\n{p.stdout}\n{p.stderr}")
    check(not os.path.exists(os.path.join(out, "report-beta1.json")), "stale report-beta1.json kept")
    for name in ("figure1.png", "figure2.png"):
        size = png_size(os.path.join(out, name))
        check(size is not None and size[0] >= 600 and size[1] >= 400, f"{name}: {size}")
    # A file that is not a report gets one clear message.
    bad = os.path.join(wd, "bad.json")
    with open(bad, "w") as f:
        f.write('{"model": "x"}')
    plot = os.path.join(here, "..", "..", "examples", "plot_reports.py")
    p = subprocess.run([sys.executable, plot, bad, "--out", out], capture_output=True, text=True)
    check(p.returncode != 0 and "bad.json" in p.stderr and "not a kqsvd evaluation report" in p.stderr,
          f"plot_reports.py on a bad report: {p.returncode} {p.stderr}")
    finish("figures")
