# Sourced by the job templates (calibrate.sbatch, evaluate.sbatch,
# export.sbatch).  Finds kqsvd, picks the launcher, and in array mode (set
# up by kqsvd-submit) the task's model, its log and its status file.
#
# Environment:
#   KQSVD          the kqsvd executable [KQSVD_ROOT/build/kqsvd]
#   KQSVD_ROOT     the repository [the folder sbatch was run from]
#   KQSVD_LAUNCH   mpirun (default: one rank per SLURM task), srun, or a
#                  whole command such as "srun --mpi=pmix"
#   KQSVD_SUBMISSION, KQSVD_LOGDIR, KQSVD_CKPT_DIR   set by kqsvd-submit

KQSVD_ROOT=${KQSVD_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}
KQSVD=${KQSVD:-$KQSVD_ROOT/build/kqsvd}
if [ "$(id -u)" -eq 0 ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi

kqsvd_launch() {
  case ${KQSVD_LAUNCH:-mpirun} in
    mpirun) mpirun "$@" ;;
    srun) srun "$@" ;;
    *) ${KQSVD_LAUNCH} "$@" ;;
  esac
}

# Array mode: reads line SLURM_ARRAY_TASK_ID + 1 of the submission's
# resolved manifest into job_name, job_model, job_output, job_policy and
# job_valid (the paths of the model's files are in SUBMISSION/NAME.shards
# and NAME.valid, one per line), sends everything after this point to
# LOGDIR/NAME.KIND.log, and marks LOGDIR/NAME.KIND.status as started: only
# kqsvd_task_end writes an exit code there, so a job that SLURM cancels or
# times out never reads as a success.
kqsvd_array_task() {
  local kind=$1 line tsv=$KQSVD_SUBMISSION/manifest.tsv
  line=$(sed -n "$((SLURM_ARRAY_TASK_ID + 1))p" "$tsv")
  [ -n "$line" ] || { echo "kqsvd job: no line $((SLURM_ARRAY_TASK_ID + 1)) in $tsv" >&2; exit 1; }
  IFS=$'\t' read -r job_name job_model job_output job_policy _ _ job_valid <<<"$line"
  status_file=$KQSVD_LOGDIR/$job_name.$kind.status
  echo "started by job ${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}, no exit code: killed?" > "$status_file"
  exec >>"$KQSVD_LOGDIR/$job_name.$kind.log" 2>&1
  echo "== $(date '+%F %T') $kind of $job_name: job ${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID} on ${SLURM_NTASKS:-1} tasks ($(hostname -s))"
}

# Runs a command, records its exit code in the status file, exits with it.
kqsvd_task_end() {
  local rc=0
  "$@" || rc=$?
  echo "$rc" > "$status_file"
  echo "== $(date '+%F %T') exit code $rc"
  exit "$rc"
}
