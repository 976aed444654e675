"""The memory a cache holds, measured: the storages of every tensor its
layers reference, each counted once, whole.

A view keeps the whole buffer it was cut from alive, so a cache's memory
is not the sum of its tensors' sizes but of their storages': this walks
what a cache layer references (its tensors, and the lists, tuples, dicts
and stores of this package that hold them), takes each tensor's untyped
storage, and sums the distinct ones (by device and address).  The
projections a layer reads (its `site`, a tier's `P`) are the model's, not
the cache's, and are not walked.

float_bytes counts floating-point storages holding values as they came
at float_bytes per element (2: as bf16), a rescale of what is referenced,
not a formula: the stores' codes, scales and zeros (named by their class's
`_as_stored`) and integer tensors count as stored."""
from __future__ import annotations

import torch

# Attributes of a cache layer that reference what is not the cache's: the
# installation (compressed.Site) and the projections (LayerProjection).
NOT_HELD = frozenset({"site", "P"})


def _walked(obj):
    """Whether obj's attributes are walked: a cache layer of transformers
    or an object of this package's attention (stores, columns, tiers)."""
    mod = type(obj).__module__ or ""
    if mod.startswith("kqsvd.attention."):
        return True
    return mod.startswith("transformers.") and hasattr(obj, "keys") and hasattr(obj, "values")


def _storages(t):
    """(key, nbytes, element size, floating) of the storages behind tensor t;
    a wrapper subclass without one of its own (quanto's QTensor) gives its
    inner tensors'."""
    try:
        s = t.untyped_storage()
        return [((t.device, s.data_ptr()), s.nbytes(), t.element_size(), t.is_floating_point())]
    except (RuntimeError, NotImplementedError, TypeError):
        inner = getattr(t, "__tensor_flatten__", None)
        if inner is None:
            return [((t.device, id(t)), t.numel() * t.element_size(), t.element_size(),
                     t.is_floating_point())]
        names, _ = inner()
        return [x for n in names for x in _storages(getattr(t, n))]


def _walk(x, found, seen, stored):
    if isinstance(x, torch.Tensor):
        for key, nbytes, size, floating in _storages(x):
            if key not in found or stored:
                found[key] = (nbytes, size, floating and not stored)
        return
    if id(x) in seen or x is None or isinstance(x, (str, bytes, int, float, bool)):
        return
    seen.add(id(x))
    if isinstance(x, (list, tuple)):
        for y in x:
            _walk(y, found, seen, stored)
    elif isinstance(x, dict):
        for y in x.values():
            _walk(y, found, seen, stored)
    elif _walked(x):
        as_stored = getattr(type(x), "_as_stored", ())
        for name, y in vars(x).items():
            if name not in NOT_HELD:
                _walk(y, found, seen, stored or name in as_stored)


def referenced_bytes(obj, float_bytes=None):
    """Bytes of the distinct storages obj (cache layers, lists of them,
    legacy (keys, values) tuples) references, floating ones holding values
    as they came counted at float_bytes per element when given."""
    found = {}
    _walk(obj, found, set(), False)
    total = 0
    for nbytes, size, rescale in found.values():
        total += nbytes // size * float_bytes if float_bytes and rescale else nbytes
    return total
