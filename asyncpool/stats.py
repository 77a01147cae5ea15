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

    With a ``KVPagePool`` (``kv=``), the ``pages_*`` figures are its pages
    the same way (``pages_free + pages_allocated + pages_pending +
    pages_quarantined == pages_capacity``; detached pages count as
    allocated), ``admits`` counts admissions granted and ``admit_wait``
    their waits (``wait_time`` is the waits of ``alloc``). Without it they
    are zero. With ``fence_timeout``, ``overdue_fences`` counts pending
    fences older than it and ``overdue_rows``/``overdue_pages`` what they
    hold (still held: see ``force_release``).
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
    pages_capacity: int = 0
    pages_free: int = 0
    pages_allocated: int = 0
    pages_pending: int = 0
    pages_quarantined: int = 0
    overdue_fences: int = 0
    overdue_rows: int = 0
    overdue_pages: int = 0
    admits: int = 0
    admit_wait: LatencySummary = field(default_factory=LatencySummary)
