"""python -m kqsvd.frontier on a tiny Llama calibrated by the C tool: the
protocol (prefill, then the continuation token by token with explicit
positions) scores the full model as one whole-window pass does; every
configuration's bytes are what its cache holds, checked by formula; the
peers (a kvpress press, transformers' QuantizedCache) run and leave the
model as they found it; the fronts are what they claim; and bad options
are one line and exit 2, with no output written."""
import json
import os
import subprocess
import sys
import unittest

import numpy as np
import torch

from common import ROOT, TEXT, Calibrated, cache_kw, tiny_lm, workdir

import kqsvd
from kqsvd import models
from kqsvd.attention.quant import room
from kqsvd.formats.saving import save_ranks
from kqsvd.formats.quant import QuantScheme
from kqsvd.quality.frontier import continue_window, pareto
from kqsvd.quality.configs import Config
from kqsvd.quality.peers import PressPeer

PY = [sys.executable, "-m", "kqsvd.frontier"]
CTX, CONT, N = 80, 12, 2


def side_bytes(L, H, T, n, bits, axis, res=0):
    """One side's bytes by section 1 of docs/quantized-cache.md, group 16:
    T tokens of n columns taken at once, the newest res (and, per channel,
    those of a block not complete) held at 2 bytes, the codes' buffers
    with the room they keep (at most an eighth)."""
    q = (T - res) // 16 * 16 if axis == "channel" else T - res
    units = q // 16 if axis == "channel" else q
    units += room(0, units, 16 if axis == "channel" else 1)
    rows = n * units if axis == "channel" else units
    width = 16 if axis == "channel" else n
    return L * H * (rows * ((width + 7) // 8 * bits + 4 * -(-width // 16)) + (T - q) * n * 2)


def frontier(*args, expect=0):
    p = subprocess.run(PY + list(args), capture_output=True, text=True)
    if p.returncode != expect:
        raise AssertionError(f"exit {p.returncode}, expected {expect}\n{p.stdout}\n{p.stderr}")
    return p


class Frontier(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.cal = Calibrated.get()
        cls.wd = workdir("frontier")
        cls.out = os.path.join(cls.wd, "f.json")
        # a file with bits of its own (as quality-bits:F writes them)
        cls.bits = os.path.join(cls.wd, "bits.h5")
        L, H = 2, 2
        save_ranks(cls.cal.proj, cls.bits, {"kqsvd": (np.full((L, H), 6), np.full((L, H), 6))},
                   "test", force=True, bits={"kqsvd": (np.full((L, H), 3), np.full((L, H), 8))},
                   scheme=QuantScheme(group=16))
        cls.p = frontier(
            "--model", cls.cal.model, "--text", TEXT, "--proj", cls.cal.proj,
            "--proj", cls.bits + "=kqsvd/stored",
            "--ranks", "fixed:8@4,fixed:4@2/8", "--methods", "kqsvd,ksvd",
            "--plain", "4", "--quantized-cache", "quanto:4", "--presses", "snapkv",
            "--press-kept", "0.5", "--press-quantized", "quanto:4,quanto:2",
            "--press-bytes", "0.25,0.2", "--group", "16", "--context", str(CTX),
            "--continuation", str(CONT), "--num-seqs", str(N), "--dtype", "float64",
            "--json", cls.out, "--plot", os.path.join(cls.wd, "f.png"))
        with open(cls.out) as f:
            cls.report = json.load(f)
        cls.by = {r["label"]: r for r in cls.report["results"]}
        cls.model, cls.tok, cls.info = models.load(cls.cal.model, dtype=torch.float64)
        cls.seqs = models.token_windows(cls.tok, TEXT, CTX + CONT, N, "validation")[0]

    def test_warns_of_windows_longer_than_calibrated(self):
        # both files hold the 64-token windows they were calibrated on
        for path in (self.cal.proj, self.bits):
            self.assertIn(f"warning: {path} was calibrated on windows of 64 tokens, shorter than "
                          f"the {CTX + CONT} scored here", self.p.stderr)

    def test_the_protocol_scores_the_full_model_as_one_pass(self):
        nll = 0.0
        with torch.no_grad():
            for row in self.seqs:
                ids = torch.from_numpy(row[None])
                logp = torch.log_softmax(self.model(input_ids=ids).logits[0].double(), -1)
                nll -= float(logp[CTX - 1:-1].gather(1, ids[0, CTX:, None]).sum())
                step, _, _ = continue_window(self.model, ids, CTX, Config())
                np.testing.assert_allclose(step.numpy(), logp[CTX - 1:-1].numpy(), atol=1e-9)
        self.assertAlmostEqual(self.report["full"]["nll"], nll / (N * CONT), delta=1e-9)
        self.assertEqual(set(self.by), {"kqsvd fixed:8@4 [proj]", "ksvd fixed:8@4 [proj]",
                                        "kqsvd fixed:4@2/8 [proj]", "ksvd fixed:4@2/8 [proj]",
                                        "kqsvd stored [bits]", "int4", "quanto-int4",
                                        "snapkv:0.5", "snapkv:0.666667 over quanto-int4",
                                        "snapkv:0.533333 over quanto-int4",
                                        "snapkv:0.8 over quanto-int2"})

    def test_each_window_pools_to_the_report(self):
        """The per-window figures (the spread the table prints) average to
        the pooled ones: every window scores the same number of tokens, and
        the full model's window run alone (above) is its window's value."""
        full = self.report["full"]
        self.assertEqual(len(full["perplexity_windows"]), N)
        self.assertAlmostEqual(np.mean(np.log(full["perplexity_windows"])), full["nll"], delta=1e-12)
        for r in self.report["results"]:
            self.assertEqual(len(r["ratio_windows"]), N, r["label"])
            self.assertAlmostEqual(np.mean(np.log(r["perplexity_windows"])), r["nll"], delta=1e-12)
            self.assertAlmostEqual(np.mean(r["kl_windows"]), r["kl"], delta=1e-12)
            np.testing.assert_allclose(r["ratio_windows"], np.array(r["perplexity_windows"]) /
                                       np.array(full["perplexity_windows"]), rtol=1e-12)
        self.assertRegex(self.p.stdout, r"int4 .*x +\d\.\d{3}-\d\.\d{3} ")
        # the units cover every scored token, and pool to each nll
        self.assertEqual(sum(full["unit_tokens"]), N * (CONT))
        self.assertAlmostEqual(sum(full["unit_nll"]) / sum(full["unit_tokens"]), full["nll"],
                               delta=1e-12)
        peers = [r for r in self.report["results"] if r["family"].split()[0] not in
                 ("kqsvd", "ksvd", "eigen")]
        for r in self.report["results"]:
            self.assertAlmostEqual(sum(r["unit_nll"]) / sum(full["unit_tokens"]), r["nll"],
                                   delta=1e-12)
            lo, hi = r["ratio_interval"]
            self.assertLessEqual(lo, r["perplexity"] / full["perplexity"] * (1 + 1e-12))
            self.assertGreaterEqual(hi, r["perplexity"] / full["perplexity"] * (1 - 1e-12))
            if r in peers:
                self.assertNotIn("against_peer", r)
                continue
            near = [p for p in peers if abs(p["kept"] - r["kept"]) <= 0.1 * r["kept"]]
            p = r["against_peer"]
            if not near:
                self.assertIsNone(p, r["label"])
                continue
            best = min(near, key=lambda p: p["perplexity"])
            self.assertEqual(p["label"], best["label"])
            self.assertAlmostEqual(p["ratio"], r["perplexity"] / best["perplexity"], delta=1e-9)
            self.assertLessEqual(p["low"], p["ratio"] * (1 + 1e-12))

    def test_bytes_are_what_each_cache_holds(self):
        L, H, d = self.info.num_layers, self.info.num_kv_heads, self.info.head_dim
        full = 2 * 2 * L * H * d  # bytes per token, keys and values in bf16
        self.assertEqual(self.report["full"]["bytes_context"], full * CTX)
        self.assertEqual(self.report["full"]["bytes_end"], full * (CTX + CONT - 1))

        def side(T, n, bits, axis):
            return side_bytes(L, H, T, n, bits, axis)
        for label, r, bk, bv in (("int4", d, 4, 4), ("kqsvd fixed:8@4 [proj]", 8, 4, 4),
                                 ("kqsvd fixed:4@2/8 [proj]", 4, 2, 8),
                                 ("kqsvd stored [bits]", 6, 3, 8)):
            got = self.by[label]
            self.assertEqual(got["bytes_context"], side(CTX, r, bk, "channel") +
                             side(CTX, r, bv, "token"), label)
            self.assertAlmostEqual(got["kept"], got["bytes_context"] / (full * CTX))
        self.assertEqual(self.by["snapkv:0.5"]["bytes_context"], full * CTX // 2)
        q4 = self.by["quanto-int4"]["bytes_context"]
        self.assertEqual(q4, 2 * L * H * CTX * d * (4 / 8 + 4 / 16))
        # snapkv over quanto int4 (0.375 of bf16's bytes with group 16) at a
        # quarter and a fifth keeps 2/3 and 8/15 of the context, as kvpress
        # rounds it (down); int2 (0.25) cannot hold a quarter with fewer tokens
        for f, label in ((0.25, "snapkv:0.666667 over quanto-int4"),
                         (0.2, "snapkv:0.533333 over quanto-int4"),
                         (0.2, "snapkv:0.8 over quanto-int2")):
            bits = 4 if "int4" in label else 2
            kept = int(CTX * f / ((bits / 8 + 4 / 16) / 2) + 1e-9)
            self.assertEqual(self.by[label]["bytes_context"],
                             2 * L * H * kept * d * (bits / 8 + 4 / 16), label)
            self.assertAlmostEqual(self.by[label]["kept"], f, delta=2 / CTX)
        self.assertFalse([x for x in self.by if x.endswith("over quanto-int2") and ":1" in x])
        self.assertIn("--press-bytes 0.25 over quanto-int2", self.p.stderr)

    def test_kivi_window_on_a_stored_file(self):
        """--residual replaces a file's stored residual: its newest tokens
        held as they came, the rest quantized as before."""
        out = os.path.join(self.wd, "kivi.json")
        frontier("--model", self.cal.model, "--text", TEXT, "--proj", self.bits + "=kqsvd/stored",
                 "--plain", "none", "--quantized-cache", "none", "--presses", "none",
                 "--residual", "24", "--context", str(CTX), "--continuation", str(CONT),
                 "--num-seqs", "1", "--json", out)
        with open(out) as f:
            got = json.load(f)["results"][0]["bytes_context"]
        L, H = self.info.num_layers, self.info.num_kv_heads
        self.assertEqual(got, side_bytes(L, H, CTX, 6, 3, "channel", 24) +
                         side_bytes(L, H, CTX, 6, 8, "token", 24))
        self.assertNotEqual(got, side_bytes(L, H, CTX, 6, 3, "channel") +
                            side_bytes(L, H, CTX, 6, 8, "token"))

    def test_quality_is_ordered_as_the_bytes_say(self):
        r = self.by
        for label, res in r.items():
            self.assertGreaterEqual(res["kl"], 0, label)
            self.assertTrue(0 <= res["top1"] <= 1)
        # fewer bits on the same rank cannot be closer to the full model here
        self.assertLess(r["kqsvd fixed:8@4 [proj]"]["kl"], r["kqsvd fixed:4@2/8 [proj]"]["kl"])
        self.assertTrue(os.path.getsize(os.path.join(self.wd, "f.png")) > 0)

    def test_fronts(self):
        pts = [(0.5, 3.0), (0.25, 4.0), (0.25, 3.5), (0.6, 2.0), (0.7, 2.5), (0.1, 9.0)]
        self.assertEqual(pareto(pts), [0, 2, 3, 5])
        res = self.report["results"]
        for key, front in (("perplexity", "front"), ("kl", "front_kl")):
            on = [x for x in res if x[front]]
            self.assertTrue(on)
            for x in res:
                beaten = any(y["kept"] <= x["kept"] and y[key] < x[key] for y in res
                             if y is not x)
                self.assertEqual(x[front], not beaten, x["label"])

    def test_a_latent_after_a_press(self):
        """kvpress wraps every registered attention function when imported,
        kqsvd's too, and calls it with dropout by position: a latent
        window after a press computes as before it."""
        import kqsvd.attention.function  # noqa: F401  (registered before kvpress wraps it)
        from kqsvd.formats.projections import load_projections
        from kqsvd.quality.configs import Latent
        latent = Latent("fixed:8", "kqsvd", load_projections(self.cal.proj, "kqsvd", 8))
        ids = torch.from_numpy(self.seqs[:1])
        with torch.no_grad():
            before = continue_window(self.model, ids, CTX, latent)[0]
            continue_window(self.model, ids, CTX, PressPeer("knorm", 0.5, CTX))
            after = continue_window(self.model, ids, CTX, latent)[0]
        self.assertTrue(torch.equal(before, after))

    def test_a_press_leaves_the_model_as_it_found_it(self):
        attns = [lay.self_attn for lay in self.model.model.layers]
        before = [set(a._modules) | set(a.__dict__) for a in attns]
        impl = self.model.config._attn_implementation
        ids = torch.from_numpy(self.seqs[:1])
        with torch.no_grad():
            continue_window(self.model, ids, CTX, PressPeer("knorm", 0.5, CTX))
        self.assertEqual([set(a._modules) | set(a.__dict__) for a in attns], before)
        self.assertEqual(self.model.config._attn_implementation, impl)

    def test_decode_figures_beside_quality(self):
        """A report with decode figures (bench/decode_speed.py --annotate)
        shows each configuration's rate against the full cache in its
        table and beside its points; one without shows none."""
        import contextlib
        import io
        from kqsvd.commands.frontier import plot, table
        rep = json.loads(json.dumps(self.report))
        first, second = rep["results"][:2]
        fig = dict(context=CTX, batch=1, decode_tok_s=5.0, decode_range=[4.9, 5.1],
                   against_full=0.5, prefill_s=1.0, peak_above_model_mb=10.0)
        rep["decode_full"] = [dict(fig, decode_tok_s=10.0, against_full=1.0)]
        first["decode"] = [fig]
        for r, want in ((rep, True), (self.report, False)):
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                table(r)
            lines = out.getvalue().splitlines()
            self.assertEqual("decode" in lines[1], want)
            row = next(x for x in lines if x.startswith(first["label"] + " "))
            self.assertEqual("0.50x" in row, want, row)
            if want:
                other = next(x for x in lines if x.startswith(second["label"] + " "))
                self.assertNotIn("0.50x", other)
        png = os.path.join(self.wd, "decode.png")
        plot(rep)(png)
        self.assertGreater(os.path.getsize(png), 1000)

    def test_decode_speed_counts_a_quantized_caches_codes(self):
        """bench/decode_speed.py runs QuantizedCache and a press over it as
        the frontier does, and its cache column holds their codes (int4 in
        groups of 32: 0.3125 of bf16; the composite at an eighth keeps 40%
        of the prompt at that), not the nothing cache_bytes sees of them."""
        rows = {}
        for spec in ("full", "quanto:4", "composite:snapkv:quanto:4:0.125"):
            p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "decode_speed.py"),
                                "--one", spec, "128", "1", "--steps", "2", "--repeats", "1",
                                "--threads", "1"], capture_output=True, text=True, timeout=600)
            self.assertEqual(p.returncode, 0, p.stderr)
            rows[spec] = json.loads(p.stdout.strip().splitlines()[-1])
            self.assertGreater(rows[spec]["decode_tok_s"], 0)
        full = rows["full"]["cache_bytes"]
        self.assertEqual(full, 30 * 2 * 3 * 64 * (128 + 1) * 2)  # SmolLM2, bf16
        self.assertAlmostEqual(rows["quanto:4"]["cache_bytes"] / full, 0.3125, delta=0.01)
        self.assertAlmostEqual(rows["composite:snapkv:quanto:4:0.125"]["cache_bytes"] / full,
                               0.125, delta=0.01)

    def test_bad_options(self):
        base = ["--model", self.cal.model, "--text", TEXT, "--json",
                os.path.join(self.wd, "bad.json"), "--presses", "none"]
        for extra, says in ((["--plain", "5"], "--plain"),
                            (["--proj", self.cal.proj, "--ranks", "fixed:8@5"], "fixed:8@5"),
                            (["--ranks", "fixed:8@4"], "--proj"),
                            (["--plain", "none", "--quantized-cache", "none"],
                             "nothing to compare"),
                            (["--presses", "snapkv", "--context", "40"], "--context 40"),
                            (["--presses", "nosuch"], "nosuch"),
                            (["--quantized-cache", "quanto:3"], "quanto:3"),
                            (["--press-kept", "1.5", "--presses", "knorm"], "1.5"),
                            (["--group", "0"], "--group"),
                            (["--proj", self.cal.proj, "--ranks", "quality-budget:0.5"],
                             "quality-budget"),
                            (["--json", TEXT], "--json")):
            p = frontier(*(base + extra), expect=2)
            self.assertEqual(len(p.stderr.strip().splitlines()), 1, p.stderr)
            self.assertIn(says, p.stderr)
            self.assertNotIn("Traceback", p.stderr)
        self.assertFalse(os.path.exists(os.path.join(self.wd, "bad.json")))
        p = frontier(*base, "--proj", os.path.join(self.wd, "missing.h5"), "--ranks", "fixed:8",
                     expect=1)
        self.assertIn("missing.h5", p.stderr)


class QuantizedCacheHeld(unittest.TestCase):
    """kqsvd.cache_bytes(cache, 2, held=True) of transformers' QuantizedCache
    (quanto) is the bytes of the tokens it holds, counted here as its
    update keeps them: the prefill quantized; each later token held as it
    came until the residual_length-th, when all are quantized again."""

    def test_the_tokens_held(self):
        from transformers import QuantizedCache
        model = tiny_lm("llama", 97, seed=3, heads=4, kv_heads=2, hidden=64)
        cfg = model.config
        L, H, d, B = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 2
        group, residual, prompt = 16, 8, 20
        ids = torch.randint(0, 97, (B, 40), generator=torch.Generator().manual_seed(1))

        def side(quantized, rest, bits):  # codes, a scale and a zero of 2 bytes per group
            n = B * H * quantized * d
            return n * bits // 8 + n // group * 2 * 2 + B * H * rest * d * 2
        for bits in (4, 2):
            cache = QuantizedCache(backend="quanto", config=cfg, nbits=bits, q_group_size=group,
                                   residual_length=residual)
            quantized, rest = 0, 0
            with torch.no_grad():
                for t in range(prompt - 1, 40):  # the prompt, then a token at a time
                    model(input_ids=ids[:, :prompt] if t < prompt else ids[:, t:t + 1],
                          use_cache=True, **cache_kw(cache))
                    quantized, rest = ((prompt, 0) if t < prompt else
                                       (quantized + rest + 1, 0) if rest + 1 >= residual else
                                       (quantized, rest + 1))
                    self.assertEqual(kqsvd.cache_bytes(cache, 2, held=True),
                                     L * 2 * side(quantized, rest, bits), f"int{bits}, {t + 1} tokens")
            self.assertEqual(quantized + rest, 40)
            self.assertGreater(quantized, prompt)  # quantized again on the way


if __name__ == "__main__":
    unittest.main()
