"""One configuration's run of bench/decode_speed.py, in a process of its
own (decode_speed.py --one): the model set up for the configuration, the
timed generate() calls, the cache's bytes and the peak memory."""
import contextlib
import dataclasses
import os
import statistics
import threading
import time

from kqsvd.compat import cache_kwarg, output_cache
from kqsvd.errors import KqsvdError, UsageError
from kqsvd.formats.numbers import whole

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def latent_spec(spec):
    """kqsvd:PATH[=[METHOD/]POLICY] -> (absolute file, method, policy), the
    policy as formats.policy reads it (stored by default; @B bits, a
    tiers: layout), the method kqsvd unless given."""
    from kqsvd.formats.policy import parse
    path, _, pol = spec[6:].partition("=")
    head, slash, rest = (pol or "stored").partition("/")
    # a part before '/' that looks like no policy is a method, named if unknown
    method, pol = (head, rest) if slash and not any(c in head for c in ":@") and \
        head != "stored" else ("kqsvd", pol or "stored")
    return (os.path.abspath(path) if path else path, method, parse(pol).text)


def resolved(path, method, pol, layers, scheme, what):
    """(label, Projections) of a policy of the file, as the frontier
    resolves it (quality.measure.resolve_policies)."""
    from kqsvd.quality.measure import resolve_policies
    try:
        [(label, _, proj)] = resolve_policies(path, [pol], [method], layers, scheme)
    except (UsageError, KqsvdError) as e:
        raise type(e)(f"{what}: {e}") from None
    return label, proj


def install(model, info, spec, scheme, context):
    """Sets the model up for `spec`; returns generate()'s extra keyword
    arguments (a fresh cache per call, or none for generate()'s own), the
    context each generate() runs in, and the bytes a cache it leaves holds
    (sizes()); `spec` has passed check()."""
    none, held = contextlib.nullcontext, sizes
    key = cache_kwarg(model)  # cache from transformers 5.24 on: the old name warns there
    if spec == "full":
        model.set_attn_implementation("sdpa")
        return (lambda: {}), none, held
    if spec == "sdpa-off":
        return (lambda: {}), none, held
    model.set_attn_implementation("sdpa")
    if spec.startswith("int") and whole(spec[3:]) is not None:
        from kqsvd.attention import reading_codes
        from kqsvd.attention.cache import QuantCache
        b, plain = whole(spec[3:]), dataclasses.replace(scheme, rotate=False)  # as the frontier's
        return ((lambda: {key: QuantCache(info.num_layers, plain, (b, b))}),
                lambda: reading_codes(model), held)
    if spec.startswith("press:"):
        from kqsvd.quality.peers import PressPeer
        name, _, kept = spec[6:].partition(":")
        peer = PressPeer(name, float(kept), context)
        peer.check()
        return (lambda: {}), (lambda: peer.prefill(model)), held
    if spec.split(":")[0] in ("quanto", "hqq", "composite"):
        from kqsvd.quality.peers import QuantizedCachePeer, composite_of, press_over_quantized
        kind, _, rest = spec.partition(":")
        peer = press_over_quantized(*composite_of(rest), context, scheme.group) \
            if kind == "composite" else QuantizedCachePeer(kind, int(rest), scheme.group)
        peer.check()
        return ((lambda: {key: peer.cache(model)}),
                (lambda: peer.prefill(model)), lambda cache: sizes(cache, peer.nbytes))
    from kqsvd.attention import compress, latent_cache
    path, method, pol = latent_spec(spec)
    compress(model, resolved(path, method, pol, info.num_layers, scheme, spec)[1])
    return (lambda: {key: latent_cache(model)}), none, held


def sizes(cache, counted=None):
    """A cache's bytes, values held as computed counted as bf16: what it
    references, measured (cache_bytes: its capacity, the room of its
    buffers included), and the bytes of the tokens it holds (its use;
    `counted(cache)` for QuantizedCache, as its peer counts them)."""
    from kqsvd.attention import cache_bytes
    return dict(cache_bytes=cache_bytes(cache, 2),
                cache_bytes_held=counted(cache) if counted else cache_bytes(cache, 2, held=True))


def one(spec, context, batch, steps, repeats, threads, scheme, chunk=None):
    """Runs one configuration in this process (its prompt prefilled in
    pieces of `chunk` tokens, when given); returns its figures."""
    import torch
    torch.set_num_threads(threads)
    from transformers import LogitsProcessor, LogitsProcessorList
    from kqsvd import models
    from kqsvd.formats.quant import QuantScheme
    model, tok, info = models.load(MODEL, dtype=torch.float32)
    extra, around, held = install(model, info, spec, QuantScheme(**scheme), context)

    class Clock(LogitsProcessor):
        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (batch, context), generator=g)

    def run(n, new):
        clock = Clock()
        t0 = time.perf_counter()
        with around():
            out = model.generate(input_ids=ids[:, :n], attention_mask=torch.ones_like(ids[:, :n]),
                                 max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                 pad_token_id=tok.eos_token_id, return_dict_in_generate=True,
                                 logits_processor=LogitsProcessorList([clock]),
                                 prefill_chunk_size=chunk if chunk and n > chunk else None,
                                 **extra())
        t = clock.times
        return t[0] - t0, (len(t) - 1) / (t[-1] - t[0]), output_cache(out), out.sequences[:, n:]

    peak = _Peak()
    with torch.no_grad():
        run(min(128, context), 4)  # warm-up: first calls, allocator (presses need a window)
        got = [run(context, steps) for _ in range(repeats)]
    cache, new = got[-1][2], got[-1][3]
    prefill = [p for p, *_ in got]
    decode = [d for _, d, *_ in got]
    return dict(config=spec, context=context, batch=batch, steps=steps, prefill_chunk=chunk,
                attn=model.config._attn_implementation,
                prefill_s=statistics.median(prefill), prefill_range=[min(prefill), max(prefill)],
                decode_tok_s=statistics.median(decode) * batch,
                decode_range=[min(decode) * batch, max(decode) * batch],
                **held(cache), peak_above_model_mb=peak.stop(), new_tokens=new.tolist())


def _rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Peak:
    """The most resident memory above what the loaded model holds, sampled
    every 5 ms (the load's own peak, GGUF dequantization, is left out)."""

    def __init__(self):
        self.base, self.top, self.run = _rss(), 0, True
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self):
        while self.run:
            self.top = max(self.top, _rss() - self.base)
            time.sleep(0.005)

    def stop(self):
        self.run = False
        self.thread.join()
        return max(self.top, _rss() - self.base) / 2**20
