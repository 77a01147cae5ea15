"""Counters a scrape can trust: each call counted once, figures that agree.

* a queued call whose own ``timeout=`` fires and whose task is cancelled in
  the same loop turn raises ``CancelledError``: it counts as a cancellation,
  not also as a timeout (``timeouts`` counts calls that raised
  ``TimeoutError``);
* a waiter granted at hand-over and cancelled before it resumed is in the
  wait histogram (it was granted) and in ``cancellations`` (docs/api.md, Metrics);
* ``admits`` equals ``admit_wait_histogram.count`` in every snapshot, even
  one read while an admission lands (a scrape from another thread reads a
  few operations apart; the two were separate counters);
* overdue memory is pending memory: a snapshot never reports more overdue
  rows or pages than pending ones, even when a fence completes between the
  overdue scan and the pending counts;
* ``KVPagePool.stats()`` derives ``frees`` from the ``allocs`` it reports:
  an alloc landing after that read leaves ``allocs - frees == allocated``
  (``frees`` read afresh would run ahead of the snapshot's ``allocs``).

The interleavings of a scrape from another thread are forced here by doing
the racing operation inside the snapshot, at the point where the other
thread's operation would land. (Found by an observability trial; each test
fails on the code before the fix.)
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from helpers import EventFence, FakeStream, bounded, spin, tracing, until

from asyncpool import AsyncReqToTokenPool, KVPagePool, deferral


async def test_timeout_and_cancel_in_one_turn_count_once() -> None:
    pool = AsyncReqToTokenPool(2, 8)
    held = await pool.alloc(1)
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(pool.alloc(1, timeout=0.001))
    # Until it is queued, its timeout armed: no turn more. An eager task
    # factory queues it at once, and a turn of the loop given then let its
    # timeout (armed a turn before the cancel) expire on a loaded host,
    # before the cancel was armed (3 of 300 runs, uvloop on 3.12).
    await until(lambda: pool.waiting() == 1, poll_s=0)
    # Armed after the timeout, with the same delay: due with it or after it,
    # and run after it in the turn where both are due.
    loop.call_later(0.001, task.cancel)
    deadline = loop.time() + 0.01
    while loop.time() < deadline:  # hold the loop until both are due
        pass
    async with bounded():
        with pytest.raises(asyncio.CancelledError):
            await task
    st = pool.stats()
    assert (st.timeouts, st.cancellations) == (0, 1)
    assert st.allocated == 1 and pool.available_size() == 0
    pool.free(held)
    pool.check_invariants()


async def test_a_plain_timeout_still_counts_as_one() -> None:
    pool = AsyncReqToTokenPool(2, 8)
    held = await pool.alloc(1)
    async with bounded():
        with pytest.raises(TimeoutError):
            await pool.alloc(1, timeout=0.001)
        with pytest.raises(TimeoutError):
            await pool.alloc(1, priority=1, timeout=0.001)
    st = pool.stats()
    assert (st.timeouts, st.cancellations) == (2, 0)
    pool.free(held)


async def test_admit_timeout_counts_once() -> None:
    pool = AsyncReqToTokenPool(2, 8, kv=KVPagePool(5, 4))
    held = await pool.admit(pages=4)
    async with bounded():
        with pytest.raises(TimeoutError):
            await pool.admit(pages=1, timeout=0.001)
    st = pool.stats()
    assert (st.timeouts, st.cancellations) == (1, 0)
    pool.free([held.row])


async def test_cancelled_after_grant_is_observed_and_counted() -> None:
    pool = AsyncReqToTokenPool(2, 8)
    held = await pool.alloc(1)
    task = asyncio.ensure_future(pool.alloc(1))
    await spin(1)
    pool.free(held)  # granted at hand-over
    task.cancel()  # before it resumes: the row goes back
    async with bounded():
        with pytest.raises(asyncio.CancelledError):
            await task
    st = pool.stats()
    assert st.cancellations == 1 and st.allocated == 0
    assert st.wait_histogram.count == st.alloc_calls == 2


async def test_admits_equal_the_histogram_count_in_a_torn_read() -> None:
    pool = AsyncReqToTokenPool(4, 8, kv=KVPagePool(9, 4))
    assert pool.try_admit(1) is not None
    pages = pool._pages
    assert pages is not None
    grant = pages.grant
    mid: list[Any] = []

    def scrape_lands_mid_admission(row: int, taken: Any) -> Any:
        # A direct admission has counted its zero wait and not yet attached
        # its pages: where a scrape from another thread may read.
        mid.append(pool.stats(summaries=False))
        return grant(row, taken)

    pages.grant = scrape_lands_mid_admission  # type: ignore[method-assign]
    try:
        assert pool.try_admit(1) is not None
    finally:
        del pages.grant
    (st,) = mid
    assert st.admits == st.admit_wait_histogram.count
    after = pool.stats()
    assert after.admits == after.admit_wait_histogram.count == 2


def completes_after_the_overdue_scan(pool: AsyncReqToTokenPool, fence: EventFence) -> Any:
    """Make ``pool.stats()`` see ``fence`` complete and be reclaimed between
    its overdue scan and its pending counts (the loop thread's work while a
    scrape reads); returns the patched scanner, to ``del`` afterwards."""
    overdue = pool._overdue
    assert overdue is not None
    counts = overdue.counts

    def scan_then_complete(**kwargs: Any) -> Any:
        result = counts(**kwargs)
        fence.set()
        pool.reclaim()
        return result

    overdue.counts = scan_then_complete  # type: ignore[method-assign]
    return overdue


async def test_overdue_never_exceeds_pending_in_a_torn_read() -> None:
    pool = AsyncReqToTokenPool(4, 8, kv=KVPagePool(9, 4), fence_timeout=1e-9)
    grant = await pool.admit(pages=2)
    fence = EventFence()
    pool.free([grant.row], fence=fence)
    overdue = completes_after_the_overdue_scan(pool, fence)
    try:
        st = pool.stats()
    finally:
        del overdue.counts
    assert st.pending == 0  # read after the reclaim (the page counts before the scan)
    assert st.overdue_rows <= st.pending and st.overdue_pages <= st.pages_pending
    pool.check_invariants()
    await pool.close()  # joins the fence watcher the pending free started


async def test_overdue_fences_read_zero_when_all_they_held_completed() -> None:
    pool = AsyncReqToTokenPool(4, 8, fence_timeout=1e-9)  # rows only
    (row,) = await pool.alloc(1)
    fence = EventFence()
    pool.free([row], fence=fence)
    overdue = completes_after_the_overdue_scan(pool, fence)
    try:
        st = pool.stats()
    finally:
        del overdue.counts
    assert (st.pending, st.overdue_rows, st.overdue_fences) == (0, 0, 0)
    await pool.close()


def test_kv_stats_survive_a_queue_added_mid_read() -> None:
    # KVPagePool.stats() may be read from another thread (a scrape): the
    # owner's next free behind a new stream lands inside its walk of the
    # pending queues, here from a trace hook at the walk's first line.
    kv = KVPagePool(64, 4)
    streams = [FakeStream(), FakeStream()]
    for s in streams:
        pages = kv.alloc(2)
        assert pages is not None
        kv.free(pages, fence=s.record())
    led = kv._ledger
    landed: list[int] = []

    def owner_frees(frame: Any, event: str, arg: Any) -> Any:
        if event == "line" and not landed:
            landed.append(1)
            pages = kv.alloc(2)
            assert pages is not None
            kv.free(pages, fence=FakeStream().record())  # a queue added
        return owner_frees

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        back = frame.f_back
        if (
            frame.f_code.co_filename == deferral.__file__
            and back is not None
            and back.f_code.co_name == "pending_fences"
        ):
            return owner_frees  # inside the walk (a comprehension of it)
        return None

    with tracing(tracer):
        st = kv.stats()
    assert landed and st.pending_fences in (2, 3)
    assert st.free + st.allocated + st.pending + st.quarantined == st.capacity
    assert len(led.pending_fences()) == 3
    kv.check_invariants()


def _kv_stats_with_an_alloc_landing_at(attr: str) -> tuple[KVPagePool, Any]:
    """``kv.stats()`` of a pool with 2 pages pending, where ``kv.alloc(3)``
    (the owner's, as from another thread) lands at the scrape's first read
    of the ledger's ``attr``; the alloc's own reads pass through."""
    kv = KVPagePool(64, 4)
    s = FakeStream()
    pages = kv.alloc(2)
    assert pages is not None
    kv.free(pages, fence=s.record())
    led = kv._ledger
    landed: list[int] = []

    class LandsAtFirstRead:
        def __get__(self, obj: Any, owner: Any) -> int:
            if not landed:
                landed.append(1)
                assert kv.alloc(3) is not None
            return obj.__dict__[attr]  # type: ignore[no-any-return]

        def __set__(self, obj: Any, value: int) -> None:
            obj.__dict__[attr] = value

    led.__dict__[attr] = getattr(led, attr)
    cls = type(led)
    led.__class__ = type("TornLedger", (cls,), {attr: LandsAtFirstRead()})
    try:
        st = kv.stats()
    finally:
        led.__class__ = cls
    assert landed
    return kv, st


def test_kv_stats_add_up_in_a_torn_read() -> None:
    # An alloc landing between the counts a scrape reads (led.pending, read
    # twice by the old stats()): the four still add up to capacity
    # (allocated is derived, as in PoolStats).
    kv, st = _kv_stats_with_an_alloc_landing_at("pending")
    assert st.free + st.allocated + st.pending + st.quarantined == st.capacity
    assert st.frees >= 0 and st.allocs - st.frees == st.allocated
    kv.check_invariants()


def test_kv_stats_frees_follow_the_allocs_read_when_an_alloc_lands_after_it() -> None:
    # An alloc landing between the lifetime total and the free count a
    # scrape reads (led.free_count, read after led.allocs): frees is derived
    # from the allocs this snapshot reports (allocs - frees == allocated),
    # never read afresh, so it never runs ahead of the snapshot's allocs.
    kv, st = _kv_stats_with_an_alloc_landing_at("free_count")
    assert st.free + st.allocated + st.pending + st.quarantined == st.capacity
    assert st.allocs - st.frees == st.allocated
    assert st.frees <= st.allocs
    kv.check_invariants()
