"""A wait's ``timeout=`` past the float range (an int such as ``10**400``).

It is a number >= 0, so the docs take it: it waits for ever. asyncio's
``call_later`` raised ``OverflowError`` for it after the waiter was queued,
so the call raised an untyped error and left a waiter nobody awaited, which
the grant loop then served: a row and its pages allocated to nobody, for
the pool's life (``release_memory`` refused for ever).
"""

from __future__ import annotations

import asyncio
from fractions import Fraction

import pytest
from helpers import bounded

from asyncpool import AsyncReqToTokenPool, KVPagePool
from asyncpool.base import check_timeout
from asyncpool.overdue import check_fence_timeout

HUGE = [10**400, Fraction(10**400)]


@pytest.mark.parametrize("timeout", HUGE, ids=["int", "fraction"])
async def test_a_queued_admit_with_a_timeout_past_the_float_range_waits(timeout: object) -> None:
    pool = AsyncReqToTokenPool(3, 64, kv=KVPagePool(9, 4))
    held = await pool.admit(pages=8)
    task = asyncio.ensure_future(pool.admit(pages=4, timeout=timeout))  # type: ignore[arg-type]
    await asyncio.sleep(0)
    assert not task.done()  # queued, not refused with an OverflowError
    assert pool.waiting() == 1
    pool.free([held.row])
    async with bounded():
        grant = await task
    assert len(grant.pages) == 4
    pool.free([grant.row])
    st = pool.stats()
    assert (st.allocated, st.pages_allocated, pool.waiting()) == (0, 0, 0)
    pool.check_invariants()
    async with bounded():
        await pool.close()


@pytest.mark.parametrize("timeout", HUGE, ids=["int", "fraction"])
async def test_a_cancelled_alloc_with_a_timeout_past_the_float_range_leaves_nothing(
    timeout: object,
) -> None:
    pool = AsyncReqToTokenPool(2, 4)
    rows = await pool.alloc(1)
    task = asyncio.ensure_future(pool.alloc(1, timeout=timeout))  # type: ignore[arg-type]
    await asyncio.sleep(0)
    assert pool.waiting() == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        async with bounded():
            await task
    pool.free(rows)
    await asyncio.sleep(0)
    assert (pool.allocated_size(), pool.waiting()) == (0, 0)
    pool.check_invariants()
    async with bounded():
        await pool.close()


def test_check_timeout_reads_a_timeout_past_the_float_range_as_for_ever() -> None:
    assert check_timeout(10**400) == float("inf")
    assert check_timeout(Fraction(10**400)) == float("inf")
    assert check_timeout(10**30) == 10**30  # an int in range: as it is
    with pytest.raises(ValueError, match="timeout"):
        check_timeout(-(10**400))
    with pytest.raises(ValueError, match="timeout"):
        check_timeout(Fraction(-(10**400)))


@pytest.mark.parametrize("value", [10**400, Fraction(10**400)], ids=["int", "fraction"])
def test_a_fence_timeout_past_the_float_range_is_a_value_error(value: object) -> None:
    with pytest.raises(ValueError, match="finite"):
        check_fence_timeout(value)
    with pytest.raises(ValueError, match="fence_timeout"):
        AsyncReqToTokenPool(4, 8, fence_timeout=value)  # type: ignore[arg-type]


def test_a_timer_the_loop_refuses_queues_no_waiter(monkeypatch: pytest.MonkeyPatch) -> None:
    """The timer is scheduled before the waiter is queued: a loop that
    refuses it (any error from ``call_later``) leaves no waiter behind. On a
    loop of its own, stock asyncio's: uvloop's ``call_later`` cannot be
    replaced on the instance."""
    loop = asyncio.new_event_loop()

    def refuse(*args: object, **kwargs: object) -> None:
        raise OverflowError("refused by the loop")

    async def body() -> None:
        pool = AsyncReqToTokenPool(3, 64, kv=KVPagePool(9, 4))
        held = await pool.admit(pages=8)
        with monkeypatch.context() as mp:
            mp.setattr(loop, "call_later", refuse)
            with pytest.raises(OverflowError, match="refused"):
                await pool.admit(pages=4, timeout=1.0)
            with pytest.raises(OverflowError, match="refused"):
                await pool.alloc(2, timeout=1.0)  # one row is free: it queues
        assert pool.waiting() == 0
        pool.free([held.row])
        st = pool.stats()
        assert (st.allocated, st.pages_allocated) == (0, 0)
        pool.check_invariants()
        async with bounded():
            await pool.close()

    try:
        loop.run_until_complete(body())
    finally:
        loop.close()
