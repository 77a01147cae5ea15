"""Growth: more pages for rows already allocated, never waiting.

The part of :class:`~asyncpool.AsyncReqToTokenPool` that grows the pages a
row owns (``kv=``): ``extend`` (one row), ``extend_rows`` (many rows, all or
nothing) and ``extend_fitting`` (the longest run of rows, in order, that
fits), each on one kv, one named KV group or several groups at once
(``{group: count}``, all or nothing across them). A growth takes free pages
at once or refuses (None, counted in ``growth_refusals``): it never waits
and never queues, since waiting behind new admissions could deadlock; pages
that a growth's reclaim made free go to the queued admissions (the grant
loop runs after it). A mixin with no state of its own, on
:class:`~asyncpool.page_args.PageArgs` (the pool's state and the argument
checks it shares with admission and give-back).

Thread rules: the pool's (:mod:`asyncpool.pool`). Every call here is
checked: a pool with ``kv`` never opens the unchecked fast paths. Nothing
here awaits, so a cancellation never lands part way through a growth.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, SupportsIndex, TypeVar, overload

import numpy as np
import torch

from .base import count_of as _count
from .errors import CapacityError, PoolClosedError
from .kv_pages import OWNED, PageLedger
from .ledger import Rows, SlotLedger
from .page_args import Counts, PageArgs, _check_ordered, _page_counts, _per_row
from .row_pages import RowPages, check_page_count

__all__ = ["Growth"]


def _reclaim_short(
    rows: SlotLedger, held: Sequence[int], needs: Sequence[tuple[PageLedger, int]]
) -> bool:
    """A grouped growth's reclaim: each group with fewer than its need of
    pages free reclaims its completed fences, with the growth's rows
    ``held`` (:meth:`SlotLedger.hold`: a fence's ``query()`` may call the
    pool back, and must not change them meanwhile); True if that returned
    any (the grant loop then runs after the growth). The caller counts
    what is free after all of them: code run by a later group's
    ``query()`` may take pages an earlier group made free."""
    short = [led for led, need in needs if need > led.free_count and led.pending]
    if not short:
        return False
    reclaimed = False
    rows.hold(held)
    try:
        for led in short:
            before = led.reclaimed
            led.reclaim()
            if led.reclaimed != before:
                reclaimed = True
    finally:
        rows.unhold(held)
    return reclaimed


_Got = TypeVar("_Got")  # what a growth answers: pages, None, or (m, pages)
_C = TypeVar("_C")  # a grouped growth's count for one group: one int, or one per row
#: A grouped growth's want for one group: its name, its pages, and one page
#: count for every row or a list of one per row.
_GroupWant = tuple[str, RowPages, int | list[int]]


class Growth(PageArgs):
    """Growth of allocated rows' pages, mixed into ``AsyncReqToTokenPool``.

    The methods below are the pool's; see
    :class:`~asyncpool.AsyncReqToTokenPool` for the public contract of each
    call defined here.
    """

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
                f"cannot extend {_count(len(seq), 'row')} by {_count(k, 'page')} each: "
                f"{total} pages, and the KV pool has only {pages.capacity}"
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
                f"cannot extend {_count(len(seq), 'row')} by {total} pages in all, and the KV "
                f"pool has only {pages.capacity}"
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
        flat tensors of the run's pages in row order in every group when a
        count is one per row (an int beside it counts for every row and
        answers flat too; a refusal: once in ``stats().growth_refusals``, and in the
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
                        f"cannot extend {_count(n, 'row')} by {_count(k, 'page')} each in KV group "
                        f"{name!r}: {n * k} pages, and its KV pool has only {pages.capacity}"
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
            wants, seq, lambda k: n * k, lambda k, free: free // k
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
                    f"KV group {name!r}: cannot extend {_count(len(seq), 'row')} by {total} "
                    f"pages in all, and its KV pool has only {pages.capacity}"
                )
        if self._closed:
            raise PoolClosedError("the pool is closed; no pages can be allocated")
        if self._released:
            return None
        return self._grow_groups(wants, seq, lines=False)

    def _fitting_run(
        self,
        wants: Sequence[tuple[str, RowPages, _C]],
        rows: Sequence[int],
        need: Callable[[_C], int],
        fitting: Callable[[_C, int], int],
    ) -> tuple[int, list[RowPages], bool]:
        """The grouped :meth:`extend_fitting`'s run: how many of its
        ``rows`` every group's free pages cover (0 while released). A group
        short of ``need(count)`` pages reclaims its completed fences first;
        one still short caps the run at ``fitting(count, free)`` rows and is
        listed, to count the call as a refusal of its own. Answers the run's
        length, the short groups, and whether a reclaim returned pages (the
        grant loop runs after the growth)."""
        m = 0 if self._released else len(rows)
        shorts: list[RowPages] = []
        if not m:
            return m, shorts, False
        totals = [need(count) for _, _, count in wants]
        reclaimed = _reclaim_short(
            self._ledger,
            rows,
            [(pages.ledger, total) for (_, pages, _), total in zip(wants, totals, strict=True)],
        )
        for (_, pages, count), total in zip(wants, totals, strict=True):
            free = pages.ledger.free_count
            if total > free:
                m = min(m, fitting(count, free))
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
            seq,
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
        totals = [n * k if isinstance(k, int) else sum(k) for _, _, k in wants]
        reclaimed = _reclaim_short(
            self._ledger,
            rows,
            [(pages.ledger, total) for (_, pages, _), total in zip(wants, totals, strict=True)],
        )
        shorts = [
            pages
            for (_, pages, _), total in zip(wants, totals, strict=True)
            if total > pages.ledger.free_count
        ]
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
