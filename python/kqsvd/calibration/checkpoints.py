"""The in-situ calibration's checkpoints: each rank's factors saved as it
goes, so that the same command run again after an interruption (a signal,
a crash, a job's time limit) folds only what is left and ends with the
same file.  What a checkpoint was made from is named by the identities of
its inputs (file_identity) and every option that changes a number."""
import hashlib
import json
import os

from ..errors import KqsvdError
from ..formats.files import write_atomic


def file_identity(path):
    """What says a file is the same one: its real path, size and time."""
    h = hashlib.sha256()
    for root, _dirs, files in (os.walk(path) if os.path.isdir(path) else [("", [], [path])]):
        for f in sorted(files):
            p = os.path.join(root, f)
            st = os.stat(p)
            h.update(f"{os.path.realpath(p)}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


class Checkpoint:
    """One rank's progress in DIR: the accumulator's factors (the C
    library's checkpoint format) in STATE-NNNNNN.h5 after NNNNNN sequences,
    and rank-R-of-P.json naming the current one with the inputs' hash.  The
    JSON is replaced after the new state is complete, and the old state is
    removed after that, so a crash at any point leaves a consistent pair."""

    def __init__(self, folder, rank, size, inputs):
        self.folder, self.inputs = folder, inputs
        self.stem = f"rank-{rank}-of-{size}"
        self.index = os.path.join(folder, self.stem + ".json")
        self.current = None

    def resume(self, cal):
        """Loads the saved factors into cal; returns the sequences done."""
        if not os.path.exists(self.index):
            return 0
        try:
            with open(self.index) as f:
                saved = json.load(f)
            done, state = int(saved["done"]), saved["state"]
            inputs = saved["inputs"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise KqsvdError(f"{self.index}: not a calibrate_hf checkpoint ({e}); remove it") from None
        if inputs != self.inputs:
            raise KqsvdError(f"{self.index}: field 'inputs' differs: the checkpoint is from other "
                             "inputs or options (model, text, --seq-len, --num-seqs, --dtype, --no-bos, "
                             "--keys, --qr-block or rank count); remove the folder or use another")
        cal.load(os.path.join(self.folder, state))
        self.current = state
        return done

    def save(self, cal, done):
        """Saves cal's factors after `done` sequences, then names them in
        the index, then removes the state before: consistent at every step."""
        state = f"{self.stem}-{done:06d}.h5"
        path = os.path.join(self.folder, state)
        cal.save(path, force=True)  # a state this rank wrote before an interruption

        def write(tmp):
            with open(tmp, "w") as f:
                json.dump({"inputs": self.inputs, "done": done, "state": state}, f)
        write_atomic(self.index, write, force=True)  # its own, of the save before
        if self.current and self.current != state:
            os.remove(os.path.join(self.folder, self.current))
        self.current = state

    def remove(self):
        """Every file of this rank's, a crashed save's temporary one too."""
        for f in os.listdir(self.folder):
            if f.startswith(self.stem):
                os.remove(os.path.join(self.folder, f))
