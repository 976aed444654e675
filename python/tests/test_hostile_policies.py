"""Rank policies, tiered layouts and budgets as users write them, read
alike by every surface that takes one (issue 61): the quality command,
the frontier, bench/passkey.py, bench/decode_speed.py's latent specs, a
file's stored `tiers` attribute and the library.  Each refusal is one
line naming the option or file, before the model loads where the file
and the model's header suffice (NO_LOAD), nothing left behind and every
input unchanged (test_hostile.HostileCase)."""
import contextlib
import io
import os
import shutil
import sys
import types
import unittest
from unittest import mock

import h5py
from common import tiny_decoder, workdir
from test_hostile import HostileCase, listing
from test_hostile_decode_speed import load_script as decode_speed
from test_hostile_passkey import _script

import kqsvd
from kqsvd.commands import frontier, quality
from kqsvd.errors import KqsvdError, UsageError

NO_LOAD = mock.patch("kqsvd.models.load", side_effect=AssertionError("the model was loaded"))


class HostilePolicies(HostileCase):
    WORK = "hostile-policies"

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.passkey = _script()

    # -- helpers --------------------------------------------------------------
    def refused(self, main, argv, code, *words, loads=False):
        """main(argv) in this process exits `code` with one line holding
        every word, self.out as it was; unless `loads`, before the load."""
        before = set(listing(self.out))
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()), \
                (contextlib.nullcontext() if loads else NO_LOAD):
            try:
                got = main(argv)
            except SystemExit as e:
                got = e.code
        return self.one_error(code, got, err.getvalue(), words, before)

    def quality(self, ranks, *extra):
        return ["--model", self.model, "--text", self.text, "--proj", self.proj, "--ranks", ranks,
                "--methods", "kqsvd", "--seq-len", "16", "--num-seqs", "1", "--calib-seqs", "1",
                "--json", os.path.join(self.out, "q.json"), *extra]

    def frontier(self, *extra):
        return ["--model", self.model, "--text", self.text, "--plain", "none",
                "--quantized-cache", "none", "--presses", "none", "--context", "16",
                "--continuation", "4", "--num-seqs", "1", "--json",
                os.path.join(self.out, "f.json"), *extra]

    def passkey_main(self, argv):
        with mock.patch.object(sys, "argv", ["passkey.py"] + argv):
            return self.passkey.main()

    def passkey_args(self, *extra):
        return ["--model", self.model, "--text", self.text, "--lengths", "120", "--depths", "0.5",
                "--plain", "none", "--presses", "none", "--json",
                os.path.join(self.out, "p.json"), *extra]

    def with_tiers_attribute(self, text):
        """A copy of the projections file whose kqsvd group stores `text`
        as its tiered layout (with the scheme a layout needs)."""
        path = os.path.join(self.wd, "tiers-attr.h5")
        shutil.copyfile(self.proj, path)
        with h5py.File(path, "r+") as f:
            f["kqsvd"].attrs["tiers"] = text
            for k, v in (("quant_group", 32), ("quant_key_axis", "channel"),
                         ("quant_value_axis", "token"), ("quant_residual", 0),
                         ("quant_rotate", 0)):
                f.attrs[k] = v
        return path

    # -- item 13: numbers in ASCII digits, everywhere --------------------------
    def test_digits_of_other_scripts_in_every_command(self):
        """Superscripts pass str.isdigit() and then fail int(): each
        surface refuses them in one line, as any other bad layout."""
        for bad in ("tiers:w²+1xdrop", "tiers:w8+1x³@4", "tiers:w8+s٣+1xdrop",
                    "tiers:w8+1x16@٤"):
            self.refused(quality.main, self.quality(bad), 2, "--ranks", bad.split("+")[0])
            self.refused(frontier.main, self.frontier("--proj", f"{self.proj}={bad}"), 2,
                         f"--proj {self.proj}", bad.split("+")[0])
            self.refused(self.passkey_main, self.passkey_args("--proj", f"{self.proj}={bad}"), 2,
                         "--proj", bad.split("+")[0])
            with self.assertRaises(UsageError):  # a --config, or a frontier report's label
                decode_speed().latent_spec(f"kqsvd:{self.proj}={bad}")
            with self.assertRaisesRegex(KqsvdError, "attribute 'kqsvd/tiers'"):
                kqsvd.load_projections(self.with_tiers_attribute(bad), "kqsvd")

    def test_digits_of_other_scripts_in_bits_and_numbers(self):
        """'@٤' is not 4 bits, nor '٦٤' 64 tokens: int() reads both."""
        self.refused(frontier.main, self.frontier("--proj", self.proj, "--ranks", "fixed:8@٤"), 2,
                     "fixed:8@٤")
        self.refused(frontier.main, self.frontier("--plain", "٤"), 2, "--plain", "'٤'")
        self.refused(quality.main, self.quality("fixed:4", "--num-seqs", "١"), 2, "--num-seqs",
                     "'١'")
        self.refused(frontier.main, self.frontier("--presses", "knorm", "--press-kept", "٠.٥"),
                     2, "--press-kept", "٠.٥")

    def test_a_scorer_given_twice(self):
        self.refused(quality.main, self.quality("tiers:w8+1xdrop+snap+expected"), 2,
                     "scorer given twice", "'snap'", "'expected'")

    def test_a_tier_wider_than_the_units(self):
        """10^20 columns are a tier's columns out of range, not a numpy
        object array."""
        wide = "tiers:w4+1x" + "1" + "0" * 20 + "@4"
        self.refused(frontier.main, self.frontier("--proj", f"{self.proj}={wide}"), 2,
                     f"--proj {self.proj}", "outside 1..16")
        self.refused(self.passkey_main, self.passkey_args("--proj", f"{self.proj}={wide}"), 2,
                     "--proj", "outside 1..16")
        self.refused(quality.main, self.quality(wide), 2, wide[:11],
                     "outside 1..16", loads=True)
        with self.assertRaisesRegex(UsageError, "outside 1..head_dim = 16"):
            kqsvd.load_projections(self.proj, "kqsvd", 10 ** 20)
        with self.assertRaisesRegex(UsageError, "outside 1..head_dim = 16"):
            kqsvd.load_projections(self.proj, "kqsvd", [3, 10 ** 20])

    # -- item 14: one configuration, however it is spelled ---------------------
    SPELLINGS = (("tiers:w8+1x16@4", "tiers:w8+1x16@4/4"), ("tiers:w8+1x16+snap", "tiers:1x016+w8"),
                 ("fixed:4@4", "fixed:4@4/4"), ("fixed:4", "fixed:04"),
                 ("budget:0.25", "budget:.25"))

    def test_configurations_given_twice(self):
        """Two spellings of one configuration are refused by every command
        and bench that takes a list of them, compared after parsing."""
        for one, again in self.SPELLINGS:
            self.refused(quality.main, self.quality(f"{one},{again}"), 2, "--ranks",
                         f"'{again}' is given twice", f"(as '{one}')")
            self.refused(frontier.main, self.frontier("--proj", f"{self.proj}={one},{again}"), 2,
                         f"--proj {self.proj}", again, "twice")
            self.refused(self.passkey_main,
                         self.passkey_args("--proj", f"{self.proj}={one}",
                                           "--proj", f"{self.proj}={again}"),
                         2, f"--proj {self.proj}={again}", "same file and policy")

    def test_decode_speed_keys_one_configuration_alike(self):
        from kqsvd import models
        from kqsvd.formats.quant import QuantScheme
        bench = decode_speed()
        info = models.describe(self.model)[0]

        def key(pol):
            return bench.check(f"kqsvd:{self.proj}={pol}", info, [64], QuantScheme())[0]
        for one, again in self.SPELLINGS:
            self.assertEqual(key(one), key(again), (one, again))
        # ranks that differ are configurations that differ, whatever their labels
        self.assertNotEqual(key("budget:0.25"), key("budget:0.5"))
        self.assertNotEqual(key("fixed:4@4"), key("fixed:4@4/8"))

    # -- item 15: a budget no tiered layout meets ------------------------------
    def test_quality_tiers_that_no_layout_fits(self):
        """At 32 tokens (the file's windows) the sinks and the smallest
        window hold 20 of the 28 prefilled: a quarter of the bytes (or
        1e-6) fits no layout."""
        for frac in ("0.25", "1e-6"):
            argv = self.quality(f"quality-tiers:{frac}")
            argv[argv.index("--seq-len") + 1] = "32"
            self.refused(quality.main, argv, 2, f"quality-tiers:{float(frac):g}",
                         "no layout fits", "--seq-len 32", loads=True)
    # -- item 16: save_ranks writes what its readers read ----------------------
    def test_save_ranks_writes_tiered_files_its_readers_read(self):
        from kqsvd.formats.policy import parse
        from kqsvd.formats.quant import QuantScheme
        ranks = {"kqsvd": ([8, 8], [8, 8])}
        out = os.path.join(self.out, "t.h5")
        # thirds: 6 digits would write 0.333333 three times, which sum to 0.999999
        third = "tiers:w8+0.3333333333333333x8@4+0.3333333333333333x4@2+0.3333333333333334xdrop"
        kqsvd.save_ranks(self.proj, out, ranks, "test", scheme=QuantScheme(), tiers={"kqsvd": third})
        self.assertEqual(kqsvd.load_projections(out, "kqsvd").tiers[0], parse(third).tiers)
        os.remove(out)
        for bad, says in (("tiers:w8+0.5xstored+0.5xdrop", "not 'stored'"),
                          ("tiers:w8+1x99@4", "outside 1..16")):
            with self.assertRaisesRegex(UsageError, f"tiers for {out}: method 'kqsvd': .*{says}"):
                kqsvd.save_ranks(self.proj, out, ranks, "test", scheme=QuantScheme(),
                                 tiers={"kqsvd": bad})
            self.assertEqual(listing(self.out), [])

    # -- item 17: budgets below one token ---------------------------------------
    def test_presses_keeping_less_than_one_token(self):
        """kvpress keeps one token whatever the fraction, so a press (or a
        press over a quantized cache) keeping less than one of the
        context's is refused, not labelled with bytes it does not hold."""
        self.refused(frontier.main, self.frontier("--presses", "knorm", "--press-kept", "none",
                                                  "--press-quantized", "quanto:4",
                                                  "--press-bytes", "1e-9"),
                     2, "--context 16", "knorm", "over quanto-int4", "1e-09",
                     "less than one of its tokens")
        self.refused(frontier.main, self.frontier("--presses", "knorm", "--press-kept", "0.01"),
                     2, "--context 16", "knorm:0.01", "less than one of its tokens")
        self.refused(self.passkey_main,
                     self.passkey_args("--composites", "knorm:quanto:4:1e-9"), 2,
                     "--composites knorm:quanto:4:1e-09", "--lengths 120",
                     "less than one of its tokens")
        fake = types.SimpleNamespace(KnormPress=lambda: types.SimpleNamespace())
        with mock.patch("kqsvd.quality.peers.need", return_value=fake):
            self.refused(self.passkey_main,
                         self.passkey_args("--presses", "knorm:0.005", "--lengths", "120,400"),
                         2, "--lengths 120", "--presses knorm:0.005", "less than one")

    # -- item 18: what a tiered cache does not do ------------------------------
    def test_score_errors_and_fold_with_a_tiered_cache(self):
        """A tiered cache has no probe mode and folds nothing (docs/formats.md
        5.4.1): refused before the load for a layout or quality-tiers:F,
        before any fit for a file whose stored policy is a layout (its
        rows were skipped, or refused after the fits)."""
        for flag in ("--score-errors", "--fold"):
            for pol in ("fixed:4,tiers:w8+1xdrop", "quality-tiers:0.5"):
                self.refused(quality.main, self.quality(pol, flag), 2, flag,
                             f"--ranks {pol.split(',')[-1]}", "tiered cache")
            stored = self.with_tiers_attribute("tiers:w8+1x8@4")
            argv = self.quality("fixed:4,stored", flag)
            argv[argv.index("--proj") + 1] = stored
            self.refused(quality.main, argv, 2, flag, "--ranks stored", "tiered cache",
                         loads=True)

    # -- item 20: QuantizedCache's group against the model, before the load ----
    def test_quantized_cache_group_checked_before_the_load(self):
        """quanto raised 'Group size must be a divisor' after the full
        model's pass; the group must divide a token's values (here 2 KV
        heads x 16)."""
        fake = types.SimpleNamespace(KnormPress=lambda: types.SimpleNamespace())
        with mock.patch("kqsvd.quality.peers.need", return_value=fake):
            for extra in (["--quantized-cache", "quanto:4"],
                          ["--presses", "knorm", "--press-kept", "none", "--press-quantized",
                           "quanto:4", "--press-bytes", "0.125"]):
                self.refused(frontier.main, self.frontier("--group", "4096", *extra), 2,
                             "--group 4096", "quanto-int4", "must divide", "2 KV heads x 16 = 32")
            # passkey's composites quantize in groups of 32: one KV head of 16 is too narrow
            narrow = tiny_decoder("llama", os.path.join(workdir("hostile-policies-narrow"), "m"),
                                  kv_heads=1)
            argv = self.passkey_args("--composites", "knorm:quanto:4:0.1")
            argv[argv.index("--model") + 1] = narrow
            self.refused(self.passkey_main, argv, 2, "--composites knorm:quanto:4:0.1",
                         "groups of 32", "1 KV heads x 16 = 16")


if __name__ == "__main__":
    unittest.main()
