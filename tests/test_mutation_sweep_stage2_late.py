"""Gaps found by a hand-made mutation sweep of the last session's code:
the dead waiters of ``asyncpool/waiters.py`` (``_dead``, ``_gone``, the
sweep at ``_COMPACT_MIN``, ``queued_through``, ``by_priority``), the
thread-safe submissions (``asyncpool/threadsafe.py``, ``alloc_threadsafe`` /
``admit_threadsafe``), the grouped growth with per-row counts and
``trim_pages`` in ``asyncpool/admission.py`` (now ``growth.py`` and
``give_back.py``), ``HostFence``'s stream name
and ``HostStream.wait`` in ``asyncpool/fences.py``, and
``release_memory(timeout=)`` / ``_reclaim_all`` in the pool.

Each test pins one behaviour that a mutant broke while every test file that
exercises the code still passed (86 mutants: 61 killed by the existing
tests, 3 equivalent, 22 gaps: these tests; see docs/changes.md):

* a waiter queued behind only dead waiters (the grant loop stopped when the
  free list ran dry, a dead one next), in that queue or a less urgent new
  one, is the head: the grant loop runs for it at the loop's next turn;
* the dead are swept at the cancel that makes them both more than the live
  and at least ``_COMPACT_MIN`` (64), not one cancel before;
* cancelled waiters the grant loop took off (``_gone``) are forgotten when
  their handlers run, and when the waiters of a closed loop are dropped;
* ``waiting_by_priority()`` leaves out a waiter whose loop was closed under
  it (``waiting()`` still counts it);
* ``admit_threadsafe(priority=)`` queues at that priority; a submission
  cancelled before the loop ran it asks nothing; a wait cancelled on the
  loop cancels the caller's future; an ended wait's future no longer holds
  its task; a ``BaseException`` that is not an ``Exception`` ends the task
  too; an error of a wait cancelled meanwhile ends the task quietly; the
  caller's cancel reaches the task through ``call_soon_threadsafe``;
* ``try_admit`` raises for pages (not rows) quarantine makes unfittable,
  even while others queue; a grouped ``extend_fitting`` with per-row counts
  grows a row that asks its group's whole capacity; a grouped ``extend``
  refuses a list of counts and takes nothing;
* grouped: ``try_admit`` raises for a group's pages-only quarantine while
  others queue; a per-row ``extend_fitting`` stops where the shortest
  group does (whichever comes first), reclaims a short group's completed
  fences, and hands what that reclaim freed past the growth to the queued
  waiters in the same call;
* ``release_memory`` checks its ``timeout`` before anything else (a bad
  one is a ``ValueError`` on a closed pool too).

Async tests run on asyncio and uvloop (conftest); every wait is bounded.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import logging
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import uvloop
from helpers import (
    Streams,
    bounded,
    grouped_pool,
    in_thread,
    kv_group,
    pool_snapshot,
    spin,
    until,
)

from asyncpool import AsyncReqToTokenPool, CapacityError, KVPagePool
from asyncpool.stats import Histogram
from asyncpool.threadsafe import submit_wait
from asyncpool.waiters import _COMPACT_MIN, WaiterQueues

# ------------------------------------------------------------ waiters: dead waiters


def _queues(supply: list[int] | None = None, pending: list[int] | None = None) -> WaiterQueues:
    """WaiterQueues over a stand-in pool: a need ``n`` takes ``n`` units from
    ``supply`` (the free list the grant loop watches), else from ``pending``
    (completed fences not yet reclaimed, as the pool's take reclaims)."""
    supply = [] if supply is None else supply
    pending = [] if pending is None else pending

    def take(n: int) -> list[int] | None:
        for source in (supply, pending):
            if len(source) >= n:
                got = source[:n]
                del source[:n]
                return got
        return None

    return WaiterQueues(
        take, lambda grant: None, lambda n: (f"alloc({n})", f"{n} rows"), supply=supply
    )


def _enqueue(queues: WaiterQueues, need: int, priority: int) -> Any:
    loop = asyncio.get_running_loop()
    return queues.enqueue(need, priority, None, loop, collections.deque(), Histogram())[0]


def _cancel_queued(queues: WaiterQueues, waiter: Any) -> None:
    """Cancel a queued waiter as its task's handler does."""
    waiter[1].cancel()
    queues.cancelled(waiter)


@pytest.mark.parametrize("priority", [0, 1])
async def test_a_waiter_behind_only_dead_ones_is_served_at_the_next_turn(priority: int) -> None:
    """The grant loop stops when the free list runs dry (it breaks) with a
    dead waiter next: a waiter queued after it, in that queue or a less
    urgent new one, is the head behind only the dead, and the grant loop
    runs for it at the loop's next turn (it may fit in what a reclaim
    makes free). The mutants never ran it: it waited for the next free."""
    supply: list[int] = []
    pending: list[int] = []
    queues = _queues(supply, pending)
    big = _enqueue(queues, 5, 2)  # blocks at the back, keeps the count > 0
    a, b, c = (_enqueue(queues, 1, 0) for _ in range(3))
    _cancel_queued(queues, b)  # the middle: dead
    _cancel_queued(queues, c)  # the tail: off at once
    assert queues._dead == {b[1]}
    supply.append(7)
    queues.grant()  # a is served, the free list is empty: the loop stops there
    assert a[1].result() == [7] and not big[1].done()
    assert list(queues._queues[0]) == [b]  # only the dead one is left in front
    pending.append(8)  # a completed fence: a take reclaims it
    new = _enqueue(queues, 1, priority)
    await spin(2)
    assert new[1].done() and new[1].result() == [8]
    assert not big[1].done() and queues.count == 1 and not queues._dead
    queues.check_invariants()


@pytest.mark.parametrize(("queued", "swept_at"), [(100, 64), (130, 66)])
async def test_the_dead_are_swept_once_they_outnumber_the_live_and_reach_64(
    queued: int, swept_at: int
) -> None:
    """The sweep runs at the cancel that makes the dead both more than the
    live and at least ``_COMPACT_MIN`` (64), not one before: 100 queued
    sweep at the 64th dead (51 already outnumber the live), 130 at the 66th
    (65 dead against 65 live do not outnumber them)."""
    assert _COMPACT_MIN == 64
    queues = _queues()
    ws = [_enqueue(queues, 1, 0) for _ in range(queued)]
    middle = ws[1:-1]
    for i, w in enumerate(middle[: swept_at - 1], 1):
        _cancel_queued(queues, w)
        assert len(queues._dead) == i
    _cancel_queued(queues, middle[swept_at - 1])
    assert not queues._dead  # swept: the queue holds the live only
    assert len(queues._queues[0]) == queues.count == queued - swept_at
    queues.check_invariants()


async def test_waiters_taken_off_before_their_tasks_unwound_are_forgotten() -> None:
    """Cancelled waiters the grant loop takes off before their tasks ran
    their handlers go to ``_gone``; each handler finds its own and removes
    it. The mutant left them there: a set that grew with every such cancel
    (and kept each cancelled future, and what its error held)."""
    async with AsyncReqToTokenPool(2, 16) as pool:  # one row
        held = await pool.alloc(1)
        tasks = [asyncio.create_task(pool.alloc(1)) for _ in range(3)]
        await spin(1)
        assert pool.waiting() == 3
        tasks[0].cancel()
        tasks[1].cancel()
        pool.free(held)  # the grant loop drops the two cancelled heads, serves the third
        assert len(pool._waiters._gone) == 2
        async with bounded():
            results = await asyncio.gather(*tasks, return_exceptions=True)
        assert [type(r) for r in results[:2]] == [asyncio.CancelledError] * 2
        assert not pool._waiters._gone
        assert pool.stats().cancellations == 2
        pool.free(results[2])
        pool.check_invariants()


# ------------------------------------------------------------ waiters of a closed loop

LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}


def _on_a_loop_closed_after(
    factory: Callable[[], asyncio.AbstractEventLoop],
    body: Callable[[], Awaitable[None]],
    then: Callable[[], None] = lambda: None,
) -> None:
    """Run ``body`` on a fresh loop, then ``then()`` with the loop stopped
    (what it schedules never runs), then close the loop without cancelling
    the tasks it left (their waiters stay queued, never to resume)."""
    loop = factory()
    try:
        loop.run_until_complete(body())
        then()
    finally:
        loop.close()


@pytest.mark.parametrize("loop", LOOPS)
def test_waiting_by_priority_leaves_out_a_waiter_of_a_closed_loop(
    loop: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A waiter whose loop was closed under it can never resume: ``waiting()``
    still counts it (until a call that looks at the queue drops it), and
    ``waiting_by_priority()`` does not (the mutant counted it live)."""
    caplog.set_level(logging.ERROR)  # the abandoned task, destroyed pending
    factory = LOOPS[loop]
    pool = AsyncReqToTokenPool(2, 8)  # one row
    tasks: list[asyncio.Task[Any]] = []

    async def setup() -> None:
        await pool.alloc(1)
        tasks.append(asyncio.create_task(pool.alloc(1, priority=3)))
        await spin(2)
        assert pool.waiting_by_priority() == {3: 1}

    _on_a_loop_closed_after(factory, setup)

    async def next_loop() -> None:
        assert pool.waiting() == 1
        assert pool.waiting_by_priority() == {}
        assert pool.waiting() == 1  # a read: it drops nothing

    run_on = factory()
    try:
        run_on.run_until_complete(next_loop())
    finally:
        run_on.close()


@pytest.mark.parametrize("loop", LOOPS)
def test_dropping_the_waiters_of_a_closed_loop_forgets_those_taken_off(
    loop: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A cancelled waiter the grant loop took off (in ``_gone``, for its
    handler to find) whose loop was then closed: its handler never runs, so
    dropping that loop's waiters forgets it too (the mutant kept it, and the
    closed loop's future, for good)."""
    caplog.set_level(logging.ERROR)
    factory = LOOPS[loop]
    pool = AsyncReqToTokenPool(2, 8)  # one row
    tasks: list[asyncio.Task[Any]] = []
    held: list[int] = []

    async def setup() -> None:
        held.extend(await pool.alloc(1))
        tasks.extend(asyncio.create_task(pool.alloc(1)) for _ in range(3))
        await spin(2)
        assert pool.waiting() == 3

    def cancel_then_free() -> None:  # the loop stopped: no handler runs
        tasks[0].cancel()
        pool.free(held)  # drops the cancelled one (gone), grants the second
        assert len(pool._waiters._gone) == 1 and pool.waiting() == 1

    _on_a_loop_closed_after(factory, setup, cancel_then_free)

    async def next_loop() -> None:
        assert pool.try_alloc(1) is None  # the granted row went with the loop
        assert pool.waiting() == 0
        assert not pool._waiters._gone
        pool.check_invariants()

    run_on = factory()
    try:
        run_on.run_until_complete(next_loop())
    finally:
        run_on.close()


# ------------------------------------------------------------ thread-safe submissions


async def test_admit_threadsafe_queues_at_its_priority() -> None:
    """``admit_threadsafe(priority=)`` waits at that priority (the mutant
    queued it at 0, ahead of a more urgent caller's reach)."""
    async with bounded(), AsyncReqToTokenPool(2, 4, kv=KVPagePool(8, 2)) as pool:  # one row
        held = await pool.admit(pages=1)
        fut = await asyncio.to_thread(pool.admit_threadsafe, pages=1, priority=2)
        await until(lambda: pool.waiting() == 1)
        assert pool.waiting_by_priority() == {2: 1}
        assert pool.queue_head() is not None and pool.queue_head().priority == 2
        pool.free([held.row])
        grant = await asyncio.wrap_future(fut)
        pool.free([grant.row])


def _the_other_task() -> asyncio.Task[Any]:
    (task,) = asyncio.all_tasks() - {asyncio.current_task()}
    return task


async def test_a_submission_cancelled_before_the_loop_started_it_asks_nothing() -> None:
    """``cancel()`` before the loop ran the submission: the wait never
    starts (the mutant started it, so the fast path granted the rows and
    gave them back, counted as a cancellation)."""
    async with bounded(), AsyncReqToTokenPool(3, 4) as pool:
        pool.bind()
        fut = pool.alloc_threadsafe(1)  # queued on this loop; it has not run yet
        assert fut.cancel() is True
        await spin(3)
        stats = pool.stats()
        assert (stats.allocs, stats.cancellations, stats.allocated) == (0, 0, 0)
        assert asyncio.all_tasks() == {asyncio.current_task()}


async def test_a_wait_cancelled_on_the_loop_cancels_the_future() -> None:
    """The task cancelled on the loop itself (a shutdown cancelling every
    task), not by the caller: the future is cancelled, so a frontend
    blocked on ``result()`` wakes (the mutant left it pending for ever)."""
    async with bounded(), AsyncReqToTokenPool(2, 4) as pool:  # one row
        held = await pool.alloc(1)
        fut = await asyncio.to_thread(pool.alloc_threadsafe, 1)
        await until(lambda: pool.waiting() == 1)
        _the_other_task().cancel()
        await until(fut.done)
        assert fut.cancelled()
        assert pool.waiting() == 0 and pool.stats().cancellations == 1
        pool.free(held)


@pytest.mark.lazy_tasks(
    "it looks at submit_wait's task before the task ran: eager, the wait ran inside the hand-over"
)
async def test_an_ended_wait_leaves_the_future_without_its_task() -> None:
    """Once the wait ended, the caller's future no longer holds the task
    (its done callback reaches the task through a list the task's end
    empties): the mutant kept the task, and what it held, for as long as
    the caller kept the future."""
    async with bounded(), AsyncReqToTokenPool(3, 4) as pool:
        pool.bind()
        fut = pool.alloc_threadsafe(1)
        await spin(1)
        ref = weakref.ref(_the_other_task())
        rows = await asyncio.wrap_future(fut)
        await spin(2)
        gc.disable()  # refcounting alone: nothing may hold the task
        try:
            assert ref() is None
        finally:
            gc.enable()
        assert fut.result() == rows
        pool.free(rows)


class _Interrupt(BaseException):
    """Not an Exception: as KeyboardInterrupt or SystemExit."""


@pytest.mark.lazy_tasks(
    "it looks at submit_wait's task before the task ran: eager, the wait ran inside the hand-over"
)
async def test_a_base_exception_of_the_wait_reaches_the_loop_too() -> None:
    """A ``BaseException`` that is not an ``Exception`` (KeyboardInterrupt,
    SystemExit) raised by the wait is the future's and ends the task with
    it, so it reaches the loop (the mutant swallowed it there)."""
    loop = asyncio.get_running_loop()

    async def interrupted() -> int:
        raise _Interrupt

    fut = submit_wait(loop, interrupted, lambda result: None)
    await spin(1)
    task = _the_other_task()
    async with bounded():
        await asyncio.wait([task])
    assert isinstance(task.exception(), _Interrupt)
    assert isinstance(fut.exception(timeout=0), _Interrupt)


@pytest.mark.lazy_tasks(
    "it looks at submit_wait's task before the task ran: eager, the wait ran inside the hand-over"
)
async def test_an_error_of_a_wait_cancelled_meanwhile_ends_the_task_quietly() -> None:
    """The caller cancels after the task started and before its error: the
    future stays cancelled and the task ends without an error of its own
    (the mutant set the error on the cancelled future: the task failed
    with ``InvalidStateError``, logged as never retrieved)."""
    async with bounded(), AsyncReqToTokenPool(3, 4) as pool:
        pool.bind()
        fut = pool.alloc_threadsafe(5)  # more rows than the pool has: CapacityError
        await spin(1)
        task = _the_other_task()  # made, not yet run
        assert fut.cancel() is True
        await asyncio.wait([task])
        assert task.exception() is None
        assert fut.cancelled()


async def test_a_cancel_from_another_thread_reaches_the_loop_through_its_queue() -> None:
    """The caller's ``cancel()`` in its own thread cancels the task on the
    loop's thread (``call_soon_threadsafe``). The mutant cancelled it from
    the caller's thread: asyncio's debug mode refuses that, and the task
    stayed queued (uvloop does not check; asyncio's loop shows it)."""
    loop = asyncio.get_running_loop()
    loop.set_debug(True)
    try:
        async with bounded(), AsyncReqToTokenPool(2, 4) as pool:  # one row
            held = await pool.alloc(1)
            fut = await asyncio.to_thread(pool.alloc_threadsafe, 1)
            await until(lambda: pool.waiting() == 1)
            assert in_thread(fut.cancel) is True
            await until(lambda: pool.waiting() == 0)
            assert pool.stats().cancellations == 1
            pool.free(held)
    finally:
        loop.set_debug(False)


# ------------------------------------------------------------ admission


def _boom() -> None:
    raise RuntimeError("kernel fault")


async def _pages_quarantined(
    kit: Streams, pool: AsyncReqToTokenPool, trim: Callable[..., Any]
) -> None:
    """``trim(after=stream)`` behind a stream whose work faults: pages (not
    rows) quarantined once the fault is reclaimed."""
    stream = kit.stream()
    gate = kit.gate(stream)
    stream.launch(_boom)
    trim(after=stream)
    gate.open()
    await until(lambda: (pool.reclaim(), pool.stats().pages_quarantined)[1] > 0)
    assert pool.stats().quarantined == 0


async def test_try_admit_raises_for_pages_only_quarantine_while_others_queue(
    kit: Streams, caplog: pytest.LogCaptureFixture
) -> None:
    """Pages quarantined behind a trim (no row is): a request they make
    unfittable raises even while others queue (the mutant looked at the
    rows' quarantine only, and answered None for ever)."""
    caplog.set_level(logging.CRITICAL, logger="asyncpool")
    async with AsyncReqToTokenPool(4, 16, kv=KVPagePool(9, 4)) as pool:  # 8 pages
        g = await pool.admit(pages=3)
        await _pages_quarantined(kit, pool, lambda after: pool.trim_pages(g.row, 1, after=after))
        assert pool.stats().pages_quarantined == 2
        task = asyncio.create_task(pool.admit(pages=6))  # fits once g is freed
        await spin(1)
        assert pool.waiting() == 1
        assert pool.try_admit(pages=1) is None  # fits: no queue jumping
        with pytest.raises(CapacityError, match=r"7 pages.*only 6 of 8"):
            pool.try_admit(pages=7)
        pool.free([g.row])
        async with bounded():
            got = await task
        pool.free([got.row])


async def test_extend_fitting_per_row_takes_a_row_asking_the_whole_group() -> None:
    """A row's count equal to its group's capacity can grow (the mutant
    refused it as one that never could)."""
    pool = grouped_pool(rows=3, swa=4, full=8)
    cap = kv_group(pool, "swa").capacity
    g = await pool.admit({"swa": 0, "full": 1})
    m, got = pool.extend_fitting([g.row], {"swa": [cap]})
    assert m == 1 and got["swa"].shape == (cap,)
    pool.free([g.row])
    pool.check_invariants()


# ------------------------------------------------------------ release_memory


async def test_release_memory_checks_its_timeout_before_anything_else() -> None:
    """A bad ``timeout`` is a ``ValueError`` even on a closed pool (the
    mutant let the closed check answer first, and checked it only in the
    drain, after the pool had started releasing)."""
    pool = AsyncReqToTokenPool(3, 4)
    await pool.close()
    with pytest.raises(ValueError):
        await pool.release_memory(timeout=-1.0)


async def test_grouped_extend_refuses_a_list_of_counts_and_changes_nothing() -> None:
    """``extend`` (one row) takes one int count per group: a list is a
    ``CapacityError`` that takes nothing (the mutant sent it down the
    per-row path of ``extend_rows``, which grew the row)."""
    pool = grouped_pool(rows=3, swa=4, full=8)
    g = await pool.admit({"swa": 0, "full": 1})
    before = pool_snapshot(pool)
    with pytest.raises(CapacityError, match="KV group 'swa': a page count must be an integer"):
        pool.extend(g.row, {"swa": [1]})
    assert pool_snapshot(pool) == before
    pool.free([g.row])


async def test_grouped_try_admit_raises_for_a_group_s_pages_only_quarantine(
    kit: Streams, caplog: pytest.LogCaptureFixture
) -> None:
    """The same on a pool with KV groups: a group's pages (not rows)
    quarantined, a waiter queued (the mutant looked at the rows' quarantine
    only, and answered None for ever)."""
    caplog.set_level(logging.CRITICAL, logger="asyncpool")
    async with grouped_pool(rows=3, swa=4, full=8) as pool:  # swa: 4 pages
        g = await pool.admit({"swa": 3, "full": 1})
        await _pages_quarantined(
            kit, pool, lambda after: pool.trim_pages(g.row, 1, after=after, group="swa")
        )
        task = asyncio.create_task(pool.admit({"swa": 2, "full": 1}))  # fits once g is freed
        await spin(1)
        assert pool.waiting() == 1
        with pytest.raises(CapacityError, match=r"3 pages of KV group 'swa'"):
            pool.try_admit({"swa": 3, "full": 0})
        pool.free([g.row])
        async with bounded():
            got = await task
        pool.free([got.row])


@pytest.mark.parametrize("shorter", ["swa", "full"])
async def test_extend_fitting_per_row_stops_where_the_shortest_group_does(shorter: str) -> None:
    """Two groups short: the run ends where the one that covers fewer rows
    ends, whichever group comes first (the mutant took the last one's)."""
    pool = grouped_pool(rows=5, swa=8, full=8)  # 8 pages each
    other = "full" if shorter == "swa" else "swa"
    filler = await pool.admit({shorter: 7, other: 6})  # 1 free in one, 2 in the other
    rows = [(await pool.admit({"swa": 0, "full": 0})).row for _ in range(3)]
    m, got = pool.extend_fitting(rows, {"swa": [1, 1, 1], "full": [1, 1, 1]})
    assert m == 1 and got["swa"].shape == got["full"].shape == (1,)
    pool.free([filler.row, *rows])
    pool.check_invariants()


async def test_extend_fitting_per_row_reclaims_and_serves_the_waiters(kit: Streams) -> None:
    """A short group reclaims its completed fences before the run is cut
    (the mutant did not: no row grew), and what the reclaim made free past
    the growth goes to the queued waiter at once, in the same call (the
    mutant left it to the fence's wake-up)."""
    pool = grouped_pool(rows=4, swa=4, full=8)  # swa: 4 pages
    a = await pool.admit({"swa": 4, "full": 1})
    b = await pool.admit({"swa": 0, "full": 1})
    task = asyncio.create_task(pool.admit({"swa": 1, "full": 1}))
    await spin(1)
    assert pool.waiting() == 1
    stream = kit.stream()
    gate = kit.gate(stream)
    fence = stream.record()
    pool.trim_pages(a.row, 1, fence=fence, group="swa")  # 3 pages behind the fence
    gate.open()
    fence.synchronize()  # landed; its wake-up has not run (no await since)
    assert pool.waiting() == 1
    m, got = pool.extend_fitting([b.row], {"swa": [1]})
    assert m == 1 and got["swa"].shape == (1,)
    assert pool.waiting() == 0  # served by the growth's reclaim
    async with bounded():
        g = await task
    pool.free([a.row, b.row, g.row])
    pool.check_invariants()
