"""Profile the asyncpool side of one benchmark under cProfile.

``python -m benchmarks.profile uncontended --loop uvloop`` runs only the
pool's workload (no references) and prints the functions with the most
own time. cProfile inflates Python call costs, so read it for *where* the
time goes, not how much; the benchmarks give the how much.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import threading
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from .harness import loop_factories, run_on

WORKLOADS = ("uncontended", "batched", "contended", "fenced", "reclaim-head", "wake")


async def _uncontended(n: int) -> Callable[[], Coroutine[Any, Any, None]]:
    from asyncpool import AsyncReqToTokenPool

    pool = AsyncReqToTokenPool(1024, 1024)

    async def work() -> None:
        alloc, free = pool.alloc, pool.free
        for _ in range(n):
            rows = await alloc(1)
            free(rows)
        await pool.close()

    return work


async def _batched(n: int) -> Callable[[], Coroutine[Any, Any, None]]:
    from asyncpool import AsyncReqToTokenPool

    pool = AsyncReqToTokenPool(1024, 1024)

    async def work() -> None:
        alloc, free = pool.alloc, pool.free
        for _ in range(n // 64):
            rows = await alloc(64)
            free(rows)
        await pool.close()

    return work


async def _contended(n: int) -> Callable[[], Coroutine[Any, Any, None]]:
    from asyncpool import AsyncReqToTokenPool

    pool = AsyncReqToTokenPool(65, 1024)

    async def worker() -> None:
        for _ in range(5):
            rows = await pool.alloc(1)
            await asyncio.sleep(0)
            pool.free(rows)

    async def work() -> None:
        for _ in range(max(1, n // 5000)):
            await asyncio.gather(*[worker() for _ in range(1000)])
        await pool.close()

    return work


async def _fenced(n: int) -> Callable[[], Coroutine[Any, Any, None]]:
    from asyncpool import AsyncReqToTokenPool, HostStream

    pool = AsyncReqToTokenPool(64 * 64 + 1, 1024)
    stream = HostStream()

    async def work() -> None:
        for _ in range(max(1, n // 4096)):
            gate = threading.Event()
            stream.launch(gate.wait)
            fences = [stream.record() for _ in range(64)]
            for f in fences:
                rows = await pool.alloc(64)
                pool.free(rows, fence=f)
            gate.set()
            stream.synchronize()
            pool.reclaim()
            await asyncio.sleep(0)
        await pool.drain()
        await pool.close()
        stream.close()

    return work


async def _reclaim_head(n: int) -> Callable[[], Coroutine[Any, Any, None]]:
    from asyncpool import AsyncReqToTokenPool, HostStream

    from .bench_fences import _GatedPending

    h = _GatedPending(AsyncReqToTokenPool(10_002, 16), HostStream(), 10_000)
    await h.fill()

    async def work() -> None:
        for _ in range(min(n, 2000)):
            gate, fence = h.queue.popleft()
            gate.set()
            fence.synchronize()
            h.pool.reclaim()
            await asyncio.sleep(0)
            rows = h.pool.try_alloc(1)
            assert rows is not None
            h.push(rows)
        await h.close()

    return work


async def _wake(n: int) -> Callable[[], Coroutine[Any, Any, None]]:
    """A waiter on a full pool, woken by a host fence completing: n times."""
    from asyncpool import AsyncReqToTokenPool, HostStream

    pool = AsyncReqToTokenPool(2, 16)
    stream = HostStream()
    held = await pool.alloc(1)

    async def work() -> None:
        nonlocal held
        for _ in range(min(n, 5000)):
            gate = threading.Event()
            stream.launch(gate.wait)
            pool.free(held, fence=stream.record())
            task = asyncio.ensure_future(pool.alloc(1))
            await asyncio.sleep(0)
            gate.set()
            held = await task
        pool.free(held)
        await pool.close()
        stream.close()

    return work


def profile(workload: str, loop: str, n: int, top: int = 25) -> str:
    makers = {
        "uncontended": _uncontended,
        "batched": _batched,
        "contended": _contended,
        "fenced": _fenced,
        "reclaim-head": _reclaim_head,
        "wake": _wake,
    }

    async def main() -> str:
        work = await makers[workload](n)
        prof = cProfile.Profile()
        prof.enable()
        await work()
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
        return out.getvalue()

    return run_on(loop, main)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.profile", description=__doc__)
    p.add_argument("workload", choices=WORKLOADS)
    p.add_argument("--loop", default="asyncio", choices=list(loop_factories()))
    p.add_argument("-n", type=int, default=200_000, help="operations (rows or grants)")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)
    print(profile(args.workload, args.loop, args.n, args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
