"""Folding a running model's activations into a Calibrator: the capture
hooks hand each layer's queries, keys and values over as the attention
produces them, and a worker thread folds them while the model goes on
(the C fold releases the GIL), in the order they came, so the result is
the same as folding them in line."""
import queue
import threading


class AsyncFolder:
    """Runs fold calls in one worker thread, first in, first out.  At most
    `depth` calls wait (each holds its tensor alive), so memory stays
    bounded when the fold is slower than the model.  The first failure is
    raised by the next submit(), or by drain()."""

    def __init__(self, depth=64):
        self.q = queue.Queue(maxsize=depth)
        self.error = None
        self.worker = threading.Thread(target=self._work, daemon=True)
        self.worker.start()

    def _work(self):
        while True:
            item = self.q.get()
            try:
                if item is None:
                    return
                if self.error is None:
                    item[0](*item[1])
            except BaseException as e:  # noqa: BLE001 - handed to the model's thread
                self.error = e
            finally:
                self.q.task_done()

    def submit(self, fn, *args):
        if self.error is not None:
            raise self.error
        self.q.put((fn, args))

    def drain(self):
        """Waits until every submitted call has run; raises the first error."""
        self.q.join()
        if self.error is not None:
            raise self.error

    def close(self):
        self.q.put(None)
        self.worker.join()


def fold_sequences(model, info, seqs, cal, device, on_sequence=None, folder=None):
    """Runs the model over each row of seqs ([n, T] token ids) and folds
    every layer's post-RoPE queries and keys and its values into cal as
    the attention produces them: cal is a Calibrator (the C fold), or a
    TorchFold (on the model's device).  on_sequence(i) after each sequence,
    when everything of it is folded.  folder: an AsyncFolder (None: fold
    in line)."""
    import torch
    from .capture import Capture
    group = info.num_heads // info.num_kv_heads
    names = {"q": "queries", "k": "keys", "v": "values"}

    def fold(layer, kind, t):
        if isinstance(cal, TorchFold):
            cal.absorb(layer, kind, t)
            return
        for h in range(t.shape[0]):
            if kind == "q":
                cal.absorb("queries", layer, h // group, t[h], query=h % group)
            else:
                cal.absorb(names[kind], layer, h, t[h])

    def sink(layer, kind, t):  # t: [1, heads, T, d], each head's rows contiguous
        t = t[0].detach()
        if folder:
            folder.submit(fold, layer, kind, t)
        else:
            fold(layer, kind, t)

    cap = Capture(model, info.model_type, model.config, sink)
    try:
        for i, row in enumerate(seqs):
            with torch.no_grad():
                model(input_ids=torch.from_numpy(row[None]).to(device), use_cache=False)
            if folder:
                folder.drain()
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
        self.group = info.num_heads // info.num_kv_heads
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
            from .errors import KqsvdError
            raise KqsvdError(f"{self.NAMES[k]}: NaN or Inf at layer {layer}, KV head {bad[0]}, "
                             f"row {bad[1]} of the head's rows")
        self.R[k, layer] = torch.linalg.qr(torch.cat([self.R[k, layer], rows], dim=1), mode="r")[1]

    def into(self, cal):
        """Adds every factor to cal (a Calibrator; empty for the result to
        be exactly these factors)."""
        R = self.R.cpu()
        for k in range(3):
            for layer in range(R.shape[1]):
                for g in range(R.shape[2]):
                    cal.absorb(self.NAMES[k], layer, g, R[k, layer, g])

    def load(self, cal):
        """Takes cal's factors (a loaded checkpoint) as the starting point."""
        import torch
        for k in range(3):
            for layer in range(self.R.shape[1]):
                for g in range(self.R.shape[2]):
                    self.R[k, layer, g] = torch.from_numpy(cal.factor(self.NAMES[k], layer, g))
