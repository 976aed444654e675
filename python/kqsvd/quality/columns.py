"""Bits per latent column (transform coding in the KQ-SVD basis): each
column of each unit's latent gets 0 bits (dropped: the rank), codes of 2,
3, 4 or 8 bits, or 16 (unquantized), under one budget of bits per token.

The columns are treated as independent sources, each with a cost per
choice: the error it adds to what the model computes, with the others
exact.  Two forms of that cost:

- spectrum: the attention's own.  For kqsvd, K A has orthonormal columns
  and (K A_j)(Q B_j)^T is the j-th term of K Q^T's SVD, so noise e_j on
  latent column j adds ||e_j||^2 sigma_j^2 to err_kq (sigma_j the file's
  spectra/KQt; values: spectra/VWo and err_out).  With D_j(b) =
  ||x A_j - Q_b(x A_j)||^2 / ||x A_j||^2 measured on the calibration
  windows, the cost is sigma_j^2 D_j(b) (sigma_j^2 when dropped), scaled
  per unit and side by the loss (bits.column_candidates): reverse
  water-filling on the spectrum, which spends bits where sigma_j^2 stands
  above the water level and drops the columns below it.
- fisher: the model's loss, allocate.py's Fisher form per column:
  sum over windows (sum over tokens of g_t . e_tj B_j)^2.

The choices are allocated by knapsack.knapsack over every column of every
unit (the greedy on each column's convex hull: the discrete water level),
then made a rank: a unit keeps its columns up to the last it gave bits,
an earlier column without bits gets the fewest (2).  That and the runs'
packing cost a little more than the greedy counted, so the greedy's
budget is lowered (bisection) until the exact bytes (formats.quant.
unit_bits) fit; a uniform choice (one rank, one width everywhere) that
fits and costs less is kept instead."""
import numpy as np

from ..formats import h5io
from ..formats.quant import DROPPED, UNQUANTIZED, unit_bits
from .knapsack import knapsack, uniform_choices


def column_sizes(choices, group):
    """Bits per token of one column at each choice, then 0 for dropped:
    its codes and its share of the float16 scale and zero (one pair per
    `group` tokens of a column, or per `group` columns of a token's row,
    both 32 / group bits a value), 16 unquantized.  The runs' packing
    padding is left to unit_bits."""
    return np.array([16.0 if b == UNQUANTIZED else b + 32.0 / group for b in choices] + [0.0])


def spectrum_costs(sigma, dist, energy):
    """sigma [L, H, d] the units' singular values, dist [L, H, nb, d] each
    choice's squared quantization error of each latent column, energy [L,
    H, d] each column's squared norm -> costs [L, H, nb + 1, d] (last:
    dropped)."""
    s2 = (sigma.astype(np.float64) ** 2)[:, :, None, :]
    rel = dist / np.maximum(energy, np.finfo(np.float64).tiny)[:, :, None, :]
    return np.concatenate([s2 * rel, s2], 2)


def read_spectra(path, method):
    """(sigma of K Q^T, sigma of V W^O) [L, H, d] for kqsvd's own basis, or
    None: the spectra describe kqsvd's columns only."""
    if method != "kqsvd":
        return None
    with h5io.open_file(path, "projections") as f:
        if "spectra/KQt" not in f or "spectra/VWo" not in f:
            return None
        return f["spectra/KQt"][...], f["spectra/VWo"][...]


def allocate_columns(costs, choices, scheme, budget):
    """costs [2, L, H, nb + 1, d] (keys, values; each choice of `choices`
    then dropped) -> bits [2, L, H, d] in the file's per-column form
    (COL_BITS) whose exact bytes (unit_bits over both sides) are at most
    `budget` bits per token.  Raises UsageError (from knapsack) when even
    rank 1 at the fewest bits does not fit."""
    _, L, H, nc, d = costs.shape
    axes = (scheme.key_axis, scheme.value_axis)
    sizes = column_sizes(choices, scheme.group)
    flat_c = np.concatenate([np.moveaxis(costs[s], 2, 3).reshape(L * H * d, nc) for s in (0, 1)])
    flat_s = np.repeat(sizes[None], 2 * L * H * d, 0)
    col = np.array(list(choices) + [DROPPED])
    fewest = min(b for b in col if b != DROPPED)

    def made(b):
        bits = col[knapsack(flat_s, flat_c, b)].reshape(2, L, H, d)
        exact = 0.0
        for s in (0, 1):
            for l in range(L):
                for h in range(H):
                    row = bits[s, l, h]
                    kept = np.flatnonzero(row)
                    r = kept[-1] + 1 if len(kept) else 1
                    row[:r][row[:r] == DROPPED] = fewest
                    exact += unit_bits(row, r, axes[s], scheme.group)
        return bits, exact

    bits, exact = made(budget)
    if exact > budget + 1e-9:
        lo, hi, bits = 0.0, budget, None
        while hi - lo > 0.25:  # the greedy's budget, lowered until the exact bytes fit
            mid = (lo + hi) / 2
            got, e = made(mid)
            if e <= budget + 1e-9:
                lo, bits = mid, got
            else:
                hi = mid
        # At 0 every unit keeps one column at the fewest bits, which
        # bits.check_fraction has found to fit.
        bits = bits if bits is not None else made(0.0)[0]
    # Runs cost scales and padding the greedy priced per column (a token's
    # row holds one scale per run even of 3 columns): a uniform choice
    # that fits may then cost less, and is kept if it does.
    index = {c: i for i, c in enumerate(col)}

    def cost(b):
        pick = np.vectorize(index.get)(b)
        return np.take_along_axis(costs, pick[:, :, :, None, :], 3).sum()
    best, best_cost = bits, cost(bits)
    for b, r in uniform_choices(L, H, d, scheme, budget).items():
        uni = np.where(np.arange(d) < r, b, DROPPED) * np.ones((2, L, H, 1), np.int64)
        c = cost(uni)
        if c < best_cost:
            best, best_cost = uni, c
    return best
