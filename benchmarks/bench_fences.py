"""Issue 6, parts 3 and 5: frees behind fences, reclaim, and wake-up latency.

* Fenced frees, per row: ``alloc(64)`` then ``free(rows, fence=f)`` with
  ``f`` still open (a gate holds the host stream), then, once the stream has
  run past every fence, ``reclaim()`` and one ``await asyncio.sleep(0)`` so
  the pool's own completion callbacks run too. Timed: the alloc+free loop
  and the reclaim+sleep; untimed: recording the fences and waiting for the
  stream. References: the same alloc+free without a fence, and the
  seed-style pool (which has no fences at all, and so no safety).
* A step's ``record_use``, per row: 256 allocated rows, each step's
  ``record_use(rows, fence)`` with that step's fence (one ``HostStream``,
  fences recorded untimed), so every row replaces the step before's use.
  Reference (the floor): a list of uses written row by row, the least any
  pool that remembers a row's newest use must do.
* Reclaim against the number of pending fences P (1 .. 10^4), one row per
  fence, one stream, each fence behind its own gate. "idle": ``reclaim()``
  while no fence has completed. "head": open the oldest gate, wait for its
  fence, time the one ``reclaim()`` that returns its row, then re-free a row
  behind a new fence at the tail, so P stays constant. Both must stay flat:
  the ledger checks only the head of each stream's queue.
* Wake-up latency: a waiter queues on a full pool; its row is freed behind
  an open fence; the time from the stream reaching the fence to the waiter
  resuming. Reference (the floor): a bare future resolved with
  ``call_soon_threadsafe`` from the same fence's completion. Also: the CPU
  the process burns (``time.process_time``, every thread) while a waiter
  idles on an open fence for ``idle_wait_s``, beside the same window with
  nobody waiting; each window pays the loop's one wake-up, so the two agree
  when the waiter costs nothing (no polling).
  :func:`bench_wake_latency` takes ``device`` so that it can run on CUDA
  events (nothing in the suite does: on a GPU machine, call it with
  ``device="cuda"``; ``scripts/gpu_check.sh`` measures the watcher's wake
  latency in ``tests/test_cuda.py`` instead).
* Wake-up latency with 100 slow fences of unknown origin watched (transfer
  handles that stay open): a fence of unknown origin, or a host fence,
  completes among them; against the single-fence figure above, and the CPU
  the watcher's poller burns meanwhile (:func:`bench_wake_slow_fences`).
"""

from __future__ import annotations

import asyncio
import collections
import gc
import random
import threading
import time
from collections.abc import Callable
from time import perf_counter_ns
from typing import Any

from .harness import Config, Row, Target, clock_of, compare, interleave, loop_name, median
from .naive_pool import NaiveReqToTokenPool

__all__ = [
    "bench_fenced_free",
    "bench_reclaim_sweep",
    "bench_record_use",
    "bench_wake_latency",
    "bench_wake_slow_fences",
]

RECLAIM_FLAT = Target("<=", 1.5)


async def bench_fenced_free(cfg: Config) -> list[Row]:
    """Free behind an open fence + reclaim, per row."""
    from asyncpool import AsyncReqToTokenPool, HostStream

    loop = loop_name()
    now = clock_of(cfg)
    k, batches = cfg.batch_k, cfg.fenced_batches
    size = batches * k + 1
    ctx = cfg.max_context_len
    fenced = AsyncReqToTokenPool(size, ctx, device="cpu")
    plain = AsyncReqToTokenPool(size, ctx, device="cpu")
    naive = NaiveReqToTokenPool(size, ctx)
    stream = HostStream(name="bench-fenced")
    reclaimed = [0]

    async def fenced_sample(n: int) -> int:
        alloc, free, reclaim = fenced.alloc, fenced.free, fenced.reclaim
        total = 0
        for _ in range(n):
            gate = threading.Event()
            stream.launch(gate.wait)
            fences = [stream.record() for _ in range(batches)]
            t0 = now()
            for f in fences:
                rows = await alloc(k)
                free(rows, fence=f)
            t1 = now()
            gate.set()
            stream.synchronize()
            t2 = now()
            reclaimed[0] += reclaim()
            await asyncio.sleep(0)
            total += (t1 - t0) + (now() - t2)
        return total

    async def plain_sample(n: int) -> int:
        alloc, free = plain.alloc, plain.free
        t0 = now()
        for _ in range(n):
            for _ in range(batches):
                rows = await alloc(k)
                free(rows)
        return now() - t0

    async def naive_sample(n: int) -> int:
        alloc, free = naive.alloc, naive.free
        t0 = now()
        for _ in range(n):
            for _ in range(batches):
                rows = alloc(k)
                assert rows is not None
                free(rows)
        return now() - t0

    rows_per_call = batches * k
    try:
        per_op = await interleave(
            {"fenced": fenced_sample, "unfenced": plain_sample, "seed-style": naive_sample},
            rounds=cfg.rounds,
            target_s=cfg.sample_s,
            ops_per_call=dict.fromkeys(("fenced", "unfenced", "seed-style"), rows_per_call),
            start=1,
        )
    finally:
        stream.synchronize()
        await fenced.drain()
        await fenced.close()
        await plain.close()
        stream.close()
    bench = f"fenced free({k} rows) + reclaim, per row"
    note = f"{batches} batches of {k} rows behind open fences per cycle"
    return [
        compare(
            per_op,
            bench=bench,
            loop=loop,
            subject="fenced",
            reference="unfenced",
            unit="ns/row",
            speedup=False,
            subject_label="asyncpool, fenced",
            reference_label="asyncpool alloc+free, no fence",
            note=note,
        ),
        compare(
            per_op,
            bench=bench,
            loop=loop,
            subject="fenced",
            reference="seed-style",
            unit="ns/row",
            speedup=True,
            subject_label="asyncpool, fenced",
            reference_label="seed-style alloc+free (no fence)",
            note=note,
        ),
    ]


async def bench_record_use(cfg: Config, running: int = 256) -> list[Row]:
    """A step's ``record_use`` over ``running`` rows, per row, against the floor."""
    from asyncpool import AsyncReqToTokenPool, HostStream

    loop = loop_name()
    now = clock_of(cfg)
    pool = AsyncReqToTokenPool(running + 1, cfg.max_context_len, device="cpu")
    stream = HostStream(name="bench-record-use")
    rows = await pool.alloc(running)
    floor_uses: list[Any] = [None] * (running + 1)

    def fences(n: int) -> list[Any]:
        return [stream.record() for _ in range(n)]

    async def pool_sample(n: int) -> int:
        record_use = pool.record_use
        steps = fences(n)
        t0 = now()
        for f in steps:
            record_use(rows, f)
        return now() - t0

    async def floor_sample(n: int) -> int:
        uses = floor_uses
        steps = fences(n)
        t0 = now()
        for f in steps:
            for row in rows:
                uses[row] = f
        return now() - t0

    try:
        per_op = await interleave(
            {"record_use": pool_sample, "floor": floor_sample},
            rounds=cfg.rounds,
            target_s=cfg.sample_s,
            ops_per_call=dict.fromkeys(("record_use", "floor"), running),
            start=1,
        )
    finally:
        stream.synchronize()
        pool.free(rows)
        await pool.drain()
        await pool.close()
        stream.close()
    return [
        compare(
            per_op,
            bench=f"step: record_use({running} rows), per row",
            loop=loop,
            subject="record_use",
            reference="floor",
            unit="ns/row",
            speedup=False,
            subject_label="asyncpool record_use",
            reference_label="a list of uses written per row, unchecked (the floor)",
            note=f"{running} running rows, a new fence each step: every row's "
            "use replaced; checks every row is allocated and named once",
        ),
    ]


class _GatedPending:
    """A pool holding exactly ``p`` rows behind ``p`` open fences, one per row.

    Every fence sits behind its own gate on one host stream, so the test
    opens them one at a time, oldest first.
    """

    def __init__(self, pool: Any, stream: Any, p: int) -> None:
        self.pool = pool
        self.stream = stream
        self.p = p
        self.queue: collections.deque[tuple[threading.Event, Any]] = collections.deque()

    async def fill(self) -> None:
        rows = await self.pool.alloc(self.p)
        for row in rows:
            self.push([row])

    def push(self, rows: list[int]) -> None:
        gate = threading.Event()
        self.stream.launch(gate.wait)
        fence = self.stream.record()
        self.pool.free(rows, fence=fence)
        self.queue.append((gate, fence))

    async def close(self) -> None:
        for gate, _ in self.queue:
            gate.set()
        self.stream.synchronize()
        await self.pool.drain()
        await self.pool.close()
        self.stream.close()


async def bench_reclaim_sweep(cfg: Config) -> list[Row]:
    """``reclaim()`` cost as the number of pending fences grows."""
    from asyncpool import AsyncReqToTokenPool, HostStream

    loop = loop_name()
    now = clock_of(cfg)
    ps = cfg.reclaim_pending
    size = max(ps) + 2
    holders: dict[int, _GatedPending] = {}
    try:
        for p in ps:
            h = _GatedPending(
                AsyncReqToTokenPool(size, 16, device="cpu"), HostStream(name=f"bench-p{p}"), p
            )
            holders[p] = h
            await h.fill()
            assert h.pool.pending_size() == p, (p, h.pool.pending_size())

        def idle_sampler(h: _GatedPending) -> Callable[[int], Any]:
            async def sample(n: int) -> int:
                reclaim = h.pool.reclaim
                t0 = now()
                for _ in range(n):
                    reclaim()
                return now() - t0

            return sample

        def head_sampler(h: _GatedPending) -> Callable[[int], Any]:
            async def sample(n: int) -> int:
                pool = h.pool
                total = 0
                for _ in range(n):
                    gate, fence = h.queue.popleft()
                    gate.set()
                    fence.synchronize()
                    t0 = perf_counter_ns()
                    got = pool.reclaim()
                    total += perf_counter_ns() - t0
                    assert got == 1, got
                    # Let the pool's completion callback run (untimed), then
                    # keep P constant: one row back behind a new open fence.
                    await asyncio.sleep(0)
                    rows = pool.try_alloc(1)
                    assert rows is not None
                    h.push(rows)
                return total

            return sample

        idle = await interleave(
            {f"P={p}": idle_sampler(holders[p]) for p in ps},
            rounds=cfg.rounds,
            target_s=cfg.sample_s,
        )
        head = await interleave(
            {f"P={p}": head_sampler(holders[p]) for p in ps},
            rounds=cfg.rounds,
            target_s=0.0,
            start=cfg.reclaim_head_samples,
        )
        for p in ps:
            assert holders[p].pool.pending_size() == p
    finally:
        for h in holders.values():
            await h.close()

    base = f"P={ps[0]}"
    rows: list[Row] = []
    for label, data, what in (
        ("idle", idle, "nothing completed"),
        ("head", head, "oldest fence completed"),
    ):
        for p in ps[1:]:
            rows.append(
                compare(
                    data,
                    bench=f"reclaim(), {what}",
                    loop=loop,
                    subject=f"P={p}",
                    reference=base,
                    unit="ns/reclaim",
                    speedup=False,
                    target=RECLAIM_FLAT if p == max(ps) else None,
                    subject_label=f"{p} pending fences",
                    reference_label=f"{ps[0]} pending fence",
                    note=f"sweep:{label}",
                )
            )
    return rows


def _stamp(cell: list[int]) -> None:
    cell[0] = perf_counter_ns()


class _CudaGate:
    """Holds a CUDA stream busy for a while and stamps when a fence completes.

    The host cannot be told the instant an event completes, so a thread spins
    on ``query()`` (yielding the GIL between polls) and stamps the first True;
    the figure is therefore an upper bound by the poll period (~µs).
    """

    def __init__(self, stream: Any, sleep_cycles: int = 2_000_000) -> None:
        import torch

        self.torch = torch
        self.stream = stream
        self.sleep_cycles = sleep_cycles

    def hold_and_record(self, record: Callable[[Any], Any]) -> tuple[Any, list[int]]:
        torch = self.torch
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(self.sleep_cycles)
        fence = record(self.stream)
        cell = [0]

        def spin() -> None:
            while not fence.query():
                time.sleep(0)
            cell[0] = perf_counter_ns()

        thread = threading.Thread(target=spin, daemon=True)
        thread.start()
        self._thread = thread
        return fence, cell

    def join(self) -> None:
        self._thread.join()


async def bench_wake_latency(cfg: Config, device: str = "cpu") -> list[Row]:
    """Fence completion → the waiting task resumes, against the bare floor.

    ``device="cpu"``: host fences on a :class:`HostStream`, stamped on the
    stream's worker just before it reaches the fence. ``device="cuda"``:
    CUDA events on a side stream held busy by ``torch.cuda._sleep``, stamped
    by a polling thread (see :class:`_CudaGate`).
    """
    from asyncpool import AsyncReqToTokenPool, HostStream, record_fence

    loop_kind = loop_name()
    loop = asyncio.get_running_loop()
    cuda = device.startswith("cuda")
    if cuda:
        import torch

        stream: Any = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        gate_cuda = _CudaGate(stream)
    else:
        stream = HostStream(name="bench-wake")
    pool = AsyncReqToTokenPool(2, 16, device=device)  # one grantable row
    held = await pool.alloc(1)
    pool_lat: list[float] = []
    floor_lat: list[float] = []

    def open_fence() -> tuple[Any, list[int], threading.Event | None]:
        if cuda:
            fence, cell = gate_cuda.hold_and_record(record_fence)
            return fence, cell, None
        gate = threading.Event()
        cell = [0]
        stream.launch(gate.wait)
        stream.launch(_stamp, cell)
        return stream.record(), cell, gate

    async def waiter() -> tuple[list[int], int]:
        rows = await pool.alloc(1)
        return rows, perf_counter_ns()

    async def pool_once() -> float:
        nonlocal held
        fence, cell, gate = open_fence()
        pool.free(held, fence=fence)
        task = asyncio.ensure_future(waiter())
        for _ in range(3):
            await asyncio.sleep(0)  # the waiter is queued now
        if gate is not None:
            gate.set()
        held, t1 = await task
        if cuda:
            gate_cuda.join()
        return float(t1 - cell[0])

    async def floor_once() -> float:
        fence, cell, gate = open_fence()
        fut: asyncio.Future[int] = loop.create_future()

        def done(_: object = None) -> None:
            if not fut.done():
                fut.set_result(perf_counter_ns())

        if cuda:

            def watch() -> None:
                fence.synchronize()
                loop.call_soon_threadsafe(done)

            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
        else:
            fence.add_done_callback(lambda: loop.call_soon_threadsafe(done))

        async def resume() -> int:
            await fut
            return perf_counter_ns()

        task = asyncio.ensure_future(resume())
        for _ in range(3):
            await asyncio.sleep(0)
        if gate is not None:
            gate.set()
        t1 = await task
        if cuda:
            watcher.join()
            gate_cuda.join()
        return float(t1 - cell[0])

    async def idle_window() -> float:
        """CPU seconds per wall second over one ``cfg.idle_wait_s`` sleep.

        Settles first (a collection, then a short sleep), so no leftover work
        of the samples before lands in the window. A window always costs the
        loop's own wake-up (about 0.1 ms here), so a short window reads high:
        compare with :func:`bare_cpu`, measured the same way.
        """
        gc.collect()
        await asyncio.sleep(0.02)
        c0, w0 = time.process_time(), time.perf_counter()
        await asyncio.sleep(cfg.idle_wait_s)
        c1, w1 = time.process_time(), time.perf_counter()
        return (c1 - c0) / (w1 - w0)

    async def idle_cpu() -> float:
        """CPU fraction of a core while a waiter idles on an open fence."""
        nonlocal held
        gate = threading.Event()
        if cuda:
            # Busy for the whole window: at most ~2 GHz of SM clock, so twice
            # the window's seconds in GHz cycles (the wake-up samples' 2e6
            # cycles, ~1 ms, would leave the window's rest with no fence open).
            with torch.cuda.stream(stream):
                torch.cuda._sleep(int(cfg.idle_wait_s * 4e9))  # type: ignore[no-untyped-call]
            fence = record_fence(stream)
        else:
            stream.launch(gate.wait)
            fence = stream.record()
        pool.free(held, fence=fence)
        task = asyncio.ensure_future(waiter())
        await asyncio.sleep(0)
        cpu = await idle_window()
        gate.set()
        held, _ = await task
        return cpu

    async def bare_cpu() -> float:
        """The same window with nobody waiting: the loop's own idle cost."""
        return await idle_window()

    try:
        for _ in range(3):  # warm-up
            await pool_once()
            await floor_once()
        for i in range(cfg.wake_samples):
            if i % 2:
                floor_lat.append(await floor_once())
                pool_lat.append(await pool_once())
            else:
                pool_lat.append(await pool_once())
                floor_lat.append(await floor_once())
        cpu = await idle_cpu()
        bare = await bare_cpu()
    finally:
        pool.free(held)
        await pool.drain()
        await pool.close()
        if not cuda:
            stream.close()

    def p90(xs: list[float]) -> float:
        return sorted(xs)[min(len(xs) - 1, int(0.9 * len(xs)))]

    row = compare(
        {"pool": pool_lat, "floor": floor_lat},
        bench=f"wake-up latency ({device} fences)",
        loop=loop_kind,
        subject="pool",
        reference="floor",
        unit="ns",
        speedup=False,
        subject_label="asyncpool waiter resumes",
        reference_label="bare future via call_soon_threadsafe",
        note=(
            f"p90 pool {p90(pool_lat) / 1e3:.1f} µs, floor {p90(floor_lat) / 1e3:.1f} µs; "
            f"CPU while a waiter idles on an open fence: {cpu * 100:.3f}% of a core over "
            f"{cfg.idle_wait_s:g} s (the loop sleeping, nobody waiting: {bare * 100:.3f}%)"
        ),
    )
    row.samples["idle_cpu_fraction"] = [cpu]
    row.samples["bare_idle_cpu_fraction"] = [bare]
    row.samples["pool_median_us"] = [median(pool_lat) / 1e3]
    return [row]


class _SlowFence:
    """A fence of unknown origin (a transfer handle): no ``stream_key``,
    completes when its event is set; the watcher polls its ``query()``."""

    __slots__ = ("event",)

    def __init__(self) -> None:
        self.event = threading.Event()

    def query(self) -> bool:
        return self.event.is_set()

    def synchronize(self) -> None:
        self.event.wait()


async def bench_wait_fence(cfg: Config) -> list[Row]:
    """``await wait_fence(fence)`` against ``await loop.run_in_executor(None,
    fence.synchronize)``, the other way to wait without blocking the loop.

    Latency from the fence's completion (stamped by whoever completes it, just
    before) to the awaiting task's resumption, interleaved sample by sample,
    for a host fence (it calls back) and for a fence of unknown origin (polled
    by the watcher, which never calls its ``synchronize()``; the executor
    blocks a thread in it for the whole wait, for ever if it never completes).
    """
    from asyncpool import HostStream, wait_fence

    loop_kind = loop_name()
    loop = asyncio.get_running_loop()
    stream = HostStream(name="bench-wait-fence")

    def host_fence() -> tuple[Any, Callable[[], None], list[int]]:
        gate = threading.Event()
        cell = [0]
        stream.launch(gate.wait)
        stream.launch(_stamp, cell)
        return stream.record(), gate.set, cell

    def unknown_fence() -> tuple[Any, Callable[[], None], list[int]]:
        fence = _SlowFence()
        cell = [0]

        def complete() -> None:
            def land() -> None:  # the transfer lands on a thread of its own
                cell[0] = perf_counter_ns()
                fence.event.set()

            threading.Thread(target=land, daemon=True).start()

        return fence, complete, cell

    async def once(
        make: Callable[[], tuple[Any, Callable[[], None], list[int]]], how: str
    ) -> float:
        fence, complete, cell = make()

        async def resume() -> int:
            if how == "wait_fence":
                await wait_fence(fence)
            else:
                await loop.run_in_executor(None, fence.synchronize)
            return perf_counter_ns()

        task = asyncio.ensure_future(resume())
        for _ in range(3):
            await asyncio.sleep(0)  # the wait is under way
        complete()
        t1 = await task
        return float(t1 - cell[0])

    rows: list[Row] = []
    try:
        for kind, make in (("host fence", host_fence), ("fence of unknown origin", unknown_fence)):
            lat: dict[str, list[float]] = {"wait_fence": [], "executor": []}
            for _ in range(3):  # warm-up (the executor's thread, the watcher)
                await once(make, "wait_fence")
                await once(make, "executor")
            for i in range(cfg.wake_samples):
                order = ("executor", "wait_fence") if i % 2 else ("wait_fence", "executor")
                for how in order:
                    lat[how].append(await once(make, how))
            rows.append(
                compare(
                    lat,
                    bench=f"wait_fence wake-up ({kind})",
                    loop=loop_kind,
                    subject="wait_fence",
                    reference="executor",
                    unit="ns",
                    speedup=False,
                    subject_label="await wait_fence(fence)",
                    reference_label="await run_in_executor(None, fence.synchronize)",
                    note="from the fence's completion to the task's resumption",
                )
            )
    finally:
        stream.close()
    return rows


async def bench_wake_slow_fences(cfg: Config) -> list[Row]:
    """Wake-up latency with ``cfg.slow_fences`` slow fences of unknown origin watched.

    A pool holds ``cfg.slow_fences`` rows behind fences of unknown origin
    that stay open for the whole run (slow transfers) plus one row that a
    waiter wants. That row is freed behind (a) a host fence or (b) a fence
    of unknown origin, which completes ``cfg.wake_settle_s`` later (long
    enough for the watcher's poll backoff to reach its cap: the steady state
    of slow transfers; plus a random phase). Latency: the stream's worker stamps just before it
    completes the fence; the waiter stamps when it resumes. Reference: the
    existing single-fence figure (a pool with nothing else pending, host
    fence), interleaved in the same run. Also: the process's CPU while the
    slow fences are watched and the loop idles.
    """
    from asyncpool import AsyncReqToTokenPool, HostStream

    loop_kind = loop_name()
    n_slow = cfg.slow_fences
    stream = HostStream(name="bench-wake-slow")
    single = AsyncReqToTokenPool(2, 16)
    crowded = AsyncReqToTokenPool(n_slow + 2, 16)
    slow = [_SlowFence() for _ in range(n_slow)]
    for slot, fence in zip(await crowded.alloc(n_slow), slow, strict=True):
        crowded.free([slot], fence=fence)
    held = {id(single): await single.alloc(1), id(crowded): await crowded.alloc(1)}

    rng = random.Random(0)

    async def once(pool: Any, unknown: bool) -> float:
        gate = threading.Event()
        cell = [0]
        stream.launch(gate.wait)
        stream.launch(_stamp, cell)
        fence: Any
        if unknown:
            fence = _SlowFence()
            stream.launch(fence.event.set)
        else:
            fence = stream.record()
        pool.free(held[id(pool)], fence=fence)

        async def waiter() -> tuple[list[int], int]:
            rows = await pool.alloc(1)
            return rows, perf_counter_ns()

        task = asyncio.ensure_future(waiter())
        # The waiter queues and the poll backoff reaches its cap; a random
        # extra up to one cap period spreads the completion uniformly over
        # the poll schedule instead of phase-locking to it.
        await asyncio.sleep(cfg.wake_settle_s + rng.uniform(0.0, 0.001))
        gate.set()
        rows, t1 = await task
        held[id(pool)] = rows
        return float(t1 - cell[0])

    cases = {
        "single": (single, False),
        "crowded-host": (crowded, False),
        "crowded-unknown": (crowded, True),
        "single-unknown": (single, True),
    }
    lat: dict[str, list[float]] = {name: [] for name in cases}
    try:
        for _ in range(2):  # warm-up
            for pool, unknown in cases.values():
                await once(pool, unknown)
        names = list(cases)
        for i in range(cfg.wake_samples):
            k = i % len(names)
            for name in names[k:] + names[:k]:  # rotate who goes first
                lat[name].append(await once(*cases[name]))
        watcher = crowded._wakeups.watcher
        assert watcher is not None and watcher.polled == n_slow, watcher
        polls0 = watcher.polls
        c0, w0 = time.process_time(), time.perf_counter()
        await asyncio.sleep(cfg.idle_wait_s)
        c1, w1 = time.process_time(), time.perf_counter()
        cpu = (c1 - c0) / (w1 - w0)
        poll_rate = (watcher.polls - polls0) / (w1 - w0)
    finally:
        for fence in slow:
            fence.event.set()
        for pool in (single, crowded):
            pool.free(held[id(pool)])
            await pool.drain(timeout=30)
            await pool.close()
        stream.close()

    def us(xs: list[float]) -> str:
        return f"{median(xs) / 1e3:.1f} µs"

    note = (
        f"{n_slow} slow fences of unknown origin stay open; the fence completes "
        f"{cfg.wake_settle_s * 1e3:g}-{cfg.wake_settle_s * 1e3 + 1:g} ms after the waiter "
        f"queued; a fence of unknown "
        f"origin alone: {us(lat['single-unknown'])}. While the {n_slow} are watched and "
        f"the loop idles: {cpu * 100:.1f}% of a core, {poll_rate:.0f} polls/s"
    )
    rows = [
        compare(
            lat,
            bench=f"wake-up latency, {n_slow} slow fences watched",
            loop=loop_kind,
            subject="crowded-unknown",
            reference="single",
            unit="ns",
            speedup=False,
            subject_label="a fence of unknown origin completes (polled)",
            reference_label="single host fence, nothing else pending",
            note=note,
        ),
        compare(
            lat,
            bench=f"wake-up latency, {n_slow} slow fences watched",
            loop=loop_kind,
            subject="crowded-host",
            reference="single",
            unit="ns",
            speedup=False,
            subject_label="a host fence completes (done-callback)",
            reference_label="single host fence, nothing else pending",
            note=note,
        ),
    ]
    for row in rows:
        row.samples["idle_cpu_fraction"] = [cpu]
        row.samples["polls_per_s"] = [poll_rate]
    return rows
