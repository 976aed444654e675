#!/usr/bin/env bash
# The package as a user gets it (ctest's package_wheel): builds the sdist,
# then the wheel from the sdist (python -m build, scikit-build-core and
# CMake), installs the wheel into a new virtual environment outside the
# repository (its numpy and h5py from PyPI), and there, with no build/ and
# no KQSVD_* variables, runs the console scripts (--help without torch),
# the kqsvd executable (synth, calibrate), a model command refusing in one
# line for want of torch, a rank policy through
# kqsvd.load_projections and kqsvd.Calibrator against numpy, and checks the
# one-line message for a missing system library; then an in-situ
# calibration of a tiny random Llama in a second new environment that
# borrows torch and transformers from the checkout's .venv.
#   tests/wheel_smoke.sh WORKDIR
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
work=${1:?usage: tests/wheel_smoke.sh WORKDIR}
py=$root/.venv/bin/python3
[ -x "$py" ] && "$py" -c "import build" 2>/dev/null || { echo "wheel_smoke: no .venv with build (scripts/hf-env.sh)"; exit 77; }
rm -rf "$work" && mkdir -p "$work"
cd "$root"
"$py" -m build --outdir "$work/dist" . > "$work/build.log" 2>&1 || { tail -30 "$work/build.log"; exit 1; }
ls "$work"/dist
sdist=$(ls "$work"/dist/kqsvd-*.tar.gz) wheel=$(ls "$work"/dist/kqsvd-*.whl)
# the sdist holds the C sources, not the checkout's data or builds
tar tzf "$sdist" | grep -q "/src/core/tpqr.c$" && ! tar tzf "$sdist" | grep -q -E "/(data|build[^/]*|\.venv)/"
# a Python 3 wheel for this platform, holding the executable and the library
case $(basename "$wheel") in *-py3-none-linux_*.whl) ;; *) echo "wheel_smoke: unexpected tag $wheel"; exit 1 ;; esac

/usr/bin/python3 -m venv "$work/venv"
v=$work/venv/bin
"$v/pip" install -q --disable-pip-version-check "$wheel"
cd "$work"
unset KQSVD_BIN KQSVD_LIBRARY KQSVD_PYTHON KQSVD_GPU_MODULE
export PATH="$v:$PATH" OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
"$v/python3" - "$work" <<'PY'
import os, sys
import kqsvd
here = os.path.dirname(kqsvd.__file__)
assert here.startswith(sys.argv[1]), f"kqsvd imported from {here}, not the new environment"
print("kqsvd", kqsvd.__version__, "from", here)
PY
for c in kqsvd-quality kqsvd-allocate kqsvd-calibrate-hf kqsvd-frontier kqsvd-export; do
  "$v/$c" --help > /dev/null
  "$v/python3" -c "import sys, runpy; sys.argv = ['$c', '--help']
try:
    runpy.run_path('$v/$c', run_name='__main__')
except SystemExit:
    pass
assert 'torch' not in sys.modules, '$c --help imports torch'" > /dev/null
done
"$v/kqsvd" --version
"$v/kqsvd" synth --out syn --layers 2 --heads 4 --kv-heads 2 --head-dim 8 --hidden 32 --seqs 4 \
  --seq-len 64 --min-seq-len 64 --shards 2 --progress off
mpirun -np 2 "$v/kqsvd" calibrate --model syn/model.h5 --out proj.h5 --progress off syn/shard-*.h5
"$v/python3" - <<'PY'
import numpy as np
import kqsvd
from kqsvd import Calibrator  # the documented name (docs/guide/c-library.md)
assert Calibrator is kqsvd.Calibrator
p = kqsvd.load_projections("proj.h5", "kqsvd", ranks="fixed:4")
assert list(p.rank_k) == [4, 4], p.rank_k
print("rank policy fixed:4 through", kqsvd.native.binary())
x = np.random.default_rng(0).standard_normal((100, 8))
c = Calibrator(layers=1, kv_heads=1, q_per_kv=1, head_dim=8, hidden=8, block_rows=16)
c.absorb("keys", 0, 0, x)
R = c.factor("keys", 0, 0)
assert np.allclose(R.T @ R, x.T @ x, rtol=1e-12, atol=1e-10), "R^T R is not X^T X"
print("Calibrator: R^T R = X^T X")
PY
# This environment has no torch: a model command says so in one line, exit 1.
set +e
msg=$("$v/kqsvd-quality" --model syn --text "$root/README.md" --proj proj.h5 --ranks fixed:2 \
  --json q.json 2>&1); rc=$?
set -e
[ "$rc" = 1 ] && [ "$(echo "$msg" | wc -l)" = 1 ] && echo "$msg" | grep -q "pip install 'kqsvd\[torch\]'" &&
  [ ! -e q.json ] || { echo "wheel_smoke: kqsvd-quality without torch gave (exit $rc): $msg"; exit 1; }
echo "without torch: $msg"
# A system library missing under libkqsvd.so: one line naming it, exit 1.
mkdir fake
echo 'int gone(void) { return 0; }' > fake/gone.c
gcc -shared -fPIC -o fake/libgone.so.1 -Wl,-soname,libgone.so.1 fake/gone.c
echo 'int gone(void); int fake(void) { return gone(); }' > fake/k.c
gcc -shared -fPIC -o fake/libkqsvd.so fake/k.c -Lfake -l:libgone.so.1
rm fake/libgone.so.1
set +e
msg=$(KQSVD_LIBRARY=$work/fake/libkqsvd.so "$v/kqsvd" --version 2>&1); rc=$?
set -e
[ "$rc" = 1 ] && [ "$(echo "$msg" | wc -l)" = 1 ] && echo "$msg" | grep -q "needs libgone.so.1" ||
  { echo "wheel_smoke: a missing library gave (exit $rc): $msg"; exit 1; }
echo "missing library: $msg"

# In-situ calibration of a tiny random Llama (its tokenizer made from the
# text), in a second new environment: the system's numpy and h5py (as
# .venv has them), .venv's torch and transformers after its own packages
# (a .pth line appends to sys.path; the checkout's kqsvd-checkout.pth is
# not read), and the wheel.
/usr/bin/python3 -m venv --system-site-packages "$work/venv-torch"
v=$work/venv-torch/bin
"$v/pip" install -q --disable-pip-version-check --no-deps "$wheel"
site=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
vsite=$("$v/python3" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
printf '%s\n' "$site" > "$vsite/zz-torch-from-checkout.pth"
export PATH="$v:$PATH"
text=$root/examples/data/us-founding-documents.txt
"$v/python3" - "$text" <<'PY'
import sys
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
tok.train([sys.argv[1]], trainers.WordLevelTrainer(vocab_size=500, special_tokens=["[UNK]"]))
fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
fast.save_pretrained("tiny")
torch.manual_seed(0)
LlamaForCausalLM(LlamaConfig(vocab_size=fast.vocab_size, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=128)).save_pretrained("tiny")
PY
"$v/kqsvd-calibrate-hf" --model tiny --text "$text" --seq-len 32 --num-seqs 4 --out insitu.h5
"$v/kqsvd" ranks --proj insitu.h5 --ranks fixed:2 > /dev/null
echo "wheel_smoke: the sdist, the wheel and a new environment work"
