#!/usr/bin/env python3
"""Renders the paper's figures from `kqsvd evaluate --json` reports.

    examples/plot_reports.py REPORT.json [REPORT-beta*.json ...] --out DIR

DIR/figure1.png   the first report: err_out per layer for the three methods
                  (top) and the mean err_k, err_q, err_v, err_kq and err_out
                  of each method (bottom), as in the paper's Figure 1.
DIR/figure2.png   with reports at two or more values of beta (calibrate
                  --beta, see examples/sweep_beta.sh): mean err_out against
                  beta, as in the paper's Figure 2.

Needs matplotlib (Debian: python3-matplotlib).  When the python3 first on
PATH (pyenv, a venv) lacks it, the script runs again with $KQSVD_PYTHON or
/usr/bin/python3, where Debian's python3-* packages live.
"""
import argparse
import json
import os
import sys

from _python import rerun_elsewhere

METHODS = ("kqsvd", "ksvd", "eigen")
LABELS = {"kqsvd": "KQ-SVD", "ksvd": "K-SVD", "eigen": "Eigen"}
COLORS = {"kqsvd": "#d62728", "ksvd": "#1f77b4", "eigen": "#2ca02c"}
METRICS = ("err_k", "err_q", "err_v", "err_kq", "err_out")
METRIC_LABELS = ("K", "Q", "V", "$QK^T$", "output")


def load(path):
    try:
        with open(path) as f:
            r = json.load(f)
        for m in METHODS:
            for k in METRICS:
                float(r["methods"][m]["mean"][k])
        return r
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"plot_reports: {path}: not a kqsvd evaluation report ({e})")


def figure1(plt, ticker, rep, path):
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7.5, 7.5))
    layers = [x["layer"] for x in rep["methods"]["kqsvd"]["layers"]]
    for m in METHODS:
        top.plot(layers, [x["err_out"] for x in rep["methods"][m]["layers"]], marker="o",
                 markersize=3, color=COLORS[m], label=LABELS[m])
    top.set_yscale("log")
    top.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
    top.set_xlabel("layer")
    top.set_ylabel("relative output error")
    top.grid(True, which="both", alpha=0.3)
    top.legend()
    policy = rep.get("rank_policy", "")
    top.set_title(f"{rep['model']}: {rep['sequences']} validation sequences"
                  + (f", ranks {policy}" if policy else ""), fontsize=10)
    width = 0.26
    for i, m in enumerate(METHODS):
        vals = [rep["methods"][m]["mean"][k] for k in METRICS]
        bottom.bar([j + (i - 1) * width for j in range(len(METRICS))], vals, width,
                   color=COLORS[m], label=LABELS[m])
    bottom.set_xticks(range(len(METRICS)))
    bottom.set_xticklabels(METRIC_LABELS)
    bottom.set_yscale("log")
    # Labels at 2, 3 and 5 within each decade too: bars span about one.
    bottom.yaxis.set_minor_locator(ticker.LogLocator(subs=(2.0, 3.0, 5.0)))
    bottom.yaxis.set_minor_formatter(ticker.FormatStrFormatter("%g"))
    bottom.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
    bottom.set_ylabel("mean relative error over layers")
    bottom.grid(True, axis="y", which="both", alpha=0.3)
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def figure2(plt, ticker, reps, path):
    # One report per beta (the first given), in order of beta.
    by_beta = {}
    for r in reps:
        by_beta.setdefault(r.get("beta", 1.0), r)
    betas = sorted(by_beta)
    reps = [by_beta[b] for b in betas]
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for m in METHODS:
        ax.plot(betas, [r["methods"][m]["mean"]["err_out"] for r in reps], marker="o",
                color=COLORS[m], label=LABELS[m])
    ax.set_xscale("log")
    ax.xaxis.set_minor_locator(ticker.NullLocator())
    ax.set_xticks(betas)
    ax.xaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
    ax.set_xlabel(r"unbalance $\beta$ (keys $\times\beta$, queries $/\beta$)")
    ax.set_ylabel("mean relative output error")
    ax.set_title(f"{reps[0]['model']}: output error against unbalance", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("reports", nargs="+", help="JSON reports of kqsvd evaluate")
    ap.add_argument("--out", required=True, help="folder for the PNG files")
    a = ap.parse_args()
    reps = [load(p) for p in a.reports]
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker as ticker
    except ImportError:
        rerun_elsewhere(__file__)
        raise SystemExit("plot_reports: needs matplotlib (Debian: apt-get install python3-matplotlib)")
    os.makedirs(a.out, exist_ok=True)
    written = [os.path.join(a.out, "figure1.png")]
    figure1(plt, ticker, reps[0], written[0])
    if len({r.get("beta", 1.0) for r in reps}) >= 2:
        written.append(os.path.join(a.out, "figure2.png"))
        figure2(plt, ticker, reps, written[1])
    elif len(reps) > 1:
        print("plot_reports: the reports share one beta; figure2.png needs several", file=sys.stderr)
    print("wrote " + ", ".join(written))


if __name__ == "__main__":
    main()
