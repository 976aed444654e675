"""python -m kqsvd.allocate: quality-aware ranks per (layer, KV head) for a
fraction of the full KV cache (the policy quality-budget:F; with --tune,
quality-tuned:F), written into a copy of the projections file.  The work
is kqsvd.quality.allocate.fit; this module parses and prints."""
import argparse
import sys

from .. import models
from ..errors import UsageError
from ..formats.files import check_input_file, check_outputs
from ..formats.policy import QUALITY_BUDGET, QUALITY_TUNED
from ..formats.projections import METHODS
from ..quality.allocate import fit
from .cli import ArgumentParser, count, fraction, positive, run_command

PROG = "python -m kqsvd.allocate"


def main(argv=None):
    return run_command(PROG, lambda: _run(parse(argv)))


def parse(argv):
    ap = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="model folder, GGUF file or id (offline)")
    ap.add_argument("--text", required=True, help="calibration text (its train split is used)")
    ap.add_argument("--proj", required=True, help="projections file (kqsvd calibrate --out)")
    ap.add_argument("--budget", required=True, type=fraction,
                    help="fraction F of the full KV cache to keep, 0 < F <= 1")
    ap.add_argument("--out", required=True, help="the projections file to write, with the ranks")
    ap.add_argument("--force", action="store_true", help="replace an existing --out")
    ap.add_argument("--methods", default=",".join(METHODS), help="[kqsvd,ksvd,eigen]")
    ap.add_argument("--seq-len", type=count(2), default=256, help="tokens per window [256]")
    ap.add_argument("--num-seqs", type=count(1), default=4, help="calibration windows [4]")
    ap.add_argument("--no-bos", action="store_true", help="windows without the BOS token")
    ap.add_argument("--rounds", type=count(0), default=6, help="refinement rounds [6]")
    ap.add_argument("--tune", type=count(0), default=0, metavar="STEPS",
                    help="also train the up-projections for STEPS Adam steps (kqsvd.quality.tune; the "
                    "policy becomes quality-tuned:F) [0: no]")
    ap.add_argument("--check-seqs", type=count(0), default=4,
                    help="--tune: windows after the calibration ones that choose the step [4]")
    ap.add_argument("--lr", type=positive, default=3e-3, help="--tune: learning rate [3e-3]")
    ap.add_argument("--device", default="cpu", help=f"{models.DEVICES} [cpu]")
    a = ap.parse_args(argv)
    if a.tune and a.check_seqs < 1:
        raise UsageError(f"--check-seqs {a.check_seqs}: --tune {a.tune} needs 1 or more")
    a.methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    bad = [m for m in a.methods if m not in METHODS or a.methods.count(m) > 1]
    if bad or not a.methods:
        raise UsageError(f"--methods {','.join(a.methods)}: expected some of {', '.join(METHODS)}, "
                         "each once")
    check_input_file("--text", a.text)
    check_outputs([("--out", a.out)], [("--proj", a.proj), ("--text", a.text),
                                       ("--model", models.resolve(a.model))], a.force)
    return a


def _run(a):
    """The command: fit() with the options, and a line saying what it wrote."""
    log = lambda s: print(f"allocate: {s}", file=sys.stderr, flush=True)  # noqa: E731
    fit(a.model, a.text, a.proj, a.budget, a.out, a.methods, a.seq_len, a.num_seqs,
        not a.no_bos, a.rounds, a.tune, a.check_seqs, a.lr, a.device, a.force, log)
    print(f"wrote {a.out}: {QUALITY_TUNED if a.tune else QUALITY_BUDGET}{a.budget:g} ranks per layer and KV head "
          f"for {', '.join(a.methods)}")


if __name__ == "__main__":
    sys.exit(main())
