"""Compressed attention for transformers' Llama, Mistral and Qwen2.

`compress(model, proj)` replaces every layer's attention forward (eager
attention) by one that keeps only the compressed cache: K A and V A_v, r
columns wide per KV head.  Queries go through B before the scores, so the
scores are (q B)(K A)^T ~ q K^T; the attention weights multiply the
compressed values, and B_v^T returns them to the heads' space before W^O,
or is folded into o_proj (`fold=True`: one [D, Hq r_v] matrix, see
fold_o_proj).  `compress(model, None)` restores the full attention
without re-patching, so one patched model serves many (method, rank)
configurations.  Works with model(...) and generate(); the cache
(transformers' DynamicCache) then holds r-wide tensors, and cache_bytes()
measures them.

Projections of keys taken before RoPE (the file's `rope` attribute is
"pre": `examples/export_hf.py --keys pre-rope` or `calibrate_hf --keys
pre-rope`) are used as Palu uses them: the cache holds the compressed
pre-RoPE keys k_pre A (r columns per KV head; A could as well be fused into
k_proj), and at attention time every cached key is brought back,
k_hat = RoPE((k_pre A) B^T) at its own position, and scored against the
full post-RoPE queries (no B on the query side: RoPE does not commute with
a projection, so it must act on d-wide keys).  The cache does not hold
positions: key n of the cache sits at the model's position n - (c - p),
where c and p are the cache index and position of the newest token (the
model's own positions whenever they are contiguous within a row, left
padding included).  Values are as above.  At full rank A B^T = I, so the
logits are the full model's.

Probe mode (`probe=True`) measures instead of compressing: each layer
computes the exact and the compressed scores and outputs, records their
relative squared errors per sequence (the data contract's err_kq and
err_out, as `kqsvd evaluate` defines them), and passes the exact output on,
so every layer sees the full model's inputs.  Scores are compared after
RoPE for both kinds of projections: those the model really uses.
"""
import contextlib
import inspect
import math
import os
import sys

import torch

from ..compat import check_transformers
from ..errors import KqsvdError, UsageError
from ..models import COMPRESSIBLE
from ..formats.projections import Projections, check_sizes



class LayerProjection:
    """One layer's matrices as tensors of the model's dtype and device."""

    def __init__(self, proj, layer, heads, dtype, device, o_weight=None, fold=False):
        g = heads // proj.num_kv_heads
        t = lambda a: torch.as_tensor(a, dtype=dtype, device=device)  # noqa: E731
        self.A = t(proj.key_down[layer])                                     # [Hkv, d, rk]
        self.Bq = t(proj.query_down[layer]).repeat_interleave(g, 0)          # [Hq, d, rk]
        self.Av = t(proj.value_down[layer])                                  # [Hkv, d, rv]
        self.BvT = t(proj.value_up[layer]).transpose(1, 2).repeat_interleave(g, 0)  # [Hq, rv, d]
        # Pre-RoPE projections: B^T takes each KV head's cached r columns back
        # to d-wide keys, which are then rotated.
        self.rope = proj.rope
        self.BkT = t(proj.query_down[layer]).transpose(1, 2)               # [Hkv, rk, d]
        self.o_folded = fold_o_proj(o_weight, proj.value_up[layer], heads) if fold else None
        # Heads with ranks of their own: the cache holds each KV head's own
        # columns side by side, [b, 1, T, sum of ranks], not the widest.
        self.ragged = proj.per_head(layer)
        if self.ragged:
            rk, rv = proj.rank_k_heads[layer], proj.rank_v_heads[layer]
            self.rk, self.rv = [int(x) for x in rk], [int(x) for x in rv]
            self.ko = [0] + list(torch.tensor(self.rk).cumsum(0).tolist())
            self.vo = [0] + list(torch.tensor(self.rv).cumsum(0).tolist())
            self.A = [self.A[j, :, :r] for j, r in enumerate(self.rk)]
            self.Bq = [t(proj.query_down[layer][j, :, :r]) for j, r in enumerate(self.rk)]
            self.BkT = [b.T for b in self.Bq]
            self.Av = [self.Av[j, :, :r] for j, r in enumerate(self.rv)]
            self.BvT = [t(proj.value_up[layer][j, :, :r]).T for j, r in enumerate(self.rv)]
            if self.o_folded is not None:  # each head's own columns of the padded fold
                wide = int(rv.max())
                cols = [h * wide + c for h in range(heads) for c in range(self.rv[h // g])]
                self.o_folded = self.o_folded[:, cols]
        if self.o_folded is not None:
            self.o_folded = self.o_folded.to(dtype=dtype, device=device)


def fold_o_proj(o_weight, value_up, num_heads):
    """The o_proj weight that takes the compressed head outputs directly.

    o_weight: [D, Hq d] (torch Linear layout); value_up: [Hkv, d, r_v] (B_v
    of one layer).  Returns [D, Hq r_v]: head h's block W_h B_v[g(h)], so
    softmax(.) (V A_v) times it equals softmax(.) (V A_v B_v^T) W_h^T."""
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


def _layers(model):
    base = getattr(model, "model", model)
    mtype = getattr(model.config, "model_type", None)
    if mtype not in COMPRESSIBLE or not hasattr(base, "layers"):
        raise KqsvdError(f"compressed attention supports {', '.join(COMPRESSIBLE)} decoders, "
                         f"not '{mtype}'")
    return list(base.layers)


def _rope(attn, q, k, v, position_ids, position_embeddings, past, seq_len):
    """The family's own rotary embedding, called as its attention does."""
    module = sys.modules[type(attn).__module__]
    params = inspect.signature(attn.rotary_emb.forward).parameters
    if "seq_len" in params and "position_ids" not in params:  # Qwen2 in transformers 4.44
        total = seq_len + (past.get_usable_length(seq_len, attn.layer_idx) if past is not None else 0)
        cos, sin = attn.rotary_emb(v, seq_len=total)
        return module.apply_rotary_pos_emb(q, k, cos, sin, position_ids)
    cos, sin = position_embeddings if position_embeddings is not None else \
        attn.rotary_emb(v, position_ids)
    return module.apply_rotary_pos_emb(q, k, cos, sin)


def _rotate(attn, x, positions):
    """x [b, H, N, d] rotated at positions [b or 1, N] by the family's own
    rotary embedding and apply_rotary_pos_emb (keys of a pre-RoPE cache)."""
    module = sys.modules[type(attn).__module__]
    params = inspect.signature(attn.rotary_emb.forward).parameters
    if "seq_len" in params and "position_ids" not in params:  # Qwen2 in transformers 4.44
        cos, sin = attn.rotary_emb(x, seq_len=int(positions.max()) + 1)
        return module.apply_rotary_pos_emb(x, x, cos, sin, positions)[0]
    cos, sin = attn.rotary_emb(x, positions)
    return module.apply_rotary_pos_emb(x, x, cos, sin)[0]


def _key_positions(position_ids, cache_position, T, N, device):
    """The positions of the N keys a layer attends to, the last T of them the
    current tokens': [b or 1, N].  The cache keeps keys by cache index; the
    model's position of index n is n minus its row's offset between cache
    index and position (left padding shifts it), read off the newest token,
    which is never padding."""
    if position_ids is None:
        position_ids = torch.arange(N - T, N, device=device)[None]
    if N == T:
        return position_ids
    last = cache_position[-1] if cache_position is not None else N - 1
    offset = last - position_ids[:, -1:]
    # Padding keys before a row's first token would get negative positions;
    # the mask hides them, the clamp keeps them in the tables' range.
    return (torch.arange(N, device=device)[None] - offset).clamp(min=0)


def _forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None,
             output_attentions=False, use_cache=False, cache_position=None,
             position_embeddings=None, **kwargs):
    P = self._kqsvd
    if P is None:
        return self._kqsvd_forward(hidden_states, attention_mask=attention_mask,
                                   position_ids=position_ids, past_key_value=past_key_value,
                                   output_attentions=output_attentions, use_cache=use_cache,
                                   cache_position=cache_position,
                                   **({"position_embeddings": position_embeddings}
                                      if position_embeddings is not None else {}), **kwargs)
    b, T, _ = hidden_states.shape
    hq, hkv, d = self.num_heads, self.num_key_value_heads, self.head_dim
    q = self.q_proj(hidden_states).view(b, T, hq, d).transpose(1, 2)
    k = self.k_proj(hidden_states).view(b, T, hkv, d).transpose(1, 2)
    v = self.v_proj(hidden_states).view(b, T, hkv, d).transpose(1, 2)
    k_pre = k
    q, k = _rope(self, q, k, v, position_ids, position_embeddings, past_key_value, T)
    g = hq // hkv
    pre = P.rope == "pre"
    keys = k_pre if pre else k                     # what A compresses
    if P.ragged:
        kc = torch.cat([keys[:, j:j + 1] @ a for j, a in enumerate(P.A)], -1)  # [b, 1, T, sum rk]
        vc = torch.cat([v[:, j:j + 1] @ a for j, a in enumerate(P.Av)], -1)
    else:
        kc, vc = keys @ P.A, v @ P.Av              # what the cache holds: [b, Hkv, T, r]
    if past_key_value is not None:
        kc, vc = past_key_value.update(kc, vc, self.layer_idx, {"cache_position": cache_position})
    N = kc.shape[-2]
    mask = attention_mask[:, :, :, :N] if attention_mask is not None else None
    if pre:  # every cached key back to d columns, rotated at its position
        if P.ragged:
            k_hat = torch.cat([kc[..., P.ko[j]:P.ko[j + 1]] @ P.BkT[j] for j in range(hkv)], 1)
        else:
            k_hat = kc @ P.BkT                      # [b, Hkv, N, d]
        k_hat = _rotate(self, k_hat, _key_positions(position_ids, cache_position, T, N,
                                                    k_hat.device))

    def attend(qq, kk, vv, rep=g):
        s = qq @ kk.repeat_interleave(rep, 1).transpose(2, 3)
        w = s / math.sqrt(d)
        if mask is not None:
            w = w + mask
        w = torch.nn.functional.softmax(w, dim=-1, dtype=torch.float32).to(qq.dtype)
        return s, w, w @ vv.repeat_interleave(rep, 1)

    if P.ragged:  # each KV group with its own ranks, its query heads together
        parts = [attend(q[:, j * g:(j + 1) * g] if pre else q[:, j * g:(j + 1) * g] @ P.Bq[j],
                        k_hat[:, j:j + 1] if pre else kc[..., P.ko[j]:P.ko[j + 1]],
                        vc[..., P.vo[j]:P.vo[j + 1]]) for j in range(hkv)]
        s_c, w = torch.cat([x[0] for x in parts], 1), torch.cat([x[1] for x in parts], 1)
        oc = torch.cat([x[2].transpose(1, 2).reshape(b, T, -1) for x in parts], -1)
        heads = torch.cat([x[2] @ P.BvT[j] for j, x in enumerate(parts)], 1)
    else:
        s_c, w, oc = attend(q, k_hat, vc) if pre else attend(q @ P.Bq, kc, vc)  # oc: [b, Hq, T, rv]
        heads = oc @ P.BvT                          # back to [b, Hq, T, d]
        oc = oc.transpose(1, 2).reshape(b, T, -1)
    if self._kqsvd_probe is not None:
        return _probe(self, attend(q, k, v), s_c, heads, past_key_value, N)
    if P.o_folded is not None:
        out = oc @ P.o_folded.T
        if self.o_proj.bias is not None:
            out = out + self.o_proj.bias
    else:
        out = self.o_proj(heads.transpose(1, 2).reshape(b, T, hq * d))
    return out, (w if output_attentions else None), past_key_value


def _probe(self, exact_attn, s_c, heads_c, past_key_value, keys):
    """Probe mode: records the score and output errors of each sequence
    (err_kq and err_out, W^O without its bias as the contract has it) and
    returns the exact output, so the next layer sees the full model's."""
    s, _, exact = exact_attn
    b, hq, T, d = exact.shape
    if past_key_value is not None and keys != T:
        raise KqsvdError("probe mode measures whole sequences; call the model without a cache")
    wo = self.o_proj.weight
    y = exact.transpose(1, 2).reshape(b, T, hq * d) @ wo.T
    y_c = heads_c.transpose(1, 2).reshape(b, T, hq * d) @ wo.T
    for i in range(b):
        self._kqsvd_probe.append((
            float(((s[i] - s_c[i]) ** 2).sum() / (s[i] ** 2).sum()),
            float(((y[i] - y_c[i]) ** 2).sum() / (y[i] ** 2).sum())))
    out = y if self.o_proj.bias is None else y + self.o_proj.bias
    return out, None, past_key_value


def compress(model, proj, fold=False, probe=False):
    """Installs `proj` (a Projections, see load_projections) in every layer's
    attention, or the full attention again when proj is None.  Not
    collective; not thread-safe.  fold: fold B_v into o_proj.  probe:
    measure (see the module's doc) instead of compressing; read the result
    with probe_errors().  Raises KqsvdError for an unsupported model or
    projections of another shape."""
    if proj is not None and not isinstance(proj, Projections):
        hint = " (a path: load it with kqsvd.load_projections first)" if isinstance(
            proj, (str, os.PathLike)) else ""
        raise UsageError(f"compress: proj must be a Projections from kqsvd.load_projections, or "
                         f"None, not {type(proj).__name__}{hint}")
    check_transformers()
    layers = _layers(model)
    cfg = model.config
    if proj is not None:
        hq = cfg.num_attention_heads
        check_sizes(proj.sizes(), proj.path, dict(
            num_layers=len(layers), num_heads=hq,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or hq,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // hq,
            hidden_size=cfg.hidden_size))
    p = next(model.parameters())
    # Every layer's matrices are built before any layer changes, so that an
    # error leaves the model as it was.
    built = [None if proj is None else LayerProjection(
        proj, l, layer.self_attn.num_heads, p.dtype, p.device,
        layer.self_attn.o_proj.weight.detach(), fold) for l, layer in enumerate(layers)]
    if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
        cfg.pretraining_tp = 1  # the same function computed in one piece
    # The decoder builds an explicit 4-D causal mask only for eager attention;
    # sdpa may pass none and rely on is_causal, which this forward does not see.
    cfg._attn_implementation = "eager"
    for layer, lp in zip(layers, built):
        attn = layer.self_attn
        if not hasattr(attn, "_kqsvd_forward"):
            attn._kqsvd_forward = attn.forward
            attn.forward = _forward.__get__(attn)
        attn._kqsvd = lp
        attn._kqsvd_probe = [] if (probe and proj is not None) else None
    return model


_CONFIG_FIELDS = ("_attn_implementation_internal", "pretraining_tp")
_LAYER_FIELDS = ("forward", "_kqsvd_forward", "_kqsvd", "_kqsvd_probe")
_MISSING = object()


@contextlib.contextmanager
def compressed(model, proj, fold=False, probe=False):
    """with compressed(model, proj): the model attends through `proj` (as
    compress() installs it) inside the block and is exactly as it was
    after it: the attention modules' own forward, the config's fields,
    any projections installed before.  Everything is built and checked
    before anything changes, so an error leaves the model untouched.
    Yields the model.  Not collective; not thread-safe."""
    cfg = model.config
    saved_cfg = {k: cfg.__dict__.get(k, _MISSING) for k in _CONFIG_FIELDS}
    saved = [{k: layer.self_attn.__dict__.get(k, _MISSING) for k in _LAYER_FIELDS}
             for layer in _layers(model)]
    compress(model, proj, fold=fold, probe=probe)
    try:
        yield model
    finally:
        for k, v in saved_cfg.items():
            if v is _MISSING:
                cfg.__dict__.pop(k, None)
            else:
                cfg.__dict__[k] = v
        for layer, fields in zip(_layers(model), saved):
            for k, v in fields.items():
                if v is _MISSING:
                    layer.self_attn.__dict__.pop(k, None)
                else:
                    layer.self_attn.__dict__[k] = v


def probe_errors(model):
    """After a probe run: per layer, the list of (err_kq, err_out) of each
    sequence seen since compress(..., probe=True)."""
    return [list(layer.self_attn._kqsvd_probe or []) for layer in _layers(model)]


def cache_bytes(cache):
    """Bytes held by a transformers cache (DynamicCache or legacy tuples)."""
    if hasattr(cache, "key_cache"):
        tensors = list(cache.key_cache) + list(cache.value_cache)
    else:
        tensors = [t for kv in cache for t in kv]
    return sum(t.numel() * t.element_size() for t in tensors)
