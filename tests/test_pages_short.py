"""``pool.pages_short()``: how many pages the next queued waiter lacks.

The pool cannot evict an engine's prefix cache; an awaited admission short
of pages that only the cache holds waits until the engine evicts. This read
tells the engine how many to evict: the head's page count less the pages
free and those pending behind fences.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, TypeVar

import pytest
from helpers import (
    EventFence,
    FakeStream,
    WarningsSeen,
    bounded,
    in_thread,
    kv_of,
    queued_call,
    spin,
)

from asyncpool import AsyncReqToTokenPool, KVPagePool, WrongThreadError

T = TypeVar("T")


def paged(rows: int = 4, pages: int = 8) -> AsyncReqToTokenPool:
    return AsyncReqToTokenPool(rows + 1, 64, kv=KVPagePool(pages + 1, 4))


async def test_nobody_waiting_or_no_kv_means_nothing_short() -> None:
    async with bounded(), paged(rows=2, pages=4) as pool:
        g = await pool.admit(pages=4)  # every page taken, nobody waits
        assert pool.pages_short() == 0
        pool.free([g.row])
    async with bounded(), AsyncReqToTokenPool(3, 8) as rows_only:
        rows = await rows_only.alloc(2)
        waiter = await queued_call(rows_only.alloc(1))
        assert rows_only.pages_short() == 0
        rows_only.free(rows)
        rows_only.free(await waiter)


async def test_the_heads_pages_less_those_free_and_those_on_their_way_back() -> None:
    s = FakeStream()
    async with bounded(), paged(rows=4, pages=8) as pool:
        kv = kv_of(pool)
        cached = await pool.admit(pages=6)  # a finished request's pages...
        held = pool.detach_pages(cached.row)  # ...kept by the engine's cache
        pool.free([cached.row])
        waiter = await queued_call(pool.admit(pages=5))  # 2 free
        assert pool.pages_short() == 3
        kv.free(held[:2], fence=s.record())  # evicted behind a reader: pending
        assert pool.pages_short() == 1 and kv.pending_size() == 2
        s.complete()  # a read: it reclaims nothing, the pages count either way
        assert pool.pages_short() == 1
        kv.free(held[2:3])  # at once: the grant loop runs and serves the head
        async with bounded():
            g = await waiter
        assert pool.pages_short() == 0
        pool.free([g.row])
        kv.free(held[3:])


async def test_a_head_that_asks_rows_only_or_has_its_pages_counts_nothing() -> None:
    async with bounded(), paged(rows=1, pages=4) as pool:
        g = await pool.admit(pages=1)  # the only row
        alloc = await queued_call(pool.alloc(1))  # the head: rows only
        admit = await queued_call(pool.admit(pages=4))  # short of pages too
        assert pool.pages_short() == 0  # the head needs no pages
        alloc.cancel()  # its future is done at once, still queued until it runs
        assert pool.pages_short() == 1  # the admission is the next served
        await asyncio.gather(alloc, return_exceptions=True)
        assert pool.pages_short() == 1
        pool.free([g.row])  # the row and its page: the admission fits
        async with bounded():
            got = await admit
        pool.free([got.row])
        g = await pool.admit(pages=1)
        short_of_a_row = await queued_call(pool.admit(pages=2))  # 3 free
        assert pool.pages_short() == 0  # its pages are free: it waits for a row
        pool.free([g.row])
        async with bounded():
            got = await short_of_a_row
        pool.free([got.row])


async def test_a_more_urgent_admission_is_the_head() -> None:
    async with bounded(), paged(rows=4, pages=8) as pool:
        g = await pool.admit(pages=8)
        low = await queued_call(pool.admit(pages=2, priority=5))
        assert pool.pages_short() == 2
        high = await queued_call(pool.admit(pages=7, priority=0))
        assert pool.pages_short() == 7
        high.cancel()
        low.cancel()
        await asyncio.gather(high, low, return_exceptions=True)
        assert pool.pages_short() == 0
        pool.free([g.row])


async def test_evicting_what_it_says_serves_an_admission_the_cache_starves() -> None:
    # The engine's loop: a queued admit waits on pages only the cache holds;
    # the engine evicts pages_short() of them (behind their reader's fence)
    # and the admission is granted once that fence completes.
    s = FakeStream()
    async with bounded(), paged(rows=2, pages=8) as pool:
        kv = kv_of(pool)
        g = await pool.admit(pages=8)
        cache = list(pool.detach_pages(g.row).tolist())  # all 8 pages cached
        pool.free([g.row])
        reader = s.record()  # the newest step that read the cached pages
        waiter = await queued_call(pool.admit(pages=3))
        short = pool.pages_short()
        assert short == 3
        evicted, cache = cache[:short], cache[short:]
        kv.free(evicted, fence=reader)
        assert pool.pages_short() == 0  # on their way back: evict no more
        s.complete()
        kv.reclaim()  # (or the pool's wake-up, once the watcher sees it)
        async with bounded():
            got = await waiter
        assert sorted(got.pages.tolist()) == sorted(evicted)
        assert len(cache) == 5  # the rest of the cache kept
        pool.free([got.row])
        kv.free(cache)


async def test_from_another_thread_it_is_refused() -> None:
    async with bounded(), paged() as pool:
        g = await pool.admit(pages=1)
        with pytest.raises(WrongThreadError):
            in_thread(pool.pages_short)
        pool.free([g.row])


async def test_under_a_hold_growth_takes_the_pending_pages_first() -> None:
    # Documented: the pending pages count for the head, but while a hold is
    # held growth takes them first, so the shortfall shows once it has.
    s = FakeStream()
    async with bounded(), paged(rows=4, pages=8) as pool:
        running = await pool.admit(pages=4)
        victim = await pool.admit(pages=4)
        waiter = await queued_call(pool.admit(pages=4))
        hold = pool.hold_grants()  # the stall: growth first
        pool.free([victim.row], fence=s.record())  # the retraction, behind the step
        assert pool.pages_short() == 0  # 4 pending: the head's, as it reads now
        s.complete()
        grown = pool.extend(running.row, 3)  # growth reclaims and takes them
        assert grown is not None
        assert pool.pages_short() == 3  # 1 free now: the real shortfall
        hold.release()
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        pool.free([running.row])


async def test_a_hit_found_after_the_grant_gives_back_the_surplus_at_once() -> None:
    # docs/api.md's recipe for a cache that changed while the admission
    # queued: a row's pages are interchangeable until written, so a late hit
    # of h pages keeps the first k - h and trims the rest, free at once.
    async with bounded(), paged(rows=2, pages=8) as pool:
        kv = kv_of(pool)
        g = await pool.admit(pages=5)  # counted with no hit
        own = pool.pages_of(g.row).tolist()
        assert pool.trim_pages(g.row, 5 - 2) == 2  # a 2-page hit found now
        assert pool.pages_of(g.row).tolist() == own[:3]
        assert kv.available_size() == 5 and kv.pending_size() == 0
        pool.free([g.row])


def test_waiters_of_a_loop_closed_under_them_are_not_counted() -> None:
    # A review's find: pages_short() counted a waiter whose event loop was
    # closed (asyncio.run returned with it queued), which can never run: a
    # cache evicting for it would evict for nobody. Dropped first, as every
    # call that looks at the queue drops them.
    pool = paged(rows=2, pages=8)

    async def first() -> None:
        g = await pool.admit(pages=8)
        pool.detach_pages(g.row)  # the cache's now: held for good here
        pool.free([g.row])
        waiter = asyncio.ensure_future(pool.admit(pages=8))
        await spin()
        assert pool.pages_short() == 8 and not waiter.done()

    async def second() -> None:
        assert pool.pages_short() == 0 and pool.waiting() == 0

    asyncio.run(first())
    asyncio.run(second())


@pytest.mark.parametrize("grouped", [False, True], ids=["one kv", "groups"])
async def test_pages_behind_an_overdue_fence_are_not_on_their_way_back(grouped: bool) -> None:
    """A transfer whose peer died holds an aborted request's pages for ever:
    counted as on their way back, the head read 0 short and a cache that
    evicts by this read never evicted, so the admission waited behind the
    stuck fence though the cache held the pages it needed (found by the
    scheduler-port trial). Before the fence is overdue they still count."""
    stuck = EventFence()
    seen = WarningsSeen("is overdue")
    log = logging.getLogger("asyncpool")
    log.addHandler(seen)
    kv: Any = KVPagePool(9, 4)
    if grouped:
        kv = {"full": kv, "swa": KVPagePool(9, 4)}
    try:
        async with bounded(), AsyncReqToTokenPool(4, 64, kv=kv, fence_timeout=0.05) as pool:
            ask: Any = {"full": 4, "swa": 0} if grouped else 4
            short = (lambda: pool.pages_short(group="full")) if grouped else pool.pages_short
            aborted = await pool.admit(ask)  # its transfer never lands
            cached = await pool.admit(ask)  # a finished request, into the cache
            held = pool.detach_pages(cached.row, group="full" if grouped else None)
            pool.free([cached.row])
            pool.free([aborted.row], fence=stuck)
            waiter = await queued_call(pool.admit(ask))
            try:
                assert short() == 0  # 4 pending behind a fence not overdue yet
                await seen.event.wait()  # bounded above; nobody calls the pool meanwhile
                assert pool.stats().overdue_pages == 4
                assert short() == 4  # evict for the head: the stuck pages are not coming
                head = pool.queue_head()
                assert head is not None
                assert head.pages_short == ({"full": 4, "swa": 0} if grouped else 4)
                kv_of_full = kv["full"] if grouped else kv
                kv_of_full.free(held)  # the cache evicts what it said
                granted = await waiter
                assert short() == 0
                pool.free([granted.row])
            finally:
                if not waiter.done():  # the old code: never granted
                    waiter.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await waiter
            assert pool.force_release(stuck) == (1, 4)
    finally:
        stuck.set()
        log.removeHandler(seen)
