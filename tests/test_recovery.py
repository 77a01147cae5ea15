"""A scheduler task that dies mid-step, and the one that takes over the pool.

docs/api.md's *Recovering from a scheduler crash*: the new scheduler ends the
grant holds the dead one took (``release_grant_holds``: a hold whose handle
died with its task was held for good, and every queued admission starved),
then frees the dead scheduler's rows behind the forward stream (a row it
launched a step on but never recorded is covered by ``after=``): every
allocated row where it was the pool's only client, else the rows of the
engine's record of its requests. It serves on with no row or KV slot
written by another request. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import gc
import random
from collections.abc import Iterable

import pytest
import torch
from helpers import EventFence, bounded, in_thread, spin

from asyncpool import (
    AsyncReqToTokenPool,
    HostStream,
    InvalidSlotError,
    KVPagePool,
    WrongThreadError,
    record_fence,
    wait_fence,
)


class Crash(Exception):
    """The scheduler's own bug, raised mid-step."""


def paged(rows: int = 4, pages: int = 8) -> AsyncReqToTokenPool:
    return AsyncReqToTokenPool(rows + 1, 64, kv=KVPagePool(pages + 1, 4))


def free_all(pool: AsyncReqToTokenPool, rows: Iterable[int], forward: HostStream) -> int:
    """Free each of ``rows`` behind the forward stream; skip those that are
    not allocated (free, pending, quarantined). docs/api.md's recovery."""
    freed = 0
    for row in rows:
        try:
            pool.free(row, after=forward)
        except InvalidSlotError:
            continue
        freed += 1
    return freed


async def test_a_scheduler_that_died_holding_the_grant_loop_no_longer_starves_the_queue(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def scheduler(pool: AsyncReqToTokenPool) -> None:
        hold = pool.hold_grants()  # growth first: about to retract
        assert hold.held
        raise Crash("between hold_grants and release")

    async with bounded(), paged(rows=2, pages=4) as pool:
        a = await pool.admit(pages=2)
        b = await pool.admit(pages=2)
        waiter = asyncio.ensure_future(pool.admit(pages=2))
        waiter.add_done_callback(lambda t: t.cancelled() or t.exception())
        await spin()
        with pytest.raises(Crash):
            await scheduler(pool)
        gc.collect()  # the dead task's hold is gone; its count is not
        pool.free(a.row)
        await spin()
        assert not waiter.done() and pool.grants_held  # starved, as before
        with caplog.at_level("WARNING", logger="asyncpool.lifecycle"):
            assert pool.release_grant_holds() == 1
        assert "1 lost" in caplog.text
        assert not pool.grants_held and pool.grant_holds == pool.stats().grant_holds == 0
        g = await waiter  # granted by the release
        assert g.pages.numel() == 2
        pool.check_invariants()
        pool.free([b.row, g.row])
        assert pool.release_grant_holds() == 0  # none held: nothing done


async def test_release_grant_holds_ends_the_live_holds_too() -> None:
    async with bounded(), paged() as pool:
        rows = await pool.alloc(4)
        first, second = pool.hold_grants(), pool.hold_grants()
        waiter = asyncio.ensure_future(pool.alloc(1))
        waiter.add_done_callback(lambda t: t.cancelled() or t.exception())
        await spin()
        pool.free(rows[0])
        await spin()
        assert not waiter.done()
        assert pool.release_grant_holds() == 2
        assert not first.held and not second.held
        granted = await waiter  # the grant loop ran
        first.release()  # idempotent: the count stays at 0, not -1
        second.release()
        assert pool.grant_holds == 0
        pool.check_invariants()
        pool.free(granted)
        with pool.hold_grants():  # holds work as before afterwards
            assert pool.grants_held and pool.try_alloc(1) is None
        assert not pool.grants_held and pool.try_alloc(1) is not None


async def test_release_grant_holds_from_another_thread_changes_nothing() -> None:
    async with bounded(), paged() as pool:
        hold = pool.hold_grants()
        try:
            with pytest.raises(WrongThreadError):
                in_thread(lambda: pool.release_grant_holds())
            assert hold.held and pool.grant_holds == 1
        finally:
            hold.release()


async def test_release_grant_holds_keeps_a_closed_or_released_pool_gated() -> None:
    async with bounded():
        pool = paged()
        pool.hold_grants()
        await pool.close()
        assert pool.release_grant_holds() == 1
        assert pool.grant_holds == 0 and pool.closed
        pool.check_invariants()


async def test_release_grant_holds_while_release_memory_drains_keeps_the_waiters_queued() -> None:
    """A scheduler that died while it unloaded the pool (a hold, the frees,
    ``release_memory`` draining behind a transfer): the one taking over ends
    the holds mid-drain. The release still gates the queue (the waiter keeps
    its place until ``resume_memory``), the dead hold's late ``release()``
    does not end a hold taken after, and every count stays whole."""
    async with bounded(), paged() as pool:
        rows = await pool.alloc(4)
        dead = pool.hold_grants()
        waiter = asyncio.ensure_future(pool.alloc(1))
        waiter.add_done_callback(lambda t: t.cancelled() or t.exception())
        await spin()
        transfer = EventFence()
        pool.free(rows, fence=transfer)
        releasing = asyncio.ensure_future(pool.release_memory())
        await spin()
        assert not releasing.done() and pool.grants_held
        assert pool.release_grant_holds() == 1
        pool.check_invariants()
        late = pool.hold_grants()
        dead.release()  # ended already: the late hold stays held
        assert late.held and pool.grant_holds == 1
        late.release()
        await spin()
        assert not waiter.done() and pool.grant_holds == 0
        pool.check_invariants()
        transfer.set()
        await releasing
        await spin()
        assert pool.released and not waiter.done()
        await pool.resume_memory()
        pool.free(await waiter)
        pool.check_invariants()


@pytest.mark.parametrize(("mode", "seed"), [("scan", 0), ("scan", 1), ("record", 0), ("record", 1)])
async def test_crashes_at_random_points_of_the_step_recovered_on_the_same_pool(
    mode: str, seed: int
) -> None:
    """An overlap loop (admit with pages, extend, forward on a HostStream,
    record_use, free) raising at random points: between admit and the
    launch, between the launch and record_use, after record_use, after a
    free, and while it holds the grant loop. Each time the recovery frees
    what the dead scheduler held and a new scheduler goes on; every step
    checks every KV slot and req_to_token entry of the batch it read.

    ``scan``: the scheduler is the pool's only client, and the recovery
    frees every allocated row. ``record``: admissions awaited in another
    task hold rows too (granted at hand-over, often while the scheduler is
    dead), and the recovery frees the rows of the engine's record of the
    scheduler's requests, which outlives its task (a scan would free the
    other task's rows)."""
    rng = random.Random(seed)
    page, max_len, steps = 4, 32, 1000
    kv = KVPagePool(21, page)
    pool = AsyncReqToTokenPool(9, max_len, kv=kv)
    kv_data = torch.zeros(21 * page, dtype=torch.int64)
    forward = HostStream("fwd")
    table = pool.req_to_token
    state = {"step": 0, "next": 1, "crashes": 0, "checked": 0, "holds": 0, "lost_holds": 0}
    running: dict[int, list[int]] = {}  # the engine's record: row -> [request, tokens]

    def crash_point(p: float = 0.03) -> None:
        if rng.random() < p:
            state["crashes"] += 1
            raise Crash

    async def scheduler() -> None:
        prev = None
        while state["step"] < steps:
            state["step"] += 1
            while len(running) < 6 and rng.random() < 0.5:
                g = pool.try_admit(pages=rng.randint(1, 2))
                if g is None:
                    break
                running[g.row] = [state["next"], 0]  # recorded before any await
                state["next"] += 1
                crash_point()
            for row in list(running):
                grows = running[row][1] + 1 > pool.pages_of(row).numel() * page
                if grows and pool.extend(row, 1) is None:
                    hold = pool.hold_grants()
                    state["holds"] += 1
                    crash_point(1.0 if state["holds"] == 1 else 0.5)  # dies holding it
                    hold.release()
                    del running[row]
                    pool.free(row)  # retracted
            if not state["holds"] and state["step"] >= 20:
                # No extend came up short yet (the pressure depends on how fast
                # the host reclaims): die holding the grant loop once anyway,
                # the handle lost with this frame, as above.
                hold = pool.hold_grants()
                state["holds"] += 1
                crash_point(1.0)
            batch = [(row, req, n, pool.pages_of(row).clone()) for row, (req, n) in running.items()]

            def step(batch: list[tuple[int, int, int, torch.Tensor]] = batch) -> None:
                for row, req, n, pages in batch:
                    slot = int(pages[n // page]) * page + n % page
                    kv_data[slot] = req * 1000 + n
                    table[row, n] = slot

            forward.launch(step)
            crash_point()  # launched, never recorded: after= covers it
            fence = record_fence(forward)
            pool.record_use(list(running), fence)
            crash_point()
            if prev is not None:
                await wait_fence(prev[0])
                for row, req, n, _ in prev[1]:
                    if running.get(row, [0])[0] != req:
                        continue  # finished or retracted since
                    for pos in range(n + 1):
                        slot = int(table[row, pos])
                        assert int(kv_data[slot]) == req * 1000 + pos, (row, req, pos)
                        state["checked"] += 1
            prev = (fence, batch)
            for row in list(running):
                running[row][1] += 1
                if running[row][1] >= max_len - 1 or rng.random() < 0.1:
                    del running[row]
                    pool.free(row)
                    crash_point()
            await asyncio.sleep(0)
        free_all(pool, list(running), forward)
        running.clear()

    others = {"granted": 0}

    async def admissions() -> None:
        """The other client of ``record``: admissions awaited in a task of
        its own, through asyncio.wait_for (one more loop turn to resume)."""
        while state["step"] < steps:
            g = await asyncio.wait_for(pool.admit(pages=1), 30)
            await asyncio.sleep(0)
            pool.free(g.row)
            others["granted"] += 1

    other = asyncio.ensure_future(admissions()) if mode == "record" else None
    try:
        async with bounded(60):
            while state["step"] < steps:
                try:
                    await scheduler()
                except Crash:
                    state["lost_holds"] += pool.grant_holds
                    pool.release_grant_holds()
                    if mode == "scan":
                        allocated = pool.stats().allocated
                        assert free_all(pool, range(1, pool.capacity + 1), forward) == allocated
                        assert pool.stats().allocated == 0
                    else:
                        free_all(pool, list(running), forward)
                    running.clear()
            if other is not None:
                await other
            await pool.drain()
        pool.check_invariants()
        stats = pool.stats()
        assert stats.allocated == stats.pages_allocated == stats.quarantined == 0
        assert stats.free == pool.capacity and stats.pages_free == kv.capacity
        assert state["crashes"] > 0 and state["checked"] > 0 and state["lost_holds"] > 0
        assert mode == "scan" or others["granted"] > 0
    finally:
        if other is not None:
            other.cancel()
        forward.close()
        await pool.close()
