"""``try_alloc`` / ``try_admit`` with ``priority=``: only waiters of that
priority or a more urgent one hold the call back (it takes what an ``alloc``
or ``admit`` at that priority would be granted at once); without it, anyone
queued does. Bad priorities are typed errors that change nothing. Found by
the multi-tenant trial: a paid request tried from the scheduler's loop was
refused while only batch jobs queued. Every wait is bounded.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from helpers import bounded, spin

from asyncpool import AsyncReqToTokenPool, KVPagePool


def make() -> AsyncReqToTokenPool:
    return AsyncReqToTokenPool(5, 16, kv=KVPagePool(9, 4))  # 4 rows, 8 pages


async def test_try_alloc_passes_less_urgent_waiters_only() -> None:
    pool = AsyncReqToTokenPool(5, 16)
    try:
        held = pool.try_alloc(2)
        assert held is not None
        batch = asyncio.create_task(pool.alloc(4, priority=3))  # cannot fit yet
        await spin()
        assert pool.waiting() == 1
        assert pool.try_alloc(1) is None  # anyone queued holds it back
        assert pool.try_alloc(1, priority=3) is None  # same priority: FIFO
        assert pool.try_alloc(1, priority=7) is None  # less urgent
        got = pool.try_alloc(1, priority=np.int64(0))  # more urgent: takes it
        assert got is not None and pool.waiting() == 1
        pool.free(held + got)
        async with bounded():
            rows = await batch
        pool.free(rows)
        pool.check_invariants()
    finally:
        await pool.close()


async def test_try_admit_passes_less_urgent_waiters_only() -> None:
    pool = make()
    try:
        held = pool.try_admit(pages=6)
        assert held is not None
        batch = asyncio.create_task(pool.admit(pages=8, priority=2))
        await spin()
        assert pool.try_admit(pages=1) is None
        assert pool.try_admit(pages=1, priority=2) is None
        got = pool.try_admit(pages=2, priority=-1)
        assert got is not None and len(got.pages) == 2
        assert pool.try_admit(pages=1, priority=-1) is None  # does not fit: None
        pool.free([held.row, got.row])
        async with bounded():
            grant = await batch
        pool.free([grant.row])
        pool.check_invariants()
    finally:
        await pool.close()


async def test_grouped_try_admit_takes_a_priority() -> None:
    pool = AsyncReqToTokenPool(5, 16, kv={"full": KVPagePool(9, 4), "swa": KVPagePool(5, 4)})
    try:
        held = pool.try_admit({"full": 6, "swa": 1})
        assert held is not None
        batch = asyncio.create_task(pool.admit({"full": 8, "swa": 1}, priority=1))
        await spin()
        assert pool.try_admit({"full": 1, "swa": 1}) is None
        got = pool.try_admit({"full": 1, "swa": 1}, priority=0)
        assert got is not None
        pool.free([held.row, got.row])
        async with bounded():
            grant = await batch
        pool.free([grant.row])
    finally:
        await pool.close()


async def test_a_cancelled_urgent_waiter_does_not_hold_it_back() -> None:
    pool = AsyncReqToTokenPool(5, 16)
    try:
        held = pool.try_alloc(3)
        assert held is not None
        urgent = asyncio.create_task(pool.alloc(4, priority=0))
        await spin()
        urgent.cancel()  # its task has not unwound: still counted
        assert pool.waiting() == 1
        got = pool.try_alloc(1, priority=1)
        assert got is not None
        async with bounded():
            with pytest.raises(asyncio.CancelledError):
                await urgent
        pool.free(held + got)
        pool.check_invariants()
    finally:
        await pool.close()


async def test_held_grants_and_released_memory_still_refuse() -> None:
    pool = make()
    try:
        with pool.hold_grants():
            assert pool.try_alloc(1, priority=-100) is None
            assert pool.try_admit(pages=1, priority=-100) is None
        await pool.release_memory()
        assert pool.try_admit(pages=1, priority=-100) is None
        await pool.resume_memory()
        got = pool.try_admit(pages=1, priority=0)  # nobody queued: as before
        assert got is not None
        pool.free([got.row])
    finally:
        await pool.close()


@pytest.mark.parametrize("bad", [True, 1.0, "0", np.float64(0)])
async def test_a_bad_priority_is_a_type_error_that_changes_nothing(bad: object) -> None:
    pool = make()
    try:
        before = (pool.available_size(), pool.kv.available_size(), pool.waiting())
        with pytest.raises(TypeError, match="priority must be an int"):
            pool.try_alloc(1, priority=bad)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="priority must be an int"):
            pool.try_admit(pages=1, priority=bad)  # type: ignore[arg-type]
        assert (pool.available_size(), pool.kv.available_size(), pool.waiting()) == before
        pool.check_invariants()
    finally:
        await pool.close()
