"""KV groups: the grant loop, fences, cancellation and lifecycle across groups.

A grouped admission waits in the same queue as ``alloc`` and single-kv
``admit`` (FIFO within priority, the head blocks), holds nothing while it
waits (no hold-and-wait: short in one group, it has no row and no page of
any group), is granted at hand-over by whoever makes memory free (a free, a
fence completing in any group's ledger with nobody calling the pool, a
caller's ``kv.free`` on a group's page pool), and gives every group back
when cancelled after its grant. ``free``/``record_use``/``force_release``/
``retire``/``agree``/``drain``/``release_memory``/``close`` cover every
group. Every await that could hang is bounded.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
import torch
from helpers import ManualClock, Streams, bounded, spin
from helpers import grouped_pool as grouped
from helpers import kv_group as kv

import asyncpool.agreement as agreement_mod
from asyncpool import (
    AgreementError,
    AsyncReqToTokenPool,
    GroupGrant,
    KVPagePool,
    PoolBusyError,
    PoolClosedError,
)


def free_pages(pool: AsyncReqToTokenPool) -> tuple[int, int, int]:
    return (
        pool.available_size(),
        kv(pool, "swa").available_size(),
        kv(pool, "full").available_size(),
    )


def conserved(pool: AsyncReqToTokenPool) -> None:
    pool.check_invariants()
    st = pool.stats()
    assert st.pages_free + st.pages_allocated + st.pages_pending + st.pages_quarantined == (
        st.pages_capacity
    )
    for name in ("swa", "full"):
        kv(pool, name).check_invariants()


async def outcome(task: asyncio.Task[Any]) -> Any:
    async with bounded():
        try:
            return await task
        except BaseException as exc:
            return exc


async def queued(pool: AsyncReqToTokenPool, *coros: Any) -> list[asyncio.Task[Any]]:
    tasks = [asyncio.ensure_future(c) for c in coros]
    await spin()
    assert pool.waiting() == len(coros)
    return tasks


# ---------------------------------------------------------------- no hold-and-wait


async def test_a_waiter_short_in_one_group_holds_nothing_then_gets_everything() -> None:
    pool = grouped(swa=8, full=4)
    big = await pool.admit({"swa": 1, "full": 4})  # full is all taken
    before = free_pages(pool)
    (waiter,) = await queued(pool, pool.admit({"swa": 3, "full": 2}))
    # It waits with no row and no swa page: everything it would need from
    # the groups that have it is still free for others.
    assert free_pages(pool) == before
    other = pool.try_alloc(1)
    assert other is None  # no queue jumping, but nothing was held either
    pages = pool.detach_pages(big.row, group="full")
    assert free_pages(pool) == before  # detached: still allocated, not free
    kv(pool, "full").free(pages)  # the caller's free runs the grant loop
    assert pool.waiting() == 0  # granted inside that call
    got = await outcome(waiter)
    assert isinstance(got, GroupGrant)
    assert len(got.pages["swa"]) == 3 and len(got.pages["full"]) == 2
    pool.free([big.row, got.row])
    conserved(pool)
    assert free_pages(pool) == (4, 8, 4)


# ---------------------------------------------------------------- order


async def test_fifo_across_alloc_single_and_grouped_admit() -> None:
    pool = grouped(rows=2)
    held = [await pool.admit({"swa": 1, "full": 1}), await pool.admit({"swa": 1, "full": 1})]
    order: list[str] = []

    async def tagged(tag: str, coro: Any) -> Any:
        got = await coro
        order.append(tag)
        return got

    tasks = await queued(
        pool,
        tagged("alloc", pool.alloc(1)),
        tagged("grouped", pool.admit({"swa": 2, "full": 2})),
        tagged("alloc2", pool.alloc(1)),
    )
    pool.free(held[0].row)
    await spin()
    assert order == ["alloc"]
    pool.free(held[1].row)
    await spin()
    assert order == ["alloc", "grouped"]
    first = await outcome(tasks[0])
    pool.free(first)
    await spin()
    assert order == ["alloc", "grouped", "alloc2"]
    second = await outcome(tasks[1])
    pool.free([second.row, *(await outcome(tasks[2]))])
    conserved(pool)


async def test_priority_orders_grouped_admissions() -> None:
    pool = grouped(rows=1)
    held = await pool.admit({"swa": 1, "full": 1})
    late_low = asyncio.ensure_future(pool.admit({"swa": 1, "full": 1}, priority=5))
    await spin()
    early_high = asyncio.ensure_future(pool.admit({"swa": 1, "full": 1}, priority=0))
    await spin()
    pool.free(held.row)
    got = await outcome(early_high)
    assert isinstance(got, GroupGrant)
    assert not late_low.done()
    pool.free(got.row)
    low = await outcome(late_low)
    pool.free(low.row)
    conserved(pool)


async def test_the_grouped_head_blocks_smaller_requests_behind_it() -> None:
    pool = grouped(rows=3, swa=2)
    held = await pool.admit({"swa": 2, "full": 0})
    head, behind = await queued(
        pool, pool.admit({"swa": 2, "full": 1}), pool.admit({"swa": 0, "full": 1})
    )
    assert pool.try_admit({"swa": 0, "full": 1}) is None  # no queue jumping
    assert pool.pages_short(group="swa") == 2 and pool.pages_short(group="full") == 0
    pool.free(held.row)
    a, b = await outcome(head), await outcome(behind)
    pool.free([a.row, b.row])
    conserved(pool)


# ---------------------------------------------------------------- fences wake waiters


async def test_a_host_fence_in_the_second_group_wakes_a_waiter_unprompted(kit: Streams) -> None:
    pool = grouped(swa=8, full=3)
    stream = kit.stream()
    gate = kit.gate(stream)
    g = await pool.admit({"swa": 1, "full": 3})
    full = pool.detach_pages(g.row, group="full")
    pool.free(g.row)  # the row and its swa page: free at once
    kv(pool, "full").free(full, fence=stream.record())  # only group 2 waits
    (waiter,) = await queued(pool, pool.admit({"swa": 1, "full": 3}))
    gate.open()  # nobody calls the pool from here on
    got = await outcome(waiter)
    assert isinstance(got, GroupGrant) and len(got.pages["full"]) == 3
    pool.free(got.row)
    conserved(pool)


async def test_a_transfer_handle_in_the_second_group_wakes_a_waiter(kit: Streams) -> None:
    pool = grouped(swa=8, full=3)
    transfer = kit.event_fence()  # query()/synchronize(), no stream: polled
    g = await pool.admit({"swa": 2, "full": 3})
    pool.free(g.row, fence=transfer)  # row, swa and full pages all behind it
    assert pool.stats().pages_pending == 5
    (waiter,) = await queued(pool, pool.admit({"swa": 1, "full": 3}))
    transfer.set()
    got = await outcome(waiter)
    assert isinstance(got, GroupGrant)
    pool.free(got.row)
    async with bounded():
        await pool.drain()
    conserved(pool)


async def test_free_and_record_use_cover_every_group(kit: Streams) -> None:
    pool = grouped()
    stream = kit.stream()
    gate = kit.gate(stream)
    g = await pool.admit({"swa": 2, "full": 3})
    pool.record_use([g.row], stream.record())
    assert pool.free(g.row) == 0
    st = pool.stats()
    assert (st.pending, st.pages_pending) == (1, 5)
    assert kv(pool, "swa").pending_size() == 2 and kv(pool, "full").pending_size() == 3
    gate.open()
    async with bounded():
        await pool.drain()
    assert free_pages(pool) == (4, 8, 12)
    conserved(pool)


async def test_free_after_a_stream_covers_every_group(kit: Streams) -> None:
    pool = grouped()
    stream = kit.stream()
    gate = kit.gate(stream)
    g = await pool.admit({"swa": 1, "full": 1})
    assert pool.free([g.row], after=stream) == 0
    assert pool.stats().pages_pending == 2
    gate.open()
    async with bounded():
        await pool.drain()
    conserved(pool)


# ---------------------------------------------------------------- cancellation, timeouts


async def test_cancelled_after_its_grant_gives_back_every_group() -> None:
    pool = grouped(rows=1)
    held = await pool.admit({"swa": 1, "full": 1})
    (waiter,) = await queued(pool, pool.admit({"swa": 4, "full": 5}))
    pool.free(held.row)  # grants the waiter inside this call
    assert pool.waiting() == 0 and kv(pool, "full").available_size() == 7
    waiter.cancel()  # before it resumes
    assert isinstance(await outcome(waiter), asyncio.CancelledError)
    assert free_pages(pool) == (1, 8, 12)
    st = pool.stats()
    assert st.cancellations == 1 and st.pages_allocated == 0
    conserved(pool)


async def test_cancelled_while_queued_takes_nothing() -> None:
    pool = grouped(rows=1)
    held = await pool.admit({"swa": 1, "full": 1})
    (waiter,) = await queued(pool, pool.admit({"swa": 1, "full": 1}))
    waiter.cancel()
    assert isinstance(await outcome(waiter), asyncio.CancelledError)
    pool.free(held.row)
    assert free_pages(pool) == (1, 8, 12)
    conserved(pool)


async def test_a_timeout_takes_nothing_and_a_grant_first_wins() -> None:
    pool = grouped(rows=1)
    held = await pool.admit({"swa": 1, "full": 1})
    with pytest.raises(TimeoutError):
        async with bounded():
            await pool.admit({"swa": 1, "full": 1}, timeout=0.01)
    assert pool.stats().timeouts == 1 and free_pages(pool) == (0, 7, 11)
    (waiter,) = await queued(pool, pool.admit({"swa": 2, "full": 2}, timeout=30))
    pool.free(held.row)
    got = await outcome(waiter)
    assert isinstance(got, GroupGrant)
    pool.free(got.row)
    conserved(pool)


async def test_max_waiters_counts_grouped_admissions() -> None:
    pool = grouped(rows=1, max_waiters=1)
    held = await pool.admit({"swa": 1, "full": 1})
    (waiter,) = await queued(pool, pool.admit({"swa": 1, "full": 1}))
    with pytest.raises(PoolBusyError):
        await pool.admit({"swa": 1, "full": 1})
    pool.free(held.row)
    pool.free((await outcome(waiter)).row)
    conserved(pool)


# ---------------------------------------------------------------- lifecycle


async def test_close_fails_a_grouped_waiter_and_drain_waits_for_every_group(
    kit: Streams,
) -> None:
    pool = grouped(rows=1)
    stream = kit.stream()
    gate = kit.gate(stream)
    held = await pool.admit({"swa": 1, "full": 2})
    (waiter,) = await queued(pool, pool.admit({"swa": 1, "full": 1}))
    await pool.close()
    assert isinstance(await outcome(waiter), PoolClosedError)
    with pytest.raises(PoolClosedError):
        pool.try_admit({"swa": 1, "full": 1})
    full = pool.detach_pages(held.row, group="full")
    pool.free(held.row)
    kv(pool, "full").free(full, fence=stream.record())
    with pytest.raises(TimeoutError, match="2 pages"):
        await pool.drain(timeout=0.01)
    gate.open()
    async with bounded():
        await pool.drain()
    conserved(pool)


async def test_release_memory_refuses_while_a_group_holds_pages() -> None:
    pool = grouped()
    g = await pool.admit({"swa": 0, "full": 1})
    pages = pool.detach_pages(g.row, group="full")
    pool.free(g.row)
    with pytest.raises(PoolBusyError, match="KV group 'full'"):
        await pool.release_memory()
    kv(pool, "full").free(pages)
    async with bounded():
        await pool.release_memory()
    assert pool.try_admit({"swa": 1, "full": 1}) is None  # released
    (waiter,) = await queued(pool, pool.admit({"swa": 1, "full": 1}))
    await pool.resume_memory()
    got = await outcome(waiter)
    assert isinstance(got, GroupGrant)
    pool.free(got.row)
    conserved(pool)


# ---------------------------------------------------------------- overdue, force_release


async def test_overdue_and_force_release_across_groups(
    kit: Streams, caplog: pytest.LogCaptureFixture
) -> None:
    pool = grouped(fence_timeout=1000.0)
    clock = ManualClock()
    for led in (pool._ledger, *(ps.ledger for ps in pool._page_sets)):
        led._clock = clock
    assert pool._overdue is not None
    pool._overdue._clock = clock
    stream = kit.stream()
    kit.gate(stream)
    fence = stream.record()
    g = await pool.admit({"swa": 2, "full": 3})
    pool.free(g.row, fence=fence)
    clock.now = 2000.0
    with caplog.at_level(logging.WARNING):
        pool._check_overdue()
    st = pool.stats()
    assert (st.overdue_fences, st.overdue_rows, st.overdue_pages) == (1, 1, 5)
    assert pool.overdue_fences() == [fence]
    with caplog.at_level(logging.WARNING):
        assert pool.force_release(fence) == (1, 5)
    assert free_pages(pool) == (4, 8, 12)
    assert pool.stats().overdue_fences == 0
    conserved(pool)


# ---------------------------------------------------------------- explicit mode


def explicit_grouped(names: tuple[str, ...] = ("swa", "full")) -> AsyncReqToTokenPool:
    return AsyncReqToTokenPool(
        5, 64, kv={name: KVPagePool(9, 4) for name in names}, reclaim="explicit"
    )


class Transfer:
    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        raise AssertionError("never waited for")


async def test_retire_returns_every_group_and_admits_a_waiter() -> None:
    from helpers import FakeStream

    pool = explicit_grouped()
    stream = FakeStream()
    g = await pool.admit({"swa": 8, "full": 2})
    step = stream.record()
    pool.free(g.row, fence=step)
    (waiter,) = await queued(pool, pool.admit({"swa": 1, "full": 1}))
    assert pool.retire(step) == (1, 10)
    got = await outcome(waiter)
    assert isinstance(got, GroupGrant)
    pool.free(got.row)
    pool.check_invariants()


async def test_agree_settles_every_group(group: Any) -> None:
    pool = explicit_grouped()
    t = Transfer()
    g = await pool.admit({"swa": 2, "full": 3})
    pool.free(g.row, fence=t)
    assert pool.agree(group) == (0, 0)
    t.done = True
    assert pool.agree(group) == (1, 5)
    pool.check_invariants()


async def _agree_vector(pool: AsyncReqToTokenPool, group: Any, mp: pytest.MonkeyPatch) -> list[int]:
    seen: list[list[int]] = []

    def capture(values: list[int], *args: Any, **kw: Any) -> list[int]:
        seen.append(list(values))
        return list(values)

    mp.setattr(agreement_mod, "_all_reduce_min", capture)
    pool.agree(group)
    mp.undo()
    return seen[0]


@pytest.mark.parametrize(
    "other",
    [("swa", "mamba"), ("full", "swa"), ("swa",), ("swa", "full", "mamba"), "single", "none"],
)
async def test_ranks_built_with_other_groups_raise_agreement_error(
    group: Any, other: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    mine = explicit_grouped()
    if other == "single":
        theirs = AsyncReqToTokenPool(5, 64, kv=KVPagePool(9, 4), reclaim="explicit")
    elif other == "none":
        theirs = AsyncReqToTokenPool(5, 64, reclaim="explicit")
    else:
        theirs = explicit_grouped(other)
    with pytest.MonkeyPatch.context() as mp:
        a = await _agree_vector(mine, group, mp)
    with pytest.MonkeyPatch.context() as mp:
        b = await _agree_vector(theirs, group, mp)
    # The same length on every rank: the collective cannot hang on sizes.
    assert len(a) == len(b)
    for pool, peer in ((mine, b), (theirs, a)):

        def reduce(values: list[int], *args: Any, _peer: list[int] = peer, **kw: Any) -> list[int]:
            return [min(x, y) for x, y in zip(values, _peer, strict=True)]

        monkeypatch.setattr(agreement_mod, "_all_reduce_min", reduce)
        with pytest.raises(AgreementError):
            pool.agree(group)
    monkeypatch.undo()
    # Alike ranks agree.
    twin = explicit_grouped()
    with pytest.MonkeyPatch.context() as mp:
        assert await _agree_vector(twin, group, mp) == a


async def test_ranks_whose_groups_hold_other_counts_raise_agreement_error(
    group: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Same totals, split differently between the groups: a diverged rank.
    mine, theirs = explicit_grouped(), explicit_grouped()
    await mine.admit({"swa": 2, "full": 1})
    await theirs.admit({"swa": 1, "full": 2})
    with pytest.MonkeyPatch.context() as mp:
        a = await _agree_vector(mine, group, mp)
    with pytest.MonkeyPatch.context() as mp:
        b = await _agree_vector(theirs, group, mp)
    monkeypatch.setattr(
        agreement_mod,
        "_all_reduce_min",
        lambda values, *args, **kw: [min(x, y) for x, y in zip(values, b, strict=True)],
    )
    with pytest.raises(AgreementError):
        mine.agree(group)
    assert a != b


async def test_grouped_explicit_drain_settles_every_group() -> None:
    pool = explicit_grouped()
    t = Transfer()
    g = await pool.admit({"swa": 2, "full": 3})
    pool.free(g.row, fence=t)
    t.done = True
    async with bounded():
        await pool.drain()
    assert pool.stats().pages_pending == 0
    pool.check_invariants()


async def test_grant_tensor_failure_gives_back_every_group(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = grouped()
    full = pool._groups["full"]  # type: ignore[index]

    def boom(pages: Any, host: bool = False) -> torch.Tensor:
        raise RuntimeError("device allocation failed")

    monkeypatch.setattr(full, "out", boom)
    with pytest.raises(RuntimeError, match="device allocation"):
        await pool.admit({"swa": 2, "full": 2})
    assert free_pages(pool) == (4, 8, 12)
    monkeypatch.undo()
    conserved(pool)


async def test_a_shared_adapter_slot_as_a_group_detached_to_the_cache() -> None:
    """docs/api.md, *A request that needs two pools*: a LoRA adapter slot
    as a KV group of the model's pool, granted with the row on a miss and
    detached to the engine's adapter cache, evicted behind its newest
    reader; a queued miss holds nothing of either kind meanwhile."""
    slots = KVPagePool(3, 1, name="lora")  # two adapter slots
    pool = AsyncReqToTokenPool(8, 64, kv={"kv": KVPagePool(64, 4), "lora": slots})
    async with bounded():
        a = await pool.admit({"kv": 4, "lora": 1})  # a miss: adapter A's slot
        cache = {"A": pool.detach_pages(a.row, group="lora")}
        assert pool.pages_of(a.row, group="lora").numel() == 0
        hit = await pool.admit({"kv": 4, "lora": 0})  # a hit: no slot
        b = await pool.admit({"kv": 4, "lora": 1})
        cache["B"] = pool.detach_pages(b.row, group="lora")
    free_rows, free_kv = pool.available_size(), pool.kv_groups["kv"].available_size()
    waiter = asyncio.ensure_future(pool.admit({"kv": 4, "lora": 1}))  # adapter C
    await spin()
    assert pool.pages_short(group="lora") == 1 and pool.pages_short(group="kv") == 0
    assert (pool.available_size(), pool.kv_groups["kv"].available_size()) == (free_rows, free_kv)
    with Streams() as streams:
        step = streams.stream("forward")
        gate = streams.gate(step)
        reader = step.record()
        pool.record_use([a.row, hit.row], reader)
        slots.free(cache.pop("A"), fence=reader)  # evicted behind its newest reader
        await spin()
        assert not waiter.done()
        gate.open()
        async with bounded():
            c = await waiter
    assert c.pages["lora"].tolist() == [1]  # A's slot, once the reader was done
    pool.free([a.row, hit.row, b.row, c.row])
    slots.free(cache.pop("B"))
    pool.check_invariants()
