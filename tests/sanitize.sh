#!/usr/bin/env bash
# The sanitizer job (CI runs it after ./test.sh): builds everything with
# AddressSanitizer + UndefinedBehaviorSanitizer (-DKQSVD_SANITIZE=ON) into
# build-asan/, runs the unit tests, the MPI tests and the end-to-end
# scenarios that cover calibrate, evaluate, checkpoint/resume, manifests
# and bad input there, then fuzzes the readers (tests/fuzz_readers.py).
# Any sanitizer report fails it, also from a run whose non-zero exit a test
# expected: reports go to files (log_path), which are checked at the end.
#
#   tests/sanitize.sh                 both parts
#   tests/sanitize.sh --no-fuzz       the tests only
#   tests/sanitize.sh --fuzz-only     the fuzzer only (builds first)
#   KQSVD_FUZZ_ARGS="--count 500"     more mutants (tests/fuzz_readers.py --help)
#   KQSVD_SANITIZE_TESTS=REGEX        another ctest selection
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$PWD
tests=1 fuzz=1
for a in "$@"; do
  case $a in
    --no-fuzz) fuzz=0 ;;
    --fuzz-only) tests=0 ;;
    *) echo "usage: tests/sanitize.sh [--no-fuzz | --fuzz-only]" >&2; exit 2 ;;
  esac
done

# The packages (and build/, which is up to date after ./test.sh).
scripts/bootstrap.sh >/dev/null
. scripts/env.sh

t0=$SECONDS
# Warnings are not errors here: GCC warns differently with -fsanitize.
cmake -S "$root" -B "$root/build-asan" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKQSVD_SANITIZE=ON \
  -DKQSVD_CUDA=OFF -DKQSVD_WERROR=OFF >/dev/null
cmake --build "$root/build-asan" -j"$(nproc)" >/dev/null
echo "sanitize: built build-asan/ in $((SECONDS - t0)) s"

# Runtime settings.  Reports go to files under $logs (every process: ranks
# under mpirun, forked children), each ends its process with exit 86, and
# UBSan does not recover.  Leaks are checked, except those of Open MPI and
# the libraries under it (tests/lsan.supp), which needs the slow unwinder.
# Dynamic TLS is not tracked (intercept_tls_get_addr=0): GCC 12's
# LeakSanitizer reads glibc's DTV, whose layout Debian 12's glibc update
# (2.36-9+deb12u14) changed, and its tracer then dies on a bogus range
# before any leak is checked.  Untracked, DTLS blocks are plain heap blocks
# reachable from the DTV, so leaks are still found.
logs=$root/build-asan/sanitizer-logs
rm -rf "$logs" && mkdir -p "$logs"
export ASAN_OPTIONS="exitcode=86:detect_leaks=1:fast_unwind_on_malloc=0:check_initialization_order=1:intercept_tls_get_addr=0:log_path=$logs/asan"
export UBSAN_OPTIONS="exitcode=86:halt_on_error=1:print_stacktrace=1:log_path=$logs/ubsan"
export LSAN_OPTIONS="suppressions=$root/tests/lsan.supp:print_suppressions=0"
export OPENBLAS_NUM_THREADS=1

status=0
if [ "$tests" = 1 ]; then
  t1=$SECONDS
  # e2e_signals expects kqsvd's own crash line, which sanitizer builds
  # leave to the sanitizer.
  select=${KQSVD_SANITIZE_TESTS:-'^(unit_.*|mpi_.*|e2e_(types|degenerate|bad_input|checkpoint|checkpoints|eval_reference|eval_bad_input|manifest|manifest_reader|hostile_files|few_rows|options|head_groups))$'}
  ctest --test-dir "$root/build-asan" --output-on-failure -j"$(nproc)" -R "$select" || status=1
  # Every report fails, but those inside libhdf5 in the child process that
  # kqsvd forks to read a damaged file's headers (io/isolate.c): there a
  # crash is expected and becomes one clear error.
  "$KQSVD_PYTHON" tests/fuzz_readers.py --check-logs "$logs" || status=1
  echo "sanitize: tests took $((SECONDS - t1)) s"
fi

if [ "$fuzz" = 1 ]; then
  t2=$SECONDS
  # shellcheck disable=SC2086
  "$KQSVD_PYTHON" tests/fuzz_readers.py --kqsvd "$root/build-asan/kqsvd" \
    --work "$root/build-asan/fuzz" ${KQSVD_FUZZ_ARGS:-} || status=1
  echo "sanitize: fuzzing took $((SECONDS - t2)) s"
fi
echo "sanitize: $([ $status = 0 ] && echo passed || echo FAILED) in $((SECONDS - t0)) s"
exit $status
