"""Every kind of cache the package serves, on a tiny Llama (issue 61):
- the memory each holds, measured here by walking every object it
  references (gc's referents, the model's modules and the projections
  aside) and summing the distinct storages of their tensors, is what
  kqsvd.cache_bytes reports, and at most an eighth above the bytes of
  the tokens it holds (cache_bytes(held=True)): no view of a prefill
  kept alive, no room for 64 tokens after a short prompt;
- each row of a left-padded batch, greedy generate() in float64, gives
  the logits (to 1e-9) and tokens of its prompt run alone: padding
  enters no group's scale, no score, no tier's ranking; read as codes
  (float32) the same as dequantized;
- a tiered cache honours its prefill's mask (a token hidden there is
  the token removed) and refuses a later one that hides another."""
import contextlib
import dataclasses
import gc
import os
import types
import unittest
from unittest import mock

import numpy as np
import torch

from common import cache_kw, orthonormal_projections, tiny_lm
from test_decode_codes import group_projections

import kqsvd
from kqsvd.attention import compressed, kernel, reading_codes
from kqsvd.attention.cache import QuantCache
from kqsvd.attention.compressed import Site
from kqsvd.attention.projection import LayerProjection
from kqsvd.compat import cache_kwarg, output_cache
from kqsvd.errors import KqsvdError, UsageError
from kqsvd.formats.policy import parse
from kqsvd.formats.quant import QuantScheme, with_bits


def per_head(model, seed):
    """Orthonormal projections whose KV heads have ranks of their own."""
    p = orthonormal_projections(model, 8, seed=seed)
    heads = np.array([[8, 5]] * p.num_layers)
    cut = [m.copy() for m in p.key_down]
    for m in cut:
        m[1, :, 5:] = 0
    return dataclasses.replace(p, key_down=cut, query_down=cut, rank_k_heads=heads,
                               rank_v_heads=heads.copy())


def per_column(p, token_keys=False):
    """p with bits per latent column (16: unquantized) under groups of 8;
    keys per token too with token_keys (every run quantized together)."""
    L, H, d = p.num_layers, p.num_kv_heads, p.head_dim
    scheme = QuantScheme(group=8, key_axis="token" if token_keys else "channel")
    q = with_bits(p, (4, 4), scheme)
    ck, cv = np.zeros((L, H, d), np.int64), np.zeros((L, H, d), np.int64)
    ck[..., :6] = [8, 4, 2, 4, 3, 8] if token_keys else [8, 4, 16, 2, 4, 3]
    cv[..., :6] = [4, 4, 4, 2, 2, 8] if token_keys else [4, 4, 4, 2, 2, 16]
    return dataclasses.replace(q, bits_k=ck, bits_v=cv)


def tiered(p, text, bits=(4, 4)):
    """p carrying the tier layout `text`, its first tier p at `bits`."""
    lay = parse(text).tiers
    tier = with_bits(p, bits, QuantScheme(group=8))
    return dataclasses.replace(p, tiers=(lay, (tier, None)))


def kinds(model):
    """{name: (projections or None, plain cache bits or None, reading codes)}:
    every kind of cache, the float ones included."""
    orth = lambda **kw: orthonormal_projections(model, 6, **kw)  # noqa: E731
    g8 = QuantScheme(group=8)
    return {
        "full": (None, None, False),
        "float latent": (orth(seed=1), None, False),
        "float latent before RoPE": (orth(rope="pre", seed=2), None, False),
        "6@4 latent": (with_bits(orth(seed=3), (4, 4), g8), None, False),
        "6@4/2 latent, residual, rotated": (
            with_bits(orth(seed=4), (4, 2), QuantScheme(group=8, residual=3, rotate=True)),
            None, False),
        "per-column bits before RoPE": (per_column(orth(rope="pre", seed=5)), None, False),
        "per-column bits, keys per token": (per_column(orth(seed=6), True), None, False),
        "per-head ranks @4": (with_bits(per_head(model, 7), (4, 4), g8), None, False),
        "head groups @4": (with_bits(group_projections(model, 2, 10, 8), (4, 4), g8), None,
                           False),
        "int4 cache": (None, (4, 4), False),
        "int4 cache reading codes": (None, (4, 4), True),
        "tiers after RoPE": (tiered(orth(seed=9), "tiers:w4+s2+0.5x6@4+0.5xdrop"), None, False),
        "tiers before RoPE": (tiered(orth(rope="pre", seed=10), "tiers:w4+s2+0.6x6@4/2+0.4xdrop"),
                              None, False),
    }


@contextlib.contextmanager
def serving(model, kind):
    """The model as `kind` serves it; yields a new cache, None where the
    model starts its own."""
    proj, bits, codes = kind
    with contextlib.ExitStack() as stack:
        if proj is not None:
            stack.enter_context(compressed(model, proj))
        if codes:
            stack.enter_context(reading_codes(model))
        yield None if bits is None else (
            lambda: QuantCache(model.config.num_hidden_layers, QuantScheme(group=8), bits))


def referenced(cache):
    """Bytes of the distinct storages of every tensor reachable from cache
    through gc's referents, without entering the model (its modules), the
    projections, functions, classes or modules."""
    skip = (torch.nn.Module, Site, LayerProjection, types.FunctionType, types.ModuleType, type)
    seen, storages, todo = set(), {}, [cache]
    while todo:
        x = todo.pop()
        if id(x) in seen or isinstance(x, skip):
            continue
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            s = x.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
            continue
        todo.extend(gc.get_referents(x))
    return sum(storages.values())


class Memory(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.model = tiny_lm("llama", 97, seed=3, heads=4, kv_heads=2, hidden=64)
        cls.ids = torch.randint(0, 97, (2, 80), generator=torch.Generator().manual_seed(1))

    def check(self, name, cache):
        got, held = kqsvd.cache_bytes(cache), kqsvd.cache_bytes(cache, held=True)
        self.assertEqual(got, referenced(cache), name)
        self.assertLessEqual(held, got, name)
        self.assertLessEqual(got, held * 9 / 8, f"{name}: {got / held:.2f} x the held bytes")

    def test_referenced_is_reported_for_every_kind(self):
        for name, kind in kinds(self.model).items():
            for prompt in (23, 64):
                with self.subTest(name, prompt=prompt), torch.no_grad(), \
                        serving(self.model, kind) as new:
                    extra = {} if new is None else cache_kw(new())
                    out = self.model(input_ids=self.ids[:, :prompt], use_cache=True, **extra)
                    cache = output_cache(out)
                    self.check(f"{name} after the prefill", cache)
                    for t in range(prompt, prompt + 9):
                        self.model(input_ids=self.ids[:, t:t + 1], **cache_kw(cache),
                                   use_cache=True)
                    self.check(f"{name} after 9 steps", cache)

    def test_float_bytes_rescales_what_is_referenced(self):
        with torch.no_grad():
            cache = output_cache(self.model(input_ids=self.ids[:, :30], use_cache=True))
        self.assertEqual(kqsvd.cache_bytes(cache, 2) * 2, kqsvd.cache_bytes(cache))
        with torch.no_grad(), serving(self.model, (None, (4, 4), False)) as new:
            cache = new()
            self.model(input_ids=self.ids[:, :30], **cache_kw(cache), use_cache=True)
        # codes and float16 scales as stored; the 6 key tokens of a block
        # not yet complete (30 = 3 x 8 + 6) as bf16
        held = 2 * 2 * 2 * 6 * 16 * 4
        self.assertEqual(kqsvd.cache_bytes(cache) - kqsvd.cache_bytes(cache, 2), held // 2)

    def test_refusals(self):
        for bad in (None, 3, "cache", ((1, 2),)):
            with self.assertRaises(UsageError) as e:
                kqsvd.cache_bytes(bad)
            self.assertEqual(len(str(e.exception).splitlines()), 1)
            self.assertIn("cache_bytes", str(e.exception))
        with self.assertRaises(UsageError):
            kqsvd.cache_bytes((), float_bytes=1.5)


def generate(model, kind, ids, mask=None, steps=6):
    """Greedy generate() of `kind` from ids (left-padded by mask): (tokens
    [b, steps], logits [b, steps, V])."""
    with torch.no_grad(), serving(model, kind) as new:
        extra = {} if new is None else {cache_kwarg(model): new()}
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps,
                             min_new_tokens=steps, do_sample=False, pad_token_id=0,
                             return_dict_in_generate=True, output_logits=True, **extra)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1)


def left_padded(prompts):
    """A batch of prompts (int64 [n] each) padded on the left with 0, and
    its attention mask."""
    T = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), T, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, T - len(p):], mask[i, T - len(p):] = p, 1
    return ids, mask


class Padded(unittest.TestCase):
    """Prompts of 33, 45 and 40 tokens (12, 0 and 5 of padding: none a
    multiple of the key blocks' 8), each row against the prompt alone."""

    @classmethod
    def setUpClass(cls):
        cls.model = tiny_lm("llama", 97, seed=5, heads=4, kv_heads=2, hidden=64).double()
        g = torch.Generator().manual_seed(2)
        cls.prompts = [torch.randint(1, 97, (n,), generator=g) for n in (33, 45, 40)]

    def test_each_row_is_its_prompt_alone(self):
        ids, mask = left_padded(self.prompts)
        for name, kind in kinds(self.model).items():
            with self.subTest(name):
                tokens, logits = generate(self.model, kind, ids, mask)
                for i, p in enumerate(self.prompts):
                    t1, l1 = generate(self.model, kind, p[None])
                    np.testing.assert_allclose(logits[i].numpy(), l1[0].numpy(), rtol=0,
                                               atol=1e-9, err_msg=f"{name}: row {i}")
                    self.assertEqual(tokens[i].tolist(), t1[0].tolist(), f"{name}: row {i}")

    def test_padding_longer_than_the_first_chunk(self):
        """A padded batch prefilled in chunks, the first holding only padding
        for a row: refused in one line (the row's padding entered its key
        blocks' scales, 0.031 off its prompt alone); chunks past the
        longest padding serve each row as its prompt alone."""
        ids, mask = left_padded(self.prompts)
        pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
        L = self.model.config.num_hidden_layers

        def chunked(n):
            cache = QuantCache(L, QuantScheme(group=8), (4, 4))
            with torch.no_grad():
                for a in range(0, ids.shape[1], n):
                    out = self.model(input_ids=ids[:, a:a + n], attention_mask=mask[:, :a + n],
                                     position_ids=pos[:, a:a + n], use_cache=True,
                                     **cache_kw(cache))
            return out.logits[:, -1]
        with self.assertRaises(KqsvdError) as e:
            chunked(8)
        self.assertEqual(len(str(e.exception).splitlines()), 1)
        self.assertIn("row 0", str(e.exception))
        got = chunked(16)  # row 0's 12 of padding inside the first chunk
        for i, p in enumerate(self.prompts):
            # alone, in the same chunks: the batch's cuts less the row's padding
            pad = ids.shape[1] - len(p)
            cuts = [0] + [c - pad for c in range(16, ids.shape[1], 16) if c > pad] + [len(p)]
            cache = QuantCache(L, QuantScheme(group=8), (4, 4))
            with torch.no_grad():
                for a, b in zip(cuts, cuts[1:]):
                    alone = self.model(input_ids=p[None, a:b], use_cache=True,
                                       position_ids=torch.arange(a, b)[None],
                                       **cache_kw(cache)).logits
            np.testing.assert_allclose(got[i].numpy(), alone[0, -1].numpy(), rtol=0, atol=1e-9,
                                       err_msg=f"row {i}")

    def test_padded_codes_read_as_the_floats(self):
        """float32: the padded batch's steps read as codes (quant.Rows, a
        store per row) as through the dequantized stores."""
        if not kernel.available(torch.zeros(1)):
            self.skipTest("libkqsvd's decode kernels are not there")
        model = tiny_lm("llama", 97, seed=5, heads=4, kv_heads=2, hidden=64)
        ids, mask = left_padded(self.prompts)
        ks = kinds(model)
        for name in ("6@4 latent", "per-head ranks @4", "head groups @4",
                     "int4 cache reading codes", "tiers after RoPE"):
            got = []
            for env in ("", "torch"):
                with mock.patch.dict(os.environ, KQSVD_DECODE=env):
                    kernel._LIB.clear()
                    got.append(generate(model, ks[name], ids, mask, 8)[1])
            kernel._LIB.clear()
            np.testing.assert_allclose(got[0].numpy(), got[1].numpy(), atol=2e-4, rtol=0,
                                       err_msg=name)


class TieredMasks(unittest.TestCase):
    """A tiered cache holds what its prefill's mask shows: a hole in it is
    the token removed (positions as generate() numbers them, from the
    mask), where the tiers had ignored it; a later step's mask that hides
    a held token, or shows a hidden one, is refused in one line."""

    @classmethod
    def setUpClass(cls):
        cls.model = tiny_lm("llama", 97, seed=6, heads=4, kv_heads=2, hidden=64).double()
        cls.ids = torch.randint(1, 97, (1, 30), generator=torch.Generator().manual_seed(3))
        cls.hole = torch.ones_like(cls.ids)
        cls.hole[0, 1] = 0

    def test_a_hole_is_the_token_removed(self):
        gone = torch.cat([self.ids[:, :1], self.ids[:, 2:]], 1)
        for name in ("full", "tiers after RoPE", "tiers before RoPE"):
            kind = kinds(self.model)[name]
            tokens, logits = generate(self.model, kind, self.ids, self.hole)
            t0, l0 = generate(self.model, kind, gone)
            np.testing.assert_allclose(logits.numpy(), l0.numpy(), rtol=0, atol=1e-9,
                                       err_msg=name)
            self.assertEqual(tokens.tolist(), t0.tolist(), name)
            _, whole = generate(self.model, kind, self.ids)
            self.assertGreater(float((whole - logits).abs().max()), 1e-3, f"{name}: no hole")

    def test_later_masks_that_cannot_be_honoured(self):
        kind = kinds(self.model)["tiers after RoPE"]
        ones = torch.ones(1, 31, dtype=torch.int64)
        later = ones.clone()
        later[0, 7] = 0
        for prefill, step in ((None, later), (self.hole, ones)):
            with torch.no_grad(), serving(self.model, kind):
                out = self.model(input_ids=self.ids, attention_mask=prefill, use_cache=True)
                with self.assertRaises(KqsvdError) as e:
                    self.model(input_ids=self.ids[:, -1:], attention_mask=step,
                               position_ids=torch.tensor([[30]]), use_cache=True,
                               **{cache_kwarg(self.model): output_cache(out)})
            self.assertIn("mask", str(e.exception))
            self.assertEqual(len(str(e.exception).splitlines()), 1)


if __name__ == "__main__":
    unittest.main()
