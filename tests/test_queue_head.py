"""``pool.queue_head()``: the queued call the grant loop serves next.

The head blocks every call behind it; an engine watching for stalls reads
what it is (``alloc`` or ``admit``, rows and pages asked, priority), how
long it has queued, and what it lacks now (rows and pages beyond those free
and those pending behind fences, per KV group on a grouped pool), instead
of mirroring the FIFO itself. A read: it grants and reclaims nothing.

The waiter queues' clock (``asyncpool.waiters._perf_counter``, which stamps
a waiter when it queues and is read for ``waited_s``) is a
:class:`ManualClock` here, so waits are exact and move only by hand.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
import uvloop
from helpers import (
    EventFence,
    FakeStream,
    ManualClock,
    WarningsSeen,
    bounded,
    in_thread,
    kv_of,
    kv_snapshot,
    ledger_snapshot,
    queued_call,
    settled,
    spin,
)

import asyncpool.waiters
from asyncpool import (
    AsyncReqToTokenPool,
    KVPagePool,
    PoolClosedError,
    QueueHead,
    WrongThreadError,
)

T = TypeVar("T")


@pytest.fixture(autouse=True)
def clock(monkeypatch: pytest.MonkeyPatch) -> ManualClock:
    clock = ManualClock(100.0)
    monkeypatch.setattr(asyncpool.waiters, "_perf_counter", clock)
    return clock


def paged(rows: int = 4, pages: int = 8) -> AsyncReqToTokenPool:
    return AsyncReqToTokenPool(rows + 1, 64, kv=KVPagePool(pages + 1, 4))


def grouped(rows: int = 4, swa: int = 4, full: int = 8) -> AsyncReqToTokenPool:
    return AsyncReqToTokenPool(
        rows + 1, 64, kv={"swa": KVPagePool(swa + 1, 4), "full": KVPagePool(full + 1, 4)}
    )


async def test_nobody_waiting_is_none() -> None:
    async with bounded(), paged(rows=2, pages=4) as pool:
        assert pool.queue_head() is None
        g = await pool.admit(pages=4)  # everything taken, nobody waits
        assert pool.queue_head() is None
        pool.free([g.row])


async def test_an_alloc_head_on_a_rows_only_pool_counts_rows_free_and_pending() -> None:
    s = FakeStream()
    async with bounded(), AsyncReqToTokenPool(4, 8) as pool:
        rows = await pool.alloc(3)
        waiter = await queued_call(pool.alloc(2))
        head = pool.queue_head()
        assert head == QueueHead("alloc", 2, 0, 0, 0.0, 2, 0)
        pool.free(rows[:1], fence=s.record())  # on its way back: counted
        assert pool.queue_head() == QueueHead("alloc", 2, 0, 0, 0.0, 1, 0)
        pool.free(rows[1:2])  # free at once, and the other on its way back
        assert pool.queue_head() == QueueHead("alloc", 2, 0, 0, 0.0, 0, 0)
        s.complete()  # lacks nothing, waits for the reclaim
        pool.reclaim()
        got = await settled(waiter)
        assert len(got) == 2 and pool.queue_head() is None
        pool.free(got + rows[2:])


async def test_rows_behind_an_overdue_fence_are_not_on_their_way_back() -> None:
    """As for pages (``pages_short``): a row behind a fence past
    ``fence_timeout`` (a transfer whose peer died) is not coming back, so
    a stall watcher reads the head short of it (it read 0 short, waiting on
    nothing that would come). Before the fence is overdue it still counts."""
    stuck = EventFence()
    seen = WarningsSeen("is overdue")
    log = logging.getLogger("asyncpool")
    log.addHandler(seen)
    try:
        async with bounded(), AsyncReqToTokenPool(3, 8, fence_timeout=0.05) as pool:
            rows = await pool.alloc(2)  # both rows
            pool.free(rows[:1], fence=stuck)  # its transfer never lands
            waiter = await queued_call(pool.alloc(2))
            try:
                head = pool.queue_head()
                assert head is not None and head.rows_short == 1  # 1 pending: on its way
                await seen.event.wait()  # bounded above; nobody calls the pool meanwhile
                assert pool.stats().overdue_rows == 1
                head = pool.queue_head()
                assert head is not None and head.rows_short == 2
                pool.free(rows[1:])
                head = pool.queue_head()
                assert head is not None and head.rows_short == 1  # the stuck one
                assert pool.force_release(stuck) == (1, 0)  # the operator's escape hatch
                got = await settled(waiter)
                assert pool.queue_head() is None
                pool.free(got)
            finally:
                if not waiter.done():  # a failed assertion: leave no task behind
                    waiter.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await waiter
    finally:
        stuck.set()
        log.removeHandler(seen)


async def test_an_alloc_head_on_a_paged_pool_asks_no_pages() -> None:
    async with bounded(), paged(rows=1, pages=4) as pool:
        g = await pool.admit(pages=4)  # the only row and every page
        waiter = await queued_call(pool.alloc(1))
        assert pool.queue_head() == QueueHead("alloc", 1, 0, 0, 0.0, 1, 0)
        pool.free([g.row])
        pool.free(await settled(waiter))


async def test_an_admission_short_of_pages_counts_them_as_pages_short_does() -> None:
    s = FakeStream()
    async with bounded(), paged(rows=4, pages=8) as pool:
        kv = kv_of(pool)
        cached = await pool.admit(pages=6)
        held = pool.detach_pages(cached.row)  # the engine's cache holds 6
        pool.free([cached.row])
        waiter = await queued_call(pool.admit(pages=5, priority=3))  # 2 free
        assert pool.queue_head() == QueueHead("admit", 1, 5, 3, 0.0, 0, 3)
        kv.free(held[:2], fence=s.record())  # evicted behind a reader: pending
        head = pool.queue_head()
        assert head is not None and head.pages_short == 1 == pool.pages_short()
        s.complete()  # a read: completed but not reclaimed, it counts either way
        assert pool.queue_head() == head
        kv.free(held[2:3])  # the grant loop runs and serves the head
        got = await settled(waiter)
        assert pool.queue_head() is None
        pool.free([got.row])
        kv.free(held[3:])


async def test_an_admission_short_of_a_row_with_its_pages_free() -> None:
    s = FakeStream()
    async with bounded(), paged(rows=1, pages=8) as pool:
        g = await pool.admit(pages=1)  # the only row
        waiter = await queued_call(pool.admit(pages=2))  # 7 pages free
        assert pool.queue_head() == QueueHead("admit", 1, 2, 0, 0.0, 1, 0)
        assert pool.pages_short() == 0  # says nothing of the row it waits for
        pool.free([g.row], fence=s.record())  # the row on its way back
        assert pool.queue_head() == QueueHead("admit", 1, 2, 0, 0.0, 0, 0)
        s.complete()
        pool.reclaim()  # the row and its page come back: the head is served
        got = await settled(waiter)
        assert pool.queue_head() is None
        pool.free([got.row])


async def test_a_grouped_head_names_the_group_it_waits_for() -> None:
    async with bounded(), grouped(rows=3, swa=4, full=8) as pool:
        g = await pool.admit({"swa": 3, "full": 0})
        waiter = await queued_call(pool.admit({"swa": 3, "full": 2}))  # 1 swa page free
        head = pool.queue_head()
        assert head == QueueHead(
            "admit", 1, {"swa": 3, "full": 2}, 0, 0.0, 0, {"swa": 2, "full": 0}
        )
        assert head is not None
        assert list(head.pages) == list(head.pages_short) == ["swa", "full"]  # pool order
        for mapping in (head.pages, head.pages_short):
            with pytest.raises(TypeError):
                mapping["swa"] = 0  # type: ignore[index]
        assert pool.pages_short(group="swa") == 2 and pool.pages_short(group="full") == 0
        pool.free(g.row)
        got = await settled(waiter)
        assert pool.queue_head() is None
        pool.free(got.row)


async def test_an_alloc_head_on_a_grouped_pool_asks_no_page_of_any_group() -> None:
    async with bounded(), grouped(rows=1) as pool:
        g = await pool.admit({"swa": 1, "full": 1})
        waiter = await queued_call(pool.alloc(1))
        zero = {"swa": 0, "full": 0}
        assert pool.queue_head() == QueueHead("alloc", 1, zero, 0, 0.0, 1, zero)
        pool.free(g.row)
        pool.free(await settled(waiter))


async def test_the_more_urgent_call_is_the_head_and_a_cancelled_one_is_not() -> None:
    async with bounded(), paged(rows=4, pages=8) as pool:
        g = await pool.admit(pages=8)
        low = await queued_call(pool.admit(pages=2, priority=5))
        head = pool.queue_head()
        assert head is not None and (head.priority, head.pages) == (5, 2)
        # More urgent, and a row is free: served at the loop's next turn.
        pool.free(await settled(asyncio.ensure_future(pool.alloc(1, priority=-1))))
        assert pool.queue_head() == head
        high = await queued_call(pool.admit(pages=7, priority=0))
        assert pool.queue_head() == QueueHead("admit", 1, 7, 0, 0.0, 0, 7)
        high.cancel()  # done at once, still queued until its task unwinds
        assert pool.waiting() == 2 and pool.queue_head() == head
        await settled(high)
        assert pool.queue_head() == head
        low.cancel()
        await settled(low)
        assert pool.queue_head() is None
        pool.free([g.row])


async def test_waited_grows_from_when_the_call_queued(clock: ManualClock) -> None:
    async with bounded(), AsyncReqToTokenPool(2, 8) as pool:
        rows = await pool.alloc(1)
        clock.now += 7.0  # before it queues: not counted
        first = await queued_call(pool.alloc(1))
        clock.now += 1.5
        second = await queued_call(pool.alloc(1))
        head = pool.queue_head()
        assert head is not None and head.waited_s == 1.5
        clock.now += 2.25
        head = pool.queue_head()
        assert head is not None and head.waited_s == 3.75  # the first, still
        pool.free(rows)
        got = await settled(first)
        head = pool.queue_head()
        assert head is not None and head.waited_s == 2.25  # the second now
        pool.free(got)
        pool.free(await settled(second))


async def test_none_once_the_head_is_granted_cancelled_or_timed_out() -> None:
    async with bounded(), paged(rows=1, pages=4) as pool:
        g = await pool.admit(pages=1)
        for end in ("grant", "cancel", "timeout"):
            waiter = await queued_call(
                pool.admit(pages=1, timeout=0.01 if end == "timeout" else None)
            )
            assert pool.queue_head() is not None
            if end == "grant":
                pool.free([g.row])
            elif end == "cancel":
                waiter.cancel()
            got = await settled(waiter)
            assert pool.queue_head() is None and pool.waiting() == 0
            if end == "grant":
                g = got
            else:
                expected = asyncio.CancelledError if end == "cancel" else TimeoutError
                assert isinstance(got, expected)
        pool.free([g.row])


async def test_from_another_thread_it_is_refused() -> None:
    async with bounded(), paged(rows=1) as pool:
        g = await pool.admit(pages=1)
        waiter = await queued_call(pool.alloc(1))
        with pytest.raises(WrongThreadError):
            in_thread(pool.queue_head)
        assert pool.waiting() == 1
        pool.free([g.row])
        pool.free(await settled(waiter))


async def test_a_closed_pool_has_no_head() -> None:
    # Closing fails every waiter (PoolClosedError) and drops them from the
    # queue: None at once, before their tasks unwind, and after.
    pool = paged(rows=1)
    g = await pool.admit(pages=1)
    waiter = await queued_call(pool.alloc(1))
    assert pool.queue_head() is not None
    async with bounded():
        await pool.close()
    assert pool.queue_head() is None
    assert isinstance(await settled(waiter), PoolClosedError)
    assert pool.queue_head() is None and g.row == 1


async def test_a_read_changes_nothing_not_even_a_completed_fence() -> None:
    s = FakeStream()
    async with bounded(), paged(rows=2, pages=4) as pool:
        kv = kv_of(pool)
        g = await pool.admit(pages=4)
        waiter = await queued_call(pool.admit(pages=2))
        pool.free([g.row], fence=s.record())  # row and pages pending
        s.complete()  # done, not yet reclaimed: the head would fit after one

        def snapshot() -> tuple[Any, ...]:
            pool.check_invariants()
            return (
                ledger_snapshot(pool._ledger),
                kv_snapshot(kv),
                pool.waiting(),
                pool._waiters.needs(),
            )

        before = snapshot()
        head = pool.queue_head()
        assert head == QueueHead("admit", 1, 2, 0, 0.0, 0, 0)
        assert snapshot() == before and not waiter.done()
        assert kv.pending_size() == 4  # nothing reclaimed, nothing granted
        pool.reclaim()
        got = await settled(waiter)
        pool.free([got.row])


async def test_the_snapshot_is_frozen_and_its_own() -> None:
    async with bounded(), AsyncReqToTokenPool(2, 8) as pool:
        rows = await pool.alloc(1)
        waiter = await queued_call(pool.alloc(1))
        head = pool.queue_head()
        assert head is not None
        with pytest.raises(dataclasses.FrozenInstanceError):
            head.rows = 5  # type: ignore[misc]
        pool.free(rows)
        pool.free(await settled(waiter))
        assert head.call == "alloc" and head.rows_short == 1  # as it was read


@pytest.mark.parametrize("new_loop", [asyncio.new_event_loop, uvloop.new_event_loop])
def test_waiters_of_a_loop_closed_under_them_are_dropped_first(
    new_loop: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    # As pages_short(): a waiter whose event loop was closed (its run
    # returned with it queued) can never run; the head is not it.
    pool = paged(rows=2, pages=8)

    async def first() -> None:
        g = await pool.admit(pages=8)
        pool.detach_pages(g.row)
        pool.free([g.row])
        waiter = asyncio.ensure_future(pool.admit(pages=8))
        await spin()
        assert pool.queue_head() is not None and not waiter.done()

    async def second() -> None:
        assert pool.queue_head() is None and pool.waiting() == 0

    for step in (first, second):
        loop = new_loop()
        try:
            loop.run_until_complete(step())
        finally:
            loop.close()
