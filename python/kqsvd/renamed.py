"""Public names renamed or moved in 0.5's redesign, kept working for one
release with a DeprecationWarning that names the new one (CHANGELOG.md
lists them):

    Calibrator(group=...)                   q_per_kv=...
    Calibrator.shape.group, Result.shape.group   .q_per_kv
    kqsvd.calibration.binding.Calibrator,   kqsvd.calibration.calibrator
        check_policy, Result                (result.Result for Result)
    kqsvd.formats.projections.save_ranks    kqsvd.formats.saving (kqsvd.save_ranks)
    kqsvd.attention.LayerProjection.g       .q_per_kv

One helper per kind of rename: a keyword (keywords), an attribute
(attribute), a module-level name (moved)."""
import functools
import importlib
import warnings

from .errors import UsageError


def _warn(old, new):
    # stacklevel 3: past this function and the shim, at the caller's line
    warnings.warn(f"{old} is deprecated: use {new} (the old name goes in the next release)",
                  DeprecationWarning, stacklevel=3)


def keywords(**renamed):
    """A decorator: each keyword given by its old name (old=new in
    `renamed`) is passed on as the new one, with a DeprecationWarning;
    both names at once is a UsageError."""
    def wrap(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            for old, new in renamed.items():
                if old not in kwargs:
                    continue
                name = fn.__qualname__.removesuffix(".__init__")
                if new in kwargs:
                    raise UsageError(f"{name}(): give {new} alone, not also {old} (its old name)")
                _warn(f"{name}({old}=...)", f"{new}=...")
                kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)
        return call
    return wrap


def attribute(new, old):
    """A property `old` (as 'Class.old', for the warning) reading and
    writing the attribute `new`, with a DeprecationWarning."""
    def get(self):
        _warn(old, new)
        return getattr(self, new)

    def put(self, value):
        _warn(old, new)
        setattr(self, new, value)
    return property(get, put, doc=f"Deprecated: {new}.")


def moved(module, names):
    """A module's __getattr__ for the names that left it: {name: 'package
    .module'} where each now lives, imported on first use (so that the new
    module may import the old one) with a DeprecationWarning."""
    def __getattr__(name):
        if name not in names:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        _warn(f"{module}.{name}", f"{names[name]}.{name}")
        return getattr(importlib.import_module(names[name]), name)
    return __getattr__
