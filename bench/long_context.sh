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
#                         [--texts "jargon kjv"] [--reuse] [--headline]
#
# Calibration: 4 windows of --calib-len tokens from the Jargon File's start
# (its train split), keys before RoPE and, for the tiers' serving, after;
# per-column bits fitted on 4 x 512 train tokens, token tiers on 2 x 4,096
# (python -m kqsvd.quality).  Retrieval (bench/passkey.py, passkey and
# span tasks, 5 depths at 2,048 and 4,096 tokens) for the tiers and the
# peers at an eighth and a sixteenth.
# Scoring: --num-seqs windows of --context + --continuation tokens from the
# end of the Jargon File (its validation split, never calibrated on) and
# from the end of Genesis and Exodus in the King James Version (a text
# these files never saw; examples/data/README.md),
# --chunk 8, in .venv-peers.  Each configuration's ratio to the full model
# comes with its range over the windows.  About 7 hours on 2 cores at the
# defaults.  Writes DIR/{jargon,kjv}{,-kivi,-composite,-tiers}.{json,txt,png}
# and DIR/{jargon,kjv}-{passkey,span}.{json,txt}.
# --headline scores README's headline rows alone, on 8 windows unless
# --num-seqs says otherwise, each ratio with its paired bootstrap interval
# against the full model and against the best peer at the same bytes:
# DIR/{jargon,kjv}-headline{,-kivi}.{json,txt,png}, about 80 minutes a
# text after the fits.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
work="" context=3840 continuation=256 nseqs="" calib_len=4096 dtype=float32 reuse=0 headline=0
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
    --headline) headline=1; shift ;;
    -h|--help) sed -n '2,34p' "$0"; exit 0 ;;
    *) echo "long_context.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
work=${work:-data/long-context}
[ -n "$nseqs" ] || { nseqs=3; [ $headline = 0 ] || nseqs=8; }
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
# token tiers (docs/formats.md 5.4.1), fitted at the served length on the
# train split (quality-tiers:F, two windows of 4,096) and served on the
# keys-before-RoPE file they were fitted on and, the same layouts, on a
# keys-after-RoPE calibration (its tiers decode through the kernels)
post=$work/g3-post.h5
if [ $reuse = 0 ] || [ ! -f "$post" ]; then
  g3_post "$post"
fi
qt=$work/g3.tiers.quality-tiers  # named after --json
if [ $reuse = 0 ] || [ ! -f "$qt-0.25.h5" ]; then
  $py -m kqsvd.quality --model "$model" --text "$text" --proj "$work/g3.h5" \
    --ranks quality-tiers:0.125,quality-tiers:0.0625,quality-tiers:0.25 --methods kqsvd \
    --seq-len 4096 --num-seqs 1 --calib-seqs 2 --json "$work/g3.tiers.json" --force
fi
layout() { $py -c 'import h5py, sys; print(h5py.File(sys.argv[1], "r")["kqsvd"].attrs["tiers"])' "$1"; }
tiered=() served=()
for f in 0.25 0.125 0.0625; do
  tiered+=(--proj "$qt-$f.h5=kqsvd/stored")
  served+=(--proj "$post=$(layout "$qt-$f.h5")")
done
echo "long_context.sh: tiers fitted at $((SECONDS - t0)) s"
declare -A file=([jargon]=$text [kjv]=examples/data/kjv-genesis-exodus.txt)
for name in $texts; do
  [ -n "${file[$name]:-}" ] || { echo "long_context.sh: --texts: unknown text $name" >&2; exit 2; }
  set -- "$name" "${file[$name]}"
  if [ $headline = 1 ]; then
    # README's rows: the tiers, the every-token latent, int3, and the best
    # press alone and over int4 (ExpectedAttention or SnapKV); KIVI's rows
    # apart, since --residual holds the newest tokens of every cache
    score "$1-headline" "$2" --methods kqsvd "${tiered[@]}" --proj "$fit-0.25.h5=kqsvd/stored" \
      --proj "$fit-0.125.h5=kqsvd/stored" --plain 3 --quantized-cache none \
      --presses expected,snapkv --press-kept 0.125,0.0625 --press-quantized quanto:4 \
      --press-bytes 0.25,0.125,0.0625
    score "$1-headline-kivi" "$2" --plain 4,3 --residual 128 --quantized-cache none \
      --presses none
    continue
  fi
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
  score "$1-tiers" "$2" --methods kqsvd --plain none --quantized-cache none --presses none \
    "${tiered[@]}" "${served[@]}"
  # retrieval at 2k and 4k, the tiers and every peer at 1/8 and 1/16
  for task in passkey span; do
    .venv-peers/bin/python bench/passkey.py --task $task --text "$2" --lengths 2048,4096 \
      --plain none --presses expected:0.125,expected:0.0625,snapkv:0.125,snapkv:0.0625 \
      --composites expected:quanto:4:0.125,expected:quanto:4:0.0625 \
      --proj "$qt-0.125.h5" --proj "$qt-0.0625.h5" "${served[@]:2}" \
      --proj "$fit-0.125.h5" --proj "$fit-0.0625.h5" \
      --json "$work/$1-$task.json" --force | tee "$work/$1-$task.txt"
    echo "long_context.sh: $1 $task done at $((SECONDS - t0)) s"
  done
done
echo "long_context.sh: done in $((SECONDS - t0)) s"
