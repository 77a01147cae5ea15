"""A pipeline-parallel engine's view of the pool (a porter's trial).

Each stage runs on its own stream and a request's rows are recorded with
every stage's fence of its micro-batch (``record_use(rows, [s0, s1, s2])``),
so what an operator reads when a stage sticks must say which stage:

* a :class:`HostFence` names its stream (the name its ``HostStream`` was
  given) in ``repr()``, so the overdue WARNING, the ``overdue_fences()``
  list and a faulted stream's ``FenceError`` name the stuck stage, not
  only its opaque key;
* a batch freed behind several fences of a dead pipeline is listed under
  one fence at a time: ``force_release(pool.overdue_fences())`` releases
  what waits for the listed fences, and the batch's next fence is listed at
  once, so a dead pipe is released by repeating it until nothing is overdue
  (docs/api.md, *stuck fences*).
"""

from __future__ import annotations

import asyncio

import pytest
from helpers import Streams, bounded, overdue_warnings, warnings_seen

from asyncpool import AsyncReqToTokenPool, FenceError, HostStream, KVPagePool, wait_fence


def test_a_host_fence_names_the_stream_it_was_recorded_on(kit: Streams) -> None:
    stage = kit.stream("stage2")
    kit.gate(stage)
    fence = stage.record()
    assert fence.stream_name == "stage2"
    assert repr(fence) == f"<HostFence stream={stage.key} ('stage2') seq=1 pending>"
    # an idle stream's fence is settled at once: named the same
    idle = kit.stream("stage0")
    assert repr(idle.record()) == f"<HostFence stream={idle.key} ('stage0') seq=1 done>"
    # a stream given no name: its fences read as before, by key alone
    anon = kit.stream()
    assert repr(anon.record()) == f"<HostFence stream={anon.key} seq=1 done>"


async def test_a_faulted_stage_is_named_in_its_fence_error() -> None:
    stage = HostStream("stage1")

    def boom() -> None:
        raise RuntimeError("kernel failed")

    stage.launch(boom)
    fence = stage.record()
    try:
        with pytest.raises(FenceError, match=r"HostStream \d+ \('stage1'\) faulted before fence 1"):
            async with bounded():
                await wait_fence(fence)
    finally:
        stage.close()


async def test_the_overdue_line_names_the_stuck_stage(kit: Streams) -> None:
    stages = [kit.stream(f"stage{s}") for s in range(3)]
    kit.gate(stages[2])  # the last stage sticks; the others run
    pool = AsyncReqToTokenPool(8, 16, kv=KVPagePool(16, 4), fence_timeout=0.01)
    g = await pool.admit(pages=2)
    fences = [s.record() for s in stages]
    pool.record_use([g.row], fences)
    pool.free([g.row])
    with warnings_seen("is overdue") as seen:
        async with bounded():
            await seen.event.wait()
    assert "('stage2')" in seen.messages[0]
    assert pool.overdue_fences() == [fences[2]]
    assert "('stage2')" in repr(pool.overdue_fences())
    pool.force_release(fences[2])
    await pool.close()


async def test_a_dead_pipeline_is_released_one_listed_fence_at_a_time(kit: Streams) -> None:
    stages = [kit.stream(f"stage{s}") for s in range(3)]
    for s in stages:
        kit.gate(s)  # the whole pipe is dead
    pool = AsyncReqToTokenPool(8, 16, kv=KVPagePool(16, 4), fence_timeout=0.01)
    grants = [await pool.admit(pages=2) for _ in range(2)]
    rows = [g.row for g in grants]
    fences = [s.record() for s in stages]
    pool.record_use(rows, fences)
    pool.free(rows)
    with overdue_warnings() as seen:
        async with bounded():
            await seen.wait()
    assert pool.overdue_fences() == [fences[0]]  # the one the batch waits for now
    assert pool.force_release(pool.overdue_fences()) == (0, 0)  # the batch waits on
    assert pool.overdue_fences() == [fences[1]]  # listed at once: it keeps its free's time
    released = [(0, 0)]
    async with bounded():
        while overdue := pool.overdue_fences():  # the documented loop
            released.append(pool.force_release(overdue))
            await asyncio.sleep(0)
    assert released == [(0, 0), (0, 0), (2, 4)]
    stats = pool.stats()
    assert (stats.pending, stats.pages_pending, stats.free) == (0, 0, 7)
    await pool.close()
