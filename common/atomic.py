"""Atomic file writes: write a temp file beside the target, fsync it, rename it over the target, fsync the directory.

A crash at any point leaves either the old file or the new one, never a torn
mix; that is the guarantee every save in the project builds on.  ``os.replace``
is atomic on POSIX (and Windows) only within one file system, which is why the
temporary file lives in the target's own directory.  Fsyncing the file *before*
the rename and the directory *after* it makes the new content survive a power
loss, not just a killed process.

Every temporary name contains ``TMP_MARKER``, so a directory's owner (the index
store, for one) can sweep the ones an interrupted write left behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import IO, Any

TMP_MARKER = ".tmp-"  # in every temporary name, so stray ones can be found and swept


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
    """Swap a fully written directory into place: the old one is renamed away, then removed.

    Between the two renames a reader may find no `target`; it never finds a half-written one.
    """
    fsync_dir(build_dir)
    old = None
    if os.path.exists(target):
        old = f"{target}.old-{os.getpid()}"
        os.replace(target, old)
    os.replace(build_dir, target)
    fsync_dir(os.path.dirname(os.path.abspath(target)))
    if old:
        shutil.rmtree(old, ignore_errors=True)
