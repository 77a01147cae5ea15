"""Atomic admission: one await grants a request its row and its KV pages.

``await pool.admit(pages=n)`` waits in the same queue as ``alloc``: FIFO
within priority, the head blocks those behind it whatever it needs, grant at
hand-over for both resources, ``try_admit`` answers None while anyone waits.
Pages belong to their row while it is allocated (``pages_of``, ``extend``,
``detach_pages``), and ``free(rows)`` frees each row with its pages behind the
row's newest recorded use plus ``fence``/``after``. Every wait is bounded by
``asyncio.timeout``; every test ends with nothing leaked in either ledger.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

import numpy as np
import pytest
import torch
from helpers import WAIT_S, assert_conserved, bounded, kv_of, spin
from helpers import assert_pages_conserved as conserved
from helpers import page_ids as ids

from asyncpool import (
    AsyncReqToTokenPool,
    CapacityError,
    DoubleFreeError,
    FenceError,
    Grant,
    HostStream,
    InvalidSlotError,
    KVPagePool,
    PoolBusyError,
    PoolClosedError,
    WrongThreadError,
)


def make(rows: int = 4, pages: int = 16, page_size: int = 4, **kw) -> AsyncReqToTokenPool:
    """A pool of ``rows`` grantable rows and ``pages`` grantable pages."""
    return AsyncReqToTokenPool(rows + 1, 64, kv=KVPagePool(pages + 1, page_size), **kw)


def settled(stream) -> None:
    """Block until everything launched on ``stream`` ran (or it faulted)."""
    try:
        stream.record().wait(WAIT_S)
    except FenceError:
        pass


async def outcome(task: asyncio.Task):
    async with asyncio.timeout(WAIT_S):
        try:
            return await task
        except BaseException as exc:  # CancelledError included
            return exc


async def queued(pool: AsyncReqToTokenPool, *coros) -> list[asyncio.Task]:
    tasks = [asyncio.create_task(c) for c in coros]
    await spin()
    assert pool.waiting() == len(coros)
    return tasks


async def pages_pending(pool: AsyncReqToTokenPool, n: int, **fence: Any) -> torch.Tensor:
    """Admit a request of ``n`` pages, detach them, free its row (free at
    once) and free the pages to the page pool behind ``fence``/``after``:
    only pages pending. Returns them."""
    g = await pool.admit(pages=n)
    pages = pool.detach_pages(g.row)
    pool.free(g.row)
    kv_of(pool).free(pages, **fence)
    return pages


# ---------------------------------------------------------------- the grant


async def test_admit_grants_a_row_and_its_pages_without_suspending():
    async with make() as pool:
        coro = pool.admit(pages=3)
        with pytest.raises(StopIteration) as stop:
            coro.send(None)  # the fast path never suspends
        g = stop.value.value
        assert isinstance(g, Grant) and g.row.__class__ is int
        assert g.pages.dtype in (torch.int32, torch.int64) and g.pages.dim() == 1
        assert len(g.pages) == 3 and 0 not in ids(g.pages)
        assert ids(pool.pages_of(g.row)) == ids(g.pages)
        assert pool.allocated_size() == 1 and kv_of(pool).available_size() == 13
        row, pages = g  # unpacks
        assert row == g.row and pages is g.pages
        pool.free([g.row])
        assert kv_of(pool).available_size() == 16 and pool.available_size() == 4
        conserved(pool)


async def test_grant_is_frozen():
    async with make() as pool:
        g = await pool.admit(pages=1)
        with pytest.raises(AttributeError):
            g.row = 3  # type: ignore[misc]
        with pytest.raises(AttributeError):
            g.pages = torch.zeros(1)  # type: ignore[misc]
        pool.free(g.row)


async def test_admit_zero_pages_grants_a_row_with_no_pages():
    async with make() as pool:
        g = await pool.admit(pages=0)
        assert len(g.pages) == 0 and len(pool.pages_of(g.row)) == 0
        pool.free([g.row])
        conserved(pool)


async def test_try_admit_grants_or_answers_none():
    async with make(rows=1, pages=4) as pool:
        g = pool.try_admit(pages=4)
        assert g is not None and len(g.pages) == 4
        assert pool.try_admit(pages=1) is None  # no row
        pool.free(g.row)
        g2 = pool.try_admit(pages=4)
        assert g2 is not None
        pool.free(g2.row)
        conserved(pool)


async def test_try_admit_none_while_anyone_waits():
    async with make(rows=2, pages=8) as pool:
        g = await pool.admit(pages=6)
        [w] = await queued(pool, pool.admit(pages=4))
        # A row and 2 pages are free: a small admit would fit, but may not jump.
        assert pool.try_admit(pages=1) is None
        assert pool.try_alloc(1) is None
        pool.free(g.row)
        got = await outcome(w)
        assert isinstance(got, Grant)
        pool.free(got.row)
        conserved(pool)


async def test_try_admit_reclaims_completed_fences_before_answering_none(kit):
    stream = kit.stream()
    gate = kit.gate(stream)
    async with make(rows=2, pages=4) as pool:
        g = await pool.admit(pages=4)
        pool.free([g.row], after=stream)
        assert kv_of(pool).pending_size() == 4
        gate.open()
        await asyncio.wait_for(asyncio.to_thread(stream.synchronize), WAIT_S)
        g2 = pool.try_admit(pages=4)
        assert g2 is not None
        pool.free(g2.row)
        conserved(pool)


async def test_counts_are_reads_and_reclaim_brings_rows_and_pages_back_at_once(kit):
    """docs/api.md's *Counts are reads*: a fence completed while the loop does
    not run changes no count (the wake-up is a callback of the loop), and
    ``pool.reclaim()``, still without a loop turn, returns the row and its
    pages and grants the queued admission."""
    async with bounded(), make(rows=2, pages=8) as pool:
        kv = kv_of(pool)
        a, b = pool.try_admit(pages=4), pool.try_admit(pages=4)
        assert a is not None and b is not None
        [w] = await queued(pool, pool.admit(pages=4))
        fence = kit.event_fence()
        pool.free([a.row], fence=fence)
        fence.set()
        fence.synchronize()  # complete; no await from here to the reclaim
        counts = (
            pool.available_size(),
            pool.pending_size(),
            kv.available_size(),
            kv.pending_size(),
            pool.stats().pages_free,
        )
        assert counts == (0, 1, 0, 4, 0)
        assert pool.reclaim() == 1
        assert pool.waiting() == 0 and pool.allocated_size() == 2  # granted at once
        assert (pool.pending_size(), kv.pending_size(), kv.available_size()) == (0, 0, 0)
        got = await outcome(w)
        assert isinstance(got, Grant) and got.row == a.row and len(got.pages) == 4
        pool.free([b.row, got.row])
        conserved(pool)


# ---------------------------------------------------------------- no hold-and-wait


async def test_a_waiter_short_of_pages_holds_no_row():
    async with make(rows=4, pages=8) as pool:
        g = await pool.admit(pages=6)
        [w] = await queued(pool, pool.admit(pages=4))
        assert pool.allocated_size() == 1  # the waiter holds no row
        assert pool.available_size() == 3
        assert pool.stats().pages_allocated == 6
        pool.free(g.row)
        got = await outcome(w)
        assert len(got.pages) == 4 and pool.allocated_size() == 1
        pool.free(got.row)
        conserved(pool)


async def test_a_waiter_short_of_rows_holds_no_pages():
    async with make(rows=1, pages=8) as pool:
        g = await pool.admit(pages=2)
        [w] = await queued(pool, pool.admit(pages=2))
        assert kv_of(pool).available_size() == 6  # the waiter holds no pages
        assert pool.stats().pages_allocated == 2
        pool.free(g.row)
        got = await outcome(w)
        assert got.row == g.row
        pool.free(got.row)
        conserved(pool)


# ---------------------------------------------------------------- one queue


async def test_row_only_alloc_queued_behind_a_page_starved_head_waits():
    async with make(rows=4, pages=8) as pool:
        g = await pool.admit(pages=8)
        head, alloc = await queued(pool, pool.admit(pages=4), pool.alloc(1))
        # Three rows are free, yet the alloc waits behind the admit head.
        assert pool.available_size() == 3 and not alloc.done()
        assert pool.try_alloc(1) is None
        pool.free(g.row)  # pages for the head: both granted, in order
        got = await outcome(head)
        rows = await outcome(alloc)
        assert isinstance(got, Grant) and len(rows) == 1
        assert pool.stats().admit_wait.count == 1
        pool.free([got.row, *rows])
        conserved(pool)


async def test_admit_queued_behind_a_row_starved_alloc_head_waits():
    async with make(rows=2, pages=8) as pool:
        held = await pool.alloc(1)
        head, adm = await queued(pool, pool.alloc(2), pool.admit(pages=1))
        assert pool.available_size() == 1 and kv_of(pool).available_size() == 8
        assert not adm.done()
        pool.free(held)
        rows = await outcome(head)
        assert len(rows) == 2 and not adm.done()
        pool.free(rows)
        got = await outcome(adm)
        pool.free(got.row)
        conserved(pool)


async def test_fifo_across_alloc_and_admit():
    async with make(rows=1, pages=8) as pool:
        held = await pool.alloc(1)
        order: list[str] = []

        async def admit(tag: str) -> None:
            g = await pool.admit(pages=1)
            order.append(tag)
            await asyncio.sleep(0)
            pool.free(g.row)

        async def alloc(tag: str) -> None:
            rows = await pool.alloc(1)
            order.append(tag)
            await asyncio.sleep(0)
            pool.free(rows)

        tasks = await queued(pool, admit("a1"), alloc("r1"), admit("a2"), alloc("r2"))
        pool.free(held)
        async with asyncio.timeout(WAIT_S):
            await asyncio.gather(*tasks)
        assert order == ["a1", "r1", "a2", "r2"]
        conserved(pool)


async def test_priority_orders_admits_and_allocs_together():
    async with make(rows=1, pages=8) as pool:
        held = await pool.alloc(1)
        late = asyncio.create_task(pool.alloc(1))
        await spin()
        urgent = asyncio.create_task(pool.admit(pages=2, priority=-1))
        await spin()
        pool.free(held)
        got = await outcome(urgent)
        assert isinstance(got, Grant) and not late.done()
        pool.free(got.row)
        rows = await outcome(late)
        pool.free(rows)
        conserved(pool)


async def test_a_new_urgent_admit_that_fits_is_granted_without_a_free():
    """The head was short of pages; a more urgent admit that fits in the
    rows and pages free becomes the head and is granted at the loop's next
    turn, without waiting for an unrelated free."""
    async with bounded(), make(rows=4, pages=8) as pool:
        g = await pool.admit(pages=6)  # 3 rows and 2 pages free
        [big] = await queued(pool, pool.admit(pages=4))
        urgent = asyncio.create_task(pool.admit(pages=1, priority=-1))
        got = await outcome(urgent)
        assert isinstance(got, Grant) and len(got.pages) == 1
        assert not big.done() and pool.waiting() == 1
        pool.free([g.row, got.row])
        got_big = await outcome(big)
        pool.free(got_big.row)
        conserved(pool)


async def test_a_big_page_head_blocks_smaller_admits_behind_it():
    async with make(rows=4, pages=8) as pool:
        g = await pool.admit(pages=4)
        big, small = await queued(pool, pool.admit(pages=8), pool.admit(pages=1))
        assert not small.done()  # 4 pages free, but the head needs 8
        big.cancel()  # a cancelled head lets the smaller one through
        assert isinstance(await outcome(big), asyncio.CancelledError)
        got = await outcome(small)
        assert len(got.pages) == 1
        pool.free([g.row, got.row])
        conserved(pool)


# ---------------------------------------------------------------- wake-ups and fences


async def test_page_fence_completion_wakes_an_admit_waiter(kit):
    stream = kit.stream()
    gate = kit.gate(stream)
    async with make(rows=4, pages=4) as pool:
        pages = await pages_pending(pool, 4, after=stream)  # behind the gated stream
        [w] = await queued(pool, pool.admit(pages=4))
        assert pool.stats().pages_pending == 4
        gate.open()  # nobody calls the pool after this
        got = await outcome(w)
        assert sorted(ids(got.pages)) == sorted(ids(pages))
        pool.free(got.row)
        conserved(pool)


async def test_a_reclaim_that_frees_only_pages_grants_the_admit_waiter(kit):
    """``pool.reclaim()`` grants the waiters when it made only pages free (no
    row): the queued admission is served by that call, before the fence's
    own wake-up can run (the mutant granted only when rows came back)."""
    stream = kit.stream()
    gate = kit.gate(stream)
    async with make(rows=4, pages=4) as pool:
        pages = await pages_pending(pool, 4, after=stream)  # behind the gated stream
        [w] = await queued(pool, pool.admit(pages=4))
        gate.open()
        settled(stream)  # the fence completed; its wake-up is not run yet
        assert pool.reclaim() == 0  # no row came back, only pages
        assert pool.waiting() == 0, "the waiter was not granted by reclaim()"
        got = await outcome(w)
        assert sorted(ids(got.pages)) == sorted(ids(pages))
        pool.free(got.row)
        conserved(pool)


async def test_a_transfer_handle_fence_defers_a_freed_rows_pages(kit):
    handle = kit.event_fence()  # query()/synchronize(), no stream: unknown origin
    async with make(rows=2, pages=4) as pool:
        g = await pool.admit(pages=3)
        pool.free([g.row], fence=handle)
        kv = kv_of(pool)
        assert pool.pending_size() == 1 and kv.pending_size() == 3
        assert pool.try_admit(pages=2) is None  # only 1 page free
        [w] = await queued(pool, pool.admit(pages=4))
        handle.set()  # the watcher thread sees it; nobody calls the pool
        got = await outcome(w)
        assert len(got.pages) == 4 and kv.pending_size() == 0
        pool.free(got.row)
        conserved(pool)


async def test_record_use_covers_the_pages(kit):
    stream = kit.stream()
    gate = kit.gate(stream)
    async with make(rows=2, pages=4) as pool:
        g = await pool.admit(pages=4)
        pool.record_use([g.row], stream.record())  # one call per step
        pool.free([g.row])
        kv = kv_of(pool)
        assert pool.pending_size() == 1 and kv.pending_size() == 4
        assert kv.available_size() == 0
        [w] = await queued(pool, pool.admit(pages=1))
        gate.open()
        got = await outcome(w)
        assert kv.pending_size() == 0
        pool.free(got.row)
        conserved(pool)


async def test_free_waits_for_use_and_explicit_fence_on_pages(kit):
    s1, s2 = kit.stream(), kit.stream()
    g1, g2 = kit.gate(s1), kit.gate(s2)
    async with make(rows=2, pages=4) as pool:
        g = await pool.admit(pages=2)
        pool.record_use([g.row], s1.record())
        pool.free([g.row], fence=s2.record())
        kv = kv_of(pool)
        assert kv.pending_size() == 2
        g1.open()
        await asyncio.wait_for(asyncio.to_thread(s1.synchronize), WAIT_S)
        pool.reclaim()
        assert kv.pending_size() == 2  # still behind s2's fence
        g2.open()
        await asyncio.wait_for(asyncio.to_thread(s2.synchronize), WAIT_S)
        pool.reclaim()
        assert kv.pending_size() == 0 and pool.pending_size() == 0
        conserved(pool)


async def test_a_faulted_fence_quarantines_row_and_pages(kit, caplog):
    caplog.set_level(logging.CRITICAL, logger="asyncpool")
    stream = kit.stream()
    gate = kit.gate(stream)

    def boom() -> None:
        raise RuntimeError("kernel fault")

    async with make(rows=2, pages=4) as pool:
        g = await pool.admit(pages=3)
        stream.launch(boom)
        pool.free([g.row], after=stream)
        gate.open()
        await asyncio.wait_for(asyncio.to_thread(settled, stream), WAIT_S)
        pool.reclaim()
        st = pool.stats()
        assert st.quarantined == 1 and st.pages_quarantined == 3
        # Only one page can ever be free again: an admit for two fails at once.
        with pytest.raises(CapacityError, match=r"pages.*a new pool is the way back"):
            async with bounded():  # a lost check must fail, not hang
                await pool.admit(pages=2)
        conserved(pool)


async def test_a_page_waiter_that_can_never_fit_after_a_fault_fails(kit, caplog):
    caplog.set_level(logging.CRITICAL, logger="asyncpool")
    stream = kit.stream()
    gate = kit.gate(stream)

    def boom() -> None:
        raise RuntimeError("kernel fault")

    async with make(rows=2, pages=4) as pool:
        g = await pool.admit(pages=3)
        stream.launch(boom)
        pool.free([g.row], after=stream)
        [w] = await queued(pool, pool.admit(pages=4))
        gate.open()
        res = await outcome(w)
        assert isinstance(res, CapacityError) and "pages" in str(res)
        assert pool.waiting() == 0
        conserved(pool)


# ---------------------------------------------------------------- same-tick races


async def test_cancel_then_free_in_the_same_tick_admits_nothing():
    async with make(rows=1, pages=4) as pool:
        g = await pool.admit(pages=2)
        [w] = await queued(pool, pool.admit(pages=2))
        w.cancel()
        pool.free(g.row)  # no yield between the cancel and the free
        assert isinstance(await outcome(w), asyncio.CancelledError)
        assert pool.available_size() == 1 and kv_of(pool).available_size() == 4
        assert pool.stats().cancellations == 1
        conserved(pool)


async def test_free_then_cancel_in_the_same_tick_gives_both_back():
    async with make(rows=1, pages=4) as pool:
        g = await pool.admit(pages=4)
        [w] = await queued(pool, pool.admit(pages=3))
        pool.free(g.row)  # w is granted the row and three pages...
        assert pool.waiting() == 0 and pool.available_size() == 0
        assert kv_of(pool).available_size() == 1
        w.cancel()  # ...and cancelled before it resumes
        assert isinstance(await outcome(w), asyncio.CancelledError)
        assert pool.available_size() == 1 and kv_of(pool).available_size() == 4
        assert pool.allocated_size() == 0 and pool.stats().pages_allocated == 0
        conserved(pool)


async def test_cancelled_after_grant_hands_both_to_the_next_waiter():
    async with make(rows=1, pages=4) as pool:
        g = await pool.admit(pages=4)
        w1, w2 = await queued(pool, pool.admit(pages=4), pool.admit(pages=4))
        pool.free(g.row)
        assert pool.waiting() == 1
        w1.cancel()
        assert isinstance(await outcome(w1), asyncio.CancelledError)
        got = await outcome(w2)
        assert isinstance(got, Grant) and len(got.pages) == 4
        pool.free(got.row)
        conserved(pool)


@pytest.mark.lazy_tasks(
    "the waiter is made, then counted queued a pass later: eager, its 0 s timer fires sooner"
)
async def test_timeout_expiring_as_the_grant_lands():
    async with make(rows=1, pages=4) as pool:
        g = await pool.admit(pages=4)
        w = asyncio.create_task(pool.admit(pages=4, timeout=0))
        await asyncio.sleep(0)  # queued; its zero timer is due next iteration
        assert pool.waiting() == 1
        pool.free(g.row)  # the grant and the expiry meet
        res = await outcome(w)
        if isinstance(res, TimeoutError):
            assert pool.stats().timeouts == 1
        else:
            assert isinstance(res, Grant)
            pool.free(res.row)
        assert pool.available_size() == 1 and kv_of(pool).available_size() == 4
        conserved(pool)


async def test_external_timeout_as_the_grant_lands_gives_both_back():
    async with make(rows=1, pages=4) as pool:
        g = await pool.admit(pages=4)

        async def waiter() -> Grant:
            async with asyncio.timeout(0):
                return await pool.admit(pages=4)

        w = asyncio.create_task(waiter())
        await asyncio.sleep(0)
        pool.free(g.row)
        res = await outcome(w)
        assert isinstance(res, TimeoutError)
        assert pool.available_size() == 1 and kv_of(pool).available_size() == 4
        conserved(pool)


async def test_timeout_means_nothing_admitted():
    async with make(rows=1, pages=4) as pool:
        g = await pool.admit(pages=1)
        async with asyncio.timeout(WAIT_S):
            with pytest.raises(TimeoutError, match=r"admit\(pages=2\) timed out .*1 row and 2 p"):
                await pool.admit(pages=2, timeout=0.01)
        assert pool.waiting() == 0 and kv_of(pool).available_size() == 3
        pool.free(g.row)
        conserved(pool)


# ---------------------------------------------------------------- extend, detach


async def test_extend_adds_pages_to_the_row_and_never_waits():
    async with make(rows=2, pages=6) as pool:
        g = await pool.admit(pages=2)
        more = pool.extend(g.row, 3)
        assert more is not None and len(more) == 3
        assert ids(pool.pages_of(g.row)) == ids(g.pages) + ids(more)
        assert pool.extend(g.row, 2) is None  # one page left: short, no wait
        assert len(pool.pages_of(g.row)) == 5 and kv_of(pool).available_size() == 1
        pool.free(g.row)  # frees all five
        assert kv_of(pool).available_size() == 6
        conserved(pool)


async def test_extend_with_waiters_queued_still_answers_at_once():
    async with make(rows=1, pages=4) as pool:
        g = await pool.admit(pages=1)
        [w] = await queued(pool, pool.admit(pages=1))
        # A running request grows before new admissions (it holds its row).
        assert pool.extend(g.row, 2) is not None
        assert pool.extend(g.row, 3) is None
        pool.free(g.row)
        got = await outcome(w)
        pool.free(got.row)
        conserved(pool)


async def test_extend_reclaims_completed_page_fences_first(kit):
    stream = kit.stream()
    gate = kit.gate(stream)
    async with make(rows=2, pages=4) as pool:
        a = await pool.admit(pages=3)
        b = await pool.admit(pages=1)
        pool.free([a.row], after=stream)
        assert pool.extend(b.row, 3) is None  # behind the gate
        gate.open()
        await asyncio.wait_for(asyncio.to_thread(stream.synchronize), WAIT_S)
        more = pool.extend(b.row, 3)
        assert more is not None and len(pool.pages_of(b.row)) == 4
        pool.free(b.row)
        conserved(pool)


async def test_detach_pages_hands_them_to_the_caller():
    async with make(rows=2, pages=4) as pool:
        g = await pool.admit(pages=3)
        pages = pool.detach_pages(g.row)
        assert ids(pages) == ids(g.pages) and len(pool.pages_of(g.row)) == 0
        pool.free(g.row)
        kv = kv_of(pool)
        assert kv.available_size() == 1  # the caller owns three pages now
        assert pool.stats().pages_allocated == 3
        kv.free(pages)
        assert kv.available_size() == 4
        conserved(pool)


@pytest.mark.parametrize("n", [1, 3])
async def test_host_ids_are_the_same_pages_on_the_cpu(n):
    """``host=True`` (for a CUDA pool's host bookkeeping) gives the same ids
    as CPU tensors: here, where the pool is on the CPU, the same tensors'
    contents; tests/test_cuda.py checks a CUDA pool."""
    async with make(rows=3, pages=8) as pool:
        kv = kv_of(pool)
        g = await pool.admit(pages=n)
        for got in (pool.pages_of(g.row, host=True), pool.pages_of(g.row)):
            assert got.device.type == "cpu" and got.dtype == torch.int64
            assert ids(got) == ids(g.pages)
        mine = kv.alloc(2, host=True)
        assert mine is not None and mine.device.type == "cpu" and len(ids(mine)) == 2
        detached = pool.detach_pages(g.row, host=True)
        assert detached.device.type == "cpu" and ids(detached) == ids(g.pages)
        assert ids(pool.pages_of(g.row, host=True)) == []
        assert ids(pool.detach_pages(g.row, host=True)) == []
        kv.free(detached)
        kv.free(mine)
        pool.free(g.row)
        conserved(pool)


@pytest.mark.parametrize("n", [1, 4, 12])
@pytest.mark.parametrize("form", ["detached tensor", "tensor", "list", "numpy"])
async def test_the_caller_freeing_detached_pages_serves_a_waiter(n, form):
    # Every path of KVPagePool.free (one page, a few, many; the very tensor
    # detach_pages handed out, another tensor, list, array) runs the pool's
    # grant loop.
    async with make(rows=2, pages=12) as pool:
        g = await pool.admit(pages=n)
        detached = pool.detach_pages(g.row)
        pages = detached.clone()
        pool.free(g.row)
        rest = await pool.admit(pages=12 - n)
        [w] = await queued(pool, pool.admit(pages=n))
        arg = {
            "detached tensor": detached,
            "tensor": pages,
            "list": pages.tolist(),
            "numpy": pages.numpy(),
        }[form]
        kv_of(pool).free(arg)  # straight to the KVPagePool, no fence
        got = await outcome(w)
        assert len(got.pages) == n
        pool.free([got.row, rest.row])
        conserved(pool)


async def test_detached_pages_free_without_id_checks(monkeypatch):
    # The page pool remembers the tensor detach_pages handed out, as it
    # does for its own alloc: freeing it unchanged skips the id checks.
    async with make(rows=2, pages=8) as pool:
        g = await pool.admit(pages=5)
        pages = pool.detach_pages(g.row)
        pool.free(g.row)
        kv = kv_of(pool)

        def broken(*args: object, **kwargs: object) -> None:
            raise AssertionError("an id check was run")

        for name in ("prepare", "_free_now_small", "_checked"):
            monkeypatch.setattr(kv.ledger, name, broken)
        assert kv.free(pages) == 5
        monkeypatch.undo()
        assert kv.available_size() == 8
        conserved(pool)


async def test_detach_then_extend_then_free_frees_only_the_new_pages():
    async with make(rows=2, pages=4) as pool:
        g = await pool.admit(pages=2)
        kept = pool.detach_pages(g.row)
        more = pool.extend(g.row, 1)
        assert more is not None and ids(pool.pages_of(g.row)) == ids(more)
        pool.free(g.row)
        assert kv_of(pool).available_size() == 2
        kv_of(pool).free(kept)
        conserved(pool)


async def test_alloc_rows_own_no_pages_until_extended():
    async with make(rows=2, pages=4) as pool:
        rows = await pool.alloc(1)
        assert len(pool.pages_of(rows[0])) == 0
        assert pool.extend(rows[0], 2) is not None
        pool.free(rows)
        assert kv_of(pool).available_size() == 4
        conserved(pool)


# ---------------------------------------------------------------- overdue fences


class _Seen(logging.Handler):
    """Sets an asyncio.Event on the first record containing ``word``."""

    def __init__(self, word: str) -> None:
        super().__init__(logging.WARNING)
        self.word = word
        self.event = asyncio.Event()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if self.word in record.getMessage():
            self.records.append(record)
            self.event.set()  # logged on the loop's thread (a timer callback)


async def test_overdue_fence_is_counted_and_logged_once_memory_held(kit, caplog):
    caplog.set_level(logging.WARNING, logger="asyncpool")  # let the warnings through
    stuck = kit.event_fence()  # a transfer that never completes
    seen = _Seen("overdue")
    released = _Seen("force_release")
    log = logging.getLogger("asyncpool")
    log.addHandler(seen)
    log.addHandler(released)
    try:
        async with make(rows=2, pages=4, fence_timeout=0.1) as pool:
            g = await pool.admit(pages=3)
            h = await pool.admit(pages=0)
            pool.free([g.row], fence=stuck)
            [w] = await queued(pool, pool.admit(pages=4))
            async with asyncio.timeout(WAIT_S):
                await seen.event.wait()  # nobody calls the pool meanwhile
            st = pool.stats()
            assert st.overdue_fences == 1 and st.overdue_rows == 1 and st.overdue_pages == 3
            assert st.pending == 1 and st.pages_pending == 3  # still held
            [record] = seen.records
            assert record.levelno == logging.WARNING
            msg = record.getMessage()
            assert repr(stuck) in msg and "1 row " in msg and "3 pages" in msg
            other = kit.event_fence()
            seen.event.clear()
            pool.free([h.row], fence=other)  # arms another check, past the timeout
            async with asyncio.timeout(WAIT_S):
                await seen.event.wait()  # that check's records, all of them
            # It logged the new fence and not the one already logged.
            assert len(seen.records) == 2 and repr(other) in seen.records[1].getMessage()
            del seen.records[1]
            other.set()
            assert len(seen.records) == 1 and not w.done()
            assert pool.force_release(stuck) == (1, 3)
            stuck.set()  # let the watcher thread go (close() joins it)
            assert released.records and repr(stuck) in released.records[0].getMessage()
            got = await outcome(w)  # the waiter is served
            assert len(got.pages) == 4
            await pool.drain(timeout=WAIT_S)  # h's row, behind `other` (set above)
            st = pool.stats()
            assert st.overdue_fences == 0 and st.pending == 0 and st.pages_pending == 0
            pool.free(got.row)
            conserved(pool)
    finally:
        stuck.set()  # let the watcher thread go (close() joins it)
        log.removeHandler(seen)
        log.removeHandler(released)


async def test_a_fence_younger_than_fence_timeout_is_not_overdue(kit):
    stuck = kit.event_fence()
    async with make(rows=2, pages=4, fence_timeout=60) as pool:
        g = await pool.admit(pages=3)
        pool.free([g.row], fence=stuck)
        st = pool.stats()
        assert st.overdue_fences == 0 and st.pending == 1
        stuck.set()


async def test_force_release_without_fence_timeout_and_of_a_fence_holding_nothing(kit):
    stuck = kit.event_fence()
    other = kit.event_fence()
    async with make(rows=2, pages=4) as pool:
        g = await pool.admit(pages=2)
        pool.free([g.row], fence=stuck)
        assert pool.stats().overdue_fences == 0  # no fence_timeout: never overdue
        assert pool.force_release(other) == (0, 0)
        assert pool.force_release(stuck) == (1, 2)
        assert pool.available_size() == 2 and kv_of(pool).available_size() == 4
        assert pool.force_release(stuck) == (0, 0)
        conserved(pool)
        stuck.set()
        other.set()


async def test_force_release_of_pages_freed_by_the_caller(kit):
    stuck = kit.event_fence()
    async with make(rows=2, pages=4) as pool:
        await pages_pending(pool, 2, fence=stuck)
        [w] = await queued(pool, pool.admit(pages=4))
        assert pool.force_release(stuck) == (0, 2)
        got = await outcome(w)
        pool.free(got.row)
        conserved(pool)
        stuck.set()


async def test_force_release_stops_watching_and_covers_uses_still_recorded(kit):
    """force_release left the fence polled for good, and a row with a use
    recorded on it, freed afterwards, waited behind it again (held for good)."""
    stuck = kit.event_fence()
    other = kit.event_fence()
    stream = kit.stream()
    gate = kit.gate(stream)
    async with make(rows=3, pages=4) as pool:
        a = await pool.admit(pages=1)
        b = await pool.admit(pages=1)
        pool.record_use([a.row], stuck)
        pool.record_use([b.row], stuck)
        pool.record_use([b.row], other)  # b waits for both
        used = stream.record()
        pool.record_use([b.row], used)
        pool.free([a.row], fence=stuck)
        assert pool._wakeups.watcher is not None and pool._wakeups.watcher.polled == 1
        pool.force_release(stuck)
        assert pool._wakeups.watcher.polled == 0  # nothing waits on it: not asked again
        pool.free([b.row])
        gate.open()
        await asyncio.wait_for(asyncio.to_thread(stream.synchronize), WAIT_S)
        pool.reclaim()
        assert pool.pending_size() == 1  # b waits for `other` only
        other.set()
        async with bounded():
            await pool.drain()
        c = await pool.admit(pages=1)
        pool.record_use([c.row], stuck)
        assert pool.free([c.row]) == 0  # a use recorded after it counts again
        conserved(pool)
        stuck.set()


async def test_force_release_of_one_fence_of_two_keeps_waiting_for_the_other(kit):
    stuck = kit.event_fence()
    stream = kit.stream()
    gate = kit.gate(stream)
    async with make(rows=2, pages=4) as pool:
        g = await pool.admit(pages=2)
        pool.record_use([g.row], stream.record())
        pool.free([g.row], fence=stuck)
        pool.force_release(stuck)
        assert pool.pending_size() == 1 and kv_of(pool).pending_size() == 2
        gate.open()
        await asyncio.wait_for(asyncio.to_thread(stream.synchronize), WAIT_S)
        pool.reclaim()
        assert pool.pending_size() == 0 and kv_of(pool).pending_size() == 0
        conserved(pool)
        stuck.set()


# ---------------------------------------------------------------- lifecycle


async def test_close_fails_admit_waiters_and_later_admits():
    pool = make(rows=1, pages=4)
    g = await pool.admit(pages=1)
    [w] = await queued(pool, pool.admit(pages=1))
    await pool.close()
    assert isinstance(await outcome(w), PoolClosedError)
    with pytest.raises(PoolClosedError):
        async with bounded():  # a lost check must fail, not hang
            await pool.admit(pages=1)
    with pytest.raises(PoolClosedError):
        pool.try_admit(pages=1)
    pool.free(g.row)  # free still works after close
    conserved(pool)


async def test_extend_after_close_raises_and_changes_nothing():
    pool = make(rows=2, pages=4)
    g = await pool.admit(pages=1)
    assert pool.extend(g.row, 1) is not None
    await pool.close()
    before = snapshot(pool)
    with pytest.raises(PoolClosedError):
        pool.extend(g.row, 1)
    assert snapshot(pool) == before
    pool.free(g.row)  # free still works after close, pages included
    assert kv_of(pool).available_size() == 4
    conserved(pool)


async def test_admissions_answer_none_while_release_memory_drains(kit):
    # (extend cannot meet a drain any more: a release with a row allocated
    # is refused at once.)
    stream = kit.stream()
    gate = kit.gate(stream)
    async with make(rows=2, pages=4) as pool:
        p = await pool.admit(pages=1)
        pool.free([p.row], after=stream)
        release = asyncio.create_task(pool.release_memory())
        await spin()
        assert not release.done()  # draining: the gate is closed already
        assert pool.try_admit(pages=1) is None and pool.try_alloc(1) is None
        gate.open()
        async with bounded():
            await release
        assert pool.released and pool.try_admit(pages=1) is None
        await pool.resume_memory()
        g = pool.try_admit(pages=1)
        assert g is not None and pool.extend(g.row, 1) is not None
        pool.free(g.row)
        conserved(pool)


async def test_bind_refuses_while_pages_are_pending(kit):
    stream = kit.stream()
    gate = kit.gate(stream)
    async with make(rows=2, pages=4) as pool:
        await pages_pending(pool, 2, after=stream)
        with pytest.raises(PoolBusyError, match="2 pages"):
            pool.bind()
        gate.open()
        await pool.drain(timeout=WAIT_S)
        pool.bind()  # nothing pending: allowed


async def test_drain_waits_for_page_fences(kit):
    stream = kit.stream()
    gate = kit.gate(stream)
    async with make(rows=2, pages=4) as pool:
        await pages_pending(pool, 2, after=stream)
        drain = asyncio.create_task(pool.drain())
        await spin()
        assert not drain.done()
        gate.open()
        async with asyncio.timeout(WAIT_S):
            await drain
        assert kv_of(pool).pending_size() == 0
        conserved(pool)


async def test_max_waiters_covers_admissions():
    async with make(rows=1, pages=4, max_waiters=1) as pool:
        g = await pool.admit(pages=4)
        [w] = await queued(pool, pool.admit(pages=1))
        with pytest.raises(PoolBusyError, match=r"admit\(pages=2\)"):
            await pool.admit(pages=2)
        assert pool.stats().rejections == 1
        pool.free(g.row)
        got = await outcome(w)
        pool.free(got.row)
        conserved(pool)


async def test_release_memory_refuses_while_pages_are_allocated_and_resume_restores():
    async with make(rows=2, pages=4) as pool:
        g = await pool.admit(pages=2)
        pages = pool.detach_pages(g.row)
        pool.free(g.row)
        with pytest.raises(PoolBusyError, match="pages"):
            await pool.release_memory()
        assert not pool.released
        kv_of(pool).free(pages)
        await pool.release_memory()
        assert pool.try_admit(pages=1) is None  # released: admissions wait
        w = asyncio.create_task(pool.admit(pages=1))
        await spin()
        assert not w.done()
        await pool.resume_memory()
        got = await outcome(w)
        pool.free(got.row)
        conserved(pool)


async def test_release_memory_drains_page_fences(kit):
    stream = kit.stream()
    gate = kit.gate(stream)
    async with make(rows=2, pages=4) as pool:
        g = await pool.admit(pages=2)
        pool.free([g.row], after=stream)
        release = asyncio.create_task(pool.release_memory())
        await spin()
        assert not release.done()
        gate.open()
        async with asyncio.timeout(WAIT_S):
            await release
        assert kv_of(pool).pending_size() == 0
        await pool.resume_memory()
        conserved(pool)


# ---------------------------------------------------------------- stats


async def test_stats_carry_page_figures_and_admit_waits(kit):
    stream = kit.stream()
    gate = kit.gate(stream)
    async with make(rows=2, pages=8) as pool:
        a = await pool.admit(pages=3)
        b = await pool.admit(pages=2)
        pool.free([b.row], after=stream)
        st = pool.stats()
        assert (st.pages_capacity, st.pages_free, st.pages_allocated, st.pages_pending) == (
            8,
            3,
            3,
            2,
        )
        assert st.pages_quarantined == 0 and st.overdue_pages == 0 and st.admits == 2
        [w] = await queued(pool, pool.admit(pages=5))
        gate.open()
        got = await outcome(w)
        st = pool.stats()
        assert st.admit_wait.count == 1 and st.admits == 3
        assert st.wait_time.count == 0  # alloc waits are apart
        pool.free([a.row, got.row])
        conserved(pool)


async def test_stats_without_kv_have_zero_page_figures():
    async with AsyncReqToTokenPool(3, 4) as pool:
        st = pool.stats()
        assert st.pages_capacity == 0 and st.pages_free == 0 and st.admits == 0
        assert pool.kv is None


# ---------------------------------------------------------------- bad input


def snapshot(pool: AsyncReqToTokenPool, check: bool = True):
    stats = dataclasses.asdict(pool.stats())
    for key in ("wait_time", "fence_latency", "admit_wait", "oldest_wait_s"):
        stats.pop(key, None)
    kv = kv_of(pool)
    if check:
        kv.check_invariants()
        pool.check_invariants()
    owned = {r: ids(pool.pages_of(r)) for r in pool._ledger.allocated_rows()}
    return stats, pool.waiting(), kv.available_size(), kv.pending_size(), owned


@pytest.mark.parametrize("n", [-1, 17, 1.0, "2", None, True, 2**70])
async def test_bad_page_counts_raise_and_change_nothing(n):
    async with make(rows=2, pages=16) as pool:
        g = await pool.admit(pages=1)
        before = snapshot(pool)
        with pytest.raises(CapacityError):
            async with bounded():  # a lost check must fail, not hang
                await pool.admit(pages=n)
        with pytest.raises(CapacityError):
            pool.try_admit(pages=n)
        with pytest.raises(CapacityError):
            pool.extend(g.row, n)
        after = snapshot(pool)
        if n in (17, 2**70):
            # More pages than the pool has: a call that can never be served,
            # counted (admit only, at its priority); nothing else changes.
            assert after[0].pop("unfittable") == before[0].pop("unfittable") + 1 == 1
            assert after[0].pop("by_priority")[0]["unfittable"] == 1
            assert not before[0].pop("by_priority")
        assert after == before
        pool.free(g.row)


async def test_admit_accepts_index_like_page_counts():
    import numpy as np

    async with make(rows=2, pages=16) as pool:
        g = await pool.admit(pages=np.int64(2))
        assert len(g.pages) == 2
        more = pool.extend(g.row, np.int32(1))
        assert more is not None and len(more) == 1
        pool.free(g.row)


@pytest.mark.parametrize("k", [0, -1])
async def test_extend_needs_at_least_one_page(k):
    async with make() as pool:
        g = await pool.admit(pages=1)
        before = snapshot(pool)
        with pytest.raises(CapacityError):
            pool.extend(g.row, k)
        assert snapshot(pool) == before
        pool.free(g.row)


async def test_bad_wait_arguments_on_admit_queue_nothing():
    async with make(rows=1, pages=4) as pool:
        g = await pool.admit(pages=4)
        before = snapshot(pool)
        with pytest.raises(TypeError):
            await pool.admit(pages=1, priority=1.5)  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            await pool.admit(pages=1, timeout=-1)
        assert snapshot(pool) == before
        pool.free(g.row)


@pytest.mark.parametrize("row", [0, -1, 99, "1", 1.0, None])
async def test_bad_rows_for_page_calls_raise_and_change_nothing(row):
    async with make(rows=2) as pool:
        g = await pool.admit(pages=1)
        before = snapshot(pool)
        for call in (pool.pages_of, pool.detach_pages, lambda r: pool.extend(r, 1)):
            with pytest.raises(InvalidSlotError):
                call(row)
        assert snapshot(pool) == before
        pool.free(g.row)


async def test_page_calls_on_a_row_not_allocated_raise_and_change_nothing(kit):
    stream = kit.stream()
    gate = kit.gate(stream)
    async with make(rows=3) as pool:
        g = await pool.admit(pages=1)
        p = await pool.admit(pages=1)
        pool.free([p.row], after=stream)  # pending
        free_row = next(r for r in range(1, 4) if r not in (g.row, p.row))
        before = snapshot(pool)
        for row in (p.row, free_row):
            for call in (pool.pages_of, pool.detach_pages, lambda r: pool.extend(r, 1)):
                with pytest.raises(InvalidSlotError):
                    call(row)
        assert snapshot(pool) == before
        gate.open()
        pool.free(g.row)


async def test_bad_frees_on_a_kv_pool_keep_rows_and_pages():
    async with make(rows=3) as pool:
        a = await pool.admit(pages=2)
        b = await pool.admit(pages=3)
        before = snapshot(pool)
        with pytest.raises(InvalidSlotError):
            pool.free([a.row, a.row])
        with pytest.raises(InvalidSlotError):
            pool.free([a.row, 0])
        with pytest.raises(TypeError):
            pool.free([a.row], fence=object())  # type: ignore[arg-type]
        assert snapshot(pool) == before
        pool.free([a.row, b.row])
        with pytest.raises(DoubleFreeError):
            pool.free([a.row])
        conserved(pool)


@pytest.mark.parametrize("k", [1, 2, 12, 40])  # inline, one Python pass, vectorised
@pytest.mark.parametrize("form", ["grant", "pages_of", "list", "copy"])
async def test_the_page_pool_refuses_pages_a_row_owns(k: int, form: str, kit):
    """kv.free of a row's pages took them, skipping the row's open fence: the
    next admission got them while step t still wrote them, and freeing the
    row then freed the new owner's pages. A row's pages are OWNED now: only
    the row's free (behind its fences) or detach_pages gives them back."""
    stream = kit.stream()
    gate = kit.gate(stream)
    async with make(rows=3, pages=64) as pool:
        a = await pool.admit(pages=k)
        pool.record_use([a.row], stream.record())  # step t still writes them
        pages: Any = {
            "grant": a.pages,
            "pages_of": pool.pages_of(a.row),
            "list": ids(a.pages),
            "copy": a.pages.clone(),
        }[form]
        before = snapshot(pool, check=False)
        with pytest.raises(InvalidSlotError, match="owned by a row"):
            kv_of(pool).free(pages)
        with pytest.raises(InvalidSlotError, match="owned by a row"):
            kv_of(pool).free(pages, fence=kit.event_fence())
        assert snapshot(pool, check=False) == before
        b = pool.try_admit(64 - k)
        assert b is not None and not set(ids(b.pages)) & set(ids(a.pages))
        assert pool.free([a.row]) == 0  # behind step t's fence, pages too
        pool.free([b.row])
        gate.open()
        async with bounded():
            await pool.drain()
        conserved(pool)


async def test_invariants_see_owned_pages_no_row_lists():
    """check_invariants checked one way only (a row's pages are OWNED): an
    OWNED page in no row's record, a leak kv.free can never undo, passed."""
    from asyncpool.kv_pages import OWNED

    async with make(rows=2, pages=8) as pool:
        pool.check_invariants()
        kv_of(pool).ledger.take(3, OWNED)  # what a take lost mid-grant would leave
        with pytest.raises(AssertionError, match="3 pages are OWNED"):
            pool.check_invariants()


async def test_detached_pages_are_the_callers_to_free():
    async with make(rows=2, pages=16) as pool:
        a = await pool.admit(pages=4)
        b = await pool.admit(pages=4)
        b.pages[0] = a.pages[0]  # misuse: b's record now lists a's page
        detached = pool.detach_pages(b.row)  # b's own pages (its seal) change hands
        kv = kv_of(pool)
        assert ids(a.pages) == [1, 2, 3, 4] and ids(detached) == [5, 6, 7, 8]
        kv.free(detached)  # b's own four pages
        pool.free([a.row, b.row])
        conserved(pool)


async def test_clearing_a_page_pool_that_serves_a_row_pool_is_refused():
    async with make(rows=2) as pool:
        g = await pool.admit(pages=2)
        before = snapshot(pool)
        with pytest.raises(PoolBusyError, match="rows own pages"):
            kv_of(pool).clear()
        assert snapshot(pool) == before
        pool.free(g.row)


async def test_force_release_of_a_non_fence_is_a_type_error():
    async with make() as pool:
        before = snapshot(pool)
        with pytest.raises(TypeError):
            pool.force_release(object())  # type: ignore[arg-type]
        assert snapshot(pool) == before


async def test_admit_and_page_calls_without_kv_raise():
    async with AsyncReqToTokenPool(3, 4) as pool:
        rows = await pool.alloc(1)
        with pytest.raises(CapacityError, match="kv"):
            async with bounded():  # a lost check must fail, not hang
                await pool.admit(pages=1)
        with pytest.raises(CapacityError, match="kv"):
            pool.try_admit(pages=1)
        with pytest.raises(CapacityError, match="kv"):
            pool.extend(rows[0], 1)
        assert len(pool.pages_of(rows[0])) == 0
        assert len(pool.detach_pages(rows[0])) == 0
        pool.free(rows)
        assert_conserved(pool)


@pytest.mark.parametrize("bad", [-1, "1", float("nan"), True, float("inf")])
def test_bad_fence_timeout_is_refused(bad):
    with pytest.raises((ValueError, TypeError)):
        make(fence_timeout=bad)


def test_kv_must_be_a_kv_page_pool_and_serve_one_pool():
    with pytest.raises(TypeError):
        AsyncReqToTokenPool(3, 4, kv=object())  # type: ignore[arg-type]
    kv = KVPagePool(5, 4)
    AsyncReqToTokenPool(3, 4, kv=kv)
    with pytest.raises(ValueError, match="already"):
        AsyncReqToTokenPool(3, 4, kv=kv)


async def test_a_faulted_page_fence_counts_in_pool_stats(kit, caplog):
    caplog.set_level(logging.CRITICAL, logger="asyncpool")
    stream = kit.stream()

    def boom() -> None:
        raise RuntimeError("fault")

    async with make(rows=2, pages=4) as pool:
        g = await pool.admit(pages=1)
        stream.launch(boom)
        pages = pool.detach_pages(g.row)
        pool.free(g.row)
        kv_of(pool).free(pages, after=stream)
        await asyncio.wait_for(asyncio.to_thread(settled, stream), WAIT_S)
        pool.reclaim()
        assert pool.stats().pages_quarantined == 1
        assert kv_of(pool).stats().fence_errors == 1


# ---------------------------------------------------------------- grant.pages written into
# grant.pages is a view of the row's record ("do not modify it in place"). A
# caller who does anyway gets a typed error from free, and the pool stays as
# it was: the pool trusts its record only while it is as granted.


@pytest.mark.parametrize("form", ["[row]", "row"])  # the fast path, the general one
@pytest.mark.parametrize("n", [3, 8, 9, 12])
@pytest.mark.parametrize(
    "write",
    [
        "the last page as -1",  # numpy would read -1 as page n
        "a page past the end",
        "a duplicate",
        "page 0",
        "another row's page",  # valid ids: only the seal tells
    ],
)
async def test_free_of_a_row_whose_pages_were_written_into_raises_and_changes_nothing(
    n, write, form
):
    async with make(rows=2, pages=n + 1) as pool:
        g = await pool.admit(pages=n)
        other = await pool.admit(pages=1)  # the last page, n + 1
        last = ids(g.pages).index(n)
        value = {
            "the last page as -1": -1,
            "a page past the end": 10**6,
            "a duplicate": int(g.pages[(last + 1) % n]),
            "page 0": 0,
            "another row's page": int(other.pages[0]),
        }[write]
        g.pages[last] = value
        arg = [g.row] if form == "[row]" else g.row
        before = pool.stats()
        with pytest.raises(InvalidSlotError, match=f"pages of row {g.row} were written into"):
            pool.free(arg)
        after = pool.stats()
        assert dataclasses.replace(after, fence_latency=before.fence_latency) == before
        kv_of(pool).check_invariants()
        g.pages[last] = n  # put right: it frees
        assert pool.free(arg) == 1
        assert ids(pool.pages_of(other.row)) == [n + 1]
        pool.free(other.row)
        assert kv_of(pool).available_size() == n + 1
        conserved(pool)


async def test_a_write_before_extend_is_still_seen_and_detach_is_the_way_out():
    # extend copies the record; its seal grows from the old seal, so the
    # write is still caught. The caller can always take the pages back.
    async with make(rows=2, pages=12) as pool:
        g = await pool.admit(pages=10)
        g.pages[0] = g.pages[1]
        more = pool.extend(g.row, 2)
        assert more is not None
        for arg in ([g.row], g.row):
            with pytest.raises(InvalidSlotError, match="written into"):
                pool.free(arg)
        detached = pool.detach_pages(g.row)  # the row's own pages, not the record
        assert sorted(ids(detached)) == list(range(1, 13))
        pool.free(g.row)
        assert kv_of(pool).free(detached) == 12
        conserved(pool)


async def test_rows_with_different_uses_never_free_one_page_twice():
    # Two rows list the same page (a record written into); with different
    # recorded uses their pages are checked in separate groups, and
    # together as well. (A page freed behind a row's back and taken again by
    # another row, the other way to get there, is refused at kv.free now.)
    async with make(rows=3, pages=4) as pool:
        kv = kv_of(pool)
        stream = HostStream()
        try:
            a = await pool.admit(pages=2)
            b = await pool.admit(pages=2)
            a.pages[0] = b.pages[0]
            fence = stream.record()
            await asyncio.wait_for(asyncio.to_thread(fence.synchronize), WAIT_S)
            pool.record_use([b.row], fence)  # a's use is None: two groups
            before = pool.stats()
            with pytest.raises(InvalidSlotError, match="written into"):
                pool.free([a.row, b.row])
            after = pool.stats()
            assert dataclasses.replace(after, fence_latency=before.fence_latency) == before
            kv.check_invariants()
            pool.detach_pages(a.row)
            pool.free([a.row, b.row])
            kv.free([1, 2])  # a's own pages, detached (its record is not)
            conserved(pool)
        finally:
            stream.close()


async def test_decode_growth_copies_only_the_new_pages():
    # A page per decode step: extend copied the whole record each time
    # (O(n) a step, O(n**2) a request: 200 us an extend at 128K pages).
    # The record now grows inside a buffer that doubles when full, so its
    # memory moves O(log n) times, and it lists every page in order.
    steps = 500
    async with make(rows=1, pages=steps + 1) as pool:
        g = await pool.admit(pages=1)
        expected = ids(g.pages)
        moves, where = 0, None
        for _ in range(steps):
            more = pool.extend(g.row, 1)
            assert more is not None
            expected += ids(more)
            ptr = pool.pages_of(g.row).data_ptr()
            moves += ptr != where
            where = ptr
        assert moves <= 10
        assert ids(pool.pages_of(g.row)) == expected
        pool.check_invariants()
        detached = pool.detach_pages(g.row)
        assert ids(detached) == expected
        pool.free(g.row)
        assert kv_of(pool).free(detached) == steps + 1
        conserved(pool)


async def test_a_write_through_an_earlier_record_view_after_extend_is_seen():
    # While the record fits its buffer, a view pages_of() returned before an
    # extend is still the row's memory: a write through it must be caught.
    async with make(rows=2, pages=8) as pool:
        g = await pool.admit(pages=2)
        assert pool.extend(g.row, 1) is not None  # into a buffer with room
        view = pool.pages_of(g.row)
        assert pool.extend(g.row, 1) is not None  # fits: same memory
        assert pool.pages_of(g.row).data_ptr() == view.data_ptr()
        own = ids(pool.pages_of(g.row))
        view[0] = view[1]
        with pytest.raises(InvalidSlotError, match="written into"):
            pool.free([g.row])
        assert sorted(ids(pool.detach_pages(g.row))) == sorted(own)
        pool.free(g.row)
        kv_of(pool).free(torch.tensor(own))
        conserved(pool)


async def test_a_row_never_lists_a_page_twice_after_extends():
    # Before pages were OWNED, a row's pages freed straight to the page pool
    # could be taken again by its extend and listed twice. kv.free refuses
    # them now, and extend takes free pages only.
    async with make(rows=2, pages=20) as pool:
        kv = kv_of(pool)
        g = await pool.admit(pages=10)
        with pytest.raises(InvalidSlotError, match="owned by a row"):
            kv.free(g.pages.clone())
        more = pool.extend(g.row, 10)
        assert more is not None and not set(ids(more)) & set(ids(g.pages))
        assert sorted(ids(pool.pages_of(g.row))) == list(range(1, 21))
        assert pool.free([g.row]) == 1
        conserved(pool)


@pytest.mark.parametrize("write", [-1, 10**6, "duplicate", "a page held elsewhere"])
async def test_detach_of_a_written_record_hands_over_the_rows_own_pages(write):
    """It disowned the row's pages (its seal) but returned the record as
    written: with a page another holder had (a prefix cache's, from
    kv.alloc) written in, kv.free of the detached tensor freed that page
    from under its holder, and the row's own page leaked."""
    async with make(rows=2, pages=12) as pool:
        kv = kv_of(pool)
        cache = kv.alloc(2)  # a prefix cache's pages: 1 and 2
        g = await pool.admit(pages=10)
        own = ids(g.pages)
        value = {"duplicate": g.pages[1], "a page held elsewhere": cache[0]}.get(write, write)
        g.pages[0] = value
        detached = pool.detach_pages(g.row)
        assert ids(detached) == own
        pool.free(g.row)
        assert kv.free(detached) == 10
        assert kv.ledger.state_of(int(cache[0])) == "allocated"  # still the cache's
        kv.free(cache)
        conserved(pool)


@pytest.mark.parametrize("how", ["admit", "alloc then extend", "admit then extends"])
async def test_a_row_record_frees_without_the_checked_path(how, monkeypatch):
    async with make(rows=2, pages=12) as pool:
        if how == "admit":
            row = (await pool.admit(pages=10)).row
        elif how == "alloc then extend":
            row = (await pool.alloc(1))[0]
            assert pool.extend(row, 10) is not None
        else:  # a decode-grown row: trusted too, now that its pages are OWNED
            row = (await pool.admit(pages=4)).row
            assert pool.extend(row, 3) is not None and pool.extend(row, 3) is not None
        led = kv_of(pool).ledger

        def broken(*args: object, **kwargs: object) -> None:
            raise AssertionError("the checked path was taken")

        monkeypatch.setattr(led, "prepare", broken)
        assert pool.free([row]) == 1
        monkeypatch.undo()
        conserved(pool)


@pytest.mark.parametrize("call", ["free", "alloc", "reclaim"])
async def test_the_page_pool_of_a_pool_refuses_a_foreign_thread(call):
    # Its free would run the row pool's grant loop off the loop's thread
    # (a waiter resolved there never woke up).
    async with make(rows=2, pages=4) as pool:
        kv = kv_of(pool)
        g = await pool.admit(pages=4)
        detached = pool.detach_pages(g.row)
        before = pool.stats()
        act = {
            "free": lambda: kv.free(detached),
            "alloc": lambda: kv.alloc(1),
            "reclaim": kv.reclaim,
        }[call]
        with pytest.raises(WrongThreadError, match="this KVPagePool serves"):
            await asyncio.wait_for(asyncio.to_thread(act), WAIT_S)
        after = pool.stats()
        assert dataclasses.replace(after, fence_latency=before.fence_latency) == before
        [w] = await queued(pool, pool.admit(pages=2))
        assert kv.free(detached) == 4  # from the pool's own thread: serves the waiter
        got = await outcome(w)
        pool.free([g.row, got.row])
        conserved(pool)


@pytest.mark.parametrize(
    "form",
    [np.int64, np.int32, np.uint16, torch.tensor],
    ids=["np.int64", "np.int32", "np.uint16", "0-d tensor"],
)
async def test_row_calls_accept_integer_scalars_as_free_does(form):
    async with make(rows=2, pages=8) as pool:
        g = await pool.admit(pages=2)
        row = form(g.row)
        assert ids(pool.pages_of(row)) == ids(g.pages)
        more = pool.extend(row, 2)
        assert more is not None and len(pool.pages_of(row)) == 4
        assert len(pool.detach_pages(row)) == 4
        for bad in (True, float(g.row), str(g.row)):
            with pytest.raises(InvalidSlotError):
                pool.pages_of(bad)
        pool.free(row)
        kv_of(pool).free(list(range(1, 5)))
        conserved(pool)
