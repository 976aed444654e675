#!/usr/bin/env bash
# The default run, on a real model: builds kqsvd (installing what is
# missing), prepares the exporter's environment (.venv), exports
# all-MiniLM-L6-v2's attention caches on the bundled public-domain text
# (calibration from its start, validation from its end; kept in data/minilm
# so the second run is fast), calibrates on 2 MPI ranks, evaluates the three
# methods side by side, and draws the paper's figures into data/minilm/figures.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
scripts/bootstrap.sh
. scripts/env.sh
scripts/hf-env.sh
data=${KQSVD_DEMO_DIR:-data/minilm}
text=examples/data/us-founding-documents.txt
model=sentence-transformers/all-MiniLM-L6-v2

for split in train:40 validation:16; do
  name=${split%%:*}
  if [ ! -f "$data/$name/model.h5" ]; then  # written last: absent means not done
    rm -rf "${data:?}/$name"
    examples/export_hf.py --model "$model" --text "$text" --seq-len 128 --num-seqs "${split##*:}" \
      --split "$name" --shard-seqs 8 --dtype bf16 --out "$data/$name"
  fi
done
mpirun -np 2 build/kqsvd calibrate --force --model "$data/train/model.h5" --out "$data/proj.h5" \
  --checkpoint "$data/checkpoint" "$data"/train/shard-*.h5
mpirun -np 2 build/kqsvd evaluate --model "$data/validation/model.h5" --proj "$data/proj.h5" \
  --json "$data/report.json" "$data"/validation/shard-*.h5
# The unbalance study (Figure 2) on the same caches, then both figures.
examples/sweep_beta.sh --betas 1,2,5,10 --np 2 --model "$data/train/model.h5" \
  --calib "$data/train/shard-*.h5" --valid "$data/validation/shard-*.h5" --out "$data/beta" > /dev/null
"$KQSVD_PYTHON" examples/plot_reports.py "$data/report.json" "$data"/beta/report-beta*.json \
  --out "$data/figures"
