#!/usr/bin/env bash
# Calibration at the length served: python -m kqsvd.calibrate_hf on
# SmolLM2-135M-Instruct at windows of 2,048, 4,096 and 8,192 tokens (its
# limit), the same 16,384 tokens of the Jargon File's train split each time
# (8, 4 and 2 windows), head groups G = 3 with keys before RoPE, as the
# README's headline files.  Prints the wall time and the peak resident
# memory (GNU time's maximum RSS) of each run, for docs/benchmarks.md.
#
#   bench/long_calibration.sh [--work DIR] [--lengths "2048 4096 8192"] [--np N]
#
# The model computes its attention with SDPA while it is calibrated
# (kqsvd.calibration.capture, compute="sdpa"): no T x T score matrix is
# held, so memory grows with the window's activations only.  About
# 10 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
work="" lengths="2048 4096 8192" np=1
while [ $# -gt 0 ]; do
  case $1 in
    --work) work=$2; shift 2 ;;
    --lengths) lengths=$2; shift 2 ;;
    --np) np=$2; shift 2 ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "long_calibration.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
work=${work:-data/long-calibration}
text=examples/data/jargon-file-4.4.7.txt
. bench/smollm2.sh
py=.venv/bin/python
launch=()
[ "$np" -gt 1 ] && launch=(mpirun -np "$np")
printf '%-8s %6s %10s %12s\n' window seqs seconds "peak RSS MiB"
for n in $lengths; do
  seqs=$((16384 / n))
  log="$work/time-$n.txt"
  /usr/bin/time -o "$log" -f "%e %M" "${launch[@]}" $py -m kqsvd.calibrate_hf --model "$model" \
    --text "$text" --seq-len "$n" --num-seqs "$seqs" --keys pre-rope --head-groups 3 \
    --ranks fixed:96 --out "$work/g3-$n.h5" --force >"$work/calibrate-$n.log" 2>&1
  read -r secs kib <"$log"
  printf '%-8s %6s %10s %12s\n' "$n" "$seqs" "$secs" "$((kib / 1024))"
done
echo "long_calibration.sh: done in $((SECONDS - t0)) s"
