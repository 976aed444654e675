"""Tests for kqsvd.models.gguf_loader on architectures beyond plain Llama.

Run:  cd /work/main && .venv/bin/python python/tests/run.py test_gguf_arch

Mistral and Mixtral (GGUF architecture "llama", Mixtral with experts), Gemma,
Phi-3 and Starcoder2: a tiny random Hugging Face model of each family is written
the way llama.cpp's convert_hf_to_gguf.py writes it -- tensor names from the gguf
package's own TensorNameMap, q/k rows permuted for llama/Mixtral only, experts
stacked into 3-D tensors, Gemma's RMSNorm weights stored as w + 1, the family's
own metadata fields -- and loaded back with load_gguf.  F32 files must give the
original's logits; quantized files the logits of the original with its weights
quantized and dequantized the same way.  Variants the loader cannot reproduce
must be refused with a GGUFError naming the file and the item.
"""
import math
import os
import re
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import gguf  # noqa: E402
from gguf import GGMLQuantizationType as QT  # noqa: E402
from transformers import (GemmaConfig, GemmaForCausalLM, LlamaForCausalLM, MistralConfig, MistralForCausalLM,  # noqa: E402
                          MixtralConfig, MixtralForCausalLM, Phi3Config, Phi3ForCausalLM,
                          Starcoder2Config, Starcoder2ForCausalLM)

from test_gguf import (TEXT, Base, base_meta, llama_cpp_permute, log, logits, max_rel_diff,  # noqa: E402
                       roundtrip, train_tokenizer, write_raw)
from common import rope_scaling  # noqa: E402
from kqsvd.errors import KqsvdError  # noqa: E402
from kqsvd.models.gguf_loader import GGUFError, load_gguf  # noqa: E402

GGUF_ARCH = {"mistral": "llama", "mixtral": "llama", "gemma": "gemma", "phi3": "phi3",
             "starcoder2": "starcoder2"}
HF_CLASSES = {"mistral": (MistralConfig, MistralForCausalLM), "mixtral": (MixtralConfig, MixtralForCausalLM),
              "gemma": (GemmaConfig, GemmaForCausalLM), "phi3": (Phi3Config, Phi3ForCausalLM),
              "starcoder2": (Starcoder2Config, Starcoder2ForCausalLM)}
LONG = [1.0, 1.5, 2.0, 3.0, 4.5, 6.0, 8.0, 12.0]  # Phi-3 LongRoPE factors, head_dim/2 = 8 of them
SHORT = [1.0, 1.0, 1.03125, 1.0625, 1.125, 1.25, 1.375, 1.5]  # float32-exact, as GGUF stores them


def tiny(family, vocab, seed=0, **over):
    """2 layers, hidden 64, 4 query / 2 KV heads, norms and biases randomised so that
    a wrong mapping (or a forgotten +1) changes the logits."""
    torch.manual_seed(seed)
    kw = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, rope_theta=1e4, max_position_embeddings=256,
              attn_implementation="eager")
    kw.update({"mistral": dict(rms_norm_eps=1e-5, sliding_window=None, tie_word_embeddings=False),
               "mixtral": dict(rms_norm_eps=1e-5, num_local_experts=4, num_experts_per_tok=2,
                               tie_word_embeddings=False),
               # head_dim 32 != 64 / 4, as in Gemma-7B (256 != 3072 / 16)
               "gemma": dict(rms_norm_eps=1e-6, head_dim=32, hidden_activation="gelu_pytorch_tanh"),
               "phi3": dict(rms_norm_eps=1e-5, pad_token_id=None, original_max_position_embeddings=256,
                            sliding_window=255, tie_word_embeddings=False),
               "starcoder2": dict(norm_epsilon=1e-5, use_bias=True, tie_word_embeddings=True)}[family])
    kw.update(over)
    config_class, model_class = HF_CLASSES[family]
    model = model_class(config_class(**kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif p.dim() == 1:  # Gemma's norm weights are offsets from 1
                p.copy_((0 if family == "gemma" else 1) + 0.1 * torch.randn_like(p))
    return model


def to_gguf_tensors(model, family):
    """(GGUF name, float32 array) pairs as convert_hf_to_gguf.py writes them."""
    cfg = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[GGUF_ARCH[family].upper()], cfg.num_hidden_layers)
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:  # tied output is not written (Gemma's never is)
        sd.pop("lm_head.weight", None)
    out = []
    # transformers 4's experts (block_sparse_moe.experts.E.w1, w3, w2: gate, up,
    # down) stacked first into transformers 5's layout, which is converted below
    stacks = {}
    for hf in list(sd):
        m = re.match(r"model\.layers\.(\d+)\.block_sparse_moe\.(?:experts\.(\d+)\.(w[123])|"
                     r"(gate))\.weight$", hf)
        if m:
            stacks.setdefault(int(m[1]), {})[(int(m[2]), m[3]) if m[2] else "gate"] = sd.pop(hf)
    for l, parts in stacks.items():
        n = max(e for e, _ in (k for k in parts if k != "gate")) + 1
        sd[f"model.layers.{l}.mlp.gate.weight"] = parts["gate"]
        sd[f"model.layers.{l}.mlp.experts.gate_up_proj"] = np.stack(
            [np.concatenate([parts[e, "w1"], parts[e, "w3"]]) for e in range(n)])
        sd[f"model.layers.{l}.mlp.experts.down_proj"] = np.stack([parts[e, "w2"] for e in range(n)])
    for hf, arr in sd.items():
        # transformers 5's experts: [E, 2F, D] gate and up side by side, [E, D, F] down
        m = re.match(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up|down)_proj$", hf)
        if m:
            stacked = {"gate_up": np.split(arr, 2, axis=1), "down": [arr]}[m[2]]
            for kind, a in zip({"gate_up": ("gate", "up"), "down": ("down",)}[m[2]], stacked):
                out.append((f"blk.{m[1]}.ffn_{kind}_exps.weight", np.ascontiguousarray(a)))
            continue
        if hf.endswith(".mlp.gate.weight"):
            out.append((hf.replace("model.layers.", "blk.").replace(".mlp.gate.weight",
                                                                    ".ffn_gate_inp.weight"), arr))
            continue
        if GGUF_ARCH[family] == "llama":  # LlamaModel.modify_tensors
            if ".q_proj." in hf:
                arr = llama_cpp_permute(arr, cfg.num_attention_heads)
            elif ".k_proj." in hf:
                arr = llama_cpp_permute(arr, cfg.num_key_value_heads)
        if family == "gemma" and hf.endswith("norm.weight"):  # GemmaModel.modify_tensors
            arr = arr + 1
        out.append((names.get_name(hf, try_suffixes=(".weight", ".bias")), arr))
    return out


def family_meta(model, family, tok, pre="gpt-2"):
    """The metadata each converter class's set_gguf_parameters writes."""
    cfg = model.config
    meta = base_meta(cfg, tok, pre)
    if family == "mixtral":
        meta.update({"{arch}.expert_count": cfg.num_local_experts,
                     "{arch}.expert_used_count": cfg.num_experts_per_tok})
    elif family == "gemma":  # no rope base, rope dims or vocab size; head size given
        meta.update({"{arch}.rope.freq_base": None, "{arch}.rope.dimension_count": None,
                     "{arch}.vocab_size": None, "{arch}.attention.key_length": cfg.head_dim,
                     "{arch}.attention.value_length": cfg.head_dim})
    elif family == "phi3":
        meta.update({"{arch}.vocab_size": None, "{arch}.attention.sliding_window": cfg.sliding_window,
                     "{arch}.rope.scaling.original_context_length": cfg.original_max_position_embeddings})
        if rope_scaling(cfg):
            scale = cfg.max_position_embeddings / cfg.original_max_position_embeddings
            meta["{arch}.rope.scaling.attn_factor"] = float(
                np.sqrt(1 + np.log(scale) / np.log(cfg.original_max_position_embeddings)))
    elif family == "starcoder2":  # LayerNorm epsilon, generic Model parameters
        meta.update({"{arch}.attention.layer_norm_rms_epsilon": None, "{arch}.vocab_size": None,
                     "{arch}.rope.dimension_count": None,
                     "{arch}.attention.layer_norm_epsilon": float(cfg.norm_epsilon)})
    return meta


def write_family(path, model, family, tok, qtype=QT.F32, kv=None, drop=(), extra=None,
                 pre="gpt-2", arch=None):
    meta = family_meta(model, family, tok, pre)
    meta.update(kv or {})
    tensors = to_gguf_tensors(model, family)
    cfg = model.config
    if family == "phi3" and rope_scaling(cfg):  # Phi3MiniModel.generate_extra_tensors
        tensors += [("rope_factors_long.weight", np.array(rope_scaling(cfg)["long_factor"])),
                    ("rope_factors_short.weight", np.array(rope_scaling(cfg)["short_factor"]))]
    tensors += list((extra or {}).items())
    tensors = [(n, a) for n, a in tensors if n not in drop]
    write_raw(path, arch or GGUF_ARCH[family], meta, tensors, qtype)


class TestFamilies(Base):
    QTYPES = (QT.F32, QT.Q8_0, QT.Q4_0)

    # Settings whose effect on tiny random models can hide below the logit tolerance
    # (e.g. tanh-approximate vs exact GELU on small activations).
    CONFIG_KEYS = ("hidden_act", "hidden_activation", "rms_norm_eps", "norm_epsilon", "rope_theta",
                   "head_dim", "use_bias", "num_local_experts", "num_experts_per_tok", "rope_parameters",
                   "max_position_embeddings", "original_max_position_embeddings", "attention_bias")

    def assertSameConfig(self, got, want):
        for key in self.CONFIG_KEYS:
            if hasattr(want, key) and hasattr(got, key):
                a, b = getattr(got, key), getattr(want, key)
                if key == "head_dim":  # None (some releases' default): hidden / heads
                    a = a or got.hidden_size // got.num_attention_heads
                    b = b or want.hidden_size // want.num_attention_heads
                if isinstance(b, float):  # GGUF stores float32
                    self.assertTrue(math.isclose(a, b, rel_tol=1e-6), f"{key}: {a} != {b}")
                else:
                    self.assertEqual(a, b, key)

    def check_roundtrip(self, family, model, qtypes=QTYPES, ids_list=None):
        sd = model.state_dict()
        for qtype in qtypes:
            with self.subTest(family=family, qtype=qtype.name):
                path = self.path(f"{family}-{qtype.name}.gguf")
                write_family(path, model, family, self.tok, qtype)
                loaded, _ = load_gguf(path)
                want_class = LlamaForCausalLM if family == "mistral" else type(model)
                self.assertIs(type(loaded), want_class)
                self.assertEqual(loaded.config.tie_word_embeddings, model.config.tie_word_embeddings)
                self.assertSameConfig(loaded.config, model.config)
                # Exact: layout changes move whole rows and quant blocks live inside rows.
                ref = {k: torch.from_numpy(roundtrip(v.numpy(), qtype, k)) for k, v in sd.items()}
                got = loaded.state_dict()
                self.assertEqual(set(got), set(ref))
                for k, v in ref.items():
                    if family == "gemma" and k.endswith("norm.weight"):
                        # The file holds fl(1 + w); what Gemma multiplies by must match.
                        self.assertTrue(torch.equal(1 + got[k], 1 + v), k)
                    else:
                        self.assertTrue(torch.equal(got[k], v), f"{qtype.name}: {k} differs")
                ref_model = type(model)(model.config).eval()
                ref_model.load_state_dict(ref)
                for ids in ids_list or [self.ids]:
                    expected = logits(ref_model, ids)
                    if qtype == QT.F32:
                        self.assertTrue(torch.equal(expected, logits(model, ids)))
                    else:  # the quantization must be visible, or this case tests nothing
                        self.assertGreater(max_rel_diff(expected, logits(model, ids)), 1e-6)
                    diff = max_rel_diff(logits(loaded, ids), expected)
                    self.assertLess(diff, 1e-5, f"{family} {qtype.name}")
                log(f"{family} {qtype.name}: max rel logit diff {diff:.1e}")

    def test_mistral(self):
        # convert_hf_to_gguf writes Mistral as plain llama; it loads as Llama.
        self.check_roundtrip("mistral", tiny("mistral", self.vocab), qtypes=(QT.F32, QT.Q8_0))

    def test_mixtral(self):
        model = tiny("mixtral", self.vocab, seed=1)
        self.check_roundtrip("mixtral", model)
        loaded, _ = load_gguf(self.path("mixtral-F32.gguf"))
        self.assertEqual((loaded.config.num_local_experts, loaded.config.num_experts_per_tok), (4, 2))
        # The routing really mixes experts: dropping one changes the output.
        with torch.no_grad():
            moe = loaded.model.layers[0]
            if hasattr(moe, "block_sparse_moe"):  # transformers 4: an expert's modules
                moe.block_sparse_moe.experts[3].w2.weight.zero_()
            else:
                moe.mlp.experts.down_proj[3].zero_()
        self.assertGreater(max_rel_diff(logits(loaded, self.ids), logits(model, self.ids)), 1e-4)
        bf, _ = load_gguf(self.path("mixtral-F32.gguf"), dtype=torch.bfloat16)
        self.assertEqual(bf.lm_head.weight.dtype, torch.bfloat16)
        self.assertLess(max_rel_diff(logits(bf, self.ids), logits(model, self.ids)), 0.1)

    def test_gemma(self):
        model = tiny("gemma", self.vocab, seed=2)
        self.check_roundtrip("gemma", model)
        loaded, _ = load_gguf(self.path("gemma-F32.gguf"))
        self.assertEqual(loaded.config.head_dim, 32)
        self.assertIs(loaded.lm_head.weight, loaded.model.embed_tokens.weight)
        # Without the -1 the norms would scale by 2 + w: the test would see it.
        self.assertGreater(loaded.model.norm.weight.abs().max().item(), 0)
        self.assertLess(loaded.model.norm.weight.abs().max().item(), 0.9)

    def test_phi3(self):
        self.check_roundtrip("phi3", tiny("phi3", self.vocab, seed=3))

    def test_phi3_longrope(self):
        # Phi-3-mini-128k style: short factors up to original_max_position_embeddings
        # (here 32) tokens, long factors beyond; the GGUF carries them as tensors.
        scaling = {"type": "longrope", "long_factor": LONG, "short_factor": SHORT}
        model = tiny("phi3", self.vocab, seed=4, rope_scaling=scaling, original_max_position_embeddings=32)
        short_ids, long_ids = self.ids[:24], self.ids
        self.check_roundtrip("phi3", model, qtypes=(QT.F32, QT.Q8_0), ids_list=[short_ids, long_ids])
        loaded, _ = load_gguf(self.path("phi3-F32.gguf"))
        self.assertEqual(loaded.config.rope_scaling["long_factor"], LONG)
        self.assertEqual(loaded.config.original_max_position_embeddings, 32)
        plain = tiny("phi3", self.vocab, seed=4)
        self.assertGreater(max_rel_diff(logits(plain, long_ids), logits(model, long_ids)), 1e-4)

    def test_starcoder2(self):
        self.check_roundtrip("starcoder2", tiny("starcoder2", self.vocab, seed=5))
        model = tiny("starcoder2", self.vocab, seed=6, tie_word_embeddings=False)
        path = self.path("starcoder2-untied.gguf")
        write_family(path, model, "starcoder2", self.tok)
        loaded, _ = load_gguf(path)
        self.assertFalse(loaded.config.tie_word_embeddings)
        self.assertLess(max_rel_diff(logits(loaded, self.ids), logits(model, self.ids)), 1e-5)

    def test_starcoder_pretokenizer(self):
        # llama.cpp's "starcoder" pre-tokenizer is the same digit split as "smollm".
        trained = train_tokenizer("smollm")
        path = self.path("starcoder-tok.gguf")
        write_family(path, tiny("starcoder2", trained.get_vocab_size()), "starcoder2", trained,
                     pre="starcoder")
        _, tok = load_gguf(path)
        sample = TEXT[:3000] + " 2024 x  1"
        self.assertEqual(tok(sample, add_special_tokens=False).input_ids, trained.encode(sample).ids)


class TestRefusals(Base):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.models = {f: tiny(f, cls.vocab, seed=10) for f in ("mixtral", "gemma", "phi3", "starcoder2")}
        scaling = {"type": "longrope", "long_factor": LONG, "short_factor": SHORT}
        cls.models["phi3-long"] = tiny("phi3", cls.vocab, seed=11, rope_scaling=scaling,
                                       original_max_position_embeddings=32)

    def assertFamilyRefused(self, name, family, *needles, **write):
        path = self.path(name)
        model = self.models["phi3-long" if write.pop("long", False) else family]
        write_family(path, model, family, self.tok, **write)
        self.assertTrue(issubclass(GGUFError, KqsvdError))
        return self.assertRefused(path, *needles)

    def test_gemma2(self):
        self.assertFamilyRefused("gemma2.gguf", "gemma", "architecture 'gemma2'", "soft-capping",
                           arch="gemma2")

    def test_gemma(self):
        self.assertFamilyRefused("gemma-output.gguf", "gemma", "unknown tensor 'output.weight'",
                           extra={"output.weight": np.zeros((self.vocab, 64))})
        self.assertFamilyRefused("gemma-rope.gguf", "gemma", "'gemma.rope.dimension_count'=16",
                           kv={"{arch}.rope.dimension_count": 16})
        self.assertFamilyRefused("gemma-value.gguf", "gemma", "'gemma.attention.value_length'=16",
                           kv={"{arch}.attention.value_length": 16})

    def test_mixtral(self):
        self.assertFamilyRefused("mixtral-used.gguf", "mixtral", "'llama.expert_used_count'=5",
                           kv={"{arch}.expert_used_count": 5})
        # Before April 2024 llama.cpp wrote one tensor per expert.
        self.assertFamilyRefused("mixtral-old.gguf", "mixtral", "unknown tensor 'blk.0.ffn_gate.0.weight'",
                           "re-convert", extra={"blk.0.ffn_gate.0.weight": np.zeros((96, 64))})
        self.assertFamilyRefused("mixtral-freqs.gguf", "mixtral", "unknown tensor 'rope_freqs.weight'",
                           extra={"rope_freqs.weight": np.ones(8)})
        self.assertFamilyRefused("mixtral-norm.gguf", "mixtral", "'llama.expert_weights_norm'=false",
                           kv={"{arch}.expert_weights_norm": False})
        self.assertFamilyRefused("mixtral-rope.gguf", "mixtral", "rope scaling type 'linear'",
                           kv={"{arch}.rope.scaling.type": "linear", "{arch}.rope.scaling.factor": 2.0})
        self.assertFamilyRefused("mixtral-shape.gguf", "mixtral", "'blk.0.ffn_gate_exps.weight'",
                           "(4, 96, 64)", "(4, 128, 64)", kv={"{arch}.feed_forward_length": 128})

    def test_phi3(self):
        # YaRN-scaled Phi-3 files store attn_factor 0.1 ln(s) + 1, which HF 4.44 cannot compute.
        self.assertFamilyRefused("phi3-yarn.gguf", "phi3", "'phi3.rope.scaling.attn_factor'", "LongRoPE",
                           long=True, kv={"{arch}.rope.scaling.attn_factor": float(0.1 * np.log(8) + 1)})
        self.assertFamilyRefused("phi3-half.gguf", "phi3", "'rope_factors_long.weight'",
                           "'rope_factors_short.weight' is missing", long=True,
                           drop={"rope_factors_short.weight"})
        self.assertFamilyRefused("phi3-split.gguf", "phi3", "unknown tensor 'blk.0.attn_q.weight'",
                           extra={"blk.0.attn_q.weight": np.zeros((64, 64))})
        self.assertFamilyRefused("phi3-moe.gguf", "phi3", "'phi3.expert_count'=16",
                           kv={"{arch}.expert_count": 16})
        self.assertFamilyRefused("phi3-noattn.gguf", "phi3", "'phi3.rope.scaling.attn_factor'", "missing",
                           long=True, kv={"{arch}.rope.scaling.attn_factor": None})

    def test_starcoder2(self):
        self.assertFamilyRefused("sc2-bias.gguf", "starcoder2", "tensor 'blk.1.attn_q.bias' is missing",
                           drop={"blk.1.attn_q.bias"})
        self.assertFamilyRefused("sc2-eps.gguf", "starcoder2", "'starcoder2.attention.layer_norm_epsilon'",
                           kv={"{arch}.attention.layer_norm_epsilon": None})
        self.assertFamilyRefused("sc2-rope.gguf", "starcoder2", "rope scaling type 'linear'", "starcoder2",
                           kv={"{arch}.rope.scaling.type": "linear", "{arch}.rope.scaling.factor": 2.0})


if __name__ == "__main__":
    unittest.main()
