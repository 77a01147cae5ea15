"""``try_alloc`` / ``try_admit`` of a request that quarantine makes unfittable.

The awaited calls raise :class:`CapacityError` at once for a request that
can never fit because memory is quarantined behind faulted fences; the try
calls used to answer ``None`` instead, for ever: an opportunistic batch job
polling ``try_admit`` each scheduling pass retried a request that no free
could ever serve, with nothing telling it so. They raise the same error now,
even while others queue, and change nothing; a request that still fits is
served as before.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
from helpers import assert_pages_conserved, grouped_pool, pool_snapshot, until

from asyncpool import AsyncReqToTokenPool, CapacityError, KVPagePool


def _boom() -> None:
    raise RuntimeError("kernel fault")


async def _quarantine(kit, pool, row: int) -> None:
    """Free ``row`` behind a stream whose work faults, and wait for the fault."""
    stream = kit.stream()
    gate = kit.gate(stream)
    stream.launch(_boom)
    pool.free([row], after=stream)
    gate.open()
    await until(lambda: (pool.reclaim(), pool.stats().quarantined)[1] == 1)


async def test_try_admit_raises_for_pages_quarantine_makes_unfittable(kit, caplog):
    caplog.set_level(logging.CRITICAL, logger="asyncpool")
    async with AsyncReqToTokenPool(4, 16, kv=KVPagePool(9, 4)) as pool:
        g = await pool.admit(pages=3)
        await _quarantine(kit, pool, g.row)
        assert pool.stats().pages_quarantined == 3
        before = pool_snapshot(pool)
        with pytest.raises(CapacityError, match=r"6 pages.*only 5 of 8.*a new pool"):
            pool.try_admit(pages=6)
        assert pool_snapshot(pool) == before
        with pytest.raises(CapacityError, match=r"6 pages.*only 5 of 8"):
            await pool.admit(pages=6)  # the awaited call says the same
        got = pool.try_admit(pages=5)  # one that fits is served
        assert got is not None
        pool.free([got.row])
        assert_pages_conserved(pool)


async def test_try_alloc_raises_for_rows_quarantine_makes_unfittable(kit, caplog):
    caplog.set_level(logging.CRITICAL, logger="asyncpool")
    async with AsyncReqToTokenPool(4, 16) as pool:
        [row] = await pool.alloc(1)
        await _quarantine(kit, pool, row)
        before = pool_snapshot(pool)
        with pytest.raises(CapacityError, match=r"3 rows.*only 2 of 3.*a new pool"):
            pool.try_alloc(3)
        assert pool_snapshot(pool) == before
        rows = pool.try_alloc(2)
        assert rows is not None
        pool.free(rows)


async def test_try_admit_raises_for_an_unfittable_request_while_others_queue(kit, caplog):
    caplog.set_level(logging.CRITICAL, logger="asyncpool")
    async with AsyncReqToTokenPool(4, 16, kv=KVPagePool(9, 4)) as pool:
        g = await pool.admit(pages=3)
        await _quarantine(kit, pool, g.row)
        held = await pool.admit(pages=5)
        waiter = pool.admit(pages=1)
        task = asyncio.create_task(waiter)
        await asyncio.sleep(0)
        assert pool.waiting() == 1
        assert pool.try_admit(pages=1) is None  # fits some day: no queue jumping
        with pytest.raises(CapacityError):
            pool.try_admit(pages=6)  # never fits: said at once
        pool.free([held.row])
        got = await asyncio.wait_for(task, 5)
        pool.free([got.row])
        assert_pages_conserved(pool)


async def test_grouped_try_admit_raises_for_a_group_quarantine_makes_unfittable(kit, caplog):
    caplog.set_level(logging.CRITICAL, logger="asyncpool")
    async with grouped_pool(rows=3, swa=4, full=8) as pool:
        g = await pool.admit({"swa": 2, "full": 1})
        await _quarantine(kit, pool, g.row)
        before = pool_snapshot(pool)
        with pytest.raises(CapacityError, match=r"3 pages of KV group 'swa'.*only 2 of 4"):
            pool.try_admit({"swa": 3, "full": 1})
        assert pool_snapshot(pool) == before
        got = pool.try_admit({"swa": 2, "full": 7})
        assert got is not None
        pool.free([got.row])
