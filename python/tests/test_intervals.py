"""The frontier's intervals (kqsvd.quality.intervals, issue 58 item 3),
checked by their properties: a ratio of a configuration to itself is 1
with no spread; a constant shift per token is its exponential exactly;
the interval's width is the normal approximation's on many units; the
units cover every token; the best peer is the lowest perplexity within
the share of the bytes."""
import math
import unittest

import numpy as np

from kqsvd.quality import intervals


class Intervals(unittest.TestCase):
    def test_units_cover_every_token(self):
        nll = np.arange(70, dtype=np.float64)
        sums, counts = intervals.units(nll, 32)
        self.assertEqual(counts, [32, 32, 6])
        self.assertEqual(sums, [nll[:32].sum(), nll[32:64].sum(), nll[64:].sum()])

    def test_a_ratio_to_itself_and_a_constant_shift(self):
        g = np.random.default_rng(1)
        a, n = g.gamma(2.0, 20.0, 40), np.full(40, 32)
        self.assertEqual(intervals.paired_ratio(a, a, n), (1.0, 1.0, 1.0))
        r, lo, hi = intervals.paired_ratio(a + 0.05 * n, a, n)
        for v in (r, lo, hi):  # every draw shifts by 0.05 a token: the pairing cancels a
            self.assertAlmostEqual(v, math.exp(0.05), 12)

    def test_width_is_the_normal_approximations(self):
        g = np.random.default_rng(2)
        m, u, sd = 32, 400, 3.0
        b = g.normal(80.0, 10.0, u)
        a = b + g.normal(0.02 * m, sd, u)  # the shared part cancels, the rest is sd per unit
        r, lo, hi = intervals.paired_ratio(a, b, np.full(u, m), repeats=4000)
        se = np.std(a - b, ddof=1) / math.sqrt(u) / m
        self.assertAlmostEqual(math.log(r), np.mean(a - b) / m, 12)
        self.assertLess(lo, r)
        self.assertGreater(hi, r)
        half = (math.log(hi) - math.log(lo)) / 2
        self.assertAlmostEqual(half / (1.959964 * se), 1.0, delta=0.1)
        # seeded: the same report twice
        self.assertEqual(intervals.paired_ratio(a, b, np.full(u, m)),
                         intervals.paired_ratio(a, b, np.full(u, m)))

    def test_mismatched_units_are_refused(self):
        with self.assertRaises(ValueError):
            intervals.paired_ratio([1.0, 2.0], [1.0], [32, 32])
        with self.assertRaises(ValueError):
            intervals.paired_ratio([], [], [])

    def test_best_peer_at_the_same_bytes(self):
        peers = [dict(label="a", kept=0.125, perplexity=9.0),
                 dict(label="b", kept=0.13, perplexity=8.0),
                 dict(label="c", kept=0.25, perplexity=7.0),
                 dict(label="d", kept=0.112, perplexity=8.5)]
        self.assertEqual(intervals.best_peer(dict(kept=0.125), peers)["label"], "b")
        self.assertEqual(intervals.best_peer(dict(kept=0.115), peers, 0.05)["label"], "d")
        self.assertIsNone(intervals.best_peer(dict(kept=0.5), peers))


if __name__ == "__main__":
    unittest.main()
