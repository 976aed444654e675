"""Random byte mutants of the HDF5 files (`b*`): recipes of bit flips,
overwrites with boundary values, truncation, insertion, deletion, block
copies and zeroed blocks, mostly aimed at metadata; applying a recipe to a
file's bytes (also used for the manifest text mutants) and describing it."""

INTERESTING = [b"\x00", b"\xff", b"\x7f", b"\x80", b"\x01", b"\x02", b"\x10",
               b"\xff\xff\xff\xff", b"\xff\xff\xff\x7f", b"\x00\x00\x00\x80",
               b"\xff" * 8, b"\x00" * 8, (1 << 62).to_bytes(8, "little"),
               (1 << 31).to_bytes(8, "little"), b"\xff\xff", b"\x00\x80"]
BYTE_TARGETS = [("shard0", "calibrate", 30), ("model", "calibrate", 18), ("proj", "evaluate", 17),
                ("ck1", "resume", 20), ("shard1", "evaluate", 10), ("ck2", "resume2", 5)]


def in_data(off, n, ranges):
    return any(off < o + s and o < off + n for o, s in ranges)


def pick_offset(rng, size, ranges):
    """Three quarters in metadata (outside raw data), the rest anywhere;
    of the metadata picks, a third in the first 4 KiB or the last 4 KiB."""
    if rng.random() < 0.75:
        for _ in range(200):
            r = rng.random()
            if r < 0.2:
                off = rng.randrange(0, min(size, 4096))
            elif r < 0.33:
                off = rng.randrange(max(0, size - 4096), size)
            else:
                off = rng.randrange(0, size)
            if not in_data(off, 1, ranges):
                return off
    return rng.randrange(0, size)


def byte_recipe(rng, target, size, ranges):
    ops = []
    for _ in range(rng.choices([1, 2, 3], [55, 30, 15])[0]):
        kind = rng.choices(["flip", "set", "trunc", "insert", "delete", "copy", "zero"],
                           [30, 30, 8, 8, 8, 8, 8])[0]
        off = pick_offset(rng, size, ranges)
        if kind == "flip":
            ops.append(["flip", off, rng.randrange(8)])
        elif kind == "set":
            if rng.random() < 0.6:
                val = rng.choice(INTERESTING)
                if rng.random() < 0.2:  # an address just past the end
                    val = (size + rng.randrange(-8, 64)).to_bytes(8, "little", signed=True)
            else:
                val = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
            ops.append(["set", off, val.hex()])
        elif kind == "trunc":
            keep = rng.choice([rng.randrange(0, size), size - rng.randint(1, 64),
                               rng.randrange(0, min(size, 4096))])
            ops.append(["trunc", max(0, keep)])
        elif kind == "insert":
            ops.append(["insert", off, bytes(rng.randrange(256)
                                             for _ in range(rng.randint(1, 64))).hex()])
        elif kind == "delete":
            ops.append(["delete", off, rng.randint(1, 64)])
        elif kind == "copy":
            ops.append(["copy", rng.randrange(0, size), off, rng.randint(16, 256)])
        else:
            ops.append(["zero", off, rng.randint(16, 512)])
    return ops


def apply_bytes(data, ops):
    b = bytearray(data)
    for op in ops:
        k = op[0]
        if k == "flip" and op[1] < len(b):
            b[op[1]] ^= 1 << op[2]
        elif k == "set" and op[1] < len(b):
            v = bytes.fromhex(op[2])
            b[op[1]:op[1] + len(v)] = v[:max(0, len(b) - op[1])]
        elif k == "trunc":
            del b[op[1]:]
        elif k == "insert":
            b[op[1]:op[1]] = bytes.fromhex(op[2])
        elif k == "delete":
            del b[op[1]:op[1] + op[2]]
        elif k == "copy":
            src = bytes(b[op[1]:op[1] + op[3]])
            b[op[2]:op[2] + len(src)] = src[:max(0, len(b) - op[2])]
        elif k == "zero" and op[1] < len(b):
            n = min(op[2], len(b) - op[1])
            b[op[1]:op[1] + n] = bytes(n)
    return bytes(b)


def neutral(ops, ranges):
    """True when no op touches raw data or moves bytes."""
    for op in ops:
        if op[0] in ("trunc", "insert", "delete"):
            return False
        if op[0] == "flip":
            off, n = op[1], 1
        elif op[0] == "set":
            off, n = op[1], len(op[2]) // 2
        elif op[0] == "copy":
            off, n = op[2], op[3]
        else:
            off, n = op[1], op[2]
        if in_data(off, n, ranges):
            return False
    return True


# How each op reads in a recipe's description (--list, the failures).
OP_TEXT = {
    "flip": lambda op: f"flip@{op[1]}.bit{op[2]}",
    "set": lambda op: f"set@{op[1]}={op[2]}",
    "trunc": lambda op: f"truncate->{op[1]}",
    "insert": lambda op: f"insert@{op[1]}+{len(op[2]) // 2}B",
    "delete": lambda op: f"delete@{op[1]}-{op[2]}B",
    "copy": lambda op: f"copy {op[1]}->{op[2]} {op[3]}B",
    "zero": lambda op: f"zero@{op[1]}+{op[2]}B",
}


def describe_ops(ops):
    return " ".join(OP_TEXT.get(op[0], OP_TEXT["zero"])(op) for op in ops)
