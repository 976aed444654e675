#!/usr/bin/env python3
"""Passkey retrieval at long context (kqsvd.quality.retrieval): a 5-digit
key hidden at each depth of filler from the text's held-out end, asked
for and answered greedily by the full model, plain int-b caches, kvpress
presses (alone and over transformers' QuantizedCache) and kqsvd's stored
files (tiered ones included), each through its own cache.

    .venv-peers/bin/python bench/passkey.py --proj FILE [--proj FILE ...] \\
        [--task passkey|span] [--lengths 2048,4096,8192] \\
        [--depths 0.1,0.3,0.5,0.7,0.9] [--plain 4,3] \\
        [--presses expected:0.25,expected:0.125] \\
        [--composites expected:quanto:4:0.125] [--json OUT]

--task span hides a 20-digit access code (four groups of five) and asks
for it back: every token of a span retrieved and copied, not five digits.
--composites PRESS:BACKEND:BITS:BYTES runs a press over QuantizedCache
keeping BYTES of the bf16 cache's bytes (as kqsvd.frontier's
--press-quantized).  The presses need kvpress (.venv-peers; --presses
none without it).  Each
trial prefills its whole context: about 9 s at 2,048 tokens, 32 s at 4,096
and 2 minutes at 8,192 on 2 cores in float32 for the full model.

Everything is checked before the model loads, as the package's commands
check it (docs/guide/commands.md): every option, the text (UTF-8), each
--proj file (readable, of the model's sizes), kvpress for the presses
(each keeping a token of every context at least), each length against
the model's positions, and the report's place.  Errors are
one line: exit 2 for the command line and the output, 1 for an input file,
130 for Ctrl-C or SIGTERM; the report is written only when every trial has
run, under a temporary name renamed at the end."""
import argparse
import os
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import retrieval_cli as cli
from kqsvd.commands.cli import ArgumentParser, listed, run_command
from kqsvd.errors import UsageError
from kqsvd.formats.numbers import number
from kqsvd.quality.retrieval import TASKS

PROG = "passkey.py"
# Relative to the current folder, as before; made only when the report is
# written, so that a run that fails leaves no empty folder behind.
DEFAULT_JSON = os.path.join("data", "passkey", "passkey.json")


def _depth(text):
    v = number(text)
    if v is None:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number")
    if not 0 <= v <= 1:  # NaN and the infinities fail this too
        raise argparse.ArgumentTypeError(f"{text} is not a depth in [0, 1] (the share of the "
                                         "filler before the key)")
    return v


def parse(argv):
    ap = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                        formatter_class=argparse.RawDescriptionHelpFormatter,
                        epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    cli.add_options(ap, DEFAULT_JSON, "tokens of each prompt, question included, at most the "
                    "model's max_position_embeddings less the answer's")
    ap.add_argument("--depths", type=listed(_depth), default="0.1,0.3,0.5,0.7,0.9",
                    help="where the key sits, each a share of the filler in [0, 1] "
                    "[%(default)s]")
    ap.add_argument("--task", default="passkey", choices=TASKS,
                    help="a 5-digit key, or a 20-digit code to copy back [%(default)s]")
    return cli.parsed(ap.parse_args(argv), DEFAULT_JSON)


def check(a):
    """retrieval_cli.check, then the prompts' lengths against the filler.
    Returns the filler, the projections and the folders to make."""
    from kqsvd.quality.retrieval import ANSWER_TOKENS
    text, projs, folders = cli.check(a, ANSWER_TOKENS[a.task], "passkey")
    return _filler(a, text), projs, folders


def _filler(a, text):
    """The filler's token ids, the text's second half (no file was
    calibrated on it), with every length checked against it and each
    press's window: by the model's tokenizer alone, before the load."""
    from kqsvd import models
    from kqsvd.quality.retrieval import task_prompt, widest_key
    tok = models.tokenizer(a.model)
    ids = tok(text, add_special_tokens=False, verbose=False)["input_ids"]
    filler = ids[len(ids) // 2:]
    for n in a.lengths:
        try:
            context, _ = task_prompt(a.task, tok, filler, n, 0.5, widest_key(a.task))
        except UsageError as e:
            raise UsageError(f"--lengths {n}: {str(e).removeprefix('passkey: ')}") from None
        cli.check_context(a, n, len(context))
    return filler


def run(a):
    filler, projs, folders = check(a)
    import numpy as np
    from kqsvd.quality.retrieval import accuracy, passkey
    t0 = time.time()
    configs = cli.configs(a, projs)
    model, tok = cli.load(a)
    total = len(a.lengths) * len(a.depths) * (1 + len(configs))
    done = [0]

    def progress():
        done[0] += 1
        print(f"passkey: {done[0]}/{total} answers, {time.time() - t0:.0f} s", file=sys.stderr,
              flush=True)
    rows = passkey(model, tok, filler, a.lengths, a.depths, configs, a.seed, progress, a.task)
    # the bytes each cache held after the prompt's context, over the full
    # model's, as measured (a tiered layout's depend on the length)
    kept = {label: {str(n): float(np.mean([r["kept"] for r in got if r["length"] == n]))
                    for n in a.lengths} for label, got in rows.items()}
    report = dict(model=a.model, task=a.task, text=os.path.basename(a.text), lengths=a.lengths,
                  depths=a.depths, dtype=a.dtype, attention=a.attention, seed=a.seed, kept=kept, results=rows,
                  elapsed_s=time.time() - t0)
    cli.write(a.json, report, folders, a.force)
    w = max(len(k) for k in rows) + 2
    print(f"{'configuration':<{w}}" + "".join(f"{n:>8} {'kept':>6}" for n in a.lengths))
    for label, got in rows.items():
        print(f"{label:<{w}}" + "".join(f"{100 * accuracy(got, n):>7.0f}% "
                                        f"{100 * kept[label][str(n)]:>5.1f}%" for n in a.lengths))
    print(f"passkey ({a.task}): {len(a.depths)} depths per length, wrote {a.json} in "
          f"{time.time() - t0:.0f} s")


def main(argv=None):
    """The exit status of the command line argv (sys.argv's without it)."""
    try:
        return run_command(PROG, lambda: run(parse(argv)))
    except SystemExit as e:  # --help
        return e.code


if __name__ == "__main__":
    sys.exit(main())
