"""The cache and the attention: projections installed in a transformers
model (compressed.py) and written for other runtimes (export.py)."""
from .compressed import (LayerProjection, cache_bytes, compress, compressed, fold_o_proj,
                         probe_errors)

__all__ = ["LayerProjection", "cache_bytes", "compress", "compressed", "fold_o_proj",
           "probe_errors"]
