#!/bin/sh
"true" '''\'
# Runs with the repository's .venv (scripts/hf-env.sh), else python3.
me=$(readlink -f "$0"); v="$(dirname "$me")/../.venv/bin/python3"
[ -x "$v" ] || v=python3; exec "$v" "$me" "$@"
'''
HELP = """In-situ calibration's cost over the model's forward pass on a GPU, for
the torch fold (python -m kqsvd.calibrate_hf --device cuda) with each
method: models of real shapes with random weights in bf16 (the cost
depends on the shapes, not on the weights), SDPA attention, windows of
--seq-len random tokens, batch 1.

Each window is run bare and with the capture and the fold (every layer's
queries, keys and values, folded once per window), in alternating order,
timed with the device synchronised; the figures are medians over the
windows after --warmup windows.  The fold's rate counts 2 w^2 flops per
row of width w, as calibrate's --timings does.

--profile then runs one more window with the fold under torch.profiler
and lists the kernels that take the most device time, the forward
pass's and the fold's apart: where the overhead goes.

    bench/gpu_insitu.py [--models smollm2,llama7b] [--seq-len 2048] [--windows 8]
                        [--warmup 2] [--methods gram,qr] [--peak 67] [--profile]
"""
import argparse
import os
import statistics
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.realpath(__file__)), ".."))
sys.path.insert(0, os.path.join(ROOT, "python"))

SHAPES = {  # layers, query heads, KV heads, head_dim, hidden, MLP
    "smollm2": ("SmolLM2-135M", 30, 9, 3, 64, 576, 1536),
    "llama7b": ("Llama-2-7B", 32, 32, 32, 128, 4096, 11008),
}


def model_of(key):
    import torch
    from transformers import LlamaConfig, LlamaModel
    name, L, hq, hkv, d, hidden, mlp = SHAPES[key]
    cfg = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=mlp,
                      num_hidden_layers=L, num_attention_heads=hq, num_key_value_heads=hkv,
                      head_dim=d, max_position_embeddings=8192, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaModel(cfg).to(torch.bfloat16).eval()
    return name, model, cfg


def profile(model, cfg, fold, sink, T, gen, top=12):
    """One window with the capture and the fold under torch.profiler: the
    kernels with the most device time."""
    import torch
    from kqsvd.calibration.capture import Capture
    ids = torch.randint(0, cfg.vocab_size, (1, T), device="cuda", generator=gen)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof, torch.no_grad():
        with torch.profiler.record_function("forward+capture"):
            with Capture(model, "llama", cfg, sink, "post", compute="sdpa"):
                model(input_ids=ids, use_cache=False)
        with torch.profiler.record_function("flush"):
            fold.flush()
        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: -getattr(e, "device_time_total", 0))
    print(f"\nkernels of one window (device time, ms; {top} largest):")
    for e in rows[:top]:
        print(f"  {getattr(e, 'device_time_total', 0) / 1e3:9.2f}  x{e.count:<5d} {e.key[:90]}")


def main():
    ap = argparse.ArgumentParser(description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2,llama7b")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--methods", default="gram,qr")
    ap.add_argument("--peak", type=float, default=67.0, help="FP64 peak, TFLOP/s [67]")
    ap.add_argument("--profile", action="store_true", help="the kernels of one window")
    args = ap.parse_args()
    import torch
    from kqsvd.calibration.capture import Capture
    from kqsvd.calibration.insitu import TorchFold
    from kqsvd.models import ModelInfo
    if not torch.cuda.is_available():
        print("gpu_insitu: PyTorch sees no CUDA device")
        return 77
    print(f"{torch.cuda.get_device_name(0)}; torch {torch.__version__}; windows of "
          f"{args.seq_len} tokens, batch 1, bf16, median of {args.windows}\n")
    print("| model | method | forward | forward + fold | overhead | fold's FP64 rate |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for key in args.models.split(","):
        name, model, cfg = model_of(key)
        _, L, hq, hkv, d, hidden, _ = SHAPES[key]
        info = ModelInfo(name, "llama", L, hq, hkv, d, hidden, 1)
        T = args.seq_len
        flops = 2.0 * T * d * d * (2 * hkv + hq) * L
        gen = torch.Generator(device="cuda").manual_seed(1)
        for method in args.methods.split(","):
            fold = TorchFold(info, "cuda", method)

            def sink(layer, kind, t, fold=fold):
                fold.absorb(layer, kind, t[0].detach())

            bare, with_fold = [], []
            for w in range(args.warmup + args.windows):
                ids = torch.randint(0, 32000, (1, T), device="cuda", generator=gen)
                order = (0, 1) if w % 2 == 0 else (1, 0)
                spent = [0.0, 0.0]
                for kind in order:
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    with torch.no_grad():
                        if kind == 0:
                            model(input_ids=ids, use_cache=False)
                        else:
                            with Capture(model, "llama", cfg, sink, "post", compute="sdpa"):
                                model(input_ids=ids, use_cache=False)
                            fold.flush()
                    torch.cuda.synchronize()
                    spent[kind] = time.perf_counter() - t0
                if w >= args.warmup:
                    bare.append(spent[0])
                    with_fold.append(spent[1])
            f, i = statistics.median(bare), statistics.median(with_fold)
            ratio = statistics.median([b / a for a, b in zip(bare, with_fold)])
            extra = max(i - f, 1e-9)
            print(f"| {name} | {method} | {1e3 * f:.1f} ms | {1e3 * i:.1f} ms | "
                  f"{100 * (ratio - 1):+.1f}% | {flops / extra / 1e12:.1f} TFLOP/s "
                  f"({100 * flops / extra / 1e12 / args.peak:.0f}%) |", flush=True)
            if args.profile:
                profile(model, cfg, fold, sink, T, gen)
            del fold
        del model
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
