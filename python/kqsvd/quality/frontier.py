"""Quality per byte, every configuration scored the same way: each window's
first `context` tokens are prefilled into the configuration's cache (which
compresses them its own way), then the rest is fed token by token (or
`chunk` at a time) with that cache, each step at its explicit position
(an eviction press keeps fewer tokens than it has seen); the continuation's
tokens are scored against the full model, which runs the same protocol
once per window.  Bytes are the cache's after the prefill (the context as
held) and at the window's end, values held unquantized counted at 2 bytes
(bf16), codes and scales as stored."""
import math

from ..compat import cache_kwarg, output_cache
from .configs import Config
from .intervals import paired_ratio, units
from .tally import Tally


def continue_window(model, ids, context, config, chunk=1):
    """One window (int64 [1, T]) through one configuration: returns
    (float64 log-probabilities [T - context, V] of the continuation's
    tokens, bytes after the prefill, bytes at the end)."""
    import torch
    T = ids.shape[1]
    key = cache_kwarg(model)  # past_key_values, or cache from transformers 5.24 on
    with config.window(model):
        cache = config.cache(model)
        with config.prefill(model):
            out = model(input_ids=ids[:, :context], use_cache=True, **{key: cache})
        cache = output_cache(out)
        first = config.nbytes(cache)
        logits = [out.logits[0, -1:]]
        for t in range(context, T - 1, chunk):
            e = min(t + chunk, T - 1)
            pos = torch.arange(t, e, device=ids.device)[None]
            out = model(input_ids=ids[:, t:e], use_cache=True, position_ids=pos, **{key: cache})
            cache = output_cache(out)
            logits.append(out.logits[0])
        last = config.nbytes(cache)
    return torch.log_softmax(torch.cat(logits).double(), -1), first, last


def score(model, seqs, context, configs, chunk=1, progress=None):
    """Scores every configuration on the windows seqs (int64 [n, T]) against
    the full model.  Returns (full, [result per configuration]), each a
    dict of perplexity, nll, kl, top1 (not for full), bytes_context,
    bytes_end, unit_nll (the NLL summed over each unit of scored tokens,
    intervals.units) and, for the configurations, kept (bytes_context
    over the full model's), kept_end and ratio_interval (the perplexity
    ratio's paired bootstrap interval against the full model).  Not
    collective."""
    import torch
    full, tallies = _Sums(), [_Sums() for _ in configs]
    dev = next(model.parameters()).device
    with torch.no_grad():
        for row in seqs:
            ids = torch.from_numpy(row[None]).to(dev)
            targets = ids[0, context:]
            ref, a, b = continue_window(model, ids, context, Config(), chunk)
            full.add(ref, targets, None, a, b)
            if progress:
                progress()
            for c, t in zip(configs, tallies):
                logp, a, b = continue_window(model, ids, context, c, chunk)
                t.add(logp, targets, ref, a, b)
                if progress:
                    progress()
    base = full.result()
    out = []
    for t in tallies:
        r = t.result()
        r["kept"] = r["bytes_context"] / base["bytes_context"]
        r["kept_end"] = r["bytes_end"] / base["bytes_end"]
        # Each window's perplexity over the full model's on it: the spread
        # between windows, stated beside the pooled ratio.
        r["ratio_windows"] = [math.exp(a - b) for a, b in zip(t.window_nll, full.window_nll)]
        r["ratio_interval"] = list(paired_ratio(t.unit_nll, full.unit_nll, full.unit_tokens)[1:])
        out.append(r)
    return base, out


class _Sums(Tally):
    """A Tally with the bytes after the prefill and at the end (the
    largest over the windows, which all have one length), and each window's
    mean NLL and KL."""
    first = last = 0

    def __init__(self):
        super().__init__()
        self.window_nll, self.window_kl = [], []
        self.unit_nll, self.unit_tokens = [], []

    def add(self, logp, targets, ref=None, first=0, last=0):
        nll, kl, n = self.nll, self.kl, self.tokens
        super().add(logp, targets, ref)
        sums, counts = units((-logp.gather(1, targets[:, None])[:, 0]).tolist())
        self.unit_nll += sums
        self.unit_tokens += counts
        self.window_nll.append((self.nll - nll) / (self.tokens - n))
        self.window_kl.append((self.kl - kl) / (self.tokens - n))
        self.first, self.last = max(self.first, first), max(self.last, last)

    def result(self):
        r = super().result()
        r.pop("cache_bytes", None)
        r.update(bytes_context=self.first, bytes_end=self.last,
                 perplexity_windows=[math.exp(x) for x in self.window_nll],
                 unit_nll=list(self.unit_nll), unit_tokens=list(self.unit_tokens))
        if self.compared:
            r["kl_windows"] = list(self.window_kl)
        return r


def pareto(points):
    """Indices of the points (kept, perplexity) on the front: no other
    keeps as few bytes or fewer with a lower perplexity."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1]))
    front, best = [], math.inf
    for i in order:
        if points[i][1] < best:
            front.append(i)
            best = points[i][1]
    return sorted(front)
