"""Exceptions of the indexing package."""

from __future__ import annotations

import os


class IndexFormatError(ValueError):
    """A file on disk is not a (readable, supported) twotower index file.

    Raised for a missing or corrupt manifest, a future format version, a vector file
    without our trailer, or files that disagree with each other. The message always
    names the offending file; ``path`` holds it too.
    """

    def __init__(self, path: str | os.PathLike, message: str) -> None:
        self.path = os.fspath(path)
        super().__init__(f"{self.path}: {message}")


class IndexDiskFullError(OSError):
    """The disk filled up while changing an index; nothing was committed (``errno`` is ``ENOSPC``).

    The message names the index directory and says that it is unchanged at its last commit.
    """
