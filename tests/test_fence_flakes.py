"""Fences whose answers differ between the watcher's poller and the pool's
loop, and streams that fault every fence recorded on them.

1. A transfer handle whose ``query()`` answers True to the poller and then
   plain False to the pool's reclaim (a flaky status poll): the poller let
   go of it, the reclaim kept its memory pending, and nothing watched it
   again, so its waiter hung even after it answered True for good. Now a
   fence the poller let go of that still holds memory after the wake-up's
   reclaim is watched again (done-then-not-done is not done).
2. A handle whose ``query()`` raises on the poller's thread but answers
   False on the loop's: each poller fault woke the pool, whose reclaim kept
   it and watched it again at once, a loop of poller, wake-up and reclaim
   as fast as the threads hand over. The same holds for a handle that
   answers True to the poller and False to the loop for ever (1, watched
   again). Now a fence the poller lets go of again and again is watched
   again after a backoff (1 ms doubling to 10 ms), so it costs at most
   about a hundred wake-ups a second, and its waiter is still served
   within about 10 ms once it settles.
3. A faulted ``HostStream`` faults every later fence recorded on it: the
   pool logged one ERROR per fence. Now the first fault of a stream is an
   ERROR, the second one WARNING that says the rest go to DEBUG (with a
   running count); ``stats().fence_errors`` still counts every fence and
   every row is quarantined as before.

Fake handles are driven by ``threading.Event`` flags and by which thread
asks (the poller or the loop); the windows that count calls are measuring
windows, not synchronisation. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
from helpers import WAIT_S, EventFence, assert_granted, bounded, count_wake_ups, spin, until

from asyncpool import AsyncReqToTokenPool, HostStream, KVPagePool
from asyncpool.watcher import FenceWatcher

LOGGER = "asyncpool"

Waiter = Callable[[], Coroutine[Any, Any, Any]]


class _TwoFaced:
    """A transfer handle that answers the poller's thread differently from
    the loop's while ``armed``: the poller gets ``poller`` (a bool answered,
    or an exception raised) for its first ``times`` asks after arming (None:
    every ask), the loop gets False; once ``landed``, everyone gets True.
    Counts the asks of each side."""

    def __init__(self, poller: bool | BaseException, times: int | None = None) -> None:
        self.poller = poller
        self.times = times
        self.owner = threading.get_ident()  # the loop's thread
        self.armed = threading.Event()
        self.landed = threading.Event()
        self.lied = threading.Event()  # the poller heard its answer at least once
        self.denied = threading.Event()  # ... and then the loop heard False
        self.poller_asks = 0
        self.loop_asks = 0
        self._scripted = 0

    def __repr__(self) -> str:
        return f"<_TwoFaced landed={self.landed.is_set()}>"

    def query(self) -> bool:
        if self.landed.is_set():
            return True
        if threading.get_ident() == self.owner:
            self.loop_asks += 1
            if self.lied.is_set():
                self.denied.set()
            return False
        self.poller_asks += 1
        if self.armed.is_set() and (self.times is None or self._scripted < self.times):
            self._scripted += 1
            self.lied.set()
            if isinstance(self.poller, BaseException):
                raise self.poller
            return self.poller
        return False

    def synchronize(self) -> None:
        self.landed.wait(WAIT_S)


async def _held_behind(side: str, fence: Any) -> tuple[AsyncReqToTokenPool, Waiter]:
    """A pool whose free memory is all held behind ``fence`` (one row, or
    two pages), and the call a waiter makes for it."""
    if side == "rows":
        pool = AsyncReqToTokenPool(2, 8)
        assert pool.free(await pool.alloc(1), fence=fence) == 0
        return pool, lambda: pool.alloc(1)
    pool = AsyncReqToTokenPool(3, 8, kv=KVPagePool(3, 4))
    grant = await pool.admit(pages=2)
    assert pool.trim_pages(grant.row, 0, fence=fence) == 0
    return pool, lambda: pool.admit(pages=2)


# ---------------------------------------------------------------- 1: done, then not done


@pytest.mark.parametrize("side", ["rows", "pages"])
async def test_a_handle_done_for_the_poller_and_not_for_the_loop_is_watched_again(
    side: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The poller's ask gets True once, the wake-up's reclaim then gets
    False: the memory stays pending and the poller watches the handle
    again, so once the handle answers True for good the waiter is served
    with nobody calling the pool (how soon is the wake-up benchmark's row,
    not a test's). Before: nothing watched it again and the waiter hung."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    handle = _TwoFaced(True, times=1)
    pool, wait = await _held_behind(side, handle)
    waiter = asyncio.ensure_future(wait())
    await spin()
    assert pool.waiting() == 1
    watcher = pool._wakeups.watcher
    assert watcher is not None
    handle.armed.set()
    await until(lambda: handle.denied.is_set() and watcher.polling(handle))
    assert not waiter.done()
    assert pool.quarantined_size() == 0 and pool._pending_any() == (1 if side == "rows" else 2)
    handle.landed.set()  # only the poller can notice
    async with bounded():  # unwatched, it hangs: fails at the bound
        assert_granted(side, await waiter)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    pool.check_invariants()
    await pool.close()


# ---------------------------------------------------------------- 2: no hot loop


@pytest.mark.parametrize(
    "poller", [True, ConnectionError("status poll failed")], ids=["done", "raises"]
)
async def test_a_handle_the_poller_keeps_letting_go_costs_a_bounded_number_of_wake_ups(
    poller: bool | BaseException, caplog: pytest.LogCaptureFixture
) -> None:
    """A handle that answers True (or raises) on the poller's thread every
    time and False on the loop's: each poller ask lets go of it and wakes
    the pool, whose reclaim keeps its row pending. Watched again at once,
    this is a loop of poller, wake-up and reclaim (thousands of wake-ups a
    second); with the backoff (1 ms doubling to 10 ms) it wakes the pool
    about a hundred times a second at most. Once the handle lands, the
    waiter is served, the row never quarantined."""
    caplog.set_level(logging.CRITICAL, logger=LOGGER)
    window = 0.3
    handle = _TwoFaced(poller)
    pool, wait = await _held_behind("rows", handle)
    waiter = asyncio.ensure_future(wait())
    await spin()
    wake_ups = count_wake_ups(pool)
    handle.armed.set()
    await until(lambda: handle.denied.is_set())
    woken, asks = wake_ups[0], handle.poller_asks + handle.loop_asks
    await asyncio.sleep(window)  # a measuring window, not a synchronisation
    woken, asks = wake_ups[0] - woken, handle.poller_asks + handle.loop_asks - asks
    assert not waiter.done() and pool.pending_size() == 1 and pool.quarantined_size() == 0
    # 1, 2, 4, 8 ms, then every 10 ms: about 30 in the window; allow a slow VM.
    assert woken <= 80, f"{woken} wake-ups in {window} s: a hot loop"
    assert asks <= 4 * woken + 10, (asks, woken)
    handle.landed.set()
    async with bounded():
        assert_granted("rows", await waiter)
    pool.check_invariants()
    await pool.close()


async def test_a_delayed_rewatch_pending_at_close_does_nothing_harmful(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A handle that keeps bouncing has a delayed re-watch queued when the
    pool closes: the timer finds the watcher stopped and does nothing (no
    error reaches the loop), and the row stays pending for drain()."""
    caplog.set_level(logging.CRITICAL, logger=LOGGER)
    contexts: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: contexts.append(ctx))
    handle = _TwoFaced(True)
    pool, _ = await _held_behind("rows", handle)
    handle.armed.set()
    await until(lambda: pool._wakeups._rewatch_timer is not None)
    await pool.close()
    await until(lambda: pool._wakeups._rewatch_timer is None)  # the timer ran
    assert not contexts and pool.pending_size() == 1 and not pool._wakeups._rewatch_due
    handle.landed.set()
    async with bounded():
        await pool.drain()
    assert pool.pending_size() == 0


def test_a_delayed_rewatch_moves_with_the_pool_to_a_new_loop(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A pool whose loop ends while a delayed re-watch is queued on it
    (``asyncio.run`` twice): its timer there never runs, so the move to the
    next loop watches those fences again at once; the handle's landing then
    serves a waiter on the new loop with nobody calling the pool."""
    caplog.set_level(logging.CRITICAL, logger=LOGGER)
    handle = _TwoFaced(True, times=2)  # bounces twice: the second is delayed
    state: dict[str, Any] = {}

    async def first() -> None:
        pool, _ = await _held_behind("rows", handle)
        state["pool"] = pool
        # The delay is at least 1 ms: the loop ends with the timer queued.
        _rewatch_later = pool._wakeups._rewatch_later

        def stop_after(fences: list[Any], bounces: int) -> None:
            _rewatch_later(fences, bounces)
            asyncio.get_running_loop().stop()

        pool._wakeups._rewatch_later = stop_after  # type: ignore[method-assign]
        handle.armed.set()
        await asyncio.sleep(WAIT_S)  # stopped by stop_after, far earlier

    async def second() -> list[int]:
        pool = state["pool"]
        waiter = asyncio.ensure_future(pool.alloc(1))  # moves the pool here
        await spin()
        watcher = pool._wakeups.watcher
        assert watcher is not None and watcher.polling(handle)
        handle.landed.set()
        async with bounded():
            return await waiter  # type: ignore[no-any-return]

    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(RuntimeError, match="Event loop stopped"):
            loop.run_until_complete(first())
        assert state["pool"]._wakeups._rewatch_due == [handle]
    finally:
        loop.close()
    got = asyncio.run(second())
    assert got == [1]
    state["pool"].check_invariants()


def test_a_watcher_keeps_the_fences_it_let_go_of_only_when_asked() -> None:
    """``keep_dropped``: the poller records each fence it lets go of (done
    or raised) for the owner, who takes them once; without it (a watcher
    of its own) it keeps none, so nothing grows."""
    for keep in (True, False):
        fired = threading.Semaphore(0)
        watcher = FenceWatcher(fired.release, keep_dropped=keep)
        try:
            done, bad = EventFence(), EventFence()
            done.set()
            bad.error = ConnectionError("status poll failed")
            bad.set()
            watcher.watch(done)
            watcher.watch(bad)
            dropped: list[Any] = []
            deadline = time.monotonic() + WAIT_S
            while len(dropped) < (2 if keep else 0) or watcher.polled:
                assert fired.acquire(timeout=max(0.0, deadline - time.monotonic()))
                dropped += watcher.take_dropped()
            assert sorted(map(id, dropped)) == sorted(map(id, [done, bad] if keep else []))
            assert watcher.take_dropped() == [] and watcher.dropped == []
        finally:
            watcher.stop()
            assert watcher.join(WAIT_S)


# ---------------------------------------------------------------- 3: a faulted stream logs little


def _faulted_stream() -> HostStream:
    stream = HostStream("dead-stream")

    def boom() -> None:
        raise RuntimeError("kernel failed")

    stream.launch(boom)
    with pytest.raises(Exception, match=r"kernel failed|faulted"):
        stream.synchronize()
    return stream


@pytest.mark.parametrize("side", ["rows", "pages"])
async def test_a_faulted_stream_logs_one_error_not_one_per_fence(
    side: str, caplog: pytest.LogCaptureFixture
) -> None:
    """100 frees, each behind its own fence recorded on one faulted
    HostStream: every one is quarantined and counted in ``fence_errors`` as
    before, but the pool logs one ERROR for the stream and one WARNING
    saying the rest are logged at DEBUG, not 100 ERRORs. Before: 100."""
    n = 100
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    stream = _faulted_stream()
    caplog.clear()  # the stream's own ERROR for the work that raised
    try:
        if side == "rows":
            pool = AsyncReqToTokenPool(n + 1, 8)
            rows = await pool.alloc(n)
            for row in rows:
                pool.free([row], fence=stream.record())
        else:
            pool = AsyncReqToTokenPool(n + 1, 8, kv=KVPagePool(n + 1, 4))
            for _ in range(n):
                grant = await pool.admit(pages=1)
                pool.trim_pages(grant.row, 0, fence=stream.record())
        stats = pool.stats()
        if side == "rows":
            assert stats.fence_errors == n and pool.quarantined_size() == n
        else:
            assert stats.page_fence_errors == n and stats.pages_quarantined == n
        loud = [r for r in caplog.records if r.levelno >= logging.WARNING]
        errors = [r for r in loud if r.levelno >= logging.ERROR]
        assert len(errors) == 1, [r.getMessage() for r in errors]
        assert len(loud) == 2, [r.getMessage() for r in loud]
        assert "logged at DEBUG" in loud[1].getMessage()
        debug = [r for r in caplog.records if r.levelno == logging.DEBUG and "faulted" in r.msg]
        assert len(debug) >= n - 2
        pool.check_invariants()
        await pool.close()
    finally:
        stream.close()


async def test_each_faulted_stream_gets_its_own_error(caplog: pytest.LogCaptureFixture) -> None:
    """The first fault of every stream is an ERROR: a second dead stream is
    not hidden behind the first one's summary."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    first, second = _faulted_stream(), _faulted_stream()
    caplog.clear()
    try:
        pool = AsyncReqToTokenPool(9, 8)
        rows = await pool.alloc(8)
        for i, row in enumerate(rows):
            pool.free([row], fence=(first if i % 2 else second).record())
        assert pool.stats().fence_errors == 8 and pool.quarantined_size() == 8
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 2, [r.getMessage() for r in errors]
        await pool.close()
    finally:
        first.close()
        second.close()
