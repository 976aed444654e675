"""compress(), compressed() and reading_codes() across each other, and
their arguments, as a user mixes them: every exit, in any order, leaves
the model's attention implementation exactly as it was before the first
switch, projections installed inside a reading_codes() block keep working
after it, a cache of removed projections says so in one KqsvdError, and a
model that is not one is a UsageError naming the call."""
import unittest

import torch
from test_hostile import HostileCase

import kqsvd
from kqsvd.attention import compress, compressed, latent_cache, reading_codes
from kqsvd.compat import cache_kwarg
from kqsvd.models import load


class AcrossEachOther(HostileCase):
    WORK = "hostile-attention"

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.ids = torch.arange(5, 21)[None]

    def setUp(self):
        super().setUp()
        self.m, _, _ = load(self.model)
        self.p = kqsvd.load_projections(self.proj, "kqsvd", 4)

    def step(self, ids, cache):
        with torch.no_grad():
            self.m(input_ids=ids, use_cache=True, **{cache_kwarg(self.m): cache})

    def impl(self):
        return self.m.config._attn_implementation

    def generates(self):
        """generate() runs through whatever is installed, without error."""
        out = self.m.generate(input_ids=self.ids, max_new_tokens=3, do_sample=False,
                              pad_token_id=0)
        self.assertEqual(out.shape[1], self.ids.shape[1] + 3)

    def test_compress_inside_a_reading_codes_block(self):
        for start in ("eager", "sdpa"):
            with self.subTest(start=start):
                self.m.set_attn_implementation(start)
                with reading_codes(self.m):
                    compress(self.m, self.p)
                    self.assertEqual(self.impl(), "kqsvd")
                # The projections outlive the block, and attend through them.
                self.assertEqual(self.impl(), "kqsvd")
                with torch.no_grad():
                    self.generates()
                compress(self.m, None)
                self.assertEqual(self.impl(), start)

    def test_a_block_inside_compress_and_nested_ones(self):
        self.m.set_attn_implementation("eager")
        compress(self.m, self.p)
        with reading_codes(self.m):
            with reading_codes(self.m):
                pass
            self.assertEqual(self.impl(), "kqsvd")
        self.assertEqual(self.impl(), "kqsvd")
        with compressed(self.m, self.p), reading_codes(self.m):
            pass
        self.assertEqual(self.impl(), "kqsvd")
        compress(self.m, None)
        self.assertEqual(self.impl(), "eager")
        # and the other way round: the block outlives a compressed() inside it
        with reading_codes(self.m):
            with compressed(self.m, self.p):
                pass
            self.assertEqual(self.impl(), "kqsvd")
        self.assertEqual(self.impl(), "eager")

    def test_a_cache_of_removed_projections(self):
        with compressed(self.m, self.p):
            cache = latent_cache(self.m)
            self.step(self.ids, cache)
        for _ in range(2):  # not only the first use
            with self.assertRaises(kqsvd.KqsvdError) as cm:
                self.step(self.ids[:, :1], cache)
            msg = str(cm.exception)
            self.assertEqual(len(msg.splitlines()), 1, msg)
            self.assertIn("belongs to a compressed model that no longer is", msg)
        # installed again (the same installation after a nested block): usable again
        compress(self.m, self.p)
        with compressed(self.m, kqsvd.load_projections(self.proj, "ksvd", 3)):
            pass
        fresh = latent_cache(self.m)
        self.step(self.ids, fresh)
        self.step(self.ids[:, :1], fresh)
        compress(self.m, None)

    def test_nothing_to_install(self):
        with self.assertRaises(kqsvd.UsageError) as cm:
            compressed(self.m, None).__enter__()
        self.assertIn("compressed: proj must be a Projections", str(cm.exception))
        self.assertNotIn("or None", str(cm.exception))  # compressed() removes nothing

    def test_not_a_model(self):
        for bad in ("x", None, 3, torch.zeros(2)):
            for name, call in (("reading_codes", lambda: reading_codes(bad).__enter__()),
                               ("compress", lambda: compress(bad, self.p)),
                               ("compress", lambda: compress(bad, None)),
                               ("compressed", lambda: compressed(bad, self.p).__enter__()),
                               ("latent_cache", lambda: latent_cache(bad))):
                with self.subTest(call=name, model=type(bad).__name__):
                    with self.assertRaises(kqsvd.UsageError) as cm:
                        call()
                    msg = str(cm.exception)
                    self.assertIn(name, msg)
                    self.assertIn(type(bad).__name__, msg)


if __name__ == "__main__":
    unittest.main()
