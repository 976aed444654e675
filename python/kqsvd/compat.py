"""The transformers versions the package supports, checked where it first
touches a model, so that another version gives one clear error instead of
an AttributeError from inside transformers.  pyproject.toml declares the
same range (python/tests check that they agree)."""
from .errors import KqsvdError

# Inclusive floor, exclusive bound.  Tested at both ends: the floor
# (examples/requirements-floor.txt, py_floor) and the newest release
# (examples/requirements-hf.txt); the bound is the next major version,
# where transformers' public extension points may change.
TRANSFORMERS = ("4.56", "6")


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


def cache_kwarg(module):
    """The keyword by which a model (or its decoder) takes the KV cache:
    'cache' from transformers 5.24 on, 'past_key_values' before (5.24 still
    maps the old name, with a deprecation warning).  Read from the
    signature of module.forward, so that it follows the installed release
    rather than a version number."""
    import inspect
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def output_cache(out):
    """The cache a model's output carries (out.cache from 5.24 on,
    out.past_key_values before), or None; without the old name's
    deprecation warning."""
    keys = out.keys()
    for name in ("cache", "past_key_values"):
        if name in keys:
            return out[name]
    return None
