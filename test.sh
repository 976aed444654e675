#!/usr/bin/env bash
# The whole test suite: builds with warnings as errors (installing what is
# missing; with the CUDA module when the CUDA toolkit is present) and runs
# every test under ctest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
# slurm-wlm and munge let the cluster test start a private single-node SLURM
# when none is running (as root); clang-format 14 is lint_c's (tests/lint.sh).
KQSVD_EXTRA_PACKAGES="slurm-wlm munge clang-format ${KQSVD_EXTRA_PACKAGES:-}" \
  KQSVD_CMAKE_ARGS="-DKQSVD_WERROR=ON ${KQSVD_CMAKE_ARGS:-}" scripts/bootstrap.sh
. scripts/env.sh
scripts/hf-env.sh  # the exporter's environment (.venv), for the real-model tests

# The CUDA module is part of the build wherever CMake finds nvcc (here in
# /usr/local/cuda), so it compiles and links in CI; its tests report
# SKIPPED where the driver shows no GPU.
build/kqsvd --version

ctest --test-dir build --output-on-failure -j"$(nproc)" "$@"
