"""The transformers versions the package supports, checked where it first
touches a model, so that another version gives one clear error instead of
an AttributeError from inside transformers.  pyproject.toml declares the
same range (python/tests check that they agree).  What the package reads
or writes of transformers beyond its public calls is here too: the one
place to look when a release changes it."""
import dataclasses
import inspect
import weakref

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
        import transformers  # not at the top: the package loads without it (formats, calibration)
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
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def no_init_weights():
    """transformers' context that skips the random initialisation of a model
    whose every weight is then overwritten (a GGUF file's): in
    transformers.initialization from 5.0, in modeling_utils before."""
    try:  # transformers here, not at the top: the package loads without it
        from transformers.initialization import no_init_weights as skip
    except ImportError:  # 4.56 .. 4.57
        from transformers.modeling_utils import no_init_weights as skip
    return skip()


_MISSING = object()


def attention_implementation(config):
    """The attention implementation a config selects ('eager', 'sdpa', a
    registered name), or None where none is set.  transformers keeps it
    as config._attn_implementation, which every attention module and mask
    builder reads at each call: the switch of its attention interface."""
    return config._attn_implementation


def switch_attention(config, name):
    """Selects the registered attention function `name` for config and its
    sub-configs; returns what restore_attention needs to put back exactly
    what was set (or not set) before."""
    saved = [(c, c.__dict__.get("_attn_implementation_internal", _MISSING))
             for c in _configs(config)]
    config._attn_implementation = name  # the setter reaches the sub-configs too
    return saved


def restore_attention(saved):
    """Undoes switch_attention."""
    for c, v in saved:
        if v is _MISSING:
            c.__dict__.pop("_attn_implementation_internal", None)
        else:
            c.__dict__["_attn_implementation_internal"] = v


def _configs(cfg, seen=None):
    seen = [] if seen is None else seen
    if cfg is None or any(c is cfg for c in seen):
        return seen
    seen.append(cfg)
    for key in getattr(cfg, "sub_configs", None) or {}:
        _configs(getattr(cfg, key, None), seen)
    return seen


def output_cache(out):
    """The cache a model's output carries (out.cache from 5.24 on,
    out.past_key_values before), or None; without the old name's
    deprecation warning."""
    keys = out.keys()
    for name in ("cache", "past_key_values"):
        if name in keys:
            return out[name]
    return None


@dataclasses.dataclass(frozen=True)
class Places:
    """Where a cache layer's new tokens stand, as transformers hands them to
    its update(): up to 5.23 the attention passes cache_kwargs (the cos and
    sin that rotated the keys, and cache_position), 5.24 its own keyword
    arguments instead (kwargs=, with the tokens' position_ids).  Each is
    None where it was not handed."""
    cos: object = None
    sin: object = None
    position_ids: object = None
    cache_position: object = None

    def positions(self):
        """The new tokens' positions [1 or b, T], int64: position_ids, else
        cache_position; None where neither was handed."""
        for p in (self.position_ids, self.cache_position):
            if p is not None:
                return p.view(-1, p.shape[-1]).long()
        return None


def update_places(cache_kwargs, kwargs):
    """The Places a cache layer's update(keys, values, cache_kwargs,
    kwargs=) was handed: the one reading of what each release passes."""
    given, extra = cache_kwargs or {}, kwargs or {}
    rotated = given if given.get("cos") is not None else extra
    return Places(rotated.get("cos"), rotated.get("sin"),
                  extra.get("position_ids", given.get("position_ids")),
                  given.get("cache_position"))


# attention module -> {name of a registered attention function: what that
# function reads for the module (a compressed.Site, a capture's record)}.
# transformers calls an attention function with the module alone, so this
# is the one place a function finds its own state for a module; weak keys,
# so nothing is attached to the model and nothing outlives it.
_ATTACHED = weakref.WeakKeyDictionary()


def attach(module, name, what):
    """The attention function `name` reads `what` for `module`."""
    _ATTACHED.setdefault(module, {})[name] = what


def detach(module, name, what):
    """`what` is no longer attached to module under `name` (another's stays)."""
    held = _ATTACHED.get(module)
    if held is not None and held.get(name) is what:
        del held[name]
        if not held:
            del _ATTACHED[module]


def attached(module, name):
    """What is attached to module under `name`, or None."""
    held = _ATTACHED.get(module)
    return None if held is None else held.get(name)
