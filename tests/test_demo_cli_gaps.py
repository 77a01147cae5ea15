"""The demo's command lines refuse what cannot work, up front, with status 2
and the flag's name: no run starts (each case exits in the parser or the
checks after it), so these are fast."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
from helpers import bounded, usage_error

from scheduler_demo.cli import main
from scheduler_demo.compare import main as compare_main
from scheduler_demo.workload import MAX_LENGTH, LengthDist


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--transfer-ms", "nan"], "--transfer-ms"),
        (["--transfer-ms", "inf"], "--transfer-ms"),
        (["--transfer-ms", "1e9"], "--transfer-ms"),
        (["--forward-ms", "nan"], "--forward-ms"),
        (["--forward-ms", "inf"], "--forward-ms"),
        (["--forward-us-per-token", "inf"], "--forward-us-per-token"),
        (["--forward-us-per-token", "1e300"], "--forward-us-per-token"),
        (["--sched-ms", "inf"], "--sched-ms"),
        (["--sched-ms", "nan"], "--sched-ms"),
        (["--sched-ms", "1e7"], "--sched-ms"),
        (["--timeout", "nan"], "--timeout"),
        (["--timeout", "inf"], "--timeout"),
        (["--timeout", "0"], "--timeout"),
        (["--rate", "nan"], "--rate"),
        (["--rate", "inf"], "--rate"),
        (["--abort-rate", "nan"], "--abort-rate"),
        (["--admit-watermark", "nan"], "--admit-watermark"),
        (["--prompt-len", "const:inf"], "--prompt-len"),
        (["--prompt-len", "const:1e400"], "--prompt-len"),
        (["--prompt-len", "uniform:1:inf"], "--prompt-len"),
        (["--prompt-len", "lognormal:inf:0"], "--prompt-len"),
        (["--prompt-len", "lognormal:nan:1"], "--prompt-len"),
        (["--output-len", "exp:inf"], "--output-len"),
        (["--output-len", "zipf:2"], "--output-len"),
        (["-n", "0"], "-n/--num-requests"),
        (["--rows", "0"], "--rows"),
        (["--kv-pages", "10"], "--kv-pages"),
    ],
)
def test_bad_numbers_are_refused_naming_the_flag(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    err = usage_error(main, ["-n", "20", *argv], capsys)
    assert "usage:" in err
    assert f"error: {flag}" in err, err
    # The messages name flags, not the config's fields.
    for field in ("num_requests", "timeout_s", "transfer_ms", "prompt_len", "kv_pages"):
        assert field not in err


def test_gate_on_cuda_is_refused_in_words_naming_both_flags(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The config's message once read "device='cpu'", which the flag
    # rewriter turned into "--device='cpu'".
    err = usage_error(main, ["--gate", "--device", "cuda"], capsys)
    assert "error: --gate needs --device 'cpu'" in err, err


def test_a_user_value_is_quoted_as_written_not_renamed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    err = usage_error(main, ["--prompt-len", "rate:3"], capsys)
    assert "error: --prompt-len: unknown length distribution 'rate' in 'rate:3'" in err


@pytest.mark.parametrize(
    "spec",
    [
        "lognormal:96:1000",
        "lognormal:1e300:5",
        "exp:1e300",
        "exp:1e-320",
        "uniform:1:1e300",
        "const:1e300",
    ],
)
def test_length_draws_are_bounded_and_never_overflow(spec: str) -> None:
    dist = LengthDist.parse(spec)
    rng = random.Random(0)
    assert all(1 <= dist.sample(rng) <= MAX_LENGTH for _ in range(200))


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--rounds", "0"], "--rounds must be >= 1"),
        (["--rounds", "-2"], "--rounds must be >= 1"),
        (["-n", "0"], "-n/--num-requests must be >= 1"),
        (["--transfer-ms", "nan"], "--transfer-ms"),
        (["--unsafe"], "--unsafe: not for compare"),
        (["--mode", "sync"], "--mode: not for compare"),
        (["--mode", "overlap"], "--mode: not for compare"),
        (["--admission", "row-first"], "--admission: not for compare"),
        (["--json", "x.json"], "--json: not for compare"),
        (["--plot", "x.png"], "--plot: not for compare"),
        (["--tp", "2"], "--tp: not for compare"),
        (["--out", "/nonexistent/x.json"], "--out /nonexistent/x.json"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_compare_refuses_bad_and_overridden_flags(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    err = usage_error(compare_main, argv, capsys)
    assert "python -m scheduler_demo.compare: error:" in err, err
    assert needle in err, err


def test_compare_help_lists_its_own_flags_not_the_refused_ones(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exc:
        compare_main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--rounds" in out and "--out" in out and "refuses (exit 2)" in out
    assert "--unsafe " not in out.split("options:")[-1]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--json", "/nonexistent/x.json"], "--json /nonexistent/x.json: the directory"),
        (["--json", "."], "--json .: is a directory"),
        (["--plot", "/nonexistent/x.png"], "--plot /nonexistent/x.png: the directory"),
        (["--plot", "out.pdf"], "--plot out.pdf: the plot is a PNG"),
        (["--plot", "out.txt"], "--plot out.txt: the plot is a PNG"),
        (["--plot", "out"], "--plot out: the plot is a PNG"),
    ],
)
def test_bad_output_paths_are_refused_before_the_run(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    err = usage_error(main, argv, capsys)
    assert needle in err, err


def test_a_directory_as_output_isusage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = usage_error(main, ["--json", str(tmp_path)], capsys)
    assert "is a directory" in err


def test_tp_refuses_plot_up_front(capsys: pytest.CaptureFixture[str]) -> None:
    err = usage_error(main, ["--tp", "2", "--plot", "x.png"], capsys)
    assert "usage:" in err and "--plot is not drawn with --tp" in err


@pytest.mark.parametrize("extra", [["--gate"], ["--admission", "row-first"]])
def test_tp_conflicts_print_the_usage_line(
    extra: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--tp", "2", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage:")
    assert "error: --tp needs --admission atomic and no --gate" in err


def test_help_says_what_gate_does_in_sync_mode_and_what_unsafe_frees(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "with --mode sync only the transfer half applies" in out
    assert "free rows and KV pages immediately" in out
    assert "without waiting for its KV transfer to land" in out
    assert "at most 60000" in out


async def test_timeout_cuts_short_the_steps_in_flight() -> None:
    """--timeout with 20 s steps: the steps queued or running skip their
    compute once the run is given up, so closing the stream does not wait
    them out (it took two whole steps, 40 s here, and then said "after
    --timeout 0.5 s")."""
    import time
    from dataclasses import replace

    from scheduler_demo.config import DemoConfig
    from scheduler_demo.runner import run_demo

    cfg = replace(
        DemoConfig(), num_requests=4, rate=0.0, forward_ms=20_000.0, progress=False, timeout_s=0.5
    )
    t0 = time.monotonic()
    async with bounded(10.0):  # a regression fails in 10 s, not after 40
        with pytest.raises(TimeoutError):
            await run_demo(cfg)
    assert time.monotonic() - t0 < 10.0


def test_plot_without_matplotlib_is_refused_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Installed without the demo extra, ``--plot`` failed after the whole
    run, at the import of matplotlib; it is refused up front, saying what
    to install."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import raises ImportError
    err = usage_error(main, ["--plot", str(tmp_path / "x.png")], capsys)
    assert "--plot needs matplotlib" in err and "asyncpool[demo]" in err
    assert not (tmp_path / "x.png").exists()


def test_no_tqdm_means_no_progress_bar_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    """With stderr a terminal and tqdm missing (no demo extra), the run goes
    on without a bar instead of failing at the import."""
    from scheduler_demo.config import DemoConfig
    from scheduler_demo.runner import _progress_bar

    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert _progress_bar(DemoConfig(progress=True)) is None
