"""The cache and the attention: projections installed in a transformers
model through its attention interface and cache layers (projection.py,
cache.py, function.py, compressed.py), and written for other runtimes
(export.py)."""
from .cache import LatentCache, LatentLayer, cache_bytes
from .compressed import (attention_modules, compress, compressed, latent_cache,
                         layer_projections, probe_errors, reading_codes)
from .projection import LayerProjection, fold_o_proj

__all__ = ["LatentCache", "LatentLayer", "LayerProjection", "attention_modules", "cache_bytes",
           "compress", "compressed", "fold_o_proj", "latent_cache", "layer_projections",
           "probe_errors", "reading_codes"]
