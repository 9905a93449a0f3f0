"""Dev metrics for model selection: a worked example of nDCG@10 and recall@100, and the dev pool."""

from __future__ import annotations

import math

import pytest

from twotower.retrieval.training.dev_eval import dev_metrics, dev_pool, rerank_run


def test_dev_metrics_worked_example():
    qrels = {"q1": {"a": 1, "b": 1}, "q2": {"d": 1}, "q3": {"x": 1}}
    run = {"q1": {"a": 3.0, "c": 2.0, "b": 1.0},  # relevant at ranks 1 and 3
           "q2": {"e": 1.0},  # nothing relevant retrieved
           "q3": {}}  # judged but empty: still counts, as trec_eval -c
    q1_ndcg = (1 + 1 / math.log2(4)) / (1 + 1 / math.log2(3))
    metrics = dev_metrics(run, qrels)
    assert metrics == pytest.approx({"ndcg@10": q1_ndcg / 3, "recall@100": 1 / 3})
    assert dev_metrics(run, qrels, ("ndcg@10",)) == pytest.approx({"ndcg@10": q1_ndcg / 3})


def test_dev_pool_keeps_judged_documents_and_a_seeded_sample():
    corpus = {f"d{i}": f"text {i}" for i in range(20)}
    qrels = {"q": {"d3": 1, "d17": 1, "missing": 1}}
    pool = dev_pool(corpus, qrels, size=5, seed=1)
    assert {"d3", "d17"} <= set(pool) and len(pool) == 7 and pool == dev_pool(corpus, qrels, size=5, seed=1)
    assert dev_pool(corpus, qrels, size=None) == corpus


class CountingReranker:
    """Scores a pair by its text's length, recording every pair it is asked for."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, str]] = []

    def predict(self, pairs, batch_size=32, progress=False):
        self.asked.extend(pairs)
        return [float(len(q) + 10 * len(t)) for q, t in pairs]


def test_rerank_run_reuses_known_scores_and_scores_only_the_rest():
    corpus = {"a": "x", "b": "xx", "c": "xxx", "d": "xxxx"}
    queries = {"q1": "one", "q2": "three"}
    first = {"q1": {"a": 4.0, "b": 3.0, "c": 2.0, "d": 1.0}, "q2": {"d": 2.0, "c": 1.0}}
    full, full_scores = rerank_run(CountingReranker(), queries, first, corpus, k=3)
    assert full == {"q1": {"a": 13.0, "b": 23.0, "c": 33.0}, "q2": {"d": 45.0, "c": 35.0}}
    known = {"q1": {"a": 13.0, "c": 33.0}, "q2": {"d": 45.0, "c": 35.0}}  # q2 needs nothing scored
    counting = CountingReranker()
    run, scores = rerank_run(counting, queries, first, corpus, k=3, known=known)
    assert run == full and sorted(scores.tolist()) == sorted(full_scores.tolist())
    assert counting.asked == [("one", "xx")]
    nothing = CountingReranker()
    assert rerank_run(nothing, queries, first, corpus, k=3, known=full)[0] == full and nothing.asked == []
