"""python -m kqsvd.allocate: ranks per (layer, KV head) that spend a given
fraction of the full KV cache where the model's loss needs it most (the
policy quality-budget:F).

The energy rules (eps:, budget:) look only at singular values, whose
scales differ between keys and values and between layers; what a
truncation costs the model depends on how its loss reacts.  Here each
unit u (a layer's KV head, keys or values) gets a predicted cost of being
cut to rank r, from one forward and backward pass per calibration window
of the full model:

    s_u(r) = sum over tokens t of (g_t . (x_t - x_t A_r B_r^T))^2

where x_t is the unit's key (after RoPE) or value row, g_t the gradient of
the windows' negative log-likelihood with respect to it, and A_r B_r^T the
method's rank-r map (keys: scores q B_r (k A_r)^T = q (k A_r B_r^T)^T;
values: V A_v B_v^T).  It is the squared first-order change of the loss,
token by token (the empirical Fisher information along the truncation's
direction), so a direction the queries never look at costs nothing, as
for KQ-SVD it should.  The ranks minimising the sum of s_u(r_u) under the
budget are found exactly for the convex hulls of the curves (segments
taken by decreasing slope; ties by unit order, so the result is
deterministic), each unit between 1 and head_dim.

The model itself then decides: the allocation and the uniform one of the
same budget are measured (KL to the full model on the calibration
windows), the better is the start, and refine() moves columns between
units by the first-order change of that KL at the allocation where it
stands (the gradient of gates on every column), keeping a move only when
the measured KL falls.  So the policy is never worse than uniform ranks on
the text it was calibrated on.

With --tune STEPS the up-projections are then trained at those ranks
(kqsvd.quality.tune; the policy quality-tuned:F), on the same windows, the step
kept chosen on --check-seqs windows that follow them."""
import dataclasses

import numpy as np

from .. import models
from ..calibration.capture import Capture
from ..errors import KqsvdError, UsageError
from ..formats.policy import QUALITY_BUDGET
from ..formats.projections import METHODS, check_sizes, file_sizes, load_projections
from ..formats.saving import save_ranks
from .kl import full_logprobs, kl_to_full, weights_frozen
from .tune import tuned_file

def budget_ranks(fraction, units, d, prefix=QUALITY_BUDGET):
    """The whole number of rank columns a fraction of the cache buys;
    UsageError naming the policy (prefix F) when it buys fewer than one
    per unit."""
    total = int(round(fraction * units * d))
    if total < units:
        raise UsageError(f"{prefix}{fraction:g} buys {total} columns for {units} keys and values of "
                         f"KV heads; each needs at least 1 (the least fraction is "
                         f"{1.0 / d:.4g})")
    return total


def uniform(total, L, H):
    """[2, L, H] ranks of one size everywhere, the remainder given to the
    first units in order (keys before values, layer by layer)."""
    n = 2 * L * H
    r = np.full(n, total // n, dtype=np.int64)
    r[:total % n] += 1
    return r.reshape(2, L, H)


def hull_segments(cost):
    """The lower convex hull of a decreasing-ish curve cost[0..d-1] (cost of
    rank 1..d) as segments (slope per column, columns), steepest first."""
    pts = [(1, float(cost[0]))]
    for r in range(2, len(cost) + 1):
        pts.append((r, float(cost[r - 1])))
    hull = []
    for p in pts:
        while len(hull) >= 2:
            (x1, y1), (x2, y2) = hull[-2], hull[-1]
            if (y2 - y1) * (p[0] - x1) >= (p[1] - y1) * (x2 - x1):
                hull.pop()
            else:
                break
        hull.append(p)
    segs = []
    for (x1, y1), (x2, y2) in zip(hull, hull[1:]):
        gain = (y1 - y2) / (x2 - x1)
        if gain <= 0:
            break  # more columns buy nothing
        segs.append((gain, x2 - x1))
    return segs


def allocate_costs(costs, total):
    """costs: [U, d] predicted loss of each unit at ranks 1..d.  Returns
    int ranks [U] with sum == total, 1 <= r <= d, minimising the sum of the
    convexified costs."""
    U, d = costs.shape
    if not U <= total <= U * d:
        raise UsageError(f"a budget of {total} columns for {U} units of 1..{d} columns each")
    ranks = np.ones(U, dtype=np.int64)
    left = total - U
    segs = sorted(((-gain, u, k, n) for u in range(U)
                   for k, (gain, n) in enumerate(hull_segments(costs[u]))))
    for _, u, _, n in segs:
        if left == 0:
            break
        take = min(n, left)
        ranks[u] += take
        left -= take
    # Columns that buy nothing at all: spread over the units with room.
    u = 0
    while left > 0:
        if ranks[u] < d:
            ranks[u] += 1
            left -= 1
        u = (u + 1) % U
    return ranks


def group_view(info, head_groups):
    """A model's ModelInfo as a head-groups file sees it: Hkv / G KV heads
    of G d (docs/formats.md 5.3), so that units are (layer, group)."""
    return dataclasses.replace(info, num_kv_heads=info.num_kv_heads // head_groups,
                               head_dim=info.head_dim * head_groups)


class Sensitivity:
    """Accumulates s_u(r) for every method, unit and rank over windows."""

    def __init__(self, projs, info):
        self.mats = {}
        for m, p in projs.items():
            self.mats[m] = {"k": (p.key_down, p.query_down), "v": (p.value_down, p.value_up)}
        self.G = next(iter(projs.values())).head_groups
        L, H, d = info.num_layers, info.num_kv_heads, info.head_dim
        self.cost = {m: np.zeros((2, L, H, d)) for m in projs}

    def view(self, a):
        """[b, Hkv, T, d] rows as the group view's [b, Hkv / G, T, G d]: a
        group's heads side by side (a itself for G = 1)."""
        if self.G == 1:
            return a
        b, H, T, d = a.shape
        return a.reshape(b, H // self.G, self.G, T, d).transpose(0, 1, 3, 2, 4).reshape(
            b, H // self.G, T, self.G * d)

    def add(self, layer, kind, x, g, joint):
        """x, g: float64 [b, H, T, d] rows and their loss gradients (a group's
        heads are put side by side for head groups).  joint: square each
        window's sum over tokens (the Fisher form, with random-sign
        gradients), else each token's term."""
        x, g = self.view(x), self.view(g)
        side = 0 if kind == "k" else 1
        gx = (x * g).sum(-1)                                  # [b, H, T]
        for m, mats in self.mats.items():
            A, B = mats[kind][0][layer], mats[kind][1][layer]  # [H, d, d]
            xa = np.einsum("bhtd,hde->bhte", x, A)
            gb = np.einsum("bhtd,hde->bhte", g, B)
            c = gx[..., None] - np.cumsum(xa * gb, -1)       # g.(x - x A_r B_r^T), r = 1..d
            if joint:
                self.cost[m][side, layer] += (c.sum(2) ** 2).sum(0)
            else:
                self.cost[m][side, layer] += (c ** 2).sum((0, 2))


def measure_costs(model, info, seqs, projs, batch=4, draws=0, seed=0, sensitivity=None):
    """Forward and backward passes of the full model over the windows;
    returns {method: costs [2, L, Hkv, d]}.  draws = 0: the gradient of
    the windows' NLL, squared token by token; draws = n: n passes per batch
    with next tokens sampled from the model and random signs per position,
    whose squared sums estimate the Fisher quadratic form (the KL's second
    order) without bias.  sensitivity: what accumulates the costs
    (Sensitivity by default)."""
    import torch
    sens = sensitivity or Sensitivity(projs, info)
    live = []

    def sink(layer, kind, t):
        if kind in ("k", "v") and t.requires_grad:
            live.append((layer, kind, t))
            t.retain_grad()

    hooks = [model.get_input_embeddings().register_forward_hook(
        lambda _m, _i, out: out.requires_grad_(True))]
    # The keys the projections act on: after RoPE, or before it (--keys pre-rope).
    ropes = {p.rope for p in projs.values()}
    if len(ropes) != 1:
        raise KqsvdError("projections of keys before and after RoPE cannot be allocated together")
    cap = Capture(model.model, info.model_type, model.config, sink, rope=ropes.pop())
    gen = torch.Generator().manual_seed(seed)
    try:
        with weights_frozen(model):
            _cost_passes(model, info, seqs, batch, draws, gen, live, sens)
    finally:
        cap.close()
        for h in hooks:
            h.remove()
    return sens.cost


def _cost_passes(model, info, seqs, batch, draws, gen, live, sens):
    """measure_costs' passes: forward, backward, and the costs of the
    activations the hooks collected in `live`."""
    import torch
    for i, _ in ((i, k) for i in range(0, len(seqs), batch) for k in range(max(draws, 1))):
        ids = torch.from_numpy(seqs[i:i + batch]).to(next(model.parameters()).device)
        live.clear()
        logits = model(input_ids=ids, use_cache=False).logits.float()
        logp = torch.log_softmax(logits[:, :-1], -1)
        if draws:
            probs = logp.detach().exp().cpu()
            y = torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=gen)
            sign = torch.randint(0, 2, y.shape, generator=gen).double() * 2 - 1
            y = y.view(*probs.shape[:2], 1).to(logp.device)
            loss = (logp.gather(2, y)[..., 0] * sign.view(probs.shape[:2]).to(logp)).sum()
        else:
            loss = -logp.gather(2, ids[:, 1:, None]).sum()
        loss.backward()
        for layer, kind, t in live:
            x, g = t.detach(), t.grad
            sens.add(layer, kind, x.double().cpu().numpy(), g.double().cpu().numpy(),
                     joint=draws > 0)


class Gates:
    """Every layer's compressed attention at full width, each column of A
    and A_v multiplied by a gate (1 kept, 0 cut): the gradient of the loss
    with respect to the gates is the first-order change of the loss when a
    unit gains or loses a column, at the allocation where it is taken."""

    def __init__(self, model, proj_full, info):
        import torch
        from ..attention import compress, layer_projections  # torch at its top
        compress(model, proj_full)
        self.layers = layer_projections(model)
        self.A = [P.A.detach().clone() for P in self.layers]
        self.Av = [P.Av.detach().clone() for P in self.layers]
        L, H, d = info.num_layers, info.num_kv_heads, info.head_dim
        self.mask = torch.zeros(2, L, H, d, dtype=self.A[0].dtype, device=self.A[0].device)

    def set(self, ranks):
        import torch
        d = self.mask.shape[-1]
        cols = torch.arange(d, device=self.mask.device)
        r = torch.as_tensor(ranks, device=self.mask.device)
        self.mask = (cols < r[..., None]).to(self.mask.dtype).requires_grad_(True)

    def install(self):
        for l, P in enumerate(self.layers):
            P.A = self.A[l] * self.mask[0, l][:, None, :]
            P.Av = self.Av[l] * self.mask[1, l][:, None, :]


def refine(model, info, proj_path, method, ranks, seqs, full_logp, iters=6, log=None, step=None):
    """Moves columns between units while the measured KL to the full model
    on the windows falls: each round takes the gates' gradients (one
    forward and backward pass), pairs the units whose last column costs
    least with those whose next column gains most, and keeps the move only
    if the measured KL is lower (else halves the move).  The budget and the
    bounds hold throughout.  Returns (ranks [2, L, H], KL)."""
    # The Fisher costs are a second-order guess made at the full model; at
    # half the cache the model is far from it, and the gates' gradients
    # measured where the allocation stands say better where a column pays.
    from ..attention import compress  # torch at its top
    d = info.head_dim
    gates = Gates(model, load_projections(proj_path, method, d), info)
    ranks = np.array(ranks, dtype=np.int64)

    def kl_at(r, grad):
        gates.set(r)
        return kl_to_full(model, seqs, full_logp, grad=grad, before=gates.install)

    try:
        with weights_frozen(model):
            ranks, best = _moves(ranks, kl_at, gates, d, iters, step, method, log)
    finally:
        compress(model, None)
    return ranks, best


def _moves(ranks, kl_at, gates, d, iters, step, method, log):
    """refine's rounds; returns (ranks, KL)."""
    best = kl_at(ranks, True)
    g = gates.mask.grad.double().cpu().numpy().reshape(-1, d)
    step = step or max(1, ranks.size // 8)
    for it in range(iters):
        flat = ranks.reshape(-1)
        idx = np.arange(flat.size)
        drop = np.where(flat > 1, -g[idx, np.maximum(flat - 1, 0)], np.inf)
        add = np.where(flat < d, g[idx, np.minimum(flat, d - 1)], np.inf)
        order_drop, order_add = np.argsort(drop, kind="stable"), np.argsort(add, kind="stable")
        moved, trial, used = 0, flat.copy(), set()
        for u, v in zip(order_drop, order_add):
            if moved == step or drop[u] + add[v] >= 0:
                break
            if u == v or u in used or v in used:
                continue
            trial[u] -= 1
            trial[v] += 1
            used.update((u, v))
            moved += 1
        if moved == 0:
            break
        kl = kl_at(trial.reshape(ranks.shape), False)
        if log:
            log(f"{method}: round {it + 1} of {iters}: {moved} columns moved, KL {kl:.4f} "
                f"(was {best:.4f})")
        if kl < best:
            ranks, best = trial.reshape(ranks.shape), kl
            kl_at(ranks, True)
            g = gates.mask.grad.double().cpu().numpy().reshape(-1, d)
        else:  # the gradient where the allocation still stands holds
            step = max(1, step // 2)
            if moved == 1:
                break
    return ranks, best


def allocate(model, info, proj_path, fraction, seqs, methods, draws=2, rounds=6, log=None):
    """Quality-aware ranks for each method: {method: dict(rank_k [L, H],
    rank_v [L, H], start ("fisher" or "uniform"), kl_fisher, kl_uniform,
    kl)}, kl being the final allocation's KL to the full model on the
    windows (never above the other two).  model: the causal LM
    (kqsvd.models.load); seqs: int64 [n, T] calibration windows; draws:
    sampled passes per batch for the Fisher costs; rounds: refinement
    rounds (see refine).  Not collective.  Raises UsageError for an
    impossible fraction, KqsvdError for a bad projections file or model."""
    from ..attention import compress  # torch at its top
    # Units are (layer, group) for head groups.
    info = group_view(info, file_sizes(proj_path, methods)["head_groups"])
    L, H, d = info.num_layers, info.num_kv_heads, info.head_dim
    total = budget_ranks(fraction, 2 * L * H, d)
    full = {m: load_projections(proj_path, m, d) for m in methods}
    compress(model, None)
    costs = measure_costs(model, info, seqs, full, draws=draws)
    full_logp = full_logprobs(model, seqs)
    out = {}
    for m in methods:
        cands = {"fisher": allocate_costs(costs[m].reshape(2 * L * H, d), total).reshape(2, L, H),
                 "uniform": uniform(total, L, H)}
        kls = {}
        for name, r in cands.items():
            compress(model, load_projections(proj_path, m, (r[0], r[1])))
            kls[name] = kl_to_full(model, seqs, full_logp)
        compress(model, None)
        start = min(kls, key=lambda k: (kls[k], k != "fisher"))
        ranks, _ = refine(model, info, proj_path, m, cands[start], seqs, full_logp, rounds,
                          log=log)
        # Measured as the candidates were (the gates' path differs in the
        # last bits), so that the comparison is fair.
        compress(model, load_projections(proj_path, m, (ranks[0], ranks[1])))
        kl = kl_to_full(model, seqs, full_logp)
        compress(model, None)
        if kl > kls[start]:
            ranks, kl = cands[start], kls[start]
        out[m] = dict(rank_k=ranks[0], rank_v=ranks[1], start=start, kl_fisher=kls["fisher"],
                      kl_uniform=kls["uniform"], kl=kl)
        if log:
            log(f"{QUALITY_BUDGET}{fraction:g} {m}: keys {int(ranks[0].sum())} and values "
                f"{int(ranks[1].sum())} of {L * H * d} columns each; calibration KL "
                f"{kl:.4f} (uniform {kls['uniform']:.4f}, Fisher allocation {kls['fisher']:.4f})")
    return out


def fit(model, text, proj, budget, out, methods=METHODS, seq_len=256, num_seqs=4, bos=True,
        rounds=6, tune=0, check_seqs=4, lr=3e-3, device="cpu", force=False, log=None):
    """Fits quality-budget ranks (and, with tune > 0 steps, quality-tuned
    up-projections) for `budget`, a fraction of the full cache, on
    num_seqs windows of seq_len tokens of the text's train split, and
    writes them into a copy of the projections file `proj` at `out`
    (force: replace an existing out).  model: a model folder, GGUF file or
    id.  Returns out.  Not collective.  Raises UsageError for an impossible
    argument, KqsvdError for a bad file or model."""
    import torch
    models.check_device(device)
    psizes = file_sizes(proj, methods)  # a bad file fails before the model loads
    loaded, tok, info = models.load(model, dtype=torch.float32, device=device)
    check_sizes(psizes, proj, info.sizes(), model)
    if info.model_type not in models.COMPRESSIBLE:
        raise KqsvdError(f"{model}: quality-aware ranks need a decoder whose attention "
                         f"kqsvd.attention replaces ({', '.join(models.COMPRESSIBLE)}), not "
                         f"'{info.model_type}'")
    models.check_positions(info, loaded.config, seq_len)
    seqs = models.token_windows(tok, text, seq_len, num_seqs + (tune > 0) * check_seqs, "train",
                                bos=bos)[0]
    got = allocate(loaded, info, proj, budget, seqs[:num_seqs], methods, rounds=rounds, log=log)
    ranks = {m: (g["rank_k"], g["rank_v"]) for m, g in got.items()}
    if tune:
        return tuned_file(loaded, proj, ranks, seqs[:num_seqs], seqs[num_seqs:], out, budget,
                          tune, lr, log, force=force)
    return save_ranks(proj, out, ranks, f"{QUALITY_BUDGET}{budget:g}", force=force)
