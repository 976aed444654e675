"""Decode steps over quantized latents read as codes (libkqsvd's
kqsvd_codes_scores and kqsvd_codes_weigh, through attention/kernel.py)
against the same steps through the dequantized cache (KQSVD_DECODE=torch),
whose values tests/test_quant.py checks against an independent model:
the same attention to float32 round-off, for every layout of the stores
(one slice, a slice per KV head, ranks per head, head groups), folded or
not, rotated or not, with a residual and channel blocks filling up across
the steps.  And the store's two products against a direct dequantization
for every number of bits and both axes."""
import contextlib
import dataclasses
import os
import unittest
from unittest import mock

import numpy as np
import torch

from common import cache_kw, orthonormal_projections, tiny_lm

from transformers import AttentionInterface

from kqsvd.attention import compress, compressed, function, kernel, latent_cache, reading_codes
from kqsvd.attention.cache import QuantCache
from kqsvd.attention.handoff import Note, hand, received
from kqsvd.attention.quant import RunStore, Store, dequantize, quantize
from kqsvd.errors import KqsvdError
from kqsvd.formats.projections import Projections
from kqsvd.formats.quant import QuantScheme, with_bits


def group_projections(model, G, rank, seed):
    """A head-groups file (docs/formats.md 5.3) for model: orthonormal A = B
    and A_v = B_v on each group's G d columns."""
    cfg = model.config
    L, hq, hkv = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads
    d = cfg.hidden_size // hq
    rng = np.random.default_rng(seed)

    def orth():
        return np.stack([np.linalg.qr(rng.standard_normal((G * d, G * d)))[0][:, :rank]
                         for _ in range(hkv // G)])
    a, av = [orth() for _ in range(L)], [orth() for _ in range(L)]
    ranks = np.full(L, rank, dtype=np.int64)
    heads = np.full((L, hkv // G), rank, dtype=np.int64)
    return Projections(path="groups", method="kqsvd", policy=f"fixed:{rank}", model="tiny",
                       num_layers=L, num_heads=hq, num_kv_heads=hkv // G, head_dim=G * d,
                       hidden_size=cfg.hidden_size, rank_k=ranks, rank_v=ranks.copy(),
                       key_down=a, query_down=a, value_down=av, value_up=av,
                       rank_k_heads=heads, rank_v_heads=heads.copy(), rope="post", head_groups=G)


class Steps(unittest.TestCase):
    """Each decode step's attention read as codes against the same step
    read through the dequantized stores, on the same cache state: whole
    runs cannot be compared to round-off, since a code may round the other
    way when its input moves by one unit in the last place."""

    @classmethod
    def setUpClass(cls):
        cls.model = tiny_lm("llama", 97, seed=3, heads=4, kv_heads=2, hidden=64)
        torch.manual_seed(5)
        cls.ids = torch.randint(0, 97, (2, 52))

    def steps(self, proj, fold):
        """A 37-token prompt and 15 steps of one token each; returns the
        largest difference of a step's attention output, read both ways,
        relative to the largest output, and how many steps read codes."""
        errs = []

        def both(module, query, key, value, mask, *args, **kwargs):
            note, _, _ = received(key, value)
            out = function.latent_attention(module, query, key, value, mask, *args, **kwargs)
            if note is not None and note.reading is not None:
                # the same step over the layer's stores dequantized
                kc, vc = note.read(query.dtype)
                latent = Note(note.site)
                want = function.latent_attention(module, query, hand(kc, latent),
                                                 hand(vc, latent), mask, *args, **kwargs)
                errs.append(float((out[0] - want[0]).abs().max() / want[0].abs().max()))
            return out

        AttentionInterface.register(function.NAME, both)
        try:
            with torch.no_grad():
                compress(self.model, proj, fold=fold)
                try:
                    cache = latent_cache(self.model)
                    self.model(input_ids=self.ids[:, :37], **cache_kw(cache), use_cache=True)
                    for t in range(37, self.ids.shape[1]):
                        self.model(input_ids=self.ids[:, t:t + 1], **cache_kw(cache),
                                   use_cache=True)
                finally:
                    compress(self.model, None)
        finally:
            AttentionInterface.register(function.NAME, function.latent_attention)
        return max(errs, default=float("inf")), len(errs)

    def check(self, proj, msg):
        self.assertIsNotNone(kernel.library(), "libkqsvd with the decode kernels is not built")
        layers = self.model.config.num_hidden_layers
        for fold in (False, True):
            err, n = self.steps(proj, fold)
            self.assertEqual(n, 15 * layers, f"{msg}: steps that read codes")
            self.assertLess(err, 2e-6, f"{msg}, fold {fold}")

    def test_one_slice_per_layer(self):
        proj = orthonormal_projections(self.model, 12, seed=1)
        for rotate in (False, True):
            for bits in ((2, 4), (3, 8)):
                p = with_bits(proj, bits, QuantScheme(group=8, residual=3, rotate=rotate))
                self.check(p, f"bits {bits} rotate {rotate}")

    def test_columns_of_their_own_bits_and_a_slice_per_head(self):
        proj = orthonormal_projections(self.model, 10, seed=2)
        p = with_bits(proj, (4, 4), QuantScheme(group=8, residual=0))
        L, H, d = p.num_layers, p.num_kv_heads, p.head_dim
        cols = np.zeros((L, H, d), np.int64)
        cols[:, 0, :10] = [8, 4, 16, 2, 4, 3, 2, 2, 3, 4]
        cols[:, 1, :10] = [2] * 10
        self.check(dataclasses.replace(p, bits_k=cols, bits_v=cols[:, ::-1].copy()),
                   "per-column bits")
        self.check(dataclasses.replace(p, bits_k=cols, bits_v=cols.copy(),
                                       quant=QuantScheme(group=8, key_axis="token",
                                                         value_axis="channel")),
                   "keys per token, values per channel")

    def test_runs_quantized_together(self):
        """Every run quantized, on the token axis, no residual: a token's
        runs are quantized in one library call (RunStore._together)."""
        proj = orthonormal_projections(self.model, 10, seed=5)
        p = with_bits(proj, (4, 4), QuantScheme(group=8, key_axis="token", residual=0))
        L, H, d = p.num_layers, p.num_kv_heads, p.head_dim
        cols = np.zeros((L, H, d), np.int64)
        cols[..., :10] = [8, 4, 2, 2, 4, 3, 2, 2, 3, 4]
        self.check(dataclasses.replace(p, bits_k=cols, bits_v=cols[:, ::-1].copy()),
                   "runs together")

    def test_ranks_per_head(self):
        proj = orthonormal_projections(self.model, 12, seed=3)
        proj.rank_k_heads[:] = [9, 12]
        proj.rank_v_heads[:] = [12, 5]
        self.check(with_bits(proj, (3, 2), QuantScheme(group=8, residual=2)), "ranks per head")

    def test_head_groups(self):
        proj = group_projections(self.model, 2, 20, seed=4)
        self.check(with_bits(proj, (2, 3), QuantScheme(group=8, residual=1)), "G = 2")

    def test_float64_and_the_switch_keep_the_dequantized_path(self):
        proj = with_bits(orthonormal_projections(self.model, 12, seed=1), (4, 4), QuantScheme())
        with mock.patch.dict(os.environ, {"KQSVD_DECODE": "torch"}):
            self.assertEqual(self.steps(proj, False)[1], 0)
        self.model.double()
        try:
            self.assertEqual(self.steps(proj, False)[1], 0)
        finally:
            self.model.float()


class Plain(unittest.TestCase):
    """A plain quantized cache (the model's own keys and values) inside
    reading_codes(): each decode step read as codes against SDPA over the
    same cache state dequantized; the model as it was after the block."""

    @classmethod
    def setUpClass(cls):
        cls.model = tiny_lm("llama", 97, seed=4, heads=6, kv_heads=2, hidden=96)
        torch.manual_seed(6)
        cls.ids = torch.randint(0, 97, (2, 45))

    def run_steps(self, scheme, bits, inside=True):
        """A 30-token prompt, 15 steps; (largest relative difference of a
        step's output read both ways, steps that read codes, last logits)."""
        errs = []

        def both(module, query, key, value, mask, *args, **kwargs):
            note, _, _ = received(key, value)
            out = function.latent_attention(module, query, key, value, mask, *args, **kwargs)
            if note is not None and note.reading is not None:
                kc, vc = note.read(query.dtype)
                want = function.sdpa_attention_forward(module, query, kc, vc, mask, *args,
                                                       **kwargs)
                errs.append(float((out[0] - want[0]).abs().max() / want[0].abs().max()))
            return out

        L = self.model.config.num_hidden_layers
        AttentionInterface.register(function.NAME, both)
        try:
            with torch.no_grad(), (reading_codes(self.model) if inside
                                   else contextlib.nullcontext()):
                cache = QuantCache(L, scheme, bits)
                self.model(input_ids=self.ids[:, :30], **cache_kw(cache), use_cache=True)
                for t in range(30, self.ids.shape[1]):
                    out = self.model(input_ids=self.ids[:, t:t + 1], **cache_kw(cache),
                                     use_cache=True)
        finally:
            AttentionInterface.register(function.NAME, function.latent_attention)
        return max(errs, default=float("inf")), len(errs), out.logits

    def test_steps_read_codes(self):
        self.assertIsNotNone(kernel.library(), "libkqsvd with the decode kernels is not built")
        L = self.model.config.num_hidden_layers
        for scheme, bits in ((QuantScheme(group=8, residual=3), (4, 4)),
                             (QuantScheme(group=16, residual=0), (3, 2)),
                             (QuantScheme(group=8, key_axis="token", value_axis="channel"),
                              (8, 4))):
            err, n, _ = self.run_steps(scheme, bits)
            self.assertEqual(n, 15 * L, f"{scheme} {bits}: steps that read codes")
            self.assertLess(err, 2e-6, f"{scheme} {bits}")

    def test_outside_the_block_and_after_it(self):
        for impl in ("sdpa", "eager"):
            self.model.set_attn_implementation(impl)
            scheme = QuantScheme(group=8, residual=2)
            _, n, before = self.run_steps(scheme, (4, 4), inside=False)
            self.assertEqual(n, 0)
            self.assertEqual(self.model.config._attn_implementation, impl)
            _, n, inside = self.run_steps(scheme, (4, 4))
            self.assertGreater(n, 0)
            self.assertEqual(self.model.config._attn_implementation, impl, "restored")
            torch.testing.assert_close(inside, before, rtol=0, atol=2e-4)
        self.model.set_attn_implementation("sdpa")

    def test_a_compressed_model_given_a_plain_cache_reads_it_whole(self):
        """Inside compressed() too, a plain cache's step hands its stores;
        the compressed attention then projects them dequantized."""
        proj = orthonormal_projections(self.model, 12, seed=7)
        L = self.model.config.num_hidden_layers
        scheme = QuantScheme(group=8, residual=2)
        got = []
        with torch.no_grad():
            for inside in (False, True):
                with compressed(self.model, proj), (reading_codes(self.model) if inside
                                                    else contextlib.nullcontext()):
                    cache = QuantCache(L, scheme, (4, 4))
                    self.model(input_ids=self.ids[:, :30], **cache_kw(cache), use_cache=True)
                    got.append(self.model(input_ids=self.ids[:, 30:31], **cache_kw(cache),
                                          use_cache=True).logits)
        torch.testing.assert_close(got[1], got[0], rtol=0, atol=1e-5)


class Products(unittest.TestCase):
    """Store.scores and Store.weigh against q x^T and p x of the store's
    dequantized values, every number of bits, both axes, tiles cut short."""

    def test_scores_and_sums(self):
        self.assertIsNotNone(kernel.library(), "libkqsvd with the decode kernels is not built")
        g = torch.Generator().manual_seed(0)
        for bits in (2, 3, 4, 8):
            for axis in ("channel", "token"):
                for T, n, nq, group in ((77, 37, 9, 8), (64, 190, 3, 32), (5, 3, 1, 2)):
                    st = Store(bits, group, axis, residual=2)
                    st.append(torch.randn(2, 3, T, n, generator=g) * 3 + 1, read=False)
                    x = st.values(torch.float64)
                    q = torch.randn(2, 3, nq, n, generator=g)
                    s = torch.randn(2, 3, nq, T + 4, generator=g)
                    want = s.double().clone()
                    want[..., :T] += q.double() @ x.transpose(-1, -2)
                    got = st.scores(q, s.clone())
                    tol = 1e-5 * float(want.abs().max())
                    self.assertLess(float((got - want).abs().max()), tol, f"{bits} {axis} {T}")
                    p = torch.softmax(torch.randn(2, 3, nq, T + 4, generator=g), -1)
                    want = p[..., :T].double() @ x
                    got = st.weigh(p)
                    tol = 1e-5 * float(want.abs().max())
                    self.assertLess(float((got - want).abs().max()), tol, f"{bits} {axis} {T}")

    def test_the_library_quantizes_to_the_bit(self):
        """kqsvd_codes_quantize against quant.quantize, the documented
        scheme: random rows, rows of integers whose quotients fall on
        exact halves (ties to even), constant groups (scale 0), short last
        groups, and the refusal of what float16 cannot hold."""
        g = torch.Generator().manual_seed(1)
        cases = [torch.randn(3, 5, 37, generator=g) * 4,
                 torch.randint(-8, 9, (4, 64), generator=g).float() / 2,
                 torch.full((2, 16), 0.3), torch.randn(7, 3, generator=g) * 1e3,
                 torch.randn(2, 2, 9, 33, generator=g).to(torch.bfloat16)]
        for x in cases:
            for bits in (2, 3, 4, 8):
                for group in (1, 3, 8, 32):
                    got = kernel.quantize(x, bits, group)
                    want = quantize(x, bits, group)
                    for a, b, name in zip(got, want, ("codes", "scale", "zero")):
                        self.assertTrue(torch.equal(a, b), f"{name}: {bits} bits, group {group}")
        for bad in (torch.tensor([[1.0, float("nan")]]), torch.tensor([[-7e4, 0.0]]),
                    torch.tensor([[-float("inf"), 0.0]])):
            with self.assertRaises(KqsvdError) as want:
                quantize(bad, 4, 2)
            with self.assertRaises(KqsvdError) as got:
                kernel.quantize(bad, 4, 2)
            self.assertEqual(str(got.exception), str(want.exception))

    def test_runs_together_are_runs_apart(self):
        """A RunStore's runs quantized in one call hold the codes, scales
        and zeros each run's own store holds when fed alone."""
        g = torch.Generator().manual_seed(2)
        runs = [(5, 8), (20, 3), (7, 2)]
        together = RunStore(runs, 4, "token")
        self.assertTrue(together._together(torch.zeros(1, 1, 1, 32)))
        apart = [Store(b, 4, "token") for _, b in runs]
        for t in (9, 1, 1, 3):
            x = torch.randn(2, 3, t, 32, generator=g)
            together.append(x, read=False)
            for st, a, b in zip(apart, together.cuts, together.cuts[1:]):
                st.append(x[..., a:b], read=False)
        for st, want in zip(together.parts, apart):
            for name in ("codes", "scale", "zero"):
                self.assertTrue(torch.equal(getattr(st, name), getattr(want, name)), name)
        self.assertTrue(torch.equal(together.values(torch.float32),
                                    torch.cat([st.values(torch.float32) for st in apart], -1)))

    def test_the_codes_are_the_stores(self):
        """The kernel reads the store's own codes: a store whose codes are
        zeroed gives the zeros' values, zero + 0 * scale."""
        st = Store(4, 8, "token")
        st.append(torch.randn(1, 1, 16, 8), read=False)
        st.codes.zero_()
        want = dequantize(st.codes, st.scale, st.zero, 4, 8, 8, torch.float32)
        p = torch.full((1, 1, 1, 16), 1 / 16)
        self.assertTrue(torch.allclose(st.weigh(p), want.mean(-2, keepdim=True), atol=1e-6))


if __name__ == "__main__":
    unittest.main()
