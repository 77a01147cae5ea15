"""The figures the README and docs/performance.md read off the stored
benchmark runs (``benchmarks/results/*.json``), against those runs.

A claims audit found the README's and docs/performance.md's count of the
stored runs in which the seed-style ``alloc(1)`` target was missed on uvloop
wrong ("five of the seven", where the history table the same README prints
bolds four), and nothing checked the history table against the command
printed beside it. These tests recompute each figure from the JSON the
command reads, so a new stored run, or a table edited by hand, fails here
until the prose says what the runs say.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from benchmarks.harness import Row
from benchmarks.history import main

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
README = REPO / "README.md"
PERFORMANCE = REPO / "docs" / "performance.md"

_WORDS = {
    1: "one",
    2: "two",
    3: "three",
    4: "four",
    5: "five",
    6: "six",
    7: "seven",
    8: "eight",
    9: "nine",
    10: "ten",
}


def _flat(path: Path) -> str:
    """The document's text with every run of whitespace one space."""
    return re.sub(r"\s+", " ", path.read_text(encoding="utf-8"))


def _history_runs() -> list[Path]:
    """The saved runs the README's ``python -m benchmarks.history`` names."""
    found = re.search(
        r"python -m benchmarks\.history((?: benchmarks/results/[\w.-]+\.json)+)",
        _flat(README),
    )
    assert found, "the README shows the history command with the stored runs"
    return [REPO / name for name in found.group(1).split()]


def _load(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data


def _seed_style_misses(paths: list[Path], loop: str) -> int:
    """How many of the runs missed ``alloc(1)`` + ``free`` against the seed."""
    missed = 0
    for path in paths:
        rows = [Row.from_json(r) for r in _load(path)["rows"]]
        (row,) = [
            r
            for r in rows
            if r.bench == "uncontended alloc(1)+free"
            and r.reference == "seed-style"
            and r.loop == loop
        ]
        missed += not row.met
    return missed


def test_the_readme_history_table_is_what_its_command_prints(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main([str(p) for p in _history_runs()]) == 0
    printed = capsys.readouterr().out.splitlines()
    lines = README.read_text(encoding="utf-8").splitlines()
    start = lines.index(printed[0])
    assert lines[start : start + len(printed)] == printed
    assert not lines[start + len(printed)].startswith("|")  # no row the command lacks


def test_every_stored_run_is_named_in_the_readme() -> None:
    readme = _flat(README)
    stored = sorted(p.name for p in RESULTS.glob("*.json"))
    assert stored
    assert [name for name in stored if name not in readme] == []


def test_the_latest_runs_count_of_targets_met_and_of_later_runs() -> None:
    readme = _flat(README)
    latest = _load(RESULTS / "latest.json")
    assert f"**{latest['targets_met']} of {latest['targets_total']} targets met**" in readme
    later = len(_history_runs()) - 1
    assert f"{_WORDS[later].capitalize()} later full runs" in readme


def test_the_seed_style_misses_on_uvloop_are_counted_as_the_runs_read() -> None:
    runs = _history_runs()
    missed = _seed_style_misses(runs, "uvloop")
    claims = [
        (doc.name, m.group(1), m.group(2))
        for doc in (README, PERFORMANCE)
        for m in re.finditer(
            r"uvloop (?:it is )?(?:missed )?in (\w+) of (?:the |those )?(\w+)", _flat(doc)
        )
    ]
    # Two in the README, three in docs/performance.md: a rewording that
    # drops one must drop it here too.
    assert len(claims) == 5, claims
    assert [c for c in claims if c[1:] != (_WORDS[missed], _WORDS[len(runs)])] == []
