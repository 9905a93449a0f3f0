"""Request counts and latency percentiles since the server started, in bounded memory.

Latencies go into a histogram with geometric buckets (each 2 % wider than the one
before, from 10 µs to ~28 hours: 1,000 counters per route), so p50/p95/p99 "since start" need no
list of every request and are exact to within one bucket (± 1 %).  Routes are counted
by their template (``/documents/{doc_id}``), so the table cannot grow with the ids asked for.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

_MIN_S = 1e-5
_GROWTH = 1.02
_BUCKETS = 1000
_LOG_GROWTH = math.log(_GROWTH)
PERCENTILES = (50, 95, 99)


class LatencyHistogram:
    """Counts of durations in geometric buckets; percentiles are bucket centres (geometric mean of the edges)."""

    __slots__ = ("counts", "n", "total", "max")

    def __init__(self) -> None:
        self.counts = [0] * _BUCKETS
        self.n = 0
        self.total = 0.0
        self.max = 0.0

    @staticmethod
    def bucket(seconds: float) -> int:
        if seconds <= _MIN_S:
            return 0
        return min(_BUCKETS - 1, 1 + int(math.log(seconds / _MIN_S) / _LOG_GROWTH))

    def add(self, seconds: float) -> None:
        self.counts[self.bucket(seconds)] += 1
        self.n += 1
        self.total += seconds
        self.max = max(self.max, seconds)

    def percentile(self, p: float) -> float | None:
        """The p-th percentile in seconds (nearest rank), or None before the first sample."""
        if self.n == 0:
            return None
        rank = max(1, math.ceil(p / 100 * self.n))
        seen = 0
        for i, c in enumerate(self.counts):
            seen += c
            if seen >= rank:
                if i == 0:
                    return _MIN_S
                low = _MIN_S * _GROWTH ** (i - 1)
                return min(low * math.sqrt(_GROWTH), self.max)
        return self.max  # pragma: no cover - the counts add up to n

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"count": self.n}
        for p in PERCENTILES:
            v = self.percentile(p)
            out[f"p{p}_ms"] = None if v is None else round(v * 1000, 3)
        out["mean_ms"] = round(self.total / self.n * 1000, 3) if self.n else None
        out["max_ms"] = round(self.max * 1000, 3) if self.n else None
        return out


class RequestStats:
    """Per-route request counts by status class and latency histograms (thread-safe)."""

    def __init__(self) -> None:
        self.started = time.time()
        self._lock = threading.Lock()
        self._routes: dict[str, dict[str, Any]] = {}

    def record(self, route: str, status: int, seconds: float) -> None:
        with self._lock:
            r = self._routes.get(route)
            if r is None:
                r = self._routes[route] = {"statuses": {}, "latency": LatencyHistogram()}
            key = f"{status // 100}xx"
            r["statuses"][key] = r["statuses"].get(key, 0) + 1
            r["latency"].add(seconds)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            routes = {name: {"statuses": dict(r["statuses"]), **r["latency"].summary()}
                      for name, r in sorted(self._routes.items())}
        return {"uptime_s": round(time.time() - self.started, 3),
                "total": sum(r["count"] for r in routes.values()), "routes": routes}


class StatsMiddleware:
    """Time every HTTP request from its arrival to its last response byte, by route template."""

    def __init__(self, app: ASGIApp, stats: RequestStats) -> None:
        self.app = app
        self.stats = stats

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            route = scope.get("route")
            name = getattr(route, "path", None) or "(unmatched)"
            self.stats.record(f"{scope['method']} {name}", status, time.perf_counter() - start)
