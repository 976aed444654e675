#!/usr/bin/env bash
# Head-group latents on SmolLM2-135M-Instruct (3 KV heads of d = 64): one
# latent per layer (G = 3, 192 wide) against one per KV head, at equal
# cache bytes: perplexity, KL to the full model and top-1 agreement at 50%,
# 25% and 12.5% of the KV cache, for kqsvd, ksvd and eigen, with the same
# rank share in every layer (fixed:R, closed form), with ranks fitted on
# the model (quality-budget:F) and, for kqsvd, with the up-projections
# trained too (quality-tuned:F).
#
#   bench/head_groups.sh [--keys post-rope|pre-rope] [--work DIR] [--fit "1 3"]
#                        [--fractions 0.5,0.25] [--fit-methods kqsvd] [--reuse]
#
# Calibration: 24 x 256 tokens from the start of the bundled text (the
# demo's), folded from the running model on 2 ranks (python -m
# kqsvd.calibrate_hf, float32, no caches), once per head and once with
# --head-groups 3; evaluation: 8 x 256 tokens from the end of the text.
# Closed forms (fixed:R) for the three methods at 50%, 25% and 12.5%.
# Fitted ranks for the forms in --fit (G values; "" for none) and the
# methods in --fit-methods, at --fractions: quality-budget fits its ranks
# on 4 of the calibration windows, quality-tuned trains the up-projections
# 30 steps on them and keeps the step that is best on the next 4 (about
# 6 minutes per fraction and method on 2 cores).  --reuse: keep DIR's
# projections files from an earlier run.  Writes DIR/head_groups.md (the
# table of docs/head-groups.md) and the quality reports beside it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
keys=post-rope work="" fractions=0.5,0.25 fit="1 3" fit_methods=kqsvd reuse=0
while [ $# -gt 0 ]; do
  case $1 in
    --keys) keys=$2; shift 2 ;;
    --work) work=$2; shift 2 ;;
    --fractions) fractions=$2; shift 2 ;;
    --fit-methods) fit_methods=$2; shift 2 ;;
    --fit) fit=$2; shift 2 ;;
    --reuse) reuse=1; shift ;;
    -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
    *) echo "head_groups.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
work=${work:-data/head-groups-$keys}
. bench/smollm2.sh
for g in 1 3; do
  if [ $reuse = 1 ] && [ -f "$work/g$g.h5" ]; then continue; fi
  mpirun -np 2 .venv/bin/python -m kqsvd.calibrate_hf --model "$model" --text "$text" \
    --seq-len 256 --num-seqs 24 --keys "$keys" --head-groups $g --out "$work/g$g.h5" --force
done
echo "head_groups.sh: calibrated in $((SECONDS - t0)) s"
common=(--model "$model" --text "$text" --split validation --seq-len 256 --num-seqs 8
        --calib-seqs 4 --check-seqs 4 --tune-steps 30 --force)
for g in 3 1; do
  w=$((64 * g))
  .venv/bin/python -m kqsvd.quality "${common[@]}" --proj "$work/g$g.h5" \
    --ranks fixed:$((w / 2)),fixed:$((w / 4)),fixed:$((w / 8)) --json "$work/g$g.json" \
    | tee "$work/g$g.txt"
  case " $fit " in *" $g "*) ;; *) continue ;; esac
  pol=$(echo "$fractions" | sed 's/\([0-9.][0-9.]*\)/quality-budget:\1,quality-tuned:\1/g')
  .venv/bin/python -m kqsvd.quality "${common[@]}" --proj "$work/g$g.h5" --ranks "$pol" \
    --methods "$fit_methods" --json "$work/g$g-fitted.json" | tee "$work/g$g-fitted.txt"
done
.venv/bin/python - "$work" "$keys" > "$work/head_groups.md" <<'EOF'
import json, os, sys
work, keys = sys.argv[1], sys.argv[2]
rows, full = {}, None
for g in (1, 3):
    for name in (f"g{g}.json", f"g{g}-fitted.json"):
        path = os.path.join(work, name)
        if not os.path.exists(path):
            continue
        rep = json.load(open(path))
        full = rep["full"]["perplexity"]
        for r in rep["results"]:
            kind = r["policy"].split(":")[0].replace("fixed", "closed form")
            rows.setdefault((round(r["cache_kept"], 3), kind, r["method"]), {})[g] = r
print(f"keys {keys}; full model: perplexity {full:.3f}; per head (G = 1) against one latent per "
      "layer (G = 3), at equal cache bytes")
print()
print("| cache | ranks | method | ppl per head | ppl G = 3 | × full (G = 3) | KL per head | "
      "KL G = 3 | top-1 per head | top-1 G = 3 |")
print("| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
order = {"closed form": 0, "quality-budget": 1, "quality-tuned": 2}


def cell(r, key, fmt):
    return fmt.format(r[key]) if r else "-"


methods = {"kqsvd": 0, "ksvd": 1, "eigen": 2}
for (kept, kind, m), r in sorted(rows.items(),
                                 key=lambda x: (-x[0][0], order[x[0][1]], methods[x[0][2]])):
    a, b = r.get(1), r.get(3)
    ratio = f"{b['perplexity'] / full:.2f}" if b else "-"
    print(f"| {100 * kept:.1f}% | {kind} | {m} | {cell(a, 'perplexity', '{:.2f}')} | "
          f"{cell(b, 'perplexity', '{:.2f}')} | {ratio} | {cell(a, 'kl', '{:.3f}')} | "
          f"{cell(b, 'kl', '{:.3f}')} | {cell(a, 'top1', '{:.1%}')} | {cell(b, 'top1', '{:.1%}')} |")
EOF
cat "$work/head_groups.md"
echo "head_groups.sh: $keys done in $((SECONDS - t0)) s"
