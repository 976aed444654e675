"""The attention's activations as the model computes them: each layer's
queries and keys (after RoPE, or before it with keys="pre") and its values,
handed to a sink during the forward pass, and each layer's output
projection.  One implementation for examples/export_hf.py (which writes
them as cache shards) and python -m kqsvd.calibrate_hf (which folds them
into R factors at once)."""
import sys

from ..compat import (attach, attached, attention_implementation, detach, restore_attention,
                      switch_attention)
from ..errors import UsageError
from ..models import ENCODERS, head_dim

# Where queries and keys are taken in a RoPE decoder: the option's values
# (--keys) and the `rope` attribute each writes (docs/formats.md 5.6).
KEYS = {"post-rope": "post", "pre-rope": "pre"}


def rope_of(mtype, keys, option="--keys"):
    """The `rope` attribute for `keys` ("post-rope" or "pre-rope") on a
    model of type mtype: "post" or "pre" for a RoPE decoder, None for an
    encoder (no RoPE, no attribute).  Raises UsageError for pre-rope on an
    encoder."""
    if mtype in ENCODERS:
        if keys != "post-rope":
            raise UsageError(f"{option} {keys} is for decoders with RoPE; '{mtype}' is an "
                             "encoder without it")
        return None
    return KEYS[keys]


class Capture:
    """Records each layer's Q, K and V as the attention computes them and
    hands them to `sink(layer, kind, tensor [B, H, T, d])`.  rope "post"
    (the default): queries and keys after RoPE, as the scores use them;
    "pre": before it (after q_norm and k_norm where the family has them),
    for projections applied before the keys are rotated.  Close it (or use
    it in a with block) to leave the model as it was.

    Decoders: a transformers attention function (capture_attention,
    registered as CAPTURE + the model's own implementation) receives the
    post-RoPE queries and keys and the values, hands them on, and computes
    the attention as the model's own implementation would, or with
    compute="sdpa" as torch's scaled_dot_product_attention does; keys and
    queries before RoPE come from forward hooks on the modules that make
    them.  Encoders: forward hooks on their query, key and value layers.

    compute="sdpa" is for passes that need the activations and not the
    attention weights (calibration, export): the models load with eager
    attention, which holds a T x T score matrix per head, 2.4 GB a layer
    for SmolLM2 at 8,192 tokens in float32, where SDPA's fused kernels hold
    a block at a time."""

    def __init__(self, model, mtype, cfg, sink, rope="post", compute="own"):
        if rope not in ("post", "pre"):
            raise UsageError(f"Capture: rope must be 'post' or 'pre', not {rope!r}")
        if compute not in ("own", "sdpa"):
            raise UsageError(f"Capture: compute must be 'own' or 'sdpa', not {compute!r}")
        self.sink, self.handles, self.rope, self.cfg = sink, [], rope, cfg
        self.saved, self.sites = None, []
        self.hq = cfg.num_attention_heads
        self.hkv = getattr(cfg, "num_key_value_heads", None) or self.hq
        self.d = head_dim(getattr(cfg, "name_or_path", "") or "model", cfg)
        if mtype in ENCODERS:
            self.layers = list(model.encoder.layer)
            for l, lay in enumerate(self.layers):
                att = lay.attention.self
                for kind, mod, h in (("q", att.query, self.hq), ("k", att.key, self.hkv),
                                     ("v", att.value, self.hkv)):
                    self.handles.append(mod.register_forward_hook(self._linear(l, kind, h)))
            return
        _register()
        self.layers = list(model.layers)
        own = attention_implementation(cfg) or "eager"
        name = CAPTURE + (own if own in ("eager", "sdpa") and compute == "own" else "sdpa")
        for l, lay in enumerate(self.layers):
            att = lay.self_attn
            self.sites.append((att, (self, l)))
            attach(att, CAPTURE, self.sites[-1][1])
            if rope == "pre":
                self._pre_hooks(l, att)
        self.saved = switch_attention(cfg, name)

    def _pre_hooks(self, l, att):
        if hasattr(att, "qkv_proj"):  # Phi-3: one fused projection, queries first
            self.handles.append(att.qkv_proj.register_forward_hook(
                self._slice(l, (("q", 0, self.hq), ("k", self.hq * self.d, self.hkv)))))
            return
        for kind, heads in (("q", self.hq), ("k", self.hkv)):
            norm = getattr(att, f"{kind}_norm", None)  # Qwen3: RoPE acts on the normed rows
            if norm is not None:
                self.handles.append(norm.register_forward_hook(self._normed(l, kind)))
            else:
                self.handles.append(getattr(att, f"{kind}_proj").register_forward_hook(
                    self._linear(l, kind, heads)))

    # Each hook returns its output rebuilt from the views it handed on, so
    # that those views are what the model computes with and a sink that
    # retains their gradients (kqsvd.quality.allocate) gets them.
    def _normed(self, l, kind):
        def hook(_mod, _inp, out):  # [b, T, H, d]
            x = out.transpose(1, 2)
            self.sink(l, kind, x)
            return x.transpose(1, 2)
        return hook

    def _linear(self, l, kind, heads):
        def hook(_mod, _inp, out):
            b, t, _ = out.shape
            x = out.view(b, t, heads, self.d).transpose(1, 2)
            self.sink(l, kind, x)
            return x.transpose(1, 2).reshape(b, t, heads * self.d)
        return hook

    def _slice(self, l, parts):
        import torch  # torch here, not at the top: capture.py is read without it (KEYS, rope_of)

        def hook(_mod, _inp, out):
            b, t, _ = out.shape
            pieces, end = [], 0
            for kind, start, heads in parts:  # adjacent, from column 0
                x = out[..., start:start + heads * self.d].reshape(b, t, heads, self.d)
                x = x.transpose(1, 2)
                self.sink(l, kind, x)
                pieces.append(x.transpose(1, 2).reshape(b, t, heads * self.d))
                end = start + heads * self.d
            return torch.cat(pieces + [out[..., end:]], -1)
        return hook

    def seen(self, l, q, k, v):
        """What the capture attention function receives (the last T keys and
        values are the current tokens')."""
        T = q.shape[2]
        if k.shape[-2] != T:  # a cache's earlier keys before the current ones
            k, v = k[..., -T:, :], v[..., -T:, :]
        if self.rope == "post":
            self.sink(l, "q", q)
            self.sink(l, "k", k)
        self.sink(l, "v", v)

    def close(self):
        for h in self.handles:
            h.remove()
        self.handles = []
        for att, site in self.sites:
            detach(att, CAPTURE, site)
        self.sites = []
        if self.saved is not None:
            restore_attention(self.saved)
            self.saved = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# The capture functions' names' prefix; what they read for an attention
# module, (Capture, layer) while a capture runs, is attached under it.
CAPTURE = "kqsvd_capture_"
_REGISTERED = []


def _capture_with(own):
    """The capture attention function that computes as `own` does."""
    # transformers here, not at the top: capture.py is read without it (KEYS, rope_of)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def capture_attention(module, query, key, value, attention_mask, dropout=0.0, **kwargs):
        # dropout sixth, as transformers' SDPA function has it: kvpress wraps
        # every registered attention function and passes it by position.
        site = attached(module, CAPTURE)
        if site is not None:
            site[0].seen(site[1], query, key, value)
        if own == "sdpa":
            return sdpa_attention_forward(module, query, key, value, attention_mask,
                                          dropout=dropout, **kwargs)
        # the family's own eager attention, as transformers picks it for "eager"
        eager = sys.modules[type(module).__module__].eager_attention_forward
        return eager(module, query, key, value, attention_mask, dropout=dropout, **kwargs)
    return capture_attention


def _register():
    if _REGISTERED:
        return
    _REGISTERED.append(True)
    # transformers here, not at the top: capture.py is read without it (KEYS, rope_of)
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
    for own, mask in (("eager", eager_mask), ("sdpa", sdpa_mask)):
        AttentionInterface.register(CAPTURE + own, _capture_with(own))
        AttentionMaskInterface.register(CAPTURE + own, mask)


def attention_out_proj(model, mtype):
    """Each layer's output projection weight [D, Hq*d] (torch.nn.Linear layout)."""
    if mtype in ENCODERS:
        return [lay.attention.output.dense.weight for lay in model.encoder.layer]
    return [lay.self_attn.o_proj.weight for lay in model.layers]
