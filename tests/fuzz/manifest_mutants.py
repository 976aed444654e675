"""Manifest mutants: the valid manifest's text, the catalogue of mangled
manifests (`m:*`) and the recipes of random edits of its text (`t*`)."""
import os
import re


def manifest_text(info, name="m1", out="m1.h5", eps="0.1"):
    d = os.path.dirname(info["model"])
    return (f"# fuzz manifest\n{name}  {info['model']}  {out}  {d}/shard-*.h5  {eps}\n")


def manifest_catalogue(info):
    """name -> (text bytes, runner, expect)."""
    d = os.path.dirname(info["model"])
    model = info["model"]
    good = manifest_text(info).encode()
    line = lambda *f: ("  ".join(f) + "\n").encode()  # noqa: E731
    c = {
        "good": (good, "manifest", "same"),
        "good-calibrate": (good, "calib-manifest", "same"),
        "empty": (b"", "manifest", "any"),
        "only-comments": (b"# nothing\n#\n\n", "manifest", "any"),
        "no-newline": (good.rstrip(b"\n"), "manifest", "same"),
        "crlf": (good.replace(b"\n", b"\r\n"), "manifest", "any"),
        "bom": (b"\xef\xbb\xbf" + good, "manifest", "any"),
        "tabs": (good.replace(b"  ", b"\t"), "manifest", "same"),
        "nul-in-name": (line("m\0x", model, "o.h5", f"{d}/shard-*.h5"), "manifest", "refuse"),
        "nul-line": (good + b"\0\0\0\n", "manifest", "refuse"),
        "nul-in-path": (line("m1", model + "\0junk", "o.h5", f"{d}/shard-*.h5"), "manifest", "refuse"),
        "ctrl-in-path": (line("m1", model, "o\x01\x1b[31m.h5", f"{d}/shard-*.h5"), "manifest", "refuse"),
        "cr-in-path": (line("m1", model, "o\r.h5", f"{d}/shard-*.h5"), "manifest", "refuse"),
        "del-in-name": (line("m\x7f1", model, "o.h5", f"{d}/shard-*.h5"), "manifest", "refuse"),
        "non-utf8": (line("m1", model, "o\xff\xfe.h5".encode("latin-1").decode("latin-1"),
                          f"{d}/shard-*.h5").replace(b"\xc3\xbf\xc3\xbe", b"\xff\xfe"),
                     "manifest", "any"),
        "long-name-5000": (line("n" * 5000, model, "o.h5", f"{d}/shard-*.h5"), "manifest", "refuse"),
        "long-line-1MiB": (line("m1", model, "o" * (1 << 20) + ".h5", f"{d}/shard-*.h5"),
                           "manifest", "refuse"),
        "long-comment-1MiB": (b"#" + b"c" * (1 << 20) + b"\n" + good, "manifest", "any"),
        "one-field": (b"m1\n", "manifest", "refuse"),
        "seven-fields": (line("m1", model, "o.h5", f"{d}/shard-*.h5", "0.1", "v*", "x"),
                         "manifest", "refuse"),
        "10k-fields": (b" ".join([b"x"] * 10000) + b"\n", "manifest", "refuse"),
        "glob-bracket": (line("m1", model, "o.h5", f"{d}/shard-[.h5"), "manifest", "refuse"),
        "glob-bang": (line("m1", model, "o.h5", f"{d}/shard-[!"), "manifest", "refuse"),
        "glob-backslash": (line("m1", model, "o.h5", f"{d}/shard-\\"), "manifest", "refuse"),
        "glob-stars-2000": (line("m1", model, "o.h5", f"{d}/" + "*" * 2000), "manifest", "any"),
        "glob-brace": (line("m1", model, "o.h5", f"{d}/shard-{{0000,0001}}.h5"), "manifest", "any"),
        "glob-dirs": (line("m1", model, "o.h5", f"{os.path.dirname(d)}/*"), "manifest", "any"),
        "glob-dirs-calibrate": (line("m1", model, "o.h5", f"{os.path.dirname(d)}/*"),
                                "calib-manifest", "refuse"),
        "glob-matches-manifest": (line("m1", model, "o.h5", "*"), "calib-manifest", "refuse"),
        "glob-deep": (line("m1", model, "o.h5", f"{d}/" + "*/" * 40 + "*.h5"), "manifest", "refuse"),
        "glob-8k": (line("m1", model, "o.h5", f"{d}/" + "?" * 8000), "manifest", "refuse"),
        "name-dash": (line("-x", model, "o.h5", f"{d}/shard-*.h5"), "manifest", "refuse"),
        "name-slash": (line("a/b", model, "o.h5", f"{d}/shard-*.h5"), "manifest", "refuse"),
        "name-dotdot": (line("..", model, "o.h5", f"{d}/shard-*.h5"), "manifest", "refuse"),
        "name-twice": (good + line("m1", model, "o2.h5", f"{d}/shard-*.h5"), "manifest", "refuse"),
        "output-twice": (good + line("m2", model, "m1.h5", f"{d}/shard-*.h5"), "manifest", "refuse"),
        "output-is-input": (line("m1", model, model, f"{d}/shard-*.h5"), "manifest", "refuse"),
        "output-no-dir": (line("m1", model, "/nonexistent/dir/o.h5", f"{d}/shard-*.h5"),
                          "calib-manifest", "refuse"),
        "model-missing": (line("m1", "/nonexistent/model.h5", "o.h5", f"{d}/shard-*.h5"),
                          "manifest", "refuse"),
        "model-dir": (line("m1", d, "o.h5", f"{d}/shard-*.h5"), "calib-manifest", "refuse"),
        "model-devzero": (line("m1", "/dev/zero", "o.h5", f"{d}/shard-*.h5"), "calib-manifest", "refuse"),
        "model-fifo": (line("m1", "FIFO", "o.h5", f"{d}/shard-*.h5"), "calib-manifest", "refuse"),
        "model-dotdot": (line("m1", "../../../../../../../../../etc/passwd", "o.h5", f"{d}/shard-*.h5"),
                         "calib-manifest", "refuse"),
        "hash-in-path": (line("m1", model, "o#x.h5", f"{d}/shard-*.h5"), "manifest", "any"),
        "100k-comment-lines": (b"# c\n" * 100000 + good, "manifest", "same"),
        "2000-models": (b"".join(line(f"m{i}", model, f"o{i}.h5", f"{d}/shard-*.h5")
                                 for i in range(2000)), "manifest", "any"),
    }
    for i, eps in enumerate(("nan", "inf", "-0", "1e999", "0x1p-3", "1e-400", "fixed:0", "fixed:-1",
                             "fixed:99999999999999999999999", "fixed:1.5", "budget:", "budget:1e-300",
                             "budget:nan", "eps:", ":", "eps:0.1:0.2", "fixed:" + "9" * 5000)):
        c[f"eps{i}-{re.sub(r'[^A-Za-z0-9.+-]', '_', eps)[:16]}"] = (
            line("m1", model, "o.h5", f"{d}/shard-*.h5", eps), "manifest", "any")
    return c


def text_recipe(rng, size):
    ops = []
    for _ in range(rng.choices([1, 2, 3, 4], [40, 30, 20, 10])[0]):
        kind = rng.choice(["set", "insert", "delete", "dup", "trunc"])
        off = rng.randrange(0, max(1, size))
        if kind in ("set", "insert"):
            pool = [b"\0", b"\n", b"\r", b"\t", b" ", b"#", b"*", b"[", b"]", b"?", b"\\", b"\x1b",
                    b"\x7f", b"\xff", b"..", b"/", b":", b"-", b"0", b"9" * 30]
            val = b"".join(rng.choice(pool) for _ in range(rng.randint(1, 6)))
            ops.append([kind, off, val.hex()])
        elif kind == "delete":
            ops.append(["delete", off, rng.randint(1, 20)])
        elif kind == "dup":
            ops.append(["copy", off, rng.randrange(0, max(1, size)), rng.randint(1, 200)])
        else:
            ops.append(["trunc", off])
    return ops
