"""*memory saver* (docs/api.md): releasing the memory with requests queued when
an admission was granted just before the hold, its task not yet resumed.

Found by a trial that drove the recipe through an RL-rollout engine (a weight
update every few steps, requests queueing, aborts and timeouts; trialRelease):
the recipe as once written (take ``hold_grants()``, free the running requests'
rows, ``release_memory()``) raised ``PoolBusyError`` 93 times in 5,000
releases (asyncio) and 116 in 5,000 (uvloop). A free earlier in the pass (a
request that finished, or a fence that completed) grants the queued head at
once (grant at hand-over); its task has not resumed, so the engine does not
know the row yet and cannot free it, and the hold, taken after the grant, does
not take it back. Yielding once after the hold (``await asyncio.sleep(0)``)
lets that task return its grant; freed with the others, the release succeeds
(0 in 5,000 on each loop). An ``admit`` run in a task of its own (3.11's
``asyncio.wait_for``) needs more passes, so the recipe frees and yields until
``allocated_size()`` reads 0; the hold grants nothing meanwhile, so the loop
ends. The pool behaves as documented; these tests pin the orders. Every
await that could hang is bounded.
"""

from __future__ import annotations

import asyncio

import pytest
from helpers import bounded, spin

from asyncpool import AsyncReqToTokenPool, KVPagePool, PoolBusyError


async def engine_with_a_grant_in_flight() -> tuple[
    AsyncReqToTokenPool, list[int], list[asyncio.Task[None]]
]:
    """Two running requests (4 pages each of the pool's 8), two admissions
    queued, and one of them granted by a free earlier in the pass (a request
    that finished before its row ran: nothing to wait for), its task not
    yet resumed."""
    pool = AsyncReqToTokenPool(3, 64, kv=KVPagePool(9, 4))
    running: list[int] = []

    async def request() -> None:  # a request's task: admitted, then it runs
        grant = await pool.admit(pages=4)
        running.append(grant.row)

    async with bounded():
        first = await pool.admit(pages=4)
        second = await pool.admit(pages=4)
    running += [first.row, second.row]
    queued = [asyncio.ensure_future(request()) for _ in range(2)]
    await spin()
    assert pool.waiting() == 2
    running.remove(first.row)
    pool.free(first.row)  # granted to the queued head at once
    assert pool.waiting() == 1 and pool.stats().allocated == 2
    assert not queued[0].done()
    return pool, running, queued


async def test_the_recipe_as_once_written_is_refused() -> None:
    pool, running, queued = await engine_with_a_grant_in_flight()
    hold = pool.hold_grants()  # before freeing the running rows, as written
    for row in running:
        pool.free(row)
    running.clear()
    with pytest.raises(PoolBusyError, match="1 row is still allocated"):
        async with bounded():
            await pool.release_memory()
    assert not pool.released and pool.stats().allocated == 1
    # the granted request's task resumes with its row; nothing was lost
    async with bounded():
        await queued[0]
    assert len(running) == 1 and pool.waiting() == 1
    pool.free(running.pop())
    hold.release()
    async with bounded():
        await queued[1]
    pool.free(running.pop())
    pool.check_invariants()
    await pool.close()


async def test_a_yield_after_the_hold_lets_the_granted_request_be_freed_too() -> None:
    pool, running, queued = await engine_with_a_grant_in_flight()
    hold = pool.hold_grants()
    await asyncio.sleep(0)  # the grant made before the hold reaches its task
    assert queued[0].done() and len(running) == 2
    for row in running:
        pool.free(row)
    running.clear()
    async with bounded():
        await pool.release_memory()
    hold.release()
    await spin()
    # released: the other queued admission keeps its place
    assert pool.released and not queued[1].done() and pool.waiting() == 1
    await pool.resume_memory()
    async with bounded():
        await queued[1]
    assert len(running) == 1 and pool.stats().allocated == 1
    pool.free(running.pop())
    pool.check_invariants()
    await pool.close()


async def engine_with_a_nested_grant_in_flight(
    depth: int,
) -> tuple[AsyncReqToTokenPool, list[int], asyncio.Task[None]]:
    """One running request, one admission queued whose ``admit`` runs
    ``depth`` tasks deep (3.11's ``asyncio.wait_for`` makes one such task),
    granted by a free earlier in the pass, its tasks not yet resumed."""
    pool = AsyncReqToTokenPool(2, 64, kv=KVPagePool(9, 4))
    running: list[int] = []

    async def nested(d: int) -> int:
        if d == 0:
            return (await pool.admit(pages=4)).row
        return await asyncio.ensure_future(nested(d - 1))

    async def request() -> None:
        running.append(await nested(depth))

    async with bounded():
        first = await pool.admit(pages=8)
    queued = asyncio.ensure_future(request())
    await spin(depth + 3)
    assert pool.waiting() == 1
    pool.free(first.row)  # granted to the queued admission at once
    assert pool.waiting() == 0 and pool.stats().allocated == 1
    return pool, running, queued


async def release_as_the_recipe_says(pool: AsyncReqToTokenPool, running: list[int]) -> int:
    """docs/api.md's loop: free what the engine holds, yield until nothing
    is allocated; returns the yields it took."""
    yields = 0
    async with bounded():
        while True:
            for row in running:
                pool.free(row)
            running.clear()
            if not pool.allocated_size():
                break
            await asyncio.sleep(0)
            yields += 1
        await pool.release_memory()
    return yields


@pytest.mark.parametrize("depth", [0, 1, 3])
async def test_the_recipes_loop_frees_a_grant_however_deep_its_admit_runs(depth: int) -> None:
    pool, running, queued = await engine_with_a_nested_grant_in_flight(depth)
    hold = pool.hold_grants()
    yields = await release_as_the_recipe_says(pool, running)
    assert pool.released and queued.done()
    assert yields >= 1 + (depth > 0)  # one yield is not enough once admit runs in a task
    hold.release()
    await pool.resume_memory()
    pool.check_invariants()
    await pool.close()


async def test_one_yield_is_not_enough_for_an_admit_in_a_task_of_its_own() -> None:
    pool, running, queued = await engine_with_a_nested_grant_in_flight(1)
    hold = pool.hold_grants()
    await asyncio.sleep(0)
    for row in running:
        pool.free(row)
    running.clear()
    with pytest.raises(PoolBusyError, match="1 row is still allocated"):
        async with bounded():
            await pool.release_memory()
    async with bounded():
        await queued
    pool.free(running.pop())
    hold.release()
    pool.check_invariants()
    await pool.close()
