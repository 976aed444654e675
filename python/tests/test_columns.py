"""Bits per latent column (kqsvd.quality.columns): the allocation on costs
made here, checked by properties an independent count can confirm: the
exact bytes within the budget, the rank as a prefix, reverse
water-filling's order on a spectrum, and no uniform choice that fits
costing less."""
import unittest

import numpy as np

from kqsvd.formats.quant import QuantScheme, option_bits
from kqsvd.quality.knapsack import CHOICES
from kqsvd.quality.columns import allocate_columns, spectrum_costs


def bytes_of(bits, scheme):
    """Bits per token of per-column bits [2, L, H, d], counted here: each
    unit's columns of one width held as their own latent."""
    total = 0.0
    for s, axis in enumerate((scheme.key_axis, scheme.value_axis)):
        for row in bits[s].reshape(-1, bits.shape[-1]):
            for b in set(row.tolist()) - {0}:
                total += option_bits(int((row == b).sum()), b, axis, scheme.group)
    return total


def spectrum(L, H, d, seed):
    """Singular values falling over three decades, and the distortion of a
    b-bit min-max code of a column (about 2^-2b of its energy)."""
    rng = np.random.default_rng(seed)
    sigma = np.sort(np.exp(rng.uniform(-4, 3, (L, H, d))), -1)[..., ::-1].copy()
    energy = np.ones((L, H, d))
    dist = np.stack([np.full((L, H, d), 0.0 if b == 16 else 4.0 ** -b) for b in CHOICES], 2)
    return np.stack([spectrum_costs(sigma, dist, energy)] * 2), sigma


class Columns(unittest.TestCase):
    def test_budget_rank_and_water_filling(self):
        L, H, d = 3, 2, 24
        for seed, group, frac in ((1, 32, 0.25), (2, 8, 0.125), (3, 16, 0.0625)):
            scheme = QuantScheme(group=group)
            costs, sigma = spectrum(L, H, d, seed)
            budget = frac * 2 * L * H * d * 16
            bits = allocate_columns(costs, CHOICES, scheme, budget)
            self.assertLessEqual(bytes_of(bits, scheme), budget + 1e-9)
            ranks = (bits != 0).sum(-1)
            self.assertTrue((ranks >= 1).all())
            self.assertTrue(np.array_equal(bits != 0, np.arange(d) < ranks[..., None]))
            # A larger singular value never gets fewer bits (16 = unquantized).
            self.assertTrue((np.diff(bits, axis=-1) <= 0).all(), (seed, bits[0, 0]))
            # Every uniform choice that fits costs at least as much.
            picked = np.take_along_axis(
                costs, np.array([list(CHOICES).index(b) if b else len(CHOICES)
                                 for b in bits.ravel()]).reshape(2, L, H, 1, d), 3).sum()
            for i, b in enumerate(CHOICES):
                for r in range(1, d + 1):
                    uni = np.zeros((2, L, H, d), int)
                    uni[..., :r] = b
                    if bytes_of(uni, scheme) > budget + 1e-9:
                        break
                    cost = costs[..., i, :r].sum() + costs[..., -1, r:].sum()
                    self.assertLessEqual(picked, cost * (1 + 1e-12), (seed, b, r))


if __name__ == "__main__":
    unittest.main()
