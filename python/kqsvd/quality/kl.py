"""What the quality tools share (kqsvd.allocate, kqsvd.quality.tune, kqsvd.quality):
the KL of a compressed model to the full one on token windows, with
gradients where asked (the fitted policies' names are formats.policy's).
Numpy and torch only; no command line."""
import contextlib


@contextlib.contextmanager
def weights_frozen(model):
    """Gradients for activations and gates only: the weights' would double
    the backward pass's work for nothing."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(True)


def logprobs(model, ids, cache=False):
    """float64 next-token log-probabilities of every position but the last;
    cache: through the cache the model starts (a quantized latent cache
    quantizes only what it holds)."""
    import torch
    return torch.log_softmax(model(input_ids=ids, use_cache=cache).logits[:, :-1].double(), -1)


def full_logprobs(model, seqs, batch=4):
    """The model's log-probabilities per batch of windows, the reference of
    kl_to_full."""
    import torch
    device = next(model.parameters()).device
    with torch.no_grad():
        return [logprobs(model, torch.from_numpy(seqs[i:i + batch]).to(device))
                for i in range(0, len(seqs), batch)]


def kl_to_full(model, seqs, full_logp, batch=4, grad=False, before=None, cache=False):
    """Mean KL(full || model) per predicted token over the windows.  grad:
    back-propagate each batch's KL; before: called before each batch;
    cache: run through the model's cache (see logprobs)."""
    import torch
    kl, n = 0.0, 0
    device = next(model.parameters()).device
    with torch.set_grad_enabled(grad):
        for i in range(0, len(seqs), batch):
            if before:
                before()
            ref = full_logp[i // batch]
            part = (ref.exp() * (ref - logprobs(model, torch.from_numpy(seqs[i:i + batch])
                                                 .to(device), cache))).sum()
            if grad:
                part.backward()
            kl += float(part.detach())
            n += ref.shape[0] * ref.shape[1]
    return kl / max(n, 1)
