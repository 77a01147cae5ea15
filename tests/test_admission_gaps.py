"""Admission edge cases found by mutation testing (asyncpool.admission; since
split into asyncpool.growth and asyncpool.give_back too)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from helpers import WAIT_S, kv_of, spin
from helpers import assert_pages_conserved as conserved

from asyncpool import (
    AsyncReqToTokenPool,
    CapacityError,
    InvalidSlotError,
    KVPagePool,
    PoolClosedError,
    ReqToTokenPoolInfo,
)
from asyncpool.agreement import WIDTH, agree


def make(rows: int = 4, pages: int = 16, page_size: int = 4, **kw) -> AsyncReqToTokenPool:
    return AsyncReqToTokenPool(rows + 1, 64, kv=KVPagePool(pages + 1, page_size), **kw)


async def test_pages_reclaimed_at_hand_over_without_a_free_row_grant_nothing(kit):
    # The head admit waiter is short of rows; at hand-over the grant loop
    # reclaims completed pages: it must take nothing (no row), and the
    # waiter is granted, whole, when a row comes back.
    stream = kit.stream()
    gate = kit.gate(stream)
    async with make(rows=2, pages=4) as pool:
        g = await pool.admit(pages=2)
        h = await pool.admit(pages=1)
        kv = kv_of(pool)
        kv.free(pool.detach_pages(g.row), after=stream)  # 2 pending, 1 free
        w = asyncio.create_task(pool.admit(pages=3))
        await spin()
        assert pool.waiting() == 1
        gate.open()
        settled(stream)  # the pending pages' fence completed
        kv.free(pool.detach_pages(h.row))  # a free page: the grant loop runs now
        assert kv.pending_size() == 0  # it reclaimed them at hand-over
        await spin()
        assert not w.done() and kv.available_size() == 4
        pool.check_invariants()
        pool.free(g.row)
        async with asyncio.timeout(WAIT_S):
            got = await w
        assert len(got.pages) == 3
        pool.free([got.row, h.row])
        conserved(pool)


def settled(stream) -> None:
    """Block until everything launched on ``stream`` ran."""
    stream.record().wait(WAIT_S)


async def test_admit_wait_histogram_counts_every_admit_fast_ones_as_zero_waits():
    async with make(rows=1, pages=4) as pool:
        g = await pool.admit(pages=1)  # fast: no wait
        w = asyncio.create_task(pool.admit(pages=1))
        await spin()
        assert pool.waiting() == 1
        pool.free(g.row)
        async with asyncio.timeout(WAIT_S):
            g2 = await w  # queued: one wait
        pool.free(g2.row)
        g3 = pool.try_admit(pages=2)  # fast as well
        assert g3 is not None
        pool.free(g3.row)
        st = pool.stats()
        assert st.admits == 3
        h = st.admit_wait_histogram
        assert h.count == 3
        assert h.counts[0] >= 2  # the two fast admits are zero waits
        conserved(pool)


async def test_try_admit_and_admit_reclaim_completed_fences_before_answering(kit):
    handle = kit.event_fence()
    async with make(rows=1, pages=4) as pool:
        g = await pool.admit(pages=4)
        pool.free([g.row], fence=handle)  # row and pages pending
        kv = kv_of(pool)
        assert pool.pending_size() == 1 and kv.pending_size() == 4
        assert pool.try_admit(pages=1) is None  # still pending
        handle.set()  # complete; nothing ran on the loop since
        g2 = pool.try_admit(pages=4)
        assert g2 is not None and len(g2.pages) == 4
        handle2 = kit.event_fence()
        pool.free([g2.row], fence=handle2)
        handle2.set()
        coro = pool.admit(pages=4)
        try:
            coro.send(None)  # reclaims, grants without suspending
        except StopIteration as stop:
            g3 = stop.value
        else:
            coro.close()
            raise AssertionError("admit suspended with completed fences to reclaim")
        assert len(g3.pages) == 4
        pool.free(g3.row)
        conserved(pool)


async def test_extend_that_reclaims_more_than_it_takes_serves_the_waiters(kit):
    handle = kit.event_fence()
    async with make(rows=3, pages=6) as pool:
        a = await pool.admit(pages=2)
        b = await pool.admit(pages=4)
        pool.free([b.row], fence=handle)  # 4 pages (and a row) pending
        w = asyncio.create_task(pool.admit(pages=3))
        await spin()
        assert pool.waiting() == 1  # a row is free, no page is
        handle.set()  # complete; the loop has not run since
        got = pool.extend(a.row, 1)  # reclaims 4 pages, takes 1
        assert got is not None and len(got) == 1
        assert pool.waiting() == 0  # granted by extend itself, not by a wake-up
        async with asyncio.timeout(WAIT_S):
            g = await w
        assert len(g.pages) == 3
        pool.free([a.row, g.row])
        conserved(pool)


async def test_extend_rows_that_reclaims_more_than_it_takes_serves_the_waiters(kit):
    handle = kit.event_fence()
    async with make(rows=3, pages=6) as pool:
        a = await pool.admit(pages=2)
        b = await pool.admit(pages=4)
        pool.free([b.row], fence=handle)
        w = asyncio.create_task(pool.admit(pages=3))
        await spin()
        assert pool.waiting() == 1
        handle.set()
        got = pool.extend_rows([a.row], 1)
        assert got is not None and tuple(got.shape) == (1, 1)
        assert pool.waiting() == 0
        async with asyncio.timeout(WAIT_S):
            g = await w
        pool.free([a.row, g.row])
        conserved(pool)


async def test_extend_rows_of_no_rows_answers_none_while_released():
    async with make(rows=2, pages=4) as pool:
        async with asyncio.timeout(WAIT_S):
            await pool.release_memory()
        assert pool.released
        assert pool.extend_rows([], 1) is None  # released: None, even for no rows
        async with asyncio.timeout(WAIT_S):
            await pool.resume_memory()
        got = pool.extend_rows([], 2)
        assert got is not None and tuple(got.shape) == (0, 2)
        conserved(pool)


async def test_a_row_freed_with_its_pages_goes_behind_the_clean_rows():
    # The free queue is [clean rows..., dirty rows...]: a row freed (fast
    # path) was written, and must not be handed out as a clean one.
    async with make(rows=3, pages=8) as pool:
        g = await pool.admit(pages=2)
        pool.set_req_pool_info(
            g.row, ReqToTokenPoolInfo(2, 3, torch.tensor([4, 5, 6], dtype=torch.int32))
        )
        assert pool.free([g.row]) == 1
        for _ in range(3):
            h = await pool.admit(pages=1)
            seen = (int(pool.verified_lens[h.row]), int(pool.alloced_lens[h.row]))
            assert seen == (0, 0), f"row {h.row} handed out dirty"
        pool.free(list(range(1, 4)))
        conserved(pool)


async def test_a_refused_free_after_a_stream_records_no_use(kit):
    stream = kit.stream()
    gate = kit.gate(stream)
    async with make(rows=2, pages=4) as pool:
        g = await pool.admit(pages=3)
        page = int(g.pages[0])
        g.pages[0] = -1  # written into: free refuses
        with pytest.raises(InvalidSlotError, match="were written into"):
            pool.free([g.row], after=stream)
        g.pages[0] = page  # put right
        assert pool.free([g.row]) == 1  # no use was recorded on the gated stream
        assert pool.pending_size() == 0 and kv_of(pool).pending_size() == 0
        gate.open()
        conserved(pool)


async def test_a_page_free_serves_an_admit_waiter_whose_row_waits_on_a_completed_fence(kit):
    handle = kit.event_fence()
    async with make(rows=1, pages=4) as pool:
        g = await pool.admit(pages=2)
        pages = pool.detach_pages(g.row)
        pool.free([g.row], fence=handle)  # only the row pending
        w = asyncio.create_task(pool.admit(pages=1))
        await spin()
        assert pool.waiting() == 1
        handle.set()  # complete; the loop has not run since
        kv_of(pool).free(pages)  # the grant loop runs here: it reclaims the row
        assert pool.waiting() == 0
        async with asyncio.timeout(WAIT_S):
            got = await w
        pool.free(got.row)
        conserved(pool)


# ---------------------------------------------------------------- agree()


class Handle:
    """A transfer handle (no stream_key): done when told; raises when faulted."""

    def __init__(self, done: bool = False) -> None:
        self.done = done
        self.error: BaseException | None = None

    def query(self) -> bool:
        if self.error is not None:
            raise self.error
        return self.done

    def synchronize(self) -> None:
        if self.error is not None:
            raise self.error


def explicit_pool(rows: int = 4, pages: int = 8) -> AsyncReqToTokenPool:
    return AsyncReqToTokenPool(rows + 1, 8, kv=KVPagePool(pages + 1, 4), reclaim="explicit")


async def test_agree_reads_each_ledgers_own_flags(group: Any) -> None:
    # Rows and pages pending behind different fences: the page ledger's
    # batches must be settled by their own flags, not the row ledger's.
    pool = explicit_pool()
    g = await pool.admit(pages=3)
    pages = pool.detach_pages(g.row)
    slow, fast = Handle(), Handle(done=True)
    pool.free([g.row], fence=slow)  # the row only
    kv_of(pool).free(pages, fence=fast)  # the pages only
    assert pool.agree(group) == (0, 3)
    slow.done = True
    assert pool.agree(group) == (1, 0)
    await pool.close()


async def test_agree_counts_the_quarantined_and_uses_one_collective_up_to_width(
    group: Any,
) -> None:
    pool = explicit_pool(rows=WIDTH, pages=WIDTH)
    fences = [Handle() for _ in range(WIDTH)]
    for f in fences:
        g = await pool.admit(pages=1)
        pool.free([g.row], fence=f)  # one row batch and one page batch each
    first = agree(group, [pool._ledger])  # exactly WIDTH batches: one collective
    assert first.batches == WIDTH and first.collectives == 1 and first.released == (0,)
    fences[0].error = RuntimeError("the transfer failed")
    for f in fences[1 : WIDTH // 2]:
        f.done = True
    kv = kv_of(pool)
    res = agree(group, [pool._ledger, kv.ledger])
    # WIDTH batches per ledger, 2 * WIDTH in all: beyond the first collective.
    assert res.batches == 2 * WIDTH and res.collectives == 2
    assert res.released == (WIDTH // 2 - 1, WIDTH // 2 - 1)
    assert res.quarantined == 2  # the faulted fence's row and its page
    await pool.close()


async def test_extend_after_close_still_reports_bad_input_first():
    # As admit, try_admit and extend_rows do: a bad argument is named as
    # such even on a closed pool; a good one gets PoolClosedError.
    pool = make(rows=2, pages=4)
    g = await pool.admit(pages=1)
    await pool.close()
    with pytest.raises(CapacityError):
        pool.extend(g.row, 0)
    with pytest.raises(InvalidSlotError):
        pool.extend(99, 1)
    with pytest.raises(PoolClosedError):
        pool.extend(g.row, 1)
    with pytest.raises(CapacityError):
        pool.extend_rows([g.row], 0)


async def test_rows_reclaimed_at_hand_over_with_pages_still_short_grant_nothing(kit):
    handle = kit.event_fence()
    async with make(rows=2, pages=5) as pool:
        a = await pool.admit(pages=2)
        b = await pool.admit(pages=2)
        kept = pool.detach_pages(b.row)
        pool.free([a.row], fence=handle)  # a row and 2 pages pending, 1 page free
        w = asyncio.create_task(pool.admit(pages=5))
        await spin()
        assert pool.waiting() == 1
        handle.set()
        kv = kv_of(pool)
        kv.free(kept[:1])  # the grant loop reclaims: a row, but only 4 pages
        assert pool.waiting() == 1 and pool.pending_size() == 0
        assert kv.available_size() == 4
        pool.check_invariants()
        kv.free(kept[1:])  # the fifth page: now it fits
        async with asyncio.timeout(WAIT_S):
            got = await w
        assert len(got.pages) == 5
        pool.free([got.row, b.row])
        conserved(pool)
