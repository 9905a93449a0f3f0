"""Choosing the interpolation weight on dev: the grid's best alpha, ties, and the docstring example."""

from __future__ import annotations

import doctest

import pytest

import twotower.retrieval.training.alpha
from twotower.retrieval.training.alpha import ALPHA_GRID, choose_alpha


def test_choose_alpha_follows_the_better_ranker():
    qrels = {f"q{i}": {f"d{i}": 1} for i in range(6)}
    docs = [f"d{i}" for i in range(6)]
    good = {q: {d: (1.0 if d == next(iter(qrels[q])) else 0.1 * j) for j, d in enumerate(docs)} for q in qrels}
    bad = {q: {d: -s for d, s in good[q].items()} for q in qrels}
    alpha, curve = choose_alpha(good, bad, qrels)  # reranker right, first stage wrong
    assert alpha == 1.0 and curve[1.0] == pytest.approx(1.0) and curve[0.0] < 0.5
    alpha, curve = choose_alpha(bad, good, qrels)  # the other way round
    assert alpha < 0.5 and curve[0.0] == pytest.approx(1.0)
    assert sorted(curve) == list(ALPHA_GRID) == [i / 10 for i in range(11)]


def test_ties_go_to_the_larger_alpha():
    qrels = {"q": {"a": 1}}
    same = {"q": {"a": 2.0, "b": 1.0}}  # both stages agree: every alpha scores nDCG 1
    alpha, curve = choose_alpha(same, same, qrels, grid=(0.0, 0.4, 0.7))
    assert list(curve.values()) == pytest.approx([1.0, 1.0, 1.0]) and alpha == 0.7


def test_docstring_examples():
    result = doctest.testmod(twotower.retrieval.training.alpha)
    assert result.attempted > 0 and result.failed == 0
