"""Rank policies, as every command and the library write them: one parser.

    eps:E, fixed:R, budget:F     ranks from a projections file's spectra
                                 (`kqsvd ranks` resolves them)
    stored                       the ranks (and bits) the file stores
    quality-budget:F             ranks fitted to the model (kqsvd.quality)
    quality-tuned:F              the same ranks, up-projections trained
    quality-bits:F               ranks and bits of a quantized latent, fitted
    tiers:LAYOUT                 a tiered cache: tokens held in full, coded or
                                 dropped by importance (formats/tiers.py)
    quality-tiers:F              a tiered cache's layout at F of the bytes, fitted

and after any but the fitted ones, @B or @BK/BV: the latent's columns held
at B bits (keys and values alike), or BK for keys and BV for values, each
among formats.quant.BITS.  Before a policy, METHOD/ (kqsvd/, ksvd/, eigen/)
limits it to one method where a command compares several files.

What a policy means for a file (its ranks) is `kqsvd ranks`'s business
(formats.projections.policy_ranks); this module knows only how one is
written."""
import dataclasses

from ..errors import UsageError
from . import tiers
from .numbers import number, whole
from .quant import split_bits

QUALITY_BUDGET = "quality-budget:"
QUALITY_TUNED = "quality-tuned:"
QUALITY_BITS = "quality-bits:"
QUALITY_TIERS = "quality-tiers:"
FITTED = (QUALITY_BUDGET, QUALITY_TUNED, QUALITY_BITS, QUALITY_TIERS)
STORED = "stored"
METHODS = ("kqsvd", "ksvd", "eigen")


@dataclasses.dataclass(frozen=True)
class Policy:
    """A policy as written: `base` without its bits, `bits` (keys, values)
    or None, `fitted` the prefix of a policy fitted to the model (FITTED)
    or None, `fraction` its F, `method` the METHOD/ given or None, `tiers`
    a tiered cache's TierLayout or None."""
    text: str
    base: str
    bits: tuple = None
    fitted: str = None
    fraction: float = None
    method: str = None
    tiers: object = None

    @property
    def key(self):
        """What makes two policies one configuration, compared after
        parsing: (method, what the base says, bits), equal for fixed:32 and
        fixed:032, for @4 and @4/4, for budget:.25 and budget:0.25, and for
        two spellings of a tiered layout.  Every command and bench that
        refuses a configuration given twice compares these."""
        if self.tiers is not None:
            base = self.tiers  # its codes and parts in one form (formats.tiers)
        elif self.fitted:
            base = (self.fitted, self.fraction)
        else:
            kind, colon, value = self.base.partition(":")
            read = whole(value) if kind == "fixed" else number(value)
            base = (kind, read) if colon and read is not None else self.base
        return self.method, base, self.bits


def fitted_fraction(text):
    """The F of a fitted policy (quality-budget:F, quality-tuned:F,
    quality-bits:F, quality-tiers:F), or None
    for a policy of another kind.  Raises UsageError for F outside (0, 1]."""
    prefix = next((p for p in FITTED if text.startswith(p)), None)
    if prefix is None:
        return None
    f = number(text[len(prefix):])
    if f is None or not 0.0 < f <= 1.0:  # NaN fails too
        raise UsageError(f"rank policy {text}: the fraction must be in (0, 1]")
    return f


def parse(text, methods=False):
    """The Policy `text` writes; methods: whether a METHOD/ may lead it.
    Raises UsageError naming the policy for bad bits or fractions (eps,
    fixed and budget are checked by `kqsvd ranks`); bits after a fitted
    policy are the caller's to refuse (the quality command does)."""
    method = None
    if methods:
        m, slash, rest = text.partition("/")
        if slash and m in METHODS:
            method, text = m, rest
    if text.startswith(tiers.PREFIX):
        return Policy(text, text, method=method, tiers=tiers.parse(text))
    base, bits = split_bits(text)
    frac = fitted_fraction(base)
    fitted = next((p for p in FITTED if base.startswith(p)), None) if frac is not None else None
    return Policy(text, base, bits, fitted, frac, method)
