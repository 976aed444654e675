"""Brute-force float64 evaluation, written from docs/formats.md section 4 only:
whole T x T score matrices, softmax and the T x D layer output per sequence,
no R factors and no blocking.

Used by the end-to-end tests; also runnable by hand to check a report:
    python3 tests/e2e/eval_reference.py MODEL.h5 PROJ.h5 REPORT.json SHARD...
"""
import json
import sys

import h5py
import numpy as np

from reference import load_oproj, to_f64

METHODS = ("kqsvd", "ksvd", "eigen")
METRICS = ("err_k", "err_q", "err_v", "err_kq", "err_out")


def sequences(shards):
    """Yields (K [L,Hkv,T,d], V, Q [L,Hq,T,d], causal) per sequence."""
    for path in shards:
        with h5py.File(path, "r") as f:
            K, V, Q = to_f64(f["keys"]), to_f64(f["values"]), to_f64(f["queries"])
            causal = int(f.attrs["causal"])
            off = 0
            for n in f["seq_lens"][...]:
                n = int(n)
                yield K[:, :, off:off + n], V[:, :, off:off + n], Q[:, :, off:off + n], causal
                off += n


def softmax_rows(S, causal):
    if causal:
        T = S.shape[0]
        S = np.where(np.tril(np.ones((T, T), dtype=bool)), S, -np.inf)
    S = S - S.max(1, keepdims=True)
    P = np.exp(S)
    return P / P.sum(1, keepdims=True)


def rel(num, den):
    if den > 0:
        return num / den
    return 1.0 if num > 0 else 0.0


def head_rank(r, g):
    """Rank of KV head g: r is the layer's rank, or a list with one per KV head."""
    return int(r) if np.ndim(r) == 0 else int(r[g])


def layer_errors(K, V, Q, O, proj, l, ranks, causal):
    """Errors of one sequence in layer l: {method: {metric: value}}.  ranks:
    {method: (rank_k, rank_v)}, each an int or a list of one per KV head."""
    Hkv, d = K.shape[1], K.shape[3]
    Hq = Q.shape[1]
    m = Hq // Hkv
    out = {}
    den = dict.fromkeys(METRICS, 0.0)
    exact = 0.0
    for h in range(Hq):
        g = h // m
        Wh = O[l][:, h * d:(h + 1) * d].T  # d x D
        P = softmax_rows(Q[l, h] @ K[l, g].T / np.sqrt(d), causal)
        exact = exact + P @ V[l, g] @ Wh
        den["err_q"] += (Q[l, h] ** 2).sum()
        den["err_kq"] += ((Q[l, h] @ K[l, g].T) ** 2).sum()
    for g in range(Hkv):
        den["err_k"] += (K[l, g] ** 2).sum()
        den["err_v"] += (V[l, g] ** 2).sum()
    den["err_out"] = (exact ** 2).sum()
    for meth in METHODS:
        num = dict.fromkeys(METRICS, 0.0)
        approx = 0.0
        for g in range(Hkv):
            rk, rv = (head_rank(r, g) for r in ranks[meth])
            A = proj[meth]["key_down"][l, g][:, :rk]
            B = proj[meth]["query_down"][l, g][:, :rk]
            Av = proj[meth]["value_down"][l, g][:, :rv]
            Bv = proj[meth]["value_up"][l, g][:, :rv]
            num["err_k"] += ((K[l, g] - K[l, g] @ A @ B.T) ** 2).sum()
            num["err_v"] += ((V[l, g] - V[l, g] @ Av @ Bv.T) ** 2).sum()
            for h in range(g * m, (g + 1) * m):
                Wh = O[l][:, h * d:(h + 1) * d].T
                num["err_q"] += ((Q[l, h] - Q[l, h] @ B @ A.T) ** 2).sum()
                S = Q[l, h] @ K[l, g].T
                St = (Q[l, h] @ B) @ (K[l, g] @ A).T
                num["err_kq"] += ((S - St) ** 2).sum()
                P = softmax_rows(St / np.sqrt(d), causal)
                approx = approx + P @ (V[l, g] @ Av) @ (Bv.T @ Wh)
        num["err_out"] = ((exact - approx) ** 2).sum()
        out[meth] = {k: rel(num[k], den[k]) for k in METRICS}
    return out


def load_proj_mats(path):
    with h5py.File(path, "r") as f:
        return {m: {k: f[m][k][...] for k in ("key_down", "query_down", "value_down", "value_up")}
                for m in METHODS}


def evaluate(model, proj_path, shards, ranks, errors=None):
    """ranks: {method: [(rank_k, rank_v) per layer]}, each an int or a list
    of one per KV head (per-head ranks, docs/formats.md 5.3).  errors: the
    per-sequence errors of a layer, as layer_errors [layer_errors].  Returns
    {method: {"layers": [{metric: value}], "mean": {metric: value}}}."""
    errors = errors or layer_errors
    O = load_oproj(model)
    proj = load_proj_mats(proj_path)
    L = O.shape[0]
    sums = {m: [dict.fromkeys(METRICS, 0.0) for _ in range(L)] for m in METHODS}
    nseq = 0
    for K, V, Q, causal in sequences(shards):
        nseq += 1
        for l in range(L):
            e = errors(K, V, Q, O, proj, l, {m: ranks[m][l] for m in METHODS}, causal)
            for m in METHODS:
                for k in METRICS:
                    sums[m][l][k] += e[m][k]
    res = {}
    for m in METHODS:
        layers = [{k: s[k] / nseq for k in METRICS} for s in sums[m]]
        res[m] = {"layers": layers,
                  "mean": {k: sum(x[k] for x in layers) / L for k in METRICS}}
    return res


def report_ranks(report):
    """{method: [(rank_k, rank_v) per layer]} as the report evaluated them:
    the lists rank_k_heads / rank_v_heads where it has them, else ints."""
    return {m: [(x.get("rank_k_heads", x["rank_k"]), x.get("rank_v_heads", x["rank_v"]))
                for x in report["methods"][m]["layers"]]
            for m in METHODS}


def compare(report, ref):
    """Largest relative deviation of a report from the reference, and where."""
    worst, where = 0.0, None
    for m in METHODS:
        rows = report["methods"][m]["layers"] + [report["methods"][m]["mean"]]
        refs = ref[m]["layers"] + [ref[m]["mean"]]
        for i, (a, b) in enumerate(zip(rows, refs)):
            for k in METRICS:
                dev = abs(a[k] - b[k]) / max(abs(b[k]), 1e-300)
                if abs(a[k] - b[k]) > 1e-25 and dev > worst:
                    worst, where = dev, (m, i, k)
    return worst, where


def main():
    model, proj, report_path, shards = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
    with open(report_path) as f:
        report = json.load(f)
    ref = evaluate(model, proj, shards, report_ranks(report))
    worst, where = compare(report, ref)
    for m in METHODS:
        print(m, " ".join(f"{k} {ref[m]['mean'][k]:.6e}" for k in METRICS))
    print(f"largest relative deviation of the report: {worst:.3e} at {where}")
    return 0 if worst <= 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
