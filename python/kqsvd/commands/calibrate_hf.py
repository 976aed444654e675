"""python -m kqsvd.calibrate_hf: projections straight from a model, with no
caches on disk.  The model runs over the calibration sequences; the
post-RoPE queries and keys (or, with --keys pre-rope, those before RoPE)
and the values of every layer (kqsvd.calibration.capture, the exporter's capture code)
are folded into the C library's accumulator (kqsvd.Calibrator) as they are
produced; W^O comes from the weights.  The result equals
`examples/export_hf.py --dtype f32 --weights-dtype f32` (with the same
--keys) then `kqsvd calibrate` on the same tokens, to round-off.

Under `mpirun -np N` (with mpi4py), each rank runs the model on its share
of the sequences and the factors are merged across ranks (TSQR); rank 0
writes the one projections file.  With --checkpoint DIR, each rank saves
its factors every --checkpoint-every seconds; the same command run again
skips the sequences already folded."""
import argparse
import hashlib
import json
import os
import signal
import sys
import time

from ..calibration import faults
from ..calibration.capture import KEYS
from ..errors import KqsvdError, UsageError
from ..formats.files import Staged, check_folder_output, check_input_file, check_outputs, write_all

HELP = __doc__.split("\n\n")[0] + """

    python -m kqsvd.calibrate_hf --model PATH_OR_ID --text FILE --seq-len 2048 \\
        --num-seqs 128 --out PROJ.h5 [--ranks POLICY | --eps E] [--beta B] \\
        [--keys post-rope|pre-rope] [--checkpoint DIR] [mpirun -np N python -m kqsvd.calibrate_hf ...]

--model is a model folder, a GGUF file of a Llama-family model or an id
resolved offline, as examples/export_hf.py takes it; the sequences are that
exporter's --split train windows of the text."""

EXIT_INTERRUPTED = 75  # as `kqsvd calibrate`: checkpoints kept, run again to resume


PROG = "python -m kqsvd.calibrate_hf"


def log(comm, msg):
    if comm is None or comm.Get_rank() == 0:
        print(f"calibrate_hf: {msg}", file=sys.stderr, flush=True)


def world():
    """mpi4py's COMM_WORLD when started by an MPI launcher, else None (no
    MPI at all, so a laptop or a login node needs no MPI runtime)."""
    launched = any(os.environ.get(v) for v in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"))
    if not launched:
        return None
    try:
        from mpi4py import MPI
    except ImportError:
        raise UsageError("started by mpirun, but mpi4py is missing (Debian: apt-get install "
                         "python3-mpi4py)") from None
    return MPI.COMM_WORLD


def agree(comm, error):
    """Collective: every rank learns whether any failed.  The first failing
    rank raises its error (printed once, by it); the others exit with the
    same code, quietly, so no rank waits for another in a later collective
    and a failure every rank found alike is printed once."""
    if comm is None:
        if error:
            raise error
        return
    code = 0 if error is None else (2 if isinstance(error, UsageError) else 1)
    codes = comm.allgather(code)
    failed = [r for r, c in enumerate(codes) if c]
    if not failed:
        return
    if comm.Get_rank() == failed[0]:
        raise error
    raise SystemExit(codes[failed[0]])


def on_root(comm, rank, work):
    """Collective: work() on rank 0 alone, then every rank learns whether
    it failed (agree), so that none waits for it in a later collective.
    Returns what work() returned on rank 0, None elsewhere."""
    err, out = None, None
    if rank == 0:
        try:
            out = work()
        except (KqsvdError, OSError) as e:
            err = e
    agree(comm, err)
    return out


def file_identity(path):
    """What says a file is the same one: its real path, size and time."""
    h = hashlib.sha256()
    for root, _dirs, files in (os.walk(path) if os.path.isdir(path) else [("", [], [path])]):
        for f in sorted(files):
            p = os.path.join(root, f)
            st = os.stat(p)
            h.update(f"{os.path.realpath(p)}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def inputs_hash(args, model_path):
    """What the output is made from (the files' identities and every option
    that changes a number), stored as its `inputs_hash`: --skip-done skips
    an output whose hash matches.  The rank count is left out: 1 and N ranks
    agree to round-off."""
    from .. import __version__
    return hashlib.sha256(json.dumps(
        [file_identity(model_path), file_identity(args.text), args.seq_len, args.num_seqs,
         args.dtype, args.qr_block, args.ranks, args.beta, args.model_name or args.model,
         __version__] + ([] if not args.no_bos else ["no-bos"]) + _keys(args)
    ).encode()).hexdigest()[:32]


def _keys(args):
    """--keys, --head-groups and --qr in a hash: only when not the defaults, so
    that the hashes of outputs and checkpoints made before the options stay
    valid."""
    return ([] if args.keys == "post-rope" else [args.keys]) + (
        [] if args.head_groups == 1 else [f"head-groups:{args.head_groups}"]) + (
        [] if args.qr == "tsqr" else [f"qr:{args.qr}"])


def up_to_date(path, want):
    """Whether `path` is a projections file made from the same inputs."""
    if not os.path.isfile(path):
        return False
    try:
        import h5py
        with h5py.File(path, "r") as f:
            have = f.attrs.get("inputs_hash")
    except (OSError, ImportError):
        return False
    return (have.decode() if isinstance(have, bytes) else have) == want


class Checkpoint:
    """One rank's progress in DIR: the accumulator's factors (the C
    library's checkpoint format) in STATE-NNNNNN.h5 after NNNNNN sequences,
    and rank-R-of-P.json naming the current one with the inputs' hash.  The
    JSON is replaced after the new state is complete, and the old state is
    removed after that, so a crash at any point leaves a consistent pair."""

    def __init__(self, folder, rank, size, inputs):
        self.folder, self.inputs = folder, inputs
        self.stem = f"rank-{rank}-of-{size}"
        self.index = os.path.join(folder, self.stem + ".json")
        self.current = None

    def resume(self, cal):
        """Loads the saved factors into cal; returns the sequences done."""
        if not os.path.exists(self.index):
            return 0
        try:
            with open(self.index) as f:
                saved = json.load(f)
            done, state = int(saved["done"]), saved["state"]
            inputs = saved["inputs"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise KqsvdError(f"{self.index}: not a calibrate_hf checkpoint ({e}); remove it") from None
        if inputs != self.inputs:
            raise KqsvdError(f"{self.index}: field 'inputs' differs: the checkpoint is from other "
                             "inputs or options (model, text, --seq-len, --num-seqs, --dtype, --no-bos, "
                             "--keys, --qr-block or rank count); remove the folder or use another")
        cal.load(os.path.join(self.folder, state))
        self.current = state
        return done

    def save(self, cal, done):
        from ..formats.files import write_atomic
        state = f"{self.stem}-{done:06d}.h5"
        path = os.path.join(self.folder, state)
        cal.save(path, force=True)  # a state this rank wrote before an interruption
        def write(tmp):
            with open(tmp, "w") as f:
                json.dump({"inputs": self.inputs, "done": done, "state": state}, f)
        write_atomic(self.index, write)
        if self.current and self.current != state:
            os.remove(os.path.join(self.folder, self.current))
        self.current = state

    def remove(self):
        for f in os.listdir(self.folder):
            if f.startswith(self.stem):
                os.remove(os.path.join(self.folder, f))


def run(args):
    import torch
    from .. import models
    from ..calibration.binding import Calibrator, check_policy
    from ..calibration.capture import attention_out_proj, rope_of
    from ..calibration.insitu import TorchFold, fold_sequences
    from ..progress import Progress
    comm = world()
    rank, size = (comm.Get_rank(), comm.Get_size()) if comm else (0, 1)
    err, stop = None, {"signal": None}
    made_from = skip = None
    try:
        made_from = inputs_hash(args, models.resolve(args.model))
        skip = rank == 0 and args.skip_done and up_to_date(args.out, made_from)
    except (KqsvdError, OSError) as e:
        err = e
    agree(comm, err)
    if comm:
        skip = comm.bcast(skip, root=0)
    if skip:
        log(comm, f"{args.out} is up to date (made from these inputs and options): nothing to do")
        return
    try:
        inputs = [("--model", models.resolve(args.model)), ("--text", args.text)]
        if rank == 0:
            check_outputs([("--out", args.out)], inputs, args.force or args.skip_done)
        if args.checkpoint:
            check_folder_output("--checkpoint", args.checkpoint)
        models.check_device(args.device, flags=True)
        # What the model's header says, checked before the load: nothing is
        # made (the checkpoint folder included) for options it refuses.
        info, cfg = models.describe(args.model)
        models.check_positions(info, cfg, args.seq_len, flags=True)
        rope = rope_of(info.model_type, args.keys)
        if info.num_kv_heads % args.head_groups:
            raise UsageError(f"--head-groups {args.head_groups} does not divide the "
                             f"{info.num_kv_heads} KV heads of {args.model}")
        check_policy(args.ranks, args.beta, info.head_dim * args.head_groups)
        dtype = {"f32": torch.float32, "f64": torch.float64}[args.dtype]
        model, tok, info = models.load(args.model, lm_head=False, device=args.device, dtype=dtype)
        seqs, ntok, _, _ = models.token_windows(tok, args.text, args.seq_len, args.num_seqs,
                                                "train", bos=not args.no_bos, flags=True)
        if args.checkpoint:
            try:
                os.makedirs(args.checkpoint, exist_ok=True)
            except OSError as e:
                raise UsageError(f"--checkpoint {args.checkpoint}: cannot make the folder: "
                                 f"{e.strerror}") from None
        def new_cal():
            return Calibrator(info.num_layers, info.num_kv_heads,
                              info.num_heads // info.num_kv_heads, info.head_dim, info.hidden_size,
                              block_rows=args.qr_block, head_groups=args.head_groups, qr=args.qr)
        cal = new_cal()
        # The fold on the model's device when it is a GPU (rows never leave
        # it), else in the C library (--fold picks).
        on_device = TorchFold(info, args.device, "gram" if args.qr == "gram" else "qr",
                              args.head_groups) if args.fold == "torch" or (
            args.fold == "auto" and args.device != "cpu") else None
    except (KqsvdError, OSError) as e:
        err = e
    agree(comm, err)

    first, last = rank * args.num_seqs // size, (rank + 1) * args.num_seqs // size
    ckpt, done = None, 0
    try:
        if args.checkpoint:
            inputs = hashlib.sha256(json.dumps(
                [file_identity(models.resolve(args.model)), file_identity(args.text), args.seq_len,
                 args.num_seqs, args.dtype, args.qr_block, rank, size, args.no_bos] + _keys(args)
            ).encode()).hexdigest()
            ckpt = Checkpoint(args.checkpoint, rank, size, inputs)
            done = ckpt.resume(cal)
            if on_device and done:
                on_device.load(cal)
                cal.close()
                cal = new_cal()
    except KqsvdError as e:
        err = e
    agree(comm, err)
    resumed = comm.allreduce(done) if comm else done
    if resumed:
        log(comm, f"resuming: {resumed} of {args.num_seqs} sequences already folded "
                  f"(checkpoints in {args.checkpoint})")
    mine = last - first - done
    total = comm.allreduce(mine) if comm else mine
    bar = Progress("calibrate_hf", max(total, 1) * args.seq_len, "tok") if rank == 0 else None
    for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(s, lambda num, _f: stop.update(signal=num))
    saved_at = time.time()

    def after(i):
        nonlocal saved_at
        # Rank 0's bar counts its own sequences for all: ranks run alike.
        if bar:
            bar.advance(args.seq_len * size if comm else args.seq_len)
        n = done + i + 1
        if ckpt and (stop["signal"] or time.time() - saved_at >= args.checkpoint_every or
                     n == last - first):
            if on_device:
                snap = new_cal()
                on_device.into(snap)
                ckpt.save(snap, n)
                snap.close()
            else:
                ckpt.save(cal, n)
            saved_at = time.time()
        faults.at(f"window-{n}", rank)
        if stop["signal"]:
            raise InterruptedError

    def stopped():
        """Collective: whether a signal reached any rank.  Every rank
        stops together, at the same point, so none waits in a collective."""
        hit = stop["signal"] or 0
        hit = comm.allreduce(hit, op=max_op()) if comm else hit
        if hit:
            log(comm, f"stopped by signal {hit}: " +
                (f"checkpoints in {args.checkpoint}; run the same command to resume"
                 if ckpt else "no --checkpoint, nothing kept"))
            raise SystemExit(EXIT_INTERRUPTED)

    t0 = time.time()
    try:
        fold_sequences(model, info, seqs[first + done:last], on_device or cal, args.device, after,
                       rope, args.head_groups)
    except InterruptedError:
        pass  # every rank learns of it in stopped()
    except KqsvdError as e:
        err = KqsvdError(f"rank {rank}: {e}" if comm else str(e))
    agree(comm, err)
    faults.at("fold", rank)
    stopped()
    seconds = time.time() - t0
    if on_device:
        on_device.into(cal)
    cal.reduce(comm, 0)

    def solve(staged):
        for l, w in enumerate(attention_out_proj(model, info.model_type)):
            cal.absorb_oproj(l, w.detach().cpu())  # the C library reads host memory
        res = cal.finish(args.ranks, args.beta)
        res.write(staged.tmp(args.out), model=args.model_name or args.model,
                  tokens=args.num_seqs * args.seq_len, causal=info.causal, force=True,
                  inputs_hash=made_from, rope=rope, seq_len=args.seq_len)
        faults.at("write", rank)
        return res

    # Staged: a signal while solving or writing leaves no output, and is
    # said (exit 75) as during the fold; the checkpoints stay until the end.
    # Rank 0's failures are agreed on, so that no rank waits for it.
    with Staged() as staged:
        res = on_root(comm, rank, lambda: solve(staged))
        stopped()
        on_root(comm, rank, lambda: write_all([], staged))
        if rank == 0:
            rk, rv = res.ranks("kqsvd")
            print(f"wrote {args.out}: kqsvd, ksvd and eigen (beta = {args.beta:g}) projections "
                  f"of {info.num_layers} layers from {args.num_seqs} x {args.seq_len} tokens on "
                  f"{size} rank{'s' if size > 1 else ''}"
                  f"{', keys before RoPE' if rope == 'pre' else ''} in {seconds:.2f} s, no caches "
                  f"written; kqsvd ranks {args.ranks}: rank_k {rk}, rank_v {rv}")
    if ckpt:
        if comm:
            comm.Barrier()  # the output exists before any checkpoint goes
        ckpt.remove()


def max_op():
    from mpi4py import MPI
    return MPI.MAX


def parse(argv):
    from .cli import ArgumentParser, count, finite, nonnegative, positive, window_options
    ap = ArgumentParser(prog=PROG, description=HELP,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    window_options(ap)
    ap.add_argument("--out", required=True, help="projections file to write")
    ap.add_argument("--ranks", help="rank policy as kqsvd calibrate takes it [eps:0.1]")
    ap.add_argument("--eps", type=finite, help="same as --ranks eps:E")
    ap.add_argument("--beta", type=positive, default=1.0, help="eigen's key/query unbalance [1]")
    ap.add_argument("--checkpoint", help="save progress in this folder; rerun to resume")
    ap.add_argument("--checkpoint-every", type=nonnegative, default=60.0,
                    help="seconds between checkpoints, 0 = after every sequence [60]")
    ap.add_argument("--qr-block", type=count(1), default=256,
                    help="rows per Householder update [256]")
    ap.add_argument("--dtype", choices=("f32", "f64"), default="f32",
                    help="the model's precision, as export_hf.py --dtype f32/f64 runs it [f32]")
    ap.add_argument("--device", default="cpu", help="where the model runs: cpu or cuda[:N] [cpu]")
    ap.add_argument("--no-bos", action="store_true",
                    help="windows without the BOS token the tokenizer adds in normal use, as "
                         "export_hf.py --no-bos")
    ap.add_argument("--keys", choices=tuple(KEYS), default="post-rope",
                    help="fold queries and keys after RoPE, or before it (decoders), as "
                         "export_hf.py --keys [post-rope]")
    ap.add_argument("--fold", choices=("auto", "c", "torch"), default="auto",
                    help="where rows are folded: c (the C library, on the CPU), torch (float64 "
                    "on the model's device, every layer of a window at once) or auto (torch on "
                    "a GPU, else c) [auto]")
    ap.add_argument("--qr", choices=("tsqr", "gram"), default="tsqr",
                    help="how rows become factors, as kqsvd calibrate --qr: tsqr (Householder "
                    "QR) or gram (float64 Gram matrices: half the flops, in large batched "
                    "GEMMs on a GPU; singular values below ~1e-8 of the largest are lost) "
                    "[tsqr]")
    ap.add_argument("--head-groups", type=count(1), default=1, metavar="G",
                    help="solve each group of G consecutive KV heads as one, as kqsvd calibrate "
                    "--head-groups: one latent per group (G divides the KV heads) [1]")
    ap.add_argument("--model-name", help="the output's model attribute [--model]")
    ap.add_argument("--force", action="store_true", help="replace an existing --out")
    ap.add_argument("--skip-done", action="store_true",
                    help="do nothing when --out exists and was made from the same model, text "
                    "and options; replace it otherwise")
    args = ap.parse_args(argv)
    if args.force and args.skip_done:
        raise UsageError("give --force (always remake --out) or --skip-done (remake it only when "
                         "its inputs changed), not both")
    if args.ranks and args.eps is not None:
        raise UsageError("give --ranks or --eps, not both")
    args.ranks = args.ranks or (f"eps:{args.eps:g}" if args.eps is not None else "eps:0.1")
    check_input_file("--text", args.text)
    if args.checkpoint:
        # The run deletes its checkpoint files at the end; an output among
        # them (even one named like them) would go with them.
        ck = os.path.realpath(args.checkpoint)
        out = os.path.realpath(args.out)
        if out == ck or out.startswith(ck + os.sep):
            raise UsageError(f"--out {args.out} lies inside --checkpoint {args.checkpoint}, whose "
                             "files the run deletes; write it elsewhere")
    return args


def main(argv=None):
    from .cli import run_command
    got = {}
    # Options are read alike on every rank: rank 0 alone reports them.  In
    # run(), agree() has only the rank that failed first raise.
    code = run_command(PROG, lambda: got.update(args=parse(argv)))
    if not code:
        code = run_command(PROG, lambda: run(got["args"]), every_rank=True)
    raise SystemExit(code)


if __name__ == "__main__":
    main()
