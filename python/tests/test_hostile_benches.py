"""bench/gpu_decode.py's report and bench/weighted_fit.py's work folder
held to the commands' rules (issue 61), with no GPU and no model load:
- gpu_decode rewrites its --json after every row: the rewrites of one run
  replace the file it wrote and no other; a file there before the run, or
  one put there in its place while it ran, is refused in one line without
  --force and left as it is;
- weighted_fit opens its --work files as the kqsvd files they are: a FIFO
  among its inputs or outputs is refused in one line before the model
  loads, not waited on; its outputs are written under temporary names and
  renamed together at the end, so that a link among them is replaced, not
  followed, and a write that fails after the model load is one line and
  leaves none of them.

gpu_decode runs in this process on its tiny random model on the CPU, each
row's measure made up; weighted_fit in a child, under a timeout so that a
script that waits on a FIFO fails the test instead of hanging it, or in
this process with its model and measures made up (its refits and writes
its own)."""
import contextlib
import importlib.util
import io
import json
import os
import subprocess
import sys
import unittest
from types import SimpleNamespace
from unittest import mock

from common import KQSVD, ROOT, run, workdir
from kqsvd.formats import h5io

GPU_DECODE = os.path.join(ROOT, "bench", "gpu_decode.py")
WEIGHTED_FIT = os.path.join(ROOT, "bench", "weighted_fit.py")
ENV = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
ROW = dict(tokens_per_s=1.0, bytes=1, peak_bytes=0, prefill_s=0.0)
OUTPUTS = ("unweighted.h5", "weighted.h5", "weighted.json")


def load_script(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def gpu_decode():
    return load_script("gpu_decode_under_test", GPU_DECODE)


def theirs(path, text):
    """A file another run puts at path: a new file renamed over it."""
    with open(path + ".theirs", "w") as f:
        f.write(text)
    os.replace(path + ".theirs", path)


class GpuDecodeReport(unittest.TestCase):
    def setUp(self):
        self.out = os.path.join(workdir("bench-gpu-decode"), "rows.json")
        self.mod = gpu_decode()

    def main(self, *extra, measure=None):
        """(exit status, stderr) of the bench over two points, full cache."""
        argv = ["--shape", "tiny", "--device", "cpu", "--points", "8x1,12x1", "--configs",
                "full", "--steps", "1", "--warmup", "0", "--chunk", "8", "--rank", "4",
                "--json", self.out, *extra]
        err = io.StringIO()
        with mock.patch.object(self.mod, "measure", measure or (lambda *_: dict(ROW))), \
                contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            try:
                code = self.mod.main(argv)
            except SystemExit as e:
                code = e.code
        return code, err.getvalue()

    def rows(self):
        with open(self.out) as f:
            return [(r["context"], r["batch"]) for r in json.load(f)["rows"]]

    def test_its_own_report_rewritten_without_force(self):
        self.assertEqual(self.main(), (0, ""))
        self.assertEqual(self.rows(), [(8, 1), (12, 1)])

    def test_a_report_there_before_is_refused(self):
        theirs(self.out, "before")
        code, err = self.main()
        self.assertEqual(code, 2)
        self.assertIn("already exists; give --force", err.splitlines()[-1])
        with open(self.out) as f:
            self.assertEqual(f.read(), "before")

    def test_a_file_put_in_its_place_is_kept(self):
        def measure(_model, _proj, _config, N, *_):
            if N == 12:  # after the first row's report: another run's file replaces it
                theirs(self.out, "another run's")
            return dict(ROW)
        code, err = self.main(measure=measure)
        lines = err.splitlines()
        self.assertEqual((code, len(lines)), (1, 1), err)
        self.assertIn(f"gpu_decode: error: {self.out} appeared while the run worked", lines[0])
        with open(self.out) as f:
            self.assertEqual(f.read(), "another run's")
        self.assertEqual(self.main("--force", measure=measure), (0, ""))  # --force: replaced
        self.assertEqual(self.rows(), [(8, 1), (12, 1)])


class WeightedFitWork(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        """A --work folder as bench/rank_allocation.sh leaves it, in small:
        train/ (a model file and a shard) and proj.h5 calibrated from it;
        more rows than d = 64, so that the unweighted refit is proj.h5's."""
        cls.work = workdir("bench-weighted-fit")
        run([KQSVD, "synth", "--out", os.path.join(cls.work, "train"), "--seqs", "8",
             "--seq-len", "32", "--shards", "1", "--progress", "off"])
        run([KQSVD, "calibrate", "--progress", "off", "--ranks", "fixed:4", "--model",
             os.path.join(cls.work, "train", "model.h5"), "--out",
             os.path.join(cls.work, "proj.h5"), os.path.join(cls.work, "train", "shard-0000.h5")])

    def refused(self, fifo, code, *words):
        """weighted_fit.py with `fifo` (a path in --work) a FIFO: exit
        `code`, one line naming it and holding `words`, the FIFO left."""
        path = os.path.join(self.work, fifo)
        aside = path + ".aside"
        if os.path.exists(path):
            os.rename(path, aside)
        os.mkfifo(path)
        try:
            r = subprocess.run([sys.executable, WEIGHTED_FIT, "--work", self.work], env=ENV,
                               capture_output=True, text=True, timeout=120)
            self.assertTrue(os.path.exists(path))
        finally:
            os.remove(path)
            if os.path.exists(aside):
                os.rename(aside, path)
        lines = r.stderr.splitlines()
        self.assertEqual((r.returncode, len(lines)), (code, 1), r.stderr)
        self.assertNotIn("Traceback", r.stderr)
        for w in (path,) + words:
            self.assertIn(w, lines[0])

    def test_an_input_that_is_a_fifo(self):
        for name in ("proj.h5", os.path.join("train", "model.h5"),
                     os.path.join("train", "shard-0000.h5")):
            with self.subTest(name):
                self.refused(name, 1, "weighted_fit.py: error:", "is a FIFO, not a regular file")

    def test_an_output_that_is_a_fifo(self):
        for name in ("unweighted.h5", "weighted.h5", "weighted.json"):
            with self.subTest(name):
                self.refused(name, 2, "error:", "is not a regular file")

    def setUp(self):
        self.addCleanup(self.remove_outputs)

    def remove_outputs(self):
        for name in OUTPUTS:
            path = os.path.join(self.work, name)
            if os.path.isdir(path) and not os.path.islink(path):
                os.rmdir(path)
            elif os.path.lexists(path):
                os.remove(path)

    def study(self, during=None):
        """(exit status, stderr) of weighted_fit's main() in this process on
        the small --work, its model and measures made up (the refits and
        the writes are the script's); `during` runs in the held-out measure,
        after the model load and before the outputs are written."""
        import numpy as np
        mod = load_script("weighted_fit_under_test", WEIGHTED_FIT)
        with h5io.open_file(os.path.join(self.work, "train", "shard-0000.h5"), "cache") as f:
            L, H, rows, _ = f["keys"].shape
            Hq = f["queries"].shape[1]
        info = SimpleNamespace(num_layers=L, num_kv_heads=H, num_heads=Hq)

        def held_out(*_):
            if during:
                during()
            return dict(perplexity=1.0, kl=0.0, top1=1.0)
        err = io.StringIO()
        with mock.patch("kqsvd.models.load", lambda *_, **__: (None, None, info)), \
                mock.patch("kqsvd.models.token_windows",
                           lambda *_, **__: (np.zeros((24, 4), np.int64),)), \
                mock.patch("kqsvd.quality.kl.full_logprobs", lambda *_: None), \
                mock.patch("kqsvd.quality.allocate.allocate",
                           lambda *_, **__: {"kqsvd": dict(rank_k=[[4] * H] * L,
                                                           rank_v=[[4] * H] * L)}), \
                mock.patch.object(mod, "attention_weights", lambda *_: np.ones((L, H, rows))), \
                mock.patch.object(mod, "held_out", held_out), \
                mock.patch.object(sys, "argv", ["weighted_fit.py", "--work", self.work]), \
                contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            code = mod.main()
        return code, err.getvalue()

    def test_an_output_that_is_a_link_is_replaced_not_followed(self):
        theirs_dir = workdir("bench-weighted-fit-theirs")
        links = {}
        for name in OUTPUTS:
            target = os.path.join(theirs_dir, name)
            with open(target, "w") as f:
                f.write("another's file")
            links[name] = os.path.join(self.work, name)
            os.symlink(target, links[name])
        code, err = self.study()
        self.assertEqual(code, 0, err)
        for name in OUTPUTS:
            with open(os.path.join(theirs_dir, name)) as f:
                self.assertEqual(f.read(), "another's file", f"{name}: its link's target written")
            self.assertFalse(os.path.islink(links[name]), name)
        with h5io.open_file(links["weighted.h5"], "projections") as f:
            self.assertIn("kqsvd", f)

    def test_a_failed_last_write_is_one_line(self):
        report = os.path.join(self.work, "weighted.json")
        code, err = self.study(during=lambda: os.path.isdir(report) or os.mkdir(report))
        lines = [ln for ln in err.splitlines() if "error" in ln]  # beside the study's log
        self.assertEqual((code, len(lines)), (1, 1), err)
        self.assertNotIn("Traceback", err)
        self.assertTrue(err.endswith(lines[0] + "\n"), err)
        self.assertIn(f"weighted_fit.py: error: {report}", lines[0])
        # all or none: the projections it wrote before went with the report
        for name in ("unweighted.h5", "weighted.h5"):
            self.assertFalse(os.path.lexists(os.path.join(self.work, name)), name)
        self.assertFalse([n for n in os.listdir(self.work) if n.endswith(".tmp")])


if __name__ == "__main__":
    unittest.main()
