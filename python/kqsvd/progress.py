"""A progress line on stderr: a live bar on a terminal, a line per tenth of
the work otherwise (job logs)."""
import sys
import time


class Progress:
    def __init__(self, label, total, unit="tok"):
        self.label, self.total, self.unit = label, max(int(total), 1), unit
        self.t0, self.done, self.shown = time.time(), 0, -1

    def advance(self, n=1, note=""):
        self.done = min(self.done + n, self.total)
        elapsed = time.time() - self.t0
        rate = self.done / max(elapsed, 1e-9)
        text = f"{self.done}/{self.total} {self.unit}  {rate:,.1f} {self.unit}/s"
        left = (self.total - self.done) / rate if rate > 0 else 0.0
        text += f"  took {elapsed:.0f} s" if self.done == self.total else f"  ETA {left:.0f} s"
        if note:
            text += f"  {note}"
        if sys.stderr.isatty():
            bar = "#" * int(30 * self.done / self.total)
            end = "\n" if self.done == self.total else ""
            print(f"\r{self.label} [{bar:<30}] {text}\033[K", end=end, file=sys.stderr, flush=True)
        else:
            tenth = (10 * self.done) // self.total
            if tenth != self.shown:
                self.shown = tenth
                print(f"{self.label}: {text}", file=sys.stderr, flush=True)
