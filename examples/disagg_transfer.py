"""The prefill server of a disaggregated deployment and its transfers: a program that checks itself.

docs/cuda.md's *The prefill side: a transfer that reads the pages*, whole.
A prefill server's overlap loop over ``AsyncReqToTokenPool(kv=KVPagePool(
...), fence_timeout=...)`` admits requests (a row and the prompt's pages in
one ``try_admit``), launches a prefill step that writes their KV (markers:
whose token, which position), ties their rows to the step's fence
(``record_use``) and, once that fence has completed, starts a transfer per
request. A transfer engine on a thread of its own reads a transfer's pages
when it completes, as an RDMA read shipping them to a decode server would,
and compares them with what the prefill wrote: a *mismatched transfer* read
pages that another request had been granted and written meanwhile.
Transfers are plain objects with ``query()`` and ``synchronize()`` (fences
of unknown origin: the pool polls them). Each request's task awaits its
transfer (``wait_fence`` under the server's deadline and the client's
abort), and its transfer, seeded per try, is:

* *accepted* (most): landed, ``pool.free([row])`` frees at once;
* *rejected for now* by the decode server: the row goes back, the pages
  are kept (``detach_pages``) and shipped again by a new transfer, a new
  wrapper (three tries, then the request is dropped);
* *failed cleanly*: stopped reading, answers ``True``; dropped, freed at once;
* *faulted* (``--faults`` a run, since their pages are quarantined for the
  pool's life): ``query()`` raises and the transfer still reads once more,
  later; the pages freed behind it are quarantined;
* *hung*: never lands. The server gives it up at its deadline (the pages
  behind ``[step_fence, transfer]``, then the row); it turns overdue after
  ``fence_timeout``; the operator task has the engine cancel it, which
  confirms it can no longer read, then calls ``pool.force_release``;
* *slow*: lands after the deadline, given up the same way; the pages wait
  for it, and one still reading when overdue is cancelled and released.

Clients abort too: mid-prefill (``free([row])``, held behind the step by
``record_use``) and mid-transfer (the pages behind ``[step_fence,
transfer]``, a retry's kept pages behind its transfer). Checks: 0
mismatched transfers; no page granted while a live transfer may still read
it (the engine's book, at each grant); every row and page back at the end
but the faulted transfers' pages, quarantined. The pool's log lines (a
WARNING per overdue fence and per release, an ERROR per fault) show with
``--verbose``. Two flags put a bug in, and the run must then fail:

* ``--free-without-transfer-fence``: an abort, a give-up or a fault frees
  the pages behind the step fence only, as if the transfer did not read
  them: the next admission gets them while the transfer still reads;
* ``--force-release-slow``: the operator force-releases the overdue
  transfers without having the engine cancel them: a slow one still reads.

The catch is timing, not a gate: a transfer lasts several prefill steps,
the pool is tight, and freed pages are granted and rewritten within a step
or two. Runs on :class:`~asyncpool.HostStream` workers without a GPU and on
CUDA streams when ``torch.cuda.is_available()`` (``--device cpu`` forces
the host streams); the transfer engine is a host thread either way (on
CUDA it reads on a stream of its own). ``--loop uvloop`` runs it on
uvloop. Every wait is bounded (the deadline, the operator,
``asyncio.timeout``). Exit status: 0 when everything checks out, 1
otherwise. Public API only.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import logging
import math
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncpool import AsyncReqToTokenPool, KVPagePool, record_fence, wait_fence

from _engine import DueThread, PagedEngine, prefill, run_loop

MAX_LEN = 64
MARK = 1 << 20  # a request's KV value: (id + 1) * MARK + position
#: Per try of a transfer, seeded: its kind and probability (the rest accepted;
#: --faults first tries fault instead, since their pages are quarantined for life).
MIX = {"rejected": 0.10, "failed": 0.04, "hung": 0.006, "slow": 0.04}
KINDS = ("accepted", "rejected", "failed", "faulted", "hung", "slow")
SHOWN = {"faulted": "raised"}  # a faulted transfer, as the summary names it
TRIES = 3  # a request rejected this often is dropped
RETRY_S = 0.003  # the pause before a rejected request's next try


class TransferError(RuntimeError):
    """A transfer's peer state is unknown: it may still read."""


class Transfer:
    """One read of a request's pages (a wrapper per try), settled by the engine.

    ``kind`` is what it will do (seeded: accepted, rejected, failed,
    faulted, hung, slow); ``state``: reading, done (read), failed (stopped
    reading), cancelled (by the operator, confirmed: it can no longer
    read), faulted (``query()`` raises; one late read still comes).
    """

    def __init__(
        self, engine: TransferEngine, name: str, req: Request, kind: str, late_s: float
    ) -> None:
        self.engine, self.name, self.kind, self.late_s = engine, name, kind, late_s
        self.pages = list(req.pages)
        self.slots, self.expect = req.slots, req.values
        self.state = "reading"

    def query(self) -> bool:
        with self.engine.cond:
            if self.state == "faulted":
                raise TransferError(f"{self.name}: peer state unknown")
            return self.state != "reading"

    def synchronize(self) -> None:
        """Block until settled (as a real handle's would: for ever if hung)."""
        with self.engine.cond:
            self.engine.cond.wait_for(lambda: self.state != "reading")
        self.query()

    def __repr__(self) -> str:
        return f"Transfer({self.name}, {self.kind})"


class TransferEngine:
    """The transfer engine: a thread that reads each transfer's pages when due.

    ``live`` counts, per page, the transfers that may still read it; a read
    copies the pages from the KV cache and compares them with the prefill's
    values (``mismatched``: a page rewritten by its next owner first).
    """

    def __init__(self, engine: PagedEngine) -> None:
        self.kv_cache, self.device = engine.kv_cache, engine.device
        self.clock = DueThread(engine.device)
        self.cond = self.clock.cond
        self.live: collections.Counter[int] = collections.Counter()
        self.hung: list[Transfer] = []  # never settled but by a cancel
        self.reads = self.mismatched = 0

    def start(self, name: str, req: Request, kind: str, duration_s: float) -> Transfer:
        """A transfer of ``req``'s pages that settles ``duration_s`` from now
        (a hung one never does, until cancelled)."""
        t = Transfer(self, name, req, kind, 0.002 + duration_s / 2)  # (a fault's late read)
        with self.cond:
            self.live.update(t.pages)
            if kind == "hung":
                self.hung.append(t)
            else:
                self.clock.at(time.monotonic() + duration_s, functools.partial(self._due, t))
        return t

    def reading(self, pages: list[int]) -> int:
        """How many of ``pages`` a live transfer may still read."""
        with self.cond:
            return sum(1 for p in pages if self.live[p])

    def cancel(self, t: Transfer) -> bool:
        """The operator's cancel: True once ``t`` can no longer read."""
        with self.cond:
            if t.state == "reading":
                self._settle(t, "cancelled")
            return t.state != "faulted"

    def _settle(self, t: Transfer, state: str) -> None:  # under the lock
        t.state = state
        self.live.subtract(t.pages)
        self.cond.notify_all()

    def _read(self, t: Transfer) -> None:  # under the lock: the read, whole
        slots = t.slots.to(self.device) if self.device.type == "cuda" else t.slots
        got = self.kv_cache[slots].cpu()
        self.reads += 1
        self.mismatched += int(not torch.equal(got, t.expect))

    def _due(self, t: Transfer) -> None:  # on the clock's thread, under the lock
        if t.state == "faulted":  # its late read, after query() raised
            self._read(t)
            self.live.subtract(t.pages)
        elif t.state == "reading" and t.kind == "failed":
            self._settle(t, "failed")
        elif t.state == "reading" and t.kind == "faulted":
            t.state = "faulted"
            self.cond.notify_all()
            self.clock.at(time.monotonic() + t.late_s, functools.partial(self._due, t))
        elif t.state == "reading":
            self._read(t)
            self._settle(t, "done")

    def close(self) -> int:
        """Let every due read happen, then cancel what hangs; the pages a
        live transfer still held then (0 unless one was hung)."""
        self.clock.close()
        with self.cond:
            held = sum(self.live.values())
        for t in self.hung:
            self.cancel(t)
        return held


@dataclass(eq=False)
class Request:
    id: int
    npages: int
    abort: str  # "", "prefill" or "transfer"
    abort_at: tuple[int, float]  # mid-transfer: the try, and when in it (a fraction)
    tries: list[tuple[str, float]]  # (kind, duration) per try of its transfer
    row: int = -1
    pages: list[int] = field(default_factory=list)
    parked: Any = None  # the pages kept without the row, for a retry
    slots: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    values: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    step: Any = None  # the prefill step's fence


def plan(rng: random.Random, i: int, args: argparse.Namespace, fault: bool) -> Request:
    """Request ``i``, seeded: its size, its client's abort and its transfer's tries
    (the first one faulted if ``fault``)."""
    tries: list[tuple[str, float]] = []
    while len(tries) < TRIES and (not tries or tries[-1][0] == "rejected"):
        x, kind = rng.random(), "accepted"
        for name, p in MIX.items():
            if x < p:
                kind = name
                break
            x -= p
        if fault and not tries:
            kind = "faulted"
        ms = args.transfer_ms * rng.uniform(0.3, 1.7)
        if kind == "slow":
            ms = args.deadline_ms + rng.uniform(0.5, 4) * args.fence_timeout_ms
        tries.append((kind, ms / 1e3))
    a = rng.random()
    abort = "prefill" if a < args.abort / 3 and not fault else "transfer" if a < args.abort else ""
    # A client that leaves mid-transfer does so during one of the tries, while it reads.
    at = (rng.randrange(len(tries)), rng.uniform(0.05, 0.5))
    return Request(i, rng.randint(1, args.max_prompt_pages), abort, at, tries)


async def run(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    rng = random.Random(args.seed)
    ps = args.page_size
    engine = PagedEngine(device, args.pages + 1, ps, args.forward_ms)
    xfer = TransferEngine(engine)
    kv = KVPagePool(args.pages + 1, ps)
    pool = AsyncReqToTokenPool(
        args.rows + 1,
        MAX_LEN,
        device=device,
        kv=kv,
        stream=engine.forward if engine.cuda else None,
        fence_timeout=args.fence_timeout_ms / 1e3,
    )
    loop = asyncio.get_running_loop()
    faults = set(rng.sample(range(args.requests), min(args.faults, args.requests)))
    requests = [plan(rng, i, args, i in faults) for i in range(args.requests)]
    waiting = collections.deque(requests)
    kinds: collections.Counter[str] = collections.Counter()  # tries by kind
    ends: collections.Counter[str] = collections.Counter()  # requests by how they ended
    early = 0  # pages granted while a live transfer could still read them
    expect_quarantined = 0
    overdue_seen: set[Any] = set()  # the fences themselves (ids are reused)
    released: set[Any] = set()  # fences force-released
    released_pages = 0
    bug = args.free_without_transfer_fence

    def give_up(req: Request, t: Transfer, how: str) -> None:
        """An abort, the deadline or a fault: the pages behind the step and
        the transfer (which reads page ids, not the row), then the row."""
        nonlocal expect_quarantined
        ends[how] += 1
        if t.kind == "faulted" and not bug:
            expect_quarantined += len(t.pages)
        if req.parked is not None:  # the step is long done: the transfer only
            kv.free(req.parked, fence=[] if bug else [t])
            return
        pages = pool.detach_pages(req.row, host=True)
        kv.free(pages, fence=[req.step] if bug else [req.step, t])
        pool.free([req.row])

    def done(req: Request, how: str) -> None:
        """The transfer has landed (or stopped reading): free at once."""
        ends[how] += 1
        if req.parked is not None:
            kv.free(req.parked)
        else:
            pool.free([req.row])

    async def ship(req: Request) -> None:
        """Transfer ``req``'s KV until accepted, dropped, aborted or given up."""
        for n, (kind, duration) in enumerate(req.tries):
            t = xfer.start(f"req {req.id} try {n + 1}", req, kind, duration)
            kinds[kind] += 1
            limit = loop.time() + args.deadline_ms / 1e3
            abort_at = math.inf
            if req.abort == "transfer" and req.abort_at[0] == n:
                abort_at = loop.time() + req.abort_at[1] * duration
            try:
                async with asyncio.timeout_at(min(limit, abort_at)):
                    await wait_fence(t)
            except TimeoutError:
                give_up(req, t, "aborted mid-transfer" if abort_at <= limit else "given up")
                return
            except TransferError:
                give_up(req, t, "faulted")
                return
            if kind != "rejected":
                return done(req, "shipped" if kind in ("accepted", "slow") else "dropped")
            if n + 1 == len(req.tries):
                return done(req, "dropped")
            if req.parked is None:  # rows are scarcer: keep the pages alone
                req.parked = pool.detach_pages(req.row, host=True)
                pool.free([req.row])
            await asyncio.sleep(RETRY_S)

    async def operator(stop: asyncio.Event) -> None:
        """For each overdue fence: have the engine cancel it, release it once
        confirmed (``--force-release-slow``: release it unconfirmed)."""
        nonlocal released_pages
        while not stop.is_set():
            overdue = pool.overdue_fences()
            overdue_seen.update(overdue)
            confirmed = [
                f
                for f in overdue
                if isinstance(f, Transfer) and (args.force_release_slow or xfer.cancel(f))
            ]
            if confirmed:
                released.update(confirmed)
                released_pages += pool.force_release(confirmed)[1]
            await asyncio.sleep(args.operator_ms / 1e3)  # its period

    stop = asyncio.Event()
    operator_task = asyncio.create_task(operator(stop))
    shipping: set[asyncio.Task[None]] = set()
    errors: list[BaseException] = []

    def shipped(task: asyncio.Task[None]) -> None:
        shipping.discard(task)
        if not task.cancelled() and task.exception() is not None:
            errors.append(task.exception())  # type: ignore[arg-type]

    prev: tuple[Any, list[Request]] | None = None
    steps = 0
    t0 = time.perf_counter()
    try:
        while waiting or prev is not None or shipping:
            # Admission: a row and the prompt's pages at once, while they fit.
            batch: list[Request] = []
            while waiting:
                grant = pool.try_admit(pages=waiting[0].npages)
                if grant is None and not batch and prev is None:
                    grant = await pool.admit(pages=waiting[0].npages, timeout=30)
                if grant is None:
                    break
                req = waiting.popleft()
                req.row = grant.row
                req.pages = pool.pages_of(grant.row, host=True).tolist()
                early += xfer.reading(req.pages)
                base = torch.tensor(req.pages) * ps
                req.slots = (base[:, None] + torch.arange(ps)).flatten()
                req.values = (req.id + 1) * MARK + torch.arange(len(req.slots))
                batch.append(req)
            engine.planned()  # (host streams: step t-1 may write now)
            # Launch the prefill step; tie its rows (and their pages) to its fence.
            launched = None
            if batch:
                slots = torch.cat([r.slots for r in batch])
                engine.launch_kernel(
                    pool, slots, torch.cat([r.values for r in batch]), kernel=prefill
                )
                fence = record_fence(engine.forward)
                pool.record_use([r.row for r in batch], fence)
                for req in batch:
                    req.step = fence
                    if req.abort == "prefill":  # behind the step, by record_use
                        pool.free([req.row])
                        ends["aborted mid-prefill"] += 1
                launched = (fence, [r for r in batch if r.abort != "prefill"])
                steps += 1
            # Step t-1 has written its requests' KV: start their transfers.
            if prev is not None:
                await wait_fence(prev[0])
                for req in prev[1]:
                    task = asyncio.create_task(ship(req))
                    shipping.add(task)
                    task.add_done_callback(shipped)
            prev = launched
            if not waiting and prev is None and shipping:
                async with asyncio.timeout(30):
                    await asyncio.wait(shipping)
            if errors:
                raise errors[0]
            await asyncio.sleep(0)
        engine.planned()
        async with asyncio.timeout(30):  # the operator releases what hangs
            await pool.drain()
        elapsed = time.perf_counter() - t0
    finally:
        stop.set()
        await operator_task
        await pool.close()
        engine.close()
        held = xfer.close()

    stats = pool.stats()
    pool.check_invariants()
    back = (
        stats.allocated == stats.pending == stats.quarantined == 0
        and stats.pages_allocated == stats.pages_pending == 0
        and stats.pages_free + stats.pages_quarantined == stats.pages_capacity
        and stats.pages_quarantined == expect_quarantined
        and sum(ends.values()) == len(requests)
    )
    where = "CUDA streams" if engine.cuda else "HostStream"
    by_kind = ", ".join(f"{kinds[k]} {SHOWN.get(k, k)}" for k in KINDS)
    print(
        f"disagg_transfer: {len(requests)} requests on {args.rows} rows and {args.pages} pages "
        f"of {ps}, {steps} prefill steps, {sum(kinds.values())} transfers: {by_kind}, "
        f"{xfer.reads} reads, on {where}"
    )
    how = ("shipped", "dropped", "aborted mid-prefill", "aborted mid-transfer", "given up")
    print(
        f"disagg_transfer: requests {', '.join(f'{ends[h]} {h}' for h in (*how, 'faulted'))}, "
        f"{len(overdue_seen)} overdue fences seen, {len(released)} fences force released, "
        f"{released_pages} pages force released, {stats.pages_quarantined} pages quarantined"
    )
    if xfer.mismatched == early == held == 0 and back:
        print(
            f"disagg_transfer: OK: 0 mismatched transfers, 0 pages granted while read, "
            f"every row and page back but {stats.pages_quarantined} quarantined, {elapsed:.2f} s"
        )
        return 0
    print(
        f"disagg_transfer: FAILED: {xfer.mismatched} mismatched transfers, {early} pages "
        f"granted while read, {held} pages held by hung transfers, {stats.allocated} rows and "
        f"{stats.pages_allocated} pages still allocated, {stats.pending} rows and "
        f"{stats.pages_pending} pages pending, {stats.pages_quarantined} pages quarantined "
        f"({expect_quarantined} expected)"
    )
    return 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    p.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio")
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--rows", type=int, default=16, help="rows in the pool (row 0 excluded)")
    p.add_argument("--pages", type=int, default=40, help="KV pages (page 0 excluded)")
    p.add_argument("--page-size", type=int, default=4, help="token slots a page")
    p.add_argument("--max-prompt-pages", type=int, default=6, help="pages of the longest prompt")
    p.add_argument("--forward-ms", type=float, default=1.0, help="a prefill step's time")
    p.add_argument("--transfer-ms", type=float, default=10.0, help="a transfer's mean time")
    p.add_argument("--deadline-ms", type=float, default=40.0, help="the server's deadline")
    p.add_argument("--fence-timeout-ms", type=float, default=20.0, help="the pool's fence_timeout")
    p.add_argument("--operator-ms", type=float, default=5.0, help="the operator's period")
    p.add_argument("--abort", type=float, default=0.06, help="the share of requests aborted")
    p.add_argument("--faults", type=int, default=3, help="transfers that raise (seeded requests)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--verbose", action="store_true", help="show the pool's log lines")
    p.add_argument(
        "--free-without-transfer-fence",
        action="store_true",
        help="free the pages behind the step fence only (the bug): read while reused",
    )
    p.add_argument(
        "--force-release-slow",
        action="store_true",
        help="force-release overdue transfers unconfirmed (the bug): slow ones still read",
    )
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available here")
    if min(args.rows, args.page_size, args.max_prompt_pages) < 1 or args.requests < 0:
        p.error("--rows, --page-size and --max-prompt-pages must be at least 1, --requests 0")
    if args.faults < 0:
        p.error("--faults must be at least 0")
    least = (args.faults + 1) * args.max_prompt_pages  # faults quarantine pages for life
    if args.pages < least or args.max_prompt_pages * args.page_size > MAX_LEN:
        p.error(
            f"a prompt must fit: --pages at least {least} (--max-prompt-pages times --faults "
            f"+ 1), --max-prompt-pages times --page-size at most {MAX_LEN}"
        )
    times = (args.forward_ms, args.transfer_ms, args.deadline_ms)
    if not all(0 <= x < float("inf") for x in times) or not 0 <= args.abort <= 1:
        p.error("--forward-ms, --transfer-ms and --deadline-ms must be finite, --abort in [0, 1]")
    if not (0 < args.fence_timeout_ms < float("inf") and 0 < args.operator_ms < float("inf")):
        p.error("--fence-timeout-ms and --operator-ms must be finite and positive")
    if args.verbose:
        logging.basicConfig(level=logging.INFO)
    else:  # the summary counts what the pool logs
        logging.getLogger("asyncpool").setLevel(logging.CRITICAL)
    return run_loop(run(args), args.loop)


if __name__ == "__main__":
    sys.exit(main())
