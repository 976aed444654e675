"""Reading kqsvd's HDF5 files with h5py: element types, attributes and the
checks every reader shares (numpy only, no torch)."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import KqsvdError
from .files import node_kind

if TYPE_CHECKING:
    import h5py

SIZE_ATTRS = ("num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size")


def is_bf16(ds):
    """The contract stores bfloat16 as uint16 bit patterns tagged dtype="bfloat16"."""
    tag = ds.attrs.get("dtype")
    return (tag.decode() if isinstance(tag, bytes) else tag) == "bfloat16"


def decode(a, bf16):
    """A numpy array of a dataset's stored type -> float64, decoding bfloat16
    bit patterns exactly (bf16 is the top half of a float32)."""
    a = np.asarray(a)
    if bf16:
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64)


def read(ds: h5py.Dataset, sel: Any = ()) -> np.ndarray:
    """ds[sel] as float64, whatever the contract's element type.

    Exported as kqsvd.read_dataset.  bfloat16, which the contract stores
    as uint16 bit patterns tagged dtype="bfloat16", is decoded exactly;
    other element types are converted.

    Parameters
    ----------
    ds : h5py.Dataset
        A dataset of a kqsvd file (cache.h5, model.h5, proj.h5).
    sel : selection
        What to read, as h5py indexes a dataset (an index, a slice, a
        tuple of them); () reads all of it.

    Returns
    -------
    np.ndarray
        float64, of the selection's shape.

    Examples
    --------
    >>> with h5py.File("cache.h5", "r") as f:
    ...     k0 = kqsvd.read_dataset(f["keys"], 0)  # layer 0's keys, [Hkv, T, d]
    """
    return decode(ds[sel], is_bf16(ds))


def attr(f, name, default=None):
    v = f.attrs.get(name, default)
    if isinstance(v, bytes):
        return v.decode()
    if isinstance(v, np.ndarray) and v.shape == ():
        return v.item()
    return v


def open_file(path, kind, datasets=()):
    """Opens a kqsvd file of the given kqsvd_format ('cache', 'model',
    'projections'); raises KqsvdError naming the file and what is wrong."""
    import h5py
    if not os.path.exists(path):
        raise KqsvdError(f"{path}: no such file")
    if os.path.isdir(path):
        raise KqsvdError(f"{path}: is a folder, not a file")
    if not os.path.isfile(path):  # HDF5's open() of a FIFO waits for a writer forever
        raise KqsvdError(f"{path}: is {node_kind(path)}, not a regular file")
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise KqsvdError(f"{path}: cannot read as HDF5 ({e})") from None
    try:
        got = attr(f, "kqsvd_format")
        if got != kind:
            raise KqsvdError(f"{path}: not a kqsvd {kind} file (kqsvd_format is {got!r}, "
                             f"expected {kind!r})" if got is not None else
                             f"{path}: not a kqsvd {kind} file (no kqsvd_format attribute)")
        for n in datasets:
            if n not in f:
                raise KqsvdError(f"{path}: dataset '{n}' is missing")
        return f
    except BaseException:
        f.close()
        raise


def sizes(f, path):
    """The model's sizes from a file's root attributes, as a dict of ints."""
    out = {}
    for n in SIZE_ATTRS:
        v = attr(f, n)
        try:
            out[n] = int(v)
        except (TypeError, ValueError):
            raise KqsvdError(f"{path}: attribute '{n}' is missing or not an integer") from None
        if out[n] < 1:
            raise KqsvdError(f"{path}: attribute '{n}' = {out[n]} must be at least 1")
    return out
