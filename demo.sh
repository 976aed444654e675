#!/usr/bin/env bash
# The default run, on a real model: builds kqsvd (installing what is
# missing), prepares the Python environment (.venv), exports a model's
# attention caches from the bundled public-domain text (calibration from its
# start, validation from its end; kept in data/MODEL so the second run is
# fast), calibrates on 2 MPI ranks, evaluates the three methods side by side,
# draws the paper's figures, and (for the decoder) measures what the ranks
# cost the model: perplexity, KL and top-1 agreement.
#
#   ./demo.sh            SmolLM2-135M-Instruct (Llama, GQA 9/3, d = 64, causal)
#   ./demo.sh minilm     all-MiniLM-L6-v2 (BERT encoder, d = 32, bidirectional)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
which=${1:-smollm2}
case $which in
  smollm2)
    model=HuggingFaceTB/SmolLM2-135M-Instruct
    seq_len=256 train=24 valid=8
    # A fixed-rank sweep, the default eps rule and a budget (each method
    # gets its own ranks at equal memory).
    policies=fixed:16,fixed:32,fixed:48,eps:0.1,budget:0.5 ;;
  minilm)
    model=sentence-transformers/all-MiniLM-L6-v2
    seq_len=128 train=40 valid=16 policies= ;;
  -h|--help) sed -n 2,11p "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) echo "demo.sh: unknown model '$which' (smollm2 or minilm)" >&2; exit 2 ;;
esac
scripts/bootstrap.sh
. scripts/env.sh
scripts/hf-env.sh
data=${KQSVD_DEMO_DIR:-data/$which}
text=examples/data/us-founding-documents.txt
t0=$SECONDS

for split in train:$train validation:$valid; do
  name=${split%%:*}
  if [ ! -f "$data/$name/model.h5" ]; then  # written last: absent means not done
    rm -rf "${data:?}/$name"
    examples/export_hf.py --model "$model" --text "$text" --seq-len "$seq_len" \
      --num-seqs "${split##*:}" --split "$name" --shard-seqs 8 --dtype bf16 --out "$data/$name"
  fi
done
mpirun -np 2 build/kqsvd calibrate --force --model "$data/train/model.h5" --out "$data/proj.h5" \
  --checkpoint "$data/checkpoint" "$data"/train/shard-*.h5
mpirun -np 2 build/kqsvd evaluate --model "$data/validation/model.h5" --proj "$data/proj.h5" \
  --json "$data/report.json" --force "$data"/validation/shard-*.h5
# The unbalance study (Figure 2) on the same caches, then both figures.
examples/sweep_beta.sh --betas 1,2,5,10 --np 2 --model "$data/train/model.h5" \
  --calib "$data/train/shard-*.h5" --valid "$data/validation/shard-*.h5" --out "$data/beta" > /dev/null
"$KQSVD_PYTHON" examples/plot_reports.py "$data/report.json" "$data"/beta/report-beta*.json \
  --out "$data/figures"
if [ -n "$policies" ]; then
  # What the ranks cost the model, on the same validation windows.
  .venv/bin/python3 -m kqsvd.quality --model "$model" --text "$text" --proj "$data/proj.h5" \
    --ranks "$policies" --seq-len "$seq_len" --num-seqs "$valid" --json "$data/quality.json" \
    --plot "$data/figures/quality.png" --force
fi
echo "demo: $model done in $((SECONDS - t0)) s; figures in $data/figures" >&2
