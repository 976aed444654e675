#!/usr/bin/env python3
"""Recomputes the perplexities of a quality report with an independent
compressed Llama and compares: the check of issue 17 ("an independent
re-implementation of the compressed attention with the written ranks
reproduces it within 1e-3").

    .venv/bin/python bench/reference_check.py REPORT.json [--policies P,...]

For every result of REPORT.json (python -m kqsvd.quality --json) whose
policy is listed (default: those that wrote a projections file,
quality-budget:F and quality-tuned:F), the file's projections are read
as they were measured (the written file with its stored per-head ranks
and, where it has them, tuned up-projections; other policies through
load_projections on the report's proj) and the same held-out windows
are scored by python/tests/test_attention.py's reference_nll: RMSNorm,
RoPE, GQA attention and SwiGLU written from the weights in float64,
without transformers' modules.  Prints one line per result and exits 1
when any differs by more than 1e-3 (relative perplexity)."""
import argparse
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "python"), os.path.join(HERE, "..", "python", "tests")]
TEXT = os.path.join(HERE, "..", "examples", "data")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("report", help="a quality report (python -m kqsvd.quality --json)")
    ap.add_argument("--policies", help="comma-separated; default: results with a 'proj' file")
    ap.add_argument("--tol", type=float, default=1e-3, help="relative perplexity [1e-3]")
    a = ap.parse_args()
    import torch
    import kqsvd
    from kqsvd import models
    from test_attention import reference_nll
    t0 = time.time()
    with open(a.report) as f:
        rep = json.load(f)
    want = a.policies.split(",") if a.policies else None
    todo = [r for r in rep["results"] if (r["policy"] in want if want else "proj" in r)]
    if not todo:
        sys.exit(f"reference_check.py: {a.report}: no result to check")
    model, tok, info = models.load(rep["model"], dtype=torch.float32)
    seqs = models.token_windows(tok, os.path.join(TEXT, rep["text"]), rep["seq_len"],
                                rep["num_seqs"], rep["split"], bos=bool(rep["bos"]))[0]
    sd, worst = model.state_dict(), 0.0
    n = seqs.shape[0] * (seqs.shape[1] - 1)
    for r in todo:
        if "proj" in r:
            proj = kqsvd.load_projections(r["proj"], r["method"])
        else:
            proj = kqsvd.load_projections(rep["proj"], r["method"], (
                r.get("rank_k_heads", r["rank_k"]), r.get("rank_v_heads", r["rank_v"])))
        nll = sum(reference_nll(sd, model.config, proj, row) for row in seqs)
        ppl = math.exp(nll / n)
        diff = abs(ppl / r["perplexity"] - 1)
        worst = max(worst, diff)
        print(f"{r['policy']:<22}{r['method']:<7} report {r['perplexity']:.4f}  independent "
              f"{ppl:.4f}  relative difference {diff:.1e}{'  (tuned)' if proj.tuned else ''}",
              flush=True)
    print(f"reference_check.py: {len(todo)} results, worst relative difference {worst:.1e} "
          f"(tolerance {a.tol:g}) in {time.time() - t0:.0f} s")
    return 0 if worst <= a.tol else 1


if __name__ == "__main__":
    sys.exit(main())
