"""The passage rows of a split document at rest: their ids, and the rule that they give the document back.

Why here and not in ``twotower.retrieval.passages`` (which splits documents and searches them):
``twotower index check`` (`twotower.indexing.check`) verifies that every split document can be
rebuilt, and the indexing layer imports nothing of retrieval; both layers apply this one rule.

A document longer than one window is stored only as its passages: rows ``<doc id>\\x1f<n>``,
``n`` = 0, 1, ..., each with its document's id (``parent``) and its character span (``start``,
``end``). Its text is the union of the spans, so the rows must be numbered 0 to n-1 with n >= 2
(a document that fits one window is one row under its own id), and each must start at or before
the end of the ones before it, the first at 0. A row removed alone breaks that (earlier versions
let ``index delete`` and ``SearchPipeline.delete`` remove one by its id).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

SEPARATOR = "\x1f"  # between a document id and its passage number in a row id
RowT = TypeVar("RowT", bound=Mapping[str, Any])


def passage_number(row_id: str) -> int | None:
    """The passage number in a row id, or None for a document stored whole."""
    head, sep, n = row_id.partition(SEPARATOR)
    return int(n) if sep else None


def in_passage_order(rows: Sequence[RowT]) -> list[RowT]:
    """The rows of one document by passage number (SQLite gives them by span start, or in no order)."""
    return sorted(rows, key=lambda r: passage_number(r["id"]) or 0)


def passages_problem(rows: Sequence[Mapping[str, Any]]) -> str | None:
    """Why the passage rows of one document (`in_passage_order`) do not give its text back, or None.

    Rows are mappings with ``id``, ``start`` and ``end``; the answer names the first row at fault.
    """
    numbers = [passage_number(r["id"]) for r in rows]
    if numbers != list(range(len(rows))):  # ids are unique: a number below len(rows) is absent
        gone = next(n for n in range(len(rows)) if n not in numbers)
        shown = ", ".join(map(str, numbers[:10])) + (", ..." if len(numbers) > 10 else "")
        return f"passage {gone} is missing (the stored ones are numbered {shown})"
    if len(rows) < 2:
        return "only passage 0 is stored; a document split into passages has at least 2"
    end = 0
    for r in rows:
        if r["start"] > end:
            return (f"passage {r['id']!r} starts at {r['start']}, after the previous passages end ({end}): the "
                    "stored passages do not cover the text")
        end = max(end, r["end"])
    return None
