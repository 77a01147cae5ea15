"""``await wait_fence(fence)`` on a fence that has completed lets the loop run once.

Found by a trial that ported an SGLang-shaped overlap scheduler: its only
await per step was ``wait_fence`` for the step before, which the stream had
finished by the time the scheduler's CPU work was done, and a completed
fence returned without suspending. No other task ran: an admission the pool
granted at hand-over (``pool.waiting()`` read 0) never resumed, step after
step, although the README and docs/cuda.md say the overlap loop's wait for
the previous step's outputs is the await that lets the loop run.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
from helpers import EventFence, Streams, bounded

from asyncpool import AsyncReqToTokenPool, KVPagePool, wait_fence


def _done(kit: Streams, kind: str) -> Any:
    if kind == "host":
        stream = kit.stream()
        fence = stream.record()
        stream.synchronize()
        return fence
    if kind == "unknown origin":
        fence = EventFence()
        fence.set()
        return fence
    if kind == "sequence":
        return [_done(kit, "host"), _done(kit, "unknown origin")]
    return []  # an empty sequence


@pytest.mark.parametrize("kind", ["host", "unknown origin", "sequence", "empty sequence"])
async def test_a_completed_fence_lets_a_ready_task_run(kit: Streams, kind: str) -> None:
    fence = _done(kit, kind)
    ran = asyncio.Event()
    asyncio.get_running_loop().call_soon(ran.set)  # ready before the wait
    async with bounded():
        await wait_fence(fence)
    assert ran.is_set()  # the loop ran it during the wait


async def test_an_overlap_loop_that_awaits_only_the_step_before_serves_its_waiters(
    kit: Streams,
) -> None:
    stream = kit.stream()
    async with AsyncReqToTokenPool(3, 8, kv=KVPagePool(5, 2)) as pool:
        a = await pool.admit(pages=2)
        b = await pool.admit(pages=2)
        waiter = asyncio.get_running_loop().create_task(pool.admit(pages=2))
        try:
            resumed_at = await _overlap_loop(stream, pool, a.row, b.row, waiter)
        finally:
            if not waiter.done():  # the old code: granted, never resumed
                waiter.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    async with bounded():
                        await waiter
        assert resumed_at == 3  # the next step's wait let it resume
        pool.free([a.row, waiter.result().row])


async def _overlap_loop(
    stream: Any, pool: AsyncReqToTokenPool, a: int, b: int, waiter: asyncio.Task[Any]
) -> int | None:
    """20 steps of an overlap loop whose only await is the step before."""
    prev = None
    resumed_at = None
    for step in range(20):
        stream.launch(lambda: None)
        fence = stream.record()
        pool.record_use([a], fence)
        stream.synchronize()  # the device finished the step before the CPU work did
        if prev is not None:
            async with bounded():
                await wait_fence(prev)  # the loop's only await
        if step == 2:
            pool.free([b])  # b finished: granted to the waiter at hand-over
            assert pool.waiting() == 0
        if waiter.done() and resumed_at is None:
            resumed_at = step
        prev = fence
    return resumed_at
