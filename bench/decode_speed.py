"""Speed and memory at long context, against the baseline users run:
prefill time, decode tokens/s and peak resident memory above the loaded
model of SmolLM2-135M-Instruct through `model.generate()`, with the model's
default attention (SDPA) and generate()'s own cache for the full model,
and each compressed configuration through the cache it ships.

    .venv/bin/python3 bench/decode_speed.py [--contexts 1024,4096,8192] [--batches 1,8]
        [--steps 32] [--repeats 3] [--threads 2] [--config SPEC ...] [--json OUT [--force]]

Every (configuration, context, batch) runs in a process of its own, so the
peak memory is its own; in it, one short generate() warms up, then
--repeats generate() calls of --steps new tokens each are timed by a
logits processor that notes when each token's logits arrive: the prefill
is the time to the first, the decode rate the other steps - 1 over the
time from the first to the last.  Medians with their range over the
repeats.  Random tokens (speed does not depend on them; seed 0), greedy.

SPEC: full (SDPA, generate()'s cache); sdpa-off (the same with the eager
attention kqsvd's loader gives, the old baseline); intB (a plain B-bit
cache of the model's keys and values, keys per channel, values per token,
groups of 32; kqsvd's own, as the frontier scores it); quanto:B
(transformers' QuantizedCache, optimum-quanto, in .venv-peers); and
kqsvd:PATH[=POLICY] (a projections file, POLICY its ranks, `stored` by
default, with @B for B-bit codes, e.g. kqsvd:proj.h5=fixed:32@4).
kqsvd-32, kqsvd-32@4, g3-pre and g3-pre@4 name the files of the
docs' older tables (bench/rank_allocation.sh, bench/head_groups.sh)."""
import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
ALIASES = {"kqsvd-32": "kqsvd:data/rank-allocation-post-rope/proj.h5=fixed:32",
           "g3-pre": "kqsvd:data/head-groups-pre-rope/g3-fitted.quality-tuned-0.5.h5=stored"}
DEFAULT = ["full", "int4", "kqsvd-32", "kqsvd-32@4", "g3-pre", "g3-pre@4"]


def spec_of(name):
    """A configuration name with its alias expanded (bits kept)."""
    base, at, bits = name.partition("@")
    return ALIASES[base] + at + bits if base in ALIASES else name


def check(spec):
    """Refuses a SPEC that cannot run (UsageError or KqsvdError, one line),
    before any process starts; returns its projections file or None."""
    from kqsvd.errors import UsageError
    from kqsvd.formats.files import check_input_file
    from kqsvd.formats.quant import BITS, split_bits
    if spec in ("full", "sdpa-off"):
        return None
    if spec.startswith("int") and spec[3:].isdigit() and int(spec[3:]) in BITS:
        return None
    if spec in ("quanto:2", "quanto:4"):
        return None
    if spec.startswith("kqsvd:"):
        path, _, pol = spec[6:].partition("=")
        split_bits(pol or "stored")
        check_input_file("--config", os.path.join(ROOT, path))
        return os.path.join(ROOT, path)
    raise UsageError(f"--config {spec}: not full, sdpa-off, intB, quanto:B or kqsvd:PATH[=POLICY]")


def install(model, info, spec):
    """Sets the model up for `spec`; returns generate()'s extra keyword
    arguments (a fresh cache per call, or none for generate()'s own);
    `spec` has passed check()."""
    if spec == "full":
        model.set_attn_implementation("sdpa")
        return lambda: {}
    if spec == "sdpa-off":
        return lambda: {}
    model.set_attn_implementation("sdpa")
    if spec.startswith("int") and spec[3:].isdigit():
        from kqsvd.attention.cache import QuantCache
        from kqsvd.formats.quant import QuantScheme
        b = int(spec[3:])
        return lambda: {"past_key_values": QuantCache(info.num_layers, QuantScheme(), (b, b))}
    if spec.startswith("quanto:"):  # quanto's import is checked here, in the child
        from kqsvd.quality.peers import QuantizedCachePeer
        peer = QuantizedCachePeer("quanto", int(spec[7:]), 32)
        peer.check()
        return lambda: {"past_key_values": peer.cache(model)}
    if spec.startswith("kqsvd:"):
        from kqsvd.attention import compress, latent_cache
        from kqsvd.formats.projections import load_projections, policy_ranks
        from kqsvd.formats.quant import QuantScheme, split_bits, with_bits
        path, _, pol = spec[6:].partition("=")
        pol, bits = split_bits(pol or "stored")
        path = os.path.join(ROOT, path)
        ranks = None
        if pol != "stored":
            got = policy_ranks(path, pol)["methods"]["kqsvd"]
            ranks = (got["rank_k"], got["rank_v"])
        proj = load_projections(path, "kqsvd", ranks)
        if bits is not None:
            proj = with_bits(proj, bits, QuantScheme())
        compress(model, proj)
        return lambda: {"past_key_values": latent_cache(model)}
    return lambda: {}


def one(spec, context, batch, steps, repeats, threads):
    """Runs one configuration in this process; returns its figures."""
    sys.path.insert(0, os.path.join(ROOT, "python"))
    import torch
    torch.set_num_threads(threads)
    from transformers import LogitsProcessor, LogitsProcessorList
    from kqsvd import models
    from kqsvd.attention import cache_bytes
    model, tok, info = models.load(MODEL, dtype=torch.float32)
    extra = install(model, info, spec)

    class Clock(LogitsProcessor):
        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (batch, context), generator=g)

    def run(n, new):
        clock = Clock()
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids[:, :n], attention_mask=torch.ones_like(ids[:, :n]),
                             max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             pad_token_id=tok.eos_token_id, return_dict_in_generate=True,
                             logits_processor=LogitsProcessorList([clock]), **extra())
        t = clock.times
        return t[0] - t0, (len(t) - 1) / (t[-1] - t[0]), out.past_key_values

    peak = _Peak()
    with torch.no_grad():
        run(min(64, context), 4)  # warm-up: first calls, allocator
        got = [run(context, steps) for _ in range(repeats)]
    cache = got[-1][2]
    prefill = [p for p, _, _ in got]
    decode = [d for _, d, _ in got]
    return dict(config=spec, context=context, batch=batch, steps=steps,
                attn=model.config._attn_implementation,
                prefill_s=statistics.median(prefill), prefill_range=[min(prefill), max(prefill)],
                decode_tok_s=statistics.median(decode) * batch,
                decode_range=[min(decode) * batch, max(decode) * batch],
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
    ap.add_argument("--batches", default="1")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--config", action="append", help="a SPEC (see above); repeat it")
    ap.add_argument("--json")
    ap.add_argument("--force", action="store_true", help="replace --json if it exists")
    ap.add_argument("--one", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.steps < 2 or a.repeats < 1:
        ap.error("--steps at least 2, --repeats at least 1")
    if a.one:
        print(json.dumps(one(a.one[0], int(a.one[1]), int(a.one[2]), a.steps, a.repeats,
                             a.threads)))
        return 0
    sys.path.insert(0, os.path.join(ROOT, "python"))
    from kqsvd.errors import KqsvdError
    from kqsvd.formats.files import check_outputs, write_atomic
    specs = [spec_of(n) for n in a.config or DEFAULT]
    try:  # every configuration and the report's place, before minutes of work
        inputs = [("--config", p) for p in map(check, specs) if p]
        check_outputs([("--json", a.json)], inputs, a.force)
    except KqsvdError as e:
        sys.exit(f"decode_speed.py: error: {e}")
    rows = []
    print(f"{'config':<44}{'context':>8}{'batch':>6}{'prefill s':>11}{'decode tok/s':>14}"
          f"{'range':>16}{'x full':>8}{'cache MB':>10}{'peak MB':>9}", flush=True)
    for n in (int(x) for x in a.contexts.split(",")):
        for b in (int(x) for x in a.batches.split(",")):
            full = None
            for name, spec in zip(a.config or DEFAULT, specs):
                p = subprocess.run([sys.executable, __file__, "--one", spec, str(n), str(b),
                                    "--steps", str(a.steps), "--repeats", str(a.repeats),
                                    "--threads", str(a.threads)], capture_output=True, text=True)
                if p.returncode:
                    print(f"{name} at {n} x {b}: failed\n{p.stderr[-2000:]}", file=sys.stderr)
                    return 1
                r = json.loads(p.stdout.strip().splitlines()[-1])
                r["name"] = name
                label = name if not name.startswith("kqsvd:") else \
                    "kqsvd:" + os.path.basename(name[6:])
                full = r["decode_tok_s"] if spec == "full" else full
                r["against_full"] = r["decode_tok_s"] / full if full else None
                rows.append(r)
                lo, hi = r["decode_range"]
                x = f"{r['against_full']:.2f}" if full else "-"
                print(f"{label:<44}{n:>8}{b:>6}{r['prefill_s']:>11.2f}{r['decode_tok_s']:>14.2f}"
                      f"{f'{lo:.2f}-{hi:.2f}':>16}{x:>8}{r['cache_bytes'] / 2**20:>10.1f}"
                      f"{r['peak_above_model_mb']:>9.0f}", flush=True)
    if a.json:
        def write(tmp):
            with open(tmp, "w") as f:
                json.dump(rows, f, indent=1)
        write_atomic(a.json, write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
