"""Fault injection for the tests, through one documented environment
hook: KQSVD_TEST_FAULT=WHERE:WHAT makes rank 0 of an in-situ calibration
(python -m kqsvd.calibrate_hf) meet WHAT at WHERE; without it nothing
happens.

    WHERE   window-N  once its N-th window is folded (and checkpointed)
            fold      once its last window is folded
            write     once the output is written under its temporary
                      name, before the rename
    WHAT    kill      SIGKILL: a crash, nothing cleaned up
            SIGINT, SIGTERM, SIGUSR1
                      that signal, as Ctrl-C, kill, SLURM or mpirun send it
            fail      a KqsvdError, as a full disk or a lost mount raise

The run calls at() at each of those points, so that the tests reach every
moment a real fault can come at without a test double in the product."""
import os
import signal

from ..errors import KqsvdError

VAR = "KQSVD_TEST_FAULT"


def at(where, rank):
    """Meets the fault KQSVD_TEST_FAULT names for `where` on rank 0."""
    spec = os.environ.get(VAR, "")
    point, _, what = spec.partition(":")
    if rank != 0 or point != where:
        return
    if what == "fail":
        raise KqsvdError(f"a fault injected at '{where}' ({VAR})")
    sig = signal.SIGKILL if what == "kill" else getattr(signal.Signals, what, None)
    if sig is None:
        raise KqsvdError(f"{VAR}={spec}: expected WHERE:kill, WHERE:fail or WHERE:SIGNAME")
    os.kill(os.getpid(), sig)
