"""One layer's decode kernels (kqsvd_codes_scores and kqsvd_codes_weigh,
include/kqsvd/decode.h) on the layout of SmolLM2's head-group quarter
after RoPE: keys of 181 columns per channel in runs of 2, 3, 4 and 8 bits,
values of 187 per token, groups of 32, 9 query heads, through the Python
stores (attention/quant.py), once per instruction set.

    .venv/bin/python3 bench/decode_kernels.py [--tokens 8192] [--threads 2]

Prints the best of 5 means of 200 calls, in ms, for each set that this
machine runs (KQSVD_ISA picks it, as for the QR)."""
import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEYS = [(140, 2), (20, 3), (15, 4), (6, 8)]     # (columns, bits) per run
VALUES = [(150, 2), (20, 3), (11, 4), (6, 8)]


def one(tokens, threads):
    """(scores ms, sums ms) in this process, its KQSVD_ISA."""
    sys.path.insert(0, os.path.join(ROOT, "python"))
    import torch
    from kqsvd.attention.quant import store
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    keys, values = store(KEYS, 32, "channel"), store(VALUES, 32, "token")
    keys.append(torch.randn(1, 1, tokens, sum(c for c, _ in KEYS)), False)
    values.append(torch.randn(1, 1, tokens, sum(c for c, _ in VALUES)), False)
    q = torch.randn(1, 1, 9, sum(c for c, _ in KEYS))
    out = torch.zeros(1, 1, 9, tokens)
    p = torch.softmax(torch.randn(1, 1, 9, tokens), -1)

    def best(f):
        f()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(200):
                f()
            times.append((time.perf_counter() - t0) / 200 * 1e3)
        return min(times)
    return best(lambda: keys.scores(q, out.zero_())), best(lambda: values.weigh(p))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.tokens < 1 or a.threads < 1:
        ap.error("--tokens and --threads at least 1")
    if a.one:
        print(*one(a.tokens, a.threads))
        return 0
    print(f"{'set':<8}{'scores ms':>11}{'sums ms':>10}   ({a.tokens} tokens, {a.threads} threads)")
    for isa in ("base", "avx2", "avx512"):
        p = subprocess.run([sys.executable, __file__, "--one", "--tokens", str(a.tokens),
                            "--threads", str(a.threads)], capture_output=True, text=True,
                           env=dict(os.environ, KQSVD_ISA=isa))
        if p.returncode:  # a set this machine does not run: the library refuses it
            print(f"{isa:<8}{'-':>11}{'-':>10}   {p.stderr.strip().splitlines()[-1][:60]}")
            continue
        s, w = (float(x) for x in p.stdout.split())
        print(f"{isa:<8}{s:>11.3f}{w:>10.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
