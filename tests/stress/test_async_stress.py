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
import time
from typing import Any

import pytest
from harness import Cond, ShadowBase, loop_id, run_phases, show

from asyncpool import AsyncReqToTokenPool, HostStream, PoolStats

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
MAX_MANUAL = 16  # fences of unknown origin open at once
MANUAL_SHARE = 0.1  # of the fences picked: of unknown origin
CHECK_EVERY = 250
# Generous: the suite runs in well under this per loop on 2 cores; a hang
# fails here instead of at pytest's global timeout.
BUDGET_S = 240 * max(1.0, SCALE)


class ShadowError(AssertionError):
    pass


class Boom(Exception):
    """Raised by lease bodies on purpose."""


class Harness(ShadowBase):
    """The shadow model: who holds which row, and what each freed row waits for."""

    def __init__(self, pool: AsyncReqToTokenPool, streams: list[HostStream], seed: int) -> None:
        super().__init__(
            pool,
            streams,
            seed=seed,
            target=TARGET_OPS,
            check_every=CHECK_EVERY,
            max_open_gates=MAX_OPEN_GATES,
            max_manual=MAX_MANUAL,
            manual_share=MANUAL_SHARE,
        )
        self.cap = pool.capacity
        self.tokens = itertools.count(1)
        # shadow model
        self.owner: dict[int, int] = {}
        self.waits: dict[int, list[Cond]] = {}
        self.max_n = self.cap
        self.max_held = 4

    # ---------------------------------------------------------------- shadow

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
            self.check_conds(f"row {r}", tok, self.waits.pop(r, ()))
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
            conds = self.row_conds(r, fence, after)
            if conds:
                self.waits[r] = conds

    def cross_check(self, st: PoolStats) -> None:
        if st.free + st.allocated + st.pending + st.quarantined != st.capacity:
            self.fail(f"stats do not add up: {st}")
        if st.quarantined:
            self.fail(f"{st.quarantined} rows quarantined without any fault")
        if len(self.owner) > st.allocated:
            self.fail(f"shadow holds {len(self.owner)} rows, pool says {st.allocated} allocated")
        led = self.pool._ledger
        for r in self.owner:
            state = led.state_of(r)
            if state != "allocated":
                self.fail(f"row {r} held by {self.owner[r]} but the pool says {state}")


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
            h.note("alloc_queued")
        try:
            rows = await pool.alloc(n, priority=rng.randrange(3), timeout=timeout)
        except TimeoutError:
            h.note("timeouts_seen")
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
                h.note("try_alloc_hit")
                held.append((h.grant(rows), rows))
        elif op < 0.48:
            await lease_body(h, rng, bool(held))
        elif op < 0.56:
            await cancel_alloc(h, rng, held, free_one)
        elif op < 0.66:
            if held:
                _tok, rows = held[rng.randrange(len(held))]
                h.record_use(rows, h.pick_fence(rng))
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
                h.record_use(rows, h.pick_fence(rng))
            for _ in range(rng.randrange(3)):
                await asyncio.sleep(0)
            if rng.random() < 0.3:
                raise Boom
    except Boom:
        h.note("lease_raised")
    except TimeoutError:
        h.note("timeouts_seen")
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
        h.note("cancelled")
        if asyncio.current_task().cancelling():  # type: ignore[union-attr]
            raise
        return
    held.append((h.grant(rows), rows))


# Its own watchdog fails a stall in ~30 s; this bound covers the whole budget.
@pytest.mark.timeout(BUDGET_S + 60)
async def test_async_stress(
    request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str], record_property: Any
) -> None:
    t0 = time.perf_counter()
    streams = [HostStream(f"stress-{i}") for i in range(NSTREAMS)]
    pool = AsyncReqToTokenPool(SIZE, 8)
    h = Harness(pool, streams, SEED)

    def begin(phase: tuple[int, float, int, int]) -> int:
        nworkers, share, h.max_n, h.max_held = phase
        h.target = int(TARGET_OPS * share)
        return nworkers

    run = await run_phases(
        h,
        PHASES,
        begin=begin,
        worker=lambda wid, _phase: worker(h, wid),
        budget_s=BUDGET_S,
        take_rows_back=True,
    )
    hung, errors, st, leftover = run.hung, run.errors, run.stats, run.leftover
    elapsed = time.perf_counter() - t0
    summary = (
        f"stress[{loop_id(request)}]: {h.ops} pool ops in {elapsed:.1f}s by {h.tasks_created} "
        f"tasks; allocs={st.allocs} frees={st.frees} deferred={st.deferred_frees} "
        f"reclaimed={st.reclaimed} timeouts={st.timeouts} cancellations={st.cancellations} "
        f"fences={sum(h.launched)} checks={h.checks} "
        f"counts={dict(sorted(h.counts.items()))}"
    )
    show(capsys, summary)
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
