"""Compressed attention in transformers' models, tied to the C tool.

On tiny random GQA decoders whose caches went through export_hf.py and
`kqsvd calibrate`:
- at full rank the compressed model's logits are the full model's;
- the cached path (generate, a token at a time) equals the uncached one,
  and the cache holds r-wide tensors;
- folding B_v into o_proj changes nothing;
- in float64, the score and output errors the patched attention measures
  equal `kqsvd evaluate`'s err_kq and err_out;
- an independent re-implementation of the compressed Llama (written here
  from the weights, not through transformers) gives the same perplexity.
"""
import math
import os
import unittest

import numpy as np
import torch

from common import FAMILIES, cache_kw, Calibrated, evaluate, installed, padded, reference_llama_nll, tiny_lm

import kqsvd
from kqsvd import models
from kqsvd.compat import output_cache
from kqsvd.errors import KqsvdError, UsageError


def load_lm(path, dtype=torch.float32):
    model, tok, info = models.load(path, dtype=dtype)
    return model, tok, info


def windows(tok, n, seq_len, split="validation"):
    from common import TEXT
    return models.token_windows(tok, TEXT, seq_len, n, split)[0]


def rel(a, b):
    return float((a - b).norm() / b.norm())


class FullRank(unittest.TestCase):
    def test_logits_equal_at_full_rank(self):
        for kind in ("llama", "mistral", "qwen2"):
            c = Calibrated.get(kind)
            model, tok, info = load_lm(c.model)
            ids = torch.from_numpy(windows(tok, 2, 64))
            with torch.no_grad():
                full = model(input_ids=ids).logits
                for m in kqsvd.METHODS:
                    for fold in (False, True):
                        kqsvd.compress(model, kqsvd.load_projections(c.proj, m, info.head_dim),
                                       fold=fold)
                        got = model(input_ids=ids).logits
                        self.assertLess(rel(got, full), 1e-5, f"{kind} {m} fold={fold}")
                kqsvd.compress(model, None)
                self.assertEqual(rel(model(input_ids=ids).logits, full), 0.0, f"{kind} restored")

    def test_low_rank_changes_logits(self):
        c = Calibrated.get("llama")
        model, tok, info = load_lm(c.model)
        ids = torch.from_numpy(windows(tok, 1, 64))
        with torch.no_grad():
            full = model(input_ids=ids).logits
            kqsvd.compress(model, kqsvd.load_projections(c.proj, "kqsvd", 4))
            self.assertGreater(rel(model(input_ids=ids).logits, full), 1e-3)


class Cache(unittest.TestCase):
    def test_generate_and_cache_bytes(self):
        for kind in ("llama", "mistral", "qwen2"):
            with self.subTest(kind):
                self.generate(kind)

    def generate(self, kind):
        c = Calibrated.get(kind)
        model, tok, info = load_lm(c.model)
        proj = kqsvd.load_projections(c.proj, "kqsvd", "fixed:6")
        kqsvd.compress(model, proj)
        ids = torch.from_numpy(windows(tok, 1, 20))
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=8, do_sample=False,
                                 return_dict_in_generate=True, pad_token_id=0)
            seq = out.sequences
            # The same tokens from whole-sequence passes without a cache.
            for t in range(ids.shape[1], seq.shape[1]):
                logits = model(input_ids=seq[:, :t], use_cache=False).logits[0, -1]
                self.assertEqual(int(logits.argmax()), int(seq[0, t]), f"token {t}")
            # Incremental logits equal the uncached ones.
            step = model(input_ids=seq[:, :-1], use_cache=True)
            nxt = model(input_ids=seq[:, -1:], **cache_kw(output_cache(step)),
                        use_cache=True)
            whole = model(input_ids=seq, use_cache=False).logits[0, -1]
            self.assertLess(rel(nxt.logits[0, -1], whole), 1e-5)
            T = seq.shape[1]
            got = kqsvd.cache_bytes(output_cache(nxt))
            want = 4 * T * info.num_kv_heads * (proj.rank_k.sum() + proj.rank_v.sum())
            self.assertEqual(got, want)
            kqsvd.compress(model, None)
            fullc = output_cache(model(input_ids=seq, use_cache=True))
            # transformers' own layers keep no room, so their use is what
            # they reference: the tokens' keys and values, and beside them
            # the sliding-window layers' counter of 8 bytes
            tokens = 4 * T * info.num_kv_heads * 2 * info.head_dim * info.num_layers
            self.assertEqual(kqsvd.cache_bytes(fullc, held=True), kqsvd.cache_bytes(fullc))
            self.assertGreaterEqual(kqsvd.cache_bytes(fullc), tokens)
            self.assertLessEqual(kqsvd.cache_bytes(fullc) - tokens, 8 * info.num_layers)
            self.assertAlmostEqual(got / tokens, proj.cache_kept())


class PerHead(unittest.TestCase):
    """Ranks of their own per (layer, KV head): the cache holds each head's
    own columns, and the result equals the zero-padded matrices' (which
    compute the same scores and outputs the slow way)."""

    def ranks(self, info):
        rng = np.random.default_rng(7)
        shape = (info.num_layers, info.num_kv_heads)
        return (rng.integers(1, info.head_dim + 1, shape), rng.integers(1, info.head_dim + 1, shape))

    def test_ragged_equals_padded_and_cache_bytes(self):
        c = Calibrated.get("llama")
        model, tok, info = load_lm(c.model)
        rk, rv = self.ranks(info)
        ids = torch.from_numpy(windows(tok, 2, 24))
        for m in kqsvd.METHODS:
            proj = kqsvd.load_projections(c.proj, m, (rk, rv))
            self.assertEqual(proj.policy, "per-head")
            self.assertTrue(all(proj.per_head(l) for l in range(info.num_layers)))
            with torch.no_grad():
                kqsvd.compress(model, proj)
                self.assertTrue(kqsvd.attention.layer_projections(model)[0].ragged)
                step = model(input_ids=ids, use_cache=True)
                ragged = step.logits
                T = ids.shape[1]
                self.assertEqual(kqsvd.cache_bytes(output_cache(step)),
                                 4 * 2 * T * int(rk.sum() + rv.sum()))
                for fold in (True, False):
                    kqsvd.compress(model, proj, fold=fold)
                    for site, layer in zip(installed(model), model.model.layers):
                        if not fold:  # the padded path, the same numbers
                            site.P = padded(proj, layer, info)
                    got = model(input_ids=ids).logits
                    self.assertLess(rel(got, ragged), 1e-5, f"{m} fold={fold}")
                kqsvd.compress(model, None)
        self.assertAlmostEqual(proj.cache_kept(), (rk.sum() + rv.sum()) /
                               (2 * info.head_dim * info.num_layers * info.num_kv_heads))

    def test_stored_per_head_ranks_round_trip(self):
        c = Calibrated.get("llama")
        _, _, info = load_lm(c.model)
        rk, rv = self.ranks(info)
        out = os.path.join(c.wd, "per-head.h5")
        kqsvd.save_ranks(c.proj, out, {"kqsvd": (rk, rv)}, "test:per-head")
        p = kqsvd.load_projections(out, "kqsvd")
        self.assertEqual(p.policy, "test:per-head")
        np.testing.assert_array_equal(p.rank_k_heads, rk)
        np.testing.assert_array_equal(p.rank_v, rv.max(1))
        other = kqsvd.load_projections(out, "ksvd")  # untouched: per layer, as stored
        np.testing.assert_array_equal(other.rank_k_heads[:, 0], other.rank_k)
        import h5py
        with h5py.File(out, "r+") as f:
            f["kqsvd/rank_k"][0] += 1
        with self.assertRaisesRegex(KqsvdError, "'kqsvd/rank_k' is not each layer's largest"):
            kqsvd.load_projections(out, "kqsvd")


class Families(unittest.TestCase):
    """Every family the package compresses, through transformers' attention
    interface and cache layers: full-rank logits equal the model's (with
    o_proj folded too: Starcoder2's carries a bias), and greedy generate()
    over a left-padded batch, with the latent cache it starts by itself,
    equals whole-sequence decoding of the compressed model."""

    def test_every_family(self):
        c = Calibrated.get("llama")  # its full-rank A B^T = I suits any model of its sizes
        full = kqsvd.load_projections(c.proj, "kqsvd", 16)
        low = kqsvd.load_projections(c.proj, "kqsvd", "fixed:6")
        self.assertEqual(sorted(FAMILIES), sorted(models.COMPRESSIBLE))
        for kind in FAMILIES:
            with self.subTest(kind):
                self.family(kind, full, low)

    def family(self, kind, full, low):
        model = tiny_lm(kind, 300, seed=3)
        ids = torch.randint(3, 300, (2, 14), generator=torch.Generator().manual_seed(4))
        mask = torch.ones_like(ids)
        mask[1, :4] = 0  # left padding
        with torch.no_grad():
            want = model(input_ids=ids, attention_mask=mask).logits[mask.bool()]
            for fold in (False, True):
                with kqsvd.compressed(model, full, fold=fold):
                    got = model(input_ids=ids, attention_mask=mask).logits[mask.bool()]
                self.assertLess(rel(got, want), 1e-5, f"{kind} fold={fold}")
            with kqsvd.compressed(model, low):
                out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6,
                                     do_sample=False, pad_token_id=0, return_dict_in_generate=True)
                self.assertIsInstance(output_cache(out), kqsvd.attention.LatentCache)
                seq, m = ids, mask
                for _ in range(6):  # whole sequences, no cache, positions as generate's
                    pos = (m.cumsum(-1) - 1).clamp(min=0)
                    logits = model(input_ids=seq, attention_mask=m, position_ids=pos,
                                   use_cache=False).logits
                    nxt = logits[:, -1].argmax(-1, keepdim=True)
                    seq, m = torch.cat([seq, nxt], -1), torch.cat([m, torch.ones_like(nxt)], -1)
        self.assertTrue(torch.equal(out.sequences, seq), kind)
        T = seq.shape[1] - 1  # the last token is never fed back
        self.assertEqual(kqsvd.cache_bytes(output_cache(out)),
                         4 * 2 * T * 2 * int(low.rank_k.sum() + low.rank_v.sum()))


class TiedToEvaluate(unittest.TestCase):
    def test_probe_equals_kqsvd_evaluate(self):
        c = Calibrated.get("llama")
        model, tok, info = load_lm(c.model, torch.float64)
        ids = windows(tok, c.num_valid, c.seq_len)
        for policy in ("fixed:5", "eps:0.1"):
            rep = evaluate(c.valid[0], c.proj, c.valid[1], policy,
                           os.path.join(c.wd, "report.json"))
            for m in kqsvd.METHODS:
                kqsvd.compress(model, kqsvd.load_projections(c.proj, m, policy), probe=True)
                with torch.no_grad():
                    for row in ids:
                        model(input_ids=torch.from_numpy(row[None]), use_cache=False)
                errs = kqsvd.probe_errors(model)
                for l, e in enumerate(errs):
                    self.assertEqual(len(e), c.num_valid)
                    for i, key in enumerate(("err_kq", "err_out")):
                        want = rep["methods"][m]["layers"][l][key]
                        got = float(np.mean([x[i] for x in e]))
                        self.assertLess(abs(got - want) / want, 1e-6,
                                        f"{policy} {m} layer {l} {key}: {got} vs {want}")


def reference_nll(sd, cfg, proj, ids):
    """An independent compressed Llama (common.reference_llama_nll): GQA
    attention on K A and V A_v with q B scores and B_v^T before W^O.  Keys
    before RoPE (proj.rope "pre"): the cache holds k_pre A, the scores are
    RoPE(q) against RoPE(k_pre A B^T).  Returns the summed next-token NLL."""
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = cfg.hidden_size // hq

    def attention(l, q, k, v, rot, mask):
        out = torch.zeros(len(ids), hq * d, dtype=torch.float64)
        for head in range(hq):
            g = head // (hq // hkv)
            A, B = (torch.from_numpy(m[l][g]) for m in (proj.key_down, proj.query_down))
            Av, Bv = (torch.from_numpy(m[l][g]) for m in (proj.value_down, proj.value_up))
            if proj.rope == "pre":
                qh = rot(q[:, head * d:(head + 1) * d])
                kh = rot(k[:, g * d:(g + 1) * d] @ A @ B.T)
            else:
                qh = rot(q[:, head * d:(head + 1) * d]) @ B
                kh = rot(k[:, g * d:(g + 1) * d]) @ A
            w = torch.softmax(qh @ kh.T / math.sqrt(d) + mask, -1)
            out[:, head * d:(head + 1) * d] = w @ (v[:, g * d:(g + 1) * d] @ Av) @ Bv.T
        return out

    return reference_llama_nll(sd, cfg, ids, attention)


class Reference(unittest.TestCase):
    def test_independent_perplexity(self):
        c = Calibrated.get("llama")
        model, tok, info = load_lm(c.model)
        ids = windows(tok, 2, 64)
        proj = kqsvd.load_projections(c.proj, "kqsvd", "fixed:5")
        sd = model.state_dict()
        ref = sum(reference_nll(sd, model.config, proj, row) for row in ids)
        kqsvd.compress(model, proj)
        got = 0.0
        with torch.no_grad():
            for row in ids:
                logp = torch.log_softmax(model(input_ids=torch.from_numpy(row[None])).logits[0, :-1]
                                         .double(), -1)
                got -= float(logp.gather(1, torch.from_numpy(row[1:])[:, None]).sum())
        n = ids.shape[0] * (ids.shape[1] - 1)
        self.assertLess(abs(math.exp(got / n) / math.exp(ref / n) - 1), 1e-4)
        # and the compression mattered
        kqsvd.compress(model, None)
        self.assertGreater(abs(reference_nll(sd, model.config, proj, ids[0]) -
                               reference_nll(sd, model.config, kqsvd.load_projections(
                                   c.proj, "kqsvd", info.head_dim), ids[0])), 1e-3)


class Errors(unittest.TestCase):
    def test_refusals(self):
        c = Calibrated.get("llama")
        model, tok, info = load_lm(c.model)
        other = Calibrated.get("qwen2")  # same sizes: compatible, so build a mismatch by hand
        proj = kqsvd.load_projections(other.proj, "ksvd", 3)
        proj.num_layers = 3
        with self.assertRaisesRegex(KqsvdError, "num_layers = 3.*another model"):
            kqsvd.compress(model, proj)
        with self.assertRaisesRegex(UsageError, "outside 1..head_dim = 16"):
            kqsvd.load_projections(c.proj, "kqsvd", 17)
        with self.assertRaisesRegex(UsageError, "unknown method 'svd'"):
            kqsvd.load_projections(c.proj, "svd")
        with self.assertRaisesRegex(UsageError, "foo"):
            kqsvd.load_projections(c.proj, "kqsvd", "foo:1")
        with self.assertRaisesRegex(KqsvdError, "not a kqsvd projections file"):
            kqsvd.load_projections(c.valid[0], "kqsvd")


class Safetensors(unittest.TestCase):
    def test_export(self):
        from safetensors import safe_open
        c = Calibrated.get("llama")
        model, tok, info = load_lm(c.model)
        proj = kqsvd.load_projections(c.proj, "eigen", "eps:0.1")
        path = os.path.join(c.wd, "eigen.safetensors")
        o = [lay.self_attn.o_proj.weight.detach() for lay in model.model.layers]
        kqsvd.export_safetensors(c.proj, path, "eigen", "eps:0.1", "float64", o_proj=o)
        self.assertFalse(os.path.exists(path + ".tmp"))
        with safe_open(path, "pt") as f:
            meta = f.metadata()
            self.assertEqual((meta["method"], meta["policy"]), ("eigen", "eps:0.1"))
            self.assertEqual((meta["rope"], meta["tuned"]), ("post", "0"))
            for l in range(info.num_layers):
                for n in ("key_down", "query_down", "value_down", "value_up"):
                    got = f.get_tensor(f"layers.{l}.{n}").numpy()
                    self.assertTrue(np.array_equal(got, getattr(proj, n)[l]), f"{l} {n}")
                F = f.get_tensor(f"layers.{l}.o_proj_folded")
                self.assertEqual(tuple(F.shape), (info.hidden_size,
                                                  info.num_heads * int(proj.rank_v[l])))
                self.assertLess(rel(F, kqsvd.fold_o_proj(o[l], proj.value_up[l], info.num_heads)),
                                1e-15)
        with self.assertRaisesRegex(UsageError, "dtype 'int8'"):
            kqsvd.export_safetensors(c.proj, path, "eigen", None, "int8")


class Fold(unittest.TestCase):
    def test_fold_matches_blocks(self):
        g = torch.Generator().manual_seed(0)
        W = torch.randn(10, 4 * 3, generator=g, dtype=torch.float64)
        Bv = torch.randn(2, 3, 2, generator=g, dtype=torch.float64)
        F = kqsvd.fold_o_proj(W, Bv, 4)
        self.assertEqual(tuple(F.shape), (10, 8))
        o = torch.randn(5, 4, 2, generator=g, dtype=torch.float64)  # [T, Hq, r]
        heads = torch.einsum("thr,hdr->thd", o, Bv.repeat_interleave(2, 0)).reshape(5, 12)
        self.assertLess(rel(o.reshape(5, 8) @ F.T, heads @ W.T), 1e-14)


if __name__ == "__main__":
    unittest.main()
