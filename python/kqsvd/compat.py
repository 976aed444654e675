"""The transformers versions the package supports, checked where it first
touches a model, so that another version gives one clear error instead of
an AttributeError from inside transformers.  pyproject.toml declares the
same range (python/tests check that they agree)."""
from .errors import KqsvdError

# Inclusive floor, exclusive bound: what scripts/hf-env.sh installs is inside.
TRANSFORMERS = ("4.56", "5.3")


def _key(version):
    """A sortable key of a version string: its leading numbers (4.44.2,
    4.57.0.dev0 and 5.2.0rc1 compare as 4.44.2, 4.57.0 and 5.2.0)."""
    out = []
    for part in version.split("."):
        digits = ""
        for ch in part:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        out.append(int(digits))
        if len(digits) != len(part):
            break
    return tuple(out)


def check_transformers(version=None):
    """Raises KqsvdError naming the installed and the supported versions
    when transformers (or `version`, for tests) is outside the range.
    Not collective."""
    if version is None:
        import transformers
        version = transformers.__version__
    low, high = TRANSFORMERS
    if not _key(low) <= _key(version) < _key(high):
        raise KqsvdError(f"transformers {version} is installed, but kqsvd supports "
                         f"transformers>={low},<{high}; scripts/hf-env.sh prepares a "
                         "matching environment")
