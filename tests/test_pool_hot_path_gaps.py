"""Gaps found by hand-made mutation testing of the pool's hot paths.

Scope: ``alloc`` (its inlined one-row fast path and its slow path),
``try_alloc``, the grant loop's supply side (``_take_for_waiter``,
``_give_back``, ``_flush_resets``, ``_reclaim_both``), ``free``'s inlined
one-row path, ``record_use``, ``waiting``, and the ledger's input
conversions, ``check_n``, ``take``, ``take_unreset``, ``put_back`` and
``check_allocated``.

Each test pins one behaviour that the rest of the suite let a one-line
change break unnoticed. Every await that could hang is bounded.
"""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
import uvloop
from helpers import EventFence, bounded, pool_snapshot, spin, unfittable_apart

from asyncpool import (
    AsyncReqToTokenPool,
    CapacityError,
    InvalidSlotError,
    KVPagePool,
    PoolClosedError,
    ReqToTokenPoolInfo,
)
from asyncpool.ledger import SlotLedger


def make(size: int = 5, **kw: Any) -> AsyncReqToTokenPool:
    return AsyncReqToTokenPool(size, 8, **kw)


async def _open_fast_path(pool: AsyncReqToTokenPool) -> list[int]:
    """Bind ``pool`` and open its unchecked fast paths (a general alloc that
    succeeds reopens them); return the rows that alloc took."""
    held = await pool.alloc(2)
    assert pool._fast, "the fast paths did not open: the test would not exercise them"
    return held


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"priority": "high"}, TypeError),
        ({"priority": 1.5}, TypeError),
        ({"timeout": -1}, ValueError),
        ({"timeout": "soon"}, ValueError),
    ],
)
async def test_one_row_fast_alloc_validates_priority_and_timeout(
    kwargs: dict[str, Any], error: type[Exception]
) -> None:
    """``alloc(1, ...)`` with a bad ``priority`` or ``timeout`` raises, and
    allocates nothing, even when the one-row fast path is open and a clean
    row is free: the fast path is taken only for ``timeout=None`` and an
    int ``priority``, so the slow path validates them."""
    async with bounded(), make(5) as pool:
        held = await _open_fast_path(pool)
        before = pool_snapshot(pool)
        with pytest.raises(error):
            await pool.alloc(1, **kwargs)
        assert pool_snapshot(pool) == before
        pool.free(held)


async def test_one_row_fast_alloc_records_the_peak() -> None:
    """``stats().peak_allocated`` counts rows taken by ``alloc(1)``'s
    inlined fast path on the owner's thread (only a foreign thread's fast
    alloc may miss a peak, per the module docstring)."""
    async with bounded(), make(6) as pool:
        held = await _open_fast_path(pool)
        assert pool.stats().peak_allocated == 2
        for _ in range(3):
            assert pool._fast
            held += await pool.alloc(1)
        assert pool.stats().peak_allocated == 5
        pool.free(held)
        assert pool.stats().peak_allocated == 5


async def test_a_one_row_grant_records_the_peak() -> None:
    """A one-row grant to a waiter (the grant loop's inlined take) counts in
    ``stats().peak_allocated`` when it sets a new peak: here the queued row
    comes back from behind a fence while the other row is held."""
    async with bounded(), make(3) as pool:  # two rows
        first = await pool.alloc(1)
        assert pool.stats().peak_allocated == 1
        fence = EventFence()
        pool.free(first, fence)  # pending behind the fence
        other = await pool.alloc(1)  # the one free row
        waiter = asyncio.ensure_future(pool.alloc(1))
        await asyncio.sleep(0)
        assert pool.waiting() == 1
        assert pool.stats().peak_allocated == 1
        fence.set()  # the row comes back; the waiter gets it
        got = await waiter
        assert got == first
        assert pool.stats().peak_allocated == 2
        pool.free(got)
        pool.free(other)
        pool.check_invariants()


async def test_a_granted_timed_alloc_cancels_its_timer() -> None:
    """A timed ``alloc`` that queued and was granted cancels its timeout
    handle (``WaiterQueues.enqueue``'s contract): the loop does not keep the
    waiter (its future, the granted rows) alive until the timeout would
    have expired."""
    async with bounded(), make(2) as pool:  # one row
        held = await pool.alloc(1)
        task = asyncio.ensure_future(pool.alloc(1, timeout=3600))
        await asyncio.sleep(0)
        assert pool.waiting() == 1
        (queue,) = pool._waiters._queues.values()
        ref = weakref.ref(queue[0][1])  # the waiter's future
        del queue
        pool.free(held)
        got = await task
        del task
        gc.collect()
        assert ref() is None, "the granted waiter is still referenced (its timer is live)"
        pool.free(got)


async def test_alloc_of_more_than_capacity_reports_the_capacity() -> None:
    """``alloc(n)`` for ``n`` above the capacity raises :class:`CapacityError`
    at once naming the pool's capacity (``check_n``'s message), not the
    quarantine message of a need that can no longer fit; on a closed pool
    too, as ``try_alloc`` does (a bad ``n`` is refused before the state is
    looked at)."""
    async with bounded(), make(5) as pool:
        before = unfittable_apart(pool_snapshot(pool))
        with pytest.raises(CapacityError, match="the pool has only 4"):
            await pool.alloc(5)
        # counted as a call that can never be served; nothing else changes
        assert unfittable_apart(pool_snapshot(pool)) == ((1, {0: 1}), before[1])
    assert pool._closed
    with pytest.raises(CapacityError, match="the pool has only 4"):
        pool.try_alloc(5)
    with pytest.raises(CapacityError, match="the pool has only 4"):
        await pool.alloc(5)
    with pytest.raises(PoolClosedError):
        await pool.alloc(4)


@pytest.mark.parametrize("kind", ["sparse", "meta"])
async def test_rows_given_as_a_tensor_without_data_are_refused(kind: str) -> None:
    """``free`` and ``record_use`` refuse a 1-D row tensor whose values
    cannot be read (a sparse tensor raises ``RuntimeError`` from
    ``tolist()``, a meta one ``NotImplementedError``) with
    :class:`InvalidSlotError`, changing nothing."""
    if kind == "sparse":
        rows = torch.tensor([1, 2]).to_sparse()
    else:
        rows = torch.empty(2, dtype=torch.long, device="meta")
    async with bounded(), make(5) as pool:
        held = await pool.alloc(2)
        before = pool_snapshot(pool)
        with pytest.raises(InvalidSlotError, match="a tensor with data"):
            pool.free(rows)
        with pytest.raises(InvalidSlotError, match="a tensor with data"):
            pool.record_use(rows, EventFence())
        assert pool_snapshot(pool) == before
        pool.free(held)


@pytest.mark.parametrize("api", ["alloc", "admit"])
@pytest.mark.parametrize(
    "factory", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"]
)
def test_a_fence_deferred_after_the_loop_closed_wakes_a_waiter_on_the_next(
    factory: Callable[[], asyncio.AbstractEventLoop], api: str
) -> None:
    """A fence that starts holding a row (and, after ``admit``, its pages)
    while the pool's loop is closed and none runs is kept to be watched
    later. When another fence's free has already moved the pool to the next
    loop, an ``alloc`` or ``admit`` that queues there must still start
    watching the kept fence: its completion alone grants the waiter (nobody
    calls into the pool)."""
    pool = make(4, kv=KVPagePool(7, 1)) if api == "admit" else make(4)  # three rows

    async def one_row() -> int:
        if api == "admit":
            return (await pool.admit(pages=2)).row
        (row,) = await pool.alloc(1)
        return row

    async def three_rows() -> list[int]:
        return [await one_row() for _ in range(3)]

    first = factory()
    try:
        r1, r2, r3 = first.run_until_complete(three_rows())  # binds the first loop
    finally:
        first.close()
    kept = EventFence()
    pool.free([r1], kept)  # no loop runs, the pool's is closed: kept for later

    async def main() -> int:
        other = EventFence()
        pool.free([r2], other)  # moves the pool to this loop
        waiter = asyncio.ensure_future(one_row())
        await asyncio.sleep(0)
        assert pool.waiting() == 1
        kept.set()  # only the kept fence completes
        async with bounded():
            got = await waiter
        other.set()
        pool.free([got, r3])
        async with bounded():
            await pool.drain()
            await pool.close()
        return got

    second = factory()
    try:
        assert second.run_until_complete(main()) == r1
    finally:
        kept.set()
        second.close()
    pool.check_invariants()


def test_take_of_exactly_the_clean_rows_resets_nothing() -> None:
    """``SlotLedger.take(n)`` with ``n`` equal to the clean rows at the head
    of the free queue hands those out and calls ``on_reset`` for nobody: the
    dirty rows behind them are reset right before the first of them would
    be handed out (the class docstring), not before."""
    calls: list[list[int]] = []
    led = SlotLedger(5, on_reset=calls.append)  # rows 1..4, all clean
    first = led.take(2)
    assert first == [1, 2]
    assert led.free(first) == 2  # dirty now, behind the clean rows 3, 4
    assert led.take(2) == [3, 4]
    assert (calls, led.resets) == ([], 0)
    assert led.take(1) == [1]
    assert (calls, led.resets) == ([[1, 2]], 1)
    led.check_invariants()


async def test_a_checked_one_row_free_files_the_row_at_the_tail() -> None:
    """``free`` of one row on its checked path (the fast paths closed by a
    checked call, nobody waiting) files the row, dirty, at the tail of the
    free queue: the clean rows ahead of it are handed out first (the
    oldest-freed order), and the freed row, when its turn comes, reads zero."""
    async with bounded(), make(5) as pool:  # rows 1..4
        a, b = await pool.alloc(2)
        [c] = pool.try_alloc(1) or []  # a checked call: the fast paths close
        assert not pool._fast
        pool.set_req_pool_info(a, ReqToTokenPoolInfo(1, 2, torch.tensor([a, a], dtype=torch.int32)))
        assert pool.free([a]) == 1  # the checked one-row path
        [d] = await pool.alloc(1)
        assert d == 4  # the clean row ahead of the freed one
        assert _lens(pool, d) == (0, 0, 0)
        [e] = await pool.alloc(1)
        assert e == a
        assert _lens(pool, e) == (0, 0, 0)
        pool.free([b, c, d, e])
        pool.check_invariants()


def _lens(pool: AsyncReqToTokenPool, row: int) -> tuple[int, int, int]:
    return (
        int(pool.verified_lens[row]),
        int(pool.alloced_lens[row]),
        int(pool.alloced_lens_cpu[row]),
    )


async def test_one_row_fast_alloc_stamps_a_new_generation() -> None:
    """Each grant of ``alloc(1)``'s inlined fast path gets the next
    generation, as every other grant does (a lease tells a row it still owns
    from one freed in its body and granted again by it; the mutant left the
    row's old generation)."""
    async with bounded(), make(6) as pool:
        held = await _open_fast_path(pool)
        last = max(pool.generation(r) for r in held)
        for _ in range(3):
            assert pool._fast
            (row,) = await pool.alloc(1)
            assert pool.generation(row) == last + 1
            last += 1
            held.append(row)
        pool.free(held)


async def test_a_one_row_free_under_a_grant_hold_keeps_the_fast_paths_shut() -> None:
    """A checked ``free([row])`` reopens the unchecked fast paths only when
    the grant loop is not gated: under a ``hold_grants()`` hold the next
    ``alloc(1)`` queues, though a clean row is free (the mutant reopened
    them, and that alloc jumped the hold)."""
    async with bounded(), make(6) as pool:
        held = await _open_fast_path(pool)
        hold = pool.hold_grants()
        pool.free([held[0]])
        task = asyncio.ensure_future(pool.alloc(1))
        await spin()
        assert not task.done() and pool.waiting() == 1
        hold.release()
        rows = await task
        pool.free(rows + held[1:])


async def test_the_zero_wait_count_never_goes_down_between_scrapes() -> None:
    """A scrape from another thread may read ``_popped`` bumped before
    ``granted`` (a hand-out half done): its figure undercounts by one, and
    the count reported keeps the largest seen, so a counter built on it
    never goes down (the mutant reported the undercount). The interleaving
    is replayed here on one thread."""
    async with bounded(), make(6) as pool:
        held = await _open_fast_path(pool)
        held += await pool.alloc(1)  # inlined: a zero wait counted at stats time
        seen = pool.stats().alloc_calls
        assert seen == 2
        pool._ledger._popped += 1  # a grant loop's hand-out, half done
        try:
            assert pool.stats().alloc_calls == seen
        finally:
            pool._ledger._popped -= 1
        pool.free(held)
