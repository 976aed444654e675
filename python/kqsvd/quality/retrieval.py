"""Retrieval at long context: a passkey (a 5-digit number) hidden at a
depth of filler text, then asked for and answered greedily, through each
configuration's cache as the frontier runs it (configs.Config): the
context (instructions, filler, the passkey's sentence) is prefilled, and
compressed as the configuration compresses, the question follows as one
chunk at its positions, then each answer token one at a time.  An
eviction press thus chooses what to keep before it sees the question, as
when a long document is cached for questions to come.

The answer is right when its first run of digits is the key, no more and
no fewer digits (SmolLM2 sometimes appends one).

The multi-key task (TASKS) hides MULTI keys, each named by a colour, one
at the trial's depth and the others spread evenly after it (wrapping to
the start), and asks for the first: the model must retrieve the right key
among look-alikes, not the only number in the text."""
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
MULTI = 4
COLOURS = ("red", "blue", "green", "yellow")
MULTI_INTRO = ("There are several pass keys hidden inside a lot of irrelevant text, each with "
               "a colour. Find them and memorize them. I will quiz you about one of them.\n")
MULTI_NEEDLE = "\nThe {name} pass key is {key}. Remember it. {key} is the {name} pass key.\n"
MULTI_QUESTION = "\nWhat is the {name} pass key? The {name} pass key is"
TASKS = ("passkey", "multikey")


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
    return _prompt(tok, filler, length, INTRO, [(depth, NEEDLE.format(key=key))], QUESTION)


def multikey_prompt(tok, filler, length, depth, keys):
    """passkey_prompt's (context ids, question ids) for len(keys) keys, each
    named by a colour (COLOURS): keys[0] at `depth`, keys[j] at depth + j /
    len(keys) (modulo 1), the question asking for keys[0]."""
    _check_prompt(length, depth)
    if not 1 <= len(keys) <= len(COLOURS):
        raise UsageError(f"multikey: {len(keys)} keys; 1 to {len(COLOURS)} have colours")
    needles = [((depth + j / len(keys)) % 1, MULTI_NEEDLE.format(name=c, key=k))
               for j, (c, k) in enumerate(zip(COLOURS, keys))]
    return _prompt(tok, filler, length, MULTI_INTRO, needles,
                   MULTI_QUESTION.format(name=COLOURS[0]))


def _prompt(tok, filler, length, intro, needles, question):
    """intro, the filler with each needle (depth, text) after that share of
    it, then the question: (context ids, question ids), `length` in all."""
    def enc(s):
        return tok(s, add_special_tokens=False)["input_ids"]
    head, question = enc(intro), enc(question)
    needles = sorted((d, enc(t)) for d, t in needles)
    body = length - len(head) - sum(len(t) for _, t in needles) - len(question)
    kind = "key" if len(needles) == 1 else "keys"
    if body < 1:
        raise UsageError(f"passkey: a prompt of {length} tokens leaves no room for filler: the "
                         f"instructions, {kind} and question take {length - body}, so at least "
                         f"{length - body + 1}")
    if body > len(filler):
        raise UsageError(f"passkey: a prompt of {length} tokens needs {body} tokens of filler; "
                         f"the text gives {len(filler)}")
    out, at = list(head), 0
    for d, t in needles:
        cut = int(round(body * d))
        out += filler[at:cut] + t
        at = cut
    return out + filler[at:body], question


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


def passkey(model, tok, filler, lengths, depths, configs, seed=0, progress=None,
            task="passkey"):
    """Every (length, depth) trial of `task` (TASKS), keys drawn for each,
    answered by the full model and by each configuration.  Returns {label:
    [dict(length, depth, key, answer, correct)]}, "full" first, key the one
    asked.  Not collective."""
    if task not in TASKS:
        raise UsageError(f"retrieval: unknown task '{task}' (expected {', '.join(TASKS)})")
    rng = np.random.default_rng(seed)
    trials = [(n, d, _draw(rng, task)) for n in lengths for d in depths]
    everyone = [Config()] + list(configs)
    out = {c.label: [] for c in everyone}
    for n, d, keys in trials:
        if task == "multikey":
            context, question = multikey_prompt(tok, filler, n, d, keys)
        else:
            context, question = passkey_prompt(tok, filler, n, d, keys[0])
        for c in everyone:
            text = tok.decode(answer(model, context, question, c))
            out[c.label].append(dict(length=n, depth=d, key=keys[0], answer=text,
                                     correct=is_key(text, keys[0])))
            if progress:
                progress()
    return out


def _draw(rng, task):
    """A trial's keys: one (drawn as before the multi-key task, so that a
    seed gives the passkey reports it gave), or MULTI distinct ones."""
    lo, hi = 10 ** (DIGITS - 1), 10 ** DIGITS
    if task == "passkey":
        return [int(rng.integers(lo, hi))]
    return [int(k) for k in rng.choice(np.arange(lo, hi), MULTI, replace=False)]


def accuracy(rows, length=None):
    """The share of right answers, over every trial or those of one length."""
    rows = [r for r in rows if length is None or r["length"] == length]
    return sum(r["correct"] for r in rows) / max(len(rows), 1)
