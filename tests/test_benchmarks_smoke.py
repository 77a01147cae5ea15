"""Smoke test of ``benchmarks/``: every benchmark runs, tiny, on both loops.

No timing assertions: only that each benchmark runs to the end, returns
well-formed rows, and leaves no stream, pool or task behind (the suite runs
with ``-W error``). The async tests run on every loop conftest provides.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import re
import time
from pathlib import Path

import pytest
from helpers import LONG_S, bounded

from benchmarks import ablation, grant_parts, scrape_costs
from benchmarks import bench_decode as decode_mod
from benchmarks import bench_pages as pages_mod
from benchmarks.bench_admit import bench_admit
from benchmarks.bench_alloc import bench_batched, bench_contended, bench_uncontended
from benchmarks.bench_decode import bench_decode
from benchmarks.bench_fences import (
    bench_fenced_free,
    bench_reclaim_sweep,
    bench_wait_fence,
    bench_wake_latency,
    bench_wake_slow_fences,
)
from benchmarks.bench_groups import bench_groups
from benchmarks.bench_pages import bench_pages
from benchmarks.bench_scaling import bench_scaling
from benchmarks.harness import PRESETS, Row
from benchmarks.naive_pages import NaivePagePool
from benchmarks.naive_pool import NaiveReqToTokenPool
from benchmarks.report import PEERS_INSTALL, REPO

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


def test_naive_page_pool_behaves_like_sglangs_allocator() -> None:
    pool = NaivePagePool(8, 16)
    assert pool.available_size() == 7
    pages = pool.alloc(3)
    assert pages is not None and pages.tolist() == [1, 2, 3]
    assert pool.alloc(5) is None and pool.available_size() == 4
    pool.free(pages[1:])
    pool.free(pages[:0])
    assert pool.available_size() == 6
    again = pool.alloc(6)
    assert again is not None and again.tolist() == [2, 3, 4, 5, 6, 7]  # freed first (LIFO)
    pool.clear()
    assert pool.available_size() == 7
    with pytest.raises(ValueError):
        NaivePagePool(1, 16)


def _check_pages(rows: list[Row]) -> None:
    assert rows
    for row in rows:
        assert row.loop == pages_mod.LOOP
        assert row.ratio > 0 and math.isfinite(row.ratio), row
        assert row.subject_value > 0 and row.reference_value > 0, row
        assert row.subject.startswith("asyncpool KVPagePool"), row
        json.dumps(row.to_json())


async def test_pages() -> None:
    async with bounded(LONG_S):
        rows, skipped = await bench_pages(SMOKE)
    _check_pages(rows)
    counts = SMOKE.pages_counts
    # The seed-style peer is always there, at every n.
    assert {r.bench for r in rows if r.reference.startswith("seed-style")} == {
        pages_mod.bench_name(n) for n in counts
    }
    flat = [r for r in rows if r.target is pages_mod.FLATNESS]
    assert len(flat) == 1 and "256 pages" in flat[0].subject
    # Each real peer is measured (its rows, with their targets) or said skipped, never both.
    for peer in (pages_mod.SGLANG, pages_mod.VLLM):
        measured = [r for r in rows if r.reference.startswith(peer)]
        why = skipped.get(f"pages vs {peer}")
        assert bool(measured) != bool(why), (peer, measured, why)
        if why:
            assert why.startswith("skipped:") and "install_peers.sh" in why
        else:
            assert sum(r.target is not None for r in measured) == 2


async def test_pages_peers_found_skipped_and_broken(monkeypatch: pytest.MonkeyPatch) -> None:
    """A missing peer and one that fails to build are skipped with the reason;
    an importable one is timed and its targets are judged."""

    def broken(num_pages: int, page_size: int) -> pages_mod.Contender:
        raise RuntimeError("no CUDA here")

    def stand_in(num_pages: int, page_size: int) -> pages_mod.Contender:
        pool = NaivePagePool(num_pages, page_size)
        return pages_mod.Contender(
            pages_mod.VLLM,
            "vLLM stand-in",
            pool.alloc,
            pool.free,
            1,
            lambda t: int(t.numel()),
            pool.available_size,
        )

    monkeypatch.setattr(
        pages_mod,
        "PEERS",
        {
            pages_mod.SGLANG: ("asyncpool_no_such_peer", broken),
            pages_mod.VLLM: ("numpy", stand_in),
            "Broken": ("numpy", broken),
        },
    )
    async with bounded(LONG_S):
        rows, skipped = await bench_pages(SMOKE)
    _check_pages(rows)
    assert set(skipped) == {"pages vs SGLang", "pages vs Broken"}
    assert "`asyncpool_no_such_peer` is not importable" in skipped["pages vs SGLang"]
    assert "RuntimeError: no CUDA here" in skipped["pages vs Broken"]
    judged = {
        (r.bench, r.target)
        for r in rows
        if r.reference == "vLLM stand-in" and r.subject == "asyncpool KVPagePool"
    }
    # The checked path (a copy freed) is context against each peer, never judged.
    assert all(
        r.target is None
        for r in rows
        if r.subject.startswith("asyncpool KVPagePool, freeing a copy")
    )
    assert judged == {
        (pages_mod.bench_name(n), pages_mod.TARGETS.get((pages_mod.VLLM, n)))
        for n in SMOKE.pages_counts
    }
    one = next(
        r for r in rows if r.reference == "vLLM stand-in" and r.bench == pages_mod.bench_name(1)
    )
    assert one.ratio_label.startswith("cost")  # "within 3x of vLLM" is a cost ratio


def _check_decode(rows: list[Row]) -> None:
    for row in rows:
        assert row.loop == decode_mod.LOOP and row.unit == "ns/step" and row.target is None
        assert row.bench in (decode_mod.BENCH_PAGES, decode_mod.BENCH_SLOTS), row
        assert row.subject.startswith("asyncpool"), row
        assert row.ratio > 0 and math.isfinite(row.ratio), row
        assert row.subject_value > 0 and row.reference_value > 0, row
        json.dumps(row.to_json())


async def test_decode() -> None:
    """The asyncpool sides always run (their page counts checked every step);
    each peer is measured or said skipped, never both."""
    async with bounded(LONG_S):
        rows, skipped = await bench_decode(SMOKE)
    _check_decode(rows)
    for peer, (_, _, bench) in decode_mod.PEERS.items():
        measured = [r for r in rows if peer in r.samples]  # keyed by the PEERS name
        why = skipped.get(f"decode vs {peer}")
        assert bool(measured) != bool(why), (peer, measured, why)
        if why:
            assert why.startswith("skipped:") and "install_peers.sh" in why
        else:
            assert [r.bench for r in measured] == [bench]


class _PagesStandIn(decode_mod.AsyncpoolPages):
    key = "pages stand-in"
    label = "vLLM stand-in"


class _SlotsStandIn(decode_mod.AsyncpoolSlots):
    key = "slots stand-in"
    label = "SGLang stand-in"


class _Greedy(decode_mod.AsyncpoolPages):
    """Hands out one page a step more than the lengths call for."""

    key = "greedy"
    label = "greedy stand-in"

    def step(self, arg: list[int]) -> object:
        extra = [row for row in self.rows if row not in arg][:1]
        return self.extend_rows(arg + extra, 1)


async def test_decode_peers_found_skipped_broken_and_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Stand-in peers are timed into both benches' rows; a missing or broken
    one is skipped with the reason; a side that hands out a page too many fails."""

    def broken(sc: decode_mod.Scenario) -> decode_mod.Side:
        raise RuntimeError("no CUDA here")

    monkeypatch.setattr(
        decode_mod,
        "PEERS",
        {
            "vLLM": ("numpy", _PagesStandIn, decode_mod.BENCH_PAGES),
            "SGLang": ("numpy", _SlotsStandIn, decode_mod.BENCH_SLOTS),
            "Missing": ("asyncpool_no_such_peer", broken, decode_mod.BENCH_PAGES),
            "Broken": ("numpy", broken, decode_mod.BENCH_SLOTS),
        },
    )
    async with bounded(LONG_S):
        rows, skipped = await bench_decode(SMOKE)
    _check_decode(rows)
    assert [(r.bench, r.reference) for r in rows] == [
        (decode_mod.BENCH_PAGES, "vLLM stand-in"),
        (decode_mod.BENCH_SLOTS, "SGLang stand-in"),
    ]
    assert set(skipped) == {"decode vs Missing", "decode vs Broken"}
    assert "`asyncpool_no_such_peer` is not importable" in skipped["decode vs Missing"]
    assert "RuntimeError: no CUDA here" in skipped["decode vs Broken"]

    monkeypatch.setattr(decode_mod, "PEERS", {"Greedy": ("numpy", _Greedy, decode_mod.BENCH_PAGES)})
    async with bounded(LONG_S):
        with pytest.raises(AssertionError, match="greedy stand-in: step 0 handed out"):
            await bench_decode(SMOKE)


def test_decode_scenario() -> None:
    """Any page-size run of steps crosses each request exactly once."""
    sc = decode_mod.Scenario.of(SMOKE)
    assert len(sc.lens) == SMOKE.decode_requests
    assert all(SMOKE.decode_lens[0] <= n < SMOKE.decode_lens[1] for n in sc.lens)
    for start in range(sc.steps - sc.page_size + 1):
        crossed = sorted(i for j in range(start, start + sc.page_size) for i in sc.crossing(j))
        assert crossed == list(range(sc.requests))
    assert [b - a for a, b in zip(sc.pages_at(0), sc.pages_at(1), strict=True)] == [
        int(i in sc.crossing(0)) for i in range(sc.requests)
    ]
    with pytest.raises(ValueError, match="multiple of the page size"):
        decode_mod.Scenario.of(dataclasses.replace(SMOKE, decode_batch_steps=24))
    with pytest.raises(ValueError, match="do not fit"):
        decode_mod.Scenario.of(dataclasses.replace(SMOKE, decode_num_pages=16))


def test_peers_install_lines_are_the_scripts() -> None:
    """docs/benchmarks.md shows PEERS_INSTALL; the script must run exactly those lines."""
    script = (REPO / "benchmarks" / "install_peers.sh").read_text(encoding="utf-8")
    lines = script.splitlines()
    for line in PEERS_INSTALL:
        assert line in lines, line


async def test_uncontended() -> None:
    async with bounded(LONG_S):
        _check(await bench_uncontended(SMOKE))


async def test_batched() -> None:
    async with bounded(LONG_S):
        _check(await bench_batched(SMOKE))


async def test_contended() -> None:
    async with bounded(LONG_S):
        _check(await bench_contended(SMOKE))


async def test_contended_ablation() -> None:
    async with bounded(LONG_S):
        per_op = await ablation.ablate_contended(SMOKE)
    assert set(per_op) == {*ablation.SUBJECTS, "Semaphore"}
    for samples in per_op.values():
        assert len(samples) == SMOKE.rounds
        assert all(x > 0 and math.isfinite(x) for x in samples)
    table = ablation.render({"asyncio": per_op})
    assert all(name in table for name in ablation.SUBJECTS)
    # The clock swap is undone, whatever the run did.
    from asyncpool import waiters

    assert waiters._perf_counter is time.perf_counter


async def test_grant_parts() -> None:
    async with bounded(LONG_S):
        got = await grant_parts.measure(n=200, repeats=1)
    assert list(got["free"]) == list(grant_parts.FREE_PARTS)
    assert list(got["alloc"]) == list(grant_parts.ALLOC_PARTS)
    for side in got.values():
        assert all(x > 0 and math.isfinite(x) for x in side.values())
    table = grant_parts.render({"asyncio": got})
    assert all(name in table for name in (*grant_parts.FREE_PARTS, *grant_parts.ALLOC_PARTS))
    assert "a grant, both sides" in table


async def test_scrape_costs() -> None:
    """docs/api.md's scrape figures for many priorities and many pending
    batches, and its router's reads, come from ``python -m
    benchmarks.scrape_costs``: each figure is measured, and the priorities'
    scrape exports every priority's series."""
    async with bounded(LONG_S):
        few = await scrape_costs.measure(priorities=1, waits=2, pending=(4,), repeats=1)
        got = await scrape_costs.measure(priorities=3, waits=2, pending=(4, 64), repeats=3)
    assert list(got) == [
        "3 priorities: samples",
        "3 priorities: collect_ms",
        "3 priorities: generate_latest_ms",
        "stats(), 4 pending batches: ms",
        "stats(), 64 pending batches: ms",
        "router: five counts, us",
        "router: stats(summaries=False), us",
    ]
    assert all(x > 0 and math.isfinite(x) for x in got.values())
    assert got["3 priorities: samples"] > few["1 priorities: samples"]
    table = scrape_costs.render({"asyncio": got, "uvloop": got})
    assert all(name in table for name in got) and "| figure | asyncio | uvloop |" in table


def _quoted_scrape_samples() -> int:
    """The samples a pool docs/api.md says a scrape with 16 priorities exports."""
    text = " ".join((Path(__file__).resolve().parent.parent / "docs/api.md").read_text().split())
    quoted = re.search(r"with 16 priorities queued, ([\d,]+) samples a pool", text)
    assert quoted is not None
    return int(quoted[1].replace(",", ""))


async def test_the_scrape_samples_docs_api_quotes_are_what_a_scrape_exports() -> None:
    """docs/api.md's "with 16 priorities queued, N samples a pool" is what
    ``benchmarks.scrape_costs`` counts today (it read 853 after a family was
    added and the scrape exported 870)."""
    quoted = _quoted_scrape_samples()
    async with bounded(LONG_S):
        got = await scrape_costs.measure(priorities=16, waits=1, pending=(), repeats=1)
    assert quoted == got["16 priorities: samples"]


async def test_hand_over_floor_grants_in_order() -> None:
    pool = ablation.HandOverPool(1)
    first = await pool.alloc(1)
    loop = asyncio.get_running_loop()
    second, third = loop.create_task(pool.alloc(1)), loop.create_task(pool.alloc(1))
    await asyncio.sleep(0)
    pool.free(first)
    async with bounded(LONG_S):
        assert await second == first
    assert not third.done()
    third.cancel()
    with pytest.raises(asyncio.CancelledError):
        await third


async def test_admit() -> None:
    async with bounded(LONG_S):
        rows = await bench_admit(SMOKE)
    _check(rows)
    benches = [r.bench for r in rows]
    assert any(b.startswith("uncontended admit(") for b in benches)
    assert any(b.startswith("contended admit") for b in benches)
    assert any(b.endswith("as far as pages go") for b in benches)  # extend_fitting


async def test_groups() -> None:
    """Grouped admission against its parts and the single-kv admission, the
    grouped decode step against one call a group, and the window's drop
    against a trim: each measured on the loop it runs on."""
    async with bounded(LONG_S):
        rows = await bench_groups(SMOKE)
    _check(rows)
    admit = [r for r in rows if r.bench.startswith("uncontended grouped admit(")]
    k, w = SMOKE.admit_pages, SMOKE.groups_window_pages
    assert [r.reference.split(" (")[0] for r in admit] == [
        "alloc(1)+free",
        f"admit(pages={k}) + free",
        f"admit(pages={k}) + free",
        f'admit({{"full": {k}}}) + free',
        f'admit({{"full": {k}, "swa": {w}}}) + free',
    ]
    assert [r.target is not None for r in rows] == [True] + [False] * (len(rows) - 1)
    benches = [r.bench for r in rows]
    assert any(b.startswith("grouped decode step") for b in benches)
    assert any(b.startswith("sliding window step") for b in benches)


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


async def test_wait_fence_against_the_executor() -> None:
    async with bounded(LONG_S):
        rows = await bench_wait_fence(SMOKE)
    _check(rows)
    assert [r.bench for r in rows] == [
        "wait_fence wake-up (host fence)",
        "wait_fence wake-up (fence of unknown origin)",
    ]


async def test_metrics_scrape() -> None:
    from benchmarks.bench_metrics import bench_metrics_scrape

    async with bounded(LONG_S):
        rows = await bench_metrics_scrape(SMOKE)
    _check(rows)
    assert rows[0].target is not None and rows[0].reference_value == 1e6


async def test_wake_latency_with_slow_fences_watched() -> None:
    async with bounded(LONG_S):
        rows = await bench_wake_slow_fences(SMOKE)
    _check(rows)
    assert len(rows) == 2 and all("100 slow fences" in r.bench for r in rows)
    # A figure, not a guarantee: the smoke preset idles 10 ms, and a loaded
    # machine can run no poll in it (the benchmark itself asserts that the
    # watcher polls all 100 fences).
    assert rows[0].samples["polls_per_s"][0] >= 0


@pytest.mark.timeout(120)
def test_slow_fences_flag_sets_how_many_the_wake_benchmark_watches(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--slow-fences N``: docs/api.md quotes wake-ups with 1,000 and 4,000
    pending transfer handles; the command beside them reruns that figure."""
    from benchmarks.run import main

    argv = ["--preset", "smoke", "--only", "wake", "--loops", "asyncio", "--no-md"]
    assert main([*argv, "--slow-fences", "7"]) == 0
    out = capsys.readouterr().out
    assert "wake-up latency, 7 slow fences watched" in out
    assert "100 slow fences" not in out


async def test_scaling() -> None:
    async with bounded(LONG_S):
        rows, memory = await bench_scaling(SMOKE)
    _check(rows)
    assert [int(m["size"]) for m in memory] == list(SMOKE.scaling_sizes)
    for m in memory:
        assert m["asyncpool_table_bytes"] > 0


@pytest.mark.timeout(180)
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


@pytest.mark.timeout(180)
def test_entry_point_writes_markdown_and_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from benchmarks.run import main

    # A run of every benchmark writes the report to docs/benchmarks.md under
    # the current directory without being asked (a subset does not:
    # tests/test_packaging.py).
    monkeypatch.chdir(tmp_path)
    md, js = tmp_path / "docs" / "benchmarks.md", tmp_path / "bench.json"
    # The demo has its own test; here it only has to be wired in.
    argv = ["--preset", "smoke", "--json", str(js), "--loops", "asyncio", "--clock", "cpu"]
    assert main(argv) == 0
    text = md.read_text(encoding="utf-8")
    assert "| Benchmark |" in text and "## Targets" in text
    data = json.loads(js.read_text(encoding="utf-8"))
    assert data["rows"] and data["machine"]["python"]
    benches = {r["bench"] for r in data["rows"]}
    assert any("uncontended" in b for b in benches)
    assert any(b.startswith("contended admit") for b in benches)
    assert any(b.startswith("uncontended grouped admit(") for b in benches)
    assert {r["loop"] for r in data["rows"]} >= {"asyncio"}
    # The demo is either measured or reported as not available, never silently dropped.
    assert any("demo" in b for b in benches) or "demo" in data["unavailable"]
    # So are the page allocators: KVPagePool always, each peer measured or said skipped.
    assert any(b.startswith("KV pages alloc(") for b in benches)
    assert "## KV page allocators" in text and "install_peers.sh" in text
    for peer in ("SGLang", "vLLM"):
        assert (
            any(r["reference"].startswith(peer) for r in data["rows"])
            or f"pages vs {peer}" in data["unavailable"]
        )
    # And the decode step: each peer measured or said skipped.
    decode_rows = [
        r for r in data["rows"] if r["bench"] in (decode_mod.BENCH_PAGES, decode_mod.BENCH_SLOTS)
    ]
    for peer in decode_mod.PEERS:
        assert (
            any(peer in r["samples"] for r in decode_rows)
            or f"decode vs {peer}" in data["unavailable"]
        ), peer
    # A saved run re-renders to the same markdown without measuring anything.
    again = tmp_path / "again.md"
    assert main(["--from-json", str(js), "--md", str(again)]) == 0
    assert (
        again.read_text(encoding="utf-8").replace(
            f"Every sample of this run is in `{js}`; `python -m benchmarks --from-json {js}` "
            "re-renders this page.\n\n",
            "",
        )
        == text
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["--only", "nope"],
        ["--loops", "nope"],
        # Nothing to run is an error, not an empty report (or a crash in the
        # synchronous benchmarks, which run on the first loop named).
        ["--only", ","],
        ["--loops", ","],
        ["--only", "pages", "--loops", ""],
        # --rounds 0 was ignored (the preset's rounds ran); fewer gave n/a rows.
        ["--rounds", "0"],
        ["--rounds", "-3"],
        ["--slow-fences", "0"],
    ],
)
def test_entry_point_rejects_unknown_names(argv: list[str]) -> None:
    from benchmarks.run import main

    with pytest.raises(SystemExit) as exc:
        main(["--preset", "smoke", "--no-md", *argv])
    assert exc.value.code == 2  # a usage error (names were exit 1, a failed run's)


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


def test_report_method_names_the_paths_the_page_rows_measure(tmp_path: Path) -> None:
    """The Method section says which SGLang path the page targets are on
    (free_segment, as the rows' labels say), not only free(slots)."""
    from benchmarks.run import main

    md = tmp_path / "r.md"
    saved = REPO / "benchmarks" / "results" / "latest.json"
    assert main(["--from-json", str(saved), "--md", str(md)]) == 0
    method = md.read_text(encoding="utf-8").split("## Method", 1)[1]
    pages = next(line for line in method.splitlines() if line.startswith("- KV pages:"))
    assert "free_segment(slots, start_pos=0)" in pages and "free(slots)" in pages
    assert "freeing a copy" in pages
    data = json.loads(saved.read_text(encoding="utf-8"))
    labels = {r["reference"] for r in data["rows"] if r["bench"].startswith("KV pages alloc(")}
    assert any("free_segment" in label for label in labels)


def test_pages_measure_vllms_default_setting_beside_the_targets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's engine runs BlockPool with prefix caching on by default: the
    page rows measure that setting too (context), while the vLLM targets
    stay on caching off (the same work as KVPagePool, vLLM's faster
    setting). A stand-in vLLM module records how the pools are built."""
    import sys
    import types

    built: list[bool] = []

    class BlockPool:
        def __init__(self, *, num_gpu_blocks: int, enable_caching: bool, hash_block_size: int):
            built.append(enable_caching)
            self.free = list(range(1, num_gpu_blocks))

        def get_new_blocks(self, n: int) -> list[int]:
            got, self.free = self.free[:n], self.free[n:]
            return got

        def free_blocks(self, blocks: list[int]) -> None:
            self.free[:0] = blocks

        def get_num_free_blocks(self) -> int:
            return len(self.free)

    names = ["vllm", "vllm.v1", "vllm.v1.core", "vllm.v1.core.block_pool"]
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setattr(sys.modules["vllm.v1.core.block_pool"], "BlockPool", BlockPool, False)

    vllm = {key: loader for key, (module, loader) in pages_mod.PEERS.items() if module == "vllm"}
    peers = {key: build(64, 16) for key, build in vllm.items()}
    assert sorted(built) == [False, True]
    default = [p for p in peers.values() if "vLLM's default" in p.label]
    assert len(default) == 1 and "prefix caching on" in default[0].label
    assert default[0].key != pages_mod.VLLM  # the targets stay on caching off
    assert "prefix caching off" in peers[pages_mod.VLLM].label
    assert not any(key == default[0].key for key, _ in pages_mod.TARGETS)
    rows = pages_mod._rows(
        {
            f"{c.key}/{n}": [1.0, 2.0, 3.0]
            for c in (peers[pages_mod.VLLM], *peers.values())
            for n in (1,)
        }
        | {f"{k}/1": [1.0, 2.0, 3.0] for k in (pages_mod.SUBJECT, pages_mod.SUBJECT_COPY)},
        [
            pages_mod.Contender(pages_mod.SUBJECT, "asyncpool KVPagePool", *[None] * 5),  # type: ignore[arg-type]
            pages_mod.Contender(pages_mod.SUBJECT_COPY, "copy", *[None] * 5),  # type: ignore[arg-type]
            *peers.values(),
        ],
        (1,),
        64,
        16,
    )
    on_default = [r for r in rows if r.reference == default[0].label]
    assert len(on_default) == 1 and on_default[0].target is None


def test_report_says_which_ratio_and_flags_a_disagreeing_one(tmp_path: Path) -> None:
    """The ratio column is the median of per-round ratios; the times beside
    it are unpaired medians, whose quotient can disagree: the method says
    which the targets are judged on, and a row whose ratio of medians lies
    outside the rounds' IQR says so."""
    from benchmarks.report import _row_line, ratio_of_medians
    from benchmarks.run import main

    row = Row(
        bench="b",
        loop="sync",
        subject="s",
        reference="r",
        subject_value=100.0,
        reference_value=300.0,
        unit="ns/op",
        ratio=2.0,
        ratio_label="speed-up (ref/subject)",
        ratio_p25=1.9,
        ratio_p75=2.1,
    )
    assert ratio_of_medians(row) == 3.0
    assert "their ratio, 3.00x, lies outside the rounds' IQR" in _row_line(row)
    row.reference_value = 200.0
    assert "outside" not in _row_line(row)

    md = tmp_path / "r.md"
    saved = REPO / "benchmarks" / "results" / "latest.json"
    assert main(["--from-json", str(saved), "--md", str(md)]) == 0
    text = md.read_text(encoding="utf-8")
    assert "targets are judged on it" in text and "ratio of medians" in text
    method = text.split("## Method", 1)[1]
    pages = next(line for line in method.splitlines() if line.startswith("- KV pages:"))
    assert "vLLM's engine default is prefix caching on" in pages
    assert "enable_caching=True" in pages


def test_peer_install_pins_what_decides_the_figures() -> None:
    """torch, the two peers, numpy and uvloop are pinned (==) in the install
    lines; the method text says what is left unpinned."""
    import re

    script = (REPO / "benchmarks" / "install_peers.sh").read_text(encoding="utf-8")
    installs = " ".join(line for line in PEERS_INSTALL if " pip " in line)
    for dist in ("torch", "numpy", "uvloop", "sglang", "vllm"):
        assert re.search(rf"(?<![\w-]){dist}==\d", installs), dist
        assert re.search(rf"(?<![\w-]){dist}==\d", script), dist
    assert "Left unpinned" in script


def test_decode_measures_vllms_engine_path_in_its_default_setting() -> None:
    """vLLM's scheduler path, KVCacheManager.allocate_slots, is measured with
    prefix caching off (like for like) and on (vLLM's default), both context."""
    managers = {
        key: cls
        for key, (module, cls, bench) in decode_mod.PEERS.items()
        if module == "vllm" and issubclass(cls, decode_mod.VllmManager)
    }
    assert sorted(cls.caching for cls in managers.values()) == [False, True]
    assert all(decode_mod.PEERS[key][2] == decode_mod.BENCH_PAGES for key in managers)


def test_batch_calls_measures_every_call_per_call_and_per_row(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``python -m benchmarks.batch_calls``: each batched call and its
    reference, tiny; a figure a call and one a row (the call's over the
    rows), and the table printed for each batch size."""
    from benchmarks import batch_calls

    got = batch_calls.measure(4, rounds=1, steps=2)
    labels = [label for label, _, _ in got]
    for call in ("drop_pages", "trim_pages", "extend_rows", "pages_of_rows", "per row"):
        assert any(call in label for label in labels), call
    for _, per_call, per_row in got:
        assert per_call > 0 and math.isclose(per_row, per_call / 4)
    batch_calls.main(["--rows", "2,3", "--rounds", "1", "--steps", "2", "--long", "16,32"])
    out = capsys.readouterr().out
    assert "2 rows: us a call, us a row" in out and "3 rows" in out
    assert "one row of 16 pages (page size 1)" in out and "one row of 32 pages" in out


def test_batch_calls_times_a_long_rows_trim_and_regrowth() -> None:
    """The one long row's cycle, ``trim_pages(row, n - 1)`` then
    ``extend(row, 1)``, and the trim alone, each without and with a lending
    ``pages_of`` each step, and a window's step on a row of as many live
    pages, ``drop_pages(row, d + 1)`` then ``extend(row, 1)``, and the drop
    alone; a bad ``--long`` is a usage error."""
    from benchmarks import batch_calls

    got = batch_calls.measure_long(16, rounds=1, steps=2)
    labels = [label for label, _ in got]
    assert labels[0] == "trim_pages(row, n - 1); extend(row, 1)"
    assert sum("pages_of(row)" in label for label in labels) == 2
    assert labels[-2:] == [
        "drop_pages(row, d + 1); extend(row, 1)",
        "drop_pages(row, d + 1) after extend(row, 1)",
    ]
    assert all(us > 0 for _, us in got)
    for bad in ("x", "1"):
        with pytest.raises(SystemExit):
            batch_calls.main(["--rows", "2", "--long", bad])
