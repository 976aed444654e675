#!/usr/bin/env bash
# RULER (bench/ruler.py, docs/ruler.md) on SmolLM2-135M-Instruct, as
# docs/long-context.md reports it: first the full model on every task,
# then, on the tasks it answers at 80% or more, each fraction's
# configurations at equal bytes, the question after the compression:
#   - kqsvd's tiers, the fitted layouts of docs/long-context.md served on a
#     keys-after-RoPE head-group calibration (the form that decodes fastest);
#   - kqsvd's every-token latent on the same file, fixed:R@3 (R = 192, 96,
#     48: a quarter, an eighth, a sixteenth of the bf16 cache's bytes);
#   - kvpress's ExpectedAttention, SnapKV and StreamingLLM keeping F of the
#     context, and ExpectedAttention and SnapKV over quanto's int4 cache at F
#     of the bytes;
#   - at a quarter, the plain int4 and int3 caches too, and KIVI's (the
#     same with the newest 128 tokens unquantized).
#
#   bench/ruler_suite.sh [--work DIR] [--lengths 4096] [--samples 25]
#                        [--fractions "0.125 0.25 0.0625"] [--full-only]
#                        [--question agnostic|aware]
#
# Each part writes its own report, DIR/ruler-L-full.json and
# DIR/ruler-L-F.json, after every sample: run the same command again to go
# on from where it stopped (a finished part is not run again).  A sample
# takes about 12 s for the full model at 4,096 tokens on 2 cores, and 2 to
# 3 minutes for a fraction's nine configurations, so the suite is hours.
# --question aware compresses the question with the context (kvpress's
# question-aware case), each fraction's report then DIR/ruler-L-F-aware.json.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
work=data/long-context lengths=4096 samples=25 fractions="0.125 0.25 0.0625" full_only=0
question=agnostic
text=examples/data/jargon-file-4.4.7.txt  # where g3-post.h5 is calibrated, as long_context.sh
while [ $# -gt 0 ]; do
  case $1 in
    --work) work=$2; shift 2 ;;
    --lengths) lengths=$2; shift 2 ;;
    --samples) samples=$2; shift 2 ;;
    --fractions) fractions=$2; shift 2 ;;
    --full-only) full_only=1; shift ;;
    --question) question=$2; shift 2 ;;
    -h|--help) sed -n '2,26p' "$0"; exit 0 ;;
    *) echo "ruler_suite.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
. bench/smollm2.sh
py=.venv/bin/python
declare -A tiers=([0.25]=w32+s4+0.760515x192@4+0.239485xdrop+snapv
                  [0.125]=w16+s4+0.491361x144@4+0.508639xdrop+expected
                  [0.0625]=w16+s4+0.231675x144@4+0.768325xdrop)
declare -A latent=([0.25]=192 [0.125]=96 [0.0625]=48)
for f in $fractions; do
  [ -n "${tiers[$f]:-}" ] || {
    echo "ruler_suite.sh: --fractions: $f is not one of ${!tiers[*]}" >&2; exit 2; }
done
case $question in
  agnostic) aware="" ;;
  aware) aware=-aware ;;
  *) echo "ruler_suite.sh: --question: $question is not agnostic or aware" >&2; exit 2 ;;
esac
tag=${lengths//,/-}
complete() { [ -f "$1" ] && $py -c 'import json, sys; sys.exit(not json.load(open(sys.argv[1]))["complete"])' "$1"; }
part() {  # REPORT PYTHON, then bench/ruler.py's options
  local report=$1 python=$2
  shift 2
  if complete "$report"; then
    echo "ruler_suite.sh: $report is complete"
    return
  fi
  $python bench/ruler.py --lengths "$lengths" --samples "$samples" --json "$report" "$@" |
    tee "${report%.json}.txt"
  echo "ruler_suite.sh: $report done at $((SECONDS - t0)) s"
}
full=$work/ruler-$tag-full.json
part "$full" $py --plain none --presses none --composites none
[ $full_only = 0 ] || exit 0
# the tasks the full model answers at 80% or more at every length
solved=$($py -c '
import json, sys
r = json.load(open(sys.argv[1]))
beyond = {t for ts in r["beyond"].values() for t in ts}
print(",".join(t for t in r["settings"]["tasks"] if t not in beyond))' "$full")
[ -n "$solved" ] || { echo "ruler_suite.sh: the full model solves no task: nothing to compare"; exit 0; }
echo "ruler_suite.sh: the full model solves $solved"
post=$work/g3-post.h5
[ -f "$post" ] || g3_post "$post"
for f in $fractions; do
  plain=none
  [ "$f" != 0.25 ] || plain=4,3
  part "$work/ruler-$tag-$f$aware.json" .venv-peers/bin/python --tasks "$solved" --question "$question" \
    --plain $plain --kivi $plain \
    --presses "expected:$f,snapkv:$f,streaming:$f" \
    --composites "expected:quanto:4:$f,snapkv:quanto:4:$f" \
    --proj "$post=tiers:${tiers[$f]}" --proj "$post=fixed:${latent[$f]}@3"
done
echo "ruler_suite.sh: done in $((SECONDS - t0)) s"
