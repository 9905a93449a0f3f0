"""Evaluate a whole run against qrels: per-query values and their means.

Which queries count (decided here once, stated in every report):

* The denominator is the set of **judged queries** — every query id that
  appears in the qrels, even one whose judgments are all ≤ 0.
* A judged query missing from the run, or present with no documents, scores
  0 on every metric and still counts.  This is ``trec_eval -c`` ("average
  over the complete set of queries in the relevance judgements"), and it is
  what stops a system from looking better by answering fewer queries.
  Plain ``trec_eval`` and ``pytrec_eval`` average over the intersection of
  run and qrels instead; on a run that answers every judged query the two agree.
* Run queries without any judgment are skipped (they cannot be scored) and
  counted in ``skipped_unjudged``.
* ``drop_self_hits`` removes, before ranking, a document whose id equals the
  query id (BEIR does this for ArguAna and Quora where queries are also
  documents).  Off by default; reports state which way it was set.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from twotower.eval.metrics.names import MetricSpec, parse_metrics
from twotower.eval.metrics.ranking import query_metrics, rank_documents, recall_curve

Run = Mapping[str, Mapping[str, float]]  # {query id: {doc id: score}}
Qrels = Mapping[str, Mapping[str, int]]  # {query id: {doc id: judgment}}

DEFAULT_METRICS = ("ndcg@10", "mrr@10", "recall@100", "map")


class RetrievalEvaluation(NamedTuple):
    """Result of :func:`evaluate`.

    Attributes:
        means: ``{label: mean over judged queries}``, labels as requested.
        per_query: ``{query id: {label: value}}`` for every judged query, in qrels order.
        num_queries: number of judged queries (the denominator of ``means``).
        skipped_unjudged: run queries that have no judgments and were ignored.
        missing_from_run: judged queries with no document in the run (scored 0).
        drop_self_hits: whether documents equal to their query id were removed.
    """

    means: dict[str, float]
    per_query: dict[str, dict[str, float]]
    num_queries: int
    skipped_unjudged: int
    missing_from_run: int
    drop_self_hits: bool

    def column(self, label: str) -> np.ndarray:
        """Per-query values of one metric in ``per_query`` order, for significance tests.  # (Q,)"""
        return np.array([values[label] for values in self.per_query.values()], dtype=np.float64)


def ranked_relevance(
    scores: Mapping[str, float] | None,
    judgments: Mapping[str, int],
    query_id: str | None = None,
    drop_self_hits: bool = False,
) -> np.ndarray:
    """Judgments of a query's retrieved documents in trec_eval rank order (0 = unjudged).  # (N,)"""
    if not scores:
        return np.zeros(0, dtype=np.float64)
    if drop_self_hits and query_id is not None and query_id in scores:
        scores = {d: s for d, s in scores.items() if d != query_id}
    try:
        order = rank_documents(scores)
    except ValueError as exc:
        raise ValueError(f"query {query_id!r}: {exc}") from None
    return np.array([judgments.get(doc_id, 0) for doc_id in order], dtype=np.float64)


def evaluate(
    run: Run,
    qrels: Qrels,
    metrics: str | Sequence[str] | Sequence[MetricSpec] = DEFAULT_METRICS,
    *,
    drop_self_hits: bool = False,
) -> RetrievalEvaluation:
    """Score a run against qrels with trec_eval semantics, averaging the ``trec_eval -c`` way.

    Args:
        run: ``{query id: {doc id: score}}``; higher scores rank first.
        qrels: ``{query id: {doc id: judgment}}``; judgments > 0 are relevant.
        metrics: names like ``"ndcg@10,map"`` or a list of names / parsed specs.
        drop_self_hits: drop a retrieved document whose id equals its query id.

    Example:
        >>> r = evaluate({"q1": {"a": 2.0, "b": 1.0}}, {"q1": {"b": 1}, "q2": {"c": 1}}, "mrr@10")
        >>> r.per_query, r.means
        ({'q1': {'mrr@10': 0.5}, 'q2': {'mrr@10': 0.0}}, {'mrr@10': 0.25})

    Raises:
        ValueError: the qrels hold no query, a metric name is unknown, or a score is NaN.
    """
    if metrics and all(isinstance(m, MetricSpec) for m in metrics):
        specs = list(metrics)  # type: ignore[arg-type]
    else:
        specs = parse_metrics(metrics)  # type: ignore[arg-type]
    if not qrels:
        raise ValueError("the qrels hold no query")
    per_query: dict[str, dict[str, float]] = {}
    missing = 0
    for query_id, judgments in qrels.items():
        scores = run.get(query_id)
        if not scores:
            missing += 1
        rels = ranked_relevance(scores, judgments, query_id, drop_self_hits)
        per_query[query_id] = query_metrics(rels, judgments.values(), specs)
    n = len(per_query)
    means = {s.label: float(sum(v[s.label] for v in per_query.values()) / n) for s in specs}
    skipped = sum(1 for query_id in run if query_id not in qrels)
    return RetrievalEvaluation(means, per_query, n, skipped, missing, drop_self_hits)


def mean_recall_curve(
    run: Run, qrels: Qrels, max_k: int = 100, *, drop_self_hits: bool = False
) -> np.ndarray:
    """Mean Recall@k over judged queries for k = 1..max_k (same averaging as :func:`evaluate`).

    Returns:
        ``(max_k,)`` array; entry ``k - 1`` is Recall@k.
    """
    if max_k <= 0:
        raise ValueError("max_k must be positive")
    if not qrels:
        raise ValueError("the qrels hold no query")
    total = np.zeros(max_k, dtype=np.float64)
    for query_id, judgments in qrels.items():
        rels = ranked_relevance(run.get(query_id), judgments, query_id, drop_self_hits)
        num_rel = sum(1 for v in judgments.values() if v > 0)
        total += recall_curve(rels, num_rel, max_k)
    return total / len(qrels)
