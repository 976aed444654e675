"""Running kqsvd: the sanitizer and MPI environment of every run, the
command line (under mpirun for more than one rank), a run in its own
session killed as a group on timeout, and the setup runs that must succeed."""
import os
import shlex
import signal
import subprocess
import sys
import time

# The repository (this file is tests/fuzz/runner.py).
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SAN_DEFAULTS = {
    "ASAN_OPTIONS": (
        "exitcode=86:detect_leaks=1:fast_unwind_on_malloc=0:check_initialization_order=1"
        ":intercept_tls_get_addr=0"  # see tests/sanitize.sh
    ),
    "UBSAN_OPTIONS": "exitcode=86:halt_on_error=1:print_stacktrace=1",
    "LSAN_OPTIONS": f"suppressions={ROOT}/tests/lsan.supp:print_suppressions=0",
}


class Ctx:
    """Paths and settings shared by every mutant."""

    def __init__(self, a):
        self.kqsvd = os.path.abspath(a.kqsvd)
        self.mpiexec = a.mpiexec
        self.preflags = shlex.split(os.environ.get("KQSVD_MPIEXEC_PREFLAGS", "--oversubscribe"))
        self.timeout = a.timeout
        self.work = os.path.abspath(a.work)
        self.base = os.path.join(self.work, "base")
        self.seed = a.seed
        self.keep = a.keep


def run_env(extra=None, san_dir=None):
    e = dict(os.environ)
    for k, v in SAN_DEFAULTS.items():  # the caller's settings after the defaults win
        e[k] = f"{v}:{e[k]}" if e.get(k) else v
    if san_dir:
        e["ASAN_OPTIONS"] += f":log_path={san_dir}/asan"
        e["UBSAN_OPTIONS"] += f":log_path={san_dir}/ubsan"
    e.setdefault("OPENBLAS_NUM_THREADS", "1")
    # kqsvd reads each file's headers first in a child process, which it ends
    # when libhdf5 loops on a damaged file (io/isolate.c): here after 5 s,
    # well within the timeout.
    e.setdefault("KQSVD_HEADER_TIMEOUT", "5")
    e.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
    if os.getuid() == 0:
        e.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        e.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    e.update(extra or {})
    return e


def command(ctx, args, np_):
    cmd = [ctx.kqsvd] + [str(a) for a in args]
    if np_ > 1:
        cmd = [ctx.mpiexec, "-n", str(np_)] + ctx.preflags + cmd
    return cmd


def execute(ctx, cmd, env, timeout, cwd=None):
    """Runs cmd in its own session; on timeout kills the whole group."""
    t0 = time.time()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=cwd,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        timed_out = True
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = p.communicate()
    # Whatever the run left in its group (an orphaned orted, a rank) goes too.
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    return (p.returncode, out.decode(errors="replace"), err.decode(errors="replace"),
            time.time() - t0, timed_out)


def must(ctx, args, np_=1, env=None, expect=0):
    cmd = command(ctx, args, np_)
    rc, out, err, _, to = execute(ctx, cmd, run_env(env), 300)
    if to or (expect is not None and rc != expect):
        sys.exit(f"fuzz_readers: setup failed ({'timeout' if to else f'exit {rc}'}): "
                 f"{shlex.join(cmd)}\n{out}{err}")
    return rc, out, err
