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

The span task (TASKS) hides an access code of SPAN groups of DIGITS digits
joined by dashes and asks for it back: twenty digits retrieved and copied
in order, not five.  The answer is right when it starts with the code.
(Tried first on the full SmolLM2-135M at 2,048 tokens, both too hard to
judge a cache by: four keys named by colours with one asked, 2 of 3
right; a phrase of six common words, 2 of 3, the one at a tenth of the
filler lost.)"""
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
SPAN = 4          # groups of DIGITS digits in the span task's code
SPAN_INTRO = ("There is an access code hidden inside a lot of irrelevant text. Find it and "
              "memorize it. I will quiz you about the access code.\n")
SPAN_NEEDLE = "\nThe access code is {code}. Remember it. {code} is the access code.\n"
SPAN_QUESTION = "\nWhat is the access code? The access code is"
# tokens answered: the key and one more (SmolLM2 sometimes appends a
# digit); the code's digits and dashes, one token each at most, and a
# leading space
ANSWER_TOKENS = {"passkey": DIGITS + 1, "span": SPAN * (DIGITS + 1) + 1}
TASKS = ("passkey", "span")


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
    return _prompt(tok, filler, length, depth, INTRO, NEEDLE.format(key=key), QUESTION)


def span_prompt(tok, filler, length, depth, code):
    """passkey_prompt's (context ids, question ids) for the span task: the
    code (a string) after `depth` of the filler."""
    _check_prompt(length, depth)
    return _prompt(tok, filler, length, depth, SPAN_INTRO, SPAN_NEEDLE.format(code=code),
                   SPAN_QUESTION)


def task_prompt(task, tok, filler, length, depth, key):
    """The prompt of a trial of `task` (TASKS) for its key (or code)."""
    return (span_prompt if task == "span" else passkey_prompt)(tok, filler, length, depth, key)


def widest_key(task):
    """The key of `task` whose prompt takes the most tokens: what a check of
    the lengths against the filler tries."""
    widest = 10 ** DIGITS - 1
    return "-".join([str(widest)] * SPAN) if task == "span" else widest


def _prompt(tok, filler, length, depth, intro, needle, question):
    """intro, the filler with the needle after `depth` of it, then the
    question: (context ids, question ids), `length` in all."""
    def enc(s):
        return tok(s, add_special_tokens=False)["input_ids"]
    head, needle, question = enc(intro), enc(needle), enc(question)
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


def answer(model, context, question, config, new=DIGITS + 1, held=None, stop=None):
    """The greedy continuation (new token ids) of context + question through
    `config`: the context prefilled into its cache, the question as one
    chunk, then one token at a time, up to `new` tokens or until
    stop(the ids so far) is true; the bytes its cache holds after the
    prefill appended to the list `held` when one is given.  Not
    collective."""
    import torch
    dev = next(model.parameters()).device
    key = cache_kwarg(model)
    ids = torch.tensor([list(context) + list(question)], device=dev)
    n = len(context)
    got = []
    with torch.no_grad(), config.window(model):
        cache = config.cache(model)
        with config.prefill(model):
            # only the cache is wanted: the logits of 4,096 positions over a
            # 49k vocabulary were a sixth of the prefill's time
            out = model(input_ids=ids[:, :n], use_cache=True, logits_to_keep=1, **{key: cache})
        cache = output_cache(out)
        if held is not None:
            held.append(config.nbytes(cache))
        step, at = ids[:, n:], n
        while True:
            pos = torch.arange(at, at + step.shape[1], device=dev)[None]
            out = model(input_ids=step, position_ids=pos, use_cache=True, logits_to_keep=1,
                        **{key: cache})
            cache = output_cache(out)
            at += step.shape[1]
            got.append(int(out.logits[0, -1].argmax()))
            if len(got) == new or (stop is not None and stop(got)):
                return got
            step = torch.tensor([[got[-1]]], device=dev)


def is_key(text, key):
    """Whether the answer's first run of digits is exactly the key."""
    m = re.match(r"\s*(\d+)", text)
    return bool(m) and m.group(1) == str(key)


def is_span(text, code):
    """Whether the answer starts with the code (after spaces)."""
    return text.lstrip().startswith(code)


def passkey(model, tok, filler, lengths, depths, configs, seed=0, progress=None,
            task="passkey"):
    """Every (length, depth) trial of `task` (TASKS), a key (or code)
    drawn for each, answered by the full model and by each configuration.
    Returns {label: [dict(length, depth, key, answer, correct, kept)]},
    "full" first, kept the bytes the cache held after the context over
    the full model's.  Not collective."""
    if task not in TASKS:
        raise UsageError(f"retrieval: unknown task '{task}' (expected {', '.join(TASKS)})")
    rng = np.random.default_rng(seed)
    trials = [(n, d, _draw(rng, task)) for n in lengths for d in depths]
    everyone = [Config()] + list(configs)
    out = {c.label: [] for c in everyone}
    for n, d, key in trials:
        context, question = task_prompt(task, tok, filler, n, d, key)
        grade = is_span if task == "span" else is_key
        held = []
        for c in everyone:
            text = tok.decode(answer(model, context, question, c, ANSWER_TOKENS[task], held))
            out[c.label].append(dict(length=n, depth=d, key=key, answer=text,
                                     correct=grade(text, key), kept=held[-1] / held[0]))
            if progress:
                progress()
    return out


def _draw(rng, task):
    """A trial's key (drawn as before the span task, so that a seed gives
    the passkey reports it gave) or code (SPAN keys joined by dashes)."""
    if task == "passkey":
        return int(rng.integers(10 ** (DIGITS - 1), 10 ** DIGITS))
    return "-".join(str(int(k)) for k in rng.integers(10 ** (DIGITS - 1), 10 ** DIGITS, SPAN))


def accuracy(rows, length=None):
    """The share of right answers, over every trial or those of one length."""
    rows = [r for r in rows if length is None or r["length"] == length]
    return sum(r["correct"] for r in rows) / max(len(rows), 1)
