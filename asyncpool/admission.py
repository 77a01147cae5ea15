"""Atomic admission: one await grants a request its row and its KV pages.

The part of :class:`~asyncpool.AsyncReqToTokenPool` that admits a request
with pages (``kv=``): ``admit``/``try_admit`` (one row and ``k`` pages, all
or nothing, System V ``semop`` semantics, waiting in the same queues as
``alloc``), the grant loop's take of an admission (one kv, or one count per
KV group), what the queue's head lacks (``queue_head``, ``pages_short``) and
the reads of the pages a row owns (``pages_of``, ``pages_of_rows``). A
mixin with no state of its own: the pool composes the ledgers, the tables,
the waiter queues (:mod:`asyncpool.waiters`, where the queueing,
cancellation and timeout rules live) and the wake-ups; this class reads and
drives them. A row's growth is :mod:`asyncpool.growth`'s, giving its pages
back (and ``free`` of rows that own pages) :mod:`asyncpool.give_back`'s;
the state and argument checks the three share, :mod:`asyncpool.page_args`'s.
It knows nothing of fences' wake-up machinery, metrics or tensor
parallelism.

Thread rules: the pool's (:mod:`asyncpool.pool`). Every call here is
checked: a pool with ``kv`` never opens the unchecked fast paths.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, SupportsIndex, overload

import numpy as np
import numpy.typing as npt
import torch

from .base import check_wait_args as _check_wait_args
from .errors import CapacityError, PoolClosedError
from .kv_pages import OWNED
from .ledger import Rows, as_index, describe
from .page_args import Counts, PageArgs, _check_ordered
from .row_pages import _EMPTY, Grant, GroupGrant, RowPages, check_page_count, table_zeros
from .stats import FrozenDict

if TYPE_CHECKING:
    from .deferral import Deferrals
    from .overdue import OverdueFences

__all__ = ["Admission", "Counts", "Need", "QueueHead"]

_get_ident = threading.get_ident
_get_running_loop = asyncio.get_running_loop
_new_grant = tuple.__new__

#: What a waiter needs (asyncpool.waiters never looks inside): ``n`` (an
#: int) for alloc(n), ``(1, k)`` for admit(pages=k), ``(1, (k0, k1, ...))``
#: for an admission on a pool with KV groups (one count per group, in the
#: groups' order).
Need = int | tuple[int, int] | tuple[int, tuple[int, ...]]


@dataclass(frozen=True, slots=True)
class QueueHead:
    """The queued call the grant loop serves next, and what it lacks now
    (:meth:`~asyncpool.AsyncReqToTokenPool.queue_head`; frozen, a snapshot).

    Attributes:
        call: ``"alloc"`` or ``"admit"``.
        rows: rows it asks for (``n`` of ``alloc(n)``; 1 for ``admit``).
        pages: pages it asks for: an int on a pool with one ``kv`` or none
            (0 for an ``alloc``, and on a pool without ``kv``); on a pool
            with KV groups, a read-only mapping (a :class:`FrozenDict`)
            ``{group: count}`` naming every group in the pool's order (all 0
            for an ``alloc``).
        priority: its ``priority=`` (lower is served first).
        waited_s: seconds it has queued so far (``time.perf_counter``, from
            when it queued: the clock its wait is recorded with when granted).
        rows_short: rows it asks for beyond those free and those pending
            behind fences (on their way back); 0 when they cover it.
        pages_short: the same for its pages, as
            :meth:`~asyncpool.AsyncReqToTokenPool.pages_short` counts them:
            an int, or on a pool with KV groups a read-only mapping
            ``{group: shortfall}`` naming every group (the groups with a
            non-zero count are those it waits for).
    """

    call: Literal["alloc", "admit"]
    rows: int
    pages: int | Mapping[str, int]
    priority: int
    waited_s: float
    rows_short: int
    pages_short: int | Mapping[str, int]


class Admission(PageArgs):
    """Admission and the reads of a row's pages, mixed into ``AsyncReqToTokenPool``.

    The attributes and methods below are the pool's; see
    :class:`~asyncpool.AsyncReqToTokenPool` for the public contract of each
    call defined here.
    """

    if TYPE_CHECKING:

        def _bind_thread(self) -> None: ...

        def _try_must_wait(self, priority: int | None = None) -> bool: ...

        def _passed_meanwhile(self, priority: int | None) -> bool: ...

        def _reclaim_both(self) -> bool: ...

        def _drop_dead_waiters(self) -> bool: ...

        def _take_for_waiter(self, need: Need) -> list[int] | Grant | GroupGrant | None: ...

        def _give_back(self, granted: list[int] | Grant | GroupGrant) -> None: ...

        def _unfittable_need(self, need: Need) -> CapacityError | None: ...

        def _count_oversized(
            self, count: object, capacity: int, priority: object, timeout: object
        ) -> None: ...

        def _prepare_to_queue(self, loop: asyncio.AbstractEventLoop) -> bool: ...

        def _overdue_scanner(self) -> OverdueFences | None: ...

    def _take_admission(self, k: int) -> Grant | None:
        """One row and ``k`` pages for an ``admit`` waiter, all or nothing."""
        pages = self._pages
        assert pages is not None
        pled = pages.ledger
        if (not self._free_q or k > pled.free_count) and (
            not (self._ledger.pending or pled.pending)  # nothing to reclaim
            or not self._reclaim_both()
            or not self._free_q
            or k > pled.free_count
        ):
            return None
        taken = pages.take(k)
        assert taken is not None
        rows = self._take_for_waiter(1)  # its reset is deferred: cannot raise
        assert isinstance(rows, list)
        try:
            return pages.grant(rows[0], taken)
        except BaseException:
            # The grant's tensor could not be made (a device error): undo the
            # hand-over; the error reaches whoever ran the grant loop and the
            # waiter stays at the head, served by the next grant.
            self._untake(rows[0], taken)
            raise

    def _untake(self, row: int, taken: npt.NDArray[np.int64]) -> None:
        """Return a row and the pages taken for it whose grant was never made."""
        pages = self._pages
        assert pages is not None
        if taken.shape[0]:
            pages.ledger.put_back(taken, OWNED)
        self._give_back([row])

    # ------------------------------------------------------------ admitting

    @overload
    async def admit(
        self, pages: SupportsIndex, *, priority: SupportsIndex = 0, timeout: float | None = None
    ) -> Grant: ...

    @overload
    async def admit(
        self,
        pages: Mapping[str, SupportsIndex],
        *,
        priority: SupportsIndex = 0,
        timeout: float | None = None,
    ) -> GroupGrant: ...

    async def admit(
        self,
        pages: SupportsIndex | Mapping[str, SupportsIndex],
        *,
        priority: SupportsIndex = 0,
        timeout: float | None = None,
    ) -> Grant | GroupGrant:
        """Admit a request: one row and ``pages`` KV pages, granted together.

        All or nothing (System V ``semop`` semantics): a waiter short of
        pages holds no row, and one short of rows holds no pages. Waits in
        the same queue as :meth:`alloc`, FIFO within ``priority`` (lower
        number first: a retry that should go ahead of new requests takes
        a negative one); the head blocks those behind it whatever they
        need. Returns at once, without suspending, when nobody is queued,
        both fit (reclaiming completed fences when short), the memory is
        not released and no
        :meth:`hold_grants` hold is held. The row owns its
        pages until it is freed (with them) or they are detached; do not
        modify ``grant.pages`` in place.

        Raises :class:`CapacityError` at once for a page count that is not an
        int in ``0..kv.capacity`` (or a pool without ``kv``), or one that can
        never fit because of quarantine (also to a waiter, when quarantine
        makes its request impossible while it waits); ``TypeError`` and
        ``ValueError`` for ``priority`` and ``timeout``,
        :class:`PoolBusyError`, :class:`PoolClosedError` and
        ``TimeoutError`` as :meth:`alloc` does.
        On any exception, cancellation included, nothing was allocated; a
        waiter cancelled after its grant gives row and pages back.

        On a pool built with KV groups (a mapping ``kv=``), ``pages`` is a
        mapping naming every group exactly once, ``{group: count}``, each
        count an int in ``0..capacity`` of that group's pool: one row and
        each group's pages, all or nothing across the row and every group
        (a waiter short in any group holds nothing in any), in the same
        queue and by the same rules; returns a :class:`GroupGrant` (``row,
        pages = grant``, ``pages`` a dict of one tensor per group).
        ``ValueError`` for an int there (or a mapping on a pool with one
        ``kv``), a group missing or unknown; :class:`CapacityError` for a
        count that is not an int in range, or one that quarantine makes
        unfittable in its group; nothing changes.
        """
        if pages.__class__ is not int and self._groups is not None:
            if (
                pages.__class__ is dict
                and timeout is None
                and priority.__class__ is int
                and self._owner == _get_ident()
            ):
                # The grouped fast path: a plain call, no nested coroutine.
                fast = self._admit_groups_fast(pages)
                if fast is not None:
                    return fast
            return await self._admit_groups(pages, priority, timeout)
        if self._owner != _get_ident():
            self._bind_thread()
        self._fast = False  # no unchecked call may interleave with this one
        try:
            k = self._page_count(pages, 0)
        except CapacityError:
            if self._pages is not None:  # more pages than the pool has: unfittable
                self._count_oversized(pages, self._pages.capacity, priority, timeout)
            raise
        if timeout is not None or priority.__class__ is not int:
            priority, timeout = _check_wait_args(priority, timeout)
        waiters = self._waiters
        if not waiters.count and not waiters.gated:
            grant = self._admit_now(k, priority)
            if grant is not None:
                return grant
        if self._closed:
            raise PoolClosedError("the pool is closed; nothing can be admitted")
        need = (1, k)
        pages_ = self._pages
        assert pages_ is not None
        if self._ledger.quarantined or pages_.ledger.quarantined:
            # k is within capacity (checked above): only quarantine can
            # make it unfittable.
            error = self._unfittable_need(need)
            if error is not None:
                waiters.unfit(priority)
                raise error
        loop = _get_running_loop()
        dropped = False
        if loop is not self._loop or self._unwatched:
            dropped = self._prepare_to_queue(loop)
        # WaiterQueues.wait() inlined, as in alloc(): no nested coroutine.
        figures = waiters.tiers.get(priority) or waiters.figures(priority)  # as alloc()
        waiter, handle = waiters.enqueue(
            need, priority, timeout, loop, pages_.waits, figures.histograms[1]
        )
        if dropped:
            waiters.serve_soon(waiter, loop)
        try:
            granted: Grant = await waiter[1]
            return granted
        except asyncio.CancelledError:
            waiters.cancelled(waiter)
            raise
        except TimeoutError:
            waiters.timed_out(waiter)  # counted where the call raises it (see _expire)
            raise
        except CapacityError:
            waiters.unfit(priority)  # failed by _shed_unfittable: counted where raised
            raise
        finally:
            if handle is not None:
                handle.cancel()
            # The waiter holds the future, which holds a timeout's or a close's
            # error, whose traceback holds this frame: a cycle that would keep
            # the caller's frames (and their locals) until the cycle collector.
            del waiter

    @overload
    def try_admit(
        self, pages: SupportsIndex, *, priority: SupportsIndex | None = None
    ) -> Grant | None: ...

    @overload
    def try_admit(
        self, pages: Mapping[str, SupportsIndex], *, priority: SupportsIndex | None = None
    ) -> GroupGrant | None: ...

    def try_admit(
        self,
        pages: SupportsIndex | Mapping[str, SupportsIndex],
        *,
        priority: SupportsIndex | None = None,
    ) -> Grant | GroupGrant | None:
        """Admit now (one row and ``pages`` pages), or return None; never waits.

        None while anyone is queued (no queue jumping), while the memory is
        released or the grants are held (:meth:`hold_grants`), or when either
        does not fit after reclaiming completed
        fences. With ``priority`` only waiters of that priority or a more
        urgent one (a lower number) hold it back: it takes what
        :meth:`admit` at that priority would be granted at once, ahead of
        less urgent waiters. Raises as :meth:`admit` does for bad input
        (``TypeError`` for a ``priority`` that is not None or an integer) and
        for a request that quarantine makes unfittable
        (:class:`CapacityError`: a None there would be answered for ever),
        and :class:`PoolClosedError` after :meth:`close`; each changes
        nothing. On a pool with KV
        groups: ``pages`` a mapping ``{group: count}`` and a
        :class:`GroupGrant` (or None), as :meth:`admit`.
        """
        self._check_thread()
        prio = None if priority is None else _check_wait_args(priority, None)[0]
        if pages.__class__ is not int and self._groups is not None:
            if pages.__class__ is dict:
                grant = self._admit_groups_fast(pages)
                if grant is not None:
                    return grant
            counts = self._group_counts(pages)
            if self._closed:
                raise PoolClosedError("the pool is closed; nothing can be admitted")
            if self._ledger.quarantined or any(p.ledger.quarantined for p in self._page_sets):
                error = self._unfittable_need((1, counts))
                if error is not None:
                    raise error
            if self._try_must_wait(prio):
                return None
            return self._admit_groups_now(counts, prio)
        k = self._page_count(pages, 0)
        if self._closed:
            raise PoolClosedError("the pool is closed; nothing can be admitted")
        pages_ = self._pages
        assert pages_ is not None
        if self._ledger.quarantined or pages_.ledger.quarantined:
            error = self._unfittable_need((1, k))
            if error is not None:
                raise error
        if self._try_must_wait(prio):
            return None
        return self._admit_now(k, prio)

    def _admit_now(self, k: int, priority: int | None) -> Grant | None:
        pages = self._pages
        assert pages is not None
        free = self._free_q
        pled = pages.ledger
        # Capacity only waiting on a fence is not exhaustion: reclaim once,
        # then count again whatever it answers (a query() it asks may free
        # a row or pages at once: see try_alloc), unless a call it queued
        # or a hold it took comes first (_passed_meanwhile).
        if not free or k > pled.free_count:
            self._reclaim_both()
            if self._passed_meanwhile(priority) or not free or k > pled.free_count:
                return None
        # The row first: taking a dirty one runs its reset, a device op that
        # may raise, and then nothing must have been taken (taking the pages
        # cannot fail once counted).
        rows = self._take(1)
        assert rows is not None
        taken = pages.take(k)
        assert taken is not None
        try:
            grant = pages.grant(rows[0], taken)
        except BaseException:
            self._untake(rows[0], taken)
            raise
        pages.fast_admits += 1
        return grant

    def _kv_pages(self, what: str = "admit or extend with pages") -> RowPages:
        """The pool's pages; :class:`CapacityError` on a pool without ``kv``,
        ``ValueError`` on one with KV groups (an int count there)."""
        pages = self._pages
        if pages is None:
            if self._groups is not None:
                raise ValueError(
                    f"this pool has KV groups {self._group_words()}: admit and try_admit "
                    "take a mapping {group: page count} naming each of them, not one count"
                )
            raise CapacityError(
                f"this pool has no KV pages: build it with kv=KVPagePool(...) to {what}"
            )
        return pages

    def _page_count(self, k: object, least: int) -> int:
        pages = self._kv_pages()
        if k.__class__ is int and least <= k <= pages.capacity:
            return k
        if isinstance(k, Mapping):
            raise ValueError(
                "this pool has one KV page pool and no KV groups: give a page count (an "
                "int), not a mapping of group names to counts"
            )
        return check_page_count(k, pages.capacity, least=least)

    # ------------------------------------------------------------ KV groups

    def _group_counts(self, pages: object) -> tuple[int, ...]:
        """An admission's ``{group: count}`` as one count per group, in the
        groups' order. ``ValueError`` for anything but a mapping naming
        every group exactly once; :class:`CapacityError` for a count that
        is not an int in ``0..capacity`` of its group."""
        groups = self._groups
        assert groups is not None
        if not isinstance(pages, Mapping):
            raise ValueError(
                f"this pool has KV groups {self._group_words()}: admit and try_admit take a "
                f"mapping {{group: page count}} naming each of them, got {describe(pages)} "
                f"of type {type(pages).__name__}"
            )
        unknown = [key for key in pages if not isinstance(key, str) or key not in groups]
        if unknown:
            raise ValueError(
                f"unknown KV group {describe(unknown[0])} in the page counts; this pool's "
                f"groups are {self._group_words()}"
            )
        missing = [name for name in groups if name not in pages]
        if missing:
            raise ValueError(
                f"the page counts name no count for KV group {missing[0]!r}: name every "
                f"group of {self._group_words()} (0 for none)"
            )
        counts = []
        for name, one in groups.items():
            try:
                counts.append(self._count_for(one, pages[name], 0))
            except CapacityError as exc:
                raise CapacityError(f"KV group {name!r}: {exc}") from None
        return tuple(counts)

    def _groups_short(self, counts: tuple[int, ...]) -> bool:
        """Whether some group has fewer free pages than its count."""
        for pages, k in zip(self._page_sets, counts, strict=True):
            if k > pages.ledger.free_count:
                return True
        return False

    def _grant_groups(self, row: int, counts: Sequence[int]) -> GroupGrant:
        """Take each group's pages for the newly taken ``row`` (counted
        free: cannot fail), make every group's tensor, then record them
        all. If a tensor cannot be made (a device error), row and pages go
        back and the error propagates: nothing was granted."""
        sets = self._page_sets
        taken: list[Any] = []  # int64 arrays
        for pages, k in zip(sets, counts, strict=True):
            # RowPages.take, inlined (k counted free: never None).
            taken.append(pages.ledger.take(k, OWNED) if k else _EMPTY)
        try:
            outs = {
                name: pages.out(arr)
                for (name, pages, _), arr in zip(self._group_items, taken, strict=True)
            }
        except BaseException:
            for pages, arr in zip(sets, taken, strict=True):
                if arr.shape[0]:
                    pages.ledger.put_back(arr, OWNED)
            self._give_back([row])
            raise
        for pages, arr in zip(sets, taken, strict=True):
            if arr.shape[0]:  # the row's record and seal, as RowPages.grant records them
                pages.owned[row] = arr
                pages.sealed[row] = arr.tobytes()
        return _new_grant(GroupGrant, (row, outs))

    def _admit_groups_fast(self, pages: dict[Any, Any]) -> GroupGrant | None:
        """The grouped admission's fast path, or None for the general one.

        Grants when nothing queues, the grant loop is not gated (closed,
        released or held), ``pages`` names every group once with a count that is an int in
        ``0..capacity`` of its group, and a row and each group's pages are
        free now: what :meth:`_admit_groups_now` grants then, with none of
        the general validation (:meth:`_group_counts`) or reclaim. Anything
        else answers None having changed nothing, and the caller's general
        path checks, reclaims, raises or queues as before. The caller
        checked the thread (and, for ``admit``, the wait arguments). No
        ``_fast = False`` here: a pool with ``kv`` never opens the unchecked
        paths (``_choose_fast_paths``).
        """
        waiters = self._waiters
        items = self._group_items
        # gated: closed, released or held (Lifecycle._gate_wanted, checked
        # by check_invariants), so a closed pool is the general path's.
        if waiters.count or waiters.gated or not self._free_q or len(pages) != len(items):
            return None
        counts = []
        get = pages.get
        for name, group, capacity in items:
            k = get(name)
            # Equal sizes and every group named: no unknown key.
            if k.__class__ is not int or not 0 <= k <= capacity or k > group.ledger.free_count:
                return None
            counts.append(k)
        rows = self._take(1)  # its reset may raise: nothing taken yet
        assert rows is not None
        grant = self._grant_groups(rows[0], counts)
        items[0][1].fast_admits += 1
        return grant

    def _admit_groups_now(self, counts: tuple[int, ...], priority: int | None) -> GroupGrant | None:
        free = self._free_q
        # Capacity only waiting on a fence is not exhaustion: reclaim once,
        # then count again (as _admit_now).
        if not free or self._groups_short(counts):
            self._reclaim_both()
            if self._passed_meanwhile(priority) or not free or self._groups_short(counts):
                return None
        # The row first (its reset may raise; nothing taken yet), then the
        # pages of every group.
        rows = self._take(1)
        assert rows is not None
        grant = self._grant_groups(rows[0], counts)
        self._page_sets[0].fast_admits += 1
        return grant

    def _count_oversized_groups(self, pages: object, priority: object, timeout: object) -> None:
        """After :meth:`_group_counts` raised :class:`CapacityError` for
        ``pages`` (a mapping naming every group once): count the ``admit``
        in ``unfittable`` if the count it refused first, in the groups'
        order, is an integer past its group's capacity, not bad input."""
        assert self._groups is not None and isinstance(pages, Mapping)
        for name, one in self._groups.items():
            try:
                k = as_index(pages[name])
            except TypeError:
                return  # bad input: refused first
            if k < 0:
                return
            if k > one.capacity:
                self._count_oversized(k, one.capacity, priority, timeout)
                return

    def _take_group_admission(self, counts: tuple[int, ...]) -> GroupGrant | None:
        """One row and each group's pages for a waiter, all or nothing."""
        if (not self._free_q or self._groups_short(counts)) and (
            not (self._ledger.pending or any(p.ledger.pending for p in self._page_sets))
            or not self._reclaim_both()
            or not self._free_q
            or self._groups_short(counts)
        ):
            return None
        rows = self._take_for_waiter(1)  # its reset is deferred: cannot raise
        assert isinstance(rows, list)
        return self._grant_groups(rows[0], counts)

    async def _admit_groups(
        self, pages: object, priority: SupportsIndex, timeout: float | None
    ) -> GroupGrant:
        """:meth:`admit` on a pool with KV groups."""
        if self._owner != _get_ident():
            self._bind_thread()
        self._fast = False
        try:
            counts = self._group_counts(pages)
        except CapacityError:
            self._count_oversized_groups(pages, priority, timeout)
            raise
        if timeout is not None or priority.__class__ is not int:
            priority, timeout = _check_wait_args(priority, timeout)
        waiters = self._waiters
        if not waiters.count and not waiters.gated:
            grant = self._admit_groups_now(counts, priority)
            if grant is not None:
                return grant
        if self._closed:
            raise PoolClosedError("the pool is closed; nothing can be admitted")
        need = (1, counts)
        if self._ledger.quarantined or any(p.ledger.quarantined for p in self._page_sets):
            error = self._unfittable_need(need)
            if error is not None:
                waiters.unfit(priority)
                raise error
        loop = _get_running_loop()
        dropped = False
        if loop is not self._loop or self._unwatched:
            dropped = self._prepare_to_queue(loop)
        stats = self._page_sets[0]  # admissions are counted on the first group
        # WaiterQueues.wait(), the rules' reference form: a nested coroutine
        # costs this path little next to its per-group work (alloc and the
        # one-kv admit inline it, their hot paths).
        granted: GroupGrant = await waiters.wait(
            need,
            priority,
            timeout,
            loop,
            stats.waits,
            waiters.figures(priority).histograms[1],
            serve=dropped,
        )
        return granted

    def _pages_lacked(self, pages: RowPages, k: int) -> int:
        """How many of ``k`` pages exceed those free and those pending behind
        fences in ``pages``, the pending ones behind an overdue fence left
        out (not on their way back): :meth:`pages_short`'s count."""
        pled = pages.ledger
        return self._lacked(pled, pled.free_count, k)

    def _lacked(self, led: Deferrals[Any], free: int, k: int) -> int:
        """How many of ``k`` ids of ``led`` (``free`` of them free) exceed
        those free and those pending behind fences that are not overdue
        (memory behind an overdue fence is not on its way back)."""
        lacked = k - free - led.pending
        if led.pending and k > free:
            overdue = self._overdue_scanner()  # O(pending batches): only when it matters
            if overdue is not None:
                lacked += overdue.held_in(led, agreed=self._ledger.explicit)
        return max(0, lacked)

    def pages_short(self, group: str | None = None) -> int:
        """How many pages the next queued waiter lacks: those to evict for it.

        The pool cannot evict a prefix cache's pages (it does not know
        them), so an ``await admit(pages=k)`` short of pages that only the
        cache holds waits until the engine evicts some. This says how many:
        the head of the queue (the waiter the grant loop serves next; it
        blocks those behind it) is an admission for ``k`` pages, and ``k``
        exceeds the pages free plus those pending behind fences (on their
        way back: evicting for them would empty the cache for memory that
        returns within a step or so) by this much; pages behind an overdue
        fence (``fence_timeout``; a transfer whose peer died) are not on
        their way back and are not counted as such, so the cache evicts
        for the head instead of leaving it to wait on them. 0 when nobody waits, when
        the head is an ``alloc`` (rows only) or its pages are covered (it may
        still wait for a row), and on a pool without ``kv``; waiters whose
        event loop was closed under them are dropped first, as every call
        that looks at the queue drops them. Otherwise a read: it reclaims
        nothing and grants nothing (a completed fence's pages count
        as pending until the pool's wake-up or a call reclaims them). Evict
        that many, behind their readers' fences (docs/api.md: *Prefix caching*);
        the pages come back to the queue's head first, except while a
        :meth:`hold_grants` hold is held: then growth takes what comes back
        first (the hold's purpose), so this may read 0 while the stalled
        requests are still to take the pending pages; read it again once
        the hold is released (growth's own shortfall is the scheduler's to
        count). The event loop's thread only
        (:class:`~asyncpool.WrongThreadError` otherwise). On a pool with KV
        groups, ``group`` (required there, ``ValueError`` otherwise) names
        the group whose shortfall to read; on any other pool it must be None.
        :meth:`queue_head` reads the same head whole: its call, rows,
        priority and wait, and this count for every group at once.
        """
        self._check_thread()
        pages = self._pages
        if pages is None or group is not None:
            pages = self._pages_or_none(group, "pages_short")
        if pages is None or not self._waiters.count:
            return 0
        self._drop_dead_waiters()  # waiters of a loop closed under them never run
        need: Need | None = self._waiters.head()
        if need is None or isinstance(need, int):
            return 0
        k = need[1]
        if isinstance(k, tuple):  # KV groups: this group's count
            k = k[self._page_sets.index(pages)]
        return self._pages_lacked(pages, k)

    def queue_head(self) -> QueueHead | None:
        """The queued call the grant loop serves next, and what it lacks now.

        The head of the queue (the first queued ``alloc`` or ``admit`` not
        yet cancelled, by priority and then FIFO) blocks every call behind
        it, whatever they need: this says what it is and why it waits, for an
        engine that watches for stalls. A :class:`~asyncpool.QueueHead`:
        the call, the rows and pages it asks for, its priority, the seconds
        it has queued, and ``rows_short`` / ``pages_short``, what it asks
        beyond the memory free and that pending behind fences (on their way
        back; not behind an overdue fence), counted as :meth:`pages_short` counts (on a pool with KV
        groups, one shortfall per group: the groups it waits for). None
        when nobody waits (after :meth:`close` too: closing fails every
        waiter). A head that lacks nothing may still wait: while the
        memory is released, while a :meth:`hold_grants` hold is held, until
        a completed fence's memory is reclaimed (the pool's wake-up, or a
        call that reclaims), or until the grant loop's next run (a more
        urgent call that just queued is served at the loop's next turn).

        As :meth:`pages_short`: waiters whose event loop was closed under
        them are dropped first, as every call that looks at the queue drops
        them; otherwise a read that reclaims nothing and grants nothing. A
        new snapshot each call; O(1) but for waiters cancelled and not yet
        unwound, which it steps over. The event loop's thread only
        (:class:`~asyncpool.WrongThreadError` otherwise).
        """
        self._check_thread()
        waiters = self._waiters
        if not waiters.count:
            return None
        self._drop_dead_waiters()  # waiters of a loop closed under them never run
        head = waiters.head_wait()
        if head is None:
            return None
        need, priority, waited = head
        led = self._ledger
        if need.__class__ is int:
            call: Literal["alloc", "admit"] = "alloc"
            n: int = need
            counts: int | tuple[int, ...] = (
                0 if self._groups is None else (0,) * len(self._page_sets)
            )
        else:
            call, n, counts = "admit", 1, need[1]
        rows_short = self._lacked(led, len(self._free_q), n)
        pages: int | Mapping[str, int]
        short: int | Mapping[str, int]
        if isinstance(counts, tuple):
            assert self._groups is not None
            pages = FrozenDict(zip(self._groups, counts, strict=True))
            short = FrozenDict(
                (name, self._pages_lacked(one, k))
                for (name, one), k in zip(self._groups.items(), counts, strict=True)
            )
        else:
            pages = counts
            short = 0 if self._pages is None else self._pages_lacked(self._pages, counts)
        return QueueHead(call, n, pages, priority, waited, rows_short, short)

    def pages_of(
        self, row: SupportsIndex, *, host: bool = False, group: str | None = None
    ) -> torch.Tensor:
        """The pages ``row`` owns (a 1-D int64 tensor; empty if none).

        On the ``KVPagePool``'s device; with ``host=True`` on the CPU, from
        the pool's host record with no copy to the device (on a CUDA pool,
        ids for the engine's own bookkeeping, which ``kv.free`` and
        ``kv.slots`` take without reading anything back). Raises
        :class:`InvalidSlotError` unless ``row`` is allocated. Read only:
        the tensor is (a copy of) the pool's record, and the pool never
        writes it: later growth, :meth:`trim_pages` and :meth:`drop_pages`
        leave it reading what it read (a step in flight may read it). After
        :meth:`drop_pages`, one page id per position: the dropped positions
        read as page 0 (the page pool's reserved padding page), and the
        tensor is a fresh one, never the record (built each call: a pass
        over the row's positions). On a pool with KV
        groups, ``group=`` names the group (required there; ``ValueError``
        for it missing, unknown, or given on a pool without groups).
        """
        self._check_thread()
        pages = self._pages
        if pages is None or group is not None:
            pages = self._pages_or_none(group, "pages_of")
        row = self._allocated_row(row, "asked for its pages")
        if pages is None:
            return torch.zeros(0, dtype=torch.int64)
        return pages.of(row, host)

    def pages_of_rows(
        self,
        rows: Rows,
        *,
        host: bool = False,
        group: str | None = None,
        width: SupportsIndex | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The pages of many rows at once, as a block table: ``(table,
        counts)``.

        ``table`` is a ``(len(rows), width)`` int64 tensor whose line ``i``
        is what :meth:`pages_of` answers for ``rows[i]``, padded with page
        0 (the page pool's reserved padding page, as dropped positions
        read); ``counts`` a 1-D int64 tensor, line ``i``'s positions
        (dropped ones included). ``width`` None: the most positions of any
        of the rows (0 for none); an int >= 0: a fixed width (a CUDA
        graph's block table), :class:`CapacityError` for a row with more
        positions. One call builds the step's block table with two
        tensors, where :meth:`pages_of` per row makes one tensor a row and
        leaves the padding to the caller. Both are fresh, the caller's (not
        the pool's record: writing into them is fine), on the
        ``KVPagePool``'s device, or with ``host=True`` on the CPU (one copy
        each to the device otherwise). ``rows``: as :meth:`free` takes them
        (an empty sequence gives a ``(0, width)`` table), in the table's
        order (a set is refused). Raises, changing nothing:
        :class:`InvalidSlotError` unless the rows are distinct allocated
        rows (or for rows in a set), :class:`CapacityError` for a
        ``width`` that is not an int >= 0, that a row's positions pass or
        whose table cannot be made (numpy's ``MemoryError``, typed);
        ``group=`` as for :meth:`pages_of` (required on a pool with KV
        groups: one table per group). On a pool without ``kv``: a table of
        zeros, every count 0. Owner thread, as every call here.
        """
        self._check_thread()
        pages = self._pages
        if pages is None or group is not None:
            pages = self._pages_or_none(group, "pages_of_rows")
        _check_ordered(rows, "pages_of_rows")
        led = self._ledger
        seq = led.as_rows(rows)
        led.check_allocated(seq, "asked for its pages")
        w: int | None = None
        if width is not None:
            try:
                w = as_index(width)
            except TypeError:
                raise CapacityError(
                    f"width must be a page count (an int >= 0) or None, got "
                    f"{describe(width)} of type {type(width).__name__}"
                ) from None
            if w < 0:
                raise CapacityError(f"width must be a page count >= 0, got {w}")
        if pages is None:
            return (
                torch.from_numpy(table_zeros(len(seq), w or 0)),
                torch.zeros(len(seq), dtype=torch.int64),
            )
        return pages.table(seq, w, host)
