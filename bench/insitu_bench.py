#!/bin/sh
"true" '''\'
# Runs with the repository's .venv (scripts/hf-env.sh), else python3.
me=$(readlink -f "$0"); v="$(dirname "$me")/../.venv/bin/python3"
[ -x "$v" ] || v=python3; exec "$v" "$me" "$@"
'''
HELP = """In-situ calibration against the bare forward pass and against export plus
calibrate, on one model and text, each run in a process of its own:

  forward   the model over the calibration windows, nothing else
  insitu    python -m kqsvd.calibrate_hf (the same windows, folded as produced)
  twostep   examples/export_hf.py --dtype f32, then build/kqsvd calibrate

For each: wall time (whole process, and the loop over the sequences where
the tool reports it), bytes written under the work folder, and peak RSS.
insitu runs again on --scale times the sequences, to show that its memory
does not grow with the tokens.

The overhead of in-situ calibration over the forward pass is measured in
one process, where the two alternate sequence by sequence (forward then
in-situ, then the other way round, --repeat times over the windows), as
the median of the per-window ratios: separate processes differ by more
than the overhead from run to run (CPU clocks, caches, other load).  The
fold alone of one window's activations is timed too: the floor of the
overhead when the fold runs in line.

    bench/insitu_bench.py [--model ID] [--seq-len 512] [--num-seqs 16] [--scale 2]
                          [--repeat 2] [--work DIR] [--json FILE] [--threads N]
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.realpath(__file__)), ".."))
TEXT = os.path.join(ROOT, "examples", "data", "us-founding-documents.txt")

# The forward pass as calibrate_hf runs it (same loading, same windows, no
# hooks): its loop time is printed as "loop S".
FORWARD = """
import sys, time, torch
sys.path.insert(0, {python!r})
from kqsvd import models
model, tok, info = models.load({model!r}, lm_head=False, dtype=torch.float32)
seqs, _, _, _ = models.token_windows(tok, {text!r}, {seq_len}, {num_seqs}, "train")
t0 = time.time()
for row in seqs:
    with torch.no_grad():
        model(input_ids=torch.from_numpy(row[None]), use_cache=False)
print(f"loop {{time.time() - t0:.3f}}")
"""

# Forward and in-situ passes alternating in one process (kqsvd.calibration.insitu, as
# calibrate_hf folds): a line "pair F I" (seconds) per sequence and pass;
# then the fold alone of one window's activations, "fold S".
PAIRS = """
import sys, time, torch
sys.path.insert(0, {python!r})
from kqsvd import models
from kqsvd.calibration.calibrator import Calibrator
from kqsvd.calibration.insitu import fold_heads, fold_sequences
model, tok, info = models.load({model!r}, lm_head=False, dtype=torch.float32)
seqs, _, _, _ = models.token_windows(tok, {text!r}, {seq_len}, {num_seqs}, "train")
cal = Calibrator(info.num_layers, info.num_kv_heads, info.num_heads // info.num_kv_heads,
                 info.head_dim, info.hidden_size)
for rep in range({repeat}):
    for i in range(len(seqs)):
        spent = [0.0, 0.0]
        for kind in ((0, 1) if (i + rep) % 2 == 0 else (1, 0)):
            t0 = time.time()
            if kind == 0:
                with torch.no_grad():
                    model(input_ids=torch.from_numpy(seqs[i][None]), use_cache=False)
            else:
                fold_sequences(model, info, seqs[i:i + 1], cal, "cpu")
            spent[kind] = time.time() - t0
        print(f"pair {{spent[0]:.4f}} {{spent[1]:.4f}}")
# The fold alone, on the activations of the first window (what the pairs'
# difference should be, without the model).
acts = []
from kqsvd.calibration.capture import Capture
cap = Capture(model, info.model_type, model.config, lambda l, k, t: acts.append((l, k, t[0].clone())))
with torch.no_grad():
    model(input_ids=torch.from_numpy(seqs[0][None]), use_cache=False)
cap.close()
group = info.num_heads // info.num_kv_heads
t0 = time.time()
for l, k, t in acts:
    fold_heads(cal, group, l, k, t)
print(f"fold {{time.time() - t0:.4f}}")
"""


def run(cmd, env=None):
    """(wall seconds, peak RSS MiB, stdout+stderr) of a command."""
    t0 = time.time()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=dict(os.environ, **(env or {})))
    out = p.stdout.read()
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.time() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"insitu_bench: {' '.join(cmd)} failed:\n{out[-3000:]}")
    return wall, ru.ru_maxrss / 1024.0, out


def disk_bytes(folder):
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(folder) for f in fs)


def _options():
    ap = argparse.ArgumentParser(description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--text", default=TEXT)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--num-seqs", type=int, default=16)
    ap.add_argument("--scale", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2, help="passes over the windows for the overhead [2]")
    ap.add_argument("--work", help="work folder [a temporary one, removed]")
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--threads", type=int, help="torch and BLAS threads [all cores]")
    return ap


def main():
    a = _options().parse_args()
    work = a.work or tempfile.mkdtemp(prefix="kqsvd-insitu-bench-")
    os.makedirs(work, exist_ok=True)
    env = {}
    if a.threads:
        env = {"OMP_NUM_THREADS": str(a.threads), "OPENBLAS_NUM_THREADS": str(a.threads)}
    _long_enough(a, work)
    rows = {}
    pairs, fold_alone = _forward(a, env, rows)
    _insitu(a, env, work, rows)
    _twostep(a, env, work, rows)
    _say(a, rows, pairs, fold_alone)
    if not a.work:
        shutil.rmtree(work, ignore_errors=True)


def _long_enough(a, work):
    """a.text, repeated into `work` where the largest run needs more."""
    # Each split may use half of the text's tokens: a text too short for the
    # largest run is repeated (the timings do not depend on the words).
    need = 2 * a.seq_len * a.num_seqs * a.scale
    with open(a.text, encoding="utf-8") as fh:
        text = fh.read()
    have = len(text.split())  # a lower bound on the tokens of any subword tokenizer
    if have < need:
        a.text = os.path.join(work, "text.txt")
        with open(a.text, "w", encoding="utf-8") as fh:
            fh.write((text + "\n") * (need // have + 1))
        print(f"insitu_bench: the text repeated {need // have + 1} times for {need} tokens",
              file=sys.stderr)


def _loop_of(out):
    m = re.search(r"loop ([0-9.]+)", out) or re.search(r" in ([0-9.]+) s, no caches", out)
    return float(m.group(1)) if m else float("nan")


def _forward(a, env, rows):
    """The forward pass alone (rows["forward"]), and the pairs of windows
    run both ways in one process: ([(forward s, in-situ s)], the fold's
    seconds a window)."""
    py, tokens = sys.executable, a.seq_len * a.num_seqs
    src = FORWARD.format(python=os.path.join(ROOT, "python"), model=a.model, text=a.text,
                         seq_len=a.seq_len, num_seqs=a.num_seqs)
    wall, rss, out = run([py, "-c", src], env)
    rows["forward"] = dict(wall=wall, loop=_loop_of(out), rss_mib=rss, disk=0, tokens=tokens)
    _, _, out = run([py, "-c", PAIRS.format(python=os.path.join(ROOT, "python"), model=a.model,
                                            text=a.text, seq_len=a.seq_len, num_seqs=a.num_seqs,
                                            repeat=a.repeat)], env)
    pairs = [(float(x), float(y)) for x, y in re.findall(r"pair ([0-9.]+) ([0-9.]+)", out)]
    return pairs, float(re.search(r"fold ([0-9.]+)", out).group(1))


def _insitu(a, env, work, rows):
    """calibrate_hf on the windows, and on --scale times as many."""
    py = sys.executable
    common = ["--model", a.model, "--text", a.text, "--seq-len", str(a.seq_len)]
    for name, n in (("insitu", a.num_seqs), (f"insitu x{a.scale}", a.num_seqs * a.scale)):
        folder = os.path.join(work, name.replace(" ", ""))
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
        wall, rss, out = run([py, "-m", "kqsvd.calibrate_hf", *common, "--num-seqs", str(n),
                              "--out", os.path.join(folder, "proj.h5")],
                             dict(env, PYTHONPATH=os.path.join(ROOT, "python")))
        rows[name] = dict(wall=wall, loop=_loop_of(out), rss_mib=rss, disk=disk_bytes(folder),
                          tokens=a.seq_len * n)


def _twostep(a, env, work, rows):
    """The caches exported, then `kqsvd calibrate` on them."""
    py, tokens = sys.executable, a.seq_len * a.num_seqs
    common = ["--model", a.model, "--text", a.text, "--seq-len", str(a.seq_len)]
    folder = os.path.join(work, "twostep")
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    w1, r1, _ = run([py, os.path.join(ROOT, "examples", "export_hf.py"), *common, "--num-seqs",
                     str(a.num_seqs), "--split", "train", "--dtype", "f32", "--out",
                     os.path.join(folder, "caches")], env)
    cache_bytes = disk_bytes(os.path.join(folder, "caches"))
    shards = sorted(os.path.join(folder, "caches", f) for f in os.listdir(os.path.join(folder, "caches"))
                    if f.startswith("shard-"))
    w2, r2, _ = run([os.path.join(ROOT, "build", "kqsvd"), "calibrate", "--progress", "off",
                     "--model", os.path.join(folder, "caches", "model.h5"), "--out",
                     os.path.join(folder, "proj.h5"), *shards], env)
    rows["twostep"] = dict(wall=w1 + w2, loop=float("nan"), rss_mib=max(r1, r2),
                           disk=disk_bytes(folder), cache_bytes=cache_bytes, tokens=tokens,
                           export_wall=w1, calibrate_wall=w2)


def _say(a, rows, pairs, fold_alone):
    """The table and the overhead line, and the --json figures."""
    pair_f, pair_i = sum(p[0] for p in pairs), sum(p[1] for p in pairs)
    # The median of the pairs' ratios: a burst of load from elsewhere that
    # hits one pass of one pair moves it far less than it moves the sums.
    ratios = sorted(y / x - 1 for x, y in pairs)
    median = ratios[len(ratios) // 2] if len(ratios) % 2 else 0.5 * (
        ratios[len(ratios) // 2 - 1] + ratios[len(ratios) // 2])
    quart = (ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4])
    f, i = rows["forward"], rows["insitu"]
    summary = dict(model=a.model, seq_len=a.seq_len, num_seqs=a.num_seqs, threads=a.threads,
                   repeat=a.repeat, pairs_forward_s=pair_f, pairs_insitu_s=pair_i,
                   overhead=median, overhead_quartiles=quart, overhead_sums=pair_i / pair_f - 1,
                   fold_alone_per_window_s=fold_alone,
                   fold_share=fold_alone * len(pairs) / pair_f,
                   overhead_loop=i["loop"] / f["loop"] - 1, overhead_wall=i["wall"] / f["wall"] - 1,
                   rss_growth=rows[f"insitu x{a.scale}"]["rss_mib"] / i["rss_mib"] - 1,
                   twostep_over_insitu=rows["twostep"]["wall"] / i["wall"], rows=rows)
    print(f"{a.model}: {a.num_seqs} x {a.seq_len} tokens, {os.cpu_count()} cores"
          f"{'' if not a.threads else f', {a.threads} threads'}")
    print(f"{'run':<12} {'tokens':>7} {'wall s':>8} {'loop s':>8} {'tok/s':>8} {'written':>10} "
          f"{'peak RSS':>9}")
    for name, r in rows.items():
        rate = r["tokens"] / r["loop"] if r["loop"] == r["loop"] else r["tokens"] / r["wall"]
        print(f"{name:<12} {r['tokens']:>7} {r['wall']:>8.2f} {r['loop']:>8.2f} {rate:>8.0f} "
              f"{r['disk'] / 1e6:>8.1f} MB {r['rss_mib']:>6.0f} MiB")
    print(f"in-situ overhead over the forward pass: {100 * median:+.1f}% (median of {len(pairs)} "
          f"windows run both ways in one process; quartiles {100 * quart[0]:+.1f}% and "
          f"{100 * quart[1]:+.1f}%; sums {pair_f:.2f} s and {pair_i:.2f} s: "
          f"{100 * summary['overhead_sums']:+.1f}%); the fold alone: {fold_alone:.3f} s a window, "
          f"{100 * summary['fold_share']:.1f}% of the forward pass; between the processes above "
          f"{100 * summary['overhead_loop']:+.1f}% "
          f"(loop), {100 * summary['overhead_wall']:+.1f}% (whole process); peak RSS at "
          f"{a.scale}x the tokens: {100 * summary['rss_growth']:+.1f}%; export + calibrate took "
          f"{summary['twostep_over_insitu']:.2f}x the in-situ time and wrote "
          f"{rows['twostep']['cache_bytes'] / 1e6:.1f} MB of caches")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(summary, fh, indent=1)


if __name__ == "__main__":
    main()
