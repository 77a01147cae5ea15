"""``AsyncReqToTokenPool``: awaitable, fence-safe allocation of request rows.

Allocation waits in bounded, prioritised FIFO queues; frees are deferred
behind fences; completed fences return rows to waiters without anyone
calling the pool. The design follows ``asyncio.Semaphore`` (CPython
``Lib/asyncio/locks.py``) with one change that removes its class of
lost-wake-up and queue-jumping bugs: **grant at hand-over**. Whoever makes
rows free (``free``, a completed fence, a cancelled or timed-out head,
``resume_memory``) runs the grant loop, which takes the rows for the waiters
at the head of the queues and resolves their futures *with the rows*. A woken
waiter never re-checks and competes; ``try_alloc`` answers ``None`` while
anyone waits.

Cancellation contract: if ``alloc`` raises (``CancelledError``,
``TimeoutError``, ``PoolClosedError``), nothing was allocated to the caller.
A waiter cancelled after its grant gives the rows back (to the head of the
free queue, clean) and re-runs the grant loop; a cancelled head that was not
granted re-runs it too, since smaller waiters behind it may now fit.

Thread rules: the pool is loop-affine like every asyncio object. It binds to
the thread of the first call made *inside a running event loop* (and to that
loop); calls from another thread then raise :class:`WrongThreadError`.
Synchronous calls made while no loop runs (building and warming a pool in a
set-up thread) do not bind, so an engine may build the pool in one thread
and run its scheduler in another. :meth:`AsyncReqToTokenPool.bind` hands a
bound pool over explicitly. Fence completions on other threads reach the
loop only through ``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import functools
import logging
import threading
import time
from types import TracebackType
from typing import Any

import torch

from .agreement import agree, check_explicit, check_reclaim_mode
from .base import PoolCore
from .deferral import check_ordered
from .errors import (
    CapacityError,
    DoubleFreeError,
    PoolBusyError,
    PoolClosedError,
    WrongThreadError,
)
from .fences import Fence, HostFence, HostStream
from .ledger import ALLOCATED, FREE, Rows
from .stats import Histogram, LatencySummary, PoolStats
from .watcher import FenceWatcher

__all__ = ["AsyncReqToTokenPool", "Lease"]

logger = logging.getLogger(__name__)

_get_ident = threading.get_ident
_perf_counter = time.perf_counter
_get_running_loop = asyncio.get_running_loop


# drain() polls fences without a done callback with this backoff (seconds).
_DRAIN_POLL_MIN_S = 50e-6
_DRAIN_POLL_MAX_S = 1e-3
# close() joins the watcher's idle threads for at most this long in all: they
# exit within microseconds of stop(); the bound only guards against a fence
# whose query() blocks, against the protocol.
_CLOSE_JOIN_S = 0.05

# A queued alloc() is the tuple (n, future, enqueue time): cheaper to build
# than an object, and the future says whether it is still wanted.
_Waiter = tuple[int, "asyncio.Future[list[int]]", float]


def _settle_from_thread(loop: asyncio.AbstractEventLoop, fut: asyncio.Future[None]) -> None:
    """Resolve ``fut`` from any thread; a closed loop means nobody waits."""

    def settle() -> None:
        if not fut.done():
            fut.set_result(None)

    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the loop is closed
        pass


def _count(n: int, noun: str) -> str:
    """``"1 row"``, ``"2 rows"``: messages read as sentences."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _check_wait_args(priority: object, timeout: object) -> None:
    if priority.__class__ is not int:
        raise TypeError(f"priority must be an int, got {priority!r}")
    if timeout is not None and (
        not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout >= 0
    ):
        raise ValueError(f"timeout must be None or a number >= 0, got {timeout!r}")


class AsyncReqToTokenPool(PoolCore):
    """A request-row pool whose allocation is awaitable and fence-safe.

    Parameters
    ----------
    size, max_context_len, device, enable_memory_saver
        As the seed's ``ReqToTokenPool``; ``size - 1`` rows can be handed
        out (row 0 is reserved padding). ``enable_memory_saver=True`` needs
        CUDA and raises :class:`MemorySaverError` without it.
    stream
        The pool's stream: on CUDA, row resets are launched on it.
    max_waiters
        At most this many ``alloc`` calls may queue; one more raises
        :class:`PoolBusyError` at once (load shedding). ``None``: unbounded.
    reclaim
        ``"auto"`` (default): rows return as soon as their fences complete
        (fence callbacks, a watcher thread, reclaim inside ``alloc``).
        ``"explicit"``, for engines that run one scheduler replica per
        tensor-parallel rank: the pool never asks a fence whether it has
        completed; rows return through :meth:`retire` (the scheduler has
        processed that step) and :meth:`agree` (a collective over the ranks
        for fences the scheduler does not observe), so ranks that make the
        same calls make the same grants. See the README's TP section.
    """

    def __init__(
        self,
        size: int,
        max_context_len: int,
        device: str | torch.device = "cpu",
        enable_memory_saver: bool = False,
        stream: Any | None = None,
        max_waiters: int | None = None,
        *,
        reclaim: str = "auto",
    ) -> None:
        if max_waiters is not None and (max_waiters.__class__ is not int or max_waiters < 0):
            raise ValueError(f"max_waiters must be None or an int >= 0, got {max_waiters!r}")
        explicit = check_reclaim_mode(reclaim)
        super().__init__(size, max_context_len, device, enable_memory_saver, stream)
        led = self._ledger
        if explicit:
            led.make_explicit()
        self._capacity = led.capacity
        self._take = led.take
        # The single-row fast paths of alloc() and free() below work on the
        # ledger's containers directly (a method call costs as much as the
        # whole operation); they keep the ledger's invariants exactly as
        # SlotLedger.take and SlotLedger.free do.
        self._free_q = led._free
        self._state = led._state
        self._gen = led._gen
        self._uses = led._uses
        self._size = led.size
        assert ALLOCATED == 1 and FREE == 0  # the literals in the fast paths
        self._owner: int | None = None
        self._owner_name = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queues: dict[int, collections.deque[_Waiter]] = {}
        self._prios: list[int] = []
        self._nwaiters = 0
        self._max_waiters = max_waiters
        self._closed = False
        self._released = False
        self._gated = False  # closed or released: no fast path, no grants
        # The owner's ident while alloc's fast path is open (bound, nobody
        # queued, not gated), else None: one compare checks all three. Set
        # to None wherever one of them stops holding; re-derived by the next
        # alloc that takes the general path (stale None is only slower).
        self._fast: int | None = None
        self._wake_scheduled = False
        self._watcher: FenceWatcher | None = None
        self._wait_times: collections.deque[float] = collections.deque(maxlen=4096)
        self._wait_histogram = Histogram()  # queued allocs' waits, at grant
        self._fast_allocs = 0  # allocs granted without queueing (zero waits)
        self._unreset: list[int] = []  # granted rows whose reset is scheduled
        self._unwatched: list[Fence] = []  # deferred before any loop ran
        self._timeouts = 0
        self._cancellations = 0
        self._rejections = 0

    def __repr__(self) -> str:
        led = self._ledger
        state = "closed" if self._closed else ("released" if self._released else "open")
        return (
            f"<AsyncReqToTokenPool {state} size={self.size} free={led.free_count} "
            f"allocated={led.allocated} pending={led.pending} "
            f"quarantined={led.quarantined} waiters={self._nwaiters}>"
        )

    async def __aenter__(self) -> AsyncReqToTokenPool:
        self._check_thread()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # ------------------------------------------------------------ affinity

    def _check_thread(self) -> None:
        if self._owner != _get_ident():
            self._bind_thread()

    def _bind_thread(self) -> None:
        # Off the fast path: the pool is unbound, or called from a thread
        # that does not own it.
        ident = _get_ident()
        owner = self._owner
        if owner is None:
            try:
                loop = _get_running_loop()
            except RuntimeError:
                return  # set-up code outside any loop: do not bind
            self._owner = ident
            self._owner_name = threading.current_thread().name
            if self._loop is None:
                self._loop = loop
            return
        if owner != ident:
            here = threading.current_thread().name
            raise WrongThreadError(
                f"AsyncReqToTokenPool is bound to thread {self._owner_name!r} (ident {owner}) "
                f"and was called from thread {here!r} (ident {ident}); call it from its own "
                "thread (loop.call_soon_threadsafe), or hand it over with pool.bind() "
                "called in the new thread"
            )

    def bind(self) -> None:
        """Bind the pool to the calling thread and its running loop, if any.

        The explicit hand-off: build and warm a pool in one thread, then call
        ``bind()`` in the scheduler's thread (or in its event loop) before
        using it there. Without a running loop only the thread is bound; the
        first ``alloc`` that has to wait binds the loop. From then on, calls
        from any other thread raise :class:`WrongThreadError`.

        The previous thread must have stopped calling the pool. Raises
        :class:`PoolBusyError`, changing nothing, while an ``alloc`` waits or
        a row is pending behind a fence (their wake-ups belong to the old
        loop); free or drain first.
        """
        if self._nwaiters or self._ledger.pending or self._unwatched:
            raise PoolBusyError(
                f"cannot bind the pool to thread {threading.current_thread().name!r} while "
                f"{_count(self._nwaiters, 'waiter')} queue and "
                f"{_count(self._ledger.pending, 'row')} wait behind fences; "
                "let them finish (await pool.drain()) first"
            )
        self._flush_resets()  # a flush queued on the old loop must not be needed
        self._owner = _get_ident()
        self._owner_name = threading.current_thread().name
        self._fast = None
        try:
            self._loop = _get_running_loop()
        except RuntimeError:
            self._loop = None
        self._wake_scheduled = False  # nothing is pending, so nothing to wake

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        return loop

    # ------------------------------------------------------------ allocation

    async def alloc(
        self, n: int, *, priority: int = 0, timeout: float | None = None
    ) -> list[int]:
        """Allocate ``n`` rows, waiting until they can all be granted at once.

        Returns at once, without suspending, when nobody is queued and ``n``
        rows are free. Otherwise waits FIFO within ``priority`` (lower number
        first; the head of the most urgent queue blocks everyone behind it,
        so large requests do not starve). Rows that are only pending behind a
        fence are waited for, not treated as exhaustion.

        Raises :class:`CapacityError` at once for ``n`` that is not an int in
        ``1..capacity``, :class:`PoolBusyError` when ``max_waiters`` already
        queue, :class:`PoolClosedError` when the pool is (or gets) closed,
        ``TimeoutError`` after ``timeout`` seconds. On any exception,
        cancellation included, nothing was allocated.
        """
        ident = _get_ident()
        if self._fast == ident and n == 1 and n.__class__ is int:
            # The owner's thread, nobody queued, not gated: one clean row.
            if timeout is not None or priority.__class__ is not int:
                _check_wait_args(priority, timeout)
            led = self._ledger
            if led._clean:
                # Inlined SlotLedger.take(1) for a clean row.
                led._clean -= 1
                free = self._free_q
                row = free.popleft()
                self._state[row] = 1  # ALLOCATED
                gen = self._gen
                g = gen[row] + 1
                gen[row] = g if g != 256 else led._carry(row)
                if len(free) < led._peak_bound:
                    led._note_peak()
                self._fast_allocs += 1
                return [row]
        if self._owner != ident:
            self._bind_thread()
        if n.__class__ is not int or not 0 < n <= self._capacity:
            n = self._ledger.check_n(n)
        if timeout is not None or priority.__class__ is not int:
            _check_wait_args(priority, timeout)
        if not self._nwaiters and not self._gated:
            if self._owner is not None:
                self._fast = self._owner  # reopen the fast path (see __init__)
            led = self._ledger
            if n == 1 and led._clean:
                # Inlined SlotLedger.take(1) for a clean row.
                led._clean -= 1
                free = self._free_q
                row = free.popleft()
                self._state[row] = 1  # ALLOCATED
                gen = self._gen
                g = gen[row] + 1
                gen[row] = g if g != 256 else led._carry(row)
                if len(free) < led._peak_bound:
                    led._note_peak()
                self._fast_allocs += 1
                return [row]
            rows = self._take(n)
            if rows is not None:
                self._fast_allocs += 1
                return rows
            if led.pending and led.reclaim():
                # Capacity only waiting on a fence is not exhaustion.
                rows = self._take(n)
                if rows is not None:
                    self._fast_allocs += 1
                    return rows
        # Slow path, inline (no nested coroutine per wait): queue and wait
        # for a grant.
        if self._closed:
            raise PoolClosedError("the pool is closed; no rows can be allocated")
        if n > self._capacity - self._ledger.quarantined:
            raise self._unfittable(n)
        if self._max_waiters is not None and self._nwaiters >= self._max_waiters:
            self._rejections += 1
            raise PoolBusyError(
                f"{_count(self._nwaiters, 'waiter')} already queued, the limit set by "
                f"max_waiters={self._max_waiters}; refusing to queue alloc({n})"
            )
        loop = _get_running_loop()
        if loop is not self._loop:
            self._rebind_loop(loop)
        if self._unwatched:
            unwatched, self._unwatched = self._unwatched, []
            for pending_fence in unwatched:
                self._on_pending(pending_fence)
        fut: asyncio.Future[list[int]] = loop.create_future()
        waiter = (n, fut, _perf_counter())
        queue = self._queues.get(priority)
        if queue is None:
            queue = self._queues[priority] = collections.deque()
            bisect.insort(self._prios, priority)
        queue.append(waiter)
        self._nwaiters += 1
        self._fast = None
        handle = None if timeout is None else loop.call_later(
            timeout, self._expire, waiter, priority, timeout
        )
        try:
            return await fut
        except asyncio.CancelledError:
            self._cancellations += 1
            if fut.cancelled():
                self._dequeue(waiter, priority)
            elif fut.exception() is None:
                # Granted, then cancelled before it could resume: give the
                # rows back and let the next waiters have them.
                self._give_back(fut.result())
            self._grant()
            raise
        finally:
            if handle is not None:
                handle.cancel()

    def _rebind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        old = self._loop
        if old is not None and not old.is_closed() and (self._nwaiters or self._ledger.pending):
            raise WrongThreadError(
                "AsyncReqToTokenPool is bound to another event loop that still has "
                "waiters or pending fences; a pool is loop-affine"
            )
        self._loop = loop

    def _dequeue(self, waiter: _Waiter, priority: int) -> None:
        queue = self._queues.get(priority)
        if queue is None:
            return
        try:
            queue.remove(waiter)
        except ValueError:
            return  # already taken off by the grant loop, expiry or close
        self._nwaiters -= 1
        if not queue:
            del self._queues[priority]
            self._prios.remove(priority)

    def _expire(self, waiter: _Waiter, priority: int, timeout: float) -> None:
        n, fut, _ = waiter
        if fut.done():
            return
        self._dequeue(waiter, priority)
        self._timeouts += 1
        fut.set_exception(TimeoutError(
            f"alloc({n}) timed out after {timeout} s: {_count(n, 'row')} could not be "
            "granted in time"
        ))
        self._grant()

    def _give_back(self, rows: list[int]) -> None:
        # Their reset may still be scheduled: do it now, since put_back
        # files them as clean rows at the head of the free queue.
        self._flush_resets()
        self._ledger.put_back(rows)

    def _grant(self) -> None:
        """Hand rows to waiters in order until the head does not fit.

        Runs synchronously; resolves each granted waiter's future with its
        rows, so nobody else can take them in between. Rows that need a
        reset are zeroed by one callback scheduled *before* the first future
        is resolved: callbacks run in order, so every granted task resumes
        after its rows read zero, and a burst of grants costs one tensor op.
        """
        if not self._nwaiters or self._gated:
            return
        led = self._ledger
        free = self._free_q
        queues = self._queues
        prios = self._prios
        now = 0.0
        while self._nwaiters:
            prio = prios[0]
            queue = queues[prio]
            waiter = queue[0]
            n, fut, t0 = waiter
            if fut.done():  # cancelled; its task has not run its handler yet
                queue.popleft()
                self._nwaiters -= 1
                if not queue:
                    del queues[prio]
                    prios.pop(0)
                continue
            if n > len(free):
                if led.pending and led.reclaim():
                    continue
                return
            queue.popleft()
            self._nwaiters -= 1
            if not queue:
                del queues[prio]
                prios.pop(0)
            if n == 1:
                # Inlined SlotLedger.take_unreset(1): under saturation the
                # row was freed a moment ago and is still dirty.
                row = free.popleft()
                self._state[row] = 1  # ALLOCATED
                g = self._gen[row] + 1
                self._gen[row] = g if g != 256 else led._carry(row)
                if len(free) < led._peak_bound:
                    led._note_peak()
                rows = [row]
                clean = led._clean
                if clean:
                    led._clean = clean - 1
                else:
                    if not self._unreset:
                        self._running_loop().call_soon(self._flush_resets)
                    self._unreset.append(row)
            else:
                rows, dirty = led.take_unreset(n)
                if dirty:
                    if not self._unreset:
                        self._running_loop().call_soon(self._flush_resets)
                    self._unreset.extend(dirty)
            fut.set_result(rows)
            if not now:
                now = _perf_counter()
            self._wait_times.append(now - t0)
            self._wait_histogram.observe(now - t0)

    def _flush_resets(self) -> None:
        rows = self._unreset
        if rows:
            self._unreset = []
            self._ledger.resets += 1
            self._tables.reset_rows(rows)

    def try_alloc(self, n: int) -> list[int] | None:
        """Allocate ``n`` rows now, or return None; never waits.

        Returns None while anyone is queued (no queue jumping) or while the
        memory is released; reclaims completed fences before answering None.
        Raises :class:`CapacityError` for bad ``n`` and
        :class:`PoolClosedError` after :meth:`close`.
        """
        if self._owner != _get_ident():
            self._bind_thread()
        led = self._ledger
        if n.__class__ is not int or not 0 < n <= self._capacity:
            n = led.check_n(n)
        if self._closed:
            raise PoolClosedError("the pool is closed; no rows can be allocated")
        if self._nwaiters or self._released:
            return None
        rows = self._take(n)
        if rows is None and led.pending and led.reclaim():
            rows = self._take(n)
        if rows is not None:
            self._fast_allocs += 1
        return rows

    # ------------------------------------------------------------ free

    def record_use(self, rows: Rows, fence: Fence) -> None:
        """Note that ``rows`` are touched by work that completes with ``fence``.

        Call it once per scheduler step, right after launching the step, with
        the one fence recorded after that launch. A later :meth:`free` of a
        row then waits for the newest use recorded for it (per stream).
        Raises, changing nothing, unless every row is allocated.
        """
        if self._owner != _get_ident():
            self._bind_thread()
        self._ledger.record_use(rows, fence)

    def free(
        self,
        rows: Rows,
        fence: Fence | None = None,
        *,
        after: HostStream | Any | None = None,
    ) -> int:
        """Return rows to the pool; never awaits.

        Each row goes back to circulation once its newest recorded use and
        ``fence`` (and a fence recorded now on ``after``, when given) have
        completed; a row with nothing incomplete is free at once and goes to
        the waiters. Returns the number of rows free at once. The signature
        is :meth:`ReqToTokenPool.free`'s: ``free(rows)``, ``free(rows, fence)``
        or ``free(rows, fence=fence)``, and ``after=`` by keyword. ``rows``: an
        int, a list of ints, integer scalars or a 1-D integer tensor or array.
        Raises,
        changing nothing, for row 0, out-of-range or non-int ids, rows not
        allocated (:class:`DoubleFreeError` for one already freed),
        duplicates, and a ``fence`` that is not a fence. Allowed after
        :meth:`close`.
        """
        if self._owner != _get_ident():
            self._bind_thread()
        if fence is None and after is None and rows.__class__ is list and len(rows) == 1:
            # Inlined SlotLedger.free fast path: one row, no fence, no use.
            row = rows[0]
            if (
                row.__class__ is int
                and 0 < row < self._size
                and self._state[row] == 1  # ALLOCATED
                and self._uses[row] is None
            ):
                self._state[row] = 0  # FREE
                self._free_q.append(row)
                if self._nwaiters:
                    self._grant()
                return 1
        led = self._ledger
        if after is not None:
            rows = self._use_until_now(rows, after, fence)
        immediate = led.free(rows, fence)
        if immediate and self._nwaiters:
            self._grant()
        return immediate

    @property
    def reclaim_mode(self) -> str:
        """``"auto"`` or ``"explicit"`` (the constructor's ``reclaim``)."""
        return "explicit" if self._ledger.explicit else "auto"

    def reclaim(self) -> int:
        """Return rows whose fences completed; grant waiters; the rows made free.

        With ``reclaim="explicit"`` it asks no fence and returns 0.
        """
        if self._owner != _get_ident():
            self._bind_thread()
        released = self._ledger.reclaim()
        if released and self._nwaiters:
            self._grant()
        return released

    # ------------------------------------------------------------ explicit reclaim

    def retire(self, fence: Fence) -> int:
        """The scheduler has processed the step ``fence`` ends (``reclaim="explicit"``).

        Returns to circulation exactly the rows behind fences of ``fence``'s
        stream up to it, in record order, then grants waiters (the grant loop
        runs synchronously inside this call). Never calls ``query()``: call
        it once the step's outputs are in (you waited for them anyway), at
        the same point of the loop on every rank. Returns the rows made
        free; 0 when nothing waited on it. Raises ``TypeError`` for a fence
        that is not ordered (a transfer handle: :meth:`agree` settles those)
        and ``RuntimeError`` on an ``"auto"`` pool; either way nothing
        changes. Loop thread only.
        """
        if self._owner != _get_ident():
            self._bind_thread()
        led = self._ledger
        check_explicit(led, "retire")
        check_ordered(fence)
        released = led.retire(fence)
        if released and self._nwaiters:
            self._grant()
        return released

    def agree(self, group: Any = None) -> int:
        """Settle pending fences identically on every tensor-parallel rank.

        A collective over the ``torch.distributed`` process group ``group``
        (None: the default group), for ``reclaim="explicit"`` pools: each
        rank asks its pending fences locally, one small tensor of flags is
        all-reduced with MIN, and every rank releases exactly what all of
        them saw complete, then grants waiters. Every rank must call it at
        the same point of its loop. Blocks the loop for one collective
        (:mod:`asyncpool.agreement`). Returns the rows made free. Raises
        :class:`AgreementError` on every rank, changing nothing, when the
        ranks' pools hold different pending batches (they did not make the
        same calls); ``RuntimeError`` on an ``"auto"`` pool.
        """
        if self._owner != _get_ident():
            self._bind_thread()
        led = self._ledger
        check_explicit(led, "agree")
        released = agree(group, [led]).released[0]
        if released and self._nwaiters:
            self._grant()
        return released

    # ------------------------------------------------------------ fence wake-ups

    def _on_pending(self, fence: Fence) -> None:
        # Called by the ledger in the loop's thread when a fence starts
        # holding rows: arrange to be told when it completes.
        if self._loop is None:
            try:
                self._loop = asyncio.get_running_loop()
            except RuntimeError:
                # No loop yet: watch it once a waiter binds one.
                self._unwatched.append(fence)
                return
        if fence.__class__ is HostFence:
            fence.add_done_callback(self._fence_done_threadsafe)
            return
        watcher = self._watcher
        if watcher is None:
            if self._closed:
                return  # no thread close() would never stop; drain() still reclaims
            watcher = self._watcher = FenceWatcher(self._fence_done_threadsafe)
        try:
            watcher.watch(fence)
        except RuntimeError:
            pass  # closed: drain() and calls into the pool still reclaim

    def _fence_done_threadsafe(self) -> None:
        # Any thread. Coalesce a burst of completions into one loop callback.
        # Benign race: the flag is cleared before reclaim queries the fences,
        # and a fence is marked done before its callbacks run, so a completion
        # that sees the flag still set is seen by that reclaim.
        if self._wake_scheduled:
            return
        self._wake_scheduled = True
        loop = self._loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(self._on_fences_done)
        except RuntimeError:  # the loop is closed: nobody is left to wake
            self._wake_scheduled = False

    def _on_fences_done(self) -> None:
        self._wake_scheduled = False
        self._ledger.reclaim()
        self._grant()

    def _on_fault(self, fence: Fence, error: BaseException) -> None:
        # The ledger quarantined rows (loop thread, maybe inside _grant): a
        # waiter that can no longer ever fit would block its queue forever,
        # so fail those waiters on the next loop iteration.
        if self._nwaiters and self._loop is not None:
            self._loop.call_soon(self._shed_unfittable)

    def _shed_unfittable(self) -> None:
        usable = self._capacity - self._ledger.quarantined
        for prio in list(self._prios):
            for waiter in [w for w in self._queues.get(prio, ()) if w[0] > usable]:
                self._dequeue(waiter, prio)
                if not waiter[1].done():
                    waiter[1].set_exception(self._unfittable(waiter[0]))
        self._grant()

    def _unfittable(self, n: int) -> CapacityError:
        q = self._ledger.quarantined
        return CapacityError(
            f"cannot allocate {_count(n, 'row')}: only {self._capacity - q} of "
            f"{self._capacity} can ever be free again ({_count(q, 'row')} quarantined "
            "behind faulted fences)"
        )

    # ------------------------------------------------------------ leases

    def lease(
        self,
        n: int,
        *,
        priority: int = 0,
        timeout: float | None = None,
        after: HostStream | Any | None = None,
    ) -> Lease:
        """``async with pool.lease(n) as rows:`` allocate, then always free.

        On exit (normal, exception or cancellation) the rows are freed,
        behind a fence recorded on ``after`` at exit when given. If the body
        freed any of the rows itself, whether or not they were handed out
        again since, exit frees the rows the lease still owns and then raises
        :class:`DoubleFreeError` naming the others: it never frees a row
        twice, nor another owner's row. If the body raised, that exception
        is the new error's ``__context__``.
        """
        return Lease(self, n, priority, timeout, after)

    # ------------------------------------------------------------ lifecycle

    async def drain(self, timeout: float | None = None) -> None:
        """Wait until no row is pending behind a fence.

        Works before and after :meth:`close`. Rows of faulted fences are
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
        fence in turn and settles what is behind it as :meth:`retire` would
        (faulted: quarantined). The outcome, nothing pending, does not depend
        on timing, so ranks that drain at the same point stay alike.
        """
        self._check_thread()
        if timeout is not None:
            _check_wait_args(0, timeout)
        loop = self._running_loop()
        led = self._ledger
        if led.explicit:
            await self._drain_explicit(loop, timeout)
            return
        if led.pending:
            self.reclaim()
        if not led.pending:
            return
        try:
            async with asyncio.timeout(timeout):
                delay = _DRAIN_POLL_MIN_S
                head: Fence | None = None
                seen = -1
                while True:
                    if led.pending != seen:  # O(pending) only after progress
                        seen = led.pending
                        head = led.pending_fences()[0]
                    if head.__class__ is HostFence:
                        fut: asyncio.Future[None] = loop.create_future()
                        head.add_done_callback(functools.partial(_settle_from_thread, loop, fut))
                        await fut
                        delay = _DRAIN_POLL_MIN_S
                        seen = -1  # its rows may wait on another fence now
                    else:
                        await asyncio.sleep(delay)
                        delay = min(delay * 2, _DRAIN_POLL_MAX_S)
                    if led.pending:
                        self.reclaim()
                    if not led.pending:
                        return
        except TimeoutError:
            raise TimeoutError(
                f"drain timed out after {timeout} s with {led.pending} rows still pending "
                f"behind fences"
            ) from None

    async def _drain_explicit(
        self, loop: asyncio.AbstractEventLoop, timeout: float | None
    ) -> None:
        # Explicit pools ask no fence on their own: wait for each pending
        # fence in turn (as drain() does) and settle what is behind it as
        # retire() would. The outcome (nothing pending) is the same on every
        # rank whatever the timing, so replicas that drain at the same point
        # stay in step.
        led = self._ledger
        try:
            async with asyncio.timeout(timeout):
                delay = _DRAIN_POLL_MIN_S
                while led.pending:
                    head = led.pending_fences()[0]
                    error: BaseException | None = None
                    try:
                        done = head.query()
                    except Exception as exc:  # a faulted fence: quarantine its rows
                        done, error = True, exc
                    if done:
                        if led.conclude(head, error) and self._nwaiters:
                            self._grant()
                        delay = _DRAIN_POLL_MIN_S
                    elif head.__class__ is HostFence:
                        fut: asyncio.Future[None] = loop.create_future()
                        head.add_done_callback(functools.partial(_settle_from_thread, loop, fut))
                        await fut
                    else:
                        await asyncio.sleep(delay)
                        delay = min(delay * 2, _DRAIN_POLL_MAX_S)
        except TimeoutError:
            raise TimeoutError(
                f"drain timed out after {timeout} s with {led.pending} rows still pending "
                f"behind fences"
            ) from None

    async def close(self) -> None:
        """Close the pool: new allocations and current waiters fail.

        Every queued ``alloc`` raises :class:`PoolClosedError`; later
        ``alloc``/``try_alloc`` calls too. ``free`` still works, and rows
        pending behind fences stay pending (``drain()`` waits for them).
        Never waits for a fence: the fence watcher is told to stop, and only
        its threads that are not inside a fence's ``synchronize()`` are
        joined (they exit within microseconds; the join is bounded at 50 ms
        in all). A watcher thread stuck in a CUDA event that never completes
        is a daemon and keeps nothing alive. Idempotent.
        """
        self._check_thread()
        if self._closed:
            return
        self._closed = True
        self._gated = True
        self._fast = None
        error = PoolClosedError("the pool was closed while this request waited")
        for queue in list(self._queues.values()):
            for _, fut, _ in queue:
                if not fut.done():
                    fut.set_exception(error)
        self._queues.clear()
        self._prios.clear()
        self._nwaiters = 0
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher.stop()
            watcher.join(_CLOSE_JOIN_S)
        logger.debug("closed %r", self)

    @property
    def closed(self) -> bool:
        return self._closed

    async def release_memory(self) -> None:
        """Drain fences and release the ``kv_cache`` memory region.

        While released, ``alloc`` waits and ``try_alloc`` returns None.
        Raises :class:`PoolBusyError` (and stays serving) if rows are still
        allocated once fences are drained. Without the memory saver the
        memory step is a no-op and the state machine is the same.
        """
        self._check_thread()
        if self._closed:
            raise PoolClosedError("the pool is closed")
        if self._released:
            return
        self._released = self._gated = True
        self._fast = None
        try:
            await self.drain()
            allocated = self._ledger.allocated
            if allocated:
                rows = "1 row is" if allocated == 1 else f"{allocated} rows are"
                raise PoolBusyError(
                    f"cannot release memory while {rows} still allocated; free them first"
                )
            self._tables.pause()
        except BaseException:
            self._released = False
            self._gated = self._closed
            self._grant()
            raise
        logger.info("released the kv_cache region of %r", self)

    async def resume_memory(self) -> None:
        """Restore the memory region, zero the tables, and wake waiters."""
        self._check_thread()
        if not self._released:
            return
        self._tables.resume()
        self._ledger.reset_all()
        self._released = False
        self._gated = self._closed
        self._grant()
        logger.info("resumed the kv_cache region of %r", self)

    @property
    def released(self) -> bool:
        return self._released

    # ------------------------------------------------------------ views

    def waiting(self) -> int:
        """How many ``alloc`` calls are queued."""
        return self._nwaiters

    def stats(self, *, summaries: bool = True) -> PoolStats:
        """A frozen snapshot of counts, totals, histograms and latency summaries.

        Never mutates the pool. ``summaries=False`` leaves ``wait_time`` and
        ``fence_latency`` empty (sorting their sample windows is the costly
        part); metrics scrapes use it. May be called from another thread (a
        scrape): the figures are then read a few operations apart.
        """
        waits = self._wait_histogram.snapshot(zeros=self._fast_allocs)
        return self._stats(
            summaries,
            waiters=self._nwaiters,
            timeouts=self._timeouts,
            cancellations=self._cancellations,
            rejections=self._rejections,
            closed=self._closed,
            released=self._released,
            wait_time=LatencySummary.of(self._wait_times) if summaries else LatencySummary(),
            alloc_calls=waits.count,
            wait_histogram=waits,
        )

    def check_invariants(self) -> None:
        """Raise AssertionError unless ledger and waiter queues are consistent."""
        super().check_invariants()
        queued = sum(len(q) for q in self._queues.values())
        if queued != self._nwaiters:
            raise AssertionError(f"waiter count {self._nwaiters} != queued {queued}")
        if sorted(self._queues) != self._prios:
            raise AssertionError("priority index out of sync with the queues")
        for queue in self._queues.values():
            for n, fut, _ in queue:
                # A cancelled future stays queued until its task resumes and
                # dequeues it (legal); a granted or failed one never does.
                if fut.done() and not fut.cancelled():
                    raise AssertionError(f"a settled waiter is still queued: {n} rows")
        for row in self._unreset:
            if self._ledger.state_of(row) != "allocated":
                raise AssertionError(f"row {row} awaits its reset but is not allocated")


class Lease:
    """The async context manager returned by :meth:`AsyncReqToTokenPool.lease`."""

    __slots__ = ("_after", "_gens", "_n", "_pool", "_priority", "_timeout", "rows")

    def __init__(
        self,
        pool: AsyncReqToTokenPool,
        n: int,
        priority: int,
        timeout: float | None,
        after: Any | None,
    ) -> None:
        self._pool = pool
        self._n = n
        self._priority = priority
        self._timeout = timeout
        self._after = after
        self._gens: list[int] = []
        self.rows: list[int] = []

    async def __aenter__(self) -> list[int]:
        pool = self._pool
        self.rows = await pool.alloc(self._n, priority=self._priority, timeout=self._timeout)
        self._gens = [pool.generation(r) for r in self.rows]
        return self.rows

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        pool = self._pool
        led = pool._ledger
        stale = [
            r
            for r, g in zip(self.rows, self._gens, strict=True)
            if pool.generation(r) != g or led.state_of(r) != "allocated"
        ]
        rows = [r for r in self.rows if r not in stale] if stale else self.rows
        if rows:
            try:
                pool.free(rows, after=self._after)
            except Exception:
                # No fence could be recorded on `after` (say, a HostStream
                # closed in the body: its work has run or been dropped). Never
                # leak the rows: free them behind their recorded uses, then
                # report.
                if all(led.state_of(r) == "allocated" for r in rows):
                    pool.free(rows)
                raise
        if stale:
            raise DoubleFreeError(
                f"lease rows {stale} were freed inside the lease body, so the lease "
                "does not free them again (they may belong to another request now)"
            )
