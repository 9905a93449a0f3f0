"""A path handed to a public function, checked once: one rule for the index and the pipeline.

Why: ``Path(None)`` and ``os.fspath(None)`` fail with "expected str, bytes or os.PathLike object, not
NoneType", which names no argument; `IndexStore.open` and `SearchPipeline.load` (which may not import each
other) refuse anything but a path the same way, naming the argument.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Sequence
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


def foreign_entries(directory: str | os.PathLike, allowed_names: Collection[str]) -> list[str]:
    """The entries of `directory` (sorted) that a run of ours does not write: every name but those in
    `allowed_names`, the temporaries of interrupted atomic writes (``.NAME.tmp-*``) and the directories
    `atomic_replace_dir`'s fallback moved aside (``NAME.old-PID`` of an allowed name).

    Why: ``--overwrite`` (and a report's ``--out``) replaces a directory whole; one that holds an earlier
    run's files beside the user's (``best/`` beside ``mycode.py``) is not an earlier run, and replacing it
    deleted the user's files with it. Every command that replaces a directory asks this one question.

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp(); open(os.path.join(d, "notes.txt"), "w").close()
        >>> foreign_entries(d, {"best", "summary.json"})
        ['notes.txt']
    """
    from twotower.common.atomic import OLD_MARKER, TMP_MARKER

    def ours(name: str) -> bool:
        if name in allowed_names or (name.startswith(".") and TMP_MARKER in name):
            return True
        head, marker, pid = name.rpartition(OLD_MARKER)
        return bool(marker) and pid.isdigit() and head in allowed_names

    return [n for n in sorted(os.listdir(directory)) if not ours(n)]


def a_few(names: Sequence[str], limit: int = 3) -> str:
    """`names` joined for a message, the first `limit` of them and how many more ("a, b, c and 4 more").

    Why: a refusal names what it found, so that the user sees which of their files it means, without
    listing a directory of thousands.
    """
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


# ---- refusals: one wording for every command that replaces a directory whole ---------------------------
# (an index, a training run, a report, a tokenizer, a soup); each caller names its flag, what it writes and
# an example, so that the user reads the same sentence from every command and a fix to it lands everywhere.


def working_directory_refusal(
    path: str | os.PathLike, given: str, what: str, example: str, overwrite: bool = False
) -> str | None:
    """The refusal of `path` as a directory `what` replaces whole, when it is or holds the working directory;
    else None.

    given: how the user named it ("--out run", or "out_dir='run'" for a Python call); what: the thing
    swapped in ("the index", "a run"); example: a directory name to suggest below it; overwrite: it is
    replaced on --overwrite, so it may hold the user's files (a run's --out), which would be lost too.

    Example:
        >>> here = os.getcwd()
        >>> working_directory_refusal(".", "--out .", "the index", "--out my-index")[:70]
        '--out .: the current directory; the index replaces its directory whole'
        >>> working_directory_refusal(os.path.join(here, "sub"), "--out sub", "the index", "--out x") is None
        True
    """
    where = holds_working_directory(path)
    if where is None:
        return None
    when, lost = (" (--overwrite)", "delete your files there and leave") if overwrite else ("", "leave")
    return (f"{given}: {where}; {what} replaces its directory whole{when}, which would {lost} your shell in a "
            f"removed directory; give a directory below it, e.g. {example}")


def beside_earlier_refusal(
    given: str, earlier: str, theirs: Sequence[str], replaced: str = "--overwrite would remove with it",
    another: str = "another --out",
) -> str:
    """The refusal of a directory that holds an earlier result (`earlier`: "an earlier run") and files of the
    user's (`theirs`, from `foreign_entries`), which replacing the result would delete.

    Example:
        >>> beside_earlier_refusal("--out run", "an earlier run", ["notes.txt"])
        '--out run: an earlier run and files of yours (notes.txt), which --overwrite would remove with it: move them out, or give another --out'
    """
    return f"{given}: {earlier} and files of yours ({a_few(theirs)}), which {replaced}: move them out, or give {another}"


def not_ours_refusal(given: str, theirs: Sequence[str], what: str) -> str:
    """The refusal of a directory of other files (`theirs`) where `what` ("a soup") would be written, replacing it.

    Example:
        >>> not_ours_refusal("--out r", ["a.txt", "b.txt"], "an earlier report")
        '--out r: a directory holding other files (a.txt, b.txt), not an earlier report; give a new or empty directory'
    """
    return f"{given}: a directory holding other files ({a_few(theirs)}), not {what}; give a new or empty directory"
