"""One faulted fence is one fault: counted once, logged as an error once.

An engine records one step fence on its whole batch and frees the batch
request by request over later steps. If that fence faults, every free meets
it again. ``fence_errors`` / ``page_fence_errors`` count *fences that
faulted* (docs/api.md, Metrics), so the count stays 1 however many frees, rows or
batches meet the fence; the first later quarantine is logged as a warning
that names its rows, the rest at DEBUG with a running count (one line per
free would flood the log), and the first error names every row of its call. Each
quarantine still runs the owner's fault hook: a waiter that more quarantine
makes unfittable is failed with ``CapacityError``. (A trial found the count
going up once per ``free`` call and the error line naming only a call's
first row.)
"""

from __future__ import annotations

import asyncio
import gc
import logging
import weakref

import pytest
from helpers import EventFence, bounded, spin

from asyncpool import (
    AsyncReqToTokenPool,
    CapacityError,
    KVPagePool,
    ReqToTokenPool,
)
from asyncpool.ledger import SlotLedger

DEFERRAL = "asyncpool.deferral"


def faulted() -> EventFence:
    fence = EventFence()
    fence.error = RuntimeError("illegal memory access (simulated)")
    fence.set()
    return fence


def records(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == DEFERRAL and r.levelno == level]


async def test_one_fence_met_by_two_frees_counts_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="asyncpool")
    pool = AsyncReqToTokenPool(9, 8)
    a, b = await pool.alloc(2)
    bad = EventFence()
    pool.record_use([a, b], bad)
    bad.error = RuntimeError("dma failed")
    bad.set()
    pool.free([a])
    pool.free([b])
    st = pool.stats()
    assert (st.fence_errors, st.quarantined, st.pending) == (1, 2, 0)
    errors, warnings = records(caplog, logging.ERROR), records(caplog, logging.WARNING)
    assert len(errors) == 1 and f"[{a}]" in errors[0]
    assert len(warnings) == 1 and "faulted before" in warnings[0] and f"[{b}]" in warnings[0]
    pool.check_invariants()


async def test_alternating_fences_in_one_free_count_once(caplog: pytest.LogCaptureFixture) -> None:
    # The single-fence path remembers only the fence it asked last: rows
    # that alternate a faulted fence and a good one meet the fault twice.
    caplog.set_level(logging.WARNING, logger="asyncpool")
    pool = AsyncReqToTokenPool(9, 8)
    a, b, c = await pool.alloc(3)
    bad, good = faulted(), EventFence()
    good.set()
    pool.record_use([a, c], bad)
    pool.record_use([b], good)
    assert pool.free([a, b, c]) == 1
    st = pool.stats()
    assert (st.fence_errors, st.quarantined) == (1, 2)
    errors = records(caplog, logging.ERROR)
    assert errors == [errors[0]] and f"[{a}, {c}]" in errors[0]
    assert not records(caplog, logging.WARNING)


async def test_error_line_names_every_row_of_the_call(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="asyncpool")
    pool = AsyncReqToTokenPool(9, 8)
    rows = await pool.alloc(3)
    pool.free(rows, fence=faulted())
    errors = records(caplog, logging.ERROR)
    assert len(errors) == 1 and str(sorted(rows)) in errors[0]
    assert pool.stats().quarantined == 3


async def test_a_reclaim_and_a_later_free_count_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.CRITICAL, logger="asyncpool")
    pool = AsyncReqToTokenPool(9, 8)
    a, b = await pool.alloc(2)
    bad = EventFence()
    pool.record_use([a, b], bad)
    pool.free([a])  # pending behind bad
    bad.error = RuntimeError("lost")
    bad.set()
    pool.reclaim()  # a's batch faults here
    pool.free([b])  # b meets the same fence
    st = pool.stats()
    assert (st.fence_errors, st.quarantined) == (1, 2)
    await pool.close()  # joins the fence watcher the pending free started


async def test_admitted_rows_count_once_in_both_ledgers(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.CRITICAL, logger="asyncpool")
    pool = AsyncReqToTokenPool(9, 8, kv=KVPagePool(17, 4))
    g1 = await pool.admit(pages=2)
    g2 = await pool.admit(pages=2)
    bad = faulted()
    pool.record_use([g1.row, g2.row], bad)
    pool.free([g1.row])
    pool.free([g2.row])
    st = pool.stats()
    assert (st.fence_errors, st.page_fence_errors) == (1, 1)
    assert (st.quarantined, st.pages_quarantined) == (2, 4)


def test_sync_pool_frees_request_by_request_count_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.CRITICAL, logger="asyncpool")
    pool = ReqToTokenPool(9, 8, device="cpu", enable_memory_saver=False)
    rows = pool.alloc(8)
    assert rows is not None
    bad = faulted()
    pool.record_use(rows, bad)
    for row in rows:
        pool.free(row)
    st = pool.stats()
    assert (st.fence_errors, st.quarantined) == (1, 8)


async def test_a_batch_freed_request_by_request_behind_one_fault_logs_a_few_lines(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # One faulted step fence over a batch of 64 admitted requests, freed one
    # by one as the scheduler processes them: an error and one warning per
    # ledger, the rest at DEBUG with a running count (a trial found 126
    # warnings, one per free and ledger: O(requests) lines for one event).
    caplog.set_level(logging.DEBUG, logger="asyncpool")
    pool = AsyncReqToTokenPool(65, 8, kv=KVPagePool(129, 4))
    grants = [await pool.admit(pages=1) for _ in range(64)]
    bad = faulted()
    pool.record_use([g.row for g in grants], bad)
    for g in grants:
        pool.free(g.row)
    st = pool.stats()
    assert (st.fence_errors, st.page_fence_errors) == (1, 1)
    assert (st.quarantined, st.pages_quarantined) == (64, 64)
    errors, warnings = records(caplog, logging.ERROR), records(caplog, logging.WARNING)
    assert len(errors) == 2, errors  # rows and pages, one each
    assert len(warnings) == 2, warnings
    assert all("faulted before" in w and "logged at DEBUG" in w for w in warnings)
    debug = records(caplog, logging.DEBUG)
    assert any("(63 since its error)" in d and "rows" in d for d in debug)
    assert any("(63 since its error)" in d and "pages" in d for d in debug)


async def test_quarantine_from_a_repeat_meeting_still_sheds_waiters(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The fault hook runs on every quarantine, not only the counted one: a
    # waiter that fit after the first quarantine and no longer fits after
    # the second is failed, not left to block its queue for good.
    caplog.set_level(logging.CRITICAL, logger="asyncpool")
    pool = AsyncReqToTokenPool(5, 8)  # capacity 4
    a, b, c, d = await pool.alloc(4)
    bad = faulted()
    pool.record_use([a, b], bad)
    waiter = asyncio.ensure_future(pool.alloc(3))
    await spin()
    pool.free([a])  # capacity left 3: the waiter may still fit
    await spin()
    assert not waiter.done()
    pool.free([b])  # capacity left 2: it never can
    async with bounded():
        with pytest.raises(CapacityError):
            await waiter
    assert pool.stats().fence_errors == 1
    pool.free([c, d])
    pool.check_invariants()


async def test_remembered_faults_keep_no_fence_alive(caplog: pytest.LogCaptureFixture) -> None:
    # A transfer handle may own its staging buffer: remembering that it
    # faulted (to count it once) must not keep it, or its error's frames.
    caplog.set_level(logging.CRITICAL, logger="asyncpool")
    pool = AsyncReqToTokenPool(9, 8, kv=KVPagePool(17, 4))
    refs = []
    for _ in range(4):
        grant = await pool.admit(pages=2)
        bad = faulted()
        refs.append(weakref.ref(bad))
        pool.free([grant.row], fence=bad)
        del bad
    gc.collect()
    # The newest too: last_fence_error keeps the error, not the traceback
    # that reached the query() frame (tests/test_soak_gaps.py).
    assert [r() for r in refs] == [None] * 4
    st = pool.stats()
    assert (st.fence_errors, st.page_fence_errors, st.quarantined) == (4, 4, 4)


def test_a_fault_is_reported_even_when_a_deferral_hook_raises(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # free() reports a call's faults after deferring its pending rows; a
    # hook raising there must not swallow the report (the owner sheds its
    # waiters on it).
    faults: list[object] = []

    def on_pending(fence: object) -> None:
        raise RuntimeError("hook failed")

    led = SlotLedger(5, on_pending=on_pending, on_fault=lambda f, e: faults.append(f))
    rows = led.take(2)
    assert rows is not None
    bad, open_ = faulted(), EventFence()
    led.record_use([rows[0]], bad)
    led.record_use([rows[1]], open_)
    caplog.set_level(logging.CRITICAL, logger="asyncpool")
    with pytest.raises(RuntimeError, match="hook failed"):
        led.free(rows)
    assert faults == [bad] and led.fence_errors == 1 and led.quarantined == 1
