"""Head-group latents (KQ-SVD across the KV heads of a layer), checked
against an independent float64 reference written here with numpy: the
joint keys K_G = [K_1 .. K_G] side by side, the queries Q_bd =
blockdiag(Q_1 .. Q_G), the values against blockdiag(W_1 .. W_G).  Then the
compressed attention with group latents in a tiny Llama: full rank is the
model, generate() equals whole-sequence passes with a cache of exactly the
latents, o_proj folds, and an independent compressed Llama written here
gives the same perplexity, keys before and after RoPE."""
import math
import os
import sys
import unittest

import numpy as np
import torch

from common import TEXT, Calibrated, reference_llama_nll, run
from common import calibrate as calibrate_cli

import kqsvd
from kqsvd import models
from kqsvd.calibration.calibrator import Calibrator
from kqsvd.compat import output_cache
from kqsvd.errors import UsageError

L, HKV, M, D_HEAD, HIDDEN = 2, 4, 2, 6, 10


def random_model(T, seed, zero_head=None, rank=None):
    """Keys [L, T, Hkv, d], queries [L, T, Hq, d], values, o_proj [L, D, Hq d]:
    correlated across heads (a shared latent), so that joint and per-head
    solutions differ.  rank: keys and values of that rank; zero_head: that
    KV head's keys and values all zero."""
    rng = np.random.default_rng(seed)
    latent = rng.standard_normal((L, T, rank or HKV * D_HEAD))
    mix = rng.standard_normal((L, latent.shape[2], HKV * D_HEAD))
    K = (latent @ mix).reshape(L, T, HKV, D_HEAD) + 0.1 * rng.standard_normal(
        (L, T, HKV, D_HEAD)) * (rank is None)
    V = (latent @ rng.standard_normal(mix.shape)).reshape(L, T, HKV, D_HEAD)
    Q = rng.standard_normal((L, T, HKV * M, D_HEAD)) * np.linspace(0.2, 2, D_HEAD)
    O = rng.standard_normal((L, HIDDEN, HKV * M * D_HEAD))
    if zero_head is not None:
        K[:, :, zero_head] = 0
        V[:, :, zero_head] = 0
    return K, Q, V, O


def calibrate(K, Q, V, O, G, ranks="fixed:1"):
    cal = Calibrator(L, HKV, M, D_HEAD, HIDDEN, block_rows=16, head_groups=G)
    for l in range(L):
        for g in range(0, HKV, G):
            cal.absorb("keys", l, g, np.ascontiguousarray(K[l, :, g:g + G].reshape(-1, G * D_HEAD)))
            cal.absorb("values", l, g, np.ascontiguousarray(V[l, :, g:g + G].reshape(-1, G * D_HEAD)))
        for h in range(HKV * M):
            cal.absorb("queries", l, h // M, Q[l, :, h], query=h % M)
        cal.absorb_oproj(l, O[l])
    return cal, cal.finish(ranks)


def reference(K, Q, V, O, l, g0, G):
    """The joint matrices of group g0 .. g0+G-1 in layer l: K_G, Q_bd, V_G,
    W_bd (n x G m D)."""
    n, T = G * D_HEAD, K.shape[1]
    KG = K[l, :, g0:g0 + G].reshape(T, n)
    VG = V[l, :, g0:g0 + G].reshape(T, n)
    Qbd = np.zeros((G * M * T, n))
    Wbd = np.zeros((n, G * M * HIDDEN))
    for j in range(G):
        for i in range(M):
            h = (g0 + j) * M + i
            Qbd[(j * M + i) * T:(j * M + i + 1) * T, j * D_HEAD:(j + 1) * D_HEAD] = Q[l, :, h]
            Wbd[j * D_HEAD:(j + 1) * D_HEAD, (j * M + i) * HIDDEN:(j * M + i + 1) * HIDDEN] = \
                O[l][:, h * D_HEAD:(h + 1) * D_HEAD].T
    return KG, Qbd, VG, Wbd


def svals(X, n):
    """X's n largest singular values, zeros past its rank."""
    s = np.linalg.svd(X, compute_uv=False)[:n]
    return np.concatenate([s, np.zeros(n - len(s))])


def err2(X, A, B, Y):
    return float(np.sum((X @ A @ B.T @ Y.T - X @ Y.T) ** 2))


def subspace(A, r):
    U, _, _ = np.linalg.svd(A[:, :r], full_matrices=False)
    return U @ U.T


class JointProjections(unittest.TestCase):
    def check(self, K, Q, V, O, G, gap=True):
        cal, res = calibrate(K, Q, V, O, G)
        n = G * D_HEAD
        self.assertEqual((res.shape.kv_heads, res.shape.head_dim, res.shape.q_per_kv),
                         (HKV // G, n, M * G))
        for l in range(L):
            for gi, g0 in enumerate(range(0, HKV, G)):
                KG, Qbd, VG, Wbd = reference(K, Q, V, O, l, g0, G)
                S = KG @ Qbd.T
                s_ref = svals(S, n)
                tail = [float(np.sum(s_ref[r:] ** 2)) for r in range(n + 1)]
                scale = tail[0] or 1.0
                kq = lambda w: res.matrix("kqsvd", w, l, gi)  # noqa: E731
                np.testing.assert_allclose(res.sigma("kqsvd", False, l, gi), s_ref,
                                           atol=1e-9 * s_ref[0] + 1e-300)
                for r in (1, n // 3, n // 2, n - 1, n):
                    e = err2(KG, kq("key_down")[:, :r], kq("query_down")[:, :r], Qbd)
                    self.assertAlmostEqual(e / scale, tail[r] / scale, delta=1e-9,
                                           msg=f"layer {l} group {gi} rank {r}")
                # values against blockdiag(W_j)
                t_ref = svals(VG @ Wbd, n)
                vtail = float(np.sum(t_ref[n // 2:] ** 2))
                e = err2(VG, kq("value_down")[:, :n // 2], kq("value_up")[:, :n // 2], Wbd.T)
                self.assertAlmostEqual(e / (np.sum(t_ref ** 2) or 1), vtail /
                                       (np.sum(t_ref ** 2) or 1), delta=1e-9)
                # ksvd: K_G's own singular values and subspaces; eigen: [K_G; Q_bd]'s
                np.testing.assert_allclose(res.sigma("ksvd", False, l, gi),
                                           svals(KG, n),
                                           atol=1e-9 * np.linalg.norm(KG, 2) + 1e-300)
                np.testing.assert_allclose(
                    res.sigma("eigen", False, l, gi),
                    svals(np.vstack([KG, Qbd]), n), rtol=1e-9, atol=1e-12)
                if gap:
                    _, _, Vt = np.linalg.svd(KG, full_matrices=False)
                    r = n // 2
                    np.testing.assert_allclose(subspace(res.matrix("ksvd", "key_down", l, gi), r),
                                               Vt[:r].T @ Vt[:r], atol=1e-8)
                    _, _, Vt = np.linalg.svd(np.vstack([KG, Qbd]), full_matrices=False)
                    np.testing.assert_allclose(subspace(res.matrix("eigen", "key_down", l, gi), r),
                                               Vt[:r].T @ Vt[:r], atol=1e-8)
                    _, _, Vt = np.linalg.svd(VG, full_matrices=False)
                    np.testing.assert_allclose(
                        subspace(res.matrix("ksvd", "value_down", l, gi), r), Vt[:r].T @ Vt[:r],
                        atol=1e-8)
                # the joint R factor is LAPACK's up to row signs
                R = cal.factor("keys", l, g0)
                Rl = np.linalg.qr(KG, mode="r")
                k = min(n, KG.shape[0])
                np.testing.assert_allclose(np.abs(R[:k]), np.abs(Rl[:k]),
                                           atol=1e-10 * np.abs(Rl).max() + 1e-300)
        cal.close()
        return res

    def test_groups_of_two_and_the_whole_layer(self):
        K, Q, V, O = random_model(200, 1)
        for G in (2, 4):
            self.check(K, Q, V, O, G)

    def test_rank_deficient_and_zero_heads(self):
        # fewer tokens than the group's width, and one head of zeros
        K, Q, V, O = random_model(7, 2, zero_head=1)
        self.check(K, Q, V, O, 2, gap=False)
        K, Q, V, O = random_model(100, 3, rank=5)
        res = self.check(K, Q, V, O, 4, gap=False)
        for m in ("kqsvd", "ksvd", "eigen"):
            for w in ("key_down", "query_down", "value_down", "value_up"):
                self.assertTrue(np.isfinite(res.matrix(m, w, 0, 0)).all())

    def test_never_worse_than_per_head_at_equal_rank(self):
        K, Q, V, O = random_model(200, 4)
        _, per_head = calibrate(K, Q, V, O, 1)
        _, joint = calibrate(K, Q, V, O, HKV)
        for l in range(L):
            KG, Qbd, _, _ = reference(K, Q, V, O, l, 0, HKV)
            for r in (1, 2, 3, 5):
                A = np.zeros((HKV * D_HEAD, HKV * r))
                B = np.zeros_like(A)
                for j in range(HKV):
                    blk = slice(j * D_HEAD, (j + 1) * D_HEAD)
                    A[blk, j * r:(j + 1) * r] = per_head.matrix("kqsvd", "key_down", l, j)[:, :r]
                    B[blk, j * r:(j + 1) * r] = per_head.matrix("kqsvd", "query_down", l, j)[:, :r]
                e_head = err2(KG, A, B, Qbd)
                e_joint = err2(KG, joint.matrix("kqsvd", "key_down", l, 0)[:, :HKV * r],
                               joint.matrix("kqsvd", "query_down", l, 0)[:, :HKV * r], Qbd)
                self.assertLessEqual(e_joint, e_head * (1 + 1e-9))
                self.assertLess(e_joint, 0.99 * e_head)  # the shared latent pays here

    def test_one_head_per_group_is_the_per_head_form(self):
        K, Q, V, O = random_model(150, 5)
        cal = Calibrator(L, HKV, M, D_HEAD, HIDDEN, block_rows=16)
        for l in range(L):
            for g in range(HKV):
                cal.absorb("keys", l, g, K[l, :, g])
                cal.absorb("values", l, g, V[l, :, g])
            for h in range(HKV * M):
                cal.absorb("queries", l, h // M, Q[l, :, h], query=h % M)
            cal.absorb_oproj(l, O[l])
        plain = cal.finish("fixed:1")
        _, one = calibrate(K, Q, V, O, 1)
        for m in ("kqsvd", "ksvd", "eigen"):
            for w in ("key_down", "query_down", "value_down", "value_up"):
                np.testing.assert_array_equal(plain.matrix(m, w, 1, 3), one.matrix(m, w, 1, 3))

    def test_bad_groups(self):
        for G in (0, 3, 5):
            with self.assertRaises(UsageError) as e:
                Calibrator(L, HKV, M, D_HEAD, HIDDEN, head_groups=G)
            self.assertIn("head_groups", str(e.exception))
        cal = Calibrator(L, HKV, M, D_HEAD, HIDDEN, head_groups=2)
        with self.assertRaises(UsageError) as e:
            cal.absorb("keys", 0, 1, np.zeros((3, 2 * D_HEAD)))
        self.assertIn("first head", str(e.exception))
        with self.assertRaises(UsageError):
            cal.absorb("keys", 0, 0, np.zeros((3, D_HEAD)))  # one head's width, not the group's
        with self.assertRaises(UsageError):
            cal.finish("fixed:13")  # above G d = 12


def grouped(kind="llama", G=2, rope=None):
    """A tiny decoder's calibration (common.Calibrated) with head groups of
    G: (Calibrated, path of the head-groups file)."""
    c = Calibrated.get(kind)
    out = os.path.join(c.wd, f"proj-g{G}{'-' + rope if rope else ''}.h5")
    if not os.path.exists(out):
        calibrate_cli(*c.train, out, ranks="eps:0.1", extra=["--head-groups", str(G)])
    return c, out


def reference_nll_groups(sd, cfg, proj, ids):
    """An independent compressed Llama with group latents
    (common.reference_llama_nll): each group's keys (after RoPE, or before
    it for proj.rope "pre") side by side times A, query head h of KV head j scoring against
    them through the d rows of B for j (or, before RoPE, against RoPE of
    the rebuilt keys' block j), values (V_G A_v)(B_v,j^T) before W^O.
    Returns the summed next-token NLL."""
    G, hq, hkv = proj.head_groups, cfg.num_attention_heads, cfg.num_key_value_heads
    d, m = cfg.hidden_size // hq, hq // hkv

    def attention(l, q, k, v, rot, mask):
        out = torch.zeros(len(ids), hq * d, dtype=torch.float64)
        for gi in range(hkv // G):
            A, B, Av, Bv = (torch.from_numpy(mat[l][gi]) for mat in
                            (proj.key_down, proj.query_down, proj.value_down, proj.value_up))
            heads = range(gi * G, gi * G + G)
            kpre = torch.cat([k[:, j * d:(j + 1) * d] for j in heads], 1)
            kpost = torch.cat([rot(k[:, j * d:(j + 1) * d]) for j in heads], 1)
            c_v = torch.cat([v[:, j * d:(j + 1) * d] for j in heads], 1) @ Av
            back = kpre @ A @ B.T  # the rebuilt pre-RoPE keys of the group
            for b, j in enumerate(heads):
                rows = slice(b * d, (b + 1) * d)
                for head in range(j * m, (j + 1) * m):
                    qh = rot(q[:, head * d:(head + 1) * d])
                    if proj.rope == "pre":
                        s = qh @ rot(back[:, rows]).T
                    else:
                        s = (qh @ B[rows]) @ (kpost @ A).T
                    w = torch.softmax(s / math.sqrt(d) + mask, -1)
                    out[:, head * d:(head + 1) * d] = w @ c_v @ Bv[rows].T
        return out

    return reference_llama_nll(sd, cfg, ids, attention)


def rel(a, b):
    return float((a - b).norm() / b.norm())


def kv4():
    """A tiny Llama of 8 query and 4 KV heads and its head-groups file (G =
    2, so two groups per layer), from calibrate_hf: (folder, path)."""
    from common import tiny_decoder
    wd = Calibrated.get("llama").wd
    folder, path = os.path.join(wd, "kv4"), os.path.join(wd, "kv4-g2.h5")
    if not os.path.exists(path):
        tiny_decoder("llama", folder, heads=8, kv_heads=4)
        run([sys.executable, "-m", "kqsvd.calibrate_hf", "--model", folder, "--text", TEXT,
             "--seq-len", "48", "--num-seqs", "8", "--out", path, "--head-groups", "2",
             "--dtype", "f64"])
    return folder, path


class GroupAttention(unittest.TestCase):
    def setUp(self):
        self.c, self.path = grouped()
        self.model, self.tok, self.info = models.load(self.c.model, dtype=torch.float32)
        self.ids = torch.from_numpy(models.token_windows(self.tok, TEXT, 40, 2, "validation")[0])

    def test_loads_as_the_group_view(self):
        p = kqsvd.load_projections(self.path, "kqsvd", "fixed:8")
        self.assertEqual((p.head_groups, p.num_kv_heads, p.head_dim), (2, 1, 32))
        self.assertEqual(p.sizes()["num_kv_heads"], 2)
        self.assertEqual(p.sizes()["head_dim"], 16)
        self.assertAlmostEqual(p.cache_kept(), 8 / 32)
        with self.assertRaises(UsageError):
            kqsvd.load_projections(self.path, "kqsvd", 33)  # above G d

    def test_full_rank_is_the_model(self):
        with torch.no_grad():
            want = self.model(input_ids=self.ids).logits
            for m in kqsvd.METHODS:
                for fold in (False, True):
                    with kqsvd.compressed(self.model, kqsvd.load_projections(self.path, m, 32),
                                          fold=fold):
                        got = self.model(input_ids=self.ids).logits
                    self.assertLess(rel(got, want), 1e-5, f"{m} fold={fold}")

    def test_generate_and_cache_bytes(self):
        proj = kqsvd.load_projections(self.path, "kqsvd", "fixed:7")
        ids = self.ids[:1, :16]
        with torch.no_grad(), kqsvd.compressed(self.model, proj):
            out = self.model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0,
                                      return_dict_in_generate=True)
            seq = out.sequences
            for t in range(ids.shape[1], seq.shape[1]):
                logits = self.model(input_ids=seq[:, :t], use_cache=False).logits[0, -1]
                self.assertEqual(int(logits.argmax()), int(seq[0, t]), f"token {t}")
            T = seq.shape[1] - 1
            # one latent of 7 keys and 7 values per layer, group and token, float32
            self.assertEqual(kqsvd.cache_bytes(output_cache(out)),
                             4 * T * self.info.num_layers * 1 * (7 + 7))
            folded = None
            with kqsvd.compressed(self.model, proj, fold=True):
                folded = self.model(input_ids=seq).logits
            self.assertLess(rel(folded, self.model(input_ids=seq).logits), 1e-5)

    def test_per_group_ranks(self):
        """Ranks of their own per (layer, group), in a model of 4 KV heads in
        groups of 2: the cache holds each group's own columns, and the
        perplexity is the independent reference's, folded or not."""
        folder, path = kv4()
        model, _, info = models.load(folder, dtype=torch.float64)
        ranks = (np.array([[5, 12], [16, 3]]), np.array([[9, 2], [7, 16]]))
        ragged = kqsvd.load_projections(path, "kqsvd", ranks)
        self.assertTrue(ragged.per_head(0) and ragged.per_head(1))
        sd = model.state_dict()
        ids = self.ids[:, :24]
        ref = [reference_nll_groups(sd, model.config, ragged, row.numpy()) for row in ids]
        for fold in (False, True):
            with torch.no_grad(), kqsvd.compressed(model, ragged, fold=fold):
                out = model(input_ids=ids, use_cache=True)
            logp = torch.log_softmax(out.logits[:, :-1].double(), -1)
            nll = -logp.gather(2, ids[:, 1:, None]).sum((1, 2))
            for a, b in zip(nll.tolist(), ref):
                self.assertLess(abs(a - b) / abs(b), 1e-9, f"fold={fold}")
            self.assertEqual(kqsvd.cache_bytes(output_cache(out)),
                             8 * ids.numel() * int(sum(r.sum() for r in ranks)))

    def test_independent_perplexity(self):
        sd = self.model.state_dict()
        for rope in ("post", "pre"):
            path = self.path
            if rope == "pre":
                path = os.path.join(self.c.wd, "proj-g2-pre.h5")
                if not os.path.exists(path):
                    run([sys.executable, "-m", "kqsvd.calibrate_hf", "--model", self.c.model,
                         "--text", TEXT, "--seq-len", "64", "--num-seqs", "12", "--out", path,
                         "--keys", "pre-rope", "--head-groups", "2", "--dtype", "f64"])
            for method in kqsvd.METHODS:
                proj = kqsvd.load_projections(path, method, "fixed:6")
                self.assertEqual(proj.rope, rope)
                ref = sum(reference_nll_groups(sd, self.model.config, proj, row.numpy())
                          for row in self.ids)
                got = 0.0
                with torch.no_grad(), kqsvd.compressed(self.model, proj):
                    for row in self.ids:
                        logp = torch.log_softmax(
                            self.model(input_ids=row[None]).logits[0, :-1].double(), -1)
                        got -= float(logp.gather(1, row[1:, None]).sum())
                n = self.ids.numel() - self.ids.shape[0]
                self.assertLess(abs(math.exp(got / n) / math.exp(ref / n) - 1), 1e-4,
                                f"{rope} {method}")


class GroupQuality(unittest.TestCase):
    def test_quality_command_and_fitted_ranks(self):
        """The quality command takes a head-groups file: the C tool's
        policies, and quality-budget / quality-tuned ranks per (layer,
        group) fitted on the model and written as a head-groups file."""
        import json
        import h5py
        folder, path = kv4()
        wd = os.path.dirname(path)
        out = os.path.join(wd, "quality-g2.json")
        run([sys.executable, "-m", "kqsvd.quality", "--model", folder, "--text", TEXT, "--proj",
             path, "--ranks", "fixed:4,quality-budget:0.25,quality-tuned:0.25", "--methods",
             "kqsvd,ksvd", "--seq-len", "32", "--num-seqs", "2", "--calib-seqs", "2",
             "--check-seqs", "1", "--rounds", "1", "--tune-steps", "2", "--json", out, "--force"])
        with open(out) as f:
            rep = json.load(f)
        self.assertEqual(rep["head_groups"], 2)
        by = {(r["policy"], r["method"]): r for r in rep["results"]}
        self.assertAlmostEqual(by[("fixed:4", "kqsvd")]["cache_kept"], 0.25)
        self.assertAlmostEqual(by[("fixed:4", "kqsvd")]["cache_bytes_ratio"], 0.25)
        for pol in ("quality-budget:0.25", "quality-tuned:0.25"):
            r = by[(pol, "kqsvd")]
            self.assertAlmostEqual(r["cache_kept"], 0.25, delta=1 / 64)
            self.assertTrue(np.isfinite(r["perplexity"]))
            with h5py.File(r["proj"]) as f:
                self.assertEqual(int(f.attrs["head_groups"]), 2)
                self.assertEqual(f["kqsvd/rank_k_heads"].shape, (2, 2))
            p = kqsvd.load_projections(r["proj"], "kqsvd")
            self.assertEqual(p.tuned, pol.startswith("quality-tuned"))


if __name__ == "__main__":
    unittest.main()
