"""Outputs of the library's writers, kqsvd_result_write and kqsvd_acc_save
(Result.write and Calibrator.save in the binding), that must never be
replaced, force or not: a device node, a FIFO, a link to a device, and a
file in a folder nobody may write to (mode 0555, read-only for root too);
and an existing file, replaced only with force.  Each case raises
UsageError naming the path in the caller's words, leaves the node as it
was and nothing else in its folder.  The device is a twin of /dev/null
made with mknod, so making it needs root (Calibrator.save once turned the
machine's /dev/null into a regular file)."""
import os
import stat
import unittest

import numpy as np
from common import workdir

import kqsvd
from kqsvd.calibration.calibrator import Calibrator

ROOT = os.geteuid() == 0


def tiny():
    """A 1-layer, 1-head, d = 4 accumulator on random rows, and its result."""
    rng = np.random.default_rng(5)
    cal = Calibrator(layers=1, kv_heads=1, q_per_kv=1, head_dim=4, hidden=4)
    for tensor in ("keys", "queries", "values"):
        cal.absorb(tensor, 0, 0, rng.standard_normal((8, 4)))
    cal.absorb_oproj(0, rng.standard_normal((4, 4)))
    return cal, cal.finish("fixed:2")


class HostileOutputs(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.cal, cls.result = tiny()
        cls.writers = {"Result.write": lambda p, force: cls.result.write(p, force=force),
                       "Calibrator.save": lambda p, force: cls.cal.save(p, force=force)}

    def setUp(self):
        self.wd = workdir("hostile-outputs")

    def refused(self, path, *words, force=True):
        """Each writer raises UsageError naming path and words, and the
        folder holds what it held before."""
        folder = os.path.dirname(path)
        before = sorted(os.listdir(folder))
        for name, write in self.writers.items():
            with self.assertRaises(kqsvd.UsageError, msg=name) as e:
                write(path, force)
            msg = str(e.exception)
            self.assertEqual(len(msg.splitlines()), 1, msg)
            for w in (path, *words):
                self.assertIn(w, msg, name)
            self.assertNotIn("kqsvd_", msg, f"{name}: the C library's names")
            self.assertEqual(sorted(os.listdir(folder)), before, f"{name} left: {msg}")
        return msg

    @unittest.skipUnless(ROOT, "mknod of a character device needs root")
    def test_device_node(self):
        node = os.path.join(self.wd, "null")
        os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        self.refused(node, "not a regular file")
        self.assertTrue(stat.S_ISCHR(os.stat(node).st_mode))
        self.assertEqual(os.stat(node).st_rdev, os.makedev(1, 3))

    @unittest.skipUnless(ROOT, "mknod of a character device needs root")
    def test_link_to_device_node(self):
        node, link = os.path.join(self.wd, "null"), os.path.join(self.wd, "proj.h5")
        os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        os.symlink(node, link)
        self.refused(link, "not a regular file")
        self.assertTrue(os.path.islink(link) and os.readlink(link) == node)
        self.assertTrue(stat.S_ISCHR(os.stat(node).st_mode))

    def test_fifo(self):
        fifo = os.path.join(self.wd, "proj.h5")
        os.mkfifo(fifo)
        self.refused(fifo, "not a regular file")
        self.assertTrue(stat.S_ISFIFO(os.lstat(fifo).st_mode))

    def test_read_only_folder(self):
        ro = os.path.join(self.wd, "ro")
        os.makedirs(ro)
        os.chmod(ro, 0o555)
        try:
            self.refused(os.path.join(ro, "proj.h5"), "read-only", "0555")
        finally:
            os.chmod(ro, 0o755)

    def test_folder(self):
        self.refused(self.wd, "folder")

    def test_an_output_that_appeared_while_the_run_worked(self):
        """write_all publishes without replacing: a file made at an output
        after the checks (another run of the same command) is kept, with
        one line naming it, and none of the outputs is renamed; force
        replaces it."""
        from kqsvd.formats.files import write_all
        one, two = os.path.join(self.wd, "r.json"), os.path.join(self.wd, "r.png")

        def theirs(tmp):  # the other run finishing while this one writes
            with open(two, "w") as f:
                f.write("theirs")
            with open(tmp, "w") as f:
                f.write("ours")
        with self.assertRaises(kqsvd.KqsvdError) as e:
            write_all([(one, theirs), (two, theirs)])
        self.assertEqual(str(e.exception), f"{two} appeared while the run worked; nothing written "
                         "(give --force to replace it)")
        self.assertEqual(sorted(os.listdir(self.wd)), ["r.png"])
        with open(two) as f:
            self.assertEqual(f.read(), "theirs")
        write_all([(one, theirs), (two, theirs)], force=True)
        for p in (one, two):
            with open(p) as f:
                self.assertEqual(f.read(), "ours")
        self.assertEqual(sorted(os.listdir(self.wd)), ["r.json", "r.png"])

    def test_a_link_to_nothing(self):
        """A symbolic link to a missing file is a name taken: refused at the
        start without force (it was let through, then refused by the final
        rename after all the work), replaced with force."""
        from kqsvd.formats.files import check_outputs, json_writer, write_atomic
        path = os.path.join(self.wd, "dangling.h5")
        for name, write in self.writers.items():
            os.symlink(os.path.join(self.wd, "nowhere", "x.h5"), path)
            self.refused(path, "exists", force=False)
            write(path, True)
            self.assertFalse(os.path.islink(path), name)
            os.remove(path)
        report = os.path.join(self.wd, "dangling.json")
        os.symlink("nowhere.json", report)
        with self.assertRaises(kqsvd.UsageError) as e:
            check_outputs([("--json", report)])
        self.assertIn("already exists", str(e.exception))
        self.assertIn("--force", str(e.exception))
        check_outputs([("--json", report)], force=True)
        write_atomic(report, json_writer({"a": 1}), force=True)
        self.assertFalse(os.path.islink(report))

    def test_regular_file_still_replaced(self):
        """The refusals above are not of every existing output: a file is
        kept without force, and replaced with it."""
        path = os.path.join(self.wd, "proj.h5")
        for name, write in self.writers.items():
            with open(path, "w") as f:
                f.write("old")
            self.refused(path, "exists", "force=True", force=False)
            with open(path) as f:
                self.assertEqual(f.read(), "old", name)
            write(path, True)
            with open(path, "rb") as f:
                self.assertEqual(f.read(8), b"\x89HDF\r\n\x1a\n", name)
            self.assertEqual(sorted(os.listdir(self.wd)), ["proj.h5"], name)
        again = Calibrator(layers=1, kv_heads=1, q_per_kv=1, head_dim=4, hidden=4)
        again.load(path)
        np.testing.assert_array_equal(again.factor("keys", 0, 0), self.cal.factor("keys", 0, 0))
        again.close()


if __name__ == "__main__":
    unittest.main()
