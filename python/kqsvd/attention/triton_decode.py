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
import torch
import triton
import triton.language as tl

# 16: tl.dot's smallest side; larger tiles cost registers for no gain at
# the few query rows (a group's heads times the step's tokens) of a step
BQ, BT, BC = 16, 64, 32
SPLIT_TOKENS = 1024  # tokens per program of weigh, a multiple of BT


@triton.jit
def _decoded(codes, scale, zero, s, t, c, valid, cap, ncols,
             BITS: tl.constexpr, GROUP: tl.constexpr, CHANNEL: tl.constexpr,
             PW: tl.constexpr, NG: tl.constexpr):
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
        at = row * NG + c // GROUP
    bit = idx * BITS
    byte = row * PW + bit // 8
    word = tl.load(codes + byte, mask=valid, other=0).to(tl.int32)
    if BITS == 3:  # a 3-bit code may run into the next byte, which the row holds
        word = word | (tl.load(codes + byte + 1, mask=valid & (bit % 8 > 5),
                               other=0).to(tl.int32) << 8)
    code = ((word >> (bit % 8)) & ((1 << BITS) - 1)).to(tl.float32)
    sc = tl.load(scale + at, mask=valid, other=0).to(tl.float32)
    ze = tl.load(zero + at, mask=valid, other=0).to(tl.float32)
    return tl.where(valid, code * sc + ze, 0.0)


@triton.jit
def _scores(q, out, codes, scale, zero, nq, ncols, ntok, cap, ld_out,
            BITS: tl.constexpr, GROUP: tl.constexpr, CHANNEL: tl.constexpr,
            PW: tl.constexpr, NG: tl.constexpr,
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
                      (c[:, None] < ncols) & (t[None, :] < ntok), cap, ncols,
                      BITS, GROUP, CHANNEL, PW, NG)
        acc += tl.dot(qv, kv, input_precision="ieee")
    at = out + (s.to(tl.int64) * nq + i[:, None]) * ld_out + t[None, :]
    m = (i[:, None] < nq) & (t[None, :] < ntok)
    tl.store(at, tl.load(at, mask=m, other=0.0) + acc, mask=m)


@triton.jit
def _weigh(p, part, codes, scale, zero, nq, ncols, ntok, cap, ld_p, nslices, per_split,
           BITS: tl.constexpr, GROUP: tl.constexpr, CHANNEL: tl.constexpr,
           PW: tl.constexpr, NG: tl.constexpr,
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
                          (t[:, None] < end) & (c[None, :] < ncols), cap, ncols,
                          BITS, GROUP, CHANNEL, PW, NG)
            acc += tl.dot(pv, vv, input_precision="ieee")
        at = part + ((split.to(tl.int64) * nslices + s) * nq + i[:, None]) * ncols + c[None, :]
        tl.store(at, acc, mask=(i[:, None] < nq) & (c[None, :] < ncols))


def _layout(st):
    """The constants of one quant.Store's buffers: (bits, group, channel,
    packed bytes per row, groups per token row)."""
    n = st.rest.shape[-1]
    channel = st.axis == "channel"
    width = st.group if channel else n
    return dict(BITS=st.bits, GROUP=st.group, CHANNEL=channel,
                PW=(width + 7) // 8 * st.bits, NG=-(-n // st.group))


def scores(st, q, out):
    """out [b, H, nq, N] += q [b, H, nq, n] (float32, contiguous) times the
    first st.done tokens of quant.Store st, read as codes."""
    codes, scale, zero = st.buffers
    b, H, nq, n = q.shape
    grid = (b * H, triton.cdiv(st.done, BT), triton.cdiv(nq, BQ))
    _scores[grid](q, out, codes, scale, zero, nq, n, st.done, st.capacity(), out.shape[-1],
                  **_layout(st), BQ=BQ, BT=BT, BC=BC)


def weigh(st, p):
    """p [b, H, nq, N] (float32, contiguous) times the first st.done tokens
    of quant.Store st, read as codes: [b, H, nq, n] float32."""
    codes, scale, zero = st.buffers
    b, H, nq, N = p.shape
    n = st.rest.shape[-1]
    splits = triton.cdiv(st.done, SPLIT_TOKENS)
    part = torch.empty(splits, b * H, nq, n, dtype=torch.float32, device=p.device)
    _weigh[(b * H, splits, triton.cdiv(n, BC))](
        p, part, codes, scale, zero, nq, n, st.done, st.capacity(), N, b * H, SPLIT_TOKENS,
        **_layout(st), BQ=BQ, BT=BT, BC=BC)
    return part.sum(0).view(b, H, nq, n)
