"""Replicas behind a router, drained and replaced while they serve: a program that checks itself.

docs/api.md's *A router over data-parallel replicas* recipe, whole. Each of
``--replicas`` replicas is a scheduler with its own
``AsyncReqToTokenPool(kv=KVPagePool(...))``, its own forward stream, its
own thread and event loop. A router on the main thread's loop picks a
replica per request by the counts the recipe names (rows and pages free or
pending, admissions queued, and the requests in its inbox), read from the
router's thread, and hands the request over (a thread-safe deque and a
``call_soon_threadsafe`` wake-up). A replica admits each request on its own
loop (``await pool.admit(pages=k)`` in a task of its own) and runs an
overlap loop, as ``examples/weight_update.py`` does: prefill (or
recompute) the requests admitted since the last pass; grow a row by a page
(``extend``) when its next token starts one; launch step t, one fence right
after it, ``record_use`` of the batch's rows; process step t-1 (a finished
request's row and pages are freed behind the steps that used them, and the
router is told).

At every eighth of the run the router drains a random replica for a weight
update or replaces it, in turn. It stops routing to it first; the replica
then follows the recipe: its queued admissions are cancelled and awaited
(a grant already returned is freed with the running rows), every running
row is freed behind the step in flight, every request it held (running,
queued, in its inbox) goes back to the router, which routes it again
elsewhere (recompute from what it had), and ``await pool.drain()``; then
``stats().allocated`` and ``.pages_allocated`` must read 0. A weight update
overwrites the replica's KV cache (the new weights' garbage) and serves
again; a replaced replica closes its pool and its loop ends, and the router
starts a new one under the same label (``collector.remove`` / ``add``).
One ``PoolCollector`` on one registry exports every replica, scraped by a
thread of its own every ``--scrape-ms`` (skipped, and said so, without
``prometheus_client``, a dev dependency).

Checks: every read a step makes matches what the request's positions hold,
read through its row (``corrupted reads``: a row or page handed to another
request while a step still used it, or a request routed again but not
recomputed); no row or page handed out by a grant or ``extend`` is held
by a live request of that replica, and the pool's pages of a row are the
ones the replica noted (``shadow mismatches``); every request finishes
exactly once, with all its tokens; each drain leaves nothing allocated;
every replaced pool is collected (a weakref, after ``gc.collect()``); the
scrape never raises. On :class:`~asyncpool.HostStream` a step reads and
writes only once its replica has written the next step's prompts (a
``threading.Event``), so memory handed out too early is caught each time;
CUDA streams are used when available (``--device cpu`` forces host ones).

Two flags put the bugs back, and the run must then fail:

* ``--no-handback``: a drain frees the running rows without first handing
  back the queued admissions (the recipe as once written): the frees go to
  them when the step in flight completes (grant at hand-over), and drains
  end with rows allocated (the replica then hands them back, so the run
  completes);
* ``--no-record-use``: steps record no use of their rows, so a finished
  request's row and pages go to a queued admission while the step in
  flight still reads them: corrupted reads.

The replicas' threads and loops, their inboxes and commands, the routing,
the drains' turns and the hand-back of queued admissions are
``examples/_router.py``'s, which ``pd_router.py`` shares; the scheduler,
the drain, the collector and the checks are this program's.

Exit status: 0 when everything checks out, 1 otherwise. Public API only.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncpool import AsyncReqToTokenPool, Grant, KVPagePool, record_fence, wait_fence

import _router
from _engine import DecodeEngine, run_loop
from _router import REPLACE, STOP, UPDATE

try:
    from prometheus_client import CollectorRegistry, generate_latest

    from asyncpool.metrics import PoolCollector
except ImportError:  # a dev dependency: the scrape is skipped without it
    PoolCollector = None  # type: ignore[assignment,misc]

MAX_PROMPT = 12
MAX_OUTPUT = 8
MAX_LEN = MAX_PROMPT + MAX_OUTPUT + 1  # the step in flight at the end writes one past


@dataclass
class Request:
    id: int
    prompt_len: int
    output_len: int
    done: int = 0  # output tokens whose step has been processed
    launched: int = 0  # output tokens whose step has been launched (>= done)
    admission: int = 0  # bumped at each (re-)admission
    row: int = -1
    pages: list[int] = field(default_factory=list)
    where: object = "new"  # "router", the Replica that holds it, or "finished"
    routes: int = 0
    finishes: int = 0

    @property
    def length(self) -> int:
        return self.prompt_len + self.done

    def value(self, pos: int) -> int:
        return self.id * MAX_LEN + pos + 1

    def slot(self, pos: int, page_size: int) -> int:
        return self.pages[pos // page_size] * page_size + pos % page_size


@dataclass(eq=False)
class Figures(_router.Figures):
    """What a replica counted; read by the router once its thread ended."""

    corrupted_reads: int = 0
    handed_out_live: int = 0
    shadow_mismatches: int = 0
    rows_left: int = 0  # rows allocated at the ends of dirty drains, in all


class Replica(_router.Replica[Request, Figures]):
    """One data-parallel replica: a decode scheduler on a thread and loop of
    its own (``_router.Replica``: the inbox, the commands, the room)."""

    def __init__(self, label: str, args: argparse.Namespace, router: Router) -> None:
        # A row's pages at full length: the largest request's.
        super().__init__(label, args, router, Figures(), -(-MAX_LEN // args.page_size))

    async def _serve(self) -> None:
        args = self.args
        device = torch.device(args.device)
        ps = args.page_size
        # A full-length request's pages for every row: growth never comes up
        # short (a freed row's pages are pending with it), only rows queue.
        num_pages = args.rows * self.per_request
        # The KV cache and forward stream (a HostStream or CUDA), the prefill, the
        # step and the weight update: examples/_engine.py's DecodeEngine.
        self.engine = DecodeEngine(device, num_pages + 1, ps, args.forward_ms)
        stream = self.engine.forward if self.engine.cuda else None
        pool = AsyncReqToTokenPool(
            args.rows + 1,
            MAX_LEN,
            device=device,
            kv=KVPagePool(num_pages + 1, ps),
            stream=stream,
            name=self.label,
        )
        self.running: list[Request] = []
        self.live_rows: dict[int, int] = {}  # row -> request id
        self.live_pages: dict[int, int] = {}  # page -> request id
        self.started(pool)
        try:
            await self._schedule()
        finally:
            self.figures.corrupted_reads += self.engine.close()
            for task in self.admitting:  # (on an error)
                task.cancel()
            await asyncio.gather(*self.admitting, return_exceptions=True)
            await pool.close()

    def _take(self, req: Request, grant: Grant) -> None:
        """A request granted: check what it got against the live ones."""
        pages = grant.pages.tolist()
        if grant.row in self.live_rows or any(p in self.live_pages for p in pages):
            self.figures.handed_out_live += 1
        self.live_rows[grant.row] = req.id
        self.live_pages.update((p, req.id) for p in pages)
        req.row, req.pages = grant.row, pages
        req.admission += 1
        req.launched = req.done

    def _free(self, req: Request) -> None:
        assert self.pool is not None
        self.pool.free(req.row)  # row and pages, behind the steps that used them
        del self.live_rows[req.row]
        for page in req.pages:
            del self.live_pages[page]

    def _check_shadow(self, req: Request) -> None:
        assert self.pool is not None
        if self.pool.pages_of(req.row, host=True).tolist() != req.pages:
            self.figures.shadow_mismatches += 1

    async def _schedule(self) -> None:
        args, engine, pool = self.args, self.engine, self.pool
        assert pool is not None
        ps = args.page_size
        prev: tuple[Any, list[tuple[Request, int]]] | None = None
        while True:
            kind = await self.obey()
            if kind is not None:
                if kind != UPDATE:
                    return
                prev = None  # its step's tokens are discarded: recomputed elsewhere
                continue
            while self.inbox:
                req = self.inbox.popleft()
                self.admit(req, -(-(req.length + 1) // ps))  # its context and next token
            # 1. Arrivals: the admitted requests prefill (or recompute).
            for req, grant in self.granted():
                self._take(req, grant)
                engine.write_prompt(pool, req)
                self._check_shadow(req)
                self.running.append(req)
            # 2. Growth: a page for each request whose next token starts one.
            for req in self.running:
                if req.prompt_len + req.launched >= len(req.pages) * ps:
                    page = pool.extend(req.row, 1)
                    if page is None:
                        raise RuntimeError("growth came up short: the pool is sized for it")
                    new = int(page[0])
                    if new in self.live_pages:
                        self.figures.handed_out_live += 1
                    self.live_pages[new] = req.id
                    req.pages.append(new)
                    self._check_shadow(req)
            engine.planned()  # (host streams: step t-1 may read and write now)
            # 3. Launch step t.
            launched = None
            if self.running:
                engine.launch_step(pool, self.running)
                fence = record_fence(engine.forward)
                if not args.no_record_use:
                    pool.record_use([r.row for r in self.running], fence)
                for req in self.running:
                    req.launched += 1
                launched = (fence, [(r, r.admission) for r in self.running])
            # 4. Process step t-1 while step t runs.
            if prev is not None:
                await wait_fence(prev[0])
                for req, admission in prev[1]:
                    if req.admission != admission or req not in self.running:
                        continue  # finished or handed back since
                    req.done += 1
                    if req.done == req.output_len:
                        self.running.remove(req)
                        self._free(req)
                        self.router.call(self.router.finished, self, req)
            prev = launched
            if prev is None:
                await self.idle()  # (at once if a request, a grant or a command came)
                continue
            await asyncio.sleep(0)  # the scheduler is one task among the loop's

    async def _drain(self, kind: str) -> None:
        """docs/api.md's drain: the router stopped routing here already."""
        args, pool, engine = self.args, self.pool, self.engine
        assert pool is not None
        tasks, queued = self.take_queued()
        if not args.no_handback:
            await self.hand_back_admissions(tasks)
        running, self.running = self.running, []
        for req in running:
            self._free(req)  # behind the step in flight, which used them
        if running or queued:
            self.router.call(self.router.requeue, self, running + queued)
        engine.planned()  # the step in flight may run now
        async with asyncio.timeout(10):
            await pool.drain(timeout=10)
        stats = pool.stats(summaries=False)
        self.figures.drains += kind != STOP
        if stats.allocated or stats.pages_allocated:
            self.figures.dirty_drains += 1
            self.figures.rows_left += stats.allocated
        if args.no_handback:  # hand them back now, so that the run goes on
            await self.hand_back_admissions(tasks)
            async with asyncio.timeout(10):
                await pool.drain(timeout=10)
        pool.check_invariants()
        if kind == UPDATE:
            engine.update_weights()
        else:
            await pool.close()  # a replaced (or the run's last) replica


class Router(_router.Router[Request, Replica, Figures]):
    """The main thread's loop (``_router.Router``): drains a random replica,
    keeps one collector of every replica's pool, checks what finished."""

    def __init__(self, args: argparse.Namespace, loop: asyncio.AbstractEventLoop) -> None:
        self.rng = rng = random.Random(args.seed)
        requests = [
            Request(i, rng.randint(1, MAX_PROMPT), rng.randint(1, MAX_OUTPUT))
            for i in range(args.requests)
        ]
        super().__init__(args, loop, requests)
        self.replaced_pools: list[weakref.ref[AsyncReqToTokenPool]] = []
        self.collector: Any = None
        self.registry: Any = None

    def new_replica(self, label: str) -> Replica:
        return Replica(label, self.args, self)

    def to_drain(self) -> int:
        return self.rng.randrange(len(self.replicas))

    def finished(self, replica: Replica, req: Request, how: str = "finished") -> None:
        if req.done != req.output_len:
            self.failures.append(f"request {req.id} finished on {replica.label} short")
        super().finished(replica, req, how)

    async def start(self, label: str) -> Replica:
        replica = await super().start(label)
        if self.collector is not None:
            assert replica.pool is not None
            self.collector.add(replica.pool, name=label)
        return replica

    async def stop_replica(self, replica: Replica, kind: str) -> None:
        await super().stop_replica(replica, kind)
        if kind == UPDATE:
            return
        if self.collector is not None:
            self.collector.remove(replica.label)
        if kind == REPLACE:
            assert replica.pool is not None
            self.replaced_pools.append(weakref.ref(replica.pool))


def _scrape(registry: Any, stop: threading.Event, every_s: float, tally: dict[str, Any]) -> None:
    """The scrape thread: the whole registry at once, then every ``every_s``."""
    while True:
        try:
            generate_latest(registry)
            tally["scrapes"] += 1
        except Exception as exc:  # counted: the run fails
            tally["errors"] += 1
            tally["last"] = repr(exc)
        if stop.wait(every_s):
            return


async def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    router = Router(args, asyncio.get_running_loop())
    tally: dict[str, Any] = {"scrapes": 0, "errors": 0, "last": ""}
    stop = threading.Event()
    scraper = None
    if PoolCollector is not None:
        router.registry = CollectorRegistry()
        router.collector = PoolCollector()
        router.registry.register(router.collector)
        scraper = threading.Thread(
            target=_scrape,
            args=(router.registry, stop, args.scrape_ms / 1e3, tally),
            name="scrape",
            daemon=True,
        )
        scraper.start()
    try:
        await router.run_bounded()
    finally:
        stop.set()
        if scraper is not None:
            scraper.join(10)
    elapsed = time.perf_counter() - t0
    if router.collector is not None:
        for replica in router.replicas:
            if replica.thread.is_alive() or replica.pool is None:
                continue
            try:
                router.collector.remove(replica.label)
            except (KeyError, ValueError):
                pass
    figures = router.figures()
    router.replicas.clear()
    gc.collect()
    uncollected = sum(ref() is not None for ref in router.replaced_pools)

    bad = sum(f.corrupted_reads for f in figures)
    live = sum(f.handed_out_live for f in figures)
    shadow = sum(f.shadow_mismatches for f in figures)
    drains = sum(f.drains for f in figures)
    dirty = sum(f.dirty_drains for f in figures)
    rows_left = sum(f.rows_left for f in figures)
    errors = [repr(f.error) for f in figures if f.error is not None]
    unfinished = sum(r.finishes == 0 for r in router.requests)
    twice = sum(r.finishes > 1 for r in router.requests)
    short = sum(r.finishes and r.done != r.output_len for r in router.requests)
    where = "CUDA streams" if args.device == "cuda" else "HostStream"
    loop = args.loop
    scrape = (
        f"{tally['scrapes']} scrapes"
        if PoolCollector is not None
        else "0 scrapes (skipped: prometheus_client is not installed)"
    )
    print(
        f"router_drain: {len(router.requests)} requests, {args.replicas} "
        f"replica{'s' if args.replicas != 1 else ''} "
        f"of {args.rows} rows, {router.routes} routes, {router.requeued} handed back, "
        f"{router.updates} drains for weight updates, {router.replacements} replacements, "
        f"{drains} drains in all, {scrape}, on {where} and {loop}"
    )
    for failure in router.failures[:5]:
        print(f"router_drain: {failure}")
    if tally["errors"]:
        print(f"router_drain: the scrape raised {tally['last']}")
    ok = (
        bad == live == shadow == dirty == uncollected == unfinished == twice == short == 0
        and not errors
        and not router.failures
        and not tally["errors"]
    )
    if ok:
        print(
            f"router_drain: OK: 0 corrupted reads, 0 handed out while live, "
            f"0 shadow mismatches, every request finished once, every drain left nothing "
            f"allocated, every replaced pool collected, 0 scrape errors, {elapsed:.2f} s"
        )
        return 0
    print(
        f"router_drain: FAILED: {bad} corrupted reads, {dirty} drains with rows allocated "
        f"({rows_left} rows), {live} handed out while live, {shadow} shadow mismatches, "
        f"{unfinished} unfinished, {twice} finished twice, {short} short, "
        f"{uncollected} replaced pools not collected, {tally['errors']} scrape errors, "
        f"{len(errors)} replica errors"
    )
    return 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    p.add_argument("--requests", type=int, default=120)
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument(
        "--rows", type=int, default=4, help="rows in each replica's pool (row 0 excluded)"
    )
    p.add_argument("--page-size", type=int, default=4, help="token slots a page")
    p.add_argument("--forward-ms", type=float, default=0.5, help="the forward's time per step")
    p.add_argument("--scrape-ms", type=float, default=20, help="time between scrapes")
    p.add_argument(
        "--loop", choices=["asyncio", "uvloop"], default="asyncio", help="every replica's loop"
    )
    p.add_argument(
        "--no-handback",
        action="store_true",
        help="a drain frees the running rows without handing back the queued admissions first",
    )
    p.add_argument(
        "--no-record-use",
        action="store_true",
        help="steps record no use of their rows (the bug): corrupted reads",
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available here")
    if min(args.replicas, args.rows, args.page_size) < 1 or args.requests < 0:
        p.error("--replicas, --rows and --page-size must be at least 1, --requests at least 0")
    if not (0 <= args.forward_ms < float("inf")) or not (0 < args.scrape_ms < float("inf")):
        p.error("--forward-ms must be a finite number >= 0, --scrape-ms one > 0")
    if args.loop == "uvloop":
        try:
            import uvloop  # noqa: F401
        except ImportError:
            p.error("--loop uvloop: uvloop is not installed")
    return run_loop(run(args), args.loop)


if __name__ == "__main__":
    sys.exit(main())
