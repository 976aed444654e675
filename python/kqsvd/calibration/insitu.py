"""Folding a running model's activations as the attention produces them:
the capture hooks hand each layer's queries, keys and values to the C
fold (a Calibrator) in line, or to the fold on the model's device
(TorchFold).

In line, because a worker thread that folds while the model goes on was
measured slower on the CPU (SmolLM2, 2 cores: +3 to +8% over the bare
forward pass against +2.1 to +2.2% in line): the fold's thread preempts
PyTorch's OpenMP threads, which then wait for each other."""


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
    from .capture import Capture
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
            if on_sequence:
                on_sequence(i)
    finally:
        cap.close()


class TorchFold:
    """The fold on the model's device: each (layer, KV head)'s R factors of
    keys, stacked queries and values kept in float64 where the model runs
    and updated with torch.linalg.qr of [R; rows], batched over the KV heads
    (cuSOLVER on a GPU; LAPACK on the CPU, where it serves as a check of
    this path).  Rows never leave the device; into() hands each d x d
    factor to a Calibrator as d rows (the R factor of R is R), which then
    reduces, solves and writes as usual."""

    KINDS = {"k": 0, "v": 1, "q": 2}
    NAMES = ("keys", "values", "queries")

    def __init__(self, info, device):
        import torch
        self.R = torch.zeros(3, info.num_layers, info.num_kv_heads, info.head_dim, info.head_dim,
                             dtype=torch.float64, device=device)

    def absorb(self, layer, kind, t):
        """t: [heads, T, d] of one layer (query heads of a group adjacent)."""
        import torch
        k = self.KINDS[kind]
        hkv, d = self.R.shape[2], self.R.shape[3]
        rows = t.reshape(hkv, -1, d).to(torch.float64)  # a group's query heads stacked
        if not bool(torch.isfinite(rows).all()):
            bad = (~torch.isfinite(rows)).nonzero()[0].tolist()
            from ..errors import KqsvdError
            raise KqsvdError(f"{self.NAMES[k]}: NaN or Inf at layer {layer}, KV head {bad[0]}, "
                             f"row {bad[1]} of the head's rows")
        self.R[k, layer] = torch.linalg.qr(torch.cat([self.R[k, layer], rows], dim=1), mode="r")[1]

    def _each(self):
        """(kind index, layer, KV head) of every factor."""
        for k in range(3):
            for layer in range(self.R.shape[1]):
                for g in range(self.R.shape[2]):
                    yield k, layer, g

    def into(self, cal):
        """Adds every factor to cal (a Calibrator; empty for the result to
        be exactly these factors)."""
        R = self.R.cpu()
        for k, layer, g in self._each():
            cal.absorb(self.NAMES[k], layer, g, R[k, layer, g])

    def load(self, cal):
        """Takes cal's factors (a loaded checkpoint) as the starting point."""
        import torch
        for k, layer, g in self._each():
            self.R[k, layer, g] = torch.from_numpy(cal.factor(self.NAMES[k], layer, g))
