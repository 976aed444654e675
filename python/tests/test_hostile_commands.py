"""Bad input to the measuring commands (python -m kqsvd.quality, python -m
kqsvd.frontier), as test_hostile.py gives it to the others: each case
asserts the exit status, one stderr line naming the option, file or
policy, no Traceback, nothing left in the output folder (no temporary
file either) and every input unchanged.  Mistakes the files alone reveal
are refused before the model loads (the cases patch the loader to fail
the test if it runs), and fitted files are written with the report or
not at all.  Also (issue 61): a FIFO given as an input file (which HDF5
would wait on forever), a full disk under the fitted files, and the
exporter's --out naming a device or a FIFO."""
import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import unittest
from unittest import mock

from common import MPIENV, ROOT
from test_hostile import HostileCase, listing

from kqsvd.commands import allocate, export, frontier, quality

NO_LOAD = mock.patch("kqsvd.models.load", side_effect=AssertionError("the model was loaded"))


class HostileCommands(HostileCase):
    WORK = "hostile-commands"

    # -- helpers --------------------------------------------------------------
    def refused(self, main, argv, code, *words, leaves=(), loads=False):
        """main(argv) in this process exits `code` with one line holding
        every word, self.out holding nothing afterwards but `leaves`;
        unless `loads`, without loading the model."""
        before = set(listing(self.out)) | set(leaves)
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()), \
                (contextlib.nullcontext() if loads else NO_LOAD):
            got = main(argv)
        return self.one_error(code, got, err.getvalue(), words, before)

    def quality(self, *extra, ranks="quality-bits:0.25", seq_len=16, num_seqs=1):
        return ["--model", self.model, "--text", self.text, "--proj", self.proj, "--ranks", ranks,
                "--methods", "kqsvd", "--seq-len", str(seq_len), "--num-seqs", str(num_seqs),
                "--calib-seqs", "2", "--rounds", "0", "--tune-steps", "1", "--check-seqs", "1",
                "--json", os.path.join(self.out, "q.json"), *extra]

    def frontier(self, *extra):
        return ["--model", self.model, "--text", self.text, "--plain", "4", "--quantized-cache",
                "none", "--presses", "none", "--context", "16", "--continuation", "4",
                "--num-seqs", "1", "--json", os.path.join(self.out, "f.json"), *extra]

    # -- one parser of rank policies for every command ---------------------------
    def test_bits_after_a_policy_in_the_quality_command(self):
        """`fixed:4@4` and `stored@4/8` are read by the quality command as
        the frontier reads them: the latent's columns quantized at those
        bits, so fewer bytes than the same ranks unquantized; bits after a
        fitted policy, or bits outside BITS, are refused before the load."""
        out = os.path.join(self.out, "q.json")
        argv = self.quality("--force", ranks="fixed:4,fixed:4@4,stored@4/8")
        argv[argv.index("--json") + 1] = out
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            self.assertEqual(quality.main(argv), 0)
        with open(out) as f:
            rows = {r["policy"]: r for r in json.load(f)["results"]}
        self.assertEqual(set(rows), {"fixed:4", "fixed:4@4", "eps:0.1@4/8"})
        self.assertLess(rows["fixed:4@4"]["cache_kept"], rows["fixed:4"]["cache_kept"])
        self.assertEqual(rows["fixed:4@4"]["rank_k"], rows["fixed:4"]["rank_k"])
        os.remove(out)
        for ranks, code, words in (("quality-budget:0.5@4", 2, ("quality-budget:0.5@4", "@bits")),
                                   ("fixed:4@5", 2, ("fixed:4@5", "'@'"))):
            self.refused(quality.main, self.quality(ranks=ranks), code, *words)

    # -- the quality command: fitted files go with the report ------------------
    def test_checks_that_need_no_fit_come_first(self):
        # a text too short for the measured windows, found before the fit
        self.refused(quality.main, self.quality(num_seqs=500), 1, self.text, "500", loads=True)
        # a bad policy after one that fits
        self.refused(quality.main, self.quality(ranks="quality-bits:0.25,nonsense"), 2,
                     "nonsense", loads=True)

    def test_a_fraction_no_fit_can_meet(self):
        # rank 1 per unit: 3 bits of keys per channel, 16 of unquantized values, of 2 x 16 x 16
        line = self.refused(quality.main, self.quality(ranks="quality-budget:0.5,quality-bits:1e-9"),
                            2, "quality-bits:1e-09", "smallest", "quality-bits:0.03711 or more")
        self.assertNotIn("quality-budget", line)
        for pol in ("quality-budget", "quality-tuned"):
            self.refused(quality.main, self.quality(ranks=f"{pol}:1e-9"), 2, f"{pol}:1e-09",
                         "least fraction")
        from kqsvd.formats.quant import QuantScheme
        from kqsvd.quality.bits import check_fraction
        check_fraction(0.03711, 16, QuantScheme())  # the fraction suggested fits

    def test_interrupted_after_the_fit_leaves_nothing(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            argv = self.quality("--score-errors", ranks="quality-bits:0.25," + ",".join(
                f"fixed:{r}" for r in range(2, 9)), seq_len=64, num_seqs=40)
            p = subprocess.Popen([sys.executable, "-m", "kqsvd.quality"] + argv,
                                 env=dict(MPIENV, PYTHONPATH=os.path.join(ROOT, "python")),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            seen = []
            while True:  # until the fit is done and the measurement starts
                line = p.stderr.readline()
                seen.append(line)
                if not line or "tokens (validation split" in line:
                    break
            p.send_signal(sig)
            _, err = p.communicate(timeout=120)
            self.assertEqual(p.returncode, 130, "".join(seen) + err)
            self.assertIn("interrupted; nothing written", err)
            self.assertEqual(listing(self.out), [], sig)

    def test_a_good_run_writes_the_fitted_file_with_the_report(self):
        report = os.path.join(self.out, "q.json")
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = quality.main(self.quality("--plot", os.path.join(self.out, "q.png"),
                                             ranks="quality-bits:0.25,fixed:4"))
        self.assertEqual(code, 0, err.getvalue())
        fitted = os.path.join(self.out, "q.quality-bits-0.25.h5")
        self.assertEqual(listing(self.out), ["q.json", "q.png", "q.quality-bits-0.25.h5"])
        with open(report) as f:
            rows = {r["policy"]: r for r in json.load(f)["results"]}
        self.assertEqual(rows["quality-bits:0.25"]["proj"], fitted)
        self.assertIn(fitted, err.getvalue().splitlines()[-1])
        import kqsvd
        self.assertEqual(kqsvd.load_projections(fitted, "kqsvd").policy, "quality-bits:0.25")

    def test_staged_files_go_with_the_outputs_or_not_at_all(self):
        from kqsvd import KqsvdError
        from kqsvd.formats.files import Staged, write_all
        report, fitted = os.path.join(self.out, "r.json"), os.path.join(self.out, "r.fit.h5")

        def fails(tmp):
            raise OSError(28, "No space left on device", tmp)
        with Staged() as staged:
            with open(staged.tmp(fitted), "w") as f:
                f.write("fitted")
            with self.assertRaises(KqsvdError):
                write_all([(report, fails)], staged)
        self.assertEqual(listing(self.out), [])
        with self.assertRaises(KeyboardInterrupt), Staged() as staged:
            open(staged.tmp(fitted), "w").close()
            raise KeyboardInterrupt
        self.assertEqual(listing(self.out), [])
        with Staged() as staged:
            with open(staged.tmp(fitted), "w") as f:
                f.write("fitted")
            write_all([(report, lambda tmp: open(tmp, "w").write("{}"))], staged)
        self.assertEqual(listing(self.out), ["r.fit.h5", "r.json"])
        self.assertEqual(open(fitted).read(), "fitted")

    # -- special files, a full disk ---------------------------------------------
    def test_a_fifo_as_an_input_file(self):
        """--proj naming a FIFO is refused in one line, not opened: HDF5's
        open() would wait for a writer forever (an alarm stops the test
        where it does)."""
        fifo = os.path.join(self.out, "fifo.h5")
        os.mkfifo(fifo)
        allocate_argv = ["--model", self.model, "--text", self.text, "--proj", fifo,
                         "--budget", "0.5", "--out", os.path.join(self.out, "a.h5"), "--methods",
                         "kqsvd", "--seq-len", "16", "--num-seqs", "1", "--rounds", "0"]

        def hung(*_):
            raise TimeoutError(f"{fifo}: opened, and waited on")
        before = signal.signal(signal.SIGALRM, hung)
        try:
            for main, argv in ((quality.main, self.quality()), (allocate.main, allocate_argv)):
                argv[argv.index("--proj") + 1] = fifo
                signal.alarm(60)
                self.refused(main, argv, 1, fifo, "is a FIFO, not a regular file",
                             leaves=["fifo.h5"], loads=True)
                signal.alarm(0)
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, before)

    @unittest.skipUnless(os.geteuid() == 0, "a small tmpfs needs root")
    def test_a_full_disk_names_the_output(self):
        """A fitted file the disk has no room for: one line naming it (not
        its temporary name) as a full disk, and nothing left."""
        tiny = os.path.join(self.out, "tiny")
        os.makedirs(tiny)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", tiny], check=True)
        try:
            argv = self.quality(ranks="quality-bits:0.25,fixed:4")
            argv[argv.index("--json") + 1] = os.path.join(tiny, "q.json")
            err = io.StringIO()
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                self.assertEqual(quality.main(argv), 1, err.getvalue())
            lines = [x for x in err.getvalue().splitlines() if "error" in x]  # after the fit's log
            self.assertEqual(len(lines), 1, err.getvalue())
            self.assertIn(f"{os.path.join(tiny, 'q.quality-bits-0.25.h5')}: no space left on "
                          "device", lines[0])
            self.assertNotIn(".tmp", lines[0])
            self.assertEqual(os.listdir(tiny), [])
            self.assertEqual(listing(self.out), ["tiny"])
        finally:
            subprocess.run(["umount", tiny], check=True)

    def test_export_out_names_what_it_is(self):
        """The exporter's --out, or a folder above it, naming a device or a
        FIFO says which it is, not "a file"."""
        fifo = os.path.join(self.out, "fifo")
        os.mkfifo(fifo)
        for out, what in ((os.devnull, f"{os.devnull} is a character device, not a folder"),
                          (fifo, f"{fifo} is a FIFO, not a folder"),
                          (os.path.join(fifo, "x"), f"{fifo} is a FIFO, not a folder")):
            self.refused(lambda argv: export.main(argv), ["--model", self.model, "--text",
                                                          self.text, "--seq-len", "16",
                                                          "--num-seqs", "1", "--split", "train",
                                                          "--out", out],
                         2, f"--out {out}", what, leaves=["fifo"])

    # -- the frontier ----------------------------------------------------------
    def test_empty_lists(self):
        for extra, words in ((["--proj", self.proj, "--ranks", "fixed:8", "--methods", ""],
                              ("--methods", "none given")),
                             (["--proj", self.proj, "--ranks", "fixed:8", "--methods", "none"],
                              ("--methods",)),
                             (["--proj", self.proj], ("--proj", "no rank policy")),
                             (["--proj", self.proj + "="], ("--proj", "no rank policy")),
                             (["--proj", self.proj + "=none", "--proj", self.proj + "=fixed:8"],
                              ("--proj", "no rank policy")),
                             (["--presses", "snapkv", "--press-kept", "none"], ("--press-kept",)),
                             (["--plain", ","], ("nothing to compare",))):
            self.refused(frontier.main, self.frontier(*extra), 2, *words)

    def test_repeats(self):
        hard, sym = os.path.join(self.out, "hard.h5"), os.path.join(self.out, "sym.h5")
        os.link(self.proj, hard)
        os.symlink(self.proj, sym)
        P = self.proj
        for extra, words in ((["--plain", "4,4"], ("--plain", "'4'", "twice")),
                             (["--plain", "4,04"], ("--plain", "'04'", "twice")),
                             (["--quantized-cache", "quanto:4,quanto:4"], ("--quantized-cache",)),
                             (["--presses", "snapkv,snapkv"], ("--presses", "snapkv")),
                             (["--presses", "snapkv", "--press-kept", "0.5,.5"],
                              ("--press-kept", "'.5'", "'0.5'")),
                             (["--proj", P, "--ranks", "fixed:8", "--methods", "kqsvd,kqsvd"],
                              ("--methods", "kqsvd")),
                             (["--proj", P, "--ranks", "fixed:8,fixed:08"], ("--ranks", "fixed:08")),
                             (["--proj", P, "--ranks", "fixed:8,kqsvd/fixed:8"],
                              ("--ranks", "kqsvd/fixed:8")),
                             (["--proj", P + "=fixed:8@4,fixed:8@4/4"], (f"--proj {P}", "@4/4")),
                             (["--proj", P, "--proj", sym, "--ranks", "fixed:8"],
                              ("--proj", sym, "same file")),
                             (["--proj", P + "=fixed:8", "--proj", hard + "=fixed:4"],
                              ("--proj", hard, "same file"))):
            self.refused(frontier.main, self.frontier(*extra), 2, *words,
                         leaves=["hard.h5", "sym.h5"])

    def test_ranks_that_no_file_uses(self):
        self.refused(frontier.main, self.frontier("--proj", self.proj + "=kqsvd/fixed:8@4",
                                                  "--ranks", "fixed:999,eps:abc"),
                     2, "--ranks fixed:999,eps:abc", "every --proj names its own policies")

    def test_policies_before_the_model(self):
        P = self.proj
        for extra, words in ((["--proj", P, "--ranks", "kqsvd/quality-bits:0.25@4"],
                              ("quality-bits", "python -m kqsvd.quality")),
                             (["--proj", P + "=ksvd/quality-budget:0.5"],
                              (f"--proj {P}", "quality-budget")),
                             (["--proj", P, "--ranks", "eps:abc"], ("--ranks", "eps:abc")),
                             (["--proj", P, "--ranks", "fixed:999"], ("fixed:999", "head_dim")),
                             (["--proj", P, "--ranks", "fixed:8@5"], ("fixed:8@5",)),
                             (["--proj", P + "=budget:2"], (f"--proj {P}", "budget:2"))):
            self.refused(frontier.main, self.frontier(*extra), 2, *words)

    def test_bounds(self):
        for value in ("1000000000000", "1" + "0" * 23):
            self.refused(frontier.main, self.frontier("--group", value), 2, "--group", value,
                         "1..4096")
        self.refused(frontier.main, self.frontier("--group", "1e23"), 2, "--group", "1e23")
        self.refused(frontier.main, self.frontier("--residual", "21"), 2, "--residual 21",
                     "--context + --continuation = 20")

    def test_the_frontier_names_its_own_options(self):
        line = self.refused(frontier.main, self.frontier("--context", "600", "--continuation",
                                                         "10"),
                            2, "--context + --continuation = 610",
                            "max_position_embeddings = 512", loads=True)
        self.assertNotIn("--seq-len", line)


if __name__ == "__main__":
    unittest.main()
