"""The package on the transformers it runs on, without the C tool or model
files: ctest runs it as py_stack in .venv (the pinned newest) and as
py_floor in .venv-floor (the declared floor, scripts/hf-env.sh --floor),
so both ends of the range in pyproject.toml are tested.  On tiny random
Llama and Qwen3 models (Qwen3 normalises keys before RoPE):
- at full rank the compressed logits are the model's, keys after and
  before RoPE, o_proj folded or not;
- greedy generate() over a left-padded batch, with the latent cache it
  starts by itself, equals whole-sequence decoding, and the cache holds
  r columns per KV head;
- the context manager leaves logits bit-identical;
- capture hands on the keys the attention uses, after RoPE (as this test
  rotates them from k_proj, and k_norm) and before it."""
import os
import unittest

import torch

from common import FAMILIES, ROOT, orthonormal_projections, tiny_lm

import kqsvd
from kqsvd.calibration.capture import Capture
from kqsvd.compat import TRANSFORMERS, _key, output_cache


def rotate(x, cos, sin):
    """RoPE written here: x [b, H, T, d], cos and sin [b, T, d]."""
    h = x.shape[-1] // 2
    return x * cos[:, None] + torch.cat([-x[..., h:], x[..., :h]], -1) * sin[:, None]


class Stack(unittest.TestCase):
    KINDS = ("llama", "qwen3")

    def test_version_in_range(self):
        import transformers
        want = os.environ.get("KQSVD_EXPECT_TRANSFORMERS")
        if want:  # py_floor: the floor's venv really has the floor
            self.assertEqual(transformers.__version__, want)
        low, high = TRANSFORMERS
        self.assertTrue(_key(low) <= _key(transformers.__version__) < _key(high))
        self.assertGreaterEqual(_key(transformers.__version__), (4, 56))

    def test_package_version_is_the_projects(self):
        """kqsvd.__version__ (what an inputs_hash records) is CMakeLists.txt's
        project VERSION, which the wheel takes."""
        import re
        with open(os.path.join(ROOT, "CMakeLists.txt")) as f:
            want = re.search(r"project\(kqsvd VERSION ([0-9.]+)", f.read()).group(1)
        self.assertEqual(kqsvd.__version__, want)

    def batch(self):
        g = torch.Generator().manual_seed(5)
        ids = torch.randint(3, 200, (2, 12), generator=g)
        mask = torch.ones_like(ids)
        mask[0, :3] = 0
        return ids, mask

    def test_full_rank_generate_and_restore(self):
        for kind in self.KINDS:
            with self.subTest(kind):
                self.assertIn(kind, FAMILIES)
                self.compressed(kind)

    def compressed(self, kind):
        model = tiny_lm(kind, 200, seed=2)
        ids, mask = self.batch()
        keep = mask.bool()
        with torch.no_grad():
            full = model(input_ids=ids, attention_mask=mask).logits
            d = model.config.head_dim
            for rope in ("post", "pre"):
                for fold in (False, True):
                    with kqsvd.compressed(model, orthonormal_projections(model, d, rope), fold=fold):
                        got = model(input_ids=ids, attention_mask=mask).logits
                    err = float((got - full)[keep].abs().max() / full[keep].abs().max())
                    self.assertLess(err, 1e-5, f"{kind} {rope} fold={fold}")
            low = orthonormal_projections(model, 5, seed=3)
            with kqsvd.compressed(model, low):
                out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5,
                                     do_sample=False, pad_token_id=0, return_dict_in_generate=True)
                seq, m = ids, mask
                for _ in range(5):
                    pos = (m.cumsum(-1) - 1).clamp(min=0)
                    nxt = model(input_ids=seq, attention_mask=m, position_ids=pos,
                                use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
                    seq, m = torch.cat([seq, nxt], -1), torch.cat([m, torch.ones_like(nxt)], -1)
            self.assertTrue(torch.equal(out.sequences, seq), kind)
            cache = output_cache(out)
            self.assertEqual({tuple(layer.keys.shape) for layer in cache.layers},
                             {(2, model.config.num_key_value_heads, seq.shape[1] - 1, 5)})
            self.assertTrue(torch.equal(model(input_ids=ids, attention_mask=mask).logits, full))

    def test_no_deprecated_cache_keyword(self):
        """transformers 5.24 renamed past_key_values to cache (removed in
        5.40) and warns at every use of the old name, in a call or an
        output: the package's own passes (a compressed block's cache, the
        quality command's scoring, a quantized cache read as codes) use
        whichever name the installed release takes, and warn nothing."""
        import logging
        import warnings

        from transformers import DynamicCache

        from kqsvd.attention.cache import QuantCache
        from kqsvd.compat import cache_kwarg
        from kqsvd.formats.quant import QuantScheme
        from kqsvd.quality.measure import window_logprobs
        model = tiny_lm("llama", 200, seed=2)
        ids, _ = self.batch()
        seen = []

        class Seen(logging.Handler):
            def emit(self, record):
                seen.append(record.getMessage())
        handler = Seen()
        logging.getLogger("transformers").addHandler(handler)
        try:
            with warnings.catch_warnings(record=True) as caught, torch.no_grad():
                warnings.simplefilter("always")
                key = cache_kwarg(model)
                window_logprobs(model, ids[:1], key)
                window_logprobs(model, ids[:1, :5], key, stepwise=True)
                with kqsvd.compressed(model, orthonormal_projections(model, 5)):
                    model.generate(input_ids=ids[:1], max_new_tokens=3, do_sample=False,
                                   pad_token_id=0)
                with kqsvd.reading_codes(model):
                    cache = QuantCache(model.config.num_hidden_layers, QuantScheme(group=4),
                                       (4, 4))
                    model.generate(input_ids=ids[:1], max_new_tokens=3, do_sample=False,
                                   pad_token_id=0, **{key: cache})
                model(input_ids=ids[:1], use_cache=True, **{key: DynamicCache()})
        finally:
            logging.getLogger("transformers").removeHandler(handler)
        said = [str(w.message) for w in caught] + seen
        self.assertEqual([m for m in said if "deprecated" in m or "past_key_values" in m], [])

    def test_capture(self):
        for kind in self.KINDS:
            with self.subTest(kind):
                self.capture(kind)

    def capture(self, kind):
        model = tiny_lm(kind, 200, seed=4)
        cfg = model.config
        ids = self.batch()[0]
        b, T = ids.shape
        own = cfg._attn_implementation
        with torch.no_grad():
            full = model(input_ids=ids).logits
            lay = model.model.layers[0]
            att = lay.self_attn
            h = lay.input_layernorm(model.model.embed_tokens(ids))
            k = att.k_proj(h).view(b, T, cfg.num_key_value_heads, -1)
            if hasattr(att, "k_norm"):
                k = att.k_norm(k)
            k = k.transpose(1, 2)
            cos, sin = model.model.rotary_emb(h, torch.arange(T)[None])
            for rope, want in (("post", rotate(k, cos, sin)), ("pre", k)):
                got = {}

                def sink(layer, what, t, got=got):
                    got.setdefault((layer, what), t.detach().clone())
                with Capture(model.model, cfg.model_type, cfg, sink, rope):
                    same = model(input_ids=ids, use_cache=False).logits
                self.assertEqual(sorted(got), [(l, w) for l in range(cfg.num_hidden_layers)
                                               for w in "kqv"])
                err = float((got[(0, "k")] - want).abs().max() / want.abs().max())
                self.assertLess(err, 1e-6, f"{kind} {rope}")
                self.assertTrue(torch.equal(same, full), f"{kind} {rope}: capture changed logits")
        self.assertEqual(cfg._attn_implementation, own)


if __name__ == "__main__":
    unittest.main()
