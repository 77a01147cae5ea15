"""Admission stress: tasks admitting rows with KV pages while fences complete at random.

Worker tasks ``admit`` (and ``try_admit``, and row-only ``alloc`` in the same
queue) with random page counts, priorities, timeouts and cancellations
(including the same-tick ``task.cancel(); pool.free(row)`` race), grow rows
with ``extend`` and ``extend_rows``, hand pages off with ``detach_pages`` and free them later to
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
import time
from typing import Any

import pytest
import torch
from harness import Cond, ShadowBase, loop_id, run_phases, show

from asyncpool import AsyncReqToTokenPool, HostStream, KVPagePool, PoolStats

SCALE = float(os.environ.get("ASYNCPOOL_STRESS_SCALE") or "1")
TARGET_OPS = max(2_000, int(100_000 * SCALE))
SEED = int(os.environ.get("ASYNCPOOL_STRESS_SEED") or "20261201")
ROWS = 64
PAGES = 512
NSTREAMS = 3
MAX_OPEN_GATES = 6
MAX_HANDLES = 12  # transfer handles (fences of unknown origin) open at once
HANDLE_SHARE = 0.25  # of the fences picked: transfer handles
HANDLE_SYNC_S = 60.0  # a handle's synchronize() gives up after this
CHECK_EVERY = 500
# Few workers first (fast paths, try_admit hits), then many (always queued).
PHASES = ((16, 0.4, 3), (400, 0.6, 2))  # workers, share of ops, max held requests
BUDGET_S = 240 * max(1.0, SCALE)


class Shadow(ShadowBase):
    """Who holds which row and page, and what each freed one waits for."""

    def __init__(self, pool: AsyncReqToTokenPool, kv: KVPagePool, streams: list[HostStream]):
        super().__init__(
            pool,
            streams,
            seed=SEED,
            target=TARGET_OPS,
            check_every=CHECK_EVERY,
            max_open_gates=MAX_OPEN_GATES,
            max_manual=MAX_HANDLES,
            manual_share=HANDLE_SHARE,
            sync_timeout=HANDLE_SYNC_S,
        )
        self.kv = kv
        self.tokens = itertools.count(1)
        self.row_owner: dict[int, int] = {}
        self.page_owner: dict[int, int] = {}
        self.waits: dict[tuple[str, int], list[Cond]] = {}

    # ------------------------------------------------------------ owners

    def _take(self, kind: str, ident: int, tok: int) -> None:
        owners = self.row_owner if kind == "row" else self.page_owner
        prev = owners.get(ident)
        if prev is not None:
            self.fail(f"{kind} {ident} granted to {tok} while held by {prev} (double grant)")
        self.check_conds(f"{kind} {ident}", tok, self.waits.pop((kind, ident), ()))
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

    def release_pages(self, tok: int, pages: list[int], conds: list[Cond]) -> None:
        for p in pages:
            if self.page_owner.get(p) != tok:
                self.fail(f"page {p} freed by {tok} but owned by {self.page_owner.get(p)}")
            self.page_owner.pop(p, None)
            if conds:
                self.waits[("page", p)] = conds

    def release_row(self, tok: int, row: int, fence: Any, after: int | None) -> list[Cond]:
        if self.row_owner.get(row) != tok:
            self.fail(f"row {row} freed by {tok} but owned by {self.row_owner.get(row)}")
        self.row_owner.pop(row, None)
        conds = self.row_conds(row, fence, after)
        if conds:
            self.waits[("row", row)] = conds
        return conds

    def cross_check(self, st: PoolStats) -> None:
        if st.quarantined or st.pages_quarantined:
            self.fail("memory quarantined without any fault")
        if st.pages_free + st.pages_allocated + st.pages_pending != st.pages_capacity:
            self.fail(f"page stats do not add up: {st}")
        led, pled = self.pool._ledger, self.kv.ledger
        for r, tok in self.row_owner.items():
            if led.state_of(r) != "allocated":
                self.fail(f"row {r} held by {tok} but the pool says {led.state_of(r)}")
        row_pages = {p for r in self.row_owner for p in self.pool.pages_of(r).tolist()}
        for p, tok in self.page_owner.items():
            # A row's pages are OWNED (kv.free refuses them); detached ones
            # are ALLOCATED, the caller's to free.
            want = "owned by a row" if p in row_pages else "allocated"
            if pled.state_of(p) != want:
                self.fail(f"page {p} held by {tok} but the ledger says {pled.state_of(p)}")
        # (More may be allocated: granted waiters that have not resumed yet.)
        if len(self.page_owner) > st.pages_allocated:
            self.fail(f"shadow holds {len(self.page_owner)} pages, pool {st.pages_allocated}")


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
        timeout = (
            rng.choice((0.0, 0.0005, 0.002, 0.01))
            if held or detached
            else rng.choice((None, None, 0.001, 0.01))
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
        elif op < 0.45 and held:
            # A decode step's growth: distinct rows, all or nothing.
            batch = rng.sample(held, rng.randint(1, min(4, len(held))))
            batch = [req for req in batch if len(req.pages) < 48]
            k = rng.randint(1, 2)
            h.count("extend_rows")
            got = pool.extend_rows([req.row for req in batch], k)
            if got is not None:
                h.note("extend_rows_hit")
                if tuple(got.shape) != (len(batch), k):
                    h.fail(f"extend_rows gave shape {tuple(got.shape)} for {len(batch)} rows")
                for req, line in zip(batch, got.tolist(), strict=True):
                    h.grant_pages(line, req.tok)
                    req.pages += line
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
                h.record_use([req.row], h.pick_fence(rng))
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


# Its own watchdog fails a stall in ~30 s; this bound covers the whole budget.
@pytest.mark.timeout(BUDGET_S + 60)
async def test_admit_stress(request: pytest.FixtureRequest, capsys: Any) -> None:
    t0 = time.perf_counter()
    streams = [HostStream(f"admit-stress-{i}") for i in range(NSTREAMS)]
    kv = KVPagePool(PAGES + 1, 4)
    pool = AsyncReqToTokenPool(ROWS + 1, 8, kv=kv)
    h = Shadow(pool, kv, streams)

    def begin(phase: tuple[int, float, int]) -> int:
        nworkers, share, _max_held = phase
        h.target = h.ops + int(TARGET_OPS * share)
        return nworkers

    run = await run_phases(
        h,
        PHASES,
        begin=begin,
        worker=lambda wid, phase: worker(h, wid, phase[2]),
        budget_s=BUDGET_S,
    )
    hung, errors, st = run.hung, run.errors, run.stats
    elapsed = time.perf_counter() - t0
    summary = (
        f"admit stress[{loop_id(request)}]: {h.ops} pool ops in {elapsed:.1f}s; "
        f"admits={st.admits} timeouts={st.timeouts} cancellations={st.cancellations} "
        f"page fences={kv.stats().deferred_frees} pages deferred, fences={sum(h.launched)} "
        f"checks={h.checks} counts={dict(sorted(h.counts.items()))}"
    )
    show(capsys, summary)

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
    for what in (
        "extend_hit",
        "extend_rows_hit",
        "detach",
        "kv_free_fence",
        "try_admit_hit",
        "free_after",
    ):
        assert h.counts.get(what, 0) > 0, what
