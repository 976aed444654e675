"""The latent cache: transformers' dynamic cache layer, holding K A and V A_v
instead of K and V.

transformers calls `update(keys, values, cache_kwargs)` with each new
token's full keys (after RoPE, with the cos and sin that rotated them) and
values; the layer keeps their projections and returns everything it holds,
which the model hands on to the attention function (function.py).  The
rest (sequence length, mask sizes, cropping, beam reordering, batch
repetition) is DynamicLayer's, which works for any last dimension."""
import torch
from transformers.cache_utils import Cache, DynamicLayer


class LatentLayer(DynamicLayer):
    """A cache layer of one attention module; `site` is that module's
    installation (compressed.Site): its projections, and where the layer
    leaves what it returned so the attention function knows the tensors it
    receives are latent."""

    def __init__(self, site):
        super().__init__()
        self.site = site

    # 4.56 calls lazy_initialization(keys) and has no is_initialized flag
    # (keys is None until the first update); 4.57 and 5.x pass values too.
    def lazy_initialization(self, key_states, value_states=None):
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = torch.tensor([], dtype=self.dtype, device=self.device)
        self.values = torch.tensor([], dtype=self.dtype, device=self.device)
        self.is_initialized = True

    def update(self, key_states, value_states, cache_kwargs=None):
        if self.keys is None:
            self.lazy_initialization(key_states, value_states)
        kw = cache_kwargs or {}
        kc, vc = self.site.P.project(key_states, value_states, kw.get("cos"), kw.get("sin"))
        self.keys = torch.cat([self.keys, kc], dim=-2)
        self.values = torch.cat([self.values, vc], dim=-2)
        self.site.handoff = (self.keys, self.values)
        return self.keys, self.values



class LatentCache(Cache):
    """A cache of LatentLayers, one per attention module of a model inside
    kqsvd.compressed() (see compressed.latent_cache)."""

    def __init__(self, sites):
        super().__init__(layers=[LatentLayer(s) for s in sites])


def cache_bytes(cache):
    """Bytes held by a transformers cache (any Cache whose layers hold
    keys and values tensors, or legacy tuples of them).  Not collective."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        tensors = [t for kv in cache for t in kv[:2]]
    else:
        tensors = [t for layer in layers for t in (getattr(layer, "keys", None),
                                                   getattr(layer, "values", None))]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
