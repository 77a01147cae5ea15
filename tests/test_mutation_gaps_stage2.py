"""Gaps found by mutation testing of the stage-2 modules.

Each test pins one behaviour that a hand-written mutant of the library broke
while the whole suite (bar the demo, benchmark and example tests) still
passed:

* the overdue figures add up what *every* overdue fence holds, not only
  the last one scanned;
* an explicit pool's ``drain()`` settles a batch whose head fence it saw
  complete as ``retire()`` would: the batch moves behind its next open
  fence and stays pending (released with the head, its other fence could
  still write into the memory: an early re-grant);
* ``retire()`` never moves a stream's mark back: after retiring a step,
  retiring an older one leaves later frees behind the steps in between
  free at once.

Async tests run on asyncio and uvloop (conftest); every wait that could hang
is bounded.
"""

from __future__ import annotations

import asyncio
import itertools
import logging

import pytest
from helpers import EventFence, FakeStream, ManualClock, Streams, bounded, spin

from asyncpool import AsyncReqToTokenPool, KVPagePool
from asyncpool.ledger import SlotLedger
from asyncpool.overdue import OverdueFences


@pytest.fixture(autouse=True)
def _quiet_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.CRITICAL, logger="asyncpool")


def test_overdue_figures_add_up_every_overdue_fence():
    clock = ManualClock()
    led = SlotLedger(8, clock=clock)
    overdue = OverdueFences(10.0, [led], clock=clock)
    rows = led.take(3)
    assert rows is not None
    led.free(rows[:1], fence=EventFence())
    led.free(rows[1:], fence=EventFence())  # another fence, two rows
    clock.now = 10.0
    assert overdue.counts() == (2, {"rows": 3})


async def test_an_explicit_drain_keeps_a_row_behind_its_other_open_fence(kit: Streams):
    """A row used behind one transfer and freed behind another: drain()
    sees the first complete, and the row must then wait for the second."""
    first, second = kit.event_fence(), kit.event_fence()
    pool = AsyncReqToTokenPool(3, 4, reclaim="explicit")
    try:
        rows = await pool.alloc(1)
        pool.record_use(rows, first)
        pool.free(rows, fence=second)  # behind `first`, then `second`
        drain = asyncio.create_task(pool.drain())
        await spin()
        first.set()
        async with bounded():
            for _ in itertools.count():  # drain() polls `first` on the loop
                if drain.done() or pool._pending_fences()[0] is not first:
                    break
                await asyncio.sleep(0.001)
        assert not drain.done()
        assert pool.pending_size() == 1 and pool.available_size() == 1
        assert pool.try_alloc(2) is None  # the row is not handed out
        second.set()
        async with bounded():
            await drain
        assert pool.pending_size() == 0 and pool.available_size() == 2
        pool.check_invariants()
    finally:
        first.set()
        second.set()
        await pool.close()


def test_retiring_an_older_step_never_moves_the_mark_back():
    kv = KVPagePool(8, 4, reclaim="explicit")
    stream = FakeStream()
    old, mid, new = stream.record(), stream.record(), stream.record()
    assert kv.retire(new) == 0
    assert kv.retire(old) == 0  # late, out of order: the mark stays at `new`
    pages = kv.alloc(2)
    assert pages is not None
    assert kv.free(pages, fence=mid) == 2  # `mid` was retired with `new`
    assert kv.pending_size() == 0
    kv.check_invariants()
