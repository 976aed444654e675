"""Commands that must not need MPI, and the CUDA module loader's checks.

nompi: help (every form), --version, `manifest` and `ranks` run where Open
MPI cannot start -- no mpirun, orted or ssh on PATH (a login node), or its
runtime refusing (OMPI_MCA_plm=bogus) -- with their usual output and exit
codes, while calibrate and synth fail there (which shows that those
environments stop MPI_Init).  Under mpirun, manifest still prints once.

gpu_abi: the loader refuses stand-in modules (tests/gpu/fake_module.c) of
another ABI version, or without a table, naming both versions and the
module's path; calibrate --device auto then falls back to the CPU with a
warning, --device cuda fails.  KQSVD_TEST_GPU_LOADER=1 makes the loader
open and check a module without a GPU and never use it, so this runs in CI."""
import ctypes
import os
import re

from harness import (KQSVD, calibrate, check, finish, load_proj, max_rel_diff, run, small_set)

TINY = dict(layers=2, heads=4, kv_heads=2, head_dim=4, hidden=16, seqs=4, seq_len=32,
            min_seq_len=32, shards=2)
COMMANDS = ("calibrate", "evaluate", "manifest", "ranks", "synth")
# What Open MPI prints when its runtime is touched and fails.
OMPI_NOISE = ("MPI_Init", "orte_init", "ORTE_ERROR_LOG", "MPI_INIT", "---------")


def no_mpi_envs(wd):
    """Environments where MPI_Init cannot succeed, by name."""
    bare = os.path.join(wd, "bare-path")  # a PATH without mpirun, orted, ssh or rsh
    os.makedirs(bare, exist_ok=True)
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("OMPI_COMM_WORLD", "PMIX_", "PMI_", "SLURM_"))}
    return {"no mpirun on PATH": dict(base, PATH=bare),
            "runtime refuses": dict(base, OMPI_MCA_plm="bogus")}


def quiet(name, p):
    """Nothing of Open MPI's on stderr: MPI was not touched."""
    for n in OMPI_NOISE:
        check(n not in p.stderr, f"{name}: Open MPI output {n!r} in stderr: {p.stderr[:400]!r}")


def expect(name, p, code, out=(), err=(), empty_out=False):
    check(p.returncode == code,
          f"{name}: exit {p.returncode}, expected {code}; stderr {p.stderr[:400]!r}")
    for n in out:
        check(n in p.stdout, f"{name}: {n!r} not in stdout {p.stdout[:400]!r}")
    for n in err:
        check(n in p.stderr, f"{name}: {n!r} not in stderr {p.stderr[:400]!r}")
    if empty_out:
        check(p.stdout == "", f"{name}: output despite the error: {p.stdout[:200]!r}")


def help_and_version(label, env):
    usage = "usage: [mpirun -np N] kqsvd COMMAND [OPTIONS]"
    for args in (["--help"], ["-h"], ["help"], ["help", "a", "b"]):
        p = run(args, env=env, expect=None)
        expect(f"{label}: kqsvd {' '.join(args)}", p, 0, out=[usage, "manifest", "synth"])
        quiet(f"{label}: kqsvd {' '.join(args)}", p)
    p = run([], env=env, expect=None)  # no command: usage on stderr, exit 2, as before
    expect(f"{label}: kqsvd", p, 2, err=[usage], empty_out=True)
    quiet(f"{label}: kqsvd", p)
    p = run(["frobnicate"], env=env, expect=None)
    expect(f"{label}: unknown command", p, 2, err=["kqsvd: error: unknown command 'frobnicate'"],
           empty_out=True)
    quiet(f"{label}: unknown command", p)
    for cmd in COMMANDS:
        for args in (["help", cmd], [cmd, "--help"], [cmd, "-h"],
                     [cmd, "--progress", "off", "--help"]):
            if cmd == "manifest" and len(args) > 2:
                continue  # manifest takes no options but --lists
            p = run(args, env=env, expect=None)
            name = f"{label}: kqsvd {' '.join(args)}"
            expect(name, p, 0, out=["usage:", f"kqsvd {cmd}"])
            quiet(name, p)
    for v in ("--version", "-V", "version"):
        p = run([v], env=env, expect=None)
        expect(f"{label}: kqsvd {v}", p, 0, out=["CUDA module: ", " visible"])
        check(p.stdout.startswith("kqsvd ") and "(data contract version 1)" in p.stdout,
              f"{label}: kqsvd {v}: {p.stdout[:200]!r}")
        quiet(f"{label}: kqsvd {v}", p)


def manifest_cmds(label, env, wd, model, shards):
    set_dir = os.path.dirname(model)
    good = os.path.join(wd, "good.txt")
    with open(good, "w") as f:
        f.write(f"alpha {model} out/alpha.h5 {set_dir}/shard-*.h5 fixed:2\n")
    os.makedirs(os.path.join(wd, "out"), exist_ok=True)
    p = run(["manifest", good], env=env, expect=None)
    expect(f"{label}: manifest", p, 0)
    quiet(f"{label}: manifest", p)
    want = "\t".join(["alpha", model, os.path.join(wd, "out", "alpha.h5"), "fixed:2",
                      str(len(shards)), f"{set_dir}/shard-*.h5", "-", "-"]) + "\n"
    check(p.stdout == want, f"{label}: manifest table {p.stdout!r}, expected {want!r}")
    lists = os.path.join(wd, "lists-" + label.replace(" ", "-"))
    os.makedirs(lists, exist_ok=True)
    p = run(["manifest", good, "--lists", lists], env=env, expect=None)
    expect(f"{label}: manifest --lists", p, 0)
    got = None
    if os.path.exists(os.path.join(lists, "alpha.shards")):
        with open(os.path.join(lists, "alpha.shards"), "rb") as f:
            got = f.read()
    check(got == b"".join(s.encode() + b"\0" for s in shards), f"{label}: alpha.shards {got!r}")

    bad = os.path.join(wd, "bad.txt")
    with open(bad, "w") as f:
        f.write(f"x {model} out/x.h5 {set_dir}/nothing-*.h5\n")
    p = run(["manifest", bad], env=env, expect=None)
    expect(f"{label}: bad manifest", p, 1, empty_out=True,
           err=["kqsvd manifest: error: ", "bad.txt:1: SHARD_GLOB"])
    check(p.stderr.count("\n") == 1, f"{label}: bad manifest: not one line: {p.stderr!r}")
    quiet(f"{label}: bad manifest", p)
    missing = os.path.join(wd, "missing.txt")
    p = run(["manifest", missing], env=env, expect=None)
    expect(f"{label}: missing manifest", p, 1, empty_out=True, err=["missing.txt"])
    check(p.stderr.count("\n") == 1, f"{label}: missing manifest: not one line: {p.stderr!r}")
    quiet(f"{label}: missing manifest", p)
    p = run(["manifest"], env=env, expect=None)
    expect(f"{label}: manifest without arguments", p, 2, empty_out=True,
           err=["kqsvd manifest: error: expected MANIFEST [--lists DIR] "
                "(see kqsvd manifest --help)"])
    quiet(f"{label}: manifest without arguments", p)
    # A launcher's other ranks (each process alone, without MPI) stay silent.
    p = run(["manifest", good], env=dict(env, OMPI_COMM_WORLD_RANK="1"), expect=None)
    expect(f"{label}: manifest as rank 1", p, 0)
    check(p.stdout == "" and p.stderr == "", f"{label}: rank 1 printed {p.stdout!r} {p.stderr!r}")
    return good, want


def nompi():
    wd, model, shards = small_set("nompi", **TINY)
    proj = os.path.join(wd, "proj.h5")
    calibrate(model, proj, shards)  # with MPI, as usual
    for label, env in no_mpi_envs(wd).items():
        help_and_version(label, env)
        good, want = manifest_cmds(label, env, wd, model, shards)
        p = run(["ranks", "--proj", proj, "--ranks", "fixed:2"], env=env, expect=None)
        expect(f"{label}: ranks", p, 0, out=["fixed:2"])
        quiet(f"{label}: ranks", p)
        ref = run(["ranks", "--proj", proj, "--ranks", "fixed:2"])
        check(p.stdout == ref.stdout, f"{label}: ranks differ from a run with MPI at hand")
        p = run(["ranks", "--proj", os.path.join(wd, "nope.h5")], env=env, expect=None)
        expect(f"{label}: ranks of a missing file", p, 1, empty_out=True,
               err=["kqsvd ranks: error: ", "nope.h5"])
        quiet(f"{label}: ranks of a missing file", p)
        # The environment does stop MPI: the commands that need it fail.
        out = os.path.join(wd, "never.h5")
        p = calibrate(model, out, shards, np_=None, env=env, expect=None)  # no mpiexec
        check(p.returncode != 0, f"{label}: calibrate ran without MPI: {p.stdout!r}")
        check("MPI_Init" in p.stderr or "MPI_INIT" in p.stderr,
              f"{label}: calibrate failed, but not in MPI_Init: {p.stderr[-400:]!r}")
        check(not os.path.exists(out), f"{label}: calibrate wrote {out}")
        p = run(["synth", "--out", os.path.join(wd, "never"), "--progress", "off"], env=env,
                expect=None)
        check(p.returncode != 0 and "MPI_Init" in p.stderr, f"{label}: synth ran without MPI")
    # Under a launcher, without MPI, only rank 0 prints.
    p = run(["manifest", good], np_=2)
    check(p.stdout == want, f"mpirun -np 2 kqsvd manifest: {p.stdout!r}")
    finish("nompi")


# ---- the CUDA module loader ---------------------------------------------------

def abi_version():
    header = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "gpu",
                          "kqsvd_gpu.h")
    with open(header) as f:
        return int(re.search(r"#define KQSVD_GPU_ABI_VERSION (\d+)u", f.read()).group(1))


def gpu_abi():
    fakes = os.environ.get("KQSVD_TEST_GPU_FAKES", "")
    other, empty = (os.path.join(fakes, f"libkqsvd_fake_gpu_{n}.so") for n in ("abi", "empty"))
    if not (os.path.exists(other) and os.path.exists(empty)):
        raise SystemExit(f"gpu_abi: the stand-in modules are not built in {fakes!r}")
    n = abi_version()
    mismatch = (f"the CUDA module {other} has ABI version {n + 1}, this kqsvd needs version {n}: "
                f"build the two together")
    no_table = (f"the CUDA module {empty} exports no kqsvd_gpu_module_table: it is not a kqsvd "
                f"CUDA module, or one of ABI version 1")
    hook = {"KQSVD_TEST_GPU_LOADER": "1"}
    for module, needle in ((other, mismatch), (empty, no_table)):
        p = run(["--version"], env=dict(hook, KQSVD_GPU_MODULE=module))
        check(f"CUDA module: {module}; " in p.stdout and f"  not usable: {needle}" in p.stdout,
              f"--version with {os.path.basename(module)}: {p.stdout!r}")

    wd, model, shards = small_set("gpu_abi", **TINY)
    ref = os.path.join(wd, "cpu.h5")
    calibrate(model, ref, shards, extra=["--device", "cpu"])
    for module, needle in ((other, mismatch), (empty, no_table)):
        env = dict(hook, KQSVD_GPU_MODULE=module)
        base = os.path.basename(module)
        out = os.path.join(wd, f"auto-{base}.h5")
        p = calibrate(model, out, shards, extra=["--device", "auto"], env=env, expect=None)
        check(p.returncode == 0, f"--device auto with {base}: exit {p.returncode}: {p.stderr!r}")
        check("kqsvd calibrate: warning: GPU present but not usable, using the CPU: " + needle
              in p.stderr, f"--device auto with {base}: {p.stderr!r}")
        if os.path.exists(out):
            worst, where = max_rel_diff(load_proj(ref), load_proj(out))
            check(worst == 0.0, f"--device auto with {base}: differs from --device cpu at {where}")
        out = os.path.join(wd, f"cuda-{base}.h5")
        p = calibrate(model, out, shards, np_=2, extra=["--device", "cuda"], env=env, expect=None)
        check(p.returncode == 1, f"--device cuda with {base}: exit {p.returncode}: {p.stderr!r}")
        check(p.stderr.count("kqsvd calibrate: error: " + needle) == 1,
              f"--device cuda with {base}: not one message: {p.stderr!r}")
        check(not os.path.exists(out), f"--device cuda with {base}: wrote {out}")
    # A missing module, as before: auto quietly uses the CPU, cuda names it.
    gone = os.path.join(wd, "nowhere", "libkqsvd_gpu.so")
    env = dict(hook, KQSVD_GPU_MODULE=gone)
    p = calibrate(model, os.path.join(wd, "auto-gone.h5"), shards, extra=["--device", "auto"],
                  env=env, expect=None)
    check(p.returncode == 0 and "warning" not in p.stderr, f"auto, no module: {p.stderr!r}")
    p = calibrate(model, os.path.join(wd, "cuda-gone.h5"), shards, extra=["--device", "cuda"],
                  env=env, expect=None)
    check(p.returncode == 1 and f"cannot load the CUDA module {gone}: " in p.stderr,
          f"cuda, no module: {p.stderr!r}")

    # The real module, where built: its table has this kqsvd's version, and
    # it exports nothing else (its functions and its copy of the core are
    # reached through the table only).
    real = os.path.join(os.path.dirname(KQSVD), "libkqsvd_gpu.so")
    if os.path.exists(real):
        p = run(["--version"], env=dict(hook, KQSVD_GPU_MODULE=real))
        check(f"KQSVD_TEST_GPU_LOADER=1: the CUDA module {real} (ABI version {n}) was checked "
              "and is not used" in p.stdout, f"--version with the real module: {p.stdout!r}")
        lib = ctypes.CDLL(real, mode=os.RTLD_LOCAL)
        check(hasattr(lib, "kqsvd_gpu_module_table"), "the module lacks kqsvd_gpu_module_table")
        for name in ("kqsvd_gpu_fold_init", "kqsvd_gpu_describe", "kqsvd_error_set"):
            check(not hasattr(lib, name), f"the module exports {name}")
    else:
        print(f"gpu_abi: no CUDA module at {real}: the real module's table is not checked")
    finish("gpu_abi")
