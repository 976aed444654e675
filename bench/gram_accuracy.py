#!/bin/sh
"true" '''\'
# Runs with the repository's .venv (scripts/hf-env.sh), else python3.
me=$(readlink -f "$0"); v="$(dirname "$me")/../.venv/bin/python3"
[ -x "$v" ] || v=python3; exec "$v" "$me" "$@"
'''
HELP = """How far the Gram fold (--qr gram) is from Householder's on real data:
two projection files of the same model and tokens, one made with each,
compared.  Prints the condition numbers of the keys, queries and values
(sigma_max / sigma_min of each head's rows, from the files' spectra), the
largest relative difference of each method's projections, and of the
attention-score spectrum sigma(R_K R_Q^T) and the optimal tail energy at
ranks d/4, d/2 and 3d/4 that KQ-SVD's error equals.

    bench/gram_accuracy.py TSQR.h5 GRAM.h5
"""
import os
import sys

import h5py
import numpy as np


def main(argv):
    if len(argv) != 2:
        print(HELP, file=sys.stderr)
        return 2
    for path in argv:  # HDF5's open() of a FIFO waits for a writer forever
        if not os.path.isfile(path):
            print(f"gram_accuracy.py: {path}: no such file, or not a regular file",
                  file=sys.stderr)
            return 1
    with h5py.File(argv[0], "r") as a, h5py.File(argv[1], "r") as b:
        print(f"{argv[0]} against {argv[1]}: {a.attrs.get('model')}, "
              f"{int(a.attrs.get('tokens', 0))} tokens\n")
        print("| rows | condition number: median | 90th percentile | largest |")
        print("| --- | ---: | ---: | ---: |")
        for name in ("K", "Q", "V"):
            s = a["spectra"][name][...]
            cond = (s[..., 0] / np.where(s[..., -1] > 0, s[..., -1], np.nan)).ravel()
            print(f"| {name} | {np.nanmedian(cond):.3g} | {np.nanpercentile(cond, 90):.3g} | "
                  f"{np.nanmax(cond):.3g} |")
        print("\n| dataset | largest relative difference, gram against tsqr |")
        print("| --- | ---: |")
        for g in ("kqsvd", "ksvd", "eigen"):
            for k in ("key_down", "query_down", "value_down", "value_up"):
                x, y = a[g][k][...], b[g][k][...]
                print(f"| {g}/{k} | {np.abs(x - y).max() / np.abs(x).max():.2e} |")
        for name in ("KQt", "VWo"):
            x, y = a["spectra"][name][...], b["spectra"][name][...]
            d = x.shape[-1]
            rel = np.abs(x - y).max() / np.abs(x).max()
            tails = []
            for r in (d // 4, d // 2, 3 * d // 4):
                tx = np.sqrt((x[..., r:] ** 2).sum(-1) / (x ** 2).sum(-1))
                ty = np.sqrt((y[..., r:] ** 2).sum(-1) / (y ** 2).sum(-1))
                tails.append(f"rank {r}: {np.abs(tx - ty).max():.1e}")
            print(f"| spectra/{name} | {rel:.2e}; optimal tail (of the norm) differs by "
                  f"{', '.join(tails)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
