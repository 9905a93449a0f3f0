"""Fusing ranked lists from several retrievers (dense + BM25) into one: pure functions, no models.

Two families, because they fail differently:

* **Reciprocal-rank fusion** (Cormack, Clarke & Buettcher, SIGIR 2009) looks only
  at ranks: ``score(d) = sum_i w_i / (k + rank_i(d))`` with 1-based ranks and a
  document absent from list *i* contributing nothing.  It needs no score
  calibration, which is why it is the default for hybrid search.  ``k = 60`` is
  the constant of the paper (and of Elasticsearch / Vespa / OpenSearch); it damps
  the influence of the very top ranks so one retriever cannot dominate.
* **Score fusion** is a weighted sum of per-list normalised scores (min-max to
  [0, 1], or z-score).  It keeps the *margin* information RRF throws away, but
  is only as good as the normalisation.  A document missing from a list gets that
  list's lowest normalised score (0 for min-max): it was not retrieved, so it is
  treated as no better than the worst retrieved one.

Both return ``[(doc_id, fused_score), ...]`` best first; equal scores are
ordered by document id so that results are deterministic.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

RRF_K = 60  # Cormack et al. 2009; the value every major search engine ships as default.
# Hybrid search's fusion when none is given (`SearchPipeline.search`; `twotower eval --index` records it).
DEFAULT_FUSION = "rrf"
NORMALIZATIONS = ("minmax", "zscore")


def _check_weights(weights: Sequence[float] | None, n: int) -> list[float]:
    if weights is None:
        return [1.0] * n
    if len(weights) != n:
        raise ValueError(f"{len(weights)} weights for {n} result lists")
    # written so that NaN fails too (`w < 0` is False for it): NaN or inf weights gave NaN / inf scores, and
    # all-zero weights a ranking by id, each without a word
    if not all(0 <= w < math.inf for w in weights):
        raise ValueError(f"fusion weights must be finite numbers >= 0, got {list(weights)}")
    if not any(weights):
        raise ValueError(f"fusion weights are all 0 ({list(weights)}): every document would score 0")
    return [float(w) for w in weights]


def _ordered(scores: Mapping[str, float], limit: int | None) -> list[tuple[str, float]]:
    """By score; equal scores by id descending, as trec_eval, dense and BM25 search order them."""
    out = sorted(scores.items(), key=lambda kv: (kv[1], kv[0]), reverse=True)
    return out[:limit] if limit is not None else out


def reciprocal_rank_fusion(
    rankings: Sequence[Sequence[str]],
    k: float = RRF_K,
    weights: Sequence[float] | None = None,
    limit: int | None = None,
) -> list[tuple[str, float]]:
    """Fuse ranked id lists (best first) by reciprocal rank.

    Args:
        rankings: one list of document ids per retriever, best first.  An id that
            repeats inside one list counts only at its first (best) rank.
        k: the RRF constant (default 60, as in the paper); must be > 0.
        weights: optional non-negative weight per list (default 1 each).
        limit: keep only the best `limit` fused documents.

    Example:
        >>> reciprocal_rank_fusion([["a", "b"], ["b", "c"]], k=60)[0]
        ('b', 0.03252247488101534)
    """
    if k <= 0:
        raise ValueError(f"RRF k must be > 0, got {k}")
    w = _check_weights(weights, len(rankings))
    fused: dict[str, float] = {}
    for wi, ranking in zip(w, rankings):
        seen: set[str] = set()
        for rank, doc_id in enumerate(ranking, start=1):
            if doc_id in seen:
                continue
            seen.add(doc_id)
            fused[doc_id] = fused.get(doc_id, 0.0) + wi / (k + rank)
    return _ordered(fused, limit)


# A spread at most this fraction of the largest magnitude (and at most this, below 1) is float32 rounding
# (2**-24 ~ 6e-8 relative, with room for a few operations), not a difference between documents.
ROUNDING_SPREAD = 1e-6


def normalize_scores(scores: np.ndarray, method: str = "minmax") -> np.ndarray:
    """Normalise one list's scores so that lists from different retrievers are comparable.

    minmax: (s - min) / (max - min), in [0, 1]; a list whose scores are all equal maps to 1.0
            (every document is as good as the best).
    zscore: (s - mean) / std (population std); a constant list maps to 0.0.

    "Equal" allows float rounding (`ROUNDING_SPREAD`): a cross-encoder gives the same text at two
    positions of a batch logits ~1e-7 apart, and dividing by that spread turned the noise into a
    ranking (final scores from +1.9 to -1.2 among identical documents).
    """
    s = np.asarray(scores, dtype=np.float64)
    if method not in NORMALIZATIONS:
        raise ValueError(f"normalization={method!r}; choose one of {NORMALIZATIONS}")
    if s.size == 0:
        return s
    if not np.all(np.isfinite(s)):
        raise ValueError("scores to normalise contain NaN or infinity")
    rounding = ROUNDING_SPREAD * max(1.0, float(np.abs(s).max()))
    if method == "minmax":
        lo, hi = s.min(), s.max()
        return np.ones_like(s) if hi - lo <= rounding else (s - lo) / (hi - lo)
    sd = s.std()
    return np.zeros_like(s) if sd <= rounding else (s - s.mean()) / sd


def score_fusion(
    results: Sequence[Mapping[str, float]],
    weights: Sequence[float] | None = None,
    normalization: str = "minmax",
    limit: int | None = None,
) -> list[tuple[str, float]]:
    """Weighted sum of normalised scores over several retrievers' results.

    Args:
        results: one ``{doc_id: score}`` mapping per retriever (higher = better).
        weights: optional non-negative weight per retriever (default 1 each);
            e.g. ``[0.7, 0.3]`` for dense-heavy hybrid search.
        normalization: "minmax" or "zscore", applied to each list separately.
        limit: keep only the best `limit` fused documents.

    A document absent from a list receives that list's minimum normalised score.

    Example:
        >>> score_fusion([{"a": 2.0, "b": 1.0}, {"b": 10.0, "c": 0.0}])
        [('b', 1.0), ('a', 1.0), ('c', 0.0)]
    """
    w = _check_weights(weights, len(results))
    normed: list[dict[str, float]] = []
    floors: list[float] = []
    for res in results:
        ids = list(res)
        vals = normalize_scores(np.fromiter((res[i] for i in ids), dtype=np.float64, count=len(ids)), normalization)
        normed.append(dict(zip(ids, vals.tolist())))
        floors.append(float(vals.min()) if vals.size else 0.0)
    all_ids = {doc_id for res in results for doc_id in res}
    fused = {
        doc_id: sum(wi * nd.get(doc_id, floor) for wi, nd, floor in zip(w, normed, floors))
        for doc_id in all_ids
    }
    return _ordered(fused, limit)
