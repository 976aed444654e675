#!/usr/bin/python3
"""The in-memory PyTorch pipeline: the benchmark peer of `kqsvd calibrate`.

    bench/inmemory_pipeline.py --model DIR/model.h5 [--dtype float32|float64]
        [--threads N] [--beta B] [--check PROJ.h5] [--tol X] SHARD...

This is how the KQ-SVD paper's authors compute the three projections: for
each layer it loads the layer's whole calibration cache (all shards, joined
along T in the order given) into memory, converts it to the compute dtype,
and for each KV head calls SVD/QR on the full T x d matrices and forms the
T x d products:

  ksvd   svd(K), svd(V): the right singular vectors are the projections.
  eigen  svd([beta K; Q / beta]) for the keys; the values are K-SVD's,
         svd(V), computed once and shared (it is the same computation).
  kqsvd  K = Q_K R_K, Q = Q_Q R_Q, U S Vt = svd(R_K R_Q^T); U <- Q_K U,
         Vt <- Vt Q_Q^T; A = Q^T Vt^T S^-1, B = K^T U.  The values likewise
         against W = [W^O_h for h in the group] (d x mD): A_v = W Vt^T S^-1,
         B_v = V^T U.

Here Q is the group's m query heads stacked (mT x d).  The projections are
computed and dropped: only the time and memory are measured.  With --check
the singular values are compared with those `kqsvd calibrate` wrote into
PROJ.h5 (sigma_k, sigma_v of each method): the largest difference relative
to the largest singular value of its (layer, head, method, side) must stay
within --tol, which shows that both did the same work on the same data.

Progress goes to stderr; one JSON line with the timings goes to stdout.
Needs Debian's python3-torch, python3-numpy and python3-h5py.
"""
import argparse
import json
import os
import resource
import sys
import time

import h5py
import numpy as np
import torch

PROG = "inmemory_pipeline"
METHODS = ("kqsvd", "ksvd", "eigen")
NUMPY_DTYPE = {"float32": np.float32, "float64": np.float64}


class Failure(Exception):
    """An expected error: one line on stderr and exit status 1."""


def log(msg):
    print(f"{PROG}: {msg}", file=sys.stderr, flush=True)


def open_h5(path):
    if not os.path.isfile(path):
        raise Failure(f"{path}: no such file")
    try:
        return h5py.File(path, "r")
    except (OSError, ValueError) as e:
        raise Failure(f"cannot open {path}: {e}") from None


def attr_int(f, name):
    if name not in f.attrs:
        raise Failure(f"{f.filename}: missing root attribute {name}")
    return int(f.attrs[name])


def dataset(f, name, shape):
    """Dataset `name` of f, checked against shape (None matches any size)."""
    if name not in f or not isinstance(f[name], h5py.Dataset):
        raise Failure(f"{f.filename}: missing dataset {name}")
    ds = f[name]
    if len(ds.shape) != len(shape) or any(
            want is not None and got != want for got, want in zip(ds.shape, shape)):
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        raise Failure(f"{f.filename}: dataset {name} has shape {list(ds.shape)}, expected {want}")
    return ds


def is_bf16(ds):
    tag = ds.attrs.get("dtype")
    if isinstance(tag, bytes):
        tag = tag.decode()
    return tag == "bfloat16"


def check_element_type(ds):
    if is_bf16(ds):
        if ds.dtype != np.uint16:
            raise Failure(f"{ds.file.filename}: dataset {ds.name} says bfloat16 but is {ds.dtype}")
    elif ds.dtype not in (np.float16, np.float32, np.float64):
        raise Failure(f"{ds.file.filename}: dataset {ds.name} has element type {ds.dtype}")


def read_into(ds, index, out):
    """ds[index] into the numpy array out, decoding bfloat16 exactly."""
    raw = ds[index]
    if is_bf16(ds):
        raw = (raw.astype(np.uint32) << 16).view(np.float32)
    out[...] = raw


class CacheSet:
    """The calibration shards, checked against the model file."""

    def __init__(self, model_path, shard_paths):
        self.model = open_h5(model_path)
        m = self.model
        self.L, self.Hq, self.Hkv = (attr_int(m, n) for n in ("num_layers", "num_heads", "num_kv_heads"))
        self.d, self.D = attr_int(m, "head_dim"), attr_int(m, "hidden_size")
        if self.Hkv <= 0 or self.Hq % self.Hkv:
            raise Failure(f"{model_path}: num_kv_heads {self.Hkv} does not divide num_heads {self.Hq}")
        self.o_proj = dataset(m, "o_proj", (self.L, self.D, self.Hq * self.d))
        check_element_type(self.o_proj)
        self.shards = []  # (file, keys, values, queries, T)
        for path in shard_paths:
            f = open_h5(path)
            for name in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size"):
                if attr_int(f, name) != attr_int(m, name):
                    raise Failure(f"{path}: {name} = {attr_int(f, name)} but {model_path} has {attr_int(m, name)}")
            k = dataset(f, "keys", (self.L, self.Hkv, None, self.d))
            T = k.shape[2]
            v = dataset(f, "values", (self.L, self.Hkv, T, self.d))
            q = dataset(f, "queries", (self.L, self.Hq, T, self.d))
            for ds in (k, v, q):
                check_element_type(ds)
            lens = dataset(f, "seq_lens", (None,))[()]
            if int(lens.sum()) != T:
                raise Failure(f"{path}: seq_lens sum to {int(lens.sum())} but the caches hold {T} rows")
            self.shards.append((f, k, v, q, T))
        self.T = sum(s[4] for s in self.shards)
        if self.T == 0:
            raise Failure("the shards hold no tokens")

    def load_layer(self, l, dtype):
        """Layer l's K, V [Hkv, T, d], Q [Hq, T, d] and o_proj [D, Hq d]."""
        npdt = NUMPY_DTYPE[dtype]
        K = np.empty((self.Hkv, self.T, self.d), npdt)
        V = np.empty((self.Hkv, self.T, self.d), npdt)
        Q = np.empty((self.Hq, self.T, self.d), npdt)
        t0 = 0
        for _, k, v, q, T in self.shards:
            read_into(k, l, K[:, t0:t0 + T])
            read_into(v, l, V[:, t0:t0 + T])
            read_into(q, l, Q[:, t0:t0 + T])
            t0 += T
        Wo = np.empty((self.D, self.Hq * self.d), npdt)
        read_into(self.o_proj, l, Wo)
        return tuple(torch.from_numpy(a) for a in (K, V, Q, Wo))


def inverse_or_zero(S):
    """1/S, with 0 where S == 0 (a rank-deficient product)."""
    return torch.where(S > 0, S.reciprocal(), torch.zeros_like(S))


def right_svd(M):
    """Singular values and right singular vectors (columns) of M."""
    _, S, Vh = torch.linalg.svd(M, full_matrices=False)
    return S, Vh.T


def kq_factor(X, Y):
    """KQ-SVD of X Y^T (X: T x d, Y: n x d) from the QR factors of both.

    Returns A, B (d x d; d x T when T < d) with X A[:, :r] B[:, :r]^T Y^T the
    best rank-r approximation of X Y^T for every r, and the singular values
    of X Y^T."""
    QX, RX = torch.linalg.qr(X)
    QY, RY = torch.linalg.qr(Y)
    Us, S, Vs = torch.linalg.svd(RX @ RY.T, full_matrices=False)
    U = QX @ Us               # T x d: left singular vectors of X Y^T
    Vt = Vs @ QY.T            # d x n: right singular vectors of X Y^T
    A = Y.T @ Vt.T * inverse_or_zero(S)   # d x d, = R_X^+ Us
    B = (U.T @ X).T                       # d x d, = R_X^T Us
    return A, B, S


def compute_group(K, V, Qg, W, beta):
    """The three methods for one KV group.

    K, V: T x d; Qg: mT x d (the group's queries stacked); W: d x mD.
    Returns {method: (key_down, query_down, value_down, value_up,
    sigma_k, sigma_v)}."""
    sk, Pk = right_svd(K)
    sv, Pv = right_svd(V)
    se, Pe = right_svd(torch.cat([beta * K, Qg / beta]))
    A, B, skq = kq_factor(K, Qg)
    # Values: V W with W = [W^O_h ...]; kq_factor takes Y = W^T (mD x d).
    Av, Bv, svw = kq_factor(V, W.T)
    return {
        "ksvd": (Pk, Pk, Pv, Pv, sk, sv),
        "eigen": (Pe, Pe, Pv, Pv, se, sv),
        "kqsvd": (A, B, Av, Bv, skq, svw),
    }


def compute_layer(cs, K, V, Q, Wo, beta):
    """All KV groups of one layer; returns {method: (sigma_k, sigma_v)},
    each [Hkv, d] float64 numpy (padded with zeros when T < d)."""
    m, d = cs.Hq // cs.Hkv, cs.d
    sig = {meth: (np.zeros((cs.Hkv, d)), np.zeros((cs.Hkv, d))) for meth in METHODS}
    for g in range(cs.Hkv):
        heads = range(g * m, (g + 1) * m)
        Qg = Q[g * m:(g + 1) * m].reshape(m * cs.T, d)
        W = torch.cat([Wo[:, h * d:(h + 1) * d].T for h in heads], dim=1)
        out = compute_group(K[g], V[g], Qg, W, beta)
        for meth, res in out.items():
            for side, s in zip(sig[meth], res[4:]):
                side[g, :s.numel()] = s.double().numpy()
    return sig


def open_check(path, cs, beta):
    """PROJ.h5, checked against the shards before any work is done."""
    f = open_h5(path)
    for name, want in (("num_layers", cs.L), ("num_heads", cs.Hq),
                       ("num_kv_heads", cs.Hkv), ("head_dim", cs.d), ("tokens", cs.T)):
        if attr_int(f, name) != want:
            raise Failure(f"{path}: {name} = {attr_int(f, name)} but the shards give {want}")
    refs = {}
    for meth in METHODS:
        for side in ("sigma_k", "sigma_v"):
            refs[meth, side] = dataset(f, f"{meth}/{side}", (cs.L, cs.Hkv, cs.d))[()]
    made = float(f["eigen"].attrs.get("beta", 1.0))
    if abs(made - beta) > 1e-12 * beta:
        raise Failure(f"{path}: /eigen was made with beta = {made:g}, not --beta {beta:g}")
    f.close()
    return refs


def compare(refs, sigmas):
    """Largest |sigma - sigma_ref| / max(sigma_ref) over all items, and where."""
    worst, where = 0.0, None
    for (meth, side), ref in refs.items():
        i = 0 if side == "sigma_k" else 1
        ours = np.stack([layer[meth][i] for layer in sigmas])
        scale = ref.max(axis=2, keepdims=True)
        rel = np.abs(ours - ref) / np.where(scale > 0, scale, 1.0)
        if rel.max() > worst:
            worst = float(rel.max())
            l, g, j = np.unravel_index(rel.argmax(), rel.shape)
            where = f"/{meth}/{side} layer {l} KV head {g} value {j}"
    return worst, where


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="inmemory_pipeline.py",
        description="The in-memory PyTorch pipeline (the KQ-SVD authors' approach): "
                    "the benchmark peer of kqsvd calibrate.")
    p.add_argument("--model", required=True, help="model.h5 (o_proj of every layer)")
    p.add_argument("--dtype", choices=sorted(NUMPY_DTYPE), default="float32",
                   help="compute dtype (default float32, as the authors)")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--beta", type=float, default=1.0, help="Eigen's key scale (default 1)")
    p.add_argument("--check", metavar="PROJ.h5",
                   help="compare the singular values with those kqsvd calibrate wrote")
    p.add_argument("--tol", type=float,
                   help="largest relative sigma difference allowed by --check "
                        "(default 1e-4 for float32, 1e-9 for float64)")
    p.add_argument("shards", nargs="+", metavar="SHARD", help="calibration cache shards")
    a = p.parse_args(argv)
    if a.threads < 1:
        p.error("--threads must be at least 1")
    if not a.beta > 0:
        p.error("--beta must be positive")
    if a.tol is None:
        a.tol = 1e-4 if a.dtype == "float32" else 1e-9
    return a


def main(argv):
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    log(f"torch {torch.__version__}, threads {torch.get_num_threads()}, dtype {a.dtype}")
    t0 = time.perf_counter()
    cs = CacheSet(a.model, a.shards)   # opening the files counts as loading
    t_load, t_compute = time.perf_counter() - t0, 0.0
    refs = open_check(a.check, cs, a.beta) if a.check else None   # not timed
    log(f"{len(cs.shards)} shards, {cs.T} tokens; {cs.L} layers, {cs.Hq}/{cs.Hkv} heads, "
        f"d = {cs.d}, D = {cs.D}")
    sigmas = []
    with torch.no_grad():
        for l in range(cs.L):
            t0 = time.perf_counter()
            K, V, Q, Wo = cs.load_layer(l, a.dtype)
            t1 = time.perf_counter()
            sigmas.append(compute_layer(cs, K, V, Q, Wo, a.beta))
            t2 = time.perf_counter()
            del K, V, Q, Wo
            t_load += t1 - t0
            t_compute += t2 - t1
            log(f"layer {l + 1}/{cs.L}: load {t1 - t0:.2f} s, compute {t2 - t1:.2f} s")
    total = t_load + t_compute
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    diff = None
    if refs is not None:
        diff, where = compare(refs, sigmas)
        log(f"largest relative sigma difference from {a.check}: {diff:.3e}"
            + (f" ({where})" if where else ""))
    print(json.dumps({
        "tokens": cs.T, "layers": cs.L, "heads": cs.Hq, "kv_heads": cs.Hkv,
        "head_dim": cs.d, "hidden_size": cs.D, "shards": len(cs.shards),
        "dtype": a.dtype, "threads": a.threads,
        "seconds_total": round(total, 4), "seconds_load": round(t_load, 4),
        "seconds_compute": round(t_compute, 4), "peak_rss_mib": round(rss, 1),
        "max_rel_sigma_diff": diff}), flush=True)
    if diff is not None and diff > a.tol:
        raise Failure(f"singular values differ from {a.check} by {diff:.3e} relative "
                      f"(at {where}), more than --tol {a.tol:g}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except Failure as e:
        log(f"error: {e}")
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
