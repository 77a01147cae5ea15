"""``python -m scheduler_demo.compare``: the README's figures in one command.

Runs the same workload as fenced ``overlap``, fenced ``sync`` and ``overlap
--unsafe``, interleaved round by round (so a noisy neighbour hits every mode
alike), and prints each run, the best and median tokens/s per mode, the
overlap/sync and fenced/unsafe ratios, and the corruptions of every unsafe run.
Every other flag is passed to the demo (``--sched-ms``, ``-n``, ...).

Exit status: 0 when every fenced run completed with 0 corruptions and every
unsafe run found corruption; 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from .cli import _run, build_parser, config_from_args
from .report import Report
from .runner import run_demo

__all__ = ["main"]

VARIANTS: list[tuple[str, str, bool]] = [
    ("overlap", "overlap", False),
    ("sync", "sync", False),
    ("unsafe", "overlap", True),
]


def main(argv: Sequence[str] | None = None) -> int:
    outer = argparse.ArgumentParser(
        prog="python -m scheduler_demo.compare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=True,
    )
    outer.add_argument("--rounds", type=int, default=3, help="rounds of the three runs")
    outer.add_argument("--out", metavar="PATH", help="write every run's report as JSON")
    ours, rest = outer.parse_known_args(argv)
    args = build_parser().parse_args(rest)
    base = config_from_args(args)
    base = replace(base, progress=False)
    runs: dict[str, list[Report]] = {name: [] for name, _, _ in VARIANTS}
    for rnd in range(ours.rounds):
        # Rotate the order each round, so no mode always runs first or last.
        for name, mode, unsafe in VARIANTS[rnd % 3 :] + VARIANTS[: rnd % 3]:
            load = _loadavg()
            report = _run(run_demo(replace(base, mode=mode, unsafe=unsafe)))
            runs[name].append(report)
            print(
                f"round {rnd + 1} {name:<8} {report.tokens_per_s:8,.0f} tok/s "
                f"{report.steps_per_s:6.1f} steps/s  {report.elapsed_s:6.2f} s  "
                f"completed {report.completed}/{report.requests}  "
                f"retractions {report.retractions}  deferred frees {report.deferred_frees}  "
                f"corruptions {report.corruptions}  load {load} -> {_loadavg()}",
                flush=True,
            )
    summary = _summary(runs)
    print()
    for name, _, _ in VARIANTS:
        s = summary[name]
        print(f"{name:<8} tokens/s best {s['best']:8,.0f}  median {s['median']:8,.0f}")
    print(
        f"overlap / sync   tokens/s: best {summary['ratios']['overlap_vs_sync_best']:.2f}x, "
        f"median {summary['ratios']['overlap_vs_sync_median']:.2f}x"
    )
    print(
        f"fenced / unsafe  tokens/s: best {summary['ratios']['fenced_vs_unsafe_best']:.3f}, "
        f"median {summary['ratios']['fenced_vs_unsafe_median']:.3f}"
    )
    corr = [r.corruptions for r in runs["unsafe"]]
    print(f"unsafe corruptions per run: {corr} ({sum(c > 0 for c in corr)}/{len(corr)} runs > 0)")
    if ours.out:
        payload: dict[str, Any] = {
            "summary": summary,
            "runs": {k: [r.to_dict() for r in v] for k, v in runs.items()},
        }
        with open(ours.out, "w") as fh:
            json.dump(payload, fh, indent=2)
    safe_ok = all(r.ok for name in ("overlap", "sync") for r in runs[name])
    unsafe_caught = all(c > 0 for c in corr)
    return 0 if safe_ok and unsafe_caught else 1


def _loadavg() -> str:
    """The 1-minute load average: a busy neighbour makes every figure noisy."""
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except OSError:  # pragma: no cover - not on every platform
        return "?"


def _summary(runs: dict[str, list[Report]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, reports in runs.items():
        tps = [r.tokens_per_s for r in reports]
        out[name] = {"best": max(tps), "median": statistics.median(tps), "all": tps}
    out["ratios"] = {
        "overlap_vs_sync_best": out["overlap"]["best"] / out["sync"]["best"],
        "overlap_vs_sync_median": out["overlap"]["median"] / out["sync"]["median"],
        "fenced_vs_unsafe_best": out["overlap"]["best"] / out["unsafe"]["best"],
        "fenced_vs_unsafe_median": out["overlap"]["median"] / out["unsafe"]["median"],
    }
    return out


if __name__ == "__main__":
    sys.exit(main())
