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
  by one before they resume, and logs a warning;
* an admission takes its row (and so runs the reset) before its pages, and
  one whose pages tensor cannot be made (on CUDA, a device allocation)
  gives row and pages back: nothing is taken.

Every await is bounded by ``asyncio.timeout``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
import torch
from helpers import WAIT_S, pool_snapshot, spin

from asyncpool import AsyncReqToTokenPool, KVPagePool, ReqToTokenPool, row_pages
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


# ---------------------------------------------------------------- admissions


def _fail_resets_once(monkeypatch: pytest.MonkeyPatch, pool: AsyncReqToTokenPool) -> None:
    """Make the pool's next row reset raise, whichever of its ops it uses."""
    tables = pool._tables
    names = ("reset_rows", "reset_rows_from_1", "reset_where")
    real = {name: getattr(tables, name) for name in names}

    def fail(*args: object) -> None:
        for name, method in real.items():
            monkeypatch.setattr(tables, name, method)  # once
        raise torch.OutOfMemoryError("reset failed")

    for name in names:
        monkeypatch.setattr(tables, name, fail)


@pytest.mark.parametrize("call", ["try_admit", "admit"])
async def test_an_admission_whose_row_reset_raises_takes_no_pages(
    monkeypatch: pytest.MonkeyPatch, call: str
) -> None:
    """``admit`` and ``try_admit`` take the row before the pages: a dirty
    row's reset may raise (a device op), and then nothing is taken. Taking
    the pages first left them owned by no row, for good."""
    pool = AsyncReqToTokenPool(4, 8, kv=KVPagePool(17, 4))
    for _ in range(3):
        pool.free(await pool.alloc(1))  # every free row dirty
    before = pool_snapshot(pool)
    _fail_resets_once(monkeypatch, pool)
    with pytest.raises(torch.OutOfMemoryError):
        async with asyncio.timeout(WAIT_S):
            await (pool.admit(pages=4) if call == "admit" else _now(pool.try_admit(pages=4)))
    assert pool_snapshot(pool) == before
    grant = pool.try_admit(pages=16)  # every page is still there
    assert grant is not None and len(grant.pages) == 16
    pool.free([grant.row])
    await pool.close()


async def _now(value: object) -> object:
    return value


def _fail_grant_tensor_once(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make the next admission's pages tensor raise (on CUDA: its staging or
    device allocation); returns a list that counts the failures."""
    real = row_pages._from_numpy
    failed: list[int] = []

    def fail(arr: Any) -> torch.Tensor:
        monkeypatch.setattr(row_pages, "_from_numpy", real)  # once
        failed.append(1)
        raise torch.OutOfMemoryError("no memory for the grant's pages")

    monkeypatch.setattr(row_pages, "_from_numpy", fail)
    return failed


async def test_an_admission_whose_pages_tensor_raises_gives_both_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pool = AsyncReqToTokenPool(4, 8, kv=KVPagePool(17, 4))
    before = pool_snapshot(pool)
    failed = _fail_grant_tensor_once(monkeypatch)
    with pytest.raises(torch.OutOfMemoryError):
        pool.try_admit(pages=4)
    assert failed == [1]
    after = pool_snapshot(pool)
    # Row and pages were handed out and back: only the rows' high-water mark
    # and hand-out count (the generations) saw it, as after a waiter
    # cancelled once granted.
    for snapshot in (before, after):
        snapshot[0].pop("peak_allocated")
        snapshot[0].pop("rows_granted")
    assert after[:4] == before[:4]
    grant = pool.try_admit(pages=16)
    assert grant is not None and grant.row == 1 and len(grant.pages) == 16
    pool.free([grant.row])
    await pool.close()


async def test_a_queued_admission_whose_pages_tensor_raises_stays_queued(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In the grant loop the error reaches the call that ran it (here the
    free that made room), the hand-over is undone, and the waiter stays at
    the head, granted by the next run of the loop."""
    async with AsyncReqToTokenPool(3, 8, kv=KVPagePool(17, 4)) as pool:
        held = [await pool.admit(pages=8) for _ in range(2)]
        waiter = asyncio.create_task(pool.admit(pages=8))
        await spin()
        assert pool.waiting() == 1
        _fail_grant_tensor_once(monkeypatch)
        with pytest.raises(torch.OutOfMemoryError):
            pool.free([held[0].row])  # freed; the grant it ran failed
        assert pool.waiting() == 1 and not waiter.done()
        assert pool.available_size() == 1 and pool.kv.available_size() == 8
        pool.check_invariants()
        pool.reclaim()  # nothing pending: grants nobody
        pool.free([held[1].row])  # the loop runs again and grants the head
        async with asyncio.timeout(WAIT_S):
            grant = await waiter
        assert len(grant.pages) == 8
        assert pool.available_size() == 1 and pool.kv.available_size() == 8
        pool.free([grant.row])


def _fail_out_once(monkeypatch: pytest.MonkeyPatch, pool: AsyncReqToTokenPool, what: str) -> None:
    """Make the next tensor of page ids the pool makes for a caller raise
    (on CUDA: a staging or device allocation), once."""
    rp = pool._pages
    assert rp is not None
    real = rp.out

    def fail(*args: Any, **kwargs: Any) -> torch.Tensor:
        monkeypatch.setattr(rp, "out", real)  # once
        raise torch.OutOfMemoryError(f"no memory for {what}")

    monkeypatch.setattr(rp, "out", fail)


# Each growth of two rows holding a page each, and the pages it adds.
GROWTHS: dict[str, tuple[Any, int]] = {
    "extend": (lambda pool, rows: pool.extend(rows[0], 2), 2),
    "extend_rows": (lambda pool, rows: pool.extend_rows(rows, 2), 4),
    "extend_rows-per-row": (lambda pool, rows: pool.extend_rows(rows, [1, 2]), 3),
    "extend_fitting": (lambda pool, rows: pool.extend_fitting(rows, 2), 4),
    "extend_fitting-per-row": (lambda pool, rows: pool.extend_fitting(rows, [2, 1]), 3),
}


@pytest.mark.parametrize("growth", GROWTHS)
async def test_a_growth_whose_pages_tensor_raises_takes_nothing(
    monkeypatch: pytest.MonkeyPatch, growth: str
) -> None:
    """Each growth makes the caller's tensor before it records the pages
    in their rows: if making it raises (on CUDA, a device allocation), the
    pages go back and the rows' records are as they were."""
    async with AsyncReqToTokenPool(4, 8, kv=KVPagePool(17, 4)) as pool:
        rows = [(await pool.admit(pages=1)).row for _ in range(2)]
        before = pool_snapshot(pool)
        records = [pool.pages_of(row).tolist() for row in rows]
        _fail_out_once(monkeypatch, pool, "the growth's pages")
        grow, adds = GROWTHS[growth]
        with pytest.raises(torch.OutOfMemoryError):
            grow(pool, rows)
        assert pool_snapshot(pool) == before
        assert [pool.pages_of(row).tolist() for row in rows] == records
        assert grow(pool, rows) is not None  # and then it works
        assert pool.kv.allocated_size() == 2 + adds
        pool.free(rows)


@pytest.mark.parametrize("host", [False, True])
async def test_a_detach_whose_tensor_raises_leaves_the_row_its_pages(
    monkeypatch: pytest.MonkeyPatch, host: bool
) -> None:
    async with AsyncReqToTokenPool(4, 8, kv=KVPagePool(17, 4)) as pool:
        grant = await pool.admit(pages=1)
        before = pool_snapshot(pool)
        _fail_out_once(monkeypatch, pool, "the detached pages")
        with pytest.raises(torch.OutOfMemoryError):
            pool.detach_pages(grant.row, host=host)
        assert pool_snapshot(pool) == before
        assert pool.pages_of(grant.row).tolist() == grant.pages.tolist()
        pages = pool.detach_pages(grant.row, host=host)
        assert pages.tolist() == grant.pages.tolist()
        pool.free([grant.row])
        assert pool.kv.free(pages) == 1
