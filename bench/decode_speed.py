"""Speed and memory at long context, against the baseline users run:
prefill time, decode tokens/s and peak resident memory above the loaded
model of SmolLM2-135M-Instruct through `model.generate()`, with the model's
default attention (SDPA) and generate()'s own cache for the full model,
and each compressed configuration through the cache it ships.

    .venv/bin/python3 bench/decode_speed.py [--contexts 1024,4096,8192] [--batches 1,8]
        [--steps 32] [--repeats 3] [--rounds 1] [--threads 2] [--prefill-chunk N]
        [--mmap-threshold B] [--config SPEC ...] [--json OUT [--force]]

Every (configuration, context, batch) runs in a process of its own, so the
peak memory is its own; in it, one short generate() warms up, then
--repeats generate() calls of --steps new tokens each are timed by a
logits processor that notes when each token's logits arrive: the prefill
is the time to the first, the decode rate the other steps - 1 over the
time from the first to the last.  Medians with their range over the
repeats; with --rounds R, the whole list of configurations runs R times
in turn and each ratio is the median of the rounds' ratios, each to its
own round's full cache (on a shared machine, speed drifts between runs).
Random tokens (speed does not depend on them; seed 0), greedy.
--prefill-chunk N prefills N tokens at a time (generate()'s
prefill_chunk_size); --mmap-threshold B fixes glibc's mmap threshold
(by default it rises to 32 MiB as large blocks are freed, and the heap
then keeps freed activations: peak RSS measures the allocator's
retention as much as what is live).  Both apply to every configuration.

SPEC: full (SDPA, generate()'s cache); sdpa-off (the same with the eager
attention kqsvd's loader gives, the old baseline); intB (a plain B-bit
cache of the model's keys and values, keys per channel, values per token,
groups of 32; kqsvd's own, as the frontier scores it, its decode steps
read as codes inside kqsvd.attention.reading_codes); quanto:B
(transformers' QuantizedCache, optimum-quanto, in .venv-peers; hqq:B
likewise);
press:NAME:KEPT (a kvpress press keeping the fraction KEPT of the prompt's
tokens at prefill, in .venv-peers); and kqsvd:PATH[=POLICY] (a projections
file, POLICY its ranks, `stored` by default, METHOD/POLICY for another
method, with @B for B-bit codes, e.g. kqsvd:proj.h5=fixed:32@4).
kqsvd-32, kqsvd-32@4, g3-pre and g3-pre@4 name the files of the
docs' older tables (bench/rank_allocation.sh, bench/head_groups.sh).
The full cache is measured first in every (context, batch), so each
ratio is to the full cache of the same run.

    .venv-peers/bin/python3 bench/decode_speed.py --frontier REPORT.json
        [--front-only] [--contexts N] --annotate OUT.json [--plot PNG] [--force]

measures every configuration of a `kqsvd frontier` report (its files,
quantization scheme and peers; by default at the report's context) and
writes the report again with each result's decode figures beside its
quality (`decode`: tokens/s, ratio to the full cache, prefill, peak
memory), its table with a decode column and its plot with each point's
ratio."""
import argparse
import contextlib
import dataclasses
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


def latent_spec(spec):
    """kqsvd:PATH[=[METHOD/]POLICY[@B]] -> (file, method, policy, bits)."""
    from kqsvd.formats.quant import split_bits
    path, _, pol = spec[6:].partition("=")
    method, slash, rest = (pol or "stored").partition("/")
    method, pol = (method, rest) if slash else ("kqsvd", pol or "stored")
    return (os.path.join(ROOT, path), method) + tuple(split_bits(pol))


def check(spec):
    """Refuses a SPEC that cannot run (UsageError or KqsvdError, one line),
    before any process starts; returns its projections file or None."""
    from kqsvd.errors import UsageError
    from kqsvd.formats.files import check_input_file
    from kqsvd.formats.quant import BITS
    if spec in ("full", "sdpa-off"):
        return None
    if spec.startswith("int") and spec[3:].isdigit() and int(spec[3:]) in BITS:
        return None
    if spec in ("quanto:2", "quanto:4", "hqq:2", "hqq:4"):
        return None
    if spec.startswith("press:"):
        from kqsvd.quality.peers import PRESSES
        name, _, kept = spec[6:].partition(":")
        try:
            ok = name in PRESSES and 0 < float(kept) < 1
        except ValueError:
            ok = False
        if not ok:
            raise UsageError(f"--config {spec}: expected press:NAME:KEPT, NAME among "
                             f"{', '.join(PRESSES)}, KEPT a fraction in (0, 1)")
        return None
    if spec.startswith("kqsvd:"):
        from kqsvd.formats.projections import METHODS
        path, method, _, _ = latent_spec(spec)
        if method not in METHODS:
            raise UsageError(f"--config {spec}: method '{method}' is not one of "
                             f"{', '.join(METHODS)}")
        check_input_file("--config", path)
        return path
    raise UsageError(f"--config {spec}: not full, sdpa-off, intB, quanto:B, press:NAME:KEPT or "
                     "kqsvd:PATH[=POLICY]")


def install(model, info, spec, scheme, context):
    """Sets the model up for `spec`; returns generate()'s extra keyword
    arguments (a fresh cache per call, or none for generate()'s own) and
    the context each generate() runs in; `spec` has passed check()."""
    none = contextlib.nullcontext
    if spec == "full":
        model.set_attn_implementation("sdpa")
        return (lambda: {}), none
    if spec == "sdpa-off":
        return (lambda: {}), none
    model.set_attn_implementation("sdpa")
    if spec.startswith("int") and spec[3:].isdigit():
        from kqsvd.attention import reading_codes
        from kqsvd.attention.cache import QuantCache
        b, plain = int(spec[3:]), dataclasses.replace(scheme, rotate=False)  # as the frontier's
        return ((lambda: {"past_key_values": QuantCache(info.num_layers, plain, (b, b))}),
                lambda: reading_codes(model))
    if spec.split(":")[0] in ("quanto", "hqq"):  # the backend's import is checked in the child
        from kqsvd.quality.peers import QuantizedCachePeer
        backend, _, bits = spec.partition(":")
        peer = QuantizedCachePeer(backend, int(bits), scheme.group)
        peer.check()
        return (lambda: {"past_key_values": peer.cache(model)}), none
    if spec.startswith("press:"):
        from kqsvd.quality.peers import PressPeer
        name, _, kept = spec[6:].partition(":")
        peer = PressPeer(name, float(kept), context)
        peer.check()
        return (lambda: {}), (lambda: peer.prefill(model))
    from kqsvd.attention import compress, latent_cache
    from kqsvd.formats.projections import load_projections, policy_ranks
    from kqsvd.formats.quant import with_bits
    path, method, pol, bits = latent_spec(spec)
    ranks = None
    if pol != "stored":
        got = policy_ranks(path, pol)["methods"][method]
        ranks = (got["rank_k"], got["rank_v"])
    proj = load_projections(path, method, ranks)
    if bits is not None:
        proj = with_bits(proj, bits, scheme)
    compress(model, proj)
    return (lambda: {"past_key_values": latent_cache(model)}), none


def one(spec, context, batch, steps, repeats, threads, scheme, chunk=None):
    """Runs one configuration in this process (its prompt prefilled in
    pieces of `chunk` tokens, when given); returns its figures."""
    sys.path.insert(0, os.path.join(ROOT, "python"))
    import torch
    torch.set_num_threads(threads)
    from transformers import LogitsProcessor, LogitsProcessorList
    from kqsvd import models
    from kqsvd.attention import cache_bytes
    from kqsvd.formats.quant import QuantScheme
    model, tok, info = models.load(MODEL, dtype=torch.float32)
    extra, around = install(model, info, spec, QuantScheme(**scheme), context)

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
        with around():
            out = model.generate(input_ids=ids[:, :n], attention_mask=torch.ones_like(ids[:, :n]),
                                 max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                 pad_token_id=tok.eos_token_id, return_dict_in_generate=True,
                                 logits_processor=LogitsProcessorList([clock]),
                                 prefill_chunk_size=chunk if chunk and n > chunk else None,
                                 **extra())
        t = clock.times
        return t[0] - t0, (len(t) - 1) / (t[-1] - t[0]), out.past_key_values

    peak = _Peak()
    with torch.no_grad():
        run(min(128, context), 4)  # warm-up: first calls, allocator (presses need a window)
        got = [run(context, steps) for _ in range(repeats)]
    cache = got[-1][2]
    prefill = [p for p, _, _ in got]
    decode = [d for _, d, _ in got]
    return dict(config=spec, context=context, batch=batch, steps=steps, prefill_chunk=chunk,
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


def frontier_specs(report, front_only):
    """[(label, spec, index of the report's result)] for the configurations
    of a `kqsvd frontier` report (only those on a front with front_only);
    raises UsageError for a configuration it cannot name."""
    from kqsvd.errors import UsageError
    stems = {os.path.splitext(os.path.basename(p))[0]: p for p in report["proj"]}
    out = []
    for i, r in enumerate(report["results"]):
        if front_only and not (r["front"] or r["front_kl"]):
            continue
        label, family = r["label"], r["family"]
        if family == "int-N cache":
            spec = label
        elif family.startswith("QuantizedCache"):
            backend, _, bits = label.partition("-int")
            spec = f"{backend}:{bits}"
        elif family.startswith("kvpress"):
            spec = f"press:{label}"
        else:  # a latent: "METHOD POLICY [STEM]", the stem when the report has several files
            head, _, stem = label.partition(" [")
            method, _, policy = head.partition(" ")
            path = stems.get(stem.rstrip("]")) if stem else report["proj"][0]
            if path is None:
                raise UsageError(f"--frontier: '{label}' names no file of the report")
            spec = f"kqsvd:{os.path.abspath(path)}={method}/{policy}"
        out.append((label, spec, i))
    return out


def annotate(report, rows, specs, setup):
    """The frontier report with each measured result's decode figures."""
    report = dict(report, results=[dict(r) for r in report["results"]])
    figures = lambda r: {k: r[k] for k in ("context", "batch", "decode_tok_s",  # noqa: E731
                                           "decode_range", "against_full", "prefill_s",
                                           "peak_above_model_mb")}
    report["decode_full"] = [figures(r) for r in rows if r["config"] == "full"]
    for label, spec, i in specs:
        got = [figures(r) for r in rows if r["config"] == spec]
        if i is not None and got:
            report["results"][i]["decode"] = got
    report["decode_setup"] = setup
    return report


def measure(named, n, b, a, scheme, env):
    """Every configuration of `named` at context n and batch b, the full
    cache first, --rounds times in turn (full, A, B, ..., full, A, B,
    ...): a row per configuration, its figures the medians over rounds and
    its ratio the median of each round's ratio to that round's full cache,
    so that the machine's drift between rounds cancels.  None (after a
    message) when a run fails."""
    runs = {spec: [] for _, spec, _ in named}
    for k in range(a.rounds):
        for name, spec, _ in named:
            p = subprocess.run([sys.executable, __file__, "--one", spec, str(n), str(b),
                                "--steps", str(a.steps), "--repeats", str(a.repeats),
                                "--threads", str(a.threads), "--scheme", json.dumps(scheme)]
                               + (["--prefill-chunk", str(a.prefill_chunk)]
                                  if a.prefill_chunk else []),
                               capture_output=True, text=True, env=env)
            if p.returncode:
                print(f"{name} at {n} x {b}: failed\n{p.stderr[-2000:]}", file=sys.stderr)
                return None
            r = json.loads(p.stdout.strip().splitlines()[-1])
            r["against_full"] = r["decode_tok_s"] / runs["full"][k]["decode_tok_s"] \
                if spec != "full" else 1.0
            runs[spec].append(r)
            turn = f"round {k + 1}/{a.rounds} " if a.rounds > 1 else ""
            print(f"  {turn}{name[:60]} at {n} x {b}: {r['decode_tok_s']:.2f} tokens/s, "
                  f"{r['against_full']:.2f}x", file=sys.stderr, flush=True)
    med = statistics.median
    out = []
    for name, spec, _ in named:
        got = runs[spec]
        out.append(dict(got[-1], name=name, mmap_threshold=a.mmap_threshold, rounds=a.rounds,
                        prefill_s=med(x["prefill_s"] for x in got),
                        decode_tok_s=med(x["decode_tok_s"] for x in got),
                        decode_range=[min(x["decode_range"][0] for x in got),
                                      max(x["decode_range"][1] for x in got)],
                        against_full=med(x["against_full"] for x in got),
                        against_full_range=[min(x["against_full"] for x in got),
                                            max(x["against_full"] for x in got)],
                        peak_above_model_mb=max(x["peak_above_model_mb"] for x in got)))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every configuration this many times in turn; ratios are "
                         "the median of each round's")
    ap.add_argument("--prefill-chunk", type=int, metavar="N",
                    help="prefill the prompt N tokens at a time (generate()'s "
                         "prefill_chunk_size), for every configuration alike")
    ap.add_argument("--mmap-threshold", type=int, metavar="BYTES",
                    help="glibc's mmap threshold in every run (MALLOC_MMAP_THRESHOLD_): "
                         "fixed, freed activations go back to the system")
    ap.add_argument("--config", action="append", help="a SPEC (see above); repeat it")
    ap.add_argument("--json")
    ap.add_argument("--frontier", help="a kqsvd frontier report: measure its configurations")
    ap.add_argument("--front-only", action="store_true", help="only those on a Pareto front")
    ap.add_argument("--annotate", help="with --frontier: the report with decode figures added")
    ap.add_argument("--plot", help="with --annotate: its plot, each point with its ratio")
    ap.add_argument("--force", action="store_true", help="replace outputs that exist")
    ap.add_argument("--scheme", default="{}", help=argparse.SUPPRESS)
    ap.add_argument("--one", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.steps < 2 or a.repeats < 1 or a.rounds < 1 or any(
            v is not None and v < 1 for v in (a.prefill_chunk, a.mmap_threshold)):
        ap.error("--steps at least 2, --repeats and --rounds at least 1, --prefill-chunk "
                 "and --mmap-threshold at least 1")
    if a.one:
        print(json.dumps(one(a.one[0], int(a.one[1]), int(a.one[2]), a.steps, a.repeats,
                             a.threads, json.loads(a.scheme), a.prefill_chunk)))
        return 0
    if (a.annotate or a.front_only) and not a.frontier or a.plot and not a.annotate:
        ap.error("--annotate and --front-only go with --frontier, --plot with --annotate")
    if a.frontier and a.config:
        ap.error("--frontier measures the report's configurations: no --config with it")
    sys.path.insert(0, os.path.join(ROOT, "python"))
    from kqsvd.errors import KqsvdError
    from kqsvd.formats.files import check_input_file, check_outputs, write_atomic
    t0 = time.time()
    try:  # every configuration and the reports' places, before minutes of work
        report, scheme = None, {}
        if a.frontier:
            check_input_file("--frontier", a.frontier)
            with open(a.frontier) as f:
                report = json.load(f)
            if report.get("kqsvd_format") != "frontier":
                raise KqsvdError(f"{a.frontier}: not a kqsvd frontier report (kqsvd_format)")
            scheme = report["scheme"]
            named = frontier_specs(report, a.front_only)
        else:
            named = [(n, spec_of(n), None) for n in a.config or DEFAULT]
        # the full cache first in every (context, batch): each ratio is to its own run's
        named = [("full", "full", None)] + [x for x in named if x[1] != "full"]
        inputs = [("--config", p) for p in (check(spec) for _, spec, _ in named) if p]
        if a.frontier:
            inputs.append(("--frontier", a.frontier))
        check_outputs([("--json", a.json), ("--annotate", a.annotate), ("--plot", a.plot)],
                      inputs, a.force)
    except (KqsvdError, KeyError, ValueError) as e:
        sys.exit(f"decode_speed.py: error: {e}")
    contexts = a.contexts or (str(report["context"]) if report else "1024,4096,8192")
    rows, env = [], dict(os.environ)
    if a.mmap_threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(a.mmap_threshold)
    print(f"{'config':<44}{'context':>8}{'batch':>6}{'prefill s':>11}{'decode tok/s':>14}"
          f"{'range':>16}{'x full':>8}{'cache MB':>10}{'peak MB':>9}", flush=True)
    for n in (int(x) for x in contexts.split(",")):
        for b in (int(x) for x in a.batches.split(",")):
            got = measure(named, n, b, a, scheme, env)
            if got is None:
                return 1
            for name, r in zip((x[0] for x in named), got):
                path, eq, pol = name[6:].partition("=")  # a file by its name, not its folders
                label = "kqsvd:" + os.path.basename(path) + eq + pol \
                    if name.startswith("kqsvd:") else name
                rows.append(r)
                lo, hi = r["decode_range"]
                print(f"{label[:43]:<44}{n:>8}{b:>6}{r['prefill_s']:>11.2f}"
                      f"{r['decode_tok_s']:>14.2f}{f'{lo:.2f}-{hi:.2f}':>16}"
                      f"{r['against_full']:>8.2f}{r['cache_bytes'] / 2**20:>10.1f}"
                      f"{r['peak_above_model_mb']:>9.0f}", flush=True)
    if a.json:
        def write(tmp):
            with open(tmp, "w") as f:
                json.dump(rows, f, indent=1)
        write_atomic(a.json, write)
    if a.annotate:
        from kqsvd.commands.cli import write_report
        from kqsvd.commands.frontier import plot, table
        setup = dict(steps=a.steps, repeats=a.repeats, threads=a.threads, dtype="float32",
                     prefill_chunk=a.prefill_chunk, mmap_threshold=a.mmap_threshold,
                     rounds=a.rounds,
                     baseline="SDPA, generate()'s cache", elapsed_s=time.time() - t0)
        out = annotate(report, rows, named, setup)
        out["elapsed_s"] = report.get("elapsed_s", 0.0) + setup["elapsed_s"]
        write_report(out, a.annotate, a.plot, plot, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
