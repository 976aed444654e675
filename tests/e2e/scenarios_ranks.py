"""`kqsvd ranks`: the ranks stored in a projections file, and those a rank
policy chooses from its stored spectra, the same as calibrate's and
evaluate's; its JSON, its table and its errors."""
import json
import os

import h5py

from eval_reference import METHODS, report_ranks
from harness import calibrate, check, finish, run, synth, workdir
from reference import rank_rule

POLICIES = ("eps:0.1", "fixed:7", "budget:0.3")
L, D = 3, 64


def ranks_json(proj, policy=None, np_=None):
    """Runs `kqsvd ranks --json` (under mpiexec when np_ is given)."""
    args = ["ranks", "--proj", proj, "--json"] + (["--ranks", policy] if policy else [])
    p = run(args, np_=np_)
    check(np_ or p.stderr == "", f"ranks {proj} {policy}: stderr {p.stderr!r}")
    return json.loads(p.stdout)


def stored(proj):
    """The stored ranks {method: (rank_k, rank_v)} and the rank_policy attribute."""
    with h5py.File(proj, "r") as f:
        pol = f.attrs["rank_policy"]
        ranks = {m: (f[m]["rank_k"][...].tolist(), f[m]["rank_v"][...].tolist()) for m in METHODS}
        spectra = f["spectra/K"][...], f["spectra/V"][...]
    return ranks, pol.decode() if isinstance(pol, bytes) else pol, spectra


def as_ranks(out):
    return {m: (out["methods"][m]["rank_k"], out["methods"][m]["rank_v"]) for m in METHODS}


def check_output(name, out, proj, policy):
    check(list(out) == ["proj", "policy", "num_layers", "num_kv_heads", "head_dim", "methods",
                        "cache_kept"], f"{name}: keys {list(out)}")
    check(out["proj"] == proj and out["policy"] == policy, f"{name}: proj/policy {out}")
    check((out["num_layers"], out["num_kv_heads"], out["head_dim"]) == (L, 2, D), f"{name}: sizes")
    check(list(out["methods"]) == list(METHODS) and list(out["cache_kept"]) == list(METHODS),
          f"{name}: methods")
    for m in METHODS:
        rk, rv = out["methods"][m]["rank_k"], out["methods"][m]["rank_v"]
        check(len(rk) == L and len(rv) == L and all(1 <= r <= D for r in rk + rv),
              f"{name} {m}: ranks {rk} {rv}")
        kept = sum(rk[l] + rv[l] for l in range(L)) / (2 * D * L)
        check(out["cache_kept"][m] == kept, f"{name} {m}: cache_kept {out['cache_kept'][m]} vs {kept}")


def evaluate_ranks(model, proj, val, wd, policy=None):
    """The ranks and policy of `kqsvd evaluate [--ranks POLICY] --json`."""
    rep = os.path.join(wd, "report.json")  # the last call's, replaced
    extra = ["--ranks", policy] if policy else []
    run(["evaluate", "--progress", "off", "--model", model, "--proj", proj, "--json", rep,
         "--force"] + extra + val, np_=2)
    with open(rep) as f:
        r = json.load(f)
    return {m: tuple(map(list, zip(*report_ranks(r)[m]))) for m in METHODS}, r["rank_policy"]


def check_errors(wd, proj, model):
    text = os.path.join(wd, "text.h5")
    with open(text, "w") as f:
        f.write("not HDF5\n")
    missing = os.path.join(wd, "missing.h5")
    cases = [  # name, arguments, exit status, what stderr names
        ("unknown policy", ["--proj", proj, "--ranks", "foo:1"], 2, ["--ranks", "foo:1"]),
        ("rank above d", ["--proj", proj, "--ranks", "fixed:100"], 2,
         ["--ranks", "fixed:100", "head_dim = 64"]),
        ("budget below a column a layer", ["--proj", proj, "--ranks", "budget:0.001"], 2,
         ["--ranks", "budget:0.001"]),
        ("no --proj", ["--json"], 2, ["--proj is required"]),
        ("a stray argument", ["--proj", proj, "--json", "out.json"], 2, ["out.json"]),
        ("unknown option", ["--proj", proj, "--bogus"], 2, ["--bogus"]),
        ("missing file", ["--proj", missing, "--json"], 1, [missing]),
        ("not HDF5", ["--proj", text, "--json"], 1, [text]),
        ("a model file", ["--proj", model, "--json"], 1, [model, "kqsvd_format"]),
    ]
    for name, args, code, needles in cases:
        p = run(["ranks"] + args, expect=None)
        check(p.returncode == code, f"{name}: exit {p.returncode}, expected {code}: {p.stderr}")
        check(p.stdout == "", f"{name}: printed {p.stdout!r}")
        check(p.stderr.startswith("kqsvd ranks: error: ") and len(p.stderr.splitlines()) == 1,
              f"{name}: not one error line: {p.stderr!r}")
        for n in needles:
            check(n in p.stderr, f"{name}: message lacks '{n}': {p.stderr}")
        print(f"{name}: exit {p.returncode}: {p.stderr.strip()[:140]}", flush=True)


def ranks_cmd():
    """kqsvd ranks against calibrate's stored ranks and evaluate's."""
    wd = workdir("ranks_cmd")
    o = dict(layers=L, heads=4, kv_heads=2, head_dim=D, seq_len=96, min_seq_len=40, seed=5,
             dtype="f32")
    model, cal = synth(os.path.join(wd, "cal"), seqs=8, shards=2, **o)
    _, val = synth(os.path.join(wd, "val"), seqs=3, shards=1, skip_seqs=8, **o)
    projs = {}
    for pol in POLICIES:
        projs[pol] = os.path.join(wd, pol.replace(":", "-") + ".h5")
        calibrate(model, projs[pol], cal, np_=2, extra=["--ranks", pol])
    saved = {pol: stored(projs[pol]) for pol in POLICIES}

    # Without --ranks: the stored ranks and policy.
    for pol in POLICIES:
        out = ranks_json(projs[pol])
        check_output(f"{pol} stored", out, projs[pol], saved[pol][1])
        check(saved[pol][1] == pol, f"{pol}: rank_policy attribute {saved[pol][1]}")
        check(as_ranks(out) == saved[pol][0], f"{pol}: ranks --json differs from the file: "
              f"{as_ranks(out)} vs {saved[pol][0]}")
    sK, sV = saved["eps:0.1"][2]
    check(all(saved["eps:0.1"][0][m] == ([rank_rule(sK[l], 0.1) for l in range(L)],
                                         [rank_rule(sV[l], 0.1) for l in range(L)])
              for m in METHODS), "eps:0.1: stored ranks are not the paper's rule")
    budget = saved["budget:0.3"][0]
    check(len({str(budget[m]) for m in METHODS}) > 1, f"budget:0.3: one set of ranks {budget}")

    # With --ranks, on any of the files: calibrate's ranks for that policy.
    for pol in POLICIES:
        for src in POLICIES:
            out = ranks_json(projs[src], pol)
            check_output(f"{src} --ranks {pol}", out, projs[src], pol)
            for m in METHODS:
                check(as_ranks(out)[m] == saved[pol][0][m],
                      f"ranks --proj {src} --ranks {pol}, {m}: {as_ranks(out)[m]} vs calibrate's "
                      f"{saved[pol][0][m]}")
        print(f"{pol}: {as_ranks(ranks_json(projs['eps:0.1'], pol))}", flush=True)
    # Under mpiexec: the same, printed once.
    check(ranks_json(projs["eps:0.1"], "budget:0.3", np_=2) == ranks_json(projs["eps:0.1"],
                                                                           "budget:0.3"),
          "np 2 differs from one process")

    # evaluate, with and without --ranks, reports the same ranks and policy.
    for pol in POLICIES:
        r, p = evaluate_ranks(model, projs["eps:0.1"], val, wd, pol)
        out = ranks_json(projs["eps:0.1"], pol)
        check(r == as_ranks(out) and p == out["policy"], f"evaluate --ranks {pol}: {r} {p}")
        r, p = evaluate_ranks(model, projs[pol], val, wd)
        out = ranks_json(projs[pol])
        check(r == as_ranks(out) and p == out["policy"], f"evaluate {pol} (stored): {r} {p}")

    # The table: the policy, d, and a row of ranks per layer.
    p = run(["ranks", "--proj", projs["eps:0.1"], "--ranks", "budget:0.3"])
    lines = p.stdout.splitlines()
    check("ranks budget:0.3" in lines[0] and "d = 64" in lines[0], f"table header: {lines[0]}")
    for l in range(L):
        row = [int(x) for x in lines[3 + l].split()]
        want = [l] + [x for m in METHODS for x in (budget[m][0][l], budget[m][1][l])]
        check(row == want, f"table row {l}: {row} vs {want}")
    kept = lines[3 + L].split()
    check(kept[0] == "kept" and all(abs(float(kept[1 + i]) - sum(map(sum, budget[m])) / (2 * D * L))
                                    < 1e-4 for i, m in enumerate(METHODS)), f"kept: {kept}")
    print(p.stdout, flush=True)

    # Help, both ways, and the command list.
    for args in (["help", "ranks"], ["ranks", "--help"]):
        p = run(args)
        check(p.stdout.startswith("usage: kqsvd ranks --proj PROJ.h5"), f"{args}: {p.stdout[:80]}")
    check("ranks " in run(["--help"]).stdout, "kqsvd --help does not list ranks")

    check_errors(wd, projs["eps:0.1"], model)
    finish("ranks_cmd")
