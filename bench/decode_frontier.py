"""The `kqsvd frontier` reports that bench/decode_speed.py --frontier
measures: read with every field it uses checked, turned into the
configurations to run, and written again with each result's decode
figures beside its quality."""
import json
import math
import os

from kqsvd.errors import KqsvdError, UsageError
from kqsvd.quality.peers import BACKENDS, QuantizedCachePeer


def read_report(path):
    """A `kqsvd frontier` report, every field this command reads checked
    (KqsvdError naming the file and the field), so that a bad one is
    refused before the runs rather than by the table after them."""
    from kqsvd.formats.files import check_input_file
    from kqsvd.formats.quant import QuantScheme
    check_input_file("--frontier", path)
    try:
        with open(path, encoding="utf-8") as f:
            report = json.load(f)
    except ValueError as e:  # invalid JSON, or not UTF-8
        raise KqsvdError(f"--frontier {path}: not a JSON file ({e})") from None
    if not isinstance(report, dict) or report.get("kqsvd_format") != "frontier":
        raise KqsvdError(f"--frontier {path}: not a kqsvd frontier report (a JSON object with "
                         "kqsvd_format 'frontier')")
    num = (int, float)
    what = {str: "text", list: "a list", dict: "an object", int: "a whole number above 0",
            bool: "true or false", num: "a number"}

    def need(obj, fields, where=""):
        for field, kind in fields:
            v = obj.get(field)
            ok = isinstance(v, bool) if kind is bool else isinstance(v, kind) and \
                not isinstance(v, bool) and (kind is not int or v > 0)
            if not ok or isinstance(v, float) and not math.isfinite(v):
                raise KqsvdError(f"--frontier {path}: field '{where}{field}' is missing or not "
                                 f"{what[kind]}")
    need(report, [("model", str), ("proj", list), ("results", list), ("scheme", dict),
                  ("full", dict), ("context", int), ("continuation", int), ("num_seqs", int)]
         + [("elapsed_s", num)] * ("elapsed_s" in report))
    need(report["full"], [("perplexity", num)], "full.")
    need({f"proj[{i}]": p for i, p in enumerate(report["proj"])},
         [(f"proj[{i}]", str) for i in range(len(report["proj"]))])
    for i, r in enumerate(report["results"]):
        need({f"results[{i}]": r}, [(f"results[{i}]", dict)])
        need(r, [("label", str), ("family", str), ("front", bool), ("front_kl", bool),
                 ("kept", num), ("perplexity", num), ("kl", num), ("top1", num)], f"results[{i}].")
    field = f"--frontier {path}: field 'scheme'"
    try:
        QuantScheme(**report["scheme"]).check(field)
    except TypeError as e:  # a field QuantScheme does not have
        raise KqsvdError(f"{field}: {e}") from None
    except UsageError as e:  # the file's, not the command line's
        raise KqsvdError(str(e)) from None
    return report


def frontier_specs(report, front_only, path="the report"):
    """[(label, spec, index of the report's result)] for the configurations
    of a `kqsvd frontier` report (only those on a front with front_only);
    raises KqsvdError for a configuration it cannot name."""
    stems = {os.path.splitext(os.path.basename(p))[0]: p for p in report["proj"]}
    out = []
    for i, r in enumerate(report["results"]):
        if front_only and not (r["front"] or r["front_kl"]):
            continue
        label, family = r["label"], r["family"]
        if family == "int-N cache":
            spec = label
        elif family.startswith("QuantizedCache"):
            backend, _, bits = label.partition("-int")
            spec = f"{backend}:{bits}"
        elif family.startswith("kvpress over"):
            spec = _composite_spec(label, report["scheme"]["group"], path)
        elif family.startswith("kvpress"):
            spec = f"press:{label}"
        else:  # a latent: "METHOD POLICY [STEM]", the stem when the report has several files
            head, _, stem = label.partition(" [")
            method, _, policy = head.partition(" ")
            got = stems.get(stem.rstrip("]")) if stem else \
                report["proj"][0] if report["proj"] else None
            if got is None:
                raise KqsvdError(f"--frontier {path}: '{label}' names no file of the report")
            spec = f"kqsvd:{os.path.abspath(got)}={method}/{policy}"
        out.append((label, spec, i))
    return out


def _composite_spec(label, group, path):
    """composite:NAME:BACKEND:BITS:BYTES of a press over QuantizedCache
    the report labels NAME:KEPT over BACKEND-intBITS.  The label's KEPT
    has 6 digits, so its product with the cache's share is not the
    frontier's budget (0.333333 x 0.1875 = 0.0624999): BYTES is the
    shortest decimal whose share prints as KEPT again, which is the
    budget the frontier chose (kvpress keeps int(n x share) tokens, and
    a share 1e-6 off keeps one more at some n)."""
    press, _, cache = label.partition(" over ")
    name, _, kept = press.partition(":")
    backend, _, bits = cache.partition("-int")
    try:
        if backend not in BACKENDS or bits not in ("2", "4"):
            raise ValueError
        share = QuantizedCachePeer(backend, int(bits), group).fraction
        raw = float(kept) * share
    except ValueError:
        raise KqsvdError(f"--frontier {path}: '{label}' is no press over a QuantizedCache") \
            from None
    budget = next((b for b in (float(f"{raw:.{d}g}") for d in range(1, 18))
                   if f"{b / share:g}" == kept), raw)
    return f"composite:{name}:{backend}:{bits}:{budget!r}"


def annotate(report, rows, specs, setup):
    """The frontier report with each measured result's decode figures."""
    report = dict(report, results=[dict(r) for r in report["results"]])
    figures = lambda r: {k: r[k] for k in ("context", "batch", "decode_tok_s",  # noqa: E731
                                           "decode_range", "against_full", "prefill_s",
                                           "peak_above_model_mb")}
    report["decode_full"] = [figures(r) for r in rows if r["config"] == "full"]
    for label, spec, i in specs:
        got = [figures(r) for r in rows if r["config"] == spec]
        if i is not None and got:
            report["results"][i]["decode"] = got
    report["decode_setup"] = setup
    return report
