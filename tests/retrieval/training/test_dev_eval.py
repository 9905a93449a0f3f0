"""Dev metrics for model selection: a worked example of nDCG@10 and recall@100, and the dev pool."""

from __future__ import annotations

import math

import pytest

from twotower.retrieval.training.dev_eval import dev_metrics, dev_pool


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
