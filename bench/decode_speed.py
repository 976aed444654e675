"""Speed and memory at long context: prefill time, decode tokens/s and peak
resident memory above the loaded model of SmolLM2-135M-Instruct with the full cache, a plain
int4 cache and kqsvd's latents (quantized or not), at several context
lengths.  Each (configuration, context) runs in a process of its own, so
that the peak memory is its own.

    .venv/bin/python3 bench/decode_speed.py [--contexts 1024,4096,8192] [--steps 32]
        [--threads 2] [--config NAME ...] [--json OUT]

Configurations: full; int4 (the model's keys and values, keys per
channel, values per token, groups of 32); kqsvd-32 (per head, rank 32,
keys after RoPE: half the cache); kqsvd-32@4 (the same latent as 4-bit
codes); g3-pre (one latent per layer's 3 KV heads, keys before RoPE, the
fitted and tuned ranks at half the cache); g3-pre@4.  The tokens are
random (speed does not depend on them; seed 0).  Decode: `steps` tokens
one at a time after the prefill, timed after one warm-up step."""
import argparse
import json
import os
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
FILES = {"kqsvd-32": ("data/rank-allocation-post-rope/proj.h5", "fixed:32"),
         "g3-pre": ("data/head-groups-pre-rope/g3-fitted.quality-tuned-0.5.h5", "stored")}
CONFIGS = ["full", "int4", "kqsvd-32", "kqsvd-32@4", "g3-pre", "g3-pre@4"]


def one(name, context, steps, threads):
    """Runs one configuration in this process; returns its figures."""
    sys.path.insert(0, os.path.join(ROOT, "python"))
    import torch
    torch.set_num_threads(threads)
    from transformers import DynamicCache
    from kqsvd import models
    from kqsvd.compat import cache_kwarg, output_cache
    from kqsvd.attention import cache_bytes, compress, latent_cache
    from kqsvd.attention.cache import QuantCache
    from kqsvd.formats.projections import load_projections
    from kqsvd.formats.quant import QuantScheme, split_bits, with_bits
    from kqsvd.formats.projections import policy_ranks
    model, _, info = models.load(MODEL, dtype=torch.float32)
    base, _, bits = name.partition("@")
    if base in FILES:
        path, pol = FILES[base]
        ranks = None
        if pol != "stored":
            got = policy_ranks(os.path.join(ROOT, path), pol)["methods"]["kqsvd"]
            ranks = (got["rank_k"], got["rank_v"])
        proj = load_projections(os.path.join(ROOT, path), "kqsvd", ranks)
        proj = with_bits(proj, split_bits(f"x@{bits}")[1] if bits else None, QuantScheme())
        compress(model, proj)
        make = lambda: latent_cache(model)  # noqa: E731
    elif name == "int4":
        make = lambda: QuantCache(info.num_layers, QuantScheme(), (4, 4))  # noqa: E731
    else:
        make = DynamicCache
    key = cache_kwarg(model)  # past_key_values, or cache from transformers 5.24 on
    peak = _Peak()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, context + steps + 1), generator=g)
    with torch.no_grad():
        cache = make()
        t = time.perf_counter()
        out = model(input_ids=ids[:, :context], use_cache=True, **{key: cache},
                    logits_to_keep=1)  # the logits of every position would dominate
        prefill = time.perf_counter() - t
        cache = output_cache(out)
        for i in range(steps + 1):
            if i == 1:
                t = time.perf_counter()
            p = context + i
            out = model(input_ids=ids[:, p:p + 1], use_cache=True, **{key: cache},
                        position_ids=torch.tensor([[p]]))
            cache = output_cache(out)
        decode = steps / (time.perf_counter() - t)
    return dict(config=name, context=context, prefill_s=prefill, decode_tok_s=decode,
                cache_bytes=cache_bytes(cache, 2), peak_above_model_mb=peak.stop())


def _rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Peak:
    """The most resident memory above what the loaded model holds, sampled
    every 5 ms (the load's own peak, GGUF dequantization, is left out)."""

    def __init__(self):
        self.base, self.top, self.run = _rss(), 0, True
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self):
        while self.run:
            self.top = max(self.top, _rss() - self.base)
            time.sleep(0.005)

    def stop(self):
        self.run = False
        self.thread.join()
        return max(self.top, _rss() - self.base) / 2**20


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="1024,4096,8192")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--config", action="append", choices=CONFIGS)
    ap.add_argument("--json")
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(one(a.one[0], int(a.one[1]), a.steps, a.threads)))
        return 0
    rows = []
    print(f"{'config':<12}{'context':>8}{'prefill s':>11}{'decode tok/s':>14}{'cache MB':>10}"
          f"{'peak MB':>9}", flush=True)
    for n in (int(x) for x in a.contexts.split(",")):
        for c in a.config or CONFIGS:
            p = subprocess.run([sys.executable, __file__, "--one", c, str(n), "--steps",
                                str(a.steps), "--threads", str(a.threads)],
                               capture_output=True, text=True)
            if p.returncode:
                print(f"{c} at {n}: failed\n{p.stderr[-2000:]}", file=sys.stderr)
                return 1
            r = json.loads(p.stdout.strip().splitlines()[-1])
            rows.append(r)
            print(f"{c:<12}{n:>8}{r['prefill_s']:>11.2f}{r['decode_tok_s']:>14.2f}"
                  f"{r['cache_bytes'] / 2**20:>10.1f}{r['peak_above_model_mb']:>9.0f}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
