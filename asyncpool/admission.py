"""Atomic admission: one await grants a request its row and its KV pages.

The part of :class:`~asyncpool.AsyncReqToTokenPool` that knows a row may own
pages (``kv=``): ``admit``/``try_admit`` (one row and ``k`` pages, all or
nothing, System V ``semop`` semantics, waiting in the same queues as
``alloc``), the grant loop's take of an admission, the pages a row owns
(``pages_of``, ``extend``, ``detach_pages``) and ``free`` of rows that own
pages. A mixin with no state of its own: the pool composes the ledgers, the
tables, the waiter queues (:mod:`asyncpool.waiters`, where the queueing,
cancellation and timeout rules live) and the wake-ups; this class reads and
drives them. It knows nothing of fences' wake-up machinery, metrics or
tensor parallelism.

Thread rules: the pool's (:mod:`asyncpool.pool`). Every call here is
checked: a pool with ``kv`` never opens the unchecked fast paths.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import itertools
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, SupportsIndex, TypeVar, overload

import numpy as np
import numpy.typing as npt
import torch

from .base import check_wait_args as _check_wait_args
from .errors import CapacityError, InvalidSlotError, PoolClosedError
from .fences import Fence, Fences, HostStream, check_after, fence_list, record_fence
from .kv_pages import OWNED, PageLedger
from .ledger import Rows, SlotLedger, _attributes, as_index, describe, device_fault
from .row_pages import _EMPTY, Grant, GroupGrant, RowPages, check_page_count
from .stats import FrozenDict
from .waiters import WaiterQueues

if TYPE_CHECKING:
    from .deferral import Deferrals
    from .overdue import OverdueFences

__all__ = ["Admission", "Counts", "Need", "QueueHead"]

#: Page counts: one for every row, or one per row.
Counts = SupportsIndex | Sequence[SupportsIndex] | npt.NDArray[np.integer[Any]] | torch.Tensor

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


def _reclaim_short(led: PageLedger, need: int) -> bool:
    """A grouped growth's step for one group: when fewer than ``need`` of
    its pages are free, reclaim its completed fences; True if that
    returned any (the grant loop then runs after the growth)."""
    if need <= led.free_count or not led.pending:
        return False
    before = led.reclaimed
    led.reclaim()
    return led.reclaimed != before


# Freeing a row's own pages (no fence): up to this many go through the page
# ledger's one-pass check-and-free (about 0.1 us a page), more through the
# seal test and its vectorised free_owned (under 1 us whatever the count).
_TRUSTED_PASS = 8


_Got = TypeVar("_Got")  # what a growth answers: pages, None, or (m, pages)
_C = TypeVar("_C")  # a grouped growth's count for one group: one int, or one per row
#: A grouped growth's want for one group: its name, its pages, and one page
#: count for every row or a list of one per row.
_GroupWant = tuple[str, RowPages, int | list[int]]


def _page_counts(value: object, n: int, name: str) -> list[int]:
    """``value`` as one page count >= 0 per row (``n`` rows): one integer
    (Python, numpy, a 0-d tensor; never a bool) for every row, or a
    sequence, 1-D array or 1-D tensor of ``n`` of them. ``name`` is the
    parameter's (``keep`` for ``trim_pages``, ``k`` for ``extend_rows``);
    :class:`CapacityError` otherwise."""
    try:
        one = as_index(value)
    except TypeError:
        pass
    else:
        if one < 0:
            raise CapacityError(f"{name} must be a page count >= 0, got {one}")
        return [one] * n
    if isinstance(value, torch.Tensor | np.ndarray):
        if value.ndim != 1 or value.dtype in (torch.bool, np.bool_):
            raise CapacityError(
                f"{name} must be a page count or one per row (1-D, integers), got a "
                f"{value.ndim}-D {value.dtype} {type(value).__name__}"
            )
        try:
            items: list[object] = value.tolist()
        except (RuntimeError, NotImplementedError) as exc:
            # Meta, sparse, quantized, sub-byte: bad input, as for rows. A
            # strided integer tensor reads unless its device faulted.
            if device_fault(value, exc):
                raise
            raise CapacityError(
                f"{name} must be page counts in a tensor with data (strided, on a real "
                f"device) of an integer dtype, got {_attributes(value)}"
            ) from None
    elif _per_row(value):  # a sequence: list, tuple, range, deque, array.array
        items = list(value)  # type: ignore[call-overload]
    else:
        raise CapacityError(
            f"{name} must be a page count (an integer) or one per row, got {describe(value)} "
            f"of type {type(value).__name__}"
        )
    if len(items) != n:
        raise CapacityError(f"{name} lists {len(items)} page counts for {n} rows")
    counts = []
    for item in items:
        try:
            k = as_index(item)
        except TypeError:
            raise CapacityError(
                f"{name} must hold page counts (integers), got {describe(item)} of type "
                f"{type(item).__name__}"
            ) from None
        if k < 0:
            raise CapacityError(f"{name} must hold page counts >= 0, got {k}")
        counts.append(k)
    return counts


def _per_row(counts: object) -> bool:
    """Whether ``counts`` gives one page count per row (a sequence other
    than text or bytes, a 1-D array or tensor) rather than one for all."""
    if isinstance(counts, torch.Tensor | np.ndarray):
        return bool(counts.ndim)
    return isinstance(counts, Sequence) and not isinstance(
        counts, str | bytes | bytearray | memoryview
    )


def _check_ordered(rows: object, what: str) -> None:
    """:class:`InvalidSlotError` for rows in a ``set`` or ``frozenset``,
    whose order is arbitrary, where ``what`` gives the order a meaning;
    other forms of rows are checked as usual later."""
    if isinstance(rows, set | frozenset):
        raise InvalidSlotError(
            f"{what} pairs rows with their order, and a {type(rows).__name__} has none: "
            "give the rows as a list, tuple, 1-D array or tensor"
        )


class Admission:
    """Admission and page ownership, mixed into ``AsyncReqToTokenPool``.

    The attributes and methods below are the pool's; see
    :class:`~asyncpool.AsyncReqToTokenPool` for the public contract of each
    call defined here.
    """

    _ledger: SlotLedger
    _pages: RowPages | None
    _groups: dict[str, RowPages] | None
    _page_sets: tuple[RowPages, ...]
    _group_items: tuple[tuple[str, RowPages, int], ...]
    _waiters: WaiterQueues
    _free_q: collections.deque[int]
    _state: list[int]
    _uses: list[Any]
    _owner: int | None
    _fast: bool
    _closed: bool
    _released: bool
    _loop: asyncio.AbstractEventLoop | None
    _unwatched: list[Fence]
    _take: Callable[[int], list[int] | None]
    _growth_refusal_repeats: int
    size: int

    if TYPE_CHECKING:

        def _bind_thread(self) -> None: ...

        def _check_thread(self) -> None: ...

        def _try_must_wait(self, priority: int | None = None) -> bool: ...

        def _reclaim_both(self) -> bool: ...

        def _drop_dead_waiters(self) -> bool: ...

        def _take_for_waiter(self, need: Need) -> list[int] | Grant | GroupGrant | None: ...

        def _give_back(self, granted: list[int] | Grant | GroupGrant) -> None: ...

        def _unfittable_need(self, need: Need) -> CapacityError | None: ...

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
        k = self._page_count(pages, 0)
        if timeout is not None or priority.__class__ is not int:
            priority, timeout = _check_wait_args(priority, timeout)
        waiters = self._waiters
        if not waiters.count and not waiters.gated:
            grant = self._admit_now(k)
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
                raise error
        loop = _get_running_loop()
        dropped = False
        if loop is not self._loop or self._unwatched:
            dropped = self._prepare_to_queue(loop)
        # WaiterQueues.wait() inlined, as in alloc(): no nested coroutine.
        waiter, handle = waiters.enqueue(
            need, priority, timeout, loop, pages_.waits, pages_.wait_histogram
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
            waiters.timeouts += 1  # counted where the call raises it (see _expire)
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
            return self._admit_groups_now(counts)
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
        return self._admit_now(k)

    def _admit_now(self, k: int) -> Grant | None:
        pages = self._pages
        assert pages is not None
        free = self._free_q
        pled = pages.ledger
        # Capacity only waiting on a fence is not exhaustion: reclaim once.
        if (not free or k > pled.free_count) and (
            not self._reclaim_both() or not free or k > pled.free_count
        ):
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

    def _group_words(self) -> str:
        assert self._groups is not None
        return "(" + ", ".join(map(repr, self._groups)) + ")"

    def _group_named(self, group: object, call: str) -> RowPages:
        """The pages of KV group ``group``; ``ValueError`` for a pool
        without groups or a name that is not one of them."""
        groups = self._groups
        if groups is None:
            built = "one KVPagePool" if self._pages is not None else "no kv"
            raise ValueError(
                f"{call}: group= names a KV group, and this pool has none (built with "
                f"{built}): leave group out"
            )
        pages = groups.get(group) if isinstance(group, str) else None
        if pages is None:
            raise ValueError(
                f"{call}: unknown KV group {describe(group)}; this pool's groups are "
                f"{self._group_words()}"
            )
        return pages

    def _pages_or_none(self, group: object, call: str) -> RowPages | None:
        """The pages ``group=`` picks: the pool's one ``kv`` (``group``
        None), a group's (by name, on a pool with groups, where it is
        required), or None on a pool without ``kv`` (``group`` None).
        ``ValueError`` for ``group=`` misused."""
        if group is None:
            pages = self._pages
            if pages is not None or self._groups is None:
                return pages
            raise ValueError(
                f"{call}: this pool has KV groups {self._group_words()}: name one with group="
            )
        return self._group_named(group, call)

    def _pages_for(self, group: object, call: str, purpose: str) -> RowPages:
        """:meth:`_pages_or_none`, with :class:`CapacityError` for a pool
        without ``kv`` (as :meth:`_kv_pages`)."""
        pages = self._pages_or_none(group, call)
        if pages is None:
            raise CapacityError(
                f"this pool has no KV pages: build it with kv=KVPagePool(...) to {purpose}"
            )
        return pages

    @staticmethod
    def _count_for(pages: RowPages, k: Any, least: int) -> int:
        if k.__class__ is int and least <= k <= pages.capacity:
            return k
        return check_page_count(k, pages.capacity, least=least)

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
            if arr.shape[0]:  # RowPages.attach, inlined
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

    def _admit_groups_now(self, counts: tuple[int, ...]) -> GroupGrant | None:
        free = self._free_q
        # Capacity only waiting on a fence is not exhaustion: reclaim once.
        if (not free or self._groups_short(counts)) and (
            not self._reclaim_both() or not free or self._groups_short(counts)
        ):
            return None
        # The row first (its reset may raise; nothing taken yet), then the
        # pages of every group.
        rows = self._take(1)
        assert rows is not None
        grant = self._grant_groups(rows[0], counts)
        self._page_sets[0].fast_admits += 1
        return grant

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
        counts = self._group_counts(pages)
        if timeout is not None or priority.__class__ is not int:
            priority, timeout = _check_wait_args(priority, timeout)
        waiters = self._waiters
        if not waiters.count and not waiters.gated:
            grant = self._admit_groups_now(counts)
            if grant is not None:
                return grant
        if self._closed:
            raise PoolClosedError("the pool is closed; nothing can be admitted")
        need = (1, counts)
        if self._ledger.quarantined or any(p.ledger.quarantined for p in self._page_sets):
            error = self._unfittable_need(need)
            if error is not None:
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
            need, priority, timeout, loop, stats.waits, stats.wait_histogram, serve=dropped
        )
        return granted

    def _allocated_row(self, row: object, what: str) -> int:
        """``row`` as an int if it is an allocated row id (integer scalars
        and 0-d tensors accepted, as ``free`` does); InvalidSlotError otherwise."""
        if row.__class__ is not int:
            try:
                row = as_index(row)  # refuses bools and floats
            except TypeError:
                raise self._ledger._row_error(row, what) from None
        assert isinstance(row, int)
        if 0 < row < self.size and self._state[row] in (1, 6):
            return row  # ALLOCATED or USED
        raise self._ledger._row_error(row, what)

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
        ``width`` that is not an int >= 0 or that a row's positions pass;
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
                torch.zeros((len(seq), w or 0), dtype=torch.int64),
                torch.zeros(len(seq), dtype=torch.int64),
            )
        return pages.table(seq, w, host)

    @overload
    def extend(
        self, row: SupportsIndex, k: SupportsIndex, *, group: str | None = None
    ) -> torch.Tensor | None: ...

    @overload
    def extend(
        self, row: SupportsIndex, k: Mapping[str, SupportsIndex], *, group: None = None
    ) -> dict[str, torch.Tensor] | None: ...

    def extend(
        self,
        row: SupportsIndex,
        k: SupportsIndex | Mapping[str, SupportsIndex],
        *,
        group: str | None = None,
    ) -> torch.Tensor | dict[str, torch.Tensor] | None:
        """Add ``k`` pages to allocated ``row`` for decode growth; never waits.

        Returns the new pages (they belong to the row from now on), or None
        when fewer than ``k`` are free after reclaiming completed fences, or
        while the memory is released: the scheduler then retracts, as every
        engine does (waiting here behind new admissions could deadlock).
        Treat the tensor as read-only, as ``grant.pages``: for a row that
        owned no pages it is the row's record, and a write into it (slot
        arithmetic in place, say) makes the row's :meth:`free` refuse it. It
        takes free pages even while admissions queue, but pages that a free
        or a completed fence returns go to the queued admissions first, at
        hand-over (docs/api.md: *Growth and queued admissions*). After
        :meth:`drop_pages` the new pages follow the row's last position
        (dropped ones included); a row whose every page was dropped owns
        none, so the tensor is its record, as above. Raises
        :class:`CapacityError` for ``k`` not an int in ``1..kv.capacity``,
        :class:`InvalidSlotError` unless ``row`` is allocated,
        :class:`PoolClosedError` after :meth:`close`; changing nothing. On a
        pool without ``kv``: :class:`CapacityError`. On a pool with KV
        groups ``group=`` names the group to grow (required there, and
        ``k`` within that group's capacity); elsewhere it must be None
        (``ValueError`` for either mistake or an unknown name).

        Several groups at once (a hybrid model's decode step that crosses a
        page boundary in more than one): ``k`` a mapping ``{group: count}``
        naming any of the pool's groups (those it leaves out grow by
        nothing), each count an int in ``0..capacity`` of its group. All or
        nothing: a dict ``{group: new pages}`` (a 1-D tensor per named
        group, empty for a count of 0, in the groups' order), or None,
        taking nothing in any group, when any group is short after
        reclaiming its completed fences (one growth refusal: once in
        ``stats().growth_refusals``, and in the ``kv_groups`` figure of
        each group that was short). The same
        rules as one group: never waits, takes free pages even while
        admissions queue, None while the memory is released, read-only
        tensors, freed with the row behind its recorded uses. Raises,
        changing nothing: ``ValueError`` for a name that is not one of the
        pool's groups, for ``group=`` with a mapping, and for a mapping on
        a pool with one ``kv`` (:class:`CapacityError` on a pool without
        ``kv``); :class:`CapacityError` for a count that is not an int in
        range (the message names the group); the row and close errors as
        above.
        """
        self._check_thread()
        pages = self._pages
        if pages is None or group is not None:
            if k.__class__ is not int and isinstance(k, Mapping):
                return self._extend_groups("extend", row, k, group)
            pages = self._pages_for(group, "extend", "admit or extend with pages")
        if k.__class__ is not int or not 1 <= k <= pages.capacity:
            k = self._growth_count(pages, k, "extend")
        row = self._allocated_row(row, "extended")
        if self._closed:
            raise PoolClosedError("the pool is closed; no pages can be allocated")
        if self._released:
            return None
        return self._grow(pages, pages.extend, row, k)

    @overload
    def extend_rows(
        self, rows: Rows, k: Counts = 1, *, group: str | None = None
    ) -> torch.Tensor | None: ...

    @overload
    def extend_rows(
        self, rows: Rows, k: Mapping[str, Counts], *, group: None = None
    ) -> dict[str, torch.Tensor] | None: ...

    def extend_rows(
        self,
        rows: Rows,
        k: Counts | Mapping[str, Counts] = 1,
        *,
        group: str | None = None,
    ) -> torch.Tensor | dict[str, torch.Tensor] | None:
        """Add ``k`` pages to each of ``rows`` at once (a decode step's
        growth), all or nothing; never waits.

        Returns a ``(len(rows), k)`` int64 tensor, line ``i`` the new pages
        of ``rows[i]`` (they belong to it from now on), or None when fewer
        than ``len(rows) * k`` pages are free after reclaiming completed
        fences, or while the memory is released: nothing changed, and the
        scheduler retracts, as after :meth:`extend`. Read-only, as
        :meth:`extend`'s tensor: the line of a row that owned no pages is
        that row's record. One take and one tensor
        for the batch (``extend`` per row pays both per row). ``rows``: as
        :meth:`free` takes them. Raises :class:`CapacityError` for ``k`` not
        an int in ``1..kv.capacity`` or ``len(rows) * k`` past it,
        :class:`InvalidSlotError` unless the rows are distinct allocated
        rows, :class:`PoolClosedError` after :meth:`close`; changing nothing.

        ``k`` may also give one count per row (a sequence, 1-D array or 1-D
        tensor as long as ``rows``, each an int >= 0: a speculative step's
        growth, a chunked prefill's): then all of them or nothing, and a
        1-D int64 tensor of ``sum(k)`` pages, ``rows[i]``'s ``k[i]`` in row
        order (at ``sum(k[:i])``); :class:`CapacityError` for counts that
        are not that or whose sum is past ``kv.capacity``.

        On a pool with KV groups ``group=`` names the group to grow, as for
        :meth:`extend`; or ``k`` is a mapping ``{group: count}`` (one int
        count per named group, as :meth:`extend` takes it): each row gets
        that many pages in each named group, all or nothing across rows and
        groups, and the answer is a dict ``{group: (len(rows), count)
        tensor}``, or None taking nothing (counted as :meth:`extend`
        counts it); :class:`CapacityError` also for
        ``len(rows) * count`` past a group's capacity. A group's count may
        be one per row (a speculative step on a hybrid model): then every
        group's answer is flat, ``sum`` of its counts in row order, still
        all or nothing across rows and groups (an int counts for every
        row; :class:`CapacityError` naming the group for counts that are
        not ints >= 0 one per row or sum past its capacity).
        """
        self._check_thread()
        pages = self._pages
        if pages is None or group is not None:
            if k.__class__ is not int and isinstance(k, Mapping):
                return self._extend_groups("extend_rows", rows, k, group)
            pages = self._pages_for(group, "extend_rows", "admit or extend with pages")
        if k.__class__ is not int:
            if _per_row(k):
                return self._extend_each(pages, rows, k)
            k = self._growth_count(pages, k, "extend_rows")
        elif not 1 <= k <= pages.capacity:
            k = self._growth_count(pages, k, "extend_rows")
        led = self._ledger
        seq = led.as_rows(rows)
        led.check_allocated(seq, "extended")
        if self._closed:
            raise PoolClosedError("the pool is closed; no pages can be allocated")
        total = len(seq) * k
        if total > pages.capacity:
            raise CapacityError(
                f"cannot extend {len(seq)} rows by {k} pages each: {total} pages, and the "
                f"KV pool has only {pages.capacity}"
            )
        if self._released:
            return None
        if not total:
            return torch.zeros((0, k), dtype=torch.int64, device=pages.kv.device)
        return self._grow(pages, pages.extend_rows, seq, k)

    def _extend_each(self, pages: RowPages, rows: Rows, k: object) -> torch.Tensor | None:
        """:meth:`extend_rows` with one page count per row."""
        _check_ordered(rows, "extend_rows with one page count per row")
        led = self._ledger
        seq = led.as_rows(rows)
        counts = _page_counts(k, len(seq), "k")
        led.check_allocated(seq, "extended")
        if self._closed:
            raise PoolClosedError("the pool is closed; no pages can be allocated")
        total = sum(counts)
        if total > pages.capacity:
            raise CapacityError(
                f"cannot extend {len(seq)} rows by {total} pages in all, and the KV pool "
                f"has only {pages.capacity}"
            )
        if self._released:
            return None
        if not total:
            return torch.zeros(0, dtype=torch.int64, device=pages.kv.device)
        return self._grow(pages, pages.extend_each, seq, counts)

    @overload
    def extend_fitting(
        self, rows: Rows, k: Counts = 1, *, group: str | None = None
    ) -> tuple[int, torch.Tensor]: ...

    @overload
    def extend_fitting(
        self, rows: Rows, k: Mapping[str, Counts], *, group: None = None
    ) -> tuple[int, dict[str, torch.Tensor]]: ...

    def extend_fitting(
        self,
        rows: Rows,
        k: Counts | Mapping[str, Counts] = 1,
        *,
        group: str | None = None,
    ) -> tuple[int, torch.Tensor] | tuple[int, dict[str, torch.Tensor]]:
        """Grow ``rows`` in order, as many as the free pages cover; never waits.

        :meth:`extend_rows` for a scheduler that orders its running requests
        (by priority, by age) and retracts from the back when pages run
        short: ``rows[:m]`` each get ``k`` pages (or ``k[i]``, one count per
        row as :meth:`extend_rows` takes them) for the largest ``m`` whose
        pages are free after reclaiming completed fences, and the rows from
        ``rows[m]`` on get nothing. Returns ``(m, pages)``: for an int ``k``
        an ``(m, k)`` int64 tensor, line ``i`` the new pages of ``rows[i]``;
        for per-row counts a 1-D tensor of ``sum(k[:m])`` pages in row order.
        Read-only, as :meth:`extend`'s tensor. ``m == len(rows)``: every row
        grew (as :meth:`extend_rows` would have); ``m < len(rows)``: the
        scheduler retracts ``rows[m]`` or others (counted in
        ``stats().growth_refusals``; with per-row counts, rows after
        ``rows[m]`` that asked for 0 pages are not short: the caller knows
        which asked). Same takes as :meth:`extend`: free pages even while
        admissions queue. One take and one tensor for the run. Raises as
        :meth:`extend_rows` (:class:`CapacityError` for ``k`` not an int in
        ``1..kv.capacity`` or counts not ints in ``0..kv.capacity``,
        :class:`InvalidSlotError` unless the rows are distinct allocated
        rows, or for rows in a set, which has no order;
        :class:`PoolClosedError` after :meth:`close`; changing nothing),
        except that a total past ``kv.capacity`` is no error: the run stops
        where the pages do. On a pool with KV groups ``group=`` names the
        group to grow, as for :meth:`extend`; or ``k`` is a mapping
        ``{group: count}`` (one int count per named group, or one per row,
        as :meth:`extend_rows` takes it): ``rows[:m]`` each get their pages
        in every named group, for the largest ``m`` that every group's free
        pages cover, and the answer is ``(m, {group: (m, count) tensor})``,
        flat tensors of the run's pages in row order where a count is one
        per row (a refusal: once in ``stats().growth_refusals``, and in the
        ``kv_groups`` figure of every group whose free pages, after
        reclaiming its completed fences, could not cover all of ``rows``).
        """
        self._check_thread()
        pages = self._pages
        if pages is None or group is not None:
            if k.__class__ is not int and isinstance(k, Mapping):
                return self._extend_fitting_groups(rows, k, group)
            pages = self._pages_for(group, "extend_fitting", "admit or extend with pages")
        _check_ordered(rows, "extend_fitting")
        led = self._ledger
        seq = led.as_rows(rows)
        counts: list[int] | None = None  # one page count per row, or
        per_row = 0  # one for every row
        if k.__class__ is not int and _per_row(k):
            counts = _page_counts(k, len(seq), "k")
            if counts and max(counts) > pages.capacity:
                # One row's count past the pool can never be met, however
                # many rows are retracted for it: bad input, as an int k
                # past it is (a total past it is not: the run stops there).
                i = next(i for i, c in enumerate(counts) if c > pages.capacity)
                raise CapacityError(
                    f"extend_fitting: k[{i}] asks {counts[i]} pages for row {seq[i]}, and "
                    f"the KV pool has only {pages.capacity}: that row could never grow"
                )
        else:
            per_row = self._growth_count(pages, k, "extend_fitting")
        led.check_allocated(seq, "extended")
        if self._closed:
            raise PoolClosedError("the pool is closed; no pages can be allocated")
        if self._released:
            empty = np.zeros(0, dtype=np.int64)
            return 0, pages.out(empty if counts is not None else empty.reshape(0, per_row))
        if counts is None:
            m, got = self._grow(pages, pages.extend_fitting, seq, per_row)
        else:
            m, got = self._grow(pages, pages.extend_fitting_each, seq, counts)
        if m < len(seq):
            pages.growth_refusals += 1
        return m, got

    def _growth_count(self, pages: RowPages, k: object, call: str) -> int:
        """A growth's one page count (``1..capacity`` of ``pages``) off the
        fast path: ``ValueError`` for a mapping where one count is due
        (naming the rule), :class:`CapacityError` for anything else that
        is not such an int."""
        if isinstance(k, Mapping):
            if self._groups is None:
                raise ValueError(
                    f"{call}: this pool has one KV page pool and no KV groups: give a page "
                    "count (an int), not a mapping of group names to counts"
                )
            raise ValueError(
                f"{call} takes one page count with group=; a mapping {{group: count}} "
                "names its groups itself: give one or the other"
            )
        return check_page_count(k, pages.capacity, least=1)

    def _extend_groups(
        self, call: str, rows: Any, counts: Mapping[Any, Any], group: object
    ) -> dict[str, torch.Tensor] | None:
        """:meth:`extend` (``call`` ``"extend"``, one row) or
        :meth:`extend_rows` (``rows``) with a mapping ``{group: count}``:
        every named group's pages at once, all or nothing. Checks
        everything before it takes anything."""
        if call == "extend_rows" and any(_per_row(v) for v in counts.values()):
            return self._extend_groups_each(rows, counts, group)
        wants = self._growth_counts(call, counts, group)
        if call == "extend":
            seq: Sequence[int] = [self._allocated_row(rows, "extended")]
        else:
            led = self._ledger
            seq = led.as_rows(rows)
            led.check_allocated(seq, "extended")
            n = len(seq)
            for name, pages, k in wants:
                if n * k > pages.capacity:
                    raise CapacityError(
                        f"cannot extend {n} rows by {k} pages each in KV group {name!r}: "
                        f"{n * k} pages, and its KV pool has only {pages.capacity}"
                    )
        if self._closed:
            raise PoolClosedError("the pool is closed; no pages can be allocated")
        if self._released:
            return None
        return self._grow_groups(wants, seq, lines=call != "extend")

    def _extend_fitting_groups(
        self, rows: Rows, counts: Mapping[Any, Any], group: object
    ) -> tuple[int, dict[str, torch.Tensor]]:
        """:meth:`extend_fitting` with a mapping ``{group: count}``: the
        longest run ``rows[:m]`` that every named group's free pages cover
        (each short group reclaims its completed fences first) grows in
        every group. Checks everything before it takes anything."""
        if any(_per_row(v) for v in counts.values()):
            return self._extend_fitting_groups_each(rows, counts, group)
        wants = self._growth_counts("extend_fitting", counts, group)
        _check_ordered(rows, "extend_fitting")
        led = self._ledger
        seq = led.as_rows(rows)
        led.check_allocated(seq, "extended")
        if self._closed:
            raise PoolClosedError("the pool is closed; no pages can be allocated")
        n = len(seq)
        m, shorts, reclaimed = self._fitting_run(
            wants, n, lambda k: n * k, lambda k, free: free // k
        )
        if m:
            got = self._take_groups(wants, seq[:m], lines=True)
        else:
            got = {name: pages.out(np.zeros((0, k), dtype=np.int64)) for name, pages, k in wants}
        if shorts:
            self._count_refusal(shorts)
        if reclaimed and self._waiters.count:
            self._waiters.grant()
        return m, got

    def _named_groups(
        self, call: str, counts: Mapping[Any, Any], group: object
    ) -> dict[str, RowPages]:
        """The pool's groups, once a grouped growth's mapping ``counts`` is
        checked to name only them: ``ValueError`` for ``group=`` given too
        and for a name that is not one of the pool's groups;
        :class:`CapacityError` on a pool without KV groups."""
        if group is not None:
            raise ValueError(
                f"{call}: group= names the group of one page count, and a mapping "
                "{group: count} names its groups itself: give one or the other"
            )
        groups = self._groups
        if groups is None:
            # A pool with one kv comes here only with group= (refused above):
            # without it, its count check refuses a mapping (_growth_count).
            raise CapacityError(
                "this pool has no KV pages: build it with kv={group: KVPagePool(...)} "
                f"to {call} by group"
            )
        unknown = [key for key in counts if not isinstance(key, str) or key not in groups]
        if unknown:
            raise ValueError(
                f"unknown KV group {describe(unknown[0])} in the page counts; this pool's "
                f"groups are {self._group_words()}"
            )
        return groups

    def _growth_counts_each(
        self, call: str, rows: Rows, counts: Mapping[Any, Any], group: object
    ) -> tuple[Sequence[int], list[tuple[str, RowPages, list[int]]]]:
        """A grouped growth whose mapping gives some group one count per row
        (``extend_rows`` or ``extend_fitting``): the rows (checked: ordered,
        distinct, allocated) and ``(name, pages, counts)`` for each named
        group in the groups' order, ``counts`` one int >= 0 per row (an int
        in the mapping counts for every row). Raises as
        :meth:`_growth_counts`, :class:`CapacityError` naming the group for
        counts that are not that, and the rows' errors; changes nothing."""
        groups = self._named_groups(call, counts, group)
        _check_ordered(rows, f"{call} with one page count per row")
        led = self._ledger
        seq = led.as_rows(rows)
        n = len(seq)
        wants = []
        for name, pages in groups.items():
            if name in counts:
                try:
                    each = _page_counts(counts[name], n, "k")
                except CapacityError as exc:
                    raise CapacityError(f"KV group {name!r}: {exc}") from None
                wants.append((name, pages, each))
        led.check_allocated(seq, "extended")
        return seq, wants

    def _extend_groups_each(
        self, rows: Rows, counts: Mapping[Any, Any], group: object
    ) -> dict[str, torch.Tensor] | None:
        """:meth:`extend_rows` with a mapping that gives one count per row:
        every row's pages in every named group at once, all or nothing (a
        speculative step's growth on a hybrid model). Checks everything
        before it takes anything."""
        seq, wants = self._growth_counts_each("extend_rows", rows, counts, group)
        for name, pages, each in wants:
            total = sum(each)
            if total > pages.capacity:
                raise CapacityError(
                    f"KV group {name!r}: cannot extend {len(seq)} rows by {total} pages in "
                    f"all, and its KV pool has only {pages.capacity}"
                )
        if self._closed:
            raise PoolClosedError("the pool is closed; no pages can be allocated")
        if self._released:
            return None
        return self._grow_groups(wants, seq, lines=False)

    def _fitting_run(
        self,
        wants: Sequence[tuple[str, RowPages, _C]],
        n: int,
        need: Callable[[_C], int],
        fitting: Callable[[_C, int], int],
    ) -> tuple[int, list[RowPages], bool]:
        """The grouped :meth:`extend_fitting`'s run: how many of its ``n``
        rows every group's free pages cover (0 while released). A group
        short of ``need(count)`` pages reclaims its completed fences first;
        one still short caps the run at ``fitting(count, free)`` rows and is
        listed, to count the call as a refusal of its own. Answers the run's
        length, the short groups, and whether a reclaim returned pages (the
        grant loop runs after the growth)."""
        m = 0 if self._released else n
        shorts: list[RowPages] = []
        reclaimed = False
        if not m:
            return m, shorts, reclaimed
        for _, pages, count in wants:
            led = pages.ledger
            total = need(count)
            if _reclaim_short(led, total):
                reclaimed = True
            if total > led.free_count:
                m = min(m, fitting(count, led.free_count))
                shorts.append(pages)
        return m, shorts, reclaimed

    def _extend_fitting_groups_each(
        self, rows: Rows, counts: Mapping[Any, Any], group: object
    ) -> tuple[int, dict[str, torch.Tensor]]:
        """:meth:`extend_fitting` with a mapping that gives one count per
        row: the longest run ``rows[:m]`` whose counts every named group's
        free pages cover (each short group reclaims its completed fences
        first) grows in every group. Checks everything before it takes
        anything."""
        seq, wants = self._growth_counts_each("extend_fitting", rows, counts, group)
        for name, pages, each in wants:
            if each and max(each) > pages.capacity:
                i = next(i for i, c in enumerate(each) if c > pages.capacity)
                raise CapacityError(
                    f"KV group {name!r}: extend_fitting: k[{i}] asks {each[i]} pages for row "
                    f"{seq[i]}, and its KV pool has only {pages.capacity}: that row could "
                    "never grow"
                )
        if self._closed:
            raise PoolClosedError("the pool is closed; no pages can be allocated")
        # The longest run of rows whose counts fit: its running sums are the
        # ones up to what is free.
        m, shorts, reclaimed = self._fitting_run(
            wants,
            len(seq),
            sum,
            lambda each, free: bisect.bisect_right(list(itertools.accumulate(each)), free),
        )
        got = self._take_groups([(n, p, each[:m]) for n, p, each in wants], seq[:m], lines=False)
        if shorts:
            self._count_refusal(shorts)
        if reclaimed and self._waiters.count:
            self._waiters.grant()
        return m, got

    def _growth_counts(
        self, call: str, counts: Mapping[Any, Any], group: object
    ) -> list[tuple[str, RowPages, int]]:
        """``call``'s (a grouped growth's) ``{group: count}`` as ``(name,
        pages, count)`` for each group it names, in the groups' order (a
        group it does not name grows by nothing). ``ValueError`` for
        ``group=`` given too and for a name that is not one of the pool's
        groups; :class:`CapacityError` on a pool without KV groups and for
        a count that is not an int in ``0..capacity`` of its group."""
        groups = self._named_groups(call, counts, group)
        wants = []
        for name, pages in groups.items():
            if name in counts:
                try:
                    wants.append((name, pages, self._count_for(pages, counts[name], 0)))
                except CapacityError as exc:
                    raise CapacityError(f"KV group {name!r}: {exc}") from None
        return wants

    def _grow_groups(
        self, wants: Sequence[_GroupWant], rows: Sequence[int], lines: bool
    ) -> dict[str, torch.Tensor] | None:
        """Give each of ``rows`` (checked) ``k`` pages in every group of
        ``wants`` (``k`` one count for every row, or a list of one per row),
        all or nothing; None, taking nothing, when any group is short after
        reclaiming its completed fences.

        The rule of :meth:`_grow`: free pages are taken even while
        admissions queue, a short group reclaims first, and if a reclaim
        returned pages the grant loop runs after the growth (taken or not),
        so the queued waiters get the rest. Every group's tensor is made
        before any page is recorded: if one cannot be made (a device
        error), every group's pages go back and the error propagates. With
        ``lines`` false (one row, as :meth:`extend`; per-row counts) a
        group's tensor is 1-D; otherwise ``(len(rows), k)``, as
        :meth:`extend_rows`'.
        """
        n = len(rows)
        reclaimed = False
        shorts: list[RowPages] = []
        for _, pages, k in wants:
            led = pages.ledger
            total = n * k if isinstance(k, int) else sum(k)
            if _reclaim_short(led, total):
                reclaimed = True
            if total > led.free_count:
                shorts.append(pages)
        if shorts:
            self._count_refusal(shorts)
            got = None
        else:
            got = self._take_groups(wants, rows, lines)
        if reclaimed and self._waiters.count:
            self._waiters.grant()
        return got

    def _count_refusal(self, shorts: list[RowPages]) -> None:
        """One grouped growth refused, short in each group of ``shorts``:
        each counts it in its own ``growth_refusals`` (a dashboard per group
        shows which runs short), and ``stats().growth_refusals`` counts the
        call once (the counts past the first are repeats, written before
        the groups' own: see the pool's ``_growth_refusal_repeats``)."""
        self._growth_refusal_repeats += len(shorts) - 1
        for pages in shorts:
            pages.growth_refusals += 1

    def _take_groups(
        self, wants: Sequence[_GroupWant], rows: Sequence[int], lines: bool
    ) -> dict[str, torch.Tensor]:
        """:meth:`_grow_groups` once every group is counted free: take, make
        every tensor, then record (``rows[i]``'s pages at ``i * k``, or at
        ``sum(counts[:i])`` for per-row counts, which ``lines`` never is)."""
        n = len(rows)
        taken = []
        for _, pages, k in wants:
            arr = pages.take(n * k if isinstance(k, int) else sum(k))
            assert arr is not None  # counted free
            taken.append(arr)
        try:
            outs = {
                name: pages.out(arr.reshape(n, k) if lines and isinstance(k, int) else arr)
                for (name, pages, k), arr in zip(wants, taken, strict=True)
            }
        except BaseException:
            for (_, pages, _), arr in zip(wants, taken, strict=True):
                if arr.shape[0]:
                    pages.ledger.put_back(arr, OWNED)
            raise
        for (_, pages, k), arr in zip(wants, taken, strict=True):
            if arr.shape[0]:
                if isinstance(k, int):
                    pages.record_lines(rows, arr, k)
                else:
                    pages.record_counts(rows, k, arr)
        return outs

    def _grow(self, pages: RowPages, grow: Callable[[Any, Any], _Got], rows: Any, k: Any) -> _Got:
        """``grow(rows, k)`` (a growth of ``pages``), then the grant loop if the
        growth reclaimed completed fences: it may have made free more than
        it took, and queued admissions may fit now. A None answer counts as
        a growth refusal (``extend_fitting`` counts its short runs itself)."""
        pled = pages.ledger
        reclaimed = pled.reclaimed
        got = grow(rows, k)
        if got is None:
            pages.growth_refusals += 1
        if pled.reclaimed != reclaimed and self._waiters.count:
            self._waiters.grant()
        return got

    def detach_pages(
        self, row: SupportsIndex, *, host: bool = False, group: str | None = None
    ) -> torch.Tensor:
        """Hand ``row``'s pages to the caller, who owns them from now on.

        For prefix caching: the caller keeps them (in a radix tree, say) and
        frees them to the :class:`KVPagePool` later, fenced as well (its
        ``free(pages, fence=..., after=...)``; a completion wakes this
        pool's waiters). The row's recorded uses stay with the row, not the
        pages: the step in flight may still use them, so that later free
        needs a fence at least as new as the row's newest step (and each
        step that read them since). A later :meth:`free` of ``row`` frees only pages
        it owns then. After :meth:`drop_pages` only the live pages are
        handed over (no page 0): read :meth:`pages_dropped` first for the
        position of the first one; the row's dropped count goes with its
        pages (0 after this call). The tensor lists the pages the row was granted, even
        if its record (``grant.pages``, ``pages_of``) was written into since
        (then a fresh tensor, not that record). On the ``KVPagePool``'s
        device; with ``host=True`` on the CPU, no copy to the device (on a
        CUDA pool: the ids to keep in a prefix cache and give to
        ``kv.free`` later, which then reads nothing back). Raises
        :class:`InvalidSlotError` unless ``row`` is allocated. On a pool
        with KV groups ``group=`` names the group whose pages to hand over
        (required there; the row keeps its other groups' pages, freed with
        it); elsewhere it must be None (``ValueError`` for either mistake).
        """
        self._check_thread()
        pages = self._pages
        if pages is None or group is not None:
            pages = self._pages_or_none(group, "detach_pages")
        row = self._allocated_row(row, "detached from its pages")
        if pages is None:
            return torch.zeros(0, dtype=torch.int64)
        return pages.detach(row, host)

    def trim_pages(
        self,
        rows: Rows,
        keep: Counts | Mapping[str, Counts],
        fence: Fences | None = None,
        *,
        after: HostStream | torch.Stream | None = None,
        group: str | None = None,
    ) -> int:
        """Give back each row's pages past its first ``keep``; the rows keep those.

        For speculative decoding's rollback (pages that held only rejected
        draft tokens) and for shrinking requests instead of retracting them.
        The pages given back wait, as at :meth:`free`, for their row's
        newest recorded use per stream plus ``fence`` (one fence, or a sequence
        of fences, every one waited for) and ``after`` (a fence
        recorded on it now, once the call is checked): the step in flight
        may still write them. Each row keeps its recorded uses, its first
        pages (in order) and its row of the tables, whose slots past those
        pages the engine stops using. ``rows``: as :meth:`free` takes them
        (one row, or a step's rows at once: one call, one check and one
        deferral for all). ``keep``: one page count for every row, or one
        per row (a sequence, array or 1-D tensor as long as ``rows``). A row
        that owns ``keep`` pages or fewer is left as it is. ``keep`` counts
        positions, those :meth:`drop_pages` gave back included: a ``keep``
        at or under :meth:`pages_dropped` gives back every page the row
        owns, and the row keeps ``keep`` dropped positions. Returns the
        pages free at once. Raises, changing nothing: :class:`CapacityError`
        for a ``keep`` that is not an int >= 0 (or one per row),
        :class:`InvalidSlotError` unless the rows are distinct allocated
        rows or for a record written into (as :meth:`free`), ``TypeError``
        for a non-fence (as :meth:`free`); :class:`CapacityError` on a pool
        without ``kv``. On a pool with KV groups ``group=`` names the group
        to trim (required there); elsewhere it must be None (``ValueError``
        for either mistake or an unknown name).
        Allowed after :meth:`close`, as :meth:`free`.

        Every group at once (a hybrid model's rollback): ``keep`` a mapping
        ``{group: keep}`` naming any of the pool's groups (those it leaves
        out keep every page), each value one count or one per row, as
        above. Every group's input is checked, and every group's pages
        (:meth:`free`'s checks), before any group changes: a bad value, row
        or record in any group raises as above (the message names the
        group), nothing changed in any group. One ``after`` fence and one
        verdict per fence for the whole call; returns the pages free at
        once, summed over the groups. ``ValueError`` for ``group=`` with a
        mapping, an unknown group, or a mapping on a pool with one ``kv``.
        """
        self._check_thread()
        if keep.__class__ is not int and isinstance(keep, Mapping):
            return self._give_back_groups("trim_pages", rows, keep, fence, after, group)
        pages = self._pages
        if pages is None or group is not None:
            pages = self._pages_for(group, "trim_pages", "trim a row's pages")
        if rows.__class__ is int and keep.__class__ is int:
            # One row and one count (a loop over a step's rows): the row as
            # _allocated_row checks it, and nothing to do when it owns no
            # more than it keeps (the usual row), with no fence to check.
            assert isinstance(rows, int) and isinstance(keep, int)
            if keep >= 0 and 0 < rows < self.size and self._state[rows] in (1, 6):
                owned = pages.owned[rows]
                if (
                    fence is None
                    and after is None
                    and (owned is None or len(owned) <= keep)
                    and (not pages.holes or rows not in pages.holes)
                ):
                    return 0
                seq: Sequence[int] = [rows]
                keeps = [keep]
            else:
                seq = [self._allocated_row(rows, "trimmed")]
                keeps = _page_counts(keep, 1, "keep")
        else:
            if _per_row(keep):
                _check_ordered(rows, "trim_pages with one keep per row")
            seq = self._ledger.as_rows(rows)
            keeps = _page_counts(keep, len(seq), "keep")
        led = self._ledger
        led.check_allocated(seq, "trimmed")
        extra: tuple[Fence, ...] = () if fence is None else fence_list(fence)
        if after is not None:
            check_after(after)
        prepared = pages.prepare_free(seq, self._uses, keeps)
        holes = pages.holes
        if not prepared:
            if holes:  # positions only: a row keeps at most `keep` dropped ones
                pages.trim_holes(seq, keeps)
            return 0
        kept = dict(zip(seq, keeps, strict=True))  # positions; free() takes pages
        if holes:
            kept = {row: max(0, k - holes.get(row, 0)) for row, k in kept.items()}
        immediate = self._give_back_positions(pages, prepared, extra, after, keep=kept)
        if holes:
            pages.trim_holes(seq, keeps)
        if immediate and self._waiters.count:
            self._waiters.grant()
        return immediate

    def drop_pages(
        self,
        rows: Rows,
        below: Counts | Mapping[str, Counts],
        fence: Fences | None = None,
        *,
        after: HostStream | torch.Stream | None = None,
        group: str | None = None,
    ) -> int:
        """Give back each row's pages at positions before ``below``; the rows
        keep their later pages at their positions.

        For sliding-window attention: the pages that slid out of the window
        return to circulation while the request runs. Positions count from
        the row's first page (granted, then grown); the dropped ones stay
        positions: :meth:`pages_of` reads them as page 0 (the page pool's
        reserved padding page, so a block table indexed by position stays
        valid), :meth:`pages_dropped` counts them, :meth:`extend` appends
        after the last position, and ``trim_pages(keep=k)`` counts them
        among its ``k``. The pages given back wait, as at :meth:`trim_pages`,
        for their row's newest recorded use per stream plus ``fence`` (one
        fence, or a sequence of fences, every one waited for) and ``after``
        (a fence recorded on it now, once the call is checked): the step in
        flight may still read them. ``rows``: as :meth:`trim_pages` takes
        them. ``below``: one position for every row, or one per row (a
        sequence, array or 1-D tensor as long as ``rows``), each an int
        from 0 to the row's positions (dropped ones included); positions
        already dropped are not dropped again (a ``below`` at or under
        :meth:`pages_dropped` leaves the row as it is). The rest of each
        row's pages stays where it is: a drop writes nothing, so tensors
        handed out before (``grant.pages``, ``pages_of``, an extend's) keep
        what they read, and it costs the pages dropped, not those kept
        (only the check for a record written into, as at :meth:`free`,
        reads the row's record whole). Returns the pages free at once. Raises, changing nothing:
        :class:`CapacityError` for a ``below`` that is not an int >= 0 (or
        one per row) or that is past a row's positions (the engine computes
        it from the row's length: a larger one is a bug),
        :class:`InvalidSlotError` unless the rows are distinct allocated
        rows, for rows in a set with one ``below`` per row, or for a record
        written into (as :meth:`free`), ``TypeError`` for a non-fence (as
        :meth:`free`); :class:`CapacityError` on a pool without ``kv``. On
        a pool with KV groups ``group=`` names the group (required there;
        the sliding-window group); elsewhere it must be None (``ValueError``
        for either mistake or an unknown name). Allowed after
        :meth:`close`, as :meth:`free`.

        Every group at once: ``below`` a mapping ``{group: below}``, as
        :meth:`trim_pages` takes ``{group: keep}``: the groups it names
        drop, the others keep their pages; all checked before any changes
        (``below`` past a row's positions in any group: nothing dropped
        anywhere), one verdict per fence, the pages free at once summed.
        """
        self._check_thread()
        if below.__class__ is not int and isinstance(below, Mapping):
            return self._give_back_groups("drop_pages", rows, below, fence, after, group)
        pages = self._pages
        if pages is None or group is not None:
            pages = self._pages_for(group, "drop_pages", "drop a row's pages")
        if _per_row(below):
            _check_ordered(rows, "drop_pages with one below per row")
        led = self._ledger
        seq = led.as_rows(rows)
        belows = _page_counts(below, len(seq), "below")
        led.check_allocated(seq, "dropped from")
        for row, b in zip(seq, belows, strict=True):
            have = pages.position_count(row)
            if b > have:
                raise CapacityError(
                    f"cannot drop row {row}'s pages below position {b}: it has only "
                    f"{have} page positions (dropped ones included)"
                )
        extra: tuple[Fence, ...] = () if fence is None else fence_list(fence)
        if after is not None:
            check_after(after)
        prepared = pages.prepare_free(seq, self._uses, belows=belows)
        if not prepared:
            return 0
        immediate = self._give_back_positions(
            pages, prepared, extra, after, below=dict(zip(seq, belows, strict=True))
        )
        if immediate and self._waiters.count:
            self._waiters.grant()
        return immediate

    def _give_back_groups(
        self,
        call: Literal["trim_pages", "drop_pages"],
        rows: Rows,
        values: Mapping[Any, Any],
        fence: Fences | None,
        after: Any | None,
        group: object,
    ) -> int:
        """:meth:`trim_pages` (``values`` ``{group: keep}``) or
        :meth:`drop_pages` (``{group: below}``) in every named group at
        once. Checks everything in every group (the values, the rows, the
        fences, each group's pages as :meth:`RowPages.prepare_free` does)
        before any group changes; then one ``after`` fence and one verdict
        per fence (the page ledgers share the call's answers, as at a
        grouped :meth:`free`)."""
        trim = call == "trim_pages"
        name = "keep" if trim else "below"
        if group is None and self._groups is None and self._pages is not None:
            raise ValueError(
                f"{call}: this pool has one KV page pool and no KV groups: give {name} as a "
                "count or one per row, not a mapping of group names to them"
            )
        groups = self._named_groups(call, values, group)
        if any(_per_row(v) for v in values.values()):
            _check_ordered(rows, f"{call} with one {name} per row")
        led = self._ledger
        seq = led.as_rows(rows)
        n = len(seq)
        plans: list[tuple[str, RowPages, list[int]]] = []
        for gname, pages in groups.items():
            if gname in values:
                try:
                    counts = _page_counts(values[gname], n, name)
                except CapacityError as exc:
                    raise CapacityError(f"KV group {gname!r}: {exc}") from None
                plans.append((gname, pages, counts))
        led.check_allocated(seq, "trimmed" if trim else "dropped from")
        if not trim:
            for gname, pages, counts in plans:
                for row, b in zip(seq, counts, strict=True):
                    have = pages.position_count(row)
                    if b > have:
                        raise CapacityError(
                            f"KV group {gname!r}: cannot drop row {row}'s pages below "
                            f"position {b}: it has only {have} page positions (dropped "
                            "ones included)"
                        )
        extra: tuple[Fence, ...] = () if fence is None else fence_list(fence)
        if after is not None:
            check_after(after)
        uses = self._uses
        prepared = [
            pages.prepare_free(seq, uses, counts)
            if trim
            else pages.prepare_free(seq, uses, belows=counts)
            for _, pages, counts in plans
        ]
        # Everything is checked: from here on each group changes.
        if after is not None and any(prepared):
            extra = (*extra, record_fence(after))
        answers: dict[Any, Any] = {}
        for _, pages, _ in plans:
            pages.ledger.answers = answers
        immediate = 0
        try:
            for (_, pages, counts), one in zip(plans, prepared, strict=True):
                holes = pages.holes
                if not trim:
                    if one:
                        below = dict(zip(seq, counts, strict=True))
                        immediate += pages.free(one, extra, below=below)
                    continue
                if one:
                    kept = dict(zip(seq, counts, strict=True))  # positions; free() takes pages
                    if holes:
                        kept = {row: max(0, k - holes.get(row, 0)) for row, k in kept.items()}
                    immediate += pages.free(one, extra, kept)
                if holes:
                    pages.trim_holes(seq, counts)
        finally:
            for _, pages, _ in plans:
                pages.ledger.answers = None
        if immediate and self._waiters.count:
            self._waiters.grant()
        return immediate

    @staticmethod
    def _give_back_positions(
        pages: RowPages,
        prepared: Any,
        extra: tuple[Fence, ...],
        after: Any | None,
        *,
        keep: dict[int, int] | None = None,
        below: dict[int, int] | None = None,
    ) -> int:
        """:meth:`trim_pages`' and :meth:`drop_pages`' give-back once
        everything is checked: a fence recorded on ``after`` now, then the
        pages ``prepared`` freed behind their fences plus ``extra`` with one
        verdict per fence for the call (``Deferrals.answer``), cut to
        ``keep`` or from ``below`` (:meth:`RowPages.free`). Returns the pages
        free at once; the caller runs the grant loop."""
        if after is not None:
            extra = (*extra, record_fence(after))
        pled = pages.ledger
        pled.answers = {}
        try:
            return pages.free(prepared, extra, keep, below)
        finally:
            pled.answers = None

    def pages_dropped(self, row: SupportsIndex, *, group: str | None = None) -> int:
        """How many of ``row``'s first positions :meth:`drop_pages` gave back
        (read as page 0 by :meth:`pages_of`): the position of the row's
        first live page, to map :meth:`detach_pages`' tensor (its live
        pages only) back to positions. 0 for a row that never dropped, and
        after the row's pages are detached or it is trimmed to ``keep`` 0;
        a trim to a ``keep`` at or under the count leaves it ``keep``. Raises
        :class:`InvalidSlotError` unless ``row`` is allocated; 0 on a pool
        without ``kv``. ``group=`` as for :meth:`pages_of`.
        """
        self._check_thread()
        pages = self._pages
        if pages is None or group is not None:
            pages = self._pages_or_none(group, "pages_dropped")
        row = self._allocated_row(row, "asked for its dropped pages")
        if pages is None or not pages.holes:
            return 0
        return pages.holes.get(row, 0)

    def _free_with_pages(self, rows: Rows, after: Any | None, fence: Fences | None) -> int:
        """:meth:`free` on a pool with ``kv``: rows and the pages they own.

        Checks everything (rows, fence or fences, ``after``, the pages in
        the page ledger) before changing anything, and records no fence on
        ``after`` for a refused free. Each row's pages wait for the row's
        recorded use plus ``fence`` and ``after``: exactly the row's own
        fences.
        """
        pages = self._pages
        if pages is None:
            return self._free_with_groups(rows, after, fence)
        if fence is None and after is None and rows.__class__ is list and len(rows) == 1:
            # Fast path: one row, no fence, no recorded use: its pages and
            # then the row are free at once (the pages are checked first).
            row = rows[0]
            state = self._state
            if (
                row.__class__ is int
                and 0 < row < self.size
                and state[row] == 1  # ALLOCATED (USED: a recorded use)
            ):
                arr = pages.owned[row]
                if arr is not None:
                    if arr.tobytes() != pages.sealed[row]:  # check_record, inlined
                        raise pages.written_error(row)  # nothing changed yet
                    pled = pages.ledger
                    # The row's own record, as sealed (distinct and in range,
                    # RowPages docstring): a few pages in one checking Python
                    # pass; more with a vectorised check that each is still
                    # OWNED. Either changes nothing if a check fails, and
                    # prepare() then raises.
                    if not (
                        pled._free_now_small(arr.tolist(), OWNED)
                        if arr.shape[0] <= _TRUSTED_PASS
                        else pled.free_owned(arr, OWNED)
                    ):
                        ids, fresh = pled.prepare(arr, "freed", OWNED)
                        pled.free_prepared(ids, fresh)
                    pages.owned[row] = None
                    pages.sealed[row] = None
                    pages.grown[row] = None
                if pages.holes:
                    pages.holes.pop(row, None)
                state[row] = 0  # FREE
                self._free_q.append(row)
                if self._waiters.count:
                    self._waiters.grant()
                return 1
        led = self._ledger
        if after is not None:
            check_after(after)
        extra: tuple[Fence, ...] = () if fence is None else fence_list(fence)
        seq = led.as_rows(rows)
        led.check_allocated(seq, "freed")
        prepared = pages.prepare_free(seq, self._uses)
        if after is not None and len(seq):  # an empty free records no fence
            step = record_fence(after)
            led.record_use(seq, step, "freed")
            extra = (*extra, step)
        # One verdict per fence for a row and its pages (and every group of
        # pages): both ledgers share the answers of this call (Deferrals.answer).
        pled = pages.ledger
        led.answers = pled.answers = {}
        try:
            freed_pages = pages.free(prepared, extra)
            if pages.holes:
                pages.forget(seq)
            immediate = led.free(seq, fence)
        finally:
            led.answers = pled.answers = None
        if (immediate or freed_pages) and self._waiters.count:
            self._waiters.grant()
        return immediate

    def _free_with_groups(self, rows: Rows, after: Any | None, fence: Fences | None) -> int:
        """:meth:`free` on a pool with KV groups: rows and every group's
        pages they own. Checks everything (rows, fences, ``after``, every
        group's pages) before changing anything; one verdict per fence for
        the whole call (every ledger shares its answers). The one-kv twin
        in :meth:`_free_with_pages` stays inline: through this general form
        (a sequence of one set) its fenced free measured about 1 µs (11 %)
        slower a call."""
        if fence is None and after is None and rows.__class__ is list and len(rows) == 1:
            # Fast path, the one-kv free's (_free_with_pages) for every
            # group: one row, no fence, no recorded use (state ALLOCATED,
            # not USED): its pages in every group and then the row are free
            # at once. Anything it cannot vouch for goes the general way
            # below, which raises for it with nothing changed.
            row = rows[0]
            if (
                row.__class__ is int
                and 0 < row < self.size
                and self._state[row] == 1  # ALLOCATED (USED: a recorded use)
                and self._free_groups_owned(row)
            ):
                self._state[row] = 0  # FREE
                self._free_q.append(row)
                if self._waiters.count:
                    self._waiters.grant()
                return 1
        led = self._ledger
        if after is not None:
            check_after(after)
        extra: tuple[Fence, ...] = () if fence is None else fence_list(fence)
        seq = led.as_rows(rows)
        led.check_allocated(seq, "freed")
        sets = self._page_sets
        prepared = [pages.prepare_free(seq, self._uses) for pages in sets]
        if after is not None and len(seq):  # an empty free records no fence
            step = record_fence(after)
            led.record_use(seq, step, "freed")
            extra = (*extra, step)
        answers: dict[Any, Any] = {}
        led.answers = answers
        for pages in sets:
            pages.ledger.answers = answers
        try:
            freed_pages = 0
            for pages, one in zip(sets, prepared, strict=True):
                freed_pages += pages.free(one, extra)
                if pages.holes:
                    pages.forget(seq)
            immediate = led.free(seq, fence)
        finally:
            led.answers = None
            for pages in sets:
                pages.ledger.answers = None
        if (immediate or freed_pages) and self._waiters.count:
            self._waiters.grant()
        return immediate

    def _free_groups_owned(self, row: int) -> bool:
        """Free ``row``'s own pages in every group at once (no fence, no
        recorded use: the caller checked), all or nothing; True if done.

        Every group's record must be as sealed (checked for all before any
        page moves: one written into is the general path's to refuse), and
        each page still OWNED, as the one-kv fast free checks it: a few
        pages in one checking pass, more vectorised. A group whose check
        fails changes nothing, and the groups freed before it are undone
        (:meth:`PageLedger.unfree`): False, the pool as it was.
        """
        sets = self._page_sets
        for pages in sets:
            arr = pages.owned[row]
            if arr is not None and arr.tobytes() != pages.sealed[row]:
                return False  # written into: the general path raises
        for i, pages in enumerate(sets):
            arr = pages.owned[row]
            if arr is None:
                continue
            pled = pages.ledger
            if not (
                pled._free_now_small(arr.tolist(), OWNED)
                if arr.shape[0] <= _TRUSTED_PASS
                else pled.free_owned(arr, OWNED)
            ):
                for done in sets[:i]:
                    freed = done.owned[row]
                    if freed is not None:
                        done.ledger.unfree(freed, OWNED)
                return False
        for pages in sets:
            pages.owned[row] = None
            pages.sealed[row] = None
            pages.grown[row] = None
            if pages.holes:
                pages.holes.pop(row, None)
        return True
