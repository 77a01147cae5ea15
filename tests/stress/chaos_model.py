"""The shadow model of ``test_chaos.py``: its fences, and who holds which row and page.

* :class:`Stream`: an ordered stream of ``HostFence`` objects that the test
  settles (or faults) in record order, from the pool's thread;
* :func:`state` / :func:`newest`: a fence's state, and the fences a free
  really waits for (the pool keeps only the newest of each ordered stream);
* :class:`Shadow`: the pool and every fence, the owner of every row and page,
  what each freed one waits for, and the checks: at each grant
  (:meth:`Shadow.take`, :meth:`Shadow.on_grant`), after each step
  (:meth:`Shadow.check`, :meth:`Shadow.head_fits`) and at the end
  (:meth:`Shadow.check_end`).

Imported as the top-level module ``chaos_model``, as ``harness`` is.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import random
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from helpers import EventFence, Streams

from asyncpool import (
    AsyncReqToTokenPool,
    HostFence,
    KVPagePool,
    ReqToTokenPoolInfo,
    new_stream_key,
)

ROWS, PAGES = 8, 24


class Fail(AssertionError):
    """A check of the shadow model failed."""


class Stream:
    """An ordered stream whose ``HostFence``s the test settles in record order."""

    def __init__(self) -> None:
        self.key, self.seq = new_stream_key(), 0
        self.pending: collections.deque[HostFence] = collections.deque()

    def record(self) -> HostFence:
        self.seq += 1
        self.pending.append(HostFence(self.key, self.seq))
        return self.pending[-1]

    def advance(self, n: int) -> None:
        for _ in range(min(n, len(self.pending))):
            self.pending.popleft()._settle(None)

    def fault(self) -> None:
        err = RuntimeError(f"stream {self.key} faulted")
        while self.pending:
            self.pending.popleft()._settle(err)


def state(f: Any) -> str:
    try:
        return "done" if f.query() else "open"
    except Exception:
        return "fault"


def newest(fences: list[Any]) -> list[Any]:
    """The newest fence of each ordered stream, and every other fence once."""
    by_key: dict[int, Any] = {}
    rest: list[Any] = []
    for f in fences:
        key = getattr(f, "stream_key", None)
        if key is None:
            if not any(f is g for g in rest):
                rest.append(f)
        elif key not in by_key or f.seq > by_key[key].seq:
            by_key[key] = f
    return [*by_key.values(), *rest]


@dataclass
class Wait:
    """What a freed row or page waits for: fences open at the free, and the
    after= stream's gate ``gate`` (0: none)."""

    fences: list[Any]
    gate: int


@dataclass
class Req:
    """A request the test holds: its row, the pages the row owns, the fences used on it."""

    tok: int
    row: int
    pages: list[int]
    uses: list[Any] = field(default_factory=list)


def _gate(ev: threading.Event, passed: list[int], k: int) -> None:
    ev.wait()
    passed[0] = k


class Shadow:
    """The pool, its fences, and who holds (or waits for) which row and page."""

    def __init__(self, seed: int, kit: Streams, *, kv: bool) -> None:
        self.rng = random.Random(seed)
        self.kit = kit
        self.kv = KVPagePool(PAGES + 1, 4) if kv else None
        self.pool = AsyncReqToTokenPool(ROWS + 1, 32, kv=self.kv)
        self.streams = [Stream() for _ in range(3)]
        self.loose: list[EventFence] = []  # fences of unknown origin
        # after=: gate k holds this stream until opened; the fence the pool
        # records there for that free is its k-th (nothing else records on it).
        self.hs = kit.stream("chaos-after")
        self.gates: collections.deque[threading.Event] = collections.deque()
        self.launched, self.passed = 0, [0]
        self.toks = itertools.count(1)
        self.reqs: dict[int, Req] = {}
        self.owner: dict[tuple[str, int], int] = {}  # ("row"|"page", id) -> token
        self.detached: list[tuple[torch.Tensor, list[int], list[Any]]] = []  # pages, uses
        self.waits: dict[tuple[str, int], Wait] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.errors: list[str] = []  # raised in waiter tasks, reported by check()
        self.counts: collections.Counter[str] = collections.Counter()
        self.deferred = 0  # frees made behind a fence

    # ------------------------------------------------------------ fences

    def pick_fence(self) -> Any:
        if self.rng.random() < 0.7:
            return self.rng.choice(self.streams).record()
        live = [f for f in self.loose if not f.event.is_set()]
        if len(live) > 6:
            return self.rng.choice(live)
        self.loose.append(self.kit.event_fence())
        return self.loose[-1]

    def gate(self) -> int:
        self.launched += 1
        self.gates.append(self.kit.event())
        self.hs.launch(_gate, self.gates[-1], self.passed, self.launched)
        return self.launched

    def complete_some(self) -> None:
        self.rng.choice(self.streams).advance(self.rng.randint(1, 3))
        live = [f for f in self.loose if not f.event.is_set()]
        if live and self.rng.random() < 0.5:
            self.rng.choice(live).set()
        if self.gates and self.rng.random() < 0.3:
            self.gates.popleft().set()

    def fault_one(self) -> None:
        live = [f for f in self.loose if not f.event.is_set()]
        if live and self.rng.random() < 0.5:
            f = self.rng.choice(live)
            f.error = RuntimeError("transfer faulted")
            f.set()
        else:
            i = self.rng.randrange(len(self.streams))
            self.streams[i].fault()
            self.streams[i] = Stream()  # a faulted stream stays faulted: go on on a new one
        self.counts["fault"] += 1

    def complete_all(self) -> None:
        for s in self.streams:
            s.advance(len(s.pending))
        for f in self.loose:
            f.set()
        while self.gates:
            self.gates.popleft().set()

    # ------------------------------------------------------------ grants and frees

    def take(self, kind: str, ident: int, tok: int) -> None:
        """``tok`` was granted row or page ``ident``: nobody holds it, its fences completed."""
        if (kind, ident) in self.owner:
            raise Fail(f"{kind} {ident} granted to {tok}, held by {self.owner[kind, ident]}")
        w = self.waits.pop((kind, ident), Wait([], 0))
        for f in w.fences:
            if state(f) != "done":
                raise Fail(f"{kind} {ident} granted to {tok} while its fence {f!r} is {state(f)}")
        if self.passed[0] < w.gate:
            raise Fail(f"{kind} {ident} granted before the after= stream ran past gate {w.gate}")
        self.owner[kind, ident] = tok

    def on_grant(self, row: int, pages: list[int]) -> Req:
        tok = next(self.toks)
        self.take("row", row, tok)
        for p in pages:
            self.take("page", p, tok)
        pool = self.pool
        lens = [int(t[row]) for t in (pool.verified_lens, pool.alloced_lens, pool.alloced_lens_cpu)]
        if any(lens):
            raise Fail(f"row {row} granted with lengths {lens}: not reset")
        self.reqs[tok] = req = Req(tok, row, pages)
        pool.set_req_pool_info(row, ReqToTokenPoolInfo(2, 3, torch.tensor([tok] * 3)))  # dirty it
        self.counts["granted"] += 1
        return req

    def release(self, kind: str, ident: int, fences: list[Any], gate: int) -> None:
        del self.owner[kind, ident]
        self.waits[kind, ident] = Wait([f for f in newest(fences) if state(f) != "done"], gate)

    def free(self, reqs: list[Req], fence: Any = None, after: bool = False) -> None:
        rows = [r.row for r in reqs]
        gate = self.gate() if after else 0
        form = self.rng.randrange(4)  # list, tensor, array, or a lone int
        arg: Any = rows if form == 0 else torch.tensor(rows) if form == 1 else np.array(rows)
        arg = rows[0] if form == 3 and len(rows) == 1 else arg
        self.pool.free(arg, fence, after=self.hs if after else None)
        fences = [fence] if fence is not None else []
        for r in reqs:
            for kind, ident in [("row", r.row)] + [("page", p) for p in r.pages]:
                self.release(kind, ident, r.uses + fences, gate)
            del self.reqs[r.tok]
        self.deferred += bool(fences or after or any(r.uses for r in reqs))

    def free_detached(self, fence: Any = None, after: bool = False) -> None:
        """``kv.free`` of pages detached earlier (the tensor itself, or their ids)."""
        assert self.kv is not None
        t, pages, uses = self.detached.pop(self.rng.randrange(len(self.detached)))
        gate = self.gate() if after else 0
        if fence is None and uses and self.rng.random() < 0.5:
            fence = uses[-1]  # the last step that used the row, as a caller would
        arg = t if self.rng.random() < 0.5 else pages
        self.kv.free(arg, fence=fence, after=self.hs if after else None)
        for p in pages:
            self.release("page", p, [fence] if fence is not None else [], gate)
        self.deferred += fence is not None or after
        self.counts["kv.free"] += 1

    def forced(self, f: Any, before: dict[tuple[str, int], str]) -> None:
        """``force_release(f)`` ran; ``before``: the states just before it."""
        for key, w in self.waits.items():
            if before[key] == "pending":  # only what waited then was released
                w.fences = [x for x in w.fences if x is not f]
                if getattr(f, "stream_key", None) == self.hs.key and w.gate == f.seq:
                    w.gate = 0

        def forget(uses: list[Any]) -> list[Any]:  # the pool keeps each stream's newest use
            return [u for u in newest(uses) if u is not f]

        for r in self.reqs.values():
            r.uses = forget(r.uses)
        self.detached = [(t, p, forget(uses)) for t, p, uses in self.detached]

    # ------------------------------------------------------------ checks

    def in_flight(self) -> list[tuple[str, int]]:
        """Rows and pages granted to waiter tasks that have not resumed yet."""
        out: list[tuple[str, int]] = []
        for t in self.tasks:
            fut = getattr(t, "_fut_waiter", None)
            if t.done() or fut is None or not fut.done() or fut.cancelled() or fut.exception():
                continue
            got = fut.result()
            rows, pages = (got, []) if isinstance(got, list) else ([got.row], got.pages.tolist())
            out += [("row", r) for r in rows] + [("page", p) for p in pages]
        return out

    def holds(self) -> bool:
        return bool(self.reqs or self.detached or self.in_flight())

    def states(self) -> dict[tuple[str, int], str]:
        out = {("row", r): self.pool._ledger.state_of(r) for r in range(1, ROWS + 1)}
        if self.kv:
            out.update({("page", p): self.kv.ledger.state_of(p) for p in range(1, PAGES + 1)})
        return out

    def check(self) -> None:
        """The pool's invariants hold and what it has out is what the model holds."""
        if self.errors:
            raise Fail(f"in a waiter task: {self.errors[0]}")
        self.pool.check_invariants()
        held = sorted([*self.owner, *self.in_flight()])
        out = sorted(k for k, s in self.states().items() if s in ("allocated", "owned by a row"))
        if out != held:
            raise Fail(f"the pool has out {out}; the model holds, or granted, {held}")
        for r in self.reqs.values():
            got = self.pool.pages_of(r.row).tolist() if self.kv else []
            if sorted(got) != sorted(r.pages):
                raise Fail(f"pages_of({r.row}) = {got}, the model says {r.pages}")

    def head_fits(self) -> tuple[Any, int, int] | None:
        """The head waiter, free rows and pages, if it fits in those (it should be granted)."""
        pool, w = self.pool, self.pool._waiters
        if not w.count or w.gated or pool.closed:
            return None
        head = next((x for p in w._prios for x in w._queues[p] if not x[1].done()), None)
        rows, pages = pool._ledger.free_count, self.kv.ledger.free_count if self.kv else 0
        if head is None:
            return None
        need = head[0]  # n rows, or (1 row, k pages)
        fits = need <= rows if isinstance(need, int) else rows >= 1 and need[1] <= pages
        return (head, rows, pages) if fits else None

    def check_end(self) -> None:
        """Every fence completed, all freed and drained: all is free but exactly what
        was freed behind a fence that faulted (quarantined)."""
        self.check()
        st = self.states()
        faulted = {k for k, w in self.waits.items() if any(state(f) == "fault" for f in w.fences)}
        quarantined = {k for k, s in st.items() if s == "quarantined"}
        if quarantined != faulted:
            raise Fail(f"quarantined {sorted(quarantined)}, freed behind a fault {sorted(faulted)}")
        if any(s not in ("free", "quarantined") for s in st.values()):
            raise Fail(f"at the end, not free: {[(k, s) for k, s in st.items() if s != 'free']}")
        s = self.pool.stats()
        assert s.free + s.quarantined == ROWS, s
        assert not self.kv or s.pages_free + s.pages_quarantined == PAGES, s
