#!/usr/bin/env bash
# Issue 50's device run, prepared so that one call gives every figure in
# under 8 minutes of device time (run it from the repository's root):
#   1. the Triton decode kernels' tests on CUDA tensors (test_gpu.TritonOnTheGPU);
#   2. decode throughput, Llama's 7-8B shape in bf16 at 8k, 16k, 32k tokens
#      and batch 1, 8, 16: the full cache (SDPA, DynamicCache), kqsvd's
#      quarter read by the kernels, transformers' QuantizedCache int4 over
#      HQQ and over optimum-quanto (bench/gpu_decode.py; the (16k, 8) point
#      first, the rest while its budget lasts);
#   3. in-situ calibration's cost over the forward pass, 7B shape, Gram fold,
#      and where its time goes (bench/gpu_insitu.py --profile).
# HQQ, termcolor and optimum-quanto are not on the device's image: their
# wheels travel in .whl (pip download --no-deps optimum-quanto==0.2.7
# termcolor -d .whl; pip wheel --no-deps hqq==0.2.8.post1 -w .whl) and are
# installed into /tmp/site.  quanto compiles its CUDA extension on first
# use; it is built here in the background while the tests and the other
# rows run, and its rows run last, once it is there.
# With --cache-budget BYTES, step 2 runs each configuration at the largest
# batch whose measured cache fits BYTES, at each of --contexts (8192 by
# default), in place of the fixed points (bench/cache_budget.py).
# Outputs: $OUT (the device tool's folder) or bench-out/.
#
#   bench/gpu_decode.sh [--cache-budget 24GiB [--contexts 8192,16384]]
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
out=${OUT:-$root/bench-out}
mkdir -p "$out"
py=${PYTHON:-python3}
mode=()
while [ $# -gt 0 ]; do
  case $1 in
    --cache-budget|--contexts) [ $# -ge 2 ] || { echo "gpu_decode.sh: $1 needs a value" >&2; exit 2; }
                               mode+=("$1" "$2"); shift 2 ;;
    *) echo "gpu_decode.sh: unknown option $1 (--cache-budget BYTES, --contexts N,...)" >&2; exit 2 ;;
  esac
done
export PYTHONPATH=$root/python${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
t0=$SECONDS
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/device.txt"
ready=/tmp/quanto-cuda.ready
rm -f "$ready"
(MAX_JOBS=8 timeout 420 $py -c "from optimum.quanto.library.extensions import get_extension
get_extension('quanto_cuda').lib" >"$out/quanto-build.txt" 2>&1 && touch "$ready") &
timeout 150 $py python/tests/run.py test_gpu.TritonOnTheGPU 2>&1 | tee "$out/tests.txt" | tail -n 4
echo "gpu_decode.sh: tests done at $((SECONDS - t0)) s"
timeout 300 $py bench/gpu_decode.py --budget-s 240 --json "$out/gpu_decode.json" --force \
  --quanto-ready "$ready" "${mode[@]}" 2>&1 | grep -v Warning | tee "$out/gpu_decode.txt"
echo "gpu_decode.sh: decode done at $((SECONDS - t0)) s"
timeout 90 $py bench/gpu_insitu.py --models llama7b --methods gram --windows 6 --profile 2>&1 |
  tee "$out/gpu_insitu.txt"
kill %1 2>/dev/null
echo "gpu_decode.sh: done in $((SECONDS - t0)) s"
