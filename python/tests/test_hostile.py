"""Bad input to the Python surfaces, as a new user gives it: the commands
(kqsvd.quality, kqsvd.allocate, kqsvd.calibrate_hf, examples/export_hf.py)
and the library calls (load_projections, compress, export_safetensors,
tune).  Every case asserts the exit status (2 for the command line and
outputs, 1 for input files), one line naming the option or file, that no
output and no temporary file is left, and that every input is unchanged,
byte for byte.  The commands run in this process where one rank suffices
(fast), under mpirun where the point is printing once."""
import contextlib
import hashlib
import io
import os
import shutil
import stat
import subprocess
import sys
import unittest

import h5py
import numpy as np
from common import EXPORT, MPIENV, TEXT, run, tiny_decoder, workdir

import kqsvd
from kqsvd.commands import allocate, calibrate_hf, quality


def digest(path):
    h = hashlib.sha256()
    for root, _, files in (os.walk(path) if os.path.isdir(path) else [("", [], [path])]):
        for f in sorted(files):
            with open(os.path.join(root, f), "rb") as fh:
                h.update(fh.read())
    return h.hexdigest()


def listing(folder):
    return sorted(os.listdir(folder))


class HostileCase(unittest.TestCase):
    """The fixture of the hostile tests: a tiny decoder calibrated in situ
    and a copy of the text (inputs, checked byte for byte after every
    case), and an output folder that is empty when a case starts."""
    WORK = "hostile"

    @classmethod
    def setUpClass(cls):
        cls.wd = workdir(cls.WORK)
        cls.model = tiny_decoder("llama", os.path.join(cls.wd, "model"))
        cls.proj = os.path.join(cls.wd, "proj.h5")
        run([sys.executable, "-m", "kqsvd.calibrate_hf", "--model", cls.model, "--text", TEXT,
             "--seq-len", "32", "--num-seqs", "4", "--out", cls.proj])
        cls.text = os.path.join(cls.wd, "text.txt")
        shutil.copyfile(TEXT, cls.text)

    def setUp(self):
        self.out = workdir(f"{self.WORK}-out")  # each case's outputs, empty at the start
        self.inputs = {p: digest(p) for p in (self.proj, self.text, self.model)}

    def tearDown(self):
        for p, h in self.inputs.items():
            self.assertEqual(digest(p), h, f"{p} changed")

    def one_error(self, code, got, err, words, before):
        """Exit status `got` is `code`, stderr `err` one line with one
        'error:' holding every word, and self.out as it was (`before`)."""
        lines = [x for x in err.splitlines() if x.strip()]
        self.assertEqual(got, code, err)
        self.assertEqual(len(lines), 1, err)
        self.assertNotIn("Traceback", err)
        self.assertEqual(lines[0].count("error:"), 1, lines[0])
        for w in words:
            self.assertIn(w, lines[0])
        self.assertEqual(set(listing(self.out)), before, f"left behind after: {lines[0]}")
        return lines[0]


class Hostile(HostileCase):
    # -- helpers --------------------------------------------------------------
    def call(self, main, argv):
        """main(argv) in this process: (exit status, stderr)."""
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = main(argv)
            except SystemExit as e:
                code = e.code
        return code, err.getvalue()

    def refused(self, main, argv, code, *words, leaves=()):
        """main(argv) exits `code` with one line holding every word, and
        self.out holds nothing afterwards but `leaves`."""
        before = set(listing(self.out)) | set(leaves)
        got, err = self.call(main, argv)
        return self.one_error(code, got, err, words, before)

    def quality(self, json_path, *extra, ranks="fixed:4", proj=None, text=None):
        return ["--model", self.model, "--text", text or self.text, "--proj", proj or self.proj,
                "--ranks", ranks, "--methods", "kqsvd", "--seq-len", "16", "--num-seqs", "1",
                "--json", json_path, *extra]

    def allocate(self, out, *extra):
        return ["--model", self.model, "--text", self.text, "--proj", self.proj, "--budget", "0.5",
                "--out", out, "--methods", "kqsvd", "--seq-len", "16", "--num-seqs", "1",
                "--rounds", "0", *extra]

    def calib(self, out, *extra):
        return ["--model", self.model, "--text", self.text, "--seq-len", "16", "--num-seqs", "2",
                "--out", out, *extra]

    # -- outputs that are inputs, devices, folders, or already there ---------
    def test_report_over_its_own_input(self):
        self.refused(quality.main, self.quality(self.proj), 2, "--json", "--proj", "input")
        link = os.path.join(self.out, "hard.json")
        os.link(self.proj, link)
        self.refused(quality.main, self.quality(link, "--force"), 2, "--json", "--proj",
                     leaves=["hard.json"])
        sym = os.path.join(self.out, "sym.json")
        os.symlink(self.text, sym)
        self.refused(quality.main, self.quality(sym, "--force"), 2, "--text", leaves=["sym.json"])
        self.refused(allocate.main, self.allocate(self.proj, "--force"), 2, "--out", "--proj")
        weights = os.path.join(self.model, "config.json")  # a file of the --model folder
        self.refused(quality.main, self.quality(weights, "--force"), 2, "--json", "--model")
        self.refused(calibrate_hf.main, self.calib(self.text, "--force"), 2, "--out", "--text")

    def test_outputs_that_are_not_files(self):
        fifo = os.path.join(self.out, "fifo.json")
        os.mkfifo(fifo)
        for path in ("/dev/null", fifo):
            self.refused(quality.main, self.quality(path, "--force"), 2, path, "regular file",
                         leaves=["fifo.json"])
        self.assertTrue(stat.S_ISCHR(os.stat("/dev/null").st_mode))
        self.assertTrue(stat.S_ISFIFO(os.stat(fifo).st_mode))
        self.refused(quality.main, self.quality(self.out), 2, "folder")
        self.refused(allocate.main, self.allocate(self.out), 2, "--out", "folder")
        self.refused(calibrate_hf.main, self.calib("/dev/null", "--force"), 2, "regular file")

    def test_outputs_that_cannot_be_made(self):
        missing = os.path.join(self.out, "no", "r.json")
        self.refused(quality.main, self.quality(missing), 2, "--json", "does not exist")
        self.refused(quality.main, self.quality("/proc/kqsvd-r.json"), 2, "--json", "/proc")
        self.refused(allocate.main, self.allocate("/proc/kqsvd.h5"), 2, "--out", "/proc")
        self.refused(calibrate_hf.main, self.calib(missing), 2, "--out", "does not exist")
        ro = os.path.join(self.out, "ro")
        os.makedirs(ro)
        os.chmod(ro, 0o555)  # read-only, for root too
        try:
            self.refused(quality.main, self.quality(os.path.join(ro, "r.json")), 2, "--json",
                         "read-only", leaves=["ro"])
            with self.assertRaises(kqsvd.UsageError):
                kqsvd.export_safetensors(self.proj, os.path.join(ro, "p.st"), "kqsvd", 4)
            self.assertEqual(listing(ro), [])
        finally:
            os.chmod(ro, 0o755)

    def test_existing_outputs_need_force(self):
        mine = os.path.join(self.out, "mine.json")
        with open(mine, "w") as f:
            f.write("the user's own file\n")
        want = digest(mine)
        self.refused(quality.main, self.quality(mine), 2, "--json", "--force", leaves=["mine.json"])
        self.refused(allocate.main, self.allocate(mine), 2, "--out", "--force", leaves=["mine.json"])
        self.refused(calibrate_hf.main, self.calib(mine), 2, "--out", "--force",
                     leaves=["mine.json"])
        self.assertEqual(digest(mine), want)
        # The fitted file beside a report is an output too.
        stem = os.path.join(self.out, "q")
        with open(f"{stem}.quality-budget-0.5.h5", "w") as f:
            f.write("x")
        self.refused(quality.main, self.quality(stem + ".json", ranks="quality-budget:0.5"), 2,
                     "quality-budget-0.5.h5", "--force", leaves=["q.quality-budget-0.5.h5"])

    def test_a_failed_write_names_the_output_and_leaves_nothing(self):
        import errno
        from kqsvd.formats.files import write_all
        report, plot = os.path.join(self.out, "r.json"), os.path.join(self.out, "r.png")
        seen = []

        def full(tmp):  # a disk that fills up while the second file is written
            seen.append(tmp)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), tmp)

        def h5_like(tmp):  # h5py's errors carry the name in the text, no strerror
            seen.append(tmp)
            raise OSError(f"Unable to create file (name = '{tmp}', errno = 28)")
        for second in (full, h5_like):
            with self.assertRaises(kqsvd.KqsvdError) as e:
                write_all([(report, lambda tmp: open(tmp, "w").write("{}")), (plot, second)])
            self.assertIn(plot, str(e.exception))
            self.assertNotIn(seen[-1], str(e.exception))
            self.assertEqual(listing(self.out), [])

    def test_two_outputs_one_file(self):
        same = os.path.join(self.out, "r.png")
        self.refused(quality.main, self.quality(same, "--plot", same), 2, "--plot", "also")

    def test_plot_without_matplotlib(self):
        saved = {k: v for k, v in sys.modules.items() if k.split(".")[0] == "matplotlib"}
        sys.modules["matplotlib"] = None  # import fails, as where it is not installed
        try:
            self.refused(quality.main, self.quality(os.path.join(self.out, "r.json"), "--plot",
                                                    os.path.join(self.out, "r.png")),
                         2, "--plot", "matplotlib")
        finally:
            del sys.modules["matplotlib"]
            sys.modules.update(saved)

    def test_a_good_run_keeps_the_users_files_and_the_umask(self):
        report = os.path.join(self.out, "r.json")
        own = report + ".tmp"
        with open(own, "w") as f:
            f.write("mine")
        with open(report, "w") as f:
            f.write("old")
        os.chmod(report, 0o600)
        old = os.umask(0o022)
        try:
            code, err = self.call(quality.main, self.quality(report, "--force"))
        finally:
            os.umask(old)
        self.assertEqual(code, 0, err)
        self.assertEqual(open(own).read(), "mine")
        self.assertEqual(stat.S_IMODE(os.stat(report).st_mode), 0o644)
        self.assertEqual(listing(self.out), ["r.json", "r.json.tmp"])

    # -- options: non-finite, out of range, twice, contradictory ---------------
    def test_bad_numbers_name_their_option(self):
        r = os.path.join(self.out, "r.json")
        for opt, val in (("--lr", "inf"), ("--lr", "nan"), ("--lr", "0"), ("--seq-len", "1"),
                         ("--num-seqs", "0"), ("--tune-steps", "-1"), ("--rounds", "x")):
            self.refused(quality.main, self.quality(r, opt, val), 2, opt, val)
        a = os.path.join(self.out, "a.h5")
        for opt, val in (("--lr", "nan"), ("--lr", "0"), ("--tune", "-1"), ("--rounds", "-1"),
                         ("--num-seqs", "0"), ("--budget", "inf"), ("--budget", "1.5")):
            self.refused(allocate.main, self.allocate(a, opt, val), 2, opt, val)
        self.refused(allocate.main, self.allocate(a, "--tune", "2", "--check-seqs", "0"), 2,
                     "--check-seqs 0", "--tune 2")
        c = os.path.join(self.out, "c.h5")
        for opt, val in (("--beta", "nan"), ("--beta", "-1"), ("--checkpoint-every", "inf"),
                         ("--eps", "nan"), ("--qr-block", "0")):
            self.refused(calibrate_hf.main, self.calib(c, opt, val), 2, opt, val)

    def test_unused_options_are_not_checked(self):
        out = os.path.join(self.out, "a.h5")
        code, err = self.call(allocate.main, self.allocate(out, "--check-seqs", "0"))
        self.assertEqual(code, 0, err)
        self.assertEqual(kqsvd.load_projections(out, "kqsvd").policy, "quality-budget:0.5")

    def test_repeats_and_contradictions(self):
        r = os.path.join(self.out, "r.json")
        self.refused(quality.main, self.quality(r, ranks="fixed:4,fixed:4"), 2, "--ranks",
                     "fixed:4", "twice")
        self.refused(calibrate_hf.main, self.calib(os.path.join(self.out, "c.h5"), "--force",
                                                   "--skip-done"), 2, "--force", "--skip-done")
        ck = os.path.join(self.out, "ck")
        with open(ck, "w") as f:
            f.write("")
        self.refused(calibrate_hf.main, self.calib(os.path.join(self.out, "c.h5"), "--checkpoint",
                                                   ck), 2, "--checkpoint", "file", leaves=["ck"])

    def test_one_rule_for_exit_statuses(self):
        """A missing input file exits 1 in every command; an option the
        model cannot take exits 2."""
        r, a = os.path.join(self.out, "r.json"), os.path.join(self.out, "a.h5")
        self.refused(quality.main, self.quality(r, text="/nope.txt"), 1, "/nope.txt")
        self.refused(allocate.main, [x if x != self.text else "/nope.txt"
                                     for x in self.allocate(a)], 1, "/nope.txt")
        self.refused(calibrate_hf.main, [x if x != self.text else "/nope.txt"
                                         for x in self.calib(a)], 1, "--text", "/nope.txt")
        self.refused(quality.main, self.quality(r, text="/dev/zero"), 1, "/dev/zero",
                     "not a regular file")
        for bad in ("", self.out + os.sep):
            self.refused(quality.main, self.quality(bad), 2, "--json", "give a file name")
        self.refused(quality.main, self.quality(r, "--seq-len", "1000"), 2, "--seq-len 1000",
                     "max_position_embeddings")
        line = self.refused(quality.main, self.quality(r, ranks="nonsense"), 2, "nonsense")
        self.assertNotIn("kqsvd ranks", line)

    def test_a_file_at_odds_with_itself(self):
        bad = os.path.join(self.out, "odd.h5")
        shutil.copyfile(self.proj, bad)
        with h5py.File(bad, "r+") as f:
            f.attrs["num_kv_heads"] = np.int32(1)
        self.refused(quality.main, self.quality(os.path.join(self.out, "r.json"), proj=bad), 1,
                     "inconsistent", "'num_kv_heads'", "kqsvd/key_down", leaves=["odd.h5"])

    def test_printed_once_under_mpirun(self):
        for extra, code, word in ((["--beta", "nan"], 2, "--beta"),
                                  (["--text", "/nope.txt"], 1, "/nope.txt")):
            argv = self.calib(os.path.join(self.out, "c.h5"))
            if extra[0] == "--text":
                argv[argv.index(self.text)] = extra[1]
            else:
                argv += extra
            p = run([sys.executable, "-m", "kqsvd.calibrate_hf"] + argv, expect=code, np_=2)
            lines = [x for x in p.stderr.splitlines() if "error" in x]
            self.assertEqual(len(lines), 1, p.stderr)
            self.assertIn(word, lines[0])
        self.assertEqual(listing(self.out), [])

    def test_terminated_run_leaves_nothing(self):
        """SIGTERM in the middle of a quality run: exit 130, no report, no
        temporary file."""
        import signal
        import time
        report = os.path.join(self.out, "r.json")
        argv = self.quality(report, ranks="fixed:2,fixed:3,fixed:4,fixed:5,fixed:6,fixed:7")
        argv[argv.index("--num-seqs") + 1] = "40"
        p = subprocess.Popen([sys.executable, "-m", "kqsvd.quality"] + argv, env=MPIENV,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        while True:  # until the passes run
            line = p.stderr.readline()
            if not line or line.startswith("quality"):
                break
        time.sleep(0.5)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=120)
        self.assertEqual(p.returncode, 130, err)
        self.assertIn("interrupted", err)
        self.assertEqual(listing(self.out), [])

    # -- the exporter ------------------------------------------------------------
    def test_exporter_outputs(self):
        def export(out, text=None):
            return subprocess.run([sys.executable, EXPORT, "--model", self.model, "--text",
                                   text or self.text, "--seq-len", "16", "--num-seqs", "1",
                                   "--split", "train", "--out", out], capture_output=True,
                                  text=True, env=MPIENV)
        inside = os.path.join(self.out, "exp")
        os.makedirs(inside)
        shutil.copyfile(self.text, os.path.join(inside, "t.txt"))
        for out, text, code, word in ((self.text, None, 2, "is a file"),
                                      (os.path.join(self.text, "x", "y"), None, 2, "is a file"),
                                      (self.model, None, 2, "lies inside"),
                                      (inside, os.path.join(inside, "t.txt"), 2, "lies inside"),
                                      (os.path.join(self.out, "e2"), "/nope.txt", 1, "/nope.txt")):
            p = export(out, text)
            lines = [x for x in p.stderr.splitlines() if x.strip()]
            self.assertEqual((p.returncode, len(lines)), (code, 1), p.stderr)
            self.assertIn(word, lines[0])
        self.assertEqual(listing(self.out), ["exp"])
        self.assertEqual(listing(inside), ["t.txt"])
        # Folders above --out that do not exist yet are made, as mkdir -p.
        nested = os.path.join(self.out, "a", "b", "train")
        p = export(nested)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertTrue(os.path.exists(os.path.join(nested, "model.h5")))
        shutil.rmtree(os.path.join(self.out, "a"))
        # A shard's or model.h5's name that is a FIFO is refused, not read
        # (reading one waits forever) nor replaced.
        for name in ("shard-0000.h5", "model.h5"):
            odd = os.path.join(self.out, "odd")
            os.makedirs(odd)
            os.mkfifo(os.path.join(odd, name))
            p = export(odd)
            lines = [x for x in p.stderr.splitlines() if x.strip()]
            self.assertEqual((p.returncode, len(lines)), (1, 1), p.stderr)
            self.assertIn(f"{name}: not a regular file", lines[0])
            self.assertEqual(listing(odd), [name])
            self.assertTrue(stat.S_ISFIFO(os.stat(os.path.join(odd, name)).st_mode))
            shutil.rmtree(odd)

    # -- the library -------------------------------------------------------------
    def test_library_ranks(self):
        for bad in (0, -1, 17, True, [4], [4.0, 4.0], (4, 4, 4), {"rank_k": 4}, 3.5, "fixed:99",
                    "nonsense"):
            with self.assertRaises(kqsvd.UsageError) as e:
                kqsvd.load_projections(self.proj, "kqsvd", bad)
            msg = str(e.exception)
            self.assertNotIn("--", msg, msg)  # no command-line flags in a library's words
            self.assertTrue("ranks" in msg or "rank policy" in msg, msg)
        for path, method in ((None, "kqsvd"), (self.proj, None), (self.proj, ["kqsvd"])):
            with self.assertRaises(kqsvd.UsageError):
                kqsvd.load_projections(path, method)
        with self.assertRaises(kqsvd.UsageError):
            kqsvd.save_ranks(self.proj, os.path.join(self.out, "s.h5"), [4, 4], "x")
        ok = kqsvd.load_projections(self.proj, "kqsvd", (8, 4))
        self.assertEqual((ok.rank_k.tolist(), ok.rank_v.tolist()), ([8, 8], [4, 4]))

    def test_library_compress_and_export(self):
        import torch
        from kqsvd.models import load
        model, _, _ = load(self.model)
        ids = torch.arange(5, 21)[None]
        before = model(input_ids=ids).logits
        with self.assertRaises(kqsvd.UsageError) as e:
            kqsvd.compress(model, self.proj)
        self.assertIn("load_projections", str(e.exception))
        self.assertTrue(torch.equal(model(input_ids=ids).logits, before))
        self.assertEqual(model.config._attn_implementation, "eager")  # nothing installed
        proj = kqsvd.load_projections(self.proj, "kqsvd", 4)
        w = [lay.self_attn.o_proj.weight.detach() for lay in model.model.layers]
        st = os.path.join(self.out, "p.safetensors")
        for kw, word in (({"o_proj": w[:1]}, "o_proj"), ({"o_proj": [w[0][:, :8], w[1]]}, "o_proj[0]")):
            with self.assertRaises(kqsvd.UsageError) as e:
                kqsvd.export_safetensors(proj, st, **kw)
            self.assertIn(word, str(e.exception))
        for path, word in ((self.out, "folder"), (os.path.join(self.out, "no", "p.st"), "exist"),
                           (self.proj, "input"), ("/proc/p.st", "/proc")):
            with self.assertRaises(kqsvd.UsageError) as e:
                kqsvd.export_safetensors(self.proj, path, "kqsvd", 4, force=True)
            self.assertIn(word, str(e.exception))
        self.assertEqual(listing(self.out), [])
        with open(st, "w") as f:
            f.write("old")
        os.chmod(st, 0o600)
        with self.assertRaises(kqsvd.UsageError):
            kqsvd.export_safetensors(proj, st)  # there already
        old = os.umask(0o022)
        try:
            kqsvd.export_safetensors(proj, st, o_proj=w, force=True)
        finally:
            os.umask(old)
        self.assertEqual(stat.S_IMODE(os.stat(st).st_mode), 0o644)
        self.assertEqual(listing(self.out), ["p.safetensors"])

    def test_compressed_leaves_the_model_as_it_was(self):
        import torch
        from kqsvd.models import load
        model, _, _ = load(self.model)
        ids = torch.arange(5, 37)[None]

        def state():  # parameters; config; modules, attributes and hooks
            return ({k: v.clone() for k, v in model.state_dict().items()},
                    model.config.to_json_string(), dict(model.config.__dict__),
                    [(n, m, dict(m.__dict__)) for n, m in model.named_modules()])
        before, logits = state(), model(input_ids=ids).logits
        proj = kqsvd.load_projections(self.proj, "kqsvd", 4)
        for kw in ({}, {"fold": True}):
            with kqsvd.compressed(model, proj, **kw) as m:
                inside = m(input_ids=ids).logits
                self.assertGreater((inside - logits).abs().max().item(), 1e-3)  # compressed
            after = state()
            self.assertTrue(all(torch.equal(before[0][k], after[0][k]) for k in before[0]))
            self.assertEqual(before[1:], after[1:])
            self.assertTrue(torch.equal(model(input_ids=ids).logits, logits))
        # Projections installed before the block are there again after it.
        kqsvd.compress(model, kqsvd.load_projections(self.proj, "ksvd", 3))
        outer = model(input_ids=ids).logits
        with kqsvd.compressed(model, proj, fold=True):
            pass
        self.assertTrue(torch.equal(model(input_ids=ids).logits, outer))
        kqsvd.compress(model, None)
        self.assertEqual(before[1:], state()[1:])
        # An error inside the block restores too; one before it changes nothing.
        with self.assertRaises(RuntimeError):
            with kqsvd.compressed(model, proj):
                raise RuntimeError("the user's")
        self.assertEqual(before[1:], state()[1:])
        other = kqsvd.load_projections(self.proj, "kqsvd", 4)
        other.num_kv_heads = 1  # projections of another model
        with self.assertRaises(kqsvd.KqsvdError):
            with kqsvd.compressed(model, other):
                pass
        self.assertEqual(before[1:], state()[1:])
        self.assertTrue(torch.equal(model(input_ids=ids).logits, logits))

    def test_library_tune(self):
        from kqsvd.models import load
        from kqsvd.quality.tune import tune
        model, _, _ = load(self.model)
        proj = kqsvd.load_projections(self.proj, "kqsvd", 4)
        fit = np.arange(2, 34, dtype=np.int64).reshape(2, 16)
        for kw in ({"lr": float("inf")}, {"lr": float("nan")}, {"lr": 0.0}, {"steps": -1},
                   {"steps": True}):
            with self.assertRaises(kqsvd.UsageError):
                tune(model, proj, fit[:1], fit[1:], **kw)
        # A loss that is not finite is an error, not a result to keep.
        import torch
        with torch.no_grad():
            model.model.embed_tokens.weight[fit[1, 3]] = float("nan")
        with self.assertRaises(kqsvd.KqsvdError) as e:
            tune(model, proj, fit[:1], fit[1:], steps=2)
        self.assertIn("not finite", str(e.exception))


    def test_unsupported_transformers(self):
        import re
        import transformers
        from kqsvd.compat import TRANSFORMERS, check_transformers
        from kqsvd.models import load
        for v in ("4.30.0", "99.0.0", "4.44.0.dev0" if TRANSFORMERS[0] > "4.44" else "1.0"):
            with self.assertRaises(kqsvd.KqsvdError) as e:
                check_transformers(v)
            self.assertIn(f"transformers {v} is installed", str(e.exception))
            self.assertIn(f">={TRANSFORMERS[0]},<{TRANSFORMERS[1]}", str(e.exception))
        check_transformers()  # the installed one is supported
        real = transformers.__version__
        transformers.__version__ = "4.30.0"
        try:
            with self.assertRaises(kqsvd.KqsvdError):
                load(self.model)
            with self.assertRaises(kqsvd.KqsvdError):
                kqsvd.compress(None, None)
        finally:
            transformers.__version__ = real
        # pyproject.toml declares the same range.
        with open(os.path.join(os.path.dirname(kqsvd.__file__), "..", "..", "pyproject.toml")) as f:
            declared = re.search(r'"transformers>=([0-9.]+),<([0-9.]+)"', f.read())
        self.assertEqual(declared.groups(), TRANSFORMERS)
        # ... which holds both ends that the test environments pin
        from kqsvd.compat import _key
        root = os.path.join(os.path.dirname(kqsvd.__file__), "..", "..")
        for name in ("requirements-hf.txt", "requirements-floor.txt"):
            with open(os.path.join(root, "examples", name)) as f:
                pin = re.search(r"^transformers==(\S+)", f.read(), re.M).group(1)
            check_transformers(pin)
            self.assertLess(_key(pin), _key(TRANSFORMERS[1]), name)

    def test_new_ranks_over_a_file_with_bits(self):
        """kqsvd.allocate on a quality-bits file: the bits were fitted for
        the file's ranks, and the output holds the budget it names."""
        from kqsvd.formats.saving import save_ranks
        from kqsvd.formats.quant import QuantScheme
        bits = os.path.join(self.out, "bits.h5")
        four = {"kqsvd": (np.full((2, 2), 4), np.full((2, 2), 4))}
        save_ranks(self.proj, bits, four, "quality-bits:0.1", scheme=QuantScheme(),
                   bits={"kqsvd": (np.full((2, 2), 2), np.full((2, 2), 2))})
        half = os.path.join(self.out, "half.h5")
        argv = self.allocate(half)
        argv[argv.index("--proj") + 1] = bits
        got, err = self.call(allocate.main, argv)
        self.assertEqual(got, 0, err)
        p = kqsvd.load_projections(half, "kqsvd")
        self.assertIsNone(p.bits_k)
        self.assertEqual(p.policy, "quality-budget:0.5")
        self.assertAlmostEqual(p.cache_kept(), 0.5, delta=0.07)


if __name__ == "__main__":
    unittest.main()
