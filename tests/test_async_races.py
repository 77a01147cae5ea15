"""Same-tick races of the async pool: cancellation, timeouts and fence
completions landing in the same loop iteration as a grant.

In every test: no row leaks (free + allocated + pending + quarantined ==
capacity and ``check_invariants()``), and nobody hangs (every wait is bounded
by ``asyncio.timeout``). These are the bug classes of CPython's Semaphore
(python/asyncio#270), anyio#947 and aiohttp#9670 (lost wake-ups) and of
cpython#90155 / anyio#1172 (queue jumping).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import threading

import pytest
from helpers import WAIT_S, EventFence, assert_conserved, bounded, spin

from asyncpool import AsyncReqToTokenPool, PoolClosedError
from asyncpool.fences import HostFence

_KEYS = itertools.count(2_000_000)  # stream keys no real stream uses


@pytest.fixture(autouse=True)
def _quiet_fault_logs(caplog):
    caplog.set_level(logging.CRITICAL, logger="asyncpool")


def make(size: int = 3, **kw) -> AsyncReqToTokenPool:
    return AsyncReqToTokenPool(size, 4, **kw)


async def outcome(task: asyncio.Task):
    """The task's result or exception, waiting at most WAIT_S."""
    async with asyncio.timeout(WAIT_S):
        try:
            return await task
        except BaseException as exc:  # CancelledError included
            return exc


async def queued(pool: AsyncReqToTokenPool, *specs, **kw) -> list[asyncio.Task]:
    """Start one ``alloc`` per spec and step until all of them are queued."""
    tasks = [asyncio.create_task(pool.alloc(n, **kw)) for n in specs]
    await spin()
    assert pool.waiting() == len(specs)
    return tasks


# ---------------------------------------------------------------- cancel vs free


async def test_cancel_then_free_in_the_same_tick_keeps_the_row():
    async with bounded(), make(3) as pool:
        held = await pool.alloc(2)
        [w] = await queued(pool, 1)
        w.cancel()
        pool.free(held[:1])  # no yield between the cancel and the free
        assert isinstance(await outcome(w), asyncio.CancelledError)
        assert pool.available_size() == 1 and pool.waiting() == 0
        assert pool.stats().cancellations == 1
        assert_conserved(pool)
        assert pool.try_alloc(1) == held[:1]


async def test_cancel_then_free_in_the_same_tick_serves_the_next_waiter():
    async with bounded(), make(3) as pool:
        held = await pool.alloc(2)
        w1, w2 = await queued(pool, 1, 1)
        w1.cancel()
        pool.free(held[:1])
        assert pool.waiting() == 0  # w2 granted at once, past the cancelled head
        assert isinstance(await outcome(w1), asyncio.CancelledError)
        assert await outcome(w2) == held[:1]
        assert_conserved(pool)


async def test_free_then_cancel_in_the_same_tick_gives_the_rows_back():
    async with bounded(), make(3) as pool:
        held = await pool.alloc(2)
        [w] = await queued(pool, 2)
        pool.free(held)  # w is granted both rows...
        assert pool.waiting() == 0 and pool.available_size() == 0
        w.cancel()  # ...and cancelled before it resumes
        assert isinstance(await outcome(w), asyncio.CancelledError)
        assert pool.available_size() == 2 and pool.allocated_size() == 0
        assert_conserved(pool)
        # Back at the head of the free queue, as if never taken.
        assert pool.try_alloc(2) == held


async def test_granted_then_cancelled_waiter_hands_its_rows_to_the_next():
    async with bounded(), make(3) as pool:
        held = await pool.alloc(2)
        w1, w2 = await queued(pool, 2, 2)
        pool.free(held)
        assert pool.waiting() == 1
        w1.cancel()
        assert isinstance(await outcome(w1), asyncio.CancelledError)
        assert await outcome(w2) == held  # the very rows w1 gave back
        assert pool.stats().allocs == 4  # the cancelled grant is not counted
        assert_conserved(pool)


async def test_cancelled_head_reruns_the_grant_for_smaller_waiters():
    async with bounded(), make(4) as pool:
        held = await pool.alloc(2)  # one row stays free
        big, small = await queued(pool, 3, 1)
        assert pool.available_size() == 1
        big.cancel()  # nobody else calls the pool after this
        assert isinstance(await outcome(big), asyncio.CancelledError)
        got = await outcome(small)
        assert len(got) == 1 and got[0] not in held
        assert_conserved(pool)


async def test_cancelling_every_waiter_in_a_queue():
    async with bounded(), make(5) as pool:
        held = await pool.alloc(4)
        tasks = await queued(pool, 1, 2, 1, 3, 1, 4, 2, 1, 1, 2)
        for t in tasks:
            t.cancel()
        pool.free(held)
        results = [await outcome(t) for t in tasks]
        assert all(isinstance(r, asyncio.CancelledError) for r in results)
        assert pool.waiting() == 0 and pool.available_size() == 4
        assert pool.stats().cancellations == len(tasks)
        assert_conserved(pool)


async def test_cancelling_every_waiter_after_some_were_granted():
    async with bounded(), make(5) as pool:
        held = await pool.alloc(4)
        tasks = await queued(pool, 1, 2, 1, 3, 1)
        pool.free(held)  # grants 1, 2, 1; 3 blocks
        assert pool.waiting() == 2
        for t in tasks:
            t.cancel()
        results = [await outcome(t) for t in tasks]
        assert all(isinstance(r, asyncio.CancelledError) for r in results)
        assert pool.available_size() == 4 and pool.allocated_size() == 0
        assert_conserved(pool)


async def test_cancel_and_close_in_the_same_tick():
    pool = make(3)
    async with bounded():
        held = await pool.alloc(2)
        w1, w2 = await queued(pool, 1, 1)
    w1.cancel()
    async with bounded():
        await pool.close()
        assert isinstance(await outcome(w1), asyncio.CancelledError)
        assert isinstance(await outcome(w2), PoolClosedError)
    pool.free(held)
    assert_conserved(pool)


async def test_grant_and_close_in_the_same_tick():
    pool = make(3)
    async with bounded():
        held = await pool.alloc(2)
        w1, w2 = await queued(pool, 1, 1)
    pool.free(held[:1])  # w1 granted
    async with bounded():
        await pool.close()  # w2 fails; w1 keeps its grant
        assert await outcome(w1) == held[:1]
        assert isinstance(await outcome(w2), PoolClosedError)
    pool.free(held[1:] + held[:1])
    assert pool.available_size() == 2
    assert_conserved(pool)


# ---------------------------------------------------------------- timeouts


@pytest.mark.lazy_tasks(
    "the waiter is made, then counted queued a pass later: eager, its 0 s timer fires sooner"
)
async def test_internal_timeout_expiring_as_the_grant_lands():
    async with bounded(), make(2) as pool:
        held = await pool.alloc(1)
        w = asyncio.create_task(pool.alloc(1, timeout=0))
        await asyncio.sleep(0)  # w queued; its zero timer is due next iteration
        assert pool.waiting() == 1
        pool.free(held)  # the grant and the expiry meet
        res = await outcome(w)
        if isinstance(res, TimeoutError):
            assert pool.stats().timeouts == 1 and pool.available_size() == 1
        else:
            assert res == held and pool.stats().timeouts == 0
            pool.free(res)
        assert pool.waiting() == 0
        assert_conserved(pool)


async def test_internal_timeout_and_free_scheduled_for_the_same_instant():
    async with bounded(), make(2) as pool:
        loop = asyncio.get_running_loop()
        held = await pool.alloc(1)
        w = asyncio.create_task(pool.alloc(1, timeout=0))
        await asyncio.sleep(0)
        loop.call_later(0, pool.free, held)
        res = await outcome(w)
        assert isinstance(res, (TimeoutError, list))
        if isinstance(res, list):
            pool.free(res)
        assert pool.available_size() == 1
        assert_conserved(pool)


async def test_timed_out_head_reruns_the_grant_for_smaller_waiters():
    async with bounded(), make(4) as pool:
        held = await pool.alloc(2)
        big = asyncio.create_task(pool.alloc(3, timeout=0))
        small = asyncio.create_task(pool.alloc(1))
        assert isinstance(await outcome(big), TimeoutError)
        got = await outcome(small)  # nobody called the pool in between
        assert len(got) == 1 and got[0] not in held
        assert pool.stats().timeouts == 1
        assert_conserved(pool)


async def test_external_timeout_expiring_as_the_grant_lands():
    async with bounded(), make(2) as pool:
        held = await pool.alloc(1)

        async def waiter():
            async with asyncio.timeout(0):
                return await pool.alloc(1)

        w = asyncio.create_task(waiter())
        await asyncio.sleep(0)  # w queued; its timeout fires next iteration
        pool.free(held)  # granted in the same iteration as the cancel lands
        res = await outcome(w)
        # Either order ends the same: the cancel wins, the row is not lost.
        assert isinstance(res, TimeoutError)
        assert pool.available_size() == 1 and pool.allocated_size() == 0
        assert pool.stats().cancellations == 1
        assert_conserved(pool)


async def test_timeout_on_the_fast_path_is_not_applied():
    async with bounded(), make(2) as pool:
        coro = pool.alloc(1, timeout=0)
        with pytest.raises(StopIteration):
            coro.send(None)


async def test_timeout_leaves_nothing_queued_or_allocated():
    async with bounded(), make(2) as pool:
        held = await pool.alloc(1)
        async with asyncio.timeout(WAIT_S):
            with pytest.raises(TimeoutError):
                await pool.alloc(1, timeout=0.01)
        assert pool.waiting() == 0 and pool.allocated_size() == 1
        assert pool.stats().timeouts == 1
        pool.free(held)
        assert_conserved(pool)


# ---------------------------------------------------------------- fences


def _after_pool_callback(fence) -> threading.Event:
    """An event set once the pool's own done-callback on ``fence`` has run
    (callbacks run in registration order; the pool registered at free time)."""
    ev = threading.Event()
    fence.add_done_callback(ev.set)
    return ev


async def test_fence_completing_while_the_head_is_cancelled(kit):
    async with bounded(), make(4) as pool:
        s = kit.stream()
        gate = kit.gate(s)
        rows = await pool.alloc(2)
        held = await pool.alloc(1)
        pool.free(rows, after=s)
        [fence] = pool._ledger.pending_fences()
        pool_saw_it = _after_pool_callback(fence)
        head, small = await queued(pool, 3, 1)
        gate.open()
        assert pool_saw_it.wait(WAIT_S)  # the wake-up is queued on the loop now
        head.cancel()  # same tick as the reclaim that will run next
        assert isinstance(await outcome(head), asyncio.CancelledError)
        got = await outcome(small)
        assert len(got) == 1 and got[0] in rows
        assert pool.available_size() == 1 and pool.pending_size() == 0
        pool.free(got + held)
        assert_conserved(pool)


async def test_head_granted_by_a_fence_then_cancelled_before_it_resumes(kit):
    async with bounded(), make(3) as pool:
        s = kit.stream()
        gate = kit.gate(s)
        rows = await pool.alloc(2)
        pool.free(rows, after=s)
        [fence] = pool._ledger.pending_fences()
        pool_saw_it = _after_pool_callback(fence)
        head, nxt = await queued(pool, 2, 2)
        gate.open()
        assert pool_saw_it.wait(WAIT_S)  # the wake-up is queued on the loop
        for _ in range(10):  # step until it ran and granted the head
            if pool.waiting() == 1:
                break
            await asyncio.sleep(0)
        assert pool.waiting() == 1
        assert not head.done()
        head.cancel()
        assert isinstance(await outcome(head), asyncio.CancelledError)
        assert sorted(await outcome(nxt)) == sorted(rows)
        assert_conserved(pool)


async def test_cancel_before_the_fence_completes(kit):
    async with bounded(), make(3) as pool:
        s = kit.stream()
        gate = kit.gate(s)
        rows = await pool.alloc(2)
        pool.free(rows, after=s)
        head, small = await queued(pool, 2, 1)
        head.cancel()
        gate.open()
        assert isinstance(await outcome(head), asyncio.CancelledError)
        assert len(await outcome(small)) == 1
        assert_conserved(pool)


async def test_every_waiter_cancelled_while_fences_complete(kit):
    async with bounded(), make(5) as pool:
        s = kit.stream()
        gates = []
        held = await pool.alloc(4)
        for r in held:
            gates.append(kit.gate(s))
            pool.free([r], after=s)
        tasks = await queued(pool, 1, 1, 2, 1)
        for g in gates:
            g.open()
        for t in tasks:
            t.cancel()
        results = [await outcome(t) for t in tasks]
        for r in results:
            assert isinstance(r, (asyncio.CancelledError, list))
        for r in results:
            if isinstance(r, list):
                pool.free(r)
        async with asyncio.timeout(WAIT_S):
            await pool.drain()
        assert pool.available_size() == 4 and pool.waiting() == 0
        assert_conserved(pool)


async def test_release_memory_cancelled_while_draining_restores_service(kit):
    async with bounded(), make(3) as pool:
        s = kit.stream()
        gate = kit.gate(s)
        pool.free(await pool.alloc(1), after=s)
        rel = asyncio.create_task(pool.release_memory())
        await spin()
        [w] = await queued(pool, 1)  # waits: allocation is held while releasing
        rel.cancel()
        assert isinstance(await outcome(rel), asyncio.CancelledError)
        assert not pool.released
        assert len(await outcome(w)) == 1  # served once the release was abandoned
        gate.open()
        async with asyncio.timeout(WAIT_S):
            await pool.drain()
        assert_conserved(pool)


# ---------------------------------------------------------------- randomised


@pytest.mark.parametrize("seed", range(4))
async def test_random_same_tick_interleavings_never_leak_or_hang(kit, seed):
    rng = random.Random(seed)
    pool = make(9)
    s = kit.stream()
    owned: list[list[int]] = []
    tasks: list[asyncio.Task] = []
    gates = []
    for _ in range(300):
        op = rng.random()
        if op < 0.35:
            n = rng.choice([1, 1, 2, 3, 5])
            timeout = rng.choice([None, None, 0, 0.001])
            tasks.append(
                asyncio.create_task(
                    pool.alloc(n, priority=rng.choice([0, 0, 1, 2]), timeout=timeout)
                )
            )
        elif op < 0.6 and owned:
            rows = owned.pop(rng.randrange(len(owned)))
            if rng.random() < 0.4:
                if not gates or rng.random() < 0.3:
                    gates.append(kit.gate(s))
                pool.free(rows, after=s)
            else:
                pool.free(rows)
        elif op < 0.72 and tasks:
            tasks[rng.randrange(len(tasks))].cancel()
        elif op < 0.8 and gates:
            gates.pop(0).open()
        elif op < 0.85:
            got = pool.try_alloc(rng.choice([1, 2]))
            if got is not None:
                owned.append(got)
        # Collect finished tasks; step the loop only sometimes, so several
        # actions land in one tick.
        if rng.random() < 0.5:
            await asyncio.sleep(0)
        for t in [t for t in tasks if t.done()]:
            tasks.remove(t)
            if not t.cancelled() and t.exception() is None:
                owned.append(t.result())
            elif not t.cancelled():
                assert isinstance(t.exception(), TimeoutError)
        pool.check_invariants()
    for t in tasks:
        t.cancel()
    for g in gates:
        g.open()
    for t in tasks:
        async with bounded():
            res = await outcome(t)
        if isinstance(res, list):
            owned.append(res)
    for rows in owned:
        pool.free(rows)
    async with asyncio.timeout(WAIT_S):
        await pool.drain()
    async with bounded():
        await pool.close()
    assert pool.available_size() == pool.capacity
    assert_conserved(pool)


# ---------------------------------------------------------------- wake-up flag


class _CompletesAnotherFence(EventFence):
    """Never completes itself; its ``query()`` completes ``other`` once ``row``
    is allocated again, i.e. inside the grant loop's reclaim, after ``other``
    was already queried in that same reclaim (stream heads go first)."""

    def __init__(self, pool: AsyncReqToTokenPool, row: int, other: HostFence) -> None:
        super().__init__()
        self.pool, self.row, self.other = pool, row, other

    def query(self) -> bool:
        if not self.other.query() and self.pool._ledger.state_of(self.row) == "allocated":
            self.other._settle(None)  # its done-callback runs here, in the loop thread
        return super().query()


async def test_fence_completing_during_the_wakeup_callback_schedules_another():
    """The fence wake-up (``FenceWakeups.on_fences_done``) must clear its
    flag *before* it reclaims: a fence that completes while the callback
    reclaims and grants (after the last look at it) has its wake-up
    coalesced into a callback that already ran, and its waiter hangs.
    A fence's query() completes another. End to end, this no longer kills
    that mutant on its own (c is of unknown origin, so the poller's thread
    may query it first, outside the callback); the rule's deterministic
    test is ``tests/test_wakeups.py::
    test_a_completion_during_the_reclaim_queues_another_wake_up``."""
    pool = make(4)
    rows = await pool.alloc(3)
    a = HostFence(next(_KEYS), 1)
    b = HostFence(next(_KEYS), 1)
    c = _CompletesAnotherFence(pool, rows[0], b)
    try:
        pool.free(rows[:1], fence=a)
        pool.free(rows[1:2], fence=b)
        pool.free(rows[2:], fence=c)
        w1, w2 = await queued(pool, 1, 1)
        a._settle(None)  # wakes the pool: reclaim gives row 1 to w1; then b completes
        assert await outcome(w1) == rows[:1]
        got = await outcome(w2)
        assert got == rows[1:2], f"the second waiter was never woken: {got!r}"
        assert_conserved(pool)
    finally:
        c.set()
        async with bounded():
            await pool.close()
