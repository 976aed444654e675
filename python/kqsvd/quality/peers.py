"""What a user already has, run the way its authors ship it, for the
frontier (frontier.py): transformers' QuantizedCache (quanto and HQQ
backends) and kvpress's eviction presses.  Each peer is a Config; the
packages are imported only when a peer of theirs runs, and a missing one
is named with what installs it.  Their bytes are measured as kqsvd's own
caches' are (Config.nbytes: cache_bytes, the storages a cache references),
never computed from a formula of their scheme."""
import contextlib
import functools
import importlib
import logging

from ..errors import UsageError
from ..formats.numbers import number
from .configs import Config

# kvpress's presses by the names the command takes
PRESSES = {"snapkv": "SnapKVPress", "expected": "ExpectedAttentionPress", "knorm": "KnormPress",
           "streaming": "StreamingLLMPress", "tova": "TOVAPress",
           "observed": "ObservedAttentionPress"}
BACKENDS = {"quanto": "optimum.quanto", "hqq": "hqq"}
# The peers pin transformers below kqsvd's newest (kvpress 0.5.5: < 5.3), so
# they live in an environment of their own rather than capping kqsvd's range.
# Said by every command and bench that runs a peer, so it names none of them.
SET_UP = ("the peers' environment has it: scripts/hf-env.sh prepares .venv-peers "
          "(examples/requirements-peers.txt); run the command with .venv-peers/bin/python")
# import name -> distribution name, for the version it declares it needs
DISTRIBUTIONS = {"kvpress": "kvpress", "optimum": "optimum-quanto", "hqq": "hqq"}


def need(module, what):
    """The peer's module, imported; UsageError in one line when it is not
    installed, or when the transformers installed is outside the range the
    peer declares (it would fail inside transformers, or worse, run)."""
    top = module.split(".")[0]
    clash = _transformers_clash(DISTRIBUTIONS.get(top, top))
    if clash:
        raise UsageError(f"{what} needs {clash}; {SET_UP}")
    # quanto imports torch's C++ extension builder, which warns on a machine
    # without CUDA: noise before the command's own one-line messages
    quiet = logging.getLogger("torch.utils.cpp_extension")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise UsageError(f"{what} needs the Python package '{top}', which cannot be imported "
                         f"({e}); {SET_UP}") from None
    finally:
        quiet.setLevel(level)


@functools.lru_cache(maxsize=None)  # need() runs at every window's prefill
def _transformers_clash(dist):
    """'kvpress 0.5.5 with transformers<5.3 (5.24.0 is installed)' when the
    installed distribution `dist` declares a transformers range that the
    installed transformers is outside, else None (also when either is not
    installed: the import then says so)."""
    from importlib import metadata
    try:
        requires = metadata.requires(dist) or []
        have = metadata.version("transformers")
        mine = metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None
    from packaging.requirements import InvalidRequirement, Requirement
    for line in requires:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if req.name.lower() == "transformers" and req.marker is None and \
                not req.specifier.contains(have, prereleases=True):
            return f"{dist} {mine} with transformers{req.specifier} ({have} is installed)"
    return None


class QuantizedCachePeer(Config):
    """transformers.QuantizedCache(backend, nbits, q_group_size, residual
    0).  Its bytes: b / 8 per value and a scale and a zero of 2 bytes per
    group, as a bf16 model would hold them; values it holds unquantized
    at 2 bytes."""
    family = "transformers QuantizedCache"

    def __init__(self, backend, bits, group):
        super().__init__(f"{backend}-int{bits}", f"QuantizedCache ({backend})")
        self.backend, self.bits, self.group = backend, bits, group

    @property
    def fraction(self):
        """Its bytes per value over bf16's (2), groups taken as whole."""
        return (self.bits / 8 + 4 / self.group) / 2

    def check(self):
        need(BACKENDS[self.backend], f"the peer {self.label}")

    def check_model(self, info):
        # quanto and HQQ group a layer's keys (and values) across its KV
        # heads, tokens and channels, and need the group to divide them at
        # every step: with one token a step, to divide a token's values
        sizes = info()
        width = sizes.num_kv_heads * sizes.head_dim
        if width % self.group:
            raise UsageError(f"--group {self.group}: the peer {self.label} (transformers' "
                             f"QuantizedCache) quantizes in groups of {self.group} values, which "
                             f"must divide a token's {sizes.num_kv_heads} KV heads x "
                             f"{sizes.head_dim} = {width}")

    def cache(self, model):
        from transformers import QuantizedCache
        return QuantizedCache(backend=self.backend, config=model.config, nbits=self.bits,
                              q_group_size=self.group, residual_length=0)


def press_of(text):
    """(name, kept) of a press as the benches name one, NAME:KEPT: NAME
    among PRESSES, KEPT the fraction of the context it keeps, in (0, 1).
    UsageError naming `text` otherwise."""
    name, colon, kept = text.partition(":")
    f = number(kept)
    if name not in PRESSES or not colon or f is None or not 0 < f < 1:  # NaN fails too
        raise UsageError(f"'{text}' is not NAME:KEPT, NAME among {', '.join(PRESSES)} and KEPT "
                         "the fraction of the context kept, in (0, 1)")
    return name, f


class PressPeer(Config):
    """A kvpress press compressing the context's cache at prefill (the
    continuation's tokens are added as they come, as kvpress does): kept
    is the fraction of the context's tokens it keeps."""
    family = "kvpress"

    def __init__(self, name, kept, context):
        super().__init__(f"{name}:{kept:g}", f"kvpress {name}")
        self.name, self.kept, self.context = name, kept, context

    def tokens_kept(self, context=None):
        """The tokens of a context (self.context by default) that the
        fraction keeps, as kvpress counts them (compute_n_kept) before it
        keeps one of them at the least."""
        n = self.context if context is None else context
        return int(n * (1 - (1.0 - self.kept)))

    def check(self):
        if self.name not in PRESSES:
            raise UsageError(f"press {self.name}: unknown (expected {', '.join(PRESSES)})")
        if self.tokens_kept() < 1:  # kvpress would keep one: more than the label says
            raise UsageError(f"--context {self.context}: the press {self.label} keeps less than "
                             "one of its tokens; give a larger fraction")
        kvpress = need("kvpress", f"the peer {self.label}")
        # SnapKV scores the context by its last window_size queries (64 by default)
        window = getattr(getattr(kvpress, PRESSES[self.name])(), "window_size", 0)
        if self.context <= window:
            raise UsageError(f"--context {self.context}: the press {self.name} needs more than "
                             f"its window of {window} tokens")

    @contextlib.contextmanager
    def prefill(self, model):
        kvpress = need("kvpress", f"the peer {self.label}")
        press = getattr(kvpress, PRESSES[self.name])(compression_ratio=1.0 - self.kept)
        attns = [layer.self_attn for layer in model.model.layers]
        had = [hasattr(a, "rotary_emb") for a in attns]
        try:
            with press(model):
                yield
        finally:  # kvpress leaves the rotary embedding on each attention module
            for a, h in zip(attns, had):
                if not h and hasattr(a, "rotary_emb"):
                    delattr(a, "rotary_emb")


def composite_of(text):
    """(press, backend, bits, bytes) of PRESS:BACKEND:BITS:BYTES, as the
    benches name a press over QuantizedCache: PRESS among PRESSES, BACKEND
    among BACKENDS, BITS 2 or 4, BYTES the fraction of the bf16 cache's
    bytes it holds, in (0, 1).  UsageError naming `text` otherwise."""
    press, _, rest = text.partition(":")
    backend, _, rest = rest.partition(":")
    bits, _, budget = rest.partition(":")
    try:
        name, f = press_of(f"{press}:{budget}")
    except UsageError:
        name = None
    if name is None or backend not in BACKENDS or bits not in ("2", "4"):
        raise UsageError(
            f"'{text}' is not PRESS:BACKEND:BITS:BYTES, PRESS among {', '.join(PRESSES)}, "
            f"BACKEND among {', '.join(BACKENDS)}, BITS 2 or 4 and BYTES a fraction in (0, 1)")
    return name, backend, int(bits), f


def press_over_quantized(name, backend, bits, budget, context, group):
    """The PressOverQuantized of composite_of's fields, not yet checked;
    UsageError when the cache holds `budget` with every token (a press
    keeping more than all of them)."""
    q = QuantizedCachePeer(backend, bits, group)
    if budget >= q.fraction:
        raise UsageError(f"{q.label} holds {q.fraction:.4g} of the bytes with every token; "
                         "give a smaller fraction")
    return PressOverQuantized(name, q, budget, context)


class PressOverQuantized(Config):
    """A kvpress press over transformers' QuantizedCache, as kvpress ships
    it: at prefill the press dequantizes each layer's context, keeps the
    tokens it scores highest and quantizes them again (its forward hook
    handles a QuantizedCache).  Tokens and bits both spent: `budget` is the
    fraction of the bf16 cache's bytes it holds after the prefill, so the
    press keeps budget / quant.fraction of the context."""
    family = "kvpress over QuantizedCache"

    def __init__(self, name, quant, budget, context):
        self.quant, self.budget = quant, budget
        self.press = PressPeer(name, budget / quant.fraction, context)
        super().__init__(f"{self.press.label} over {quant.label}")

    def check_model(self, info):
        self.quant.check_model(info)

    def check(self):
        if self.press.tokens_kept() < 1:  # kvpress would keep one: more bytes than the label's
            raise UsageError(f"--context {self.press.context}: {self.label} holds {self.budget:g} "
                             "of the bytes, less than one of its tokens; give a larger budget")
        self.quant.check()
        self.press.check()

    def cache(self, model):
        return self.quant.cache(model)

    def prefill(self, model):
        return self.press.prefill(model)

    def nbytes(self, cache):
        return self.quant.nbytes(cache)
