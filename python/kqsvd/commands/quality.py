"""What a rank costs the model: perplexity, KL and top-1 agreement of the
compressed model against the full one, per rank policy and method.

    python -m kqsvd.quality --model M --text FILE --proj PROJ.h5 --ranks POLICY[,POLICY...]
        [--split validation] [--seq-len 256] [--num-seqs 8] [--methods kqsvd,ksvd,eigen]
        [--dtype float32|float64] [--device cpu] [--fold] [--score-errors]
        [--calib-seqs 4] [--rounds 6] [--tune-steps 30] [--check-seqs 4] [--lr 3e-3]
        --json OUT [--plot PNG] [--force]

The policies are `kqsvd calibrate`'s (eps:E, fixed:R, budget:F), resolved by
`kqsvd ranks` from the file's spectra, so the ranks are exactly the C tool's,
and the model's own: quality-budget:F (ranks fitted on --calib-seqs windows
of the train split, kqsvd.allocate) and quality-tuned:F (those ranks with
the up-projections trained on the same windows, the step kept chosen on
--check-seqs more, kqsvd.quality.tune) and quality-bits:F (the rank and the
bits of each unit's quantized latent at F of the bf16 cache's bytes,
kqsvd.quality.bits) and quality-tiers:F (a tiered cache's layout holding F
of the bytes after a prefill, fitted at --seq-len, kqsvd.quality.tiers);
each is written with the report, as STEM.quality-budget-F.h5,
STEM.quality-tuned-F.h5, STEM.quality-bits-F.h5 or STEM.quality-tiers-F.h5
for a report STEM.json.  Tiered caches (tiers:LAYOUT, quality-tiers:F)
attend exactly at a prefill, so they are scored on each window's last
min(256, T/8) tokens after a prefill of the rest, in chunks of 8.  The full model runs once per sequence; every
(policy, method) pair then runs on the same tokens.  Usage errors exit 2,
bad input 1, each with one line naming the file and field; every policy
and window is checked before the first fit.  Outputs (the fitted files
too) are written under a temporary name and renamed together at the end,
so an error or an interruption leaves none.
"""
import argparse
import os
import sys
import time

from .. import models, native
from ..errors import KqsvdError, UsageError
from ..formats.files import Staged, check_input_file, check_outputs, said_of
from ..formats.policy import (QUALITY_BITS, QUALITY_BUDGET, QUALITY_TIERS, QUALITY_TUNED,
                              fitted_fraction)
from ..formats.policy import parse as parse_policy
from ..formats.projections import (METHODS, check_sizes, file_sizes, load_projections,
                                   window_warning)
from ..formats.quant import QuantScheme
from ..formats.saving import save_ranks
from ..quality.allocate import allocate
from ..quality.bits import allocate_bits
from ..quality.measure import check_fitted, measure, resolve_policies
from ..quality.tune import tuned_file
from .cli import (ArgumentParser, check_plot, count, figure_writer, positive, run_command,
                  write_report)

PROG = "python -m kqsvd.quality"


def parse(argv):
    ap = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                        formatter_class=argparse.RawDescriptionHelpFormatter,
                        epilog="The JSON report is described in docs/formats.md, section 8.")
    ap.add_argument("--model", required=True, help="model folder, GGUF file or id (offline)")
    ap.add_argument("--text", required=True, help="UTF-8 text to cut the sequences from")
    ap.add_argument("--proj", required=True, help="projections file (kqsvd calibrate --out)")
    ap.add_argument("--ranks", required=True, help="rank policies, comma-separated: eps:E, "
                    "fixed:R, budget:F, quality-budget:F, quality-tuned:F, quality-bits:F "
                    "(ranks and bits of a quantized latent), or 'stored'; after any but the "
                    "quality ones, @B quantizes the latent at B bits (fixed:32@4, stored@4/8)")
    ap.add_argument("--calib-seqs", type=count(0), default=4,
                    help="quality-budget: windows of the train split its ranks are fitted on [4]")
    ap.add_argument("--rounds", type=count(0), default=6,
                    help="quality-budget: refinement rounds (kqsvd.allocate) [6]")
    ap.add_argument("--tune-steps", type=count(0), default=30,
                    help="quality-tuned: Adam steps training the up-projections [30]")
    ap.add_argument("--check-seqs", type=count(0), default=4,
                    help="quality-tuned: train-split windows after the calibration ones that "
                    "choose the step kept [4]")
    ap.add_argument("--lr", type=positive, default=3e-3, help="quality-tuned: learning rate [3e-3]")
    ap.add_argument("--split", choices=("train", "validation"), default="validation",
                    help="windows from the text's start (train) or end (validation) [validation]")
    ap.add_argument("--seq-len", type=count(2), default=256, help="tokens per sequence [256]")
    ap.add_argument("--num-seqs", type=count(1), default=8, help="sequences [8]")
    ap.add_argument("--methods", default=",".join(METHODS), help="[kqsvd,ksvd,eigen]")
    ap.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N [cpu]")
    ap.add_argument("--no-bos", action="store_true",
                    help="windows without the BOS token the tokenizer adds in normal use")
    ap.add_argument("--fold", action="store_true",
                    help="fold B_v into o_proj (not with a tiered cache)")
    ap.add_argument("--score-errors", action="store_true",
                    help="also measure err_kq and err_out in the model (kqsvd evaluate's "
                    "definitions, on the full model's activations): one more pass per pair "
                    "(not with a tiered cache)")
    ap.add_argument("--json", required=True, help="the report")
    ap.add_argument("--plot", help="PNG: KL and perplexity against the cache kept")
    ap.add_argument("--force", action="store_true",
                    help="replace outputs that exist (the report, the plot, fitted files)")
    a = ap.parse_args(argv)
    a.policies = [p.strip() for p in a.ranks.split(",") if p.strip()]
    a.methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    if not a.policies:
        raise UsageError("--ranks: give at least one policy")
    twice = sorted({x for x in a.methods if a.methods.count(x) > 1})
    if twice:
        raise UsageError(f"--methods {','.join(a.methods)}: '{twice[0]}' is given twice")
    bad = [m for m in a.methods if m not in METHODS]
    if bad or not a.methods:
        raise UsageError(f"--methods: unknown method '{bad[0] if bad else ''}' (expected "
                         f"{', '.join(METHODS)})")
    check_plot(a.plot)
    a.fitted = _read_policies(a)
    # Windows are needed only by the policies that use them.
    tuned = [p for p in a.fitted if p.startswith(QUALITY_TUNED)]
    for opt, n, uses in (("--calib-seqs", a.calib_seqs, list(a.fitted)),
                         ("--check-seqs", a.check_seqs, tuned)):
        if n < 1 and uses:
            raise UsageError(f"{opt} {n}: --ranks {uses[0]} needs 1 or more")
    if any(p not in a.fitted for p in a.policies):
        native.tool()  # `kqsvd ranks` resolves them: a missing library is found before the load
    check_input_file("--text", a.text)
    check_outputs([("--json", a.json), ("--plot", a.plot)] +
                  [(f"the {pol} file", path) for pol, path in a.fitted.items()],
                  [("--proj", a.proj), ("--text", a.text), ("--model", models.resolve(a.model))], a.force)
    return a


def _read_policies(a):
    """Each of --ranks' policies parsed and checked against the other
    options; returns {fitted policy: the file it is fitted into}."""
    fitted, seen = {}, {}
    for pol in a.policies:
        try:
            got = parse_policy(pol)
        except UsageError as e:
            raise UsageError(f"--ranks: {e}") from None
        if got.key in seen:  # compared as parsed: fixed:4@4 and fixed:04@4/4 are one
            first = seen[got.key]
            raise UsageError(f"--ranks {','.join(a.policies)}: '{pol}' is given twice" +
                             ("" if first == pol else f" (as '{first}')"))
        seen[got.key] = pol
        if got.tiers is not None or got.fitted == QUALITY_TIERS:
            _refuse_tiered(a, pol)
        if got.fitted and got.bits:  # its ranks (or bits) are fitted for its own cache
            raise UsageError(f"--ranks {pol}: no '@bits' after a policy fitted to the model; "
                             f"give its file's ranks new bits with --proj FITTED --ranks stored@B")
        if got.fitted:
            fitted[pol] = f"{_stem(a.json)}.{pol.split(':')[0]}-{got.fraction:g}.h5"
    return fitted


def _refuse_tiered(a, pol):
    """Refuses --score-errors and --fold for pol, a tiered cache's policy:
    the cache has no probe mode and keeps B_v out of o_proj (docs/formats.md
    5.4.1), and its pairs would be skipped or refused after the fits."""
    for flag, given, why in (("--score-errors", a.score_errors, "has no probe mode"),
                             ("--fold", a.fold, "folds nothing into o_proj")):
        if given:
            raise UsageError(f"{flag}: --ranks {pol} is a tiered cache, which {why} "
                             "(docs/formats.md 5.4.1)")


def _stem(json_path):
    return json_path[:-5] if json_path.endswith(".json") else json_path


def plot(report):
    """The figure's writer: write(path) saves the PNG (for files.write_all)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    marks = {"fixed": "o-", "budget": "s--", "eps": "^:", "stored": "d:"}
    colors = dict(zip(METHODS, ("C0", "C1", "C2")))
    # One line per method and kind of policy (a fixed-rank sweep, a budget
    # sweep), so points of different rules are not joined.
    for m in METHODS:
        for kind, style in marks.items():
            pts = sorted((r["cache_kept"], r["kl"], r["perplexity"]) for r in report["results"]
                         if r["method"] == m and r["policy"].split(":")[0] == kind)
            if not pts:
                continue
            x = [100 * p[0] for p in pts]
            for ax, y in zip(axes, ([max(p[1], 1e-12) for p in pts], [p[2] for p in pts])):
                ax.plot(x, y, style, color=colors[m], label=f"{m} ({kind})")
    axes[1].axhline(report["full"]["perplexity"], color="gray", ls="--", label="full model")
    axes[0].set_yscale("log")
    for ax in axes:
        ax.legend(fontsize=7)
    return figure_writer(fig, axes, ("mean KL(full || compressed) per token", "perplexity"),
                         "KV cache kept (%)", f"{report['model']}: {report['num_seqs']} x "
                         f"{report['seq_len']} tokens ({report['split']})")

def table(report):
    f = report["full"]
    print(f"{report['model']}: {report['num_seqs']} x {report['seq_len']} tokens "
          f"({report['split']} split), full model: perplexity {f['perplexity']:.3f}")
    probe = any("err_kq" in r for r in report["results"])
    w = max([14] + [len(r["policy"]) + 2 for r in report["results"]])
    print(f"{'policy':<{w}}{'method':<8}{'kept':>8}{'perplexity':>12}{'KL/token':>11}"
          f"{'top-1':>8}" + (f"{'err_kq':>11}{'err_out':>11}" if probe else ""))
    for r in report["results"]:
        line = (f"{r['policy']:<{w}}{r['method']:<8}{100 * r['cache_kept']:>7.1f}%"
                f"{r['perplexity']:>12.3f}{r['kl']:>11.4f}{100 * r['top1']:>7.1f}%")
        if "err_kq" in r:
            line += f"{r['err_kq']['mean']:>11.3e}{r['err_out']['mean']:>11.3e}"
        print(line)


def run(a):
    import torch
    t0 = time.time()
    psizes = file_sizes(a.proj, a.methods)
    short = window_warning(a.proj, a.seq_len)  # said once every check has passed
    # A fraction no fit can meet is refused before the model loads.
    scheme = QuantScheme()  # quality-bits:F's cache, the scheme's defaults
    for pol in a.fitted:
        check_fitted(pol, psizes, scheme)
    dtype = getattr(torch, a.dtype)
    models.check_device(a.device, flags=True)
    model, tok, info = models.load(a.model, dtype=dtype, device=a.device)
    if not info.causal:
        raise KqsvdError(f"{a.model}: the quality command needs a causal decoder "
                         f"({', '.join(models.DECODERS)}), not '{info.model_type}'")
    check_sizes(psizes, a.proj, info.sizes(), a.model)
    models.check_positions(info, model.config, a.seq_len, flags=True)
    # Every other policy is resolved and every window cut before any fit,
    # so that a bad policy or a text too short is refused before minutes of
    # fitting (and after the file is known to be the model's).
    own = {pol: resolve_policies(a.proj, [pol], a.methods, info.num_layers, scheme)
           for pol in a.policies if pol not in a.fitted}
    for pol, pairs in own.items():  # a file's stored policy may be a tiered cache
        if any(p.tiers is not None for _, _, p in pairs):
            _refuse_tiered(a, pol)
    seqs, ntok, start, bos = models.token_windows(tok, a.text, a.seq_len, a.num_seqs, a.split,
                                                  bos=not a.no_bos, flags=True)
    if a.fitted:
        tuned = any(p.startswith(QUALITY_TUNED) for p in a.policies)
        cal = models.token_windows(tok, a.text, a.seq_len, a.calib_seqs + tuned * a.check_seqs,
                                   "train", bos=not a.no_bos, flags=True)[0]
    log = lambda s: print(f"kqsvd.quality: {s}", file=sys.stderr, flush=True)  # noqa: E731
    if short:
        log(f"warning: {short}")
    fitted = {}

    def fit(pol, out):
        return _fit(a, pol, out, model, info, cal, scheme, fitted, log)

    # Fitted files are written under temporary names, measured from there,
    # and renamed with the report: a run that fails or is interrupted after
    # a fit leaves none of them.
    with Staged() as staged:
        pairs = []
        for pol in a.policies:
            if pol in own:
                pairs += own[pol]
                continue
            tmp = staged.tmp(a.fitted[pol])
            try:
                out = fit(pol, tmp)
            except KqsvdError as e:  # the fitted file by its own name, never its temporary one
                raise said_of(e, a.fitted[pol], tmp) from None
            pairs += [(pol, m, load_projections(out, m)) for m in a.methods]
        print(f"kqsvd.quality: {a.model}, {a.num_seqs} x {a.seq_len} tokens ({a.split} split of "
              f"{ntok} tokens), {len(a.policies)} polic{'ies' if len(a.policies) > 1 else 'y'} x "
              f"{len(a.methods)} method{'s' if len(a.methods) > 1 else ''}", file=sys.stderr)
        full, results = measure(model, seqs, pairs, a.fold, a.score_errors)
        report = _report(a, pairs, full, results, seqs, start, bos, info, psizes["head_groups"])
        report["elapsed_s"] = time.time() - t0
        write_report(report, a.json, a.plot, plot, table, staged, a.force)
    return report


def _fit(a, pol, out, model, info, cal, scheme, fitted, log):
    """Fits pol on the calibration windows `cal` and writes it to `out`
    (the temporary name of a.fitted[pol]): the fitted ranks (and tuned
    up-projections, or bits) in a projections file, so that every tool
    (kqsvd evaluate, compress) uses exactly what was measured.  fitted:
    the ranks fitted so far by fraction, which quality-budget:F and
    quality-tuned:F of one F share."""
    frac = fitted_fraction(pol)
    if pol.startswith(QUALITY_TIERS):  # a tiered cache's layout, at the windows' length
        from ..quality.tiers import fit_tiers  # torch at its top
        layouts, ranks = {}, {}
        for m in a.methods:
            layouts[m] = fit_tiers(model, info, a.proj, m, frac, cal[:a.calib_seqs], scheme,
                                   log)[0]
            p = load_projections(a.proj, m)
            ranks[m] = (p.rank_k_heads, p.rank_v_heads)
        return save_ranks(a.proj, out, ranks, f"{QUALITY_TIERS}{frac:g}", force=True,
                          scheme=scheme, tiers=layouts)
    if pol.startswith(QUALITY_BITS):  # ranks and bits of a quantized latent, chosen together
        got = allocate_bits(model, info, a.proj, frac, cal[:a.calib_seqs], a.methods, scheme,
                            log=log)
        return save_ranks(a.proj, out, {m: (g["rank_k"], g["rank_v"]) for m, g in
                                         got.items()}, f"{QUALITY_BITS}{frac:g}", force=True,
                          bits={m: (g["bits_k"], g["bits_v"]) for m, g in got.items()},
                          scheme=scheme)
    if frac not in fitted:
        got = allocate(model, info, a.proj, frac, cal[:a.calib_seqs], a.methods,
                       rounds=a.rounds, log=log)
        fitted[frac] = {m: (g["rank_k"], g["rank_v"]) for m, g in got.items()}
    if pol.startswith(QUALITY_BUDGET):
        return save_ranks(a.proj, out, fitted[frac], f"{QUALITY_BUDGET}{frac:g}", force=True)
    return tuned_file(model, a.proj, fitted[frac], cal[:a.calib_seqs], cal[a.calib_seqs:],
                      out, frac, a.tune_steps, a.lr, log, force=True)


def _report(a, pairs, full, results, seqs, start, bos, info, head_groups):
    """The JSON report (docs/formats.md, section 8) of the measured pairs."""
    report = {"kqsvd_format": "quality", "kqsvd_format_version": 1, "model": a.model,
              "proj": a.proj, "text": os.path.basename(a.text), "split": a.split,
              "seq_len": a.seq_len, "num_seqs": a.num_seqs, "bos": bos,
              "token_range": [start, start + seqs.size - bos * a.num_seqs],
              "tokens_scored": int(a.num_seqs * (a.seq_len - 1)), "dtype": a.dtype,
              "fold": a.fold, "head_dim": info.head_dim, "num_layers": info.num_layers,
              "head_groups": head_groups,
              "full": full, "results": []}
    for (pol, m, p), r in zip(pairs, results):
        if pol in a.fitted:
            r["proj"] = a.fitted[pol]
        if any(p.per_head(l) for l in range(p.num_layers)):
            r.update(rank_k_heads=p.rank_k_heads.tolist(), rank_v_heads=p.rank_v_heads.tolist())
        ratio = r["cache_bytes"] / full["cache_bytes"]
        # a tiered cache keeps what its layout chose, not what its ranks say
        r.update(policy=pol, method=m, rank_k=p.rank_k.tolist(), rank_v=p.rank_v.tolist(),
                 cache_kept=ratio if p.tiers is not None else p.cache_kept(),
                 cache_bytes_ratio=ratio)
        report["results"].append({k: r[k] for k in ("policy", "method", "cache_kept") if k in r} |
                                 {k: v for k, v in r.items() if k not in ("policy", "method")})
    return report


def main(argv=None):
    return run_command(PROG, lambda: run(parse(argv)))


if __name__ == "__main__":
    sys.exit(main())
