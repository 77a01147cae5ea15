"""``stats().oldest_wait_s`` and ``asyncpool_queue_oldest_wait_seconds``.

The wait histograms count a wait once it ends (the grant); a head stuck
for minutes shows nowhere until then. These figures are the age of the
oldest live waiter at the moment of the read (any priority), 0 when nobody
waits, readable from a scrape's thread with no lock.

The waiter queues' clock (``asyncpool.waiters._perf_counter``, which stamps
a waiter when it queues and is read for its wait) is a
:class:`ManualClock` in the tests that ask for ``clock``, so waits are exact
and move only by hand; no test sleeps to let time pass.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
import uvloop
from helpers import (
    WAIT_S,
    FakeStream,
    ManualClock,
    bounded,
    calling_from_a_thread,
    in_thread,
    queued_call,
    settled,
    spin,
)

import asyncpool.waiters
from asyncpool import AsyncReqToTokenPool, KVPagePool, PoolClosedError, ReqToTokenPool

prometheus_client = pytest.importorskip("prometheus_client")

from prometheus_client import CollectorRegistry  # noqa: E402

from asyncpool.metrics import PoolCollector  # noqa: E402

T = TypeVar("T")
GAUGE = "asyncpool_queue_oldest_wait_seconds"


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> ManualClock:
    clock = ManualClock(100.0)
    monkeypatch.setattr(asyncpool.waiters, "_perf_counter", clock)
    return clock


class Scraped:
    """A registry exporting one pool as ``pool="p"``; calling it reads the
    gauge as a scrape does (``stats(summaries=False)`` underneath)."""

    def __init__(self, pool: Any) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(PoolCollector(pool, name="p"))

    def __call__(self) -> float | None:
        value: float | None = self.registry.get_sample_value(GAUGE, {"pool": "p"})
        return value


async def test_nobody_waiting_reads_zero() -> None:
    pool = AsyncReqToTokenPool(3, 4)
    gauge = Scraped(pool)
    assert pool.stats().oldest_wait_s == 0.0 and gauge() == 0.0
    rows = await pool.alloc(2)  # every row held, nobody waits
    assert pool.stats().oldest_wait_s == 0.0 and gauge() == 0.0
    pool.free(rows)
    await pool.close()
    sync = ReqToTokenPool(3, 4)  # no queue at all
    assert sync.stats().oldest_wait_s == 0.0 and Scraped(sync)() == 0.0


async def test_a_stuck_waiter_reads_its_wait_and_it_grows_until_the_grant(
    clock: ManualClock,
) -> None:
    async with bounded(), AsyncReqToTokenPool(2, 4) as pool:
        gauge = Scraped(pool)
        rows = await pool.alloc(1)  # the only row
        waiter = await queued_call(pool.alloc(1))
        assert pool.stats().oldest_wait_s == 0.0  # queued at 100.0, read at 100.0
        clock.now = 102.5
        assert pool.stats().oldest_wait_s == 2.5 and gauge() == 2.5
        clock.now = 160.0  # a minute on: a stall no histogram has seen yet
        assert pool.stats().oldest_wait_s == 60.0 and gauge() == 60.0
        assert pool.stats().wait_histogram.count == 1  # only the first alloc
        # A scrape's thread reads the same, with no lock.
        assert in_thread(lambda: pool.stats(summaries=False).oldest_wait_s) == 60.0
        assert in_thread(gauge) == 60.0
        pool.free(rows)  # the grant
        got = await settled(waiter)
        assert pool.stats().oldest_wait_s == 0.0 and gauge() == 0.0
        pool.free(got)


async def test_the_oldest_of_any_priority_not_only_the_head(clock: ManualClock) -> None:
    async with bounded(), AsyncReqToTokenPool(2, 4) as pool:
        rows = await pool.alloc(1)
        low = await queued_call(pool.alloc(1, priority=5))  # queued at 100
        clock.now = 105.0
        high = await queued_call(pool.alloc(1, priority=0))  # the head, queued at 105
        clock.now = 106.0
        head = pool.queue_head()
        assert head is not None and (head.priority, head.waited_s) == (0, 1.0)
        assert pool.stats().oldest_wait_s == 6.0  # low has waited longer
        low.cancel()
        await settled(low)
        assert pool.stats().oldest_wait_s == 1.0
        pool.free(rows)
        pool.free(await settled(high))
        assert pool.stats().oldest_wait_s == 0.0


async def test_a_cancelled_waiter_stops_counting_before_it_unwinds(clock: ManualClock) -> None:
    async with bounded(), AsyncReqToTokenPool(2, 4) as pool:
        gauge = Scraped(pool)
        rows = await pool.alloc(1)
        first = await queued_call(pool.alloc(1))  # queued at 100
        clock.now = 103.0
        second = await queued_call(pool.alloc(1))  # queued at 103, behind it
        clock.now = 110.0
        assert pool.stats().oldest_wait_s == 10.0
        first.cancel()  # done at once; still queued until its task unwinds
        assert pool.waiting() == 2
        assert pool.stats().oldest_wait_s == 7.0 and gauge() == 7.0  # the one behind
        second.cancel()
        assert pool.waiting() == 2 and pool.stats().oldest_wait_s == 0.0 and gauge() == 0.0
        await settled(first)
        await settled(second)
        assert pool.waiting() == 0 and pool.stats().oldest_wait_s == 0.0
        pool.free(rows)


async def test_a_timed_out_waiter_reads_zero(clock: ManualClock) -> None:
    async with bounded(), AsyncReqToTokenPool(2, 4) as pool:
        gauge = Scraped(pool)
        rows = await pool.alloc(1)
        # The timer runs on the loop's own clock; the waits on the manual one.
        waiter = asyncio.ensure_future(pool.alloc(1, timeout=0.01))
        await spin()
        clock.now = 130.0
        assert waiter.done() or pool.stats().oldest_wait_s == 30.0
        assert isinstance(await settled(waiter), TimeoutError)
        assert pool.stats().oldest_wait_s == 0.0 and gauge() == 0.0
        pool.free(rows)


async def test_close_fails_the_waiters_and_reads_zero(clock: ManualClock) -> None:
    pool = AsyncReqToTokenPool(2, 4, kv=KVPagePool(5, 4))
    gauge = Scraped(pool)
    g = await pool.admit(pages=4)
    waiters = [await queued_call(pool.admit(pages=1)), await queued_call(pool.alloc(1, priority=3))]
    clock.now = 104.0
    assert pool.stats().oldest_wait_s == 4.0 and gauge() == 4.0
    await pool.close()
    for w in waiters:
        assert isinstance(await settled(w), PoolClosedError)
    assert pool.stats().oldest_wait_s == 0.0 and gauge() == 0.0
    pool.free([g.row])


@pytest.mark.parametrize("new_loop", [asyncio.new_event_loop, uvloop.new_event_loop])
def test_a_waiter_whose_loop_was_closed_under_it_does_not_count(
    clock: ManualClock, new_loop: Callable[[], asyncio.AbstractEventLoop]
) -> None:
    """A waiter of a loop closed under it can never resume: it stays queued
    until the pool's next call that looks at the queue drops it, and does
    not hold the figure up meanwhile."""
    pool = AsyncReqToTokenPool(2, 4)
    loop = new_loop()
    try:

        async def stuck() -> None:
            assert await pool.alloc(1)  # the only row
            await pool.alloc(1)  # waits for ever

        task = loop.create_task(stuck())
        for _ in range(5):
            loop.run_until_complete(asyncio.sleep(0))
        assert not task.done() and pool.waiting() == 1
        clock.now = 150.0
        assert pool.stats().oldest_wait_s == 50.0
    finally:
        loop.close()
    assert pool.waiting() == 1 and pool.stats().oldest_wait_s == 0.0


async def test_scrapes_from_another_thread_while_waiters_come_and_go() -> None:
    """A scrape's thread reads the figure while the owner queues, grants,
    cancels and times out waiters of several priorities: it never raises,
    and reads a finite figure >= 0, below the test's whole run; nobody
    waits at the end, and it reads 0. The real clock here."""
    async with AsyncReqToTokenPool(3, 4) as pool, asyncio.timeout(4 * WAIT_S):
        gauge = Scraped(pool)
        seen: list[float] = []
        t0 = asyncpool.waiters._perf_counter()

        def scrape() -> None:
            seen.append(pool.stats(summaries=False).oldest_wait_s)
            value = gauge()
            assert value is not None
            seen.append(value)

        with calling_from_a_thread(scrape):
            for i in range(200):
                held = await pool.alloc(2)
                waiters = [asyncio.ensure_future(pool.alloc(1, priority=p)) for p in (3, 1, 2, 1)]
                timed = asyncio.ensure_future(pool.alloc(2, priority=4, timeout=0.001))
                await asyncio.sleep(0)
                waiters[i % 4].cancel()
                pool.free(held[:1])  # one granted
                await asyncio.sleep(0)
                waiters[(i + 1) % 4].cancel()
                pool.free(held[1:])
                pending = {*waiters, timed}
                while pending:  # in grant order: each frees what it got
                    done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    for w in done:
                        if not w.cancelled() and w.exception() is None:
                            pool.free(w.result())
        elapsed = asyncpool.waiters._perf_counter() - t0
        assert seen
        assert all(math.isfinite(v) and 0.0 <= v <= elapsed for v in seen)
        assert pool.waiting() == 0 and pool.stats().oldest_wait_s == 0.0 and gauge() == 0.0


async def test_a_waiter_stuck_behind_a_fence_reads_its_wait(clock: ManualClock) -> None:
    """The rows are on their way back behind a fence that has not
    completed: the head waits, and the figure says for how long."""
    s = FakeStream()
    async with bounded(), AsyncReqToTokenPool(2, 4) as pool:
        rows = await pool.alloc(1)
        waiter = await queued_call(pool.alloc(1))
        pool.free(rows, fence=s.record())
        clock.now = 120.0
        assert pool.stats().oldest_wait_s == 20.0
        s.complete()
        pool.reclaim()
        pool.free(await settled(waiter))
        assert pool.stats().oldest_wait_s == 0.0
