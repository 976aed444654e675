"""Model loading and families: a model folder, GGUF file or offline id
becomes a transformers model, its tokenizer and its sizes (load.py), with
the project's GGUF reader for what transformers does not read
(gguf_loader.py, gguf_arch.py); token windows of a text; the checks
every command makes of a model before it runs."""
from .load import (COMPRESSIBLE, DECODERS, DEVICES, ENCODERS, ModelInfo, check_device,
                   check_positions, describe, head_dim, load, resolve, token_windows,
                   tokenizer)

__all__ = ["COMPRESSIBLE", "DECODERS", "DEVICES", "ENCODERS", "ModelInfo", "check_device",
           "check_positions", "describe", "head_dim", "load", "resolve", "token_windows",
           "tokenizer"]
