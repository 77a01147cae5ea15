"""Smoke test of ``benchmarks/``: every benchmark runs, tiny, on both loops.

No timing assertions: only that each benchmark runs to the end, returns
well-formed rows, and leaves no stream, pool or task behind (the suite runs
with ``-W error``). The async tests run on every loop conftest provides.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from helpers import LONG_S, bounded

from benchmarks.bench_alloc import bench_batched, bench_contended, bench_uncontended
from benchmarks.bench_fences import bench_fenced_free, bench_reclaim_sweep, bench_wake_latency
from benchmarks.bench_scaling import bench_scaling
from benchmarks.harness import PRESETS, Row
from benchmarks.naive_pool import NaiveReqToTokenPool

SMOKE = PRESETS["smoke"]


def _check(rows: list[Row]) -> None:
    assert rows
    for row in rows:
        assert row.loop in ("asyncio", "uvloop")
        assert row.ratio > 0 and math.isfinite(row.ratio), row
        assert row.subject_value > 0 and row.reference_value > 0, row
        json.dumps(row.to_json())


def test_naive_pool_behaves_like_the_seed() -> None:
    pool = NaiveReqToTokenPool(8, 4)
    assert pool.available_size() == 7
    rows = pool.alloc(3)
    assert rows == [1, 2, 3]
    pool.verified_lens[rows] = 5
    pool.free(rows[0])
    pool.free(rows[1:])
    assert pool.verified_lens.sum().item() == 0
    assert pool.alloc(8) is None
    assert pool.alloc(7) == [4, 5, 6, 7, 1, 2, 3]  # FIFO by list order, as the seed
    pool.clear()
    assert pool.available_size() == 7


async def test_uncontended() -> None:
    async with bounded(LONG_S):
        _check(await bench_uncontended(SMOKE))


async def test_batched() -> None:
    async with bounded(LONG_S):
        _check(await bench_batched(SMOKE))


async def test_contended() -> None:
    async with bounded(LONG_S):
        _check(await bench_contended(SMOKE))


async def test_fenced_free() -> None:
    async with bounded(LONG_S):
        _check(await bench_fenced_free(SMOKE))


async def test_reclaim_sweep() -> None:
    async with bounded(LONG_S):
        rows = await bench_reclaim_sweep(SMOKE)
    _check(rows)
    assert any(r.target is not None for r in rows)


async def test_wake_latency() -> None:
    async with bounded(LONG_S):
        rows = await bench_wake_latency(SMOKE, device="cpu")
    _check(rows)
    assert rows[0].samples["idle_cpu_fraction"][0] >= 0


async def test_scaling() -> None:
    async with bounded(LONG_S):
        rows, memory = await bench_scaling(SMOKE)
    _check(rows)
    assert [int(m["size"]) for m in memory] == list(SMOKE.scaling_sizes)
    for m in memory:
        assert m["asyncpool_table_bytes"] > 0


def test_demo_on_both_loops() -> None:
    from benchmarks.bench_demo import bench_demo, demo_available
    from benchmarks.harness import loop_factories

    loops = list(loop_factories())
    rows, info = bench_demo(SMOKE, loops)
    if demo_available() is None:
        assert rows == [] and info["unavailable"]
        return
    assert "unavailable" not in info, info
    assert {r.loop for r in rows} == set(loops) or info["how"] == "cli"
    for row in rows:
        assert row.ratio > 0 and row.unit == "tok/s"
        json.dumps(row.to_json())


def test_entry_point_writes_markdown_and_json(tmp_path: Path) -> None:
    from benchmarks.run import main

    md, js = tmp_path / "bench.md", tmp_path / "bench.json"
    # The demo has its own test; here it only has to be wired in.
    argv = ["--preset", "smoke", "--md", str(md), "--json", str(js), "--loops", "asyncio",
            "--clock", "cpu"]
    assert main(argv) == 0
    text = md.read_text(encoding="utf-8")
    assert "| Benchmark |" in text and "## Targets" in text
    data = json.loads(js.read_text(encoding="utf-8"))
    assert data["rows"] and data["machine"]["python"]
    benches = {r["bench"] for r in data["rows"]}
    assert any("uncontended" in b for b in benches)
    assert {r["loop"] for r in data["rows"]} >= {"asyncio"}
    # The demo is either measured or reported as not available, never silently dropped.
    assert any("demo" in b for b in benches) or "demo" in data["unavailable"]
    # A saved run re-renders to the same markdown without measuring anything.
    again = tmp_path / "again.md"
    assert main(["--from-json", str(js), "--md", str(again)]) == 0
    assert again.read_text(encoding="utf-8").replace(
        f"Every sample of this run is in `{js}`; `python -m benchmarks --from-json {js}` "
        "re-renders this page.\n\n", ""
    ) == text


@pytest.mark.parametrize("argv", [["--only", "nope"], ["--loops", "nope"]])
def test_entry_point_rejects_unknown_names(argv: list[str]) -> None:
    from benchmarks.run import main

    with pytest.raises(SystemExit):
        main(["--preset", "smoke", "--no-md", *argv])


@pytest.mark.timeout(180)
def test_agree_benchmark_runs_two_ranks() -> None:
    from benchmarks.bench_agree import PENDING, bench_agree

    rows, info = bench_agree(SMOKE)
    assert len(rows) == 2 * len(PENDING)
    for row in rows:
        assert row.bench == "agree" and row.unit == "us"
        assert row.subject_value > 0 and math.isfinite(row.ratio), row
        json.dumps(row.to_json())
    assert info["world"] == 2
