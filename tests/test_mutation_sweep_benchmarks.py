"""Mutation sweep of ``benchmarks/``: what makes each reported figure honest.

Pins, with stand-in samples, stand-in samplers and a stand-in clock (no real
timing, nothing that depends on the machine's speed):

* the harness: a target's direction and boundary, the median of per-round
  ratios (not the mean, not the ratio of medians) and its inclusive
  quartiles, the ratio's orientation, calibration, the order rotation, the
  per-operation division and the collector being off during a sample;
* the report: the Met column, the direction words, the spread, the "N of M
  targets met" count (markdown and JSON), the sections rows land in, the
  page table's per-allocator and per-page medians, the sweep tables;
* the runner: ``--rounds``, ``--clock``, ``--quick``, peers' skip lines,
  memory measured once, ``--no-md``, legacy ``--from-json`` files, ``--json``
  into a new folder;
* the reference pools' zeroing and the benchmarks' own checks (a peer that
  hands out a page too many or leaks one fails the run; slot-counted peers
  are held and cycled in pages; the decode figures are per step, speed-ups;
  a grant left allocated fails the contended runs, a miscounted head reclaim
  fails the sweep), the contended pool's size against the Semaphore's, each
  target's direction and value, and which rows carry them.
"""

from __future__ import annotations

import asyncio
import gc
import json
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks import bench_decode as decode_mod
from benchmarks import bench_pages as pages_mod
from benchmarks import harness, report
from benchmarks.harness import PRESETS, Config, Row, Target, calibrate, compare, interleave
from benchmarks.naive_pages import NaivePagePool
from benchmarks.naive_pool import NaiveReqToTokenPool

SMOKE = PRESETS["smoke"]
MEMORY = {
    "size": 16.0,
    "asyncpool_table_bytes": 1024.0,
    "asyncpool_bookkeeping_bytes": 512.0,
    "seed-style_bookkeeping_bytes": 256.0,
}
TICK = 1_000
BOUND_S = 60.0


@pytest.fixture
def fake_clock(monkeypatch: pytest.MonkeyPatch) -> Config:
    """The smoke preset on a clock that advances TICK ns at every read."""
    t = [0]

    def now() -> int:
        t[0] += TICK
        return t[0]

    monkeypatch.setitem(harness.CLOCKS, "fake", now)
    return replace(SMOKE, clock="fake")


def _row(**kw: Any) -> Row:
    base: dict[str, Any] = {
        "bench": "b",
        "loop": "asyncio",
        "subject": "s",
        "reference": "r",
        "subject_value": 100.0,
        "reference_value": 200.0,
        "unit": "ns/cycle",
        "ratio": 2.0,
        "ratio_label": "speed-up (ref/subject)",
    }
    base.update(kw)
    return Row(**base)


MACHINE: dict[str, Any] = {
    "cpu": "cpu",
    "cores_usable": 2,
    "platform": "linux",
    "python": "3.11",
    "implementation": "CPython",
    "torch": "2",
    "torch_threads": 1,
    "uvloop": "0",
    "git_commit": "abc",
    "git_dirty": False,
    "date_utc": "today",
}


def _render(rows: list[Row], **kw: Any) -> str:
    args: dict[str, Any] = {
        "command": "python -m benchmarks",
        "cfg": Config(),
        "machine": MACHINE,
        "memory": [],
        "unavailable": {},
        "elapsed_s": 1.0,
    }
    args.update(kw)
    return report.render_markdown(rows, **args)


# ---------------------------------------------------------------- harness


def test_target_met_in_its_direction_boundary_included() -> None:
    """A ">=" target is a floor and a "<=" one a ceiling, each met at its value."""
    floor, ceiling = Target(">=", 45.0), Target("<=", 1.5)
    assert floor.met(45.0) and floor.met(100.0) and not floor.met(44.9)
    assert ceiling.met(1.5) and ceiling.met(0.5) and not ceiling.met(1.51)


def test_target_prints_its_direction() -> None:
    """The Target column says "≥" for a floor and "≤" for a ceiling."""
    assert str(Target(">=", 45.0)) == "≥ 45x"
    assert str(Target("<=", 1.5)) == "≤ 1.5x"


def test_untargeted_row_has_no_verdict() -> None:
    """A row without a target is neither met nor missed: its Met cell is empty."""
    row = _row()
    assert row.met is None
    assert "| ≥" not in report._row_line(row) and "**" not in report._row_line(row)


def test_row_json_round_trip_keeps_the_target_direction() -> None:
    """A saved row re-renders with its target's direction (and ``met`` recomputed)."""
    row = _row(ratio=1.2, ratio_label="cost (subject/ref)", target=Target("<=", 1.5))
    data = json.loads(json.dumps(row.to_json()))
    assert data["target"] == {"op": "<=", "value": 1.5} and data["met"] is True
    data["met"] = False  # stale: recomputed from the ratio
    again = Row.from_json(data)
    assert again.target == Target("<=", 1.5) and again.met is True


# Three rounds where the median of per-round ratios, their mean and the ratio
# of the medians all differ.
SUBJ = [1.0, 2.0, 10.0]
REF = [4.0, 3.0, 11.0]


def compare_a_to_b(samples: dict[str, list[float]], **kw: Any) -> Row:
    """``compare`` of subject ``a`` against reference ``b``, in ns."""
    return compare(samples, bench="x", loop="asyncio", subject="a", reference="b", unit="ns", **kw)


def test_compare_reports_the_median_of_per_round_ratios_and_its_quartiles() -> None:
    """Speed-up is ref/subject per round, the median of those, with the
    inclusive quartiles as spread; the medians of each side are context."""
    row = compare_a_to_b(
        {"a": SUBJ, "b": REF}, speedup=True, subject_label="A", reference_label="B"
    )
    # per-round speed-ups 4, 1.5, 1.1: median 1.5 (mean 2.2, ratio of medians 2)
    assert row.ratio == pytest.approx(1.5)
    assert (row.ratio_p25, row.ratio_p75) == (pytest.approx(1.3), pytest.approx(2.75))
    assert (row.subject_value, row.reference_value) == (2.0, 4.0)
    assert row.ratio_label == "speed-up (ref/subject)"
    assert (row.subject, row.reference) == ("A", "B")
    assert row.samples["ratios"] == pytest.approx([4.0, 1.5, 1.1])


def test_compare_cost_ratio_is_subject_over_reference() -> None:
    """``speedup=False`` reports subject/ref per round, labelled as a cost."""
    row = compare_a_to_b({"a": SUBJ, "b": REF}, speedup=False)
    assert row.ratio == pytest.approx(2.0 / 3.0)
    assert row.ratio_label == "cost (subject/ref)"
    assert row.ratio_p25 < row.ratio < row.ratio_p75


def test_compare_refuses_samples_of_unequal_rounds() -> None:
    """Per-round ratios need one sample of each side per round."""
    with pytest.raises(ValueError):
        compare_a_to_b({"a": [1.0, 2.0], "b": [1.0]}, speedup=True)


def _linear(ns_per_op: int, calls: list[int] | None = None) -> harness.Sampler:
    async def sample(n: int) -> int:
        if calls is not None:
            calls.append(n)
        return n * ns_per_op

    return sample


async def test_calibrate_zero_target_returns_start_unsampled() -> None:
    """``target_s == 0`` (the smoke preset) samples ``start`` operations, untried."""
    calls: list[int] = []
    async with asyncio.timeout(BOUND_S):
        assert await calibrate(_linear(TICK, calls), 0.0, start=16) == 16
    assert calls == []


async def test_calibrate_scales_the_count_to_the_target() -> None:
    """The count is scaled so one sample takes about ``target_s``."""
    async with asyncio.timeout(BOUND_S):
        # 1 us an op, 10 ms a sample: 10,000 ops.
        assert await calibrate(_linear(TICK), 0.01, start=16) == 10_000


async def test_interleave_rotates_the_order_every_round() -> None:
    """Round r starts with the r-th sampler (mod their number)."""
    order: list[str] = []

    def rec(name: str) -> harness.Sampler:
        async def sample(n: int) -> int:
            order.append(name)
            return n

        return sample

    async with asyncio.timeout(BOUND_S):
        got = await interleave({k: rec(k) for k in "abc"}, rounds=4, target_s=0.0)
    assert order == list("abcbcacababc")
    assert all(len(v) == 4 for v in got.values())


async def test_interleave_divides_by_count_and_ops_per_call() -> None:
    """A figure is nanoseconds per operation: elapsed / (count x ops per call)."""

    async def flat(n: int) -> int:
        return 64_000  # whatever n is

    async with asyncio.timeout(BOUND_S):
        got = await interleave(
            {"a": flat, "b": flat},
            rounds=2,
            target_s=0.0,
            ops_per_call={"a": 8},
            start=4,
        )
    assert got == {"a": [2_000.0, 2_000.0], "b": [16_000.0, 16_000.0]}


async def test_interleave_samples_with_the_collector_off_and_collects_between(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """gc is off while a micro-benchmark sample runs (on with ``disable_gc=False``),
    collected before every sample, and on again afterwards."""
    seen: list[bool] = []
    collected = [0]
    real_collect = gc.collect

    def collect(*args: Any) -> int:
        collected[0] += 1
        return real_collect(*args)

    monkeypatch.setattr(harness.gc, "collect", collect)

    async def sample(n: int) -> int:
        seen.append(gc.isenabled())
        return n

    assert gc.isenabled()
    async with asyncio.timeout(BOUND_S):
        await interleave({"a": sample, "b": sample}, rounds=3, target_s=0.0)
        assert seen == [False] * 6 and collected[0] == 6 and gc.isenabled()
        seen.clear()
        await interleave({"a": sample}, rounds=2, target_s=0.0, disable_gc=False)
    assert seen == [True, True] and gc.isenabled()


async def test_grant_parts_samples_every_part_each_round_rotated_with_the_collector_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``python -m benchmarks.grant_parts`` interleaves its parts as the harness
    does: one sample of every part a round, the order rotated each round, gc
    off during a sample; the best sample of each part counts. (It once took
    all the samples of one part, then the next: a drift of the host landed on
    the parts measured last, and the increments the docs quote read it.)"""
    from benchmarks import grant_parts

    calls: dict[str, list[str]] = {"free": [], "alloc": []}
    returned: dict[str, list[float]] = {}
    figures = iter(range(1_000, 0, -1))  # every later sample is faster

    def side(key: str) -> Any:
        async def sample(name: str, n: int, repeats: int) -> float:
            assert repeats == 1 and n == 10
            assert not gc.isenabled()
            calls[key].append(name)
            figure = float(next(figures))
            returned.setdefault(f"{key}/{name}", []).append(figure)
            return figure

        return sample

    monkeypatch.setattr(grant_parts, "_free_side", side("free"))
    monkeypatch.setattr(grant_parts, "_alloc_side", side("alloc"))
    assert gc.isenabled()
    async with asyncio.timeout(BOUND_S):
        got = await grant_parts.measure(n=10, repeats=3)
    assert gc.isenabled()
    for key, parts in (("free", grant_parts.FREE_PARTS), ("alloc", grant_parts.ALLOC_PARTS)):
        expected = [name for r in range(3) for name in parts[r:] + parts[:r]]
        assert calls[key] == expected, key
        assert list(got[key]) == list(parts)
        # The best sample of each part is its figure.
        assert got[key] == {name: min(returned[f"{key}/{name}"]) for name in parts}


# ---------------------------------------------------------------- report


def test_met_column_says_yes_and_no() -> None:
    """The Met cell is **yes** for a met target, **NO** for a missed one."""
    met = _row(ratio=50.0, target=Target(">=", 45.0))
    missed = _row(ratio=40.0, target=Target(">=", 45.0))
    assert "| ≥ 45x | **yes** |" in report._row_line(met)
    assert "| ≥ 45x | **NO** |" in report._row_line(missed)


def test_ratio_cell_says_which_side_is_faster() -> None:
    """A speed-up above 1 reads "faster"; below 1 it names the reference's
    speed-up (1/ratio); a cost ratio reads "cost"."""
    assert "| 2.00x faster |" in report._row_line(_row(ratio=2.0))
    assert "| 0.50x (the reference is 2.00x faster) |" in report._row_line(_row(ratio=0.5))
    cost = _row(ratio=1.2, ratio_label="cost (subject/ref)")
    assert "| 1.20x cost |" in report._row_line(cost)


def test_ratio_cell_shows_the_interquartile_range_low_to_high() -> None:
    """The spread is "(p25 to p75)", left out when the two are equal."""
    spread = _row(ratio=2.0, ratio_p25=1.5, ratio_p75=3.0)
    assert "| 2.00x faster (1.50x to 3.00x) |" in report._row_line(spread)
    flat = _row(ratio=2.0, ratio_p25=2.0, ratio_p75=2.0)
    assert "| 2.00x faster |" in report._row_line(flat)


def _verdict_rows() -> list[Row]:
    return [
        _row(bench="met", ratio=50.0, target=Target(">=", 45.0)),
        _row(bench="missed", ratio=2.0, ratio_label="cost (subject/ref)", target=Target("<=", 1.5)),
        _row(bench="context"),
    ]


def test_targets_met_counts_only_targeted_rows_that_meet_them() -> None:
    """ "N of M targets met": N met, M targeted (untargeted rows count for neither),
    in the markdown and in the JSON."""
    rows = _verdict_rows()
    assert "1 of 2 targets met." in _render(rows)
    data = report.to_json(
        rows,
        command="c",
        cfg=Config(),
        machine=MACHINE,
        memory=[],
        unavailable={},
        extra={},
        elapsed_s=1.0,
    )
    assert (data["targets_met"], data["targets_total"]) == (1, 2)


def _section(md: str, title: str) -> str:
    return md.split(f"## {title}", 1)[1].split("\n## ", 1)[0]


def test_rows_land_in_their_section() -> None:
    """Targeted rows under Targets, others under Other comparisons, sweep rows
    only in their sweep table; a skipped peer is listed under Targets."""
    rows = [
        *_verdict_rows(),
        _row(bench="sweepy", subject="10 pending fences", note="sweep:idle", ratio=1.1),
    ]
    md = _render(rows, unavailable={"pages vs SGLang": "skipped: not importable"})
    targets, other = _section(md, "Targets"), _section(md, "Other comparisons")
    assert "| met |" in targets and "| missed |" in targets and "| context |" not in targets
    assert "| context |" in other and "sweepy" not in other and "| met |" not in other
    assert "- **pages vs SGLang: not available** (skipped: not importable)" in targets
    assert "| 10 pending fences | 1.10x | 100 ns/cycle |" in _section(md, "Sweeps")


def test_smoke_banner_only_on_a_smoke_run() -> None:
    """Only the smoke preset's report says its figures mean nothing."""
    banner = "these figures mean nothing"
    assert banner in _render([], cfg=SMOKE)
    assert banner not in _render([])


def test_uncommitted_changes_said_only_when_dirty() -> None:
    """The machine line says "with uncommitted changes" only for a dirty tree."""
    assert "uncommitted" not in _render([])
    assert "Commit abc with uncommitted changes" in _render(
        [], machine={**MACHINE, "git_dirty": True}
    )


def test_pages_table_has_each_allocators_own_median_and_per_page() -> None:
    """Subject and reference each get their own median, and its share per page."""
    rows = [
        _row(
            bench=pages_mod.bench_name(16),
            subject="asyncpool KVPagePool",
            reference="seed-style torch free list",
            subject_value=1_600.0,
            reference_value=3_200.0,
        )
    ]
    table = _section(_render(rows), "KV page allocators")
    assert "| asyncpool KVPagePool | 1.6 µs (100 ns/page) |" in table
    assert "| seed-style torch free list | 3.2 µs (200 ns/page) |" in table


def test_sweep_tables_keep_their_tags_apart_and_show_the_subjects_median() -> None:
    """Each sweep table holds only its own tag's rows; the median column is the subject's."""
    rows = [
        _row(subject="P=10", note="sweep:idle", ratio=1.1, subject_value=500.0),
        _row(subject="P=99", note="sweep:head", ratio=1.3, subject_value=900.0),
    ]
    sweeps = _section(_render(rows), "Sweeps")
    idle, head = sweeps.split("**reclaim() of the oldest", 1)
    assert "| P=10 | 1.10x | 500 ns/cycle |" in idle and "P=99" not in idle
    assert "| P=99 | 1.30x | 900 ns/cycle |" in head and "P=10" not in head


# ---------------------------------------------------------------- run.py


@pytest.fixture
def stand_ins(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[list[Config]]:
    """Every benchmark replaced by a stand-in that records the config it got;
    the run's cwd is an empty folder."""
    from benchmarks import (
        bench_admit,
        bench_agree,
        bench_alloc,
        bench_demo,
        bench_fences,
        bench_groups,
        bench_metrics,
        bench_scaling,
        run,
    )

    got: list[Config] = []

    def row(cfg: Config, bench: str) -> Row:
        got.append(cfg)
        return _row(bench=bench, loop=harness.loop_name())

    def simple(bench: str) -> Callable[..., Any]:
        async def fake(cfg: Config) -> list[Row]:
            return [row(cfg, bench)]

        return fake

    async def scaling(cfg: Config, *, memory: bool = True) -> tuple[list[Row], list[Any]]:
        return [row(cfg, "scaling")], ([MEMORY] if memory else [])

    async def pages(cfg: Config) -> tuple[list[Row], dict[str, str]]:
        return [row(cfg, "pages")], {"pages vs Peer": "skipped: stand-in"}

    async def decode(cfg: Config) -> tuple[list[Row], dict[str, str]]:
        return [row(cfg, "decode")], {}

    def no_rows(cfg: Config, *args: Any) -> tuple[list[Row], dict[str, Any]]:
        got.append(cfg)
        return [], {}

    for mod, names in (
        (bench_alloc, ("bench_uncontended", "bench_batched", "bench_contended")),
        (bench_admit, ("bench_admit",)),
        (bench_groups, ("bench_groups",)),
        (bench_metrics, ("bench_metrics_scrape",)),
        (
            bench_fences,
            (
                "bench_fenced_free",
                "bench_record_use",
                "bench_reclaim_sweep",
                "bench_wake_latency",
                "bench_wake_slow_fences",
                "bench_wait_fence",
            ),
        ),
    ):
        for name in names:
            monkeypatch.setattr(mod, name, simple(name))
    monkeypatch.setattr(bench_scaling, "bench_scaling", scaling)
    monkeypatch.setattr(pages_mod, "bench_pages", pages)
    monkeypatch.setattr(decode_mod, "bench_decode", decode)
    monkeypatch.setattr(bench_demo, "bench_demo", no_rows)
    monkeypatch.setattr(bench_agree, "bench_agree", no_rows)
    monkeypatch.setattr(run, "machine_info", lambda: dict(MACHINE))
    monkeypatch.chdir(tmp_path)
    yield got


def _main(argv: list[str]) -> int:
    from benchmarks.run import main

    return main(argv)


def test_run_applies_quick_rounds_and_clock(
    stand_ins: list[Config], capsys: pytest.CaptureFixture[str]
) -> None:
    """``--quick``, ``--rounds`` and ``--clock`` reach every benchmark's config."""
    base = ["--only", "uncontended", "--loops", "asyncio", "--no-md"]
    assert _main([*base, "--quick", "--rounds", "3", "--clock", "cpu"]) == 0
    (cfg,) = stand_ins
    assert (cfg.name, cfg.rounds, cfg.clock) == ("quick", 3, "cpu")
    stand_ins.clear()
    assert _main(base) == 0
    (cfg,) = stand_ins
    assert (cfg.name, cfg.rounds, cfg.clock) == ("default", 15, "wall")
    capsys.readouterr()


def test_run_reports_peers_skipped_and_memory_once(
    stand_ins: list[Config], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A synchronous benchmark's skip lines reach the report and the JSON;
    memory is measured on the first loop only; the JSON may go to a new folder."""
    js = tmp_path / "new" / "deeper" / "run.json"
    argv = ["--only", "pages,scaling", "--loops", "asyncio,uvloop", "--no-md", "--json", str(js)]
    assert _main(argv) == 0
    md = capsys.readouterr().out
    assert "- **pages vs Peer: not available** (skipped: stand-in)" in md
    data = json.loads(js.read_text(encoding="utf-8"))
    assert data["unavailable"] == {"pages vs Peer": "skipped: stand-in"}
    assert data["memory"] == [MEMORY]
    assert sorted(r["loop"] for r in data["rows"] if r["bench"] == "scaling") == [
        "asyncio",
        "uvloop",
    ]


def test_run_of_everything_with_no_md_writes_nothing(
    stand_ins: list[Config], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--no-md`` prints the report and writes no file, even for a full run."""
    assert _main(["--loops", "asyncio", "--no-md"]) == 0
    assert "## Targets" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


def _saved(tmp_path: Path, command: str) -> Path:
    data = report.to_json(
        [_row()],
        command=command,
        cfg=SMOKE,
        machine=MACHINE,
        memory=[],
        unavailable={},
        extra={},
        elapsed_s=1.0,
    )
    path = tmp_path / "saved.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def test_from_json_of_a_legacy_full_run_writes_the_default_report(
    stand_ins: list[Config],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A file saved before the "benchmarks" key, whose command ran everything,
    re-renders to docs/benchmarks.md; ``--no-md`` writes nothing."""
    saved = _saved(tmp_path, "python -m benchmarks --preset smoke --loops asyncio")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    assert _main(["--from-json", str(saved), "--no-md"]) == 0
    assert list(work.iterdir()) == []
    assert _main(["--from-json", str(saved)]) == 0
    capsys.readouterr()
    assert (work / "docs" / "benchmarks.md").is_file()
    assert stand_ins == []  # nothing measured


# ---------------------------------------------------------------- reference pools


def test_seed_pool_zeroes_every_length_tensor_on_alloc_free_and_clear() -> None:
    """The seed zeroes verified_lens, alloced_lens and alloced_lens_cpu on alloc
    (list-indexed), on free (per row) and on clear: its cost is all three."""
    pool = NaiveReqToTokenPool(8, 4)
    tensors = (pool.verified_lens, pool.alloced_lens, pool.alloced_lens_cpu)
    rows = pool.alloc(3)
    assert rows is not None
    for t in tensors:
        t[rows] = 5
    pool.free(rows)
    assert [int(t.sum()) for t in tensors] == [0, 0, 0]
    for t in tensors:
        t.fill_(7)  # stale lengths on every row, free ones included
    again = pool.alloc(7)
    assert again is not None
    assert [int(t[again].sum()) for t in tensors] == [0, 0, 0]
    for t in tensors:
        t.fill_(7)
    pool.clear()
    assert [int(t.sum()) for t in tensors] == [0, 0, 0]


def test_seed_page_pool_of_two_pages_hands_out_one() -> None:
    """The smallest pool (page 0 reserved plus one) is valid and hands out page 1."""
    pool = NaivePagePool(2, 16)
    got = pool.alloc(1)
    assert got is not None and got.tolist() == [1] and pool.alloc(1) is None


# ---------------------------------------------------------------- bench checks


def _contender(
    alloc: Callable[[int], Any], free: Callable[[Any], Any], available: Callable[[], int]
) -> pages_mod.Contender:
    return pages_mod.Contender("x", "stand-in", alloc, free, 1, lambda t: int(t.numel()), available)


def test_check_cycle_refuses_a_page_too_many_and_a_leak() -> None:
    """The untimed cycle fails a peer whose alloc(n) hands out n + 1 pages,
    and one whose free keeps a page."""
    pool = NaivePagePool(64, 16)
    greedy = _contender(lambda n: pool.alloc(n + 1), pool.free, pool.available_size)
    with pytest.raises(AssertionError, match="alloc of 4 pages"):
        greedy.check_cycle(4)
    pool.clear()
    leaky = _contender(pool.alloc, lambda t: pool.free(t[1:]), pool.available_size)
    with pytest.raises(AssertionError, match="pages free before a cycle"):
        leaky.check_cycle(4)


class _SlotPeer:
    """A peer counting token slots, two a page; records what alloc was asked."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.pool = NaivePagePool(num_pages, page_size)
        self.asked: list[int] = []
        self.frees = 0
        self.leak_from = 0  # the free call from which one page is kept (0: never)

    def alloc(self, slots: int) -> torch.Tensor | None:
        self.asked.append(slots)
        pages = self.pool.alloc(slots // 2)
        return None if pages is None else pages.repeat_interleave(2)

    def free(self, slots: torch.Tensor) -> None:
        self.frees += 1
        pages = slots[::2]
        if self.leak_from and self.frees >= self.leak_from:
            pages = pages[1:]
        self.pool.free(pages)

    def contender(self) -> pages_mod.Contender:
        return pages_mod.Contender(
            pages_mod.VLLM,
            "slot stand-in",
            self.alloc,
            self.free,
            2,
            lambda t: int(t.numel()) // 2,
            self.pool.available_size,
        )


def _only_peer(monkeypatch: pytest.MonkeyPatch, peer: _SlotPeer) -> None:
    monkeypatch.setattr(
        pages_mod, "PEERS", {pages_mod.VLLM: ("numpy", lambda n, ps: peer.contender())}
    )


async def test_bench_pages_holds_and_cycles_a_slot_counted_peer_in_pages(
    monkeypatch: pytest.MonkeyPatch, fake_clock: Config
) -> None:
    """A peer whose alloc counts slots is asked for pages x slots a page: the
    held half at setup and every timed cycle alike."""
    peer = _SlotPeer(SMOKE.pages_num_pages, SMOKE.pages_page_size)
    _only_peer(monkeypatch, peer)
    async with asyncio.timeout(BOUND_S):
        rows, skipped = await pages_mod.bench_pages(fake_clock)
    assert skipped == {} and rows
    hold = (SMOKE.pages_num_pages - 1) // 2
    assert peer.asked[0] == 2 * hold
    assert set(peer.asked[1:]) == {2 * n for n in SMOKE.pages_counts}


async def test_bench_pages_fails_a_peer_that_leaks_in_the_timed_cycles(
    monkeypatch: pytest.MonkeyPatch, fake_clock: Config
) -> None:
    """A peer that keeps a page once the untimed checks are done fails the run."""
    peer = _SlotPeer(SMOKE.pages_num_pages, SMOKE.pages_page_size)
    peer.leak_from = len(SMOKE.pages_counts) + 1  # the first timed free on
    _only_peer(monkeypatch, peer)
    async with asyncio.timeout(BOUND_S):
        with pytest.raises(AssertionError, match="pages free after the run"):
            await pages_mod.bench_pages(fake_clock)


class _FakeSGLangAllocator:
    """SGLang's ``PagedTokenToKVPoolAllocator`` interface (token slots, page 0
    padding), on a torch free list; records the ``need_sort`` it was built with."""

    built: list[bool] = []

    def __init__(
        self, size: int, page_size: int, dtype: Any, device: str, kvcache: Any, need_sort: bool
    ) -> None:
        type(self).built.append(need_sort)
        self.page_size = page_size
        self.pool = NaivePagePool(size // page_size + 1, page_size)

    def alloc(self, need_size: int) -> torch.Tensor | None:
        pages = self.pool.alloc(need_size // self.page_size)
        if pages is None:
            return None
        return (pages[:, None] * self.page_size + torch.arange(self.page_size)).reshape(-1)

    def free_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        self.pool.free(free_index[:: self.page_size] // self.page_size)

    def free(self, free_index: torch.Tensor) -> None:
        self.pool.free(torch.unique(free_index // self.page_size))

    def available_size(self) -> int:
        return self.pool.available_size() * self.page_size


async def test_bench_pages_measures_sglangs_disaggregated_setting_as_context(
    monkeypatch: pytest.MonkeyPatch, fake_clock: Config
) -> None:
    """SGLang's engine builds its page allocator with ``need_sort=True`` in
    disaggregated prefill or decode mode (a decode engine like the demo's):
    ``free`` stages pages instead of concatenating the whole free list. The
    page benchmark measures that setting beside ``need_sort=False`` (the
    targets' path), as context with no target, so the ratios against SGLang
    are not read off its slower setting alone."""
    import importlib.machinery
    import sys
    import types

    for name in ("sglang", "sglang.srt", "sglang.srt.mem_cache", "sglang.srt.mem_cache.allocator"):
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        monkeypatch.setitem(sys.modules, name, module)
    sys.modules["sglang.srt.mem_cache.allocator"].PagedTokenToKVPoolAllocator = (  # type: ignore[attr-defined]
        _FakeSGLangAllocator
    )
    monkeypatch.setattr(_FakeSGLangAllocator, "built", [])
    async with asyncio.timeout(BOUND_S):
        rows, skipped = await pages_mod.bench_pages(fake_clock)
    assert not any("SGLang" in key for key in skipped), skipped
    assert sorted(_FakeSGLangAllocator.built) == [False, False, True]
    sorted_rows = [r for r in rows if "need_sort=True" in r.reference]
    assert {r.bench for r in sorted_rows} == {pages_mod.bench_name(n) for n in SMOKE.pages_counts}
    for r in sorted_rows:
        assert r.subject == "asyncpool KVPagePool" and r.target is None
        assert r.ratio_label.startswith("speed-up")
    # The targets stay on need_sort=False's free_segment, the engine's default.
    targeted = {r.reference for r in rows if r.target is not None and "SGLang" in r.reference}
    assert targeted and all("need_sort" not in ref for ref in targeted)


def test_pages_rows_are_oriented_as_their_targets_and_flatness_is_a_cost() -> None:
    """Each targeted page row is a speed-up for a ">=" target and a cost for a
    "<=" one; KVPagePool's 256-vs-16 flatness is a cost ratio, 256 over 16."""
    keys = (pages_mod.SUBJECT, pages_mod.SUBJECT_COPY, pages_mod.SEED, pages_mod.SGLANG)
    keys += (pages_mod.VLLM,)
    contenders = [
        pages_mod.Contender(k, k, lambda n: None, lambda t: None, 1, len, lambda: 0) for k in keys
    ]
    counts = (1, 16, 256)
    per_op = {f"{k}/{n}": [float(n * (i + 1))] for i, k in enumerate(keys) for n in counts}
    rows = pages_mod._rows(per_op, contenders, counts, 1024, 16)
    targeted = [r for r in rows if r.target is not None]
    assert len(targeted) == len(pages_mod.TARGETS) + 1
    for r in targeted:
        want = "speed-up" if r.target is not None and r.target.op == ">=" else "cost"
        assert r.ratio_label.startswith(want), r
    (flat,) = [r for r in rows if r.target is pages_mod.FLATNESS]
    assert flat.ratio == pytest.approx(256 / 16) and flat.ratio_label.startswith("cost")


def test_targets_are_the_documented_ones() -> None:
    """Each target's direction and value, as README's and docs/benchmarks.md's
    tables state them (a flipped direction turns a miss into a pass)."""
    from benchmarks import (
        bench_admit,
        bench_alloc,
        bench_demo,
        bench_fences,
        bench_groups,
        bench_metrics,
    )

    got = {
        "uncontended vs seed": bench_alloc.UNCONTENDED_VS_SEED,
        "uncontended vs Semaphore": bench_alloc.UNCONTENDED_VS_SEM,
        "batched vs seed": bench_alloc.BATCHED_VS_SEED,
        "contended vs Semaphore": bench_alloc.CONTENDED_VS_SEM,
        "admit vs apart": bench_admit.ADMIT_VS_APART,
        "contended admit vs Semaphore": bench_admit.CONTENDED_ADMIT_VS_SEM,
        "grouped admit vs apart": bench_groups.GROUPED_ADMIT_VS_APART,
        "reclaim flat": bench_fences.RECLAIM_FLAT,
        "scrape": bench_metrics.SCRAPE_VS_BUDGET,
        "overlap vs sync": bench_demo.OVERLAP_VS_SYNC,
        "fenced vs unsafe": bench_demo.FENCED_VS_UNSAFE,
        "atomic vs row-first": bench_demo.ATOMIC_VS_ROW_FIRST,
        "pages flatness": pages_mod.FLATNESS,
        **{f"pages {peer} {n}": t for (peer, n), t in pages_mod.TARGETS.items()},
    }
    assert {k: (t.op, t.value) for k, t in got.items()} == {
        "uncontended vs seed": (">=", 45.0),
        "uncontended vs Semaphore": ("<=", 1.5),
        "batched vs seed": (">=", 50.0),
        "contended vs Semaphore": ("<=", 1.25),
        "admit vs apart": ("<=", 1.5),
        "contended admit vs Semaphore": ("<=", 1.5),
        "grouped admit vs apart": ("<=", 1.5),
        "reclaim flat": ("<=", 1.5),
        "scrape": ("<=", 1.0),
        "overlap vs sync": (">=", 1.6),
        "fenced vs unsafe": (">=", 0.97),
        "atomic vs row-first": (">=", 1.0),
        "pages flatness": ("<=", 2.0),
        "pages SGLang 256": (">=", 10.0),
        "pages SGLang 16": (">=", 5.0),
        "pages vLLM 256": (">=", 5.0),
        "pages vLLM 1": ("<=", 3.0),
    }


async def test_alloc_rows_are_per_row_and_oriented_as_their_targets(fake_clock: Config) -> None:
    """On a clock where every sample reads the same time, each side's figure is
    that time over its operations (rows, for the batched one): the ratios are
    exactly 1, each row oriented as its target (speed-up for ">=")."""
    from benchmarks.bench_alloc import bench_batched, bench_contended, bench_uncontended

    async with asyncio.timeout(BOUND_S):
        rows = [
            *await bench_uncontended(fake_clock),
            *await bench_batched(fake_clock),
            *await bench_contended(fake_clock),
        ]
    for r in rows:
        assert r.ratio == 1.0, r
        if r.target is not None:
            want = "speed-up" if r.target.op == ">=" else "cost"
            assert r.ratio_label.startswith(want), r
    batched = [r for r in rows if r.bench.startswith(f"alloc({SMOKE.batch_k})")]
    assert [r.subject_value for r in batched] == [TICK / (4 * SMOKE.batch_k)] * 2


async def test_admit_rows_are_oriented_as_their_targets(fake_clock: Config) -> None:
    """Admission's targets are cost ceilings on cost ratios."""
    from benchmarks.bench_admit import bench_admit

    async with asyncio.timeout(BOUND_S):
        rows = await bench_admit(fake_clock)
    targeted = [r for r in rows if r.target is not None]
    assert len(targeted) == 2
    for r in targeted:
        assert r.target is not None and r.target.op == "<=" and r.ratio_label.startswith("cost")


async def test_groups_rows_are_per_cycle_and_per_row(fake_clock: Config) -> None:
    """On a clock that advances TICK at every read, every side of the KV
    groups benchmark reads it twice a sample (admission) or twice a batch
    of steps (growth, window: only the calls timed), so each ratio is 1; the
    one target is a cost ceiling, and the per-row figures are divided by
    the rows of a step."""
    from benchmarks.bench_groups import STEPS, bench_groups

    async with asyncio.timeout(BOUND_S):
        rows = await bench_groups(fake_clock)
    assert [r.ratio for r in rows] == [1.0] * len(rows)
    (targeted,) = [r for r in rows if r.target is not None]
    assert targeted.target is not None and targeted.target.op == "<="
    assert targeted.ratio_label.startswith("cost")
    batch = SMOKE.groups_batch_rows
    growth = next(r for r in rows if r.bench.startswith("grouped decode step"))
    # calibrate's 16 steps (the smoke preset's start), in batches of at most
    # STEPS: one TICK a batch, over the steps' rows.
    batches = -(-16 // STEPS)
    assert growth.unit == "ns/row"
    assert growth.subject_value == TICK * batches / (16 * batch)
    window = next(r for r in rows if r.bench.startswith("sliding window step"))
    assert window.subject_value == TICK / batch  # one TICK a step: only the call timed


async def test_decode_figures_are_per_step_speed_ups(
    monkeypatch: pytest.MonkeyPatch, fake_clock: Config
) -> None:
    """Each step reads the clock twice: TICK ns a step on every side, so the
    figures are per step (not per batch) and the ratio, a speed-up, is 1."""

    class Peer(decode_mod.AsyncpoolPages):
        key = "peer"
        label = "peer stand-in"

    monkeypatch.setattr(decode_mod, "PEERS", {"Peer": ("numpy", Peer, decode_mod.BENCH_PAGES)})
    async with asyncio.timeout(BOUND_S):
        rows, skipped = await decode_mod.bench_decode(fake_clock)
    assert skipped == {}
    (row,) = rows
    assert (row.subject_value, row.reference_value, row.ratio) == (TICK, TICK, 1.0)
    assert row.ratio_label.startswith("speed-up")


async def test_decode_fails_a_side_that_keeps_pages_after_its_batches(
    monkeypatch: pytest.MonkeyPatch, fake_clock: Config
) -> None:
    """A side whose batches hand out the right pages but do not give them all
    back fails the run."""

    class Keeper(decode_mod.AsyncpoolPages):
        key = "keeper"
        label = "keeper stand-in"

        def end(self) -> None:
            kept = self.rows[:1]
            self.pool.free(self.rows[1:])
            self.rows = []
            self.kept = kept

        async def close(self) -> None:
            self.pool.free(getattr(self, "kept", []))
            await super().close()

    monkeypatch.setattr(decode_mod, "PEERS", {"Keeper": ("numpy", Keeper, decode_mod.BENCH_PAGES)})
    async with asyncio.timeout(BOUND_S):
        with pytest.raises(AssertionError, match=r"keeper stand-in: .* pages free after the run"):
            await decode_mod.bench_decode(fake_clock)


async def test_contended_pool_grants_as_many_rows_as_the_semaphore(
    monkeypatch: pytest.MonkeyPatch, fake_clock: Config
) -> None:
    """The contended pool has ``contended_rows`` grantable rows (slot 0 is
    padding), as many as the Semaphore it is compared with."""
    from benchmarks import bench_alloc

    pools: list[Any] = []
    real = bench_alloc.pool_worker

    def recording(pool: Any, rounds: int) -> harness.Worker:
        pools.append(pool)
        return real(pool, rounds)

    monkeypatch.setattr(bench_alloc, "pool_worker", recording)
    async with asyncio.timeout(BOUND_S):
        await bench_alloc.bench_contended(fake_clock)
    (pool,) = pools
    assert pool.capacity == SMOKE.contended_rows


async def test_contended_run_fails_when_a_row_is_left_allocated(
    monkeypatch: pytest.MonkeyPatch, fake_clock: Config
) -> None:
    """The contended benchmark checks that every grant was given back."""
    from benchmarks import bench_alloc

    real = bench_alloc.pool_worker
    leaked: list[Any] = []

    def leaking(pool: Any, rounds: int) -> harness.Worker:
        worker = real(pool, rounds)

        async def once() -> None:
            if not leaked:
                leaked.append(await pool.alloc(1))
            await worker()

        return once

    monkeypatch.setattr(bench_alloc, "pool_worker", leaking)
    async with asyncio.timeout(BOUND_S):
        with pytest.raises(AssertionError, match="allocated=1"):
            await bench_alloc.bench_contended(fake_clock)


async def test_reclaim_target_is_on_the_largest_pending_count(fake_clock: Config) -> None:
    """Only the rows at the most pending fences carry the flatness target."""
    from benchmarks.bench_fences import RECLAIM_FLAT, bench_reclaim_sweep

    cfg = replace(fake_clock, reclaim_pending=(1, 2, 3))
    async with asyncio.timeout(BOUND_S):
        rows = await bench_reclaim_sweep(cfg)
    assert [(r.subject, r.target) for r in rows] == [
        ("2 pending fences", None),
        ("3 pending fences", RECLAIM_FLAT),
    ] * 2


async def test_contended_admit_fails_when_a_grant_is_left_allocated(
    monkeypatch: pytest.MonkeyPatch, fake_clock: Config
) -> None:
    """The contended admission benchmark checks that every row and page was
    given back."""
    import asyncpool
    from benchmarks.bench_admit import bench_admit

    leaked: list[Any] = []

    class Leaky(asyncpool.AsyncReqToTokenPool):
        async def admit(self, *args: Any, **kwargs: Any) -> Any:
            grant = await super().admit(*args, **kwargs)
            if self.capacity == SMOKE.contended_rows and not leaked:
                leaked.append(self.try_admit(pages=SMOKE.admit_pages))
            return grant

    monkeypatch.setattr(asyncpool, "AsyncReqToTokenPool", Leaky)
    async with asyncio.timeout(BOUND_S):
        with pytest.raises(AssertionError, match="allocated=1"):
            await bench_admit(fake_clock)
    assert leaked and leaked[0] is not None


async def test_head_reclaim_sweep_fails_a_reclaim_that_miscounts(
    monkeypatch: pytest.MonkeyPatch, fake_clock: Config
) -> None:
    """Each timed head reclaim must release exactly the one row whose fence
    was opened: a reclaim that says otherwise fails the sweep."""
    import asyncpool
    from benchmarks.bench_fences import bench_reclaim_sweep

    class Miscounting(asyncpool.AsyncReqToTokenPool):
        def reclaim(self) -> int:
            return 2 * super().reclaim()

    monkeypatch.setattr(asyncpool, "AsyncReqToTokenPool", Miscounting)
    async with asyncio.timeout(BOUND_S):
        with pytest.raises(AssertionError, match=r"^2$"):
            await bench_reclaim_sweep(fake_clock)
