#!/usr/bin/env bash
# The GPU benchmark: the QR stage of `kqsvd calibrate` at the paper's scale
# (262,144 tokens per head, d = 128; 2 layers, 8 query / 2 KV heads, bf16)
# on all CPU cores, then on the GPUs, with the figures docs/benchmarks.md
# reports.  Run it from the repository after ./test.sh or ./demo.sh built it.
#
#   bench/gpu_calibrate.sh [--data DIR] [--cpu-ranks N] [--fp64-peak TFLOPS] [--pcie GBS]
#
# --fp64-peak: the GPU's FP64 peak [67, the H100 SXM's FP64 tensor-core
# figure]; --pcie: the host link's bandwidth per direction [64, PCIe 5.0 x16].
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
. scripts/env.sh
data=data/bench-paper cpu_ranks=$(nproc) peak=67 pcie=64
while [ $# -gt 0 ]; do
  case $1 in
    --data) data=$2; shift 2 ;;
    --cpu-ranks) cpu_ranks=$2; shift 2 ;;
    --fp64-peak) peak=$2; shift 2 ;;
    --pcie) pcie=$2; shift 2 ;;
    *) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2 ;;
  esac
done
L=2 HQ=8 HKV=2 D=128 T=262144
if [ ! -f "$data/model.h5" ]; then
  mpirun -np "$cpu_ranks" build/kqsvd synth --out "$data" --layers $L --heads $HQ --kv-heads $HKV \
    --head-dim $D --hidden 1024 --seqs 128 --seq-len 2048 --min-seq-len 2048 --shards 8 \
    --dtype bf16 --progress off
fi
# Householder QR folds each row into a d x d factor for about 2 d^2 flops;
# every token gives rows to (Hq + 2 Hkv) factors per layer.
rows=$((T * L * (HQ + 2 * HKV)))
flops=$(awk -v r=$rows -v d=$D 'BEGIN { printf "%.6e", 2 * d * d * r }')

run() { # DEVICE RANKS OUT -> seconds
  local t0 t1
  t0=$(date +%s.%N)
  mpirun -np "$2" build/kqsvd calibrate --force --device "$1" --progress off --model "$data/model.h5" \
    --out "$3" "$data"/shard-*.h5 > "$3.log"
  t1=$(date +%s.%N)
  awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.2f", b - a }'
}
report() { # NAME SECONDS
  awk -v n="$1" -v s="$2" -v r=$rows -v f="$flops" -v p="$peak" 'BEGIN {
    printf "| %s | %.2f s | %.3g | %.1f GFLOP/s |", n, s, r / s, f / s / 1e9 }'
}

# Rates use the whole calibrate run's wall time (reading, W^O, solves and
# writing included), so they understate the QR stage alone.
echo "| run | wall | token x head rows/s | FP64 rate (whole run) |"
echo "| --- | --- | --- | --- |"
cpu_s=$(run cpu "$cpu_ranks" "$data/proj-cpu.h5")
echo "$(report "CPU, $cpu_ranks ranks" "$cpu_s")"
ngpu=$(build/kqsvd --version | sed -n 's/^CUDA module: \/.*; \([0-9]*\) GPUs\{0,1\} visible/\1/p')
if [ "${ngpu:-0}" -gt 0 ]; then
  gpu_s=$(run cuda "$ngpu" "$data/proj-gpu.h5")
  echo "$(report "GPU, $ngpu rank(s)" "$gpu_s")"
  awk -v f="$flops" -v s="$gpu_s" -v p="$peak" -v c="$cpu_s" 'BEGIN {
    printf "\nGPU: %.1f%% of the %.0f TFLOP/s FP64 peak; %.1fx the CPU run\n",
           100 * f / s / (p * 1e12), p, c / s }'
  build/kqsvd_gpu_h2d | awk -v l="$pcie" '{ print } / GB\/s/ {
    for (i = 1; i <= NF; i++) if ($(i + 1) == "GB/s") printf "  = %.0f%% of %s GB/s\n", 100 * $i / l, l }'
  "$KQSVD_PYTHON" - "$data/proj-cpu.h5" "$data/proj-gpu.h5" <<'PY'
import sys
import h5py
import numpy as np
worst = 0.0
with h5py.File(sys.argv[1]) as a, h5py.File(sys.argv[2]) as b:
    for g in ("kqsvd", "ksvd", "eigen", "spectra"):
        for k in a[g]:
            x, y = a[g][k][...].astype(float), b[g][k][...].astype(float)
            worst = max(worst, np.abs(x - y).max() / (np.abs(x).max() or 1.0))
print(f"GPU projections against the CPU's: largest relative difference {worst:.2e}")
PY
else
  echo
  echo "No GPU visible: the GPU rows need a machine with one (and the CUDA module built)."
fi
