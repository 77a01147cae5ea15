"""What the synchronous and the asyncio pool share: ledger + tables."""

from __future__ import annotations

import logging
import math
import numbers
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, SupportsIndex

import torch

from .fences import Fence, Fences, HostStream, check_after, fence_list, is_fence, record_fence
from .forks import refuse_copy
from .ledger import FREE, Rows, SlotLedger, as_index, check_size, describe
from .naming import Log, check_name, pool_log
from .stats import LatencySummary, PoolStats
from .tables import PoolInfo, TokenTables

__all__ = [
    "PoolCore",
    "check_timeout",
    "check_wait_args",
    "count_of",
    "fences_words",
    "force_release_fences",
    "int_arg",
    "log_force_release",
    "log_force_release_many",
]

# From this many dirty rows on, a bulk reset uses a mask of the FREE rows
# instead of an index list (measured: about 3x cheaper at 1,024 rows).
_MASK_RESET_ROWS = 128


def count_of(n: int, noun: str) -> str:
    """``"1 row"``, ``"2 rows"``: messages read as sentences."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def log_force_release(
    log: Log,
    fence: Fence,
    noun: str,
    released: int,
    held: bool,
    aside: str = "",
    *,
    faulted: bool = False,
) -> None:
    """The warning ``force_release(fence)`` logs on a pool of one kind of
    ``noun`` (the synchronous pool's rows, a bare page pool's pages): what
    came back, or why nothing did (what it held still waits for other
    fences, or nothing was pending behind it; ``aside`` adds to that one;
    ``faulted``: the fence faulted, and what was behind it stays
    quarantined, which the line says rather than "no ... was pending").
    ``log``: the pool's module logger, through :func:`~asyncpool.naming.pool_log`
    (a named pool's lines start with its name)."""
    if released:
        log.warning(
            "force_release(%r): %s returned to circulation without the fence completing",
            fence,
            count_of(released, noun),
        )
    elif held:
        log.warning(
            "force_release(%r): the %ss behind this fence still wait for other "
            "fences; they no longer wait for this one",
            fence,
            noun,
        )
    elif faulted:
        log.warning(
            "force_release(%r): this fence faulted; the %ss behind it are quarantined "
            "for good (its faulted work may still write or read them) and stay so%s",
            fence,
            noun,
            aside,
        )
    else:
        log.warning(
            "force_release(%r): no %s was pending behind this fence (never given to "
            "this pool, already completed and reclaimed, or released before)%s",
            fence,
            noun,
            aside,
        )


def force_release_fences(fence: object) -> tuple[Fence, ...]:
    """``force_release``'s argument checked, as its fences: one fence, or a
    sequence of them (:func:`~asyncpool.fences.fence_list`'s rules and
    ``TypeError``). ``None`` is a ``TypeError`` here, not "no fence": an
    operator who passes it has the wrong object. A fence listed twice counts
    once (releasing is idempotent; the log line counts distinct fences),
    first place kept."""
    if fence is None:
        raise TypeError(
            "fence= must be a fence (an object with query() and synchronize()) or a "
            "sequence of fences, got None"
        )
    fences = fence_list(fence)
    if len(fences) > 1:
        # dict keeps first places; keyed by identity (a fence may define ==).
        fences = tuple({id(f): f for f in fences}.values())
    return fences


#: How many fences a line about a sequence of them names (the rest counted).
_FENCES_NAMED = 3


def fences_words(fences: Sequence[Fence]) -> str:
    """Several fences in a log line: ``"5 fences: <a>, <b>, <c> and 2
    more"`` (the first :data:`_FENCES_NAMED` by ``repr``)."""
    named = ", ".join(map(repr, fences[:_FENCES_NAMED]))
    more = len(fences) - _FENCES_NAMED
    return f"{len(fences)} fences: {named}" + (f" and {more} more" if more > 0 else "")


def log_force_release_many(
    log: Log,
    fences: Sequence[Fence],
    rows: int | None,
    pages: int | None,
    held: bool,
    uses: int = 0,
    *,
    remembers_fault: Callable[[Fence], bool],
) -> None:
    """The one warning ``force_release(fences)`` logs for a sequence of two
    or more fences, on any pool: what came back (``rows``/``pages``: None
    for a kind the pool has not), or why nothing did (what they held still
    waits for other fences; some of them faulted, and what was behind them
    stays quarantined, which the line says rather than "hold nothing";
    they held nothing, but were dropped from the recorded uses of ``uses``
    allocated rows; or nothing at all). ``remembers_fault(fence)``: whether
    the pool (any of its ledgers) saw ``fence`` fault; asked of each fence
    only when nothing came back and nothing is held (the count of faulted
    fences, here once for every kind of pool)."""
    what = fences_words(fences)
    back = [count_of(n, noun) for n, noun in ((rows, "row"), (pages, "page")) if n is not None]
    if rows or pages:
        log.warning(
            "force_release(%s): %s returned to circulation without the fences completing",
            what,
            " and ".join(back),
        )
    elif held:
        log.warning(
            "force_release(%s): what these fences held still waits for other fences; "
            "it no longer waits for these",
            what,
        )
    elif faulted := sum(map(remembers_fault, fences)):
        nouns = " and ".join(
            f"{noun}s" for n, noun in ((rows, "row"), (pages, "page")) if n is not None
        )
        log.warning(
            "force_release(%s): %s of these fences faulted; the %s behind %s are "
            "quarantined for good (its faulted work may still write or read them) and stay so%s",
            what,
            "all" if faulted == len(fences) else faulted,
            nouns,
            "it" if faulted == 1 else "them",
            ""
            if not uses
            else f"; dropped them from the recorded uses of {count_of(uses, 'allocated row')} "
            "(freed later, they do not wait for them)",
        )
    elif uses:
        log.warning(
            "force_release(%s): these fences hold nothing pending in this pool; dropped "
            "them from the recorded uses of %s (freed later, they do not wait for them)",
            what,
            count_of(uses, "allocated row"),
        )
    else:
        log.warning(
            "force_release(%s): these fences hold nothing pending in this pool (never "
            "given to it, already completed and reclaimed, or released before); nothing "
            "changed",
            what,
        )


def int_arg(value: object) -> int | None:
    """``value`` as a Python int if it is an integer of any type
    ``operator.index`` takes (an ``IntEnum``, a numpy integer, a 0-d integer
    tensor), bools excepted; None otherwise. For arguments such as
    ``priority=`` and ``max_waiters=``, converted off the fast paths."""
    if isinstance(value, bool):
        return None
    try:
        return as_index(value)  # refuses numpy and tensor bools too
    except TypeError:
        return None


def check_wait_args(priority: object, timeout: object) -> tuple[int, float | None]:
    """``(priority, timeout)`` checked: ``priority`` as an int (see
    :func:`int_arg`), ``timeout`` None or a real number >= 0 (a numpy
    integer or float as a Python float). Raises ``TypeError`` for a priority
    that is not an integer (a bool, a float) and ``ValueError`` for a bad
    ``timeout`` (a bool, a string, a negative number, NaN)."""
    if priority.__class__ is not int:
        converted = int_arg(priority)
        if converted is None:
            raise TypeError(
                "priority must be an int (any integer type but bool), got "
                f"{describe(priority, 80)} of type {type(priority).__name__}"
            )
        priority = converted
    assert isinstance(priority, int)
    return priority, check_timeout(timeout)


def check_timeout(timeout: object, name: str = "timeout") -> float | None:
    """``timeout`` (None or a real number >= 0: an int, a float, a numpy
    integer or float; not a bool) as it is when an int or float, as a Python
    float otherwise, and one past the float range (``10**400``) as ``inf``:
    for ever (the loop's timer arithmetic would raise ``OverflowError``);
    ``ValueError``, naming the parameter ``name``, for anything else."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        pass
    elif isinstance(timeout, float):
        if timeout >= 0:  # False for NaN
            return timeout
    elif isinstance(timeout, int):
        if timeout >= 0:
            # Past the float range (10**400) no clock gets there, and the
            # loop's timer arithmetic would raise OverflowError: for ever.
            return timeout if timeout <= sys.float_info.max else math.inf
    else:  # a numpy number, a Fraction
        try:
            value = float(timeout)
        except OverflowError:  # a Fraction past the float range: for ever, if >= 0
            value = math.inf if timeout > 0 else -math.inf  # type: ignore[operator]
        if value >= 0:  # False for NaN
            return value
    raise ValueError(f"{name} must be None or a number >= 0, got {describe(timeout, 80)}")


class PoolCore:
    """Ledger (who owns which row) plus tables (the tensors).

    Subclasses add how allocation waits. The tensors are plain attributes,
    as in the seed: ``req_to_token``, ``verified_lens``, ``alloced_lens``,
    ``alloced_lens_cpu``.
    """

    req_to_token: torch.Tensor
    verified_lens: torch.Tensor
    alloced_lens: torch.Tensor
    alloced_lens_cpu: torch.Tensor

    def __reduce_ex__(self, protocol: SupportsIndex) -> NoReturn:
        # pickle, copy.copy and copy.deepcopy: refused with the rule, a live
        # object (asyncpool.forks); not "cannot pickle '_thread.lock'".
        refuse_copy(self)

    def __init__(
        self,
        size: SupportsIndex,
        max_context_len: SupportsIndex,
        device: str | torch.device = "cpu",
        enable_memory_saver: bool = False,
        stream: HostStream | torch.Stream | None = None,
        *,
        name: str | None = None,
    ) -> None:
        """Bounds, checked before anything is built: ``size`` an int (any
        integer type but bool: numpy and torch integers are read as ints) in
        ``2..2**31`` (row ids fit the int32 index tensors engines keep them
        in; :class:`CapacityError`), ``max_context_len`` an int (likewise) in
        ``1..2**31 - 1`` (lengths are int32; ``ValueError``),
        ``enable_memory_saver`` a bool (``TypeError``), ``device`` one torch
        parses, not ``meta`` (its tensors hold no data) and not CUDA without
        CUDA (:class:`DeviceError`). The tables (``size * max_context_len``
        int32 slots) are allocated before the ledger's per-row lists, so a
        pool too large for memory fails at once, in torch's allocator.
        ``name``: None or a non-empty printable ``str`` of at most 64
        characters (:func:`~asyncpool.naming.check_name`: ``TypeError``,
        ``ValueError``), checked first.
        """
        name = check_name(name)
        size = check_size(size)
        self._tables = TokenTables(size, max_context_len, device, enable_memory_saver, stream)
        max_context_len = self._tables.max_context_len
        self._ledger = SlotLedger(
            size,
            on_reset=self._reset_rows,
            on_pending=self._on_pending,
            on_fault=self._on_fault,
        )
        self.size: int = size
        self.max_context_len: int = max_context_len
        self.device: str | torch.device = device
        self.stream: HostStream | torch.Stream | None = stream
        self._name = name
        # The ledger's fault and quarantine lines name the pool too.
        self._ledger.set_log_name(name)
        self._bind_tensors()

    @property
    def name(self) -> str | None:
        """The pool's name (the constructor's ``name=``), or None: shown in
        ``repr()`` and at the start of every line the pool logs
        (``pool 'decode': ...``). Read-only."""
        return self._name

    def _log_to(self, logger: logging.Logger) -> Log:
        """``logger`` for one of this pool's log lines: as it is without a
        name, else one that starts the line with the name. Log paths only."""
        return pool_log(logger, self._name)

    def _bind_tensors(self) -> None:
        tables = self._tables
        self.req_to_token = tables.req_to_token
        self.verified_lens = tables.verified_lens
        self.alloced_lens = tables.alloced_lens
        self.alloced_lens_cpu = tables.alloced_lens_cpu

    # Hooks from the ledger -------------------------------------------------

    def _reset_rows(self, rows: list[int]) -> None:
        led = self._ledger
        if led.free_count == led.capacity:
            # Every row is free (an idle pool running out of clean rows):
            # zero them all in one op, no index or mask to build.
            self._tables.reset_rows_from_1()
        elif len(rows) >= _MASK_RESET_ROWS:
            # Many dirty rows: zero every FREE row through a mask over a byte
            # copy of the ledger's states (one C pass; re-zeroing clean rows
            # is harmless); cheaper than building an index of the rows.
            state = torch.frombuffer(self._ledger.state_bytes(), dtype=torch.uint8)
            self._tables.reset_where(state == FREE)
        else:
            self._tables.reset_rows(rows)

    def _on_pending(self, fence: Fence) -> None:
        """A fence started holding rows (the async pool arranges a wake-up)."""

    def _on_fault(self, fence: Fence, error: BaseException) -> None:
        """A fence faulted and its rows were quarantined."""

    # Shared API ------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """Rows that can be handed out: ``size - 1`` (row 0 is reserved)."""
        return self._ledger.capacity

    def available_size(self) -> int:
        """Rows free right now (not counting rows pending behind fences).

        On ``AsyncReqToTokenPool`` a read: rows whose fences completed come
        back when the event loop runs the pool's wake-up, or at
        ``reclaim()`` (docs/api.md: *Counts are reads; wake-ups need the loop*).
        """
        return self._ledger.free_count

    def pending_size(self) -> int:
        """Rows freed but waiting for their fences to complete."""
        return self._ledger.pending

    def quarantined_size(self) -> int:
        """Rows kept out of circulation because their fence faulted."""
        return self._ledger.quarantined

    def allocated_size(self) -> int:
        """Rows handed out and not yet freed."""
        return self._ledger.allocated

    def set_req_pool_info(self, req_pool_idx: SupportsIndex, metadata: PoolInfo) -> None:
        """Write a row's lengths and token slots (for chunked prefill).

        Raises :class:`InvalidSlotError`, changing nothing, for row 0, a row
        out of range or not allocated, and metadata that does not fit the
        row (lengths, dtype, shape, slot ids out of range).

        Each call checks and writes the row's first ``alloced_len`` slots,
        all of them (the seed's contract): a chunked prefill that calls it
        once a chunk rewrites the row's whole prefix each chunk, O(row), so
        a long prompt costs O(length**2 / chunk) in all (a 128k-token row
        in 16 chunks of 8k, page_size 1, on the host: 1.6-1.8 ms in all,
        against 0.3 ms for writing the chunks alone). To write only a chunk's slots, use
        ``write((row, slice(start, end)), slots)`` (unchecked, as SGLang's
        ``req_to_token_pool.write``) and keep the lengths
        (``verified_lens``, ``alloced_lens``, ``alloced_lens_cpu``)
        yourself."""
        row = self._tables.check_row(req_pool_idx)
        if self._ledger.state_of(row) != "allocated":
            raise self._ledger._row_error(row, "written")
        self._tables.set_req_pool_info(row, metadata)

    def write(self, indices: Any, values: Any) -> None:
        """``req_to_token[indices] = values``, as the seed does: unchecked
        (row 0 and rows not allocated included); :meth:`set_req_pool_info`
        checks the row."""
        self._tables.write(indices, values)

    def generation(self, row: int) -> int:
        """A tag that changes each time ``row`` is handed out; 0 if never.

        For stale-handle checks: keep the tag with the row and compare it
        later; a different tag means the row was freed and handed out again.
        The tag is the pool's running count of rows handed out, taken just
        after the row's latest hand-out (not a count of this row's own).
        Raises :class:`InvalidSlotError` for a row id that is not an integer
        in ``0..size - 1`` (a negative id would read another row's tag).
        """
        if row.__class__ is not int or not 0 <= row < self.size:
            row = self._tables.check_row(row)
        return self._ledger.generation(row)

    def _use_until_now(self, rows: Rows, after: Any, fence: Fences | None) -> Sequence[int]:
        """For ``free(rows, after=stream)``: tie ``rows`` to a fence recorded now.

        Checks everything first (``fence``: one fence, or every element of
        a sequence), so a refused free records no fence on the
        caller's stream. Returns the rows as a sequence (a one-shot iterator
        must survive both passes).
        """
        led = self._ledger
        check_after(after)
        if fence is not None and not is_fence(fence):
            fence_list(fence)  # TypeError for a non-fence, naming a bad element
        seq = led.as_rows(rows)
        led.check_allocated(seq, "freed")
        if len(seq):  # nothing to tie: no fence (a CUDA event) for an empty free
            led.record_use(seq, record_fence(after), "freed")
        return seq

    def check_invariants(self) -> None:
        """Raise AssertionError unless every bookkeeping invariant holds."""
        self._ledger.check_invariants()

    def _stats(self, summaries: bool = True, **extra: Any) -> PoolStats:
        led = self._ledger
        # Lifetime row totals first, then the counts now: read from another
        # thread, a grant in between then lowers `frees` instead of raising it.
        granted = led.granted
        allocs = granted - led.returned
        # Each count read once, allocated derived from them: the four add up
        # to capacity even when read while the owner moves rows.
        free = led.free_count
        pending = led.pending
        quarantined = led.quarantined
        allocated = led.capacity - free - pending - quarantined
        # Overdue memory is pending memory. A scrape from another thread
        # scans the overdue fences and reads the pending counts a few
        # operations apart; it reports no more overdue than pending.
        if extra.get("overdue_rows", 0) > pending:
            extra["overdue_rows"] = pending
        if extra.get("overdue_pages", 0) > extra.get("pages_pending", 0):
            extra["overdue_pages"] = extra.get("pages_pending", 0)
        if (
            extra.get("overdue_fences")
            and not extra["overdue_rows"]
            and not extra.get("overdue_pages")
        ):
            extra["overdue_fences"] = 0  # every one of them completed meanwhile
        return PoolStats(
            capacity=led.capacity,
            free=free,
            allocated=allocated,
            pending=pending,
            quarantined=quarantined,
            allocs=allocs,
            frees=allocs - allocated,
            rows_granted=granted,
            deferred_frees=led.deferred_frees,
            reclaimed=led.reclaimed,
            force_released=led.force_released,
            peak_allocated=led.peak_allocated,
            resets=led.resets,
            fence_errors=led.fence_errors,
            fence_latency=(
                LatencySummary.of(led.fence_latencies) if summaries else LatencySummary()
            ),
            fence_latency_histogram=led.fence_histogram.snapshot(),
            **extra,
        )
