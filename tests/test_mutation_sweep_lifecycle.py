"""Gaps found by a mechanical mutation sweep of ``asyncpool/lifecycle.py``
(``drain``, ``close``, ``release_memory``/``resume_memory``).

Each test pins one behaviour that a generated mutant broke while the focused
lifecycle test files still passed:

* ``drain`` waiting on a pending ``HostFence`` is woken by the fence's done
  callback, not only by its poll timer: with the poll backoff made an hour
  long, a drain still returns as soon as the fence completes (in either
  reclaim mode);
* ``drain`` waits for KV pages pending behind a fence when no row is
  pending at all (the fences holding pages are asked too, and an explicit
  drain settles the page ledger, not only the rows ledger), in either mode;
* ``close`` and ``resume_memory`` refuse a foreign thread with
  :class:`WrongThreadError`, changing nothing (``release_memory`` is pinned
  alongside, though its ``drain`` would refuse the thread anyway);
* ``drain`` with every pending fence already complete reclaims and returns
  without suspending;
* an explicit-mode ``drain`` that runs out of time raises ``TimeoutError``
  naming the rows and pages still pending (it neither returns quietly nor
  fails building the message);
* a ``release_memory`` that fails (here: cancelled while it drains) ungates
  the waiters and grants them at once: an ``alloc`` queued during the drain
  gets its row without any later ``free``;
* a ``drain`` of a pool without ``kv`` that times out names rows only, in
  either reclaim mode;
* ``drain`` backs off the timer of its wait on a pending host fence,
  doubling from 50 µs to 1 ms, in either reclaim mode (auto mode kept it at
  50 µs, rebuilding the list of pending fences at each wake: fixed);
* an auto-mode ``drain`` whose rows wait on two host fences moves on to the
  second once the first completes, woken by its callback;
* ``drain`` polls fences of unknown origin with the documented backoff,
  doubling from 50 µs to a 1 ms cap, and starts again from 50 µs once a
  fence completes, in either reclaim mode.

Async tests run on asyncio and uvloop (conftest); every wait that could hang
is bounded.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from helpers import EventFence, Gate, bounded, in_thread, pool_snapshot, spin, until

from asyncpool import (
    AsyncReqToTokenPool,
    HostStream,
    KVPagePool,
    WrongThreadError,
)
from asyncpool import lifecycle as lifecycle_module


@pytest.mark.parametrize("reclaim", ["auto", "explicit"])
async def test_drain_wakes_on_the_host_fence_callback_not_the_timer(
    reclaim: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An hour-long poll: only the fence's done callback can end the wait.
    monkeypatch.setattr(lifecycle_module, "_DRAIN_POLL_MIN_S", 3600.0)
    monkeypatch.setattr(lifecycle_module, "_DRAIN_POLL_MAX_S", 3600.0)
    stream = HostStream()
    gate = Gate(stream)
    kv = KVPagePool(16, 4, reclaim=reclaim)
    pool = AsyncReqToTokenPool(8, 16, kv=kv, reclaim=reclaim)
    try:
        g = await pool.admit(pages=2)
        pool.free([g.row], fence=stream.record())
        drain = asyncio.create_task(pool.drain())
        await spin()
        assert not drain.done()
        gate.open()
        async with bounded(5.0):
            await drain
        assert pool.stats().pending == 0
        assert kv.available_size() == kv.capacity
    finally:
        gate.open()
        stream.close()
        await pool.close()


class _Spinning(BaseException):
    """Raised by :class:`_CappedFence` from a drain that asks it forever
    without yielding (no timeout could end that wait)."""


class _CappedFence(EventFence):
    """An ``EventFence`` that raises :class:`_Spinning` past ``cap`` queries."""

    cap = 10_000

    def query(self) -> bool:
        if self.queries >= self.cap:
            raise _Spinning(f"queried {self.queries} times")
        return super().query()


@pytest.mark.parametrize("reclaim", ["auto", "explicit"])
async def test_drain_waits_for_pages_pending_alone_behind_a_fence(reclaim: str) -> None:
    kv = KVPagePool(16, 4, reclaim=reclaim)
    pool = AsyncReqToTokenPool(8, 16, kv=kv, reclaim=reclaim)
    fence = _CappedFence()
    try:
        grant = await pool.admit(pages=3)
        pages = pool.detach_pages(grant.row)
        kv.free(pages, fence=fence)
        pool.free([grant.row])
        assert pool.stats().pending == 0  # no row pending: only the pages
        assert kv.available_size() == kv.capacity - 3
        drain = asyncio.create_task(pool.drain())
        await spin()
        assert not drain.done()
        fence.set()
        async with bounded():
            await drain
        assert kv.available_size() == kv.capacity
        pool.check_invariants()
    finally:
        fence.set()
        await pool.close()


async def _call_close(pool: AsyncReqToTokenPool) -> None:
    await pool.close()


async def _call_release(pool: AsyncReqToTokenPool) -> None:
    await pool.release_memory()


async def _call_resume(pool: AsyncReqToTokenPool) -> None:
    await pool.resume_memory()


@pytest.mark.parametrize("call", [_call_close, _call_release, _call_resume])
async def test_lifecycle_calls_refuse_a_foreign_thread(
    call: Callable[[AsyncReqToTokenPool], Any],
) -> None:
    async with bounded(), AsyncReqToTokenPool(5, 4) as pool:
        rows = await pool.alloc(1)  # binds the pool to this thread
        pool.free(rows)
        if call is _call_resume:
            await pool.release_memory()
        before = pool_snapshot(pool)
        state = (pool.closed, pool.released)
        with pytest.raises(WrongThreadError):
            in_thread(lambda: asyncio.run(call(pool)))
        assert (pool.closed, pool.released) == state
        assert pool_snapshot(pool) == before
        if call is _call_resume:
            await pool.resume_memory()


async def test_drain_with_every_fence_done_returns_without_suspending() -> None:
    async with bounded(), AsyncReqToTokenPool(5, 4) as pool:
        fence = EventFence()
        rows = await pool.alloc(2)
        pool.free(rows, fence)
        fence.set()  # complete, but nothing has reclaimed it yet
        assert pool.stats().pending == 2
        coro = pool.drain()
        with pytest.raises(StopIteration):
            coro.send(None)  # finishes on the first step: it never suspends
        assert pool.stats().pending == 0
        assert pool.available_size() == 4


async def test_an_explicit_drain_that_times_out_says_what_is_pending() -> None:
    kv = KVPagePool(16, 4, reclaim="explicit")
    pool = AsyncReqToTokenPool(8, 16, kv=kv, reclaim="explicit")
    fence = EventFence()
    try:
        grant = await pool.admit(pages=2)
        pool.free([grant.row], fence=fence)
        with pytest.raises(TimeoutError, match="1 row and 2 pages still pending"):
            async with bounded():
                await pool.drain(timeout=0.01)
        assert pool.stats().pending == 1
        fence.set()
        async with bounded():
            await pool.drain()
        assert pool.stats().pending == 0
    finally:
        fence.set()
        await pool.close()


async def test_a_failed_release_grants_the_waiters_it_held() -> None:
    stream = HostStream()
    gate = Gate(stream)
    pool = AsyncReqToTokenPool(3, 4)  # two rows
    try:
        a, b = await pool.alloc(2)
        pool.free([a])  # free at once
        pool.free([b], fence=stream.record())  # pending behind the gate
        release = asyncio.create_task(pool.release_memory())
        await spin()
        waiter = asyncio.ensure_future(pool.alloc(1))
        await spin()
        assert not waiter.done()  # gated by the release in progress
        release.cancel()
        with pytest.raises(asyncio.CancelledError):
            async with bounded():
                await release
        assert not pool.released
        async with bounded():
            assert await waiter == [a]  # granted by the failed release itself
        pool.free(waiter.result())
    finally:
        gate.open()
        stream.close()
        await pool.close()


@pytest.mark.parametrize("reclaim", ["auto", "explicit"])
async def test_drain_polls_unknown_fences_with_the_documented_backoff(
    reclaim: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = _CappedFence(), _CappedFence()  # a poll without a sleep fails
    delays: list[float] = []
    real_sleep = asyncio.sleep

    async def recording_sleep(delay: float, result: Any = None) -> Any:
        if delay > 0:  # drain's polls; spin() and the loop's own use sleep(0)
            delays.append(delay)
            if len(delays) == 8:
                first.set()
            elif len(delays) == 12:
                second.set()
        return await real_sleep(0, result)

    kv = KVPagePool(16, 4, reclaim=reclaim)
    pool = AsyncReqToTokenPool(8, 16, kv=kv, reclaim=reclaim)
    try:
        a = await pool.admit(pages=1)
        b = await pool.admit(pages=1)
        pool.free([a.row], fence=first)
        pool.free([b.row], fence=second)
        monkeypatch.setattr(asyncio, "sleep", recording_sleep)
        async with bounded():
            await pool.drain()
        monkeypatch.undo()
        assert pool.stats().pending == 0
        # Doubling from 50 us to the 1 ms cap; back to 50 us after progress.
        climb = [50e-6, 100e-6, 200e-6, 400e-6, 800e-6, 1e-3, 1e-3, 1e-3]
        assert delays == pytest.approx(climb + climb[:4])
    finally:
        first.set()
        second.set()
        await pool.close()


@pytest.mark.parametrize("reclaim", ["auto", "explicit"])
async def test_a_drain_without_kv_that_times_out_names_rows_only(reclaim: str) -> None:
    pool = AsyncReqToTokenPool(5, 4, reclaim=reclaim)
    fence = EventFence()
    try:
        rows = await pool.alloc(1)
        pool.free(rows, fence=fence)
        with pytest.raises(TimeoutError, match=r"with 1 row still pending behind fences$"):
            async with bounded():
                await pool.drain(timeout=0.01)
    finally:
        fence.set()
        await pool.close()


@pytest.mark.parametrize("reclaim", ["auto", "explicit"])
async def test_drain_backs_off_its_host_fence_timer(
    reclaim: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # In auto mode every timer wake used to count as progress: the timer
    # stayed at 50 us and each wake rebuilt the list of pending fences.
    stream = HostStream()
    gate = Gate(stream)
    delays: list[float] = []
    real_wait = lifecycle_module._fence_or_timer

    async def recording_wait(loop: asyncio.AbstractEventLoop, fence: Any, delay: float) -> None:
        delays.append(delay)
        if len(delays) == 8:
            gate.open()
        await real_wait(loop, fence, delay)

    monkeypatch.setattr(lifecycle_module, "_fence_or_timer", recording_wait)
    kv = KVPagePool(16, 4, reclaim=reclaim)
    pool = AsyncReqToTokenPool(8, 16, kv=kv, reclaim=reclaim)
    try:
        grant = await pool.admit(pages=1)
        pool.free([grant.row], fence=stream.record())
        async with bounded():
            await pool.drain()
        assert pool.stats().pending == 0
        # Doubling from 50 us to the 1 ms cap. The gate opens at the 8th
        # wait, but the stream's worker may need longer than that wait's
        # 1 ms to run the fence on a loaded machine: any later wait stays
        # at the cap.
        assert delays[:8] == pytest.approx(
            [50e-6, 100e-6, 200e-6, 400e-6, 800e-6, 1e-3, 1e-3, 1e-3]
        )
        assert delays[8:] == pytest.approx([1e-3] * len(delays[8:]))
    finally:
        gate.open()
        stream.close()
        await pool.close()


async def test_drain_moves_on_to_the_next_host_fence_of_the_same_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An hour-long poll: only the fences' callbacks can end the waits.
    monkeypatch.setattr(lifecycle_module, "_DRAIN_POLL_MIN_S", 3600.0)
    monkeypatch.setattr(lifecycle_module, "_DRAIN_POLL_MAX_S", 3600.0)
    waited: list[Any] = []
    real_wait = lifecycle_module._fence_or_timer

    async def recording_wait(loop: asyncio.AbstractEventLoop, fence: Any, delay: float) -> None:
        waited.append(fence)
        await real_wait(loop, fence, delay)

    monkeypatch.setattr(lifecycle_module, "_fence_or_timer", recording_wait)
    first, second = HostStream("first"), HostStream("second")
    gate_first, gate_second = Gate(first), Gate(second)
    pool = AsyncReqToTokenPool(5, 4)
    try:
        rows = await pool.alloc(2)
        use, last = first.record(), second.record()
        pool.record_use(rows, use)
        pool.free(rows, fence=last)  # waits for both fences
        drain = asyncio.create_task(pool.drain())
        await spin()
        gate_first.open()
        async with bounded():
            await asyncio.to_thread(use.synchronize)
        # The drain hears of `use` through its callback, which the stream's
        # worker runs after synchronize() has returned: wait until it has
        # moved on to `last` (a fixed number of loop turns raced with it).
        await until(lambda: last in waited)
        assert not drain.done() and pool.stats().pending == 2
        # Each fence waited for once: none asked again once it completed.
        assert waited.count(use) <= 1 and waited.count(last) <= 1
        gate_second.open()
        async with bounded():
            await drain
        assert pool.stats().pending == 0
        assert waited.count(use) <= 1 and waited.count(last) == 1
    finally:
        gate_first.open()
        gate_second.open()
        first.close()
        second.close()
        await pool.close()
