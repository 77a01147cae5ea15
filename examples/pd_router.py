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

The replicas' threads and loops, their inboxes and commands, the routing,
the drains' turns and the hand-back of queued admissions are
``examples/_router.py``'s, which ``router_drain.py`` shares; the prefill
scheduler, the transfers, the drain and the checks are this program's. The
router picks the replica to drain by the count of transfers in flight that
the replica's own thread publishes (``Replica.busy``), not by reading its
tasks from the router's thread.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncpool import AsyncReqToTokenPool, KVPagePool, record_fence, wait_fence

import _router
from _engine import DueThread, PagedEngine, prefill, run_loop
from _router import STOP, UPDATE

MAX_LEN = 64
MARK = 1 << 20  # a request's KV value: (id * 64 + routes) * MARK + position
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


@dataclass(eq=False)
class Figures(_router.Figures):
    """What a replica counted; read by the router once its thread ended."""

    in_flight: int = 0  # transfers in flight when a drain began
    released: int = 0  # transfers cancelled and force-released (a drain's or the operator's)


class Replica(_router.Replica[Request, Figures]):
    """A prefill server on a thread and loop of its own (``_router.Replica``:
    the inbox, the commands, the room)."""

    def __init__(self, label: str, args: argparse.Namespace, router: Router) -> None:
        super().__init__(label, args, router, Figures(), args.max_prompt_pages)
        self.xfer = router.xfer
        self.busy = 0  # its transfers in flight: the router reads it, this thread writes it

    async def _serve(self) -> None:
        args = self.args
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
        self.prefilling: list[Request] = []
        self.shipping: dict[asyncio.Task[None], Request] = {}
        self.given_up: list[Transfer] = []  # may still read: pages behind them
        self.started(pool)
        stop = asyncio.Event()
        operator = asyncio.ensure_future(self._operator(stop))
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
        assert pool is not None
        ps = self.args.page_size
        prev: tuple[Any, list[Request]] | None = None
        while True:
            kind = await self.obey()
            if kind is not None:
                if kind != UPDATE:
                    return
                prev = None
                continue
            while self.inbox:
                req = self.inbox.popleft()
                self.admit(req, req.npages)
            batch: list[Request] = []
            for req, grant in self.granted():
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
            if prev is None:
                await self.idle()  # (at once if a request, a grant or a command came)
            else:
                await asyncio.sleep(0)

    def _shipped(self, ship: asyncio.Task[None]) -> None:
        self.shipping.pop(ship, None)
        self.busy = len(self.shipping)

    async def _drain(self, kind: str) -> None:
        """The recipe: the router stopped routing here already."""
        args, pool, engine = self.args, self.pool, self.engine
        assert pool is not None
        tasks, back = self.take_queued()
        await self.hand_back_admissions(tasks)
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


class Router(_router.Router[Request, Replica, Figures]):
    """The main thread's loop (``_router.Router``) and the transfer engine
    that every replica's transfers share; drains the busiest replica."""

    def __init__(self, args: argparse.Namespace, loop: asyncio.AbstractEventLoop) -> None:
        rng = random.Random(args.seed)
        self.xfer = TransferEngine(torch.device(args.device))
        requests = []
        for i in range(args.requests):
            x, kind = rng.random(), "landed"
            if x < MIX["hung"]:
                kind = "hung"
            elif x < MIX["hung"] + MIX["slow"]:
                kind = "slow"
            ms = args.transfer_ms * rng.uniform(0.3, 1.7)
            if kind == "slow":
                ms = args.deadline_ms + rng.uniform(0.5, 3) * args.fence_timeout_ms
            requests.append(Request(i, rng.randint(1, args.max_prompt_pages), kind, ms / 1e3))
        super().__init__(args, loop, requests)

    def new_replica(self, label: str) -> Replica:
        return Replica(label, self.args, self)

    def to_drain(self) -> int:
        """The replica with the most transfers in flight: the worst case (the
        count its own thread publishes)."""
        return max(range(len(self.replicas)), key=lambda i: self.replicas[i].busy)


async def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    router = Router(args, asyncio.get_running_loop())
    try:
        await router.run_bounded()
    finally:
        router.xfer.close()
    elapsed = time.perf_counter() - t0
    figures = router.figures()
    xfer = router.xfer
    drains = sum(f.drains for f in figures)
    dirty = sum(f.dirty_drains for f in figures)
    in_flight = sum(f.in_flight for f in figures)
    released = sum(f.released for f in figures)
    errors = [f.error for f in figures if f.error is not None]
    unfinished = sum(r.finishes == 0 for r in router.requests)
    twice = sum(r.finishes > 1 for r in router.requests)
    where = "CUDA streams" if args.device == "cuda" else "HostStream"
    loop = args.loop
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
    p.add_argument(
        "--loop", choices=["asyncio", "uvloop"], default="asyncio", help="every replica's loop"
    )
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
    if args.loop == "uvloop":
        try:
            import uvloop  # noqa: F401
        except ImportError:
            p.error("--loop uvloop: uvloop is not installed")
    logging.getLogger("asyncpool").setLevel(logging.CRITICAL)  # overdue lines: expected
    return run_loop(run(args), args.loop)


if __name__ == "__main__":
    sys.exit(main())
