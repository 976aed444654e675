"""Bad input to the in-situ calibration (python -m kqsvd.calibrate_hf) and
its checkpoint folder, as test_hostile.py gives it to the other commands:
the exit status, one stderr line naming the option, nothing made (not
even the checkpoint folder) and the inputs unchanged.  A policy, a
--head-groups or a --seq-len the model cannot take is refused from the
model's header, before its weights load."""
import contextlib
import io
import os
import unittest
from unittest import mock

from test_hostile import HostileCase, listing

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


if __name__ == "__main__":
    unittest.main()
