#!/usr/bin/env bash
# The long-context frontier of issue 37 on SmolLM2-135M-Instruct: head-group
# latents (G = 3, keys before RoPE) calibrated in situ at the length served
# on the Jargon File's train split, fitted with quality-bits at a quarter,
# an eighth and a sixteenth of the bf16 cache's bytes, and scored at long
# context on two held-out texts against every peer at 1/2 to 1/16 of the
# bytes: plain int8/4/3/2, the same with a 128-token unquantized residual
# (KIVI's setting), transformers' QuantizedCache (quanto int4 and int2),
# and kvpress's ExpectedAttention, SnapKV, Knorm and StreamingLLM, alone
# and over quanto's int4 and int2 caches (kvpress's composite).
#
#   bench/long_context.sh [--work DIR] [--context 3840] [--continuation 256]
#                         [--num-seqs 3] [--calib-len 4096] [--dtype float32]
#                         [--texts "jargon kjv"] [--reuse]
#
# Calibration: 4 windows of --calib-len tokens from the Jargon File's start
# (its train split); fits on 4 x 512 train tokens (python -m kqsvd.quality).
# Scoring: --num-seqs windows of --context + --continuation tokens from the
# end of the Jargon File (its validation split, never calibrated on) and
# from the end of Genesis and Exodus in the King James Version (a text
# these files never saw; examples/data/README.md),
# --chunk 8, in .venv-peers.  Each configuration's ratio to the full model
# comes with its range over the windows.  About 2.5 hours on 2 cores at
# the defaults.  Writes DIR/{jargon,kjv}{,-kivi,-composite,-tiers}.{json,txt,png}.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
work="" context=3840 continuation=256 nseqs=3 calib_len=4096 dtype=float32 reuse=0
texts="jargon kjv"
while [ $# -gt 0 ]; do
  case $1 in
    --work) work=$2; shift 2 ;;
    --context) context=$2; shift 2 ;;
    --continuation) continuation=$2; shift 2 ;;
    --num-seqs) nseqs=$2; shift 2 ;;
    --calib-len) calib_len=$2; shift 2 ;;
    --dtype) dtype=$2; shift 2 ;;
    --texts) texts=$2; shift 2 ;;
    --reuse) reuse=1; shift ;;
    -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
    *) echo "long_context.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
work=${work:-data/long-context}
text=examples/data/jargon-file-4.4.7.txt
. bench/smollm2.sh
py=.venv/bin/python
fit=$work/g3.quality-bits
if [ $reuse = 0 ] || [ ! -f "$work/g3.h5" ]; then
  mpirun -np 2 $py -m kqsvd.calibrate_hf --model "$model" --text "$text" --seq-len "$calib_len" \
    --num-seqs 4 --keys pre-rope --head-groups 3 --out "$work/g3.h5" --force
fi
if [ $reuse = 0 ] || [ ! -f "$fit-0.0625.h5" ]; then
  $py -m kqsvd.quality --model "$model" --text "$text" --proj "$work/g3.h5" \
    --ranks quality-bits:0.25,quality-bits:0.125,quality-bits:0.0625 --methods kqsvd \
    --seq-len 512 --num-seqs 2 --calib-seqs 4 --json "$work/g3.json" --force
fi
echo "long_context.sh: calibrated and fitted in $((SECONDS - t0)) s"
score() {  # NAME TEXT, then the frontier's own options
  local name=$1 on=$2
  shift 2
  .venv-peers/bin/python -m kqsvd.frontier --model "$model" --text "$on" --split validation \
    --context "$context" --continuation "$continuation" --num-seqs "$nseqs" --chunk 8 \
    --dtype "$dtype" --json "$work/$name.json" --plot "$work/$name.png" --force "$@" |
    tee "$work/$name.txt"
  echo "long_context.sh: $name done at $((SECONDS - t0)) s"
}
# the fractions fill each budget after a prefill of 3,840 tokens
# (kqsvd.quality.tiers.solve_fraction)
tiers="tiers:w32+s4+0.8441x192@4/3+0.1559xdrop+snapv,tiers:w32+s4+0.4006x192@4/3+0.5994xdrop+snapv"
tiers+=",tiers:w32+s4+0.3644x192@4+0.6356xdrop+snapv,tiers:w32+s4+0.1814x192@4/3+0.8186xdrop+snapv"
tiers+=",tiers:w32+s4+0.164x192@4+0.836xdrop+snapv"
declare -A file=([jargon]=$text [kjv]=examples/data/kjv-genesis-exodus.txt)
for name in $texts; do
  [ -n "${file[$name]:-}" ] || { echo "long_context.sh: --texts: unknown text $name" >&2; exit 2; }
  set -- "$name" "${file[$name]}"
  score "$1" "$2" --methods kqsvd --proj "$fit-0.25.h5=kqsvd/stored" \
    --proj "$fit-0.125.h5=kqsvd/stored" --proj "$fit-0.0625.h5=kqsvd/stored" \
    --plain 8,4,3,2 --quantized-cache quanto:4,quanto:2 \
    --presses expected,snapkv,knorm,streaming --press-kept 0.5,0.25,0.125,0.0625
  score "$1-kivi" "$2" --plain 4,3,2 --residual 128 --quantized-cache none --presses none \
    --methods kqsvd --proj "$fit-0.25.h5=kqsvd/stored" --proj "$fit-0.125.h5=kqsvd/stored" \
    --proj "$fit-0.0625.h5=kqsvd/stored"
  # kvpress's composite: its presses over transformers' QuantizedCache at
  # the same fractions of the bytes
  score "$1-composite" "$2" --plain none --quantized-cache none --presses expected,snapkv \
    --press-kept none --press-quantized quanto:4,quanto:2 --press-bytes 0.25,0.125,0.0625
  # token tiers (docs/formats.md 5.4.1) at a quarter, an eighth and a
  # sixteenth: the layouts of the first, one-window exploration
  # (docs/long-context.md), every latent column in 4-bit keys and 3-bit
  # values (or 4 bits), a window of 32 and 4 sinks, tokens chosen by snapv
  score "$1-tiers" "$2" --methods kqsvd --plain none --quantized-cache none --presses none \
    --proj "$work/g3.h5=$tiers"
done
echo "long_context.sh: done in $((SECONDS - t0)) s"
