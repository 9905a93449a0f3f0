"""The weight-free fusion the hybrid_rerank_fusion benchmark compares, on a worked example."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

from hybrid_rerank_fusion import rrf3  # noqa: E402


def test_rrf3_adds_the_rerankers_reciprocal_rank_to_the_hybrids_own_score():
    # Three candidates: the hybrid's RRF score is 1/(60 + dense rank) + 1/(60 + BM25 rank); "c" was
    # not retrieved by BM25. The reranker orders them c, b, a.
    dense = {"a": 1, "b": 2, "c": 3}
    bm25 = {"a": 2, "b": 1}
    first = {d: 1 / (60 + dense[d]) + (1 / (60 + bm25[d]) if d in bm25 else 0) for d in dense}
    out = rrf3(first, dense, bm25, {"a": 0.1, "b": 0.5, "c": 2.0}, w=1.0)
    assert out["c"] == pytest.approx(1 / 63 + 1 / 61)
    assert out["b"] == pytest.approx(1 / 62 + 1 / 61 + 1 / 62)
    assert out["a"] == pytest.approx(1 / 61 + 1 / 62 + 1 / 63)
    assert sorted(out, key=out.get, reverse=True) == ["b", "a", "c"]  # two lists outvote the reranker
    # With the reranker's weight at 0 the hybrid's order is kept exactly.
    flat = rrf3(first, dense, bm25, {"a": 0.1, "b": 0.5, "c": 2.0}, w=0.0)
    assert flat == pytest.approx(first)


def test_rrf3_breaks_reranker_ties_by_the_hybrids_score():
    dense, bm25 = {"a": 2, "b": 1}, {}
    first = {"a": 1 / 62, "b": 1 / 61}
    out = rrf3(first, dense, bm25, {"a": 1.0, "b": 1.0}, w=1.0)
    assert out["b"] == pytest.approx(1 / 61 + 1 / 61)  # b ranks first with the reranker on a tie
