"""The generic grant loop (asyncpool.waiters) on its own: order and supply."""

from __future__ import annotations

import asyncio
import collections
import contextlib
from typing import Any

from helpers import bounded

from asyncpool.stats import Histogram
from asyncpool.waiters import WaiterQueues


class Rows:
    """A supply of rows that records every take the grant loop makes."""

    def __init__(self) -> None:
        self.free: collections.deque[int] = collections.deque()
        self.takes: list[int] = []

    def take(self, n: int) -> list[int] | None:
        self.takes.append(n)
        if n > len(self.free):
            return None
        return [self.free.popleft() for _ in range(n)]

    def give_back(self, rows: list[int]) -> None:
        self.free.extendleft(reversed(rows))


def _describe(need: Any) -> tuple[str, str]:
    return f"alloc({need})", f"{need} rows"


async def _queue(queues: WaiterQueues, needs: list[int]) -> list[asyncio.Future[Any]]:
    loop = asyncio.get_running_loop()
    window: collections.deque[float] = collections.deque()
    return [queues.enqueue(n, 0, None, loop, window, Histogram())[0][1] for n in needs]


async def test_an_empty_supply_ends_the_loop_without_probing_the_next_head() -> None:
    rows = Rows()
    queues = WaiterQueues(rows.take, rows.give_back, _describe, supply=rows.free)
    async with bounded():
        futs = await _queue(queues, [1, 1])
        rows.free.append(7)
        queues.grant()
        assert rows.takes == [1]  # the second head was not probed
        assert futs[0].result() == [7] and not futs[1].done()
        rows.free.append(8)
        queues.grant()
        assert futs[1].result() == [8] and queues.count == 0


async def test_without_a_supply_the_loop_probes_until_the_head_does_not_fit() -> None:
    rows = Rows()
    queues = WaiterQueues(rows.take, rows.give_back, _describe)
    async with bounded():
        futs = await _queue(queues, [1, 1])
        rows.free.append(7)
        queues.grant()
        assert rows.takes == [1, 1]  # granted the head, probed the next
        assert futs[0].result() == [7] and not futs[1].done()


async def test_a_supply_left_after_a_grant_serves_the_next_waiters_in_order() -> None:
    rows = Rows()
    queues = WaiterQueues(rows.take, rows.give_back, _describe, supply=rows.free)
    async with bounded():
        futs = await _queue(queues, [2, 1, 3])
        rows.free.extend([1, 2, 3, 4])
        queues.grant()
        assert [f.result() for f in futs[:2]] == [[1, 2], [3]]
        assert not futs[2].done() and rows.takes == [2, 1, 3]


def _enqueue(queues: WaiterQueues, need: int, priority: int) -> asyncio.Future[Any]:
    loop = asyncio.get_running_loop()
    window: collections.deque[float] = collections.deque()
    return queues.enqueue(need, priority, None, loop, window, Histogram())[0][1]


async def test_a_new_head_runs_the_loop_at_the_next_turn_and_no_other_enqueue_does() -> None:
    """Only a request more urgent than every queued one schedules a grant
    pass (it may fit what is free); one queued behind others, at their
    priority or after, leaves the hot path alone: no take is probed."""
    rows = Rows()
    rows.free.append(7)
    queues = WaiterQueues(rows.take, rows.give_back, _describe, supply=rows.free)
    async with bounded():
        big = _enqueue(queues, 2, 0)  # the first waiter: the caller tried to take
        _enqueue(queues, 1, 0)
        _enqueue(queues, 1, 1)
        await asyncio.sleep(0)
        assert rows.takes == [] and not big.done()
        urgent = _enqueue(queues, 1, -1)
        assert rows.takes == []  # not at once: from the loop
        await asyncio.sleep(0)
        assert rows.takes == [1] and urgent.result() == [7] and not big.done()


async def test_a_new_head_granted_before_its_turn_runs_no_second_pass() -> None:
    """The scheduled pass does nothing once its waiter was served (the
    owner may have moved to another loop or thread since)."""
    rows = Rows()
    queues = WaiterQueues(rows.take, rows.give_back, _describe, supply=rows.free)
    async with bounded():
        _enqueue(queues, 2, 0)
        urgent = _enqueue(queues, 1, -1)
        rows.free.append(7)
        queues.grant()  # a free in the same turn serves it first
        assert urgent.result() == [7] and rows.takes == [1]
        await asyncio.sleep(0)
        assert rows.takes == [1]


class _Unsearchable(collections.deque[Any]):
    """A waiter queue that refuses to be searched: the end it takes from
    must be enough."""

    def remove(self, value: Any) -> None:
        raise AssertionError("the waiter queue was searched for a waiter at one of its ends")


async def test_a_waiter_at_either_end_of_its_queue_leaves_without_a_search() -> None:
    """Cancelling the newest waiter, or expiring the oldest (as a timeout
    common to every waiter does), costs O(1), not O(waiters): ``remove``
    walked the whole queue for the newest one (0.4 ms a cancel with
    16,384 queued). Through the pool: its cancel and expiry paths."""
    from asyncpool import AsyncReqToTokenPool

    async with bounded():
        pool = AsyncReqToTokenPool(2, 4, device="cpu")  # one row
        held = await pool.alloc(1)
        # Long enough that a loaded machine's stall before the cancel below
        # cannot expire it first (0.01 s did, 2 runs in 600 under load).
        oldest = asyncio.ensure_future(pool.alloc(1, timeout=0.5))
        middle = [asyncio.ensure_future(pool.alloc(1)) for _ in range(8)]
        newest = asyncio.ensure_future(pool.alloc(1))
        await asyncio.sleep(0)
        queues = pool._waiters._queues
        queues[0] = _Unsearchable(queues[0])
        newest.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await newest
        assert pool.waiting() == 9
        with contextlib.suppress(TimeoutError):
            await oldest
        assert oldest.exception() is not None and pool.waiting() == 8
        pool._waiters.check_invariants()
        pool.free(held)
        got = await middle[0]
        for task in middle[1:]:
            task.cancel()
        await asyncio.gather(*middle[1:], return_exceptions=True)
        assert pool.waiting() == 0
        pool.free(got)
        await pool.close()
