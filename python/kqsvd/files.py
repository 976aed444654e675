"""Outputs written under a temporary name and renamed when complete, so an
error or an interruption leaves no partial file."""
import os


def write_atomic(path, write):
    """Calls write(tmp) for tmp = path + ".tmp", then renames tmp to path;
    the temporary file is removed if anything fails."""
    tmp = path + ".tmp"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
