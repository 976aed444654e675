"""Compressed attention in a transformers decoder, through transformers'
extension points: no method of the model is replaced.

`compress(model, proj)` builds every layer's matrices (projection.py),
registers them for the model's attention modules, and switches the
model's attention implementation (config._attn_implementation, which
every attention module and the mask builder read on each call) to the
kqsvd attention function (function.py).  A forward pre-hook on the
decoder starts a latent cache (cache.py: K A and V A_v, r columns per KV
head) wherever the model would start a cache of its own: a call with
use_cache and no cache, or generate()'s fresh, empty DynamicCache.  With
fold=True, B_v is folded into each layer's o_proj, which is swapped for
the folded Linear.  `compress(model, None)` undoes all of it.

`with compressed(model, proj):` does the same for a block and leaves the
model exactly as it found it: attention implementation, config, o_proj
modules, hooks, and any projections installed before the block.
`with reading_codes(model):` switches only the attention function, so
that a plain quantized cache's decode steps read codes (cache.py).

How they compose: the model attends through the kqsvd function while
anything needs it, projections installed (compress, compressed) or a
reading_codes() block open, in any order; when the last of them goes,
the implementation the model had before the first returns.  So
compress() inside a reading_codes() block keeps its projections working
after the block, and compress(model, None) after it gives back the
model's own implementation, not the block's.

Every matrix is built and checked before anything changes, so an error
leaves the model untouched.

None of them is thread-safe: while one thread has a compressed() or
reading_codes() block open on a model, another thread's compressed(),
reading_codes() or compress() on that model is refused (a KqsvdError
naming both threads) rather than let it swap the first block's
installation out from under its forward passes."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import weakref
from typing import Iterator

import torch
from transformers.cache_utils import DynamicCache

from ..compat import (attach, cache_kwarg, check_transformers, detach, restore_attention,
                      switch_attention)
from ..errors import KqsvdError, UsageError
from ..formats.projections import Projections, check_sizes
from ..formats.tiers import TierLayout
from ..models import COMPRESSIBLE
from .cache import LatentCache, LatentLayer, QuantLayer, codes_block
from .function import NAME
from .projection import LayerProjection
from .tiers import TierLayer


@dataclasses.dataclass(frozen=True)
class SiteTiers:
    """A tiered cache's layout at one attention module, and each tier's
    projections there (None for a tier that drops its tokens)."""
    layout: TierLayout
    projections: tuple


class Site:
    """One attention module's installation: its projections P, the model's
    rotary embedding (keys before RoPE), probe mode's records, the
    original o_proj while a folded one stands in, a tiered layout's
    SiteTiers or None, and whether it is installed now (`live`: a cache of
    a removed installation must not be used)."""

    def __init__(self, attn, P, rotary, probe, folded, tiers=None):
        self.attn, self.P, self.rotary, self.tiers = attn, P, rotary, tiers
        self.probe = [] if probe else None
        self.folded, self.o_original = folded, None
        self.live = False


def _decoder(model):
    dec = model.get_decoder() if hasattr(model, "get_decoder") else None
    return dec if dec is not None else getattr(model, "model", model)


def attention_modules(model):
    """The model's attention modules, one per layer; raises KqsvdError for a
    model whose family the compressed attention does not support."""
    mtype = getattr(model.config, "model_type", None)
    dec = _decoder(model)
    if mtype not in COMPRESSIBLE or not hasattr(dec, "layers"):
        raise KqsvdError(f"compressed attention supports {', '.join(COMPRESSIBLE)} decoders, "
                         f"not '{mtype}'")
    return [layer.self_attn for layer in dec.layers]


class _Install:
    """What compress() changed in one model, to be undone (or done again
    after a nested block) exactly."""

    def __init__(self, model, sites):
        self.model, self.sites = model, sites
        self.hook = None

    def apply(self):
        _acquire(self.model, self)
        for s in self.sites:
            attach(s.attn, NAME, s)
            s.live = True
            if s.folded is not None:
                s.o_original = s.attn.o_proj
                s.attn.o_proj = s.folded
        self.hook = _decoder(self.model).register_forward_pre_hook(self._start_cache,
                                                                   with_kwargs=True)
        _INSTALLED[self.model] = self

    def remove(self):
        _INSTALLED.pop(self.model, None)
        if self.hook is not None:
            self.hook.remove()
            self.hook = None
        _release(self.model, self)
        for s in self.sites:
            s.live = False
            detach(s.attn, NAME, s)
            if s.o_original is not None:
                s.attn.o_proj, s.o_original = s.o_original, None

    def _start_cache(self, module, args, kwargs):
        if self.sites[0].probe is not None:
            return None
        # transformers 5.24 renamed past_key_values to cache (and still maps
        # the old name): the cache is under whichever name the caller used,
        # else the one the decoder takes.
        key = next((k for k in ("cache", "past_key_values") if kwargs.get(k) is not None),
                   cache_kwarg(module))
        past = kwargs.get(key)
        use = kwargs.get("use_cache")
        if use is None:
            use = getattr(self.model.config, "use_cache", True)
        fresh = past is None and use or (type(past) is DynamicCache and past.get_seq_length() == 0)
        if not fresh:
            return None
        kwargs[key] = _new_cache(self.sites)
        return args, kwargs


_INSTALLED = weakref.WeakKeyDictionary()
# model -> (what restore_attention needs, the holders that need the kqsvd function):
# one record per model, so that installations and reading_codes() blocks
# may end in any order and the last one gives the model back its own.
_SWITCHED = weakref.WeakKeyDictionary()


def _acquire(model, holder):
    """The model attends through the kqsvd function at least while
    `holder` (an installation or a reading_codes() block) holds it."""
    saved, holders = _SWITCHED.get(model, (None, []))
    if not holders:
        saved = switch_attention(model.config, NAME)
    _SWITCHED[model] = (saved, holders + [holder])


def _release(model, holder):
    """holder no longer needs the kqsvd function; the last one to go
    restores the implementation the model had before the first came."""
    saved, holders = _SWITCHED.get(model, (None, []))
    holders = [h for h in holders if h is not holder]
    if holders:
        _SWITCHED[model] = (saved, holders)
        return
    _SWITCHED.pop(model, None)
    restore_attention(saved or [])


# model -> [the thread whose blocks are open on it, how many]: per model,
# so that threads working on models of their own never wait for each other.
_OWNERS = weakref.WeakKeyDictionary()
_OWNERS_LOCK = threading.Lock()


def _refuse_others(model, call, me):
    """KqsvdError when a thread other than `me` has a block open on model;
    the caller holds _OWNERS_LOCK."""
    held = _OWNERS.get(model)
    if held is not None and held[0] is not me:
        raise KqsvdError(f"{call}: thread '{me.name}' cannot change a model while thread "
                         f"'{held[0].name}' has a compressed() or reading_codes() block open on "
                         "it (they are not thread-safe): give each thread its own model")
    return held


@contextlib.contextmanager
def _owned(model, call):
    """The calling thread holds model for one block: entries of other
    threads are refused until the last of its blocks ends, however it ends."""
    me = threading.current_thread()
    with _OWNERS_LOCK:
        held = _refuse_others(model, call, me)
        _OWNERS[model] = [me, 1 + (held[1] if held else 0)]
    try:
        yield
    finally:
        with _OWNERS_LOCK:
            held = _OWNERS[model]
            held[1] -= 1
            if not held[1]:
                del _OWNERS[model]


def _check_model(model, call):
    """UsageError for a `model` that is not a transformers model (the
    attribute errors of a string or None otherwise)."""
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise UsageError(f"{call}: model must be a transformers model (a torch module with a "
                         f"config), not {type(model).__name__}")


def _build(model, proj, fold, probe, call="compress"):
    """The installation of proj in model, built and checked, not applied;
    model checked by the caller (_check_model); call names it in errors."""
    if not isinstance(proj, Projections):
        hint = " (a path: load it with kqsvd.load_projections first)" if isinstance(
            proj, (str, os.PathLike)) else ""
        none = ", or None" if call == "compress" else ""  # compressed() has nothing to remove
        raise UsageError(f"{call}: proj must be a Projections from kqsvd.load_projections{none}, "
                         f"not {type(proj).__name__}{hint}")
    attns = attention_modules(model)
    cfg = model.config.get_text_config(decoder=True) if hasattr(
        model.config, "get_text_config") else model.config
    hq = cfg.num_attention_heads
    check_sizes(proj.sizes(), proj.path, dict(
        num_layers=len(attns), num_heads=hq,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or hq,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // hq,
        hidden_size=cfg.hidden_size))
    rotary = getattr(_decoder(model), "rotary_emb", None)
    if proj.rope == "pre" and rotary is None:
        raise KqsvdError(f"{proj.path}: projections of keys before RoPE need the model's rotary "
                         "embedding, which this model does not have")
    fold = fold and not probe  # probe mode measures the unfolded heads
    if proj.tiers is not None and (fold or probe):
        raise UsageError(f"{call}: a tiered cache ({proj.policy}) takes neither fold nor probe: "
                         "its tiers bring their values up by B_v each")
    sites = []
    for l, attn in enumerate(attns):
        o = attn.o_proj
        w = o.weight  # each layer's own device: a model may be spread over GPUs
        P = LayerProjection(proj, l, hq, w.dtype, w.device, w.detach(), fold)
        tiers = None if proj.tiers is None else SiteTiers(proj.tiers[0], tuple(
            None if p is None else LayerProjection(p, l, hq, w.dtype, w.device)
            for p in proj.tiers[1]))
        folded = None
        if fold:
            folded = torch.nn.Linear(P.o_folded.shape[1], P.o_folded.shape[0],
                                     bias=o.bias is not None, dtype=w.dtype, device=w.device)
            with torch.no_grad():
                folded.weight.copy_(P.o_folded)
                if o.bias is not None:
                    folded.bias.copy_(o.bias)
            folded.train(o.training)
            P.o_folded = folded.weight  # one copy of the folded matrix, not two
        sites.append(Site(attn, P, rotary, probe, folded, tiers))
    return _Install(model, sites)


def compress(model: torch.nn.Module, proj: Projections | None, fold: bool = False,
             probe: bool = False) -> torch.nn.Module:
    """Installs `proj` in every layer's attention, or removes it when proj is None.

    Projections installed before are replaced.  The model's attention
    implementation becomes the kqsvd attention function, and a latent
    cache (K A and V A_v) starts wherever the model would start a cache of
    its own; compress(model, None) undoes all of it.  Every matrix is
    built and checked before anything changes.  Not collective, not
    thread-safe: refused while another thread has a block open on the
    model.

    Parameters
    ----------
    model : torch.nn.Module
        A transformers decoder of a supported family (a torch module with
        a config).
    proj : Projections or None
        Projections of this model's sizes (see load_projections); None
        removes what is installed.
    fold : bool
        Fold B_v into each layer's o_proj, which is swapped for the folded
        Linear (not with probe, which measures the unfolded heads).
    probe : bool
        Measure instead of compressing (function.py), read with
        probe_errors(); a probe runs without a cache.

    Returns
    -------
    torch.nn.Module
        The model.

    Raises
    ------
    UsageError
        For a model that is not a transformers model, or a proj that is
        not a Projections (nor None).
    KqsvdError
        For an unsupported model or transformers, projections of other
        sizes, or projections of keys before RoPE for a model without a
        rotary embedding, or while another thread has a compressed() or
        reading_codes() block open on the model.  The model is then
        unchanged.

    Examples
    --------
    >>> kqsvd.compress(model, kqsvd.load_projections("proj.h5", ranks="budget:0.25"))
    """
    check_transformers()
    _check_model(model, "compress")
    built = None if proj is None else _build(model, proj, fold, probe)
    with _OWNERS_LOCK:  # held while swapping: no block of another thread starts meanwhile
        _refuse_others(model, "compress", threading.current_thread())
        _swap(model, built)
    return model


def _swap(model, built):
    """Removes what is installed in model, applies built (or nothing), and
    returns what was installed before."""
    before = _INSTALLED.get(model)
    if before is not None:
        before.remove()
    if built is not None:
        built.apply()
    return before


@contextlib.contextmanager
def compressed(model: torch.nn.Module, proj: Projections, fold: bool = False,
               probe: bool = False) -> Iterator[torch.nn.Module]:
    """A block in which the model attends through `proj`, as compress() installs it.

    After the block the model is exactly as it was, including projections
    installed before the block.  Not collective, not thread-safe: while
    the block is open, other threads' compressed(), reading_codes() and
    compress() on the model are refused.

    Parameters
    ----------
    model : torch.nn.Module
        A transformers decoder of a supported family.
    proj : Projections
        Projections of this model's sizes (see load_projections).
    fold : bool
        Fold B_v into each layer's o_proj inside the block.
    probe : bool
        Measure instead of compressing, read with probe_errors().

    Yields
    ------
    torch.nn.Module
        The model.

    Raises
    ------
    UsageError
        For a model that is not a transformers model, or a proj that is
        not a Projections (None included).
    KqsvdError
        As compress(), another thread's block on the model included.
        Either is raised before the block is entered, the model unchanged.

    Examples
    --------
    >>> with kqsvd.compressed(model, proj):
    ...     out = model.generate(ids, max_new_tokens=20)
    """
    check_transformers()
    _check_model(model, "compressed")
    with _owned(model, "compressed"):
        before = _swap(model, _build(model, proj, fold, probe, "compressed"))
        try:
            yield model
        finally:
            _swap(model, before)


@contextlib.contextmanager
def reading_codes(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """A block in which decode steps over a plain quantized cache read its codes.

    Decode steps of `model` over a plain quantized cache (cache.QuantCache,
    the model's own keys and values) read its codes through the kernels
    (kernel.py) instead of attending over a dequantized copy, as a
    quantized latent cache does; on the CPU, below float64, with libkqsvd
    (elsewhere the cache dequantizes, as outside the block).  The model
    attends through the kqsvd attention function inside the block (SDPA
    itself where there are no codes to read) and is exactly as it was
    after it.  Inside the block, the thread's QuantCaches serve this model
    only.  Projections installed inside the block keep the kqsvd function
    after it (module docstring).  Not collective, not thread-safe: as
    compressed(), a block of another thread on the model is refused.

    Parameters
    ----------
    model : torch.nn.Module
        A transformers decoder of a supported family.

    Yields
    ------
    torch.nn.Module
        The model.

    Raises
    ------
    UsageError
        For a model that is not a transformers model.
    KqsvdError
        For a model whose family the kqsvd attention does not support, an
        unsupported transformers, or while another thread has a block
        open on the model.
    """
    check_transformers()
    _check_model(model, "reading_codes")
    attention_modules(model)
    block = object()
    with _owned(model, "reading_codes"):
        _acquire(model, block)
        try:
            with codes_block():
                yield model
        finally:
            _release(model, block)


def layer_projections(model):
    """The installed LayerProjection of each layer (tuning and allocation
    replace their tensors), or raises KqsvdError when none is installed."""
    inst = _INSTALLED.get(model)
    if inst is None:
        raise KqsvdError("no projections are installed in this model: call compress() first")
    return [s.P for s in inst.sites]


def probe_errors(model: torch.nn.Module) -> list[list[tuple[float, float]]]:
    """What a probe run measured: each layer's errors, one pair per sequence.

    Parameters
    ----------
    model : torch.nn.Module
        A model after compress(..., probe=True) and a run over whole
        sequences (use_cache=False).

    Returns
    -------
    list of list of (float, float)
        Per layer, the (err_kq, err_out) of each sequence seen since
        compress(..., probe=True): the relative squared errors of the
        scores and of the attention's output through o_proj.  Each layer's
        list is empty when the projections installed are not a probe's,
        and the whole list is empty when none are installed.
    """
    inst = _INSTALLED.get(model)
    return [list(s.probe or []) for s in inst.sites] if inst is not None else []


def latent_cache(model: torch.nn.Module) -> LatentCache:
    """A new, empty latent cache for a model with projections installed.

    To pass as the model's cache keyword (compat.cache_kwarg: `cache` from
    transformers 5.24 on, `past_key_values` before); the model starts one
    by itself otherwise.
    The cache holds K A and V A_v (quantized columns for projections with
    bits) and serves only while these projections stay installed.

    Parameters
    ----------
    model : torch.nn.Module
        A transformers model with projections installed (compress(), or
        inside compressed()).

    Returns
    -------
    LatentCache
        A transformers Cache of one layer per attention module.

    Raises
    ------
    UsageError
        For a model that is not a transformers model.
    KqsvdError
        When no projections are installed in the model.
    """
    _check_model(model, "latent_cache")
    inst = _INSTALLED.get(model)
    if inst is None:
        raise KqsvdError("no projections are installed in this model: call compress() first")
    return _new_cache(inst.sites)


def _new_cache(sites):
    """A LatentCache of one layer per site: tiered where the site has tiers,
    quantized where its projections carry bits."""
    return LatentCache([TierLayer(s) if s.tiers is not None else
                        QuantLayer(s) if s.P.quant is not None else LatentLayer(s)
                        for s in sites])
