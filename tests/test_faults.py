"""Faults: streams whose work raises, fences that raise, closing under load.

Each test checks that the fault is contained (rows behind it quarantined,
``FenceError`` surfaced in stats and logs), that the rest of the pool keeps
serving, and that nothing is left behind: no pending task, no never-awaited
coroutine (the suite runs with ``-W error``), no stream or watcher thread.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import uvloop
from helpers import bounded

from asyncpool import (
    AsyncReqToTokenPool,
    CapacityError,
    FenceError,
    HostFence,
    HostStream,
    PoolClosedError,
    ReqToTokenPool,
)

WATCHER = "asyncpool-fence-watcher"


class DeviceLost(RuntimeError):
    pass


def _boom() -> None:
    raise DeviceLost("illegal memory access (simulated)")


async def steps(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def fence_done(fence: HostFence) -> None:
    """Await a HostFence's completion or fault without blocking the loop."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()

    def settle() -> None:
        if not fut.done():
            fut.set_result(None)

    fence.add_done_callback(lambda: loop.call_soon_threadsafe(settle))
    async with asyncio.timeout(10):
        await fut
    await steps(2)  # the pool's own wake-up was scheduled before ours


async def until(cond: Callable[[], bool], what: str, timeout: float = 10) -> None:
    """Poll ``cond`` from the loop: for state a foreign thread (the watcher) changes."""
    for _ in range(int(timeout / 0.001)):
        if cond():
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"timed out waiting for {what}")


#: Threads alive when the running test started: another test's (a pool it
#: never closed keeps its watcher thread until the cycle collector runs).
_earlier_threads: set[threading.Thread] = set()


@pytest.fixture(autouse=True)
def _note_earlier_threads() -> None:
    _earlier_threads.clear()
    _earlier_threads.update(threading.enumerate())


def our_threads(*names: str) -> list[str]:
    """The named (and watcher) threads this test started that are alive."""
    wanted = {*names, WATCHER}
    return [
        t.name
        for t in threading.enumerate()
        if t.name in wanted and t.is_alive() and t not in _earlier_threads
    ]


def check_totals(pool: AsyncReqToTokenPool) -> None:
    pool.check_invariants()
    st = pool.stats()
    assert st.free + st.allocated + st.pending + st.quarantined == st.capacity


class ManualFence:
    """A fence of unknown origin, completed by the test."""

    def __init__(self) -> None:
        self.ev = threading.Event()

    def query(self) -> bool:
        return self.ev.is_set()

    def synchronize(self) -> None:
        self.ev.wait()


class FlakyFence:
    """Pending until ``break_()``; then ``query()`` and ``synchronize()`` raise."""

    def __init__(self, *, ordered: bool = False) -> None:
        self.broken = threading.Event()
        if ordered:  # looks like a fence that knows its stream
            self.stream_key = 987_654_321
            self.seq = 1

    def break_(self) -> None:
        self.broken.set()

    def query(self) -> bool:
        if self.broken.is_set():
            raise DeviceLost("query() on a lost device")
        return False

    def synchronize(self) -> None:
        self.broken.wait()
        raise DeviceLost("synchronize() on a lost device")


# --------------------------------------------------------------------------- stream work raises


async def test_work_that_raises_quarantines_rows_and_the_pool_keeps_serving(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="asyncpool")
    bad = HostStream("faulty-forward")
    good = HostStream("healthy-forward")
    pool = AsyncReqToTokenPool(9, 8)  # capacity 8
    gate_bad, gate_good = threading.Event(), threading.Event()
    try:
        async with bounded():
            doomed = await pool.alloc(3)
        bad.launch(gate_bad.wait)
        bad.launch(_boom)
        f_bad = bad.record()
        pool.record_use(doomed, f_bad)
        assert pool.free(doomed) == 0

        async with bounded():
            healthy = await pool.alloc(2)
        good.launch(gate_good.wait)
        f_good = good.record()
        pool.record_use(healthy, f_good)
        pool.free(healthy)

        # 3 free now; a waiter for 5 needs the healthy stream's 2 rows
        waiter = asyncio.create_task(pool.alloc(5))
        async with bounded():
            await steps()
        assert not waiter.done()
        assert pool.stats().pending == 5

        gate_bad.set()
        async with bounded():
            await fence_done(f_bad)
        st = pool.stats()
        assert st.quarantined == 3, st
        assert st.pending == 2
        assert st.fence_errors >= 1
        err = pool._ledger.last_fence_error
        assert isinstance(err, FenceError)
        assert isinstance(err.__cause__, DeviceLost)
        with pytest.raises(FenceError, match="faulted") as info:
            f_bad.query()
        assert isinstance(info.value.__cause__, DeviceLost)
        # says what to do: the stream stays faulted, record on a new one
        assert "sticky" in str(info.value) and "record on a new HostStream" in str(info.value)
        assert isinstance(bad.error, DeviceLost)
        # surfaced in the logs: the stream's fault and the quarantine
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert any("faulty-forward faulted" in r.getMessage() for r in errors), errors
        quarantine = [r for r in errors if "quarantined rows" in r.getMessage()]
        assert quarantine and all(str(r) in quarantine[0].getMessage() for r in doomed)
        assert not waiter.done()  # quarantined rows are never granted
        check_totals(pool)

        gate_good.set()
        async with asyncio.timeout(10):
            granted = await waiter
        assert len(granted) == 5 and not set(granted) & set(doomed)
        pool.free(granted)

        # the fault is sticky: later fences on the faulted stream fault too,
        # and a free behind one quarantines at once instead of raising
        async with bounded():
            one = await pool.alloc(1)
        late = bad.record()
        async with bounded():
            await fence_done(late)
        pool.record_use(one, late)
        assert pool.free(one) == 0
        assert pool.stats().quarantined == 4

        # the rest keeps serving, fast path and waits alike
        for _ in range(50):
            async with bounded():
                rows = await pool.alloc(4)
            pool.free(rows, after=good)
        async with asyncio.timeout(10):
            await pool.drain()  # quarantined rows are not waited for
        st = pool.stats()
        assert st.quarantined == 4 and st.pending == 0 and st.free == 4
        assert sorted(pool.try_alloc(4) or []) == sorted(set(range(1, 9)) - {*doomed, *one})
        check_totals(pool)
    finally:
        gate_bad.set()
        gate_good.set()
        async with bounded():
            await pool.close()
        bad.close()
        good.close()
    assert not our_threads("faulty-forward", "healthy-forward")


async def test_fault_fails_waiters_that_can_no_longer_fit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Quarantine shrinks what can ever be free: a head waiting for more than
    that would block its queue forever, so it fails; the rest is served."""
    caplog.set_level(logging.ERROR, logger="asyncpool")
    stream = HostStream("shrinking")
    pool = AsyncReqToTokenPool(5, 4)  # capacity 4
    gate = threading.Event()
    try:
        async with bounded():
            doomed = await pool.alloc(2)
        stream.launch(gate.wait)
        stream.launch(_boom)
        step = stream.record()
        pool.record_use(doomed, step)
        pool.free(doomed)
        async with bounded():
            held = await pool.alloc(2)
        big = asyncio.create_task(pool.alloc(4))  # the head: needs every row
        small = asyncio.create_task(pool.alloc(1, priority=1))  # behind it
        async with bounded():
            await steps()
        assert pool.waiting() == 2
        gate.set()
        async with bounded():
            await fence_done(step)
        assert pool.stats().quarantined == 2
        async with asyncio.timeout(10):
            with pytest.raises(CapacityError, match=r"4 rows.*quarantined"):
                await big
        pool.free(held)
        async with asyncio.timeout(10):
            got = await small
        assert got[0] in held
        with pytest.raises(CapacityError, match="3 rows"):
            async with bounded():
                await pool.alloc(3)  # can never fit now: refused at once, not queued
        assert pool.try_alloc(1) is not None
        check_totals(pool)
    finally:
        gate.set()
        async with bounded():
            await pool.close()
        stream.close()


async def test_faulted_stream_blocks_cross_stream_waits(caplog: pytest.LogCaptureFixture) -> None:
    """A stream that waits on a faulted fence faults too; its rows are quarantined."""
    caplog.set_level(logging.ERROR, logger="asyncpool")
    producer, consumer = HostStream("producer"), HostStream("consumer")
    pool = AsyncReqToTokenPool(5, 4)
    try:
        producer.launch(_boom)
        f = producer.record()
        consumer.wait(f)
        async with bounded():
            rows = await pool.alloc(2)
        pool.free(rows, after=consumer)
        async with asyncio.timeout(10):
            await pool.drain()
        assert pool.stats().quarantined == 2
        assert isinstance(consumer.error, FenceError)
        assert pool.stats().fence_errors >= 1
        async with bounded():
            assert sorted(await pool.alloc(2)) == [3, 4]
    finally:
        async with bounded():
            await pool.close()
        producer.close()
        consumer.close()


# --------------------------------------------------------------------------- fences that raise


async def test_fence_whose_query_raises_at_free(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="asyncpool")
    pool = AsyncReqToTokenPool(5, 4)
    try:
        async with bounded():
            rows = await pool.alloc(2)
        fence = FlakyFence()
        fence.break_()
        assert pool.free(rows, fence=fence) == 0  # no exception reaches the caller
        st = pool.stats()
        assert st.quarantined == 2 and st.pending == 0 and st.fence_errors >= 1
        assert isinstance(pool._ledger.last_fence_error, FenceError)
        assert any("quarantined" in r.getMessage() for r in caplog.records)
        # the same through record_use
        async with bounded():
            more = await pool.alloc(1)
        pool.record_use(more, fence)
        pool.free(more)
        assert pool.stats().quarantined == 3
        async with bounded():
            assert await pool.alloc(1) == [4]
        check_totals(pool)
    finally:
        async with bounded():
            await pool.close()


@pytest.mark.parametrize("kind", ["async", "sync"])
def test_force_release_of_a_faulted_fence_names_a_write_or_a_read(
    kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The line says why the rows stay quarantined without calling the
    fence's work a writer: a transfer that reads the pages (the prefill side
    of disaggregation, docs/cuda.md) faults too."""
    caplog.set_level(logging.WARNING, logger="asyncpool")
    pool = AsyncReqToTokenPool(5, 4) if kind == "async" else ReqToTokenPool(5, 4)
    rows = pool.try_alloc(2) if kind == "async" else pool.alloc(2)
    assert rows is not None
    fence = FlakyFence()
    fence.break_()
    pool.free(rows, fence=fence)
    assert pool.force_release(fence) == ((0, 0) if kind == "async" else 0)
    line = caplog.records[-1].getMessage()
    assert line.startswith(f"force_release({fence!r}): this fence faulted; the rows"), line
    assert "quarantined for good (its faulted work may still write or read them)" in line, line
    assert pool.stats().quarantined == 2  # and they stay so


@pytest.mark.parametrize("ordered", [False, True], ids=["unknown-origin", "ordered"])
async def test_fence_whose_query_raises_later(
    ordered: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Deferred behind a fence that then breaks: the watcher's wake-up quarantines."""
    caplog.set_level(logging.ERROR, logger="asyncpool")
    pool = AsyncReqToTokenPool(5, 4)
    fence = FlakyFence(ordered=ordered)
    ok = ManualFence()
    try:
        async with bounded():
            doomed = await pool.alloc(2)
        pool.free(doomed, fence=fence)
        async with bounded():
            other = await pool.alloc(2)
        pool.free(other, fence=ok)
        assert pool.stats().pending == 4
        waiter = asyncio.create_task(pool.alloc(2))
        async with bounded():
            await steps()
        assert not waiter.done()
        fence.break_()
        async with bounded():
            await until(lambda: pool.stats().quarantined == 2, "the broken fence's quarantine")
        assert pool.stats().fence_errors >= 1
        assert any("quarantined" in r.getMessage() for r in caplog.records)
        assert not waiter.done()
        ok.ev.set()
        async with asyncio.timeout(10):
            rows = await waiter
        assert sorted(rows) == sorted(other)
        pool.free(rows)
        async with asyncio.timeout(10):
            await pool.drain()
        check_totals(pool)
    finally:
        fence.break_()
        ok.ev.set()
        async with bounded():
            await pool.close()
    assert not our_threads()


# --------------------------------------------------------------------------- close under load


async def test_close_with_waiters_leases_and_pending_fences() -> None:
    stream = HostStream("close-under-load")
    gate = threading.Event()
    pool = AsyncReqToTokenPool(7, 4)  # capacity 6
    body_may_exit = asyncio.Event()
    in_body = asyncio.Event()
    lease_rows: list[int] = []

    async def leaseholder() -> None:
        async with pool.lease(2, after=stream) as rows:
            lease_rows.extend(rows)
            in_body.set()
            await body_may_exit.wait()

    try:
        holder = asyncio.create_task(leaseholder())
        async with asyncio.timeout(10):
            await in_body.wait()
        stream.launch(gate.wait)
        step = stream.record()
        async with bounded():
            pending = await pool.alloc(2)
        pool.record_use(pending, step)
        pool.free(pending)
        async with bounded():
            kept = await pool.alloc(2)  # held across close, freed after it
        waiters = [
            asyncio.create_task(pool.alloc(2)),
            asyncio.create_task(pool.alloc(1, priority=1)),
            asyncio.create_task(pool.alloc(1, timeout=60)),
        ]
        lease_waiter = asyncio.create_task(_lease_and_hold(pool))
        async with bounded():
            await steps()
        assert pool.waiting() == 4
        assert pool.try_alloc(1) is None

        async with bounded():
            await pool.close()
        async with asyncio.timeout(10):
            results = await asyncio.gather(*waiters, lease_waiter, return_exceptions=True)
        assert all(isinstance(r, PoolClosedError) for r in results), results
        st = pool.stats()
        assert st.closed and st.waiters == 0 and st.pending == 2 and st.allocated == 4
        with pytest.raises(PoolClosedError):
            async with bounded():
                await pool.alloc(1)
        with pytest.raises(PoolClosedError):
            pool.try_alloc(1)
        with pytest.raises(PoolClosedError):
            async with bounded(), pool.lease(1):
                pass
        async with bounded():
            await pool.close()  # idempotent

        # frees still work after close; the lease frees behind its stream
        pool.free(kept)
        body_may_exit.set()
        async with asyncio.timeout(10):
            await holder
        assert pool.stats().pending == 4  # 2 behind the step, 2 behind the lease's fence
        gate.set()
        async with asyncio.timeout(10):
            await pool.drain()
        st = pool.stats()
        assert st.free == 6 and st.allocated == 0 and st.pending == 0
        check_totals(pool)
    finally:
        gate.set()
        body_may_exit.set()
        async with bounded():
            await pool.close()
        stream.close()
    assert not our_threads("close-under-load")


async def _lease_and_hold(pool: AsyncReqToTokenPool) -> None:
    async with pool.lease(3):
        raise AssertionError("a lease was granted on a closed pool")


async def test_close_with_a_watched_fence_pending() -> None:
    """close() fails waiters at once and returns without waiting for the fence.

    The watcher polls the fence of unknown origin (it never blocks in its
    ``synchronize()``), so stopping it does not wait for the fence; the rows
    stay pending until ``drain()`` sees the fence complete. No watcher thread
    is left once ``close()`` returns.
    """
    pool = AsyncReqToTokenPool(3, 4)
    fence = ManualFence()
    try:
        async with bounded():
            rows = await pool.alloc(2)
        pool.free(rows, fence=fence)
        waiter = asyncio.create_task(pool.alloc(1))
        async with bounded():
            await steps()
        assert WATCHER in our_threads()
        closing = asyncio.create_task(pool.close())
        async with bounded():
            await steps()
        assert waiter.done()
        with pytest.raises(PoolClosedError):
            waiter.result()
        async with bounded():  # close() awaits its watcher's threads, not the fence
            await closing
        assert not fence.ev.is_set()
        assert not our_threads()
        assert pool.stats().pending == 2
        fence.ev.set()
        async with asyncio.timeout(10):
            await pool.drain()
        assert pool.stats().free == 2
    finally:
        fence.ev.set()
        async with bounded():
            await pool.close()
    assert not our_threads()


# --------------------------------------------------------------------------- loop shut down


RUNNERS: dict[str, Callable[[Coroutine[Any, Any, Any]], Any]] = {
    "asyncio": asyncio.run,
    "uvloop": uvloop.run,
}


@pytest.mark.parametrize("runner", sorted(RUNNERS))
def test_loop_shut_down_with_waiters(runner: str, caplog: pytest.LogCaptureFixture) -> None:
    """``asyncio.run`` returns while allocs, a lease, a drain and fences are pending.

    The run cancels the pending tasks; the pool dequeues them. Fences that
    complete after the loop closed find nobody to wake and say nothing. No
    "Task was destroyed but it is pending", no never-awaited coroutine, no
    thread left behind.
    """
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="asyncio")
    caplog.set_level(logging.DEBUG, logger="asyncpool")
    stream = HostStream("shutdown-forward")
    gate = threading.Event()
    manual = ManualFence()
    state: dict[str, Any] = {}

    async def main() -> AsyncReqToTokenPool:
        pool = AsyncReqToTokenPool(5, 4)  # capacity 4
        rows = await pool.alloc(2)
        stream.launch(gate.wait)
        pool.record_use(rows, stream.record())
        pool.free(rows)
        more = await pool.alloc(2)
        pool.free(more, fence=manual)  # a watched fence: the watcher thread runs
        tasks = [asyncio.create_task(pool.alloc(1)) for _ in range(3)]
        tasks.append(asyncio.create_task(pool.alloc(2, priority=-1, timeout=30)))
        tasks.append(asyncio.create_task(_use_lease(pool)))
        tasks.append(asyncio.create_task(pool.drain()))
        await steps()
        state["waiting"] = pool.waiting()
        state["tasks"] = tasks
        return pool  # the run cancels the rest

    pool = RUNNERS[runner](main())
    assert state["waiting"] == 5
    assert all(t.cancelled() for t in state["tasks"])
    assert pool.waiting() == 0
    pool.check_invariants()
    # completions after the loop closed: nobody to wake, no error
    gate.set()
    manual.ev.set()
    stream.synchronize()
    assert pool.reclaim() == 4
    assert pool.stats().free == 4
    # close the pool on a fresh loop: stops the watcher thread
    RUNNERS[runner](pool.close())
    stream.close()
    gc.collect()
    assert not our_threads("shutdown-forward")
    bad = [
        r.getMessage()
        for r in caplog.records
        if "destroyed but it is pending" in r.getMessage()
        or "never awaited" in r.getMessage()
        or "exception was never retrieved" in r.getMessage()
        or r.levelno >= logging.ERROR
    ]
    assert not bad, bad


async def _use_lease(pool: AsyncReqToTokenPool) -> None:
    async with pool.lease(4):
        raise AssertionError("granted while everything was pending")


# --------------------------------------------------------------------------- stream closed


async def test_host_stream_closed_with_work_queued_runs_it() -> None:
    stream = HostStream("close-runs-queued")
    pool = AsyncReqToTokenPool(5, 4)
    gate = threading.Event()
    ran: list[int] = []
    try:
        async with bounded():
            rows = await pool.alloc(2)
        stream.launch(gate.wait)
        stream.launch(ran.append, 1)
        fence = stream.record()
        pool.record_use(rows, fence)
        pool.free(rows)
        closer = asyncio.create_task(asyncio.to_thread(stream.close))
        async with bounded():
            await until(lambda: stream.closed, "close() to mark the stream closed")
        # close waits for the queued work: it must not finish while the gate
        # holds that work (given 10 ms in which a close that did not wait
        # would return).
        done, _ = await asyncio.wait({closer}, timeout=0.01)
        assert not done and ran == []
        gate.set()
        async with asyncio.timeout(10):
            await closer
        assert ran == [1] and fence.query() is True
        with pytest.raises(RuntimeError, match="closed"):
            stream.launch(ran.append, 2)
        with pytest.raises(RuntimeError, match="closed"):
            stream.record()
        # free(after=closed stream) refuses, changing nothing
        async with bounded():
            held = await pool.alloc(1)
        before = pool.stats()
        with pytest.raises(RuntimeError, match="closed"):
            pool.free(held, after=stream)
        assert pool.stats() == before
        pool.free(held)
        async with asyncio.timeout(10):
            await pool.drain()
        assert pool.stats().free == 4
        check_totals(pool)
    finally:
        gate.set()
        async with bounded():
            await pool.close()
        stream.close()
    assert not our_threads("close-runs-queued")


async def test_host_stream_closed_cancelling_pending_work(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="asyncpool")
    stream = HostStream("close-cancels-queued")
    pool = AsyncReqToTokenPool(5, 4)
    gate = threading.Event()
    started = threading.Event()
    ran: list[int] = []

    def gated() -> None:
        started.set()
        gate.wait()

    try:
        async with bounded():
            rows = await pool.alloc(2)
        stream.launch(gated)
        stream.launch(ran.append, 1)
        fence = stream.record()
        pool.record_use(rows, fence)
        pool.free(rows)
        waiter = asyncio.create_task(pool.alloc(3))
        async with bounded():
            await asyncio.to_thread(started.wait, 10)
        closer = asyncio.create_task(asyncio.to_thread(stream.close, cancel_pending=True))
        async with bounded():
            await until(lambda: stream.closed, "close() to mark the stream closed")
        gate.set()
        async with asyncio.timeout(10):
            await closer
        async with bounded():
            await steps()
        assert ran == []  # the queued work was dropped
        with pytest.raises(FenceError, match="closed with this fence queued"):
            fence.query()
        st = pool.stats()
        assert st.quarantined == 2 and st.pending == 0 and st.fence_errors >= 1
        assert any("quarantined" in r.getMessage() for r in caplog.records)
        # 2 rows can ever be free again: the waiter for 3 fails instead of hanging
        async with asyncio.timeout(10):
            with pytest.raises(CapacityError, match="3 rows") as info:
                await waiter
        assert "for the pool's life: a new pool is the way back" in str(info.value)
        async with bounded():
            assert sorted(await pool.alloc(2)) == [3, 4]
        check_totals(pool)
    finally:
        gate.set()
        async with bounded():
            await pool.close()
        stream.close()
    assert not our_threads("close-cancels-queued")


class _OddFence:
    """A fence of unknown origin whose ``query()`` answers what it is told."""

    def __init__(self, answer: Callable[[], Any], **attrs: Any) -> None:
        self._answer = answer
        self.__dict__.update(attrs)

    def query(self) -> Any:
        return self._answer()

    def synchronize(self) -> None:
        pass


def _raise_cancelled() -> None:
    raise asyncio.CancelledError


async def _async_query() -> bool:
    return False


def _odd_answer(answer: str) -> Callable[[], Any]:
    import numpy as np
    import torch

    return {
        "ndarray": lambda: np.array([False, True]),
        "tensor": lambda: torch.tensor([0, 1]),
        # Truthy, each of them: taken for "done" they freed at once memory a
        # transfer may still write (an async def query, a status word, a
        # status code such as SGLang's KVPoll.Transferring = 3).
        "coroutine": _async_query,
        "string": lambda: "PENDING",
        "status code": lambda: 3,
    }[answer]


@pytest.mark.parametrize("answer", ["ndarray", "tensor", "coroutine", "string", "status code"])
@pytest.mark.parametrize("how", ["fence=", "record_use"])
def test_a_fence_answering_without_a_truth_value_is_a_fault(
    answer: str, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    from asyncpool import KVPagePool, ReqToTokenPool

    caplog.set_level(logging.CRITICAL, logger="asyncpool")
    odd = _OddFence(_odd_answer(answer))
    pool = ReqToTokenPool(8, 4)
    rows = pool.alloc(3)
    assert rows is not None
    if how == "fence=":
        assert pool.free(rows, odd) == 0
    else:
        pool.record_use(rows, odd)
        assert pool.free(rows) == 0
    assert pool.stats().quarantined == 3  # not a raw error, no row stuck mid-call
    pool.check_invariants()
    kv = KVPagePool(8, 4)
    pages = kv.alloc(3)
    assert kv.free(pages, fence=odd) == 0 and kv.quarantined_size() == 3
    kv.check_invariants()


@pytest.mark.parametrize("answer", ["coroutine", "string", "status code"])
def test_a_fence_answering_odd_later_is_a_fault_at_reclaim(
    answer: str, caplog: pytest.LogCaptureFixture
) -> None:
    from asyncpool import ReqToTokenPool

    caplog.set_level(logging.CRITICAL, logger="asyncpool")
    answers: list[Callable[[], Any]] = [lambda: False]
    odd = _OddFence(lambda: answers[0]())
    pool = ReqToTokenPool(8, 4)
    rows = pool.alloc(3)
    assert rows is not None
    assert pool.free(rows, odd) == 0
    answers[0] = _odd_answer(answer)
    assert pool.reclaim() == 0  # not freed: quarantined
    assert pool.stats().quarantined == 3
    pool.check_invariants()


@pytest.mark.parametrize("answer", ["numpy bool", "int 1", "tensor", "one-element array"])
def test_yes_or_no_answers_of_other_types_are_understood(answer: str) -> None:
    import numpy as np
    import torch

    from asyncpool import ReqToTokenPool

    done: Any = {
        "numpy bool": np.True_,
        "int 1": 1,
        "tensor": torch.tensor(True),
        "one-element array": np.array([1]),
    }[answer]
    pool = ReqToTokenPool(8, 4)
    rows = pool.alloc(2)
    assert rows is not None
    assert pool.free(rows, _OddFence(lambda: done)) == 2  # done: free at once
    rows = pool.alloc(2)
    assert rows is not None
    assert pool.free(rows, _OddFence(lambda: 0 * done)) == 0  # not done: pending
    pool.check_invariants()


async def test_an_explicit_drain_takes_an_odd_answer_for_a_fault(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.CRITICAL, logger="asyncpool")

    pool = AsyncReqToTokenPool(4, 4, reclaim="explicit")
    pool.free(await pool.alloc(2), fence=_OddFence(_odd_answer("status code")))
    async with bounded():
        await pool.drain()
    assert (pool.stats().quarantined, pool.available_size()) == (2, 1)
    await pool.close()


def test_a_fence_class_is_not_a_fence() -> None:
    from asyncpool import ReqToTokenPool

    pool = ReqToTokenPool(8, 4)
    rows = pool.alloc(2)
    assert rows is not None
    with pytest.raises(TypeError):
        pool.free(rows, HostStream)  # the class, not a fence: was quarantined for good
    with pytest.raises(TypeError):
        pool.record_use(rows, HostFence)
    assert pool.free(rows) == 2
    pool.check_invariants()


async def test_a_fault_holding_pages_only_is_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from asyncpool import KVPagePool
    from asyncpool.metrics import PoolCollector

    caplog.set_level(logging.CRITICAL, logger="asyncpool")

    def failed() -> bool:
        raise RuntimeError("transfer failed")

    kv = KVPagePool(17, 4)
    pool = AsyncReqToTokenPool(3, 8, kv=kv)
    grant = await pool.admit(pages=4)
    pages = pool.detach_pages(grant.row)
    pool.free([grant.row])
    kv.free(pages, fence=_OddFence(failed))
    stats = pool.stats()
    assert (stats.pages_quarantined, stats.page_fence_errors, stats.fence_errors) == (4, 1, 0)
    families = {m.name: m for m in PoolCollector(pool, name="p").collect()}
    totals = [s.value for s in families["asyncpool_page_fence_errors"].samples]
    assert totals == [1]
    await pool.close()


def test_a_fence_raising_cancelled_error_leaves_the_ledger_whole() -> None:
    from asyncpool import ReqToTokenPool

    pool = ReqToTokenPool(8, 4)
    rows = pool.alloc(3)
    assert rows is not None
    with pytest.raises(asyncio.CancelledError):
        pool.free(rows, _OddFence(_raise_cancelled))
    assert [pool._ledger.state_of(r) for r in rows] == ["allocated"] * 3
    pool.check_invariants()
    # A use recorded before stays recorded: the row waits for it as before.
    stream = HostStream()
    try:
        gate = threading.Event()
        stream.launch(gate.wait)
        used = stream.record()
        pool.record_use(rows[:1], used)
        with pytest.raises(asyncio.CancelledError):
            pool.free(rows, _OddFence(_raise_cancelled))
        pool.check_invariants()
        assert pool.free(rows) == 2  # the used row waits for its fence
        gate.set()
        used.synchronize()
        assert pool.reclaim() == 1
    finally:
        stream.close()
    # reclaim: a batch behind a fence of unknown origin is kept, not dropped.
    rows = pool.alloc(2)
    assert rows is not None
    answers: list[Callable[[], Any]] = [lambda: False]
    odd = _OddFence(lambda: answers[0]())
    assert pool.free(rows, odd) == 0
    answers[0] = _raise_cancelled
    with pytest.raises(asyncio.CancelledError):
        pool.reclaim()
    pool.check_invariants()
    answers[0] = lambda: True
    assert pool.reclaim() == 2
    pool.check_invariants()


class _Switch:
    """A fence of unknown origin answering ``state``: True, False or "cancel"."""

    def __init__(self, state: Any = False) -> None:
        self.state = state

    def query(self) -> bool:
        if self.state == "cancel":
            self.state = False  # once
            raise asyncio.CancelledError
        return bool(self.state)

    def synchronize(self) -> None:
        pass


@pytest.mark.parametrize("head", ["ordered", "unordered", "force_release"])
def test_a_cancelled_query_of_a_second_fence_keeps_the_batch(head: str) -> None:
    """A batch waiting for two fences: its head completes (or is forced), and
    the other fence's query() raises CancelledError while the batch is out of
    its queue. It must wait as before, not vanish with its rows."""
    pool = AsyncReqToTokenPool(6, 4)  # used outside a loop: nothing binds
    rows = pool.try_alloc(2)
    assert rows is not None
    second = _Switch()
    stream = HostStream()
    try:
        gate = threading.Event()
        if head == "ordered":
            stream.launch(gate.wait)
            first: Any = stream.record()
        else:
            first = _Switch()
        pool.record_use(rows, first)
        assert pool.free(rows, second) == 0
        second.state = "cancel"
        with pytest.raises(asyncio.CancelledError):
            if head == "ordered":
                gate.set()
                first.synchronize()
                pool.reclaim()
            elif head == "unordered":
                first.state = True
                pool.reclaim()
            else:
                pool.force_release(first)
        pool.check_invariants()
        assert pool.pending_size() == 2
        second.state = True
        if head != "ordered":
            first.state = True
        assert pool.reclaim() == 2
        pool.check_invariants()
        assert pool.available_size() == 5
    finally:
        gate.set()
        stream.close()


async def test_a_cancelled_query_leaves_a_rows_pages_with_it() -> None:
    """free(rows, fence=t) on a pool with kv, t.query() raising CancelledError:
    the row keeps its pages (before: the record was cleared first and the
    pages were owned by nobody, leaked for good)."""
    from asyncpool import KVPagePool

    kv = KVPagePool(9, 4)
    pool = AsyncReqToTokenPool(3, 8, kv=kv)
    grant = await pool.admit(pages=4)
    with pytest.raises(asyncio.CancelledError):
        pool.free([grant.row], fence=_Switch("cancel"))
    assert pool.pages_of(grant.row).tolist() == grant.pages.tolist()
    pool.check_invariants()
    assert pool.free([grant.row]) == 1
    assert kv.available_size() == 8 and pool.stats().pages_allocated == 0
    pool.check_invariants()
    await pool.close()


def test_a_fence_with_a_stream_key_but_no_int_seq_is_of_unknown_origin() -> None:
    from asyncpool import ReqToTokenPool

    pool = ReqToTokenPool(8, 4)
    rows = pool.alloc(2)
    assert rows is not None
    done = {"a": False, "b": False, "c": False}
    a = _OddFence(lambda: done["a"], stream_key="s")
    b = _OddFence(lambda: done["b"], stream_key="s")
    c = _OddFence(lambda: done["c"], stream_key="s", seq=None)
    pool.record_use(rows, a)
    pool.record_use(rows, b)  # raised AttributeError before, rows left mid-call
    pool.record_use(rows, c)
    pool.check_invariants()
    assert pool.free(rows) == 0  # waits for all three: none is ordered
    done["a"] = done["b"] = True
    assert pool.reclaim() == 0
    done["c"] = True
    assert pool.reclaim() == 2
    pool.check_invariants()


def test_one_faulted_fence_counts_once_however_many_rows_wait_on_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from asyncpool import ReqToTokenPool

    caplog.set_level(logging.WARNING, logger="asyncpool")
    pool = ReqToTokenPool(8, 4)
    rows = pool.alloc(5)
    assert rows is not None
    open_use = _OddFence(lambda: False)
    pool.record_use(rows, open_use)  # two fences per row: the general path

    def fault() -> bool:
        raise DeviceLost("lost")

    assert pool.free(rows, _OddFence(fault)) == 0
    st = pool.stats()
    assert st.quarantined == 5 and st.fence_errors == 1
    assert len([r for r in caplog.records if "faulted" in r.getMessage()]) == 1
    pool.check_invariants()


async def test_stats_read_from_another_thread_add_up_and_never_raise() -> None:
    # The owner frees behind fences and reclaims while a thread reads
    # stats() (with the overdue scan): every snapshot adds up to capacity.
    # A guard on the whole, timing-dependent; the two tests below pin each
    # cause deterministically (a scan raising "dictionary changed size
    # during iteration", counts read a few operations apart).
    from asyncpool import KVPagePool

    pool = AsyncReqToTokenPool(17, 4, kv=KVPagePool(65, 4), fence_timeout=0.0001)
    stream = HostStream()
    stop = threading.Event()
    bad: list[str] = []

    def scrape() -> None:
        while not stop.is_set():
            try:
                st = pool.stats(summaries=False)
            except Exception as exc:  # pragma: no cover - the failure being guarded
                bad.append(repr(exc))
                return
            if st.free + st.allocated + st.pending + st.quarantined != st.capacity:
                bad.append(f"rows {st}")
            pages = st.pages_free + st.pages_allocated + st.pages_pending
            if pages + st.pages_quarantined != st.pages_capacity:
                bad.append(f"pages {st}")

    reader = threading.Thread(target=scrape, name="scraper")
    reader.start()
    try:
        for _ in range(200):
            # Each step bounded, not the 200 together: the scraper holds the
            # GIL for whole switch intervals, so on a loaded machine the run
            # takes seconds while no single step comes near the bound.
            async with bounded():
                grants = [await pool.admit(pages=2) for _ in range(8)]
                fence = stream.record()
                pool.free([g.row for g in grants], fence=fence)
                await asyncio.to_thread(fence.synchronize)
            pool.reclaim()
            if bad:
                break
    finally:
        stop.set()
        reader.join(5)
        stream.close()
        await pool.close()
    assert not bad, bad[:3]


def test_a_pending_scan_survives_the_owner_changing_the_queues() -> None:
    # stats() may scan pending batches from another thread: the scan works
    # on copies, so a stream queue appearing mid-scan cannot break it.
    from asyncpool import ReqToTokenPool

    pool = ReqToTokenPool(8, 4)
    a, b = HostStream(), HostStream()
    gates = [threading.Event(), threading.Event()]
    try:
        a.launch(gates[0].wait)
        b.launch(gates[1].wait)
        rows = pool.alloc(2)
        assert rows is not None
        pool.free(rows[:1], a.record())
        scan = pool._ledger._batches()
        next(scan)
        pool.free(rows[1:], b.record())  # a new stream queue, mid-scan
        assert list(scan) == []  # the copy taken when the scan began
    finally:
        for gate in gates:
            gate.set()
        a.close()
        b.close()


def test_stats_counts_add_up_by_construction(monkeypatch: pytest.MonkeyPatch) -> None:
    # allocated is derived from the same reads of free, pending and
    # quarantined, not read apart (a reader on another thread saw sums of
    # 63 and 67 for a capacity of 64).
    from asyncpool import ReqToTokenPool
    from asyncpool.ledger import SlotLedger

    pool = ReqToTokenPool(8, 4)
    assert pool.alloc(3) is not None
    monkeypatch.setattr(SlotLedger, "allocated", property(lambda self: -999))
    st = pool.stats()
    assert st.allocated == 3
    assert st.free + st.allocated + st.pending + st.quarantined == st.capacity


def test_a_faulted_batchs_log_line_converts_only_the_ids_it_shows() -> None:
    # The fault's log line names the first 16 ids; a batch of a million
    # pages must not be turned into a Python list to show them (it is done
    # on the loop, even with logging disabled).
    import numpy as np

    from asyncpool.deferral import _describe

    converted: list[int] = []

    class Part:
        def __init__(self, ids: Any) -> None:
            self.ids = ids

        def __getitem__(self, key: slice) -> Part:
            return Part(self.ids[key])

        def tolist(self) -> list[int]:
            converted.append(len(self.ids))
            return list(self.ids.tolist())

    big = np.arange(1, 1_000_001)
    text = _describe([Part(big[:3]), Part(big)], 1_000_003)
    assert text == ("[1, 2, 3, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, ...] (1000003 in all)")
    assert sum(converted) <= 17
    assert _describe([np.array([5, 6])], 2) == "[5, 6]"
    assert _describe([3, 4], 2) == "[3, 4]"
