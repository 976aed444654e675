#!/usr/bin/env python3
"""Passkey retrieval at long context (kqsvd.quality.retrieval): a 5-digit
key hidden at each depth of filler from the text's held-out end, asked
for and answered greedily by the full model, plain int-b caches, kvpress
presses and kqsvd's stored files, each through its own cache.

    .venv-peers/bin/python bench/passkey.py --proj FILE [--proj FILE ...] \\
        [--lengths 2048,4096,8192] [--depths 0.1,0.3,0.5,0.7,0.9] \\
        [--plain 4,3] [--presses expected:0.25,expected:0.125] [--json OUT]

The presses need kvpress (.venv-peers; --presses none without it).  Each
trial prefills its whole context: about 9 s at 2,048 tokens, 32 s at 4,096
and 2 minutes at 8,192 on 2 cores in float32 for the full model."""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--text", default="examples/data/jargon-file-4.4.7.txt")
    ap.add_argument("--proj", action="append", default=[], help="a kqsvd file, its stored policy")
    ap.add_argument("--lengths", default="2048")
    ap.add_argument("--depths", default="0.1,0.3,0.5,0.7,0.9")
    ap.add_argument("--plain", default="4,3")
    ap.add_argument("--presses", default="expected:0.25,expected:0.125")
    ap.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="data/passkey/passkey.json")
    ap.add_argument("--force", action="store_true", help="replace the report if it exists")
    a = ap.parse_args()
    from kqsvd.errors import KqsvdError
    from kqsvd.formats.files import check_input_file, check_outputs, write_atomic
    try:  # every input and the report's place, before minutes of work
        check_input_file("--text", a.text)
        for path in a.proj:
            check_input_file("--proj", path)
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        check_outputs([("--json", a.json)], [("--text", a.text)] +
                      [("--proj", p) for p in a.proj], a.force)
    except KqsvdError as e:
        sys.exit(f"passkey.py: error: {e}")
    import torch
    from kqsvd import models
    from kqsvd.formats.projections import load_projections
    from kqsvd.formats.quant import QuantScheme
    from kqsvd.quality.configs import Latent, PlainQuant
    from kqsvd.quality.retrieval import DIGITS, accuracy, passkey
    t0 = time.time()
    model, tok, _ = models.load(a.model, dtype=getattr(torch, a.dtype))
    with open(a.text, encoding="utf-8") as f:
        ids = tok(f.read(), add_special_tokens=False)["input_ids"]
    filler = ids[len(ids) // 2:]  # the validation half: text no file was calibrated on
    configs = [PlainQuant(int(b), QuantScheme()) for b in a.plain.split(",") if b]
    if a.presses != "none":
        from kqsvd.quality.peers import PressPeer
        for item in a.presses.split(","):
            name, _, kept = item.partition(":")
            configs.append(PressPeer(name, float(kept), 1 << 20))
    kept = {}
    for path in a.proj:
        p = load_projections(path, "kqsvd")
        tag = f" [{os.path.splitext(os.path.basename(path))[0]}]"
        configs.append(Latent("stored", "kqsvd", p, tag))
        kept[configs[-1].label] = p.cache_kept()
    # The answer's tokens stay within the model's positions: a length at the
    # limit (8,192 for SmolLM2) is the prompt and answer together.
    limit = getattr(model.config, "max_position_embeddings", None) or 1 << 30
    lengths = [min(int(x), limit - DIGITS - 1) for x in a.lengths.split(",")]
    depths = [float(x) for x in a.depths.split(",")]
    n = len(lengths) * len(depths) * (1 + len(configs))
    done = [0]

    def progress():
        done[0] += 1
        print(f"passkey: {done[0]}/{n} answers, {time.time() - t0:.0f} s", file=sys.stderr,
              flush=True)
    rows = passkey(model, tok, filler, lengths, depths, configs, a.seed, progress)
    report = dict(model=a.model, text=os.path.basename(a.text), lengths=lengths, depths=depths,
                  dtype=a.dtype, seed=a.seed, kept=kept, results=rows,
                  elapsed_s=time.time() - t0)

    def write(tmp):
        with open(tmp, "w") as f:
            json.dump(report, f, indent=1)
    write_atomic(a.json, write)
    w = max(len(k) for k in rows) + 2
    print(f"{'configuration':<{w}}" + "".join(f"{n:>8}" for n in lengths))
    for label, got in rows.items():
        print(f"{label:<{w}}" + "".join(f"{100 * accuracy(got, n):>7.0f}%" for n in lengths))
    print(f"passkey: {len(depths)} depths per length, wrote {a.json} in "
          f"{time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
