"""A disconnect storm: queued waiters cancelled in the middle of their queues.

Cancelling a queued waiter at either end of its priority's queue costs O(1)
(``tests/test_waiters.py``); one in the middle used to cost a search of its
queue (``deque.remove``), so a storm cancelling half of 16,000 queued
waiters at random searched for 0.7 s with the event loop stalled (the
priority-scheduler trial). Such a waiter is now left in place, *dead*: no
longer counted, dropped by the grant loop when it reaches it. These tests
pin that no search happens and that everything a caller sees (grant order,
``waiting()``, ``waiting_by_priority()``, ``queue_head()``, the fast paths,
``max_waiters``) is as if the waiter had been taken off at once.
"""

from __future__ import annotations

import asyncio
import collections
import random
import sys
from typing import Any

import pytest
from helpers import assert_pages_conserved, bounded

from asyncpool import AsyncReqToTokenPool, KVPagePool, PoolBusyError
from asyncpool.stats import Histogram
from asyncpool.waiters import WaiterQueues


class _Unsearchable(collections.deque[Any]):
    """A waiter queue that refuses to be searched."""

    def remove(self, value: Any) -> None:
        raise AssertionError("the waiter queue was searched for a cancelled waiter")


def _unsearchable(pool: AsyncReqToTokenPool) -> None:
    queues = pool._waiters._queues
    for prio in list(queues):
        queues[prio] = _Unsearchable(queues[prio])


async def _cancel(tasks: list[asyncio.Task[Any]]) -> None:
    for t in tasks:
        t.cancel()
    async with bounded():
        results = await asyncio.gather(*tasks, return_exceptions=True)
    for r in results:  # a search raised AssertionError in the task's handler
        assert isinstance(r, asyncio.CancelledError), r


async def test_cancelling_waiters_in_the_middle_searches_no_queue():
    async with AsyncReqToTokenPool(2, 16, kv=KVPagePool(9, 4)) as pool:  # one row
        held = await pool.admit(pages=8)
        tasks = [asyncio.create_task(pool.admit(pages=1, priority=i % 2)) for i in range(40)]
        await asyncio.sleep(0)
        _unsearchable(pool)
        middle = [t for i, t in enumerate(tasks) if 4 <= i < 36 and i % 3]
        await _cancel(middle)
        live = [t for t in tasks if t not in middle]
        assert pool.waiting() == len(live) == sum(pool.waiting_by_priority().values())
        pool._waiters.check_invariants()
        pool.free([held.row])
        order: list[asyncio.Task[Any]] = []
        for _ in live:  # one row: one grant at a time, priority 0 first, FIFO
            waiting = [t for t in live if t not in order]
            async with bounded():
                done, _pending = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            (t,) = done
            order.append(t)
            pool.free([t.result().row])
        expect = [t for t in live if tasks.index(t) % 2 == 0] + [
            t for t in live if tasks.index(t) % 2 == 1
        ]
        assert order == expect
        assert pool.waiting() == 0 and not pool._waiters._queues
        assert_pages_conserved(pool)


async def test_dead_waiters_ahead_do_not_delay_a_new_head_or_the_fast_path():
    async with AsyncReqToTokenPool(3, 16, kv=KVPagePool(9, 4)) as pool:
        held = await pool.admit(pages=6)  # 2 pages and 1 row free
        big = asyncio.create_task(pool.admit(pages=4, priority=1))  # blocked head
        small = [asyncio.create_task(pool.admit(pages=1, priority=0)) for _ in range(3)]
        async with bounded():
            first = await small[0]  # priority 0 first: served though big blocks
        assert not any(t.done() for t in small[1:]) and not big.done()
        tail = [asyncio.create_task(pool.admit(pages=1, priority=0)) for _ in range(2)]
        await asyncio.sleep(0)
        _unsearchable(pool)
        await _cancel(small[1:] + tail[:1])  # two in the middle of priority 0's queue
        pool.free([first.row])
        # The live priority-0 waiter behind the dead ones fits: served at
        # the loop's next turn, ahead of the blocked big one.
        async with bounded():
            got = await tail[1]
        assert not big.done()
        assert pool.queue_head().priority == 1 and pool.waiting() == 1
        pool.free([got.row, held.row])
        async with bounded():
            g = await big
        pool.free([g.row])
        assert pool.waiting() == 0 and not pool._waiters._queues
        g = await pool.admit(pages=8)  # nobody queued: the fast path again
        pool.free([g.row])
        assert_pages_conserved(pool)


async def test_dead_waiters_do_not_count_against_max_waiters():
    async with AsyncReqToTokenPool(2, 16, kv=KVPagePool(9, 4), max_waiters=5) as pool:
        held = await pool.admit(pages=8)
        tasks = [asyncio.create_task(pool.admit(pages=1)) for _ in range(5)]
        await asyncio.sleep(0)
        with pytest.raises(PoolBusyError):
            await pool.admit(pages=1)
        await _cancel(tasks[1:4])  # the middle: dead, uncounted
        more = [asyncio.create_task(pool.admit(pages=1)) for _ in range(3)]
        await asyncio.sleep(0)
        assert pool.waiting() == 5
        with pytest.raises(PoolBusyError):
            await pool.admit(pages=1)
        pool._waiters.check_invariants()
        pool.free([held.row])
        for t in [tasks[0], tasks[4], *more]:  # FIFO, the dead skipped
            async with bounded():
                g = await t
            pool.free([g.row])
        assert_pages_conserved(pool)


@pytest.mark.parametrize("seed", range(6))
async def test_random_storms_keep_fifo_and_the_counts(seed):
    """Random arrivals, frees and storms (cancels anywhere, some after the
    grant) against a shadow queue: each grant goes to the first live waiter
    of the most urgent priority, and the counts agree at every step."""
    rng = random.Random(seed)
    async with AsyncReqToTokenPool(5, 16, kv=KVPagePool(17, 4)) as pool:
        shadow: dict[int, list[asyncio.Task[Any]]] = {0: [], 1: [], 2: []}
        holding: list[Any] = []
        granted: list[tuple[int, int]] = []

        async def client(prio: int, k: int) -> Any:
            g = await pool.admit(pages=k, priority=prio)
            granted.append((prio, id(asyncio.current_task())))
            return g

        for _ in range(150):
            for _ in range(rng.randrange(4)):
                prio = rng.randrange(3)
                t = asyncio.create_task(client(prio, rng.choice([1, 2, 4])))
                shadow[prio].append(t)
            await asyncio.sleep(0)
            if holding and rng.random() < 0.6:
                pool.free([holding.pop(rng.randrange(len(holding))).row])
            if rng.random() < 0.2:
                queued = [t for q in shadow.values() for t in q]
                storm = [t for t in queued if rng.random() < 0.5]
                for t in storm:
                    t.cancel()
                await asyncio.gather(*storm, return_exceptions=True)
            await asyncio.sleep(0)
            for q in shadow.values():
                for t in [t for t in q if t.done()]:
                    q.remove(t)
                    if not t.cancelled():
                        holding.append(t.result())
            live = {p: len(q) for p, q in shadow.items() if q}
            assert pool.waiting_by_priority() == live
            assert pool.waiting() == sum(live.values())
            head = pool.queue_head()
            assert (head is None) == (not live)
            if head is not None:
                assert head.priority == min(live)
            pool.check_invariants()
        for t in [t for q in shadow.values() for t in q]:
            t.cancel()
        await asyncio.gather(*[t for q in shadow.values() for t in q], return_exceptions=True)
        for t in [t for q in shadow.values() for t in q if not t.cancelled()]:
            holding.append(t.result())
        for g in holding:
            pool.free([g.row])
        assert pool.waiting() == 0
        assert_pages_conserved(pool)


async def test_check_invariants_catches_each_corruption_of_the_dead():
    def describe(need: Any) -> tuple[str, str]:
        return f"alloc({need})", f"{need} rows"

    loop = asyncio.get_running_loop()
    queues = WaiterQueues(lambda need: None, lambda grant: None, describe)
    ws = [queues.enqueue(1, 0, None, loop, collections.deque(), Histogram())[0] for _ in range(3)]
    ws[1][1].cancel()
    queues._dequeue(ws[1], lazy=True)  # the middle one: dead, uncounted
    queues.check_invariants()
    assert queues.count == 2 and queues._dead == {ws[1][1]}
    queues.count += 1
    with pytest.raises(AssertionError, match=r"waiter count 3 != queued 2 \(besides 1 dead\)"):
        queues.check_invariants()
    queues.count -= 1
    stray: asyncio.Future[Any] = loop.create_future()
    stray.cancel()
    queues._dead.add(stray)
    queues.count -= 1  # the counts add up: the stray is not queued
    with pytest.raises(AssertionError, match="a dead waiter is not queued"):
        queues.check_invariants()
    queues._dead.discard(stray)
    queues.count += 1
    queues._gone.add(ws[0][1])
    with pytest.raises(AssertionError, match="a waiter taken off is still queued"):
        queues.check_invariants()
    queues._gone.clear()
    live = ws[0][1]
    queues._dead.add(live)
    queues.count -= 1
    with pytest.raises(AssertionError, match="a dead waiter's future is not cancelled"):
        queues.check_invariants()
    queues._dead.discard(live)
    queues.count += 1
    count = queues.count
    queues.count = 0
    queues._dead.add(ws[0][1])
    queues._dead.add(ws[2][1])
    ws[0][1].cancel()
    ws[2][1].cancel()
    with pytest.raises(AssertionError, match="only dead waiters are queued"):
        queues.check_invariants()
    queues._dead -= {ws[0][1], ws[2][1]}
    queues.count = count
    assert queues.drop_all() == 2 and not queues._dead and not queues._gone


async def test_dead_waiters_behind_a_blocked_head_stay_bounded():
    """Clients that queue and give up one after another behind a head that
    stays blocked each leave a dead waiter in the middle of the queue (a
    live one queued behind it). The grant loop never reaches them while the
    head blocks: they used to pile up without bound (20,000 cancels, 20,000
    dead, with 2 waiters queued). They are swept out once they outnumber
    the live, and the grant order is kept."""
    async with AsyncReqToTokenPool(2, 16) as pool:  # one row
        held = await pool.alloc(1)
        head = asyncio.create_task(pool.alloc(1))  # blocked while `held` is held
        prev = asyncio.create_task(pool.alloc(1))
        await asyncio.sleep(0)
        most = 0
        for _ in range(2000):
            nxt = asyncio.create_task(pool.alloc(1))
            await asyncio.sleep(0)
            await _cancel([prev])  # in the middle: `head` ahead, `nxt` behind
            prev = nxt
            queued = sum(len(q) for q in pool._waiters._queues.values())
            most = max(most, queued)
        assert pool.waiting() == 2
        assert most <= 2 * pool.waiting() + 64, most  # O(live), not O(cancels)
        assert not pool._waiters._gone
        pool.check_invariants()
        pool.free(held)
        async with bounded():
            first = await head
        pool.free(first)
        async with bounded():
            last = await prev
        pool.free(last)
        assert pool.waiting() == 0 and not pool._waiters._queues and not pool._waiters._dead


def _read_at_every_switch_point(setup: Any) -> list[Any]:
    """``setup()`` answers ``(owner, read)``: run ``owner()`` once per thread
    switch point k (a GIL build switches only at a call or a C call's
    return: a profile hook sees both), reading ``read()`` at the k-th as
    another thread could; return every read."""
    reads: list[Any] = []
    for at in range(1, 500):
        owner, read = setup()
        seen = 0

        def hook(frame: Any, event: str, arg: Any, at: int = at, read: Any = read) -> None:
            nonlocal seen
            if event in ("call", "c_return"):
                seen += 1
                if seen == at:
                    sys.setprofile(None)
                    reads.append(read())

        before = len(reads)
        sys.setprofile(hook)
        try:
            owner()
        finally:
            sys.setprofile(None)
        if len(reads) == before:
            return reads
    raise AssertionError("the sweep never ran out of switch points")


async def test_a_scrape_during_the_sweep_reads_the_oldest_live_waiter(monkeypatch):
    """``oldest_wait()`` is read from other threads (a metrics scrape) while
    the owner sweeps cancelled waiters out (the refusal path, and now the
    dead once they outnumber the live). The sweep used to empty a queue and
    refill it: a scrape between the two read 0.0 with waiters queued. It
    now puts the live in front first, so every read finds the oldest."""
    clock = [0.0]
    monkeypatch.setattr("asyncpool.waiters._perf_counter", lambda: clock[0])
    loop = asyncio.get_running_loop()

    def setup() -> Any:
        queues = WaiterQueues(lambda need: None, lambda grant: None, lambda need: ("x", "y"))
        ws = []
        for t in range(6):
            clock[0] = float(t)
            ws.append(queues.enqueue(1, 0, None, loop, collections.deque(), Histogram())[0])
        for i in (0, 2, 3):
            ws[i][1].cancel()  # cancelled, their tasks not unwound: swept
        clock[0] = 100.0
        return queues._drop_cancelled, queues.oldest_wait

    reads = _read_at_every_switch_point(setup)
    assert len(reads) > 5
    assert set(reads) == {99.0}, reads  # the oldest live waiter, queued at 1.0
