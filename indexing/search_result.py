"""The result type shared by every searcher in the package (vector and BM25)."""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple

import numpy as np

MISSING_ID = ""  # id used to pad rows that have fewer than k hits
MISSING_SCORE = -np.inf  # score used to pad those rows


class SearchResult(NamedTuple):
    """Top-k hits for a batch of queries, as plain containers (easy to fuse or serialise).

    ``ids[q][r]`` is the document id at rank ``r`` for query ``q`` and ``scores[q, r]`` its
    score; *higher is always better* (for L2 indexes the score is the negated squared
    distance). Rows with fewer than ``k`` hits are padded with ``""`` and ``-inf``.
    """

    ids: list[list[str]]  # Q lists of k ids
    scores: np.ndarray  # (Q, k) float32


def is_count(value: Any) -> bool:
    """Whether `value` is an integer (numpy's too) and not a bool: the rule for k and the other depths."""
    return not isinstance(value, bool) and isinstance(value, numbers.Integral)


def check_k(k: Any, prefix: str = "search: ") -> int:
    """``k`` (the number of hits) as an int: any integer (``np.int64(2)`` too), never a bool or below 1.

    Why one check: ``IndexStore.search`` took numpy integers that ``SearchPipeline.search`` refused, and
    both took ``k=True`` as 1. `prefix` starts the message (``"search: "``; the pipeline passes ``""``).
    """
    if not is_count(k) or k < 1:
        raise ValueError(f"{prefix}k must be a positive int, got {k!r}")
    return int(k)


def empty_result(num_queries: int, k: int) -> SearchResult:
    """All-padding result, e.g. for an empty index."""
    return SearchResult(
        ids=[[MISSING_ID] * k for _ in range(num_queries)],
        scores=np.full((num_queries, k), MISSING_SCORE, dtype=np.float32),
    )


def padded(result: SearchResult, k: int) -> SearchResult:
    """`result` (fewer than ``k`` columns) padded to ``k`` with ``""`` / ``-inf``.

    Why: a search asked for more hits than the index stores (``k=3_000_000`` on four documents) does
    its work for the stored ones and pads once at the end; padding every intermediate array to ``k``
    took seconds and hundreds of MB for one query.
    """
    n = result.scores.shape[1]
    if n >= k:
        return result
    scores = np.full((len(result.ids), k), MISSING_SCORE, dtype=np.float32)  # (Q, k)
    scores[:, :n] = result.scores
    return SearchResult(ids=[row + [MISSING_ID] * (k - len(row)) for row in result.ids], scores=scores)


def ties_by_id(result: SearchResult, k: int) -> SearchResult:
    """Each row ordered by score, equal scores by document id descending, cut to ``k`` (padding last).

    Why: trec_eval orders equal scores that way, so a search's hits, its TREC run and its HTTP answer
    show tied documents (a corpus's duplicates) in one order; backends return them in their own.
    """
    s = np.asarray(result.scores, dtype=np.float32)  # (Q, n)
    scores = np.full((len(result.ids), k), MISSING_SCORE, dtype=np.float32)
    scores[:, : min(k, s.shape[1])] = s[:, :k]
    ids = [row[:k] + [MISSING_ID] * (k - len(row[:k])) for row in result.ids]
    # only a row out of order or holding a tie is sorted again (a per-row Python sort cost ~7 us a query)
    redo = ~(s[:, :-1] >= s[:, 1:]).all(1) | ((s[:, :-1] == s[:, 1:]) & np.isfinite(s[:, 1:])).any(1)  # (Q,)
    for q in np.flatnonzero(redo).tolist():
        hits = sorted(((v, i) for i, v in zip(result.ids[q], s[q].tolist()) if i != MISSING_ID), reverse=True)[:k]
        ids[q] = [i for _, i in hits] + [MISSING_ID] * (k - len(hits))
        scores[q] = MISSING_SCORE
        scores[q, : len(hits)] = [v for v, _ in hits]
    return SearchResult(ids=ids, scores=scores)


def tie_at_cut(result: SearchResult, k: int) -> bool:
    """Whether some row's last fetched hit still ties its k-th (a deeper fetch may hold more tied documents).

    `result` holds more than ``k`` columns; a tie that reaches its last one may go on past it.
    """
    last = result.scores[:, -1]  # (Q,)
    kth = result.scores[:, k - 1]
    return bool(np.any(np.isfinite(last) & (last == kth)))
