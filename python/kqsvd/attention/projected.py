"""Attention through a layer's projections over floating-point keys and
values (function.py's prefill, and the decode steps of a latent that
reads no codes): the latent's columns, or full keys and values projected
here, by PyTorch's scaled_dot_product_attention; or probe mode's eager
measurement of the exact and the compressed attention (function.py's
docstring).  Each computes per unit of the layer (LayerProjection.attend)."""
import torch
import torch.nn.functional as F

from ..errors import KqsvdError
from .projection import rope


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


def attend(module, site, latent, query, key, value, mask, scaling, drop, pos):
    """The attention output [b, T, Hq, d] (or [b, T, 1, Hq r_v] through a
    folded o_proj) of queries [b, Hq, T, d] (after RoPE) over key and
    value: the latent's columns (latent), else full keys and values;
    through site's projections; pos the current tokens' positions (None:
    the last T of the keys').  In probe mode, the exact output, the errors
    recorded."""
    P = site.P
    T, N = query.shape[2], key.shape[2]
    if pos is None:
        pos = torch.arange(N - T, N, device=query.device)[None]
    # One table of every key's cos and sin per call, for undoing RoPE on
    # full keys and redoing it on the rebuilt ones alike.
    cos, sin = site.rotary(value, key_positions(pos, T, N)) if P.pre else (None, None)
    if site.probe is not None:
        return _measure(module, site, query, key, value, mask, scaling, cos, sin)
    if latent:
        kc, vc = key, value
    else:
        if key.shape[-1] != query.shape[-1]:
            raise KqsvdError("this cache was filled under other projections: start a new one "
                             "(kqsvd.latent_cache) after each compress()")
        kc, vc = P.project(key, value, cos, sin)
    if mask is not None and mask.dim() == 4:
        mask = mask[:, :, :, :N]
    causal = mask is None and T > 1 and getattr(module, "is_causal", True)

    def fused(q, k, v):
        # PyTorch's fused kernels want one width for queries, keys and
        # values, and fall back to materialising every score otherwise (at
        # 8k tokens, 7 times the time and 4 times the memory): zero columns
        # pad the narrower side, changing no score and no output column.
        wk, wv = q.shape[-1], v.shape[-1]
        if wk < wv:
            q, k = (F.pad(x, (0, wv - wk)) for x in (q, k))
        elif wv < wk:
            v = F.pad(v, (0, wk - wv))
        gqa = q.shape[1] != k.shape[1]
        if gqa and mask is not None and q.is_cuda:
            # CUDA's fused kernels take no mask with enable_gqa: the math
            # kernel would hold every score of a prefill chunk in float32
            # (34 GB at 2,048 x 16,384 tokens, batch 8, 32 heads); the
            # r-wide latents repeated per query head cost far less.
            k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], 1) for x in (k, v))
            gqa = False
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=drop,
                                             is_causal=causal, scale=scaling, enable_gqa=gqa)
        return out[..., :wv] if wv < wk else out, None

    heads, folded, _ = P.attend(fused, query, kc, vc, lambda x: rope(x, cos, sin))
    if folded is not None:
        return folded.unsqueeze(2)
    return heads.transpose(1, 2).contiguous()


def _measure(module, site, q, k, v, mask, scaling, cos, sin):
    """Probe mode's measurement over whole sequences (N = T): the exact
    and the compressed scores and outputs, eagerly; their relative squared
    errors recorded per sequence in site.probe; the exact output."""
    P = site.P
    T = q.shape[2]
    kc, vc = P.project(k, v, cos, sin)
    if mask is None:
        mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()[None, None]
    mask = mask[:, :, :, :T]

    def eager(qq, kk, vv):
        rep = qq.shape[1] // kk.shape[1]
        s = qq @ kk.repeat_interleave(rep, 1).transpose(2, 3)
        # as transformers' eager masks: finfo.min rather than -inf, so that
        # a row of padding gives no NaN
        bias = (torch.zeros_like(s).masked_fill(~mask, torch.finfo(s.dtype).min)
                if mask.dtype == torch.bool else mask)
        w = torch.softmax(s * scaling + bias, -1, dtype=torch.float32).to(qq.dtype)
        return w @ vv.repeat_interleave(rep, 1), s

    exact, s = eager(q, k, v)
    approx, _, scores = P.attend(eager, q, kc, vc, lambda x: rope(x, cos, sin))
    s_c = torch.cat(scores, 1)
    b, hq, T, d = exact.shape
    W = module.o_proj.weight if site.o_original is None else site.o_original.weight
    y = exact.transpose(1, 2).reshape(b, T, hq * d) @ W.T
    y_c = approx.transpose(1, 2).reshape(b, T, hq * d) @ W.T
    for i in range(b):
        site.probe.append((float(((s[i] - s_c[i]) ** 2).sum() / (s[i] ** 2).sum()),
                           float(((y[i] - y_c[i]) ** 2).sum() / (y[i] ** 2).sum())))
    return exact.transpose(1, 2).contiguous()
