"""The in-situ calibration (python -m kqsvd.calibrate_hf) in four steps:

    prepare   every check before work (outputs, the model's header, the
              policy), then the model, the windows and the accumulator
    resume    this rank's checkpoint, if the same run was cut short
    fold      this rank's share of the windows folded as the model runs,
              checkpointed as it goes, stopping where a signal says
    finish    the factors merged across ranks, solved on rank 0, written
              under a temporary name and renamed, the checkpoints removed

Every rank runs every step; the collectives (ranks.Group), the
checkpoints (checkpoints.py) and the faults the tests inject (faults.py)
live in modules of their own.  `args` is the command's options
(commands/calibrate_hf.py documents them)."""
import dataclasses
import hashlib
import json
import os
import re
import time

from .. import models
from ..errors import KqsvdError, UsageError
from ..formats.files import (Staged, check_folder_output, check_outputs, missing_top, rmdir_made,
                             said_of, write_all)
from ..progress import Progress
from ..version import __version__
from . import faults
from .calibrator import Calibrator, check_policy
from .capture import attention_out_proj, rope_of
from .checkpoints import Checkpoint, Share, file_identity
from .insitu import TorchFold, fold_sequences
from .ranks import Group, Signals, Stopped

__all__ = ["Stopped", "run"]


@dataclasses.dataclass
class Job:
    """One rank's run: its share [first, last) of the windows `seqs`,
    `done` of them folded, into `cal` (or `on_device`, folding on the
    model's device), checkpointed by `ckpt`."""
    args: object
    group: Group
    made_from: str
    model: object = None
    info: object = None
    rope: str = None
    seqs: object = None
    cal: object = None
    on_device: object = None
    ckpt: object = None
    first: int = 0
    last: int = 0
    done: int = 0
    seconds: float = 0.0
    made: str = None  # the outermost folder of --checkpoint the run made
    locked: bool = False  # the folder taken for this run (rank 0's flock)

    def new_cal(self):
        i, a = self.info, self.args
        return Calibrator(i.num_layers, i.num_kv_heads, i.num_heads // i.num_kv_heads,
                          i.head_dim, i.hidden_size, block_rows=a.qr_block,
                          head_groups=a.head_groups, qr=a.qr)


def run(args, log):
    """The calibration; returns what finish() wrote (None when --skip-done
    found the output up to date).  Raises Stopped on every rank when a
    signal stopped it, KqsvdError (on the rank that failed first; the
    others exit quietly) otherwise.  Collective over the launcher's ranks."""
    group = Group(log)
    job = prepare(args, group)
    if job is None:
        return None
    try:
        resume(job)
        signals = Signals()
        fold(job, signals)
        return finish(job, signals)
    except BaseException:  # after every rank agreed: none writes there now
        if job.ckpt:
            job.ckpt.release()
        # Only the run that held the folder removes it: two runs may both
        # have found it missing and made it, and the one refused the lock
        # would take the other's folder away before its first save.
        if args.checkpoint and job.locked:
            rmdir_made(args.checkpoint, job.made)  # kept when it holds a checkpoint
        raise


def prepare(args, group):
    """Job, or None when --skip-done finds the output made from these
    inputs.  Checks before the load whatever the model's header can tell;
    makes the checkpoint folder only once everything has passed."""
    made_from = group.each(lambda: inputs_hash(args, models.resolve(args.model)))
    skip = group.bcast(group.rank == 0 and args.skip_done and up_to_date(args.out, made_from))
    if skip:
        group.log(f"{args.out} is up to date (made from these inputs and options): nothing to do")
        return None
    job = Job(args, group, made_from)
    group.each(lambda: _check_and_load(job))
    job.first = group.rank * args.num_seqs // group.size
    job.last = (group.rank + 1) * args.num_seqs // group.size
    return job


def _check_and_load(job):
    import torch
    a = job.args
    inputs = [("--model", models.resolve(a.model)), ("--text", a.text)]
    if job.group.rank == 0:
        check_outputs([("--out", a.out)], inputs, a.force or a.skip_done)
    if a.checkpoint:
        check_folder_output("--checkpoint", a.checkpoint)
    models.check_device(a.device, flags=True)
    info, cfg = models.describe(a.model)  # the header: nothing made for what it refuses
    models.check_positions(info, cfg, a.seq_len, flags=True)
    job.rope = rope_of(info.model_type, a.keys)
    if info.num_kv_heads % a.head_groups:
        raise UsageError(f"--head-groups {a.head_groups} does not divide the "
                         f"{info.num_kv_heads} KV heads of {a.model}")
    try:
        check_policy(a.ranks, a.beta, info.head_dim * a.head_groups)
    except UsageError as e:
        raise UsageError(policy_error(a, e)) from None
    dtype = {"f32": torch.float32, "f64": torch.float64}[a.dtype]
    job.model, tok, job.info = models.load(a.model, lm_head=False, device=a.device, dtype=dtype)
    job.seqs = models.token_windows(tok, a.text, a.seq_len, a.num_seqs, "train",
                                    bos=not a.no_bos, flags=True)[0]
    if a.checkpoint:
        job.made = missing_top(a.checkpoint)
        try:
            os.makedirs(a.checkpoint, exist_ok=True)
        except OSError as e:
            raise UsageError(f"--checkpoint {a.checkpoint}: cannot make the folder: "
                             f"{e.strerror}") from None
    job.cal = job.new_cal()
    # The fold on the model's device when it is a GPU (rows never leave
    # it), else in the C library (--fold picks).
    if a.fold == "torch" or (a.fold == "auto" and a.device != "cpu"):
        job.on_device = TorchFold(job.info, a.device, "gram" if a.qr == "gram" else "qr",
                                  a.head_groups)


def resume(job):
    """Takes the checkpoint folder (rank 0, for the run) and loads this
    rank's checkpoint, when the run was cut short before."""
    a, group = job.args, job.group
    if not a.checkpoint:
        return
    inputs = group.each(lambda: hashlib.sha256(json.dumps(
        [file_identity(models.resolve(a.model)), file_identity(a.text), a.seq_len,
         a.num_seqs, a.dtype, a.qr_block, group.rank, group.size, a.no_bos] + _keys(a)
    ).encode()).hexdigest())
    share = Share(job.last - job.first, a.seq_len, job.info.head_dim * a.head_groups)
    job.ckpt = Checkpoint(a.checkpoint, group.rank, group.size, inputs, share)
    group.on_root(lambda: job.ckpt.lock("--checkpoint"))
    job.locked = True  # on every rank: on_root raised on all of them otherwise

    def load():
        job.done = job.ckpt.resume(job.cal)
        if job.on_device and job.done:
            job.on_device.load(job.cal)
            job.cal.close()
            job.cal = job.new_cal()
    group.each(load)
    resumed = group.sum(job.done)
    if resumed:
        group.log(f"resuming: {resumed} of {a.num_seqs} sequences already folded "
                  f"(checkpoints in {a.checkpoint})")


def _kept(job):
    return (f"checkpoints in {job.args.checkpoint}; run the same command to resume"
            if job.ckpt else "no --checkpoint, nothing kept")


def fold(job, signals):
    """Folds this rank's windows not done yet, checkpointing every
    --checkpoint-every seconds, at the last window and at a signal; every
    rank then agrees on failures and on signals (Stopped)."""
    a, group = job.args, job.group
    total = group.sum(job.last - job.first - job.done)
    bar = Progress("calibrate_hf", max(total, 1) * a.seq_len, "tok") if group.rank == 0 else None
    saved_at = [time.time()]

    def after(i):
        if bar:  # rank 0's bar counts its own windows for all: ranks run alike
            bar.advance(a.seq_len * group.size)
        n = job.done + i + 1
        if job.ckpt and (signals.hit or time.time() - saved_at[0] >= a.checkpoint_every or
                         n == job.last - job.first):
            _save(job, n)
            saved_at[0] = time.time()
        faults.at(f"window-{n}", group.rank)
        if signals.hit:
            raise InterruptedError  # every rank learns of it in check()

    def work():
        try:
            fold_sequences(job.model, job.info, job.seqs[job.first + job.done:job.last],
                           job.on_device or job.cal, a.device, after, job.rope, a.head_groups)
        except InterruptedError:
            pass
        except KqsvdError as e:
            raise KqsvdError(f"rank {group.rank}: {e}" if group.comm else str(e)) from None
    t0 = time.time()
    group.each(work)
    faults.at("fold", group.rank)
    signals.check(group, _kept(job))
    job.seconds = time.time() - t0


def _save(job, n):
    if job.on_device:  # a snapshot of the device's factors, in the C format
        snap = job.new_cal()
        job.on_device.into(snap)
        job.ckpt.save(snap, n)
        snap.close()
    else:
        job.ckpt.save(job.cal, n)


def finish(job, signals):
    """Merges the factors onto rank 0, solves and writes there; returns
    on rank 0 {"ranks": kqsvd's (rank_k, rank_v), "seconds": the fold's,
    "layers", "size": the ranks, "rope"}, None elsewhere.
    The output is written under a temporary name (Staged) and renamed only
    once every rank has agreed on failures and signals; the checkpoints
    stay until then."""
    group = job.group
    if job.on_device:
        job.on_device.into(job.cal)
    job.cal.reduce(group.comm, 0)
    with Staged() as staged:
        res = group.on_root(lambda: _solve(job, staged))
        signals.check(group, _kept(job))
        group.on_root(lambda: write_all([], staged, job.args.force or job.args.skip_done))
    if job.ckpt:
        group.barrier()  # the output exists before any checkpoint goes
        job.ckpt.remove()
    if res is None:
        return None
    return dict(ranks=res.ranks("kqsvd"), seconds=job.seconds, layers=job.info.num_layers,
                size=group.size, rope=job.rope)


def _solve(job, staged):
    a, info = job.args, job.info
    for l, w in enumerate(attention_out_proj(job.model, info.model_type)):
        job.cal.absorb_oproj(l, w.detach().cpu())  # the C library reads host memory
    res = job.cal.finish(a.ranks, a.beta)
    tmp = staged.tmp(a.out)
    try:
        res.write(tmp, model=a.model_name or a.model,
                  tokens=a.num_seqs * a.seq_len, causal=info.causal, force=True,
                  inputs_hash=job.made_from, rope=job.rope, seq_len=a.seq_len)
    except KqsvdError as e:  # a full disk: named as the user named the file
        raise said_of(e, a.out, tmp) from None
    faults.at("write", job.group.rank)
    return res


def policy_error(args, e):
    """The library's refusal of a policy (finish(ranks=..., beta=...): ranks
    'P': why) said of the option the user gave (--ranks P, or --eps E)."""
    why = re.sub(r"^finish\(.*?\): (ranks '[^']*': )?", "", str(e))
    return f"{getattr(args, 'policy_option', f'--ranks {args.ranks}')}: {why}"


def inputs_hash(args, model_path):
    """What the output is made from (the files' identities and every option
    that changes a number), stored as its `inputs_hash`: --skip-done skips
    an output whose hash matches.  The rank count is left out: 1 and N ranks
    agree to round-off."""
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
