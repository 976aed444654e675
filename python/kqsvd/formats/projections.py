"""Reading proj.h5 (the data contract's projections file) into per-layer
matrices cut at chosen ranks.

Rank policies (eps:, fixed:, budget:) are resolved by the C tool itself,
`kqsvd ranks --json`, so Python and `kqsvd calibrate`/`evaluate` always
agree on the ranks: there is one implementation.
"""
from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import numpy as np

from . import h5io, tiers
from . import policy as policies
from .. import native
from .quant import QuantScheme, read_bits, unit_bits, with_bits
from ..errors import KqsvdError, UsageError
from ..renamed import moved

METHODS = ("kqsvd", "ksvd", "eigen")
# save_ranks lived here before formats/saving.py (kqsvd.save_ranks).
__getattr__ = moved(__name__, {"save_ranks": "kqsvd.formats.saving"})
MATRICES = ("key_down", "query_down", "value_down", "value_up")
# query_down_tuned, value_up_tuned: up-projections trained on the model's
# loss at the stored ranks (kqsvd.quality.tune; docs/formats.md section 5.3).
TUNED_SUFFIX = "_tuned"


@dataclass
class Projections:
    """One method's projections, cut at per-(layer, KV head) ranks.

    What load_projections returns.  Each layer's matrices are padded to
    its largest rank: a head's columns past its own rank are zero, so the
    padded matrices compute the same as each head's own.  Compressed keys
    are K @ A, queries q @ B, values V @ A_v, and each query head h of KV
    group g uses B_v[g]^T W^O_h in place of W^O_h.

    Attributes
    ----------
    path : str or os.PathLike
        The projections file the matrices were read from, as given to
        load_projections.
    method : str
        One of METHODS.
    policy : str
        How the ranks were chosen: the policy string given; for the stored
        ranks the file's `rank_policy` ("stored" when it has none); for
        ranks given as numbers "fixed:R", "per-layer" or "per-head".
    model : str
        The file's `model` attribute ("" when it has none).
    num_layers, num_heads, num_kv_heads, head_dim, hidden_size : int
        L, Hq, Hkv, d and D as the file has them: the group view's Hkv and
        d for a head-groups file (see `head_groups`; sizes() gives the
        model's).
    rank_k, rank_v : np.ndarray
        int [L]: each layer's largest key and value rank.
    key_down, query_down : list of np.ndarray
        Per layer l, float64 [Hkv, d, rank_k[l]]: A and B.
    value_down, value_up : list of np.ndarray
        Per layer l, float64 [Hkv, d, rank_v[l]]: A_v and B_v.
    rank_k_heads, rank_v_heads : np.ndarray
        int [L, Hkv]: each head's ranks.
    rope : str
        The file's `rope` attribute: "post" (keys after RoPE; also when the
        file has none) or "pre" (keys before RoPE, brought back as
        RoPE(K A B^T) before the scores: kqsvd.attention).
    tuned : bool
        True when query_down and value_up are the file's tuned
        up-projections (kqsvd.quality.tune), not the closed forms.
    head_groups : int
        G > 1 for a head-groups file (docs/formats.md 5.3), whose
        num_kv_heads, head_dim, matrices and ranks are the model's group
        view (Hkv / G groups, G d wide); 1 otherwise.
    bits_k, bits_v : np.ndarray or None
        The bits of the cached columns under the scheme `quant`: int
        [L, Hkv] one per unit or int [L, Hkv, d] one per latent column, in
        formats.quant's one encoding (BITS, UNQUANTIZED, and DROPPED for a
        column past its unit's rank); None without bits.
    quant : formats.quant.QuantScheme or None
        The quantization scheme of bits_k and bits_v; None without bits.
    tiers : tuple or None
        A tiered cache's (formats.tiers.TierLayout, [Projections or None
        per tier, None for a dropped one]); None for one latent per token.
        The matrices above are then the file's stored ones, which give the
        sizes.
    """
    path: str | os.PathLike
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
    key_down: list[np.ndarray] = field(repr=False)
    query_down: list[np.ndarray] = field(repr=False)
    value_down: list[np.ndarray] = field(repr=False)
    value_up: list[np.ndarray] = field(repr=False)
    rank_k_heads: np.ndarray | None = None
    rank_v_heads: np.ndarray | None = None
    rope: str = "post"
    tuned: bool = False
    head_groups: int = 1
    bits_k: np.ndarray | None = None
    bits_v: np.ndarray | None = None
    quant: QuantScheme | None = None
    tiers: tuple | None = None

    def sizes(self) -> dict[str, int]:
        """The model's sizes, whatever the head groups.

        Returns
        -------
        dict of str to int
            num_layers, num_heads, num_kv_heads, head_dim and hidden_size
            (h5io.SIZE_ATTRS) of the model itself: for a head-groups file,
            G times the group view's num_kv_heads, each head_dim / G wide.
        """
        return model_sizes({k: getattr(self, k) for k in h5io.SIZE_ATTRS}, self.head_groups)

    def per_head(self, layer: int) -> bool:
        """Whether the heads of `layer` have ranks of their own (not all alike).

        Parameters
        ----------
        layer : int
            The layer, 0 .. num_layers - 1.

        Returns
        -------
        bool
            True when some KV head's key or value rank is below the
            layer's largest.
        """
        return bool((self.rank_k_heads[layer] != self.rank_k[layer]).any() or
                    (self.rank_v_heads[layer] != self.rank_v[layer]).any())

    def cache_kept(self) -> float:
        """The fraction of the full KV cache kept.

        Without bits, the sum over layers and KV heads of (rank_k +
        rank_v) / (2 d L Hkv); with bits, the bytes of the codes and scales
        over a bf16 cache's (a block's residual tokens aside:
        docs/quantized-cache.md).

        Returns
        -------
        float
            The fraction, above 0 and at most 1 without bits.
        """
        if self.quant is None:
            return float((self.rank_k_heads.sum() + self.rank_v_heads.sum()) /
                         (2 * self.head_dim * self.num_layers * self.num_kv_heads))
        q, L, H = self.quant, self.num_layers, self.num_kv_heads
        held = sum(unit_bits(bs[l, h], rs[l, h], ax, q.group)
                   for rs, bs, ax in ((self.rank_k_heads, self.bits_k, q.key_axis),
                                      (self.rank_v_heads, self.bits_v, q.value_axis))
                   for l in range(L) for h in range(H))
        return float(held / (2 * 16 * self.head_dim * self.num_layers * self.num_kv_heads))


def model_sizes(sizes, head_groups):
    """A file's sizes as the model's: a head-groups file's group view has
    Hkv / G KV heads of G d."""
    return dict(sizes, num_kv_heads=sizes["num_kv_heads"] * head_groups,
                head_dim=sizes["head_dim"] // head_groups)


def head_groups_of(f, path, head_dim):
    """The file's head_groups attribute (1 when absent), checked."""
    G = h5io.attr(f, "head_groups", 1)
    if isinstance(G, (bool, np.bool_)) or not isinstance(G, (int, np.integer)) or G < 1 or \
            head_dim % G:
        raise KqsvdError(f"{path}: attribute 'head_groups' = {G!r} must be a whole number >= 1 "
                         f"dividing head_dim = {head_dim}")
    return int(G)


def policy_ranks(path: str | os.PathLike, policy: str | None = None) -> dict[str, Any]:
    """The ranks of a rank policy for every method, from `kqsvd ranks --json`.

    The C tool resolves the policy, so Python and `kqsvd calibrate` /
    `evaluate` agree on the ranks.  A command asks for the same answer
    twice (its options checked, then its configurations built): the tool
    runs once per executable, file version and policy, and each call gets
    a copy of the answer of its own to change.

    Parameters
    ----------
    path : str or os.PathLike
        The projections file (proj.h5).
    policy : str or None
        A rank policy ("eps:0.1", "fixed:16", "budget:0.25"); None for the
        ranks stored in the file.

    Returns
    -------
    dict
        The tool's JSON: {"policy": str, "methods": {method: {"rank_k":
        [L], "rank_v": [L]}}, "cache_kept": {method: float}, ...}.

    Raises
    ------
    UsageError
        For a policy the tool refuses (unknown, a rank above head_dim).
    KqsvdError
        For a bad file, or a kqsvd executable that is missing or cannot
        start (a system library it links is missing).

    Examples
    --------
    >>> got = kqsvd.policy_ranks("proj.h5", "budget:0.25")
    >>> rank_k = got["methods"]["kqsvd"]["rank_k"]  # one rank per layer
    """
    check_path("path", path)
    exe = native.tool()
    try:
        st = os.stat(path)
        key = (exe, os.path.realpath(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns,
               policy)
    except OSError:
        key = None  # the tool names what is wrong with the path
    if key is None or key not in _RANKS:
        got = _run_ranks(exe, path, policy)
        if key is None:
            return got
        _RANKS[key] = got
    return json.loads(json.dumps(_RANKS[key]))  # a copy: callers may change theirs


_RANKS = {}


def _run_ranks(exe, path, policy):
    cmd = [exe, "ranks", "--proj", path, "--json"]
    if policy is not None:
        cmd += ["--ranks", policy]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise KqsvdError(f"cannot run {cmd[0]}: {e}") from None
    if p.returncode != 0:
        missing = native.missing_library(p.stderr)
        if missing:  # the executable links a library libkqsvd.so does not
            raise KqsvdError(missing)
        raise (UsageError if p.returncode == 2 else KqsvdError)(_tool_message(p))
    return json.loads(p.stdout)


def _rank_array(value, name, L, H, d, path):
    """One side's ranks as int64 [L, Hkv], checked: whole numbers (not
    booleans) in 1..d, one per layer or one per layer and KV head."""
    if isinstance(value, (bool, np.bool_)):
        raise UsageError(f"ranks for {path}: {name} = {value!r} is not a rank")
    r = np.asarray(value)
    if r.dtype == object and r.size and all(isinstance(x, (int, np.integer)) and not
                                            isinstance(x, (bool, np.bool_)) for x in r.ravel()):
        # whole numbers, some beyond int64 (a rank of 10^20): out of range, not of a bad type
        bad = next((int(x) for x in r.ravel() if not 1 <= x <= d), None)
        if bad is not None:
            raise UsageError(f"ranks for {path}: {name} = {bad} is outside 1..head_dim = {d}")
    if r.shape == () and np.issubdtype(r.dtype, np.integer):
        r = np.full(L, int(r))  # one rank for every layer
    if r.dtype == object or not (np.issubdtype(r.dtype, np.integer) and r.dtype != np.bool_):
        raise UsageError(f"ranks for {path}: {name} must be whole numbers, not {r.dtype} "
                         f"({_short(value)})")
    if r.shape == (L,):
        r = np.repeat(r[:, None], H, 1)
    if r.shape != (L, H):
        raise UsageError(f"ranks for {path}: {name} must be {L} ranks, one per layer, or "
                         f"[{L}, {H}], one per layer and KV head, not shape {list(r.shape)}")
    bad = [int(x) for x in r.ravel() if not 1 <= x <= d]
    if bad:
        raise UsageError(f"ranks for {path}: {name} = {bad[0]} is outside 1..head_dim = {d}")
    return r.astype(np.int64)


def _short(value):
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_path(name, path):
    """UsageError naming the argument `name` unless path is a file name."""
    if not isinstance(path, (str, os.PathLike)):
        raise UsageError(f"{name} must be a file name, not {type(path).__name__}")


def _tool_message(p):
    """`kqsvd ranks`' one-line error, worded for a library call: without
    the tool's prefix, its --help pointer, or its option's name."""
    lines = p.stderr.strip().splitlines()
    msg = lines[0] if lines else f"exit status {p.returncode}"
    for prefix in ("kqsvd ranks: error: ", "kqsvd ranks: "):
        if msg.startswith(prefix):
            msg = msg[len(prefix):]
    msg = msg.replace(" (see kqsvd ranks --help)", "")
    for flag in ("--ranks: rank policy ", "--ranks: ", "--ranks "):
        if msg.startswith(flag):
            msg = "rank policy " + msg[len(flag):]
            break
    return msg


def rank_lists(ranks, L, H, d, path):
    """Normalises the `ranks` argument of load_projections (see there) to
    two int arrays [L, Hkv]; UsageError naming the argument otherwise."""
    if isinstance(ranks, (bool, np.bool_)):
        raise UsageError(f"ranks for {path}: {ranks!r} is not a rank (expected a whole number "
                         f"in 1..{d}, a policy string, per-layer ranks or a (keys, values) pair)")
    if isinstance(ranks, (int, np.integer)):
        rk = rv = [int(ranks)] * L  # a list: a rank beyond int64 is refused as out of range
    elif isinstance(ranks, dict):
        keys = [("rank_k_heads", "rank_v_heads"), ("rank_k", "rank_v")]
        pair = next((k for k in keys if k[0] in ranks and k[1] in ranks), None)
        if pair is None:
            raise UsageError(f"ranks for {path}: a dict needs 'rank_k' and 'rank_v' (or "
                             f"'rank_k_heads' and 'rank_v_heads'), not keys {sorted(map(str, ranks))}")
        rk, rv = ranks[pair[0]], ranks[pair[1]]
    elif isinstance(ranks, tuple):
        if len(ranks) != 2:
            raise UsageError(f"ranks for {path}: a tuple is a (keys, values) pair, not "
                             f"{len(ranks)} items")
        rk, rv = ranks
    elif isinstance(ranks, (list, np.ndarray)):
        rk = rv = ranks
    else:
        raise UsageError(f"ranks for {path}: {type(ranks).__name__} {_short(ranks)} is not a rank "
                         "(expected an int, a policy string, a list, a (keys, values) pair or a dict)")
    return [_rank_array(r, name, L, H, d, path) for name, r in (("rank_k", rk), ("rank_v", rv))]


def _stored_ranks(f, path, method, L, H):
    """The ranks stored in the file: per head where the group carries
    rank_k_heads/rank_v_heads (docs/formats.md section 5.3), else per layer."""
    g = f[method]
    if ("rank_k_heads" in g) != ("rank_v_heads" in g):
        raise KqsvdError(f"{path}: group '{method}' has only one of rank_k_heads and rank_v_heads")
    if "rank_k_heads" not in g:
        return g["rank_k"][...].astype(np.int64), g["rank_v"][...].astype(np.int64)
    heads = []
    for side in ("k", "v"):
        ds = g[f"rank_{side}_heads"]
        if ds.shape != (L, H) or not np.issubdtype(ds.dtype, np.integer):
            raise KqsvdError(f"{path}: dataset '{method}/rank_{side}_heads' must be integers of "
                             f"shape [{L}, {H}], not {ds.dtype} {list(ds.shape)}")
        r = ds[...].astype(np.int64)
        if not np.array_equal(g[f"rank_{side}"][...].astype(np.int64), r.max(1)):
            raise KqsvdError(f"{path}: dataset '{method}/rank_{side}' is not each layer's largest "
                             f"'{method}/rank_{side}_heads'")
        heads.append(r)
    return tuple(heads)


def load_projections(path: str | os.PathLike, method: str = "kqsvd",
                     ranks: int | Sequence[int] | np.ndarray | tuple | dict | str | None = None,
                     tuned: bool = True) -> Projections:
    """Reads one method's projections from proj.h5.

    The matrices are cut at `ranks` and checked: shapes as the file's
    sizes say, no NaN or Inf.  Stored bits (quality-bits:F) belong to the
    stored ranks, so they are read only with ranks None.

    Parameters
    ----------
    path : str or os.PathLike
        The projections file (`kqsvd calibrate`'s proj.h5).
    method : str
        One of METHODS: "kqsvd", "ksvd" or "eigen".
    ranks : int, sequence of int, np.ndarray, tuple, dict, str or None
        None for the ranks stored in the file (per head where it has
        them, and with the group's tuned up-projections where it has them
        and `tuned` is true: docs/formats.md section 5.3); an int for that
        rank everywhere; a policy string as the commands take it
        (formats.policy): "eps:0.1", "fixed:16", "budget:0.25" (resolved
        by `kqsvd ranks`: policy_ranks) or "stored" (as None), each with
        optional bits ("fixed:32@4": quantized under the default
        QuantScheme), or a tiered layout (docs/formats.md 5.4.1), but no
        policy fitted to the model; a list
        of L ints or an [L, Hkv] array (keys and values alike); a tuple
        (rank_k, rank_v), each an int or [L] or [L, Hkv]; or a dict with
        keys rank_k/rank_v (or rank_k_heads/rank_v_heads).  Every rank is
        a whole number (not a bool) in 1..head_dim.
    tuned : bool
        With ranks None, take the group's tuned up-projections
        (query_down_tuned, value_up_tuned) where the file has them.

    Returns
    -------
    Projections
        The method's matrices at those ranks.

    Raises
    ------
    KqsvdError
        Naming the file and field for a bad file (missing, not a
        projections file, a dataset missing or of the wrong shape, NaN or
        Inf, inconsistent stored ranks or attributes).
    UsageError
        For a path that is not a file name, an unknown method or
        impossible ranks (also a policy the tool refuses).

    Examples
    --------
    >>> proj = kqsvd.load_projections("proj.h5", "kqsvd", ranks="budget:0.25")
    """
    check_path("path", path)
    if not isinstance(method, str) or method not in METHODS:
        raise UsageError(f"unknown method {method!r} (expected one of {', '.join(METHODS)})")
    if isinstance(ranks, str):
        pol = policies.parse(ranks)
        if pol.fitted or pol.tiers is not None or pol.bits is not None or \
                pol.base == policies.STORED:
            return _load_policy(path, method, pol, tuned)
    return _read(path, method, ranks, tuned)


def _read(path, method, ranks, tuned):
    """load_projections' reading, once its arguments are checked."""
    names = [f"{method}/{n}" for n in MATRICES + ("rank_k", "rank_v")]
    with h5io.open_file(path, "projections", names) as f:
        s = h5io.sizes(f, path)
        L, H, d = s["num_layers"], s["num_kv_heads"], s["head_dim"]
        for n in MATRICES:
            shape = f[f"{method}/{n}"].shape
            if shape != (L, H, d, d):
                raise KqsvdError(f"{path}: dataset '{method}/{n}' has shape {list(shape)}, "
                                 f"expected [{L}, {H}, {d}, {d}]")
        policy, rk, rv = _ranks_of(f, path, method, ranks, (L, H, d))
        up = _tuned_names(f, path, method, (L, H, d, d)) if ranks is None and tuned else {}
        groups = head_groups_of(f, path, d)
        rope = h5io.attr(f, "rope", "post")
        if rope not in ("post", "pre"):
            raise KqsvdError(f"{path}: attribute 'rope' is {rope!r}, expected 'pre' or 'post'")
        mats = {n: _matrices(f[f"{method}/{up.get(n, n)}"], path,
                             rk if n.startswith(("key", "query")) else rv) for n in MATRICES}
        # Stored bits (quality-bits:F) belong to the stored ranks.
        bk, bv, scheme = (read_bits(f, path, method, L, H, d, (rk, rv)) if ranks is None
                          else (None,) * 3)
        # A stored tiered layout (quality-tiers:F) is the stored policy's cache.
        stored = tiers.read_stored(f, path, method, d) if ranks is None else None
        proj = Projections(path=path, method=method, policy=policy,
                           model=str(h5io.attr(f, "model", "")), rank_k=rk.max(1),
                           rank_v=rv.max(1), rank_k_heads=rk, rank_v_heads=rv, rope=rope,
                           tuned=bool(up), head_groups=groups, bits_k=bk, bits_v=bv,
                           quant=scheme, **s, **mats)
    return proj if stored is None else tiers.attach(proj, *stored,
                                                     lambda r: load_projections(path, method, r))


def _load_policy(path, method, pol, tuned):
    """load_projections of a formats.policy.Policy that `kqsvd ranks` does
    not read alone (stored, bits, a layout), as quality.measure's
    resolve_policies reads it; UsageError for one fitted to the model."""
    if pol.fitted:
        raise UsageError(f"rank policy {pol.text} is fitted to the model: fit it with python -m "
                         "kqsvd.quality, then load the file it writes")
    stored = pol.base == policies.STORED
    p = load_projections(path, method, None if stored or pol.tiers is not None else pol.base,
                         tuned)
    if pol.tiers is not None:
        return tiers.attach(p, pol.tiers, QuantScheme(),
                            lambda r: load_projections(path, method, r))
    if pol.bits is None:  # stored: the file's own bits and layout, where it has them
        return p
    label = p.policy + pol.text[len(pol.base):] if stored else pol.text
    return replace(with_bits(p, pol.bits, QuantScheme()), policy=label)


def _ranks_of(f, path, method, ranks, shape):
    """(policy, rank_k, rank_v [L, Hkv]) of load_projections' `ranks`."""
    L, H, d = shape
    if isinstance(ranks, str):
        got = policy_ranks(path, ranks)["methods"][method]
        return (ranks,) + tuple(rank_lists((got["rank_k"], got["rank_v"]), L, H, d, path))
    if ranks is None:
        policy = str(h5io.attr(f, "rank_policy", "") or "stored")
        try:
            rk, rv = rank_lists(_stored_ranks(f, path, method, L, H), L, H, d, path)
        except UsageError as e:  # the file's own ranks: a bad file, not a bad argument
            raise KqsvdError(f"{path}: group '{method}': stored {str(e).split(': ', 1)[1]}") \
                from None
        return policy, rk, rv
    rk, rv = rank_lists(ranks, L, H, d, path)
    policy = ("fixed:%d" % rk.flat[0] if len(set(rk.ravel()) | set(rv.ravel())) == 1
              else "per-head" if (rk != rk[:, :1]).any() or (rv != rv[:, :1]).any()
              else "per-layer")
    return policy, rk, rv


def _matrices(ds, path, r):
    """A dataset's per-layer matrices [Hkv, d, max rank], each head's
    columns past its rank r[l, h] zero; KqsvdError for NaN or Inf."""
    out = []
    for l in range(ds.shape[0]):
        m = np.array(ds[l, :, :, :int(r[l].max())], dtype=np.float64)
        for h in range(ds.shape[1]):
            m[h, :, r[l, h]:] = 0.0
        if not np.isfinite(m).all():
            raise KqsvdError(f"{path}: dataset '{ds.name[1:]}': NaN or Inf at layer {l}")
        out.append(m)
    return out


def _tuned_names(f, path, method, shape):
    """{name: name_tuned} for a group with tuned up-projections, {} without;
    KqsvdError for one of the pair alone or a wrong shape."""
    names = {n: n + TUNED_SUFFIX for n in ("query_down", "value_up")}
    have = [t for t in names.values() if t in f[method]]
    if not have:
        return {}
    if len(have) == 1:
        raise KqsvdError(f"{path}: group '{method}' has only one of "
                         f"{' and '.join(names.values())}")
    for t in have:
        if f[method][t].shape != shape:
            raise KqsvdError(f"{path}: dataset '{method}/{t}' has shape "
                             f"{list(f[method][t].shape)}, expected {list(shape)}")
    return names


def file_sizes(path, methods=METHODS):
    """The sizes of the model a projections file is for (h5io.SIZE_ATTRS,
    through the group view of a head-groups file, and "head_groups") once
    the file agrees with itself: each method's matrices [L, Hkv, d, d] and
    ranks [L], where present, as its attributes say.  Raises KqsvdError
    naming the attribute and the dataset that disagree, so that a file at
    odds with itself is not reported as projections of another model."""
    with h5io.open_file(path, "projections") as f:
        s = h5io.sizes(f, path)
        L, H, d = s["num_layers"], s["num_kv_heads"], s["head_dim"]
        for m in methods:
            for n in MATRICES + ("rank_k", "rank_v"):
                if f"{m}/{n}" not in f:
                    continue  # load_projections names what is missing
                shape = f[f"{m}/{n}"].shape
                want = (L,) if n.startswith("rank") else (L, H, d, d)
                if shape == want:
                    continue
                attrs = ("num_layers", "num_kv_heads", "head_dim", "head_dim")
                k = next((i for i, (a, b) in enumerate(zip(shape, want)) if a != b), 0)
                raise KqsvdError(f"{path}: inconsistent file: attribute '{attrs[k]}' = {want[k]} "
                                 f"but dataset '{m}/{n}' has shape {list(shape)}, expected "
                                 f"{list(want)}")
        G = head_groups_of(f, path, d)
    return dict(model_sizes(s, G), head_groups=G)


def calibrated_seq_len(path):
    """The file's `seq_len` attribute (docs/formats.md 5.3): the longest
    window it was calibrated on, in tokens; None for a file that does not
    record it.  Raises KqsvdError naming the file for a value that is not a
    positive whole number, or that exceeds the file's `tokens` (all the
    tokens it saw; a window is never longer)."""
    with h5io.open_file(path, "projections") as f:
        if "seq_len" not in f.attrs:
            return None
        v = np.asarray(f.attrs["seq_len"])
        tokens = np.asarray(f.attrs.get("tokens", 0))
    if v.shape != () or v.dtype.kind not in "iu" or not 1 <= int(v) <= 1 << 40:
        raise KqsvdError(f"{path}: attribute 'seq_len' = {v.tolist()!r}: expected a positive "
                         "whole number of tokens (at most 2^40)")
    # 0 or a malformed count is "unknown" (the contract's readers judge 'tokens').
    seen = int(tokens) if tokens.shape == () and tokens.dtype.kind in "iu" else 0
    if seen > 0 and int(v) > seen:
        raise KqsvdError(f"{path}: attribute 'seq_len' = {int(v)} exceeds attribute 'tokens' = "
                         f"{seen}: no calibration window is longer than all its tokens")
    return int(v)


def window_warning(path, scored):
    """A warning (str) when the file was calibrated on windows shorter than
    the `scored` tokens a command runs it over, else None.  Projections
    after RoPE calibrated on short windows degrade sharply at long context
    (docs/quantized-cache.md: calibrate at the longest context served)."""
    n = calibrated_seq_len(path)
    if n is None or n >= scored:
        return None
    return (f"{path} was calibrated on windows of {n} tokens, shorter than the {scored} scored "
            "here; calibrate at the longest context served (--seq-len)")


def check_sizes(proj_sizes, proj_path, model_sizes, model_path="the model"):
    """Raises KqsvdError naming both files at the first size (num_layers,
    num_heads, num_kv_heads, head_dim, hidden_size) that differs."""
    for k in h5io.SIZE_ATTRS:
        if proj_sizes[k] != model_sizes[k]:
            raise KqsvdError(f"{proj_path} has {k} = {proj_sizes[k]}, but {model_path} has "
                             f"{model_sizes[k]}: projections of another model")
