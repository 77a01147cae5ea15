"""``KVPagePool.force_release``: a bare page pool's escape hatch for a fence
that will never complete (a transfer whose peer died), as the row pools
have. An engine that pairs the synchronous ``ReqToTokenPool`` with a bare
page pool (the seed's layout) could force-release the rows behind a dead
transfer but not the pages: they were lost for good in either reclaim mode
(found by a trial of the tensor-parallel mode). Pages quarantined behind a
fence that *faulted* stay quarantined. On the page pool of an
``AsyncReqToTokenPool`` the pool's own ``force_release`` is the one to call
(it returns rows and pages together and keeps the overdue counts).
"""

from __future__ import annotations

import logging

import pytest
from helpers import EventFence, Streams, kv_snapshot

from asyncpool import AsyncReqToTokenPool, KVPagePool


@pytest.fixture(autouse=True)
def _quiet(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="asyncpool")


@pytest.mark.parametrize("reclaim", ["auto", "explicit"])
def test_pages_behind_a_stuck_fence_come_back(
    reclaim: str, caplog: pytest.LogCaptureFixture
) -> None:
    kv = KVPagePool(9, 4, reclaim=reclaim)  # 8 pages
    pages = kv.alloc(8)
    assert pages is not None
    stuck = EventFence()  # never set: its writer is dead
    kv.free(pages[:5].clone(), fence=stuck)
    assert (kv.pending_size(), kv.available_size()) == (5, 0)
    assert kv.alloc(1) is None  # waited for, not exhaustion: still pending
    asked = stuck.queries
    assert kv.force_release(stuck) == 5
    assert stuck.queries == asked  # never asks the fence
    assert (kv.pending_size(), kv.available_size()) == (0, 5)
    assert any("5 pages returned to circulation" in r.getMessage() for r in caplog.records)
    again = kv.alloc(5)
    assert again is not None and sorted(again.tolist()) == sorted(pages[:5].tolist())
    kv.check_invariants()


def test_pages_still_waiting_for_another_fence_are_said_so(
    caplog: pytest.LogCaptureFixture, kit: Streams
) -> None:
    kv = KVPagePool(9, 4)
    pages = kv.alloc(2)
    assert pages is not None
    stuck = EventFence()
    stream, gate = kit.stream(), kit.event()
    stream.launch(gate.wait)
    kv.free(pages, fence=stuck, after=stream)  # waits for both
    assert kv.force_release(stuck) == 0  # still waits for the stream
    messages = [r.getMessage() for r in caplog.records]
    assert any("still wait for other fences" in m for m in messages)
    assert kv.pending_size() == 2
    gate.set()
    stream.synchronize()
    assert kv.reclaim() == 2  # `stuck` no longer holds them
    kv.check_invariants()


def test_a_fence_holding_nothing_says_so(caplog: pytest.LogCaptureFixture) -> None:
    kv = KVPagePool(9, 4)
    assert kv.force_release(EventFence()) == 0
    assert any("no page was pending" in r.getMessage() for r in caplog.records)


def test_faulted_pages_stay_quarantined(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.CRITICAL, logger="asyncpool")
    kv = KVPagePool(9, 4)
    pages = kv.alloc(3)
    assert pages is not None
    bad = EventFence()
    bad.error = RuntimeError("transfer failed")
    bad.set()
    kv.free(pages, fence=bad)
    assert kv.quarantined_size() == 3
    assert kv.force_release(bad) == 0
    assert (kv.quarantined_size(), kv.available_size()) == (3, 5)
    kv.check_invariants()


def test_a_non_fence_is_refused_and_nothing_changes() -> None:
    kv = KVPagePool(9, 4)
    pages = kv.alloc(3)
    assert pages is not None
    kv.free(pages[:2].clone(), fence=EventFence())
    before = kv_snapshot(kv)
    with pytest.raises(TypeError):
        kv.force_release(object())  # type: ignore[arg-type]
    assert kv_snapshot(kv) == before


async def test_the_page_pool_of_an_async_pool_refers_to_the_pool() -> None:
    kv = KVPagePool(9, 4)
    pool = AsyncReqToTokenPool(4, 8, kv=kv)
    grant = await pool.admit(pages=2)
    stuck = EventFence()
    pool.free([grant.row], fence=stuck)
    before = kv_snapshot(kv)
    with pytest.raises(RuntimeError, match=r"pool's force_release"):
        kv.force_release(stuck)
    assert kv_snapshot(kv) == before
    assert pool.force_release(stuck) == (1, 2)
    await pool.close()
