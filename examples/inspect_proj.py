#!/usr/bin/env python3
"""Compares the three methods of a projections file on one cache shard.

    python3 examples/inspect_proj.py MODEL.h5 PROJ.h5 SHARD.h5

For every layer, at the ranks stored in PROJ.h5, prints the relative squared
Frobenius errors of the attention scores K Q^T and of the value/output
products V W^O (all heads of the layer together): the two quantities KQ-SVD
minimises.  On calibration data kqsvd's columns are never worse; on other
shards they show how well the projections generalise.
"""
import os
import sys

from _python import rerun_elsewhere

# The kqsvd package of this repository decodes the contract's element types.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.realpath(__file__)), "..", "python"))

try:
    import h5py  # noqa: F401 (open_file's: a missing one is said here, in one line)
    import numpy as np
    from kqsvd.errors import KqsvdError
    from kqsvd.formats.h5io import open_file
    from kqsvd.formats.h5io import read as f64
except ImportError as e:
    rerun_elsewhere(__file__)
    raise SystemExit(f"inspect_proj.py: needs numpy and h5py ({e}); Debian: apt-get install "
                     "python3-numpy python3-h5py")

METHODS = ("kqsvd", "ksvd", "eigen")


def rel_err(G_left, G_right, A, B):
    """||X A B^T Y^T - X Y^T||^2 and ||X Y^T||^2 from the Grams X^T X, Y^T Y."""
    E = A @ B.T - np.eye(A.shape[0])
    return np.trace(E.T @ G_left @ E @ G_right), np.trace(G_left @ G_right)


def blockdiag(mats):
    out = np.zeros((sum(x.shape[0] for x in mats), sum(x.shape[1] for x in mats)))
    i = j = 0
    for x in mats:
        out[i:i + x.shape[0], j:j + x.shape[1]] = x
        i, j = i + x.shape[0], j + x.shape[1]
    return out


def main(model, proj, shard):
    try:  # each checked as the package's readers check it: a FIFO would block forever
        files = [open_file(path, kind) for path, kind in
                 ((shard, "cache"), (model, "model"), (proj, "projections"))]
    except KqsvdError as e:
        raise SystemExit(f"inspect_proj.py: {e}") from None
    with files[0] as s, files[1] as m, files[2] as p:
        K, V, Q, O = f64(s["keys"]), f64(s["values"]), f64(s["queries"]), f64(m["o_proj"])
        L, Hkv, T, d = K.shape
        g = Q.shape[1] // Hkv
        # A head-groups file (docs/formats.md 5.3) solves G KV heads as one:
        # their keys side by side against their queries block-diagonal.
        G = int(p.attrs.get("head_groups", 1))
        print(f"{shard}: {T} tokens; errors at the ranks of {proj}" +
              (f" (head groups of {G})" if G > 1 else ""))
        print(f"{'layer':>5} {'r_k':>4} {'r_v':>4} |" + "".join(f"{'KQt ' + n:>12}" for n in METHODS)
              + " |" + "".join(f"{'VWo ' + n:>12}" for n in METHODS))
        total = np.zeros((2, 3))
        for l in range(L):
            rk, rv = int(p["kqsvd/rank_k"][l]), int(p["kqsvd/rank_v"][l])
            num, den = np.zeros((2, 3)), np.zeros((2, 3))
            for hv in range(Hkv // G):
                # The group's Grams, the same for every method.
                group = range(hv * G, (hv + 1) * G)
                gq, gw = [], []
                for h in group:
                    heads = range(h * g, (h + 1) * g)
                    q = np.concatenate([Q[l, i] for i in heads])
                    w = np.concatenate([O[l][:, i * d:(i + 1) * d].T for i in heads], axis=1)
                    gq.append(q.T @ q)
                    gw.append(w @ w.T)
                k = np.concatenate([K[l, h] for h in group], axis=1)
                v = np.concatenate([V[l, h] for h in group], axis=1)
                sides = ((k.T @ k, blockdiag(gq), rk), (v.T @ v, blockdiag(gw), rv))
                for j, meth in enumerate(METHODS):
                    pk = [p[f"{meth}/{x}"][l, hv] for x in ("key_down", "query_down", "value_down", "value_up")]
                    for i, (GL, GR, r) in enumerate(sides):
                        a, b = rel_err(GL, GR, pk[2 * i][:, :r], pk[2 * i + 1][:, :r])
                        num[i, j] += a
                        den[i, j] += b
            errs = num / den
            total += errs
            print(f"{l:>5} {rk:>4} {rv:>4} |" + "".join(f"{e:>12.4e}" for e in errs[0]) + " |"
                  + "".join(f"{e:>12.4e}" for e in errs[1]))
        total /= L
        print(f"{'mean':>15} |" + "".join(f"{e:>12.4e}" for e in total[0]) + " |"
              + "".join(f"{e:>12.4e}" for e in total[1]))


if __name__ == "__main__":
    if len(sys.argv) != 4:
        print(__doc__.strip(), file=sys.stderr)
        sys.exit(2)
    try:
        main(*sys.argv[1:])
    except (OSError, KeyError, ValueError, IndexError) as e:
        # A missing or foreign file: one line naming it, not a traceback.
        raise SystemExit(f"inspect_proj.py: {e}")
