"""Reading proj.h5 (the data contract's projections file) into per-layer
matrices cut at chosen ranks.

Rank policies (eps:, fixed:, budget:) are resolved by the C tool itself,
`kqsvd ranks --json`, so Python and `kqsvd calibrate`/`evaluate` always
agree on the ranks: there is one implementation.
"""
import json
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import List

import numpy as np

from . import h5io
from .errors import KqsvdError, UsageError

METHODS = ("kqsvd", "ksvd", "eigen")
MATRICES = ("key_down", "query_down", "value_down", "value_up")


@dataclass
class Projections:
    """One method's projections, cut at per-layer ranks.

    key_down[l], query_down[l]: float64 [Hkv, d, rank_k[l]] (A and B);
    value_down[l], value_up[l]: float64 [Hkv, d, rank_v[l]] (A_v and B_v).
    Compressed keys are K @ A, queries q @ B, values V @ A_v, and each query
    head h of KV group g uses B_v[g]^T W^O_h in place of W^O_h."""
    path: str
    method: str
    policy: str
    model: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    rank_k: np.ndarray
    rank_v: np.ndarray
    key_down: List[np.ndarray] = field(repr=False)
    query_down: List[np.ndarray] = field(repr=False)
    value_down: List[np.ndarray] = field(repr=False)
    value_up: List[np.ndarray] = field(repr=False)

    def sizes(self):
        return {k: getattr(self, k) for k in h5io.SIZE_ATTRS}

    def cache_kept(self):
        """The fraction of the full KV cache kept: sum(rank_k + rank_v) / (2 d L)."""
        return float((self.rank_k.sum() + self.rank_v.sum()) /
                     (2 * self.head_dim * self.num_layers))


def kqsvd_binary():
    """The kqsvd executable: $KQSVD_BIN, else the repository's build/kqsvd
    (this package lives in python/kqsvd of the repository), else kqsvd on PATH."""
    env = os.environ.get("KQSVD_BIN")
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    built = os.path.join(here, "..", "..", "build", "kqsvd")
    if os.access(built, os.X_OK):
        return os.path.normpath(built)
    found = shutil.which("kqsvd")
    if found:
        return found
    raise KqsvdError("the kqsvd executable was not found: build it (./test.sh or "
                     "scripts/bootstrap.sh makes build/kqsvd), or set KQSVD_BIN")


def policy_ranks(path, policy=None):
    """The ranks of a rank policy for every method, from `kqsvd ranks --json`:
    {"policy": str, "methods": {method: {"rank_k": [L], "rank_v": [L]}},
    "cache_kept": {method: float}, ...}.  policy None: the stored ranks.
    Raises UsageError for a policy the tool refuses (unknown, a rank above
    head_dim), KqsvdError for a bad file."""
    cmd = [kqsvd_binary(), "ranks", "--proj", path, "--json"]
    if policy is not None:
        cmd += ["--ranks", policy]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise KqsvdError(f"cannot run {cmd[0]}: {e}") from None
    if p.returncode != 0:
        msg = p.stderr.strip().splitlines()
        msg = msg[0] if msg else f"exit status {p.returncode}"
        raise (UsageError if p.returncode == 2 else KqsvdError)(msg.replace("kqsvd ranks: ", ""))
    return json.loads(p.stdout)


def _rank_lists(ranks, L, d, path, method):
    """Normalises the `ranks` argument of load_projections to two int arrays."""
    if isinstance(ranks, (int, np.integer)):
        rk = rv = np.full(L, int(ranks))
    elif isinstance(ranks, dict):
        rk, rv = np.asarray(ranks["rank_k"]), np.asarray(ranks["rank_v"])
    elif isinstance(ranks, tuple) and len(ranks) == 2 and np.ndim(ranks[0]) == 1:
        rk, rv = np.asarray(ranks[0]), np.asarray(ranks[1])
    else:
        rk = rv = np.asarray(ranks)
    for name, r in (("rank_k", rk), ("rank_v", rv)):
        if r.shape != (L,) or not np.issubdtype(r.dtype, np.integer):
            raise UsageError(f"ranks for {path}: {name} must be {L} whole numbers, one per layer "
                             f"(got {r.tolist()!r})")
        bad = [int(x) for x in r if not 0 <= x <= d]
        if bad:
            raise UsageError(f"ranks for {path}: {name} = {bad[0]} is outside 0..head_dim = {d}")
    return rk.astype(np.int64), rv.astype(np.int64)


def load_projections(path, method="kqsvd", ranks=None):
    """Reads one method's projections from proj.h5.

    ranks: None for the ranks stored in the file; an int for that rank in
    every layer; a policy string ("eps:0.1", "fixed:16", "budget:0.25")
    resolved by `kqsvd ranks`; a list of L ints (keys and values alike); a
    pair (rank_k list, rank_v list) or a dict with those keys.
    Returns a Projections.  Raises KqsvdError naming the file and field for
    a bad file, UsageError for an unknown method or impossible ranks."""
    if method not in METHODS:
        raise UsageError(f"unknown method '{method}' (expected one of {', '.join(METHODS)})")
    names = [f"{method}/{n}" for n in MATRICES + ("rank_k", "rank_v")]
    with h5io.open_file(path, "projections", names) as f:
        s = h5io.sizes(f, path)
        L, H, d = s["num_layers"], s["num_kv_heads"], s["head_dim"]
        for n in MATRICES:
            shape = f[f"{method}/{n}"].shape
            if shape != (L, H, d, d):
                raise KqsvdError(f"{path}: dataset '{method}/{n}' has shape {list(shape)}, "
                                 f"expected [{L}, {H}, {d}, {d}]")
        if isinstance(ranks, str):
            policy = ranks
            got = policy_ranks(path, ranks)["methods"][method]
            rk, rv = _rank_lists((got["rank_k"], got["rank_v"]), L, d, path, method)
        elif ranks is None:
            policy = str(h5io.attr(f, "rank_policy", "") or "stored")
            rk, rv = _rank_lists((f[f"{method}/rank_k"][...].astype(np.int64),
                                  f[f"{method}/rank_v"][...].astype(np.int64)), L, d, path, method)
        else:
            rk, rv = _rank_lists(ranks, L, d, path, method)
            policy = "fixed:%d" % rk[0] if len(set(rk) | set(rv)) == 1 else "per-layer"
        mats = {}
        for n in MATRICES:
            ds, r = f[f"{method}/{n}"], rk if n.startswith(("key", "query")) else rv
            mats[n] = [np.ascontiguousarray(ds[l, :, :, :int(r[l])], dtype=np.float64)
                       for l in range(L)]
            for l, m in enumerate(mats[n]):
                if not np.isfinite(m).all():
                    raise KqsvdError(f"{path}: dataset '{method}/{n}': NaN or Inf at layer {l}")
        return Projections(path=path, method=method, policy=policy,
                           model=str(h5io.attr(f, "model", "")), rank_k=rk, rank_v=rv, **s, **mats)


def check_sizes(proj_sizes, proj_path, model_sizes, model_path="the model"):
    """Raises KqsvdError naming both files at the first size (num_layers,
    num_heads, num_kv_heads, head_dim, hidden_size) that differs."""
    for k in h5io.SIZE_ATTRS:
        if proj_sizes[k] != model_sizes[k]:
            raise KqsvdError(f"{proj_path} has {k} = {proj_sizes[k]}, but {model_path} has "
                             f"{model_sizes[k]}: projections of another model")
