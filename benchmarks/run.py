"""The benchmark entry point: ``python -m benchmarks`` or ``python benchmarks/run.py``.

Runs every benchmark on asyncio and on uvloop (the synchronous page-allocator
benchmarks, ``pages`` and ``decode``, once), prints a markdown report to
stdout, writes it to ``docs/benchmarks.md`` under the current directory
(``--md PATH`` elsewhere, ``--no-md`` not at all; a run of a subset, ``--only``,
writes it only to a ``--md PATH`` given, so reproducing one figure never
overwrites the full report; nor does ``--from-json`` of a subset's run) and,
with ``--json PATH``, every sample as JSON. It
never writes anywhere else. ``--quick`` is the short run. Progress goes to
stderr. The package is not installed by ``pip install .``: run it from the
root of a checkout.
"""

from __future__ import annotations

import argparse
import functools
import os
import shlex
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import PRESETS, Config, Row, loop_factories, run_on
from benchmarks.report import REPO, loadavg, machine_info, render_markdown, to_json

#: relative, so it lands under the current directory, never beside the package
DEFAULT_MD = Path("docs") / "benchmarks.md"

BENCHMARKS = (
    "uncontended",
    "batched",
    "contended",
    "admit",
    "groups",
    "fenced",
    "reclaim",
    "scaling",
    "wake",
    "metrics",
    "pages",
    "decode",
    "demo",
    "agree",
)


def _positive_int(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def _names(text: str) -> list[str]:
    """The names of a comma-separated option (``--only``, ``--loops``)."""
    return [name for name in text.split(",") if name]


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    return _parser().parse_args(argv)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--quick", action="store_true", help="fewer, shorter rounds (one to two minutes)"
    )
    p.add_argument("--preset", choices=sorted(PRESETS), help="default, quick, or smoke (tests)")
    p.add_argument("--json", metavar="PATH", type=Path, help="write every sample as JSON")
    p.add_argument(
        "--md",
        metavar="PATH",
        type=Path,
        default=None,
        help="where to write the markdown (default: docs/benchmarks.md, relative "
        "to the current directory, for a run of every benchmark; a run of a "
        "subset (--only) writes it only here)",
    )
    p.add_argument("--no-md", action="store_true", help="only print the markdown")
    p.add_argument(
        "--loops",
        default=",".join(loop_factories()),
        help="comma-separated loop kinds (default: asyncio,uvloop)",
    )
    p.add_argument(
        "--only",
        default=",".join(BENCHMARKS),
        help=f"comma-separated subset of: {','.join(BENCHMARKS)}",
    )
    p.add_argument(
        "--rounds", type=_positive_int, help="override the interleaved rounds per comparison"
    )
    p.add_argument(
        "--slow-fences",
        type=_positive_int,
        metavar="N",
        help="how many slow fences of unknown origin the wake benchmark keeps "
        "watched (default 100; --only wake --slow-fences 1000 measures the "
        "wake-up latency docs/api.md quotes for thousands of pending transfers)",
    )
    p.add_argument(
        "--from-json",
        metavar="PATH",
        type=Path,
        help="measure nothing: re-render the markdown of a saved --json run (to "
        "docs/benchmarks.md by default only if that run was of every benchmark)",
    )
    p.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="wall: perf_counter_ns (default); cpu: the benchmarking thread's CPU "
        "time, for single-threaded figures on a shared, loaded machine (wake-up "
        "latency, the head-reclaim sweep, the demo and agree always use wall time)",
    )
    return p


def _check_output(p: argparse.ArgumentParser, flag: str, path: Path | None) -> None:
    """Refuse (exit 2), before anything is measured, an output path that
    cannot be written: a directory, or one under a folder that cannot be
    made or written (the missing folders are made)."""
    if path is None:
        return
    if path.is_dir():
        p.error(f"{flag} {path}: is a directory, not a file")
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        p.error(f"{flag} {path}: {str(folder)!r} is not a directory")
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        p.error(f"{flag} {path}: not writable")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    preset = args.preset or ("quick" if args.quick else "default")
    cfg = PRESETS[preset]
    from dataclasses import replace

    if args.rounds is not None:
        cfg = replace(cfg, rounds=args.rounds)
    cfg = replace(cfg, clock=args.clock)
    if args.slow_fences is not None:
        cfg = replace(cfg, slow_fences=args.slow_fences)
    loops = _names(args.loops)
    if not loops:
        parser.error(f"--loops names no loop kind; have {list(loop_factories())}")
    unknown = [lp for lp in loops if lp not in loop_factories()]
    if unknown:
        parser.error(f"unknown loop kind(s): {unknown}; have {list(loop_factories())}")
    only = _names(args.only)
    if not only:
        parser.error(f"--only names no benchmark; have {list(BENCHMARKS)}")
    bad = [b for b in only if b not in BENCHMARKS]
    if bad:
        parser.error(f"unknown benchmark(s): {bad}; have {list(BENCHMARKS)}")
    if args.md is not None and args.no_md:
        parser.error("--md PATH and --no-md: one writes the markdown, the other does not")
    given = list(argv if argv is not None else sys.argv[1:])
    command = "python -m benchmarks " + shlex.join(given)
    if args.from_json:
        return _render_saved(parser, args)
    if args.md is None and set(only) == set(BENCHMARKS):
        args.md = DEFAULT_MD
    if args.md is None and not args.no_md:
        _log("a subset (--only): the markdown is not written (--md PATH writes it)")
        args.no_md = True
    # Before the run, not after it: a full run takes minutes, and the JSON is
    # written after the markdown.
    _check_output(parser, "--md", None if args.no_md else args.md)
    _check_output(parser, "--json", args.json)

    from benchmarks.bench_admit import bench_admit
    from benchmarks.bench_alloc import bench_batched, bench_contended, bench_uncontended
    from benchmarks.bench_decode import bench_decode
    from benchmarks.bench_demo import bench_demo
    from benchmarks.bench_fences import (
        bench_fenced_free,
        bench_reclaim_sweep,
        bench_record_use,
        bench_wait_fence,
        bench_wake_latency,
        bench_wake_slow_fences,
    )
    from benchmarks.bench_groups import bench_groups
    from benchmarks.bench_metrics import bench_metrics_scrape
    from benchmarks.bench_pages import bench_pages
    from benchmarks.bench_scaling import bench_scaling

    rows: list[Row] = []
    memory: list[dict[str, float]] = []
    unavailable: dict[str, str] = {}
    extra: dict[str, Any] = {}

    async def fenced_all(cfg: Config) -> list[Row]:
        return [*await bench_fenced_free(cfg), *await bench_record_use(cfg)]

    async def wake_all(cfg: Config) -> list[Row]:
        return [
            *await bench_wake_latency(cfg),
            *await bench_wake_slow_fences(cfg),
            *await bench_wait_fence(cfg),
        ]

    simple: dict[str, Callable[[Config], Coroutine[Any, Any, list[Row]]]] = {
        "uncontended": bench_uncontended,
        "batched": bench_batched,
        "contended": bench_contended,
        "admit": bench_admit,
        "groups": bench_groups,
        "fenced": fenced_all,
        "reclaim": bench_reclaim_sweep,
        "wake": wake_all,
        "metrics": bench_metrics_scrape,
    }
    load_before = loadavg()
    t_start = time.perf_counter()
    for name in BENCHMARKS:
        if name not in only:
            continue
        if name == "agree":
            _log("[agree] spawning 2 gloo ranks ...")
            t0 = time.perf_counter()
            from benchmarks.bench_agree import bench_agree

            agree_rows, info = bench_agree(cfg)
            rows += agree_rows
            extra["agree"] = info
            _log(f"[agree] done in {time.perf_counter() - t0:.1f}s")
            continue
        if name == "demo":
            _log("[demo] running scheduler_demo ...")
            t0 = time.perf_counter()
            demo_rows, info = bench_demo(cfg, loops)
            rows += demo_rows
            extra["demo"] = info
            if info.get("unavailable"):
                unavailable["demo"] = str(info["unavailable"])
            _log(f"[demo] done in {time.perf_counter() - t0:.1f}s")
            continue
        if name in ("pages", "decode"):
            # Synchronous: the event loop plays no part, so it runs once (on the
            # first loop) and its rows say "sync" in the loop column.
            _log(f"[{name}] (synchronous, runs once) ...")
            t0 = time.perf_counter()
            sync_bench = bench_pages if name == "pages" else bench_decode
            prows, skipped = run_on(loops[0], functools.partial(sync_bench, cfg))
            rows += prows
            unavailable.update(skipped)
            _log(f"[{name}] done in {time.perf_counter() - t0:.1f}s")
            continue
        for lp in loops:
            _log(f"[{name}] on {lp} ...")
            t0 = time.perf_counter()
            if name == "scaling":
                want_mem = lp == loops[0]
                srows, mem = run_on(lp, functools.partial(bench_scaling, cfg, memory=want_mem))
                rows += srows
                memory += mem
            else:
                fn = simple[name]
                rows += run_on(lp, functools.partial(fn, cfg))
            _log(f"[{name}] on {lp} done in {time.perf_counter() - t0:.1f}s")
    elapsed = time.perf_counter() - t_start
    machine = {**machine_info(), "loadavg_before": load_before}
    md = render_markdown(
        rows,
        command=command,
        cfg=cfg,
        machine=machine,
        memory=memory,
        unavailable=unavailable,
        elapsed_s=elapsed,
    )
    print(md)
    if not args.no_md:
        args.md.parent.mkdir(parents=True, exist_ok=True)
        args.md.write_text(md, encoding="utf-8")
        _log(f"markdown written to {args.md}")
    if args.json:
        import json

        args.json.parent.mkdir(parents=True, exist_ok=True)
        data = to_json(
            rows,
            command=command,
            cfg=cfg,
            machine=machine,
            memory=memory,
            unavailable=unavailable,
            extra=extra,
            elapsed_s=elapsed,
            benchmarks=[b for b in BENCHMARKS if b in only],
            argv=given,
        )
        args.json.write_text(json.dumps(data, indent=1, default=str), encoding="utf-8")
        _log(f"JSON written to {args.json}")
    return 0


def _relative(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def _saved_benchmarks(data: dict[str, Any]) -> set[str]:
    """The benchmarks a saved run measured: its ``benchmarks`` list, or for a
    file written before that key, the ``--only`` of its command (none that
    parses: treated as a subset)."""
    if "benchmarks" in data:
        return set(data["benchmarks"])
    try:
        saved = _parse(shlex.split(str(data.get("command", "")))[3:])
    except SystemExit:
        return set()
    return set(_names(saved.only))


def _render_saved(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    import json

    from benchmarks.harness import Config

    try:
        data = json.loads(args.from_json.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or not {"rows", "command", "config"} <= data.keys():
            raise ValueError("not the JSON of a benchmark run (python -m benchmarks --json)")
    except (OSError, ValueError) as exc:  # UnicodeDecodeError, JSONDecodeError too
        parser.error(f"--from-json {args.from_json}: {exc}")
    if args.md is None and not args.no_md:
        # As for a run: only a run of every benchmark goes to the default
        # path, so re-rendering a subset's JSON never overwrites the full report.
        if _saved_benchmarks(data) >= set(BENCHMARKS):
            args.md = DEFAULT_MD
        else:
            _log("a saved run of a subset: the markdown is not written (--md PATH writes it)")
            args.no_md = True
    _check_output(parser, "--md", None if args.no_md else args.md)
    md = render_markdown(
        [Row.from_json(r) for r in data["rows"]],
        command=data["command"],
        cfg=Config(
            **{
                k: tuple(v) if isinstance(v, list) else v  # type: ignore[arg-type]
                for k, v in data["config"].items()
            }
        ),
        machine=data["machine"],
        memory=data["memory"],
        unavailable=data["unavailable"],
        elapsed_s=data["elapsed_s"],
        source=_relative(args.from_json),
    )
    print(md)
    if not args.no_md:
        args.md.parent.mkdir(parents=True, exist_ok=True)
        args.md.write_text(md, encoding="utf-8")
        _log(f"markdown written to {args.md}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
