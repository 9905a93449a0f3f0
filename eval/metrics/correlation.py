"""Pearson and Spearman correlation (semantic textual similarity, score calibration checks).

Spearman is Pearson on average ranks (ties share the mean of their ranks), as
in ``scipy.stats.spearmanr``; the p-value of both is the two-sided t-test
with n - 2 degrees of freedom, as scipy computes it.  A constant input has no
correlation: statistic and p-value are NaN (scipy does the same, with a warning).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from twotower.eval.metrics.distributions import student_t_two_sided_p


class CorrelationResult(NamedTuple):
    statistic: float
    pvalue: float


def _pair(x: Sequence[float] | np.ndarray, y: Sequence[float] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    a = np.asarray(x, dtype=np.float64)
    b = np.asarray(y, dtype=np.float64)
    if a.ndim != 1 or a.shape != b.shape:
        raise ValueError(f"correlation needs two 1-d arrays of equal length, got {a.shape} and {b.shape}")
    if a.shape[0] < 2:
        raise ValueError("correlation needs at least 2 points")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ValueError("correlation inputs must be finite")
    return a, b


def average_ranks(x: Sequence[float] | np.ndarray) -> np.ndarray:
    """1-based ranks with ties given their mean rank (``scipy.stats.rankdata(method="average")``).  # (N,)"""
    values = np.asarray(x, dtype=np.float64)
    _, inverse, counts = np.unique(values, return_inverse=True, return_counts=True)
    starts = np.cumsum(counts) - counts  # (U,) 0-based first rank of each distinct value
    return (starts + (counts + 1) / 2.0)[inverse]


def _pvalue(r: float, n: int) -> float:
    if n < 3:
        return 1.0
    if abs(r) >= 1.0:
        return 0.0
    t = r * math.sqrt((n - 2) / ((1.0 - r) * (1.0 + r)))
    return student_t_two_sided_p(t, n - 2)


def pearson(x: Sequence[float] | np.ndarray, y: Sequence[float] | np.ndarray) -> CorrelationResult:
    """Pearson's r and its two-sided p-value."""
    a, b = _pair(x, y)
    da, db = a - a.mean(), b - b.mean()
    denom = math.sqrt(float(da @ da) * float(db @ db))
    if denom == 0.0:
        return CorrelationResult(math.nan, math.nan)
    r = max(-1.0, min(1.0, float(da @ db) / denom))
    return CorrelationResult(r, _pvalue(r, a.shape[0]))


def spearman(x: Sequence[float] | np.ndarray, y: Sequence[float] | np.ndarray) -> CorrelationResult:
    """Spearman's rho (Pearson on average ranks) and its two-sided p-value."""
    a, b = _pair(x, y)
    return pearson(average_ranks(a), average_ranks(b))
