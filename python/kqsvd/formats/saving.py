"""Writing a projections file with new stored ranks: a copy of a file
`kqsvd calibrate` wrote, with the ranks a fit chose (per head), and where
the fit gave them the tuned up-projections or the bits of a quantized
latent beside them (docs/formats.md section 5.3)."""
from __future__ import annotations

import os
import shutil
from typing import Any

import numpy as np

from ..errors import UsageError
from . import h5io
from .files import check_outputs, write_atomic
from .projections import METHODS, TUNED_SUFFIX, Projections, check_path, rank_lists
from .quant import (BITS, COL_BITS, UNQUANTIZED, QuantScheme, drop_bits, off_rank, write_bits,
                    write_scheme)
from .tiers import check_storable
from .tiers import parse as parse_tiers


def save_ranks(src: str | os.PathLike, dst: str | os.PathLike, ranks: dict[str, Any],
               policy: str, tuned: dict[str, tuple[Projections, dict]] | None = None,
               force: bool = False, bits: dict[str, tuple[np.ndarray, np.ndarray]] | None = None,
               scheme: QuantScheme | None = None,
               tiers: dict[str, str] | None = None) -> str | os.PathLike:
    """Writes a copy of the projections file `src` to `dst` with new stored ranks.

    The ranks are stored as per-head datasets with the per-layer ones
    their maxima, and the root's rank_policy is `policy` (docs/formats.md
    section 5.3).  Methods not in `ranks` keep theirs.  A method given new
    ranks without bits loses the bits `src` has for it, which were chosen
    for its stored ranks.  Written under a temporary name and renamed.

    Parameters
    ----------
    src, dst : str or os.PathLike
        The projections file to copy, and the file to write: not src (by
        device and inode), a folder or a device.
    ranks : dict
        {method: (rank_k [L, Hkv], rank_v [L, Hkv])}, each pair in any
        non-string form load_projections takes.
    policy : str
        The rank_policy attribute to store.
    tuned : dict or None
        {method: (Projections, info)} from kqsvd.quality.tune.tune at these
        ranks; their query_down and value_up columns replace the file's,
        and the group records how they were trained (section 5.3, "Tuned
        up-projections").
    force : bool
        Replace an existing dst.
    bits : dict or None
        {method: (bits_k, bits_v)}, each [L, Hkv] per unit or [L, Hkv, d]
        per column (Projections.bits_k), stored with the quantization
        scheme (formats.quant).
    scheme : formats.quant.QuantScheme or None
        The quantization scheme of `bits` (and of the tiers' codes).
    tiers : dict or None
        {method: a tiered cache's layout, as a tiers: policy writes it}:
        stored as the group's `tiers` attribute (docs/formats.md 5.4.1),
        so that the stored policy is that cache.  A method given new
        ranks without a layout loses the one src has.  Refused as the
        readers refuse it: a `stored` tier, or one wider than the units.

    Returns
    -------
    str or os.PathLike
        dst, as given.

    Raises
    ------
    UsageError
        For src or dst not a file name, ranks that are not a dict, an
        unknown method, ranks outside 1..head_dim, bits of the wrong shape
        or values, a src whose method's up-projections were tuned at its
        stored ranks, or a dst refused (src itself, a folder or a device,
        existing without force, or in a folder that is missing or takes no
        new file).
    KqsvdError
        For a bad src file.
    """
    import h5py
    check_path("src", src)
    check_path("dst", dst)
    if not isinstance(ranks, dict):
        raise UsageError(f"save_ranks: ranks must be a dict {{method: (rank_k, rank_v)}}, not "
                         f"{type(ranks).__name__}")
    check_outputs([("dst", dst)], [("src", src)], force)
    checked, width = _checked_ranks(src, dst, ranks, tuned, bits)
    layouts = _checked_layouts(dst, tiers or {}, checked, scheme, width)

    def write(tmp):
        shutil.copyfile(src, tmp)
        with h5py.File(tmp, "r+") as f:
            _write(f, checked, tuned or {}, bits or {}, scheme, layouts)
            f.attrs["rank_policy"] = policy
    write_atomic(dst, write, force)
    return dst


def _checked_layouts(dst, tiers, checked, scheme, width):
    """save_ranks' tiered layouts {method: TierLayouts}, read by the
    readers' rules (formats.tiers.read_stored) before anything is written."""
    layouts = {}
    for m, text in tiers.items():
        if m not in checked or scheme is None:
            raise UsageError(f"tiers for {dst}: method {m!r} needs new ranks and a scheme")
        try:
            layouts[m] = parse_tiers(text)
            check_storable(layouts[m], width)
        except UsageError as e:
            raise UsageError(f"tiers for {dst}: method {m!r}: {e}") from None
    return layouts


def _write(f, checked, tuned, bits, scheme, tiers):
    """save_ranks' changes to the open copy f of its src: the ranks, tuned
    up-projections, bits and tiered layouts (TierLayouts) by method."""
    for m, (rk, rv) in checked.items():
        for side, r in (("k", rk), ("v", rv)):
            for name, data in ((f"rank_{side}_heads", r), (f"rank_{side}", r.max(1))):
                if name in f[m]:
                    del f[m][name]
                f[m].create_dataset(name, data=data.astype(np.int32))
    for m, (p, info) in tuned.items():
        _write_tuned(f[m], p, info, *checked[m])
    for m, (bk, bv) in bits.items():
        write_bits(f, m, bk, bv, scheme)
    for m in checked:
        if m in tiers:
            f[m].attrs["tiers"] = tiers[m].text()  # reads back as the same layout
            write_scheme(f, scheme)
        elif "tiers" in f[m].attrs:
            del f[m].attrs["tiers"]
    drop_bits(f, [m for m in checked if m not in bits])


def _checked_ranks(src, dst, ranks, tuned, bits):
    """save_ranks' ranks as [L, Hkv] pairs by method, every method, tuned
    set and bits checked against the file src (UsageError naming dst),
    and the width of its units (head_dim)."""
    with h5io.open_file(src, "projections") as f:
        s = h5io.sizes(f, src)
        L, H, d = s["num_layers"], s["num_kv_heads"], s["head_dim"]
        checked = {m: rank_lists(r, L, H, d, src) for m, r in ranks.items()}
        for m in list(checked) + list(tuned or {}) + list(bits or {}):
            if m not in METHODS or m not in f:
                raise UsageError(f"ranks for {dst}: method {m!r} is not a method of {src} "
                                 f"({', '.join(x for x in METHODS if x in f)})")
        extra = sorted(set(tuned or {}) - set(checked))
        if extra:  # tuned columns are trained at ranks: they come with them
            raise UsageError(f"tuned up-projections for {dst}: method {extra[0]!r} has no new "
                             "ranks in `ranks`")
        for m, pair in (bits or {}).items():
            _check_bits(m, pair, checked.get(m), (L, H, d), dst)
        # Tuned columns belong to the ranks they were trained at.
        done = [m for m in checked if "query_down" + TUNED_SUFFIX in f[m]]
    if done:
        raise UsageError(f"{src}: the '{done[0]}' up-projections were tuned at its stored ranks; "
                         "give new ranks to the calibrated file (kqsvd calibrate --out)")
    return checked, d


def _check_bits(method, pair, ranks, shape, dst):
    """UsageError naming dst for bits that are neither [L, Hkv] nor
    [L, Hkv, d] per column with bits exactly on each unit's rank."""
    L, H, d = shape
    per_unit = BITS + (UNQUANTIZED,)
    for side, b in zip("kv", pair):
        b = np.asarray(b)
        if b.shape == (L, H) and np.isin(b, per_unit).all():
            continue
        ok = b.shape == (L, H, d) and ranks is not None and np.isin(b, COL_BITS).all()
        if not ok or off_rank(b, ranks["kv".index(side)]) is not None:
            raise UsageError(f"bits for {dst}: {method} bits_{side} must be [{L}, {H}] among "
                             f"{', '.join(map(str, per_unit))}, or [{L}, {H}, {d}] among "
                             f"{', '.join(map(str, COL_BITS))} with bits on the first rank "
                             "columns of each unit and 0 past it")


def _write_tuned(g, p, info, rk, rv):
    """The tuned up-projections beside a method's closed forms, as
    query_down_tuned and value_up_tuned (each head's columns up to its
    rank; past it, the closed form's), with how they were trained."""
    for name, r, mats in (("query_down", rk, p.query_down), ("value_up", rv, p.value_up)):
        full = g[name][...]
        for l, m in enumerate(mats):
            for h in range(full.shape[1]):
                full[l, h, :, :r[l, h]] = m[h, :, :r[l, h]]
        g.create_dataset(name + TUNED_SUFFIX, data=full)
    g.attrs["tuned_steps"] = np.int32(info["step"])
    g.attrs["tuned_lr"] = float(info["lr"])
    g.attrs["tuned_kl_fit"] = np.asarray(info["kl_fit"], dtype=np.float64)
    g.attrs["tuned_kl_check"] = np.asarray(info["kl_check"], dtype=np.float64)
