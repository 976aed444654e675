"""compress(), compressed() and reading_codes() across each other, and
their arguments, as a user mixes them: every exit, in any order, leaves
the model's attention implementation exactly as it was before the first
switch, projections installed inside a reading_codes() block keep working
after it, a cache of removed projections says so in one KqsvdError, and a
model that is not one is a UsageError naming the call."""
import threading
import unittest

import torch
from test_hostile import HostileCase

import kqsvd
from kqsvd.attention import compress, compressed, latent_cache, reading_codes
from kqsvd.compat import cache_kwarg
from kqsvd.models import load


class ModelCase(HostileCase):
    """A fresh tiny model and its projections for each test."""
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


class AcrossEachOther(ModelCase):
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


def snapshot(m, ids):
    """Everything of model m a block may change: weights, every module's
    identity, attributes and hooks, every config's attributes (the
    attention implementation among them), and its logits on ids."""
    from kqsvd.compat import _configs
    with torch.no_grad():
        logits = m(input_ids=ids, use_cache=False).logits
    return dict(
        state={k: v.clone() for k, v in m.state_dict().items()},
        modules={n: (id(x), sorted(vars(x)), dict(x._forward_pre_hooks), dict(x._forward_hooks))
                 for n, x in m.named_modules()},
        configs=[{k: repr(v) for k, v in vars(c).items()} for c in _configs(m.config)],
        logits=logits)


class Threads(ModelCase):
    """compressed() and reading_codes() are not thread-safe: a second
    thread's entry while one thread's block is open on a model is refused
    in one KqsvdError naming both threads, the first block runs on
    undisturbed, and after every exit (nested, raising) the model is
    exactly the untouched one."""

    def same(self, before):
        after = snapshot(self.m, self.ids)
        for key in ("state", "modules", "configs"):
            if key == "state":
                self.assertEqual(before[key].keys(), after[key].keys())
                for k, v in before[key].items():
                    self.assertTrue(torch.equal(v, after[key][k]), k)
            else:
                self.assertEqual(before[key], after[key], key)
        self.assertTrue(torch.equal(before["logits"], after["logits"]), "logits changed")

    def test_a_second_thread(self):
        before = snapshot(self.m, self.ids)
        with compressed(self.m, self.p):
            with torch.no_grad():
                want = self.m(input_ids=self.ids, use_cache=False).logits
        entered, tried, got = threading.Event(), threading.Event(), {}

        def first():
            try:
                with compressed(self.m, self.p):
                    entered.set()
                    tried.wait(60)
                    with torch.no_grad():
                        got["logits"] = self.m(input_ids=self.ids, use_cache=False).logits
                    self.generates()
            except Exception as e:  # noqa: BLE001 - reported below
                got["first"] = e
            finally:
                entered.set()

        def second():
            entered.wait(60)
            for name, call in (("compressed", lambda: compressed(self.m, self.p).__enter__()),
                               ("reading_codes", lambda: reading_codes(self.m).__enter__()),
                               ("compress", lambda: compress(self.m, self.p)),
                               ("compress", lambda: compress(self.m, None))):
                try:
                    call()
                    got[name] = None
                except Exception as e:  # noqa: BLE001 - checked below
                    got.setdefault(name, e)
            tried.set()

        threads = [threading.Thread(target=first, name="kqsvd-first"),
                   threading.Thread(target=second, name="kqsvd-second")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        self.assertNotIn("first", got, f"the first block failed: {got.get('first')!r}")
        self.assertTrue(torch.equal(got["logits"], want), "the first block was disturbed")
        for name in ("compressed", "reading_codes", "compress"):
            e = got[name]
            self.assertIsInstance(e, kqsvd.KqsvdError, name)
            msg = str(e)
            self.assertEqual(len(msg.splitlines()), 1, msg)
            for word in (name, "kqsvd-first", "kqsvd-second", "not thread-safe"):
                self.assertIn(word, msg)
        self.same(before)
        # released: another thread enters now
        self.enters_from_another_thread()
        self.same(before)

    def enters_from_another_thread(self):
        """Nothing of a block is held: another thread's blocks run."""
        done = []

        def other():
            with compressed(self.m, self.p) as m, reading_codes(m):
                done.append(m)
        t = threading.Thread(target=other)
        t.start()
        t.join(60)
        self.assertEqual(done, [self.m], "a block left held after its exit")

    def test_nested_and_raising(self):
        before = snapshot(self.m, self.ids)
        for fold in (False, True):
            with compressed(self.m, self.p, fold=fold):
                with compressed(self.m, kqsvd.load_projections(self.proj, "ksvd", 3)):
                    with torch.no_grad():
                        self.generates()
            self.same(before)
            with self.assertRaises(ZeroDivisionError):
                with compressed(self.m, self.p, fold=fold), reading_codes(self.m):
                    with compressed(self.m, self.p):
                        1 / 0
            self.same(before)
        with self.assertRaises(kqsvd.UsageError):  # refused on entry: nothing held after
            with compressed(self.m, kqsvd.load_projections(self.proj, "kqsvd", 4)):
                compressed(self.m, "x").__enter__()
        self.same(before)
        self.enters_from_another_thread()
        self.same(before)


if __name__ == "__main__":
    unittest.main()
