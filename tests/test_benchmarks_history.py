"""``python -m benchmarks.history``: every target across saved runs.

It reads what ``python -m benchmarks --json`` saved and prints one line a
target, one column a run (oldest first), bold where a run missed; a file
that is not a saved run is a usage error (exit 2) naming it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.harness import Row, Target
from benchmarks.history import main, render_history

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"


def _row(bench: str, loop: str, ratio: float, target: Target | None) -> dict[str, object]:
    return Row(
        bench=bench,
        loop=loop,
        subject="asyncpool",
        reference="ref",
        subject_value=1.0,
        reference_value=ratio,
        unit="ns",
        ratio=ratio,
        ratio_label="cost",
        target=target,
    ).to_json()


def _save(path: Path, commit: str, date: str, rows: list[dict[str, object]]) -> Path:
    path.write_text(
        json.dumps({"rows": rows, "machine": {"git_commit": commit, "date_utc": date}}),
        encoding="utf-8",
    )
    return path


def test_runs_are_columns_oldest_first_and_misses_are_bold(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    at_most = Target("<=", 1.25)
    new = _save(
        tmp_path / "new.json",
        "bbbbbbb",
        "2026-12-05 10:00 UTC",
        [
            _row("contended", "asyncio", 1.2, at_most),
            _row("contended", "uvloop", 1.3, at_most),
            _row("pages", "sync", 5.0, Target(">=", 10.0)),
            _row("context only", "asyncio", 9.0, None),
        ],
    )
    old = _save(
        tmp_path / "old.json",
        "aaaaaaa",
        "2026-12-01 10:00 UTC",
        [_row("contended", "asyncio", 1.1, at_most), _row("contended", "uvloop", 1.2, at_most)],
    )
    assert main([str(new), str(old)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (
        "| target | reference | goal | aaaaaaa (2026-12-01) | bbbbbbb (2026-12-05) |"
    )
    assert lines[2] == "| targets met | | | 2 of 2 | 1 of 3 |"
    assert lines[3] == "| contended | ref | <= 1.25x | 1.10x / 1.20x | 1.20x / **1.30x** |"
    # A target one run lacks reads "-"; a one-sided benchmark shows one figure.
    assert lines[4] == "| pages | ref | >= 10x | - | **5.00x** |"
    assert len(lines) == 5  # rows without a target are not targets


def test_the_stored_runs_render(capsys: pytest.CaptureFixture[str]) -> None:
    paths = sorted(RESULTS.glob("*.json"))
    assert paths, "benchmarks/results holds the saved runs"
    assert main([str(p) for p in paths]) == 0
    out = capsys.readouterr().out
    for p in paths:
        data = json.loads(p.read_text(encoding="utf-8"))
        assert data["machine"]["git_commit"] in out.splitlines()[0]
        n_met = sum(1 for r in data["rows"] if r["target"] and Row.from_json(r).met)
        assert f"{n_met} of " in out.splitlines()[2]


def test_render_history_of_no_targets_is_a_header() -> None:
    text = render_history([("x (2026-12-05)", {"rows": []})])
    assert text.splitlines()[2] == "| targets met | | | 0 of 0 |"


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (None, "No such file"),
        ("{not json", "Expecting property name"),
        ("[]", "not a saved run"),
        ('{"rows": [{"bench": "x"}]}', "is not a benchmark row"),
    ],
    ids=["missing", "not-json", "no-rows", "bad-row"],
)
def test_a_file_that_is_not_a_run_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None, words: str
) -> None:
    path = tmp_path / "run.json"
    if content is not None:
        path.write_text(content, encoding="utf-8")
    with pytest.raises(SystemExit) as exc:
        main([str(path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert str(path) in err and words in err, err
