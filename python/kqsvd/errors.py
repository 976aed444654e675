"""The package's one exception type.

Every problem with the user's input (a file, a field, an option) raises
KqsvdError with a message that names the file and the field, so command-line
entry points print it on one line and exit non-zero."""


class KqsvdError(ValueError):
    """Bad input: a missing or malformed file, a shape mismatch, an
    impossible option.  str(e) is the whole message."""


class UsageError(KqsvdError):
    """An impossible option or argument (command lines exit 2 on it)."""


def run_command(prog, body):
    """Runs body() for a command line: bad input (KqsvdError) becomes one
    line 'PROG: error: ...' on stderr and exit status 2 for options, 1 for
    files; Ctrl-C exits 130.  Returns the exit status."""
    import sys
    try:
        body()
    except UsageError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except KqsvdError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\n{prog}: interrupted; nothing written", file=sys.stderr)
        return 130
    return 0
