"""One decode step's attention over what a cache layer holds, in parts.

A cache layer whose step reads its own stores (a quantized latent read
as codes, the model's own keys and values quantized, a tiered cache)
says in its update() what it holds, as a Reading (handoff.py carries it
to the attention function): the rows of the batch that hold the same
tokens, and for each the parts that hold them, side by side.  A part is
any object with

    n                  its tokens;
    scores(q, scaling) queries q [b, Hq, T, d] (after RoPE) against them:
                       [b, Hq, T, n], scaled, in float32 at least;
    weigh(p)           weights p [b, Hq, T, n] times their values: the
                       heads' output [b, Hq, T, d] (the folded o_proj's
                       input [b, T, Hq r_v] for a folded layer), scores()
                       having been called first.

Parts here: Codes (quantized columns read through the decode kernels,
under a layer's projections or the identity), Floats (a tier's latent
columns in floating point) and Exact (keys and values as the model gave
them: a tiered cache's window and sinks).  attend() takes one softmax
over all of a row's parts' scores and sums their weighted sums; a new
kind of segment (every prefill token, chosen per step through the
latent) is one more part, with no change here."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F


def gqa_scores(q, k):
    """q [b, Hq, T, w] against k [b, Hk, N, w], Hq a multiple of Hk:
    [b, Hq, T, N].  A KV head's queries are stacked as rows of one product
    (a broadcast batch dimension would copy k for each)."""
    b, hq, T, w = q.shape
    hk = k.shape[1]
    return (q.reshape(b, hk, hq // hk * T, w) @ k.transpose(-1, -2)).view(b, hq, T, -1)


def gqa_weigh(p, v):
    """Weights p [b, Hq, T, N] times values v [b, Hk, N, r]: [b, Hq, T, r]."""
    b, hq, T, N = p.shape
    hk = v.shape[1]
    return (p.reshape(b, hk, hq // hk * T, N) @ v).view(b, hq, T, -1)


def _scaled(s, q, scaling):
    """Scores s taken in q's dtype, in float32 at least and scaled."""
    return s.to(torch.promote_types(q.dtype, torch.float32)) * scaling


class Exact:
    """Keys (after RoPE) and values [b, Hkv, n, d] as the model gave them."""

    def __init__(self, keys, values):
        self.keys, self.values = keys, values
        self.n = keys.shape[-2]

    def scores(self, q, scaling):
        return _scaled(gqa_scores(q, self.keys), q, scaling)

    def weigh(self, p):
        return gqa_weigh(p, self.values)


class Floats:
    """Latent columns kc, vc in floating point under LayerProjection P,
    read in the space each group of heads scores in (P.spaces); rotary(x)
    rotates d-wide keys at their positions (keys before RoPE)."""

    def __init__(self, P, kc, vc, rotary):
        self.P, self.kc, self.vc, self.rotary = P, kc, vc, rotary
        self.n = kc.shape[-2]

    def scores(self, q, scaling):
        self.spaces = list(self.P.spaces(q, self.kc, self.vc, self.rotary))
        return _scaled(torch.cat([gqa_scores(qq, kk) for qq, kk, _, _ in self.spaces], 1), q,
                       scaling)

    def weigh(self, p):
        out, h = [], 0
        for qq, _, vv, bvT in self.spaces:
            out.append(gqa_weigh(p[:, h:h + qq.shape[1]], vv) @ bvT)
            h += qq.shape[1]
        return torch.cat(out, 1)


class Codes:
    """Quantized columns (cache.Columns) under P (a LayerProjection, or
    projection.Identity for the model's own keys and values), read through
    the decode kernels (kernel.py) slice by slice of their stores, keys
    after RoPE.  scale_queries: the scaling multiplies the r-wide queries
    in float32 before the scores are read (a quantized latent cache's
    step); else the scores, read from the queries as they come and taken
    in the queries' dtype, as Exact's and Floats' are (a tier's)."""

    def __init__(self, P, cols, scale_queries=False):
        self.P, self.cols, self.scale_queries = P, cols, scale_queries
        self.n = len(cols)

    def scores(self, q, scaling):
        b, _, T, _ = q.shape
        self.dtype, self.T = q.dtype, T
        qs = self.P.slice_queries(q, self.cols.slices[0][0] is not None)
        parts = []
        for qq, (sk, _) in zip(qs, self.cols.stores):
            qq = qq.float() * scaling if self.scale_queries else qq.float()
            parts.append(sk.scores(qq, torch.zeros(*qq.shape[:3], self.n, dtype=torch.float32,
                                                   device=q.device)))
        # each slice's units and query heads
        self.heads = [(s.shape[1], s.shape[1] * s.shape[2] // T) for s in parts]
        s = [s.view(b, h, T, self.n) for s, (_, h) in zip(parts, self.heads)]
        s = s[0] if len(s) == 1 else torch.cat(s, 1)
        return s if self.scale_queries else _scaled(s.to(q.dtype), q, scaling)

    def weigh(self, p):
        b, T, outs, h = p.shape[0], self.T, [], 0
        for (_, sv), (units, n) in zip(self.cols.stores, self.heads):
            pj = p[:, h:h + n].reshape(b, units, n // units * T, self.n)
            outs.append(sv.weigh(pj).to(self.dtype).reshape(b, n, T, -1))
            h += n
        return self.P.bring_up(outs)


def attend(q, parts, scaling, mask=None, drop=0.0, causal=False, weights=None):
    """Queries q [b, Hq, T, d] over the tokens of `parts`, side by side:
    one softmax over all their scores (mask, boolean or additive, applied
    to them; causal: the last T tokens are the step's own, causal among
    themselves), the weights cast to `weights` (None: as the softmax gives
    them) and dropped out at `drop`, and the sum of the parts' weighted
    sums, the last part's first (the order tiered caches have always
    added them in: their window, then each tier)."""
    s = [part.scores(q, scaling) for part in parts]
    s = s[0] if len(s) == 1 else torch.cat(s, -1)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    T = q.shape[2]
    if causal and T > 1:
        late = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        s[..., -T:] = s[..., -T:].masked_fill(~late, float("-inf"))
    p = torch.softmax(s, -1)
    if weights is not None:
        p = p.to(weights)
    if drop:
        p = F.dropout(p, drop)
    outs, at = [], 0
    for part in parts:
        outs.append(part.weigh(p[..., at:at + part.n]))
        at += part.n
    out = outs[-1]
    for o in outs[:-1]:
        out = out + o
    return out


@dataclasses.dataclass(frozen=True)
class Reading:
    """What a cache layer holds for one step, to be read in parts.

    rows: ((rows, parts), ...): a slice of the batch and the parts that
    hold its tokens (one entry for the whole batch, or one per row of a
    batch whose rows hold tokens of their own).  tokens: the positions a
    mask spans.  selects: the layer holds a choice of the tokens (a
    tiered cache): the step's own tokens are causal among themselves, the
    weights taken in the queries' dtype, and the mask, which cannot be
    applied to tokens not held, is checked by check(mask, b) instead;
    else the mask's last rows are applied and the weights stay float32."""
    rows: tuple
    tokens: int
    selects: bool = False
    check: object = None


def step(reading, q, mask, scaling, drop=0.0):
    """The attention output of queries q [b, Hq, T, d] over `reading`, as
    an attention function returns it: [b, T, Hq, d], or [b, T, 1, Hq r_v]
    through a folded o_proj."""
    if scaling is None:
        scaling = q.shape[-1] ** -0.5
    if reading.check is not None:
        reading.check(mask, q.shape[0])
    m = None
    if mask is not None and not reading.selects:
        m = mask[..., -q.shape[2]:, :reading.tokens]
    outs = [attend(q[rows], parts, scaling, m, drop, reading.selects,
                   q.dtype if reading.selects else None) for rows, parts in reading.rows]
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.unsqueeze(2) if out.dim() == 3 else out.transpose(1, 2).contiguous()
