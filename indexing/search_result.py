"""The result type shared by every searcher in the package (vector and BM25)."""

from __future__ import annotations

from typing import NamedTuple

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


def empty_result(num_queries: int, k: int) -> SearchResult:
    """All-padding result, e.g. for an empty index."""
    return SearchResult(
        ids=[[MISSING_ID] * k for _ in range(num_queries)],
        scores=np.full((num_queries, k), MISSING_SCORE, dtype=np.float32),
    )
