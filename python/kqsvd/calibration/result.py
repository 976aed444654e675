"""kqsvd.calibration.result.Result: what Calibrator.finish() gives, the three
methods' projections, spectra and ranks (include/kqsvd/result.h), read in
memory or written as a projections file."""
from __future__ import annotations

import ctypes
import os
from typing import TYPE_CHECKING, Literal

from ..errors import UsageError
from .binding import (METHODS, Handle, Shape, WriteOptions, check_status, library, one_of,
                      path_arg, whole)

if TYPE_CHECKING:
    import numpy as np


class Result(Handle):
    """Projections, spectra and ranks of the three methods (kqsvd_result_t).

    Made by Calibrator.finish(); read in memory (ranks, matrix, sigma) or
    written as a projections file (write).  Its C object is freed by
    close() or when it is collected.  Methods are one of "kqsvd", "ksvd"
    and "eigen".

    Attributes
    ----------
    shape : ctypes.Structure
        That of its items, with fields layers, kv_heads, q_per_kv,
        head_dim and hidden: the model's, or under head_groups G its group
        view (kv_heads / G KV heads of head_dim G d, q_per_kv G times).
    """

    def __init__(self, handle: int, shape: Shape) -> None:
        self.shape = shape
        self._own(handle, "kqsvd_result_free")

    def _item(self, method, layer, kv_head):
        s = self.shape
        return (METHODS.index(one_of("method", method, METHODS)),
                whole("layer", layer, 0, s.layers - 1), whole("kv_head", kv_head, 0, s.kv_heads - 1))

    def ranks(self, method: Literal["kqsvd", "ksvd", "eigen"]) -> tuple[list[int], list[int]]:
        """The ranks a method chose, per layer.

        Parameters
        ----------
        method : {"kqsvd", "ksvd", "eigen"}

        Returns
        -------
        (list of int, list of int)
            (rank_k, rank_v) lists over layers.

        Raises
        ------
        UsageError
            For an unknown method.
        KqsvdError
            After close().
        """
        h = self._live("ranks()")
        m = METHODS.index(one_of("method", method, METHODS))
        lib, L = library(), self.shape.layers
        rk, rv = lib.kqsvd_result_rank_k(h, m), lib.kqsvd_result_rank_v(h, m)
        return [rk[i] for i in range(L)], [rv[i] for i in range(L)]

    def matrix(self, method: Literal["kqsvd", "ksvd", "eigen"],
               which: Literal["key_down", "query_down", "value_down", "value_up"],
               layer: int, kv_head: int) -> np.ndarray:
        """One item's d x d matrix (numpy, a copy).

        Columns most important first: any rank r is the first r columns.

        Parameters
        ----------
        method : {"kqsvd", "ksvd", "eigen"}
        which : {"key_down", "query_down", "value_down", "value_up"}
            A, B, A_v or B_v.
        layer : int
            0 .. shape.layers - 1.
        kv_head : int
            0 .. shape.kv_heads - 1 (a group under head_groups).

        Returns
        -------
        np.ndarray
            float64 [d, d], d = shape.head_dim.

        Raises
        ------
        UsageError
            For an unknown method or matrix, or an index out of range.
        KqsvdError
            After close().
        """
        import numpy as np
        d = self.shape.head_dim
        names = ("key_down", "query_down", "value_down", "value_up")
        h = self._live("matrix()")
        k = names.index(one_of("which", which, names))
        m, layer, kv_head = self._item(method, layer, kv_head)
        p = library().kqsvd_result_matrix(h, m, k, layer, kv_head)
        if not p:
            raise UsageError(f"no matrix {which} of ({layer}, {kv_head})")
        return np.ctypeslib.as_array(p, shape=(d, d)).copy()

    def sigma(self, method: Literal["kqsvd", "ksvd", "eigen"], values: bool, layer: int,
              kv_head: int) -> np.ndarray:
        """The d singular values ordering one item's key or value columns.

        Parameters
        ----------
        method : {"kqsvd", "ksvd", "eigen"}
        values : bool
            False for the key columns, True for the value columns.
        layer : int
            0 .. shape.layers - 1.
        kv_head : int
            0 .. shape.kv_heads - 1 (a group under head_groups).

        Returns
        -------
        np.ndarray
            float64 [d] (numpy, a copy), d = shape.head_dim.

        Raises
        ------
        UsageError
            For an unknown method or an index out of range.
        KqsvdError
            After close().
        """
        import numpy as np
        h = self._live("sigma()")
        m, layer, kv_head = self._item(method, layer, kv_head)
        p = library().kqsvd_result_sigma(h, m, int(bool(values)), layer, kv_head)
        if not p:
            raise UsageError(f"no spectrum of ({layer}, {kv_head})")
        return np.ctypeslib.as_array(p, shape=(self.shape.head_dim,)).copy()

    def write(self, path: str | bytes | os.PathLike, model: str | None = "", tokens: int = 0,
              causal: bool | int = 1, force: bool = False, inputs_hash: str | None = None,
              rope: Literal["pre", "post"] | None = None, seq_len: int = 0) -> None:
        """Writes proj.h5 (docs/formats.md section 3), under a temporary name.

        inputs_hash, rope and seq_len, when given, are stored as the root
        attributes of those names.  Not collective.

        Parameters
        ----------
        path : str, bytes or os.PathLike
            The file to write.
        model : str or None
            The root attribute `model` (None: "").
        tokens : int
            The root attribute `tokens`; 0 for the accumulator's count
            when finish() made the result (Calibrator.tokens()).
        causal : bool or int
            The attribute `causal`: true for decoders, false for encoders.
        force : bool
            Replace an existing file.
        inputs_hash : str or None
            What the result was made from (at most 63 characters), so that
            a later run can tell the file is up to date.
        rope : {"pre", "post"} or None
            Whether the keys and queries folded were taken before or after
            RoPE; None stores no attribute, which readers take as "post".
        seq_len : int
            The longest calibration window in tokens, at most the tokens;
            0 for unknown (no attribute).

        Raises
        ------
        UsageError
            For an argument of the wrong type or out of range, naming it
            (an inputs_hash over 63 characters, a seq_len above the
            tokens); from the C library for a path that is a folder, a
            device, a FIFO or a socket (also with force), or that exists
            without force, and for a folder it cannot create a file in.
        KqsvdError
            For an I/O or HDF5 failure, naming the path; after close().
        """
        h = self._live("write()")
        where = path_arg("path", path)
        for name, v in (("model", model), ("inputs_hash", inputs_hash)):
            if v is not None and not isinstance(v, str):
                raise UsageError(f"{name} = {v!r}: expected a string")
        if rope is not None:
            one_of("rope", rope, ("pre", "post"))
        opt = WriteOptions((model or "").encode(), whole("tokens", tokens), 1 if causal else 0,
                            1 if force else 0, inputs_hash.encode() if inputs_hash else None,
                            rope.encode() if rope else None, whole("seq_len", seq_len))
        check_status(library().kqsvd_result_write(h, where, ctypes.byref(opt)),
                     f"writing {os.fsdecode(where)}")
