"""Retrieval at long context: a passkey (a 5-digit number) hidden at a
depth of filler text, then asked for and answered greedily, through each
configuration's cache as the frontier runs it (configs.Config): the
context (instructions, filler, the passkey's sentence) is prefilled, and
compressed as the configuration compresses, the question follows as one
chunk at its positions, then each answer token one at a time.  An
eviction press thus chooses what to keep before it sees the question, as
when a long document is cached for questions to come.

The answer is right when its first run of digits is the key, no more and
no fewer digits (SmolLM2 sometimes appends one)."""
import numbers
import re

import numpy as np

from ..compat import cache_kwarg, output_cache
from ..errors import UsageError
from .configs import Config

INTRO = ("There is a pass key hidden inside a lot of irrelevant text. Find it and memorize "
         "it. I will quiz you about the pass key.\n")
NEEDLE = "\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "\nWhat is the pass key? The pass key is"
DIGITS = 5


def _check_prompt(length, depth):
    """UsageError naming a length or depth passkey_prompt cannot place:
    a depth outside [0, 1] puts the key before the filler's start or past
    its end, and NaN or an infinity cannot be rounded to a token."""
    def shown(v):  # numpy's repr of its scalars would say np.float64(nan)
        return str(v) if isinstance(v, numbers.Real) and not isinstance(v, bool) else repr(v)
    if isinstance(length, bool) or not isinstance(length, numbers.Integral):
        raise UsageError(f"passkey: length {shown(length)} is not a whole number of tokens")
    if isinstance(depth, bool) or not isinstance(depth, numbers.Real) or not 0 <= depth <= 1:
        raise UsageError(f"passkey: depth {shown(depth)} is not a number in [0, 1] (the share "
                         "of the filler before the key)")


def passkey_prompt(tok, filler, length, depth, key):
    """(context ids, question ids) of `length` tokens in all: INTRO, then
    the filler's tokens (a list of ids) with NEEDLE inserted after `depth`
    (0..1) of them.  UsageError when length leaves no room for filler or
    needs more filler than given, when it is not a whole number, and when
    depth is not a number in [0, 1] (NaN and the infinities included)."""
    _check_prompt(length, depth)

    def enc(s):
        return tok(s, add_special_tokens=False)["input_ids"]
    head, needle, question = enc(INTRO), enc(NEEDLE.format(key=key)), enc(QUESTION)
    body = length - len(head) - len(needle) - len(question)
    if body < 1:
        raise UsageError(f"passkey: a prompt of {length} tokens leaves no room for filler: the "
                         f"instructions, key and question take {length - body}, so at least "
                         f"{length - body + 1}")
    if body > len(filler):
        raise UsageError(f"passkey: a prompt of {length} tokens needs {body} tokens of filler; "
                         f"the text gives {len(filler)}")
    at = int(round(body * depth))
    return head + filler[:at] + needle + filler[at:body], question


def answer(model, context, question, config, new=DIGITS + 1):
    """The greedy continuation (new token ids) of context + question through
    `config`: the context prefilled into its cache, the question as one
    chunk, then one token at a time.  Not collective."""
    import torch
    dev = next(model.parameters()).device
    key = cache_kwarg(model)
    ids = torch.tensor([list(context) + list(question)], device=dev)
    n = len(context)
    got = []
    with torch.no_grad(), config.window(model):
        cache = config.cache(model)
        with config.prefill(model):
            out = model(input_ids=ids[:, :n], use_cache=True, **{key: cache})
        cache = output_cache(out)
        step, at = ids[:, n:], n
        while True:
            pos = torch.arange(at, at + step.shape[1], device=dev)[None]
            out = model(input_ids=step, position_ids=pos, use_cache=True, **{key: cache})
            cache = output_cache(out)
            at += step.shape[1]
            got.append(int(out.logits[0, -1].argmax()))
            if len(got) == new:
                return got
            step = torch.tensor([[got[-1]]], device=dev)


def is_key(text, key):
    """Whether the answer's first run of digits is exactly the key."""
    m = re.match(r"\s*(\d+)", text)
    return bool(m) and m.group(1) == str(key)


def passkey(model, tok, filler, lengths, depths, configs, seed=0, progress=None):
    """Every (length, depth) trial, a key drawn for each, answered by the
    full model and by each configuration.  Returns {label: [dict(length,
    depth, key, answer, correct)]}, "full" first.  Not collective."""
    rng = np.random.default_rng(seed)
    trials = [(n, d, int(rng.integers(10 ** (DIGITS - 1), 10 ** DIGITS)))
              for n in lengths for d in depths]
    everyone = [Config()] + list(configs)
    out = {c.label: [] for c in everyone}
    for n, d, k in trials:
        context, question = passkey_prompt(tok, filler, n, d, k)
        for c in everyone:
            text = tok.decode(answer(model, context, question, c))
            out[c.label].append(dict(length=n, depth=d, key=k, answer=text,
                                     correct=is_key(text, k)))
            if progress:
                progress()
    return out


def accuracy(rows, length=None):
    """The share of right answers, over every trial or those of one length."""
    rows = [r for r in rows if length is None or r["length"] == length]
    return sum(r["correct"] for r in rows) / max(len(rows), 1)
