"""The processes of one in-situ calibration and what they agree on: every
collective the run makes (MPI agreement on failures, work on rank 0 alone,
sums, the signal check) is here, so that no rank ever waits in one for a
rank that left (calibrate_hf under mpirun, slurm/calibrate_hf.sbatch).

One process without an MPI launcher needs no MPI at all: a laptop or a
login node runs the same code with `comm` None."""
import os
import signal

from ..errors import KqsvdError, UsageError


class Stopped(Exception):
    """A signal reached a rank: every rank stops together (exit 75, as
    `kqsvd calibrate`); str() says what was kept."""


class Group:
    """The run's ranks: mpi4py's COMM_WORLD when an MPI launcher started
    the process, else this process alone (comm None).  log(): printed by
    rank 0 only."""

    def __init__(self, log=None):
        launched = any(os.environ.get(v) for v in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE",
                                                   "PMIX_RANK"))
        self.comm = None
        if launched:
            try:
                from mpi4py import MPI
            except ImportError:
                raise UsageError("started by mpirun, but mpi4py is missing (Debian: apt-get "
                                 "install python3-mpi4py)") from None
            self.comm = MPI.COMM_WORLD
        self.rank, self.size = (self.comm.Get_rank(), self.comm.Get_size()) if self.comm else (0, 1)
        self._log = log

    def log(self, msg):
        if self.rank == 0 and self._log:
            self._log(msg)

    def agree(self, error):
        """Collective: every rank learns whether any failed.  The first
        failing rank raises its error (printed once, by it); the others
        exit with the same code, quietly (SystemExit), so that no rank
        waits for another in a later collective."""
        if self.comm is None:
            if error:
                raise error
            return
        code = 0 if error is None else (2 if isinstance(error, UsageError) else 1)
        codes = self.comm.allgather(code)
        failed = [r for r, c in enumerate(codes) if c]
        if not failed:
            return
        if self.rank == failed[0]:
            raise error
        raise SystemExit(codes[failed[0]])

    def each(self, work):
        """Collective: work() on every rank, then agree on its failures
        (KqsvdError, OSError); returns its result."""
        err = out = None
        try:
            out = work()
        except (KqsvdError, OSError) as e:
            err = e
        self.agree(err)
        return out

    def on_root(self, work):
        """Collective: work() on rank 0 alone, then agree; returns what it
        returned on rank 0, None elsewhere."""
        return self.each(work if self.rank == 0 else lambda: None)

    def sum(self, x):
        return self.comm.allreduce(x) if self.comm else x

    def bcast(self, x):
        return self.comm.bcast(x, root=0) if self.comm else x

    def barrier(self):
        if self.comm:
            self.comm.Barrier()

    def most(self, x):
        if self.comm is None:
            return x
        from mpi4py import MPI
        return self.comm.allreduce(x, op=MPI.MAX)


class Signals:
    """SIGTERM, SIGUSR1 and SIGINT noted, not acted on at once: the run
    stops where every rank can agree (SLURM sends one before a time limit,
    mpirun forwards SIGUSR1 to every rank)."""
    NAMES = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

    def __init__(self):
        self.hit = 0
        for s in self.NAMES:
            signal.signal(s, self._note)

    def _note(self, num, _frame):
        self.hit = num

    def check(self, group, kept):
        """Collective: raises Stopped on every rank when a signal reached
        any; kept says what remains (checkpoints or nothing)."""
        hit = group.most(self.hit)
        if hit:
            raise Stopped(f"stopped by signal {hit}: {kept}")
