"""One way to hold a directory for one process: an exclusive, non-blocking ``flock`` on a lock file.

Why flock: the kernel releases it when its holder dies, even by SIGKILL, so a stale lock never
needs a human to clear it.  The index writer (``<index>/LOCK``) and the bulk build
(``<out>.build/LOCK``) both take theirs here.  Where flock does not exist (not POSIX) nothing is
locked: `try_lock` hands back a plain descriptor.
"""

from __future__ import annotations

import math
import os

try:
    import fcntl
except ImportError:  # pragma: no cover - non-POSIX
    fcntl = None  # type: ignore[assignment]

# How long a write waits for another writer's lock (`twotower serve`, `twotower index add` and `delete`).  Here, not
# in the index store, so that the command line can show it in --help without loading the store (numpy, FAISS).
LOCK_WAIT_S = 10.0


def check_lock_wait(seconds: float, name: str = "lock_wait_s") -> float:
    """`seconds` when it is a finite number >= 0; else ValueError naming the setting (`name`, in the caller's words).

    Why: NaN compared false with every deadline, so a wait of NaN seconds never ended; inf never ended either.
    """
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not (
            math.isfinite(seconds) and seconds >= 0):
        raise ValueError(f"{name} must be a number of seconds >= 0, got {seconds}")
    return float(seconds)


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
