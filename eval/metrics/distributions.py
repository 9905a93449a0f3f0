"""Student's t tail probabilities without scipy, via the regularized incomplete beta function.

Why not import scipy: ``twotower.eval.metrics`` is pure numpy by design (it is the one
package everything else may import without pulling in heavy dependencies).
The t distribution is needed for the paired t-test and for the p-values of
Pearson / Spearman correlations; both reduce to

    P(|T| >= t) = I_x(df / 2, 1 / 2),   x = df / (df + t^2)

with ``I`` evaluated by the Lentz continued fraction of Numerical Recipes
(Press et al., 3rd ed., §6.4).  Tests compare against ``scipy.special.betainc``
and ``scipy.stats.t``.
"""

from __future__ import annotations

import math

_TINY = 1e-300
_EPS = 1e-16
_MAX_ITER = 100_000


def _beta_continued_fraction(a: float, b: float, x: float) -> float:
    """Continued fraction for I_x(a, b) (modified Lentz); converges fast for x < (a+1)/(a+b+2)."""
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c = 1.0
    d = 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > _TINY else _TINY)
    h = d
    for m in range(1, _MAX_ITER + 1):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))  # even step
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > _TINY else _TINY)
        c = 1.0 + aa / c
        c = c if abs(c) > _TINY else _TINY
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))  # odd step
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > _TINY else _TINY)
        c = 1.0 + aa / c
        c = c if abs(c) > _TINY else _TINY
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < _EPS:
            return h
    raise ArithmeticError(f"incomplete beta did not converge for a={a}, b={b}, x={x}")  # pragma: no cover


def betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta function I_x(a, b) for a, b > 0 and 0 <= x <= 1."""
    if a <= 0 or b <= 0:
        raise ValueError("betainc needs a > 0 and b > 0")
    if not 0.0 <= x <= 1.0:
        raise ValueError("betainc needs 0 <= x <= 1")
    if x == 0.0 or x == 1.0:
        return x
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    # Use the symmetry I_x(a, b) = 1 - I_{1-x}(b, a) where the fraction converges faster.
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_continued_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_continued_fraction(b, a, 1.0 - x) / b


def student_t_two_sided_p(t: float, df: float) -> float:
    """P(|T| >= |t|) for Student's t with ``df`` degrees of freedom (1.0 at t = 0, 0.0 at |t| = inf)."""
    if df <= 0:
        raise ValueError("degrees of freedom must be positive")
    if math.isnan(t):
        return math.nan
    if math.isinf(t):
        return 0.0
    return min(1.0, betainc(df / 2.0, 0.5, df / (df + t * t)))


def student_t_sf(t: float, df: float) -> float:
    """One-sided upper tail P(T >= t)."""
    half = 0.5 * student_t_two_sided_p(t, df)
    return half if t >= 0 else 1.0 - half


def student_t_ppf(q: float, df: float) -> float:
    """The t with P(T <= t) = q (``scipy.stats.t.ppf``), by bisection on `student_t_sf`.

    Why bisection: the CDF is monotone and cheap here, and confidence intervals need only a few quantiles.
    """
    if not 0.0 < q < 1.0:
        raise ValueError(f"quantile level must be in (0, 1), got {q}")
    if q == 0.5:
        return 0.0
    if q < 0.5:
        return -student_t_ppf(1.0 - q, df)
    lo, hi = 0.0, 1.0
    while 1.0 - student_t_sf(hi, df) < q:  # grow until the bracket holds the quantile
        lo, hi = hi, hi * 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if 1.0 - student_t_sf(mid, df) < q:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)
