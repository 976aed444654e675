"""What a cache layer hands the attention function.

transformers' attention modules pass what a cache layer's update() returns
straight on to the attention function, as its `key` and `value`.  This
package's layers return them as Handed tensors: tensors in every respect
(an attention function of transformers reads them as any other), that
also carry a Note of what the layer holds.  The kqsvd attention function
(function.py) reads that from its own arguments: nothing passes beside
them, and the function knows no cache class.

A Note says:
- `site`: the installation (compressed.Site) whose projections filled the
  layer, None for the model's own keys and values: the tensors are the
  latent's columns, or the model's, and a site other than the module's
  is refused;
- `reading`: for a step whose attention reads the layer's own stores
  (decode.Reading, what the layer holds in parts), the tensors then
  holding no data (zero strides: a float copy of the cache is what
  reading the stores avoids), and `read(dtype)`, every token's columns
  dequantized, for a model that attends otherwise;
- `prefill`: for a prefill the layer settles only once it has been
  attended (a tiered cache ranks its tokens by the prefill's last
  queries): after attending exactly, the function hands
  prefill(query, scaling, mask, position_ids) the prefill's queries, and
  the layer settles itself.

Why a tensor subclass rather than an object of its own: transformers,
and kvpress wrapping the attention functions, hand `key` and `value` on
as tensors (and may take their shapes); an object that is not one would
break them, a tensor that carries a note breaks nothing."""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class Note:
    """What a cache layer holds, handed with its keys and values (the
    module's docstring)."""
    site: object
    reading: object = None
    read: object = None
    prefill: object = None


class Handed(torch.Tensor):
    """A tensor from a cache layer, with its `note`.  What torch computes
    from it is a Handed without one: the note belongs to what the layer
    returned, not to what is computed from it."""


def hand(t, note):
    """t as a Handed tensor with `note` (same data, no copy)."""
    out = t.as_subclass(Handed)
    out.note = note
    return out


def received(key, value):
    """(note, key, value): the Note a cache layer of this package handed
    with key and value, and the two as plain tensors (the kqsvd attention
    computes on them at torch's own speed); (None, key, value) for
    tensors of any other origin."""
    note = getattr(key, "note", None) if isinstance(key, Handed) else None
    if note is None:
        return None, key, value
    return note, key.as_subclass(torch.Tensor), value.as_subclass(torch.Tensor)
