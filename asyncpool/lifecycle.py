"""Closing, draining and releasing the memory of an ``AsyncReqToTokenPool``.

The pool's lifecycle half (a mixin with no state of its own): ``drain``
(wait, with a timeout, for every pending fence of both ledgers, in either
reclaim mode), ``close`` (fail the waiters, stop the fence watcher without
waiting for any fence), ``release_memory``/``resume_memory`` (the
``kv_cache`` memory-saver region) and ``hold_grants`` (the scheduler's own
hold on the grant loop, :class:`GrantHold`). Each gates the grant loop; the
loop stays gated while any of them does. It knows nothing of how rows or
pages are granted.

Thread rules: the pool's (:mod:`asyncpool.pool`); every call here is checked.
A named pool's lines here start with its name, as all its lines do
(:mod:`asyncpool.naming`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import weakref
from typing import TYPE_CHECKING, Any

from .base import check_timeout as _check_timeout
from .deferral import Deferrals, held_words
from .errors import PoolBusyError, PoolClosedError
from .fences import Fence, HostFence, is_done
from .ledger import SlotLedger
from .naming import pool_log
from .overdue import OverdueFences, check_fence_timeout
from .row_pages import RowPages
from .tables import TokenTables
from .waiters import WaiterQueues
from .wakeups import FenceWakeups
from .watcher import FenceWatcher

__all__ = ["GrantHold", "Lifecycle"]

logger: logging.Logger = logging.getLogger(__name__)

_peek_running_loop = asyncio._get_running_loop  # None outside a loop; never raises

# drain() polls fences without a done callback with this backoff (seconds).
_DRAIN_POLL_MIN_S = 50e-6
_DRAIN_POLL_MAX_S = 1e-3
# close() waits (awaiting, never blocking the loop) for the watcher's idle
# threads for at most this long in all: they exit within microseconds of
# stop(); the bound only guards against a fence whose query() blocks,
# against the protocol.
_CLOSE_JOIN_S = 0.05


async def _fence_or_timer(loop: asyncio.AbstractEventLoop, fence: HostFence, delay: float) -> None:
    """Wait until ``fence`` completes or ``delay`` seconds pass, whichever is
    first, and leave nothing behind on the fence (its callback is removed,
    however the wait ends). The timer lets a drain notice what no fence
    callback reports: ``force_release``, ``retire``, ``agree``."""
    fut: asyncio.Future[None] = loop.create_future()
    callback = functools.partial(_settle_from_thread, loop, fut)
    fence.add_done_callback(callback)
    timer = loop.call_later(delay, _settle, fut)
    try:
        await fut
    finally:
        timer.cancel()
        fence.remove_done_callback(callback)


def _settled_host_fence(fence: HostFence) -> bool:
    """True once ``fence`` has completed or faulted. A drain looks for the
    next head only then (or after progress): the wake of its timer alone
    keeps the head and the backoff, so a stuck host fence is asked every
    1 ms at most, at O(1) a wake, not every 50 µs at O(pending)."""
    try:
        return fence.query()
    except Exception:  # faulted: settled too
        return True


def _settle(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _settle_from_thread(loop: asyncio.AbstractEventLoop, fut: asyncio.Future[None]) -> None:
    """Resolve ``fut`` from any thread; a closed loop means nobody waits."""
    try:
        loop.call_soon_threadsafe(_settle, fut)
    except RuntimeError:  # the loop is closed
        pass


class Lifecycle:
    """Close, drain, release and resume, mixed into ``AsyncReqToTokenPool``.

    The attributes and methods below are the pool's; see
    :class:`~asyncpool.AsyncReqToTokenPool` for the contract of each call.
    """

    _name: str | None
    _ledger: SlotLedger
    _pages: RowPages | None
    _groups: dict[str, RowPages] | None
    _page_sets: tuple[RowPages, ...]
    _waiters: WaiterQueues
    _tables: TokenTables
    _overdue: OverdueFences | None
    _wakeups: FenceWakeups
    _fast: bool
    _closed: bool
    _released: bool
    _releasing: asyncio.Future[None] | None
    _holds: int
    _live_holds: weakref.WeakSet[GrantHold]
    _stopping: tuple[FenceWatcher, float] | None

    if TYPE_CHECKING:

        def _check_thread(self) -> None: ...

        def _prepare_wait(self, loop: asyncio.AbstractEventLoop) -> asyncio.AbstractEventLoop: ...

        def reclaim(self) -> int: ...

    # ------------------------------------------------------------ lifecycle

    async def drain(self, timeout: float | None = None) -> None:
        """Wait until no row (and no page, with ``kv``) is pending behind a fence.

        Works before and after :meth:`close`. Memory of faulted fences is
        quarantined, not waited for. Host fences wake it through their done
        callbacks; other fences (CUDA events, fences of unknown origin) are
        polled with ``query()`` on the loop, backing off from 50 µs to 1 ms,
        never by blocking a thread in their ``synchronize()``, so a fence
        that never completes leaves no thread behind.

        Raises ``TimeoutError`` after ``timeout`` seconds (``None``: no
        limit) with rows still pending; the pool is then as it was, apart
        from fences that completed meanwhile, which are reclaimed as any call
        would. Cancelling ``drain`` changes nothing either. Raises
        ``ValueError`` for a ``timeout`` that is not None or a number >= 0.

        With ``reclaim="explicit"`` it waits the same way for each pending
        fence in turn and settles what is behind it (rows and pages) as
        :meth:`retire` would (faulted: quarantined). The outcome, nothing
        pending, does not depend on timing, so ranks that drain at the same
        point stay alike, unless a fence faulted on some ranks only: each
        rank settles by what it sees (quarantined there, released
        elsewhere), and every later ``agree()`` raises ``AgreementError``
        (quarantine is for life: rebuild the pools). Where that can happen,
        settle with ``agree()`` until nothing is pending first (docs/tp.md,
        *Tensor-parallel engines*).
        """
        self._check_thread()
        if timeout is not None:
            timeout = _check_timeout(timeout)
        # The running loop, rebinding to it: the pool may still name a loop
        # that has since stopped (asyncio.run twice in one thread).
        loop = self._prepare_wait(asyncio.get_running_loop())
        if self._ledger.explicit:
            await self._drain_explicit(loop, timeout)
            return
        pending = self._pending_any
        if pending():
            self.reclaim()
        if not pending():
            return
        try:
            async with asyncio.timeout(timeout):
                delay = _DRAIN_POLL_MIN_S
                head: Fence | None = None
                seen = -1
                while True:
                    if pending() != seen:  # O(pending) only after progress
                        seen = pending()
                        head = self._pending_fences()[0]
                        delay = _DRAIN_POLL_MIN_S
                    if head.__class__ is HostFence:
                        assert isinstance(head, HostFence)
                        await _fence_or_timer(loop, head, delay)
                        if _settled_host_fence(head):
                            seen = -1  # its rows may wait on another fence now
                    else:
                        await asyncio.sleep(delay)
                    delay = min(delay * 2, _DRAIN_POLL_MAX_S)
                    if pending():
                        self.reclaim()
                    if not pending():
                        return
        except TimeoutError:
            raise self._drain_timed_out(timeout) from None

    async def _drain_explicit(self, loop: asyncio.AbstractEventLoop, timeout: float | None) -> None:
        # Explicit pools ask no fence on their own: wait for each pending
        # fence in turn and settle what is behind it (rows and pages) as
        # retire() would. The outcome (nothing pending) is the same on every
        # rank whatever the timing, so replicas that drain at the same point
        # stay in step, but a fault is this rank's own verdict (drain has no
        # group to agree it with; see the docstring).
        ledgers: list[Deferrals[Any]] = [self._ledger, *(ps.ledger for ps in self._page_sets)]
        try:
            async with asyncio.timeout(timeout):
                delay = _DRAIN_POLL_MIN_S
                while self._pending_any():
                    head = self._pending_fences()[0]
                    # A fault an agreement saw and did not act on (it was
                    # interrupted) stays a fault, whatever the fence says now.
                    error: BaseException | None = next(
                        (e for led in ledgers if (e := led.unagreed_fault(head)) is not None),
                        None,
                    )
                    if error is not None:
                        done = True
                    else:
                        try:
                            done = is_done(head.query())
                        except Exception as exc:  # a faulted fence: quarantine what it holds
                            done, error = True, exc
                    if done:
                        made = sum(led.conclude(head, error) for led in ledgers)
                        if made and self._waiters.count:
                            self._waiters.grant()
                        delay = _DRAIN_POLL_MIN_S
                    elif head.__class__ is HostFence:
                        # The timer: retire(), agree() and force_release()
                        # settle fences no callback reports.
                        assert isinstance(head, HostFence)
                        await _fence_or_timer(loop, head, delay)
                        delay = min(delay * 2, _DRAIN_POLL_MAX_S)
                    else:
                        await asyncio.sleep(delay)
                        delay = min(delay * 2, _DRAIN_POLL_MAX_S)
        except TimeoutError:
            raise self._drain_timed_out(timeout) from None

    def _drain_timed_out(self, timeout: float | None) -> TimeoutError:
        """``drain(timeout=)``'s error: what is still pending, in words."""
        held = {"rows": self._ledger.pending}
        pages = sum(ps.ledger.pending for ps in self._page_sets)
        if pages:
            held["pages"] = pages
        return TimeoutError(
            f"drain timed out after {timeout} s with {held_words(held)} still pending behind fences"
        )

    def _pending_any(self) -> int:
        """Rows plus pages (of every group) pending behind fences."""
        pending = self._ledger.pending
        for pages in self._page_sets:
            pending += pages.ledger.pending
        return pending

    def _pending_fences(self) -> list[Fence]:
        """The fences holding rows, then those holding pages (group by group)."""
        fences = self._ledger.pending_fences()
        for pages in self._page_sets:
            fences.extend(pages.ledger.pending_fences())
        return fences

    async def close(self) -> None:
        """Close the pool: new allocations and current waiters fail.

        Every queued ``alloc``/``admit`` raises :class:`PoolClosedError`;
        later ``alloc``/``try_alloc``/``admit``/``try_admit``/``extend``/
        ``extend_rows``/``extend_fitting``/``release_memory`` calls too.
        ``free`` still works, and rows pending behind fences stay pending
        (``drain()`` waits for them).
        Never waits for a fence: the fence watcher is told to stop, and only
        its threads that are not inside a fence's ``synchronize()`` are
        waited for (they exit within microseconds, or once a ``query()``
        under way returns; 50 ms at most in all), by awaiting, so the loop
        serves other pools and tasks meanwhile: the pool is closed before
        the first await, and a cancelled ``close()`` stops only that wait.
        A watcher thread stuck in a CUDA event that never completes is a
        daemon and keeps nothing alive. Idempotent: a call made while
        another waits for the threads (or after one was cancelled in that
        wait) waits for them too, within the same 50 ms.
        """
        self._check_thread()
        if not self._closed:
            self._closed = True
            self._fast = False
            self._waiters.fail_all(PoolClosedError("the pool was closed while this request waited"))
            if self._overdue is not None and self._overdue.timer is not None:
                self._overdue.timer.cancel()
                self._overdue.timer = None
            watcher = self._wakeups.close()
            pool_log(logger, self._name).debug("closed %r", self)
            if watcher is not None:
                # Kept until its threads are seen gone (or the bound passed):
                # a second close(), concurrent or after this one was
                # cancelled, must not return with them still running.
                self._stopping = (watcher, time.perf_counter() + _CLOSE_JOIN_S)
        stopping = self._stopping
        if stopping is None:
            return
        # Its threads exit at their next look; a poller inside a slow
        # query() only once that returns. A join here would stall the
        # loop, and every other pool on it, for as long (up to 50 ms).
        # Looked at with drain()'s backoff: 50 µs, doubling to 1 ms.
        watcher, deadline = stopping
        delay = _DRAIN_POLL_MIN_S
        while not watcher.settled and time.perf_counter() < deadline:
            await asyncio.sleep(delay)
            delay = min(delay * 2, _DRAIN_POLL_MAX_S)
        if self._stopping is stopping:
            self._stopping = None  # settled, or out of time: later calls return at once

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._closed

    async def release_memory(self, timeout: float | None = None) -> None:
        """Drain fences and release the ``kv_cache`` memory region.

        While released, ``alloc``/``admit`` wait and ``try_alloc``,
        ``try_admit``, ``extend`` and ``extend_rows`` return None and
        ``extend_fitting`` grows no row (0 and an empty tensor); so they do
        during the drain. Raises :class:`PoolClosedError` on a closed pool,
        and :class:`PoolBusyError` (and stays serving) if rows, or pages of
        the ``kv`` pool (detached ones included), are allocated: at once,
        before any drain, and again once fences are drained. Without the
        memory saver the
        memory step is a no-op and the state machine is the same. A call
        made while another is draining waits for it and shares its outcome
        (it raises :class:`PoolBusyError` if that one did not release).

        ``timeout`` bounds the drain as :meth:`drain`'s does: ``TimeoutError``
        after ``timeout`` seconds with memory still behind a fence (a stuck
        transfer, a hung step), and the pool serving again, as after a
        cancel; ``ValueError``, changing nothing, for a ``timeout`` that is
        not None or a number >= 0. A call that waits for another's drain
        waits for that one's own limit, not this ``timeout``.

        With requests queued (a model unloaded while its clients wait), a
        ``free`` of the running requests' rows hands them to the queued
        waiters at once (grant at hand-over), and the release then refuses
        them as allocated. Take :meth:`hold_grants` *before* those frees
        (and before queueing the next batch: rows still free would serve it
        at once), release, then release the hold: the waiters keep their places
        (``alloc``/``admit`` wait while released) until
        :meth:`resume_memory` serves them; or :meth:`close` fails them. A
        waiter granted before the hold whose task has not run yet holds its
        grant (the hold does not take it back) and the engine does not know
        its row yet: after taking the hold, free every row held and yield
        (``await asyncio.sleep(0)``) until ``allocated_size()`` reads 0 (one
        pass when the task awaits ``admit`` itself, more when ``admit`` runs
        in a task of its own, as under Python 3.11's ``asyncio.wait_for``;
        docs/api.md, *memory saver*, has the loop).
        """
        self._check_thread()
        if timeout is not None:
            timeout = _check_timeout(timeout)
        if self._closed:
            raise PoolClosedError("the pool is closed")
        releasing = self._releasing
        if releasing is not None:
            await asyncio.shield(releasing)
            if not self._released:
                raise PoolBusyError(
                    "the release_memory() in progress that this call waited for did not "
                    "release the memory (rows or pages were still allocated, or it was "
                    "cancelled)"
                )
            return
        if self._released:
            return
        # Refused at once when memory is allocated (draining would not free
        # it), without gating anyone for a drain that cannot succeed; and
        # once more after the drain.
        self._refuse_release_if_allocated()
        self._released = self._waiters.gated = True
        self._fast = False
        self._releasing = done = asyncio.get_running_loop().create_future()
        try:
            await self.drain(timeout)
            self._refuse_release_if_allocated()
            self._tables.pause()
        except BaseException as exc:
            self._released = False
            self._waiters.gated = self._gate_wanted()
            self._waiters.grant()
            if isinstance(exc, TimeoutError):
                raise TimeoutError(
                    f"release_memory did not release the memory (the pool serves again): {exc}"
                ) from None
            raise
        finally:
            self._releasing = None
            done.set_result(None)
        pool_log(logger, self._name).info("released the kv_cache region of %r", self)

    def _refuse_release_if_allocated(self) -> None:
        allocated = self._ledger.allocated
        if allocated:
            rows = "1 row is" if allocated == 1 else f"{allocated} rows are"
            raise PoolBusyError(
                f"cannot release memory while {rows} still allocated; free them first"
            )
        groups = list(self._groups) if self._groups is not None else [None] * len(self._page_sets)
        for name, one in zip(groups, self._page_sets, strict=True):
            pages = one.ledger.allocated
            if pages:
                where = "the kv pool" if name is None else f"KV group {name!r}"
                what = (
                    f"1 KV page of {where} is"
                    if pages == 1
                    else (f"{pages} KV pages of {where} are")
                )
                # No row is allocated (checked above), so no row owns these
                # pages: the caller holds them (detach_pages, a prefix cache;
                # or a direct kv.alloc). Say so: "free them" would send an
                # engine to pool.free, which has no row to free.
                it = "it" if pages == 1 else "them"
                free = "kv.free" if name is None else f"pool.kv_groups[{name!r}].free"
                raise PoolBusyError(
                    f"cannot release memory while {what} still allocated, held by no "
                    f"row: the caller's (detach_pages, a prefix cache, or a direct "
                    f"kv.alloc); evict {it} with {free} first"
                )

    async def resume_memory(self) -> None:
        """Restore the memory region, zero the tables, and wake waiters.

        On a pool whose memory is not released, a no-op (the tables keep
        what was written to them).

        Raises :class:`PoolBusyError`, changing nothing, while a
        :meth:`release_memory` is still draining: the rows it waits for may
        belong to running requests, whose tables a resume would zero. Await
        (or cancel) the release first.
        """
        self._check_thread()
        if self._releasing is not None:
            raise PoolBusyError(
                "release_memory() is still draining fences; await it (or cancel it) "
                "before resume_memory()"
            )
        if not self._released:
            return
        self._tables.resume()
        self._ledger.reset_all()
        self._released = False
        self._waiters.gated = self._gate_wanted()
        self._waiters.grant()
        pool_log(logger, self._name).info("resumed the kv_cache region of %r", self)

    def hold_grants(self, *, warn_after: float | None = 10.0) -> GrantHold:
        """Hold the grant loop: queued ``alloc``/``admit`` waiters get nothing
        until the hold is released; return the hold.

        For growth first: the memory that frees and completed fences return
        while any hold is held stays free for the scheduler's own calls that
        never wait (``extend``, ``extend_rows``, ``extend_fitting``), instead of going to the
        queued admissions at hand-over. A scheduler whose decode growth comes
        up short holds (before it retracts: a free with nothing to wait for
        grants at once), retracts, and releases at the first scheduling pass
        that finds nobody stalled, a step planned or not (the victims' pages
        come back when the step in flight completes: keep the hold across
        the steps until then; but a loop that idles with the hold held, its
        stalled requests finished or aborted, waits for ever). Meanwhile
        ``try_alloc`` and ``try_admit`` answer None, and ``alloc`` and
        ``admit`` queue (FIFO within priority, as ever; timeouts and
        cancellation as ever). When
        the last hold is released the grant loop runs at once, unless the
        memory is released or the pool closed (those gate it too). While
        held, ``alloc``/``admit`` queue even when memory is free, so they
        count toward ``max_waiters`` (:class:`~asyncpool.PoolBusyError` past
        it) and the time held shows in the wait figures of ``stats()``. On
        tensor-parallel replicas (``reclaim="explicit"``) the release grants:
        hold and release at the same point of the step on every rank, as
        with ``agree()``.

        Holds nest (each must be released once); ``release()`` is
        idempotent and the hold is a context manager (``with
        pool.hold_grants():``). Allowed after :meth:`close` (it holds
        nothing there). The event loop's thread only: from another thread,
        :class:`~asyncpool.WrongThreadError`, changing nothing. A hold never
        released starves every waiter: nothing releases it for you (a hold
        collected while held logs an error and stays held until
        :meth:`release_grant_holds`; ``stats().grants_held`` shows it). So a hold still held
        ``warn_after`` seconds after it was taken logs a WARNING once (how
        long, how many waiters queue), from the event loop it was taken in;
        a stall rarely lasts more than a few steps. ``None``: no warning;
        none either for a hold taken with no running loop, and none once
        the pool is closed. A hold released from another thread (carried
        over by :meth:`bind`) leaves its timer to its loop, where it finds
        the hold released. Raises
        ``ValueError``, changing nothing, for a ``warn_after`` that is not
        None or a finite number > 0.
        """
        self._check_thread()  # closes the unchecked fast paths: gated, none reopens
        warn = check_fence_timeout(warn_after, "warn_after")
        hold = GrantHold(self, None if self._closed else warn)  # armed before it counts
        self._holds += 1
        self._live_holds.add(hold)
        self._waiters.gated = True
        return hold

    def release_grant_holds(self) -> int:
        """End every :meth:`hold_grants` hold still held, lost ones included;
        return how many were held (0: none, nothing done, nothing logged).

        Recovery, not the scheduler's step: a scheduler task that died (an
        exception, a cancellation) while it held the grant loop took the only
        handle to its hold with it, and a hold collected while held stays
        held, so every queued ``alloc``/``admit`` would starve for good. The
        scheduler that takes over calls this once before it serves: each
        live :class:`GrantHold` then reads ``held`` False (its ``release()``
        does nothing), ``grant_holds`` reads 0, and the grant loop runs at
        once unless the memory is released or the pool closed (on
        tensor-parallel replicas, ``reclaim="explicit"``, it grants as a
        hold's release does: call it at the same point on every rank).
        Logged at WARNING (how many, how many of them were lost). The event
        loop's thread only (:class:`~asyncpool.WrongThreadError`, changing
        nothing). docs/api.md, *Recovering from a scheduler crash*, has the
        rest of a restart.
        """
        self._check_thread()
        held = self._holds
        if not held:
            return 0
        live = list(self._live_holds)
        self._live_holds.clear()
        for hold in live:
            hold._end_silently()
        self._holds = 0
        pool_log(logger, self._name).warning(
            "release_grant_holds() ended %d hold_grants() holds of %r (%d lost: collected "
            "while held); %d waiters queued",
            held,
            self,
            held - len(live),
            self._waiters.count,
        )
        if not self._gate_wanted():
            self._waiters.gated = False
            self._waiters.grant()
        return held

    @property
    def grants_held(self) -> bool:
        """True while any :meth:`hold_grants` hold is held."""
        return self._holds > 0

    @property
    def grant_holds(self) -> int:
        """How many :meth:`hold_grants` holds are held now (they nest: the
        grant loop reopens when the last is released). 0 when none."""
        return self._holds

    def _end_hold(self) -> None:
        self._holds -= 1
        if not self._gate_wanted():
            self._waiters.gated = False
            self._waiters.grant()

    def _gate_wanted(self) -> bool:
        """Whether the grant loop must stay gated: closed, released (or
        releasing) or held. The one rule every gate change and
        ``check_invariants`` follow."""
        return self._closed or self._released or self._holds > 0

    @property
    def released(self) -> bool:
        """True once :meth:`release_memory` has released the memory region,
        until :meth:`resume_memory`; False while a release still drains its
        fences (allocation is already held then, and the region still holds
        memory), and False again if that release fails."""
        return self._released and self._releasing is None


class GrantHold:
    """A hold on a pool's grant loop, from ``AsyncReqToTokenPool.hold_grants()``.

    :meth:`release` (or leaving a ``with`` block) ends it; once every hold of
    the pool has ended, the queued waiters are granted at once. Idempotent.
    Held from ``hold_grants()`` on; a ``with`` block on a released hold
    raises ``RuntimeError`` (it would hold nothing).
    The pool's event-loop thread only: from another thread,
    :class:`~asyncpool.WrongThreadError`, and the hold stays held.
    """

    __slots__ = ("__weakref__", "_loop", "_pool", "_timer")

    def __init__(self, pool: Lifecycle, warn_after: float | None = None) -> None:
        self._pool: Lifecycle | None = None  # held once the timer is armed
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        if warn_after is not None:
            loop = _peek_running_loop()
            if loop is not None:  # no running loop: no warning
                # A weak reference: the timer must not keep a dropped hold
                # alive (its collection is how a lost hold is reported).
                self._timer = loop.call_later(
                    warn_after, _warn_if_held, weakref.ref(self), warn_after
                )
                self._loop = loop
        self._pool = pool

    def __repr__(self) -> str:
        return f"<GrantHold {'held' if self._pool is not None else 'released'}>"

    @property
    def held(self) -> bool:
        """True until :meth:`release`."""
        return self._pool is not None

    def release(self) -> None:
        """End this hold; the grant loop runs if it was the pool's last."""
        pool = self._pool
        if pool is None:
            return
        pool._check_thread()
        self._pool = None
        timer, self._timer = self._timer, None
        # A timer handle is its loop's, not thread-safe: cancel it only from
        # that loop (a hold carried over by bind() is released elsewhere;
        # there the timer fires later and finds the hold released).
        if timer is not None and _peek_running_loop() is self._loop:
            timer.cancel()
        pool._live_holds.discard(self)
        pool._end_hold()

    def _end_silently(self) -> None:
        """Mark this hold released without touching the pool's count (for
        ``release_grant_holds``, which ends every hold at once)."""
        self._pool = None
        timer, self._timer = self._timer, None
        if timer is not None and _peek_running_loop() is self._loop:
            timer.cancel()

    def __enter__(self) -> GrantHold:
        if self._pool is None:
            # Entering it again would read as a hold and hold nothing: the
            # grants the block means to keep back would go out.
            raise RuntimeError(
                "this GrantHold was released, so a with block on it would hold "
                "nothing; take a new hold with pool.hold_grants()"
            )
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def __del__(self) -> None:
        # Collected while held: nothing can release it now, and every queued
        # waiter of the pool starves. Say so loudly; do not release here (a
        # collection may run inside one of the pool's own calls, or on
        # another thread).
        if self._pool is not None:
            pool_log(logger, self._pool._name).error(
                "a GrantHold of %r was collected while held: the pool grants its "
                "queued waiters nothing until pool.release_grant_holds(); keep each "
                "hold and release() it",
                self._pool,
            )


def _warn_if_held(ref: weakref.ReferenceType[GrantHold], held_s: float) -> None:
    """The ``warn_after`` timer of a :class:`GrantHold`: warn once if held."""
    hold = ref()
    if hold is None or hold._pool is None or hold._pool._closed:
        return  # collected (reported as such), released, or closed: holds nothing
    pool = hold._pool
    pool_log(logger, pool._name).warning(
        "a hold_grants() hold on %r has been held for %.3g s, %d waiters queued behind "
        "it: release it at the first scheduling pass that finds nobody stalled (a loop "
        "that idles with it held waits for ever)",
        pool,
        held_s,
        pool._waiters.count,
    )
