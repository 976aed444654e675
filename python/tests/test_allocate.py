"""Quality-aware ranks (kqsvd.allocate, the policy quality-budget:F).

- The exact allocation of the convexified costs against brute force on
  small random curves.
- On a tiny GQA Llama: the allocation meets its budget exactly, each unit
  between 1 and head_dim, is deterministic, and its KL to the full model
  on held-out windows is no worse than the uniform ranks' of the same
  budget; the predicted costs fall as ranks grow and reach zero at full
  rank.
- `python -m kqsvd.allocate` writes a projections file with per-head ranks
  that `kqsvd ranks` and load_projections read, and the quality command
  takes quality-budget:F next to the other policies.
"""
import itertools
import json
import os
import subprocess
import sys
import unittest

import numpy as np
import torch

from common import TEXT, Calibrated

import kqsvd
from kqsvd.quality import allocate as al
from kqsvd.formats.policy import fitted_fraction as parse_policy
from kqsvd import models
from kqsvd.errors import UsageError


class Exact(unittest.TestCase):
    def test_matches_brute_force_on_convex_curves(self):
        rng = np.random.default_rng(3)
        for trial in range(40):
            U, d = int(rng.integers(2, 4)), int(rng.integers(2, 6))
            # Convex decreasing curves: sorted positive decrements.
            dec = -np.sort(-rng.random((U, d - 1)) * rng.random((U, 1)) * 10, 1)
            costs = np.concatenate([np.zeros((U, 1)), -np.cumsum(dec, 1)], 1) + dec.sum(1)[:, None]
            total = int(rng.integers(U, U * d + 1))
            got = al.allocate_costs(costs, total)
            self.assertEqual(got.sum(), total)
            best = min(sum(costs[u, r[u] - 1] for u in range(U))
                       for r in itertools.product(range(1, d + 1), repeat=U) if sum(r) == total)
            self.assertAlmostEqual(sum(costs[u, got[u] - 1] for u in range(U)), best, 9,
                                   f"trial {trial}")

    def test_budget_and_bounds(self):
        self.assertEqual(al.budget_ranks(0.5, 12, 16), 96)
        with self.assertRaisesRegex(UsageError, "each needs at least 1"):
            al.budget_ranks(0.01, 12, 16)
        with self.assertRaisesRegex(UsageError, r"fraction must be in \(0, 1\]"):
            parse_policy("quality-budget:1.5")
        self.assertIsNone(parse_policy("budget:0.5"))
        u = al.uniform(100, 3, 2)
        self.assertEqual(int(u.sum()), 100)
        self.assertLessEqual(int(u.max() - u.min()), 1)


class OnTinyModel(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.c = Calibrated.get("llama")
        cls.model, cls.tok, cls.info = models.load(cls.c.model, dtype=torch.float32)
        # A random LM head leaves the next-token distribution nearly uniform,
        # whatever attention does; a larger one makes the loss feel it.  The
        # projections stay valid: they come from the layers, not the head.
        assert not cls.model.config.tie_word_embeddings
        with torch.no_grad():
            cls.model.lm_head.weight.mul_(15.0)
        cls.seqs = models.token_windows(cls.tok, TEXT, 64, 6, "train")[0]

    def test_costs_fall_to_zero(self):
        d = self.info.head_dim
        projs = {"kqsvd": kqsvd.load_projections(self.c.proj, "kqsvd", d)}
        cost = al.measure_costs(self.model, self.info, self.seqs[:2], projs)["kqsvd"]
        self.assertTrue((cost[..., -1] <= 1e-8 * cost[..., 0].max()).all())
        self.assertTrue((cost[..., 0] > 0).all())
        # Mostly falling: the hull decides where it does not.
        self.assertGreater(float((np.diff(cost, axis=-1) <= 1e-12).mean()), 0.8)

    def test_refine_never_raises_the_kl(self):
        """Many rounds, so that some moves are measured worse and undone."""
        L, H, d = self.info.num_layers, self.info.num_kv_heads, self.info.head_dim
        kqsvd.compress(self.model, None)
        ref = self.full_logp(self.seqs)
        start = al.uniform(al.budget_ranks(0.25, 2 * L * H, d), L, H)
        seen = []
        ranks, kl = al.refine(self.model, self.info, self.c.proj, "kqsvd", start, self.seqs, ref,
                              iters=25, log=seen.append, step=4)
        kls = [float(s.split("KL ")[1].split()[0]) for s in seen]
        was = [float(s.split("was ")[1].rstrip(")")) for s in seen]
        self.assertTrue(any(k >= w for k, w in zip(kls, was)), seen)  # a move undone
        self.assertEqual(int(ranks.sum()), int(start.sum()))
        kqsvd.compress(self.model, kqsvd.load_projections(self.c.proj, "kqsvd", (start[0], start[1])))
        before = al.kl_to_full(self.model, self.seqs, ref)
        kqsvd.compress(self.model, None)
        self.assertLessEqual(kl, before + 1e-9)

    def test_budget_exact_bounded_deterministic_and_not_worse_than_uniform(self):
        L, H, d = self.info.num_layers, self.info.num_kv_heads, self.info.head_dim
        for frac in (0.5, 0.25):
            a = al.allocate(self.model, self.info, self.c.proj, frac, self.seqs, kqsvd.METHODS)
            b = al.allocate(self.model, self.info, self.c.proj, frac, self.seqs, kqsvd.METHODS)
            total = al.budget_ranks(frac, 2 * L * H, d)
            valid = models.token_windows(self.tok, TEXT, 64, 4, "validation")[0]
            for m in kqsvd.METHODS:
                rk, rv = a[m]["rank_k"], a[m]["rank_v"]
                self.assertEqual(int(rk.sum() + rv.sum()), total, m)
                self.assertTrue(1 <= min(rk.min(), rv.min()) and max(rk.max(), rv.max()) <= d)
                np.testing.assert_array_equal(rk, b[m]["rank_k"])
                np.testing.assert_array_equal(rv, b[m]["rank_v"])
                self.assertLessEqual(a[m]["kl"], min(a[m]["kl_fisher"], a[m]["kl_uniform"]))
                held, ref = {}, self.full_logp(valid)
                for name, (k, v) in (("quality", (rk, rv)),
                                     ("uniform", tuple(al.uniform(total, L, H)))):
                    kqsvd.compress(self.model, kqsvd.load_projections(self.c.proj, m, (k, v)))
                    held[name] = al.kl_to_full(self.model, valid, ref)
                kqsvd.compress(self.model, None)
                print(f"quality-budget:{frac} {m}: held-out KL {held['quality']:.4e}, uniform "
                      f"{held['uniform']:.4e} (calibration {a[m]['kl']:.4e}, uniform "
                      f"{a[m]['kl_uniform']:.4e}, Fisher start {a[m]['kl_fisher']:.4e})",
                      file=sys.stderr)
                self.assertLessEqual(held["quality"], held["uniform"], m)

    def full_logp(self, seqs):
        kqsvd.compress(self.model, None)
        with torch.no_grad():
            return [torch.log_softmax(self.model(input_ids=torch.from_numpy(seqs[i:i + 4]),
                                                 use_cache=False).logits[:, :-1].double(), -1)
                    for i in range(0, len(seqs), 4)]


class Commands(unittest.TestCase):
    def test_allocate_writes_per_head_ranks(self):
        c = Calibrated.get("llama")
        out = os.path.join(c.wd, "quality.h5")
        p = subprocess.run([sys.executable, "-m", "kqsvd.allocate", "--model", c.model, "--text",
                            TEXT, "--proj", c.proj, "--budget", "0.4", "--seq-len", "64",
                            "--num-seqs", "4", "--out", out], capture_output=True, text=True)
        self.assertEqual(p.returncode, 0, p.stderr)
        proj = kqsvd.load_projections(out, "kqsvd")
        self.assertEqual(proj.policy, "quality-budget:0.4")
        self.assertAlmostEqual(proj.cache_kept(), 0.4, delta=0.5 / proj.head_dim)
        p = subprocess.run([sys.executable, "-m", "kqsvd.allocate", "--model", c.model, "--text",
                            TEXT, "--proj", c.proj, "--budget", "0.001", "--out", out + "2"],
                           capture_output=True, text=True)
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("each needs at least 1", p.stderr)
        self.assertNotIn("Traceback", p.stderr)
        self.assertFalse(os.path.exists(out + "2"))
        for args, code, needle in ((["--budget", "2", "--out", out + "3"], 2,
                                    "--budget: 2 must be in (0, 1]"),
                                   (["--budget", "0.5", "--out", c.proj], 2, "is --proj, an input"),
                                   (["--budget", "0.5", "--out", "/nonexistent/x.h5"], 2,
                                    "does not exist"),
                                   (["--budget", "0.5", "--out", out + "4", "--proj", TEXT], 1,
                                    "cannot read as HDF5")):
            base = [sys.executable, "-m", "kqsvd.allocate", "--model", c.model, "--text", TEXT]
            p = subprocess.run(base + (["--proj", c.proj] if "--proj" not in args else []) + args,
                               capture_output=True, text=True)
            self.assertEqual(p.returncode, code, p.stderr)
            self.assertIn(needle, p.stderr)
            self.assertEqual(len(p.stderr.strip().splitlines()), 1, p.stderr)

    def test_quality_command_compares_policies(self):
        c = Calibrated.get("llama")
        rep = os.path.join(c.wd, "quality-budget.json")
        d = 16
        p = subprocess.run([sys.executable, "-m", "kqsvd.quality", "--model", c.model, "--text",
                            TEXT, "--proj", c.proj, "--ranks", "fixed:8,budget:0.5,quality-budget:0.5",
                            "--seq-len", "64", "--num-seqs", "2", "--calib-seqs", "2", "--rounds",
                            "2", "--methods", "kqsvd,ksvd", "--json", rep],
                           capture_output=True, text=True)
        self.assertEqual(p.returncode, 0, p.stderr[-3000:])
        with open(rep) as f:
            results = json.load(f)["results"]
        self.assertEqual([(r["policy"], r["method"]) for r in results],
                         [(pol, m) for pol in ("fixed:8", "budget:0.5", "quality-budget:0.5")
                          for m in ("kqsvd", "ksvd")])
        for r in results:
            self.assertAlmostEqual(r["cache_kept"], 0.5, delta=1e-12)
            self.assertAlmostEqual(r["cache_bytes_ratio"], 0.5, delta=1e-12)
            if r["policy"].startswith("quality"):
                heads = np.array(r["rank_k_heads"] + r["rank_v_heads"])
                self.assertTrue(1 <= heads.min() and heads.max() <= d)
                # The fitted ranks are written beside the report, for every tool.
                self.assertEqual(r["proj"], rep[:-5] + ".quality-budget-0.5.h5")
                stored = kqsvd.load_projections(r["proj"], r["method"])
                self.assertEqual(stored.policy, "quality-budget:0.5")
                self.assertEqual(stored.rank_k_heads.tolist(), r["rank_k_heads"])
                self.assertEqual(stored.rank_v_heads.tolist(), r["rank_v_heads"])
                got = kqsvd.policy_ranks(r["proj"])["methods"][r["method"]]
                self.assertEqual(got["rank_k_heads"], r["rank_k_heads"])


if __name__ == "__main__":
    unittest.main()
