"""Admission stress: tasks admitting rows with KV pages while fences complete at random.

Worker tasks ``admit`` (and ``try_admit``, and row-only ``alloc`` in the same
queue) with random page counts, priorities, timeouts and cancellations
(including the same-tick ``task.cancel(); pool.free(row)`` race), grow rows
with ``extend``, hand pages off with ``detach_pages`` and free them later to
the ``KVPagePool`` themselves, ``record_use`` rows behind step fences, and
free rows plainly, behind ``fence=`` (ordered host fences and transfer
handles of unknown origin) or ``after=stream``. A clock task launches gates
on three ``HostStream``s and opens them, and the transfer handles, at random
moments, so fences complete out of order.

A shadow model checks, at every grant of a row or a page, that nobody else
holds it and that no fence it was freed behind is still open (the page
checks are the point: a page handed out while a transfer into it may still
land is the bug this guards against); every ``CHECK_EVERY`` operations it
cross-checks owners with the pool and runs ``check_invariants()``. At the end
every row and page is back, nothing is pending, nobody hung.

``ASYNCPOOL_STRESS_SCALE`` (default 1: 10^5 pool operations per loop) scales
the run; ``ASYNCPOOL_STRESS_SEED`` changes the seed.
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
import torch

from asyncpool import AsyncReqToTokenPool, HostStream, KVPagePool

SCALE = float(os.environ.get("ASYNCPOOL_STRESS_SCALE") or "1")
TARGET_OPS = max(2_000, int(100_000 * SCALE))
SEED = int(os.environ.get("ASYNCPOOL_STRESS_SEED") or "20261201")
ROWS = 64
PAGES = 512
NSTREAMS = 3
MAX_OPEN_GATES = 6
CHECK_EVERY = 500
# Few workers first (fast paths, try_admit hits), then many (always queued).
PHASES = ((16, 0.4, 3), (400, 0.6, 2))  # workers, share of ops, max held requests
BUDGET_S = 240 * max(1.0, SCALE)


class Handle:
    """A transfer handle: a fence of unknown origin that completes on ``set``."""

    __slots__ = ("_ev",)

    def __init__(self) -> None:
        self._ev = threading.Event()

    def query(self) -> bool:
        return self._ev.is_set()

    def synchronize(self) -> None:
        self._ev.wait(60)

    def set(self) -> None:
        self._ev.set()


def _gate(ev: threading.Event, passed: list[int], s: int, k: int) -> None:
    ev.wait()
    passed[s] = k


class Shadow:
    """Who holds which row and page, and what each freed one waits for."""

    def __init__(self, pool: AsyncReqToTokenPool, kv: KVPagePool, streams: list[HostStream]):
        self.pool = pool
        self.kv = kv
        self.streams = streams
        self.tokens = itertools.count(1)
        self.row_owner: dict[int, int] = {}
        self.page_owner: dict[int, int] = {}
        self.uses: dict[int, list[Any]] = {}  # row -> fences recorded on it
        self.waits: dict[tuple[str, int], list[tuple[Any, ...]]] = {}
        self.launched = [0] * len(streams)
        self.passed = [0] * len(streams)
        self.current: list[Any] = [None] * len(streams)
        self.open_gates: list[list[threading.Event]] = [[] for _ in streams]
        self.handles: list[Handle] = []
        self.handle_done = Handle()
        self.handle_done.set()
        self.ops = 0
        self.counts: dict[str, int] = {}
        self.failures: list[str] = []
        self.stop = False
        self.done = False
        self.target = TARGET_OPS
        self.checks = 0

    # ------------------------------------------------------------ bookkeeping

    def count(self, what: str) -> None:
        self.ops += 1
        self.counts[what] = self.counts.get(what, 0) + 1
        if self.ops >= self.target:
            self.stop = True
        if self.ops % CHECK_EVERY == 0:
            self.check()

    def note(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def fail(self, msg: str) -> None:
        if len(self.failures) < 50:
            self.failures.append(msg)
        self.stop = True

    def _take(self, kind: str, ident: int, tok: int) -> None:
        owners = self.row_owner if kind == "row" else self.page_owner
        prev = owners.get(ident)
        if prev is not None:
            self.fail(f"{kind} {ident} granted to {tok} while held by {prev} (double grant)")
        for cond in self.waits.pop((kind, ident), ()):
            if cond[0] == "fence":
                if not cond[1].query():
                    self.fail(f"{kind} {ident} granted to {tok} while {cond[1]!r} is open")
            else:
                _, s, k = cond
                if self.passed[s] < k:
                    self.fail(
                        f"{kind} {ident} granted to {tok} before stream {s} ran past gate {k}"
                    )
        owners[ident] = tok

    def grant_row(self, row: int, tok: int) -> None:
        if not 0 < row <= ROWS:
            self.fail(f"row {row} out of range")
        self._take("row", row, tok)
        self.uses[row] = []

    def grant_pages(self, pages: list[int], tok: int) -> None:
        if len(set(pages)) != len(pages):
            self.fail(f"grant {tok}: duplicate pages {pages}")
        for p in pages:
            if not 0 < p <= PAGES:
                self.fail(f"page {p} out of range")
            self._take("page", p, tok)

    def conds(self, fences: list[Any], after: int | None) -> list[tuple[Any, ...]]:
        out: list[tuple[Any, ...]] = [("fence", f) for f in fences]
        if after is not None:
            out.append(("gate", after, self.launched[after]))
        return out

    def release_pages(self, tok: int, pages: list[int], conds: list[tuple[Any, ...]]) -> None:
        for p in pages:
            if self.page_owner.get(p) != tok:
                self.fail(f"page {p} freed by {tok} but owned by {self.page_owner.get(p)}")
            self.page_owner.pop(p, None)
            if conds:
                self.waits[("page", p)] = conds

    def release_row(self, tok: int, row: int, fence: Any, after: int | None) -> list[Any]:
        if self.row_owner.get(row) != tok:
            self.fail(f"row {row} freed by {tok} but owned by {self.row_owner.get(row)}")
        self.row_owner.pop(row, None)
        fences = self.uses.pop(row, [])
        if fence is not None:
            fences = [*fences, fence]
        conds = self.conds(fences, after)
        if conds:
            self.waits[("row", row)] = conds
        return conds

    def check(self) -> None:
        self.checks += 1
        pool, kv = self.pool, self.kv
        try:
            pool.check_invariants()
        except AssertionError as exc:
            self.fail(f"check_invariants after {self.ops} ops: {exc}")
            return
        st = pool.stats()
        if st.quarantined or st.pages_quarantined:
            self.fail("memory quarantined without any fault")
        if st.pages_free + st.pages_allocated + st.pages_pending != st.pages_capacity:
            self.fail(f"page stats do not add up: {st}")
        led, pled = pool._ledger, kv.ledger
        for r, tok in self.row_owner.items():
            if led.state_of(r) != "allocated":
                self.fail(f"row {r} held by {tok} but the pool says {led.state_of(r)}")
        for p, tok in self.page_owner.items():
            if pled.state_of(p) != "allocated":
                self.fail(f"page {p} held by {tok} but the ledger says {pled.state_of(p)}")
        # (More may be allocated: granted waiters that have not resumed yet.)
        if len(self.page_owner) > st.pages_allocated:
            self.fail(f"shadow holds {len(self.page_owner)} pages, pool {st.pages_allocated}")

    # ------------------------------------------------------------ fences

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
        gates = self.open_gates[rng.randrange(len(self.streams))]
        if gates:
            i = rng.randrange(len(gates))
            gates[i], gates[-1] = gates[-1], gates[i]
            gates.pop().set()

    def pick_fence(self, rng: random.Random) -> Any:
        if rng.random() < 0.25:  # a transfer handle
            if self.handles and rng.random() < 0.7:
                return rng.choice(self.handles)
            return self.handle_done
        f = self.current[rng.randrange(len(self.streams))]
        return f if f is not None else self.handle_done

    def open_everything(self) -> None:
        for gates in self.open_gates:
            for ev in gates:
                ev.set()
            gates.clear()
        for hd in self.handles:
            hd.set()
        self.handles.clear()


async def clock(h: Shadow) -> None:
    rng = random.Random(SEED)
    while not h.done:
        for _ in range(4):
            if rng.random() < 0.4:
                h.new_gate(rng)
            if rng.random() < 0.55:
                h.open_random_gate(rng)
            if rng.random() < 0.03 and len(h.handles) < 12:
                h.handles.append(Handle())
            if h.handles and rng.random() < 0.03:
                h.handles.pop(rng.randrange(len(h.handles))).set()
        if h.stop:
            h.open_random_gate(rng)
        await asyncio.sleep(0)


def pick_pages(rng: random.Random) -> int:
    x = rng.random()
    if x < 0.05:
        return 0
    if x < 0.7:
        return rng.randint(1, 8)
    if x < 0.97:
        return rng.randint(9, 40)
    return rng.randint(41, PAGES)


class Req:
    """A request a worker holds: its token, row, and the pages it owns."""

    __slots__ = ("pages", "row", "tok")

    def __init__(self, tok: int, row: int, pages: list[int]) -> None:
        self.tok = tok
        self.row = row
        self.pages = pages


async def worker(h: Shadow, wid: int, max_held: int) -> None:
    rng = random.Random(SEED * 1_000_003 + wid)
    pool, kv = h.pool, h.kv
    held: list[Req] = []
    detached: list[tuple[int, list[int]]] = []

    def granted(row: int, pages: torch.Tensor) -> Req:
        tok = next(h.tokens)
        ids = pages.tolist()
        h.grant_row(row, tok)
        h.grant_pages(ids, tok)
        if pool.pages_of(row).tolist() != ids:
            h.fail(f"pages_of({row}) != granted pages")
        return Req(tok, row, ids)

    def free_req(i: int | None = None) -> None:
        idx = rng.randrange(len(held)) if i is None else i
        req = held[idx]
        held[idx] = held[-1]
        held.pop()
        mode = rng.random()
        fence: Any = None
        after: int | None = None
        if mode < 0.45:
            h.count("free")
            pool.free([req.row])
        elif mode < 0.75:
            fence = h.pick_fence(rng)
            h.count("free_fence")
            pool.free([req.row], fence=fence)
        else:
            after = rng.randrange(NSTREAMS)
            h.count("free_after")
            pool.free([req.row], after=h.streams[after])
        conds = h.release_row(req.tok, req.row, fence, after)
        h.release_pages(req.tok, req.pages, conds)

    def free_detached() -> None:
        tok, pages = detached.pop(rng.randrange(len(detached)))
        mode = rng.random()
        if mode < 0.4:
            h.count("kv_free")
            kv.free(pages)
            h.release_pages(tok, pages, [])
        elif mode < 0.7:
            f = h.pick_fence(rng)
            h.count("kv_free_fence")
            kv.free(pages, fence=f)
            h.release_pages(tok, pages, h.conds([f], None))
        else:
            s = rng.randrange(NSTREAMS)
            h.count("kv_free_after")
            kv.free(pages, after=h.streams[s])
            h.release_pages(tok, pages, h.conds([], s))

    async def admit() -> None:
        k = pick_pages(rng)
        # Waiting unbounded only while holding nothing (no hold-and-wait in
        # the workload itself).
        timeout = rng.choice((0.0, 0.0005, 0.002, 0.01)) if held or detached else rng.choice(
            (None, None, 0.001, 0.01)
        )
        h.count("admit")
        try:
            g = await pool.admit(pages=k, priority=rng.randrange(3), timeout=timeout)
        except TimeoutError:
            h.note("timeouts_seen")
            return
        if len(g.pages) != k:
            h.fail(f"admit(pages={k}) granted {len(g.pages)} pages")
        held.append(granted(g.row, g.pages))

    async def cancel_admit() -> None:
        h.count("admit_cancelled")
        task = asyncio.create_task(pool.admit(pages=pick_pages(rng), priority=rng.randrange(3)))
        for _ in range(rng.randrange(4)):
            await asyncio.sleep(0)
        task.cancel()
        if held and rng.random() < 0.5:
            free_req()  # same tick: the grant may land on the cancelled waiter
        try:
            g = await task
        except asyncio.CancelledError:
            h.note("cancelled")
            if asyncio.current_task().cancelling():  # type: ignore[union-attr]
                raise
            return
        held.append(granted(g.row, g.pages))

    async def alloc_row() -> None:
        h.count("alloc")
        try:
            rows = await pool.alloc(1, priority=rng.randrange(3), timeout=0.002)
        except TimeoutError:
            h.note("timeouts_seen")
            return
        held.append(granted(rows[0], torch.zeros(0, dtype=torch.int64)))

    while not h.stop:
        op = rng.random()
        if op < 0.24:
            await admit()
        elif op < 0.30:
            h.count("try_admit")
            g = pool.try_admit(pages=pick_pages(rng))
            if g is not None:
                h.note("try_admit_hit")
                held.append(granted(g.row, g.pages))
        elif op < 0.34:
            await alloc_row()
        elif op < 0.40:
            await cancel_admit()
        elif op < 0.52:
            req = held[rng.randrange(len(held))] if held else None
            if req is not None and len(req.pages) < 48:
                h.count("extend")
                more = pool.extend(req.row, rng.randint(1, 4))
                if more is not None:
                    h.note("extend_hit")
                    ids = more.tolist()
                    h.grant_pages(ids, req.tok)
                    req.pages += ids
        elif op < 0.57:
            if held:
                req = held[rng.randrange(len(held))]
                h.count("detach")
                pages = pool.detach_pages(req.row).tolist()
                if pages != req.pages:
                    h.fail(f"detach_pages({req.row}) returned {pages}, owned {req.pages}")
                if pages:
                    detached.append((req.tok, pages))
                req.pages = []
        elif op < 0.68:
            if held:
                req = held[rng.randrange(len(held))]
                f = h.pick_fence(rng)
                h.count("record_use")
                pool.record_use([req.row], f)
                h.uses[req.row].append(f)
        elif op < 0.74:
            if detached:
                free_detached()
        elif held:
            free_req()
        if len(held) > max_held:
            free_req()
        if len(detached) > 2:
            free_detached()
        if rng.random() < 0.6:
            await asyncio.sleep(0)
    while held:
        free_req(len(held) - 1)
    while detached:
        free_detached()


async def test_admit_stress(request: pytest.FixtureRequest, capsys: Any) -> None:
    t0 = time.perf_counter()
    streams = [HostStream(f"admit-stress-{i}") for i in range(NSTREAMS)]
    kv = KVPagePool(PAGES + 1, 4)
    pool = AsyncReqToTokenPool(ROWS + 1, 8, kv=kv)
    h = Shadow(pool, kv, streams)
    clock_task = asyncio.create_task(clock(h))
    results: list[BaseException | None] = []
    hung = False
    try:
        wid = 0
        for nworkers, share, max_held in PHASES:
            if h.failures:
                break
            h.stop = False
            h.target = h.ops + int(TARGET_OPS * share)
            workers = [asyncio.create_task(worker(h, wid + i, max_held)) for i in range(nworkers)]
            wid += nworkers
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
        f"admit stress[{loop_name}]: {h.ops} pool ops in {elapsed:.1f}s; admits={st.admits} "
        f"timeouts={st.timeouts} cancellations={st.cancellations} "
        f"page fences={kv.stats().deferred_frees} pages deferred, fences={sum(h.launched)} "
        f"checks={h.checks} counts={dict(sorted(h.counts.items()))}"
    )
    with capsys.disabled():
        print("\n" + summary)

    assert not hung, f"workers hung after {h.ops} ops: {summary}"
    assert not errors, errors[:3]
    assert not h.failures, "\n".join(h.failures[:10])
    assert h.ops >= TARGET_OPS
    assert not h.row_owner and not h.page_owner
    assert st.allocated == 0 and st.pending == 0 and st.waiters == 0
    assert st.pages_allocated == 0 and st.pages_pending == 0 and st.pages_quarantined == 0
    assert st.free == ROWS and st.pages_free == PAGES
    # the run exercised what it claims to
    assert kv.stats().deferred_frees > 0 and kv.stats().reclaimed > 0
    assert st.timeouts > 0 and st.cancellations > 0 and st.admit_wait.count > 0
    for what in ("extend_hit", "detach", "kv_free_fence", "try_admit_hit", "free_after"):
        assert h.counts.get(what, 0) > 0, what
