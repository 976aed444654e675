# Sourced by the job templates (calibrate.sbatch, calibrate_hf.sbatch,
# evaluate.sbatch, export.sbatch).  Finds kqsvd, picks the launcher, passes on the signals
# SLURM sends before a time limit or on preemption, and in array mode (set
# up by kqsvd-submit) finds the task's model, its log and its status file.
#
# Environment:
#   KQSVD          the kqsvd executable [KQSVD_ROOT/build/kqsvd]
#   KQSVD_ROOT     the repository [the folder sbatch was run from]
#   KQSVD_LAUNCH   mpirun (default: one rank per SLURM task), srun, or a
#                  whole command such as "srun --mpi=pmix"
#   KQSVD_HF_PYTHON  the Python of the model jobs [KQSVD_ROOT/.venv/bin/python3]
#   KQSVD_REQUEUE  1: a calibration stopped by the time-limit signal (exit
#                  status 75, checkpoint saved) requeues its job [0]
#   KQSVD_SUBMISSION, KQSVD_LOGDIR, KQSVD_CKPT_DIR   set by kqsvd-submit

KQSVD_ROOT=${KQSVD_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}
KQSVD=${KQSVD:-$KQSVD_ROOT/build/kqsvd}
if [ "$(id -u)" -eq 0 ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
# The exit status of a kqsvd run stopped by a signal after saving its
# checkpoint (EX_TEMPFAIL): the same command, run again, resumes.
KQSVD_EXIT_INTERRUPTED=75

# shellcheck disable=SC2206
launcher=(${KQSVD_LAUNCH:-mpirun})

kqsvd_launch() { "${launcher[@]}" "$@"; }

# Runs the launcher in the background, so that this shell can take the
# signals SLURM sends it: USR1 some time before the time limit (the
# templates' --signal=B:USR1@LEAD) and TERM on preemption or scancel.  Both
# go on to the launcher as USR1, the signal mpirun and srun forward to the
# ranks (mpirun kills them soon after a TERM): kqsvd calibrate then saves
# its checkpoint and exits with 75.  Sets kqsvd_rc, and kqsvd_signal to the
# first signal taken (USR1 or TERM; empty when none).
kqsvd_launch_signalled() {
  kqsvd_signal="" kqsvd_rc=0 kqsvd_child=""
  # Before the launcher starts: a signal in between would end this shell.
  trap 'kqsvd_pass_on USR1' USR1
  trap 'kqsvd_pass_on TERM' TERM
  "${launcher[@]}" "$@" &
  kqsvd_child=$!
  [ -z "$kqsvd_signal" ] || kill -USR1 "$kqsvd_child" 2>/dev/null || true
  # A signal ends `wait` early; wait again until the launcher has exited.
  while :; do
    kqsvd_rc=0
    wait "$kqsvd_child" || kqsvd_rc=$?
    kill -0 "$kqsvd_child" 2>/dev/null || break
  done
  trap - USR1 TERM
}

kqsvd_pass_on() {
  kqsvd_signal=${kqsvd_signal:-$1}
  echo "== $(date '+%F %T') SIG$1: passing it on to the ranks as SIGUSR1"
  [ -z "$kqsvd_child" ] || kill -USR1 "$kqsvd_child" 2>/dev/null || true
}

# After kqsvd_launch_signalled: whether to requeue, i.e. the run saved its
# checkpoint because the time limit is near (USR1; on TERM it was cancelled,
# or SLURM itself requeues a preempted job) and requeueing is on.
kqsvd_should_requeue() {
  [ "$kqsvd_rc" = "$KQSVD_EXIT_INTERRUPTED" ] && [ "$kqsvd_signal" = USR1 ] &&
    [ "${KQSVD_REQUEUE:-0}" = 1 ] && [ -n "${SLURM_JOB_ID:-}" ]
}

# Requeues this job.  SLURM takes the requeue at once and ends this
# script soon after; a failing requeue (a job submitted with --no-requeue)
# leaves the exit status 75 and says how to resume.
kqsvd_requeue() {
  echo "== $(date '+%F %T') checkpoint saved before the time limit: requeueing job $SLURM_JOB_ID," \
       "it resumes from the checkpoint"
  scontrol requeue "$SLURM_JOB_ID" && return 0
  echo "== scontrol requeue $SLURM_JOB_ID failed: submit the same job again to resume"
  return 1
}

# The Python that runs the model jobs (python -m kqsvd.calibrate_hf,
# kqsvd.quality): KQSVD_HF_PYTHON [the repository's .venv, made by
# scripts/hf-env.sh], with the repository's package on its path.  Sets
# kqsvd_python; fails with a message when it is missing.
kqsvd_hf_python() {
  kqsvd_python=${KQSVD_HF_PYTHON:-$KQSVD_ROOT/.venv/bin/python3}
  [ -x "$kqsvd_python" ] || {
    echo "kqsvd job: $kqsvd_python not found: run scripts/hf-env.sh or set KQSVD_HF_PYTHON" >&2
    exit 1
  }
  export PYTHONPATH=$KQSVD_ROOT/python${PYTHONPATH:+:$PYTHONPATH}
}

# Array mode: reads line SLURM_ARRAY_TASK_ID + 1 of the submission's
# resolved manifest (`kqsvd manifest`'s 8 fields) into job_name,
# job_model, job_output, job_policy, job_count, job_inputs, job_valid and
# job_seq_len.  A cache line's job_model is its MODEL_H5 and the paths of
# its files are in SUBMISSION/NAME.shards and NAME.valid, each followed by
# a NUL byte (kqsvd_read_list); an in-situ line's job_model is hf:MODEL,
# job_inputs its TEXT, job_valid its VALID_TEXT (or -), job_count and
# job_seq_len its NUM_SEQS and SEQ_LEN.  Sends
# everything after this point to LOGDIR/NAME.KIND.log, and marks
# LOGDIR/NAME.KIND.status as started: only kqsvd_task_end writes an exit
# code there, so a job that SLURM cancels or times out never reads as a
# success.
kqsvd_array_task() {
  local kind=$1 line tsv=$KQSVD_SUBMISSION/manifest.tsv
  line=$(sed -n "$((SLURM_ARRAY_TASK_ID + 1))p" "$tsv")
  [ -n "$line" ] || { echo "kqsvd job: no line $((SLURM_ARRAY_TASK_ID + 1)) in $tsv" >&2; exit 1; }
  IFS=$'\t' read -r job_name job_model job_output job_policy job_count job_inputs job_valid \
    job_seq_len <<<"$line"
  status_file=$KQSVD_LOGDIR/$job_name.$kind.status
  echo "started by job ${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}, no exit code: killed?" > "$status_file"
  exec >>"$KQSVD_LOGDIR/$job_name.$kind.log" 2>&1
  echo "== $(date '+%F %T') $kind of $job_name: job ${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}" \
       "on ${SLURM_NTASKS:-1} tasks ($(hostname -s)), run $((${SLURM_RESTART_COUNT:-0} + 1))"
}

# The paths of a list written by `kqsvd manifest --lists` into the array
# shards: NUL-separated, so no file name can add or shift an argument.
kqsvd_read_list() {
  mapfile -d '' -t shards < "$1"
}

# Runs a command through kqsvd_launch_signalled, records its exit code in
# the status file (array mode) and exits with it.  A requeued run's status
# says so (written first: SLURM may end this script as it requeues) until
# the next run overwrites it.
kqsvd_task_end() {
  kqsvd_launch_signalled "$@"
  if kqsvd_should_requeue; then
    [ -z "${status_file:-}" ] ||
      echo "requeued after exit code $kqsvd_rc (checkpoint saved)" > "$status_file"
    kqsvd_requeue && exit "$kqsvd_rc"
  fi
  [ -z "${status_file:-}" ] || echo "$kqsvd_rc" > "$status_file"
  echo "== $(date '+%F %T') exit code $kqsvd_rc${kqsvd_signal:+ (after SIG$kqsvd_signal)}"
  exit "$kqsvd_rc"
}
