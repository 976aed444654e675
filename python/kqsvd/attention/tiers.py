"""The tiered cache: each token of a layer held in one place, by its
importance (formats/tiers.py writes the layout; docs/formats.md 5.4.1).

- the sinks (the first tokens) and the window (the newest) as the model
  gave them: keys after RoPE and values, in full;
- every other token of the prefill in one tier, the ones the prefill's
  last queries attend to most in the first: a tier holds its tokens'
  latent columns under projections of its own (its ranks and bits), or
  drops them;
- the positions of a tier's tokens when its keys are taken before RoPE:
  each is rotated back at its own position, gaps and all.

The prefill attends exactly, as the model does; its last queries then
score every token (scorers.py: scorers.OBSERVED of them, SnapKV's
observation window, by the scorer the layout names) and the layer settles
its tokens into the tiers.  Later tokens enter the window; those that leave it enter the
first tier.  A decode step's update() hands what the layer holds as a
decode.Reading, a part per tier and one for the window and sinks: one
softmax over all their scores (tiers in their latent space, window and
sinks exactly), and the values' sum per tier, brought up by that tier's
B_v.

get_seq_length() is the tokens seen, not those held, so that positions
count on from it (generate() takes them from there)."""
from __future__ import annotations

import dataclasses
import weakref

import torch

from ..compat import update_places
from ..errors import KqsvdError
from .cache import latent_columns
from .decode import Codes, Exact, Floats, Reading
from .layer import FixedLayer
from .projection import rope
from .scorers import SCORERS


class Tier:
    """One tier of one layer: its tokens' latent columns under P (a
    LayerProjection; quantized when P carries bits) and, before RoPE,
    their positions (int32 [b, n])."""

    def __init__(self, P):
        self.P = P
        self.cols = latent_columns(P, residual=0) if P.quant is not None else None
        self.kc = self.vc = self.pos = None
        self.n = 0

    def add(self, keys, values, pos, rotary):
        """Takes tokens keys (after RoPE) and values [b, Hkv, t, d] at
        positions pos [b, t]."""
        cos, sin = rotary(values, pos) if self.P.pre else (None, None)
        kc, vc = self.P.project(keys, values, cos, sin)
        if self.cols is not None:
            self.cols.append(kc, vc)
        else:
            self.kc = kc if self.kc is None else torch.cat([self.kc, kc], -2)
            self.vc = vc if self.vc is None else torch.cat([self.vc, vc], -2)
        if self.P.pre:
            p = pos.to(torch.int32)
            self.pos = p if self.pos is None else torch.cat([self.pos, p], -1)
        self.n += keys.shape[-2]

    def reads_codes(self):
        """Whether a step reads this tier's codes through the decode kernels:
        quantized keys after RoPE, and a kernel reading its stores (their
        kernel.Reader, chosen by its first tokens)."""
        return self.cols is not None and not self.P.pre and self.cols.reader.reads

    def part(self, x, rotary):
        """The tier's tokens as a part of a step over tensors like x
        (decode.py): its codes, or its columns in floating point."""
        if self.reads_codes():
            return Codes(self.P, self.cols)
        kc, vc = self.cols.read(x.dtype) if self.cols is not None else (self.kc, self.vc)
        pos = self.pos
        return Floats(self.P, kc, vc, lambda y: rope(y, *rotary(y, pos.long())))

    def nbytes(self, float_bytes=None):
        held = self.cols.nbytes(float_bytes) if self.cols is not None else sum(
            t.numel() * (float_bytes or t.element_size()) for t in (self.kc, self.vc)
            if t is not None)
        return held + (0 if self.pos is None else self.pos.numel() * 4)


class Held:
    """What a tiered layer holds of rows that all saw the same tokens: the
    whole batch, or one row of a batch whose prefill's mask hid some of
    its tokens (padding).  Its tiers, the sinks and the window in full,
    and `hidden`, the prefill's tokens it never held (its positions are
    the cache's less those)."""

    def __init__(self, site, hidden=0):
        self.site, self.hidden = site, hidden
        self.layout = site.tiers.layout
        self.tiers = [None if P is None else Tier(P) for P in site.tiers.projections]
        self.full = None       # keys, values [b, Hkv, n, d]: the sinks, then the window
        self.held_sinks = 0    # of full's first tokens, the sinks
        self.full_pos = None   # int32 [b, n]: their positions, before RoPE (None after)

    def enter(self, keys, values, pos):
        """New tokens into the window; the oldest of it, beyond the window's
        length (or the new tokens' count), into the first tier."""
        W, T = self.layout.window, keys.shape[-2]
        fk, fv = self.full
        out = fk.shape[-2] - self.held_sinks + T - max(W, T)
        if out > 0:
            a, b = self.held_sinks, self.held_sinks + out
            if self.tiers[0] is not None:
                self.tiers[0].add(fk[..., a:b, :], fv[..., a:b, :], None if self.full_pos is None
                                  else self.full_pos[:, a:b], self.site.rotary)
            keep = lambda x, d: torch.cat([x.narrow(d, 0, a), x.narrow(d, b, x.shape[d] - b)], d)  # noqa: E731
            fk, fv = keep(fk, -2), keep(fv, -2)
            if self.full_pos is not None:
                self.full_pos = keep(self.full_pos, -1)
        self.full = (torch.cat([fk, keys], -2), torch.cat([fv, values], -2))
        if self.full_pos is not None:
            self.full_pos = torch.cat([self.full_pos, pos.expand(fk.shape[0], -1).int()], -1)

    def settle(self, query, keys, values, pos, scaling):
        """Places a prefill's tokens keys, values [b, Hkv, N, d] at positions
        pos [b, N], scored by the attention of its last queries [b, Hq, N,
        d] (after RoPE), each row ranking its own."""
        N = keys.shape[2]
        S = min(self.layout.sinks, N)
        W = min(self.layout.window, N - S)
        middle = N - S - W
        if middle:
            share = SCORERS[self.layout.scorer](query, keys, values, scaling,
                                                self.site.rotary)[:, S:S + middle]
            order = share.argsort(dim=-1, descending=True, stable=True)
            at = 0
            for tier, n in zip(self.tiers, self.layout.counts(middle)):
                idx = order[:, at:at + n].sort(-1).values + S  # in their order in the text
                at += n
                if tier is not None and n:
                    g = idx[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[-1])
                    tier.add(keys.gather(2, g), values.gather(2, g), pos.gather(1, idx),
                             self.site.rotary)
        keep = torch.cat([torch.arange(S), torch.arange(N - W, N)]).to(keys.device)
        self.full = (keys[..., keep, :], values[..., keep, :])
        # positions rotate a tier's keys back before RoPE; after RoPE its keys carry them
        self.full_pos = pos[:, keep].int() if any(
            t is not None and t.P.pre for t in self.tiers) else None
        self.held_sinks = S

    def parts(self, x):
        """Everything held as the parts of a step over tensors like x
        (decode.py): each tier that holds tokens, then the sinks and the
        window in full, the step's own tokens last."""
        return tuple([t.part(x, self.site.rotary) for t in self.tiers if t is not None and t.n] +
                     [Exact(*self.full)])

    def nbytes(self, float_bytes=None):
        held = sum(t.nbytes(float_bytes) for t in self.tiers if t is not None)
        held += sum(x.numel() * (float_bytes or x.element_size()) for x in self.full or ())
        return held + (0 if self.full_pos is None else self.full_pos.numel() * 4)


# (id(mask), what the prefill's mask showed) -> mask: the masks decode steps
# have checked (Shown), each once and not at every layer (on
# a GPU each check waits for the device).  Weak: a mask's record goes with it.
_CHECKED = weakref.WeakValueDictionary()


_UNMASKED = ("a tiered cache holds the tokens its prefill's attention mask showed: a later "
             "step's mask must show those and every later token (the prefill's mask extended "
             "by ones), not hide or show others")


class TierLayer(FixedLayer):
    """A cache layer of one attention module whose site (compressed.Site)
    carries a tier layout (site.tiers: compressed.SiteTiers, the layout and
    a LayerProjection or None per tier).  It holds what its prefill's
    attention mask showed to the prefill's last query: a batch without
    padding as one Held, a padded batch (or one whose mask hid any token)
    a Held per row, each holding its own tokens by the layout's counts of
    them (a shorter row holds fewer) and ranking them by its own queries;
    padding is never held."""

    KIND = "tiered"
    GONE = ("this tiered cache belongs to a compressed model that no longer is: start a new "
            "cache")

    def __init__(self, site):
        super().__init__(site)
        self.held = [Held(site)]  # the batch's, or a Held per row
        self.shown = None         # bool [b, N]: what the prefill's mask showed (None: all)
        self.shown_key = None     # its bytes: the same for every layer of a cache
        self.seen = 0
        self.prefill = None       # the prefill's keys, values, positions until settled

    def get_seq_length(self, *args):
        return self.seen

    def update(self, key_states, value_states, cache_kwargs=None, *args, kwargs=None, **extra):
        if self.keys is None:
            self.lazy_initialization(key_states, value_states)
        self.installed()
        T = key_states.shape[-2]
        places = update_places(cache_kwargs, kwargs)
        if self.seen == 0:  # attended exactly, then settled (settle)
            self.prefill = (key_states, value_states, positions(places, 0, key_states))
            self.seen = T
            return self.hand(key_states, value_states, prefill=self.settle)
        given = places.position_ids
        at = positions(update_places(cache_kwargs, None), self.seen, key_states)  # the cache's own
        self.seen += T
        each = [slice(None) if len(self.held) == 1 else slice(i, i + 1)
                for i in range(len(self.held))]
        for rows, h in zip(each, self.held):
            if given is None:  # a row's positions skip the tokens its prefill hid
                pos = at - h.hidden
            else:
                pos = given.reshape(-1, T)
                pos = pos[rows] if pos.shape[0] > 1 else pos
            h.enter(key_states[rows], value_states[rows], pos)
        reading = Reading(tuple((rows, h.parts(key_states)) for rows, h in zip(each, self.held)),
                          self.seen, selects=True,
                          check=Shown(self.shown, self.shown_key, self.seen))
        return self.hand_shapes(key_states, value_states, self.seen, reading, None)

    def settle(self, query, scaling, mask=None, position_ids=None):
        """Places the prefill's tokens, scored by the attention of its last
        queries [b, Hq, N, d] (after RoPE): those the mask [b, 1, N, N]
        (or None) shows to its last query, at position_ids [b or 1, N]
        (the model's; else those update() was given).  The prefill's
        hand-off (handoff.Note.prefill): the attention function hands it
        the queries once it has attended exactly."""
        keys, values, pos = self.prefill
        self.prefill = None
        b, N = keys.shape[0], keys.shape[2]
        if position_ids is not None and position_ids.shape[-1] == N:
            pos = position_ids
        pos = pos.reshape(-1, N).expand(b, -1)
        self.shown = shown(mask, b, N)
        self.shown_key = None if self.shown is None else self.shown.cpu().numpy().tobytes()
        if self.shown is None:
            self.held = [Held(self.site)]
            self.held[0].settle(query, keys, values, pos, scaling)
            return
        self.held = []
        for i in range(b):
            idx = self.shown[i].nonzero()[:, 0]
            h = Held(self.site, N - idx.numel())
            h.settle(query[i:i + 1, :, idx], keys[i:i + 1, :, idx], values[i:i + 1, :, idx],
                     pos[i:i + 1, idx], scaling)
            self.held.append(h)

    def nbytes(self, float_bytes=None):
        held = sum(h.nbytes(float_bytes) for h in self.held)
        held += sum(x.numel() * (float_bytes or x.element_size())
                    for x in (self.prefill[:2] if self.prefill else ()))
        return held + (0 if self.shown is None else self.shown.numel())


@dataclasses.dataclass(frozen=True)
class Shown:
    """What a tiered layer's prefill mask showed its last query (bool [b,
    N], None: every token), those bytes (the same for every layer of a
    cache), and the tokens the layer has seen: called as a decode.Reading's
    check(mask, b), KqsvdError unless a decode step's mask [b, 1, T, seen]
    shows its last query what the prefill's showed and every later token:
    a tiered cache holds only what its prefill showed, and cannot honour a
    mask that hides a token it holds or shows one it never held."""
    shown: object
    key: object
    seen: int

    def __call__(self, mask, b):
        if mask is None:  # every token shown: as the prefill's, or not honoured
            if self.shown is not None:
                raise KqsvdError(_UNMASKED)
            return
        key = (id(mask), self.key)  # every layer of a cache is given the same mask
        if mask.dim() != 4 or _CHECKED.get(key) is mask:
            return
        want = torch.ones(b, self.seen, dtype=torch.bool, device=mask.device)
        if self.shown is not None:
            want[:, :self.shown.shape[1]] = self.shown
        if not torch.equal(shown(mask, b, self.seen, False), want):
            raise KqsvdError(_UNMASKED)
        _CHECKED[key] = mask


def shown(mask, b, N, none_if_all=True):
    """bool [b, N]: the tokens an attention mask [b or 1, 1, T, >= N]
    (boolean, or additive: 0 shown) shows to its last query; None for no
    mask, and (none_if_all) for one that shows every token."""
    if mask is None or mask.dim() != 4:
        return None
    m = mask[:, 0, -1, :N]
    m = m if m.dtype == torch.bool else m > torch.finfo(m.dtype).min / 2
    m = m.expand(b, N)
    return None if none_if_all and bool(m.all()) else m.clone()


def positions(places, seen, x):
    """The new tokens' positions [1 or b, T] as update() was handed them
    (compat.Places); else they follow the tokens seen."""
    p = places.positions()
    return torch.arange(seen, seen + x.shape[-2], device=x.device)[None] if p is None else p

