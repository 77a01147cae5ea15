"""Gaps found by a mechanical mutation sweep of the rest of
``asyncpool/pool.py`` (``alloc``'s general path and inlined wait, loop and
thread binding, ``retire``/``agree``, leases, the views and ``stats``, the
overdue and fault hooks, the constructor; ``retire``/``agree`` and the
overdue and fault hooks are in ``asyncpool/fence_control.py`` since, the
views and ``stats`` in ``asyncpool/figures.py``).

Each test pins one behaviour that a generated mutant broke while every pool
test file that reaches the mutated line still passed:

* ``bind()`` in a loop in asyncio's debug mode closes the unchecked fast
  paths at once: the thread that owned the pool before, now foreign, has
  its ``alloc(1)`` refused with ``WrongThreadError`` instead of served
  unchecked;
* ``lease``'s default ``priority`` is 0: a lease queues after an earlier
  ``alloc(priority=0)`` and ahead of a later one;
* ``async with pool`` alone binds the pool to the calling thread (a call
  from another thread is then refused);
* a pool that moves to another loop with nothing pending drops the
  overdue-fence check left armed on the old loop, so a fence deferred on
  the new loop is checked (and reported once overdue) there;
* ``stats()`` of a pool with ``fence_timeout`` reports 0 overdue fences,
  rows and pages while rows, or pages, are pending behind a fence not yet
  overdue;
* a closed pool arms no overdue-fence check for a fence deferred by a
  ``free`` after ``close()``;
* ``retire`` and ``agree`` refuse a foreign thread (``agree`` before the
  collective), and ``agree`` refuses a ``reclaim="auto"`` pool, changing
  nothing;
* ``bind()`` outside any loop takes asyncio's debug mode from the
  environment (``PYTHONASYNCIODEBUG``): the unchecked fast paths stay
  closed, so a foreign ``alloc(1)`` is refused;
* ``max_waiters`` given as a numpy integer 0 is taken as 0 (nobody may
  queue), not refused;
* ``write`` writes ``req_to_token``;
* set-up code outside any loop can ``try_alloc`` and ``free`` one row (the
  checked one-row ``free`` reads the fast-path flag before any bind), and
  leaves the unchecked fast paths closed: the first ``alloc(1)`` made in a
  loop afterwards still binds the pool to its thread.

And one library defect that a surviving mutant of ``bind()`` led to (fixed
in ``force_release``): a fence deferred while the pool's loop was closed,
then given up on with ``force_release``, was still watched (polled for
ever) once the pool ran in a new loop.

Async tests run on asyncio and uvloop (conftest); every wait that could hang
is bounded.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
import torch
from helpers import FakeStream, bounded, in_thread, overdue_warnings, spin

from asyncpool import AsyncReqToTokenPool, KVPagePool, PoolBusyError, WrongThreadError


def test_bind_in_a_debug_loop_closes_the_fast_paths_at_once() -> None:
    pool = AsyncReqToTokenPool(4, 4)
    owner = asyncio.new_event_loop()
    owner.set_debug(False)  # the owner's loop is not in debug mode, even under PYTHONASYNCIODEBUG
    try:

        async def warm() -> list[int]:
            return await pool.alloc(1)  # the general path: opens the fast paths

        held = owner.run_until_complete(warm())
        assert pool._fast  # open, as the owner left it
        debug = asyncio.new_event_loop()
        debug.set_debug(True)

        def hand_over() -> None:
            async def bind_here() -> None:
                pool.bind()

            debug.run_until_complete(bind_here())

        try:
            in_thread(hand_over)
            # The old owner is foreign now, and the new loop is in debug
            # mode: every foreign call raises, alloc(1) included.
            with pytest.raises(WrongThreadError):
                owner.run_until_complete(pool.alloc(1))
            assert pool.available_size() == 2
            pool.bind()  # back to this thread (no loop runs here)
            pool.free(held)
        finally:
            debug.close()
    finally:
        owner.close()


async def test_lease_default_priority_is_priority_zero() -> None:
    async with bounded(), AsyncReqToTokenPool(3, 4) as pool:
        held = await pool.alloc(2)
        before = asyncio.ensure_future(pool.alloc(1, priority=0))
        await spin()
        lease = pool.lease(1)  # default priority
        leased = asyncio.ensure_future(lease.__aenter__())
        await spin()
        after = asyncio.ensure_future(pool.alloc(1, priority=0))
        await spin()
        assert pool.waiting() == 3
        pool.free([held[0]])
        assert await before == [held[0]]  # queued ahead of the lease
        pool.free([held[1]])
        assert await leased == [held[1]]  # queued ahead of `after`
        assert not after.done()
        await lease.__aexit__(None, None, None)
        assert await after == [held[1]]
        pool.free([held[0], held[1]])


async def test_entering_the_pool_binds_it_to_this_thread() -> None:
    pool = AsyncReqToTokenPool(3, 4)
    async with bounded(), pool:
        # No other call in the body: `async with` alone binds the pool, so a
        # call from another thread is refused.
        with pytest.raises(WrongThreadError):
            in_thread(lambda: pool.try_alloc(1))
        assert pool.available_size() == 2


def test_moving_loops_with_nothing_pending_forgets_the_old_overdue_check() -> None:
    pool = AsyncReqToTokenPool(4, 4, fence_timeout=0.05)
    overdue = pool._overdue
    assert overdue is not None
    stream = FakeStream()

    async def take() -> list[int]:
        return await pool.alloc(2)

    old = asyncio.new_event_loop()
    try:
        rows = old.run_until_complete(take())
        # Between runs of the pool's loop: the check is armed there, and is
        # still armed once the fence completed and its rows were reclaimed.
        pool.free(rows, fence=stream.record())
        stream.complete()
        assert pool.reclaim() == 2
        assert overdue.timer is not None

        async def elsewhere() -> None:
            with overdue_warnings() as seen:
                async with bounded():
                    await pool.drain()  # nothing pending: moves the pool here
                # A fence deferred now is checked, on this loop.
                pool.free(await pool.alloc(2), fence=stream.record())
                async with bounded():
                    await seen.wait()
            stream.complete()
            async with bounded():
                await pool.drain()
            await pool.close()

        asyncio.run(elsewhere())
    finally:
        old.close()


async def test_stats_count_no_overdue_rows_or_pages_while_none_is_overdue() -> None:
    stream = FakeStream()
    async with AsyncReqToTokenPool(4, 4, fence_timeout=60.0) as pool:
        assert pool.stats().overdue_rows == 0
        # Rows pending behind a fence that is not overdue yet.
        pool.free(await pool.alloc(2), fence=stream.record())
        stats = pool.stats()
        assert stats.pending == 2
        assert (stats.overdue_fences, stats.overdue_rows, stats.overdue_pages) == (0, 0, 0)
        stream.complete()
        async with bounded():
            await pool.drain()


async def test_stats_count_no_overdue_pages_while_none_is_overdue() -> None:
    stream = FakeStream()
    kv = KVPagePool(9, 4)  # 8 pages
    async with AsyncReqToTokenPool(4, 8, kv=kv, fence_timeout=60.0) as pool:
        grant = pool.try_admit(pages=2)
        assert grant is not None
        # Pages pending behind a fence that is not overdue yet.
        kv.free(pool.detach_pages(grant.row), fence=stream.record())
        stats = pool.stats()
        assert stats.pages_pending == 2
        assert (stats.overdue_fences, stats.overdue_rows, stats.overdue_pages) == (0, 0, 0)
        pool.free([grant.row])
        stream.complete()
        async with bounded():
            await pool.drain()


async def test_a_closed_pool_arms_no_overdue_check() -> None:
    stream = FakeStream()
    async with AsyncReqToTokenPool(4, 4, fence_timeout=60.0) as pool:
        rows = await pool.alloc(2)
        await pool.close()
        # free still works once closed; the fence it defers is not checked
        # for being overdue (close() cancelled the check, for good).
        pool.free(rows, fence=stream.record())
        assert pool.stats().pending == 2
        overdue = pool._overdue
        assert overdue is not None and overdue.timer is None
        stream.complete()
        async with bounded():
            await pool.drain()


def test_force_release_of_a_fence_deferred_while_no_loop_ran_stops_it_being_watched() -> None:
    """Found through a surviving mutant of bind(): a fence deferred after the
    pool's loop closed waits, unwatched, for the next loop; force_release()
    gives up on it, so that loop must not start polling it (the writer is
    dead: the poller would ask it for ever)."""
    pool = AsyncReqToTokenPool(4, 4)

    async def take() -> list[int]:
        return await pool.alloc(2)

    rows = asyncio.run(take())  # the pool's loop is closed now
    stream = FakeStream()
    fence = stream.record()
    pool.free(rows, fence=fence)
    assert pool.force_release(fence) == (2, 0)

    async def next_loop() -> None:
        async with bounded():
            await pool.drain()  # binds this loop, watches what was deferred
        watcher = pool._wakeups.watcher
        assert watcher is None or watcher.polled == 0
        assert pool.available_size() == 3
        await pool.close()

    asyncio.run(next_loop())


async def test_retire_refuses_a_foreign_thread() -> None:
    stream = FakeStream()
    async with AsyncReqToTokenPool(4, 4, reclaim="explicit") as pool:
        fence = stream.record()
        pool.free(await pool.alloc(2), fence=fence)
        stream.complete()
        with pytest.raises(WrongThreadError):
            in_thread(lambda: pool.retire(fence))
        assert pool.stats().pending == 2  # changed nothing
        assert pool.retire(fence) == (2, 0)


async def test_agree_refuses_a_foreign_thread_before_the_collective(group: Any) -> None:
    stream = FakeStream()
    async with AsyncReqToTokenPool(4, 4, reclaim="explicit") as pool:
        pool.free(await pool.alloc(2), fence=stream.record())
        stream.complete()
        with pytest.raises(WrongThreadError):
            in_thread(lambda: pool.agree(group))
        assert pool.stats().pending == 2  # changed nothing
        assert pool.agree(group) == (2, 0)


async def test_agree_refuses_an_auto_pool(group: Any) -> None:
    stream = FakeStream()
    async with AsyncReqToTokenPool(4, 4) as pool:
        pool.free(await pool.alloc(2), fence=stream.record())
        stream.complete()
        with pytest.raises(RuntimeError, match='reclaim="explicit"'):
            pool.agree(group)
        assert pool.stats().pending == 2  # changed nothing


def test_bind_outside_a_loop_reads_debug_mode_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PYTHONASYNCIODEBUG", "1")
    pool = AsyncReqToTokenPool(4, 4)
    pool.bind()  # no running loop: asyncio's debug mode is the environment's
    loop = asyncio.new_event_loop()
    try:
        held = loop.run_until_complete(pool.alloc(1))  # the owner's general path
        # Debug mode: the unchecked fast paths never open, so a foreign
        # alloc(1) is checked, and refused.
        with pytest.raises(WrongThreadError):
            in_thread(lambda: asyncio.run(pool.alloc(1)))
        assert pool.available_size() == 2
        pool.free(held)
        loop.run_until_complete(pool.close())
    finally:
        loop.close()


@pytest.mark.parametrize("zero", [np.int64(0), np.int32(0)])
async def test_max_waiters_of_a_numpy_zero_is_taken_as_zero(zero: Any) -> None:
    async with bounded(), AsyncReqToTokenPool(2, 4, max_waiters=zero) as pool:
        held = await pool.alloc(1)
        with pytest.raises(PoolBusyError):
            await pool.alloc(1)  # max_waiters=0: nobody may queue
        pool.free(held)


async def test_write_writes_the_token_table() -> None:
    async with AsyncReqToTokenPool(3, 4) as pool:
        (row,) = await pool.alloc(1)
        pool.write((row, slice(0, 3)), torch.tensor([7, 8, 9], dtype=torch.int32))
        assert pool.req_to_token[row, :3].tolist() == [7, 8, 9]
        pool.free([row])


def test_set_up_code_outside_a_loop_leaves_the_first_call_in_a_loop_to_bind() -> None:
    pool = AsyncReqToTokenPool(3, 4)
    rows = pool.try_alloc(1)  # no loop runs: nothing binds
    assert rows is not None
    assert pool.free(rows) == 1  # the checked one-row path, before any bind
    assert pool.available_size() == 2

    async def first_in_a_loop() -> None:
        held = await pool.alloc(1)  # the first call in a loop binds this thread
        with pytest.raises(WrongThreadError):
            in_thread(lambda: pool.try_alloc(1))
        pool.free(held)
        await pool.close()

    asyncio.run(first_in_a_loop())
