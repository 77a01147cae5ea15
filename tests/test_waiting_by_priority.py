"""``pool.waiting_by_priority()``: a tier's queue depth, live calls only.

A multi-tenant scheduler sheds load per tier (the free tier's queue full
must not refuse a paid request), and exports each tier's queue depth; the
pool counted every priority together (``waiting()``, ``max_waiters``, the
``asyncpool_waiting_requests`` gauge), and ``waiting()`` also counts a call
cancelled while queued until its task unwinds, so right after a disconnect
storm it read hundreds while ``queue_head()`` read None. The trial that
found it kept a shadow count per tier instead.
"""

from __future__ import annotations

import asyncio

import pytest
from helpers import assert_pages_conserved, bounded, in_thread

from asyncpool import AsyncReqToTokenPool, KVPagePool, WrongThreadError


async def test_counts_live_calls_per_priority_most_urgent_first():
    async with AsyncReqToTokenPool(3, 16, kv=KVPagePool(9, 4)) as pool:
        assert pool.waiting_by_priority() == {}
        held = await pool.admit(pages=8)
        prios = [3, -1, 10**30, 0, 3, -1, 3]
        tasks = [asyncio.create_task(pool.admit(pages=1, priority=p)) for p in prios]
        tasks.append(asyncio.create_task(pool.alloc(1, priority=0)))
        await asyncio.sleep(0)
        got = pool.waiting_by_priority()
        assert got == {-1: 2, 0: 2, 3: 3, 10**30: 1}
        assert list(got) == [-1, 0, 3, 10**30]  # most urgent first
        assert sum(got.values()) == pool.waiting() == 8
        # A disconnect storm: cancelled, not yet unwound. waiting() still
        # counts them (documented); the per-priority figure does not.
        for t in tasks[:3]:  # priorities 3, -1 and 10**30
            t.cancel()
        assert pool.waiting() == 8
        assert pool.waiting_by_priority() == {-1: 1, 0: 2, 3: 2}
        async with bounded():
            await asyncio.gather(*tasks[:3], return_exceptions=True)
        assert pool.waiting() == 5 == sum(pool.waiting_by_priority().values())
        for t in tasks[3:]:
            t.cancel()
        async with bounded():
            await asyncio.gather(*tasks[3:], return_exceptions=True)
        assert pool.waiting_by_priority() == {} and pool.waiting() == 0
        pool.free([held.row])
        assert_pages_conserved(pool)


async def test_a_read_that_changes_nothing_and_refuses_other_threads():
    async with AsyncReqToTokenPool(3, 16) as pool:
        rows = await pool.alloc(2)
        task = asyncio.create_task(pool.alloc(1, priority=5))
        await asyncio.sleep(0)
        with pytest.raises(WrongThreadError):
            in_thread(pool.waiting_by_priority)
        assert pool.waiting_by_priority() == {5: 1}
        assert pool.waiting_by_priority() == {5: 1}  # no waiter dropped or served
        pool.free(rows[:1])
        async with bounded():
            got = await task
        assert pool.waiting_by_priority() == {}
        pool.free(rows[1:] + got)
