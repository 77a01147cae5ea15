"""Admission tasks on explicit pools: at least one loop turn at a fixed point
(docs/tp.md: "Put a fixed number (at least one) of ``await asyncio.sleep(0)``").

A TP rank that admits with ``await pool.admit(...)`` tasks collects their
grants at a fixed point of its loop (``task.done()``). Between steps it awaits
something whose loop turns differ per rank (``await wait_fence(prev)`` passes
once on a rank whose step is done, more on another). With no ``sleep(0)``
after creating the tasks, their first step (the ``admit`` call) falls inside
those turns: an urgent admit is granted at the loop's next turn on the rank
that turns more, at ``retire`` on the other, and the ranks see the grant at
different steps (trialTP's 2-rank run on uvloop ended in ``AgreementError``
that way). With one, every rank sees the same grants at the same step.

Each "rank" here is one run of the same scheduler loop on its own pool, the
only difference being the turns its "wait_fence" passes (1 or 3); the runs
are sequential on the test's loop, so their turns never interleave.
"""

from __future__ import annotations

import asyncio

import pytest
from helpers import bounded, spin

from asyncpool import AsyncReqToTokenPool, Grant, HostStream, KVPagePool


async def _rank(sleeps: int, wait_turns: int) -> list[tuple[int, str, int]]:
    """One rank's loop over four steps; returns (step, request, row) as the
    scheduler collects each admission."""
    stream = HostStream("forward")
    kv = KVPagePool(9, 4, reclaim="explicit")  # page 0 is padding: 8 to hand out
    pool = AsyncReqToTokenPool(4, 8, kv=kv, reclaim="explicit")
    loop = asyncio.get_running_loop()
    tasks: dict[str, asyncio.Task[Grant]] = {}
    seen: list[tuple[int, str, int]] = []
    try:
        first, second = pool.try_admit(pages=4), pool.try_admit(pages=4)
        assert first is not None and second is not None  # every page taken
        tasks["queued"] = loop.create_task(pool.admit(4))
        await spin(1)
        assert pool.waiting() == 1
        # Step 0's request finishes: its row and pages wait behind step 0.
        step0 = stream.record()
        pool.record_use([first.row], step0)
        pool.free([first.row])
        async with bounded():
            for step in range(1, 5):
                if step == 1:
                    # More urgent than the queued one, fits what is free (a row).
                    tasks["urgent"] = loop.create_task(pool.admit(0, priority=-1))
                await spin(sleeps)  # the fixed turns after creating admission tasks
                for name, task in list(tasks.items()):
                    if task.done():  # the fixed point where grants join the batch
                        seen.append((step, name, int(task.result().row)))
                        del tasks[name]
                await spin(wait_turns)  # await wait_fence(prev): turns differ per rank
                if step == 1:
                    pool.retire(step0)
        assert not tasks
        pool.check_invariants()
    finally:
        stream.close()
        await pool.close()
    return seen


async def test_one_turn_after_creating_admission_tasks_gives_every_rank_the_same_grants() -> None:
    fast, slow = await _rank(1, 1), await _rank(1, 3)
    assert fast == slow
    assert [(step, name) for step, name, _ in fast] == [(2, "queued"), (2, "urgent")]


@pytest.mark.parametrize("wait_turns", [1, 3])
async def test_without_that_turn_the_ranks_see_the_grants_at_different_steps(
    wait_turns: int,
) -> None:
    """The control: the same loop with no ``sleep(0)`` after creating the
    tasks; the pools make the same grants (rows), the schedulers see them at
    steps that depend on the turns."""
    seen = await _rank(0, wait_turns)
    rows = sorted((name, row) for _, name, row in seen)
    assert rows == sorted((name, row) for _, name, row in await _rank(1, 1))
    steps = {name: step for step, name, _ in seen}
    if wait_turns == 1:
        assert steps == {"queued": 3, "urgent": 3}  # granted at retire, seen a step late
    else:
        assert steps == {"queued": 3, "urgent": 2}  # granted at the loop's next turn
