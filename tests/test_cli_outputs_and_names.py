"""Found by trying the programs as a new user: a compare whose runs made no
output token, an output path given twice or given empty, the benchmarks'
output paths and names, which were checked only after (or not as) a usage
error, and the examples' bad arguments, which ended in a traceback and exit
1, the status of corruption found. Each is now a usage error (exit 2) before
anything runs, or a report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import load_example

from scheduler_demo.cli import main
from scheduler_demo.compare import main as compare_main
from scheduler_demo.config import DemoConfig
from scheduler_demo.report import Report

# Every request aborted while its KV is still on its way (an output of one
# token cannot be aborted mid-decode): no run makes an output token.
NO_TOKENS = [
    "-n",
    "4",
    "--abort-rate",
    "1",
    "--output-len",
    "const:1",
    "--prompt-len",
    "const:8",
    "--transfer-ms",
    "5",
    "--no-progress",
]


def test_compare_whose_runs_make_no_token_reports_instead_of_crashing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "compare.json"
    # ZeroDivisionError before, after every run, and --out never written.
    rc = compare_main(["--rounds", "1", "--out", str(out), *NO_TOKENS])
    assert rc == 1  # the unsafe run caught nothing: no KV was ever reused
    data = json.loads(out.read_text())
    assert data["summary"]["overlap"]["best"] == 0
    assert data["summary"]["ratios"]["overlap_vs_sync_best"] is None
    # The exit status, spelled out: the fenced runs were clean, the unsafe
    # one caught nothing.
    assert data["verdict"] == {
        "ok": False,
        "fenced_clean": True,
        "unsafe_caught": [False],
        "gave_up": None,
    }
    printed = capsys.readouterr().out
    assert "overlap / sync   tokens/s: best n/a, median n/a" in printed


def test_compare_given_up_at_timeout_still_writes_the_runs_so_far(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A compare stopped by a run given up at --timeout wrote no --out: the
    rounds it had run were lost with it. Now the runs so far are written,
    with the verdict naming the run given up."""
    from scheduler_demo import compare

    real = compare.run_demo
    calls = 0

    async def second_gives_up(cfg: DemoConfig) -> Report:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise TimeoutError
        return await real(cfg)

    monkeypatch.setattr(compare, "run_demo", second_gives_up)
    out = tmp_path / "compare.json"
    assert compare_main(["--rounds", "1", "--out", str(out), *NO_TOKENS]) == 1
    data = json.loads(out.read_text())
    assert data["summary"] is None
    assert [len(data["runs"][name]) for name in ("overlap", "sync", "unsafe", "row-first")] == [
        1,
        0,
        0,
        0,
    ]
    verdict = data["verdict"]
    assert verdict["ok"] is False
    assert "round 1 sync" in verdict["gave_up"] and "--timeout" in verdict["gave_up"]
    assert "round 1 sync" in capsys.readouterr().err


def test_json_and_plot_to_the_same_file_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The plot overwrote the JSON and the run exited 0.
    same = tmp_path / "out.png"
    alias = tmp_path / "." / "out.png"
    with pytest.raises(SystemExit) as exc:
        main([*NO_TOKENS, "--json", str(same), "--plot", str(alias)])
    assert exc.value.code == 2
    assert "the same file" in capsys.readouterr().err
    assert not same.exists()


@pytest.mark.parametrize("flag", ["--json", "--md"])
def test_benchmarks_refuse_an_output_path_that_is_a_directory_before_measuring(
    flag: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Measured everything, then IsADirectoryError; with --md a directory the
    # --json samples were lost too.
    import benchmarks.run as run

    def never(*args: object, **kwargs: object) -> object:
        raise AssertionError("measured before refusing the output path")

    monkeypatch.setattr(run, "run_on", never)
    with pytest.raises(SystemExit) as exc:
        run.main(["--preset", "smoke", "--only", "uncontended", flag, str(tmp_path)])
    assert exc.value.code == 2


def test_benchmarks_from_json_of_a_missing_file_is_a_usage_error(tmp_path: Path) -> None:
    from benchmarks.run import main as bench_main

    with pytest.raises(SystemExit) as exc:
        bench_main(["--from-json", str(tmp_path / "none.json"), "--no-md"])
    assert exc.value.code == 2  # FileNotFoundError traceback before


@pytest.mark.parametrize("flag", ["--json", "--plot"])
def test_an_empty_output_path_is_refused(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    # `--json ''` ran and wrote nothing (an empty path read as no flag).
    with pytest.raises(SystemExit) as exc:
        main([*NO_TOKENS, flag, ""])
    assert exc.value.code == 2
    assert f"error: {flag} " in capsys.readouterr().err  # "an empty path", or not a PNG


def test_compare_refuses_an_empty_out_path(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        compare_main(["--rounds", "1", "--out", "", *NO_TOKENS])
    assert exc.value.code == 2
    assert "an empty path" in capsys.readouterr().err


def test_benchmarks_refuse_md_with_no_md(tmp_path: Path) -> None:
    # --no-md won and --md was ignored, silently.
    from benchmarks.run import main as bench_main

    with pytest.raises(SystemExit) as exc:
        bench_main(
            [
                "--preset",
                "smoke",
                "--only",
                "uncontended",
                "--md",
                str(tmp_path / "x.md"),
                "--no-md",
            ]
        )
    assert exc.value.code == 2


BAD_EXAMPLE_ARGS = [
    (name, args)
    for name, extra in [
        ("overlap_step", [["--retract", "2"], ["--requests", "-1"]]),
        ("sync_dropin", [["--abort", "-0.1"], ["--requests", "-1"]]),
        ("paged_admission", [["--prefix-pages", "-1"], ["--headroom", "-1"], ["--abort", "nan"]]),
        ("speculative_decode", [["--low-water", "-1"], ["--headroom", "-1"]]),
        (
            "hybrid_admission",
            [
                ["--window", "0"],
                ["--page-size", "0"],
                ["--requests", "-1"],
                ["--full-pages", "31"],  # the longest request alone needs 32 pages of 4
                ["--swa-pages", "6"],  # a window of 16 in pages of 4, and 3
            ],
        ),
        ("weight_update", [["--update-every", "0"], ["--timeouts", "2"], ["--cancels", "-1"]]),
    ]
    for args in [
        ["--rows", "0"],
        ["--rows", "-1"],
        ["--forward-ms", "-1"],
        ["--forward-ms", "nan"],
        ["--forward-ms", "inf"],
        ["--device", "foo"],
        *extra,
    ]
]


@pytest.mark.parametrize(
    ("name", "args"), BAD_EXAMPLE_ARGS, ids=lambda v: v if isinstance(v, str) else " ".join(v)
)
def test_an_example_refuses_a_bad_argument_with_a_usage_error(
    name: str, args: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    example = load_example(name, monkeypatch)
    with pytest.raises(SystemExit) as exc:
        example.main(args)
    assert exc.value.code == 2  # a traceback and exit 1 before, for most
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize(
    "name",
    [
        "overlap_step",
        "sync_dropin",
        "paged_admission",
        "speculative_decode",
        "hybrid_admission",
        "weight_update",
    ],
)
def test_an_example_refuses_cuda_without_cuda(
    name: str,
    without_cuda: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    example = load_example(name, monkeypatch)
    with pytest.raises(SystemExit) as exc:
        example.main(["--device", "cuda"])
    assert exc.value.code == 2
    assert "no CUDA device is available here" in capsys.readouterr().err
