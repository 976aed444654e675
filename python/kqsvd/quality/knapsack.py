"""Choosing one option per unit under a budget of bits per token, for
quality-bits:F (quality.bits, per unit) and its bits per latent column
(quality.columns): the bits a unit or column can take, the lower convex
hull of each one's options, and the greedy over the hulls' segments by
decreasing gain per bit, which is the optimum of the convexified problem
at every breakpoint (quality.bits' docstring has the argument)."""
import numpy as np

from ..errors import UsageError
from ..formats.policy import QUALITY_BITS
from ..formats.quant import BITS, UNQUANTIZED, option_bits

# What a unit's (or column's) cached values can be held at: codes of BITS
# bits, or as computed (formats.quant's one encoding).
CHOICES = BITS + (UNQUANTIZED,)


def hull(sizes, costs):
    """The lower convex hull of one unit's options: indices into the
    options, by increasing size, each step buying a lower cost."""
    order = sorted(range(len(sizes)), key=lambda i: (sizes[i], costs[i]))
    pts = []
    for i in order:
        if pts and sizes[pts[-1]] == sizes[i]:
            continue  # the cheaper cost of one size is already in
        while len(pts) >= 2:
            a, b = pts[-2], pts[-1]
            if (costs[b] - costs[a]) * (sizes[i] - sizes[a]) >= \
                    (costs[i] - costs[a]) * (sizes[b] - sizes[a]):
                pts.pop()
            else:
                break
        pts.append(i)
    out = [pts[0]]
    for i in pts[1:]:
        if costs[i] < costs[out[-1]]:
            out.append(i)
    return out


def knapsack(sizes, costs, budget):
    """One option per unit: sizes, costs [U, n]; the sum of sizes at most
    budget, the sum of the convexified costs least (see the module's doc).
    Returns int [U] option indices.  UsageError when even the smallest
    options do not fit."""
    U = len(sizes)
    hulls = [hull(sizes[u], costs[u]) for u in range(U)]
    pick = [h[0] for h in hulls]
    used = sum(sizes[u][pick[u]] for u in range(U))
    if used > budget + 1e-9:
        raise UsageError(f"{QUALITY_BITS} the budget buys {budget:.0f} bits per token; the smallest "
                         f"option of every unit takes {used:.0f}")
    segs = []
    for u, h in enumerate(hulls):
        for k in range(1, len(h)):
            ds = sizes[u][h[k]] - sizes[u][h[k - 1]]
            segs.append(((costs[u][h[k - 1]] - costs[u][h[k]]) / ds, u, k))
    closed = set()
    for _, u, k in sorted(segs, key=lambda s: (-s[0], s[1], s[2])):
        if u in closed:
            continue
        ds = sizes[u][hulls[u][k]] - sizes[u][pick[u]]
        if used + ds > budget + 1e-9:
            closed.add(u)
            continue
        pick[u], used = hulls[u][k], used + ds
    return np.array(pick, dtype=np.int64)


def uniform_choices(L, H, d, scheme, budget):
    """{bits: the largest rank that fits the budget with every unit at that
    rank and those bits (CHOICES)}, without the bits at
    which even rank 1 does not fit."""
    out = {}
    for b in CHOICES:
        per = [L * H * (option_bits(r, b, scheme.key_axis, scheme.group) +
                        option_bits(r, b, scheme.value_axis, scheme.group))
               for r in range(1, d + 1)]
        r = max((r for r in range(1, d + 1) if per[r - 1] <= budget + 1e-9), default=0)
        if r:
            out[b] = r
    return out
