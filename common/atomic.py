"""Atomic file writes: write a temp file beside the target, fsync it, rename it over the target, fsync the directory.

A crash at any point leaves either the old file or the new one, never a torn
mix; that is the guarantee every save in the project builds on.  ``os.replace``
is atomic on POSIX (and Windows) only within one file system, which is why the
temporary file lives in the target's own directory.  Fsyncing the file *before*
the rename and the directory *after* it makes the new content survive a power
loss, not just a killed process.

Every temporary name contains ``TMP_MARKER``, so a directory's owner (the index
store, for one) can sweep the ones an interrupted write left behind
(`sweep_temporaries`).  Whole directories are swapped by `atomic_replace_dir`,
which never leaves a moment without the target where Linux can exchange two
names at once, and whose leftovers elsewhere `recover_replaced_dir` undoes.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Collection, Iterator
from typing import IO, Any

TMP_MARKER = ".tmp-"  # in every temporary name, so stray ones can be found and swept
OLD_MARKER = ".old-"  # TARGET.old-PID: the directory `atomic_replace_dir`'s fallback moves aside
STAGING_SUFFIX = ".unfinished"  # OUT.unfinished: where a run that replaces an earlier one is built


def _file_mode() -> int:
    """The mode ``open()`` would give a new file under the current umask (``mkstemp`` gives 0600)."""
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


_FILE_MODE = _file_mode()  # read once: setting the umask to read it is not thread-safe


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Flush a directory entry so a rename inside it survives power loss (no-op where unsupported)."""
    try:
        fd = os.open(os.fspath(path), os.O_RDONLY)
    except OSError:  # e.g. Windows cannot open directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[str]:
    """Yield a temp path in the target's directory; on success fsync it and rename it over `path`.

    The caller (or a library it calls, as ``faiss.write_index`` or ``np.save``) writes the
    whole content to the yielded path.  On any error the temp file is removed and `path`
    is left as it was.  Parent directories are created.
    """
    target = os.path.abspath(os.fspath(path))
    directory = os.path.dirname(target)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(target)}{TMP_MARKER}", suffix=".tmp", dir=directory)
    os.close(fd)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, _FILE_MODE)
        os.replace(tmp, target)
        fsync_dir(directory)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike[str], mode: str = "w", encoding: str = "utf-8") -> Iterator[IO]:
    """Open a temp file for writing (``"w"`` or ``"wb"``); on success it replaces ``path``.

    Text mode writes ``\\n`` line endings on every platform.

    Example:
        >>> import tempfile, pathlib
        >>> target = pathlib.Path(tempfile.mkdtemp()) / "x.txt"
        >>> with atomic_open(target) as f:
        ...     _ = f.write("hello\\n")
        >>> target.read_text()
        'hello\\n'
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open supports modes 'w' and 'wb', got {mode!r}")
    with atomic_path(path) as tmp:
        if mode == "wb":
            handle: IO = open(tmp, "wb")
        else:
            handle = open(tmp, "w", encoding=encoding, newline="\n")
        with handle:
            yield handle


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` atomically."""
    with atomic_open(path, "wb") as f:
        f.write(data)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` (UTF-8, ``\\n`` line endings kept as given) to ``path`` atomically."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike[str], obj: Any) -> None:
    """Write ``obj`` as pretty, key-sorted UTF-8 JSON (human-inspectable manifests), atomically."""
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def atomic_replace_dir(build_dir: str, target: str) -> None:
    """Swap a fully written directory into place, so that `target` always names a complete directory.

    Where the kernel and file system can (Linux ``renameat2(RENAME_EXCHANGE)``) the two names are exchanged
    in one step and the old content, now under `build_dir`'s temporary name, is removed. Elsewhere the old
    directory is renamed to ``TARGET.old-PID`` first; a kill between that rename and the next leaves no
    `target`, which `recover_replaced_dir` (called here, and by the readers of such directories) undoes.
    A reader never finds a half-written `target`.

    Both paths are made absolute first: the kernel refuses to rename ``.`` (EBUSY), so ``--out .`` was a
    traceback, and the fallback's ``TARGET.old-PID`` of ``.`` named an entry inside it.
    """
    build_dir, target = os.path.abspath(build_dir), os.path.abspath(target)
    fsync_dir(build_dir)
    recover_replaced_dir(target)
    parent = os.path.dirname(os.path.abspath(target))
    if os.path.lexists(target) and _exchange(build_dir, target):
        fsync_dir(parent)
        _remove(build_dir)  # the old content; a kill before this leaves a temporary name that is swept
        return
    old = None
    if os.path.lexists(target):
        old = f"{target}{OLD_MARKER}{os.getpid()}"
        os.replace(target, old)
    os.replace(build_dir, target)
    fsync_dir(parent)
    if old:
        _remove(old)


def recover_replaced_dir(target: str) -> None:
    """Undo what a kill inside `atomic_replace_dir`'s fallback left: restore ``TARGET.old-PID`` when `target`
    is missing, remove such leftovers when it is there.

    Why: between its two renames `target` does not exist, so a kill there lost the last complete directory
    (a resume found no training state, a search no ``best/``). Best effort: a read-only file system is left
    as it is, and the caller finds what it finds.
    """
    parent = os.path.dirname(os.path.abspath(target))
    prefix = os.path.basename(os.path.abspath(target)) + OLD_MARKER
    try:
        leftovers = sorted((os.path.join(parent, n) for n in os.listdir(parent)
                            if n.startswith(prefix) and n[len(prefix):].isdigit()), key=os.path.getmtime)
        if leftovers and not os.path.lexists(target):
            os.replace(leftovers.pop(), target)  # the newest: the last one that was complete
            fsync_dir(parent)
        for path in leftovers:
            _remove(path)
    except OSError:
        pass


def sweep_temporaries(directory: str, of: str | None = None) -> list[str]:
    """Remove what interrupted atomic writes left in `directory`: entries named ``.NAME.tmp-*`` (files and
    directories); with `of`, only those of the entry named `of` (``.OF.tmp-*``), for a directory that is not
    the caller's own (the parent of a run's ``--out``). Returns the names removed.

    Why: a kill during a save leaves its temporary copy (a checkpoint's full weights, a half-drawn PNG)
    that nothing else removes. Only this module's temporary names are touched (a leading dot and
    ``TMP_MARKER``), never a user's file; the directory's owner calls this when it starts writing there
    again, when no other save of its own is under way.
    """
    prefix = "." if of is None else f".{of}{TMP_MARKER}"
    try:
        names = [n for n in os.listdir(directory) if n.startswith(prefix) and TMP_MARKER in n]
    except OSError:
        return []
    for name in names:
        _remove(os.path.join(directory, name))
    return names


def staging_dir(out_dir: str) -> str:
    """Where a run that replaces the earlier run in `out_dir` is built until it is complete (then swapped in
    with `atomic_replace_dir`), so that a stopped run never costs the earlier one.

    A name that is ``.`` or ``..`` is made absolute first: ``..unfinished`` was an entry inside the current
    directory, not beside it, and could not be swapped in."""
    base = out_dir.rstrip(os.sep)
    if os.path.basename(base) in ("", ".", ".."):
        base = os.path.abspath(out_dir)
    return base + STAGING_SUFFIX


def commit_staged_run(staged: str, target: str, log_name: str, run_names: Collection[str]) -> None:
    """Swap a complete replacing run, built in `staged` (`staging_dir`), into `target`; the earlier run's log
    (`log_name`) is kept in it as ``<log_name>.previous``. The earlier run goes only now, and not while `target`
    holds files no run writes (`refuse_swap_over_theirs`)."""
    refuse_swap_over_theirs(staged, target, run_names)
    earlier_log = os.path.join(target, log_name)
    if os.path.isfile(earlier_log):
        shutil.copyfile(earlier_log, os.path.join(staged, log_name + ".previous"))
    atomic_replace_dir(staged, target)


def refuse_swap_over_theirs(staged: str, target: str, run_names: Collection[str]) -> None:
    """Refuse to swap the run built in `staged` into `target` while `target` holds entries that no run writes
    (`foreign_entries` against `run_names`): the run stays in `staged`, and the message names the files.

    Why: --out was checked when a replacing run started, and the swap hours later (or after a --resume)
    deleted a file the user had put there meanwhile. Called right before each swap, and when a stopped
    replacing run is resumed (its swap is still to come)."""
    from twotower.common.paths import a_few, foreign_entries

    theirs = foreign_entries(target, run_names) if os.path.isdir(target) else []
    if theirs:
        raise ValueError(f"{target}: files of yours ({a_few(theirs)}) beside the earlier run, which swapping in "
                         f"the run built in {staged} would remove; nothing was swapped. Once that run is complete "
                         f"it is kept in {staged}: move your files out of {target} and run the same command with "
                         f"--resume to swap it in, or use it from {staged}")


def left_by_a_stopped_run(directory: str, marker: str) -> bool:
    """Whether a `staging_dir` is what a stopped replacing run left (nothing, or its `marker` file: a log, a
    run record), which the next such run may start again from nothing; anything else there is the user's."""
    try:
        names = os.listdir(directory)
    except OSError:
        return False
    return not names or marker in names


def _remove(path: str) -> None:
    """Remove a file or a directory tree, whichever `path` is; what cannot be removed stays."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.unlink(path)


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100
_NO_EXCHANGE = {errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EPERM}


def _renameat2() -> Callable[..., int] | None:
    """libc's ``renameat2`` (glibc 2.28+, Linux), or None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_RENAMEAT2 = _renameat2()


def _exchange(a: str, b: str) -> bool:
    """Swap the names `a` and `b` atomically; False where the system or file system cannot (nothing moved)."""
    if _RENAMEAT2 is None:
        return False
    if _RENAMEAT2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in _NO_EXCHANGE:
        return False
    raise OSError(err, os.strerror(err), a, None, b)
