"""The passkey test (kqsvd.quality.retrieval) on a tiny Llama: prompts of
the asked length with the key where the depth says, answers through a
configuration's cache equal to generate()'s with the model's own, and the
grading of answers."""
import unittest

import numpy as np
import torch

from common import TEXT, Calibrated

from kqsvd import models
from kqsvd.errors import UsageError
from kqsvd.formats.quant import QuantScheme
from kqsvd.quality.configs import Config, PlainQuant
from kqsvd.quality.retrieval import (COLOURS, DIGITS, INTRO, MULTI, MULTI_INTRO,
                                     MULTI_NEEDLE, MULTI_QUESTION, NEEDLE, QUESTION, accuracy,
                                     answer, is_key, multikey_prompt, passkey, passkey_prompt)


class Passkey(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cal = Calibrated.get()
        cls.model, cls.tok, _ = models.load(cal.model, dtype=torch.float64)
        with open(TEXT, encoding="utf-8") as f:
            cls.filler = cls.tok(f.read()[:20000], add_special_tokens=False)["input_ids"]

    def test_prompt_length_and_depth(self):
        enc = lambda s: self.tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
        head = len(enc(INTRO))
        for n, depth in ((120, 0.0), (200, 0.5), (300, 1.0), (300, 0.3)):
            ctx, q = passkey_prompt(self.tok, self.filler, n, depth, 12345)
            self.assertEqual(len(ctx) + len(q), n)
            self.assertEqual(q, enc(QUESTION))
            needle = enc(NEEDLE.format(key=12345))
            at = next(i for i in range(len(ctx)) if ctx[i:i + len(needle)] == needle)
            body = n - head - len(needle) - len(q)
            self.assertEqual(at - head, round(body * depth))   # filler before the needle
            self.assertEqual(ctx[head:at] + ctx[at + len(needle):], self.filler[:body])
        with self.assertRaises(UsageError):
            passkey_prompt(self.tok, self.filler, 20, 0.5, 12345)
        with self.assertRaises(UsageError):
            passkey_prompt(self.tok, self.filler[:10], 500, 0.5, 12345)

    def test_multikey_prompt(self):
        """Every key at its share of the filler, in depth order, the filler
        whole between them, the question naming the first key's colour."""
        enc = lambda s: self.tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
        keys = [11111, 22222, 33333, 44444]
        needles = [enc(MULTI_NEEDLE.format(name=c, key=k)) for c, k in zip(COLOURS, keys)]
        for n, depth in ((400, 0.0), (500, 0.6), (450, 0.9)):
            ctx, q = multikey_prompt(self.tok, self.filler, n, depth, keys)
            self.assertEqual(len(ctx) + len(q), n)
            self.assertEqual(q, enc(MULTI_QUESTION.format(name=COLOURS[0])))
            body = n - len(enc(MULTI_INTRO)) - sum(map(len, needles)) - len(q)
            filler, at, i = [], len(enc(MULTI_INTRO)), 0
            found = {}
            while i < len(ctx):   # walk the context, lifting the needles out
                hit = next((j for j, nd in enumerate(needles) if ctx[i:i + len(nd)] == nd), None)
                if hit is None:
                    if i >= at:
                        filler.append(ctx[i])
                    i += 1
                else:
                    found[hit] = len(filler)
                    i += len(needles[hit])
            self.assertEqual(filler, self.filler[:body])
            self.assertEqual(sorted(found), list(range(MULTI)))
            for j in range(MULTI):   # key j after (depth + j / 4) mod 1 of the filler
                self.assertEqual(found[j], round(body * ((depth + j / MULTI) % 1)))
        with self.assertRaises(UsageError):
            multikey_prompt(self.tok, self.filler, 60, 0.5, keys)

    def test_answers_are_generates_own(self):
        ctx, q = passkey_prompt(self.tok, self.filler, 150, 0.3, 54321)
        ids = torch.tensor([ctx + q])
        with torch.no_grad():
            want = self.model.generate(ids, max_new_tokens=DIGITS + 1, do_sample=False,
                                       attention_mask=torch.ones_like(ids))[0, ids.shape[1]:]
        self.assertEqual(answer(self.model, ctx, q, Config()), want.tolist())
        # int8 codes change little; the answer has the same length
        self.assertEqual(len(answer(self.model, ctx, q, PlainQuant(8, QuantScheme(group=16)))),
                         DIGITS + 1)

    def test_grading(self):
        self.assertTrue(is_key(" 12345.\n", 12345))
        self.assertTrue(is_key("12345 Remember", 12345))
        self.assertFalse(is_key(" 123456.", 12345))
        self.assertFalse(is_key(" 1234", 12345))
        self.assertFalse(is_key(" the key", 12345))
        rows = passkey(self.model, self.tok, self.filler, [100, 140], [0.2, 0.8],
                       [PlainQuant(4, QuantScheme(group=16))], seed=3)
        self.assertEqual(list(rows), ["full", "int4"])
        self.assertEqual([(r["length"], r["depth"]) for r in rows["full"]],
                         [(100, 0.2), (100, 0.8), (140, 0.2), (140, 0.8)])
        keys = [r["key"] for r in rows["full"]]
        self.assertTrue(all(10000 <= k < 100000 for k in keys))
        self.assertEqual(keys, [r["key"] for r in rows["int4"]])
        for label, got in rows.items():
            self.assertEqual(accuracy(got), np.mean([is_key(r["answer"], r["key"]) for r in got]))
        multi = passkey(self.model, self.tok, self.filler, [300], [0.5], [], seed=3,
                        task="multikey")
        (row,) = multi["full"]
        self.assertEqual((row["length"], row["depth"]), (300, 0.5))
        self.assertTrue(10000 <= row["key"] < 100000)
        self.assertEqual(row["correct"], is_key(row["answer"], row["key"]))
        with self.assertRaises(UsageError):
            passkey(self.model, self.tok, self.filler, [300], [0.5], [], task="needles")


if __name__ == "__main__":
    unittest.main()
