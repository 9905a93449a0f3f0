"""MLM accuracy / perplexity over selected positions, checked against torch cross-entropy."""

from __future__ import annotations

import math

import numpy as np
import pytest

from twotower.eval.metrics import MLMAccumulator, log_softmax, mlm_accuracy, mlm_perplexity, perplexity


def test_worked_example_from_design_notes():
    """Targets with probabilities 0.8 and 0.25: mean NLL 0.804719, never divided by all 7 positions."""
    vocab = 9
    labels = np.array([[-100, -100, 5, -100, 7, -100, -100]])  # (1, 7)
    probs = np.full((1, 7, vocab), 1e-3)
    probs[0, 2, 5], probs[0, 2, 0] = 0.8, 0.2 - 7e-3
    probs[0, 4, 7], probs[0, 4, 8] = 0.25, 0.75 - 7e-3
    logits = np.log(probs)  # softmax(log p) = p because each row sums to 1
    assert mlm_perplexity(logits, labels) == pytest.approx(math.exp(0.804719), rel=1e-5)
    assert mlm_accuracy(logits, labels) == 0.5  # position 2 right, position 4 predicts 8


def test_matches_torch_cross_entropy():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(13, 7, 99)) * 3  # (B, T, V)
    labels = rng.integers(0, 99, size=(13, 7))
    labels[rng.random((13, 7)) < 0.85] = -100
    loss = torch.nn.functional.cross_entropy(
        torch.from_numpy(logits).reshape(-1, 99), torch.from_numpy(labels).reshape(-1), ignore_index=-100
    )
    assert mlm_perplexity(logits, labels) == pytest.approx(math.exp(loss.item()), rel=1e-9)
    keep = labels != -100
    assert mlm_accuracy(logits, labels) == pytest.approx((logits.argmax(-1)[keep] == labels[keep]).mean())


def test_accumulator_weights_by_targets_not_batches():
    rng = np.random.default_rng(1)
    a_logits, b_logits = rng.normal(size=(4, 11)), rng.normal(size=(10, 11))
    a_labels = np.array([1, -100, -100, -100])
    b_labels = rng.integers(0, 11, size=10)
    acc = MLMAccumulator()
    acc.update(a_logits, a_labels)
    acc.update(b_logits, b_labels)
    joint = mlm_perplexity(np.concatenate([a_logits, b_logits]), np.concatenate([a_labels, b_labels]))
    assert acc.count == 11
    assert acc.perplexity == pytest.approx(joint)


def test_errors_and_helpers():
    with pytest.raises(ValueError, match="no selected"):
        mlm_accuracy(np.zeros((2, 3)), np.array([-100, -100]))
    with pytest.raises(ValueError, match="vocabulary"):
        mlm_accuracy(np.zeros((2, 3)), np.array([3, -100]))
    with pytest.raises(ValueError, match="plus a vocabulary axis"):
        mlm_accuracy(np.zeros((2, 3)), np.array([1, 1, 1]))
    with pytest.raises(ValueError, match="no selected"):
        _ = MLMAccumulator().perplexity
    assert perplexity(1000.0) == math.inf
    np.testing.assert_allclose(np.exp(log_softmax(np.array([[1000.0, 1000.0]]))), [[0.5, 0.5]])
