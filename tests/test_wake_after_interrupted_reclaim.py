"""A fence wake-up whose reclaim is interrupted by a ``query()`` that raises
what is not an ``Exception`` (``CancelledError``, ``KeyboardInterrupt``).

A transfer handle's ``query()`` may raise ``CancelledError`` (it wraps a
concurrent future that was just cancelled) or be hit by a signal. The ledgers
then leave the batch "decided or as it was" and the error propagates (the
contracts' *fences* row, docs/api.md). In the pool's wake-up, the callback the watcher's
poller queues after it let go of a fence, that left two things undone (found
by a trial):

1. the batch stayed pending, but the poller had dropped its fence (it
   answered True there, or raised), and nothing watched it again: its
   completion woke no waiter until an unrelated call into the pool;
2. the grant loop at the end of the wake-up never ran, so rows or pages the
   same reclaim released before the raise were not handed to the waiters.

Now the wake-up serves the waiters with what was reclaimed, logs the error
(no caller to raise it to; ``KeyboardInterrupt`` and ``SystemExit`` still
propagate and stop the loop) and retries itself with a backoff (1 ms
doubling to 0.1 s) until a reclaim no longer raises, then watches again the
fences the poller let go of. A handle that raises on every call costs a few
retries a second, not a hot loop, and logs one warning.

Fake handles are driven by ``threading.Event`` flags and by which thread
asks (the poller or the loop), never by timed sleeps; every wait is bounded.
Async tests run on asyncio and uvloop (conftest); the loop-stopping ones run
their own loop of each kind.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import logging
import threading
import time
import weakref
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import uvloop
from helpers import (
    WAIT_S,
    EventFence,
    assert_granted,
    bounded,
    count_wake_ups,
    spin,
    tracing,
    until,
)

from asyncpool import AsyncReqToTokenPool, KVPagePool, PoolClosedError
from asyncpool import wakeups as wakeups_mod

LOGGER = "asyncpool"


class _Handle:
    """A transfer handle whose ``query()`` answers whether it ``landed``,
    except while ``armed``: then the poller's first ask gets ``poller`` (a
    bool answered, or an exception class raised; None: no special answer)
    and the loop thread's first ask after it (or at once when ``poller`` is
    None) raises ``raised``."""

    def __init__(
        self,
        poller: bool | type[BaseException] | None = True,
        raised: type[BaseException] = asyncio.CancelledError,
    ) -> None:
        self.poller = poller
        self.raised = raised
        self.owner = threading.get_ident()  # the loop's thread
        self.armed = threading.Event()
        self.polled = threading.Event()  # the poller's scripted ask happened
        self.interrupted = threading.Event()  # the loop's ask raised
        self.landed = threading.Event()

    def __repr__(self) -> str:
        return f"<_Handle landed={self.landed.is_set()}>"

    def query(self) -> bool:
        if self.armed.is_set():
            if threading.get_ident() != self.owner:
                if self.poller is not None and not self.polled.is_set():
                    self.polled.set()
                    if isinstance(self.poller, bool):
                        return self.poller
                    raise self.poller("status poll failed")
            elif (self.poller is None or self.polled.is_set()) and not self.interrupted.is_set():
                self.interrupted.set()
                raise self.raised()
        return self.landed.is_set()

    def synchronize(self) -> None:
        self.landed.wait(5)


class _AlwaysRaises:
    """A handle whose ``query()`` raises ``CancelledError`` on every call
    while ``raising`` (a cancelled future's result), then answers True;
    counts its calls."""

    def __init__(self) -> None:
        self.raising = False
        self.done = False
        self.asks = 0

    def query(self) -> bool:
        self.asks += 1
        if self.raising:
            raise asyncio.CancelledError
        return self.done

    def synchronize(self) -> None:
        pass


class _Stuck:
    """A handle that never completes; counts its calls."""

    def __init__(self) -> None:
        self.asks = 0

    def query(self) -> bool:
        self.asks += 1
        return False

    def synchronize(self) -> None:
        pass


Waiter = Callable[[], Coroutine[Any, Any, Any]]


async def _held_behind(side: str, fences: list[Any]) -> tuple[AsyncReqToTokenPool, Waiter]:
    """A pool whose memory is all held behind ``fences`` (one row, or two
    pages, each), and the call a waiter makes for one share of it: ``alloc(1)``
    on the rows side, ``admit(pages=2)`` on the pages side (the row is free
    there; the pages were trimmed off an admitted row behind the fences)."""
    n = len(fences)
    if side == "rows":
        pool = AsyncReqToTokenPool(n + 1, 8)
        rows = await pool.alloc(n)
        for row, fence in zip(rows, fences, strict=True):
            assert pool.free([row], fence=fence) == 0
        return pool, lambda: pool.alloc(1)
    pool = AsyncReqToTokenPool(3, 8, kv=KVPagePool(2 * n + 1, 4))
    grant = await pool.admit(pages=2 * n)
    for i, fence in enumerate(fences):  # the first fence holds the last pages
        assert pool.trim_pages(grant.row, 2 * (n - 1 - i), fence=fence) == 0
    return pool, lambda: pool.admit(pages=2)


class _Handled:
    """The loop's exception handler, recording what reached it."""

    def __init__(self) -> None:
        self.contexts: list[dict[str, Any]] = []

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        self.contexts.append(context)


# ---------------------------------------------------------------- the trial's case


@pytest.mark.parametrize("side", ["rows", "pages"])
async def test_a_cancelled_second_ask_still_wakes_the_waiter(
    side: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The trial's handle: the poller's ask answers True, the wake-up's
    reclaim asks again and gets ``CancelledError``, later asks answer True.
    The waiter gets its row (or row and pages) with nobody calling the pool.
    Before: the error left the callback, nothing watched the handle any
    more and the grant loop never ran, so the waiter hung."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    handled = _Handled()
    asyncio.get_running_loop().set_exception_handler(handled)
    handle = _Handle(poller=True)
    pool, wait = await _held_behind(side, [handle])
    waiter = asyncio.ensure_future(wait())
    await spin()
    assert pool.waiting() == 1
    handle.landed.set()
    handle.armed.set()  # from here on only the poller asks, until its wake-up
    async with bounded():
        assert_granted(side, await waiter)
    assert handle.polled.is_set() and handle.interrupted.is_set()
    # No caller to raise it to: logged once, not handed to the loop's handler.
    assert not handled.contexts
    warned = [r for r in caplog.records if "background reclaim" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING
    pool.check_invariants()
    await pool.close()


# ---------------------------------------------------------------- 1: the fence is watched again


@pytest.mark.parametrize("side", ["rows", "pages"])
@pytest.mark.parametrize(
    "poller", [True, ConnectionError, asyncio.CancelledError], ids=["done", "raised", "cancelled"]
)
async def test_a_fence_the_poller_let_go_is_watched_again(
    side: str, poller: bool | type[BaseException], caplog: pytest.LogCaptureFixture
) -> None:
    """The poller lets go of the handle (it answered True there, or raised
    an Exception or a CancelledError); the wake-up's reclaim gets
    CancelledError, and the handle answers "not done" from then on until it
    lands. Its memory stays pending and the poller watches it again, so its
    landing wakes the waiter with nobody calling the pool. Before: nothing
    watched it again."""
    caplog.set_level(logging.CRITICAL, logger=LOGGER)
    handle = _Handle(poller=poller)
    pool, wait = await _held_behind(side, [handle])
    waiter = asyncio.ensure_future(wait())
    await spin()
    handle.armed.set()
    watcher = pool._wakeups.watcher
    assert watcher is not None
    await until(lambda: handle.interrupted.is_set() and watcher.polling(handle))
    assert not waiter.done() and pool.waiting() == 1
    assert (pool.pending_size() if side == "rows" else pool.kv.pending_size()) == (  # type: ignore[union-attr]
        1 if side == "rows" else 2
    )
    assert pool.quarantined_size() == 0
    handle.landed.set()  # only the poller can notice
    async with bounded():
        assert_granted(side, await waiter)
    pool.check_invariants()
    await pool.close()


# ---------------------------------------------------------------- 2: what was reclaimed is granted


@pytest.mark.parametrize("side", ["rows", "pages"])
async def test_memory_reclaimed_before_the_raise_goes_to_the_waiter(
    side: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Two handles, each holding one share: the first lands, the second's
    query() raises CancelledError at the wake-up's reclaim, after the first
    one's share was released. The waiter gets that share at once (the second
    handle never lands during the test). Before: the grant loop at the end
    of the wake-up never ran, and the released share sat free while the
    waiter waited."""
    caplog.set_level(logging.CRITICAL, logger=LOGGER)
    first = EventFence()
    second = _Handle(poller=None)  # the poller keeps hearing "not done"
    pool, wait = await _held_behind(side, [first, second])
    waiter = asyncio.ensure_future(wait())
    await spin()
    assert pool.waiting() == 1
    second.armed.set()  # the loop's next ask raises
    first.set()  # the poller notices this one and wakes the pool
    try:
        async with bounded():
            assert_granted(side, await waiter)
        assert second.interrupted.is_set()
        assert pool.quarantined_size() == 0
        pool.check_invariants()
    finally:
        second.landed.set()
        await pool.close()


# ---------------------------------------------------------------- no hot loop, no flood


async def test_a_handle_that_keeps_raising_costs_less_than_a_stuck_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A handle whose query() raises CancelledError on every call: the
    poller lets go of it at once and wakes the pool, whose reclaim raises
    again; the wake-up retries with a backoff (1 ms doubling to 0.1 s)
    instead of watching it again at once, which would make a loop of
    poller, wake-up and reclaim as fast as the threads can hand over. Over
    half a second it is asked far less often than a stuck handle, the pool
    wakes a few dozen times at most, and one warning is logged. Once it
    answers again, the retry finds it: the waiter gets its row."""
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    handled = _Handled()
    asyncio.get_running_loop().set_exception_handler(handled)
    window = 0.5
    # The reference: a stuck handle polled at the backoff rate.
    stuck = _Stuck()
    ref = AsyncReqToTokenPool(2, 8)
    ref.free(await ref.alloc(1), fence=stuck)
    ref_waiter = asyncio.ensure_future(ref.alloc(1))
    await spin()
    before = stuck.asks
    await asyncio.sleep(window)  # a measuring window, not a synchronisation
    stuck_asks = stuck.asks - before
    await ref.close()
    with pytest.raises(PoolClosedError):
        await ref_waiter
    # The handle that keeps raising.
    bad = _AlwaysRaises()
    pool = AsyncReqToTokenPool(2, 8)
    pool.free(await pool.alloc(1), fence=bad)
    waiter = asyncio.ensure_future(pool.alloc(1))
    await spin()
    wake_ups = count_wake_ups(pool)
    caplog.clear()
    base = bad.asks
    bad.raising = True
    t0 = time.perf_counter()
    await until(lambda: wake_ups[0] > 0)
    await asyncio.sleep(max(0.0, window - (time.perf_counter() - t0)))
    asks, woken = bad.asks - base, wake_ups[0]
    records = list(caplog.records)
    assert not waiter.done() and pool.pending_size() == 1 and pool.quarantined_size() == 0
    # Retries at 1, 2, 4, ... 64 ms then every 100 ms: about 10 in the window.
    assert woken <= 30, f"{woken} wake-ups in {window} s: a hot loop"
    assert asks <= 3 * woken + 2 and asks < max(stuck_asks, 100), (asks, stuck_asks)
    warnings = [r for r in records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "background reclaim" in warnings[0].getMessage()
    assert len(records) <= 20, [r.getMessage() for r in records]
    assert not handled.contexts  # nothing reached the loop's exception handler
    assert pool._wakeups.watcher is not None and not pool._wakeups.watcher.polling(bad)
    # It answers again (the transfer was not cancelled after all): a retry
    # asks it within 0.1 s, and the waiter is served with nobody calling.
    bad.done = True
    bad.raising = False
    async with bounded():
        assert await waiter == [1]
    pool.check_invariants()
    await pool.close()


async def test_a_closed_pool_stops_retrying(caplog: pytest.LogCaptureFixture) -> None:
    """After close() the wake-up no longer retries (drain() and calls still
    reclaim): a handle that keeps raising is not asked again by the pool."""
    caplog.set_level(logging.CRITICAL, logger=LOGGER)
    bad = _AlwaysRaises()
    pool = AsyncReqToTokenPool(2, 8)
    pool.free(await pool.alloc(1), fence=bad)
    wake_ups = count_wake_ups(pool)
    bad.raising = True
    await until(lambda: wake_ups[0] >= 2)  # the poller's wake-up and a retry
    await pool.close()
    await until(lambda: pool._wakeups._wake_retry is None)  # the retry pending at close ran
    seen = wake_ups[0]
    for _ in range(20):
        await asyncio.sleep(0.01)  # a window in which retries would have run
    assert wake_ups[0] == seen
    assert pool.pending_size() == 1


async def test_a_pending_retry_does_not_keep_the_pool_alive(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The retry's timer holds the pool weakly, as the fence wake-ups do: a
    pool nothing else holds is collected while a handle behind it keeps
    raising and a retry is queued (it then does nothing)."""
    caplog.set_level(logging.CRITICAL, logger=LOGGER)
    bad = _AlwaysRaises()
    pool = AsyncReqToTokenPool(2, 8)
    pool.free(await pool.alloc(1), fence=bad)
    ref = weakref.ref(pool)
    bad.raising = True
    await until(lambda: getattr(getattr(ref(), "_wakeups", None), "_wake_retry", None) is not None)
    del pool
    gc.collect()
    assert ref() is None


# ---------------------------------------------------------------- the loop still stops


@pytest.mark.parametrize("raised", [KeyboardInterrupt, SystemExit])
@pytest.mark.parametrize(
    "factory", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"]
)
def test_an_interrupt_in_the_wake_up_still_stops_the_loop(
    factory: Callable[[], asyncio.AbstractEventLoop],
    raised: type[BaseException],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A KeyboardInterrupt (or SystemExit) from the wake-up's reclaim leaves
    the callback and stops the loop, as before; the waiter was served
    meanwhile (the grant loop ran, its own reclaim found the handle done),
    so running the loop again completes it. Before: the grant loop never ran
    and nothing watched the handle again; the waiter hung."""
    caplog.set_level(logging.CRITICAL, logger=LOGGER)
    loop = factory()
    handle = _Handle(poller=True, raised=raised)
    state: dict[str, Any] = {}

    async def start() -> None:
        pool = AsyncReqToTokenPool(2, 8)
        pool.free(await pool.alloc(1), fence=handle)
        state["pool"] = pool
        state["waiter"] = asyncio.ensure_future(pool.alloc(1))
        await spin()
        assert pool.waiting() == 1

    async def finish() -> list[int]:
        async with bounded():
            return await state["waiter"]  # type: ignore[no-any-return]

    try:
        loop.run_until_complete(start())
        handle.landed.set()
        handle.armed.set()
        with pytest.raises(raised):
            loop.run_until_complete(finish())
        assert handle.interrupted.is_set()
        assert loop.run_until_complete(finish()) == [1]
        loop.run_until_complete(state["pool"].close())
    finally:
        handle.landed.set()
        loop.close()


# ---------------------------------------------------------------- a pool handed to another thread


def _line_of(fn: Callable[..., Any], text: str) -> int:
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, line in enumerate(lines) if text in line)


@pytest.mark.parametrize(
    "factory", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"]
)
def test_a_retry_left_on_the_old_loop_does_not_touch_the_pool_after_bind(
    factory: Callable[[], asyncio.AbstractEventLoop], caplog: pytest.LogCaptureFixture
) -> None:
    """A retry queued on loop A, then the pool handed to thread B with
    ``bind()`` (nothing pending: a call reclaimed it). A's timer still fires
    on A's thread; it must do nothing there. Before, it passed its check
    (``_wake_retry`` still named A) and cleared ``_wake_retry`` from A's
    thread: landing after B queued its own retry (a tracer holds A's thread
    just before the store until then), it lost B's retry, so nothing
    watched B's handle again and B's waiter hung."""
    caplog.set_level(logging.CRITICAL, logger=LOGGER)
    bad, bad_b = _AlwaysRaises(), _AlwaysRaises()
    state: dict[str, Any] = {}
    handed, bound, checked, queued_b, done_b = (threading.Event() for _ in range(5))
    store = _line_of(wakeups_mod._retry_wake_of, "wakeups._wake_retry = None")
    code = wakeups_mod._retry_wake_of.__code__

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code is not code:
            return None
        if not bound.is_set():
            return tracer
        if event == "line" and frame.f_lineno == store:
            checked.set()  # A's stale timer passed its check
            queued_b.wait(WAIT_S)  # B's retry is queued: store now
        elif event == "return":
            checked.set()  # it did nothing
        return tracer

    async def on_a() -> None:
        loop = asyncio.get_running_loop()
        pool = state["pool"] = AsyncReqToTokenPool(2, 8)
        pool.free(await pool.alloc(1), fence=bad)
        bad.raising = True
        await until(lambda: pool._wakeups._wake_raises >= 8)  # the next retry is 0.1 s away
        bad.raising, bad.done = False, True
        pool.reclaim()  # a call reclaims it: nothing pending, the retry still queued
        assert pool.pending_size() == 0 and pool._wakeups._wake_retry is loop
        handed.set()
        assert bound.wait(WAIT_S)  # blocks A: its timer fires after the bind
        # Keep A running (its timer fires) until B is done; B's waits are bounded.
        assert await loop.run_in_executor(None, done_b.wait, 3 * WAIT_S)

    async def on_b() -> None:
        pool: AsyncReqToTokenPool = state["pool"]
        pool.bind()
        bound.set()
        assert checked.wait(WAIT_S)  # A's stale timer fired (within 0.1 s)
        real = pool._wakeups._retry_wake_later

        def queue_retry(raises: int) -> None:
            real(raises)
            queued_b.set()

        pool._wakeups._retry_wake_later = queue_retry  # type: ignore[method-assign]
        pool.free(await pool.alloc(1), fence=bad_b)
        bad_b.raising = True
        await until(queued_b.is_set)
        bad_b.raising = False  # not done yet: only a re-watch would see it land
        waiter = asyncio.ensure_future(pool.alloc(1))
        await spin()
        bad_b.done = True
        async with bounded():
            assert await waiter == [1]
        pool.check_invariants()
        await pool.close()

    def thread_b() -> None:
        try:
            assert handed.wait(WAIT_S)
            with asyncio.Runner(loop_factory=factory) as runner:
                runner.run(on_b())
        except BaseException as exc:
            state["error_b"] = exc
        finally:
            bound.set()
            checked.set()
            queued_b.set()
            done_b.set()

    tb = threading.Thread(target=thread_b, name="B")
    tb.start()
    try:
        with tracing(tracer), asyncio.Runner(loop_factory=factory) as runner:
            runner.run(on_a())
    finally:
        tb.join(WAIT_S)
    assert not tb.is_alive()
    if "error_b" in state:
        raise state["error_b"]


@pytest.mark.parametrize("move", ["bind", "drain"])
@pytest.mark.parametrize(
    "factory", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"]
)
def test_a_pool_that_left_its_loop_does_not_keep_it_alive(
    factory: Callable[[], asyncio.AbstractEventLoop], move: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A retry queued on loop A, A stopped and closed before it fired, then
    the pool moved to loop B: by ``bind()`` there, or by its first wait there
    (``drain()``, which rebinds a pool whose loop is closed). The pool lets
    go of A: once nothing else holds A it is collected. Before, the pool's
    note of the loop its retry was queued on (``_wake_retry``) kept A, with
    everything A held, until a retry was queued on B, which may never be.
    And the count of interrupted wake-ups starts afresh on B."""
    caplog.set_level(logging.CRITICAL, logger=LOGGER)
    bad = _AlwaysRaises()
    state: dict[str, Any] = {}

    async def on_a() -> None:
        pool = state["pool"] = AsyncReqToTokenPool(2, 8)
        pool.free(await pool.alloc(1), fence=bad)
        bad.raising = True  # every retry's reclaim raises, and queues the next
        await until(lambda: pool._wakeups._wake_retry is not None)

    loop_a = factory()
    try:
        loop_a.run_until_complete(on_a())
        pool: AsyncReqToTokenPool = state["pool"]
        assert pool._wakeups._wake_retry is loop_a and pool._loop is loop_a  # a retry still queued
    finally:
        loop_a.close()
    old = weakref.ref(loop_a)
    del loop_a
    bad.raising, bad.done = False, True  # reclaimed on B: no retry queued there

    async def on_b() -> None:
        if move == "bind":
            pool.bind()
        else:
            async with bounded():
                await pool.drain()
        assert pool._loop is asyncio.get_running_loop()
        assert pool.pending_size() == 0

    async def interrupted_on_b() -> None:
        # B's first interrupted wake-up is the first in a row: it warns, as
        # on a fresh pool. Before, bind() kept A's count, so it was the
        # n-th in a row there and logged nothing (DEBUG at most).
        caplog.set_level(logging.WARNING, logger=LOGGER)
        again = _AlwaysRaises()
        pool.free(await pool.alloc(1), fence=again)
        again.raising = True
        await until(lambda: any("background reclaim" in r.getMessage() for r in caplog.records))
        assert [r.levelno for r in caplog.records] == [logging.WARNING]
        again.raising, again.done = False, True
        async with bounded():
            await pool.drain()

    loop_b = factory()
    try:
        loop_b.run_until_complete(on_b())
        gc.collect()
        assert old() is None, [type(r).__name__ for r in gc.get_referrers(old())]
        pool.check_invariants()
        loop_b.run_until_complete(interrupted_on_b())
        loop_b.run_until_complete(pool.close())
    finally:
        loop_b.close()
