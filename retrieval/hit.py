"""`Hit`: one search result, carrying every score that produced its place in the list.

Keeping the first-stage score and rank beside the rerank score is deliberate:
it is what lets a person see *why* a document moved (recall put it at 57, the
cross-encoder lifted it to 1) and what lets evaluation compare recall-only and
reranked runs from one search.

A plain slotted dataclass (not frozen): a search builds thousands of these, and
frozen dataclasses cost about three times as much to construct.  `gc_paused`
exists for the same reason: building 10,000 hits in a loop triggers collector
passes that find nothing to free; in a process with torch and faiss loaded they
more than doubled the mean cost (11.2 vs 4.9 ms, benchmarks/hit_construction.py).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any


@contextmanager
def gc_paused() -> Iterator[None]:
    """Suspend the cyclic garbage collector while a block allocates many short, acyclic objects.

    Reference counting still frees everything as usual; only the cycle detector waits, and it
    is re-enabled (if it was enabled) even when the block raises.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@dataclass(slots=True)
class Hit:
    """A ranked document.

    Attributes:
        id: document id (the corpus ``_id``).
        title: document title ("" when the corpus has none; None when searched with fetch_documents=False).
        text: document text (None when searched with fetch_documents=False).
        rank: final rank, 1-based.
        score: final score: the rerank score when reranked, else the first-stage score.
        first_stage_score: dense similarity, BM25 score, or fused score for hybrid search.
        first_stage_rank: 1-based rank in the first-stage (recall) list.
        rerank_score: cross-encoder score, or None when not reranked.
        dense_score: the dense similarity when hybrid search retrieved it densely, else None.
        bm25_score: the BM25 score when hybrid search retrieved it lexically, else None.
        label: the class a classification head gave the document (search with ``classifier=``), else None.
        label_score: that head's probability for ``label``, else None.
        passage: for a document split into passages (`twotower.retrieval.passages`), the character
            offsets ``{"start", "end"}`` in ``text`` of the passage that ranked it; None for a document
            stored whole, or when searched with fetch_documents=False.
        metadata: the document's metadata object (``{}`` when it has none), read with its title and text;
            None when searched with fetch_documents=False.
    """

    id: str
    title: str | None
    text: str | None
    rank: int
    score: float
    first_stage_score: float
    first_stage_rank: int
    rerank_score: float | None = None
    dense_score: float | None = None
    bm25_score: float | None = None
    label: str | None = None
    label_score: float | None = None
    passage: dict[str, int] | None = None
    metadata: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (the `twotower search --json` record).

        A flat copy (``passage`` and ``metadata`` are shared, not copied): ``dataclasses.asdict`` (a recursive
        deep copy) costs several times more on the service's event loop, which serialises thousands of hits a
        second.
        """
        return {name: getattr(self, name) for name in _HIT_FIELDS}


_HIT_FIELDS = tuple(f.name for f in fields(Hit))
