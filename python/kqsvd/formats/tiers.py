"""Token tiers: how a tiered cache spends its bytes on tokens, columns and
bits (docs/formats.md, section 5.4.1).  One layout, as policies write it:

    tiers:w128+s4+0.4xstored+0.3x48@2+0.3xdrop

- `wN`: the newest N tokens held in full (the model's own keys and
  values; KIVI's window);
- `sN`: the first N tokens held in full too (attention sinks) [0];
- `FxCODE`: a tier holding the fraction F of the other tokens of the
  prefill, chosen by importance, the first tier the most important:
  CODE `stored` (the file's own ranks and bits), `R@B` or `R@BK/BV` (the
  first R latent columns of each unit, B bits, or BK for keys and BV for
  values), `R` (R columns unquantized), or `drop` (not held);
- `snap` (the default): importance is the attention that the prefill's
  last 64 queries pay each token (SnapKV's observation window); `snapv`
  weighs each head's attention by the norm of the token's value there
  (its weight in the head's output); `expected` takes the last 64
  queries, moved to the next 256 positions, as Gaussian and weighs each
  token by its expected attention times its value's norm.

The fractions sum to 1.  Tokens that leave the window after the prefill
enter the first tier.  This module knows only how a layout is written;
attention/tiers.py holds the cache."""
from __future__ import annotations

import dataclasses
import math

from ..errors import KqsvdError, UsageError
from .numbers import number, whole
from .quant import read_scheme, split_bits, with_bits

PREFIX = "tiers:"
DROP, STORED = "drop", "stored"
SCORERS = ("snap", "snapv", "expected")


@dataclasses.dataclass(frozen=True)
class Tier:
    """One tier: `fraction` of the prefill's tokens outside the window and
    the sinks; `code` as written; `ranks` (R) and `bits` (keys, values)
    for an R@B code, `ranks` alone for R unquantized, neither for stored
    and drop."""
    fraction: float
    code: str
    ranks: int | None = None
    bits: tuple | None = None

    @property
    def dropped(self) -> bool:
        return self.code == DROP


@dataclasses.dataclass(frozen=True)
class TierLayout:
    """A tiered cache's layout: the window, the sinks, the tiers (most
    important first) and the scorer."""
    window: int
    sinks: int
    tiers: tuple
    scorer: str = "snap"

    def text(self) -> str:
        """The layout as parse() reads it, in one canonical form."""
        parts = [f"w{self.window}"] + ([f"s{self.sinks}"] if self.sinks else [])
        parts += [f"{fraction_text(t.fraction)}x{t.code}" for t in self.tiers]
        return PREFIX + "+".join(parts + ([self.scorer] if self.scorer != "snap" else []))

    def counts(self, n: int) -> list[int]:
        """How many of n tokens (those outside the window and the sinks)
        each tier holds: the cumulative fractions rounded to the nearest
        token (half up), so that the counts sum to n."""
        cut, out, total = 0, [], 0.0
        for t in self.tiers:
            total += t.fraction
            nxt = min(n, math.floor(total * n + 0.5))
            out.append(nxt - cut)
            cut = nxt
        out[-1] += n - cut
        return out


def fraction_text(f):
    """A tier's fraction as text() writes it: the shortest decimal that
    reads back as the same float, so that a layout written and read again
    is the same layout, its fractions summing to 1 as they did (%g's six
    digits wrote 1/3 as 0.333333, three of which sum to 0.999999)."""
    text = repr(float(f))
    return text[:-2] if text.endswith(".0") else text


def _code(text, policy):
    """The Tier fields (code, ranks, bits) of one CODE, the code written
    in one form (32@4/4 is 32@4, 032 is 32), so that two spellings of a
    tier are one tier, its label and its key alike."""
    if text in (DROP, STORED):
        return text, None, None
    try:
        base, bits = split_bits(text)
    except UsageError:
        base, bits = "", None
    r = whole(base)
    if r is None or r < 1:
        raise UsageError(f"rank policy {policy}: a tier's code '{text}' is not stored, drop, R, "
                         "R@B or R@BK/BV (R columns, B bits)")
    at = "" if bits is None else f"@{bits[0]}" if bits[0] == bits[1] else f"@{bits[0]}/{bits[1]}"
    return f"{r}{at}", r, bits


def parse(text: str) -> TierLayout:
    """The TierLayout a `tiers:` policy writes.  Raises UsageError naming
    the policy and the part that is wrong."""
    if not text.startswith(PREFIX):
        raise UsageError(f"rank policy {text}: a tiered cache's layout starts with {PREFIX}")
    window = sinks = scorer = None
    tiers = []
    for part in text[len(PREFIX):].split("+"):
        head, x, code = part.partition("x")
        if part in SCORERS:
            if scorer is not None:
                raise UsageError(f"rank policy {text}: the scorer given twice ('{scorer}' and "
                                 f"'{part}')")
            scorer = part
        elif part[:1] in ("w", "s") and whole(part[1:]) is not None:
            if (window if part[0] == "w" else sinks) is not None:
                raise UsageError(f"rank policy {text}: '{part[0]}' given twice")
            if part[0] == "w":
                window = whole(part[1:])
            else:
                sinks = whole(part[1:])
        elif x:
            f = number(head)
            if f is None or not 0 < f <= 1:  # NaN fails too
                raise UsageError(f"rank policy {text}: '{part}': the fraction must be in (0, 1]")
            tiers.append(Tier(f, *_code(code, text)))
        else:
            raise UsageError(f"rank policy {text}: '{part}' is none of wN (window), sN (sinks), "
                             f"FxCODE (a tier) or {', '.join(SCORERS)} (the scorer)")
    if window is None or not tiers:
        raise UsageError(f"rank policy {text}: give the window (wN) and at least one tier "
                         "(FxCODE)")
    if abs(sum(t.fraction for t in tiers) - 1) > 1e-9:
        raise UsageError(f"rank policy {text}: the tiers' fractions sum to "
                         f"{sum(t.fraction for t in tiers):g}, not 1")
    return TierLayout(window, sinks or 0, tuple(tiers), scorer or "snap")


def check_width(layout, width):
    """Refuses (UsageError naming the policy) a tier taking more columns
    than the units hold (`width`: a file's head_dim, G d for head groups)."""
    for t in layout.tiers:
        if t.ranks is not None and not 1 <= t.ranks <= width:
            raise UsageError(f"rank policy {layout.text()}: the tier {t.code} takes {t.ranks} "
                             f"columns, outside 1..{width} (the width of the file's units)")


def check_storable(layout, width):
    """Refuses (UsageError naming the policy) a layout that a file cannot
    store as its `tiers` attribute: a `stored` tier (the stored ranks are
    the layout's own cache) or a tier wider than the file's units.  The
    writer (formats.saving) and the reader (read_stored, attach) both
    apply it."""
    if any(t.code == STORED for t in layout.tiers):
        raise UsageError(f"rank policy {layout.text()}: a stored layout's tiers have codes of "
                         "their own (R@B), not 'stored'")
    check_width(layout, width)


def attach(base, layout, scheme, load):
    """base (a file's stored Projections) carrying `layout`'s tiers (see
    Projections.tiers): R@B cut at R columns (load(R) reads the file so)
    and quantized under scheme (a QuantScheme), R cut and unquantized,
    stored as base is.  UsageError for a tier wider than base's units."""
    check_width(layout, base.head_dim)
    base = dataclasses.replace(base, tiers=None)
    per = [None if t.dropped else base if t.code == STORED else
           with_bits(load(t.ranks), t.bits, scheme) for t in layout.tiers]
    return dataclasses.replace(base, policy=layout.text(), tiers=(layout, tuple(per)))


def read_stored(f, path, method, width):
    """(layout, scheme) a method group stores (its `tiers` attribute,
    docs/formats.md 5.4.1), or None; KqsvdError naming the attribute for
    one that is not a layout."""
    if "tiers" not in f[method].attrs:
        return None
    v = f[method].attrs["tiers"]
    v = v.decode("utf-8", "replace") if isinstance(v, bytes) else v
    try:
        layout = parse(str(v))
        check_storable(layout, width)
    except UsageError as e:
        raise KqsvdError(f"{path}: attribute '{method}/tiers': {e}") from None
    return layout, read_scheme(f, path, "the file stores a tiered layout")
