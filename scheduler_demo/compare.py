"""``python -m scheduler_demo.compare``: the README's figures in one command.

Runs the same workload (transfers and aborts included) as fenced ``overlap``
with atomic admission, fenced ``sync``, ``overlap --unsafe`` and fenced
``overlap --admission row-first``, interleaved round by round (so a noisy
neighbour hits every mode alike), and prints each run, the best and median
tokens/s and row utilization per mode, the overlap/sync, fenced/unsafe and
atomic/row-first ratios, and the corruptions of every unsafe run. Every
other flag is passed to the demo (``--sched-ms``, ``-n``, ...).

Exit status: 0 when every fenced run served every request with 0
corruptions of either kind and every unsafe run found KV corruption; 1
otherwise.
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

#: name -> (mode, unsafe, admission)
VARIANTS: list[tuple[str, str, bool, str]] = [
    ("overlap", "overlap", False, "atomic"),
    ("sync", "sync", False, "atomic"),
    ("unsafe", "overlap", True, "atomic"),
    ("row-first", "overlap", False, "row-first"),
]


def main(argv: Sequence[str] | None = None) -> int:
    outer = argparse.ArgumentParser(
        prog="python -m scheduler_demo.compare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=True,
    )
    outer.add_argument("--rounds", type=int, default=3, help="rounds of the four runs")
    outer.add_argument("--out", metavar="PATH", help="write every run's report as JSON")
    ours, rest = outer.parse_known_args(argv)
    args = build_parser().parse_args(rest)
    base = config_from_args(args)
    base = replace(base, progress=False)
    runs: dict[str, list[Report]] = {v[0]: [] for v in VARIANTS}
    k = len(VARIANTS)
    for rnd in range(ours.rounds):
        # Rotate the order each round, so no mode always runs first or last.
        for name, mode, unsafe, admission in VARIANTS[rnd % k :] + VARIANTS[: rnd % k]:
            load = _loadavg()
            cfg = replace(base, mode=mode, unsafe=unsafe, admission=admission)
            report = _run(run_demo(cfg))
            runs[name].append(report)
            print(
                f"round {rnd + 1} {name:<9} {report.tokens_per_s:8,.0f} tok/s "
                f"{report.steps_per_s:6.1f} steps/s  {report.elapsed_s:6.2f} s  "
                f"served {report.completed}+{report.aborts}/{report.requests}  "
                f"row util {report.row_utilization:.2f}  "
                f"retractions {report.retractions}  deferred frees {report.deferred_frees}/"
                f"{report.deferred_page_frees}  corruptions {report.corruptions}/"
                f"{report.kv_corruptions}  load {load} -> {_loadavg()}",
                flush=True,
            )
    summary = _summary(runs)
    print()
    print("(deferred frees and corruptions: rows/pages)")
    for name, *_ in VARIANTS:
        s = summary[name]
        print(
            f"{name:<9} tokens/s best {s['best']:8,.0f}  median {s['median']:8,.0f}  "
            f"row utilization median {s['row_utilization']:.2f}"
        )
    print(
        f"overlap / sync   tokens/s: best {summary['ratios']['overlap_vs_sync_best']:.2f}x, "
        f"median {summary['ratios']['overlap_vs_sync_median']:.2f}x"
    )
    print(
        f"fenced / unsafe  tokens/s: best {summary['ratios']['fenced_vs_unsafe_best']:.3f}x, "
        f"median {summary['ratios']['fenced_vs_unsafe_median']:.3f}x"
    )
    r = summary["ratios"]
    print(
        f"atomic / row-first tokens/s: best {r['atomic_vs_row_first_best']:.3f}x, "
        f"median {r['atomic_vs_row_first_median']:.3f}x; row utilization "
        f"{summary['overlap']['row_utilization']:.2f} vs "
        f"{summary['row-first']['row_utilization']:.2f}"
    )
    corr = [x.corruptions for x in runs["unsafe"]]
    kv = [x.kv_corruptions for x in runs["unsafe"]]
    print(f"unsafe row corruptions per run: {corr}")
    print(f"unsafe KV corruptions per run:  {kv} ({sum(c > 0 for c in kv)}/{len(kv)} runs > 0)")
    if ours.out:
        payload: dict[str, Any] = {
            "summary": summary,
            "runs": {k: [r.to_dict() for r in v] for k, v in runs.items()},
        }
        with open(ours.out, "w") as fh:
            json.dump(payload, fh, indent=2)
    safe_ok = all(x.ok for name in ("overlap", "sync", "row-first") for x in runs[name])
    unsafe_caught = all(c > 0 for c in kv)
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
        util = [r.row_utilization for r in reports]
        out[name] = {
            "best": max(tps),
            "median": statistics.median(tps),
            "all": tps,
            "row_utilization": statistics.median(util),
        }
    out["ratios"] = {
        "overlap_vs_sync_best": out["overlap"]["best"] / out["sync"]["best"],
        "overlap_vs_sync_median": out["overlap"]["median"] / out["sync"]["median"],
        "fenced_vs_unsafe_best": out["overlap"]["best"] / out["unsafe"]["best"],
        "fenced_vs_unsafe_median": out["overlap"]["median"] / out["unsafe"]["median"],
        "atomic_vs_row_first_best": out["overlap"]["best"] / out["row-first"]["best"],
        "atomic_vs_row_first_median": out["overlap"]["median"] / out["row-first"]["median"],
        "row_utilization_atomic_vs_row_first": (
            out["overlap"]["row_utilization"] / max(out["row-first"]["row_utilization"], 1e-9)
        ),
    }
    return out


if __name__ == "__main__":
    sys.exit(main())
