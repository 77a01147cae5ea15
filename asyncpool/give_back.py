"""Give-back: a row's pages returned to the page pool, and ``free`` of rows
that own pages.

The part of :class:`~asyncpool.AsyncReqToTokenPool` that takes pages from
rows (``kv=``): ``detach_pages`` (hand a row's pages to the caller, for a
prefix cache), ``trim_pages`` (give back each row's pages past its first
``keep``: speculative decoding's rollback), ``drop_pages`` (give back each
row's first pages: a sliding window's), ``pages_dropped`` (the position of
a row's first live page), and :meth:`free` of rows that own pages (the
pool's ``free`` calls ``_free_with_pages``), on one kv or KV groups. Pages
given back wait, as at ``free``, behind their row's recorded uses and the
call's fences; those free at once go to the queued admissions in the call.
A mixin with no state of its own, on :class:`~asyncpool.page_args.PageArgs`
(the pool's state and the argument checks it shares with admission and
growth).

Thread rules: the pool's (:mod:`asyncpool.pool`). Every call here is
checked: a pool with ``kv`` never opens the unchecked fast paths. Nothing
here awaits, so a cancellation never lands part way through a give-back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, SupportsIndex

import torch

from .errors import CapacityError
from .fences import Fence, Fences, HostStream, check_after, fence_list, record_fence
from .kv_pages import OWNED
from .ledger import Rows
from .page_args import Counts, PageArgs, _check_ordered, _page_counts, _per_row
from .row_pages import RowPages

__all__ = ["GiveBack"]

# Freeing a row's own pages (no fence): up to this many go through the page
# ledger's one-pass check-and-free (about 0.1 us a page), more through the
# seal test and its vectorised free_owned (under 1 us whatever the count).
_TRUSTED_PASS = 8


def _check_below(
    pages: RowPages, rows: Sequence[int], belows: Sequence[int], where: str = ""
) -> None:
    """:class:`CapacityError` (``where`` starting its message: the group of
    a grouped drop) for a ``below`` past its row's positions, dropped ones
    included: what :meth:`GiveBack.drop_pages` checks before any change."""
    owned = pages.owned
    holes = pages.holes
    for row, b in zip(rows, belows, strict=True):
        if not b:
            continue  # never past (b >= 0: checked)
        # the row's positions (its dropped ones and its pages), inline: the per-row cost of a drop.
        record = owned[row]
        have = (0 if record is None else len(record)) + (holes.get(row, 0) if holes else 0)
        if b > have:
            raise CapacityError(
                f"{where}cannot drop row {row}'s pages below position {b}: it has only "
                f"{have} page positions (dropped ones included)"
            )


def _kept_pages(pages: RowPages, rows: Sequence[int], keeps: Sequence[int]) -> dict[int, int]:
    """A trim's ``keep`` positions as the live pages each row keeps (its
    dropped positions count among the kept ones): what :meth:`RowPages.free`
    takes."""
    holes = pages.holes
    if not holes:
        return dict(zip(rows, keeps, strict=True))
    return {row: max(0, k - holes.get(row, 0)) for row, k in zip(rows, keeps, strict=True)}


class GiveBack(PageArgs):
    """Give-back and the free of rows with pages, mixed into ``AsyncReqToTokenPool``.

    The methods below are the pool's; see
    :class:`~asyncpool.AsyncReqToTokenPool` for the public contract of each
    call defined here.
    """

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
        rows or for a record written into among the pages it gives back
        (as :meth:`free`), ``TypeError`` for a non-fence (as :meth:`free`);
        :class:`CapacityError` on a pool without ``kv``. A trim costs the
        pages it gives back, not those the row keeps: it checks only the
        pages it gives back against what the pool recorded (a write into a
        kept page is refused where that page is given back: the row's
        :meth:`free`, a drop, a later trim), and the row's next growth
        writes after the kept pages in the buffer the record grew in,
        unless :meth:`pages_of` handed out a view of it since (on the
        host): then it copies the kept pages into a new buffer, so that
        the view keeps what it read. On a pool with KV groups ``group=``
        names the group to trim (required there); elsewhere it must be
        None (``ValueError`` for either mistake or an unknown name).
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
        kept = _kept_pages(pages, seq, keeps)
        led.hold(seq)  # while fences are asked: see SlotLedger.hold
        try:
            immediate = self._give_back_positions(pages, prepared, extra, after, keep=kept)
        finally:
            led.unhold(seq)
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
        what they read, and it costs the pages dropped, not those kept:
        as :meth:`trim_pages`, it checks only the pages it gives back
        against what the pool recorded (a write into a kept page is
        refused where that page is given back: the row's :meth:`free`, a
        later drop or trim). Returns the pages free at once. Raises,
        changing nothing: :class:`CapacityError` for a ``below`` that is
        not an int >= 0 (or one per row) or that is past a row's positions
        (the engine computes it from the row's length: a larger one is a
        bug), :class:`InvalidSlotError` unless the rows are distinct
        allocated rows, for rows in a set with one ``below`` per row, or
        for a record written into among the pages it gives back (as
        :meth:`free`), ``TypeError`` for a non-fence (as
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
        _check_below(pages, seq, belows)
        extra: tuple[Fence, ...] = () if fence is None else fence_list(fence)
        if after is not None:
            check_after(after)
        prepared = pages.prepare_free(seq, self._uses, belows=belows)
        if not prepared:
            return 0
        led.hold(seq)  # while fences are asked: see SlotLedger.hold
        try:
            immediate = self._give_back_positions(
                pages, prepared, extra, after, below=dict(zip(seq, belows, strict=True))
            )
        finally:
            led.unhold(seq)
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
                _check_below(pages, seq, counts, f"KV group {gname!r}: ")
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
        # Put back after (not None): a fence's query() may call the pool
        # back, and a call there that shares answers must not end the
        # outer call's (whose next answer() would fail, quarantining).
        before = [pages.ledger.answers for _, pages, _ in plans]
        for _, pages, _ in plans:
            pages.ledger.answers = answers
        immediate = 0
        led.hold(seq)  # while fences are asked: see SlotLedger.hold
        try:
            for (_, pages, counts), one in zip(plans, prepared, strict=True):
                holes = pages.holes
                if not trim:
                    if one:
                        below = dict(zip(seq, counts, strict=True))
                        immediate += pages.free(one, extra, below=below)
                    continue
                if one:
                    immediate += pages.free(one, extra, _kept_pages(pages, seq, counts))
                if holes:
                    pages.trim_holes(seq, counts)
        finally:
            led.unhold(seq)
            for (_, pages, _), was in zip(plans, before, strict=True):
                pages.ledger.answers = was
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
        before = pled.answers  # put back after: see _give_back's
        pled.answers = {}
        try:
            return pages.free(prepared, extra, keep, below)
        finally:
            pled.answers = before

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
        if fence is None and after is None:
            # Fast path: one row (``[row]`` or a bare int), no fence, no
            # recorded use: its pages and then the row are free at once (the
            # pages are checked first).
            row = (rows[0] if len(rows) == 1 else None) if rows.__class__ is list else rows
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
        # Put back after (not None): a call made from a fence's query()
        # (or a task an eager factory runs there) must not end this call's
        # answers, whose next answer() would fail and quarantine the rows.
        before, pbefore = led.answers, pled.answers
        led.answers = pled.answers = {}
        try:
            # The rows held while their pages' fences are asked (see
            # SlotLedger.hold); the row ledger's free holds them itself.
            led.hold(seq)
            try:
                freed_pages = pages.free(prepared, extra)
            finally:
                led.unhold(seq)
            if pages.holes:
                pages.forget(seq)
            immediate = led.free(seq, fence)
        finally:
            led.answers, pled.answers = before, pbefore
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
        if fence is None and after is None:
            # Fast path, the one-kv free's (_free_with_pages) for every
            # group: one row (``[row]`` or a bare int), no fence, no
            # recorded use (state ALLOCATED, not USED): its pages in every
            # group and then the row are free at once. Anything it cannot
            # vouch for goes the general way below, which raises for it with
            # nothing changed.
            row = (rows[0] if len(rows) == 1 else None) if rows.__class__ is list else rows
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
        before = led.answers  # put back after: see _free_with_pages
        pbefore = [pages.ledger.answers for pages in sets]
        led.answers = answers
        for pages in sets:
            pages.ledger.answers = answers
        try:
            freed_pages = 0
            led.hold(seq)  # as in _free_with_pages
            try:
                for pages, one in zip(sets, prepared, strict=True):
                    freed_pages += pages.free(one, extra)
                    if pages.holes:
                        pages.forget(seq)
            finally:
                led.unhold(seq)
            immediate = led.free(seq, fence)
        finally:
            led.answers = before
            for pages, was in zip(sets, pbefore, strict=True):
                pages.ledger.answers = was
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
