"""A reset that raises leaves its rows dirty.

``SlotLedger.take`` resets every dirty row (the ``on_reset`` hook: the
pool's one vectorised zeroing of their lengths) right before handing the
first of them out. On CUDA that op builds an index tensor on the device and
can raise (``torch.OutOfMemoryError``); an interrupt can land in it too.
Pinned here:

* ``take`` raising from the hook changes nothing (every public method of
  the ledger is atomic): the rows stay dirty, ``resets`` is not counted, and
  the next ``take`` calls the hook again with all of them, before any of them
  is handed out (before: they were counted clean before the hook ran, and
  the next ``take`` handed them out unreset);
* on the synchronous pool, the ``alloc`` after an ``alloc`` whose reset
  raised hands out rows that read zero lengths, not the last owner's.

* on the async pool, a grant whose batched reset raises (it runs in a
  callback scheduled before the granted tasks resume) zeroes the rows one
  by one before they resume, and logs a warning.

Every await is bounded by ``asyncio.timeout``.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch
from helpers import WAIT_S, spin

from asyncpool import AsyncReqToTokenPool, ReqToTokenPool
from asyncpool.ledger import SlotLedger


class _FailOnce:
    """An ``on_reset`` hook whose first call raises ``MemoryError``."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []
        self.failed = False

    def __call__(self, rows: list[int]) -> None:
        if not self.failed:
            self.failed = True
            raise MemoryError("reset failed")
        self.calls.append(list(rows))


def test_take_whose_reset_raises_leaves_its_rows_dirty() -> None:
    hook = _FailOnce()
    led = SlotLedger(6, on_reset=hook)
    taken = led.take(5)
    assert taken is not None
    led.free(taken)  # every free row dirty now
    with pytest.raises(MemoryError):
        led.take(2)
    assert led.resets == 0 and led.free_count == 5
    led.check_invariants()
    assert led.take(2) == [1, 2]
    assert hook.calls == [[1, 2, 3, 4, 5]] and led.resets == 1
    led.check_invariants()


@pytest.mark.parametrize("held", [0, 1])
def test_sync_alloc_after_a_failed_reset_hands_out_zeroed_rows(
    monkeypatch: pytest.MonkeyPatch, held: int
) -> None:
    """``held=0``: every row free, the bulk reset of the whole table fails;
    ``held=1``: one row held, the reset of the dirty rows' index fails."""
    pool = ReqToTokenPool(6, 8)
    rows = pool.alloc(5)
    assert rows is not None
    for row in rows:
        pool.alloced_lens[row] = 7
        pool.verified_lens[row] = 5
    pool.free(rows[held:])
    tables = pool._tables
    name = "reset_rows" if held else "reset_rows_from_1"
    real = getattr(tables, name)
    failed = False

    def fail_once(*args: object) -> None:
        nonlocal failed
        if not failed:
            failed = True
            raise torch.OutOfMemoryError("reset failed")
        real(*args)

    monkeypatch.setattr(tables, name, fail_once)
    with pytest.raises(torch.OutOfMemoryError):
        pool.alloc(2)
    pool.check_invariants()
    got = pool.alloc(2)
    assert got is not None
    assert [int(pool.alloced_lens[r]) for r in got] == [0, 0]
    assert [int(pool.verified_lens[r]) for r in got] == [0, 0]
    pool.check_invariants()


async def test_a_grant_whose_batched_reset_raises_still_hands_out_zeroed_rows(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The grant loop hands rows to waiters and schedules one batched reset
    before their tasks resume. If that op raises (a CUDA out-of-memory error
    copying its index), the rows are zeroed one by one before the tasks
    resume: a granted waiter never reads its row's last owner's lengths."""
    async with AsyncReqToTokenPool(3, 8) as pool:
        rows = await pool.alloc(2)
        for row in rows:
            pool.alloced_lens[row] = 7
            pool.verified_lens[row] = 5
        waiters = [asyncio.create_task(pool.alloc(1)) for _ in range(2)]
        await spin()
        assert pool.waiting() == 2
        tables = pool._tables
        real = tables.reset_rows
        calls: list[list[int]] = []

        def fail(rows: list[int]) -> None:
            calls.append(list(rows))
            raise torch.OutOfMemoryError("reset failed")

        monkeypatch.setattr(tables, "reset_rows", fail)
        with caplog.at_level(logging.WARNING, logger="asyncpool.pool"):
            pool.free(rows)  # both waiters granted in this call, one flush queued
            async with asyncio.timeout(WAIT_S):
                got = [r for w in waiters for r in await w]
        assert got == rows and calls == [rows]  # one batched reset, of both
        for row in got:
            assert int(pool.alloced_lens[row]) == 0 and int(pool.verified_lens[row]) == 0
        assert "zeroing them one by one" in caplog.text
        monkeypatch.setattr(tables, "reset_rows", real)
        pool.check_invariants()
        pool.free(got)


def test_reset_rows_each_zeroes_only_those_rows() -> None:
    pool = ReqToTokenPool(5, 8)
    rows = pool.alloc(4)
    assert rows == [1, 2, 3, 4]
    for row in rows:
        pool.alloced_lens[row] = row + 1
        pool.verified_lens[row] = row
    pool._tables.reset_rows_each([2, 4])
    assert pool.alloced_lens.tolist()[1:] == [2, 0, 4, 0]
    assert pool.verified_lens.tolist()[1:] == [1, 0, 3, 0]
    pool.free(rows)
