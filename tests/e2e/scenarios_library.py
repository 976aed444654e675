"""The library's accumulator against the command line: a synthetic set fed
row by row through the public API (tests/tools/acc_replay.c, one process)
gives the projections `kqsvd calibrate` gives on one rank with the same
--qr-block, bit for bit, for every rank policy; and with several ranks,
within round-off."""
import os
import subprocess

import h5py
import numpy as np

from harness import calibrate, check, finish, load_proj, max_rel_diff, small_set

REPLAY = os.environ.get("KQSVD_ACC_REPLAY", "")


def replay(block, policy, beta, out, model, shards):
    p = subprocess.run([REPLAY, str(block), policy, str(beta), out, model] + shards,
                       capture_output=True, text=True, timeout=300)
    check(p.returncode == 0, f"acc_replay {policy}: {p.stderr}")
    return out


def accumulator():
    wd, model, shards = small_set("accumulator", layers=3, heads=6, kv_heads=2, head_dim=16,
                                  hidden=40, seqs=9, seq_len=150, min_seq_len=20, shards=3,
                                  uneven=True, dtype="bf16", seed=5)
    for policy, beta, block in (("eps:0.1", 1, 64), ("budget:0.4", 2, 64), ("fixed:5", 1, 256)):
        cli, lib = os.path.join(wd, "cli.h5"), os.path.join(wd, "lib.h5")
        for f in (cli, lib):
            if os.path.exists(f):
                os.remove(f)
        calibrate(model, cli, shards, extra=["--ranks", policy, "--beta", str(beta),
                                             "--qr-block", str(block)])
        replay(block, policy, beta, lib, model, shards)
        a, b = load_proj(cli), load_proj(lib)
        same = [k for k in a if k != "attrs" and np.array_equal(a[k], b[k])]
        differ = [k for k in a if k != "attrs" and k not in same]
        check(not differ, f"{policy} beta {beta} block {block}: library and CLI differ in "
              f"{differ[:4]} (max rel {max_rel_diff(a, b)[0]:.2e})")
        with h5py.File(lib) as f:
            check(f.attrs["kqsvd_format"] in ("projections", b"projections") and
                  int(f.attrs["qr_block_rows"]) == block and
                  int(f.attrs["tokens"]) == sum(int(h5py.File(s)["seq_lens"][...].sum())
                                                for s in shards),
                  f"{policy}: attributes {dict(f.attrs)}")
    # Several ranks merge factors in another order: equal to round-off.
    cli4 = os.path.join(wd, "cli4.h5")
    calibrate(model, cli4, shards, np_=4, extra=["--ranks", "fixed:5", "--qr-block", "256"])
    worst, where = max_rel_diff(load_proj(cli4), load_proj(os.path.join(wd, "lib.h5")))
    check(worst < 1e-10, f"4 ranks vs library: {worst:.2e} at {where}")
    finish("accumulator")


REF = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "calibrate-ref")
REF_SIGNATURE = "7dcc612a30f382e2"
REF_RUNS = ((1, []), (3, ["--qr-block", "64", "--ranks", "budget:0.3", "--beta", "2"]),
            (2, ["--qr", "gram"]))


def cpu_signature():
    """The CPU's model name and vector flags, hashed: where they match the
    machine that made the references, results must match bit for bit."""
    import hashlib
    import re
    try:
        info = open("/proc/cpuinfo").read()
        name = re.search(r"model name\s*:\s*(.*)", info).group(1).strip()
        flags = re.search(r"flags\s*:\s*(.*)", info).group(1).split()
    except (OSError, AttributeError):
        return ""
    sig = name + "|" + " ".join(sorted(f for f in flags if f.startswith(("avx", "fma", "sse"))))
    return hashlib.sha256(sig.encode()).hexdigest()[:16]


def calibrate_ref():
    """calibrate against outputs made before it ran on the accumulator."""
    wd, model, shards = small_set("calibrate_ref", layers=2, heads=4, kv_heads=2, head_dim=16,
                                  hidden=32, seqs=6, seq_len=200, min_seq_len=30, shards=3,
                                  uneven=True, dtype="bf16", seed=11)
    exact = cpu_signature() == REF_SIGNATURE
    print(f"calibrate_ref: {'the reference machine: bit for bit' if exact else 'another CPU: 1e-10'}")
    for i, (np_, extra) in enumerate(REF_RUNS, 1):
        out = os.path.join(wd, f"proj-{i}.h5")
        calibrate(model, out, shards, np_=np_, extra=extra)
        a, b = load_proj(os.path.join(REF, f"proj-{i}.h5")), load_proj(out)
        if exact:
            differ = [k for k in a if k != "attrs" and not np.array_equal(a[k], b[k])]
            check(not differ, f"run {i} ({np_} ranks {extra}) differs from the reference in {differ[:4]}")
        else:
            worst, where = max_rel_diff(a, b)
            check(worst <= 1e-10, f"run {i}: {worst:.2e} from the reference at {where}")
    finish("calibrate_ref")
