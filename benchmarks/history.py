"""Every target across saved benchmark runs, side by side.

``python -m benchmarks.history benchmarks/results/latest.json
benchmarks/results/default-5339384.json`` (any number of saved runs).

One full run reads a target met or missed partly by the host's phase (the
seed-style ratios are torch's per-op cost against ours) and by noise (the
demo's ratios sit at 1.00x). This puts the saved runs side by side, one
column a run (oldest first, by the run's date), one line a target: its
ratio on asyncio / uvloop and whether it was met, so a reader can see which
misses are steady and which come and go. It reads the JSON that ``python -m
benchmarks --json PATH`` writes (``benchmarks/results/*.json``) and prints
Markdown; it measures nothing and writes no file.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .harness import Row

__all__ = ["main", "render_history"]

_LOOPS = ("asyncio", "uvloop")


class RunFileError(ValueError):
    """A file that is not a saved run of ``python -m benchmarks --json``."""


def _load(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RunFileError(f"{path}: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise RunFileError(f"{path}: not a saved run (no 'rows' list)")
    try:
        data["rows"] = [Row.from_json(r) for r in data["rows"]]
    except (TypeError, KeyError, ValueError) as exc:
        raise RunFileError(f"{path}: a row is not a benchmark row ({exc})") from None
    return data


def _label(data: dict[str, Any], path: Path) -> str:
    machine = data.get("machine") or {}
    commit = machine.get("git_commit") or path.stem
    date = str(machine.get("date_utc") or "")[:10]
    return f"{commit} ({date})" if date else str(commit)


def _cell(rows: dict[str, Row]) -> str:
    """The ratios of one target in one run: asyncio / uvloop, or the one
    figure of a benchmark run on one side only (``sync``); bold if missed."""
    order = [loop for loop in _LOOPS if loop in rows] + sorted(set(rows) - set(_LOOPS))
    if not order:
        return "-"
    return " / ".join(
        f"{rows[loop].ratio:.2f}x" if rows[loop].met else f"**{rows[loop].ratio:.2f}x**"
        for loop in order
    )


def render_history(runs: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """Markdown: one line a target (bench, reference, target), one column a
    run; a cell is the ratio on asyncio / uvloop (one figure for a benchmark
    run on one side only), **bold** where missed."""
    keys: list[tuple[str, str, str]] = []
    cells: dict[tuple[str, str, str], dict[int, dict[str, Row]]] = {}
    for i, (_, data) in enumerate(runs):
        for row in data["rows"]:
            if row.target is None:
                continue
            key = (row.bench, row.reference, f"{row.target.op} {row.target.value:g}x")
            if key not in cells:
                keys.append(key)
                cells[key] = {}
            cells[key].setdefault(i, {})[row.loop] = row
    head = ["target", "reference", "goal", *(label for label, _ in runs)]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    met = []
    for _, data in runs:
        n_met = sum(1 for r in data["rows"] if r.met)
        n_all = sum(1 for r in data["rows"] if r.target is not None)
        met.append(f"{n_met} of {n_all}")
    lines.append("| targets met | | | " + " | ".join(met) + " |")
    for key in keys:
        bench, reference, goal = key
        row_cells = [_cell(cells[key].get(i, {})) for i in range(len(runs))]
        lines.append(f"| {bench} | {reference} | {goal} | " + " | ".join(row_cells) + " |")
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.history",
        description="Every target's ratio across saved runs (python -m benchmarks --json), "
        "oldest first; Markdown on stdout.",
    )
    p.add_argument("runs", nargs="+", type=Path, help="saved runs (JSON)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    runs: list[tuple[str, dict[str, Any]]] = []
    for path in args.runs:
        try:
            data = _load(path)
        except RunFileError as exc:
            parser.error(str(exc))
        runs.append((_label(data, path), data))
    runs.sort(key=lambda run: str((run[1].get("machine") or {}).get("date_utc") or ""))
    print(render_history(runs), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
