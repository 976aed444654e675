"""Quantized latents: the scheme a cache quantizes with (docs/quantized-cache.md)
and the bits of each (layer, KV head) unit, as Projections carry them.

A rank policy takes bits after '@': `fixed:32@4` is rank 32 with 4-bit
codes for keys and values, `fixed:32@4/8` 4-bit keys and 8-bit values;
without '@' the latent is held as computed (bits 0)."""
import dataclasses

import numpy as np

from ..errors import UsageError

BITS = (2, 3, 4, 8)
AXES = ("channel", "token")


@dataclasses.dataclass(frozen=True)
class QuantScheme:
    """How a quantized cache holds its columns: groups of `group` values
    (along the token axis for 'channel', within a token's row for 'token'),
    keys and values each on their own axis, the newest `residual` tokens
    unquantized, and the latent rotated by a Hadamard matrix (folded into
    A and B) when `rotate`."""
    group: int = 32
    key_axis: str = "channel"
    value_axis: str = "token"
    residual: int = 0
    rotate: bool = False

    def check(self, what="the quantization scheme"):
        if self.group < 1 or self.residual < 0 or self.key_axis not in AXES or \
                self.value_axis not in AXES:
            raise UsageError(f"{what}: group {self.group}, residual {self.residual}, key axis "
                             f"{self.key_axis}, value axis {self.value_axis}: expected group >= 1,"
                             f" residual >= 0, axes among {', '.join(AXES)}")
        return self


def split_bits(policy):
    """'fixed:32@4' -> ('fixed:32', (4, 4)); '...@4/8' -> (..., (4, 8));
    no '@' -> (policy, None).  Raises UsageError for bits not in BITS."""
    base, at, bits = policy.rpartition("@")
    if not at:
        return policy, None
    parts = bits.split("/")
    try:
        b = tuple(int(x) for x in parts)
    except ValueError:
        b = ()
    if len(b) not in (1, 2) or any(x not in BITS for x in b) or not base:
        raise UsageError(f"rank policy {policy}: bits after '@' must be one of "
                         f"{', '.join(map(str, BITS))}, or keys/values such as 4/8")
    return base, (b * 2)[:2]


def with_bits(proj, bits, scheme):
    """proj (a Projections) with every unit quantized at bits = (keys,
    values) under scheme, or unquantized for bits None."""
    if bits is None:
        return dataclasses.replace(proj, bits_k=None, bits_v=None, quant=None)
    shape = proj.rank_k_heads.shape
    return dataclasses.replace(proj, bits_k=np.full(shape, bits[0], np.int64),
                               bits_v=np.full(shape, bits[1], np.int64), quant=scheme)
