"""Async stress: thousands of tasks against one pool whose fences complete at random.

Worker tasks do random ``alloc`` sizes, priorities, timeouts and
cancellations (including the same-tick ``task.cancel(); pool.free(rows)``
race), ``lease`` bodies that raise, ``record_use`` and frees with and
without fences (ordered ``HostStream`` fences, ``after=stream``, and
fences of unknown origin that go through the pool's watcher thread). A clock
task launches gates on three ``HostStream``s and opens them, and the unknown
fences, at random moments, so fences complete out of order across streams.

A shadow model checks, on every grant, that no row is held by two owners,
that no row is granted while a fence it was freed behind is still open, and
that a granted row reads zero lengths; every ``CHECK_EVERY`` operations it
runs ``check_invariants()`` and cross-checks its owners against the pool.
At the end every row is back, nobody hangs, nothing is pending.

``ASYNCPOOL_STRESS_SCALE`` (default 1: 2*10^5 pool operations per loop)
scales the run for soak tests; ``ASYNCPOOL_STRESS_SEED`` changes the seed.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import threading
import time
from typing import Any

import pytest

from asyncpool import AsyncReqToTokenPool, HostStream

SCALE = float(os.environ.get("ASYNCPOOL_STRESS_SCALE") or "1")
TARGET_OPS = max(2_000, int(200_000 * SCALE))
SEED = int(os.environ.get("ASYNCPOOL_STRESS_SEED") or "20241129")
SIZE = 129  # capacity 128
NSTREAMS = 3
# Two phases: few workers (the pool mostly has rows: fast paths, try_alloc
# successes, immediate frees), then many (always contended: queues, grants at
# hand-over, timeouts, cancelled heads). Half the operations each.
PHASES = ((25, 0.5, 4, 2), (1_000, 1.0, SIZE - 1, 4))  # workers, ops share, max n, max held
MAX_OPEN_GATES = 6  # per stream
CHECK_EVERY = 250
# Generous: the suite runs in well under this per loop on 2 cores; a hang
# fails here instead of at pytest's global timeout.
BUDGET_S = 240 * max(1.0, SCALE)


class ShadowError(AssertionError):
    pass


class ManualFence:
    """A fence of unknown origin (no stream_key): the pool polls it in full."""

    __slots__ = ("_ev",)

    def __init__(self) -> None:
        self._ev = threading.Event()

    def query(self) -> bool:
        return self._ev.is_set()

    def synchronize(self) -> None:
        self._ev.wait()

    def set(self) -> None:
        self._ev.set()


class Boom(Exception):
    """Raised by lease bodies on purpose."""


class Harness:
    def __init__(self, pool: AsyncReqToTokenPool, streams: list[HostStream], seed: int) -> None:
        self.pool = pool
        self.cap = pool.capacity
        self.streams = streams
        self.seed = seed
        self.tokens = itertools.count(1)
        # shadow model
        self.owner: dict[int, int] = {}
        self.uses: dict[int, list[Any]] = {}
        self.waits: dict[int, list[tuple[Any, ...]]] = {}
        # stream gates: gate k on stream s sets passed[s] = k once it has run
        self.launched = [0] * len(streams)
        self.passed = [0] * len(streams)
        self.current: list[Any] = [None] * len(streams)
        self.open_gates: list[list[threading.Event]] = [[] for _ in streams]
        self.manual_open: list[ManualFence] = []
        self.manual_done = ManualFence()
        self.manual_done.set()
        # counters
        self.ops = 0
        self.counts: dict[str, int] = {}
        self.tasks_created = 0
        self.failures: list[str] = []
        self.stop = False
        self.target = TARGET_OPS
        self.max_n = self.cap
        self.max_held = 4
        self.done = False
        self.checks = 0

    # ---------------------------------------------------------------- shadow

    def count(self, what: str) -> None:
        self.ops += 1
        self.counts[what] = self.counts.get(what, 0) + 1
        if self.ops >= self.target:
            self.stop = True
        if self.ops % CHECK_EVERY == 0:
            self.check()

    def fail(self, msg: str) -> None:
        if len(self.failures) < 50:
            self.failures.append(msg)
        self.stop = True

    def grant(self, rows: list[int]) -> int:
        tok = next(self.tokens)
        if len(set(rows)) != len(rows):
            self.fail(f"grant {tok}: duplicate rows {rows}")
        for r in rows:
            if not 0 < r < SIZE:
                self.fail(f"grant {tok}: row {r} out of range")
            prev = self.owner.get(r)
            if prev is not None:
                self.fail(f"row {r} granted to {tok} while held by {prev}")
            for cond in self.waits.pop(r, ()):
                if cond[0] == "fence":
                    if not cond[1].query():
                        self.fail(f"row {r} granted to {tok} while its fence {cond[1]!r} is open")
                else:
                    _, s, k = cond
                    if self.passed[s] < k:
                        self.fail(
                            f"row {r} granted to {tok} before stream {s} ran past gate {k} "
                            f"(passed {self.passed[s]}): freed with after=stream"
                        )
            self.owner[r] = tok
            self.uses[r] = []
        lens = self.pool.verified_lens[rows].tolist()
        if any(lens):
            self.fail(f"grant {tok}: rows {rows} read verified_lens {lens}, not zero")
        self.pool.verified_lens[rows] = tok % 30_000 + 1
        return tok

    def release(
        self, tok: int, rows: list[int], fence: Any = None, after: int | None = None
    ) -> None:
        for r in rows:
            if self.owner.get(r) != tok:
                self.fail(f"row {r} freed by {tok} but owned by {self.owner.get(r)}")
            self.owner.pop(r, None)
            conds: list[tuple[Any, ...]] = [("fence", f) for f in self.uses.pop(r, ())]
            if fence is not None:
                conds.append(("fence", fence))
            if after is not None:
                conds.append(("gate", after, self.launched[after]))
            if conds:
                self.waits[r] = conds

    def check(self) -> None:
        self.checks += 1
        pool = self.pool
        try:
            pool.check_invariants()
        except AssertionError as exc:
            self.fail(f"check_invariants after {self.ops} ops: {exc}")
            return
        st = pool.stats()
        if st.free + st.allocated + st.pending + st.quarantined != st.capacity:
            self.fail(f"stats do not add up: {st}")
        if st.quarantined:
            self.fail(f"{st.quarantined} rows quarantined without any fault")
        if len(self.owner) > st.allocated:
            self.fail(f"shadow holds {len(self.owner)} rows, pool says {st.allocated} allocated")
        led = pool._ledger
        for r in self.owner:
            state = led.state_of(r)
            if state != "allocated":
                self.fail(f"row {r} held by {self.owner[r]} but the pool says {state}")

    # ---------------------------------------------------------------- fences

    def new_gate(self, rng: random.Random) -> None:
        s = rng.randrange(len(self.streams))
        if len(self.open_gates[s]) >= MAX_OPEN_GATES:
            return
        ev = threading.Event()
        k = self.launched[s] + 1
        self.streams[s].launch(_gate, ev, self.passed, s, k)
        self.launched[s] = k
        self.current[s] = self.streams[s].record()
        self.open_gates[s].append(ev)

    def open_random_gate(self, rng: random.Random) -> None:
        s = rng.randrange(len(self.streams))
        gates = self.open_gates[s]
        if gates:
            i = rng.randrange(len(gates))
            gates[i], gates[-1] = gates[-1], gates[i]
            gates.pop().set()

    def pick_fence(self, rng: random.Random) -> Any:
        x = rng.random()
        if x < 0.1:
            if self.manual_open and rng.random() < 0.7:
                return rng.choice(self.manual_open)
            return self.manual_done
        f = self.current[rng.randrange(len(self.streams))]
        return f if f is not None else self.manual_done

    def open_everything(self) -> None:
        for gates in self.open_gates:
            for ev in gates:
                ev.set()
            gates.clear()
        for mf in self.manual_open:
            mf.set()
        self.manual_open.clear()


def _gate(ev: threading.Event, passed: list[int], s: int, k: int) -> None:
    ev.wait()
    passed[s] = k


def pick_n(rng: random.Random, cap: int) -> int:
    x = rng.random()
    if x < 0.65:
        return 1
    if x < 0.88:
        return rng.randint(2, 4)
    if x < 0.98:
        return rng.randint(5, 16)
    if x < 0.998:
        return rng.randint(17, cap // 2)
    return cap


def pick_n_for(rng: random.Random, h: Harness) -> int:
    return min(pick_n(rng, h.cap), h.max_n)


async def clock(h: Harness) -> None:
    """Launch gates and open them (and unknown fences) at random moments."""
    rng = random.Random(h.seed)
    while not h.done:
        for _ in range(4):
            if rng.random() < 0.4:
                h.new_gate(rng)
            if rng.random() < 0.55:
                h.open_random_gate(rng)
            if rng.random() < 0.03 and len(h.manual_open) < 16:
                h.manual_open.append(ManualFence())
            if h.manual_open and rng.random() < 0.03:
                h.manual_open.pop(rng.randrange(len(h.manual_open))).set()
        if h.stop:
            h.open_random_gate(rng)  # wind down faster
        await asyncio.sleep(0)


async def worker(h: Harness, wid: int) -> None:
    rng = random.Random(h.seed * 1_000_003 + wid)
    pool = h.pool
    cap = h.cap
    held: list[tuple[int, list[int]]] = []

    def free_one(idx: int | None = None) -> None:
        i = rng.randrange(len(held)) if idx is None else idx
        tok, rows = held[i]
        mode = rng.random()
        if mode < 0.15 and len(rows) > 1:  # partial free
            k = rng.randint(1, len(rows) - 1)
            part, rest = rows[:k], rows[k:]
            h.count("free_partial")
            pool.free(part)
            h.release(tok, part)
            held[i] = (tok, rest)
            return
        held[i] = held[-1]
        held.pop()
        if mode < 0.55:
            h.count("free")
            pool.free(rows)
            h.release(tok, rows)
        elif mode < 0.80:
            f = h.pick_fence(rng)
            h.count("free_fence")
            pool.free(rows, fence=f)
            h.release(tok, rows, fence=f)
        else:
            s = rng.randrange(len(h.streams))
            h.count("free_after")
            pool.free(rows, after=h.streams[s])
            h.release(tok, rows, after=s)

    async def alloc(n: int, timeout: float | None) -> None:
        h.count("alloc")
        if pool.waiting() or pool.available_size() < n:
            h.counts["alloc_queued"] = h.counts.get("alloc_queued", 0) + 1
        try:
            rows = await pool.alloc(n, priority=rng.randrange(3), timeout=timeout)
        except TimeoutError:
            h.counts["timeouts_seen"] = h.counts.get("timeouts_seen", 0) + 1
            return
        held.append((h.grant(rows), rows))

    while not h.stop:
        op = rng.random()
        if op < 0.28:
            n = pick_n_for(rng, h)
            if held or n > cap // 4:
                timeout: float | None = rng.choice((0.0, 0.0005, 0.002, 0.01))
            else:
                timeout = rng.choice((None, None, None, 0.001, 0.01))
            await alloc(n, timeout)
        elif op < 0.36:
            h.count("try_alloc")
            rows = pool.try_alloc(pick_n_for(rng, h))
            if rows is not None:
                h.counts["try_alloc_hit"] = h.counts.get("try_alloc_hit", 0) + 1
                held.append((h.grant(rows), rows))
        elif op < 0.48:
            await lease_body(h, rng, bool(held))
        elif op < 0.56:
            await cancel_alloc(h, rng, held, free_one)
        elif op < 0.66:
            if held:
                _tok, rows = held[rng.randrange(len(held))]
                f = h.pick_fence(rng)
                h.count("record_use")
                pool.record_use(rows, f)
                for r in rows:
                    h.uses[r].append(f)
        elif held:
            free_one()
        if len(held) > h.max_held:
            free_one()
        if rng.random() < 0.6:
            await asyncio.sleep(0)
    while held:
        free_one(len(held) - 1)


async def lease_body(h: Harness, rng: random.Random, holding: bool) -> None:
    n = pick_n_for(rng, h)
    timeout = rng.choice((0.0, 0.002, 0.01)) if holding or n > h.cap // 4 else None
    s = rng.randrange(len(h.streams)) if rng.random() < 0.6 else None
    after = h.streams[s] if s is not None else None
    tok = None
    rows: list[int] = []
    h.count("lease")
    try:
        async with h.pool.lease(n, priority=rng.randrange(3), timeout=timeout, after=after) as rows:
            tok = h.grant(rows)
            if rng.random() < 0.5:
                f = h.pick_fence(rng)
                h.count("record_use")
                h.pool.record_use(rows, f)
                for r in rows:
                    h.uses[r].append(f)
            for _ in range(rng.randrange(3)):
                await asyncio.sleep(0)
            if rng.random() < 0.3:
                raise Boom
    except Boom:
        h.counts["lease_raised"] = h.counts.get("lease_raised", 0) + 1
    except TimeoutError:
        h.counts["timeouts_seen"] = h.counts.get("timeouts_seen", 0) + 1
    finally:
        # No suspension since the lease's __aexit__ freed the rows.
        if tok is not None:
            h.release(tok, rows, after=s)


async def cancel_alloc(h: Harness, rng: random.Random, held: list[Any], free_one: Any) -> None:
    """Cancel an alloc at a random point; sometimes free in the same tick."""
    pool = h.pool
    n = pick_n_for(rng, h)
    h.count("alloc_cancelled")
    task = asyncio.create_task(pool.alloc(n, priority=rng.randrange(3)))
    h.tasks_created += 1
    for _ in range(rng.randrange(4)):
        await asyncio.sleep(0)
    task.cancel()
    if held and rng.random() < 0.5:
        free_one()  # same tick as the cancel: the grant may land on the cancelled waiter
    try:
        rows = await task
    except asyncio.CancelledError:
        h.counts["cancelled"] = h.counts.get("cancelled", 0) + 1
        if asyncio.current_task().cancelling():  # type: ignore[union-attr]
            raise
        return
    held.append((h.grant(rows), rows))


async def test_async_stress(
    request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str], record_property: Any
) -> None:
    t0 = time.perf_counter()
    streams = [HostStream(f"stress-{i}") for i in range(NSTREAMS)]
    pool = AsyncReqToTokenPool(SIZE, 8)
    h = Harness(pool, streams, SEED)
    clock_task = asyncio.create_task(clock(h))
    h.tasks_created += 1
    workers: list[asyncio.Task[None]] = []
    results: list[BaseException | None] = []
    hung = False
    try:
        wid = 0
        for nworkers, share, max_n, max_held in PHASES:
            if h.failures:
                break
            h.max_n, h.max_held = max_n, max_held
            h.stop = False
            h.target = int(TARGET_OPS * share)
            workers = [asyncio.create_task(worker(h, wid + i)) for i in range(nworkers)]
            wid += nworkers
            h.tasks_created += nworkers
            try:
                async with asyncio.timeout(BUDGET_S):
                    results += await asyncio.gather(*workers, return_exceptions=True)
            except TimeoutError:
                hung = True
                for t in workers:
                    t.cancel()
                await asyncio.gather(*workers, return_exceptions=True)
                break
        errors = [r for r in results if isinstance(r, BaseException)]
        h.done = True
        await clock_task
        h.open_everything()
        async with asyncio.timeout(30):
            await pool.drain()
        h.check()
        st = pool.stats()
        leftover = pool.try_alloc(pool.capacity) if not hung else None
        if leftover is not None:
            pool.free(leftover)
    finally:
        h.done = True
        h.open_everything()
        if not clock_task.done():
            clock_task.cancel()
            await asyncio.gather(clock_task, return_exceptions=True)
        await pool.close()
        for s in streams:
            s.close()
    elapsed = time.perf_counter() - t0
    loop_name = request.node.callspec.id if hasattr(request.node, "callspec") else "?"
    summary = (
        f"stress[{loop_name}]: {h.ops} pool ops in {elapsed:.1f}s by {h.tasks_created} tasks; "
        f"allocs={st.allocs} frees={st.frees} deferred={st.deferred_frees} "
        f"reclaimed={st.reclaimed} timeouts={st.timeouts} cancellations={st.cancellations} "
        f"fences={sum(h.launched)} checks={h.checks} "
        f"counts={dict(sorted(h.counts.items()))}"
    )
    with capsys.disabled():
        print("\n" + summary)
    record_property("stress_ops", h.ops)
    record_property("stress_seconds", round(elapsed, 2))

    assert not hung, f"workers hung after {h.ops} ops: {summary}"
    assert not errors, errors[:3]
    assert not h.failures, "\n".join(h.failures[:10])
    assert h.ops >= TARGET_OPS
    assert not h.owner
    assert st.allocated == 0 and st.pending == 0 and st.quarantined == 0 and st.waiters == 0
    assert st.free == pool.capacity
    assert leftover is not None and sorted(leftover) == list(range(1, SIZE))
    # the run exercised what it claims to
    assert st.deferred_frees > 0 and st.reclaimed > 0
    assert st.timeouts > 0 and st.cancellations > 0 and st.wait_time.count > 0
    assert h.counts.get("lease_raised", 0) > 0
