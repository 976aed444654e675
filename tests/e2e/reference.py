"""Independent float64 reference for kqsvd, written from docs/formats.md and the
paper only: it loads whole matrices and never forms an R factor.

Used by the end-to-end tests; also runnable by hand:
    python3 tests/e2e/reference.py MODEL.h5 PROJ.h5 SHARD...
"""
import sys

import h5py
import numpy as np


def to_f64(ds):
    """Dataset -> float64 array, decoding bfloat16 bit patterns exactly."""
    a = ds[...]
    if ds.attrs.get("dtype", None) in ("bfloat16", b"bfloat16"):
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64)


def load_set(shards):
    """Concatenates keys/values/queries of all shards along T (float64)."""
    K, V, Q = [], [], []
    for path in shards:
        with h5py.File(path, "r") as f:
            K.append(to_f64(f["keys"]))
            V.append(to_f64(f["values"]))
            Q.append(to_f64(f["queries"]))
    return np.concatenate(K, 2), np.concatenate(V, 2), np.concatenate(Q, 2)


def load_oproj(model):
    with h5py.File(model, "r") as f:
        return to_f64(f["o_proj"])


def group_mats(K, V, Q, O, l, g):
    """K (T x d), stacked group queries (mT x d), V, and W = [W^O_h ...] (d x mD)."""
    Hkv, Hq, d = K.shape[1], Q.shape[1], K.shape[3]
    m = Hq // Hkv
    heads = range(g * m, (g + 1) * m)
    Qs = np.concatenate([Q[l, h] for h in heads], 0)
    W = np.concatenate([O[l][:, h * d:(h + 1) * d].T for h in heads], 1)
    return K[l, g], Qs, V[l, g], W


def svals(M):
    return np.linalg.svd(M, compute_uv=False)


def top_right(M, d):
    _, _, vt = np.linalg.svd(M, full_matrices=False)
    return vt.T[:, :d]


def kq_error(K, Q, A, B, r):
    """||K A_r B_r^T Q^T - K Q^T||_F^2 / ||K Q^T||_F^2 (via d x d Gram matrices)."""
    P = A[:, :r] @ B[:, :r].T
    GK, GQ = K.T @ K, Q.T @ Q
    E = P - np.eye(P.shape[0])
    err = np.trace(E.T @ GK @ E @ GQ)
    tot = np.trace(GK @ GQ)
    return err / tot if tot > 0 else 0.0


def rank_rule(sig, eps):
    """sig: [Hkv, d]. Smallest r in [1, d] with mean retained fraction >= 1 - eps."""
    e = sig.astype(np.float64) ** 2
    tot = e.sum(1)
    frac = np.where(tot[:, None] > 0, np.cumsum(e, 1) / np.where(tot > 0, tot, 1)[:, None], 1.0)
    mean = frac.mean(0)
    for r in range(1, e.shape[1] + 1):
        if mean[r - 1] >= 1 - eps:
            return r
    return e.shape[1]


def main():
    model, proj, shards = sys.argv[1], sys.argv[2], sys.argv[3:]
    K, V, Q = load_set(shards)
    O = load_oproj(model)
    worst = 0.0
    with h5py.File(proj, "r") as p:
        eps = float(p.attrs["eps"])
        L, Hkv, d = K.shape[0], K.shape[1], K.shape[3]
        for l in range(L):
            sk = np.array([svals(K[l, g]) for g in range(Hkv)])
            sv = np.array([svals(V[l, g]) for g in range(Hkv)])
            rk, rv = rank_rule(sk, eps), rank_rule(sv, eps)
            for meth in ("kqsvd", "ksvd", "eigen"):
                assert p[meth]["rank_k"][l] == rk and p[meth]["rank_v"][l] == rv, (meth, l)
            for g in range(Hkv):
                k, q, v, w = group_mats(K, V, Q, O, l, g)
                kq = svals(k @ q.T)[:d]
                tail = (kq[rk:] ** 2).sum() / (kq ** 2).sum()
                A = p["kqsvd/key_down"][l, g]
                B = p["kqsvd/query_down"][l, g]
                e = kq_error(k, q, A, B, rk)
                worst = max(worst, abs(e - tail) / tail)
                print(f"layer {l} head {g}: rank {rk} kqsvd err {e:.6e} tail {tail:.6e} "
                      f"ksvd {kq_error(k, q, p['ksvd/key_down'][l, g], p['ksvd/query_down'][l, g], rk):.6e} "
                      f"eigen {kq_error(k, q, p['eigen/key_down'][l, g], p['eigen/query_down'][l, g], rk):.6e}")
    print("worst relative deviation of kqsvd error from tail energy:", worst)


if __name__ == "__main__":
    main()
