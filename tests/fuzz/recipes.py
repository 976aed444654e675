"""Every mutant's recipe, in a fixed order that follows from --seed and
--count alone, and its one-line description (--list, the failures)."""
import random

from .bytes_mutants import BYTE_TARGETS, byte_recipe, describe_ops, neutral
from .manifest_mutants import manifest_catalogue, manifest_text, text_recipe
from .struct_mutants import catalogue


def recipes(ctx, info, count):
    """Every mutant's recipe, in a fixed order: structured ones first."""
    out = []
    for name, (target, runner, expect, fn, np_) in catalogue(info).items():
        out.append({"id": f"s:{name}", "kind": "struct", "target": target, "runner": runner,
                    "expect": expect, "np": np_})
    for name, (_text, runner, expect) in manifest_catalogue(info).items():
        out.append({"id": f"m:{name}", "kind": "mtext", "target": "manifest", "runner": runner,
                    "expect": expect, "np": 1})
    n_text = count // 8
    for i in range(count - n_text):
        rng = random.Random(f"{ctx.seed}/b{i}")
        target, runner, _ = rng.choices(BYTE_TARGETS, [w for *_, w in BYTE_TARGETS])[0]
        ops = byte_recipe(rng, target, info["sizes"][target], info["ranges"][target])
        np_ = 2 if runner == "resume2" else (2 if rng.random() < 0.06 and runner != "resume" else 1)
        out.append({"id": f"b{i}", "kind": "bytes", "target": target, "runner": runner,
                    "expect": "any", "np": np_, "ops": ops,
                    "neutral": neutral(ops, info["ranges"][target])})
    good = manifest_text(info).encode()
    for i in range(n_text):
        rng = random.Random(f"{ctx.seed}/t{i}")
        out.append({"id": f"t{i}", "kind": "tbytes", "target": "manifest",
                    "runner": "manifest" if rng.random() < 0.8 else "calib-manifest",
                    "expect": "any", "np": 1, "ops": text_recipe(rng, len(good))})
    return out


def describe(r):
    s = f"{r['id']}: {r['target']} via {r['runner']} on {r['np']} rank{'s' if r['np'] > 1 else ''}"
    if r["kind"] in ("bytes", "tbytes"):
        s += ": " + describe_ops(r["ops"])
    s += f" (expect {r['expect']})"
    return s
