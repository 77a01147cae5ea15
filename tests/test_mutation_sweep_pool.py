"""Gaps found by a mechanical mutation sweep of the safety-critical part of
``asyncpool/pool.py`` (the grant hand-over, the free and alloc paths, reclaim,
``force_release``, the fence wake-ups and shedding unfittable waiters;
``reclaim``, ``force_release`` and the shedding are in
``asyncpool/fence_control.py`` since).

Each test pins one behaviour that a generated mutant broke while the focused
pool test files still passed:

* ``try_alloc`` counts its grant in ``alloc_calls`` (a zero wait in the
  histogram), as ``alloc`` does;
* ``try_admit`` with a row free and the pages it needs only pending behind a
  completed fence reclaims them and admits (the reclaim of pages alone
  counts as "made free", not just a reclaim of rows);
* the general ``free`` path closes the unchecked single-row fast paths for
  the whole call: a foreign ``alloc(1)`` made in the middle of it (here, from
  inside recording its ``after=`` fence) takes the checked path and is
  refused, instead of interleaving with the owner's bookkeeping;
* ``force_release`` refuses a foreign thread, changing nothing;
* a grant given back because its waiter was cancelled before the grant's
  scheduled reset ran (a coroutine driven by hand, so the cancellation is
  not ordered after the reset callback) is reset at once: the row, filed as
  clean at the head of the free queue, reads zero to the next owner, and
  the stale reset does not zero what that owner writes afterwards;
* dirty rows granted to several waiters in one grant pass are zeroed by one
  bulk reset, counted once in ``stats().resets``;
* fence completions in a burst, before the loop runs, queue one wake-up
  (``FenceWakeups.fence_done_threadsafe`` coalesces them), not one per fence;
* the fence wake-up closes the unchecked fast paths before it reclaims: a
  foreign ``alloc(1)`` made while it asks the fences is refused;
* a one-row ``free`` on the checked path, with nobody queued, reopens the
  unchecked fast paths the general path closed: a foreign ``alloc(1)`` is
  served again;
* a queued ``admit`` short of pages that are only pending behind a
  completed fence, with no row pending, is granted inside the ``free`` that
  frees a row (the hand-over reclaims the pages), not left for the next
  wake-up;
* a row granted to a queued ``alloc(1)`` gets a new ``generation`` (the
  inlined one-row hand-over tags it, as ``SlotLedger`` does);
* ``force_release`` on a pool without ``kv`` of a fence whose rows still
  wait for another fence says so (the rows ledger alone decides "held").

Async tests run on asyncio and uvloop (conftest); every wait that could hang
is bounded.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import EventFence, Streams, bounded, in_thread, pool_snapshot, spin, until

from asyncpool import (
    AsyncReqToTokenPool,
    HostFence,
    HostStream,
    KVPagePool,
    ReqToTokenPoolInfo,
    WrongThreadError,
)


async def test_try_alloc_counts_its_grant() -> None:
    async with bounded(), AsyncReqToTokenPool(5, 4) as pool:
        assert pool.stats().alloc_calls == 0
        rows = pool.try_alloc(2)
        assert rows is not None
        assert pool.stats().alloc_calls == 1
        assert pool.try_alloc(1) is not None
        assert pool.stats().alloc_calls == 2
        assert pool.stats().wait_histogram.count == 2


async def test_try_admit_reclaims_pages_alone_pending_behind_a_done_fence() -> None:
    kv = KVPagePool(9, 4)  # 8 pages
    async with bounded(), AsyncReqToTokenPool(3, 8, kv=kv) as pool:
        with Streams() as streams:
            grant = pool.try_admit(pages=8)
            assert grant is not None
            pages = pool.detach_pages(grant.row)
            fence = streams.event_fence()
            kv.free(pages, fence=fence)  # every page pending; rows still free
            assert pool.try_admit(pages=1) is None
            fence.set()
            # No await: no wake-up ran, so try_admit's own reclaim (pages
            # only, no row pending) is what makes the pages free.
            again = pool.try_admit(pages=1)
            assert again is not None
            assert kv.available_size() == 7
            pool.free([grant.row, again.row])
            pool.check_invariants()


class _ProbingStream(HostStream):
    """A host stream that runs ``probe`` while a fence is recorded on it."""

    probe: Any = None

    def record(self) -> HostFence:
        if self.probe is not None:
            probe, self.probe = self.probe, None
            probe()
        return super().record()


def _foreign_alloc(pool: AsyncReqToTokenPool, outcome: dict[str, Any]) -> Callable[[], None]:
    """A probe that calls ``pool.alloc(1)`` from a foreign thread and puts
    its rows (``"rows"``) or its WrongThreadError (``"error"``) in ``outcome``."""

    def probe() -> None:
        try:
            outcome["rows"] = in_thread(lambda: asyncio.run(pool.alloc(1)))
        except WrongThreadError as err:
            outcome["error"] = err

    return probe


async def test_general_free_keeps_the_unchecked_fast_paths_closed_throughout() -> None:
    async with bounded(), AsyncReqToTokenPool(5, 4) as pool:
        rows = await pool.alloc(3)  # binds; the general alloc opened the fast paths
        outcome: dict[str, Any] = {}
        stream = _ProbingStream("probe")
        try:
            stream.probe = _foreign_alloc(pool, outcome)
            pool.free(rows[:2], after=stream)
        finally:
            stream.close()
        assert "error" in outcome, outcome  # refused: it did not interleave
        assert pool.stats().allocated == 1
        pool.free(rows[2:])
        async with bounded():
            await pool.drain()
        pool.check_invariants()
        assert pool.available_size() == 4


async def test_force_release_refuses_a_foreign_thread() -> None:
    async with bounded(), AsyncReqToTokenPool(5, 4) as pool:
        with Streams() as streams:
            rows = await pool.alloc(2)
            fence = streams.event_fence()
            pool.free(rows, fence)
            before = pool_snapshot(pool)
            with pytest.raises(WrongThreadError):
                in_thread(lambda: pool.force_release(fence))
            assert pool_snapshot(pool) == before
            assert pool.force_release(fence) == (2, 0)


def _lens(pool: AsyncReqToTokenPool, row: int) -> tuple[int, int]:
    return int(pool.verified_lens[row]), int(pool.alloced_lens[row])


async def test_a_grant_given_back_before_its_reset_ran_is_reset_at_once() -> None:
    async with bounded(), AsyncReqToTokenPool(2, 8) as pool:  # one row
        [row] = await pool.alloc(1)
        pool.set_req_pool_info(row, ReqToTokenPoolInfo(5, 5, torch.arange(5)))
        waiter = pool.alloc(1)
        waiter.send(None)  # queued: it yields the future it awaits
        assert pool.waiting() == 1
        pool.free([row])  # granted to it; the row's reset is only scheduled
        with pytest.raises(asyncio.CancelledError):
            waiter.throw(asyncio.CancelledError())
        assert pool.waiting() == 0 and pool.available_size() == 1
        assert pool.try_alloc(1) == [row]
        assert _lens(pool, row) == (0, 0)
        pool.set_req_pool_info(row, ReqToTokenPoolInfo(3, 3, torch.arange(3)))
        await spin()  # the reset scheduled at the grant has had its turn
        assert _lens(pool, row) == (3, 3)
        pool.free([row])
        pool.check_invariants()


async def test_dirty_rows_granted_in_one_pass_cost_one_counted_reset() -> None:
    async with bounded(), AsyncReqToTokenPool(3, 8) as pool:  # two rows
        a, b = await pool.alloc(2)
        for row in (a, b):
            pool.set_req_pool_info(row, ReqToTokenPoolInfo(5, 5, torch.arange(5)))
        first = asyncio.ensure_future(pool.alloc(1))
        second = asyncio.ensure_future(pool.alloc(1))
        await spin()
        assert pool.waiting() == 2
        before = pool.stats().resets
        pool.free([a, b])  # one grant pass for both waiters
        async with bounded():
            got = [*(await first), *(await second)]
        assert sorted(got) == sorted([a, b])
        assert pool.stats().resets == before + 1
        assert _lens(pool, a) == _lens(pool, b) == (0, 0)
        pool.free(got)


async def test_a_burst_of_fence_completions_queues_one_wake_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with bounded(), AsyncReqToTokenPool(5, 4) as pool:
        with Streams() as streams:
            stream = streams.stream()
            gate = streams.gate(stream)
            rows = await pool.alloc(3)
            for row in rows:
                pool.free([row], after=stream)  # three fences, all held by the gate
            assert pool.available_size() == 1
            wake_ups: list[object] = []
            original = pool._wakeups.on_fences_done

            def counting(loop: asyncio.AbstractEventLoop | None = None) -> None:
                wake_ups.append(loop)
                original(loop)

            monkeypatch.setattr(pool._wakeups, "on_fences_done", counting)
            gate.open()
            stream.record().synchronize()  # every completion's callback has run
            await until(lambda: pool.available_size() == 4)
            await spin()
            assert len(wake_ups) == 1, wake_ups


class _ProbingFence(EventFence):
    """An event fence that runs ``probe`` when the owner's thread asks it,
    once it has completed."""

    def __init__(self) -> None:
        super().__init__()
        self.owner = threading.get_ident()
        self.probe: Any = None

    def query(self) -> bool:
        done = super().query()
        if done and self.probe is not None and threading.get_ident() == self.owner:
            probe, self.probe = self.probe, None
            probe()
        return done


async def test_the_fence_wake_up_closes_the_fast_paths_before_it_reclaims() -> None:
    async with bounded(), AsyncReqToTokenPool(5, 4) as pool:
        fence = _ProbingFence()
        try:
            rows = await pool.alloc(3)
            pool.free(rows[:2], fence)  # pending behind the fence
            pool.free(rows[2:])  # a checked single-row free: the fast paths reopen
            outcome: dict[str, Any] = {}
            fence.probe = _foreign_alloc(pool, outcome)
            fence.set()  # the watcher wakes the loop, whose reclaim asks the fence
            await until(lambda: bool(outcome))
            assert "error" in outcome, outcome
            await until(lambda: pool.available_size() == 4)
            pool.check_invariants()
        finally:
            fence.set()


async def test_a_checked_one_row_free_reopens_the_fast_paths() -> None:
    async with bounded(), AsyncReqToTokenPool(5, 4) as pool:
        rows = await pool.alloc(3)
        pool.free(rows[:2])  # the general path: the fast paths close
        with pytest.raises(WrongThreadError):
            in_thread(lambda: asyncio.run(pool.alloc(1)))
        pool.free(rows[2:])  # one row, nobody queued: checked, and reopens them
        theirs = in_thread(lambda: asyncio.run(pool.alloc(1)))
        assert len(theirs) == 1
        pool.check_invariants()
        assert pool.stats().allocated == 1
        pool.free(theirs)


async def test_a_queued_admit_is_granted_by_a_free_when_only_pages_are_pending() -> None:
    kv = KVPagePool(9, 4)  # 8 pages
    async with bounded(), AsyncReqToTokenPool(2, 8, kv=kv) as pool:  # one row
        with Streams() as streams:
            grant = pool.try_admit(pages=8)
            assert grant is not None
            fence = streams.event_fence()
            kv.free(pool.detach_pages(grant.row), fence=fence)  # pages pending only
            waiter = asyncio.ensure_future(pool.admit(pages=2))
            await spin()
            assert pool.waiting() == 1
            fence.set()
            pool.free([grant.row])  # no await: no wake-up has run
            assert pool.waiting() == 0  # granted at the hand-over, pages reclaimed there
            async with bounded():
                got = await waiter
            assert got.row == grant.row
            pool.free([got.row])
            pool.check_invariants()


async def test_a_row_granted_to_a_waiter_gets_a_new_generation() -> None:
    async with bounded(), AsyncReqToTokenPool(2, 8) as pool:  # one row
        [row] = await pool.alloc(1)
        first = pool.generation(row)
        waiter = asyncio.ensure_future(pool.alloc(1))
        await spin()
        assert pool.waiting() == 1
        pool.free([row])
        async with bounded():
            assert await waiter == [row]
        assert pool.generation(row) > first
        pool.free([row])


async def test_force_release_without_kv_says_the_rows_still_wait_for_other_fences(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="asyncpool.pool")
    async with bounded(), AsyncReqToTokenPool(4, 8) as pool:
        with Streams() as streams:
            stuck, other = streams.event_fence(), streams.event_fence()
            rows = await pool.alloc(1)
            pool.record_use(rows, other)
            pool.free(rows, fence=stuck)
            assert pool.force_release(stuck) == (0, 0)
            messages = [r.getMessage() for r in caplog.records]
            assert any("still wait for other fences" in m for m in messages), messages
            assert not any("holds no row" in m for m in messages)
            other.set()
            assert pool.reclaim() == 1
