"""Three edges a trial of holds, leases and queue limits found (each test
failed before its fix; every await is bounded, on both loops):

* ``max_waiters`` counted a waiter whose task was cancelled but had not run
  yet, so a caller that gave up on a request and queued its replacement in
  the same step was refused with ``PoolBusyError`` by nobody;
* a ``with`` block on a released ``GrantHold`` read as a hold and held
  nothing: the waiters it meant to keep back were granted inside it;
* a lease whose body freed one of its own rows and was then cancelled
  replaced the ``CancelledError`` with ``DoubleFreeError``, so the caller's
  ``asyncio.timeout`` saw an ordinary error instead of its expiry, and the
  task did not read as cancelled.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
from helpers import bounded

from asyncpool import AsyncReqToTokenPool, DoubleFreeError, KVPagePool, PoolBusyError


@pytest.mark.parametrize("kind", ["alloc", "admit"])
async def test_a_cancelled_waiter_does_not_count_against_max_waiters(kind: str) -> None:
    pool = AsyncReqToTokenPool(2, 8, kv=KVPagePool(5, 4), max_waiters=1)
    held = await pool.admit(pages=4)

    async def request() -> int:
        if kind == "alloc":
            return (await pool.alloc(1))[0]
        return (await pool.admit(pages=1)).row

    given_up = asyncio.ensure_future(request())
    await asyncio.sleep(0)  # queued
    given_up.cancel()  # its task has not run since: its waiter is still queued
    asyncio.get_running_loop().call_soon(pool.free, [held.row])  # after the unwind
    async with bounded():
        row = await request()  # queues now, before the cancelled task unwinds
    assert pool.stats().rejections == 0
    assert given_up.cancelled()
    assert (pool.waiting(), pool.stats().cancellations) == (0, 1)
    blocker = asyncio.ensure_future(request())  # the limit still holds for live waiters
    await asyncio.sleep(0)
    with pytest.raises(PoolBusyError):
        await pool.alloc(1)
    assert pool.stats().rejections == 1
    pool.free([row])
    async with bounded():
        pool.free([await blocker])
    assert (pool.allocated_size(), pool.waiting()) == (0, 0)
    pool.check_invariants()


async def test_a_released_hold_cannot_be_entered_again() -> None:
    pool = AsyncReqToTokenPool(3, 8)
    rows = await pool.alloc(2)
    hold = pool.hold_grants()
    with hold:
        pass
    waiter = asyncio.ensure_future(pool.alloc(2))
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="released"), hold:
        pass
    assert not pool.grants_held
    with pool.hold_grants():  # a new hold holds
        pool.free(rows)
        await asyncio.sleep(0)
        assert not waiter.done()
    async with bounded():
        assert sorted(await waiter) == sorted(rows)
    pool.check_invariants()


async def _lease_that_frees_a_row_then_waits(pool: AsyncReqToTokenPool) -> None:
    async with pool.lease(2) as rows:
        pool.free([rows[0]])
        await asyncio.Event().wait()  # cancelled here


async def test_a_cancelled_lease_body_stays_cancelled(caplog: pytest.LogCaptureFixture) -> None:
    pool = AsyncReqToTokenPool(4, 8)
    task = asyncio.ensure_future(_lease_that_frees_a_row_then_waits(pool))
    await asyncio.sleep(0)
    task.cancel()
    with caplog.at_level(logging.WARNING, logger="asyncpool"):
        async with bounded():
            with pytest.raises(asyncio.CancelledError) as caught:
                await task
    assert task.cancelled()
    notes = getattr(caught.value, "__notes__", [])
    assert len(notes) == 1 and "freed inside the lease body" in notes[0], notes
    assert any("lease exit while CancelledError" in r.getMessage() for r in caplog.records)
    assert pool.allocated_size() == 0  # the row it still owned was freed
    pool.check_invariants()


async def test_a_timeout_around_such_a_lease_reads_as_a_timeout() -> None:
    pool = AsyncReqToTokenPool(4, 8)
    with pytest.raises(TimeoutError):
        async with bounded(), asyncio.timeout(0.01):
            await _lease_that_frees_a_row_then_waits(pool)
    assert pool.allocated_size() == 0
    pool.check_invariants()


async def test_an_ordinary_error_in_the_body_still_becomes_the_double_free() -> None:
    pool = AsyncReqToTokenPool(4, 8)
    with pytest.raises(DoubleFreeError) as caught:
        async with pool.lease(2) as rows:
            pool.free([rows[0]])
            raise ValueError("the body failed")
    assert isinstance(caught.value.__context__, ValueError)
    assert pool.allocated_size() == 0
    pool.check_invariants()
