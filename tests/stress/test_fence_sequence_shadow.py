"""Sequences of fences under random operations, checked against a shadow model.

A decode node of disaggregated serving: its rows and their KV pages are read
by the forward stream and by KV transfers, so every call that holds memory
behind fences gets a sequence of them (``fence=[...]``, 0 to 4 fences, as a
list, a tuple or one bare fence): ordered host fences of three streams,
settled by the test in record order (a stream may fault, and is then
replaced), and transfer handles (fences of unknown origin, polled by the
pool's watcher), landed in any order, some failing, some stuck until
``force_release``. Sequences repeat a fence, repeat a row's own recorded
use, mix completed and open fences. One task drives the pool:
``try_admit`` and queued ``admit``/``alloc`` waiters (timeouts, cancels),
``extend``, ``record_use`` of a sequence, ``free`` and ``trim_pages``
behind a sequence and ``after=`` a gated ``HostStream``, ``detach_pages``
then ``kv.free`` behind a sequence; in ``reclaim="explicit"`` mode the
stream fences are retired once settled and ``agree`` (a one-rank gloo
group) settles the transfers.

After every step: ``check_invariants()`` of both pools; the stats add up;
every row and page the shadow holds is allocated in the pool; no row or
page freed behind a fence still open (or faulted) is free or handed out;
no waiter at the head of the queue fits in what is free. Every few dozen
steps, everything not stuck completes and, with nobody calling the pool,
everything must come back (the watcher's wake-ups alone; explicit mode:
after one retire per stream and one agree). At the end all is free but
exactly what was freed behind a fault (quarantined).

``ASYNCPOOL_STRESS_SCALE`` (default 1: 10 seeds of 500 steps per loop and
mode) scales the seeds; ``ASYNCPOOL_STRESS_SEED`` sets the first.
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
from chaos_model import Req
from harness import loop_id, show
from helpers import bounded, spin, until

from asyncpool import (
    AsyncReqToTokenPool,
    CapacityError,
    HostFence,
    HostStream,
    KVPagePool,
    new_stream_key,
    wait_fence,
)

SCALE = float(os.environ.get("ASYNCPOOL_STRESS_SCALE") or "1")
SEED = int(os.environ.get("ASYNCPOOL_STRESS_SEED") or "20261205")
SEEDS = max(1, round(10 * SCALE))
STEPS = 500
QUIESCE_EVERY = 60
ROWS, PAGES, PAGE_SIZE = 10, 40, 4
MAX_HELD = 6  # requests the driver holds at once
MAX_WAITERS = 4
# Page ledger states, as the row ledger's (asyncpool.ledger) plus OWNED.
FREE, PENDING, QUARANTINED = 0, 2, 3


class Fail(AssertionError):
    pass


class Stream:
    """Ordered host fences the test settles (or faults) in record order."""

    def __init__(self) -> None:
        self.key, self.seq = new_stream_key(), 0
        self.pending: list[HostFence] = []
        self.last: HostFence | None = None

    def record(self) -> HostFence:
        self.seq += 1
        self.last = HostFence(self.key, self.seq)
        self.pending.append(self.last)
        return self.last

    def settle(self, n: int) -> list[HostFence]:
        done, self.pending = self.pending[:n], self.pending[n:]
        for f in done:
            f._settle(None)
        return done

    def fault(self) -> None:
        err = RuntimeError(f"stream {self.key} faulted")
        for f in self.pending:
            f._settle(err)
        self.pending = []


class Transfer:
    """A transfer handle: lands, fails, or is stuck until force-released."""

    _ids = itertools.count(1)

    def __init__(self, stuck: bool = False) -> None:
        self.n = next(self._ids)
        self.landed = False
        self.failed = False
        self.stuck = stuck

    def __repr__(self) -> str:
        return f"<Transfer {self.n}{' stuck' if self.stuck else ''}>"

    def query(self) -> bool:
        if self.failed:
            raise RuntimeError(f"transfer {self.n} failed")
        return self.landed

    def synchronize(self) -> None:
        raise AssertionError("the pool never blocks in a transfer's synchronize()")


class Gated:
    """A ``HostStream`` for ``after=``, held by gates the test opens in order:
    a fence recorded on it after gate ``k`` completes once ``passed >= k``."""

    def __init__(self) -> None:
        self.stream = HostStream("seq-shadow-after")
        self.launched = 0
        self.passed = 0
        self.gates: list[threading.Event] = []

    def _run(self, ev: threading.Event, k: int) -> None:
        ev.wait(30)
        self.passed = k

    def launch(self) -> None:
        ev = threading.Event()
        self.launched += 1
        self.stream.launch(self._run, ev, self.launched)
        self.gates.append(ev)

    def open(self, n: int) -> None:
        for ev in self.gates[:n]:
            ev.set()
        del self.gates[:n]

    def close(self) -> None:
        self.open(len(self.gates))
        self.stream.close()


class Model:
    def __init__(self, pool: AsyncReqToTokenPool, kv: KVPagePool, seed: int, explicit: bool):
        self.pool, self.kv, self.explicit = pool, kv, explicit
        self.rng = random.Random(seed)
        self.seed = seed
        self.streams = [Stream() for _ in range(3)]
        self.retired_streams: list[Stream] = []
        self.transfers: list[Transfer] = []  # not landed, not failed
        self.settled: list[Transfer] = []  # landed or failed: reused now and then
        self.gated = Gated()
        self.toks = itertools.count(1)
        self.held: list[Req] = []
        self.detached: list[tuple[int, list[int], list[Any]]] = []
        self.row_owner: dict[int, int] = {}
        self.page_owner: dict[int, int] = {}
        # What a freed row or page waits for: fences, and ("after", k).
        self.waits: dict[tuple[str, int], list[Any]] = {}
        self.waiters: list[tuple[asyncio.Task[Any], int]] = []
        self.counts: dict[str, int] = {}
        self.step = 0

    # ------------------------------------------------------------ fences

    def note(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def state(self, cond: Any) -> str:
        if cond.__class__ is tuple:
            return "done" if self.gated.passed >= cond[1] else "open"
        try:
            return "done" if cond.query() else "open"
        except Exception:
            return "fault"

    def pick_fence(self, req: Req | None, prev: list[Any]) -> Any:
        rng = self.rng
        x = rng.random()
        if x < 0.4:
            s = rng.choice(self.streams)
            if s.last is None or rng.random() < 0.5:
                return s.record()
            return s.last if rng.random() < 0.6 or not s.pending else rng.choice(s.pending)
        if x < 0.45 and self.settled:
            self.note("settled_transfer")
            return rng.choice(self.settled)
        if x < 0.75:
            live = [t for t in self.transfers if not t.stuck]
            if live and rng.random() < 0.5:
                return rng.choice(live)
            if len(self.transfers) < 10:
                t = Transfer()
                self.transfers.append(t)
                return t
            return rng.choice(self.transfers)
        if x < 0.85 and req is not None and req.uses:
            self.note("own_use_in_fence")
            return rng.choice(req.uses)
        if x < 0.93 and prev:
            self.note("repeated_fence")
            return rng.choice(prev)
        stuck = [t for t in self.transfers if t.stuck]
        if len(stuck) < 2:
            t = Transfer(stuck=True)
            self.transfers.append(t)
            return t
        return rng.choice(stuck)

    def pick_seq(self, req: Req | None = None) -> tuple[Any, list[Any]]:
        """A ``fence=`` argument and the fences it names."""
        rng = self.rng
        n = rng.choice((0, 1, 1, 2, 2, 3, 4))
        fences: list[Any] = []
        for _ in range(n):
            fences.append(self.pick_fence(req, fences))
        form = rng.random()
        if n == 0:
            return (None if form < 0.3 else [] if form < 0.7 else ()), []
        if n == 1 and form < 0.4:
            return fences[0], fences
        self.note(f"seq{n}")
        return (list(fences) if form < 0.7 else tuple(fences)), fences

    def pick_after(self) -> tuple[Any, list[Any]]:
        if self.rng.random() < 0.25:
            if self.rng.random() < 0.5:
                self.gated.launch()
            self.note("after")
            return self.gated.stream, [("after", self.gated.launched)]
        return None, []

    # ------------------------------------------------------------ owners

    def take(self, kind: str, ident: int, tok: int) -> None:
        owners = self.row_owner if kind == "row" else self.page_owner
        if ident in owners:
            raise Fail(f"{kind} {ident} granted to {tok} while held by {owners[ident]}")
        conds = self.waits.pop((kind, ident), [])
        for c in conds:
            if self.state(c) != "done":
                raise Fail(f"{kind} {ident} granted to {tok} behind {c!r} ({self.state(c)})")
        owners[ident] = tok

    def granted(self, row: int, pages: list[int]) -> Req:
        tok = next(self.toks)
        self.take("row", row, tok)
        for p in pages:
            self.take("page", p, tok)
        if self.pool.pages_of(row).tolist() != pages:
            raise Fail(f"pages_of({row}) != granted {pages}")
        req = Req(tok, row, list(pages))
        self.held.append(req)
        return req

    def give(self, kind: str, ident: int, tok: int, conds: list[Any]) -> None:
        owners = self.row_owner if kind == "row" else self.page_owner
        if owners.get(ident) != tok:
            raise Fail(f"{kind} {ident} freed by {tok}, held by {owners.get(ident)}")
        del owners[ident]
        if conds:
            self.waits[(kind, ident)] = list(conds)

    # ------------------------------------------------------------ operations

    def free_reqs(self, reqs: list[Req]) -> None:
        fence, fences = self.pick_seq(reqs[0])
        after, later = self.pick_after()
        rows = [r.row for r in reqs]
        self.note("free")
        self.pool.free(rows, fence, after=after)
        for r in reqs:
            self.held.remove(r)
            conds = [*r.uses, *fences, *later]
            self.give("row", r.row, r.tok, conds)
            for p in r.pages:
                self.give("page", p, r.tok, conds)

    def trim(self, reqs: list[Req]) -> None:
        keep = self.rng.randrange(3)
        fence, fences = self.pick_seq(reqs[0])
        after, later = self.pick_after()
        self.note("trim_pages")
        self.pool.trim_pages([r.row for r in reqs], keep, fence, after=after)
        for r in reqs:
            conds = [*r.uses, *fences, *later]
            for p in r.pages[keep:]:
                self.give("page", p, r.tok, conds)
            del r.pages[keep:]

    def kv_free(self) -> None:
        tok, pages, uses = self.detached.pop(self.rng.randrange(len(self.detached)))
        fence, fences = self.pick_seq()
        # The engine's part (detach_pages' contract): the row's newest step
        # goes with the pages, and every transfer that read them.
        extra = [*{id(f): f for f in uses}.values()]
        fences = [*extra, *fences]
        after, later = self.pick_after()
        self.note("kv_free")
        self.kv.free(pages, fence=fences if fences else fence, after=after)
        for p in pages:
            self.give("page", p, tok, [*fences, *later])

    def on_waiter_done(self) -> None:
        keep = []
        for task, k in self.waiters:
            if not task.done():
                keep.append((task, k))
                continue
            if task.cancelled():
                self.note("waiter_cancelled")
                continue
            exc = task.exception()
            if exc is not None:
                if not isinstance(exc, (TimeoutError, CapacityError)):
                    raise Fail(f"waiter raised {exc!r}")
                self.note(f"waiter_{type(exc).__name__}")
                continue
            g = task.result()
            self.note("waiter_granted")
            if isinstance(g, list):
                self.granted(g[0], [])
            else:
                self.granted(g.row, g.pages.tolist())
        self.waiters = keep

    async def op(self) -> None:
        rng, pool = self.rng, self.pool
        x = rng.random()
        if x < 0.14:
            k = rng.randrange(7)
            if len(self.held) < MAX_HELD and rng.random() < 0.6:
                self.note("try_admit")
                try:
                    g = pool.try_admit(pages=k)
                except CapacityError:  # quarantine: it can never fit
                    self.note("try_admit_CapacityError")
                    g = None
                if g is not None:
                    self.granted(g.row, g.pages.tolist())
            elif len(self.waiters) < MAX_WAITERS:
                t = rng.choice((None, None, 0.001, 0.02))
                coro = (
                    pool.alloc(1, timeout=t)
                    if rng.random() < 0.2
                    else pool.admit(pages=k, timeout=t)
                )
                self.waiters.append((asyncio.ensure_future(coro), k))
                self.note("queued")
        elif x < 0.20 and self.held:
            r = rng.choice(self.held)
            got = pool.extend(r.row, rng.randint(1, 3))
            self.note("extend")
            if got is not None:
                ids = got.tolist()
                for p in ids:
                    self.take("page", p, r.tok)
                r.pages += ids
        elif x < 0.32 and self.held:
            reqs = rng.sample(self.held, rng.randint(1, len(self.held)))
            fence, fences = self.pick_seq(reqs[0])
            self.note("record_use")
            pool.record_use([r.row for r in reqs], fence if fence is not None else [])
            for r in reqs:
                r.uses += fences
        elif x < 0.44 and self.held:
            self.free_reqs(rng.sample(self.held, rng.randint(1, min(3, len(self.held)))))
        elif x < 0.50 and self.held:
            self.trim(rng.sample(self.held, rng.randint(1, len(self.held))))
        elif x < 0.55 and self.held:
            r = rng.choice(self.held)
            pages = pool.detach_pages(r.row).tolist()
            self.note("detach")
            if pages != r.pages:
                raise Fail(f"detach_pages({r.row}) gave {pages}, owned {r.pages}")
            if pages:
                newest = [u for u in r.uses if not isinstance(u, Transfer)][-1:]
                self.detached.append((r.tok, pages, [*newest, *r.uses[-2:]]))
            r.pages = []
        elif x < 0.62 and self.detached:
            self.kv_free()
        elif x < 0.86:
            self.complete()
        elif x < 0.90:
            stuck = [t for t in self.transfers if t.stuck]
            if stuck:
                self.force_release(rng.choice(stuck))
        elif x < 0.94 and self.waiters:
            task, _ = rng.choice(self.waiters)
            task.cancel()
            if self.held and rng.random() < 0.5:
                self.free_reqs([rng.choice(self.held)])  # same tick as the cancel
            self.note("cancel")
        if len(self.held) > MAX_HELD:
            self.free_reqs([self.held[0]])
        if len(self.detached) > 3:
            self.kv_free()
        for _ in range(rng.randrange(3)):
            await asyncio.sleep(0)

    def complete(self) -> None:
        rng = self.rng
        x = rng.random()
        if x < 0.45:
            s = rng.choice(self.streams)
            done = s.settle(rng.randint(1, 3))
            self.note("stream_settled")
            if self.explicit and done:
                self.pool.retire(done[-1])
        elif x < 0.8:
            live = [t for t in self.transfers if not t.stuck]
            if live:
                t = rng.choice(live)
                self.transfers.remove(t)
                self.settled = [*self.settled[-5:], t]
                if rng.random() < 0.03:
                    t.failed = True
                    self.note("transfer_failed")
                else:
                    t.landed = True
                    self.note("transfer_landed")
        elif x < 0.9:
            self.gated.open(rng.randint(1, 2))
        elif x < 0.905:
            i = rng.randrange(3)
            self.streams[i].fault()
            self.retired_streams.append(self.streams[i])
            self.streams[i] = Stream()
            self.note("stream_faulted")
        if self.explicit and rng.random() < 0.3:
            self.note("agree")
            self.pool.agree()

    def force_release(self, t: Transfer) -> None:
        self.note("force_release")
        self.pool.force_release(t)
        self.transfers.remove(t)
        # Treated as completed for what waits now, and forgotten by the
        # rows that recorded it; it never lands.
        for conds in self.waits.values():
            conds[:] = [c for c in conds if c is not t]
        for r in self.held:
            r.uses = [u for u in r.uses if u is not t]
        self.detached = [
            (tok, pages, [u for u in uses if u is not t]) for tok, pages, uses in self.detached
        ]

    # ------------------------------------------------------------ checks

    def check(self) -> None:
        pool, kv = self.pool, self.kv
        pool.check_invariants()
        kv.check_invariants()
        st = pool.stats()
        if st.free + st.allocated + st.pending + st.quarantined != ROWS:
            raise Fail(f"row counts do not add up: {st}")
        if st.pages_free + st.pages_allocated + st.pages_pending + st.pages_quarantined != PAGES:
            raise Fail(f"page counts do not add up: {st}")
        rstate, pstate = pool._ledger._state, kv.ledger._state
        for row in self.row_owner:
            if rstate[row] not in (1, 6):
                raise Fail(f"row {row} held by the shadow is {pool._ledger.state_of(row)}")
        for page in self.page_owner:
            if pstate[page] not in (1, 7):
                raise Fail(f"page {page} held by the shadow is {kv.ledger.state_of(page)}")
        for (kind, ident), conds in self.waits.items():
            st_ = rstate[ident] if kind == "row" else int(pstate[ident])
            if st_ in (PENDING, QUARANTINED):
                continue
            for c in conds:
                if self.state(c) != "done":
                    raise Fail(
                        f"step {self.step}: {kind} {ident} is "
                        f"{'free' if st_ == FREE else 'handed out'} behind {c!r} ({self.state(c)})"
                    )
        w = pool._waiters
        if w.count and not w.gated and not pool.closed:
            head = next((x for p in w._prios for x in w._queues[p] if not x[1].done()), None)
            if head is not None:
                need = head[0]
                rows, pages = pool._ledger.free_count, kv.ledger.free_count
                fits = need <= rows if isinstance(need, int) else rows >= 1 and need[1] <= pages
                if fits:
                    raise Fail(f"step {self.step}: head waiter {need} fits ({rows}, {pages})")

    async def quiesce(self, final: bool = False) -> None:
        """Complete everything not stuck (final: force-release the stuck),
        then with nobody calling the pool everything pending comes back."""
        self.note("quiesce")
        if final:
            for t in [t for t in self.transfers if t.stuck]:
                self.force_release(t)
        for s in self.streams:
            s.settle(len(s.pending))
        for t in [t for t in self.transfers if not t.stuck]:
            t.landed = True
            self.transfers.remove(t)
        self.gated.open(len(self.gated.gates))
        marker = self.gated.stream.record()
        async with bounded():
            await wait_fence(marker)
        stuck = [t for t in self.transfers if t.stuck]
        if self.explicit:
            for s in self.streams:
                if s.last is not None:
                    self.pool.retire(s.last)
            self.pool.retire(marker)
            self.pool.agree()
        # Nobody calls the pool here: the watcher's wake-ups alone (auto
        # mode), or the calls above (explicit), bring back everything that
        # waits for nothing stuck.
        led, pled = self.pool._ledger, self.kv.ledger

        def settled() -> bool:
            held = {id(f) for f in stuck}
            rows = sum(
                b.n for b in led._batches() if any(id(f) in held for f in (b.fence, *b.rest))
            )
            pages = sum(
                b.n for b in pled._batches() if any(id(f) in held for f in (b.fence, *b.rest))
            )
            return led.pending == rows and pled.pending == pages

        await until(settled)
        await spin()
        self.on_waiter_done()
        self.check()

    def check_end(self) -> None:
        faulted = {
            k for k, conds in self.waits.items() if any(self.state(c) == "fault" for c in conds)
        }
        rstate, pstate = self.pool._ledger._state, self.kv.ledger._state
        quarantined = {("row", r) for r in range(1, ROWS + 1) if rstate[r] == QUARANTINED}
        quarantined |= {("page", p) for p in range(1, PAGES + 1) if pstate[p] == QUARANTINED}
        if quarantined != faulted:
            raise Fail(
                f"quarantined {sorted(quarantined)} != freed behind a fault {sorted(faulted)}"
            )
        st = self.pool.stats()
        assert st.allocated == 0 and st.pending == 0 and st.pages_pending == 0, st
        assert st.free + st.quarantined == ROWS, st
        assert st.pages_free + st.pages_quarantined == PAGES, st


async def run_seed(seed: int, explicit: bool) -> Model:
    kv = KVPagePool(PAGES + 1, PAGE_SIZE, reclaim="explicit" if explicit else "auto")
    pool = AsyncReqToTokenPool(
        ROWS + 1, PAGES * PAGE_SIZE, kv=kv, reclaim="explicit" if explicit else "auto"
    )
    m = Model(pool, kv, seed, explicit)
    try:
        for m.step in range(STEPS):
            await m.op()
            m.on_waiter_done()
            m.check()
            if m.step % QUIESCE_EVERY == QUIESCE_EVERY - 1:
                await m.quiesce()
        for task, _ in m.waiters:
            task.cancel()
        await asyncio.gather(*(t for t, _ in m.waiters), return_exceptions=True)
        m.on_waiter_done()
        m.waiters = []
        while m.held:
            m.free_reqs([m.held[0]])
        while m.detached:
            m.kv_free()
        await m.quiesce(final=True)
        m.check_end()
    except Exception as exc:
        raise Fail(f"seed {seed} step {m.step}: {exc}") from exc
    finally:
        for task, _ in m.waiters:
            task.cancel()
        await asyncio.gather(*(t for t, _ in m.waiters), return_exceptions=True)
        await pool.close()
        m.gated.close()
    return m


@pytest.mark.timeout(120 * max(1.0, SCALE))
@pytest.mark.parametrize("mode", ["auto", "explicit"])
async def test_fence_sequences_against_a_shadow_model(
    request: pytest.FixtureRequest, capsys: Any, mode: str, group: Any
) -> None:
    t0 = time.perf_counter()
    counts: dict[str, int] = {}
    for i in range(SEEDS):
        async with bounded(60):
            m = await run_seed(SEED + i, mode == "explicit")
        for k, v in m.counts.items():
            counts[k] = counts.get(k, 0) + v
    summary = (
        f"fence sequences[{loop_id(request)}]: {SEEDS} seeds x {STEPS} steps in "
        f"{time.perf_counter() - t0:.1f}s; {dict(sorted(counts.items()))}"
    )
    show(capsys, summary)
    for what in ("seq2", "seq3", "seq4", "own_use_in_fence", "repeated_fence", "after"):
        assert counts.get(what, 0) > 0, what
    for what in ("waiter_granted", "transfer_failed", "force_release", "quiesce", "cancel"):
        assert counts.get(what, 0) > 0, what
