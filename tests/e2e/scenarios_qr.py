"""The --qr backends: gram (SYRK + Cholesky) and scalapack (pdgeqrf) give
TSQR's results on ordinary data at any rank count, keep working on zero and
rank-deficient heads, and (gram only) lose the small singular values of an
ill-conditioned head; their option errors."""
import os

import numpy as np

from harness import calibrate, check, finish, load_proj, max_rel_diff, small_set, synth, workdir
from scenarios_data import write_cache, write_model

GQA = dict(layers=2, heads=6, kv_heads=2, head_dim=16, seqs=9, seq_len=80, dtype="bf16", seed=5)


def agreement():
    wd, model, shards = small_set("qr_backends", shards=3, uneven=True, **GQA)
    base_path = os.path.join(wd, "tsqr.h5")
    calibrate(model, base_path, shards, np_=1)
    base = load_proj(base_path)
    for qr, nps in (("gram", (1, 2, 3)), ("scalapack", (1, 2, 3, 4))):
        for np_ in nps:
            out = os.path.join(wd, f"{qr}-np{np_}.h5")
            calibrate(model, out, shards, np_=np_, extra=["--qr", qr])
            d, where = max_rel_diff(base, load_proj(out))
            print(f"--qr {qr} on {np_} ranks vs tsqr: largest relative difference {d:.3g} ({where})")
            check(d <= 1e-9, f"--qr {qr} np {np_} differs from tsqr by {d:.3g} in {where}")


def wide_range():
    """Keys with singular values from 1 down to 1e-12: the Gram matrix squares
    them, so everything below ~1e-8 drowns in its round-off."""
    wd = workdir("qr_wide")
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
    for qr in ("tsqr", "gram", "scalapack"):
        out = os.path.join(wd, f"{qr}.h5")
        calibrate(model, out, files, np_=2, extra=["--qr", qr])
        got = load_proj(out)["spectra/K"][0, 0]
        errs[qr] = np.abs(got - s) / s
        print(f"--qr {qr:9s}: relative error of sigma_j(K) at sigma = 1e-4, 1e-8, 1e-10, 1e-12: "
              + ", ".join(f"{errs[qr][j]:.1e}" for j in (5, 11, 13, 15)))
    for qr in ("tsqr", "scalapack"):
        # Backward-stable QR: absolute error ~ eps * sigma_max, so sigma_j keeps
        # about 16 + log10(sigma_j) digits.
        check((errs[qr] * s <= 1e-13).all(), f"{qr}: absolute error above 1e-13")
        check((errs[qr][s >= 1e-10] <= 1e-4).all(), f"{qr}: sigma >= 1e-10 not accurate")
    check((errs["gram"][s >= 1e-4] <= 1e-6).all(), "gram: large singular values should be accurate")
    check(errs["gram"][s <= 1e-9].min() >= 0.5,
          "gram was expected to lose the singular values below 1e-8 (squared condition number)")


def degenerate():
    wd = workdir("qr_degenerate")
    rng = np.random.default_rng(9)
    L, Hq, Hkv, d, D, T = 1, 4, 2, 8, 16, 200
    K, V, Q = rng.standard_normal((L, Hkv, T, d)), rng.standard_normal((L, Hkv, T, d)), rng.standard_normal((L, Hq, T, d))
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
    for qr in ("gram", "scalapack"):
        out = os.path.join(wd, f"{qr}.h5")
        calibrate(model, out, [shard], np_=3, extra=["--qr", qr])
        p = load_proj(out)
        check(all(np.isfinite(v).all() for k, v in p.items() if k != "attrs"), f"{qr}: non-finite output")
        check(np.abs(p["spectra/K"][0, 0]).max() == 0, f"{qr}: zero head's spectrum should be 0")
        for name in ("K", "Q", "V", "KQt", "VWo"):
            a, b = base[f"spectra/{name}"][0], p[f"spectra/{name}"][0]
            dev = np.abs(a - b).max() / max(np.abs(a).max(), 1e-300)
            check(dev <= 1e-7, f"{qr}: spectrum {name} deviates by {dev:.3g}")


def errors():
    wd, model, shards = small_set("qr_errors", shards=2, **GQA)
    out = os.path.join(wd, "proj.h5")
    cases = [(["--qr", "householder"], "--qr must be tsqr, gram or scalapack"),
             (["--qr", "scalapack", "--checkpoint", wd], "--checkpoint does not work with --qr scalapack"),
             (["--qr", "gram", "--device", "cuda"], "--device cuda runs the tsqr method only"),
             (["--qr", "scalapack", "--mem-limit", "100"], "--qr scalapack holds each (layer, KV head)'s rows")]
    # 32 k tokens: 6 MiB of stacked queries per rank, over what 100 MiB leaves.
    model, shards = synth(os.path.join(wd, "big"), **dict(GQA, seqs=64, seq_len=512))
    for extra, needle in cases:
        p = calibrate(model, out, shards, np_=2, extra=extra, expect=1)
        check(needle in p.stderr, f"{extra}: expected '{needle}' in: {p.stderr.strip()}")
        check(not os.path.exists(out), f"{extra}: output left behind")
        check(not [f for f in os.listdir(wd) if ".tmp" in f], f"{extra}: temporary file left behind")


def qr_backends():
    agreement()
    wide_range()
    degenerate()
    errors()
    finish("qr_backends")
