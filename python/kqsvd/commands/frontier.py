"""Quality per byte: kqsvd's latents (quantized or not) and what a user
already has, on the same windows, scored the same way.

    python -m kqsvd.frontier --model M --text FILE [--proj PROJ.h5 --ranks POLICY[,...]]
        [--methods kqsvd,ksvd] [--group 32] [--key-axis channel] [--value-axis token]
        [--residual 0] [--rotate] [--plain 8,4,3,2] [--quantized-cache quanto:4,quanto:2]
        [--presses snapkv,expected,knorm] [--press-kept 0.5,0.25,0.125]
        [--press-quantized quanto:4] [--press-bytes 0.25,0.125,0.0625]
        [--context 768] [--continuation 256] [--num-seqs 3] [--split validation] [--chunk 1]
        [--dtype float32] [--device cpu] --json OUT [--plot PNG] [--force]

Each window's first --context tokens are prefilled into the configuration's
cache, the next --continuation tokens are fed --chunk at a time with that
cache and scored (perplexity, KL to the full model, top-1 agreement).  The
configurations: every rank policy of `kqsvd ranks` (eps:E, fixed:R,
budget:F, stored) for each method (METHOD/POLICY for one method only),
with '@b' a b-bit latent (fixed:32@4, or fixed:32@4/8 for 4-bit keys and
8-bit values); plain int-b caches of the
model's keys and values (--plain); transformers' QuantizedCache
(--quantized-cache backend:bits); kvpress presses keeping each fraction of
the context (--presses, --press-kept), and the same presses over a
QuantizedCache holding each fraction of the bf16 bytes (--press-quantized,
--press-bytes: kvpress's own composite).  Quantized latents and plain caches
use one scheme (docs/quantized-cache.md): groups of --group values, keys
per channel or per token (--key-axis), values likewise (--value-axis), the
newest --residual tokens unquantized, the latent rotated by a Hadamard
matrix with --rotate (--group at most 4096, --residual at most a window's
tokens; transformers' QuantizedCache, alone or under a press, takes the
same --group, which must divide the model's KV heads x head_dim).  Every
option is checked before the model loads: each policy as `kqsvd ranks`
reads it, no list naming one configuration twice (files compared by
device and inode: a link is its file), and no press keeping less than one
of the context's tokens (kvpress would keep one: more bytes than its
label).  Usage errors exit 2,
bad input 1; outputs are written under a temporary name and renamed."""
import argparse
import dataclasses
import functools
import os
import sys
import time

from .. import models
from ..errors import KqsvdError, UsageError
from ..formats.files import check_input_file, check_outputs
from ..formats.numbers import number, whole
from ..formats.policy import parse as parse_policy
from ..formats.projections import METHODS, check_sizes, file_sizes, policy_ranks, window_warning
from ..formats.quant import AXES, BITS, GROUP_MAX, QuantScheme
from ..formats.tiers import check_width
from ..progress import Progress
from ..quality import intervals
from ..quality.configs import Latent, PlainQuant
from ..quality.frontier import pareto, score
from ..quality.measure import resolve_policies
from ..quality.peers import BACKENDS, PRESSES, PressOverQuantized, PressPeer, QuantizedCachePeer
from .cli import (ArgumentParser, between, check_plot, count, figure_writer, run_command,
                  write_report)

PROG = "python -m kqsvd.frontier"


def _list(text):
    return [x.strip() for x in text.split(",") if x.strip() and x.strip() != "none"]


def _twice(opt, item, first):
    """The error for a list option naming one configuration twice."""
    return UsageError(f"{opt}: '{item}' is given twice" + ("" if item == first else
                                                           f" (as '{first}')"))


def _once(opt, items, key=str):
    """items, refused when two of them are one configuration (key equal)."""
    seen = {}
    for x in items:
        if key(x) in seen:
            raise _twice(opt, x, seen[key(x)])
        seen[key(x)] = x
    return items


def _options():
    ap = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                        formatter_class=argparse.RawDescriptionHelpFormatter,
                        epilog="The JSON report is described in docs/quantized-cache.md.")
    ap.add_argument("--model", required=True, help="model folder, GGUF file or id (offline)")
    ap.add_argument("--text", required=True, help="UTF-8 text to cut the windows from")
    ap.add_argument("--proj", action="append", default=[],
                    help="projections file (kqsvd calibrate --out), FILE=POLICY,... for policies "
                    "of its own; repeat it to compare files")
    ap.add_argument("--ranks", default="", help="rank policies of every --proj without its own, "
                    "comma-separated, each with optional '@bits' (fixed:32@4)")
    ap.add_argument("--methods", default="kqsvd,ksvd", help="[kqsvd,ksvd]")
    ap.add_argument("--group", type=between(1, GROUP_MAX), default=32,
                    help=f"values per scale, 1..{GROUP_MAX} [32]")
    ap.add_argument("--key-axis", choices=AXES, default="channel", help="[channel]")
    ap.add_argument("--value-axis", choices=AXES, default="token", help="[token]")
    ap.add_argument("--residual", type=count(0),
                    help="newest tokens held unquantized, at most --context + --continuation, "
                    "in every quantized cache, a file's stored bits too [0; a file: its own]")
    ap.add_argument("--rotate", action="store_true",
                    help="rotate quantized latents by a Hadamard matrix (Palu)")
    ap.add_argument("--plain", default="8,4,3,2", help="bits of plain quantized caches [8,4,3,2]")
    ap.add_argument("--quantized-cache", default="quanto:4,quanto:2",
                    help="transformers QuantizedCache backend:bits, backend quanto or hqq "
                    "[quanto:4,quanto:2]")
    ap.add_argument("--presses", default="snapkv,expected,knorm",
                    help=f"kvpress presses ({', '.join(PRESSES)}) [snapkv,expected,knorm]")
    ap.add_argument("--press-kept", default="0.5,0.25,0.125",
                    help="fractions of the context the presses keep [0.5,0.25,0.125]")
    ap.add_argument("--press-quantized", default="",
                    help="QuantizedCache backend:bits that every press also runs over, as "
                    "kvpress runs it (quanto:4,quanto:2) [none]")
    ap.add_argument("--press-bytes", default="0.25,0.125,0.0625",
                    help="fractions of the bf16 cache's bytes a press over a quantized cache "
                    "holds: it keeps that over the cache's own fraction [0.25,0.125,0.0625]")
    ap.add_argument("--context", type=count(1), default=768, help="tokens prefilled [768]")
    ap.add_argument("--continuation", type=count(1), default=256, help="tokens scored [256]")
    ap.add_argument("--num-seqs", type=count(1), default=3, help="windows [3]")
    ap.add_argument("--split", choices=("train", "validation"), default="validation")
    ap.add_argument("--chunk", type=count(1), default=1, help="tokens per continuation step [1]")
    ap.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N [cpu]")
    ap.add_argument("--no-bos", action="store_true", help="windows without the BOS token")
    ap.add_argument("--json", required=True, help="the report")
    ap.add_argument("--plot", help="PNG: perplexity and KL against the bytes kept")
    ap.add_argument("--force", action="store_true", help="replace outputs that exist")
    return ap


def parse(argv):
    """The options, each checked before the model loads (the files, each
    policy as `kqsvd ranks` reads it, the peers, the outputs)."""
    a = _options().parse_args(argv)
    T = a.context + a.continuation
    a.stored_residual, a.residual = a.residual, a.residual or 0
    if a.residual > T:  # a window holds no more tokens than that
        raise UsageError(f"--residual {a.residual}: at most --context + --continuation = {T}")
    a.scheme = QuantScheme(a.group, a.key_axis, a.value_axis, a.residual, a.rotate).check()
    a.policies, a.methods = _list(a.ranks), _once("--methods", _list(a.methods))
    bad = [m for m in a.methods if m not in METHODS]
    if bad or not a.methods:
        raise UsageError(f"--methods: {f'unknown method {bad[0]!r}' if bad else 'none given'} "
                         f"(expected one or more of {', '.join(METHODS)})")
    # FILE=POLICY,... : that file's own policies instead of --ranks'
    raw = a.proj
    a.proj = [(f, _list(pols) if eq else a.policies) for f, eq, pols in
              (p.partition("=") for p in raw)]
    if a.policies and not a.proj:
        raise UsageError(f"--ranks {a.ranks}: give the projections file (--proj)")
    if a.policies and all("=" in p for p in raw):
        raise UsageError(f"--ranks {a.ranks}: every --proj names its own policies "
                         "(FILE=POLICY,...), so --ranks would apply to no file")
    for given, (_, pols) in zip(raw, a.proj):
        if not pols:
            raise UsageError(f"--proj {given}: no rank policy for it; give --ranks POLICY,... or "
                             "--proj FILE=POLICY,...")
    a.configs = _peer_configs(a, BACKENDS, PRESSES)
    if not a.configs and not a.proj:
        raise UsageError("nothing to compare: give --ranks, --plain, --quantized-cache or "
                         "--presses")
    for c in a.configs:
        c.check()
    info = functools.cache(lambda: models.describe(a.model)[0])  # the header, once, if a peer asks
    for c in a.configs:
        c.check_model(info)
    check_plot(a.plot)
    check_input_file("--text", a.text)
    files = _files(a.proj)
    # Each file, and each policy as `kqsvd ranks` reads it, before the model loads.
    a.sizes = [file_sizes(path, a.methods) for path in files]
    for given, (path, pols) in zip(raw, a.proj):
        _check_policies("--ranks" if "=" not in given else f"--proj {path}", path, pols,
                        a.methods)
    check_outputs([("--json", a.json), ("--plot", a.plot)],
                  [("--proj", p) for p in files] +
                  [("--text", a.text), ("--model", models.resolve(a.model))], a.force)
    return a


def _files(proj):
    """The --proj files, each readable and given once (a link to a file
    given already is that file)."""
    files, seen = [f for f, _ in proj], {}
    for path in files:
        check_input_file("--proj", path)
        st = os.stat(path)
        if (st.st_dev, st.st_ino) in seen:
            raise UsageError(f"--proj {path}: the same file as --proj {seen[st.st_dev, st.st_ino]};"
                             " give it once, with all its policies (FILE=POLICY,...)")
        seen[st.st_dev, st.st_ino] = path
    return files


def _check_policies(opt, path, policies, methods):
    """Refuses (UsageError naming opt) a policy of the file `path` that
    `kqsvd ranks` or the bits' syntax refuse, one fitted to the model, and
    one configuration named twice (fixed:8 and kqsvd/fixed:08 among the
    methods kqsvd and ksvd)."""
    seen = {}
    for pol in policies:
        try:
            got = parse_policy(pol, methods=True)
        except UsageError as e:
            raise UsageError(f"{opt}: {e}") from None
        if got.tiers is not None:
            _check_tiers(opt, path, got.tiers)
        elif got.base.startswith("quality-"):
            raise UsageError(f"{opt} {pol}: fit it with python -m kqsvd.quality, then give its "
                             "file as --proj FILE=stored")
        else:  # as `kqsvd ranks` reads it
            try:
                policy_ranks(path, None if got.base == "stored" else got.base)
            except UsageError as e:
                raise UsageError(f"{opt}: {e}") from None
        for m in [got.method] if got.method else methods:
            key = (m,) + got.key[1:]  # compared as parsed (formats.policy)
            if key in seen:
                raise _twice(opt, pol, seen[key])
            seen[key] = pol


def _check_tiers(opt, path, layout):
    """Refuses a tier's columns beyond the file's units (UsageError naming
    opt and the policy)."""
    sizes = file_sizes(path, ())
    try:
        check_width(layout, sizes["head_dim"] * sizes["head_groups"])
    except UsageError as e:
        raise UsageError(f"{opt}: {e}") from None


def _peer_configs(a, backends, presses):
    configs = []
    for b in _once("--plain", _list(a.plain), lambda b: whole(b) if whole(b) is not None else b):
        if whole(b) not in BITS:
            raise UsageError(f"--plain {a.plain}: '{b}' is not one of {BITS}")
        configs.append(PlainQuant(whole(b), QuantScheme(a.group, a.key_axis, a.value_axis,
                                                        a.residual)))
    configs += _quantized_caches("--quantized-cache", a.quantized_cache, backends, a.group)
    kept = _fractions("--press-kept", a.press_kept)
    names = _once("--presses", _list(a.presses))
    if names and not kept and not _list(a.press_quantized):
        raise UsageError(f"--press-kept {a.press_kept}: give the fractions of the context "
                         f"--presses {a.presses} keep")
    for name in names:
        if name not in presses:
            raise UsageError(f"--presses: unknown press '{name}' (expected {', '.join(presses)})")
        configs += [PressPeer(name, f, a.context) for f in kept]
    return configs + _composites(a, names, backends)


def _quantized_caches(opt, text, backends, group):
    """The QuantizedCache peers a list of backend:bits names."""
    out = []
    for item in _once(opt, _list(text)):
        backend, _, bits = item.partition(":")
        if backend not in backends or bits not in ("2", "4"):
            raise UsageError(f"{opt} {item}: expected backend:bits, backend among "
                             f"{', '.join(backends)}, bits 2 or 4")
        out.append(QuantizedCachePeer(backend, int(bits), group))
    return out


def _fractions(opt, text):
    """The fractions in (0, 1) a list option gives, each once."""
    got = []
    for k in _list(text):
        f = number(k)
        if f is None or not 0 < f < 1:  # NaN fails too
            raise UsageError(f"{opt} {text}: '{k}' is not a fraction in (0, 1)")
        if f in got:
            raise _twice(opt, k, _list(text)[got.index(f)])
        got.append(f)
    return got


def _composites(a, names, backends):
    """Each press of --presses over each --press-quantized cache, at each
    fraction of the bf16 bytes of --press-bytes.  A budget the cache alone
    reaches keeping every token is no composite: said on stderr, skipped."""
    caches = _quantized_caches("--press-quantized", a.press_quantized, backends, a.group)
    budgets = _fractions("--press-bytes", a.press_bytes)
    if caches and not (names and budgets):
        raise UsageError(f"--press-quantized {a.press_quantized}: give the presses (--presses) "
                         "and the fractions of the bytes they hold (--press-bytes)")
    out = []
    for q in caches:
        for f in budgets:
            if f >= q.fraction:
                print(f"{PROG}: note: --press-bytes {f:g} over {q.label}: the cache holds "
                      f"{q.fraction:.4g} of the bytes with every token; skipped",
                      file=sys.stderr)
                continue
            out += [PressOverQuantized(name, q, f, a.context) for name in names]
    return out


def _latent_configs(a, L):
    out = []
    for path, policies in a.proj:
        # several files: each configuration names its file's stem
        tag = f" [{os.path.splitext(os.path.basename(path))[0]}]" if len(a.proj) > 1 else ""
        for text in policies:
            pol = parse_policy(text, methods=True)
            plain = text.partition("/")[2] if pol.method else text  # its label: no METHOD/
            for _, m, p in resolve_policies(path, [plain], [pol.method] if pol.method else
                                            a.methods, L, a.scheme):
                if p.quant is not None and a.stored_residual is not None:  # KIVI's window
                    p = dataclasses.replace(p, quant=dataclasses.replace(
                        p.quant, residual=a.stored_residual))
                out.append(Latent(plain, m, p, tag))
    return out


def table(report):
    f = report["full"]
    print(f"{report['model']}: {report['num_seqs']} windows, {report['context']} tokens of "
          f"context, {report['continuation']} scored; full model: perplexity "
          f"{f['perplexity']:.3f}")
    w = max(len(r["label"]) for r in report["results"]) + 2
    # bench/decode_speed.py --annotate adds each configuration's decode rate
    # against the full cache's, measured in one run
    speed = "decode_full" in report
    print(f"{'configuration':<{w}}{'kept':>8}{'perplexity':>12}{'ratio':>8}{'95% interval':>16}"
          f"{'KL/token':>11}{'top-1':>8}{'  decode' if speed else ''}  front (perplexity, KL)")
    for r in sorted(report["results"], key=lambda r: -r["kept"]):
        # a report from before the intervals: the windows' range
        each = r.get("ratio_interval") or r.get("ratio_windows") or \
            [r["perplexity"] / f["perplexity"]]
        rate = f"{_decode_ratio(r):>7.2f}x" if speed and "decode" in r else \
            f"{'-':>8}" if speed else ""
        print(f"{r['label']:<{w}}{100 * r['kept']:>7.1f}%{r['perplexity']:>12.3f}"
              f"{r['perplexity'] / f['perplexity']:>7.3f}x"
              f"{f'{min(each):.3f}-{max(each):.3f}':>16}{r['kl']:>11.4f}"
              f"{100 * r['top1']:>7.1f}%{rate}  {'*' if r['front'] else ' '} "
              f"{'*' if r['front_kl'] else ''}")
    rows = [r for r in report["results"] if r.get("against_peer")]
    if rows:
        print("against the best peer at the same bytes (within "
              f"{100 * intervals.SAME_BYTES:.0f}%), paired 95% interval:")
    for r in sorted(rows, key=lambda r: -r["kept"]):
        p = r["against_peer"]
        print(f"  {r['label']:<{w}}{p['ratio']:.3f}x ({p['low']:.3f}-{p['high']:.3f}) of "
              f"{p['label']}'s perplexity")
    if speed:
        d = report["decode_full"][0]
        print(f"decode: tokens/s against the full cache's {d['decode_tok_s']:.2f} (SDPA, "
              f"generate()'s cache) at {d['context']} tokens, batch {d['batch']}")


def _against_peers(results, full):
    """Each of kqsvd's results gets against_peer: the best peer at the same
    bytes (intervals.best_peer), its ratio to that peer's perplexity and
    the paired interval, or None where no peer holds the same bytes."""
    peers = [r for r in results if not _ours(r)]
    for r in results:
        if not _ours(r):
            continue
        p = intervals.best_peer(r, peers)
        r["against_peer"] = None if p is None else dict(zip(
            ("label", "ratio", "low", "high"),
            (p["label"],) + intervals.paired_ratio(r["unit_nll"], p["unit_nll"],
                                                   full["unit_tokens"])))


def _decode_ratio(result):
    """A result's decode rate against the full cache's, at the first
    context measured."""
    return result["decode"][0]["against_full"]


def _ours(result):
    """Whether a result is one of kqsvd's configurations (its family names
    a method), not a peer's."""
    return result["family"].split()[0] in METHODS


def plot(report):
    """The figure's writer (for files.write_all): perplexity over the full
    model's and KL against the bytes kept, kqsvd's own front one
    highlighted, labelled line, its other configurations faint, and each
    peer family a muted line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.6))
    full = report["full"]["perplexity"]
    res = report["results"]
    ys = (lambda r: r["perplexity"] / full, lambda r: max(r["kl"], 1e-6))
    peers = sorted({r["family"] for r in res if not _ours(r)})
    muted = plt.get_cmap("tab10" if len(peers) <= 10 else "tab20")
    for i, fam in enumerate(peers):
        pts = sorted((r for r in res if r["family"] == fam), key=lambda r: r["kept"])
        for ax, y in zip(axes, ys):
            ax.plot([100 * r["kept"] for r in pts], [y(r) for r in pts],
                    "o-" if len(pts) > 1 else "D", color=muted(i % muted.N), alpha=0.45, lw=1,
                    ms=3, label=fam if ax is axes[0] else None)
    ours = [r for r in res if _ours(r)]
    for ax, y in zip(axes, ys):
        front = [ours[i] for i in pareto([(r["kept"], y(r)) for r in ours])]
        rest = [r for r in ours if r not in front]
        ax.plot([100 * r["kept"] for r in rest], [y(r) for r in rest], "s", color="C3",
                alpha=0.35, ms=4, label="kqsvd, off its front" if rest and ax is axes[0] else None)
        ax.plot([100 * r["kept"] for r in front], [y(r) for r in front], "s-", color="C3", lw=2.4,
                ms=6, label="kqsvd (its front)" if front and ax is axes[0] else None, zorder=5)
        for r in front:
            ax.annotate(r["label"].split(" ", 1)[-1][:28], (100 * r["kept"], y(r)), fontsize=6,
                        xytext=(5, -9), textcoords="offset points", color="C3")
        for r in res:  # decode rates, where measured, beside the points
            if "decode" in r:
                ax.annotate(f"{_decode_ratio(r):.2f}x", (100 * r["kept"], y(r)), fontsize=6,
                            xytext=(4, 4), textcoords="offset points", color="0.3")
    axes[0].axhline(1.0, color="gray", ls="--", lw=1, label="full model")
    for ax in axes:
        ax.set_yscale("log")
    times = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:.3g}x")
    axes[0].yaxis.set_major_formatter(times)
    axes[0].yaxis.set_minor_formatter(times)
    axes[0].tick_params(axis="y", which="minor", labelsize=7)
    axes[0].legend(fontsize=6, ncol=2)
    return figure_writer(fig, axes, ("perplexity / the full model's",
                                     "KL(full || configuration) per token"),
                         "KV cache bytes kept (% of bf16)",
                         f"{report['model']}: {report['num_seqs']} windows, {report['context']} "
                         f"+ {report['continuation']} tokens; full model {full:.3f}"
                         f"{'; Nx: decode rate against the full cache' if 'decode_full' in report else ''}")


def run(a):
    import torch
    t0 = time.time()
    # said once every check has passed: a refusal stays one line
    shorts = [window_warning(path, a.context + a.continuation) for path, _ in a.proj]
    models.check_device(a.device, flags=True)
    model, tok, info = models.load(a.model, dtype=getattr(torch, a.dtype), device=a.device)
    if not info.causal:
        raise KqsvdError(f"{a.model}: the frontier needs a causal decoder, not '{info.model_type}'")
    for (path, _), sizes in zip(a.proj, a.sizes):
        check_sizes(sizes, path, info.sizes(), a.model)
    T = a.context + a.continuation
    models.check_positions(info, model.config, T, label="--context + --continuation")
    configs = _latent_configs(a, info.num_layers) + a.configs
    seqs, ntok, start, bos = models.token_windows(tok, a.text, T, a.num_seqs, a.split,
                                                  bos=not a.no_bos, flags=True)
    for short in filter(None, shorts):
        print(f"{PROG}: warning: {short}", file=sys.stderr, flush=True)
    bar = Progress("frontier", a.num_seqs * (1 + len(configs)), "windows")
    full, results = score(model, seqs, a.context, configs, a.chunk, bar.advance)
    front = set(pareto([(r["kept"], r["perplexity"]) for r in results]))
    front_kl = set(pareto([(r["kept"], r["kl"]) for r in results]))
    report = {"kqsvd_format": "frontier", "kqsvd_format_version": 1, "model": a.model,
              "proj": [f for f, _ in a.proj], "text": os.path.basename(a.text), "split": a.split,
              "context": a.context, "continuation": a.continuation, "num_seqs": a.num_seqs,
              "chunk": a.chunk, "bos": bos, "token_range": [start, start + seqs.size - bos *
                                                            a.num_seqs],
              "dtype": a.dtype, "scheme": vars(a.scheme), "full": full, "results": []}
    for i, (c, r) in enumerate(zip(configs, results)):
        report["results"].append(dict(label=c.label, family=c.family, front=i in front,
                                      front_kl=i in front_kl, **r))
    _against_peers(report["results"], full)
    report["elapsed_s"] = time.time() - t0
    write_report(report, a.json, a.plot, plot, table, force=a.force)
    return report


def main(argv=None):
    return run_command(PROG, lambda: run(parse(argv)))
