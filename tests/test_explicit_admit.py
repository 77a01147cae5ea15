"""reclaim="explicit" on a pool that owns a KVPagePool (admission): retire and
agree cover rows and pages together; overdue fences are agreed ones only."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from helpers import FakeStream, bounded

from asyncpool import AsyncReqToTokenPool, KVPagePool


class Transfer:
    """A transfer handle (no stream_key) that counts query() calls."""

    def __init__(self, done: bool = False) -> None:
        self.done = done
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.done

    def synchronize(self) -> None:
        if not self.done:
            raise AssertionError("synchronize() on a transfer the test has not completed")


def explicit_pool(rows: int = 4, pages: int = 17, **kw: Any) -> AsyncReqToTokenPool:
    return AsyncReqToTokenPool(rows, 8, kv=KVPagePool(pages, 4), reclaim="explicit", **kw)


def test_kv_follows_the_pool_mode() -> None:
    kv = KVPagePool(9, 4)
    pool = AsyncReqToTokenPool(4, 8, kv=kv, reclaim="explicit")
    assert kv.reclaim_mode == "explicit" and pool.reclaim_mode == "explicit"
    with pytest.raises(ValueError, match="same mode"):
        AsyncReqToTokenPool(4, 8, kv=KVPagePool(9, 4, reclaim="explicit"))
    busy = KVPagePool(9, 4)
    pages = busy.alloc(2)
    busy.free(pages, fence=Transfer())
    with pytest.raises(ValueError, match="fresh page pool"):
        AsyncReqToTokenPool(4, 8, kv=busy, reclaim="explicit")
    assert busy.reclaim_mode == "auto" and busy.ledger._on_pending is None


async def test_an_explicit_page_pool_handed_over_with_pending_pages_is_not_watched(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An explicit pool never asks a fence, also for the pages its page pool
    deferred before it was handed over: no watcher thread polls them and no
    overdue warning is logged by this rank's own clock (a review found both:
    the hand-over announced them as an auto pool must)."""
    kv = KVPagePool(17, 4, reclaim="explicit")
    pages = kv.alloc(4)
    assert pages is not None
    transfer = Transfer()
    kv.free(pages[:2], fence=transfer)
    stream = FakeStream()
    kv.free(pages[2:], fence=stream.record())
    with caplog.at_level(logging.WARNING, logger="asyncpool"):
        pool = AsyncReqToTokenPool(4, 8, kv=kv, reclaim="explicit", fence_timeout=0.01)
        for _ in range(3):
            await asyncio.sleep(0.02)
    assert pool._wakeups.watcher is None and transfer.queries == 0
    assert "overdue" not in caplog.text and pool.stats().overdue_fences == 0
    assert kv.pending_size() == 4
    await pool.close()


async def test_retire_returns_rows_and_pages_and_admits_a_waiter() -> None:
    pool = explicit_pool(rows=2, pages=9)
    s = FakeStream()
    g = await pool.admit(pages=8)
    f = s.record()
    pool.record_use([g.row], f)
    s.complete()  # done, but the pool does not look
    pool.free([g.row])
    assert pool.try_admit(pages=8) is None
    waiter = asyncio.ensure_future(pool.admit(pages=8))
    await asyncio.sleep(0)
    assert pool.retire(f) == (1, 8)
    assert pool.waiting() == 0  # granted inside retire()
    async with bounded():
        g2 = await waiter
    assert g2.row == g.row and sorted(g2.pages.tolist()) == sorted(g.pages.tolist())
    assert f.queries == 0
    pool.check_invariants()
    await pool.close()


async def test_agree_settles_rows_and_pages_behind_a_transfer(group: Any) -> None:
    pool = explicit_pool()
    g = await pool.admit(pages=3)
    t = Transfer()
    pool.free([g.row], fence=t)
    assert pool.agree(group) == (0, 0)
    t.done = True
    assert pool.agree(group) == (1, 3)
    assert t.queries == 2  # once per agreement, for both ledgers
    await pool.close()


async def test_overdue_is_what_every_rank_agreed(
    group: Any, caplog: pytest.LogCaptureFixture
) -> None:
    pool = explicit_pool(fence_timeout=1e-6)
    g = await pool.admit(pages=2)
    t = Transfer()
    pool.free([g.row], fence=t)
    await asyncio.sleep(0.01)  # long past the timeout on this clock
    assert pool.stats().overdue_fences == 0  # no rank agreed yet: not overdue
    assert pool._overdue is not None and pool._overdue.timer is None  # no local clock
    with caplog.at_level(logging.WARNING, logger="asyncpool.agreement"):
        pool.agree(group)
        pool.agree(group)
    st = pool.stats()
    assert (st.overdue_fences, st.overdue_rows, st.overdue_pages) == (1, 1, 2)
    warned = [r.message for r in caplog.records if "not done on at least one rank" in r.message]
    assert len(warned) == 1 and "1 row and 2 pages" in warned[0]  # one per fence
    assert pool.force_release(t) == (1, 2)
    assert pool.stats().overdue_fences == 0
    await pool.close()


async def test_extend_and_detached_pages_under_explicit_reclaim() -> None:
    pool = explicit_pool(rows=3, pages=9)
    kv = pool.kv
    assert kv is not None
    s = FakeStream()
    g = await pool.admit(pages=2)
    more = pool.extend(g.row, 2)
    assert more is not None
    f = s.record()
    pool.record_use([g.row], f)
    mine = pool.detach_pages(g.row)
    kv.free(mine, fence=f)
    pool.free([g.row])
    assert pool.stats().pages_pending == 4 and pool.pending_size() == 1
    assert pool.retire(f) == (1, 4)
    pool.check_invariants()
    await pool.close()


async def test_explicit_drain_settles_rows_and_pages() -> None:
    pool = explicit_pool()
    s = FakeStream()
    g1 = await pool.admit(pages=2)
    g2 = await pool.admit(pages=3)
    f = s.record()
    pool.record_use([g1.row], f)
    s.complete()
    pool.free([g1.row])
    pool.free([g2.row], fence=Transfer(done=True))
    async with bounded():
        await pool.drain()
    assert pool.pending_size() == 0 and pool.stats().pages_pending == 0
    pool.check_invariants()
    await pool.close()
