#!/usr/bin/env bash
# The README's quality-per-byte table, made from nothing: SmolLM2-135M-
# Instruct's latents calibrated in situ, fitted, and scored with the
# frontier against plain int-N caches, transformers' QuantizedCache
# (quanto) and kvpress's presses, in float64 (docs/quantized-cache.md,
# "Precision").
#
#   bench/frontier_smollm2.sh [--work DIR] [--dtype float64|float32] [--reuse]
#
# Calibration (python -m kqsvd.calibrate_hf, 2 ranks, float32): 24 x 256
# tokens from the start of the bundled founding documents, head-group
# latents (G = 3, keys before RoPE) and per-head latents (keys after
# RoPE).  Fits (python -m kqsvd.quality, bench/head_groups.sh's options):
# quality-bits:0.25 and :0.125, and quality-tuned:0.5, on 4 (+ 4) of those
# windows.  Frontier: 3 windows of 768 + 256 tokens from the end of the
# same text, --chunk 8, in .venv-peers (the peers' environment).  About an
# hour on 2 cores.  Writes DIR/frontier.json, DIR/frontier.png and the
# table DIR/frontier.txt.  --reuse: keep DIR's projections files.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
work="" dtype=float64 reuse=0
while [ $# -gt 0 ]; do
  case $1 in
    --work) work=$2; shift 2 ;;
    --dtype) dtype=$2; shift 2 ;;
    --reuse) reuse=1; shift ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "frontier_smollm2.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
work=${work:-data/frontier-smollm2}
. bench/smollm2.sh
calibrate() {  # OUT, then calibrate_hf's options
  local out=$1
  shift
  [ $reuse = 1 ] && [ -f "$out" ] && return 0
  mpirun -np 2 .venv/bin/python -m kqsvd.calibrate_hf --model "$model" --text "$text" \
    --seq-len 256 --num-seqs 24 --out "$out" --force "$@"
}
calibrate "$work/g3.h5" --keys pre-rope --head-groups 3
calibrate "$work/post.h5"
if [ $reuse = 0 ] || [ ! -f "$work/g3.quality-tuned-0.5.h5" ]; then
  .venv/bin/python -m kqsvd.quality --model "$model" --text "$text" --proj "$work/g3.h5" \
    --ranks quality-bits:0.25,quality-bits:0.125,quality-tuned:0.5 --methods kqsvd \
    --split validation --seq-len 256 --num-seqs 8 --calib-seqs 4 --check-seqs 4 \
    --tune-steps 30 --json "$work/g3.json" --force | tee "$work/g3.txt"
fi
echo "frontier_smollm2.sh: calibrated and fitted in $((SECONDS - t0)) s"
.venv-peers/bin/python -m kqsvd.frontier --model "$model" --text "$text" \
  --proj "$work/g3.quality-bits-0.25.h5=kqsvd/stored" \
  --proj "$work/g3.quality-bits-0.125.h5=kqsvd/stored" \
  --proj "$work/g3.quality-tuned-0.5.h5=kqsvd/stored@4,kqsvd/stored@3" \
  --proj "$work/post.h5=fixed:48@4" --methods kqsvd,ksvd --chunk 8 --dtype "$dtype" \
  --json "$work/frontier.json" --plot "$work/frontier.png" --force | tee "$work/frontier.txt"
echo "frontier_smollm2.sh: done in $((SECONDS - t0)) s"
