"""The valid set every mutant starts from: a tiny `kqsvd synth` set (model
file + 2 shards), its projections on 1 and 2 ranks (the references), the
checkpoints of a killed calibrate on 1 and 2 ranks, and where the raw data
of each file lies (what is not raw data is metadata)."""
import glob
import json
import os
import shutil
import sys

import h5py

from .runner import must


SET = dict(layers=2, heads=4, kv_heads=2, head_dim=8, seqs=6, seq_len=64, shards=2, dtype="bf16",
           seed=1)


def data_ranges(path):
    """[(offset, size)] of the raw data of every dataset stored contiguously
    or in chunks; everything else in the file is metadata."""
    ranges = []
    with h5py.File(path, "r") as f:
        def visit(_, obj):
            if not isinstance(obj, h5py.Dataset):
                return
            dcpl = obj.id.get_create_plist()
            layout = dcpl.get_layout()
            if layout == h5py.h5d.CONTIGUOUS and obj.id.get_offset() is not None:
                ranges.append((obj.id.get_offset(), obj.id.get_storage_size()))
            elif layout == h5py.h5d.CHUNKED:
                for i in range(obj.id.get_num_chunks()):
                    c = obj.id.get_chunk_info(i)
                    ranges.append((c.byte_offset, c.size))
        f.visititems(visit)
    return sorted(ranges)


def setup(ctx):
    b = ctx.base
    shutil.rmtree(b, ignore_errors=True)
    os.makedirs(b)
    opts = []
    for k, v in SET.items():
        opts += ["--" + k.replace("_", "-"), v]
    must(ctx, ["synth", "--out", os.path.join(b, "set"), "--progress", "off"] + opts)
    model = os.path.join(b, "set", "model.h5")
    shards = sorted(glob.glob(os.path.join(b, "set", "shard-*.h5")))
    assert len(shards) == 2, shards
    # The uninterrupted results on 1 and 2 ranks (rank counts agree to round-off only).
    ref, ref2 = os.path.join(b, "ref.h5"), os.path.join(b, "ref2.h5")
    must(ctx, ["calibrate", "--progress", "off", "--model", model, "--out", ref] + shards)
    must(ctx, ["calibrate", "--progress", "off", "--model", model, "--out", ref2] + shards, np_=2)
    # Checkpoints of a run killed after its first save, on 1 and on 2 ranks.
    for np_, name in ((1, "ck1"), (2, "ck2")):
        ck = os.path.join(b, name)
        for after in ("1", "2", "3"):
            shutil.rmtree(ck, ignore_errors=True)
            must(ctx, ["calibrate", "--progress", "off", "--model", model, "--out",
                       os.path.join(b, "killed.h5"), "--checkpoint", ck, "--checkpoint-every", "0"]
                 + shards, np_=np_, expect=None,
                 env={"KQSVD_TEST_KILL_AFTER_CHECKPOINTS": after, "KQSVD_TEST_KILL_RANK": "0"})
            if len(glob.glob(os.path.join(ck, "rank-*.h5"))) == np_:
                break
        else:
            sys.exit(f"fuzz_readers: setup made no {np_}-rank checkpoint in {ck}")
    for leftover in glob.glob(os.path.join(b, "killed.h5*")):
        os.remove(leftover)
    files = {"shard0": shards[0], "shard1": shards[1], "model": model, "proj": ref,
             "ck1": glob.glob(os.path.join(b, "ck1", "rank-*.h5"))[0],
             "ck2": sorted(glob.glob(os.path.join(b, "ck2", "rank-*.h5")))[0]}
    info = {"files": files, "shards": shards, "model": model, "ref": ref, "ref2": ref2,
            "ranges": {k: data_ranges(v) for k, v in files.items()},
            "sizes": {k: os.path.getsize(v) for k, v in files.items()}}
    with open(os.path.join(b, "info.json"), "w") as f:
        json.dump(info, f, indent=1)
    return info
