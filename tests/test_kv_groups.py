"""KV groups: ``kv=`` as a mapping of page pools, admitted with the row atomically.

A hybrid model's request needs its row plus pages from two or more page
pools (sliding-window and full attention layers; a Mamba state slot as a
``KVPagePool(n, 1)`` admitted with a count of 1). These tests cover the
constructor's checks, the grouped ``admit``/``try_admit`` forms and their
bad input (typed errors, the pool exactly unchanged), ``group=`` on the
per-row page calls, and an audit that runs every public method of the pool
on a grouped pool with ``check_invariants()`` after each, so a site that
still reads "the one kv" shows. Admission order, fences, cancellation and
lifecycle across groups: tests/test_kv_groups_admission.py.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import inspect
import pickle
from typing import Any

import numpy as np
import pytest
import torch
from helpers import FakeStream, Streams, bounded, pool_snapshot, spin, unfittable_apart
from helpers import grouped_pool as grouped

from asyncpool import (
    AsyncReqToTokenPool,
    CapacityError,
    Grant,
    GroupGrant,
    HostStream,
    KVGroupStats,
    KVPagePool,
    KVPageStats,
    LatencySummary,
    PoolBusyError,
    ReqToTokenPool,
)
from asyncpool.metrics import PoolCollector
from asyncpool.pool import MAX_KV_GROUPS


def groups_of(pool: AsyncReqToTokenPool) -> dict[str, KVPagePool]:
    groups = pool.kv_groups
    assert groups is not None
    return dict(groups)


def snapshot(pool: AsyncReqToTokenPool) -> tuple[Any, ...]:
    """Everything a refused call must leave as it was: the pool's stats and
    ledger, every group's page stats, and every row's pages in every group."""
    rows = pool._ledger.allocated_rows()
    per_group = []
    for name, kv in (pool.kv_groups or {}).items():
        kv.check_invariants()
        owned = tuple(tuple(pool.pages_of(r, group=name).tolist()) for r in rows)
        per_group.append((name, dataclasses.astuple(kv.stats()), owned))
    return (pool_snapshot(pool), tuple(per_group))


def counted_apart(snap: tuple[Any, ...]) -> tuple[Any, ...]:
    """A :func:`snapshot` as its count of calls that can never be served
    (see ``helpers.unfittable_apart``) and the rest of it."""
    counted, rest = unfittable_apart(snap[0])
    return counted, (rest, snap[1])


def ids(t: torch.Tensor) -> list[int]:
    out: list[int] = t.tolist()
    return out


# ---------------------------------------------------------------- building


def test_kv_groups_and_kv_on_each_kind_of_pool() -> None:
    a, b = KVPagePool(5, 4), KVPagePool(3, 1)
    pool = AsyncReqToTokenPool(4, 8, kv={"swa": a, "mamba": b})
    groups = pool.kv_groups
    assert groups is not None and list(groups) == ["swa", "mamba"]
    assert groups["swa"] is a and groups["mamba"] is b
    assert pool.kv is None  # no group is "the" page pool
    with pytest.raises(TypeError):
        groups["x"] = a  # type: ignore[index]
    single = AsyncReqToTokenPool(4, 8, kv=KVPagePool(5, 4))
    assert single.kv_groups is None and single.kv is not None
    assert AsyncReqToTokenPool(4, 8).kv_groups is None


def _served() -> KVPagePool:
    kv = KVPagePool(5, 4)
    AsyncReqToTokenPool(2, 8, kv=kv)
    return kv


def _auto_with_pending(stream: HostStream) -> KVPagePool:
    kv = KVPagePool(5, 4)
    pages = kv.alloc(1)
    assert pages is not None
    kv.free(pages, fence=stream.record())
    return kv


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: {"a": object()}, TypeError, "must be a KVPagePool"),
        (lambda: {1: KVPagePool(5, 4)}, TypeError, "group name"),
        (lambda: {None: KVPagePool(5, 4)}, TypeError, "group name"),
        (lambda: {"": KVPagePool(5, 4)}, ValueError, "group name"),
        (lambda: {"a\nb": KVPagePool(5, 4)}, ValueError, "group name"),
        (lambda: {"x" * 65: KVPagePool(5, 4)}, ValueError, "group name"),
        (lambda: {}, ValueError, "1 to 4 groups"),
        (
            lambda: {f"g{i}": KVPagePool(3, 1) for i in range(MAX_KV_GROUPS + 1)},
            ValueError,
            "1 to 4 groups",
        ),
        (lambda: {"a": _served()}, ValueError, "already serves a pool"),
        (
            lambda: {"a": KVPagePool(5, 4), "b": KVPagePool(5, 4, reclaim="explicit")},
            ValueError,
            'reclaim="explicit"',
        ),
        (lambda: [KVPagePool(5, 4)], TypeError, "must be a KVPagePool"),
    ],
)
def test_constructor_refusals_build_nothing(make: Any, error: type, match: str) -> None:
    kv = make()
    pools = [p for p in (kv.values() if isinstance(kv, dict) else kv) if isinstance(p, KVPagePool)]
    hooked = [p.ledger._on_pending is not None for p in pools]
    with pytest.raises(error, match=match):
        AsyncReqToTokenPool(4, 8, kv=kv)
    # Nothing built: no page pool was claimed by a pool that does not exist.
    assert [p.ledger._on_pending is not None for p in pools] == hooked


def test_the_same_page_pool_twice_is_refused() -> None:
    kv = KVPagePool(5, 4)
    with pytest.raises(ValueError, match="same KVPagePool"):
        AsyncReqToTokenPool(4, 8, kv={"a": kv, "b": kv})
    assert kv.ledger._on_pending is None
    AsyncReqToTokenPool(4, 8, kv={"a": kv})  # still free to serve a pool


def test_explicit_pool_refuses_an_auto_group_with_pending_pages(kit: Streams) -> None:
    stream = kit.stream()
    kit.gate(stream)  # the fence below stays open
    busy = _auto_with_pending(stream)
    assert busy.pending_size() == 1
    fresh = KVPagePool(5, 4)
    with pytest.raises(ValueError, match="pages behind fences"):
        AsyncReqToTokenPool(4, 8, kv={"a": fresh, "b": busy}, reclaim="explicit")
    assert not fresh.ledger.explicit  # nothing switched
    assert fresh.ledger._on_pending is None


def test_explicit_pool_switches_every_fresh_group() -> None:
    a, b = KVPagePool(5, 4), KVPagePool(5, 4)
    AsyncReqToTokenPool(4, 8, kv={"a": a, "b": b}, reclaim="explicit")
    assert a.ledger.explicit and b.ledger.explicit


# ---------------------------------------------------------------- admission forms


async def test_grouped_admit_grants_a_row_and_each_groups_pages() -> None:
    pool = grouped()
    kv = groups_of(pool)
    g = await pool.admit({"swa": 3, "full": 5})
    assert isinstance(g, GroupGrant) and not isinstance(g, Grant)
    row, pages = g
    assert set(pages) == {"swa", "full"}
    assert len(pages["swa"]) == 3 and len(pages["full"]) == 5
    assert ids(pool.pages_of(row, group="swa")) == ids(pages["swa"])
    assert ids(pool.pages_of(row, group="full")) == ids(pages["full"])
    assert kv["swa"].available_size() == 5 and kv["full"].available_size() == 7
    zero = pool.try_admit({"swa": 0, "full": 1})
    assert zero is not None and len(zero.pages["swa"]) == 0
    pool.check_invariants()
    assert pool.free([row, zero.row]) == 2
    assert kv["swa"].available_size() == 8 and kv["full"].available_size() == 12
    pool.check_invariants()


async def test_short_in_one_group_takes_nothing_anywhere() -> None:
    pool = grouped(swa=2, full=12)
    held = pool.try_admit({"swa": 2, "full": 1})
    assert held is not None
    before = snapshot(pool)
    assert pool.try_admit({"swa": 1, "full": 1}) is None  # swa is short
    assert snapshot(pool) == before  # no row, no full page taken
    pool.free(held.row)


@pytest.mark.parametrize(
    ("pages", "error", "match"),
    [
        (2, ValueError, "KV groups"),
        (np.int64(2), ValueError, "KV groups"),
        (torch.tensor(2), ValueError, "KV groups"),
        ([2, 2], ValueError, "KV groups"),
        ({"swa": 1}, ValueError, "no count for KV group 'full'"),
        ({"swa": 1, "full": 1, "mamba": 1}, ValueError, "unknown KV group"),
        ({"swa": 1, "full": 1, 3: 1}, ValueError, "unknown KV group"),
        ({"swa": -1, "full": 1}, CapacityError, "KV group 'swa'"),
        ({"swa": 1.5, "full": 1}, CapacityError, "KV group 'swa'"),
        ({"swa": True, "full": 1}, CapacityError, "KV group 'swa'"),
        ({"swa": 9, "full": 1}, CapacityError, "KV group 'swa'"),
        ({"swa": 1, "full": 13}, CapacityError, "KV group 'full'"),
        ({"swa": 1, "full": torch.tensor([1])}, CapacityError, "KV group 'full'"),
    ],
)
async def test_bad_grouped_counts_change_nothing(pages: Any, error: type, match: str) -> None:
    pool = grouped()
    held = await pool.admit({"swa": 1, "full": 2})
    before = counted_apart(snapshot(pool))
    # A count past its group's pages: the admit can never be served, and
    # counts so (not the try_admit); any other bad count counts nothing.
    counted = (1, {0: 1}) if pages in ({"swa": 9, "full": 1}, {"swa": 1, "full": 13}) else (0, {})
    with pytest.raises(error, match=match):
        await pool.admit(pages)
    assert counted_apart(snapshot(pool)) == (counted, before[1])
    with pytest.raises(error, match=match):
        pool.try_admit(pages)
    assert counted_apart(snapshot(pool)) == (counted, before[1])
    pool.free(held.row)


@pytest.mark.parametrize("pages", [{"swa": 1}, {}, {"kv": 1}])
async def test_a_mapping_on_a_single_kv_pool_is_a_value_error(pages: Any) -> None:
    pool = AsyncReqToTokenPool(5, 64, kv=KVPagePool(9, 4))
    before = pool_snapshot(pool)
    with pytest.raises(ValueError, match="no KV groups"):
        await pool.admit(pages)
    with pytest.raises(ValueError, match="no KV groups"):
        pool.try_admit(pages)
    assert pool_snapshot(pool) == before


async def test_a_mapping_on_a_pool_without_kv_is_a_capacity_error() -> None:
    pool = AsyncReqToTokenPool(5, 64)
    with pytest.raises(CapacityError, match="no KV pages"):
        await pool.admit({"swa": 1})


async def test_grouped_admit_checks_priority_and_timeout() -> None:
    pool = grouped()
    before = snapshot(pool)
    with pytest.raises(TypeError):
        await pool.admit({"swa": 1, "full": 1}, priority=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        await pool.admit({"swa": 1, "full": 1}, timeout=-1)
    assert snapshot(pool) == before


async def test_quarantine_that_makes_a_group_unfittable_refuses_at_once() -> None:
    pool = grouped(swa=2)
    g = await pool.admit({"swa": 2, "full": 0})

    class Broken:
        def query(self) -> bool:
            raise RuntimeError("transfer failed")

        def synchronize(self) -> None:
            raise RuntimeError("transfer failed")

    pool.free(g.row, fence=Broken())  # quarantined at once: row and swa pages
    assert pool.stats().pages_quarantined == 2
    before = counted_apart(snapshot(pool))
    with pytest.raises(CapacityError, match="KV group 'swa'"):
        async with bounded():
            await pool.admit({"swa": 1, "full": 1})
    assert counted_apart(snapshot(pool)) == ((1, {0: 1}), before[1])  # counted, nothing else
    other = await pool.admit({"swa": 0, "full": 1})  # another still fits
    pool.free(other.row)


# ---------------------------------------------------------------- group=

_GROUP_CALLS = [
    ("pages_of", lambda p, r, **g: p.pages_of(r, **g)),
    ("detach_pages", lambda p, r, **g: p.detach_pages(r, **g)),
    ("extend", lambda p, r, **g: p.extend(r, 1, **g)),
    ("extend_rows", lambda p, r, **g: p.extend_rows([r], 1, **g)),
    ("extend_rows each", lambda p, r, **g: p.extend_rows([r], [1], **g)),
    ("extend_fitting", lambda p, r, **g: p.extend_fitting([r], 1, **g)),
    ("trim_pages", lambda p, r, **g: p.trim_pages([r], 0, **g)),
    ("pages_short", lambda p, r, **g: p.pages_short(**g)),
]


@pytest.mark.parametrize(("name", "call"), _GROUP_CALLS, ids=[c[0] for c in _GROUP_CALLS])
@pytest.mark.parametrize(
    ("kind", "group", "match"),
    [
        ("grouped", None, "name one with group="),
        ("grouped", "mamba", "unknown KV group"),
        ("grouped", 1, "unknown KV group"),
        ("single", "swa", "this pool has none"),
        ("rows", "swa", "this pool has none"),
    ],
)
async def test_group_misuse_is_a_value_error_changing_nothing(
    name: str, call: Any, kind: str, group: Any, match: str
) -> None:
    if kind == "grouped":
        pool = grouped()
        row = (await pool.admit({"swa": 2, "full": 2})).row
    elif kind == "single":
        pool = AsyncReqToTokenPool(5, 64, kv=KVPagePool(9, 4))
        row = (await pool.admit(2)).row
    else:
        pool = AsyncReqToTokenPool(5, 64)
        row = (await pool.alloc(1))[0]
    before = snapshot(pool)
    with pytest.raises(ValueError, match=match):
        call(pool, row, group=group)
    assert snapshot(pool) == before


async def test_group_calls_act_on_their_group_only() -> None:
    pool = grouped()
    kv = groups_of(pool)
    g = await pool.admit({"swa": 2, "full": 3})
    row = g.row
    new = pool.extend(row, 2, group="full")
    assert new is not None and len(new) == 2
    assert len(pool.pages_of(row, group="full")) == 5
    assert len(pool.pages_of(row, group="swa")) == 2
    lines = pool.extend_rows([row], 1, group="swa")
    assert lines is not None and lines.shape == (1, 1)
    m, grown = pool.extend_fitting([row], 1, group="swa")
    assert m == 1 and grown.shape == (1, 1)
    assert len(pool.pages_of(row, group="swa")) == 4
    assert pool.trim_pages([row], 1, group="swa") == 3
    assert len(pool.pages_of(row, group="swa")) == 1
    assert len(pool.pages_of(row, group="full")) == 5
    pool.check_invariants()
    # extend within the group's own capacity, not the sum
    with pytest.raises(CapacityError):
        pool.extend(row, 9, group="swa")
    assert pool.extend(row, 8, group="swa") is None  # 7 free: a refusal
    assert pool.stats().growth_refusals == 1
    detached = pool.detach_pages(row, group="full", host=True)
    assert len(detached) == 5 and len(pool.pages_of(row, group="full")) == 0
    assert pool.free(row) == 1  # swa's page goes with the row
    assert kv["swa"].available_size() == 8
    assert kv["full"].available_size() == 7
    kv["full"].free(detached)
    assert kv["full"].available_size() == 12
    pool.check_invariants()


# ---------------------------------------------------------------- stats, metrics


async def test_stats_sum_the_groups_and_metrics_follow() -> None:
    pool = grouped(swa=8, full=12)
    st = pool.stats()
    assert (st.pages_capacity, st.pages_free, st.pages_allocated) == (20, 20, 0)
    g = await pool.admit({"swa": 3, "full": 4})
    assert pool.try_admit({"swa": 6, "full": 0}) is None  # swa short
    st = pool.stats()
    assert (st.pages_free, st.pages_allocated, st.admits) == (13, 7, 1)
    assert st.pages_free + st.pages_allocated + st.pages_pending + st.pages_quarantined == 20
    collector = PoolCollector()
    collector.add(pool, name="hybrid")
    samples = {
        s.name: s.value for fam in collector.collect() for s in fam.samples if "pages" in s.name
    }
    assert samples["asyncpool_capacity_pages"] == 20
    assert samples["asyncpool_allocated_pages"] == 7
    pool.free(g.row)
    assert pool.stats().pages_free == 20


async def test_stats_show_each_groups_own_figures() -> None:
    """``stats().kv_groups``: each group's own figures (its ``kv.stats()``)
    and growth refusals, so a starving group shows (swa out of pages, with
    a fault and a retraction, while full attention idles); the page sums
    are the groups' sums. Only the sums were there."""
    pool = grouped(swa=6, full=12)
    kv = groups_of(pool)
    bad, slow = FakeStream(), FakeStream()
    g1 = await pool.admit({"swa": 2, "full": 1})
    fault = bad.record()
    bad.fault()
    kv["swa"].free(pool.detach_pages(g1.row, group="swa"), fence=fault)  # quarantined
    kv["full"].free(pool.detach_pages(g1.row, group="full"), fence=slow.record())  # pending
    g2 = await pool.admit({"swa": 4, "full": 3})  # every usable swa page
    assert pool.extend(g2.row, 1, group="swa") is None  # swa short: a retraction
    assert pool.extend(g2.row, 1, group="full") is not None
    st = pool.stats()
    assert list(st.kv_groups) == ["swa", "full"]  # the pool's group order
    swa, full = st.kv_groups["swa"], st.kv_groups["full"]
    assert isinstance(swa, KVGroupStats) and isinstance(swa, KVPageStats)
    figures = ("capacity", "free", "allocated", "pending", "quarantined", "fence_errors")
    assert [getattr(swa, f) for f in figures] == [6, 0, 4, 0, 2, 1]
    assert [getattr(full, f) for f in figures] == [12, 7, 4, 1, 0, 0]
    assert (swa.growth_refusals, full.growth_refusals) == (1, 0)
    assert (swa.peak_allocated, full.peak_allocated) == (4, 4)
    for name, one in st.kv_groups.items():  # every figure of the group's own stats()
        own = dataclasses.asdict(kv[name].stats())
        assert {k: v for k, v in dataclasses.asdict(one).items() if k in own} == own
    # The sums, as before, are the groups' sums.
    assert (st.pages_capacity, st.pages_free, st.pages_allocated) == (18, 7, 8)
    assert (st.pages_pending, st.pages_quarantined, st.page_fence_errors) == (1, 2, 1)
    assert st.growth_refusals == 1
    pool.check_invariants()
    slow.complete()
    assert kv["full"].reclaim() == 1
    pool.free([g1.row, g2.row])
    assert pool.stats().kv_groups["full"].free == 12


async def test_kv_groups_of_stats_is_a_read_only_snapshot() -> None:
    """The mapping refuses changes, and the snapshot still hashes, copies,
    pickles and turns into a dict (``dataclasses.asdict``)."""
    pool = grouped()
    g = await pool.admit({"swa": 1, "full": 2})
    st = pool.stats()
    groups = st.kv_groups
    for change in (
        lambda: groups.__setitem__("swa", groups["full"]),  # type: ignore[index]
        lambda: groups.__delitem__("swa"),  # type: ignore[attr-defined]
        lambda: groups.clear(),  # type: ignore[attr-defined]
        lambda: groups.update({}),  # type: ignore[attr-defined]
        lambda: groups.pop("swa"),  # type: ignore[attr-defined]
        lambda: groups.setdefault("x", groups["swa"]),  # type: ignore[attr-defined]
        lambda: groups.popitem(),  # type: ignore[attr-defined]
        lambda: groups.__ior__({}),  # type: ignore[attr-defined]
    ):
        with pytest.raises(TypeError, match="read-only"):
            change()
    assert list(groups) == ["swa", "full"]
    assert groups == {"swa": groups["swa"], "full": groups["full"]}
    assert hash(st) == hash(copy.deepcopy(st)) and copy.deepcopy(st) == st
    assert pickle.loads(pickle.dumps(st)) == st
    assert dataclasses.asdict(st)["kv_groups"]["full"]["allocated"] == 2
    pool.free(g.row)
    assert st.kv_groups["full"].allocated == 2  # a snapshot: the free did not reach it


async def test_pools_without_groups_have_no_group_figures() -> None:
    """A pool with one ``kv=`` or none has an empty ``kv_groups`` (its page
    figures are the ``pages_*`` ones): nothing to look up, nothing built."""
    single = AsyncReqToTokenPool(5, 8, kv=KVPagePool(9, 4))
    await single.admit(pages=3)
    for pool in (single, AsyncReqToTokenPool(5, 8), ReqToTokenPool(5, 8)):
        st = pool.stats()
        assert st.kv_groups == {} and not st.kv_groups
        assert pool.stats(summaries=False).kv_groups is st.kv_groups  # one shared empty
    assert single.stats().pages_allocated == 3


async def test_group_fence_latency_follows_summaries() -> None:
    """Each group's ``fence_latency`` window is summarised by ``stats()``
    and left empty by ``stats(summaries=False)`` (a scrape), every other
    figure the same."""
    pool = grouped()
    kv = groups_of(pool)
    stream = FakeStream()
    g = await pool.admit({"swa": 1, "full": 2})
    kv["full"].free(pool.detach_pages(g.row, group="full"), fence=stream.record())
    stream.complete()
    assert kv["full"].reclaim() == 2
    full, cheap = pool.stats(), pool.stats(summaries=False)
    assert full.kv_groups["full"].fence_latency.count == 1
    assert cheap.kv_groups["full"].fence_latency == LatencySummary()
    for name in ("swa", "full"):
        keep = dataclasses.replace(full.kv_groups[name], fence_latency=LatencySummary())
        assert keep == cheap.kv_groups[name]
    pool.free(g.row)


# ---------------------------------------------------------------- the audit

#: Every public method, and how the audit calls it on a grouped pool.
#: A public method missing here fails test_audit_covers_every_public_method.


def _fence(stream: HostStream) -> Any:
    return stream.record()


async def _audit_calls(pool: AsyncReqToTokenPool, stream: HostStream) -> dict[str, Any]:
    g = await pool.admit({"swa": 2, "full": 2})
    row = g.row

    async def lease() -> None:
        async with pool.lease(1) as rows:
            assert rows

    async def admit() -> None:
        other = await pool.admit({"swa": 1, "full": 1})
        pool.free(other.row)

    async def alloc() -> None:
        pool.free(await pool.alloc(1))

    async def admit_threadsafe() -> None:
        other = await asyncio.wrap_future(pool.admit_threadsafe({"swa": 1, "full": 1}))
        assert set(other.pages) == {"swa", "full"}
        pool.free([other.row])

    async def alloc_threadsafe() -> None:
        pool.free(await asyncio.wrap_future(pool.alloc_threadsafe(1)))

    def try_admit() -> None:
        other = pool.try_admit({"swa": 1, "full": 1})
        assert other is not None
        pool.free([other.row])

    def try_alloc() -> None:
        rows = pool.try_alloc(1)
        assert rows is not None
        pool.free(rows)

    def detach() -> None:
        other = pool.try_admit({"swa": 1, "full": 1})
        assert other is not None
        pages = pool.detach_pages(other.row, group="full")
        pool.free(other.row)
        groups_of(pool)["full"].free(pages)

    def free() -> None:
        other = pool.try_admit({"swa": 1, "full": 1})
        assert other is not None
        pool.record_use([other.row], _fence(stream))
        pool.free([other.row], fence=_fence(stream), after=stream)

    def force_release() -> None:
        other = pool.try_admit({"swa": 1, "full": 1})
        assert other is not None
        pool.free([other.row], fence=_fence(stream))
        pool.force_release(_fence(stream))

    async def release_resume() -> None:
        pool.free(row)
        await pool.drain(timeout=5)
        await pool.release_memory()
        await pool.resume_memory()

    def write() -> None:
        pool.write((row, slice(0, 2)), torch.tensor([1, 2], dtype=torch.int32))

    return {
        "admit": admit,
        "alloc": alloc,
        "lease": lease,
        "admit_threadsafe": admit_threadsafe,
        "alloc_threadsafe": alloc_threadsafe,
        "try_admit": try_admit,
        "try_alloc": try_alloc,
        "pages_of": lambda: pool.pages_of(row, group="swa"),
        "pages_of_rows": lambda: pool.pages_of_rows([row], group="full"),
        "extend": lambda: (pool.extend(row, 1, group="full"), pool.extend(row, {"swa": 1})),
        "extend_rows": lambda: (
            pool.extend_rows([row], 1, group="swa"),
            pool.extend_rows([row], {"swa": 1, "full": 1}),
        ),
        "extend_fitting": lambda: pool.extend_fitting([row], 1, group="full"),
        "trim_pages": lambda: (
            pool.trim_pages([row], 1, group="full"),
            pool.trim_pages([row], {"swa": 2, "full": 1}),
        ),
        "drop_pages": lambda: (
            pool.drop_pages([row], 1, group="swa"),
            pool.drop_pages([row], {"swa": 1}),
        ),
        "pages_dropped": lambda: pool.pages_dropped(row, group="swa"),
        "pages_short": lambda: pool.pages_short(group="swa"),
        "queue_head": pool.queue_head,
        "detach_pages": detach,
        "record_use": lambda: pool.record_use([row], _fence(stream)),
        "free": free,
        "force_release": force_release,
        "overdue_fences": pool.overdue_fences,
        "reclaim": pool.reclaim,
        "waiting": pool.waiting,
        "waiting_by_priority": pool.waiting_by_priority,
        "available_size": pool.available_size,
        "pending_size": pool.pending_size,
        "quarantined_size": pool.quarantined_size,
        "stats": pool.stats,
        "check_invariants": pool.check_invariants,
        "generation": lambda: pool.generation(row),
        # The seed's API: a row's lengths and slots, no page state
        # (tests/test_async_pool.py covers it).
        "set_req_pool_info": lambda: None,
        "write": write,
        "allocated_size": pool.allocated_size,
        "bind": lambda: None,  # needs nothing pending: run last (below)
        "hold_grants": lambda: pool.hold_grants().release(),
        "release_grant_holds": lambda: (pool.hold_grants(), pool.release_grant_holds()),
        "retire": lambda: _refused(pool.retire, _fence(stream)),  # auto: RuntimeError
        "agree": lambda: _refused(pool.agree),
        "forget_stream": lambda: _refused(pool.forget_stream, _fence(stream).stream_key),
        "drain": lambda: pool.drain(timeout=5),
        "release_memory": release_resume,
        "resume_memory": pool.resume_memory,
        "close": pool.close,
    }


def _refused(call: Any, *args: Any) -> None:
    with pytest.raises(RuntimeError, match="explicit"):
        call(*args)


def _public_methods() -> set[str]:
    return {
        name
        for name, value in inspect.getmembers(AsyncReqToTokenPool)
        if not name.startswith("_") and callable(value) and not isinstance(value, type)
    }


async def test_audit_covers_every_public_method() -> None:
    with HostStream() as stream:
        calls = await _audit_calls(grouped(), stream)
        stream.synchronize()
    missing = _public_methods() - set(calls)
    assert not missing, f"add these to the grouped-pool audit: {sorted(missing)}"


async def test_every_public_method_on_a_grouped_pool_keeps_the_invariants() -> None:
    pool = grouped()
    with HostStream() as stream:
        calls = await _audit_calls(pool, stream)
        order = [name for name in calls if name not in ("close", "bind")] + ["bind", "close"]
        for name in order:
            if name == "bind":
                stream.synchronize()
                await pool.drain(timeout=5)
                pool.bind()
            else:
                result = calls[name]()
                if inspect.isawaitable(result):
                    async with bounded():
                        await result
            pool.check_invariants()
            for kv in groups_of(pool).values():
                kv.check_invariants()
        stream.synchronize()
        await pool.drain(timeout=5)
    st = pool.stats()
    assert st.pages_free + st.pages_allocated + st.pages_pending + st.pages_quarantined == 20
    assert st.pages_pending == 0


async def test_a_grouped_pool_never_opens_the_unchecked_paths() -> None:
    pool = grouped()
    g = await pool.admit({"swa": 1, "full": 1})
    await spin()
    assert pool._unchecked is False
    assert pool.free([g.row]) == 1
    assert pool.stats().pages_allocated == 0
    rows = await pool.alloc(1)  # a plain row on a grouped pool: no pages
    assert all(len(pool.pages_of(rows[0], group=n)) == 0 for n in ("swa", "full"))
    pool.free(rows)
    pool.check_invariants()


async def test_check_invariants_covers_every_group() -> None:
    pool = grouped()
    g = await pool.admit({"swa": 1, "full": 2})
    pool.check_invariants()
    full = pool._groups["full"]  # type: ignore[index]
    record, seal = full.owned[g.row], full.sealed[g.row]
    full.owned[g.row] = full.sealed[g.row] = None  # the row forgets its full pages
    with pytest.raises(AssertionError):
        pool.check_invariants()
    full.owned[g.row], full.sealed[g.row] = record, seal
    pool.check_invariants()
    pool.free(g.row)


async def test_pages_short_reads_the_named_groups_count() -> None:
    pool = grouped(swa=8, full=6)
    held = await pool.admit({"swa": 0, "full": 4})
    waiter = asyncio.ensure_future(pool.admit({"swa": 1, "full": 5}))
    await spin()
    assert pool.waiting() == 1
    assert pool.pages_short(group="full") == 3  # 5 wanted, 2 free
    assert pool.pages_short(group="swa") == 0
    waiter.cancel()
    async with bounded():
        with pytest.raises(asyncio.CancelledError):
            await waiter
    pool.free(held.row)


@pytest.mark.parametrize("kind", ["rows", "single", "grouped"])
async def test_release_memory_refusal_on_every_kind_of_pool(kind: str) -> None:
    if kind == "rows":
        pool = AsyncReqToTokenPool(5, 64)
    elif kind == "single":
        pool = AsyncReqToTokenPool(5, 64, kv=KVPagePool(9, 4))
    else:
        pool = grouped()
    rows = await pool.alloc(1)
    with pytest.raises(PoolBusyError, match="1 row is still allocated"):
        await pool.release_memory()
    pool.free(rows)
    async with bounded():
        await pool.release_memory()
    assert pool.released
    await pool.resume_memory()
