"""Frozen statistics snapshots of a pool."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["LatencySummary", "PoolStats"]


@dataclass(frozen=True, slots=True)
class LatencySummary:
    """Summary of recent latencies in seconds (a bounded window of samples)."""

    count: int = 0
    mean_s: float = 0.0
    p50_s: float = 0.0
    p99_s: float = 0.0
    max_s: float = 0.0

    @classmethod
    def of(cls, samples: Iterable[float]) -> LatencySummary:
        data = sorted(samples)
        n = len(data)
        if not n:
            return cls()
        return cls(
            count=n,
            mean_s=sum(data) / n,
            p50_s=data[(n - 1) // 2],
            p99_s=data[min(n - 1, (n * 99) // 100)],
            max_s=data[-1],
        )


@dataclass(frozen=True, slots=True)
class PoolStats:
    """A snapshot of a pool's state and lifetime totals.

    ``free + allocated + pending + quarantined == capacity`` always holds.
    Rows only waiting on a fence count as ``pending``, not ``allocated``.
    """

    capacity: int
    free: int
    allocated: int
    pending: int
    quarantined: int
    waiters: int
    allocs: int
    frees: int
    deferred_frees: int
    reclaimed: int
    timeouts: int
    cancellations: int
    rejections: int
    peak_allocated: int
    resets: int = 0
    fence_errors: int = 0
    closed: bool = False
    released: bool = False
    wait_time: LatencySummary = field(default_factory=LatencySummary)
    fence_latency: LatencySummary = field(default_factory=LatencySummary)
