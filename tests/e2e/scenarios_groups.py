"""Head-group latents from the command line: `kqsvd calibrate --head-groups G`
against an independent reference built here from the shards (keys of the
group side by side, queries and W^O block-diagonal), on 1 and 3 ranks."""
import os

import h5py
import numpy as np

import json

from eval_reference import METHODS, METRICS, compare, evaluate, rel, softmax_rows
from harness import calibrate, check, finish, load_proj, max_rel_diff, run, small_set
from reference import group_mats, load_oproj, load_set, svals
from scenarios_math import explicit_err, ref_projections

SET = dict(layers=2, heads=8, kv_heads=4, head_dim=8, seqs=7, seq_len=60, dtype="bf16", seed=11)


def block_diag(*blocks):
    return np.block([[b if i == j else np.zeros((b.shape[0], c.shape[1]))
                      for j, c in enumerate(blocks)] for i, b in enumerate(blocks)])


def joint_mats(K, V, Q, O, l, g0, G):
    """K_G, Q_bd, V_G and W_bd of the KV heads g0 .. g0+G-1 of layer l."""
    parts = [group_mats(K, V, Q, O, l, g) for g in range(g0, g0 + G)]
    return (np.hstack([p[0] for p in parts]), block_diag(*[p[1] for p in parts]),
            np.hstack([p[2] for p in parts]), block_diag(*[p[3] for p in parts]))


def subspace_gap(A, B, r):
    """Largest difference of the projectors on the first r columns of A and B."""
    P = [np.linalg.svd(M[:, :r], full_matrices=False)[0] for M in (A, B)]
    return float(np.abs(P[0] @ P[0].T - P[1] @ P[1].T).max())


def grouped_errors(K, V, Q, O, proj, l, ranks, causal):
    """docs/formats.md section 4 for a head-groups file (proj: its matrices
    as eval_reference.load_proj_mats reads them), one sequence, layer l,
    ranks {method: (r, r)}: query head h of KV head j scores q_h B_j (K_G A)^T, B_j the d
    rows of B for head j, and reads its values as (V_G A_v)(B_v,j^T W^O_h);
    err_q is that of the padded queries (Q_bd)."""
    Hkv, d, Hq = K.shape[1], K.shape[3], Q.shape[1]
    m, G = Hq // Hkv, proj["kqsvd"]["key_down"].shape[-1] // K.shape[3]
    den = dict.fromkeys(METRICS, 0.0)
    exact = 0.0
    for h in range(Hq):
        Wh = O[l][:, h * d:(h + 1) * d].T
        exact = exact + softmax_rows(Q[l, h] @ K[l, h // m].T / np.sqrt(d), causal) @ V[l, h // m] @ Wh
        den["err_q"] += (Q[l, h] ** 2).sum()
        den["err_kq"] += ((Q[l, h] @ K[l, h // m].T) ** 2).sum()
    den["err_k"], den["err_v"] = (K[l] ** 2).sum(), (V[l] ** 2).sum()
    den["err_out"] = (exact ** 2).sum()
    out = {}
    for meth in METHODS:
        num = dict.fromkeys(METRICS, 0.0)
        approx = 0.0
        for gi in range(Hkv // G):
            r = ranks[meth][0]
            A, B, Av, Bv = (proj[meth][x][l, gi][:, :r] for x in
                            ("key_down", "query_down", "value_down", "value_up"))
            KG = np.hstack([K[l, j] for j in range(gi * G, gi * G + G)])
            VG = np.hstack([V[l, j] for j in range(gi * G, gi * G + G)])
            num["err_k"] += ((KG - KG @ A @ B.T) ** 2).sum()
            num["err_v"] += ((VG - VG @ Av @ Bv.T) ** 2).sum()
            for b in range(G):
                j, rows = gi * G + b, slice(b * d, (b + 1) * d)
                for h in range(j * m, (j + 1) * m):
                    Wh = O[l][:, h * d:(h + 1) * d].T
                    qp = np.zeros((Q.shape[2], G * d))
                    qp[:, rows] = Q[l, h]
                    num["err_q"] += ((qp - qp @ B @ A.T) ** 2).sum()
                    St = (Q[l, h] @ B[rows]) @ (KG @ A).T
                    num["err_kq"] += ((Q[l, h] @ K[l, j].T - St) ** 2).sum()
                    approx = approx + softmax_rows(St / np.sqrt(d), causal) @ (VG @ Av) @ (Bv[rows].T @ Wh)
        num["err_out"] = ((exact - approx) ** 2).sum()
        out[meth] = {k: rel(num[k], den[k]) for k in METRICS}
    return out


def check_evaluate(wd, model, proj, shards, G, r):
    """kqsvd evaluate on a head-groups file against grouped_errors."""
    report = os.path.join(wd, f"eval-g{G}.json")
    run(["evaluate", "--progress", "off", "--model", model, "--proj", proj, "--json", report,
         *shards], np_=2)
    with open(report) as f:
        rep = json.load(f)
    check(rep.get("head_groups") == G, f"report head_groups {rep.get('head_groups')}")
    L = load_oproj(model).shape[0]
    ref = evaluate(model, proj, shards, {m: [(r, r)] * L for m in METHODS}, grouped_errors)
    worst, where = compare(rep, ref)
    check(worst < 1e-8, f"evaluate G={G} vs the reference: {worst:.2e} at {where}")
    return worst


def head_groups():
    wd, model, shards = small_set("head_groups", shards=3, uneven=True, **SET)
    K, V, Q = load_set(shards)
    O = load_oproj(model)
    L, Hkv, T, d = K.shape
    for G in (2, 4):
        n = G * d
        one, three = (os.path.join(wd, f"g{G}-np{p}.h5") for p in (1, 3))
        calibrate(model, one, shards, extra=["--head-groups", str(G), "--ranks", "fixed:3",
                                             "--beta", "1.5"])
        calibrate(model, three, shards, np_=3,
                  extra=["--head-groups", str(G), "--ranks", "fixed:3", "--beta", "1.5",
                         "--qr-block", "16", "--read-rows", "32"])
        p, p3 = load_proj(one), load_proj(three)
        with h5py.File(one, "r") as f:
            a = f.attrs
            check((a["head_groups"], a["num_kv_heads"], a["head_dim"], a["num_heads"]) ==
                  (G, Hkv // G, n, SET["heads"]), f"G={G}: group-view attributes {dict(a)}")
        diff = max_rel_diff(p, p3)[0]
        check(diff < 1e-9, f"G={G}: 1 vs 3 ranks (other blocks) differ by {diff:.2e}")
        worst = 0.0
        for l in range(L):
            for gi in range(Hkv // G):
                k, q, v, w = joint_mats(K, V, Q, O, l, gi * G, G)
                ref = ref_projections(k, q, v, w, 1.5)
                s_kq, s_vw = svals(k @ q.T)[:n], svals(v @ w)[:n]
                for name, s in {"K": svals(k), "V": svals(v), "KQt": s_kq, "VWo": s_vw}.items():
                    got = p[f"spectra/{name}"][l, gi]
                    worst = max(worst, float(np.abs(got - s).max() / s[0]))
                for r in (1, n // 4, n // 2, n - 1):
                    A, B = p["kqsvd/key_down"][l, gi], p["kqsvd/query_down"][l, gi]
                    tail = float((s_kq[r:] ** 2).sum() / (s_kq ** 2).sum())
                    worst = max(worst, abs(explicit_err(k, q, A, B, r) - tail))
                    Av, Bv = p["kqsvd/value_down"][l, gi], p["kqsvd/value_up"][l, gi]
                    tail = float((s_vw[r:] ** 2).sum() / (s_vw ** 2).sum())
                    worst = max(worst, abs(explicit_err(v, w.T, Av, Bv, r) - tail))
                r = n // 2  # a gap in these spectra: the subspaces are defined
                for m, (A, _, Av, _) in ref.items():
                    if m == "kqsvd":
                        continue
                    worst = max(worst, subspace_gap(p[f"{m}/key_down"][l, gi], A, r),
                                subspace_gap(p[f"{m}/value_down"][l, gi], Av, r))
        check(worst < 1e-6, f"G={G}: vs the independent reference {worst:.2e}")
        ev = check_evaluate(wd, model, one, shards, G, 3)
        lst = json.loads(run(["ranks", "--proj", one, "--ranks", "budget:0.25", "--json"]).stdout)
        kept = lst["cache_kept"]["kqsvd"]
        check(lst.get("head_groups") == G and lst["head_dim"] == n and abs(kept - 0.25) < 0.05,
              f"ranks of G={G}: {lst}")
        print(f"head groups G={G} ({n} wide): vs reference {worst:.2e}, 1 vs 3 ranks {diff:.2e}, "
              f"evaluate vs reference {ev:.2e}")
    # a killed grouped run resumes from its checkpoints, bit for bit
    ck, cut, whole = (os.path.join(wd, n) for n in ("ck", "cut.h5", "whole.h5"))
    opts = ["--head-groups", "2", "--ranks", "fixed:3", "--qr-block", "16", "--read-rows", "32"]
    calibrate(model, whole, shards, np_=2, extra=opts)
    calibrate(model, cut, shards, np_=2, expect=None,
              extra=opts + ["--checkpoint", ck, "--checkpoint-every", "0"],
              env={"KQSVD_TEST_KILL_AFTER_CHECKPOINTS": "3"})
    check(not os.path.exists(cut), "a killed run left its output")
    res = calibrate(model, cut, shards, np_=2, extra=opts + ["--checkpoint", ck,
                                                              "--progress", "lines"])
    check("resuming 2 of 2 ranks" in res.stderr + res.stdout, f"no resume: {res.stderr}")
    check(max_rel_diff(load_proj(cut), load_proj(whole))[0] == 0.0, "resumed run differs")
    # examples/inspect_proj.py reads the group view: its err_kq of each
    # layer is the group sums' over one shard
    import subprocess
    import sys
    ex = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples")
    g4 = os.path.join(wd, "g2-np1.h5")
    p = subprocess.run([sys.executable, os.path.join(ex, "inspect_proj.py"), model, g4, shards[0]],
                       capture_output=True, text=True)
    check(p.returncode == 0 and "head groups of 2" in p.stdout, f"inspect_proj.py: {p.stderr}")
    rows = [line.split() for line in p.stdout.splitlines() if line.split()[:1] in (["0"], ["1"])]
    K0, V0, Q0 = load_set(shards[:1])
    pg = load_proj(g4)
    for l, row in enumerate(rows):
        num = den = 0.0
        for gi in range(Hkv // 2):
            k, q, _, _ = joint_mats(K0, V0, Q0, O, l, gi * 2, 2)
            r = int(row[1])
            M = k @ q.T
            num += float(((k @ pg["kqsvd/key_down"][l, gi][:, :r] @
                           pg["kqsvd/query_down"][l, gi][:, :r].T @ q.T - M) ** 2).sum())
            den += float((M ** 2).sum())
        check(abs(float(row[4]) - num / den) <= 1e-4 * num / den,
              f"inspect_proj.py layer {l}: {row[4]} vs {num / den:.4e}")
    # never worse than per head at equal total rank, on the calibration set
    per = os.path.join(wd, "per-head.h5")
    calibrate(model, per, shards, extra=["--ranks", "fixed:3"])
    ph, pj = load_proj(per), load_proj(os.path.join(wd, "g4-np1.h5"))
    for l in range(L):
        k, q, _, _ = joint_mats(K, V, Q, O, l, 0, Hkv)
        for r in (1, 2, 4):
            A, B = (block_diag(*[ph[f"kqsvd/{x}"][l, g][:, :r] for g in range(Hkv)])
                    for x in ("key_down", "query_down"))
            e_head = explicit_err(k, q, A, B, Hkv * r)
            e_joint = explicit_err(k, q, pj["kqsvd/key_down"][l, 0], pj["kqsvd/query_down"][l, 0],
                                   Hkv * r)
            check(e_joint <= e_head * (1 + 1e-9), f"layer {l} rank {r}: joint {e_joint:.4e} "
                  f"above per head {e_head:.4e}")
    # bad options: one line naming the option, no output
    bad = os.path.join(wd, "bad.h5")
    for extra, words in ((["--head-groups", "3"], "does not divide the 4 KV heads"),
                         (["--head-groups", "0"], "--head-groups"),
                         (["--head-groups", "2", "--ranks", "fixed:17"], "17")):
        res = calibrate(model, bad, shards, extra=extra, expect=1)
        check(words in res.stderr and "Traceback" not in res.stderr,
              f"{extra}: message {res.stderr!r}")
        check(not os.path.exists(bad), f"{extra}: no output")
    finish("head_groups")
