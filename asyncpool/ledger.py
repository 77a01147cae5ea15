"""Pure slot bookkeeping: which row is free, allocated, pending or quarantined.

The ledger knows nothing of tensors or of asyncio. It owns rows
``1..size-1`` (row 0 is reserved padding, never handed out, never freed) and
moves each through::

    FREE --take--> ALLOCATED --free--> FREE                 (no open fence)
                            \\--free--> PENDING --fence done--> FREE
                                              \\--fence faulted--> QUARANTINED

Invariants (proved by :meth:`SlotLedger.check_invariants`):

* every row is in exactly one state; the counts add up to ``capacity``;
  an allocated row is USED exactly when it carries a recorded use;
* the free queue holds exactly the FREE rows, oldest-freed first (FIFO
  reuse, as tokenspeed's allocator does: reuse as late as possible);
* the free queue is ``[clean rows..., dirty rows...]``: its first ``_clean``
  rows were reset, the rows made free since sit behind them. Before a dirty
  row is handed out, the ``on_reset`` hook is called once with *every* dirty
  row (one vectorised tensor op for about ``capacity`` frees, not one per
  free), so a row reads zero lengths when its new owner gets it;
* pending rows sit in batches behind their fences, one queue per stream kept
  in the stream's record order, so reclaim looks only at each queue's head;
  fences of unknown origin sit in a side list polled in full. That machinery
  (and quarantine and fault accounting) lives in :mod:`asyncpool.deferral`,
  shared with the KV page ledger; this class is a :class:`Deferrals` whose
  batches hold row ids.

Every public method is atomic: one that raises an ``Exception`` has changed
nothing; a fence's ``query()`` raising what is not one (``KeyboardInterrupt``,
``CancelledError``) propagates and leaves every row decided or as it was.
Not thread-safe: the owning pool serialises calls.
"""

from __future__ import annotations

import collections
import itertools
import logging
import operator
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, SupportsIndex

from .deferral import Deferrals, answer_once, stream_key
from .errors import CapacityError, DoubleFreeError, InvalidSlotError
from .fences import (
    Fence,
    FenceAnswer,
    Fences,
    fence_arg,
    fence_list,
    is_done,
    is_fence,
    is_stream,
    stream_is_no_fence,
)

__all__ = ["ALLOCATED", "FREE", "PENDING", "QUARANTINED", "RESERVED", "USED", "SlotLedger"]

logger: logging.Logger = logging.getLogger(__name__)

FREE, ALLOCATED, PENDING, QUARANTINED, RESERVED = 0, 1, 2, 3, 4
_CHECKING = 5  # transient mark while one call validates its rows
# ALLOCATED with a recorded use (its _uses entry is set): one state tells the
# fast paths of free() that a row can go back at once, with no second look.
USED = 6
STATE_NAMES = ("free", "allocated", "pending", "quarantined", "reserved", "checking", "allocated")
# forget_uses: what a row's recorded uses become once all were forgotten.
_ALL_FORGOTTEN = object()
_NO_USE = object()  # no recorded use met yet (None is one: no use)

#: What a call that takes rows accepts: one row id (an int or an integer
#: scalar) or an iterable of them (a list, a 1-D integer tensor or array),
#: as :func:`as_row_ids` converts them; floats and bools are refused there,
#: at run time.
Rows = SupportsIndex | Iterable[SupportsIndex]


class SlotLedger(Deferrals[int]):
    """Bookkeeping for ``size - 1`` rows; see the module docstring.

    Pending queues, :meth:`reclaim`, :meth:`pending_fences`, quarantine and
    the fault counters (``pending``, ``quarantined``, ``deferred_frees``,
    ``reclaimed``, ``fence_errors``, ``last_fence_error``,
    ``fence_latencies``) come from :class:`~asyncpool.deferral.Deferrals`.

    ``on_reset(rows)`` is called with every dirty row right before the first
    of them would be handed out. ``on_pending(fence)`` is called once for each
    fence that starts holding rows, so the owner can arrange to be told when
    it completes. ``on_fault(fence, error)`` is called when a fence faults.
    """

    unit = "rows"

    def __init__(
        self,
        size: int,
        *,
        on_reset: Callable[[list[int]], None] | None = None,
        on_pending: Callable[[Fence], None] | None = None,
        on_fault: Callable[[Fence, BaseException], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        latency_window: int = 4096,
    ) -> None:
        size = check_size(size)
        self.size: int = size
        self.capacity: int = size - 1
        self._free: collections.deque[int] = collections.deque(range(1, size))
        self._clean = size - 1  # the tables start zeroed
        # A list, not a bytearray: CPython specialises int subscripts of a
        # list (BINARY_SUBSCR_LIST_INT / STORE_SUBSCR_LIST_INT) and not of a
        # bytearray, and the state is read and written once per row on every
        # take and free (about 17 ns a row of alloc(64) + free).
        self._state: list[int] = [FREE] * size
        self._state[0] = RESERVED
        # Generations: each row's tag from its latest hand-out, the value of
        # _granted (rows handed out over the pool's life) just after it; 0
        # for a row never handed out. A tag changes on every hand-out, which
        # is all a stale lease or a double free needs, and one hand-out of
        # n rows stores one shared int n times: no read-modify-write per
        # row. The fast paths bump _granted and store the tag themselves.
        self._gen: list[int] = [0] * size
        self._granted = 0
        self._uses: list[Any] = [None] * size
        # One list per record_use under way that prunes (nested: a query()
        # it asks may record again): the fences forget_uses dropped while it
        # asked, which its uses worked out before may still hold.
        self._forgetting: list[list[Fence]] = []
        super().__init__(
            on_pending=on_pending, on_fault=on_fault, clock=clock, latency_window=latency_window
        )
        self._on_reset = on_reset
        self.peak_allocated: int = 0
        # allocated <= capacity - len(free), so a new peak needs the free
        # queue shorter than this bound: a one-compare pre-filter per take.
        self._peak_bound = self.capacity
        self._returned = 0  # rows given back by put_back (never really allocated)
        # Rows handed out by _pop (and by the pool's grant loop, which
        # inlines it): every hand-out except the async pool's inlined
        # single-row alloc paths, which it derives as granted - _popped.
        self._popped = 0
        self.resets: int = 0

    # ------------------------------------------------------------------ counts

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def allocated(self) -> int:
        return self.capacity - len(self._free) - self.pending - self.quarantined

    @property
    def allocs(self) -> int:
        """Rows handed out over the pool's life (derived: no hot-path counter)."""
        return self.granted - self._returned

    @property
    def granted(self) -> int:
        """Rows handed out, counting those given back by ``put_back`` (monotonic)."""
        return self._granted

    @property
    def returned(self) -> int:
        """Rows given back by ``put_back`` (granted to a waiter that was cancelled)."""
        return self._returned

    @property
    def frees(self) -> int:
        """Rows given back over the pool's life (each handed-out row once)."""
        return self.allocs - self.allocated

    def state_of(self, row: int) -> str:
        """The state of ``row`` by name (for messages and tests)."""
        return STATE_NAMES[self._state[row]]

    def generation(self, row: int) -> int:
        """A tag that changes each time ``row`` is handed out; 0 if never.

        The pool's count of rows handed out (:attr:`granted`) just after
        the row's latest hand-out: strictly larger at each hand-out of the
        row, shared by the rows handed out together.
        """
        return self._gen[row]

    # ------------------------------------------------------------------ take

    def take(self, n: int) -> list[int] | None:
        """Hand out the ``n`` oldest-freed rows, or None when fewer are free.

        ``n`` must already be validated (an int in ``1..capacity``).
        """
        free = self._free
        if n > self._clean:  # short, or dirty rows needed
            if n > len(free):
                return None
            self._reset_dirty()
        self._clean -= n
        return self._pop(n)

    def take_unreset(self, n: int) -> tuple[list[int], list[int]]:
        """Hand out ``n`` rows without resetting; also return the dirty ones.

        For a caller that resets the returned dirty rows itself before their
        new owner can read them (the async pool batches a burst of grants into
        one reset). ``n`` must not exceed :attr:`free_count`.
        """
        clean = self._clean
        if n <= clean:
            self._clean = clean - n
            return self._pop(n), []
        self._clean = 0
        rows = self._pop(n)
        return rows, rows[clean:]

    def _pop(self, n: int) -> list[int]:
        free = self._free
        # _popped before _granted: a read of both from another thread (the
        # pool's zero-wait count, granted - _popped) can only undercount.
        self._popped += n
        tag = self._granted + n
        self._granted = tag
        if n == 1:
            row = free.popleft()
            self._state[row] = ALLOCATED
            self._gen[row] = tag
            rows = [row]
        else:
            state = self._state
            gen = self._gen
            pop = free.popleft
            rows = list(itertools.starmap(pop, itertools.repeat((), n)))  # a C loop
            for row in rows:
                state[row] = ALLOCATED
                gen[row] = tag
        if len(free) < self._peak_bound:
            self._note_peak()
        return rows

    def _note_peak(self) -> None:
        allocated = self.capacity - len(self._free) - self.pending - self.quarantined
        if allocated > self.peak_allocated:
            self.peak_allocated = allocated
            self._peak_bound = self.capacity - allocated

    def put_back(self, rows: list[int]) -> None:
        """Return rows handed out by :meth:`take` but never given to anyone.

        They go back to the head of the free queue, clean, as if never taken
        (used when a waiter is cancelled after its grant).
        """
        state = self._state
        free = self._free
        for row in reversed(rows):
            state[row] = FREE
            free.appendleft(row)
        self._clean += len(rows)
        self._returned += len(rows)

    def _reset_dirty(self) -> None:
        free = self._free
        dirty = list(itertools.islice(free, self._clean, None))
        if dirty:
            # The hook first: if it raises (a CUDA OOM building its index),
            # the rows stay dirty and the next take resets them, instead of
            # handing them out with their last owner's lengths.
            if self._on_reset is not None:
                self._on_reset(dirty)
            self.resets += 1
        self._clean = len(free)

    def reset_all(self) -> None:
        """Mark every free row clean (the caller zeroed the whole table)."""
        self._clean = len(self._free)

    # ------------------------------------------------------------------ checks

    def check_n(self, n: object) -> int:
        """Validate a requested row count; raise :class:`CapacityError`.

        Accepts a Python int or an integer scalar (numpy, a 0-d torch
        tensor); returns it as a Python int. Floats and bools are refused.
        """
        if n.__class__ is not int:
            try:
                n = as_index(n)
            except TypeError:
                raise CapacityError(
                    f"a row count must be an integer, got {describe(n)} of type {type(n).__name__}"
                ) from None
        assert isinstance(n, int)
        if n < 1:
            raise CapacityError(
                f"cannot allocate {n} {_rows_word(n)}: a request needs at least 1 row"
            )
        if n > self.capacity:
            raise CapacityError(
                f"cannot allocate {n} rows: the pool has only {self.capacity} "
                "(size - 1, since row 0 is reserved)"
            )
        return n

    def _row_error(self, row: object, what: str) -> InvalidSlotError:
        if row.__class__ is not int:
            return InvalidSlotError(
                f"row ids must be ints, got {describe(row)} of type {type(row).__name__}"
            )
        assert isinstance(row, int)
        if row == 0:
            return InvalidSlotError(f"row 0 is reserved padding and cannot be {what}")
        if not 0 < row < self.size:
            return InvalidSlotError(f"row {row} is out of range 1..{self.size - 1}")
        state = self._state[row]
        if state == _CHECKING:
            return InvalidSlotError(
                f"row {row} appears twice in this call, or a call under way holds it (it "
                "asked a fence's query(), which called the pool back); a call may name "
                "each row once, and code run inside a query() may not name the rows of "
                "the call that asked it"
            )
        if state in (FREE, PENDING):
            if self.generation(row) == 0:
                return InvalidSlotError(f"row {row} was never allocated and cannot be {what}")
            where = "is already free" if state == FREE else "is already pending behind a fence"
            if what == "freed":
                return DoubleFreeError(f"double free: row {row} {where}")
            return InvalidSlotError(f"row {row} {where} (not allocated) and cannot be {what}")
        return InvalidSlotError(f"row {row} is {STATE_NAMES[state]} and cannot be {what}")

    def _mark_allocated(self, rows: Sequence[int], what: str) -> None:
        """Check that ``rows`` are distinct allocated rows; mark them CHECKING.

        On error every mark is undone and the ledger is as before.
        """
        state = self._state
        size = self.size
        for i, row in enumerate(rows):
            if (
                row.__class__ is not int
                or not 0 < row < size
                or (state[row] != ALLOCATED and state[row] != USED)
            ):
                error = self._row_error(row, what)  # before undoing: it reads the marks
                self._unmark(rows[:i])
                raise error
            state[row] = _CHECKING

    def hold(self, rows: Iterable[int]) -> None:
        """Hold ``rows`` while a call that changes them asks fences.

        For the owner's calls that run code not theirs in the middle of a
        change to rows (a fence's ``query()``, asked as pages are given
        back or reclaimed): that code may call the pool back (directly, or
        through a task an eager task factory runs at once), and a call
        there that names one of these rows (a free, a trim, a detach, an
        extend, a ``record_use``) would change them under the call that
        holds them. Held rows are marked CHECKING, which every such call
        refuses with :class:`InvalidSlotError` (changing nothing), as it
        refuses a row named twice. ``rows``: distinct allocated rows,
        checked by the caller with nothing run since. Undo with
        :meth:`unhold`, in a ``finally``.
        """
        state = self._state
        for row in rows:
            state[row] = _CHECKING

    def unhold(self, rows: Iterable[int]) -> None:
        """Undo :meth:`hold`: each row back to ALLOCATED or USED."""
        self._unmark(rows)

    def _unmark(self, rows: Iterable[int]) -> None:
        """Undo :meth:`_mark_allocated`: each row back to ALLOCATED or USED."""
        state = self._state
        uses = self._uses
        for row in rows:
            state[row] = ALLOCATED if uses[row] is None else USED

    def check_allocated(self, rows: Sequence[int], what: str) -> None:
        """Raise as :meth:`free` would unless ``rows`` are distinct allocated rows.

        Changes nothing. Valid rows are told by one pass over the states and
        a set; only a failing call marks and unmarks, for the precise error.
        """
        state = self._state
        size = self.size
        for row in rows:
            if (
                row.__class__ is not int
                or not 0 < row < size
                or (state[row] != ALLOCATED and state[row] != USED)
            ):
                break
        else:
            if len(rows) < 2 or len(set(rows)) == len(rows):
                return
        self._mark_allocated(rows, what)  # raises, naming the first bad row
        self._unmark(rows)

    @staticmethod
    def as_rows(rows: object) -> Sequence[int]:
        """``rows`` as a sequence of Python ints (see :func:`as_row_ids`)."""
        return as_row_ids(rows)

    @staticmethod
    def check_fence(fence: object, name: str = "fence") -> None:
        """Raise ``TypeError`` unless ``fence`` is one fence (:func:`is_fence`);
        a stream's error says what to pass instead (:func:`is_stream`)."""
        if not is_fence(fence):
            if is_stream(fence):
                raise stream_is_no_fence(fence, f"{name}=")
            raise TypeError(
                f"{name}= must be a fence (an object with query() and synchronize()), "
                f"got {fence!r} of type {type(fence).__name__}"
            )

    # ------------------------------------------------------------------ use

    def record_use(self, rows: Rows, fence: Fences, what: str = "used") -> None:
        """Note that ``rows`` are touched by work that completes with ``fence``.

        ``fence``: one fence, or a sequence of fences (a step that
        ends with several: each is recorded, as by one call per fence; an
        empty one records nothing but still checks the rows). A later
        :meth:`free` of a row waits for the newest use recorded on each
        stream. All rows must be allocated. ``what="freed"`` (a
        ``free(after=...)`` recording its fence) reports a row already free
        or pending as a :class:`DoubleFreeError`, as :meth:`free` does.
        Raises, changing nothing: ``TypeError`` for a non-fence (naming
        the element of a sequence by its position) and for None (here
        not "no fence", as at a free: a use needs its fence; ``[]`` is
        none).

        A row's uses keep each fence of unknown origin until it is found
        complete: a record that makes them longer than ``_PRUNE_AT`` asks
        some of them, in turn (two per fence it adds, each fence once per
        call), and drops those that answered True (:func:`_pruned`); one
        still open, or whose ``query()`` raises or answers neither yes nor
        no, stays (a fault is counted, and quarantines, at the free). Not
        with ``what="freed"`` (the free asks them all next) nor on an
        explicit ledger (no fence is asked there: a row keeps every such
        fence until its free). A ``query()`` raising what is not an
        ``Exception`` propagates: the rows recorded before it keep their
        record, that row and the rest their uses as they were.
        """
        seq = self.as_rows(rows)
        if not is_fence(fence):  # the one-fence path's only check, as before
            if fence is None:
                # fence_list reads None as "no fence" (free's default), but a
                # use with no fence is no use: the rows would go back while
                # the step still runs. A step's fence variable still None (a
                # wrapper that returned nothing) must not pass silently.
                raise TypeError(
                    "record_use() needs the fence of the work that uses the rows, got "
                    "None: nothing would hold them (or their pages) while it runs; "
                    "record one after the launch (record_fence(stream)), or pass [] "
                    "for work with no fence"
                )
            fences = fence_list(fence)  # all checked before anything is recorded
            self.check_allocated(seq, what)
            if fences:
                self._record_uses(seq, fences, what != "freed")
            return
        self.check_allocated(seq, what)
        state = self._state
        uses = self._uses
        key = stream_key(fence)
        fseq = getattr(fence, "seq", 0)
        # The rows of one step mostly hold the same previous use (the step
        # before's fence, or one shared tuple): what replaces a use depends
        # only on that use and ``fence``, so it is worked out once per
        # distinct previous use, not per row, and rows that shared one use
        # share the new one (a free decides them once: see free()). Rows of
        # several histories in turn (A, B, A, ...) find theirs in `seen`,
        # made at the second distinct use met, so a step of one history
        # pays for no dict.
        last_prev: Any = None
        last_new: Any = None
        seen: dict[int, tuple[Any, Any]] | None = None
        # A row's uses grown past _PRUNE_AT drop the fences of unknown
        # origin found complete (_pruned), except on a free's own record
        # (the free asks them all next) and on an explicit pool (no fence
        # is asked there). `asked`: this call's answers, one per fence.
        prune = what != "freed"
        asked: dict[int, tuple[Fence, Any]] | None = None
        # A prune asks fences: code not ours, which may call the pool back.
        # From the first prune on, the call's rows are held (hold()), the
        # rest marked as held as the loop reaches them, all USED at the end;
        # and a force_release made there is undone in the uses worked out
        # before it (_forgot_while_held).
        mark = USED
        try:
            for row in seq:
                state[row] = mark
                prev = uses[row]
                if prev is None or prev is fence:
                    uses[row] = fence
                elif prev is last_prev:
                    uses[row] = last_new
                else:
                    hit = None if seen is None else seen.get(id(prev))
                    if hit is not None:
                        new = hit[1]
                    else:
                        if key is not None and stream_key(prev) == key:
                            new = fence if prev.seq <= fseq else prev
                        else:
                            new = _merge_uses(prev, fence)
                            if len(new) > _PRUNE_AT and prune and not self.explicit:
                                if asked is None:
                                    asked = {} if self.answers is None else self.answers
                                if mark == USED:
                                    mark = _CHECKING
                                    self.hold(seq)
                                    self._forgetting.append([])
                                new = _pruned(prev, new, asked)
                        if last_prev is not None:
                            # Each entry keeps its use alive: no id is reused.
                            if seen is None:
                                seen = {id(last_prev): (last_prev, last_new)}
                            seen[id(prev)] = (prev, new)
                    uses[row] = last_new = new
                    last_prev = prev
        finally:
            if mark != USED:
                self._forgot_while_held(seq)

    def _record_uses(self, seq: Sequence[int], fences: tuple[Fence, ...], prune: bool) -> None:
        """:meth:`record_use` of several fences (checked, rows allocated):
        each row's uses become what one call per fence would leave, folded
        once per previous use (:func:`_fold_uses`): a long sequence in one
        pass over it, not one pass over the row's growing uses per fence
        (O(len(fences)^2) for a sequence of transfer handles). Uses grown
        past ``_PRUNE_AT`` are pruned (:func:`_pruned`) when ``prune``."""
        state = self._state
        uses = self._uses
        last_prev: Any = _NO_USE
        last_new: Any = None
        seen: dict[int, tuple[Any, Any]] | None = None  # as in record_use
        prune = prune and not self.explicit
        asked: dict[int, tuple[Fence, Any]] | None = None  # as in record_use
        mark = USED  # held from the first prune on, as in record_use
        try:
            for row in seq:
                state[row] = mark
                prev = uses[row]
                if prev is not last_prev:
                    hit = None if seen is None else seen.get(id(prev))
                    if hit is not None:
                        new = hit[1]
                    else:
                        new = _fold_uses(prev, fences)
                        if prune and new.__class__ is tuple and len(new) > _PRUNE_AT:
                            if asked is None:
                                asked = {} if self.answers is None else self.answers
                            if mark == USED:
                                mark = _CHECKING
                                self.hold(seq)
                                self._forgetting.append([])
                            new = _pruned(prev, new, asked)
                        if last_prev is not _NO_USE:
                            if seen is None:
                                seen = {id(last_prev): (last_prev, last_new)}
                            seen[id(prev)] = (prev, new)
                    last_new = new
                    last_prev = prev
                uses[row] = last_new
        finally:
            if mark != USED:
                self._forgot_while_held(seq)

    def _forgot_while_held(self, seq: Sequence[int]) -> None:
        """End a pruning record's hold of ``seq``: the fences a
        ``force_release`` made from one of its ``query()`` calls dropped
        from the rows' uses are dropped again (the uses the record worked
        out before, from the rows' old ones, still held them: the rows
        would wait for a fence the operator released), then each row back
        to ALLOCATED or USED."""
        forgot = self._forgetting.pop()  # nested records end first
        if forgot:
            self.forget_uses(forgot)
        self._unmark(seq)

    def forget_use(self, fence: Fence) -> int:
        """Drop ``fence`` from the uses recorded on allocated rows; return how
        many rows it touched. For ``force_release``: a fence treated as
        completed must not hold a row freed later. O(size)."""
        return self.forget_uses((fence,))

    def stream_uses(self, key: int) -> tuple[list[Fence], int]:
        """The fences of stream ``key`` recorded as uses of allocated rows
        that a retire of it covers (``seq`` at or below its mark), which a
        free of their rows no longer waits for, and how many rows carry
        one it does not cover (a free of such a row waits for a retire of
        the stream). For ``forget_stream``: the covered ones go with the
        mark (:meth:`forget_stream`), or a free of their rows would wait for
        a retire of a stream done with; a row with an uncovered one refuses
        it. O(size) while some row carries a use, else O(1) in Python."""
        uses = self._uses
        if uses.count(None) == len(uses):
            return [], 0
        mark = self._retired.get(key)
        covered: dict[int, Fence] = {}
        open_rows = 0
        # Rows recorded in one call share their tuple of uses: read it once.
        seen: dict[int, tuple[Any, bool]] = {}
        for use in uses:
            if use is None:
                continue
            hit = seen.get(id(use))
            if hit is None:
                still = False
                for f in use if use.__class__ is tuple else (use,):
                    if stream_key(f) == key:
                        if mark is not None and getattr(f, "seq", 0) <= mark:
                            covered[id(f)] = f
                        else:
                            still = True
                seen[id(use)] = hit = (use, still)
            if hit[1]:
                open_rows += 1
        return list(covered.values()), open_rows

    def forget_stream(self, key: int) -> bool:
        """:meth:`Deferrals.forget_stream`, and the recorded uses of
        allocated rows that its retire covers dropped with the mark: a free
        of such a row would be free at once of them while the mark stays,
        and must stay so (the owner checked first that no row carries one
        it does not cover)."""
        covered, _ = self.stream_uses(key)
        if covered:
            self.forget_uses(covered)
        return super().forget_stream(key)

    def forget_uses(self, fences: Sequence[Fence]) -> int:
        """:meth:`forget_use` of every fence in ``fences``, in one pass:
        return how many rows any of them touched. O(size), however many.
        A row held by a call under way (CHECKING: :meth:`hold`, made from a
        ``query()`` that call asked) keeps its mark: the holder's
        :meth:`unhold` reads what its uses became."""
        for forgot in self._forgetting:
            forgot.extend(fences)
        ids = {id(f) for f in fences}
        uses = self._uses
        state = self._state
        touched = 0
        # What each distinct tuple of uses becomes (None: it holds none of
        # the fences), kept with the tuple so that no id is reused: the rows
        # that shared one tuple share its rest, as record_use left them.
        rests: dict[int, tuple[Any, Any]] = {}
        for row, use in enumerate(uses):
            if use is None:
                continue
            if use.__class__ is tuple:
                hit = rests.get(id(use))
                if hit is None:
                    new = None
                    if any(id(f) in ids for f in use):
                        rest = tuple(f for f in use if id(f) not in ids)
                        new = rest if len(rest) > 1 else rest[0] if rest else _ALL_FORGOTTEN
                    rests[id(use)] = hit = (use, new)
                if hit[1] is not None:
                    if hit[1] is _ALL_FORGOTTEN:  # every fence of it forgotten
                        uses[row] = None
                        if state[row] == USED:  # not a held row's mark
                            state[row] = ALLOCATED
                    else:
                        uses[row] = hit[1]
                    touched += 1
            elif id(use) in ids:
                uses[row] = None
                if state[row] == USED:  # not a held row's mark
                    state[row] = ALLOCATED
                touched += 1
        return touched

    # ------------------------------------------------------------------ free

    def free(self, rows: Rows, fence: Fences | None = None) -> int:
        """Return allocated rows; return how many are free at once.

        Each row waits for its newest recorded use and for ``fence`` (one
        fence, or a sequence of fences: every one of them; an empty
        one is None); a row with nothing incomplete to wait for is free at
        once, the rest become PENDING. Raises (changing nothing) for row 0,
        out-of-range or non-int ids, rows not allocated, duplicates, and a
        non-fence (``TypeError``, naming a list's bad element by position).
        """
        if fence is None and rows.__class__ is list:
            # Fast path: distinct allocated rows, no fence, no recorded use
            # (ALLOCATED, not USED), in one pass that checks each row and
            # marks it FREE; a repeated row finds itself already FREE, and a
            # row past the end raises IndexError (cheaper than a bound test
            # per row). On the first row that fails, the marks made before
            # it are undone and the careful path below runs (and raises, for
            # every error). Where it failed comes from the iterator's length
            # hint, so the undo costs the rows marked, not the free queue: a
            # row with a recorded use (every row of an overlap engine) fails
            # here on every free.
            state = self._state
            it = iter(rows)
            try:
                for row in it:
                    if row.__class__ is not int or row <= 0 or state[row] != ALLOCATED:
                        break
                    state[row] = FREE
                else:
                    self._free.extend(rows)
                    return len(rows)
            except IndexError:
                pass
            # The failed row was consumed: the rows before it were marked.
            for row in rows[: len(rows) - operator.length_hint(it) - 1]:
                state[row] = ALLOCATED
        seq = self.as_rows(rows)
        if fence is not None:
            if not is_fence(fence):  # the one-fence path's only check, as before
                # A sequence: None (empty), its one fence, or a tuple
                # of several (the only tuple read as several fences below).
                fence = fence_arg(fence)
            # `one` and `more` are read only where a fence was given (not
            # after an empty list made it None): the fence when it is one
            # (else None), and the fences to add to a row's uses on the
            # general path.
            one: Fence | None
            more: Any
            if fence.__class__ is tuple:
                one = None
                more = fence
            else:
                one = fence  # type: ignore[assignment]  # not a tuple: one fence
                more = (fence,)
        self._mark_allocated(seq, "freed")
        state = self._state
        uses = self._uses
        free = self._free
        immediate = 0
        # Rows grouped by the fences they wait for: keyed by the head fence's
        # id when that is all, else by the ids of all of them.
        deferred: dict[Any, tuple[Fence, tuple[Fence, ...], list[int]]] | None = None
        last: Any = None
        # A bool, except for the moment a query() answered another yes or no
        # (an int 0/1) before is_done reads it.
        last_done: FenceAnswer = False
        last_error: BaseException | None = None
        row = 0
        orig: Any = None
        # Rows quarantined behind a faulted fence, by fence: reported (counted,
        # logged) together once the call has decided every row.
        faults: dict[int, tuple[Fence, BaseException, list[int]]] | None = None
        answers = self.answers  # set: ask each fence once (Deferrals.answer)
        # The general path's verdict for the last recorded use it met: the
        # rows of one step share their use (record_use), and the call's own
        # fences are the same for every row, so those rows wait for the same
        # fences, asked once per call as the one-fence path asks them. Rows
        # of several uses in turn (A, B, A, ...) find theirs in `verdicts`,
        # made at the second distinct use met: a row of A never gets a
        # verdict other than the first row of A got.
        several_use: Any = _NO_USE
        several: Any = None
        verdicts: dict[int, tuple[Any, Any]] | None = None
        try:
            for row in seq:
                use = uses[row]
                orig = use
                if use is None and fence is None:
                    state[row] = FREE
                    free.append(row)
                    immediate += 1
                    continue
                uses[row] = None
                if use is None:
                    # Only the given fence to wait for (None: several, the
                    # general path). `one` is set: a fence was given, or
                    # the row would have been freed above.
                    single = one
                elif fence is None and use.__class__ is not tuple:
                    single = use  # only the recorded use
                else:
                    single = None  # several fences: the general path below
                if single is not None:
                    # Common case: one fence to wait for; query each distinct
                    # fence once per call.
                    use = single
                    if use is not last:
                        last = use
                        last_error = None
                        try:
                            # In the try: an answer that is not a yes or no is a fault.
                            if self.explicit:
                                last_done = self.is_retired(use)
                            elif answers is None:
                                last_done = use.query()
                                if last_done is not True and last_done is not False:
                                    last_done = is_done(last_done)
                            else:
                                last_done = self.answer(use)
                        except Exception as exc:  # a faulted stream
                            last_error = exc
                            faults = self._fault_row(faults, row, use, exc)
                            continue
                    elif last_error is not None:  # same faulted fence: one error
                        faults = self._fault_row(faults, row, use, last_error)
                        continue
                    if last_done:
                        state[row] = FREE
                        free.append(row)
                        immediate += 1
                        continue
                    head = use
                    rest: tuple[Fence, ...] = ()
                    key: Any = id(use)
                else:
                    if use is not several_use:
                        hit = None if verdicts is None else verdicts.get(id(use))
                        if hit is not None:
                            verdict = hit[1]
                        else:
                            candidates: list[Fence] = []
                            if use is not None:
                                candidates.extend(use if use.__class__ is tuple else (use,))
                            if fence is not None:
                                candidates.extend(more)
                            verdict = self._open_fences(candidates)
                            if several_use is not _NO_USE:
                                # Each entry keeps its use alive: no id is reused.
                                if verdicts is None:
                                    verdicts = {id(several_use): (several_use, several)}
                                verdicts[id(use)] = (use, verdict)
                        several = verdict
                        several_use = use
                    waits, faulted, error = several
                    if faulted is not None:
                        faults = self._fault_row(faults, row, faulted, error)
                        continue
                    if not waits:
                        state[row] = FREE
                        free.append(row)
                        immediate += 1
                        continue
                    head = waits[0]
                    rest = tuple(waits[1:])
                    key = tuple(map(id, waits)) if rest else id(head)
                state[row] = PENDING
                if deferred is None:
                    deferred = {}
                entry = deferred.get(key)
                if entry is None:
                    deferred[key] = (head, rest, [row])
                else:
                    entry[2].append(row)
        except BaseException:
            # Only a fence's query() raising what is not an Exception
            # (KeyboardInterrupt, CancelledError) gets here, mid-call: keep
            # the ledger whole. The rows decided stay decided; the row being
            # decided gets its use back; the rest are allocated again.
            if state[row] == _CHECKING:
                uses[row] = orig
            self._unmark([r for r in seq if state[r] == _CHECKING])
            self._conclude_free(deferred, faults)
            raise
        self._conclude_free(deferred, faults)
        return immediate

    def _conclude_free(
        self,
        deferred: dict[Any, tuple[Fence, tuple[Fence, ...], list[int]]] | None,
        faults: dict[int, tuple[Fence, BaseException, list[int]]] | None,
    ) -> None:
        """Defer the rows a free call left pending, then report its faults:
        even if a deferral's hook raised, since those rows are quarantined
        already and the owner must shed the waiters that no longer fit."""
        try:
            if deferred:
                now = self._clock()
                for head, rest, batch_rows in deferred.values():
                    self._defer(head, batch_rows, len(batch_rows), now, rest)
        finally:
            if faults:
                self._report_faults(faults)

    def _fault_row(
        self,
        faults: dict[int, tuple[Fence, BaseException, list[int]]] | None,
        row: int,
        fence: Fence,
        error: BaseException,
    ) -> dict[int, tuple[Fence, BaseException, list[int]]]:
        """Quarantine ``row`` behind faulted ``fence``; note it in ``faults``
        (made on the first fault of a call) for :meth:`_report_faults`."""
        self._fault([row], 1, fence, error, report=False)
        if faults is None:
            faults = {}
        entry = faults.get(id(fence))
        if entry is None:
            faults[id(fence)] = (fence, error, [row])
        else:
            entry[2].append(row)
        return faults

    def _report_faults(self, faults: dict[int, tuple[Fence, BaseException, list[int]]]) -> None:
        """Report each faulted fence of one free call once, with all its rows."""
        for fence, error, rows in faults.values():
            self._report_fault(fence, error, rows, len(rows))

    # ------------------------------------------------------------------ deferral hooks

    def _release_items(self, items: list[int]) -> None:
        state = self._state
        for row in items:
            state[row] = FREE
        self._free.extend(items)

    def _quarantine_items(self, items: list[int]) -> None:
        state = self._state
        for row in items:
            state[row] = QUARANTINED

    def _count_items(self, items: list[int]) -> int:
        return len(items)

    # ------------------------------------------------------------------ views

    def state_bytes(self) -> bytearray:
        """A copy of every row's state, one byte per row (FREE is 0)."""
        return bytearray(self._state)

    def allocated_rows(self) -> list[int]:
        state = self._state
        return [row for row in range(1, self.size) if state[row] in (ALLOCATED, USED)]

    def free_all_allocated(self) -> int:
        """Free every allocated row (respecting recorded uses): the seed's flush."""
        rows = self.allocated_rows()
        if not rows:
            return 0
        return self.free(rows)

    def restore_fresh_order(self) -> None:
        """Put the free queue in row order and mark it clean.

        Only for a caller that has just zeroed every row (the seed's flush).
        """
        ordered = sorted(self._free)
        self._free.clear()
        self._free.extend(ordered)
        self._clean = len(ordered)

    # ------------------------------------------------------------------ proof

    def check_invariants(self) -> None:
        """Raise AssertionError unless every invariant of the module holds."""

        def fail(msg: str) -> None:
            raise AssertionError(f"ledger invariant broken: {msg}")

        state = self._state
        if state[0] != RESERVED:
            fail("row 0 is not reserved")
        counts = [0] * len(STATE_NAMES)
        for row in range(1, self.size):
            counts[state[row]] += 1
        if counts[RESERVED] or counts[_CHECKING]:
            fail(f"rows in impossible states: {counts}")
        free_rows = list(self._free)
        if len(set(free_rows)) != len(free_rows):
            fail("a row is in the free queue twice")
        if any(state[r] != FREE for r in free_rows) or len(free_rows) != counts[FREE]:
            fail(f"free queue ({len(free_rows)}) != FREE rows ({counts[FREE]})")
        if not 0 <= self._clean <= len(free_rows):
            fail(f"clean count {self._clean} outside 0..{len(free_rows)}")
        pending_rows: list[int] = []
        for rows in self._check_deferrals(fail):
            pending_rows.extend(rows)
        if len(set(pending_rows)) != len(pending_rows):
            fail("a row is pending in two batches")
        if any(state[r] != PENDING for r in pending_rows) or len(pending_rows) != counts[PENDING]:
            fail(f"pending batches ({len(pending_rows)}) != PENDING rows ({counts[PENDING]})")
        if self.quarantined != counts[QUARANTINED]:
            fail(f"quarantined count {self.quarantined} != {counts[QUARANTINED]}")
        allocated = counts[ALLOCATED] + counts[USED]
        if self.allocated != allocated:
            fail(f"allocated count {self.allocated} != {allocated}")
        if sum(counts[:4]) + counts[USED] != self.capacity:
            fail("states do not add up to capacity")
        for row in range(1, self.size):
            if (self._uses[row] is not None) != (state[row] == USED):
                what = "carries a recorded use" if self._uses[row] is not None else "carries none"
                fail(f"row {row} {what} but its state is {state[row]}")


#: The largest ``size`` of a row pool: row ids ``1..size - 1`` must fit the
#: int32 index tensors engines keep them in (``req_pool_indices``), and the
#: ledger keeps a few Python objects per row, so a size past it could only
#: fill memory for minutes before failing.
MAX_ROWS_SIZE = 2**31


def check_size(size: object) -> int:
    """``size`` as a Python int; :class:`CapacityError` unless it is an
    integer (any type :func:`integral` converts) in ``2..MAX_ROWS_SIZE``
    (row 0 is reserved; ids fit int32)."""
    size = integral(size)
    if size.__class__ is not int:
        raise CapacityError(f"size must be an int, got {size!r} of type {type(size).__name__}")
    assert isinstance(size, int)
    if size < 2:
        raise CapacityError(f"size must be at least 2 (row 0 is reserved padding), got {size!r}")
    if size > MAX_ROWS_SIZE:
        raise CapacityError(
            f"size must be at most 2**31 (row ids must fit the int32 index tensors "
            f"engines keep them in), got {size!r}"
        )
    return size


def _rows_word(n: int) -> str:
    return "row" if n == 1 else "rows"


def integral(value: object) -> object:
    """``value`` as a Python int if it is an integer of another type (a numpy
    or torch integer scalar, a 0-d integer tensor or array, an ``IntEnum``:
    what :func:`as_index` reads), bools excepted; otherwise ``value`` as it
    is, for the caller's check to refuse by name. For constructor sizes,
    which engines often compute with numpy."""
    if value.__class__ is int or isinstance(value, bool):
        return value
    try:
        return as_index(value)
    except TypeError:
        return value


def describe(value: object, limit: int | None = None) -> str:
    """``repr(value)`` for an error message (cut to ``limit`` characters), or,
    for a value whose repr raises (a tensor of a sub-byte dtype such as
    ``torch.bits8``, which torch cannot print), its type with whatever
    ``dtype``, ``shape``, ``layout`` and ``device`` it has: a bad argument's
    error must not itself fail."""
    try:
        text = repr(value)
    except Exception:
        text = _attributes(value)
    return text if limit is None else text[:limit]


def _attributes(value: object) -> str:
    """``<Tensor: dtype torch.bits8, shape (2,), layout torch.strided, device
    cpu>``: a value's type and whichever of those attributes it has, read
    without touching its data."""
    parts = []
    for name in ("dtype", "shape", "layout", "device"):
        try:
            attr = getattr(value, name, None)
        except RuntimeError:  # a nested tensor has no shape to read
            continue
        if attr is not None:
            parts.append(f"{name} {tuple(attr) if name == 'shape' else attr}")
    return f"<{type(value).__name__}" + (": " + ", ".join(parts) if parts else "") + ">"


def as_index(value: object) -> int:
    """One integer as a Python int: an int, a numpy or torch integer scalar,
    or a 0-d integer tensor or array. ``TypeError`` for anything else: bools
    and floats (bool tensors included), and tensors or arrays of one or more
    dimensions even when they hold one element (``operator.index`` would
    take ``torch.tensor([2])`` as 2). A value with no data to read (a meta
    tensor), one of a dtype torch reads no scalar from (``item()`` raises
    ``NotImplementedError``: ``bits8``, ``uint4``) and one whose
    ``__index__`` raises are a ``TypeError`` too (chained to what it raised),
    so every caller's typed error covers them. Any other error of ``item()``
    (a device fault) is not bad input and propagates as it is."""
    if isinstance(value, int) and not isinstance(value, bool):
        return int(value)
    ndim = getattr(value, "ndim", None)
    if ndim is not None:
        if ndim != 0:
            raise TypeError(f"expected one integer, got a {ndim}-d {type(value).__name__}")
        item = getattr(value, "item", None)
        if item is not None:
            try:
                value = item()  # numpy scalar, 0-d array or tensor -> Python scalar
            except Exception as exc:
                # No data to read (a meta tensor), or a dtype torch reads no
                # scalar from (sub-byte: bits8, uint4; NotImplementedError):
                # bad input. A device error (a CUDA fault) is not: as it is.
                if getattr(value, "is_meta", False) or isinstance(exc, NotImplementedError):
                    raise TypeError(
                        f"cannot read an integer from {describe(value, 80)}: {exc}"
                    ) from exc
                raise
    if isinstance(value, bool):
        raise TypeError("a bool is not a row id")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise  # not an integer
    except Exception as exc:  # an __index__ that raises
        raise TypeError(f"{type(value).__name__}.__index__ raised {exc!r}") from exc


#: What a call that takes ids refuses although it iterates: text, bytes
#: (and views of them) and mappings (whose iteration yields their keys).
_NOT_IDS = (str, bytes, bytearray, memoryview, Mapping)


def as_row_ids(rows: object) -> Sequence[int]:
    """What engines hold, as a sequence of Python ints.

    Accepts an int or an integer scalar (numpy, torch; a 0-d tensor is one
    row), a 1-D integer tensor or array, or any iterable of those. A list,
    tuple or range of Python ints is returned as it is (the fast path);
    anything else is converted once, here, off the hot path. Raises
    :class:`InvalidSlotError` naming the value for floats, bools, strings,
    mappings (a dict iterates its keys) and tensors that are not 1-D. A set
    is accepted (its ids are distinct), as ``KVPagePool.free`` accepts one.
    A tensor without readable data (meta, sparse, quantized, sub-byte) is
    an ``InvalidSlotError``; a strided integer tensor whose read fails (a
    device fault) raises what the device raised, as it is.
    """
    cls = rows.__class__
    if cls is list or cls is tuple or cls is range:
        seq: Sequence[Any] = rows  # type: ignore[assignment]
        for row in seq:
            if row.__class__ is not int:
                break
        else:
            return seq
        return [_row_id(row) for row in seq]
    if cls is int:
        return (rows,)  # type: ignore[return-value]
    if isinstance(rows, _NOT_IDS):
        # A mapping iterates its keys: free({3: "x"}) would free row 3; text
        # and bytes (a memoryview too: it has ndim and tolist) are not ids.
        # KVPagePool.free refuses them too; a set (distinct ids) is accepted
        # by both.
        raise InvalidSlotError(
            f"rows must be an int or a sequence of ints, got {describe(rows, 80)} of type "
            f"{type(rows).__name__}"
        )
    ndim = getattr(rows, "ndim", None)
    if ndim == 0:
        return (_row_id(rows),)
    if ndim is not None and ndim != 1:
        raise InvalidSlotError(
            f"rows must be one row id or a 1-D sequence of row ids, got a {ndim}-D "
            f"{_attributes(rows)}"
        )
    if ndim == 1 and hasattr(rows, "tolist"):
        try:
            values = rows.tolist()
        except (RuntimeError, NotImplementedError) as exc:
            # Meta (NotImplementedError), sparse, quantized, sub-byte: bad
            # input. A strided integer tensor reads unless its device
            # faulted (a sticky CUDA error): not bad input, as it is.
            if device_fault(rows, exc):
                raise
            raise InvalidSlotError(
                "rows must be a tensor with data (strided, on a real device) of an integer "
                f"dtype, got {_attributes(rows)}"
            ) from None
        return [_row_id(row) for row in values]
    if not isinstance(rows, Iterable):
        raise InvalidSlotError(
            f"rows must be an int or a sequence of ints, got {describe(rows, 80)} of type "
            f"{type(rows).__name__}"
        )
    return [_row_id(row) for row in rows]


#: torch's integer dtypes by how torch prints them (``str(torch.int64)``),
#: so that this module tells them apart without importing torch;
#: ``tables.ID_DTYPES`` is built from these names.
INTEGER_DTYPE_NAMES = frozenset(
    f"torch.{kind}{bits}" for kind in ("int", "uint") for bits in (8, 16, 32, 64)
)


def device_fault(tensor: object, exc: BaseException) -> bool:
    """True when reading ids out of ``tensor`` raised ``exc`` because of its
    device (a sticky CUDA fault), not because of what it is: a strided,
    non-meta tensor of an integer dtype reads unless its device failed, and
    a meta tensor's ``NotImplementedError`` (no data) is bad input. Callers
    re-raise such an error as it is and turn any other into their typed
    error; sparse, quantized and sub-byte tensors are bad input, and so is
    a ZeroTensor (``torch._efficientzerotensor``: strided, but no storage)."""
    is_zero = getattr(tensor, "_is_zerotensor", None)
    return (
        not isinstance(exc, NotImplementedError)
        and not getattr(tensor, "is_meta", False)
        and str(getattr(tensor, "layout", "")) == "torch.strided"
        and str(getattr(tensor, "dtype", "")) in INTEGER_DTYPE_NAMES
        and not (callable(is_zero) and is_zero())
    )


def index_or_error(value: object, rule: str) -> int:
    """:func:`as_index`, raising ``InvalidSlotError(f"{rule}, got ...")``
    (naming the value and its type) for what it refuses."""
    if value.__class__ is int:
        return value
    try:
        return as_index(value)
    except TypeError:
        raise InvalidSlotError(
            f"{rule}, got {describe(value)} of type {type(value).__name__}"
        ) from None


def _row_id(row: object) -> int:
    return index_or_error(row, "row ids must be integers")


#: A record that makes a row's uses longer than this asks some of their
#: fences of unknown origin whether they completed (:func:`_pruned`).
_PRUNE_AT = 8


def _pruned(prev: Any, new: tuple[Fence, ...], asked: dict[int, tuple[Fence, Any]]) -> Any:
    """``new`` (``prev``, a row's uses, with a record merged in: ``prev``'s
    fences in their places, ordered ones maybe replaced, then the fences
    the record added) less the fences of unknown origin found complete.

    A transfer handle recorded on a row every step would otherwise stay in
    its uses, landed or not, until the row is freed: O(steps) memory and
    merge and free cost per row, and every landed handle (which may own
    buffers) kept alive. Asked, through ``asked`` (this call's answers, so
    each fence is asked once per call: :func:`answer_once`): the first
    fences of unknown origin of ``prev``'s part, two for each fence the
    record added (the added ones, just launched, are not asked). Those
    that answered True go; those still open, and those whose ``query()``
    raised or answered neither yes nor no (faults: the free quarantines
    behind them), stay and move behind the others of ``prev``'s part, so
    the next records ask the ones after them: every fence is asked in
    turn, a handle stuck open costs a query per pass, not per record. Each
    added fence thus costs at most two queries, and a row recorded with
    one new handle a step keeps about twice its handles still open, plus
    ``_PRUNE_AT``. What a ``query()`` raises that is not an ``Exception``
    propagates, before anything is changed for the rows that hold
    ``prev``."""
    n_old = 0 if prev is None else len(prev) if prev.__class__ is tuple else 1
    budget = 2 * (len(new) - n_old)
    if budget <= 0:
        return new
    kept: list[Fence] = []
    stay: list[Fence] = []  # asked, not complete: behind the others
    for i in range(n_old):
        f = new[i]
        if budget and stream_key(f) is None:
            budget -= 1
            try:
                done = answer_once(asked, f)
            except Exception:  # a fault: kept, for the free to quarantine
                done = False
            if not done:
                stay.append(f)
        else:
            kept.append(f)
    if not stay and len(kept) == n_old:
        return new  # nothing of unknown origin in prev's part
    kept += stay
    kept += new[n_old:]
    return kept[0] if len(kept) == 1 else tuple(kept)


#: Past this many fences, :func:`_fold_uses` folds them in one pass
#: (:func:`_merge_many`) instead of one :func:`_merge_uses` per fence.
_FOLD_AT = 8


def _fold_uses(prev: Any, fences: Sequence[Fence]) -> Any:
    """``prev`` (a row's uses) with ``fences`` recorded in turn, as one
    :meth:`SlotLedger.record_use` per fence leaves it: a few fences one by
    one (each a short scan of the row's uses), more in one pass
    (O(len(prev) + len(fences)), not O(len(prev) * len(fences)))."""
    if len(fences) > _FOLD_AT:
        return _merge_many(prev, fences)
    new = prev
    for f in fences:
        if new is None or new is f:
            new = f
        else:
            key = stream_key(f)
            if key is not None and stream_key(new) == key:
                new = f if getattr(new, "seq", 0) <= getattr(f, "seq", 0) else new
            else:
                new = _merge_uses(new, f)
    return new


def _merge_many(prev: Any, fences: Sequence[Fence]) -> Any:
    """``prev`` (a row's uses: None, a fence or a tuple of them) with every
    fence of ``fences`` recorded in turn, as :meth:`SlotLedger.record_use`
    records one: a fence replaces the one of its stream whose ``seq`` is
    not newer, one of unknown origin is added once (by identity); the
    others keep their places, new ones are appended. One fence alone is
    returned as itself, several as a tuple. O(len(prev) + len(fences))."""
    out: list[Fence] = [] if prev is None else [*prev] if prev.__class__ is tuple else [prev]
    at: dict[int, int] = {}  # stream key -> index in out
    seen: set[int] = set()  # ids of the fences of unknown origin in out
    for i, f in enumerate(out):
        key = stream_key(f)
        if key is None:
            seen.add(id(f))
        else:
            at[key] = i
    for f in fences:
        key = stream_key(f)
        if key is None:
            if id(f) not in seen:
                seen.add(id(f))
                out.append(f)
        else:
            at_key = at.get(key)
            if at_key is None:
                at[key] = len(out)
                out.append(f)
            elif getattr(out[at_key], "seq", 0) <= getattr(f, "seq", 0):
                out[at_key] = f
    return out[0] if len(out) == 1 else tuple(out)


def _merge_uses(prev: Any, fence: Fence) -> tuple[Fence, ...]:
    """Fold ``fence`` into a row's uses: the newest per stream, all unordered."""
    fences = [*prev] if prev.__class__ is tuple else [prev]
    key = stream_key(fence)
    if key is not None:
        for i, f in enumerate(fences):
            if stream_key(f) == key:
                if getattr(f, "seq", 0) <= getattr(fence, "seq", 0):
                    fences[i] = fence
                return tuple(fences)
    elif any(f is fence for f in fences):
        return tuple(fences)
    fences.append(fence)
    return tuple(fences)
