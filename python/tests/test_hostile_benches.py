"""bench/gpu_decode.py's report and bench/weighted_fit.py's work folder
held to the commands' rules (issue 61), with no GPU and no model load:
- gpu_decode rewrites its --json after every row: the rewrites of one run
  replace the file it wrote and no other; a file there before the run, or
  one put there in its place while it ran, is refused in one line without
  --force and left as it is;
- weighted_fit opens its --work files as the kqsvd files they are: a FIFO
  among its inputs or outputs is refused in one line before the model
  loads, not waited on.

gpu_decode runs in this process on its tiny random model on the CPU, each
row's measure made up; weighted_fit in a child, under a timeout so that a
script that waits on a FIFO fails the test instead of hanging it."""
import contextlib
import importlib.util
import io
import json
import os
import subprocess
import sys
import unittest
from unittest import mock

from common import KQSVD, ROOT, run, workdir

GPU_DECODE = os.path.join(ROOT, "bench", "gpu_decode.py")
WEIGHTED_FIT = os.path.join(ROOT, "bench", "weighted_fit.py")
ENV = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
ROW = dict(tokens_per_s=1.0, bytes=1, peak_bytes=0, prefill_s=0.0)


def gpu_decode():
    spec = importlib.util.spec_from_file_location("gpu_decode_under_test", GPU_DECODE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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
        train/ (a model file and a shard) and proj.h5 calibrated from it."""
        cls.work = workdir("bench-weighted-fit")
        run([KQSVD, "synth", "--out", os.path.join(cls.work, "train"), "--seqs", "2",
             "--seq-len", "16", "--shards", "1", "--progress", "off"])
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


if __name__ == "__main__":
    unittest.main()
