"""Load a llama-architecture GGUF file as a Hugging Face model and tokenizer.

GGUF is llama.cpp's single-file format: key/value metadata (architecture
hyper-parameters, tokenizer vocabulary) followed by possibly quantized tensors.
This module turns such a file into

* a ``transformers.LlamaForCausalLM`` (eager attention, eval mode) whose weights
  are the file's weights dequantized with ``gguf.quants.dequantize``, and
* a ``transformers.PreTrainedTokenizerFast`` built with the ``tokenizers``
  library from the file's own ``tokenizer.ggml.*`` fields,

so that the rest of kqsvd can use a quantized checkpoint exactly like a
Hugging Face one.  Anything the loader cannot reproduce faithfully (another
architecture, a tensor type gguf cannot dequantize, an unknown RoPE scaling,
...) is refused with a :class:`GGUFError` rather than loaded approximately.

Public API::

    class GGUFError(KqsvdError)
    def is_gguf(path) -> bool
    def load_gguf(path, dtype=torch.float32, device="cpu") -> (model, tokenizer)
"""
from __future__ import annotations

import os
import re

import numpy as np
import torch

from .errors import KqsvdError

__all__ = ["GGUFError", "is_gguf", "load_gguf"]

SUPPORTED_ARCHITECTURES = ("llama",)

# Per-layer GGUF tensor name -> Hugging Face Llama module path.
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.weight$")

# Llama-3 pre-tokenizer split (llama.cpp "llama-bpe"): contractions, letter runs
# with one leading non-letter, 1-3 digit groups, punctuation runs, newlines, spaces.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4


class GGUFError(KqsvdError):
    """A GGUF file that this loader cannot load faithfully.

    The message always starts with the file path and names the offending
    metadata field, tensor, tensor type or architecture.
    """

    def __init__(self, path, what):
        super().__init__(f"{os.fspath(path)}: {what}")
        self.path = os.fspath(path)


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


_MISSING = object()


def _get(reader, path, key, default=_MISSING):
    """Value of metadata field ``key`` (str, number, bool or list); ``default`` if absent.

    Raises GGUFError naming ``key`` when it is absent and no default is given.
    """
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise GGUFError(path, f"required metadata field '{key}' is missing")
        return default
    return field.contents()


def _scalar_int(reader, path, key, default=_MISSING):
    """Integer field; per-layer arrays (used by other architectures) are refused."""
    v = _get(reader, path, key, default)
    if isinstance(v, list):
        raise GGUFError(path, f"metadata field '{key}' is a per-layer array, which is not supported")
    return v if v is None else int(v)


def _read_hparams(reader, path):
    """Hyper-parameters from the llama.* fields, checked for what HF Llama can express.

    Returns a dict of LlamaConfig keyword arguments plus "head_dim".
    """
    arch = _get(reader, path, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(path, f"architecture '{arch}' is not supported "
                              f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    # Mixtral GGUFs say "llama" but carry experts: refuse them explicitly.
    n_expert = _scalar_int(reader, path, f"{arch}.expert_count", 0)
    if n_expert:
        raise GGUFError(path, f"'{arch}.expert_count'={n_expert} (mixture of experts) is not supported")
    hidden = _scalar_int(reader, path, f"{arch}.embedding_length")
    n_head = _scalar_int(reader, path, f"{arch}.attention.head_count")
    n_kv = _scalar_int(reader, path, f"{arch}.attention.head_count_kv", n_head)
    if n_head <= 0 or hidden % n_head or n_kv <= 0 or n_head % n_kv:
        raise GGUFError(path, f"inconsistent head counts: embedding_length={hidden}, "
                              f"head_count={n_head}, head_count_kv={n_kv}")
    head_dim = hidden // n_head
    # transformers 4.44's Llama derives head_dim = hidden / heads and rotates all of it.
    for key in ("attention.key_length", "attention.value_length", "rope.dimension_count"):
        v = _scalar_int(reader, path, f"{arch}.{key}", head_dim)
        if v != head_dim:
            raise GGUFError(path, f"'{arch}.{key}'={v} differs from embedding_length/head_count="
                                  f"{head_dim}, which is not supported")
    hp = dict(
        hidden_size=hidden,
        num_attention_heads=n_head,
        num_key_value_heads=n_kv,
        num_hidden_layers=_scalar_int(reader, path, f"{arch}.block_count"),
        intermediate_size=_scalar_int(reader, path, f"{arch}.feed_forward_length"),
        max_position_embeddings=_scalar_int(reader, path, f"{arch}.context_length", 4096),
        rms_norm_eps=float(_get(reader, path, f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(_get(reader, path, f"{arch}.rope.freq_base", 10000.0)),
        head_dim=head_dim,
        rope_scaling=None,
    )
    # RoPE scaling: only "none" and "linear" have an exact HF equivalent here.
    kind = _get(reader, path, f"{arch}.rope.scaling.type", None)
    factor = float(_get(reader, path, f"{arch}.rope.scaling.factor",
                        _get(reader, path, f"{arch}.rope.scale_linear", 1.0)))
    if kind is None:
        kind = "linear" if factor != 1.0 else "none"
    if kind == "linear" and factor != 1.0:
        hp["rope_scaling"] = {"rope_type": "linear", "factor": factor}
    elif kind not in ("none", "linear"):
        raise GGUFError(path, f"rope scaling type '{kind}' ('{arch}.rope.scaling.type') is not "
                              f"supported (supported: none, linear)")
    return hp


# ----------------------------------------------------------------------------- tensors

def _expected_shapes(hp, vocab):
    """HF (out, in) shape of every tensor the file may hold, keyed by GGUF name."""
    h, d, f = hp["hidden_size"], hp["head_dim"], hp["intermediate_size"]
    q, kv = hp["num_attention_heads"] * d, hp["num_key_value_heads"] * d
    per_layer = {"attn_norm": (h,), "ffn_norm": (h,), "attn_q": (q, h), "attn_k": (kv, h),
                 "attn_v": (kv, h), "attn_output": (h, q), "ffn_gate": (f, h),
                 "ffn_up": (f, h), "ffn_down": (h, f)}
    shapes = {"token_embd.weight": (vocab, h), "output_norm.weight": (h,),
              "output.weight": (vocab, h), "rope_freqs.weight": (d // 2,)}
    for i in range(hp["num_hidden_layers"]):
        shapes.update({f"blk.{i}.{k}.weight": s for k, s in per_layer.items()})
    return shapes


def _hf_name(name):
    """HF parameter name for a GGUF tensor name (None for rope_freqs)."""
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    m = _LAYER_RE.match(name)
    return f"model.layers.{m.group(1)}.{_LAYER_TENSORS[m.group(2)]}.weight" if m else None


def _dequantize(tensor, shape):
    """float32 ndarray of ``shape`` from a ReaderTensor whose type was probed."""
    from gguf.quants import dequantize
    arr = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)
    # F32 tensors come back as views of the read-only memory map: copy them.
    return arr if arr.flags.writeable and arr.flags.c_contiguous else np.array(arr)


def _unpermute(w, n_head):
    """Undo llama.cpp's q/k row permutation.

    convert_hf_to_gguf reorders each head's rows from HF's "rotate half" layout
    (first half, second half) to interleaved pairs (GPT-J style RoPE), i.e.
    gguf[h, j, s] = hf[h, s, j] with rows viewed as (head, head_dim/2, 2).
    """
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


def _load_tensors(reader, path, hp, vocab):
    """Check names/shapes/types of all tensors, then dequantize them.

    Returns (dict HF name -> float32 ndarray, rope_freqs ndarray or None).
    """
    from gguf.quants import dequantize
    expected = _expected_shapes(hp, vocab)
    by_name = {t.name: t for t in reader.tensors}
    for name in by_name:
        if name not in expected:
            raise GGUFError(path, f"unknown tensor '{name}' (not part of a {hp['num_hidden_layers']}"
                                  f"-layer llama model)")
    optional = {"output.weight", "rope_freqs.weight"}
    for name in expected:
        if name not in by_name and name not in optional:
            raise GGUFError(path, f"tensor '{name}' is missing")
    probed = set()
    for name, t in by_name.items():
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))  # GGUF lists ne0 (columns) first
        if shape != expected[name]:
            raise GGUFError(path, f"tensor '{name}' has shape {shape}, expected {expected[name]} "
                                  f"from the metadata")
        # Probe each type on one row first so an unsupported type fails before any work.
        if t.tensor_type not in probed:
            try:
                dequantize(t.data.reshape(-1, t.data.shape[-1])[:1], t.tensor_type)
            except NotImplementedError:
                raise GGUFError(path, f"tensor '{name}' has type {t.tensor_type.name}, which "
                                      f"gguf.quants cannot dequantize") from None
            probed.add(t.tensor_type)
    weights, rope_freqs = {}, None
    for name, t in by_name.items():
        arr = _dequantize(t, expected[name])
        if name == "rope_freqs.weight":
            rope_freqs = arr
            continue
        if ".attn_q." in name:
            arr = _unpermute(arr, hp["num_attention_heads"])
        elif ".attn_k." in name:
            arr = _unpermute(arr, hp["num_key_value_heads"])
        weights[_hf_name(name)] = arr
    return weights, rope_freqs


# ----------------------------------------------------------------------------- tokenizer

def _bpe_pre_tokenizer(path, pre):
    """tokenizers pre-tokenizer matching llama.cpp's ``tokenizer.ggml.pre`` value."""
    from tokenizers import Regex, pre_tokenizers as pt
    if pre in ("gpt-2", "default", None):
        return pt.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":  # StarCoder-style: every digit alone, then GPT-2 regex
        return pt.Sequence([pt.Digits(individual_digits=True),
                            pt.ByteLevel(add_prefix_space=False, use_regex=True)])
    if pre == "llama-bpe":
        return pt.Sequence([pt.Split(Regex(_LLAMA3_SPLIT), behavior="isolated", invert=False),
                            pt.ByteLevel(add_prefix_space=False, use_regex=False)])
    raise GGUFError(path, f"tokenizer pre-tokenizer 'tokenizer.ggml.pre'='{pre}' is not supported "
                          f"(supported: smollm, gpt-2, default, llama-bpe)")


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

def load_gguf(path, dtype=torch.float32, device="cpu"):
    """Load a llama-architecture GGUF file.

    Args:
        path: path of the .gguf file.
        dtype: torch dtype of the returned weights (dequantized in float32 first).
        device: torch device for the model.

    Returns:
        (model, tokenizer): a ``transformers.LlamaForCausalLM`` in eval mode with
        ``attn_implementation="eager"`` and lm_head tied to the embedding when the
        file has no ``output.weight``; a ``PreTrainedTokenizerFast`` built from the
        file's tokenizer fields.

    Raises:
        GGUFError: not a GGUF file, unsupported architecture, rope scaling, tensor
            type or tokenizer, missing/unknown tensor, or shapes inconsistent with
            the metadata.  The message names the file and the offending item.
        OSError: the file cannot be opened.
    """
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_utils import no_init_weights
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise GGUFError(path, f"not a GGUF file (magic bytes {magic!r}, expected b'GGUF')")
    reader = _open_reader(path)
    if reader.byte_order != "I":
        raise GGUFError(path, "byte order differs from this machine's, which is not supported")

    hp = _read_hparams(reader, path)
    n_tokens = len(reader.fields["tokenizer.ggml.tokens"].data) \
        if "tokenizer.ggml.tokens" in reader.fields else None
    vocab = _scalar_int(reader, path, "llama.vocab_size", n_tokens)
    if vocab is None:  # neither field: trust the embedding's row count
        emb = [t for t in reader.tensors if t.name == "token_embd.weight"]
        if not emb:
            raise GGUFError(path, "tensor 'token_embd.weight' is missing")
        vocab = int(emb[0].shape[-1])
    if n_tokens is not None and n_tokens != vocab:
        raise GGUFError(path, f"'tokenizer.ggml.tokens' has {n_tokens} entries but "
                              f"'llama.vocab_size' is {vocab}")
    weights, rope_freqs = _load_tensors(reader, path, hp, vocab)
    tokenizer = _build_tokenizer(reader, path, hp["max_position_embeddings"])

    tied = "lm_head.weight" not in weights
    hp.pop("head_dim")  # transformers 4.44 derives it (checked equal in _read_hparams)
    config = LlamaConfig(
        vocab_size=vocab, tie_word_embeddings=tied, hidden_act="silu", attention_bias=False,
        mlp_bias=False, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, torch_dtype=dtype, attn_implementation="eager", **hp)
    # Skip random initialisation: every parameter is overwritten below.
    with no_init_weights():
        model = LlamaForCausalLM(config)
    for name, arr in weights.items():
        module, attr = name.rsplit(".", 1)
        # Replace the storage (not copy_) so peak memory is the model plus one tensor.
        getattr(model.get_submodule(module), attr).data = torch.from_numpy(arr).to(dtype)
    if tied:
        model.tie_weights()
    if rope_freqs is not None:
        # Llama-3.1-style RoPE: llama.cpp divides each rotation frequency by its
        # factor, which is what HF's "llama3" rope_type computes from its parameters.
        factors = torch.from_numpy(rope_freqs.astype(np.float64))
        if not torch.all(factors > 0):
            raise GGUFError(path, "tensor 'rope_freqs.weight' holds non-positive factors")
        for m in model.modules():
            if isinstance(m, LlamaRotaryEmbedding):
                m.inv_freq = (m.inv_freq.double() / factors).float()
                m.original_inv_freq = m.inv_freq
    return model.to(device).eval(), tokenizer
