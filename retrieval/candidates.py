"""`Candidate`: one first-stage result of a query, before reranking turns the list into Hits.

Dense search gives candidates straight from the index's `SearchResult`; hybrid
search fuses the dense and BM25 lists (`twotower.retrieval.fusion`) and keeps
both source scores, so a Hit can say where its document came from.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from twotower.indexing import MISSING_ID, SearchResult
from twotower.retrieval.fusion import reciprocal_rank_fusion, score_fusion


class Candidate(NamedTuple):
    """A recalled document: a NamedTuple because a search builds thousands and reads them by field."""

    id: str
    score: float  # the first stage's score: dense similarity, BM25 score, or the fused score for hybrid search
    rank: int  # 1-based rank in the first stage; reranking breaks score ties by it
    dense: float | None = None  # hybrid only: the dense score, None when dense search did not retrieve it
    bm25: float | None = None  # hybrid only: the BM25 score, None when BM25 did not retrieve it
    passage: str | None = None  # the best passage's row id of a document split into passages (retrieval.passages)


def dense_candidates(res: SearchResult) -> list[list[Candidate]]:
    """Candidates per query from one index search (dense, or BM25 alone: the same `SearchResult`), padding dropped."""
    return [[Candidate(d, s, r) for r, (d, s) in enumerate(zip(ids, scores), start=1) if d != MISSING_ID]
            for ids, scores in zip(res.ids, res.scores.tolist())]


def fused_candidates(
    dense: SearchResult, lexical: SearchResult, qi: int, limit: int, fusion: str, rrf_k: float,
    weights: Sequence[float] | None,
) -> list[Candidate]:
    """Query `qi`'s dense and BM25 lists fused by "rrf" (ranks) or "minmax" / "zscore" (normalised scores)."""
    d_ids = [d for d in dense.ids[qi] if d != MISSING_ID]
    b_ids = [d for d in lexical.ids[qi] if d != MISSING_ID]
    d_score = dict(zip(d_ids, dense.scores[qi].tolist()))
    b_score = dict(zip(b_ids, lexical.scores[qi].tolist()))
    if fusion == "rrf":
        fused = reciprocal_rank_fusion([d_ids, b_ids], k=rrf_k, weights=weights, limit=limit)
    else:
        fused = score_fusion([d_score, b_score], weights=weights, normalization=fusion, limit=limit)
    return [Candidate(d, float(s), r, d_score.get(d), b_score.get(d)) for r, (d, s) in enumerate(fused, start=1)]
