"""Gaps found by a mechanical mutation sweep of ``asyncpool/waiters.py`` and
``asyncpool/admission.py`` (since split: its growth is ``growth.py``'s, its
give-back and ``free`` of rows with pages ``give_back.py``'s).

Each test pins one behaviour that a generated mutant broke while every test
file that mentions the module's classes or calls still passed:

* ``WaiterQueues.wait()`` (the documented, un-inlined form of the wait that
  ``alloc`` and ``admit`` inline) returns the grant; a waiter cancelled
  while queued leaves the queue and one cancelled after its grant gives it
  back; a timeout raises ``TimeoutError``, counts one timeout and takes the
  waiter off its queue; the timer is cancelled once the wait is over (a
  live timer kept the waiter, and what it needs, alive until it fired);
  and the wait leaves no reference cycle through a timeout's traceback;
* a timer that fires after its waiter was granted, before the waiter
  resumed, does nothing (no error on the settled future, no second grant
  pass);
* ``WaiterQueues.shed()`` fails every waiter its callback refuses, in
  every priority, past a cancelled waiter still queued (never failed
  itself), takes each off its queue, returns how many, and runs the grant
  loop; ``needs()`` lists what the waiters still queued need, in order;
* a timed ``admit`` granted after queueing cancels its timer; one that
  times out counts one timeout;
* ``admit`` fails at once when quarantined *pages* alone (no row
  quarantined) make its need unfittable, instead of queueing for good;
* a queued ``admit`` short of pages is granted at hand-over when the
  reclaim there makes free exactly the pages it needs;
* ``try_admit(0)`` grants a row with no pages;
* an ``admit`` that queues on a new event loop moves the pool there, so a
  fence deferred on the old loop wakes it;
* ``extend_rows``' per-row form refuses a row that is not allocated (it
  gave a freed row pages nobody frees); ``extend``, ``pages_of`` and
  ``detach_pages`` raise InvalidSlotError for the first id past the table;
* ``extend_rows``: ``k`` defaults to one page a row; a numpy integer or a
  0-d tensor is one count for every row (a 2-D result); per-row counts
  may add up to exactly the KV capacity; the per-row form of no rows
  answers None while the memory is released;
* ``trim_pages`` refuses a foreign thread; returns 0 when nothing is given
  back, in every form; gives back every page of a list of rows for
  ``keep=0``; and, with ``free`` on a pool with ``kv``, its
  one-row fast path raises InvalidSlotError for the first row id past the
  table (an IndexError before the bound was checked), and trim_pages'
  takes only an allocated row there (one pending behind a fence raises
  InvalidSlotError, as on the checked path).

A later hand-made sweep added: an ``admit`` queued behind a head that does
not fit runs no grant pass at the loop's next turn (the mutant scheduled
one for every admit, as for a request behind dead waiters just dropped).

Async tests run on asyncio and uvloop (conftest); every wait that could hang
is bounded.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import logging
import weakref
from typing import Any

import numpy as np
import pytest
import torch
from helpers import WAIT_S, EventFence, Streams, bounded, in_thread, pool_snapshot, spin

from asyncpool import (
    AsyncReqToTokenPool,
    CapacityError,
    FenceError,
    InvalidSlotError,
    KVPagePool,
    WrongThreadError,
)
from asyncpool.stats import Histogram
from asyncpool.waiters import WaiterQueues


def _boom() -> None:
    raise RuntimeError("kernel fault (simulated)")


def _settled(stream: Any) -> None:
    """Block until everything launched on ``stream`` ran (or it faulted)."""
    try:
        stream.record().wait(WAIT_S)
    except FenceError:
        pass


class _Need:
    """A need the test can hold a weak reference to."""

    def __init__(self, n: int) -> None:
        self.n = n


class _Rows:
    """A supply of rows taken by ``_Need``s, recording each take and give-back."""

    def __init__(self, free: int = 0) -> None:
        self.free: collections.deque[int] = collections.deque(range(free))
        self.takes: list[int] = []
        self.given_back: list[list[int]] = []

    def take(self, need: _Need) -> list[int] | None:
        self.takes.append(need.n)
        if need.n > len(self.free):
            return None
        return [self.free.popleft() for _ in range(need.n)]

    def give_back(self, rows: list[int]) -> None:
        self.given_back.append(rows)
        self.free.extendleft(reversed(rows))


def _describe(need: Any) -> tuple[str, str]:
    return f"alloc({need.n})", f"{need.n} rows"


def _queues(rows: _Rows) -> WaiterQueues:
    return WaiterQueues(rows.take, rows.give_back, _describe)


def _wait(queues: WaiterQueues, need: _Need, timeout: float | None = None) -> Any:
    loop = asyncio.get_running_loop()
    window: collections.deque[float] = collections.deque()
    return queues.wait(need, 0, timeout, loop, window, Histogram())


async def test_wait_returns_the_grant_the_loop_hands_over() -> None:
    rows = _Rows()
    queues = _queues(rows)
    async with bounded():
        task = asyncio.ensure_future(_wait(queues, _Need(2)))
        await asyncio.sleep(0)
        assert queues.count == 1 and not task.done()
        rows.free.extend([5, 6])
        queues.grant()
        assert await task == [5, 6]
        assert queues.count == 0 and queues.timeouts == 0 and queues.cancellations == 0


async def test_wait_cancelled_while_queued_leaves_the_queue() -> None:
    rows = _Rows()
    queues = _queues(rows)
    async with bounded():
        task = asyncio.ensure_future(_wait(queues, _Need(1)))
        await asyncio.sleep(0)
        assert queues.count == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert queues.count == 0 and queues.cancellations == 1
        queues.check_invariants()
        rows.free.append(3)
        queues.grant()
        assert rows.takes == [] and list(rows.free) == [3]  # nobody left to serve


async def test_wait_cancelled_after_its_grant_gives_the_grant_back() -> None:
    rows = _Rows()
    queues = _queues(rows)
    async with bounded():
        task = asyncio.ensure_future(_wait(queues, _Need(2)))
        await asyncio.sleep(0)
        rows.free.extend([5, 6])
        queues.grant()  # granted; the task has not resumed yet
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert rows.given_back == [[5, 6]] and list(rows.free) == [5, 6]
        assert queues.count == 0 and queues.cancellations == 1


async def test_wait_times_out_counts_it_and_leaves_the_queue() -> None:
    rows = _Rows()
    queues = _queues(rows)
    async with bounded():
        with pytest.raises(TimeoutError, match=r"alloc\(1\) timed out after 0.01 s"):
            await _wait(queues, _Need(1), timeout=0.01)
        assert queues.timeouts == 1 and queues.cancellations == 0 and queues.count == 0
        queues.check_invariants()


async def test_wait_cancels_its_timer_once_granted() -> None:
    """A granted wait leaves no live timer: the timer held the waiter (its
    need and future) for the whole timeout, an hour here."""
    rows = _Rows()
    queues = _queues(rows)
    need = _Need(1)
    ref = weakref.ref(need)
    async with bounded():
        task = asyncio.ensure_future(_wait(queues, need, timeout=3600.0))
        del need
        await asyncio.sleep(0)
        rows.free.append(4)
        queues.grant()
        assert await task == [4]
        del task
        gc.collect()
        assert ref() is None, "the granted waiter is still referenced (its timer is live)"


async def test_wait_leaves_no_cycle_through_a_timeout() -> None:
    """After a timed-out wait, the waiter (its need) is freed by reference
    counting alone: the timeout's traceback holds the wait's frame, which
    must not hold the waiter (whose future holds the timeout)."""
    rows = _Rows()
    queues = _queues(rows)
    need = _Need(1)
    ref = weakref.ref(need)
    gc.collect()
    gc.disable()
    try:
        async with bounded():
            try:
                await _wait(queues, need, timeout=0.001)
            except TimeoutError:
                pass
            del need
            # The loop's handle that resumed this task holds the future
            # until the task yields: let it go.
            await asyncio.sleep(0)
            assert ref() is None, "a timed-out wait left a reference cycle"
    finally:
        gc.enable()


async def test_a_timer_firing_after_the_grant_does_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The grant and the waiter's timer fall due in the same loop turn: the
    grant wins, the timer finds the future settled and leaves it (and the
    queue) alone: no error in the loop's handler, no extra grant pass."""
    rows = _Rows()
    queues = _queues(rows)
    loop = asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    window: collections.deque[float] = collections.deque()
    fired = asyncio.Event()
    expire = type(queues)._expire

    def expire_and_say(self: Any, *args: Any) -> None:
        expire(self, *args)
        fired.set()

    monkeypatch.setattr(type(queues), "_expire", expire_and_say)
    try:
        async with bounded():
            waiter, handle = queues.enqueue(_Need(1), 0, 0.0, loop, window, Histogram())
            assert handle is not None
            fut = waiter[1]
            blocked = queues.enqueue(_Need(2), 0, None, loop, window, Histogram())[0][1]
            rows.free.append(9)
            queues.grant()  # the head is served; its timer is still armed
            assert fut.result() == [9] and rows.takes == [1, 2]
            await fired.wait()  # the timer has run
            assert errors == []
            assert fut.result() == [9] and not blocked.done()
            assert rows.takes == [1, 2]  # the fired timer ran no grant pass
            assert queues.count == 1 and queues.timeouts == 0
            queues.check_invariants()
    finally:
        loop.set_exception_handler(None)


def _too_big(need: _Need) -> BaseException | None:
    return CapacityError(f"{need.n} rows can never fit") if need.n >= 5 else None


async def test_shed_fails_every_unfittable_waiter_and_serves_the_rest() -> None:
    """``shed`` fails each waiter its callback answers with an error, in
    every priority and past a cancelled one still queued (left to its own
    task: never failed), takes each off its queue (also those behind a
    head that still does not fit), returns how many it failed, and runs the
    grant loop: a waiter that only failed heads blocked is served at once,
    with nothing freed."""
    rows = _Rows(free=1)
    queues = _queues(rows)
    loop = asyncio.get_running_loop()
    window: collections.deque[float] = collections.deque()
    async with bounded():
        futs = [
            queues.enqueue(_Need(n), prio, None, loop, window, Histogram())[0][1]
            for n, prio in [(5, 0), (6, 0), (7, 0), (1, 0), (2, 0), (9, 0), (8, 1)]
        ]
        head, cancelled, third, small, blocked, after, low = futs
        cancelled.cancel()  # its task has not run its handler yet
        assert queues.shed(_too_big) == 4
        for fut in (head, third, after, low):
            with pytest.raises(CapacityError, match="can never fit"):
                fut.result()
        assert cancelled.cancelled()
        assert small.result() == [0] and not blocked.done()
        assert rows.takes == [1, 2]
        assert queues.count == 1 and [need.n for need in queues.needs()] == [2]
        queues.check_invariants()
        assert queues.shed(_too_big) == 0 and queues.count == 1


# ------------------------------------------------------------------ admission


def _pool(rows: int = 2, pages: int = 4) -> AsyncReqToTokenPool:
    """A pool of ``rows`` grantable rows and ``pages`` grantable pages."""
    return AsyncReqToTokenPool(rows + 1, 64, kv=KVPagePool(pages + 1, 4))


async def test_a_granted_timed_admit_cancels_its_timer() -> None:
    """A timed ``admit`` that queued and was granted cancels its timeout
    handle, as ``alloc`` does: the loop does not keep the waiter (its
    future, the granted row and pages) alive for the whole timeout."""
    async with bounded():
        pool = _pool(rows=1)
        held = await pool.admit(pages=1)
        task = asyncio.ensure_future(pool.admit(pages=2, timeout=3600))
        await asyncio.sleep(0)
        assert pool.waiting() == 1
        (queue,) = pool._waiters._queues.values()
        ref = weakref.ref(queue[0][1])  # the waiter's future
        del queue
        pool.free([held.row])
        got = await task
        del task
        gc.collect()
        assert ref() is None, "the granted waiter is still referenced (its timer is live)"
        pool.free([got.row])
        await pool.close()


async def test_a_timed_out_admit_counts_one_timeout() -> None:
    """A timed-out ``admit`` counts exactly one timeout (where the call
    raises it, as ``alloc`` does) and leaves nobody queued."""
    async with bounded():
        pool = _pool(rows=1)
        held = await pool.admit(pages=1)
        with pytest.raises(TimeoutError):
            await pool.admit(pages=1, timeout=0.01)
        st = pool.stats()
        assert st.timeouts == 1 and st.cancellations == 0 and pool.waiting() == 0
        pool.free([held.row])
        await pool.close()


async def test_admit_refuses_at_once_what_quarantined_pages_alone_rule_out(
    kit: Streams, caplog: pytest.LogCaptureFixture
) -> None:
    """Pages quarantined behind a faulted fence (their row is not: it only
    trimmed them) make an ``admit`` for more pages than can ever be free
    again fail at once with CapacityError, instead of queueing for good."""
    caplog.set_level(logging.CRITICAL, logger="asyncpool")
    stream = kit.stream()
    gate = kit.gate(stream)
    stream.launch(_boom)
    pool = _pool(rows=2, pages=4)
    async with bounded():
        g = await pool.admit(pages=2)
    pool.trim_pages(g.row, 0, after=stream)
    gate.open()
    await asyncio.wait_for(asyncio.to_thread(_settled, stream), WAIT_S)
    pool.reclaim()
    st = pool.stats()
    assert st.pages_quarantined == 2 and st.quarantined == 0
    with pytest.raises(CapacityError, match="quarantined"):
        async with bounded():  # a lost check must fail, not hang
            await pool.admit(pages=3)
    assert pool.waiting() == 0
    pool.free([g.row])
    await pool.close()


async def test_extend_rows_grows_each_row_by_one_page_by_default() -> None:
    async with bounded():
        pool = _pool(rows=2, pages=4)
        a, b = await pool.admit(pages=0), await pool.admit(pages=0)
        new = pool.extend_rows([a.row, b.row])
        assert new is not None and tuple(new.shape) == (2, 1)
        assert [len(pool.pages_of(r)) for r in (a.row, b.row)] == [1, 1]
        pool.free([a.row, b.row])
        await pool.close()


@pytest.mark.parametrize("k", [np.int64(2), torch.tensor(2)], ids=["numpy", "tensor"])
async def test_extend_rows_takes_an_integer_scalar_as_one_count_for_every_row(k: Any) -> None:
    """A numpy integer or a 0-d tensor is one page count for every row, as
    an int is: a ``(len(rows), k)`` tensor, not the per-row form's 1-D one."""
    async with bounded():
        pool = _pool(rows=2, pages=4)
        a, b = await pool.admit(pages=0), await pool.admit(pages=0)
        new = pool.extend_rows([a.row, b.row], k)
        assert new is not None and tuple(new.shape) == (2, 2)
        assert pool.pages_of(a.row).tolist() == new[0].tolist()
        assert pool.pages_of(b.row).tolist() == new[1].tolist()
        pool.free([a.row, b.row])
        await pool.close()


async def test_extend_rows_per_row_counts_may_take_the_whole_capacity() -> None:
    """Per-row counts that add up to exactly the KV pool's capacity are
    allowed (all free: granted); one page more is refused."""
    async with bounded():
        pool = _pool(rows=2, pages=4)
        a, b = await pool.admit(pages=0), await pool.admit(pages=0)
        with pytest.raises(CapacityError, match="5 pages in all"):
            pool.extend_rows([a.row, b.row], [2, 3])
        new = pool.extend_rows([a.row, b.row], [1, 3])
        assert new is not None and tuple(new.shape) == (4,)
        assert len(pool.pages_of(a.row)) == 1 and len(pool.pages_of(b.row)) == 3
        pool.free([a.row, b.row])
        await pool.close()


async def test_extend_rows_per_row_of_no_rows_answers_none_while_released() -> None:
    """The per-row form answers as the one-count form does: None while the
    memory is released, even for no rows (an empty tensor once resumed)."""
    pool = _pool(rows=2, pages=4)
    async with bounded():
        await pool.release_memory()
    assert pool.extend_rows([], []) is None
    async with bounded():
        await pool.resume_memory()
    got = pool.extend_rows([], [])
    assert got is not None and tuple(got.shape) == (0,)
    await pool.close()


async def test_trim_pages_from_another_thread_is_refused_and_changes_nothing() -> None:
    """``trim_pages`` is checked like every call of a pool with ``kv``: from
    a thread that is not the pool's it raises WrongThreadError, the row
    keeps its pages and none is freed."""
    async with bounded():
        pool = _pool(rows=2, pages=4)
        g = await pool.admit(pages=3)
        before = pool_snapshot(pool)
        for rows, keep in [(g.row, 1), ([g.row], [0])]:
            with pytest.raises(WrongThreadError):
                in_thread(lambda rows=rows, keep=keep: pool.trim_pages(rows, keep))
        assert pool_snapshot(pool) == before
        assert pool.pages_of(g.row).tolist() == g.pages.tolist()
        pool.free([g.row])
        await pool.close()


async def test_try_admit_of_no_pages_grants_a_row_alone() -> None:
    """``try_admit(0)`` is a row with no pages, as ``admit(pages=0)`` is."""
    async with bounded():
        pool = _pool(rows=2, pages=4)
        g = pool.try_admit(0)
        assert g is not None and len(g.pages) == 0
        assert len(pool.pages_of(g.row)) == 0
        pool.free([g.row])
        await pool.close()


async def test_trim_pages_with_nothing_to_give_back_returns_zero() -> None:
    """A trim that gives nothing back (every row owns no more than it
    keeps) returns 0 pages free at once, in every form: a list of rows, a
    count per row, a fence passed."""
    async with bounded():
        pool = _pool(rows=2, pages=4)
        a, b = await pool.admit(pages=1), await pool.admit(pages=2)
        assert pool.trim_pages([a.row, b.row], 2) == 0
        assert pool.trim_pages([a.row, b.row], [1, 2]) == 0
        assert pool.trim_pages(a.row, 1, fence=EventFence()) == 0
        assert [len(pool.pages_of(r)) for r in (a.row, b.row)] == [1, 2]
        pool.free([a.row, b.row])
        await pool.close()


async def test_one_row_past_the_table_raises_invalid_slot_on_the_fast_paths() -> None:
    """The one-row fast paths of ``trim_pages`` and of ``free`` on a pool
    with ``kv`` bound the row as the checked paths do: the first id past
    the table raises InvalidSlotError (out of range), not an IndexError of
    the state list, and changes nothing."""
    pool = _pool(rows=2, pages=4)
    before = pool_snapshot(pool)
    for row in (pool.size, 0, -1):
        with pytest.raises(InvalidSlotError):
            pool.trim_pages(row, 0)
        with pytest.raises(InvalidSlotError):
            pool.free([row])
    assert pool_snapshot(pool) == before
    await pool.close()


async def test_an_admit_waiter_gets_pages_a_reclaim_at_hand_over_makes_just_enough() -> None:
    """At hand-over, an ``admit`` waiter short of pages reclaims completed
    fences; if that makes free exactly the pages it needs, it is granted
    then, in the free that ran the grant loop, not at a later wake-up."""
    pool = _pool(rows=3, pages=4)
    fence = EventFence()
    try:
        async with bounded():
            other = await pool.admit(pages=0)
            g = await pool.admit(pages=4)
            pool.free([g.row], fence=fence)  # row and 4 pages wait behind it
            waiter = asyncio.ensure_future(pool.admit(pages=4))
            await asyncio.sleep(0)
            assert pool.waiting() == 1
            fence.set()  # completed; no wake-up has run yet
            pool.free([other.row])  # runs the grant loop, which reclaims
            assert pool.waiting() == 0, "the waiter was not granted at hand-over"
            got = await waiter
            assert len(got.pages) == 4
            pool.free([got.row])
    finally:
        fence.set()
        await pool.close()


async def test_trim_pages_of_one_row_behind_a_fence_or_free_is_refused() -> None:
    """The one-row fast path of ``trim_pages`` takes only allocated rows: a
    row pending behind a fence, or free, raises InvalidSlotError (as the
    checked path does), not 0 as for a row with nothing to give back."""
    pool = _pool(rows=2, pages=4)
    fence = EventFence()
    try:
        async with bounded():
            pending = await pool.admit(pages=0)
            free = await pool.admit(pages=0)
        pool.free([pending.row], fence=fence)
        pool.free([free.row])
        before = pool_snapshot(pool)
        for row in (pending.row, free.row):
            with pytest.raises(InvalidSlotError):
                pool.trim_pages(row, 0)
        assert pool_snapshot(pool) == before
    finally:
        fence.set()
        await pool.close()


async def test_trim_pages_of_a_list_of_rows_to_zero_gives_back_every_page() -> None:
    """``keep=0`` (one count for every row of a list) is a page count like
    any other: every page of every row is given back (free at once here,
    no use recorded); -1 is refused, changing nothing."""
    async with bounded():
        pool = _pool(rows=2, pages=4)
        a, b = await pool.admit(pages=1), await pool.admit(pages=2)
        before = pool_snapshot(pool)
        with pytest.raises(CapacityError, match=">= 0"):
            pool.trim_pages([a.row, b.row], -1)
        assert pool_snapshot(pool) == before
        assert pool.trim_pages([a.row, b.row], 0) == 3
        assert [len(pool.pages_of(r)) for r in (a.row, b.row)] == [0, 0]
        pool.free([a.row, b.row])
        await pool.close()


async def test_extend_rows_per_row_refuses_a_row_not_allocated() -> None:
    """The per-row form of ``extend_rows`` checks its rows as the one-count
    form does: a freed row raises InvalidSlotError and takes no page (it
    would own pages nobody frees)."""
    async with bounded():
        pool = _pool(rows=2, pages=4)
        live, gone = await pool.admit(pages=0), await pool.admit(pages=0)
        pool.free([gone.row])
        before = pool_snapshot(pool)
        for rows, k in [([gone.row], [2]), ([live.row, gone.row], [1, 1])]:
            with pytest.raises(InvalidSlotError, match="already free"):
                pool.extend_rows(rows, k)
        assert pool_snapshot(pool) == before
        assert pool.stats().pages_free == 4
        pool.free([live.row])
        await pool.close()


async def test_row_calls_raise_invalid_slot_for_the_first_id_past_the_table() -> None:
    """``extend``, ``pages_of`` and ``detach_pages`` bound the row before
    they read its state: the first id past the table raises
    InvalidSlotError (out of range), not an IndexError."""
    pool = _pool(rows=2, pages=4)
    for call in (
        lambda: pool.extend(pool.size, 1),
        lambda: pool.pages_of(pool.size),
        lambda: pool.detach_pages(pool.size),
    ):
        with pytest.raises(InvalidSlotError, match="out of range"):
            call()
    await pool.close()


def test_an_admit_queued_on_a_new_loop_is_woken_there() -> None:
    """An ``admit`` that queues on a new event loop (the pool's first loop
    closed while pages still waited behind a fence) moves the pool to that
    loop, so the fence's completion wakes the waiter there."""
    pool = _pool(rows=1, pages=4)
    fence = EventFence()

    async def first() -> None:
        g = await pool.admit(pages=4)
        pool.free([g.row], fence=fence)  # watched from this loop

    async def second() -> int:
        async with bounded():
            waiter = asyncio.ensure_future(pool.admit(pages=4))
            await asyncio.sleep(0)
            assert pool.waiting() == 1
            fence.set()
            got = await waiter
            pool.free([got.row])
            await pool.close()
            return len(got.pages)

    try:
        asyncio.run(first())
        assert asyncio.run(second()) == 4
    finally:
        fence.set()


async def test_an_admit_queued_behind_a_blocked_head_runs_no_grant_pass() -> None:
    """Only a new head (or a request behind dead waiters just dropped)
    schedules a grant pass; an ``admit`` queued behind a head that does not
    fit probes nothing: no take, no reclaim for a head nothing freed."""
    async with bounded(), AsyncReqToTokenPool(4, 8, kv=KVPagePool(9, 4)) as pool:
        every_page = await pool.admit(pages=8)
        head = asyncio.ensure_future(pool.admit(pages=2))
        await spin()
        assert not head.done()
        probes: list[Any] = []
        take = pool._waiters._take

        def counting(need: Any) -> Any:
            probes.append(need)
            return take(need)

        pool._waiters._take = counting
        behind = asyncio.ensure_future(pool.admit(pages=1))
        await spin()
        assert probes == [] and not head.done() and not behind.done()
        pool.free([every_page.row])  # a free runs the loop: both are served
        assert probes == [(1, 2), (1, 1)]
        first, second = await head, await behind
        pool.free([first.row, second.row])
        pool.check_invariants()
