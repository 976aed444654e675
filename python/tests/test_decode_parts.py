"""The attention path's structure (issue 57), read from the package itself:
one decode attention over parts, its softmax in decode.py alone;
one table of the tiered cache's scorers, by the names a layout writes;
one map from attention modules to what each registered function reads
for them; a site's tiers one frozen record; the cache layers' shared
base; a reader chosen once per store, handed the store's layout; a
layer's projections in units."""
import ast
import dataclasses
import inspect
import os
import unittest
import unittest.mock

import numpy as np
import torch

from common import cache_kw, orthonormal_projections, tiny_lm

from kqsvd import compat
from kqsvd.compat import output_cache
from kqsvd.attention import (cache, compressed, decode, function, kernel, layer, projection,
                             scorers, tiers)
from kqsvd.attention.compressed import Site, SiteTiers
from kqsvd.calibration import capture
from kqsvd.errors import KqsvdError
from kqsvd.formats import tiers as formats_tiers
from kqsvd.formats.quant import QuantScheme, with_bits


class OneOfEach(unittest.TestCase):
    def test_the_scorers_are_the_layouts_names(self):
        self.assertEqual(tuple(scorers.SCORERS), formats_tiers.SCORERS)
        self.assertFalse(hasattr(formats_tiers, "OBSERVED"), "a runtime constant in formats/")
        self.assertEqual(scorers.OBSERVED, 64)

    def test_one_map_of_attention_modules(self):
        """compressed() and a capture attach to the same module side by
        side, each under its function's name, and each removes its own."""
        model = tiny_lm("llama", 97, seed=3, heads=4, kv_heads=2, hidden=64)
        attn = model.model.layers[0].self_attn
        proj = orthonormal_projections(model, 6, seed=1)
        for mod in (function, capture):
            self.assertFalse([n for n, v in vars(mod).items()
                              if type(v).__name__ == "WeakKeyDictionary"], mod.__name__)
        with compressed(model, proj):
            site = compat.attached(attn, function.NAME)
            self.assertIsInstance(site, Site)
            with capture.Capture(model.model, "llama", model.config, lambda *a: None):
                self.assertIs(compat.attached(attn, function.NAME), site)
                self.assertEqual(compat.attached(attn, capture.CAPTURE)[1], 0)
            self.assertIsNone(compat.attached(attn, capture.CAPTURE))
            self.assertIs(compat.attached(attn, function.NAME), site)
        self.assertIsNone(compat.attached(attn, function.NAME))

    def test_site_tiers_a_frozen_record(self):
        self.assertTrue(dataclasses.is_dataclass(SiteTiers))
        lay = formats_tiers.parse("tiers:w4+1xdrop")
        t = SiteTiers(lay, (None,))
        with self.assertRaises(dataclasses.FrozenInstanceError):
            t.layout = lay

    def test_one_base_for_the_layers(self):
        for cls in (cache.LatentLayer, cache.QuantLayer, tiers.TierLayer):
            self.assertTrue(issubclass(cls, layer.KqsvdLayer), cls.__name__)
        for cls in (cache.LatentLayer, tiers.TierLayer):  # QuantLayer's makes its columns
            self.assertNotIn("lazy_initialization", vars(cls), cls.__name__)
        for cls, kind in ((cache.QuantLayer, "quantized"), (tiers.TierLayer, "tiered")):
            with self.assertRaises(KqsvdError) as e:
                cls.crop(object.__new__(cls), 3)
            self.assertEqual(str(e.exception),
                             f"a {kind} cache cannot be cropped, reordered or repeated")

    def test_one_position_shim(self):
        pos = torch.tensor([[3, 4]])
        p = compat.update_places(None, {"position_ids": pos})
        self.assertIs(p.position_ids, pos)
        self.assertIsNone(p.cos)
        cos, sin = torch.ones(1, 2, 4), torch.zeros(1, 2, 4)
        p = compat.update_places({"cos": cos, "sin": sin, "cache_position": torch.arange(2)},
                                 None)
        self.assertIs(p.cos, cos)
        self.assertEqual(p.positions().tolist(), [[0, 1]])
        self.assertIsNone(compat.update_places(None, None).positions())
        for mod in (cache, tiers):
            self.assertNotIn("cache_kwargs.get", open(mod.__file__).read(), mod.__name__)


if __name__ == "__main__":
    unittest.main()


class OneAttention(unittest.TestCase):
    """decode.attend over parts side by side is the attention over their
    tokens together: one softmax, the sum of the weighted sums; and a
    decode step's softmax is written in decode.py alone."""

    def test_parts_side_by_side_are_one_attention(self):
        g = torch.Generator().manual_seed(0)
        q = torch.randn(2, 4, 3, 8, generator=g, dtype=torch.float64)
        k, v = (torch.randn(2, 2, 11, 8, generator=g, dtype=torch.float64) for _ in range(2))
        whole = decode.attend(q, [decode.Exact(k, v)], 0.3, causal=True)
        parts = [decode.Exact(k[:, :, a:b], v[:, :, a:b]) for a, b in ((0, 4), (4, 5), (5, 11))]
        torch.testing.assert_close(decode.attend(q, parts, 0.3, causal=True), whole,
                                   rtol=0, atol=1e-12)
        s = (q.reshape(2, 2, 6, 8) @ k.transpose(-1, -2)).view(2, 4, 3, 11) * 0.3
        s[..., -3:] = s[..., -3:].masked_fill(~torch.ones(3, 3, dtype=torch.bool).tril(),
                                              float("-inf"))
        want = (torch.softmax(s, -1).reshape(2, 2, 6, 11) @ v).view(2, 4, 3, 8)
        torch.testing.assert_close(whole, want, rtol=0, atol=1e-12)

    def test_one_softmax_for_a_decode_step(self):
        folder = os.path.dirname(decode.__file__)
        calls = {}
        for f in sorted(os.listdir(folder)):
            if f.endswith(".py"):
                tree = ast.parse(open(os.path.join(folder, f)).read())
                tops = [n for n in tree.body if isinstance(n, ast.FunctionDef)] + [
                    m for c in tree.body if isinstance(c, ast.ClassDef) for m in c.body
                    if isinstance(m, ast.FunctionDef)]
                for fn in tops:  # a function or method, what it defines inside included
                    if any(isinstance(c, ast.Call) and "softmax" in ast.unparse(c.func)
                           for c in ast.walk(fn)):
                        calls.setdefault(f, set()).add(fn.name)
        # the prefill's scorers and probe mode's eager measurement are no decode step
        self.assertEqual(calls, {"decode.py": {"attend"}, "projected.py": {"_measure"},
                                 "scorers.py": {"_share", "expected"}})

    def test_latent_attention_fits(self):
        src = inspect.getsource(function.latent_attention)
        self.assertLessEqual(len(src.splitlines()), 80)


class WhatALayerHolds(unittest.TestCase):
    """The attention function knows no cache class: what a layer holds
    comes in its note (handoff.Note), a tiered prefill's queries go back
    through it."""

    def test_function_names_no_cache_class(self):
        tree = ast.parse(open(function.__file__).read())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        self.assertFalse(imported & {"cache", "tiers", "layer", "quant", "compressed"}, imported)
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
            n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        classes = {n for m in (cache, tiers, layer) for n, v in vars(m).items()
                   if isinstance(v, type) and v.__module__ == m.__name__}
        self.assertFalse(names & (classes | {"settle", "layer"}), names & (classes | {"settle"}))

    def test_a_tiered_prefill_settles_through_its_note(self):
        model = tiny_lm("llama", 97, seed=3, heads=4, kv_heads=2, hidden=64)
        proj = orthonormal_projections(model, 6, seed=1)
        lay = formats_tiers.parse("tiers:w4+s1+1xdrop")
        proj = dataclasses.replace(proj, tiers=(lay, (None,)))
        ids = torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(0))
        seen = []
        real = tiers.TierLayer.settle

        def settle(self, *args):
            seen.append(type(args[0]).__name__)
            return real(self, *args)
        with torch.no_grad(), compressed(model, proj), \
                unittest.mock.patch.object(tiers.TierLayer, "settle", settle):
            cache = output_cache(model(input_ids=ids, use_cache=True))
        self.assertEqual(seen, ["Tensor"] * model.config.num_hidden_layers)
        self.assertEqual([layer_.prefill for layer_ in cache.layers],
                         [None] * model.config.num_hidden_layers)


class AReaderPerStore(unittest.TestCase):
    """What reads a store's codes is chosen once per store, when its first
    tokens show their device and dtype (kernel.reader, the one place
    KQSVD_DECODE is read), and the kernels are handed the store's Layout."""

    def test_the_environment_read_where_the_reader_is_chosen(self):
        for mod, allowed in ((kernel, {"reader"}), (triton_source(), set())):
            tree = ast.parse(open(mod.__file__).read()) if hasattr(mod, "__file__") else mod
            readers = {fn.name for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef)
                       and "os.environ" in ast.unparse(fn)}
            self.assertEqual(readers, allowed)

    def test_chosen_once_per_store(self):
        if not kernel.available(torch.zeros(1)):
            self.skipTest("libkqsvd's decode kernels are not there")
        model = tiny_lm("llama", 97, seed=3, heads=4, kv_heads=2, hidden=64)
        proj = with_bits(orthonormal_projections(model, 8, seed=1), (4, 2),
                         QuantScheme(group=8, residual=2))
        ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(0))
        chosen, handed = [], set()
        real, call = kernel.reader, kernel.Native._call

        def reader(x):
            chosen.append(x.device)
            return real(x)

        def native(self, name, lays, *args):
            handed.update(type(lay).__name__ for lay in lays)
            return call(self, name, lays, *args)
        with torch.no_grad(), compressed(model, proj), \
                unittest.mock.patch.object(kernel, "reader", reader), \
                unittest.mock.patch.object(kernel.Native, "_call", native):
            cache = output_cache(model(input_ids=ids[:, :30], use_cache=True))
            after = len(chosen)
            for t in range(30, 40):
                model(input_ids=ids[:, t:t + 1], **cache_kw(cache), use_cache=True)
        stores = sum(2 * len(layer_.cols.stores) for layer_ in cache.layers)
        self.assertEqual((after, len(chosen)), (stores, stores))
        self.assertEqual(handed, {"Layout"})


def triton_source():
    """triton_decode.py's tree (read, not imported: Triton may be missing)."""
    return ast.parse(open(os.path.join(os.path.dirname(kernel.__file__),
                                       "triton_decode.py")).read())


class Units(unittest.TestCase):
    """A LayerProjection works unit by unit: one unit for a layer whose
    heads share their ranks, one per KV head otherwise; nothing outside
    projection.py asks which."""

    def test_no_ragged_outside_projection(self):
        folder = os.path.dirname(decode.__file__)
        for root, _, files in os.walk(os.path.dirname(folder)):
            for f in files:
                path = os.path.join(root, f)
                if f.endswith(".py") and path != projection.__file__:
                    tree = ast.parse(open(path).read())
                    self.assertFalse([n for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                                      and n.attr == "ragged"], path)

    def test_one_unit_or_one_per_kv_head(self):
        model = tiny_lm("llama", 97, seed=3, heads=4, kv_heads=2, hidden=64)
        p = orthonormal_projections(model, 8, seed=1)
        P = projection.LayerProjection(p, 0, 4, torch.float64, "cpu")
        self.assertEqual(len(P.units), 1)
        self.assertIs(P.A, P.units[0].A)
        heads = np.array([[8, 5]] * p.num_layers)
        cut = [m.copy() for m in p.key_down]
        for m in cut:
            m[1, :, 5:] = 0
        p = dataclasses.replace(p, key_down=cut, query_down=cut, rank_k_heads=heads,
                                rank_v_heads=heads.copy())
        P = projection.LayerProjection(p, 0, 4, torch.float64, "cpu")
        self.assertEqual([(u.kv, u.q, u.A.shape[-1]) for u in P.units],
                         [(slice(0, 1), slice(0, 2), 8), (slice(1, 2), slice(2, 4), 5)])
        self.assertEqual([a.shape[-1] for a in P.A], [8, 5])
