#!/usr/bin/env bash
# The GPU benchmark: the fold stage of `kqsvd calibrate` at the paper's scale
# (d = 128; 2 layers, 8 query / 2 KV heads, bf16; 128 sequences of 2,048
# tokens = 262,144 tokens per head, or --seqs 1024 for 2.1 M) on all CPU
# cores with both folds, then on the GPU with both (Householder QR per
# factor, and the batched Gram fold), by one rank and by several sharing
# it, with the figures docs/benchmarks.md reports.  Run it from the
# repository after ./test.sh or ./demo.sh built it.
#
#   bench/gpu_calibrate.sh [--data DIR] [--seqs N] [--cpu-ranks N] [--gpu-ranks "1 4"]
#                          [--fp64-peak TFLOPS] [--pcie GBS]
#
# --fp64-peak: the GPU's FP64 peak [67, the H100 SXM's and H200's FP64
# tensor-core figure]; --pcie: the host link's bandwidth per direction [64,
# PCIe 5.0 x16].  Every run is checked against the CPU's Householder one.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
. scripts/env.sh
data="" seqs=128 cpu_ranks=$(nproc) gpu_ranks="1 4" peak=67 pcie=64
while [ $# -gt 0 ]; do
  case $1 in
    --data) data=$2; shift 2 ;;
    --seqs) seqs=$2; shift 2 ;;
    --cpu-ranks) cpu_ranks=$2; shift 2 ;;
    --gpu-ranks) gpu_ranks=$2; shift 2 ;;
    --fp64-peak) peak=$2; shift 2 ;;
    --pcie) pcie=$2; shift 2 ;;
    *) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
  esac
done
data=${data:-data/bench-paper-$seqs}
L=2 HQ=8 HKV=2 D=128
if [ ! -f "$data/model.h5" ]; then
  shards=$((seqs >= 512 ? 16 : seqs < 8 ? seqs : 8))
  mpirun -np "$cpu_ranks" build/kqsvd synth --out "$data" --layers $L --heads $HQ --kv-heads $HKV \
    --head-dim $D --hidden 1024 --seqs "$seqs" --seq-len 2048 --min-seq-len 2048 --shards $shards \
    --dtype bf16 --progress off --force  # model.h5 comes last: a set without it is partial
fi
# The fold's flops: 2 d^2 per row folded into a d x d factor (Householder's
# count; the Gram fold's GEMMs do the same), (Hq + 2 Hkv) L rows a token.
flops=$(awk -v t=$((seqs * 2048)) -v d=$D 'BEGIN { printf "%.6e", 2 * d * d * t * 2 * (8 + 4) }')

run() { # NAME DEVICE QR RANKS -> one table row; the output in $data/proj-NAME.h5
  local out="$data/proj-$1.h5" t0 t1 log
  log="$data/proj-$1.log"
  t0=$(date +%s.%N)
  mpirun -np "$4" build/kqsvd calibrate --force --device "$2" --qr "$3" --timings --progress off \
    --model "$data/model.h5" --out "$out" "$data"/shard-*.h5 > "$log" 2>&1
  t1=$(date +%s.%N)
  "$KQSVD_PYTHON" - "$1" "$t0" "$t1" "$log" "$flops" "$peak" "$data/proj-cpu-tsqr.h5" "$out" <<'PY'
import re, sys
import h5py
import numpy as np
name, t0, t1, log, flops, peak, ref, out = sys.argv[1:]
text = open(log).read()
got = dict(re.findall(r"\b(read|fold)=([0-9.e+-]+) s", text))
fold = float(got["fold"])
worst = 0.0
with h5py.File(ref) as a, h5py.File(out) as b:
    for g in ("kqsvd", "ksvd", "eigen", "spectra"):
        for k in a[g]:
            x, y = a[g][k][...].astype(float), b[g][k][...].astype(float)
            worst = max(worst, np.abs(x - y).max() / (np.abs(x).max() or 1.0))
rate = float(flops) / fold / 1e12
print(f"| {name} | {float(t1) - float(t0):.2f} s | {float(got['read']):.2f} s | {fold:.2f} s | "
      f"{rate:.2f} TFLOP/s | {100 * rate / float(peak):.1f}% | {worst:.1e} |")
PY
}

echo "$(awk -v t=$((seqs * 2048)) 'BEGIN { printf "%.3g", t }') tokens per head; fold time and" \
  "rate from --timings (the slowest rank's; on a GPU the host's staging and waits included)"
echo
echo "| run | wall | read | fold | fold rate | share of $peak TFLOP/s | largest difference from CPU tsqr |"
echo "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"
run cpu-tsqr cpu tsqr "$cpu_ranks"
run cpu-gram cpu gram "$cpu_ranks"
ngpu=$(build/kqsvd --version | sed -n 's/^CUDA module: \/.*; \([0-9]*\) GPUs\{0,1\} visible/\1/p')
if [ "${ngpu:-0}" -gt 0 ]; then
  run gpu-tsqr-1 cuda tsqr 1
  for n in $gpu_ranks; do run "gpu-gram-$n" cuda gram "$n"; done
  echo
  build/kqsvd_gpu_h2d | awk -v l="$pcie" '{ print } / GB\/s/ {
    for (i = 1; i <= NF; i++) if ($(i + 1) == "GB/s") printf "  = %.0f%% of %s GB/s\n", 100 * $i / l, l }'
else
  echo
  echo "No GPU visible: the GPU rows need a machine with one (and the CUDA module built)."
fi
