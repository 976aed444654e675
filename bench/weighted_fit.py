#!/usr/bin/env python3
"""A study toward issue 17's target (perplexity within 1.25x of the full
model at half the cache): does weighting each cached token by the
attention it receives give better KQ-SVD projections than the paper's
unweighted fit, under uniform and under fitted (quality-budget) ranks?

    .venv/bin/python bench/weighted_fit.py --work data/rank-allocation-pre-rope

--work: a folder of bench/rank_allocation.sh (its train/ shards and
proj.h5, SmolLM2 with --keys pre-rope or post-rope).  The weight of key
and value row n of a KV head is w_n = sum over the group's query heads h
and positions m of a_hmn^2 (the attention probabilities of the full model
on the same windows), the first-order weight of a row's error in the
attention output: an error e_n in value n moves output m by a_mn e_n, and
an error in score s_mn moves it by a_mn (v_n - o_m).  Keys and values are
refitted with rows scaled by sqrt(w_n) (queries and W^O as they are): the
closed form of the paper with R_K, R_V of the weighted rows.  The refit
without weights must reproduce proj.h5 (checked, 1e-9).

--tune N then trains the weighted fit's up-projections (B of the keys
and B_v of the values) for N Adam steps on the KL to the full model over
the calibration windows, with A and A_v fixed, as the tool's
quality-tuned:F does (kqsvd.quality.tune, the step kept chosen on the 4 windows
after the calibration ones): the cache holds the same columns, only how
they are read back changes.

Not part of the tool: the shards' contract has no row weights, so this
refits in numpy from the shards.  Prints one table; writes
WORK/unweighted.h5 (the check's refit), WORK/weighted.h5 (the weighted
projections) and WORK/weighted.json, replacing them (a link among them
replaced itself, never its target written): each under a temporary name,
all three renamed at the end, so that a run that fails leaves none."""
import argparse
import glob
import os
import shutil
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from kqsvd.errors import KqsvdError, UsageError  # noqa: E402
from kqsvd.formats import h5io  # noqa: E402
from kqsvd.formats.files import Staged, cannot_write, check_outputs, json_writer, write_all  # noqa: E402

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
OUTPUTS = ("unweighted.h5", "weighted.h5", "weighted.json")
TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "data",
                    "us-founding-documents.txt")


def attention_weights(model, seqs, L, H, g):
    """w [L, H, rows]: sum over the group's heads and query positions of
    the squared attention probabilities each key row receives."""
    import torch
    T = seqs.shape[1]
    w = np.zeros((L, H, seqs.size))
    with torch.no_grad():  # output_attentions: the SDPA attention falls back to eager
        for i in range(0, len(seqs), 4):
            out = model(input_ids=torch.from_numpy(seqs[i:i + 4]), output_attentions=True,
                        use_cache=False)
            for l, a in enumerate(out.attentions):  # [b, Hq, T, T]
                a2 = (a.double().numpy() ** 2).reshape(a.shape[0], H, g, T, T).sum((2, 3))
                w[l, :, i * T:(i + a.shape[0]) * T] = a2.transpose(1, 0, 2).reshape(H, -1)
    return w


def work_files(work):
    """The shards of --work, once its inputs have opened as the kqsvd files
    they must be (h5io.open_file: a FIFO is refused, not waited on) and
    its outputs are names a file may be written at (not a folder, device,
    FIFO or an input), before the model loads.  KqsvdError or UsageError,
    naming the file."""
    inputs = [("the projections", os.path.join(work, "proj.h5"), "projections"),
              ("the model file", os.path.join(work, "train", "model.h5"), "model")]
    shards = sorted(glob.glob(os.path.join(work, "train", "shard-*.h5")))
    if not shards:
        raise KqsvdError(f"--work {work}: no train/shard-*.h5 (a folder of "
                         "bench/rank_allocation.sh)")
    inputs += [("a shard", s, "cache") for s in shards]
    for _, path, kind in inputs:
        h5io.open_file(path, kind).close()
    check_outputs([("--work's", os.path.join(work, n)) for n in OUTPUTS],
                  [(label, path) for label, path, _ in inputs], force=True)
    return shards


def grams(shards, weights, L, H, g):
    """Gram matrices of the weighted key and value rows and of the
    group's stacked queries, [L, H, d, d] each, over the shards in order."""
    CK = CQ = CV = None
    off = 0
    for path in shards:
        with h5io.open_file(path, "cache") as f:
            n = int(f["seq_lens"][...].sum())
            for l in range(L):
                k, q, v = (h5io.decode(f[x][l], h5io.is_bf16(f[x])).astype(np.float64)
                           for x in ("keys", "queries", "values"))
                if CK is None:
                    d = k.shape[-1]
                    CK, CQ, CV = (np.zeros((L, H, d, d)) for _ in range(3))
                for h in range(H):
                    w = weights[l, h, off:off + n] if weights is not None else np.ones(n)
                    CK[l, h] += (k[h] * w[:, None]).T @ k[h]
                    CV[l, h] += (v[h] * w[:, None]).T @ v[h]
                    CQ[l, h] += sum(q[j].T @ q[j] for j in range(h * g, (h + 1) * g))
        off += n
    return CK, CQ, CV


def root(C):
    """A square root R of a Gram matrix (R^T R = C), like an R factor."""
    e, V = np.linalg.eigh(C)
    return (V * np.sqrt(np.maximum(e, 0.0))) @ V.T


def optimal_pair(CX, CY):
    """The paper's closed form from Grams: core R_X R_Y^T = U S V^T,
    A = R_X^+ U, B = R_X^T U."""
    RX = root(CX)
    U, s, _ = np.linalg.svd(RX @ root(CY).T)
    return np.linalg.pinv(RX, rcond=1e-12) @ U, RX.T @ U, s


def refit(work, shards, weights, out, staged, L, H, g):
    """WORK/proj.h5 with the kqsvd group refitted (weights None: unweighted),
    written at staged.tmp(out), out's temporary name (the copy and h5py
    write a file of the run's own, never what out is or links to).
    Returns the largest relative difference of the rank-16 maps from
    proj.h5's (the unweighted refit's check).  KqsvdError naming out when
    it cannot be written."""
    CK, CQ, CV = grams(shards, weights, L, H, g)
    with h5io.open_file(os.path.join(work, "train", "model.h5"), "model") as f:
        O = h5io.decode(f["o_proj"][...], h5io.is_bf16(f["o_proj"])).astype(np.float64)
    tmp = staged.tmp(out)
    try:
        shutil.copyfile(os.path.join(work, "proj.h5"), tmp)
        return refit_into(tmp, O, CK, CQ, CV, L, H, g)
    except OSError as e:
        raise cannot_write(out, e, tmp) from None


def refit_into(path, O, CK, CQ, CV, L, H, g):
    """refit's new kqsvd maps from the Grams, written into the copy at path."""
    import h5py
    d = CK.shape[-1]
    worst = 0.0
    with h5py.File(path, "r+") as f:
        for l in range(L):
            for h in range(H):
                blocks = O[l][:, h * g * d:(h + 1) * g * d]  # the group's W^O blocks side by side
                CW = sum(blocks[:, j * d:(j + 1) * d].T @ blocks[:, j * d:(j + 1) * d]
                         for j in range(g))
                new = optimal_pair(CK[l, h], CQ[l, h]) + optimal_pair(CV[l, h], CW)
                for (x, y), (i, j) in ((("key_down", "query_down"), (0, 1)),
                                       (("value_down", "value_up"), (3, 4))):
                    old = f[f"kqsvd/{x}"][l, h, :, :16] @ f[f"kqsvd/{y}"][l, h, :, :16].T
                    got = new[i][:, :16] @ new[j][:, :16].T
                    worst = max(worst, np.linalg.norm(got - old) / np.linalg.norm(old))
                    f[f"kqsvd/{x}"][l, h], f[f"kqsvd/{y}"][l, h] = new[i], new[j]
                f["kqsvd/sigma_k"][l, h], f["kqsvd/sigma_v"][l, h] = new[2], new[5]
    return worst


def held_out(model, proj, ranks, seqs, ref):
    """Perplexity, KL to the full model and top-1 agreement on seqs."""
    from kqsvd.attention import compress
    from kqsvd.formats.projections import load_projections
    compress(model, load_projections(proj, "kqsvd", ranks))
    got = score(model, seqs, ref)
    compress(model, None)
    return got


def score(model, seqs, ref):
    """held_out's measures of the model as it is now (the quality command's
    sums), ref: full_logprobs of seqs."""
    import torch
    from kqsvd.quality.kl import logprobs
    from kqsvd.quality.tally import Tally
    t = Tally()
    with torch.no_grad():
        for i in range(0, len(seqs), 4):
            ids = torch.from_numpy(seqs[i:i + 4])
            lp, r = logprobs(model, ids), ref[i // 4]
            t.add(lp.reshape(-1, lp.shape[-1]), ids[:, 1:].reshape(-1), r.reshape(-1, r.shape[-1]))
    return {k: t.result()[k] for k in ("perplexity", "kl", "top1")}


def tune_up(model, proj, ranks, cal, check, steps, lr, ev, ref):
    """The tool's quality-tuned:F on the weighted fit (kqsvd.quality.tune): B and
    B_v trained on the calibration KL, A and A_v fixed, the step kept
    chosen on the check windows; returns score() on ev after."""
    from kqsvd.attention import compress
    from kqsvd.formats.projections import load_projections
    from kqsvd.quality.tune import tune
    tuned, info = tune(model, load_projections(proj, "kqsvd", ranks), cal, check, steps, lr,
                       log=lambda s: print(f"weighted_fit: tuning {s}", file=sys.stderr, flush=True))
    print(f"weighted_fit: kept step {info['step']} of {steps}", file=sys.stderr)
    compress(model, tuned)
    try:
        return score(model, ev, ref)
    finally:
        compress(model, None)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", required=True, help="a folder of bench/rank_allocation.sh")
    ap.add_argument("--calib-seqs", type=int, default=16, help="quality-budget windows [16]")
    ap.add_argument("--rounds", type=int, default=6, help="refinement rounds [6]")
    ap.add_argument("--tune", type=int, default=0,
                    help="Adam steps training the weighted fit's up-projections B, B_v on the "
                         "calibration KL, the cache's A, A_v fixed [0: none]")
    ap.add_argument("--lr", type=float, default=3e-3, help="--tune's learning rate [3e-3]")
    a = ap.parse_args()
    if not 1 <= a.calib_seqs <= 24 - 4 * (a.tune > 0):
        ap.error("--calib-seqs: 1 to 24 of the demo's windows, and 4 left to check --tune")
    try:  # an output refused at the start, 2 as the commands; an input, or a write later, 1
        shards = work_files(a.work)
        with Staged() as staged:  # left without write_all: the written outputs go
            study(a, shards, staged)
    except (UsageError, KqsvdError) as e:
        print(f"weighted_fit.py: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, UsageError) else 1
    return 0


def study(a, shards, staged):
    """The study of --work's shards, main's options `a`: the refits staged
    (read back from their temporary names), the table printed, and the
    three outputs renamed together with weighted.json."""
    import torch
    from kqsvd import models
    from kqsvd.quality.allocate import allocate
    from kqsvd.quality.kl import full_logprobs
    t0 = time.time()
    model, tok, info = models.load(MODEL, dtype=torch.float32)
    L, H = info.num_layers, info.num_kv_heads
    g = info.num_heads // H
    train = models.token_windows(tok, TEXT, 256, 24, "train", bos=True)[0]
    check = refit(a.work, shards, None, os.path.join(a.work, "unweighted.h5"), staged, L, H, g)
    if check > 1e-9:
        sys.exit(f"weighted_fit.py: the unweighted refit differs from proj.h5 by {check:.2e}: "
                 "not the demo's 24 windows?")
    w = attention_weights(model, train, L, H, g)
    print(f"weights: the first token of a window weighs {np.median(w[..., ::256] / w.mean(-1, keepdims=True)):.0f}"
          f" times the mean (median over layers and heads)", file=sys.stderr)
    refit(a.work, shards, w, os.path.join(a.work, "weighted.h5"), staged, L, H, g)
    weighted = staged.tmp(os.path.join(a.work, "weighted.h5"))
    ev = models.token_windows(tok, TEXT, 256, 8, "validation", bos=True)[0]
    ref = full_logprobs(model, ev)
    cal = train[:a.calib_seqs]
    rows = []
    for name, proj in (("unweighted", os.path.join(a.work, "proj.h5")), ("attention-weighted", weighted)):
        rows.append((name, "fixed:32", held_out(model, proj, 32, ev, ref)))
        got = allocate(model, info, proj, 0.5, cal, ["kqsvd"], rounds=a.rounds,
                       log=lambda s: print(f"weighted_fit: {s}", file=sys.stderr))["kqsvd"]
        ranks = (got["rank_k"], got["rank_v"])
        rows.append((name, "quality-budget:0.5", held_out(model, proj, ranks, ev, ref)))
    if a.tune:
        rows.append((name, f"quality-budget:0.5, B and B_v tuned ({a.tune} steps)",
                     tune_up(model, weighted, ranks, cal, train[a.calib_seqs:a.calib_seqs + 4],
                             a.tune, a.lr, ev, ref)))
    print(f"kqsvd at half the cache, {MODEL}; held-out 8 x 256 tokens; quality-budget fitted on "
          f"{a.calib_seqs} windows, {a.rounds} rounds; unweighted refit check {check:.1e}")
    print("| fit | ranks | perplexity | KL / token | top-1 |\n| --- | --- | ---: | ---: | ---: |")
    for name, pol, r in rows:
        print(f"| {name} | {pol} | {r['perplexity']:.2f} | {r['kl']:.3f} | {100 * r['top1']:.1f}% |")
    write_all([(os.path.join(a.work, "weighted.json"),
                json_writer([dict(fit=n, ranks=p, **r) for n, p, r in rows]))], staged, force=True)
    print(f"weighted_fit.py: done in {time.time() - t0:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
