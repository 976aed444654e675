"""Projections for programs outside Python's HDF5 stack: safetensors files."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Sequence

import numpy as np
import torch

from ..errors import UsageError
from ..formats.files import check_outputs, write_atomic
from ..formats.projections import Projections, load_projections
from .projection import fold_o_proj

DTYPES = {"float64": np.float64, "float32": np.float32, "float16": np.float16, "bfloat16": None}


def export_safetensors(proj: Projections | str | os.PathLike, path: str | os.PathLike,
                       method: str = "kqsvd",
                       ranks: int | Sequence[int] | np.ndarray | tuple | dict | str | None = None,
                       dtype: str = "float32",
                       o_proj: Sequence[torch.Tensor | np.ndarray] | None = None,
                       force: bool = False) -> str | os.PathLike:
    """Writes one method's per-layer matrices to a safetensors file.

    The tensors, cut at the ranks::

        layers.{l}.key_down [Hkv, d, rank_k[l]]   (A)
        layers.{l}.query_down [Hkv, d, rank_k[l]] (B)
        layers.{l}.value_down [Hkv, d, rank_v[l]] (A_v)
        layers.{l}.value_up [Hkv, d, rank_v[l]]   (B_v)
        layers.{l}.o_proj_folded [D, Hq rank_v[l]]  (with o_proj)

    A head-groups file's matrices are its group view's (docs/formats.md
    5.3).  The metadata holds the method, the policy, the ranks (per
    layer, and per layer and KV head: a head's columns past its own rank
    are zero), whether B and B_v are tuned (kqsvd.quality.tune) and the
    model's sizes (JSON strings), and for a quantized latent
    (quality-bits:F) each head's bits and the quantization scheme.
    path is checked before any work; the file is written under a temporary
    name and renamed, with the mode a new file gets.  Needs torch and
    safetensors.

    Parameters
    ----------
    proj : Projections, str or os.PathLike
        A Projections, or a path to proj.h5 to load with `method` and
        `ranks`.
    path : str or os.PathLike
        The file to write: not the projections file itself (by device and
        inode), not a folder or a device, in a folder that exists and
        takes a new file.
    method, ranks : str, and ranks as load_projections takes them
        Used only when proj is a path (a Projections is written as it is).
    dtype : str
        "float64", "float32", "float16" or "bfloat16": the tensors' type.
    o_proj : sequence of torch.Tensor or np.ndarray, or None
        Each layer's o_proj weight [D, Hq d] (torch Linear layout), one
        per layer, to store the folded weights (see
        attention.fold_o_proj).
    force : bool
        Replace an existing file at path.

    Returns
    -------
    str or os.PathLike
        path, as given.

    Raises
    ------
    UsageError
        For a bad argument, naming it: an unknown dtype, a proj or path of
        the wrong type, an o_proj of the wrong length or shapes, a path
        refused, impossible ranks or an unknown method.
    KqsvdError
        For a bad projections file.

    Examples
    --------
    >>> kqsvd.export_safetensors("proj.h5", "proj.safetensors", ranks="budget:0.25")
    """
    from safetensors.torch import save_file  # an optional dependency, wanted here alone
    if dtype not in DTYPES:
        raise UsageError(f"export_safetensors: dtype '{dtype}' is not one of {', '.join(DTYPES)}")
    if not isinstance(proj, (Projections, str, os.PathLike)):
        raise UsageError(f"export_safetensors: proj must be a Projections or a path to a "
                         f"projections file, not {type(proj).__name__}")
    if not isinstance(path, (str, os.PathLike)):
        raise UsageError(f"export_safetensors: path must be a file name, not {type(path).__name__}")
    source = proj.path if isinstance(proj, Projections) else proj
    check_outputs([("path", os.fspath(path))], [("proj", source)], force)
    p = proj if isinstance(proj, Projections) else load_projections(proj, method, ranks)
    if o_proj is not None:
        _check_o_proj(p, o_proj)
    out, meta = _tensors(p, o_proj, dtype), _metadata(p)
    write_atomic(path, lambda tmp: save_file(out, tmp, metadata=meta), force)
    return path


def _check_o_proj(p, o_proj):
    """UsageError unless o_proj is one [D, Hq d] weight per layer of p."""
    want = (p.hidden_size, p.num_heads * p.sizes()["head_dim"])
    got = len(o_proj) if hasattr(o_proj, "__len__") else repr(o_proj)
    if got != p.num_layers:
        raise UsageError(f"export_safetensors: o_proj must hold {p.num_layers} weights, one "
                         f"per layer, not {got}")
    for l, w in enumerate(o_proj):
        if tuple(getattr(w, "shape", ())) != want:
            raise UsageError(f"export_safetensors: o_proj[{l}] must have shape {list(want)}, "
                             f"not {list(getattr(w, 'shape', ()))}")


def _tensors(p, o_proj, dtype):
    """The file's tensors: every layer's matrices, and its folded o_proj."""
    tdtype = getattr(torch, dtype)
    out = {}
    for l in range(p.num_layers):
        for n in ("key_down", "query_down", "value_down", "value_up"):
            out[f"layers.{l}.{n}"] = torch.from_numpy(getattr(p, n)[l]).to(tdtype).contiguous()
        if o_proj is not None:
            out[f"layers.{l}.o_proj_folded"] = fold_o_proj(
                o_proj[l], p.value_up[l], p.num_heads, p.head_groups).to(tdtype).contiguous()
    return out


def _metadata(p):
    """The file's metadata (JSON strings): what a reader needs besides the
    tensors to use them, the bits and scheme of a quantized latent too."""
    meta = {"kqsvd_format": "projections-safetensors", "method": p.method, "policy": p.policy,
            "source": os.path.basename(p.path), "model": p.model,
            "rank_k": json.dumps(p.rank_k.tolist()), "rank_v": json.dumps(p.rank_v.tolist()),
            "rope": p.rope, "tuned": str(int(p.tuned)),
            "rank_k_heads": json.dumps(p.rank_k_heads.tolist()),
            "rank_v_heads": json.dumps(p.rank_v_heads.tolist()),
            "sizes": json.dumps({k: getattr(p, k) for k in ("num_layers", "num_heads",
                                 "num_kv_heads", "head_dim", "hidden_size")}),
            "head_groups": str(p.head_groups)}
    if p.bits_k is not None:  # a quantized latent: its size and its reading depend on these
        form = "cols" if p.bits_k.ndim == 3 else "heads"
        meta.update({f"bits_k_{form}": json.dumps(p.bits_k.tolist()),
                     f"bits_v_{form}": json.dumps(p.bits_v.tolist())},
                    quant=json.dumps(dataclasses.asdict(p.quant)))
    return meta
