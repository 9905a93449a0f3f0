"""Crash-safe file writes: write a temporary file, fsync it, rename it over the target.

Why: a reader (or a process restarted after a crash) must see either the old file or
the complete new one, never a torn write. ``os.replace`` is atomic on POSIX when the
temporary file lives in the same directory; fsyncing the file *before* the rename and
the directory *after* it makes the new content survive a power loss, not just a kill.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

TMP_MARKER = ".tmp-"  # every temporary name contains this, so stray ones can be swept


def fsync_dir(directory: str | os.PathLike) -> None:
    """Flush a directory entry (a rename or unlink) to disk; a no-op where unsupported."""
    try:
        fd = os.open(os.fspath(directory), os.O_RDONLY)
    except OSError:  # e.g. Windows cannot open directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike) -> None:
    """fsync an already written file by path."""
    fd = os.open(os.fspath(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_path_for(path: str | os.PathLike) -> Path:
    """A fresh, unique temporary name next to ``path`` (same directory → same filesystem)."""
    path = Path(path)
    fd, name = tempfile.mkstemp(prefix=path.name + TMP_MARKER, dir=path.parent)
    os.close(fd)
    return Path(name)


def atomic_write_with(path: str | os.PathLike, writer: Callable[[Path], None]) -> None:
    """Atomically create/replace ``path`` with whatever ``writer(tmp_path)`` writes.

    ``writer`` receives a temporary path in the same directory and must write the full
    content there (it may open it itself, as ``faiss.write_index`` does). On any error the
    temporary file is removed and ``path`` is left untouched.
    """
    path = Path(path)
    tmp = temp_path_for(path)
    try:
        writer(tmp)
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Atomically write ``data`` to ``path``."""

    def _write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            f.write(data)

    atomic_write_with(path, _write)


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    """Atomically write ``obj`` as pretty UTF-8 JSON (human-inspectable manifests)."""
    text = json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    atomic_write_bytes(path, text.encode("utf-8"))
