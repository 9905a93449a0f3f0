"""The weight-selection rules the alpha_rules benchmark compares, on worked per-claim score tables."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))

from alpha_rules import choose, judge  # noqa: E402

GRID = [0.0, 0.5, 1.0]


def test_argmax_takes_the_best_mean_and_breaks_ties_by_the_rule():
    curves = np.array([[0.2, 0.6, 0.6], [0.4, 0.6, 0.6]])  # means 0.3, 0.6, 0.6: a tie at 0.5 and 1.0
    assert choose(curves, GRID, "argmax") == 2
    assert choose(curves, GRID, "argmax-low") == 1


def test_one_standard_error_shrinks_only_when_dev_cannot_tell_the_weights_apart():
    # Weight 1.0 is best by 0.05 on average, but the per-claim differences to 0.5 are +0.15 and -0.05:
    # their standard error is 0.1414 / sqrt(2) = 0.1, more than the 0.05 between the means.
    noisy = np.array([[0.0, 0.5, 0.65], [0.0, 0.6, 0.55]])
    assert choose(noisy, GRID, "argmax") == 2
    assert choose(noisy, GRID, "1se") == 1
    # The same means with consistent differences (+0.05 on both claims): no shrinking.
    steady = np.array([[0.0, 0.5, 0.55], [0.0, 0.6, 0.65]])
    assert choose(steady, GRID, "1se") == 2


def test_unknown_rule_is_refused():
    with pytest.raises(ValueError, match="unknown rule"):
        choose(np.zeros((2, 3)), GRID, "median")


def test_judge_scores_the_seen_choice_on_unseen_claims():
    # Seen claims prefer pure reranking; unseen claims lose with it: the transfer shows the loss.
    curves = np.array([[0.5, 0.7, 0.9], [0.5, 0.7, 0.9], [0.8, 0.7, 0.4], [0.8, 0.7, 0.4]])
    seen = np.array([True, True, False, False])
    out = judge(curves, seen, GRID, halves=10, seed=0)
    assert out["argmax"]["weight_seen_dev"] == 1.0
    assert out["argmax"]["unseen_gain"] == pytest.approx(-0.4)
    assert out["unseen_curve"] == {"0.0": 0.8, "0.5": 0.7, "1.0": 0.4}
