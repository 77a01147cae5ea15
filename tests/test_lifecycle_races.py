"""drain, release_memory and resume_memory against what else can happen
meanwhile: a force_release, a retire, a second release, a resume, a fence
that never completes. Found by an adversarial review; each test fails
without its fix. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import pytest
from helpers import EventFence, Gate, bounded, spin

from asyncpool import (
    AsyncReqToTokenPool,
    HostFence,
    HostStream,
    KVPagePool,
    PoolBusyError,
)


@pytest.fixture(autouse=True)
def _quiet(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.CRITICAL, logger="asyncpool")


def make(reclaim: str = "auto") -> AsyncReqToTokenPool:
    return AsyncReqToTokenPool(8, 16, kv=KVPagePool(16, 4, reclaim=reclaim), reclaim=reclaim)


@contextlib.asynccontextmanager
async def draining_release() -> AsyncIterator[tuple[AsyncReqToTokenPool, Gate, asyncio.Task[None]]]:
    """A pool whose ``release_memory()`` task drains behind one row freed
    behind a gated fence (nothing allocated); closed on exit."""
    stream = HostStream()
    gate = Gate(stream)
    pool = make()
    try:
        g = await pool.admit(pages=1)
        pool.free([g.row], fence=stream.record())
        release = asyncio.create_task(pool.release_memory())
        await spin()
        yield pool, gate, release
    finally:
        gate.open()
        stream.close()
        await pool.close()


@pytest.mark.parametrize("reclaim", ["auto", "explicit"])
async def test_drain_notices_a_force_release(reclaim: str) -> None:
    # drain used to wait only for the head HostFence's callback, which a
    # force_release never fires: it hung with nothing pending, in either mode.
    stream = HostStream()
    gate = Gate(stream)
    pool = make(reclaim=reclaim)
    try:
        g = await pool.admit(pages=2)
        stuck = stream.record()
        pool.free([g.row], fence=stuck)
        drain = asyncio.create_task(pool.drain())
        await spin()
        assert pool.force_release(stuck) == (1, 2)
        async with bounded():
            await drain
        assert pool.stats().pending == 0
    finally:
        gate.open()
        stream.close()
        await pool.close()


async def test_drains_that_give_up_leave_no_callback_on_a_stuck_fence() -> None:
    stream = HostStream()
    gate = Gate(stream)
    pool = make()
    try:
        rows = await pool.alloc(1)
        stuck = stream.record()
        assert isinstance(stuck, HostFence)
        pool.free(rows, fence=stuck)
        before = len(stuck._callbacks or ())
        for _ in range(50):
            with pytest.raises(TimeoutError, match="1 row still pending"):
                await pool.drain(timeout=0.001)
        assert len(stuck._callbacks or ()) == before
    finally:
        gate.open()
        stream.close()
        await pool.close()


def test_remove_done_callback() -> None:
    stream = HostStream()
    gate = Gate(stream)
    try:
        fence = stream.record()
        assert isinstance(fence, HostFence)
        ran: list[str] = []

        def first() -> None:
            ran.append("first")

        def second() -> None:
            ran.append("second")

        fence.add_done_callback(first)
        fence.add_done_callback(second)
        assert fence.remove_done_callback(first) is True
        assert fence.remove_done_callback(first) is False
        # Waiters wake before a fence's done-callbacks run; the worker runs
        # them before it settles the next fence, so wait on that one.
        behind = stream.record()
        gate.open()
        behind.synchronize()
        assert ran == ["second"]
        assert fence.remove_done_callback(second) is False  # settled: nothing waits
    finally:
        gate.open()
        stream.close()


async def test_resume_while_a_release_drains_is_refused() -> None:
    # A resume during the drain zeroed every table (running requests' too,
    # when a release could still start with rows allocated).
    async with draining_release() as (pool, gate, release):
        with pytest.raises(PoolBusyError, match="still draining"):
            await pool.resume_memory()
        assert not release.done()  # still draining
        gate.open()
        async with bounded():
            await release
        assert pool.released
        await pool.resume_memory()


async def test_release_with_memory_allocated_is_refused_at_once() -> None:
    """It drained first, with the pool gated: alloc waited with rows free,
    and behind a stuck fence the refusal never came."""
    stuck = EventFence()
    pool = make()
    try:
        live = await pool.admit(pages=2)
        pool.verified_lens[live.row] = 4
        other = await pool.admit(pages=1)
        pool.free([other.row], fence=stuck)  # never completes
        async with bounded():
            with pytest.raises(PoolBusyError, match="1 row is still allocated"):
                await pool.release_memory()
        assert not pool.released and int(pool.verified_lens[live.row]) == 4
        async with bounded():
            got = await pool.admit(pages=1)  # not gated
        pool.free([got.row, live.row])
        detached = pool.kv.alloc(2)  # pages only, held by the caller
        async with bounded():  # a drain first would hang behind the stuck fence
            with pytest.raises(PoolBusyError, match="2 KV pages"):
                await pool.release_memory()
        pool.kv.free(detached)
    finally:
        stuck.set()
        await pool.close()


@pytest.mark.parametrize("outcome", ["released", "refused"])
async def test_a_second_release_shares_the_first_ones_outcome(outcome: str) -> None:
    async with draining_release() as (pool, gate, first):
        # Pages taken meanwhile (kv.alloc bypasses the gate): the first
        # release refuses once drained.
        live = pool.kv.alloc(1) if outcome == "refused" else None
        second = asyncio.create_task(pool.release_memory())
        await spin()
        assert not second.done()  # it waits for the first
        gate.open()
        async with bounded():
            results = await asyncio.gather(first, second, return_exceptions=True)
        if outcome == "released":
            assert results == [None, None] and pool.released
            await pool.resume_memory()
        else:
            assert [type(r) for r in results] == [PoolBusyError, PoolBusyError]
            assert "did not release" in str(results[1]) and not pool.released
            assert live is not None
            pool.kv.free(live)
