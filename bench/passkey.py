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

from kqsvd.commands.cli import ArgumentParser, count, listed, run_command
from kqsvd.errors import KqsvdError, UsageError
from kqsvd.formats.numbers import number
from kqsvd.formats.policy import parse as parse_policy
from kqsvd.formats.quant import BITS
from kqsvd.quality.peers import PRESSES, PressPeer, composite_of, press_of, press_over_quantized
from kqsvd.quality.retrieval import TASKS

PROG = "passkey.py"
TEXT = os.path.join("examples", "data", "jargon-file-4.4.7.txt")
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


def _bits(text):
    v = count(1)(text)
    if v not in BITS:
        raise argparse.ArgumentTypeError(f"{text} bits: expected one of "
                                         f"{', '.join(map(str, BITS))}")
    return v


def _press(text):
    try:
        return press_of(text)
    except UsageError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _composite(text):
    """(press, backend, bits, bytes) of PRESS:BACKEND:BITS:BYTES."""
    try:
        return composite_of(text)
    except UsageError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _or_none(read):
    """read, or no item for 'none' (or nothing), as the frontier takes
    --plain and --presses."""
    def parse(text):
        return [] if text.strip() in ("", "none") else read(text)
    parse.__name__ = read.__name__
    return parse


def parse(argv):
    ap = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                        formatter_class=argparse.RawDescriptionHelpFormatter,
                        epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct",
                    help="model folder, GGUF file or id (offline) [%(default)s]")
    ap.add_argument("--text", help=f"UTF-8 text whose second half is the filler [{TEXT} of "
                    "this repository]")
    ap.add_argument("--proj", action="append", default=[],
                    help="a kqsvd projections file, PATH[=POLICY], run with POLICY (a rank "
                    "policy the file resolves alone, tiers: layouts included; its stored one "
                    "by default); repeat it to compare files or policies")
    ap.add_argument("--lengths", type=listed(count(1)), default="2048",
                    help="tokens of each prompt, question included, at most the model's "
                    "max_position_embeddings less the answer's; comma-separated [%(default)s]")
    ap.add_argument("--depths", type=listed(_depth), default="0.1,0.3,0.5,0.7,0.9",
                    help="where the key sits, each a share of the filler in [0, 1] "
                    "[%(default)s]")
    ap.add_argument("--plain", type=_or_none(listed(_bits)), default="4,3",
                    help=f"bits of plain quantized caches, each one of "
                    f"{', '.join(map(str, BITS))}, or none [%(default)s]")
    ap.add_argument("--presses", type=_or_none(listed(_press)),
                    default="expected:0.25,expected:0.125",
                    help=f"kvpress presses PRESS:KEPT, PRESS one of {', '.join(PRESSES)} and "
                    "KEPT the share of the context kept, or none [%(default)s]")
    ap.add_argument("--composites", type=_or_none(listed(_composite)), default="none",
                    help="presses over QuantizedCache, PRESS:BACKEND:BITS:BYTES, BYTES the "
                    "fraction of the bf16 cache's bytes held, or none [%(default)s]")
    ap.add_argument("--task", default="passkey", choices=TASKS,
                    help="a 5-digit key, or a 20-digit code to copy back [%(default)s]")
    ap.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    ap.add_argument("--seed", type=count(0), default=0, help="draws the keys [0]")
    ap.add_argument("--json", help=f"the report [{DEFAULT_JSON} in the current folder, its "
                    "folders made when the report is written]; a --json given must be in a "
                    "folder that exists")
    ap.add_argument("--force", action="store_true", help="replace the report if it exists")
    a = ap.parse_args(argv)
    a.windows = {}  # each press's window of queries, from check()
    if a.text is None:
        a.text = os.path.join(ROOT, TEXT)
    return a


def _composite_config(spec, length):
    """The PressOverQuantized of a --composites item, checked: its backend
    and kvpress importable, a budget below the cache's own, and one that
    keeps a token of a prompt of `length` (the shortest)."""
    item = _composite_item(*spec)
    try:  # the frontier's default --group
        c = press_over_quantized(*spec, length, 32)
        c.check()
    except UsageError as e:
        raise UsageError(f"--composites {item}: " + str(e).replace("--context ", "--lengths ") +
                         " (or give --composites none)") from None
    return c


def _composite_item(name, backend, bits, budget):
    return f"{name}:{backend}:{bits}:{budget:g}"


def _composite_name(c):
    """The --composites item of a PressOverQuantized."""
    return _composite_item(c.press.name, c.quant.backend, c.quant.bits, c.budget)


def _proj_item(item):
    """(path, policy) of --proj PATH[=POLICY], the policy 'stored' unless given."""
    path, eq, pol = item.partition("=")
    return path, (pol if eq else "stored")


def _resolved(item, path, pol, layers):
    """The Projections of a --proj item, its policy resolved as the frontier
    resolves one (quality.measure.resolve_policies)."""
    from kqsvd.quality.measure import resolve_policies
    try:
        [(_, _, proj)] = resolve_policies(path, [pol], ["kqsvd"], layers)
    except UsageError as e:
        raise UsageError(f"--proj {item}: {e}") from None
    return proj


def _stem(path):
    return os.path.splitext(os.path.basename(path))[0]


def _check_window(name, length, context, window):
    if context <= window:
        raise UsageError(f"--lengths {length}: the press {name} needs a context (the prompt less "
                         f"its question) of more than its window of {window} tokens")


def _check_kept(a, length, context):
    """Refuses a press, alone or over a quantized cache, keeping less than
    one of the context's tokens: kvpress keeps one, and the cache would
    hold more than its label says."""
    peers = [(f"--presses {name}:{kept:g}", PressPeer(name, kept, context))
             for name, kept in a.presses]
    peers += [(f"--composites {_composite_name(c)}", c.press) for c in a.composites]
    for what, peer in peers:
        if peer.tokens_kept(context) < 1:
            raise UsageError(f"--lengths {length}: {what} keeps less than one of the context's "
                             f"{context} tokens (the prompt less its question); give a larger "
                             "fraction")


def check(a):
    """Every check that needs no model weights, in the order a user would
    fix them: the options, the inputs, the model's header, the output.
    Returns the text, the projections and the folders to make for the
    report (the default's, where missing)."""
    from kqsvd import models
    from kqsvd.formats.files import check_folder_output, check_input_file, check_outputs
    from kqsvd.formats.projections import check_sizes, file_sizes
    from kqsvd.quality.peers import need
    from kqsvd.quality.retrieval import ANSWER_TOKENS
    check_input_file("--text", a.text)
    try:
        with open(a.text, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise KqsvdError(f"--text {a.text}: not UTF-8 text (byte {e.start})") from None
    _check_proj_items(a.proj)
    for name, kept in a.presses:
        try:  # kvpress importable, and with this transformers
            PressPeer(name, kept, 1 << 20).check()
        except UsageError as e:
            raise UsageError(f"--presses {name}:{kept:g}: {e} (or give --presses none)") from None
    a.composites = [_composite_config(c, min(a.lengths)) for c in a.composites]
    for name in {n for n, _ in a.presses} | {c.press.name for c in a.composites}:
        # SnapKV scores the context by its last window_size queries, and
        # fails inside kvpress on a shorter one
        a.windows[name] = getattr(getattr(need("kvpress", name), PRESSES[name])(), "window_size", 0)
        for n in a.lengths:
            _check_window(name, n, n, a.windows[name])
    for n in a.lengths:
        _check_kept(a, n, n)
    info, cfg = models.describe(a.model)
    if not info.causal:
        raise KqsvdError(f"{a.model}: the passkey needs a causal decoder, not '{info.model_type}'")
    for c in a.composites:  # QuantizedCache's group (32) against the model's sizes
        try:
            c.check_model(lambda: info)
        except UsageError as e:
            raise UsageError(f"--composites {_composite_name(c)}: "
                             f"{str(e).removeprefix('--group 32: ')}") from None
    projs = []
    for item in a.proj:
        path, pol = _proj_item(item)
        check_sizes(file_sizes(path, ("kqsvd",)), path, info.sizes(), a.model)
        projs.append((_stem(path), pol, _resolved(item, path, pol, info.num_layers)))
    # The answer's tokens stay within the model's positions: a length at the
    # limit is the prompt and answer together.
    limit = getattr(cfg, "max_position_embeddings", None)
    new = ANSWER_TOKENS[a.task]
    for n in a.lengths if limit else ():
        if n > limit - new:
            raise UsageError(f"--lengths {n}: at most {limit - new}, the model's "
                             f"max_position_embeddings = {limit} less the answer's {new} tokens")
    inputs = [("--text", a.text), ("--model", info.path)] + [("--proj", _proj_item(p)[0])
                                                              for p in a.proj]
    path, missing = a.json or DEFAULT_JSON, []
    folder = os.path.dirname(os.path.abspath(path))
    if a.json is None and not os.path.lexists(folder):
        check_folder_output("--json", os.path.dirname(path), inputs)
        while not os.path.lexists(folder):
            missing.append(folder)
            folder = os.path.dirname(folder)
    else:
        check_outputs([("--json", path)], inputs, a.force)
    a.json = path
    return _filler(a, text), projs, missing[::-1]


def _check_proj_items(items):
    """--proj FILE=POLICY items: each file a regular file, each policy read,
    and no file and policy (or report name) given twice."""
    from kqsvd.formats.files import check_input_file
    seen, stems = {}, {}
    for item in items:
        path, pol = _proj_item(item)
        check_input_file("--proj", path)
        try:  # policies compared as parsed: fixed:32 and fixed:032 are one
            key = parse_policy(pol).key
        except UsageError as e:
            raise UsageError(f"--proj {item}: {e}") from None
        st = os.stat(path)  # a link to a file given already is that file
        if (st.st_dev, st.st_ino, key) in seen:
            raise UsageError(f"--proj {item}: the same file and policy as --proj "
                             f"{seen[st.st_dev, st.st_ino, key]}")
        seen[st.st_dev, st.st_ino, key] = item
        if (_stem(path), key) in stems:  # the report has one row per name
            raise UsageError(f"--proj {item}: named [{_stem(path)}] in the report, as --proj "
                             f"{stems[_stem(path), key]} is; give the files names of their own")
        stems[_stem(path), key] = item


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
        for name, window in a.windows.items():
            _check_window(name, n, len(context), window)
        _check_kept(a, n, len(context))
    return filler


def write(path, report, folders, force=False):
    """The report, under a temporary name renamed when complete, in
    `folders` made first (outermost first) and removed again should the
    write fail or be interrupted."""
    from kqsvd.formats.files import json_writer, write_atomic
    made = []
    try:
        for d in folders:
            if not os.path.isdir(d):  # made meanwhile by another run: not ours to remove
                os.mkdir(d)
                made.append(d)
        write_atomic(path, json_writer(report), force)
    except BaseException:
        for d in reversed(made):
            try:
                os.rmdir(d)
            except OSError:
                pass
        raise


def run(a):
    filler, projs, folders = check(a)
    import numpy as np
    import torch
    from kqsvd import models
    from kqsvd.formats.quant import QuantScheme
    from kqsvd.quality.configs import Latent, PlainQuant
    from kqsvd.quality.retrieval import accuracy, passkey
    t0 = time.time()
    configs = [PlainQuant(b, QuantScheme()) for b in a.plain]
    configs += [PressPeer(name, kept, 1 << 20) for name, kept in a.presses]
    configs += a.composites
    for stem, pol, p in projs:
        configs.append(Latent(pol, "kqsvd", p, f" [{stem}]"))
    model, tok, _ = models.load(a.model, dtype=getattr(torch, a.dtype))
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
                  depths=a.depths, dtype=a.dtype, seed=a.seed, kept=kept, results=rows,
                  elapsed_s=time.time() - t0)
    write(a.json, report, folders, a.force)
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
