"""Bad input to the library calls and to the package's environment, as a
new user gives it (py_hostile): the Calibrator binding's arguments, the
quantization attributes of a projections file, new ranks over a file with
bits, the safetensors export of a quantized latent, the console scripts
without torch, a missing system library, and a peer the frontier cannot
use.  Each case asserts one line naming the argument, attribute or file,
no traceback, nothing written, and the inputs byte-identical."""
import hashlib
import os
import shutil
import subprocess
import sys
import textwrap
import unittest

import h5py
import numpy as np
from common import ROOT, TEXT, tiny_decoder, workdir

import kqsvd
from kqsvd.calibration.calibrator import Calibrator
from kqsvd.formats.projections import METHODS, load_projections
from kqsvd.formats.saving import save_ranks
from kqsvd.formats.quant import QuantScheme

L, HKV, GROUP, D, HIDDEN = 2, 2, 2, 8, 16


def digest(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def calibrated(path, head_groups=1):
    """A projections file of random rows through the binding (fixed:4)."""
    rng = np.random.default_rng(3)
    cal = Calibrator(L, HKV, GROUP, D, HIDDEN, head_groups=head_groups)
    for layer in range(L):
        for h in range(0, HKV, head_groups):
            for t in ("keys", "values"):
                cal.absorb(t, layer, h, rng.standard_normal((40, D * head_groups)))
        for h in range(HKV):
            for j in range(GROUP):
                cal.absorb("queries", layer, h, rng.standard_normal((40, D)), query=j)
        cal.absorb_oproj(layer, rng.standard_normal((HIDDEN, HKV * GROUP * D)))
    cal.finish("fixed:4").write(path, model="random")
    cal.close()
    return path


def one_line(test, text, *words):
    text = str(text)
    lines = [x for x in text.splitlines() if x.strip()]
    test.assertEqual(len(lines), 1, text)
    test.assertNotIn("Traceback", text)
    for w in words:
        test.assertIn(w, lines[0])
    return lines[0]


def python(code, env=None, cwd=None):
    """Runs code in a new interpreter of this environment (the package on
    its path): (exit status, stderr)."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "python"), env.get("PYTHONPATH", "")])
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                       text=True, env=env, cwd=cwd, timeout=300)
    return p.returncode, p.stderr


class Library(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.wd = workdir("hostile-library")
        cls.proj = calibrated(os.path.join(cls.wd, "proj.h5"))
        cls.bits = os.path.join(cls.wd, "bits.h5")
        ranks = {m: (np.full((L, HKV), 4), np.full((L, HKV), 3)) for m in METHODS}
        bits = {m: (np.full((L, HKV), 4), np.full((L, HKV), 2)) for m in METHODS}
        save_ranks(cls.proj, cls.bits, ranks, "quality-bits:0.25", bits=bits,
                   scheme=QuantScheme(group=4))

    def setUp(self):
        self.out = workdir("hostile-library-out")
        self.inputs = {p: digest(p) for p in (self.proj, self.bits)}

    def tearDown(self):
        for p, h in self.inputs.items():
            self.assertEqual(digest(p), h, f"{p} changed")

    def refused(self, exc, call, *words):
        before = sorted(os.listdir(self.out))
        with self.assertRaises(exc) as cm:
            call()
        self.assertEqual(sorted(os.listdir(self.out)), before, "something was written")
        return one_line(self, cm.exception, *words)

    # -- 6: new ranks over a file with bits -----------------------------------
    def test_new_ranks_drop_the_bits_of_other_ranks(self):
        self.assertEqual(load_projections(self.bits, "kqsvd").bits_k.tolist(), [[4, 4]] * L)
        out = os.path.join(self.out, "half.h5")
        save_ranks(self.bits, out, {"kqsvd": (4, 4)}, "quality-budget:0.5")
        p = load_projections(out, "kqsvd")
        self.assertIsNone(p.bits_k)
        self.assertIsNone(p.quant)
        self.assertAlmostEqual(p.cache_kept(), 0.5)
        # a method given no new ranks keeps its bits, and the scheme with them
        self.assertEqual(load_projections(out, "ksvd").bits_v.tolist(), [[2, 2]] * L)
        every = os.path.join(self.out, "every.h5")
        save_ranks(self.bits, every, {m: (4, 4) for m in METHODS}, "fixed:4")
        with h5py.File(every, "r") as f:
            self.assertFalse([a for a in f.attrs if a.startswith("quant_")])
            self.assertFalse([n for m in METHODS for n in f[m] if n.startswith("bits_")])

    # -- 7: the safetensors export of a quantized latent ----------------------
    def test_export_carries_bits_and_scheme(self):
        import json
        from safetensors import safe_open
        out = os.path.join(self.out, "bits.safetensors")
        kqsvd.export_safetensors(self.bits, out, "kqsvd")
        with safe_open(out, "pt") as f:
            meta = f.metadata()
        self.assertEqual(json.loads(meta["bits_k_heads"]), [[4, 4]] * L)
        self.assertEqual(json.loads(meta["bits_v_heads"]), [[2, 2]] * L)
        self.assertEqual(json.loads(meta["quant"]), {"group": 4, "key_axis": "channel",
                                                     "value_axis": "token", "residual": 0,
                                                     "rotate": False})
        plain = os.path.join(self.out, "plain.safetensors")
        kqsvd.export_safetensors(self.proj, plain, "kqsvd")
        with safe_open(plain, "pt") as f:
            self.assertNotIn("bits_k_heads", f.metadata())

    # -- 9, 13: every quantization attribute checked when the file is read ----
    def test_quant_attributes(self):
        cases = [("quant_group", 32.0), ("quant_group", 1.5), ("quant_group", "32"),
                 ("quant_group", [32, 32]), ("quant_group", 2 ** 40), ("quant_group", 0),
                 ("quant_group", True), ("quant_rotate", 2), ("quant_rotate", -1),
                 ("quant_rotate", 0.5), ("quant_residual", -1), ("quant_residual", 2 ** 40),
                 ("quant_key_axis", "diagonal"), ("quant_value_axis", 3),
                 ("quant_key_axis", ["channel", "token"])]
        for attr, value in cases:
            with self.subTest(attr=attr, value=value):
                bad = os.path.join(self.out, "bad.h5")
                shutil.copyfile(self.bits, bad)
                with h5py.File(bad, "r+") as f:
                    f.attrs[attr] = value
                with self.assertRaises(kqsvd.KqsvdError) as cm:
                    load_projections(bad, "kqsvd")
                self.assertNotIsInstance(cm.exception, kqsvd.UsageError)  # a bad file, not a call
                one_line(self, cm.exception, bad, f"'{attr}'")
                os.remove(bad)

    def test_bits_stored_as_groups(self):
        """A bits field that is an HDF5 group, not a dataset, in either
        form: one KqsvdError naming the file and the field (it was h5py's
        TypeError in load_projections, the quality command and the
        frontier, which all read bits here)."""
        for form, side in (("heads", "k"), ("cols", "k"), ("cols", "v")):
            with self.subTest(form=form, side=side):
                bad = os.path.join(self.out, "bad.h5")
                shutil.copyfile(self.bits, bad)
                with h5py.File(bad, "r+") as f:
                    g = f["kqsvd"]
                    b = {s: g[f"bits_{s}_heads"][...] for s in "kv"}
                    for s in "kv":
                        del g[f"bits_{s}_heads"]
                        name = f"bits_{s}_{form}"
                        if s == side:
                            g.create_group(name)
                        else:  # the other side as a well-formed dataset of its form
                            cols = np.zeros((L, HKV, D), np.int32)
                            cols[:, :, :4] = 4
                            g[name] = b[s] if form == "heads" else cols
                with self.assertRaises(kqsvd.KqsvdError) as cm:
                    load_projections(bad, "kqsvd")
                self.assertNotIsInstance(cm.exception, kqsvd.UsageError)
                one_line(self, cm.exception, bad, f"'kqsvd/bits_{side}_{form}'", "group",
                         "dataset")
                os.remove(bad)

    def test_calls_found_by_their_docstrings(self):
        """What writing the public API's docstrings found: each of these
        raised a bare TypeError, ValueError or KeyError."""
        import torch
        from kqsvd.formats.projections import policy_ranks
        U = kqsvd.UsageError
        self.refused(U, lambda: policy_ranks(None), "path", "file name")
        self.refused(kqsvd.KqsvdError, lambda: kqsvd.fold_o_proj(torch.zeros(4), torch.zeros(
            (1, 2, 2)), 2), "o_proj", "[D, Hq d]")
        self.refused(kqsvd.KqsvdError, lambda: kqsvd.fold_o_proj(torch.zeros((4, 4)), torch.zeros(
            (2, 2)), 2), "value_up")
        ranks = (np.full((L, HKV), 4), np.full((L, HKV), 3))
        out = os.path.join(self.out, "x.h5")
        self.refused(U, lambda: save_ranks(self.proj, out, {"kqsvd": ranks}, "p",
                                           tuned={"ksvd": (None, None)}), "ksvd", "no new ranks")
        self.refused(U, lambda: save_ranks(self.proj, out, {"palu": ranks}, "p"), "'palu'")

    def test_unquantized_in_files_before_the_one_encoding(self):
        """An older file said 0 for an unquantized unit (bits_*_heads); it
        loads as the one encoding says it, 16, and costs the same bytes as
        a file that says 16."""
        old, new = (os.path.join(self.out, f"{n}.h5") for n in ("old", "new"))
        for path, value in ((old, 0), (new, 16)):
            shutil.copyfile(self.bits, path)
            with h5py.File(path, "r+") as f:
                f["kqsvd/bits_k_heads"][0, 1] = value
        a, b = load_projections(old, "kqsvd"), load_projections(new, "kqsvd")
        self.assertEqual(a.bits_k.tolist(), b.bits_k.tolist())
        self.assertEqual(int(a.bits_k[0, 1]), 16)
        self.assertEqual(a.cache_kept(), b.cache_kept())
        self.assertGreater(a.cache_kept(), load_projections(self.bits, "kqsvd").cache_kept())

    def test_seq_len_bounded_by_tokens(self):
        """seq_len, the longest calibration window, is no more than the
        tokens the file saw: 2^62 or 2^64 - 1 beside tokens = 512 only
        silenced the short-window warning."""
        from kqsvd.formats.projections import calibrated_seq_len, window_warning
        bad = os.path.join(self.out, "window.h5")
        shutil.copyfile(self.proj, bad)
        for tokens, seq_len, ok in ((512, 256, True), (512, 512, True), (512, 513, False),
                                    (512, np.int64(2 ** 62), False),
                                    (512, np.uint64(2 ** 64 - 1), False),
                                    (0, np.int64(2 ** 62), False), (0, 4096, True)):
            with self.subTest(tokens=tokens, seq_len=seq_len):
                with h5py.File(bad, "r+") as f:
                    f.attrs["tokens"] = np.int64(tokens)
                    f.attrs["seq_len"] = seq_len
                if ok:
                    self.assertEqual(calibrated_seq_len(bad), int(seq_len))
                    continue
                for call in (calibrated_seq_len, lambda p: window_warning(p, 100)):
                    with self.assertRaises(kqsvd.KqsvdError) as cm:
                        call(bad)
                    one_line(self, cm.exception, bad, "'seq_len'")
        os.remove(bad)

    # -- 8, 19, 21: the binding's arguments, under its documented name -------
    def test_documented_name(self):
        from kqsvd import Calibrator as C
        self.assertIs(kqsvd.Calibrator, Calibrator)
        self.assertIs(C, Calibrator)
        self.assertIn("Calibrator", kqsvd.__all__)

    def test_every_public_name_resolves(self):
        """Each name of kqsvd.__all__ is an attribute of the package, and
        the calls docs/guide/inference.md makes on it are among them."""
        from kqsvd import attention
        for name in kqsvd.__all__:
            self.assertIsNotNone(getattr(kqsvd, name), name)
        self.assertIs(kqsvd.reading_codes, attention.reading_codes)
        with open(os.path.join(ROOT, "docs", "guide", "inference.md"), encoding="utf-8") as f:
            guide = f.read()
        for name in ("compress", "compressed", "latent_cache", "reading_codes", "cache_bytes",
                     "fold_o_proj", "export_safetensors", "load_projections"):
            self.assertIn(f"{name}(", guide)
            self.assertIn(name, kqsvd.__all__)

    def test_policies_as_the_commands_write_them(self):
        """load_projections reads a policy with formats.policy, the commands'
        one grammar: bits after '@', stored, a tiered layout, as the
        commands resolve them (quality.measure.resolve_policies)."""
        from kqsvd.quality.measure import resolve_policies
        for text in ("fixed:4@4", "fixed:3@4/8", "stored@2", "stored", "tiers:w8+0.5x4@4+0.5xdrop"):
            p = load_projections(self.proj, "kqsvd", text)
            [(label, _, want)] = resolve_policies(self.proj, [text], ["kqsvd"], L)
            for field in ("rank_k_heads", "rank_v_heads", "bits_k", "bits_v"):
                np.testing.assert_array_equal(getattr(p, field), getattr(want, field), field)
            self.assertEqual((p.quant, p.policy), (want.quant, label), text)
            self.assertEqual(p.tiers and p.tiers[0], want.tiers and want.tiers[0], text)
        p = load_projections(self.proj, "kqsvd", "fixed:3@4/8")
        self.assertEqual((p.bits_k.max(), p.bits_v.max(), p.quant), (4, 8, QuantScheme()))
        self.assertEqual(load_projections(self.proj, "kqsvd", "tiers:w8+1x4@4").tiers[0].window, 8)
        self.refused(kqsvd.UsageError, lambda: load_projections(self.proj, "kqsvd", "fixed:4@5"),
                     "fixed:4@5", "bits")
        self.refused(kqsvd.UsageError,
                     lambda: load_projections(self.proj, "kqsvd", "quality-budget:0.5"),
                     "quality-budget:0.5", "python -m kqsvd.quality")

    def test_renamed_names_keep_working_for_a_release(self):
        """Each public name renamed or moved in 0.5's redesign (renamed.py)
        still works, with a DeprecationWarning naming the new one at the
        caller's line; the new names warn nothing."""
        import importlib
        import warnings
        from kqsvd.calibration import calibrator, result
        from kqsvd.formats import saving

        def old(call, new):
            with self.assertWarns(DeprecationWarning) as w:
                got = call()
            self.assertIn(new, str(w.warning))
            self.assertEqual(w.filename, __file__)
            return got
        cal = old(lambda: Calibrator(layers=1, kv_heads=1, group=2, head_dim=4, hidden=4),
                  "q_per_kv=")
        self.assertEqual(cal.shape.q_per_kv, 2)
        self.assertEqual(old(lambda: cal.shape.group, "q_per_kv"), 2)
        from types import SimpleNamespace

        from kqsvd.attention import LayerProjection
        one = SimpleNamespace(q_per_kv=3)  # a LayerProjection's attribute, read as its class does
        self.assertEqual(old(lambda: LayerProjection.g.fget(one), "q_per_kv"), 3)
        binding = importlib.import_module("kqsvd.calibration.binding")
        projections = importlib.import_module("kqsvd.formats.projections")
        for module, name, now in ((binding, "Calibrator", calibrator),
                                  (binding, "check_policy", calibrator),
                                  (binding, "Result", result),
                                  (projections, "save_ranks", saving)):
            self.assertIs(old(lambda: getattr(module, name), now.__name__), getattr(now, name))
        self.refused(kqsvd.UsageError, lambda: Calibrator(layers=1, kv_heads=1, q_per_kv=2,
                                                          group=2, head_dim=4, hidden=4),
                     "Calibrator()", "q_per_kv", "group")
        with self.assertRaises(AttributeError):
            binding.nosuch  # noqa: B018
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            again = Calibrator(layers=1, kv_heads=1, q_per_kv=2, head_dim=4, hidden=4)
            self.assertEqual(again.shape.q_per_kv, 2)
        again.close()
        cal.close()

    def test_calibrator_arguments(self):
        U = kqsvd.UsageError
        self.refused(U, lambda: Calibrator(L, HKV, GROUP, D, HIDDEN, head_groups=2 ** 70),
                     "head_groups", str(2 ** 70))
        self.refused(U, lambda: Calibrator(L, HKV, GROUP, D, HIDDEN, head_groups=1.5),
                     "head_groups", "1.5")
        self.refused(U, lambda: Calibrator(L, 3, GROUP, D, HIDDEN, head_groups=2),
                     "head_groups", "divide")
        self.refused(U, lambda: Calibrator(L, HKV, GROUP, 2 ** 64, HIDDEN), "head_dim")
        self.refused(U, lambda: Calibrator(L, HKV, GROUP, D, HIDDEN, mem_limit_mib="a lot"),
                     "mem_limit_mib")
        cal = Calibrator(L, HKV, GROUP, D, HIDDEN)
        rows = np.zeros((5, D))
        self.refused(U, lambda: cal.absorb("bogus", 0, 0, rows), "tensor", "'bogus'")
        self.refused(U, lambda: cal.absorb("keys", 1.0, 0, rows), "layer", "1.0")
        self.refused(U, lambda: cal.absorb("keys", L, 0, rows), "layer", f"0..{L - 1}")
        self.refused(U, lambda: cal.absorb("keys", 0, -1, rows), "kv_head")
        self.refused(U, lambda: cal.absorb("queries", 0, 0, rows, query=GROUP), "query")
        self.refused(U, lambda: cal.absorb_oproj(True, np.zeros((HIDDEN, HKV * GROUP * D))),
                     "layer")
        for layer in range(L):
            cal.absorb_oproj(layer, np.zeros((HIDDEN, HKV * GROUP * D)))
        self.refused(U, lambda: cal.finish(None), "ranks", "None")
        self.refused(U, lambda: cal.finish("fixed:4", beta=float("nan")), "beta")
        self.refused(U, lambda: cal.factor("bogus", 0, 0), "tensor")
        res = cal.finish("fixed:4")
        self.refused(U, lambda: res.matrix("kqsvd", "key_up", 0, 0), "which", "'key_up'")
        self.refused(U, lambda: res.sigma("palu", False, 0, 0), "method", "'palu'")
        self.refused(U, lambda: res.write(os.path.join(self.out, "p.h5"), tokens=-1), "tokens")
        self.refused(U, lambda: res.write(os.path.join(self.out, "p.h5"), rope="sideways"),
                     "rope")
        res.close()
        cal.close()

    def test_rows_as_wide_as_the_head(self):
        U = kqsvd.UsageError
        cal = Calibrator(L, HKV, GROUP, D, HIDDEN)
        self.refused(U, lambda: cal.absorb("keys", 0, 0, np.zeros((5, D + 1))), "keys",
                     f"{D + 1} wide", f"expected {D}")
        self.refused(U, lambda: cal.absorb_oproj(0, np.zeros((HIDDEN, D))), "o_proj",
                     f"{HKV * GROUP * D}")
        self.assertEqual(cal.tokens(), 0)  # nothing was folded
        cal.close()
        grouped = Calibrator(L, HKV, GROUP, D, HIDDEN, head_groups=2)
        self.refused(U, lambda: grouped.absorb("queries", 0, 0, np.zeros((5, 2 * D))), "queries",
                     f"{2 * D} wide", f"expected {D}")
        self.refused(U, lambda: grouped.absorb("values", 0, 0, np.zeros((5, D))), "values",
                     f"expected {2 * D}", "2 heads")
        grouped.absorb("keys", 0, 0, np.ones((5, 2 * D)))  # the group's width is taken
        grouped.close()

    def test_closed_handles(self):
        """Every call on a closed Calibrator or Result raises KqsvdError
        naming the state; none reaches the C library with a NULL handle
        (tokens() read 0 there, ranks() dereferenced NULL)."""
        cal = Calibrator(L, HKV, GROUP, D, HIDDEN)
        for layer in range(L):
            cal.absorb_oproj(layer, np.zeros((HIDDEN, HKV * GROUP * D)))
        res = cal.finish("fixed:4")
        cal.close()
        res.close()
        path = os.path.join(self.out, "x.h5")
        calls = {"tokens()": lambda: cal.tokens(),
                 "absorb()": lambda: cal.absorb("keys", 0, 0, np.zeros((2, D))),
                 "absorb_oproj()": lambda: cal.absorb_oproj(0, np.zeros((HIDDEN, HKV * GROUP * D))),
                 "factor()": lambda: cal.factor("keys", 0, 0),
                 "save()": lambda: cal.save(path), "load()": lambda: cal.load(self.proj),
                 "reduce()": lambda: cal.reduce(None), "finish()": lambda: cal.finish("fixed:4")}
        for what, call in calls.items():
            self.refused(kqsvd.KqsvdError, call, f"Calibrator.{what}", "closed")
        for what, call in {"ranks()": lambda: res.ranks("kqsvd"),
                           "matrix()": lambda: res.matrix("kqsvd", "key_down", 0, 0),
                           "sigma()": lambda: res.sigma("kqsvd", False, 0, 0),
                           "write()": lambda: res.write(path)}.items():
            self.refused(kqsvd.KqsvdError, call, f"Result.{what}", "closed")
        cal.close()  # twice: nothing to free

    def test_arguments_in_the_callers_words(self):
        """What the library says names the Python call and its arguments,
        not the command line's flags nor the C library's functions."""
        cal = Calibrator(L, HKV, GROUP, D, HIDDEN)
        self.refused(kqsvd.UsageError, lambda: cal.reduce(object()), "comm", "mpi4py")
        line = self.refused(kqsvd.UsageError, lambda: cal.finish("fixed:4", beta=2.0),
                            "finish(ranks='fixed:4', beta=2.0)", "o_proj", "absorb_oproj()")
        line += self.refused(kqsvd.UsageError, lambda: cal.finish("bogus:1"), "bogus:1")
        for flag in ("--ranks", "--beta", "kqsvd_", "force in"):
            self.assertNotIn(flag, line)
        cal.close()

    # -- 3: Result.write onto what is not a regular file ---------------------
    # (python/tests/test_hostile_outputs.py)

    # -- 15: handles collected at interpreter exit ----------------------------
    def test_handles_alive_at_exit(self):
        code, err = python("""
            import numpy as np
            from kqsvd.calibration import binding, calibrator, result
            cal = calibrator.Calibrator(1, 1, 1, 4, 4)
            cal.absorb("keys", 0, 0, np.ones((3, 4)))
            cal.absorb_oproj(0, np.ones((4, 4)))
            res = cal.finish("fixed:2")
            # What the interpreter does to a module's globals at exit, when
            # handles outlive it: each becomes None.
            for module in (binding, calibrator, result):
                for name in [n for n in vars(module) if not n.startswith("__")]:
                    setattr(module, name, None)
            del cal, res
            """)
        self.assertEqual((code, err), (0, ""))


class Environment(unittest.TestCase):
    """What the package needs around it: torch for the model commands, the
    system libraries of the C side, and the peers' own environment."""

    @classmethod
    def setUpClass(cls):
        cls.wd = workdir("hostile-env")
        cls.model = tiny_decoder("llama", os.path.join(cls.wd, "model"))
        cls.proj = calibrated(os.path.join(cls.wd, "proj.h5"))

    # -- 12: the console scripts where torch is not installed ----------------
    def test_commands_without_torch(self):
        out = os.path.join(self.wd, "out")
        os.makedirs(out, exist_ok=True)
        m, t = self.model, TEXT
        argv = {
            "quality": ["--model", m, "--text", t, "--proj", self.proj, "--ranks", "fixed:2",
                        "--json", f"{out}/q.json"],
            "allocate": ["--model", m, "--text", t, "--proj", self.proj, "--budget", "0.5",
                         "--out", f"{out}/a.h5"],
            "calibrate_hf": ["--model", m, "--text", t, "--seq-len", "8", "--num-seqs", "2",
                             "--out", f"{out}/c.h5"],
            "frontier": ["--model", m, "--text", t, "--plain", "4", "--quantized-cache", "",
                         "--presses", "", "--json", f"{out}/f.json"],
            "export": ["--model", m, "--text", t, "--seq-len", "8", "--num-seqs", "2", "--split", "train",
                       "--out", f"{out}/e"],
        }
        for name, args in argv.items():
            with self.subTest(name):
                code, err = python(f"""
                    import sys
                    sys.modules["torch"] = None     # as in an environment without it
                    from kqsvd.commands import {name}
                    sys.exit({name}.main({args!r}))
                    """)
                self.assertEqual(code, 1, err)
                one_line(self, err, "torch", "pip install 'kqsvd[torch]'")
                self.assertEqual(os.listdir(out), [])

    # -- 18: a system library missing under the C side -----------------------
    def fake_native(self):
        """A libkqsvd.so and a kqsvd executable that link libgone.so.1,
        which is then removed (as a missing libmpi would be)."""
        fake = os.path.join(self.wd, "fake")
        if os.path.isdir(fake):
            return fake
        os.makedirs(fake)
        with open(os.path.join(fake, "gone.c"), "w") as f:
            f.write("int gone(void) { return 0; }\n")
        with open(os.path.join(fake, "k.c"), "w") as f:
            f.write("int gone(void);\nint main(void) { return gone(); }\n")
        cc = ["cc", "-Wl,-rpath," + fake, "-L" + fake]
        subprocess.run(["cc", "-shared", "-fPIC", "-o", f"{fake}/libgone.so.1",
                        "-Wl,-soname,libgone.so.1", f"{fake}/gone.c"], check=True)
        subprocess.run(cc + ["-shared", "-fPIC", "-o", f"{fake}/libkqsvd.so", f"{fake}/k.c",
                             "-l:libgone.so.1"], check=True)
        subprocess.run(cc + ["-o", f"{fake}/kqsvd", f"{fake}/k.c", "-l:libgone.so.1"], check=True)
        os.remove(f"{fake}/libgone.so.1")
        return fake

    def test_missing_system_library(self):
        fake = self.fake_native()
        load = f"""
            import kqsvd
            try:
                kqsvd.load_projections({self.proj!r}, "kqsvd", "fixed:2")
            except kqsvd.KqsvdError as e:
                raise SystemExit("error: " + str(e))
            """
        for var in ("KQSVD_LIBRARY", "KQSVD_BIN"):  # the library, or the executable alone
            with self.subTest(var):
                env = dict(os.environ, **{var: os.path.join(fake, os.path.basename(
                    "libkqsvd.so" if var == "KQSVD_LIBRARY" else "kqsvd"))})
                code, err = python(load, env)
                self.assertEqual(code, 1, err)
                one_line(self, err, "needs libgone.so.1", "which this system does not have")

    def test_missing_system_library_before_the_model_loads(self):
        """The commands that resolve policies with `kqsvd ranks` find the
        missing library first: here the model cannot load at all, and the
        message is still the library's."""
        fake = self.fake_native()
        broken = os.path.join(self.wd, "broken-model")
        if not os.path.isdir(broken):
            shutil.copytree(self.model, broken)
            for f in os.listdir(broken):
                if f.endswith(".safetensors"):
                    with open(os.path.join(broken, f), "wb") as fh:
                        fh.write(b"not weights")
        out = os.path.join(self.wd, "lib-out")
        os.makedirs(out, exist_ok=True)
        env = dict(os.environ, KQSVD_LIBRARY=os.path.join(fake, "libkqsvd.so"))
        argv = {"quality": ["--model", broken, "--text", TEXT, "--proj", self.proj, "--ranks",
                            "fixed:2", "--json", f"{out}/q.json"],
                "frontier": ["--model", broken, "--text", TEXT, "--proj", self.proj, "--ranks",
                             "fixed:2", "--plain", "", "--quantized-cache", "", "--presses", "",
                             "--json", f"{out}/f.json"]}
        for name, args in argv.items():
            with self.subTest(name):
                code, err = python(f"""
                    import sys
                    from kqsvd.commands import {name}
                    sys.exit({name}.main({args!r}))
                    """, env)
                self.assertEqual(code, 1, err)
                one_line(self, err, "needs libgone.so.1")
                self.assertEqual(os.listdir(out), [])

    # -- 22: the frontier's peers, in an environment of their own ------------
    def test_peer_not_installed_or_incompatible(self):
        from kqsvd.quality import peers
        with self.assertRaises(kqsvd.UsageError) as cm:
            peers.need("kqsvd_no_such_peer", "the peer x")
        one_line(self, cm.exception, "kqsvd_no_such_peer", ".venv-peers")
        # a peer whose declared transformers range excludes the installed one
        site = os.path.join(self.wd, "site")
        info = os.path.join(site, "oldpeer-1.0.dist-info")
        os.makedirs(info, exist_ok=True)
        with open(os.path.join(info, "METADATA"), "w") as f:
            f.write("Metadata-Version: 2.1\nName: oldpeer\nVersion: 1.0\n"
                    "Requires-Dist: transformers<4.0\n")
        with open(os.path.join(site, "oldpeer.py"), "w") as f:
            f.write("")
        sys.path.insert(0, site)
        try:
            import importlib
            importlib.invalidate_caches()
            with self.assertRaises(kqsvd.UsageError) as cm:
                peers.need("oldpeer", "the peer y")
            one_line(self, cm.exception, "oldpeer 1.0", "transformers<4.0", "is installed",
                     ".venv-peers")
        finally:
            sys.path.remove(site)
            sys.modules.pop("oldpeer", None)

    def test_frontier_peer_missing(self):
        out = os.path.join(self.wd, "peer-out")
        os.makedirs(out, exist_ok=True)
        code, err = python(f"""
            import sys
            sys.modules["kvpress"] = None     # as where kvpress is not installed
            from kqsvd.commands import frontier
            sys.exit(frontier.main(["--model", {self.model!r}, "--text", {TEXT!r},
                                    "--plain", "", "--quantized-cache", "", "--presses", "snapkv",
                                    "--press-kept", "0.5", "--json", "{out}/f.json"]))
            """)
        self.assertEqual(code, 2, err)
        one_line(self, err, "snapkv", "kvpress", ".venv-peers")
        self.assertEqual(os.listdir(out), [])


if __name__ == "__main__":
    unittest.main()
