"""``force_release`` of a fence that faulted says so.

An operator whose prefill peer died force-releases its transfers; those that
raised from ``query()`` (the peer's failure reported) had their rows and pages
quarantined, which ``force_release`` leaves as they are. The warning used to
read "holds no row and no page of this pool (never given to it, already
completed and reclaimed, or released before)": as if the memory were back in
circulation, or the operator had passed the wrong object (a disaggregated
decode router's trial). Now it says the fence faulted and what is behind it
stays quarantined, on the asyncio pool, the synchronous pool and a bare page
pool, and nothing changes.
"""

from __future__ import annotations

import logging

import pytest
from helpers import grouped_pool, kv_group, pool_snapshot

from asyncpool import AsyncReqToTokenPool, KVPagePool, ReqToTokenPool


class DeadTransfer:
    """A transfer handle whose peer died: ``query()`` raises."""

    def query(self) -> bool:
        raise RuntimeError("KV transfer failed: peer gone")

    def synchronize(self) -> None:
        raise RuntimeError("KV transfer failed: peer gone")

    def __repr__(self) -> str:
        return "DeadTransfer()"


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "force_release" in r.getMessage()
    ]


async def test_the_async_pool_says_the_fence_faulted(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="asyncpool")
    pool = AsyncReqToTokenPool(5, 8, kv=KVPagePool(9, 4), name="decode")
    grant = pool.try_admit(pages=2)
    assert grant is not None
    dead = DeadTransfer()
    pool.free([grant.row], fence=dead)
    pool.reclaim()
    st = pool.stats()
    assert (st.quarantined, st.pages_quarantined) == (1, 2)
    before = pool_snapshot(pool)
    caplog.clear()
    assert pool.force_release(dead) == (0, 0)
    assert pool_snapshot(pool) == before
    (msg,) = warnings_of(caplog)
    assert "faulted" in msg and "quarantined" in msg, msg
    assert "never given" not in msg, msg
    await pool.close()


async def test_pages_detached_behind_a_faulted_transfer(caplog: pytest.LogCaptureFixture) -> None:
    # The pages-only abort (docs/cuda.md): only the page ledger saw the fault.
    caplog.set_level(logging.WARNING, logger="asyncpool")
    pool = AsyncReqToTokenPool(5, 8, kv=KVPagePool(9, 4))
    assert pool.kv is not None
    grant = pool.try_admit(pages=2)
    assert grant is not None
    dead = DeadTransfer()
    pool.kv.free(pool.detach_pages(grant.row, host=True), fence=dead)
    pool.free([grant.row])
    pool.reclaim()
    assert pool.stats().pages_quarantined == 2
    caplog.clear()
    assert pool.force_release(dead) == (0, 0)
    (msg,) = warnings_of(caplog)
    assert "faulted" in msg and "never given" not in msg, msg
    await pool.close()


async def test_a_faulted_fence_still_recorded_as_a_use_says_both(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The dead transfer also wrote into a running request's row (a use
    recorded on it): the warning read "this fence holds no row and no page
    of this pool; dropped it from the recorded uses", as if nothing were
    quarantined behind it, where the synchronous pool said it faulted. It
    now says the fence faulted, its memory stays quarantined, and the use
    was dropped."""
    caplog.set_level(logging.WARNING, logger="asyncpool")
    pool = AsyncReqToTokenPool(5, 8, kv=KVPagePool(9, 4), name="decode")
    lost = pool.try_admit(pages=2)
    running = pool.try_admit(pages=1)
    assert lost is not None and running is not None
    dead = DeadTransfer()
    pool.record_use([running.row], dead)
    pool.free([lost.row], fence=dead)
    pool.reclaim()
    assert (pool.stats().quarantined, pool.stats().pages_quarantined) == (1, 2)
    caplog.clear()
    assert pool.force_release(dead) == (0, 0)
    (msg,) = warnings_of(caplog)
    assert "faulted" in msg and "quarantined" in msg, msg
    assert "1 allocated row" in msg and "holds no row" not in msg, msg
    pool.free([running.row])  # the use was dropped: it waits for nothing
    assert pool.pending_size() == 0 and pool.stats().quarantined == 1
    pool.check_invariants()
    await pool.close()

    sync = ReqToTokenPool(5, 8, device="cpu", enable_memory_saver=False)
    lost_rows, running_rows = sync.alloc(1), sync.alloc(1)
    assert lost_rows is not None and running_rows is not None
    sync.record_use(running_rows, dead)
    sync.free(lost_rows, fence=dead)
    sync.reclaim()
    caplog.clear()
    assert sync.force_release(dead) == 0
    (msg,) = warnings_of(caplog)
    assert "faulted" in msg and "1 allocated row forgets its use" in msg, msg


def test_the_sync_pool_and_a_bare_page_pool_say_so_too(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="asyncpool")
    pool = ReqToTokenPool(5, 8, device="cpu", enable_memory_saver=False)
    rows = pool.alloc(1)
    assert rows is not None
    dead = DeadTransfer()
    pool.free(rows, fence=dead)
    pool.reclaim()
    assert pool.stats().quarantined == 1
    caplog.clear()
    assert pool.force_release(dead) == 0
    (msg,) = warnings_of(caplog)
    assert "faulted" in msg and "rows behind it are quarantined" in msg, msg
    assert pool.stats().quarantined == 1

    kv = KVPagePool(9, 4)
    pages = kv.alloc(3)
    assert pages is not None
    kv.free(pages, fence=dead)
    kv.reclaim()
    assert kv.stats().quarantined == 3
    caplog.clear()
    assert kv.force_release(dead) == 0
    (msg,) = warnings_of(caplog)
    assert "faulted" in msg and "pages behind it are quarantined" in msg, msg
    assert kv.stats().quarantined == 3


async def test_a_dead_peers_transfers_released_together_say_they_faulted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The operator releases every transfer of the dead peer in one call
    (a list): the one line read "these fences hold nothing pending in this
    pool (never given to it, ...); nothing changed" where one fence at a
    time said it faulted. The line now says how many of them faulted and
    that what they held stays quarantined, on every kind of pool, and
    nothing changes."""
    caplog.set_level(logging.WARNING, logger="asyncpool")
    dead, other = DeadTransfer(), DeadTransfer()
    never = DeadTransfer()  # never given to any pool
    pool = AsyncReqToTokenPool(5, 8, kv=KVPagePool(9, 4), name="decode")
    grants = [pool.try_admit(pages=2) for _ in range(2)]
    running = pool.try_admit(pages=1)
    assert None not in grants and running is not None
    for grant, fence in zip(grants, [dead, other], strict=True):
        assert grant is not None
        pool.free([grant.row], fence=fence)
    pool.record_use([running.row], other)
    pool.reclaim()
    assert (pool.stats().quarantined, pool.stats().pages_quarantined) == (2, 4)
    caplog.clear()
    assert pool.force_release([dead, other, never]) == (0, 0)
    (msg,) = warnings_of(caplog)
    assert "2 of these fences faulted" in msg and "rows and pages" in msg, msg
    assert "quarantined" in msg and "1 allocated row" in msg, msg
    assert "never given" not in msg and "hold nothing" not in msg, msg
    assert (pool.stats().quarantined, pool.stats().pages_quarantined) == (2, 4)
    pool.free([running.row])  # the use was dropped: it waits for nothing
    assert pool.pending_size() == 0
    pool.check_invariants()
    await pool.close()

    sync = ReqToTokenPool(5, 8, device="cpu", enable_memory_saver=False)
    for fence in (dead, other):
        rows = sync.alloc(1)
        assert rows is not None
        sync.free(rows, fence=fence)
    sync.reclaim()
    caplog.clear()
    assert sync.force_release([dead, other]) == 0
    (msg,) = warnings_of(caplog)
    assert "all of these fences faulted" in msg and "the rows behind them" in msg, msg
    assert sync.stats().quarantined == 2

    kv = KVPagePool(9, 4)
    pages = kv.alloc(3)
    assert pages is not None
    kv.free(pages, fence=dead)
    kv.reclaim()
    caplog.clear()
    assert kv.force_release([dead, never]) == 0
    (msg,) = warnings_of(caplog)
    assert "1 of these fences faulted" in msg and "the pages behind it" in msg, msg
    assert kv.stats().quarantined == 3
    caplog.clear()
    kv.force_release([never, DeadTransfer()])  # none faulted: as before
    (msg,) = warnings_of(caplog)
    assert "never given" in msg and "faulted" not in msg, msg


def test_a_fence_never_given_still_reads_as_before(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="asyncpool")
    kv = KVPagePool(9, 4)
    kv.force_release(DeadTransfer())
    (msg,) = warnings_of(caplog)
    assert "never given" in msg and "faulted" not in msg, msg


async def test_fences_faulted_in_one_kv_group_only_released_together_say_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Several fences released at once on a pool with KV groups, one of
    which faulted holding only one group's detached pages (the pages-only
    abort): the row ledger never saw it, that group's ledger did. The line
    counts it as faulted (every ledger of the pool is asked, as for one
    fence), and nothing changes."""
    caplog.set_level(logging.WARNING, logger="asyncpool")
    pool = grouped_pool(rows=2)
    grant = pool.try_admit({"swa": 1, "full": 3})
    assert grant is not None
    dead, never = DeadTransfer(), DeadTransfer()
    kv_group(pool, "full").free(pool.detach_pages(grant.row, group="full", host=True), fence=dead)
    pool.free([grant.row])
    pool.reclaim()
    st = pool.stats()
    assert (st.quarantined, st.pages_quarantined) == (0, 3)
    before = pool_snapshot(pool)
    caplog.clear()
    assert pool.force_release([dead, never]) == (0, 0)
    (msg,) = warnings_of(caplog)
    assert "1 of these fences faulted" in msg and "the rows and pages behind it" in msg, msg
    assert "never given" not in msg, msg
    assert pool_snapshot(pool) == before
    pool.check_invariants()
    await pool.close()
