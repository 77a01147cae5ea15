"""scheduler_demo with a hybrid model (``--swa-window``): a "full" and a
"swa" KV group, the swa pages that slid out of the window dropped behind
each step's fence.

Sizes follow tests/test_demo.py's SMALL (seconds a run). ``HYBRID`` adds a
16-token window and a swa group of 12 pages (the derived size would be 32,
room for every row's window): the swa group is short, so a page given back
is handed out again at once, which is what makes the unsafe run's early
frees visible. The gate (the worst lags, deterministic) also lands a new
owner's prompt KV before a gated step reads its window: unsafe, seeds 0-9
each gave 12-25 swa corruptions; fenced, none.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from helpers import LONG_S, bounded, usage_error
from test_demo import SMALL, _cli_args, snapshot_queued_as_on_cuda

import scheduler_demo.compare
from asyncpool import AsyncReqToTokenPool
from scheduler_demo import DemoConfig, Report, run_demo
from scheduler_demo.cli import main
from scheduler_demo.compare import main as compare_main
from scheduler_demo.forward import Forward
from scheduler_demo.scheduler import Scheduler

HYBRID = replace(SMALL, swa_window=16, swa_pages=12, gate=True)


def _hybrid_args(cfg: DemoConfig) -> list[str]:
    return [*_cli_args(cfg), f"--swa-window={cfg.swa_window}", f"--swa-pages={cfg.swa_pages}"]


async def _run(cfg: DemoConfig) -> tuple[Any, AsyncReqToTokenPool]:
    """The report, and the pool the run used (closed by then)."""
    pools: list[AsyncReqToTokenPool] = []

    def factory(cfg: DemoConfig, pool: AsyncReqToTokenPool, *args: Any, **kw: Any) -> Scheduler:
        pools.append(pool)
        return Scheduler(cfg, pool, *args, **kw)

    async with bounded(LONG_S):
        report = await run_demo(cfg, scheduler_factory=factory)
    return report, pools[0]


async def test_fenced_hybrid_run_is_clean_in_both_groups_and_ends_empty() -> None:
    report, pool = await _run(HYBRID)
    assert report.completed + report.aborts == report.requests == HYBRID.num_requests
    assert report.corruptions == 0 and report.mismatches == 0
    assert report.kv_corruptions == 0 and report.kv_mismatches == 0
    swa = report.swa
    assert swa is not None
    assert swa["kv_corruptions"] == 0 and swa["kv_mismatches"] == 0
    assert report.ok
    # Fenced, the dropped pages waited for the step in flight.
    assert swa["deferred_page_frees"] > 0
    st = pool.stats()
    assert st.allocated == st.pending == 0
    assert st.pages_allocated == st.pages_pending == 0
    assert set(st.kv_groups) == {"full", "swa"}
    for group in st.kv_groups.values():
        assert group.allocated == group.pending == 0


async def test_unsafe_hybrid_run_corrupts_swa_pages() -> None:
    report, _ = await _run(replace(HYBRID, unsafe=True))
    swa = report.swa
    assert swa is not None
    assert swa["kv_corruptions"] > 0 and swa["kv_mismatches"] >= swa["kv_corruptions"]
    assert swa["deferred_page_frees"] == 0  # unsafe: every drop and free at once
    assert not report.ok


async def test_the_drops_give_swa_pages_back_and_the_group_needs_them() -> None:
    report, _ = await _run(HYBRID)
    swa = report.swa
    assert swa is not None
    assert swa["window"] == 16 and swa["pages"] == 12
    assert swa["pages_dropped"] > 0
    assert swa["peak_allocated"] <= swa["pages"]
    # Without the drops one step's rows would have held more pages than the
    # group has: the run finished only because the window's pages went back.
    assert swa["undropped_peak"] > swa["pages"]


async def test_derived_swa_size_is_room_for_every_rows_window() -> None:
    report, _ = await _run(replace(HYBRID, swa_pages=0, num_requests=12))
    assert report.swa is not None
    # 8 rows x (ceil(16 / 8) + 2) pages.
    assert report.swa["pages"] == 8 * 4 and report.ok


def test_cli_hybrid_run_reports_each_group(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    js = tmp_path / "out.json"
    assert main([*_hybrid_args(HYBRID), "--gate", f"--json={js}"]) == 0
    data = json.loads(js.read_text())
    assert data["swa"]["kv_corruptions"] == 0 and data["kv_corruptions"] == 0
    assert data["config"]["swa_window"] == 16
    out = capsys.readouterr().out
    assert "kv_corruptions (full pages)" in out and "kv_corruptions (swa pages)" in out
    assert "swa pages dropped / deferred" in out
    js2 = tmp_path / "unsafe.json"
    assert main([*_hybrid_args(HYBRID), "--gate", "--unsafe", f"--json={js2}"]) == 1
    assert json.loads(js2.read_text())["swa"]["kv_corruptions"] > 0


def test_cli_default_run_has_no_swa_output(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    js = tmp_path / "out.json"
    assert main([*_cli_args(replace(SMALL, num_requests=8)), f"--json={js}"]) == 0
    assert "swa" not in json.loads(js.read_text())
    out = capsys.readouterr().out
    assert "kv_corruptions (pages)" in out and "swa" not in out


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--swa-window=-1"], "--swa-window and --swa-pages must be >= 0"),
        (["--swa-pages=8"], "--swa-pages needs --swa-window"),
        (["--swa-window=126"], "--swa-window (126) must be under --max-context-len - 2"),
        (["--swa-window=16", "--swa-pages=3"], "--swa-pages (3) must be >= 4"),
        (["--swa-window=16", "--swa-pages=100000000"], "--swa-pages must be <= "),
        (["--swa-window=16", "--tp=2"], "--swa-window is not run with --tp"),
        (["--swa-window=x"], "invalid int value"),
    ],
)
def test_cli_refuses_bad_swa_flags(
    args: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["--max-context-len=128", "--kv-pages=32", "--page-size=8", "-n", "4"]
    assert says in usage_error(main, [*base, *args], capsys)


def test_help_explains_the_hybrid_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "--swa-window W" in out and "--swa-pages N" in out and "drop_pages" in out


@pytest.mark.cuda
async def test_cuda_fenced_hybrid_run() -> None:
    # Not run on the project's VM (no GPU): the swa inputs, writes and read-backs
    # on a CUDA stream, fenced, with no gate (the gate is CPU only).
    report, _ = await _run(replace(HYBRID, device="cuda", gate=False, forward_ms=2.0))
    assert report.swa is not None and report.ok


# -- the end-of-run check of a finished request's last window -------------------


def _scribbling(cfg: DemoConfig, pool: AsyncReqToTokenPool, *args: Any, **kw: Any) -> Scheduler:
    """A scheduler that, as each request finishes, overwrites the swa KV of
    its last position: a corruption that lands after the request's last
    step read its window, which only the end-of-run check can see."""

    class Scribbling(Scheduler):
        def _finish(self, req: Any, length: int) -> None:
            kv = self.forward.kv
            assert self.swa is not None and kv is not None
            kv[int(self.swa.slots(req.row, length - 1, length)[0])] = -1
            super()._finish(req, length)

    return Scribbling(cfg, pool, *args, **kw)


@pytest.mark.parametrize("mode", ["overlap", "sync"])
async def test_the_final_check_reads_each_finished_requests_last_window(mode: str) -> None:
    async with bounded(LONG_S):
        report = await run_demo(replace(HYBRID, mode=mode), scheduler_factory=_scribbling)
    assert report.swa is not None and report.completed > 0
    # Every finished request's window was found overwritten, and only there.
    assert report.swa["kv_corruptions"] == report.completed
    assert report.swa["kv_mismatches"] == report.completed
    assert report.corruptions == 0 and report.kv_corruptions == 0
    assert not report.ok


async def test_the_final_window_read_is_fenced_like_the_full_groups(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The copy of a finished request's last window is part of its final
    read: queued after the steps in flight as on CUDA (here behind a lagging
    host stream), its swa pages are freed behind that read, so a new
    owner's transfer cannot land in them first; and the pages a drop gave
    back (a fence away from a new owner) are not read."""

    monkeypatch.setattr(Forward, "snapshot", snapshot_queued_as_on_cuda)
    report, _ = await _run(replace(HYBRID, gate=False, transfer_ms=0.4))
    assert report.swa is not None and report.completed > 0
    assert report.corruptions == 0 and report.kv_corruptions == 0
    assert report.swa["kv_corruptions"] == 0
    assert report.ok


# -- compare with a window -------------------------------------------------------


def test_compare_runs_the_window_and_prints_the_swa_counts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "compare.json"
    assert compare_main(["--rounds=1", f"--out={out}", *_hybrid_args(HYBRID), "--gate"]) == 0
    runs = json.loads(out.read_text())["runs"]
    for name in ("overlap", "sync", "unsafe", "row-first"):
        assert runs[name][0]["swa"]["window"] == 16, name  # every run has the window
    unsafe = runs["unsafe"][0]
    rows, kv, swa = unsafe["corruptions"], unsafe["kv_corruptions"], unsafe["swa"]["kv_corruptions"]
    assert swa > 0
    text = capsys.readouterr().out
    assert "(deferred frees: rows/full pages; corruptions: rows/full pages/swa pages)" in text
    assert f"corruptions {rows}/{kv}/{swa}  load" in text
    assert f"unsafe KV corruptions per run:  full pages [{kv}], swa pages [{swa}] (1/1" in text


def _unsafe_found(rows: int, kv: int, swa: int) -> Any:
    """compare's ``run_demo``, its unsafe runs' corruption counts set to
    these (so the verdict is tested whatever a run happens to hit)."""
    real = scheduler_demo.compare.run_demo

    async def run(cfg: DemoConfig) -> Report:
        report = await real(cfg)
        if not cfg.unsafe:
            return report
        report = replace(report, corruptions=rows, kv_corruptions=kv)
        if report.swa is not None:
            report.swa["kv_corruptions"] = swa
        return report

    return run


@pytest.mark.parametrize(
    ("window", "rows", "kv", "swa", "rc", "says"),
    [
        # With a window: KV corruption in either group catches the run.
        (True, 0, 0, 7, 0, "full pages [0], swa pages [7] (1/1 runs > 0 in either group)"),
        (True, 0, 5, 0, 0, "full pages [5], swa pages [0] (1/1 runs > 0 in either group)"),
        # Row corruption alone does not, with a window or without.
        (True, 3, 0, 0, 1, "full pages [0], swa pages [0] (0/1 runs > 0 in either group)"),
        (False, 3, 0, 0, 1, "unsafe KV corruptions per run:  [0] (0/1 runs > 0)"),
        (False, 0, 5, 0, 0, "unsafe KV corruptions per run:  [5] (1/1 runs > 0)"),
    ],
)
def test_compare_counts_an_unsafe_run_caught_by_kv_corruption_in_either_group(
    window: bool,
    rows: int,
    kv: int,
    swa: int,
    rc: int,
    says: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(scheduler_demo.compare, "run_demo", _unsafe_found(rows, kv, swa))
    args = _hybrid_args(HYBRID) if window else _cli_args(SMALL)
    assert compare_main(["--rounds=1", *args, "--gate"]) == rc
    text = capsys.readouterr().out
    assert says in text
    assert ("swa" in text) == window  # the output without a window is as before


def test_a_derived_swa_size_past_the_cap_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    # --swa-pages 20040000 is refused (past 10,000,000); 0 derived the same
    # 20,040,000 pages (20,000 rows x (1000 + 2)) and the run went ahead.
    args = ["--swa-window=1000", "--page-size=1", "--rows=20000", "--kv-pages=30000", "-n", "1"]
    err = usage_error(main, args, capsys)
    assert "--swa-pages 0 derives 20,040,000 pages (--rows x (ceil(--swa-window" in err
    assert "past the 10,000,000 allowed: give --swa-pages" in err
    err = usage_error(main, [*args, "--swa-pages=20040000"], capsys)
    assert "--swa-pages must be <= 10,000,000" in err
