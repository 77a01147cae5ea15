"""An optional Prometheus collector for a pool's statistics.

Needs the ``metrics`` extra (``prometheus-client``)::

    from prometheus_client import REGISTRY
    from asyncpool.metrics import PoolCollector
    REGISTRY.register(PoolCollector(pool, name="decode"))

The collector reads ``pool.stats()`` at scrape time. Scrapes usually run on
another thread (the HTTP server's); ``stats()`` only reads ints and copies
bounded sample windows, so a scrape never mutates the pool, but its numbers
may be a few operations apart from one another.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from .stats import PoolStats

__all__ = ["PoolCollector"]


class _HasStats(Protocol):
    def stats(self) -> PoolStats: ...


_GAUGES = {
    "capacity": "Rows that can be handed out (size - 1).",
    "free": "Rows free right now.",
    "allocated": "Rows held by requests.",
    "pending": "Rows freed but waiting for their fences.",
    "quarantined": "Rows kept out of circulation after a fence faulted.",
    "waiters": "alloc() calls queued.",
    "peak_allocated": "Most rows held at once.",
}
_COUNTERS = {
    "allocs": "Rows handed out.",
    "frees": "Rows given back.",
    "deferred_frees": "Rows whose free waited for a fence.",
    "reclaimed": "Rows returned to circulation by completed fences.",
    "timeouts": "alloc() calls that timed out.",
    "cancellations": "alloc() calls cancelled while waiting.",
    "rejections": "alloc() calls refused because max_waiters queued.",
    "fence_errors": "Fences that faulted.",
    "resets": "Bulk row resets (one vectorised op each).",
}


class PoolCollector:
    """A ``prometheus_client`` custom collector for one pool."""

    def __init__(self, pool: _HasStats, name: str = "default", prefix: str = "asyncpool") -> None:
        self._pool = pool
        self._name = name
        self._prefix = prefix

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats = self._pool.stats()
        labels = ["pool"]
        for field, doc in _GAUGES.items():
            gauge = GaugeMetricFamily(f"{self._prefix}_{field}", doc, labels=labels)
            gauge.add_metric([self._name], float(getattr(stats, field)))
            yield gauge
        for field, doc in _COUNTERS.items():
            counter = CounterMetricFamily(f"{self._prefix}_{field}", doc, labels=labels)
            counter.add_metric([self._name], float(getattr(stats, field)))
            yield counter
        for summary_name in ("wait_time", "fence_latency"):
            summary = getattr(stats, summary_name)
            gauge = GaugeMetricFamily(
                f"{self._prefix}_{summary_name}_seconds",
                f"Recent {summary_name.replace('_', ' ')} quantiles (bounded sample window).",
                labels=[*labels, "quantile"],
            )
            gauge.add_metric([self._name, "0.5"], summary.p50_s)
            gauge.add_metric([self._name, "0.99"], summary.p99_s)
            gauge.add_metric([self._name, "max"], summary.max_s)
            yield gauge
