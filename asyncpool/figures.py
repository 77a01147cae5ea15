"""The pool's figures: the queue and memory counts, ``stats()``, the overdue
list and the consistency audit.

:class:`Figures` is mixed into :class:`~asyncpool.AsyncReqToTokenPool` (a
mixin with no state of its own; the pool composes what it reads). It holds
``waiting``/``waiting_by_priority``; the counts ``available_size``,
``pending_size`` and ``quarantined_size`` (and the one move a count read
makes, ``_follow_running_loop``); ``stats()`` with its per-priority and
per-group figures (``_priority_stats``, ``_kv_group_stats``) and the
zero-wait allocs it derives (``_zero_wait_allocs``); ``overdue_fences()``;
and ``check_invariants()``. It derives from
:class:`~asyncpool.base.PoolCore`, whose counts and audit it extends
(``check_invariants`` calls PoolCore's first), and sits before it in the
pool's bases.

Thread rules: the pool's (:mod:`asyncpool.pool`). The counts, ``waiting``
and ``stats`` are reads, from any thread (a metrics scrape: the figures are
then read a few operations apart); one made on the owner's thread from a
running loop the pool has left (its own closed, or stopped with nobody
waiting on it) moves the pool there first, as any call does: it is the
only call a scheduler that sizes its batches by the counts may make on a
new loop. ``waiting_by_priority``, ``overdue_fences`` and
``check_invariants`` are the pool's thread's only
(:class:`WrongThreadError` otherwise). Cancellation: nothing here awaits.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from typing import TYPE_CHECKING, Any

from .base import PoolCore
from .fences import Fence
from .kv_pages import KVGroupStats
from .overdue import OverdueFences
from .row_pages import RowPages
from .stats import FrozenDict, LatencySummary, PoolStats, PriorityStats
from .waiters import PriorityFigures, WaiterQueues
from .wakeups import FenceWakeups

__all__ = ["Figures"]

_get_ident = threading.get_ident
_peek_running_loop = asyncio._get_running_loop  # None outside a loop; never raises


class Figures(PoolCore):
    """Counts, ``stats()``, ``overdue_fences()`` and ``check_invariants()``,
    mixed into ``AsyncReqToTokenPool``.

    The attributes and methods below are the pool's; see
    :class:`~asyncpool.AsyncReqToTokenPool` for the public contract of each
    call defined here. A subclass of :class:`~asyncpool.base.PoolCore`
    (whose ``check_invariants`` this one's extends) with nothing of its own
    to construct.
    """

    _pages: RowPages | None
    _groups: dict[str, RowPages] | None
    _page_sets: tuple[RowPages, ...]
    _waiters: WaiterQueues
    _wakeups: FenceWakeups
    _overdue: OverdueFences | None
    _agreed_overdue: OverdueFences | None
    _loop: asyncio.AbstractEventLoop | None
    _owner: int | None
    _fast: bool
    _closed: bool
    _released: bool
    _holds: int
    _unreset: list[int]
    _wait_times: collections.deque[float]
    _fast_allocs: int
    _zero_waits_seen: int
    _page_fault_repeats: int
    _growth_refusal_repeats: int

    if TYPE_CHECKING:

        @property
        def released(self) -> bool: ...

        def _check_thread(self) -> None: ...

        def _prepare_wait(self, loop: asyncio.AbstractEventLoop) -> asyncio.AbstractEventLoop: ...

        def _gate_wanted(self) -> bool: ...

    # ------------------------------------------------------------ views

    def waiting(self) -> int:
        """How many ``alloc`` and ``admit`` calls are queued.

        A call cancelled while queued counts until its task unwinds (the
        loop's next turn), as one whose event loop was closed under it
        counts until the next call that looks at the queue: right after a
        disconnect storm this may read hundreds while :meth:`queue_head`
        reads None. :meth:`waiting_by_priority` counts live calls only.
        Any thread (a scrape).
        """
        return self._waiters.count

    def waiting_by_priority(self) -> dict[int, int]:
        """The live queued ``alloc`` and ``admit`` calls per priority.

        ``{priority: count}``, most urgent first, priorities with none left
        out (``{}`` when nobody waits): a tier's queue depth, for per-tier
        backpressure or a per-tier gauge (``max_waiters`` and the metrics
        count every priority together). Live: a call cancelled (or timed
        out) whose task has not unwound yet is not counted, nor one whose
        event loop was closed under it. A read: it changes nothing.
        O(calls queued); the event loop's thread only
        (:class:`WrongThreadError` otherwise).
        """
        self._check_thread()
        return self._waiters.by_priority()

    def _zero_wait_allocs(self) -> int:
        """Allocs granted without queueing, the inlined single-row ones included.

        ``granted`` counts every row handed out; every hand-out but
        alloc()'s inlined single-row path also counts in ``_popped``. The
        difference is those inlined calls (one row each). ``granted`` is
        read first and ``_popped`` is bumped before it, so a read racing a
        hand-out on the owner's
        thread (a scrape from another thread) can only undercount; the
        figure reported is the largest seen so far, so a counter built on
        it never goes down between scrapes and never runs ahead of the truth.
        """
        led = self._ledger
        granted = led.granted
        count = granted - led._popped + self._fast_allocs
        if count > self._zero_waits_seen:
            self._zero_waits_seen = count
        return self._zero_waits_seen

    # ------------------------------------------------------------ counts
    # Reads, from any thread (a metrics scrape). One made on the owner's
    # thread from a running loop the pool has left moves the pool there
    # first (_follow_running_loop): it is the only call a scheduler that
    # sizes its batches by the counts may make on a new loop.

    def available_size(self) -> int:
        """Rows free right now (not counting rows pending behind fences).

        A read: rows whose fences completed come back when the event loop
        runs the pool's wake-up, or at ``reclaim()`` (docs/api.md: *Counts
        are reads; wake-ups need the loop*). On the owner's thread, from a
        running loop the pool has left (its own closed, or stopped with
        nobody waiting on it), it first moves the pool there and looks at
        its fences, as any call does; from another thread it only reads.
        """
        if self._loop is not _peek_running_loop():
            self._follow_running_loop()
        return self._ledger.free_count

    def pending_size(self) -> int:
        """Rows freed but waiting for their fences to complete (a read; see
        :meth:`available_size` for the one move it makes)."""
        if self._loop is not _peek_running_loop():
            self._follow_running_loop()
        return self._ledger.pending

    def quarantined_size(self) -> int:
        """Rows kept out of circulation because their fence faulted (a read;
        see :meth:`available_size` for the one move it makes)."""
        if self._loop is not _peek_running_loop():
            self._follow_running_loop()
        return self._ledger.quarantined

    def _follow_running_loop(self) -> None:
        # A read from a running loop that is not the pool's. Fences that
        # completed since the pool's loop stopped sent their wake-ups there
        # (closed: dropped; stopped: queued where nothing runs them), so
        # awaiting on this loop would never bring their memory back, and a
        # scheduler that only reads the counts here makes no call that
        # moves the pool. On the owner's thread, where any call would move
        # the pool (its loop is gone, or stopped with nobody waiting on it),
        # move here and look at the fences at once, as a call does; from
        # then on wake-ups come here. Elsewhere (another thread's scrape,
        # the pool's loop still live, a pool no call has bound) only read.
        running = _peek_running_loop()
        if running is None or self._owner != _get_ident():
            return
        loop = self._loop
        if loop is not None and not loop.is_closed() and (loop.is_running() or self._waiters.count):
            return
        self._fast = False  # no unchecked call may interleave with this one
        self._prepare_wait(running)
        self._wakeups.on_fences_done(running)

    def stats(self, *, summaries: bool = True) -> PoolStats:
        """A frozen snapshot of counts, totals, histograms and latency summaries.

        Changes nothing a caller can see (it only caches a count it derives),
        but for the move :meth:`available_size` makes from a loop the pool
        has left. ``summaries=False`` leaves ``wait_time``, ``admit_wait`` and
        ``fence_latency`` empty (sorting their sample windows is the costly
        part); metrics scrapes use it. May be called from another thread (a
        scrape): the figures are then read a few operations apart.
        """
        if self._loop is not _peek_running_loop():
            self._follow_running_loop()
        waiters = self._waiters
        holds = self._holds  # read once: grants_held and grant_holds agree
        waits = waiters.wait_snapshot(0, zeros=self._zero_wait_allocs())
        extra: dict[str, Any] = {}
        sets = self._page_sets
        if sets:
            # Admissions are counted on the first group's RowPages.
            pages = sets[0]
            groups = self._groups
            if groups is None:
                pled = pages.ledger
                capacity, free = pled.capacity, pled.free_count
                pending, quarantined = pled.pending, pled.quarantined
                errors, refusals = pled.fence_errors, pages.growth_refusals
                forced = pled.force_released
            else:
                # Each group's figures, read once; the page figures are their
                # sums, so a scrape from another thread sees them agree.
                per = self._kv_group_stats(groups, summaries)
                capacity = sum(g.capacity for g in per.values())
                free = sum(g.free for g in per.values())
                pending = sum(g.pending for g in per.values())
                quarantined = sum(g.quarantined for g in per.values())
                errors = sum(g.fence_errors for g in per.values())
                forced = sum(g.force_released for g in per.values())
                # Calls refused, once each: read after the groups' counts.
                refusals = sum(g.growth_refusals for g in per.values())
                refusals -= self._growth_refusal_repeats
            # Every grant of an admission is observed in the histogram (a
            # zero wait for one granted without queueing), so its count is
            # the number of admissions: one figure, never two counters read
            # a few operations apart by a scrape from another thread.
            admit_waits = waiters.wait_snapshot(1, zeros=pages.fast_admits)
            extra = {
                "pages_capacity": capacity,
                "pages_free": free,
                "pages_allocated": capacity - free - pending - quarantined,
                "pages_pending": pending,
                "pages_quarantined": quarantined,
                "page_fence_errors": errors - self._page_fault_repeats,
                "admits": admit_waits.count,
                "admit_wait": LatencySummary.of(pages.waits) if summaries else LatencySummary(),
                "admit_wait_histogram": admit_waits,
                "growth_refusals": refusals,
                "pages_force_released": forced,
            }
            if groups is not None:
                extra["kv_groups"] = per
        overdue = self._overdue_scanner()
        if overdue is not None:
            # Explicit: overdue is what agree() agreed (not done on some rank).
            fences, held = overdue.counts(agreed=self._ledger.explicit)
            extra["overdue_fences"] = fences
            extra["overdue_rows"] = held.get("rows", 0)
            extra["overdue_pages"] = held.get("pages", 0)
        return self._stats(
            summaries,
            waiters=waiters.count,
            oldest_wait_s=waiters.oldest_wait(),
            timeouts=waiters.timeouts,
            cancellations=waiters.cancellations,
            rejections=waiters.rejections,
            unfittable=waiters.unfittable,
            closed=self._closed,
            released=self.released,
            grants_held=holds > 0,
            grant_holds=holds,
            wait_time=LatencySummary.of(self._wait_times) if summaries else LatencySummary(),
            alloc_calls=waits.count,
            wait_histogram=waits,
            **self._priority_stats(),
            **extra,
        )

    def _priority_stats(self) -> dict[str, Any]:
        """``stats().by_priority`` and ``.other_priorities``; nothing (the
        defaults) while no call queued. Any thread (a scrape)."""
        waiters = self._waiters
        tiers = sorted(list(waiters.tiers.items()))  # one C-level copy, then sorted
        other = waiters.other
        if not tiers:
            return {}

        def one(figures: PriorityFigures) -> PriorityStats:
            allocs, admits = figures.histograms
            return PriorityStats(
                wait_histogram=allocs.snapshot(),
                admit_wait_histogram=admits.snapshot(),
                timeouts=figures.timeouts,
                cancellations=figures.cancellations,
                rejections=figures.rejections,
                unfittable=figures.unfittable,
            )

        return {
            "by_priority": FrozenDict({prio: one(figures) for prio, figures in tiers}),
            "other_priorities": None if other is None else one(other),
        }

    @staticmethod
    def _kv_group_stats(
        groups: dict[str, RowPages], summaries: bool
    ) -> FrozenDict[str, KVGroupStats]:
        """``stats().kv_groups``: each group's own figures and its growth
        refusals, in the groups' order."""
        return FrozenDict(
            {
                name: KVGroupStats(
                    **one.kv._figures(summaries), growth_refusals=one.growth_refusals
                )
                for name, one in groups.items()
            }
        )

    def _overdue_scanner(self) -> OverdueFences | None:
        # What stats() and overdue_fences() scan: the pool's own check, or
        # (explicit, no fence_timeout here) the one for what agree() marked
        # overdue, scanned only once it marked some batch.
        overdue = self._overdue
        if overdue is None and self._agreed_overdue is not None:
            marked = self._ledger.agreed_overdue or any(
                pages.ledger.agreed_overdue for pages in self._page_sets
            )
            overdue = self._agreed_overdue if marked else None
        return overdue

    def overdue_fences(self) -> list[Fence]:
        """The fences overdue now, oldest first: the ones ``stats()``
        counts in ``overdue_fences``, to act on (``force_release`` takes
        the list, for fences whose work is known to be dead).

        A fence is overdue while some batch of rows or pages waits for it
        (as the fence it waits for now) past ``fence_timeout`` since it was
        freed; with ``reclaim="explicit"``, while ``agree()`` has agreed it
        overdue. Oldest is the fence whose oldest such batch was freed
        first. A batch freed behind several fences (``fence=[a, b]``, a row
        used on two streams) waits for one at a time, so only the one it
        waits for now is listed: once that one completes or is released,
        the batch's next open fence is listed at once (the batch keeps its
        free's time). Empty without ``fence_timeout`` (and, explicit, before
        ``agree()`` marked any). A new list; the pool keeps no reference to
        it. Changes nothing; O(pending batches). From the pool's thread, as
        the calls that act on it (:class:`WrongThreadError` otherwise).
        """
        self._check_thread()
        overdue = self._overdue_scanner()
        if overdue is None:
            return []
        return overdue.fences(agreed=self._ledger.explicit)

    def check_invariants(self) -> None:
        """Raise AssertionError unless ledger and waiter queues are consistent.

        From the pool's thread only (:class:`WrongThreadError` otherwise): it
        walks every record, which a call in the owner's thread may have half
        updated, so from another thread it could report a fault that is not.
        For the same reason it may report one while another thread's call
        on an unchecked fast path is half-way (its row out of the free
        queue, not yet marked allocated): those paths are safe for the
        pool's state, not for an audit running beside them.
        """
        self._check_thread()
        super().check_invariants()
        self._waiters.check_invariants()
        if self._holds < 0 or self._waiters.gated != self._gate_wanted():
            raise AssertionError(
                f"the grant loop is {'' if self._waiters.gated else 'not '}gated with "
                f"closed={self._closed} released={self._released} holds={self._holds}"
            )
        for pages in self._page_sets:
            pages.ledger.check_invariants()
            pages.check_invariants(self._ledger.allocated_rows())
        if self._groups is not None and (
            self._pages is not None or tuple(self._groups.values()) != self._page_sets
        ):
            raise AssertionError("the KV groups and the pool's page sets disagree")
        for row in self._unreset:
            if self._ledger.state_of(row) != "allocated":
                raise AssertionError(f"row {row} awaits its reset but is not allocated")
