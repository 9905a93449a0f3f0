"""Per-query ranking metrics with trec_eval semantics, as small pure functions.

Why trec_eval semantics and not "whatever sorted() does": published numbers
(BEIR, MS MARCO, TREC) are trec_eval numbers, and the details move scores in
the third decimal.  The rules reproduced here, each checked against
pytrec_eval in ``tests/eval/test_retrieval_parity.py``:

* a run is ordered by score descending; equal scores are ordered by document
  id *descending* (trec_eval's ``qsort`` comparator compares ``docno`` with
  ``strcmp(b, a)``); the ranks written in a run file are ignored;
* a document is relevant when its judgment is > 0 (trec_eval's default
  ``relevance_level`` 1 on integer judgments); unjudged documents count as 0;
* nDCG uses the judgment itself as gain (not ``2^rel - 1``), discount
  ``log2(rank + 1)``; negative judgments give gain 0; the ideal ranking is
  built from every judged document, cut at the same k;
* P@k divides by k even when fewer than k documents were retrieved;
  MAP@k (``map_cut``) divides by the number of relevant documents, not by
  ``min(k, R)``; R-precision is precision at rank R (number of relevant);
* a query with no relevant documents scores 0 on every measure.

References: Järvelin & Kekäläinen 2002 (nDCG); trec_eval 9.0 ``m_*.c``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from twotower.eval.metrics.names import MetricSpec


def rank_documents(scores: Mapping[str, float]) -> list[str]:
    """Document ids in trec_eval order: score descending, then document id descending.

    Raises:
        ValueError: a score is NaN (it has no place in an order).
    """
    for doc_id, score in scores.items():
        if math.isnan(score):
            raise ValueError(f"document {doc_id!r} has a NaN score")
    # Python compares str by code point, which equals strcmp on UTF-8 bytes.
    return [doc_id for doc_id, _ in sorted(scores.items(), key=lambda kv: (kv[1], kv[0]), reverse=True)]


def _discounts(n: int) -> np.ndarray:
    return 1.0 / np.log2(np.arange(2, n + 2, dtype=np.float64))  # (n,)


def query_metrics(
    ranked_rels: Sequence[float] | np.ndarray,
    judged_rels: Iterable[float] | np.ndarray,
    specs: Sequence[MetricSpec],
) -> dict[str, float]:
    """All requested metrics for one query.

    Args:
        ranked_rels: judgment of each retrieved document in rank order, 0 for unjudged.  # (N,)
        judged_rels: every judgment of the query (relevant or not), for the ideal ranking and R.
        specs: parsed metric names.

    Returns:
        ``{spec.label: value}``.
    """
    rels = np.asarray(ranked_rels, dtype=np.float64)  # (N,)
    gains = np.where(rels > 0, rels, 0.0)  # (N,)
    hits = gains > 0  # (N,)
    cum_hits = np.cumsum(hits)  # (N,) relevant retrieved at each rank
    n = rels.shape[0]
    judged = np.asarray(list(judged_rels), dtype=np.float64)
    ideal = np.sort(judged[judged > 0])[::-1]  # (R,) best possible gains
    num_rel = ideal.shape[0]

    out: dict[str, float] = {}
    for spec in specs:
        k = spec.k
        cut = n if k is None else min(k, n)
        if spec.family == "ndcg":
            ideal_cut = ideal if k is None else ideal[:k]
            idcg = float(ideal_cut @ _discounts(ideal_cut.shape[0]))
            dcg = float(gains[:cut] @ _discounts(cut))
            value = dcg / idcg if idcg > 0 else 0.0
        elif spec.family == "mrr":
            first = np.flatnonzero(hits[:cut])
            value = 1.0 / (first[0] + 1) if first.size else 0.0
        elif spec.family == "recall":
            value = float(cum_hits[cut - 1]) / num_rel if num_rel and cut else 0.0
        elif spec.family == "p":
            assert k is not None  # parse_metric guarantees a cutoff for P
            value = float(cum_hits[cut - 1]) / k if cut else 0.0
        elif spec.family == "map":
            ranks = np.flatnonzero(hits[:cut]) + 1  # (hits,) 1-based ranks of relevant docs
            precisions = cum_hits[ranks - 1] / ranks
            value = float(precisions.sum()) / num_rel if num_rel else 0.0
        elif spec.family == "rprec":
            r_cut = min(num_rel, n)
            value = float(cum_hits[r_cut - 1]) / num_rel if num_rel and r_cut else 0.0
        else:  # pragma: no cover - parse_metric rejects other families
            raise ValueError(f"unsupported metric family {spec.family!r}")
        out[spec.label] = float(value)
    return out


def recall_curve(ranked_rels: Sequence[float] | np.ndarray, num_rel: int, max_k: int) -> np.ndarray:
    """Recall@k for k = 1..max_k of one query (0 everywhere when it has no relevant document).

    Returns:
        ``(max_k,)`` float array.
    """
    rels = np.asarray(ranked_rels, dtype=np.float64)[:max_k]
    cum = np.cumsum(rels > 0).astype(np.float64)  # (min(N, max_k),)
    curve = np.zeros(max_k, dtype=np.float64)
    if num_rel <= 0:
        return curve
    curve[: cum.shape[0]] = cum
    if cum.shape[0] < max_k:  # fewer documents than max_k: recall stays flat
        curve[cum.shape[0] :] = cum[-1] if cum.shape[0] else 0.0
    return curve / num_rel
