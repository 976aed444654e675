"""python -m kqsvd.quality on a tiny GQA Llama: the report's numbers, its
ties to kqsvd ranks and kqsvd evaluate, and its refusals (one line, the
right exit status, no partial output)."""
import json
import math
import os
import sys
import unittest

from common import TEXT, Calibrated, evaluate, run

import kqsvd


def quality(c, out, *extra, expect=0, ranks="fixed:16,eps:0.1,budget:0.3", model=None,
            proj=None, nseq=3):
    cmd = [sys.executable, "-m", "kqsvd.quality", "--model", model or c.model, "--text", TEXT,
           "--proj", proj or c.proj, "--ranks", ranks, "--seq-len", "64", "--num-seqs", str(nseq),
           "--json", out] + list(extra)
    return run(cmd, expect=expect)


class Report(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.c = Calibrated.get("llama")
        cls.out = os.path.join(cls.c.wd, "quality.json")
        cls.png = os.path.join(cls.c.wd, "quality.png")
        cls.p = quality(cls.c, cls.out, "--plot", cls.png, "--score-errors")
        with open(cls.out) as f:
            cls.rep = json.load(f)

    def test_pairs_and_fields(self):
        res = self.rep["results"]
        self.assertEqual([(r["policy"], r["method"]) for r in res],
                         [(p, m) for p in ("fixed:16", "eps:0.1", "budget:0.3")
                          for m in kqsvd.METHODS])
        self.assertEqual(self.rep["tokens_scored"], 3 * 63)
        self.assertTrue(os.path.getsize(self.png) > 10000)
        self.assertIn("perplexity", self.p.stdout)
        for r in res:
            self.assertTrue(all(math.isfinite(r[k]) for k in ("perplexity", "kl", "top1")), r)
            self.assertGreaterEqual(r["kl"], -1e-9)

    def test_full_rank_is_the_full_model(self):
        full = self.rep["full"]["perplexity"]
        for r in self.rep["results"][:3]:
            self.assertAlmostEqual(r["cache_kept"], 1.0)
            self.assertLess(abs(r["perplexity"] / full - 1), 1e-5, r["method"])
            self.assertLess(r["kl"], 1e-8)
            self.assertEqual(r["top1"], 1.0)
            self.assertLess(r["err_kq"]["mean"], 1e-10)

    def test_ranks_are_the_c_tools(self):
        for pol in ("eps:0.1", "budget:0.3"):
            got = kqsvd.policy_ranks(self.c.proj, pol)
            for r in self.rep["results"]:
                if r["policy"] == pol:
                    want = got["methods"][r["method"]]
                    self.assertEqual((r["rank_k"], r["rank_v"]), (want["rank_k"], want["rank_v"]))
                    self.assertAlmostEqual(r["cache_kept"], got["cache_kept"][r["method"]])
                    self.assertAlmostEqual(r["cache_bytes_ratio"], r["cache_kept"])

    def test_score_errors_match_evaluate(self):
        # In float64 the in-model probe sees exactly the exported validation
        # caches (the same windows: the last num_valid x seq_len tokens).
        c = self.c
        out = os.path.join(c.wd, "quality64.json")
        quality(c, out, "--dtype", "float64", "--score-errors", ranks="eps:0.1,budget:0.3",
                nseq=c.num_valid)
        with open(out) as f:
            q = json.load(f)
        for pol in ("eps:0.1", "budget:0.3"):
            rep = evaluate(c.valid[0], c.proj, c.valid[1], pol, os.path.join(c.wd, "eval.json"))
            for r in q["results"]:
                if r["policy"] != pol:
                    continue
                m = rep["methods"][r["method"]]
                self.assertEqual(r["rank_k"], [lay["rank_k"] for lay in m["layers"]])
                self.assertEqual(r["rank_v"], [lay["rank_v"] for lay in m["layers"]])
                for key in ("err_kq", "err_out"):
                    self.assertLess(abs(r[key]["mean"] / m["mean"][key] - 1), 1e-6,
                                    f"{pol} {r['method']} {key}")
                    for l, want in enumerate(m["layers"]):
                        self.assertLess(abs(r[key]["layers"][l] / want[key] - 1), 1e-6)


class Refusals(unittest.TestCase):
    def setUp(self):
        self.c = Calibrated.get("llama")
        self.out = os.path.join(self.c.wd, "bad.json")

    def refused(self, expect, needle, **kw):
        p = quality(self.c, self.out, expect=expect, **kw)
        self.assertIn(needle, p.stderr)
        self.assertEqual(len(p.stderr.strip().splitlines()), 1, p.stderr)
        self.assertFalse(os.path.exists(self.out))
        self.assertFalse(os.path.exists(self.out + ".tmp"))

    def test_unknown_policy(self):
        self.refused(2, "foo:1", ranks="eps:0.1,foo:1")

    def test_rank_above_head_dim(self):
        self.refused(2, "17", ranks="fixed:17")

    def test_other_models_projections(self):
        other = Calibrated.get("llama", seq_len=32, train=8, valid=2)  # same sizes
        import h5py
        bad = os.path.join(self.c.wd, "other-proj.h5")
        with h5py.File(other.proj) as src, h5py.File(bad, "w") as dst:
            for k, v in src.attrs.items():
                dst.attrs[k] = v
            dst.attrs["num_kv_heads"] = 4
        p = quality(self.c, self.out, expect=1, proj=bad)
        self.assertIn(bad, p.stderr)
        self.assertIn(self.c.model, p.stderr)
        self.assertIn("num_kv_heads", p.stderr)
        self.assertFalse(os.path.exists(self.out))

    def test_calibration_window(self):
        """Scoring windows longer than the file was calibrated on warns (the
        file records them: kqsvd calibrate's longest sequence); a seq_len
        attribute that is no positive whole number is refused."""
        import h5py
        import shutil
        with h5py.File(self.c.proj) as f:
            self.assertEqual(int(f.attrs["seq_len"]), 64)
        good = os.path.join(self.c.wd, "window.json")
        p = quality(self.c, good, "--force", ranks="eps:0.1")
        self.assertNotIn("calibrated on windows", p.stderr)
        short = os.path.join(self.c.wd, "short-window.h5")
        shutil.copyfile(self.c.proj, short)
        with h5py.File(short, "r+") as f:
            f.attrs["seq_len"] = 32
        p = quality(self.c, good, "--force", ranks="eps:0.1", proj=short)
        self.assertIn(f"warning: {short} was calibrated on windows of 32 tokens, shorter than "
                      "the 64 scored here", p.stderr)
        for bad in (0, "long", 2.5):
            with h5py.File(short, "r+") as f:
                f.attrs["seq_len"] = bad
            self.refused(1, f"{short}: attribute 'seq_len'", ranks="eps:0.1", proj=short)

    def test_text_too_short(self):
        cmd = [sys.executable, "-m", "kqsvd.quality", "--model", self.c.model, "--text", TEXT,
               "--proj", self.c.proj, "--ranks", "eps:0.1", "--seq-len", "500", "--num-seqs",
               "30", "--json", self.out]
        p = run(cmd, expect=1)
        self.assertIn("cannot overlap", p.stderr)
        self.assertFalse(os.path.exists(self.out))

    def test_missing_files(self):
        self.refused(1, "no such file", proj=os.path.join(self.c.wd, "nope.h5"))
        p = run([sys.executable, "-m", "kqsvd.quality", "--model", self.c.model, "--text", TEXT,
                 "--proj", self.c.proj, "--ranks", "eps:0.1", "--json", "/nonexistent/q.json"],
                expect=2)
        self.assertIn("/nonexistent", p.stderr)


if __name__ == "__main__":
    unittest.main()
