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

Any other WHERE or WHAT is refused in one line before the run starts
(check()).  The run calls at() at each of those points, so that the tests
reach every moment a real fault can come at without a test double in the
product."""
import os
import re
import signal

from ..errors import KqsvdError, UsageError

VAR = "KQSVD_TEST_FAULT"
# The documented actions, and only these: a stop (SIGSTOP) would hang a
# test until it is killed, and a SIGSEGV is no fault a run meets.
SIGNALS = {"kill": signal.SIGKILL, "SIGINT": signal.SIGINT, "SIGTERM": signal.SIGTERM,
           "SIGUSR1": signal.SIGUSR1}
ACTIONS = ("fail",) + tuple(SIGNALS)
POINT = re.compile(r"window-[1-9][0-9]*|fold|write")


def check():
    """The hook's value (WHERE, WHAT), None when unset; UsageError, one
    line, for any other WHERE or WHAT than the documented ones.  The
    command calls it with its options, before any work."""
    spec = os.environ.get(VAR, "")
    if not spec:
        return None
    point, _, what = spec.partition(":")
    if not POINT.fullmatch(point) or what not in ACTIONS:
        raise UsageError(f"{VAR}={spec}: expected WHERE:WHAT, WHERE one of window-N, fold, write "
                         f"and WHAT one of {', '.join(ACTIONS)}")
    return point, what


def at(where, rank):
    """Meets the fault KQSVD_TEST_FAULT names for `where` on rank 0."""
    got = check()
    if rank != 0 or got is None or got[0] != where:
        return
    if got[1] == "fail":
        raise KqsvdError(f"a fault injected at '{where}' ({VAR})")
    os.kill(os.getpid(), SIGNALS[got[1]])
