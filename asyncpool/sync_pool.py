"""``ReqToTokenPool``: the seed's synchronous API, made fence-safe.

A drop-in for tokenspeed's ``ReqToTokenPool``: same constructor, ``alloc``
returning ``None`` when short, ``free``, ``available_size``, ``clear``,
``set_req_pool_info``, ``write`` and the four tensors. Differences, on
purpose: ``alloc(0)``, ``alloc(-1)``, a non-int size and ``alloc(n >
capacity)`` raise :class:`CapacityError` (the seed returns ``[]``, rows, or
``None``); a double free raises :class:`DoubleFreeError` (the seed corrupts
its free list). Rows are reset lazily and in bulk rather than one torch op
per call, and a freed row waits for its recorded uses: a write that is not
ordered with the tables' stream and lands after a bulk reset survives into
the row's next owner, where the seed's zeroing at ``alloc`` may have come
later; ``record_use`` is the protection (docs/api.md, "Deliberate differences").

Not thread-safe: call it from one thread (the scheduler's), ``available_size``
included (it reclaims); only :meth:`ReqToTokenPool.stats` may be read from
another thread (a scrape).
"""

from __future__ import annotations

import logging
from typing import Any, SupportsIndex

import torch

from .agreement import agree, check_explicit, check_reclaim_mode, forget_stream
from .base import PoolCore, force_release_fences, log_force_release, log_force_release_many
from .deferral import check_ordered
from .fences import Fence, Fences, HostStream
from .ledger import Rows
from .naming import repr_head
from .stats import Histogram, PoolStats

__all__ = ["ReqToTokenPool"]

_NO_WAITS = Histogram()  # never observed: the sync pool's waits are all zero

logger: logging.Logger = logging.getLogger(__name__)


class ReqToTokenPool(PoolCore):
    """A pool of ``size - 1`` request rows (row 0 is reserved padding).

    ``free(rows)`` returns a row at once unless ``record_use`` tied it to an
    incomplete fence, or ``fence=``/``after=`` name one: then the row is
    *pending* and comes back through :meth:`reclaim`, which :meth:`alloc` runs
    before answering ``None``.

    ``reclaim="explicit"`` (for one scheduler replica per tensor-parallel
    rank): the pool never asks a fence whether it completed; pending rows
    come back through :meth:`retire` (the scheduler processed that step) and
    :meth:`agree` (a collective over the ranks), so every rank that makes the
    same calls makes the same decisions.

    ``name`` (keyword only; None, the default, for none): a label for an
    engine that runs several pools, shown in ``repr()`` and at the start of
    every line the pool logs (``pool 'decode': force_release(...)``);
    without one the lines are as they always were. A non-empty ``str`` of
    at most 64 printable characters (no control characters or newlines,
    which could forge log lines): ``TypeError`` for a non-str,
    ``ValueError`` otherwise, nothing built. Read back as :attr:`name`; the
    hot paths never read it.
    """

    def __init__(
        self,
        size: SupportsIndex,
        max_context_len: SupportsIndex,
        device: str | torch.device = "cpu",
        enable_memory_saver: bool = False,
        stream: HostStream | torch.Stream | None = None,
        *,
        reclaim: str = "auto",
        name: str | None = None,
    ) -> None:
        explicit = check_reclaim_mode(reclaim)
        super().__init__(size, max_context_len, device, enable_memory_saver, stream, name=name)
        if explicit:
            self._ledger.make_explicit()
        self._alloc_calls = 0  # successful alloc() calls (each a zero wait)

    def __repr__(self) -> str:
        led = self._ledger
        return (
            f"{repr_head('ReqToTokenPool', self._name)}size={self.size} free={led.free_count} "
            f"allocated={led.allocated} pending={led.pending} quarantined={led.quarantined}>"
        )

    def alloc(self, need_size: SupportsIndex) -> list[int] | None:
        """Take ``need_size`` rows (oldest-freed first), or None when short.

        Reclaims completed fences before answering None. Raises
        :class:`CapacityError` for a size that is not an int in
        ``1..capacity``. The rows read zero lengths.
        """
        led = self._ledger
        if need_size.__class__ is not int or not 0 < need_size <= led.capacity:
            need_size = led.check_n(need_size)
        rows = led.take(need_size)
        if rows is None and led.pending and led.reclaim():
            rows = led.take(need_size)
        if rows is not None:
            self._alloc_calls += 1
        return rows

    def available_size(self) -> int:
        """Rows free right now, after returning rows whose fences completed.

        The seed's schedulers size a batch by ``available_size()`` before
        they call ``alloc`` (SGLang's ``available_req_slots``); nothing else
        reclaims a synchronous pool, so a count that left out rows behind
        completed fences could stay 0 for good. Reclaims only while rows are
        pending (one ``query()`` per stream head); with
        ``reclaim="explicit"`` it asks no fence (rows come back through
        :meth:`retire` and :meth:`agree`).
        """
        led = self._ledger
        if led.pending:
            led.reclaim()
        return led.free_count

    def record_use(self, rows: Rows, fence: Fences) -> None:
        """Tie ``rows`` to work that completes with ``fence`` (or with every
        fence of a sequence of them): a later :meth:`free` of a row
        waits for the newest use recorded for it (per stream) and for the
        fences of unknown origin recorded for it that have not completed
        (a record asks some of a long row's handles in turn and drops
        those that landed; not with ``reclaim="explicit"``: see
        :meth:`AsyncReqToTokenPool.record_use`). Raises, changing nothing:
        :class:`InvalidSlotError` unless every row is allocated,
        ``TypeError`` for a ``fence`` that is not a fence or a sequence of
        fences, None included (a use needs its fence; ``[]`` records
        none)."""
        self._ledger.record_use(rows, fence)

    def free(
        self,
        free_index: Rows,
        fence: Fences | None = None,
        *,
        after: HostStream | torch.Stream | None = None,
    ) -> int:
        """Free rows; each waits for its newest recorded use and for ``fence``.

        Same signature as :meth:`AsyncReqToTokenPool.free`: ``fence`` by
        position or keyword (one fence, or a sequence of fences: the
        rows wait for every one; an empty one is no fence), ``after`` by
        keyword only. ``after=stream``
        records a fence on ``stream`` now and waits for it too. Returns how
        many rows were free at once. Raises, changing nothing, for bad rows
        (:class:`InvalidSlotError`, :class:`DoubleFreeError`), a non-fence
        (naming a bad element of a sequence by its position)
        or an ``after`` that is not a stream (``TypeError``) and a closed
        ``HostStream`` as ``after`` (``RuntimeError``). ``free_index``: an
        int, a list of ints, integer scalars or a 1-D integer tensor or
        array.
        """
        led = self._ledger
        if after is not None:
            free_index = self._use_until_now(free_index, after, fence)
        return led.free(free_index, fence)

    @property
    def reclaim_mode(self) -> str:
        """``"auto"`` or ``"explicit"`` (the constructor's ``reclaim``)."""
        return "explicit" if self._ledger.explicit else "auto"

    def reclaim(self) -> int:
        """Return rows whose fences completed; the number made free.

        With ``reclaim="explicit"`` it asks no fence and returns 0: rows
        come back through :meth:`retire` and :meth:`agree` only.
        """
        return self._ledger.reclaim()

    def retire(self, fence: Fence) -> int:
        """The scheduler processed the step ``fence`` ends (``reclaim="explicit"``).

        Returns to circulation exactly the rows behind fences of ``fence``'s
        stream up to it, in record order; never calls ``query()``. Returns
        the rows made free (0 when nothing waited on it). Raises
        ``TypeError`` for a fence that is not ordered, ``RuntimeError`` on an
        ``"auto"`` pool; either way nothing changes.
        """
        led = self._ledger
        check_explicit(led, "retire")
        check_ordered(fence)
        return led.retire(fence)

    def forget_stream(self, stream_key: int) -> bool:
        """Forget that stream ``stream_key`` was retired.

        ``reclaim="explicit"`` only. The contract is
        :meth:`AsyncReqToTokenPool.forget_stream
        <asyncpool.AsyncReqToTokenPool.forget_stream>`'s, on this pool's rows:
        a mark (about 32 B) stays per stream key :meth:`retire` ever retired
        until this is called, once the stream is done with, at the same point
        on every rank (the pool never prunes one itself); True if a mark was
        dropped; ``TypeError`` or ``RuntimeError`` as there, nothing changed.
        """
        return forget_stream([self._ledger], stream_key)

    def agree(self, group: Any = None) -> int:
        """Settle pending fences identically on every rank of ``group``
        (``reclaim="explicit"``); see :mod:`asyncpool.agreement`.

        A collective over a ``torch.distributed`` process group (None: the
        default group): every rank calls it at the same point. Returns the
        rows made free. Raises :class:`AgreementError` on every rank,
        changing nothing, when the ranks' pools disagree or a fence's
        ``query()`` was interrupted on another rank (that rank raises its
        ``KeyboardInterrupt`` or ``SystemExit``). ``RuntimeError`` on an
        ``"auto"`` pool or without an initialised ``torch.distributed``,
        and ``TypeError``/``ValueError`` for a bad ``group``, raise on this
        rank alone, before the collective (the other ranks then wait in it).
        """
        check_explicit(self._ledger, "agree")
        return agree(group, [self._ledger], pool_name=self._name).released[0]

    def force_release(self, fence: Fences) -> int:
        """Release the rows held behind ``fence``, done or not (logged).

        The escape hatch :meth:`AsyncReqToTokenPool.force_release` is, for
        an operator who knows the work behind a stuck fence (a transfer
        whose peer died) will never write or read again: rows waiting on
        ``fence`` are treated as if it had completed (released, or still
        waiting for their other fences). Never asks ``fence`` anything. Rows
        still allocated with a use recorded on ``fence`` forget that use.
        Rows quarantined behind a fence that *faulted* stay quarantined (its
        faulted work may still write or read them; nothing returns them).
        Returns the rows made free: 0 when none is, which includes rows that
        still wait for their other fences (they no longer wait for this
        one). ``fence`` may also
        be a sequence of fences: all of them at once, one log line, the rows
        summed (an empty one: 0, nothing logged). Raises ``TypeError`` for a
        non-fence, or a sequence with one (named by its position) or
        another iterable, changing nothing.
        """
        fences = force_release_fences(fence)
        if not fences:
            return 0
        led = self._ledger
        held = led.holds_any(fences)
        rows = led.force_release_all(fences)
        forgot = led.forget_uses(fences)
        log = self._log_to(logger)
        if len(fences) > 1:
            log_force_release_many(
                log, fences, rows, None, held, forgot, remembers_fault=led.remembers_fault
            )
            return rows
        log_force_release(
            log,
            fences[0],
            "row",
            rows,
            held,
            ""
            if not forgot
            else "; 1 allocated row forgets its use of it"
            if forgot == 1
            else f"; {forgot} allocated rows forget their use of it",
            faulted=not rows and not held and led.remembers_fault(fences[0]),
        )
        return rows

    def clear(self) -> None:
        """Flush: free every allocated row at once and zero every row's
        lengths (``req_to_token`` keeps its contents, as after any free).

        Never releases a row still behind a fence: allocated rows with an
        incomplete recorded use, and rows already pending, *stay pending*
        and return through :meth:`reclaim` once their fences complete
        (``reclaim="explicit"``: through :meth:`retire` or :meth:`agree`).
        """
        led = self._ledger
        led.free_all_allocated()
        led.reclaim()
        self._tables.reset_all()
        led.restore_fresh_order()

    def stats(self, *, summaries: bool = True) -> PoolStats:
        """A frozen snapshot of counts, totals, histograms and latency summaries.

        Every successful :meth:`alloc` counts as a zero wait.
        ``summaries=False`` leaves the percentile summaries empty (sorting
        their sample windows is the costly part); metrics scrapes use it.
        """
        calls = self._alloc_calls
        return self._stats(
            summaries,
            waiters=0,
            timeouts=0,
            cancellations=0,
            rejections=0,
            closed=False,
            released=False,
            alloc_calls=calls,
            wait_histogram=_NO_WAITS.snapshot(zeros=calls),
        )
