"""What a cache layer hands the attention function.

transformers' attention modules pass what a cache layer's update() returns
straight on to the attention function, as its `key` and `value`.  This
package's layers return them as Handed tensors: tensors in every respect
(an attention function of transformers reads them as any other), that
also say which cache layer they come from and whether that layer's stores
are to be read as codes, in which case they hold no data (zero strides: a
float copy of the cache is what reading codes avoids).  The kqsvd attention function
(function.py) reads that from its own arguments: nothing passes beside
them.

Why a tensor subclass rather than an object of its own: transformers,
and kvpress wrapping the attention functions, hand `key` and `value` on
as tensors (and may take their shapes); an object that is not one would
break them, a tensor that carries a note breaks nothing."""
import torch


class Handed(torch.Tensor):
    """A tensor from a cache layer: `layer` (cache.LatentLayer or
    cache.QuantLayer), `codes` (whether the attention reads the layer's
    stores, this tensor holding only their shape) and then `reading`
    (decode.Reading: what the layer holds, in parts).  What torch computes
    from it is a Handed without them: the note belongs to what the layer
    returned, not to what is computed from it."""


def hand(t, layer, codes=False, reading=None):
    """t as a Handed tensor from `layer` (same data, no copy)."""
    out = t.as_subclass(Handed)
    out.layer, out.codes, out.reading = layer, codes, reading
    return out


def received(key, value):
    """(layer, reading, key, value): what a cache layer of this package
    handed with key and value (reading None unless the attention reads the
    layer's stores), and the two as plain tensors (the kqsvd attention
    computes on them at torch's own speed); (None, None, key, value) for
    tensors of any other origin."""
    layer = getattr(key, "layer", None) if isinstance(key, Handed) else None
    if layer is None:
        return None, None, key, value
    return layer, key.reading, key.as_subclass(torch.Tensor), value.as_subclass(torch.Tensor)
