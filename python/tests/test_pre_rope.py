"""Keys before RoPE (issue 17, item 3): `examples/export_hf.py --keys
pre-rope`, `kqsvd calibrate` carrying the caches' `rope` attribute,
`python -m kqsvd.calibrate_hf --keys pre-rope`, and the compressed
attention that rotates the keys it rebuilds from the cache, on a tiny GQA
Llama:
- every file says rope = "pre" (export_request too), and the exported keys
  and queries are q_proj and k_proj of layer 0's normed embeddings, which
  rotated by RoPE (written here, not transformers') are the post-RoPE
  export's;
- calibrate writes rope = "pre" into proj.h5 and refuses a set mixing
  keys before and after RoPE, naming the shard;
- at full rank the compressed model's logits are the full model's (every
  method, per-layer and per-head ranks); at a low rank they differ from
  post-RoPE projections'; generate() gives the tokens whole-sequence
  passes give, and the cache holds r-wide tensors;
- probe mode measures the post-RoPE scores the model uses (against a
  computation from the exported caches here);
- in situ equals export + calibrate within 1e-10 and says rope = "pre";
- resuming an export with another --keys is refused naming --keys, and an
  encoder refuses --keys pre-rope with one message."""
import json
import math
import os
import sys
import unittest

import h5py
import numpy as np
import torch

from common import (EXPORT, KQSVD, MPIENV, TEXT, cache_kw, calibrate, installed, padded, rope_theta, run,
                    tiny_decoder, workdir)

import kqsvd
from kqsvd import models
from kqsvd.compat import output_cache

SEQ, TRAIN, VALID = 64, 12, 4


def export(model, out, split, num_seqs, keys, dtype="f32", expect=0):
    p = run([sys.executable, EXPORT, "--model", model, "--text", TEXT, "--seq-len", str(SEQ),
             "--num-seqs", str(num_seqs), "--split", split, "--shard-seqs", "4", "--dtype", dtype,
             "--keys", keys, "--out", out], expect=expect)
    if expect:
        return p
    shards = sorted(os.path.join(out, f) for f in os.listdir(out) if f.startswith("shard-"))
    return os.path.join(out, "model.h5"), shards


def insitu(model, out, *extra, expect=0):
    return run([sys.executable, "-m", "kqsvd.calibrate_hf", "--model", model, "--text", TEXT,
                "--seq-len", str(SEQ), "--num-seqs", str(TRAIN), "--out", out, *extra],
               expect=expect)


def rope(x, cfg, positions):
    """x [..., T, d] rotated by Llama's RoPE (rotate-half), written here."""
    d = x.shape[-1]
    inv = 1.0 / (rope_theta(cfg) ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = positions.double()[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, 1), torch.cat([ang.sin()] * 2, 1)
    return x * cos + torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1) * sin


def rel(a, b):
    return float((a - b).norm() / b.norm())


def attr(f, name):
    v = f.attrs.get(name)
    return v.decode() if isinstance(v, bytes) else v


class PreRope(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.wd = workdir("pre-rope")
        cls.model = tiny_decoder("llama", os.path.join(cls.wd, "model"))
        w = lambda *p: os.path.join(cls.wd, *p)  # noqa: E731
        cls.pre = export(cls.model, w("pre"), "train", TRAIN, "pre-rope")
        cls.post = export(cls.model, w("post"), "train", TRAIN, "post-rope")
        cls.proj_pre = calibrate(*cls.pre, w("proj-pre.h5"))
        cls.proj_post = calibrate(*cls.post, w("proj-post.h5"))
        cls.lm, cls.tok, cls.info = models.load(cls.model, dtype=torch.float32)

    def tearDown(self):
        kqsvd.compress(self.lm, None)

    def ids(self, n, seq_len, split="validation"):
        return torch.from_numpy(models.token_windows(self.tok, TEXT, seq_len, n, split)[0])

    # -- the exporter -------------------------------------------------------

    def test_files_record_rope(self):
        for (model_h5, shards), want in ((self.pre, "pre"), (self.post, "post")):
            for path in [model_h5] + shards:
                with h5py.File(path) as f:
                    self.assertEqual(attr(f, "rope"), want, path)
                    self.assertEqual(json.loads(attr(f, "export_request"))["rope"], want, path)

    def test_keys_are_taken_before_rope(self):
        """Layer 0: the exported keys and queries are k_proj and q_proj of
        the normed embeddings; in every layer, RoPE applied to them gives
        the post-RoPE export."""
        lm, info = self.lm, self.info
        ids = torch.from_numpy(models.token_windows(self.tok, TEXT, SEQ, TRAIN, "train")[0][:1])
        att = lm.model.layers[0].self_attn
        with torch.no_grad():
            h = lm.model.layers[0].input_layernorm(lm.model.embed_tokens(ids))
            k = att.k_proj(h).view(SEQ, info.num_kv_heads, info.head_dim).transpose(0, 1)
            q = att.q_proj(h).view(SEQ, info.num_heads, info.head_dim).transpose(0, 1)
        with h5py.File(self.pre[1][0]) as f:
            np.testing.assert_array_equal(f["keys"][0, :, :SEQ], k.numpy())
            np.testing.assert_array_equal(f["queries"][0, :, :SEQ], q.numpy())
        pos = torch.arange(SEQ)
        for a, b in zip(self.pre[1], self.post[1]):
            with h5py.File(a) as fa, h5py.File(b) as fb:
                for name in ("keys", "queries"):
                    x = torch.from_numpy(fa[name][...].astype(np.float64))
                    L, H, T, d = x.shape
                    x = rope(x.view(L, H, T // SEQ, SEQ, d), lm.config, pos).view(L, H, T, d)
                    y = torch.from_numpy(fb[name][...].astype(np.float64))
                    self.assertLess(rel(x, y), 1e-6, f"{a} {name}")
                np.testing.assert_array_equal(fa["values"][...], fb["values"][...])

    def test_resume_with_other_keys_is_refused(self):
        p = export(self.model, os.path.join(self.wd, "pre"), "train", TRAIN, "post-rope", expect=1)
        errors = [ln for ln in p.stderr.splitlines() if ln.startswith("export_hf: error")]
        self.assertEqual(len(errors), 1, p.stderr)
        self.assertIn("--keys differs (rope: 'pre' there, 'post' now)", p.stderr)

    def test_encoder_refuses_pre_rope(self):
        out = os.path.join(self.wd, "minilm")
        p = run([sys.executable, EXPORT, "--model", "sentence-transformers/all-MiniLM-L6-v2",
                 "--text", TEXT, "--seq-len", "32", "--num-seqs", "2", "--split", "train",
                 "--keys", "pre-rope", "--out", out], expect=2)
        self.assertEqual(p.stderr.count("export_hf: error"), 1, p.stderr)
        self.assertIn("--keys pre-rope is for decoders with RoPE; 'bert' is an encoder", p.stderr)
        self.assertFalse(os.path.exists(os.path.join(out, "model.h5")))
        p = run([sys.executable, "-m", "kqsvd.calibrate_hf", "--model",
                 "sentence-transformers/all-MiniLM-L6-v2", "--text", TEXT, "--seq-len", "32",
                 "--num-seqs", "2", "--keys", "pre-rope", "--out", out + ".h5"], expect=2)
        self.assertEqual(p.stderr.count("calibrate_hf: error"), 1, p.stderr)
        self.assertIn("'bert' is an encoder", p.stderr)

    # -- kqsvd calibrate ----------------------------------------------------

    def test_calibrate_carries_rope_and_refuses_a_mix(self):
        for path, want in ((self.proj_pre, "pre"), (self.proj_post, "post")):
            with h5py.File(path) as f:
                self.assertEqual(attr(f, "rope"), want)
            self.assertEqual(kqsvd.load_projections(path, "kqsvd").rope, want)
        out = os.path.join(self.wd, "mixed.h5")
        for model_h5, shards, bad in ((self.pre[0], self.pre[1][:2] + self.post[1][2:], self.post[1][2]),
                                      (self.post[0], self.post[1][:1] + self.pre[1][1:2], self.pre[1][1])):
            for np_ in (1, 2):
                p = run([KQSVD, "calibrate", "--progress", "off", "--model", model_h5, "--out", out]
                        + shards, expect=1, np_=np_)
                self.assertIn(f"{bad}: attribute 'rope' is", p.stderr)
                self.assertIn("caches of keys before and after RoPE do not mix", p.stderr)
                self.assertFalse(os.path.exists(out))
        # A shard without the attribute counts as "post"; no attribute stays none.
        bare = os.path.join(self.wd, "bare")
        os.makedirs(bare)
        copies = []
        for src in [self.post[0]] + self.post[1]:
            dst = os.path.join(bare, os.path.basename(src))
            with open(src, "rb") as a, open(dst, "wb") as b:
                b.write(a.read())
            copies.append(dst)
        for path in copies:
            with h5py.File(path, "r+") as f:
                del f.attrs["rope"]
        proj = calibrate(copies[0], copies[1:], os.path.join(self.wd, "bare.h5"))
        with h5py.File(proj) as f:
            self.assertNotIn("rope", f.attrs)
        self.assertEqual(kqsvd.load_projections(proj, "kqsvd").rope, "post")
        mixed = calibrate(self.post[0], copies[1:2] + self.post[1][1:],
                          os.path.join(self.wd, "half-bare.h5"))
        with h5py.File(mixed) as f:
            self.assertEqual(attr(f, "rope"), "post")
        with h5py.File(copies[1], "r+") as f:
            f.attrs["rope"] = "sideways"
        p = run([KQSVD, "calibrate", "--progress", "off", "--model", copies[0], "--out", out]
                + copies[1:], expect=1)
        self.assertIn(f"{copies[1]}: attribute 'rope' is \"sideways\", expected \"pre\" or "
                      "\"post\"", p.stderr)

    # -- the compressed attention -------------------------------------------

    def test_full_rank_logits_equal(self):
        lm, info = self.lm, self.info
        ids = self.ids(2, SEQ)
        rng = np.random.default_rng(5)
        shape = (info.num_layers, info.num_kv_heads)
        with torch.no_grad():
            full = lm(input_ids=ids).logits
            for m in kqsvd.METHODS:
                proj = kqsvd.load_projections(self.proj_pre, m, info.head_dim)
                self.assertEqual(proj.rope, "pre")
                for fold in (False, True):
                    kqsvd.compress(lm, proj, fold=fold)
                    self.assertLess(rel(lm(input_ids=ids).logits, full), 1e-5, f"{m} fold={fold}")
                # Per-head ranks: full-rank keys with ragged values, then
                # ragged keys against the zero-padded layout's.
                rv = rng.integers(1, info.head_dim + 1, shape)
                rv[:, 0] = np.where(rv[:, 1] == 1, 2, 1)  # heads of every layer differ
                kqsvd.compress(lm, kqsvd.load_projections(
                    self.proj_pre, m, (np.full(shape, info.head_dim), rv)))
                self.assertTrue(kqsvd.attention.layer_projections(lm)[0].ragged)
                ref_v = kqsvd.load_projections(self.proj_post, m, (np.full(shape, info.head_dim), rv))
                ragged = lm(input_ids=ids).logits
                kqsvd.compress(lm, ref_v)
                self.assertLess(rel(ragged, lm(input_ids=ids).logits), 1e-5, f"{m} ragged")
                rk = rng.integers(1, info.head_dim + 1, shape)
                proj = kqsvd.load_projections(self.proj_pre, m, (rk, rv))
                kqsvd.compress(lm, proj)
                ragged = lm(input_ids=ids).logits
                for site, layer in zip(installed(lm), lm.model.layers):
                    site.P = padded(proj, layer, info)
                self.assertLess(rel(lm(input_ids=ids).logits, ragged), 1e-5, f"{m} padded")

    def test_quality_budget_on_pre_rope_keys(self):
        """The allocation's costs come from the keys the projections act on."""
        from kqsvd.quality import allocate as al
        # spied on where allocate looks it up (the name it imported)
        ropes, original = [], al.Capture

        def spy(*a, **kw):
            ropes.append(kw.get("rope", "post"))
            return original(*a, **kw)
        al.Capture = spy
        try:
            seqs = self.ids(4, SEQ, "train").numpy()
            got = al.allocate(self.lm, self.info, self.proj_pre, 0.5, seqs, ["kqsvd"], rounds=2)
        finally:
            al.Capture = original
        self.assertEqual(ropes, ["pre"])
        L, H, d = self.info.num_layers, self.info.num_kv_heads, self.info.head_dim
        r = got["kqsvd"]
        self.assertEqual(int(r["rank_k"].sum() + r["rank_v"].sum()), L * H * d)
        self.assertLessEqual(r["kl"], r["kl_uniform"])

    def test_independent_perplexity_plain_and_tuned(self):
        """test_attention's independent Llama, with keys rebuilt before RoPE,
        gives the compressed model's perplexity at per-head ranks, closed
        form and with up-projections tuned (which then train B^T, the
        matrix bringing cached keys back)."""
        from test_attention import reference_nll
        from kqsvd.quality.tune import tune
        L, H, d = self.info.num_layers, self.info.num_kv_heads, self.info.head_dim
        rng = np.random.default_rng(11)
        rk, rv = rng.integers(2, d, (L, H)), rng.integers(2, d, (L, H))
        rk[:, 0] = np.where(rk[:, 1] == 3, 4, 3)
        plain = kqsvd.load_projections(self.proj_pre, "kqsvd", (rk, rv))
        train = self.ids(12, SEQ, "train").numpy()
        tuned, info = tune(self.lm, plain, train[:10], train[10:], steps=3, lr=1e-2)
        ids = self.ids(2, SEQ).numpy()
        sd = self.lm.state_dict()
        n = ids.shape[0] * (ids.shape[1] - 1)
        refs = []
        for name, proj in (("closed form", plain), ("tuned", tuned)):
            kqsvd.compress(self.lm, proj)
            with torch.no_grad():
                logp = torch.log_softmax(self.lm(input_ids=torch.from_numpy(ids)).logits[:, :-1]
                                         .double(), -1)
            got = -float(logp.gather(2, torch.from_numpy(ids[:, 1:])[..., None]).sum())
            refs.append(sum(reference_nll(sd, self.lm.config, proj, row) for row in ids))
            self.assertLess(abs(math.exp((got - refs[-1]) / n) - 1), 1e-4, name)
        self.assertGreater(info["step"], 0)
        self.assertGreater(abs(refs[0] - refs[1]), 1e-3)

    def test_low_rank_differs_from_post_rope(self):
        ids = self.ids(1, SEQ)
        with torch.no_grad():
            full = self.lm(input_ids=ids).logits
            got = {}
            for name, path in (("pre", self.proj_pre), ("post", self.proj_post)):
                kqsvd.compress(self.lm, kqsvd.load_projections(path, "kqsvd", 4))
                got[name] = self.lm(input_ids=ids).logits
                self.assertGreater(rel(got[name], full), 1e-3, name)
            self.assertGreater(rel(got["pre"], got["post"]), 1e-3)

    def test_generate_and_cache(self):
        lm, info = self.lm, self.info
        for ranks in ("fixed:6", "per-head"):
            if ranks == "per-head":
                rng = np.random.default_rng(9)
                shape = (info.num_layers, info.num_kv_heads)
                ranks = (rng.integers(1, 9, shape), rng.integers(1, 9, shape))
            proj = kqsvd.load_projections(self.proj_pre, "kqsvd", ranks)
            kqsvd.compress(lm, proj)
            ids = self.ids(1, 20)
            with torch.no_grad():
                seq = lm.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0,
                                  return_dict_in_generate=True).sequences
                for t in range(ids.shape[1], seq.shape[1]):
                    logits = lm(input_ids=seq[:, :t], use_cache=False).logits[0, -1]
                    self.assertEqual(int(logits.argmax()), int(seq[0, t]), f"{ranks} token {t}")
                # Three steps on a cache equal one pass without it.
                a = lm(input_ids=seq[:, :-3], use_cache=True)
                b = lm(input_ids=seq[:, -3:-1], **cache_kw(output_cache(a)), use_cache=True)
                c = lm(input_ids=seq[:, -1:], **cache_kw(output_cache(b)), use_cache=True)
                whole = lm(input_ids=seq, use_cache=False).logits
                self.assertLess(rel(b.logits[0], whole[0, -3:-1]), 1e-5)
                self.assertLess(rel(c.logits[0, -1], whole[0, -1]), 1e-5)
                T = seq.shape[1]
                self.assertEqual(kqsvd.cache_bytes(output_cache(c)),
                                 4 * T * int(proj.rank_k_heads.sum() + proj.rank_v_heads.sum()))

    def test_left_padded_batch(self):
        """A left-padded batch row gives the logits of the row alone: the
        rebuilt keys are rotated at the model's positions, not the cache's."""
        lm = self.lm
        kqsvd.compress(lm, kqsvd.load_projections(self.proj_pre, "kqsvd", "fixed:6"))
        ids = self.ids(2, 16)
        short = ids[1:, 5:]
        batch = torch.cat([ids[:1], torch.cat([torch.zeros(1, 5, dtype=ids.dtype), short], 1)])
        mask = torch.ones_like(batch)
        mask[1, :5] = 0
        with torch.no_grad():
            out = lm.generate(batch, attention_mask=mask, max_new_tokens=4, do_sample=False,
                              pad_token_id=0, return_dict_in_generate=True).sequences
            alone = lm.generate(short, max_new_tokens=4, do_sample=False, pad_token_id=0,
                                return_dict_in_generate=True).sequences
        self.assertEqual(out[1, 16:].tolist(), alone[0, 11:].tolist())

    def test_mistral_and_qwen2(self):
        """The other families' RoPE (Qwen2's tables by length in transformers
        4.44): full-rank logits, and a cache of a few steps at a low rank."""
        for kind in ("mistral", "qwen2"):
            w = lambda *p: os.path.join(self.wd, kind, *p)  # noqa: E731
            model = tiny_decoder(kind, w("model"))
            proj = calibrate(*export(model, w("train"), "train", 8, "pre-rope"), w("proj.h5"))
            lm, tok, info = models.load(model, dtype=torch.float32)
            ids = torch.from_numpy(models.token_windows(tok, TEXT, 24, 1, "validation")[0])
            with torch.no_grad():
                full = lm(input_ids=ids).logits
                for m in kqsvd.METHODS:
                    kqsvd.compress(lm, kqsvd.load_projections(proj, m, info.head_dim))
                    self.assertLess(rel(lm(input_ids=ids).logits, full), 1e-5, f"{kind} {m}")
                kqsvd.compress(lm, kqsvd.load_projections(proj, "kqsvd", 5))
                a = lm(input_ids=ids[:, :-2], use_cache=True)
                b = lm(input_ids=ids[:, -2:], **cache_kw(output_cache(a)), use_cache=True)
                whole = lm(input_ids=ids, use_cache=False).logits
                self.assertGreater(rel(whole, full), 1e-3, kind)
                self.assertLess(rel(b.logits[0], whole[0, -2:]), 1e-5, kind)

    def test_probe_measures_post_rope_scores(self):
        """err_kq and err_out of probe mode against the same numbers computed
        here from float64 validation caches: the pre-RoPE keys' rebuilt
        RoPE(K A B^T) scored against the post-RoPE queries."""
        w = lambda *p: os.path.join(self.wd, *p)  # noqa: E731
        pre = export(self.model, w("valid-pre"), "validation", VALID, "pre-rope", "f64")
        post = export(self.model, w("valid-post"), "validation", VALID, "post-rope", "f64")
        lm, _, info = models.load(self.model, dtype=torch.float64)
        ids = models.token_windows(self.tok, TEXT, SEQ, VALID, "validation")[0]
        g, d = info.num_heads // info.num_kv_heads, info.head_dim
        for m in kqsvd.METHODS:
            for ranks in (d, 5):
                proj = kqsvd.load_projections(self.proj_pre, m, ranks)
                kqsvd.compress(lm, proj, probe=True)
                with torch.no_grad():
                    for row in ids:
                        lm(input_ids=torch.from_numpy(row[None]), use_cache=False)
                errs = kqsvd.probe_errors(lm)
                kqsvd.compress(lm, None)
                with h5py.File(pre[1][0]) as fp, h5py.File(post[1][0]) as fq:
                    for l in range(info.num_layers):
                        for s in range(VALID):
                            rows = slice(s * SEQ, (s + 1) * SEQ)
                            k_pre = torch.from_numpy(fp["keys"][l, :, rows])
                            q = torch.from_numpy(fq["queries"][l, :, rows])
                            k = torch.from_numpy(fq["keys"][l, :, rows])
                            A = torch.from_numpy(proj.key_down[l])
                            B = torch.from_numpy(proj.query_down[l])
                            k_hat = rope(k_pre @ A @ B.transpose(1, 2), lm.config, torch.arange(SEQ))
                            kk, kh = k.repeat_interleave(g, 0), k_hat.repeat_interleave(g, 0)
                            S, S_c = q @ kk.transpose(1, 2), q @ kh.transpose(1, 2)
                            want = float(((S - S_c) ** 2).sum() / (S ** 2).sum())
                            # Not the error in the caches' own, pre-RoPE space.
                            q_pre = torch.from_numpy(fp["queries"][l, :, rows])
                            P = q_pre @ k_pre.repeat_interleave(g, 0).transpose(1, 2)
                            P_c = q_pre @ (k_pre @ A @ B.transpose(1, 2)).repeat_interleave(
                                g, 0).transpose(1, 2)
                            unrotated = float(((P - P_c) ** 2).sum() / (P ** 2).sum())
                            got = errs[l][s][0]
                            if ranks == d:
                                self.assertLess(got, 1e-20, f"{m} layer {l}")
                                self.assertLess(errs[l][s][1], 1e-20, f"{m} layer {l}")
                            else:
                                self.assertGreater(got, 1e-8)
                                # transformers' RoPE tables are float32 even in a
                                # float64 model, this test's float64.
                                self.assertLess(abs(got - want) / want, 1e-6,
                                                f"{m} layer {l} seq {s}: {got} vs {want}")
                                self.assertGreater(abs(got - unrotated) / want, 1e-3)

    # -- in situ ------------------------------------------------------------

    def test_insitu_equals_export_then_calibrate(self):
        out = os.path.join(self.wd, "insitu-pre.h5")
        p = insitu(self.model, out, "--keys", "pre-rope")
        self.assertIn("keys before RoPE", p.stdout)
        with h5py.File(out) as a, h5py.File(self.proj_pre) as b:
            self.assertEqual(attr(a, "rope"), "pre")
            names = []
            a.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
            worst = 0.0
            for n in names:
                x, y = a[n][...], b[n][...]
                if "rank" in n:
                    np.testing.assert_array_equal(x, y, err_msg=n)
                else:
                    worst = max(worst, float(np.abs(x - y).max() / max(np.abs(y).max(), 1e-300)))
            self.assertLess(worst, 1e-10)
            hash_pre = attr(a, "inputs_hash")
        post = os.path.join(self.wd, "insitu-post.h5")
        insitu(self.model, post)
        with h5py.File(post) as f:
            self.assertEqual(attr(f, "rope"), "post")
            self.assertNotEqual(attr(f, "inputs_hash"), hash_pre)
        # --skip-done redoes an output made with the other --keys.
        p = insitu(self.model, post, "--skip-done", "--keys", "pre-rope")
        self.assertIn("no caches written", p.stdout)
        with h5py.File(post) as f:
            self.assertEqual(attr(f, "rope"), "pre")

    def test_insitu_checkpoint_of_other_keys_is_refused(self):
        ckpt, out = os.path.join(self.wd, "ckpt"), os.path.join(self.wd, "cut.h5")
        import subprocess
        subprocess.run([sys.executable, "-m", "kqsvd.calibrate_hf", "--model", self.model, "--text",
                        TEXT, "--seq-len", str(SEQ), "--num-seqs", str(TRAIN), "--out", out,
                        "--checkpoint", ckpt, "--checkpoint-every", "0"], capture_output=True,
                       env=dict(MPIENV, KQSVD_TEST_FAULT="window-3:kill"))
        with open(os.path.join(ckpt, "rank-0-of-1.json")) as f:
            self.assertEqual(json.load(f)["done"], 3)
        p = insitu(self.model, out, "--checkpoint", ckpt, "--keys", "pre-rope", expect=1)
        self.assertIn("rank-0-of-1.json: field 'inputs' differs", p.stderr)
        self.assertIn("--keys", p.stderr)
        self.assertFalse(os.path.exists(out))


if __name__ == "__main__":
    unittest.main()
