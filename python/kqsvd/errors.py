"""The package's one exception type.

Every problem with the user's input (a file, a field, an option) raises
KqsvdError with a message that names the file and the field, so command-line
entry points print it on one line and exit non-zero."""


class KqsvdError(ValueError):
    """Bad input: a missing or malformed file, a shape mismatch, an
    impossible option.  str(e) is the whole message."""


class UsageError(KqsvdError):
    """An impossible option or argument (command lines exit 2 on it)."""

