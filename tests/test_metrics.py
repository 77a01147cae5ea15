"""The optional Prometheus collector exposes the pool's stats."""

from __future__ import annotations

import pytest
from helpers import bounded

from asyncpool import AsyncReqToTokenPool

prometheus_client = pytest.importorskip("prometheus_client")


async def test_collector_exposes_counts_and_totals() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from asyncpool.metrics import PoolCollector

    pool = AsyncReqToTokenPool(9, 4)
    async with bounded():
        rows = await pool.alloc(3)
    pool.free(rows[:1])
    registry = CollectorRegistry()
    registry.register(PoolCollector(pool, name="decode"))
    text = generate_latest(registry).decode()
    assert 'asyncpool_capacity{pool="decode"} 8.0' in text
    assert 'asyncpool_allocated{pool="decode"} 2.0' in text
    assert 'asyncpool_free{pool="decode"} 6.0' in text
    assert 'asyncpool_allocs_total{pool="decode"} 3.0' in text
    assert 'asyncpool_frees_total{pool="decode"} 1.0' in text
    assert 'asyncpool_wait_time_seconds{pool="decode",quantile="0.99"}' in text
    assert registry.get_sample_value("asyncpool_pending", {"pool": "decode"}) == 0.0
    pool.free(rows[1:])
    async with bounded():
        await pool.close()
