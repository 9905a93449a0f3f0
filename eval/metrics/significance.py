"""Paired significance tests between two systems scored on the same queries.

Why both: the paired t-test is what most IR papers report and is cheap; the
paired randomization (sign-flip permutation) test makes no normality
assumption about per-query differences, which for bounded, often bimodal
metrics such as MRR is the safer choice (Smucker, Allan & Carterette, CIKM
2007).  Both take per-query values in the same query order, e.g.
``RetrievalEvaluation.column("ndcg@10")`` of two runs evaluated on one qrels.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from twotower.eval.metrics.distributions import student_t_ppf, student_t_two_sided_p


class SignificanceResult(NamedTuple):
    """``statistic``: t for the t-test, mean(a - b) for the randomization test; ``pvalue`` two-sided."""

    statistic: float
    pvalue: float
    mean_difference: float
    n: int


def _paired(a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray) -> np.ndarray:
    x = np.asarray(a, dtype=np.float64)
    y = np.asarray(b, dtype=np.float64)
    if x.ndim != 1 or x.shape != y.shape:
        raise ValueError(f"paired test needs two 1-d arrays of equal length, got {x.shape} and {y.shape}")
    if x.shape[0] < 2:
        raise ValueError("paired test needs at least 2 paired values")
    if not (np.isfinite(x).all() and np.isfinite(y).all()):
        raise ValueError("paired test values must be finite")
    return x - y  # (Q,)


def paired_t_test(a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray) -> SignificanceResult:
    """Two-sided paired t-test (same statistic and p-value as ``scipy.stats.ttest_rel``).

    When every difference is 0 scipy returns NaN; we return t = 0, p = 1
    ("no evidence of a difference"), which is what a report should show.
    """
    diff = _paired(a, b)
    n = diff.shape[0]
    mean = float(diff.mean())
    sd = float(diff.std(ddof=1))
    if sd == 0.0:
        if mean == 0.0:
            return SignificanceResult(0.0, 1.0, 0.0, n)
        return SignificanceResult(math.copysign(math.inf, mean), 0.0, mean, n)
    t = mean / (sd / math.sqrt(n))
    return SignificanceResult(t, student_t_two_sided_p(t, n - 1), mean, n)


def paired_t_interval(a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray,
                      level: float = 0.95) -> tuple[float, float]:
    """Confidence interval of mean(a - b) from the paired t-test (``ttest_rel(a, b).confidence_interval(level)``).

    Why an interval next to the p-value: a goal such as "at least +0.02" is met with confidence only when the
    interval's low end clears it, and a gain that falls short can still be consistent with the goal.
    """
    if not 0.0 < level < 1.0:
        raise ValueError(f"confidence level must be in (0, 1), got {level}")
    diff = _paired(a, b)
    n = diff.shape[0]
    mean = float(diff.mean())
    half = student_t_ppf(0.5 + level / 2.0, n - 1) * float(diff.std(ddof=1)) / math.sqrt(n)
    return mean - half, mean + half


def paired_randomization_test(
    a: Sequence[float] | np.ndarray,
    b: Sequence[float] | np.ndarray,
    *,
    n_resamples: int = 10_000,
    seed: int | None = 0,
    batch_size: int = 1_000,
) -> SignificanceResult:
    """Two-sided paired randomization test on the mean difference.

    Under the null the label "system A" / "system B" of each query is
    exchangeable, so each per-query difference keeps or flips its sign with
    probability 1/2.  p = share of sign assignments whose |mean| is at least
    the observed |mean|.

    * If ``2**n <= n_resamples`` every assignment is enumerated (exact p,
      equal to ``scipy.stats.permutation_test(..., permutation_type="samples")``).
    * Otherwise ``n_resamples`` random assignments are drawn with ``seed`` and
      p = (count + 1) / (n_resamples + 1), which counts the observed
      assignment and so never returns 0 (Phipson & Smyth 2010).
    """
    diff = _paired(a, b)
    n = diff.shape[0]
    observed = float(diff.mean())
    # Sums of the same numbers in another order differ in the last bits: allow for it.
    threshold = abs(observed) * (1.0 - 1e-12) - 1e-15
    if n_resamples <= 0:
        raise ValueError("n_resamples must be positive")
    if n < 63 and 2**n <= n_resamples:
        codes = np.arange(2**n, dtype=np.int64)[:, None]  # (2^n, 1)
        signs = 1.0 - 2.0 * ((codes >> np.arange(n, dtype=np.int64)) & 1)  # (2^n, n)
        count = int((np.abs(signs @ diff) / n >= threshold).sum())
        return SignificanceResult(observed, count / 2**n, observed, n)
    rng = np.random.default_rng(seed)
    count = 0
    done = 0
    while done < n_resamples:
        m = min(batch_size, n_resamples - done)
        signs = rng.integers(0, 2, size=(m, n), dtype=np.int8) * 2.0 - 1.0  # (m, n)
        count += int((np.abs(signs @ diff) / n >= threshold).sum())
        done += m
    return SignificanceResult(observed, (count + 1) / (n_resamples + 1), observed, n)
