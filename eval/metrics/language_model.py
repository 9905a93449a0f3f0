"""Masked-language-model accuracy and perplexity over the selected (labelled) positions only.

Why only labelled positions: the MLM loss mask is the *selection* (labels !=
-100), not ``input_ids == [MASK]`` — 10% of selected tokens are replaced at
random and 10% kept, and those are scored too.  Averaging over all positions
(or dividing by sequence length) is the classic bug that makes perplexity
look far better than it is.  Perplexity = exp(mean negative log-likelihood
over the selected targets), natural log.

Works on numpy arrays; pass ``tensor.detach().cpu().numpy()`` from torch.
Over a whole evaluation set use :class:`MLMAccumulator` so that the mean is
over targets, not a mean of batch means.
"""

from __future__ import annotations

import math

import numpy as np

IGNORE_INDEX = -100


def log_softmax(logits: np.ndarray, axis: int = -1) -> np.ndarray:
    """Numerically stable log-softmax (subtract the max before exp)."""
    x = np.asarray(logits, dtype=np.float64)
    shifted = x - x.max(axis=axis, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=axis, keepdims=True))


def _select(logits: np.ndarray, labels: np.ndarray, ignore_index: int) -> tuple[np.ndarray, np.ndarray]:
    logits = np.asarray(logits)
    labels = np.asarray(labels)
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {logits.shape} must be labels {labels.shape} plus a vocabulary axis")
    keep = labels != ignore_index  # (...) selected positions
    picked_logits = logits[keep]  # (M, V)
    picked_labels = labels[keep].astype(np.int64)  # (M,)
    if picked_labels.size and (picked_labels.min() < 0 or picked_labels.max() >= logits.shape[-1]):
        raise ValueError(f"a label is outside the vocabulary of size {logits.shape[-1]}")
    return picked_logits, picked_labels


def mlm_counts(
    logits: np.ndarray, labels: np.ndarray, ignore_index: int = IGNORE_INDEX
) -> tuple[float, int, int]:
    """``(sum of NLL, number correct, number of targets)`` for one batch.

    Args:
        logits: ``(..., V)`` scores over the vocabulary, e.g. ``(B, T, V)`` or ``(M, V)``.
        labels: ``(...)`` target ids, ``ignore_index`` where not selected.
    """
    picked, targets = _select(logits, labels, ignore_index)  # (M, V), (M,)
    if targets.size == 0:
        return 0.0, 0, 0
    logp = log_softmax(picked)  # (M, V)
    nll = -logp[np.arange(targets.size), targets]  # (M,)
    correct = int((picked.argmax(axis=-1) == targets).sum())
    return float(nll.sum()), correct, int(targets.size)


def mlm_accuracy(logits: np.ndarray, labels: np.ndarray, ignore_index: int = IGNORE_INDEX) -> float:
    """Share of selected positions whose arg-max prediction is the original token."""
    _, correct, count = mlm_counts(logits, labels, ignore_index)
    if count == 0:
        raise ValueError("no selected (labelled) position to score")
    return correct / count


def perplexity(mean_nll: float) -> float:
    """exp(mean NLL in nats); ``inf`` instead of an overflow error for hopeless models."""
    return math.exp(mean_nll) if mean_nll < 709.0 else math.inf


def mlm_perplexity(logits: np.ndarray, labels: np.ndarray, ignore_index: int = IGNORE_INDEX) -> float:
    """Perplexity over the selected positions of one batch."""
    nll, _, count = mlm_counts(logits, labels, ignore_index)
    if count == 0:
        raise ValueError("no selected (labelled) position to score")
    return perplexity(nll / count)


class MLMAccumulator:
    """Running MLM accuracy / perplexity over many batches, weighted by target count.

    Example:
        >>> acc = MLMAccumulator()
        >>> acc.update(np.array([[0.0, 5.0], [5.0, 0.0]]), np.array([1, -100]))
        >>> acc.count, acc.accuracy
        (1, 1.0)
    """

    def __init__(self, ignore_index: int = IGNORE_INDEX) -> None:
        self.ignore_index = ignore_index
        self.nll_sum = 0.0
        self.correct = 0
        self.count = 0

    def update(self, logits: np.ndarray, labels: np.ndarray) -> None:
        nll, correct, count = mlm_counts(logits, labels, self.ignore_index)
        self.nll_sum += nll
        self.correct += correct
        self.count += count

    def _need_targets(self) -> None:
        if self.count == 0:
            raise ValueError("no selected (labelled) position seen yet")

    @property
    def accuracy(self) -> float:
        self._need_targets()
        return self.correct / self.count

    @property
    def mean_nll(self) -> float:
        self._need_targets()
        return self.nll_sum / self.count

    @property
    def perplexity(self) -> float:
        return perplexity(self.mean_nll)
