"""libkqsvd from Python, through ctypes, so nothing is compiled at install
time: the library found and its functions typed, its structures, its
errors as KqsvdError, and what the accumulator (calibrator.py) and its
result (result.py) share.  kqsvd.Calibrator is the accumulator of
include/kqsvd/accumulator.h:

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
from typing import TYPE_CHECKING

from .. import native
from ..errors import KqsvdError, UsageError
from ..renamed import attribute, moved

if TYPE_CHECKING:  # numpy loads at first use, torch never: rows may be either
    pass

TENSORS = {"keys": 0, "values": 1, "queries": 2}
METHODS = ("kqsvd", "ksvd", "eigen")
ERR_USAGE = 1
# status codes of include/kqsvd/types.h, for messages
STATUS = ("ok", "usage", "input", "data", "io", "hdf5", "mpi", "lapack", "cuda", "nomem", "bug",
          "remote", "interrupted")


class Shape(ctypes.Structure):
    _fields_ = [("layers", ctypes.c_int64), ("kv_heads", ctypes.c_int64),
                ("q_per_kv", ctypes.c_int64), ("head_dim", ctypes.c_int64),
                ("hidden", ctypes.c_int64)]
    group = attribute("q_per_kv", "Shape.group")  # renamed in 0.5 (renamed.py)


# Calibrator, check_policy and Result lived here before calibrator.py and result.py.
__getattr__ = moved(__name__, {"Calibrator": "kqsvd.calibration.calibrator",
                               "check_policy": "kqsvd.calibration.calibrator",
                               "Result": "kqsvd.calibration.result"})


# How rows become factors (kqsvd_qr_t): Householder QR merged by TSQR, or
# float64 Gram matrices (kqsvd calibrate --qr).
QR_METHODS = ("tsqr", "gram")


class AccOptions(ctypes.Structure):
    _fields_ = [("block_rows", ctypes.c_int64), ("mem_limit_mib", ctypes.c_double),
                ("qr", ctypes.c_int), ("head_groups", ctypes.c_int64)]


class FinishOptions(ctypes.Structure):
    _fields_ = [("beta", ctypes.c_double), ("ranks", ctypes.c_char_p)]


class WriteOptions(ctypes.Structure):
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
        "kqsvd_acc_options_default": (None, [ctypes.POINTER(AccOptions)]),
        "kqsvd_acc_init": (I, [ctypes.POINTER(Shape), ctypes.POINTER(AccOptions),
                               ctypes.POINTER(P)]),
        "kqsvd_acc_free": (None, [ctypes.POINTER(P)]),
        "kqsvd_acc_absorb": (I, [P, I, I64, I64, I64, P, I, I64, I64]),
        "kqsvd_acc_absorb_oproj": (I, [P, I64, P, I, I64, I64]),
        "kqsvd_acc_factor": (I, [P, I, I64, I64, P]),
        "kqsvd_acc_tokens": (I64, [P]),
        "kqsvd_acc_save": (I, [P, ctypes.c_char_p, I]),
        "kqsvd_acc_load": (I, [P, ctypes.c_char_p]),
        "kqsvd_acc_reduce": (I, [P, P, I]),
        "kqsvd_acc_finish": (I, [P, ctypes.POINTER(FinishOptions), ctypes.POINTER(P)]),
        "kqsvd_result_write": (I, [P, ctypes.c_char_p, ctypes.POINTER(WriteOptions)]),
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


def check_status(status, what):
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


class Handle:
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


def whole(name, v, low=0, high=_MOST):
    """v as an int when it is a whole number (not a bool) in low..high;
    UsageError naming the argument otherwise."""
    import numbers
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or not low <= v <= high:
        raise UsageError(f"{name} = {v!r}: expected a whole number in {low}..{high}")
    return int(v)


def one_of(name, v, choices):
    if not isinstance(v, str) or v not in choices:
        raise UsageError(f"{name} = {v!r}: expected one of {', '.join(map(repr, choices))}")
    return v


def path_arg(name, v):
    if not isinstance(v, (str, bytes, os.PathLike)):
        raise UsageError(f"{name} = {v!r}: expected a file name")
    return os.fsencode(v)
