"""Calls that can never be served are counted: ``stats().unfittable``.

An ``alloc`` or ``admit`` that asks more rows or pages than the pool (a KV
group) has, or than quarantine behind faulted fences leaves it, raises
:class:`CapacityError`: refused at once, or failed while it queues when
quarantine grows under it. Such calls were counted nowhere (not in
``stats()``, not per priority, not in Prometheus), so an operator could not
alert on requests that can never be served. Each counts once now, pool-wide
and at its priority, exported as ``asyncpool_alloc_unfittable_total`` and
``asyncpool_priority_unfittable_total``: a waiter failed so and cancelled
before it resumes raises ``CancelledError`` and counts as a cancellation
alone; bad counts, bad priorities or timeouts beside a count past the
pool's size, and ``try_`` calls (None or raising) count nothing.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from helpers import bounded, counter_values, grouped_pool, queued_call, settled

from asyncpool import AsyncReqToTokenPool, CapacityError, KVPagePool
from asyncpool.metrics import PoolCollector


class DeadTransfer:
    """A fence whose writer failed: ``query()`` raises (its memory is quarantined)."""

    def query(self) -> bool:
        raise RuntimeError("KV transfer failed: peer gone")

    def synchronize(self) -> None:
        raise RuntimeError("KV transfer failed: peer gone")


def unfittable(pool: Any) -> tuple[int, dict[int, int]]:
    """The pool's unfittable count, and each priority's (those not 0)."""
    stats = pool.stats()
    per = {p: one.unfittable for p, one in stats.by_priority.items() if one.unfittable}
    return stats.unfittable, per


@pytest.fixture(autouse=True)
def _quiet(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.CRITICAL, logger="asyncpool")


async def test_calls_asking_more_than_the_pool_has_are_counted_at_their_priority() -> None:
    pool = AsyncReqToTokenPool(5, 16, kv=KVPagePool(9, 4))  # 4 rows, 8 pages
    with pytest.raises(CapacityError, match="only 4"):
        await pool.alloc(5, priority=2)
    with pytest.raises(CapacityError, match="only 8"):
        await pool.admit(pages=9, priority=-1)
    with pytest.raises(CapacityError):
        async with pool.lease(10**6, priority=2):
            raise AssertionError("granted")
    assert unfittable(pool) == (3, {-1: 1, 2: 2})
    pool.check_invariants()
    await pool.close()


async def test_bad_counts_and_try_calls_are_not_counted() -> None:
    pool = AsyncReqToTokenPool(5, 16, kv=KVPagePool(9, 4))
    for call in (
        lambda: pool.alloc(0),
        lambda: pool.alloc(2.0),  # type: ignore[arg-type]
        lambda: pool.admit(pages=-1),
        lambda: pool.admit(pages="3"),  # type: ignore[arg-type]
        lambda: pool.alloc(5, priority=1.5),  # type: ignore[arg-type]
        # A bad timeout is bad input too, though the size is refused first.
        lambda: pool.alloc(5, timeout="x"),  # type: ignore[arg-type]
        lambda: pool.alloc(5, timeout=-1.0),
        lambda: pool.admit(pages=9, timeout=float("nan")),
    ):
        with pytest.raises(CapacityError):
            async with bounded():
                await call()
    with pytest.raises(CapacityError):
        pool.try_alloc(5)
    with pytest.raises(CapacityError):
        pool.try_admit(pages=9)
    held = await pool.alloc(4)
    assert pool.try_alloc(1) is None  # does not fit now: not unfittable
    assert unfittable(pool) == (0, {})
    pool.free(held)
    await pool.close()


async def test_a_group_count_past_its_group_is_counted() -> None:
    pool = grouped_pool()  # swa 8 pages, full 12
    with pytest.raises(CapacityError, match="'swa'"):
        await pool.admit(pages={"swa": 9, "full": 1}, priority=4)
    with pytest.raises(CapacityError, match="'swa'"):
        await pool.admit(pages={"swa": -1, "full": 13}, priority=4)  # bad input first
    with pytest.raises(CapacityError, match="'swa'"):
        await pool.admit(pages={"swa": 9, "full": 1}, timeout=True)  # type: ignore[arg-type]
    assert unfittable(pool) == (1, {4: 1})
    pool.check_invariants()
    await pool.close()


async def test_refused_at_once_behind_quarantine_counts_once() -> None:
    pool = AsyncReqToTokenPool(5, 16, kv=KVPagePool(9, 4))
    grant = await pool.admit(pages=2)
    pool.free([grant.row], fence=DeadTransfer())
    pool.reclaim()
    assert (pool.stats().quarantined, pool.stats().pages_quarantined) == (1, 2)
    with pytest.raises(CapacityError, match="quarantined"):
        await pool.alloc(4, priority=1)
    with pytest.raises(CapacityError, match="quarantined"):
        await pool.admit(pages=7, priority=1)
    with pytest.raises(CapacityError, match="quarantined"):
        pool.try_admit(pages=7)  # a try call: not counted
    assert unfittable(pool) == (2, {1: 2})
    pool.check_invariants()
    await pool.close()


async def _fault_under(pool: Any, held: Any) -> None:
    """Free ``held`` (rows) behind a fence that faults and reclaim it: the
    quarantine that makes the queued waiters unfittable."""
    pool.free(held, fence=DeadTransfer())
    pool.reclaim()


async def test_waiters_failed_when_quarantine_grows_count_once() -> None:
    pool = AsyncReqToTokenPool(5, 16, kv=KVPagePool(9, 4))
    grants = [await pool.admit(pages=2) for _ in range(4)]  # every row, every page
    alloc = await queued_call(pool.alloc(4, priority=3))
    admit = await queued_call(pool.admit(pages=8, priority=5))
    small = await queued_call(pool.admit(pages=1, priority=6))  # still fits
    await _fault_under(pool, [grants[0].row])
    assert isinstance(await settled(alloc), CapacityError)
    assert isinstance(await settled(admit), CapacityError)
    assert unfittable(pool) == (2, {3: 1, 5: 1})
    pool.free([g.row for g in grants[1:]])
    got = await settled(small)
    pool.free([got.row])
    assert unfittable(pool) == (2, {3: 1, 5: 1})
    pool.check_invariants()
    await pool.close()


async def test_a_grouped_waiter_failed_so_counts_once() -> None:
    pool = grouped_pool(rows=2)
    grants = [await pool.admit(pages={"swa": 4, "full": 6}) for _ in range(2)]
    waiter = await queued_call(pool.admit(pages={"swa": 8, "full": 1}, priority=7))
    await _fault_under(pool, [grants[0].row])
    assert isinstance(await settled(waiter), CapacityError)
    assert unfittable(pool) == (1, {7: 1})
    pool.check_invariants()
    await pool.close()


async def test_a_waiter_failed_so_and_cancelled_before_it_resumes_is_a_cancellation() -> None:
    pool = AsyncReqToTokenPool(5, 16)
    held = await pool.alloc(4)
    task = await queued_call(pool.alloc(4, priority=2))
    await _fault_under(pool, held[:1])  # the shed runs at the loop's next turn
    queued: list[int] = []

    def cancel() -> None:  # right after the shed, before the task resumes
        queued.append(pool.stats().waiters)
        task.cancel()

    asyncio.get_running_loop().call_soon(cancel)
    assert isinstance(await settled(task), asyncio.CancelledError)
    assert queued == [0]  # the shed had failed it: the cancel came after
    stats = pool.stats()
    assert (stats.unfittable, stats.cancellations) == (0, 1)
    assert (stats.by_priority[2].unfittable, stats.by_priority[2].cancellations) == (0, 1)
    pool.free(held[1:])
    pool.check_invariants()
    await pool.close()


async def test_exported_pool_wide_and_per_priority() -> None:
    pool = AsyncReqToTokenPool(5, 16)
    collector = PoolCollector(pool, name="decode")
    assert counter_values(collector)["asyncpool_alloc_unfittable"] == 0
    with pytest.raises(CapacityError):
        await pool.alloc(5, priority=3)
    assert counter_values(collector)["asyncpool_alloc_unfittable"] == 1
    (fam,) = [f for f in collector.collect() if f.name == "asyncpool_priority_unfittable"]
    assert [(s.labels, s.value) for s in fam.samples if s.name.endswith("_total")] == [
        ({"pool": "decode", "priority": "3"}, 1.0)
    ]
    await pool.close()
