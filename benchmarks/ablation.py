"""Where the contended grant's cost goes: the pool with parts switched off.

``python -m benchmarks.ablation`` runs the contended benchmark's workload
(1,000 tasks, each ``alloc(1)``, ``sleep(0)``, ``free`` five times, on 64
rows) for these subjects, interleaved round by round on each loop, and
prints each one's cost per grant as a ratio to ``asyncio.Semaphore(64)``
measured in the same rounds:

* ``asyncpool``: the pool as shipped;
* ``no resets``: the same pool with the row resets skipped (the one
  vectorised op per loop tick that zeroes the lengths of rows handed out
  dirty);
* ``no wait timing``: the same pool with the waiter queues' clock replaced by
  a constant (the wait window and histogram still fill, with zeros);
* ``no resets, no timing``: both;
* ``no alloc checks``: the same pool with ``alloc``'s preamble stripped to
  what queueing needs (no thread, argument, closed, quarantine or loop
  checks; the take-or-enqueue-and-await core is the shipped one's);
* ``hand-over floor``: :class:`HandOverPool`, grant at hand-over and nothing
  else (a deque of rows, a deque of futures), the least any pool with the
  same fairness rule pays.

The variants are measurement aids, never configurations: a pool without
resets hands out rows with stale lengths. Nothing here is a target.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import statistics
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from .harness import (
    PRESETS,
    Config,
    Sampler,
    add_loop_option,
    clock_of,
    gathered,
    interleave,
    loop_factories,
    pool_worker,
    run_on,
    semaphore_worker,
)

__all__ = ["SUBJECTS", "HandOverPool", "ablate_contended", "main", "unchecked_alloc_pool"]

SUBJECTS = (
    "asyncpool",
    "no resets",
    "no wait timing",
    "no resets, no timing",
    "no alloc checks",
    "hand-over floor",
)


class HandOverPool:
    """Rows granted at hand-over, FIFO, with nothing else: no checks, no
    stats, no resets, no fences. The floor for the contended grant."""

    def __init__(self, rows: int) -> None:
        self._free: collections.deque[int] = collections.deque(range(1, rows + 1))
        self._waiters: collections.deque[asyncio.Future[list[int]]] = collections.deque()

    async def alloc(self, n: int) -> list[int]:
        if not self._waiters and self._free:
            return [self._free.popleft()]
        fut: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        return await fut

    def free(self, rows: list[int]) -> int:
        free, waiters = self._free, self._waiters
        free.extend(rows)
        while waiters and free:
            fut = waiters.popleft()
            if not fut.done():
                fut.set_result([free.popleft()])
        return len(rows)


def unchecked_alloc_pool(size: int, max_context_len: int) -> Any:
    """An AsyncReqToTokenPool whose ``alloc`` skips every check (see above).

    Its body is a deliberate copy of the shipped ``alloc``'s take-or-enqueue
    core (``asyncpool/pool.py``), inlined as the shipped one inlines
    ``WaiterQueues.wait``: calling ``wait`` would add a coroutine frame and
    measure something else. Keep the two in step.
    """
    from asyncpool import AsyncReqToTokenPool

    class UncheckedAlloc(AsyncReqToTokenPool):
        async def alloc(  # type: ignore[override]  # a stand-in: ints only
            self, n: int, *, priority: int = 0, timeout: float | None = None
        ) -> list[int]:
            waiters = self._waiters
            self._fast = False  # as the shipped alloc: no unchecked free meanwhile
            if not waiters.count and not waiters.gated:
                rows = self._take(n)
                if rows is not None:
                    self._fast_allocs += 1
                    self._fast = self._unchecked
                    return rows
            waiter, handle = waiters.enqueue(
                n,
                priority,
                timeout,
                asyncio.get_running_loop(),
                self._wait_times,
                waiters.figures(priority).histograms[0],
            )
            try:
                granted: list[int] = await waiter[1]
                return granted
            except asyncio.CancelledError:
                waiters.cancelled(waiter)
                raise
            finally:
                if handle is not None:
                    handle.cancel()

    return UncheckedAlloc(size, max_context_len, device="cpu")


@contextmanager
def _constant_wait_clock() -> Iterator[None]:
    from asyncpool import waiters

    real = waiters._perf_counter
    waiters._perf_counter = lambda: 1.0
    try:
        yield
    finally:
        waiters._perf_counter = real


def _skip_resets(pool: Any) -> None:
    def drop() -> None:
        pool._unreset.clear()

    pool._flush_resets = drop


async def ablate_contended(cfg: Config) -> dict[str, list[float]]:
    """Per-round ratios to ``asyncio.Semaphore(64)``, per subject."""
    from asyncpool import AsyncReqToTokenPool

    tasks, rounds, rows = cfg.contended_tasks, cfg.contended_rounds, cfg.contended_rows
    now = clock_of(cfg)
    pools: dict[str, Any] = {}
    for name in SUBJECTS:
        if name == "hand-over floor":
            pools[name] = HandOverPool(rows)
            continue
        if name == "no alloc checks":
            pools[name] = unchecked_alloc_pool(rows + 1, cfg.max_context_len)
            continue
        pool = AsyncReqToTokenPool(rows + 1, cfg.max_context_len, device="cpu")
        if "no resets" in name:
            _skip_resets(pool)
        pools[name] = pool
    sem = asyncio.Semaphore(rows)

    def pool_sampler(name: str) -> Sampler:
        sample = gathered(pool_worker(pools[name], rounds), tasks, now)
        if "timing" in name:

            async def sample_untimed(n: int) -> int:
                with _constant_wait_clock():
                    return await sample(n)

            return sample_untimed
        return sample

    sem_sample = gathered(semaphore_worker(sem, rounds), tasks, now)

    samplers: dict[str, Sampler] = {name: pool_sampler(name) for name in SUBJECTS}
    samplers["Semaphore"] = sem_sample
    per_grant = tasks * rounds
    try:
        per_op = await interleave(
            samplers,
            rounds=cfg.rounds,
            target_s=cfg.sample_s * 5,
            ops_per_call=dict.fromkeys(samplers, per_grant),
            start=1,
            disable_gc=False,
        )
    finally:
        for pool in pools.values():
            if isinstance(pool, AsyncReqToTokenPool):
                await pool.close()
    return per_op


def render(results: dict[str, dict[str, list[float]]]) -> str:
    """A markdown table: per subject and loop, the median ratio and ns/grant."""
    loops = list(results)
    lines = [
        "| subject | " + " | ".join(f"{lp}: vs Semaphore | {lp}: per grant" for lp in loops) + " |",
        "| --- | " + " | ".join("--- | ---" for _ in loops) + " |",
    ]
    for name in (*SUBJECTS, "Semaphore"):
        cells = []
        for lp in loops:
            per_op = results[lp]
            ratios = [a / b for a, b in zip(per_op[name], per_op["Semaphore"], strict=True)]
            cells.append(
                f"{statistics.median(ratios):.2f}x | {statistics.median(per_op[name]) / 1e3:.2f} µs"
            )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(cfg: Config, loops: Sequence[str] | None = None) -> dict[str, dict[str, list[float]]]:
    """Run the ablation on each loop (all available by default)."""
    kinds = list(loops) if loops else list(loop_factories())
    return {kind: run_on(kind, functools.partial(ablate_contended, cfg)) for kind in kinds}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.ablation",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--preset", choices=sorted(PRESETS), default="default")
    add_loop_option(p)
    args = p.parse_args(argv)
    print(render(run(PRESETS[args.preset], args.loop)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
