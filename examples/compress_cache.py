#!/usr/bin/env python3
"""Loads a projections file with PyTorch and compresses one layer's cache.

    python3 examples/compress_cache.py PROJ.h5 SHARD.h5 [LAYER]

proj.h5 read by hand with h5py (marked below; the kqsvd package's
load_projections and compress do this for a whole model) and a measurement
of what it did: the share of the cache kept and the relative squared error
of the scores.
Needs numpy, h5py and PyTorch (Debian: python3-numpy python3-h5py
python3-torch).  Usage errors exit 2, bad input 1, each with one line.
"""
import argparse
import os
import sys

from _python import rerun_elsewhere

# The kqsvd package of this repository decodes the contract's element types.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.realpath(__file__)), "..", "python"))

PROG = "compress_cache.py"


def fail(msg):
    print(f"{PROG}: {msg}", file=sys.stderr)
    sys.exit(1)


def parse_args():
    ap = argparse.ArgumentParser(
        prog=PROG, description="Compresses one layer's cache of SHARD.h5 with the kqsvd "
        "projections of PROJ.h5, at the layer's stored ranks, and prints the share of the "
        "cache kept and the relative squared error of the attention scores.")
    ap.add_argument("proj", metavar="PROJ.h5", help="projections file (kqsvd calibrate --out)")
    ap.add_argument("shard", metavar="SHARD.h5", help="a cache shard of the same model")
    ap.add_argument("layer", metavar="LAYER", nargs="?", default="0",
                    help="the layer to compress, from 0 to num_layers - 1 [0]")
    a = ap.parse_args()
    try:
        a.layer = int(a.layer)
    except ValueError:
        ap.error(f"argument LAYER: expected an integer from 0 to num_layers - 1, got '{a.layer}'")
    return a


def import_modules():
    """numpy, h5py and torch; python3 first on PATH (pyenv, a venv) may lack
    Debian's python3-* packages, so run again with $KQSVD_PYTHON or
    /usr/bin/python3 (as scripts/env.sh picks) before giving up."""
    try:
        import h5py
        import numpy
        import torch
        return h5py, numpy, torch
    except ImportError as e:
        rerun_elsewhere(__file__)
        fail(f"needs numpy, h5py and PyTorch ({e}); Debian: apt-get install python3-numpy "
             "python3-h5py python3-torch")


def attr(f, name):
    v = f.attrs.get(name)
    return v.decode() if isinstance(v, bytes) else v


def check_inputs(proj, shard, layer):
    """One line and exit 1 for a missing file, a file of the wrong kind, a
    shard of another model or a layer out of range."""
    sizes = {}
    for path, want, datasets in ((proj, "projections", ("kqsvd/key_down", "kqsvd/query_down",
                                                         "kqsvd/value_down", "kqsvd/value_up",
                                                         "kqsvd/rank_k", "kqsvd/rank_v")),
                                 (shard, "cache", ("keys", "values", "queries"))):
        if not os.path.exists(path):
            fail(f"{path}: no such file")
        if os.path.isdir(path):
            fail(f"{path}: is a folder, not a file")
        if not os.path.isfile(path):  # HDF5's open() of a FIFO waits for a writer forever
            fail(f"{path}: is not a regular file (a device, FIFO or socket)")
        try:
            with h5py.File(path, "r") as f:
                kind = attr(f, "kqsvd_format")
                if kind != want:
                    fail(f"{path}: not a kqsvd {want} file (kqsvd_format is {kind!r}, "
                         f"expected {want!r})" if kind else
                         f"{path}: not a kqsvd {want} file (no kqsvd_format attribute)")
                missing = [n for n in datasets if n not in f]
                if missing:
                    fail(f"{path}: dataset '{missing[0]}' is missing")
                sizes[path] = [int(f.attrs[n]) for n in ("num_layers", "num_heads",
                                                           "num_kv_heads", "head_dim")]
                if want == "projections" and int(f.attrs.get("head_groups", 1)) != 1:
                    fail(f"{path}: attribute 'head_groups' = {int(f.attrs['head_groups'])}: "
                         "this example reads per-head projections; kqsvd.compress applies "
                         "head-group latents")
        except OSError as e:
            fail(f"{path}: cannot read as HDF5 ({e})")
        except (KeyError, TypeError, ValueError) as e:
            fail(f"{path}: bad size attribute ({e})")
    for name, a, b in zip(("num_layers", "num_heads", "num_kv_heads", "head_dim"),
                          sizes[proj], sizes[shard]):
        if a != b:
            fail(f"{shard} has {name} = {b}, but {proj} has {a}: not the same model")
    layers = sizes[proj][0]
    if not 0 <= layer < layers:
        fail(f"LAYER {layer} is out of range: {proj} has {layers} layers, 0 to {layers - 1}")


def cache(ds):  # float64, bf16 bit patterns decoded (kqsvd.read_dataset)
    from kqsvd.formats.h5io import read
    return torch.from_numpy(read(ds))


args = parse_args()
h5py, np, torch = import_modules()
proj, shard, layer = args.proj, args.shard, args.layer
check_inputs(proj, shard, layer)

# --- reading proj.h5 by hand ---------------------------------------------------
with h5py.File(proj) as p, h5py.File(shard) as s:
    rk, rv = int(p["kqsvd/rank_k"][layer]), int(p["kqsvd/rank_v"][layer])
    A, B = (torch.from_numpy(p[f"kqsvd/{n}"][layer, :, :, :rk]) for n in ("key_down", "query_down"))
    Av, Bv = (torch.from_numpy(p[f"kqsvd/{n}"][layer, :, :, :rv]) for n in ("value_down", "value_up"))
    K, V, Q = (cache(s[n])[layer] for n in ("keys", "values", "queries"))  # [H, T, d]
K_c, V_c = K @ A, V @ Av                       # the compressed cache: [Hkv, T, r]
g = Q.shape[0] // K.shape[0]                   # query heads per KV head (GQA)
q_c = Q @ B.repeat_interleave(g, 0)            # queries projected once per step
scores = q_c @ K_c.repeat_interleave(g, 0).transpose(1, 2)  # ~ Q K^T, per head
# V_c @ Bv^T ~ V in the W^O-weighted sense: fold Bv^T into each head's W^O block.
# ------------------------------------------------------------------------------

exact = Q @ K.repeat_interleave(g, 0).transpose(1, 2)
err = ((scores - exact) ** 2).sum() / (exact ** 2).sum()
kept = (K_c.numel() + V_c.numel()) / (K.numel() + V.numel())
print(f"layer {layer}: rank_k {rk}, rank_v {rv}; cache kept {kept:.1%}; "
      f"relative score error {err.item():.4e}")
