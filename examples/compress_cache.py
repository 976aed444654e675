#!/usr/bin/env python3
"""Loads a projections file with PyTorch and compresses one layer's cache.

    python3 examples/compress_cache.py PROJ.h5 SHARD.h5 [LAYER]

The first block is the README's snippet; the rest measures what it did.
"""
import sys

import h5py
import numpy as np
import torch

proj, shard = sys.argv[1], sys.argv[2]
layer = int(sys.argv[3]) if len(sys.argv) > 3 else 0


def cache(ds):  # bf16 is stored as uint16 bit patterns
    a = ds[...]
    if ds.attrs.get("dtype") in ("bfloat16", b"bfloat16"):
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).double()
    return torch.from_numpy(a.astype(np.float64))


# --- README snippet -----------------------------------------------------------
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
