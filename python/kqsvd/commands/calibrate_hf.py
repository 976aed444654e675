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
import os
import sys

from ..calibration import faults
from ..calibration.capture import KEYS
from ..calibration.driver import Stopped
from ..calibration.driver import run as calibrate
from ..errors import UsageError
from ..formats.files import check_input_file
from .cli import (ArgumentParser, count, finite, launched_rank, nonnegative, positive,
                  run_command, window_options)

HELP = __doc__.split("\n\n")[0] + """

    python -m kqsvd.calibrate_hf --model PATH_OR_ID --text FILE --seq-len 2048 \\
        --num-seqs 128 --out PROJ.h5 [--ranks POLICY | --eps E] [--beta B] \\
        [--keys post-rope|pre-rope] [--checkpoint DIR] [mpirun -np N python -m kqsvd.calibrate_hf ...]

--model is a model folder, a GGUF file of a Llama-family model or an id
resolved offline, as examples/export_hf.py takes it; the sequences are that
exporter's --split train windows of the text."""

EXIT_INTERRUPTED = 75  # as `kqsvd calibrate`: checkpoints kept, run again to resume


PROG = "python -m kqsvd.calibrate_hf"


def log(msg):
    print(f"calibrate_hf: {msg}", file=sys.stderr, flush=True)


def run(args):
    """The calibration (kqsvd.calibration.driver) and its one line."""
    try:
        got = calibrate(args, log)
    except Stopped as e:  # raised on every rank alike: said once
        if launched_rank() == 0:
            log(str(e))
        raise SystemExit(EXIT_INTERRUPTED) from None
    if got is None:
        return
    rk, rv = got["ranks"]
    n = got["size"]
    print(f"wrote {args.out}: kqsvd, ksvd and eigen (beta = {args.beta:g}) projections of "
          f"{got['layers']} layers from {args.num_seqs} x {args.seq_len} tokens on {n} "
          f"rank{'s' if n > 1 else ''}{', keys before RoPE' if got['rope'] == 'pre' else ''} in "
          f"{got['seconds']:.2f} s, no caches written; kqsvd ranks {args.ranks}: rank_k {rk}, "
          f"rank_v {rv}")


def parse(argv):
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
    # What the policy's errors name: the option the user gave.
    args.policy_option = f"--eps {args.eps:g}" if args.eps is not None else \
        f"--ranks {args.ranks or 'eps:0.1'}"
    args.ranks = args.ranks or (f"eps:{args.eps:g}" if args.eps is not None else "eps:0.1")
    faults.check()
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
    got = {}
    # Options are read alike on every rank: rank 0 alone reports them.  In
    # run(), agree() has only the rank that failed first raise.
    code = run_command(PROG, lambda: got.update(args=parse(argv)))
    if not code:
        code = run_command(PROG, lambda: run(got["args"]), every_rank=True)
    raise SystemExit(code)


if __name__ == "__main__":
    main()
