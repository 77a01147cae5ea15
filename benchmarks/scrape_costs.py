"""What a metrics scrape costs with many priorities or many pending batches.

``python -m benchmarks.scrape_costs`` measures the scrape figures
docs/api.md (*Metrics*) quotes that ``python -m benchmarks --only metrics``
(one pool, one priority, nothing pending) does not:

* **priorities**: a pool whose calls queued at ``--priorities`` priorities
  (16 by default, the most ``stats().by_priority`` keeps apart), each with
  granted waits, a timeout and one call still queued: the samples one
  scrape of that pool exports, and the median time of its
  ``PoolCollector.collect()`` and of ``generate_latest`` of a registry
  holding that one collector;
* **pending batches**: ``pool.stats(summaries=False)``, what a scrape
  reads, of a pool with ``fence_timeout=`` set and ``--pending`` batches
  pending (one ``free(row, after=stream)`` each, behind a ``HostStream``
  held busy, so none is done and none is overdue): the overdue figures
  need the scan that ``fence_timeout=`` adds;
* **a router's reads** (docs/api.md, *A router over data-parallel
  replicas*): from a thread other than the pool's (a replica serving on a
  loop of its own, rows and pages allocated, some pending behind a step,
  admissions queued), the five counts its recipe reads per replica and
  decision (``available_size()`` and ``pending_size()`` of the pool and of
  its ``kv``, and ``waiting()``) together, against one
  ``stats(summaries=False)``.

A measurement aid, not part of ``python -m benchmarks`` and not a target:
the median of ``--repeats`` timed calls (wall clock, the collector on), on
each loop named. It writes no file.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import statistics
import threading
import time
from collections.abc import Sequence
from typing import Any

from .harness import add_loop_option, loop_factories, run_on

__all__ = ["main", "measure", "render"]


def _median_ms(samples: list[int]) -> float:
    return statistics.median(samples) / 1e6


async def _priorities(priorities: int, waits: int, repeats: int) -> dict[str, float]:
    """One pool with calls queued at ``priorities`` priorities: its scrape."""
    from prometheus_client import CollectorRegistry, generate_latest

    from asyncpool import AsyncReqToTokenPool, PoolClosedError
    from asyncpool.metrics import PoolCollector

    pool = AsyncReqToTokenPool(3, 8, device="cpu")  # two rows, both held
    queued: list[asyncio.Future[list[int]]] = []
    try:
        held = await pool.alloc(2)
        for priority in range(priorities):
            for _ in range(waits):  # each queues, then the free grants it
                waiter = asyncio.ensure_future(pool.alloc(1, priority=priority))
                await asyncio.sleep(0)
                pool.free([held.pop()])
                held += await waiter
            with contextlib.suppress(TimeoutError):
                await pool.alloc(1, priority=priority, timeout=1e-4)
        # Then one call left queued at each (queued earlier, it would have
        # taken the rows the waits above are granted).
        queued += [asyncio.ensure_future(pool.alloc(1, priority=p)) for p in range(priorities)]
        await asyncio.sleep(0)
        assert pool.waiting() == priorities, pool.waiting()
        collector = PoolCollector(pool, name="bench")
        registry = CollectorRegistry()
        registry.register(collector)
        samples = sum(len(family.samples) for family in collector.collect())
        collect_ns: list[int] = []
        scrape_ns: list[int] = []
        for _ in range(repeats):
            t0 = time.perf_counter_ns()
            for _family in collector.collect():
                pass
            t1 = time.perf_counter_ns()
            generate_latest(registry)
            t2 = time.perf_counter_ns()
            collect_ns.append(t1 - t0)
            scrape_ns.append(t2 - t1)
    finally:
        await pool.close()
        for task in queued:
            with contextlib.suppress(PoolClosedError, asyncio.CancelledError):
                await task
    return {
        "samples": float(samples),
        "collect_ms": _median_ms(collect_ns),
        "generate_latest_ms": _median_ms(scrape_ns),
    }


async def _pending(n: int, repeats: int) -> float:
    """Median ms of ``stats(summaries=False)`` with ``n`` batches pending."""
    from asyncpool import AsyncReqToTokenPool, HostStream

    pool = AsyncReqToTokenPool(n + 1, 8, device="cpu", fence_timeout=3600.0)
    try:
        with HostStream(name="scrape-costs") as stream:
            gate = threading.Event()
            stream.launch(gate.wait)  # every fence recorded below stays open
            try:
                for row in await pool.alloc(n):
                    pool.free([row], after=stream)  # one pending batch each
                assert pool.pending_size() == n, pool.pending_size()
                stats = pool.stats
                times: list[int] = []
                for _ in range(repeats):
                    t0 = time.perf_counter_ns()
                    stats(summaries=False)
                    times.append(time.perf_counter_ns() - t0)
            finally:
                gate.set()
            async with asyncio.timeout(60):
                await pool.drain()
    finally:
        await pool.close()
    return _median_ms(times)


def _replica(ready: threading.Event, box: dict[str, Any]) -> None:
    """A replica's thread: a pool serving on a loop of its own (rows and
    pages allocated, some pending behind a step, two admissions queued)
    until ``box["stop"]()`` is called."""
    from asyncpool import AsyncReqToTokenPool, HostStream, KVPagePool, PoolClosedError

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        pool = AsyncReqToTokenPool(65, 4096, device="cpu", kv=KVPagePool(513, 16))
        stop: asyncio.Future[None] = loop.create_future()
        queued: list[asyncio.Future[Any]] = []
        with HostStream(name="replica") as stream:
            gate = threading.Event()
            stream.launch(gate.wait)  # the step in flight: what is freed waits
            try:
                grants = [await pool.admit(pages=16) for _ in range(30)]
                done = [g.row for g in grants[:4]]
                pool.record_use(done, stream.record())
                pool.free(done)  # pending behind the step
                queued += [asyncio.ensure_future(pool.admit(pages=500)) for _ in range(2)]
                await asyncio.sleep(0)
                assert pool.waiting() == 2 and pool.pending_size() == 4
                box["pool"] = pool
                box["stop"] = functools.partial(loop.call_soon_threadsafe, stop.set_result, None)
                ready.set()
                await stop
            finally:
                gate.set()
                await pool.close()
                for task in queued:
                    with contextlib.suppress(PoolClosedError, asyncio.CancelledError):
                        await task

    asyncio.run(serve())


def _router(repeats: int) -> dict[str, float]:
    """Median us, read from this thread, of the five counts a router reads
    per replica and decision together, and of ``stats(summaries=False)``."""
    ready = threading.Event()
    box: dict[str, Any] = {}
    thread = threading.Thread(target=_replica, args=(ready, box), name="replica")
    thread.start()
    try:
        if not ready.wait(60):
            raise RuntimeError("the replica's pool was not ready in 60 s")
        pool = box["pool"]
        kv = pool.kv
        counts_ns: list[int] = []
        stats_ns: list[int] = []
        for _ in range(repeats):
            t0 = time.perf_counter_ns()
            pool.available_size() + pool.pending_size()
            kv.available_size() + kv.pending_size()
            pool.waiting()
            t1 = time.perf_counter_ns()
            pool.stats(summaries=False)
            t2 = time.perf_counter_ns()
            counts_ns.append(t1 - t0)
            stats_ns.append(t2 - t1)
    finally:
        if "stop" in box:
            box["stop"]()
        thread.join(60)
    return {
        "router: five counts, us": statistics.median(counts_ns) / 1e3,
        "router: stats(summaries=False), us": statistics.median(stats_ns) / 1e3,
    }


async def measure(
    priorities: int = 16, waits: int = 20, pending: Sequence[int] = (2048, 32768), repeats: int = 51
) -> dict[str, float]:
    """Every figure, on the running loop: ``{name: value}`` (ms, us, or a count)."""
    out = {
        f"{priorities} priorities: {key}": value
        for key, value in (await _priorities(priorities, waits, repeats)).items()
    }
    for n in pending:
        out[f"stats(), {n} pending batches: ms"] = await _pending(n, repeats)
    out.update(_router(repeats))  # this loop waits while it reads, as a router's decision does
    return out


def render(results: dict[str, dict[str, float]]) -> str:
    """A markdown table: one line a figure, one column a loop."""
    loops = list(results)
    lines = [
        "| figure | " + " | ".join(loops) + " |",
        "| --- | " + " | ".join("---" for _ in loops) + " |",
    ]
    for name in results[loops[0]]:
        cells = [
            f"{results[lp][name]:.0f}" if name.endswith("samples") else f"{results[lp][name]:.3f}"
            for lp in loops
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated integers") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: each count at least 1")
    return counts


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.scrape_costs",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_loop_option(p)
    p.add_argument("--priorities", type=int, default=16, help="priorities queued (default 16)")
    p.add_argument(
        "--pending",
        type=_counts,
        default=[2048, 32768],
        help="pending batches, comma-separated (default 2048,32768)",
    )
    p.add_argument("--repeats", type=int, default=51, help="timed calls; the median counts")
    args = p.parse_args(argv)
    if args.priorities < 1 or args.repeats < 1:
        p.error("--priorities and --repeats must be at least 1")
    kinds = args.loop or list(loop_factories())
    results = {
        kind: run_on(
            kind,
            functools.partial(measure, args.priorities, pending=args.pending, repeats=args.repeats),
        )
        for kind in kinds
    }
    print(render(results))
    print(
        f"Each time: the median of {args.repeats} calls, in ms (wall clock; us where "
        "named); 'samples': the samples one scrape of that pool exports."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
