"""Per-architecture knowledge behind :mod:`kqsvd.models.gguf_loader`.

For every llama.cpp ``general.architecture`` the loader accepts, this module
knows which ``{arch}.*`` metadata fields and which tensors llama.cpp's
``convert_hf_to_gguf.py`` writes, how the tensors' layout differs from the
Hugging Face checkpoint they came from, and which transformers class can
reproduce the model exactly:

=============  ==========================  =========================================
architecture   transformers class          what differs from the HF checkpoint
=============  ==========================  =========================================
llama          LlamaForCausalLM            q/k rows permuted for interleaved RoPE
llama + MoE    MixtralForCausalLM          as llama; experts stacked in 3-D tensors
gemma          GemmaForCausalLM            RMSNorm weights stored as (w + 1)
phi3           Phi3ForCausalLM             none (fused qkv and gate|up kept fused)
starcoder2     Starcoder2ForCausalLM       none (biases and LayerNorms as in HF)
=============  ==========================  =========================================

Everything else (another architecture, a feature transformers 4.44 cannot
express for that class) is refused with a :class:`GGUFError`.
"""
from __future__ import annotations

import math
import os
import re

import numpy as np

from ..compat import no_init_weights
from ..errors import KqsvdError

SUPPORTED_ARCHITECTURES = ("llama", "gemma", "phi3", "starcoder2")

# Close relatives of supported architectures, refused with the reason, because
# "not supported" alone invites the guess that a sibling's loader would do.
_REFUSED_BECAUSE = {
    "gemma2": "its attention and final logit soft-capping "
              "('gemma2.attn_logit_softcapping', 'gemma2.final_logit_softcapping') and "
              "alternating sliding-window layers are not reproduced by this loader",
    "gemma3": "its q/k norms, interleaved local (sliding-window) and global layers and "
              "their separate RoPE bases are not reproduced by this loader",
}

_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


class GGUFError(KqsvdError):
    """A GGUF file that this loader cannot load faithfully.

    The message always starts with the file path and names the offending
    metadata field, tensor, tensor type or architecture.
    """

    def __init__(self, path, what):
        super().__init__(f"{os.fspath(path)}: {what}")
        self.path = os.fspath(path)


# ----------------------------------------------------------------------------- metadata

_MISSING = object()


def get_field(reader, path, key, default=_MISSING):
    """Value of metadata field ``key`` (str, number, bool or list); ``default`` if absent.

    Raises GGUFError naming ``key`` when it is absent and no default is given.
    """
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise GGUFError(path, f"required metadata field '{key}' is missing")
        return default
    return field.contents()


def scalar_int(reader, path, key, default=_MISSING):
    """Integer field; per-layer arrays (used by other architectures) are refused."""
    v = get_field(reader, path, key, default)
    if isinstance(v, list):
        raise GGUFError(path, f"metadata field '{key}' is a per-layer array, which is not supported")
    return v if v is None else int(v)


class _Meta:
    """The file's ``{arch}.*`` fields, with the architecture prefix filled in."""

    def __init__(self, reader, path, arch):
        self.reader, self.path, self.arch = reader, path, arch

    def get(self, key, default=_MISSING):
        return get_field(self.reader, self.path, f"{self.arch}.{key}", default)

    def int(self, key, default=_MISSING):
        return scalar_int(self.reader, self.path, f"{self.arch}.{key}", default)

    def float(self, key, default=_MISSING):
        v = self.get(key, default)
        return v if v is None else float(v)

    def error(self, what):
        return GGUFError(self.path, what)


# ----------------------------------------------------------------------------- architectures

class _Llama:
    """``llama`` without experts: Llama 1-3, Mistral, SmolLM, ... -> LlamaForCausalLM."""

    label = "llama"
    config_class, model_class = "LlamaConfig", "LlamaForCausalLM"
    eps_key = "attention.layer_norm_rms_epsilon"
    free_head_dim = False  # transformers 4.44 derives head_dim = hidden / heads
    rope_scaling_types = ("none", "linear")
    extras = ("rope_freqs.weight",)  # tensors that configure the model instead of filling it
    optional = ("output.weight", "rope_freqs.weight")

    # --- metadata
    def hparams(self, m):
        hidden = m.int("embedding_length")
        n_head = m.int("attention.head_count")
        n_kv = m.int("attention.head_count_kv", n_head)
        if n_head <= 0 or n_kv <= 0 or n_head % n_kv or (not self.free_head_dim and hidden % n_head):
            raise m.error(f"inconsistent head counts: embedding_length={hidden}, "
                          f"head_count={n_head}, head_count_kv={n_kv}")
        derived = hidden // n_head
        head_dim = m.int("attention.key_length", derived)
        checks = [("attention.value_length", head_dim, "attention.key_length"),
                  ("rope.dimension_count", head_dim, "the head size")]  # HF rotates whole heads
        if not self.free_head_dim:
            checks.insert(0, ("attention.key_length", derived, "embedding_length/head_count"))
        for key, want, why in checks:
            v = m.int(key, want)
            if v != want:
                raise m.error(f"'{m.arch}.{key}'={v} differs from {why}={want}, which "
                              f"{self.model_class} cannot express")
        hp = dict(hidden_size=hidden, num_attention_heads=n_head, num_key_value_heads=n_kv,
                  head_dim=head_dim, num_hidden_layers=m.int("block_count"),
                  intermediate_size=m.int("feed_forward_length"),
                  max_position_embeddings=m.int("context_length", 4096),
                  rope_theta=m.float("rope.freq_base", 10000.0),
                  eps=m.float(self.eps_key), rope_scaling=self._rope_scaling(m))
        return hp

    def _rope_scaling(self, m):
        kind = m.get("rope.scaling.type", None)
        factor = m.float("rope.scaling.factor", m.float("rope.scale_linear", 1.0))
        if kind is None:
            kind = "linear" if factor != 1.0 else "none"
        if kind not in self.rope_scaling_types:
            raise m.error(f"rope scaling type '{kind}' ('{m.arch}.rope.scaling.type') is not "
                          f"supported for {self.label} (supported: {', '.join(self.rope_scaling_types)})")
        if kind == "linear" and factor != 1.0:
            return {"rope_type": "linear", "factor": factor}
        return None

    # --- tensors
    def layer_tensors(self, hp):
        """GGUF per-layer name -> (HF name below model.layers.N, HF shape)."""
        h = hp["hidden_size"]
        q, kv = hp["num_attention_heads"] * hp["head_dim"], hp["num_key_value_heads"] * hp["head_dim"]
        t = {"attn_norm.weight": ("input_layernorm.weight", (h,)),
             "ffn_norm.weight": ("post_attention_layernorm.weight", (h,)),
             "attn_q.weight": ("self_attn.q_proj.weight", (q, h)),
             "attn_k.weight": ("self_attn.k_proj.weight", (kv, h)),
             "attn_v.weight": ("self_attn.v_proj.weight", (kv, h)),
             "attn_output.weight": ("self_attn.o_proj.weight", (h, q))}
        t.update(self.ffn_tensors(hp))
        return t

    def ffn_tensors(self, hp):
        h, f = hp["hidden_size"], hp["intermediate_size"]
        return {"ffn_gate.weight": ("mlp.gate_proj.weight", (f, h)),
                "ffn_up.weight": ("mlp.up_proj.weight", (f, h)),
                "ffn_down.weight": ("mlp.down_proj.weight", (h, f))}

    def global_tensors(self, hp, vocab):
        h = hp["hidden_size"]
        g = {"token_embd.weight": ("model.embed_tokens.weight", (vocab, h)),
             "output_norm.weight": ("model.norm.weight", (h,)),
             "output.weight": ("lm_head.weight", (vocab, h))}
        g.update({k: (None, (hp["head_dim"] // 2,)) for k in self.extras})
        return g

    def convert(self, key, arr, hp):
        """Undo llama.cpp's layout change for tensor ``key``: the name below blk.N
        for per-layer tensors (e.g. 'attn_q.weight'), the full name otherwise."""
        if key == "attn_q.weight":
            return _unpermute(arr, hp["num_attention_heads"])
        if key == "attn_k.weight":
            return _unpermute(arr, hp["num_key_value_heads"])
        return arr

    # --- model
    def config_kwargs(self, hp, extras, m):
        return dict(rms_norm_eps=hp["eps"], rope_scaling=hp["rope_scaling"], hidden_act="silu",
                    attention_bias=False, mlp_bias=False)

    def layout(self, weights, params):
        """weights renamed for the installed transformers' parameters (the
        tables give transformers 5's names); params: the model's."""
        return weights

    def finish(self, model, extras, m):
        factors = extras.get("rope_freqs.weight")
        if factors is not None:
            _divide_rope_frequencies(model, factors, m)


class _Mixtral(_Llama):
    """``llama`` with ``llama.expert_count`` > 0 (Mixtral) -> MixtralForCausalLM."""

    config_class, model_class = "MixtralConfig", "MixtralForCausalLM"
    rope_scaling_types = ("none",)
    # llama.cpp's Mixtral conversions never carry rope_freqs.weight: refused as unknown.
    extras = ()
    optional = ("output.weight",)

    @property
    def label(self):
        return "llama mixture-of-experts (Mixtral)"

    def hparams(self, m):
        hp = super().hparams(m)
        hp["experts"] = m.int("expert_count")
        hp["experts_used"] = m.int("expert_used_count")
        if not 0 < hp["experts_used"] <= hp["experts"]:
            raise m.error(f"'{m.arch}.expert_used_count'={hp['experts_used']} is not between 1 and "
                          f"'{m.arch}.expert_count'={hp['experts']}")
        # Mixtral renormalises the top-k softmax weights; llama.cpp's llama graph
        # always does, and a file saying otherwise was made for another router.
        if not m.get("expert_weights_norm", True):
            raise m.error(f"'{m.arch}.expert_weights_norm'=false is not supported (Mixtral "
                          f"renormalises the selected experts' weights)")
        gating = m.int("expert_gating_func", 1)
        if gating != 1:  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
            raise m.error(f"'{m.arch}.expert_gating_func'={gating} is not supported (Mixtral "
                          f"routes with a softmax, 1)")
        return hp

    def ffn_tensors(self, hp):
        h, f, e = hp["hidden_size"], hp["intermediate_size"], hp["experts"]
        # convert_hf_to_gguf stacks each projection of all experts along a new
        # first axis; transformers 5 holds gate and up side by side in one
        # tensor ("#0", "#1": the parts, joined along rows).
        return {"ffn_gate_inp.weight": ("mlp.gate.weight", (e, h)),
                "ffn_gate_exps.weight": ("mlp.experts.gate_up_proj#0", (e, f, h)),
                "ffn_up_exps.weight": ("mlp.experts.gate_up_proj#1", (e, f, h)),
                "ffn_down_exps.weight": ("mlp.experts.down_proj", (e, h, f))}

    def layout(self, weights, params):
        """Before transformers 5 Mixtral held each expert as modules of its
        own (block_sparse_moe.experts.E.w1, w3, w2: gate, up, down): the
        stacked tensors are cut into them for such a release."""
        if not any(".block_sparse_moe." in n for n in params):
            return weights
        out = {}
        for name, arr in weights.items():
            head, dot, tail = name.partition(".mlp.")
            if not dot:
                out[name] = arr
            elif tail == "gate.weight":
                out[f"{head}.block_sparse_moe.gate.weight"] = arr
            elif tail == "experts.gate_up_proj":
                f = arr.shape[1] // 2
                for e in range(arr.shape[0]):
                    out[f"{head}.block_sparse_moe.experts.{e}.w1.weight"] = arr[e, :f]
                    out[f"{head}.block_sparse_moe.experts.{e}.w3.weight"] = arr[e, f:]
            else:  # experts.down_proj
                for e in range(arr.shape[0]):
                    out[f"{head}.block_sparse_moe.experts.{e}.w2.weight"] = arr[e]
        return out

    def config_kwargs(self, hp, extras, m):
        # llama.cpp's llama graph has no sliding window, so none here either.
        return dict(rms_norm_eps=hp["eps"], hidden_act="silu", num_local_experts=hp["experts"],
                    num_experts_per_tok=hp["experts_used"], sliding_window=None,
                    router_jitter_noise=0.0)


class _Gemma(_Llama):
    """``gemma`` (Gemma 1, CodeGemma) -> GemmaForCausalLM."""

    label = "gemma"
    config_class, model_class = "GemmaConfig", "GemmaForCausalLM"
    free_head_dim = True  # GemmaConfig.head_dim (256 for Gemma-7B, != 3072/16)
    rope_scaling_types = ("none",)
    extras = ()
    optional = ()  # llama.cpp's gemma has no output.weight: the embedding is always tied

    def global_tensors(self, hp, vocab):
        g = super().global_tensors(hp, vocab)
        del g["output.weight"]
        return g

    def convert(self, key, arr, hp):
        # HF GemmaRMSNorm scales by (1 + w); convert_hf_to_gguf stores s = w + 1 so
        # that llama.cpp's plain RMSNorm multiplies by the stored value.  For s in
        # [0.5, 4) (w in [-0.5, 3)), s - 1 is exact in float32, so the 1 + w that
        # GemmaRMSNorm computes gives back s bit for bit.
        if key.endswith("norm.weight"):
            return arr - np.float32(1.0)
        return arr  # gemma uses NeoX RoPE in llama.cpp: q/k are not permuted

    def config_kwargs(self, hp, extras, m):
        return dict(rms_norm_eps=hp["eps"], head_dim=hp["head_dim"], attention_bias=False,
                    hidden_activation="gelu_pytorch_tanh")  # llama.cpp's GELU is the tanh one


class _Phi3(_Llama):
    """``phi3`` (Phi-3, Phi-3.5 mini) -> Phi3ForCausalLM."""

    label = "phi3"
    config_class, model_class = "Phi3Config", "Phi3ForCausalLM"
    rope_scaling_types = ("none",)  # LongRoPE comes as rope_factors_* tensors instead
    extras = ("rope_factors_long.weight", "rope_factors_short.weight")
    optional = ("output.weight",) + extras

    def hparams(self, m):
        hp = super().hparams(m)
        hp["original_ctx"] = m.int("rope.scaling.original_context_length",
                                   hp["max_position_embeddings"])
        # Carried over for completeness: transformers 4.44 applies Phi3's window
        # only with flash-attention, never in the eager attention built here.
        hp["sliding_window"] = m.int("attention.sliding_window", None)
        return hp

    def layer_tensors(self, hp):
        h, f = hp["hidden_size"], hp["intermediate_size"]
        q, kv = hp["num_attention_heads"] * hp["head_dim"], hp["num_key_value_heads"] * hp["head_dim"]
        # Phi3's fused projections are stored fused: qkv rows are [q; k; v], and
        # ffn_up rows are [gate; up], which Phi3MLP splits with chunk(2) in that order.
        return {"attn_norm.weight": ("input_layernorm.weight", (h,)),
                "ffn_norm.weight": ("post_attention_layernorm.weight", (h,)),
                "attn_qkv.weight": ("self_attn.qkv_proj.weight", (q + 2 * kv, h)),
                "attn_output.weight": ("self_attn.o_proj.weight", (h, q)),
                "ffn_up.weight": ("mlp.gate_up_proj.weight", (2 * f, h)),
                "ffn_down.weight": ("mlp.down_proj.weight", (h, f))}

    def convert(self, key, arr, hp):
        return arr  # phi3 uses NeoX RoPE in llama.cpp: nothing is permuted

    def config_kwargs(self, hp, extras, m):
        kw = dict(rms_norm_eps=hp["eps"], original_max_position_embeddings=hp["original_ctx"],
                  sliding_window=hp["sliding_window"], rope_scaling=None)
        long_f, short_f = (extras.get(k) for k in self.extras)
        if (long_f is None) != (short_f is None):
            have, lack = (self.extras if long_f is not None else self.extras[::-1])
            raise m.error(f"tensor '{have}' is present but '{lack}' is missing")
        if long_f is not None:
            kw["rope_scaling"] = {"type": "longrope", "long_factor": long_f.tolist(),
                                  "short_factor": short_f.tolist()}
            # Phi3LongRoPEScaledRotaryEmbedding derives the cos/sin scale from the two
            # context lengths (LongRoPE); a file whose stored factor disagrees (e.g. YaRN
            # scaling, 0.1 ln s + 1) would be computed differently, so it is refused.
            scale = hp["max_position_embeddings"] / hp["original_ctx"]
            want = math.sqrt(1 + math.log(scale) / math.log(hp["original_ctx"])) if scale > 1 else 1.0
            got = m.float("rope.scaling.attn_factor")
            if abs(got - want) > 1e-6 * want:
                raise m.error(f"'{m.arch}.rope.scaling.attn_factor'={got} differs from the "
                              f"LongRoPE factor {want:.7g} that Phi3ForCausalLM derives from "
                              f"'{m.arch}.context_length' and "
                              f"'{m.arch}.rope.scaling.original_context_length'")
        return kw

    def finish(self, model, extras, m):
        pass  # the rope factors went into the config


class _Starcoder2(_Llama):
    """``starcoder2`` -> Starcoder2ForCausalLM."""

    label = "starcoder2"
    config_class, model_class = "Starcoder2Config", "Starcoder2ForCausalLM"
    eps_key = "attention.layer_norm_epsilon"  # LayerNorm, not RMSNorm
    rope_scaling_types = ("none",)
    extras = ()
    optional = ("output.weight",)

    def layer_tensors(self, hp):
        h, f = hp["hidden_size"], hp["intermediate_size"]
        q, kv = hp["num_attention_heads"] * hp["head_dim"], hp["num_key_value_heads"] * hp["head_dim"]
        t = {}
        for gg, hf, out, inp in (("attn_norm", "input_layernorm", h, None),
                                 ("ffn_norm", "post_attention_layernorm", h, None),
                                 ("attn_q", "self_attn.q_proj", q, h), ("attn_k", "self_attn.k_proj", kv, h),
                                 ("attn_v", "self_attn.v_proj", kv, h),
                                 ("attn_output", "self_attn.o_proj", h, q),
                                 ("ffn_up", "mlp.c_fc", f, h), ("ffn_down", "mlp.c_proj", h, f)):
            t[f"{gg}.weight"] = (f"{hf}.weight", (out,) if inp is None else (out, inp))
            t[f"{gg}.bias"] = (f"{hf}.bias", (out,))
        return t

    def global_tensors(self, hp, vocab):
        g = super().global_tensors(hp, vocab)
        g["output_norm.bias"] = ("model.norm.bias", (hp["hidden_size"],))
        return g

    def convert(self, key, arr, hp):
        return arr  # starcoder2 uses NeoX RoPE in llama.cpp: nothing is permuted

    def config_kwargs(self, hp, extras, m):
        # convert_hf_to_gguf does not record Starcoder2's sliding window and
        # llama.cpp's starcoder2 graph attends to the whole context: so does this model.
        return dict(norm_epsilon=hp["eps"], use_bias=True, hidden_act="gelu_pytorch_tanh",
                    sliding_window=None)

    def finish(self, model, extras, m):
        pass


def select(reader, path):
    """The architecture handler for the file (GGUFError if unsupported) and its _Meta."""
    arch = get_field(reader, path, "general.architecture")
    if arch in _REFUSED_BECAUSE:
        raise GGUFError(path, f"architecture '{arch}' is not supported: {_REFUSED_BECAUSE[arch]} "
                              f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(path, f"architecture '{arch}' is not supported "
                              f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    m = _Meta(reader, path, arch)
    if arch == "llama":
        return (_Mixtral() if m.int("expert_count", 0) else _Llama()), m
    # Only llama's graph in llama.cpp reads the experts fields the same way.
    if m.int("expert_count", 0):
        raise m.error(f"'{arch}.expert_count'={m.int('expert_count')} (mixture of experts) is "
                      f"not supported for architecture '{arch}'")
    return {"gemma": _Gemma, "phi3": _Phi3, "starcoder2": _Starcoder2}[arch](), m


# ----------------------------------------------------------------------------- tensors

def _unpermute(w, n_head):
    """Undo llama.cpp's q/k row permutation.

    convert_hf_to_gguf reorders each head's rows from HF's "rotate half" layout
    (first half, second half) to interleaved pairs (GPT-J style RoPE), i.e.
    gguf[h, j, s] = hf[h, s, j] with rows viewed as (head, head_dim/2, 2).
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


def _dequantize(tensor, shape):
    """float32 ndarray of ``shape`` from a ReaderTensor whose type was probed."""
    from gguf.quants import dequantize
    arr = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)
    # F32 tensors come back as views of the read-only memory map: copy them.
    return arr if arr.flags.writeable and arr.flags.c_contiguous else np.array(arr)


def load_tensors(reader, m, spec, hp, vocab):
    """Check names/shapes/types of all tensors, then dequantize and convert them.

    Returns (dict HF parameter name -> float32 ndarray, dict GGUF name -> ndarray
    of the tensors in ``spec.extras``, which configure rather than fill the model).
    """
    from gguf.quants import dequantize
    path = m.path
    expected = dict(spec.global_tensors(hp, vocab))
    layer = spec.layer_tensors(hp)
    for i in range(hp["num_hidden_layers"]):
        expected.update({f"blk.{i}.{k}": (f"model.layers.{i}.{hf}", s) for k, (hf, s) in layer.items()})
    by_name = {t.name: t for t in reader.tensors}
    for name in by_name:
        if name not in expected:
            hint = ""
            if re.match(r"^blk\.\d+\.ffn_(gate|up|down)\.\d+\.weight$", name):
                hint = "; per-expert tensors are an old Mixtral layout: re-convert the model"
            raise GGUFError(path, f"unknown tensor '{name}' (not part of a {hp['num_hidden_layers']}"
                                  f"-layer {spec.label} model){hint}")
    for name in expected:
        if name not in by_name and name not in spec.optional:
            raise GGUFError(path, f"tensor '{name}' is missing")
    probed = set()
    for name, t in by_name.items():
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))  # GGUF lists ne0 (columns) first
        if shape != expected[name][1]:
            raise GGUFError(path, f"tensor '{name}' has shape {shape}, expected {expected[name][1]} "
                                  f"from the metadata")
        # Probe each type on one row first so an unsupported type fails before any work.
        if t.tensor_type not in probed:
            try:
                dequantize(t.data.reshape(-1, t.data.shape[-1])[:1], t.tensor_type)
            except NotImplementedError:
                raise GGUFError(path, f"tensor '{name}' has type {t.tensor_type.name}, which "
                                      f"gguf.quants cannot dequantize") from None
            probed.add(t.tensor_type)
    weights, extras, parts = {}, {}, {}
    for name, t in by_name.items():
        hf, shape = expected[name]
        arr = _dequantize(t, shape)
        layer_key = _LAYER_RE.match(name)
        arr = spec.convert(layer_key.group(2) if layer_key else name, arr, hp)
        if hf is None:
            extras[name] = arr
        elif "#" in hf:
            whole, part = hf.split("#")
            parts.setdefault(whole, {})[int(part)] = arr
        else:
            weights[hf] = arr
    for whole, got in parts.items():
        weights[whole] = np.concatenate([got[i] for i in sorted(got)], axis=1)
    return weights, extras


def _divide_rope_frequencies(model, factors, m):
    """Llama-3.1-style RoPE: llama.cpp divides each rotation frequency by its
    factor, which is what HF's "llama3" rope_type computes from its parameters."""
    import torch
    f = torch.from_numpy(factors.astype(np.float64))
    if not torch.all(f > 0):
        raise m.error("tensor 'rope_freqs.weight' holds non-positive factors")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    for mod in model.modules():
        if isinstance(mod, LlamaRotaryEmbedding):  # computes cos/sin from inv_freq on every call
            mod.inv_freq = (mod.inv_freq.double() / f).float()
            mod.original_inv_freq = mod.inv_freq


# ----------------------------------------------------------------------------- model

def build_model(spec, m, hp, vocab, weights, extras, tokenizer, dtype):
    """The transformers model for ``spec`` holding ``weights`` (eager attention, eval mode)."""
    import torch
    import transformers

    tied = "lm_head.weight" not in weights
    common = dict(
        vocab_size=vocab, hidden_size=hp["hidden_size"], intermediate_size=hp["intermediate_size"],
        num_hidden_layers=hp["num_hidden_layers"], num_attention_heads=hp["num_attention_heads"],
        num_key_value_heads=hp["num_key_value_heads"],
        max_position_embeddings=hp["max_position_embeddings"], rope_theta=hp["rope_theta"],
        tie_word_embeddings=tied, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        dtype=dtype, attn_implementation="eager")
    common.update(spec.config_kwargs(hp, extras, m))
    try:
        config = getattr(transformers, spec.config_class)(**common)
    except ValueError as e:  # e.g. Phi3Config's rope_scaling validation
        raise m.error(f"{spec.config_class} rejects the '{m.arch}.*' hyper-parameters: {e}") from e
    # Skip random initialisation: every parameter is overwritten below.
    with no_init_weights():
        model = getattr(transformers, spec.model_class)(config)
    # Every (module, attribute) pair, so a tied lm_head is listed under both names.
    params = {f"{prefix}.{n}" if prefix else n: p for prefix, mod in model.named_modules()
              for n, p in mod.named_parameters(recurse=False)}
    if tied:
        params.pop("lm_head.weight", None)
    weights = spec.layout(weights, params)
    if set(params) != set(weights):  # a table above is out of step with transformers
        raise m.error(f"internal: {spec.model_class} parameters "
                      f"{sorted(set(params) ^ set(weights))[:4]} do not match the file's tensors")
    for name, arr in weights.items():
        p = params[name]
        if tuple(p.shape) != arr.shape:
            raise m.error(f"internal: {spec.model_class} parameter '{name}' has shape "
                          f"{tuple(p.shape)}, the file's tensor {arr.shape}")
        # Replace the storage (not copy_) so peak memory is the model plus one tensor.
        p.data = torch.from_numpy(arr).to(dtype)
    if tied:
        model.tie_weights()
    spec.finish(model, extras, m)
    return model
