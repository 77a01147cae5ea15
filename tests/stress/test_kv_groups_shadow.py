"""KV groups stress: grouped admissions against a shadow model, on both loops.

Worker tasks admit requests on a pool with three KV groups (sliding-window
pages, full-attention pages, a Mamba-style state slot ``KVPagePool(n, 1)``
admitted with a count of 1), with random counts, priorities, timeouts and
cancellations; they grow rows per group (``extend``, ``extend_rows``,
``extend_fitting``), trim them, drop their early pages as a sliding window
does (``drop_pages``: the shadow keeps each row's dropped positions and
checks ``pages_of`` and ``pages_dropped`` against them), detach a group's
pages and free those to its page pool later, record uses and free rows
plainly or behind fences: gates on a ``HostStream`` (ordered) and transfer
handles (``query()``/
``synchronize()``, polled by the watcher). A clock task opens gates and
handles at random, so fences complete out of order and wake queued
admissions with nobody calling the pool.

The shadow checks at every grant (admission, growth) that no row or page is
held by anyone else (no double grant) and that every fence it was last
freed behind has completed (no page handed out while its fence is open);
every ``CHECK_EVERY`` operations it compares its counts with the pool's and
each group's and runs ``check_invariants()``. At the end every row and
page is back, nothing pending, nobody hung.

``ASYNCPOOL_STRESS_SCALE`` (default 1: 10^5 pool operations per loop) scales
the run; ``ASYNCPOOL_STRESS_SEED`` changes the seed.
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time
from typing import Any

import pytest
import torch
from harness import loop_id, show

from asyncpool import AsyncReqToTokenPool, GroupGrant, HostStream, KVPagePool

SCALE = float(os.environ.get("ASYNCPOOL_STRESS_SCALE") or "1")
TARGET_OPS = max(2_000, int(100_000 * SCALE))
SEED = int(os.environ.get("ASYNCPOOL_STRESS_SEED") or "20261205")
ROWS = 24
SIZES = {"swa": 64, "full": 160, "mamba": 24}
PAGE_SIZES = {"swa": 4, "full": 4, "mamba": 1}
WORKERS = 40
CHECK_EVERY = 2_000
BUDGET_S = 120 * max(1.0, SCALE)


class Handle:
    """A transfer handle: no stream, completes on ``set()`` (polled)."""

    __slots__ = ("event",)

    def __init__(self) -> None:
        self.event = threading.Event()

    def query(self) -> bool:
        return self.event.is_set()

    def synchronize(self) -> None:
        self.event.wait(30)


class Shadow:
    def __init__(self, pool: AsyncReqToTokenPool, stream: HostStream, rng: random.Random) -> None:
        self.pool = pool
        self.stream = stream
        self.rng = rng
        self.ops = 0
        self.failures: list[str] = []
        self.rows_held: set[int] = set()
        self.pages_held: dict[str, set[int]] = {g: set() for g in SIZES}
        # What a freed row or page waited for: each must be done at its next grant.
        self.row_after: dict[int, list[Any]] = {}
        self.page_after: dict[tuple[str, int], list[Any]] = {}
        self.uses: dict[int, list[Any]] = {}
        self.detached: list[tuple[str, list[int], list[Any]]] = []
        self.gates: list[threading.Event] = []
        self.handles: list[Handle] = []
        self.grants = 0
        self.timeouts = 0
        self.cancels = 0

    def fail(self, msg: str) -> None:
        if len(self.failures) < 20:
            self.failures.append(msg)

    # fences
    def fence(self) -> Any:
        if self.rng.random() < 0.5:
            h = Handle()
            self.handles.append(h)
            return h
        if len(self.gates) < 6 and self.rng.random() < 0.5:
            ev = threading.Event()
            self.stream.launch(lambda: ev.wait(30))
            self.gates.append(ev)
        return self.stream.record()

    def open_some(self) -> None:
        rng = self.rng
        if self.handles and rng.random() < 0.5:
            self.handles.pop(rng.randrange(len(self.handles))).event.set()
        if self.gates and rng.random() < 0.3:
            self.gates.pop(0).set()

    def open_all(self) -> None:
        for h in self.handles:
            h.event.set()
        for ev in self.gates:
            ev.set()
        self.handles.clear()
        self.gates.clear()

    # grants
    def granted_row(self, row: int) -> None:
        if row in self.rows_held:
            self.fail(f"row {row} granted twice")
        for f in self.row_after.pop(row, ()):
            if not f.query():
                self.fail(f"row {row} granted while its fence {f!r} is open")
        self.rows_held.add(row)
        self.uses[row] = []

    def granted_pages(self, group: str, pages: list[int]) -> None:
        held = self.pages_held[group]
        for p in pages:
            if p in held:
                self.fail(f"page {p} of {group} granted twice")
            for f in self.page_after.pop((group, p), ()):
                if not f.query():
                    self.fail(f"page {p} of {group} granted while its fence {f!r} is open")
            held.add(p)

    def freed_pages(self, group: str, pages: list[int], fences: list[Any]) -> None:
        held = self.pages_held[group]
        for p in pages:
            held.discard(p)
            if fences:
                self.page_after[(group, p)] = list(fences)

    def check(self, final: bool = False) -> None:
        """The pool agrees with the shadow. Mid-run, a waiter granted at
        hand-over that has not resumed yet holds what the shadow does not
        know of: the pool may hold more, never less; at the end, exactly."""
        pool = self.pool
        pool.check_invariants()
        st = pool.stats()
        if st.allocated < len(self.rows_held) or (final and st.allocated != len(self.rows_held)):
            self.fail(f"pool holds {st.allocated} rows, the shadow {len(self.rows_held)}")
        for row in self.rows_held:
            if pool._ledger.state_of(row) != "allocated":
                self.fail(f"row {row} is held but {pool._ledger.state_of(row)}")
        groups = pool.kv_groups
        assert groups is not None
        for name, kv in groups.items():
            kv.check_invariants()
            detached = sum(len(p) for g, p, _ in self.detached if g == name)
            want = len(self.pages_held[name]) + detached
            got = kv.allocated_size()
            if got < want or (final and got != want):
                self.fail(f"{name}: {got} pages allocated, shadow {want}")


class Request:
    __slots__ = ("dropped", "pages", "row")

    def __init__(self, row: int, pages: dict[str, list[int]]) -> None:
        self.row = row
        self.pages = pages  # live pages per group
        self.dropped = dict.fromkeys(pages, 0)  # leading dropped positions per group


async def worker(sh: Shadow, wid: int, deadline: float) -> None:
    pool = sh.pool
    rng = random.Random(SEED * 1000 + wid)
    groups = pool.kv_groups
    assert groups is not None
    held: list[Request] = []
    while sh.ops < TARGET_OPS and not sh.failures and time.monotonic() < deadline:
        sh.ops += 1
        if sh.ops % CHECK_EVERY == 0:
            sh.check()
        r = rng.random()
        if r < 0.30 and len(held) < 3:
            counts = {
                "swa": rng.randint(0, 8),
                "full": rng.randint(0, 24),
                "mamba": 1,
            }
            mode = rng.random()
            if held and mode >= 0.4:
                # A worker that holds requests never waits unbounded for
                # more: all of them waiting would be the app's own
                # hold-and-wait (nobody left to free).
                mode = rng.random() * 0.4
            if mode < 0.15:
                grant = pool.try_admit(counts)
                if grant is None:
                    continue
            elif mode < 0.3:
                try:
                    grant = await pool.admit(counts, timeout=rng.choice([0.0, 0.0005, 0.002]))
                except TimeoutError:  # the admission's own timeout
                    sh.timeouts += 1
                    continue
            elif mode < 0.4:
                try:
                    async with asyncio.timeout(0.001):  # cancels the wait from outside
                        grant = await pool.admit(counts, priority=rng.randint(0, 2))
                except TimeoutError:
                    sh.cancels += 1
                    continue
            else:
                # Bounded: a lost wake-up fails the test, it does not hang CI.
                async with asyncio.timeout(60):
                    grant = await pool.admit(counts, priority=rng.randint(0, 2))
            assert isinstance(grant, GroupGrant)
            sh.grants += 1
            sh.granted_row(grant.row)
            pages = {g: t.tolist() for g, t in grant.pages.items()}
            for g, ps in pages.items():
                if len(ps) != counts[g]:
                    sh.fail(f"{g}: granted {len(ps)} pages for {counts[g]}")
                sh.granted_pages(g, ps)
            held.append(Request(grant.row, pages))
        elif r < 0.45 and held:
            req = held[rng.randrange(len(held))]
            g = rng.choice(["swa", "full"])
            how = rng.random()
            if how < 0.4:
                got = pool.extend(req.row, rng.randint(1, 3), group=g)
                new = [] if got is None else got.tolist()
            elif how < 0.7:
                rows = [q.row for q in held]
                lines = pool.extend_rows(rows, 1, group=g)
                new = []
                if lines is not None:
                    for q, line in zip(held, lines.tolist(), strict=True):
                        q.pages[g].extend(line)
                        sh.granted_pages(g, line)
                    continue
            else:
                rows = [q.row for q in held]
                m, lines = pool.extend_fitting(rows, 1, group=g)
                for q, line in zip(held[:m], lines.tolist(), strict=True):
                    q.pages[g].extend(line)
                    sh.granted_pages(g, line)
                continue
            req.pages[g].extend(new)
            sh.granted_pages(g, new)
        elif r < 0.52 and held:
            req = held[rng.randrange(len(held))]
            g = rng.choice(["swa", "full"])
            d = req.dropped[g]
            keep = rng.randint(0, d + len(req.pages[g]))  # positions, holes included
            fence = sh.fence() if rng.random() < 0.5 else None
            live = max(0, keep - d)
            cut = req.pages[g][live:]
            pool.trim_pages([req.row], keep, fence, group=g)
            req.pages[g] = req.pages[g][:live]
            req.dropped[g] = min(d, keep)
            fences = list(sh.uses[req.row]) + ([fence] if fence is not None else [])
            sh.freed_pages(g, cut, fences)
        elif r < 0.58 and held:
            req = held[rng.randrange(len(held))]
            g = rng.choice(["swa", "full"])
            out = pool.detach_pages(req.row, group=g, host=True).tolist()
            if sorted(out) != sorted(req.pages[g]):
                sh.fail(f"detach {g} of row {req.row}: {out} != {req.pages[g]}")
            for p in out:
                sh.pages_held[g].discard(p)
            sh.detached.append((g, out, list(sh.uses[req.row])))
            req.pages[g] = []
            req.dropped[g] = 0
        elif r < 0.64 and sh.detached:
            g, pages, uses = sh.detached.pop(rng.randrange(len(sh.detached)))
            extra = [sh.fence()] if rng.random() < 0.5 else []
            fences = [*uses, *extra]
            groups[g].free(torch.tensor(pages, dtype=torch.int64), fence=fences or None)
            sh.freed_pages(g, pages, fences)
        elif r < 0.72 and held:
            fence = sh.fence()
            rows = [q.row for q in held]
            pool.record_use(rows, fence)
            for row in rows:
                sh.uses[row].append(fence)
        elif r < 0.77 and held:
            # A sliding window: the early positions go back behind the row's uses.
            req = held[rng.randrange(len(held))]
            g = rng.choice(["swa", "full"])
            d = req.dropped[g]
            below = rng.randint(max(0, d - 1), d + len(req.pages[g]))
            fence = sh.fence() if rng.random() < 0.3 else None
            n = max(0, below - d)
            cut = req.pages[g][:n]
            pool.drop_pages(req.row, below, fence, group=g)
            req.pages[g] = req.pages[g][n:]
            req.dropped[g] = max(d, below)
            fences = list(sh.uses[req.row]) + ([fence] if fence is not None else [])
            sh.freed_pages(g, cut, fences)
            want = [0] * req.dropped[g] + req.pages[g]
            if pool.pages_of(req.row, group=g, host=True).tolist() != want:
                sh.fail(f"drop {g} of row {req.row}: pages_of != {want}")
            if pool.pages_dropped(req.row, group=g) != req.dropped[g]:
                sh.fail(f"drop {g} of row {req.row}: pages_dropped != {req.dropped[g]}")
        elif r < 0.92 and held:
            req = held.pop(rng.randrange(len(held)))
            fence = sh.fence() if rng.random() < 0.6 else None
            pool.free([req.row], fence)
            fences = sh.uses.pop(req.row) + ([fence] if fence is not None else [])
            sh.rows_held.discard(req.row)
            if fences:
                sh.row_after[req.row] = list(fences)
            for g, ps in req.pages.items():
                sh.freed_pages(g, ps, fences)
        else:
            sh.open_some()
            await asyncio.sleep(0)
    for req in held:
        pool.free([req.row])
        sh.rows_held.discard(req.row)
        sh.uses.pop(req.row, None)
        for g, ps in req.pages.items():
            sh.freed_pages(g, ps, [])


async def clock(sh: Shadow, stop: asyncio.Event) -> None:
    while not stop.is_set():
        sh.open_some()
        await asyncio.sleep(0)


@pytest.mark.timeout(BUDGET_S + 60)
async def test_kv_groups_shadow(request: pytest.FixtureRequest, capsys: Any) -> None:
    groups = {g: KVPagePool(n + 1, PAGE_SIZES[g], name=g) for g, n in SIZES.items()}
    pool = AsyncReqToTokenPool(ROWS + 1, 64, kv=groups)
    t0 = time.monotonic()
    with HostStream("kv-groups-stress") as stream:
        sh = Shadow(pool, stream, random.Random(SEED))
        stop = asyncio.Event()
        ticker = asyncio.create_task(clock(sh, stop))
        deadline = t0 + BUDGET_S
        async with asyncio.timeout(BUDGET_S + 30):
            await asyncio.gather(*(worker(sh, w, deadline) for w in range(WORKERS)))
        stop.set()
        await ticker
        for g, pages, _ in sh.detached:
            groups[g].free(torch.tensor(pages, dtype=torch.int64))
        sh.detached.clear()
        sh.open_all()
        async with asyncio.timeout(30):
            await pool.drain()
        sh.check(final=True)
        await pool.close()
    assert not sh.failures, sh.failures
    assert sh.ops >= TARGET_OPS, f"only {sh.ops} of {TARGET_OPS} operations within the budget"
    st = pool.stats()
    assert st.allocated == 0 and st.pending == 0 and st.free == ROWS
    assert st.pages_free == sum(SIZES.values()) and st.pages_pending == 0
    assert st.waiters == 0
    for g, kv in groups.items():
        assert kv.available_size() == SIZES[g], g
    assert sh.grants > 0 and sh.timeouts + sh.cancels > 0
    show(
        capsys,
        f"kv groups shadow [{loop_id(request)}]: {sh.ops} ops, {sh.grants} grants, "
        f"{sh.timeouts} timeouts, {sh.cancels} cancels in {time.monotonic() - t0:.1f} s",
    )
