"""A decode step over quantized columns read as codes: libkqsvd's
kqsvd_codes_scores and kqsvd_codes_weigh (include/kqsvd/decode.h).

Dequantizing a whole cache to float32 at every step, as quant.Store's
values() does, writes and reads back four bytes per cached value where
the codes hold two to four bits; at long context that traffic sets the
step's time.  The kernels decode a tile of tokens at a time into a buffer
that stays in the core's cache.  They serve CPU tensors; elsewhere, or
without the C library, or with KQSVD_DECODE=torch in the environment, the
stores dequantize as before (the same values up to float32 round-off).

`scores(store, q, out)` and `weigh(store, p)` take one quant.Store: the
tokens it holds quantized through the kernel, the rest (residual, a
channel block not yet complete) by a float32 product."""
import ctypes
import os

import torch

from .. import native
from ..errors import KqsvdError

_AXES = {"channel": 0, "token": 1}


class _Codes(ctypes.Structure):
    _fields_ = [("slices", ctypes.c_int64), ("tokens", ctypes.c_int64), ("cols", ctypes.c_int64),
                ("capacity", ctypes.c_int64), ("bits", ctypes.c_int32), ("group", ctypes.c_int32),
                ("axis", ctypes.c_int),
                ("codes", ctypes.c_void_p), ("scale", ctypes.c_void_p),
                ("zero", ctypes.c_void_p)]  # float16


_LIB = []  # [library or None], once looked for


def library():
    """libkqsvd with the two kernels typed, or None when it is not there or
    KQSVD_DECODE=torch."""
    if os.environ.get("KQSVD_DECODE", "").lower() == "torch":
        return None
    if not _LIB:
        lib = native.load_library(required=False)
        if lib is not None and hasattr(lib, "kqsvd_codes_scores"):
            for name in ("kqsvd_codes_scores", "kqsvd_codes_weigh"):
                f = getattr(lib, name)
                f.restype = ctypes.c_int
                f.argtypes = [ctypes.POINTER(_Codes), ctypes.c_int64, ctypes.c_void_p,
                              ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
            lib.kqsvd_clear_error.restype = None
            lib.kqsvd_codes_quantize.restype = ctypes.c_int
            lib.kqsvd_codes_quantize.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 4 + [
                ctypes.c_int, ctypes.c_int] + [ctypes.c_void_p] * 3
            lib.kqsvd_last_error.restype = ctypes.c_char_p
        else:
            lib = None
        _LIB.append(lib)
    return _LIB[0]


def available(x):
    """Whether a step over tensors like x reads codes through the kernels:
    on the CPU, in float32 or narrower (float64 runs keep their precision
    through the dequantized values)."""
    return x.device.type == "cpu" and x.dtype != torch.float64 and library() is not None


def _call(name, store, a, out, ld):
    """One kernel call on store's quantized tokens; a and out float32,
    contiguous, [b, H, nq, .]."""
    lib = library()
    b, H = store.codes.shape[:2]
    desc = _Codes(b * H, store.done, store.rest.shape[-1], store.capacity(), store.bits,
                  store.group,
                  _AXES[store.axis], store.codes.data_ptr(), store.scale.data_ptr(),
                  store.zero.data_ptr())
    st = getattr(lib, name)(ctypes.byref(desc), a.shape[2], a.data_ptr(), ld, out.data_ptr(),
                            torch.get_num_threads())
    if st:
        msg = lib.kqsvd_last_error().decode("utf-8", "replace")
        lib.kqsvd_clear_error()
        raise KqsvdError(f"the decode kernel failed: {msg}")


def quantize(x, bits, group):
    """quant.quantize(x, bits, group) by libkqsvd's kqsvd_codes_quantize
    (the same codes, scales and zeros to the bit), or None where the
    kernels do not serve x (available())."""
    if not available(x):
        return None
    lib = library()
    x = x.float().contiguous()
    n = x.shape[-1]
    rows = x.numel() // n
    lead = x.shape[:-1]
    codes = torch.empty(*lead, (n + 7) // 8 * bits, dtype=torch.uint8)
    scale = torch.empty(*lead, -(-n // group), dtype=torch.float16)
    zero = torch.empty_like(scale)
    st = lib.kqsvd_codes_quantize(x.data_ptr(), rows, n, n, 1, bits, group, codes.data_ptr(),
                                  scale.data_ptr(), zero.data_ptr())
    if st:
        msg = lib.kqsvd_last_error().decode("utf-8", "replace")
        lib.kqsvd_clear_error()
        raise KqsvdError(msg)
    return codes, scale, zero


def scores(store, q, out):
    """out [b, H, nq, N] += q [b, H, nq, n] times every token's columns
    (N >= the tokens held).  Both float32, out contiguous."""
    q = q.float().contiguous()
    if store.codes is not None:
        _call("kqsvd_codes_scores", store, q, out, out.shape[-1])
    if store.rest is not None and store.rest.shape[-2]:
        end = store.done + store.rest.shape[-2]
        out[..., store.done:end] += q @ store.rest.float().transpose(-1, -2)
    return out


def weigh(store, p):
    """p [b, H, nq, N] (N >= the tokens held) times every token's columns:
    [b, H, nq, n] float32."""
    p = p.float().contiguous()
    b, H, nq, N = p.shape
    n = store.rest.shape[-1]
    out = torch.zeros(b, H, nq, n, dtype=torch.float32, device=p.device)
    if store.codes is not None:
        _call("kqsvd_codes_weigh", store, p, out, N)
    if store.rest is not None and store.rest.shape[-2]:
        out += p[..., store.done:store.done + store.rest.shape[-2]] @ store.rest.float()
    return out
