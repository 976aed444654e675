"""The Triton decode kernels (attention/triton_decode.py) on the CPU,
under Triton's interpreter: the steps, stores and tiers that
test_decode_codes and test_tiers read through libkqsvd, read through
Triton instead (KQSVD_DECODE=triton) and held to the same tolerances
against the dequantized path; the two kernels against libkqsvd's on the
same stores; bench/gpu_decode.py on a tiny model; and the switch's
refusals.  On a GPU the same kernels serve CUDA tensors: test_gpu's
TritonOnTheGPU checks them there (bench/gpu_decode.sh runs it).

The switches are set for the whole process (run.py runs one module per
process), before Triton makes its kernels: the interpreter is chosen
then."""
import os

os.environ["TRITON_INTERPRET"] = "1"
os.environ["KQSVD_DECODE"] = "triton"

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import unittest  # noqa: E402
from unittest import mock  # noqa: E402

import torch  # noqa: E402

import test_decode_codes  # noqa: E402
import test_tiers  # noqa: E402
from kqsvd.attention import kernel  # noqa: E402
from kqsvd.attention.quant import RunStore, Store  # noqa: E402
from kqsvd.errors import KqsvdError  # noqa: E402


class Steps(test_decode_codes.Steps):
    pass


class Plain(test_decode_codes.Plain):
    pass


class Products(test_decode_codes.Products):
    pass


class Tiers(test_tiers.Cache):
    CODES = "triton"


class AgainstTheLibrary(unittest.TestCase):
    """Both kernels on the same stores: Triton's and libkqsvd's products
    to float32 round-off, odd token counts, one column, every width, groups
    that do not divide the tokens, runs of their own bits."""

    def both(self, st, q, p, N):
        got = []
        for mode in ("triton", ""):
            with mock.patch.dict(os.environ, {"KQSVD_DECODE": mode}):
                self.assertEqual(kernel.backend(q), mode or "native")
                st.reader = kernel.reader(q)  # chosen once per store: here, for each kernel
                got.append((st.scores(q, torch.zeros(*q.shape[:3], N)), st.weigh(p)))
        return got

    def test_the_same_products(self):
        self.assertIsNotNone(kernel.library(), "libkqsvd with the decode kernels is not built")
        g = torch.Generator().manual_seed(3)
        stores = [(Store(b, group, axis, residual), n)
                  for b in (2, 3, 4, 8) for axis in ("token", "channel")
                  for n, group, residual in ((1, 32, 0), (37, 5, 3), (70, 32, 0))]
        stores.append((RunStore([(5, 8), (20, 3), (1, 2), (6, 4)], 7, "token", 2), 32))
        stores.append((RunStore([(3, 4), (9, 2)], 4, "channel"), 12))
        for st, n in stores:
            for T in (1, 67, 129):
                st.append(torch.randn(2, 3, T, n, generator=g) * 2 - 1, read=False)
                N = len(st) + 2
                q = torch.randn(2, 3, 5, n, generator=g)
                p = torch.softmax(torch.randn(2, 3, 5, N, generator=g), -1)
                (s1, w1), (s2, w2) = self.both(st, q, p, N)
                what = f"{type(st).__name__} {n} columns, {len(st)} tokens"
                torch.testing.assert_close(s1, s2, rtol=1e-5, atol=1e-5 * float(s2.abs().max()),
                                           msg=what)
                torch.testing.assert_close(w1, w2, rtol=1e-5, atol=1e-5 * float(w2.abs().max()),
                                           msg=what)

    def test_quantizes_to_the_bit(self):
        """triton_decode.quantize_into against quant.quantize, the
        documented scheme: random rows, exact halves (ties to even),
        constant groups (scale 0), short last groups, bf16 input, and a
        store's own strided view as the destination."""
        from kqsvd.attention import triton_decode
        from kqsvd.attention.quant import quantize
        g = torch.Generator().manual_seed(1)
        cases = [torch.randn(3, 5, 37, generator=g) * 4,
                 torch.randint(-8, 9, (1, 4, 64), generator=g).float() / 2,
                 torch.full((1, 2, 16), 0.3), torch.randn(1, 7, 3, generator=g) * 1e3,
                 torch.randn(2, 2, 9, 33, generator=g).to(torch.bfloat16)]
        for x in cases:
            for bits in (2, 3, 4, 8):
                for group in (1, 3, 8, 32):
                    want = quantize(x, bits, group)
                    got = [torch.zeros_like(w) for w in want]
                    self.assertTrue(triton_decode.quantize_into(x, bits, group, got))
                    for a, b, name in zip(got, want, ("codes", "scale", "zero")):
                        self.assertTrue(torch.equal(a, b), f"{name}: {bits} bits, group {group}")
        st = Store(3, 8, "token")
        st.append(torch.randn(2, 3, 5, 20, generator=g), read=False)
        y = torch.randn(2, 3, 1, 20, generator=g)
        dest, _ = st.reserve(y, -2)
        self.assertFalse(dest[0].is_contiguous())
        self.assertTrue(triton_decode.quantize_into(y, 3, 8, dest))
        for a, b in zip(dest, quantize(y, 3, 8)):
            self.assertTrue(torch.equal(a, b))
        # per channel: blocks of 4 tokens, each channel's 4 values a row,
        # written into the store's view of its next blocks
        st = Store(2, 4, "channel")
        st.append(torch.randn(2, 3, 8, 6, generator=g), read=False)
        y = torch.randn(2, 3, 8, 6, generator=g).view(2, 3, 2, 4, 6).transpose(-1, -2)
        dest, _ = st.reserve(y, -3)
        self.assertTrue(triton_decode.quantize_into(y, 2, 4, dest))
        for a, b in zip(dest, quantize(y, 2, 4)):
            self.assertTrue(torch.equal(a, b))

    def test_the_switch(self):
        x = torch.zeros(1, 1, 1, 4)
        self.assertEqual(kernel.backend(x), "triton")
        self.assertIsNone(kernel.backend(x.double()), "float64 keeps the dequantized path")
        for env, msg in (({"KQSVD_DECODE": "cuda"}, "KQSVD_DECODE=cuda: expected one of"),
                         ({"TRITON_INTERPRET": "0"}, "needs TRITON_INTERPRET=1")):
            with mock.patch.dict(os.environ, env), self.assertRaises(KqsvdError) as e:
                kernel.backend(x)
            self.assertIn(msg, str(e.exception))
        with mock.patch.dict(os.environ, {"KQSVD_DECODE": "torch"}):
            self.assertIsNone(kernel.backend(x))


class Arguments(unittest.TestCase):
    """The kernels' arguments checked before each launch: a size, dtype,
    layout or scheme the kernel would index past (on a GPU, memory
    corruption) is a KqsvdError of one line naming the argument, and
    nothing is written; a non-contiguous q is read right; empty operands
    give empty results."""

    def setUp(self):
        from kqsvd.attention import triton_decode
        self.td = triton_decode
        g = torch.Generator().manual_seed(5)
        self.st = Store(4, 8, "token")
        self.st.append(torch.randn(1, 2, 40, 20, generator=g), read=False)
        self.q = torch.randn(1, 2, 3, 20, generator=g)
        self.x = torch.randn(2, 3, 37, generator=g)

    def refused(self, call, *args, says):
        with self.assertRaises(KqsvdError) as e:
            call(*args)
        msg = str(e.exception)
        self.assertEqual(len(msg.splitlines()), 1, msg)
        self.assertIn(says, msg)

    @staticmethod
    def inside(shape, room, dtype=torch.float32):
        """A contiguous tensor of `shape` at the start of a zeroed buffer
        `room` elements longer: what a kernel writes past it lands in the
        rest, which the test reads."""
        n = torch.Size(shape).numel()
        buf = torch.zeros(n + room, dtype=dtype)
        return buf[:n].view(shape), buf[n:]

    def test_scores(self):
        st, q, td = self.st, self.q, self.td
        out, past = self.inside((1, 2, 3, 10), 200)
        self.refused(td.scores, st.layout, q, out, says="scores: out torch.float32 [1, 2, 3, 10]")
        self.assertEqual(int(past.count_nonzero()), 0, "written past out")
        for bad, says in ((q[..., :10].contiguous(), "q torch.float32 [1, 2, 3, 10]"),
                          (q.double(), "q torch.float64"), (q.half(), "q torch.float16"),
                          (q[:, :1].contiguous(), "q torch.float32 [1, 1, 3, 20]"),
                          ("q", "q str")):
            self.refused(td.scores, st.layout, bad, torch.zeros(1, 2, 3, 40), says=says)
        for bad, says in ((torch.zeros(1, 2, 3, 40, dtype=torch.float64), "out torch.float64"),
                          (torch.zeros(1, 2, 2, 40), "q's query rows"),
                          (torch.zeros(1, 2, 40, 3).transpose(-1, -2), "contiguous")):
            self.refused(td.scores, st.layout, q, bad, says=says)
        # a q whose rows are not adjacent: read through its strides
        qn = torch.randn(1, 2, 20, 3).transpose(-1, -2)
        out = torch.zeros(1, 2, 3, 41)
        td.scores(st.layout, qn, out)
        want = qn @ st.values(torch.float32).transpose(-1, -2)
        torch.testing.assert_close(out[..., :40], want, rtol=1e-5, atol=1e-4)
        self.assertEqual(int(out[..., 40:].count_nonzero()), 0)

    def test_weigh(self):
        st, td = self.st, self.td
        p, _ = self.inside((1, 2, 3, 10), 200)
        p.fill_(1.0)
        self.refused(td.weigh, st.layout, p, says="weigh: p torch.float32 [1, 2, 3, 10]")
        for bad, says in ((torch.zeros(1, 2, 3, 40, dtype=torch.float16), "p torch.float16"),
                          (torch.zeros(1, 2, 3, 40, dtype=torch.float64), "p torch.float64"),
                          (torch.zeros(2, 2, 3, 40), "p torch.float32 [2, 2, 3, 40]")):
            self.refused(td.weigh, st.layout, bad, says=says)
        pn = torch.softmax(torch.randn(1, 2, 40, 3), -2).transpose(-1, -2)
        torch.testing.assert_close(td.weigh(st.layout, pn), pn @ st.values(torch.float32),
                                   rtol=1e-5, atol=1e-5)

    def test_stores(self):
        td, q = self.td, self.q
        for call, arg in ((td.scores, (q, torch.zeros(1, 2, 3, 40))),
                          (td.weigh, (torch.zeros(1, 2, 3, 40),))):
            empty = Store(4, 8, "token", residual=4)
            self.refused(call, empty.layout, *arg, says="holding quantized tokens")
            empty.append(torch.randn(1, 2, 3, 20), read=False)  # held as they came
            self.refused(call, empty.layout, *arg, says="holding quantized tokens")
            self.refused(call, None, *arg, says="store NoneType")
            self.st.bits = 5
            self.refused(call, self.st.layout, *arg, says="bits 5: expected one of 2, 3, 4, 8")
            self.st.bits = 4
            self.st.done = 10 ** 6
            self.refused(call, self.st.layout, *arg, says="in room for")
            self.st.done = 40
            self.st.group = 4  # its scales laid out for groups of 8
            self.refused(call, self.st.layout, *arg, says="store scale torch.float16 [1, 2,")
            self.st.group = 8

    def test_empty_operands(self):
        st, td = self.st, self.td
        out = torch.zeros(1, 2, 0, 40)
        td.scores(st.layout, self.q[:, :, :0], out)
        got = td.weigh(st.layout, torch.zeros(1, 2, 0, 40))
        self.assertEqual(got.shape, (1, 2, 0, 20))
        st0 = Store(4, 8, "token")  # a batch of no sequences
        st0.append(torch.randn(0, 2, 9, 20), read=False)
        td.scores(st0.layout, torch.zeros(0, 2, 3, 20), torch.zeros(0, 2, 3, 9))
        self.assertEqual(td.weigh(st0.layout, torch.zeros(0, 2, 3, 9)).shape, (0, 2, 3, 20))
        for x in (torch.randn(2, 3, 0), torch.randn(0, 3, 37)):
            dest = [torch.zeros(*x.shape[:-1], w, dtype=dt) for w, dt in (
                ((x.shape[-1] + 7) // 8 * 4, torch.uint8), (-(-x.shape[-1] // 8), torch.half),
                (-(-x.shape[-1] // 8), torch.half))]
            self.assertTrue(td.quantize_into(x, 4, 8, dest))

    def test_quantize_into(self):
        td, x = self.td, self.x
        codes, past = self.inside((2, 3, 19), 64, torch.uint8)  # 20 bytes a row at 4 bits
        scale, zero = (torch.zeros(2, 3, 5, dtype=torch.half) for _ in range(2))
        self.refused(td.quantize_into, x, 4, 8, (codes, scale, zero),
                     says="quantize_into: dest codes torch.uint8 [2, 3, 19] on cpu: expected "
                          "torch.uint8 [2, 3, 20]")
        self.assertEqual(int(past.count_nonzero()), 0, "written past codes")
        self.assertEqual(int(codes.count_nonzero()), 0, "written before refusing")
        good = (torch.zeros(2, 3, 25, dtype=torch.uint8), scale, zero)
        self.refused(td.quantize_into, x, 5, 8, good, says="bits 5: expected one of 2, 3, 4, 8")
        for group in (0, -3, 2.5, None):
            self.refused(td.quantize_into, x, 4, group, good, says=f"group {group!r}")
        self.refused(td.quantize_into, x, 4, 8, good[:2], says="dest tuple")
        self.refused(td.quantize_into, x, 4, 8, (good[0][..., :20], scale.float(), zero),
                     says="dest scale torch.float32")
        self.refused(td.quantize_into, x.int(), 4, 8, good, says="x torch.int32")
        # float64 rows quantize as quant.quantize takes them: through float32
        from kqsvd.attention.quant import quantize
        got = [torch.zeros_like(w) for w in quantize(x, 4, 8)]
        self.assertTrue(td.quantize_into(x.double(), 4, 8, got))
        for a, b in zip(got, quantize(x.double(), 4, 8)):
            self.assertTrue(torch.equal(a, b))
        # rows whose bytes are not adjacent: not rows the kernel writes
        wide = torch.zeros(2, 3, 20, 2, dtype=torch.uint8)[..., 0]
        self.assertFalse(td.quantize_into(x, 4, 8, (wide, scale, zero)))


class Bench(unittest.TestCase):
    """bench/gpu_decode.py, the device run's decode figures, on a tiny
    random model on the CPU: every point and configuration measured, the
    quarter's bytes below the full cache's, the refusal of bad points."""

    def test_tiny(self):
        from common import workdir
        bench = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "gpu_decode.py")
        out = os.path.join(workdir("gpu-decode"), "rows.json")
        r = subprocess.run([sys.executable, bench, "--shape", "tiny", "--device", "cpu",
                            "--points", "90x2,40x1", "--configs", "full,kqsvd", "--steps", "2",
                            "--chunk", "32", "--rank", "12", "--json", out],
                           capture_output=True, text=True, timeout=300)
        self.assertEqual(r.returncode, 0, r.stderr[-2000:])
        with open(out) as f:
            rows = json.load(f)["rows"]
        self.assertEqual([(x["context"], x["batch"], x["config"]) for x in rows],
                         [(90, 2, "full"), (90, 2, "kqsvd"), (40, 1, "full"), (40, 1, "kqsvd")])
        for x in rows:
            self.assertGreater(x["tokens_per_s"], 0)
            if x["config"] == "kqsvd":
                # rank 12 of 16 at 4 bits, scales of 4 bytes per 32: 0.234 of the full cache,
                # plus the keys of a block not yet complete held as they came (10 of 42
                # tokens at 40 x 1) and the buffers' room (at most an eighth), as measured
                self.assertLess(x["bytes_over_full"], 0.35 if x["context"] == 90 else 0.45)
        r = subprocess.run([sys.executable, bench, "--shape", "tiny", "--rank", "12", "--json", out],
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 2)
        self.assertIn("already exists", r.stderr.splitlines()[-1])
        r = subprocess.run([sys.executable, bench, "--points", "16k"], capture_output=True,
                           text=True, timeout=60)
        self.assertEqual(r.returncode, 2)
        self.assertIn("--points '16k': expected CONTEXTxBATCH", r.stderr.splitlines()[-1])

    def test_cache_budget(self):
        """--cache-budget: at each context, each configuration's largest
        batch whose measured cache fits, the kqsvd quarter's several
        times the full cache's; the batch above it is over the budget."""
        from common import workdir
        bench = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "gpu_decode.py")
        out = os.path.join(workdir("gpu-decode-budget"), "rows.json")
        budget = 96 * 2**10
        r = subprocess.run([sys.executable, bench, "--shape", "tiny", "--device", "cpu",
                            "--cache-budget", "96KiB", "--contexts", "40", "--configs",
                            "full,kqsvd", "--steps", "2", "--chunk", "32", "--rank", "8",
                            "--json", out, "--force"],
                           capture_output=True, text=True, timeout=300)
        self.assertEqual(r.returncode, 0, r.stderr[-2000:])
        with open(out) as f:
            report = json.load(f)
        full, latent = report["rows"]
        self.assertEqual(report["cache_budget"], budget)
        for x in (full, latent):
            self.assertLessEqual(x["bytes"], budget)
            self.assertGreater(x["next_batch_bytes"], budget)
            self.assertTrue(x["largest_confirmed"])
            self.assertEqual(x["tried"][str(x["batch"])], x["bytes"])
        self.assertGreater(latent["batch"], 2 * full["batch"])
        r = subprocess.run([sys.executable, bench, "--cache-budget", "lots"],
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 2)
        self.assertIn("--cache-budget lots", r.stderr.splitlines()[-1])


def load_tests(loader, tests, pattern):
    suite = unittest.TestSuite()
    for cls in (Steps, Plain, AgainstTheLibrary, Arguments, Bench):
        suite.addTests(loader.loadTestsFromTestCase(cls))
    suite.addTests([Products("test_scores_and_sums"), Products("test_the_codes_are_the_stores"),
                    Tiers("test_codes_read_as_the_floats")])
    return suite


if __name__ == "__main__":
    unittest.main()
