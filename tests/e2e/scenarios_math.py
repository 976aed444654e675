"""Numerical scenarios: agreement with the independent reference, with
itself across rank counts and shard/block sizes, and the paper's theorems."""
import os
import re

import h5py
import numpy as np

from harness import calibrate, check, finish, load_proj, max_rel_diff, run, small_set, synth, workdir
from reference import group_mats, load_oproj, load_set, rank_rule, svals

# A GQA model (3 query heads per KV head), bf16, uneven shards of uneven sequences.
GQA = dict(layers=2, heads=6, kv_heads=2, head_dim=16, seqs=9, seq_len=80, dtype="bf16", seed=5)


def explicit_err(X, Y, A, B, r):
    """||X A_r B_r^T Y^T - X Y^T||_F^2 / ||X Y^T||_F^2 with the products formed."""
    M = X @ Y.T
    Mt = (X @ A[:, :r]) @ (Y @ B[:, :r]).T
    return float(((Mt - M) ** 2).sum() / (M ** 2).sum())


def ref_projections(k, q, v, w, beta):
    """The contract's definitions, from full matrices (no R factors)."""
    d = k.shape[1]
    Vk = np.linalg.svd(k, full_matrices=False)[2].T
    Vv = np.linalg.svd(v, full_matrices=False)[2].T
    Ve = np.linalg.svd(np.vstack([beta * k, q / beta]), full_matrices=False)[2].T
    Ukq = np.linalg.svd(k @ q.T, full_matrices=False)[0][:, :d]
    Uvw = np.linalg.svd(v @ w, full_matrices=False)[0][:, :d]
    return {"ksvd": (Vk, Vk, Vv, Vv), "eigen": (Ve, Ve, Vv, Vv),
            "kqsvd": (np.linalg.pinv(k) @ Ukq, k.T @ Ukq, np.linalg.pinv(v) @ Uvw, v.T @ Uvw)}


def reference():
    wd, model, shards = small_set("reference", shards=4, uneven=True, **GQA)
    out = os.path.join(wd, "proj.h5")
    calibrate(model, out, shards, np_=3, extra=["--eps", "0.15", "--beta", "2"])
    K, V, Q = load_set(shards)
    O = load_oproj(model)
    p = load_proj(out)
    L, Hkv, T, d = K.shape
    check(p["attrs"]["tokens"] == T and p["attrs"]["shards"] == 4, "tokens/shards attributes")
    check(abs(p["attrs"]["eps"] - 0.15) < 1e-15, "eps attribute")
    with h5py.File(out, "r") as f:
        check(f["eigen"].attrs["beta"] == 2.0, "eigen beta attribute")
        check(f.attrs["kqsvd_format"] in ("projections", b"projections"), "format attribute")
    worst = 0.0
    for l in range(L):
        rk = rank_rule(np.array([svals(K[l, g]) for g in range(Hkv)]), 0.15)
        rv = rank_rule(np.array([svals(V[l, g]) for g in range(Hkv)]), 0.15)
        for m in ("kqsvd", "ksvd", "eigen"):
            check(p[f"{m}/rank_k"][l] == rk and p[f"{m}/rank_v"][l] == rv,
                  f"layer {l} {m}: ranks {p[f'{m}/rank_k'][l]},{p[f'{m}/rank_v'][l]} vs {rk},{rv}")
        for g in range(Hkv):
            k, q, v, w = group_mats(K, V, Q, O, l, g)
            spec = {"K": svals(k), "Q": svals(q), "V": svals(v), "KQt": svals(k @ q.T)[:d],
                    "VWo": svals(v @ w)[:d]}
            for name, s in spec.items():
                got = p[f"spectra/{name}"][l, g]
                check(np.abs(got - s).max() <= 1e-10 * s[0], f"spectrum {name} layer {l} head {g}")
            refp = ref_projections(k, q, v, w, 2.0)
            for m, (A, B, Av, Bv) in refp.items():
                ours = [p[f"{m}/{n}"][l, g] for n in ("key_down", "query_down", "value_down", "value_up")]
                for (X, Y, a, b, ra, rb, r) in ((k, q, ours[0], ours[1], A, B, rk),
                                                (v, w.T, ours[2], ours[3], Av, Bv, rv)):
                    e, e_ref = explicit_err(X, Y, a, b, r), explicit_err(X, Y, ra, rb, r)
                    rel = abs(e - e_ref) / max(e_ref, 1e-300)
                    worst = max(worst, rel)
                    check(rel <= 1e-6, f"{m} layer {l} head {g}: error {e} vs reference {e_ref}")
            kq = spec["KQt"]
            e = explicit_err(k, q, p["kqsvd/key_down"][l, g], p["kqsvd/query_down"][l, g], rk)
            check(abs(e - (kq[rk:] ** 2).sum() / (kq ** 2).sum()) <= 1e-9, "kqsvd error = tail")
    print(f"largest relative deviation from the reference: {worst:.3g}")
    finish("reference")


def ranks():
    wd, model, shards = small_set("ranks", shards=3, uneven=True, **GQA)
    base = None
    for np_ in (1, 2, 3, 4, 7):
        out = os.path.join(wd, f"proj-np{np_}.h5")
        calibrate(model, out, shards, np_=np_)
        p = load_proj(out)
        if base is None:
            base = p
            continue
        d, where = max_rel_diff(base, p)
        print(f"np {np_} vs np 1: largest relative difference {d:.3g} ({where})")
        check(d <= 1e-10, f"np {np_} differs from np 1 by {d:.3g} in {where}")
    finish("ranks")


def shards():
    wd = workdir("shards")
    one_model, one = synth(os.path.join(wd, "one"), shards=1, **GQA)
    five_model, five = synth(os.path.join(wd, "five"), shards=5, uneven=True, **GQA)
    base_path = os.path.join(wd, "base.h5")
    calibrate(five_model, base_path, five, np_=1)
    base = load_proj(base_path)
    runs = [("one shard on 2 ranks (MPI-IO row ranges)", one_model, one, 2, []),
            ("one shard on 3 ranks, small reads", one_model, one, 3, ["--read-rows", "100", "--qr-block", "50"]),
            ("five shards on 3 ranks, qr block 1000", five_model, five, 3, ["--qr-block", "1000"]),
            ("five shards, reads of 64 rows", five_model, five, 1, ["--read-rows", "64", "--qr-block", "64"]),
            ("five shards on 7 ranks", five_model, five, 7, [])]
    # For a fixed rank count, shard list and --qr-block, the read size must
    # not change a single bit (W^O included: hidden 2048 spans many reads).
    exact_model, exact = synth(os.path.join(wd, "wide"), shards=2, **dict(GQA, hidden=2048))
    outs = []
    for extra in ([], ["--read-rows", "64"], ["--read-rows", "192", "--mem-limit", "200"]):
        outs.append(os.path.join(wd, f"exact{len(outs)}.h5"))
        calibrate(exact_model, outs[-1], exact, np_=2, extra=["--qr-block", "64"] + extra)
    a = load_proj(outs[0])
    for o in outs[1:]:
        b = load_proj(o)
        check(all(np.array_equal(a[k], b[k]) for k in a if k != "attrs"), f"{o}: read size changed bits")
    for i, (what, model, files, np_, extra) in enumerate(runs):
        out = os.path.join(wd, f"run{i}.h5")
        calibrate(model, out, files, np_=np_, extra=extra)
        d, where = max_rel_diff(base, load_proj(out))
        print(f"{what}: largest relative difference {d:.3g} ({where})")
        check(d <= 1e-10, f"{what}: differs by {d:.3g} in {where}")
    finish("shards")


def theorems():
    wd = workdir("theorems")
    spec = dict(GQA, dtype="f64", seq_len=60)
    model, files = synth(os.path.join(wd, "b1"), shards=2, **spec)
    outs = {}
    for beta in (1, 10, 100, 1000):
        outs[beta] = os.path.join(wd, f"beta{beta}.h5")
        calibrate(model, outs[beta], files, np_=2, extra=["--beta", beta])
    K, V, Q = load_set(files)
    O = load_oproj(model)
    p = load_proj(outs[1])
    L, Hkv, T, d = K.shape
    for l in range(L):
        for g in range(Hkv):
            k, q, v, w = group_mats(K, V, Q, O, l, g)
            kq, vw = svals(k @ q.T)[:d], svals(v @ w)[:d]
            A, B = p["kqsvd/key_down"][l, g], p["kqsvd/query_down"][l, g]
            Av, Bv = p["kqsvd/value_down"][l, g], p["kqsvd/value_up"][l, g]
            Vk = p["ksvd/key_down"][l, g]
            tot = (kq ** 2).sum()
            for r in range(1, d + 1):
                # Theorem 2 (and its value/output counterpart): opt is the tail energy.
                opt = explicit_err(k, q, A, B, r)
                check(abs(opt - (kq[r:] ** 2).sum() / tot) <= 1e-9, f"l{l} g{g} r{r}: KQ tail")
                check(abs(explicit_err(v, w.T, Av, Bv, r) - (vw[r:] ** 2).sum() / (vw ** 2).sum()) <= 1e-9,
                      f"l{l} g{g} r{r}: VW tail")
                # Theorem 3: the gap of ksvd in closed form, never negative.
                eks = explicit_err(k, q, Vk, Vk, r)
                proj = ((k @ Vk[:, :r]) @ (q @ Vk[:, :r]).T)
                closed = ((kq[:r] ** 2).sum() - (proj ** 2).sum()) / tot
                check(abs((eks - opt) - closed) <= 1e-9 and eks - opt >= -1e-12,
                      f"l{l} g{g} r{r}: ksvd gap {eks - opt} vs closed form {closed}")
            # Theorem 5 (GQA): stacked objective = sum of per-head ones, and each
            # head's best B_h given A gives no less error than the shared B.
            r = int(p["kqsvd/rank_k"][l])
            m = Q.shape[1] // Hkv
            heads = [Q[l, h] for h in range(g * m, (g + 1) * m)]
            stacked = explicit_err(k, q, A, B, r) * tot
            per_head = sum(explicit_err(k, qh, A, B, r) * ((k @ qh.T) ** 2).sum() for qh in heads)
            check(abs(stacked - per_head) <= 1e-9 * tot, "GQA: stacked = sum of heads")
            Qx = np.linalg.qr(k @ A[:, :r])[0]
            best = sum((((k @ qh.T) - Qx @ (Qx.T @ (k @ qh.T))) ** 2).sum() for qh in heads)
            check(abs(best - stacked) <= 1e-9 * tot, f"GQA: per-head optimum {best} vs {stacked}")
            # Exact side-by-side W^O beats the authors' averaged blocks.
            D = O.shape[1]
            wavg = sum(w[:, i * D:(i + 1) * D] for i in range(m)) / m
            U = np.linalg.svd(v @ wavg, full_matrices=False)[0][:, :d]
            Aa, Ba = np.linalg.pinv(v) @ U, v.T @ U
            rv = int(p["kqsvd/rank_v"][l])
            check(explicit_err(v, w.T, Av, Bv, rv) <= explicit_err(v, w.T, Aa, Ba, rv) + 1e-12,
                  "exact W beats averaged W^O")
            # Theorem 4: eigen tends to ksvd as beta grows.
            sk = svals(k)
            if sk[r - 1] > sk[r] * (1 + 1e-6):
                eks = explicit_err(k, q, Vk, Vk, r)
                gaps = []
                for beta in (1, 10, 100, 1000):
                    pe = load_proj(outs[beta])
                    Ve = pe["eigen/key_down"][l, g]
                    gaps.append(abs(explicit_err(k, q, Ve, Ve, r) - eks))
                check(all(b <= a + 1e-15 for a, b in zip(gaps, gaps[1:])), f"eigen gaps {gaps} not decreasing")
                check(gaps[-1] <= 1e-6 * eks, f"eigen at beta 1000 still {gaps[-1]} from ksvd")
    # Scaling K by c and Q by 1/c leaves ksvd and kqsvd unchanged.
    model3, files3 = synth(os.path.join(wd, "b3"), shards=2, beta=3, **spec)
    out3 = os.path.join(wd, "scaled.h5")
    calibrate(model3, out3, files3, np_=2)
    p3 = load_proj(out3)
    for meth in ("ksvd", "kqsvd"):
        for l in range(L):
            for g in range(Hkv):
                r = int(p[f"{meth}/rank_k"][l])
                a, b = p[f"{meth}/key_down"][l, g][:, :r], p[f"{meth}/query_down"][l, g][:, :r]
                a3, b3 = p3[f"{meth}/key_down"][l, g][:, :r], p3[f"{meth}/query_down"][l, g][:, :r]
                P, P3 = a @ b.T, a3 @ b3.T
                check(np.abs(P - P3).max() <= 1e-9 * np.abs(P).max(), f"{meth} A B^T changed under scaling")
    check(np.array_equal(p["kqsvd/rank_k"], p3["kqsvd/rank_k"]), "ranks changed under scaling")
    finish("theorems")


def gpu():
    """calibrate --device cuda against --device cpu on the same data, for
    both folds (Householder QR, and Gram matrices in batched FP64 GEMMs),
    per head and in head groups; the Gram fold against the CPU's
    Householder reference; and a NaN found on the device named like on the
    CPU, for both folds (skips without a GPU)."""
    v = run(["--version"]).stdout
    if "not built" in v or " 0 GPUs visible" in v:
        print("gpu: SKIPPED, this kqsvd has no CUDA module or sees no GPU:\n" + v)
        raise SystemExit(77)
    wd, model, shards = small_set("gpu", shards=3, uneven=True, **GQA)
    outs, timed = {}, {}
    for G in (1, 2):
        for qr in ("tsqr", "gram"):
            for dev in ("cpu", "cuda"):
                key = (G, qr, dev)
                outs[key] = os.path.join(wd, f"proj-{dev}-{qr}-{G}.h5")
                err = calibrate(model, outs[key], shards, np_=2,
                                extra=["--device", dev, "--qr", qr, "--head-groups", str(G),
                                       "--timings"]).stderr
                timed[key] = dict(re.findall(r"(fold|rows)=([0-9.e+]+)", err))
            # --timings counts the device's fold like the CPU's (it once printed 0).
            gpu_t, cpu_t = timed[(G, qr, "cuda")], timed[(G, qr, "cpu")]
            check(gpu_t.get("rows") == cpu_t.get("rows") and float(gpu_t.get("fold", 0)) > 0,
                  f"G = {G}, {qr}: GPU --timings {gpu_t} against the CPU's {cpu_t}")
            worst, where = max_rel_diff(load_proj(outs[(G, qr, "cpu")]),
                                        load_proj(outs[(G, qr, "cuda")]))
            check(worst <= 1e-9, f"G = {G}, {qr}: GPU projections differ from the CPU's by "
                  f"{worst:.2e} at {where}")
            print(f"gpu: G = {G}, --qr {qr}: largest relative difference from the CPU {worst:.2e}")
        worst, where = max_rel_diff(load_proj(outs[(G, "tsqr", "cpu")]),
                                    load_proj(outs[(G, "gram", "cuda")]))
        check(worst <= 1e-9, f"G = {G}: the GPU's Gram fold differs from the CPU's Householder "
              f"fold by {worst:.2e} at {where}")
        print(f"gpu: G = {G}, GPU gram against CPU tsqr: {worst:.2e}")
    bad = os.path.join(wd, "nan.h5")
    with h5py.File(shards[1], "r") as src, h5py.File(bad, "w") as dst:
        for k, val in src.attrs.items():
            dst.attrs[k] = val
        for name in src:
            dst.create_dataset(name, data=src[name][...])
            for k, val in src[name].attrs.items():
                dst[name].attrs[k] = val
        q = dst["queries"][...]
        q[1, 4, 9, 0] = 0x7fc0
        dst["queries"][...] = q
    for qr in ("tsqr", "gram"):
        p = calibrate(model, os.path.join(wd, "x.h5"), [shards[0], bad], np_=2,
                      extra=["--device", "cuda", "--qr", qr], expect=1)
        check("nan.h5" in p.stderr and "queries" in p.stderr and "layer 1, head 4, row 9" in p.stderr,
              f"NaN on the GPU ({qr}): {p.stderr}")
    finish("gpu")
