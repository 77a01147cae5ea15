"""The Prometheus collector and the histograms behind it (issue 11)."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import itertools
import logging
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
from helpers import (
    WAIT_S,
    EventFence,
    FakeStream,
    Streams,
    bounded,
    calling_from_a_thread,
    doc_section,
    spin,
    tracing,
)

import asyncpool.waiters as waiters_module
from asyncpool import AsyncReqToTokenPool, KVGroupStats, KVPagePool, ReqToTokenPool
from asyncpool.ledger import SlotLedger
from asyncpool.stats import DEFAULT_BOUNDS_S, FrozenDict, Histogram, HistogramSnapshot, PoolStats

prometheus_client = pytest.importorskip("prometheus_client")

from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402
from prometheus_client.openmetrics.exposition import (  # noqa: E402
    generate_latest as generate_openmetrics,
)
from prometheus_client.openmetrics.parser import (  # noqa: E402
    text_string_to_metric_families as parse_openmetrics,
)
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from asyncpool.metrics import FAMILIES, GROUP_FAMILIES, PRIORITY_FAMILIES, PoolCollector  # noqa: E402

GAUGES = {
    "asyncpool_capacity_rows": "rows",
    "asyncpool_free_rows": "rows",
    "asyncpool_allocated_rows": "rows",
    "asyncpool_pending_rows": "rows",
    "asyncpool_quarantined_rows": "rows",
    "asyncpool_peak_allocated_rows": "rows",
    "asyncpool_waiting_requests": "",
    "asyncpool_queue_oldest_wait_seconds": "seconds",
    "asyncpool_capacity_pages": "pages",
    "asyncpool_free_pages": "pages",
    "asyncpool_allocated_pages": "pages",
    "asyncpool_pending_pages": "pages",
    "asyncpool_quarantined_pages": "pages",
    "asyncpool_overdue_fences": "",
    "asyncpool_overdue_rows": "rows",
    "asyncpool_overdue_pages": "pages",
    "asyncpool_closed": "",
    "asyncpool_released": "",
    "asyncpool_grants_held": "",
    "asyncpool_grant_holds": "",
}
COUNTERS = {
    "asyncpool_alloc_calls",
    "asyncpool_admit_calls",
    "asyncpool_growth_refusals",
    "asyncpool_rows_allocated",
    "asyncpool_rows_freed",
    "asyncpool_rows_deferred",
    "asyncpool_rows_reclaimed",
    "asyncpool_rows_force_released",
    "asyncpool_pages_force_released",
    "asyncpool_alloc_timeouts",
    "asyncpool_alloc_cancellations",
    "asyncpool_alloc_rejections",
    "asyncpool_alloc_unfittable",
    "asyncpool_fence_errors",
    "asyncpool_page_fence_errors",
    "asyncpool_row_resets",
}
HISTOGRAMS = {
    "asyncpool_alloc_wait_seconds",
    "asyncpool_admit_wait_seconds",
    "asyncpool_fence_latency_seconds",
}
#: The per-KV-group families (labels pool, group; state on kv_group_pages).
GROUP_GAUGES = {
    "asyncpool_kv_group_capacity_pages": "pages",
    "asyncpool_kv_group_pages": "pages",
    "asyncpool_kv_group_peak_allocated_pages": "pages",
}
GROUP_COUNTERS = {"asyncpool_kv_group_growth_refusals", "asyncpool_kv_group_fence_errors"}
STATES = ("free", "allocated", "pending", "quarantined")
#: The per-priority families (labels pool, priority): with every pool that queues.
PRIORITY_COUNTERS = {
    "asyncpool_priority_timeouts",
    "asyncpool_priority_cancellations",
    "asyncpool_priority_rejections",
    "asyncpool_priority_unfittable",
}
PRIORITY_HISTOGRAMS = {
    "asyncpool_priority_alloc_queue_wait_seconds",
    "asyncpool_priority_admit_queue_wait_seconds",
}


def scrape(*pools: tuple[Any, str]) -> dict[str, Any]:
    """Register one collector for ``pools`` and parse a text-format scrape."""
    registry = CollectorRegistry()
    collector = PoolCollector()
    for pool, name in pools:
        collector.add(pool, name)
    registry.register(collector)
    text = generate_latest(registry).decode()
    return {fam.name: fam for fam in text_string_to_metric_families(text)}


def value(families: dict[str, Any], sample: str, pool: str = "p", **labels: str) -> float:
    """The value of one sample (by full sample name and labels)."""
    base = sample
    for suffix in ("_total", "_bucket", "_count", "_sum"):
        if sample.endswith(suffix) and sample.removesuffix(suffix) in families:
            base = sample.removesuffix(suffix)
    want = {"pool": pool, **labels}
    hits = [s.value for s in families[base].samples if s.name == sample and s.labels == want]
    assert len(hits) == 1, (sample, want, families[base].samples)
    return float(hits[0])


def buckets(families: dict[str, Any], name: str, pool: str = "p") -> list[tuple[str, float]]:
    return [
        (s.labels["le"], s.value)
        for s in families[name].samples
        if s.name == name + "_bucket" and s.labels["pool"] == pool
    ]


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


# ---------------------------------------------------------------- names and types


async def test_every_family_has_its_name_type_and_unit() -> None:
    async with AsyncReqToTokenPool(9, 4) as pool:
        fams = scrape((pool, "p"))
        types = {name: fam.type for name, fam in fams.items()}
        assert types == {
            **dict.fromkeys(GAUGES, "gauge"),
            **dict.fromkeys(COUNTERS, "counter"),
            **dict.fromkeys(HISTOGRAMS, "histogram"),
            **dict.fromkeys(PRIORITY_COUNTERS, "counter"),
            **dict.fromkeys(PRIORITY_HISTOGRAMS, "histogram"),
        }
        # Counters expose "_total" samples; nothing else does.
        for name in COUNTERS:
            assert [s.name for s in fams[name].samples] == [name + "_total"]
        for name in GAUGES:
            assert [s.name for s in fams[name].samples] == [name]
        # Units: declared in the OpenMetrics exposition, and the name ends in them.
        registry = CollectorRegistry()
        registry.register(PoolCollector(pool, name="p"))
        om = {f.name: f for f in parse_openmetrics(generate_openmetrics(registry).decode())}
        for name, unit in GAUGES.items():
            assert om[name].unit == unit
        for name in HISTOGRAMS:
            assert om[name].unit == "seconds" and name.endswith("_seconds")
        for name in COUNTERS:
            assert om[name].unit == ""
        assert len(FAMILIES) == len(GAUGES) + len(COUNTERS) + len(HISTOGRAMS)


async def test_gauges_and_counters_track_the_pool() -> None:
    # The old collector's figures, under their new names.
    async with AsyncReqToTokenPool(9, 4) as pool, asyncio.timeout(WAIT_S):
        rows = await pool.alloc(3)
        pool.free(rows[:1])
        fams = scrape((pool, "decode"))
        assert value(fams, "asyncpool_capacity_rows", "decode") == 8
        assert value(fams, "asyncpool_allocated_rows", "decode") == 2
        assert value(fams, "asyncpool_free_rows", "decode") == 6
        assert value(fams, "asyncpool_pending_rows", "decode") == 0
        assert value(fams, "asyncpool_peak_allocated_rows", "decode") == 3
        # Calls and rows are counted apart: one call, three rows.
        assert value(fams, "asyncpool_alloc_calls_total", "decode") == 1
        assert value(fams, "asyncpool_rows_allocated_total", "decode") == 3
        assert value(fams, "asyncpool_rows_freed_total", "decode") == 1
        assert value(fams, "asyncpool_closed", "decode") == 0
        assert value(fams, "asyncpool_released", "decode") == 0
        pool.free(rows[1:])
        await pool.release_memory()
        assert value(scrape((pool, "decode")), "asyncpool_released", "decode") == 1
        await pool.resume_memory()
    assert value(scrape((pool, "decode")), "asyncpool_closed", "decode") == 1


async def test_released_reads_true_only_once_the_region_is_released(kit: Streams) -> None:
    # While release_memory() drains a fence, allocation is held but the
    # region still holds memory: released (property, stats, gauge) is False
    # and the repr says "releasing"; it turns True when the release returns.
    async with AsyncReqToTokenPool(4, 4) as pool, asyncio.timeout(WAIT_S):
        s = kit.stream()
        gate = kit.gate(s)
        pool.free(await pool.alloc(2), after=s)
        rel = asyncio.create_task(pool.release_memory())
        await spin()
        assert not rel.done() and pool.try_alloc(1) is None  # draining, allocs held
        assert not pool.released and not pool.stats().released
        assert value(scrape((pool, "p")), "asyncpool_released") == 0
        assert "releasing" in repr(pool)
        gate.open()
        await rel
        assert pool.released and pool.stats().released
        assert value(scrape((pool, "p")), "asyncpool_released") == 1
        assert "released" in repr(pool) and "releasing" not in repr(pool)
        await pool.resume_memory()
        assert not pool.released and "open" in repr(pool)


# ---------------------------------------------------------------- the wait histogram


async def test_every_alloc_is_in_the_wait_histogram(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(waiters_module, "_perf_counter", clock)  # every wait is timed there
    async with AsyncReqToTokenPool(12, 4) as pool, asyncio.timeout(WAIT_S):
        held = []
        for _ in range(10):  # fast path: ten zero waits
            held += await pool.alloc(1)
        assert pool.try_alloc(1) is not None  # an eleventh, through try_alloc
        # Two waited allocs, granted 3 ms and 2 s after queueing.
        clock.t = 100.0
        w1 = asyncio.create_task(pool.alloc(1))
        await spin()
        clock.t = 100.003
        pool.free(held[:1])
        assert (await w1) == held[:1]
        clock.t = 200.0
        w2 = asyncio.create_task(pool.alloc(1))
        await spin()
        clock.t = 202.0
        pool.free(held[1:2])
        await w2

        fams = scrape((pool, "p"))
        name = "asyncpool_alloc_wait_seconds"
        assert value(fams, name + "_count") == 13 == pool.stats().alloc_calls
        assert value(fams, "asyncpool_alloc_calls_total") == 13
        assert value(fams, name + "_sum") == pytest.approx(2.003)
        cum = dict(buckets(fams, name))
        assert cum["1e-05"] == 11  # the zero waits
        assert cum["0.0025"] == 11 and cum["0.005"] == 12  # 3 ms
        assert cum["1.0"] == 12 and cum["2.5"] == 13 == cum["+Inf"]  # 2 s
        counts = [c for _, c in buckets(fams, name)]
        assert counts == sorted(counts)  # cumulative


async def test_each_fast_path_counts_its_call_once(kit: Streams) -> None:
    async with AsyncReqToTokenPool(6, 4) as pool, asyncio.timeout(WAIT_S):

        def calls() -> int:
            st = pool.stats(summaries=False)
            assert st.alloc_calls == st.wait_histogram.count == st.wait_histogram.counts[0]
            return st.alloc_calls

        a = await pool.alloc(1)  # a clean row, inlined
        assert calls() == 1
        pool.free(a)  # dirty now, at the tail of the free queue
        b = await pool.alloc(3)  # several rows, through the ledger
        assert calls() == 2
        c = await pool.alloc(1)  # the last clean row, inlined
        d = await pool.alloc(1)  # the dirty row `a`, through the ledger
        assert d == a and calls() == 4
        s = kit.stream()
        gate = kit.gate(s)
        pool.free(b + c + d, after=s)  # five rows pending behind one fence
        assert pool.pending_size() == 5 and pool.available_size() == 0
        gate.open()
        s.synchronize()  # the fence completed; the loop has not heard of it yet
        e = await pool.alloc(2)  # short until the alloc itself reclaims
        assert calls() == 5 and pool.waiting() == 0
        f = pool.try_alloc(1)
        assert f is not None and calls() == 6
        assert pool.try_alloc(3) is None and calls() == 6  # refused: not counted
        pool.free(e + f)


async def test_timeouts_cancellations_and_rejections_are_counted_apart() -> None:
    async with AsyncReqToTokenPool(3, 4, max_waiters=1) as pool, asyncio.timeout(WAIT_S):
        held = await pool.alloc(2)
        with pytest.raises(TimeoutError):
            await pool.alloc(1, timeout=0)
        t = asyncio.create_task(pool.alloc(1))
        await spin()
        with pytest.raises(Exception, match="max_waiters"):
            await pool.alloc(1)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        fams = scrape((pool, "p"))
        assert value(fams, "asyncpool_alloc_timeouts_total") == 1
        assert value(fams, "asyncpool_alloc_cancellations_total") == 1
        assert value(fams, "asyncpool_alloc_rejections_total") == 1
        # None of them was granted: only the first alloc is in the histogram.
        assert value(fams, "asyncpool_alloc_wait_seconds_count") == 1
        assert value(fams, "asyncpool_alloc_calls_total") == 1
        pool.free(held)


def test_sync_pool_allocs_are_zero_waits() -> None:
    pool = ReqToTokenPool(5, 4)
    a = pool.alloc(2)
    b = pool.alloc(2)
    assert a is not None and b is not None
    assert pool.alloc(1) is None  # refused: not a granted call
    fams = scrape((pool, "p"))
    assert value(fams, "asyncpool_alloc_calls_total") == 2
    assert value(fams, "asyncpool_rows_allocated_total") == 4
    assert dict(buckets(fams, "asyncpool_alloc_wait_seconds"))["1e-05"] == 2
    assert value(fams, "asyncpool_waiting_requests") == 0


# ---------------------------------------------------------------- fence latency


def test_fence_latency_is_bucketed_per_completed_batch() -> None:
    clock = FakeClock()
    led = SlotLedger(9, clock=clock)
    s = FakeStream()
    rows = led.take(4)
    assert rows is not None
    led.free(rows[:2], s.record())
    led.free(rows[2:], s.record())
    clock.t += 0.004
    s.complete(1)
    assert led.reclaim() == 2
    clock.t += 0.5
    s.complete()
    assert led.reclaim() == 2
    snap = led.fence_histogram.snapshot()
    assert snap.count == 2 and snap.sum_s == pytest.approx(0.004 + 0.504)
    cum = {f"{b:g}": c for b, c in snap.cumulative()}
    assert cum["0.0025"] == 0 and cum["0.005"] == 1 and cum["0.5"] == 1 and cum["1"] == 2


def test_fence_latency_histogram_is_exported() -> None:
    pool = ReqToTokenPool(9, 4)
    s = FakeStream()
    rows = pool.alloc(3)
    assert rows is not None
    pool.free(rows, fence=s.record())
    s.complete()
    assert pool.reclaim() == 3
    fams = scrape((pool, "p"))
    assert value(fams, "asyncpool_fence_latency_seconds_count") == 1
    assert value(fams, "asyncpool_rows_deferred_total") == 3
    assert value(fams, "asyncpool_rows_reclaimed_total") == 3
    assert pool.stats().fence_latency.count == 1  # the window stays for stats()


# ---------------------------------------------------------------- registration


async def test_a_duplicate_registration_raises() -> None:
    async with AsyncReqToTokenPool(5, 4) as pool, AsyncReqToTokenPool(5, 4) as other:
        registry = CollectorRegistry()
        registry.register(PoolCollector(pool, name="decode"))
        with pytest.raises(ValueError, match="Duplicated"):
            registry.register(PoolCollector(other, name="decode"))
        # A second collector is refused whatever its label: the scrape would
        # carry two TYPE blocks per name. More pools go into the same one.
        with pytest.raises(ValueError, match="Duplicated"):
            registry.register(PoolCollector(other, name="prefill"))


async def test_a_replaced_replica_closed_and_removed_is_collected() -> None:
    """docs/api.md (*A router over data-parallel replicas*, *Close and
    forget*): a pool closed, drained, removed from the collector and held by
    nothing else is collected, its watcher thread ended; the collector
    exports the pool added under its label instead."""
    registry = CollectorRegistry()
    pool = AsyncReqToTokenPool(5, 4, kv=KVPagePool(9, 4), name="replaced-r0")
    collector = PoolCollector(pool, name="r0")
    registry.register(collector)
    grant = await pool.admit(pages=2)
    transfer = EventFence()  # of unknown origin: a watcher thread polls it
    pool.free(grant.row, fence=transfer)
    generate_latest(registry)
    threads = [t for t in threading.enumerate() if "replaced-r0" in t.name]
    assert threads
    transfer.event.set()
    async with bounded():
        await pool.drain(timeout=5)
        await pool.close()
    collector.remove("r0")
    replacement = AsyncReqToTokenPool(9, 4)
    collector.add(replacement, name="r0")
    ref = weakref.ref(pool)
    del pool, grant
    for thread in threads:
        thread.join(WAIT_S)
        assert not thread.is_alive()
    # A callback the watcher scheduled on the loop before it ended still
    # holds the pool until the loop runs it (in asyncio's debug mode its
    # handle lingers a turn or two more): let the loop run those first.
    await spin(10)
    gc.collect()
    assert ref() is None
    assert b'asyncpool_capacity_rows{pool="r0"} 8.0' in generate_latest(registry)
    await replacement.close()


async def test_one_collector_exports_several_pools() -> None:
    async with AsyncReqToTokenPool(5, 4) as a, AsyncReqToTokenPool(9, 4) as b:
        collector = PoolCollector(a, name="decode")
        collector.add(b, name="prefill")
        with pytest.raises(ValueError, match="decode"):
            collector.add(b, name="decode")
        # One pool under a second name would count twice in a sum over pools.
        with pytest.raises(ValueError, match=r"exports .* as 'prefill'"):
            collector.add(b, name="prefill2")
        with pytest.raises(TypeError):
            collector.add(b, name=3)  # type: ignore[arg-type]
        assert collector.names == ("decode", "prefill")
        registry = CollectorRegistry()
        registry.register(collector)
        text = generate_latest(registry).decode()
        assert text.count("# TYPE asyncpool_free_rows gauge") == 1
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        assert value(fams, "asyncpool_capacity_rows", "decode") == 4
        assert value(fams, "asyncpool_capacity_rows", "prefill") == 8
        collector.remove("prefill")
        assert 'pool="prefill"' not in generate_latest(registry).decode()


def test_describe_names_every_family_without_samples() -> None:
    pool = ReqToTokenPool(5, 4)
    described = PoolCollector(pool, name="p").describe()
    assert [f.name for f in described] == [f.name for f in PoolCollector(pool).collect()]
    assert all(not f.samples for f in described)


# ---------------------------------------------------------------- scrapes are read-only


async def test_collect_leaves_stats_unchanged() -> None:
    async with AsyncReqToTokenPool(5, 4) as pool, asyncio.timeout(WAIT_S):
        held = await pool.alloc(4)
        w = asyncio.create_task(pool.alloc(1))
        await spin()
        pool.free(held[:1])
        await w
        before = pool.stats()
        collector = PoolCollector(pool, name="p")
        for _ in range(3):
            list(collector.collect())
        assert pool.stats() == before
        pool.check_invariants()


# ---------------------------------------------------------------- Histogram


def test_histogram_buckets_are_inclusive_upper_bounds() -> None:
    h = Histogram((1.0, 2.0))
    for v in (0.0, 1.0, 1.5, 2.0, 3.0):
        h.observe(v)
    snap = h.snapshot()
    assert snap.counts == (2, 2, 1) and snap.count == 5 and snap.sum_s == 7.5
    assert snap.cumulative() == [(1.0, 2), (2.0, 4), (float("inf"), 5)]
    folded = h.snapshot(zeros=3)
    assert folded.counts == (5, 2, 1) and folded.count == 8 and folded.sum_s == 7.5
    assert h.snapshot() == snap  # snapshot(zeros=) does not mutate


@pytest.mark.parametrize(
    "bounds", [(), (2.0, 1.0), (1.0, 1.0), (1.0, float("inf")), (float("nan"),)]
)
def test_histogram_refuses_bad_bounds(bounds: tuple[float, ...]) -> None:
    with pytest.raises(ValueError):
        Histogram(bounds)


def test_default_bounds_span_10us_to_10s() -> None:
    assert DEFAULT_BOUNDS_S[0] == 1e-5 and DEFAULT_BOUNDS_S[-1] == 10.0
    assert len(DEFAULT_BOUNDS_S) == 19 and list(DEFAULT_BOUNDS_S) == sorted(DEFAULT_BOUNDS_S)
    empty = HistogramSnapshot()
    assert empty.count == 0 and len(empty.counts) == len(empty.bounds) + 1


def test_pool_stats_fields_are_documented() -> None:
    doc = PoolStats.__doc__ or ""
    for f in dataclasses.fields(PoolStats):
        assert f"{f.name}:" in doc, f.name


def test_existing_constructors_keep_working() -> None:
    st = PoolStats(8, 8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    assert st.alloc_calls == 0 and st.wait_histogram == HistogramSnapshot()


async def test_stats_without_summaries_skips_only_the_windows() -> None:
    async with AsyncReqToTokenPool(3, 4) as pool, asyncio.timeout(WAIT_S):
        held = await pool.alloc(2)
        w = asyncio.create_task(pool.alloc(1))
        await spin()
        pool.free(held[:1])
        await w
        full, cheap = pool.stats(), pool.stats(summaries=False)
        assert full.wait_time.count == 1 and cheap.wait_time.count == 0
        assert dataclasses.replace(full, wait_time=cheap.wait_time) == cheap


def test_the_metrics_table_lists_every_family() -> None:
    section = doc_section("docs/api.md", "## Metrics")  # the README's, moved there
    listed = {}
    for line in section.splitlines():
        cells = [c.strip().strip("`") for c in line.strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("asyncpool_"):
            listed[cells[0]] = cells[1]
    exported = {
        f"asyncpool_{f.name}" + ("_total" if f.type == "counter" else ""): f.type for f in FAMILIES
    }
    assert listed == exported


async def test_scrapes_from_another_thread_see_consistent_monotonic_figures() -> None:
    async with AsyncReqToTokenPool(3, 4) as pool, asyncio.timeout(4 * WAIT_S):
        registry = CollectorRegistry()
        registry.register(PoolCollector(pool, name="p"))
        seen: list[dict[str, Any]] = []

        def scrape_into_seen() -> None:
            text = generate_latest(registry).decode()
            seen.append({f.name: f for f in text_string_to_metric_families(text)})

        with calling_from_a_thread(scrape_into_seen):
            for _ in range(300):
                held = await pool.alloc(2)  # fast
                waiter = asyncio.create_task(pool.alloc(1))  # waits, then granted
                await asyncio.sleep(0)
                pool.free(held)
                pool.free(await waiter)
        assert seen
        last: dict[str, float] = {}
        for fams in seen:
            for name in ("asyncpool_alloc_wait_seconds", "asyncpool_fence_latency_seconds"):
                counts = [c for _, c in buckets(fams, name)]
                assert counts == sorted(counts)
                assert counts[-1] == value(fams, name + "_count")
            for sample in (
                "asyncpool_alloc_calls_total",
                "asyncpool_rows_allocated_total",
                "asyncpool_alloc_wait_seconds_count",
            ):
                v = value(fams, sample)
                assert v >= last.get(sample, 0.0), sample
                last[sample] = v
        final = scrape((pool, "p"))
        assert value(final, "asyncpool_alloc_wait_seconds_count") == 600


async def test_a_grant_given_back_by_a_cancelled_waiter_never_lowers_a_counter() -> None:
    async with AsyncReqToTokenPool(3, 4) as pool, asyncio.timeout(WAIT_S):
        held = await pool.alloc(2)
        w = asyncio.create_task(pool.alloc(2))
        await spin()
        pool.free(held)  # w is granted both rows...
        before = scrape((pool, "p"))
        w.cancel()  # ...and cancelled before it resumes: it gives them back
        with pytest.raises(asyncio.CancelledError):
            await w
        after = scrape((pool, "p"))
        assert pool.stats().allocs == 2  # stats() keeps not counting the given-back grant
        assert value(before, "asyncpool_rows_allocated_total") == 4
        assert value(after, "asyncpool_rows_allocated_total") == 4
        assert value(before, "asyncpool_rows_freed_total") == 2
        assert value(after, "asyncpool_rows_freed_total") == 4  # given back = left allocated
        assert value(after, "asyncpool_alloc_calls_total") == 2  # it was granted
        assert value(after, "asyncpool_alloc_cancellations_total") == 1
        assert value(after, "asyncpool_free_rows") == 2


class StatsSequence:
    """A stand-in pool whose ``stats()`` answers from a list (read skew)."""

    def __init__(self, *stats: PoolStats) -> None:
        self.answers = list(stats)

    def stats(self, *, summaries: bool = True) -> PoolStats:
        return self.answers.pop(0)


def test_a_skewed_read_never_shows_a_counter_going_down() -> None:
    base = PoolStats(8, 4, 4, 0, 0, 0, 10, 6, 0, 0, 0, 0, 0, 4, rows_granted=10)
    skewed = dataclasses.replace(base, rows_granted=10, allocated=5)  # freed 6 -> 5
    later = dataclasses.replace(base, rows_granted=12, allocated=4)
    fake = StatsSequence(base, skewed, later, skewed)
    registry = CollectorRegistry()
    collector = PoolCollector(fake, name="p")
    registry.register(collector)
    freed = "asyncpool_rows_freed_total"
    assert registry.get_sample_value(freed, {"pool": "p"}) == 6
    assert registry.get_sample_value(freed, {"pool": "p"}) == 6  # not 5
    assert registry.get_sample_value(freed, {"pool": "p"}) == 8
    collector.remove("p")
    collector.add(fake, name="p")  # a new pool under the old name starts afresh
    assert registry.get_sample_value(freed, {"pool": "p"}) == 5


async def test_admission_figures_are_exported(kit: Streams) -> None:
    stream = kit.stream()
    gate = kit.gate(stream)
    kv = KVPagePool(17, 4)
    async with AsyncReqToTokenPool(3, 4, kv=kv) as pool, asyncio.timeout(WAIT_S):
        a = await pool.admit(pages=10)
        b = await pool.admit(pages=4)
        pool.free([b.row], after=stream)
        w = asyncio.create_task(pool.admit(pages=6))
        await spin()
        fams = scrape((pool, "p"))
        assert value(fams, "asyncpool_capacity_pages") == 16
        assert value(fams, "asyncpool_free_pages") == 2
        assert value(fams, "asyncpool_allocated_pages") == 10
        assert value(fams, "asyncpool_pending_pages") == 4
        assert value(fams, "asyncpool_quarantined_pages") == 0
        assert value(fams, "asyncpool_admit_calls_total") == 2
        assert value(fams, "asyncpool_waiting_requests") == 1
        gate.open()
        g = await w
        fams = scrape((pool, "p"))
        assert value(fams, "asyncpool_admit_calls_total") == 3
        assert value(fams, "asyncpool_admit_wait_seconds_count") == 3
        assert dict(buckets(fams, "asyncpool_admit_wait_seconds"))["1e-05"] >= 2  # fast ones
        pool.free([a.row, g.row])


@pytest.mark.parametrize("bad", ["kv", "object"])
async def test_the_collector_refuses_what_it_cannot_export_and_keeps_serving(bad: str) -> None:
    """``add`` refuses a ``KVPagePool`` (its stats are another kind) and an
    object with no ``stats()``, adding nothing: accepted, either failed every
    later scrape, for every pool (found by a newcomer trial)."""
    async with bounded(), AsyncReqToTokenPool(5, 4) as pool:
        collector = PoolCollector(pool, name="p")
        registry = CollectorRegistry()
        registry.register(collector)
        wrong = KVPagePool(5, 2) if bad == "kv" else object()
        with pytest.raises(TypeError, match="export a ReqToTokenPool or an AsyncReqToTokenPool"):
            collector.add(wrong, name="wrong")  # type: ignore[arg-type]
        assert collector.names == ("p",)
        text = generate_latest(registry).decode()
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        assert value(fams, "asyncpool_capacity_rows", "p") == 4


class _Broken:
    """A pool stand-in whose ``stats()`` fails, as a pool torn down under a
    scrape might."""

    def stats(self, *, summaries: bool = True) -> PoolStats:
        raise RuntimeError("torn down")


async def test_a_pool_that_cannot_answer_is_left_out_and_the_others_exported(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One pool whose ``stats()`` raises leaves only itself out of the scrape,
    with a WARNING naming it; it failed the whole scrape (an HTTP 500) for
    every pool."""
    caplog.set_level(logging.WARNING, logger="asyncpool")
    async with bounded(), AsyncReqToTokenPool(5, 4) as pool:
        collector = PoolCollector(pool, name="good")
        collector.add(_Broken(), name="broken")
        registry = CollectorRegistry()
        registry.register(collector)
        text = generate_latest(registry).decode()
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        assert value(fams, "asyncpool_capacity_rows", "good") == 4
        assert 'pool="broken"' not in text
        msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("'broken' left out of this scrape" in m for m in msgs), msgs


# ---------------------------------------------------------------- KV groups


def hybrid(swa: int = 4, full: int = 12) -> AsyncReqToTokenPool:
    """Four rows, two KV groups of ``swa`` and ``full`` pages."""
    return AsyncReqToTokenPool(
        5, 64, kv={"swa": KVPagePool(swa + 1, 4), "full": KVPagePool(full + 1, 4)}
    )


async def test_each_kv_group_is_exported_with_a_group_label() -> None:
    """A pool with KV groups exports each group's pages by state, capacity,
    peak and counters under ``group=``, in families of their own; the summed
    families keep their one label (a ``group`` there would double count).
    Only the sums were exported: a starving swa group did not show."""
    async with bounded():
        pool = hybrid(swa=4, full=12)
        g = await pool.admit({"swa": 4, "full": 2})  # swa full, full attention idle
        assert pool.extend(g.row, 1, group="swa") is None
        fams = scrape((pool, "hybrid"))

        def group(sample: str, name: str, **labels: str) -> float:
            return value(fams, sample, "hybrid", group=name, **labels)

        pages = "asyncpool_kv_group_pages"
        assert [group(pages, "swa", state=s) for s in STATES] == [0, 4, 0, 0]
        assert [group(pages, "full", state=s) for s in STATES] == [10, 2, 0, 0]
        assert group("asyncpool_kv_group_capacity_pages", "swa") == 4
        assert group("asyncpool_kv_group_capacity_pages", "full") == 12
        assert group("asyncpool_kv_group_peak_allocated_pages", "swa") == 4
        assert group("asyncpool_kv_group_growth_refusals_total", "swa") == 1
        assert group("asyncpool_kv_group_growth_refusals_total", "full") == 0
        assert group("asyncpool_kv_group_fence_errors_total", "full") == 0
        assert value(fams, "asyncpool_capacity_pages", "hybrid") == 16  # the sums, as before
        assert value(fams, "asyncpool_free_pages", "hybrid") == 10
        assert value(fams, "asyncpool_growth_refusals_total", "hybrid") == 1
        for name, fam in fams.items():
            keys = {k for smp in fam.samples for k in smp.labels}
            if name in GROUP_GAUGES or name in GROUP_COUNTERS:
                assert keys == ({"pool", "group", "state"} if name == pages else {"pool", "group"})
            else:
                assert keys <= {"pool", "le"}, name
        # Types, and units declared in the OpenMetrics exposition.
        assert {n: fams[n].type for n in GROUP_GAUGES} == dict.fromkeys(GROUP_GAUGES, "gauge")
        assert {n: fams[n].type for n in GROUP_COUNTERS} == dict.fromkeys(GROUP_COUNTERS, "counter")
        registry = CollectorRegistry()
        registry.register(PoolCollector(pool, name="hybrid"))
        om = {f.name: f for f in parse_openmetrics(generate_openmetrics(registry).decode())}
        assert {n: om[n].unit for n in GROUP_GAUGES} == GROUP_GAUGES
        assert len(GROUP_FAMILIES) == len(GROUP_GAUGES) + len(GROUP_COUNTERS)
        pool.free(g.row)


async def test_group_families_come_only_with_a_grouped_pool() -> None:
    """Nothing new for a pool with one ``kv=`` or none; beside a grouped
    pool, the group families carry that pool's groups only, and
    ``describe()`` names what ``collect()`` gives."""
    async with bounded():
        single = AsyncReqToTokenPool(5, 8, kv=KVPagePool(9, 4))
        rows = AsyncReqToTokenPool(5, 8)
        collector = PoolCollector(single, name="single")
        collector.add(rows, name="rows")
        names = [f.name for f in collector.collect()]
        assert not any("kv_group" in n for n in names)
        assert [f.name for f in collector.describe()] == names
        collector.add(hybrid(), name="hybrid")
        collected = list(collector.collect())
        assert [f.name for f in collector.describe()] == [f.name for f in collected]
        by_name = {f.name: f for f in collected}
        caps = by_name["asyncpool_kv_group_capacity_pages"].samples
        assert sorted((s.labels["pool"], s.labels["group"], s.value) for s in caps) == [
            ("hybrid", "full", 12.0),
            ("hybrid", "swa", 4.0),
        ]
        assert len(by_name["asyncpool_kv_group_pages"].samples) == 2 * len(STATES)


def _group(**figures: int) -> KVGroupStats:
    base = dict.fromkeys(
        ("num_pages", "page_size", "capacity", "free", "allocated", "pending", "quarantined"), 0
    )
    counts = ("peak_allocated", "allocs", "frees", "deferred_frees", "reclaimed")
    base |= dict.fromkeys((*counts, "fence_errors", "pending_fences"), 0)
    return KVGroupStats(**(base | figures))


def test_a_skewed_read_never_shows_a_group_counter_going_down() -> None:
    base = PoolStats(8, 8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0)

    def with_refusals(n: int) -> PoolStats:
        groups = FrozenDict({"swa": _group(growth_refusals=n), "full": _group()})
        return dataclasses.replace(base, kv_groups=groups)

    fake = StatsSequence(with_refusals(3), with_refusals(2), with_refusals(5), with_refusals(2))
    registry = CollectorRegistry()
    collector = PoolCollector(fake, name="p")
    registry.register(collector)
    refusals = "asyncpool_kv_group_growth_refusals_total"
    swa = {"pool": "p", "group": "swa"}
    assert registry.get_sample_value(refusals, swa) == 3
    assert registry.get_sample_value(refusals, swa) == 3  # not 2
    assert registry.get_sample_value(refusals, swa) == 5
    collector.remove("p")
    collector.add(fake, name="p")  # a new pool under the old name starts afresh
    assert registry.get_sample_value(refusals, swa) == 2


def test_the_metrics_table_lists_every_group_family() -> None:
    section = doc_section("docs/api.md", "## Metrics")  # the README's, moved there
    listed = {}
    for line in section.splitlines():
        cells = [c.strip().strip("`") for c in line.strip("|").split("|")]
        if len(cells) == 5 and cells[0].startswith("asyncpool_kv_group_"):
            listed[cells[0]] = (cells[1], cells[3])
    exported = {
        f"asyncpool_{f.name}" + ("_total" if f.type == "counter" else ""): (
            f.type,
            ", ".join(["pool", "group"] + ([f.label] if f.label else [])),
        )
        for f in GROUP_FAMILIES
    }
    assert listed == exported


@pytest.mark.parametrize("how", ["closed", "raised"])
def test_a_scrape_stopped_early_keeps_no_counter_of_a_pool_removed_meanwhile(how: str) -> None:
    """A pool removed while a scrape ran loses what that scrape wrote for it
    after the removal, also when the scrape stops before its end (a
    consumer that raised, or let go of the generator): before, each such
    scrape left the pool's counters behind for good (a model reload per
    scrape that failed)."""
    pool = ReqToTokenPool(9, 8)
    collector = PoolCollector(pool, name="p")
    counters = [f.name for f in FAMILIES if f.type == "counter"]
    assert len(counters) >= 2
    scrape = collector.collect()
    for family in scrape:  # up to the first counter: its figure is kept
        if family.name == f"asyncpool_{counters[0]}":
            break
    assert collector._last
    collector.remove("p")  # a reload: drops what was kept so far
    for family in scrape:  # the scrape goes on, and keeps one more figure
        if family.name == f"asyncpool_{counters[1]}":
            break
    if how == "closed":
        scrape.close()
    else:
        with pytest.raises(RuntimeError):
            scrape.throw(RuntimeError("the consumer failed"))
    assert collector._last == {}


def test_the_metrics_table_lists_every_priority_family() -> None:
    section = doc_section("docs/api.md", "## Metrics")
    listed = {}
    for line in section.splitlines():
        cells = [c.strip().strip("`") for c in line.strip("|").split("|")]
        if len(cells) == 5 and cells[0].startswith("asyncpool_priority_"):
            listed[cells[0]] = (cells[1], cells[3])
    exported = {
        f"asyncpool_{f.name}" + ("_total" if f.type == "counter" else ""): (
            f.type,
            "pool, priority",
        )
        for f in PRIORITY_FAMILIES
    }
    assert listed == exported
    assert {f"asyncpool_{f.name}" for f in PRIORITY_FAMILIES} == (
        PRIORITY_COUNTERS | PRIORITY_HISTOGRAMS
    )


def test_a_pool_added_while_a_scrape_forgets_removed_pools_breaks_nothing() -> None:
    """add() and remove() may run on any thread while a scrape runs: an
    add() landing inside the scrape's closing walk of the exported pools
    (where it forgets the counters of pools removed meanwhile) must not
    fail the scrape. Here the walk's first step over the pools starts it in
    another thread and gives it time to run, as a thread switch would (the
    pools' dict hands out a walk that does so; a trace hook could not
    reach inside the walk on every Python: 3.12 inlines comprehensions and
    did not deliver opcode events to it); the walk iterated the live dict
    and raised ``RuntimeError: dictionary changed size during iteration``.
    (The add waits for the collector's lock now, which the walk holds: it
    lands after the walk.)"""

    collector = PoolCollector(ReqToTokenPool(9, 8), name="a")
    late = ReqToTokenPool(9, 8)
    landed: list[threading.Thread] = []
    armed = False

    class Pools(dict):  # type: ignore[type-arg]
        def values(self) -> Any:
            view = super().values()
            if not armed or landed:
                return view

            def walk() -> Iterator[Any]:
                for value in view:  # the live dict, as the scrape walks it
                    if not landed:
                        other = threading.Thread(target=collector.add, args=(late, "late"))
                        landed.append(other)
                        other.start()
                        other.join(0.05)  # its turn: done, or waiting for the walk
                    yield value

            return walk()

    collector._pools = Pools(collector._pools)
    scrape = collector.collect()
    families = list(itertools.islice(scrape, 1))  # begun: its snapshots taken
    armed = True
    families += list(scrape)
    assert landed and families
    landed[0].join(10)
    assert not landed[0].is_alive()
    assert collector.names == ("a", "late")
    assert any(key[1] is collector._pools["a"][1] for key in collector._last)


def test_a_pool_removed_while_another_is_added_breaks_nothing() -> None:
    """add() checks the pool is not exported already by walking the
    exported pools; a remove() landing inside that walk (another thread's,
    started here from a trace hook at the walk's first line and given time
    to run) must not fail the add: the walk iterated the live dict and
    raised ``RuntimeError: dictionary changed size during iteration``. (The
    remove waits for the collector's lock now, which the add holds there.)"""
    import inspect

    from asyncpool import metrics

    collector = PoolCollector(ReqToTokenPool(9, 8), name="a")
    collector.add(ReqToTokenPool(9, 8), name="b")
    new = ReqToTokenPool(9, 8)
    landed: list[threading.Thread] = []
    source, first = inspect.getsourcelines(PoolCollector.add)
    inside = first + next(i for i, line in enumerate(source) if "if exported is pool" in line)

    def removes(frame: Any, event: str, arg: Any) -> Any:
        if event == "line" and not landed and frame.f_lineno == inside:
            other = threading.Thread(target=collector.remove, args=("b",))
            landed.append(other)
            other.start()
            other.join(0.05)  # its turn: done, or waiting for the add's lock
        return removes

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename == metrics.__file__ and frame.f_code.co_name == "add":
            return removes
        return None

    with tracing(tracer):
        collector.add(new, name="c")
    assert landed
    landed[0].join(10)
    assert not landed[0].is_alive()
    assert collector.names == ("a", "c")
