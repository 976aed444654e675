#!/usr/bin/python3
"""kqsvd calibrate against its peers and the machine's limits, on synthetic
sets of growing size.  One command:

    bench/calibrate_bench.py            # 16 k .. 262 k tokens per head, about 20 minutes here
    bench/calibrate_bench.py --quick    # 16 k .. 64 k, about 3 minutes

For each size it makes a set with `kqsvd synth` (d = 128, GQA; kept in
data/bench for later runs) and times, on the same files:
  - kqsvd calibrate on 1 and on --np ranks (TSQR, the default),
  - kqsvd calibrate --qr gram and --qr scalapack on --np ranks,
  - bench/inmemory_pipeline.py, the authors' in-memory PyTorch approach,
    with 1 thread (and --np threads at the largest size); its singular values
    are checked against kqsvd's output.
It also measures OpenBLAS dgemm on 1 and --np threads and the raw read rate
of the largest set's files.  The table is printed and written into
docs/benchmarks.md between the `calibrate-bench` markers, with the command.
Needs build/kqsvd and build/kqsvd_bench_machine (./scripts/bootstrap.sh).
"""
import argparse
import datetime
import glob
import json
import os
import re
import shlex
import subprocess
import sys
import time

import h5py
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD = os.environ.get("KQSVD_BUILD", os.path.join(ROOT, "build"))
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           OMPI_MCA_rmaps_base_oversubscribe="1", OPENBLAS_NUM_THREADS="1")
BEGIN, END = "<!-- calibrate-bench:begin -->", "<!-- calibrate-bench:end -->"


def sh(cmd, env=None):
    """Runs cmd; returns (seconds, stdout, stderr); exits with its output on failure."""
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env or ENV)
    dt = time.perf_counter() - t0
    if p.returncode != 0:
        sys.exit(f"calibrate_bench: failed: {shlex.join(cmd)}\n{p.stdout}{p.stderr}")
    return dt, p.stdout, p.stderr


def keyvals(text):
    return {k: float(v) for k, v in re.findall(r"(\w+)=([-+0-9.e]+)", text)}


def make_set(a, tokens):
    """data/bench/TOKENS: sequences of --seq-len tokens, shards of 32 k tokens."""
    out = os.path.join(a.data, f"t{tokens}")
    stamp = os.path.join(out, "complete")
    opts = ["--layers", a.layers, "--heads", a.heads, "--kv-heads", a.kv_heads, "--head-dim",
            a.head_dim, "--seq-len", a.seq_len, "--min-seq-len", a.seq_len, "--seqs",
            tokens // a.seq_len, "--shards", max(1, tokens // 32768), "--dtype", "bf16", "--seed", 7]
    opts = [str(o) for o in opts]
    if not (os.path.exists(stamp) and open(stamp).read() == " ".join(opts)):
        print(f"making the {tokens}-token set in {out} ...", file=sys.stderr, flush=True)
        sh(["mpirun", "-np", str(a.np)] + [os.path.join(BUILD, "kqsvd"), "synth", "--out", out,
                                          "--progress", "off", "--force"] + opts)
        with open(stamp, "w") as f:
            f.write(" ".join(opts))
    return os.path.join(out, "model.h5"), sorted(glob.glob(os.path.join(out, "shard-*.h5")))


def sigma_diff(ref, path):
    """Largest difference of the singular values in two outputs, relative to
    each item's largest: every timed run must have done the same work."""
    worst = 0.0
    with h5py.File(ref, "r") as f, h5py.File(path, "r") as g:
        for m in ("kqsvd", "ksvd", "eigen"):
            for k in ("sigma_k", "sigma_v"):
                x, y = f[m][k][()], g[m][k][()]
                worst = max(worst, float((np.abs(x - y) / np.maximum(x[..., :1], 1e-300)).max()))
    return worst


def kqsvd_run(a, model, shards, np_, qr, out):
    # TSQR and gram run under the default --mem-limit; pdgeqrf needs the rows in memory.
    mem = ["--mem-limit", str(a.mem_limit)] if qr == "scalapack" else []
    cmd = ["mpirun", "-np", str(np_), os.path.join(BUILD, "kqsvd"), "calibrate", "--force",
           "--progress", "off", "--timings", "--qr", qr, "--model", model, "--out", out] + mem + shards
    wall, _, err = sh(cmd)
    line = [x for x in err.splitlines() if "timings" in x][-1]
    t = keyvals(line.split(":", 2)[2])
    ref = os.path.join(os.path.dirname(out), "p1.h5")
    return dict(wall=wall, fold_gflops=t["fold_gflops"], rss=t["peak_rss"],
                read_bps=t["read_rate"], fold=t["fold"], read=t["read"],
                sigma=sigma_diff(ref, out) if out != ref else 0.0)


def peer_run(a, model, shards, threads, check):
    cmd = [sys.executable, os.path.join(ROOT, "bench", "inmemory_pipeline.py"), "--model", model,
           "--dtype", a.peer_dtype, "--threads", str(threads), "--check", check] + shards
    # Debian's torch does its QR, SVD and products in OpenBLAS.
    wall, out, _ = sh(cmd, env=dict(ENV, OPENBLAS_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads)))
    j = json.loads(out.strip().splitlines()[-1])
    return dict(wall=wall, rss=j["peak_rss_mib"], load=j["seconds_load"],
                compute=j["seconds_compute"], sigma=j["max_rel_sigma_diff"])


def machine_info():
    model = "unknown CPU"
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{model}, {os.cpu_count()} cores, {mem:.0f} GiB"


def _options():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="16384,32768,65536,131072,262144",
                    help="tokens per head of each set, comma-separated")
    ap.add_argument("--quick", action="store_true", help="only 16384,32768,65536 tokens")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--np", type=int, default=os.cpu_count() or 2, help="ranks of the parallel runs")
    ap.add_argument("--peer-dtype", default="float32", choices=("float32", "float64"),
                    help="the in-memory pipeline's precision (the authors use float32)")
    ap.add_argument("--mem-limit", type=int, default=16384, help="--mem-limit (MiB) of the --qr scalapack runs")
    ap.add_argument("--data", default=os.path.join(ROOT, "data", "bench"))
    ap.add_argument("--doc", default=os.path.join(ROOT, "docs", "benchmarks.md"),
                    help="file to write the results into ('' = none)")
    return ap


def main():
    a = _options().parse_args()
    sizes = [16384, 32768, 65536] if a.quick else [int(t) for t in a.tokens.split(",")]
    for exe in ("kqsvd", "kqsvd_bench_machine"):
        if not os.access(os.path.join(BUILD, exe), os.X_OK):
            sys.exit(f"calibrate_bench: build/{exe} is missing; run ./scripts/bootstrap.sh first")
    heads = a.layers * (a.heads + 2 * a.kv_heads)
    mach, read, rows, summary = _measure(a, sizes)
    text = _report(a, sizes, heads, mach, read, rows, summary)
    print(text)
    if a.doc:
        _write_doc(a.doc, text)


def _measure(a, sizes):
    """Every run of every set: (dgemm GFLOP/s by threads, the largest
    set's read rates, [(tokens, run, figures)], {tokens: {run: figures}})."""
    mach = {}
    for th in sorted({1, a.np}):
        mach[th] = keyvals(sh([os.path.join(BUILD, "kqsvd_bench_machine"), "dgemm", str(th)])[1])["dgemm_gflops"]
    rows, summary = [], {}
    for T in sizes:
        model, shards = make_set(a, T)
        wd = os.path.dirname(model)
        # The raw read rate of these files, which also leaves them in the page
        # cache: every run below reads them from memory, the first one too.
        read = keyvals(sh([os.path.join(BUILD, "kqsvd_bench_machine"), "read"] + shards)[1])
        runs = [("kqsvd, 1 rank", kqsvd_run(a, model, shards, 1, "tsqr", os.path.join(wd, "p1.h5")))]
        runs.append((f"kqsvd, {a.np} ranks", kqsvd_run(a, model, shards, a.np, "tsqr", os.path.join(wd, "pn.h5"))))
        runs.append((f"--qr gram, {a.np} ranks", kqsvd_run(a, model, shards, a.np, "gram", os.path.join(wd, "pg.h5"))))
        runs.append((f"--qr scalapack, {a.np} ranks",
                     kqsvd_run(a, model, shards, a.np, "scalapack", os.path.join(wd, "ps.h5"))))
        runs.append(("in-memory, 1 thread", peer_run(a, model, shards, 1, os.path.join(wd, "p1.h5"))))
        if T == sizes[-1] and a.np > 1:
            runs.append((f"in-memory, {a.np} threads", peer_run(a, model, shards, a.np, os.path.join(wd, "p1.h5"))))
        for name, r in runs:
            rows.append((T, name, r))
            print(f"{T:7d}  {name:26s} {r['wall']:8.2f} s  peak RSS {r['rss']:8.1f} MiB", file=sys.stderr, flush=True)
        summary[T] = dict(runs)
    return mach, read, rows, summary


def _report(a, sizes, heads, mach, read, rows, summary):
    """The results as the benchmarks page shows them (markdown)."""
    lines = ["| tokens/head | run | wall (s) | token x head rows/s | fold GFLOP/s per rank | "
             "peak RSS per rank (MiB) | read GB/s per rank | sigma vs 1 rank |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for T, name, r in rows:
        gf = f"{r['fold_gflops']:.1f}" if "fold_gflops" in r else "-"
        rd = f"{r['read_bps'] / 1e9:.2f}" if "read_bps" in r else "-"
        lines.append(f"| {T:,} | {name} | {r['wall']:.2f} | {T * heads / r['wall']:.3g} | {gf} "
                     f"| {r['rss']:.0f} | {rd} | {r['sigma']:.0e} |")
    big, small = sizes[-1], [t for t in sizes if t * 8 == sizes[-1]]
    k1, kn = "kqsvd, 1 rank", f"kqsvd, {a.np} ranks"
    out = ["", f"Machine limits: OpenBLAS dgemm {mach[1]:.1f} GFLOP/s on 1 thread"
           + (f", {mach[a.np]:.1f} on {a.np}" if a.np in mach and a.np != 1 else "")
           + f"; raw read of the {big:,}-token set ({read['read_bytes'] / 1e9:.2f} GB): "
           f"{read['read_warm_bps'] / 1e9:.2f} GB/s from the page cache, {read['read_cold_bps'] / 1e9:.2f} GB/s "
           "after dropping it (posix_fadvise).", ""]
    for T in sizes:
        s = summary[T]
        out.append(f"- {T:,} tokens: in-memory (1 thread) / kqsvd (1 rank) = "
                   f"**{s['in-memory, 1 thread']['wall'] / s[k1]['wall']:.2f}x**; "
                   f"QR stage at 1 rank {s[k1]['fold_gflops']:.1f} GFLOP/s = "
                   f"**{100 * s[k1]['fold_gflops'] / mach[1]:.0f}%** of dgemm; "
                   f"pdgeqrf / TSQR at {a.np} ranks = "
                   f"**{s[f'--qr scalapack, {a.np} ranks']['wall'] / s[kn]['wall']:.2f}x** "
                   "(wall).")
    if small:
        t0 = small[0]

        def g(name):
            return 100 * (summary[big][name]["rss"] / summary[t0][name]["rss"] - 1)
        out.append(f"- Peak RSS from {t0:,} to {big:,} tokens (8x): kqsvd 1 rank **{g(k1):+.1f}%**, "
                   f"{a.np} ranks {g(kn):+.1f}%; in-memory **{g('in-memory, 1 thread'):+.0f}%**; "
                   f"--qr scalapack {g(f'--qr scalapack, {a.np} ranks'):+.0f}%.")
    cmd = "bench/calibrate_bench.py " + " ".join(shlex.quote(x) for x in sys.argv[1:])
    head = [f"Measured {datetime.date.today().isoformat()} on {machine_info()}, with",
            "", f"    {cmd.strip()}", "",
            f"Sets: {a.layers} layers, {a.heads} query / {a.kv_heads} KV heads, d = {a.head_dim}, bf16, "
            f"sequences of {a.seq_len} tokens, shards of 32,768 tokens (`kqsvd synth`). A token x head "
            f"row is one row of d values of one head's K, Q or V: {heads} per token. The fold is "
            "the QR stage (conversion from bf16 included), at 2 d² flops per row for every method. "
            f"The in-memory pipeline computes in {a.peer_dtype}. The last column is the largest "
            "difference of every method's singular values from those of the 1-rank TSQR run, "
            "relative to each head's largest: every run did the same work.", ""]
    return "\n".join(head + lines + out) + "\n"


def _write_doc(path, text):
    """text between the page's BEGIN and END marks (added if missing)."""
    doc = open(path).read() if os.path.exists(path) else f"# Benchmarks\n\n{BEGIN}\n{END}\n"
    if BEGIN not in doc:
        doc += f"\n{BEGIN}\n{END}\n"
    pre, rest = doc.split(BEGIN, 1)
    post = rest.split(END, 1)[1]
    with open(path + ".tmp", "w") as f:
        f.write(pre + BEGIN + "\n" + text + END + post)
    os.replace(path + ".tmp", path)
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
