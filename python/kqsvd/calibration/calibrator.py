"""kqsvd.Calibrator: the C library's accumulator (include/kqsvd/accumulator.h)
for one model shape, fed rows from Python (kqsvd.calibration.binding says
how rows reach C and where the library is found)."""
from __future__ import annotations

import ctypes
import os
from typing import TYPE_CHECKING, Any, Literal

from ..errors import UsageError
from ..renamed import keywords
from .binding import (QR_METHODS, TENSORS, AccOptions, FinishOptions, Handle, Shape,
                      check_status, library, one_of, path_arg, rows_of, whole)
from .result import Result

if TYPE_CHECKING:
    import numpy as np
    import torch


class Calibrator(Handle):
    """A kqsvd accumulator for one model shape (the C library's kqsvd_acc_t).

    It holds float64 R factors of every (layer, KV head)'s keys, stacked
    queries, values and W^O; finish() solves them into projections.  Every
    argument is checked before it reaches C: a bad one is a UsageError
    naming it.  A failing C call raises KqsvdError (UsageError for a bad
    argument) carrying the C library's message.  The C object is freed by
    close() or when the Calibrator is collected.  Nothing but reduce() is
    collective.

    Parameters
    ----------
    layers, kv_heads, q_per_kv, head_dim, hidden : int
        The model's sizes: L, Hkv, Hq / Hkv, d and D, each at least 1.
    block_rows : int
        Rows per Householder update, 1 .. 2^20; results depend on it by
        round-off only, and checkpoints record it.
    mem_limit_mib : float
        Refuse an accumulator whose factors and buffers exceed this many
        MiB; 0 for no limit.
    head_groups : int
        G, dividing kv_heads: each group of G consecutive KV heads is
        solved as one, G d wide, and the result is the model's group view
        (docs/formats.md 5.3); 1 is the per-head form.
    qr : {"tsqr", "gram"}
        How rows become factors: Householder QR merged by TSQR, or
        float64 Gram matrices (kqsvd calibrate --qr).

    Attributes
    ----------
    shape : ctypes.Structure
        layers, kv_heads, q_per_kv, head_dim and hidden, as given.
    head_groups : int
        G, as given.

    Raises
    ------
    UsageError
        For a bad argument, naming it.
    KqsvdError
        When libkqsvd.so is not found or cannot load, or when the
        accumulator would exceed mem_limit_mib or memory (saying how much
        is needed).

    Examples
    --------
    >>> cal = kqsvd.Calibrator(layers=L, kv_heads=Hkv, q_per_kv=Hq // Hkv, head_dim=d, hidden=D)
    >>> cal.absorb("keys", layer, kv_head, k_rows)  # [T, d] tensor or array
    >>> cal.absorb("queries", layer, kv_head, q_rows, query=j)
    >>> cal.absorb("values", layer, kv_head, v_rows)
    >>> cal.absorb_oproj(layer, o_proj_weight)  # [D, Hq d], once per layer
    >>> cal.finish(ranks="eps:0.1").write("proj.h5", model="name")
    """

    @keywords(group="q_per_kv")  # renamed in 0.5 (renamed.py)
    def __init__(self, layers: int, kv_heads: int, q_per_kv: int, head_dim: int, hidden: int,
                 block_rows: int = 256, mem_limit_mib: float = 0.0, head_groups: int = 1,
                 qr: Literal["tsqr", "gram"] = "tsqr") -> None:
        import math
        lib = library()
        sizes = {k: whole(k, v, 1) for k, v in (("layers", layers), ("kv_heads", kv_heads),
                                                 ("q_per_kv", q_per_kv), ("head_dim", head_dim),
                                                 ("hidden", hidden))}
        self.shape = Shape(*sizes.values())
        self.head_groups = whole("head_groups", head_groups, 1, sizes["kv_heads"])
        if sizes["kv_heads"] % self.head_groups:
            raise UsageError(f"head_groups = {head_groups} does not divide kv_heads = {kv_heads}")
        if isinstance(mem_limit_mib, bool) or not isinstance(mem_limit_mib, (int, float)) or \
                not math.isfinite(mem_limit_mib) or mem_limit_mib < 0:
            raise UsageError(f"mem_limit_mib = {mem_limit_mib!r}: expected a number, 0 or more")
        opt = AccOptions()
        lib.kqsvd_acc_options_default(ctypes.byref(opt))
        opt.block_rows = whole("block_rows", block_rows, 1, 1 << 20)
        opt.mem_limit_mib, opt.head_groups = float(mem_limit_mib), self.head_groups
        opt.qr = QR_METHODS.index(one_of("qr", qr, QR_METHODS))
        h = ctypes.c_void_p()
        check_status(lib.kqsvd_acc_init(ctypes.byref(self.shape), ctypes.byref(opt),
                                        ctypes.byref(h)),
                     "creating the accumulator")
        self._own(h.value, "kqsvd_acc_free")

    def _where(self, tensor, layer, kv_head):
        """(tensor code, layer, kv_head) checked against the shape."""
        s = self.shape
        return (TENSORS[one_of("tensor", tensor, tuple(TENSORS))],
                whole("layer", layer, 0, s.layers - 1), whole("kv_head", kv_head, 0, s.kv_heads - 1))

    def absorb(self, tensor: Literal["keys", "values", "queries"], layer: int, kv_head: int,
               rows: torch.Tensor | np.ndarray, query: int = 0) -> None:
        """Folds [T, head_dim] rows of one head into its factor.

        The rows are read where they lie, by pointer with their row stride,
        without a copy.  The result depends on the rows, their order and
        how they are split into calls only through round-off.  Not
        collective.

        Parameters
        ----------
        tensor : {"keys", "values", "queries"}
            Keys or values of KV head kv_head, or queries of its query head
            `query`.
        layer : int
            0 .. layers - 1.
        kv_head : int
            0 .. kv_heads - 1.  With head_groups G, keys and values come a
            group at a time: kv_head is the group's first KV head.
        rows : torch.Tensor or np.ndarray
            [T, head_dim] rows ([T, G head_dim] for keys and values under
            head_groups G: the group's heads side by side): a CPU torch
            tensor or a numpy array, its last dimension contiguous, in
            float16, bfloat16, float32 or float64 (a uint16 array is read
            as bfloat16 bit patterns).
        query : int
            The query head, 0 .. q_per_kv - 1, the KV head's own; 0 for
            keys and values.

        Raises
        ------
        UsageError
            For a bad argument, naming it: an index out of range, rows of
            another width, type or layout, or on a GPU.
        KqsvdError
            For a NaN or Inf, naming the tensor, layer, head and row (the
            factor is then left as it was); after close().
        """
        h = self._live("absorb()")
        t, layer, kv_head = self._where(tensor, layer, kv_head)
        query = whole("query", query, 0, self.shape.q_per_kv - 1)
        ptr, dt, n, stride, keep = rows_of(rows)
        width = self.shape.head_dim * (1 if tensor == "queries" else self.head_groups)
        if keep.shape[1] != width:
            raise UsageError(f"{tensor} rows of layer {layer} are {keep.shape[1]} wide; "
                             f"expected {width}" + (f" ({self.head_groups} heads of head_dim "
                                                    f"{self.shape.head_dim})"
                                                    if width != self.shape.head_dim else
                                                    " (head_dim)"))
        check_status(library().kqsvd_acc_absorb(h, t, layer, kv_head, query, ptr, dt, n, stride),
                     f"{tensor} of layer {layer}")

    def absorb_oproj(self, layer: int, weight: torch.Tensor | np.ndarray) -> None:
        """Folds a layer's output projection weight into its W factors.

        W is the model's, the same on every process: reduce() does not
        merge it, so give it to the accumulator that finishes.  Not
        collective.

        Parameters
        ----------
        layer : int
            0 .. layers - 1.
        weight : torch.Tensor or np.ndarray
            o_proj's weight, [D, Hq d] (torch's nn.Linear layout), rows
            contiguous, of a type absorb() takes.

        Raises
        ------
        UsageError
            For a bad argument, naming it: a layer out of range, a weight
            of another width, type or layout.
        KqsvdError
            For a NaN or Inf (the layer's W factors are then left as they
            were); after close().
        """
        h = self._live("absorb_oproj()")
        s = self.shape
        layer = whole("layer", layer, 0, s.layers - 1)
        ptr, dt, n, stride, keep = rows_of(weight)
        want = s.kv_heads * s.q_per_kv * s.head_dim
        if keep.shape[1] != want:
            raise UsageError(f"o_proj of layer {layer} is {keep.shape[1]} wide; expected Hq d = "
                             f"{want}")
        check_status(library().kqsvd_acc_absorb_oproj(h, layer, ptr, dt, n, stride),
                     f"o_proj of layer {layer}")

    def tokens(self) -> int:
        """Rows folded so far into the keys of (layer 0, KV head 0).

        Returns
        -------
        int
            The tokens seen, when every head gets every token.

        Raises
        ------
        KqsvdError
            After close().
        """
        return library().kqsvd_acc_tokens(self._live("tokens()"))

    def factor(self, tensor: Literal["keys", "values", "queries"], layer: int,
               kv_head: int) -> np.ndarray:
        """The current d x d R factor of one head's rows (numpy, upper triangular).

        Unique up to the sign of each row; under qr="gram", the Cholesky
        factor of the Gram matrix.  Not collective.

        Parameters
        ----------
        tensor : {"keys", "values", "queries"}
            As absorb(); queries: the KV head's query heads stacked.
        layer : int
            0 .. layers - 1.
        kv_head : int
            0 .. kv_heads - 1.

        Returns
        -------
        np.ndarray
            float64 [d, d], zeros below the diagonal; keys and values under
            head_groups G: the group's (G d) x (G d) one.

        Raises
        ------
        UsageError
            For an unknown tensor or an index out of range.
        KqsvdError
            When the C library fails; after close().
        """
        import numpy as np
        h = self._live("factor()")
        t, layer, kv_head = self._where(tensor, layer, kv_head)
        d = self.shape.head_dim * (1 if tensor == "queries" else self.head_groups)
        R = np.zeros((d, d))
        check_status(library().kqsvd_acc_factor(h, t, layer, kv_head, R.ctypes.data),
                     f"factor of {tensor}")
        return R

    def save(self, path: str | bytes | os.PathLike, force: bool = False) -> None:
        """Writes the factors in kqsvd's checkpoint format (docs/formats.md 7).

        Written under a unique temporary name and renamed, with a checksum.
        Not collective.

        Parameters
        ----------
        path : str, bytes or os.PathLike
            The checkpoint to write.
        force : bool
            Replace an existing file.

        Raises
        ------
        UsageError
            Nothing written: for a path that is not a file name; when path
            is a folder, a device, a FIFO or a socket, force or not; when
            it exists and force is false; when its folder is missing or
            takes no new file.
        KqsvdError
            For an I/O or HDF5 failure, naming the path; after close().
        """
        h = self._live("save()")
        where = path_arg("path", path)
        check_status(library().kqsvd_acc_save(h, where, 1 if force else 0),
                     f"saving {os.fsdecode(where)}")

    def load(self, path: str | bytes | os.PathLike) -> None:
        """Replaces the factors with those a save() wrote.

        The checkpoint must come from an accumulator of the same shape and
        options.  Not collective.

        Parameters
        ----------
        path : str, bytes or os.PathLike
            The checkpoint to read.

        Raises
        ------
        UsageError
            For a path that is not a file name.
        KqsvdError
            Naming the file, for another shape or options, a damaged file
            (checksum) or a missing one, or an HDF5 failure; after close().
        """
        h = self._live("load()")
        where = path_arg("path", path)
        check_status(library().kqsvd_acc_load(h, where), f"loading {os.fsdecode(where)}")

    def reduce(self, comm: Any, root: int = 0) -> None:
        """Merges every process's factors onto `root` (collective).

        Collective over an mpi4py communicator: root's accumulator then
        holds the factors of all the processes' rows; the others' are left
        unchanged.  Every process must have the same shape and options.
        One process (or comm None): nothing to do.  After a failure root's
        factors are unspecified.

        Parameters
        ----------
        comm : mpi4py.MPI.Comm or None
            The communicator.
        root : int
            The rank that receives the factors, 0 .. comm.Get_size() - 1.

        Raises
        ------
        UsageError
            For a comm that is not an mpi4py communicator (or mpi4py
            missing), a bad root, or shapes that differ.
        KqsvdError
            For an MPI failure or out of memory (the same on every
            process); after close().
        """
        h = self._live("reduce()")
        if comm is None:
            return
        try:
            from mpi4py import MPI
        except ImportError:
            MPI = None
        if MPI is None or not isinstance(comm, MPI.Comm):
            raise UsageError(f"comm = {comm!r}: expected an mpi4py communicator or None")
        if comm.Get_size() == 1:
            return
        root = whole("root", root, 0, comm.Get_size() - 1)
        # MPI._handleof: mpi4py's documented way to a communicator's C handle
        check_status(library().kqsvd_acc_reduce(h, ctypes.c_void_p(MPI._handleof(comm)), root),
                     "reducing the factors")

    def finish(self, ranks: str = "eps:0.1", beta: float = 1.0) -> Result:
        """The three methods' projections, spectra and ranks (a Result).

        Solves the d x d problem of every (layer, KV head), or (layer,
        group) under head_groups, from the factors and chooses ranks.
        Call it after reduce(), on the root.  The accumulator is
        unchanged.  Not collective.

        Parameters
        ----------
        ranks : str
            A rank policy: "eps:E", "fixed:R" or "budget:F".
        beta : float
            The eigen method's key/query unbalance, above 0.

        Returns
        -------
        Result
            Its shape is the group view under head_groups G: kv_heads / G
            KV heads of head_dim G d.

        Raises
        ------
        UsageError
            For a ranks that is not a string, a beta not above 0, an
            unknown policy or a rank above head_dim.
        KqsvdError
            For a LAPACK failure or out of memory; after close().

        Examples
        --------
        >>> cal.finish(ranks="budget:0.25").write("proj.h5", model="name")
        """
        import math
        h = self._live("finish()")
        if not isinstance(ranks, str):
            raise UsageError(f"ranks = {ranks!r}: expected a policy string such as 'eps:0.1', "
                             "'fixed:16' or 'budget:0.25'")
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or \
                not math.isfinite(beta) or beta <= 0:
            raise UsageError(f"beta = {beta!r}: expected a number above 0")
        opt = FinishOptions(float(beta), ranks.encode())
        res = ctypes.c_void_p()
        check_status(library().kqsvd_acc_finish(h, ctypes.byref(opt), ctypes.byref(res)),
                     f"finish(ranks={ranks!r}, beta={beta!r})")
        G = self.head_groups
        s = self.shape
        return Result(res.value, Shape(s.layers, s.kv_heads // G, s.q_per_kv * G, s.head_dim * G,
                                      s.hidden))


def check_policy(ranks, beta, head_dim):
    """Raises UsageError when finish() would refuse the rank policy or beta
    at this head_dim: found before a long run rather than after it (a
    one-head accumulator of zeros, which solves at once)."""
    import numpy as np
    cal = Calibrator(1, 1, 1, head_dim, 1)
    try:
        cal.absorb_oproj(0, np.zeros((1, head_dim)))
        cal.finish(ranks, beta).close()
    finally:
        cal.close()
