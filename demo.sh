#!/usr/bin/env bash
# The default run: builds kqsvd (installing what is missing), makes a
# synthetic GQA cache set once (kept in data/demo), calibrates it on 2 MPI
# ranks and compares the three methods on the calibration data.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
scripts/bootstrap.sh
. scripts/env.sh
data=${KQSVD_DEMO_DIR:-data/demo}

if [ ! -f "$data/model.h5" ]; then
  build/kqsvd synth --out "$data" --layers 4 --heads 8 --kv-heads 2 --head-dim 64 \
    --seqs 48 --seq-len 512 --shards 6 --uneven --dtype bf16 --seed 1
fi
mpirun -np 2 build/kqsvd calibrate --model "$data/model.h5" --out "$data/proj.h5" \
  --checkpoint "$data/checkpoint" "$data"/shard-*.h5
"$KQSVD_PYTHON" examples/inspect_proj.py "$data/model.h5" "$data/proj.h5" "$data/shard-0000.h5"
