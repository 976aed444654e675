"""RULER's tasks (kqsvd.quality.ruler, bench/ruler.py, issue 58 item 7):
niah_single_1 written again here from docs/ruler.md alone and made sample
by sample for a seed; every task's samples checked by their properties
(they fit, their answers are in them, a larger haystack would not fit);
the grading, the Wilson interval and the summary against hand-worked
cases; and bench/ruler.py on a tiny model: its report, a stopped run gone
on from without redoing a sample, and its refusals."""
import json
import math
import os
import re
import unittest
import zlib

import numpy as np
from common import ROOT
from test_hostile_passkey import ScriptCase

from kqsvd.quality import ruler

TEXT = os.path.join(ROOT, "examples", "data", "jargon-file-4.4.7.txt")


class WordTokens:
    """A tokenizer of a word (a run of non-spaces) a token: enough to fit a
    sample, and one the test and the module cannot disagree on."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [zlib.crc32(w.encode()) for w in text.split()]}


def _words(text):
    """docs/ruler.md's word list, by another road than the module's regex."""
    runs = re.split(r"[^A-Za-z]+", text)
    return sorted({r for r in runs if 4 <= len(r) <= 10 and r == r.lower()})


def _niah_single_1(seed, length, index, vocabulary, tok):
    """docs/ruler.md's niah_single_1, written from the page."""
    noise = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and "
             "back again.")

    def build(n):
        g = np.random.default_rng([seed, zlib.crc32(b"niah_single_1"), length, index])
        i, j = g.choice(len(vocabulary), 2, replace=False)
        key = vocabulary[i] + "-" + vocabulary[j]
        value = str(int(g.integers(10 ** 6, 10 ** 7)))
        needle = f"One of the special magic numbers for {key} is: {value}."
        g.permutation(1)  # step 2 reorders the one needle
        units = [noise] * n
        at = sorted(g.integers(0, n + 1, 1))[::-1]
        units.insert(int(at[0]), needle)
        g.choice(1, 1, replace=False)  # step 4: the one key asked
        context = ("A special magic number is hidden within the following text. Make sure to "
                   "memorize it. I will quiz you about the number afterwards.\n" +
                   "\n".join(units) + "\n")
        question = (f"What is the special magic number for {key} mentioned in the provided text? "
                    f"The special magic number for {key} mentioned in the provided text is")
        return context, question, [value]

    def fits(n):
        c, q, _ = build(n)
        return len(tok(c)["input_ids"]) + len(tok(q)["input_ids"]) + 128 <= length
    lo, hi = 1, 2
    while hi <= 1 << 20 and fits(hi):
        lo, hi = hi, 2 * hi
    hi = min(hi, (1 << 20) + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    c, q, answers = build(lo)
    return lo, tok(c)["input_ids"], tok(q)["input_ids"], answers


class Generation(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        with open(TEXT, encoding="utf-8") as f:
            cls.text = f.read()
        cls.words = ruler.Words(cls.text)
        cls.tok = WordTokens()

    def test_the_word_list_is_the_pages(self):
        self.assertEqual(self.words.vocabulary, _words(self.text))

    def test_niah_single_1_sample_by_sample(self):
        for seed in (0, 7):
            for length in (300, 1000):
                for index in range(5):
                    with self.subTest(seed=seed, length=length, index=index):
                        s = ruler.sample("niah_single_1", self.tok, self.words, seed, length,
                                         index)
                        n, c, q, answers = _niah_single_1(seed, length, index,
                                                          self.words.vocabulary, self.tok)
                        self.assertEqual((s["n"], s["context"], s["question"], s["answers"]),
                                         (n, c, q, answers))
        # the seed and the index each change the sample
        a, b, c = (ruler.sample("niah_single_1", self.tok, self.words, seed, 300, i)["answers"]
                   for seed, i in ((0, 0), (1, 0), (0, 1)))
        self.assertTrue(a != b and a != c)

    def test_every_task_fits_and_holds_its_answers(self):
        for task in ruler.TASKS:
            for length in (1500, 5000):
                with self.subTest(task=task, length=length):
                    s = ruler.sample(task, self.tok, self.words, 3, length, 2)
                    used = len(s["context"]) + len(s["question"]) + s["new"]
                    self.assertLessEqual(used, length)
                    # a haystack one larger no longer fits (the bisection's end)
                    c, q, _ = ruler.build(task, 3, length, 2, s["n"] + 1, self.words)
                    bigger = len(self.tok(c)["input_ids"]) + len(self.tok(q)["input_ids"])
                    self.assertGreater(bigger + s["new"], length)
                    self.assertGreater(used, 0.9 * length)  # the length is spent
                    context, _, answers = ruler.build(task, 3, length, 2, s["n"], self.words)
                    self.assertEqual(answers, s["answers"])
                    self._holds(task, context, answers)

    def _holds(self, task, context, answers):
        """The answers are where the task says in its context."""
        if task in ruler.NIAH:
            for v in answers:
                self.assertIn(f"is: {v}.", context)
        elif task == "vt":
            last = context.split("\n\n", 2)[2]  # the task after the worked example
            value = re.search(r"VAR [A-Z]{5} = (\d+)", last).group(1)
            for a, b in zip(answers, answers[1:]):
                self.assertIn(f"VAR {b} = VAR {a}", last)
            self.assertIn(f"VAR {answers[0]} = {value}", last)
        else:
            body = context.rsplit("\n", 2)[-2]
            counts = {}
            for w in body.split():
                if not w.endswith(".") or w == "...":
                    counts[w] = counts.get(w, 0) + 1
            top = sorted((w for w in counts if w != "..."), key=lambda w: -counts[w])
            want = 10 if task == "cwe" else 3
            self.assertEqual(set(top[:want]), set(answers))
            self.assertGreater(counts[top[want - 1]], counts[top[want]])

    def test_a_length_too_short_is_refused(self):
        from kqsvd.errors import UsageError
        with self.assertRaises(UsageError) as e:
            ruler.sample("cwe", self.tok, self.words, 0, 150, 0)
        self.assertIn("cwe needs more than 150 tokens", str(e.exception))

    def test_grading_as_ruler_grades(self):
        self.assertEqual(ruler.found(" 1234567 and 7654321", ["1234567", "7654321"]), 2)
        self.assertEqual(ruler.found(" The answer: ABC-def", ["abc-DEF", "x"]), 1)
        self.assertEqual(ruler.found("", ["1"]), 0)

    def test_wilson_interval(self):
        # worked by hand from the formula: 5 of 10, 0 of 25, 25 of 25
        lo, hi = ruler.wilson(5, 10)
        self.assertAlmostEqual(lo, 0.23659309, 6)
        self.assertAlmostEqual(hi, 0.76340691, 6)
        self.assertEqual(ruler.wilson(0, 25)[0], 0.0)
        self.assertAlmostEqual(ruler.wilson(0, 25)[1], 3.8414588 / (25 + 3.8414588), 6)
        lo, hi = ruler.wilson(25, 25)
        self.assertAlmostEqual(lo, 25 / (25 + 3.8414588), 6)
        for k in range(0, 26):  # it holds the rate, and mirrors k and n - k
            lo, hi = ruler.wilson(k, 25)
            self.assertLessEqual(lo, k / 25)
            self.assertGreaterEqual(hi, k / 25)
            lo2, hi2 = ruler.wilson(25 - k, 25)
            self.assertTrue(math.isclose(lo, 1 - hi2, abs_tol=1e-12))

    def test_the_summary(self):
        def rec(task, config, correct, found=None, mode="agnostic"):
            return dict(task=task, length=100, config=config, mode=mode, of=2,
                        found=2 if correct else (found or 0), correct=correct)
        records = [rec("a", "full", True) for _ in range(4)] + [rec("a", "full", False)]
        records += [rec("b", "full", False, 1) for _ in range(5)]
        records += [rec("a", "x", i < 2, 1, m) for i in range(5) for m in ("agnostic", "aware")]
        records += [rec("b", "x", True, mode=m) for _ in range(5) for m in ("agnostic", "aware")]
        summary, beyond = ruler.tally(records, ["agnostic", "aware"])
        self.assertEqual(beyond, {"100": ["b"]})  # 0 of 5 < 80%; a: 4 of 5 counts
        a = summary["aware"]["x"]["100"]
        self.assertEqual((a["tasks"]["a"]["k"], a["tasks"]["a"]["n"]), (2, 5))
        self.assertAlmostEqual(a["tasks"]["a"]["score"], (2 * 1 + 3 * 0.5) / 5)
        self.assertEqual((a["average"]["k"], a["average"]["n"]), (2, 5))  # b not counted
        self.assertEqual(summary["aware"]["full"], summary["agnostic"]["full"])  # run once
        self.assertAlmostEqual(summary["agnostic"]["full"]["100"]["tasks"]["b"]["score"], 0.5)


class Bench(ScriptCase):
    """bench/ruler.py on the tiny model, as test_hostile_passkey runs
    bench/passkey.py."""
    WORK = "hostile-ruler"
    PROG = "ruler.py"

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        import importlib.util
        spec = importlib.util.spec_from_file_location("ruler_bench",
                                                      os.path.join(ROOT, "bench", "ruler.py"))
        cls.bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(cls.bench)

    def args(self, *extra, json_path="r.json", proj=True):
        return ["--model", self.model, "--text", self.text, "--lengths", "400", "--samples", "2",
                "--tasks", "niah_single_1,vt", "--plain", "4", "--presses", "none"] + \
            (["--proj", self.proj] if proj else []) + \
            (["--json", os.path.join(self.out, json_path)] if json_path else []) + list(extra)

    def _report(self):
        with open(os.path.join(self.out, "r.json")) as f:
            return json.load(f)

    def test_a_stopped_run_goes_on(self):
        real, calls, seen = self.bench.answer_one, [], set()

        def counted(*a, **k):
            calls.append(a[2]["task"])
            seen.add(a[0].config._attn_implementation)  # the full model's, and int4's
            if len(calls) == 12:  # in the third sample (5 answers a sample)
                raise KeyboardInterrupt
            return real(*a, **k)
        from unittest import mock
        with mock.patch.object(self.bench, "answer_one", counted):
            code, _, err = self.call(self.args("--question", "both"), loads=True)
        self.assertEqual(code, 130, err)
        self.assertIn("holds the 2 samples finished", err)
        self.assertNotIn("Traceback", err)
        first = self._report()
        self.assertFalse(first["complete"])
        self.assertEqual(len(first["results"]), 10)  # full, int4 and the file twice each
        self.assertEqual(os.listdir(self.out), ["r.json"])  # no temporary left
        calls.clear()
        with mock.patch.object(self.bench, "answer_one", counted):
            code, out, err = self.call(self.args("--question", "both"), loads=True)
        self.assertEqual(code, 0, err)
        self.assertEqual(len(calls), 10)  # the two samples left, nothing redone
        done = self._report()
        self.assertTrue(done["complete"])
        self.assertEqual(done["results"][:10], [dict(r, kept=r["kept"]) for r in
                                               first["results"]])
        keys = [(r["task"], r["index"], r["config"], r["mode"]) for r in done["results"]]
        self.assertEqual(len(set(keys)), 20)
        self.assertEqual(set(done["summary"]), {"agnostic", "aware"})
        full = [r for r in done["results"] if r["config"] == "full"]
        self.assertTrue(all(r["kept"] == 1.0 for r in full))
        for r in done["results"]:
            self.assertEqual(r["correct"], ruler.found(r["answer"], r["answers"]) == r["of"])
        self.assertIn("beyond the model", out)
        # SDPA unless asked: what users run, 4 times eager's speed
        self.assertEqual(seen, {"sdpa"})
        self.assertEqual(done["settings"]["attention"], "sdpa")
        # complete: not replaced without --force; other settings: not gone on from
        self.refused(self.args("--question", "both"), 2, "--json", "complete", "--force")
        done["complete"] = False
        with open(os.path.join(self.out, "r.json"), "w") as f:
            json.dump(done, f)
        self.refused(self.args("--question", "both", "--seed", "1"), 2, "--json", "seed",
                     "--force")
        self.refused(self.args("--question", "both", "--attention", "eager"), 2, "--json",
                     "attention", "--force")

    def test_refusals_before_the_load(self):
        for opt, value in (("--tasks", "niah_single_9"), ("--tasks", "vt,vt"),
                           ("--samples", "0"), ("--question", "sometimes")):
            with self.subTest(opt=opt, value=value):
                self.refused(self.args(opt, value), 2, opt)
        self.refused(self.args("--lengths", "100"), 2, "--lengths 100")
        self.refused(self.args("--kivi", "4", "--kivi-residual", "401"), 2,
                     "--kivi-residual 401", "400")
        self.refused(self.args("--kivi", "5"), 2, "--kivi", "5")
        self.refused(self.args("--lengths", "600"), 2, "--lengths 600", "512")
        with open(os.path.join(self.out, "r.json"), "w") as f:
            f.write("not a report\n")
        self.refused(self.args(), 2, "--json", "not a ruler.py report")

    def test_kivi_holds_its_residual_unquantized(self):
        code, out, err = self.call(self.args("--kivi", "4", "--kivi-residual", "64", "--samples",
                                             "1", proj=False), loads=True)
        self.assertEqual(code, 0, err)
        rows = {(r["task"], r["config"]): r for r in self._report()["results"]}
        kivi = "int4 + 64 residual (KIVI)"
        self.assertIn(kivi, out)
        for task in ("niah_single_1", "vt"):
            full, int4, k = (rows[task, c]["held"] for c in ("full", "int4", kivi))
            # 64 tokens at bf16 against int4's codes (4 bits and a scale and
            # zero per 32 values): more bytes than int4, fewer than the full
            self.assertGreater(k, int4)
            self.assertLess(k, full)
