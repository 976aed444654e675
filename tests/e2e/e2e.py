"""End-to-end scenarios: `python3 e2e.py SCENARIO` (ctest runs each one).

types       every element type decoded bit for bit; mixed-type sets
reference   a GQA bf16 set on uneven shards vs the independent reference
ranks       results independent of the rank count (1, 2, 3, 4, 7)
shards      ... and of shard, read and QR block sizes (one shard split by MPI-IO too)
theorems    the paper's theorems on the tool's output
degenerate  all-zero and rank-deficient heads
bad_input   one clear message, non-zero exit, no output, no hang
checkpoint  a killed run resumes and ends with identical output
examples    examples/compress_cache.py and examples/inspect_proj.py
disk_full   a full disk while writing the output (needs root for a tmpfs)
eval_reference  evaluate vs a brute-force reference (causal GQA, MHA, degenerate heads)
eval_ranks      ... independent of rank count and row blocks
eval_policies   rank policies (eps, fixed, budget) in calibrate and evaluate
eval_bad_input  evaluate's errors
eval_memory     4096-token sequences in bounded memory, flat in the number of sequences
figures         examples/sweep_beta.sh and plot_reports.py (needs matplotlib)
manifest        calibrate --manifest under mpirun -np 3; manifest errors; skipping done models
slurm           slurm/kqsvd-submit on a real SLURM, with kill-and-resume (needs slurm-wlm)
hf_export       examples/export_hf.py reproduces the attention of real and tiny models (.venv)
hf_export_runs  export_hf.py resumes after a crash; batches, device maps, BOS, weight types (.venv)
hf_minilm       all-MiniLM-L6-v2 exported, calibrated, evaluated vs the reference (.venv)
few_rows        more ranks than rows (np 6, 8, 13 on 5 rows): no hang, the 1-rank result
options         output and checkpoint arguments refused before any work
synth_outputs   synth --out: an existing set kept without --force, replaced whole with it; not a folder
apt_lock        scripts/apt-install.sh waits for another apt holding its locks, within a bound (root)
skip_done       --skip-done sees a shard rewritten with the same size and mtime
hostile_files   overflowing seq_lens, mistagged bf16, virtual and external data, long strings
checkpoints     damaged checkpoints refused by name; an intact one resumes bit for bit
signals         SIGUSR1/SIGTERM: checkpoint, exit 75, bit-identical resume; no leftovers
examples_usage  compress_cache.py's usage errors and one-line bad-input errors
manifest_reader hostile and large manifests: special files, control characters, every bad line
slurm_scripts   the SLURM job scripts against stand-ins: requeue on exit 75, NUL-separated lists
gpu             calibrate --device cuda against --device cpu (needs a GPU and -DKQSVD_CUDA=ON)
ranks_cmd       kqsvd ranks: stored and policy ranks equal calibrate's and evaluate's; errors
nompi           help, --version, manifest and ranks where MPI cannot start; calibrate fails there
gpu_abi         the CUDA module loader refuses stand-ins of another ABI version or without a table
accumulator     the public accumulator fed row by row equals calibrate bit for bit
calibrate_ref   calibrate equals outputs made before it ran on the accumulator
pipeline        calibrate and evaluate as library calls equal the command line, 1 and 3 ranks
head_ranks      per-(layer, KV head) ranks in proj.h5: evaluate vs the reference, ranks, errors
head_groups     calibrate --head-groups vs an independent reference, 1 and 3 ranks; errors
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from scenarios_data import (bad_input, checkpoint, degenerate, disk_full, examples,  # noqa: E402
                            types)
from scenarios_eval import (eval_bad_input, eval_memory, eval_policies, eval_ranks,  # noqa: E402
                            eval_reference, figures)
from scenarios_math import gpu, ranks, reference, shards, theorems  # noqa: E402
from scenarios_qr import qr_gram, qr_scalapack  # noqa: E402
from scenarios_head_ranks import head_ranks  # noqa: E402
from scenarios_groups import head_groups  # noqa: E402
from scenarios_hardening import (checkpoints, few_rows, hostile_files, options,  # noqa: E402
                                 signals, skip_done, synth_outputs)
from scenarios_examples import examples_usage  # noqa: E402
from scenarios_hf import hf_export, hf_export_runs, hf_minilm  # noqa: E402
from scenarios_library import accumulator, calibrate_ref, pipeline  # noqa: E402
from scenarios_manifest import manifest_reader  # noqa: E402
from scenarios_nompi import gpu_abi, nompi  # noqa: E402
from scenarios_ranks import ranks_cmd  # noqa: E402
from scenarios_setup import apt_lock  # noqa: E402
from scenarios_slurm import manifest, slurm, slurm_scripts  # noqa: E402

SCENARIOS = {f.__name__: f for f in
             (types, reference, ranks, shards, theorems, degenerate, bad_input, checkpoint,
              nompi, gpu_abi,
              examples, disk_full, eval_reference, eval_ranks, eval_policies, eval_bad_input,
              eval_memory, figures, manifest, slurm, hf_export, hf_export_runs, hf_minilm, qr_gram,
              qr_scalapack, gpu, few_rows, options, skip_done, hostile_files, checkpoints,
              signals, examples_usage, manifest_reader, slurm_scripts, ranks_cmd, accumulator,
              calibrate_ref, pipeline, head_ranks, head_groups, synth_outputs, apt_lock)}

if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in SCENARIOS:
        raise SystemExit(__doc__)
    SCENARIOS[sys.argv[1]]()
