"""The largest batch whose cache fits a budget (bench/cache_budget.py,
decode_speed.py --cache-budget, gpu_decode.py --cache-budget).

The search is checked against a brute force over made-up caches (a fixed
part, a part per row, buffers that round up), where the largest batch is
known; the sizes parser by its cases; and one real run of decode_speed.py
on SmolLM2 at a short context, its answer checked by running the batch
above it, which the search itself never runs."""
import argparse
import json
import os
import subprocess
import sys
import unittest

import numpy as np

from common import ROOT, workdir

sys.path.insert(0, os.path.join(ROOT, "bench"))
from cache_budget import Search, largest_batch  # noqa: E402
from kqsvd.commands.cli import size  # noqa: E402


def linear(base, per, round_to=1):
    """A made-up cache: base bytes and per bytes a row, each row's rounded
    up to round_to as buffers round their room (a cache's bytes are
    affine in the batch); run(b, probe) also records the calls."""
    calls = []

    def run(b, probe):
        calls.append((b, probe))
        return dict(cache_bytes=base + -(-per // round_to) * round_to * b, decode_tok_s=float(b))
    return run, calls


def brute(run, budget, most=4096):
    best = 0
    for b in range(1, most + 1):
        if run(b, False)["cache_bytes"] <= budget:
            best = b
    return best


class SearchFindsTheLargestBatch(unittest.TestCase):
    def test_against_brute_force(self):
        rng = np.random.default_rng(0)
        for _ in range(200):
            base, per = int(rng.integers(0, 5000)), int(rng.integers(1, 4000))
            round_to = int(rng.choice([1, 64, 4096]))
            budget = int(rng.integers(1, 400_000))
            run, calls = linear(base, per, round_to)
            want = brute(run, budget, most=400)
            calls.clear()
            row = largest_batch(run, budget, most=400)
            with self.subTest(base=base, per=per, round_to=round_to, budget=budget):
                self.assertEqual(row["batch"], want)
                if want:
                    self.assertLessEqual(row["cache_bytes"], budget)
                    self.assertTrue(row["largest_confirmed"] or row["batch"] == 400)
                    # the answer is a batch that ran in full, not a probe
                    self.assertIn((want, False), calls)
                    self.assertEqual(row["decode_tok_s"], float(want))
                else:
                    self.assertIn("over the budget", row["error"])
                self.assertLessEqual(len(calls), 9)  # one probe and at most 8 tries
                self.assertEqual(calls[0], (1, True))

    def test_a_batch_that_fits_exactly(self):
        run, _ = linear(0, 100)
        self.assertEqual(largest_batch(run, 1000)["batch"], 10)
        self.assertEqual(largest_batch(run, 999)["batch"], 9)

    def test_a_run_that_fails_above(self):
        """Memory runs out at 6 rows: the search keeps the largest batch
        that ran, and says what failed above it."""
        def run(b, probe):
            if b >= 6:
                return dict(error="killed by signal 9")
            return dict(cache_bytes=100 * b, decode_tok_s=1.0)
        s = Search(run, 10_000)()
        row = s.row()
        self.assertIn("killed", row["error_above"])
        self.assertLess(row["batch"], 6)
        self.assertGreaterEqual(row["batch"], 1)

    def test_batch_one_over_the_budget_or_failing(self):
        run, _ = linear(0, 5000)
        row = largest_batch(run, 1000)
        self.assertEqual(row["batch"], 0)
        self.assertNotIn("decode_tok_s", row)
        row = largest_batch(lambda b, p: dict(error="no such backend"), 10)
        self.assertEqual((row["batch"], row["error"]), (0, "no such backend"))

    def test_a_size_that_does_not_grow(self):
        run, calls = linear(500, 0)
        row = largest_batch(run, 1000, most=50)
        self.assertEqual(row["batch"], 50)
        self.assertFalse(row["largest_confirmed"])  # stopped at `most`, not by the budget


class Sizes(unittest.TestCase):
    def test_units(self):
        self.assertEqual(size("1GiB"), 2**30)
        self.assertEqual(size("512MiB"), 512 * 2**20)
        self.assertEqual(size("1.5GB"), 1_500_000_000)
        self.assertEqual(size("4096"), 4096)
        self.assertEqual(size("2 KiB"), 2048)
        self.assertEqual(size("1e6"), 10**6)

    def test_refused(self):
        for bad in ("", "0", "-1GiB", "0.5", "1XB", "GiB", "nan", "inf", "1_000", "١GiB"):
            with self.subTest(bad=bad), self.assertRaises(argparse.ArgumentTypeError):
                size(bad)


class RealRun(unittest.TestCase):
    """decode_speed.py --cache-budget on SmolLM2 at 48 tokens: the batch
    it reports fits, and one row more, run here by --one, does not."""

    def test_the_batch_above_does_not_fit(self):
        script = os.path.join(ROOT, "bench", "decode_speed.py")
        wd = workdir("cache-budget")
        out = os.path.join(wd, "rows.json")
        env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
        budget = 3 * 2**20
        common = ["--steps", "3", "--repeats", "1", "--threads", "1"]
        p = subprocess.run([sys.executable, script, "--contexts", "48", "--cache-budget",
                            str(budget), "--config", "full", "--config", "int4", *common,
                            "--json", out, "--force"], capture_output=True, text=True, env=env,
                           timeout=900)
        self.assertEqual(p.returncode, 0, p.stderr[-2000:])
        with open(out) as f:
            rows = json.load(f)
        self.assertEqual([r["config"] for r in rows], ["full", "int4"])
        for r in rows:
            with self.subTest(config=r["config"]):
                self.assertGreaterEqual(r["batch"], 1)
                self.assertLessEqual(r["cache_bytes"], budget)
                self.assertEqual(len(r["new_tokens"]), r["batch"])
                above = subprocess.run(
                    [sys.executable, script, "--one", r["config"], "48", str(r["batch"] + 1),
                     *common], capture_output=True, text=True, env=env, timeout=600)
                self.assertEqual(above.returncode, 0, above.stderr[-2000:])
                self.assertGreater(json.loads(above.stdout.splitlines()[-1])["cache_bytes"],
                                   budget)
        full, int4 = rows
        self.assertGreater(int4["batch"], full["batch"])  # int4 holds about a third
        self.assertAlmostEqual(int4["against_full"],
                               int4["decode_tok_s"] / full["decode_tok_s"])


if __name__ == "__main__":
    unittest.main()
