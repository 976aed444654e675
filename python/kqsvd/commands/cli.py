"""What every command line of the package shares: one-line usage errors,
numbers checked as they are parsed (each error names its option and value),
and errors printed once under MPI.

Exit status, the same in every command (as `kqsvd` in C): 2 for the command
line (an option malformed, out of range, contradicting another or
impossible for the model or file given; an output that cannot be written
or would replace an input), 1 for an input (a file missing, unreadable,
malformed or inconsistent) and for failures while running, 130 for Ctrl-C."""
import argparse
import math
import os
import signal
import sys
import threading

from ..errors import KqsvdError, UsageError
from ..formats.files import json_writer, write_all
from ..formats.numbers import integer, number, whole

# What pyproject.toml's [torch] extra brings: the model commands need them.
TORCH_EXTRA = ("torch", "transformers", "safetensors")


class ArgumentParser(argparse.ArgumentParser):
    """argparse with its errors as UsageError: one line, no usage dump.
    Run as one of the wheel's console scripts (kqsvd-quality, ...), the
    usage names that script rather than the `python -m` form."""

    def __init__(self, *args, **kwargs):
        kwargs["prog"] = _script() or kwargs.get("prog")
        super().__init__(*args, **kwargs)

    def error(self, message):
        raise UsageError(f"{message} (see --help)")


def _script():
    """The console script running (kqsvd-quality, ...), or None."""
    script = os.path.basename(sys.argv[0] if sys.argv else "")
    return script if script.startswith("kqsvd-") else None


def _number(kind, text, ok, what):
    v = (integer if kind is int else number)(text)  # ASCII digits alone (formats.numbers)
    if v is None:
        raise argparse.ArgumentTypeError(
            f"'{text}' is not a {'whole number' if kind is int else 'number'}")
    if kind is float and not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"'{text}' is not a finite number")
    if not ok(v):
        raise argparse.ArgumentTypeError(f"{text} must be {what}")
    return v


def finite(text):
    """A finite float."""
    return _number(float, text, lambda v: True, "finite")


def positive(text):
    """A finite float above 0."""
    return _number(float, text, lambda v: v > 0, "above 0")


def nonnegative(text):
    """A finite float, 0 or more."""
    return _number(float, text, lambda v: v >= 0, "0 or more")


def fraction(text):
    """A finite float in (0, 1]."""
    return _number(float, text, lambda v: 0 < v <= 1, "in (0, 1]")


def count(least):
    """A whole number >= least."""
    def parse(text):
        return _number(int, text, lambda v: v >= least, f"{least} or more")
    parse.__name__ = f"count>={least}"
    return parse


def between(least, most):
    """A whole number in least..most."""
    def parse(text):
        return _number(int, text, lambda v: least <= v <= most, f"in {least}..{most}")
    parse.__name__ = f"count in {least}..{most}"
    return parse


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def size(text):
    """A number of bytes above 0: a whole number, or a number with a unit
    (512MiB, 1GiB, 1.5GB; KiB/MiB/GiB/TiB powers of 1,024, KB/MB/GB/TB
    of 1,000), rounded down to whole bytes."""
    t = text.strip()
    digits = t.rstrip("KMGTiBkmgtb")
    unit = t[len(digits):].strip().upper()
    v = number(digits.strip()) if unit in _UNITS else None
    if v is None or not math.isfinite(v) or int(v * _UNITS[unit]) < 1:
        raise argparse.ArgumentTypeError(f"'{text}' is not a size in bytes above 0 "
                                         "(a whole number, or with a unit: 512MiB, 1GiB)")
    return int(v * _UNITS[unit])


def listed(parse):
    """A comma-separated list of items each read by `parse` (one of the
    types above): at least one item, no empty item, none given twice (a
    repeated configuration would only run twice)."""
    def read(text):
        items = [x.strip() for x in text.split(",")]
        if not text.strip() or not all(items):
            raise argparse.ArgumentTypeError(f"'{text}' is not a comma-separated list of values")
        out = []
        for x in items:
            v = parse(x)
            if v in out:
                raise argparse.ArgumentTypeError(f"'{x}' is given twice")
            out.append(v)
        return out
    read.__name__ = f"list of {parse.__name__}"
    return read


def window_options(ap):
    """The options that cut a model's windows from a text, for the commands
    that run a model on --num-seqs windows of --seq-len tokens."""
    ap.add_argument("--model", required=True, help="model folder, GGUF file or id (offline)")
    ap.add_argument("--text", required=True, help="UTF-8 text to cut the sequences from")
    ap.add_argument("--seq-len", type=count(1), required=True)
    ap.add_argument("--num-seqs", type=count(1), required=True)


def launched_rank():
    """This process's rank when an MPI launcher started it, else 0: read
    from the launcher's environment, so that errors found before MPI is
    initialised (or without mpi4py) are printed by one rank only."""
    for var in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"):
        v = os.environ.get(var)
        if whole(v) is not None:
            return whole(v)
    return 0


def run_command(prog, body, every_rank=False, interrupted=None):
    """Runs body() for a command line and returns its exit status (module
    docstring): KqsvdError becomes one line 'PROG: error: ...' on stderr;
    SIGTERM and Ctrl-C exit 130 with nothing written, or with what
    interrupted(), where given, says is kept (a report written as a run
    goes).
    Under MPI only rank 0 prints, unless every_rank (for errors that one
    rank alone raises, as calibrate_hf's agree() arranges)."""
    prog = _script() or prog

    def say(msg):
        if every_rank or launched_rank() == 0:
            print(f"{prog}: {msg}", file=sys.stderr, flush=True)

    def stop(_signum, _frame):
        raise KeyboardInterrupt

    # SIGTERM (kill, SLURM's time limit) ends the run as Ctrl-C does, so that
    # the temporary files are removed; a command may set its own handler.
    main = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGTERM, stop) if main else None
    try:
        body()
    except UsageError as e:
        say(f"error: {e}")
        return 2
    except KqsvdError as e:
        say(f"error: {e}")
        return 1
    except KeyboardInterrupt:
        say("interrupted; " + ((interrupted and interrupted()) or "nothing written"))
        return 130
    except ModuleNotFoundError as e:  # a plain `pip install .` has no torch
        top = (e.name or "").split(".")[0]
        if top not in TORCH_EXTRA:
            raise
        if top == e.name:
            say(f"error: this command needs {top}, which is not installed: "
                "pip install 'kqsvd[torch]'")
        else:  # installed, but not a release whose layout the package knows
            from importlib.metadata import version
            say(f"error: {top} {version(top)} has no module {e.name}; the package supports "
                f"the releases pyproject.toml names (scripts/hf-env.sh prepares them)")
        return 1
    except OSError as e:  # the system's, not the input's: disk full, a lost mount
        say(f"error: {e.strerror or e}" + (f": {e.filename}" if e.filename else ""))
        return 1
    finally:
        if main:
            signal.signal(signal.SIGTERM, before)
    return 0


def write_report(report, json_path, plot_path, plot, table, staged=None, force=False):
    """The end of a reporting command: the JSON report and its plot
    (plot(report) gives the figure's writer) written together with the
    files `staged` holds (files.Staged: fitted files the run measured), so
    that a failure leaves none, then the table printed and where they went.
    force: the command's --force (files.write_all)."""
    staged_paths = list(staged.tmps) if staged is not None else []
    write_all([(json_path, json_writer(report))] + ([(plot_path, plot(report))] if plot_path else []),
              staged, force)
    table(report)
    wrote = [json_path] + ([plot_path] if plot_path else []) + staged_paths
    print(f"wrote {', '.join(wrote[:-1])}{' and ' if len(wrote) > 1 else ''}{wrote[-1]} in "
          f"{report['elapsed_s']:.1f} s", file=sys.stderr)


def figure_writer(fig, axes, ylabels, xlabel, title):
    """Labels a matplotlib figure's axes and title; returns its writer,
    write(path) saving the PNG (for write_report)."""
    import matplotlib.pyplot as plt
    for ax, y in zip(axes, ylabels):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(y)
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()

    def write(tmp):
        fig.savefig(tmp, format="png", dpi=110)
        plt.close(fig)
    return write


def check_plot(path):
    """A --plot option checked before any work: a .png name, and
    matplotlib importable.  UsageError otherwise."""
    if not path:
        return
    if not path.lower().endswith(".png"):
        raise UsageError(f"--plot {path}: expected a .png file name")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError(f"--plot {path}: matplotlib cannot be imported (Debian: apt-get "
                         "install python3-matplotlib)") from None
