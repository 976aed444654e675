"""A decode step over quantized columns read as codes: libkqsvd's
kqsvd_codes_scores and kqsvd_codes_weigh (include/kqsvd/decode.h).

Dequantizing a whole cache to float32 at every step, as quant.Store's
values() does, writes and reads back four bytes per cached value where
the codes hold two to four bits; at long context that traffic sets the
step's time.  The kernels decode a tile of tokens at a time into a buffer
that stays in the core's cache.  They serve CPU tensors; tensors on a GPU
are served by the same two reads in Triton (triton_decode.py).  In float64,
without the C library (or Triton), or with KQSVD_DECODE=torch in the
environment, the stores dequantize as before (the same values up to
float32 round-off).  KQSVD_DECODE=triton runs the Triton kernels on CPU
tensors too, under Triton's interpreter (TRITON_INTERPRET=1): how they are
tested without a GPU.

Which of them serves a store is chosen once, when its first tokens come
and their device and dtype are known (reader(): the one place the
environment is read): a Reader, Native, Triton or the base Reader (the
codes dequantized), which also quantizes the store's tokens (libkqsvd on
the CPU, Triton on a GPU, else quant.quantize).  A store keeps its state
in a Layout, the one record the kernels read.

A Reader's `scores(layouts, cuts, q, out)` and `weigh(layouts, cuts, p)`
take the Layouts of one side's runs of columns: the tokens they hold
quantized through one kernel call, the rest (residual, a channel block
not yet complete, columns kept unquantized) by float32 products."""
import ctypes
import os
import weakref

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
    """libkqsvd with the decode functions typed, or None when it is not
    there or is older than they are.  Whether a store uses it is reader()'s
    choice (KQSVD_DECODE is read there, not here)."""
    if not _LIB:
        lib = native.load_library(required=False)
        if lib is not None and hasattr(lib, "kqsvd_codes_quantize_runs"):
            for name in ("kqsvd_codes_scores", "kqsvd_codes_weigh"):
                f = getattr(lib, name)
                f.restype = ctypes.c_int
                f.argtypes = [ctypes.POINTER(_Codes), ctypes.c_int64, ctypes.c_int64,
                              ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
            lib.kqsvd_clear_error.restype = None
            lib.kqsvd_codes_quantize_runs.restype = ctypes.c_int
            lib.kqsvd_codes_quantize_runs.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [
                ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 3
            lib.kqsvd_last_error.restype = ctypes.c_char_p
        else:
            lib = None
        _LIB.append(lib)
    return _LIB[0]


def _check(lib, status, what=""):
    """Raises KqsvdError with the library's message for a failed call."""
    if status:
        msg = lib.kqsvd_last_error().decode("utf-8", "replace")
        lib.kqsvd_clear_error()
        raise KqsvdError(what + msg)


class Layout:
    """One quant.Store's tokens as the decode kernels read them, the
    store's own state (docs/quantized-cache.md): its scheme (bits, group,
    axis); `buffers` (codes, scale, zero), None before the first quantized
    token, laid out for `capacity` tokens of which the first `done` are
    quantized, replaced when they grow (and `generation` then changes, so
    that a reader may keep what it derives from them, pointers, until it
    does); `rest`, the tokens after them as they came [b, H, t, n]."""

    _as_stored = ("buffers",)  # codes, float16 scales and zeros: as stored (footprint.py)

    def __init__(self, bits, group, axis):
        self.bits, self.group, self.axis = bits, group, axis
        self.buffers, self.capacity, self.done, self.generation = None, 0, 0, 0
        self.rest = None


_MODES = ("", "torch", "triton")
_TRITON = []  # [triton_decode or None], once imported


def _triton_decode():
    """triton_decode, or None where Triton is not installed; imported when
    first asked, since TRITON_INTERPRET is read as its kernels are made
    (and Triton is not wanted where no store asks for it)."""
    if not _TRITON:
        try:
            from . import triton_decode  # triton at its top, only for the stores that ask
        except ImportError:
            triton_decode = None
        _TRITON.append(triton_decode)
    return _TRITON[0]


def reader(x):
    """The Reader of a store of tensors like x (their device and dtype):
    Native (libkqsvd, CPU tensors), Triton (GPU tensors, or any under
    KQSVD_DECODE=triton), or the base Reader (dequantized values: float64
    runs keep their precision that way).  The one place KQSVD_DECODE is
    read; raises KqsvdError for a value the kernels cannot honour."""
    mode = os.environ.get("KQSVD_DECODE", "").lower()
    if mode not in _MODES:
        raise KqsvdError(f"KQSVD_DECODE={mode}: expected one of {', '.join(_MODES[1:])}")
    cpu = x.device.type == "cpu"
    lib = None if mode == "torch" else library()
    # libkqsvd quantizes CPU tensors below float64: the same codes as
    # quant.quantize, faster
    quantizer = lib if cpu and x.dtype != torch.float64 else None
    if mode == "torch" or x.dtype == torch.float64:
        return Reader(quantizer)
    if mode == "triton" or x.device.type == "cuda":
        if mode == "triton" and cpu and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            raise KqsvdError("KQSVD_DECODE=triton on CPU tensors needs TRITON_INTERPRET=1 "
                             "(Triton's interpreter)")
        td = _triton_decode()
        if td is None and mode == "triton":
            raise KqsvdError("KQSVD_DECODE=triton: Triton is not installed")
        return Reader(quantizer) if td is None else Triton(quantizer, td)
    return Native(quantizer) if cpu and lib is not None else Reader(quantizer)


def backend(x):
    """What reads codes in a step over tensors like x (reader()): "native",
    "triton", or None (dequantized values)."""
    return reader(x).name


def available(x):
    """Whether a step over tensors like x reads codes through the kernels
    (backend())."""
    return reader(x).reads


def quantizes(x):
    """Whether libkqsvd quantizes tensors like x (CPU, float32 or narrower):
    the same codes as quant.quantize, faster."""
    return reader(x).quantizes(x)


def quantize_into(x, bits, group, dest):
    """quant.quantize(x, bits, group) written into dest = (codes, scale,
    zero) by the reader of tensors like x (Reader.quantize_into); False
    (nothing written) where none of the kernels serves x."""
    return reader(x).quantize_into(x, bits, group, dest)


class Reader:
    """How a store's codes are read in a decode step and its tokens
    quantized, chosen once per store (reader()).  This base reads none
    (name None: the step dequantizes the stores) and quantizes through
    `lib` (libkqsvd) where it is given."""

    name = None

    def __init__(self, lib):
        self.lib = lib

    @property
    def reads(self):
        """Whether decode steps read the store's codes through kernels."""
        return self.name is not None

    def quantizes(self, x):
        """Whether libkqsvd quantizes x: the same codes as quant.quantize,
        faster."""
        return self.lib is not None

    def quantize_into(self, x, bits, group, dest):
        """quant.quantize(x, bits, group) written into dest = (codes, scale,
        zero), the same codes, scales and zeros to the bit, straight into
        them when they are contiguous; False (nothing written) where no
        kernel here serves x."""
        if self.lib is None:
            return False
        self.quantize_runs(x, [x.shape[-1]], [bits], group, [dest])
        return True

    def quantize_runs(self, x, cols, bits, group, dests):
        """quantize_into for runs of columns side by side in x [...,
        sum(cols)], run k at bits[k] into dests[k] = (codes, scale, zero),
        in one call (kqsvd_codes_quantize_runs); the caller has checked
        quantizes(x)."""
        _quantize_runs(self.lib, x, cols, bits, group, dests)

    def _call(self, name, lays, a, out, ld):
        raise KqsvdError("these quantized columns are read as codes by no decode kernel "
                         "(float64, KQSVD_DECODE=torch, or neither libkqsvd nor Triton): "
                         "read their values instead")

    def scores(self, lays, cuts, q, out):
        """out [b, H, nq, N] += q [b, H, nq, n] times every token's columns
        (N >= the tokens held), the columns cuts[i]:cuts[i + 1] held by
        the store of Layout lays[i].  out float32, contiguous."""
        return _scores(self, lays, cuts, q, out)

    def weigh(self, lays, cuts, p):
        """p [b, H, nq, N] (N >= the tokens held) times every token's
        columns: [b, H, nq, n] float32, the columns cuts[i]:cuts[i + 1]
        held by the store of Layout lays[i]."""
        return _weigh(self, lays, cuts, p)


class Native(Reader):
    """libkqsvd's kernels, for CPU tensors."""

    name = "native"

    def _call(self, name, lays, a, out, ld):
        """One kernel call on the quantized tokens of lays (runs of columns
        side by side, all holding the same tokens); a and out float32,
        contiguous, [b, H, nq, .]."""
        descs = (_Codes * len(lays))(*[_desc(lay) for lay in lays])
        st = getattr(self.lib, name)(descs, len(lays), a.shape[2], a.data_ptr(), ld,
                                     out.data_ptr(), torch.get_num_threads())
        _check(self.lib, st, "the decode kernel failed: ")


class Triton(Reader):
    """Triton's kernels (triton_decode.py), for GPU tensors (or any under
    KQSVD_DECODE=triton); libkqsvd, where given, quantizes CPU tensors."""

    name = "triton"

    def __init__(self, lib, td):
        super().__init__(lib)
        self.td = td

    def quantize_into(self, x, bits, group, dest):
        # one launch where quant.quantize takes some twenty, at every layer
        # of every step
        if x.is_cuda and self.td.quantize_into(x, bits, group, dest):
            return True
        return super().quantize_into(x, bits, group, dest)

    def _call(self, name, lays, a, out, ld):
        at = 0
        for lay in lays:  # a launch per run: each has its own bits
            n = lay.rest.shape[-1]
            if name == "kqsvd_codes_scores":
                self.td.scores(lay, a[..., at:at + n].contiguous(), out)
            else:
                out[..., at:at + n] += self.td.weigh(lay, a)
            at += n


# Layout -> (its generation, the descriptor of its buffers): a decode step
# calls the kernels twice per layer, and ctypes structures cost more to
# build than to update.  Weak: a store's descriptor goes with it.
_DESCS = weakref.WeakKeyDictionary()


def _desc(lay):
    """The descriptor of a store's quantized tokens (its Layout), made
    again only when its buffers are (generation)."""
    kept = _DESCS.get(lay)
    if kept is None or kept[0] != lay.generation:
        bufs = lay.buffers
        b, H = bufs[0].shape[:2]
        kept = (lay.generation, _Codes(b * H, 0, lay.rest.shape[-1], lay.capacity, lay.bits,
                                       lay.group, _AXES[lay.axis], *(t.data_ptr() for t in bufs)))
        _DESCS[lay] = kept
    kept[1].tokens = lay.done
    return kept[1]


_RUNS = {}  # (cols, bits) -> their ctypes arrays


def _quantize_runs(lib, x, cols, bits, group, dests):
    """Reader.quantize_runs through libkqsvd `lib`."""
    x = x.float().contiguous()
    outs = [[d if d.is_contiguous() else torch.empty_like(d) for d in dest] for dest in dests]
    ptrs = [(ctypes.c_void_p * len(outs))(*(o[i].data_ptr() for o in outs)) for i in range(3)]
    key = (tuple(cols), tuple(bits))
    if key not in _RUNS:  # the same runs at every step of a layer
        _RUNS[key] = ((ctypes.c_int64 * len(cols))(*cols), (ctypes.c_int32 * len(bits))(*bits))
    _check(lib, lib.kqsvd_codes_quantize_runs(
        x.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], len(cols), *_RUNS[key], group,
        *ptrs))
    for dest, out in zip(dests, outs):
        for d, o in zip(dest, out):
            if o is not d:
                d.copy_(o)


def quantize(x, bits, group):
    """quant.quantize(x, bits, group) through quantize_into, or None where
    the kernels do not serve x."""
    lead, n = x.shape[:-1], x.shape[-1]
    got = (torch.empty(*lead, (n + 7) // 8 * bits, dtype=torch.uint8, device=x.device),
           torch.empty(*lead, -(-n // group), dtype=torch.float16, device=x.device))
    got = (got[0], got[1], torch.empty_like(got[1]))
    return got if quantize_into(x, bits, group, got) else None


def _coded(lays, cuts):
    """The Layouts holding codes (bits 0 holds every token as it came) with
    their column ranges, and whether that is all of them."""
    got = [(lay, a, b) for lay, a, b in zip(lays, cuts, cuts[1:]) if lay.done]
    return got, len(got) == len(lays)


def _scores(rd, lays, cuts, q, out):
    """Reader.scores through rd's kernel calls."""
    q = q.float()
    coded, every = _coded(lays, cuts)
    if coded:
        qc = q if every else torch.cat([q[..., a:b] for _, a, b in coded], -1)
        rd._call("kqsvd_codes_scores", [st for st, _, _ in coded], qc.contiguous(), out,
                 out.shape[-1])
    rest = [(st, a, b) for st, a, b in zip(lays, cuts, cuts[1:])
            if st.rest is not None and st.rest.shape[-2]]
    if rest and all(st.done == rest[0][0].done for st, _, _ in rest):
        # runs in lockstep (a channel block filling up): one product
        st = rest[0][0]
        held = rest[0][0].rest if len(rest) == 1 else torch.cat([s.rest for s, _, _ in rest], -1)
        qr = q if len(rest) == len(lays) else torch.cat([q[..., a:b] for _, a, b in rest], -1)
        out[..., st.done:st.done + held.shape[-2]] += qr @ held.float().transpose(-1, -2)
    else:
        for st, a, b in rest:
            end = st.done + st.rest.shape[-2]
            out[..., st.done:end] += q[..., a:b] @ st.rest.float().transpose(-1, -2)
    return out


def _weigh(rd, lays, cuts, p):
    """Reader.weigh through rd's kernel calls."""
    p = p.float().contiguous()
    b, H, nq, N = p.shape
    coded, every = _coded(lays, cuts)
    out = torch.zeros(b, H, nq, cuts[-1], dtype=torch.float32, device=p.device)
    if coded:
        got = out if every else torch.zeros(b, H, nq, sum(b_ - a for _, a, b_ in coded),
                                            dtype=torch.float32, device=p.device)
        rd._call("kqsvd_codes_weigh", [st for st, _, _ in coded], p, got, N)
        if not every:
            at = 0
            for _, a, b_ in coded:
                out[..., a:b_] = got[..., at:at + b_ - a]
                at += b_ - a
    for st, a, b_ in zip(lays, cuts, cuts[1:]):
        if st.rest is not None and st.rest.shape[-2]:
            out[..., a:b_] += p[..., st.done:st.done + st.rest.shape[-2]] @ st.rest.float()
    return out
