#!/bin/sh
"true" '''\'
# Runs with the repository's .venv (scripts/hf-env.sh), else python3.
me=$(readlink -f "$0"); v="$(dirname "$me")/../.venv/bin/python3"
[ -x "$v" ] || v=python3; exec "$v" "$me" "$@"
'''
HELP = """Decode throughput on a GPU: a model of Llama's 7-8B shape (32 layers,
32 query and 8 KV heads, d = 128, hidden 4096, MLP 14336) with random
weights in bf16 (the speed depends on the shapes, not on the weights),
SDPA attention, batch B, a prompt of N random tokens prefilled in chunks,
then --steps greedy steps timed with the device synchronised:

  full     the full bf16 cache, transformers' DynamicCache (generate()'s)
  kqsvd    kqsvd.compressed() with random orthonormal projections of rank
           --rank per KV head, keys and values quantized to --bits (keys per
           channel, values per token, groups of 32): read as codes by the
           Triton kernels (attention/triton_decode.py)
  hqq:B    transformers' QuantizedCache over HQQ (pure PyTorch), and
  quanto:B over optimum-quanto, both with its defaults (groups of 64, the
           newest 128 tokens in bf16).  quanto's unpacking on CUDA is a
           C++/CUDA extension it compiles on first use (minutes): its rows
           run last, and with --quanto-ready F only once F exists (the
           device script builds the extension beside the other rows)

Each row: tokens/s (batch x steps over the steps' time, after --warmup
untimed steps), the cache's bytes over the full cache's, the device's
peak memory (the prefill's included), and the prefill's time.  Points run
in the order given (the (16384, 8) point first by default) until
--budget-s is spent; the rest are listed as not run; --json is rewritten
after every row.  --cache-budget BYTES (1GiB, 24GiB) runs, in place of
--points, each configuration at each of --contexts with the largest
batch whose cache, measured after the run, fits BYTES
(bench/cache_budget.py: batch 1 for its size, then the batch a line
through the sizes measured predicts, run, until one fits and the line
puts one row more over); the ratio is to the full cache's tokens/s at
its own largest batch.  --shape tiny --device cpu runs the same code on a small
random model (Triton's interpreter: set TRITON_INTERPRET=1 and
KQSVD_DECODE=triton), which is how it is tested.

    bench/gpu_decode.py [--points 16384x8,8192x1,...] [--configs full,kqsvd,hqq:4,quanto:4]
                        [--steps 16] [--warmup 4] [--rank 96] [--bits 4] [--budget-s 300]
                        [--json F] [--quanto-ready F]
    bench/gpu_decode.py --cache-budget 16GiB [--contexts 8192,...] [--configs ...] ...
"""
import argparse
import os
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.realpath(__file__)), ".."))
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.join(ROOT, "bench"))

SHAPES = {  # layers, query heads, KV heads, head_dim, hidden, MLP, vocab
    "llama7b": (32, 32, 8, 128, 4096, 14336, 32000),
    "tiny": (2, 4, 2, 16, 64, 128, 97),
}
POINTS = ("16384x8,8192x1,8192x8,8192x16,16384x1,16384x16,32768x1,32768x8,32768x16")


def model_of(shape, device, max_len):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    L, hq, hkv, d, hidden, mlp, vocab = SHAPES[shape]
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp,
                      num_hidden_layers=L, num_attention_heads=hq, num_key_value_heads=hkv,
                      head_dim=d, max_position_embeddings=max_len, attn_implementation="sdpa")
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # made in bf16: no float32 copy of 8 B weights
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(before)
    return model


def projections(model, rank, bits):
    """Random orthonormal projections of rank `rank` per (layer, KV head),
    keys and values quantized to `bits`."""
    import numpy as np
    from kqsvd.formats.projections import Projections
    from kqsvd.formats.quant import QuantScheme, with_bits
    cfg = model.config
    L, hq, hkv, d = (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
                     cfg.head_dim)
    rng = np.random.default_rng(0)

    def orth():
        return np.stack([np.linalg.qr(rng.standard_normal((d, d)))[0][:, :rank]
                         for _ in range(hkv)])
    a, av = [orth() for _ in range(L)], [orth() for _ in range(L)]
    ranks = np.full(L, rank, dtype=np.int64)
    p = Projections(path="random", method="kqsvd", policy=f"fixed:{rank}", model="random",
                    num_layers=L, num_heads=hq, num_kv_heads=hkv, head_dim=d,
                    hidden_size=cfg.hidden_size, rank_k=ranks, rank_v=ranks.copy(),
                    key_down=a, query_down=a, value_down=av, value_up=av,
                    rank_k_heads=np.repeat(ranks[:, None], hkv, 1),
                    rank_v_heads=np.repeat(ranks[:, None], hkv, 1), rope="post")
    return with_bits(p, (bits, bits), QuantScheme(group=32))


def cache_of(config, model):
    if config == "full":
        from transformers import DynamicCache
        return DynamicCache()
    if config == "kqsvd":
        from kqsvd.attention import latent_cache
        return latent_cache(model)
    from transformers import QuantizedCache
    backend, bits = config.split(":")
    return QuantizedCache(backend=backend, config=model.config, nbits=int(bits))


def one(model, config, N, B, a, sync):
    """(tokens/s, prefill seconds, cache bytes) of one point: a prefill in
    chunks, a.warmup steps, a.steps timed."""
    import torch
    from kqsvd.attention import cache_bytes
    from kqsvd.compat import cache_kwarg
    g = torch.Generator(device=model.device).manual_seed(N + B)
    ids = torch.randint(0, model.config.vocab_size, (B, N), generator=g, device=model.device)
    cache = cache_of(config, model)
    key = cache_kwarg(model)  # cache from transformers 5.24 on: the old name warns there
    t0 = time.perf_counter()
    with torch.no_grad():
        for at in range(0, N, a.chunk):
            out = model(input_ids=ids[:, at:at + a.chunk], **{key: cache},
                        use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1:].argmax(-1)
        for _ in range(a.warmup):  # the kernels compiled, the buffers grown
            out = model(input_ids=nxt, **{key: cache}, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
        sync()
        t1 = time.perf_counter()
        for _ in range(a.steps):
            out = model(input_ids=nxt, **{key: cache}, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
        sync()
        t2 = time.perf_counter()
    held = cache_bytes(cache, 2)  # measured, peers' caches too: the storages referenced
    return B * a.steps / (t2 - t1), t1 - t0, held


def parse(argv):
    ap = argparse.ArgumentParser(description=HELP,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama7b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--points", default=POINTS, help="CONTEXTxBATCH,... in the order run")
    ap.add_argument("--configs", default="full,kqsvd,hqq:4,quanto:4")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=4, help="untimed steps first [4]")
    ap.add_argument("--chunk", type=int, default=2048, help="prefill tokens per forward")
    ap.add_argument("--rank", type=int, default=96)
    ap.add_argument("--bits", type=int, default=4, choices=(2, 3, 4, 8))
    ap.add_argument("--budget-s", type=float, default=300.0)
    ap.add_argument("--cache-budget", metavar="BYTES",
                    help="in place of --points: at each of --contexts, the largest batch "
                         "whose measured cache fits BYTES")
    ap.add_argument("--contexts", help="with --cache-budget: N,... [8192]")
    ap.add_argument("--json", help="the rows, rewritten after each")
    ap.add_argument("--force", action="store_true", help="replace --json if it exists")
    ap.add_argument("--quanto-ready", help="a file that exists once optimum-quanto's CUDA "
                    "extension is built: quanto rows run only then")
    a = ap.parse_args(argv)
    try:
        a.points = [tuple(int(x) for x in p.split("x")) for p in a.points.split(",")]
        assert all(len(p) == 2 and min(p) > 0 for p in a.points)
    except (ValueError, AssertionError):
        ap.error(f"--points {a.points!r}: expected CONTEXTxBATCH,... (16384x8)")
    if a.contexts and not a.cache_budget:
        ap.error("--contexts goes with --cache-budget (--points otherwise)")
    if a.cache_budget:
        from kqsvd.commands.cli import size
        a.contexts = a.contexts or "8192"
        try:
            a.cache_budget = size(a.cache_budget)
            a.contexts = [int(x) for x in a.contexts.split(",")]
            assert min(a.contexts) > 0
        except (ValueError, AssertionError, argparse.ArgumentTypeError) as e:
            ap.error(f"--cache-budget {a.cache_budget} --contexts {a.contexts}: {e}")
        a.points = [(n, 0) for n in a.contexts]  # the batch is the search's
    a.configs = a.configs.split(",")
    bad = [c for c in a.configs if c not in ("full", "kqsvd") and
           not (c.split(":")[0] in ("quanto", "hqq") and c.split(":")[-1] in ("2", "4"))]
    if bad:
        ap.error(f"--configs: unknown configuration {bad[0]!r} (full, kqsvd, quanto:B, hqq:B; "
                 "B 2 or 4)")
    if min(a.steps, a.chunk, a.rank) < 1 or a.warmup < 0 or a.rank > SHAPES[a.shape][3]:
        ap.error("--steps and --chunk at least 1, --warmup at least 0, --rank in 1..head_dim")
    from kqsvd.errors import KqsvdError
    from kqsvd.formats.files import check_outputs
    try:  # before the model is made: not a folder, device or FIFO, not replaced unasked
        check_outputs([("--json", a.json)], (), a.force)
    except KqsvdError as e:
        ap.error(str(e))
    return a


def at_budget(model, proj, config, N, a, sync):
    """The row of the largest batch whose measured cache fits
    --cache-budget at context N (cache_budget.largest_batch); batch 1
    runs as the others do (the same steps: the same tokens held)."""
    from cache_budget import largest_batch

    def go(b, probe):
        r = measure(model, proj, config, N, b, a, sync)
        print(f"  {config} at {N} x {b}: " + (r["error"][:100] if "error" in r else
              f"cache {r['bytes'] / 2**20:.1f} MiB"), flush=True)
        return r if "error" in r else dict(r, cache_bytes=r["bytes"])
    r = largest_batch(go, a.cache_budget)
    r.pop("cache_bytes", None)
    return r


def measure(model, proj, config, N, B, a, sync):
    """One row: the point's figures, or why it has none."""
    import torch
    from kqsvd.attention import compressed
    if config.startswith("quanto:") and a.quanto_ready and not os.path.exists(a.quanto_ready):
        return dict(error="not run: optimum-quanto's CUDA extension was still compiling")
    if torch.cuda.is_available() and a.device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    try:
        if config == "kqsvd":
            with compressed(model, proj):
                rate, pre, held = one(model, config, N, B, a, sync)
        else:
            rate, pre, held = one(model, config, N, B, a, sync)
    except Exception as e:  # out of memory, a missing backend, a kernel that fails
        return dict(error=(str(e) or type(e).__name__).splitlines()[0][:300])
    peak = torch.cuda.max_memory_allocated() if a.device.startswith("cuda") else 0
    return dict(tokens_per_s=rate, bytes=held, peak_bytes=peak, prefill_s=pre)


class Report:
    """--json, rewritten after every row so that a run cut short keeps what
    it measured: the first write makes the file (one there then appeared
    after parse() checked: refused without --force), each later one
    replaces the file this run wrote, and no other."""

    def __init__(self, path, force):
        self.path, self.force, self.ours = path, force, None

    def write(self, report):
        from kqsvd.formats.files import json_writer, write_atomic
        try:
            st = os.lstat(self.path)
            mine = self.ours == (st.st_dev, st.st_ino)
        except OSError:  # nothing there; anything else is write_atomic's to say
            mine = False
        made = []

        def write(tmp):  # renamed, never copied: the file keeps tmp's inode
            json_writer(report)(tmp)
            st = os.stat(tmp)
            made.append((st.st_dev, st.st_ino))
        write_atomic(self.path, write, force=self.force or mine)
        self.ours = made[0]


def main(argv=None):
    a = parse(argv)
    import torch
    from kqsvd.errors import KqsvdError
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_decode: PyTorch sees no CUDA device")
        return 77
    cuda = a.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    model = model_of(a.shape, a.device, max(n for n, _ in a.points) + a.steps + a.warmup + 8)
    proj = projections(model, a.rank, a.bits)
    name = torch.cuda.get_device_name(0) if cuda else "CPU"
    print(f"{name}; torch {torch.__version__}; {a.shape}, {a.warmup} + {a.steps} steps; kqsvd "
          f"rank {a.rank} at {a.bits} bits\n\n| context | batch | configuration | tokens/s | "
          "x full | bytes | peak memory | prefill |\n| ---: | ---: | --- | ---: | ---: | ---: "
          "| ---: | ---: |", flush=True)
    rows, t0, full = [], time.time(), {}
    report = Report(a.json, a.force) if a.json else None
    # quanto last: its CUDA extension compiles (once) while the others run
    late = [c for c in a.configs if c.startswith("quanto:")]
    order = [(p, c) for p in a.points for c in a.configs if c not in late]
    order += [(p, c) for c in late for p in a.points]
    for (N, B), config in order:
        row = dict(context=N, batch=B, config=config)
        if time.time() - t0 > a.budget_s:
            row["error"] = f"not run: --budget-s {a.budget_s:g} spent"
        elif a.cache_budget:
            row.update(at_budget(model, proj, config, N, a, sync))
            B = row["batch"]
        else:
            row.update(measure(model, proj, config, N, B, a, sync))
        if "error" in row:
            print(f"| {N} | {B} | {config} | {row['error'][:120]} | | | | |", flush=True)
        else:
            if config == "full":
                full[N, B if not a.cache_budget else 0] = row
            f = full.get((N, B if not a.cache_budget else 0))
            row["ratio_to_full"] = row["tokens_per_s"] / f["tokens_per_s"] if f else None
            row["bytes_over_full"] = row["bytes"] / f["bytes"] if f else None
            print(f"| {N} | {B} | {config} | {row['tokens_per_s']:.1f} | "
                  f"{row['ratio_to_full'] or float('nan'):.2f}x | "
                  f"{row['bytes_over_full'] or float('nan'):.3f} | "
                  f"{row['peak_bytes'] / 2**30:.1f} GiB | {row['prefill_s']:.1f} s |", flush=True)
        rows.append(row)
        if report:
            try:
                report.write(dict(device=name, torch=torch.__version__, shape=a.shape,
                                  steps=a.steps, warmup=a.warmup, rank=a.rank, bits=a.bits,
                                  cache_budget=a.cache_budget, rows=rows))
            except KqsvdError as e:  # another run's file there, a full disk: one line
                print(f"gpu_decode: error: {e}", file=sys.stderr)
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
