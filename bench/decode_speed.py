"""Speed and memory at long context, against the baseline users run:
prefill time, decode tokens/s and peak resident memory above the loaded
model of SmolLM2-135M-Instruct through `model.generate()`, with the model's
default attention (SDPA) and generate()'s own cache for the full model,
and each compressed configuration through the cache it ships.

    .venv/bin/python3 bench/decode_speed.py [--contexts 1024,4096,8160] [--batches 1,8]
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
The cache's bytes are taken from the last call's cache, values held as
computed counted as bf16: `cache MB` what it references, measured
(kqsvd.cache_bytes: its capacity, the room its buffers keep for more
tokens included), `held MB` the bytes of the tokens it holds (its use).
Random tokens (speed does not depend on them; seed 0), greedy; each row
keeps the tokens its last call generated (`new_tokens`, a list per
prompt), so that two trees' runs can be compared token for token.  Each
context and its --steps fit the model's positions (max_position_embeddings,
8,192): the model attends over the prompt and every new token but the
last, context + steps - 1 positions, so the default contexts end at
8,193 - --steps.
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
tokens at prefill, in .venv-peers); composite:NAME:BACKEND:BITS:BYTES (the
press over QuantizedCache BACKEND:BITS, keeping the share of the prompt
that holds the fraction BYTES of the bf16 cache's bytes, as the frontier's
--press-quantized and bench/passkey.py's --composites run it); and
kqsvd:PATH[=POLICY] (a projections
file, relative to the current folder, POLICY its ranks, `stored` by
default, METHOD/POLICY for another method, with @B for B-bit codes, e.g.
kqsvd:proj.h5=fixed:32@4).
kqsvd-32, kqsvd-32@4, g3-pre and g3-pre@4 name the files of the
docs' older tables (bench/rank_allocation.sh, bench/head_groups.sh), in the
repository's data/ wherever the command runs.
The full cache is measured first in every (context, batch), so each
ratio is to the full cache of the same run.

    .venv-peers/bin/python3 bench/decode_speed.py --frontier REPORT.json
        [--front-only] [--contexts N] --annotate OUT.json [--plot PNG] [--force]

measures every configuration of a `kqsvd frontier` report (its files,
quantization scheme and peers; by default at the report's context) and
writes the report again with each result's decode figures beside its
quality (`decode`: tokens/s, ratio to the full cache, prefill, peak
memory), its table with a decode column and its plot with each point's
ratio.

Every option, configuration (policy, bits, file, peer package), context,
report and output is checked before the model loads and any run starts;
errors are one line: exit 2 for the command line and outputs, 1 for an
input file or a failed run, 130 for Ctrl-C or SIGTERM (nothing written)."""
import argparse
import contextlib
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (os.path.join(ROOT, "python"), os.path.dirname(os.path.abspath(__file__))):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from decode_frontier import annotate, frontier_specs, read_report  # noqa: E402
from kqsvd.compat import cache_kwarg, output_cache  # noqa: E402
from kqsvd.errors import KqsvdError, UsageError  # noqa: E402
from kqsvd.formats.numbers import whole  # noqa: E402

PROG = "decode_speed.py"
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
# Absolute: the docs' tables name files of the repository's data/, wherever
# the command runs; a kqsvd:PATH the user gives is the current folder's.
ALIASES = {"kqsvd-32": "kqsvd:" + os.path.join(ROOT, "data", "rank-allocation-post-rope",
                                               "proj.h5") + "=fixed:32",
           "g3-pre": "kqsvd:" + os.path.join(ROOT, "data", "head-groups-pre-rope",
                                             "g3-fitted.quality-tuned-0.5.h5") + "=stored"}
DEFAULT = ["full", "int4", "kqsvd-32", "kqsvd-32@4", "g3-pre", "g3-pre@4"]
DEFAULT_CONTEXTS = (1024, 4096)  # and the longest the model takes (parse)


def spec_of(name):
    """A configuration name with its alias expanded (bits kept) and its
    file, if any, made absolute: the runs read the file the user meant."""
    base, at, bits = name.partition("@")
    spec = ALIASES[base] + at + bits if base in ALIASES else name
    if not spec.startswith("kqsvd:"):
        return spec
    path, eq, rest = spec[6:].partition("=")
    return "kqsvd:" + (os.path.abspath(path) if path else "") + eq + rest


def latent_spec(spec):
    """kqsvd:PATH[=[METHOD/]POLICY] -> (absolute file, method, policy), the
    policy as formats.policy reads it (stored by default; @B bits, a
    tiers: layout), the method kqsvd unless given."""
    from kqsvd.formats.policy import parse
    path, _, pol = spec[6:].partition("=")
    head, slash, rest = (pol or "stored").partition("/")
    # a part before '/' that looks like no policy is a method, named if unknown
    method, pol = (head, rest) if slash and not any(c in head for c in ":@") and \
        head != "stored" else ("kqsvd", pol or "stored")
    return (os.path.abspath(path) if path else path, method, parse(pol).text)


def check(spec, info, contexts, scheme, what=None):
    """Refuses a SPEC that cannot run (UsageError or KqsvdError, one line
    starting with `what`, by default '--config SPEC') before any process
    starts: its syntax, peer package, policy and file, read as the run
    reads it.  Returns (key, input file or None), key equal for two names
    of one configuration."""
    what = what or f"--config {spec}"
    from kqsvd.formats.quant import BITS
    from kqsvd.quality.peers import (BACKENDS, PressPeer, QuantizedCachePeer, composite_of,
                                     press_of, press_over_quantized)
    kind, _, rest = spec.partition(":")
    if spec in ("full", "sdpa-off"):
        return spec, None
    if spec.startswith("int") and not rest:
        if whole(spec[3:]) not in BITS:
            raise UsageError(f"{what}: intB takes B among {', '.join(map(str, BITS))}")
        return ("int", whole(spec[3:])), None
    if kind in BACKENDS:
        if rest not in ("2", "4"):
            raise UsageError(f"{what}: expected {kind}:2 or {kind}:4")
        try:  # its package, here rather than in each run
            QuantizedCachePeer(kind, int(rest), scheme.group).check()
        except UsageError as e:
            raise UsageError(f"{what}: {e}") from None
        return (kind, int(rest)), None
    if kind == "press":
        try:
            name, k = press_of(rest)
        except UsageError as e:
            raise UsageError(f"{what}: expected press:NAME:KEPT; {e}") from None
        for n in contexts:  # kvpress itself, and a prompt longer than the press's window
            try:
                PressPeer(name, k, n).check()
            except UsageError as e:
                raise UsageError(f"{what}: {e}".replace("--context ", "--contexts ")) \
                    from None
        return ("press", name, k), None
    if kind == "composite":
        try:
            fields = composite_of(rest)
            for n in contexts:  # its packages, the cache's share, the press's window
                press_over_quantized(*fields, n, scheme.group).check()
        except UsageError as e:
            raise UsageError(f"{what}: {e}".replace("--context ", "--contexts ")) from None
        return ("composite",) + fields, None
    if kind == "kqsvd":
        return _check_latent(spec, info, scheme, what)
    raise UsageError(f"{what}: not full, sdpa-off, intB, quanto:B, hqq:B, press:NAME:KEPT, "
                     "composite:NAME:BACKEND:BITS:BYTES or kqsvd:PATH[=POLICY] (see --help)")


def _check_latent(spec, info, scheme, what):
    from kqsvd.formats.files import check_input_file
    from kqsvd.formats.projections import METHODS, check_sizes, file_sizes
    try:
        path, method, pol = latent_spec(spec)
    except UsageError as e:
        raise UsageError(f"{what}: {e}") from None
    if method not in METHODS:
        raise UsageError(f"{what}: method '{method}' is not one of {', '.join(METHODS)}")
    if not path:
        raise UsageError(f"{what}: give the projections file, kqsvd:PATH[=POLICY]")
    check_input_file(f"{what}:", path)
    check_sizes(file_sizes(path, [method]), path, info.sizes(), MODEL)
    # read whole as the run reads it: a bad dataset is found here, not after the full cache's run
    from kqsvd.formats.policy import parse
    _resolved(path, method, pol, info.num_layers, scheme, what)
    st = os.stat(path)  # a link to a file is that file; fixed:08 is fixed:8
    return ("kqsvd", st.st_dev, st.st_ino, method, parse(pol).key), path


def _resolved(path, method, pol, layers, scheme, what):
    """(label, Projections) of a policy of the file, as the frontier
    resolves it (quality.measure.resolve_policies)."""
    from kqsvd.quality.measure import resolve_policies
    try:
        [(label, _, proj)] = resolve_policies(path, [pol], [method], layers, scheme)
    except (UsageError, KqsvdError) as e:
        raise type(e)(f"{what}: {e}") from None
    return label, proj


def install(model, info, spec, scheme, context):
    """Sets the model up for `spec`; returns generate()'s extra keyword
    arguments (a fresh cache per call, or none for generate()'s own), the
    context each generate() runs in, and the bytes a cache it leaves holds
    (sizes()); `spec` has passed check()."""
    none, held = contextlib.nullcontext, sizes
    key = cache_kwarg(model)  # cache from transformers 5.24 on: the old name warns there
    if spec == "full":
        model.set_attn_implementation("sdpa")
        return (lambda: {}), none, held
    if spec == "sdpa-off":
        return (lambda: {}), none, held
    model.set_attn_implementation("sdpa")
    if spec.startswith("int") and whole(spec[3:]) is not None:
        from kqsvd.attention import reading_codes
        from kqsvd.attention.cache import QuantCache
        b, plain = whole(spec[3:]), dataclasses.replace(scheme, rotate=False)  # as the frontier's
        return ((lambda: {key: QuantCache(info.num_layers, plain, (b, b))}),
                lambda: reading_codes(model), held)
    if spec.startswith("press:"):
        from kqsvd.quality.peers import PressPeer
        name, _, kept = spec[6:].partition(":")
        peer = PressPeer(name, float(kept), context)
        peer.check()
        return (lambda: {}), (lambda: peer.prefill(model)), held
    if spec.split(":")[0] in ("quanto", "hqq", "composite"):
        from kqsvd.quality.peers import QuantizedCachePeer, composite_of, press_over_quantized
        kind, _, rest = spec.partition(":")
        peer = press_over_quantized(*composite_of(rest), context, scheme.group) \
            if kind == "composite" else QuantizedCachePeer(kind, int(rest), scheme.group)
        peer.check()
        return ((lambda: {key: peer.cache(model)}),
                (lambda: peer.prefill(model)), lambda cache: sizes(cache, peer.nbytes))
    from kqsvd.attention import compress, latent_cache
    path, method, pol = latent_spec(spec)
    compress(model, _resolved(path, method, pol, info.num_layers, scheme, spec)[1])
    return (lambda: {key: latent_cache(model)}), none, held


def sizes(cache, counted=None):
    """A cache's bytes, values held as computed counted as bf16: what it
    references, measured (cache_bytes: its capacity, the room of its
    buffers included), and the bytes of the tokens it holds (its use;
    `counted(cache)` for QuantizedCache, as its peer counts them)."""
    from kqsvd.attention import cache_bytes
    return dict(cache_bytes=cache_bytes(cache, 2),
                cache_bytes_held=counted(cache) if counted else cache_bytes(cache, 2, held=True))


def one(spec, context, batch, steps, repeats, threads, scheme, chunk=None):
    """Runs one configuration in this process (its prompt prefilled in
    pieces of `chunk` tokens, when given); returns its figures."""
    import torch
    torch.set_num_threads(threads)
    from transformers import LogitsProcessor, LogitsProcessorList
    from kqsvd import models
    from kqsvd.formats.quant import QuantScheme
    model, tok, info = models.load(MODEL, dtype=torch.float32)
    extra, around, held = install(model, info, spec, QuantScheme(**scheme), context)

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
        return t[0] - t0, (len(t) - 1) / (t[-1] - t[0]), output_cache(out), out.sequences[:, n:]

    peak = _Peak()
    with torch.no_grad():
        run(min(128, context), 4)  # warm-up: first calls, allocator (presses need a window)
        got = [run(context, steps) for _ in range(repeats)]
    cache, new = got[-1][2], got[-1][3]
    prefill = [p for p, *_ in got]
    decode = [d for _, d, *_ in got]
    return dict(config=spec, context=context, batch=batch, steps=steps, prefill_chunk=chunk,
                attn=model.config._attn_implementation,
                prefill_s=statistics.median(prefill), prefill_range=[min(prefill), max(prefill)],
                decode_tok_s=statistics.median(decode) * batch,
                decode_range=[min(decode) * batch, max(decode) * batch],
                **held(cache), peak_above_model_mb=peak.stop(), new_tokens=new.tolist())


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


def run_one(cmd, env, what):
    """One configuration's process: its row, or KqsvdError with its last
    error line (a traceback is its last line, not echoed); Ctrl-C or
    SIGTERM ends it with this run."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=env) as p:
        try:
            stdout, stderr = p.communicate()
        except BaseException:  # Ctrl-C, SIGTERM: the run ends with this one, reaped
            p.kill()
            p.wait()
            raise
    if p.returncode in (130, -signal.SIGINT, -signal.SIGTERM):
        raise KeyboardInterrupt
    if p.returncode == 0:
        try:
            return json.loads(stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            pass
    lines = [x.strip() for x in stderr.splitlines() if x.strip()]
    last = lines[-1] if lines else ""
    for prefix in (f"{PROG}: error: ", f"{PROG}: "):
        last = last[len(prefix):] if last.startswith(prefix) else last
    if p.returncode == 0:
        why = "it printed no figures"
    elif p.returncode < 0:
        why = f"killed by signal {-p.returncode}" + (f" ({last})" if last else "")
    else:
        why = last or f"exit status {p.returncode}"
    raise KqsvdError(f"{what}: the run failed: {why}")


def measure(named, n, b, a, scheme, env):
    """Every configuration of `named` at context n and batch b, the full
    cache first, --rounds times in turn (full, A, B, ..., full, A, B,
    ...): a row per configuration, its figures the medians over rounds and
    its ratio the median of each round's ratio to that round's full cache,
    so that the machine's drift between rounds cancels."""
    runs = {spec: [] for _, spec, _ in named}
    for k in range(a.rounds):
        for name, spec, _ in named:
            r = run_one([sys.executable, os.path.abspath(__file__), "--one", spec, str(n), str(b),
                         "--steps", str(a.steps), "--repeats", str(a.repeats),
                         "--threads", str(a.threads), "--scheme", json.dumps(scheme)]
                        + (["--prefill-chunk", str(a.prefill_chunk)] if a.prefill_chunk else []),
                        env, f"{name} at {n} x {b}")
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


def _options():
    from kqsvd.commands.cli import ArgumentParser, count, listed
    ap = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                        formatter_class=argparse.RawDescriptionHelpFormatter,
                        epilog="\n\n".join(__doc__.split("\n\n")[3:]))
    ap.add_argument("--contexts", type=listed(count(1)), metavar="N,...",
                    help="prompt lengths; each + --steps within the model's positions "
                         "[1024,4096,8192 - --steps; with --frontier the report's context]")
    ap.add_argument("--batches", type=listed(count(1)), default=[1], metavar="B,...",
                    help="prompts decoded together [1]")
    ap.add_argument("--steps", type=count(2), default=32, help="new tokens per generate() [32]")
    ap.add_argument("--repeats", type=count(1), default=3, help="timed generate() calls [3]")
    ap.add_argument("--threads", type=count(1), default=2, help="torch threads per run [2]")
    ap.add_argument("--rounds", type=count(1), default=1,
                    help="run every configuration this many times in turn; ratios are "
                         "the median of each round's [1]")
    ap.add_argument("--prefill-chunk", type=count(1), metavar="N",
                    help="prefill the prompt N tokens at a time (generate()'s "
                         "prefill_chunk_size), for every configuration alike")
    ap.add_argument("--mmap-threshold", type=count(1), metavar="BYTES",
                    help="glibc's mmap threshold in every run (MALLOC_MMAP_THRESHOLD_): "
                         "fixed, freed activations go back to the system")
    ap.add_argument("--config", action="append", metavar="SPEC",
                    help=f"a configuration (below); repeat it [{' '.join(DEFAULT)}]")
    ap.add_argument("--json", help="the rows, one per configuration, context and batch")
    ap.add_argument("--frontier", metavar="REPORT",
                    help="a kqsvd frontier report: measure its configurations")
    ap.add_argument("--front-only", action="store_true", help="only those on a Pareto front")
    ap.add_argument("--annotate", help="with --frontier: the report with decode figures added")
    ap.add_argument("--plot", help="with --annotate: its plot (.png), each point with its ratio")
    ap.add_argument("--force", action="store_true", help="replace outputs that exist")
    ap.add_argument("--scheme", default="{}", help=argparse.SUPPRESS)
    ap.add_argument("--one", nargs=3, help=argparse.SUPPRESS)
    return ap


def parse(argv):
    """The options, every configuration, context and output checked
    before any run (and before the model loads)."""
    a = _options().parse_args(argv)
    if a.one:
        return a
    if (a.annotate or a.front_only) and not a.frontier or a.plot and not a.annotate:
        raise UsageError("--annotate and --front-only go with --frontier, --plot with --annotate")
    if a.frontier and a.config:
        raise UsageError("--frontier measures the report's configurations: no --config with it")
    from kqsvd import models
    from kqsvd.commands.cli import check_plot
    from kqsvd.formats.files import check_outputs
    from kqsvd.formats.quant import QuantScheme
    check_plot(a.plot)
    a.report = read_report(a.frontier) if a.frontier else None
    # the model's sizes and positions from its config, without its weights
    info, cfg = models.describe(MODEL)
    maxpos = getattr(cfg, "max_position_embeddings", None) or 1 << 30
    if a.steps >= maxpos:
        raise UsageError(f"--steps {a.steps}: the model takes {maxpos} positions, prompt and "
                         "new tokens together")
    given = "--contexts" if a.contexts else "the report's context"  # the defaults fit
    if a.contexts is None:
        a.contexts = [a.report["context"]] if a.report else sorted(
            {n for n in DEFAULT_CONTEXTS if n + a.steps - 1 <= maxpos} |
            {min(8192, maxpos) + 1 - a.steps})
    for n in a.contexts:  # the last new token is never fed back
        models.check_positions(info, cfg, n + a.steps - 1,
                               label=f"{given} {n} + --steps {a.steps} - 1")
    scheme = QuantScheme(**a.report["scheme"]) if a.report else QuantScheme()
    a.scheme = dataclasses.asdict(scheme)
    if a.report:
        a.named = frontier_specs(a.report, a.front_only, a.frontier)
    else:
        a.named = [(n, spec_of(n), None) for n in a.config or DEFAULT]
    # the full cache first in every (context, batch): each ratio is to its own run's
    if all(spec != "full" for _, spec, _ in a.named):
        a.named.insert(0, ("full", "full", None))
    a.named.sort(key=lambda x: x[1] != "full")
    inputs = _configurations(a, info, scheme)
    if a.frontier:
        inputs.append(("--frontier", a.frontier))
    check_outputs([("--json", a.json), ("--annotate", a.annotate), ("--plot", a.plot)],
                  inputs + [("the model", models.resolve(MODEL))], a.force)
    return a


def _configurations(a, info, scheme):
    """Checks every configuration of a.named (check()), none given twice;
    returns the files they read, as (option, path) inputs."""
    seen, inputs = {}, []
    for name, spec, _ in a.named:
        key, path = check(spec, info, a.contexts, scheme, f"--frontier {a.frontier}: result "
                          f"'{name}'" if a.report else f"--config {name}")
        if key in seen and a.report:
            raise KqsvdError(f"--frontier {a.frontier}: '{name}' is one configuration with "
                             f"'{seen[key]}'")
        if key in seen:
            raise UsageError(f"--config {name}: given twice" + ("" if seen[key] == name else
                                                               f" (as '{seen[key]}')"))
        seen[key] = name
        if path:
            inputs.append(("--config", path))
    return inputs


def child(a):
    """--one SPEC N B: one configuration's figures, a JSON line on stdout."""
    from kqsvd.formats.quant import QuantScheme
    spec, n, b = a.one
    if not ((whole(n) or 0) > 0 and (whole(b) or 0) > 0):
        raise UsageError(f"--one {spec} {n} {b}: the context and batch are whole numbers above 0")
    try:
        scheme = QuantScheme(**json.loads(a.scheme)).check("--scheme")
    except (TypeError, ValueError) as e:
        raise UsageError(f"--scheme {a.scheme}: {e}") from None
    print(json.dumps(one(spec, int(n), int(b), a.steps, a.repeats, a.threads,
                         dataclasses.asdict(scheme), a.prefill_chunk)), flush=True)


def run(a):
    if a.one:
        return child(a)
    t0 = time.time()
    named, rows, env = a.named, [], dict(os.environ)
    if a.mmap_threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(a.mmap_threshold)
    print(f"{'config':<44}{'context':>8}{'batch':>6}{'prefill s':>11}{'decode tok/s':>14}"
          f"{'range':>16}{'x full':>8}{'cache MB':>10}{'held MB':>9}{'peak MB':>9}", flush=True)
    for n in a.contexts:
        for b in a.batches:
            got = measure(named, n, b, a, a.scheme, env)
            for name, r in zip((x[0] for x in named), got):
                path, eq, pol = name[6:].partition("=")  # a file by its name, not its folders
                label = "kqsvd:" + os.path.basename(path) + eq + pol \
                    if name.startswith("kqsvd:") else name
                rows.append(r)
                lo, hi = r["decode_range"]
                print(f"{label[:43]:<44}{n:>8}{b:>6}{r['prefill_s']:>11.2f}"
                      f"{r['decode_tok_s']:>14.2f}{f'{lo:.2f}-{hi:.2f}':>16}"
                      f"{r['against_full']:>8.2f}{r['cache_bytes'] / 2**20:>10.1f}"
                      f"{r.get('cache_bytes_held', r['cache_bytes']) / 2**20:>9.1f}"
                      f"{r['peak_above_model_mb']:>9.0f}", flush=True)
    from kqsvd.commands.cli import write_report
    from kqsvd.formats.files import json_writer, write_all
    write_rows = json_writer(rows)
    if a.annotate:
        from kqsvd.commands.frontier import plot, table
        setup = dict(steps=a.steps, repeats=a.repeats, threads=a.threads, dtype="float32",
                     prefill_chunk=a.prefill_chunk, mmap_threshold=a.mmap_threshold,
                     rounds=a.rounds,
                     baseline="SDPA, generate()'s cache", elapsed_s=time.time() - t0)
        out = annotate(a.report, rows, named, setup)
        out["elapsed_s"] = a.report.get("elapsed_s", 0.0) + setup["elapsed_s"]
        if a.json:  # the rows with the report, or neither
            from kqsvd.formats.files import Staged
            with Staged() as staged:
                write_rows(staged.tmp(a.json))
                write_report(out, a.annotate, a.plot, plot, table, staged, a.force)
        else:
            write_report(out, a.annotate, a.plot, plot, table, force=a.force)
    elif a.json:
        write_all([(a.json, write_rows)], force=a.force)


def main(argv=None):
    """The exit status of the command line argv (sys.argv's without it)."""
    from kqsvd.commands.cli import run_command
    try:
        return run_command(PROG, lambda: run(parse(argv)))
    except SystemExit as e:  # --help
        return e.code


if __name__ == "__main__":
    sys.exit(main())
