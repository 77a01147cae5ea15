"""AsyncReqToTokenPool: grant order, fast path, fence-driven wake-ups, vLLM
deferred-free scenarios, leases, lifecycle, memory release, load shedding,
thread affinity, bad input, stats, and the fence watcher.

Every test runs on asyncio and uvloop (conftest). Waits that could hang are
bounded by ``asyncio.timeout``; the loop is stepped with ``sleep(0)``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading

import pytest
import torch
from helpers import (
    WAIT_S,
    FakeStream,
    assert_conserved,
    bounded,
    gpu_busy,
    pool_snapshot,
    spin,
    unfittable_apart,
)

from asyncpool import (
    AsyncReqToTokenPool,
    CapacityError,
    DoubleFreeError,
    FenceError,
    InvalidSlotError,
    LatencySummary,
    PoolBusyError,
    PoolClosedError,
    PoolStats,
    ReqToTokenPoolInfo,
    WrongThreadError,
)


@pytest.fixture(autouse=True)
def _quiet_fault_logs(caplog):
    caplog.set_level(logging.CRITICAL, logger="asyncpool")


def make(size: int = 5, **kw) -> AsyncReqToTokenPool:
    return AsyncReqToTokenPool(size, 8, **kw)


async def finish(*tasks: asyncio.Task) -> list:
    async with asyncio.timeout(WAIT_S):
        return await asyncio.gather(*tasks)


def lens(pool: AsyncReqToTokenPool, row: int) -> tuple[int, int, int]:
    return (
        int(pool.verified_lens[row]),
        int(pool.alloced_lens[row]),
        int(pool.alloced_lens_cpu[row]),
    )


# ---------------------------------------------------------------- fast path


async def test_fast_path_completes_without_suspending():
    async with bounded(), make(9) as pool:
        for n in (1, 3, 2):
            coro = pool.alloc(n)
            with pytest.raises(StopIteration) as ei:
                coro.send(None)
            assert len(ei.value.value) == n
        # Dirty rows (a bulk reset on the way) do not suspend either.
        pool.free(list(range(1, 7)))
        coro = pool.alloc(2)
        with pytest.raises(StopIteration) as ei:
            coro.send(None)
        assert ei.value.value == [7, 8]
        coro = pool.alloc(1)
        with pytest.raises(StopIteration) as ei:
            coro.send(None)
        assert ei.value.value == [1]
        assert_conserved(pool)


@pytest.mark.lazy_tasks(
    "its probe is a task created and not yet run: eager, the probe runs at once"
)
async def test_fast_path_lets_no_other_task_run():
    async with bounded(), make(5) as pool:
        ran: list[str] = []

        async def other() -> None:
            ran.append("other")

        t = asyncio.create_task(other())
        rows = await pool.alloc(2)
        rows += await pool.alloc(1)
        assert ran == []  # no suspension: the other task never got a turn
        await t
        assert ran == ["other"]
        assert len(rows) == 3


async def test_slow_path_suspends_until_granted():
    async with bounded(), make(3) as pool:
        held = await pool.alloc(2)
        t = asyncio.create_task(pool.alloc(1))
        await spin()
        assert not t.done() and pool.waiting() == 1
        pool.free(held[:1])
        assert pool.waiting() == 0  # granted at hand-over, synchronously
        assert await finish(t) == [held[:1]]


async def test_alloc_fast_path_reclaims_a_completed_fence(kit):
    async with bounded(), make(3) as pool:
        s = kit.stream()
        gate = kit.gate(s)
        rows = await pool.alloc(2)
        pool.free(rows, after=s)
        gate.open()
        s.synchronize()  # fence complete; its loop callback has not run yet
        assert pool.pending_size() == 2
        coro = pool.alloc(2)
        with pytest.raises(StopIteration) as ei:
            coro.send(None)
        assert ei.value.value == rows
        await spin()
        assert_conserved(pool)


# ---------------------------------------------------------------- grant order


async def _waiter(pool, n, name, log, **kw):
    rows = await pool.alloc(n, **kw)
    log.append(name)
    return rows


async def test_fifo_grant_order_within_a_priority():
    async with bounded(), make(5) as pool:
        held = await pool.alloc(4)
        log: list[str] = []
        tasks = [asyncio.create_task(_waiter(pool, 1, name, log)) for name in "ABCD"]
        await spin()
        assert pool.waiting() == 4
        for i, row in enumerate(held):
            pool.free([row])
            assert pool.waiting() == 3 - i
            await spin()
            assert log == list("ABCD"[: i + 1])
        results = await finish(*tasks)
        assert results == [[r] for r in held]  # each got the row freed for it
        assert_conserved(pool)


async def test_priority_order_lower_number_first():
    async with bounded(), make(5) as pool:
        held = await pool.alloc(4)
        log: list[str] = []
        specs = [("p5", 5), ("p0a", 0), ("p1", 1), ("p0b", 0)]
        tasks = [asyncio.create_task(_waiter(pool, 1, name, log, priority=p)) for name, p in specs]
        await spin()
        for row in held:
            pool.free([row])
            await spin()
        await finish(*tasks)
        assert log == ["p0a", "p0b", "p1", "p5"]
        assert_conserved(pool)


async def test_negative_priority_goes_first():
    async with bounded(), make(3) as pool:
        held = await pool.alloc(2)
        log: list[str] = []
        t0 = asyncio.create_task(_waiter(pool, 1, "zero", log))
        tn = asyncio.create_task(_waiter(pool, 1, "neg", log, priority=-3))
        await spin()
        pool.free(held[:1])
        await spin()
        assert log == ["neg"]
        pool.free(held[1:])
        await finish(t0, tn)


async def test_big_head_blocks_smaller_ones_behind_it():
    async with bounded(), make(5) as pool:
        held = await pool.alloc(4)
        log: list[str] = []
        big = asyncio.create_task(_waiter(pool, 3, "big", log))
        small = asyncio.create_task(_waiter(pool, 1, "small", log))
        await spin()
        pool.free(held[:1])
        await spin()
        assert log == [] and pool.available_size() == 1 and pool.waiting() == 2
        assert pool.try_alloc(1) is None  # nor can anyone jump the queue
        pool.free(held[1:3])
        await spin()
        assert log == ["big"] and pool.available_size() == 0
        pool.free(held[3:])
        await finish(big, small)
        assert log == ["big", "small"]


async def test_big_head_blocks_across_priorities():
    async with bounded(), make(5) as pool:
        held = await pool.alloc(4)
        log: list[str] = []
        big = asyncio.create_task(_waiter(pool, 3, "big", log, priority=0))
        small = asyncio.create_task(_waiter(pool, 1, "small", log, priority=1))
        await spin()
        pool.free(held[:2])
        await spin()
        assert log == [] and pool.available_size() == 2
        pool.free(held[2:3])
        await spin()
        assert log == ["big"]
        pool.free(held[3:])
        await finish(big, small)
        assert log == ["big", "small"]


async def test_a_new_head_that_fits_is_granted_without_a_free():
    """A request more urgent than every queued one becomes the head; if it
    fits in what is free it is granted at once (the loop's next turn), not
    at the next unrelated free, which on an idle pool may never come. Its
    row, freed dirty with nobody waiting, reads zero lengths when it resumes."""
    async with bounded(), make(5) as pool:
        held = await pool.alloc(4)
        for row in held:
            pool.set_req_pool_info(row, ReqToTokenPoolInfo(3, 3, torch.arange(3)))
        pool.free(held[:2])  # nobody waits: back unreset
        log: list[str] = []
        big = asyncio.create_task(_waiter(pool, 3, "big", log))
        await spin()
        assert log == [] and pool.waiting() == 1 and pool.available_size() == 2
        urgent = asyncio.create_task(_waiter(pool, 1, "urgent", log, priority=-1))
        [row] = await urgent
        assert log == ["urgent"] and row in held[:2]
        assert lens(pool, row) == (0, 0, 0)
        assert pool.waiting() == 1 and not big.done()  # the big one still waits
        pool.free([*held[2:], row])
        await finish(big)
        assert log == ["urgent", "big"]
        pool.check_invariants()


async def test_a_new_head_that_does_not_fit_waits_and_blocks():
    async with bounded(), make(5) as pool:
        held = await pool.alloc(4)
        log: list[str] = []
        small = asyncio.create_task(_waiter(pool, 1, "small", log))
        await spin()
        urgent = asyncio.create_task(_waiter(pool, 2, "urgent", log, priority=-1))
        await spin()
        pool.free(held[:1])  # one row: the urgent head needs two
        await spin()
        assert log == [] and pool.waiting() == 2 and pool.available_size() == 1
        pool.free(held[1:2])
        await finish(urgent)
        pool.free(held[2:])
        await finish(small)
        assert log == ["urgent", "small"]


async def test_more_urgent_small_request_passes_a_less_urgent_big_one():
    async with bounded(), make(5) as pool:
        held = await pool.alloc(4)
        log: list[str] = []
        big = asyncio.create_task(_waiter(pool, 3, "big", log, priority=1))
        small = asyncio.create_task(_waiter(pool, 1, "small", log, priority=0))
        await spin()
        pool.free(held[:1])
        await spin()
        assert log == ["small"]
        pool.free(held[1:])
        await finish(big, small)
        assert log == ["small", "big"]


async def test_one_free_grants_several_waiters_in_order():
    async with bounded(), make(9) as pool:
        held = await pool.alloc(8)
        log: list[str] = []
        tasks = [
            asyncio.create_task(_waiter(pool, n, name, log))
            for name, n in [("a", 2), ("b", 3), ("c", 2), ("d", 4)]
        ]
        await spin()
        pool.free(held)  # 8 rows: a, b, c fit (7), d does not
        assert pool.waiting() == 1
        await spin()
        assert log == ["a", "b", "c"]
        results = await asyncio.gather(*tasks[:3])
        pool.free(results[0] + results[1])
        await finish(tasks[3])
        assert log == ["a", "b", "c", "d"]


# ---------------------------------------------------------------- fences


async def test_waiter_blocked_on_pending_rows_wakes_when_gate_opens(kit):
    async with bounded(), make(3) as pool:
        s = kit.stream()
        gate = kit.gate(s)
        rows = await pool.alloc(2)
        pool.free(rows, after=s)
        assert pool.available_size() == 0 and pool.pending_size() == 2
        t = asyncio.create_task(pool.alloc(2))
        await spin()
        assert pool.waiting() == 1 and not t.done()
        gate.open()  # no other call into the pool from here on
        got = (await finish(t))[0]
        assert sorted(got) == sorted(rows)
        assert pool.pending_size() == 0
        assert_conserved(pool)


async def test_try_alloc_none_while_anyone_waits():
    async with bounded(), make(5) as pool:
        held = await pool.alloc(3)
        t = asyncio.create_task(pool.alloc(2))
        await spin()
        assert pool.available_size() == 1
        before = pool_snapshot(pool)
        assert pool.try_alloc(1) is None  # a row is free, but someone waits
        assert pool_snapshot(pool) == before
        pool.free(held[:1])
        got = (await finish(t))[0]
        assert len(got) == 2
        pool.free(held[1:])
        assert pool.try_alloc(1) == [held[1]]  # nobody waits: served again


async def test_try_alloc_reclaims_completed_fences_before_answering_none(kit):
    async with bounded(), make(3) as pool:
        s = kit.stream()
        gate = kit.gate(s)
        rows = await pool.alloc(2)
        pool.free(rows, after=s)
        assert pool.try_alloc(1) is None
        gate.open()
        s.synchronize()  # complete, but the loop has not run the wake-up yet
        assert pool.try_alloc(2) == rows
        assert pool.stats().reclaimed == 2
        await spin()
        assert_conserved(pool)


async def test_try_alloc_reclaims_a_row_used_on_two_streams(kit):
    """Regression: reclaim() under-counted rows freed by a requeue, so
    try_alloc answered None with the row free."""
    async with bounded(), make(2) as pool:
        a, b = kit.stream(), kit.stream()
        ga, gb = kit.gate(a), kit.gate(b)
        rows = await pool.alloc(1)
        pool.record_use(rows, a.record())
        pool.record_use(rows, b.record())
        pool.free(rows)
        gb.open()
        b.synchronize()
        ga.open()
        a.synchronize()
        assert pool.try_alloc(1) == rows
        await spin()
        assert_conserved(pool)


async def test_waiter_for_row_used_on_two_streams_wakes(kit):
    async with bounded(), make(2) as pool:
        a, b = kit.stream(), kit.stream()
        ga, gb = kit.gate(a), kit.gate(b)
        rows = await pool.alloc(1)
        pool.record_use(rows, a.record())
        pool.record_use(rows, b.record())
        pool.free(rows)
        t = asyncio.create_task(pool.alloc(1))
        await spin()
        ga.open()
        a.synchronize()
        await spin()
        assert not t.done() and pool.pending_size() == 1
        gb.open()
        assert await finish(t) == [rows]
        assert_conserved(pool)


# ---------------------------------------------------------------- vLLM scenarios


async def test_free_with_a_use_in_flight_defers_until_that_steps_fence(kit):
    async with bounded(), make(4) as pool:
        s = kit.stream()
        gate = kit.gate(s)
        rows = await pool.alloc(3)
        step = s.record()
        pool.record_use(rows, step)
        assert pool.free(rows[:1]) == 0
        assert pool.pending_size() == 1
        assert pool.stats().deferred_frees == 1
        assert pool.reclaim() == 0
        gate.open()
        assert step.wait(WAIT_S)
        assert pool.reclaim() == 1
        assert pool.available_size() == 1


async def test_free_of_untouched_row_is_immediate_while_other_steps_run(kit):
    async with bounded(), make(4) as pool:
        s = kit.stream()
        kit.gate(s)
        inflight = await pool.alloc(2)
        done_req = await pool.alloc(1)
        pool.record_use(inflight, s.record())
        # The finished request's row is in no in-flight step: free at once.
        assert pool.free(done_req) == 1
        assert pool.available_size() == 1
        assert pool.pending_size() == 0
        assert await pool.alloc(1) == done_req  # and handed out at once


async def test_row_touched_by_three_inflight_steps_waits_for_the_newest(kit):
    async with bounded(), make(3) as pool:
        s = kit.stream()
        gates, steps = [], []
        for _ in range(3):
            gates.append(kit.gate(s))
            steps.append(s.record())
        row = await pool.alloc(1)
        for f in steps:
            pool.record_use(row, f)
        other = await pool.alloc(1)
        pool.free(row)
        t = asyncio.create_task(pool.alloc(1))
        await spin()
        for i in range(2):
            gates[i].open()
            assert steps[i].wait(WAIT_S)
            await spin()
            assert pool.reclaim() == 0 and not t.done()
        gates[2].open()
        assert await finish(t) == [row]
        pool.free(other)


async def test_explicit_fence_on_free_adds_to_recorded_use_never_weakens(kit):
    async with bounded(), make(5) as pool:
        s, other = kit.stream(), kit.stream()
        old = s.record()
        assert old.wait(WAIT_S)
        gate = kit.gate(s)
        new = s.record()
        rows = await pool.alloc(3)
        pool.record_use(rows[:1], new)
        pool.free(rows[:1], fence=old)  # older fence must not shorten the wait
        pool.record_use(rows[1:2], old)
        pool.free(rows[1:2], fence=new)  # newer explicit fence extends it
        og = kit.gate(other)
        pool.record_use(rows[2:], new)
        pool.free(rows[2:], fence=other.record())  # another stream: waits for both
        assert pool.pending_size() == 3
        gate.open()
        assert new.wait(WAIT_S)
        assert pool.reclaim() == 2
        assert pool.pending_size() == 1
        og.open()
        other.synchronize()
        assert pool.reclaim() == 1
        assert_conserved(pool)


async def test_free_after_stream_records_a_fence(kit):
    async with bounded(), make(4) as pool:
        s = kit.stream()
        gate = kit.gate(s)
        rows = await pool.alloc(2)
        seq = s._seq
        assert pool.free(rows, after=s) == 0
        assert s._seq == seq + 1  # one fence recorded for this free
        [fence] = pool._ledger.pending_fences()
        assert fence.stream_key == s.key and fence.seq == seq + 1
        gate.open()
        async with asyncio.timeout(WAIT_S):
            await pool.drain()
        assert pool.available_size() == 3


async def test_after_with_iterator_frees_every_row(kit):
    async with bounded(), make(4) as pool:
        s = kit.stream()
        rows = await pool.alloc(3)
        pool.free(iter(rows), after=s)
        async with asyncio.timeout(WAIT_S):
            await pool.drain()
        assert pool.allocated_size() == 0 and pool.available_size() == 3


async def test_a_reused_row_reads_zero_after_the_late_write(kit):
    async with bounded(), make(2) as pool:
        s = kit.stream()
        gate = kit.gate(s)
        [row] = await pool.alloc(1)
        pool.set_req_pool_info(
            row, ReqToTokenPoolInfo(2, 3, torch.tensor([4, 5, 6], dtype=torch.int32))
        )
        s.launch(pool.verified_lens.__setitem__, row, 77)  # the in-flight step's write
        pool.record_use([row], s.record())
        pool.free([row])

        async def new_owner():
            rows = await pool.alloc(1)
            return rows, lens(pool, rows[0])  # read the moment it resumes

        t = asyncio.create_task(new_owner())
        await spin()
        assert not t.done()
        gate.open()
        [(rows, seen)] = await finish(t)
        assert rows == [row]
        assert seen == (0, 0, 0)


async def test_a_burst_of_granted_waiters_each_read_zero_on_resume():
    async with bounded(), make(9) as pool:
        held = await pool.alloc(8)
        for r in held:
            pool.set_req_pool_info(
                r, ReqToTokenPoolInfo(1, 2, torch.tensor([r, r], dtype=torch.int32))
            )

        async def new_owner(n):
            rows = await pool.alloc(n)
            return [lens(pool, r) for r in rows]

        tasks = [asyncio.create_task(new_owner(n)) for n in (3, 1, 4)]
        await spin()
        pool.free(held)  # one hand-over grants all three
        assert pool.waiting() == 0
        for seen in await finish(*tasks):
            assert all(x == (0, 0, 0) for x in seen)
        resets = pool.stats().resets
        assert resets <= 2  # the burst cost one bulk reset, not one per waiter


# ---------------------------------------------------------------- leases


async def test_lease_frees_on_normal_exit():
    async with bounded(), make(4) as pool:
        async with pool.lease(2) as rows:
            assert len(rows) == 2 and pool.available_size() == 1
        assert pool.available_size() == 3
        assert_conserved(pool)


async def test_lease_frees_on_exception():
    async with bounded(), make(4) as pool:
        with pytest.raises(KeyError):
            async with pool.lease(3):
                raise KeyError("boom")
        assert pool.available_size() == 3
        assert_conserved(pool)


async def test_lease_frees_on_cancellation():
    async with bounded(), make(4) as pool:
        inside = asyncio.Event()

        async def body() -> None:
            async with pool.lease(3):
                inside.set()
                await asyncio.Event().wait()

        t = asyncio.create_task(body())
        async with asyncio.timeout(WAIT_S):
            await inside.wait()
        assert pool.available_size() == 0
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        assert pool.available_size() == 3
        assert_conserved(pool)


async def test_lease_cancelled_while_waiting_allocates_nothing():
    async with bounded(), make(3) as pool:
        held = await pool.alloc(2)

        async def body() -> None:
            async with pool.lease(1):
                pytest.fail("must not enter")

        t = asyncio.create_task(body())
        await spin()
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        pool.free(held)
        assert pool.available_size() == 2
        assert_conserved(pool)


async def test_lease_after_stream_defers_the_free(kit):
    async with bounded(), make(4) as pool:
        s = kit.stream()
        gate = kit.gate(s)
        async with pool.lease(2, after=s) as rows:
            pass
        assert pool.pending_size() == 2
        assert all(pool._ledger.state_of(r) == "pending" for r in rows)
        gate.open()
        async with asyncio.timeout(WAIT_S):
            await pool.drain()
        assert pool.available_size() == 3


async def test_lease_whose_rows_were_freed_in_the_body_raises_double_free():
    async with bounded(), make(4) as pool:
        with pytest.raises(DoubleFreeError):
            async with pool.lease(2) as rows:
                pool.free(rows)
        assert pool.available_size() == 3
        assert_conserved(pool)


async def test_lease_does_not_free_rows_another_owner_now_holds():
    async with bounded(), make(3) as pool:
        with pytest.raises(DoubleFreeError):
            async with pool.lease(2) as rows:
                pool.free(rows)
                theirs = await pool.alloc(2)  # the same rows, new owner
                assert sorted(theirs) == sorted(rows)
        assert pool.allocated_size() == 2  # still theirs
        pool.free(theirs)
        assert_conserved(pool)


async def test_lease_rows_attribute_and_bad_size():
    async with bounded(), make(3) as pool:
        lease = pool.lease(2)
        async with lease as rows:
            assert lease.rows == rows
        with pytest.raises(CapacityError):
            async with pool.lease(0):
                pass
        assert pool.available_size() == 2


# ---------------------------------------------------------------- lifecycle


async def test_close_fails_waiters_and_later_allocs_but_free_still_works():
    pool = make(3)
    async with bounded():
        held = await pool.alloc(2)
    t1 = asyncio.create_task(pool.alloc(1))
    t2 = asyncio.create_task(pool.alloc(2, priority=3))
    await spin()
    async with bounded():
        await pool.close()
    assert pool.closed and pool.stats().closed
    for t in (t1, t2):
        with pytest.raises(PoolClosedError):
            async with bounded():
                await t
    with pytest.raises(PoolClosedError):
        async with bounded():
            await pool.alloc(1)
    with pytest.raises(PoolClosedError):
        pool.try_alloc(1)
    with pytest.raises(PoolClosedError):
        async with bounded():
            await pool.release_memory()
    assert pool.free(held) == 2
    assert pool.available_size() == 2 and pool.waiting() == 0
    assert "closed" in repr(pool)
    async with bounded():
        await pool.close()  # idempotent
    assert_conserved(pool)


async def test_drain_before_and_after_close(kit):
    pool = make(5)
    s = kit.stream()
    g1 = kit.gate(s)
    async with bounded():
        rows = await pool.alloc(4)
    pool.free(rows[:2], after=s)
    d = asyncio.create_task(pool.drain())
    await spin()
    assert not d.done()
    g1.open()
    async with bounded():
        await finish(d)
    assert pool.pending_size() == 0
    g2 = kit.gate(s)
    pool.free(rows[2:], after=s)
    async with bounded():
        await pool.close()
    d = asyncio.create_task(pool.drain())
    await spin()
    assert not d.done() and pool.pending_size() == 2
    g2.open()
    async with bounded():
        await finish(d)
    assert pool.pending_size() == 0 and pool.available_size() == 4


async def test_drain_cancelled_changes_nothing(kit):
    async with bounded(), make(3) as pool:
        s = kit.stream()
        gate = kit.gate(s)
        pool.free(await pool.alloc(2), after=s)
        before = pool_snapshot(pool)
        d = asyncio.create_task(pool.drain())
        await spin()
        d.cancel()
        with pytest.raises(asyncio.CancelledError):
            await d
        assert pool_snapshot(pool) == before
        gate.open()
        async with asyncio.timeout(WAIT_S):
            await pool.drain()


async def test_async_with_closes_the_pool():
    async with bounded(), AsyncReqToTokenPool(3, 4) as pool:
        assert not pool.closed
        rows = await pool.alloc(2)
    assert pool.closed
    with pytest.raises(PoolClosedError):
        async with bounded():
            await pool.alloc(1)
    pool.free(rows)


async def test_release_resume_with_waiters_queued():
    async with bounded(), make(4) as pool:
        pool.write((1, slice(0, 3)), torch.tensor([1, 2, 3], dtype=torch.int32))
        await pool.release_memory()
        assert pool.released and pool.stats().released
        assert pool.try_alloc(1) is None  # released: nothing, though 3 are free
        t1 = asyncio.create_task(pool.alloc(2))
        t2 = asyncio.create_task(pool.alloc(1))
        await spin()
        assert pool.waiting() == 2 and not t1.done() and not t2.done()
        await pool.release_memory()  # idempotent
        await pool.resume_memory()
        assert not pool.released
        r1, r2 = await finish(t1, t2)
        assert len(r1) == 2 and len(r2) == 1
        assert not pool.req_to_token.any()  # resumed memory is zeroed
        await pool.resume_memory()  # no-op
        pool.free(r1 + r2)
        assert_conserved(pool)


async def test_waiter_queued_before_release_is_held_until_resume(kit):
    async with bounded(), make(3) as pool:
        s = kit.stream()
        gate = kit.gate(s)
        pool.free(await pool.alloc(2), after=s)
        w = asyncio.create_task(pool.alloc(2))
        await spin()
        assert pool.waiting() == 1
        rel = asyncio.create_task(pool.release_memory())
        await spin()
        gate.open()  # the rows come back while the release drains...
        await finish(rel)
        assert pool.released and pool.available_size() == 2
        await spin()
        assert not w.done() and pool.waiting() == 1  # ...but are not granted
        assert pool.try_alloc(1) is None
        await pool.resume_memory()
        assert len((await finish(w))[0]) == 2


async def test_release_waits_for_pending_fences_first(kit):
    async with bounded(), make(4) as pool:
        s = kit.stream()
        gate = kit.gate(s)
        pool.free(await pool.alloc(2), after=s)
        rel = asyncio.create_task(pool.release_memory())
        await spin()
        assert not rel.done()
        assert pool.try_alloc(1) is None  # allocs are held while it drains
        gate.open()
        await finish(rel)
        assert pool.released and pool.pending_size() == 0
        await pool.resume_memory()
        assert pool.try_alloc(3) is not None


async def test_release_refused_while_rows_allocated_and_pool_keeps_serving():
    async with bounded(), make(5) as pool:
        held = await pool.alloc(2)
        t = asyncio.create_task(pool.alloc(3))
        await spin()
        assert pool.waiting() == 1
        with pytest.raises(PoolBusyError):
            await pool.release_memory()
        assert not pool.released and not pool.stats().released
        assert pool.waiting() == 1
        pool.free(held)
        got = (await finish(t))[0]
        assert got == [3, 4, held[0]]  # FIFO: never-used rows first, then freed ones
        assert pool.try_alloc(1) == [held[1]]


async def test_max_waiters_sheds_load():
    async with bounded(), make(3, max_waiters=1) as pool:
        held = await pool.alloc(2)
        t = asyncio.create_task(pool.alloc(1))
        await spin()
        before = pool_snapshot(pool)
        with pytest.raises(PoolBusyError):
            await pool.alloc(1)
        after = pool_snapshot(pool)
        assert after[0]["rejections"] == before[0]["rejections"] + 1
        assert pool.waiting() == 1 and pool.stats().rejections == 1
        pool.free(held[:1])
        assert await finish(t) == [held[:1]]
        pool.free(held[1:])


async def test_max_waiters_zero_refuses_any_wait_but_serves_fast_path():
    async with bounded(), make(3, max_waiters=0) as pool:
        rows = await pool.alloc(2)
        with pytest.raises(PoolBusyError):
            await pool.alloc(1)
        assert pool.waiting() == 0
        pool.free(rows)


@pytest.mark.parametrize("bad", [-1, 1.0, "2", True])
def test_max_waiters_must_be_none_or_non_negative_int(bad):
    with pytest.raises(ValueError):
        make(3, max_waiters=bad)


async def test_wrong_thread_is_refused_and_changes_nothing():
    # In asyncio's debug mode every call is checked, the unchecked fast
    # paths included (tests/test_thread_fast_paths.py covers normal mode).
    asyncio.get_running_loop().set_debug(True)
    async with bounded(), make(5) as pool:
        rows = pool.try_alloc(2)
        before = pool_snapshot(pool)
        errors: dict[str, BaseException | None] = {}
        fs = FakeStream()

        def other() -> None:
            calls = {
                "try_alloc": lambda: pool.try_alloc(1),
                "free": lambda: pool.free(rows),
                "free_one": lambda: pool.free(rows[:1]),
                "record_use": lambda: pool.record_use(rows, fs.record()),
                "reclaim": pool.reclaim,
                "alloc": lambda: asyncio.run(pool.alloc(1)),
                # They read the row's state, and wrote the row's lengths
                # unchecked: a race with the owner's free and re-grant.
                "set_req_pool_info": lambda: pool.set_req_pool_info(
                    rows[0], ReqToTokenPoolInfo(0, 0, torch.zeros(0, dtype=torch.int32))
                ),
                "write": lambda: pool.write((rows[0], 0), 1),
            }
            for name, call in calls.items():
                try:
                    call()
                    errors[name] = None
                except BaseException as exc:
                    errors[name] = exc

        th = threading.Thread(target=other)
        th.start()
        th.join(WAIT_S)
        assert not th.is_alive()
        for name, exc in errors.items():
            assert isinstance(exc, WrongThreadError), (name, exc)
            assert isinstance(exc, RuntimeError)
        assert len(errors) == 8
        assert pool_snapshot(pool) == before
        pool.free(rows)  # the owner thread is still served


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("n", [0, -1, 5, 99, 1.0, 2.5, True, None, "1"])
async def test_bad_sizes_raise_capacity_error_and_change_nothing(n):
    async with bounded(), make(5) as pool:
        held = await pool.alloc(1)
        before = pool_snapshot(pool)
        with pytest.raises(CapacityError):
            async with bounded():  # a lost check must fail, not hang
                await pool.alloc(n)
        with pytest.raises(CapacityError):
            pool.try_alloc(n)
        with pytest.raises(CapacityError):
            async with pool.lease(n):
                pass
        # More rows than the pool has: alloc and lease (not try_alloc) count
        # as calls that can never be served, and change nothing else.
        too_many = n in (5, 99)
        assert unfittable_apart(pool_snapshot(pool)) == (
            (2, {0: 2}) if too_many else (0, {}),
            unfittable_apart(before)[1],
        )
        # Also while others wait: an impossible request is refused, not queued.
        t = asyncio.create_task(pool.alloc(4))
        await spin()
        before = pool_snapshot(pool)
        with pytest.raises(CapacityError):
            async with bounded():  # a lost check must fail, not hang
                await pool.alloc(n)
        assert unfittable_apart(pool_snapshot(pool)) == (
            (3, {0: 3}) if too_many else (0, {}),
            unfittable_apart(before)[1],
        )
        pool.free(held)
        await finish(t)


async def test_bad_wait_arguments_raise_and_queue_nothing():
    async with bounded(), make(3) as pool:
        held = await pool.alloc(2)
        before = pool_snapshot(pool)
        with pytest.raises(TypeError):
            await pool.alloc(2, priority="high")
        with pytest.raises(ValueError):
            await pool.alloc(2, timeout=-1)
        with pytest.raises(ValueError):
            await pool.alloc(2, timeout="soon")
        assert pool_snapshot(pool) == before
        pool.free(held)


async def test_bad_frees_raise_typed_errors_and_change_nothing(kit):
    async with bounded(), make(9) as pool:
        s = kit.stream()
        kit.gate(s)
        a, b, c = await pool.alloc(3)
        pool.free([b])
        pool.free([c], after=s)
        cases = [
            ([0], InvalidSlotError),
            ([-1], InvalidSlotError),
            ([9], InvalidSlotError),
            ([2.0], InvalidSlotError),
            ([True], InvalidSlotError),
            ([8], InvalidSlotError),
            ([a, a], InvalidSlotError),
            ([b], DoubleFreeError),
            ([c], DoubleFreeError),
            ([a, c], DoubleFreeError),
            (0, InvalidSlotError),
            ("a", InvalidSlotError),
        ]
        for rows, exc in cases:
            for kw in ({}, {"after": s}, {"fence": s.record()}):
                before = pool_snapshot(pool)
                with pytest.raises(exc):
                    pool.free(rows, **kw)
                assert pool_snapshot(pool) == before, (rows, kw)
        before = pool_snapshot(pool)
        with pytest.raises(TypeError):
            pool.free([a], fence=object())
        with pytest.raises(TypeError):
            pool.free([a], after=object())
        with pytest.raises(TypeError):
            pool.free([a], after=s, fence="x")
        with pytest.raises(TypeError):
            pool.record_use([a], 42)
        with pytest.raises(InvalidSlotError):
            pool.record_use([a, 0], s.record())
        assert pool_snapshot(pool) == before
        closed = kit.stream()
        closed.close()
        with pytest.raises(RuntimeError, match="closed"):
            pool.free([a], after=closed)  # no fence can be recorded: nothing freed
        assert pool_snapshot(pool) == before
        assert pool.free([a]) == 1


# ---------------------------------------------------------------- stats, repr


async def test_stats_fields(kit):
    async with bounded(), make(5) as pool:
        st0 = pool.stats()
        assert isinstance(st0, PoolStats)
        with pytest.raises(dataclasses.FrozenInstanceError):
            st0.free = 3  # type: ignore[misc]
        assert (st0.capacity, st0.free, st0.allocated, st0.pending, st0.quarantined) == (
            4,
            4,
            0,
            0,
            0,
        )
        assert st0.wait_time == LatencySummary() and st0.fence_latency.count == 0

        held = await pool.alloc(4)
        # A timeout, a cancellation, a granted waiter.
        with pytest.raises(TimeoutError):
            await pool.alloc(1, timeout=0)
        t = asyncio.create_task(pool.alloc(1))
        await spin()
        assert pool.stats().waiters == 1
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        g = asyncio.create_task(pool.alloc(2))
        await spin()
        pool.free(held[:2])
        granted = (await finish(g))[0]
        # A deferred free and its reclaim.
        s = kit.stream()
        gate = kit.gate(s)
        pool.free(held[2:], after=s)
        st = pool.stats()
        assert st.timeouts == 1 and st.cancellations == 1 and st.rejections == 0
        assert st.waiters == 0
        assert st.allocs == 6 and st.frees == 4
        assert st.deferred_frees == 2 and st.pending == 2 and st.reclaimed == 0
        assert st.peak_allocated == 4
        assert st.wait_time.count == 1 and st.wait_time.max_s >= 0
        gate.open()
        async with asyncio.timeout(WAIT_S):
            await pool.drain()
        st = pool.stats()
        assert st.reclaimed == 2 and st.pending == 0
        assert st.fence_latency.count == 1
        assert st.fence_latency.p50_s <= st.fence_latency.p99_s <= st.fence_latency.max_s
        assert st.free + st.allocated + st.pending + st.quarantined == st.capacity
        pool.free(granted)
        assert pool.stats().free == 4


def test_latency_summary_of_samples():
    s = LatencySummary.of([3.0, 1.0, 2.0, 4.0])
    assert s.count == 4 and s.mean_s == 2.5 and s.p50_s == 2.0 and s.max_s == 4.0
    assert LatencySummary.of([]) == LatencySummary()


async def test_repr_shows_state():
    pool = make(5)
    async with bounded():
        rows = await pool.alloc(2)
    r = repr(pool)
    assert "open" in r and "size=5" in r and "free=2" in r and "allocated=2" in r
    assert "waiters=0" in r
    pool.free(rows)
    async with bounded():
        await pool.release_memory()
    assert "released" in repr(pool)
    async with bounded():
        await pool.resume_memory()
        await pool.close()
    assert "closed" in repr(pool)


# ---------------------------------------------------------------- faults


async def test_fault_quarantines_and_waiters_are_served_from_the_rest(kit):
    async with bounded(), make(5) as pool:
        s = kit.stream()
        gate = kit.gate(s)
        s.launch(lambda: 1 / 0)
        bad = await pool.alloc(2)
        pool.free(bad, after=s)
        held = await pool.alloc(2)
        t = asyncio.create_task(pool.alloc(1))
        await spin()
        gate.open()
        with pytest.raises(FenceError):
            s.synchronize()
        pool.free(held[:1])
        [got] = await finish(t)
        assert got == held[:1]
        await spin()
        st = pool.stats()
        assert st.quarantined == 2 and st.fence_errors >= 1 and st.pending == 0
        assert pool.quarantined_size() == 2
        pool.free(held[1:])
        pool.free(got)
        rows = pool.try_alloc(2)
        assert rows is not None and not set(rows) & set(bad)
        assert pool.try_alloc(1) is None  # the quarantined rows never come back
        assert_conserved(pool)


# ---------------------------------------------------------------- fence watcher


async def test_watcher_wakes_waiter_for_a_fence_of_unknown_origin(kit):
    async with bounded(), make(3) as pool:
        rows = await pool.alloc(2)
        ef = kit.event_fence()
        assert not hasattr(ef, "stream_key")
        pool.free(rows, fence=ef)
        assert pool.pending_size() == 2
        t = asyncio.create_task(pool.alloc(2))
        await spin()
        watcher = pool._wakeups.watcher
        assert watcher is not None and watcher.running
        assert pool.waiting() == 1
        ef.set()  # no other call into the pool
        got = (await finish(t))[0]
        assert sorted(got) == sorted(rows)
        pool.free(got)
    # close() joins the stopped watcher for 50 ms only; a loaded machine may
    # take longer to run the thread out.
    assert watcher.join(WAIT_S)
    assert pool._wakeups.watcher is None


async def test_watcher_record_use_with_unknown_fence(kit):
    async with bounded(), make(3) as pool:
        rows = await pool.alloc(2)
        ef = kit.event_fence()
        pool.record_use(rows, ef)
        assert pool.free(rows) == 0
        d = asyncio.create_task(pool.drain())
        await spin()
        assert not d.done()
        ef.set()
        await finish(d)
        assert pool.available_size() == 2


async def test_close_stops_an_idle_watcher_thread(kit):
    pool = make(3)
    ef = kit.event_fence()
    ef.set()
    async with bounded():
        rows = await pool.alloc(1)
    pool.record_use(rows, ef)
    async with bounded():
        other = await pool.alloc(1)
    ef2 = kit.event_fence()
    pool.free(other, fence=ef2)
    watcher = pool._wakeups.watcher
    assert watcher is not None and watcher.running
    thread = watcher._thread
    ef2.set()
    async with asyncio.timeout(WAIT_S):
        await pool.drain()
    async with bounded():
        await pool.close()
    thread.join(WAIT_S)  # close() waits 50 ms at most; the thread ends anyway
    assert not thread.is_alive()
    pool.free(rows)


async def test_no_watcher_thread_is_started_after_close(kit):
    """Regression: a free behind an unknown fence after close() started a
    watcher thread that nothing ever stopped."""
    pool = make(3)
    async with bounded():
        rows = await pool.alloc(2)
        await pool.close()
    before = {t.ident for t in threading.enumerate()}
    ef = kit.event_fence()
    pool.free(rows, fence=ef)
    assert pool.pending_size() == 2
    assert pool._wakeups.watcher is None
    # A subset: a watcher of an earlier test may end meanwhile (1 s idle).
    assert {t.ident for t in threading.enumerate()} <= before
    d = asyncio.create_task(pool.drain())  # drain still waits for it
    await spin()
    assert not d.done()
    ef.set()
    async with asyncio.timeout(WAIT_S):
        await d
    assert pool.available_size() == 2


@pytest.mark.cuda
async def test_cuda_fence_wakes_a_waiter_through_the_watcher():
    from asyncpool import record_fence

    stream = torch.cuda.Stream()
    async with bounded(), AsyncReqToTokenPool(3, 8, device="cuda", stream=stream) as pool:
        rows = await pool.alloc(2)
        with torch.cuda.stream(stream):
            gpu_busy(300)  # an in-flight step
            pool.verified_lens[rows[0] : rows[0] + 1].fill_(9)  # its late write (a kernel)
        pool.record_use(rows, record_fence(stream))
        assert pool.free(rows) == 0
        t = asyncio.create_task(pool.alloc(2))
        await spin()
        assert not t.done() and pool._wakeups.watcher is not None
        got = (await finish(t))[0]  # no other call into the pool
        assert sorted(got) == sorted(rows)
        stream.synchronize()
        assert int(pool.verified_lens[rows[0]]) == 0
        pool.free(got)
