"""Bad input to bench/passkey.py (issue 47 items 5, 11, 17 and 20), as
test_hostile.py gives it to the package's commands: each case asserts the
exit status (2 for the command line and the report, 1 for input files,
130 for an interruption), one stderr line naming the option or file, no
Traceback, nothing left where the report would go (no empty folder, no
temporary file) and every input unchanged.  Every mistake the command line,
the files and the model's header reveal is refused before the model loads
(NO_LOAD fails the case if it does); passkey_prompt refuses a depth it
cannot place.

The script is loaded from KQSVD_PASSKEY when set (another copy of it, such
as the one before these fixes) and run in this process through sys.argv,
so the same cases run against it."""
import contextlib
import io
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import types
import unittest
from unittest import mock

import h5py
from common import ROOT, tiny_decoder, workdir
from test_hostile import HostileCase, listing

from kqsvd.errors import UsageError

NO_LOAD = mock.patch("kqsvd.models.load", side_effect=AssertionError("the model was loaded"))
SCRIPT = os.environ.get("KQSVD_PASSKEY") or os.path.join(ROOT, "bench", "passkey.py")


def _script():
    spec = importlib.util.spec_from_file_location("passkey_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class ScriptCase(HostileCase):
    """A bench script (self.bench, a module with main()) run in this
    process on the tiny model's fixture."""
    PROG = "passkey.py"

    # -- helpers --------------------------------------------------------------
    def call(self, argv, loads=False, cwd=None):
        """The script on argv in this process, as `python bench/PROG` runs
        it: (exit status, stdout, stderr)."""
        out, err = io.StringIO(), io.StringIO()
        here = os.getcwd()
        try:
            if cwd:
                os.chdir(cwd)
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out), \
                    mock.patch.object(sys, "argv", [self.PROG] + argv), \
                    (contextlib.nullcontext() if loads else NO_LOAD):
                try:
                    code = self.bench.main()
                except SystemExit as e:  # sys.exit(message) prints it and exits 1
                    code = e.code
                    if isinstance(code, str):
                        print(code, file=err)
                        code = 1
                except KeyboardInterrupt:  # would end the whole test run
                    self.fail("KeyboardInterrupt escaped main()")
        finally:
            os.chdir(here)
        return 0 if code is None else code, out.getvalue(), err.getvalue()  # as a process exits

    def refused(self, argv, code, *words, loads=False, cwd=None):
        """argv exits `code` with one line holding every word, before the
        model loads (unless `loads`), self.out left as it was."""
        before = set(listing(self.out))
        got, _, err = self.call(argv, loads, cwd)
        return self.one_error(code, got, err, words, before)


class HostilePasskey(ScriptCase):
    WORK = "hostile-passkey"

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.bench = _script()

    def args(self, *extra, json_path="x.json", proj=True):
        """A tiny run: one short prompt, int4 and the calibrated file."""
        return ["--model", self.model, "--text", self.text, "--lengths", "120", "--depths", "0.5",
                "--plain", "4", "--presses", "none"] + (["--proj", self.proj] if proj else []) + \
            (["--json", os.path.join(self.out, json_path)] if json_path else []) + list(extra)

    def test_composites_and_task_are_checked(self):
        self.refused(self.args("--composites", "expected:quanto:3:0.125"), 2, "--composites",
                     "PRESS:BACKEND:BITS:BYTES")
        self.refused(self.args("--composites", "expected:nope:4:0.125"), 2, "--composites")
        self.refused(self.args("--composites", "expected:quanto:4:1.5"), 2, "--composites")
        # a budget the quantized cache holds with every token is no composite
        self.refused(self.args("--composites", "expected:quanto:2:0.25"), 2,
                     "--composites expected:quanto:2:0.25", "every token")
        self.refused(self.args("--task", "needles"), 2, "--task", "needles")
        # a policy the file cannot resolve, named with the file, before the load
        self.refused(self.args(proj=False) + ["--proj", self.proj + "=tiers:w8+s2+1.0x4@9"], 2,
                     "--proj", "tiers:w8")
        # the span's answer takes 25 tokens of the tiny model's 512 positions
        self.refused(self.args("--task", "span", "--lengths", "500"), 2, "--lengths", "487")

    # -- item 5: the report's place, and nothing made before the run succeeds --
    def test_json_in_a_missing_folder_is_refused(self):
        self.refused(self.args(json_path="missing/dir/x.json"), 2, "--json", "does not exist")

    def test_json_under_a_regular_file_is_refused(self):
        with open(os.path.join(self.out, "FILE"), "w") as f:
            f.write("not a folder\n")
        self.refused(self.args(json_path="FILE/x.json"), 2, "--json", "FILE/x.json")

    def test_json_rules_of_the_commands(self):
        path = os.path.join(self.out, "x.json")
        with open(path, "w") as f:
            f.write("{}\n")
        self.refused(self.args(), 2, "--json", "already exists", "--force")
        self.refused(self.args("--force", json_path=None) + ["--json", self.text], 2, "--json",
                     "--text", "input")
        self.refused(self.args(json_path=None) + ["--json", self.out], 2, "--json", "folder")

    def test_default_report_leaves_nothing_when_the_run_fails(self):
        # a model that is not there: found before the load, and no data/passkey/ made
        self.refused(self.args(json_path=None) + ["--model", os.path.join(self.out, "none")], 1,
                     "none", cwd=self.out)
        self.assertEqual(listing(self.out), [])
        # too little filler: found by the tokenizer alone, before the load
        with open(os.path.join(self.wd, "short.txt"), "w") as f:
            f.write("a few words only\n")
        self.refused(self.args(json_path=None) + ["--text", os.path.join(self.wd, "short.txt")],
                     2, "--lengths 120", "filler", cwd=self.out)
        self.assertEqual(listing(self.out), [])

    def test_default_report_under_a_file_is_refused(self):
        with open(os.path.join(self.out, "data"), "w") as f:
            f.write("a file where the report's folder goes\n")
        self.refused(self.args(json_path=None), 2, "--json", "not a folder", cwd=self.out)

    def test_default_report_is_written_at_the_end(self):
        code, out, err = self.call(self.args(json_path=None), loads=True, cwd=self.out)
        self.assertEqual(code, 0, err)
        self.assertNotIn("Traceback", err)
        self.assertEqual(listing(self.out), ["data"])
        self.assertEqual(listing(os.path.join(self.out, "data", "passkey")), ["passkey.json"])
        with open(os.path.join(self.out, "data", "passkey", "passkey.json")) as f:
            report = json.load(f)
        self.assertEqual(report["lengths"], [120])
        self.assertEqual(report["depths"], [0.5])
        stored = "kqsvd stored [proj]"
        self.assertEqual(list(report["results"]), ["full", "int4", stored])
        self.assertEqual(list(report["kept"]), ["full", "int4", stored])  # measured, each
        self.assertEqual(report["kept"]["full"], {"120": 1.0})
        self.assertTrue(0.25 < report["kept"]["int4"]["120"] < 1)  # 4 bits, scales, a short block
        self.assertEqual(len(report["results"]["full"]), 1)
        self.assertIn("wrote data/passkey/passkey.json", out)
        # the folder exists now: the report is an output like any other
        self.refused(self.args(json_path=None), 2, "--json", "already exists", cwd=self.out)

    # -- item 11: depths are shares of the filler ------------------------------
    def test_depths_outside_zero_one_are_refused(self):
        for depths in ("1.5,-0.5", "-0.5", "1.0001", "nan", "inf", "-inf", "0.5,abc", "0.5,0.5",
                       "", "0.5,"):
            with self.subTest(depths=depths):
                self.refused(self.args("--depths", depths), 2, "--depths")

    def test_passkey_prompt_refuses_a_depth_it_cannot_place(self):
        from transformers import AutoTokenizer

        from kqsvd.quality.retrieval import passkey_prompt
        tok = AutoTokenizer.from_pretrained(self.model)
        filler = list(range(1000, 1400))
        for depth in (float("nan"), float("inf"), -float("inf"), 1.5, -0.5, "0.5", None):
            with self.subTest(depth=depth):
                with self.assertRaises(UsageError) as e:
                    passkey_prompt(tok, filler, 120, depth, 12345)
                shown = depth if isinstance(depth, float) else repr(depth)
                self.assertIn(f"depth {shown} ", str(e.exception))
        for depth in (0, 0.0, 1, 1.0, 0.25):  # the ends included
            ctx, q = passkey_prompt(tok, filler, 120, depth, 12345)
            self.assertEqual(len(ctx) + len(q), 120)

    # -- item 17: every option typed, every input checked before the load -------
    def test_malformed_options_are_one_line(self):
        for opt, value, *words in (("--lengths", "abc", "abc"), ("--lengths", "0", "0"),
                                   ("--lengths", "-5", "-5"), ("--lengths", "", ""),
                                   ("--lengths", "120,120", "twice"), ("--lengths", "1e3", "1e3"),
                                   ("--plain", "abc", "abc"), ("--plain", "5", "5"),
                                   ("--plain", "4,4", "twice"), ("--seed", "-1", "-1"),
                                   ("--seed", "x", "x"), ("--depths", "nan", "nan"),
                                   ("--presses", "bogus:0.5", "bogus"),
                                   ("--presses", "expected", "expected"),
                                   ("--presses", "expected:1.5", "1.5"),
                                   ("--presses", "expected:abc", "abc"),
                                   ("--dtype", "float16", "float16")):
            with self.subTest(opt=opt, value=value):
                self.refused(self.args(opt, value), 2, opt, *words)

    def test_lengths_beyond_the_models_positions(self):
        # the tiny model has 512 positions; the answer's 6 tokens come after the prompt
        for n in ("100000", "507", "120,600"):
            with self.subTest(lengths=n):
                self.refused(self.args("--lengths", n), 2, "--lengths", "506", "512")

    def test_a_missing_model_is_named(self):
        self.refused(self.args("--model", os.path.join(self.out, "nothing")), 1, "nothing")

    def test_bad_projections_files_are_refused_before_the_load(self):
        bad = os.path.join(self.wd, "bad-bits.h5")
        shutil.copyfile(self.proj, bad)
        with h5py.File(bad, "a") as f:
            f["kqsvd/bits_k_cols"] = [4]
            f["kqsvd/bits_v_cols"] = [4]
        self.refused(self.args("--proj", bad, proj=False), 1, "bad-bits.h5", "bits_k_cols")
        self.refused(self.args("--proj", os.path.join(self.out, "no.h5"), proj=False), 1,
                     "--proj", "no.h5")
        self.refused(self.args("--proj", self.out, proj=False), 1, "--proj", "regular file")
        # the same file twice, or two files that one row would name
        self.refused(self.args("--proj", self.proj), 2, "--proj", "same file")
        twin = os.path.join(self.wd, "twin")
        os.makedirs(twin, exist_ok=True)
        shutil.copyfile(self.proj, os.path.join(twin, "proj.h5"))
        self.refused(self.args("--proj", os.path.join(twin, "proj.h5")), 2, "--proj", "proj]")

    def test_projections_of_another_model_are_refused_before_the_load(self):
        other = tiny_decoder("llama", os.path.join(workdir("hostile-passkey-other"), "m"),
                             hidden=32)
        self.refused(self.args("--model", other), 1, self.proj, "another model")

    def test_presses_are_checked_before_the_load(self):
        with mock.patch.dict(sys.modules, {"kvpress": None}):  # as if not installed
            self.refused(self.args("--presses", "expected:0.25"), 2, "--presses", "kvpress")
        # SnapKV needs more context than its window (kvpress asserts inside the run)
        kvpress = types.SimpleNamespace(SnapKVPress=lambda: types.SimpleNamespace(window_size=64))
        with mock.patch("kqsvd.quality.peers.need", return_value=kvpress):
            self.refused(self.args("--presses", "snapkv:0.5", "--lengths", "64"), 2,
                         "--lengths 64", "snapkv", "64 tokens")

    def test_texts_that_are_not_utf8_text(self):
        binary = os.path.join(self.wd, "binary.txt")
        with open(binary, "wb") as f:
            f.write(bytes(range(256)) * 64)
        self.refused(self.args("--text", binary), 1, "--text", "binary.txt", "UTF-8")
        self.refused(self.args("--text", os.path.join(self.out, "no.txt")), 1, "--text", "no.txt")
        self.refused(self.args("--text", self.out), 1, "--text", "regular file")

    def test_interrupted_load_is_one_line(self):
        with mock.patch("kqsvd.models.load", side_effect=KeyboardInterrupt):
            code, _, err = self.call(self.args(), loads=True)
        self.assertEqual(code, 130, err)
        self.assertNotIn("Traceback", err)
        self.assertEqual(err.splitlines(), ["passkey.py: interrupted; nothing written"])
        self.assertEqual(listing(self.out), [])

    def test_ctrl_c_during_the_trials(self):
        """A real SIGINT to `python bench/passkey.py` between answers: exit
        130, no traceback, no report."""
        argv = self.args("--lengths", ",".join(str(n) for n in range(100, 500, 4)),
                         "--depths", "0,0.25,0.5,0.75,1")
        p = subprocess.Popen([sys.executable, SCRIPT] + argv, stderr=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
        try:
            lines = []
            for line in p.stderr:  # the first answer: the run is under way
                lines.append(line)
                if line.startswith("passkey: 1/"):
                    break
            p.send_signal(signal.SIGINT)
            out, rest = p.communicate(timeout=120)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        err = "".join(lines) + rest
        self.assertEqual(p.returncode, 130, err)
        self.assertNotIn("Traceback", err)
        last = [x for x in err.splitlines() if not x.startswith("passkey: ")]
        self.assertEqual(len(last), 1, err)
        self.assertIn("interrupted", last[0])
        self.assertEqual(listing(self.out), [])

    # -- item 20: --help, and main(argv) giving the status -----------------------
    def test_help_and_status(self):
        code, out, err = self.call(["--help"])
        self.assertEqual(code, 0, err)
        out = " ".join(out.split())  # as wrapped for any terminal's width
        for words in ("--lengths", "--depths", "[0, 1]", "data/passkey/passkey.json", "exit 2"):
            self.assertIn(words, out)
        err = io.StringIO()
        with contextlib.redirect_stderr(err), NO_LOAD:
            self.assertEqual(self.bench.main(["--seed", "-1"]), 2)
        self.assertIn("passkey.py: error: argument --seed", err.getvalue())

    def test_a_tiny_run_writes_its_report(self):
        code, out, err = self.call(self.args("--depths", "0,1", "--plain", "4,8"), loads=True)
        self.assertEqual(code, 0, err)
        self.assertEqual(listing(self.out), ["x.json"])
        with open(os.path.join(self.out, "x.json")) as f:
            report = json.load(f)
        self.assertEqual(list(report["results"]), ["full", "int4", "int8", "kqsvd stored [proj]"])
        for rows in report["results"].values():
            self.assertEqual([(r["length"], r["depth"]) for r in rows], [(120, 0), (120, 1)])
        self.assertIn("int8", out)


if __name__ == "__main__":
    unittest.main()
