"""A soak: the pool's whole surface for millions of operations, looking for
bookkeeping that grows.

``python -m benchmarks.soak --ops 2000000 --rounds 20`` runs, on each loop
named (both by default), three pools on one forward ``HostStream`` (rows
only; a ``KVPagePool``; two KV groups), each driven by an overlap
scheduler's steps: ``admit`` / ``try_admit`` / ``alloc`` / ``try_alloc`` /
``lease`` and ``alloc_threadsafe`` from a frontend thread (priorities,
timeouts, cancels), ``extend`` / ``extend_rows`` / ``extend_fitting``
(retracting what does not fit), ``record_use`` once a step, ``free`` behind
the step and behind transfer handles of unknown origin (polled by the
watcher; some answer done on its thread before the loop's), ``trim_pages``,
``drop_pages``, ``detach_pages`` and the page pool's own ``alloc`` / ``free``
(a prefix cache), a stream used once per connection, transfers that hang
(overdue past ``fence_timeout``, then ``force_release``), ``hold_grants``,
``stats()`` and a ``PoolCollector`` scraped; per round, pools built, faulted
(quarantine), exported, closed and dropped.

After each round, at a quiet point (every request freed, every fence
completed, the pools drained, ``release_memory`` / ``resume_memory``), it
records the length of every container reachable from the pools, their page
pools, the collector and the forward stream (``vars()`` and slots, three
attributes down: ledgers, waiter queues, the fence watcher, the overdue
check, the figures) and of the library's module-level containers, the
count of the library's live objects by type, threads, RSS and, with
``--tracemalloc``, the traced size and the allocation sites that grew the
most since the round before. A deque with a ``maxlen`` (a recent window:
fence latencies, waits) is reported against its bound, not as growth; any
other container longer at the last round than at the second is growth, and
so is a library object or a thread left after the pools closed. Exit status
1 then. A measurement aid, not part of ``python -m benchmarks``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import dataclasses
import functools
import gc
import logging
import random
import sys
import threading
import time
import tracemalloc
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from .harness import add_loop_option, loop_factories, run_on

__all__ = ["Round", "Soak", "grown", "main", "soak"]

_PRIORITIES = (-1, 0, 1, 2)
_CONTAINERS = (
    dict,
    list,
    set,
    frozenset,
    collections.deque,
    weakref.WeakSet,
    weakref.WeakKeyDictionary,
    weakref.WeakValueDictionary,
)


@dataclasses.dataclass
class Round:
    """The figures of one quiet point."""

    ops: int  # pool calls so far
    grants: int  # rows granted so far
    seconds: float
    rss_kb: int
    traced_kb: int | None  # tracemalloc's traced size (None: not tracing)
    threads: int
    sizes: dict[str, int]  # container path -> length (windows excluded)
    windows: dict[str, tuple[int, int]]  # deque with a maxlen -> (length, maxlen)
    objects: dict[str, int]  # the library's live objects by type
    top: list[str]  # tracemalloc: the sites that grew most since the round before


@dataclasses.dataclass
class Soak:
    """A whole run: its rounds, and what was left once the pools closed."""

    rounds: list[Round]
    watchers_idle: list[str]  # fence watcher threads still running, the pools idle 10 s
    threads_left: list[str]  # threads other than the caller's, after close
    objects_left: dict[str, int]  # pools, page pools, streams, watchers more than before
    touched: dict[str, int]  # the paths taken: stats() totals over the pools, and more
    overdue: int  # fences found overdue and force-released (by time: may be 0 in a short run)


class Handle:
    """A transfer handle of unknown origin: done once the driver says so;
    ``fault`` makes ``query()`` raise (quarantine). ``flaky``: done on the
    watcher's thread a few queries before the loop's sees it."""

    __slots__ = ("__weakref__", "done", "fault", "flaky", "loop_thread")

    def __init__(self, flaky: bool = False) -> None:
        self.done = False
        self.fault = False
        self.flaky = 3 if flaky else 0
        self.loop_thread = threading.get_ident()

    def query(self) -> bool:
        if self.fault:
            raise RuntimeError("peer died (simulated)")
        if self.flaky and self.done and threading.get_ident() == self.loop_thread:
            self.flaky -= 1
            return False
        return self.done

    def synchronize(self) -> None:
        while not self.done:
            if self.fault:
                raise RuntimeError("peer died (simulated)")
            time.sleep(0.001)


def _noop() -> None:
    pass


def _lib(obj: object) -> bool:
    mod = type(obj).__module__
    return isinstance(mod, str) and mod.startswith("asyncpool")


def _walk(
    obj: object,
    path: str,
    depth: int,
    sizes: dict[str, int],
    windows: dict[str, tuple[int, int]],
    seen: set[int],
) -> None:
    """Record the length of every container reachable from ``obj`` through
    ``depth`` attributes (a container's library-object elements count as
    one level, the first 8 of them)."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, _CONTAINERS):
        n = len(obj)
        if isinstance(obj, collections.deque) and obj.maxlen is not None:
            windows[path] = (n, obj.maxlen)
        else:
            sizes[path] = n
        if depth <= 0:
            return
        values: list[object] = list(obj.values() if isinstance(obj, dict) else obj)[:8]
        for i, v in enumerate(values):
            if _lib(v):
                _walk(v, f"{path}[{i}]", depth - 1, sizes, windows, seen)
        return
    attrs: dict[str, object] = dict(getattr(obj, "__dict__", {}))
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if name not in ("__weakref__", "__dict__") and hasattr(obj, name):
                attrs[name] = getattr(obj, name)
    for name, v in attrs.items():
        if isinstance(v, _CONTAINERS):
            _walk(v, f"{path}.{name}", depth, sizes, windows, seen)
        elif isinstance(v, tuple):
            for i, e in enumerate(v[:8]):
                if _lib(e) and depth > 0:
                    _walk(e, f"{path}.{name}[{i}]", depth - 1, sizes, windows, seen)
        elif _lib(v) and depth > 0:
            _walk(v, f"{path}.{name}", depth - 1, sizes, windows, seen)


def structures(roots: dict[str, object]) -> tuple[dict[str, int], dict[str, tuple[int, int]]]:
    """The lengths of the containers reachable from ``roots`` (3 attributes
    down) and of every ``asyncpool`` module's own: ``(sizes, windows)``."""
    sizes: dict[str, int] = {}
    windows: dict[str, tuple[int, int]] = {}
    seen: set[int] = set()
    for name, root in roots.items():
        _walk(root, name, 3, sizes, windows, seen)
    for modname, mod in sorted(sys.modules.items()):
        if modname.split(".")[0] != "asyncpool":
            continue
        for name, v in list(vars(mod).items()):
            if name.startswith("__") or isinstance(v, type) or callable(v):
                continue
            if isinstance(v, _CONTAINERS) or _lib(v):
                _walk(v, f"{modname}.{name}", 2, sizes, windows, seen)
    return sizes, windows


def library_objects() -> dict[str, int]:
    """The library's live objects (the cyclic GC's view), by type."""
    counts: collections.Counter[str] = collections.Counter()
    for obj in gc.get_objects():
        if _lib(obj):
            counts[type(obj).__qualname__] += 1
    return dict(counts)


def _rss_kb() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:  # not Linux
        pass
    return 0


def grown(result: Soak, since: int = 2) -> dict[str, tuple[int, int]]:
    """The containers longer at the last round than at round ``since``
    (1-based): path -> (then, last). A path missing from a round reads 0."""
    first, last = result.rounds[since - 1].sizes, result.rounds[-1].sizes
    return {k: (first.get(k, 0), v) for k, v in last.items() if v > first.get(k, 0)}


#: The library objects the soak makes that must not outlive it.
_OWNERS = ("AsyncReqToTokenPool", "KVPagePool", "HostStream", "FenceWatcher")

_TOUCHED = (
    "admits",
    "allocs",
    "timeouts",
    "cancellations",
    "deferred_frees",
    "growth_refusals",
    "force_released",
    "rejections",
)


class _Tally:
    def __init__(self) -> None:
        self.ops = 0
        self.grants = 0
        self.faulted = 0  # pools built to quarantine a faulted transfer
        self.streams = 0  # streams used once
        self.holds = 0  # hold_grants() holds taken
        self.overdue = 0  # overdue fences force-released (timing: not always in a short run)


class _Engine:
    """An overlap scheduler over one pool, one step at a time.

    ``kind``: ``"rows"`` (alloc, no pages), ``"paged"`` (a ``KVPagePool``;
    overdue transfers, the page pool's own calls) or ``"hybrid"`` (KV
    groups ``full`` and ``swa``; the swa window's pages dropped)."""

    def __init__(
        self,
        pool: Any,
        kind: str,
        fwd: Any,
        rng: random.Random,
        tally: _Tally,
        frontend: concurrent.futures.ThreadPoolExecutor,
    ) -> None:
        self.pool, self.kind, self.fwd, self.rng, self.t = pool, kind, fwd, rng, tally
        self.frontend = frontend
        self.running: dict[int, list[int]] = {}  # row -> [tokens, swa positions]
        self.waiting: list[asyncio.Future[Any]] = []
        self.submitted: list[concurrent.futures.Future[list[int]]] = []
        self.handles: list[tuple[int, Handle]] = []  # (step due, handle)
        self.stuck: list[Handle] = []
        self.cached: list[tuple[Any, Any]] = []  # (page pool, pages): a prefix cache
        self.hold: Any = None
        self.step_no = 0

    def _counts(self, n: int) -> Any:
        return {"full": n, "swa": min(n, 2)} if self.kind == "hybrid" else n

    def _run(self, row: int, pages: int) -> None:
        self.t.grants += 1
        self.running[row] = [self.rng.randint(16, 200), min(pages, 2)]

    def _granted(self, got: Any) -> None:
        if isinstance(got, list):
            for row in got:
                self._run(row, 0)
        elif got is not None:
            pages = got.pages
            n = len(pages["swa"]) if isinstance(pages, dict) else len(pages)
            self._run(got.row, n)

    async def _lease(self) -> None:
        async with self.pool.lease(1, timeout=0.01, after=self.fwd):
            self.t.grants += 1
            await asyncio.sleep(0)

    def _arrivals(self) -> None:
        pool, rng, t = self.pool, self.rng, self.t
        for _ in range(rng.randint(0, 3)):
            x = rng.random()
            t.ops += 1
            prio = rng.choice(_PRIORITIES)
            timeout = rng.choice((None, 0.0005, 0.002, 0.05))
            try:
                if self.kind == "rows":
                    if x < 0.3:
                        self._granted(pool.try_alloc(rng.randint(1, 3), priority=prio))
                    elif x < 0.7 and len(self.waiting) < 12:
                        n = rng.randint(1, 3)
                        self.waiting.append(
                            asyncio.ensure_future(pool.alloc(n, priority=prio, timeout=timeout))
                        )
                    elif x < 0.8 and len(self.waiting) < 12:
                        self.waiting.append(asyncio.ensure_future(self._lease()))
                    elif len(self.submitted) < 8:
                        # An API server's thread submits; the loop grants.
                        call = functools.partial(pool.alloc_threadsafe, 1, timeout=0.05)
                        self.submitted.append(self.frontend.submit(call).result())
                    continue
                pages = self._counts(rng.randint(1, 12))
                got = pool.try_admit(pages, priority=rng.choice((None, prio)))
                if got is not None:
                    self._granted(got)
                elif len(self.waiting) < 40:
                    self.waiting.append(
                        asyncio.ensure_future(pool.admit(pages, priority=prio, timeout=timeout))
                    )
            except Exception as exc:  # PoolBusyError: load shed
                if type(exc).__name__ != "PoolBusyError":
                    raise

    def _collect(self) -> None:
        still = []
        for fut in self.waiting:
            if not fut.done():
                still.append(fut)
            elif not fut.cancelled() and fut.exception() is None:
                self._granted(fut.result())
        self.waiting = still
        left = []
        for cf in self.submitted:
            if not cf.done():
                left.append(cf)
            elif not cf.cancelled() and cf.exception() is None:
                self._granted(cf.result())
        self.submitted = left
        if self.waiting and self.rng.random() < 0.1:
            self.waiting[self.rng.randrange(len(self.waiting))].cancel()
        if self.submitted and self.rng.random() < 0.1:
            self.submitted[self.rng.randrange(len(self.submitted))].cancel()

    def _grow(self) -> None:
        pool, rng, t, running = self.pool, self.rng, self.t, self.running
        rows = list(running)
        for state in running.values():
            state[0] += 1
        if self.kind == "rows" or not rows:
            return
        grow = [r for r in rows if running[r][0] % 16 == 0]
        if grow:
            t.ops += 1
            m, _ = pool.extend_fitting(grow, self._counts(1))
            for r in grow[:m]:
                running[r][1] += 1
            for r in grow[m:]:  # retracted
                t.ops += 1
                pool.free(r)
                del running[r]
        if running and rng.random() < 0.1:
            some = list(running)[:3]
            t.ops += 1
            if self.kind == "hybrid":
                if pool.extend(some[0], self._counts(1)) is not None:
                    running[some[0]][1] += 1
                state = running[some[0]]
                if state[1] > 2:  # the window slid: its first pages go
                    t.ops += 1
                    pool.drop_pages([some[0]], state[1] - 1, group="swa")
            else:
                pool.extend_rows(some, 1 if rng.random() < 0.5 else [1] * len(some))
                t.ops += 1
                got = pool.kv.alloc(2, host=rng.random() < 0.5)
                if got is not None:
                    self.cached.append((pool.kv, got))

    def _finish(self, fence: Any) -> None:
        pool, rng, t, s = self.pool, self.rng, self.t, self.step_no
        for r in list(self.running):
            x = rng.random()
            if x < 0.04:
                t.ops += 1
                pool.free(r)
                del self.running[r]
            elif x < 0.05:  # aborted while its transfer is on its way
                h = Handle(flaky=rng.random() < 0.3)
                self.handles.append((s + rng.randint(1, 30), h))
                t.ops += 1
                pool.free([r], fence=[fence, h] if rng.random() < 0.5 else h)
                del self.running[r]
            elif self.kind == "rows":
                continue
            elif x < 0.055:  # speculative rollback
                t.ops += 1
                group = "full" if self.kind == "hybrid" else None
                pool.trim_pages([r], 1, group=group)
            elif x < 0.058:  # into a prefix cache
                t.ops += 1
                group = "full" if self.kind == "hybrid" else None
                kv = pool.kv if group is None else pool.kv_groups[group]
                self.cached.append((kv, pool.detach_pages(r, host=True, group=group)))
        if self.kind == "paged" and s % 25 == 0 and self.running:  # a transfer that hangs
            h = Handle()
            self.stuck.append(h)
            r = next(iter(self.running))
            t.ops += 1
            pool.free([r], fence=h)
            del self.running[r]
        if self.running and rng.random() < 0.01:  # a connection's stream, used once
            r = next(iter(self.running))
            stream = type(self.fwd)(f"conn{s}")
            with stream:
                stream.launch(_noop)
                t.ops += 1
                t.streams += 1
                pool.free([r], after=stream)
            del self.running[r]
        while len(self.cached) > 8:  # evicted behind this step
            kv, pages = self.cached.pop(0)
            t.ops += 1
            kv.free(pages, fence=fence)

    async def step(self) -> None:
        pool, rng, t = self.pool, self.rng, self.t
        self.step_no += 1
        s = self.step_no
        self._collect()
        self._arrivals()
        if self.hold is not None:
            self.hold.release()
            self.hold = None
            t.ops += 1
        elif rng.random() < 0.02:
            self.hold = pool.hold_grants(warn_after=None)
            t.ops += 1
            t.holds += 1
        self._grow()
        self.fwd.launch(_noop)
        fence = self.fwd.record()
        if self.running:
            t.ops += 1
            pool.record_use(list(self.running), fence)
        self._finish(fence)
        keep = []
        for due, h in self.handles:
            if due <= s:
                h.done = True
            else:
                keep.append((due, h))
        self.handles = keep
        if self.stuck and s % 10 == 0:
            t.ops += 1
            over = pool.overdue_fences()
            if over:
                t.overdue += len(over)
                t.ops += 1
                pool.force_release(over)
                dead = {id(f) for f in over}
                self.stuck = [h for h in self.stuck if id(h) not in dead]
        if s % 10 == 0:
            t.ops += 1
            pool.stats()
        await asyncio.sleep(0)

    async def quiesce(self) -> None:
        """Everything freed, every fence completed, nothing pending."""
        pool = self.pool
        if self.hold is not None:
            self.hold.release()
            self.hold = None
        for fut in self.waiting:
            fut.cancel()
        for cf in self.submitted:
            cf.cancel()
        waits = [*self.waiting, *(asyncio.wrap_future(cf) for cf in self.submitted)]
        for done in await asyncio.gather(*waits, return_exceptions=True):
            if isinstance(done, list):
                self.running.update((row, [0, 0]) for row in done)
            elif done is not None and not isinstance(done, BaseException):
                self.running[done.row] = [0, 0]
        self.waiting, self.submitted = [], []
        if self.running:
            pool.free(list(self.running), after=self.fwd)
        self.running.clear()
        for kv, pages in self.cached:
            kv.free(pages, after=self.fwd)
        self.cached.clear()
        for _, h in self.handles:
            h.done = True
        self.handles.clear()
        if self.stuck:
            pool.force_release(list(self.stuck))
            self.stuck.clear()
        await pool.drain()
        await pool.release_memory()
        await pool.resume_memory()
        st = pool.stats(summaries=False)
        if st.allocated or st.pending or st.pages_allocated or st.pages_pending:
            raise AssertionError(f"not quiet after a round: {pool!r}")


def _watcher_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if "fence-watcher" in t.name)


async def _one(pool: Any, priority: int) -> int:
    """One row (and a page a group) at ``priority``; the row."""
    if pool.kv_groups:
        return int((await pool.admit({"full": 1, "swa": 1}, priority=priority)).row)
    if pool.kv is not None:
        return int((await pool.admit(1, priority=priority)).row)
    return int((await pool.alloc(1, priority=priority))[0])


async def _settled(pools: Sequence[Any], bound_s: float = 5.0) -> None:
    """Until each pool's fence watcher polls nothing and holds no fence it
    let go of for the pool to take (its last pass and the wake-up after it
    run behind the drain): the quiet point. At most ``bound_s``; a watcher
    still busy then is measured as it is."""
    deadline = time.perf_counter() + bound_s
    while time.perf_counter() < deadline:
        watchers = [pool._wakeups.watcher for pool in pools]
        if all(w is None or not (w._polled or w.dropped) for w in watchers):
            return
        await asyncio.sleep(0.001)


async def _faults(collector: Any, tally: _Tally) -> None:
    """A pool built, exported, faulted (quarantine), closed and dropped."""
    from asyncpool import AsyncReqToTokenPool, HostStream, KVPagePool

    pool = AsyncReqToTokenPool(9, 256, kv=KVPagePool(33, 16), fence_timeout=0.01, name="brief")
    collector.add(pool)
    grant = await pool.admit(2)
    h = Handle()
    pool.free(grant.row, fence=h)
    h.fault = True
    await pool.drain()
    with HostStream() as once:
        pool.free((await pool.admit(1)).row, after=once)
        await pool.drain()
    for _ in collector.collect():
        pass
    collector.remove("brief")
    await pool.close()
    tally.ops += 6
    tally.faulted += pool.stats(summaries=False).quarantined


async def soak(
    ops: int,
    rounds: int,
    *,
    seed: int = 0,
    trace: bool = False,
    on_pool: Callable[[Any], object] | None = None,
    report: Callable[[Round], object] | None = None,
) -> Soak:
    """Run about ``ops`` pool calls in ``rounds`` rounds on the running
    loop; the figures of each round's quiet point, and what outlived the
    pools. ``on_pool(pool)`` sees each long-lived pool once built (a test
    installs a leak there); ``report(round)`` sees each round as it ends.
    ``trace``: tracemalloc's figures (started here if not tracing)."""
    from asyncpool import AsyncReqToTokenPool, HostStream, KVPagePool
    from asyncpool.metrics import PoolCollector

    started = False
    if trace and not tracemalloc.is_tracing():
        tracemalloc.start(1)
        started = True
    threads_before = set(threading.enumerate())
    gc.collect()
    objects_before = library_objects()  # others' in this process (a test suite's)
    rng = random.Random(seed)
    tally = _Tally()
    frontend = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="soak-frontend")
    fwd = HostStream("forward")
    pools = {
        "rows": AsyncReqToTokenPool(17, 256, max_waiters=8, name="rows"),
        "paged": AsyncReqToTokenPool(
            33,
            4096,
            kv=KVPagePool(257, 16),
            stream=fwd,
            max_waiters=64,
            fence_timeout=0.005,
            name="paged",
        ),
        "hybrid": AsyncReqToTokenPool(
            25, 4096, kv={"full": KVPagePool(201, 16), "swa": KVPagePool(65, 16)}, name="hybrid"
        ),
    }
    collector = PoolCollector()
    for pool in pools.values():
        collector.add(pool)
        if on_pool is not None:
            on_pool(pool)
    engines = [_Engine(pool, kind, fwd, rng, tally, frontend) for kind, pool in pools.items()]
    # Every priority queues once first, so each keeps its figures from round 1.
    for pool in pools.values():
        hold = pool.hold_grants(warn_after=None)
        calls = [asyncio.ensure_future(_one(pool, p)) for p in _PRIORITIES]
        await asyncio.sleep(0)
        hold.release()
        for row in await asyncio.gather(*calls):
            pool.free(row)
    roots: dict[str, object] = {**pools, "collector": collector, "forward": fwd}
    out: list[Round] = []
    per_round = max(1, ops // rounds)
    t0 = time.perf_counter()
    prev: tracemalloc.Snapshot | None = None
    try:
        for _ in range(rounds):
            target = tally.ops + per_round
            while tally.ops < target:
                for engine in engines:
                    await engine.step()
                if engines[0].step_no % 20 == 0:
                    tally.ops += 1
                    for _ in collector.collect():
                        pass
            await _faults(collector, tally)
            for engine in engines:
                await engine.quiesce()
            await _settled(list(pools.values()))
            for _ in collector.collect():
                pass
            gc.collect()
            sizes, windows = structures(roots)
            top: list[str] = []
            traced = None
            if tracemalloc.is_tracing():
                traced = tracemalloc.get_traced_memory()[0] // 1024
                snap = tracemalloc.take_snapshot().filter_traces(
                    [tracemalloc.Filter(False, tracemalloc.__file__)]
                )
                if prev is not None:
                    top = [
                        f"{stat.traceback[0].filename.rsplit('/', 1)[-1]}:"
                        f"{stat.traceback[0].lineno} {stat.size_diff:+d} B"
                        for stat in snap.compare_to(prev, "lineno")[:5]
                    ]
                prev = snap
            one = Round(
                tally.ops,
                tally.grants,
                time.perf_counter() - t0,
                _rss_kb(),
                traced,
                threading.active_count(),
                sizes,
                windows,
                library_objects(),
                top,
            )
            out.append(one)
            if report is not None:
                report(one)
        # Idle, the fence watchers' threads end (after about a second).
        for _ in range(1000):  # at most 10 s: threads have no event to await
            if not _watcher_threads():
                break
            await asyncio.sleep(0.01)
        idle = _watcher_threads()
        touched: dict[str, int] = collections.Counter()
        for pool in pools.values():
            st = pool.stats(summaries=False)
            for name in _TOUCHED:
                touched[name] += getattr(st, name)
        touched["faulted"] = tally.faulted
        touched["streams_once"] = tally.streams
        touched["grant_holds"] = tally.holds
    finally:
        for pool in pools.values():
            await pool.close()
        fwd.close()
        frontend.shutdown()
        if started:
            tracemalloc.stop()
    del pools, pool, engines, engine, roots, collector, fwd, prev
    left: list[str] = []
    for _ in range(200):  # the watcher's threads end once idle
        gc.collect()
        left = [t.name for t in threading.enumerate() if t not in threads_before]
        if not left:
            break
        await asyncio.sleep(0.02)
    alive = {
        k: v - objects_before.get(k, 0)
        for k, v in library_objects().items()
        if k in _OWNERS and v > objects_before.get(k, 0)
    }
    return Soak(out, idle, left, alive, dict(touched), tally.overdue)


def _line(kind: str, i: int, r: Round) -> str:
    traced = "" if r.traced_kb is None else f" traced {r.traced_kb:,} KiB"
    return (
        f"{kind} round {i:3d}: {r.ops:>10,} ops {r.grants:>9,} grants {r.seconds:7.1f} s "
        f"RSS {r.rss_kb:,} KiB{traced} threads {r.threads} "
        f"objects {sum(r.objects.values())}" + (f"  top: {'; '.join(r.top[:3])}" if r.top else "")
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.soak",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_loop_option(p)
    p.add_argument("--ops", type=int, default=2_000_000, help="pool calls a loop")
    p.add_argument("--rounds", type=int, default=20, help="quiet points (at least 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tracemalloc", action="store_true", help="trace (about 3x slower)")
    args = p.parse_args(argv)
    if args.rounds < 3 or args.ops < args.rounds:
        p.error("--rounds must be at least 3 and --ops at least --rounds")
    # Overdue transfers, force_release() and faults log a line each, by design;
    # the level is put back however the run ends (main() runs inside tests too).
    log = logging.getLogger("asyncpool")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        failed = False
        for kind in args.loop or list(loop_factories()):
            count = iter(range(1, args.rounds + 1))

            def show(r: Round, kind: str = kind, count: Any = count) -> None:
                print(_line(kind, next(count), r), flush=True)

            result = run_on(
                kind,
                functools.partial(
                    soak, args.ops, args.rounds, seed=args.seed, trace=args.tracemalloc, report=show
                ),
            )
            last = result.rounds[-1]
            paths = ", ".join(f"{k} {v:,}" for k, v in result.touched.items())
            print(f"{kind}: {paths}, overdue released {result.overdue:,}")
            full = sorted(k for k, (n, cap) in last.windows.items() if n == cap)
            print(f"{kind}: {len(last.sizes)} containers tracked; windows full: {len(full)}")
            growth = grown(result)
            for path, (then, now) in sorted(growth.items()):
                print(f"{kind}: GREW {path}: {then} at round 2 -> {now} at round {args.rounds}")
            first = result.rounds[1].objects
            more = {k: (first.get(k, 0), v) for k, v in last.objects.items() if v > first.get(k, 0)}
            if more:  # a watcher started or not yet ended: reported, not failed
                print(f"{kind}: library objects more at the last round than at round 2: {more}")
            if result.watchers_idle:
                print(f"{kind}: fence watcher threads still running, idle: {result.watchers_idle}")
            if result.threads_left or result.objects_left:
                print(f"{kind}: LEFT after close: {result.threads_left} {result.objects_left}")
            failed = failed or bool(
                growth or result.watchers_idle or result.threads_left or result.objects_left
            )
            if not growth:
                print(f"{kind}: no container grew from round 2 to round {args.rounds}")
    finally:
        log.setLevel(level)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
