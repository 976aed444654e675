"""Hardening scenarios: inputs and faults found by fuzzing and fault
injection.  Each case must end with a correct result or one clear message,
a non-zero exit, no hang and no leftover."""
import glob
import os
import shutil
import stat
import subprocess
import time

import h5py
import numpy as np

from harness import (KQSVD, calibrate, check, digests, finish, load_proj, max_rel_diff,
                     refused_output, run, small_set, special_outputs, synth, workdir)

# d = 4 <= rows, so every factor has full rank and the projections are unique.
TINY = dict(layers=2, heads=4, kv_heads=2, head_dim=4, hidden=16)


def few_rows():
    """More ranks than rows: every rank count runs (some ranks read nothing)
    and gives the 1-rank result; 1- and 3-shard sets, tsqr and gram.  With
    5 rows and d = 64 most singular values are zero: their vectors are
    chosen canonically, so they agree too."""
    wd, model, one = small_set("few_rows", seqs=1, seq_len=5, min_seq_len=5, shards=1)
    three_model, three = synth(os.path.join(wd, "three"), seqs=3, seq_len=3, min_seq_len=2,
                               shards=3, **TINY)
    for name, m, files in (("1 shard", model, one), ("3 shards", three_model, three)):
        for qr in ("tsqr", "gram"):
            base = os.path.join(wd, f"base-{qr}.h5")
            calibrate(m, base, files, extra=["--qr", qr, "--force"])
            ref = load_proj(base)
            for np_ in (6, 8, 13):
                out = os.path.join(wd, f"np{np_}-{qr}.h5")
                p = calibrate(m, out, files, np_=np_, extra=["--qr", qr, "--force"])
                d, where = max_rel_diff(ref, load_proj(out))
                print(f"{name}, --qr {qr}, np {np_}: largest relative difference {d:.3g}")
                check(d <= 1e-10, f"{name} --qr {qr} np {np_}: differs by {d:.3g} in {where}")
                check(p.returncode == 0, f"{name} np {np_}: exit {p.returncode}")
    finish("few_rows")


def refused(p, *words, code=None):
    """One error line naming `words`, a non-zero exit (`code` if given)."""
    err = p.stderr.strip()
    ok = p.returncode != 0 and (code is None or p.returncode == code)
    ok = ok and all(w in err for w in words) and "Traceback" not in err
    return check(ok, f"expected a refusal naming {words} (exit {code}), got exit "
                     f"{p.returncode}: {err[:600]}")


def leftovers(folder):
    return [f for f in os.listdir(folder) if ".tmp" in f]


def options():
    """Output and checkpoint arguments refused before any work."""
    wd, model, shards = small_set("options", seqs=4, seq_len=32, shards=2, **TINY)
    out = os.path.join(wd, "proj.h5")
    calibrate(model, out, shards)
    before = os.stat(out).st_mtime_ns
    # An existing output is kept unless --force (or --skip-done) says so.
    refused(calibrate(model, out, shards, expect=None), "--out", "already exists", "--force",
            code=2)
    check(os.stat(out).st_mtime_ns == before, "a refused run touched the existing output")
    calibrate(model, out, shards, extra=["--force"])
    # A name that leaves no room for the temporary suffix (".tmp-PID"):
    # refused at once, not after the run inside MPI-IO.
    long_out = os.path.join(wd, "p" * 238 + ".h5")
    refused(calibrate(model, long_out, shards, expect=None), "--out", "file name", code=2)
    check(not leftovers(wd), f"leftovers: {leftovers(wd)}")
    # The two options that name one file.
    refused(calibrate(model, out, [model, *shards], extra=["--force"], expect=None),
            "given twice", "--model", "shard 1", code=2)
    refused(calibrate(model, shards[0], shards, extra=["--force"], expect=None),
            "--out", "shard 1", code=2)
    # Checkpoints: an output inside the folder would be deleted with them;
    # the folder must be writable before the stream starts.
    ckpt = os.path.join(wd, "ckpt")
    refused(calibrate(model, os.path.join(ckpt, "rank-00000-of-00001.h5"), shards,
                      extra=["--checkpoint", ckpt], expect=None), "inside the --checkpoint",
            code=2)
    check(not os.path.exists(ckpt), "a refused run left the --checkpoint folder it made")
    made_folders_only(wd, model, out, shards)
    refused(calibrate(model, out, shards, extra=["--force", "--checkpoint", out], expect=None),
            "--checkpoint", code=2)
    under_file = os.path.join(shards[0], "ckpt")
    p = calibrate(model, os.path.join(wd, "x.h5"), shards, extra=["--checkpoint", under_file],
                  expect=None)
    refused(p, "--checkpoint", under_file, code=2)
    check(not os.path.exists(os.path.join(wd, "x.h5")), "output written despite the refusal")
    special_places(wd, model, shards)
    # A shell pattern that matched nothing arrives as itself.
    pattern = os.path.join(wd, "set", "nothing-*.h5")
    refused(calibrate(model, out, [pattern], extra=["--force"], expect=None), pattern,
            "no file matches", code=1)
    # Projections of another model with the same shapes: an error unless
    # asked for.
    other = os.path.join(wd, "other-model.h5")
    shutil.copy(model, other)
    with h5py.File(other, "r+") as f:
        f.attrs["model"] = "another/model"
    ev = ["evaluate", "--progress", "off", "--model", other, "--proj", out, *shards]
    refused(run(ev, expect=None), out, "another/model", "--allow-model-mismatch", code=1)
    p = run(ev + ["--allow-model-mismatch"])
    check("warning" in p.stderr, f"no warning with --allow-model-mismatch: {p.stderr[:300]}")
    # help CMD, -V and version.
    p = run(["help", "evaluate"])
    check("usage: [mpirun -np N] kqsvd evaluate" in p.stdout, f"help evaluate: {p.stdout[:200]}")
    for v in ("-V", "version", "--version"):
        p = run([v])
        check(p.stdout.startswith("kqsvd "), f"kqsvd {v}: {p.stdout[:200]}")
    finish("options")


def made_folders_only(wd, model, out, shards):
    """A refused run (an existing --out) takes away only the --checkpoint
    folders its own mkdir made, and only empty ones: not one that was there
    before (a ".." leading back to it, an empty folder given as is, or the
    parent of a new one), and a trailing "/" changes nothing."""
    def refused_ckpt(ck, np_=1):
        refused(calibrate(model, out, shards, np_=np_, extra=["--checkpoint", ck], expect=None),
                "--out", "already exists", code=2)
    mine, made = os.path.join(wd, "mine"), os.path.join(wd, "made")
    os.makedirs(mine)
    refused_ckpt(os.path.join(made, "..", "mine"))
    check(os.path.isdir(mine), "a refused run removed a folder there before it, through ..")
    check(not os.path.exists(made), "a refused run left the folder it made before a ..")
    # On several ranks the mkdirs race and share the components out among
    # them: every one made goes, whichever rank made it (tried a few times,
    # since a race is not lost every time).
    for np_, tries in ((1, 1), (2, 4), (3, 4)):
        for _ in range(tries):
            refused_ckpt(os.path.join(made, "a", "b", "ck") + "/", np_)
            check(not os.path.exists(made),
                  f"--checkpoint {made}/a/b/ck/ on {np_} ranks: left {made}")
    refused_ckpt(mine)
    refused_ckpt(os.path.join(mine, "ck"))
    check(os.path.isdir(mine) and not os.listdir(mine),
          "a refused run removed an empty --checkpoint folder, or its parent, it did not make")
    os.rmdir(mine)


def special_places(wd, model, shards):
    """Outputs that are never replaced, --force or not: a device, a FIFO, a
    link to a device (rename() would put a file in their place), and a file
    in a folder nobody may write to (mode 0555, for root too)."""
    nodes = special_outputs(os.path.join(wd, "special"))
    ro = os.path.join(wd, "ro")
    os.makedirs(ro)
    os.chmod(ro, 0o555)
    cal = ["calibrate", "--progress", "off", "--model", model]
    for path in nodes:
        for extra in ([], ["--force"], ["--head-groups", "2"], ["--force", "--head-groups", "2"]):
            refused_output(f"--out {os.path.basename(path)} {' '.join(extra)}",
                           [*cal, "--out", path, *extra, *shards], "--out", path,
                           [model, *shards], "is not a regular file (a device, FIFO or socket)")
    in_ro = os.path.join(ro, "proj.h5")
    for extra in ([], ["--force"]):
        refused_output(f"--out in a mode-0555 folder {' '.join(extra)}",
                       [*cal, "--out", in_ro, *extra, *shards], "--out", in_ro, [model, *shards],
                       f"the folder {ro} is read-only (mode 0555)")
    # A manifest's outputs: its reader refuses such a line (exit 1, as every
    # bad line); the folder is checked with the other outputs (exit 2).
    manifest = os.path.join(wd, "special.txt")
    glob_ = os.path.join(os.path.dirname(shards[0]), "shard-*.h5")
    real = os.path.realpath(wd)
    for path, code, words in [(p, 1, "is not a regular file") for p in nodes] + \
            [(in_ro, 2, "is read-only (mode 0555)")]:
        with open(manifest, "w") as f:
            f.write(f"x {model} {path} {glob_}\n")
        shown = os.path.join(real, os.path.relpath(path, wd))
        refused_output(f"manifest OUTPUT_H5 {os.path.basename(path)}",
                       ["calibrate", "--progress", "off", "--manifest", manifest], "OUTPUT_H5",
                       shown, [model, *shards, manifest], words, code=code)
    for path, is_kind in nodes.items():
        check(is_kind(os.stat(path).st_mode), f"{path} is no longer what it was")
    # The name became a FIFO while the run streamed: the final rename leaves
    # it as it is, and no temporary file.
    late, ck = os.path.join(wd, "special", "late.h5"), os.path.join(wd, "ck-late")
    p = subprocess.Popen([KQSVD, *cal, "--out", late, "--read-rows", "8", "--checkpoint", ck,
                          "--checkpoint-every", "0", *shards], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, KQSVD_TEST_READ_DELAY_MS="200"))
    t0 = time.time()
    while time.time() - t0 < 30 and not glob.glob(os.path.join(ck, "rank-*.h5")):
        time.sleep(0.02)
    check(p.poll() is None, "the slowed run ended before its first checkpoint")
    os.mkfifo(late)
    _, err = p.communicate(timeout=120)
    check(p.returncode == 1 and err.count("\n") == 1 and f"{late} is no longer a regular file" in
          err, f"a FIFO made mid-run: exit {p.returncode}: {err[:600]}")
    check(stat.S_ISFIFO(os.stat(late).st_mode), "a FIFO made mid-run was replaced")
    check(not leftovers(os.path.dirname(late)), f"leftovers: {leftovers(os.path.dirname(late))}")
    os.chmod(ro, 0o755)


def synth_outputs():
    """kqsvd synth --out: an existing set is kept without --force and
    replaced whole with it (no shard of the older set beside the new one,
    on 1 and 2 ranks); a file, FIFO, device or a link to one, and a
    read-only folder, are refused before any work, exit 2, naming --out."""
    wd = workdir("synth_outputs")
    tiny = dict(TINY, seqs=4, seq_len=8, progress="off")
    out = os.path.join(wd, "set")
    args = lambda extra: ["synth", "--out", out, *[x for k, v in tiny.items()  # noqa: E731
                                                  for x in ("--" + k.replace("_", "-"), str(v))],
                          *extra]
    run(args(["--shards", "3"]))
    sums = digests(glob.glob(os.path.join(out, "*.h5")))
    p = run(args(["--shards", "1"]), expect=None)
    refused(p, "--out", out, "already holds a cache set", "model.h5 and 3 shard files",
            "--force", code=2)
    check(digests(glob.glob(os.path.join(out, "*.h5"))) == sums, "a refused synth changed the set")
    for np_ in (1, 2):
        run(args(["--shards", "1", "--force"]), np_=np_)
        have = sorted(os.listdir(out))
        check(have == ["model.h5", "shard-0000.h5"], f"np {np_}: stale files after --force: {have}")
        with h5py.File(os.path.join(out, "shard-0000.h5"), "r") as f:
            check(int(f["seq_lens"].shape[0]) == 4, "the one new shard holds every sequence")
        run(args(["--shards", "2", "--force"]), np_=np_)
    # Not a folder: said of --out, before any work, exit 2.
    nodes = special_outputs(os.path.join(wd, "special"))
    plain = os.path.join(wd, "special", "file.h5")
    with open(plain, "w") as f:
        f.write("x")
    nodes[plain] = stat.S_ISREG
    for path, is_kind in nodes.items():
        p = run(["synth", "--out", path, "--progress", "off"], expect=None)
        refused(p, f"--out {path}", "not a folder", code=2)
        check(p.stderr.count("\n") == 1, f"one line: {p.stderr[:300]}")
        check(is_kind(os.stat(path).st_mode), f"{path} is no longer what it was")
    check(sorted(os.listdir(os.path.join(wd, "special"))) ==
          sorted(os.path.basename(p) for p in nodes), "synth wrote beside the special files")
    dangling = os.path.join(wd, "dangling")
    os.symlink(os.path.join(wd, "nowhere"), dangling)
    refused(run(["synth", "--out", dangling, "--progress", "off"], expect=None),
            f"--out {dangling}", "link to nothing", code=2)
    # A read-only folder (mode 0555, for root too), itself or above --out.
    ro = os.path.join(wd, "ro")
    os.makedirs(ro)
    os.chmod(ro, 0o555)
    for path in (ro, os.path.join(ro, "new", "set")):
        refused(run(["synth", "--out", path, "--progress", "off"], expect=None), "--out", path,
                "read-only (mode 0555)", code=2)
    check(os.listdir(ro) == [], f"synth wrote into a read-only folder: {os.listdir(ro)}")
    os.chmod(ro, 0o755)
    # A set whose shard name is a FIFO is not replaced, --force or not.
    odd = os.path.join(wd, "odd")
    os.makedirs(odd)
    os.mkfifo(os.path.join(odd, "shard-0000.h5"))
    for extra in ([], ["--force"]):
        refused(run(["synth", "--out", odd, "--progress", "off", *extra], expect=None),
                "shard-0000.h5", "not a regular file", code=2)
    check(stat.S_ISFIFO(os.stat(os.path.join(odd, "shard-0000.h5")).st_mode), "FIFO replaced")
    # A crashed run's temporary files go with the set it replaces.
    for name in ("model.h5.tmp-1-0", "shard-0003.h5.tmp-1-2"):
        with open(os.path.join(out, name), "w") as f:
            f.write("cut short")
    run(args(["--shards", "1", "--force"]))
    check(sorted(os.listdir(out)) == ["model.h5", "shard-0000.h5"],
          f"temporary files of a crashed run left: {sorted(os.listdir(out))}")
    finish("synth_outputs")


def skip_done():
    """--skip-done notices a shard rewritten within the same second with the
    same size (and even the same mtime)."""
    wd, model, shards = small_set("skip_done", seqs=4, seq_len=32, min_seq_len=32,
                                   shards=2, **TINY)
    out = os.path.join(wd, "proj.h5")
    calibrate(model, out, shards)
    p = calibrate(model, out, shards, extra=["--skip-done"])
    check("nothing to do" in p.stdout, f"an up-to-date output was remade: {p.stdout}")
    st = os.stat(shards[1])
    other = synth(os.path.join(wd, "other"), seqs=4, seq_len=32, min_seq_len=32, shards=2,
                  seed=99, **TINY)[1]
    with open(other[1], "rb") as f:
        data = f.read()
    if check(len(data) == st.st_size, "the two synthetic shards differ in size"):
        with open(shards[1], "r+b") as f:
            f.write(data)
        os.utime(shards[1], ns=(st.st_atime_ns, st.st_mtime_ns))
        p = calibrate(model, out, shards, extra=["--skip-done"])
        check("nothing to do" not in p.stdout, "a rewritten shard with the same size and mtime "
              "was taken as unchanged")
    finish("skip_done")


def copy_to(src, folder, tag):
    dst = os.path.join(folder, f"{tag}-{os.path.basename(src)}")
    shutil.copy(src, dst)
    return dst


def hostile_files():
    """Files that were accepted with wrong results, or broke the tool."""
    wd, model, shards = small_set("hostile", seqs=4, seq_len=24, min_seq_len=24, shards=2,
                                  dtype="bf16", **TINY)
    out = os.path.join(wd, "proj.h5")

    def cal(files, np_=1, mdl=None, extra=()):
        return calibrate(mdl or model, out, files, np_=np_, extra=["--force", *extra],
                         expect=None)

    def refused_file(p, path, *words):
        refused(p, path, *words, code=1)
        check(not os.path.exists(out) and not leftovers(wd), f"{path}: output or leftovers")

    # seq_lens whose sum wraps around 2^64 back to T.
    sl = copy_to(shards[0], wd, "wrap")
    with h5py.File(sl, "r+") as f:
        T = f["keys"].shape[2]
        del f["seq_lens"]
        f["seq_lens"] = np.array([2**62, 2**62, 2**62, 2**62 + T], dtype=np.int64)
    refused_file(cal([sl, shards[1]]), sl, "seq_lens[0]")
    # evaluate reads the same field (it reported a --mem-limit error).
    calibrate(model, out, shards)
    p = run(["evaluate", "--progress", "off", "--model", model, "--proj", out, sl], expect=None)
    refused(p, sl, "seq_lens", code=1)
    os.remove(out)
    # bf16 bit patterns in an IEEE half (or int16) dataset, tagged bfloat16.
    for tag, name, kind in (("half", "keys", np.float16), ("signed", "values", np.int16)):
        bad = copy_to(shards[0], wd, tag)
        with h5py.File(bad, "r+") as f:
            bits = f[name][...]
            del f[name]
            f[name] = bits.view(kind)
            f[name].attrs["dtype"] = "bfloat16"
        refused_file(cal([bad, shards[1]]), bad, name, "bfloat16", "unsigned")
    # Virtual datasets: refused up front on every rank count (a missing
    # source read as zeros; a valid one failed only once split over ranks).
    src = copy_to(shards[0], wd, "source")
    for tag, keep_source in (("virtual", True), ("orphan", False)):
        v = os.path.join(wd, f"{tag}.h5")
        shutil.copy(shards[0], v)
        with h5py.File(src, "r") as s, h5py.File(v, "r+") as f:
            shape, dt = s["keys"].shape, s["keys"].dtype
            layout = h5py.VirtualLayout(shape=shape, dtype=dt)
            layout[...] = h5py.VirtualSource(src, "keys", shape=shape)
            del f["keys"]
            f.create_virtual_dataset("keys", layout)
            f["keys"].attrs["dtype"] = "bfloat16"
        if not keep_source:
            os.rename(src, src + ".gone")
        for np_ in (1, 2):
            refused_file(cal([v], np_=np_), v, "keys", "virtual")
    ext = copy_to(shards[0], wd, "external")
    with h5py.File(ext, "r+") as f:
        vals = f["values"][...]
        del f["values"]
        f.create_dataset("values", data=vals, external=[(os.path.join(wd, "raw.bin"), 0,
                                                         h5py.h5f.UNLIMITED)])
        f["values"].attrs["dtype"] = "bfloat16"
    refused_file(cal([ext, shards[1]]), ext, "values", "external")
    # One limit for string attributes, fixed or variable length.
    for kind in ("fixed", "variable"):
        big = copy_to(model, wd, kind)
        with h5py.File(big, "r+") as f:
            del f.attrs["model"]
            if kind == "fixed":
                f.attrs.create("model", np.bytes_(b"m" * 5000))
            else:
                f.attrs["model"] = "m" * 100000
        refused_file(cal(shards, mdl=big), big, "'model'", "4096")
    # An attribute HDF5 cannot read names the attribute.
    bad_attr = copy_to(model, wd, "attr")
    with h5py.File(bad_attr, "r+") as f:
        del f.attrs["num_layers"]
        f.attrs["num_layers"] = np.array(2**64 - 1, dtype=np.uint64)
    refused_file(cal(shards, mdl=bad_attr), bad_attr, "num_layers")
    finish("hostile_files")


def checkpoints():
    """A checkpoint with flipped bits or a NaN is refused, naming it; an
    intact one resumes to the uninterrupted result bit for bit."""
    wd, model, shards = small_set("checkpoints", seqs=6, seq_len=40, shards=3, **TINY)
    ref = os.path.join(wd, "ref.h5")
    calibrate(model, ref, shards, np_=2)
    ckpt = os.path.join(wd, "ckpt")
    out = os.path.join(wd, "proj.h5")
    kill = {"KQSVD_TEST_KILL_AFTER_CHECKPOINTS": "1"}
    calibrate(model, out, shards, np_=2, extra=["--checkpoint", ckpt], env=kill, expect=None)
    files = sorted(glob.glob(os.path.join(ckpt, "rank-*.h5")))
    if not check(len(files) == 2, f"expected 2 checkpoints, found {files}"):
        finish("checkpoints")
    saved = {f: open(f, "rb").read() for f in files}

    def damaged(how):
        for f, data in saved.items():
            open(f, "wb").write(data)
        with h5py.File(files[0], "r+") as f:
            state = f["state"][...]
            if how == "flip":
                bits = state.view(np.uint64)
                bits[len(bits) // 2] ^= np.uint64(1 << 20)
            else:
                state[len(state) // 3] = np.nan
            f["state"][...] = state
        p = calibrate(model, out, shards, np_=2, extra=["--checkpoint", ckpt], expect=None)
        refused(p, files[0], code=1)
        check("LAPACK" not in p.stderr, f"{how}: reported as a LAPACK failure")
        check(not os.path.exists(out), f"{how}: an output was written from a damaged checkpoint")

    damaged("flip")
    damaged("nan")
    for f, data in saved.items():
        open(f, "wb").write(data)
    # a save that a crash cut short left its temporary file, named uniquely
    crashed = files[0] + ".tmp-4242-0"
    open(crashed, "wb").write(b"cut short")
    calibrate(model, out, shards, np_=2, extra=["--checkpoint", ckpt])
    a, b = load_proj(ref), load_proj(out)
    check(all(np.array_equal(a[k], b[k]) for k in a if k != "attrs"),
          "a resumed run differs from the uninterrupted one")
    check(os.listdir(ckpt) == [], f"left in the checkpoint folder: {os.listdir(ckpt)}")
    finish("checkpoints")


def signals():
    """SIGUSR1 (SLURM's warning through mpirun) or SIGTERM stops a run at a
    safe point with a checkpoint and exit 75; the rerun equals an
    uninterrupted run bit for bit.  A signal while the output is written
    leaves no temporary file."""
    import signal
    import subprocess
    import time
    from harness import KQSVD, MPIEXEC, NPFLAG, PREFLAGS
    wd, model, shards = small_set("signals", seqs=8, seq_len=256, min_seq_len=256, shards=2,
                                  **TINY)
    blocks = ["--read-rows", "64", "--qr-block", "64"]
    ref = os.path.join(wd, "ref.h5")
    calibrate(model, ref, shards, np_=2, extra=blocks)
    slow = dict(os.environ, KQSVD_TEST_READ_DELAY_MS="60")

    def interrupted(tag, send, ckpt=True):
        out, ck = os.path.join(wd, f"{tag}.h5"), os.path.join(wd, f"ck-{tag}")
        args = [KQSVD, "calibrate", "--progress", "off", "--model", model, "--out", out, *blocks]
        args += ["--checkpoint", ck, "--checkpoint-every", "0"] if ckpt else []
        p = subprocess.Popen([MPIEXEC, NPFLAG, "2", *PREFLAGS, *args, *shards], env=slow,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        t0 = time.time()
        # Mid-stream: once a checkpoint exists (or a second has passed).
        while time.time() - t0 < 20 and not glob.glob(os.path.join(ck, "rank-*.h5")):
            if not ckpt and time.time() - t0 > 1.5:
                break
            time.sleep(0.05)
        send(p)
        try:
            _, err = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            check(False, f"{tag}: no exit within 60 s of the signal")
            return out, ck, args
        check(p.returncode == 75, f"{tag}: exit {p.returncode}, expected 75: {err[:800]}")
        check("interrupted by" in err, f"{tag}: no 'interrupted by' message: {err[:800]}")
        check(not os.path.exists(out) and not leftovers(wd), f"{tag}: output or leftovers")
        if ckpt:
            check(len(glob.glob(os.path.join(ck, "rank-*.h5"))) == 2 and
                  not glob.glob(os.path.join(ck, "*.tmp")), f"{tag}: checkpoints missing")
        else:
            check("nothing is kept" in err, f"{tag}: does not say nothing was kept: {err[:400]}")
        return out, ck, args

    def ranks_of(p):
        r = subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True)
        return [int(x) for x in r.stdout.split()]

    for tag, send in (("usr1", lambda p: p.send_signal(signal.SIGUSR1)),
                      ("term-one-rank", lambda p: os.kill(ranks_of(p)[-1], signal.SIGTERM))):
        out, ck, args = interrupted(tag, send)
        calibrate(model, out, shards, np_=2, extra=[*blocks, "--checkpoint", ck])
        a, b = load_proj(ref), load_proj(out)
        check(all(np.array_equal(a[k], b[k]) for k in a if k != "attrs"),
              f"{tag}: the resumed run differs from the uninterrupted one")
    interrupted("no-checkpoint", lambda p: p.send_signal(signal.SIGUSR1), ckpt=False)
    # A rank that crashes (as libhdf5 can on a damaged file) names the file
    # it was reading, and the launcher ends the job: no hang.
    out = os.path.join(wd, "crash.h5")
    p = subprocess.Popen([MPIEXEC, NPFLAG, "2", *PREFLAGS, KQSVD, "calibrate", "--progress", "off",
                          "--model", model, "--out", out, *blocks, *shards], env=slow,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(1.5)
    os.kill(ranks_of(p)[-1], signal.SIGSEGV)
    try:
        _, err = p.communicate(timeout=60)
        check(p.returncode != 0 and "fatal signal SIGSEGV" in err and "shard-" in err,
              f"crash: exit {p.returncode}: {err[:600]}")
    except subprocess.TimeoutExpired:
        p.kill()
        check(False, "crash: the other rank hung")
    check(not os.path.exists(out) and not leftovers(wd), "crash: output or leftovers")
    # SIGTERM while proj.h5 is written: no OUT.tmp-PID left behind.
    out = os.path.join(wd, "writing.h5")
    p = calibrate(model, out, shards, np_=2, env={"KQSVD_TEST_SIGNAL_WRITING": "15"},
                  expect=None)
    check(p.returncode != 0 and not os.path.exists(out) and not leftovers(wd),
          f"signal while writing: exit {p.returncode}, leftovers {leftovers(wd)}")
    finish("signals")
