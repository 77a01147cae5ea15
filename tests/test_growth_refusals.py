"""``stats().growth_refusals``: decode growth answered None, counted.

``extend`` and ``extend_rows`` never wait: when fewer pages are free than
asked (after reclaiming completed fences) they answer None and the
scheduler retracts a request. The pool counts those answers, so an
operator sees the retraction pressure without the engine's own figure.

* each None from ``extend``, ``extend_rows`` (one count for all rows, or one
  count per row) counts once; a growth that succeeds counts nothing;
* a call refused with an error (bad count, a row not allocated, a closed
  pool) counts nothing and changes nothing;
* a short growth that reclaimed completed fences still counts, and still
  serves the admissions those pages fit;
* the Prometheus collector exports the figure as
  ``asyncpool_growth_refusals_total``; a pool without ``kv`` reports 0.
"""

from __future__ import annotations

import asyncio

import pytest
from helpers import WAIT_S, counter_values, spin
from helpers import assert_pages_conserved as conserved

from asyncpool import (
    AsyncReqToTokenPool,
    CapacityError,
    InvalidSlotError,
    KVPagePool,
    PoolClosedError,
)
from asyncpool.metrics import PoolCollector


def make(rows: int = 4, pages: int = 8) -> AsyncReqToTokenPool:
    return AsyncReqToTokenPool(rows + 1, 64, kv=KVPagePool(pages + 1, 4))


async def test_each_short_growth_counts_once_and_a_granted_one_not_at_all() -> None:
    async with make(rows=3, pages=8) as pool:
        a = await pool.admit(pages=3)
        b = await pool.admit(pages=3)
        assert pool.stats().growth_refusals == 0
        assert pool.extend(a.row, 1) is not None  # 1 page left
        assert pool.stats().growth_refusals == 0
        assert pool.extend(a.row, 2) is None
        assert pool.stats().growth_refusals == 1
        assert pool.extend_rows([a.row, b.row], 1) is None
        assert pool.stats().growth_refusals == 2
        assert pool.extend_rows([a.row, b.row], [0, 2]) is None  # per-row counts
        assert pool.stats().growth_refusals == 3
        assert pool.extend_rows([a.row, b.row], [1, 0]) is not None
        st = pool.stats()
        assert st.growth_refusals == 3 and st.pages_free == 0
        pool.free([a.row, b.row])
        conserved(pool)


async def test_a_growth_refused_with_an_error_counts_nothing() -> None:
    async with make(rows=2, pages=4) as pool:
        g = await pool.admit(pages=4)
        before = pool.stats()
        with pytest.raises(CapacityError):
            pool.extend(g.row, 0)
        with pytest.raises(CapacityError):
            pool.extend_rows([g.row], 5)
        with pytest.raises(InvalidSlotError):
            pool.extend(2, 1)  # not allocated
        with pytest.raises(InvalidSlotError):
            pool.extend_rows([g.row, 2], [1, 1])
        after = pool.stats()
        assert after.growth_refusals == 0
        assert (after.pages_free, after.allocated) == (before.pages_free, before.allocated)
        await pool.close()
        with pytest.raises(PoolClosedError):
            pool.extend(g.row, 1)
        assert pool.stats().growth_refusals == 0
        pool.free(g.row)
        conserved(pool)


async def test_a_short_growth_that_reclaimed_counts_and_serves_the_admission(kit) -> None:
    stream = kit.stream()
    gate = kit.gate(stream)
    async with make(rows=3, pages=4) as pool:
        a = await pool.admit(pages=2)
        b = await pool.admit(pages=2)
        pool.free([b.row], after=stream)  # 2 pages pending, none free
        waiter = asyncio.create_task(pool.admit(pages=2))
        await spin()
        assert pool.waiting() == 1
        gate.open()
        stream.record().wait(WAIT_S)  # the fence completed; nobody told the pool yet
        assert pool.extend(a.row, 3) is None  # reclaims 2, still short of 3
        assert pool.stats().growth_refusals == 1
        async with asyncio.timeout(WAIT_S):
            got = await waiter  # the reclaimed pages went to the queued admission
        assert len(got.pages) == 2
        pool.free([a.row, got.row])
        conserved(pool)


async def test_the_collector_exports_growth_refusals() -> None:
    async with make(rows=2, pages=2) as pool, AsyncReqToTokenPool(3, 4) as rows_only:
        g = await pool.admit(pages=2)
        assert pool.extend(g.row, 1) is None
        assert pool.extend_rows([g.row], 1) is None
        exported = {}
        for name, subject in (("kv", pool), ("rows", rows_only)):
            collector = PoolCollector()
            collector.add(subject, name)
            exported[name] = counter_values(collector)["asyncpool_growth_refusals"]
        assert exported == {"kv": 2.0, "rows": 0.0}  # counter_values: counters only
        assert rows_only.stats().growth_refusals == 0
        pool.free(g.row)
        conserved(pool)
