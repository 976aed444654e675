"""The attention path's structure (issue 57), read from the package itself:
one table of the tiered cache's scorers, by the names a layout writes;
one map from attention modules to what each registered function reads
for them; a site's tiers one frozen record; the cache layers' shared
base."""
import dataclasses
import unittest

import torch

from common import orthonormal_projections, tiny_lm

from kqsvd import compat
from kqsvd.attention import cache, compressed, function, layer, scorers, tiers
from kqsvd.attention.compressed import Site, SiteTiers
from kqsvd.calibration import capture
from kqsvd.errors import KqsvdError
from kqsvd.formats import tiers as formats_tiers


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
