"""Scoring first-stage candidates with a cross-encoder: one batched ``predict`` over every (query, text) pair.

The one reranking step of the project: `SearchPipeline` reranks the candidates
it recalled from the index, and the dev evaluation of training
(`twotower.retrieval.training.dev_eval.rerank_run`) reranks a first-stage run,
so a reranker is judged on dev exactly as it will be used.

All queries' pairs go to the reranker in one call, not one call per query:
`CrossEncoder.predict` sorts pairs by length across the whole call, so batches
pad less than they would inside one query's candidates.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from twotower.retrieval.cross_encoder import PairDocument

# First-stage candidates the cross-encoder scores when a search is not given rerank_k, and the depth
# training's dev evaluation reranks (so the stored interpolation weight is chosen at the depth it is used
# at). Measured on SciFact (docs/results.md, "How deep to rerank"): nDCG@10 at 20 is within noise of 10,
# 50 and 100, at a fifth of the cost of 100 (1.3 s vs 6.2 s a query in fp32 on 2 cores of CPU-A).
DEFAULT_RERANK_K = 20


# First-stage candidates a search takes when it is not given recall_k (and k is not larger).
DEFAULT_RECALL_K = 100


def recall_depth(recall_k: int | None, k: int, default: int = DEFAULT_RECALL_K) -> int:
    """How many candidates the first stage recalls: `recall_k`, else max(`default`, k) (`default`: the
    service's configured depth, else DEFAULT_RECALL_K).

    Why max: ``search(q, k=1000)`` was refused ("recall_k (100) must be >= k (1000)") for a recall depth the
    caller never chose. A `recall_k` the caller gave below k stays an error, which each caller raises in its
    own words (``recall_k`` in Python, ``--recall-k`` on the command line). One rule for the pipeline, the
    command line and the service.
    """
    return max(default, k) if recall_k is None else recall_k


def rerank_depth(rerank_k: int | None, recall_k: int) -> int:
    """How many of the first stage's top candidates the cross-encoder scores: `rerank_k`, else
    min(DEFAULT_RERANK_K, recall_k). One rule for the pipeline and the commands that report the depth."""
    return min(DEFAULT_RERANK_K, recall_k) if rerank_k is None else rerank_k


def rerank_scores(
    reranker: Any, queries: Sequence[str], texts: Sequence[Sequence[PairDocument]], batch_size: int | None = None,
    progress: bool = False,
) -> list[np.ndarray]:
    """Scores of each query's candidate texts, one (n_i,) array per query, in the candidates' order.

    Args:
        reranker: a `CrossEncoder`, or anything with ``predict(pairs, batch_size=..., progress=...)``
            returning one score per (query, text) pair.
        queries: Q query strings.
        texts: Q lists of candidate documents: `twotower.indexing.document_text` of each, or (title, text)
            for a reranker that reads documents window by window (`CrossEncoder.windows`).
        batch_size: pairs per forward pass; None: the reranker's own default (`CrossEncoder`'s is a token
            budget; another library's `predict` is not handed a None it may not take).
    """
    pairs = [(q, t) for q, candidates in zip(queries, texts) for t in candidates]
    sized = {} if batch_size is None else {"batch_size": batch_size}
    scores = np.asarray(reranker.predict(pairs, progress=progress, **sized))  # (N,)
    if scores.shape != (len(pairs),):
        raise ValueError(f"reranker returned {scores.shape} scores for {len(pairs)} pairs")
    out, pos = [], 0
    for candidates in texts:
        out.append(scores[pos:pos + len(candidates)])
        pos += len(candidates)
    return out
