"""The in-situ calibration's checkpoints: each rank's factors saved as it
goes, so that the same command run again after an interruption (a signal,
a crash, a job's time limit) folds only what is left and ends with the
same file.  What a checkpoint was made from is named by the identities of
its inputs (file_identity) and every option that changes a number.

The folder may hold other files (the run's own --text, a user's backup):
the run touches only the names it writes, and refuses an index naming
anything else.  One run at a time uses a folder (a lock, see lock())."""
import dataclasses
import fcntl
import hashlib
import json
import os
import re
import stat

from ..errors import KqsvdError
from ..formats.files import said_of, write_atomic


def file_identity(path):
    """What says a file is the same one: its real path, size and time."""
    h = hashlib.sha256()
    for root, _dirs, files in (os.walk(path) if os.path.isdir(path) else [("", [], [path])]):
        for f in sorted(files):
            p = os.path.join(root, f)
            st = os.stat(p)
            h.update(f"{os.path.realpath(p)}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


@dataclasses.dataclass
class Share:
    """What a rank's checkpoint must agree with: its `windows` (of
    `seq_len` tokens each) and the rows of a factor's R (`snapshot_rows`,
    the tokens a snapshot of the fold on the device holds)."""
    windows: int
    seq_len: int
    snapshot_rows: int


class Checkpoint:
    """One rank's progress in DIR: the accumulator's factors (the C
    library's checkpoint format) in STEM-NNNNNN.h5 after NNNNNN windows,
    and STEM.json (STEM = rank-R-of-P) naming the current one with the
    inputs' hash.  The JSON is replaced after the new state is complete,
    and the old state is removed after that, so a crash at any point
    leaves a consistent pair."""

    FIELDS = ("inputs", "done", "state")

    def __init__(self, folder, rank, size, inputs, share):
        self.folder, self.inputs, self.share = folder, inputs, share
        self.stem = f"rank-{rank}-of-{size}"
        self.index = os.path.join(folder, self.stem + ".json")
        self.current = None
        self._lock = None
        # The names a save makes: states, the C library's temporary names
        # of them (.tmp-PID-N), the index's (mkstemp's .NAME.XXXXXXXX.tmp).
        s = re.escape(self.stem)
        self._ours = re.compile(rf"{s}\.json|{s}-\d{{6}}\.h5(\.tmp-\d+-\d+)?|"
                                rf"\.{s}\.json\.[a-z0-9_]{{8}}\.tmp")

    def state_name(self, done):
        return f"{self.stem}-{done:06d}.h5"

    def lock(self, label):
        """Takes the folder for this run (an flock on the folder itself,
        released when the process ends, however it ends): a second run
        in the same folder would resume from the first's partial state and
        remove the files the first goes on with.  Rank 0 takes it for all
        the run's ranks.  KqsvdError, one line, when another run holds it."""
        fd = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise KqsvdError(f"{label} {self.folder} is in use by another run of "
                             "calibrate_hf; wait for it to end or give another folder") from None
        self._lock = fd

    def _bad(self, field, why):
        return KqsvdError(f"{self.index}: field '{field}' {why}; remove the index or the folder")

    def _read(self):
        """The index's fields, each checked against the names and the
        share of this run: (done, state)."""
        if not os.path.isfile(self.index):  # a FIFO would block open() forever
            raise KqsvdError(f"{self.index}: not a calibrate_hf checkpoint (not a regular "
                             "file); remove it")
        try:
            with open(self.index) as f:
                saved = json.load(f)
        except (OSError, ValueError) as e:
            raise KqsvdError(f"{self.index}: not a calibrate_hf checkpoint ({e}); "
                             "remove it") from None
        if not isinstance(saved, dict) or sorted(saved) != sorted(self.FIELDS):
            got = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
            raise KqsvdError(f"{self.index}: not a calibrate_hf checkpoint (expected the fields "
                             f"{', '.join(self.FIELDS)}, found {got}); remove it")
        if saved["inputs"] != self.inputs:
            raise KqsvdError(f"{self.index}: field 'inputs' differs: the checkpoint is from other "
                             "inputs or options (model, text, --seq-len, --num-seqs, --dtype, --no-bos, "
                             "--keys, --qr-block or rank count); remove the folder or use another")
        done, state, n = saved["done"], saved["state"], self.share.windows
        if type(done) is not int or not 1 <= done <= n:
            raise self._bad("done", f"= {done!r}: this rank folds {n} window"
                            f"{'s' if n != 1 else ''}, so 1 to {n}")
        if not isinstance(state, str) or os.path.basename(state) != state or \
                state in ("", ".", ".."):
            raise self._bad("state", f"= {state!r} is not a plain file name inside the folder")
        if state != self.state_name(done):
            raise self._bad("state", f"= {state!r} is not this rank's state after {done} windows "
                            f"({self.state_name(done)})")
        path = os.path.join(self.folder, state)
        try:
            st = os.lstat(path)
        except OSError as e:
            raise self._bad("state", f"names {state}, which cannot be read: {e.strerror}") from None
        if not stat.S_ISREG(st.st_mode):
            raise self._bad("state", f"names {state}, which is not a regular file")
        return done, state

    def resume(self, cal):
        """Loads the saved factors into cal; returns the windows done."""
        if not os.path.lexists(self.index):
            return 0
        done, state = self._read()
        cal.load(os.path.join(self.folder, state))
        tokens, want = cal.tokens(), done * self.share.seq_len
        if tokens not in (want, self.share.snapshot_rows):
            raise self._bad("done", f"= {done} disagrees with {state}, which holds {tokens} "
                            f"tokens, not {done} x {self.share.seq_len}")
        self.current = state
        return done

    def save(self, cal, done):
        """Saves cal's factors after `done` windows, then names them in
        the index, then removes the state before: consistent at every step."""
        state = self.state_name(done)
        path = os.path.join(self.folder, state)
        try:
            cal.save(path, force=True)  # a state this rank wrote before an interruption
        except KqsvdError as e:
            raise said_of(e, path) from None

        def write(tmp):
            with open(tmp, "w") as f:
                json.dump({"inputs": self.inputs, "done": done, "state": state}, f)
        try:
            write_atomic(self.index, write, force=True)  # its own, of the save before
        except KqsvdError:
            if state != self.current:  # named by no index: the folder as it was
                os.remove(path)
            raise
        if self.current and self.current != state:
            os.remove(os.path.join(self.folder, self.current))
        self.current = state

    def remove(self):
        """This rank's files, by the names a save makes (an interrupted
        save's temporary ones too); nothing else in the folder.  Releases
        the lock."""
        for f in os.listdir(self.folder):
            if self._ours.fullmatch(f):
                os.remove(os.path.join(self.folder, f))
        self.release()

    def release(self):
        """Gives the folder back (lock()); a process that ends does too."""
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None
