"""One way to hold a directory for one process: an exclusive, non-blocking ``flock`` on a lock file.

Why flock: the kernel releases it when its holder dies, even by SIGKILL, so a stale lock never
needs a human to clear it.  The index writer (``<index>/LOCK``) and the bulk build
(``<out>.build/LOCK``) both take theirs here.  Where flock does not exist (not POSIX) nothing is
locked: `try_lock` hands back a plain descriptor.
"""

from __future__ import annotations

import os

try:
    import fcntl
except ImportError:  # pragma: no cover - non-POSIX
    fcntl = None  # type: ignore[assignment]


def try_lock(path: str | os.PathLike) -> int | None:
    """A descriptor of `path` (created if missing) holding an exclusive flock, or None if another process holds it.

    Closing the descriptor releases the lock.  Raises FileNotFoundError when the directory is gone.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    if fcntl is None:  # pragma: no cover - non-POSIX
        return fd
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def lock_note(path: str | os.PathLike) -> str:
    """What the holder wrote into the lock file (e.g. its pid), or "" when there is nothing to read."""
    try:
        with open(path, "rb") as f:
            return f.read(64).decode("ascii", "replace").strip()
    except OSError:
        return ""
