"""Numbered line reading shared by the text-format readers, so every error can name ``path:line``.

Files whose name ends in ``.gz`` are read through gzip; lines are streamed, so a
corpus never has to fit in memory to be read or checked.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator
from typing import Any

from twotower.common.errors import DataError


def numbered_lines(path: str | os.PathLike[str]) -> Iterator[tuple[int, str]]:
    """Yield ``(1-based line number, line without its end-of-line)`` of a UTF-8 file (or ``.gz`` of one).

    A byte-order mark at the start is dropped; ``\\r\\n`` endings are accepted.

    Raises:
        FileNotFoundError: the file does not exist (message names it).
        DataError: the file is not valid UTF-8 (message names the line).
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file")
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DataError(path, number, f"not valid UTF-8 ({exc.reason})") from None
            if number == 1 and line.startswith("\ufeff"):
                line = line[1:]
            yield number, line.rstrip("\r\n")


def json_lines(path: str | os.PathLike[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(line number, object)`` for every non-blank line of a JSON-lines file; each must be an object.

    Raises:
        FileNotFoundError: the file does not exist.
        DataError: a line that is not valid JSON, or not a JSON object (message names the line).
    """
    for number, line in numbered_lines(path):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(path, number, f"not valid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(obj, dict):
            raise DataError(path, number, f"expected a JSON object, got {type(obj).__name__}")
        yield number, obj
