"""The package's one exception type.

Every problem with the user's input (a file, a field, an option) raises
KqsvdError with a message that names the file and the field, so command-line
entry points print it on one line and exit non-zero."""


class KqsvdError(ValueError):
    """Bad input: a missing or malformed file, a shape mismatch, an
    impossible option.

    A ValueError, so callers that catch ValueError catch it too.  str(e)
    is the whole message: it names the file and the field (or the
    argument) at fault, on one line, so command-line entry points print it
    as it is and exit non-zero.

    Examples
    --------
    >>> try:
    ...     kqsvd.load_projections("missing.h5")
    ... except kqsvd.KqsvdError as e:
    ...     print(e)
    missing.h5: no such file
    """


class UsageError(KqsvdError):
    """An impossible option or argument (command lines exit 2 on it).

    A KqsvdError, raised where the caller, not a file, is at fault: an
    unknown method, a rank outside 1..head_dim, an argument of the wrong
    type, an output path that is refused.

    Examples
    --------
    >>> kqsvd.load_projections("proj.h5", method="svd")
    Traceback (most recent call last):
    ...
    kqsvd.errors.UsageError: unknown method 'svd' (expected one of kqsvd, ksvd, eigen)
    """
