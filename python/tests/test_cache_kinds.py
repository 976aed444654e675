"""Every kind of cache the package serves, on a tiny Llama (issue 61):
- the memory each holds, measured here by walking every object it
  references (gc's referents, the model's modules and the projections
  aside) and summing the distinct storages of their tensors, is what
  kqsvd.cache_bytes reports, and at most an eighth above the bytes of
  the tokens it holds (cache_bytes(held=True)): no view of a prefill
  kept alive, no room for 64 tokens after a short prompt."""
import contextlib
import dataclasses
import gc
import types
import unittest

import numpy as np
import torch

from common import orthonormal_projections, tiny_lm
from test_decode_codes import group_projections

import kqsvd
from kqsvd.attention import compressed, reading_codes
from kqsvd.attention.cache import QuantCache
from kqsvd.attention.compressed import Site
from kqsvd.attention.projection import LayerProjection
from kqsvd.errors import UsageError
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
                    extra = {} if new is None else {"past_key_values": new()}
                    out = self.model(input_ids=self.ids[:, :prompt], use_cache=True, **extra)
                    cache = out.past_key_values
                    self.check(f"{name} after the prefill", cache)
                    for t in range(prompt, prompt + 9):
                        self.model(input_ids=self.ids[:, t:t + 1], past_key_values=cache,
                                   use_cache=True)
                    self.check(f"{name} after 9 steps", cache)

    def test_float_bytes_rescales_what_is_referenced(self):
        with torch.no_grad():
            cache = self.model(input_ids=self.ids[:, :30], use_cache=True).past_key_values
        self.assertEqual(kqsvd.cache_bytes(cache, 2) * 2, kqsvd.cache_bytes(cache))
        with torch.no_grad(), serving(self.model, (None, (4, 4), False)) as new:
            cache = new()
            self.model(input_ids=self.ids[:, :30], past_key_values=cache, use_cache=True)
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


if __name__ == "__main__":
    unittest.main()
