"""KV groups: the grouped free's and admission's fast paths.

A grouped ``free`` of one row with no fence, no ``after`` and no recorded
use gives each group's own pages back at once, as the single-kv free does
(``GiveBack._free_groups_owned``), all or nothing across the groups: a
record written into, in any group, is refused before any page moves, and a
page that is no longer the row's in a later group undoes the groups freed
before it. A recorded use, a fence or ``after`` keep every group's pages
behind them (the general path). A row's dropped positions and detached
pages go the fast way and leave nothing behind. A grouped admission grants
at once when nothing queues or holds the grants, the pool is open, every
count is an int in range and every group has them free
(``Admission._admit_groups_fast``); anything else goes the general way,
which refuses, reclaims or queues as before. Every await that could hang
is bounded.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from helpers import (
    EventFence,
    Streams,
    bounded,
    kv_snapshot,
    ledger_snapshot,
    pool_snapshot,
    spin,
)
from helpers import kv_group as kv

from asyncpool import AsyncReqToTokenPool, GroupGrant, InvalidSlotError, KVPagePool, PoolClosedError
from asyncpool.kv_pages import ALLOCATED, OWNED
from asyncpool.row_pages import RowPages

#: full past the free's one-pass limit (its vectorised check), swa and mamba under it
COUNTS = {"full": 10, "swa": 2, "mamba": 1}
NAMES = ("full", "swa", "mamba")


def hybrid(rows: int = 4) -> AsyncReqToTokenPool:
    """A pool with full, sliding-window and Mamba groups, ``rows`` rows."""
    return AsyncReqToTokenPool(
        rows + 1,
        64,
        kv={
            "full": KVPagePool(10 * rows + 1, 4),
            "swa": KVPagePool(4 * rows + 1, 4),
            "mamba": KVPagePool(rows + 1, 1),
        },
    )


def state(pool: AsyncReqToTokenPool) -> tuple[Any, ...]:
    """The pool's and every group's observable state (invariants checked)."""
    rows = pool._ledger.allocated_rows()
    owned = tuple(
        tuple(tuple(pool.pages_of(r, group=name).tolist()) for r in rows) for name in NAMES
    )
    return (pool_snapshot(pool), owned, tuple(kv_snapshot(kv(pool, n)) for n in NAMES))


def conserved(pool: AsyncReqToTokenPool) -> None:
    pool.check_invariants()
    for name in NAMES:
        kv(pool, name).check_invariants()


def no_general_free(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the general path's page check fail the test: the fast path must
    free without it."""

    def refuse(*args: Any, **kw: Any) -> Any:
        raise AssertionError("the grouped free took the general path")

    monkeypatch.setattr(RowPages, "prepare_free", refuse)


# ---------------------------------------------------------------- free: the fast path


async def test_a_plain_grouped_free_gives_every_group_back_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pool = hybrid()
    g = await pool.admit(COUNTS)
    other = await pool.admit(COUNTS)
    with monkeypatch.context() as mp:
        no_general_free(mp)
        assert pool.free([g.row]) == 1
    for name in NAMES:
        assert kv(pool, name).allocated_size() == COUNTS[name]  # other's only
        assert {kv(pool, name).ledger.state_of(p) for p in g.pages[name].tolist()} == {"free"}
    assert pool.pages_of(other.row, group="full").tolist() == other.pages["full"].tolist()
    with pytest.raises(InvalidSlotError):
        pool.pages_of(g.row, group="swa")  # the row is free
    pool.free([other.row])
    conserved(pool)
    assert pool.stats().pages_allocated == 0


async def test_dropped_positions_go_with_a_fast_free(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = hybrid(rows=1)  # one row: the next admission gets it again
    g = await pool.admit(COUNTS)
    assert pool.drop_pages(g.row, 1, group="swa") == 1  # no fence, no use: free at once
    assert pool.pages_dropped(g.row, group="swa") == 1
    with monkeypatch.context() as mp:
        no_general_free(mp)
        assert pool.free([g.row]) == 1
    conserved(pool)
    again = await pool.admit(COUNTS)
    assert again.row == g.row
    assert pool.pages_dropped(again.row, group="swa") == 0
    assert 0 not in pool.pages_of(again.row, group="swa").tolist()
    pool.free([again.row])
    conserved(pool)


async def test_detached_pages_stay_with_the_caller_through_a_fast_free(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pool = hybrid()
    g = await pool.admit(COUNTS)
    detached = pool.detach_pages(g.row, group="full")
    with monkeypatch.context() as mp:
        no_general_free(mp)
        assert pool.free([g.row]) == 1
    assert kv(pool, "full").allocated_size() == COUNTS["full"]  # the caller's
    assert kv(pool, "swa").allocated_size() == kv(pool, "mamba").allocated_size() == 0
    kv(pool, "full").free(detached)
    conserved(pool)


# ---------------------------------------------------------------- free: not the fast path


async def test_a_recorded_use_keeps_every_groups_pages_behind_it() -> None:
    pool = hybrid()
    with Streams() as kit:
        stream = kit.stream()
        gate = kit.gate(stream)
        g = await pool.admit(COUNTS)
        pool.record_use([g.row], stream.record())
        assert pool.free([g.row]) == 0
        for name in NAMES:
            assert kv(pool, name).pending_size() == COUNTS[name]
            assert kv(pool, name).allocated_size() == 0
        gate.open()
        stream.synchronize()
        pool.reclaim()
    for name in NAMES:
        assert kv(pool, name).pending_size() == 0
        assert kv(pool, name).available_size() == kv(pool, name).capacity
    conserved(pool)


@pytest.mark.parametrize("how", ["fence", "after"])
async def test_a_fence_or_after_keeps_every_groups_pages_behind_it(how: str) -> None:
    pool = hybrid()
    with Streams() as kit:
        stream = kit.stream()
        gate = kit.gate(stream)
        g = await pool.admit(COUNTS)
        if how == "fence":
            assert pool.free([g.row], stream.record()) == 0
        else:
            assert pool.free([g.row], after=stream) == 0
        for name in NAMES:
            assert kv(pool, name).pending_size() == COUNTS[name]
        gate.open()
        stream.synchronize()
        pool.reclaim()
    assert pool.stats().pages_pending == 0
    conserved(pool)


@pytest.mark.parametrize("group", ["swa", "mamba"])
async def test_a_record_written_into_in_a_later_group_changes_nothing(group: str) -> None:
    pool = hybrid()
    g = await pool.admit(COUNTS)
    other = await pool.admit(COUNTS)
    # Another row's page written into g's record: still OWNED in its
    # ledger, so only the seal tells it is not g's to give back.
    record = g.pages[group]
    mine = int(record[0])
    record[0] = int(other.pages[group][0])
    before = state(pool)
    with pytest.raises(InvalidSlotError, match="written into"):
        pool.free([g.row])
    assert state(pool) == before
    record[0] = mine  # restored, the free goes through
    assert pool.free([g.row]) == 1
    pool.free([other.row])
    conserved(pool)
    assert pool.stats().pages_allocated == 0


@pytest.mark.parametrize("group", ["swa", "mamba"])
async def test_a_page_no_longer_owned_in_a_later_group_undoes_the_earlier_ones(
    group: str,
) -> None:
    pool = hybrid()
    g = await pool.admit(COUNTS)
    page = int(g.pages[group][-1])
    led = kv(pool, group).ledger
    led._state_bytes[page] = ALLOCATED  # taken from the row behind the pool's back

    def raw() -> tuple[Any, ...]:  # the pool's invariants do not hold while tampered
        return (
            ledger_snapshot(pool._ledger),
            [kv_snapshot(kv(pool, n)) for n in NAMES if n != group],
            (led.free_count, led.states().tobytes(), led._ring.tobytes(), led._head),
        )

    before = raw()
    with pytest.raises(InvalidSlotError):
        pool.free([g.row])
    assert raw() == before
    for name in NAMES:
        assert pool.pages_of(g.row, group=name).tolist() == g.pages[name].tolist()
    led._state_bytes[page] = OWNED  # the row's again: the free goes through
    assert pool.free([g.row]) == 1
    conserved(pool)
    assert pool.stats().pages_allocated == 0


# ---------------------------------------------------------------- admission


async def test_a_grouped_admission_never_jumps_the_queue() -> None:
    pool = hybrid(rows=3)
    hog = await pool.admit({"full": 10, "swa": 12, "mamba": 1})  # every swa page
    waiter = asyncio.ensure_future(pool.admit({"full": 1, "swa": 1, "mamba": 1}))
    await spin()
    assert pool.waiting() == 1
    fits = {"full": 1, "swa": 0, "mamba": 1}  # free now in every group
    assert pool.try_admit(fits) is None
    behind = asyncio.ensure_future(pool.admit(fits))
    await spin()
    assert pool.waiting() == 2 and not behind.done()
    pool.free([hog.row])
    async with bounded():
        first, second = await waiter, await behind
    assert isinstance(first, GroupGrant) and isinstance(second, GroupGrant)
    pool.free([first.row, second.row])
    conserved(pool)


async def test_a_grouped_admission_waits_while_the_grants_are_held() -> None:
    pool = hybrid()
    hold = pool.hold_grants()
    assert pool.try_admit(COUNTS) is None
    task = asyncio.ensure_future(pool.admit(COUNTS))
    await spin()
    assert pool.waiting() == 1 and not task.done()
    hold.release()
    async with bounded():
        g = await task
    pool.free([g.row])
    conserved(pool)


async def test_a_closed_pool_admits_nothing_through_the_fast_path() -> None:
    pool = hybrid()
    await pool.close()
    before = state(pool)
    with pytest.raises(PoolClosedError):
        pool.try_admit(COUNTS)
    with pytest.raises(PoolClosedError):
        async with bounded():
            await pool.admit(COUNTS)
    assert state(pool) == before


async def test_a_group_short_until_a_reclaim_is_admitted() -> None:
    pool = hybrid(rows=2)
    g = await pool.admit({"full": 10, "swa": 8, "mamba": 1})  # every swa page
    fence = EventFence()
    assert pool.free([g.row], fence) == 0
    fence.set()  # completed, not yet reclaimed: swa reads short until a reclaim
    assert kv(pool, "swa").ledger.free_count == 0
    again = pool.try_admit({"full": 1, "swa": 8, "mamba": 1})
    assert again is not None
    assert sorted(again.pages["swa"].tolist()) == sorted(g.pages["swa"].tolist())
    pool.free([again.row])
    conserved(pool)


@pytest.mark.parametrize(
    "counts",
    [
        {"full": np.int64(10), "swa": 2, "mamba": 1},  # not an int: the general path
        {"mamba": 1, "swa": 2, "full": 10},  # the groups' order need not be kept
    ],
)
async def test_counts_the_fast_path_leaves_to_the_general_one_are_granted(counts: Any) -> None:
    pool = hybrid()
    for grant in (pool.try_admit(counts), await pool.admit(counts)):
        assert grant is not None
        assert list(grant.pages) == list(NAMES)
        assert [len(grant.pages[n]) for n in NAMES] == [10, 2, 1]
        pool.free([grant.row])
    conserved(pool)


async def test_plain_counts_skip_the_general_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = hybrid()

    def refuse(*args: Any, **kw: Any) -> Any:
        raise AssertionError("the grouped admission took the general path")

    monkeypatch.setattr(AsyncReqToTokenPool, "_group_counts", refuse)
    for grant in (pool.try_admit(COUNTS), await pool.admit(COUNTS)):
        assert grant is not None
        assert [len(grant.pages[n]) for n in NAMES] == [10, 2, 1]
        pool.free([grant.row])
    monkeypatch.undo()
    conserved(pool)
