"""Edits of an open HDF5 file (h5py) that the structured mutants are made
of: retyped, replaced or re-laid-out datasets, attributes, single elements,
virtual, external and chunked datasets, a corrupted chunk, and the special
files (FIFO, directory, user block, ...) that replace a file."""
import os

import h5py
import numpy as np


def from_bf16(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def replace(f, name, data, attrs=None, **kw):
    """Replaces dataset `name` by `data` (keeping nothing of the old one)."""
    if name in f:
        del f[name]
    ds = f.create_dataset(name, data=data, **kw)
    for k, v in (attrs or {}).items():
        ds.attrs[k] = v
    return ds


def as_float(f, name):
    ds = f[name]
    raw = ds[...]
    if ds.attrs.get("dtype") in ("bfloat16", b"bfloat16"):
        return from_bf16(raw)
    return raw.astype(np.float32)


def set_attr(f, name, value, dtype=None):
    if name in f.attrs:
        del f.attrs[name]
    if dtype is None:
        f.attrs[name] = value
    else:
        f.attrs.create(name, value, dtype=dtype)


def edit_elem(name, index, value):
    """Sets one element of a dataset (for bf16 ones, to a bit pattern)."""
    def m(f, _ctx):
        a = f[name][...]
        a[index] = value
        f[name][...] = a
    return m


def seq_lens(values, dtype=np.int64):
    def m(f, _ctx):
        replace(f, "seq_lens", np.array(values, dtype=dtype))
    return m


def vds(name, src_file, src_name=None):
    """Dataset `name` made virtual, mapped whole onto dataset `src_name`
    (default: the same name) of `src_file` (a path, or a function of the
    mutant's ctx giving one)."""
    def m(f, ctx):
        shape, dt = f[name].shape, f[name].dtype
        attrs = dict(f[name].attrs)
        lay = h5py.VirtualLayout(shape=shape, dtype=dt)
        lay[...] = h5py.VirtualSource(src_file(ctx) if callable(src_file) else src_file,
                                      src_name or name, shape=shape, dtype=dt)
        del f[name]
        ds = f.create_virtual_dataset(name, lay, fillvalue=0)
        for k, v in attrs.items():
            ds.attrs[k] = v
    return m


def external_keys(which):
    """keys stored in an external raw file: 'missing', 'short' or 'good'."""
    def m(f, ctx):
        data = f["keys"][...]
        attrs = dict(f["keys"].attrs)
        raw = os.path.join(ctx["dir"], "keys.raw")
        if which == "good":
            data.tofile(raw)
        elif which == "short":
            data.reshape(-1)[:100].tofile(raw)
        del f["keys"]
        ds = f.create_dataset("keys", shape=data.shape, dtype=data.dtype,
                              external=[(raw, 0, data.nbytes)])
        for k, v in attrs.items():
            ds.attrs[k] = v
    return m


def chunked(name, corrupt=None, **kw):
    def m(f, ctx):
        data = f[name][...]
        attrs = dict(f[name].attrs)
        replace(f, name, data, attrs, **kw)
        ctx["corrupt_chunk"] = (name, corrupt) if corrupt else None
    return m


def huge_sparse(rows):
    """keys/values/queries declared with `rows` tokens, no chunk written."""
    def m(f, _ctx):
        for name in ("keys", "values", "queries"):
            shape = list(f[name].shape)
            attrs = dict(f[name].attrs)
            shape[2] = rows
            del f[name]
            ds = f.create_dataset(name, shape=tuple(shape), dtype=np.uint16,
                                  chunks=(1, 1, 4096, shape[3]))
            for k, v in attrs.items():
                ds.attrs[k] = v
        replace(f, "seq_lens", np.array([rows], np.int64))
    return m


def compact_seq_lens(f):
    """seq_lens rewritten with the compact layout (stored in its object header)."""
    x = f["seq_lens"][...]
    del f["seq_lens"]
    sid = h5py.h5s.create_simple(x.shape)
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_layout(h5py.h5d.COMPACT)
    did = h5py.h5d.create(f.id, b"seq_lens", h5py.h5t.STD_I64LE, sid, dcpl=dcpl)
    did.write(h5py.h5s.ALL, h5py.h5s.ALL, x)


def corrupt_chunk(path, name, how, rng):
    with h5py.File(path, "r") as f:
        ds = f[name]
        c = ds.id.get_chunk_info(ds.id.get_num_chunks() // 2)
    with open(path, "r+b") as fh:
        fh.seek(c.byte_offset)
        blob = bytearray(fh.read(c.size))
        if how == "flip":
            blob[len(blob) // 3] ^= 0x10
        elif how == "garbage":
            for i in range(len(blob) // 4, min(len(blob), len(blob) // 4 + 64)):
                blob[i] = rng.randrange(256)
        else:
            blob[len(blob) // 2:] = bytes(len(blob) - len(blob) // 2)
        fh.seek(c.byte_offset)
        fh.write(blob)


def make_special(path, kind, base_file):
    if kind == "empty":
        open(path, "wb").close()
    elif kind == "directory":
        os.makedirs(path)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "devnull":
        os.symlink("/dev/null", path)
    elif kind == "symlink-loop":
        os.symlink(os.path.basename(path), path)
    elif kind == "text":
        with open(path, "w") as fh:
            fh.write("HDF5? no\n" * 500)
    elif kind == "userblock":
        # The same content behind a 512-byte user block: a valid HDF5 file.
        with h5py.File(base_file, "r") as src, h5py.File(path, "w", userblock_size=512) as dst:
            for k, v in src.attrs.items():
                dst.attrs[k] = v
            for k in src:
                src.copy(src[k], dst, name=k)
