"""The one error type for bad input data: a file (or an in-memory record) that cannot be read as what it claims to be.

Why a dedicated class: a user who points a command at a malformed corpus, run
or qrels file needs to know *where* it is broken, not just that a ``float()``
failed somewhere.  ``DataError`` always renders as ``path:line: message`` (or
``path: message`` when no line applies, e.g. a JSON field or a whole file),
and it subclasses ``ValueError`` so existing ``except ValueError`` callers, and
the CLI's handler (exit status 2), keep working.
"""

from __future__ import annotations

import os


class DataError(ValueError):
    """Malformed input data, located by file and (1-based) line or field.

    Args:
        path: the offending file, or a name for an in-memory record such as ``"docs[3]"``.
        line: 1-based line number, or ``None`` when the problem is not tied to a line.
        message: what is wrong, phrased for the user.
        field: the field of the record at fault, when there is one (the service answers with it).

    Example:
        >>> str(DataError("run.trec", 3, "expected 6 columns, got 5"))
        'run.trec:3: expected 6 columns, got 5'
        >>> isinstance(DataError("docs[0]", None, "missing field '_id'"), ValueError)
        True
    """

    def __init__(self, path: str | os.PathLike[str], line: int | None, message: str, *, field: str | None = None) -> None:
        self.path = os.fspath(path)
        self.line = line
        self.message = message
        self.field = field  # the record's field at fault ("_id", "text", "metadata"), for a client to point at
        where = self.path if line is None else f"{self.path}:{line}"
        super().__init__(f"{where}: {message}")


def check_setting(ok: bool, name: str, value: object, flag: str | None, want: str) -> None:
    """A config setting's check, failing as ``name=value: want (flag)``: the Python field for API users and
    the command-line flag for everyone else (flag None: a setting the command line does not expose).

    Example:
        >>> check_setting(3 >= 1, "epochs", 3, "--epochs", "give 1 or more")
        >>> check_setting(0 >= 1, "epochs", 0, "--epochs", "give 1 or more")
        Traceback (most recent call last):
        ...
        ValueError: epochs=0: give 1 or more (--epochs)
    """
    if not ok:
        raise ValueError(f"{name}={value!r}: {want}" + (f" ({flag})" if flag else ""))


def check_at_least(config: object, low: int, flags: dict[str, str | None]) -> None:
    """`check_setting` for counts: each named field of `config` is None (not set) or at least `low`.
    flags: field name -> its command-line flag (None: not exposed)."""
    for name, flag in flags.items():
        value = getattr(config, name)
        check_setting(value is None or value >= low, name, value, flag, f"give {low} or more")


def flags_need(given: dict[str, object], needed: str) -> str | None:
    """What is wrong with giving options that only work with `needed`, naming only those given (not None), or None.

    Why only the given ones: "--passage-window and --passage-stride need --passages" of a command line that gave
    --passage-window alone named a flag the user never typed.

    Example:
        >>> flags_need({"--passage-window": 64, "--passage-stride": None}, "--passages")
        '--passage-window needs --passages'
        >>> flags_need({"--milvus-uri": "", "--collection": "c"}, "--backend milvus")
        '--milvus-uri and --collection need --backend milvus'
    """
    names = [flag for flag, value in given.items() if value is not None]
    return f"{' and '.join(names)} need{'s' * (len(names) == 1)} {needed}" if names else None


def refuse_keywords(call: str, given: dict[str, object], takes: str, hints: dict[str, str]) -> None:
    """Raise Python's TypeError for the first keyword of `given`, saying what `call` takes and, for a name another
    library uses (`hints`: name -> the way here), what to write instead.

    Why: ``search(top_k=5)`` or sentence-transformers' ``encode(..., show_progress_bar=True)`` failed deep inside
    (naming an internal class) or with a bare "unexpected keyword argument", which does not say the way here.
    """
    for name in given:
        hint = f" ({hints[name]})" if name in hints else ""
        raise TypeError(f"{call}() got an unexpected keyword argument {name!r}{hint}; it takes {takes}")
