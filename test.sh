#!/usr/bin/env bash
# The whole test suite: builds with warnings as errors (installing what is
# missing), runs every test under ctest, and checks that the optional CUDA
# backend still compiles and links when the CUDA toolkit is present.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
# slurm-wlm and munge let the cluster test start a private single-node SLURM
# when none is running (as root).
KQSVD_EXTRA_PACKAGES="slurm-wlm munge ${KQSVD_EXTRA_PACKAGES:-}" \
  KQSVD_CMAKE_ARGS="-DKQSVD_WERROR=ON ${KQSVD_CMAKE_ARGS:-}" scripts/bootstrap.sh
. scripts/env.sh
scripts/hf-env.sh  # the exporter's environment (.venv), for the real-model tests

nvcc=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null || true)
if [ -n "$nvcc" ]; then
  echo "test.sh: building the CUDA backend (-DKQSVD_CUDA=ON) with $nvcc"
  cmake -S . -B build-cuda -DKQSVD_CUDA=ON -DKQSVD_WERROR=ON \
    -DCMAKE_CUDA_COMPILER="$nvcc" >/dev/null
  cmake --build build-cuda -j"$(nproc)" >/dev/null
  build-cuda/kqsvd --version
  # The GPU tests: they report SKIPPED where no device is visible.
  ctest --test-dir build-cuda -R gpu --output-on-failure
else
  echo "test.sh: CUDA backend build SKIPPED (no nvcc on this machine)"
fi

ctest --test-dir build --output-on-failure -j"$(nproc)" "$@"
