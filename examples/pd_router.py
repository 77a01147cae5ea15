"""Prefill replicas behind a router, drained with transfers in flight: a program that checks itself.

docs/api.md's *A router over data-parallel replicas* (``router_drain.py``)
over prefill servers whose transfers read the pages they ship (docs/cuda.md's
*The prefill side*, ``disagg_transfer.py``). Each of ``--replicas`` replicas
is a prefill server on a thread and loop of its own, with its own
``AsyncReqToTokenPool(kv=KVPagePool(...), fence_timeout=...)`` and KV cache
(``_engine.PagedEngine``). A router on the main thread's loop routes each
request to the replica with the most room; the replica admits it, prefills
it (``record_use`` of its row on the step's fence) and, once the step is
done, starts its transfer. One transfer engine thread serves every replica:
it reads a transfer's pages from its replica's KV cache when it lands and
compares them with what the prefill wrote (a *mismatched transfer* read
overwritten KV). A transfer lands, is slow (after the server's deadline) or
hangs: one given up at the deadline leaves its pages behind ``[step_fence,
transfer]``; a per-replica operator has the engine cancel overdue transfers
and, confirmed, calls ``force_release``.

At every eighth of the run the router drains the replica with the most
transfers in flight for a weight update (its KV cache overwritten after) or
replaces it (pool closed, KV cache dropped: overwritten with garbage here),
in turn. The drain: stop routing to it; cancel and await its queued
admissions (router_drain's hand-back); free its prefilling rows behind their
step fence; give up its transfers in flight (pages behind ``[step_fence,
transfer]``); hand every request it held back to the router, which routes
it again; ``await pool.drain(timeout=...)`` for the transfers' fences, and
past the timeout have the engine cancel those still reading, confirm, and
``force_release``. Only then is the KV cache overwritten or dropped.

Checks: 0 mismatched transfers; every request finishes once (shipped or
given up), routed again only after a drain; every drain leaves nothing
allocated nor pending. ``--drain-without-transfers`` (the bug: the drain
frees behind the step fence only and overwrites without waiting for the
transfers) must fail. Exit status 0 when everything checks out, else 1.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import functools
import logging
import random
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncpool import AsyncReqToTokenPool, Grant, KVPagePool, record_fence, wait_fence

from _engine import DueThread, PagedEngine

MAX_LEN = 64
MARK = 1 << 20  # a request's KV value: (id * 64 + routes) * MARK + position
UPDATE, REPLACE, STOP = "update", "replace", "stop"
MIX = {"hung": 0.01, "slow": 0.04}  # per request, seeded; the rest land in time


@dataclass(eq=False)
class Request:
    id: int
    npages: int
    kind: str  # its transfer: "landed", "slow" or "hung"
    duration_s: float
    where: object = "new"  # "router", the Replica that holds it, or "finished"
    routes: int = 0
    finishes: int = 0
    row: int = -1
    pages: list[int] = field(default_factory=list)
    slots: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    values: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    step: Any = None  # its prefill step's fence
    transfer: Transfer | None = None


class Transfer:
    """One read of a request's pages from its replica's KV cache: a fence
    (``query``/``synchronize``) that the pool polls. ``state``: reading,
    done (read) or cancelled (by the engine, confirmed: it reads no more)."""

    def __init__(self, engine: TransferEngine, kv_cache: torch.Tensor, req: Request) -> None:
        self.engine, self.kv_cache, self.kind = engine, kv_cache, req.kind
        self.name = f"req {req.id} route {req.routes}"
        self.slots, self.expect = req.slots, req.values
        self.state = "reading"

    def query(self) -> bool:
        with self.engine.cond:
            return self.state != "reading"

    def synchronize(self) -> None:
        with self.engine.cond:
            self.engine.cond.wait_for(lambda: self.state != "reading")

    def __repr__(self) -> str:
        return f"Transfer({self.name}, {self.kind})"


class TransferEngine:
    """One thread for every replica: reads each transfer when it lands."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.clock = DueThread(device)
        self.cond = self.clock.cond
        self.hung: list[Transfer] = []
        self.reads = self.mismatched = self.cancelled = 0

    def start(self, kv_cache: torch.Tensor, req: Request) -> Transfer:
        t = Transfer(self, kv_cache, req)
        with self.cond:
            if t.kind == "hung":
                self.hung.append(t)
            else:
                self.clock.at(time.monotonic() + req.duration_s, functools.partial(self._read, t))
        return t

    def cancel(self, t: Transfer) -> bool:
        """Cancel ``t``: True once it can no longer read (always, here)."""
        with self.cond:
            if t.state == "reading":
                t.state = "cancelled"
                self.cancelled += 1
                self.cond.notify_all()
            return True

    def _read(self, t: Transfer) -> None:  # on the clock's thread, under the lock
        if t.state != "reading":
            return
        got = t.kv_cache[t.slots.to(t.kv_cache.device)].cpu()
        self.reads += 1
        self.mismatched += int(not torch.equal(got, t.expect))
        t.state = "done"
        self.cond.notify_all()

    def close(self) -> None:
        """Let every due read happen, then cancel what hangs."""
        self.clock.close()
        for t in self.hung:
            self.cancel(t)


def prefill(
    kv_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    verified_lens: torch.Tensor,
    bad_reads: torch.Tensor,
    slots: torch.Tensor,
    values: torch.Tensor,
) -> None:
    """The prefill step's write: each request's KV into its pages' slots."""
    kv_cache[slots] = values


def _run_loop(main: Any, use_uvloop: bool) -> None:
    if use_uvloop:
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(main)
    else:
        asyncio.run(main)


@dataclass(eq=False)
class Figures:
    drains: int = 0
    dirty_drains: int = 0  # drains that left rows or pages allocated or pending
    in_flight: int = 0  # transfers in flight when a drain began
    released: int = 0  # transfers cancelled and force-released (a drain's or the operator's)
    error: BaseException | None = None


class Replica:
    """A prefill server on a thread and loop of its own."""

    def __init__(self, label: str, args: argparse.Namespace, router: Router) -> None:
        self.label, self.args, self.router, self.xfer = label, args, router, router.xfer
        self.inbox: collections.deque[Request] = collections.deque()
        self.serving = False
        self.ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self.figures = Figures()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.pool: AsyncReqToTokenPool | None = None
        self._command: tuple[str, Callable[[], None]] | None = None
        self._wake: asyncio.Event | None = None
        self.busy = 0  # its transfers in flight: the router reads it, this thread writes it
        self.thread = threading.Thread(target=self._main, name=f"replica-{label}", daemon=True)

    # -- the router's side ------------------------------------------------

    def counts(self) -> int:
        pool = self.pool
        assert pool is not None and pool.kv is not None
        rows = pool.available_size() + pool.pending_size()
        pages = pool.kv.available_size() + pool.kv.pending_size()
        per = self.args.max_prompt_pages
        return int(min(rows, pages // per) - pool.waiting() - len(self.inbox))

    def hand(self, req: Request) -> None:
        self.inbox.append(req)
        assert self.loop is not None
        self.loop.call_soon_threadsafe(self._poke)

    def command(self, kind: str, done: Callable[[], None]) -> None:
        assert self.loop is not None
        self.loop.call_soon_threadsafe(self._set_command, kind, done)

    # -- the replica's thread ----------------------------------------------

    def _poke(self) -> None:
        assert self._wake is not None
        self._wake.set()

    def _set_command(self, kind: str, done: Callable[[], None]) -> None:
        self._command = (kind, done)
        self._poke()

    def _main(self) -> None:
        try:
            _run_loop(self._serve(), self.args.uvloop)
        except BaseException as exc:
            self.figures.error = exc
            if not self.ready.done():
                self.ready.set_exception(exc)
            self.router.call(self.router.replica_failed, self)

    async def _serve(self) -> None:
        args = self.args
        self.loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        device = torch.device(args.device)
        self.engine = PagedEngine(device, args.pages + 1, args.page_size, args.forward_ms)
        self.kv = KVPagePool(args.pages + 1, args.page_size)
        pool = AsyncReqToTokenPool(
            args.rows + 1,
            MAX_LEN,
            device=device,
            kv=self.kv,
            stream=self.engine.forward if self.engine.cuda else None,
            fence_timeout=args.fence_timeout_ms / 1e3,
            name=self.label,
        )
        pool.bind()
        self.pool = pool
        self.admitting: dict[asyncio.Task[Grant], Request] = {}
        self.prefilling: list[Request] = []
        self.shipping: dict[asyncio.Task[None], Request] = {}
        self.given_up: list[Transfer] = []  # may still read: pages behind them
        stop = asyncio.Event()
        operator = asyncio.ensure_future(self._operator(stop))
        self.ready.set_result(None)
        try:
            await self._schedule()
        finally:
            stop.set()
            await operator
            for task in [*self.admitting, *self.shipping]:  # (on an error)
                task.cancel()
            await asyncio.gather(*self.admitting, *self.shipping, return_exceptions=True)
            self.engine.close()
            await pool.close()

    async def _operator(self, stop: asyncio.Event) -> None:
        """The overdue transfers: cancelled by the engine, confirmed, released."""
        assert self.pool is not None
        while not stop.is_set():
            self._release([f for f in self.pool.overdue_fences() if isinstance(f, Transfer)])
            await asyncio.sleep(self.args.operator_ms / 1e3)

    def _release(self, transfers: list[Transfer]) -> None:
        assert self.pool is not None
        confirmed = [t for t in transfers if self.xfer.cancel(t)]
        if confirmed:
            self.figures.released += len(confirmed)
            self.pool.force_release(confirmed)
        self.given_up = [t for t in self.given_up if t.state == "reading"]

    def _give_up(self, req: Request, fences: list[Any]) -> None:
        """The pages behind ``fences`` (the transfer reads page ids, not the
        row), then the row."""
        assert self.pool is not None and req.transfer is not None
        pages = self.pool.detach_pages(req.row, host=True)
        self.kv.free(pages, fence=fences)
        self.pool.free([req.row])
        self.given_up.append(req.transfer)

    async def _ship(self, req: Request) -> None:
        assert self.pool is not None
        req.transfer = self.xfer.start(self.engine.kv_cache, req)
        try:
            async with asyncio.timeout(self.args.deadline_ms / 1e3):
                await wait_fence(req.transfer)
        except TimeoutError:
            self._give_up(req, [req.step, req.transfer])
            self.router.call(self.router.finished, self, req, "given up")
            return
        self.pool.free([req.row])  # landed: at once
        self.router.call(self.router.finished, self, req, "shipped")

    async def _schedule(self) -> None:
        engine, pool = self.engine, self.pool
        assert pool is not None and self._wake is not None
        ps = self.args.page_size
        prev: tuple[Any, list[Request]] | None = None
        while True:
            self._wake.clear()
            if self._command is not None:
                kind, done = self._command
                self._command = None
                await self._drain(kind)
                prev = None
                self.router.call(done)
                if kind != UPDATE:
                    return
                continue
            while self.inbox:
                req = self.inbox.popleft()
                admit = asyncio.ensure_future(pool.admit(pages=req.npages))
                admit.add_done_callback(lambda _: self._poke())
                self.admitting[admit] = req
            batch: list[Request] = []
            for admit in [t for t in self.admitting if t.done()]:
                req = self.admitting.pop(admit)
                grant = admit.result()
                req.row, req.pages = grant.row, grant.pages.tolist()
                req.slots = (torch.tensor(req.pages)[:, None] * ps + torch.arange(ps)).flatten()
                base = (req.id * 64 + req.routes) * MARK
                req.values = base + torch.arange(len(req.slots))
                batch.append(req)
            engine.planned()  # (host streams: step t-1 may write now)
            launched = None
            if batch:
                engine.launch_kernel(
                    pool,
                    torch.cat([r.slots for r in batch]),
                    torch.cat([r.values for r in batch]),
                    kernel=prefill,
                )
                fence = record_fence(engine.forward)
                pool.record_use([r.row for r in batch], fence)
                for req in batch:
                    req.step = fence
                launched = (fence, batch)
            if prev is not None:  # step t-1 wrote its requests' KV: ship it
                await wait_fence(prev[0])
                for req in prev[1]:
                    ship = asyncio.ensure_future(self._ship(req))
                    ship.add_done_callback(self._shipped)
                    self.shipping[ship] = req
                self.busy = len(self.shipping)
            prev = launched
            self.prefilling = batch
            if prev is None and not any(t.done() for t in self.admitting):
                await self._wake.wait()
            else:
                await asyncio.sleep(0)

    def _shipped(self, ship: asyncio.Task[None]) -> None:
        self.shipping.pop(ship, None)
        self.busy = len(self.shipping)

    async def _drain(self, kind: str) -> None:
        """The recipe: the router stopped routing here already."""
        args, pool, engine = self.args, self.pool, self.engine
        assert pool is not None
        back = list(self.inbox)
        self.inbox.clear()
        tasks = list(self.admitting)  # queued admissions: handed back
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for task in tasks:
            req = self.admitting.pop(task)
            back.append(req)
            if not task.cancelled() and task.exception() is None:
                pool.free(task.result().row)  # nothing ran on it: at once
        for req in self.prefilling:  # behind the step in flight (record_use)
            pool.free([req.row])
            back.append(req)
        self.prefilling = []
        shipping = dict(self.shipping)  # transfers in flight: given up
        for ship in shipping:
            ship.cancel()
        await asyncio.gather(*shipping, return_exceptions=True)
        for ship, req in shipping.items():
            if ship.cancelled():
                assert req.transfer is not None
                self.figures.in_flight += req.transfer.state == "reading"
                bug = args.drain_without_transfers
                self._give_up(req, [req.step] if bug else [req.step, req.transfer])
                back.append(req)
        if back:
            self.router.call(self.router.requeue, self, back)
        engine.planned()
        try:
            await pool.drain(timeout=args.drain_timeout_ms / 1e3)
        except TimeoutError:  # still reading: cancelled, confirmed, released
            self._release(list(self.given_up))
            await pool.drain(timeout=10)
        stats = pool.stats(summaries=False)
        self.figures.drains += kind != STOP
        if stats.allocated or stats.pages_allocated or stats.pending or stats.pages_pending:
            self.figures.dirty_drains += 1
        pool.check_invariants()
        if kind == UPDATE:
            engine.update_weights()  # the KV cache overwritten
        else:
            engine.synchronize()
            engine.kv_cache.fill_(-9)  # dropped: someone else's memory now
            await pool.close()


class Router:
    """The main thread's loop: routes requests, drains and replaces replicas."""

    def __init__(self, args: argparse.Namespace, loop: asyncio.AbstractEventLoop) -> None:
        self.args, self.loop = args, loop
        self.rng = rng = random.Random(args.seed)
        self.xfer = TransferEngine(torch.device(args.device))
        self.requests = []
        for i in range(args.requests):
            x, kind = rng.random(), "landed"
            if x < MIX["hung"]:
                kind = "hung"
            elif x < MIX["hung"] + MIX["slow"]:
                kind = "slow"
            ms = args.transfer_ms * rng.uniform(0.3, 1.7)
            if kind == "slow":
                ms = args.deadline_ms + rng.uniform(0.5, 3) * args.fence_timeout_ms
            self.requests.append(Request(i, rng.randint(1, args.max_prompt_pages), kind, ms / 1e3))
        self.queue: collections.deque[Request] = collections.deque()
        self.spawned = self.finished_count = self.requeued = self.routes = 0
        self.ends: collections.Counter[str] = collections.Counter()
        self.changed = asyncio.Event()
        self.replicas: list[Replica] = []
        self.retired: list[Figures] = []
        self.updates = self.replacements = 0
        self.failures: list[str] = []

    def call(self, fn: Callable[..., None], *args: Any) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def finished(self, replica: Replica, req: Request, how: str) -> None:
        if req.where is not replica:
            self.failures.append(f"request {req.id} finished on {replica.label} unexpectedly")
        req.finishes += 1
        req.where = "finished"
        self.finished_count += 1
        self.ends[how] += 1
        self.changed.set()

    def requeue(self, replica: Replica, reqs: list[Request]) -> None:
        for req in reqs:
            if req.where is not replica:
                self.failures.append(f"request {req.id} handed back by {replica.label}")
            req.where = "router"
            self.queue.append(req)
        self.requeued += len(reqs)
        self.changed.set()

    def replica_failed(self, replica: Replica) -> None:
        self.failures.append(f"replica {replica.label}: {replica.figures.error!r}")
        self.changed.set()

    async def start(self, label: str) -> Replica:
        replica = Replica(label, self.args, self)
        replica.thread.start()
        async with asyncio.timeout(10):
            await asyncio.wrap_future(replica.ready)
        replica.serving = True
        return replica

    async def stop_replica(self, replica: Replica, kind: str) -> None:
        replica.serving = False  # stop routing to it first
        drained: asyncio.Future[None] = self.loop.create_future()

        def done() -> None:
            if not drained.done():
                drained.set_result(None)

        replica.command(kind, done)
        async with asyncio.timeout(20):
            await drained
        if kind == UPDATE:
            replica.serving = True
            return
        async with asyncio.timeout(10):
            await asyncio.to_thread(replica.thread.join)
        self.retired.append(replica.figures)

    async def cycle(self, index: int, kind: str) -> None:
        replica = self.replicas[index]
        await self.stop_replica(replica, kind)
        if kind == REPLACE:
            self.replicas[index] = await self.start(replica.label)
            self.replacements += 1
        else:
            self.updates += 1
        self.changed.set()

    async def run(self) -> None:
        args = self.args
        cap = 2 * args.rows * args.replicas
        for i in range(args.replicas):
            self.replicas.append(await self.start(f"r{i}"))
        events = 0
        cycling: asyncio.Task[None] | None = None
        while self.finished_count < len(self.requests):
            if self.failures:
                raise RuntimeError(self.failures[0])
            self.changed.clear()
            due = (events + 1) * len(self.requests) // 8
            if events < 7 and self.finished_count >= due and (cycling is None or cycling.done()):
                if cycling is not None:
                    await cycling
                kind = UPDATE if events % 2 == 0 else REPLACE
                # The replica with the most transfers in flight: the worst case
                # (the count its own thread publishes).
                index = max(range(len(self.replicas)), key=lambda i: self.replicas[i].busy)
                cycling = asyncio.ensure_future(self.cycle(index, kind))
                events += 1
            while self.queue or (
                self.spawned < len(self.requests) and self.spawned - self.finished_count < cap
            ):
                serving = [r for r in self.replicas if r.serving]
                if not serving:
                    break
                replica = max(serving, key=Replica.counts)
                req = self.queue.popleft() if self.queue else self.requests[self.spawned]
                if req.where == "new":
                    self.spawned += 1
                req.where, req.routes = replica, req.routes + 1
                self.routes += 1
                replica.hand(req)
            await self.changed.wait()
        if cycling is not None:
            await cycling
        for replica in self.replicas:
            await self.stop_replica(replica, STOP)


async def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    router = Router(args, asyncio.get_running_loop())
    try:
        async with asyncio.timeout(60):
            await router.run()
    except Exception as exc:
        router.failures.append(f"the router: {exc!r}")
    finally:
        for replica in router.replicas:
            if replica.thread.is_alive() and replica.loop is not None:
                if not replica.loop.is_closed():
                    replica.command(STOP, lambda: None)
                replica.thread.join(10)
        router.xfer.close()
    elapsed = time.perf_counter() - t0
    figures = router.retired + [r.figures for r in router.replicas]
    figures = list({id(f): f for f in figures}.values())
    xfer = router.xfer
    drains = sum(f.drains for f in figures)
    dirty = sum(f.dirty_drains for f in figures)
    in_flight = sum(f.in_flight for f in figures)
    released = sum(f.released for f in figures)
    errors = [f.error for f in figures if f.error is not None]
    unfinished = sum(r.finishes == 0 for r in router.requests)
    twice = sum(r.finishes > 1 for r in router.requests)
    where = "CUDA streams" if args.device == "cuda" else "HostStream"
    loop = "uvloop" if args.uvloop else "asyncio"
    print(
        f"pd_router: {len(router.requests)} requests, {args.replicas} prefill replicas, "
        f"{router.routes} routes, {router.requeued} handed back, {router.updates} drains for "
        f"weight updates, {router.replacements} replacements, {drains} drains in all, "
        f"{in_flight} transfers in flight at drains, {xfer.reads} reads, "
        f"{router.ends['shipped']} shipped, {router.ends['given up']} given up, "
        f"{released} transfers cancelled and released, on {where} and {loop}"
    )
    for failure in router.failures[:5]:
        print(f"pd_router: {failure}")
    ok = xfer.mismatched == dirty == unfinished == twice == 0
    if ok and not errors and not router.failures:
        print(
            f"pd_router: OK: 0 mismatched transfers, every request finished once, every drain "
            f"left nothing allocated, {elapsed:.2f} s"
        )
        return 0
    print(
        f"pd_router: FAILED: {xfer.mismatched} mismatched transfers, {dirty} drains with memory "
        f"left, {unfinished} unfinished, {twice} finished twice, {len(errors)} replica errors"
    )
    return 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--rows", type=int, default=8, help="rows a replica (row 0 excluded)")
    p.add_argument("--pages", type=int, default=24, help="KV pages a replica (page 0 excluded)")
    p.add_argument("--page-size", type=int, default=4, help="token slots a page")
    p.add_argument("--max-prompt-pages", type=int, default=4, help="pages of the longest prompt")
    p.add_argument("--forward-ms", type=float, default=1.0, help="a prefill step's time")
    p.add_argument("--transfer-ms", type=float, default=40.0, help="a transfer's mean time")
    p.add_argument("--deadline-ms", type=float, default=100.0, help="the server's deadline")
    p.add_argument("--fence-timeout-ms", type=float, default=40.0, help="the pool's fence_timeout")
    p.add_argument("--drain-timeout-ms", type=float, default=50.0, help="a drain's wait")
    p.add_argument("--operator-ms", type=float, default=5.0, help="the operator's period")
    p.add_argument("--uvloop", action="store_true", help="every loop a uvloop one")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--drain-without-transfers",
        action="store_true",
        help="a drain frees and overwrites without waiting for the transfers (the bug)",
    )
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available here")
    if min(args.replicas, args.rows, args.page_size, args.max_prompt_pages) < 1:
        p.error("--replicas, --rows, --page-size and --max-prompt-pages must be at least 1")
    if args.requests < 0 or args.pages < args.max_prompt_pages:
        p.error("--requests must be at least 0, --pages at least --max-prompt-pages")
    if args.max_prompt_pages * args.page_size > MAX_LEN:
        p.error(f"--max-prompt-pages times --page-size must be at most {MAX_LEN}")
    times = (args.forward_ms, args.transfer_ms, args.deadline_ms, args.drain_timeout_ms)
    if not all(0 <= x < float("inf") for x in times):
        p.error("--forward-ms, --transfer-ms, --deadline-ms and --drain-timeout-ms: finite, >= 0")
    if not (0 < args.fence_timeout_ms < float("inf") and 0 < args.operator_ms < float("inf")):
        p.error("--fence-timeout-ms and --operator-ms must be finite and positive")
    if args.uvloop:
        try:
            import uvloop  # noqa: F401
        except ImportError:
            p.error("--uvloop: uvloop is not installed")
    logging.getLogger("asyncpool").setLevel(logging.CRITICAL)  # overdue lines: expected
    box: list[int] = []

    async def body() -> None:
        box.append(await run(args))

    _run_loop(body(), args.uvloop)
    return box[0]


if __name__ == "__main__":
    sys.exit(main())
