"""Quantized latents: the scheme a cache quantizes with (docs/quantized-cache.md)
and the bits of each (layer, KV head) unit, as Projections carry them.

A rank policy takes bits after '@': `fixed:32@4` is rank 32 with 4-bit
codes for keys and values, `fixed:32@4/8` 4-bit keys and 8-bit values;
without '@' the latent is held as computed (bits 0)."""
import dataclasses

import numpy as np

from ..errors import KqsvdError, UsageError
from .numbers import whole

BITS = (2, 3, 4, 8)
# One encoding of what a unit or a latent column is held at, in memory and
# in the files written since (docs/formats.md 5.3): codes of BITS bits,
# UNQUANTIZED as computed, DROPPED not cached (a column past its unit's
# rank).  Older files wrote 0 for an unquantized unit (bits_*_heads);
# read_bits takes it as UNQUANTIZED.
UNQUANTIZED, DROPPED = 16, 0
AXES = ("channel", "token")
# Past these a scheme is a typo, and taken literally it sizes buffers by
# them (a group of 10^12 values asked for hundreds of terabytes).
GROUP_MAX = 4096
RESIDUAL_MAX = 1 << 20


@dataclasses.dataclass(frozen=True)
class QuantScheme:
    """How a quantized cache holds its columns: groups of `group` values
    (along the token axis for 'channel', within a token's row for 'token'),
    keys and values each on their own axis, the newest `residual` tokens
    unquantized, and the latent rotated by a Hadamard matrix (folded into
    A and B) when `rotate`."""
    group: int = 32
    key_axis: str = "channel"
    value_axis: str = "token"
    residual: int = 0
    rotate: bool = False

    def check(self, what="the quantization scheme"):
        """self, or UsageError naming `what` for a field out of range."""
        for name, low, high in (("group", 1, GROUP_MAX), ("residual", 0, RESIDUAL_MAX)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not low <= v <= high:
                raise UsageError(f"{what}: {name} {v!r} must be a whole number in {low}..{high}")
        for name in ("key_axis", "value_axis"):
            if getattr(self, name) not in AXES:
                raise UsageError(f"{what}: {name.replace('_', ' ')} {getattr(self, name)!r} must "
                                 f"be one of {', '.join(AXES)}")
        if not isinstance(self.rotate, (bool, np.bool_)):
            raise UsageError(f"{what}: rotate {self.rotate!r} must be true or false")
        return self


def option_bits(r, b, axis, group):
    """Bits per token that r cached columns at b bits take under the scheme
    (codes and scales, docs/quantized-cache.md section 1; 16 per value for
    b UNQUANTIZED)."""
    if b == UNQUANTIZED:
        return 16.0 * r
    if axis == "channel":  # a scale and a zero per column per block of `group` tokens
        return r * b + 32.0 * r / group
    return (r + 7) // 8 * 8 * b + 32.0 * -(-r // group)


# A latent column's bits in a file's per-column form (bits_k_cols).
COL_BITS = (DROPPED,) + BITS + (UNQUANTIZED,)


def off_rank(bits, ranks):
    """The first unit (an index into ranks) whose per-column bits [..., d]
    are not nonzero exactly on its first rank columns, or None when every
    unit keeps that rule."""
    bits = np.asarray(bits)
    bad = (bits != DROPPED) != (np.arange(bits.shape[-1]) < np.asarray(ranks)[..., None])
    hit = np.argwhere(bad.any(-1))
    return tuple(int(i) for i in hit[0]) if len(hit) else None


def column_runs(bits, rank):
    """A unit's cached columns grouped by their bits, for the stores that
    hold them: [(columns int array, bits)], widest first (unquantized, 8,
    4, 3, 2), each run's columns in increasing order.  bits: the unit's one
    number or its columns' ([d], COL_BITS: not DROPPED exactly on the first
    `rank`).  Raises KqsvdError for columns that break that rule."""
    rank = int(rank)
    if np.ndim(bits) == 0:
        return [(np.arange(rank), int(bits))]
    bits = np.asarray(bits)
    if off_rank(bits, rank) is not None:
        raise KqsvdError(f"per-column bits {bits.tolist()}: the first {rank} columns (the rank) "
                         "need bits, the others none")
    runs = []
    for b in sorted(set(bits[:rank].tolist()), reverse=True):
        runs.append((np.flatnonzero(bits[:rank] == b), int(b)))
    return runs


def unit_bits(bits, rank, axis, group):
    """Bits per token a unit's cached columns take: each run of column_runs
    held by a store of its own (option_bits)."""
    return sum(option_bits(len(c), b, axis, group) for c, b in column_runs(bits, rank))


def split_bits(text):
    """'fixed:32@4' -> ('fixed:32', (4, 4)); '...@4/8' -> (..., (4, 8));
    no '@' -> (text, None).  Raises UsageError for bits not among BITS."""
    base, at, bits = text.rpartition("@")
    if not at:
        return text, None
    b = tuple(whole(x) for x in bits.split("/"))  # ASCII digits alone (formats.numbers)
    if len(b) not in (1, 2) or any(x not in BITS for x in b) or not base:
        raise UsageError(f"rank policy {text}: bits after '@' must be one of "
                         f"{', '.join(map(str, BITS))}, or keys/values such as 4/8")
    return base, (b * 2)[:2]


def with_bits(proj, bits, scheme):
    """proj (a Projections) with every unit quantized at bits = (keys,
    values) under scheme, or unquantized for bits None."""
    if bits is None:
        return dataclasses.replace(proj, bits_k=None, bits_v=None, quant=None)
    shape = proj.rank_k_heads.shape
    return dataclasses.replace(proj, bits_k=np.full(shape, bits[0], np.int64),
                               bits_v=np.full(shape, bits[1], np.int64), quant=scheme)


SCHEME_ATTRS = {"quant_group": "group", "quant_key_axis": "key_axis",
                "quant_value_axis": "value_axis", "quant_residual": "residual",
                "quant_rotate": "rotate"}


def read_bits(f, path, method, L, H, d=None, ranks=None):
    """A method group's stored bits and the file's scheme (root attributes
    quant_*), or (None, None, None) for a file without them.  The bits are
    one number per unit (bits_k_heads, bits_v_heads: int [L, Hkv], BITS or
    UNQUANTIZED, an older file's 0 read as UNQUANTIZED) or one per latent
    column (bits_k_cols, bits_v_cols: int [L, Hkv, d] among COL_BITS, not
    DROPPED exactly on the first rank columns of ranks = (rank_k [L, Hkv],
    rank_v)).  Raises KqsvdError naming the dataset or attribute that is
    wrong."""
    forms = [[f"{method}/bits_{s}_{form}" for s in "kv"] for form in ("heads", "cols")]
    have = [n for names in forms for n in names if n in f]
    if not have:
        return None, None, None
    names = forms[0] if have[0].endswith("_heads") else forms[1]
    if sorted(have) != sorted(names):
        raise KqsvdError(f"{path}: group '{method}' has {' and '.join(have)}: give keys and "
                         "values bits of one form, bits_k_heads and bits_v_heads or "
                         "bits_k_cols and bits_v_cols")
    cols = names is forms[1]
    # per unit: 0 is how files before the one encoding said UNQUANTIZED
    shape, allowed = ((L, H, d), COL_BITS) if cols else ((L, H), (0,) + BITS + (UNQUANTIZED,))
    import h5py
    bits = []
    for i, n in enumerate(names):
        if not isinstance(f[n], h5py.Dataset):
            raise KqsvdError(f"{path}: '{n}' is an HDF5 group; expected a dataset of "
                             f"{list(shape)} whole numbers")
        b = f[n][...]
        if b.shape != shape or not np.issubdtype(b.dtype, np.integer) or \
                not np.isin(b, allowed).all():
            raise KqsvdError(f"{path}: dataset '{n}' must be {list(shape)} whole numbers among "
                             f"{', '.join(map(str, allowed))}")
        at = off_rank(b, ranks[i]) if cols else None
        if at is not None:
            l, h = at
            raise KqsvdError(f"{path}: dataset '{n}' gives bits to {(b[l, h] != 0).sum()} columns "
                             f"of layer {l}, KV head {h}, which has rank {ranks[i][l, h]}: the "
                             "first rank columns need bits, the others 0")
        b = b.astype(np.int64)
        bits.append(b if cols else np.where(b == 0, UNQUANTIZED, b))
    return bits[0], bits[1], read_scheme(f, path)


def read_scheme(f, path, why="the file has bits"):
    """The file's quantization scheme (root attributes quant_*); KqsvdError
    naming the attribute that is missing (`why` says what needs it) or
    wrong."""
    kw = {SCHEME_ATTRS[a]: _scheme_attr(f, path, a, why) for a in SCHEME_ATTRS}
    try:
        return QuantScheme(**kw).check(f"{path}: attributes quant_*")
    except UsageError as e:
        raise KqsvdError(str(e)) from None


def _scheme_attr(f, path, attr, why):
    """One quant_* root attribute as QuantScheme takes it: a scalar whole
    number in range (quant_group, quant_residual), 0 or 1 (quant_rotate),
    or one of AXES (the axes); KqsvdError naming the file and attribute
    otherwise.  Checked here because a bad value would otherwise surface
    at the first forward pass, as a TypeError or an allocation of
    terabytes."""
    if attr not in f.attrs:
        raise KqsvdError(f"{path}: attribute '{attr}' is missing ({why})")
    v = f.attrs[attr]
    if attr.endswith("_axis"):
        if isinstance(v, np.ndarray) and v.shape == ():
            v = v.item()
        v = v.decode("utf-8", "replace") if isinstance(v, bytes) else v
        if not isinstance(v, str) or v not in AXES:
            raise KqsvdError(f"{path}: attribute '{attr}' is {_short(v)}, expected one of "
                             f"{', '.join(repr(a) for a in AXES)}")
        return v
    low, high = {"quant_group": (1, GROUP_MAX), "quant_residual": (0, RESIDUAL_MAX),
                 "quant_rotate": (0, 1)}[attr]
    whole = isinstance(v, np.integer) and not isinstance(v, np.bool_)
    if not whole or not low <= int(v) <= high:
        raise KqsvdError(f"{path}: attribute '{attr}' is {_short(v)}, expected one whole number "
                         f"in {low}..{high}")
    return bool(v) if attr == "quant_rotate" else int(v)


def _short(v):
    text = repr(v.tolist() if isinstance(v, np.ndarray) else v)
    return text if len(text) <= 40 else text[:37] + "..."


def write_bits(f, method, bits_k, bits_v, scheme):
    """Writes a method group's bits, [L, Hkv] per unit or [L, Hkv, d] per
    column, and the file's scheme (read_bits' forms)."""
    _drop(f, method)
    for side, b in (("k", bits_k), ("v", bits_v)):
        b = np.asarray(b, dtype=np.int32)
        f[method].create_dataset(f"bits_{side}_{'cols' if b.ndim == 3 else 'heads'}", data=b)
    write_scheme(f, scheme)


def write_scheme(f, scheme):
    """The file's quantization scheme as root attributes quant_*."""
    for attr, key in SCHEME_ATTRS.items():
        v = getattr(scheme, key)
        f.attrs[attr] = np.int32(v) if isinstance(v, (bool, int)) else v


def drop_bits(f, methods):
    """Removes the bits of `methods` (an open file's groups), and the
    scheme's attributes once no group has bits: bits are chosen for the
    ranks they were stored with, and kept under other ranks they would
    price and quantize a latent nobody fitted them for."""
    import h5py
    for m in methods:
        _drop(f, m)
    if not any(isinstance(g, h5py.Group) and ("bits_k_heads" in g or "bits_k_cols" in g or
                                              "tiers" in g.attrs) for g in f.values()):
        for attr in SCHEME_ATTRS:
            if attr in f.attrs:
                del f.attrs[attr]


def _drop(f, method):
    for side in "kv":
        for form in ("heads", "cols"):
            if f"{method}/bits_{side}_{form}" in f:
                del f[method][f"bits_{side}_{form}"]
