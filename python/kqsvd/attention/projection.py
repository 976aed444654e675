"""One layer's projections as the model's tensors, and what they compute:
the cache's columns of new keys and values (`project`), and attention
through them (`attend`), in one place for the latent cache, the attention
function and probe mode.

Shapes: keys and values [b, Hkv, T, d]; queries [b, Hq, T, d], Hq = g Hkv.
The cache holds K A and V A_v, [b, Hkv, T, r]; with ranks per head
(`ragged`) each KV head's own columns side by side, [b, 1, T, sum of ranks],
so the cache holds exactly the bytes the ranks say.

Keys before RoPE (`rope == "pre"`, Palu's form): the cache holds k_pre A,
and at attention time every cached key is brought back, RoPE((k_pre A) B^T)
at its own position, and scored against the full post-RoPE queries (no B on
the query side: RoPE does not commute with a projection).  transformers
hands the cache post-RoPE keys with the cos and sin that rotated them;
`unrope` undoes the rotation exactly (up to round-off), partial and scaled
RoPE included."""
import torch

from ..errors import KqsvdError


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


def key_positions(position_ids, T, N):
    """The positions of the N keys a layer attends to, the last T of them the
    current tokens': [b or 1, N].  A dynamic cache keeps keys by index; key n
    sits at the model's position n - (N - 1 - p), p the newest token's
    position (never padding), so left padding shifts each row as the
    model's own positions do."""
    if N == T:
        return position_ids
    offset = (N - 1) - position_ids[:, -1:]
    # Padding keys before a row's first token would get negative positions;
    # the mask hides them, the clamp keeps them in the tables' range.
    return (torch.arange(N, device=position_ids.device)[None] - offset).clamp(min=0)


def fold_o_proj(o_weight, value_up, num_heads):
    """The o_proj weight that takes the compressed head outputs directly.

    o_weight: [D, Hq d] (torch Linear layout); value_up: [Hkv, d, r_v] (B_v
    of one layer).  Returns float64 [D, Hq r_v]: head h's block W_h B_v[g(h)],
    so softmax(.) (V A_v) times it equals softmax(.) (V A_v B_v^T) W_h^T.
    Not collective; raises KqsvdError when the shapes do not match."""
    w = torch.as_tensor(o_weight, dtype=torch.float64)
    bv = torch.as_tensor(value_up, dtype=torch.float64)
    D, hd = w.shape
    hkv, d, r = bv.shape
    if hd != num_heads * d or num_heads % hkv:
        raise KqsvdError(f"fold_o_proj: o_proj is [{D}, {hd}], which does not match {num_heads} "
                         f"heads of d = {d} in {hkv} KV groups")
    blocks = w.view(D, num_heads, d).transpose(0, 1)                      # [Hq, D, d]
    folded = blocks @ bv.repeat_interleave(num_heads // hkv, 0)           # [Hq, D, r]
    return folded.transpose(0, 1).reshape(D, num_heads * r)


class LayerProjection:
    """One layer's matrices as tensors of the model's dtype and device.
    Tuning and allocation replace A, Av, Bq, BkT and BvT by tensors that
    carry gradients; everything here reads them at each call."""

    def __init__(self, proj, layer, heads, dtype, device, o_weight=None, fold=False):
        g = heads // proj.num_kv_heads
        self.g, self.hkv = g, proj.num_kv_heads
        t = lambda a: torch.as_tensor(a, dtype=dtype, device=device)  # noqa: E731
        self.A = t(proj.key_down[layer])                                     # [Hkv, d, rk]
        self.Bq = t(proj.query_down[layer]).repeat_interleave(g, 0)          # [Hq, d, rk]
        self.Av = t(proj.value_down[layer])                                  # [Hkv, d, rv]
        self.BvT = t(proj.value_up[layer]).transpose(1, 2).repeat_interleave(g, 0)  # [Hq, rv, d]
        self.rope = proj.rope
        self.BkT = t(proj.query_down[layer]).transpose(1, 2)               # [Hkv, rk, d]
        self.o_folded = fold_o_proj(o_weight, proj.value_up[layer], heads) if fold else None
        self.ragged = proj.per_head(layer)
        if self.ragged:
            rk, rv = proj.rank_k_heads[layer], proj.rank_v_heads[layer]
            self.rk, self.rv = [int(x) for x in rk], [int(x) for x in rv]
            self.ko = [0] + torch.tensor(self.rk).cumsum(0).tolist()
            self.vo = [0] + torch.tensor(self.rv).cumsum(0).tolist()
            self.A = [self.A[j, :, :r] for j, r in enumerate(self.rk)]
            self.Bq = [t(proj.query_down[layer][j, :, :r]) for j, r in enumerate(self.rk)]
            self.BkT = [b.T for b in self.Bq]
            self.Av = [self.Av[j, :, :r] for j, r in enumerate(self.rv)]
            self.BvT = [t(proj.value_up[layer][j, :, :r]).T for j, r in enumerate(self.rv)]
            if self.o_folded is not None:  # each head's own columns of the padded fold
                wide = int(rv.max())
                cols = [h * wide + c for h in range(heads) for c in range(self.rv[h // g])]
                self.o_folded = self.o_folded[:, cols]
        else:
            self.rk, self.rv = int(self.A.shape[-1]), int(self.Av.shape[-1])
        if self.o_folded is not None:
            self.o_folded = self.o_folded.to(dtype=dtype, device=device)

    @property
    def pre(self):
        return self.rope == "pre"

    def project(self, keys, values, cos=None, sin=None):
        """The cache's columns of keys and values [b, Hkv, T, d] (keys after
        RoPE, rotated by cos and sin, which pre-RoPE projections undo)."""
        if self.pre:
            keys = unrope(keys, cos, sin)
        if self.ragged:
            return (torch.cat([keys[:, j:j + 1] @ a for j, a in enumerate(self.A)], -1),
                    torch.cat([values[:, j:j + 1] @ a for j, a in enumerate(self.Av)], -1))
        return keys @ self.A, values @ self.Av

    def groups(self, q, kc, vc):
        """(queries, cached keys, cached values, B^T or None, Bq or None,
        B_v^T) per group of heads that share one set of ranks: the whole
        layer, or with ranks per head each KV head and its g query heads."""
        if not self.ragged:
            yield q, kc, vc, self.BkT, self.Bq, self.BvT
            return
        g = self.g
        for j in range(self.hkv):
            yield (q[:, j * g:(j + 1) * g], kc[..., self.ko[j]:self.ko[j + 1]],
                   vc[..., self.vo[j]:self.vo[j + 1]], self.BkT[j], self.Bq[j], self.BvT[j])

    def attend(self, attend, q, kc, vc, rotary):
        """Attention through the projections.  attend(q, k, v) -> (out,
        extra) computes one group's attention (queries [b, G, T, w], keys
        and values [b, G/g, N, .]); rotary(x) rotates d-wide keys at their
        positions (pre-RoPE projections).  Returns (heads [b, Hq, T, d],
        folded [b, T, Hq r_v] or None, extras per group)."""
        heads, folded, extras = [], [], []
        for qg, kg, vg, bkT, bq, bvT in self.groups(q, kc, vc):
            if self.pre:
                kk, qq = rotary(kg @ bkT), qg
            else:
                kk, qq = kg, qg @ bq
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
