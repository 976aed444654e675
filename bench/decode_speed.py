"""Speed and memory at long context, against the baseline users run:
prefill time, decode tokens/s and peak resident memory above the loaded
model of SmolLM2-135M-Instruct through `model.generate()`, with the model's
default attention (SDPA) and generate()'s own cache for the full model,
and each compressed configuration through the cache it ships.

    .venv/bin/python3 bench/decode_speed.py [--contexts 1024,4096,8160] [--batches 1,8]
        [--steps 32] [--repeats 3] [--rounds 1] [--threads 2] [--prefill-chunk N]
        [--mmap-threshold B] [--cache-budget BYTES] [--config SPEC ...] [--json OUT [--force]]

Every (configuration, context, batch) runs in a process of its own, so the
peak memory is its own; in it, one short generate() warms up, then
--repeats generate() calls of --steps new tokens each are timed by a
logits processor that notes when each token's logits arrive: the prefill
is the time to the first, the decode rate the other steps - 1 over the
time from the first to the last.  Medians with their range over the
repeats; with --rounds R, the whole list of configurations runs R times
in turn and each ratio is the median of the rounds' ratios, each to its
own round's full cache (on a shared machine, speed drifts between runs).
--cache-budget BYTES (1GiB, 512MiB, or bytes) runs, in place of
--batches, each configuration at the largest batch whose cache, as
measured, fits BYTES (bench/cache_budget.py: batch 1 for its size, then
the batch a line through the sizes measured so far predicts, run and
measured, until one fits and the line puts one row more over): its row
has the batch, its tokens/s over the whole batch, the ratio to the full
cache's at its own largest batch, the sizes tried and the bytes one row
more would take.  Each row's prefill runs batch x context tokens: on a
CPU, at 8k tokens, tens of seconds a row and repeat.
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
import dataclasses
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (os.path.join(ROOT, "python"), os.path.dirname(os.path.abspath(__file__))):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from decode_child import MODEL, latent_spec, one, resolved  # noqa: E402
from decode_frontier import annotate, frontier_specs, read_report  # noqa: E402
from kqsvd.errors import KqsvdError, UsageError  # noqa: E402
from kqsvd.formats.numbers import whole  # noqa: E402

PROG = "decode_speed.py"
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
    resolved(path, method, pol, info.num_layers, scheme, what)
    st = os.stat(path)  # a link to a file is that file; fixed:08 is fixed:8
    return ("kqsvd", st.st_dev, st.st_ino, method, parse(pol).key), path


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


def child_cmd(spec, n, b, a, steps=None, repeats=None):
    """The command line of one configuration's process (--one)."""
    return ([sys.executable, os.path.abspath(__file__), "--one", spec, str(n), str(b),
             "--steps", str(steps or a.steps), "--repeats", str(repeats or a.repeats),
             "--threads", str(a.threads), "--scheme", json.dumps(a.scheme)]
            + (["--prefill-chunk", str(a.prefill_chunk)] if a.prefill_chunk else []))


def at_budget(named, n, a, env):
    """Every configuration of `named` at context n and the largest batch
    whose measured cache fits --cache-budget, the full cache first: a row
    each (batch 0 and `error` where batch 1 does not fit).  A run that
    fails at batch 1 ends the command; one above (memory) ends the search
    there, noted in the row."""
    from cache_budget import largest_batch
    out, full = [], None
    for name, spec, _ in named:
        def go(b, probe, name=name, spec=spec):
            try:
                r = run_one(child_cmd(spec, n, b, a, repeats=1 if probe else None), env,
                            f"{name} at {n} x {b}")
            except KqsvdError as e:
                if b == 1:
                    raise
                return dict(error=str(e))
            fits = "fits" if r["cache_bytes"] <= a.cache_budget else "over"
            print(f"  {name[:60]} at {n} x {b}: cache {r['cache_bytes'] / 2**20:.1f} MiB, "
                  f"{fits}" + ("" if probe else f", {r['decode_tok_s']:.2f} tokens/s"),
                  file=sys.stderr, flush=True)
            return r
        r = dict(largest_batch(go, a.cache_budget), name=name, config=spec, context=n,
                 mmap_threshold=a.mmap_threshold)
        if spec == "full":
            full = r
        if "decode_tok_s" in r:
            r["against_full"] = r["decode_tok_s"] / full["decode_tok_s"] \
                if full and "decode_tok_s" in full else None
        out.append(r)
    return out


def measure(named, n, b, a, env):
    """Every configuration of `named` at context n and batch b, the full
    cache first, --rounds times in turn (full, A, B, ..., full, A, B,
    ...): a row per configuration, its figures the medians over rounds and
    its ratio the median of each round's ratio to that round's full cache,
    so that the machine's drift between rounds cancels."""
    runs = {spec: [] for _, spec, _ in named}
    for k in range(a.rounds):
        for name, spec, _ in named:
            r = run_one(child_cmd(spec, n, b, a), env, f"{name} at {n} x {b}")
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
    from kqsvd.commands.cli import ArgumentParser, count, listed, size
    ap = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                        formatter_class=argparse.RawDescriptionHelpFormatter,
                        epilog="\n\n".join(__doc__.split("\n\n")[3:]))
    ap.add_argument("--contexts", type=listed(count(1)), metavar="N,...",
                    help="prompt lengths; each + --steps within the model's positions "
                         "[1024,4096,8192 - --steps; with --frontier the report's context]")
    ap.add_argument("--batches", type=listed(count(1)), metavar="B,...",
                    help="prompts decoded together [1]")
    ap.add_argument("--cache-budget", type=size, metavar="BYTES",
                    help="in place of --batches: each configuration at the largest batch "
                         "whose measured cache fits BYTES (1GiB, 512MiB, bytes)")
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
    if a.cache_budget and (a.batches or a.rounds > 1 or a.frontier):
        raise UsageError("--cache-budget chooses each configuration's batch, in one round: "
                         "no --batches, --rounds or --frontier with it")
    a.batches = a.batches or [1]
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
        for b in [None] if a.cache_budget else a.batches:
            got = at_budget(named, n, a, env) if b is None else \
                measure(named, n, b, a, env)
            for name, r in zip((x[0] for x in named), got):
                path, eq, pol = name[6:].partition("=")  # a file by its name, not its folders
                label = "kqsvd:" + os.path.basename(path) + eq + pol \
                    if name.startswith("kqsvd:") else name
                rows.append(r)
                if "decode_tok_s" not in r:
                    print(f"{label[:43]:<44}{n:>8}{0:>6}  {r['error']}", flush=True)
                    continue
                lo, hi = r["decode_range"]
                print(f"{label[:43]:<44}{n:>8}{r['batch']:>6}{r['prefill_s']:>11.2f}"
                      f"{r['decode_tok_s']:>14.2f}{f'{lo:.2f}-{hi:.2f}':>16}"
                      f"{r['against_full'] or math.nan:>8.2f}{r['cache_bytes'] / 2**20:>10.1f}"
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
