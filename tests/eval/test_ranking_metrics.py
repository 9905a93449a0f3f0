"""Worked examples of the retrieval metrics, computed by hand, and the metric-name parser."""

from __future__ import annotations

import math

import numpy as np
import pytest

from twotower.eval.metrics import (
    evaluate,
    mean_recall_curve,
    parse_metric,
    parse_metrics,
    query_metrics,
    rank_documents,
    recall_curve,
)


def test_ties_are_broken_by_document_id_descending():
    assert rank_documents({"a": 1.0, "c": 1.0, "b": 2.0, "d10": 1.0, "d9": 1.0}) == [
        "b",
        "d9",
        "d10",
        "c",
        "a",
    ]


def test_nan_score_is_rejected():
    with pytest.raises(ValueError, match="NaN"):
        rank_documents({"a": float("nan")})


def test_worked_example_graded():
    # ranking: d (rel -1), e (unjudged), c (0), b (2), a (1)
    run = {"q": {"a": 1.0, "b": 1.0, "c": 1.0, "e": 1.0, "d": 2.0}}
    qrels = {"q": {"a": 1, "b": 2, "c": 0, "d": -1}}
    r = evaluate(run, qrels, "ndcg@10,ndcg@4,mrr@10,mrr@3,p@5,p@10,recall@4,map,map@4,rprec").per_query["q"]
    dcg = 2 / math.log2(5) + 1 / math.log2(6)
    idcg = 2 + 1 / math.log2(3)
    assert r["ndcg@10"] == pytest.approx(dcg / idcg)
    assert r["ndcg@4"] == pytest.approx((2 / math.log2(5)) / idcg)
    assert r["mrr@10"] == pytest.approx(0.25)
    assert r["mrr@3"] == 0.0
    assert r["p@5"] == pytest.approx(2 / 5)
    assert r["p@10"] == pytest.approx(2 / 10)  # divides by k even with 5 retrieved
    assert r["recall@4"] == pytest.approx(1 / 2)
    assert r["map"] == pytest.approx((1 / 4 + 2 / 5) / 2)
    assert r["map@4"] == pytest.approx((1 / 4) / 2)  # divides by R = 2, not min(k, R)
    assert r["rprec"] == 0.0


def test_judged_query_without_results_counts_zero_and_unjudged_run_query_is_skipped():
    run = {"q1": {"a": 1.0}, "q3": {}, "extra": {"a": 1.0}}
    qrels = {"q1": {"a": 1}, "q2": {"b": 1}, "q3": {"c": 2}}
    r = evaluate(run, qrels, ["mrr@10", "recall@100"])
    assert r.per_query == {
        "q1": {"mrr@10": 1.0, "recall@100": 1.0},
        "q2": {"mrr@10": 0.0, "recall@100": 0.0},
        "q3": {"mrr@10": 0.0, "recall@100": 0.0},
    }
    assert r.means["mrr@10"] == pytest.approx(1 / 3)
    assert (r.num_queries, r.skipped_unjudged, r.missing_from_run) == (3, 1, 2)


def test_query_with_only_non_relevant_judgments_scores_zero():
    r = evaluate({"q": {"a": 3.0}}, {"q": {"a": 0, "b": -2}}, "ndcg@10,map,recall@10,rprec,mrr")
    assert set(r.per_query["q"].values()) == {0.0}


def test_drop_self_hits():
    run = {"q1": {"q1": 9.0, "d": 1.0}}
    qrels = {"q1": {"q1": 1, "d": 1}}
    assert evaluate(run, qrels, "p@1").means["p@1"] == 1.0
    kept = evaluate(run, {"q1": {"d": 1}}, "mrr@10")
    dropped = evaluate(run, {"q1": {"d": 1}}, "mrr@10", drop_self_hits=True)
    assert (kept.means["mrr@10"], dropped.means["mrr@10"]) == (0.5, 1.0)
    assert dropped.drop_self_hits and not kept.drop_self_hits


def test_labels_are_kept_as_written():
    r = evaluate({"q": {"a": 1.0}}, {"q": {"a": 1}}, " NDCG@10 ,P.1")
    assert list(r.means) == ["NDCG@10", "P.1"]


@pytest.mark.parametrize(
    ("name", "family", "k"),
    [
        ("ndcg@10", "ndcg", 10),
        ("ndcg", "ndcg", None),
        ("MRR@10", "mrr", 10),
        ("recall@100", "recall", 100),
        ("p@5", "p", 5),
        ("P.5", "p", 5),
        ("map", "map", None),
        ("map@100", "map", 100),
        ("rprec", "rprec", None),
        ("R-Precision", "rprec", None),
    ],
)
def test_parse_metric(name, family, k):
    spec = parse_metric(name)
    assert (spec.family, spec.k, spec.label) == (family, k, name)


@pytest.mark.parametrize("bad", ["bleu", "p", "ndcg@0", "rprec@5", "ndcg@x", ""])
def test_parse_metric_rejects(bad):
    with pytest.raises(ValueError):
        parse_metric(bad)


def test_parse_metrics_dedupes_and_needs_one():
    assert [s.label for s in parse_metrics("map,map,ndcg@10")] == ["map", "ndcg@10"]
    # one metric spelled two ways was two keys with one value
    assert [s.label for s in parse_metrics("ndcg@10,NDCG@010,AP,map")] == ["ndcg@10", "AP"]
    for bad in ("ndcg@-1", "recall@1e9", "map@"):  # the family is right, the cutoff is not ("unknown metric")
        with pytest.raises(ValueError, match=f"metric '{bad}': the cutoff must be a positive integer"):
            parse_metric(bad)
    with pytest.raises(ValueError, match="no metric"):
        parse_metrics(" , ")


def test_recall_curve_matches_recall_at_k():
    rng = np.random.default_rng(0)
    run = {f"q{i}": {f"d{j}": float(rng.random()) for j in range(30)} for i in range(6)}
    qrels = {
        f"q{i}": {f"d{j}": int(rng.integers(0, 3)) for j in rng.choice(40, 8, replace=False)}
        for i in range(7)
    }
    curve = mean_recall_curve(run, qrels, max_k=35)
    ev = evaluate(run, qrels, [f"recall@{k}" for k in range(1, 36)])
    assert curve.shape == (35,)
    np.testing.assert_allclose(curve, [ev.means[f"recall@{k}"] for k in range(1, 36)], atol=1e-12)
    assert np.all(np.diff(curve) >= 0)


def test_recall_curve_short_ranking_stays_flat():
    np.testing.assert_allclose(recall_curve([1, 0], num_rel=4, max_k=4), [0.25, 0.25, 0.25, 0.25])
    np.testing.assert_allclose(recall_curve([], num_rel=4, max_k=2), [0.0, 0.0])


def test_query_metrics_empty_ranking():
    out = query_metrics([], [1, 2], parse_metrics("ndcg@10,mrr,p@3,map,rprec,recall"))
    assert set(out.values()) == {0.0}


def test_empty_qrels_is_an_error():
    with pytest.raises(ValueError, match="no query"):
        evaluate({"q": {"a": 1.0}}, {}, "map")
