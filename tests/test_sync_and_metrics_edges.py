"""Edges of the sync pool, stats and metrics, found by a review.

Each test failed before its fix:

* the synchronous pool's ``available_size()`` left out rows whose fences
  had completed, and nothing else reclaims a synchronous pool: a seed-style
  scheduler sizing its batch by it saw 0 free rows for good;

* a pool re-added under a name the collector's ``remove`` dropped while a
  scrape was running inherited its predecessor's counters (the scrape wrote
  its last-exported values back after ``remove`` had cleared them, and the
  never-go-down clamp then held the new pool's counters at the old values);
* ``generation(row)`` read another row's tag for a negative id or a bool and
  raised a raw ``IndexError``/``TypeError`` for others;
* ``LatencySummary``'s p99 was one rank too high whenever ``0.99 n`` is a
  whole number (p99 of 100 samples was their maximum), against its own
  "nearest-rank" docstring and ``scheduler_demo.report.percentile``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from helpers import EventFence, counter_values

from asyncpool import AsyncReqToTokenPool, InvalidSlotError, KVPagePool, ReqToTokenPool
from asyncpool.stats import LatencySummary, PoolStats


def test_pool_readded_after_a_remove_during_a_scrape_starts_its_counters_afresh() -> None:
    pytest.importorskip("prometheus_client")
    from asyncpool.metrics import PoolCollector

    collector = PoolCollector()
    old = ReqToTokenPool(9, 4)
    for _ in range(3):
        assert old.alloc(2) is not None

    class RemovedMidScrape:
        """The operator's thread runs remove() while this scrape reads stats."""

        def stats(self, *, summaries: bool = True) -> PoolStats:
            snapshot = old.stats(summaries=summaries)
            collector.remove("decode")
            return snapshot

    collector.add(RemovedMidScrape(), "decode")
    assert counter_values(collector)["asyncpool_alloc_calls"] == 3.0
    assert collector.names == ()

    new = ReqToTokenPool(9, 4)
    collector.add(new, "decode")
    assert new.alloc(1) is not None
    counters = counter_values(collector)
    assert counters["asyncpool_alloc_calls"] == 1.0
    assert counters["asyncpool_rows_allocated"] == 1.0
    # And nothing of the removed pool is kept.
    assert len(collector._last) == len(counters)


def test_remove_then_add_between_scrapes_still_starts_afresh() -> None:
    pytest.importorskip("prometheus_client")
    from asyncpool.metrics import PoolCollector

    old = ReqToTokenPool(9, 4)
    assert old.alloc(4) is not None
    collector = PoolCollector(old, name="p")
    assert counter_values(collector)["asyncpool_rows_allocated"] == 4.0
    collector.remove("p")
    new = ReqToTokenPool(9, 4)
    collector.add(new, "p")
    assert counter_values(collector)["asyncpool_rows_allocated"] == 0.0


@pytest.mark.parametrize("make", [lambda: ReqToTokenPool(5, 4), lambda: AsyncReqToTokenPool(5, 4)])
@pytest.mark.parametrize("bad", [-1, -4, 5, 10**30, True, 1.0, "1", None])
def test_generation_refuses_what_is_not_a_row_id(make: Any, bad: object) -> None:
    pool = make()
    rows = pool.try_alloc(4) if isinstance(pool, AsyncReqToTokenPool) else pool.alloc(4)
    assert rows == [1, 2, 3, 4]
    with pytest.raises(InvalidSlotError):
        pool.generation(bad)


@pytest.mark.parametrize("make", [lambda: ReqToTokenPool(5, 4), lambda: AsyncReqToTokenPool(5, 4)])
def test_generation_takes_row_ids_in_every_integer_form(make: Any) -> None:
    pool = make()
    rows = pool.try_alloc(2) if isinstance(pool, AsyncReqToTokenPool) else pool.alloc(2)
    tag = pool.generation(rows[1])
    assert tag == 2
    assert pool.generation(np.int64(rows[1])) == tag
    assert pool.generation(torch.tensor(rows[1])) == tag
    assert pool.generation(0) == 0 and pool.generation(4) == 0


@pytest.mark.parametrize("n", [1, 2, 3, 99, 100, 101, 199, 200, 1000, 4096])
def test_latency_summary_percentiles_are_nearest_rank(n: int) -> None:
    data = [float(i) for i in range(1, n + 1)]
    summary = LatencySummary.of(reversed(data))

    def rank(q: float) -> float:
        return data[math.ceil(q / 100 * n) - 1]

    assert summary.p50_s == rank(50)
    assert summary.p99_s == rank(99)
    assert summary.max_s == data[-1] and summary.count == n


def test_sync_available_size_counts_rows_whose_fences_completed() -> None:
    # A seed-style scheduler sizes its batch by available_size() and calls
    # alloc() only when it is positive (SGLang's available_req_slots). Rows
    # freed behind a step that has since completed must count, or nothing
    # ever reclaims them and admission stops for good.
    pool = ReqToTokenPool(5, 8)
    rows = pool.alloc(4)
    assert rows is not None
    step = EventFence()
    pool.record_use(rows, step)
    assert pool.free(rows) == 0
    assert pool.available_size() == 0 and pool.pending_size() == 4
    step.set()
    assert pool.available_size() == 4
    assert pool.pending_size() == 0
    pool.check_invariants()


def test_sync_available_size_asks_no_fence_when_explicit_or_nothing_pending() -> None:
    pool = ReqToTokenPool(5, 8, reclaim="explicit")
    rows = pool.alloc(2)
    assert rows is not None
    step = EventFence()
    pool.record_use(rows, step)
    pool.free(rows)
    step.set()
    assert pool.available_size() == 2 and step.queries == 0  # retire/agree only
    auto = ReqToTokenPool(5, 8)
    held = auto.alloc(1)
    assert held is not None
    other = EventFence()
    auto.record_use(held, other)
    assert auto.available_size() == 3 and other.queries == 0  # nothing pending


def test_a_page_pool_of_its_own_counts_pages_whose_fences_completed() -> None:
    # The same for a KVPagePool used as a seed-style token allocator: its
    # scheduler checks available_size() before alloc().
    kv = KVPagePool(9, 4)
    pages = kv.alloc(8)
    assert pages is not None
    step = EventFence()
    assert kv.free(pages, fence=step) == 0
    assert kv.available_size() == 0 and kv.pending_size() == 8
    step.set()
    assert kv.available_size() == 8 and kv.pending_size() == 0
    kv.check_invariants()
    explicit = KVPagePool(9, 4, reclaim="explicit")
    held = explicit.alloc(2)
    assert held is not None
    other = EventFence()
    explicit.free(held, fence=other)
    other.set()
    assert explicit.available_size() == 6 and other.queries == 0  # retire/agree only
