"""How long after a CUDA event completes does a coroutine waiting for it resume?

CUDA only (a measurement aid for ``docs/cuda.md``, not part of CI or of
``python -m benchmarks``). A kernel of ``--kernel-ms`` runs on a side stream,
a fence is recorded after it, and the waiting coroutine stamps when it
resumes; the fence's own completion cannot be stamped from the host, so each
way of waiting is read against a blocking ``fence.synchronize()`` inside the
coroutine (the loop stands still: the fastest wake-up, and the one to avoid
in a scheduler). The ways, interleaved sample by sample, order rotated:

* ``wait_fence``: ``await asyncpool.wait_fence(fence)`` (its loop's poller
  asks ``query()``; backoff 50 µs to 1 ms);
* ``stream thread``: a :class:`~asyncpool.watcher.FenceWatcher` given the
  fence with ``watch()`` (what the pools do: a daemon thread per stream,
  asleep in the event's ``synchronize()``), which wakes the loop;
* ``executor``: ``await loop.run_in_executor(None, fence.synchronize)``.

    python scripts/cuda_wait_latency.py [--samples 200] [--kernel-ms 2]

Prints, per event loop, the median and 90th percentile of each way's extra
time over the blocking synchronize's median, in microseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch
import uvloop

from asyncpool import record_fence, wait_fence
from asyncpool.watcher import FenceWatcher


def _cycles_per_ms() -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # untimed: lets the clock boost
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / max(start.elapsed_time(end), 1e-3)


async def _measure(samples: int, kernel_ms: float) -> dict[str, list[float]]:
    loop = asyncio.get_running_loop()
    stream = torch.cuda.Stream()
    cycles = int(kernel_ms * _cycles_per_ms())
    woken = asyncio.Event()

    def notify() -> None:  # on the watcher's thread
        loop.call_soon_threadsafe(woken.set)

    watcher = FenceWatcher(notify, name="latency")

    async def by_sync(fence: Any) -> None:
        fence.synchronize()

    async def by_wait_fence(fence: Any) -> None:
        await wait_fence(fence)

    async def by_stream_thread(fence: Any) -> None:
        woken.clear()
        watcher.watch(fence)
        while not fence.query():  # notified for this fence, or a stale notify
            await woken.wait()
            woken.clear()

    async def by_executor(fence: Any) -> None:
        await loop.run_in_executor(None, fence.synchronize)

    ways: dict[str, Callable[[Any], Awaitable[None]]] = {
        "synchronize()": by_sync,
        "wait_fence": by_wait_fence,
        "stream thread": by_stream_thread,
        "executor": by_executor,
    }
    names = list(ways)
    took: dict[str, list[float]] = {name: [] for name in names}
    try:
        for i in range(samples + 5):
            order = names[i % len(names) :] + names[: i % len(names)]
            for name in order:
                with torch.cuda.stream(stream):
                    torch.cuda._sleep(cycles)
                fence = record_fence(stream)
                t0 = time.perf_counter()
                await ways[name](fence)
                if i >= 5:  # the first rounds warm the threads up
                    took[name].append(time.perf_counter() - t0)
    finally:
        watcher.stop()
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--kernel-ms", type=float, default=2.0)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, kernel {args.kernel_ms} ms")
    for name, run in (("asyncio", asyncio.run), ("uvloop", uvloop.run)):
        took = run(_measure(args.samples, args.kernel_ms))
        base = statistics.median(took["synchronize()"])
        print(f"{name}: blocking synchronize() median {base * 1e3:.3f} ms; extra over it, µs:")
        for way, times in took.items():
            extra = sorted((t - base) * 1e6 for t in times)
            p90 = extra[int(0.9 * (len(extra) - 1))]
            print(f"  {way:15s} median {statistics.median(extra):8.1f}   p90 {p90:8.1f}")


if __name__ == "__main__":
    main()
