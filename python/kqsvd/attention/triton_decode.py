"""The decode step's two reads of quantized columns, in Triton: the same
contract as libkqsvd's kqsvd_codes_scores and kqsvd_codes_weigh (kernel.py),
for tensors on a GPU, or on the CPU under TRITON_INTERPRET=1 (how the tests
and CI run them without one).

A quant.Store's buffers are read as they lie (docs/quantized-cache.md):
codes packed eight at a time into `bits` bytes, little-endian, so that a
row's code i starts at bit i * bits of the row; float16 scale and zero per
group.  Per token (axis "token") a row is one token's columns, a group
`group` adjacent columns; per channel (KIVI's keys, axis "channel") a row
is one channel over a block of `group` tokens, that block its group.
Each tile is decoded in registers and multiplied at once: the cache is
never copied to floating point, in memory or anywhere else.

scores: out[s, i, t] += sum_c q[s, i, c] * x[s, t, c]; one program per
(slice, tile of tokens, block of query rows), the columns looped over.
weigh: out[s, i, c] = sum_t p[s, i, t] * x[s, t, c]; the tokens split
among programs (flash-decoding's split-K: a long cache and a batch of one
still fill the device), each split's partial sum reduced after."""
import contextlib

import torch
import triton
import triton.language as tl

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


def _layout(st):
    """(packed bytes per row, groups per token row) of a quant.Store's
    buffers, and its constants: bits, group, axis."""
    n = st.rest.shape[-1]
    channel = st.axis == "channel"
    width = st.group if channel else n
    return ((width + 7) // 8 * st.bits, -(-n // st.group)), \
        dict(BITS=st.bits, GROUP=st.group, CHANNEL=channel)


def _rows(nq):
    """Query rows per program (BQ)."""
    return min(max(triton.next_power_of_2(nq), BQ_MIN), BQ_MAX)


def scores(st, q, out):
    """out [b, H, nq, N] += q [b, H, nq, n] (float32, contiguous) times the
    first st.done tokens of quant.Store st, read as codes."""
    codes, scale, zero = st.buffers
    b, H, nq, n = q.shape
    sizes, const = _layout(st)
    BQ = _rows(nq)
    grid = (b * H, triton.cdiv(st.done, BT), triton.cdiv(nq, BQ))
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():  # Triton: current device
        _scores[grid](q, out, codes, scale, zero, nq, n, st.done, st.capacity(), *sizes,
                      out.shape[-1], **const, BQ=BQ, BT=BT, BC=BC)


def weigh(st, p):
    """p [b, H, nq, N] (float32, contiguous) times the first st.done tokens
    of quant.Store st, read as codes: [b, H, nq, n] float32."""
    codes, scale, zero = st.buffers
    b, H, nq, N = p.shape
    n = st.rest.shape[-1]
    sizes, const = _layout(st)
    splits = triton.cdiv(st.done, SPLIT_TOKENS)
    part = torch.empty(splits, b * H, nq, n, dtype=torch.float32, device=p.device)
    with torch.cuda.device(p.device) if p.is_cuda else contextlib.nullcontext():
        _weigh[(b * H, splits, triton.cdiv(n, BC))](
            p, part, codes, scale, zero, nq, n, st.done, st.capacity(), *sizes, N, b * H,
            SPLIT_TOKENS, **const, BQ=_rows(nq), BT=BT, BC=BC)
    return (part[0] if splits == 1 else part.sum(0)).view(b, H, nq, n)

