"""In-situ calibration (python -m kqsvd.calibrate_hf) and the binding under
it (kqsvd.calibration.calibrator.Calibrator): the binding's R factors against numpy's QR
for every element type, without copies of strided rows; the in-situ
projections against export_hf.py --dtype f32 followed by kqsvd calibrate;
1 rank against 3; a killed run resumed bit for bit; bad input refused
with one message, no output, on every rank."""
import json
import os
import sys
import unittest

import h5py
import numpy as np
import torch

from common import MPIENV, ROOT, TEXT, calibrate, export, tiny_decoder, workdir

from kqsvd.calibration.calibrator import Calibrator, check_policy
from kqsvd.errors import KqsvdError, UsageError

METHODS = ("kqsvd", "ksvd", "eigen")


def insitu(model, out, *extra, seq_len=64, num_seqs=12, np_=None, expect=0, env=None):
    cmd = [sys.executable, "-m", "kqsvd.calibrate_hf", "--model", model, "--text", TEXT,
           "--seq-len", str(seq_len), "--num-seqs", str(num_seqs), "--out", out, *extra]
    if np_:
        cmd = [os.environ.get("KQSVD_MPIEXEC") or "mpirun", "-np", str(np_)] + cmd
    import subprocess
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                       env=dict(MPIENV, **(env or {})))
    if expect is not None and (p.returncode == 0) != (expect == 0):
        raise AssertionError(f"{' '.join(cmd)}: exit {p.returncode}\n{p.stdout}\n{p.stderr[-3000:]}")
    return p


def datasets(path):
    out = {}
    with h5py.File(path) as f:
        f.visititems(lambda n, o: out.__setitem__(n, o[...]) if isinstance(o, h5py.Dataset) else None)
    return out


def worst_rel(a, b):
    """Largest difference relative to the dataset's largest entry, over
    every dataset but the ranks (which must be equal)."""
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    worst = 0.0
    for k in a:
        if "rank" in k:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
        else:
            x, y = a[k].astype(float), b[k].astype(float)
            worst = max(worst, float(np.abs(x - y).max() / max(np.abs(y).max(), 1e-300)))
    return worst


def errors(p):
    return [ln for ln in p.stderr.splitlines() if "kqsvd.calibrate_hf: error" in ln]


class Binding(unittest.TestCase):
    def test_factors_of_every_type(self):
        rng = np.random.default_rng(3)
        d = 16
        for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            cal = Calibrator(layers=2, kv_heads=2, q_per_kv=2, head_dim=d, hidden=32, block_rows=8)
            wide = torch.from_numpy(rng.standard_normal((90, 3 * d))).to(dtype)
            rows = wide[:, d:2 * d]  # a strided view: passed by pointer and stride
            cal.absorb("values", 1, 1, rows[:41])
            cal.absorb("values", 1, 1, rows[41:])
            ref = np.linalg.qr(rows.double().numpy(), mode="r")
            R = cal.factor("values", 1, 1)
            err = np.abs(np.abs(R) - np.abs(ref)).max() / np.abs(ref).max()
            self.assertLess(err, 1e-12, str(dtype))
            cal.close()

    def test_numpy_and_torch_agree(self):
        x = np.random.default_rng(4).standard_normal((50, 8))
        a, b = Calibrator(1, 1, 2, 8, 4), Calibrator(1, 1, 2, 8, 4)
        a.absorb("queries", 0, 0, x, query=1)
        b.absorb("queries", 0, 0, torch.from_numpy(x), query=1)
        np.testing.assert_array_equal(a.factor("queries", 0, 0), b.factor("queries", 0, 0))

    def test_errors_carry_the_c_message(self):
        cal = Calibrator(2, 2, 2, 8, 16)
        x = np.ones((4, 8))
        with self.assertRaisesRegex(UsageError, r"layer = 5: expected a whole number in 0\.\.1"):
            cal.absorb("keys", 5, 0, x)  # checked before C (issue 36, item 19)
        x[2, 3] = np.inf
        with self.assertRaisesRegex(KqsvdError, "NaN or Inf at layer 0, head 1, row 2"):
            cal.absorb("keys", 0, 1, x)
        with self.assertRaisesRegex(UsageError, "each row must be contiguous"):
            cal.absorb("keys", 0, 0, np.ones((4, 16))[:, ::2])
        with self.assertRaisesRegex(UsageError, "dtype int64"):
            cal.absorb("keys", 0, 0, np.ones((4, 8), dtype=np.int64))
        with self.assertRaisesRegex(UsageError, "ranks"):
            check_policy("fixed:9", 1.0, 8)
        with self.assertRaisesRegex(UsageError, "ranks"):
            check_policy("most:3", 1.0, 8)
        check_policy("budget:0.5", 2.0, 8)


def slurm_env(wd):
    """(env, cluster folder or None): the SLURM of SLURM_CONF when one
    answers, else a private single-node one started here (root, Debian's
    slurm-wlm and munge: what CI has), else None."""
    import shutil
    import subprocess
    env = dict(MPIENV, PATH=os.environ["PATH"] + ":/usr/sbin")

    def up():
        try:
            p = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True,
                               env=env, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            return False
        return p.returncode == 0 and any(x in p.stdout for x in ("idle", "mixed", "alloc"))

    if up():
        return env, None
    if os.geteuid() != 0 or not shutil.which("munged", path=env["PATH"]) or not shutil.which("sbatch"):
        return None, None
    own = os.path.join(wd, "cluster")
    env["SLURM_CONF"] = os.path.join(own, "slurm.conf")
    p = subprocess.run([os.path.join(ROOT, "slurm", "local-cluster.sh"), "start", own],
                       capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise AssertionError(f"cannot start a local SLURM: {p.stderr}")
    return env, own


class OnDevice(unittest.TestCase):
    def test_torch_fold_refuses_nan(self):
        from kqsvd.calibration.insitu import TorchFold
        from kqsvd.models import ModelInfo
        for method in ("qr", "gram"):
            fold = TorchFold(ModelInfo("m", "llama", 2, 4, 2, 8, 32, 1), "cpu", method)
            rows = torch.randn(4, 10, 8)
            fold.absorb(1, "q", rows)
            fold.flush()
            R = fold.factor("q", 1, 1)
            ref = np.linalg.qr(rows[2:].reshape(20, 8).double().numpy(), mode="r")
            self.assertLess(np.abs(np.abs(R) - np.abs(ref)).max(), 1e-12, method)
            rows[3, 4, 5] = float("nan")
            fold.absorb(0, "q", rows)
            with self.assertRaisesRegex(KqsvdError,
                                        "queries: NaN or Inf at layer 0, KV head 1, row 14"):
                fold.flush()

    def test_torch_fold_batches_layers_and_groups(self):
        """A window's layers folded together, a few per call, in head groups
        (keys side by side, queries per KV head) and across windows: the R
        factors of numpy's QR of the same rows, for both methods."""
        from kqsvd.calibration.insitu import TorchFold
        from kqsvd.models import ModelInfo
        info = ModelInfo("m", "llama", 3, 8, 4, 8, 64, 1)  # 3 layers, 8 query / 4 KV heads, d 8
        rng = np.random.default_rng(3)
        wins = [{(l, k): torch.from_numpy(rng.standard_normal((8 if k == "q" else 4, 12, 8)))
                 for l in range(3) for k in "qkv"} for _ in range(2)]
        for method in ("qr", "gram"):
            fold = TorchFold(info, "cpu", method, head_groups=2, batch_bytes=2 * 4 * 12 * 8 * 8)
            for win in wins:
                for (l, k), t in win.items():
                    fold.absorb(l, k, t)
                fold.flush()
            for l in range(3):
                for g in (0, 2):  # a group's keys: its two heads side by side
                    rows = np.concatenate([np.concatenate([w[(l, "k")][g], w[(l, "k")][g + 1]], 1)
                                           for w in wins])
                    ref = np.linalg.qr(rows, mode="r")
                    self.assertLess(np.abs(np.abs(fold.factor("k", l, g)) - np.abs(ref)).max(),
                                    1e-10, (method, l, g))
                for h in range(4):  # KV head h's two query heads stacked
                    rows = np.concatenate([w[(l, "q")][2 * h + j] for w in wins for j in (0, 1)])
                    ref = np.linalg.qr(rows, mode="r")
                    self.assertLess(np.abs(np.abs(fold.factor("q", l, h)) - np.abs(ref)).max(),
                                    1e-10, (method, l, h))


class InSitu(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.wd = workdir("insitu")
        cls.model = tiny_decoder("llama", os.path.join(cls.wd, "model"))
        cls.train = export(cls.model, os.path.join(cls.wd, "train"), "train", 64, 12, "f32")

    def test_equals_export_then_calibrate(self):
        for policy in ("eps:0.1", "budget:0.3"):
            two = calibrate(*self.train, os.path.join(self.wd, f"two-{policy}.h5"), ranks=policy)
            out = os.path.join(self.wd, f"insitu-{policy}.h5")
            p = insitu(self.model, out, "--ranks", policy)
            self.assertIn("no caches written", p.stdout)
            self.assertLess(worst_rel(datasets(out), datasets(two)), 1e-10, policy)
            with h5py.File(out) as f:
                self.assertEqual(int(f.attrs["tokens"]), 12 * 64)
                self.assertEqual(int(f.attrs["seq_len"]), 64)  # --seq-len, as the C tool's
            with h5py.File(two) as f:
                self.assertEqual(int(f.attrs["seq_len"]), 64)
                self.assertEqual(f.attrs["rank_policy"], policy)

    def test_head_groups(self):
        """--head-groups equals export_hf.py then kqsvd calibrate --head-groups,
        on 1 rank and 2, with the C fold and the torch fold (both methods);
        a G not dividing the KV heads is refused with one line."""
        two = calibrate(*self.train, os.path.join(self.wd, "two-g2.h5"), ranks="fixed:5",
                        extra=["--head-groups", "2"])
        for np_, extra in ((None, []), (2, []), (None, ["--fold", "torch"]),
                           (None, ["--fold", "torch", "--qr", "gram"])):
            out = os.path.join(self.wd, f"insitu-g2-{np_}-{len(extra)}.h5")
            insitu(self.model, out, "--ranks", "fixed:5", "--head-groups", "2", *extra, np_=np_)
            self.assertLess(worst_rel(datasets(out), datasets(two)), 1e-9, extra)
            with h5py.File(out) as f:
                self.assertEqual(int(f.attrs["head_groups"]), 2)
        bad = os.path.join(self.wd, "bad-g.h5")
        for extra, words in ((["--head-groups", "3"], "does not divide the 2 KV heads"),):
            p = insitu(self.model, bad, *extra, expect=1)
            self.assertIn(words, p.stderr)
            self.assertNotIn("Traceback", p.stderr)
            self.assertFalse(os.path.exists(bad))

    def test_three_ranks_equal_one(self):
        one, three = os.path.join(self.wd, "np1.h5"), os.path.join(self.wd, "np3.h5")
        insitu(self.model, one, "--eps", "0.05")
        p = insitu(self.model, three, "--eps", "0.05", np_=3)
        self.assertIn("on 3 ranks", p.stdout)
        self.assertLess(worst_rel(datasets(three), datasets(one)), 1e-10)

    def test_fold_on_the_models_device(self):
        """--fold torch (the GPU path: float64 QR where the model runs, here
        on the CPU) equals the C fold, also across a kill and resume."""
        c, t = os.path.join(self.wd, "fold-c.h5"), os.path.join(self.wd, "fold-torch.h5")
        insitu(self.model, c, "--fold", "c")
        insitu(self.model, t, "--fold", "torch")
        self.assertLess(worst_rel(datasets(t), datasets(c)), 1e-10)
        for qr in ("tsqr", "gram"):  # the Gram fold: the same to well within its bound
            ckpt = os.path.join(self.wd, f"ckpt-torch-{qr}")
            cut = os.path.join(self.wd, f"fold-cut-{qr}.h5")
            insitu(self.model, cut, "--fold", "torch", "--qr", qr, "--checkpoint", ckpt,
                   "--checkpoint-every", "0", expect=None, env={"KQSVD_TEST_FAULT": "window-7:kill"})
            p = insitu(self.model, cut, "--fold", "torch", "--qr", qr, "--checkpoint", ckpt)
            self.assertIn("resuming: 7 of 12", p.stderr)
            self.assertLess(worst_rel(datasets(cut), datasets(c)), 1e-10 if qr == "tsqr" else 1e-8)
        gram_c = os.path.join(self.wd, "fold-c-gram.h5")  # the C library's Gram fold too
        insitu(self.model, gram_c, "--fold", "c", "--qr", "gram")
        self.assertLess(worst_rel(datasets(gram_c), datasets(c)), 1e-8)

    def test_writes_nothing_but_the_output(self):
        folder = os.path.join(self.wd, "only")
        os.makedirs(folder)
        insitu(self.model, os.path.join(folder, "proj.h5"))
        self.assertEqual(os.listdir(folder), ["proj.h5"])

    def test_skip_done(self):
        """--skip-done leaves an output made from the same inputs alone and
        redoes one made with other options, on 1 rank and on 2."""
        out = os.path.join(self.wd, "skip.h5")
        insitu(self.model, out, "--skip-done")
        with h5py.File(out) as f:
            self.assertRegex(f.attrs["inputs_hash"], "^[0-9a-f]{32}$")
        before = os.stat(out).st_mtime_ns
        for np_ in (None, 2):
            p = insitu(self.model, out, "--skip-done", np_=np_)
            self.assertIn("is up to date", p.stderr)
            self.assertEqual(p.stderr.count("is up to date"), 1)
            self.assertEqual(os.stat(out).st_mtime_ns, before)
        p = insitu(self.model, out, "--skip-done", "--eps", "0.05")
        self.assertIn("no caches written", p.stdout)
        with h5py.File(out) as f:
            self.assertEqual(f.attrs["rank_policy"], "eps:0.05")

    def test_killed_run_resumes_bit_for_bit(self):
        whole, cut = os.path.join(self.wd, "whole.h5"), os.path.join(self.wd, "cut.h5")
        ckpt = os.path.join(self.wd, "ckpt")
        insitu(self.model, whole)
        insitu(self.model, cut, "--checkpoint", ckpt, "--checkpoint-every", "0", expect=None,
               env={"KQSVD_TEST_FAULT": "window-5:kill"})
        self.assertFalse(os.path.exists(cut))
        with open(os.path.join(ckpt, "rank-0-of-1.json")) as f:
            self.assertEqual(json.load(f)["done"], 5)
        p = insitu(self.model, cut, "--checkpoint", ckpt, "--checkpoint-every", "0")
        self.assertIn("resuming: 5 of 12 sequences", p.stderr)
        a, b = datasets(cut), datasets(whole)
        for k in a:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
        self.assertEqual(os.listdir(ckpt), [])
        # The same folder with other inputs: refused by name, nothing written.
        insitu(self.model, cut + ".2", "--checkpoint", ckpt, "--checkpoint-every", "0",
               expect=None, env={"KQSVD_TEST_FAULT": "window-2:kill"})
        p = insitu(self.model, cut + ".2", "--checkpoint", ckpt, "--seq-len", "32", expect=1,
                   seq_len=32)
        self.assertEqual(len(errors(p)), 1, p.stderr)
        self.assertIn("rank-0-of-1.json: field 'inputs' differs", p.stderr)
        self.assertFalse(os.path.exists(cut + ".2"))

    def test_a_signal_after_the_last_window(self):
        """SIGINT or SIGTERM after the last window is folded, or while the
        output is written, stops the run as at any other moment (exit 75,
        said once, no output nor temporary file), on 1 rank and 2, and the
        same command then resumes from the checkpoints to the whole run's
        file; without --checkpoint it says nothing was kept."""
        whole = os.path.join(self.wd, "late-whole.h5")
        insitu(self.model, whole, num_seqs=4)
        for where, sig, np_ in (("fold", "SIGINT", None), ("write", "SIGTERM", None),
                                ("write", "SIGINT", 2)):
            out, ckpt = (os.path.join(self.wd, f"late-{where}-{sig}{x}") for x in (".h5", "-ck"))
            late = {"KQSVD_TEST_FAULT": f"{where}:{sig}"}
            for extra, says in ((["--checkpoint", ckpt], "run the same command to resume"),
                                ([], "nothing kept")):
                p = insitu(self.model, out, *extra, num_seqs=4, np_=np_, expect=None, env=late)
                self.assertEqual(p.returncode, 75, p.stderr)
                lines = [x for x in p.stderr.splitlines() if "stopped by signal" in x]
                self.assertEqual(len(lines), 1, p.stderr)
                self.assertIn(says, lines[0])
                self.assertNotIn("Traceback", p.stderr)
                self.assertFalse(os.path.exists(out))
                self.assertEqual([f for f in os.listdir(self.wd) if f.startswith(".late")], [])
            p = insitu(self.model, out, "--checkpoint", ckpt, num_seqs=4, np_=np_)
            self.assertIn("resuming: 4 of 4 sequences", p.stderr)
            self.assertLess(worst_rel(datasets(out), datasets(whole)), 1e-10)

    def test_rank_0_failing_at_the_end(self):
        """Rank 0 failing while it solves or writes (a full disk) stops
        every rank with one message, exit 1, no output and nothing left:
        no rank waits for it."""
        out = os.path.join(self.wd, "failing.h5")
        for np_ in (None, 2):
            p = insitu(self.model, out, num_seqs=4, np_=np_, expect=None,
                       env={"KQSVD_TEST_FAULT": "write:fail"})
            self.assertEqual(p.returncode, 1, p.stderr)
            self.assertEqual(len(errors(p)), 1, p.stderr)
            self.assertIn("a fault injected at 'write'", p.stderr)
            self.assertFalse(os.path.exists(out))
            self.assertEqual([f for f in os.listdir(self.wd) if f.startswith(".failing")], [])

    def test_slurm_job(self):
        """slurm/calibrate_hf.sbatch on a real SLURM, 2 tasks: the output
        equals a 1-rank run; a job with bad input fails with the message
        in its log and no output."""
        import subprocess
        import time
        wd = workdir("insitu-slurm")
        env, own = slurm_env(wd)
        if env is None:
            self.skipTest("no SLURM answering and none can be started here (needs root, "
                          "slurm-wlm and munge)")
        try:
            ref, out = os.path.join(wd, "ref.h5"), os.path.join(wd, "job.h5")
            insitu(self.model, ref)
            jobs = {}
            for name, o, extra in (("good", out, []), ("bad", out + ".bad", ["--seq-len", "999"])):
                cmd = ["sbatch", "--parsable", "--ntasks", "2", "--chdir", wd, "--output",
                       os.path.join(wd, f"{name}.log"), os.path.join(ROOT, "slurm", "calibrate_hf.sbatch"),
                       "--model", self.model, "--text", TEXT, "--seq-len", "64", "--num-seqs", "12",
                       "--out", o, "--checkpoint", os.path.join(wd, f"ckpt-{name}"), *extra]
                p = subprocess.run(cmd, capture_output=True, text=True, env=dict(env, KQSVD_ROOT=ROOT))
                self.assertEqual(p.returncode, 0, p.stderr)
                jobs[name] = p.stdout.strip().split(";")[0]
            t0 = time.time()
            while time.time() - t0 < 300:
                q = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, env=env)
                if not set(jobs.values()) & set(q.stdout.split()):
                    break
                time.sleep(1)
            good = open(os.path.join(wd, "good.log")).read()
            self.assertIn("exit code 0", good)
            self.assertIn("on 2 ranks", good)
            self.assertLess(worst_rel(datasets(out), datasets(ref)), 1e-10)
            bad = open(os.path.join(wd, "bad.log")).read()
            self.assertIn("exceeds the model's max_position_embeddings", bad)
            self.assertRegex(bad, r"exit code [1-9]")
            self.assertFalse(os.path.exists(out + ".bad"))
            self.submit_model_line(wd, env, ref)
        finally:
            if own:
                subprocess.run([os.path.join(ROOT, "slurm", "local-cluster.sh"), "stop", own], env=env)

    def submit_model_line(self, wd, env, ref):
        """slurm/kqsvd-submit with a manifest line naming the model: the
        calibrate task (2 ranks) equals a 1-rank run, the evaluate task
        writes a quality report, and a resubmission skips the done model."""
        import subprocess
        manifest = os.path.join(wd, "models.txt")
        with open(manifest, "w") as f:
            f.write(f"tiny hf:{self.model} out/tiny.h5 {TEXT} 64 12\n")
        os.makedirs(os.path.join(wd, "out"))
        cmd = [os.path.join(ROOT, "slurm", "kqsvd-submit"), manifest, "--ntasks-per-node", "2",
               "--evaluate", "--wait", "--poll", "1"]
        env = dict(env, KQSVD_HF_PYTHON=sys.executable)
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        logs = os.path.join(wd, "kqsvd-logs")
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr + "".join(
            open(os.path.join(logs, f)).read() for f in os.listdir(logs) if f.endswith(".log")))
        self.assertRegex(p.stdout, r"tiny +calibrate +ok")
        self.assertRegex(p.stdout, r"tiny +evaluate +ok")
        out = os.path.join(wd, "out", "tiny.h5")
        self.assertLess(worst_rel(datasets(out), datasets(ref)), 1e-10)
        self.assertIn("on 2 ranks", open(os.path.join(logs, "tiny.calibrate.log")).read())
        with open(os.path.join(wd, "out", "tiny.quality.json")) as f:
            report = json.load(f)
        self.assertEqual(report["kqsvd_format"], "quality")
        self.assertEqual((report["split"], report["seq_len"], report["num_seqs"]),
                         ("validation", 64, 8))
        self.assertEqual({r["policy"] for r in report["results"]}, {"eps:0.1"})
        mtime = os.stat(out).st_mtime_ns
        p = subprocess.run(cmd[:4] + ["--wait", "--poll", "1"], capture_output=True, text=True,
                           env=env, timeout=600)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn("is up to date", open(os.path.join(logs, "tiny.calibrate.log")).read())
        self.assertEqual(os.stat(out).st_mtime_ns, mtime)

    def test_bad_input(self):
        wd = workdir("insitu-bad")
        gpt2 = os.path.join(wd, "gpt2")
        os.makedirs(gpt2)
        with open(os.path.join(gpt2, "config.json"), "w") as f:
            json.dump({"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 8}, f)
        short = os.path.join(wd, "short.txt")
        with open(short, "w") as f:
            f.write("too short a text " * 10)
        out = os.path.join(wd, "proj.h5")
        cases = [
            ([gpt2, out], [], "architecture 'gpt2' is not supported"),
            ([self.model, out], ["--seq-len", "600"], "exceeds the model's max_position_embeddings"),
            ([self.model, out], ["--text", short], "short.txt: "),
            ([self.model, os.path.join(wd, "none", "p.h5")], [], "folder"),
            ([self.model, out], ["--ranks", "fixed:99"], "ranks"),
            ([self.model, wd], [], "is a folder"),
        ]
        for (model, o), extra, want in cases:
            for np_ in (None, 2):
                p = insitu(model, o, *extra, np_=np_, expect=1)
                self.assertEqual(len(errors(p)), 1, f"{want}: {p.stderr[-2000:]}")
                self.assertIn(want, p.stderr)
                self.assertFalse(os.path.exists(out), want)
        open(out, "w").close()
        p = insitu(self.model, out, expect=1)
        self.assertIn("already exists; give --force", p.stderr)


if __name__ == "__main__":
    unittest.main()
