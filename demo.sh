#!/usr/bin/env bash
# The default run: builds kqsvd (installing what is missing), makes a
# synthetic GQA model's calibration and validation caches once (kept in
# data/demo), calibrates on 2 MPI ranks, evaluates the three methods on the
# validation set and draws the paper's Figure 1 into data/demo/figures.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
scripts/bootstrap.sh
. scripts/env.sh
data=${KQSVD_DEMO_DIR:-data/demo}
shape=(--layers 4 --heads 8 --kv-heads 2 --head-dim 64 --seq-len 512 --dtype bf16 --seed 1)

if [ ! -f "$data/valid/model.h5" ]; then
  build/kqsvd synth --out "$data/calib" "${shape[@]}" --seqs 48 --shards 6 --uneven
  # The same model, 16 further sequences: disjoint from the calibration set.
  build/kqsvd synth --out "$data/valid" "${shape[@]}" --seqs 16 --shards 2 --skip-seqs 48
fi
mpirun -np 2 build/kqsvd calibrate --model "$data/calib/model.h5" --out "$data/proj.h5" \
  --checkpoint "$data/checkpoint" "$data"/calib/shard-*.h5
mpirun -np 2 build/kqsvd evaluate --model "$data/valid/model.h5" --proj "$data/proj.h5" \
  --json "$data/report.json" "$data"/valid/shard-*.h5
"$KQSVD_PYTHON" examples/plot_reports.py "$data/report.json" --out "$data/figures"
