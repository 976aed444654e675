"""The scorers of a tiered cache's prefill (tiers.py): how much each token
matters to the tokens to come, from the prefill's last queries, one
function per scorer by the name a layout writes (formats/tiers.py's
SCORERS), as kvpress's presses are one class each.

Each takes the prefill's queries [b, Hq, T, d] (after RoPE), keys [b, Hkv,
N, d] (after RoPE) and values, the module's scaling and the model's rotary
embedding, and gives each token's score [b, N], in float32 at least: the
layer places the highest in its first tier."""
import torch
import torch.nn.functional as F

from .decode import gqa_scores
from .projection import rope

OBSERVED = 64  # the prefill's last queries that score its tokens (SnapKV's observation window)


def _share(query, keys, scaling, values=None):
    """Each token's share of the attention of the last OBSERVED queries
    [b, Hq, T, d] (causal among them), summed over queries and heads (each
    head's share times the norm of the token's value there, with values:
    its weight in the output) and averaged over 5 neighbours: [b, N], in
    float32 at least."""
    acc = torch.promote_types(query.dtype, torch.float32)
    q = query[:, :, -OBSERVED:].to(acc)
    w, N = q.shape[2], keys.shape[2]
    s = gqa_scores(q, keys.to(acc)) * scaling
    late = torch.ones(w, w, dtype=torch.bool, device=q.device).tril()
    s[..., N - w:] = s[..., N - w:].masked_fill(~late, float("-inf"))
    share = torch.softmax(s, -1).sum(2)                                   # [b, Hq, N]
    if values is not None:
        b, hq = share.shape[:2]
        norm = values.to(acc).norm(dim=-1)                                # [b, Hkv, N]
        share = (share.view(b, norm.shape[1], -1, N) * norm[:, :, None]).view(b, hq, N)
    return F.avg_pool1d(share.sum(1)[:, None], 5, 1, 2, count_include_pad=False)[:, 0]


def snap(query, keys, values, scaling, rotary):
    """SnapKV's: the attention the last OBSERVED queries pay each token."""
    return _share(query, keys, scaling)


def snapv(query, keys, values, scaling, rotary):
    """snap's, each head's share weighed by the norm of the token's value
    there (its weight in the head's output)."""
    return _share(query, keys, scaling, values)


def expected(query, keys, values, scaling, rotary, ahead=256):
    """Each token's expected weight in the output of the next `ahead`
    queries: the last OBSERVED queries [b, Hq, T, d] (after RoPE) moved to
    the positions ahead (each rotated by the mean of the rotations that
    take it there), taken as Gaussian (their mean and covariance per
    head), so that a key's expected logit is s mu.k + s^2 k'Ck / 2; the
    softmax of those over the tokens, times the norm of each token's
    value, summed over the heads: [b, N], in float32 at least."""
    acc = torch.promote_types(query.dtype, torch.float32)
    b, hq, T, d = query.shape
    N = keys.shape[2]
    q = query[:, :, -OBSERVED:].to(acc)
    w = q.shape[2]
    # the rotation from position N - w + i to N + u, averaged over u < ahead
    shift = torch.arange(w, 0, -1, device=q.device)[:, None] + torch.arange(ahead,
                                                                             device=q.device)
    cos, sin = rotary(q, shift.reshape(1, -1))
    cos, sin = (x.to(acc).view(w, ahead, -1).mean(1) for x in (cos, sin))   # [w, d]
    moved = rope(q, cos[None], sin[None])                                   # [b, Hq, w, d]
    mu = moved.mean(2, keepdim=True)                                        # [b, Hq, 1, d]
    dev = moved - mu
    cov = dev.transpose(-1, -2) @ dev / max(w - 1, 1)                       # [b, Hq, d, d]
    k = keys.to(acc)
    hk = k.shape[1]
    kk = k[:, :, None].expand(b, hk, hq // hk, N, d).reshape(b, hq, N, d)
    logit = scaling * (kk @ mu.transpose(-1, -2))[..., 0] + \
        0.5 * scaling ** 2 * ((kk @ cov) * kk).sum(-1)                    # [b, Hq, N]
    weight = torch.softmax(logit, -1)
    norm = values.to(acc).norm(dim=-1)                                      # [b, Hkv, N]
    return (weight.view(b, hk, -1, N) * norm[:, :, None]).sum((1, 2))


# name (formats.tiers.SCORERS) -> scorer
SCORERS = {"snap": snap, "snapv": snapv, "expected": expected}
