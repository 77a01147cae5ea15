"""Gaps found by a mechanical mutation sweep of the observability modules
(``asyncpool/stats.py``, ``asyncpool/metrics.py``, ``asyncpool/base.py``,
``asyncpool/errors.py``).

Each test pins one behaviour that a generated mutant broke while every test
file that exercises those modules still passed:

* the figures a pool has nothing to report for keep :class:`PoolStats`'
  defaults, and those defaults are zero and empty: the page figures of a
  pool without ``kv=``, the overdue figures of one without
  ``fence_timeout``, the admission figures, and the sync pool's
  ``wait_time`` window; the Prometheus families of those figures read 0,
  and the admission histogram exports the default bounds with no
  observation;
* the snapshots (``PoolStats``, ``LatencySummary``, ``HistogramSnapshot``)
  are frozen: a field cannot be assigned;
* a pool left out of a scrape (its ``stats()`` raised, or gave no
  ``PoolStats``) leaves out only itself: the pools added after it are
  exported too (the older test added the bad pool last);
* a counter read lower on a later scrape (figures read a few operations
  apart from another thread) is exported at the value of the scrape
  before: the collector keeps each pool's last values from one scrape to
  the next, not only within one;
* ``stats()`` reports no more overdue memory than pending memory when its
  overdue scan and its pending counts disagree (read a few operations
  apart): overdue rows are clamped to the pending rows, overdue pages to
  the pending pages (0 without ``kv=``), and overdue fences are 0 once
  they hold neither; figures that agree are left as they are;
* a pool keeps the seed's plain attributes ``size``, ``max_context_len``,
  ``device`` and ``stream`` as given (engine code reads them).
"""

from __future__ import annotations

import dataclasses

import pytest
from helpers import EventFence, bounded
from prometheus_client.core import Metric

from asyncpool import AsyncReqToTokenPool, KVPagePool, ReqToTokenPool
from asyncpool.metrics import PoolCollector
from asyncpool.stats import (
    DEFAULT_BOUNDS_S,
    FrozenDict,
    HistogramSnapshot,
    LatencySummary,
    PoolStats,
)

#: The fields a pool built without ``kv=`` and ``fence_timeout`` leaves at
#: their defaults (``wait_time`` too on the sync pool).
_UNREPORTED = (
    "pages_capacity",
    "pages_free",
    "pages_allocated",
    "pages_pending",
    "pages_quarantined",
    "page_fence_errors",
    "overdue_fences",
    "overdue_rows",
    "overdue_pages",
    "admits",
    "growth_refusals",
)


def _check_unreported(st: PoolStats) -> None:
    for name in _UNREPORTED:
        assert getattr(st, name) == 0, name
    assert st.admit_wait == LatencySummary()
    assert st.admit_wait.count == 0 and st.admit_wait.p99_s == 0.0
    empty = st.admit_wait_histogram
    assert empty.bounds == DEFAULT_BOUNDS_S
    assert empty.counts == (0,) * (len(DEFAULT_BOUNDS_S) + 1)
    assert empty.count == 0 and empty.sum_s == 0.0


def _samples(collector: PoolCollector) -> dict[str, float]:
    out: dict[str, float] = {}
    fam: Metric
    for fam in collector.collect():
        for s in fam.samples:
            out[s.name + str(sorted(s.labels.items()))] = s.value
    return out


def test_the_sync_pools_unreported_figures_are_zero_and_empty() -> None:
    pool = ReqToTokenPool(9, 8)
    rows = pool.alloc(3)
    assert rows is not None
    pool.free(rows)
    st = pool.stats()
    _check_unreported(st)
    assert st.wait_time == LatencySummary()
    assert (st.resets, st.fence_errors, st.closed, st.released) == (0, 0, False, False)
    # Every field of a fresh PoolStats with only the required figures is
    # zero, False or empty.
    bare = PoolStats(8, 8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    for f in dataclasses.fields(PoolStats):
        value = getattr(bare, f.name)
        if isinstance(value, LatencySummary):
            assert value == LatencySummary(0, 0.0, 0.0, 0.0, 0.0), f.name
        elif isinstance(value, HistogramSnapshot):
            assert value == HistogramSnapshot(
                DEFAULT_BOUNDS_S, (0,) * (len(DEFAULT_BOUNDS_S) + 1), 0, 0.0
            ), f.name
        elif f.name in ("kv_groups", "by_priority"):  # no KV groups, nothing queued: none
            assert value == {} and isinstance(value, FrozenDict), f.name
        elif f.name == "other_priorities":  # no priority past the cap
            assert value is None, f.name
        elif f.name == "oldest_wait_s":  # seconds: nobody waits
            assert value == 0.0 and type(value) is float, f.name
        elif f.name != "capacity" and f.name != "free":
            assert value in (0, False) and type(value) in (int, bool), f.name


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_a_pool_without_kv_exports_zero_pages_and_overdue(kind: str) -> None:
    pool = ReqToTokenPool(9, 8) if kind == "sync" else AsyncReqToTokenPool(9, 8)
    async with bounded():
        st = pool.stats()
        _check_unreported(st)
        got = _samples(PoolCollector(pool, name="p"))
        lab = "[('pool', 'p')]"
        for fam in (
            "capacity_pages",
            "free_pages",
            "allocated_pages",
            "pending_pages",
            "quarantined_pages",
            "overdue_fences",
            "overdue_rows",
            "overdue_pages",
        ):
            assert got[f"asyncpool_{fam}{lab}"] == 0.0, fam
        for fam in ("admit_calls", "growth_refusals", "page_fence_errors"):
            assert got[f"asyncpool_{fam}_total{lab}"] == 0.0, fam
        assert got[f"asyncpool_admit_wait_seconds_count{lab}"] == 0.0
        inf = "[('le', '+Inf'), ('pool', 'p')]"
        assert got[f"asyncpool_admit_wait_seconds_bucket{inf}"] == 0.0
        assert got[f"asyncpool_capacity_rows{lab}"] == 8.0
        if isinstance(pool, AsyncReqToTokenPool):
            await pool.close()


def test_the_snapshots_are_frozen() -> None:
    pool = ReqToTokenPool(5, 8)
    st = pool.stats()
    with pytest.raises(dataclasses.FrozenInstanceError):
        st.free = 0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        st.fence_latency.count = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        st.wait_histogram.count = 1  # type: ignore[misc]
    assert hash(st.wait_histogram) == hash(pool.stats().wait_histogram)


class _Raises:
    def stats(self, *, summaries: bool = True) -> PoolStats:
        raise RuntimeError("torn down")


class _NotStats:
    def stats(self, *, summaries: bool = True) -> PoolStats:
        return None  # type: ignore[return-value]


@pytest.mark.parametrize("bad", [_Raises, _NotStats])
def test_a_pool_left_out_of_a_scrape_leaves_out_only_itself(bad: type) -> None:
    collector = PoolCollector(bad(), name="bad")
    collector.add(ReqToTokenPool(5, 8), name="after")
    collector.add(bad(), name="bad2")
    collector.add(ReqToTokenPool(9, 8), name="last")
    got = _samples(collector)
    assert got["asyncpool_capacity_rows[('pool', 'after')]"] == 4.0
    assert got["asyncpool_capacity_rows[('pool', 'last')]"] == 8.0
    assert got["asyncpool_alloc_calls_total[('pool', 'last')]"] == 0.0
    assert got["asyncpool_alloc_wait_seconds_count[('pool', 'last')]"] == 0.0
    assert not any("bad" in k for k in got)


class _Scripted:
    """A pool stand-in whose ``stats()`` gives the next snapshot of a list."""

    def __init__(self, snaps: list[PoolStats]) -> None:
        self.snaps = snaps

    def stats(self, *, summaries: bool = True) -> PoolStats:
        return self.snaps.pop(0)


def test_a_counter_read_lower_on_a_later_scrape_does_not_go_down() -> None:
    base = PoolStats(8, 4, 4, 0, 0, 0, 10, 6, 3, 2, 0, 0, 0, 4, rows_granted=10, alloc_calls=7)
    skewed = dataclasses.replace(base, alloc_calls=6, rows_granted=9, deferred_frees=2)
    ahead = dataclasses.replace(base, alloc_calls=8, rows_granted=11, deferred_frees=3)
    collector = PoolCollector(_Scripted([base, skewed, ahead]), name="p")
    lab = "[('pool', 'p')]"
    names = ("alloc_calls", "rows_allocated", "rows_deferred")
    for want in ((7.0, 10.0, 3.0), (7.0, 10.0, 3.0), (8.0, 11.0, 3.0)):
        got = _samples(collector)
        assert tuple(got[f"asyncpool_{n}_total{lab}"] for n in names) == want


@pytest.mark.parametrize(
    ("kv", "scan", "want"),
    [
        # (pages?, (fences, {unit: held}) the racing scan saw, (fences, rows, pages) reported)
        (True, (2, {"rows": 5, "pages": 9}), (2, 1, 2)),  # both clamped
        (True, (1, {"rows": 1, "pages": 2}), (1, 1, 2)),  # equal: kept
        (True, (1, {"rows": 0, "pages": 1}), (1, 0, 1)),  # below: kept
        (True, (3, {}), (0, 0, 0)),  # the fences hold nothing any more
        (False, (1, {"rows": 1, "pages": 4}), (1, 1, 0)),  # no pages without kv
        (False, (2, {"pages": 4}), (0, 0, 0)),
    ],
)
async def test_stats_report_no_more_overdue_than_pending(
    kv: bool, scan: tuple[int, dict[str, int]], want: tuple[int, int, int]
) -> None:
    pages = KVPagePool(9, 4) if kv else None
    async with bounded(), AsyncReqToTokenPool(5, 8, kv=pages, fence_timeout=60.0) as pool:
        if pages is not None:
            grant = await pool.admit(pages=2)
            row = grant.row
        else:
            (row,) = await pool.alloc(1)
        fence = EventFence()
        pool.free([row], fence=fence)
        assert pool.pending_size() == 1
        assert pool.stats().overdue_fences == 0
        overdue = pool._overdue
        assert overdue is not None
        overdue.counts = lambda *, agreed=False: scan  # type: ignore[method-assign]
        st = pool.stats()
        assert (st.overdue_fences, st.overdue_rows, st.overdue_pages) == want
        assert st.pending == 1 and st.pages_pending == (2 if kv else 0)
        fence.set()


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_a_pool_keeps_the_seeds_plain_attributes(kind: str) -> None:
    cls = ReqToTokenPool if kind == "sync" else AsyncReqToTokenPool
    pool = cls(7, 12, device="cpu")
    assert (pool.size, pool.max_context_len, pool.device, pool.stream) == (7, 12, "cpu", None)
    assert tuple(pool.req_to_token.shape) == (7, 12)
    if isinstance(pool, AsyncReqToTokenPool):
        async with bounded():
            await pool.close()
