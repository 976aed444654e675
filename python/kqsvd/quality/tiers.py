"""Tiered caches measured and fitted (formats/tiers.py writes the layouts,
attention/tiers.py holds the cache).

A tiered cache attends exactly at the prefill, so a whole-window pass
says nothing about it: it is scored as the frontier scores every cache
(quality.frontier.continue_window), each window's last tail(T) tokens fed
in chunks of 8 after a prefill of the rest.

quality-tiers:F chooses a layout whose cache holds F of the bf16 cache's
bytes after the prefill of a served window: the window's length, the
tiers' fractions and each tier's columns and bits.  The bytes are counted
here as the cache holds them (layout_bytes), so each candidate meets the
budget before it is measured; the candidates are then measured by their
KL to the full model on the calibration windows, at the served length,
and the best is kept."""
from __future__ import annotations

from ..attention.quant import packed_width, room
from ..errors import UsageError
from ..formats.projections import load_projections
from ..formats.quant import UNQUANTIZED
from ..formats.tiers import DROP, PREFIX, SCORERS, Tier, TierLayout, attach, parse
from .configs import Config, Latent
from .frontier import continue_window

CHUNK = 8        # continuation tokens per step, as the frontier's benches run
SINKS = 4        # sink tokens of every fitted layout
WINDOWS = (16, 32, 64, 128)


def tail(T):
    """Tokens scored at the end of a window of T: 256, or T / 8 for a short one."""
    return max(1, min(256, T // 8))


def side_bytes(n, runs, group, axis):
    """Bytes of n tokens of one unit's side, taken at once, as the cache
    references them (docs/quantized-cache.md, residual 0): runs [(count,
    bits)] of columns, each store's buffers with the room they keep
    (attention.quant.room)."""
    total = 0
    for count, bits in runs:
        if bits == UNQUANTIZED:
            total += n * count * 2
        elif axis == "channel":  # blocks of `group` tokens, each column's a row
            nb = n // group
            total += (nb + room(0, nb, group)) * count * (packed_width(group, bits) + 4) + \
                (n - nb * group) * count * 2
        else:
            total += (n + room(0, n, 1)) * (packed_width(count, bits) + 4 * -(-count // group))
    return total


def layout_bytes(layout, N, units, kv_heads, head_dim, scheme, pre):
    """Bytes of one layer of a tiered cache right after a prefill of N
    tokens: units [(key runs, value runs) per unit] for each tier (None
    for a dropped one), sinks and window at 2 bytes a value, 4 bytes a
    position before RoPE (the sinks' and window's too), each store's room
    included (side_bytes): the bytes the cache references."""
    S = min(layout.sinks, N)
    W = min(layout.window, N - S)
    total = (S + W) * (kv_heads * head_dim * 2 * 2 + (4 if pre else 0))
    for n, per_unit in zip(layout.counts(N - S - W), units):
        if per_unit is None or not n:
            continue
        total += sum(side_bytes(n, rk, scheme.group, scheme.key_axis) +
                     side_bytes(n, rv, scheme.group, scheme.value_axis) for rk, rv in per_unit)
        total += 4 * n if pre else 0
    return total


def uniform(width, units, code_ranks, bits):
    """Every unit's runs for an R@B code: [([(R, bk)], [(R, bv)])] * units."""
    r = min(code_ranks, width)
    return [([(r, bits[0])], [(r, bits[1])])] * units


def solve_fraction(budget, N, window, costs, full_token):
    """The fraction f of the prefill's other tokens a coded tier holds so
    that the layer holds `budget` of its bf16 bytes: costs(n) the tier's
    bytes for n tokens (increasing), the sinks and window at full_token
    bytes each; 0 when even the window does not fit.  The largest f =
    k / M whose bytes fit (M the other tokens)."""
    S = min(SINKS, N)
    W = min(window, N - S)
    M = N - S - W
    room = budget * N * full_token - (S + W) * full_token
    if room <= 0 or not M:
        return 0.0
    lo, hi = 0, M
    while lo < hi:  # the most tokens whose bytes fit
        mid = (lo + hi + 1) // 2
        if costs(mid) <= room:
            lo = mid
        else:
            hi = mid - 1
    return lo / M


def single(window, code, f):
    """The layout of one coded tier holding f of the other tokens, the rest
    dropped."""
    if f >= 1:
        return TierLayout(window, SINKS, (Tier(1.0, code, *_code_fields(code)),))
    return TierLayout(window, SINKS, (Tier(f, code, *_code_fields(code)),
                                      Tier(1 - f, DROP)))


def _code_fields(code):
    r, _, b = code.partition("@")
    bk, _, bv = b.partition("/")
    return int(r), (int(bk), int(bv or bk))


def rounded(layout):
    """The layout with its fractions rounded to 6 digits, the last making
    the sum 1, as a file stores it."""
    fr = [round(t.fraction, 6) for t in layout.tiers]
    fr[-1] = round(1 - sum(fr[:-1]), 6)
    tiers = tuple(Tier(f, t.code, t.ranks, t.bits) for f, t in zip(fr, layout.tiers))
    return TierLayout(layout.window, layout.sinks, tiers, layout.scorer)


def tiered_logprobs(model, ids):
    """float64 log-probabilities [tail(T), V] of a window's last tail(T)
    tokens (int64 [1, T]) through the model as it is (its own cache, or
    the latent cache of what is installed), after a prefill of the rest,
    in chunks of CHUNK (quality.frontier's protocol), with the bytes after
    the prefill and at the end (continue_window)."""
    T = ids.shape[1]
    return continue_window(model, ids, T - tail(T), Config(), CHUNK)


def fit_tiers(model, info, path, method, frac, cal, scheme, log=print):
    """The layout of quality-tiers:frac for `method` of the projections file
    `path`: the window (WINDOWS) first, then the tier's bits and columns,
    then the scorer,
    each candidate's tier fraction the largest whose bytes fit, kept by
    its KL to the full model on the calibration windows cal (int64 [n,
    T]) at their length.  Returns (layout text, KL)."""
    import torch
    base = load_projections(path, method)
    dev = next(model.parameters()).device
    T = cal.shape[1]
    N = T - tail(T)                         # tokens prefilled
    width, units = base.head_dim, base.num_kv_heads
    kvh, d = info.num_kv_heads, info.head_dim
    full_token = kvh * d * 2 * 2
    pre = base.rope == "pre"

    def layout_for(window, code):
        r, bits = _code_fields(code)
        runs = uniform(width, units, r, bits)
        whole = TierLayout(window, SINKS, (Tier(1.0, code, r, bits),))  # n tokens in the tier
        f = solve_fraction(frac, N, window,
                           lambda n: layout_bytes(whole, n + SINKS + window, [runs], kvh, d,
                                                  scheme, pre) - (SINKS + window) * full_token,
                           full_token)
        return None if f <= 0 else rounded(single(window, code, f))

    def kl(lay):
        p = attach(base, lay, scheme, lambda r: load_projections(path, method, r))
        total = n = 0.0
        with torch.no_grad():
            for w, ref in zip(windows, refs):
                logp = continue_window(model, w, N, Latent(lay.text(), method, p), CHUNK)[0]
                total += float((ref.exp() * (ref - logp)).sum())
                n += ref.shape[0]
        return total / n

    tried = {}

    def best(cands):
        for lay in cands:
            if lay is not None and lay.text() not in tried:
                tried[lay.text()] = kl(lay)
                log(f"{PREFIX}{frac:g}: {lay.text()}  KL {tried[lay.text()]:.4f}")
        return min(tried.items(), key=lambda kv: kv[1])
    # The window comes first, and every later candidate keeps the one it
    # chose: with none, the search stops here, before the full model's pass.
    firsts = [layout_for(w, f"{width}@4") for w in WINDOWS]
    if all(lay is None for lay in firsts):
        raise UsageError(f"quality-{PREFIX}{frac:g}: no layout fits at --seq-len {T}: the "
                         f"{SINKS} sinks and the smallest window ({WINDOWS[0]} tokens) alone hold "
                         f"more than {frac:g} of the bytes after a prefill of {N} tokens, or "
                         "leave no token to code")
    with torch.no_grad():
        windows = [torch.from_numpy(r[None]).to(dev) for r in cal]
        refs = [continue_window(model, w, N, Config(), CHUNK)[0] for w in windows]
    got = best(firsts)
    W = parse(got[0]).window
    got = best(layout_for(W, c) for c in (f"{width}@4/3", f"{width}@3", f"{width * 3 // 4}@4",
                                          f"{width}@4/2"))
    lay = parse(got[0])
    return best(TierLayout(lay.window, lay.sinks, lay.tiers, s) for s in SCORERS[1:])
