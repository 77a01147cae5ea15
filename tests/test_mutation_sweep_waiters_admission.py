"""Gaps found by a mechanical mutation sweep of ``asyncpool/waiters.py`` and
``asyncpool/admission.py``.

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
  loop; ``needs()`` lists what the waiters still queued need, in order.

Async tests run on asyncio and uvloop (conftest); every wait that could hang
is bounded.
"""

from __future__ import annotations

import asyncio
import collections
import gc
import weakref
from typing import Any

import pytest
from helpers import bounded

from asyncpool import CapacityError
from asyncpool.stats import Histogram
from asyncpool.waiters import WaiterQueues


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


async def test_a_timer_firing_after_the_grant_does_nothing() -> None:
    """The grant and the waiter's timer fall due in the same loop turn: the
    grant wins, the timer finds the future settled and leaves it (and the
    queue) alone: no error in the loop's handler, no extra grant pass."""
    rows = _Rows()
    queues = _queues(rows)
    loop = asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    window: collections.deque[float] = collections.deque()
    try:
        async with bounded():
            waiter, handle = queues.enqueue(_Need(1), 0, 0.0, loop, window, Histogram())
            assert handle is not None
            fut = waiter[1]
            blocked = queues.enqueue(_Need(2), 0, None, loop, window, Histogram())[0][1]
            rows.free.append(9)
            queues.grant()  # the head is served; its timer is still armed
            assert fut.result() == [9] and rows.takes == [1, 2]
            for _ in range(3):
                await asyncio.sleep(0.001)
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
