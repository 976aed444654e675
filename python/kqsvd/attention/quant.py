"""Group-wise asymmetric min-max quantization of cached columns, exactly as
docs/quantized-cache.md states it, so that an independent implementation
reproduces every code and every byte.

A row of n values is cut into groups of `group` consecutive values (the
last one shorter when group does not divide n).  Each group keeps its
minimum as `zero` and (max - min) / (2^b - 1) as `scale`, both rounded to
float16; a value x becomes the code clamp(round((x - zero) / scale), 0,
2^b - 1) (round half to even, in float32 from the float16 zero and scale;
code 0 where scale is 0) and comes back as code * scale + zero.  Codes are
packed eight at a time into b bytes, little-endian, each row padded with
zero codes to a multiple of 8.

Keys per channel (KIVI) quantize blocks of `group` tokens, each channel's
`group` values one group; keys or values per token quantize each token's
row.  `Store` holds one side of one cache layer that way."""
import math

import numpy as np
import torch

from ..errors import KqsvdError
from ..formats.quant import AXES, BITS, UNQUANTIZED
from . import kernel


def packed_width(n, bits):
    """Bytes of one packed row of n codes."""
    return (n + 7) // 8 * bits


def pack(codes, bits):
    """uint8 codes [..., n] (each < 2^bits) -> uint8 [..., packed_width(n, bits)]."""
    n = codes.shape[-1]
    pad = (-n) % 8
    c = torch.nn.functional.pad(codes, (0, pad)).to(torch.int64)
    c = c.view(*c.shape[:-1], -1, 8)
    word = (c << (bits * torch.arange(8, device=c.device))).sum(-1, keepdim=True)
    out = (word >> (8 * torch.arange(bits, device=c.device))) & 255
    return out.to(torch.uint8).reshape(*codes.shape[:-1], -1)


def _groups(x, group):
    """x [..., n] as [..., ng, group] with the short last group padded by
    repeating its last value (which changes neither its min nor its max)."""
    n = x.shape[-1]
    pad = (-n) % group
    if pad:
        x = torch.cat([x, x[..., -1:].expand(*x.shape[:-1], pad)], -1)
    return x.view(*x.shape[:-1], -1, group)


def quantize(x, bits, group):
    """Rows x [..., n] in groups of `group` along the last axis -> (packed
    codes uint8 [..., packed_width(n, bits)], scale and zero float16 [...,
    ceil(n / group)]).  Raises KqsvdError for values float16 cannot hold,
    on the CPU: on a GPU the check would wait for the device at every layer
    of every decode step, so there such a value reaches the output as not
    finite, as it would through the full cache."""
    n, top = x.shape[-1], (1 << bits) - 1
    g = _groups(x.float(), group)
    lo, hi = g.amin(-1), g.amax(-1)
    zero, scale = lo.half(), ((hi - lo) / top).half()
    if not x.is_cuda and not (torch.isfinite(zero).all() and torch.isfinite(scale).all()):
        raise KqsvdError("a cached value is not finite or beyond float16's range "
                         "(65504): it cannot be quantized")
    s, z = scale.float()[..., None], zero.float()[..., None]
    q = torch.where(s > 0, torch.round((g - z) / torch.where(s > 0, s, 1.0)), 0.0)
    codes = q.clamp(0, top).to(torch.uint8).view(*x.shape[:-1], -1)[..., :n]
    return pack(codes, bits), scale, zero


def dequantize(packed, scale, zero, bits, group, n, dtype):
    """Rows of n values back from quantize()'s output, as dtype."""
    c = _codes(packed, bits)
    if c.shape[-1] != -(-n // group) * group:  # the packing's padding is not the groups'
        c = torch.nn.functional.pad(c[..., :n], (0, (-n) % group))
    x = c.view(*c.shape[:-1], -1, group).mul_(scale.float()[..., None])
    x = x.add_(zero.float()[..., None]).view(*c.shape[:-1], -1)
    return x[..., :n].to(dtype)


_TABLES = {}


def _codes(packed, bits):
    """Packed rows -> float32 codes [..., packed_width(n, bits) * 8 // bits]
    (the padding codes included).  A table of every byte's codes (2, 4 and
    8 bits; for 3 bits, of every 12-bit half of 3 bytes, 4 codes) replaces
    the shifts: decoding runs at every read of the cache, and the table
    makes it several times faster."""
    width = 12 if bits == 3 else 8
    key = (bits, packed.device)
    if key not in _TABLES:
        word = torch.arange(1 << width, device=packed.device)[:, None]
        shift = bits * torch.arange(width // bits, device=packed.device)
        _TABLES[key] = ((word >> shift) & ((1 << bits) - 1)).float()
    index = packed.int()
    if bits == 3:
        p = index.view(*packed.shape[:-1], -1, 3)
        word = p[..., 0] | (p[..., 1] << 8) | (p[..., 2] << 16)
        index = torch.stack([word & 4095, word >> 12], -1)
    c = torch.nn.functional.embedding(index, _TABLES[key])
    return c.view(*packed.shape[:-1], -1)


def hadamard(n, dtype=torch.float64, device=None):
    """An orthogonal n x n matrix: the normalised Sylvester Hadamard matrix
    when n is a power of 2, else block-diagonal Hadamard blocks of the
    powers of 2 in n's binary form, largest first."""
    blocks, left = [], n
    while left:
        m = 1 << (left.bit_length() - 1)
        h = torch.ones(1, 1, dtype=dtype, device=device)
        while h.shape[0] < m:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        blocks.append(h / math.sqrt(m))
        left -= m
    return torch.block_diag(*blocks)


def own(t):
    """t, or a copy of it where t is a view of a larger buffer: a cache that
    keeps a view keeps the whole buffer alive (the prefill's, held for
    the cache's life, where a few tokens of it were to be held)."""
    if t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.clone(memory_format=torch.contiguous_format)


def room(used, need, unit):
    """Units (tokens, or blocks of `unit` tokens) of room a store's buffers
    keep beyond the `need` they must hold, when they grow from holding
    `used`: an eighth of what they held (appending one token at a time
    would otherwise copy the whole cache at every step), and at least
    min(64 tokens, an eighth of `need`), so that a prefill's buffers keep
    room for the first steps after it.  So the room is never more than an
    eighth of what they hold (docs/quantized-cache.md, section 1)."""
    return max(used // 8, min(64 // unit, need // 8))


def _of_layout(name, doc):
    """A store's property that is its Layout's field `name`: the store
    keeps its state in the record the kernels read."""
    return property(lambda self: getattr(self.layout, name),
                    lambda self, v: setattr(self.layout, name, v), doc=doc)


class Store:
    """One side (keys or values) of one cache layer: rows [b, H, T, n]
    appended token by token, quantized as the scheme says (bits UNQUANTIZED:
    never quantized), the newest
    `residual` tokens (and, per channel, the tokens of a block not yet
    complete) held as they came.  values() is everything held, quantized
    tokens dequantized."""

    def __init__(self, bits, group, axis, residual=0):
        if bits not in BITS + (UNQUANTIZED,) or axis not in AXES or group < 1 or residual < 0:
            raise KqsvdError(f"quantized cache: bits {bits}, group {group}, axis {axis}, "
                             f"residual {residual} is not a scheme (bits {BITS}, axes {AXES})")
        self.layout = kernel.Layout(bits, group, axis)  # the buffers' state, as the kernels read it
        self.residual = residual
        self._dim = -3 if axis == "channel" else -2  # along which the buffers grow
        self._used = 0                               # of the buffers along _dim
        self.reader = None                           # kernel.Reader, from the first tokens

    bits = _of_layout("bits", "The scheme's bits (UNQUANTIZED: never quantized).")
    group = _of_layout("group", "Values per quantization group.")
    axis = _of_layout("axis", "'token' or 'channel' (KIVI's keys: blocks of `group` tokens).")
    rest = _of_layout("rest", "The tokens held as they came, [b, H, t, n].")
    done = _of_layout("done", "Tokens quantized.")
    generation = _of_layout("generation", "Counts the buffers' reallocations.")

    # The quantized tokens, views of the buffers (None before the first):
    # taken when asked, since a decode step asks the kernels, not these.
    codes = property(lambda self: self._view(0))
    scale = property(lambda self: self._view(1))
    zero = property(lambda self: self._view(2))

    @property
    def buffers(self):
        """What the decode kernels read (kernel.py, through the Layout):
        (codes, scale, zero), the buffers laid out for capacity() tokens, of
        which the first `done` are quantized; None before the first.  They
        are replaced when they grow, and `generation` then changes, so that
        a reader may keep what it derives from them (pointers) until it
        does."""
        return self.layout.buffers

    @property
    def _buf(self):
        return self.layout.buffers

    def _view(self, i):
        return self._buf[i].narrow(self._dim, 0, self._used) if self._used else None

    def __len__(self):
        return self.done + (0 if self.rest is None else self.rest.shape[-2])

    def append(self, x, read=True):
        """Adds rows x [b, H, T, n]; returns every token's values [b, H, len, n]
        (None when not `read`)."""
        if self.reader is None:  # the tokens' device and dtype known: chosen once
            self.reader = kernel.reader(x)
        rest = x if self.rest is None or not self.rest.shape[-2] else torch.cat(
            [self.rest, x], -2)
        over = rest.shape[-2] - self.residual
        unit = self.group if self.axis == "channel" else 1
        # No columns (a head of rank 0): nothing to quantize, and the rows
        # held as they came are empty, so they cost nothing.
        coded = self.bits != UNQUANTIZED and x.shape[-1] > 0
        take = max(over, 0) // unit * unit if coded else 0
        if take:
            self._add(rest[..., :take, :])
            rest = rest[..., take:, :]
        self.rest = own(rest)
        return self.values(x.dtype) if read else None

    def _add(self, x):
        if self.axis == "channel":  # blocks of `group` tokens, each channel's one group
            b, H, T, n = x.shape
            x = x.view(b, H, T // self.group, self.group, n).transpose(-1, -2)
        dest, commit = self.reserve(x, -3 if self.axis == "channel" else -2)
        if not self.reader.quantize_into(x, self.bits, self.group, dest):
            for d, t in zip(dest, quantize(x, self.bits, self.group)):
                d.copy_(t)
        commit()
        self.done += x.shape[-2] if self.axis == "token" else x.shape[-3] * self.group

    def reserve(self, x, dim):
        """Room for the codes [..., pw] and scales and zeros [..., groups] of
        rows x [..., n] along dim (tokens, or blocks on the channel axis), in
        buffers that grow by an eighth at a time: appending to tensors one
        token at a time would copy the whole cache at every step.  Returns
        the new part's views (codes, scale, zero) and commit(), after which
        codes, scale and zero are views of everything held, the new part
        included (a failure before it leaves the store as it was)."""
        lead, n = x.shape[:-1], x.shape[-1]
        shapes = [(*lead, packed_width(n, self.bits)), (*lead, -(-n // self.group))]
        used, new = self._used, shapes[0][dim]
        if self._buf is None or used + new > self._buf[0].shape[dim]:
            cap = used + new + room(used, used + new, self.group if dim == -3 else 1)
            bufs = []
            for i, (shape, dt) in enumerate(zip((shapes[0], shapes[1], shapes[1]),
                                                (torch.uint8, torch.float16, torch.float16))):
                shape = list(shape)
                shape[dim] = cap
                buf = torch.empty(shape, dtype=dt, device=x.device)
                if used:
                    buf.narrow(dim, 0, used).copy_((self.codes, self.scale, self.zero)[i])
                bufs.append(buf)
            self.layout.buffers = tuple(bufs)
            self.layout.capacity = cap * self.group if dim == -3 else cap
            self.generation += 1
        bufs = self._buf

        def commit():
            self._used = used + new
        return [b.narrow(dim, used, new) for b in bufs], commit

    def capacity(self):
        """Tokens each (sequence, head) slice's buffers are laid out for."""
        return self.layout.capacity

    def values(self, dtype):
        # Dequantized at every call, never kept: a float copy of the
        # quantized tokens would hold the bytes quantization saves.
        if self.codes is None:
            return self.rest
        n = self.rest.shape[-1]
        if self.axis == "channel":
            blocks = dequantize(self.codes, self.scale, self.zero, self.bits, self.group,
                                self.group, dtype)              # [b, H, nb, n, group]
            b, H, nb = blocks.shape[:3]
            old = blocks.transpose(-1, -2).reshape(b, H, nb * self.group, n)
        else:
            old = dequantize(self.codes, self.scale, self.zero, self.bits, self.group, n, dtype)
        return torch.cat([old, self.rest], -2)

    def scores(self, q, out):
        """out [b, H, nq, N] += q [b, H, nq, n] times every token's columns,
        in float32, read from the codes by the store's reader (kernel.py)."""
        return self.reader.scores([self.layout], [0, q.shape[-1]], q, out)

    def weigh(self, p):
        """p [b, H, nq, N] times every token's columns: [b, H, nq, n] float32."""
        return self.reader.weigh([self.layout], [0, self.rest.shape[-1]], p)

    def nbytes(self, float_bytes=None):
        """Bytes of the tokens held (the store's use, without its buffers'
        room): codes and float16 scales as stored; the tokens held as they
        came at float_bytes per value (their own size when None)."""
        held = 0 if self.codes is None else sum(
            t.numel() * t.element_size() for t in (self.codes, self.scale, self.zero))
        if self.rest is not None:
            held += self.rest.numel() * (float_bytes or self.rest.element_size())
        return held


class RunStore:
    """One side of a cache slice whose columns come in runs of their own
    bits (per-column bits, formats.quant.column_runs): a Store per run of
    `count` adjacent columns, each quantized as if alone."""

    def __init__(self, runs, group, axis, residual=0):
        self.cuts = [0]
        for n, _ in runs:
            self.cuts.append(self.cuts[-1] + n)
        self.parts = [Store(b, group, axis, residual) for _, b in runs]
        self.reader = None  # kernel.Reader, from the first tokens: the runs'

    def __len__(self):
        return len(self.parts[0])

    def append(self, x, read=True):
        """Adds rows x [b, H, T, n]; returns every token's values [b, H, len, n]
        (None when not `read`)."""
        self._chosen(x)
        if not self._together(x):
            got = [s.append(x[..., a:b], read)
                   for s, a, b in zip(self.parts, self.cuts, self.cuts[1:])]
            return torch.cat(got, -1) if read else None
        # Tokens quantized as they come, every run at once: one library call
        # (Reader.quantize_runs) where a call per run cost more than the work.
        got = [s.reserve(x[..., a:b], -2) for s, a, b in zip(self.parts, self.cuts, self.cuts[1:])]
        self.reader.quantize_runs(x, [b - a for a, b in zip(self.cuts, self.cuts[1:])],
                                  [s.bits for s in self.parts], self.parts[0].group,
                                  [dest for dest, _ in got])
        for s, (_, commit), a, b in zip(self.parts, got, self.cuts, self.cuts[1:]):
            commit()
            s.done += x.shape[-2]
            if s.rest is None or s.rest.dtype != x.dtype:
                # nothing held back (_together), as append keeps it: an empty
                # tensor of its own (a view of x would keep x alive)
                s.rest = x.new_empty(*x.shape[:-2], 0, b - a)
        return self.values(x.dtype) if read else None

    def _together(self, x):
        """Whether new tokens x go to every run in one call: quantized as they
        come (token axis, no residual, nothing held back, every run
        quantized) through the library."""
        return all(s.axis == "token" and not s.residual and s.bits != UNQUANTIZED and
                   (s.rest is None or not s.rest.shape[-2]) for s in self.parts) and \
            all(b > a for a, b in zip(self.cuts, self.cuts[1:])) and self._chosen(x).quantizes(x)

    def _chosen(self, x):
        """The runs' kernel.Reader, chosen by the first tokens x."""
        if self.reader is None:
            self.reader = kernel.reader(x)
            for s in self.parts:
                s.reader = self.reader
        return self.reader

    def values(self, dtype):
        return torch.cat([s.values(dtype) for s in self.parts], -1)

    def scores(self, q, out):
        return self.reader.scores([s.layout for s in self.parts], self.cuts, q, out)

    def weigh(self, p):
        return self.reader.weigh([s.layout for s in self.parts], self.cuts, p)

    def nbytes(self, float_bytes=None):
        return sum(s.nbytes(float_bytes) for s in self.parts)


class Rows:
    """One side of a cache slice for a batch whose rows begin with padding
    (left padding: row i's first pads[i] tokens): a store per row (made
    by make()), holding that row's own tokens alone, so that no pad token
    enters a group's scale or zero and each row's key blocks begin at its
    first token, as they would for the row alone.  The pad positions hold
    nothing: they read as zeros (values) and score -inf (scores), and
    their bytes are not held."""

    def __init__(self, make, pads):
        self.pads = [int(p) for p in pads]
        self.rows = [make() for _ in self.pads]

    @property
    def reader(self):
        """The rows' kernel.Reader (each row's store chose the same)."""
        return self.rows[0].reader

    def __len__(self):
        return self.pads[0] + len(self.rows[0])

    def append(self, x, read=True):
        """Adds rows x [b, H, T, n], each row's padding dropped at the first."""
        first = not len(self.rows[0])
        for i, (r, p) in enumerate(zip(self.rows, self.pads)):
            r.append(x[i:i + 1, ..., p if first else 0:, :], False)
        return self.values(x.dtype) if read else None

    def values(self, dtype):
        got = [r.values(dtype) for r in self.rows]
        out = got[0].new_zeros(len(got), got[0].shape[1], len(self), got[0].shape[-1])
        for i, (g, p) in enumerate(zip(got, self.pads)):
            out[i, :, p:] = g[0]
        return out

    def scores(self, q, out):
        """out [b, H, nq, N] += q times each row's tokens' columns, its pad
        positions -inf (a row's own scores are its store's, alone)."""
        for i, (r, p) in enumerate(zip(self.rows, self.pads)):
            n = len(r)
            part = out.new_zeros(1, *out.shape[1:3], n)
            r.scores(q[i:i + 1], part)
            out[i:i + 1, ..., p:p + n] += part
            out[i, ..., :p] = float("-inf")
        return out

    def weigh(self, p):
        return torch.cat([r.weigh(p[i:i + 1, ..., pad:pad + len(r)])
                          for i, (r, pad) in enumerate(zip(self.rows, self.pads))])

    def nbytes(self, float_bytes=None):
        return sum(r.nbytes(float_bytes) for r in self.rows)


def store(spec, group, axis, residual=0):
    """The store of one side of a cache slice: spec the slice's bits (one
    number, BITS or UNQUANTIZED) or its runs [(count, bits)]."""
    if isinstance(spec, (int, np.integer)):
        return Store(int(spec), group, axis, residual)
    if len(spec) == 1:
        return Store(spec[0][1], group, axis, residual)
    return RunStore(spec, group, axis, residual)
