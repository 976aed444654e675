"""One layer's projections as the model's tensors, and what they compute:
the cache's columns of new keys and values (`project`), and attention
through them (`attend`), in one place for the latent cache, the attention
function and probe mode.

Shapes: keys and values [b, Hkv, T, d]; queries [b, Hq, T, d], Hq = g Hkv.
The cache holds K A and V A_v, [b, Hkv, T, r]; with ranks per head
(`ragged`) each KV head's own columns side by side, [b, 1, T, sum of ranks],
so the cache holds exactly the bytes the ranks say.  Every method works
unit by unit (Unit: heads that share one set of ranks): one unit for a
layer whose heads have the same ranks, one per KV head otherwise; only
the construction tells the two apart.

Head groups (a file with head_groups G, docs/formats.md 5.3): the
projections are the model's group view's, each of its Hkv / G heads a
group of G KV heads whose keys and values enter side by side ([b, Hkv / G,
T, G d], `to_view`), so the cache holds one latent per group, [b, Hkv / G,
T, R].  Query head h of KV head j reads it through the d rows of B (and of
B_v) for j: `per_query` gives every query head its own d x r block, which
for G = 1 is its KV head's whole matrix.

Keys before RoPE (`rope == "pre"`, Palu's form): the cache holds k_pre A,
and at attention time every cached key is brought back, RoPE((k_pre A) B^T)
at its own position, and scored against the full post-RoPE queries (no B on
the query side: RoPE does not commute with a projection).  transformers
hands the cache post-RoPE keys with the cos and sin that rotated them;
`unrope` undoes the rotation exactly (up to round-off), partial and scaled
RoPE included."""
from __future__ import annotations

import numpy as np
import torch

from ..errors import KqsvdError
from ..formats.quant import column_runs
from ..renamed import attribute
from .quant import hadamard


def _rot_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rope(x, cos, sin):
    """x [b, H, N, d] rotated by cos, sin [b or 1, N, rd]; rd < d rotates the
    first rd columns only (Phi-3's partial rotary), as transformers does."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rd = cos.shape[-1]
    xr = x[..., :rd]
    return torch.cat([xr * cos + _rot_half(xr) * sin, x[..., rd:]], dim=-1)


def unrope(x, cos, sin):
    """The inverse of rope(): the rotation by -theta, divided by cos^2 +
    sin^2, which is the square of the attention scaling of scaled RoPE types
    (YaRN, LongRoPE) and 1 otherwise."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rd = cos.shape[-1]
    xr = x[..., :rd]
    back = (xr * cos - _rot_half(xr) * sin) / (cos * cos + sin * sin)
    return torch.cat([back, x[..., rd:]], dim=-1)


def per_query(M, num_heads, head_groups=1):
    """Each query head's d rows of one layer's B or B_v: M [Hkv / G, G d, r]
    (the file's, G = head_groups) gives [Hq, d, r], query head h taking the
    block of its KV head j = h // (Hq / Hkv) in its group (j mod G)."""
    hv, w, r = M.shape
    d, per = w // head_groups, num_heads // hv // head_groups  # query heads per KV head
    return M.reshape(hv, head_groups, d, r).repeat_interleave(per, 1).reshape(num_heads, d, r)


def fold_o_proj(o_weight: torch.Tensor | np.ndarray, value_up: torch.Tensor | np.ndarray,
                num_heads: int, head_groups: int = 1) -> torch.Tensor:
    """The o_proj weight that takes the compressed head outputs directly.

    Head h's block is W_h B_v,j for its KV head j, so softmax(.) (V A_v)
    times it equals softmax(.) (V A_v B_v^T) W_h^T.  Computed in float64.
    Not collective.

    Parameters
    ----------
    o_weight : torch.Tensor or np.ndarray
        One layer's o_proj weight, [D, Hq d] (torch Linear layout).
    value_up : torch.Tensor or np.ndarray
        B_v of the same layer, [Hkv, d, r_v] (Projections.value_up[l]);
        [Hkv / G, G d, r_v] for head groups G.
    num_heads : int
        Hq, the model's query heads.
    head_groups : int
        G, the file's head_groups (1: per head).

    Returns
    -------
    torch.Tensor
        float64 [D, Hq r_v], on the inputs' device (a numpy array's is
        the CPU; torch needs both on one device).

    Raises
    ------
    KqsvdError
        When the shapes do not match.

    Examples
    --------
    >>> W = kqsvd.fold_o_proj(attn.o_proj.weight, proj.value_up[l], proj.num_heads)
    """
    w = torch.as_tensor(o_weight, dtype=torch.float64)
    # B_v comes from the file, on the CPU; o_proj where the model runs.
    bv = torch.as_tensor(value_up, dtype=torch.float64, device=w.device)
    if w.dim() != 2 or bv.dim() != 3:
        raise KqsvdError(f"fold_o_proj: o_proj must be [D, Hq d] and value_up [Hkv, d, r_v], "
                         f"not {list(w.shape)} and {list(bv.shape)}")
    D, hd = w.shape
    hv, gd, r = bv.shape
    d = gd // head_groups
    if hd != num_heads * d or num_heads % (hv * head_groups) or gd % head_groups:
        raise KqsvdError(f"fold_o_proj: o_proj is [{D}, {hd}], which does not match {num_heads} "
                         f"heads of d = {d} in {hv * head_groups} KV groups")
    blocks = w.view(D, num_heads, d).transpose(0, 1)                      # [Hq, D, d]
    folded = blocks @ per_query(bv, num_heads, head_groups)               # [Hq, D, r]
    return folded.transpose(0, 1).reshape(D, num_heads * r)


def rotate(M, ranks):
    """M [H, d, r] float64 with each head j's first ranks[j] columns
    multiplied by the Hadamard matrix of that size (quant.hadamard); or,
    ranks a list of each head's run lengths, each run of columns by its
    own (the columns of one number of bits)."""
    M = M.clone()
    for j, runs in enumerate(ranks):
        at = 0
        for n in ([int(runs)] if np.ndim(runs) == 0 else [int(x) for x in runs]):
            M[j, :, at:at + n] = M[j, :, at:at + n] @ hadamard(n, M.dtype, M.device)
            at += n
    return M


def bit_runs(proj, layer):
    """Each KV head's cached columns of one layer, keys and values, grouped
    by bits (formats.quant.column_runs): (order_k, order_v) [Hkv] lists of
    column orders (the head's first rank columns, widest bits first) and
    (runs_k, runs_v) [Hkv] lists of [(count, bits)]."""
    orders, runs = ([], []), ([], [])
    for side, (bits, ranks) in enumerate(((proj.bits_k, proj.rank_k_heads),
                                          (proj.bits_v, proj.rank_v_heads))):
        for h in range(proj.num_kv_heads):
            got = column_runs(bits[layer, h], ranks[layer, h])
            orders[side].append(np.concatenate([c for c, _ in got]))
            runs[side].append([(len(c), b) for c, b in got])
    return orders, runs


class Unit:
    """Heads of one layer that share one set of ranks: every head of a
    layer whose heads have the same ranks, or one (view) KV head and its
    query heads.  kv, q: its KV heads and query heads (slices); k, v: its
    columns of the cache's row of keys and of values; A, Av [KV heads, d,
    r] (one head's: [d, r]) and, once set_up() has run, Bq, BkT and BvT."""

    def __init__(self, kv, q, k, v, A, Av):
        self.kv, self.q, self.k, self.v, self.A, self.Av = kv, q, k, v, A, Av
        self.Bq = self.BkT = self.BvT = None

    def kv_heads(self, hkv):
        """How many of a layer's hkv (view) KV heads are the unit's."""
        return len(range(hkv)[self.kv])

    def q_heads(self, hq):
        """How many of a layer's hq query heads are the unit's."""
        return len(range(hq)[self.q])


def _heads(x, which):
    """x's heads `which` (a slice of axis 1); x itself for all of them."""
    return x if which == slice(None) else x[:, which]


def _columns(x, which):
    """x's columns `which` (a slice of the last axis); x itself for all."""
    return x if which == slice(None) else x[..., which]


def _joined(parts, dim):
    """The parts side by side along dim (the one part itself, uncopied)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def _of_units(name):
    """A matrix of a LayerProjection, its one unit's or a list of every
    unit's (as with ranks per head, a unit per KV head), read and set."""
    def get(self):
        got = [getattr(u, name) for u in self.units]
        return got if self.ragged else got[0]

    def put(self, value):
        for u, m in zip(self.units, value if self.ragged else [value]):
            setattr(u, name, m)
    return property(get, put)


class LayerProjection:
    """One layer's matrices as tensors of the model's dtype and device.
    Tuning and allocation replace A, Av, Bq, BkT and BvT by tensors that
    carry gradients; everything here reads them at each call."""

    g = attribute("q_per_kv", "LayerProjection.g")  # renamed in 0.5 (d7b91ea)

    def __init__(self, proj, layer, heads, dtype, device, o_weight=None, fold=False):
        G = getattr(proj, "head_groups", 1)
        q_per_kv = heads // proj.num_kv_heads  # of a (view) KV head
        self.q_per_kv, self.hkv, self.G, self.heads = q_per_kv, proj.num_kv_heads, G, heads
        t = lambda a: torch.as_tensor(a, dtype=dtype, device=device)  # noqa: E731
        self.quant = getattr(proj, "quant", None)
        mats = [torch.as_tensor(m[layer], dtype=torch.float64) for m in
                (proj.key_down, proj.query_down, proj.value_down, proj.value_up)]
        if self.quant is not None:
            # Each head's columns of one number of bits side by side, one
            # store each: a permutation of the latent's columns, which
            # changes neither the scores nor the output.
            (ok, ov), (self.runs_k, self.runs_v) = bit_runs(proj, layer)
            mats = [m.clone() for m in mats]  # as_tensor shares the Projections' arrays
            for i, order in zip(range(4), (ok, ok, ov, ov)):
                for h, o in enumerate(order):
                    mats[i][h, :, :len(o)] = mats[i][h, :, torch.as_tensor(o)]
            if self.quant.rotate:  # A H and B H: the same scores, flatter columns to quantize
                rk, rv = self.runs_k, self.runs_v
                mats = [rotate(m, [[n for n, _ in r] for r in runs])
                        for m, runs in zip(mats, (rk, rk, rv, rv))]
        kd, qd, vd, vu = mats
        self.rope = proj.rope
        self.o_folded = fold_o_proj(o_weight, vu, heads, G) if fold else None
        self.ragged = proj.per_head(layer)
        A, Av = t(kd), t(vd)                                                 # [Hkv, d, r]
        if self.ragged:  # a unit per (view) KV head, with its own ranks
            rk, rv = proj.rank_k_heads[layer], proj.rank_v_heads[layer]
            self.rk, self.rv = [int(x) for x in rk], [int(x) for x in rv]
            ko, vo = ([0] + torch.tensor(r).cumsum(0).tolist() for r in (self.rk, self.rv))
            self.units = [Unit(slice(j, j + 1), slice(j * q_per_kv, (j + 1) * q_per_kv),
                               slice(ko[j], ko[j + 1]), slice(vo[j], vo[j + 1]),
                               A[j, :, :self.rk[j]], Av[j, :, :self.rv[j]])
                          for j in range(self.hkv)]
            if self.o_folded is not None:  # each head's own columns of the padded fold
                wide = int(rv.max())
                cols = [h * wide + c for h in range(heads) for c in range(self.rv[h // q_per_kv])]
                self.o_folded = self.o_folded[:, cols]
        else:  # one unit: every head, every column
            self.rk, self.rv = int(A.shape[-1]), int(Av.shape[-1])
            self.units = [Unit(slice(None), slice(None), slice(None), slice(None), A, Av)]
        if self.o_folded is not None:
            self.o_folded = self.o_folded.to(dtype=dtype, device=device)
        self.set_up(t(qd), t(vu))

    def quant_slices(self):
        """[(cut, key runs, value runs)] of each slice of cached columns that
        its own stores hold, runs [(count, bits)] of its columns
        (bit_runs): the whole layer when it is one unit whose heads all
        have the same runs, else each (view) KV head; cut(x, side) takes the
        slice's columns of keys (side 0) or values (side 1)."""
        same = lambda runs: all(r == runs[0] for r in runs)  # noqa: E731
        if len(self.units) == 1 and same(self.runs_k) and same(self.runs_v):
            return [(None, self.runs_k[0], self.runs_v[0])]
        heads = [(u, h) for u in self.units for h in range(u.kv_heads(self.hkv))]
        return [((lambda x, side, u=u, h=h: x[..., (u.k, u.v)[side]][:, h:h + 1]), bk, bv)
                for (u, h), bk, bv in zip(heads, self.runs_k, self.runs_v)]

    @property
    def slice_axis(self):
        """The axis quant_slices()'s slices lie side by side on in the
        cache: the columns, where each is a unit of its own ranks; the KV
        heads of the one unit otherwise."""
        return -1 if len(self.units) > 1 else 1

    def slice_queries(self, q, per_head):
        """Queries after RoPE [b, Hq, T, d] brought down to each slice of
        cached columns (quant_slices) and laid out for the decode kernels:
        [b, KV heads, q_per_kv T, r] per slice, one slice per unit
        (per_head False: a layer of one slice), else each (view) KV head's.
        Keys after RoPE only."""
        b, _, T, _ = q.shape
        g, out = self.q_per_kv, []
        for u in self.units:
            qu = _heads(q, u.q)
            qv = (qu @ u.Bq).reshape(b, qu.shape[1] // g, g * T, -1)
            out += [qv[:, j:j + 1] for j in range(qv.shape[1])] if per_head else [qv]
        return out

    def bring_up(self, outs):
        """Each slice's outputs in the latent, [b, heads, T, rv] in
        slice_queries' order, brought up: the heads' output [b, Hq, T, d]
        through B_v, or the folded o_proj's input [b, T, Hq rv]."""
        ups, at = [], 0
        for u in self.units:  # each unit's slices, its query heads side by side
            n, heads = u.q_heads(self.heads), 0
            mine = []
            while heads < n:
                mine.append(outs[at])
                heads += outs[at].shape[1]
                at += 1
            o = torch.cat(mine, 1)
            if self.o_folded is not None:
                ups.append(o.transpose(1, 2).reshape(o.shape[0], o.shape[2], -1))
            else:
                ups.append(o @ u.BvT)
        return _joined(ups, -1 if self.o_folded is not None else 1)

    def set_up(self, qd, vu):
        """Sets the up-projections from one layer's B and B_v as the file
        has them, [Hkv, d, r] (tuning passes tensors that carry gradients):
        each unit's Bq [query heads, d, rk] (each query head's block), BkT
        [KV heads, rk, d] (keys brought back before RoPE) and BvT [query
        heads, rv, d]; a unit of one KV head of its own ranks takes that
        head's own columns, its BkT [rk, d]."""
        Bq = per_query(qd, self.heads, self.G)
        BkT = qd.transpose(1, 2)
        BvT = per_query(vu, self.heads, self.G).transpose(1, 2)
        for j, u in enumerate(self.units):
            if u.kv == slice(None):
                u.Bq, u.BkT, u.BvT = Bq, BkT, BvT
            else:
                rk, rv = u.A.shape[-1], u.Av.shape[-1]
                u.Bq, u.BkT, u.BvT = Bq[u.q, :, :rk], BkT[j, :rk], BvT[u.q, :rv]

    # The matrices as tuning and allocation read and replace them: the one
    # unit's of a uniform layer, a list of each unit's otherwise.
    A, Av, Bq, BkT, BvT = (_of_units(n) for n in ("A", "Av", "Bq", "BkT", "BvT"))

    @property
    def pre(self):
        return self.rope == "pre"

    def to_view(self, x):
        """[b, Hkv, T, d] -> the group view's [b, Hkv / G, T, G d]: each
        group's heads side by side (x itself for G = 1)."""
        if self.G == 1:
            return x
        b, H, T, d = x.shape
        return x.view(b, H // self.G, self.G, T, d).transpose(2, 3).reshape(
            b, H // self.G, T, self.G * d)

    def from_view(self, x):
        """The inverse of to_view."""
        if self.G == 1:
            return x
        b, hv, T, w = x.shape
        d = w // self.G
        return x.view(b, hv, T, self.G, d).transpose(2, 3).reshape(b, hv * self.G, T, d)

    def project(self, keys, values, cos=None, sin=None):
        """The cache's columns of keys and values [b, Hkv, T, d] (keys after
        RoPE, rotated by cos and sin, which pre-RoPE projections undo)."""
        if self.pre:
            keys = unrope(keys, cos, sin)
        keys, values = self.to_view(keys), self.to_view(values)
        return (_joined([_heads(keys, u.kv) @ u.A for u in self.units], -1),
                _joined([_heads(values, u.kv) @ u.Av for u in self.units], -1))

    def groups(self, q, kc, vc):
        """(queries, cached keys, cached values, B^T, Bq, B_v^T) per unit,
        the heads that share one set of ranks: the whole layer, or with
        ranks per head each KV head and its q_per_kv query heads."""
        for u in self.units:
            yield (_heads(q, u.q), _columns(kc, u.k), _columns(vc, u.v), u.BkT, u.Bq, u.BvT)

    def spaces(self, q, kc, vc, rotary):
        """Attention's inputs per group of heads that share one set of
        ranks (groups): (queries [b, G, T, w], keys [b, G/g, N, w] in the
        space the scores are taken in, values [b, G/g, N, rv], B_v^T
        [G, rv, d]); rotary(x) rotates d-wide keys at their positions.
        Before RoPE each key is brought back, RoPE((k A) B^T), against the
        full queries; after RoPE the queries come down, (q B)."""
        for qg, kg, vg, bkT, bq, bvT in self.groups(q, kc, vc):
            if self.pre:
                # as many value heads as the keys brought back
                yield qg, rotary(self.from_view(kg @ bkT)), vg.repeat_interleave(self.G, 1), bvT
            else:
                yield qg @ bq, kg, vg, bvT

    def attend(self, attend, q, kc, vc, rotary):
        """Attention through the projections.  attend(q, k, v) -> (out,
        extra) computes one group's attention (spaces()).  Returns (heads
        [b, Hq, T, d], folded [b, T, Hq r_v] or None, extras per group)."""
        heads, folded, extras = [], [], []
        for qq, kk, vg, bvT in self.spaces(q, kc, vc, rotary):
            out, extra = attend(qq, kk, vg)                  # [b, G, T, rv]
            extras.append(extra)
            if self.o_folded is not None:
                b, G, T, rv = out.shape
                folded.append(out.transpose(1, 2).reshape(b, T, G * rv))
            else:
                heads.append(out @ bvT)
        if self.o_folded is not None:
            return None, torch.cat(folded, -1), extras
        return torch.cat(heads, 1), None, extras


class Identity:
    """The model's own keys and values of hkv KV heads as a projection, B
    and B_v the identity: a plain quantized cache read as codes
    (decode.Codes) as a latent is."""

    def __init__(self, hkv):
        self.hkv = hkv

    def slice_queries(self, q, per_head):
        """The queries [b, Hq, T, d] as one slice, a KV head's query heads
        stacked as rows: [b, Hkv, Hq / Hkv T, d]."""
        b, Hq, T, d = q.shape
        return [q.reshape(b, self.hkv, Hq // self.hkv * T, d)]

    def bring_up(self, outs):
        """The one slice's outputs [b, Hq, T, d]: the heads' output."""
        return torch.cat(outs, 1)
