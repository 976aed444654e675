"""quality-bits:F: the rank and the bits of every (layer, KV head) unit,
keys and values each, chosen together so that the quantized latent cache
holds a fraction F of the bf16 cache's bytes where the model's loss needs
them most.

Each option (r, b) of a unit (ranks 1..d; codes of 2, 3, 4 or 8 bits, or
unquantized) gets a predicted cost, allocate.py's Fisher form with the
latent quantized as the cache would hold it:

    s_u(r, b) = sum over windows (sum over tokens t of g_t . (x_t - Q_b(x_t A)_r B_r^T))^2

(Q_b quantizes the unit's d latent columns at b bits under the scheme,
docs/quantized-cache.md; the first r are kept), and a cost in bits per
token (codes and scales, 16 per value unquantized).  The options of every
unit are reduced to the lower convex hull of (bits, cost), and the hull
segments taken by decreasing gain per bit while the budget lasts, a
segment that does not fit closing its unit (so every unit stands on a hull
vertex).  Where the budget ends at a breakpoint of the steepest-first
path (no unit closed), no choice of options within the budget costs less:
every option lies on or above its unit's hull, and each segment taken buys
more per bit than any left (the Lagrangian argument).  The model then decides: the
allocation and each uniform choice that fits the budget (one rank, one
number of bits everywhere) are measured by their KL to the full model on
the calibration windows, through the quantized cache, and the best is
kept, with two allocations of bits per latent column (quality.columns:
reverse water-filling on the attention's spectrum, and on each column's
Fisher cost) among the candidates."""
import math

import numpy as np

from ..errors import UsageError
from ..formats.policy import QUALITY_BITS
from ..formats.projections import file_sizes, load_projections
from ..formats.quant import DROPPED, UNQUANTIZED, option_bits, with_bits
from .allocate import Sensitivity, group_view, measure_costs
from .columns import allocate_columns, read_spectra, spectrum_costs
from .kl import full_logprobs, kl_to_full
from .knapsack import CHOICES, knapsack, uniform_choices

class QuantSensitivity(Sensitivity):
    """Sensitivity with a cost per bits choice: cost[m] [2, L, H, nb, d]
    (unit options: rank r at bits b).  Per latent column (quality.columns):
    col[m] [2, L, H, nb + 1, d], each column's own Fisher cost at each
    choice then dropped; dist[m] [2, L, H, nb, d] its squared quantization
    error and energy[m] [2, L, H, d] its squared norm."""

    def __init__(self, projs, info, scheme):
        super().__init__(projs, info)
        self.scheme = scheme
        L, H, d = info.num_layers, info.num_kv_heads, info.head_dim
        nb = len(CHOICES)
        self.cost = {m: np.zeros((2, L, H, nb, d)) for m in projs}
        self.col = {m: np.zeros((2, L, H, nb + 1, d)) for m in projs}
        self.dist = {m: np.zeros((2, L, H, nb, d)) for m in projs}
        self.energy = {m: np.zeros((2, L, H, d)) for m in projs}

    def _col(self, m, side, layer, i, e, joint):
        """Adds one choice's per-column terms e [b, H, T, d] (g . e_tj B_j)."""
        self.col[m][side, layer, :, i] += (e.sum(2) ** 2).sum(0) if joint else \
            (e ** 2).sum((0, 2))

    def add(self, layer, kind, x, g, joint):
        import torch
        from ..attention.quant import Store  # torch at its top
        x, g = self.view(x), self.view(g)
        side = 0 if kind == "k" else 1
        axis = self.scheme.key_axis if kind == "k" else self.scheme.value_axis
        gx = (x * g).sum(-1)
        for m, mats in self.mats.items():
            A, B = mats[kind][0][layer], mats[kind][1][layer]
            xa = np.einsum("bhtd,hde->bhte", x, A)
            gb = np.einsum("bhtd,hde->bhte", g, B)
            for i, bits in enumerate(CHOICES):
                q = xa if bits == UNQUANTIZED else Store(bits, self.scheme.group, axis).append(
                    torch.from_numpy(xa)).numpy()
                c = gx[..., None] - np.cumsum(q * gb, -1)
                if joint:
                    self.cost[m][side, layer, :, i] += (c.sum(2) ** 2).sum(0)
                else:
                    self.cost[m][side, layer, :, i] += (c ** 2).sum((0, 2))
                self._col(m, side, layer, i, (xa - q) * gb, joint)
                self.dist[m][side, layer, :, i] += ((xa - q) ** 2).sum((0, 2))
            self._col(m, side, layer, len(CHOICES), xa * gb, joint)
            self.energy[m][side, layer] += (xa ** 2).sum((0, 2))


def least_fraction(head_dim, scheme):
    """The smallest fraction of a bf16 cache any choice can take: every
    unit (of head_dim columns, a head-groups file's group view) at its
    smallest option, rank 1 at the bits the scheme holds in the fewest
    bits per token.  A property of the file and the scheme alone."""
    least = sum(min(option_bits(1, b, axis, scheme.group) for b in CHOICES)
                for axis in (scheme.key_axis, scheme.value_axis))
    return least / (2 * head_dim * 16)


def check_fraction(fraction, head_dim, scheme):
    """UsageError naming quality-bits:F, before any fitting, when F is not
    in (0, 1] or buys less than least_fraction."""
    if not 0 < fraction <= 1:
        raise UsageError(f"{QUALITY_BITS}{fraction:g}: the fraction must be in (0, 1]")
    least = least_fraction(head_dim, scheme)
    if fraction < least * (1 - 1e-12):
        # rounded up, so that the fraction suggested fits
        e = math.floor(math.log10(least)) - 3
        up = f"{math.ceil(round(least / 10 ** e, 6)) * 10 ** e:.4g}"
        raise UsageError(f"{QUALITY_BITS}{fraction:g} is below the smallest quantized cache, every "
                         f"unit at rank 1 and its fewest bits per token: {up} of the bf16 "
                         f"cache's bytes; give {QUALITY_BITS}{up} or more")


def column_candidates(qs, method, proj_path, scheme, budget):
    """{name: (ranks [2, L, H], bits [2, L, H, d])}: bits per latent column
    (quality.columns) from the columns' Fisher costs ("columns") and, for
    kqsvd, from the attention's spectrum ("spectrum")."""
    costs = {"columns": qs.col[method]}
    spectra = read_spectra(proj_path, method)
    if spectra is not None:
        spec = np.stack([spectrum_costs(spectra[s], qs.dist[method][s], qs.energy[method][s])
                         for s in (0, 1)])
        # err_kq and err_out are in units of their own, and each layer's
        # weigh differently in the loss: each unit's spectrum is scaled to
        # what the loss says dropping all of it costs (its columns' Fisher
        # costs dropped), the spectrum deciding among its columns.
        loss = qs.col[method][..., -1, :].sum(-1)
        spent = spec[..., -1, :].sum(-1)
        costs["spectrum"] = spec * (loss / np.maximum(spent, np.finfo(float).tiny))[..., None, None]
    out = {}
    for name, c in costs.items():
        bits = allocate_columns(c, CHOICES, scheme, budget)
        out[name] = ((bits != DROPPED).sum(-1), bits)
    return out


def allocate_bits(model, info, proj_path, fraction, seqs, methods, scheme, draws=2, log=None):
    """Ranks and bits for each method: {method: dict(rank_k, rank_v, bits_k,
    bits_v (each [L, H] per unit, or [L, H, d] per column), start, kl,
    kls)}.  Not collective.  Raises UsageError for an impossible
    fraction."""
    from ..attention import compress  # torch at its top
    info = group_view(info, file_sizes(proj_path, methods)["head_groups"])
    L, H, d = info.num_layers, info.num_kv_heads, info.head_dim
    check_fraction(fraction, d, scheme)
    budget = fraction * 2 * L * H * d * 16
    full = {m: load_projections(proj_path, m, d) for m in methods}
    compress(model, None)
    qs = QuantSensitivity(full, info, scheme)
    sens = measure_costs(model, info, seqs, full, draws=draws, sensitivity=qs)
    full_logp = full_logprobs(model, seqs)
    opts = [(r, b) for b in CHOICES for r in range(1, d + 1)]
    sizes = np.array([[option_bits(r, b, ax, scheme.group) for r, b in opts]
                      for ax in (scheme.key_axis, scheme.value_axis)])
    out = {}
    for m in methods:
        c = sens[m]                                              # [2, L, H, nb, d]
        flat = c.reshape(2, L * H, len(CHOICES) * d)
        size_u = np.concatenate([np.repeat(sizes[s][None], L * H, 0) for s in (0, 1)])
        pick = knapsack(size_u, np.concatenate([flat[0], flat[1]]), budget)
        ranks = np.array([opts[i][0] for i in pick]).reshape(2, L, H)
        bits = np.array([opts[i][1] for i in pick]).reshape(2, L, H)
        cands = {"fisher": (ranks, bits)}
        for b, r in uniform_choices(L, H, d, scheme, budget).items():
            cands[f"fixed:{r}" + (f"@{b}" if b != UNQUANTIZED else "")] = (np.full((2, L, H), r),
                                                            np.full((2, L, H), b))
        cands.update(column_candidates(qs, m, proj_path, scheme, budget))
        kls = {}
        for name, (rk, bk) in cands.items():
            p = load_projections(proj_path, m, (rk[0], rk[1]))
            p = with_bits(p, (4, 4), scheme)
            p.bits_k, p.bits_v = np.array(bk[0]), np.array(bk[1])
            compress(model, p)
            kls[name] = kl_to_full(model, seqs, full_logp, cache=True)
        compress(model, None)
        start = min(kls, key=lambda k: (kls[k], k != "fisher"))
        rk, bk = cands[start]
        out[m] = dict(rank_k=rk[0], rank_v=rk[1], bits_k=bk[0], bits_v=bk[1], start=start,
                      kl=kls[start], kls=kls)
        if log:
            log(f"{QUALITY_BITS}{fraction:g} {m}: kept {start} (calibration KL {kls[start]:.4f}); "
                + ", ".join(f"{k} {v:.4f}" for k, v in kls.items()))
    return out
