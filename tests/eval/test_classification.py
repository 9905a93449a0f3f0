"""Classification metrics: the 95/5 worked example and parity with scikit-learn."""

from __future__ import annotations

import numpy as np
import pytest

from twotower.eval.metrics import accuracy, classification_report, confusion_matrix, misclassified


def test_majority_class_hides_minority_failure():
    """95 negatives, 5 positives, predict "neg" always: 95% accuracy, 0% minority recall."""
    y_true = ["neg"] * 95 + ["pos"] * 5
    y_pred = ["neg"] * 100
    r = classification_report(y_true, y_pred)
    assert r.labels == ["neg", "pos"]
    assert r.accuracy == pytest.approx(0.95)
    assert r.recall.tolist() == pytest.approx([1.0, 0.0])
    assert r.precision.tolist() == pytest.approx([0.95, 0.0])
    assert r.f1[0] == pytest.approx(2 * 0.95 / 1.95)
    assert r.f1[1] == 0.0
    assert r.macro_f1 == pytest.approx((2 * 0.95 / 1.95) / 2)  # ~0.487: the macro average shows the failure
    assert r.micro_f1 == pytest.approx(0.95)  # micro = accuracy for single-label tasks
    assert r.confusion.tolist() == [[95, 0], [5, 0]]
    assert r.support.tolist() == [95, 5]
    assert r.per_class()["pos"] == {"precision": 0.0, "recall": 0.0, "f1": 0.0, "support": 5}
    text = r.format()
    assert "pos" in text and "0.9500" in text and "macro avg" in text


def test_matches_sklearn_on_random_labels():
    metrics = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(0)
    for trial in range(20):
        n_classes = int(rng.integers(2, 7))
        y_true = rng.integers(0, n_classes, size=int(rng.integers(5, 200))).tolist()
        y_pred = rng.integers(
            0, n_classes + (trial % 2), size=len(y_true)
        ).tolist()  # sometimes an extra label
        r = classification_report(y_true, y_pred)
        p, rec, f, s = metrics.precision_recall_fscore_support(
            y_true, y_pred, labels=r.labels, zero_division=0
        )
        np.testing.assert_allclose(r.precision, p)
        np.testing.assert_allclose(r.recall, rec)
        np.testing.assert_allclose(r.f1, f)
        np.testing.assert_array_equal(r.support, s)
        for average in ("macro", "micro", "weighted"):
            ours = getattr(r, f"{average}_f1")
            assert ours == pytest.approx(metrics.f1_score(y_true, y_pred, average=average, zero_division=0))
        assert r.accuracy == pytest.approx(metrics.accuracy_score(y_true, y_pred))
        np.testing.assert_array_equal(r.confusion, metrics.confusion_matrix(y_true, y_pred, labels=r.labels))


def test_label_subset_follows_sklearn():
    metrics = pytest.importorskip("sklearn.metrics")
    y_true = ["a", "b", "c", "a", "c", "b", "a"]
    y_pred = ["a", "c", "c", "b", "a", "b", "a"]
    r = classification_report(y_true, y_pred, labels=["a", "c"])
    assert r.micro_f1 == pytest.approx(metrics.f1_score(y_true, y_pred, labels=["a", "c"], average="micro"))
    assert r.macro_f1 == pytest.approx(metrics.f1_score(y_true, y_pred, labels=["a", "c"], average="macro"))
    assert r.confusion.tolist() == metrics.confusion_matrix(y_true, y_pred, labels=["a", "c"]).tolist()


def test_helpers_and_errors():
    assert accuracy([1, 2, 3], [1, 0, 3]) == pytest.approx(2 / 3)
    assert misclassified(["x", "y", "z"], ["x", "z", "z"]) == [1]
    assert confusion_matrix([0, 1], [1, 1]).tolist() == [[0, 1], [0, 1]]
    with pytest.raises(ValueError, match="2 items"):
        accuracy([1, 2], [1])
    with pytest.raises(ValueError, match="no examples"):
        classification_report([], [])
    with pytest.raises(ValueError, match="duplicates"):
        classification_report([1], [1], labels=[1, 1])
