"""Frozen statistics snapshots of a pool, and the fixed-bucket histogram.

Two kinds of latency figures live side by side:

* :class:`Histogram` counts *every* observation over the pool's life into
  fixed buckets (cumulative ``_bucket``/``_count``/``_sum`` for Prometheus,
  aggregatable across pools and over time);
* :class:`LatencySummary` summarises a bounded window of *recent* samples
  (percentiles for ``stats()`` and logs; not aggregatable).
"""

from __future__ import annotations

import itertools
import math
from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

if TYPE_CHECKING:
    from .kv_pages import KVGroupStats

__all__ = [
    "DEFAULT_BOUNDS_S",
    "MAX_PRIORITIES",
    "FrozenDict",
    "Histogram",
    "HistogramSnapshot",
    "LatencySummary",
    "PoolStats",
    "PriorityStats",
]

#: The most distinct priorities whose figures a pool keeps apart
#: (:attr:`PoolStats.by_priority`, the metrics' ``priority`` label): the
#: first this many priorities the pool's calls queue (or are refused) at.
#: Priorities are the caller's ints, so this bounds the memory and the
#: metrics' series; the calls of every later priority are counted together
#: in :attr:`PoolStats.other_priorities` (``priority="other"``).
MAX_PRIORITIES = 16

#: Bucket upper bounds (seconds) for scheduler latencies: 1, 2.5 and 5 per
#: decade from 10 µs to 10 s (19 bounds; ``+Inf`` is implicit). A zero wait
#: (an allocation granted without queueing) lands in the first bucket.
DEFAULT_BOUNDS_S: tuple[float, ...] = (
    1e-5,
    2.5e-5,
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


@dataclass(frozen=True, slots=True)
class HistogramSnapshot:
    """A histogram frozen at one moment.

    ``bounds`` are the buckets' inclusive upper bounds in seconds (ascending;
    the ``+Inf`` bucket is implied). ``counts`` holds one count per bucket,
    *not* cumulative, with the ``+Inf`` bucket's last: ``len(counts) ==
    len(bounds) + 1``. ``count`` is the number of observations (always
    ``sum(counts)``) and ``sum_s`` their total in seconds.
    """

    bounds: tuple[float, ...] = DEFAULT_BOUNDS_S
    counts: tuple[int, ...] = (0,) * (len(DEFAULT_BOUNDS_S) + 1)
    count: int = 0
    sum_s: float = 0.0

    def cumulative(self) -> list[tuple[float, int]]:
        """Cumulative ``(upper bound, count)`` pairs, as Prometheus exposes them.

        The last pair is ``(inf, count)``.
        """
        out: list[tuple[float, int]] = []
        total = 0
        for bound, c in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += c
            out.append((bound, total))
        return out


class Histogram:
    """Counts of observations in fixed buckets, plus their count and sum.

    ``observe(value)`` costs one ``bisect`` into :attr:`bounds` and three
    adds; keep it off the per-call fast path (count zero-valued events in a
    plain int instead and pass it as ``zeros`` to :meth:`snapshot`).

    Thread rules: observe from one thread (the pool's). :meth:`snapshot` may
    run on another (a metrics scrape): it copies the counts in one C-level
    step, so the snapshot's buckets and count agree with each other; its
    ``sum_s`` may be one observation apart.
    """

    __slots__ = ("_counts", "_sum", "bounds")

    def __init__(self, bounds: Sequence[float] = DEFAULT_BOUNDS_S) -> None:
        b = tuple(float(x) for x in bounds)
        if (
            not b
            or not all(math.isfinite(x) for x in b)
            or any(not lo < hi for lo, hi in itertools.pairwise(b))
        ):
            raise ValueError(
                f"histogram bounds must be finite, increasing and not empty (+Inf is "
                f"implicit), got {bounds!r}"
            )
        self.bounds: tuple[float, ...] = b
        self._counts = [0] * (len(b) + 1)
        self._sum = 0.0

    def observe(self, value: float) -> None:
        """Count ``value`` into the first bucket whose bound is >= it.

        The grant loop (:mod:`asyncpool.waiters`) inlines these two lines.
        """
        self._counts[bisect_left(self.bounds, value)] += 1
        self._sum += value

    def snapshot(self, zeros: int = 0) -> HistogramSnapshot:
        """A frozen copy, with ``zeros`` extra observations of 0.0 folded in.

        ``zeros`` lets a hot path count zero-valued events (allocations that
        never waited) with one integer add and still have them in the
        histogram. Never mutates the histogram.
        """
        counts = list(self._counts)  # one C-level copy: consistent buckets
        if zeros:
            counts[0] += zeros
        return HistogramSnapshot(self.bounds, tuple(counts), sum(counts), self._sum)


@dataclass(frozen=True, slots=True)
class LatencySummary:
    """Summary of recent latencies in seconds (a bounded window of samples).

    ``count`` is the number of samples in the window (not a lifetime total:
    see the histograms for that); ``mean_s``, ``p50_s``, ``p99_s`` and
    ``max_s`` are in seconds (nearest-rank percentiles), all 0.0 when empty.
    """

    count: int = 0
    mean_s: float = 0.0
    p50_s: float = 0.0
    p99_s: float = 0.0
    max_s: float = 0.0

    @classmethod
    def of(cls, samples: Iterable[float]) -> LatencySummary:
        """The summary of ``samples`` (seconds); all zeros for none."""
        data = sorted(samples)
        n = len(data)
        if not n:
            return cls()
        return cls(
            count=n,
            mean_s=sum(data) / n,
            p50_s=data[(n - 1) // 2],
            # nearest rank: the ceil(0.99 n)-th sample (1-based)
            p99_s=data[(n * 99 + 99) // 100 - 1],
            max_s=data[-1],
        )


_K = TypeVar("_K")
_V = TypeVar("_V")


class FrozenDict(dict[_K, _V]):
    """A ``dict`` that refuses every change (``TypeError``) and hashes.

    What a frozen snapshot holds where it needs a mapping
    (:attr:`PoolStats.kv_groups`): read it as any ``Mapping``. A ``dict``
    subclass rather than a ``MappingProxyType`` so that
    ``dataclasses.asdict``, ``copy`` and ``pickle`` handle the snapshot
    holding it (they copy a mapping proxy's contents through pickling, which
    it refuses). Hashable when its values are, as the frozen dataclasses
    that hold it; equal to any ``dict`` with the same items.
    """

    __slots__ = ()

    # Every change refused, each declared with its own signature (a method
    # assigned from one helper is an untyped override to type checkers).

    def _refuse(self) -> NoReturn:
        raise TypeError(f"{type(self).__name__} is read-only (a snapshot)")

    def __setitem__(self, key: _K, value: _V, /) -> NoReturn:
        self._refuse()

    def __delitem__(self, key: _K, /) -> NoReturn:
        self._refuse()

    def __ior__(self, other: Any, /) -> NoReturn:  # type: ignore[misc]  # (``|`` builds a dict)
        self._refuse()

    def clear(self) -> NoReturn:
        self._refuse()

    def pop(self, *args: Any) -> NoReturn:
        """Refused: read-only."""
        self._refuse()

    def popitem(self) -> NoReturn:
        self._refuse()

    def setdefault(self, *args: Any) -> NoReturn:
        """Refused: read-only."""
        self._refuse()

    def update(self, *args: Any, **kwargs: Any) -> NoReturn:
        """Refused: read-only."""
        self._refuse()

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(frozenset(self.items()))

    def __reduce__(self) -> tuple[Any, ...]:
        # copy and pickle rebuild it whole, never item by item (refused).
        return (type(self), (dict(self),))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({dict.__repr__(self)})"


@dataclass(frozen=True, slots=True)
class PriorityStats:
    """One priority's figures over the pool's life (:attr:`PoolStats.by_priority`).

    Attributes:
        wait_histogram: the waits (seconds, from queueing to grant) of the
            ``alloc`` calls at this priority that queued. Unlike the pool's
            ``wait_histogram`` it has no zero waits of calls granted without
            queueing: those cost the hot path nothing, so it does not know
            their priorities. The pool's ``wait_histogram`` less its zero
            waits is the sum over the priorities (``other_priorities``
            included).
        admit_wait_histogram: the same for ``admit`` calls.
        timeouts: calls at this priority that raised ``TimeoutError`` from
            their own ``timeout=`` (as the pool's ``timeouts``).
        cancellations: calls at this priority cancelled while queued, or
            after their grant before they resumed (as the pool's
            ``cancellations``).
        rejections: calls at this priority refused with ``PoolBusyError``
            past ``max_waiters`` (as the pool's ``rejections``: load shed).
        unfittable: calls at this priority that raised ``CapacityError``
            because they can never be served (as the pool's ``unfittable``).

    The pool's ``timeouts``, ``cancellations``, ``rejections`` and
    ``unfittable`` are the sums of these over the priorities
    (``other_priorities`` included).
    """

    wait_histogram: HistogramSnapshot = field(default_factory=HistogramSnapshot)
    admit_wait_histogram: HistogramSnapshot = field(default_factory=HistogramSnapshot)
    timeouts: int = 0
    cancellations: int = 0
    rejections: int = 0
    unfittable: int = 0


#: The ``by_priority`` of a pool whose calls never queued: one shared empty
#: mapping.
NO_PRIORITIES: FrozenDict[int, PriorityStats] = FrozenDict()


#: The ``kv_groups`` of a pool without KV groups: one shared empty mapping,
#: so that ``stats()`` of such a pool builds nothing more than before.
NO_GROUPS: FrozenDict[str, Any] = FrozenDict()


@dataclass(frozen=True, slots=True)
class PoolStats:
    """A snapshot of a pool's state and lifetime totals.

    ``free + allocated + pending + quarantined == capacity`` always holds.
    Rows only waiting on a fence count as ``pending``, not ``allocated``.
    Counts of rows are in rows, of calls in calls; totals (``deferred_frees``
    ... ``fence_errors``, ``alloc_calls``, ``rows_granted``) only grow over
    the pool's life. ``allocs`` and ``frees`` are the exception: rows that a
    waiter cancelled after its grant gives back leave ``allocs`` (they were
    never used), so both can step back; ``rows_granted`` and the metrics'
    counters never do.

    Attributes:
        capacity: rows that can ever be handed out (``size - 1``; row 0 is
            reserved padding).
        free: rows free right now, ready to hand out.
        allocated: rows held by requests right now.
        pending: rows freed but waiting for their fences to complete.
        quarantined: rows kept out of circulation because a fence faulted.
        waiters: ``alloc`` and ``admit`` calls queued right now (0 for the
            sync pool).
        allocs: rows handed out, total. Rows granted to a waiter that was
            cancelled before it resumed (and gave them back) are not counted.
        frees: rows given back by requests, total (``allocs - allocated``).
        deferred_frees: rows whose free had to wait for a fence, total.
        reclaimed: rows returned to circulation by completed fences, total
            (not those ``force_release`` returned: ``force_released``)
            (rows released by ``force_release`` count as if their fence had
            completed, as they do in the fence-latency figures).
        timeouts: ``alloc`` and ``admit`` calls that raised ``TimeoutError``
            from their own ``timeout=``, total (one waiter queue serves both).
            A call timed out from outside (``asyncio.wait_for``,
            ``asyncio.timeout``) is cancelled: it counts in ``cancellations``.
        cancellations: ``alloc`` and ``admit`` calls cancelled while queued
            (or after their grant, before they resumed: what they were granted
            was given back), total.
        rejections: ``alloc`` and ``admit`` calls refused with
            ``PoolBusyError`` because ``max_waiters`` calls already queued, total.
        unfittable: ``alloc`` and ``admit`` calls that raised
            ``CapacityError`` because they can never be served, total: they
            ask more rows or pages than the pool (a KV group) has, or than
            quarantine leaves it, refused at once or failed while queued
            when quarantine grew. Each such call counts once (one cancelled
            before it resumes raises ``CancelledError``, and counts in
            ``cancellations``); counts that are not integers >= 1 (>= 0 for
            pages) are bad input and not counted, nor are ``try_`` calls
            (0 for the sync pool).
        peak_allocated: the most rows ever held at once.
        resets: bulk row resets, total (one vectorised tensor op each).
        fence_errors: fences that faulted, total (their rows quarantined).
        closed: ``close()`` was called.
        released: the memory region is released (``release_memory()`` has
            returned; False while it still drains fences).
        grants_held: a ``hold_grants()`` hold is held: queued waiters get
            nothing until it is released (a hold never released starves
            them; this says so).
        grant_holds: how many ``hold_grants()`` holds are held (they nest;
            ``grants_held`` is ``grant_holds > 0``): a count that stays up
            after every holder thinks it released names a leaked hold.
        wait_time: percentiles (seconds) of the recent window of queued
            allocations' waits, from queueing to grant; allocations granted
            without queueing are not in the window. Empty when ``stats``
            was asked for no summaries.
        fence_latency: percentiles (seconds) of the recent window of fence
            latencies, from a deferred free to the reclaim that saw its fence
            complete. Empty when ``stats`` was asked for no summaries.
        alloc_calls: allocation calls that were granted rows, total
            (``alloc``, successful ``try_alloc``, the sync pool's successful
            ``alloc``); equals ``wait_histogram.count``. A waiter granted
            rows and cancelled before it resumed is counted here (it was
            granted) and in ``cancellations``.
        wait_histogram: every granted allocation's wait in seconds, from the
            call (or its queueing) to its grant; one granted without
            queueing counts as a zero wait. Timed-out, cancelled-while-queued
            and rejected calls are not in it (see their counters).
        fence_latency_histogram: every completed fence batch's latency in
            seconds, from the deferred free to the reclaim that saw the fence
            complete (the same figure as ``fence_latency``, for every batch).
        rows_granted: rows handed out, total, counting those a waiter
            cancelled after its grant gave back (unlike ``allocs``, it never
            decreases: the ``rows_allocated`` counter of the metrics).
        pages_capacity: pages the pool's ``KVPagePool`` (``kv=``) can hand
            out (``num_pages - 1``); 0 without ``kv``, as every page figure.
            ``pages_free + pages_allocated + pages_pending +
            pages_quarantined == pages_capacity`` always holds.
        pages_free: pages free right now.
        pages_allocated: pages held right now, by rows or by callers that
            detached them from their rows.
        pages_pending: pages freed but waiting for their fences.
        pages_quarantined: pages kept out of circulation because a fence
            faulted.
        page_fence_errors: fences that faulted holding pages, total (their
            pages quarantined); a fence holding rows too counts in
            ``fence_errors`` as well. With KV groups, a fence counts once
            however many groups it held pages in (each group's own count:
            ``pool.kv_groups[name].stats().fence_errors``); a group that
            meets it after the others have forgotten it (each remembers its
            newest 256 faulted fences) counts it again.
        overdue_fences: pending fences older than ``fence_timeout`` right now
            (0 without it). With ``reclaim="explicit"``, those ``agree()``
            agreed overdue (not done past some rank's ``fence_timeout``):
            counted on every rank, one built without a timeout too. Their
            memory stays held (their work may still write or read it) until
            they complete or ``force_release``.
        overdue_rows: rows held by the overdue fences.
        overdue_pages: pages held by the overdue fences.
        admits: ``admit``/``try_admit`` calls granted a row and its pages,
            total; equals ``admit_wait_histogram.count``. A waiter granted and
            cancelled before it resumed is counted here (it was granted) and
            in ``cancellations``.
        admit_wait: percentiles (seconds) of the recent window of queued
            admissions' waits (``wait_time`` is the waits of ``alloc``).
            Empty when ``stats`` was asked for no summaries.
        admit_wait_histogram: every granted admission's wait in seconds, from
            the call (or its queueing) to its grant; one granted without
            queueing counts as a zero wait.
        growth_refusals: ``extend`` and ``extend_rows`` calls answered None
            because fewer pages were free than asked after reclaiming
            completed fences, and ``extend_fitting`` calls that grew fewer
            rows than they were given, total: each is a retraction the
            scheduler had to make (its preemption figure, seen from the
            pool). Calls refused with an error are not counted. One per
            call: with KV groups, a grouped growth (``{group: count}``)
            short in several groups counts once here and once in each of
            those groups' own figures (``kv_groups``), so this is the sum of
            the groups' figures less those repeats, never more than the
            sum.
        force_released: rows that ``force_release`` returned to
            circulation without their fence completing, total: the
            operator's escape hatch, each use a risk (a late write or
            read may land), so counted apart from ``reclaimed`` and left out of the
            fence latencies.
        pages_force_released: the same for KV pages (with KV groups, the
            sum over the groups).
        kv_groups: with KV groups (a mapping ``kv=``), each group's own
            page figures, group name -> :class:`~asyncpool.KVGroupStats`, in
            the pool's group order: every figure of the group's
            ``kv.stats()`` (``free``, ``allocated``, ``pending``,
            ``quarantined``, ``capacity``, ``peak_allocated``,
            ``fence_errors``, ...) plus its ``growth_refusals``, so an
            operator sees which group runs short (the sliding-window one
            full while full attention idles). The ``pages_*`` figures above
            are their sums, read from the same snapshots (they always
            agree); ``page_fence_errors`` is their ``fence_errors``' sum
            less the fences counted in more than one group, and
            ``growth_refusals`` their sum less the calls counted in more
            than one group (see above). Each
            group's ``fence_latency`` is empty when ``stats`` was asked for
            no summaries. Read-only (a :class:`FrozenDict`); empty for a
            pool with one ``kv=`` (its figures are the ``pages_*`` ones) or
            none.
        oldest_wait_s: seconds the longest-queued ``alloc`` or ``admit``
            call still waiting has waited so far, at the moment of the
            snapshot (any priority: at least ``queue_head().waited_s``);
            0.0 when none waits (0.0 for the sync pool). A stall in
            progress, which the wait histograms see only once it ends. A
            call cancelled while queued stops counting at once, though it
            stays queued until its task unwinds; one whose event loop was
            closed under it too. Read on the waiter queues' clock
            (``time.perf_counter``), as the waits. Left out of the
            snapshot's equality (and hash): it moves with the clock while
            the pool's state stands still.
        by_priority: each priority's own wait histograms and its timeouts,
            cancellations, rejections and unfittable calls, priority ->
            :class:`PriorityStats`,
            most urgent first: whether tier 3 waits seconds while tier 0
            waits microseconds. A priority appears once a call at it queued
            or was refused, or a thread-safe call's grant at it was
            cancelled before delivery (a cancellation); calls granted
            without queueing are not otherwise counted per priority. Kept
            apart for the first :data:`MAX_PRIORITIES` distinct priorities;
            read-only (a :class:`FrozenDict`), empty for the sync pool and
            a pool whose calls never queued nor had such a grant cancelled.
        other_priorities: the figures of every priority past the first
            :data:`MAX_PRIORITIES`, together; None while there is none.
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
    unfittable: int = 0
    closed: bool = False
    released: bool = False
    grants_held: bool = False
    grant_holds: int = 0
    wait_time: LatencySummary = field(default_factory=LatencySummary)
    fence_latency: LatencySummary = field(default_factory=LatencySummary)
    alloc_calls: int = 0
    wait_histogram: HistogramSnapshot = field(default_factory=HistogramSnapshot)
    fence_latency_histogram: HistogramSnapshot = field(default_factory=HistogramSnapshot)
    rows_granted: int = 0
    pages_capacity: int = 0
    pages_free: int = 0
    pages_allocated: int = 0
    pages_pending: int = 0
    pages_quarantined: int = 0
    page_fence_errors: int = 0
    overdue_fences: int = 0
    overdue_rows: int = 0
    overdue_pages: int = 0
    admits: int = 0
    admit_wait: LatencySummary = field(default_factory=LatencySummary)
    admit_wait_histogram: HistogramSnapshot = field(default_factory=HistogramSnapshot)
    growth_refusals: int = 0
    force_released: int = 0
    pages_force_released: int = 0
    kv_groups: Mapping[str, KVGroupStats] = NO_GROUPS
    oldest_wait_s: float = field(default=0.0, compare=False)
    by_priority: Mapping[int, PriorityStats] = NO_PRIORITIES
    other_priorities: PriorityStats | None = None
