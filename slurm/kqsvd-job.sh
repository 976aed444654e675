# Sourced by the job templates (calibrate.sbatch, evaluate.sbatch,
# export.sbatch).  Finds kqsvd, picks the launcher, and in array mode (set
# up by kqsvd-submit) the task's model, its log and its status file.
#
# Environment:
#   KQSVD          the kqsvd executable [KQSVD_ROOT/build/kqsvd]
#   KQSVD_ROOT     the repository [the folder sbatch was run from]
#   KQSVD_LAUNCH   mpirun (default: one rank per SLURM task), srun, or a
#                  whole command such as "srun --mpi=pmix"
#   KQSVD_MANIFEST_TSV, KQSVD_LOGDIR, KQSVD_CKPT_DIR   set by kqsvd-submit

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

# Array mode: reads line SLURM_ARRAY_TASK_ID + 1 of the resolved manifest
# into job_name, job_model, job_output, job_policy, job_shards, job_valid,
# sends everything after this point to LOGDIR/NAME.KIND.log, and records
# the exit code in LOGDIR/NAME.KIND.status for kqsvd-submit --wait.
kqsvd_array_task() {
  local kind=$1 line
  line=$(sed -n "$((SLURM_ARRAY_TASK_ID + 1))p" "$KQSVD_MANIFEST_TSV")
  [ -n "$line" ] || { echo "kqsvd job: no line $((SLURM_ARRAY_TASK_ID + 1)) in $KQSVD_MANIFEST_TSV" >&2; exit 1; }
  IFS=$'\t' read -r job_name job_model job_output job_policy _ job_shards job_valid <<<"$line"
  exec >>"$KQSVD_LOGDIR/$job_name.$kind.log" 2>&1
  echo "== $(date '+%F %T') $kind of $job_name: job ${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID} on ${SLURM_NTASKS:-1} tasks ($(hostname -s))"
  status_file=$KQSVD_LOGDIR/$job_name.$kind.status
  trap 'echo $? > "$status_file"' EXIT
}
