"""Paired tests and the t distribution against scipy; correlations against scipy."""

from __future__ import annotations

import math

import numpy as np
import pytest

from twotower.eval.metrics import (
    average_ranks,
    betainc,
    paired_randomization_test,
    paired_t_test,
    pearson,
    spearman,
    student_t_sf,
    student_t_two_sided_p,
)

stats = pytest.importorskip("scipy.stats")
special = pytest.importorskip("scipy.special")


@pytest.mark.parametrize("a", [0.5, 1.0, 2.5, 30.0, 400.0])
@pytest.mark.parametrize("b", [0.5, 1.0, 7.0])
def test_betainc_matches_scipy(a, b):
    for x in [0.0, 1e-8, 0.01, 0.3, 0.5, 0.77, 0.999, 1.0]:
        assert betainc(a, b, x) == pytest.approx(float(special.betainc(a, b, x)), rel=1e-10, abs=1e-14)


@pytest.mark.parametrize("df", [1, 2, 5, 29, 299, 5000])
def test_student_t_matches_scipy(df):
    for t in [-8.0, -2.1, -0.3, 0.0, 0.4, 1.96, 3.5, 12.0]:
        assert student_t_two_sided_p(t, df) == pytest.approx(2 * stats.t.sf(abs(t), df), rel=1e-9, abs=1e-15)
        assert student_t_sf(t, df) == pytest.approx(stats.t.sf(t, df), rel=1e-9, abs=1e-15)


def test_paired_t_test_matches_scipy_ttest_rel():
    rng = np.random.default_rng(7)
    for n in (2, 3, 10, 50, 300):
        for shift in (0.0, 0.05, 0.3):
            a = rng.random(n)
            b = np.clip(a - shift + rng.normal(scale=0.2, size=n), 0, 1)
            ours = paired_t_test(a, b)
            ref = stats.ttest_rel(a, b)
            assert ours.statistic == pytest.approx(ref.statistic, rel=1e-10)
            assert ours.pvalue == pytest.approx(ref.pvalue, rel=1e-8, abs=1e-300)
            assert ours.mean_difference == pytest.approx(float(np.mean(a - b)))


def test_paired_t_test_identical_runs():
    a = [0.1, 0.5, 0.9]
    r = paired_t_test(a, a)
    assert (r.statistic, r.pvalue) == (0.0, 1.0)
    constant_gain = paired_t_test([1.0, 2.0], [0.5, 1.5])
    assert constant_gain.pvalue == 0.0 and constant_gain.statistic == math.inf


def test_randomization_exact_matches_scipy_permutation_test():
    rng = np.random.default_rng(3)

    def mean_diff(x, y, axis):
        return np.mean(x - y, axis=axis)

    for n in (4, 7, 11):
        a = rng.random(n)
        b = a - 0.1 + rng.normal(scale=0.15, size=n)
        ours = paired_randomization_test(a, b, n_resamples=10_000)
        ref = stats.permutation_test(
            (a, b), mean_diff, permutation_type="samples", vectorized=True, n_resamples=10_000
        )
        assert ours.pvalue == pytest.approx(ref.pvalue, abs=1e-12)


def test_randomization_sampled_is_seeded_and_close_to_scipy():
    rng = np.random.default_rng(11)
    a = rng.random(60)
    b = a - 0.03 + rng.normal(scale=0.15, size=60)
    first = paired_randomization_test(a, b, n_resamples=20_000, seed=5)
    again = paired_randomization_test(a, b, n_resamples=20_000, seed=5)
    assert first == again
    ref = stats.permutation_test(
        (a, b),
        lambda x, y, axis: np.mean(x - y, axis=axis),
        permutation_type="samples",
        vectorized=True,
        n_resamples=20_000,
        random_state=0,
    )
    assert abs(first.pvalue - ref.pvalue) < 0.02  # two Monte Carlo estimates of one p-value
    assert 0.0 < first.pvalue < 1.0


def test_randomization_extremes():
    same = paired_randomization_test([0.2, 0.4, 0.6, 0.8] * 20, [0.2, 0.4, 0.6, 0.8] * 20, n_resamples=999)
    assert same.pvalue == 1.0
    better = paired_randomization_test(np.ones(80), np.zeros(80), n_resamples=999)
    assert better.pvalue == pytest.approx(1 / 1000)  # only the observed assignment is as extreme


def test_paired_input_errors():
    with pytest.raises(ValueError, match="equal length"):
        paired_t_test([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="at least 2"):
        paired_randomization_test([1.0], [0.0])
    with pytest.raises(ValueError, match="finite"):
        paired_t_test([1.0, float("nan")], [0.0, 0.0])


def test_correlations_match_scipy():
    rng = np.random.default_rng(5)
    for n in (3, 10, 200):
        x = rng.normal(size=n)
        y = 0.5 * x + rng.normal(size=n)
        y_ties = np.round(y, 1)  # ties for Spearman
        assert len(set(y_ties)) > 1
        for ours, ref in (
            (pearson(x, y), stats.pearsonr(x, y)),
            (spearman(x, y_ties), stats.spearmanr(x, y_ties)),
        ):
            assert ours.statistic == pytest.approx(ref.statistic, rel=1e-10, abs=1e-12)
            assert ours.pvalue == pytest.approx(ref.pvalue, rel=1e-7, abs=1e-12)


def test_average_ranks_match_scipy():
    values = [3.0, 1.0, 3.0, 2.0, 3.0, -1.0]
    np.testing.assert_allclose(average_ranks(values), stats.rankdata(values))


def test_correlation_of_constant_is_nan():
    r = pearson([1.0, 1.0, 1.0], [1.0, 2.0, 3.0])
    assert math.isnan(r.statistic) and math.isnan(r.pvalue)
    assert pearson([1, 2, 3], [2, 4, 6]).statistic == pytest.approx(1.0)


@pytest.mark.parametrize("df", [1, 3, 29, 103, 299])
def test_student_t_ppf_matches_scipy(df):
    from twotower.eval.metrics import student_t_ppf

    for q in [0.001, 0.025, 0.3, 0.5, 0.8, 0.975, 0.9995]:
        assert student_t_ppf(q, df) == pytest.approx(float(stats.t.ppf(q, df)), rel=1e-8, abs=1e-10)
    with pytest.raises(ValueError, match="quantile level"):
        student_t_ppf(1.0, df)


@pytest.mark.parametrize("level", [0.9, 0.95, 0.99])
def test_paired_t_interval_matches_scipy(level):
    from twotower.eval.metrics import paired_t_interval

    rng = np.random.default_rng(3)
    a = rng.uniform(0, 1, 104)
    b = np.clip(a - 0.02 + rng.normal(0, 0.15, 104), 0, 1)
    ci = stats.ttest_rel(a, b).confidence_interval(confidence_level=level)
    low, high = paired_t_interval(a, b, level)
    assert (low, high) == pytest.approx((ci.low, ci.high), rel=1e-8)
    assert low < float(np.mean(a - b)) < high
