"""Latency percentiles from the bounded histogram agree with exact percentiles; error field names."""

from __future__ import annotations

import math

import numpy as np
import pytest

from twotower.serve.errors import field_name
from twotower.serve.stats import LatencyHistogram, RequestStats


@pytest.mark.parametrize("seed", [0, 1])
def test_percentiles_match_numpy_within_one_bucket(seed):
    rng = np.random.default_rng(seed)
    samples = np.concatenate([rng.lognormal(math.log(0.02), 0.6, 5000), rng.uniform(0.2, 2.0, 100)])  # seconds
    h = LatencyHistogram()
    for s in samples:
        h.add(float(s))
    for p in (50, 95, 99):
        exact = float(np.percentile(samples, p, method="inverted_cdf"))  # nearest rank, as the histogram
        assert h.percentile(p) == pytest.approx(exact, rel=0.011)
    s = h.summary()
    assert s["count"] == len(samples)
    assert s["max_ms"] == pytest.approx(samples.max() * 1000, abs=1e-3)
    assert s["mean_ms"] == pytest.approx(samples.mean() * 1000, abs=1e-3)


def test_histogram_edges():
    h = LatencyHistogram()
    assert h.percentile(50) is None and h.summary()["p99_ms"] is None
    h.add(0.0)
    h.add(1e9)  # beyond the last bucket: counted there, never past the maximum seen
    assert h.percentile(1) == pytest.approx(1e-5) and h.percentile(100) <= 1e9
    assert [LatencyHistogram.bucket(x) for x in (1e-6, 1e-4, 1e-3, 1e-2)] == sorted(
        LatencyHistogram.bucket(x) for x in (1e-6, 1e-4, 1e-3, 1e-2))


def test_request_stats_count_by_route_and_status_class():
    st = RequestStats()
    for status in (200, 200, 404, 503):
        st.record("GET /search", status, 0.01)
    snap = st.snapshot()
    assert snap["total"] == 4
    assert snap["routes"]["GET /search"]["statuses"] == {"2xx": 2, "4xx": 1, "5xx": 1}


def test_field_names_read_as_the_client_wrote_them():
    assert field_name(("body", "documents", 3, "text")) == "documents[3].text"
    assert field_name(("query", "k")) == "k"
    assert field_name(("body",)) == "body"
    assert field_name(("body", "queries", 0)) == "queries[0]"
