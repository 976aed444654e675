"""Making one mutant from its recipe in its own folder (work/m/ID), with
the command line that reads it, and running and judging it."""
import os
import random
import shlex
import shutil

import h5py

from .bytes_mutants import apply_bytes
from .h5_edits import corrupt_chunk, make_special
from .manifest_mutants import manifest_catalogue, manifest_text
from .runner import command, execute, run_env
from .struct_mutants import catalogue
from .verdict import judge


def prepare(ctx, info, r, d):
    """Writes the mutant into d; returns (argv, mutated path(s), out dir)."""
    files = info["files"]
    shards = list(info["shards"])
    model, proj = info["model"], info["ref"]
    out = os.path.join(d, "out")
    os.makedirs(out)
    os.makedirs(os.path.join(d, "san"))
    target = r["target"]
    mctx = {"dir": d, "sidecar": os.path.join(d, "sidecar.h5")}

    if target == "manifest":
        if r["kind"] == "mtext":
            text = manifest_catalogue(info)[r["id"][2:]][0]
        else:
            text = apply_bytes(manifest_text(info).encode(), r["ops"])
        if b"FIFO" in text:
            os.mkfifo(os.path.join(d, "FIFO"))
        man = os.path.join(d, "manifest.txt")
        with open(man, "wb") as fh:
            fh.write(text)
        if r["runner"] == "manifest":
            lists = os.path.join(out, "lists")
            os.makedirs(lists)
            return ["manifest", man, "--lists", lists], [man], out
        return ["calibrate", "--progress", "off", "--manifest", man], [man], out

    src = files[target]
    if target in ("ck1", "ck2"):
        ckdir = os.path.join(d, "ck")
        shutil.copytree(os.path.dirname(src), ckdir)
        path = os.path.join(ckdir, os.path.basename(src))
    else:
        path = os.path.join(d, os.path.basename(src))
    if r["kind"] == "bytes":
        with open(src, "rb") as fh:
            data = fh.read()
        with open(path, "wb") as fh:
            fh.write(apply_bytes(data, r["ops"]))
    else:
        fn = catalogue(info)[r["id"][2:]][3]
        if isinstance(fn, tuple) and fn[0] == "special":
            if os.path.exists(path):
                os.remove(path)
            make_special(path, fn[1], src)
        else:
            if target not in ("ck1", "ck2"):
                shutil.copy(src, path)
            shutil.copy(files["shard1"] if target != "shard1" else files["shard0"], mctx["sidecar"])
            with h5py.File(path, "r+") as f:
                fn(f, mctx)
            if mctx.get("corrupt_chunk"):
                name, how = mctx["corrupt_chunk"]
                corrupt_chunk(path, name, how, random.Random(f"{ctx.seed}/{r['id']}"))

    if target == "shard0":
        shards[0] = path
    elif target == "shard1":
        shards[1] = path
    elif target == "model":
        model = path
    elif target == "proj":
        proj = path
    base = ["--progress", "off"]
    if r["runner"] == "evaluate":
        argv = ["evaluate"] + base + ["--model", model, "--proj", proj, "--json",
                                      os.path.join(out, "report.json")] + shards
    else:
        argv = ["calibrate"] + base + ["--model", model, "--out", os.path.join(out, "proj.h5")]
        if target in ("ck1", "ck2"):
            argv += ["--checkpoint", os.path.dirname(path)]
        argv += shards
    mentions = [path]
    if target in ("ck1", "ck2"):
        mentions.append(os.path.dirname(path))
    return argv, mentions, out


def run_one(ctx, info, r):
    d = os.path.join(ctx.work, "m", r["id"].replace(":", "_"))
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    try:
        argv, mentions, out = prepare(ctx, info, r, d)
    except Exception as e:  # noqa: BLE001
        return r, [f"harness could not make the mutant: {type(e).__name__}: {e}"], [], 0.0, ""
    cmd = command(ctx, argv, r["np"])
    with open(os.path.join(d, "cmd"), "w") as fh:
        fh.write(shlex.join(cmd) + "\n")
    res = execute(ctx, cmd, run_env(san_dir=os.path.join(d, "san")), ctx.timeout, cwd=d)
    fails, warns, secs = judge(ctx, info, r, d, argv, mentions, out, res)
    with open(os.path.join(d, "stderr"), "w") as fh:
        fh.write(res[2])
    if not fails and not ctx.keep:
        shutil.rmtree(d, ignore_errors=True)
    return r, fails, warns, secs, shlex.join(cmd)
