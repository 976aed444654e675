"""Where the C side is: the kqsvd executable and libkqsvd.so.

A wheel (`pip install .`, pyproject.toml) carries both in the package's
_native folder; a checkout uses its build/ (./test.sh, scripts/bootstrap.sh);
$KQSVD_BIN and $KQSVD_LIBRARY override either.  Both link the system's Open
MPI, parallel HDF5, OpenBLAS, LAPACKE and ScaLAPACK: when one is missing,
the loader's message becomes one line naming it and the Debian package
that has it.  `main` is the `kqsvd` console script of the wheel."""
import os
import re
import shutil
import sys

from .errors import KqsvdError

NATIVE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_native")

# soname prefix -> Debian 12's runtime package
PACKAGES = {"libmpi.so": "libopenmpi3", "libhdf5_openmpi.so": "libhdf5-openmpi-103-1",
            "libopenblas.so": "libopenblas0", "liblapacke.so": "liblapacke",
            "libscalapack-openmpi.so": "libscalapack-openmpi2.2", "liblapack.so": "liblapack3",
            "libgfortran.so": "libgfortran5", "libgomp.so": "libgomp1"}


def checkout_build():
    """The build/ folder of the repository checkout this package lives in
    (python/kqsvd), where ./test.sh puts the kqsvd executable and
    libkqsvd.so."""
    package = os.path.dirname(os.path.realpath(__file__))
    return os.path.join(os.path.dirname(os.path.dirname(package)), "build")


def binary():
    """The kqsvd executable: $KQSVD_BIN, else the wheel's, else the
    checkout's build/kqsvd, else kqsvd on PATH (not this package's own
    console script).  Raises KqsvdError when there is none."""
    env = os.environ.get("KQSVD_BIN")
    if env:
        return env
    for path in (os.path.join(NATIVE, "kqsvd"), os.path.join(checkout_build(), "kqsvd")):
        if os.access(path, os.X_OK):
            return os.path.normpath(path)
    found = shutil.which("kqsvd")
    if found and not _is_script(found):
        return found
    raise KqsvdError("the kqsvd executable was not found: install the package with its C part "
                     "(pip install . from the repository), build it (./test.sh or "
                     "scripts/bootstrap.sh makes build/kqsvd), or set KQSVD_BIN")


def library_candidates():
    """Paths (or names for the linker) where libkqsvd.so may be, in order."""
    env = os.environ.get("KQSVD_LIBRARY")
    if env:
        yield env
        return
    yield os.path.join(NATIVE, "libkqsvd.so")
    yield os.path.join(checkout_build(), "libkqsvd.so")
    exe = shutil.which("kqsvd")
    if exe and not _is_script(exe):
        prefix = os.path.dirname(os.path.dirname(os.path.realpath(exe)))
        for lib in ("lib", "lib64", os.path.join("lib", "x86_64-linux-gnu")):
            yield os.path.join(prefix, lib, "libkqsvd.so")
    import ctypes.util
    found = ctypes.util.find_library("kqsvd")
    if found:
        yield found


def load_library(required=True):
    """libkqsvd.so loaded (ctypes.CDLL) from the first candidate that
    loads.  Raises KqsvdError when a system library it links is missing,
    and when there is none (or returns None, when not required)."""
    import ctypes
    tried = []
    for path in library_candidates():
        if os.path.sep in path and not os.path.exists(path):
            tried.append(path)
            continue
        try:
            return ctypes.CDLL(path)
        except OSError as e:
            missing = missing_library(e)
            if missing:
                raise KqsvdError(missing) from None
            tried.append(f"{path} ({e})")
    if not required:
        return None
    raise KqsvdError("libkqsvd.so not found (tried " + ", ".join(tried or ["the linker's path"]) +
                     "); build it with scripts/bootstrap.sh or set KQSVD_LIBRARY")


def missing_library(error):
    """The loader's message (OSError) as one line naming the system library
    that is missing and its Debian package, or None when it is not that."""
    m = re.search(r"(lib[\w.+-]+\.so[\w.]*): cannot open shared object file", str(error))
    if not m:
        return None
    name = m.group(1)
    package = next((p for prefix, p in PACKAGES.items() if name.startswith(prefix)), None)
    hint = f" (Debian 12: apt-get install {package})" if package else ""
    return (f"kqsvd's C library needs {name}, which this system does not have{hint}; "
            "docs/guide/install.md lists what it links")


def tool():
    """The kqsvd executable, once it is known to start: the system
    libraries it links (those of libkqsvd.so) are there.  Raises
    KqsvdError in one line naming what is missing, so that a command finds
    out before it loads a model rather than when it first runs the tool."""
    exe = binary()
    load_library(required=False)
    return exe


def _is_script(path):
    """True for a Python console script (this package's `kqsvd`)."""
    try:
        with open(path, "rb") as f:
            return f.read(2) == b"#!"
    except OSError:
        return False


def main():
    """The `kqsvd` console script: runs the executable with the same
    arguments (the same process, so mpirun and signals see it).  A missing
    system library is one line, exit 1."""
    try:
        exe = tool()
    except KqsvdError as e:
        print(f"kqsvd: error: {e}", file=sys.stderr)
        return 1
    os.execv(exe, [exe] + sys.argv[1:])
