"""Per-(layer, KV head) ranks in a projections file (docs/formats.md 5.3):
`kqsvd evaluate` cuts each KV head at its own ranks (against the brute-force
reference, on 1 and 3 ranks), `kqsvd ranks` lists them, per-head ranks equal
to the per-layer ones change nothing, `--ranks` ignores them, and each kind
of bad per-head data gets one message naming the file and dataset."""
import json
import os
import shutil

import h5py
import numpy as np

from eval_reference import METHODS, METRICS, compare, evaluate as ref_evaluate
from harness import calibrate, check, finish, run, workdir
from scenarios_eval import evaluate, matches_reference, split_sets

L, H, D = 3, 3, 8
POLICY = "quality-budget:0.5"


def varied_ranks(seed):
    """Varied [L, H] key and value ranks in 1..D, 1 and D among them, the
    heads of each layer not all equal."""
    rng = np.random.default_rng(seed)
    rk = rng.integers(1, D + 1, (L, H)).astype(np.int32)
    rv = rng.integers(1, D + 1, (L, H)).astype(np.int32)
    rk[0, :] = (1, D, 4)
    rv[1, :] = (D, 2, 1)
    rk[2, 0], rv[2, 2] = 1, D
    for r in (rk, rv):
        for l in range(L):
            if len(set(r[l])) == 1:
                r[l, 0] = 1 if r[l, 0] > 1 else D
    return rk, rv


def write_heads(src, dst, heads, policy=POLICY):
    """Copies src to dst with heads[m] = (rank_k_heads, rank_v_heads) for the
    methods in heads, each layer's rank_k/rank_v set to its heads' maximum."""
    shutil.copy(src, dst)
    with h5py.File(dst, "r+") as f:
        for m, (rk, rv) in heads.items():
            f[m]["rank_k_heads"] = rk
            f[m]["rank_v_heads"] = rv
            f[m]["rank_k"][...] = rk.max(axis=1)
            f[m]["rank_v"][...] = rv.max(axis=1)
        f.attrs["rank_policy"] = policy


def ranks_json(proj, extra=()):
    p = run(["ranks", "--proj", proj, "--json", *extra])
    check(p.stderr == "", f"ranks {proj}: stderr {p.stderr!r}")
    return json.loads(p.stdout)


def check_report_heads(name, rep, heads, stored):
    """The report lists each method's per-head ranks (and rank_k/rank_v as
    their maximum) where the file has them, and no lists elsewhere."""
    check(rep["rank_policy"] == POLICY, f"{name}: rank_policy {rep['rank_policy']}")
    for m in METHODS:
        for l, x in enumerate(rep["methods"][m]["layers"]):
            if m in heads:
                rk, rv = heads[m]
                check(x.get("rank_k_heads") == rk[l].tolist() and
                      x.get("rank_v_heads") == rv[l].tolist(), f"{name} {m} layer {l}: {x}")
                check((x["rank_k"], x["rank_v"]) == (int(rk[l].max()), int(rv[l].max())),
                      f"{name} {m} layer {l}: rank_k/rank_v {x['rank_k']}/{x['rank_v']}")
            else:
                check("rank_k_heads" not in x and "rank_v_heads" not in x,
                      f"{name} {m} layer {l}: per-head ranks listed for a method without them")
                check((x["rank_k"], x["rank_v"]) == stored[m][l], f"{name} {m} layer {l}: ranks")


def check_ranks_cmd(proj, base, heads, wd):
    """kqsvd ranks on a per-head file: the lists, cache_kept from the heads,
    the table; with --ranks, the same as on the file without them."""
    out = ranks_json(proj)
    check(out["policy"] == POLICY, f"ranks --json: policy {out['policy']}")
    for m in METHODS:
        got = out["methods"][m]
        if m in heads:
            rk, rv = heads[m]
            check(list(got) == ["rank_k", "rank_v", "rank_k_heads", "rank_v_heads"],
                  f"ranks --json {m}: keys {list(got)}")
            check(got["rank_k_heads"] == rk.tolist() and got["rank_v_heads"] == rv.tolist(),
                  f"ranks --json {m}: heads {got}")
            check(got["rank_k"] == rk.max(1).tolist() and got["rank_v"] == rv.max(1).tolist(),
                  f"ranks --json {m}: per-layer ranks are not the heads' maximum: {got}")
            kept = (int(rk.sum()) + int(rv.sum())) / (2 * D * L * H)
        else:
            check(list(got) == ["rank_k", "rank_v"], f"ranks --json {m}: keys {list(got)}")
            kept = (sum(got["rank_k"]) + sum(got["rank_v"])) / (2 * D * L)
        check(out["cache_kept"][m] == kept, f"ranks --json {m}: cache_kept {out['cache_kept'][m]} "
              f"vs {kept}")
        print(f"ranks --json {m}: cache_kept {out['cache_kept'][m]}", flush=True)
    # Any integer type is read alike (as rank_k): int64, as numpy writes them.
    wide = os.path.join(wd, "heads-int64.h5")
    write_heads(base, wide, {m: (rk.astype(np.int64), rv.astype(np.int64))
                             for m, (rk, rv) in heads.items()})
    w = ranks_json(wide)
    check(w["methods"] == out["methods"] and w["cache_kept"] == out["cache_kept"],
          "int64 per-head ranks read differently from int32")
    # --ranks: the policy's per-layer ranks, as for the file without heads.
    for pol in ("fixed:3", "budget:0.4"):
        a, b = ranks_json(proj, ["--ranks", pol]), ranks_json(base, ["--ranks", pol])
        a.pop("proj"), b.pop("proj")
        check(a == b, f"ranks --ranks {pol}: differs from the file without per-head ranks")
    # The table: a block per method, each layer's heads as "a,b,c".
    p = run(["ranks", "--proj", proj])
    print(p.stdout, flush=True)
    lines = p.stdout.splitlines()
    check(POLICY in lines[0] and "per KV head" in lines[0], f"table header: {lines[0]}")
    for i, m in enumerate(METHODS):
        block = lines[1 + i * (L + 2):1 + (i + 1) * (L + 2)]
        check(block[0].startswith(f"{m}: {'per KV head' if m in heads else 'per layer'}, kept "),
              f"table {m}: {block[0]}")
        for l in range(L):
            cells = block[2 + l].split()
            want = ([str(l)] + [",".join(map(str, r[l])) for r in heads[m]] if m in heads else
                    [str(l), str(out["methods"][m]["rank_k"][l]),
                     str(out["methods"][m]["rank_v"][l])])
            check(cells == want, f"table {m} layer {l}: {cells} vs {want}")


def bad_cases(base, wd):
    """(name, file, what the message must name) for each kind of bad
    per-head data; each file is otherwise a valid per-head file."""
    rk, rv = varied_ranks(11)
    cases = []

    def case(name, edit, needles):
        path = os.path.join(wd, name.replace(" ", "-").replace("'", "") + ".h5")
        write_heads(base, path, {"kqsvd": (rk, rv), "eigen": (rk, rv)})
        with h5py.File(path, "r+") as f:
            edit(f)
        cases.append((name, path, [os.path.basename(path)] + needles))

    def replace(name, value):
        def edit(f):
            del f[name]
            f[name] = value
        return edit

    case("wrong shape", replace("eigen/rank_k_heads", np.ones((L, H + 1), np.int32)),
         ["eigen/rank_k_heads", "dimension 1"])
    case("one dimension", replace("kqsvd/rank_v_heads", rv.max(1)), ["kqsvd/rank_v_heads",
                                                                     "dimensions"])
    zero, high = rk.copy(), rv.copy()
    zero[1, 2], high[2, 1] = 0, D + 1
    case("rank 0", replace("kqsvd/rank_k_heads", zero), ["kqsvd/rank_k_heads", "layer 1",
                                                         "KV head 2", "outside"])
    case("rank above d", replace("eigen/rank_v_heads", high), ["eigen/rank_v_heads", "layer 2",
                                                               "KV head 1", "head_dim = 8"])
    case("only rank_k_heads", lambda f: f.__delitem__("eigen/rank_v_heads"),
         ["eigen/rank_v_heads", "missing"])
    case("only rank_v_heads", lambda f: f.__delitem__("kqsvd/rank_k_heads"),
         ["kqsvd/rank_k_heads", "missing"])
    below = rk.max(1)
    below[0] -= 1  # a reader of rank_k alone would drop columns head 1 uses

    def above(f):  # more than any head of layer 2 keeps
        v = rv.copy()
        v[2] = (2, 3, 2)
        f["eigen/rank_v_heads"][...] = v
        f["eigen/rank_v"][2] = 5

    case("per-layer rank below the heads' maximum", replace("kqsvd/rank_k", below),
         ["kqsvd/rank_k", "kqsvd/rank_k_heads", "layer 0", "is 8"])
    case("per-layer rank above the heads' maximum", above,
         ["eigen/rank_v", "eigen/rank_v_heads", "layer 2", "rank 5", "is 3"])
    case("float ranks", replace("kqsvd/rank_k_heads", rk.astype(np.float64)),
         ["kqsvd/rank_k_heads", "integers"])
    return cases


def check_bad_input(model, base, val, wd):
    rep = os.path.join(wd, "bad-report.json")
    for name, path, needles in bad_cases(base, wd):
        p = run(["ranks", "--proj", path, "--json"], expect=None)
        check(p.returncode == 1, f"ranks, {name}: exit {p.returncode}: {p.stderr}")
        check(p.stdout == "", f"ranks, {name}: printed {p.stdout!r}")
        check(p.stderr.startswith("kqsvd ranks: error: ") and len(p.stderr.splitlines()) == 1,
              f"ranks, {name}: not one error line: {p.stderr!r}")
        p2 = run(["evaluate", "--progress", "off", "--model", model, "--proj", path, "--json", rep]
                 + val, np_=2, expect=None, timeout=120)
        check(p2.returncode == 1, f"evaluate, {name}: exit {p2.returncode}: {p2.stderr}")
        check("kqsvd evaluate: error" in p2.stderr, f"evaluate, {name}: no error line: {p2.stderr}")
        check(not os.path.exists(rep), f"evaluate, {name}: wrote a report")
        for n in needles:
            check(n in p.stderr, f"ranks, {name}: message lacks '{n}': {p.stderr}")
            check(n in p2.stderr, f"evaluate, {name}: message lacks '{n}': {p2.stderr}")
        print(f"{name}: {p.stderr.strip()[:160]}", flush=True)


def head_ranks():
    wd = workdir("head_ranks")
    model, cal, val = split_sets(wd, "set", layers=L, heads=6, kv_heads=H, dtype="bf16",
                                 causal=1, seed=21)
    base = os.path.join(wd, "proj.h5")
    calibrate(model, base, cal, np_=2)
    with h5py.File(base, "r") as f:
        stored = {m: list(zip(f[m]["rank_k"][...].tolist(), f[m]["rank_v"][...].tolist()))
                  for m in METHODS}

    # kqsvd and eigen with their own per-head ranks, ksvd per layer.
    heads = {"kqsvd": varied_ranks(1), "eigen": varied_ranks(2)}
    proj = os.path.join(wd, "heads.h5")
    write_heads(base, proj, heads)
    _, one = evaluate(model, proj, val, np_=1, json_path=os.path.join(wd, "heads-np1.json"))
    p, three = evaluate(model, proj, val, np_=3, extra=["--block-rows", "7"],
                        json_path=os.path.join(wd, "heads-np3.json"))
    check("ranks per KV head" in p.stdout, f"evaluate's table does not say so:\n{p.stdout}")
    for name, rep in (("np 1", one), ("np 3", three)):
        check_report_heads(name, rep, heads, stored)
        matches_reference(f"per-head ranks, {name}", model, proj, val, rep)
    worst, where = compare(three, {m: one["methods"][m] for m in METHODS})
    check(worst <= 1e-12, f"np 3 differs from np 1 by {worst:.2e} at {where}")
    # The heads' own ranks matter: at each layer's maximum the errors differ.
    at_max = ref_evaluate(model, proj, val, {m: [(x["rank_k"], x["rank_v"]) for x in
                                                 one["methods"][m]["layers"]] for m in METHODS})
    for m in heads:
        dev = max(abs(a[k] - b[k]) for a, b in zip(one["methods"][m]["layers"],
                                                   at_max[m]["layers"]) for k in METRICS)
        check(dev > 1e-6, f"{m}: per-head ranks give the errors of the per-layer maximum ({dev:.1e})")

    # Per-head ranks equal to the per-layer ones: exactly the same errors.
    flat = {m: (np.repeat(np.array([r[0] for r in stored[m]], np.int32)[:, None], H, 1),
                np.repeat(np.array([r[1] for r in stored[m]], np.int32)[:, None], H, 1))
            for m in METHODS}
    same = os.path.join(wd, "same.h5")
    write_heads(base, same, flat)
    _, a = evaluate(model, same, val, np_=3, json_path=os.path.join(wd, "same.json"))
    _, b = evaluate(model, base, val, np_=3, json_path=os.path.join(wd, "base.json"))
    for m in METHODS:
        for x, y in zip(a["methods"][m]["layers"], b["methods"][m]["layers"]):
            check(x.get("rank_k_heads") == [x["rank_k"]] * H, f"same {m}: {x}")
            check(all(x[k] == y[k] for k in METRICS + ("rank_k", "rank_v")),
                  f"same {m} layer {x['layer']}: {x} vs {y}")
        check(a["methods"][m]["mean"] == b["methods"][m]["mean"], f"same {m}: means differ")
    check(all("rank_k_heads" not in x for m in METHODS for x in b["methods"][m]["layers"]),
          "a file without per-head ranks reports them")

    # --ranks POLICY: the policy's per-layer ranks, per-head ranks ignored.
    for pol in ("fixed:3", "budget:0.4"):
        _, a = evaluate(model, proj, val, np_=2, extra=["--ranks", pol],
                        json_path=os.path.join(wd, f"heads-{pol}.json"))
        _, b = evaluate(model, base, val, np_=2, extra=["--ranks", pol],
                        json_path=os.path.join(wd, f"base-{pol}.json"))
        check(a["rank_policy"] == pol and a["methods"] == b["methods"],
              f"--ranks {pol}: differs from the file without per-head ranks")

    check_ranks_cmd(proj, base, heads, wd)
    check_bad_input(model, base, val, wd)
    finish("head_ranks")
