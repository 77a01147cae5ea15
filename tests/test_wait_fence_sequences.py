"""``await wait_fence([a, b])``: the scheduler's own wait for several fences.

``fence=`` on the pools takes a sequence of fences (a step's fence and a
transfer that reads the same memory); ``wait_fence`` takes the same
argument, so a scheduler that must see both before it reuses a buffer of
its own waits once. Every wait is bounded (``bounded()``).
"""

from __future__ import annotations

import asyncio

import pytest
from helpers import EventFence, Streams, bounded

from asyncpool import wait_fence
from asyncpool.fence_wait import _pending_waits


async def test_the_wait_ends_only_when_every_fence_has_completed(kit: Streams) -> None:
    stream = kit.stream()
    gate = kit.gate(stream)
    step, transfer = stream.record(), EventFence()
    waiter = asyncio.create_task(wait_fence([step, transfer]))
    transfer.set()  # the transfer lands first: the step still runs
    for _ in range(20):
        await asyncio.sleep(0)
    assert not waiter.done()
    gate.open()
    async with bounded():
        await waiter
    assert step.query() and transfer.query()
    assert _pending_waits(asyncio.get_running_loop()) == 0


async def test_either_order_of_completion_ends_the_wait(kit: Streams) -> None:
    stream = kit.stream()
    gate = kit.gate(stream)
    step, transfer = stream.record(), EventFence()
    waiter = asyncio.create_task(wait_fence((transfer, step)))
    gate.open()  # the step first, now
    for _ in range(20):
        await asyncio.sleep(0)
    assert not waiter.done()
    transfer.set()
    async with bounded():
        await waiter


async def test_an_empty_sequence_and_completed_fences_return_at_once() -> None:
    done = EventFence()
    done.set()
    async with bounded():
        await wait_fence([])
        await wait_fence(())
        await wait_fence([done, done])
    assert _pending_waits(asyncio.get_running_loop()) == 0


async def test_the_first_fault_in_order_is_raised() -> None:
    failed, later = EventFence(), EventFence()
    failed.error = ConnectionResetError("peer gone")
    failed.set()
    with pytest.raises(ConnectionResetError, match="peer gone"):
        async with bounded():
            await wait_fence([failed, later])
    assert later.queries == 0  # the fences after the fault are not asked
    assert _pending_waits(asyncio.get_running_loop()) == 0


@pytest.mark.parametrize(
    "bad, match",
    [
        ([EventFence(), 3], r"fence=\[1\] must be a fence"),
        ({EventFence()}, "needs a fence"),
        (iter([EventFence()]), "needs a fence"),
        ("fence", "needs a fence"),
    ],
    ids=["an element", "a set", "an iterator", "text"],
)
async def test_a_bad_sequence_is_refused_before_anything_is_waited_for(
    bad: object, match: str
) -> None:
    with pytest.raises(TypeError, match=match):
        async with bounded():
            await wait_fence(bad)  # type: ignore[arg-type]
    assert _pending_waits(asyncio.get_running_loop()) == 0


async def test_an_open_fence_before_a_bad_element_is_not_waited_for() -> None:
    # Checked first: an open fence ahead of the bad element would otherwise
    # hold the call (until the bound) before the TypeError.
    open_fence = EventFence()
    with pytest.raises(TypeError, match=r"\[1\]"):
        async with bounded():
            await wait_fence([open_fence, object()])  # type: ignore[list-item]
    assert open_fence.queries == 0
