"""What bench/passkey.py and bench/ruler.py share: the configurations
(--proj, --plain, --presses, --composites) and the other options, their
checks before the model loads (docs/guide/commands.md: every option, the
text, each --proj file, kvpress, the model's header, the report's place)
and the report's write.  Each script adds its task's options and checks
each prompt's context against the presses."""
import argparse
import os

from kqsvd.commands.cli import count, listed
from kqsvd.errors import KqsvdError, UsageError
from kqsvd.formats.policy import parse as parse_policy
from kqsvd.formats.quant import BITS
from kqsvd.quality.peers import PRESSES, PressPeer, composite_of, press_of, press_over_quantized

TEXT = os.path.join("examples", "data", "jargon-file-4.4.7.txt")
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
ATTENTION = ("sdpa", "eager")


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


def add_options(ap, default_json, lengths_help, lengths="2048"):
    """The options of every retrieval bench on the parser ap; lengths_help
    says what --lengths counts."""
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct",
                    help="model folder, GGUF file or id (offline) [%(default)s]")
    ap.add_argument("--text", help=f"UTF-8 text whose second half is the filler [{TEXT} of "
                    "this repository]")
    ap.add_argument("--proj", action="append", default=[],
                    help="a kqsvd projections file, PATH[=POLICY], run with POLICY (a rank "
                    "policy the file resolves alone, tiers: layouts included; its stored one "
                    "by default); repeat it to compare files or policies")
    ap.add_argument("--lengths", type=listed(count(1)), default=lengths,
                    help=lengths_help + "; comma-separated [%(default)s]")
    ap.add_argument("--plain", type=_or_none(listed(_bits)), default="4,3",
                    help=f"bits of plain quantized caches, each one of "
                    f"{', '.join(map(str, BITS))}, or none [%(default)s]")
    ap.add_argument("--kivi", type=_or_none(listed(_bits)), default="none",
                    help="bits of KIVI's caches: int-b as --plain, the newest --kivi-residual "
                    "tokens held unquantized (counted at bf16's 2 bytes), or none [%(default)s]")
    ap.add_argument("--kivi-residual", type=count(1), default=128,
                    help="tokens KIVI's caches hold unquantized, at most the shortest --lengths "
                    "[%(default)s, KIVI's]")
    ap.add_argument("--presses", type=_or_none(listed(_press)),
                    default="expected:0.25,expected:0.125",
                    help=f"kvpress presses PRESS:KEPT, PRESS one of {', '.join(PRESSES)} and "
                    "KEPT the share of the context kept, or none [%(default)s]")
    ap.add_argument("--composites", type=_or_none(listed(_composite)), default="none",
                    help="presses over QuantizedCache, PRESS:BACKEND:BITS:BYTES, BYTES the "
                    "fraction of the bf16 cache's bytes held, or none [%(default)s]")
    ap.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    ap.add_argument("--attention", default="sdpa", choices=ATTENTION,
                    help="the model's own attention, for the full model and the presses: "
                    "SDPA, what users run (4 times eager's speed at 4,096 tokens on 2 cores), "
                    "or eager, as reports before it were made [%(default)s]")
    ap.add_argument("--seed", type=count(0), default=0, help="draws the keys [0]")
    ap.add_argument("--json", help=f"the report [{default_json} in the current folder, its "
                    "folders made when the report is written]; a --json given must be in a "
                    "folder that exists")
    ap.add_argument("--force", action="store_true", help="replace the report if it exists")


def load(a):
    """(model, tokenizer) of --model in --dtype, attending by --attention:
    kqsvd's configurations switch to their own function for their blocks
    and back (attention.compressed), so it is what the others run."""
    import torch
    from kqsvd import models
    model, tok, _ = models.load(a.model, dtype=getattr(torch, a.dtype))
    model.set_attn_implementation(a.attention)
    return model, tok


def parsed(a, default_json):
    """a, the parsed options, with the defaults that depend on others."""
    a.windows = {}  # each press's window of queries, from check()
    a.default_json = default_json
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


def check(a, new, task, replace=False):
    """Every check that needs no model weights but the task's prompts, in
    the order a user would fix them: the options, the inputs, the model's
    header, the output.  `new` is the tokens past a --lengths an answer
    may take, `task` names the bench in errors, `replace` lets an existing
    report be replaced (--force, or a run resumed).  Returns the text, the projections, and
    the folders to make for the report (the default's, where missing)."""
    from kqsvd import models
    from kqsvd.formats.files import check_folder_output, check_input_file, check_outputs
    from kqsvd.formats.projections import check_sizes, file_sizes
    from kqsvd.quality.peers import need
    check_input_file("--text", a.text)
    try:
        with open(a.text, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise KqsvdError(f"--text {a.text}: not UTF-8 text (byte {e.start})") from None
    _check_proj_items(a.proj)
    if a.kivi and a.kivi_residual > min(a.lengths):
        raise UsageError(f"--kivi-residual {a.kivi_residual}: at most the shortest --lengths, "
                         f"{min(a.lengths)} (or give --kivi none)")
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
        check_context(a, n, n)
    info, cfg = models.describe(a.model)
    if not info.causal:
        raise KqsvdError(f"{a.model}: the {task} needs a causal decoder, not '{info.model_type}'")
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
    for n in a.lengths if limit else ():
        if n > limit - new:
            less = f" less the answer's {new} tokens" if new else ""
            raise UsageError(f"--lengths {n}: at most {limit - new}, the model's "
                             f"max_position_embeddings = {limit}{less}")
    inputs = [("--text", a.text), ("--model", info.path)] + [("--proj", _proj_item(p)[0])
                                                              for p in a.proj]
    path, missing = a.json or a.default_json, []
    folder = os.path.dirname(os.path.abspath(path))
    if a.json is None and not os.path.lexists(folder):
        check_folder_output("--json", os.path.dirname(path), inputs)
        while not os.path.lexists(folder):
            missing.append(folder)
            folder = os.path.dirname(folder)
    else:
        check_outputs([("--json", path)], inputs, a.force or replace)
    a.json = path
    return text, projs, missing[::-1]


def check_context(a, length, context):
    """Refuses a press that cannot serve a prompt of `length` tokens whose
    context (what is compressed) is `context` tokens: one scoring by a
    window of queries as long as the context, and one keeping less than
    one of its tokens (kvpress keeps one, and the cache would hold more
    than its label says)."""
    for name, window in a.windows.items():
        if context <= window:
            raise UsageError(f"--lengths {length}: the press {name} needs a context (the "
                             f"prompt less its question) of more than its window of {window} "
                             "tokens")
    peers = [(f"--presses {name}:{kept:g}", PressPeer(name, kept, context))
             for name, kept in a.presses]
    peers += [(f"--composites {_composite_name(c)}", c.press) for c in a.composites]
    for what, peer in peers:
        if peer.tokens_kept(context) < 1:
            raise UsageError(f"--lengths {length}: {what} keeps less than one of the context's "
                             f"{context} tokens (the prompt less its question); give a larger "
                             "fraction")


def configs(a, projs):
    """The configurations the options name, the full model's aside."""
    from kqsvd.formats.quant import QuantScheme
    from kqsvd.quality.configs import Latent, PlainQuant
    out = [PlainQuant(b, QuantScheme()) for b in a.plain]
    out += [PlainQuant(b, QuantScheme(residual=a.kivi_residual), kivi=True)
            for b in a.kivi]
    out += [PressPeer(name, kept, 1 << 20) for name, kept in a.presses]
    out += a.composites
    for stem, pol, p in projs:
        out.append(Latent(pol, "kqsvd", p, f" [{stem}]"))
    return out


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
