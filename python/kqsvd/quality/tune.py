"""Up-projections trained on the model's loss (the policy quality-tuned:F).

The closed forms of the paper fit each layer's scores and outputs on their
own; what reaches the logits is their errors passed through the rest of
the model, where softmax and the layers after weigh them very unequally
(the first token of a window, an attention sink, draws a large part of
the attention).  Here the read-back side of a compressed head, B (keys:
the queries' projection, or with keys before RoPE the matrix that brings
the cached columns back to d-wide keys) and B_v (values), is trained by
Adam on the mean KL to the full model over calibration windows, starting
from the closed form.  A and A_v, what the cache holds, stay as they are:
the cache, its width and its ranks do not change, only how it is read.

Training on a few windows overfits, so a second, disjoint set of windows
checks every step, and the step with the lowest check KL is kept (step 0,
the closed form, included: the result is never worse than the untuned
projections on the check windows)."""
import copy

from ..errors import KqsvdError, UsageError
from ..formats.files import check_outputs
from ..formats.policy import QUALITY_TUNED
from ..formats.projections import load_projections
from ..formats.saving import save_ranks
from .kl import full_logprobs, kl_to_full, weights_frozen


class _Trainable:
    """Each layer's B and B_v of one Projections as trainable tensors,
    installed in the compressed attention before every batch."""

    def __init__(self, model, proj):
        import torch
        from ..attention import compress, layer_projections  # torch at its top
        compress(model, proj)
        p = next(model.parameters())
        self.layers = layer_projections(model)
        self.qd = [torch.tensor(m, dtype=p.dtype, device=p.device, requires_grad=True)
                   for m in proj.query_down]                       # [Hkv, d, rk]
        self.vu = [torch.tensor(m, dtype=p.dtype, device=p.device, requires_grad=True)
                   for m in proj.value_up]                         # [Hkv, d, rv]

    def install(self):
        # The layouts of attention.LayerProjection, rebuilt from the leaves
        # so that the gradients reach them.
        for P, qd, vu in zip(self.layers, self.qd, self.vu):
            P.set_up(qd, vu)

    def leaves(self):
        return self.qd + self.vu

    def snapshot(self):
        return [t.detach().double().cpu().numpy().copy() for t in self.leaves()]


def tune(model, proj, fit, check, steps=30, lr=3e-3, log=None):
    """Trains proj's up-projections (B and B_v at its ranks) on the KL to
    the full model.  model: the causal LM (kqsvd.models.load); proj: a
    Projections (kqsvd.load_projections); fit, check: int64 [n, T]
    windows to train on and to choose the step by, disjoint; steps: Adam
    steps (one pass over fit each); lr: Adam's learning rate.  Returns
    (Projections, info): a copy of proj with query_down and value_up
    replaced (columns past a head's rank stay zero), and info = dict(step
    (the step kept, 0 for none), steps, lr, kl_fit (before, after),
    kl_check (before, after)).  Not collective; leaves the model with its
    full attention.  Deterministic for the same inputs and threads."""
    import math
    import torch
    from ..attention import compress  # torch at its top
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise UsageError(f"tune: steps = {steps!r} must be a whole number, 0 or more")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not (math.isfinite(lr) and lr > 0):
        raise UsageError(f"tune: lr = {lr!r} must be a finite number above 0")
    if not len(fit) or not len(check):
        raise UsageError(f"tune: the fit ({len(fit)}) and check ({len(check)}) windows must not "
                         "be empty")
    compress(model, None)
    ref_fit, ref_check = full_logprobs(model, fit), full_logprobs(model, check)
    t = _Trainable(model, proj)
    opt = torch.optim.Adam(t.leaves(), lr=lr)
    try:
        with weights_frozen(model):
            kl0 = kl_to_full(model, check, ref_check, before=t.install)
            if not math.isfinite(kl0):
                raise KqsvdError(f"tune {proj.method}: the KL of the closed form on the check "
                                 f"windows is {kl0:g}, not finite: the model's log-probabilities "
                                 "are not finite on these windows")
            # Step 0 is the closed form as the file has it (float64), not
            # its copy in the model's dtype.
            best, kept, step = kl0, list(proj.query_down) + list(proj.value_up), 0
            if log:
                log(f"{proj.method}: closed form: KL {kl0:.4f} on {len(check)} check windows")
            fit0 = None  # the first step's forward pass measures it
            for s in range(1, steps + 1):
                opt.zero_grad()
                kl_fit = kl_to_full(model, fit, ref_fit, grad=True, before=t.install)
                fit0 = kl_fit if fit0 is None else fit0
                try:
                    opt.step()
                except RuntimeError as e:  # a step past float range
                    raise KqsvdError(f"tune {proj.method}: Adam's step {s} failed at learning "
                                     f"rate {lr:g} ({e}); give a smaller learning rate") from None
                kl = kl_to_full(model, check, ref_check, before=t.install)
                if not (math.isfinite(kl_fit) and math.isfinite(kl)):
                    raise KqsvdError(f"tune {proj.method}: the KL is {kl_fit:g} on the fit "
                                     f"windows and {kl:g} on the check windows at step {s}, not "
                                     f"finite (learning rate {lr:g}): the training diverged; "
                                     "give a smaller learning rate")
                if log:
                    log(f"{proj.method}: step {s} of {steps}: KL {kl_fit:.4f} on the fit windows "
                        f"(before the step), {kl:.4f} on the check windows (best {min(kl, best):.4f})")
                if kl < best:
                    best, kept, step = kl, t.snapshot(), s
            if fit0 is None:
                fit0 = kl_to_full(model, fit, ref_fit, before=t.install)
            fit_kl = fit0
            if step:  # the kept step's fit KL was not measured after it
                _put(t, kept)
                fit_kl = kl_to_full(model, fit, ref_fit, before=t.install)
    finally:
        compress(model, None)
    L = len(t.qd)
    out = copy.copy(proj)
    out.query_down, out.value_up = kept[:L], kept[L:]
    return out, dict(step=step, steps=steps, lr=lr, kl_fit=(fit0, fit_kl), kl_check=(kl0, best))


def _put(t, arrays):
    """Loads the kept step's values back into the leaves."""
    import torch
    with torch.no_grad():
        for leaf, a in zip(t.leaves(), arrays):
            leaf.copy_(torch.as_tensor(a, dtype=leaf.dtype))


def tuned_file(model, proj_path, ranks, fit, check, out, fraction, steps=30, lr=3e-3, log=None,
               force=False):
    """tune() for each method at its ranks ({method: (rank_k, rank_v)},
    e.g. from kqsvd.allocate.allocate), written with those ranks to `out`
    as the policy quality-tuned:F (kqsvd.formats.saving.save_ranks).  Returns
    out.  Not collective.  out is checked as save_ranks checks it (force to
    replace a file) before any training."""
    check_outputs([("out", out)], [("proj_path", proj_path)], force)
    tuned = {}
    for m, r in ranks.items():
        tuned[m] = tune(model, load_projections(proj_path, m, r), fit, check, steps, lr, log)
        info = tuned[m][1]
        if log:
            log(f"{QUALITY_TUNED}{fraction:g} {m}: kept step {info['step']} of {steps}; KL "
                f"{info['kl_fit'][0]:.4f} -> {info['kl_fit'][1]:.4f} on {len(fit)} fit windows, "
                f"{info['kl_check'][0]:.4f} -> {info['kl_check'][1]:.4f} on {len(check)} check "
                "windows")
    return save_ranks(proj_path, out, ranks, f"{QUALITY_TUNED}{fraction:g}", tuned=tuned, force=force)
