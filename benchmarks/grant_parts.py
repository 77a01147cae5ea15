"""What each part of a contended grant costs, side by side, without the loop.

``python -m benchmarks.grant_parts`` splits a contended grant (a task
queued in ``alloc(1)`` that a ``free`` of one row serves) into its two
halves and times each without the event loop's scheduling in between, so
parts of 50-200 ns can be told apart:

* **the free side**: ``free([row])`` with waiters queued, which runs the
  grant loop, takes the row for the head waiter and resolves its future;
* **the wait side**: the ``alloc(1)`` coroutine driven by hand from its
  call to its suspension on the future, and from the resolved future to
  its return (``send``, ``set_result``, ``send``).

Each side is built up from the least a pool with the same fairness rule
does (the hand-over floor of ``benchmarks.ablation``) by adding the
shipped pool's parts one at a time, and ends with the shipped call itself;
``asyncio.Semaphore`` (release with a waiter; acquire driven by hand) is
the reference. Every variant is a measurement aid that works on the
shipped pool's own containers (its free queue, row states and waiter
queues): a copy of ``asyncpool/pool.py``'s and ``asyncpool/waiters.py``'s
hot paths, pared down (the wait side's check-free ``alloc`` is the
ablation's ``UncheckedAlloc``, not a second copy). Keep them in step.
The free side leaves out the batched reset of the granted rows (one
tensor op a loop tick, queued on the loop and not run here; the ablation's
"without row resets" line measures it), so its shipped figure is a lower
bound on a grant's cost. The parts are sampled interleaved (every part once
a round, the order rotated each round, the collector off during a sample,
as in :func:`benchmarks.harness.interleave`); the best sample of each counts.
The parts are timed alone, with warm caches; inside the contended
workload (``python -m benchmarks --only contended``) they cost less and
the loop's own work more, so read the increments, not the sum. Nothing
here is a target.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import collections
import functools
import gc
import math
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from .ablation import unchecked_alloc_pool
from .harness import add_loop_option, loop_factories, run_on

__all__ = ["ALLOC_PARTS", "FREE_PARTS", "main", "measure", "render"]

FREE_PARTS = (
    "hand-over floor",
    "+ free's checks and row state",
    "+ the take's bookkeeping (tag, peak, reset list)",
    "+ the wait record (clock, window, histogram)",
    "shipped free (the generic grant loop calling take)",
    "asyncio.Semaphore.release, one waiter",
)
ALLOC_PARTS = (
    "hand-over floor",
    "+ the waiter record (clock, tuple, count)",
    "+ alloc's take-or-enqueue core (running loop, WaiterQueues.enqueue)",
    "shipped alloc (thread, argument, closed, quarantine, loop checks)",
    "asyncio.Semaphore.acquire, waiting",
)

_get_ident = threading.get_ident
_perf_counter = time.perf_counter
_bisect_left = bisect.bisect_left


def _free_variants(pool: Any, loop: asyncio.AbstractEventLoop) -> dict[str, Callable[[Any], Any]]:
    """The free side's variants, as ``free(rows)`` callables on ``pool``."""
    waiters, led = pool._waiters, pool._ledger
    free_q, state, gen = pool._free_q, pool._state, pool._gen
    queues, prios = waiters._queues, waiters._prios

    def pop_head() -> tuple[Any, ...]:
        queue = queues[prios[0]]
        head = queue.popleft()
        waiters.count -= 1
        return head  # type: ignore[no-any-return]

    def floor(rows: list[int]) -> None:
        free_q.extend(rows)
        while waiters.count and free_q:
            fut = pop_head()[1]
            if not fut.done():
                fut.set_result([free_q.popleft()])

    def checked(bookkeeping: bool, record: bool) -> Callable[[list[int]], None]:
        # free's one-row path (pool.py), then the grant loop inlined; the
        # flags are read from the closure (a few ns), not passed per call.
        def free(rows: list[int]) -> None:
            if rows.__class__ is list and len(rows) == 1:
                row = rows[0]
                if row.__class__ is int and 0 < row < pool._rows_end and state[row] == 1:
                    if pool._owner != _get_ident():
                        raise RuntimeError("measure on the pool's thread")
                    state[row] = 0
                    free_q.append(row)
                    now = 0.0
                    while waiters.count and free_q:
                        _, fut, t0, _, window, histogram = pop_head()
                        if fut.done():
                            continue
                        got = free_q.popleft()
                        state[got] = 1
                        if bookkeeping:  # _take_for_waiter's n == 1 branch
                            led._popped += 1
                            tag = led._granted + 1
                            led._granted = tag
                            gen[got] = tag
                            if len(free_q) < led._peak_bound:
                                led._note_peak()
                            if led._clean:
                                led._clean -= 1
                            else:
                                if not pool._unreset:
                                    loop.call_soon(pool._flush_resets)
                                pool._unreset.append(got)
                        fut.set_result([got])
                        if record:  # WaiterQueues.grant's wait record
                            if not now:
                                now = _perf_counter()
                            waited = now - t0
                            window.append(waited)
                            histogram._counts[_bisect_left(histogram.bounds, waited)] += 1
                            histogram._sum += waited

        return free

    return {
        FREE_PARTS[0]: floor,
        FREE_PARTS[1]: checked(bookkeeping=False, record=False),
        FREE_PARTS[2]: checked(bookkeeping=True, record=False),
        FREE_PARTS[3]: checked(bookkeeping=True, record=True),
        FREE_PARTS[4]: pool.free,
    }


def _alloc_variants(
    pool: Any, loop: asyncio.AbstractEventLoop
) -> dict[str, Callable[[int], Coroutine[Any, Any, Any]]]:
    """The wait side's variants, as ``alloc(n)`` coroutine functions on ``pool``."""
    waiters = pool._waiters
    queue = waiters._queues[0]

    async def floor(n: int) -> Any:
        fut = loop.create_future()
        queue.append((n, fut))
        return await fut

    async def record(n: int) -> Any:
        fut = loop.create_future()
        queue.append(
            (n, fut, _perf_counter(), 0, pool._wait_times, pool._waiters.figures(0).histograms[0])
        )
        waiters.count += 1
        try:
            return await fut
        except asyncio.CancelledError:
            waiters.cancelled(queue[-1])
            raise

    # ALLOC_PARTS[2] and [3] are the pool's own alloc: _alloc_side builds
    # the ablation's check-free pool for [2] (alloc's core, as shipped).
    return {
        ALLOC_PARTS[0]: floor,
        ALLOC_PARTS[1]: record,
        ALLOC_PARTS[2]: pool.alloc,
        ALLOC_PARTS[3]: pool.alloc,
    }


async def _free_side(name: str, n: int, repeats: int) -> float:
    """Best ns per ``free`` that serves one queued waiter."""
    from asyncpool import AsyncReqToTokenPool

    loop = asyncio.get_running_loop()
    if name == FREE_PARTS[-1]:
        # One Semaphore a release, each with one waiter: the resumed
        # acquire removes its waiter (``self._waiters.remove(fut)``), and the
        # wait side's hand-driven acquire times that; a popleft here would
        # count it twice (and without one, done futures would pile up ahead
        # of the next release's waiter).
        best = float("inf")
        for _ in range(repeats):
            sems = []
            for _ in range(n):
                sem = asyncio.Semaphore(0)
                sem._waiters = collections.deque((loop.create_future(),))
                sems.append(sem)
            t0 = time.perf_counter_ns()
            for sem in sems:
                sem.release()
            best = min(best, (time.perf_counter_ns() - t0) / n)
        return best
    pool = AsyncReqToTokenPool(65, 8, device="cpu")
    held: list[list[int]] = []
    for _ in range(64):
        got = pool.try_alloc(1)
        assert got is not None
        held.append(got)
    assert pool._loop is loop  # bound by try_alloc inside the loop
    free = _free_variants(pool, loop)[name]
    enqueue = pool._waiters.enqueue
    rows = held[0]
    best = float("inf")
    for _ in range(repeats):
        futs = [
            enqueue(1, 0, None, loop, pool._wait_times, pool._waiters.figures(0).histograms[0])[0][
                1
            ]
            for _ in range(n)
        ]
        t0 = time.perf_counter_ns()
        for fut in futs:
            free(rows)
            rows = fut.result()
        best = min(best, (time.perf_counter_ns() - t0) / n)
        pool._unreset.clear()  # their flush is queued on the loop; not measured
    pool.free(rows)
    for other in held[1:]:
        pool.free(other)
    await pool.close()
    return best


async def _alloc_side(name: str, n: int, repeats: int) -> float:
    """Best ns per ``alloc(1)`` from the call through suspension to return."""
    from asyncpool import AsyncReqToTokenPool

    loop = asyncio.get_running_loop()
    granted = [1]
    if name == ALLOC_PARTS[-1]:
        sem = asyncio.Semaphore(0)
        acquire: Callable[..., Coroutine[Any, Any, Any]] = sem.acquire
        pool = None
    else:
        if name == ALLOC_PARTS[2]:
            pool = unchecked_alloc_pool(65, 8)  # alloc without its checks
        else:
            pool = AsyncReqToTokenPool(65, 8, device="cpu")
        for _ in range(64):
            pool.try_alloc(1)
        assert pool._loop is loop  # bound by try_alloc inside the loop
        waiters = pool._waiters
        # One waiter that is never served keeps the queue (and count) alive.
        waiters.enqueue(1, 0, None, loop, pool._wait_times, pool._waiters.figures(0).histograms[0])
        acquire = _alloc_variants(pool, loop)[name]
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            coro = acquire(1) if pool is not None else acquire()
            fut = coro.send(None)
            fut.set_result(granted if pool is not None else True)
            try:
                coro.send(None)
            except StopIteration:
                pass
        best = min(best, (time.perf_counter_ns() - t0) / n)
        if pool is not None:
            queue = waiters._queues[0]
            while len(queue) > 1:
                queue.pop()
            waiters.count = 1
    if pool is not None:
        waiters.drop_all()  # the never-served waiter's future is never awaited
        await pool.close()
    return best


async def _sample(
    side: Callable[[str, int, int], Coroutine[Any, Any, float]], name: str, n: int
) -> float:
    """One sample of one part (ns a call), the collector off while it runs
    and collected before it, as the harness's :func:`~benchmarks.harness.interleave`
    does: no part pays for another's garbage."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return await side(name, n, 1)
    finally:
        if was_enabled:
            gc.enable()


async def measure(n: int = 20_000, repeats: int = 7) -> dict[str, dict[str, float]]:
    """Best ns per call of every variant: ``{"free": {...}, "alloc": {...}}``.

    Interleaved, as the benchmarks are: each of the ``repeats`` rounds takes
    one sample of every part of a side, the order rotated each round, so a
    drift of the host (another process, a slow phase) lands on every part
    alike instead of on the parts measured last. The best sample counts.
    """
    out: dict[str, dict[str, float]] = {
        "free": dict.fromkeys(FREE_PARTS, math.inf),
        "alloc": dict.fromkeys(ALLOC_PARTS, math.inf),
    }
    sides: tuple[
        tuple[str, tuple[str, ...], Callable[[str, int, int], Coroutine[Any, Any, float]]], ...
    ] = (("free", FREE_PARTS, _free_side), ("alloc", ALLOC_PARTS, _alloc_side))
    for r in range(repeats):
        for key, parts, side in sides:
            k = r % len(parts)
            for name in parts[k:] + parts[:k]:
                best = await _sample(side, name, n)
                out[key][name] = min(out[key][name], best)
                await asyncio.sleep(0)  # let queued resets and wake-ups run
    return out


def render(results: dict[str, dict[str, dict[str, float]]]) -> str:
    """A markdown table per side: ns per call per loop, and each step's increment."""
    loops = list(results)
    lines: list[str] = []
    for side, parts in (("free side", FREE_PARTS), ("wait side", ALLOC_PARTS)):
        key = "free" if side == "free side" else "alloc"
        lines += [
            f"| {side} | " + " | ".join(f"{lp}: ns | {lp}: step" for lp in loops) + " |",
            "| --- | " + " | ".join("--- | ---" for _ in loops) + " |",
        ]
        for i, name in enumerate(parts):
            cells = []
            for lp in loops:
                side_ns = results[lp][key]
                step = (
                    ""
                    if i in (0, len(parts) - 1)
                    else f"+{side_ns[name] - side_ns[parts[i - 1]]:.0f}"
                )
                cells.append(f"{side_ns[name]:.0f} | {step}")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    for lp in loops:
        free, alloc = results[lp]["free"], results[lp]["alloc"]
        ours = free[FREE_PARTS[-2]] + alloc[ALLOC_PARTS[-2]]
        floor = free[FREE_PARTS[0]] + alloc[ALLOC_PARTS[0]]
        sem = free[FREE_PARTS[-1]] + alloc[ALLOC_PARTS[-1]]
        lines.append(
            f"{lp}: a grant, both sides: shipped {ours:.0f} ns, hand-over floor {floor:.0f} ns, "
            f"asyncio.Semaphore {sem:.0f} ns (shipped - Semaphore = {ours - sem:.0f} ns)"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.grant_parts",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_loop_option(p)
    p.add_argument("--calls", type=int, default=20_000, help="calls per sample (default 20000)")
    p.add_argument("--repeats", type=int, default=7, help="samples; the best counts (default 7)")
    args = p.parse_args(argv)
    kinds = args.loop or list(loop_factories())
    results = {
        kind: run_on(kind, functools.partial(measure, args.calls, args.repeats)) for kind in kinds
    }
    print(render(results))
    print(
        f"Each figure: the best of {args.repeats} interleaved samples of {args.calls} calls, "
        "in ns a call; the free side leaves out the rows' batched reset."
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
