#!/usr/bin/env bash
# kqsvd's quarter of the cache against plain int3 and int4 on text its
# files never saw, in float64: the end of the GNU GPL v3 (Debian's
# /usr/share/common-licenses/GPL-3), the files calibrated and fitted on
# its start; SmolLM2-135M-Instruct.
#
#   bench/held_out.sh [--work DIR] [--text FILE] [--reuse]
#
# Calibration: head-group latents (G = 3, keys before RoPE, as the
# README's headline) folded in situ from 12 x 256 tokens of the text's
# start (its train split); quality-bits:0.25 fitted on 4 of those windows
# (python -m kqsvd.quality, which also scores it, step by step, on 4 x 256
# tokens of the end).  Frontier: 5 windows of 512 + 128 tokens from the
# text's end, float64 (reproducible to about 1e-9; docs/quantized-cache.md,
# "Precision"), against int4 and int3 caches of the model's own keys and
# values.  About 8 minutes on 2 cores.  Writes DIR/held_out.json and the
# table DIR/held_out.txt.  --reuse: keep DIR's projections files.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
work="" text=/usr/share/common-licenses/GPL-3 reuse=0
while [ $# -gt 0 ]; do
  case $1 in
    --work) work=$2; shift 2 ;;
    --text) text=$2; shift 2 ;;
    --reuse) reuse=1; shift ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "held_out.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[ -f "$text" ] || { echo "held_out.sh: $text: no such file (Debian: base-files)" >&2; exit 1; }
work=${work:-data/held-out}
. bench/smollm2.sh
py=.venv/bin/python
if [ $reuse = 0 ] || [ ! -f "$work/g3.h5" ]; then
  mpirun -np 2 $py -m kqsvd.calibrate_hf --model "$model" --text "$text" --seq-len 256 \
    --num-seqs 12 --keys pre-rope --head-groups 3 --out "$work/g3.h5" --force
fi
if [ $reuse = 0 ] || [ ! -f "$work/fit.quality-bits-0.25.h5" ]; then
  $py -m kqsvd.quality --model "$model" --text "$text" --proj "$work/g3.h5" \
    --ranks quality-bits:0.25 --methods kqsvd --seq-len 256 --num-seqs 4 --calib-seqs 4 \
    --json "$work/fit.json" --force
fi
echo "held_out.sh: calibrated and fitted in $((SECONDS - t0)) s"
$py -m kqsvd.frontier --model "$model" --text "$text" \
  --proj "$work/fit.quality-bits-0.25.h5=kqsvd/stored" --plain 4,3 --quantized-cache none \
  --presses none --context 512 --continuation 128 --num-seqs 5 --dtype float64 \
  --json "$work/held_out.json" --force | tee "$work/held_out.txt"
echo "held_out.sh: done in $((SECONDS - t0)) s"
