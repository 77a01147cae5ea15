"""The PromQL of docs/api.md's *Metrics* section against a real scrape.

An SRE copies those queries into alerts and dashboards: every metric name
they use must be a sample name of the exposition, every label they group,
match or ignore must be on those samples (a typo'd name or label gives an
empty result, never an error, so an alert that cannot fire), and the ones
evaluable by hand give what the pools' own figures say. The scrape holds
three pools, as in production: one with KV groups, one named with a
``fence_timeout``, one whose calls queued, timed out and were refused at
four priorities; it goes through ``generate_latest`` and
``prometheus_client.parser``, as Prometheus reads it.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from helpers import bounded, doc_section, grouped_pool, queued_call

from asyncpool import AsyncReqToTokenPool, PoolBusyError
from asyncpool.metrics import PoolCollector

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

_BLOCK = re.compile(r"^```promql\n(.*?)^```", re.M | re.S)
_NAME = re.compile(r"\basyncpool_[a-z_]+\b")
_GROUPING = re.compile(r"\b(?:by|ignoring|on|without)\s*\(([^)]*)\)")
_MATCHER = re.compile(r"(asyncpool_[a-z_]+)\{([^}]*)\}")
_PAIR = re.compile(r'(\w+)\s*=\s*"([^"]*)"')


def _queries() -> list[str]:
    blocks = _BLOCK.findall(doc_section("docs/api.md", "## Metrics"))
    assert len(blocks) == 1, "the Metrics section has one promql block"
    lines = [line.strip() for line in blocks[0].splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


async def _scrape() -> tuple[list[Any], dict[str, list[Any]]]:
    """Three pools' scrape: its parsed samples, by sample name."""
    grouped = grouped_pool()
    named = AsyncReqToTokenPool(3, 8, name="decode", fence_timeout=5.0)
    tiers = AsyncReqToTokenPool(2, 8, max_waiters=1, name="tiers")
    collector = PoolCollector(grouped, name="grouped")
    collector.add(named)
    collector.add(tiers)
    registry = prometheus_client.CollectorRegistry()
    registry.register(collector)
    held = await tiers.alloc(1)
    got = await grouped.admit(pages={"swa": 2, "full": 3})
    async with bounded():
        for priority in range(4):
            with pytest.raises(TimeoutError):
                await tiers.alloc(1, priority=priority, timeout=0.001)
        queued = await queued_call(tiers.alloc(1, priority=3))
        with pytest.raises(PoolBusyError):
            await tiers.alloc(1, priority=2)
        tiers.free(held)
        tiers.free(await queued)
    text = prometheus_client.generate_latest(registry).decode()
    grouped.free([got.row])
    samples = [s for fam in text_string_to_metric_families(text) for s in fam.samples]
    by_name: dict[str, list[Any]] = {}
    for s in samples:
        by_name.setdefault(s.name, []).append(s)
    return samples, by_name


def test_the_section_documents_the_queries_an_sre_needs() -> None:
    text = " ".join(_queries())
    for needed in (
        "histogram_quantile(0.99",
        "asyncpool_priority_timeouts_total",
        "asyncpool_queue_oldest_wait_seconds",
        "asyncpool_fence_errors_total",
        "asyncpool_quarantined_rows",
    ):
        assert needed in text


async def test_every_documented_name_and_label_is_in_a_scrape() -> None:
    _, by_name = await _scrape()
    checked = 0
    for query in _queries():
        names = _NAME.findall(query)
        assert names, query
        for name in names:
            assert by_name.get(name), f"{name} (in {query!r}) is not a sample of the scrape"
        labels = {lab for s in (s for n in names for s in by_name[n]) for lab in s.labels}
        for grouping in _GROUPING.findall(query):
            for label in filter(None, (x.strip() for x in grouping.split(","))):
                assert label in labels, f"label {label!r} of {query!r} is on none of its samples"
        for name, matchers in _MATCHER.findall(query):
            for label, value in _PAIR.findall(matchers):
                values = {s.labels.get(label) for s in by_name[name]}
                assert value in values, f"{name}{{{label}={value!r}}} matches no sample"
        checked += 1
    assert checked >= 8


async def test_the_documented_queries_evaluated_by_hand() -> None:
    samples, by_name = await _scrape()
    # histogram_quantile's input: after sum by (pool, priority, le), each
    # (pool, priority) has increasing le buckets ending at +Inf, per priority.
    series: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for s in by_name["asyncpool_priority_alloc_queue_wait_seconds_bucket"]:
        key = (s.labels["pool"], s.labels["priority"])
        series.setdefault(key, []).append((float(s.labels["le"]), s.value))
    assert sorted(series) == [("tiers", str(p)) for p in range(4)]
    for buckets in series.values():
        assert buckets[-1][0] == float("inf")
        assert [v for _, v in buckets] == sorted(v for _, v in buckets)
    assert series[("tiers", "3")][-1][1] == 1  # the one call that queued and was granted
    # sum by (pool, priority) of the per-priority counters: one series each.
    timeouts = {
        (s.labels["pool"], s.labels["priority"]): s.value
        for s in by_name["asyncpool_priority_timeouts_total"]
    }
    assert timeouts == {("tiers", str(p)): 1.0 for p in range(4)}
    rejections = {
        (s.labels["pool"], s.labels["priority"]): s.value
        for s in by_name["asyncpool_priority_rejections_total"]
    }
    assert rejections[("tiers", "2")] == 1.0 and sum(rejections.values()) == 1.0
    # free / ignoring(state) capacity: one-to-one on (pool, group), the
    # share each group has free (the admission, 2 of 8 and 3 of 12, held).
    capacity = {
        (s.labels["pool"], s.labels["group"]): s.value
        for s in by_name["asyncpool_kv_group_capacity_pages"]
    }
    free = {
        (s.labels["pool"], s.labels["group"]): s.value
        for s in by_name["asyncpool_kv_group_pages"]
        if s.labels["state"] == "free"
    }
    assert set(free) == set(capacity) == {("grouped", "swa"), ("grouped", "full")}
    assert {k: free[k] / capacity[k] for k in free} == {
        ("grouped", "swa"): 0.75,
        ("grouped", "full"): 0.75,
    }
    # the gauges alerted on: one sample per pool, all idle here.
    for name in (
        "asyncpool_queue_oldest_wait_seconds",
        "asyncpool_overdue_fences",
        "asyncpool_quarantined_rows",
    ):
        assert {s.labels["pool"]: s.value for s in by_name[name]} == {
            "grouped": 0.0,
            "decode": 0.0,
            "tiers": 0.0,
        }
    assert samples
