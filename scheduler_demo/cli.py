"""``python -m scheduler_demo``: the command line."""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import time
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

from .config import DemoConfig
from .report import Report
from .runner import run_demo

__all__ = ["build_parser", "check_args", "main"]

T = TypeVar("T")

_D = DemoConfig()

DESCRIPTION = """\
An overlap scheduler of a disaggregated decode engine on uvloop, built on
asyncpool, that shows the memory reuse hazards of overlap scheduling and of
KV transfers, and their fix.

A request holds a row of req_to_token and the KV pages the row lists. Its
prompt's KV arrives by a transfer on a second stream (--transfer-ms); it
joins the batch once the transfer has landed. The forward step runs on a
stream (a HostStream worker thread doing real torch compute on CPU, a CUDA
stream with --device cuda) and writes the batch's rows, and each new token's
KV through its row, there. The scheduler launches step t and only then
processes step t-1's results, so it frees rows and pages (finished, retracted
and aborted requests) that step t is still writing; clients abort some
requests while their KV is still on its way (--abort-rate). Fenced (the
default), the pool keeps those rows and pages out of circulation until step t
and the transfer have landed; with --unsafe they are freed at once, as the
seed pool and SGLang before #35049 do, and the late writes land in the new
owners' rows and pages. Every run verifies every token of every live request,
its row entry and its KV, against the host's truth at every step;
corruptions are counted, logged at debug level (--log-level debug) and
reported.

Exit status: 0 when a fenced run completed or aborted every request with 0
corruptions of rows and of KV, 1 otherwise (an --unsafe run always exits 1),
2 on bad arguments.
"""

EPILOG = """\
examples:
  python -m scheduler_demo                          # the default: fenced overlap
  python -m scheduler_demo --unsafe                 # same workload, no fences
  python -m scheduler_demo --admission row-first    # a row first, pages later
  python -m scheduler_demo --mode sync              # no overlap, for comparison
  python -m scheduler_demo --swa-window 64          # a hybrid model: full + swa groups
  python -m scheduler_demo --json out.json --plot out.png
  python -m scheduler_demo.compare --rounds 3      # overlap, sync, unsafe, row-first
"""

MAX_TP = 64  # ranks, each a process with its own pools


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m scheduler_demo",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    w = p.add_argument_group("workload (seeded)")
    w.add_argument(
        "-n",
        "--num-requests",
        type=int,
        default=_D.num_requests,
        help="number of requests (default %(default)s)",
    )
    w.add_argument(
        "--rate",
        type=float,
        default=_D.rate,
        help="Poisson arrival rate in requests/s; 0 = all arrive at once "
        "(default %(default)s: faster than the engine serves, so admission "
        "waits under backpressure)",
    )
    w.add_argument(
        "--prompt-len",
        default=_D.prompt_len,
        metavar="DIST",
        help="prompt length distribution: const:N, uniform:LO:HI, exp:MEAN or "
        "lognormal:MEDIAN:SIGMA, finite numbers; draws are capped at 10^9 and "
        "then at --max-context-len (default %(default)s)",
    )
    w.add_argument(
        "--output-len",
        default=_D.output_len,
        metavar="DIST",
        help="output length distribution, same forms (default %(default)s)",
    )
    w.add_argument(
        "--abort-rate",
        type=float,
        default=_D.abort_rate,
        help="fraction of requests their client aborts: half while their KV "
        "is being transferred, half while decoding (default %(default)s)",
    )
    w.add_argument("--seed", type=int, default=_D.seed, help="workload seed (default %(default)s)")

    e = p.add_argument_group("engine")
    e.add_argument(
        "--mode",
        choices=["overlap", "sync"],
        default=_D.mode,
        help="overlap: launch step t, then process step t-1 (default); sync: launch, wait, process",
    )
    e.add_argument(
        "--unsafe",
        action="store_true",
        help="free rows and KV pages immediately, as the seed pool does: no "
        "fences, no recorded uses, and an aborted request's pages are freed "
        "without waiting for its KV transfer to land (shows the corruption); "
        "with --device cuda the pool's row resets also run on the current "
        "stream, not the forward stream, as the seed's do",
    )
    e.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default=_D.device,
        help="cpu: the forward runs on an asyncpool.HostStream; cuda: on a "
        "torch.cuda.Stream (default %(default)s)",
    )
    e.add_argument(
        "--rows",
        type=int,
        default=_D.rows,
        help="request rows in the pool (its capacity; row 0 is padding on "
        "top) (default %(default)s)",
    )
    e.add_argument(
        "--max-context-len",
        type=int,
        default=_D.max_context_len,
        help="columns of req_to_token; caps prompt+output (default %(default)s)",
    )
    e.add_argument(
        "--kv-pages",
        type=int,
        default=_D.kv_pages,
        help="KV cache pages (page 0, padding, on top); when a running "
        "request needs a page and none is free, requests are retracted "
        "(default %(default)s)",
    )
    e.add_argument(
        "--page-size",
        type=int,
        default=_D.page_size,
        help="token slots per KV page (default %(default)s)",
    )
    e.add_argument(
        "--swa-window",
        type=int,
        default=_D.swa_window,
        metavar="W",
        help="a hybrid model: sliding-window layers attending to the last W tokens, "
        'their KV in a second KV group ("swa") beside the full-attention "full" '
        "(--kv-pages); each step writes every new token's KV in both and reads "
        "the window back from swa, and the swa pages that slid out of every "
        "window go back with drop_pages behind the step's fence (--unsafe: at "
        "once); swa corruptions are reported apart; under --max-context-len - 2 "
        "(default %(default)s: off)",
    )
    e.add_argument(
        "--swa-pages",
        type=int,
        default=_D.swa_pages,
        metavar="N",
        help="with --swa-window: the swa group's pages (page 0, padding, on top); "
        "0 sizes it for windows: rows x (ceil(W / page-size) + 2), a window's pages "
        "and one behind the fence per row, not whole contexts; at least "
        "ceil(W / page-size) + 2 (default %(default)s)",
    )
    e.add_argument(
        "--admission",
        choices=["atomic", "row-first"],
        default=_D.admission,
        help="atomic: a row and the prompt's pages together (pool.admit); "
        "row-first: a row at arrival, pages when the budget allows, as "
        "engines do today (default %(default)s)",
    )
    e.add_argument(
        "--transfer-ms",
        type=float,
        default=_D.transfer_ms,
        help="mean time for a prompt's KV to arrive by transfer: a quarter fixed "
        "latency, the rest in proportion to its length; several forward steps; "
        "at most 60000 (default %(default)s)",
    )
    e.add_argument(
        "--admit-watermark",
        type=float,
        default=_D.admit_watermark,
        help="admit new requests only while the pages held stay under this "
        "fraction of the cache (default %(default)s)",
    )
    e.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=_D.max_prefill_tokens,
        help="prefill tokens (retracted requests recomputing their KV) in "
        "one step (default %(default)s)",
    )

    e.add_argument(
        "--tp",
        type=int,
        default=0,
        metavar="N",
        help="run N tensor-parallel scheduler replicas, one process each (gloo; NCCL with "
        '--device cuda, one GPU per rank), with reclaim="explicit" pools; every step '
        "checks that all ranks built the same batch; needs --admission atomic, refuses "
        "--gate (exit 2) and draws no --plot (default: 0, the plain demo; 1 runs "
        "the replica machinery on one rank)",
    )
    e.add_argument(
        "--tp-reclaim",
        choices=("explicit", "auto"),
        default=None,
        help="with --tp: the pools' reclaim mode; auto is the control run, whose replicas "
        "decide by local fence timing and diverge (default: explicit)",
    )
    t = p.add_argument_group("timing")
    t.add_argument(
        "--forward-ms",
        type=float,
        default=_D.forward_ms,
        help="forward step latency: fixed part, ms; at most 60000 (default %(default)s)",
    )
    t.add_argument(
        "--forward-us-per-token",
        type=float,
        default=_D.forward_us_per_token,
        help="forward step latency per batch token, us; the step's matmul is "
        "sized to forward-ms + this * tokens; at most 10000 (default %(default)s)",
    )
    t.add_argument(
        "--sched-ms",
        type=float,
        default=_D.sched_ms,
        help="busy CPU work the scheduler does per step on top of its real "
        "bookkeeping, ms; about the forward's time shows overlap's "
        "pipelining; at most 60000: it busy-waits on the event loop, where not "
        "even --timeout can interrupt it (default %(default)s)",
    )
    t.add_argument(
        "--gate",
        action="store_true",
        help="the worst legal lag, deterministic (CPU only): hold each step's "
        "table writes until the scheduler finished its next iteration, and "
        "an aborted request's transfer until a new owner of its pages has "
        "written and verified a slot it writes (with --mode sync only the "
        "transfer half applies: no step is in flight to hold); with --swa-window, "
        "a transfer that writes a slot a held step reads in its window lands first",
    )
    t.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="S",
        help="give up after S seconds; a forward step already running is let "
        "finish first (at most one matmul chunk of it) (default: none)",
    )

    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="PATH", help="write the report as JSON to PATH")
    o.add_argument(
        "--plot",
        metavar="PATH.png",
        help="write a PNG (PATH must end in .png; refused with --tp): rows and "
        "KV pages allocated/pending/free over time "
        "with the aborts marked, what is held behind fences, and the admission "
        "wait-time distribution",
    )
    o.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress bar (it is also off when stderr is not a tty)",
    )
    o.add_argument(
        "--log-level",
        default="warning",
        choices=["debug", "info", "warning", "error"],
        help="logging level; debug logs every corruption found (default %(default)s)",
    )
    return p


def config_from_args(args: argparse.Namespace) -> DemoConfig:
    return DemoConfig(
        num_requests=args.num_requests,
        rate=args.rate,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        abort_rate=args.abort_rate,
        seed=args.seed,
        rows=args.rows,
        max_context_len=args.max_context_len,
        kv_pages=args.kv_pages,
        page_size=args.page_size,
        admission=args.admission,
        transfer_ms=args.transfer_ms,
        swa_window=args.swa_window,
        swa_pages=args.swa_pages,
        admit_watermark=args.admit_watermark,
        max_prefill_tokens=args.max_prefill_tokens,
        mode=args.mode,
        unsafe=args.unsafe,
        device=args.device,
        forward_ms=args.forward_ms,
        forward_us_per_token=args.forward_us_per_token,
        sched_ms=args.sched_ms,
        gate=args.gate,
        progress=not args.no_progress,
        timeout_s=args.timeout,
    )


#: DemoConfig field -> the flag that sets it, for the messages of
#: :meth:`DemoConfig.validate` (which name the fields).
FLAGS = {
    "num_requests": "-n/--num-requests",
    "rate": "--rate",
    "prompt_len": "--prompt-len",
    "output_len": "--output-len",
    "abort_rate": "--abort-rate",
    "seed": "--seed",
    "rows": "--rows",
    "max_context_len": "--max-context-len",
    "kv_pages": "--kv-pages",
    "page_size": "--page-size",
    "admission": "--admission",
    "transfer_ms": "--transfer-ms",
    "swa_window": "--swa-window",
    "swa_pages": "--swa-pages",
    "admit_watermark": "--admit-watermark",
    "max_prefill_tokens": "--max-prefill-tokens",
    "mode": "--mode",
    "unsafe": "--unsafe",
    "device": "--device",
    "forward_ms": "--forward-ms",
    "forward_us_per_token": "--forward-us-per-token",
    "sched_ms": "--sched-ms",
    "gate": "--gate",
    "timeout_s": "--timeout",
}
_FIELD = re.compile(r"\b(" + "|".join(sorted(FLAGS, key=len, reverse=True)) + r")\b")


def flag_message(message: str) -> str:
    """``message`` with the config's field names written as their flags; quoted
    text (the user's own values) is left as it is."""
    parts = re.split(r"('[^']*')", message)
    return "".join(
        part if i % 2 else _FIELD.sub(lambda m: FLAGS[m.group(1)], part)
        for i, part in enumerate(parts)
    )


def check_output_path(parser: argparse.ArgumentParser, flag: str, path: str) -> None:
    """Refuse (exit 2) an output path that cannot be written, before the run
    rather than after it: its folder must exist, and it must not be a folder."""
    if not path:
        parser.error(f"{flag} '': an empty path (leave {flag} out to write nothing)")
    target = Path(path)
    if target.is_dir() or path.endswith(("/", os.sep)):
        parser.error(f"{flag} {path}: is a directory, not a file")
    parent = target.parent
    if not parent.is_dir():
        parser.error(f"{flag} {path}: the directory {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK) or (
        target.exists() and not os.access(target, os.W_OK)
    ):
        parser.error(f"{flag} {path}: not writable")


def _same_file(a: str, b: str) -> bool:
    """Whether two output paths name one file (``x.png``, ``./x.png``, a link)."""
    try:
        return Path(a).resolve() == Path(b).resolve() or os.path.samefile(a, b)
    except OSError:  # neither exists yet, and they resolve apart
        return False


TP_NEEDS = "--tp needs --admission atomic and no --gate"


def usage_error(parser: argparse.ArgumentParser, message: str) -> int:
    """What ``parser.error`` prints (the usage line, then the message), as a
    status to return rather than a SystemExit to raise."""
    parser.print_usage(sys.stderr)
    print(f"{parser.prog}: error: {message}", file=sys.stderr)
    return 2


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> DemoConfig:
    """Every check that needs no run: the config (named by flag), the
    combinations the demo refuses, the output paths. Exits 2 on the first
    failure, with the usage line."""
    cfg = config_from_args(args)
    try:
        cfg.validate()
    except ValueError as exc:
        parser.error(flag_message(str(exc)))
    if args.tp and not 1 <= args.tp <= MAX_TP:
        parser.error(f"--tp must be in 1..{MAX_TP} (one process per rank), got {args.tp}")
    if args.tp:
        if cfg.admission != "atomic" or cfg.gate:
            parser.error(TP_NEEDS)
        if cfg.swa_window:
            parser.error("--swa-window is not run with --tp (the replicas have one KV group)")
        if args.plot:
            parser.error("--plot is not drawn with --tp (use --json)")
    elif args.tp_reclaim is not None:
        parser.error("--tp-reclaim is for --tp N runs (the plain demo has one scheduler)")
    if args.json is not None:
        check_output_path(parser, "--json", args.json)
    if args.plot is not None:
        if Path(args.plot).suffix.lower() != ".png":
            parser.error(
                f"--plot {args.plot}: the plot is a PNG; name it PATH.png "
                f"(got {Path(args.plot).suffix or 'no extension'!r})"
            )
        check_output_path(parser, "--plot", args.plot)
        if args.json and _same_file(args.json, args.plot):
            # Written one after the other, the plot would replace the JSON.
            parser.error(f"--json {args.json} and --plot {args.plot}: the same file")
        try:  # before the run, not after it
            import matplotlib  # type: ignore[import-not-found,unused-ignore]  # noqa: F401
        except ImportError:
            parser.error(
                "--plot needs matplotlib, which is not installed: "
                "pip install 'asyncpool[demo]' (or drop --plot)"
            )
    if cfg.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA device is available here")
    return cfg


def timeout_message(cfg: DemoConfig, took_s: float) -> str:
    """What a run cut short by --timeout says, with the time it really took:
    the setup before the clock starts, and the steps and transfers in flight
    that close joins, come on top."""
    return (
        f"scheduler_demo: gave up after --timeout {cfg.timeout_s} s "
        f"({took_s:.1f} s in all, with the setup and the steps in flight let finish)"
    )


def _run(coro: Coroutine[Any, Any, T]) -> T:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - e.g. Windows
        import asyncio

        return asyncio.run(coro)
    result: T = uvloop.run(coro)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; return the exit status (see ``--help``)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if args.tp and (args.admission != "atomic" or args.gate):
        # Returned, not raised: main() has returned 2 here since --tp came.
        return usage_error(parser, TP_NEEDS)
    cfg = check_args(parser, args)
    if args.tp:
        return _main_tp(args, cfg)
    t0 = time.monotonic()
    try:
        report: Report = _run(run_demo(cfg))
    except TimeoutError:
        print(timeout_message(cfg, time.monotonic() - t0), file=sys.stderr)
        return 1
    print(report.table())
    if args.json:
        report.write_json(args.json)
    if args.plot:
        from .plot import save_plot

        save_plot(report, args.plot)
    return 0 if report.ok else 1


def _main_tp(args: argparse.Namespace, cfg: DemoConfig) -> int:
    """``--tp N``: rank 0 prints its report; then the agreement figures."""
    import json

    from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException

    from .tp import TPMismatchError, format_summary, run_tp

    try:
        res = run_tp(cfg, args.tp, args.tp_reclaim or "explicit")
    except TPMismatchError as exc:
        print(f"scheduler_demo: {exc}", file=sys.stderr)
        return 1
    except TimeoutError as exc:
        print(f"scheduler_demo: {exc}", file=sys.stderr)
        return 1
    except (ProcessRaisedException, ProcessExitedException) as exc:
        lines = str(exc).strip().splitlines()
        print(
            f"scheduler_demo: a tensor-parallel rank failed: {lines[-1] if lines else exc}",
            file=sys.stderr,
        )
        return 1
    print(format_summary(res))
    report = res["ranks"][0]["report"]
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(
                {**report, "tp": {k: v for k, v in res.items() if k != "ranks"}},
                f,
                indent=1,
                default=str,
            )
    # Every rank's corruptions count, not rank 0's only; --unsafe exits 1 as
    # without --tp.
    clean = all(
        r["report"].get("corruptions", 1) == 0 and r["report"].get("kv_corruptions", 1) == 0
        for r in res["ranks"]
    )
    ok = res["mismatches"] == 0 and clean and not cfg.unsafe
    return 0 if ok else 1
