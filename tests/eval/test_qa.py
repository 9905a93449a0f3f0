"""SQuAD v1.1 / v2.0 scoring: official normalisation and worked examples."""

from __future__ import annotations

import pytest

from twotower.eval.metrics import (
    exact_match,
    normalize_answer,
    squad_v1_scores,
    squad_v2_raw_scores,
    squad_v2_scores,
    token_f1,
)
from twotower.eval.metrics.qa import token_f1_v2


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The  Denver Broncos!", "denver broncos"),
        ("an apple, a pear", "apple pear"),
        ("Theatre", "theatre"),  # article only as a whole word
        ("“Quoted”", "“quoted”"),  # only ASCII punctuation is removed, as in the official script
        ("  ", ""),
    ],
)
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


def test_exact_match_and_f1():
    assert exact_match("the Broncos", "Broncos.") == 1.0
    assert exact_match("Denver", "Denver Broncos") == 0.0
    # pred tokens: denver broncos won ; gold: broncos won game  -> 2 shared
    assert token_f1("Denver Broncos won", "the Broncos won the game") == pytest.approx(
        2 * (2 / 3) * (2 / 3) / (4 / 3)
    )
    assert token_f1("", "") == 0.0  # v1.1: nothing shared
    assert token_f1_v2("", "") == 1.0  # v2.0: both say "no answer"
    assert token_f1_v2("Broncos", "") == 0.0


def test_squad_v1_max_over_golds_and_missing():
    refs = {"a": ["Denver Broncos", "Broncos"], "b": ["1990"], "c": ["Paris"]}
    preds = {"a": "the broncos", "b": "in 1990 year"}
    out = squad_v1_scores(preds, refs)
    # a: EM 1 (matches "Broncos"); b: EM 0, F1 = 2*(1/3)*1/(4/3) = 0.5; c: missing -> 0
    assert out["exact_match"] == pytest.approx(100 * 1 / 3)
    assert out["f1"] == pytest.approx(100 * 1.5 / 3)
    assert (out["total"], out["missing"]) == (3, 1)


def test_squad_v1_rejects_unanswerable_and_single_string():
    with pytest.raises(ValueError, match="no gold"):
        squad_v1_scores({"a": ""}, {"a": []})
    with pytest.raises(ValueError, match="list of answer strings"):
        squad_v1_scores({"a": "x"}, {"a": "x"})


def test_squad_v2_no_answer_handling():
    refs = {"has1": ["Paris"], "has2": ["blue whale"], "no1": [], "no2": []}
    preds = {"has1": "Paris", "has2": "whale", "no1": "", "no2": "London"}
    exact, f1, has = squad_v2_raw_scores(preds, refs)
    assert exact == {"has1": 1.0, "has2": 0.0, "no1": 1.0, "no2": 0.0}
    assert f1["has2"] == pytest.approx(2 * 1 * 0.5 / 1.5)
    assert has == {"has1": True, "has2": True, "no1": False, "no2": False}
    out = squad_v2_scores(preds, refs)
    assert out["exact"] == pytest.approx(50.0)
    assert out["HasAns_exact"] == pytest.approx(50.0) and out["HasAns_total"] == 2
    assert out["NoAns_exact"] == pytest.approx(50.0) and out["NoAns_total"] == 2
    assert "best_exact" not in out


def test_squad_v2_threshold_and_best_threshold():
    refs = {"has1": ["Paris"], "has2": ["blue whale"], "no1": [], "no2": []}
    preds = {"has1": "Paris", "has2": "whale", "no1": "", "no2": "London"}
    na_probs = {"has1": 0.1, "has2": 0.6, "no1": 0.7, "no2": 0.9}
    out = squad_v2_scores(preds, refs, na_probs, na_prob_thresh=0.8)
    # no2 (0.9 > 0.8) becomes "no answer" -> correct; the others keep their raw scores
    assert out["exact"] == pytest.approx(75.0)
    # Sweep (official find_best_thresh): start at 2 (all abstain); has1 +1 -> 3 (thresh 0.1);
    # has2 +0 -> 3; no1 +0 -> 3; no2 answered wrongly -1 -> 2.  Best 3/4 at 0.1.
    assert out["best_exact"] == pytest.approx(75.0)
    assert out["best_exact_thresh"] == pytest.approx(0.1)
    # F1 sweep: has2 adds 2/3 -> best 3.667/4 at 0.6
    assert out["best_f1"] == pytest.approx(100 * (3 + 2 / 3) / 4)
    assert out["best_f1_thresh"] == pytest.approx(0.6)


def test_squad_v2_gold_that_normalises_to_nothing_counts_as_no_answer():
    exact, f1, has = squad_v2_raw_scores({"q": ""}, {"q": ["The"]})
    assert exact["q"] == 1.0 and f1["q"] == 1.0 and has["q"] is True
