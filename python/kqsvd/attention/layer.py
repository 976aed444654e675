"""What every cache layer of this package shares (cache.py's LatentLayer
and QuantLayer, tiers.py's TierLayer): transformers' DynamicLayer for
what it does for any last dimension, the installation (`site`,
compressed.Site) whose projections fill it, the refusal of a cache whose
installation is gone, and the shape-only hand-off of a step whose
attention reads the layer's own stores (handoff.py)."""
import torch
from transformers.cache_utils import DynamicLayer

from ..errors import KqsvdError
from .handoff import Note, hand


class KqsvdLayer(DynamicLayer):
    """A cache layer of one attention module filled under `site`
    (compressed.Site, or None for the model's own keys and values)."""

    # The cache's columns are latents of projections that are gone, which
    # no attention can read (it was a raw torch error).
    GONE = ("this latent cache belongs to a compressed model that no longer is: its "
            "projections were removed (compress(model, None), or the end of a "
            "compressed() block); start a new cache")

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

    def installed(self):
        """The layer's site, still installed in its model; else KqsvdError."""
        if not self.site.live:
            raise KqsvdError(self.GONE)
        return self.site

    def hand(self, keys, values, **note):
        """keys and values handed as this layer's, with a Note of its site
        and `note`'s fields (handoff.py)."""
        note = Note(self.site, **note)
        return hand(keys, note), hand(values, note)

    def hand_shapes(self, key_states, value_states, n, reading, read):
        """Keys and values of n tokens shaped as these new ones, with no
        data (zero strides), handed with `reading` (decode.Reading) and
        `read`: the attention reads the layer's stores, and a float copy
        of the cache is what that avoids."""
        none = key_states.new_zeros(())
        return self.hand(*(none.expand(*x.shape[:2], n, x.shape[-1])
                           for x in (key_states, value_states)), reading=reading, read=read)


class FixedLayer(KqsvdLayer):
    """A layer that holds its tokens in a form of its own (quantized, or in
    tiers), which DynamicLayer's cropping, beam reordering and batch
    repetition would not keep: refused."""

    KIND = "quantized"

    def _refuse(self, *args, **kwargs):
        raise KqsvdError(f"a {self.KIND} cache cannot be cropped, reordered or repeated")

    crop = batch_repeat_interleave = batch_select_indices = reorder_cache = _refuse
