"""Head-group latents (KQ-SVD across the KV heads of a layer), checked
against an independent float64 reference written here with numpy: the
joint keys K_G = [K_1 .. K_G] side by side, the queries Q_bd =
blockdiag(Q_1 .. Q_G), the values against blockdiag(W_1 .. W_G)."""
import unittest

import numpy as np

from kqsvd.calibration.binding import Calibrator
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
        self.assertEqual((res.shape.kv_heads, res.shape.head_dim, res.shape.group),
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


if __name__ == "__main__":
    unittest.main()
