"""The catalogue of structured mutants (`s:*`), written with h5py: element
types, shapes, missing objects, attribute values, seq_lens overflow,
NaN/Inf, filters and layouts, virtual, external and linked datasets,
special files, projections and checkpoints; each with its target file,
the run that reads it and the expected verdict."""
import h5py
import numpy as np

from .h5_edits import (as_float, chunked, compact_seq_lens, edit_elem, external_keys, huge_sparse,
                       replace, seq_lens, set_attr, vds)


ATTRS = ("kqsvd_format", "kqsvd_format_version", "model", "num_layers", "num_heads",
         "num_kv_heads", "head_dim", "hidden_size", "causal")


def T_of(info):
    with h5py.File(info["files"]["shard0"], "r") as f:
        return int(f["keys"].shape[2])


def catalogue(info):
    """name -> (target, runner, expect, mutate(f, ctx) or special, np).
    expect: 'refuse' (must exit 1/2), 'same' (must exit 0 with the reference
    output), 'valid' (a valid variant: refused, or accepted with the
    reference output), 'any' (either, cleanly)."""
    T = T_of(info)
    shard1 = info["files"]["shard1"]
    c = {}

    def add(name, target, expect, fn, runner=None, np_=1):
        runner = runner or {"shard0": "calibrate", "model": "calibrate", "proj": "evaluate",
                            "shard1": "evaluate", "ck1": "resume", "ck2": "resume2"}[target]
        c[name] = (target, runner, expect, fn, np_)

    # --- element types ---
    def retype(name, dtype, tag=None):
        def m(f, _ctx):
            x = as_float(f, name)
            replace(f, name, x.astype(dtype), {"dtype": tag} if tag else None)
        return m
    add("f16-tagged-bf16", "shard0", "refuse", retype("keys", np.float16, "bfloat16"), np_=2)
    add("f32-tagged-bf16", "shard0", "refuse", retype("keys", np.float32, "bfloat16"))
    add("f64-tagged-bf16", "shard0", "refuse", retype("queries", np.float64, "bfloat16"))
    add("f16-tagged-bf16-model", "model", "refuse", retype("o_proj", np.float16, "bfloat16"))
    for dt in ("int32", "int8", "uint64", "bool", "complex64", "longdouble"):
        add(f"keys-{dt}", "shard0", "refuse", retype("keys", np.dtype(dt)))
    add("keys-f16", "shard0", "any", retype("keys", np.float16))
    add("keys-f64", "shard0", "any", retype("keys", np.float64))

    def untagged(f, _ctx):
        del f["values"].attrs["dtype"]
    add("uint16-untagged", "shard0", "refuse", untagged)

    def compound(f, _ctx):
        x = f["keys"][...]
        rec = np.zeros(x.shape, dtype=[("a", np.uint16), ("b", np.float32)])
        rec["a"] = x
        replace(f, "keys", rec, {"dtype": "bfloat16"})
    add("keys-compound", "shard0", "refuse", compound)

    def strings(f, _ctx):
        replace(f, "keys", np.array(["x"] * 4, dtype=h5py.string_dtype()))
    add("keys-vlen-str", "shard0", "refuse", strings)

    def fixed_str(f, _ctx):
        replace(f, "values", np.full(f["values"].shape, b"ab", dtype="S2"))
    add("values-fixed-str", "shard0", "refuse", fixed_str)

    def tag(value, dtype=None, ds="keys"):
        def m(f, _ctx):
            del f[ds].attrs["dtype"]
            if dtype is None:
                f[ds].attrs["dtype"] = value
            else:
                f[ds].attrs.create("dtype", value, dtype=dtype)
        return m
    add("dtype-attr-int", "shard0", "refuse", tag(7))
    add("dtype-attr-empty", "shard0", "refuse", tag(""))
    add("dtype-attr-1", "shard0", "refuse", tag("b"))
    add("dtype-attr-long", "shard0", "refuse", tag("bfloat16" + "x" * 70000))
    # C string semantics: HDF5 readers in C see "bfloat16" (h5py sees the NUL and "junk").
    add("dtype-attr-nul-fixed", "shard0", "any", tag(np.bytes_(b"bfloat16\0junk")))
    add("dtype-attr-fixed-exact", "shard0", "same", tag(np.bytes_(b"bfloat16")))
    add("dtype-attr-fixed-nulpad", "shard0", "same",
        tag(b"bfloat16", dtype=h5py.string_dtype("ascii", 12)))
    add("dtype-attr-array", "shard0", "refuse", tag(["bfloat16", "bfloat16"]))
    add("dtype-attr-float8", "shard0", "refuse", tag("float8"))
    add("dtype-attr-trailing-space", "shard0", "refuse", tag("bfloat16 "))
    add("dtype-attr-non-utf8", "shard0", "refuse", tag(np.void(b"\xff\xfebf16")))
    add("dtype-attr-odd-4095", "shard0", "refuse", tag("b" * 4095))
    add("dtype-attr-odd-65535", "shard0", "refuse", tag("c" * 65535))

    # --- shapes ---
    def reshape(name, fn):
        def m(f, _ctx):
            x = f[name][...]
            attrs = dict(f[name].attrs)
            replace(f, name, fn(x), attrs)
        return m
    add("keys-rank3", "shard0", "refuse", reshape("keys", lambda x: x.reshape(x.shape[0], -1, x.shape[3])))
    add("keys-rank5", "shard0", "refuse", reshape("keys", lambda x: x[None]))
    add("keys-extra-layer", "shard0", "refuse", reshape("keys", lambda x: np.concatenate([x, x[:1]])))
    add("keys-short-T", "shard0", "refuse", reshape("keys", lambda x: x[:, :, :-1]), np_=2)
    add("keys-long-T", "shard0", "refuse", reshape("keys", lambda x: np.concatenate([x, x[:, :, :1]], 2)))
    add("keys-d-mismatch", "shard0", "refuse", reshape("keys", lambda x: x[..., :-1]))
    add("queries-heads", "shard0", "refuse", reshape("queries", lambda x: x[:, :-1]))
    add("keys-T0", "shard0", "refuse", reshape("keys", lambda x: x[:, :, :0]))
    add("keys-scalar", "shard0", "refuse", reshape("keys", lambda x: x.reshape(-1)[0]))

    def null_space(f, _ctx):
        del f["values"]
        f.create_dataset("values", data=h5py.Empty("<u2"))
        f["values"].attrs["dtype"] = "bfloat16"
    add("values-null-dataspace", "shard0", "refuse", null_space)
    add("o_proj-rank2", "model", "refuse", reshape("o_proj", lambda x: x[0]))
    add("o_proj-extra-layer", "model", "refuse", reshape("o_proj", lambda x: np.concatenate([x, x[:1]])))
    add("o_proj-short", "model", "refuse", reshape("o_proj", lambda x: x[:, :, :-1]))

    # --- missing objects and attributes ---
    for ds in ("keys", "values", "queries", "seq_lens"):
        add(f"missing-{ds}", "shard0", "refuse", (lambda d: lambda f, _c: f.__delitem__(d))(ds))
    add("missing-o_proj", "model", "refuse", lambda f, _c: f.__delitem__("o_proj"))
    for a in ATTRS:
        add(f"missing-attr-{a}", "shard0", "any" if a == "model" else "refuse",
            (lambda n: lambda f, _c: f.attrs.__delitem__(n))(a))
    add("missing-attr-num_heads-model", "model", "refuse",
        lambda f, _c: f.attrs.__delitem__("num_heads"))
    add("empty-file-root", "shard0", "refuse",
        lambda f, _c: [f.__delitem__(k) for k in list(f)] + [f.attrs.__delitem__(k) for k in list(f.attrs)])

    # --- attribute values and types ---
    attr_cases = {
        "num_layers-str": ("num_layers", "2", None), "num_layers-float": ("num_layers", 2.5, None),
        "num_layers-float-exact": ("num_layers", 2.0, None),
        "num_layers-array": ("num_layers", np.array([2, 2]), None),
        "num_layers-neg": ("num_layers", -1, None), "num_layers-0": ("num_layers", 0, None),
        "num_layers-2^62": ("num_layers", 1 << 62, None),
        "num_layers-i64max": ("num_layers", (1 << 63) - 1, None),
        "num_layers-u64max": ("num_layers", (1 << 64) - 1, np.uint64),
        "num_layers-int8": ("num_layers", 2, np.int8),
        "num_heads-2^40": ("num_heads", 1 << 40, None),
        "head_dim-2^31": ("head_dim", 1 << 31, None),
        "head_dim-2^62": ("head_dim", 1 << 62, None),
        "hidden_size-2^62": ("hidden_size", 1 << 62, None),
        "num_kv_heads-0": ("num_kv_heads", 0, None),
        "causal-2": ("causal", 2, None), "causal-str": ("causal", "yes", None),
        "version-float": ("kqsvd_format_version", 1.0, None),
        "version-str": ("kqsvd_format_version", "1", None),
        "version-2^63": ("kqsvd_format_version", (1 << 63) + 1, np.uint64),
        "format-fixed-nulpad": ("kqsvd_format", b"cache", h5py.string_dtype("ascii", 9)),
        "format-embedded-nul": ("kqsvd_format", np.bytes_(b"cache\0model"), None),
        "format-empty": ("kqsvd_format", "", None),
        "format-odd-1": ("kqsvd_format", "c", None),
        "format-odd-4095": ("kqsvd_format", "c" * 4095, None),
        "format-1MiB": ("kqsvd_format", "cache" * 209716, None),
        "format-array": ("kqsvd_format", np.array(["cache", "cache"], dtype=h5py.string_dtype()), None),
        "format-non-utf8": ("kqsvd_format", np.void(b"\xffcache"), None),
        "format-int": ("kqsvd_format", 5, None),
        "model-1MiB": ("model", "m" * (1 << 20), None),
        "model-non-utf8": ("model", np.bytes_(b"\xff\xfe\x00x"), None),
    }
    for name, (a, v, dt) in attr_cases.items():
        expect = "any" if name.startswith(("model-", "format-fixed", "num_layers-float-exact",
                                           "num_layers-int8", "format-embedded-nul")) else "refuse"
        add(f"attr-{name}", "shard0", expect, (lambda a, v, dt: lambda f, _c: set_attr(f, a, v, dt))(a, v, dt))
    add("attr-head_dim-2^62-model", "model", "refuse", lambda f, _c: set_attr(f, "head_dim", 1 << 62))
    add("attr-num_layers-2^40-model", "model", "refuse", lambda f, _c: set_attr(f, "num_layers", 1 << 40))
    add("attr-format-cache-model", "model", "refuse", lambda f, _c: set_attr(f, "kqsvd_format", "cache"))
    add("attr-on-dataset-not-root", "shard0", "refuse",
        lambda f, _c: (f["keys"].attrs.__setitem__("kqsvd_format", "cache"),
                       f.attrs.__delitem__("kqsvd_format")))

    # --- seq_lens ---
    I64 = (1 << 63) - 1
    add("seq_lens-negative", "shard0", "refuse", seq_lens([T + 1, -1]))
    add("seq_lens-zero", "shard0", "refuse", seq_lens([0, T]))
    add("seq_lens-2^62", "shard0", "refuse", seq_lens([1 << 62, T - (1 << 62)]), np_=2)
    add("seq_lens-2^62-pair", "shard0", "refuse", seq_lens([(1 << 62) + 1, (1 << 62) - 1, T - (1 << 63)]))
    add("seq_lens-i64-wrap", "shard0", "refuse", seq_lens([I64, I64, T + 2]))  # sums to T mod 2^64
    add("seq_lens-u64-wrap", "shard0", "refuse", seq_lens([(1 << 64) - 1, T + 1], np.uint64))
    add("seq_lens-float", "shard0", "refuse", seq_lens([T / 2, T / 2], np.float64))
    add("seq_lens-empty", "shard0", "refuse", seq_lens([], np.int64))
    add("seq_lens-2d", "shard0", "refuse", lambda f, _c: replace(f, "seq_lens", np.array([[T]], np.int64)))
    add("seq_lens-scalar", "shard0", "refuse", lambda f, _c: replace(f, "seq_lens", np.int64(T)))
    add("seq_lens-ones", "shard0", "same", seq_lens([1] * T), np_=1)
    add("seq_lens-int8", "shard0", "any", lambda f, _c: replace(f, "seq_lens", f["seq_lens"][...].astype(np.int8)))
    add("seq_lens-sum-plus1", "shard0", "refuse", lambda f, _c: replace(
        f, "seq_lens", f["seq_lens"][...] + np.array([1] + [0] * (len(f["seq_lens"]) - 1))))
    add("seq_lens-str", "shard0", "refuse", lambda f, _c: replace(
        f, "seq_lens", np.array(["5"], dtype=h5py.string_dtype())))

    # --- NaN / Inf ---
    add("nan-keys", "shard0", "refuse", edit_elem("keys", (1, 1, 5, 3), 0x7FC0), np_=2)
    add("inf-values", "shard0", "refuse", edit_elem("values", (0, 0, 0, 0), 0x7F80))
    add("neg-inf-queries-last", "shard0", "refuse", edit_elem("queries", (-1, -1, -1, -1), 0xFF80))
    add("snan-keys", "shard0", "refuse", edit_elem("keys", (0, 1, 2, 3), 0x7F81))
    add("subnormal-keys", "shard0", "any", edit_elem("keys", (0, 0, 1, 1), 0x0001))
    add("nan-o_proj", "model", "refuse", edit_elem("o_proj", (1, 3, 20), 0x7FC0))
    add("nan-eval-shard", "shard1", "refuse", edit_elem("queries", (0, 2, 1, 1), 0x7FC0))

    def f32_nan(f, _c):
        x = as_float(f, "values")
        x[0, 1, 2, 3] = np.nan
        replace(f, "values", x)
    add("nan-values-f32", "shard0", "refuse", f32_nan)

    # --- storage: filters, layouts ---
    add("gzip-shuffle", "shard0", "same", chunked("keys", compression="gzip", shuffle=True, chunks=True))
    add("tiny-chunks", "shard0", "same", chunked("queries", chunks=(1, 1, 1, 8)))
    add("lzf-filter", "shard0", "valid", chunked("keys", compression="lzf", chunks=True))
    add("fletcher32-corrupt", "shard0", "refuse", chunked("values", corrupt="flip", fletcher32=True,
                                                          chunks=(1, 1, 16, 8)), np_=2)
    add("gzip-corrupt", "shard0", "refuse", chunked("keys", corrupt="garbage", compression="gzip",
                                                    chunks=(1, 1, 16, 8)))
    add("gzip-truncated-chunk", "shard0", "refuse", chunked("keys", corrupt="zero-tail",
                                                            compression="gzip", chunks=(2, 2, 64, 8)))
    add("scaleoffset", "shard0", "any", chunked("keys", scaleoffset=0, chunks=True))
    add("compact-layout", "shard0", "same", lambda f, _c: compact_seq_lens(f))
    add("gzip-o_proj", "model", "same", chunked("o_proj", compression="gzip", chunks=True))
    add("gzip-corrupt-model", "model", "refuse", chunked("o_proj", corrupt="garbage",
                                                         compression="gzip", chunks=(1, 8, 32)))
    add("gzip-corrupt-eval-shard", "shard1", "refuse", chunked("queries", corrupt="garbage",
                                                               compression="gzip", chunks=(1, 1, 32, 8)))
    add("gzip-corrupt-ck-state", "ck1", "refuse", chunked("state", corrupt="garbage",
                                                          compression="gzip", chunks=(64,)))
    add("gzip-corrupt-proj", "proj", "refuse", chunked("kqsvd/key_down", corrupt="garbage",
                                                       compression="gzip", chunks=(1, 1, 8, 8)))
    add("huge-sparse-2^26-rows", "shard0", "refuse", huge_sparse(1 << 26))

    # --- virtual, external and linked datasets ---
    add("vds-missing-source", "shard0", "refuse", vds("keys", "/nonexistent/kqsvd-fuzz/src.h5"), np_=2)
    add("vds-missing-dataset", "shard0", "refuse", vds("keys", shard1, "no_such_dataset"))
    add("vds-self", "shard0", "refuse", vds("keys", "."))
    add("vds-good", "shard0", "any", vds("keys", lambda ctx: ctx["sidecar"]))
    add("external-missing", "shard0", "refuse", external_keys("missing"))
    add("external-short", "shard0", "refuse", external_keys("short"))
    add("external-good", "shard0", "valid", external_keys("good"))
    add("softlink-keys-to-values", "shard0", "any",
        lambda f, _c: (f.__delitem__("keys"), f.__setitem__("keys", h5py.SoftLink("/values"))))
    add("softlink-dangling", "shard0", "refuse",
        lambda f, _c: (f.__delitem__("keys"), f.__setitem__("keys", h5py.SoftLink("/nowhere"))))
    add("softlink-loop", "shard0", "refuse",
        lambda f, _c: (f.__delitem__("keys"), f.__setitem__("keys", h5py.SoftLink("/keys"))))
    add("extlink-missing", "shard0", "refuse",
        lambda f, _c: (f.__delitem__("keys"),
                       f.__setitem__("keys", h5py.ExternalLink("/nonexistent/x.h5", "/keys"))))
    add("extlink-good", "shard0", "any",
        lambda f, c: (f.__delitem__("keys"), f.__setitem__("keys", h5py.ExternalLink(c["sidecar"], "/keys"))))
    add("keys-is-group", "shard0", "refuse",
        lambda f, _c: (f.__delitem__("keys"), f.create_group("keys")))
    add("o_proj-vds-missing", "model", "refuse", vds("o_proj", "/nonexistent/m.h5"))

    # --- special files (the file itself replaced) ---
    for kind in ("empty", "directory", "fifo", "devnull", "symlink-loop", "userblock", "text"):
        add(f"file-{kind}", "shard0", "same" if kind == "userblock" else "refuse", ("special", kind),
            np_=2 if kind == "fifo" else 1)
    add("file-fifo-model", "model", "refuse", ("special", "fifo"))

    # --- projections (evaluate) ---
    add("proj-missing-group", "proj", "refuse", lambda f, _c: f.__delitem__("kqsvd"))
    add("proj-key_down-shape", "proj", "refuse", reshape("kqsvd/key_down", lambda x: x[:, :, :-1]))
    for v in (9, 0, -1, 1 << 40, -(1 << 62)):
        add(f"proj-rank_k-{v}", "proj", "refuse",
            (lambda v: lambda f, _c: replace(f, "kqsvd/rank_k", np.array([v, 2], np.int64)))(v))
    add("proj-rank_k-float", "proj", "refuse",
        lambda f, _c: replace(f, "kqsvd/rank_k", np.array([2.5, 2], np.float64)))
    add("proj-nan-query_down", "proj", "any", edit_elem("kqsvd/query_down", (0, 0, 0, 0), np.nan))
    add("proj-missing-rank_v", "proj", "refuse", lambda f, _c: f.__delitem__("ksvd/rank_v"))
    add("proj-head_dim", "proj", "refuse", lambda f, _c: set_attr(f, "head_dim", 16))
    add("proj-num_layers-2^62", "proj", "refuse", lambda f, _c: set_attr(f, "num_layers", 1 << 62))
    add("proj-missing-beta", "proj", "any", lambda f, _c: f["eigen"].attrs.__delitem__("beta"))
    add("proj-rank_policy-junk", "proj", "any", lambda f, _c: set_attr(f, "rank_policy", "fixed:abc"))
    add("proj-rank_policy-1MiB", "proj", "any", lambda f, _c: set_attr(f, "rank_policy", "e" * (1 << 20)))
    add("proj-format-cache", "proj", "refuse", lambda f, _c: set_attr(f, "kqsvd_format", "cache"))

    # Per-head ranks (docs/formats.md 5.3): a valid pair is evaluated, each
    # kind of bad one refused naming the file.
    def heads(edit=None, group="kqsvd"):
        def m(f, _c):
            L, H, d = (int(f.attrs[k]) for k in ("num_layers", "num_kv_heads", "head_dim"))
            rk = (np.arange(L * H).reshape(L, H) % d + 1).astype(np.int64)
            rv = (d - np.arange(L * H).reshape(L, H) % d).astype(np.int64)
            replace(f, f"{group}/rank_k_heads", rk)
            replace(f, f"{group}/rank_v_heads", rv)
            f[group]["rank_k"][...] = rk.max(1)
            f[group]["rank_v"][...] = rv.max(1)
            if edit:
                edit(f, f"{group}/rank_k_heads", rk)
        return m
    add("proj-heads-valid", "proj", "same", heads())
    add("proj-heads-valid-eigen", "proj", "same", heads(group="eigen"))
    for v in (0, -1, 9, 1 << 40, -(1 << 62)):
        def one(v):
            def e(f, name, rk):
                rk = rk.copy()
                rk[-1, -1] = v
                replace(f, name, rk)
            return e
        add(f"proj-heads-{v}", "proj", "refuse", heads(one(v)))
    add("proj-heads-single", "proj", "refuse",
        heads(lambda f, _n, _r: f.__delitem__("kqsvd/rank_v_heads")))
    add("proj-heads-shape", "proj", "refuse",
        heads(lambda f, n, rk: replace(f, n, np.concatenate([rk, rk[:, :1]], 1))))
    add("proj-heads-3d", "proj", "refuse", heads(lambda f, n, rk: replace(f, n, rk[None])))
    add("proj-heads-float", "proj", "refuse",
        heads(lambda f, n, rk: replace(f, n, rk.astype(np.float64))))
    add("proj-heads-not-max", "proj", "refuse",
        heads(lambda f, n, rk: f["kqsvd/rank_k"].__setitem__(0, int(rk[0].max()) - 1)))

    # --- checkpoints (resume) ---
    def ck_attr(name, value, dtype=None):
        return lambda f, _c: set_attr(f, name, value, dtype)
    for v in (1 << 62, -1, (1 << 63) - 1):
        add(f"ck-next_segment-{v}", "ck1", "refuse", ck_attr("next_segment", v))
        add(f"ck-next_item-{v}", "ck1", "refuse", ck_attr("next_item", v))
    add("ck-next_item-2", "ck1", "any", ck_attr("next_item", 2))
    add("ck-next_segment-str", "ck1", "refuse", ck_attr("next_segment", "0"))
    add("ck-state-short", "ck1", "refuse", reshape("state", lambda x: x[:-1]))
    add("ck-state-long", "ck1", "refuse", reshape("state", lambda x: np.concatenate([x, x[:1]])))
    add("ck-state-f32", "ck1", "refuse", reshape("state", lambda x: x.astype(np.float32) * 1.0000001))
    add("ck-state-2d", "ck1", "refuse", reshape("state", lambda x: x[None]))
    add("ck-state-nan", "ck1", "refuse", edit_elem("state", (0,), np.nan))
    add("ck-state-changed", "ck1", "refuse", edit_elem("state", (0,), 12345.0), np_=1)
    add("ck-state-changed-2rank", "ck2", "refuse", edit_elem("state", (0,), 12345.0), np_=2)
    add("ck-missing-state", "ck1", "refuse", lambda f, _c: f.__delitem__("state"))
    for a in ("checksum", "fingerprint", "next_segment", "kqsvd_format"):
        add(f"ck-missing-{a}", "ck1", "refuse", (lambda a: lambda f, _c: f.attrs.__delitem__(a))(a))
    add("ck-fingerprint-other", "ck1", "refuse", ck_attr("fingerprint", "0" * 16))
    add("ck-format-cache", "ck1", "refuse", ck_attr("kqsvd_format", "cache"))
    add("ck-about-1MiB", "ck1", "any", ck_attr("about", "a" * (1 << 20)))
    add("ck-checksum-1MiB", "ck1", "refuse", ck_attr("checksum", "f" * (1 << 20)))
    add("ck-checksum-empty", "ck1", "refuse", ck_attr("checksum", ""))
    return c
