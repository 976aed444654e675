"""RULER's synthetic tasks (Hsieh et al., "RULER: What's the Real Context
Size of Your Long-Context Language Models?", 2024), those that need no
outside data, generated here from a seed: docs/ruler.md says how, draw by
draw, so that another implementation can make the same samples.

A sample is a context (the instructions and the haystack) and a question
(with the start of its answer, RULER's answer prefix) that comes after
it, of `length` tokens less the tokens its answer may take; its answers
are the strings a right answer contains, all of them (RULER's
string_match_all).  The haystack's size is the largest that fits, found
by bisection (fit()).  Each sample draws from its own generator,
numpy's default_rng([seed, crc32(task), length, index]), so that a
sample does not depend on which others are made."""
import math
import re
import uuid
import zlib

import numpy as np

from ..errors import UsageError

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {kind} for {key} is: {value}."
DEPTHS = np.linspace(0.0, 1.0, 40)  # where a needle may sit in a text haystack

# (haystack, key kind, value kind, keys, values per key, keys asked)
NIAH = {
    "niah_single_1": ("noise", "words", "numbers", 1, 1, 1),
    "niah_single_2": ("text", "words", "numbers", 1, 1, 1),
    "niah_single_3": ("text", "words", "uuids", 1, 1, 1),
    "niah_multikey_1": ("text", "words", "numbers", 4, 1, 1),
    "niah_multikey_2": ("needles", "words", "numbers", 1, 1, 1),
    "niah_multikey_3": ("needles", "uuids", "uuids", 1, 1, 1),
    "niah_multivalue": ("text", "words", "numbers", 1, 4, 1),
    "niah_multiquery": ("text", "words", "numbers", 4, 1, 4),
}
TASKS = tuple(NIAH) + ("vt", "cwe", "fwe")
# the tokens an answer may take, RULER's tokens_to_generate
ANSWER_TOKENS = dict({t: 128 for t in NIAH}, vt=30, cwe=120, fwe=50)


class Words:
    """What the tasks draw from a text: its words (the distinct runs of 4 to
    10 lowercase letters, sorted), for keys and for the common-words
    list, and its held-out half as the haystack of the text tasks (its
    whitespace runs made single spaces, split at spaces)."""

    def __init__(self, text):
        self.vocabulary = sorted(set(re.findall(r"(?<![A-Za-z])[a-z]{4,10}(?![A-Za-z])", text)))
        self.haystack = re.sub(r"\s+", " ", text[len(text) // 2:]).strip().split(" ")
        if len(self.vocabulary) < 200:
            raise UsageError(f"the text has {len(self.vocabulary)} distinct words of 4 to 10 "
                             "lowercase letters; the tasks draw from at least 200")


def rng_of(seed, task, length, index):
    """The generator of one sample (module docstring)."""
    return np.random.default_rng([seed, zlib.crc32(task.encode()), length, index])


def draw(rng, kind, words):
    """A key or value of `kind`: a 7-digit number, two words joined by a
    dash, or a version-4 UUID of 16 drawn bytes."""
    if kind == "numbers":
        return str(int(rng.integers(10 ** 6, 10 ** 7)))
    if kind == "words":
        a, b = rng.choice(len(words.vocabulary), 2, replace=False)
        return f"{words.vocabulary[a]}-{words.vocabulary[b]}"
    return str(uuid.UUID(bytes=bytes(rng.integers(0, 256, 16, dtype=np.uint8).tolist()),
                         version=4))


def _niah(task, rng, n, words):
    """(context, question, answers) of a needle task with a haystack of size n:
    n noise sentences, n words of text, or n distractor needles."""
    hay, kkind, vkind, nk, nv, nq = NIAH[task]
    keys, values, needles = [], [], []
    for _ in range(nk):
        keys.append(draw(rng, kkind, words))
        values.append([draw(rng, vkind, words) for _ in range(nv)])
        needles += [NEEDLE.format(kind=vkind, key=keys[-1], value=v) for v in values[-1]]
    needles = [needles[i] for i in rng.permutation(len(needles))]
    if hay == "text":
        sentences = _sentences(words.haystack[:n])
        at = sorted(int(len(sentences) * d) for d in rng.choice(DEPTHS, len(needles), False))
        parts, last = [], 0
        for pos, needle in zip(at, needles):
            parts += sentences[last:pos] + [needle]
            last = pos
        haystack = " ".join(parts + sentences[last:])
    else:
        if hay == "noise":
            units = [NOISE] * n
        else:
            units = [NEEDLE.format(kind=vkind, key=draw(rng, kkind, words),
                                   value=draw(rng, vkind, words)) for _ in range(n)]
        for pos, needle in zip(sorted(rng.integers(0, n + 1, len(needles)))[::-1], needles):
            units.insert(int(pos), needle)
        haystack = "\n".join(units)
    asked = rng.choice(nk, nq, replace=False)
    query = _listed([keys[i] for i in asked])
    answers = [v for i in asked for v in values[i]]
    if len(answers) == 1:
        one = vkind[:-1]
        intro = (f"A special magic {one} is hidden within the following text. Make sure to "
                 f"memorize it. I will quiz you about the {one} afterwards.\n")
        question = (f"What is the special magic {one} for {query} mentioned in the provided "
                    f"text? The special magic {one} for {query} mentioned in the provided text is")
    else:
        intro = (f"Some special magic {vkind} are hidden within the following text. Make sure "
                 f"to memorize it. I will quiz you about the {vkind} afterwards.\n")
        question = (f"What are all the special magic {vkind} for {query} mentioned in the "
                    f"provided text? The special magic {vkind} for {query} mentioned in the "
                    "provided text are")
    return intro + haystack + "\n", question, answers


def _sentences(words):
    """Words joined into sentences, each ending at a word that ends in '.',
    '!' or '?' (or at the last word)."""
    out, start = [], 0
    for i, w in enumerate(words):
        if w.endswith((".", "!", "?")) or i == len(words) - 1:
            out.append(" ".join(words[start:i + 1]))
            start = i + 1
    return out


def _listed(items):
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + ", and " + items[-1]


def _chain(rng, n, letters, hops=4):
    """(text, question, names) of a variable-tracking task: a chain VAR A =
    v, VAR B = VAR A, ... of hops + 1 distinct names of `letters`
    capitals among n noise sentences."""
    names = []
    while len(names) < hops + 1:
        name = "".join(chr(65 + int(c)) for c in rng.integers(0, 26, letters))
        if name not in names:
            names.append(name)
    value = str(int(rng.integers(10000, 100000)))
    chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]}"
                                             for j in range(hops)]
    units = [NOISE] * n
    for j, pos in enumerate(sorted(rng.integers(0, n + 1, len(chain)))):
        units.insert(int(pos) + j, chain[j])
    text = ("Memorize and track the chain(s) of variable assignment hidden in the following "
            "text.\n\n" + "\n".join(units) + "\n")
    question = (f"Question: Find all variables that are assigned the value {value} in the text "
                "above. Answer: According to the chain(s) of variable assignment in the text "
                f"above, {hops + 1} variables are assigned the value {value}, they are: ")
    return text, question, names


def _vt(rng, n, words):
    """Variable tracking: a worked example (a chain of names of 3 capitals
    among 5 noise sentences, its question and its answer), then a chain
    of names of 5 capitals among n noise sentences; the answers are its
    names."""
    text, question, names = _chain(rng, 5, 3)
    worked = text + question + " ".join(names) + "\n\n"
    text, question, names = _chain(rng, n, 5)
    return worked + text, question, names


CWE_INTRO = ("Below is a numbered list of words. In these words, some appear more often than "
             "others. Memorize the ones that appear most often.\n")
CWE_QUESTION = ("Question: What are the 10 most common words in the above list? Answer: The top "
                "10 words that appear most often in the list are:")


def _word_list(rng, words, distinct, common, rare, top=10):
    """A numbered list of `distinct` words drawn from the vocabulary, the
    first `top` of them `common` times each and the rest `rare` times, in
    a random order; and its common words."""
    pick = [words.vocabulary[i] for i in rng.choice(len(words.vocabulary), distinct, False)]
    listed = pick[:top] * common + pick[top:] * rare
    listed = [listed[i] for i in rng.permutation(len(listed))]
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(listed)), pick[:top]


def _cwe(rng, n, words, length):
    """Common words: 10 words 30 times each among n others 3 times each,
    after one worked example of 40 words (10 times and 3); below 4,096
    tokens, 6 times and once after an example of 20 (3 times and once)."""
    short = length < 4096
    example, shown = _word_list(rng, words, 20 if short else 40, *((3, 1) if short else (10, 3)))
    listed, common = _word_list(rng, words, n + 10, *((6, 1) if short else (30, 3)))
    worked = " ".join(f"{i + 1}. {w}" for i, w in enumerate(shown))
    context = (CWE_INTRO + example + "\n" + CWE_QUESTION + " " + worked + "\n" + CWE_INTRO +
               listed + "\n")
    return context, CWE_QUESTION, common


def _fwe(rng, n, length):
    """Frequent words: n words of a coded vocabulary of length // 50 words of
    6 lowercase letters, the k-th floor(n k^-2 / zeta(2)) times in a
    random order, the first written '...' (noise); the answers are the
    2nd to 4th."""
    size, vocab = max(length // 50, 5), set()
    while len(vocab) < size:
        vocab.add("".join(chr(97 + int(c)) for c in rng.integers(0, 26, 6)))
    vocab = sorted(vocab)
    vocab = [vocab[i] for i in rng.permutation(size)]
    vocab[0] = "..."
    zeta = math.pi ** 2 / 6
    text = [w for k, w in enumerate(vocab, 1) for _ in range(int(n * k ** -2.0 / zeta))]
    text = [text[i] for i in rng.permutation(len(text))]
    context = ("Read the following coded text and track the frequency of each coded word. Find "
               "the three most frequently appeared coded words. " + " ".join(text) + "\n")
    question = ("Question: Do not provide any explanation. Please ignore the dots '....'. What "
                "are the three most frequently appeared words in the above coded text? Answer: "
                "According to the coded text above, the three most frequently appeared words "
                "are:")
    return context, question, vocab[1:4]


def build(task, seed, length, index, n, words):
    """(context, question, answers) of one sample with a haystack of size n."""
    rng = rng_of(seed, task, length, index)
    if task in NIAH:
        return _niah(task, rng, n, words)
    if task == "vt":
        return _vt(rng, n, words)
    if task == "cwe":
        return _cwe(rng, n, words, length)
    if task == "fwe":
        return _fwe(rng, n, length)
    raise UsageError(f"ruler: unknown task '{task}' (expected {', '.join(TASKS)})")


def fit(fits, top):
    """The largest n in [1, top] with fits(n), by bisection from lo = 1 and
    hi = the first of 2, 4, 8, ... (top + 1 at most) that does not fit;
    None when 1 does not fit."""
    if not fits(1):
        return None
    lo, hi = 1, 2
    while hi <= top and fits(hi):
        lo, hi = hi, 2 * hi
    hi = min(hi, top + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def sample(task, tok, words, seed, length, index):
    """One sample as a dict: task, index, length, n (the haystack's size),
    context and question (token ids, the context's first), answers, and
    new (the tokens its answer may take).  UsageError when not even a
    haystack of one fits in `length` tokens."""
    if task not in TASKS:
        raise UsageError(f"ruler: unknown task '{task}' (expected {', '.join(TASKS)})")
    new = ANSWER_TOKENS[task]
    made = {}

    def fits(n):
        c, q, ans = build(task, seed, length, index, n, words)
        ids = (_ids(tok, c), _ids(tok, q))
        made[n] = ids, ans
        return len(ids[0]) + len(ids[1]) + new <= length
    top = {"text": len(words.haystack)}.get(NIAH.get(task, ("",))[0], 1 << 20)
    if task == "cwe":
        top = len(words.vocabulary) - 10
    n = fit(fits, top)
    if n is None:
        raise UsageError(f"ruler: {task} needs more than {length} tokens (its instructions, "
                         f"question and {new} answer tokens)")
    (context, question), answers = made[n]
    return dict(task=task, index=index, length=length, n=n, context=context, question=question,
                answers=answers, new=new)


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def found(answer, answers):
    """How many of the answers the answer contains, case aside (RULER's
    string_match_all counts them)."""
    low = answer.lower()
    return sum(a.lower() in low for a in answers)


def wilson(k, n, z=1.959963984540054):
    """The Wilson score interval (low, high) of k successes in n trials, at
    95% by default; (0, 1) for no trials."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    mid = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (0.0 if k == 0 else mid - half), (1.0 if k == n else mid + half)


def rate(k, n):
    """A rate of k right in n with its Wilson interval, as the report keeps it."""
    low, high = wilson(k, n)
    return dict(k=k, n=n, rate=k / n if n else None, low=low, high=high)


def tally(records, modes, threshold=0.8):
    """The report's summary of its records (dicts with task, length, config,
    mode, found, of and correct; the full model's under mode "agnostic",
    it compresses nothing): for each mode, configuration and length, each
    task's rate of answers with every value found, with its Wilson
    interval, and RULER's score (the mean share of the values found);
    and the average over the tasks the full model answers at `threshold`
    or more at that length (pooled: each task the same number of
    samples).  Also {length: tasks below the threshold} (beyond the
    model)."""
    cells = {}
    for r in records:
        for mode in (modes if r["config"] == "full" else [r["mode"]]):
            cell = cells.setdefault((mode, r["config"], r["length"], r["task"]), [0, 0, 0.0])
            cell[0] += bool(r["correct"])
            cell[1] += 1
            cell[2] += r["found"] / r["of"]
    beyond, solved = {}, {}
    for (mode, config, length, task), (k, n, _) in cells.items():
        if config == "full" and mode == modes[0]:
            (solved if k >= threshold * n else beyond).setdefault(str(length), []).append(task)
    out = {}
    for (mode, config, length, task), (k, n, score) in sorted(cells.items(), key=str):
        at = out.setdefault(mode, {}).setdefault(config, {}).setdefault(
            str(length), dict(tasks={}, average=None))
        at["tasks"][task] = dict(rate(k, n), score=score / n)
    for mode in out.values():
        for lengths in mode.values():
            for length, at in lengths.items():
                counted = [at["tasks"][t] for t in solved.get(length, []) if t in at["tasks"]]
                if counted:
                    at["average"] = rate(sum(c["k"] for c in counted),
                                         sum(c["n"] for c in counted))
    return out, {n: sorted(t) for n, t in beyond.items()}
