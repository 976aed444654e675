"""The Python side on a CUDA device: in-situ calibration with the model on
the GPU (the fold there, --fold torch with QR or --qr gram, per head and
in head groups, or in the C library, --fold c) and
the quality command, against the same runs on the CPU.  Skipped (ctest
says so) where PyTorch sees no GPU.  The tiny model's tokenizer is made
here from the bundled text, so no model package is needed."""
import json
import os
import sys
import unittest

import h5py
import numpy as np
from common import TEXT, run, workdir


def cuda():
    import torch
    return torch.cuda.is_available()


def tiny_model(folder):
    """A random GQA Llama with a word-level tokenizer of the bundled text."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train([TEXT], trainers.WordLevelTrainer(vocab_size=2000, special_tokens=["[UNK]"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    fast.save_pretrained(folder)
    cfg = LlamaConfig(vocab_size=fast.vocab_size, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(1)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # scores that are not flat
        for lay in model.model.layers:
            lay.self_attn.q_proj.weight.mul_(8.0)
            lay.self_attn.k_proj.weight.mul_(8.0)
    model.save_pretrained(folder)
    return folder


def datasets(path):
    with h5py.File(path) as f:
        return {f"{g}/{k}": f[g][k][...] for g in ("kqsvd", "ksvd", "eigen", "spectra") for k in f[g]}


@unittest.skipUnless(cuda(), "PyTorch sees no CUDA device")
class OnTheGPU(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.wd = workdir("gpu")
        cls.model = tiny_model(os.path.join(cls.wd, "model"))

    def calibrate(self, device, fold, *extra):
        out = os.path.join(self.wd, f"proj-{device}-{fold}{''.join(extra)}.h5")
        run([sys.executable, "-m", "kqsvd.calibrate_hf", "--model", self.model, "--text", TEXT,
             "--seq-len", "64", "--num-seqs", "16", "--dtype", "f64", "--device", device,
             "--fold", fold, "--out", out, "--force", *extra])
        return datasets(out)

    def test_insitu_on_the_gpu_equals_the_cpu(self):
        def worst(a, b):
            return max(np.abs(a[k] - b[k]).max() / (np.abs(a[k]).max() or 1.0) for k in a)
        cpu, torch_fold, c_fold = (self.calibrate(*run) for run in
                                   (("cpu", "c"), ("cuda", "torch"), ("cuda", "c")))
        # The same rows folded on the GPU (cuSOLVER) and in the C library.
        self.assertLess(worst(c_fold, torch_fold), 1e-9)
        # The model on the GPU: transformers computes RoPE's cos and sin in
        # float32, which the GPU rounds otherwise than the CPU (measured on an
        # H100: 1.1e-6, in K-SVD's vectors, the most sensitive).
        self.assertLess(worst(cpu, torch_fold), 1e-5)
        # The Gram fold on the GPU (batched float64 GEMMs), per head and in
        # head groups, against the C library's Householder fold of the same
        # rows.
        for groups in ((), ("--head-groups", "2")):
            ref = self.calibrate("cuda", "c", *groups)
            gram = self.calibrate("cuda", "torch", "--qr", "gram", *groups)
            self.assertLess(worst(ref, gram), 1e-9, groups)

    def test_quality_on_the_gpu_equals_the_cpu(self):
        proj = os.path.join(self.wd, "proj-cpu-c.h5")
        if not os.path.exists(proj):
            self.calibrate("cpu", "c")
        reports = {}
        for device in ("cpu", "cuda"):
            reports[device] = os.path.join(self.wd, f"q-{device}.json")
            run([sys.executable, "-m", "kqsvd.quality", "--model", self.model, "--text", TEXT,
                 "--proj", proj, "--ranks", "fixed:16,fixed:4", "--methods", "kqsvd,ksvd",
                 "--seq-len", "64", "--num-seqs", "4", "--dtype", "float64", "--device", device,
                 "--json", reports[device]])
        a, b = (json.load(open(reports[d])) for d in ("cpu", "cuda"))
        for x, y in zip([a["full"]] + a["results"], [b["full"]] + b["results"]):
            self.assertLess(abs(x["perplexity"] / y["perplexity"] - 1), 1e-7)



@unittest.skipUnless(cuda(), "PyTorch sees no CUDA device")
class TritonOnTheGPU(unittest.TestCase):
    """The Triton decode kernels (attention/triton_decode.py) on CUDA
    tensors, as kqsvd.compressed() reads them there: the stores' products
    against their dequantized values in float64, every width, both axes,
    runs of their own bits; and decode steps of a compressed model read as
    codes against the same steps dequantized (KQSVD_DECODE=torch)."""

    def test_products(self):
        import torch
        from kqsvd.attention import kernel
        from kqsvd.attention.quant import RunStore, Store
        dev = torch.device("cuda")
        self.assertEqual(kernel.backend(torch.zeros(1, device=dev)), "triton")
        g = torch.Generator(device=dev).manual_seed(0)
        stores = [(Store(b, group, axis, 2), n) for b in (2, 3, 4, 8)
                  for axis in ("channel", "token") for n, group in ((1, 32), (37, 8), (190, 32))]
        stores.append((RunStore([(5, 8), (20, 3), (7, 2)], 4, "token"), 32))
        for st, n in stores:
            for T in (1, 77, 1100):  # 1100: the value sum split over programs
                st.append(torch.randn(2, 3, T, n, generator=g, device=dev) * 3 + 1, read=False)
                N = len(st)
                x = st.values(torch.float64).double()
                q = torch.randn(2, 3, 5, n, generator=g, device=dev)
                s = st.scores(q, torch.zeros(2, 3, 5, N + 4, device=dev))[..., :N]
                want = q.double() @ x.transpose(-1, -2)
                self.assertLess(float((s - want).abs().max()), 1e-5 * float(want.abs().max()))
                p = torch.softmax(torch.randn(2, 3, 5, N, generator=g, device=dev), -1)
                want = p.double() @ x
                self.assertLess(float((st.weigh(p) - want).abs().max()),
                                1e-5 * float(want.abs().max()))

    def test_quantizes_to_the_bit(self):
        import torch
        from kqsvd.attention import kernel
        from kqsvd.attention.quant import quantize
        g = torch.Generator(device="cuda").manual_seed(1)
        for x in (torch.randn(3, 5, 37, generator=g, device="cuda") * 4,
                  torch.randint(-8, 9, (1, 4, 64), generator=g, device="cuda").float() / 2,
                  torch.randn(2, 8, 1, 96, generator=g, device="cuda").to(torch.bfloat16)):
            for bits in (2, 3, 4, 8):
                for group in (3, 32):
                    want = quantize(x, bits, group)
                    got = [torch.zeros_like(w) for w in want]
                    self.assertTrue(kernel.quantize_into(x, bits, group, got))
                    for a, b, name in zip(got, want, ("codes", "scale", "zero")):
                        self.assertTrue(torch.equal(a, b), f"{name}: {bits} bits, group {group}")

    def test_decode_steps(self):
        import torch
        from unittest import mock
        from common import orthonormal_projections, tiny_lm
        from kqsvd.attention import compressed, latent_cache, triton_decode
        from kqsvd.compat import cache_kwarg
        from kqsvd.formats.quant import QuantScheme, with_bits
        model = tiny_lm("llama", 97, seed=3, heads=4, kv_heads=2, hidden=64).cuda()
        proj = with_bits(orthonormal_projections(model, 12, seed=1), (4, 3),
                         QuantScheme(group=8, residual=3))
        ids = torch.randint(0, 97, (2, 60), generator=torch.Generator().manual_seed(5)).cuda()
        got, calls = [], []
        real = triton_decode.scores

        def counted(*a, **k):
            calls.append(1)
            return real(*a, **k)
        for env in ("", "torch"):
            with mock.patch.dict(os.environ, {"KQSVD_DECODE": env}), \
                    mock.patch.object(triton_decode, "scores", counted), torch.no_grad(), \
                    compressed(model, proj):
                cache = latent_cache(model)
                key = cache_kwarg(model)  # cache from transformers 5.24 on
                model(input_ids=ids[:, :45], **{key: cache}, use_cache=True)
                for t in range(45, 60):
                    out = model(input_ids=ids[:, t:t + 1], **{key: cache}, use_cache=True)
                got.append(out.logits.float())
            if not env:
                self.assertGreater(len(calls), 0, "the steps read codes through Triton")
        torch.testing.assert_close(got[0], got[1], rtol=0, atol=1e-4)


if __name__ == "__main__":
    unittest.main()
