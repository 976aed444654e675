"""Folding a running model's activations as the attention produces them:
the capture hooks hand each layer's queries, keys and values to the C
fold (a Calibrator) in line, or to the fold on the model's device
(TorchFold).

In line, because a worker thread that folds while the model goes on was
measured slower on the CPU (SmolLM2, 2 cores: +3 to +8% over the bare
forward pass against +2.1 to +2.2% in line): the fold's thread preempts
PyTorch's OpenMP threads, which then wait for each other."""

from ..errors import KqsvdError, UsageError
from .capture import Capture

_NAMES = {"q": "queries", "k": "keys", "v": "values"}


def fold_heads(cal, group, layer, kind, t, head_groups=1):
    """Folds one layer's rows of one kind ("q", "k" or "v"; t [heads, T,
    d]) into a Calibrator, head by head; a group's query heads share the
    KV head's factor.  With head_groups G, keys and values go a group of G
    KV heads at a time, their rows side by side ([T, G d])."""
    G = head_groups if kind != "q" else 1
    for h in range(0, t.shape[0], G):
        if kind == "q":
            cal.absorb("queries", layer, h // group, t[h], query=h % group)
        elif G == 1:
            cal.absorb(_NAMES[kind], layer, h, t[h])
        else:
            rows = t[h:h + G].transpose(0, 1).reshape(t.shape[1], -1).contiguous()
            cal.absorb(_NAMES[kind], layer, h, rows)


def fold_sequences(model, info, seqs, cal, device, on_sequence=None, rope="post", head_groups=1):
    """Runs the model over each row of seqs ([n, T] token ids) and folds
    every layer's queries and keys (after RoPE, or before it for rope
    "pre": kqsvd.calibration.capture.Capture) and its values into cal as the attention
    produces them: cal is a Calibrator (the C fold; head_groups as it was
    made with), or a TorchFold (on the model's device).  on_sequence(i)
    after each sequence."""
    import torch
    group = info.num_heads // info.num_kv_heads
    if isinstance(cal, TorchFold):
        fold = cal.absorb
    else:  # the C fold reads host memory: rows of a model on a GPU come over
        def fold(layer, kind, t):
            fold_heads(cal, group, layer, kind, t.cpu(), head_groups)

    def sink(layer, kind, t):  # t: [1, heads, T, d], each head's rows contiguous
        fold(layer, kind, t[0].detach())

    cap = Capture(model, info.model_type, model.config, sink, rope, compute="sdpa")
    try:
        for i, row in enumerate(seqs):
            with torch.no_grad():
                model(input_ids=torch.from_numpy(row[None]).to(device), use_cache=False)
            if isinstance(cal, TorchFold):
                cal.flush()
            if on_sequence:
                on_sequence(i)
    finally:
        cap.close()


class TorchFold:
    """The fold on the model's device: each (layer, KV head)'s factors of
    keys, stacked queries and values kept in float64 where the model runs,
    updated once per window for every layer and KV head together, rows
    never leaving the device.  method "qr" (Householder, the reference):
    torch.linalg.qr of [R; rows], batched; "gram": Gram matrices C += X^T X
    by batched float64 matmuls (FP64 tensor cores on a GPU), half the flops
    of QR and a few large calls, whose singular values below about 1e-8 of
    the largest are lost (docs/benchmarks.md states the bound measured).
    With head_groups G, keys and values fold G heads side by side (G d
    wide) and each KV head's queries into its own d x d block, as the C
    fold does.  into() hands each factor to a Calibrator as rows whose R
    factor it is (the R factor of R is R), which then reduces, solves and
    writes as usual.

    absorb() keeps a layer's rows until flush(), which folds a window's in
    calls of at most `batch_bytes` of float64 rows each; fold_sequences
    flushes after every window."""

    KINDS = {"k": 0, "v": 1, "q": 2}
    NAMES = ("keys", "values", "queries")
    METHODS = ("qr", "gram")

    def __init__(self, info, device, method="qr", head_groups=1, batch_bytes=1 << 30):
        import torch
        if method not in self.METHODS:
            raise UsageError(f"TorchFold: method must be one of {', '.join(self.METHODS)}, "
                             f"not {method!r}")
        if head_groups < 1 or info.num_kv_heads % head_groups:
            raise UsageError(f"TorchFold: head_groups = {head_groups} does not divide the "
                             f"{info.num_kv_heads} KV heads")
        self.method, self.G, self.batch_bytes = method, head_groups, batch_bytes
        self.L, self.hkv, self.d = info.num_layers, info.num_kv_heads, info.head_dim
        w = self.d * head_groups
        f64 = dict(dtype=torch.float64, device=device)
        # keys and values per (layer, group), G d wide; queries per (layer, KV head)
        self.F = [torch.zeros(self.L, self.hkv // head_groups, w, w, **f64),
                  torch.zeros(self.L, self.hkv // head_groups, w, w, **f64),
                  torch.zeros(self.L, self.hkv, self.d, self.d, **f64)]
        self.pending = [{}, {}, {}]

    def absorb(self, layer, kind, t):
        """t: [heads, T, d] of one layer (query heads of a group adjacent),
        kept until flush()."""
        self.pending[self.KINDS[kind]][layer] = t

    def _rows(self, k, t):
        """[heads, T, d] of one layer -> the factors' rows [items, rows, width]
        (a view where the layout allows)."""
        h, T, d = t.shape
        if k == 2:  # a KV head's query heads stacked
            return t.reshape(self.hkv, -1, d)
        G = self.G  # a group's heads side by side
        return t.reshape(h // G, G, T, d).transpose(1, 2).reshape(h // G, T, G * d)

    def _raise_bad(self, kept):
        """The first NaN or Inf of a flush, named as the C fold names it."""
        import torch
        for k in range(3):
            for layer in sorted(kept[k]):
                t = kept[k][layer]
                bad = ~torch.isfinite(t)
                if bool(bad.any()):
                    h, row, _ = bad.nonzero()[0].tolist()
                    m = t.shape[0] // self.hkv if k == 2 else 1
                    raise KqsvdError(f"{self.NAMES[k]}: NaN or Inf at layer {layer}, KV head "
                                     f"{h // m}, row {row + (h % m) * t.shape[1]} of the head's rows")

    def flush(self):
        """Folds every layer's kept rows: each call converts a few layers'
        rows to float64 (one pass, no copy in the model's precision) and
        updates their factors in place, so that a window costs a few large
        GEMMs (gram) or batched QRs, and one wait for the NaN check.  A
        window with a NaN or Inf raises KqsvdError naming it, its factors
        spoiled (the command stops; nothing is written)."""
        import torch
        kept, self.pending = self.pending, [{}, {}, {}]
        flags = []
        for k in range(3):
            layers = sorted(kept[k])
            if not layers:
                continue
            first = self._rows(k, kept[k][layers[0]])
            per = max(1, self.batch_bytes // (first.numel() * 8))
            for a in range(0, len(layers), per):
                some = layers[a:a + per]
                X = torch.empty((len(some),) + tuple(first.shape), dtype=torch.float64,
                                device=first.device)
                for i, layer in enumerate(some):
                    X[i].copy_(self._rows(k, kept[k][layer]))
                F = self.F[k]
                contiguous = some == list(range(some[0], some[-1] + 1))
                if self.method == "gram" and contiguous:  # C += X^T X in place
                    w = X.shape[-1]
                    Xb = X.view(-1, X.shape[-2], w)
                    F[some[0]:some[-1] + 1].view(-1, w, w).baddbmm_(Xb.transpose(1, 2), Xb)
                elif self.method == "gram":
                    idx = torch.tensor(some, device=X.device)
                    F.index_add_(0, idx, X.transpose(-1, -2) @ X)
                else:
                    idx = torch.tensor(some, device=X.device)
                    F.index_copy_(0, idx, torch.linalg.qr(torch.cat([F[idx], X], dim=-2),
                                                          mode="r")[1])
                # A NaN or Inf in the rows reaches the factors' diagonals:
                # checked there, on a few numbers, with one wait per flush.
                flags.append(torch.isfinite(F[some].diagonal(dim1=-2, dim2=-1)).all())
        if flags and not bool(torch.stack(flags).all()):
            self._raise_bad(kept)

    def factor(self, kind, layer, g):
        """The R factor (CPU numpy, upper triangular) of keys or values of
        the group whose first KV head is g, or of KV head g's queries."""
        import numpy as np
        self.flush()
        k = self.KINDS[kind]
        M = self.F[k][layer, g if k == 2 else g // self.G].cpu().numpy()
        if self.method == "qr":
            return M
        try:  # Cholesky where the Gram matrix is numerically positive definite
            return np.ascontiguousarray(np.linalg.cholesky(M).T)
        except np.linalg.LinAlgError:  # rank-deficient or zero heads: not an error
            lam, V = np.linalg.eigh(M)
            R = np.linalg.qr(np.sqrt(np.clip(lam, 0, None))[:, None] * V.T, mode="r")
            return R * np.where(np.diag(R) < 0, -1.0, 1.0)[:, None]

    def _each(self):
        """(kind, layer, head) of every factor: a group's first KV head for
        keys and values, every KV head for queries."""
        for kind in ("k", "v", "q"):
            for layer in range(self.L):
                for g in range(0, self.hkv, 1 if kind == "q" else self.G):
                    yield kind, layer, g

    def into(self, cal):
        """Adds every factor to cal (a Calibrator of the same head_groups;
        empty for the result to be exactly these factors)."""
        for kind, layer, g in self._each():
            cal.absorb(self.NAMES[self.KINDS[kind]], layer, g, self.factor(kind, layer, g))

    def load(self, cal):
        """Takes cal's factors (a loaded checkpoint) as the starting point."""
        import torch
        self.flush()
        for kind, layer, g in self._each():
            k = self.KINDS[kind]
            R = torch.from_numpy(cal.factor(self.NAMES[k], layer, g))
            self.F[k][layer, g if k == 2 else g // self.G] = R.T @ R if self.method == "gram" else R
