"""KV groups: growth across several groups at once, all or nothing.

A hybrid model's decode step can cross a page boundary in more than one
group (sliding window and full attention) in the same step:
``extend(row, {group: count})`` and ``extend_rows(rows, {group: count})``
grow every named group or none, so a scheduler short in the second group
has nothing to trim back in the first. These tests cover the grant (pages
land in their groups and are freed with the row behind its fences), the
refusal (nothing taken anywhere), fenced pages that do not count as free,
the growth's own reclaim and the queued admissions' rule, bad input (typed
errors, the pool exactly unchanged), and, for the same groups,
``page_fence_errors`` counting a fence once and queue messages that name
the groups.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest
import torch
from helpers import Streams, bounded, pool_snapshot, spin
from helpers import grouped_pool as grouped
from helpers import kv_group as kv

from asyncpool import (
    AsyncReqToTokenPool,
    CapacityError,
    InvalidSlotError,
    KVPagePool,
    PoolBusyError,
    PoolClosedError,
)


def ids(t: torch.Tensor) -> list[int]:
    out: list[int] = t.flatten().tolist()
    return out


def snapshot(pool: AsyncReqToTokenPool) -> tuple[Any, ...]:
    """The pool's stats and ledger, every group's page stats, and every
    row's pages in every group: what a refused call must leave as it was."""
    rows = pool._ledger.allocated_rows()
    per_group = []
    for name, one in (pool.kv_groups or {}).items():
        one.check_invariants()
        owned = tuple(tuple(ids(pool.pages_of(r, group=name))) for r in rows)
        per_group.append((name, dataclasses.astuple(one.stats()), owned))
    return (pool_snapshot(pool), tuple(per_group))


class Broken:
    """A fence whose every query raises: it faults where it is first asked."""

    def query(self) -> bool:
        raise RuntimeError("transfer failed")

    def synchronize(self) -> None:
        raise RuntimeError("transfer failed")


# ---------------------------------------------------------------- the grant


async def test_grouped_extend_grows_each_named_group() -> None:
    pool = grouped()
    g = await pool.admit({"swa": 1, "full": 2})
    got = pool.extend(g.row, {"swa": 1, "full": 2})
    assert got is not None and list(got) == ["swa", "full"]
    assert len(got["swa"]) == 1 and len(got["full"]) == 2
    # Appended after the row's own pages, in each group's own record.
    assert ids(pool.pages_of(g.row, group="swa")) == ids(g.pages["swa"]) + ids(got["swa"])
    assert ids(pool.pages_of(g.row, group="full")) == ids(g.pages["full"]) + ids(got["full"])
    assert kv(pool, "swa").available_size() == 6 and kv(pool, "full").available_size() == 8
    # A group left out (or at 0) grows by nothing; the keys are the named groups.
    only = pool.extend(g.row, {"full": 1})
    assert only is not None and list(only) == ["full"]
    zero = pool.extend(g.row, {"swa": 0, "full": 1})
    assert zero is not None and len(zero["swa"]) == 0 and len(zero["full"]) == 1
    assert len(pool.pages_of(g.row, group="swa")) == 2
    assert len(pool.pages_of(g.row, group="full")) == 6
    assert pool.extend(g.row, {}) == {}
    pool.check_invariants()
    assert pool.free(g.row) == 1
    assert kv(pool, "swa").available_size() == 8 and kv(pool, "full").available_size() == 12
    pool.check_invariants()


async def test_grouped_extend_rows_gives_each_row_k_pages_in_each_group() -> None:
    pool = grouped()
    a = await pool.admit({"swa": 1, "full": 1})
    b = await pool.admit({"swa": 0, "full": 1})
    got = pool.extend_rows([a.row, b.row], {"swa": 1, "full": 2})
    assert got is not None
    assert got["swa"].shape == (2, 1) and got["full"].shape == (2, 2)
    assert ids(pool.pages_of(a.row, group="full"))[1:] == ids(got["full"][0])
    assert ids(pool.pages_of(b.row, group="full"))[1:] == ids(got["full"][1])
    assert ids(pool.pages_of(b.row, group="swa")) == ids(got["swa"][1])
    none = pool.extend_rows([], {"swa": 3})
    assert none is not None and none["swa"].shape == (0, 3)
    pool.check_invariants()
    pool.free([a.row, b.row])
    assert kv(pool, "swa").available_size() == 8 and kv(pool, "full").available_size() == 12


def assert_one_refusal_only(before: tuple[Any, ...], after: tuple[Any, ...], *short: str) -> None:
    """Between two :func:`snapshot` s one refused call was counted: once in
    the pool's figure (calls refused), and once in the own figure
    (``stats().kv_groups``) of each group in ``short`` (the groups it was
    short in) and no other; everything else is as it was."""
    after_stats, before_stats = after[0][0], before[0][0]
    assert after_stats["growth_refusals"] == before_stats["growth_refusals"] + 1
    after_stats["growth_refusals"] -= 1
    groups_after = {n: dict(g) for n, g in after_stats.pop("kv_groups").items()}
    groups_before = {n: dict(g) for n, g in before_stats.pop("kv_groups").items()}
    for group in short:
        assert (
            groups_after[group]["growth_refusals"] == groups_before[group]["growth_refusals"] + 1
        ), group
        groups_after[group]["growth_refusals"] -= 1
    assert groups_after == groups_before
    assert after == before


# ---------------------------------------------------------------- all or nothing


@pytest.mark.parametrize("call", ["extend", "extend_rows"])
async def test_short_in_the_second_group_takes_nothing_in_the_first(call: str) -> None:
    pool = grouped(swa=8, full=3)
    g = await pool.admit({"swa": 1, "full": 2})
    before = snapshot(pool)
    swa_free = kv(pool, "swa").available_size()
    if call == "extend":
        got = pool.extend(g.row, {"swa": 2, "full": 2})  # full has 1 free
    else:
        got = pool.extend_rows([g.row], {"swa": 2, "full": 2})
    assert got is None
    assert kv(pool, "swa").available_size() == swa_free  # the first group kept its pages
    assert_one_refusal_only(before, snapshot(pool), "full")
    pool.check_invariants()
    pool.free(g.row)


@pytest.mark.parametrize("call", ["extend", "extend_rows", "extend_fitting"])
async def test_a_call_short_in_both_groups_counts_in_each_and_once_in_all(call: str) -> None:
    """A grouped growth short in two groups is one refused call: the pool's
    ``growth_refusals`` (calls refused) counts it once, and each group's own
    figure counts it, so a dashboard per group shows every group that ran
    short. Only the first short group counted it before (full's figure
    stayed 0 however often it was short too)."""
    pool = grouped(rows=2, swa=3, full=3)
    a = await pool.admit({"swa": 1, "full": 1})
    b = await pool.admit({"swa": 1, "full": 1})  # 1 page left in each group
    before = snapshot(pool)
    if call == "extend":
        assert pool.extend(a.row, {"swa": 2, "full": 2}) is None
    elif call == "extend_rows":
        assert pool.extend_rows([a.row, b.row], {"swa": 1, "full": 1}) is None
    else:
        m, got = pool.extend_fitting([a.row, b.row], {"swa": 2, "full": 2})
        assert m == 0 and got["swa"].shape == (0, 2) and got["full"].shape == (0, 2)
    assert_one_refusal_only(before, snapshot(pool), "swa", "full")
    st = pool.stats()
    assert st.growth_refusals == 1
    assert [g.growth_refusals for g in st.kv_groups.values()] == [1, 1]
    pool.check_invariants()
    pool.free([a.row, b.row])


@pytest.mark.parametrize("short", ["swa", "full"])
@pytest.mark.parametrize("call", ["extend", "extend_rows", "extend_fitting"])
async def test_a_call_short_in_one_group_counts_only_there(call: str, short: str) -> None:
    """Short in one group (the first or the second in the pool's order):
    that group counts the call, the other does not, the pool once."""
    pool = grouped(rows=2, swa=4, full=4)
    a = await pool.admit({"swa": 1, "full": 1})
    b = await pool.admit({"swa": 1, "full": 1})  # 2 pages left in each group
    counts = {"swa": 1, "full": 1}
    counts[short] = 2  # 2 pages a row for two rows: 4, and 2 are free
    before = snapshot(pool)
    if call == "extend":
        assert pool.extend(a.row, counts | {short: 3}) is None
    elif call == "extend_rows":
        assert pool.extend_rows([a.row, b.row], counts) is None
    else:
        m, _ = pool.extend_fitting([a.row, b.row], counts)
        assert m == 1  # the short group stops the run after one row
    st = pool.stats()
    if call != "extend_fitting":
        assert_one_refusal_only(before, snapshot(pool), short)
    other = "full" if short == "swa" else "swa"
    assert st.growth_refusals == 1
    assert (st.kv_groups[short].growth_refusals, st.kv_groups[other].growth_refusals) == (1, 0)
    pool.check_invariants()
    pool.free([a.row, b.row])


async def test_extend_fitting_counts_a_short_group_that_did_not_stop_the_run() -> None:
    """``extend_fitting``: every group that cannot cover all the rows given
    counts the call, not only the one that stopped the run shortest (swa
    covers one of three rows, full two: both short, one call)."""
    pool = grouped(rows=3, swa=4, full=5)
    grants = [await pool.admit({"swa": 1, "full": 1}) for _ in range(3)]
    rows = [g.row for g in grants]  # 1 swa page and 2 full pages left
    m, got = pool.extend_fitting(rows, {"swa": 1, "full": 1})
    assert m == 1 and got["full"].shape == (1, 1)
    st = pool.stats()
    assert st.growth_refusals == 1
    assert {n: g.growth_refusals for n, g in st.kv_groups.items()} == {"swa": 1, "full": 1}
    pool.check_invariants()
    pool.free(rows)


async def test_metrics_count_each_short_group_and_the_call_once() -> None:
    """The per-group counter ``asyncpool_kv_group_growth_refusals_total``
    counts the call in both short groups; ``asyncpool_growth_refusals_total``
    once."""
    pytest.importorskip("prometheus_client")
    from asyncpool.metrics import PoolCollector

    pool = grouped(rows=1, swa=1, full=1)
    g = await pool.admit({"swa": 1, "full": 1})
    assert pool.extend(g.row, {"swa": 1, "full": 1}) is None
    samples = {
        (s.name, s.labels.get("group")): s.value
        for fam in PoolCollector(pool, name="p").collect()
        for s in fam.samples
        if "growth_refusals" in s.name
    }
    assert samples == {
        ("asyncpool_growth_refusals_total", None): 1.0,
        ("asyncpool_kv_group_growth_refusals_total", "swa"): 1.0,
        ("asyncpool_kv_group_growth_refusals_total", "full"): 1.0,
    }
    pool.free(g.row)


async def test_fenced_pages_in_one_group_are_not_free_until_reclaimed(kit: Streams) -> None:
    pool = grouped(swa=8, full=4)
    stream = kit.stream()
    gate = kit.gate(stream)  # the step's fence stays open until the gate opens
    done = await pool.admit({"swa": 1, "full": 3})
    g = await pool.admit({"swa": 1, "full": 1})
    pool.free(done.row, fence=stream.record())  # 3 full pages pending
    assert kv(pool, "full").available_size() == 0
    assert pool.extend(g.row, {"swa": 1, "full": 1}) is None  # pending is not free
    assert kv(pool, "swa").available_size() == 6
    gate.open()
    stream.synchronize()  # the fence completed; nobody has reclaimed yet
    assert kv(pool, "full").pending_size() == 3
    got = pool.extend(g.row, {"swa": 1, "full": 1})  # the short group reclaims first
    assert got is not None and len(got["full"]) == 1
    assert kv(pool, "full").available_size() == 2
    pool.check_invariants()
    pool.free(g.row)


async def test_grouped_growth_is_freed_behind_the_rows_recorded_use(kit: Streams) -> None:
    pool = grouped()
    stream = kit.stream()
    gate = kit.gate(stream)
    g = await pool.admit({"swa": 1, "full": 1})
    got = pool.extend(g.row, {"swa": 2, "full": 3})
    assert got is not None
    pool.record_use([g.row], stream.record())  # the step in flight reads every page
    assert pool.free(g.row) == 0
    st = pool.stats()
    assert st.pages_pending == 7 and st.pages_allocated == 0  # nothing free early
    assert kv(pool, "swa").pending_size() == 3 and kv(pool, "full").pending_size() == 4
    gate.open()
    stream.synchronize()
    pool.reclaim()
    assert kv(pool, "swa").available_size() == 8 and kv(pool, "full").available_size() == 12
    pool.check_invariants()


async def test_grouped_growth_takes_free_pages_while_admissions_queue() -> None:
    pool = grouped(swa=8, full=4)
    held = await pool.admit({"swa": 1, "full": 2})
    waiter = asyncio.ensure_future(pool.admit({"swa": 1, "full": 4}))  # 2 full free
    await spin()
    assert pool.waiting() == 1
    # As extend: growth takes what is free though an admission queues.
    got = pool.extend(held.row, {"swa": 1, "full": 1})
    assert got is not None
    assert pool.waiting() == 1 and kv(pool, "full").available_size() == 1
    pool.free(held.row)  # 4 full pages back: the queued admission is granted
    async with bounded():
        grant = await waiter
    assert len(grant.pages["full"]) == 4
    pool.free(grant.row)
    pool.check_invariants()


async def test_pages_a_growths_reclaim_finds_beyond_its_need_go_to_the_waiter(
    kit: Streams,
) -> None:
    pool = grouped(swa=8, full=4)
    stream = kit.stream()
    gate = kit.gate(stream)
    done = await pool.admit({"swa": 0, "full": 4})
    g = await pool.admit({"swa": 1, "full": 0})
    pool.free(done.row, fence=stream.record())
    waiter = asyncio.ensure_future(pool.admit({"swa": 1, "full": 3}))
    await spin()
    assert pool.waiting() == 1
    gate.open()
    stream.synchronize()  # completed; the pool's wake-up has not run yet
    got = pool.extend(g.row, {"swa": 1, "full": 1})  # reclaims 4, takes 1
    assert got is not None
    # The grant loop ran after the growth: the waiter holds the other 3.
    assert pool.waiting() == 0
    async with bounded():
        grant = await waiter
    assert len(grant.pages["full"]) == 3
    pool.free([g.row, grant.row])
    pool.check_invariants()


async def test_grouped_growth_while_released_or_closed() -> None:
    pool = grouped()
    await pool.release_memory()
    before = snapshot(pool)
    assert pool.extend_rows([], {"swa": 1}) is None
    assert snapshot(pool) == before
    await pool.resume_memory()
    g = await pool.admit({"swa": 1, "full": 1})
    await pool.close()
    before = snapshot(pool)
    with pytest.raises(PoolClosedError):
        pool.extend(g.row, {"swa": 1})
    with pytest.raises(PoolClosedError):
        pool.extend_rows([g.row], {"swa": 1})
    assert snapshot(pool) == before


# ---------------------------------------------------------------- bad input

_BAD = [
    ({"mamba": 1}, ValueError, "unknown KV group 'mamba'"),
    ({"swa": 1, 3: 1}, ValueError, "unknown KV group"),
    ({"swa": -1}, CapacityError, "KV group 'swa'"),
    ({"swa": 1, "full": 1.5}, CapacityError, "KV group 'full'"),
    ({"swa": True}, CapacityError, "KV group 'swa'"),
    ({"swa": 9}, CapacityError, "KV group 'swa'"),
    ({"full": torch.tensor([1, 1])}, CapacityError, "KV group 'full'"),
    ({"full": [1, 1]}, CapacityError, "KV group 'full'"),
]


@pytest.mark.parametrize("call", ["extend", "extend_rows"])
@pytest.mark.parametrize(("counts", "error", "match"), _BAD)
async def test_bad_grouped_growth_changes_nothing(
    call: str, counts: Any, error: type, match: str
) -> None:
    pool = grouped()
    g = await pool.admit({"swa": 1, "full": 2})
    before = snapshot(pool)
    with pytest.raises(error, match=match):
        if call == "extend":
            pool.extend(g.row, counts)
        else:
            pool.extend_rows([g.row], counts)
    assert snapshot(pool) == before
    pool.free(g.row)


async def test_grouped_growth_refuses_bad_rows_and_group_with_a_mapping() -> None:
    pool = grouped(swa=3)
    g = await pool.admit({"swa": 1, "full": 2})
    other = await pool.admit({"swa": 0, "full": 0})
    before = snapshot(pool)
    with pytest.raises(ValueError, match="give one or the other"):
        pool.extend(g.row, {"swa": 1}, group="swa")  # type: ignore[call-overload]
    with pytest.raises(ValueError, match="give one or the other"):
        pool.extend_rows([g.row], {"swa": 1}, group="full")  # type: ignore[call-overload]
    with pytest.raises(InvalidSlotError):
        pool.extend(3, {"swa": 1})  # not allocated
    with pytest.raises(InvalidSlotError):
        pool.extend_rows([g.row, g.row], {"swa": 1})  # not distinct
    with pytest.raises(CapacityError, match="KV group 'swa'"):
        pool.extend_rows([g.row, other.row], {"swa": 2, "full": 1})  # 4 swa pages > 3
    with pytest.raises(ValueError, match="give one or the other"):
        pool.extend_fitting([g.row], {"swa": 1}, group="swa")  # type: ignore[call-overload]
    assert snapshot(pool) == before
    pool.free([g.row, other.row])


@pytest.mark.parametrize("call", ["extend", "extend_rows", "extend_fitting"])
async def test_a_mapping_on_a_single_kv_pool_names_the_rule(call: str) -> None:
    pool = AsyncReqToTokenPool(5, 64, kv=KVPagePool(9, 4))
    g = await pool.admit(1)
    before = pool_snapshot(pool)
    with pytest.raises(ValueError, match="one KV page pool and no KV groups"):
        getattr(pool, call)(g.row if call == "extend" else [g.row], {"kv": 1})
    assert pool_snapshot(pool) == before
    pool.free(g.row)


async def test_a_mapping_on_a_pool_without_kv_is_a_capacity_error() -> None:
    pool = AsyncReqToTokenPool(5, 64)
    rows = await pool.alloc(1)
    before = pool_snapshot(pool)
    with pytest.raises(CapacityError, match="no KV pages"):
        pool.extend(rows[0], {"swa": 1})
    with pytest.raises(CapacityError, match="no KV pages"):
        pool.extend_rows(rows, {"swa": 1})
    assert pool_snapshot(pool) == before


# ---------------------------------------------------------------- page_fence_errors


async def test_a_fence_faulting_in_two_groups_counts_once() -> None:
    pool = grouped()
    g = await pool.admit({"swa": 1, "full": 2})
    pool.free(g.row, fence=Broken())  # row, swa and full pages quarantined
    st = pool.stats()
    assert st.pages_quarantined == 3
    assert (st.fence_errors, st.page_fence_errors) == (1, 1)
    # Each group still counts it in its own figures.
    assert kv(pool, "swa").stats().fence_errors == 1
    assert kv(pool, "full").stats().fence_errors == 1
    # Another fence, in one group only: one more.
    h = await pool.admit({"swa": 0, "full": 1})
    pool.free(h.row, fence=Broken())
    assert pool.stats().page_fence_errors == 2
    # A fence that faulted holding swa pages, met later by the full group
    # (a caller's kv.free behind it, in another call): still one fence.
    transfer = Broken()
    k = await pool.admit({"swa": 1, "full": 0})
    pool.free(k.row, fence=transfer)
    assert pool.stats().page_fence_errors == 3
    m = await pool.admit({"swa": 0, "full": 1})
    pages = pool.detach_pages(m.row, group="full", host=True)
    pool.free(m.row)
    kv(pool, "full").free(pages, fence=transfer)
    assert kv(pool, "full").stats().fence_errors == 3  # the group counts it
    assert pool.stats().page_fence_errors == 3  # the pool does not count it again
    pool.check_invariants()


# ---------------------------------------------------------------- messages


async def test_queue_messages_name_the_groups() -> None:
    pool = grouped(full=2, max_waiters=1)
    held = await pool.admit({"swa": 0, "full": 2})
    with pytest.raises(TimeoutError) as timed_out:
        async with bounded():
            await pool.admit({"swa": 2, "full": 1}, timeout=0.01)
    text = str(timed_out.value)
    assert "admit(pages={'swa': 2, 'full': 1})" in text
    assert "1 row and 2 pages of 'swa', 1 page of 'full'" in text
    queued = asyncio.ensure_future(pool.admit({"swa": 0, "full": 1}))
    await spin()
    with pytest.raises(PoolBusyError, match=r"refusing to queue admit\(pages=\{'swa': 3, 'full'"):
        await pool.admit({"swa": 3, "full": 2})
    pool.free(held.row)
    async with bounded():
        grant = await queued
    pool.free(grant.row)


# ---------------------------------------------------------------- extend_fitting by group


async def test_extend_fitting_by_group_grows_the_run_every_group_covers() -> None:
    """``extend_fitting(rows, {group: k})`` grows ``rows[:m]`` in every named
    group for the largest ``m`` that each group's free pages cover: here
    the swa group (3 free, 2 pages a row) stops the run at one row; the
    refusal is counted on it, and the full group gave only ``m`` rows'
    pages."""
    pool = grouped(rows=4, swa=7, full=12)
    grants = [await pool.admit({"swa": 1, "full": 1}) for _ in range(4)]
    rows = [g.row for g in grants]
    full_free = kv(pool, "full").available_size()  # 8
    m, got = pool.extend_fitting(rows, {"swa": 2, "full": 1})  # swa: 3 free -> 1 row
    assert m == 1
    assert set(got) == {"swa", "full"}
    assert got["swa"].shape == (1, 2) and got["full"].shape == (1, 1)
    assert kv(pool, "full").available_size() == full_free - 1
    assert kv(pool, "swa").available_size() == 1
    assert ids(pool.pages_of(rows[0], group="swa"))[1:] == ids(got["swa"][0])
    assert ids(pool.pages_of(rows[0], group="full"))[1:] == ids(got["full"][0])
    assert all(len(pool.pages_of(r, group="swa")) == 1 for r in rows[1:])
    groups = pool.stats().kv_groups
    assert groups["swa"].growth_refusals == 1 and groups["full"].growth_refusals == 0
    assert pool.stats().growth_refusals == 1
    m, got = pool.extend_fitting(rows[1:], {"full": 2})  # a group left out grows nothing
    assert m == 3 and set(got) == {"full"} and got["full"].shape == (3, 2)
    pool.check_invariants()
    pool.free(rows)
    assert kv(pool, "swa").available_size() == 7 and kv(pool, "full").available_size() == 12


async def test_extend_fitting_by_group_when_every_row_fits_and_when_none_does() -> None:
    pool = grouped(rows=2, swa=8, full=4)
    a = await pool.admit({"swa": 1, "full": 1})
    b = await pool.admit({"swa": 1, "full": 1})
    m, got = pool.extend_fitting([b.row, a.row], {"swa": 1, "full": 1})
    assert m == 2 and got["swa"].shape == (2, 1)
    assert ids(pool.pages_of(b.row, group="full"))[1:] == ids(got["full"][0])
    assert pool.stats().growth_refusals == 0
    before = snapshot(pool)
    m, got = pool.extend_fitting([a.row, b.row], {"swa": 1, "full": 3})  # full: 0 free
    assert m == 0 and got["swa"].shape == (0, 1) and got["full"].shape == (0, 3)
    assert_one_refusal_only(before, snapshot(pool), "full")
    pool.free([a.row, b.row])


async def test_extend_fitting_by_group_reclaims_a_short_groups_completed_fences(
    kit: Streams,
) -> None:
    """The short group reclaims its completed fences before the run is
    measured, and the waiters get what the growth leaves."""
    pool = grouped(rows=3, swa=4, full=8)
    a = await pool.admit({"swa": 2, "full": 1})
    b = await pool.admit({"swa": 2, "full": 1})
    stream = kit.stream()
    gate = kit.gate(stream)  # the step's fence stays open until the gate opens
    pool.free([b.row], fence=stream.record())  # b's swa pages pending behind it
    assert kv(pool, "swa").available_size() == 0
    m, _ = pool.extend_fitting([a.row], {"swa": 1, "full": 1})
    assert m == 0  # pending is not free
    gate.open()
    stream.synchronize()  # the fence completed; nobody has reclaimed yet
    assert kv(pool, "swa").pending_size() == 2
    m, got = pool.extend_fitting([a.row], {"swa": 1, "full": 1})
    assert m == 1 and got["swa"].shape == (1, 1)
    assert kv(pool, "swa").available_size() == 1
    pool.free([a.row])
    pool.check_invariants()


async def test_extend_fitting_by_group_refuses_bad_input_changing_nothing() -> None:
    pool = grouped(rows=3, swa=4, full=4)
    g = await pool.admit({"swa": 1, "full": 1})
    other = await pool.admit({"swa": 1, "full": 1})
    before = snapshot(pool)
    with pytest.raises(ValueError, match="unknown KV group"):
        pool.extend_fitting([g.row], {"mla": 1})
    with pytest.raises(CapacityError, match="KV group 'swa'"):
        pool.extend_fitting([g.row], {"swa": -1})
    with pytest.raises(CapacityError, match="KV group 'full'"):
        pool.extend_fitting([g.row], {"full": 1.0})
    with pytest.raises(InvalidSlotError):
        pool.extend_fitting({g.row, other.row}, {"swa": 1})  # a set has no order
    with pytest.raises(InvalidSlotError):
        pool.extend_fitting([g.row, 3], {"swa": 1})  # 3 is not allocated
    assert snapshot(pool) == before
    pool.free([other.row])
    await pool.close()
    with pytest.raises(PoolClosedError):
        pool.extend_fitting([g.row], {"swa": 1})
