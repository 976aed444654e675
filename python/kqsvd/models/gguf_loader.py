"""Load a GGUF file as a Hugging Face transformers model and tokenizer.

GGUF is llama.cpp's single-file format: key/value metadata (architecture
hyper-parameters, tokenizer vocabulary) followed by possibly quantized tensors.
This module turns such a file into

* a transformers causal LM (eager attention, eval mode) whose weights are the
  file's weights dequantized with ``gguf.quants.dequantize``, chosen by
  ``general.architecture``:

  - ``llama`` (Llama 1-3, Mistral, SmolLM, ...) -> ``LlamaForCausalLM``, or
    ``MixtralForCausalLM`` when ``llama.expert_count`` > 0 (Mixtral);
  - ``gemma`` (Gemma 1) -> ``GemmaForCausalLM``;
  - ``phi3`` (Phi-3 / Phi-3.5 mini, LongRoPE included) -> ``Phi3ForCausalLM``;
  - ``starcoder2`` -> ``Starcoder2ForCausalLM``;

  (the per-architecture tables live in :mod:`kqsvd.models.gguf_arch`), and
* a ``transformers.PreTrainedTokenizerFast`` built with the ``tokenizers``
  library from the file's own ``tokenizer.ggml.*`` fields,

so that the rest of kqsvd can use a quantized checkpoint exactly like a
Hugging Face one.  Anything the loader cannot reproduce faithfully (another
architecture such as gemma2 with its logit soft-capping, a tensor type gguf
cannot dequantize, an unknown RoPE scaling, ...) is refused with a
:class:`GGUFError` rather than loaded approximately.

Public API::

    class GGUFError(KqsvdError)
    def is_gguf(path) -> bool
    def load_gguf(path, dtype=torch.float32, device="cpu") -> (model, tokenizer)
"""
from __future__ import annotations

import numpy as np
import torch

from .gguf_arch import GGUFError, build_model, load_tensors, select
from .gguf_arch import get_field as _get

__all__ = ["GGUFError", "is_gguf", "load_gguf", "read_config", "read_tokenizer"]


# Llama-3 pre-tokenizer split (llama.cpp "llama-bpe"): contractions, letter runs
# with one leading non-letter, 1-3 digit groups, punctuation runs, newlines, spaces.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4


def is_gguf(path) -> bool:
    """Return True when ``path`` is a readable file starting with the magic b"GGUF".

    Never raises for a missing or unreadable path (returns False).
    """
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


# ----------------------------------------------------------------------------- metadata

def _open_reader(path):
    """gguf.GGUFReader on ``path`` (GGUFError if the header cannot be parsed).

    GGUFReader slices its np.memmap once per metadata string (~100k for a
    49k-token vocabulary) and memmap's per-slice bookkeeping triples the parse
    time; a plain ndarray view of the same mapping reads identically, faster.
    """
    from gguf import GGUFReader

    class _Reader(GGUFReader):
        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, value):
            self._plain = value.view(np.ndarray)  # keeps the mapping alive via .base

    try:
        return _Reader(path)
    except Exception as e:  # truncated file, unknown version, bad alignment, ...
        raise GGUFError(path, f"cannot parse GGUF header: {e}") from e


# ----------------------------------------------------------------------------- tokenizer

def _bpe_pre_tokenizer(path, pre):
    """tokenizers pre-tokenizer matching llama.cpp's ``tokenizer.ggml.pre`` value."""
    from tokenizers import Regex, pre_tokenizers as pt
    if pre in ("gpt-2", "default", None):
        return pt.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact"):  # llama.cpp: every digit alone, then GPT-2 regex
        return pt.Sequence([pt.Digits(individual_digits=True),
                            pt.ByteLevel(add_prefix_space=False, use_regex=True)])
    if pre == "llama-bpe":
        return pt.Sequence([pt.Split(Regex(_LLAMA3_SPLIT), behavior="isolated", invert=False),
                            pt.ByteLevel(add_prefix_space=False, use_regex=False)])
    raise GGUFError(path, f"tokenizer pre-tokenizer 'tokenizer.ggml.pre'='{pre}' is not supported "
                          f"(supported: smollm, starcoder, refact, gpt-2, default, llama-bpe)")


def _spm_merges(tokens, scores):
    """BPE merges for a SentencePiece vocab: every split of a piece into two
    pieces, ranked by the merged piece's score (SentencePiece merges the pair
    whose result scores highest)."""
    ids = {t: i for i, t in enumerate(tokens)}
    found = []
    for i, tok in enumerate(tokens):
        for k in range(1, len(tok)):
            left, right = tok[:k], tok[k:]
            if left in ids and right in ids:
                found.append((-scores[i], ids[left], ids[right], left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def _build_tokenizer(reader, path, max_len):
    """PreTrainedTokenizerFast from the tokenizer.ggml.* fields (GGUFError if unsupported)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors
    from transformers import PreTrainedTokenizerFast
    kind = _get(reader, path, "tokenizer.ggml.model")
    tokens = _get(reader, path, "tokenizer.ggml.tokens")
    types = _get(reader, path, "tokenizer.ggml.token_type", [1] * len(tokens))
    vocab = {t: i for i, t in enumerate(tokens)}
    try:
        if kind == "gpt2":  # byte-level BPE (GPT-2, SmolLM, Llama-3, ...)
            pre = _get(reader, path, "tokenizer.ggml.pre", None)
            pre_tok = _bpe_pre_tokenizer(path, pre)
            merges = [tuple(m.split(" ")) for m in _get(reader, path, "tokenizer.ggml.merges")]
            if any(len(m) != 2 for m in merges):
                raise GGUFError(path, "'tokenizer.ggml.merges' holds an entry that is not 'a b'")
            # Llama-3 (like llama.cpp) looks whole words up in the vocab before merging.
            tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False,
                                       ignore_merges=(pre == "llama-bpe")))
            tok.pre_tokenizer = pre_tok
            tok.decoder = decoders.ByteLevel()
            add_bos_default = False
        elif kind == "llama":  # SentencePiece BPE with byte fallback (Llama-2, Mistral, ...)
            scores = _get(reader, path, "tokenizer.ggml.scores")
            unk = _get(reader, path, "tokenizer.ggml.unknown_token_id", 0)
            tok = Tokenizer(models.BPE(vocab, _spm_merges(tokens, scores), unk_token=tokens[unk],
                                       fuse_unk=True, byte_fallback=True))
            prefix = bool(_get(reader, path, "tokenizer.ggml.add_space_prefix", True))
            norm = [normalizers.Prepend("\u2581")] if prefix else []
            tok.normalizer = normalizers.Sequence(norm + [normalizers.Replace(" ", "\u2581")])
            dec = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
            tok.decoder = decoders.Sequence(dec + ([decoders.Strip(" ", 1, 0)] if prefix else []))
            add_bos_default = True
        else:
            raise GGUFError(path, f"tokenizer model 'tokenizer.ggml.model'='{kind}' is not supported "
                                  f"(supported: gpt2, llama)")
    except GGUFError:
        raise
    except Exception as e:  # tokenizers rejects e.g. merges naming unknown tokens
        raise GGUFError(path, f"cannot build the '{kind}' tokenizer from tokenizer.ggml.*: {e}") from e
    # Control tokens (<|im_start|>, <s>, ...) are matched verbatim and never split;
    # user-defined ones likewise, but are not "special" (kept by skip_special_tokens).
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, t in enumerate(types) if t == _TOKEN_CONTROL])
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                    for i, t in enumerate(types) if t == _TOKEN_USER_DEFINED])

    def special(key):
        i = _get(reader, path, f"tokenizer.ggml.{key}_token_id", None)
        if i is not None and not 0 <= int(i) < len(tokens):
            raise GGUFError(path, f"'tokenizer.ggml.{key}_token_id'={i} is outside the vocabulary")
        return None if i is None else tokens[int(i)]

    bos, eos = special("bos"), special("eos")
    # BOS/EOS are added only for add_special_tokens=True, as llama.cpp's add_bos/add_eos say.
    add_bos = bool(_get(reader, path, "tokenizer.ggml.add_bos_token", add_bos_default)) and bos
    add_eos = bool(_get(reader, path, "tokenizer.ggml.add_eos_token", False)) and eos
    if add_bos or add_eos:
        b, e = (f"{bos} " if add_bos else ""), (f" {eos}" if add_eos else "")
        used = [t for t, on in ((bos, add_bos), (eos, add_eos)) if on]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{b}$A{e}", pair=f"{b}$A{e} {b}$B{e}",
            special_tokens=[(t, vocab[t]) for t in dict.fromkeys(used)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=bos, eos_token=eos, unk_token=special("unknown"),
        pad_token=special("padding"), model_max_length=max_len,
        clean_up_tokenization_spaces=False)  # keep decode(encode(text)) == text
    template = _get(reader, path, "tokenizer.chat_template", None)
    if template:
        fast.chat_template = template
    return fast


# ----------------------------------------------------------------------------- model

def read_config(path):
    """What the file says of the model's shape, without its tensors: a
    namespace with a transformers config's size fields (model_type,
    num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim,
    hidden_size, max_position_embeddings, sliding_window), for the checks
    a command makes before it loads the weights.  Raises GGUFError as
    load_gguf does for the header."""
    import types
    import transformers
    reader = _open_reader(path)
    spec, meta = select(reader, path)
    hp = spec.hparams(meta)
    return types.SimpleNamespace(
        model_type=getattr(transformers, spec.config_class).model_type,
        num_hidden_layers=hp["num_hidden_layers"], num_attention_heads=hp["num_attention_heads"],
        num_key_value_heads=hp["num_key_value_heads"], head_dim=hp["head_dim"],
        hidden_size=hp["hidden_size"], max_position_embeddings=hp["max_position_embeddings"],
        sliding_window=hp.get("sliding_window"))


def read_tokenizer(path):
    """The tokenizer load_gguf gives with the model, from the file's
    tokenizer fields alone (no tensor is read).  Raises GGUFError."""
    reader = _open_reader(path)
    spec, meta = select(reader, path)
    return _build_tokenizer(reader, path, spec.hparams(meta)["max_position_embeddings"])


def load_gguf(path, dtype=torch.float32, device="cpu"):
    """Load a GGUF file of a supported architecture (see the module docstring).

    Args:
        path: path of the .gguf file.
        dtype: torch dtype of the returned weights (dequantized in float32 first).
        device: torch device for the model.

    Returns:
        (model, tokenizer): a transformers ``*ForCausalLM`` (``LlamaForCausalLM``,
        ``MixtralForCausalLM``, ``GemmaForCausalLM``, ``Phi3ForCausalLM`` or
        ``Starcoder2ForCausalLM``) in eval mode with ``attn_implementation="eager"``
        and lm_head tied to the embedding when the file has no ``output.weight``;
        a ``PreTrainedTokenizerFast`` built from the file's tokenizer fields.

    Raises:
        GGUFError: not a GGUF file, unsupported architecture, rope scaling, tensor
            type or tokenizer, missing/unknown tensor, or shapes inconsistent with
            the metadata.  The message names the file and the offending item.
        OSError: the file cannot be opened.
    """
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise GGUFError(path, f"not a GGUF file (magic bytes {magic!r}, expected b'GGUF')")
    reader = _open_reader(path)
    if reader.byte_order != "I":
        raise GGUFError(path, "byte order differs from this machine's, which is not supported")

    spec, meta = select(reader, path)
    hp = spec.hparams(meta)
    n_tokens = len(reader.fields["tokenizer.ggml.tokens"].data) \
        if "tokenizer.ggml.tokens" in reader.fields else None
    vocab = meta.int("vocab_size", n_tokens)
    if vocab is None:  # neither field: trust the embedding's row count
        emb = [t for t in reader.tensors if t.name == "token_embd.weight"]
        if not emb:
            raise GGUFError(path, "tensor 'token_embd.weight' is missing")
        vocab = int(emb[0].shape[-1])
    if n_tokens is not None and n_tokens != vocab:
        raise GGUFError(path, f"'tokenizer.ggml.tokens' has {n_tokens} entries but "
                              f"'{meta.arch}.vocab_size' is {vocab}")
    weights, extras = load_tensors(reader, meta, spec, hp, vocab)
    tokenizer = _build_tokenizer(reader, path, hp["max_position_embeddings"])
    model = build_model(spec, meta, hp, vocab, weights, extras, tokenizer, dtype)
    return model.to(device).eval(), tokenizer
