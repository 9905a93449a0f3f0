"""Fusion: worked examples computed by hand, plus the properties the formulas promise."""

from __future__ import annotations

import doctest
import math
import random

import numpy as np
import pytest

import twotower.retrieval.fusion
from twotower.retrieval.fusion import RRF_K, normalize_scores, reciprocal_rank_fusion, score_fusion


def test_rrf_default_k_is_60():
    assert RRF_K == 60


def test_rrf_worked_example():
    # dense: a b c ; bm25: c a d   (k = 60, 1-based ranks)
    fused = dict(reciprocal_rank_fusion([["a", "b", "c"], ["c", "a", "d"]]))
    assert fused["a"] == pytest.approx(1 / 61 + 1 / 62)
    assert fused["b"] == pytest.approx(1 / 62)
    assert fused["c"] == pytest.approx(1 / 63 + 1 / 61)
    assert fused["d"] == pytest.approx(1 / 63)
    order = [d for d, _ in reciprocal_rank_fusion([["a", "b", "c"], ["c", "a", "d"]])]
    # a: 0.032522, c: 0.032266, b: 0.016129, d: 0.015873
    assert order == ["a", "c", "b", "d"]


def test_rrf_k_changes_the_winner():
    # With a small k the top rank dominates: x (1st and 4th) beats y (2nd and 2nd) only when k is small.
    runs = [["x", "y", "p", "q"], ["r", "y", "s", "x"]]
    assert reciprocal_rank_fusion(runs, k=1)[0][0] == "x"  # 1/2 + 1/5 = 0.7 > y: 2/3 > r: 1/2
    assert reciprocal_rank_fusion(runs, k=60)[0][0] == "y"  # 2/62 > 1/61 + 1/64


def test_rrf_weights_and_limit():
    fused = reciprocal_rank_fusion([["a"], ["b"]], weights=[2.0, 1.0], limit=1)
    assert fused == [("a", pytest.approx(2 / 61))]
    with pytest.raises(ValueError, match="2 weights for 3"):
        reciprocal_rank_fusion([["a"], ["b"], ["c"]], weights=[1, 1])
    with pytest.raises(ValueError, match=">= 0"):
        reciprocal_rank_fusion([["a"]], weights=[-1])
    # NaN and inf passed `w < 0` and gave NaN / inf scores; all zeros ranked by id
    for bad in ([float("nan"), 1.0], [float("inf"), 1.0]):
        for fuse in (reciprocal_rank_fusion, score_fusion):
            with pytest.raises(ValueError, match="must be finite numbers >= 0"):
                fuse([["a"], ["b"]] if fuse is reciprocal_rank_fusion else [{"a": 1.0}, {"b": 2.0}], weights=bad)
    with pytest.raises(ValueError, match="all 0"):
        score_fusion([{"a": 1.0}, {"b": 2.0}], weights=[0, 0.0])
    assert [d for d, _ in score_fusion([{"a": 1.0, "b": 0.5}, {"b": 2.0}], weights=[1, 0])][0] == "a"
    with pytest.raises(ValueError, match="k must be > 0"):
        reciprocal_rank_fusion([["a"]], k=0)


def test_rrf_duplicates_inside_a_list_count_once():
    assert dict(reciprocal_rank_fusion([["a", "a", "b"]])) == {"a": pytest.approx(1 / 61), "b": pytest.approx(1 / 63)}


def test_rrf_single_list_keeps_its_order_and_ties_break_by_id():
    rng = random.Random(0)
    ids = [f"d{i}" for i in range(50)]
    rng.shuffle(ids)
    assert [d for d, _ in reciprocal_rank_fusion([ids])] == ids
    # two lists that mirror each other give every document the same score: by id descending, as trec_eval, dense
    # and BM25 search order equal scores (fusion alone ordered them ascending)
    assert [d for d, _ in reciprocal_rank_fusion([["b", "a"], ["a", "b"]])] == ["b", "a"]


def test_rrf_empty_inputs():
    assert reciprocal_rank_fusion([]) == []
    assert reciprocal_rank_fusion([[], []]) == []


def test_minmax_and_zscore_worked_examples():
    np.testing.assert_allclose(normalize_scores(np.array([1.0, 3.0, 2.0]), "minmax"), [0.0, 1.0, 0.5])
    # mean 2, population std sqrt(2/3)
    z = normalize_scores(np.array([1.0, 3.0, 2.0]), "zscore")
    np.testing.assert_allclose(z, [-1 / math.sqrt(2 / 3), 1 / math.sqrt(2 / 3), 0.0])
    np.testing.assert_allclose(normalize_scores(np.array([5.0, 5.0]), "minmax"), [1.0, 1.0])
    np.testing.assert_allclose(normalize_scores(np.array([5.0, 5.0]), "zscore"), [0.0, 0.0])
    assert normalize_scores(np.array([]), "minmax").size == 0
    with pytest.raises(ValueError, match="normalization"):
        normalize_scores(np.array([1.0]), "softmax")
    with pytest.raises(ValueError, match="NaN"):
        normalize_scores(np.array([1.0, np.nan]))


def test_score_fusion_minmax_worked_example():
    dense = {"a": 0.9, "b": 0.5, "c": 0.1}  # minmax -> a 1, b 0.5, c 0
    bm25 = {"c": 12.0, "d": 4.0}  # minmax -> c 1, d 0 ; missing a, b get 0
    fused = dict(score_fusion([dense, bm25], weights=[0.7, 0.3]))
    assert fused == pytest.approx({"a": 0.7, "b": 0.35, "c": 0.3, "d": 0.0})
    order = [d for d, _ in score_fusion([dense, bm25], weights=[0.7, 0.3])]
    assert order == ["a", "b", "c", "d"]


def test_a_spread_of_float_rounding_is_no_spread():
    """A cross-encoder scores one text at two batch positions ~1e-7 apart; z-scoring that blew it up to a ranking."""
    noise = np.array([1.078672171, 1.078671932, 1.078672051], dtype=np.float32)
    np.testing.assert_array_equal(normalize_scores(noise, "zscore"), [0.0, 0.0, 0.0])
    np.testing.assert_array_equal(normalize_scores(noise, "minmax"), [1.0, 1.0, 1.0])
    np.testing.assert_array_equal(normalize_scores(noise * 1e4, "zscore"), [0.0, 0.0, 0.0])  # relative to the size
    small = np.array([0.002, 0.001, 0.0015])  # a real spread, however small the scores: still normalised
    np.testing.assert_allclose(normalize_scores(small, "minmax"), [1.0, 0.0, 0.5])
    np.testing.assert_allclose(normalize_scores(small * 1e3, "zscore"), normalize_scores(small, "zscore"), atol=1e-12)


def test_interpolation_keeps_the_first_stage_order_among_documents_the_reranker_cannot_tell_apart():
    from twotower.retrieval.interpolation import interpolate

    rerank = np.array([1.078672171, 1.078671932, 1.078672051])  # one text, three batch positions
    first = np.array([0.52, 0.51, 0.50])
    assert interpolate(rerank, first, 0.7).argsort(kind="stable")[::-1].tolist() == [0, 1, 2]


def test_score_fusion_zscore_missing_gets_list_minimum():
    dense = {"a": 1.0, "b": 3.0}  # z: a -1, b +1
    bm25 = {"b": 2.0, "c": 4.0, "d": 0.0}  # mean 2, std sqrt(8/3): b 0, c +1.2247, d -1.2247
    fused = dict(score_fusion([dense, bm25], normalization="zscore"))
    s = math.sqrt(8 / 3)
    assert fused["a"] == pytest.approx(-1 + -2 / s)  # missing from bm25 -> bm25's minimum
    assert fused["b"] == pytest.approx(1 + 0)
    assert fused["c"] == pytest.approx(-1 + 2 / s)  # missing from dense -> dense's minimum (-1)
    assert fused["d"] == pytest.approx(-1 - 2 / s)


def test_score_fusion_is_invariant_to_affine_rescaling_of_a_list():
    rng = np.random.default_rng(0)
    ids = [f"d{i}" for i in range(30)]
    a = dict(zip(ids, rng.normal(size=30).tolist()))
    b = dict(zip(ids[10:], rng.normal(size=20).tolist()))
    b_scaled = {k: 7.5 * v + 100 for k, v in b.items()}
    for norm in ("minmax", "zscore"):
        base = score_fusion([a, b], normalization=norm)
        scaled = score_fusion([a, b_scaled], normalization=norm)
        assert [d for d, _ in base] == [d for d, _ in scaled]
        np.testing.assert_allclose([s for _, s in base], [s for _, s in scaled], atol=1e-9)


def test_score_fusion_limit_and_weight_count():
    assert len(score_fusion([{"a": 1.0, "b": 0.0, "c": 0.5}], limit=2)) == 2
    with pytest.raises(ValueError, match="1 weights for 2"):
        score_fusion([{"a": 1.0}, {"a": 1.0}], weights=[1.0])


def test_docstring_examples():
    result = doctest.testmod(twotower.retrieval.fusion)
    assert result.attempted > 0 and result.failed == 0
