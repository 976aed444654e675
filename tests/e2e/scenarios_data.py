"""Input-handling scenarios: element types, degenerate heads, bad input and
checkpoint/resume."""
import glob
import os
import re
import shutil
import subprocess
import time

import h5py
import numpy as np

from harness import (calibrate, check, finish, load_proj, run, small_set, synth, workdir, MPIEXEC,
                     FAILURES, NPFLAG, PREFLAGS, KQSVD)

ATTRS = ("num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size")


def put(f, name, x, kind):
    """Stores float64 x as `kind`; bf16 as uint16 (or int16) bit patterns."""
    if kind in ("bf16", "bf16s"):
        bits = (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        ds = f.create_dataset(name, data=bits.view(np.int16) if kind == "bf16s" else bits)
        ds.attrs["dtype"] = "bfloat16"
    else:
        f.create_dataset(name, data=x.astype({"f16": np.float16, "f32": np.float32, "f64": np.float64}[kind]))


def write_cache(path, K, V, Q, seq_lens, kinds=("f32",) * 3, causal=1, D=None, fmt="cache"):
    L, Hkv, T, d = K.shape
    with h5py.File(path, "w") as f:
        f.attrs.update(kqsvd_format=fmt, kqsvd_format_version=1, model="test", num_layers=L,
                       num_heads=Q.shape[1], num_kv_heads=Hkv, head_dim=d,
                       hidden_size=D or Q.shape[1] * d, causal=causal)
        for name, x, kind in (("keys", K, kinds[0]), ("values", V, kinds[1]), ("queries", Q, kinds[2])):
            put(f, name, x, kind)
        f["seq_lens"] = np.asarray(seq_lens, dtype=np.int64)


def write_model(path, O, Hq, Hkv, d, kind="f32", causal=1):
    with h5py.File(path, "w") as f:
        f.attrs.update(kqsvd_format="model", kqsvd_format_version=1, model="test", num_layers=O.shape[0],
                       num_heads=Hq, num_kv_heads=Hkv, head_dim=d, hidden_size=O.shape[1], causal=causal)
        put(f, "o_proj", O, kind)


def decode(raw, kind):
    if kind == "bf16":
        return (raw.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return raw.astype(np.float64)


def types():
    wd = workdir("types")
    rng = np.random.default_rng(3)
    L, H, T, d = 2, 2, 37, 8
    special16 = [0x0000, 0x8000, 0x0001, 0x8001, 0x03ff, 0x0400, 0x7bff, 0xfbff, 0x3c00]
    specialbf = [0x0000, 0x8000, 0x0001, 0x807f, 0x0080, 0x7f7f, 0xff7f, 0x3f80, 0x4049]
    for kind in ("bf16", "bf16s", "f16", "f32", "f64"):
        arrays = {}
        for name, h in (("keys", H), ("values", H), ("queries", 2 * H)):
            n = L * h * T * d
            if kind.startswith("bf16"):
                bits = rng.integers(0, 65536, n, dtype=np.uint32).astype(np.uint16)
                bits[(bits & 0x7F80) == 0x7F80] ^= 0x0100  # no Inf/NaN
                bits[:len(specialbf)] = specialbf
                raw = bits
            elif kind == "f16":
                bits = rng.integers(0, 65536, n, dtype=np.uint32).astype(np.uint16)
                bits[(bits & 0x7C00) == 0x7C00] ^= 0x0400
                bits[:len(special16)] = special16
                raw = bits.view(np.float16)
            elif kind == "f32":
                bits = rng.integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32)
                bits[(bits & 0x7F800000) == 0x7F800000] ^= 0x00800000
                bits[:3] = [0x00000001, 0x80000000, 0x7F7FFFFF]
                raw = bits.view(np.float32)
            else:
                raw = rng.standard_normal(n) * 10.0 ** rng.integers(-300, 300, n)
            arrays[name] = raw.reshape(L, h, T, d)
        path = os.path.join(wd, f"{kind}.h5")
        with h5py.File(path, "w") as f:
            f.attrs.update(kqsvd_format="cache", kqsvd_format_version=1, model="t", num_layers=L,
                           num_heads=2 * H, num_kv_heads=H, head_dim=d, hidden_size=4 * d, causal=0)
            for name, raw in arrays.items():
                ds = f.create_dataset(name, data=raw.view(np.int16) if kind == "bf16s" else raw)
                if kind.startswith("bf16"):
                    ds.attrs["dtype"] = "bfloat16"
            f["seq_lens"] = np.array([T], dtype=np.int64)
        out = os.path.join(wd, f"{kind}.bin")
        p = subprocess.run([os.environ["KQSVD_TEST_READ"], path, out], capture_output=True, text=True)
        if kind == "bf16s":
            # The contract stores bf16 as uint16: signed integers are refused.
            check(p.returncode != 0 and "unsigned" in p.stdout + p.stderr,
                  f"bf16 in int16 accepted: {p.stdout} {p.stderr}")
            continue
        check(p.returncode == 0, f"{kind}: reader failed: {p.stdout} {p.stderr}")
        got = np.fromfile(out, dtype=np.float64)
        want = np.concatenate([decode(arrays[n].reshape(-1), "bf16" if kind.startswith("bf16") else kind)
                               for n in ("keys", "values", "queries")])
        check(got.shape == want.shape and np.array_equal(got.view(np.uint64), want.view(np.uint64)),
              f"{kind}: decoded values differ bitwise")
        print(f"{kind}: {want.size} values decoded bit for bit")
    # A NaN is reported, not decoded silently.
    with h5py.File(os.path.join(wd, "f16.h5"), "r+") as f:
        q = f["queries"][...]
        q[1, 3, 5, 2] = np.float16("nan")
        f["queries"][...] = q
    p = subprocess.run([os.environ["KQSVD_TEST_READ"], os.path.join(wd, "f16.h5"), os.path.join(wd, "x.bin")],
                       capture_output=True, text=True)
    check(p.returncode == 3 and "queries layer 1" in p.stdout, f"NaN not reported: {p.stdout}")

    # Mixed element types within and across shards give exactly the results
    # of the same numbers stored as float64.
    Lm, Hq, Hkv, dm, Tm = 2, 4, 2, 8, 90
    def vals(*shape):
        return rng.integers(-255, 256, shape).astype(np.float64) / 8.0
    K, V, Q, O = vals(Lm, Hkv, 3 * Tm, dm), vals(Lm, Hkv, 3 * Tm, dm), vals(Lm, Hq, 3 * Tm, dm), vals(Lm, 16, Hq * dm)
    mixed = [("bf16", "f16", "f32"), ("f64", "f64", "f64"), ("f32", "bf16", "f16")]
    files = {"mixed": [], "f64": []}
    for s in range(3):
        part = slice(s * Tm, (s + 1) * Tm)
        for tag, kinds in (("mixed", mixed[s]), ("f64", ("f64",) * 3)):
            path = os.path.join(wd, f"{tag}-{s}.h5")
            write_cache(path, K[:, :, part], V[:, :, part], Q[:, :, part], [40, 50], kinds, D=16)
            files[tag].append(path)
    write_model(os.path.join(wd, "model-f16.h5"), O, Hq, Hkv, dm, "f16")
    write_model(os.path.join(wd, "model-f64.h5"), O, Hq, Hkv, dm, "f64")
    calibrate(os.path.join(wd, "model-f16.h5"), os.path.join(wd, "proj-mixed.h5"), files["mixed"],
              np_=2)
    calibrate(os.path.join(wd, "model-f64.h5"), os.path.join(wd, "proj-f64.h5"), files["f64"], np_=2)
    a, b = load_proj(os.path.join(wd, "proj-mixed.h5")), load_proj(os.path.join(wd, "proj-f64.h5"))
    same = all(np.array_equal(a[k], b[k]) for k in a if k != "attrs")
    check(same, "mixed element types changed the results")
    finish("types")


def degenerate():
    wd = workdir("degenerate")
    rng = np.random.default_rng(9)
    L, Hq, Hkv, d, D, T = 2, 4, 2, 8, 16, 200
    K, V = rng.standard_normal((L, Hkv, T, d)), rng.standard_normal((L, Hkv, T, d))
    Q = rng.standard_normal((L, Hq, T, d))
    O = rng.standard_normal((L, D, Hq * d))
    K[0, 0], V[0, 0], Q[0, 0:2] = 0, 0, 0          # layer 0, group 0: nothing at all
    O[0, :, 0:2 * d] = 0
    K[0, 1] = rng.standard_normal((T, 3)) @ rng.standard_normal((3, d))  # rank 3 keys
    V[0, 1] = rng.standard_normal((T, 2)) @ rng.standard_normal((2, d))  # rank 2 values
    files = []
    for s, part in enumerate((slice(0, 120), slice(120, T))):
        files.append(os.path.join(wd, f"shard-{s}.h5"))
        write_cache(files[-1], K[:, :, part], V[:, :, part], Q[:, :, part], [part.stop - part.start], D=D)
    write_model(os.path.join(wd, "model.h5"), O, Hq, Hkv, d)
    out = os.path.join(wd, "proj.h5")
    calibrate(os.path.join(wd, "model.h5"), out, files, np_=2)
    p = load_proj(out)
    check(all(np.isfinite(v).all() for k, v in p.items() if k != "attrs"), "non-finite output")
    check(np.abs(p["kqsvd/key_down"][0, 0]).max() == 0 and np.abs(p["kqsvd/value_up"][0, 0]).max() == 0,
          "zero head: kqsvd projections should be zero")
    check(np.abs(p["spectra/K"][0, 0]).max() == 0, "zero head: spectrum should be zero")
    for name in ("rank_k", "rank_v"):
        check(((p[f"kqsvd/{name}"] >= 1) & (p[f"kqsvd/{name}"] <= d)).all(), f"{name} out of range")
    k, q = K[0, 1], np.concatenate([Q[0, 2], Q[0, 3]])
    kq = np.linalg.svd(k @ q.T, compute_uv=False)[:d]
    A, B = p["kqsvd/key_down"][0, 1], p["kqsvd/query_down"][0, 1]
    for r in range(1, d + 1):
        M = k @ q.T
        e = (((k @ A[:, :r]) @ (q @ B[:, :r]).T - M) ** 2).sum() / (M ** 2).sum()
        check(abs(e - (kq[r:] ** 2).sum() / (kq ** 2).sum()) <= 1e-9, f"rank-3 head, r={r}: {e}")
    finish("degenerate")


def bad_input():
    wd = workdir("bad_input")
    model, shards = synth(os.path.join(wd, "ok"), layers=2, heads=6, kv_heads=2, head_dim=8,
                          seqs=6, seq_len=40, shards=3, dtype="bf16")
    out = os.path.join(wd, "proj.h5")

    def case(name, needles, args=None, files=None, mdl=None, code=1, np_=2):
        args = args or []
        cmd = [MPIEXEC, NPFLAG, str(np_)] + PREFLAGS + [KQSVD, "calibrate", "--progress", "off",
               "--model", mdl or model, "--out", out] + args + (files if files is not None else shards)
        t0 = time.time()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        except subprocess.TimeoutExpired:
            check(False, f"{name}: hung")
            return
        err = p.stderr
        check(p.returncode != 0, f"{name}: exit code 0")
        if code == 2:
            check("error:" in err and "--help" in err, f"{name}: usage errors point to --help")
        for n in needles:
            check(n in err, f"{name}: message lacks '{n}':\n{err}")
        check(err.count("error") >= 1 and "kqsvd calibrate: error" in err, f"{name}: no error line")
        left = [f for f in os.listdir(wd) if f.startswith("proj.h5")]
        check(not left, f"{name}: left {left} behind")
        print(f"{name}: {time.time() - t0:.1f}s ({err.strip().splitlines()[0][:120]})")

    def copy(src, tag):
        dst = os.path.join(wd, f"{tag}-{os.path.basename(src)}")
        shutil.copy(src, dst)
        return dst

    case("missing file", ["nope.h5", "No such file"], files=shards + [os.path.join(wd, "nope.h5")])
    junk = os.path.join(wd, "junk.h5")
    open(junk, "w").write("this is not HDF5\n" * 100)
    case("not HDF5", ["junk.h5", "not an HDF5 file"], files=[junk] + shards[1:])
    trunc = copy(shards[1], "trunc")
    os.truncate(trunc, os.path.getsize(trunc) // 2)
    case("truncated shard", [trunc], files=[shards[0], trunc, shards[2]], np_=3)
    fmt = copy(shards[0], "fmt")
    with h5py.File(fmt, "r+") as f:
        f.attrs["kqsvd_format"] = "model"
    case("wrong format", [fmt, "kqsvd_format", '"cache"'], files=[fmt] + shards[1:])
    ver = copy(shards[0], "ver")
    with h5py.File(ver, "r+") as f:
        f.attrs["kqsvd_format_version"] = 2
    case("wrong version", [ver, "kqsvd_format_version"], files=[ver] + shards[1:])
    variants = {"num_layers": dict(layers=3), "num_heads": dict(heads=8), "num_kv_heads": dict(kv_heads=3),
                "head_dim": dict(head_dim=4), "hidden_size": dict(hidden=40)}
    for attr, opt in variants.items():
        base = dict(layers=2, heads=6, kv_heads=2, head_dim=8, seqs=2, seq_len=20, shards=1)
        base.update(opt)
        _, other = synth(os.path.join(wd, f"other-{attr}"), **base)
        case(f"{attr} differs", [other[0], attr, "model.h5"], files=shards[:2] + other)
    mult = copy(model, "mult")
    with h5py.File(mult, "r+") as f:
        f.attrs["num_heads"] = 5
    case("Hq not a multiple of Hkv", [mult, "num_heads", "not a multiple"], mdl=mult)
    sl = copy(shards[2], "seqlens")
    with h5py.File(sl, "r+") as f:
        f["seq_lens"][0] += 1
    case("seq_lens sum", [sl, "seq_lens", "goes past the T"], files=shards[:2] + [sl])
    nan = copy(shards[1], "nan")
    with h5py.File(nan, "r+") as f:
        q = f["queries"][...]
        q[1, 4, 5, 3] = 0x7FC0
        f["queries"][...] = q
    case("NaN in queries", [nan, "'queries'", "NaN or Inf", "layer 1", "head 4", "row 5"],
         files=[shards[0], nan, shards[2]], np_=3)
    inf = copy(shards[2], "inf")
    with h5py.File(inf, "r+") as f:
        k = f["keys"][...]
        k[0, 1, 7, 0] = 0xFF80
        f["keys"][...] = k
    case("Inf in keys", [inf, "'keys'", "layer 0", "head 1", "row 7"], files=shards[:2] + [inf])
    mnan = copy(model, "nan")
    with h5py.File(mnan, "r+") as f:
        o = f["o_proj"][...]
        o[1, 3, 20] = 0x7FC0
        f["o_proj"][...] = o
    case("NaN in o_proj", [mnan, "'o_proj'", "layer 1"], mdl=mnan)
    nov = copy(shards[0], "novalues")
    with h5py.File(nov, "r+") as f:
        del f["values"]
    case("missing dataset", [nov, "'values'", "missing"], files=[nov] + shards[1:])
    shortq = copy(shards[0], "shortq")
    with h5py.File(shortq, "r+") as f:
        q = f["queries"][...]
        del f["queries"]
        f.create_dataset("queries", data=q[:, :, :-1])
        f["queries"].attrs["dtype"] = "bfloat16"
    case("queries shape", [shortq, "'queries'", "T ="], files=[shortq] + shards[1:])
    noo = copy(model, "nooproj")
    with h5py.File(noo, "r+") as f:
        del f["o_proj"]
    case("model without o_proj", [noo, "'o_proj'", "missing"], mdl=noo)
    for bad in ("0", "1", "1.5", "-0.1", "abc", "nan"):
        case(f"--eps {bad}", ["--eps"], args=["--eps", bad], code=2)
    case("--beta -1", ["--beta"], args=["--beta", "-1"], code=2)
    case("unknown option", ["unknown option", "--frobnicate"], args=["--frobnicate"], code=2)
    case("shard twice", ["given twice"], files=shards + [shards[0]], code=2)
    p = calibrate(model, shards[1], shards, np_=2, expect=1)
    check("is also an input" in p.stderr and p.returncode == 2, f"--out = input: {p.stderr}")
    case("tiny memory limit", ["--mem-limit"], args=["--mem-limit", "16"], code=2)
    # Ranks owning different numbers of items must still decide alike.
    wide_model, wide = synth(os.path.join(wd, "wide"), layers=3, heads=1, kv_heads=1, head_dim=512,
                             hidden=512, seqs=2, seq_len=64, shards=1)
    case("memory limit, uneven items", ["--mem-limit"], args=["--mem-limit", "110", "--qr-block", "512"],
         files=wide, mdl=wide_model, code=2)
    nodir = os.path.join(wd, "no", "such", "folder", "proj.h5")
    p = calibrate(model, nodir, shards, np_=2, expect=1)
    check(nodir in p.stderr and "does not exist" in p.stderr, f"missing output folder: {p.stderr}")
    finish("bad_input")


def checkpoint():
    wd, model, shards = small_set("checkpoint", layers=2, heads=4, kv_heads=2, head_dim=16,
                                  seqs=12, seq_len=100, shards=6, uneven=True)
    ref = os.path.join(wd, "ref.h5")
    calibrate(model, ref, shards, np_=2)
    # seq_len: the longest sequence of any shard, whichever rank read it.
    longest = 0
    for sh in shards:
        with h5py.File(sh, "r") as f:
            longest = max(longest, int(f["seq_lens"][...].max()))
    with h5py.File(ref, "r") as f:
        got = f.attrs.get("seq_len")
    check(got is not None and int(got) == longest, f"seq_len {got}, the longest sequence {longest}")
    out, ck = os.path.join(wd, "proj.h5"), os.path.join(wd, "ck")
    args = ["--checkpoint", ck, "--checkpoint-every", "0"]
    kill = {"KQSVD_TEST_KILL_AFTER_CHECKPOINTS": "5", "KQSVD_TEST_KILL_RANK": "1"}
    calibrate(model, out, shards, np_=2, extra=args, env=kill, expect=1)
    check(not os.path.exists(out), "a killed run left its output")
    check(len(glob.glob(os.path.join(ck, "rank-*.h5"))) == 2, "no checkpoints after the kill")
    p = calibrate(model, out, shards, np_=2, extra=args + ["--progress", "lines"])
    check("resuming" in p.stderr, f"the rerun did not resume: {p.stderr}")
    a, b = load_proj(ref), load_proj(out)
    check(all(np.array_equal(a[k], b[k]) for k in a if k != "attrs"),
          "resumed output differs from the uninterrupted run")
    check(not glob.glob(os.path.join(ck, "rank-*.h5")), "checkpoints left after success")
    os.remove(out)
    # With the default timer, every finished shard is still kept.
    kill1 = {"KQSVD_TEST_KILL_AFTER_CHECKPOINTS": "2", "KQSVD_TEST_KILL_RANK": "0"}
    calibrate(model, out, shards, np_=2, extra=["--checkpoint", ck], env=kill1, expect=1)
    p = calibrate(model, out, shards, np_=2, extra=["--checkpoint", ck, "--progress", "lines"])
    m = re.search(r"resuming \d of 2 ranks .*, ([0-9.]+)% already done", p.stderr)
    check(m and float(m.group(1)) > 0, f"finished shards were not kept: {p.stderr}")
    b = load_proj(out)
    check(all(np.array_equal(a[k], b[k]) for k in a if k != "attrs"), "second resume differs")
    os.remove(out)
    # A checkpoint of another rank count, or of other inputs, is refused.
    calibrate(model, out, shards, np_=2, extra=args, env=kill, expect=1)
    p = calibrate(model, out, shards, np_=3, extra=args, expect=1)
    check("2 ranks" in p.stderr and ck in p.stderr, f"rank count change not refused: {p.stderr}")
    os.utime(shards[0], (1, 1))
    p = calibrate(model, out, shards, np_=2, extra=args, expect=1)
    check("other inputs or options" in p.stderr, f"changed input not refused: {p.stderr}")
    check(not os.path.exists(out), "refused resume left output")
    finish("checkpoint")


def examples():
    """examples/compress_cache.py and the inspection script, on a fresh set."""
    import sys
    wd, model, files = small_set("examples", layers=2, heads=4, kv_heads=2, head_dim=16,
                                 seqs=6, seq_len=64, shards=2)
    out = os.path.join(wd, "proj.h5")
    calibrate(model, out, files, np_=2)
    ex = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples")
    p = subprocess.run([sys.executable, os.path.join(ex, "inspect_proj.py"), model, out, files[0]],
                       capture_output=True, text=True)
    check(p.returncode == 0, f"inspect_proj.py failed: {p.stderr}")
    rows = [l.split() for l in p.stdout.splitlines() if re.match(r"\s+\d+\s", l)]
    check(len(rows) == 2, f"inspect_proj.py printed {len(rows)} layer rows")
    for r in rows:  # kqsvd's K Q^T error is the smallest on calibration data
        check(float(r[4]) <= min(float(r[5]), float(r[6])) * (1 + 1e-12), f"kqsvd not best: {r}")
    try:
        import torch  # noqa: F401
    except ImportError:
        print("SKIPPED: PyTorch is not installed (Debian: python3-torch)")
        # finish() exits: failures so far fail the test, otherwise skipped.
        if FAILURES:
            finish("examples")
        raise SystemExit(77)
    p = subprocess.run([sys.executable, os.path.join(ex, "compress_cache.py"), out, files[0], "1"],
                       capture_output=True, text=True)
    check(p.returncode == 0, f"compress_cache.py failed: {p.stderr}")
    m = re.search(r"relative score error ([0-9.e+-]+)", p.stdout)
    check(m and abs(float(m.group(1)) - float(rows[1][4])) <= 1e-9, f"snippet {p.stdout} vs {rows[1]}")
    print(p.stdout.strip())
    finish("examples")


def full_disk_is_ordinary(wd, tiny, model, files):
    """A full disk under synth --out, calibrate --out and --checkpoint: one
    line "no space left on device" naming the file, exit 1, no MPI_ABORT
    banner (the failure is agreed, not fatal), no crash and nothing left:
    no folder the run made, for --out as for --checkpoint, which calibrate
    makes when it checks its options (issue 61, item 23)."""
    small = ["--layers", "2", "--heads", "4", "--kv-heads", "2", "--head-dim", "32", "--seqs",
             "4", "--seq-len", "64", "--shards", "2", "--progress", "off"]
    cases = [("synth", None, ["synth", "--out", os.path.join(tiny, "new", "set")] + small,
              os.path.join(tiny, "new", "set", "shard-0000.h5"))]
    for np_ in (None, 1):
        cases += [(f"calibrate np {np_}", np_, ["calibrate", "--progress", "off", "--model", model,
                                                "--out", os.path.join(tiny, "p.h5"), *files],
                   os.path.join(tiny, "p.h5")),
                  (f"--checkpoint np {np_}", np_,
                   ["calibrate", "--progress", "off", "--model", model, "--out",
                    os.path.join(wd, "elsewhere.h5"), "--checkpoint",
                    os.path.join(tiny, "new", "ck"), *files], os.path.join(tiny, "new", "ck"))]
    for what, np_, args, names in cases:
        p = run(args, np_=np_, expect=1)
        err = [ln for ln in p.stderr.splitlines() if "error" in ln]
        check(p.returncode == 1 and len(err) == 1 and names in err[0] and
              "no space left on device" in err[0], f"{what}: exit {p.returncode}, {p.stderr}")
        check("MPI_ABORT" not in p.stderr and "HDF5" not in p.stderr, f"{what}: {p.stderr}")
        check(not os.listdir(tiny), f"{what}: left {os.listdir(tiny)}")
        check(not os.path.exists(os.path.join(wd, "elsewhere.h5")), f"{what}: wrote the output")


def disk_full():
    """A full disk while writing: one message naming the file, no crash, no output."""
    wd, model, files = small_set("disk_full", layers=2, heads=4, kv_heads=2, head_dim=32,
                                 seqs=4, seq_len=64, shards=2)
    tiny = os.path.join(wd, "tiny")
    os.makedirs(tiny)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", tiny],
                      capture_output=True).returncode != 0:
        print("SKIPPED: cannot mount a small tmpfs here (needs root)")
        raise SystemExit(77)
    try:
        for np_ in (1, 2):
            out = os.path.join(tiny, "proj.h5")
            p = calibrate(model, out, files, np_=np_, expect=1)
            check("Segmentation" not in p.stderr and p.returncode != 139, f"np {np_}: crashed")
            check(out in p.stderr and "kqsvd calibrate: error" in p.stderr, f"np {np_}: {p.stderr}")
            check(not os.listdir(tiny), f"np {np_}: left {os.listdir(tiny)}")
        full_disk_is_ordinary(wd, tiny, model, files)
    finally:
        subprocess.run(["umount", tiny])
    # Room for the file to be created but not for all of it: the space is
    # claimed before any data is written, so no rank can fail inside the
    # collective close (2 ranks hung there).
    full = os.path.join(wd, "full.h5")
    calibrate(model, full, files, np_=2)
    size = os.path.getsize(full)
    for np_, room in ((1, size // 2), (2, size // 2), (2, size - 4096), (2, size - 3 * 4096)):
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={room // 4096 * 4096}", "tmpfs", tiny],
                       check=True)
        try:
            out = os.path.join(tiny, "proj.h5")
            try:
                p = run(["calibrate", "--progress", "off", "--model", model, "--out", out, *files],
                        np_=np_, expect=1, timeout=60)
                check(out in p.stderr and "no space left" in p.stderr.lower(),
                      f"{room} bytes free, np {np_}: {p.stderr[:600]}")
            except subprocess.TimeoutExpired:
                check(False, f"{room} bytes free, np {np_}: hung")
            check(not os.listdir(tiny), f"{room} bytes free, np {np_}: left {os.listdir(tiny)}")
        finally:
            subprocess.run(["umount", tiny])
    # Enough room: the reservation is given back, the file is as before.
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={2 * size // 4096 * 4096}", "tmpfs", tiny],
                   check=True)
    try:
        out = os.path.join(tiny, "proj.h5")
        calibrate(model, out, files, np_=2)
        check(os.path.getsize(out) == size, f"{os.path.getsize(out)} bytes, expected {size}")
        a, b = load_proj(full), load_proj(out)
        check(all(np.array_equal(a[k], b[k]) for k in a if k != "attrs"), "results differ")
    finally:
        subprocess.run(["umount", tiny])
    finish("disk_full")
