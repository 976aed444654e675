"""Up-projections trained on the model's loss (kqsvd.quality.tune, quality-tuned:F).

On a tiny GQA Llama, at per-head and at per-layer ranks:
- only B and B_v change, and only their columns up to each head's rank:
  A, A_v, the ranks and the cache's bytes stay as they were; the file
  keeps the closed forms and holds the tuned ones beside them;
- the KL falls on the windows trained on, the step kept is never worse
  than the closed form on the check windows, and two runs are identical;
- the written file (quality-tuned:F) round-trips, `kqsvd ranks` reads it,
  and an independent re-implementation of the compressed Llama from the
  file reproduces the tuned model's perplexity;
- the quality command reports quality-tuned:F next to quality-budget:F at
  the same cache, and a tuned file cannot be given other ranks.
"""
import json
import math
import os
import shutil
import subprocess
import sys
import unittest

import h5py
import numpy as np
import torch

from common import KQSVD, TEXT, cache_kw, Calibrated
from test_attention import reference_nll

import kqsvd
from kqsvd import models
from kqsvd.attention import cache_bytes
from kqsvd.compat import output_cache
from kqsvd.errors import KqsvdError, UsageError
from kqsvd.formats.policy import fitted_fraction as parse_policy
from kqsvd.quality.tune import tune, tuned_file


def nll(model, seqs):
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.from_numpy(seqs)).logits[:, :-1].double(), -1)
    return -float(logp.gather(2, torch.from_numpy(seqs[:, 1:])[..., None]).sum())


class Tuned(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.c = Calibrated.get("llama")
        cls.model, cls.tok, cls.info = models.load(cls.c.model, dtype=torch.float32)
        with torch.no_grad():  # a loss that feels attention (see test_allocate)
            cls.model.lm_head.weight.mul_(15.0)
        seqs = models.token_windows(cls.tok, TEXT, 64, 24, "train")[0]
        cls.fit, cls.check = seqs[:20], seqs[20:]
        L, H, d = cls.info.num_layers, cls.info.num_kv_heads, cls.info.head_dim
        rng = np.random.default_rng(7)
        rk, rv = rng.integers(2, d, (L, H)), rng.integers(2, d, (L, H))
        rk[:, 0], rv[:, 0] = np.where(rk[:, 1] == 3, 4, 3), np.where(rv[:, 1] == 5, 6, 5)
        cls.ranks = {"per-head": (rk, rv), "per-layer": (np.full(L, 6), np.full(L, 5))}

    def test_only_up_projections_change_and_the_kl_falls(self):
        for name, r in self.ranks.items():
            for m in ("kqsvd", "eigen"):
                p = kqsvd.load_projections(self.c.proj, m, r)
                a, info = tune(self.model, p, self.fit, self.check, steps=4)
                b, again = tune(self.model, p, self.fit, self.check, steps=4)
                what = f"{name} {m}"
                self.assertGreater(info["step"], 0, what)
                self.assertLess(info["kl_fit"][1], info["kl_fit"][0], what)
                self.assertLess(info["kl_check"][1], info["kl_check"][0], what)
                self.assertEqual(info, again, what)
                for l in range(p.num_layers):
                    for n in ("key_down", "value_down"):
                        self.assertTrue(np.array_equal(getattr(a, n)[l], getattr(p, n)[l]))
                    for n, rr in (("query_down", p.rank_k_heads), ("value_up", p.rank_v_heads)):
                        new, old = getattr(a, n)[l], getattr(p, n)[l]
                        self.assertTrue(np.array_equal(new, getattr(b, n)[l]), f"{what} {n}")
                        self.assertEqual(new.shape, old.shape)
                        for h in range(p.num_kv_heads):
                            self.assertFalse(new[h, :, rr[l, h]:].any(), f"{what} {n} past rank")
                        self.assertGreater(np.abs(new - old).max(), 1e-4, f"{what} {n}")
                np.testing.assert_array_equal(a.rank_k_heads, p.rank_k_heads)
                self.assertEqual(self.cache_of(a), self.cache_of(p), what)

    def test_the_best_checked_step_is_kept(self):
        """Trained hard on 4 windows, the fit windows' KL keeps falling while
        the check windows' turns up: the step kept is the check's best, not
        the last; with no steps, the closed form itself is returned."""
        p = kqsvd.load_projections(self.c.proj, "kqsvd", self.ranks["per-head"])
        seen = []
        a, info = tune(self.model, p, self.fit[:4], self.check, steps=4, lr=3e-2, log=seen.append)
        self.assertIn("closed form: KL", seen[0])
        seen = seen[1:]
        fit = [float(s.split("KL ")[1].split()[0]) for s in seen]
        check = [info["kl_check"][0]] + [float(s.split(", ")[1].split()[0]) for s in seen]
        self.assertLess(fit[-1], fit[0], seen)
        self.assertEqual(info["step"], int(np.argmin(check)), seen)
        self.assertLess(info["step"], 4, seen)  # overfitted by the last step
        self.assertAlmostEqual(info["kl_check"][1], min(check), 4)
        same, info = tune(self.model, p, self.fit, self.check, steps=0)
        self.assertEqual((info["step"], info["kl_check"][0]), (0, info["kl_check"][1]))
        for l in range(p.num_layers):
            self.assertTrue(np.array_equal(same.query_down[l], p.query_down[l]))
            self.assertTrue(np.array_equal(same.value_up[l], p.value_up[l]))

    def cache_of(self, proj):
        from transformers import DynamicCache
        kqsvd.compress(self.model, proj)
        with torch.no_grad():
            out = self.model(input_ids=torch.from_numpy(self.check[:1]), use_cache=True,
                             **cache_kw(DynamicCache()))
        kqsvd.compress(self.model, None)
        return cache_bytes(output_cache(out))

    def test_file_round_trip_and_independent_perplexity(self):
        out = os.path.join(self.c.wd, "tuned.h5")
        rk, rv = self.ranks["per-head"]
        tuned_file(self.model, self.c.proj, {"kqsvd": (rk, rv)}, self.fit, self.check, out, 0.5,
                   steps=4)
        got = kqsvd.load_projections(out, "kqsvd")
        self.assertEqual(got.policy, "quality-tuned:0.5")
        self.assertFalse(kqsvd.load_projections(self.c.proj, "kqsvd").tuned)
        want, info = tune(self.model, kqsvd.load_projections(self.c.proj, "kqsvd", (rk, rv)),
                          self.fit, self.check, steps=4)
        for n in ("key_down", "query_down", "value_down", "value_up"):
            for l in range(got.num_layers):
                self.assertTrue(np.array_equal(getattr(got, n)[l], getattr(want, n)[l]), n)
        with h5py.File(out) as f, h5py.File(self.c.proj) as src:
            self.assertEqual(int(f["kqsvd"].attrs["tuned_steps"]), info["step"])
            np.testing.assert_allclose(f["kqsvd"].attrs["tuned_kl_check"], info["kl_check"])
            for m in ("ksvd", "eigen"):  # untouched methods
                self.assertTrue(np.array_equal(f[m]["query_down"][...], src[m]["query_down"][...]))
                self.assertNotIn("tuned_steps", f[m].attrs)
            # The contract's datasets keep the closed forms; the tuned ones
            # sit beside them.
            for n in ("key_down", "query_down", "value_down", "value_up", "sigma_k", "sigma_v"):
                self.assertTrue(np.array_equal(f["kqsvd"][n][...], src["kqsvd"][n][...]), n)
            self.assertFalse(np.array_equal(f["kqsvd"]["query_down_tuned"][...],
                                            src["kqsvd"]["query_down"][...]))
        self.assertTrue(got.tuned)
        closed = kqsvd.load_projections(out, "kqsvd", tuned=False)
        again = kqsvd.load_projections(out, "kqsvd", (rk, rv))
        self.assertFalse(closed.tuned or again.tuned)
        for l in range(got.num_layers):
            self.assertTrue(np.array_equal(closed.value_up[l], again.value_up[l]))
            self.assertFalse(np.array_equal(closed.value_up[l], got.value_up[l]))
        p = subprocess.run([KQSVD, "ranks", "--proj", out, "--json"], capture_output=True,
                           text=True)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual(json.loads(p.stdout)["methods"]["kqsvd"]["rank_k_heads"], rk.tolist())
        from safetensors import safe_open
        st = kqsvd.export_safetensors(out, out + ".safetensors", "kqsvd", dtype="float64")
        with safe_open(st, "pt") as f:
            self.assertEqual(f.metadata()["tuned"], "1")
            self.assertTrue(np.array_equal(f.get_tensor("layers.0.value_up").numpy(),
                                           got.value_up[0]))
        # The tuned model's perplexity, through transformers and from the file
        # by the independent Llama of test_attention.
        seqs = models.token_windows(self.tok, TEXT, 64, 2, "validation")[0]
        kqsvd.compress(self.model, got)
        ours = nll(self.model, seqs)
        kqsvd.compress(self.model, None)
        sd = self.model.state_dict()
        ref = sum(reference_nll(sd, self.model.config, got, row) for row in seqs)
        n = seqs.shape[0] * (seqs.shape[1] - 1)
        self.assertLess(abs(math.exp(ours / n) / math.exp(ref / n) - 1), 1e-4)
        untuned = sum(reference_nll(sd, self.model.config, kqsvd.load_projections(
            self.c.proj, "kqsvd", (rk, rv)), row) for row in seqs)
        self.assertGreater(abs(untuned - ref), 1e-3)  # the tuning mattered
        with self.assertRaisesRegex(UsageError, "tuned at its stored ranks"):
            kqsvd.save_ranks(out, out + ".again", {"kqsvd": (rk, rv)}, "quality-budget:0.5")
        self.assertFalse(os.path.exists(out + ".again"))
        shutil.copy(out, out + ".half")
        with h5py.File(out + ".half", "r+") as f:
            del f["kqsvd/value_up_tuned"]
        with self.assertRaisesRegex(KqsvdError, "'kqsvd' has only one of query_down_tuned and "
                                    "value_up_tuned"):
            kqsvd.load_projections(out + ".half", "kqsvd")

    def test_refusals(self):
        p = kqsvd.load_projections(self.c.proj, "kqsvd", 4)
        with self.assertRaisesRegex(ValueError, "must be"):
            tune(self.model, p, self.fit, self.check, steps=-1)
        with self.assertRaisesRegex(ValueError, r"check \(0\) windows"):
            tune(self.model, p, self.fit, self.check[:0])


class Commands(unittest.TestCase):
    def test_quality_reports_tuned_next_to_budget(self):
        c = Calibrated.get("llama")
        out = os.path.join(c.wd, "tuned-quality.json")
        cmd = [sys.executable, "-m", "kqsvd.quality", "--model", c.model, "--text", TEXT,
               "--proj", c.proj, "--ranks", "quality-budget:0.5,quality-tuned:0.5,fixed:8",
               "--methods", "kqsvd", "--seq-len", "64", "--num-seqs", "2", "--calib-seqs", "4",
               "--check-seqs", "2", "--tune-steps", "4", "--rounds", "2", "--json", out]
        p = subprocess.run(cmd, capture_output=True, text=True)
        self.assertEqual(p.returncode, 0, p.stderr)
        with open(out) as f:
            res = {r["policy"]: r for r in json.load(f)["results"]}
        qb, qt = res["quality-budget:0.5"], res["quality-tuned:0.5"]
        self.assertEqual(qb["rank_k_heads"], qt["rank_k_heads"])
        self.assertEqual(qb["cache_bytes"], qt["cache_bytes"])
        self.assertEqual(qb["cache_kept"], res["fixed:8"]["cache_kept"])
        self.assertTrue(qt["proj"].endswith(".quality-tuned-0.5.h5") and os.path.exists(qt["proj"]))
        self.assertIn("kept step", p.stderr)
        # The written file, its stored ranks: the tuned model again.
        again = out[:-5] + "-stored.json"
        head = cmd[:cmd.index("--ranks")]
        head[head.index("--proj") + 1] = qt["proj"]
        p = subprocess.run(head +
                           ["--ranks", "stored", "--methods", "kqsvd", "--seq-len", "64",
                            "--num-seqs", "2", "--json", again], capture_output=True, text=True)
        self.assertEqual(p.returncode, 0, p.stderr)
        with open(again) as f:
            stored = json.load(f)["results"][0]
        self.assertEqual(stored["policy"], "quality-tuned:0.5")
        self.assertAlmostEqual(stored["perplexity"], qt["perplexity"], delta=1e-9 * qt["perplexity"])
        bad = subprocess.run(cmd[:-2] + ["--check-seqs", "0", "--json", out + "2"],
                             capture_output=True, text=True)
        self.assertEqual(bad.returncode, 2, bad.stderr)
        self.assertIn("--check-seqs 0: --ranks quality-tuned:0.5 needs 1 or more", bad.stderr)
        self.assertFalse(os.path.exists(out + "2"))

    def test_allocate_tune(self):
        c = Calibrated.get("llama")
        out = os.path.join(c.wd, "alloc-tuned.h5")
        p = subprocess.run([sys.executable, "-m", "kqsvd.allocate", "--model", c.model, "--text",
                            TEXT, "--proj", c.proj, "--budget", "0.5", "--seq-len", "64",
                            "--num-seqs", "4", "--tune", "3", "--check-seqs", "2", "--rounds", "1",
                            "--methods", "kqsvd", "--out", out], capture_output=True, text=True)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual(kqsvd.load_projections(out, "kqsvd").policy, "quality-tuned:0.5")
        self.assertIsNotNone(parse_policy("quality-tuned:0.5"))


if __name__ == "__main__":
    unittest.main()
