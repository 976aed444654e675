"""Intervals on a perplexity ratio: a paired bootstrap over the scored
tokens cut into units (each window's continuation in blocks of BLOCK
tokens), two configurations' negative log-likelihoods summed over the
same units at every draw, so that what the windows share (a hard passage
is hard for both) cancels, as the ratio's own spread does not.  The
frontier reports, for each configuration, its ratio's interval against
the full model and against the best peer at the same bytes."""
import numpy as np

BLOCK = 32       # scored tokens per unit
REPEATS = 2000   # bootstrap draws
LEVEL = 0.95
SAME_BYTES = 0.1  # a peer holds the same bytes within this share of them


def units(nll, block=BLOCK):
    """(sums, counts): a window's per-token negative log-likelihoods (a
    sequence of floats) cut into blocks of `block`, the last one shorter
    where the window's length is not a multiple."""
    nll = np.asarray(nll, dtype=np.float64)
    edges = range(0, len(nll), block)
    return [float(nll[i:i + block].sum()) for i in edges], \
        [len(nll[i:i + block]) for i in edges]


def paired_ratio(a, b, counts, repeats=REPEATS, level=LEVEL, seed=0):
    """(ratio, low, high): the perplexity ratio exp((sum a - sum b) / sum
    counts) of two configurations' NLL sums a and b over the same units,
    with its percentile interval over `repeats` draws of the units with
    replacement (one draw for both: paired).  The generator is seeded, so
    a report is reproducible."""
    a, b, n = (np.asarray(x, dtype=np.float64) for x in (a, b, counts))
    if not (a.shape == b.shape == n.shape) or a.size == 0:
        raise ValueError("paired_ratio: a, b and counts need one value per unit each")
    ratio = float(np.exp((a.sum() - b.sum()) / n.sum()))
    pick = np.random.default_rng(seed).integers(0, a.size, (repeats, a.size))
    draws = np.exp(((a - b)[pick]).sum(1) / n[pick].sum(1))
    low, high = np.quantile(draws, [(1 - level) / 2, (1 + level) / 2])
    return ratio, float(low), float(high)


def best_peer(result, peers, share=SAME_BYTES):
    """The peer (a result dict with kept and perplexity) of the lowest
    perplexity among those holding the same bytes as `result` (kept within
    `share` of its kept, either way), or None."""
    near = [p for p in peers if abs(p["kept"] - result["kept"]) <= share * result["kept"]]
    return min(near, key=lambda p: p["perplexity"], default=None)
