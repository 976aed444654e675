"""The attention's activations as the model computes them: each layer's
queries and keys (after RoPE, or before it with keys="pre") and its values,
handed to a sink during the forward pass, and each layer's output
projection.  One implementation for examples/export_hf.py (which writes
them as cache shards) and python -m kqsvd.calibrate_hf (which folds them
into R factors at once)."""
import sys

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
    "pre": before it, as q_proj and k_proj give them (the arguments of the
    rotation), for projections that are fused into k_proj and applied
    before the keys are rotated."""

    def __init__(self, model, mtype, cfg, sink, rope="post"):
        self.sink, self.handles, self.layer = sink, [], None
        self.hq = cfg.num_attention_heads
        self.hkv = getattr(cfg, "num_key_value_heads", None) or self.hq
        self.d = head_dim(getattr(cfg, "_name_or_path", "") or "model", cfg)
        if mtype in ENCODERS:
            self.layers = list(model.encoder.layer)
            for l, lay in enumerate(self.layers):
                att = lay.attention.self
                for kind, mod, h in (("q", att.query, self.hq), ("k", att.key, self.hkv),
                                     ("v", att.value, self.hkv)):
                    self.handles.append(mod.register_forward_hook(self._linear(l, kind, h)))
            return
        self.layers = list(model.layers)
        # Post-RoPE queries and keys are what the module-level
        # apply_rotary_pos_emb returns, pre-RoPE ones what it is given (its
        # q and k, positional or by name); each attention calls it once, so
        # a pre-hook on the attention says which layer the call belongs to.
        self.module = sys.modules[type(self.layers[0].self_attn).__module__]
        self.original = self.module.apply_rotary_pos_emb
        if rope not in ("post", "pre"):
            raise UsageError(f"Capture: rope must be 'post' or 'pre', not {rope!r}")

        def rotate(*args, **kwargs):
            if rope == "pre":
                self.sink(self.layer, "q", args[0] if args else kwargs["q"])
                self.sink(self.layer, "k", args[1] if len(args) > 1 else kwargs["k"])
            q, k = self.original(*args, **kwargs)
            if rope == "post":
                self.sink(self.layer, "q", q)
                self.sink(self.layer, "k", k)
            return q, k

        self.module.apply_rotary_pos_emb = rotate
        for l, lay in enumerate(self.layers):
            self.handles.append(lay.self_attn.register_forward_pre_hook(self._enter(l)))
            att = lay.self_attn
            if hasattr(att, "qkv_proj"):  # Phi-3: one fused projection, values last
                self.handles.append(att.qkv_proj.register_forward_hook(self._fused_v(l)))
            else:
                self.handles.append(att.v_proj.register_forward_hook(self._linear(l, "v", self.hkv)))

    def _enter(self, l):
        def hook(_mod, _inp):
            self.layer = l
        return hook

    def _linear(self, l, kind, heads):
        def hook(_mod, _inp, out):
            b, t, _ = out.shape
            self.sink(l, kind, out.view(b, t, heads, self.d).transpose(1, 2))
        return hook

    def _fused_v(self, l):
        start = (self.hq + self.hkv) * self.d

        def hook(_mod, _inp, out):
            b, t, _ = out.shape
            v = out[..., start:start + self.hkv * self.d]
            self.sink(l, "v", v.reshape(b, t, self.hkv, self.d).transpose(1, 2))
        return hook

    def close(self):
        for h in self.handles:
            h.remove()
        if hasattr(self, "original"):
            self.module.apply_rotary_pos_emb = self.original


def attention_out_proj(model, mtype):
    """Each layer's output projection weight [D, Hq*d] (torch.nn.Linear layout)."""
    if mtype in ENCODERS:
        return [lay.attention.output.dense.weight for lay in model.encoder.layer]
    return [lay.self_attn.o_proj.weight for lay in model.layers]
