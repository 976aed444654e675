# Sourced by the SmolLM2-135M benchmarks (head_groups.sh,
# frontier_smollm2.sh, held_out.sh) once they have parsed their options:
# the Python environments (scripts/hf-env.sh), Open MPI's settings, the
# model, the text (the bundled founding documents unless the script chose
# one) and the work folder $work; t0 starts the clock.  g3_post OUT
# calibrates the head-group latents (G = 3) with keys after RoPE, the form
# the tiers decode fastest in, in situ on 4 x 4,096 tokens of $text.
scripts/hf-env.sh
. scripts/env.sh
model=HuggingFaceTB/SmolLM2-135M-Instruct
text=${text:-examples/data/us-founding-documents.txt}
mkdir -p "$work"
t0=$SECONDS
g3_post() {
  mpirun -np 2 .venv/bin/python -m kqsvd.calibrate_hf --model "$model" --text "$text" \
    --seq-len "${calib_len:-4096}" --num-seqs 4 --keys post-rope --head-groups 3 --out "$1" --force
}
