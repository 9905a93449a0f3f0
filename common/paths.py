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
