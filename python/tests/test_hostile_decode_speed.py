"""Bad input to bench/decode_speed.py, which users run as a command (the
README and docs/decode.md give it): every option, configuration, context,
report and output is refused before the model loads and before any run
starts, in one line, exit 2 for the command line and outputs, 1 for input
files, 130 when interrupted, never a traceback or a usage dump.

The cases run the script in this process with the loader patched to fail
the test if it runs and `measure` (what starts the runs) patched to fail
it too, or to answer with made-up rows; one case starts the script and
interrupts it, one runs a single tiny configuration for real.
KQSVD_DECODE_SPEED=PATH tests another copy of the script (the one before
these checks: `git show HEAD~N:bench/decode_speed.py > PATH`)."""
import contextlib
import importlib.util
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest
from unittest import mock

from common import KQSVD, ROOT, run, workdir

SCRIPT = os.environ.get("KQSVD_DECODE_SPEED", os.path.join(ROOT, "bench", "decode_speed.py"))
NO_LOAD = mock.patch("kqsvd.models.load", side_effect=AssertionError("the model was loaded"))
# SmolLM2-135M-Instruct's sizes, so that a file passes the model check
SMOLLM2 = ["--layers", "30", "--heads", "9", "--kv-heads", "3", "--head-dim", "64",
           "--hidden", "576"]
ENV = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))


def load_script():
    spec = importlib.util.spec_from_file_location("decode_speed_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@contextlib.contextmanager
def inside(folder):
    here = os.getcwd()
    os.chdir(folder or here)
    try:
        yield
    finally:
        os.chdir(here)


def projections(folder, sizes=()):
    """A projections file calibrated from a synthetic cache set (seconds)."""
    os.makedirs(folder)
    run([KQSVD, "synth", "--out", os.path.join(folder, "set"), "--seqs", "2", "--seq-len", "16",
         "--shards", "1", "--progress", "off", *sizes])
    out = os.path.join(folder, "proj.h5")
    run([KQSVD, "calibrate", "--progress", "off", "--ranks", "fixed:16", "--model",
         os.path.join(folder, "set", "model.h5"), "--out", out,
         os.path.join(folder, "set", "shard-0000.h5")])
    return out


REAL_POPEN = subprocess.Popen


class FakeRun:
    """subprocess.Popen for the runs: answers `reply(cmd)` = (exit status,
    stdout, stderr) at once (subprocess.run goes through it too).  Any
    other program (`kqsvd ranks`, which resolves a policy the first time a
    file is read) runs for real: answering it too made a test pass only
    after another had filled the cache of resolved policies."""

    def __init__(self, reply):
        self.reply = reply

    def __call__(self, args, **kw):
        if "--one" not in args:
            return REAL_POPEN(args, **kw)
        self.args, self.pid = args, 0
        self.returncode, self.out, self.err = self.reply(args)
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def communicate(self, input=None, timeout=None):
        return self.out, self.err

    def poll(self):
        return self.returncode

    wait = poll

    def kill(self):
        pass


def fake_row(cmd):
    """What a run of `cmd` (decode_speed.py --one SPEC N B ...) prints."""
    spec, n, b = cmd[cmd.index("--one") + 1:][:3]
    rate = 10.0 if spec == "full" else 15.0
    return dict(config=spec, context=int(n), batch=int(b), steps=4, prefill_chunk=None,
                attn="sdpa", prefill_s=1.0, prefill_range=[1.0, 1.0], decode_tok_s=rate,
                decode_range=[rate, rate], cache_bytes=1024, peak_above_model_mb=10.0)


class HostileDecodeSpeed(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        if not os.path.exists(KQSVD):
            raise unittest.SkipTest(f"no kqsvd executable at {KQSVD} (./test.sh builds it)")
        cls.mod = load_script()
        cls.wd = workdir("hostile-decode-speed")
        cls.proj = projections(os.path.join(cls.wd, "smollm2"), SMOLLM2)
        cls.other = projections(os.path.join(cls.wd, "other"))  # 4 layers, 2 KV heads
        cls.text = os.path.join(cls.wd, "notes.txt")
        with open(cls.text, "w") as f:
            f.write("not projections\n")

    def setUp(self):
        self.out = tempfile.mkdtemp(dir=self.wd)

    def tearDown(self):
        shutil.rmtree(self.out, ignore_errors=True)

    # -- helpers ---------------------------------------------------------------
    def call(self, argv, cwd=None, measure=None, child=None):
        """The script's main() in this process with sys.argv as given:
        (exit status, stdout, stderr).  measure: what `measure` does (by
        default it fails the test: no run may start); child: what
        each run answers (a FakeRun reply), `measure` then left as it is."""
        err, out = io.StringIO(), io.StringIO()
        runs = contextlib.ExitStack()
        if child is not None:
            runs.enter_context(mock.patch("subprocess.Popen", FakeRun(child)))
        else:
            runs.enter_context(mock.patch.object(
                self.mod, "measure", side_effect=measure or AssertionError("a run started")))
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out), NO_LOAD, runs, \
                mock.patch.object(sys, "argv", [SCRIPT] + list(argv)), inside(cwd):
            try:
                code = self.mod.main()
            except SystemExit as e:
                code = e.code
            except KeyboardInterrupt:  # it would end the test run too
                self.fail("Ctrl-C left main() as a KeyboardInterrupt: a traceback")
        if isinstance(code, str):  # sys.exit("message"): Python prints it, exit 1
            err.write(code + "\n")
            code = 1
        return code, out.getvalue(), err.getvalue()

    def refused(self, argv, code, *words, cwd=None, **kw):
        """argv exits `code` with one line holding every word, before any
        run and without loading the model; nothing is left in self.out."""
        before = sorted(os.listdir(self.out))
        got, _, err = self.call(argv, cwd, **kw)
        lines = [x for x in err.splitlines() if x.strip()]
        self.assertEqual(got, code, err)
        self.assertEqual(len(lines), 1, err)
        self.assertNotIn("Traceback", err)
        self.assertTrue(lines[0].startswith("decode_speed.py: "), lines[0])
        self.assertLessEqual(lines[0].count("error:"), 1, lines[0])
        for w in words:
            self.assertIn(w, lines[0])
        self.assertEqual(sorted(os.listdir(self.out)), before, f"left behind: {lines[0]}")
        return lines[0]

    def measured(self, argv, cwd=None):
        """argv runs through (measure answering made-up rows): the
        (named, context, batch) of each call to measure."""
        calls = []

        def measure(named, n, b, *_):
            calls.append(([spec for _, spec, _ in named], n, b))
            return [dict(fake_row(["--one", spec, str(n), str(b)]), name=name, against_full=1.0)
                    for name, spec, _ in named]
        got, _, err = self.call(argv, cwd, measure=measure)
        self.assertEqual(got, 0, err)
        return calls

    def report(self, name="report.json", change=None, **fields):
        """A `kqsvd frontier` report of int4 and a latent of self.proj."""
        r = {"kqsvd_format": "frontier", "kqsvd_format_version": 1, "model": "SmolLM2",
             "proj": [self.proj], "context": 64, "continuation": 8, "num_seqs": 1,
             "scheme": {"group": 32, "key_axis": "channel", "value_axis": "token", "residual": 0,
                        "rotate": False},
             "full": {"perplexity": 7.5}, "elapsed_s": 3.0,
             "results": [dict(label="int4", family="int-N cache", front=True, front_kl=True,
                              kept=0.3, perplexity=7.9, kl=0.04, top1=0.75),
                         dict(label="kqsvd fixed:8@4", family="kqsvd int4", front=True,
                              front_kl=False, kept=0.05, perplexity=9.0, kl=0.5, top1=0.5)]}
        r.update(fields)
        if change:
            change(r)
        path = os.path.join(self.wd, name)
        with open(path, "w") as f:
            json.dump(r, f)
        return path

    # -- item 10: contexts, lists, plots and repeats ---------------------------
    def test_contexts_within_the_models_positions(self):
        self.refused(["--contexts", "9000", "--config", "int4"], 2, "--contexts 9000", "8192")
        self.refused(["--contexts", "1024,8192", "--config", "int4"], 2,
                     "--contexts 8192 + --steps 32 - 1", "max_position_embeddings = 8192")
        self.refused(["--contexts", "8190", "--steps", "4", "--config", "int4"], 2, "8193")
        self.refused(["--steps", "9000", "--config", "int4"], 2, "--steps 9000")
        # at the edge: the last new token is never fed back
        self.assertEqual(self.measured(["--contexts", "8161", "--config", "int4"]),
                         [(["full", "int4"], 8161, 1)])
        self.refused(["--contexts", "8162", "--config", "int4"], 2, "8193")
        # the default contexts fit with the default --steps
        self.assertEqual([n for _, n, _ in self.measured(["--config", "int4"])],
                         [1024, 4096, 8161])
        self.refused(["--frontier", self.report(context=8190), "--annotate",
                      os.path.join(self.out, "a.json")], 2, "the report's context 8190")

    def test_lists_that_are_empty_or_repeat(self):
        for opt in ("--contexts", "--batches"):
            for bad in ("", ",", " ", "64,,128"):
                self.refused([opt, bad, "--config", "int4"], 2, opt, "comma-separated")
            self.refused([opt, "64,64", "--config", "int4"], 2, opt, "'64' is given twice")

    def test_plot_is_a_png(self):
        for name in ("x.txt", "x", "x.png.json"):
            self.refused(["--frontier", self.report(), "--annotate",
                          os.path.join(self.out, "a.json"), "--plot",
                          os.path.join(self.out, name)], 2, "--plot", ".png")

    def test_a_configuration_given_twice(self):
        p = self.proj
        self.refused(["--contexts", "64", "--config", "int4", "--config", "int4"], 2, "int4",
                     "twice")
        self.refused(["--contexts", "64", "--config", "full", "--config", "full"], 2, "full",
                     "twice")
        self.assertEqual(self.measured(["--contexts", "64", "--config", "int4", "--config", "full"]),
                         [(["full", "int4"], 64, 1)])  # the full cache once, and first
        self.refused(["--contexts", "64", "--config", f"kqsvd:{p}=fixed:8", "--config",
                      f"kqsvd:{p}=kqsvd/fixed:08"], 2, "twice", f"kqsvd:{p}=fixed:8")
        self.refused(["--contexts", "64", "--config", f"kqsvd:{p}", "--config",
                      f"kqsvd:{p}=stored"], 2, "twice")
        # one tiered layout, written two ways
        self.refused(["--contexts", "64", "--config", f"kqsvd:{p}=tiers:w8+s0+1x8@4",
                      "--config", f"kqsvd:{p}=tiers:w8+1.0x8@4"], 2, "twice")
        link = os.path.join(self.wd, "link.h5")
        if not os.path.lexists(link):
            os.symlink(p, link)
        self.refused(["--contexts", "64", "--config", f"kqsvd:{p}=fixed:8@4", "--config",
                      f"kqsvd:{link}=fixed:8@4"], 2, "twice")
        with mock.patch.dict(self.mod.ALIASES, {"mine": f"kqsvd:{p}=fixed:8"}):
            self.refused(["--contexts", "64", "--config", "mine", "--config",
                          f"kqsvd:{p}=fixed:8"], 2, "twice", "'mine'")
            self.refused(["--contexts", "64", "--config", "mine@4", "--config",
                          f"kqsvd:{p}=fixed:8@4"], 2, "twice")
            # other bits or another method are another configuration
            got = self.measured(["--contexts", "64", "--config", "mine", "--config", "mine@4",
                                 "--config", f"kqsvd:{p}=ksvd/fixed:8"])
            self.assertEqual(len(got[0][0]), 4)

    # -- item 16: everything checked before any run -----------------------------
    def test_numbers_are_checked_as_parsed(self):
        for opt in ("--contexts", "--batches", "--threads", "--steps", "--repeats", "--rounds",
                    "--prefill-chunk", "--mmap-threshold"):
            for bad in ("abc", "0", "-1", "1.5", "nan"):
                self.refused([opt, bad, "--config", "int4"], 2, f"argument {opt}", bad)
        self.refused(["--steps", "1", "--config", "int4"], 2, "--steps", "2 or more")

    def test_policies_bits_and_methods(self):
        p = self.proj
        for pol, words in (("bogus:3", ["bogus:3"]), ("fixed:999", ["fixed:999", "head_dim = 64"]),
                           ("fixed:0", ["fixed:0"]), ("eps:2", ["eps:2"]),
                           ("fixed:8@5", ["fixed:8@5", "bits"]), ("fixed:8@", ["bits"]),
                           ("stored@4/9", ["bits"]), ("nometh/fixed:8", ["'nometh'"]),
                           ("tiers:w8+0.5x8@5+0.5xdrop", ["8@5"]),
                           ("tiers:w8+0.5x8@4", ["sum to 0.5"]),
                           ("ksvd/bogus:1", ["bogus:1"])):
            self.refused(["--contexts", "64", "--config", f"kqsvd:{p}={pol}"], 2,
                         f"--config kqsvd:{p}={pol}", *words)

    def test_projection_files(self):
        missing = os.path.join(self.out, "none.h5")
        self.refused(["--contexts", "64", "--config", f"kqsvd:{missing}"], 1, missing,
                     "no such file")
        self.refused(["--contexts", "64", "--config", f"kqsvd:{self.text}=fixed:8"], 1, self.text)
        self.refused(["--contexts", "64", "--config", f"kqsvd:{self.other}"], 1, self.other,
                     "another model")
        self.refused(["--contexts", "64", "--config", f"kqsvd:{self.wd}"], 1, "regular file")
        self.refused(["--contexts", "64", "--config", "kqsvd:/dev/zero"], 1, "regular file")
        self.refused(["--contexts", "64", "--config", "kqsvd:"], 2, "kqsvd:")
        cut = os.path.join(self.wd, "cut.h5")  # a copy that ends half way
        with open(self.proj, "rb") as f, open(cut, "wb") as g:
            g.write(f.read(os.path.getsize(self.proj) // 2))
        self.refused(["--contexts", "64", "--config", f"kqsvd:{cut}"], 1, cut)
        bits = os.path.join(self.wd, "bits.h5")  # 5-bit keys: no such codes
        shutil.copyfile(self.proj, bits)
        import h5py
        import numpy as np
        with h5py.File(bits, "a") as f:
            f["kqsvd/bits_k_heads"] = np.full((30, 3), 5)
            f["kqsvd/bits_v_heads"] = np.full((30, 3), 4)
        self.refused(["--contexts", "64", "--config", f"kqsvd:{bits}"], 1, bits, "bits_k_heads")

    def test_peers_and_their_syntax(self):
        for spec in ("quanto:3", "quanto:x", "hqq:", "press:bogus:0.5", "press:snapkv:nan",
                     "press:snapkv:1", "press:snapkv", "int5", "int", "intx", "bogus", "",
                     "int\u00b2", "int\u0664", "int+4", "int 4"):  # other scripts' digits too
            self.refused(["--contexts", "64", "--config", spec], 2, f"--config {spec}")
        for spec, package in (("quanto:4", "optimum"), ("hqq:2", "hqq"),
                              ("press:snapkv:0.5", "kvpress")):
            if importlib.util.find_spec(package) is None:  # .venv has none of them
                self.refused(["--contexts", "256", "--config", spec], 2, f"--config {spec}",
                             package, ".venv-peers/bin/python")
        if importlib.util.find_spec("kvpress") is not None:  # .venv-peers: the press's window
            self.refused(["--contexts", "32", "--config", "press:snapkv:0.5"], 2, "--contexts 32")

    def test_presses_over_a_quantized_cache(self):
        for spec in ("composite:expected:quanto:3:0.125", "composite:bogus:quanto:4:0.1",
                     "composite:expected:quanto:4", "composite:expected:nope:4:0.1",
                     "composite:expected:quanto:4:1.5", "composite:"):
            self.refused(["--contexts", "256", "--config", spec], 2, f"--config {spec}",
                         "PRESS:BACKEND:BITS:BYTES")
        # a budget the quantized cache holds with every token is no composite
        self.refused(["--contexts", "256", "--config", "composite:expected:quanto:2:0.25"], 2,
                     "--config composite:expected:quanto:2:0.25", "every token")
        if importlib.util.find_spec("optimum") is None:  # .venv
            self.refused(["--contexts", "256", "--config", "composite:snapkv:quanto:4:0.125"],
                         2, "optimum", ".venv-peers/bin/python")
        # a frontier report's press over QuantizedCache runs as one, at its bytes
        row = dict(label="expected:0.4 over quanto-int4", family="kvpress over QuantizedCache",
                   front=True, front_kl=False, kept=0.125, perplexity=8.0, kl=0.05, top1=0.7)
        # the label's 6 digits of the share (1/3 of int2's 0.1875 is 0.0625,
        # 0.333333 of it 0.0624999): the frontier's budget, not the product
        third = dict(row, label="snapkv:0.333333 over quanto-int2")
        path = self.report("composite.json", change=lambda r: r["results"].extend([row, third]))
        with mock.patch("kqsvd.quality.peers.PressOverQuantized.check"):  # no peers in .venv
            got = self.measured(["--frontier", path, "--annotate",
                                 os.path.join(self.wd, "composite-annotated.json"), "--force"])
        self.assertIn("composite:expected:quanto:4:0.125", got[0][0])
        self.assertIn("composite:snapkv:quanto:2:0.0625", got[0][0])
        for label in ("expected:0.4 over quanto", "expected:0.4 over quanto-int3",
                      "expected:0.4 over nope-int4", "expected:x over quanto-int4",
                      "expected:0.4 over quanto-int" + "9" * 400):
            path = self.report("not-composite.json", change=lambda r: r["results"].append(
                dict(row, label=label)))
            self.refused(["--frontier", path, "--annotate", os.path.join(self.out, "a.json")], 1,
                         f"'{label}'", "no press over a QuantizedCache")

    def test_frontier_reports(self):
        out = ["--annotate", os.path.join(self.out, "a.json")]
        bad = os.path.join(self.wd, "bad.json")
        for text, words in (("[1, 2]", ["not a kqsvd frontier report"]),
                            ('{"kqsvd_format": "frontier",', ["not a JSON file"]),
                            ("", ["not a JSON file"]), ("\"frontier\"", ["not a kqsvd"])):
            with open(bad, "w") as f:
                f.write(text)
            self.refused(["--frontier", bad, *out], 1, f"--frontier {bad}", *words)
        with open(bad, "wb") as f:
            f.write(b"\xff\xfe\x00garbage")
        self.refused(["--frontier", bad, *out], 1, f"--frontier {bad}", "not a JSON file")
        for change, field in ((lambda r: r.pop("scheme"), "'scheme'"),
                              (lambda r: r.update(scheme=[]), "'scheme'"),
                              (lambda r: r["scheme"].update(group=0), "scheme"),
                              (lambda r: r["scheme"].update(bits=4), "scheme"),
                              (lambda r: r.pop("results"), "'results'"),
                              (lambda r: r.update(results=[1]), "'results[0]'"),
                              (lambda r: r["results"][1].pop("family"), "'results[1].family'"),
                              (lambda r: r["results"][0].update(front="yes"), "results[0].front'"),
                              (lambda r: r["results"][0].update(kept=None), "results[0].kept'"),
                              (lambda r: r["results"][0].update(kl=float("nan")), "results[0].kl'"),
                              (lambda r: r.update(context=0), "'context'"),
                              (lambda r: r.update(context="64"), "'context'"),
                              (lambda r: r.update(proj=[3]), "'proj[0]'"),
                              (lambda r: r["full"].pop("perplexity"), "'full.perplexity'")):
            path = self.report("bad-field.json", change)
            self.refused(["--frontier", path, *out], 1, f"--frontier {path}", field)
        path = self.report("no-file.json", proj=[])
        self.refused(["--frontier", path, *out], 1, "'kqsvd fixed:8@4'", "names no file")
        path = self.report("gone.json", proj=[os.path.join(self.wd, "gone.h5")])
        self.refused(["--frontier", path, *out], 1, "gone.h5", "no such file")
        path = self.report("bad-policy.json", change=lambda r: r["results"][1].update(
            label="kqsvd fixed:999"))
        self.refused(["--frontier", path, *out], 2, "'kqsvd fixed:999'", "head_dim")
        path = self.report("int9.json", change=lambda r: r["results"][0].update(label="int9"))
        self.refused(["--frontier", path, *out], 2, "'int9'")

    def test_relative_paths_are_the_current_folders(self):
        got = self.measured(["--contexts", "64", "--config", "kqsvd:proj.h5=fixed:8"],
                            cwd=os.path.dirname(self.proj))
        self.assertEqual(got[0][0], ["full", f"kqsvd:{self.proj}=fixed:8"])
        self.refused(["--contexts", "64", "--config", "kqsvd:none.h5"], 1,
                     os.path.join(self.out, "none.h5"), "no such file", cwd=self.out)

    def test_aliases_are_the_repositorys(self):
        path = os.path.join(ROOT, "data", "rank-allocation-post-rope", "proj.h5")
        if os.path.exists(path):
            self.skipTest(f"{path} exists")
        self.refused(["--contexts", "64", "--config", "kqsvd-32@4"], 1, "kqsvd-32@4", path,
                     "no such file", cwd=self.out)

    # -- item 20: the rules of the commands -------------------------------------
    def test_options_that_do_not_go_together_and_outputs(self):
        report = self.report()
        a = os.path.join(self.out, "a.json")
        for argv in (["--annotate", a], ["--front-only"], ["--plot", "x.png"],
                     ["--frontier", report, "--plot", "x.png"],
                     ["--frontier", report, "--annotate", a, "--config", "int4"],
                     ["--contexts", "64", "--bogus"], ["--contexts"]):
            self.refused(argv, 2)
        self.refused(["--contexts", "64", "--config", "int4", "--json", "/dev/null", "--force"], 2,
                     "--json /dev/null", "regular file")
        self.refused(["--contexts", "64", "--config", f"kqsvd:{self.proj}", "--json", self.proj,
                      "--force"], 2, "--json", "input")
        self.refused(["--frontier", report, "--annotate", report, "--force"], 2, "--annotate",
                     "input")
        self.refused(["--contexts", "64", "--config", "int4", "--json",
                      os.path.join(self.out, "no", "x.json")], 2, "does not exist")
        with open(a, "w") as f:
            f.write("{}")
        self.refused(["--contexts", "64", "--config", "int4", "--json", a], 2, "already exists")
        self.refused(["--frontier", report, "--annotate", a, "--json", a, "--force"], 2,
                     "give each output its own file")

    def test_a_cache_budget_chooses_the_batch(self):
        """--cache-budget: refused with what chooses the batch otherwise
        and for sizes that are none; run, each configuration's row is the
        largest batch whose (made-up, measured) cache fits."""
        report = self.report()
        for argv, words in ((["--batches", "2"], ["--cache-budget", "--batches"]),
                            (["--rounds", "2"], ["--rounds"]),
                            (["--frontier", report], ["--frontier"])):
            self.refused(["--contexts", "64", "--cache-budget", "1GiB"] + argv, 2, *words)
        for bad in ("0", "-1", "1XB", "GiB", "1e-3"):
            self.refused(["--contexts", "64", "--cache-budget", bad, "--config", "int4"], 2,
                         f"--cache-budget: '{bad}'")
        rows = os.path.join(self.out, "rows.json")
        runs = []

        def child(cmd):  # the full cache 1,000 bytes a row, int4 300, both 100 more
            spec, n, b = cmd[cmd.index("--one") + 1:][:3]
            runs.append((spec, int(b), cmd[cmd.index("--repeats") + 1]))
            row = dict(fake_row(cmd), cache_bytes=100 + (1000 if spec == "full" else 300) * int(b))
            return 0, json.dumps(row) + "\n", ""
        got, out, err = self.call(["--contexts", "64", "--cache-budget", "10000", "--repeats", "3",
                                   "--config", "int4", "--json", rows], child=child)
        self.assertEqual(got, 0, err)
        with open(rows) as f:
            got = json.load(f)
        self.assertEqual([(r["config"], r["batch"]) for r in got], [("full", 9), ("int4", 33)])
        self.assertEqual([r["against_full"] for r in got], [1.0, 1.5])
        self.assertTrue(all(r["largest_confirmed"] and r["budget_bytes"] == 10000 for r in got))
        # batch 1 sizes the cache in one repeat, each guess runs with --repeats: int4's
        # first (25, by the line through 0) fits, the line through 1 and 25 then gives 33
        self.assertEqual(runs, [("full", 1, "1"), ("full", 9, "3"), ("int4", 1, "1"),
                                ("int4", 25, "3"), ("int4", 33, "3")])
        self.assertIn("int4", out.splitlines()[-1])

    def test_main_takes_argv_and_returns_the_status(self):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), NO_LOAD:
            self.assertEqual(self.mod.main(["--steps", "1"]), 2)
        self.assertEqual(len(err.getvalue().splitlines()), 1, err.getvalue())
        with contextlib.redirect_stdout(io.StringIO()) as out:
            self.assertEqual(self.mod.main(["--help"]), 0)
        for w in ("--contexts", "--config SPEC", "SPEC: full", "kqsvd:PATH", "--frontier",
                  "exit 2"):
            self.assertIn(w, out.getvalue())

    def test_a_failed_run_is_one_line(self):
        argv = ["--contexts", "64", "--config", "int4"]
        traceback = "Traceback (most recent call last):\n  File \"x\", line 1\nRuntimeError: boom\n"
        for code, stderr, words in ((1, traceback, ["RuntimeError: boom"]),
                                    (1, "decode_speed.py: error: x.h5: bad\n", ["x.h5: bad"]),
                                    (-9, "", ["signal 9"]), (0, "", ["no figures"]),
                                    (1, "", ["exit status 1"])):
            self.refused(argv, 1, "full at 64 x 1", *words, child=lambda cmd: (code, "", stderr))

    def test_interrupted_in_process(self):
        self.refused(["--contexts", "64", "--config", "int4"], 130, "interrupted; nothing written",
                     measure=KeyboardInterrupt)

    # -- what worked keeps working ------------------------------------------------
    def test_runs_write_the_rows_and_the_annotated_report(self):
        rows = os.path.join(self.out, "rows.json")

        def child(cmd):
            return 0, json.dumps(fake_row(cmd)) + "\n", ""
        got, out, err = self.call(["--contexts", "64,128", "--batches", "1,2", "--rounds", "2",
                                   "--config", "int4", "--json", rows], child=child)
        self.assertEqual(got, 0, err)
        with open(rows) as f:
            got = json.load(f)
        self.assertEqual([(r["config"], r["context"], r["batch"]) for r in got],
                         [(c, n, b) for n in (64, 128) for b in (1, 2) for c in ("full", "int4")])
        self.assertEqual({r["against_full"] for r in got}, {1.0, 1.5})
        self.assertEqual({r["rounds"] for r in got}, {2})
        plot = importlib.util.find_spec("matplotlib") is not None
        a, png = os.path.join(self.out, "a.json"), os.path.join(self.out, "a.png")
        got, out, err = self.call(["--frontier", self.report(), "--annotate", a, "--json", rows,
                                   "--force"] + (["--plot", png] if plot else []), child=child)
        self.assertEqual(got, 0, err)
        with open(a) as f:
            ann = json.load(f)
        self.assertEqual([r["decode"][0]["against_full"] for r in ann["results"]], [1.5, 1.5])
        self.assertEqual(ann["decode_full"][0]["context"], 64)
        self.assertEqual(os.path.exists(png), plot)
        self.assertEqual(sorted(os.listdir(self.out)), ["a.json"] + ["a.png"] * plot +
                         ["rows.json"])

    def test_interrupted_run_leaves_nothing(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            out = os.path.join(self.out, f"{sig.name}.json")
            p = subprocess.Popen([sys.executable, SCRIPT, "--contexts", "64", "--steps", "4",
                                  "--repeats", "1", "--config", "int4", "--json", out], env=ENV,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            self.assertIn("decode tok/s", p.stdout.readline())  # the checks passed
            kids, deadline = [], time.time() + 30
            while not kids and time.time() < deadline:  # the full cache's run has started
                try:
                    with open(f"/proc/{p.pid}/task/{p.pid}/children") as f:
                        kids = [int(x) for x in f.read().split()]
                except OSError:
                    p.kill()
                    p.communicate()
                    self.skipTest("no /proc/PID/task/PID/children here to find the run by")
                time.sleep(0.1)
            self.assertTrue(kids, "no run started within 30 s")
            p.send_signal(sig)
            _, err = p.communicate(timeout=120)
            self.assertEqual(p.returncode, 130, err)
            self.assertNotIn("Traceback", err)
            self.assertEqual([x for x in err.splitlines() if x.strip()],
                             ["decode_speed.py: interrupted; nothing written"])
            for kid in kids:  # no run left behind
                with self.assertRaises(ProcessLookupError):
                    os.kill(kid, 0)
            self.assertEqual(os.listdir(self.out), [])

    def test_one_run_for_real(self):
        p = subprocess.run([sys.executable, SCRIPT, "--one", "int4", "16", "1", "--steps", "2",
                            "--repeats", "1", "--threads", "1"], env=ENV, capture_output=True,
                           text=True, timeout=300)
        self.assertEqual(p.returncode, 0, p.stderr)
        # transformers 5.24 renamed generate()'s past_key_values to cache, and warns at the old name
        self.assertNotIn("deprecated", p.stderr)
        row = json.loads(p.stdout.strip().splitlines()[-1])
        self.assertEqual((row["config"], row["context"], row["batch"]), ("int4", 16, 1))
        self.assertGreater(row["decode_tok_s"], 0)


if __name__ == "__main__":
    unittest.main()
