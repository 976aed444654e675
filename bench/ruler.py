#!/usr/bin/env python3
"""RULER's synthetic tasks at long context (kqsvd.quality.ruler, generated
here from a seed: docs/ruler.md), answered greedily by the full model,
plain int-b caches, kvpress presses (alone and over transformers'
QuantizedCache) and kqsvd's stored files, each through its own cache, as
bench/passkey.py runs its trials.

    .venv-peers/bin/python bench/ruler.py --proj FILE [--proj FILE ...] \\
        [--tasks niah_single_1,vt,...] [--samples 25] [--lengths 4096,8192] \\
        [--question agnostic|aware|both] [--plain 4,3] [--attention sdpa|eager] \\
        [--presses expected:0.25,snapkv:0.125] \\
        [--composites expected:quanto:4:0.125] [--seed 0] [--json OUT]

The context is prefilled, and compressed, before the question is seen
(--question agnostic, kvpress's default); --question aware compresses
the question with it, and both runs each configuration both ways.  An
answer is right when it holds every value asked for (RULER's
string_match_all); each rate comes with its Wilson 95% interval, and the
average counts the tasks the full model answers at 80% or more at that
length (the others are listed as beyond the model).  Answers stop at
the task's RULER token limit, at the end-of-text token, or once every
value is in them (more tokens could not change the grade).

The report is written after every sample, under a temporary name renamed,
with "complete": false until the last: run the same command again to go
on from where a run stopped (its settings must be the same; --force
starts afresh).  A sample at 4,096 tokens takes about 12 s for the full
model on 2 cores in float32 (SDPA; 50 s eager), so the full suite is hours.

Errors are those of bench/passkey.py: one line, exit 2 for the command
line and the output, 1 for an input file, 130 for Ctrl-C or SIGTERM (the
report then holds every sample finished)."""
import argparse
import json
import os
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import retrieval_cli as cli
from kqsvd.commands.cli import ArgumentParser, count, run_command
from kqsvd.errors import UsageError
from kqsvd.quality import ruler

PROG = "ruler.py"
DEFAULT_JSON = os.path.join("data", "ruler", "ruler.json")
MODES = {"agnostic": ["agnostic"], "aware": ["aware"], "both": ["agnostic", "aware"]}


def _tasks(text):
    names = list(ruler.TASKS) if text.strip() == "all" else [t.strip() for t in text.split(",")]
    for t in names:
        if t not in ruler.TASKS:
            raise argparse.ArgumentTypeError(f"unknown task '{t}': expected all or some of "
                                             f"{', '.join(ruler.TASKS)}")
    if len(set(names)) < len(names):
        raise argparse.ArgumentTypeError(f"'{text}' names a task twice")
    return names


def parse(argv):
    ap = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                        formatter_class=argparse.RawDescriptionHelpFormatter,
                        epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    cli.add_options(ap, DEFAULT_JSON, "tokens of each sample, its answer's limit included, at "
                    "most the model's max_position_embeddings", lengths="4096")
    ap.add_argument("--tasks", type=_tasks, default="all",
                    help=f"all, or some of {', '.join(ruler.TASKS)} [%(default)s]")
    ap.add_argument("--samples", type=count(1), default=25,
                    help="samples per task and length [%(default)s]")
    ap.add_argument("--question", choices=tuple(MODES), default="agnostic",
                    help="compress the context before the question is seen, with it, or "
                    "both [%(default)s]")
    a = cli.parsed(ap.parse_args(argv), DEFAULT_JSON)
    a.modes = MODES[a.question]
    return a


def settings(a, labels):
    """What makes a report this run's: a resumed run must have the same."""
    return dict(model=a.model, text=os.path.abspath(a.text), tasks=a.tasks, lengths=a.lengths,
                samples=a.samples, seed=a.seed, dtype=a.dtype, attention=a.attention, modes=a.modes,
                configs=labels)


def _previous(a, want):
    """The records of the report at --json to go on from: [] where there is
    none or --force; UsageError for a report that is complete or another
    run's."""
    path = a.json
    if a.force or not os.path.lexists(path):
        return []
    try:
        with open(path, encoding="utf-8") as f:
            old = json.load(f)
        assert isinstance(old, dict) and isinstance(old.get("results"), list)
    except (OSError, ValueError, AssertionError):
        raise UsageError(f"--json {path}: exists and is not a ruler.py report to go on from; "
                         "give --force to replace it") from None
    if old.get("complete", True):
        raise UsageError(f"--json {path}: exists (a complete run); give --force to replace it")
    if old.get("settings") != want:
        diff = sorted(k for k in want if (old.get("settings") or {}).get(k) != want[k])
        raise UsageError(f"--json {path}: a stopped run with other settings "
                         f"({', '.join(diff)}); give the same options to go on, or --force")
    return old["results"]


def check(a):
    """retrieval_cli.check, then each task's first sample at each length:
    it fits, and its context suits every press.  Returns the text's
    Words, the tokenizer, the configurations, the records of a stopped
    run to go on from, and the folders to make."""
    from kqsvd import models
    new = max(ruler.ANSWER_TOKENS[t] for t in a.tasks)
    # an existing report is _previous()'s to refuse or go on from
    text, projs, folders = cli.check(a, 0, "RULER tasks", replace=True)
    configs = cli.configs(a, projs)
    previous = _previous(a, settings(a, ["full"] + [c.label for c in configs]))
    try:
        words = ruler.Words(text)
    except UsageError as e:
        raise UsageError(f"--text {a.text}: {e}") from None
    tok = models.tokenizer(a.model)
    for n in a.lengths:
        if n <= new:
            raise UsageError(f"--lengths {n}: not more than the answers' {new} tokens")
        for task in a.tasks:
            try:
                s = ruler.sample(task, tok, words, a.seed, n, 0)
            except UsageError as e:
                raise UsageError(f"--lengths {n}: {str(e).removeprefix('ruler: ')}") from None
            cli.check_context(a, n, len(s["context"]) + len(s["question"]) - 1
                              if "aware" in a.modes else len(s["context"]))
    return words, tok, configs, previous, folders


def answer_one(model, tok, s, config, mode, held):
    """One configuration's answer to sample s in `mode`: its record."""
    from kqsvd.quality.retrieval import answer
    context, question = s["context"], s["question"]
    if mode == "aware":  # the question compressed with the context; its last token asks
        context, question = context + question[:-1], question[-1:]
    eos = tok.eos_token_id

    def stop(ids):
        return ids[-1] == eos or ruler.found(tok.decode(ids), s["answers"]) == len(s["answers"])
    t0 = time.time()
    ids = answer(model, context, question, config, s["new"], held, stop)
    text = tok.decode(ids)
    got = ruler.found(text, s["answers"])
    return dict(task=s["task"], length=s["length"], index=s["index"], n=s["n"],
                config=config.label, mode=mode, answers=s["answers"], answer=text, found=got,
                of=len(s["answers"]), correct=got == len(s["answers"]), held=held[-1],
                seconds=round(time.time() - t0, 2))


def run(a, state):
    """The run; state["path"] and state["samples"] say what its report holds."""
    words, tok, configs, records, folders = check(a)
    from kqsvd.quality.configs import Config
    t0 = time.time()
    labels = ["full"] + [c.label for c in configs]
    want = settings(a, labels)
    done = {(r["task"], r["length"], r["index"], r["config"], r["mode"]) for r in records}
    everyone = [(Config(), "agnostic")] + [(c, m) for c in configs for m in a.modes]
    todo = [(n, t, i) for n in a.lengths for t in a.tasks for i in range(a.samples)]
    left = sum(any((t, n, i, c.label, m) not in done for c, m in everyone) for n, t, i in todo)
    print(f"ruler: {len(todo)} samples x {len(everyone)} answers, {len(todo) - left} done "
          "before", file=sys.stderr, flush=True)
    model = cli.load(a)[0]
    finished = 0
    for n, task, index in todo:
        runs = [(c, m) for c, m in everyone if (task, n, index, c.label, m) not in done]
        if not runs:
            continue
        s, t1 = ruler.sample(task, tok, words, a.seed, n, index), time.time()
        for c, m in runs:
            held = []
            records.append(answer_one(model, tok, s, c, m, held))
        finished += 1
        _write(a, want, records, folders, complete=False)
        folders = []
        state.update(path=a.json, samples=len({(r["task"], r["length"], r["index"])
                                                for r in records}))
        print(f"ruler: {task} at {n}, sample {index + 1}/{a.samples}: {time.time() - t1:.0f} s "
              f"({finished}/{left}, {time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
    report = _write(a, want, records, folders, complete=True)
    _print(a, report, labels)
    print(f"ruler: {len(a.tasks)} tasks x {a.samples} samples per length, wrote {a.json} in "
          f"{time.time() - t0:.0f} s")


def _write(a, want, records, folders, complete):
    """The report of the records so far, written whole (retrieval_cli.write)."""
    summary, beyond = ruler.tally(records, a.modes)
    full = {(r["task"], r["length"], r["index"]): r["held"] for r in records
            if r["config"] == "full"}
    for r in records:
        base = full.get((r["task"], r["length"], r["index"]))
        r["kept"] = r["held"] / base if base else None
    report = dict(bench="ruler", settings=want, complete=complete, summary=summary,
                  beyond=beyond, results=records)
    cli.write(a.json, report, folders, True)
    return report


def _print(a, report, labels):
    """One line per configuration and mode: the average and each task's rate."""
    w = max(len(x) for x in labels) + 10
    for n in map(str, a.lengths):
        print(f"at {n} tokens; beyond the model: {', '.join(report['beyond'].get(n, [])) or '-'}")
        print(f"{'configuration':<{w}}{'average':>20}" + "".join(f"{t[:12]:>13}" for t in a.tasks))
        for mode, rows in report["summary"].items():
            for label in labels:
                at = rows.get(label, {}).get(n)
                if at is None:
                    continue
                avg = at["average"]
                shown = (f"{100 * avg['rate']:.0f}% ({100 * avg['low']:.0f}-{100 * avg['high']:.0f})"
                         if avg else "-")
                cells = "".join(f"{100 * at['tasks'][t]['rate']:>12.0f}%" if t in at["tasks"]
                                else f"{'-':>13}" for t in a.tasks)
                tag = f"{label} ({mode})" if len(a.modes) > 1 and label != "full" else label
                print(f"{tag:<{w}}{shown:>20}{cells}")


def main(argv=None):
    """The exit status of the command line argv (sys.argv's without it)."""
    state = {}

    def kept():
        if state.get("samples"):
            return (f"{state['path']} holds the {state['samples']} samples finished; run the "
                    "same command to go on")
        return None
    try:
        return run_command(PROG, lambda: run(parse(argv), state), interrupted=kept)
    except SystemExit as e:  # --help
        return e.code


if __name__ == "__main__":
    sys.exit(main())
