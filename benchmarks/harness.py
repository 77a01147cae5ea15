"""Timing primitives shared by every benchmark.

Method (the same for every figure the benchmarks report):

* time with :func:`time.perf_counter_ns`, many operations per sample so the
  timer and loop overhead is amortised (:func:`calibrate` picks the count);
* interleave the subject and its references in one process and one event
  loop, rotating which goes first each round, so drift (turbo, other
  processes, allocator state) hits both alike;
* report the median of the *per-round* ratios, not the ratio of medians, plus
  the quartiles of those ratios as the spread.

Each benchmark is a coroutine function that runs inside whatever loop awaits
it. The runner gives each one a fresh ``asyncio`` or ``uvloop`` loop with
:func:`run_on`; the smoke tests await the same coroutines on the loops that
pytest-asyncio parametrizes.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

__all__ = [
    "CLOCKS",
    "Config",
    "Row",
    "Sampler",
    "Target",
    "Worker",
    "calibrate",
    "clock_of",
    "gathered",
    "interleave",
    "loop_factories",
    "median",
    "pool_worker",
    "quantiles",
    "run_on",
    "semaphore_worker",
]

T = TypeVar("T")

#: ``sampler(n)`` runs ``n`` operations and returns the nanoseconds they took
#: (it times itself, so it can leave its own setup out of the figure).
Sampler = Callable[[int], Awaitable[int]]


@dataclass(frozen=True)
class Config:
    """How long and how big each benchmark runs. See :data:`PRESETS`."""

    name: str = "default"
    #: "wall" (``perf_counter_ns``) or "cpu" (``thread_time_ns``: the CPU time
    #: of the benchmarking thread, which time stolen by other processes does not
    #: inflate; for single-threaded figures on a shared machine)
    clock: str = "wall"
    #: interleaved rounds per comparison (odd, so a median is one sample)
    rounds: int = 15
    #: target wall time of one sample (seconds); :func:`calibrate` sizes it
    sample_s: float = 0.02
    #: pool size (rows, slot 0 included) for the uncontended benchmarks
    size: int = 1024
    max_context_len: int = 1024
    #: rows per alloc in the batched benchmark
    batch_k: int = 64
    contended_tasks: int = 1000
    contended_rows: int = 64
    contended_rounds: int = 5
    #: admission (``--only admit``): pages per admit, pages of the uncontended
    #: pools (page 0 included), and grantable pages of the contended pool
    admit_pages: int = 16
    admit_num_pages: int = 4097
    contended_pages: int = 512
    #: decode growth: ``extend(row, 1)`` on a record this long (pages),
    #: against one of ``admit_pages``; extends per admitted record
    extend_record_pages: int = 16_384
    extend_chunk: int = 256
    #: a decode step's batch: rows grown one page each, per call or at once
    extend_batch_rows: int = 256
    #: KV groups (``--only groups``): the sliding-window group's pages per
    #: admission (the full group's are ``admit_pages``, the Mamba state's
    #: one), and the rows of a grouped decode step
    groups_window_pages: int = 4
    groups_batch_rows: int = 32
    #: batches of ``batch_k`` rows freed behind fences per fenced sample
    fenced_batches: int = 64
    reclaim_pending: tuple[int, ...] = (1, 10, 100, 1_000, 10_000)
    #: reclaim calls per "head completed" measurement round
    reclaim_head_samples: int = 200
    scaling_sizes: tuple[int, ...] = (256, 1_024, 4_096, 16_384, 65_536)
    scaling_context_len: int = 128
    wake_samples: int = 201
    #: how long a waiter idles on an open fence when measuring CPU burn (s);
    #: a window pays one loop wake-up (~0.1 ms), so shorter ones read higher
    idle_wait_s: float = 1.0
    #: slow fences of unknown origin kept open in the crowded wake-up benchmark
    slow_fences: int = 100
    #: how long after the waiter queues its fence completes (the watcher's
    #: poll backoff reaches its 1 ms cap in about 1.6 ms)
    wake_settle_s: float = 0.003
    #: scheduler_demo: requests per run, and rounds of (overlap, sync, unsafe)
    demo_requests: int = 200
    demo_repeats: int = 5
    demo_timeout_s: float = 120.0
    #: queued allocs and fence batches behind the metrics scrape benchmark
    metrics_samples: int = 10_000
    #: KV page allocators: pool size in pages (page 0 included, kept half
    #: allocated), token slots per page, and the alloc(n) sizes measured
    pages_num_pages: int = 32_768
    pages_page_size: int = 16
    pages_counts: tuple[int, ...] = (1, 16, 256)
    #: a decode step's allocator work (``--only decode``): running requests,
    #: the range their stored lengths are drawn from (seeded, [lo, hi)), pool
    #: size in pages (page 0 included), token slots a page, and steps per
    #: batch from the starting lengths (a multiple of the page size)
    decode_requests: int = 256
    decode_lens: tuple[int, int] = (16, 1_024)
    decode_num_pages: int = 32_768
    decode_page_size: int = 16
    decode_batch_steps: int = 256


PRESETS: dict[str, Config] = {
    "default": Config(),
    "quick": Config(
        name="quick",
        rounds=7,
        sample_s=0.01,
        reclaim_head_samples=100,
        wake_samples=101,
        idle_wait_s=0.5,
        demo_requests=100,
        demo_repeats=3,
    ),
    # For the smoke test: every code path, no meaningful timing.
    "smoke": Config(
        name="smoke",
        rounds=1,
        sample_s=0.0,
        size=128,
        max_context_len=16,
        batch_k=8,
        contended_tasks=20,
        contended_rows=4,
        admit_pages=2,
        admit_num_pages=65,
        contended_pages=8,
        extend_record_pages=64,
        extend_chunk=8,
        extend_batch_rows=4,
        groups_window_pages=1,
        groups_batch_rows=4,
        contended_rounds=2,
        fenced_batches=4,
        reclaim_pending=(1, 10),
        reclaim_head_samples=3,
        scaling_sizes=(16, 64),
        scaling_context_len=8,
        wake_samples=3,
        idle_wait_s=0.01,
        demo_requests=4,
        demo_repeats=1,
        demo_timeout_s=60.0,
        metrics_samples=50,
        pages_num_pages=1_024,
        decode_requests=8,
        decode_lens=(16, 64),
        decode_num_pages=1_024,
        decode_batch_steps=16,
    ),
}


CLOCKS: dict[str, Callable[[], int]] = {
    "wall": time.perf_counter_ns,
    "cpu": time.thread_time_ns,
}


def clock_of(cfg: Config) -> Callable[[], int]:
    """The nanosecond clock single-threaded samplers time themselves with."""
    return CLOCKS[cfg.clock]


@dataclass(frozen=True)
class Target:
    """A pass mark on a ratio: ``ratio >= value`` or ``ratio <= value``."""

    op: str
    value: float

    def met(self, ratio: float) -> bool:
        return ratio >= self.value if self.op == ">=" else ratio <= self.value

    def __str__(self) -> str:
        return f"{'≥' if self.op == '>=' else '≤'} {self.value:g}x"


@dataclass
class Row:
    """One comparison: a subject against a reference, measured in one run."""

    bench: str
    loop: str
    subject: str
    reference: str
    #: medians of the subject's and the reference's per-op figures (context)
    subject_value: float
    reference_value: float
    unit: str
    #: median of per-round ratios, oriented as ``ratio_label`` says
    ratio: float
    ratio_label: str
    ratio_p25: float = float("nan")
    ratio_p75: float = float("nan")
    target: Target | None = None
    note: str = ""
    samples: dict[str, list[float]] = field(default_factory=dict)

    @property
    def met(self) -> bool | None:
        return None if self.target is None else self.target.met(self.ratio)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Row:
        """Inverse of :meth:`to_json` (``met`` is recomputed)."""
        d = {k: v for k, v in d.items() if k != "met"}
        t = d.get("target")
        d["target"] = None if t is None else Target(t["op"], float(t["value"]))
        return cls(**d)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["target"] = (
            None if self.target is None else {"op": self.target.op, "value": self.target.value}
        )
        d["met"] = self.met
        return d


def pool_cycles(pool: Any, k: int, now: Callable[[], int]) -> Sampler:
    """A sampler timing ``n`` cycles of ``rows = await pool.alloc(k); pool.free(rows)``."""

    async def sample(n: int) -> int:
        alloc, free = pool.alloc, pool.free
        t0 = now()
        for _ in range(n):
            rows = await alloc(k)
            free(rows)
        return now() - t0

    return sample


#: A contended workload's task body: one task's few acquire/hold/release rounds.
Worker = Callable[[], Coroutine[Any, Any, None]]


def gathered(worker: Worker, tasks: int, now: Callable[[], int]) -> Sampler:
    """A sampler timing ``n`` times ``tasks`` copies of ``worker`` gathered."""

    async def sample(n: int) -> int:
        t0 = now()
        for _ in range(n):
            await asyncio.gather(*[worker() for _ in range(tasks)])
        return now() - t0

    return sample


def pool_worker(pool: Any, rounds: int) -> Worker:
    """``rounds`` times: ``rows = await pool.alloc(1)``, ``sleep(0)``, ``free``."""
    sleep = asyncio.sleep

    async def worker() -> None:
        alloc, free = pool.alloc, pool.free
        for _ in range(rounds):
            rows = await alloc(1)
            await sleep(0)
            free(rows)

    return worker


def semaphore_worker(sem: asyncio.Semaphore, rounds: int) -> Worker:
    """``rounds`` times: ``await sem.acquire()``, ``sleep(0)``, ``release``."""
    sleep = asyncio.sleep

    async def worker() -> None:
        acquire, release = sem.acquire, sem.release
        for _ in range(rounds):
            await acquire()
            await sleep(0)
            release()

    return worker


def seed_cycles(naive: Any, k: int, now: Callable[[], int]) -> Sampler:
    """The same cycles on the seed-style pool (synchronous, never short)."""

    async def sample(n: int) -> int:
        alloc, free = naive.alloc, naive.free
        t0 = now()
        for _ in range(n):
            rows = alloc(k)
            assert rows is not None
            free(rows)
        return now() - t0

    return sample


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def quantiles(xs: Sequence[float]) -> tuple[float, float]:
    """The 25th and 75th percentiles (both = the value for one sample)."""
    if not xs:
        return float("nan"), float("nan")
    if len(xs) == 1:
        return float(xs[0]), float(xs[0])
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return float(q[0]), float(q[2])


async def calibrate(
    sampler: Sampler, target_s: float, *, start: int = 16, max_n: int = 10_000_000
) -> int:
    """Pick ``n`` so that ``sampler(n)`` takes about ``target_s`` seconds.

    Doubles ``n`` until a sample takes a tenth of the target, then scales.
    This also serves as the warm-up. ``target_s == 0`` returns ``start``.
    """
    n = start
    if target_s <= 0:
        return n
    target_ns = target_s * 1e9
    while True:
        elapsed = await sampler(n)
        if elapsed >= target_ns / 10 or n >= max_n:
            break
        n *= 2
    return max(1, min(max_n, int(n * target_ns / max(elapsed, 1))))


async def interleave(
    samplers: dict[str, Sampler],
    *,
    rounds: int,
    target_s: float,
    ops_per_call: dict[str, int] | None = None,
    disable_gc: bool = True,
    start: int = 16,
) -> dict[str, list[float]]:
    """Sample every sampler once per round, rotating the order each round.

    Returns nanoseconds per operation, one figure per round, per sampler.
    ``ops_per_call[name]`` divides further (e.g. rows per ``alloc(64)``).
    The garbage collector is off while a sample runs (as :mod:`timeit`
    does) and collects between samples, so no sample pays for another's
    garbage.
    """
    names = list(samplers)
    counts = {name: await calibrate(samplers[name], target_s, start=start) for name in names}
    per_op: dict[str, list[float]] = {name: [] for name in names}
    gc_was_enabled = gc.isenabled()
    try:
        for r in range(rounds):
            k = r % len(names)
            for name in names[k:] + names[:k]:
                n = counts[name]
                gc.collect()
                if disable_gc:
                    gc.disable()
                try:
                    elapsed = await samplers[name](n)
                finally:
                    if gc_was_enabled:
                        gc.enable()
                div = n * (ops_per_call or {}).get(name, 1)
                per_op[name].append(elapsed / div)
    finally:
        if gc_was_enabled:
            gc.enable()
    return per_op


def compare(
    per_op: dict[str, list[float]],
    *,
    bench: str,
    loop: str,
    subject: str,
    reference: str,
    unit: str,
    speedup: bool,
    target: Target | None = None,
    note: str = "",
    subject_label: str | None = None,
    reference_label: str | None = None,
) -> Row:
    """Build a :class:`Row` from interleaved samples of two samplers.

    ``speedup=True`` reports ``reference / subject`` (how many times faster
    the subject is); otherwise ``subject / reference`` (its relative cost).
    """
    s, r = per_op[subject], per_op[reference]
    ratios = [(b / a) if speedup else (a / b) for a, b in zip(s, r, strict=True)]
    p25, p75 = quantiles(ratios)
    return Row(
        bench=bench,
        loop=loop,
        subject=subject_label or subject,
        reference=reference_label or reference,
        subject_value=median(s),
        reference_value=median(r),
        unit=unit,
        ratio=median(ratios),
        ratio_label="speed-up (ref/subject)" if speedup else "cost (subject/ref)",
        ratio_p25=p25,
        ratio_p75=p75,
        target=target,
        note=note,
        samples={subject: list(s), reference: list(r), "ratios": ratios},
    )


def loop_factories() -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    """The event loops the benchmarks run on: asyncio, and uvloop if present."""
    factories: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
        "asyncio": asyncio.new_event_loop,
    }
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        pass
    else:
        factories["uvloop"] = uvloop.new_event_loop
    return factories


def add_loop_option(parser: argparse.ArgumentParser) -> None:
    """The ``--loop`` option of a benchmark's command line: one of
    :func:`loop_factories`' names, repeatable; none given means all."""
    parser.add_argument(
        "--loop",
        action="append",
        choices=sorted(loop_factories()),
        help="a loop to run on (repeatable; default: all)",
    )


def run_on(kind: str, main: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run ``main()`` to completion on a fresh loop of ``kind``, then close it."""
    loop = loop_factories()[kind]()
    try:
        return loop.run_until_complete(main())
    finally:
        try:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            loop.close()


def loop_name() -> str:
    """``"uvloop"`` or ``"asyncio"``: the kind of the running loop."""
    loop = asyncio.get_running_loop()
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"
