"""What ``force_release`` returns is counted apart, not as completed fences.

``force_release`` is the operator's escape hatch for a fence that will never
complete (a transfer whose peer died): its memory goes back with the fence
still open, a bet that the writer is dead. It used to count as a completed
fence: in ``reclaimed`` (the ``asyncpool_rows_reclaimed_total`` counter,
"rows returned to circulation by completed fences") and in the fence
latencies (the histogram of "every completed fence batch", which then
carried the dead transfer's whole stall), and nothing counted the releases
themselves, so a dashboard could not tell how often on-call had forced
memory back (a trial's on-call harness). Now ``stats().force_released`` /
``pages_force_released`` (a bare page pool's ``kv.stats().force_released``)
count them, exported as ``asyncpool_rows_force_released_total`` and
``asyncpool_pages_force_released_total``, and ``reclaimed`` and the fence
latencies keep to fences that completed.
"""

from __future__ import annotations

import logging

import pytest
from helpers import EventFence

from asyncpool import AsyncReqToTokenPool, KVPagePool, ReqToTokenPool

pytest.importorskip("prometheus_client")
from prometheus_client import CollectorRegistry

from asyncpool.metrics import PoolCollector


@pytest.fixture(autouse=True)
def _quiet(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="asyncpool")


async def test_a_forced_release_is_counted_apart_and_exported() -> None:
    pool = AsyncReqToTokenPool(9, 8, kv=KVPagePool(33, 4), name="decode")
    registry = CollectorRegistry()
    registry.register(PoolCollector(pool))
    a, b = (await pool.admit(pages=3)).row, (await pool.admit(pages=2)).row
    dead, landed = EventFence(), EventFence()  # dead never completes
    pool.free([a], fence=dead)
    pool.free([b], fence=landed)
    landed.set()
    pool.reclaim()
    assert pool.force_release(dead) == (1, 3)
    st = pool.stats()
    assert (st.reclaimed, st.force_released, st.pages_force_released) == (1, 1, 3)
    assert st.fence_latency_histogram.count == 1  # the landed fence's batch only
    assert st.fence_latency.count == 1
    assert pool.kv is not None
    kst = pool.kv.stats()
    assert (kst.reclaimed, kst.force_released, kst.fence_latency.count) == (2, 3, 1)
    sample = registry.get_sample_value
    assert sample("asyncpool_rows_force_released_total", {"pool": "decode"}) == 1
    assert sample("asyncpool_pages_force_released_total", {"pool": "decode"}) == 3
    assert sample("asyncpool_rows_reclaimed_total", {"pool": "decode"}) == 1
    assert sample("asyncpool_fence_latency_seconds_count", {"pool": "decode"}) == 1
    assert (st.free, st.pending, st.pages_free, st.pages_pending) == (8, 0, 32, 0)
    pool.check_invariants()
    await pool.close()


async def test_a_batch_moved_behind_its_next_fence_completes_as_reclaimed() -> None:
    # Released from the dead fence, the batch still waits for the other
    # one; when that completes, the release is the fence's: reclaimed.
    pool = AsyncReqToTokenPool(9, 8)
    (row,) = await pool.alloc(1)
    dead, step = EventFence(), EventFence()
    pool.free([row], fence=[dead, step])
    assert pool.force_release(dead) == (0, 0)
    st = pool.stats()
    assert (st.force_released, st.reclaimed, st.pending) == (0, 0, 1)
    step.set()
    pool.reclaim()
    st = pool.stats()
    assert (st.force_released, st.reclaimed, st.pending) == (0, 1, 0)
    assert st.fence_latency_histogram.count == 1
    await pool.close()


def test_sync_pool_and_bare_page_pool_count_forced_releases() -> None:
    pool = ReqToTokenPool(5, 8)
    rows = pool.alloc(3)
    assert rows is not None
    dead = EventFence()
    pool.free(rows, fence=dead)
    assert pool.force_release([dead]) == 3
    st = pool.stats()
    assert (st.force_released, st.reclaimed, st.fence_latency_histogram.count) == (3, 0, 0)
    kv = KVPagePool(9, 4)
    pages = kv.alloc(5)
    assert pages is not None
    kv.free(pages, fence=dead)
    assert kv.force_release(dead) == 5
    kst = kv.stats()
    assert (kst.force_released, kst.reclaimed, kst.fence_latency.count) == (5, 0, 0)
    kv.check_invariants()


async def test_kv_groups_sum_their_forced_pages() -> None:
    pool = AsyncReqToTokenPool(5, 8, kv={"full": KVPagePool(17, 4), "swa": KVPagePool(9, 4)})
    g = await pool.admit({"full": 3, "swa": 2})
    dead = EventFence()
    pool.free([g.row], fence=dead)
    assert pool.force_release(dead) == (1, 5)
    st = pool.stats()
    assert (st.force_released, st.pages_force_released) == (1, 5)
    assert st.kv_groups["full"].force_released == 3
    assert st.kv_groups["swa"].force_released == 2
    await pool.close()
