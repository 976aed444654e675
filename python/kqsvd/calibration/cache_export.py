"""A model's attention caches written as the data contract's shards
(examples/export_hf.py): the shard layout, the record of what each shard was
made from, and resuming an export that was cut short.

Every shard records the request it belongs to (its `export_request`
attribute: model, text, split, windows, element types, BOS, which side of
RoPE the keys are taken), and is written
under NAME.tmp and renamed when complete.  So after a crash of any kind the
finished shards are whole and say what they hold: the same command run
again keeps those that match, drops the temporary files and goes on, and a
folder holding another request's export is refused naming the argument
that differs."""
import hashlib
import json
import os
import signal
import sys
import time

import numpy as np

from .capture import Capture, attention_out_proj
from ..errors import KqsvdError
from ..formats.files import publish
from ..formats.numbers import whole

# The request's fields in the order they are compared, with the option that
# sets each (named when a folder holds another request's export).
REQUEST_FIELDS = (("model", "--model"), ("model_name", "--model-name"), ("text", "--text"),
                  ("split", "--split"), ("seq_len", "--seq-len"), ("num_seqs", "--num-seqs"),
                  ("shard_seqs", "--shard-seqs"), ("dtype", "--dtype"),
                  ("weights_dtype", "--weights-dtype"), ("bos", "--no-bos"), ("rope", "--keys"))
# Fields newer than the first exporter, with the value an export made before
# them had, so that such an export still resumes (a RoPE decoder's keys were
# then always taken after RoPE).  Encoders record no `rope`.
REQUEST_DEFAULTS = {"rope": "post"}
NP_TYPES = {"bf16": np.uint16, "f16": np.float16, "f32": np.float32, "f64": np.float64}


def text_digest(path):
    """sha256 of the text's bytes: the text is the same wherever it lies."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def request(args, model_path, weights, bos, rope=None):
    """The record that ties shards to the arguments that made them.  rope:
    "post" or "pre" for a RoPE decoder (capture.rope_of), None for an
    encoder (then not recorded)."""
    req = {"model": os.path.realpath(model_path), "model_name": args.model_name or args.model,
           "text": text_digest(args.text), "split": args.split, "seq_len": args.seq_len,
           "num_seqs": args.num_seqs, "shard_seqs": args.shard_seqs, "dtype": args.dtype,
           "weights_dtype": weights, "bos": int(bos)}
    if rope is not None:
        req["rope"] = rope
    return req


def _differs(path, have, want):
    for key, option in REQUEST_FIELDS:
        had = have.get(key, REQUEST_DEFAULTS.get(key) if key in want else None)
        if had != want.get(key):
            shown = {"text": "the text's contents", "bos": "BOS"}.get(key, key)
            return (f"{path} belongs to an export made with other arguments: {option} differs "
                    f"({shown}: {had!r} there, {want.get(key)!r} now); remove the folder "
                    "or choose another")
    return None


def _recorded(path):
    import h5py
    try:
        with h5py.File(path, "r") as f:
            raw = f.attrs.get("export_request")
    except OSError as e:
        raise KqsvdError(f"{path}: cannot be read ({e}); remove it and run again") from None
    if raw is None:
        raise KqsvdError(f"{path}: no 'export_request' attribute: an export from an older "
                         "exporter or another program; remove the folder or choose another")
    try:
        return json.loads(raw.decode() if isinstance(raw, bytes) else raw)
    except ValueError:
        raise KqsvdError(f"{path}: attribute 'export_request' is not JSON") from None


def check_names(out):
    """Refuses (KqsvdError) a folder where a name of the export's files
    (model.h5, shard-NNNN.h5 and their temporary names) is not a regular
    file: reading a FIFO would wait forever, and the rename at the end
    must not replace a device.  Needs no model: called before the load."""
    if not os.path.isdir(out):
        return
    for name in sorted(os.listdir(out)):
        path = os.path.join(out, name)
        ours = name.startswith(("model.h5", "shard-")) and ".h5" in name
        if ours and not os.path.isfile(path):
            raise KqsvdError(f"{path}: not a regular file (a device, FIFO, socket or folder); "
                             "remove it, or export into another folder")


def survey(out, req, nshards):
    """Prepares --out for the request: drops temporary files of an
    interrupted run, checks every shard already there, and refuses a folder
    of another export.  Returns (finished shard indices, whether model.h5
    is there, i.e. the export is complete).  Raises KqsvdError."""
    os.makedirs(out, exist_ok=True)
    check_names(out)
    done, complete = set(), False
    for name in sorted(os.listdir(out)):
        path = os.path.join(out, name)
        if name.endswith(".h5.tmp") and (name.startswith("shard-") or name == "model.h5.tmp"):
            os.remove(path)
            continue
        if name == "model.h5" or (name.startswith("shard-") and name.endswith(".h5")):
            why = _differs(path, _recorded(path), req)
            if why:
                raise KqsvdError(why)
            if name == "model.h5":
                complete = True
                continue
            index = whole(name[len("shard-"):-len(".h5")])  # ASCII digits alone: shard-²
            if index is None or index >= nshards:
                raise KqsvdError(f"{path}: not a shard of this export ({nshards} shards)")
            done.add(index)
    if complete and len(done) != nshards:
        raise KqsvdError(f"{out}: model.h5 is there but {nshards - len(done)} of {nshards} shards "
                         "are missing; remove the folder and export again")
    return done, complete


def _header(f, fmt, name, info, req):
    f.attrs.update(kqsvd_format=fmt, kqsvd_format_version=np.int64(1), model=name,
                   num_layers=np.int64(info.num_layers), num_heads=np.int64(info.num_heads),
                   num_kv_heads=np.int64(info.num_kv_heads), head_dim=np.int64(info.head_dim),
                   hidden_size=np.int64(info.hidden_size), causal=np.int64(info.causal),
                   export_request=json.dumps(req, sort_keys=True))
    # Extension: which side of RoPE the queries and keys were taken
    # (docs/formats.md 5.6); kqsvd calibrate carries it into proj.h5.
    if "rope" in req:
        f.attrs["rope"] = req["rope"]


def _create(f, name, shape, dtype):
    ds = f.create_dataset(name, shape=shape, dtype=NP_TYPES[dtype])
    if dtype == "bf16":
        ds.attrs["dtype"] = "bfloat16"
    return ds


def encode(t, dtype):
    """A float tensor as a numpy array of the contract's element type."""
    import torch
    if dtype == "bf16":
        return t.to(torch.bfloat16).view(torch.int16).cpu().numpy().view(np.uint16)
    return t.to({"f16": torch.float16, "f32": torch.float32, "f64": torch.float64}[dtype]) \
        .cpu().numpy()


def _crash_point():
    """Tests: KQSVD_TEST_CRASH_AFTER_SHARDS=N kills the process (SIGKILL,
    as the OOM killer would) part way into shard N, after N finished ones."""
    v = os.environ.get("KQSVD_TEST_CRASH_AFTER_SHARDS")
    return int(v) if v else -1


class Exporter:
    """Writes the shards of one request.  seqs: [num_seqs, seq_len] token
    windows; start: the first text token's index; bos: 1 if every window
    starts with the BOS token."""

    def __init__(self, model, info, args, req, seqs, start, bos):
        self.model, self.info, self.args, self.req = model, info, args, req
        self.seqs, self.start, self.bos = seqs, start, bos
        self.name = args.model_name or args.model
        self.nshards = (args.num_seqs + args.shard_seqs - 1) // args.shard_seqs

    def _shard(self, s, bar):
        import h5py
        import torch
        a, info = self.args, self.info
        rows = self.seqs[s * a.shard_seqs:(s + 1) * a.shard_seqs]
        T = rows.size
        path = os.path.join(a.out, f"shard-{s:04d}.h5")
        device = next(self.model.parameters()).device
        with h5py.File(path + ".tmp", "w") as f:
            _header(f, "cache", self.name, info, self.req)
            ds = {"q": _create(f, "queries", (info.num_layers, info.num_heads, T, info.head_dim),
                               a.dtype),
                  "k": _create(f, "keys", (info.num_layers, info.num_kv_heads, T, info.head_dim),
                               a.dtype),
                  "v": _create(f, "values", (info.num_layers, info.num_kv_heads, T, info.head_dim),
                               a.dtype)}
            f["seq_lens"] = np.full(len(rows), a.seq_len, dtype=np.int64)
            # Extensions: where the shard's text tokens lie in the tokenized
            # text, the text's name, and whether each window starts with BOS.
            text_per = a.seq_len - self.bos
            first = self.start + s * a.shard_seqs * text_per
            f.attrs["token_range"] = np.array([first, first + len(rows) * text_per], np.int64)
            f.attrs["text"] = os.path.basename(a.text)
            f.attrs["bos"] = np.int64(self.bos)
            row = {"at": 0}

            def sink(layer, kind, t):
                b, h, n, d = t.shape
                arr = encode(t.detach(), a.dtype)
                r0 = row["at"]
                ds[kind][layer, :, r0:r0 + b * n, :] = arr.transpose(1, 0, 2, 3).reshape(h, b * n, d)

            cap = Capture(self.model, info.model_type, self.model.config, sink,
                          self.req.get("rope", "post"), compute="sdpa")
            try:
                for i in range(0, len(rows), a.batch):
                    chunk = rows[i:i + a.batch]
                    row["at"] = i * a.seq_len
                    if s == _crash_point() and i > 0:
                        os.kill(os.getpid(), signal.SIGKILL)
                    with torch.no_grad():
                        self.model(input_ids=torch.from_numpy(chunk).to(device), use_cache=False)
                    bar.update(len(chunk))
            finally:
                cap.close()
        publish(path + ".tmp", path)

    def _model_file(self):
        import h5py
        a, info = self.args, self.info
        path = os.path.join(a.out, "model.h5")
        with h5py.File(path + ".tmp", "w") as f:
            _header(f, "model", self.name, info, self.req)
            ds = _create(f, "o_proj", (info.num_layers, info.hidden_size,
                                       info.num_heads * info.head_dim), a.dtype)
            for l, w in enumerate(attention_out_proj(self.model, info.model_type)):
                ds[l] = encode(w.detach(), a.dtype)
        publish(path + ".tmp", path)

    def run(self, done):
        """Writes the shards not in `done`, then model.h5 (last, so that its
        presence means a complete export).  An interruption (Ctrl-C) keeps
        the finished shards; the same command resumes."""
        from tqdm import tqdm
        a = self.args
        left = [s for s in range(self.nshards) if s not in done]
        todo = sum(len(self.seqs[s * a.shard_seqs:(s + 1) * a.shard_seqs]) for s in left)
        tty = sys.stderr.isatty()
        bar = tqdm(total=todo, desc="export", unit="seq", file=sys.stderr, dynamic_ncols=True,
                   mininterval=0.5 if tty else 10.0, disable=todo == 0)
        t0 = time.time()
        try:
            for s in left:
                self._shard(s, bar)
        except KeyboardInterrupt:
            bar.close()
            for s in left:
                tmp = os.path.join(a.out, f"shard-{s:04d}.h5.tmp")
                if os.path.exists(tmp):
                    os.remove(tmp)
            raise
        bar.close()
        self._model_file()
        return time.time() - t0
