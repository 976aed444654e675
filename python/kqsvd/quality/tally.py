"""Sums over the scored tokens of one configuration: negative
log-likelihood, KL and top-1 agreement against the full model, cache
bytes (the largest a configuration's caches referenced, measured by
attention.cache_bytes), and probe errors; for the quality command (measure.py) and the
frontier (frontier.py) alike."""
import math


class Tally:
    """Sums over the scored tokens of one configuration."""

    def __init__(self):
        self.nll = self.kl = self.top1 = self.tokens = 0.0
        self.cache_bytes = 0
        self.probe = None
        self.compared = False

    def add(self, logp, targets, ref=None):
        self.nll -= float(logp.gather(1, targets[:, None]).sum())
        self.tokens += targets.numel()
        if ref is not None:
            self.compared = True
            self.kl += float((ref.exp() * (ref - logp)).sum())
            self.top1 += float((ref.argmax(1) == logp.argmax(1)).sum())

    def add_probe(self, errs):
        if self.probe is None:
            self.probe = [[] for _ in errs]
        for l, e in enumerate(errs):
            self.probe[l].extend(e)

    def result(self):
        n = max(self.tokens, 1)
        out = {"perplexity": math.exp(self.nll / n), "nll": self.nll / n,
               "cache_bytes": self.cache_bytes}
        if self.compared:  # KL and top-1 against the full model
            out.update(kl=self.kl / n, top1=self.top1 / n)
        if self.probe:
            for i, k in enumerate(("err_kq", "err_out")):
                per = [sum(e[i] for e in errs) / len(errs) for errs in self.probe]
                out[k] = {"layers": per, "mean": sum(per) / len(per)}
        return out
