"""The decode step's two reads of quantized columns, in Triton: the same
contract as libkqsvd's kqsvd_codes_scores and kqsvd_codes_weigh (kernel.py),
for tensors on a GPU, or on the CPU under TRITON_INTERPRET=1 (how the tests
and CI run them without one).

A store's buffers are read as they lie, from its kernel.Layout
(docs/quantized-cache.md): codes packed eight at a time into `bits`
bytes, little-endian, so that a row's code i starts at bit i * bits of
the row; float16 scale and zero per group.  Per token (axis "token") a row is one token's columns, a group
`group` adjacent columns; per channel (KIVI's keys, axis "channel") a row
is one channel over a block of `group` tokens, that block its group.
Each tile is decoded in registers and multiplied at once: the cache is
never copied to floating point, in memory or anywhere else.

scores: out[s, i, t] += sum_c q[s, i, c] * x[s, t, c]; one program per
(slice, tile of tokens, block of query rows), the columns looped over.
weigh: out[s, i, c] = sum_t p[s, i, t] * x[s, t, c]; the tokens split
among programs (flash-decoding's split-K: a long cache and a batch of one
still fill the device), each split's partial sum reduced after.

Every launch is preceded by checks of its arguments' shapes, strides,
dtypes and the store's scheme (one function per kind of argument, each a
KqsvdError of one line naming the argument): a kernel trusts the sizes it
is given, and on a GPU a wrong one reads or writes past a buffer.  They
look at metadata only, never at values, so they never wait for the
device."""
import contextlib

import torch
import triton
import triton.language as tl

from ..errors import KqsvdError
from ..formats.quant import AXES, BITS

# Query rows per program: all of a step's (a group's heads times the
# step's tokens) up to BQ_MAX, at least tl.dot's smallest side, 16; the
# value sum decodes each tile once for all of them.
BQ_MIN, BQ_MAX, BT, BC = 16, 64, 64, 32
SPLIT_TOKENS = 1024  # tokens per program of weigh, a multiple of BT
# Sizes that change from step to step or from slice to slice are not
# specialised on (Triton would compile again each time one turns a
# multiple of 16, inside a decode loop); only bits, the group and the
# axis make a kernel of their own.
_RUNTIME = ["nq", "ncols", "ntok", "cap", "pw", "ng"]


@triton.jit
def _decoded(codes, scale, zero, s, t, c, valid, cap, ncols, pw, ng,
             BITS: tl.constexpr, GROUP: tl.constexpr, CHANNEL: tl.constexpr):
    """The values of tokens t and columns c (broadcast against each other)
    of slice s, 0 where not valid, float32 (code * scale + zero)."""
    s = s.to(tl.int64)
    if CHANNEL:  # row: one channel of one block of GROUP tokens
        row = (s * (cap // GROUP) + t // GROUP) * ncols + c
        idx = t % GROUP
        at = row
    else:        # row: one token's columns
        row = s * cap + t
        idx = c
        at = row * ng + c // GROUP
    bit = idx * BITS
    byte = row * pw + bit // 8
    word = tl.load(codes + byte, mask=valid, other=0).to(tl.int32)
    if BITS == 3:  # a 3-bit code may run into the next byte, which the row holds
        word = word | (tl.load(codes + byte + 1, mask=valid & (bit % 8 > 5),
                               other=0).to(tl.int32) << 8)
    code = ((word >> (bit % 8)) & ((1 << BITS) - 1)).to(tl.float32)
    sc = tl.load(scale + at, mask=valid, other=0).to(tl.float32)
    ze = tl.load(zero + at, mask=valid, other=0).to(tl.float32)
    return tl.where(valid, code * sc + ze, 0.0)


@triton.jit(do_not_specialize=_RUNTIME + ["ld_out"])
def _scores(q, out, codes, scale, zero, nq, ncols, ntok, cap, pw, ng, ld_out,
            BITS: tl.constexpr, GROUP: tl.constexpr, CHANNEL: tl.constexpr,
            BQ: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    s = tl.program_id(0)
    t = tl.program_id(1) * BT + tl.arange(0, BT)
    i = tl.program_id(2) * BQ + tl.arange(0, BQ)
    acc = tl.zeros((BQ, BT), dtype=tl.float32)
    for c0 in range(0, ncols, BC):
        c = c0 + tl.arange(0, BC)
        qv = tl.load(q + (s.to(tl.int64) * nq + i[:, None]) * ncols + c[None, :],
                     mask=(i[:, None] < nq) & (c[None, :] < ncols), other=0.0)
        kv = _decoded(codes, scale, zero, s, t[None, :], c[:, None],
                      (c[:, None] < ncols) & (t[None, :] < ntok), cap, ncols, pw, ng,
                      BITS, GROUP, CHANNEL)
        acc += tl.dot(qv, kv, input_precision="ieee")
    at = out + (s.to(tl.int64) * nq + i[:, None]) * ld_out + t[None, :]
    m = (i[:, None] < nq) & (t[None, :] < ntok)
    tl.store(at, tl.load(at, mask=m, other=0.0) + acc, mask=m)


@triton.jit(do_not_specialize=_RUNTIME + ["ld_p", "nslices"])
def _weigh(p, part, codes, scale, zero, nq, ncols, ntok, cap, pw, ng, ld_p, nslices, per_split,
           BITS: tl.constexpr, GROUP: tl.constexpr, CHANNEL: tl.constexpr,
           BQ: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    s = tl.program_id(0)
    split = tl.program_id(1)
    c = tl.program_id(2) * BC + tl.arange(0, BC)
    start = split * per_split
    end = tl.minimum(start + per_split, ntok)
    for i0 in range(0, nq, BQ):
        i = i0 + tl.arange(0, BQ)
        acc = tl.zeros((BQ, BC), dtype=tl.float32)
        for t0 in range(start, end, BT):
            t = t0 + tl.arange(0, BT)
            pv = tl.load(p + (s.to(tl.int64) * nq + i[:, None]) * ld_p + t[None, :],
                         mask=(i[:, None] < nq) & (t[None, :] < end), other=0.0)
            vv = _decoded(codes, scale, zero, s, t[:, None], c[None, :],
                          (t[:, None] < end) & (c[None, :] < ncols), cap, ncols, pw, ng,
                          BITS, GROUP, CHANNEL)
            acc += tl.dot(pv, vv, input_precision="ieee")
        at = part + ((split.to(tl.int64) * nslices + s) * nq + i[:, None]) * ncols + c[None, :]
        tl.store(at, acc, mask=(i[:, None] < nq) & (c[None, :] < ncols))


def _fail(call, what, expected):
    raise KqsvdError(f"triton_decode.{call}: {what}: expected {expected}")


def _shape(t):
    return f"[{', '.join(map(str, t.shape))}]"


def _check_bits(call, bits):
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in BITS:
        _fail(call, f"bits {bits!r}", f"one of {', '.join(map(str, BITS))}")


def _check_group(call, group):
    if isinstance(group, bool) or not isinstance(group, int) or group < 1:
        _fail(call, f"group {group!r}", "a positive integer")


def _check_store(call, lay):
    """The buffers (codes, scale, zero) of a store holding quantized
    tokens, as its kernel.Layout `lay` has them, their layout what the
    kernels index (module docstring): the scheme's, contiguous, for
    `capacity` tokens of which `done` are quantized, and n columns
    (lay.rest's)."""
    bufs = getattr(lay, "buffers", None)
    if bufs is None or not getattr(lay, "done", 0) or bufs[0].dim() < 2:
        _fail(call, f"store {type(lay).__name__}",
              "the kernel.Layout of a quant.Store holding quantized tokens")
    _check_bits(call, lay.bits)
    _check_group(call, lay.group)
    if lay.axis not in AXES:
        _fail(call, f"store axis {lay.axis!r}", f"one of {', '.join(AXES)}")
    codes = bufs[0]
    b, H = codes.shape[:2]
    n, cap = lay.rest.shape[-1], lay.capacity
    if lay.axis == "channel":
        lead, width, groups = (b, H, cap // lay.group, n), lay.group, 1
    else:
        lead, width, groups = (b, H, cap), n, -(-n // lay.group)
    for name, t, dt, last in (("codes", codes, torch.uint8, (width + 7) // 8 * lay.bits),
                              ("scale", bufs[1], torch.float16, groups),
                              ("zero", bufs[2], torch.float16, groups)):
        if t.dtype != dt or tuple(t.shape) != (*lead, last) or not t.is_contiguous() or \
                t.device != codes.device:
            _fail(call, f"store {name} {t.dtype} {_shape(t)}",
                  f"{dt} [{', '.join(map(str, (*lead, last)))}], contiguous, on {codes.device}")
    if lay.done > cap or tuple(lay.rest.shape[:2]) != (b, H):
        _fail(call, f"store of {lay.done} tokens in room for {cap}, rest {_shape(lay.rest)}",
              f"at most {cap} tokens, rest [{b}, {H}, ., {n}]")
    return b, H, n


def _check_operand(call, name, t, lead, last, device, at_least=False):
    """t a float32 tensor [*lead, nq, last] on device (any nq; its last
    size at least `last` when at_least)."""
    ok = isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.dim() == 4 and \
        tuple(t.shape[:2]) == lead and t.device == device and \
        (t.shape[3] >= last if at_least else t.shape[3] == last)
    if not ok:
        got = f"{t.dtype} {_shape(t)} on {t.device}" if isinstance(t, torch.Tensor) else \
            type(t).__name__
        size = f"N >= {last}" if at_least else str(last)
        _fail(call, f"{name} {got}",
              f"torch.float32 [{lead[0]}, {lead[1]}, nq, {size}] on {device}")


def _layout(lay):
    """(packed bytes per row, groups per token row) of a store's buffers
    (its kernel.Layout lay), and its constants: bits, group, axis."""
    n = lay.rest.shape[-1]
    channel = lay.axis == "channel"
    width = lay.group if channel else n
    return ((width + 7) // 8 * lay.bits, -(-n // lay.group)), \
        dict(BITS=lay.bits, GROUP=lay.group, CHANNEL=channel)


def _rows(nq):
    """Query rows per program (BQ)."""
    return min(max(triton.next_power_of_2(nq), BQ_MIN), BQ_MAX)


def scores(lay, q, out):
    """out [b, H, nq, N] += q [b, H, nq, n] (float32) times the first
    lay.done tokens of a store, its kernel.Layout lay, read as codes; out
    float32, contiguous, N >= lay.done.  A non-contiguous q is copied (a step's
    queries, small beside the cache)."""
    b, H, n = _check_store("scores", lay)
    codes, scale, zero = lay.buffers
    _check_operand("scores", "q", q, (b, H), n, codes.device)
    _check_operand("scores", "out", out, (b, H), lay.done, codes.device, at_least=True)
    nq = q.shape[2]
    if out.shape[2] != nq or not out.is_contiguous():
        _fail("scores", f"out {_shape(out)}",
              f"[{b}, {H}, {nq}, N >= {lay.done}] (q's query rows), contiguous")
    if not b * H * nq * n:  # no slices, query rows or columns: nothing to add
        return
    q = q.contiguous()
    sizes, const = _layout(lay)
    BQ = _rows(nq)
    grid = (b * H, triton.cdiv(lay.done, BT), triton.cdiv(nq, BQ))
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():  # Triton: current device
        _scores[grid](q, out, codes, scale, zero, nq, n, lay.done, lay.capacity, *sizes,
                      out.shape[-1], **const, BQ=BQ, BT=BT, BC=BC)


def weigh(lay, p):
    """p [b, H, nq, N] (float32, N >= lay.done) times the first lay.done
    tokens of a store, its kernel.Layout lay, read as codes: [b, H, nq, n]
    float32."""
    b, H, n = _check_store("weigh", lay)
    codes, scale, zero = lay.buffers
    _check_operand("weigh", "p", p, (b, H), lay.done, codes.device, at_least=True)
    nq, N = p.shape[2:]
    if not b * H * nq * n:
        return torch.zeros(b, H, nq, n, dtype=torch.float32, device=p.device)
    p = p.contiguous()
    sizes, const = _layout(lay)
    splits = triton.cdiv(lay.done, SPLIT_TOKENS)
    part = torch.empty(splits, b * H, nq, n, dtype=torch.float32, device=p.device)
    with torch.cuda.device(p.device) if p.is_cuda else contextlib.nullcontext():
        _weigh[(b * H, splits, triton.cdiv(n, BC))](
            p, part, codes, scale, zero, nq, n, lay.done, lay.capacity, *sizes, N, b * H,
            SPLIT_TOKENS, **const, BQ=_rows(nq), BT=BT, BC=BC)
    return (part[0] if splits == 1 else part.sum(0)).view(b, H, nq, n)


@triton.jit
def _round_even(v):
    """Round half to even, as torch.round (libdevice's rint has no
    interpreter counterpart)."""
    f = tl.floor(v)
    d = v - f
    return tl.where(d > 0.5, f + 1.0,
                    tl.where(d < 0.5, f, f + (f.to(tl.int32) & 1).to(tl.float32)))


@triton.jit(do_not_specialize=["n", "nq_rows", "sp_c", "sq_c", "sp_s", "sq_s"])
def _quantize(x, codes, scale, zero, n, nq_rows, sp_c, sq_c, sp_s, sq_s,
              BITS: tl.constexpr, GROUP: tl.constexpr, GP: tl.constexpr, NGP: tl.constexpr,
              N8: tl.constexpr):
    """One row of n values: its groups' float16 zero and scale, then its
    codes packed eight at a time into BITS bytes (quant.quantize)."""
    r = tl.program_id(0).to(tl.int64)
    p, q = r // nq_rows, r % nq_rows
    top = (1 << BITS) - 1
    g = tl.arange(0, NGP)[:, None]
    j = tl.arange(0, GP)[None, :]
    c = g * GROUP + j
    valid = (j < GROUP) & (c < n)
    v = tl.load(x + r * n + c, mask=valid, other=0.0)
    lo = tl.min(tl.where(valid, v, float("inf")), axis=1)
    hi = tl.max(tl.where(valid, v, float("-inf")), axis=1)
    z16 = lo.to(tl.float16)
    s16 = tl.math.div_rn(hi - lo, top * 1.0).to(tl.float16)
    gs = tl.arange(0, NGP)
    at = p * sp_s + q * sq_s + gs
    ng = (n + GROUP - 1) // GROUP
    tl.store(zero + at, z16, mask=gs < ng)
    tl.store(scale + at, s16, mask=gs < ng)
    tl.debug_barrier()  # read back below by other threads, column by column
    # the codes in packing order: chunk k of 8 columns, column 8k + i
    k = tl.arange(0, N8)[:, None]
    i = tl.arange(0, 8)[None, :]
    col = k * 8 + i
    inside = col < n
    xv = tl.load(x + r * n + col, mask=inside, other=0.0)
    sg = tl.load(scale + p * sp_s + q * sq_s + col // GROUP, mask=inside, other=0.0)
    zg = tl.load(zero + p * sp_s + q * sq_s + col // GROUP, mask=inside, other=0.0)
    s = sg.to(tl.float32)
    z = zg.to(tl.float32)
    qv = tl.where(s > 0, _round_even(tl.math.div_rn(xv - z, tl.where(s > 0, s, 1.0))), 0.0)
    code = tl.where(inside, tl.minimum(tl.maximum(qv, 0.0), top * 1.0), 0.0).to(tl.int64)
    word = tl.sum(code << (i * BITS).to(tl.int64), axis=1)  # [N8], 8 codes
    b = tl.arange(0, 8)[None, :]
    byte = ((word[:, None] >> (8 * b).to(tl.int64)) & 255).to(tl.uint8)
    npk = (n + 7) // 8
    tl.store(codes + p * sp_c + q * sq_c + k * BITS + b, byte, mask=(b < BITS) & (k < npk))


def _as_rows(t):
    """t [*lead, width] as (P, Q) rows with a stride each, P the first two
    leading dimensions together (sequences and heads), Q the rest, each
    row's bytes adjacent: the views Store.reserve hands out are such; None
    where t is not."""
    lead = t.shape[:-1]
    P = lead[0] * lead[1] if len(lead) >= 2 else 1
    Q = t.numel() // max(P * t.shape[-1], 1)
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        return None
    try:
        v = t.view(P, Q, t.shape[-1])
    except RuntimeError:
        return None
    return v, v.stride(0), v.stride(1)


def _check_dest(x, bits, group, dest):
    """dest (codes, scale, zero) shaped for quant.quantize(x, bits, group):
    uint8 [*lead, packed bytes] and float16 [*lead, groups], x [*lead, n],
    on x's device."""
    lead, n = tuple(x.shape[:-1]), x.shape[-1]
    if not isinstance(dest, (tuple, list)) or len(dest) != 3:
        _fail("quantize_into", f"dest {type(dest).__name__}", "(codes, scale, zero)")
    for name, t, dt, last in (("codes", dest[0], torch.uint8, (n + 7) // 8 * bits),
                              ("scale", dest[1], torch.float16, -(-n // group)),
                              ("zero", dest[2], torch.float16, -(-n // group))):
        if not isinstance(t, torch.Tensor) or t.dtype != dt or \
                tuple(t.shape) != (*lead, last) or t.device != x.device:
            got = f"{t.dtype} {_shape(t)} on {t.device}" if isinstance(t, torch.Tensor) else \
                type(t).__name__
            _fail("quantize_into", f"dest {name} {got}",
                  f"{dt} [{', '.join(map(str, (*lead, last)))}] on {x.device}")


def quantize_into(x, bits, group, dest):
    """quant.quantize(x, bits, group) written into dest = (codes, scale,
    zero), the same codes, scales and zeros to the bit; x (floating point)
    on the kernels' device.  False (nothing written) where dest's layout is
    not rows (_as_rows) or a row is wider than one program takes."""
    _check_bits("quantize_into", bits)
    _check_group("quantize_into", group)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or not x.dim():
        _fail("quantize_into", f"x {getattr(x, 'dtype', type(x).__name__)}",
              "a floating-point tensor [..., n]")
    _check_dest(x, bits, group, dest)
    n = x.shape[-1]
    if n > 4096 or group > 4096:
        return False
    if not x.numel():  # no rows, or rows of no values: nothing to write
        return True
    rows = [_as_rows(d) for d in dest]
    if any(r is None for r in rows) or rows[1][1:] != rows[2][1:]:
        return False
    (_, sp_c, sq_c), (_, sp_s, sq_s) = rows[0], rows[1]
    xs = x.float().contiguous()
    R = xs.numel() // n
    Q = rows[0][0].shape[1]
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _quantize[(R,)](xs, dest[0], dest[1], dest[2], n, Q, sp_c, sq_c, sp_s, sq_s,
                        BITS=bits, GROUP=group, GP=triton.next_power_of_2(group),
                        NGP=triton.next_power_of_2(-(-n // group)),
                        N8=triton.next_power_of_2(-(-n // 8)))
    return True
