"""The manifest reader (`kqsvd manifest`, `calibrate --manifest`) on hostile
and large manifests: special files, long lines, control characters in lines
and in resolved paths, every bad line reported, normalised paths and
NUL-separated file lists, lines naming a model (hf:) instead of caches,
thousands of lines in well under a second, and outputs that are another
line's (or the same line's) inputs.  Runs alone,
as ctest's e2e_manifest_reader and e2e_slurm_scripts do:
`python3 scenarios_manifest.py manifest_reader|slurm_scripts` (the second,
the job scripts against stand-ins for SLURM, is in scenarios_slurm.py)."""
import os
import resource
import subprocess
import time

from harness import KQSVD, check, finish, run, synth, workdir


def manifest_cmd(*args, timeout=20):
    """kqsvd manifest ARGS in at most 2 GiB of address space (the old reader
    read /dev/zero until memory ran out); None when it hangs."""
    def limit():
        # AddressSanitizer reserves terabytes of address space up front.
        if "ASAN_OPTIONS" not in os.environ:
            resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
    try:
        return subprocess.run([KQSVD, "manifest", *[str(a) for a in args]], capture_output=True,
                              text=True, timeout=timeout, preexec_fn=limit)
    except subprocess.TimeoutExpired:
        return None


def write(path, text, mode="w"):
    with open(path, mode) as f:
        f.write(text)
    return path


def refused(name, p, *needles):
    """Exit code 1, nothing on stdout, every needle in stderr."""
    if not check(p is not None, f"{name}: kqsvd manifest did not return"):
        return
    check(p.returncode == 1, f"{name}: exit code {p.returncode}, stderr {p.stderr!r}")
    check(p.stdout == "", f"{name}: output despite the error: {p.stdout!r}")
    for n in needles:
        check(n in p.stderr, f"{name}: {n!r} not in {p.stderr!r}")


def files(wd, *names):
    """Empty files: the reader only globs and stats its inputs."""
    for n in names:
        os.makedirs(os.path.dirname(os.path.join(wd, n)), exist_ok=True)
        open(os.path.join(wd, n), "w").close()


def special_files(wd):
    fifo = os.path.join(wd, "fifo.txt")
    os.mkfifo(fifo)
    refused("fifo", manifest_cmd(fifo), "fifo.txt is not a regular file")
    refused("/dev/zero", manifest_cmd("/dev/zero"), "/dev/zero is not a regular file")
    refused("a folder", manifest_cmd(wd), "is not a regular file")
    big = os.path.join(wd, "big.txt")
    with open(big, "wb") as f:
        f.truncate(17 << 20)  # sparse: 17 MiB of NUL bytes
    refused("17 MiB", manifest_cmd(big), "more than the 16777216")
    # A folder of four links to itself among 2000 files: seven levels of
    # "l*" would open 4^7 folders of 2004 entries each, so the budget, not
    # the tree, must end the walk.  Few names match, so glob allocates
    # little, which keeps the walk quick under AddressSanitizer.
    loop = os.path.join(wd, "loop")
    os.makedirs(loop)
    for k in range(4):
        os.symlink(".", os.path.join(loop, f"l{k}"))
    for k in range(2000):
        open(os.path.join(loop, f"f{k:04d}"), "w").close()
    deep = write(os.path.join(wd, "deep.txt"),
                 "x a/model.h5 out/x.h5 loop/" + "/".join(["l*"] * 7) + "/shard.h5\n")
    refused("deep glob", manifest_cmd(deep, timeout=60), "deep.txt:1: SHARD_GLOB ",
            "manifest_reader/loop/l*/l*/l*/l*/l*/l*/l*/shard.h5 reads",
            "reads more than 1048576 folder entries")
    # Through the whole file system (and /proc's loops) it stops too; how
    # much a machine's tree holds decides which of the two errors it is.
    root = write(os.path.join(wd, "root.txt"), "x a/model.h5 out/x.h5 /" + "/".join(["*"] * 40) + "\n")
    refused("glob from /", manifest_cmd(root, timeout=60), "root.txt:1: SHARD_GLOB /*/*/*")
    good = "x a/model.h5 out/x.h5 a/shard-*.h5\n"
    long = write(os.path.join(wd, "long.txt"), good + "y " + "a" * 70000 + " b c d\n" + good)
    refused("long line", manifest_cmd(long), "long.txt:2: line longer than 65536 bytes")


def control_characters(wd):
    """A NUL cut the line short, a tab in a folder's name shifted the tab-
    separated table, a newline in a shard's name the job's file list."""
    good = "x a/model.h5 out/x.h5 a/shard-*.h5"
    nul = write(os.path.join(wd, "nul.txt"), good + "\0 0.1\n", "w")
    refused("NUL byte", manifest_cmd(nul), "nul.txt:1: NUL byte at column 35")
    vt = write(os.path.join(wd, "vt.txt"), "x a/model.h5\vout/x.h5 a/shard-*.h5\n")
    refused("vertical tab", manifest_cmd(vt), "vt.txt:1: control character 0x0b at column 13")
    crlf = write(os.path.join(wd, "crlf.txt"), good + "\r\n")
    p = manifest_cmd(crlf)
    check(p is not None and p.returncode == 0, f"CRLF line ends: {p and p.stderr}")

    tabbed = os.path.join(wd, "ta\tb")
    files(tabbed, "a/model.h5", "a/shard-0.h5")
    os.makedirs(os.path.join(tabbed, "out"))
    m = write(os.path.join(tabbed, "m.txt"), good + "\n")
    p = manifest_cmd(m)
    refused("tab in the manifest's folder", p, "ta\\tb/m.txt:1: OUTPUT_H5 out/x.h5 resolves to",
            "holds a control character")
    check(p is None or "\t" not in p.stderr, f"the message holds a raw tab: {p and p.stderr!r}")
    # The same files named by absolute paths from elsewhere are fine.
    m2 = write(os.path.join(wd, "abs.txt"), f"x {wd}/a/model.h5 {wd}/out/x.h5 {wd}/a/shard-*.h5\n")
    p = manifest_cmd(m2)
    check(p is not None and p.returncode == 0, f"absolute paths: {p and p.stderr}")

    files(wd, "nl/model.h5", "nl/s-0.h5", "nl/s-1\n--force.h5")
    m = write(os.path.join(wd, "nl.txt"), "x nl/model.h5 out/x.h5 nl/s-*.h5\n")
    refused("newline in a shard's name", manifest_cmd(m),
            "nl.txt:1: SHARD_GLOB", "s-1\\n--force.h5', whose name holds a control character")


def all_bad_lines(wd):
    """Every bad line, one MANIFEST:LINE: reason each, in line order."""
    text = ("x a/model.h5 out/x.h5 a/shard-*.h5\n"
            "y a/model.h5 out/y.h5 nope/*.h5\n"          # 2: no shards
            "z a/model.h5 out/z.h5 a/shard-*.h5 7\n"     # 3: bad EPS
            "w a/model.h5 out/w.h5 a/shard-*.h5\n"
            "x a/model.h5 out/x2.h5 a/shard-*.h5\n"      # 5: NAME again
            "v a/model.h5 out/x.h5 a/shard-*.h5\n")      # 6: OUTPUT_H5 again
    m = write(os.path.join(wd, "bad.txt"), text)
    p = manifest_cmd(m)
    refused("4 bad lines", p, "bad.txt: 4 bad lines")
    if p:
        lines = [ln for ln in p.stderr.splitlines() if "bad.txt:" in ln and "bad lines" not in ln]
        want = [":2: SHARD_GLOB", ":3: EPS '7'", ":5: NAME 'x' is already used on line 1",
                ":6: OUTPUT_H5 " + os.path.join(wd, "out", "x.h5") + " is already the output of line 1"]
        check(len(lines) == 4 and all(w in ln for w, ln in zip(want, lines)),
              f"4 bad lines: {p.stderr}")
    # NAMEs name files and are words in job scripts.
    names = write(os.path.join(wd, "names.txt"), "-x a/model.h5 out/x.h5 a/shard-*.h5\n" +
                  "n" * 201 + " a/model.h5 out/y.h5 a/shard-*.h5\n")
    refused("names", manifest_cmd(names), "names.txt: 2 bad lines",
            "names.txt:1: NAME '-x' must be 1 to 200 letters", "names.txt:2: NAME 'nnnn")
    # More than the error record holds: kqsvd manifest and calibrate
    # --manifest (rank 0 only, under MPI) list them all, once.
    many = write(os.path.join(wd, "many.txt"),
                 "".join(f"m{i} a/model.h5 out/m{i}.h5 nope{i}/*.h5\n" for i in range(60)))
    p = manifest_cmd(many)
    refused("60 bad lines", p, "many.txt: 60 bad lines")
    for i in (1, 30, 60):
        check(p is None or f"many.txt:{i}: SHARD_GLOB" in p.stderr, f"line {i} not reported")
    p = run(["calibrate", "--manifest", many], np_=2, expect=1)
    check("many.txt: 60 bad lines" in p.stderr and p.stderr.count("many.txt:1:") == 1
          and all(f"many.txt:{i}: SHARD_GLOB" in p.stderr for i in (1, 30, 60)),
          f"calibrate --manifest with 60 bad lines: {p.stderr}")


def normalised(wd):
    """Absolute paths without '.', '..' or '//', through a symlinked folder;
    file lists NUL-separated."""
    files(wd, "a/model.h5", "a/shard-0.h5", "a/shard-1.h5", "v/s 0.h5")
    os.makedirs(os.path.join(wd, "out"), exist_ok=True)
    os.symlink(os.path.join(wd, "a"), os.path.join(wd, "link"))
    m = write(os.path.join(wd, "norm.txt"),
              "x ./a/../a/model.h5 out/./x.h5 ./a//shard-*.h5 0.2 v/./*.h5\n"
              "y link/../a/model.h5 out/sub/../y.h5 link/shard-*.h5\n")
    os.makedirs(os.path.join(wd, "out", "sub"))
    lists = os.path.join(wd, "lists")
    os.makedirs(lists)
    p = manifest_cmd(m, "--lists", lists)
    check(p is not None and p.returncode == 0, f"normalised: {p and p.stderr}")
    if not p or p.returncode:
        return
    real = os.path.realpath(wd)
    rows = [ln.split("\t") for ln in p.stdout.splitlines()]
    want = [["x", f"{real}/a/model.h5", f"{real}/out/x.h5", "eps:0.2", "2", f"{real}/a/shard-*.h5",
             f"{real}/v/*.h5"],
            # link/.. is the folder holding link's target, as the kernel sees it.
            ["y", f"{real}/a/model.h5", f"{real}/out/y.h5", "-", "2", f"{real}/a/shard-*.h5", "-"]]
    for r in want:
        r.append("-")  # the SEQ_LEN of an in-situ line
    check(rows == want, f"normalised paths: {rows} vs {want}")
    raw = open(os.path.join(lists, "x.shards"), "rb").read()
    check(raw == f"{real}/a/shard-0.h5\0{real}/a/shard-1.h5\0".encode(), f"x.shards: {raw!r}")
    raw = open(os.path.join(lists, "x.valid"), "rb").read()
    check(raw == f"{real}/v/s 0.h5\0".encode(), f"x.valid: {raw!r}")
    p = run(["manifest", "--help"])
    check("NUL" in p.stdout and "mapfile -d ''" in p.stdout, f"--help: {p.stdout}")


def insitu_lines(wd):
    """Lines naming a model (hf:) beside a cache line: the table's eight
    fields, no file lists for them, their own refusals (several on one
    manifest), and calibrate --manifest refusing them by line."""
    files(wd, "a/model.h5", "a/shard-0.h5", "m/config.json", "g/tiny.gguf", "t/calib.txt",
          "t/valid.txt")
    os.makedirs(os.path.join(wd, "out"))
    real = os.path.realpath(wd)
    m = write(os.path.join(wd, "hf.txt"),
              "c a/model.h5 out/c.h5 a/shard-*.h5\n"
              "h hf:m out/h.h5 t/calib.txt 2048 128   # a folder\n"
              "g hf:./g/../g/tiny.gguf out/g.h5 t/calib.txt 64 12 0.2 t/valid.txt\n")
    lists = os.path.join(wd, "lists")
    os.makedirs(lists)
    p = manifest_cmd(m, "--lists", lists)
    check(p is not None and p.returncode == 0, f"in-situ lines: {p and p.stderr}")
    rows = [ln.split("\t") for ln in p.stdout.splitlines()] if p else []
    want = [["c", f"{real}/a/model.h5", f"{real}/out/c.h5", "-", "1", f"{real}/a/shard-*.h5", "-",
             "-"],
            ["h", f"hf:{real}/m", f"{real}/out/h.h5", "-", "128", f"{real}/t/calib.txt", "-", "2048"],
            ["g", f"hf:{real}/g/tiny.gguf", f"{real}/out/g.h5", "eps:0.2", "12",
             f"{real}/t/calib.txt", f"{real}/t/valid.txt", "64"]]
    check(rows == want, f"in-situ table: {rows} vs {want}")
    check(sorted(os.listdir(lists)) == ["c.shards"], f"lists: {os.listdir(lists)}")

    bad = write(os.path.join(wd, "hfbad.txt"),
                "a hf:none out/1.h5 t/calib.txt 64 2\n"                # 1: no model
                "b hf: out/2.h5 t/calib.txt 64 2\n"                    # 2: empty
                "c hf:m out/3.h5 t/calib.txt 0 2\n"                    # 3: SEQ_LEN
                "d hf:m out/4.h5 t/calib.txt 64 16777217\n"            # 4: NUM_SEQS
                "e hf:m out/5.h5 t/calib.txt 64\n"                     # 5: fields
                "f hf:m out/6.h5 t/nope.txt 64 2\n"                    # 6: no text
                "g hf:m out/7.h5 t 64 2\n"                             # 7: a folder
                "h hf:m t/calib.txt t/valid.txt 64 2\n"                # 8: output = text
                "i hf:g/tiny.gguf g/tiny.gguf t/calib.txt 64 2\n"      # 9: output = model
                "j hf:m out/10.h5 t/calib.txt 64 2 eps:2\n"            # 10: policy
                "k hf:m out/11.h5 t/calib.txt 64 2 0.1 t/calib.txt x\n")  # 11: fields
    p = manifest_cmd(bad)
    refused("bad in-situ lines", p, "hfbad.txt: 11 bad lines",
            f"hfbad.txt:1: MODEL {real}/none: No such file or directory",
            "hfbad.txt:2: MODEL 'hf:' names no model",
            "hfbad.txt:3: SEQ_LEN '0' must be a whole number from 1 to 16777216",
            "hfbad.txt:4: NUM_SEQS '16777217' must be",
            "hfbad.txt:5: 5 fields, expected NAME hf:MODEL OUTPUT_H5 TEXT SEQ_LEN NUM_SEQS",
            f"hfbad.txt:6: TEXT {real}/t/nope.txt: No such file",
            f"hfbad.txt:7: TEXT {real}/t is not a regular file",
            f"hfbad.txt:8: OUTPUT_H5 {real}/t/calib.txt is the TEXT of line",
            f"hfbad.txt:9: OUTPUT_H5 {real}/g/tiny.gguf is the MODEL of this line",
            "hfbad.txt:10: EPS 'eps:2'",
            "hfbad.txt:11: too many fields: expected NAME hf:MODEL")
    # kqsvd calibrate reads caches: the good manifest is refused by line,
    # before anything is made.
    p = run(["calibrate", "--progress", "off", "--manifest", m], np_=2, expect=1)
    check(p.stderr.count("error") == 1 and "hf.txt:2: h names a model (hf:), not cache shards "
          "(and so do later lines)" in p.stderr and "slurm/kqsvd-submit" in p.stderr,
          f"calibrate --manifest with hf: lines: {p.stderr}")
    check(os.listdir(os.path.join(wd, "out")) == [], "calibrate --manifest wrote an output")


def thousands(wd):
    """2,000 lines whose outputs exist (a resubmission) took 40 s; sorted
    checks take well under a second, and still find a clash at the end."""
    n = 2000
    os.makedirs(os.path.join(wd, "out"))
    open(os.path.join(wd, "model.h5"), "w").close()
    lines = []
    for i in range(n):
        os.makedirs(os.path.join(wd, f"s{i}"))
        for k in range(2):
            open(os.path.join(wd, f"s{i}", f"x-{k}.h5"), "w").close()
        open(os.path.join(wd, "out", f"m{i}.h5"), "w").close()
        lines.append(f"m{i} model.h5 out/m{i}.h5 s{i}/x-*.h5 0.1 s{(i + 1) % n}/x-*.h5\n")
    m = write(os.path.join(wd, "m.txt"), "".join(lines))
    t0 = time.time()
    p = manifest_cmd(m, timeout=60)
    took = time.time() - t0
    check(p is not None and p.returncode == 0 and len(p.stdout.splitlines()) == n,
          f"{n} lines: {p and p.stderr[-500:]}")
    check(took < 3.0, f"{n} lines took {took:.2f} s")
    print(f"thousands: {n} lines checked in {took:.2f} s", flush=True)
    # Clashes with early lines at the very end: an output that is line 1's
    # shard, a name that is line 4's.
    bad = write(os.path.join(wd, "clash.txt"), "".join(lines) +
                f"late model.h5 s0/x-1.h5 s{n - 1}/x-*.h5\nm3 model.h5 out/new.h5 s3/x-*.h5\n")
    t0 = time.time()
    p = manifest_cmd(bad, timeout=60)
    took = time.time() - t0
    refused(f"{n} lines and a clash", p,
            f"clash.txt:{n + 1}: OUTPUT_H5 {os.path.realpath(wd)}/s0/x-1.h5 is a SHARD_GLOB file of line 1",
            f"clash.txt:{n + 2}: NAME 'm3' is already used on line 4")
    check(took < 3.0, f"{n} lines and a clash took {took:.2f} s")


def outputs_are_inputs(wd):
    """An output that is a validation shard (of its own line or another),
    or another line's model: refused with both roles, and calibrate
    --manifest leaves the shard alone."""
    model, shards = synth(os.path.join(wd, "c"), layers=1, heads=2, kv_heads=1, head_dim=8,
                          seqs=4, seq_len=32, shards=2, seed=31)
    synth(os.path.join(wd, "v"), layers=1, heads=2, kv_heads=1, head_dim=8, seqs=2, seq_len=32,
          shards=1, seed=31, skip_seqs=4)
    os.makedirs(os.path.join(wd, "out"))
    valid = os.path.join(os.path.realpath(wd), "v", "shard-0000.h5")
    before = open(valid, "rb").read()
    cases = [("own VALID_GLOB", "x c/model.h5 v/shard-0000.h5 c/shard-*.h5 0.1 v/shard-*.h5\n",
              f":1: OUTPUT_H5 {valid} is a VALID_GLOB file of this line"),
             ("another line's VALID_GLOB",
              "x c/model.h5 out/x.h5 c/shard-*.h5 0.1 v/shard-*.h5\n"
              "y c/model.h5 v/../v/shard-0000.h5 c/shard-*.h5\n",
              f":2: OUTPUT_H5 {valid} is a VALID_GLOB file of line 1"),
             ("another line's model",
              "x v/model.h5 out/x.h5 c/shard-*.h5\ny c/model.h5 v/model.h5 c/shard-*.h5\n",
              f":2: OUTPUT_H5 {os.path.realpath(wd)}/v/model.h5 is the MODEL_H5 of line 1"),
             ("the manifest", "x c/model.h5 roles.txt c/shard-*.h5\n",
              ":1: OUTPUT_H5 " + os.path.join(os.path.realpath(wd), "roles.txt") + " is the manifest itself")]
    for k, (name, text, needle) in enumerate(cases):
        m = write(os.path.join(wd, "roles.txt"), text)
        refused(name, manifest_cmd(m), "roles.txt" + needle)
        if k < 2:  # the ones that overwrote the validation shard
            p = run(["calibrate", "--progress", "off", "--manifest", m], np_=2, expect=None)
            check(p.returncode == 1 and needle in p.stderr, f"{name}: calibrate --manifest: {p.stderr}")
    check(open(valid, "rb").read() == before, "the validation shard was changed")


def manifest_reader():
    wd = workdir("manifest_reader")
    files(wd, "a/model.h5", "a/shard-0.h5")
    os.makedirs(os.path.join(wd, "out"))
    special_files(wd)
    control_characters(wd)
    all_bad_lines(wd)
    for name, fn in (("normalised", normalised), ("insitu", insitu_lines), ("thousands", thousands),
                     ("roles", outputs_are_inputs)):
        sub = os.path.join(wd, name)
        os.makedirs(sub)
        fn(sub)
    finish("manifest_reader")

