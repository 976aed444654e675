"""The configurations the frontier scores (frontier.py): a cache a window is
prefilled into and continued with, and what a configuration does around
the window (kqsvd's projections installed) and around the prefill (a
press).  The peers' configurations are in peers.py."""
import contextlib


class Config:
    """One configuration: `label` names it in the report, `family` is its
    line on the plot.  The base is the full model's cache."""
    family = "full"

    def __init__(self, label="full", family=None):
        self.label = label
        if family is not None:
            self.family = family

    def check(self):
        """Raises UsageError, before any model is loaded, when the
        configuration cannot run here."""

    def check_model(self, info):
        """Raises UsageError, before the weights load, when the
        configuration cannot run on the model: info() gives its ModelInfo
        (models.describe, read from its header on the first call, so that
        a configuration that needs no sizes reads nothing)."""

    @contextlib.contextmanager
    def window(self, model):
        """Around one window's prefill and continuation."""
        yield

    @contextlib.contextmanager
    def prefill(self, model):
        """Around the context's prefill."""
        yield

    def cache(self, model):
        """A new, empty cache for one window."""
        from transformers import DynamicCache
        return DynamicCache()

    def nbytes(self, cache):
        """The cache's bytes, values held unquantized counted at 2 (bf16)."""
        from ..attention import cache_bytes  # torch at its top
        return cache_bytes(cache, 2)


class PlainQuant(Config):
    """The model's own keys and values quantized as kqsvd quantizes latents
    (the scheme without rotation): the plain intN cache, or KIVI's, with
    the newest scheme.residual tokens unquantized, where a caller compares
    both (`kivi`: its label says so)."""
    family = "int-N cache"

    def __init__(self, bits, scheme, kivi=False):
        super().__init__(f"int{bits}" + (f" + {scheme.residual} residual (KIVI)" if kivi else ""))
        self.bits, self.scheme = bits, scheme

    def cache(self, model):
        from ..attention.cache import QuantCache  # torch at its top
        return QuantCache(model.config.num_hidden_layers, self.scheme, (self.bits, self.bits))


class Latent(Config):
    """kqsvd's projections (any method, quantized or not) installed for the
    window: the model starts its latent cache itself."""

    def __init__(self, policy, method, proj, tag=""):
        bits = ""
        if proj.tiers is not None:
            bits = " tiers"
        elif proj.quant is not None:
            used = set(proj.bits_k.ravel()) | set(proj.bits_v.ravel())
            if proj.bits_k.ndim == 3:  # per column: 0 marks columns past the rank
                used.discard(0)
            bits = f" int{used.pop()}" if len(used) == 1 else " mixed bits"
        super().__init__(f"{method} {policy}{tag}", f"{method}{bits}{tag}")
        self.policy, self.method, self.proj = policy, method, proj

    @contextlib.contextmanager
    def window(self, model):
        from ..attention import compressed  # torch at its top
        with compressed(model, self.proj):
            yield

    def cache(self, model):
        from ..attention import latent_cache  # torch at its top
        return latent_cache(model)
