"""A path handed to a public function, checked once: one rule for the index and the pipeline.

Why: ``Path(None)`` and ``os.fspath(None)`` fail with "expected str, bytes or os.PathLike object, not
NoneType", which names no argument; `IndexStore.open` and `SearchPipeline.load` (which may not import each
other) refuse anything but a path the same way, naming the argument.
"""

from __future__ import annotations

import os
from typing import Any


def path_argument(value: Any, name: str = "directory") -> str:
    """`value` as a path string; anything but a ``str`` or ``os.PathLike`` is refused, naming `name`.

    Example:
        >>> path_argument(None)
        Traceback (most recent call last):
        ...
        TypeError: directory must be a path (str or os.PathLike), got NoneType
    """
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} must be a path (str or os.PathLike), got {type(value).__name__}")
    return os.fspath(value)


def holds_working_directory(path: str | os.PathLike) -> str | None:
    """"the current directory" or "one above the current directory" when `path` is (or holds) the process's
    working directory, else None.

    Why: a result written by swapping its directory in whole (an index, a report) cannot be swapped in for
    the working directory (the rename fails with "Device or resource busy"), and could not be seen from the
    shell left in the removed one if it could; callers refuse such a path up front, naming it.
    """
    here = os.path.realpath(path)
    cwd = os.path.realpath(os.getcwd())
    if cwd == here:
        return "the current directory"
    if cwd.startswith(here.rstrip(os.sep) + os.sep):
        return "one above the current directory"
    return None
