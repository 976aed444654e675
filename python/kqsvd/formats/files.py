"""Outputs, the same way in every command: checked before any work starts,
written under a unique temporary name in their own folder and renamed when
complete, so that an error or an interruption leaves nothing behind and no
output ever replaces an input of the same run."""
import errno
import os
import re
import stat
import tempfile

from ..errors import KqsvdError, UsageError


def _identity(path):
    """(device, inode) of what `path` names, symbolic links followed; None
    where nothing is there (or it cannot be looked at)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


# What an output's name grows by while it is written: the staged name
# (.NAME.XXXXXXXX.tmp, mkstemp's) and, when the C library writes it, its
# own suffix (.tmp-PID-N, KQSVD_TMP_SUFFIX_MAX in src/core/kqsvd_util.h).
TMP_GROWTH = 14 + 20


def _files_in(folder, most=10000):
    """The files below folder (links followed), at most `most` of them."""
    out = []
    for root, _dirs, files in os.walk(folder, followlinks=True):
        out += [os.path.join(root, f) for f in files]
        if len(out) >= most:
            break
    return out[:most]


def check_outputs(outputs, inputs=(), force=False):
    """Checks every output of a run before the run does any work.

    outputs, inputs: (label, path) pairs, the label being how the user
    named the path (an option such as "--json", or "the plot"); paths that
    are None are skipped.  An output is refused (UsageError, one line naming
    it) when it is a folder, a device, a FIFO or a socket; when it is any
    input of the run or a file inside an input folder, compared by device
    and inode (so another path, a symbolic or a hard link to an input is
    caught); when two outputs are one file; when it exists and `force` is
    false; and when its folder does not exist or a file cannot be created
    there (see _probe).
    Inputs that do not exist are left to the readers to report.  Not
    collective: under MPI, rank 0 calls it and shares the verdict."""
    seen_in = {}
    for label, path in inputs:
        if path is None:
            continue
        # A folder (a model's) is its files: replacing one of them replaces an input.
        for p in [path] + (_files_in(path) if os.path.isdir(path) else []):
            ident = _identity(p)
            if ident is not None:
                seen_in.setdefault(ident, (label, p))
    seen_out = {}
    for label, path in outputs:
        if path is None:
            continue
        name = f"{label} {path}"
        if not path or path.endswith(os.sep):
            raise UsageError(f"{label} '{path}': give a file name")
        base = len(os.fsencode(os.path.basename(path)))
        most = os.pathconf(os.path.dirname(os.path.abspath(path)) or ".", "PC_NAME_MAX") \
            if os.path.isdir(os.path.dirname(os.path.abspath(path))) else 255
        if base + TMP_GROWTH > most:  # found now, not by the write after the run
            raise UsageError(f"{name}: the file name is {base} bytes long; at most "
                             f"{most - TMP_GROWTH} fit with the temporary names it is written "
                             "under")
        try:
            st = os.stat(path)
        except FileNotFoundError:
            st = None
        except OSError as e:
            raise UsageError(f"{name}: {e.strerror}") from None
        # A link to nothing is a name taken all the same: the final rename,
        # which never replaces a name without force, would refuse it after
        # all the work.
        if st is None and os.path.islink(path) and not force:
            raise UsageError(f"{name} already exists (a symbolic link to "
                             f"{os.readlink(path)}, which does not exist); give --force to "
                             "replace it")
        if st is not None:
            if stat.S_ISDIR(st.st_mode):
                raise UsageError(f"{name} is a folder; give a file name")
            if not stat.S_ISREG(st.st_mode):
                raise UsageError(f"{name} is not a regular file (a device, FIFO or socket); "
                                 "give a file name")
            ident = (st.st_dev, st.st_ino)
            if ident in seen_in:
                what, where = seen_in[ident]
                same = "" if os.path.abspath(where) == os.path.abspath(path) else f" ({where})"
                raise UsageError(f"{name} is {what}{same}, an input of this run: the output "
                                 "would replace it")
            if not force:
                raise UsageError(f"{name} already exists; give --force to replace it")
        key = os.path.realpath(path)
        if key in seen_out:
            raise UsageError(f"{name} is also {seen_out[key]}: give each output its own file")
        seen_out[key] = name
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise UsageError(f"{name}: the folder {folder} does not exist")
        _probe(name, folder)


def node_kind(path):
    """What path names, in words ("a FIFO", "a character device", ...),
    links followed; None where nothing is there."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    for test, what in ((stat.S_ISREG, "a file"), (stat.S_ISDIR, "a folder"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return what
    return "not a file"


def check_input_file(label, path):
    """An input read whole (a text): a regular file, so that a device such
    as /dev/zero is not read forever.  Raises KqsvdError naming it."""
    if not os.path.exists(path):
        raise KqsvdError(f"{label} {path}: no such file")
    if not os.path.isfile(path):
        raise KqsvdError(f"{label} {path}: not a regular file")


def check_folder_output(label, path, inputs=()):
    """A folder the run fills (an export, checkpoints): a folder or nothing
    yet (the run makes it and any folders above it, as mkdir -p), where
    files can be created, and holding no input of the run (the run removes
    its own temporary files there).  Raises UsageError naming it."""
    name = f"{label} {path}"
    where = os.path.abspath(path)
    while not os.path.lexists(where):  # the nearest part that exists
        where = os.path.dirname(where)
    if not os.path.isdir(where):
        raise UsageError(f"{name}: {where} is {node_kind(where) or 'a dangling link'}, not a "
                         "folder")
    _probe(name, where)
    inside = os.path.realpath(path) + os.sep
    for what, p in inputs:
        if p is not None and (os.path.realpath(p) + os.sep).startswith(inside):
            raise UsageError(f"{what} {p} lies inside {name}, which this run writes")


def missing_top(path):
    """The outermost folder of `path` that does not exist (the first that
    os.makedirs(path) makes), None when path exists.  With rmdir_made:
    a run that fails before it wrote anything leaves no folder either."""
    top, p = None, os.path.abspath(path)
    while not os.path.lexists(p):
        top, p = p, os.path.dirname(p)
    return top


def rmdir_made(path, top):
    """Removes path and the folders above it up to `top` (missing_top's,
    nothing when None) as long as they are empty."""
    p = os.path.abspath(path)
    while top is not None:
        try:
            os.rmdir(p)
        except OSError:
            return
        if p == top:
            return
        p = os.path.dirname(p)


def said_of(e, path, tmp=None):
    """A library's error about writing `path` under the temporary name
    `tmp`, as one line naming `path` once and never the temporary name."""
    msg = str(e).replace(tmp, path) if tmp else str(e)
    p = re.escape(path)
    msg = re.sub(rf"^(?:writing |saving )?{p}: (?:{p}: )?", "", msg)
    return type(e)(f"{path}: {msg}")


def _probe(name, folder):
    """Whether a new file can be made in folder: tried, not guessed from
    permission bits (root passes those, and /proc refuses anyway); but a
    folder that nobody may write to (mode a-w) is taken as read-only for
    root too, as the user meant it."""
    mode = stat.S_IMODE(os.stat(folder).st_mode)
    if not mode & 0o222:
        raise UsageError(f"{name}: the folder {folder} is read-only (mode {mode:04o})")
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".kqsvd.", suffix=".probe")
    except OSError as e:
        raise UsageError(f"{name}: cannot create a file in {folder}: {e.strerror or e}") from None
    os.close(fd)
    os.remove(probe)


def cannot_write(path, e, tmp=None):
    """KqsvdError for the OSError e writing `path` (under `tmp`): one line
    naming the output, a full disk as such."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return KqsvdError(f"{path}: no space left on device")
    why = e.strerror or str(e)
    return KqsvdError(f"{path}: cannot be written: {why.replace(tmp, path) if tmp else why}")


def _umask_mode():
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def _new_tmp(path):
    """A new, empty file under a unique temporary name in path's folder
    (.NAME.XXXXXXXX.tmp); KqsvdError naming `path` when none can be made."""
    try:
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)),
                                   prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    except OSError as e:
        raise cannot_write(path, e) from None
    os.close(fd)
    return tmp


class Staged:
    """Outputs a run writes before its end because it reads them back (a
    fitted projections file that is then measured), each under a unique
    temporary name in its own folder; write_all renames them with the
    outputs they belong with (the report), and leaving the `with` block
    without that (an error, Ctrl-C, SIGTERM) removes them, so that a run
    writes all its outputs or none."""

    def __init__(self):
        self.tmps = {}  # the output's path -> its temporary name

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for tmp in self.tmps.values():
            if os.path.lexists(tmp):
                os.remove(tmp)
        self.tmps.clear()
        return False

    def tmp(self, path):
        """The temporary name to write the output `path` under (an empty
        file is there already: writers must be allowed to replace it)."""
        if path not in self.tmps:
            self.tmps[path] = _new_tmp(path)
        return self.tmps[path]


def check_replaceable(path):
    """KqsvdError unless a rename may put a file at path: nothing there, a
    regular file, or a link (replaced itself, never followed).  Checked
    again at the end of a run, which may have been long: a name that became
    a device or a FIFO meanwhile is left as it is."""
    if os.path.lexists(path) and not os.path.islink(path) and not os.path.isfile(path):
        raise KqsvdError(f"{path}: is no longer a regular file; nothing written")


def publish(tmp, path, force=False):
    """Renames the finished temporary file tmp to path (check_replaceable
    first); KqsvdError naming path.  Without force a file at path is never
    replaced: the outputs were checked before the run, so one there now
    appeared while the run worked (another run of the same command, say),
    and the rename refuses it rather than lose either.  The caller removes
    tmp on failure."""
    check_replaceable(path)
    try:
        if force:
            os.replace(tmp, path)
        else:
            _rename_new(tmp, path)
    except FileExistsError:
        raise _appeared(path) from None
    except OSError as e:
        raise cannot_write(path, e) from None


def _appeared(path):
    return KqsvdError(f"{path} appeared while the run worked; nothing written (give --force to "
                      "replace it)")


def _rename_new(tmp, path):
    """rename(tmp, path) that fails (FileExistsError) where path exists, in
    one step: a hard link made exclusively, then the temporary name
    removed.  Where the file system has no hard links, a rename after a
    look, which only a file made in between the two can slip past."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK):
            raise
        if os.path.lexists(path):
            raise FileExistsError(errno.EEXIST, "File exists", path) from None
        os.rename(tmp, path)
        return
    os.remove(tmp)


def json_writer(obj):
    """The write(tmp) of write_atomic and write_all for `obj` as JSON,
    indented by one space as every report of the project is."""
    import json

    def write(tmp):
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=1)
    return write


def write_atomic(path, write, force=False):
    """Calls write(tmp) for a new temporary file in path's folder, gives it
    the mode a newly created file gets (0666 less the umask), then renames
    it to path (replacing a file there only with force: publish).  The
    temporary file is removed if anything fails.  A failure to write is a
    KqsvdError naming `path` (never the temporary name); KqsvdError from
    write() passes through as it is."""
    write_all([(path, write)], force=force)


def write_all(outputs, staged=None, force=False):
    """write_atomic for several outputs [(path, write)] that belong
    together (a report and its plot): each is written under its temporary
    name first, and only when all are complete are they renamed, so that a
    failure in any leaves none of them.  staged: a Staged whose files,
    written already, are renamed with them.  force: replace files that
    are there (the command's --force); without it, one that appeared while
    the run worked stops the publishing before any rename (publish)."""
    tmps = []
    try:
        for path, write in outputs:
            tmp = _new_tmp(path)
            tmps.append(tmp)
            try:
                write(tmp)
                os.chmod(tmp, _umask_mode())
            except OSError as e:
                raise cannot_write(path, e, tmp) from None
        done = list(zip([p for p, _ in outputs], tmps))
        if staged is not None:
            for _, tmp in staged.tmps.items():
                os.chmod(tmp, _umask_mode())
            done += list(staged.tmps.items())
        for path, _ in done:
            check_replaceable(path)
            if not force and os.path.lexists(path):  # before any is renamed: all or none
                raise _appeared(path)
        for path, tmp in done:
            publish(tmp, path, force)
        if staged is not None:
            staged.tmps.clear()
    finally:
        for tmp in tmps:
            if os.path.lexists(tmp):
                os.remove(tmp)
