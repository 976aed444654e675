# Sourced by the SmolLM2-135M benchmarks (head_groups.sh,
# frontier_smollm2.sh, held_out.sh) once they have parsed their options:
# the Python environments (scripts/hf-env.sh), Open MPI's settings, the
# model, the text (the bundled founding documents unless the script chose
# one) and the work folder $work; t0 starts the clock.
scripts/hf-env.sh
. scripts/env.sh
model=HuggingFaceTB/SmolLM2-135M-Instruct
text=${text:-examples/data/us-founding-documents.txt}
mkdir -p "$work"
t0=$SECONDS
