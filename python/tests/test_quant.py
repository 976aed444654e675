"""Quantized latents (docs/quantized-cache.md), checked against an
independent implementation of the documented scheme written here in numpy
and plain Python integers: the codes, scales and packed bytes of every
group; the tokens a cache holds quantized or as computed; the bytes; and
a tiny Llama whose latent cache is quantized (and whose own cache is
quantized, the plain int-N cache), scored against the independent Llama
of common.py with this file's quantization inside its attention."""
import json
import os
import sys
import unittest

import h5py
import numpy as np
import torch

from common import TEXT, cache_kw, Calibrated, orthonormal_projections, reference_llama_nll, run, tiny_lm

from kqsvd.attention import cache_bytes, compress
from kqsvd.attention.cache import QuantCache
from kqsvd.attention.projection import rotate
from kqsvd.attention.quant import Store, dequantize, hadamard, quantize, store
from kqsvd.compat import output_cache
from kqsvd.errors import KqsvdError, UsageError
from kqsvd.formats.projections import load_projections
from kqsvd.formats.saving import save_ranks
from kqsvd.formats.policy import split_bits
from kqsvd.formats.quant import (QuantScheme, column_runs, option_bits, unit_bits,
                                 with_bits)
from kqsvd.quality.knapsack import hull, knapsack


def ref_quantize(x, bits, group):
    """The documented scheme on rows x (numpy, any float) -> (packed bytes
    as a list of lists, scales, zeros as float16 arrays, dequantized
    float32 rows)."""
    x = np.asarray(x, dtype=np.float32)
    rows = x.reshape(-1, x.shape[-1])
    top = (1 << bits) - 1
    out_bytes, scales, zeros, back = [], [], [], []
    for row in rows:
        codes, sc, ze, deq = [], [], [], []
        for s in range(0, len(row), group):
            g = row[s:s + group]
            lo, hi = g.min(), g.max()
            zero = np.float16(lo)
            scale = np.float16(np.float32(hi - lo) / np.float32(top))
            z32, s32 = np.float32(zero), np.float32(scale)
            for v in g:
                c = 0 if s32 == 0 else int(min(max(np.rint((v - z32) / s32), 0), top))
                codes.append(c)
                deq.append(np.float32(np.float32(c) * s32 + z32))
            sc.append(scale)
            ze.append(zero)
        codes += [0] * (-len(codes) % 8)
        packed = []
        for i in range(0, len(codes), 8):
            word = sum(c << (bits * k) for k, c in enumerate(codes[i:i + 8]))
            packed += [(word >> (8 * j)) & 255 for j in range(bits)]
        out_bytes.append(packed)
        scales.append(sc)
        zeros.append(ze)
        back.append(deq)
    shape = x.shape[:-1]
    return (np.array(out_bytes, dtype=np.uint8).reshape(*shape, -1),
            np.array(scales, dtype=np.float16).reshape(*shape, -1),
            np.array(zeros, dtype=np.float16).reshape(*shape, -1),
            np.array(back, dtype=np.float32).reshape(x.shape))


def ref_side(x, bits, group, axis, residual=0):
    """A whole side [..., T, n] as a cache holds it after all T tokens:
    (values as read back, bytes held with raw values at 2 bytes)."""
    x = np.asarray(x, dtype=np.float64)
    T, n = x.shape[-2:]
    if bits == 16 or T <= residual or axis == "channel" and T - residual < group:
        return x, x.size * 2
    if axis == "token":
        q = max(T - residual, 0)
        packed, sc, ze, deq = ref_quantize(x[..., :q, :], bits, group)
    else:
        q = max(T - residual, 0) // group * group
        blocks = x[..., :q, :].reshape(*x.shape[:-2], q // group, group, n)
        packed, sc, ze, deq = ref_quantize(np.swapaxes(blocks, -1, -2), bits, group)
        deq = np.swapaxes(deq, -1, -2).reshape(*x.shape[:-2], q, n)
    held = packed.size + 2 * sc.size + 2 * ze.size + x[..., q:, :].size * 2
    return np.concatenate([deq.astype(np.float64), x[..., q:, :]], -2), held


class Scheme(unittest.TestCase):
    def test_codes_scales_and_bytes_match_the_reference(self):
        rng = np.random.default_rng(0)
        for bits in (2, 3, 4, 8):
            for n, group in ((50, 32), (64, 32), (7, 3), (19, 5)):
                x = rng.standard_normal((3, 4, n)) * rng.uniform(0.1, 30, (3, 4, 1))
                packed, scale, zero = quantize(torch.from_numpy(x), bits, group)
                rp, rs, rz, rd = ref_quantize(x, bits, group)
                np.testing.assert_array_equal(packed.numpy(), rp, err_msg=f"{bits} {n}")
                np.testing.assert_array_equal(scale.numpy(), rs)
                np.testing.assert_array_equal(zero.numpy(), rz)
                back = dequantize(packed, scale, zero, bits, group, n, torch.float32)
                np.testing.assert_array_equal(back.numpy(), rd)
                self.assertEqual(packed.shape[-1], (n + 7) // 8 * bits)

    def test_constant_groups_and_values_float16_cannot_hold(self):
        x = torch.full((2, 9), 0.1, dtype=torch.float64)
        packed, scale, zero = quantize(x, 3, 4)
        self.assertTrue((scale == 0).all() and (packed == 0).all())
        back = dequantize(packed, scale, zero, 3, 4, 9, torch.float64)
        self.assertTrue((back == float(np.float16(0.1))).all())
        for bad in (float("nan"), float("inf"), 1e6):
            y = torch.zeros(2, 8)
            y[1, 3] = bad
            with self.assertRaises(KqsvdError):
                quantize(y, 4, 8)

    def test_a_store_holds_what_the_scheme_says_token_by_token(self):
        rng = np.random.default_rng(1)
        x = rng.standard_normal((1, 2, 75, 12))
        for axis in ("channel", "token"):
            for residual in (0, 5, 40):
                s = Store(4, 8, axis, residual)
                t = 0
                for step in (20, 1, 1, 13, 7, 1, 32):
                    got = s.append(torch.from_numpy(x[:, :, t:t + step]))
                    t += step
                    want, held = ref_side(x[:, :, :t], 4, 8, axis, residual)
                    np.testing.assert_array_equal(got.numpy(), want, err_msg=f"{axis} {t}")
                    self.assertEqual(s.nbytes(2), held)
                    self.assertEqual(len(s), t)

    def test_a_store_of_no_columns(self):
        """A slice of rank 0 (a zero head) holds its tokens at no cost, and
        reads, scores and weighs as empty: it raised ZeroDivisionError."""
        for make in (lambda: Store(4, 8, "token"), lambda: Store(4, 8, "channel"),
                     lambda: store([(0, 4), (0, 2)], 8, "token")):
            s = make()
            self.assertEqual(tuple(s.append(torch.randn(1, 2, 16, 0)).shape), (1, 2, 16, 0))
            self.assertEqual(tuple(s.append(torch.randn(1, 2, 1, 0)).shape), (1, 2, 17, 0))
            self.assertEqual((len(s), s.nbytes()), (17, 0))
            out = torch.zeros(1, 2, 1, 17)
            s.scores(torch.randn(1, 2, 1, 0), out)
            self.assertEqual(float(out.abs().max()), 0.0)
            self.assertEqual(tuple(s.weigh(torch.rand(1, 2, 1, 17)).shape), (1, 2, 1, 0))

    def test_hadamard_is_orthogonal_and_the_rotation_keeps_scores(self):
        for n in list(range(1, 20)) + [48, 64, 100]:
            H = hadamard(n)
            np.testing.assert_allclose((H @ H.T).numpy(), np.eye(n), atol=1e-14)
        A = torch.randn(3, 16, 12, dtype=torch.float64)
        B = torch.randn(3, 16, 12, dtype=torch.float64)
        ranks = [12, 5, 8]
        for j, r in enumerate(ranks):
            A[j, :, r:] = B[j, :, r:] = 0
        Ar, Br = rotate(A, ranks), rotate(B, ranks)
        torch.testing.assert_close(Ar @ Br.transpose(1, 2), A @ B.transpose(1, 2),
                                   rtol=0, atol=1e-13)
        self.assertGreater(float((Ar - A).abs().max()), 0.1)

    def test_bits_in_policies(self):
        self.assertEqual(split_bits("fixed:32@4"), ("fixed:32", (4, 4)))
        self.assertEqual(split_bits("budget:0.5@4/8"), ("budget:0.5", (4, 8)))
        self.assertEqual(split_bits("eps:0.1"), ("eps:0.1", None))
        for bad in ("fixed:32@5", "fixed:32@", "@4", "fixed:32@4/8/2", "fixed:32@x"):
            with self.assertRaises(UsageError, msg=bad):
                split_bits(bad)
        from kqsvd.formats.policy import QUALITY_TUNED, parse
        p = parse("kqsvd/stored@4/8", methods=True)
        self.assertEqual((p.method, p.base, p.bits, p.fitted), ("kqsvd", "stored", (4, 8), None))
        self.assertEqual(parse("kqsvd/stored").method, None)  # no METHOD/ unless asked
        p = parse("quality-tuned:0.5")
        self.assertEqual((p.fitted, p.fraction, p.bits), (QUALITY_TUNED, 0.5, None))
        for bad in ("quality-bits:0", "quality-budget:nan", "quality-tuned:1.5", "eps:0.1@7"):
            with self.assertRaises(UsageError, msg=bad):
                parse(bad)


class InTheModel(unittest.TestCase):
    """A tiny Llama in float64 (d = 16), whole windows through a cache that
    quantizes as they are written."""

    @classmethod
    def setUpClass(cls):
        cls.model = tiny_lm("llama", 97, seed=3, heads=4, kv_heads=2, hidden=64).double()
        cls.sd = {k: v.detach() for k, v in cls.model.state_dict().items()}
        torch.manual_seed(5)
        cls.ids = torch.randint(0, 97, (1, 45))

    def nll(self, **kw):
        with torch.no_grad():
            out = self.model(input_ids=self.ids, use_cache=True, **kw)
        logp = torch.log_softmax(out.logits[0, :-1].double(), -1)
        return -float(logp.gather(1, self.ids[0, 1:, None]).sum()), output_cache(out)

    def nll_with(self, proj):
        """nll() with proj installed, the model left as it was."""
        compress(self.model, proj)
        try:
            return self.nll()
        finally:
            compress(self.model, None)

    def reference(self, side):
        """The independent Llama whose attention quantizes each KV head's
        cached keys and values with side(l, j, keys or values, 'k'/'v')."""
        cfg = self.model.config
        H, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, 16
        g = H // hkv

        def attention(l, q, k, v, rot, mask):
            heads = []
            for j in range(hkv):
                kj, qk = side(l, j, rot(k[:, j * d:(j + 1) * d]), v[:, j * d:(j + 1) * d])
                for h in range(j * g, (j + 1) * g):
                    s = qk(rot(q[:, h * d:(h + 1) * d])) @ kj[0].T / np.sqrt(d)
                    heads.append(torch.softmax(s + mask, -1) @ kj[1])
            return torch.cat(heads, 1)
        return reference_llama_nll(self.sd, cfg, self.ids[0].numpy(), attention)

    def test_a_quantized_latent_cache_is_the_documented_scheme(self):
        proj = orthonormal_projections(self.model, 6, seed=2)
        L = proj.num_layers
        for rot in (False, True):
            for bits_k, bits_v in (([[4, 2]] * L, [[3, 3]] * L), ([[8, 8]] * L, [[16, 4]] * L)):
                scheme = QuantScheme(group=8, key_axis="channel", value_axis="token",
                                     residual=3, rotate=rot)
                p = with_bits(proj, (4, 4), scheme)
                p.bits_k[:], p.bits_v[:] = bits_k, bits_v
                got, cache = self.nll_with(p)
                held = [0]

                def side(l, j, k, v):
                    r = int(proj.rank_k_heads[l, j])
                    A, B = (torch.from_numpy(m[l][j][:, :r]) for m in (proj.key_down,
                                                                        proj.query_down))
                    Av, Bv = (torch.from_numpy(m[l][j][:, :r]) for m in (proj.value_down,
                                                                          proj.value_up))
                    if rot:
                        A, B, Av, Bv = (m @ hadamard(r) for m in (A, B, Av, Bv))
                    kc, nk = ref_side((k @ A).numpy(), bits_k[l][j], 8, "channel", 3)
                    vc, nv = ref_side((v @ Av).numpy(), bits_v[l][j], 8, "token", 3)
                    held[0] += nk + nv
                    return (torch.from_numpy(kc), torch.from_numpy(vc) @ Bv.T), lambda q: q @ B
                want = self.reference(side)
                self.assertAlmostEqual(got, want, delta=1e-9 * abs(want), msg=f"{rot} {bits_k}")
                self.assertEqual(cache_bytes(cache, 2, held=True), held[0])

    def test_per_column_bits_are_the_documented_scheme(self):
        """Bits per latent column, in no particular order: each head's
        columns of one number of bits (16: unquantized) are quantized as a
        latent of their own, here gathered and quantized independently."""
        proj = orthonormal_projections(self.model, 6, seed=4)
        L, H, d = proj.num_layers, proj.num_kv_heads, proj.head_dim
        cols_k = np.zeros((L, H, d), np.int64)
        cols_v = np.zeros((L, H, d), np.int64)
        cols_k[..., :6] = [[8, 4, 16, 2, 4, 3], [2, 2, 2, 2, 2, 2]]
        cols_v[..., :6] = [[4, 4, 4, 2, 2, 16], [3, 8, 3, 8, 3, 8]]
        for rot in (False, True):
            scheme = QuantScheme(group=8, residual=3, rotate=rot)
            p = with_bits(proj, (4, 4), scheme)
            p.bits_k, p.bits_v = cols_k, cols_v
            got, cache = self.nll_with(p)
            held = [0]

            def gathered(m, bits, r, x, axis):
                """x @ m's columns, run by run of equal bits (widest first)."""
                outs, mats = [], []
                for b in sorted(set(bits[:r].tolist()), reverse=True):
                    M = torch.from_numpy(m[:, [c for c in range(r) if bits[c] == b]])
                    if rot:
                        M = M @ hadamard(M.shape[1])
                    x_q, n = ref_side((x @ M).numpy(), b, 8, axis, 3)
                    held[0] += n
                    outs.append(torch.from_numpy(x_q))
                    mats.append(M)
                return torch.cat(outs, -1), torch.cat(mats, 1)

            def side(l, j, k, v):
                kc, A = gathered(proj.key_down[l][j], cols_k[l, j], 6, k, "channel")
                vc, Av = gathered(proj.value_down[l][j], cols_v[l, j], 6, v, "token")
                return (kc, vc @ Av.T), lambda q: q @ A  # B = A, B_v = A_v here
            want = self.reference(side)
            self.assertAlmostEqual(got, want, delta=1e-9 * abs(want), msg=f"rotate {rot}")
            self.assertEqual(cache_bytes(cache, 2, held=True), held[0])

    def test_per_column_bits_alike_are_the_units_bits_before_rope(self):
        """Keys before RoPE: the same bits in every column of a head give the
        cache of that head's one number of bits, to the last digit."""
        proj = orthonormal_projections(self.model, 5, rope="pre", seed=6)
        L, H, d = proj.num_layers, proj.num_kv_heads, proj.head_dim
        got = []
        for per_column in (False, True):
            p = with_bits(proj, (3, 4), QuantScheme(group=8, residual=2))
            if per_column:
                p.bits_k = np.where(np.arange(d) < 5, 3, 0) * np.ones((L, H, 1), np.int64)
                p.bits_v = np.where(np.arange(d) < 5, 4, 0) * np.ones((L, H, 1), np.int64)
            got.append(self.nll_with(p)[0])
        self.assertEqual(got[0], got[1])

    def test_the_plain_quantized_cache_is_the_documented_scheme(self):
        L = self.model.config.num_hidden_layers
        for bits in (4, 2):
            cache = QuantCache(L, QuantScheme(group=8, residual=2), (bits, bits))
            got, cache = self.nll(**cache_kw(cache))
            held = [0]

            def side(l, j, k, v):
                kc, nk = ref_side(k.numpy(), bits, 8, "channel", 2)
                vc, nv = ref_side(v.numpy(), bits, 8, "token", 2)
                held[0] += nk + nv
                return (torch.from_numpy(kc), torch.from_numpy(vc)), lambda q: q
            want = self.reference(side)
            self.assertAlmostEqual(got, want, delta=1e-9 * abs(want))
            self.assertEqual(cache_bytes(cache, 2, held=True), held[0])
            full = 2 * 2 * L * 2 * 45 * 16  # keys and values, bf16
            self.assertLess(held[0], full * (bits + 8) / 16)

    def test_a_quantized_cache_refuses_what_it_cannot_do(self):
        cache = QuantCache(2, QuantScheme(group=8), (4, 4))
        self.nll(**cache_kw(cache))
        with self.assertRaises(KqsvdError):
            cache.crop(10)



class BitsAndRanks(unittest.TestCase):
    def test_the_knapsack_is_optimal_where_it_spends_the_budget(self):
        import itertools
        rng = np.random.default_rng(4)
        for trial in range(30):
            U, n = 3, 5
            sizes = np.sort(rng.integers(1, 40, (U, n)), 1).astype(float)
            costs = np.sort(rng.uniform(0, 10, (U, n)), 1)[:, ::-1].copy()
            hulls = [hull(sizes[u], costs[u]) for u in range(U)]
            for u, h in enumerate(hulls):  # a convex, decreasing path from the smallest option
                self.assertEqual(h[0], int(np.argmin(sizes[u] + 1e-9 * costs[u])))
                self.assertTrue((np.diff(costs[u][h]) < 0).all())
            # Budgets at the breakpoints of the steepest-first path: there the
            # allocation is optimal over every choice of options (Lagrange).
            segs = sorted(((costs[u][h[k - 1]] - costs[u][h[k]]) /
                           (sizes[u][h[k]] - sizes[u][h[k - 1]]), sizes[u][h[k]] -
                           sizes[u][h[k - 1]]) for u, h in enumerate(hulls)
                          for k in range(1, len(h)))[::-1]
            budget = sum(sizes[u][h[0]] for u, h in enumerate(hulls))
            for _, ds in [(0, 0)] + segs:
                budget += ds
                pick = knapsack(sizes, costs, budget)
                used = sum(sizes[u][pick[u]] for u in range(U))
                self.assertLessEqual(used, budget + 1e-9)
                got = sum(costs[u][pick[u]] for u in range(U))
                best = min(sum(costs[u][c[u]] for u in range(U))
                           for c in itertools.product(range(n), repeat=U)
                           if sum(sizes[u][c[u]] for u in range(U)) <= budget + 1e-9)
                self.assertLessEqual(got, best + 1e-9, (trial, budget))
        with self.assertRaises(UsageError):
            knapsack(np.full((2, 3), 10.0), np.ones((2, 3)), 5)

    def test_option_bits_are_the_bytes_a_store_holds(self):
        for r, b, axis in ((12, 3, "token"), (40, 4, "token"), (7, 2, "channel"),
                           (33, 8, "channel"), (9, 16, "token")):
            s = Store(b, 8, axis)
            s.append(torch.randn(1, 1, 64, r))
            self.assertEqual(s.nbytes(2) * 8, 64 * option_bits(r, b, axis, 8), (r, b, axis))

    def test_per_column_bits_are_the_bytes_their_stores_hold(self):
        cols = np.array([8, 4, 16, 2, 4, 3, 2, 2, 2, 3, 0, 0])
        for axis in ("token", "channel"):
            runs = column_runs(cols, 10)
            self.assertEqual([(list(c), b) for c, b in runs],
                             [([2], 16), ([0], 8), ([1, 4], 4), ([5, 9], 3), ([3, 6, 7, 8], 2)])
            s = store([(len(c), b) for c, b in runs], 8, axis)
            s.append(torch.randn(1, 1, 64, 10))
            want = sum(option_bits(len(c), b, axis, 8) for c, b in runs)
            self.assertEqual(s.nbytes(2) * 8, 64 * want)
            self.assertEqual(unit_bits(cols, 10, axis, 8), want)
        with self.assertRaises(KqsvdError):
            column_runs(cols, 11)  # a column of the rank without bits

    def test_per_column_bits_in_the_projections_file(self):
        cal = Calibrated.get()
        wd = os.path.dirname(cal.proj)
        p = load_projections(cal.proj, "kqsvd", 5)
        L, H, d = p.num_layers, p.num_kv_heads, p.head_dim
        rk = np.full((L, H), 5)
        cols = np.zeros((L, H, d), np.int64)
        cols[..., :5] = [16, 8, 2, 4, 2]
        out = os.path.join(wd, "col-bits.h5")
        save_ranks(cal.proj, out, {"kqsvd": (rk, rk)}, "test", force=True,
                   bits={"kqsvd": (cols, cols)},
                   scheme=QuantScheme(group=16))
        q = load_projections(out, "kqsvd")
        self.assertTrue(np.array_equal(q.bits_k, cols))
        per = sum(option_bits(n, b, ax, 16) for ax in ("channel", "token")
                  for n, b in ((1, 16), (1, 8), (2, 2), (1, 4)))
        self.assertAlmostEqual(q.cache_kept(), per / (2 * 16 * d))
        with self.assertRaisesRegex(UsageError, "bits_k must be"):
            save_ranks(cal.proj, out, {"kqsvd": (rk, rk)}, "test", force=True,
                       bits={"kqsvd": (cols[..., ::-1].copy(), cols)}, scheme=QuantScheme())
        for name, value, words in (("kqsvd/bits_v_cols", 5, "must be"),
                                   ("kqsvd/bits_k_cols", 0, "which has rank 5")):
            with h5py.File(out, "r+") as f:
                keep = f[name][0, 0, 1]
                f[name][0, 0, 1] = value
            with self.assertRaisesRegex(KqsvdError, f"col-bits.h5: dataset '{name}'.*{words}"):
                load_projections(out, "kqsvd")
            with h5py.File(out, "r+") as f:
                f[name][0, 0, 1] = keep
        with h5py.File(out, "r+") as f:
            f["kqsvd/bits_v_heads"] = np.zeros((L, H), np.int32)
        with self.assertRaisesRegex(KqsvdError, "of one form"):
            load_projections(out, "kqsvd")

    def test_fitted_bits_in_the_projections_file(self):
        cal = Calibrated.get()
        wd = os.path.dirname(cal.proj)
        out = os.path.join(wd, "quant-bits.json")
        run([sys.executable, "-m", "kqsvd.quality", "--model", cal.model, "--text", TEXT,
             "--proj", cal.proj, "--ranks", "quality-bits:0.25,fixed:4", "--methods",
             "kqsvd", "--seq-len", "48", "--num-seqs", "2", "--calib-seqs", "2", "--json", out,
             "--force"])
        fitted = out[:-5] + ".quality-bits-0.25.h5"
        p = load_projections(fitted, "kqsvd")
        self.assertEqual(p.quant, QuantScheme())
        self.assertTrue(np.isin(p.bits_k, (2, 3, 4, 8, 16) if p.bits_k.ndim == 2 else
                                (0, 2, 3, 4, 8, 16)).all())
        self.assertLessEqual(p.cache_kept(), 0.25 + 1e-12)
        with open(out) as f:
            rows = {r["policy"]: r for r in json.load(f)["results"]}
        self.assertAlmostEqual(rows["quality-bits:0.25"]["cache_kept"], p.cache_kept())
        # the cache held codes and scales (a channel block's tail tokens as computed)
        self.assertLess(rows["quality-bits:0.25"]["cache_bytes"], rows["fixed:4"]["cache_bytes"]
                        * 4 * 0.25 * 2)
        # other ranks drop the bits; a bad bits dataset names itself
        self.assertIsNone(load_projections(fitted, "kqsvd", 4).quant)
        bad = os.path.join(wd, "bad-bits.h5")
        save_ranks(fitted, bad, {}, "x", force=True)
        with h5py.File(bad, "r+") as f:
            f["kqsvd/bits_v_heads"][0, 0] = 5
        with self.assertRaisesRegex(KqsvdError, "bad-bits.h5: dataset 'kqsvd/bits_v_heads'"):
            load_projections(bad, "kqsvd")


class QualityProtocol(unittest.TestCase):
    """The quality command's numbers for quantized latents (issue 40): no
    token reads a key block whose scales later tokens set, and the report's
    byte ratio is in one unit, bf16, whatever the dtype."""

    def test_a_quantized_window_reads_no_later_token(self):
        from kqsvd.compat import cache_kwarg
        from kqsvd.quality.measure import window_logprobs
        model = tiny_lm("llama", 97, seed=3, heads=4, kv_heads=2, hidden=64).double()
        key = cache_kwarg(model)
        torch.manual_seed(5)
        ids = torch.randint(0, 97, (1, 40))
        later = ids.clone()
        later[0, 20:] = torch.randint(0, 97, (20,))  # other tokens from position 20 on
        p = with_bits(orthonormal_projections(model, 6, seed=2), (4, 4), QuantScheme(group=16))
        with torch.no_grad():
            full = window_logprobs(model, ids, key)[0]
            np.testing.assert_allclose(window_logprobs(model, ids, key, stepwise=True)[0],
                                       full, atol=1e-10)  # the same model, step by step
            compress(model, p)
            try:
                a, ca = window_logprobs(model, ids, key, stepwise=True)
                b, _ = window_logprobs(model, later, key, stepwise=True)
                whole_a, cw = window_logprobs(model, ids, key)
                whole_b = window_logprobs(model, later, key)[0]
            finally:
                compress(model, None)
        # Tokens 0..19 predict 1..20: the same prefix gives the same numbers ...
        np.testing.assert_array_equal(a[:20].numpy(), b[:20].numpy())
        # ... where the whole-window pass lets tokens 16..19 read a key block
        # (16..31) that tokens from 20 on took part in quantizing.
        self.assertFalse(torch.equal(whole_a[16:20], whole_b[16:20]))
        np.testing.assert_array_equal(whole_a[:16].numpy(), whole_b[:16].numpy())
        # both end holding the same: two complete blocks, 8 tokens as computed
        self.assertEqual(cache_bytes(ca, 2, held=True), cache_bytes(cw, 2, held=True))

    def test_byte_ratio_in_bf16_in_both_dtypes(self):
        cal = Calibrated.get()
        wd = os.path.dirname(cal.proj)
        bits = os.path.join(wd, "protocol-bits.h5")
        L, H = 2, 2
        save_ranks(cal.proj, bits, {"kqsvd": (np.full((L, H), 8), np.full((L, H), 8))}, "test",
                   force=True, bits={"kqsvd": (np.full((L, H), 4), np.full((L, H), 4))},
                   scheme=QuantScheme())
        got = {}
        for dtype in ("float32", "float64"):
            out = os.path.join(wd, f"protocol-{dtype}.json")
            run([sys.executable, "-m", "kqsvd.quality", "--model", cal.model, "--text", TEXT,
                 "--proj", bits, "--ranks", "stored,fixed:4", "--methods", "kqsvd",
                 "--seq-len", "64", "--num-seqs", "2", "--dtype", dtype, "--json", out,
                 "--force"])
            with open(out) as f:
                got[dtype] = {r["policy"]: r for r in json.load(f)["results"]}
        for pol, r in got["float64"].items():
            # the bytes referenced, measured: in bf16 in either dtype ...
            self.assertEqual(got["float32"][pol]["cache_bytes_ratio"], r["cache_bytes_ratio"])
            # ... and 64 tokens, every key block of 32 complete: the formula's
            # bytes held, and the room the buffers keep, at most an eighth
            self.assertGreaterEqual(r["cache_bytes_ratio"], r["cache_kept"] - 1e-12, pol)
            self.assertLessEqual(r["cache_bytes_ratio"], r["cache_kept"] * 9 / 8, pol)
        self.assertLess(got["float64"]["test"]["cache_kept"], 0.25)


if __name__ == "__main__":
    unittest.main()
