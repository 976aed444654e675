"""The compressed attention as a transformers attention function, registered
with AttentionInterface (and AttentionMaskInterface: a name unknown there
makes transformers drop the mask, and left padding with it) under NAME.

transformers calls it from each attention module with the queries after
RoPE and with what the cache's update returned: the latent columns of a
cache layer of this package, with a note of what it holds (handoff.py),
or full keys and values (no cache, or a cache of another kind), which it
projects itself, so the result is the same either way.  It knows no
cache class: what a layer holds is in its note.
Scores are (q B)(K A)^T scaled by the module's own scaling (1/sqrt(d),
never 1/sqrt(r)), the weights multiply V A_v, and B_v^T (or the folded
o_proj) takes the result back; all through
torch.nn.functional.scaled_dot_product_attention (projected.py).

A decode step over a layer that reads its own stores (a quantized latent
read as codes, a plain quantized cache inside reading_codes(), a tiered
cache) is the attention over what the layer's update() said it holds,
in parts (decode.step).

Probe mode (compress(..., probe=True); projected.py) measures instead:
it computes the exact and the compressed scores and outputs eagerly,
records their relative squared errors per sequence (err_kq and err_out
as `kqsvd evaluate` defines them: scores after RoPE, W^O without its
bias), and returns the exact output, so every layer sees the full
model's inputs."""
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..compat import attached
from ..errors import KqsvdError
from . import projected
from .decode import step
from .handoff import received

# The function's name, and the key of what it reads for an attention
# module (compat.attached): the module's compressed.Site while its model
# is compressed, attached and detached by compressed.py alone.
NAME = "kqsvd"


def latent_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                     **kwargs):
    # dropout sixth, as transformers' SDPA function has it: kvpress wraps
    # every registered attention function and passes it by position.
    note, key, value = received(key, value)
    site = attached(module, NAME)
    if note is not None and note.site is None and site is not None:
        # a compressed model given a plain quantized cache: its stores read
        # whole, full keys and values from here
        key, value = note.read(query.dtype)
        note = None
    if note is None and (site is None or site.tiers is not None):
        # a module of a model not (or no longer) compressed; or a tiered
        # one without its cache, which attends as at a prefill: exactly
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      scaling=scaling, dropout=dropout, **kwargs)
    if kwargs.get("softcap") is not None:
        raise KqsvdError("compressed attention does not support logit soft-capping")
    if note is not None and note.site is not site:
        raise KqsvdError("this cache was filled under other projections: start a new one "
                         "(kqsvd.latent_cache) after each compress()")
    drop = dropout if module.training else 0.0
    if note is not None and note.reading is not None:  # a decode step over what the layer holds
        return step(note.reading, query, attention_mask, scaling, drop), None
    if note is not None and note.prefill is not None:
        # a prefill the layer settles once attended (a tiered cache's): it
        # attends exactly, as the model does, and hands the layer its queries
        if scaling is None:
            scaling = query.shape[-1] ** -0.5
        out = sdpa_attention_forward(module, query, key, value, attention_mask,
                                     scaling=scaling, dropout=dropout, **kwargs)
        note.prefill(query, scaling, attention_mask, kwargs.get("position_ids"))
        return out
    if site.probe is not None and (note is not None or key.shape[2] != query.shape[2]):
        raise KqsvdError("probe mode measures whole sequences: call the model with "
                         "use_cache=False")
    # a prefill through the projections (SDPA), or probe mode's measurement
    return projected.attend(module, site, note is not None, query, key, value, attention_mask,
                            scaling, drop, kwargs.get("position_ids")), None


AttentionInterface.register(NAME, latent_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)
