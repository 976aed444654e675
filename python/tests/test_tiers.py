"""Token tiers (issue 49): the layout as policies write it, and the tiered
cache on a tiny Llama calibrated by the C tool, checked by its properties:
- a window that holds every token attends as the model does, and so does
  one tier holding every token at full rank, unquantized, keys after RoPE
  and before;
- a layout that drops every token outside the sinks and the window is the
  model attending to those alone (a mask in an independent Llama written
  here);
- the bytes held after the prefill are the sinks' and window's in bf16 and each
  tier's codes as docs/quantized-cache.md counts them, positions at 4
  bytes where keys are taken before RoPE;
- fold and probe are refused in one line (padded batches are served:
  test_cache_kinds)."""
import dataclasses
import math
import os
import unittest

import numpy as np
import torch

from common import TEXT, Calibrated, orthonormal_projections, reference_llama_logp, workdir

import kqsvd
from kqsvd import compressed, models
from kqsvd.errors import UsageError
from kqsvd.formats.policy import parse
from kqsvd.formats.projections import Projections
from kqsvd.formats.quant import QuantScheme, with_bits
from kqsvd.quality.configs import Config, Latent
from kqsvd.quality.frontier import continue_window
from kqsvd.quality.measure import resolve_policies

CTX, T = 80, 92


class Held(Latent):
    """A Latent whose bytes are those of the tokens it holds (the use,
    cache_bytes(held=True)): what the docs' formulas count; the memory
    referenced is at most an eighth above (test_cache_kinds)."""

    def nbytes(self, cache):
        return kqsvd.cache_bytes(cache, 2, held=True)


def tiered(cal, info, policy, scheme=None, path=None):
    [(_, _, p)] = resolve_policies(path or cal.proj, [policy], ["kqsvd"], info.num_layers, scheme)
    return p


class Layout(unittest.TestCase):
    def test_written_and_read(self):
        lay = parse("tiers:w128+s4+0.4xstored+0.3x48@2/4+0.3xdrop").tiers
        self.assertEqual((lay.window, lay.sinks, lay.scorer), (128, 4, "snap"))
        self.assertEqual([(t.fraction, t.code, t.ranks, t.bits) for t in lay.tiers],
                         [(0.4, "stored", None, None), (0.3, "48@2/4", 48, (2, 4)),
                          (0.3, "drop", None, None)])
        self.assertEqual(parse(lay.text()).tiers, lay)
        # cumulative fractions rounded: the counts always sum to the tokens
        for n in (0, 1, 7, 11, 1000):
            self.assertEqual(sum(lay.counts(n)), n)
        self.assertEqual(parse("tiers:w8+0.5x16+0.5xdrop").tiers.counts(11), [6, 5])
        for scorer in ("snapv", "expected"):
            lay = parse(f"tiers:w8+1xdrop+{scorer}").tiers
            self.assertEqual((lay.scorer, parse(lay.text()).tiers), (scorer, lay))

    def test_refused_in_one_line(self):
        for bad, says in (("tiers:w8", "at least one tier"), ("tiers:0.5xstored+0.5xdrop", "wN"),
                          ("tiers:w8+0.5xstored", "sum to 0.5"), ("tiers:w8+1x48@5", "48@5"),
                          ("tiers:w8+1xfoo", "'foo'"), ("tiers:w8+w9+1xdrop", "twice"),
                          ("tiers:w8+0x16+1xdrop", "(0, 1]"), ("tiers:w8+1xdrop+q", "'q'"),
                          ("tiers:w8+nanx16", "(0, 1]"), ("tiers:w-1+1xdrop", "'w-1'"),
                          # ASCII digits alone: int() refuses '²' after isdigit() took it
                          ("tiers:w²+1xdrop", "'w²'"), ("tiers:w8+1x³@4", "'³@4'"),
                          ("tiers:w8+1x٣", "'٣'"), ("tiers:w8+٠.٥x16+0.5xdrop", "(0, 1]"),
                          ("tiers:w8+1xdrop+snap+expected", "scorer given twice")):
            with self.assertRaises(UsageError) as e:
                parse(bad)
            self.assertIn(says, str(e.exception), bad)
            self.assertEqual(len(str(e.exception).splitlines()), 1)


class Cache(unittest.TestCase):
    CODES = ""  # KQSVD_DECODE of the path read as codes (test_triton_decode: triton)

    @classmethod
    def setUpClass(cls):
        cls.cal = Calibrated.get()
        cls.model, cls.tok, cls.info = models.load(cls.cal.model, dtype=torch.float64)
        cls.ids = torch.from_numpy(models.token_windows(cls.tok, TEXT, T, 1, "validation")[0])
        with torch.no_grad():
            cls.full = continue_window(cls.model, cls.ids, CTX, Config())[0]

    def window(self, policy, path=None, chunk=1, scheme=None):
        p = tiered(self.cal, self.info, policy, scheme, path)
        with torch.no_grad():
            return continue_window(self.model, self.ids, CTX, Held(policy, "kqsvd", p), chunk)

    def test_a_window_of_everything_is_the_model(self):
        for chunk in (1, 5):
            lp, first, _ = self.window(f"tiers:w{T}+1xdrop", chunk=chunk)
            # the model's eager attention takes its softmax in float32
            np.testing.assert_allclose(lp, self.full, atol=1e-6, rtol=0)
        d = self.info.head_dim
        self.assertEqual(first, 2 * 2 * self.info.num_layers * self.info.num_kv_heads * d * CTX)

    def test_one_tier_at_full_rank_is_the_model(self):
        d = self.info.head_dim
        for chunk in (1, 4):
            lp = self.window(f"tiers:w0+1x{d}", chunk=chunk)[0]
            np.testing.assert_allclose(lp, self.full, atol=1e-6, rtol=0)
        lp = self.window(f"tiers:w4+s1+0.5x{d}+0.5x{d}")[0]
        np.testing.assert_allclose(lp, self.full, atol=1e-6, rtol=0)
        # keys before RoPE, each brought back at its own position: any
        # orthonormal full-rank projections (A B^T = I) give the model
        for rope in ("pre", "post"):
            p = orthonormal_projections(self.model, d, rope)
            lay = parse(f"tiers:w3+s2+0.5x{d}+0.5x{d}").tiers
            p = dataclasses.replace(p, tiers=(lay, (p, p)))
            with torch.no_grad():
                lp = continue_window(self.model, self.ids, CTX, Latent("o", "kqsvd", p), 3)[0]
            np.testing.assert_allclose(lp, self.full, atol=1e-6, rtol=0, err_msg=rope)
        # a low rank is not
        self.assertGreater(float((self.window("tiers:w0+1x2")[0] - self.full).abs().max()), 1e-3)

    def test_dropping_is_attending_to_sinks_and_window_alone(self):
        S, W = 2, 8
        got = self.window(f"tiers:w{W}+s{S}+1xdrop")[0]
        ref = reference_llama_logp(self.model.state_dict(), self.model.config,
                                   self.ids[0].tolist(), _evicting(self.model.config, S, W))
        np.testing.assert_allclose(got, ref[CTX - 1:T - 1], atol=1e-6, rtol=0)
        self.assertGreater(float((got - self.full).abs().max()), 1e-3)

    def test_scorers_choose_other_tokens(self):
        """Each scorer keeps tokens of its own choosing: at one layout the
        three give three different caches, each scored as any layout."""
        got = [self.window(f"tiers:w8+s2+0.5x16+0.5xdrop+{s}")[0]
               for s in ("snap", "snapv", "expected")]
        for i in range(3):
            self.assertGreater(float((got[i] - got[i - 1]).abs().max()), 1e-6)
            self.assertGreater(float((got[i] - self.full).abs().max()), 1e-6)

    def test_bytes_after_the_prefill(self):
        L, H, d = self.info.num_layers, self.info.num_kv_heads, self.info.head_dim
        scheme = QuantScheme(group=16)
        _, first, _ = self.window("tiers:w8+s2+0.5x8@4+0.5xdrop", scheme=scheme)
        n = (CTX - 10) // 2                          # the first tier's tokens: 35
        q = n // 16 * 16                             # keys per channel: whole blocks of 16
        keys = 8 * (q // 16) * ((16 + 7) // 8 * 4 + 4) + (n - q) * 8 * 2
        values = n * ((8 + 7) // 8 * 4 + 4)
        full = 10 * 2 * d * 2
        self.assertEqual(first, L * H * (keys + values + full))

    def test_codes_read_as_the_floats(self):
        """A quantized tier of keys after RoPE is read through the decode
        kernels (float32, on the CPU) as its dequantized floats are, per
        KV head and with ranks per head, one token or a chunk at a time."""
        from kqsvd.attention import kernel
        if not kernel.available(torch.zeros(1)):
            self.skipTest("libkqsvd's decode kernels are not there")
        model = models.load(self.cal.model, dtype=torch.float32)[0]
        ids = self.ids
        ragged = {"kqsvd": (np.array([[6, 4], [5, 8]]), np.array([[8, 3], [4, 6]]))}
        from kqsvd.formats.saving import save_ranks
        wd = workdir("tiers-codes")
        heads = os.path.join(wd, "heads.h5")
        save_ranks(self.cal.proj, heads, ragged, "test", force=True)
        for path, pol in ((None, "tiers:w4+s1+0.6x8@4/2+0.4x4@3"),
                          (heads, "tiers:w4+0.5xstored+0.5x8@2"),
                          (None, "tiers:w0+1x8@8")):
            p = tiered(self.cal, self.info, pol, QuantScheme(group=8), path)
            got, before = [], os.environ.get("KQSVD_DECODE")
            for env in (self.CODES, "torch"):
                os.environ["KQSVD_DECODE"] = env
                kernel._LIB.clear()
                with torch.no_grad():
                    got.append(continue_window(model, ids, CTX, Latent(pol, "kqsvd", p), 3)[0])
            os.environ.pop("KQSVD_DECODE")
            if before is not None:
                os.environ["KQSVD_DECODE"] = before
            kernel._LIB.clear()
            np.testing.assert_allclose(got[0], got[1], atol=2e-4, rtol=0, err_msg=pol)

    def test_refusals(self):
        p = tiered(self.cal, self.info, "tiers:w8+1xdrop")
        for kw in (dict(fold=True), dict(probe=True)):
            with self.assertRaises(UsageError) as e:
                with compressed(self.model, p, **kw):
                    pass
            self.assertIn("tiered", str(e.exception))


class Independent(unittest.TestCase):
    """One tiered configuration reproduced from the docs alone
    (docs/formats.md 5.4.1, docs/quantized-cache.md section 1) by a Llama
    written here: keys before RoPE, 2 sinks, a window of 8, half the
    other tokens at rank 8 with 4-bit keys per channel and 2-bit values
    per token (groups of 16), half dropped, continued token by token."""
    S, W, R, BK, BV, G = 2, 8, 8, 4, 2, 16

    @classmethod
    def setUpClass(cls):
        cal = Calibrated.get()
        cls.model, tok, cls.info = models.load(cal.model, dtype=torch.float64)
        cls.ids = torch.from_numpy(models.token_windows(tok, TEXT, T, 1, "validation")[0])
        cfg = cls.model.config
        L, hkv = cfg.num_hidden_layers, cfg.num_key_value_heads
        d = cfg.hidden_size // cfg.num_attention_heads
        rng = np.random.default_rng(7)
        cls.mats = [[rng.standard_normal((hkv, d, cls.R)) / d ** 0.5 for _ in range(L)]
                    for _ in range(4)]                              # A, B, A_v, B_v
        ranks = np.full(L, cls.R)
        p = Projections(path="random", method="kqsvd", policy="random", model="tiny",
                        num_layers=L, num_heads=cfg.num_attention_heads, num_kv_heads=hkv,
                        head_dim=d, hidden_size=cfg.hidden_size, rank_k=ranks,
                        rank_v=ranks.copy(), key_down=cls.mats[0], query_down=cls.mats[1],
                        value_down=cls.mats[2], value_up=cls.mats[3],
                        rank_k_heads=np.repeat(ranks[:, None], hkv, 1),
                        rank_v_heads=np.repeat(ranks[:, None], hkv, 1), rope="pre")
        lay = parse(f"tiers:w{cls.W}+s{cls.S}+0.5x{cls.R}@{cls.BK}/{cls.BV}+0.5xdrop").tiers
        tier = with_bits(p, (cls.BK, cls.BV), QuantScheme(group=cls.G))
        cls.proj = dataclasses.replace(p, tiers=(lay, (tier, None)))
        with torch.no_grad():
            cls.got, cls.first, cls.last = continue_window(
                cls.model, cls.ids, CTX, Held("t", "kqsvd", cls.proj))

    def test_log_probabilities(self):
        """The model run once over the whole window with the attention
        written here: the cache's arithmetic is all that differs."""
        from transformers import AttentionInterface
        from kqsvd.compat import restore_attention, switch_attention
        AttentionInterface.register("tiers_reference", self.attention)
        saved = switch_attention(self.model.config, "tiers_reference")
        try:
            with torch.no_grad():
                logits = self.model(input_ids=self.ids, use_cache=False).logits[0].double()
        finally:
            restore_attention(saved)
        ref = torch.log_softmax(logits, -1)
        np.testing.assert_allclose(self.got, ref[CTX - 1:T - 1], atol=1e-9, rtol=0)

    def test_bytes(self):
        cfg = self.model.config
        L, hkv = cfg.num_hidden_layers, cfg.num_key_value_heads
        d = cfg.hidden_size // cfg.num_attention_heads

        def held(n1):  # one layer: sinks and window in bf16, the tier's codes, positions
            q = n1 // self.G * self.G
            keys = self.R * (q // self.G) * (self.G // 8 * self.BK + 4) + (n1 - q) * self.R * 2
            values = n1 * ((self.R + 7) // 8 * self.BV + 4)
            return hkv * ((self.S + self.W) * 2 * d * 2 + keys + values) + \
                4 * (n1 + self.S + self.W)  # every token's position: int32
        middle = CTX - self.S - self.W
        self.assertEqual(self.first, L * held(middle // 2))
        # the last step fed token T - 2: T - 1 - CTX tokens left the window
        self.assertEqual(self.last, L * held(middle // 2 + T - 1 - CTX))

    def attention(self, module, query, key, value, mask, dropout=0.0, scaling=None, **kw):
        """A layer's attention at every position at once (the model's
        queries, keys after RoPE and values): the prefill's exact, then each
        continuation step over what the cache holds."""
        cfg = self.model.config
        hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
        d, rep = cfg.hidden_size // hq, hq // hkv
        A, B, Av, Bv = (torch.from_numpy(m[module.layer_idx]) for m in self.mats)
        cos, sin = (x[0] for x in self.model.model.rotary_emb(value, torch.arange(T)[None]))
        half = lambda u: torch.cat([-u[:, d // 2:], u[:, :d // 2]], 1)  # noqa: E731
        rot = lambda u, j: u * cos[j] + half(u) * sin[j]  # noqa: E731
        # RoPE undone: the inverse of the 2 x 2 rotations, over cos^2 + sin^2
        unrot = lambda u: (u * cos - half(u) * sin) / (cos * cos + sin * sin)  # noqa: E731
        Q, K, V = query[0], key[0], value[0]
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        out = torch.zeros(T, hq, d, dtype=torch.float64)
        share = torch.zeros(CTX, dtype=torch.float64)
        for h in range(hq):  # the prefill: exact, causal; its last 64 queries score the tokens
            s = (Q[h][:CTX] @ K[h // rep][:CTX].T * scaling).masked_fill(~causal[:CTX, :CTX],
                                                                           -math.inf)
            out[:CTX, h] = torch.softmax(s, -1) @ V[h // rep][:CTX]
            share += torch.softmax(s[CTX - 64:], -1).sum(0)
        pooled = torch.stack([share[max(0, j - 2):j + 3].mean() for j in range(CTX)])
        middle = list(range(self.S, CTX - self.W))
        ranked = sorted(middle, key=lambda j: -float(pooled[j]))  # stable: ties by position
        # the tier's tokens, in the order they entered it
        tier = sorted(ranked[:len(middle) // 2]) + list(range(CTX - self.W, T - self.W))
        for g in range(hkv):
            lat, lat_v = unrot(K[g]) @ A[g], V[g] @ Av[g]
            deq_v = _dequantized(lat_v, self.BV, self.G)     # values: per token
            blocks = {}                                      # keys: per channel, blocks of G
            for i in range(0, len(tier) - self.G + 1, self.G):
                rows = tier[i:i + self.G]
                blocks.update(zip(rows, _dequantized(lat[rows].T, self.BK, self.G).T))
            for t in range(CTX, T):
                n1 = len(middle) // 2 + t - CTX + 1  # token t - W has just left the window
                coded = set(tier[:n1 // self.G * self.G])
                keys = [K[g][j] for j in range(self.S)]
                values = [V[g][j] for j in range(self.S)]
                for j in tier[:n1]:
                    x = blocks[j] if j in coded else lat[j]
                    keys.append(rot((x @ B[g].T)[None], j)[0])
                    values.append(deq_v[j] @ Bv[g].T)
                keys += [K[g][j] for j in range(t - self.W + 1, t + 1)]
                values += [V[g][j] for j in range(t - self.W + 1, t + 1)]
                keys, values = torch.stack(keys), torch.stack(values)
                for h in range(g * rep, (g + 1) * rep):
                    out[t, h] = torch.softmax(Q[h][t] @ keys.T * scaling, -1) @ values
        return out[None], None


def _dequantized(rows, bits, group):
    """Each row of values (float64 [n, m]) quantized in groups of `group`
    and brought back, as docs/quantized-cache.md section 1 says: float32,
    float16 zero and scale, round half to even, clamp, code x scale + zero
    in float32."""
    x = rows.float()
    out = torch.empty_like(x)
    top = 2 ** bits - 1
    for a in range(0, x.shape[1], group):
        part = x[:, a:a + group]
        lo, hi = part.min(1).values, part.max(1).values
        zero, scale = lo.half().float(), ((hi - lo) / top).half().float()
        code = torch.where(scale[:, None] > 0,
                           torch.round((part - zero[:, None]) / torch.where(
                               scale > 0, scale, 1.0)[:, None]).clamp(0, top), 0.0)
        out[:, a:a + group] = code * scale[:, None] + zero[:, None]
    return out.double()

class Fitted(unittest.TestCase):
    def test_quality_tiers(self):
        """quality-tiers:F writes a file whose stored policy is the layout it
        chose, holding at most F of the bf16 bytes after the prefill, scored
        on the windows' last tokens; the frontier reads it as stored."""
        import json
        import subprocess
        import sys
        import h5py
        cal = Calibrated.get()
        wd = workdir("tiers-fit")
        out = os.path.join(wd, "q.json")
        p = subprocess.run([sys.executable, "-m", "kqsvd.quality", "--model", cal.model,
                            "--text", TEXT, "--proj", cal.proj, "--ranks", "quality-tiers:0.3",
                            "--methods", "kqsvd", "--seq-len", "160", "--num-seqs", "1",
                            "--calib-seqs", "1", "--json", out], capture_output=True, text=True)
        self.assertEqual(p.returncode, 0, p.stderr)
        fitted = os.path.join(wd, "q.quality-tiers-0.3.h5")
        with h5py.File(fitted, "r") as f:
            text = f["kqsvd"].attrs["tiers"]
        lay = parse(text).tiers
        self.assertIn(lay.window, (16, 32, 64, 128))
        with open(out) as f:
            r = json.load(f)["results"][0]
        self.assertEqual((r["scored"], r["tokens_scored"]), ("tail", 20))
        self.assertEqual(r["cache_kept"], r["cache_bytes_ratio"])  # the bytes, not the ranks
        self.assertLess(r["cache_kept"], 0.35)
        self.assertIn("KL", p.stderr)                   # each candidate said with its KL
        info = models.load(cal.model, dtype=torch.float64)[2]
        proj = kqsvd.load_projections(fitted, "kqsvd")
        self.assertEqual(proj.tiers[0], lay)
        ids = torch.from_numpy(models.token_windows(models.load(cal.model)[1], TEXT, 160, 1,
                                                    "train")[0])
        model = models.load(cal.model, dtype=torch.float64)[0]
        with torch.no_grad():
            _, first, _ = continue_window(model, ids, 140, Latent("s", "kqsvd", proj), 8)
        full = 2 * 2 * info.num_layers * info.num_kv_heads * info.head_dim * 140
        self.assertLessEqual(first, 0.3 * full)
        self.assertGreater(first, 0.2 * full)


def _evicting(cfg, S, W):
    """The reference's attention for a cache that keeps the first S tokens
    and the newest W (the current one among them) after the prefill of
    CTX tokens, fed one token at a time: the prefill's queries attend to
    every earlier token, written here with its own GQA."""
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = cfg.hidden_size // hq
    allowed = torch.ones(T, T, dtype=torch.bool).tril()
    for t in range(CTX, T):
        allowed[t, S:t - W + 1] = False
    bias = torch.zeros(T, T, dtype=torch.float64).masked_fill(~allowed, float("-inf"))

    def attention(l, q, k, v, rot, mask):
        out = torch.zeros(T, hq * d, dtype=torch.float64)
        for h in range(hq):
            g = h // (hq // hkv)
            qh, kh = rot(q[:, h * d:(h + 1) * d]), rot(k[:, g * d:(g + 1) * d])
            w = torch.softmax(qh @ kh.T / d ** 0.5 + bias, -1)
            out[:, h * d:(h + 1) * d] = w @ v[:, g * d:(g + 1) * d]
        return out
    return attention


if __name__ == "__main__":
    unittest.main()
