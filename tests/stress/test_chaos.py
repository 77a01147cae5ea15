"""Chaos: one small pool driven through random interleavings of everything it offers.

Each seed builds a pool of 8 rows (the ``kv`` kind: with 24 KV pages) and takes
a few hundred random steps: waiter tasks ``admit``/``alloc`` with random sizes,
priorities (one level, or mixed) and timeouts, and act on the pool in the
callback that resumes their grant; ``try_admit``/``try_alloc``;
``extend``/``extend_rows``; ``detach_pages``, then ``kv.free`` of the pages;
``record_use`` behind fences of three ordered streams and fences of unknown
origin; frees with ``fence=`` and ``after=`` (a ``HostStream`` held by gates);
fences that complete or fault; ``force_release``; cancellations, some in the
same tick as the free that granted the waiter; bad input; ``drain(timeout=)``;
``release_memory``/``resume_memory`` with waiters queued; ``close``. Some seeds
then move the pool to a thread running the other loop (asyncio or uvloop) with
``bind()``, and some on from there to a fresh loop after the first one closed
with waiters queued, rows held and fences pending.

After every step the shadow model (``chaos_model.py``) of who holds which row
and page, counting grants not yet resumed, is checked against
``check_invariants()``, the ledgers and ``pages_of``. Every grant must find its
rows and pages unheld, every fence they were freed behind complete (or
force-released) and the row's lengths zero; ``try_*`` must not pass a queued
waiter; bad input must raise a typed error and change nothing; and no waiter at
the head of the queue may fit in what is free without being granted (a lost
wake-up: the bug fixed in 7852c0c). At the end, every fence completed and
everything freed, all rows and pages are free but exactly those freed behind a
fence that faulted (quarantined).

``ASYNCPOOL_STRESS_SCALE`` (default 1: 32 seeds per case and loop) scales the
number of seeds; ``ASYNCPOOL_STRESS_SEED`` sets the first. A failure names its
seed and step; ``ASYNCPOOL_STRESS_SEED=<seed> ASYNCPOOL_STRESS_SCALE=0`` runs
that seed alone (thread and timer timing can still steer it elsewhere).
"""

from __future__ import annotations

import asyncio
import collections
import os
import random
import time
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import uvloop
from chaos_model import PAGES, ROWS, Fail, Req, Shadow
from harness import loop_id, show
from helpers import Streams, bounded, pool_snapshot, spin

from asyncpool import CapacityError, InvalidSlotError, PoolBusyError, PoolClosedError

SCALE = float(os.environ.get("ASYNCPOOL_STRESS_SCALE") or "1")
SEED = int(os.environ.get("ASYNCPOOL_STRESS_SEED") or "20261202")
SEEDS = max(1, round(32 * SCALE))
STEPS = 300  # per seed
STEP_S = 5.0  # bound on one step, and on each wait of the wind-down
AFTER_CLOSE_STEPS = 20  # steps a phase takes on a closed pool before it ends
WAIT_ENDS = (asyncio.CancelledError, TimeoutError, PoolClosedError, CapacityError, PoolBusyError)
EXERCISED = ["granted", "cancel", "TimeoutError", "fault", "force_release", "bad_input", "drained"]
EXERCISED += ["release_refused", "release_resume", "here", "thread", "thread+switch"]
Runner = Callable[[Coroutine[Any, Any, None]], None]


class Chaos(Shadow):
    """The random steps, and the phases a seed runs them in."""

    def __init__(self, seed: int, kit: Streams, *, kv: bool, mixed: bool) -> None:
        super().__init__(seed, kit, kv=kv)
        self.mixed = mixed
        self.step_no = 0

    # ------------------------------------------------------------ waiters

    def spawn(self) -> None:
        admit = self.kv is not None and self.rng.random() < 0.7
        n = self.rng.choice((0, 1, 1, 2, 3, 5, 8, 13) if admit else (1, 1, 2, 3))
        prio = self.rng.choice((0, 0, 1, -1)) if self.mixed else 0
        timeout = self.rng.choice((None, None, None, 0, 0.0005, 0.002, 0.01))
        self.tasks.add(asyncio.get_running_loop().create_task(self.waiter(admit, n, prio, timeout)))

    async def waiter(self, admit: bool, n: int, prio: int, timeout: float | None) -> None:
        try:
            if admit:
                g = await self.pool.admit(pages=n, priority=prio, timeout=timeout)
                req = self.on_grant(g.row, g.pages.tolist())
            else:
                rows = await self.pool.alloc(n, priority=prio, timeout=timeout)
                if len(set(rows)) != n:
                    raise Fail(f"alloc({n}) granted {rows}")
                req = [self.on_grant(r, []) for r in rows][-1]
            self.post_grant(req)
        except WAIT_ENDS as exc:
            self.counts[type(exc).__name__] += 1
        except Exception as exc:  # reported by the next check()
            self.errors.append(repr(exc))

    def post_grant(self, req: Req) -> None:
        """Act on the pool in the callback that resumed a grant."""
        x = self.rng.random()
        if x < 0.1:
            self.rng.choice(self.streams).advance(1)
        elif x < 0.13:
            self.fault_one()
        elif x < 0.2:
            self.cancel_one()
        elif x < 0.3:  # abort at once, behind the step that used it
            f = self.pick_fence()
            self.pool.record_use([req.row], f)
            req.uses.append(f)
            self.free([req])

    def cancel_one(self) -> None:
        live = [t for t in self.tasks if not t.done() and t is not asyncio.current_task()]
        if live:
            self.rng.choice(live).cancel()
            self.counts["cancel"] += 1

    # ------------------------------------------------------------ steps

    def some(self, k: int) -> list[Req]:
        n = min(len(self.reqs), self.rng.randint(1, k))
        return self.rng.sample(list(self.reqs.values()), n)

    def try_take(self) -> None:
        waiting = self.pool.waiting()
        try:
            if self.kv and self.rng.random() < 0.5:
                g = self.pool.try_admit(pages=self.rng.choice((0, 1, 2, 4)))
                got = [(g.row, g.pages.tolist())] if g is not None else []
            else:
                got = [(r, []) for r in self.pool.try_alloc(self.rng.choice((1, 1, 2))) or ()]
        except CapacityError:  # quarantine made it unfittable: said at once, as alloc does
            st = self.pool.stats()
            if not (st.quarantined or st.pages_quarantined):
                raise Fail("try_* raised CapacityError with nothing quarantined") from None
            self.counts["try_CapacityError"] += 1
            return
        if got and waiting:
            raise Fail(f"try_* granted {got} past {waiting} queued waiters")
        for row, pages in got:
            self.on_grant(row, pages)

    def grow(self) -> None:
        """``extend`` one row, or ``extend_rows`` a few: pages all or none."""
        if not self.reqs or not self.kv:
            return
        reqs, k = self.some(1 if self.rng.random() < 0.6 else 3), self.rng.randint(1, 2)
        if len(reqs) == 1:
            more = self.pool.extend(reqs[0].row, k)
            lines = [more.tolist()] if more is not None else []
        else:
            got = self.pool.extend_rows([r.row for r in reqs], k)
            if got is not None and tuple(got.shape) != (len(reqs), k):
                raise Fail(f"extend_rows({len(reqs)} rows, {k}) gave shape {tuple(got.shape)}")
            lines = got.tolist() if got is not None else []
        for r, line in zip(reqs, lines, strict=False):
            for p in line:
                self.take("page", p, r.tok)
            r.pages += line
        self.counts["grown"] += bool(lines)

    def detach(self) -> None:
        r = self.some(1)[0] if self.reqs and self.kv else None
        if r is None or not r.pages:
            return
        t = self.pool.detach_pages(r.row)
        if sorted(t.tolist()) != sorted(r.pages):
            raise Fail(f"detach_pages({r.row}) = {t.tolist()}, the row owned {r.pages}")
        self.detached.append((t, r.pages, list(r.uses)))  # its steps may still write them
        r.pages = []

    def force(self) -> None:
        fences = self.pool._ledger.pending_fences()
        fences += self.kv.ledger.pending_fences() if self.kv else []
        if fences:
            f, before = self.rng.choice(fences), self.states()
            self.pool.force_release(f)
            self.forced(f, before)
            self.counts["force_release"] += 1

    def bad_input(self) -> None:
        """A typed error, and no change at all."""
        pool, kv, cases = self.pool, self.kv, list[Callable[[], object]]()
        not_a_fence: Any = object()
        if self.reqs:
            r = self.some(1)[0].row
            cases += [lambda: pool.free([r, r]), lambda: pool.free([r, 0])]
            cases += [lambda: pool.free(r, fence=not_a_fence)]
            cases += [lambda: pool.extend(r, 0), lambda: pool.extend_rows([r, r], 1)] if kv else []
        free = [x for x in range(1, ROWS + 1) if pool._ledger.state_of(x) == "free"]
        if free:
            x = free[0]
            cases += [lambda: pool.free([x]), lambda: pool.record_use([x], self.pick_fence())]
            cases += [lambda: pool.detach_pages(x)] if kv else []
        owned = [p for r in self.reqs.values() for p in r.pages]
        if kv and owned:
            cases.append(lambda: kv.free(owned[:1]))  # a row's page: the row frees it
        cases.append(lambda: pool.try_admit(pages=PAGES + 1) if kv else pool.try_alloc(0))
        cases.append(lambda: pool.free([ROWS + 1]))
        case = self.rng.choice(cases)
        before = pool_snapshot(pool), kv.ledger.states().tobytes() if kv else b""
        try:
            case()
            raise Fail("bad input accepted")
        except (CapacityError, InvalidSlotError, TypeError, PoolClosedError):
            pass
        if (pool_snapshot(pool), kv.ledger.states().tobytes() if kv else b"") != before:
            raise Fail("bad input was refused, yet changed the pool")
        self.counts["bad_input"] += 1

    async def release_cycle(self) -> None:
        """``release_memory`` (refused while memory is held), ``resume_memory``."""
        pool = self.pool
        if self.rng.random() < 0.6:  # give everything back behind open fences; queue waiters
            for r in list(self.reqs.values()):
                self.free([r], self.pick_fence(), self.rng.random() < 0.2)
            while self.detached:
                self.free_detached(self.pick_fence())
            for _ in range(3):
                self.spawn()
            await spin(1)
        held = self.holds()
        rel = asyncio.ensure_future(pool.release_memory())
        await spin(1)
        if not rel.done():  # draining fences: allocation is held already
            try:
                await pool.resume_memory()
                raise Fail("resume_memory during release_memory's drain did not refuse")
            except PoolBusyError:
                pass
            if self.rng.random() < 0.3:
                rel.cancel()
                await asyncio.gather(rel, return_exceptions=True)
                if pool.released or pool._waiters.gated != pool.closed:
                    raise Fail("a cancelled release_memory left the pool released or gated")
                self.counts["release_cancelled"] += 1
                return
            self.complete_all()
        try:
            await rel
        except PoolBusyError:
            if not (held or self.holds()):
                raise Fail("release_memory refused with nothing allocated") from None
            self.counts["release_refused"] += 1
            return
        if self.holds() or not pool.released:
            raise Fail("release_memory returned with memory held, or not released")
        self.spawn()
        await spin(3)
        if self.holds():
            raise Fail("a grant while the memory is released")
        self.check()
        await pool.resume_memory()
        self.counts["release_resume"] += 1

    async def drain(self) -> None:
        deferred = self.deferred
        try:
            await self.pool.drain(timeout=self.rng.choice((0, 0.0005, 0.002)))
        except TimeoutError:
            return
        pending = self.pool.pending_size() + (self.kv.pending_size() if self.kv else 0)
        if pending and deferred == self.deferred:  # (a waiter may have freed behind a fence)
            raise Fail(f"drain() returned with {pending} pending")
        self.counts["drained"] += 1

    async def step(self) -> None:
        rng, pool, op = self.rng, self.pool, self.rng.random()
        if op < 0.16:
            self.spawn()
        elif op < 0.20:
            self.try_take()
        elif op < 0.30:
            self.grow()
        elif op < 0.34:
            self.detach()
        elif op < 0.39 and self.detached:
            fence = self.pick_fence() if rng.random() < 0.5 else None
            self.free_detached(fence, rng.random() < 0.2)
        elif op < 0.47 and self.reqs:
            reqs, f = self.some(4), self.pick_fence()
            pool.record_use([r.row for r in reqs], f)
            for r in reqs:
                r.uses.append(f)
        elif op < 0.60 and self.reqs:
            fence = self.pick_fence() if rng.random() < 0.4 else None
            self.free(self.some(3), fence, rng.random() < 0.2)
            if rng.random() < 0.3:  # the same tick: the free may have granted it
                self.cancel_one()
        elif op < 0.72:
            self.complete_some()
        elif op < 0.735:
            self.fault_one()
        elif op < 0.75:
            self.force()
        elif op < 0.80:
            self.cancel_one()
        elif op < 0.81:
            self.bad_input()
        elif op < 0.815 and not pool.closed:
            await self.release_cycle()
        elif op < 0.818 and rng.random() < 0.3:  # free, then close in the same tick
            if self.reqs:
                self.free(self.some(1))
            await pool.close()
        elif op < 0.825:
            await self.drain()
        else:
            await spin(rng.choice((1, 1, 3)))

    def between(self) -> None:
        """Calls made with no loop running (the pool's loop has closed)."""
        for _ in range(30 if not self.pool.closed else 0):
            op = self.rng.random()
            if op < 0.3 and self.reqs:
                self.free(self.some(2), self.pick_fence() if self.rng.random() < 0.6 else None)
            elif op < 0.6:
                self.try_take()
            elif op < 0.85:
                self.complete_some()
            else:
                self.pool.reclaim()
            self.check()

    # ------------------------------------------------------------ phases

    async def no_stall(self) -> None:
        """Fail if the same head waiter fits in what is free across 20 loop turns."""
        first = self.head_fits()
        for _ in range(2):
            if first is None:
                return
            await spin(10)
            now = self.head_fits()
            first = now if now and now[0] is first[0] else None
        if first is None:
            return
        w = self.pool._waiters
        queued = [(p, x[0]) for p in w._prios for x in w._queues[p] if not x[1].done()]
        raise Fail(
            f"stall: the head waiter needs {first[0][0]} and fits ({first[1]} rows, {first[2]} "
            f"pages free), yet is not granted; queued (priority, need): {queued}"
        )

    async def phase(self, steps: int, end: str | None) -> None:
        """``steps`` checked steps, then :meth:`finish` unless ``end`` is None.

        Once the pool is closed, a few more steps (frees and refusals after
        close) end the phase early: the rest would only be refused."""
        after_close = 0
        for _ in range(steps):
            if self.pool.closed:
                after_close += 1
                if after_close > AFTER_CLOSE_STEPS:
                    break
            self.step_no += 1
            try:
                async with bounded(STEP_S):
                    await self.step()
            except PoolClosedError:
                if not self.pool.closed:
                    raise
            self.check()
            await self.no_stall()
        self.tasks = {t for t in self.tasks if not t.done()}
        if end is not None:
            await self.finish(end)

    async def finish(self, end: str) -> None:
        """Complete every fence, free everything, end every waiter, drain, check. ``end``:
        "close" first, "keep" the pool open (to move it), or close it "last"."""
        while self.reqs or self.detached or self.tasks:
            self.complete_all()
            for r in list(self.reqs.values()):
                self.free([r])
            while self.detached:
                self.free_detached()
            for t in self.tasks:
                t.cancel()
            async with bounded(STEP_S):
                ends = await asyncio.gather(*self.tasks, return_exceptions=True)
            self.tasks.clear()
            if any(e is not None and not isinstance(e, asyncio.CancelledError) for e in ends):
                raise Fail(f"a waiter task raised: {ends}")
        self.complete_all()
        async with bounded(STEP_S):
            if end == "close":
                await self.pool.close()
            await self.pool.drain()
            self.check_end()
            if end == "last":
                await self.pool.close()


async def drive(ch: Chaos, mode: str, other: Runner, same: Runner) -> None:
    """One seed: here only, or moved to a thread on the ``other`` loop (and on to a new loop)."""
    end = ch.rng.choice(("close", "last"))
    if mode == "here":
        await ch.phase(STEPS, end)
        return
    await ch.phase(STEPS // 3, "keep")

    async def moved(steps: int, end: str | None) -> None:
        ch.pool.bind()
        await ch.phase(steps, end)

    def elsewhere() -> None:
        if mode == "thread":
            other(moved(2 * STEPS // 3, end))
            return
        other(moved(STEPS // 3, None))  # its loop closes with waiters, rows held, fences pending
        ch.between()
        same(ch.phase(STEPS // 3, end))  # a new loop: the pool follows it without bind()

    async with bounded(30 + STEPS * 0.2):
        await asyncio.to_thread(elsewhere)


@pytest.mark.timeout(max(1.0, SCALE) * 300)
@pytest.mark.parametrize("prio", ["single", "mixed"])
@pytest.mark.parametrize("kind", ["rows", "kv"])
async def test_chaos(
    kind: str, prio: str, request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]
) -> None:
    t0 = time.perf_counter()
    here_uv = isinstance(asyncio.get_running_loop(), uvloop.Loop)
    other: Runner = asyncio.run if here_uv else uvloop.run
    same: Runner = uvloop.run if here_uv else asyncio.run
    total: collections.Counter[str] = collections.Counter()
    for seed in range(SEED, SEED + SEEDS):
        mode = random.Random(seed * 7 + 1).choice(("here", "thread", "thread+switch"))
        with Streams() as kit:
            ch = Chaos(seed, kit, kv=kind == "kv", mixed=prio == "mixed")
            try:
                await drive(ch, mode, other, same)
            except AssertionError as exc:
                raise AssertionError(
                    f"seed {seed} ({mode}), step {ch.step_no}: {exc}\nrerun: ASYNCPOOL_STRESS_SEED="
                    f"{seed} ASYNCPOOL_STRESS_SCALE=0 pytest '{request.node.nodeid}'"
                ) from exc
        total.update(ch.counts)
        total[mode] += 1
    elapsed = time.perf_counter() - t0
    show(capsys, f"chaos[{loop_id(request)}]: {SEEDS} seeds in {elapsed:.1f}s {dict(total)}")
    if SEEDS >= 8:  # the run exercised what it claims to
        for what in EXERCISED + (["grown", "kv.free"] if kind == "kv" else []):
            assert total[what] > 0, f"the run never exercised {what}: {dict(total)}"
