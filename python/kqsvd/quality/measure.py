"""What a rank costs the model: perplexity, KL and top-1 agreement of the
compressed model against the full one, per rank policy and method, every
pair scored on the same windows as the full model (which runs once per
window).  The command is kqsvd.commands.quality (python -m kqsvd.quality)."""

from ..compat import cache_kwarg, output_cache
from ..errors import KqsvdError, UsageError
from ..formats import policy as policies_
from ..formats.projections import load_projections, policy_ranks
from ..formats.quant import QuantScheme, with_bits
from ..formats.tiers import attach as attach_tiers
from ..progress import Progress
from .allocate import budget_ranks
from .bits import check_fraction
from .tally import Tally


def resolve_policies(proj, policies, methods, L, scheme=None):
    """[(policy, method, Projections)] for every policy and method, from
    the projections file `proj` of a model with L layers, for the policies
    the file resolves alone (`kqsvd ranks`'s, and 'stored'), each with its
    '@bits' quantizing the latent under `scheme` (a QuantScheme; its
    defaults when None); UsageError on a bad policy, and on one fitted to
    the model (quality-budget:F, ...), which the quality command fits."""
    pairs = []
    for text in policies:
        pol = policies_.parse(text)
        if pol.fitted:
            raise UsageError(f"rank policy {text} needs the model: fit it with python -m "
                             "kqsvd.quality")
        if pol.tiers is not None:
            pairs += [(text, m, attach_tiers(load_projections(proj, m), pol.tiers,
                                             scheme or QuantScheme(),
                                             lambda r, m=m: load_projections(proj, m, r)))
                      for m in methods]
            continue
        stored = pol.base == policies_.STORED
        got = policy_ranks(proj, None if stored else pol.base)
        for m in methods:
            r = got["methods"][m]
            if len(r["rank_k"]) != L:
                raise KqsvdError(f"{proj}: kqsvd ranks gave {len(r['rank_k'])} layers, not {L}")
            # Stored ranks are read as stored, with the file's tuned
            # up-projections where it has them (docs/formats.md 5.3).
            ranks = None if stored else (r.get("rank_k_heads", r["rank_k"]),
                                         r.get("rank_v_heads", r["rank_v"]))
            p = load_projections(proj, m, ranks)
            if pol.bits is not None:  # without '@': the file's own bits, where it has any
                p = with_bits(p, pol.bits, scheme or QuantScheme())
            label = got["policy"] + text[len(pol.base):] if stored else text
            pairs.append((label, m, p))
    return pairs


def check_fitted(policy, sizes, scheme):
    """Refuses (UsageError naming it) a quality-budget:F, quality-tuned:F or
    quality-bits:F whose F no fit can meet in a file of these sizes
    (formats.projections.file_sizes), before the model is loaded; scheme:
    the quantized cache's, for quality-bits."""
    frac = policies_.fitted_fraction(policy)
    G = sizes["head_groups"]  # units are (layer, group) of G d columns
    H, d = sizes["num_kv_heads"] // G, sizes["head_dim"] * G
    if policy.startswith(policies_.QUALITY_BITS):
        check_fraction(frac, d, scheme)
    elif policy.startswith(policies_.QUALITY_TIERS):
        return  # any fraction: the fit says when not even the window fits
    else:
        budget_ranks(frac, 2 * sizes["num_layers"] * H, d, policy[:policy.index(":") + 1])


def window_logprobs(model, ids, key, stepwise=False):
    """float64 log-probabilities [T - 1, V] of each next token of a window
    (int64 [1, T]) through the model as it is (compressed or not), and the
    cache it ends with.  One whole-window pass; or, `stepwise`, the first
    token then the others one at a time, as generation does: a quantized
    cache then quantizes a block only once a token completes it, so that
    no token reads a key block whose scales later tokens set (the
    whole-window pass would quantize every complete block before any
    token reads it).  key: the model's cache keyword (compat.cache_kwarg)."""
    import torch
    from transformers import DynamicCache
    if not stepwise:
        out = model(input_ids=ids, use_cache=True, **{key: DynamicCache()})
        return torch.log_softmax(out.logits[0, :-1].double(), dim=-1), output_cache(out)
    cache, logits = DynamicCache(), []
    for t in range(ids.shape[1]):  # the last token too: the cache holds the whole window
        pos = torch.tensor([[t]], device=ids.device)
        out = model(input_ids=ids[:, t:t + 1], use_cache=True, position_ids=pos, **{key: cache})
        cache = output_cache(out)
        logits.append(out.logits[0])
    return torch.log_softmax(torch.cat(logits[:-1]).double(), dim=-1), cache


def measure(model, seqs, pairs, fold=False, score_errors=False):
    """Scores every (policy, method, Projections) pair on the windows seqs
    (int64 [n, T]) against the full model, which runs once per window.
    Quantized projections are scored step by step (window_logprobs), the
    others and the full model in one pass, tiered caches on each window's
    last tokens after a prefill of the rest (tiers.tiered_logprobs; their
    results say scored "tail", the tokens and the full model's perplexity
    on them); cache bytes are the memory each cache references, measured
    (attention.cache_bytes: the room its buffers keep included), values
    held as computed at 2 (bf16) in either dtype, as the frontier does.
    fold: fold B_v into o_proj; score_errors: also measure err_kq and
    err_out in the model (one more pass per pair).  Returns (full, [result
    per pair]) as the report holds them.  Not collective; leaves the model
    with its full attention."""
    import torch
    from ..attention import cache_bytes, compress, probe_errors  # torch at its top
    from .tiers import tiered_logprobs  # torch at its top
    key = cache_kwarg(model)  # past_key_values, or cache from transformers 5.24 on
    full, tallies = Tally(), [Tally() for _ in pairs]
    tails = [Tally() for _ in pairs]  # the full model on a tiered pair's tokens
    bar = Progress("quality", len(seqs) * (1 + len(pairs) * (1 + score_errors)), "passes")
    compress(model, None)
    dev = next(model.parameters()).device
    with torch.no_grad():
        for row in seqs:
            ids = torch.from_numpy(row[None]).to(dev)
            targets = ids[0, 1:]
            compress(model, None)
            ref, cache = window_logprobs(model, ids, key)
            full.add(ref, targets)
            full.cache_bytes = max(full.cache_bytes, cache_bytes(cache, 2))
            bar.advance()
            for (pol, m, proj), t, ft in zip(pairs, tallies, tails):
                compress(model, proj, fold=fold)
                if proj.tiers is not None:  # exact at the prefill: scored after it
                    logp, _, end = tiered_logprobs(model, ids)
                    n = logp.shape[0]
                    t.add(logp, targets[-n:], ref[-n:])
                    ft.add(ref[-n:], targets[-n:])
                    t.cache_bytes = max(t.cache_bytes, end)
                    bar.advance()
                    continue
                logp, cache = window_logprobs(model, ids, key, stepwise=proj.quant is not None)
                t.add(logp, targets, ref)
                t.cache_bytes = max(t.cache_bytes, cache_bytes(cache, 2))
                bar.advance()
                if score_errors:
                    compress(model, proj, probe=True)
                    model(input_ids=ids, use_cache=False)
                    t.add_probe(probe_errors(model))
                    bar.advance()
    compress(model, None)
    results = [t.result() for t in tallies]
    for r, ft in zip(results, tails):
        if ft.tokens:  # a tiered cache: its tokens and the full model's on them
            r.update(scored="tail", tokens_scored=int(ft.tokens),
                     full_perplexity=ft.result()["perplexity"])
    return full.result(), results
