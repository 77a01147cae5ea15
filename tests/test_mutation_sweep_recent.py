"""Gaps found by a hand-made mutation sweep of the last two sessions' code:
``asyncpool/wakeups.py`` (``FenceWakeups``), ``WaiterQueues.oldest_wait``
and its gauge, the grouped growths' refusal counting in
``asyncpool/admission.py`` (now ``growth.py``), and the demo's hybrid model
(``scheduler_demo/hybrid.py``, the swa parts of ``scheduler.py``,
``compare.py`` and ``report.py``).

Each test pins one behaviour that a mutant broke while every test file that
exercises the code still passed (95 mutants: 55 killed by the existing
tests, 12 equivalent, 28 gaps: these tests; see docs/changes.md):

* a hand-over (``handed_over``) and a loop move (``left_loop``) forget the
  loop a wake-up was queued on that never ran it (the loop was closed under
  it): the note kept that loop, and all it held, alive;
* the wake-up ``wake_soon`` queues on the pool's new loop coalesces with a
  fence completing before it runs (the mutant queued a second one); a loop
  move keeps the count of interrupted wake-ups in a row (a hand-over
  starts it afresh);
* a wake-up whose reclaim was interrupted queues its retry even when the
  grant that serves the waiters with what was reclaimed raises;
* the interrupted wake-ups in a row are logged once as a warning, then at
  DEBUG the 2nd, 4th, 8th ...; a ``KeyboardInterrupt`` or ``SystemExit``
  that stops the loop is not logged (it propagates);
* the retry delay is 1 ms doubling to 0.1 s, the delayed re-watch's 1 ms
  (its second bounce) doubling to 10 ms (read from the delays asked of a
  stand-in loop, not from a clock);
* bounce counts: a settled fence's is forgotten when no fence came back,
  a fence ``force_release`` unwatches loses its, and past the bound all
  are forgotten before this wake-up's are added; the delayed re-watch
  watches only the fences still waited for; after interrupted wake-ups
  every pending fence of unknown origin is watched again, no host or CUDA
  fence;
* ``oldest_wait`` reads every priority's queue (the oldest may sit in one
  queued after another whose first waiter left);
* a grouped ``extend_fitting`` reclaims a group's completed fences when
  its free pages cannot cover the whole run, not only one row;
* ``SwaGroup``: an admission's swa pages end where the full group's do;
  ``live_window`` and ``final_window`` start at the first position the
  row's pages still hold, and the final window at ``lo(end - 1)``; a step
  writes its new positions and reads back its whole window; ``slots``
  refuses positions outside the live pages; ``pages_dropped`` counts each
  page given back once over successive drops;
* the scheduler remembers the transfers it starts in gate mode (so those
  writing a gated step's reads land first), and a running request's owned
  slots include its live swa window;
* ``swa_figures`` counts the requests corrupted, not the checks failed;
  ``Report.to_dict`` copies the swa figures, and the table shows swa
  mismatches only when there are some.

Async tests run on asyncio and uvloop (conftest); every wait is bounded.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import weakref
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import pytest
import uvloop
from helpers import (
    EventFence,
    ManualClock,
    Streams,
    bounded,
    grouped_pool,
    kv_group,
    queued_call,
    settled,
    spin,
    until,
)
from test_demo_hybrid import HYBRID
from test_demo_hybrid import _run as run_hybrid
from test_mutation_sweep_demo import _report

import asyncpool.waiters
from asyncpool import AsyncReqToTokenPool, KVPagePool
from asyncpool import wakeups as wakeups_mod
from asyncpool.fences import CudaFence, HostFence
from asyncpool.wakeups import FenceWakeups
from scheduler_demo import DemoConfig
from scheduler_demo.hybrid import SwaGroup
from scheduler_demo.report import swa_figures
from scheduler_demo.scheduler import RUNNING, Scheduler
from scheduler_demo.workload import RequestSpec

LOGGER = "asyncpool.pool"
FACTORIES = pytest.mark.parametrize(
    "factory", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"]
)


class _Pool:
    """The pool's side of ``FenceWakeups``' contract, recording each call
    (as tests/test_wakeups.py's)."""

    def __init__(self, loop: Any) -> None:
        self.loop = loop
        self.closed = False
        self.calls: list[str] = []
        self.reclaim_raises: BaseException | None = None
        self.grant_raises: BaseException | None = None

    def reclaim(self) -> bool:
        self.calls.append("reclaim")
        if self.reclaim_raises is not None:
            raise self.reclaim_raises
        return False

    def grant(self) -> None:
        self.calls.append("grant")
        if self.grant_raises is not None:
            raise self.grant_raises

    def wakeups(self) -> FenceWakeups:
        return FenceWakeups(
            loop=lambda: self.loop,
            closed=lambda: self.closed,
            close_fast_paths=lambda: self.calls.append("close fast paths"),
            reclaim=self.reclaim,
            grant=self.grant,
            ledgers=(),
            log=logging.getLogger(LOGGER),
        )


class _Timers:
    """A stand-in loop that records the timers asked of it (delay, callback,
    args) and runs none until the test fires them."""

    def __init__(self) -> None:
        self.timers: list[tuple[float, Callable[..., object], tuple[Any, ...]]] = []

    def is_closed(self) -> bool:
        return False

    def call_later(self, delay: float, fn: Callable[..., object], *args: Any) -> None:
        self.timers.append((delay, fn, args))

    def call_soon(self, fn: Callable[..., object], *args: Any) -> None:
        self.timers.append((0.0, fn, args))

    def fire(self) -> None:
        _, fn, args = self.timers[-1]
        fn(*args)


class _Ledger:
    """A stand-in ledger waiting on the fences of ``waits``."""

    def __init__(self, waits: list[Any]) -> None:
        self.waits = waits
        self.pending = len(waits)

    def waiting_on(self, fences: list[Any]) -> list[Any]:
        return [f for f in fences if f in self.waits]

    def pending_fences(self) -> list[Any]:
        return list(self.waits)


class _Watcher:
    """A stand-in watcher: what the poller let go of, and the re-watches."""

    def __init__(self, dropped: list[Any]) -> None:
        self.dropped = dropped
        self.rewatched: list[list[Any]] = []

    def take_dropped(self) -> list[Any]:
        dropped, self.dropped = self.dropped, []
        return dropped

    def rewatch(self, fences: list[Any]) -> int:
        self.rewatched.append(list(fences))
        return len(fences)

    def unwatch(self, fence: Any) -> bool:
        return True


def _with_ledger(ledger: _Ledger, loop: Any) -> FenceWakeups:
    pool = _Pool(loop)
    return FenceWakeups(
        loop=lambda: pool.loop,
        closed=lambda: False,
        close_fast_paths=lambda: None,
        reclaim=pool.reclaim,
        grant=pool.grant,
        ledgers=cast(Any, (ledger,)),
        log=logging.getLogger(LOGGER),
    )


# -- the wake-ups: a hand-over, a loop move ------------------------------------


@FACTORIES
@pytest.mark.parametrize("move", ["handed_over", "left_loop"])
def test_a_move_forgets_a_wake_up_queued_on_a_loop_closed_under_it(
    factory: Callable[[], asyncio.AbstractEventLoop], move: str
) -> None:
    """A fence completed, its wake-up was queued on loop A, and A was closed
    before it ran. Then the pool moved (``bind()`` with nothing pending, or
    its first call on loop B): nothing is left to wake on A, and the note
    of it must not keep A alive. Before, only ``_wake_retry`` and the
    re-watch timer were forgotten; ``_wake_scheduled`` kept A."""
    loop_a = factory()
    pool = _Pool(loop_a)
    wakeups = pool.wakeups()
    wakeups.notify()  # a completion from another thread: queued on A
    assert wakeups._wake_scheduled is loop_a
    loop_a.close()  # without running it
    old = weakref.ref(loop_a)
    del loop_a
    loop_b = factory()
    try:
        pool.loop = None if move == "handed_over" else loop_b
        getattr(wakeups, move)()
        assert wakeups._wake_scheduled is None
        gc.collect()
        assert old() is None
    finally:
        loop_b.close()


async def test_the_wake_up_queued_on_a_new_loop_coalesces_with_a_completion() -> None:
    """``wake_soon`` (the pool moved here with memory pending) queues one
    wake-up; a fence completing before it ran is seen by it, not given a
    second one."""
    pool = _Pool(asyncio.get_running_loop())
    wakeups = pool.wakeups()
    wakeups.wake_soon(asyncio.get_running_loop())
    wakeups.notify()
    await spin()
    assert pool.calls == ["close fast paths", "reclaim", "grant"]


def test_a_loop_move_keeps_the_count_of_interrupted_wake_ups_in_a_row(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A move to another loop (not a hand-over) keeps counting: the wake-up
    on the new loop is the next in the row (logged at DEBUG as such, not
    warned of again)."""
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    old, new = _Timers(), _Timers()
    pool = _Pool(old)
    wakeups = pool.wakeups()
    pool.reclaim_raises = asyncio.CancelledError()
    wakeups.on_fences_done(cast(Any, old))  # 1st: warned
    old.fire()  # 2nd: DEBUG
    old.fire()  # 3rd: nothing
    pool.loop = new
    wakeups.left_loop()
    wakeups.wake_soon(cast(Any, new))  # memory pending: a wake-up on the new loop
    assert wakeups._wake_scheduled is new
    new.fire()  # 4th in a row: DEBUG
    assert [r.levelno for r in caplog.records] == [logging.WARNING] + [logging.DEBUG] * 2
    assert caplog.records[-1].args[1] == 4  # type: ignore[index]


# -- the wake-ups: an interrupted reclaim --------------------------------------


async def test_an_interrupted_wake_up_queues_its_retry_even_when_its_grant_raises(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The reclaim was interrupted (a ``CancelledError`` from a query()), and
    the grant of what it released raised: the error propagates, and the retry
    is queued all the same (nobody else would look at the fence again)."""
    caplog.set_level(logging.CRITICAL, logger=LOGGER)
    loop = asyncio.get_running_loop()
    pool = _Pool(loop)
    wakeups = pool.wakeups()
    pool.reclaim_raises = asyncio.CancelledError()
    pool.grant_raises = RuntimeError("grant failed (simulated)")
    with pytest.raises(RuntimeError, match="simulated"):
        wakeups.on_fences_done(loop)
    assert wakeups._wake_retry is loop  # its timer is queued
    pool.reclaim_raises = pool.grant_raises = None
    await until(lambda: pool.calls.count("reclaim") == 2)  # the retry (1 ms) ran
    assert wakeups._wake_retry is None and wakeups._wake_raises == 0


def test_interrupted_wake_ups_in_a_row_log_once_then_at_powers_of_two(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The first interrupted wake-up in a row warns; the 2nd, 4th, 8th ...
    log at DEBUG, the others nothing."""
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    timers = _Timers()
    pool = _Pool(timers)
    wakeups = pool.wakeups()
    pool.reclaim_raises = asyncio.CancelledError()
    wakeups.on_fences_done(cast(Any, timers))
    for _ in range(9):
        timers.fire()  # the retry, interrupted again
    levels = [r.levelno for r in caplog.records]
    assert levels[0] == logging.WARNING and levels.count(logging.WARNING) == 1
    debug = [r.args[1] for r in caplog.records if r.levelno == logging.DEBUG]  # type: ignore[index]
    assert debug == [2, 4, 8]


@pytest.mark.parametrize("stop", [KeyboardInterrupt, SystemExit])
def test_an_interrupt_that_stops_the_loop_is_not_logged(
    stop: type[BaseException], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    pool = _Pool(_Timers())
    wakeups = pool.wakeups()
    pool.reclaim_raises = stop()
    with pytest.raises(stop):
        wakeups.on_fences_done()
    assert caplog.records == []
    assert pool.calls == ["close fast paths", "reclaim", "grant"]  # it still served


def test_the_retry_delay_doubles_from_1_ms_to_a_tenth_of_a_second(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.CRITICAL, logger=LOGGER)
    timers = _Timers()
    pool = _Pool(timers)
    wakeups = pool.wakeups()
    pool.reclaim_raises = asyncio.CancelledError()
    wakeups.on_fences_done(cast(Any, timers))
    for _ in range(8):
        timers.fire()
    delays = [d for d, _, _ in timers.timers]
    assert delays == pytest.approx([0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.1, 0.1])


# -- the wake-ups: re-watching -------------------------------------------------


def test_the_delayed_rewatch_waits_1_ms_doubling_to_10_ms() -> None:
    """A fence the poller lets go of again and again: its second bounce in
    a row waits 1 ms, then 2, 4, 8 and at most 10 ms."""
    timers = _Timers()
    wakeups = _Pool(timers).wakeups()
    fence = EventFence()
    for bounces in range(2, 8):
        wakeups._rewatch_timer = None  # the previous timer fired
        wakeups._rewatch_later([fence], bounces)
    delays = [d for d, _, _ in timers.timers]
    assert delays == pytest.approx([0.001, 0.002, 0.004, 0.008, 0.01, 0.01])
    assert wakeups_mod._REWATCH_MAX_S == 0.01


def test_a_settled_fences_bounce_count_is_forgotten_when_none_comes_back() -> None:
    """A fence that bounced before and has now settled (nothing waits on it)
    loses its count, even when no fence of this wake-up came back: its id may
    be a later fence's, which would then be re-watched late, not at once."""
    timers = _Timers()
    ledger = _Ledger([])
    wakeups = _with_ledger(ledger, timers)
    settled, back = EventFence(), EventFence()
    wakeups._bounces[id(settled)] = 3
    watcher = _Watcher([settled])
    wakeups._rewatch_dropped(cast(Any, watcher))
    assert wakeups._bounces == {} and watcher.rewatched == []
    # One that comes back for the first time is watched again at once.
    ledger.waits, ledger.pending = [back], 1
    watcher.dropped = [back]
    wakeups._rewatch_dropped(cast(Any, watcher))
    assert watcher.rewatched == [[back]] and timers.timers == []


def test_the_delayed_rewatch_watches_only_the_fences_still_waited_for() -> None:
    """When its timer fires, a fence that settled meanwhile (its memory
    reclaimed) is not polled again: nothing waits on it."""
    settled, still = EventFence(), EventFence()
    ledger = _Ledger([still])
    wakeups = _with_ledger(ledger, _Timers())
    watcher = _Watcher([])
    wakeups.watcher = cast(Any, watcher)
    wakeups._rewatch_due = [settled, still]
    wakeups._rewatch_due_now()
    assert watcher.rewatched == [[still]] and wakeups._rewatch_due == []


def test_the_delayed_rewatch_forgets_the_counts_of_the_fences_that_settled() -> None:
    """A fence that settled while its delayed re-watch waited (a call into
    the pool reclaimed it) is never let go of by the poller again, so only
    the timer can forget its count: kept, it stayed (by id) until the bulk
    clear, and a later fence bearing its id was re-watched late at its
    first bounce. A soak of flaky handles left about one such count in six."""
    settled, still = EventFence(), EventFence()
    ledger = _Ledger([still])
    wakeups = _with_ledger(ledger, _Timers())
    wakeups.watcher = cast(Any, _Watcher([]))
    wakeups._bounces.update({id(settled): 2, id(still): 2})
    wakeups._rewatch_due = [settled, still]
    wakeups._rewatch_due_now()
    assert wakeups._bounces == {id(still): 2}  # still waited for: its count stays


def test_force_release_forgets_the_bounce_counts_of_the_fences_it_unwatches() -> None:
    """A fence nothing waits on any more loses its count: a later fence may
    bear its id, and would be re-watched late, not at once."""
    wakeups = _with_ledger(_Ledger([]), _Timers())
    wakeups.watcher = cast(Any, _Watcher([]))
    gone, kept = EventFence(), EventFence()
    wakeups._bounces.update({id(gone): 2, id(kept): 2})
    wakeups.unwatch([gone])
    assert wakeups._bounces == {id(kept): 2}


def test_the_bounce_counts_remembered_stay_within_their_bound() -> None:
    """Past ``_BOUNCES_REMEMBERED`` counts the pool forgets them all (each
    fence is then watched again at once once more), before adding this
    wake-up's: the table never grows past its bound."""
    limit = wakeups_mod._BOUNCES_REMEMBERED
    back = [EventFence(), EventFence()]
    ledger = _Ledger(list(back))
    wakeups = _with_ledger(ledger, _Timers())
    wakeups._bounces.update({-i: 1 for i in range(1, limit)})  # ids no fence bears
    watcher = _Watcher(list(back))
    wakeups._rewatch_dropped(cast(Any, watcher))
    assert len(wakeups._bounces) <= limit
    assert wakeups._bounces == {id(f): 1 for f in back}
    assert watcher.rewatched == [back]  # cleared: the first bounce again, at once


def test_after_interrupted_wake_ups_every_pending_fence_of_unknown_origin_is_watched() -> None:
    """The first wake-up whose reclaim is not interrupted after some that
    were watches again every pending fence of unknown origin (the poller may
    have let go of any of them meanwhile); a host fence (its done callback)
    and a CUDA fence (the stream thread) are not the poller's to watch."""
    unknown = EventFence()
    host = object.__new__(HostFence)
    cuda = object.__new__(CudaFence)
    wakeups = _with_ledger(_Ledger([host, unknown, cuda]), _Timers())
    watcher = _Watcher([])
    wakeups.watcher = cast(Any, watcher)
    wakeups._wake_raises = 2
    wakeups.on_fences_done()
    assert watcher.rewatched == [[unknown]] and wakeups._wake_raises == 0


# -- the oldest wait -----------------------------------------------------------


async def test_the_oldest_wait_reads_every_prioritys_queue(monkeypatch: pytest.MonkeyPatch) -> None:
    """The oldest live waiter may sit in any priority's queue, not only in
    the one queued first: here the first-queued priority's own oldest left
    and its next is younger than a more urgent waiter."""
    clock = ManualClock(100.0)
    monkeypatch.setattr(asyncpool.waiters, "_perf_counter", clock)
    async with bounded(), AsyncReqToTokenPool(2, 4) as pool:
        rows = await pool.alloc(1)
        first = await queued_call(pool.alloc(1, priority=5))  # queued at 100
        clock.now = 105.0
        urgent = await queued_call(pool.alloc(1, priority=0))  # queued at 105
        clock.now = 106.0
        later = await queued_call(pool.alloc(1, priority=5))  # queued at 106
        first.cancel()
        await settled(first)
        clock.now = 110.0
        assert pool.stats().oldest_wait_s == 5.0  # urgent's, not later's 4.0
        later.cancel()
        await settled(later)
        pool.free(rows)
        pool.free(await settled(urgent))


# -- grouped growths -----------------------------------------------------------


async def test_extend_fitting_by_group_reclaims_when_short_of_the_whole_run(kit: Streams) -> None:
    """A group reclaims its completed fences when its free pages cannot
    cover every row of the run, not only when they cannot cover one: two
    rows, one swa page free and one pending behind a completed fence, grow
    both."""
    pool = grouped_pool(rows=3, swa=4, full=8)
    a = await pool.admit({"swa": 1, "full": 1})
    b = await pool.admit({"swa": 1, "full": 1})
    c = await pool.admit({"swa": 1, "full": 1})
    stream = kit.stream()
    gate = kit.gate(stream)
    pool.free([c.row], fence=stream.record())  # c's swa page pending behind it
    gate.open()
    stream.synchronize()  # completed; nobody has reclaimed yet
    swa = kv_group(pool, "swa")
    assert swa.available_size() == 1 and swa.pending_size() == 1
    m, got = pool.extend_fitting([a.row, b.row], {"swa": 1, "full": 1})
    assert m == 2 and got["swa"].shape == (2, 1)
    assert pool.stats().growth_refusals == 0
    pool.free([a.row, b.row])
    pool.check_invariants()


# -- the demo's swa group ------------------------------------------------------


def _group(window: int = 8, page_size: int = 4) -> SwaGroup:
    return SwaGroup(window, page_size, rows=2, max_slots=64, offset=1000)


def test_an_admissions_swa_pages_end_where_the_full_groups_do() -> None:
    """Both groups cross their next page boundary at the same position, so
    they grow together: the swa pages run from the page of ``lo(q0)`` up to
    the full group's end."""
    g = _group(window=8, page_size=4)
    assert g.lo(13) == 6
    assert g.admission(13, 4) == (1, 3)  # pages 1..3; the full group holds 0..3
    assert g.admission(5, 2) == (0, 2)  # lo(5) = 0: from the first page


def test_the_live_and_final_windows_start_where_the_rows_pages_do() -> None:
    g = _group(window=8, page_size=4)
    g.start(1, 0, [10, 11, 12, 13])  # positions [0, 16)
    g.dropped[1] = 2  # pages 0 and 1 given back: [8, 16) live
    # The window of position 11 starts at lo(12) = 5, below the live pages.
    assert g.live_window(1, 12).tolist() == g.mirror[1, 8:12].tolist()
    assert g.final_window(1, 12) == (8, pytest.approx(g.mirror[1, 8:12]))
    g.dropped[1] = 0
    # A finished request's last window: [lo(end - 1), end).
    start, slots = g.final_window(1, 14)
    assert start == g.lo(13) == 6
    assert slots.tolist() == g.mirror[1, 6:14].tolist()
    assert g.live_window(1, 14).tolist() == g.mirror[1, 7:14].tolist()  # lo(14) = 7


def test_a_steps_swa_work_writes_the_new_positions_and_reads_the_whole_window() -> None:
    """Entry i writes positions ``[max(write_from, lo), end)`` and reads back
    its whole window ``[lo(end - 1), end)``, not only what it wrote."""
    g = _group(window=8, page_size=4)
    g.start(1, 0, [1, 2, 3, 4])  # positions [0, 16)
    step = g.build(np.array([1]), np.array([12]), np.array([11]), np.array([500], dtype=np.int64))
    assert step.w_slots.tolist() == g.mirror[1, 11:12].tolist()
    assert step.w_vals.tolist() == [511]
    assert step.v_counts.tolist() == [8]
    assert step.v_slots.tolist() == g.mirror[1, 4:12].tolist()
    assert step.v_vals.tolist() == list(range(504, 512))


def test_swa_slots_below_the_live_pages_are_refused() -> None:
    g = _group(window=8, page_size=4)
    g.start(1, 1, [20, 21])  # positions [4, 12)
    assert g.slots(1, 4, 12).tolist() == (1000 + np.r_[80:88]).tolist()
    with pytest.raises(RuntimeError, match="outside the rows' live pages"):
        g.slots(1, 3, 12)
    with pytest.raises(RuntimeError, match="outside the rows' live pages"):
        g.slots(1, 4, 13)


class _Drops:
    """A stand-in pool recording ``drop_pages``."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[int], list[int], str | None]] = []

    def drop_pages(self, rows: list[int], below: list[int], group: str | None = None) -> int:
        self.calls.append((list(rows), list(below), group))
        return 0


def test_pages_dropped_counts_each_page_once_over_successive_drops() -> None:
    g = _group(window=4, page_size=4)
    g.start(1, 0, [1, 2, 3, 4])  # positions [0, 16)
    pool = _Drops()
    as_pool = cast(AsyncReqToTokenPool, pool)
    assert g.drop(as_pool, [1], [9]) == 1  # lo(9) = 6: page 0 goes
    assert g.drop(as_pool, [1], [10]) == 0  # still page 1's: nothing more
    assert g.drop(as_pool, [1], [14]) == 1  # lo(14) = 11: page 1 goes too
    assert pool.calls == [([1], [1], "swa"), ([1], [2], "swa")]
    assert g.pages_dropped == 2 and g.dropped[1] == 2


# -- the demo's scheduler and report with a window -----------------------------


def _hybrid_scheduler(requests: int) -> Scheduler:
    """A hybrid demo scheduler built by hand (no pool, stream or transfers),
    with ``requests`` requests of 6 prompt and 4 output tokens, a 4-token
    window and 4-token pages."""
    cfg = DemoConfig(
        num_requests=requests,
        rows=4,
        max_context_len=16,
        kv_pages=8,
        page_size=4,
        swa_window=4,
        swa_pages=8,
        progress=False,
    )
    specs = [RequestSpec(i, 0.0, 6, 4) for i in range(requests)]
    return Scheduler(
        cfg, cast(Any, None), KVPagePool(9, 4), cast(Any, None), cast(Any, None), specs
    )


def test_a_running_requests_owned_slots_include_its_live_swa_window() -> None:
    """Gate mode lands a held (aborted) transfer once a new owner wrote one
    of its slots: with a window, the owner's slots are its row's positions
    and its window's swa slots that its pages still hold."""
    sched = _hybrid_scheduler(1)
    (req,) = sched.reqs
    req.row, req.state = 1, RUNNING
    sched._add_page_ids(req, [2, 3])  # positions [0, 8) of the full group
    swa = sched.swa
    assert swa is not None
    swa.start(1, 0, [5, 6])
    swa.dropped[1] = 1  # page 0 of the window given back
    owned = sched._owned_slots(req, 7)
    assert owned == sched._mirror[1, :7].tolist() + swa.mirror[1, 4:7].tolist()


async def test_a_gated_hybrid_run_lands_the_transfers_started_into_a_steps_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Gate mode with a window: each transfer started is remembered, so that
    before a gated step reads its windows the transfers that write a slot
    they read are landed (unsafe, a new owner's prompt KV then lands over a
    dropped page the step still reads: the swa corruption the demo shows)."""
    seen: list[int] = []
    real = Scheduler._land_into_reads

    async def land(self: Scheduler, step: Any) -> None:
        seen.append(len(self._started))
        await real(self, step)

    monkeypatch.setattr(Scheduler, "_land_into_reads", land)
    report, _ = await run_hybrid(HYBRID)
    assert report.ok
    assert seen and max(seen) > 0


def test_the_swa_figures_count_requests_corrupted_not_checks_failed() -> None:
    """``kv_corruptions``: the requests whose window read another's KV at
    least once; ``kv_mismatches``: every such check."""
    sched = _hybrid_scheduler(2)
    sched.swa_corrupted.add(1)
    sched.swa_mismatches = 3
    pages = KVPagePool(8, 4)
    figures = swa_figures(sched, pages)
    assert (figures["kv_corruptions"], figures["kv_mismatches"]) == (1, 3)
    assert figures["window"] == 4 and figures["pages"] == pages.capacity


def test_the_reports_swa_figures_are_a_copy_and_show_mismatches_only_when_some() -> None:
    report = _report(unsafe=False, kv_corruptions=0)
    report.swa = {
        "window": 16,
        "pages": 12,
        "peak_allocated": 10,
        "undropped_peak": 20,
        "pages_dropped": 30,
        "deferred_page_frees": 5,
        "kv_corruptions": 0,
        "kv_mismatches": 0,
    }
    out = report.to_dict()
    out["swa"]["kv_corruptions"] = 99  # the JSON's dict is not the report's
    assert report.swa["kv_corruptions"] == 0 and report.ok
    line = next(x for x in report.table().splitlines() if "kv_corruptions (swa pages)" in x)
    assert line.split()[-1] == "0" and "mismatches" not in line
    report.swa.update(kv_corruptions=1, kv_mismatches=3)
    line = next(x for x in report.table().splitlines() if "kv_corruptions (swa pages)" in x)
    assert line.endswith("1 (3 mismatches)") and not report.ok
