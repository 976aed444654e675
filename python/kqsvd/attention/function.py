"""The compressed attention as a transformers attention function, registered
with AttentionInterface (and AttentionMaskInterface: a name unknown there
makes transformers drop the mask, and left padding with it) under NAME.

transformers calls it from each attention module with the queries after
RoPE and with what the cache's update returned: the latent columns of a
cache layer of this package, with a note of what it holds (handoff.py),
or full keys and values (no cache, or a cache of another kind), which it
projects itself, so the result is the same either way.  It knows no
cache class: what a layer holds is in its note.
Scores are (q B)(K A)^T scaled by the module's own scaling (1/sqrt(d),
never 1/sqrt(r)), the weights multiply V A_v, and B_v^T (or the folded
o_proj) takes the result back; all through
torch.nn.functional.scaled_dot_product_attention.

A decode step over a layer that reads its own stores (a quantized latent
read as codes, a plain quantized cache inside reading_codes(), a tiered
cache) is the attention over what the layer's update() said it holds,
in parts (decode.step).

Probe mode (compress(..., probe=True)) measures instead: it computes the
exact and the compressed scores and outputs eagerly, records their
relative squared errors per sequence (err_kq and err_out as `kqsvd
evaluate` defines them: scores after RoPE, W^O without its bias), and
returns the exact output, so every layer sees the full model's inputs."""
import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..compat import attached
from ..errors import KqsvdError
from .decode import step
from .handoff import received
from .projection import key_positions, rope

# The function's name, and the key of what it reads for an attention
# module (compat.attached): the module's compressed.Site while its model
# is compressed, attached and detached by compressed.py alone.
NAME = "kqsvd"


def latent_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                     **kwargs):
    # dropout sixth, as transformers' SDPA function has it: kvpress wraps
    # every registered attention function and passes it by position.
    note, key, value = received(key, value)
    site = attached(module, NAME)
    if note is not None and note.site is None and site is not None:
        # a compressed model given a plain quantized cache: its stores read
        # whole, full keys and values from here
        key, value = note.read(query.dtype)
        note = None
    if note is None and (site is None or site.tiers is not None):
        # a module of a model not (or no longer) compressed; or a tiered
        # one without its cache, which attends as at a prefill: exactly
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      scaling=scaling, dropout=dropout, **kwargs)
    if kwargs.get("softcap") is not None:
        raise KqsvdError("compressed attention does not support logit soft-capping")
    if note is not None and note.site is not site:
        raise KqsvdError("this cache was filled under other projections: start a new one "
                         "(kqsvd.latent_cache) after each compress()")
    drop = dropout if module.training else 0.0
    if note is not None and note.reading is not None:  # a decode step over what the layer holds
        return step(note.reading, query, attention_mask, scaling, drop), None
    if site.probe is not None:
        if note is not None or key.shape[2] != query.shape[2]:
            raise KqsvdError("probe mode measures whole sequences: call the model with "
                             "use_cache=False")
        return _probe(module, site, query, key, value, attention_mask, scaling,
                      _positions(kwargs, query, key))
    if note is not None and note.prefill is not None:
        # a prefill the layer settles once attended (a tiered cache's): it
        # attends exactly, as the model does, and hands the layer its queries
        if scaling is None:
            scaling = query.shape[-1] ** -0.5
        out = sdpa_attention_forward(module, query, key, value, attention_mask,
                                     scaling=scaling, dropout=dropout, **kwargs)
        note.prefill(query, scaling, attention_mask, kwargs.get("position_ids"))
        return out
    return _through(module, site, note is not None, query, key, value, attention_mask,
                    scaling, drop, _positions(kwargs, query, key))


def _positions(kwargs, query, key):
    """The current tokens' positions [b or 1, T]: the model's, else the
    last T of the N keys'."""
    pos = kwargs.get("position_ids")
    if pos is None:
        T, N = query.shape[2], key.shape[2]
        pos = torch.arange(N - T, N, device=query.device)[None]
    return pos


def _through(module, site, latent, query, key, value, mask, scaling, drop, pos):
    """Attention through the site's projections by PyTorch's SDPA: over
    the latent's columns (latent: key and value are a cache layer's), or
    over full keys and values, projected here."""
    P = site.P
    T, N = query.shape[2], key.shape[2]
    # One table of every key's cos and sin per call, for undoing RoPE on
    # full keys and redoing it on the rebuilt ones alike.
    cos, sin = site.rotary(value, key_positions(pos, T, N)) if P.pre else (None, None)
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

    def attend(q, k, v):
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

    heads, folded, _ = P.attend(attend, query, kc, vc, lambda x: rope(x, cos, sin))
    if folded is not None:
        return folded.unsqueeze(2), None
    return heads.transpose(1, 2).contiguous(), None


def _probe(module, site, q, k, v, mask, scaling, pos):
    """Probe mode's measurement (see the module's doc)."""
    P = site.P
    T = q.shape[2]
    cos, sin = site.rotary(v, pos) if P.pre else (None, None)
    kc, vc = P.project(k, v, cos, sin)
    if mask is None:
        mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()[None, None]
    mask = mask[:, :, :, :T]

    def attend(qq, kk, vv):
        rep = qq.shape[1] // kk.shape[1]
        s = qq @ kk.repeat_interleave(rep, 1).transpose(2, 3)
        # as transformers' eager masks: finfo.min rather than -inf, so that
        # a row of padding gives no NaN
        bias = (torch.zeros_like(s).masked_fill(~mask, torch.finfo(s.dtype).min)
                if mask.dtype == torch.bool else mask)
        w = torch.softmax(s * scaling + bias, -1, dtype=torch.float32).to(qq.dtype)
        return w @ vv.repeat_interleave(rep, 1), s

    exact, s = attend(q, k, v)
    approx, _, scores = P.attend(attend, q, kc, vc, lambda x: rope(x, cos, sin))
    s_c = torch.cat(scores, 1)
    b, hq, T, d = exact.shape
    W = module.o_proj.weight if site.o_original is None else site.o_original.weight
    y = exact.transpose(1, 2).reshape(b, T, hq * d) @ W.T
    y_c = approx.transpose(1, 2).reshape(b, T, hq * d) @ W.T
    for i in range(b):
        site.probe.append((float(((s[i] - s_c[i]) ** 2).sum() / (s[i] ** 2).sum()),
                           float(((y[i] - y_c[i]) ** 2).sum() / (y[i] ** 2).sum())))
    return exact.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, latent_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)
