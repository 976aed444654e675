#!/bin/sh
# The paper's unbalance study (Figure 2): calibrate and evaluate at several
# beta (keys x beta, queries / beta before Eigen's SVD; KQ-SVD and K-SVD do
# not change), writing one report per beta, then the figures.
#
#   examples/sweep_beta.sh [--betas 1,2,5,10] [--np N] --model MODEL.h5 \
#       --calib 'CALIB/*.h5' --valid 'VALID/*.h5' --out DIR
#
# DIR gets proj-betaB.h5, report-betaB.json for each B, and figure1.png /
# figure2.png when matplotlib is there.  KQSVD (default: build/kqsvd next to
# this script's folder), MPIEXEC (default: mpirun), MPIEXEC_FLAGS (say,
# --oversubscribe) and KQSVD_PYTHON (the Python for the figures; default: the
# first of python3 and /usr/bin/python3 that has matplotlib) may be set.
set -eu

here=$(cd "$(dirname "$0")/.." && pwd)
kqsvd=${KQSVD:-$here/build/kqsvd}
mpiexec=${MPIEXEC:-mpirun}
mpiflags=${MPIEXEC_FLAGS:-}
betas=1,2,5,10 np=2 model= calib= valid= out=

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case $1 in
    --betas) betas=$2; shift 2 ;;
    --np) np=$2; shift 2 ;;
    --model) model=$2; shift 2 ;;
    --calib) calib=$2; shift 2 ;;
    --valid) valid=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    -h|--help) usage ;;
    *) echo "sweep_beta.sh: unknown argument '$1'" >&2; usage ;;
  esac
done
[ -n "$model" ] && [ -n "$calib" ] && [ -n "$valid" ] && [ -n "$out" ] || usage
[ -x "$kqsvd" ] || { echo "sweep_beta.sh: $kqsvd not found; build first (./demo.sh or cmake)" >&2; exit 1; }
mkdir -p "$out"

reports=
for b in $(echo "$betas" | tr ',' ' '); do
  echo "== beta = $b"
  # The globs are expanded here, on purpose.
  # shellcheck disable=SC2086
  "$mpiexec" -np "$np" $mpiflags "$kqsvd" calibrate --force --progress off --beta "$b" --model "$model" \
    --out "$out/proj-beta$b.h5" $calib > "$out/calibrate-beta$b.log"
  rm -f "$out/report-beta$b.json"
  # shellcheck disable=SC2086
  "$mpiexec" -np "$np" $mpiflags "$kqsvd" evaluate --progress off --model "$model" \
    --proj "$out/proj-beta$b.h5" --json "$out/report-beta$b.json" $valid \
    > "$out/evaluate-beta$b.log"
  tail -n 5 "$out/evaluate-beta$b.log"
  reports="$reports $out/report-beta$b.json"
done

# Debian's python3-matplotlib lives under /usr/bin/python3, which need not be
# the python3 first on PATH (as in scripts/env.sh).
py=
for candidate in ${KQSVD_PYTHON:-} python3 /usr/bin/python3; do
  if "$candidate" -c "import matplotlib" 2>/dev/null; then py=$candidate; break; fi
done
# shellcheck disable=SC2086
if [ -n "$py" ]; then
  "$py" "$here/examples/plot_reports.py" $reports --out "$out"
else
  echo "sweep_beta.sh: no matplotlib; reports are in $out" >&2
fi
