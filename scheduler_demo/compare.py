"""``python -m scheduler_demo.compare``: the README's figures in one command.

Runs the same workload (transfers and aborts included) as fenced ``overlap``
with atomic admission, fenced ``sync``, ``overlap --unsafe`` and fenced
``overlap --admission row-first``, interleaved round by round (so a noisy
neighbour hits every mode alike), and prints each run, the best and median
tokens/s and row utilization per mode, the overlap/sync, fenced/unsafe and
atomic/row-first ratios, and the corruptions of every unsafe run (with
``--swa-window``, the swa group's beside the full group's). Every
other flag is passed to the demo (``--sched-ms``, ``-n``, ...), except those
it sets itself or has no use for, which it refuses (exit 2): ``--mode``,
``--unsafe``, ``--admission``, ``--json`` (use ``--out``), ``--plot``,
``--tp`` and ``--tp-reclaim``.

Exit status: 0 when every fenced run served every request with 0
corruptions of any kind and every unsafe run found KV corruption (with
``--swa-window``: in the full or the swa group; row corruption alone does
not count, with or without a window); 1 otherwise (a run given up at
--timeout included); 2 on bad arguments. ``--out`` writes the same
judgement as its ``verdict`` (``ok``, ``fenced_clean``, ``unsafe_caught``
per unsafe run, ``gave_up``) beside the summary and every run's report,
also when a run is given up at --timeout (the runs so far, no summary).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from .cli import _run, build_parser, check_args, check_output_path, timeout_message
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


#: Demo flags compare sets itself (the variants) or has no use for: refused
#: when given. Each: its dest -> (the flag, the value compare's runs start from).
REFUSED: dict[str, tuple[str, object]] = {
    "mode": ("--mode", "overlap"),
    "unsafe": ("--unsafe", False),
    "admission": ("--admission", "atomic"),
    "json": ("--json", None),
    "plot": ("--plot", None),
    "tp": ("--tp", 0),
    "tp_reclaim": ("--tp-reclaim", None),
}


def build_compare_parser() -> argparse.ArgumentParser:
    """The demo's parser, named compare, with --rounds and --out, and the
    flags of :data:`REFUSED` hidden (given, they are refused)."""
    parser = build_parser()
    parser.prog = "python -m scheduler_demo.compare"
    parser.description = __doc__
    parser.epilog = None
    for action in parser._actions:
        if action.dest in REFUSED:
            action.default = argparse.SUPPRESS
            action.help = argparse.SUPPRESS
    g = parser.add_argument_group("compare")
    g.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds of the four runs, at least 1 (default %(default)s)",
    )
    g.add_argument("--out", metavar="PATH", help="write every run's report as JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_compare_parser()
    args = parser.parse_args(argv)
    given = [flag for dest, (flag, _) in REFUSED.items() if hasattr(args, dest)]
    if given:
        parser.error(
            f"{', '.join(given)}: not for compare, which runs overlap, sync, --unsafe "
            "and --admission row-first itself (--out writes the JSON)"
        )
    for dest, (_, value) in REFUSED.items():
        setattr(args, dest, value)
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.out is not None:
        check_output_path(parser, "--out", args.out)
    base = replace(check_args(parser, args), progress=False)
    runs: dict[str, list[Report]] = {v[0]: [] for v in VARIANTS}
    k = len(VARIANTS)
    hybrid = base.swa_window > 0
    if hybrid:
        print("(deferred frees: rows/full pages; corruptions: rows/full pages/swa pages)")
    else:
        print("(deferred frees and corruptions: rows/pages)")
    for rnd in range(args.rounds):
        # Rotate the order each round, so no mode always runs first or last.
        for name, mode, unsafe, admission in VARIANTS[rnd % k :] + VARIANTS[: rnd % k]:
            load = _loadavg()
            cfg = replace(base, mode=mode, unsafe=unsafe, admission=admission)
            t0 = time.monotonic()
            try:
                report = _run(run_demo(cfg))
            except TimeoutError:
                message = f"round {rnd + 1} {name}: {timeout_message(cfg, time.monotonic() - t0)}"
                print(message, file=sys.stderr)
                if args.out:
                    _write_out(args.out, runs, None, _verdict(runs, gave_up=message))
                return 1
            runs[name].append(report)
            print(
                f"round {rnd + 1} {name:<9} {report.tokens_per_s:8,.0f} tok/s "
                f"{report.steps_per_s:6.1f} steps/s  {report.elapsed_s:6.2f} s  "
                f"served {report.completed}+{report.aborts}/{report.requests}  "
                f"row util {report.row_utilization:.2f}  "
                f"retractions {report.retractions}  deferred frees {report.deferred_frees}/"
                f"{report.deferred_page_frees}  corruptions {report.corruptions}/"
                f"{report.kv_corruptions}{_swa_count(report)}  load {load} -> {_loadavg()}",
                flush=True,
            )
    summary = _summary(runs)
    print()
    for name, *_ in VARIANTS:
        s = summary[name]
        print(
            f"{name:<9} tokens/s best {s['best']:8,.0f}  median {s['median']:8,.0f}  "
            f"row utilization median {s['row_utilization']:.2f}"
        )
    r = summary["ratios"]
    print(
        f"overlap / sync   tokens/s: best {_times(r['overlap_vs_sync_best'], 2)}, "
        f"median {_times(r['overlap_vs_sync_median'], 2)}"
    )
    print(
        f"fenced / unsafe  tokens/s: best {_times(r['fenced_vs_unsafe_best'], 3)}, "
        f"median {_times(r['fenced_vs_unsafe_median'], 3)}"
    )
    print(
        f"atomic / row-first tokens/s: best {_times(r['atomic_vs_row_first_best'], 3)}, "
        f"median {_times(r['atomic_vs_row_first_median'], 3)}; row utilization "
        f"{summary['overlap']['row_utilization']:.2f} vs "
        f"{summary['row-first']['row_utilization']:.2f}"
    )
    corr = [x.corruptions for x in runs["unsafe"]]
    kv = [x.kv_corruptions for x in runs["unsafe"]]
    swa_kv = [_swa_kv(x) for x in runs["unsafe"]]
    verdict = _verdict(runs)
    caught = verdict["unsafe_caught"]
    print(f"unsafe row corruptions per run: {corr}")
    if hybrid:
        print(
            f"unsafe KV corruptions per run:  full pages {kv}, swa pages {swa_kv} "
            f"({sum(caught)}/{len(caught)} runs > 0 in either group)"
        )
    else:
        print(f"unsafe KV corruptions per run:  {kv} ({sum(caught)}/{len(caught)} runs > 0)")
    if args.out:
        _write_out(args.out, runs, summary, verdict)
    return 0 if verdict["ok"] else 1


def _verdict(runs: dict[str, list[Report]], gave_up: str | None = None) -> dict[str, Any]:
    """What the exit status says, spelled out for ``--out``: ``ok`` (exit 0),
    ``fenced_clean`` (every fenced run served every request with 0
    corruptions of any kind), ``unsafe_caught`` (per unsafe run, whether it
    found KV corruption, in either group with a window) and ``gave_up``
    (the message of a run given up at ``--timeout``, else None; then the
    runs so far are written and ``ok`` is False)."""
    fenced_clean = all(x.ok for name in ("overlap", "sync", "row-first") for x in runs[name])
    # Caught: KV corruption found, in either group with a window (rows alone
    # never count: the rule is the same with and without a window).
    caught = [x.kv_corruptions > 0 or _swa_kv(x) > 0 for x in runs["unsafe"]]
    return {
        "ok": gave_up is None and fenced_clean and all(caught),
        "fenced_clean": fenced_clean,
        "unsafe_caught": caught,
        "gave_up": gave_up,
    }


def _write_out(
    path: str,
    runs: dict[str, list[Report]],
    summary: dict[str, Any] | None,
    verdict: dict[str, Any],
) -> None:
    """``--out``: the verdict, the summary (None for a compare given up
    before its end) and every run's report."""
    payload: dict[str, Any] = {
        "verdict": verdict,
        "summary": summary,
        "runs": {k: [r.to_dict() for r in v] for k, v in runs.items()},
    }
    with open(path, "w") as fh:
        json.dump(payload, fh, indent=2)


def _swa_kv(report: Report) -> int:
    """The swa group's KV corruptions of ``report`` (0 without a window)."""
    return 0 if report.swa is None else int(report.swa["kv_corruptions"])


def _swa_count(report: Report) -> str:
    """``/`` and the swa group's KV corruptions; empty without a window."""
    return "" if report.swa is None else f"/{_swa_kv(report)}"


def _loadavg() -> str:
    """The 1-minute load average: a busy neighbour makes every figure noisy."""
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except OSError:  # pragma: no cover - not on every platform
        return "?"


def _ratio(num: float, den: float) -> float | None:
    """``num / den``, or None where ``den`` is 0 (no output token was made)."""
    return num / den if den else None


def _times(ratio: float | None, digits: int) -> str:
    return "n/a" if ratio is None else f"{ratio:.{digits}f}x"


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
    # A run with no output token (every request aborted before its first)
    # reads 0 tokens/s: its ratios are None ("n/a"), not a ZeroDivisionError
    # that loses every run's figures.
    out["ratios"] = {
        "overlap_vs_sync_best": _ratio(out["overlap"]["best"], out["sync"]["best"]),
        "overlap_vs_sync_median": _ratio(out["overlap"]["median"], out["sync"]["median"]),
        "fenced_vs_unsafe_best": _ratio(out["overlap"]["best"], out["unsafe"]["best"]),
        "fenced_vs_unsafe_median": _ratio(out["overlap"]["median"], out["unsafe"]["median"]),
        "atomic_vs_row_first_best": _ratio(out["overlap"]["best"], out["row-first"]["best"]),
        "atomic_vs_row_first_median": _ratio(out["overlap"]["median"], out["row-first"]["median"]),
        "row_utilization_atomic_vs_row_first": (
            out["overlap"]["row_utilization"] / max(out["row-first"]["row_utilization"], 1e-9)
        ),
    }
    return out


if __name__ == "__main__":
    sys.exit(main())
