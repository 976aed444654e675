"""The latent cache: transformers' dynamic cache layer, holding K A and V A_v
instead of K and V.

transformers calls `update(keys, values, cache_kwargs)` with each new
token's full keys (after RoPE, with the cos and sin that rotated them) and
values; the layer keeps their projections and returns everything it holds,
marked as its own (handoff.py), which the model hands on to the attention
function (function.py).  The rest (sequence length, mask sizes, cropping, beam reordering, batch
repetition) is DynamicLayer's, which works for any last dimension.

QuantLayer holds its columns quantized (quant.py): the latent's with
quantized projections, or the model's own keys and values (QuantCache, a
plain quantized cache to compare with), dequantized whenever they are
returned, except for a decode step the attention function reads as codes
(a decode.Reading of the layer's Columns): the latent's after RoPE, or
QuantCache's inside compressed.reading_codes()."""
from __future__ import annotations

import contextlib
import dataclasses
import threading

import torch
from transformers.cache_utils import Cache

from ..compat import update_places
from ..errors import KqsvdError, UsageError
from .decode import Codes, Reading
from .footprint import referenced_bytes
from .layer import FixedLayer, KqsvdLayer
from .projection import Identity
from .quant import Rows, store


class _Blocks(threading.local):
    depth = 0  # compressed.reading_codes() blocks open in this thread


_BLOCKS = _Blocks()


@contextlib.contextmanager
def codes_block():
    """Inside it, a QuantCache's decode steps (site None) hand their stores
    to the attention function to read as codes: the model attends through
    the kqsvd function there (compressed.reading_codes).  Per thread."""
    _BLOCKS.depth += 1
    try:
        yield
    finally:
        _BLOCKS.depth -= 1


def rotation(site, values, places, past):
    """The cos and sin that rotated new keys, for projections taken before
    RoPE (None, None otherwise): as update() was handed them (compat.Places),
    else made again by the model's rotary embedding at the tokens'
    position_ids; without either, the tokens follow the `past` ones."""
    if not site.P.pre:
        return None, None
    if places.cos is not None:
        return places.cos, places.sin
    pos = places.position_ids
    if pos is None:
        pos = torch.arange(past, past + values.shape[-2], device=values.device)[None]
    return site.rotary(values, pos)


def row_pads(places, T):
    """Each row's padding at a cache's first T tokens: the tokens before its
    last one at position 0, as generate() numbers a left-padded batch
    (cumsum of the mask, the padding at 1) and as key_positions reads
    it.  The positions are the position_ids transformers 5.24 hands
    update(), else the RoPE sines older ones do (zero exactly at position
    0, and only there).  None when no row has padding, or neither is
    given (positions shared by the rows: none is padded)."""
    pos = places.position_ids
    if pos is not None:
        zero = pos.reshape(-1, pos.shape[-1]) == 0
    else:
        sin = places.sin
        if sin is None or sin.dim() != 3:
            return None
        zero = (sin == 0).all(-1)
    if zero.shape[0] == 1 or zero.shape[-1] != T:
        return None
    has = zero.any(-1)
    if T > 1 and bool(has.any()) and not bool(has.all()):
        # A row still all padding: its first token comes in a later chunk,
        # after its padding would have entered the quantization groups.
        row = int((~has).int().argmax())
        raise KqsvdError(f"a left-padded batch prefilled in chunks of {T} tokens: row {row}'s "
                         "padding is longer than the first chunk, which a quantized cache "
                         "cannot tell from its tokens; prefill in one chunk, or in chunks "
                         "longer than the longest padding")
    last = T - 1 - zero.flip(-1).int().argmax(-1)
    pads = torch.where(zero.any(-1), last, 0).tolist()
    return pads if any(pads) else None


class LatentLayer(KqsvdLayer):
    """A cache layer of one attention module; `site` is that module's
    installation (compressed.Site): its projections.  What update()
    returns is handed as this layer's (handoff.py), so the attention
    function knows the tensors it receives are latent."""

    def update(self, key_states, value_states, cache_kwargs=None, *args, kwargs=None, **extra):
        if self.keys is None:
            self.lazy_initialization(key_states, value_states)
        past = self.keys.shape[-2] if self.keys.dim() > 1 else 0  # empty until the first update
        cos, sin = rotation(self.installed(), value_states, update_places(cache_kwargs, kwargs),
                            past)
        kc, vc = self.site.P.project(key_states, value_states, cos, sin)
        self.keys = torch.cat([self.keys, kc], dim=-2)
        self.values = torch.cat([self.values, vc], dim=-2)
        return self.hand(self.keys, self.values)



def reads_codes(site, x, cols):
    """Whether a step of new keys x [b, H, T, d] at `site` attends over the
    codes of `cols` directly (decode.Codes): one new token, keys after
    RoPE (before RoPE every key is rebuilt and rotated, which needs its
    floats), and a decode kernel reading the stores (their kernel.Reader).
    site None: a plain quantized cache, which reads codes inside a
    codes_block()."""
    here = _BLOCKS.depth > 0 if site is None else not site.P.pre and site.probe is None
    return x.shape[-2] == 1 and here and cols.reader.reads


class Columns:
    """Quantized columns of one cache layer, keys and values: a store per
    slice of columns of its own bits (quant.store).  slices: [(cut, key
    runs, value runs)] as LayerProjection.quant_slices() gives them (cut
    None: every column); `dim` the axis the slices lie side by side on
    (1: KV heads; -1: each head's own columns, ranks per head)."""

    def __init__(self, slices, scheme, dim=1):
        self.slices, self.scheme, self.dim = slices, scheme, dim
        self.pad(None)

    def pad(self, pads):
        """Before the first tokens: row i of the batch begins with pads[i]
        tokens of padding, which no store holds (quant.Rows); None: no row
        does."""
        s = self.scheme

        def side(bits, axis):
            if pads is None:
                return store(bits, s.group, axis, s.residual)
            return Rows(lambda: store(bits, s.group, axis, s.residual), pads)
        self.stores = [(side(bk, s.key_axis), side(bv, s.value_axis)) for _, bk, bv in self.slices]

    def append(self, keys, values):
        """Adds new tokens' columns [b, H, T, n] (every slice's)."""
        for (cut, _, _), (sk, sv) in zip(self.slices, self.stores):
            sk.append(keys if cut is None else cut(keys, 0), False)
            sv.append(values if cut is None else cut(values, 1), False)

    def read(self, dtype):
        """Every token's columns, dequantized: (keys, values) [b, H, len, n]."""
        ks = [sk.values(dtype) for sk, _ in self.stores]
        vs = [sv.values(dtype) for _, sv in self.stores]
        if len(ks) == 1:
            return ks[0], vs[0]
        return torch.cat(ks, self.dim), torch.cat(vs, self.dim)

    def __len__(self):
        return len(self.stores[0][0])

    @property
    def reader(self):
        """The stores' kernel.Reader, chosen by the first tokens' device and
        dtype (the same for every store); None before them."""
        return self.stores[0][0].reader

    def nbytes(self, float_bytes=None):
        return sum(s.nbytes(float_bytes) for pair in self.stores for s in pair)


def latent_columns(P, residual=None):
    """The Columns of a latent under LayerProjection P (quantized);
    residual replaces the scheme's."""
    scheme = P.quant if residual is None else dataclasses.replace(P.quant, residual=residual)
    return Columns(P.quant_slices(), scheme, P.slice_axis)


class QuantLayer(FixedLayer):
    """A cache layer holding quantized columns (Columns): `site` a
    compressed.Site whose projections carry bits (the latent's columns,
    per slice of columns of its own bits and ranks), or None with
    `scheme` and `bits` (keys, values) for the model's own keys and
    values."""

    def __init__(self, site=None, scheme=None, bits=None):
        super().__init__(site)
        self.cols = None
        self.scheme, self.bits = scheme, bits

    def lazy_initialization(self, key_states, value_states=None):
        self.dtype, self.device = key_states.dtype, key_states.device
        if self.site is None:
            self.cols = Columns([(None, self.bits[0], self.bits[1])], self.scheme)
        else:
            self.cols = latent_columns(self.site.P)
        self.is_initialized = True

    def update(self, key_states, value_states, cache_kwargs=None, *args, kwargs=None, **extra):
        places = update_places(cache_kwargs, kwargs)
        if self.cols is None:
            self.lazy_initialization(key_states, value_states)
            pads = row_pads(places, key_states.shape[-2])
            if pads is not None:
                self.cols.pad(pads)
        if self.site is not None:
            cos, sin = rotation(self.installed(), value_states, places, self.get_seq_length())
            key_states, value_states = self.site.P.project(key_states, value_states, cos, sin)
        self.cols.append(key_states, value_states)
        if reads_codes(self.site, key_states, self.cols):
            P = Identity(key_states.shape[1]) if self.site is None else self.site.P
            n = self.get_seq_length()
            reading = Reading(((slice(None), (Codes(P, self.cols, scale_queries=True),)),), n)
            return self.hand_shapes(key_states, value_states, n, reading, self.cols.read)
        keys, values = self.cols.read(key_states.dtype)
        if self.site is not None:  # the latent's columns, dequantized
            return self.hand(keys, values)
        return keys, values

    def read(self, dtype):
        """Every token's columns, dequantized: (keys, values) as the model's
        own or the latent's, [b, H, len, n] (ranks per head: each head's
        columns side by side)."""
        return self.cols.read(dtype)

    def get_seq_length(self, *args):
        return 0 if self.cols is None else len(self.cols)

    def nbytes(self, float_bytes=None):
        return 0 if self.cols is None else self.cols.nbytes(float_bytes)


class LatentCache(Cache):
    """A cache of one layer per attention module of a model inside
    kqsvd.compressed(): `layers` as compressed.latent_cache makes them
    (LatentLayer, QuantLayer for quantized projections, tiers.TierLayer
    for a tiered layout)."""

    def __init__(self, layers):
        super().__init__(layers=layers)


class QuantCache(Cache):
    """The model's own keys and values quantized (the plain quantized cache
    kqsvd's latents are compared with): bits (keys, values) under scheme,
    for a model of num_layers layers."""

    def __init__(self, num_layers, scheme, bits):
        super().__init__(layers=[QuantLayer(None, scheme, bits) for _ in range(num_layers)])


def cache_bytes(cache: Cache | tuple | list, float_bytes: int | None = None,
                held: bool = False) -> int:
    """Bytes of memory a transformers cache holds.

    Measured: the storages of every tensor the cache's layers reference,
    each counted once and whole (footprint.py), so that a view of a large
    buffer counts the buffer it keeps alive, and a quantized store counts
    the room its buffers keep for more tokens (at most an eighth of what
    they hold: docs/quantized-cache.md, section 1).  With
    `held`, the bytes of the tokens held instead (codes, scales and
    values of held tokens, without that room): the use, where the default
    is the capacity.  Not collective.

    Parameters
    ----------
    cache : transformers Cache, or tuple or list
        Any Cache whose layers hold tensors (a latent, quantized or tiered
        cache of this package among them); or legacy (keys, values)
        tuples, one per layer.
    float_bytes : int or None
        Bytes per floating-point value held as it came (None or 0: as
        held; 2 counts a float32 model's values as bf16), a rescale of the
        floating storages referenced.  Codes, float16 scales and zeros,
        and integer positions count as stored.
    held : bool
        Count the tokens held (the use) rather than the memory referenced.

    Returns
    -------
    int
        The bytes.

    Raises
    ------
    UsageError
        For a cache that is not one (None, say), or a float_bytes that is
        not a whole number of bytes.

    Examples
    --------
    >>> out = model(ids, use_cache=True)
    >>> from kqsvd.compat import output_cache
    >>> kqsvd.cache_bytes(output_cache(out), float_bytes=2)
    """
    layers = getattr(cache, "layers", None)
    if layers is None and not isinstance(cache, (tuple, list)):
        raise UsageError(f"cache_bytes: cache must be a transformers Cache or a tuple of (keys, "
                         f"values) per layer, not {type(cache).__name__}")
    if float_bytes is not None and (isinstance(float_bytes, bool) or
                                    not isinstance(float_bytes, int) or float_bytes < 0):
        raise UsageError(f"cache_bytes: float_bytes must be a whole number of bytes, not "
                         f"{float_bytes!r}")
    if layers is None:
        if not all(isinstance(kv, (tuple, list)) and all(
                isinstance(t, torch.Tensor) or t is None for t in kv[:2]) for kv in cache):
            raise UsageError("cache_bytes: a legacy cache is a tuple of (keys, values) tensors "
                             "per layer")
        layers = [tuple(kv[:2]) for kv in cache]
    if not held:
        return referenced_bytes(layers, float_bytes)
    # Layers of this package know their tokens from their room; any other
    # (DynamicLayer's concatenations, QuantizedCache's codes) holds no room
    # to leave out, and its use is what it references: counted so, rather
    # than its keys and values alone, which a QuantizedCache empties.
    return sum(layer.nbytes(float_bytes) if hasattr(layer, "nbytes") else
               referenced_bytes([layer], float_bytes) for layer in layers)
