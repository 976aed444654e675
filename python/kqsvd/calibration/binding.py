"""kqsvd.Calibrator: the C library's accumulator (include/kqsvd/accumulator.h)
from Python, through ctypes over libkqsvd.so, so nothing is compiled at
install time.

    cal = Calibrator(layers=L, kv_heads=Hkv, q_per_kv=Hq // Hkv, head_dim=d, hidden=D)
    cal.absorb("keys", layer, kv_head, k_rows)            # [T, d] tensor or array
    cal.absorb("queries", layer, kv_head, q_rows, query=j)
    cal.absorb("values", layer, kv_head, v_rows)
    cal.absorb_oproj(layer, o_proj_weight)                # [D, Hq d], once per layer
    cal.reduce(comm)                                      # mpi4py communicator, several ranks
    cal.finish(ranks="eps:0.1").write("proj.h5", model="name")

With head_groups=G (dividing kv_heads), keys and values are given a
group at a time, [T, G d] rows of the G heads side by side, kv_head the
group's first; the result is the model's group view (docs/formats.md 5.3).

Rows are read where they lie: a torch tensor (CPU) or numpy array whose
last dimension is contiguous, in float16, bfloat16, float32 or float64, is
passed by pointer with its row stride, without a copy.  A failing C call
raises KqsvdError (UsageError for a bad argument) carrying the C library's
message.

The library is found at $KQSVD_LIBRARY, else in the wheel's _native
folder, else in the repository's build/ folder (this package sits in
python/kqsvd), else beside an installed kqsvd (lib/ of the prefix of the
`kqsvd` on PATH), else wherever the dynamic linker looks (kqsvd.native)."""
from __future__ import annotations

import ctypes
import os
from typing import TYPE_CHECKING, Any, Literal

from .. import native
from ..errors import KqsvdError, UsageError

if TYPE_CHECKING:  # numpy loads at first use, torch never: rows may be either
    import numpy as np
    import torch

TENSORS = {"keys": 0, "values": 1, "queries": 2}
METHODS = ("kqsvd", "ksvd", "eigen")
ERR_USAGE = 1
# status codes of include/kqsvd/types.h, for messages
STATUS = ("ok", "usage", "input", "data", "io", "hdf5", "mpi", "lapack", "cuda", "nomem", "bug",
          "remote", "interrupted")


class _Shape(ctypes.Structure):
    _fields_ = [("layers", ctypes.c_int64), ("kv_heads", ctypes.c_int64),
                ("q_per_kv", ctypes.c_int64), ("head_dim", ctypes.c_int64),
                ("hidden", ctypes.c_int64)]


# How rows become factors (kqsvd_qr_t): Householder QR merged by TSQR, or
# float64 Gram matrices (kqsvd calibrate --qr).
QR_METHODS = ("tsqr", "gram")


class _AccOptions(ctypes.Structure):
    _fields_ = [("block_rows", ctypes.c_int64), ("mem_limit_mib", ctypes.c_double),
                ("qr", ctypes.c_int), ("head_groups", ctypes.c_int64)]


class _FinishOptions(ctypes.Structure):
    _fields_ = [("beta", ctypes.c_double), ("ranks", ctypes.c_char_p)]


class _WriteOptions(ctypes.Structure):
    _fields_ = [("model", ctypes.c_char_p), ("tokens", ctypes.c_int64), ("causal", ctypes.c_int),
                ("force", ctypes.c_int), ("inputs_hash", ctypes.c_char_p), ("rope", ctypes.c_char_p),
                ("seq_len", ctypes.c_int64)]


_LIB = None


def library():
    """The loaded libkqsvd, its functions typed (loaded once)."""
    global _LIB
    if _LIB is not None:
        return _LIB
    lib = native.load_library()
    P, I64, I, D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_double
    sigs = {
        "kqsvd_acc_options_default": (None, [ctypes.POINTER(_AccOptions)]),
        "kqsvd_acc_init": (I, [ctypes.POINTER(_Shape), ctypes.POINTER(_AccOptions),
                               ctypes.POINTER(P)]),
        "kqsvd_acc_free": (None, [ctypes.POINTER(P)]),
        "kqsvd_acc_absorb": (I, [P, I, I64, I64, I64, P, I, I64, I64]),
        "kqsvd_acc_absorb_oproj": (I, [P, I64, P, I, I64, I64]),
        "kqsvd_acc_factor": (I, [P, I, I64, I64, P]),
        "kqsvd_acc_tokens": (I64, [P]),
        "kqsvd_acc_save": (I, [P, ctypes.c_char_p, I]),
        "kqsvd_acc_load": (I, [P, ctypes.c_char_p]),
        "kqsvd_acc_reduce": (I, [P, P, I]),
        "kqsvd_acc_finish": (I, [P, ctypes.POINTER(_FinishOptions), ctypes.POINTER(P)]),
        "kqsvd_result_write": (I, [P, ctypes.c_char_p, ctypes.POINTER(_WriteOptions)]),
        "kqsvd_result_free": (None, [ctypes.POINTER(P)]),
        "kqsvd_result_rank_k": (ctypes.POINTER(ctypes.c_int32), [P, I]),
        "kqsvd_result_rank_v": (ctypes.POINTER(ctypes.c_int32), [P, I]),
        "kqsvd_result_matrix": (ctypes.POINTER(D), [P, I, I, I64, I64]),
        "kqsvd_result_sigma": (ctypes.POINTER(D), [P, I, I, I64, I64]),
        "kqsvd_last_error": (ctypes.c_char_p, []),
        "kqsvd_clear_error": (None, []),
    }
    for name, (res, args) in sigs.items():
        f = getattr(lib, name)
        f.restype, f.argtypes = res, args
    _LIB = lib
    return lib


# The C library's messages name its own functions and fields; a Python
# caller is told of the methods and arguments it called.
_C_NAMES = {"kqsvd_acc_absorb_oproj": "absorb_oproj()", "kqsvd_acc_absorb": "absorb()",
            "kqsvd_acc_finish": "finish()", "kqsvd_acc_factor": "factor()",
            "kqsvd_acc_save": "save()", "kqsvd_acc_load": "load()",
            "kqsvd_acc_reduce": "reduce()", "kqsvd_result_write": "Result.write()",
            "kqsvd_acc_init": "Calibrator()", "(force)": "(force=True)"}


def _python_words(msg):
    for c, py in _C_NAMES.items():
        msg = msg.replace(c, py)
    return msg


def _check(status, what):
    if status == 0:
        return
    msg = _python_words(library().kqsvd_last_error().decode("utf-8", "replace"))
    library().kqsvd_clear_error()
    name = STATUS[status] if 0 <= status < len(STATUS) else str(status)
    cls = UsageError if status == ERR_USAGE else KqsvdError
    raise cls(f"{what}: {msg}" if msg else f"{what} failed ({name} error)")


# element type codes of include/kqsvd/types.h by numpy/torch dtype name
_DTYPES = {"float16": 0, "bfloat16": 1, "float32": 2, "float64": 3}


def rows_of(x):
    """(pointer, dtype code, rows, row stride in elements, keep-alive) of a
    2-D torch tensor or numpy array whose rows are contiguous."""
    if hasattr(x, "data_ptr"):  # torch
        if x.device.type != "cpu":
            raise UsageError(f"rows on {x.device}: the CPU fold takes CPU tensors")
        name = str(x.dtype).replace("torch.", "")
        ptr, strides = x.data_ptr(), x.stride()
    else:
        import numpy as np
        x = np.asarray(x)
        name = "bfloat16" if x.dtype.name == "uint16" else x.dtype.name
        item = x.itemsize
        ptr = x.ctypes.data
        strides = tuple(s // item if s % item == 0 else -1 for s in x.strides)
    if name not in _DTYPES:
        raise UsageError(f"rows of dtype {name}: float16, bfloat16, float32 or float64 only")
    if x.ndim != 2:
        raise UsageError(f"rows must be a 2-D [rows, head_dim] array, got {x.ndim}-D")
    if x.shape[0] > 0 and (strides[1] != 1 or strides[0] < x.shape[1]):
        raise UsageError(f"rows with strides {tuple(strides)}: each row must be contiguous "
                         "(call .contiguous() first)")
    return ptr, _DTYPES[name], int(x.shape[0]), int(strides[0]) if x.shape[0] > 1 else int(x.shape[1]), x


class _Handle:
    """An opaque C handle, freed once by `_free` (a kqsvd_*_free taking its
    address), on close() or when collected.  The free function and ctypes'
    helpers are bound when the handle is made: a handle collected at
    interpreter exit must not reach module globals, which may already be
    torn down (None) by then."""
    _h = None
    _release = None

    def _own(self, handle, free):
        self._h = handle
        self._release = (getattr(library(), free), ctypes.c_void_p, ctypes.byref)

    def __del__(self):
        self.close()

    def _live(self, what):
        """The handle, or KqsvdError when close() has freed it: the C
        library must never see a NULL or freed handle."""
        if not self._h:
            raise KqsvdError(f"{type(self).__name__}.{what}: this {type(self).__name__} is "
                             "closed (close() was called); make a new one")
        return self._h

    def close(self) -> None:
        """Frees the C object now rather than when this one is collected.

        Every later call of a method that needs it raises KqsvdError
        (closed); calling close() again does nothing.  Not collective.
        """
        if self._h and self._release:
            free, ptr, byref = self._release
            free(byref(ptr(self._h)))
        self._h = None


# Past this a count or index would wrap in the C library's int64 (2**70
# became 0 there); no model has anything near it.
_MOST = 1 << 62


def _whole(name, v, low=0, high=_MOST):
    """v as an int when it is a whole number (not a bool) in low..high;
    UsageError naming the argument otherwise."""
    import numbers
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or not low <= v <= high:
        raise UsageError(f"{name} = {v!r}: expected a whole number in {low}..{high}")
    return int(v)


def _one_of(name, v, choices):
    if not isinstance(v, str) or v not in choices:
        raise UsageError(f"{name} = {v!r}: expected one of {', '.join(map(repr, choices))}")
    return v


def _path(name, v):
    if not isinstance(v, (str, bytes, os.PathLike)):
        raise UsageError(f"{name} = {v!r}: expected a file name")
    return os.fsencode(v)


class Result(_Handle):
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

    def __init__(self, handle: int, shape: _Shape) -> None:
        self.shape = shape
        self._own(handle, "kqsvd_result_free")

    def _item(self, method, layer, kv_head):
        s = self.shape
        return (METHODS.index(_one_of("method", method, METHODS)),
                _whole("layer", layer, 0, s.layers - 1), _whole("kv_head", kv_head, 0, s.kv_heads - 1))

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
        m = METHODS.index(_one_of("method", method, METHODS))
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
        k = names.index(_one_of("which", which, names))
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
        where = _path("path", path)
        for name, v in (("model", model), ("inputs_hash", inputs_hash)):
            if v is not None and not isinstance(v, str):
                raise UsageError(f"{name} = {v!r}: expected a string")
        if rope is not None:
            _one_of("rope", rope, ("pre", "post"))
        opt = _WriteOptions((model or "").encode(), _whole("tokens", tokens), 1 if causal else 0,
                            1 if force else 0, inputs_hash.encode() if inputs_hash else None,
                            rope.encode() if rope else None, _whole("seq_len", seq_len))
        _check(library().kqsvd_result_write(h, where, ctypes.byref(opt)),
               f"writing {os.fsdecode(where)}")


class Calibrator(_Handle):
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

    def __init__(self, layers: int, kv_heads: int, q_per_kv: int, head_dim: int, hidden: int,
                 block_rows: int = 256, mem_limit_mib: float = 0.0, head_groups: int = 1,
                 qr: Literal["tsqr", "gram"] = "tsqr") -> None:
        import math
        lib = library()
        sizes = {k: _whole(k, v, 1) for k, v in (("layers", layers), ("kv_heads", kv_heads),
                                                 ("q_per_kv", q_per_kv), ("head_dim", head_dim),
                                                 ("hidden", hidden))}
        self.shape = _Shape(*sizes.values())
        self.head_groups = _whole("head_groups", head_groups, 1, sizes["kv_heads"])
        if sizes["kv_heads"] % self.head_groups:
            raise UsageError(f"head_groups = {head_groups} does not divide kv_heads = {kv_heads}")
        if isinstance(mem_limit_mib, bool) or not isinstance(mem_limit_mib, (int, float)) or \
                not math.isfinite(mem_limit_mib) or mem_limit_mib < 0:
            raise UsageError(f"mem_limit_mib = {mem_limit_mib!r}: expected a number, 0 or more")
        opt = _AccOptions()
        lib.kqsvd_acc_options_default(ctypes.byref(opt))
        opt.block_rows = _whole("block_rows", block_rows, 1, 1 << 20)
        opt.mem_limit_mib, opt.head_groups = float(mem_limit_mib), self.head_groups
        opt.qr = QR_METHODS.index(_one_of("qr", qr, QR_METHODS))
        h = ctypes.c_void_p()
        _check(lib.kqsvd_acc_init(ctypes.byref(self.shape), ctypes.byref(opt), ctypes.byref(h)),
               "creating the accumulator")
        self._own(h.value, "kqsvd_acc_free")

    def _where(self, tensor, layer, kv_head):
        """(tensor code, layer, kv_head) checked against the shape."""
        s = self.shape
        return (TENSORS[_one_of("tensor", tensor, tuple(TENSORS))],
                _whole("layer", layer, 0, s.layers - 1), _whole("kv_head", kv_head, 0, s.kv_heads - 1))

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
        query = _whole("query", query, 0, self.shape.q_per_kv - 1)
        ptr, dt, n, stride, keep = rows_of(rows)
        width = self.shape.head_dim * (1 if tensor == "queries" else self.head_groups)
        if keep.shape[1] != width:
            raise UsageError(f"{tensor} rows of layer {layer} are {keep.shape[1]} wide; "
                             f"expected {width}" + (f" ({self.head_groups} heads of head_dim "
                                                    f"{self.shape.head_dim})"
                                                    if width != self.shape.head_dim else
                                                    " (head_dim)"))
        _check(library().kqsvd_acc_absorb(h, t, layer, kv_head, query, ptr, dt, n, stride),
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
        layer = _whole("layer", layer, 0, s.layers - 1)
        ptr, dt, n, stride, keep = rows_of(weight)
        want = s.kv_heads * s.q_per_kv * s.head_dim
        if keep.shape[1] != want:
            raise UsageError(f"o_proj of layer {layer} is {keep.shape[1]} wide; expected Hq d = "
                             f"{want}")
        _check(library().kqsvd_acc_absorb_oproj(h, layer, ptr, dt, n, stride),
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
        _check(library().kqsvd_acc_factor(h, t, layer, kv_head, R.ctypes.data),
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
        where = _path("path", path)
        _check(library().kqsvd_acc_save(h, where, 1 if force else 0),
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
        where = _path("path", path)
        _check(library().kqsvd_acc_load(h, where), f"loading {os.fsdecode(where)}")

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
        root = _whole("root", root, 0, comm.Get_size() - 1)
        # MPI._handleof: mpi4py's documented way to a communicator's C handle
        _check(library().kqsvd_acc_reduce(h, ctypes.c_void_p(MPI._handleof(comm)), root),
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
        opt = _FinishOptions(float(beta), ranks.encode())
        res = ctypes.c_void_p()
        _check(library().kqsvd_acc_finish(h, ctypes.byref(opt), ctypes.byref(res)),
               f"finish(ranks={ranks!r}, beta={beta!r})")
        G = self.head_groups
        s = self.shape
        return Result(res.value, _Shape(s.layers, s.kv_heads // G, s.q_per_kv * G, s.head_dim * G,
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
