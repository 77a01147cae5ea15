"""Gaps found by a coverage run of the whole CPU suite and a hand-mutation
pass over the least-tested modules (the table is filled in below as the
sweep goes)."""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import weakref
from typing import Any

import numpy as np
import pytest
import torch
from helpers import EventFence, ManualClock, bounded, page_ids

from asyncpool import AsyncReqToTokenPool, CapacityError, KVPagePool, ReqToTokenPool, wait_fence
from asyncpool.fence_wait import _LoopWaits, _pending_waits
from asyncpool.fences import fence_list
from asyncpool.kv_pages import PageLedger
from asyncpool.ledger import SlotLedger
from asyncpool.naming import NamedLog
from asyncpool.overdue import OverdueFences
from asyncpool.threadsafe import submit_wait
from asyncpool.watcher import FenceWatcher

# -- overdue.py -------------------------------------------------------------------

TIMEOUT = 10.0


def _ledgers(clock: ManualClock) -> tuple[SlotLedger, PageLedger, OverdueFences]:
    rows_led = SlotLedger(16, clock=clock)
    pages_led = PageLedger(16, clock=clock)
    return rows_led, pages_led, OverdueFences(TIMEOUT, [rows_led, pages_led], clock=clock)


def _free_rows(led: SlotLedger, n: int, fence: object) -> None:
    rows = led.take(n)
    assert rows is not None
    led.free(rows, fence)  # type: ignore[arg-type]


def _free_pages(led: PageLedger, n: int, fence: object) -> None:
    pages = led.take(n)
    assert pages is not None
    led.free(pages, [fence])  # type: ignore[list-item]


def test_overdue_fences_are_ordered_by_their_oldest_late_batch_in_any_ledger() -> None:
    """A fence late in two ledgers is as old as its oldest late batch, wherever
    that one sits: ``x`` holds rows freed at 8 (the rows ledger is walked
    first) and pages freed at 0, so it comes before ``y``, freed at 4 (the
    mutant kept the first batch seen, 8, and listed ``y`` first)."""
    clock = ManualClock()
    rows_led, pages_led, overdue = _ledgers(clock)
    x, y = EventFence(), EventFence()
    _free_pages(pages_led, 1, x)  # t0 = 0
    clock.now = 4.0
    _free_rows(rows_led, 1, y)
    clock.now = 8.0
    _free_rows(rows_led, 1, x)
    clock.now = 30.0
    assert overdue.fences() == [x, y]


def test_the_next_check_is_due_when_the_youngest_pending_batch_turns_late() -> None:
    """With a fence overdue, the next check is due when the oldest batch that
    is not late yet turns late, whatever the order the ledgers are walked in:
    ``y``'s rows freed at 8 are walked before ``z``'s pages freed at 6, due
    at 6 + 10 - 12 = 4 s (the mutant took the first batch walked: 6 s)."""
    clock = ManualClock()
    rows_led, pages_led, overdue = _ledgers(clock)
    x, y, z = EventFence(), EventFence(), EventFence()
    _free_rows(rows_led, 1, x)  # t0 = 0: overdue at 12
    clock.now = 6.0
    _free_pages(pages_led, 1, z)
    clock.now = 8.0
    _free_rows(rows_led, 1, y)
    clock.now = 12.0
    found, due = overdue.scan()
    assert [f for f, _ in found.values()] == [x]
    assert due == 4.0
    assert overdue.check() == 4.0


def test_an_agreed_scan_is_never_due_in_the_past() -> None:
    """``scan(agreed=True)``: overdue is what ``agree()`` marked; a batch past
    the timeout that no agreement marked is due now (0), not a negative
    number of seconds (the mutant dropped the floor at 0)."""
    clock = ManualClock()
    rows_led, _, overdue = _ledgers(clock)
    x, y = EventFence(), EventFence()
    _free_rows(rows_led, 1, x)
    _free_rows(rows_led, 2, y)
    rows_led.agreed_overdue = {b.did for b in rows_led.pending_batches() if b.fence is x}
    clock.now = 30.0
    found, due = overdue.scan(agreed=True)
    assert [f for f, _ in found.values()] == [x]
    assert due == 0.0


def test_held_in_counts_only_the_ids_behind_overdue_fences() -> None:
    """``held_in`` (admission's "memory not on its way back") counts the ids
    of one ledger behind overdue fences only: 2 of the 5 pending rows, and
    none of the pages ledger's (the mutant counted every pending batch)."""
    clock = ManualClock()
    rows_led, pages_led, overdue = _ledgers(clock)
    x, y = EventFence(), EventFence()
    _free_rows(rows_led, 2, x)
    clock.now = 8.0
    _free_rows(rows_led, 3, y)
    _free_pages(pages_led, 4, y)
    clock.now = 12.0
    assert overdue.held_in(rows_led) == 2
    assert overdue.held_in(pages_led) == 0


def test_a_fence_force_released_is_forgotten_not_logged_as_completed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``forget`` (what ``force_release`` calls) drops a fence logged overdue:
    the next ``settled()`` says nothing of it (it did not complete: its memory
    was let go of), ``reported`` turns False, and should it hold memory again
    and turn overdue, it is logged again (the mutant kept it: a "completed"
    line for a fence that never completed, and no second warning)."""
    clock = ManualClock()
    rows_led, _, overdue = _ledgers(clock)
    x = EventFence()
    _free_rows(rows_led, 1, x)
    clock.now = 12.0
    with caplog.at_level(logging.INFO, logger="asyncpool.overdue"):
        overdue.check()
        assert [r.levelno for r in caplog.records] == [logging.WARNING]
        assert rows_led.force_release_all([x]) == 1
        overdue.forget(x)
        caplog.clear()
        overdue.settled()
        assert not overdue.reported
        assert caplog.records == []
        _free_rows(rows_led, 1, x)
        clock.now = 30.0
        overdue.check()
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "is overdue" in caplog.records[0].getMessage()


# -- fence_wait.py ----------------------------------------------------------------


async def test_a_fence_the_poller_dropped_is_watched_again() -> None:
    """A fence whose ``query()`` raised on the watcher's poller (dropped
    there, the loop notified) but answers "not yet" on the loop is handed
    to the watcher again, and its waiter wakes when it completes (the
    mutant left it unwatched: nobody asked it again, the wait hung)."""
    loop_thread = threading.current_thread()

    class Flaky(EventFence):
        raised = False  # its one raise, on the poller
        seen = False  # the loop asked it after that raise

        def query(self) -> bool:
            if threading.current_thread() is not loop_thread:
                if not self.raised:
                    self.raised = True
                    raise RuntimeError("a flaky query")
                return self.seen
            if self.raised and not self.seen:
                self.seen = True
                return False  # "not yet", here: watched again
            return self.seen

    fence = Flaky()
    async with bounded(5):
        await wait_fence(fence)
    assert fence.raised and fence.seen
    assert _pending_waits(asyncio.get_running_loop()) == 0


async def test_a_waiter_cancelled_before_the_check_does_not_stop_the_others() -> None:
    """A task cancelled while the check that completes its fence is already
    queued (its future cancelled, its ``finally`` not run yet) is skipped;
    the others waiting for the fence are woken and the check raises nothing
    (the mutant set a result on the cancelled future: ``InvalidStateError``
    out of the check, the others never woken)."""
    loop = asyncio.get_running_loop()
    fence = EventFence()
    quitter = asyncio.create_task(wait_fence(fence))
    stayer = asyncio.create_task(wait_fence(fence))
    await asyncio.sleep(0)
    assert _pending_waits(loop) == 1
    quitter.cancel()  # its future is cancelled now; the task unwinds next turn
    fence.set()
    _LoopWaits.of(loop)._check()  # the queued check runs first
    assert stayer.done() is False  # woken: it resumes on the loop's next turn
    async with bounded():
        await stayer
    with pytest.raises(asyncio.CancelledError):
        async with bounded():
            await quitter
    assert _pending_waits(loop) == 0


# -- threadsafe.py ----------------------------------------------------------------


def test_a_submission_to_a_closed_loop_says_how_to_go_on() -> None:
    """A thread-safe call on a pool whose loop is closed is refused at once
    with a ``RuntimeError`` that says what to do (``bind()`` the pool in its
    new loop), not asyncio's bare "Event loop is closed" (what the mutant
    let through); nothing is taken."""
    pool = AsyncReqToTokenPool(2, 16)
    loop = asyncio.new_event_loop()

    async def bind() -> None:
        pool.bind()

    loop.run_until_complete(bind())
    loop.close()
    free = pool.available_size()
    for call in (lambda: pool.alloc_threadsafe(1), lambda: submit_wait(loop, _never, _unused)):
        with pytest.raises(RuntimeError, match=r"bind\(\) the pool in its new loop"):
            call()
    assert pool.available_size() == free
    assert pool.stats().allocated == 0


async def _never() -> int:
    raise AssertionError("never started")


def _unused(_: int) -> None:
    raise AssertionError("nothing to give back")


# -- figures.py -------------------------------------------------------------------


async def test_pages_alone_agreed_overdue_are_counted_and_listed(
    group: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An explicit pool without ``fence_timeout`` scans for what ``agree()``
    marked overdue once any ledger holds a mark, a page ledger's too: pages
    trimmed off a live row behind a stuck transfer (no row pending) are
    counted by ``stats()`` and listed by ``overdue_fences()`` (the mutant
    looked at the rows ledger's marks only: 0 fences, an empty list)."""
    import asyncpool.agreement as agreement

    pool = AsyncReqToTokenPool(4, 8, kv=KVPagePool(9, 4), reclaim="explicit")
    g = pool.try_admit(pages=3)
    assert g is not None
    transfer = EventFence()
    pool.trim_pages([g.row], 1, fence=transfer)
    real = agreement._all_reduce_min
    nh = len(agreement._HEADER) * agreement.SLOTS

    def overdue_on_another_rank(values: list[int], grp: Any, dev: Any, **kw: Any) -> Any:
        out = real(values, grp, dev, **kw)
        for i in range(2 * nh + 1, len(out) - 1, 3):  # [done, -overdue, -faulted] each
            out[i] = -1
        return out

    monkeypatch.setattr(agreement, "_all_reduce_min", overdue_on_another_rank)
    assert pool.agree(group) == (0, 0)
    st = pool.stats()
    assert (st.overdue_fences, st.overdue_rows, st.overdue_pages) == (1, 0, 2)
    assert pool.overdue_fences() == [transfer]
    monkeypatch.setattr(agreement, "_all_reduce_min", real)
    transfer.set()
    assert pool.agree(group) == (0, 2)
    assert pool.overdue_fences() == []
    pool.free([g.row])
    pool.check_invariants()
    await pool.close()


# -- lines no test ran (the coverage run) -------------------------------------------


def test_a_named_log_says_what_it_wraps() -> None:
    """``repr(NamedLog)`` names its logger and the pool's name (naming.py)."""
    log = NamedLog(logging.getLogger("asyncpool.deferral"), "swa")
    assert repr(log) == "<NamedLog asyncpool.deferral 'swa'>"


def test_a_collected_fence_logged_overdue_is_forgotten_silently(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A fence logged overdue that completed and was collected before the
    next ``settled()`` (only a weak reference is kept) is dropped without a
    line: there is no fence left to name (the mutant went on and logged
    ``None`` as completed)."""
    clock = ManualClock()
    rows_led, _, overdue = _ledgers(clock)
    x = EventFence()
    _free_rows(rows_led, 1, x)
    clock.now = 12.0
    with caplog.at_level(logging.ERROR, logger="asyncpool.overdue"):
        overdue.check()  # logged (no record kept here: a record would hold the fence)
    assert overdue.reported
    x.set()
    assert rows_led.reclaim() == 1
    gone = weakref.ref(x)
    del x
    gc.collect()
    assert gone() is None
    with caplog.at_level(logging.INFO, logger="asyncpool.overdue"):
        overdue.settled()
    assert caplog.records == []
    assert not overdue.reported


def test_force_release_of_no_fences_releases_and_logs_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``force_release([])`` on the sync row pool and on a page pool answers
    0 and logs nothing (sync_pool.py, kv_pages.py)."""
    rows = ReqToTokenPool(4, 8)
    kv = KVPagePool(9, 4)
    with caplog.at_level(logging.DEBUG, logger="asyncpool"):
        assert rows.force_release([]) == 0
        assert kv.force_release([]) == 0
    assert caplog.records == []


def test_a_stopped_watcher_refuses_to_poll_again() -> None:
    """``FenceWatcher.rewatch`` after ``stop()`` raises, as ``watch`` does."""
    watcher = FenceWatcher(lambda: None)
    watcher.stop()
    with pytest.raises(RuntimeError, match="stopped"):
        watcher.rewatch([EventFence()])


def test_no_fence_is_an_empty_tuple() -> None:
    """``fence_list(None)``: no fences (fences.py)."""
    assert fence_list(None) == ()


def test_a_kv_group_name_given_twice_is_refused() -> None:
    """Two keys that are one name once checked (a ``str`` subclass is taken
    as its plain characters) are refused, naming it, before anything is
    built (pool.py)."""

    class Other(str):
        __slots__ = ()

        def __hash__(self) -> int:
            return hash(("other", str(self)))

        def __eq__(self, other: object) -> bool:
            return other.__class__ is Other and str.__eq__(self, other)

    kv = {"swa": KVPagePool(9, 4), Other("swa"): KVPagePool(9, 4)}
    assert len(kv) == 2
    with pytest.raises(ValueError, match="the KV group name 'swa' is given twice"):
        AsyncReqToTokenPool(3, 64, kv=kv)


@pytest.mark.parametrize(
    ("keep", "match"),
    [
        (np.int64(-1), "keep must be a page count >= 0, got -1"),
        (torch.tensor(1.5), "got a 0-D torch.float32 Tensor"),
    ],
    ids=["numpy negative", "0-d float tensor"],
)
def test_one_bad_scalar_count_is_refused_and_changes_nothing(keep: object, match: str) -> None:
    """One count for every row that is not a plain ``int``: a negative numpy
    integer, a 0-d float tensor (``as_index`` refuses it; the array check
    names it) are refused with ``CapacityError``, the row's pages as they
    were (page_args.py)."""
    pool = AsyncReqToTokenPool(3, 64, kv=KVPagePool(9, 4))
    g = pool.try_admit(pages=3)
    assert g is not None
    before = page_ids(pool.pages_of(g.row))
    with pytest.raises(CapacityError, match=match):
        pool.trim_pages([g.row], keep)  # type: ignore[arg-type]
    assert page_ids(pool.pages_of(g.row)) == before
    pool.check_invariants()
