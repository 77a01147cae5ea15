"""*A router over data-parallel replicas*: draining a replica while admissions
still queue on it (docs/api.md).

Found by a trial that drove the docs' recipes to tight memory against the
installed package (trialPress): the drain as the recipe wrote it (free every
running row, hand the requests back, ``await pool.drain()``, "then
``stats().allocated``, ``.pages_allocated`` read 0") ends with rows still
allocated whenever admissions queue on the replica (its scheduler's awaited
``admit`` when nothing runs, or the router's ``admit_threadsafe``): grant at
hand-over gives the rows and pages that the frees return, once the step in
flight completes, to those waiters. In the trial 257 of 278 drains ended so
(1,134 rows granted to queued admissions). Handing the queued admissions back
first (cancel them and await them: one granted at hand-over whose task had
not resumed gives its row and pages back when it does; one whose task already
returned its grant is freed with the running rows), then freeing, leaves
nothing allocated after the drain (0 of 549 drains on both loops). The pool
behaves as documented; these tests pin the recipe's order. Every await that
could hang is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator

from helpers import bounded, spin

from asyncpool import AsyncReqToTokenPool, Grant, HostStream, KVPagePool, record_fence


@contextlib.asynccontextmanager
async def replica_in_flight() -> AsyncIterator[
    tuple[AsyncReqToTokenPool, list[int], asyncio.Task[Grant], threading.Event]
]:
    """Two running requests (4 pages each of the pool's 8) in a step held in
    flight by the yielded gate, and one admission queued behind them. The gate
    is set and the stream closed on the way out, whatever the test did."""
    stream, gate = HostStream("forward"), threading.Event()
    try:
        pool = AsyncReqToTokenPool(4, 64, kv=KVPagePool(9, 4))
        rows = []
        for _ in range(2):
            async with bounded():
                rows.append((await pool.admit(pages=4)).row)
        stream.launch(gate.wait)  # the step in flight
        pool.record_use(rows, record_fence(stream))
        queued = asyncio.ensure_future(pool.admit(pages=4))
        await spin()
        assert not queued.done() and pool.waiting() == 1
        yield pool, rows, queued, gate
    finally:
        gate.set()
        stream.close()


async def test_drain_as_once_written_leaves_the_queued_admission_granted() -> None:
    async with replica_in_flight() as (pool, rows, queued, gate):
        for row in rows:  # free every running row, behind the step in flight
            pool.free(row)
        gate.set()
        async with bounded():
            await pool.drain(timeout=5)
        # Not 0: the step's completion granted the queued admission.
        stats = pool.stats()
        assert (stats.allocated, stats.pages_allocated) == (1, 4)
        async with bounded():
            grant = await queued
        pool.free(grant.row)
        await pool.close()


async def test_drain_after_handing_queued_admissions_back_leaves_nothing() -> None:
    async with replica_in_flight() as (pool, rows, queued, gate):
        # Hand the queued admissions back first: cancel them and await them.
        queued.cancel()
        async with bounded():
            (outcome,) = await asyncio.gather(queued, return_exceptions=True)
        assert isinstance(outcome, asyncio.CancelledError) and pool.waiting() == 0
        for row in rows:
            pool.free(row)
        gate.set()
        async with bounded():
            await pool.drain(timeout=5)
        stats = pool.stats()
        assert (stats.allocated, stats.pages_allocated, stats.pending) == (0, 0, 0)
        pool.check_invariants()
        await pool.close()


async def test_an_admission_granted_at_hand_over_is_handed_back_by_its_cancel() -> None:
    """A free earlier in the pass (a request that finished, no fence) grants the
    queued admission at once; its task has not resumed when the drain starts.
    Cancelled and awaited, it gives its row and pages back."""
    pool = AsyncReqToTokenPool(4, 64, kv=KVPagePool(9, 4))
    async with bounded():
        a = await pool.admit(pages=4)
        b = await pool.admit(pages=4)
    queued = asyncio.ensure_future(pool.admit(pages=4))
    await spin()
    pool.free(a.row)  # nothing ran on it: granted to the queued admission at once
    assert pool.waiting() == 0 and pool.stats().allocated == 2 and not queued.done()
    queued.cancel()
    async with bounded():
        (outcome,) = await asyncio.gather(queued, return_exceptions=True)
    assert isinstance(outcome, asyncio.CancelledError)
    pool.free(b.row)
    async with bounded():
        await pool.drain(timeout=5)
    stats = pool.stats()
    assert (stats.allocated, stats.pages_allocated) == (0, 0)
    await pool.close()


async def test_a_hold_keeps_the_queued_admission_queued_through_the_drain() -> None:
    """docs/api.md: a hold (``hold_grants()``) keeps the queued admissions
    queued instead: the drain ends with nothing allocated and the admission
    still waiting; released, it is granted."""
    async with replica_in_flight() as (pool, rows, queued, gate):
        with pool.hold_grants():
            for row in rows:
                pool.free(row)
            gate.set()
            async with bounded():
                await pool.drain(timeout=5)
            stats = pool.stats()
            assert (stats.allocated, stats.pages_allocated, stats.pending) == (0, 0, 0)
            assert pool.waiting() == 1 and not queued.done()
        async with bounded():
            grant = await queued  # the hold released: granted
        pool.free(grant.row)
        pool.check_invariants()
        await pool.close()
