"""Single-label classification metrics: accuracy, per-class P/R/F1, macro/micro/weighted F1, confusion matrix.

Why per-class numbers are always computed: accuracy hides failure on rare
classes.  With 95 negatives and 5 positives, predicting "negative" for
everything scores 95% accuracy while the positive class has recall 0 —
``classification_report`` makes that visible (see the worked example in
``tests/eval/test_classification.py``).

Conventions follow scikit-learn so numbers are comparable: labels default to
the sorted union of true and predicted labels; precision/recall/F1 of a class
with no predictions / no support is 0 (``zero_division=0``); the confusion
matrix has true labels on rows and predictions on columns.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import NamedTuple

import numpy as np


def _safe_divide(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    num = np.asarray(num, dtype=np.float64)
    den = np.asarray(den, dtype=np.float64)
    out = np.zeros(np.broadcast(num, den).shape, dtype=np.float64)
    np.divide(num, den, out=out, where=den != 0)
    return out


def _f1(precision: np.ndarray, recall: np.ndarray) -> np.ndarray:
    return _safe_divide(2.0 * precision * recall, precision + recall)


def _check(y_true: Sequence[Hashable], y_pred: Sequence[Hashable]) -> None:
    if len(y_true) != len(y_pred):
        raise ValueError(f"y_true has {len(y_true)} items but y_pred has {len(y_pred)}")
    if len(y_true) == 0:
        raise ValueError("no examples to score")


def _labels(
    y_true: Sequence[Hashable], y_pred: Sequence[Hashable], labels: Sequence[Hashable] | None
) -> list:
    if labels is not None:
        if len(set(labels)) != len(labels):
            raise ValueError("labels contain duplicates")
        return list(labels)
    return sorted(set(y_true) | set(y_pred))  # type: ignore[type-var]


def _encode(values: Sequence[Hashable], names: list) -> np.ndarray:
    """Label -> column index, -1 for a label outside ``names``.  # (N,)"""
    index = {label: i for i, label in enumerate(names)}
    return np.array([index.get(v, -1) for v in values], dtype=np.int64)


def accuracy(y_true: Sequence[Hashable], y_pred: Sequence[Hashable]) -> float:
    """Share of exact matches."""
    _check(y_true, y_pred)
    return sum(t == p for t, p in zip(y_true, y_pred)) / len(y_true)


def confusion_matrix(
    y_true: Sequence[Hashable], y_pred: Sequence[Hashable], labels: Sequence[Hashable] | None = None
) -> np.ndarray:
    """Counts ``C[i, j]`` of examples with true label ``labels[i]`` predicted as ``labels[j]``.  # (C, C)

    Examples whose true or predicted label is not in ``labels`` are left out.
    """
    _check(y_true, y_pred)
    names = _labels(y_true, y_pred, labels)
    t, p = _encode(y_true, names), _encode(y_pred, names)
    both = (t >= 0) & (p >= 0)
    matrix = np.zeros((len(names), len(names)), dtype=np.int64)
    np.add.at(matrix, (t[both], p[both]), 1)
    return matrix


class ClassificationReport(NamedTuple):
    """Everything :func:`classification_report` computes; arrays follow ``labels`` order."""

    labels: list
    confusion: np.ndarray  # (C, C) rows = true, columns = predicted
    precision: np.ndarray  # (C,)
    recall: np.ndarray  # (C,)
    f1: np.ndarray  # (C,)
    support: np.ndarray  # (C,) number of true examples per class
    accuracy: float
    macro_precision: float
    macro_recall: float
    macro_f1: float
    micro_precision: float
    micro_recall: float
    micro_f1: float
    weighted_f1: float
    num_examples: int

    def per_class(self) -> dict:
        """``{label: {"precision", "recall", "f1", "support"}}`` (JSON-friendly)."""
        return {
            label: {
                "precision": float(self.precision[i]),
                "recall": float(self.recall[i]),
                "f1": float(self.f1[i]),
                "support": int(self.support[i]),
            }
            for i, label in enumerate(self.labels)
        }

    def format(self, digits: int = 4) -> str:
        """A plain-text table in the layout of scikit-learn's ``classification_report``."""
        names = [str(label) for label in self.labels] + ["macro avg", "micro avg", "weighted avg"]
        width = max(12, *(len(n) for n in names))
        head = f"{'':>{width}} {'precision':>10} {'recall':>10} {'f1':>10} {'support':>10}"
        lines = [head, ""]
        for i, name in enumerate(names[: len(self.labels)]):
            lines.append(
                f"{name:>{width}} {self.precision[i]:>10.{digits}f} {self.recall[i]:>10.{digits}f} "
                f"{self.f1[i]:>10.{digits}f} {int(self.support[i]):>10d}"
            )
        total = int(self.support.sum())
        weighted_p = float(_safe_divide((self.precision * self.support).sum(), total))
        weighted_r = float(_safe_divide((self.recall * self.support).sum(), total))
        lines += [
            "",
            f"{'accuracy':>{width}} {'':>10} {'':>10} {self.accuracy:>10.{digits}f} {self.num_examples:>10d}",
            f"{'macro avg':>{width}} {self.macro_precision:>10.{digits}f} {self.macro_recall:>10.{digits}f} "
            f"{self.macro_f1:>10.{digits}f} {total:>10d}",
            f"{'micro avg':>{width}} {self.micro_precision:>10.{digits}f} {self.micro_recall:>10.{digits}f} "
            f"{self.micro_f1:>10.{digits}f} {total:>10d}",
            f"{'weighted avg':>{width}} {weighted_p:>10.{digits}f} {weighted_r:>10.{digits}f} "
            f"{self.weighted_f1:>10.{digits}f} {total:>10d}",
        ]
        return "\n".join(lines)


def classification_report(
    y_true: Sequence[Hashable], y_pred: Sequence[Hashable], labels: Sequence[Hashable] | None = None
) -> ClassificationReport:
    """Per-class and averaged precision, recall and F1 plus accuracy and the confusion matrix.

    Args:
        y_true: gold labels, one per example.
        y_pred: predicted labels, same length.
        labels: classes to report, in order; default the sorted union of both.
            Micro/macro averages run over these classes only (scikit-learn's rule).

    Example:
        >>> r = classification_report(["a", "a", "b"], ["a", "b", "b"])
        >>> r.labels, r.recall.tolist(), round(r.macro_f1, 4)
        (['a', 'b'], [0.5, 1.0], 0.6667)
    """
    _check(y_true, y_pred)
    names = _labels(y_true, y_pred, labels)
    c = len(names)
    t, p = _encode(y_true, names), _encode(y_pred, names)  # (N,), (N,)
    tp = np.bincount(t[(t == p) & (t >= 0)], minlength=c).astype(np.float64)  # (C,)
    predicted = np.bincount(p[p >= 0], minlength=c).astype(np.float64)  # (C,)
    support = np.bincount(t[t >= 0], minlength=c).astype(np.int64)  # (C,)
    precision = _safe_divide(tp, predicted)
    recall = _safe_divide(tp, support)
    f1 = _f1(precision, recall)
    micro_p = float(_safe_divide(tp.sum(), predicted.sum()))
    micro_r = float(_safe_divide(tp.sum(), support.sum()))
    micro_f1 = float(_f1(np.array(micro_p), np.array(micro_r)))
    weighted_f1 = float(_safe_divide((f1 * support).sum(), support.sum()))
    return ClassificationReport(
        labels=names,
        confusion=confusion_matrix(y_true, y_pred, names),
        precision=precision,
        recall=recall,
        f1=f1,
        support=support,
        accuracy=accuracy(y_true, y_pred),
        macro_precision=float(precision.mean()) if len(names) else 0.0,
        macro_recall=float(recall.mean()) if len(names) else 0.0,
        macro_f1=float(f1.mean()) if len(names) else 0.0,
        micro_precision=micro_p,
        micro_recall=micro_r,
        micro_f1=micro_f1,
        weighted_f1=weighted_f1,
        num_examples=len(y_true),
    )


def misclassified(y_true: Sequence[Hashable], y_pred: Sequence[Hashable]) -> list[int]:
    """Indices of wrong predictions, so a report can show the examples themselves."""
    _check(y_true, y_pred)
    return [i for i, (t, p) in enumerate(zip(y_true, y_pred)) if t != p]
