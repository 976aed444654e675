"""The library against the command line: a synthetic set fed row by row
through the public accumulator (tests/tools/acc_replay.c, one process)
gives the projections `kqsvd calibrate` gives on one rank with the same
--qr-block, bit for bit, for every rank policy, and with several ranks
within round-off; calibrate and evaluate called as the pipeline's library
functions (tests/tools/pipeline_run.c) give the command line's files; and
calibrate still equals outputs made before the accumulator."""
import os
import subprocess

import h5py
import numpy as np

from harness import PREFLAGS, calibrate, check, finish, load_proj, max_rel_diff, small_set

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


PIPELINE_RUN = os.environ.get("KQSVD_PIPELINE_RUN", "")


def observed_ranks(lines):
    """{method: [(rank_k, rank_v) per layer]} from the tool's ranks lines."""
    out = {}
    for ln in lines:
        if ln.startswith("ranks "):
            name, *pairs = ln.split()[1:]
            out[name] = [tuple(int(x) for x in p.split("/")) for p in pairs]
    return out


def pipeline():
    """calibrate and evaluate as library calls (tests/tools/pipeline_run.c)
    under 1 and 3 ranks: the same files as the command line, the observer
    told the ranks written, nothing printed without an observer, and an
    impossible plan one agreed usage error."""
    import json
    wd, model, shards = small_set("pipeline", layers=3, heads=6, kv_heads=2, head_dim=16,
                                  hidden=40, seqs=8, seq_len=120, min_seq_len=20, shards=3,
                                  uneven=True, dtype="f16", seed=8)
    for np_ in (1, 3):
        prefix = os.path.join(wd, f"np{np_}")
        cmd = [os.environ.get("KQSVD_MPIEXEC", "mpiexec"), os.environ.get("KQSVD_MPIEXEC_FLAGS", "-n"),
               str(np_)] + PREFLAGS + [PIPELINE_RUN, prefix, model] + shards
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        check(p.returncode == 0, f"np {np_}: pipeline_run exit {p.returncode}: {p.stderr}")
        # Nothing of the pipeline's own reaches the terminal.
        check(p.stdout == "" and p.stderr == "", f"np {np_}: the library printed "
              f"{(p.stdout + p.stderr)[:300]!r}")
        lines = open(prefix + ".observed").read().splitlines()
        facts = {ln.split()[0]: ln for ln in lines}
        check(facts.get("calibrate") == "calibrate 0" and facts.get("quiet") == "quiet 0" and
              facts.get("evaluate", "").startswith("evaluate 0 d=16"), f"np {np_}: {lines}")
        check(not any(ln.startswith("unterminated") for ln in lines), f"np {np_}: {lines}")
        begun = [ln.split()[1] for ln in lines if ln.startswith("begin ")]
        check(begun == ["calibrate", "evaluate"], f"np {np_}: progress stages {begun}")
        # The ranks the observer heard are the ones written, per method.
        heard = observed_ranks(lines)
        with h5py.File(prefix + ".proj.h5") as f:
            for m in ("kqsvd", "ksvd", "eigen"):
                stored = list(zip(f[m]["rank_k"][...].tolist(), f[m]["rank_v"][...].tolist()))
                check(heard.get(m) == stored, f"np {np_} {m}: heard {heard.get(m)}, stored {stored}")
        check("per_method=1" in facts.get("calibrated", ""), f"np {np_}: {facts.get('calibrated')}")
        # The command line, same options and rank count: the same bytes.
        cli = os.path.join(wd, f"cli{np_}.h5")
        calibrate(model, cli, shards, np_=np_, extra=["--ranks", "budget:0.4", "--device", "cpu"])
        a, b = load_proj(cli), load_proj(prefix + ".proj.h5")
        differ = [k for k in a if k != "attrs" and not np.array_equal(a[k], b[k])]
        check(not differ, f"np {np_}: library and CLI differ in {differ[:4]}")
        js = os.path.join(wd, f"cli{np_}.json")
        from harness import run
        run(["evaluate", "--progress", "off", "--model", model, "--proj", prefix + ".proj.h5",
             "--json", js, *shards], np_=np_)
        lib_report, cli_report = json.load(open(prefix + ".eval.json")), json.load(open(js))
        check(lib_report == cli_report, f"np {np_}: evaluation reports differ")
        tight = [ln for ln in lines if ln.startswith("tight ")]
        check(tight[:1] == [f"tight usage={np_} of {np_} speakers=1 rank0_speaks=1 "
                            "tight_exists=0"], f"np {np_}: impossible plan: {tight}")
        check(len(tight) == 2 and "--mem-limit 16 MiB is too small" in tight[1],
              f"np {np_}: impossible plan's message: {tight}")
    finish("pipeline")
