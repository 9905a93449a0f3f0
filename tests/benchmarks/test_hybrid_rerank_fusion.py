"""The weight-free fusion the hybrid_rerank_fusion benchmark compares, on a worked example."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

from hybrid_rerank_fusion import rrf3  # noqa: E402


def test_rrf3_adds_the_rerankers_reciprocal_rank_to_the_hybrids_own_score():
    # Three candidates with the hybrid's RRF scores 1/(60 + dense rank) + 1/(60 + BM25 rank): a is 1st and
    # 2nd, b 2nd and 1st, c 3rd by dense and not retrieved by BM25. The reranker orders them c, b, a.
    first = {"a": 1 / 61 + 1 / 62, "b": 1 / 62 + 1 / 61, "c": 1 / 63}
    out = rrf3(first, {"a": 0.1, "b": 0.5, "c": 2.0}, w=1.0)
    assert out["c"] == pytest.approx(1 / 63 + 1 / 61)
    assert out["b"] == pytest.approx(1 / 62 + 1 / 61 + 1 / 62)
    assert out["a"] == pytest.approx(1 / 61 + 1 / 62 + 1 / 63)
    assert sorted(out, key=out.get, reverse=True) == ["b", "a", "c"]  # two lists outvote the reranker
    # With the reranker's weight at 0 the hybrid's scores are kept exactly.
    assert rrf3(first, {"a": 0.1, "b": 0.5, "c": 2.0}, w=0.0) == first


def test_rrf3_breaks_reranker_ties_by_the_hybrids_score():
    first = {"a": 1 / 62, "b": 1 / 61}
    out = rrf3(first, {"a": 1.0, "b": 1.0}, w=1.0)
    assert out["b"] == pytest.approx(1 / 61 + 1 / 61)  # b takes the reranker's first rank on a tie
    assert out["a"] == pytest.approx(1 / 62 + 1 / 62)
