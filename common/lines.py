"""Numbered line reading shared by the text-format readers, so every error can name ``path:line``.

Files whose name ends in ``.gz`` are read through gzip; lines are streamed, so a
corpus never has to fit in memory to be read or checked.

Each line is decoded on its own (the file is read as bytes and split on ``\\n``),
so a bad byte is reported on the line that holds it, the line an editor or
``sed -n Np`` shows.  (A text-mode reader decodes 8 KiB blocks ahead of the
line it hands out, and its error arrives with the number of an earlier line.)

Hostile or damaged files become a `DataError` naming the file (and line), never a
traceback from deep inside gzip or json: a truncated or non-gzip ``.gz``, a JSON
value nested deeper than the parser can recurse, a number too long to convert,
and a lone UTF-16 surrogate (``"\\ud800"``, valid JSON but not Unicode text, which
no tokenizer or UTF-8 writer accepts).  A key given twice in one object is refused too:
Python's parser keeps the last value silently, so ``{"id": "a", "id": "b"}`` would index "b".
"""

from __future__ import annotations

import gzip
import json
import math
import os
import re
import unicodedata
import zlib
from collections.abc import Iterator
from typing import Any

from twotower.common.errors import DataError

GZIP_MAGIC = b"\x1f\x8b"
# A JSON escape of a UTF-16 surrogate; only lines holding one can decode to a lone surrogate.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def is_json_lines(path: str | os.PathLike[str]) -> bool:
    """Whether a file's name says JSON lines (``.jsonl`` or ``.json``, gzipped or not) rather than tab-separated
    text: readers that chose by ``.jsonl`` alone read ``queries.jsonl.gz`` as TSV."""
    name = os.fspath(path).lower()
    return name.removesuffix(".gz").endswith((".jsonl", ".json"))


def numbered_lines(path: str | os.PathLike[str]) -> Iterator[tuple[int, str]]:
    """Yield ``(1-based line number, line without its end-of-line)`` of a UTF-8 file (or ``.gz`` of one).

    A byte-order mark at the start is dropped; ``\\r\\n`` endings are accepted.

    Raises:
        FileNotFoundError: the file does not exist (message names it).
        DataError: the file is not valid UTF-8 (message names the line), or a ``.gz`` file
            is not gzip or is truncated / corrupt (message names the file and the line reached).
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file")
    compressed = path.endswith(".gz")
    opener = gzip.open if compressed else open
    number = 0
    try:
        with opener(path, "rb") as handle:
            for number, raw in enumerate(handle, start=1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    hint = ""
                    if number == 1 and raw.startswith(GZIP_MAGIC):
                        hint = "; it looks gzip-compressed: name it *.gz"
                    raise DataError(path, number, f"not valid UTF-8 ({exc.reason}){hint}") from None
                if number == 1 and line.startswith("\ufeff"):
                    line = line[1:]
                yield number, line.rstrip("\r\n")
    except gzip.BadGzipFile as exc:
        if number == 0 and str(exc).startswith("Not a gzipped file"):
            raise DataError(path, None, "not a gzip file, although its name ends in .gz (rename it or compress it)") \
                from None
        raise DataError(path, number + 1, f"corrupt gzip data ({exc})") from None  # e.g. "CRC check failed"
    except EOFError:
        raise DataError(path, number + 1, f"the gzip data ends early: the file is truncated (read {number} complete "
                        "lines)") from None
    except zlib.error as exc:
        raise DataError(path, number + 1, f"corrupt gzip data ({exc})") from None


def is_blank(text: str) -> bool:
    """Whether `text` holds nothing but whitespace, control and format characters (the one notion of blank,
    for queries and for documents).

    Why not ``strip()``: ``"\\x00"``, a zero-width space, a word joiner, a soft hyphen or a byte-order mark
    passed it, reached the model as an empty text, and (a query) returned arbitrary hits or (a document)
    became the [CLS]/[SEP]-only vector that shows up for any query.
    """
    return all(ch.isspace() or unicodedata.category(ch) in ("Cc", "Cf") for ch in text)


def query_problem(text: str, name: str) -> str | None:
    """Why `text` cannot be searched as a query, or None; `name` is what the user calls it ("q", "query 3").

    Blank (`is_blank`) is refused. A lone surrogate (an unpaired ``\\u`` escape in JSON, or an undecodable
    byte on a command line) is not Unicode text: the tokenizer refused it with a TypeError.
    """
    if is_blank(text):
        return f"{name} is empty" if not text.strip() else f"{name} holds only control or invisible characters"
    return json_problem(text, name)


def json_problem(
    value: Any, name: str = "", *, max_depth: int | None = None, allow_nan: bool = True,
    max_int_bits: int | None = None,
) -> str | None:
    """What makes a decoded (or in-memory) JSON value unfit to store and serve, or None if nothing.

    Walks the value without recursion (a hostile value may be nested 100k deep) and reports the
    first of: a lone surrogate in a string or key, a non-finite float (when not `allow_nan`:
    NaN and Infinity are not JSON), nesting deeper than `max_depth`, a non-string key, an integer
    of more than `max_int_bits` bits, or a type JSON does not have.  The answer names where, as
    ``name.a.b[2]`` (`name` is what the caller calls the value, e.g. ``metadata``).
    """
    stack: list[tuple[Any, str, int]] = [(value, name, 0)]
    while stack:
        v, where, depth = stack.pop()
        here = where or "the value"
        if isinstance(v, str):
            if not v.isascii() and (m := _SURROGATE.search(v)):
                return (f"{here} holds a lone surrogate {ascii(m.group())} at character {m.start()} "
                        "(an unpaired \\u escape), which is not Unicode text")
        elif isinstance(v, bool) or v is None:
            pass
        elif isinstance(v, int):
            if max_int_bits is not None and v.bit_length() > max_int_bits:
                return f"{here} is an integer of about {int(v.bit_length() * 0.30103)} digits, too long to store"
        elif isinstance(v, float):
            if not allow_nan and not math.isfinite(v):
                shown = "NaN" if math.isnan(v) else ("Infinity" if v > 0 else "-Infinity")
                return f"{here} is {shown}, which is not a JSON number (JSON has no NaN or Infinity)"
        elif isinstance(v, (dict, list, tuple)):
            if max_depth is not None and depth >= max_depth:
                return f"{here} is nested more than {max_depth} levels deep"
            if isinstance(v, dict):
                for k, item in v.items():
                    if not isinstance(k, str):
                        return f"{here} has a key {k!r} that is not a string"
                    if not k.isascii() and _SURROGATE.search(k):
                        return f"{here} has a key {ascii(k)} holding a lone surrogate, which is not Unicode text"
                    stack.append((item, f"{where}.{k}" if where else k, depth + 1))
            else:
                stack.extend((item, f"{where}[{i}]", depth + 1) for i, item in enumerate(v))
        else:
            return f"{here} is a {type(v).__name__}, which JSON cannot hold"
    return None


class RepeatedKeyError(ValueError):
    """A JSON object that gives one key twice; `key` is the key."""

    def __init__(self, key: str) -> None:
        super().__init__(f"key {key!r} is given twice in one JSON object; give it once")
        self.key = key


def no_repeated_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A ``json.loads`` ``object_pairs_hook`` that raises `RepeatedKeyError` for a key given twice."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise RepeatedKeyError(key)
            seen.add(key)
    return out


def json_lines(path: str | os.PathLike[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(line number, object)`` for every non-blank line of a JSON-lines file; each must be an object.

    Raises:
        FileNotFoundError: the file does not exist.
        DataError: a line that is not valid JSON, not a JSON object, nested too deeply for the
            parser, holding a number too long to read, a lone surrogate or a key given twice
            (message names the line).
    """
    for number, line in numbered_lines(path):
        if not line.strip():
            continue
        try:
            obj = json.loads(line, object_pairs_hook=no_repeated_keys)
        except json.JSONDecodeError as exc:
            raise DataError(path, number, f"not valid JSON ({exc.msg} at column {exc.colno})") from None
        except RepeatedKeyError as exc:
            raise DataError(path, number, str(exc)) from None
        except RecursionError:
            raise DataError(path, number, "JSON nested too deeply to read") from None
        except ValueError as exc:  # e.g. "Exceeds the limit (4300 digits) for integer string conversion"
            raise DataError(path, number, f"a number too long to read ({str(exc).split(';')[0]})") from None
        if not isinstance(obj, dict):
            raise DataError(path, number, f"expected a JSON object, got {type(obj).__name__}")
        if _SURROGATE_ESCAPE.search(line) and (problem := json_problem(obj)):
            raise DataError(path, number, problem)
        yield number, obj
