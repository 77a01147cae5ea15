"""The pool's fence controls: explicit reclaim, tensor-parallel agreement,
the operator's release of stuck fences, the ledgers' pending hook with the
overdue timer, and what a faulted fence does to the waiters.

:class:`FenceControl` is mixed into :class:`~asyncpool.AsyncReqToTokenPool`
(a mixin with no state of its own; the pool composes its ledgers, waiters,
wake-ups and overdue check). It holds ``reclaim``/``reclaim_mode``;
``retire``, ``forget_stream`` and ``agree`` (``reclaim="explicit"``: memory
returns by the scheduler's word and a collective over the ranks, never by a
``query()``, :mod:`asyncpool.agreement`); ``force_release`` (memory behind a
fence whose work is known dead, logged at WARNING under the
``asyncpool.pool`` logger, as before this module split off); ``_on_pending``,
the hook both ledgers call when a fence starts holding memory (bind or move
to the running loop, arm the overdue check, have the wake-ups watch the
fence: :mod:`asyncpool.wakeups`); the overdue timer; and the fault hooks,
which fail waiters that quarantine made impossible (``_shed_unfittable``,
with the errors of ``_unfittable_need``/``_unfittable``).

Thread rules: the pool's (:mod:`asyncpool.pool`). Every public call here is
checked: from another thread it raises :class:`WrongThreadError`, changing
nothing. The ledgers call the hooks in the loop's thread; the overdue
timer's callback holds its pool weakly and does nothing on a loop the pool
has left. Cancellation: nothing here awaits, so nothing here is cancelled
part way; ``agree`` blocks the loop for its collective.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from typing import TYPE_CHECKING, Any

from .admission import Need
from .agreement import agree, check_explicit, forget_stream
from .base import count_of as _count
from .base import force_release_fences, log_force_release_many
from .deferral import Deferrals, check_ordered
from .errors import CapacityError
from .fences import Fence, Fences
from .ledger import SlotLedger
from .overdue import OverdueFences
from .row_pages import RowPages
from .waiters import WaiterQueues
from .wakeups import FenceWakeups

if TYPE_CHECKING:
    from .naming import Log

__all__ = ["FenceControl"]

# The pool's records: force_release's lines are logged as they were before
# this module split off from asyncpool.pool (operators and tests filter on it).
logger: logging.Logger = logging.getLogger("asyncpool.pool")

_peek_running_loop = asyncio._get_running_loop  # None outside a loop; never raises

#: After an overdue check that logged newly overdue fences, the next check
#: comes no sooner than this: at most a few WARNING lines a second, however
#: many fences turn overdue one after another (see ``_check_overdue``).
_RECHECK_AFTER_LOGGING_S = 1.0


def _check_overdue_of(pool_ref: weakref.ref[FenceControl], loop: Any) -> None:
    """An overdue check's timer callback, holding its pool weakly."""
    pool = pool_ref()
    if pool is not None:
        pool._check_overdue(loop)


class FenceControl:
    """Explicit reclaim, agreement, ``force_release``, the pending hook, the
    overdue timer and the fault hooks, mixed into ``AsyncReqToTokenPool``.

    The attributes and methods below are the pool's; see
    :class:`~asyncpool.AsyncReqToTokenPool` for the public contract of each
    call defined here.
    """

    _name: str | None
    _ledger: SlotLedger
    _capacity: int
    _pages: RowPages | None
    _groups: dict[str, RowPages] | None
    _page_sets: tuple[RowPages, ...]
    _waiters: WaiterQueues
    _wakeups: FenceWakeups
    _overdue: OverdueFences | None
    _loop: asyncio.AbstractEventLoop | None
    _closed: bool
    _unwatched: list[Fence]
    _page_fault_repeats: int
    _group_faults_seen: list[int]

    if TYPE_CHECKING:

        def _check_thread(self) -> None: ...

        def _log_to(self, logger: logging.Logger) -> Log: ...

        def _reclaim_all(self) -> tuple[int, bool]: ...

        def _rebind_loop(self, loop: asyncio.AbstractEventLoop) -> None: ...

        def _drop_dead_waiters(self) -> bool: ...

    # ------------------------------------------------------------ reclaim

    def reclaim(self) -> int:
        """Return memory whose fences completed; grant waiters; the rows made free.

        With ``reclaim="explicit"`` a no-op that returns 0 (it would decide
        by this rank's fence timing): :meth:`retire` and :meth:`agree` return
        memory there.
        """
        self._check_thread()
        released, made = self._reclaim_all()
        if made and self._waiters.count:
            self._waiters.grant()
        return released

    @property
    def reclaim_mode(self) -> str:
        """``"auto"`` or ``"explicit"`` (the constructor's ``reclaim``)."""
        return "explicit" if self._ledger.explicit else "auto"

    def retire(self, fence: Fence) -> tuple[int, int]:
        """The scheduler has processed the step ``fence`` ends (``reclaim="explicit"``).

        Returns to circulation exactly the rows and pages behind fences of
        ``fence``'s stream up to it, in record order, then grants waiters
        (the grant loop runs synchronously inside this call). Never calls
        ``query()``: call it once the step's outputs are in (you waited for
        them anyway), at the same point of the loop on every rank. Returns
        ``(rows, pages)`` made free; ``(0, 0)`` when nothing waited on it.
        Raises ``TypeError`` for a fence that is not ordered (a transfer
        handle: :meth:`agree` settles those) and ``RuntimeError`` on an
        ``"auto"`` pool; either way nothing changes. Loop thread only.
        """
        self._check_thread()
        led = self._ledger
        check_explicit(led, "retire")
        check_ordered(fence)
        rows = led.retire(fence)
        pages = sum(ps.ledger.retire(fence) for ps in self._page_sets)
        if (rows or pages) and self._waiters.count:
            self._waiters.grant()
        return rows, pages

    def forget_stream(self, stream_key: int) -> bool:
        """Forget that stream ``stream_key`` was retired, on the rows and the pages.

        ``reclaim="explicit"``: what :meth:`retire` keeps per stream is a
        mark (about 32 B) per stream key it ever retired, which a
        ``new_stream_key()`` per connection grows for as long as the pool
        serves; call this once a stream is done with (its last fence
        retired, none to be freed behind or retired again), at the same
        point on every rank, as :meth:`retire`. The pool never prunes a mark
        itself: ranks must decide alike. Afterwards a free behind a fence
        of that stream waits for a retire of it or for ``agree``. Returns
        True if a mark was dropped. ``TypeError`` for a key that is not an
        int, ``RuntimeError`` on an ``"auto"`` pool or while batches still
        wait for a fence of that stream (behind it, or after another
        stream's), or while an allocated row carries a recorded use of it
        not yet retired; either way nothing changes. The recorded uses its
        retire covers go with the mark: a later free of their rows is free
        of them at once, as it was with the mark.
        Loop thread only.
        """
        self._check_thread()
        return forget_stream([self._ledger, *(ps.ledger for ps in self._page_sets)], stream_key)

    def agree(self, group: Any = None) -> tuple[int, int]:
        """Settle pending fences identically on every tensor-parallel rank.

        A collective over the ``torch.distributed`` process group ``group``
        (None: the default group), for ``reclaim="explicit"`` pools: each
        rank asks its pending fences (rows and pages) locally, ONE small
        tensor of flags is all-reduced with MIN, and every rank releases
        exactly what all of them saw complete, quarantines what any saw
        fault (a transfer that failed on one rank only), marks overdue what
        any saw not done past ``fence_timeout``, then grants waiters. Every
        rank must call it at the same point of its loop; it blocks the loop
        for the collective
        (:mod:`asyncpool.agreement`). Returns ``(rows, pages)`` made free.
        Raises :class:`AgreementError` on every rank, changing nothing,
        when the ranks' pools hold different pending batches (in number or
        in the ids they hold: they did not make the same calls) or were
        built otherwise (``kv=`` on some ranks only), or when a fence's
        ``query()`` raised ``KeyboardInterrupt``/``SystemExit`` on
        another rank (that rank raises it, also changing nothing).
        ``RuntimeError`` on an ``"auto"`` pool, :class:`WrongThreadError`
        from a foreign thread and ``TypeError``/``ValueError`` for a bad
        ``group`` (``RuntimeError`` when ``torch.distributed`` is not
        initialised) raise on this rank alone, before the collective: the
        other ranks then wait in it until the group's timeout.
        """
        self._check_thread()
        led = self._ledger
        check_explicit(led, "agree")
        ledgers: list[Deferrals[Any]] = [led, *(ps.ledger for ps in self._page_sets)]
        timeout = self._overdue.timeout if self._overdue is not None else None
        res = agree(
            group,
            ledgers,
            overdue_after=timeout,
            pool_name=self._name,
            page_groups=None if self._groups is None else tuple(self._groups),
        )
        rows = res.released[0]
        pages = sum(res.released[1:])
        if (rows or pages or res.quarantined) and self._waiters.count:
            self._waiters.grant()
        return rows, pages

    def force_release(self, fence: Fences) -> tuple[int, int]:
        """Release the rows and pages held behind ``fence``, done or not.

        The escape hatch for an operator who knows the work behind a stuck
        fence (a transfer whose peer died) will never write or read again:
        memory waiting on ``fence`` is treated as if it had completed
        (released, or still waiting for its other fences), logged at
        WARNING, and the waiters are served. Never asks ``fence`` anything,
        and stops watching it. Rows still allocated with a use recorded on
        ``fence`` forget that use: freed later, they do not wait for it.
        Returns ``(rows, pages)`` made free: ``(0, 0)`` when none is, which
        includes memory that still waits for its other fences (it no longer
        waits for this one). What it frees counts in
        ``stats().force_released`` and ``pages_force_released``, not in
        ``reclaimed`` nor in the fence latencies (the fence did not
        complete). Acts on what waits now and is not remembered: a later
        free or use naming ``fence`` waits for it again, since a fence
        object may be armed again (a CUDA event recorded anew); a transfer
        known dead should answer ``query()`` True instead (docs/cuda.md).
        Rows and pages quarantined behind a fence that *faulted* stay
        quarantined (its faulted work may still write or read them; nothing
        returns them).

        ``fence`` may also be a sequence of fences (:data:`~asyncpool.Fences`;
        :meth:`overdue_fences` is one): every one is released as above, at
        once (none of them is asked anything, so memory behind two of them
        is released), with one log line for the call; returns the summed
        ``(rows, pages)``. An empty one releases nothing and logs nothing.
        Memory also behind a fence not listed waits for that one, and
        :meth:`overdue_fences` lists a batch under one fence at a time: a
        batch behind several stuck fences (a dead pipeline's stages) takes
        one call per fence, so repeat until it lists none.
        ``TypeError`` for a non-fence, or a sequence with an element that
        is not a fence (named by its position) or for another iterable (a
        set, an iterator, text): every element is checked before anything
        is released, and nothing changes.
        """
        self._check_thread()
        fences = force_release_fences(fence)
        if not fences:
            return 0, 0
        led = self._ledger
        pleds = [ps.ledger for ps in self._page_sets]
        held = led.holds_any(fences) or any(pled.holds_any(fences) for pled in pleds)
        # The rows' uses first: rows (and their pages) freed later skip them,
        # those freed from a query() the settles below ask included.
        uses = led.forget_uses(fences)
        rows = led.force_release_all(fences)
        pages = sum(pled.force_release_all(fences) for pled in pleds)
        ids = {id(f) for f in fences}
        if self._overdue is not None:
            for f in fences:
                self._overdue.forget(f)
        self._wakeups.unwatch(fences)  # nothing waits on them: stop asking
        if self._unwatched:
            # Deferred while the pool's loop was closed, so not watched yet:
            # the next loop must not start asking them either.
            self._unwatched = [f for f in self._unwatched if id(f) not in ids]
        log = self._log_to(logger)
        if len(fences) > 1:
            log_force_release_many(
                log, fences, rows, pages, held, uses, remembers_fault=self._remembers_fault
            )
            if rows or pages:
                self._waiters.grant()
            return rows, pages
        fence = fences[0]
        if rows or pages:
            log.warning(
                "force_release(%r): %s and %s returned to circulation without the fence completing",
                fence,
                _count(rows, "row"),
                _count(pages, "page"),
            )
            self._waiters.grant()
        elif held:
            log.warning(
                "force_release(%r): the rows and pages behind this fence still wait for "
                "other fences; they no longer wait for this one",
                fence,
            )
        elif self._remembers_fault(fence):
            # An operator releasing a dead peer's transfers meets this one:
            # "never given to it" (or "holds no row", when a running row had
            # a use recorded on it too) would read as if its memory were back.
            log.warning(
                "force_release(%r): this fence faulted; the rows and pages behind it are "
                "quarantined for good (its faulted work may still write or read them) "
                "and stay so%s",
                fence,
                ""
                if not uses
                else f"; dropped it from the recorded uses of {_count(uses, 'allocated row')} "
                "(freed later, they do not wait for it)",
            )
        elif uses:
            log.warning(
                "force_release(%r): this fence holds no row and no page of this pool; "
                "dropped it from the recorded uses of %s (freed later, they do not "
                "wait for it)",
                fence,
                _count(uses, "allocated row"),
            )
        else:
            # Say so plainly: the operator may have passed the wrong object.
            log.warning(
                "force_release(%r): this fence holds no row and no page of this pool "
                "(never given to it, already completed and reclaimed, or released "
                "before); nothing changed",
                fence,
            )
        return rows, pages

    # ------------------------------------------------------------ fences pending

    def _on_pending(self, fence: Fence) -> None:
        # Called by either ledger in the loop's thread when a fence starts
        # holding rows or pages: bind or move to the running loop as any
        # call does, arm the overdue check, and have the wake-ups
        # (asyncpool.wakeups) tell the loop when the fence completes.
        loop = self._loop
        running = _peek_running_loop()
        if running is not loop:
            if running is None:
                if loop is None or loop.is_closed():
                    # No loop (yet): watch it once a waiter binds one.
                    self._unwatched.append(fence)
                    return
                # Set-up code between runs of the pool's (open) loop.
            elif loop is None:
                # Bound by bind() outside any loop: attach this one (its
                # debug flag decides the fast paths).
                self._rebind_loop(running)
            elif loop.is_closed() or not (loop.is_running() or self._waiters.count):
                # The pool's loop is gone, or stopped with nobody waiting on
                # it (asyncio.run twice; a warm-up loop left open): move here.
                self._rebind_loop(running)
        overdue = self._overdue
        if overdue is not None and overdue.timer is None:
            self._arm_overdue(overdue.timeout)
        self._wakeups.watch(fence)

    def _arm_overdue(self, delay: float) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed() and not self._closed:
            assert self._overdue is not None
            # Weakly, as the fence wake-ups (wakeups._Wake): a pool nothing else holds
            # is collected, not kept until a long fence_timeout passes.
            self._overdue.timer = loop.call_later(delay, _check_overdue_of, weakref.ref(self), loop)

    def _check_overdue(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        # Loop thread, while fences are pending: log newly overdue fences
        # once, then look again when the next pending one becomes overdue.
        # ``loop``: the loop the check was armed on; one the pool has left
        # (bind() to another thread's loop) does nothing, as a stale wake-up.
        if loop is not None and loop is not self._loop:
            return
        overdue = self._overdue
        assert overdue is not None
        overdue.timer = None
        due = overdue.check()
        if due is not None:
            # After a check that logged, pause: fences turning overdue one
            # after another (a burst of transfers freed behind a dead peer)
            # are then logged by one check, not a few lines each.
            self._arm_overdue(max(due + 0.001, _RECHECK_AFTER_LOGGING_S if overdue.logged else 0.0))

    def _on_fault(self, fence: Fence, error: BaseException) -> None:
        # A ledger quarantined rows or pages (loop thread, maybe inside the
        # grant loop): a waiter that can no longer ever fit would block its
        # queue forever, so fail those waiters on the next loop iteration.
        loop = self._loop
        if self._waiters.count and loop is not None and not self._drop_dead_waiters():
            loop.call_soon(self._shed_unfittable)

    def _remembers_fault(self, fence: Fence) -> bool:
        """True if the row ledger or any page ledger saw ``fence`` fault
        (``force_release``'s lines: its memory stays quarantined)."""
        if self._ledger.remembers_fault(fence):
            return True
        return any(ps.ledger.remembers_fault(fence) for ps in self._page_sets)

    def _on_group_fault(self, index: int, fence: Fence, error: BaseException) -> None:
        # KV group `index`'s ledger quarantined pages behind a faulted fence.
        # If that counted the fence there (its fence_errors moved) and another
        # group counted it before, it is a repeat for page_fence_errors.
        sets = self._page_sets
        counted = sets[index].ledger.fence_errors
        if counted != self._group_faults_seen[index]:
            self._group_faults_seen[index] = counted
            if any(
                other.ledger.remembers_fault(fence) for i, other in enumerate(sets) if i != index
            ):
                self._page_fault_repeats += 1
        self._on_fault(fence, error)

    def _shed_unfittable(self) -> None:
        self._waiters.shed(self._unfittable_need)

    def _unfittable_need(self, need: Need) -> CapacityError | None:
        """The error for a need that can never be met any more, else None."""
        if need.__class__ is int:
            n: int = need
            if n > self._capacity - self._ledger.quarantined:
                return self._unfittable(n)
            return None
        if self._ledger.quarantined >= self._capacity:
            return self._unfittable(1)
        k = need[1]  # type: ignore[index]
        if isinstance(k, tuple):  # KV groups: one count per group
            assert self._groups is not None
            for name, pages, count in zip(self._groups, self._page_sets, k, strict=True):
                cap, q = pages.capacity, pages.ledger.quarantined
                if count > cap - q:
                    return CapacityError(
                        f"cannot admit a request for {_count(count, 'page')} of KV group "
                        f"{name!r}: only {cap - q} of {cap} can ever be free again "
                        f"({_count(q, 'page')} quarantined behind faulted fences, for the "
                        "pool's life: a new pool is the way back)"
                    )
            return None
        one = self._pages
        assert one is not None
        cap, q = one.capacity, one.ledger.quarantined
        if k > cap - q:
            return CapacityError(
                f"cannot admit a request for {_count(k, 'page')}: only {cap - q} of {cap} "
                f"can ever be free again ({_count(q, 'page')} quarantined behind faulted "
                "fences, for the pool's life: a new pool is the way back)"
            )
        return None

    def _unfittable(self, n: int) -> CapacityError:
        q = self._ledger.quarantined
        return CapacityError(
            f"cannot allocate {_count(n, 'row')}: only {self._capacity - q} of "
            f"{self._capacity} can ever be free again ({_count(q, 'row')} quarantined "
            "behind faulted fences, for the pool's life: a new pool is the way back)"
        )
