"""The largest batch whose cache fits a memory budget, as measured: what
bench/decode_speed.py --cache-budget and bench/gpu_decode.py
--cache-budget share.

A cache's bytes are measured after a run (kqsvd.cache_bytes: the storage
it references, its buffers' room included), never computed from a
formula.  The search runs batch 1 for its size only, then guesses the
largest batch from a line through the sizes measured so far (a cache's
bytes are a fixed part plus a part per row), runs that batch in full and
measures it, and goes on until a batch that was run fits and the line
puts one more row over the budget.  So the answer is a batch that ran and
fit; its neighbour above is judged by the line through two measured
points, which costs no run of its own (at 8k tokens on a CPU, one row's
prefill is tens of seconds)."""
import math


class Search:
    """The batches tried for one configuration and what each measured.

    run(batch, probe) runs one batch and returns its row, a dict with the
    measured 'cache_bytes' (probe=True: only the size is wanted, the run
    may be short); a row with 'error' (memory ran out) is a batch too
    large, the next tried halfway below it.  budget: bytes.
    most: the largest batch tried (a run at a million rows is a typo)."""

    def __init__(self, run, budget, most=4096, tries=8):
        self.run, self.budget, self.most, self.tries = run, budget, most, tries
        self.sizes = {}  # batch -> measured bytes, probes included
        self.best = None  # (batch, row) of the largest full run that fit
        self.error, self.failed = None, None  # the last failure, and its batch

    def line(self):
        """(fixed bytes, bytes per row) through the two largest batches
        measured (through 0 with one)."""
        b = sorted(self.sizes)[-2:]
        if len(b) == 1:
            return 0.0, self.sizes[b[0]] / b[0]
        per = (self.sizes[b[1]] - self.sizes[b[0]]) / (b[1] - b[0])
        return self.sizes[b[1]] - per * b[1], per

    def guess(self):
        base, per = self.line()
        if per <= 0:  # a size that does not grow with the batch: no line to follow
            return self.most
        return max(1, min(self.most, math.floor((self.budget - base) / per)))

    def next_bytes(self):
        """The bytes of one row more than the best batch: measured where
        that batch ran, else the line's."""
        b = self.best[0] + 1
        if b in self.sizes:
            return self.sizes[b]
        base, per = self.line()
        return base + per * b

    def __call__(self):
        """Runs the search; returns self (best None where batch 1 does not
        fit, or failed: see error)."""
        first = self.run(1, True)
        if "error" in first:
            self.error = first["error"]
            return self
        self.sizes[1] = first["cache_bytes"]
        if self.sizes[1] > self.budget:
            return self
        hi = self.most + 1  # the smallest batch known not to fit, or to fail
        for _ in range(self.tries):
            lo = self.best[0] if self.best else 0
            if self.best and (hi == lo + 1 or self.next_bytes() > self.budget):
                break  # measured, or the line puts one row more over the budget
            b = max(lo + 1, min(hi - 1, self.guess()))
            if self.failed:  # memory ran out above: halve the gap below it
                b = max(lo + 1, min(b, (lo + self.failed) // 2))
            row = self.run(b, False)
            if "error" in row:
                self.error, self.failed, hi = row["error"], min(b, self.failed or b), min(hi, b)
                continue
            self.sizes[b] = row["cache_bytes"]
            if row["cache_bytes"] <= self.budget:
                self.best = (b, row)
            else:
                hi = min(hi, b)
        return self

    def row(self):
        """The best run's row with the search's figures (budget, batches
        tried and their sizes, the next batch's bytes by the line), or a
        row saying why there is none."""
        out = dict(budget_bytes=self.budget,
                   tried={str(b): s for b, s in sorted(self.sizes.items())})
        if self.best is None:
            why = self.error or (f"batch 1's cache is {self.sizes[1] / 2**20:.1f} MiB, over "
                                 f"the budget of {self.budget / 2**20:.1f} MiB")
            return dict(out, batch=0, error=why)
        b, row = self.best
        base, per = self.line()
        nxt = self.next_bytes()
        # confirmed: the line puts one row more over the budget (not so only
        # where the tries ran out, or at `most`)
        out.update(row, batch=b, bytes_per_row=per, next_batch_bytes=nxt,
                   largest_confirmed=nxt > self.budget)
        if self.error:
            out["error_above"] = self.error  # a larger batch failed to run
        return out


def largest_batch(run, budget, most=4096):
    """Search(run, budget, most)()'s row: the largest batch whose
    measured cache fits `budget` bytes, with its run's figures."""
    return Search(run, budget, most)().row()
