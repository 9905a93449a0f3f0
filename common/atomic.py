"""Atomic file writes: write a temp file beside the target, fsync, rename.

A crash at any point leaves either the old file or the new one, never a torn
mix; that is the guarantee every save in the project builds on.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator


def fsync_dir(path: str) -> None:
    """Flush a directory entry so a rename inside it survives power loss (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str) -> Iterator[str]:
    """Yield a temp path in the target's directory; on success fsync it and rename over `path`."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    os.close(fd)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(directory)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def atomic_write_bytes(path: str, data: bytes) -> None:
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(data)


def atomic_write_text(path: str, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


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
