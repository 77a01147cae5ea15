"""A weight update with requests queued (an RL rollout): a program that checks itself.

An RL-rollout engine over ``AsyncReqToTokenPool(kv=KVPagePool(...))`` that
stops every ``--update-every`` steps to update its weights, releasing the
pool's memory meanwhile (``release_memory()``) while clients keep queueing.
Clients admit in tasks of their own (``await pool.admit(pages=k,
priority=p)``) at three priorities, some under ``asyncio.timeout``, a few
cancelled while they queue; an admitted request joins the engine's running
set and generates a few tokens, one per step. Each step:

1. **arrivals**: the requests admitted since the last pass write their
   prompt (prefill; after an update, the recompute of what they had);
2. **growth**: a request whose next token starts a page gets one with
   ``extend(row, 1)`` (the pool holds a full-length request per row, so it
   never comes up short);
3. **launch** step t on the forward stream; one fence right after it;
   ``record_use`` ties the batch's rows, and so their pages, to it;
4. **process** step t-1 while step t runs: a finished request's row is freed
   (its pages with it) behind the steps that used it.

Every ``--update-every`` steps the engine launches nothing and updates its
weights by docs/api.md's recipe (*memory saver*): it waits for the step in
flight and processes it (a request that finished then is freed with nothing
left to wait for, so its row goes to the queued head at once: granted just
*before* the hold, its task not yet resumed), takes ``hold_grants()``,
frees every row it holds (requeued at the front for recompute, or aborted
with ``--abort-running``) and yields until ``allocated_size()`` reads 0,
``release_memory()``, updates the weights (the KV cache is overwritten, as
the released memory would be), ``resume_memory()``, releases the hold.
Requeued requests admit again at priority -1, ahead of every new request.

Checks: every step reads its context through its row and compares it with
what the request's positions hold (``corrupted reads``: a page or row handed
to another request while a step still uses it, or a requeued request not
recomputed after the update); ``release_memory`` never refuses
(``PoolBusyError``); within each priority the pool grants in the order the
clients queued (``out of order``: a waiter that lost its place across an
update); every request ends (finished, aborted, timed out or cancelled) and
every finished one generated all its tokens; the pool is empty at the end.
On :class:`~asyncpool.HostStream` a step reads and writes only once the
scheduler has written the next step's prompts (a ``threading.Event``), so
memory handed out too early is caught each time; CUDA streams are used when
available (``--device cpu`` forces host ones).

``--no-yield`` frees the running rows once, without the loop (the recipe
as once written): the request granted just before the hold still holds its
row, and ``release_memory`` refuses (counted; the engine then frees and
yields as the recipe says, so the run completes), and the run fails.
``--loop uvloop`` runs it on uvloop. Exit status: 0 when everything checks
out, 1 otherwise. Public API only.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncpool import (
    AsyncReqToTokenPool,
    KVPagePool,
    PoolBusyError,
    record_fence,
    wait_fence,
)

from _engine import DecodeEngine, run_loop

MAX_PROMPT = 12
MAX_OUTPUT = 8
MAX_LEN = MAX_PROMPT + MAX_OUTPUT + 1  # the step in flight at the end writes one past
PRIORITIES = (0, 1, 2)
RETRY = -1  # requeued at an update: ahead of every new request


@dataclass
class Request:
    id: int
    priority: int
    prompt_len: int
    output_len: int
    timeout: float | None  # the client's bound on its admission
    done: int = 0  # output tokens whose step has been processed
    launched: int = 0  # output tokens whose step has been launched (>= done)
    admission: int = 0  # bumped at each (re-)admission
    row: int = -1
    pages: list[int] = field(default_factory=list)
    queued: bool = False  # awaiting admit (the only time the driver cancels)
    outcome: str = ""  # finished, aborted, timed out, cancelled
    result: asyncio.Future[str] | None = None  # the engine's word: finished, requeue, aborted

    @property
    def length(self) -> int:
        return self.prompt_len + self.done

    def value(self, pos: int) -> int:
        return self.id * MAX_LEN + pos + 1

    def slot(self, pos: int, page_size: int) -> int:
        return self.pages[pos // page_size] * page_size + pos % page_size


async def run(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    rng = random.Random(args.seed)
    ps = args.page_size
    per_row = -(-MAX_LEN // ps)
    # A full-length request's pages for every row: growth never comes up
    # short (a freed row's pages are pending with it), only rows queue.
    num_pages = args.rows * per_row
    # The KV cache and forward stream (a HostStream or CUDA), the prefill, the
    # step and the weight update: examples/_engine.py's DecodeEngine.
    engine = DecodeEngine(device, num_pages + 1, ps, args.forward_ms)
    kv = KVPagePool(num_pages + 1, ps)
    pool = AsyncReqToTokenPool(
        args.rows + 1, MAX_LEN, device=device, kv=kv, stream=engine.forward if engine.cuda else None
    )
    requests = [
        Request(
            i,
            rng.choice(PRIORITIES),
            rng.randint(1, MAX_PROMPT),
            rng.randint(1, MAX_OUTPUT),
            rng.uniform(0.002, 0.05) if rng.random() < args.timeouts else None,
        )
        for i in range(args.requests)
    ]
    loop = asyncio.get_running_loop()
    arrived: list[Request] = []  # admitted, not yet seen by the engine
    changed = asyncio.Event()  # a client arrived or ended
    order = itertools.count()
    granted: dict[int, list[int]] = {}  # priority -> queue numbers, in grant order
    tasks: dict[int, asyncio.Task[None]] = {}

    async def client(req: Request) -> None:
        priority = req.priority
        try:
            while True:
                need = -(-(req.length + 1) // ps)  # its context and its next token
                ticket = next(order)  # queued in this order (admit queues at once)
                # An admit that may return at once (nobody queued, nothing
                # gating) is left out of the order check: it returns before a
                # waiter granted just before it resumes, though granted after.
                fast = not (pool.waiting() or holding or pool.released)
                req.queued = True
                try:
                    if req.timeout is not None:
                        async with asyncio.timeout(req.timeout):
                            grant = await pool.admit(pages=need, priority=priority)
                    else:
                        grant = await pool.admit(pages=need, priority=priority)
                except TimeoutError:
                    req.outcome = "timed out"
                    return
                finally:
                    req.queued = False
                if not fast:
                    granted.setdefault(priority, []).append(ticket)
                req.row = grant.row
                req.pages = pool.pages_of(grant.row, host=True).tolist()
                req.admission += 1
                req.launched = req.done
                req.result = loop.create_future()
                arrived.append(req)
                changed.set()
                word = await req.result
                if word != "requeue":
                    req.outcome = word
                    return
                priority = RETRY  # recompute: at the front of the queue
        except asyncio.CancelledError:
            req.outcome = "cancelled"
            raise
        finally:
            changed.set()

    running: list[Request] = []
    prev: tuple[Any, list[tuple[Request, int]]] | None = None
    steps = since_update = updates = busy = requeued = aborted = most_yields = 0
    holding = False
    spawned = 0
    t0 = time.perf_counter()

    def hand_back(req: Request, word: str) -> None:
        running.remove(req)
        pool.free(req.row)  # row and pages, behind the steps that used them
        assert req.result is not None
        req.result.set_result(word)

    def process(prev: tuple[Any, list[tuple[Request, int]]]) -> None:
        _, batch = prev
        for req, admission in batch:
            if req.admission != admission or req not in running:
                continue  # handed back since: that step's token is discarded
            req.done += 1
            if req.done == req.output_len:
                hand_back(req, "finished")

    async def update_weights() -> None:
        """docs/api.md's recipe, the step in flight processed first."""
        nonlocal prev, busy, requeued, aborted, holding, most_yields
        engine.planned()
        if prev is not None:
            await wait_fence(prev[0])
            process(prev)  # a finished row goes to the queued head at once
            prev = None
        hold = pool.hold_grants()
        holding = True
        word = "aborted" if args.abort_running else "requeue"

        def free_all() -> None:
            nonlocal requeued, aborted
            running.extend(arrived)  # granted, their tasks resumed since
            arrived.clear()
            for req in list(running):
                hand_back(req, word)
                if word == "requeue":
                    requeued += 1
                else:
                    aborted += 1

        async with asyncio.timeout(5):  # a row the engine lost would spin here
            if args.no_yield:
                free_all()  # once, without the loop: the recipe as once written
            else:
                yields = 0
                while True:
                    free_all()
                    if not pool.allocated_size():
                        break
                    await asyncio.sleep(0)  # a grant made before the hold reaches its task
                    yields += 1
                most_yields = max(most_yields, yields)
            try:
                await pool.release_memory()
            except PoolBusyError:
                busy += 1
                while True:  # recover as the recipe would have
                    free_all()
                    if not pool.allocated_size():
                        break
                    await asyncio.sleep(0)
                await pool.release_memory()
        engine.update_weights()
        await pool.resume_memory()
        hold.release()
        holding = False

    try:
        async with asyncio.timeout(60):
            while True:
                # New clients arrive; a few queued ones are cancelled.
                for _ in range(rng.randint(0, args.arrivals)):
                    if spawned < len(requests):
                        req = requests[spawned]
                        tasks[req.id] = asyncio.ensure_future(client(req))
                        spawned += 1
                queued = [r for r in requests[:spawned] if r.queued]
                if queued and rng.random() < args.cancels:
                    tasks[rng.choice(queued).id].cancel()
                if since_update >= args.update_every and (running or arrived):
                    await update_weights()
                    updates += 1
                    since_update = 0
                    continue
                # 1. Arrivals: prefill (or recompute).
                for req in arrived:
                    engine.write_prompt(pool, req)
                    running.append(req)
                arrived.clear()
                # 2. Growth: a page for each request whose next token starts one.
                for req in running:
                    if req.prompt_len + req.launched >= len(req.pages) * ps:
                        page = pool.extend(req.row, 1)
                        if page is None:
                            raise RuntimeError("growth came up short: the pool is sized for it")
                        req.pages.append(int(page[0]))
                engine.planned()  # (host streams: step t-1 may read and write now)
                # 3. Launch step t.
                launched = None
                if running:
                    engine.launch_step(pool, running)
                    fence = record_fence(engine.forward)
                    pool.record_use([r.row for r in running], fence)
                    for req in running:
                        req.launched += 1
                    launched = (fence, [(r, r.admission) for r in running])
                    steps += 1
                    since_update += 1
                # 4. Process step t-1 while step t runs.
                if prev is not None:
                    await wait_fence(prev[0])
                    process(prev)
                prev = launched
                if prev is None and not arrived:
                    if spawned == len(requests) and all(t.done() for t in tasks.values()):
                        break
                    if spawned == len(requests):
                        changed.clear()
                        await changed.wait()  # an admission or a client's end
                        continue
                await asyncio.sleep(0)  # the scheduler is one task among the engine's
            await asyncio.gather(*tasks.values(), return_exceptions=True)
            await pool.drain()
        elapsed = time.perf_counter() - t0
    finally:
        for task in tasks.values():  # (on an error: the clients end first)
            task.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        await pool.close()
        engine.close()

    outcomes = {w: 0 for w in ("finished", "aborted", "timed out", "cancelled")}
    short = unended = 0
    for req in requests:
        if req.outcome in outcomes:
            outcomes[req.outcome] += 1
        else:
            unended += 1
        if req.outcome == "finished" and req.done != req.output_len:
            short += 1
    checked = sum(map(len, granted.values()))
    out_of_order = sum(
        sum(a > b for a, b in itertools.pairwise(tickets)) for tickets in granted.values()
    )
    bad_reads = int(engine.bad_reads)
    stats = pool.stats()
    pool.check_invariants()
    empty = (
        stats.allocated == stats.pending == 0 and stats.pages_allocated == stats.pages_pending == 0
    )
    where = "CUDA streams" if engine.cuda else "HostStream"
    print(
        f"weight_update: {len(requests)} requests on {args.rows} rows, {steps} steps, "
        f"{updates} weight updates, {most_yields} yields at most an update, "
        f"{requeued} requeued, {aborted} aborted at updates, "
        f"{outcomes['finished']} finished, {outcomes['timed out']} timed out, "
        f"{outcomes['cancelled']} cancelled, {checked} queued grants checked for order, "
        f"on {where}"
    )
    if bad_reads == busy == out_of_order == short == unended == 0 and empty:
        print(
            f"weight_update: OK: 0 refused releases, 0 corrupted reads, 0 out of order, "
            f"pool empty, {elapsed:.2f} s"
        )
        return 0
    print(
        f"weight_update: FAILED: {busy} refused releases, {bad_reads} corrupted reads, "
        f"{out_of_order} out of order, {short} short, {unended} unended, "
        f"{stats.allocated} rows and {stats.pages_allocated} pages still allocated"
    )
    return 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    p.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio")
    p.add_argument("--requests", type=int, default=150)
    p.add_argument("--rows", type=int, default=6, help="rows in the pool (row 0 excluded)")
    p.add_argument("--page-size", type=int, default=4, help="token slots a page")
    p.add_argument("--forward-ms", type=float, default=0.5, help="the forward's time per step")
    p.add_argument("--update-every", type=int, default=4, help="steps between weight updates")
    p.add_argument("--arrivals", type=int, default=3, help="most new clients a step")
    p.add_argument(
        "--timeouts", type=float, default=0.2, help="share of clients that bound their admission"
    )
    p.add_argument(
        "--cancels", type=float, default=0.05, help="probability a step cancels a queued client"
    )
    p.add_argument(
        "--abort-running",
        action="store_true",
        help="abort the requests running at an update instead of requeueing them",
    )
    p.add_argument(
        "--no-yield",
        action="store_true",
        help="free the running rows once, without yielding (the bug): release_memory refuses",
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available here")
    if (
        min(args.rows, args.page_size, args.update_every) < 1
        or min(args.requests, args.arrivals) < 0
    ):
        p.error("--rows, --page-size and --update-every must be at least 1, the rest at least 0")
    if not (0 <= args.forward_ms < float("inf")):
        p.error("--forward-ms must be a finite number >= 0")
    if not (0 <= args.timeouts <= 1 and 0 <= args.cancels <= 1):
        p.error("--timeouts and --cancels must be probabilities")
    return run_loop(run(args), args.loop)


if __name__ == "__main__":
    sys.exit(main())
