"""Bad input to the in-situ calibration (python -m kqsvd.calibrate_hf) and
its checkpoint folder, as test_hostile.py gives it to the other commands:
the exit status, one stderr line naming the option, nothing made (not
even the checkpoint folder) and the inputs unchanged.  A policy, a
--head-groups or a --seq-len the model cannot take is refused from the
model's header, before its weights load.  The checkpoint folder's other
files, an edited index, a second run in the folder, an output made while
the run works and a full disk: CheckpointFolder (issue 61)."""
import contextlib
import fcntl
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import unittest
from unittest import mock

from common import MPIENV, ROOT
from test_hostile import HostileCase, digest, listing

from kqsvd.commands import calibrate_hf

NO_LOAD = mock.patch("kqsvd.models.load", side_effect=AssertionError("the model was loaded"))


class HostileCalibrate(HostileCase):
    WORK = "hostile-calibrate"

    def calib(self, out, *extra):
        return ["--model", self.model, "--text", self.text, "--seq-len", "16", "--num-seqs", "2",
                "--out", out, *extra]

    def refused(self, argv, code, *words, leaves=()):
        before = set(listing(self.out)) | set(leaves)
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()), NO_LOAD:
            try:
                got = calibrate_hf.main(argv)
            except SystemExit as e:
                got = e.code
        return self.one_error(code, got, err.getvalue(), words, before)

    def test_options_the_model_refuses_make_nothing(self):
        """The checkpoint folder is made only once every option passed:
        none of these leaves an empty one, and none loads the model."""
        out, ck = os.path.join(self.out, "c.h5"), os.path.join(self.out, "new", "ck")
        for extra, words in ((["--ranks", "bogus:1"], ("bogus:1",)),
                             (["--ranks", "fixed:999"], ("fixed:999", "head_dim")),
                             (["--head-groups", "3"], ("--head-groups 3", "divide")),
                             (["--seq-len", "100000"], ("--seq-len 100000",
                                                        "max_position_embeddings"))):
            self.refused(self.calib(out, "--checkpoint", ck, *extra), 2, *words)
            self.assertFalse(os.path.exists(os.path.dirname(ck)), f"{extra}: made {ck}")

    def test_an_output_inside_the_checkpoint_folder(self):
        """The run deletes its checkpoint files at its end: an output in
        that folder, at its top or deeper, or named like one of them, is
        refused before any work."""
        ck = os.path.join(self.out, "ck")
        os.makedirs(os.path.join(ck, "deep"))
        for out in ("x.h5", "rank-0-of-1-000001.h5", os.path.join("deep", "x.h5")):
            for force in ([], ["--force"]):
                self.refused(self.calib(os.path.join(ck, out), "--checkpoint", ck, *force), 2,
                             "--out", "inside --checkpoint", leaves=["ck"])
        self.refused(self.calib(ck, "--checkpoint", ck), 2, "--out", leaves=["ck"])
        self.assertEqual(os.listdir(ck), ["deep"])

    def test_a_name_too_long_for_its_temporary_names(self):
        """An output is written under longer names first (the staged name,
        then the C library's suffix): a name with no room for them is
        refused before the model loads, not by the write after the run."""
        for n, ok in ((221, True), (222, False)):
            out = os.path.join(self.out, "p" * (n - 3) + ".h5")
            if ok:
                from kqsvd.formats.files import check_outputs
                check_outputs([("--out", out)])
                continue
            self.refused(self.calib(out), 2, "--out", f"is {n} bytes long", "at most 221")

    def test_policy_errors_name_the_option(self):
        """--ranks and --eps refused in the user's words, not the library
        call's (finish(ranks=..., beta=...))."""
        out = os.path.join(self.out, "c.h5")
        for extra, words in ((["--ranks", "fixed:32@4"], ("--ranks fixed:32@4", "'32@4'")),
                             (["--ranks", "fixed:999"], ("--ranks fixed:999", "head_dim")),
                             (["--eps", "1.5"], ("--eps 1.5", "(0, 1)"))):
            line = self.refused(self.calib(out, *extra), 2, *words)
            self.assertNotIn("finish(", line)
            self.assertNotIn("ranks '", line)

    def test_fault_hook_takes_only_its_actions(self):
        """KQSVD_TEST_FAULT names a documented point and action, or the run
        is refused before any work: a SIGSTOP would hang it, a SIGSEGV
        crash it."""
        out = os.path.join(self.out, "c.h5")
        for spec in ("fold:SIGSTOP", "fold:SIGSEGV", "fold:SIGKILL", "fold:bogus", "fold",
                     "nowhere:kill", "window-0:kill", "window-x:fail"):
            with mock.patch.dict(os.environ, {"KQSVD_TEST_FAULT": spec}):
                self.refused(self.calib(out), 2, f"KQSVD_TEST_FAULT={spec}", "window-N",
                             "SIGUSR1")

    def test_a_checkpoint_folder_that_takes_no_file(self):
        ro = os.path.join(self.out, "ro")
        os.makedirs(ro)
        os.chmod(ro, 0o555)
        try:
            for ck in (ro, os.path.join(ro, "ck")):
                self.refused(self.calib(os.path.join(self.out, "c.h5"), "--checkpoint", ck), 2,
                             "--checkpoint", "read-only", leaves=["ro"])
            self.assertEqual(os.listdir(ro), [])
        finally:
            os.chmod(ro, 0o755)


class CheckpointFolder(HostileCase):
    """The checkpoint folder and the output of whole in-process runs (4
    windows of 16 tokens): the run removes only the files it wrote, refuses
    an index that names anything but its own state after `done` windows,
    one run at a time, and never replaces an output that appeared while it
    worked (issue 61, items 1 to 5)."""
    WORK = "hostile-ckpt"

    def setUp(self):
        super().setUp()
        self.ck = os.path.join(self.out, "ck")
        self.dest = os.path.join(self.out, "c.h5")

    def calib(self, *extra, out=None, text=None):
        return ["--model", self.model, "--text", text or self.text, "--seq-len", "16",
                "--num-seqs", "4", "--out", out or self.dest, "--checkpoint", self.ck,
                "--checkpoint-every", "0", *extra]

    def main(self, argv, fault=None, at=None):
        """calibrate_hf.main(argv) here: (exit status, stderr), the signal
        handlers it sets given back; fault: KQSVD_TEST_FAULT; at: stands in
        for faults.at."""
        err, handlers = io.StringIO(), {s: signal.getsignal(s) for s in
                                        (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
        env = {"KQSVD_TEST_FAULT": fault} if fault else {}
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()), \
                mock.patch.dict(os.environ, env), \
                (mock.patch("kqsvd.calibration.faults.at", at) if at else contextlib.nullcontext()):
            try:
                code = calibrate_hf.main(argv)
            except SystemExit as e:
                code = e.code
            finally:
                for s, h in handlers.items():
                    signal.signal(s, h)
        # the progress lines of the windows folded before the error
        return code, "".join(ln for ln in err.getvalue().splitlines(True)
                             if not re.match(r"calibrate_hf: \d+/\d+ tok", ln))

    def cut(self, n=2, **kw):
        """A run stopped by a failure after n windows: its checkpoint kept."""
        code, err = self.main(self.calib(**kw), fault=f"window-{n}:fail")
        self.assertEqual(code, 1, err)
        with open(os.path.join(self.ck, "rank-0-of-1.json")) as f:
            return json.load(f)

    def refused(self, argv, *words, code=1):
        before = set(listing(self.out))
        got, err = self.main(argv)
        return self.one_error(code, got, err, words, before)

    def test_only_its_own_files_go(self):
        """The run's --text and a user's file in the folder, named like the
        run's files, are there after a cut and a resumed run as before."""
        os.makedirs(self.ck)
        notes, backup = (os.path.join(self.ck, f) for f in ("rank-0-of-1-notes.txt",
                                                             "rank-0-of-1-backup.h5"))
        shutil.copyfile(self.text, notes)
        shutil.copyfile(self.proj, backup)
        kept = {p: digest(p) for p in (notes, backup)}
        self.cut(text=notes)
        code, err = self.main(self.calib(text=notes))
        self.assertEqual(code, 0, err)
        self.assertIn("resuming: 2 of 4", err)
        self.assertEqual({p: digest(p) for p in kept}, kept)
        self.assertEqual(listing(self.ck), ["rank-0-of-1-backup.h5", "rank-0-of-1-notes.txt"])

    def edit(self, saved, **fields):
        with open(os.path.join(self.ck, "rank-0-of-1.json"), "w") as f:
            json.dump(dict(saved, **fields), f)

    def test_an_index_naming_a_file_outside_its_folder(self):
        saved = self.cut()
        victim = os.path.join(self.out, "victim.h5")
        shutil.copyfile(os.path.join(self.ck, saved["state"]), victim)
        os.makedirs(os.path.join(self.ck, "sub"))
        shutil.copyfile(victim, os.path.join(self.ck, "sub", saved["state"]))
        want = digest(victim)
        for state in ("../victim.h5", victim, f"sub/{saved['state']}", "", ".", ".."):
            self.edit(saved, state=state)
            self.refused(self.calib(), "rank-0-of-1.json", "field 'state'",
                         "plain file name inside the folder")
            self.assertEqual(digest(victim), want)
        self.assertTrue(os.path.exists(os.path.join(self.ck, "sub", saved["state"])))

    def test_an_edited_index(self):
        """Every field checked against this rank's share, the state's name
        and the tokens the state holds; the index as saved resumes."""
        saved = self.cut()
        state = os.path.join(self.ck, saved["state"])
        for fields, words in (({"done": 999}, ("field 'done'", "999", "1 to 4")),
                              ({"done": -1}, ("field 'done'", "-1")),
                              ({"done": 0}, ("field 'done'", "= 0")),
                              ({"done": True}, ("field 'done'", "True")),
                              ({"done": "2"}, ("field 'done'", "'2'")),
                              ({"done": 2.0}, ("field 'done'", "2.0")),
                              ({"done": 3}, ("field 'state'", "after 3 windows")),
                              ({"state": "rank-0-of-1-000003.h5"}, ("field 'state'",)),
                              ({"inputs": "x"}, ("field 'inputs' differs",)),
                              ({"extra": 1}, ("fields", "extra"))):
            self.edit(saved, **fields)
            self.refused(self.calib(), "rank-0-of-1.json", *words)
        # A consistent index and name over a state of 2 windows: its tokens tell.
        os.rename(state, state.replace("000002", "000003"))
        self.edit(saved, done=3, state="rank-0-of-1-000003.h5")
        self.refused(self.calib(), "field 'done'", "holds 32 tokens, not 3 x 16")
        os.rename(state.replace("000002", "000003"), state)
        self.edit(saved)
        code, err = self.main(self.calib())
        self.assertEqual(code, 0, err)
        self.assertIn("resuming: 2 of 4", err)

    def test_one_run_per_folder(self):
        """A second run in the folder of one still working (here this
        process holding the folder's lock as a run does) is refused in
        one line, the first one's files untouched."""
        saved = self.cut()
        before = {f: digest(os.path.join(self.ck, f)) for f in listing(self.ck)}
        fd = os.open(self.ck, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            self.refused(self.calib(), "--checkpoint", self.ck, "in use by another run")
            self.assertEqual({f: digest(os.path.join(self.ck, f)) for f in listing(self.ck)},
                             before)
        finally:
            os.close(fd)
        code, err = self.main(self.calib())
        self.assertEqual(code, 0, err)
        self.assertIn(f"resuming: {saved['done']} of 4", err)

    def test_an_index_that_is_a_fifo(self):
        """A FIFO where the index lies is refused in one line (open() of it
        waited for a writer forever), and left where it is."""
        os.makedirs(self.ck)
        os.mkfifo(os.path.join(self.ck, "rank-0-of-1.json"))
        self.refused(self.calib(), "rank-0-of-1.json", "not a regular file")

    def test_a_refused_run_leaves_the_folder_of_the_one_that_holds_it(self):
        """Two runs that both found --checkpoint missing both made it: the
        one refused the lock leaves the folder to the other, whose first
        save would fail without it (it removed it, as a folder it made)."""
        from kqsvd.calibration.checkpoints import Checkpoint
        real, held = Checkpoint.lock, []

        def other_run_first(ckpt, label):
            fd = os.open(ckpt.folder, os.O_RDONLY)  # the other run takes the folder just before
            fcntl.flock(fd, fcntl.LOCK_EX)
            held.append(fd)
            return real(ckpt, label)
        self.assertFalse(os.path.exists(self.ck))
        try:
            with mock.patch.object(Checkpoint, "lock", other_run_first):
                code, err = self.main(self.calib())
            lines = [x for x in err.splitlines() if "in use by another run" in x]
            self.assertNotEqual(code, 0, err)
            self.assertEqual(len(lines), 1, err)
            self.assertNotIn("Traceback", err)
            self.assertTrue(os.path.isdir(self.ck), "the other run's folder was removed")
        finally:
            for fd in held:
                os.close(fd)

    def test_an_output_made_while_the_run_works(self):
        """A file created at --out while the run works (another run of the
        same command finishing first) is kept without --force, with one
        line; with --force it is replaced."""
        def theirs(where, rank):
            if where == "write":
                with open(self.dest, "w") as f:
                    f.write("theirs")
        for force in ([], ["--force"]):
            if os.path.exists(self.dest):
                os.remove(self.dest)
            code, err = self.main(self.calib(*force), at=theirs)
            if not force:
                line = self.one_error(1, code, err, (self.dest, "appeared while the run worked",
                                                     "--force"), {"c.h5", "ck"})
                self.assertNotIn(".tmp", line)
                with open(self.dest) as f:
                    self.assertEqual(f.read(), "theirs")
            else:
                self.assertEqual(code, 0, err)
                with open(self.dest, "rb") as f:
                    self.assertEqual(f.read(4), b"\x89HDF")
            self.assertEqual(sorted(listing(self.out)), ["c.h5", "ck"])

    @unittest.skipUnless(os.geteuid() == 0, "a small tmpfs needs root")
    def test_a_full_disk(self):
        """A full disk under --checkpoint or --out: one line "no space left
        on device" naming the file, exit 1, no HDF5 noise, no crash, and
        nothing left on it: no temporary file, no folder the run made."""
        tiny = os.path.join(self.out, "tiny")
        os.makedirs(tiny)
        for size, out, ck in (("16k", self.dest, os.path.join(tiny, "new", "ck")),
                              ("16k", os.path.join(tiny, "p.h5"), None),
                              ("100k", os.path.join(tiny, "p.h5"), None)):
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", tiny],
                           check=True)
            try:
                argv = self.calib(out=out)[:-4] + (["--checkpoint", ck] if ck else [])
                p = subprocess.run([sys.executable, "-m", "kqsvd.calibrate_hf"] + argv,
                                   capture_output=True, text=True, timeout=300,
                                   env=dict(MPIENV, PYTHONPATH=os.path.join(ROOT, "python")))
                err = [ln for ln in p.stderr.splitlines() if "error" in ln.lower()]
                self.assertEqual(p.returncode, 1, p.stderr)
                self.assertEqual(len(err), 1, p.stderr)
                self.assertIn(f"{ck or out}", err[0])
                self.assertIn("no space left on device", err[0])
                self.assertNotIn("HDF5", p.stderr)
                self.assertNotIn(".tmp", p.stderr)
                self.assertEqual(os.listdir(tiny), [], size)
                self.assertFalse(os.path.exists(self.dest))
            finally:
                subprocess.run(["umount", tiny], check=True)


if __name__ == "__main__":
    unittest.main()
