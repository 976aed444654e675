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
from kqsvd.quality.retrieval import (ANSWER_TOKENS, DIGITS, INTRO, NEEDLE, QUESTION, SPAN,
                                     SPAN_INTRO, SPAN_NEEDLE, SPAN_QUESTION, accuracy, answer,
                                     is_key, is_span, passkey, passkey_prompt, span_prompt)


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

    def test_span_prompt(self):
        enc = lambda s: self.tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
        phrase = "12345-67890-24680-13579"
        needle = enc(SPAN_NEEDLE.format(code=phrase))
        head = len(enc(SPAN_INTRO))
        for n, depth in ((200, 0.0), (300, 0.6), (300, 1.0)):
            ctx, q = span_prompt(self.tok, self.filler, n, depth, phrase)
            self.assertEqual(len(ctx) + len(q), n)
            self.assertEqual(q, enc(SPAN_QUESTION))
            at = next(i for i in range(len(ctx)) if ctx[i:i + len(needle)] == needle)
            body = n - head - len(needle) - len(q)
            self.assertEqual(at - head, round(body * depth))
            self.assertEqual(ctx[head:at] + ctx[at + len(needle):], self.filler[:body])
        with self.assertRaises(UsageError):
            span_prompt(self.tok, self.filler, 30, 0.5, phrase)
        # the answer's room holds the code with its leading space
        self.assertLessEqual(len(enc(" " + phrase)), ANSWER_TOKENS["span"])

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
        self.assertTrue(is_span(" 12345-67890-24680-13579.", "12345-67890-24680-13579"))
        self.assertFalse(is_span(" 12345-67890-24680", "12345-67890-24680-13579"))
        self.assertFalse(is_span(" 12345-67890-24681-13579", "12345-67890-24680-13579"))
        spans = passkey(self.model, self.tok, self.filler, [300], [0.5, 0.9], [], seed=3,
                        task="span")
        for row in spans["full"]:
            groups = row["key"].split("-")
            self.assertEqual(len(groups), SPAN)
            self.assertTrue(all(len(g) == DIGITS and g.isdigit() for g in groups))
            self.assertEqual(row["correct"], is_span(row["answer"], row["key"]))
        self.assertNotEqual(*[r["key"] for r in spans["full"]])
        with self.assertRaises(UsageError):
            passkey(self.model, self.tok, self.filler, [300], [0.5], [], task="needles")


if __name__ == "__main__":
    unittest.main()
