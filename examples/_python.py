"""Shared by the example scripts: the python3 first on PATH (pyenv, a venv)
may lack Debian's python3-numpy, python3-h5py and python3-matplotlib, which
live under /usr/bin/python3.  scripts/env.sh picks such a Python as
$KQSVD_PYTHON; an example that cannot import what it needs runs itself
again there, once, before it gives up."""
import os
import shutil
import sys


def rerun_elsewhere(script):
    """Replaces this process with `script` under $KQSVD_PYTHON or
    /usr/bin/python3, when one of them is another Python; returns when
    there is none or this already is the second try."""
    if os.environ.get("KQSVD_EXAMPLES_REEXEC"):
        return
    for cand in (os.environ.get("KQSVD_PYTHON"), "/usr/bin/python3"):
        path = cand and shutil.which(cand)
        if path and os.path.abspath(path) != sys.executable:
            os.environ["KQSVD_EXAMPLES_REEXEC"] = "1"
            os.execv(path, [path, os.path.abspath(script)] + sys.argv[1:])
