"""``ReqToTokenPool.force_release``: the synchronous pool's escape hatch for
a fence that will never complete (a transfer whose peer died), as on the
asyncio pool. Without it, rows behind a stuck fence were lost to a
synchronous engine for good (a drop-in trial found no way out). Rows
quarantined behind a fence that *faulted* stay quarantined: nothing returns
them, on either pool.
"""

from __future__ import annotations

import logging

import pytest
from helpers import EventFence, pool_snapshot

from asyncpool import AsyncReqToTokenPool, KVPagePool, ReqToTokenPool


@pytest.fixture(autouse=True)
def _quiet(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="asyncpool")


def make() -> ReqToTokenPool:
    return ReqToTokenPool(6, 8, device="cpu", enable_memory_saver=False)


def test_rows_behind_a_stuck_fence_come_back(caplog: pytest.LogCaptureFixture) -> None:
    pool = make()
    rows = pool.alloc(3)
    assert rows is not None
    stuck = EventFence()  # never set: its writer is dead
    pool.record_use(rows, stuck)
    pool.free(rows[:2])
    assert pool.pending_size() == 2 and pool.available_size() == 2
    asked = stuck.queries
    assert pool.force_release(stuck) == 2
    assert stuck.queries == asked  # never asks the fence
    assert pool.pending_size() == 0 and pool.available_size() == 4
    # The row still allocated forgot its use: freed now, it is free at once.
    assert pool.free(rows[2]) == 1
    assert pool.available_size() == 5
    assert any("returned to circulation" in r.getMessage() for r in caplog.records)
    pool.check_invariants()


def test_a_fence_holding_nothing_says_so(caplog: pytest.LogCaptureFixture) -> None:
    pool = make()
    (row,) = pool.alloc(1) or []
    fence = EventFence()
    pool.record_use([row], fence)
    assert pool.force_release(fence) == 0
    messages = [r.getMessage() for r in caplog.records]
    assert any(
        "no row was pending" in m and "1 allocated row forgets its use" in m for m in messages
    )
    assert pool.free(row) == 1


def test_faulted_rows_stay_quarantined(caplog: pytest.LogCaptureFixture) -> None:
    pool = make()
    caplog.set_level(logging.CRITICAL, logger="asyncpool")
    rows = pool.alloc(2)
    assert rows is not None
    bad = EventFence()
    bad.error = RuntimeError("transfer failed")
    bad.set()
    pool.free(rows, fence=bad)
    assert pool.quarantined_size() == 2
    assert pool.force_release(bad) == 0
    pool.clear()
    assert pool.quarantined_size() == 2 and pool.available_size() == 3


def test_a_non_fence_is_refused_and_nothing_changes() -> None:
    pool = make()
    rows = pool.alloc(2)
    assert rows is not None
    pool.record_use(rows, EventFence())
    pool.free(rows[0])
    before = pool_snapshot(pool)
    with pytest.raises(TypeError):
        pool.force_release(object())  # type: ignore[arg-type]
    assert pool_snapshot(pool) == before


def test_rows_still_waiting_for_another_fence_are_said_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pool = make()
    (row,) = pool.alloc(1) or []
    stuck, other = EventFence(), EventFence()
    pool.record_use([row], other)
    pool.free(row, fence=stuck)  # waits for both
    assert pool.force_release(stuck) == 0  # still waits for `other`
    messages = [r.getMessage() for r in caplog.records]
    assert any("still wait for other fences" in m for m in messages)
    assert not any("no row was pending" in m for m in messages)
    other.set()
    assert pool.reclaim() == 1  # `stuck` no longer holds it


async def test_the_async_pool_says_so_too(caplog: pytest.LogCaptureFixture) -> None:
    pool = AsyncReqToTokenPool(4, 8, kv=KVPagePool(9, 4))
    grant = await pool.admit(pages=2)
    stuck, other = EventFence(), EventFence()
    pool.record_use([grant.row], other)
    pool.free([grant.row], fence=stuck)
    assert pool.force_release(stuck) == (0, 0)
    messages = [r.getMessage() for r in caplog.records]
    assert any("still wait for other fences" in m for m in messages)
    assert not any("holds no row" in m for m in messages)
    other.set()
    assert pool.reclaim() == 1
    await pool.close()
