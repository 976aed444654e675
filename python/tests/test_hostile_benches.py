"""bench/gpu_decode.py's report held to the commands' rules (issue 61),
with no GPU: it rewrites its --json after every row, and the rewrites of
one run replace the file it wrote and no other; a file there before the
run, or one put there in its place while it ran, is refused in one line
without --force and left as it is.  The bench runs in this process on its
tiny random model on the CPU, each row's measure made up."""
import contextlib
import importlib.util
import io
import json
import os
import unittest
from unittest import mock

from common import ROOT, workdir

GPU_DECODE = os.path.join(ROOT, "bench", "gpu_decode.py")
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


if __name__ == "__main__":
    unittest.main()
