"""The fence watcher survives slow and stuck fences (issue 13).

* No fence delays another fence's wake-up: a waiter resumes within
  milliseconds of *any* of its candidate fences completing, however many
  slow or stuck fences of unknown origin (transfer handles) are watched, and
  a stuck CUDA stream does not hold up another stream's fences.
* ``close()`` never waits for a fence and leaves no thread that keeps the
  process alive; ``drain(timeout=)`` raises ``TimeoutError`` and changes
  nothing.
* Fences of unknown origin are polled with ``query()`` (backoff capped at
  1 ms), never blocked on with ``synchronize()``; a faulting one still
  quarantines its rows.

Slow fences are held by ``threading.Event`` objects the test controls (the
``kit`` fixture opens them at teardown), never by timed sleeps. Every wait is
bounded by ``asyncio.timeout``. CUDA fences are stood in for by real
:class:`CudaFence` wrappers around an event-like object, so the per-stream
threads run on a machine without a GPU.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator

import pytest
from helpers import (
    FAKE_DEVICE,
    WAIT_S,
    NoSyncFence,
    StandInEvent,
    Streams,
    bounded,
    forget_stand_in_events,
    pool_snapshot,
    spin,
    until,
)

from asyncpool import AsyncReqToTokenPool, CapacityError, FenceError, PoolClosedError
from asyncpool import watcher as watcher_mod
from asyncpool.fences import CudaFence

#: A waiter must resume within this of its fence completing. The poller's
#: backoff caps at 1 ms; the rest is slack for a loaded CI machine. The slow
#: fences never complete during the test, so any bound shows they were not
#: waited for.
PROMPT_S = 2.0


@pytest.fixture(autouse=True)
def _quiet_fault_logs(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    caplog.set_level(logging.CRITICAL, logger="asyncpool")
    yield
    forget_stand_in_events()


class StandInCudaStream:
    """Records :class:`CudaFence` objects on a pretend CUDA stream."""

    _keys = iter(range(2_000_000, 3_000_000))

    def __init__(self, kit: Streams) -> None:
        self.kit = kit
        self.key = next(self._keys)
        self.seq = 0

    def record(self) -> tuple[CudaFence, threading.Event]:
        self.seq += 1
        gate = self.kit.event_fence().event  # the kit opens it at teardown
        fence = CudaFence(StandInEvent(gate), FAKE_DEVICE, self.key, self.seq)  # type: ignore[arg-type]
        return fence, gate


def non_daemon_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if not t.daemon and t.is_alive()}


async def timed(aw: asyncio.Future[list[int]] | asyncio.Task[list[int]]) -> tuple[list[int], float]:
    t0 = time.perf_counter()
    async with asyncio.timeout(PROMPT_S):
        got = await aw
    return got, time.perf_counter() - t0


# ------------------------------------------------------------------ head-of-line


async def test_a_fast_fence_wakes_its_waiter_while_a_slow_one_is_watched(kit: Streams) -> None:
    """Row a behind slow fence A, row b behind fast fence B: B's completion
    alone wakes the waiter, with row b (today: the watcher sits in A)."""
    async with AsyncReqToTokenPool(3, 8) as pool:
        a, b = await pool.alloc(2)
        slow, fast = kit.event_fence(), kit.event_fence()
        pool.free([a], fence=slow)
        pool.free([b], fence=fast)
        waiter = asyncio.create_task(pool.alloc(1))
        await spin()
        assert pool.waiting() == 1
        fast.set()  # nobody calls into the pool
        got, _ = await timed(waiter)
        assert got == [b]
        assert pool.pending_size() == 1 and not slow.event.is_set()
        pool.free(got)


async def test_one_completion_among_100_stuck_fences_wakes_its_waiter(kit: Streams) -> None:
    async with AsyncReqToTokenPool(102, 8) as pool:
        rows = await pool.alloc(101)
        stuck = [kit.event_fence() for _ in range(100)]
        for row, fence in zip(rows, stuck, strict=False):
            pool.free([row], fence=fence)
        last = kit.event_fence()
        pool.free([rows[-1]], fence=last)
        assert pool.pending_size() == 101
        waiter = asyncio.create_task(pool.alloc(1))
        await spin()
        last.set()
        got, _ = await timed(waiter)
        assert got == [rows[-1]]
        assert pool.pending_size() == 100
        pool.free(got)


async def test_unknown_fences_are_polled_never_synchronized(kit: Streams) -> None:
    async with AsyncReqToTokenPool(3, 8) as pool:
        rows = await pool.alloc(2)
        fences = [NoSyncFence(), NoSyncFence()]
        kit._events += [f.event for f in fences]
        for row, fence in zip(rows, fences, strict=True):
            pool.free([row], fence=fence)
        waiter = asyncio.create_task(pool.alloc(2))
        await spin()
        for fence in fences:
            fence.set()
        got, _ = await timed(waiter)
        assert sorted(got) == sorted(rows)
        assert [f.synchronized for f in fences] == [0, 0]
        assert all(f.queries > 1 for f in fences)  # the ledger's own + the poller's
        pool.free(got)


async def test_a_stuck_cuda_stream_does_not_hold_up_another_stream(kit: Streams) -> None:
    """Per-stream threads: stream X's head never completes; stream Y's fence
    completes and wakes its waiter (today: one thread sits in X's event)."""
    x, y = StandInCudaStream(kit), StandInCudaStream(kit)
    async with AsyncReqToTokenPool(3, 8) as pool:
        a, b = await pool.alloc(2)
        fx, _gx = x.record()
        fy, gy = y.record()
        pool.free([a], fence=fx)
        pool.free([b], fence=fy)
        waiter = asyncio.create_task(pool.alloc(1))
        await spin()
        watcher = pool._wakeups.watcher
        assert watcher is not None and watcher.polled == 0  # CUDA fences are not polled
        gy.set()
        got, _ = await timed(waiter)
        assert got == [b]
        pool.free(got)


async def test_cuda_fences_of_one_stream_are_waited_in_record_order(kit: Streams) -> None:
    s = StandInCudaStream(kit)
    async with AsyncReqToTokenPool(4, 8) as pool:
        rows = await pool.alloc(3)
        recorded = [s.record() for _ in rows]
        for row, (fence, _) in zip(rows, recorded, strict=True):
            pool.free([row], fence=fence)
        for expect, (_, gate) in zip(rows, recorded, strict=True):
            waiter = asyncio.create_task(pool.alloc(1))
            await spin()
            gate.set()
            got, _ = await timed(waiter)
            assert got == [expect]
        threads = [t for t in threading.enumerate() if t.name.endswith(f"-stream-{s.key}")]
        assert len(threads) == 1  # one thread for the stream, not one per fence


async def test_a_row_freed_behind_an_older_fence_of_a_blocked_stream_is_served(
    kit: Streams,
) -> None:
    """Frees handed over out of record order: the stream's thread already
    blocks in the newer fence when the older one arrives. The row behind
    the older fence is granted as soon as that fence completes, with the
    newer still running (in the stream's queue it would wait for it)."""
    s = StandInCudaStream(kit)
    async with AsyncReqToTokenPool(3, 8) as pool:
        first, second = await pool.alloc(2)
        older, older_gate = s.record()
        newer, _ = s.record()  # never completes during the test
        pool.free([second], fence=newer)
        waiter = asyncio.create_task(pool.alloc(1))
        await spin()  # the pool hands the newer fence to the watcher on its loop
        assert await asyncio.to_thread(newer.event.entered.wait, WAIT_S)  # type: ignore[attr-defined]
        pool.free([first], fence=older)
        await spin()
        older_gate.set()
        got, _ = await timed(waiter)
        assert got == [first]
        pool.free(got)


async def test_an_idle_stream_thread_exits(kit: Streams, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(watcher_mod, "_STREAM_LINGER_S", 0.01)
    s = StandInCudaStream(kit)
    async with AsyncReqToTokenPool(3, 8) as pool:
        rows = await pool.alloc(1)
        fence, gate = s.record()
        pool.free(rows, fence=fence)
        watcher = pool._wakeups.watcher
        assert watcher is not None and watcher.running
        gate.set()
        await until(lambda: not watcher.running)
        # a later fence of the same stream starts a thread again
        rows = await pool.alloc(1)
        fence, gate = s.record()
        pool.free(rows, fence=fence)
        waiter = asyncio.create_task(pool.alloc(2))
        await spin()
        gate.set()
        got, _ = await timed(waiter)
        assert len(got) == 2
        pool.free(got)


async def test_a_faulting_fence_behind_a_stuck_one_still_quarantines(kit: Streams) -> None:
    """The fault is noticed by polling though a stuck fence was watched
    first; the waiter that can no longer fit fails without anyone calling in."""
    async with AsyncReqToTokenPool(3, 8) as pool:
        a, b = await pool.alloc(2)
        stuck, flaky = kit.event_fence(), kit.event_fence()
        flaky.error = FenceError("transfer failed")
        pool.free([a], fence=stuck)
        pool.free([b], fence=flaky)
        waiter = asyncio.create_task(pool.alloc(2))
        await spin()
        flaky.set()  # its query() now raises
        with pytest.raises(CapacityError):
            async with asyncio.timeout(PROMPT_S):
                await waiter
        st = pool.stats()
        assert st.quarantined == 1 and st.pending == 1 and st.fence_errors == 1


# ------------------------------------------------------------------ close / drain


async def test_close_with_a_stuck_unknown_fence_returns_promptly(kit: Streams) -> None:
    before = non_daemon_threads()
    pool = AsyncReqToTokenPool(3, 8)
    rows = await pool.alloc(2)
    stuck = kit.event_fence()
    pool.free(rows, fence=stuck)
    waiter = asyncio.create_task(pool.alloc(1))
    await spin()
    watcher = pool._wakeups.watcher
    assert watcher is not None and watcher.running
    async with asyncio.timeout(PROMPT_S):
        await pool.close()
    with pytest.raises(PoolClosedError):
        async with asyncio.timeout(WAIT_S):
            await waiter
    assert not watcher.running  # the poller was not inside the fence
    assert non_daemon_threads() <= before
    assert pool.pending_size() == 2  # still held: a late write may land
    stuck.set()
    async with asyncio.timeout(WAIT_S):
        await pool.drain()
    assert pool.available_size() == 2


async def test_close_with_a_stuck_cuda_fence_returns_promptly(kit: Streams) -> None:
    before = non_daemon_threads()
    s = StandInCudaStream(kit)
    pool = AsyncReqToTokenPool(3, 8)
    rows = await pool.alloc(2)
    fence, gate = s.record()
    pool.free(rows, fence=fence)
    entered = fence.event.entered  # type: ignore[attr-defined]
    await until(entered.is_set)  # the stream thread blocks in the event
    async with asyncio.timeout(PROMPT_S):
        await pool.close()
    stuck = [t for t in threading.enumerate() if t.name.endswith(f"-stream-{s.key}")]
    assert len(stuck) == 1 and stuck[0].daemon  # blocked in the event, keeps nothing alive
    assert non_daemon_threads() <= before
    gate.set()
    stuck[0].join(WAIT_S)
    assert not stuck[0].is_alive()  # stop() was seen once the event returned


async def test_drain_timeout_with_a_stuck_fence_changes_nothing(kit: Streams) -> None:
    async with AsyncReqToTokenPool(4, 8) as pool:
        rows = await pool.alloc(3)
        stuck = kit.event_fence()
        pool.free(rows[:2], fence=stuck)
        before = pool_snapshot(pool)
        threads = set(threading.enumerate())
        with pytest.raises(TimeoutError, match="2 rows still pending"):
            async with asyncio.timeout(WAIT_S):
                await pool.drain(timeout=0.02)
        assert pool_snapshot(pool) == before
        assert set(threading.enumerate()) <= threads  # no thread left blocked in it
        with pytest.raises(TimeoutError):
            await pool.drain(timeout=0)
        assert pool_snapshot(pool) == before
        for bad in (-1, float("nan"), "1", True):
            with pytest.raises(ValueError):
                await pool.drain(timeout=bad)  # type: ignore[arg-type]
            assert pool_snapshot(pool) == before
        d = asyncio.create_task(pool.drain(timeout=WAIT_S))
        await spin()
        stuck.set()
        async with asyncio.timeout(WAIT_S):
            await d
        assert pool.pending_size() == 0 and pool.available_size() == 2
        pool.free(rows[2:])


# ------------------------------------------------------------------ polling cost


async def test_the_poller_backs_off_while_100_fences_are_stuck(kit: Streams) -> None:
    """At most about one pass per millisecond (the backoff cap), not a spin."""
    async with AsyncReqToTokenPool(101, 8) as pool:
        rows = await pool.alloc(100)
        stuck = [kit.event_fence() for _ in rows]
        for row, fence in zip(rows, stuck, strict=True):
            pool.free([row], fence=fence)
        watcher = pool._wakeups.watcher
        assert watcher is not None and watcher.polled == 100
        p0, t0 = watcher.polls, time.perf_counter()
        # Measuring a rate over at least 0.1 s, not synchronising; on until
        # one pass is seen (a pass pre-empted for 5 ms backs off 100 ms).
        async with asyncio.timeout(WAIT_S):
            while True:
                await asyncio.sleep(0.1)
                if watcher.polls > p0:
                    break
        rate = (watcher.polls - p0) / (time.perf_counter() - t0)
        assert 0 < rate <= 1.2 / watcher_mod._POLL_MAX_S, rate
        for fence in stuck:
            fence.set()
        async with asyncio.timeout(WAIT_S):
            await pool.drain()
        await until(lambda: not watcher.polled)  # it forgets the completed fences


# ------------------------------------------------------------------ real CUDA events


@pytest.mark.cuda
async def test_cuda_a_busy_stream_does_not_delay_another_streams_wake_up() -> None:
    """Real events: stream X runs a long kernel, stream Y a short one; the
    waiter gets Y's row while X's event is still open, and close() returns
    without waiting for X."""
    import torch

    from asyncpool import record_fence

    x, y = torch.cuda.Stream(), torch.cuda.Stream()
    pool = AsyncReqToTokenPool(3, 8, device="cuda")
    try:
        a, b = await pool.alloc(2)
        with torch.cuda.stream(x):
            torch.cuda._sleep(4_000_000_000)  # seconds of GPU time
        fx = record_fence(x)
        with torch.cuda.stream(y):
            torch.cuda._sleep(1_000_000)
        fy = record_fence(y)
        pool.free([a], fence=fx)
        pool.free([b], fence=fy)
        got, _ = await timed(asyncio.ensure_future(pool.alloc(1)))
        assert got == [b]
        assert not fx.query()
        async with asyncio.timeout(PROMPT_S):
            await pool.close()
        assert not fx.query()  # close() did not wait for it
        pool.free(got)
    finally:
        await pool.close()
        x.synchronize()


class _CancellingFence:
    """A fence of unknown origin whose query() raises CancelledError while
    ``bad`` is set (and says so through ``asked``)."""

    def __init__(self) -> None:
        self.done = False
        self.bad = False
        self.asked = threading.Event()

    def query(self) -> bool:
        if self.bad:
            self.asked.set()
            raise asyncio.CancelledError
        return self.done

    def synchronize(self) -> None:
        pass


async def test_a_fence_raising_cancelled_error_does_not_end_the_poller(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The poller caught Exception only: a query() raising CancelledError
    ended the thread, and no fence of unknown origin woke anyone again."""
    caplog.set_level(logging.CRITICAL, logger="asyncpool")
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, _context: None)  # the reclaim's raise
    pool = AsyncReqToTokenPool(2, 4)
    bad = _CancellingFence()
    pool.free(await pool.alloc(1), bad)
    bad.bad = True
    assert await asyncio.to_thread(bad.asked.wait, WAIT_S)
    bad.bad = False
    pool.force_release(bad)
    good = _CancellingFence()
    pool.free(await pool.alloc(1), good)
    waiter = asyncio.ensure_future(pool.alloc(1))
    await spin()
    assert not waiter.done()
    good.done = True  # only the poller can notice
    async with bounded():
        assert await waiter == [1]
    await pool.close()


class _CancellingEvent(StandInEvent):
    def synchronize(self) -> None:
        self.entered.set()
        raise asyncio.CancelledError


def test_a_cuda_fence_raising_cancelled_error_does_not_end_its_stream_thread(
    kit: Streams,
) -> None:
    """The stream thread caught Exception only: a synchronize() raising
    CancelledError ended it, and later fences of the stream were never
    reported."""
    fired = threading.Semaphore(0)
    watcher = watcher_mod.FenceWatcher(fired.release)
    try:
        stream = StandInCudaStream(kit)
        gate = kit.event_fence().event
        bad = CudaFence(_CancellingEvent(gate), FAKE_DEVICE, stream.key, 1)  # type: ignore[arg-type]
        watcher.watch(bad)
        assert fired.acquire(timeout=WAIT_S)  # reported: the pool asks it and quarantines
        good, good_gate = stream.record()
        watcher.watch(good)
        good_gate.set()
        assert fired.acquire(timeout=WAIT_S)
    finally:
        watcher.stop()
