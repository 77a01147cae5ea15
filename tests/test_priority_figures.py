"""Per-priority figures: ``stats().by_priority``, the ``priority`` label in
the metrics, and errors that name the priority and the pool.

A multi-tenant platform (paid tiers at priority 0, free at 1, batch at 2-3)
could not see from ``stats()`` or the metrics that tier 3 waited seconds
while tier 0 waited microseconds, nor which tier took the timeouts,
cancellations and sheds: every figure counted the priorities together
(``waiting_by_priority()`` gave live queue depths only), and a timeout's or a
``PoolBusyError``'s message named neither the priority nor the pool.
"""

from __future__ import annotations

import asyncio

import pytest
from helpers import bounded
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import asyncpool
from asyncpool import AsyncReqToTokenPool, KVPagePool, PoolBusyError
from asyncpool import stats as stats_module
from asyncpool.metrics import PoolCollector
from asyncpool.stats import FrozenDict

# Read in the tests (not imported at the top), so that each test fails on
# its own on a pool without per-priority figures.
PRIORITY_STATS = "PriorityStats"


async def _queued(pool: AsyncReqToTokenPool, prio: int, **kw: object) -> asyncio.Task[object]:
    task = asyncio.create_task(pool.alloc(1, priority=prio, **kw))  # type: ignore[arg-type]
    await asyncio.sleep(0)  # queued
    return task


async def test_each_priority_has_its_own_waits_timeouts_cancellations_and_rejections():
    async with AsyncReqToTokenPool(3, 4, max_waiters=3) as pool:
        rows = await pool.alloc(2)  # full: every later call queues
        assert pool.stats().by_priority == {}
        granted0 = await _queued(pool, 0)
        granted3 = await _queued(pool, 3)
        timed_out = await _queued(pool, 3, timeout=0.001)
        with pytest.raises(PoolBusyError):
            await pool.alloc(1, priority=2)  # shed: 3 already queue
        async with bounded():
            with pytest.raises(TimeoutError):
                await timed_out
        cancelled = await _queued(pool, 1)
        cancelled.cancel()
        async with bounded():
            with pytest.raises(asyncio.CancelledError):
                await cancelled
        pool.free([rows[0]])  # priority 0 first
        async with bounded():
            got0 = await granted0
        pool.free([rows[1]])
        async with bounded():
            got3 = await granted3
        st = pool.stats()
        assert isinstance(st.by_priority, FrozenDict)
        assert list(st.by_priority) == [0, 1, 2, 3]  # most urgent first
        p0, p1, p2, p3 = (st.by_priority[p] for p in (0, 1, 2, 3))
        assert all(isinstance(p, getattr(asyncpool, PRIORITY_STATS)) for p in (p0, p1, p2, p3))
        assert (p0.wait_histogram.count, p1.wait_histogram.count) == (1, 0)
        assert (p2.wait_histogram.count, p3.wait_histogram.count) == (0, 1)
        assert [(p.timeouts, p.cancellations, p.rejections) for p in (p0, p1, p2, p3)] == [
            (0, 0, 0),
            (0, 1, 0),
            (0, 0, 1),
            (1, 0, 0),
        ]
        # Each is its own: the pool-wide sum of queued waits is theirs.
        assert p3.wait_histogram.sum_s > 0.0 and p0.wait_histogram.sum_s > 0.0
        assert st.wait_histogram.sum_s == p0.wait_histogram.sum_s + p3.wait_histogram.sum_s
        # The pool-wide figures are their sums (the zero wait of the call
        # granted without queueing besides).
        assert st.timeouts == 1 and st.cancellations == 1 and st.rejections == 1
        assert st.wait_histogram.count == 1 + 2
        assert st.wait_histogram.counts[0] >= 1
        tiers = sum(p.wait_histogram.count for p in st.by_priority.values())
        assert tiers == st.wait_histogram.count - 1
        assert st.other_priorities is None
        pool.free(got0 + got3)  # type: ignore[operator]


async def test_admissions_are_counted_per_priority_apart_from_allocs():
    async with AsyncReqToTokenPool(3, 16, kv=KVPagePool(9, 4)) as pool:
        held = await pool.admit(pages=8)
        task = asyncio.create_task(pool.admit(pages=2, priority=2))
        await asyncio.sleep(0)
        pool.free([held.row])
        async with bounded():
            grant = await task
        st = pool.stats()
        p2 = st.by_priority[2]
        assert p2.admit_wait_histogram.count == 1 and p2.wait_histogram.count == 0
        # admits: the queued one at priority 2 and the one granted at once.
        assert st.admits == st.admit_wait_histogram.count == 2
        assert st.admit_wait_histogram.sum_s == p2.admit_wait_histogram.sum_s
        pool.free([grant.row])


async def test_priorities_past_the_cap_are_counted_together():
    async with AsyncReqToTokenPool(2, 4) as pool:
        row = await pool.alloc(1)
        cap: int = stats_module.MAX_PRIORITIES  # type: ignore[attr-defined,unused-ignore]
        prios = list(range(cap + 3))
        tasks = [asyncio.create_task(pool.alloc(1, priority=p, timeout=0.001)) for p in prios]
        async with bounded():
            results = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(r, TimeoutError) for r in results)
        st = pool.stats()
        assert list(st.by_priority) == prios[:cap]
        assert all(p.timeouts == 1 for p in st.by_priority.values())
        assert st.other_priorities is not None and st.other_priorities.timeouts == 3
        assert st.timeouts == len(prios)
        fams = _scrape(pool)
        labels = {s.labels["priority"] for s in fams["asyncpool_priority_timeouts"].samples}
        assert labels == {str(p) for p in prios[:cap]} | {"other"}
        pool.free(row)


def _scrape(pool: AsyncReqToTokenPool) -> dict[str, object]:
    registry = CollectorRegistry()
    registry.register(PoolCollector(pool, name="p"))
    text = generate_latest(registry).decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


async def test_the_collector_labels_each_priority_and_keeps_the_pool_wide_series():
    async with AsyncReqToTokenPool(2, 4) as pool:
        fams = _scrape(pool)
        # A pool that queues has the families, with no samples before a call queued.
        assert fams["asyncpool_priority_timeouts"].samples == []  # type: ignore[attr-defined]
        row = await pool.alloc(1)
        task = await _queued(pool, 3)
        with pytest.raises(TimeoutError):
            await pool.alloc(1, priority=1, timeout=0.001)
        pool.free(row)
        async with bounded():
            got = await task
        fams = _scrape(pool)
        samples = {
            (s.name, s.labels.get("priority"), s.labels.get("le")): s.value
            for f in fams.values()
            for s in f.samples  # type: ignore[attr-defined]
        }
        hist = "asyncpool_priority_alloc_queue_wait_seconds"
        assert samples[(hist + "_count", "3", None)] == 1
        assert samples[(hist + "_bucket", "3", "+Inf")] == 1
        assert samples[(hist + "_count", "1", None)] == 0  # timed out: not a wait
        assert samples[("asyncpool_priority_timeouts_total", "1", None)] == 1
        assert samples[("asyncpool_priority_timeouts_total", "3", None)] == 0
        assert samples[("asyncpool_priority_admit_queue_wait_seconds_count", "3", None)] == 0
        # The pool-wide series are as before: no priority label.
        assert samples[("asyncpool_alloc_timeouts_total", None, None)] == 1
        assert samples[("asyncpool_alloc_wait_seconds_count", None, None)] == 2
        pool.free(got)  # type: ignore[arg-type]


async def test_a_timeout_names_the_priority_and_the_pool():
    async with AsyncReqToTokenPool(2, 4, name="decode") as pool:
        row = await pool.alloc(1)
        with pytest.raises(
            TimeoutError,
            match=r"^AsyncReqToTokenPool 'decode': alloc\(1\) timed out after 0.001 s: 1 row "
            r"could not be granted in time at priority 7$",
        ):
            await pool.alloc(1, priority=7, timeout=0.001)
        pool.free(row)
    async with AsyncReqToTokenPool(2, 4, kv=KVPagePool(5, 4)) as pool:
        held = await pool.admit(pages=1)
        with pytest.raises(
            TimeoutError, match=r"^AsyncReqToTokenPool: admit\(pages=2\) .* at priority 2$"
        ):
            await pool.admit(pages=2, priority=2, timeout=0.001)
        pool.free([held.row])


async def test_a_shed_call_names_the_priority_and_the_pool():
    async with AsyncReqToTokenPool(2, 4, max_waiters=1, name="prefill") as pool:
        row = await pool.alloc(1)
        task = await _queued(pool, 0)
        with pytest.raises(
            PoolBusyError,
            match=r"^AsyncReqToTokenPool 'prefill': 1 waiter already queued, the limit set by "
            r"max_waiters=1; refusing to queue alloc\(1\) at priority 3$",
        ):
            await pool.alloc(1, priority=3)
        assert pool.stats().by_priority[3].rejections == 1
        pool.free(row)
        async with bounded():
            pool.free(await task)  # type: ignore[arg-type]


async def test_a_cancelled_threadsafe_grant_counts_at_its_priority():
    async with AsyncReqToTokenPool(3, 4) as pool:
        pool._give_back_undelivered(await pool.alloc(1), 2)
        st = pool.stats()
        assert st.cancellations == 1 and st.by_priority[2].cancellations == 1
