"""Issue 11: what a Prometheus scrape of a pool costs.

The pool first serves ``cfg.metrics_samples`` (10^4) queued allocations and
as many frees behind fences (a :class:`~asyncpool.HostStream`), so both
latency windows are full and both histograms hold 10^4 observations. Then,
interleaved: ``generate_latest(registry)`` with one
:class:`~asyncpool.metrics.PoolCollector` registered (the whole scrape:
``stats(summaries=False)``, every family of ``FAMILIES``, the text format), against
``pool.stats()`` with its percentile summaries (what the old collector read
on every scrape; sorting the two sample windows is most of it). Pass mark,
absolute: under 1 ms per scrape, reported as the ratio to a constant 1 ms
reference. Not a timed test: a benchmark row.
"""

from __future__ import annotations

import asyncio
import threading

from .harness import Config, Row, Target, clock_of, compare, interleave, loop_name

__all__ = ["SCRAPE_TARGET_NS", "SCRAPE_VS_BUDGET", "bench_metrics_scrape"]

SCRAPE_TARGET_NS = 1e6  # one scrape of a pool with 10^4 recent samples: < 1 ms
SCRAPE_VS_BUDGET = Target("<=", 1.0)


async def _fill(pool: object, samples: int) -> None:
    """Give ``pool`` ``samples`` queued-alloc waits and fence latencies."""
    from asyncpool import AsyncReqToTokenPool, HostStream

    assert isinstance(pool, AsyncReqToTokenPool)
    held = await pool.alloc(pool.capacity)
    for _ in range(samples):  # each alloc queues, then is granted by the free
        waiter = asyncio.create_task(pool.alloc(1))
        await asyncio.sleep(0)
        pool.free([held.pop()])
        held += await waiter
    pool.free(held)
    with HostStream(name="bench-metrics") as stream:
        batch = min(256, pool.capacity)
        done = 0
        while done < samples:
            k = min(batch, samples - done)
            gate = threading.Event()
            stream.launch(gate.wait)  # hold the fences until all k are recorded
            for _ in range(k):  # one fence batch per free
                pool.free(await pool.alloc(1), after=stream)
            gate.set()
            async with asyncio.timeout(60):
                await pool.drain()
            done += k


async def bench_metrics_scrape(cfg: Config) -> list[Row]:
    """``generate_latest`` of one pool's collector vs ``stats()`` with percentiles."""
    from prometheus_client import CollectorRegistry, generate_latest

    from asyncpool import AsyncReqToTokenPool
    from asyncpool.metrics import PoolCollector

    loop = loop_name()
    now = clock_of(cfg)
    pool = AsyncReqToTokenPool(512, 8, device="cpu")
    try:
        await _fill(pool, cfg.metrics_samples)
        registry = CollectorRegistry()
        registry.register(PoolCollector(pool, name="decode"))

        async def scrape(n: int) -> int:
            t0 = now()
            for _ in range(n):
                generate_latest(registry)
            return now() - t0

        async def full_stats(n: int) -> int:
            stats = pool.stats
            t0 = now()
            for _ in range(n):
                stats()
            return now() - t0

        per_op = await interleave(
            {"scrape": scrape, "stats": full_stats},
            rounds=cfg.rounds,
            target_s=cfg.sample_s,
            start=1,
        )
        st = pool.stats(summaries=False)
        assert st.wait_histogram.count >= cfg.metrics_samples
        assert st.fence_latency_histogram.count == cfg.metrics_samples
    finally:
        await pool.close()
    # The absolute pass mark as a constant reference: ratio = scrape / 1 ms.
    per_op["budget"] = [SCRAPE_TARGET_NS] * len(per_op["scrape"])
    bench = f"metrics scrape ({cfg.metrics_samples:,} samples)"
    scraper = "generate_latest, one PoolCollector"
    return [
        compare(
            per_op,
            bench=bench,
            loop=loop,
            subject="scrape",
            reference="budget",
            unit="ns/scrape",
            speedup=False,
            target=SCRAPE_VS_BUDGET,
            subject_label=scraper,
            reference_label="a 1 ms budget",
        ),
        compare(
            per_op,
            bench=bench,
            loop=loop,
            subject="scrape",
            reference="stats",
            unit="ns/scrape",
            speedup=False,
            subject_label=scraper,
            reference_label="pool.stats() with percentiles",
        ),
    ]
