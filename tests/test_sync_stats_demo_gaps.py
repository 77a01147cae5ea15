"""Gaps found by mutation testing of the sync pool, the stats, the metrics
collector and the scheduler demo, pinned; and one metrics bug, fixed.

Each test here fails with a hand-made mutant applied (named in its
docstring) that the rest of the suite let through:

* ``ReqToTokenPool``: ``reclaim_mode`` of an explicit pool, ``clear()``
  returning rows whose fences have completed (in fresh row order),
  ``stats(summaries=False)`` leaving the windows empty, and ``repr``;
* ``DEFAULT_BOUNDS_S``: exactly 1, 2.5 and 5 per decade;
* ``PoolCollector``: every family exports the ``PoolStats`` field it names,
  a scrape asks for no summaries, ``remove`` forgets the pool's kept counter
  values; and (the bug) a first scrape whose skewed read puts ``rows_freed``
  below 0 raised ``KeyError`` instead of exporting 0;
* the scheduler demo's verification (``Scheduler._verify`` and
  ``_final_check``): each check (``verified_lens``, the row entries, the KV)
  on its own, attribution of a bad token to its request, stale entries
  skipped, corruptions counted per request and mismatches per check. The
  demo runs still catch corruption when one of those checks is broken (the
  others, and the final check, see the same late write), so these tests
  drive the checker directly with a hand-built step;
* the demo's report carrying the checker's four counts, and
  ``scheduler_demo.compare``'s exit status (clean fenced runs *and* caught
  unsafe runs).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, cast

import numpy as np
import pytest
import torch
from helpers import LONG_S, EventFence, bounded, counter_values

from asyncpool import ReqToTokenPool
from asyncpool.stats import DEFAULT_BOUNDS_S, HistogramSnapshot, PoolStats

# ---------------------------------------------------------------- the sync pool


def test_sync_reclaim_mode_names_the_constructors_mode() -> None:
    """``reclaim_mode`` is ``"explicit"`` for ``reclaim="explicit"`` and
    ``"auto"`` otherwise (mutant: always ``"auto"``)."""
    assert ReqToTokenPool(5, 4, reclaim="explicit").reclaim_mode == "explicit"
    assert ReqToTokenPool(5, 4).reclaim_mode == "auto"


def test_sync_clear_returns_rows_whose_fences_completed_in_fresh_order() -> None:
    """``clear()`` never releases a row still behind a fence, but a row whose
    fence has completed is not behind one: it is free right after
    ``clear()``, and the free rows are in fresh row order (mutant: ``clear``
    without its ``reclaim()``, the row stays pending and comes back last)."""
    pool = ReqToTokenPool(9, 8)
    rows = pool.alloc(8)
    assert rows == list(range(1, 9))
    step = EventFence()
    pool.free(rows[:1], fence=step)
    assert pool.pending_size() == 1
    step.set()
    pool.clear()
    assert pool.pending_size() == 0 and pool.allocated_size() == 0
    assert pool.stats().free == 8
    assert pool.alloc(8) == list(range(1, 9))
    pool.check_invariants()


def test_sync_stats_without_summaries_leaves_the_windows_empty() -> None:
    """``stats(summaries=False)`` leaves the percentile summaries empty and
    everything else as ``stats()`` has it (mutant: the sync pool passes
    ``summaries=True`` on regardless)."""
    pool = ReqToTokenPool(5, 8)
    rows = pool.alloc(2)
    assert rows is not None
    step = EventFence()
    pool.free(rows, fence=step)
    step.set()
    assert pool.reclaim() == 2
    full, cheap = pool.stats(), pool.stats(summaries=False)
    assert full.fence_latency.count == 1
    assert cheap.fence_latency.count == 0 and cheap.wait_time.count == 0
    assert dataclasses.replace(full, fence_latency=cheap.fence_latency) == cheap


def test_sync_repr_shows_each_count_in_its_place() -> None:
    """``repr`` names the free, allocated, pending and quarantined counts, each
    its own (mutant: ``pending=`` printed the quarantined count)."""
    pool = ReqToTokenPool(9, 8)
    rows = pool.alloc(3)
    assert rows is not None
    pool.free(rows[:1], fence=EventFence())
    assert repr(pool) == "<ReqToTokenPool size=9 free=5 allocated=2 pending=1 quarantined=0>"


# ---------------------------------------------------------------- stats and metrics


def test_default_bounds_are_1_2_5_and_5_per_decade() -> None:
    """``DEFAULT_BOUNDS_S`` is 1, 2.5 and 5 per decade from 10 us to 10 s, as
    documented (and as dashboards built on the ``le`` labels expect) (mutant:
    0.025 s moved to 0.02 s, still 19 increasing bounds from 1e-5 to 10)."""
    want = [m * 10.0**e for e in range(-5, 1) for m in (1.0, 2.5, 5.0)] + [10.0]
    assert len(DEFAULT_BOUNDS_S) == len(want) == 19
    for got, w in zip(DEFAULT_BOUNDS_S, want, strict=True):
        assert math.isclose(got, w, rel_tol=1e-12), (got, w)


class _OneStats:
    """A pool stand-in: answers ``stats()`` with one snapshot, and records the
    ``summaries`` each scrape asked for."""

    def __init__(self, stats: PoolStats) -> None:
        self.snapshot = stats
        self.asked: list[bool] = []

    def stats(self, *, summaries: bool = True) -> PoolStats:
        self.asked.append(summaries)
        return self.snapshot


def _distinct_stats() -> PoolStats:
    """Every count a different number (101, 102, ... in field order), the
    histograms different too, so a family reading the wrong field shows it."""

    def hist(n: int, sum_s: float) -> HistogramSnapshot:
        return HistogramSnapshot(DEFAULT_BOUNDS_S, (n,) + (0,) * len(DEFAULT_BOUNDS_S), n, sum_s)

    ints = [f.name for f in dataclasses.fields(PoolStats) if f.type == "int"]
    return PoolStats(
        **{name: 101 + i for i, name in enumerate(ints)},
        closed=True,
        released=False,
        oldest_wait_s=12.5,
        wait_histogram=hist(7, 1.5),
        fence_latency_histogram=hist(8, 2.5),
        admit_wait_histogram=hist(9, 3.5),
    )


#: Exported family (sample name after the prefix) -> the PoolStats field it
#: shows, written out here rather than read from ``FAMILIES``.
_EXPORTS = {
    "capacity_rows": "capacity",
    "free_rows": "free",
    "allocated_rows": "allocated",
    "pending_rows": "pending",
    "quarantined_rows": "quarantined",
    "peak_allocated_rows": "peak_allocated",
    "waiting_requests": "waiters",
    "queue_oldest_wait_seconds": "oldest_wait_s",
    "capacity_pages": "pages_capacity",
    "free_pages": "pages_free",
    "allocated_pages": "pages_allocated",
    "pending_pages": "pages_pending",
    "quarantined_pages": "pages_quarantined",
    "overdue_fences": "overdue_fences",
    "overdue_rows": "overdue_rows",
    "overdue_pages": "overdue_pages",
    "closed": "closed",
    "released": "released",
    "alloc_calls_total": "alloc_calls",
    "admit_calls_total": "admits",
    "growth_refusals_total": "growth_refusals",
    "rows_allocated_total": "rows_granted",
    "rows_deferred_total": "deferred_frees",
    "rows_reclaimed_total": "reclaimed",
    "alloc_timeouts_total": "timeouts",
    "alloc_cancellations_total": "cancellations",
    "alloc_rejections_total": "rejections",
    "fence_errors_total": "fence_errors",
    "page_fence_errors_total": "page_fence_errors",
    "row_resets_total": "resets",
}


def test_every_family_exports_the_figure_it_names() -> None:
    """Each gauge, counter and histogram reads its own ``PoolStats`` field
    (checked against this table, not against ``FAMILIES``) (mutants:
    ``overdue_rows`` exporting the overdue pages, ``peak_allocated_rows``
    the rows allocated now, ``page_fence_errors`` the row fence errors,
    ``waiting_requests`` 0, ``admit_wait_seconds`` the alloc waits)."""
    pytest.importorskip("prometheus_client")
    from prometheus_client import CollectorRegistry

    from asyncpool.metrics import PoolCollector

    st = _distinct_stats()
    registry = CollectorRegistry()
    registry.register(PoolCollector(_OneStats(st), name="p"))
    want = {name: float(getattr(st, field)) for name, field in _EXPORTS.items()}
    want["rows_freed_total"] = float(st.rows_granted - st.allocated)
    for name, h in (
        ("alloc_wait_seconds", st.wait_histogram),
        ("admit_wait_seconds", st.admit_wait_histogram),
        ("fence_latency_seconds", st.fence_latency_histogram),
    ):
        want[name + "_count"], want[name + "_sum"] = float(h.count), h.sum_s
    got = {name: registry.get_sample_value(f"asyncpool_{name}", {"pool": "p"}) for name in want}
    assert got == want


def test_a_scrape_asks_for_stats_without_summaries() -> None:
    """A scrape calls ``stats(summaries=False)``: sorting the sample windows
    is the costly part of ``stats()`` and nothing exported reads them
    (mutant: ``stats()`` with the summaries, on the HTTP server's thread)."""
    pytest.importorskip("prometheus_client")
    from asyncpool.metrics import PoolCollector

    pool = _OneStats(_distinct_stats())
    collector = PoolCollector(pool, name="p")
    for _ in range(2):
        list(collector.collect())
    assert pool.asked == [False, False]


def test_remove_forgets_the_pools_last_counter_values() -> None:
    """``remove(name)`` drops the never-go-down values it kept for that pool:
    a collector whose pools come and go (one per model, say) does not grow
    for ever (mutant: ``remove`` without its ``_forget``)."""
    pytest.importorskip("prometheus_client")
    from asyncpool.metrics import PoolCollector

    collector = PoolCollector()
    for i in range(3):
        collector.add(_OneStats(_distinct_stats()), name=f"p{i}")
        list(collector.collect())
        collector.remove(f"p{i}")
        assert collector._last == {}


def test_a_first_scrape_skewed_below_zero_exports_zero() -> None:
    """Bug fix: a scrape reads ``rows_granted`` before the counts now, so a
    grant on the owner's thread in between makes ``rows_granted - allocated``
    (``rows_freed``) negative, e.g. 0 - 2 on a new pool's first scrape. The
    never-go-down clamp then looked up a last value that was never kept and
    the scrape raised ``KeyError`` (an HTTP 500); it exports 0 now, and the
    counter carries on from there."""
    pytest.importorskip("prometheus_client")
    from asyncpool.metrics import PoolCollector

    skewed = PoolStats(8, 6, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, rows_granted=0)
    pool = _OneStats(skewed)
    collector = PoolCollector(pool, name="p")
    assert counter_values(collector)["asyncpool_rows_freed"] == 0.0
    pool.snapshot = dataclasses.replace(skewed, rows_granted=3, allocated=2, free=6)
    counters = counter_values(collector)
    assert counters["asyncpool_rows_freed"] == 1.0
    assert counters["asyncpool_rows_allocated"] == 3.0


# ---------------------------------------------------------------- the demo's checker


def _scheduler(forward: Any = None) -> Any:
    """A demo scheduler over two requests (rid 0 and 1), both running, for
    driving its checker by hand; the pool and the streams are not used."""
    from asyncpool import KVPagePool
    from scheduler_demo import DemoConfig
    from scheduler_demo.scheduler import RUNNING, Scheduler
    from scheduler_demo.workload import RequestSpec

    cfg = DemoConfig(
        num_requests=2, rows=4, max_context_len=16, kv_pages=8, page_size=4, progress=False
    )
    specs = [RequestSpec(0, 0.0, 2, 4), RequestSpec(1, 0.0, 1, 4)]
    sched = Scheduler(cfg, cast(Any, None), KVPagePool(9, 4), forward, cast(Any, None), specs)
    for row, req in enumerate(sched.reqs, start=1):
        req.row, req.state = row, RUNNING
    return sched


def _step(sched: Any, step_id: int = 1) -> Any:
    """A step of request 0 (3 tokens, slots 10..12) and request 1 (2 tokens,
    slots 20..21), with the outputs a clean forward reads back; tests corrupt
    them. Token 3 is request 1's first: on the boundary between the two."""
    from scheduler_demo.forward import Step
    from scheduler_demo.scheduler import kv_value

    a, b = sched.reqs
    entries = [(a, a.epoch, 3), (b, b.epoch, 2)]
    v_rows = np.array([a.row] * 3 + [b.row] * 2, dtype=np.int64)
    v_cols = np.array([0, 1, 2, 0, 1], dtype=np.int64)
    v_slots = np.array([10, 11, 12, 20, 21], dtype=np.int64)
    v_vals = np.array([kv_value(0, p) for p in range(3)] + [kv_value(1, p) for p in range(2)])
    empty = np.zeros(0, dtype=np.int64)
    step = Step(
        step_id,
        entries,
        [a.row, b.row],
        [1, 1],
        empty,
        empty,
        empty,
        empty,
        empty,
        (v_rows, v_cols, v_slots, v_vals.astype(np.int64)),
    )
    step.out_lens = torch.tensor([3, 2], dtype=torch.int32)
    step.out_row = torch.from_numpy(v_slots).to(torch.int32)
    step.out_kv = torch.from_numpy(v_vals.astype(np.int64))
    return step


def _counts(sched: Any) -> tuple[int, int, int, int]:
    return sched.corruptions, sched.mismatches, sched.kv_corruptions, sched.kv_mismatches


def test_checker_passes_a_clean_step() -> None:
    """A step whose outputs are what the host expects counts nothing."""
    sched = _scheduler()
    sched._verify(_step(sched))
    assert _counts(sched) == (0, 0, 0, 0)


def test_checker_sees_a_wrong_row_entry_and_blames_its_request() -> None:
    """A row entry that lists another slot (and nothing else wrong) is a row
    corruption of the request whose token it is, here the first token of the
    second request (mutants: no row compare; a bad token blamed on the
    request before it; a row mismatch counted as a KV one)."""
    sched = _scheduler()
    step = _step(sched)
    step.out_row[3] = 99
    sched._verify(step)
    a, b = sched.reqs
    assert _counts(sched) == (1, 1, 0, 0)
    assert b.corrupted and not a.corrupted and not b.kv_corrupted


def test_checker_sees_a_wrong_kv_value_and_blames_its_request() -> None:
    """A KV slot holding another request's value (rows and lengths right) is a
    KV corruption of the request that owns the slot (mutants: no KV compare;
    the early return looking at rows and lengths only; a bad token blamed on
    the request before it)."""
    from scheduler_demo.scheduler import kv_value

    sched = _scheduler()
    step = _step(sched)
    step.out_kv[3] = kv_value(0, 7)
    sched._verify(step)
    a, b = sched.reqs
    assert _counts(sched) == (0, 0, 1, 1)
    assert b.kv_corrupted and not a.kv_corrupted and not b.corrupted


def test_checker_sees_a_wrong_verified_len() -> None:
    """A ``verified_lens`` that disagrees (rows and KV right) is a row
    corruption of that request (mutant: no length compare)."""
    sched = _scheduler()
    step = _step(sched)
    step.out_lens[0] = 4
    sched._verify(step)
    a, b = sched.reqs
    assert _counts(sched) == (1, 1, 0, 0)
    assert a.corrupted and not b.corrupted


def test_checker_skips_entries_of_requests_no_longer_running() -> None:
    """A request retracted (or finished, aborted) after the step launched no
    longer owns what the step read: its bad entries count nothing (mutant:
    the stale-entry skip removed)."""
    from scheduler_demo.scheduler import kv_value

    sched = _scheduler()
    step = _step(sched)
    b = sched.reqs[1]
    b.epoch += 1  # retracted after the launch
    step.out_row[4] = 99
    step.out_kv[4] = kv_value(0, 7)
    sched._verify(step)
    assert _counts(sched) == (0, 0, 0, 0)
    assert not b.corrupted and not b.kv_corrupted


def test_checker_counts_requests_once_and_every_mismatch() -> None:
    """``corruptions``/``kv_corruptions`` count requests, ``mismatches``/
    ``kv_mismatches`` every disagreeing check: one request bad at two steps
    is one corruption and two mismatches of each kind (mutant: KV
    corruptions counted per check)."""
    from scheduler_demo.scheduler import kv_value

    sched = _scheduler()
    for step_id in (1, 2):
        step = _step(sched, step_id)
        step.out_row[0] = 99
        step.out_kv[1] = kv_value(1, 0)
        sched._verify(step)
    assert _counts(sched) == (1, 2, 1, 2)


@pytest.mark.parametrize("what", ["row", "kv"])
def test_final_check_compares_finished_rows_and_kv(what: str) -> None:
    """The final check compares every finished request's row and KV, as they
    were when it finished, with the host's truth: a finished request whose
    row (or KV) copy differs is counted, the other is not (mutants: either
    compare removed)."""
    from scheduler_demo.forward import Forward

    forward = Forward("cpu", 0.0, 0.0)
    try:
        sched = _scheduler(forward)
        for req in sched.reqs:
            req.kv_len = 3
            req.slots = np.array([4, 5, 6], dtype=np.int64)
            req.snapshot = torch.tensor([4, 5, 6], dtype=torch.int32)
            req.kv_snapshot = torch.arange(req.base, req.base + 3, dtype=torch.int64)
        a, b = sched.reqs
        if what == "row":
            b.snapshot[2] = 9  # a late write landed in its row
        else:
            b.kv_snapshot[0] = a.base  # another request's value in its page
        sched._final_check()
    finally:
        forward.close()
    assert _counts(sched) == ((1, 1, 0, 0) if what == "row" else (0, 0, 1, 1))
    assert not a.corrupted and not a.kv_corrupted


# ---------------------------------------------------------------- the compare tool's exit status


def _report(unsafe: bool, corruptions: int, kv_corruptions: int) -> Any:
    """A report of a run that completed its 4 requests, every other figure 1
    (the compare tool divides by the tokens/s)."""
    from scheduler_demo import Report

    given: dict[str, Any] = {
        "mode": "overlap",
        "unsafe": unsafe,
        "device": "cpu",
        "admission": "atomic",
        "requests": 4,
        "completed": 4,
        "aborts": 0,
        "corruptions": corruptions,
        "kv_corruptions": kv_corruptions,
    }
    rest = {f.name: 1 for f in dataclasses.fields(Report) if f.name not in given}
    del rest["config"], rest["trace"], rest["swa"]  # the optional fields
    return Report(**given, **rest)


@pytest.mark.parametrize(
    "fenced_kv, unsafe_kv, status",
    [(0, 3, 0), (0, 0, 1), (2, 3, 1)],
    ids=["clean-and-caught", "unsafe-not-caught", "fenced-corrupted"],
)
def test_compare_exit_status_needs_clean_fenced_runs_and_caught_unsafe_ones(
    monkeypatch: pytest.MonkeyPatch, fenced_kv: int, unsafe_kv: int, status: int
) -> None:
    """``scheduler_demo.compare`` exits 0 only when every fenced run is clean
    and every unsafe run found KV corruption; an unsafe run that found none
    means the checker (or the hazard) is broken (mutants: the unsafe runs'
    check, or the fenced runs' check, forced to pass)."""
    from scheduler_demo import compare

    async def fake_run_demo(cfg: Any) -> Any:
        if cfg.unsafe:
            return _report(True, 1, unsafe_kv)
        return _report(False, 0, fenced_kv)

    monkeypatch.setattr(compare, "run_demo", fake_run_demo)
    assert compare.main(["--rounds=1", "--no-progress"]) == status


# ---------------------------------------------------------------- the report's counts


async def test_the_report_carries_the_checkers_four_counts() -> None:
    """``run_demo``'s report gives the scheduler's ``corruptions``,
    ``mismatches``, ``kv_corruptions`` and ``kv_mismatches`` each in its own
    field (mutants: the report's ``corruptions`` read from the mismatches, or
    its ``kv_corruptions`` from the row corruptions). The scheduler's counts
    are set by hand at the end of a short clean run, four different numbers."""
    from scheduler_demo import DemoConfig, run_demo
    from scheduler_demo.scheduler import Scheduler

    class Counted(Scheduler):
        def _final_check(self) -> None:
            super()._final_check()
            self.corruptions, self.mismatches = 3, 7
            self.kv_corruptions, self.kv_mismatches = 5, 11

    cfg = DemoConfig(
        num_requests=4,
        rate=0.0,
        prompt_len="const:4",
        output_len="const:3",
        abort_rate=0.0,
        rows=4,
        max_context_len=16,
        kv_pages=16,
        page_size=4,
        transfer_ms=0.5,
        forward_ms=0.1,
        forward_us_per_token=0.0,
        sched_ms=0.0,
        progress=False,
        timeout_s=60.0,
    )
    async with bounded(LONG_S):
        report = await run_demo(cfg, scheduler_factory=Counted)
    assert report.completed == 4
    assert (report.corruptions, report.mismatches) == (3, 7)
    assert (report.kv_corruptions, report.kv_mismatches) == (5, 11)
    assert not report.ok
