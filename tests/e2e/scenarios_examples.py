"""The example scripts' command lines: examples/compress_cache.py answers a
usage error with argparse's usage line and exit 2, and bad input (a layer
out of range, a missing file, a file of the wrong kind, a shard of another
model) with one line naming the argument or file and exit 1, never with a
Python traceback."""
import os
import subprocess
import sys

from harness import FAILURES, calibrate, check, finish, small_set, synth

HERE = os.path.dirname(os.path.abspath(__file__))
COMPRESS = os.path.join(HERE, "..", "..", "examples", "compress_cache.py")
INSPECT = os.path.join(HERE, "..", "..", "examples", "inspect_proj.py")


def compress(*args):
    return subprocess.run([sys.executable, COMPRESS, *map(str, args)], capture_output=True,
                          text=True, timeout=120)


def expect(p, rc, words, what):
    """Exit code rc, and stderr one line (after argparse's usage line for
    rc 2) holding every word, without a traceback."""
    err = p.stderr.strip()
    lines = err.splitlines()
    one = len(lines) == (2 if rc == 2 else 1)
    ok = (p.returncode == rc and one and "Traceback" not in err
          and all(w in lines[-1] for w in words))
    check(ok, f"compress_cache.py {what}: exit {p.returncode} (expected {rc}), stderr:\n{err}")
    if rc == 2:
        check(lines and lines[0].startswith("usage: compress_cache.py"),
              f"compress_cache.py {what}: no usage line:\n{err}")


def examples_usage():
    wd, model, shards = small_set("examples_usage", layers=2, heads=4, kv_heads=2, head_dim=16,
                                  seqs=4, seq_len=40, shards=2)
    proj = os.path.join(wd, "proj.h5")
    calibrate(model, proj, shards)
    shard = shards[0]

    # Usage errors: argparse's usage line and one line, exit 2.
    expect(compress(), 2, ["PROJ.h5", "SHARD.h5", "required"], "without arguments")
    expect(compress(proj), 2, ["SHARD.h5", "required"], "without SHARD.h5")
    expect(compress(proj, shard, "first"), 2, ["LAYER", "integer", "'first'"], "with LAYER 'first'")
    expect(compress(proj, shard, 1, 2), 2, ["unrecognized arguments: 2"], "with a fourth argument")
    p = compress("--help")
    check(p.returncode == 0 and "LAYER" in p.stdout, f"compress_cache.py --help: {p.returncode} {p.stdout}")

    try:
        import h5py  # noqa: F401
        import numpy  # noqa: F401
        import torch  # noqa: F401
    except ImportError:
        # Bad input is checked once the modules are there (and this kind of
        # run tells what is missing in one line).
        p = compress(proj, shard, 5)
        check(p.returncode == 1 and "Traceback" not in p.stderr and "needs" in p.stderr,
              f"compress_cache.py without its modules: {p.returncode} {p.stderr}")
        if FAILURES:
            finish("examples_usage")
        print("examples_usage: SKIPPED the bad-input cases: PyTorch is not installed "
              "(Debian: python3-torch)")
        raise SystemExit(77)

    # Bad input: one line naming the argument or file, exit 1.
    expect(compress(proj, shard, 2), 1, ["LAYER 2", "out of range", proj, "2 layers", "0 to 1"],
           "with LAYER 2 of 2")
    expect(compress(proj, shard, -1), 1, ["LAYER -1", "out of range", "0 to 1"], "with LAYER -1")
    missing = os.path.join(wd, "missing.h5")
    expect(compress(missing, shard), 1, [missing, "no such file"], "with a missing PROJ.h5")
    expect(compress(proj, missing), 1, [missing, "no such file"], "with a missing SHARD.h5")
    expect(compress(wd, shard), 1, [wd, "folder"], "with a folder as PROJ.h5")
    expect(compress(shard, proj), 1, [shard, "not a kqsvd projections file", "'cache'"],
           "with a shard as PROJ.h5")
    expect(compress(proj, model), 1, [model, "not a kqsvd cache file", "'model'"],
           "with the model file as SHARD.h5")
    fifo = os.path.join(wd, "proj.fifo")
    if not os.path.exists(fifo):
        os.mkfifo(fifo)
    # HDF5 opens a FIFO and waits for a writer: a check missing hangs (timeout).
    expect(compress(fifo, shard), 1, [fifo, "not a regular file"], "with a FIFO as PROJ.h5")
    p = subprocess.run([sys.executable, INSPECT, model, fifo, shard], capture_output=True,
                       text=True, timeout=120)
    check(p.returncode == 1 and "Traceback" not in p.stderr and fifo in p.stderr and
          "not a regular file" in p.stderr and len(p.stderr.strip().splitlines()) == 1,
          f"inspect_proj.py with a FIFO as PROJ.h5: exit {p.returncode}, stderr:\n{p.stderr}")
    text = os.path.join(wd, "notes.txt")
    with open(text, "w") as f:
        f.write("not HDF5\n")
    expect(compress(text, shard), 1, [text, "HDF5"], "with a text file as PROJ.h5")
    _, other = synth(os.path.join(wd, "other"), layers=2, heads=4, kv_heads=2, head_dim=8, seqs=2,
                     seq_len=16, shards=1)
    expect(compress(proj, other[0]), 1, [other[0], "head_dim = 8", "16", "not the same model"],
           "with a shard of another model")

    joint = os.path.join(wd, "joint.h5")
    calibrate(model, joint, shards, extra=["--head-groups", "2"])
    expect(compress(joint, shard), 1, [joint, "head_groups", "per-head"],
           "with a head-groups file")

    # And the good case still runs.
    p = compress(proj, shard, 1)
    check(p.returncode == 0 and p.stdout.startswith("layer 1: rank_k"),
          f"compress_cache.py on good input: {p.returncode} {p.stdout} {p.stderr}")
    finish("examples_usage")


if __name__ == "__main__":
    examples_usage()
