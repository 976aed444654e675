"""The --qr backends, one ctest each: gram (SYRK + Cholesky) and scalapack
(pdgeqrf) give TSQR's results on ordinary data at any rank count, keep
working on zero and rank-deficient heads, and on an ill-conditioned head
scalapack keeps TSQR's accuracy while gram loses the small singular values
(yet its projections keep the optimal attention-score error up to a
condition number of 1e8); their option errors.  qr_scalapack exits 77 (skipped) in a build without
ScaLAPACK, which it reports."""
import os
import re

import h5py
import numpy as np

from harness import calibrate, check, finish, load_proj, max_rel_diff, run, small_set, synth, workdir
from scenarios_data import write_cache, write_model

GQA = dict(layers=2, heads=6, kv_heads=2, head_dim=16, seqs=9, seq_len=80, dtype="bf16", seed=5)


def agreement(qr, nps):
    """TSQR's projections at every rank count, per head and in head groups
    of 2 KV heads (keys and values side by side, queries block-diagonal)."""
    wd, model, shards = small_set(f"qr_{qr}", shards=3, uneven=True, **dict(GQA, kv_heads=4, heads=8))
    for G in (1, 2):
        groups = ["--head-groups", str(G)]
        base_path = os.path.join(wd, f"tsqr-g{G}.h5")
        calibrate(model, base_path, shards, np_=1, extra=groups)
        base = load_proj(base_path)
        for np_ in nps:
            out = os.path.join(wd, f"{qr}-np{np_}-g{G}.h5")
            calibrate(model, out, shards, np_=np_, extra=["--qr", qr, *groups])
            d, where = max_rel_diff(base, load_proj(out))
            print(f"--qr {qr} on {np_} ranks, head groups of {G}, vs tsqr: largest relative "
                  f"difference {d:.3g} ({where})")
            check(d <= 1e-9, f"--qr {qr} np {np_} G {G} differs from tsqr by {d:.3g} in {where}")


def wide_range(qr):
    """Keys with singular values from 1 down to 1e-12: the Gram matrix squares
    them, so everything below ~1e-8 drowns in its round-off."""
    wd = workdir(f"qr_wide_{qr}")
    rng = np.random.default_rng(11)
    L, Hq, Hkv, d, T = 1, 2, 1, 16, 3000
    s = np.logspace(0, -12, d)
    U = np.linalg.qr(rng.standard_normal((T, d)))[0]
    W = np.linalg.qr(rng.standard_normal((d, d)))[0]
    K = (U * s) @ W.T
    Q, V = rng.standard_normal((L, Hq, T, d)), rng.standard_normal((L, Hkv, T, d))
    files = []
    for i, part in enumerate((slice(0, 1700), slice(1700, T))):
        files.append(os.path.join(wd, f"shard-{i}.h5"))
        write_cache(files[-1], K[None, None, part], V[:, :, part], Q[:, :, part],
                    [part.stop - part.start], kinds=("f64",) * 3)
    model = os.path.join(wd, "model.h5")
    write_model(model, rng.standard_normal((L, 32, Hq * d)), Hq, Hkv, d)
    errs = {}
    for method in ("tsqr", qr):
        out = os.path.join(wd, f"{method}.h5")
        calibrate(model, out, files, np_=2, extra=["--qr", method])
        got = load_proj(out)["spectra/K"][0, 0]
        errs[method] = np.abs(got - s) / s
        print(f"--qr {method:9s}: relative error of sigma_j(K) at sigma = 1e-4, 1e-8, 1e-10, 1e-12: "
              + ", ".join(f"{errs[method][j]:.1e}" for j in (5, 11, 13, 15)))
    for method in ("tsqr",) if qr == "gram" else ("tsqr", qr):
        # Backward-stable QR: absolute error ~ eps * sigma_max, so sigma_j keeps
        # about 16 + log10(sigma_j) digits.
        check((errs[method] * s <= 1e-13).all(), f"{method}: absolute error above 1e-13")
        check((errs[method][s >= 1e-10] <= 1e-4).all(), f"{method}: sigma >= 1e-10 not accurate")
    if qr == "gram":
        check((errs["gram"][s >= 1e-4] <= 1e-6).all(), "gram: large singular values should be accurate")
        check(errs["gram"][s <= 1e-9].min() >= 0.5,
              "gram was expected to lose the singular values below 1e-8 (squared condition number)")


def conditioning():
    """What the Gram fold's squared condition number costs where it matters:
    keys and values of condition number 1e2 to 1e8, against an independent
    float64 reference (numpy's QR and SVD).  The attention-score error of
    KQ-SVD's projections, ||K Q^T - K A B^T Q^T||_F / ||K Q^T||_F, equals the
    optimal tail of sigma(R_K R_Q^T) for both folds (gram's excess measured
    at most 1.2e-15 at 1e8, docs/benchmarks.md); the projection matrices
    agree with Householder's on well-conditioned data (2.7e-13 at 1e2)."""
    wd = workdir("qr_conditioning")
    rng = np.random.default_rng(7)
    L, Hq, Hkv, d, T = 1, 2, 1, 16, 3000

    def spread(cond):  # T x d with singular values from 1 down to 1/cond
        U = np.linalg.qr(rng.standard_normal((T, d)))[0]
        W = np.linalg.qr(rng.standard_normal((d, d)))[0]
        return (U * np.logspace(0, -np.log10(cond), d)) @ W.T

    for cond in (1e2, 1e4, 1e6, 1e8):
        K, V = spread(cond), spread(cond)
        Q = rng.standard_normal((L, Hq, T, d)) * np.linspace(0.5, 2, d)
        files = []
        for i, part in enumerate((slice(0, 1700), slice(1700, T))):
            files.append(os.path.join(wd, f"shard-{i}.h5"))
            write_cache(files[-1], K[None, None, part], V[None, None, part], Q[:, :, part],
                        [part.stop - part.start], kinds=("f64",) * 3)
        model = os.path.join(wd, "model.h5")
        write_model(model, rng.standard_normal((L, 32, Hq * d)), Hq, Hkv, d)
        Qs = Q[0].reshape(-1, d)
        S = K @ Qs.T
        sig = np.linalg.svd(np.linalg.qr(K, mode="r") @ np.linalg.qr(Qs, mode="r").T,
                            compute_uv=False)
        norm = np.sqrt((sig ** 2).sum())
        got = {}
        for method in ("tsqr", "gram"):
            out = os.path.join(wd, f"{method}-{cond:.0e}.h5")
            calibrate(model, out, files, np_=2, extra=["--qr", method, "--force"])
            got[method] = load_proj(out)
        for r in (4, 8, 12):
            tail = np.sqrt((sig[r:] ** 2).sum()) / norm
            for method in ("tsqr", "gram"):
                A = got[method]["kqsvd/key_down"][0, 0][:, :r]
                B = got[method]["kqsvd/query_down"][0, 0][:, :r]
                err = np.linalg.norm(S - (K @ A) @ (Qs @ B).T) / norm
                check(abs(err - tail) <= 1e-12, f"cond {cond:.0e}, rank {r}, --qr {method}: score "
                      f"error {err:.6e} against the optimal {tail:.6e}")
        diff, where = max_rel_diff(got["tsqr"], got["gram"])
        print(f"cond {cond:.0e}: gram's projections differ from tsqr's by {diff:.1e} ({where}); "
              "both reach the optimal score error at ranks 4, 8, 12")
        if cond <= 1e2:
            check(diff <= 1e-9, f"cond {cond:.0e}: gram differs from tsqr by {diff:.2e} at {where}")


def degenerate(qr):
    wd = workdir(f"qr_degenerate_{qr}")
    rng = np.random.default_rng(9)
    L, Hq, Hkv, d, D, T = 1, 4, 2, 8, 16, 200
    K, V = rng.standard_normal((L, Hkv, T, d)), rng.standard_normal((L, Hkv, T, d))
    Q = rng.standard_normal((L, Hq, T, d))
    K[0, 0], V[0, 0], Q[0, 0:2] = 0, 0, 0
    K[0, 1] = rng.standard_normal((T, 3)) @ rng.standard_normal((3, d))
    V[0, 1] = rng.standard_normal((T, 1)) @ rng.standard_normal((1, d))
    shard = os.path.join(wd, "shard-0.h5")
    write_cache(shard, K, V, Q, [T], D=D)
    model = os.path.join(wd, "model.h5")
    write_model(model, rng.standard_normal((L, D, Hq * d)), Hq, Hkv, d)
    base_path = os.path.join(wd, "tsqr.h5")
    calibrate(model, base_path, [shard], np_=2)
    base = load_proj(base_path)
    out = os.path.join(wd, f"{qr}.h5")
    calibrate(model, out, [shard], np_=3, extra=["--qr", qr])
    p = load_proj(out)
    check(all(np.isfinite(v).all() for k, v in p.items() if k != "attrs"), f"{qr}: non-finite output")
    check(np.abs(p["spectra/K"][0, 0]).max() == 0, f"{qr}: zero head's spectrum should be 0")
    for name in ("K", "Q", "V", "KQt", "VWo"):
        a, b = base[f"spectra/{name}"][0], p[f"spectra/{name}"][0]
        dev = np.abs(a - b).max() / max(np.abs(a).max(), 1e-300)
        check(dev <= 1e-7, f"{qr}: spectrum {name} deviates by {dev:.3g}")


def errors(qr):
    wd = workdir(f"qr_errors_{qr}")
    out = os.path.join(wd, "proj.h5")
    cases = [(["--qr", "householder"], "--qr must be tsqr, gram or scalapack")]
    if qr == "scalapack":
        cases += [(["--qr", "scalapack", "--device", "cuda"], "--device cuda runs --qr tsqr or gram"),
                  (["--qr", "scalapack", "--checkpoint", wd], "--checkpoint does not work with --qr scalapack"),
                  (["--qr", "scalapack", "--mem-limit", "100"],
                   "--qr scalapack holds each (layer, KV head)'s rows")]
    # 32 k tokens: 6 MiB of stacked queries per rank, over what 100 MiB leaves.
    model, shards = synth(os.path.join(wd, "big"), **dict(GQA, seqs=64, seq_len=512))
    for extra, needle in cases:
        p = calibrate(model, out, shards, np_=2, extra=extra, expect=1)
        check(needle in p.stderr, f"{extra}: expected '{needle}' in: {p.stderr.strip()}")
        check(not os.path.exists(out), f"{extra}: output left behind")
        check(not [f for f in os.listdir(wd) if ".tmp" in f], f"{extra}: temporary file left behind")


def timings_line(qr):
    """bench/calibrate_bench.py parses this line: its fields must be there."""
    wd, model, shards = small_set(f"qr_timings_{qr}", shards=2, **GQA)
    p = calibrate(model, os.path.join(wd, "proj.h5"), shards, np_=2, extra=["--qr", qr, "--timings"])
    line = [x for x in p.stderr.splitlines() if "timings" in x]
    check(len(line) == 1, f"one timings line expected, got {line}")
    fields = dict(re.findall(r"(\w+)=([-+0-9.e]+)", line[0].split(":", 2)[2])) if line else {}
    for k in ("wall", "read", "bytes", "read_rate", "fold", "rows", "fold_gflops", "reduce", "solve", "peak_rss"):
        check(k in fields and float(fields[k]) >= 0, f"timings field {k} missing in {line}")
    T = sum(h5py.File(f, "r")["seq_lens"][()].sum() for f in shards)
    rows = T * GQA["layers"] * (GQA["heads"] + 2 * GQA["kv_heads"])
    check(fields and float(fields["rows"]) == rows, f"rows {fields.get('rows')} vs {rows} folded")


def qr_gram():
    agreement("gram", (1, 2, 3))
    wide_range("gram")
    conditioning()
    degenerate("gram")
    errors("gram")
    timings_line("gram")
    finish("qr_gram")


def qr_scalapack():
    p = run(["calibrate", "--qr", "scalapack", "--model", "x", "--out", "y", "z"], expect=None)
    if "built without ScaLAPACK" in p.stderr:
        print("SKIPPED: this kqsvd was built without ScaLAPACK (KQSVD_SCALAPACK=OFF)")
        raise SystemExit(77)
    agreement("scalapack", (1, 2, 3, 4))
    wide_range("scalapack")
    degenerate("scalapack")
    errors("scalapack")
    timings_line("scalapack")
    finish("qr_scalapack")
