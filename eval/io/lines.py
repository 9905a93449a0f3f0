"""Numbered line reading shared by the text-format readers, so every error can name ``path:line``."""

from __future__ import annotations

import os
from collections.abc import Iterator

from twotower.eval.errors import DataError


def numbered_lines(path: str | os.PathLike[str]) -> Iterator[tuple[int, str]]:
    """Yield ``(1-based line number, line without its end-of-line)`` of a UTF-8 file.

    A byte-order mark at the start is dropped; ``\\r\\n`` endings are accepted.

    Raises:
        FileNotFoundError: the file does not exist (message names it).
        DataError: the file is not valid UTF-8 (message names the line).
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file")
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(path, number, f"not valid UTF-8 ({exc.reason})") from None
            if number == 1 and line.startswith("\ufeff"):
                line = line[1:]
            yield number, line.rstrip("\r\n")
