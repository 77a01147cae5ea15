"""vLLM's retract-and-retry loop over deferred frees: a program that checks itself.

An overlap loop over ``AsyncReqToTokenPool(kv=KVPagePool(...))`` shaped like
vLLM's scheduler: requests with priorities (a lower number is more urgent),
chunked prefill under a per-step token budget (``--budget``), decode growth
with ``extend(row, k)`` for each running request in turn. When ``extend``
answers None the scheduler retracts (preempts) the lowest-priority running
request (the greatest ``(priority, arrival)``) for recompute: its row and
pages are freed with ``free([row])`` and it goes back to the waiting queue,
to be re-admitted later with its prompt and the tokens it had made
prefilled again. Requests are admitted (``try_admit(pages=k)``, the pages
of their first chunk) only in a step that retracted nothing, as vLLM does.

The retracted request is in the batch of the step in flight, so its pages
are *pending* behind that step's fence after ``free``, not free: they come
back a step later (docs/api.md, *Retraction: the victim's pages come back a
step later*). Two ways to handle a short ``extend``:

* default, the documented fix: count what this pass's retractions will
  return (the victim's ``len(pages_of(row)) - pages_dropped(row)``, read
  before its ``free``), retract only until that covers the shortfall (pages
  already promised to another short request this pass are not counted
  twice), and let the short request sit this step out; it grows at the
  next;
* ``--verbatim``: vLLM's loop as is: retract, retry ``extend`` at once,
  until it fits or the short request has retracted itself. The retry never
  sees the victim's pages, so it retracts request after request: wasteful,
  not unsafe (the run must check out all the same).

Each step, for each request in the batch, the step reads the request's
context through its row and checks it (``corrupted reads``), then writes the
KV of the step's last position; the earlier positions of a prefill chunk
are written by the scheduler (on host streams from its own thread, before
the step in flight reads: see ``PagedEngine``). A finished request's KV and
row are copied out on a copy stream and compared at the end (``corrupted
KV``, ``corrupted rows``).

One flag puts a bug in, and the checks must then report corruptions (on
host streams; on CUDA the scheduler's writes go on the forward stream,
after the step in flight: docs/cuda.md): ``--free-at-once`` gives a
victim's pages back with no fence, through the public API as an engine
could: ``kv.free(pool.detach_pages(row))`` (detached pages are the caller's,
and ``kv.free`` holds them behind exactly the fences it is given: none),
then ``free([row])``. The retry's ``extend`` then succeeds, and a prefill
chunk written into a victim's page meets the step in flight that still
reads it.

Prints the steps, retractions, the most in one step, the requests finished
and the corruptions found. ``--loop uvloop`` runs it on uvloop. Exit
status: 0 when everything checks out and the pool ends empty, 1 otherwise.
Public API only.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncpool import AsyncReqToTokenPool, KVPagePool, record_fence, wait_fence

from _engine import PagedEngine, run_loop

MAX_PROMPT = 96
MAX_OUTPUT = 96
MAX_LEN = MAX_PROMPT + MAX_OUTPUT  # a row's slots


@dataclass
class Request:
    id: int  # also its arrival order
    priority: int  # lower is more urgent
    prompt_len: int
    output_len: int
    done: int = 0  # output tokens whose step has been processed
    pos: int = 0  # the next position to compute in this admission
    pos_before: int = 0  # pos before this step's chunk
    target: int = 0  # the positions to prefill in this admission
    admission: int = 0  # bumped at each (re-)admission
    row: int = -1
    pages: list[int] = field(default_factory=list)
    copied: list[Any] = field(default_factory=list)  # (KV, row) copied out at finish

    def value(self, pos: int) -> int:
        """What the KV holds at ``pos``."""
        return self.id * MAX_LEN + pos + 1

    def context_sum(self, n: int) -> int:
        """The sum of ``value(p)`` over ``p < n``."""
        return n * self.id * MAX_LEN + n * (n + 1) // 2

    def slot(self, pos: int, page_size: int) -> int:
        return self.pages[pos // page_size] * page_size + pos % page_size

    @property
    def last(self) -> int:
        """The last position a step computes: the step that makes the last
        output token ends there."""
        return self.prompt_len + self.output_len - 2


class Engine(PagedEngine):
    """The KV cache and the forward and copy streams (HostStreams or CUDA)."""

    def __init__(self, device: torch.device, num_pages: int, ps: int, forward_ms: float) -> None:
        super().__init__(device, num_pages, ps, forward_ms)
        self.copy: Any = self.new_stream("copy")

    def write_chunk(self, pool: AsyncReqToTokenPool, req: Request, lo: int, hi: int) -> None:
        """The scheduler's part of a prefill chunk ``lo..hi-1``: the row's
        slots up to ``hi - 1`` and the KV of ``lo..hi-2`` (the step computes
        ``hi - 1``)."""
        if hi - 1 <= lo:
            return
        slots = torch.tensor([req.slot(p, self.page_size) for p in range(hi - 1)])
        values = torch.tensor([req.value(p) for p in range(lo, hi - 1)])
        self.write(pool, req.row, slots, values, lo)

    def launch_step(self, pool: AsyncReqToTokenPool, batch: list[tuple[Request, int]]) -> None:
        """Each request reads positions ``0..p-1`` through its row and writes ``p``."""
        ps = self.page_size
        rows = torch.tensor([r.row for r, _ in batch])
        pos = torch.tensor([p for _, p in batch])
        slots = torch.tensor([r.slot(p, ps) for r, p in batch])
        values = torch.tensor([r.value(p) for r, p in batch])
        sums = torch.tensor([r.context_sum(p) for r, p in batch])
        self.launch_kernel(pool, rows, pos, slots, values, sums)

    def copy_out(self, pool: AsyncReqToTokenPool, req: Request) -> None:
        n = req.last + 1
        slots = torch.tensor([req.slot(p, self.page_size) for p in range(n)])
        self.copy_to_host(self.copy, pool, req.row, slots, req.copied)


async def run(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    rng = random.Random(args.seed)
    ps: int = args.page_size
    engine = Engine(device, args.pages + 1, ps, args.forward_ms)
    kv = KVPagePool(args.pages + 1, ps)
    pool = AsyncReqToTokenPool(
        args.rows + 1, MAX_LEN, device=device, kv=kv, stream=engine.forward if engine.cuda else None
    )
    arrivals = 0
    waiting: list[tuple[int, int, Request]] = []  # a heap of (priority, arrival, request)

    def arrive() -> None:
        nonlocal arrivals
        req = Request(
            arrivals,
            rng.randrange(args.priorities),
            rng.randint(1, MAX_PROMPT),
            rng.randint(1, MAX_OUTPUT),
        )
        heapq.heappush(waiting, (req.priority, req.id, req))
        arrivals += 1

    running: list[Request] = []
    finished: list[Request] = []
    retractions = most = 0
    budget = retracted = 0  # this step's tokens left and retractions so far
    batch: list[tuple[Request, int, int]] = []  # this step's (request, admission, end)

    def pages_for(n: int) -> int:
        return -(-n // ps)

    def retract(victim: Request) -> int:
        """Retract ``victim`` for recompute; the pages its free will return.
        A victim already in this step's batch leaves it (its budget back)."""
        nonlocal budget, retracted
        for i, (r, _, hi) in enumerate(batch):
            if r is victim:
                del batch[i]
                budget += hi - r.pos_before
                break
        retracted += 1
        returning = len(pool.pages_of(victim.row)) - pool.pages_dropped(victim.row)
        running.remove(victim)
        if args.free_at_once:  # the bug: its pages back with no fence
            kv.free(pool.detach_pages(victim.row, host=True))
        pool.free([victim.row])  # row and pages, behind its recorded uses
        victim.row, victim.pages = -1, []
        heapq.heappush(waiting, (victim.priority, victim.id, victim))
        return returning

    def lowest() -> Request:
        """The running request retracted first: the lowest priority, newest."""
        return max(running, key=lambda r: (r.priority, r.id))

    def schedule(req: Request, lo: int, hi: int) -> None:
        """Put positions ``lo..hi-1`` of ``req`` in this step."""
        nonlocal budget
        engine.write_chunk(pool, req, lo, hi)
        budget -= hi - lo
        req.pos_before, req.pos = lo, hi
        batch.append((req, req.admission, hi))

    def chunk(req: Request, budget: int) -> int:
        """The end of the positions ``req`` computes this step."""
        if req.pos < req.target:
            return min(req.target, req.pos + budget)
        return req.pos + 1

    prev: tuple[Any, list[tuple[Request, int, int]]] | None = None
    steps = 0
    t0 = time.perf_counter()
    try:
        while steps < args.steps:
            while len(waiting) < 2 * args.rows:
                arrive()
            budget = args.budget
            retracted = 0
            batch.clear()
            coming = 0  # pages this pass's retractions return, not yet promised
            for req in list(running):
                if req not in running or budget == 0 or req.pos > req.last:
                    continue  # retracted this pass, out of budget, or all launched
                hi = chunk(req, budget)
                k = pages_for(hi) - len(req.pages)
                while k > 0:
                    got = pool.extend(req.row, k)
                    if got is not None:
                        req.pages += got.tolist()
                        k = 0
                    elif args.verbatim:  # vLLM's loop: retract, retry at once
                        victim = lowest()
                        retract(victim)
                        if victim is req:
                            break
                    else:  # the fix: retract until what comes back covers it
                        short = k - kv.available_size()
                        while coming < short:
                            victim = lowest()
                            coming += retract(victim)
                            if victim is req:
                                break
                        else:
                            coming -= short  # promised to req, which sits out
                        break
                if k > 0:
                    continue  # retracted itself or sits this step out
                schedule(req, req.pos, hi)
            # Admission (vLLM: only in a step that retracted nothing).
            while not retracted and waiting and budget > 0:
                req = waiting[0][2]
                req.target = req.prompt_len + req.done
                hi = min(req.target, budget)
                grant = pool.try_admit(pages=pages_for(hi))
                if grant is None:
                    break
                heapq.heappop(waiting)
                req.row, req.pos = grant.row, 0
                req.pages = pool.pages_of(grant.row, host=True).tolist()
                req.admission += 1
                running.append(req)
                schedule(req, 0, hi)
            retractions += retracted
            most = max(most, retracted)
            engine.planned()  # (host streams: the step in flight may read now)
            launched = None
            if batch:
                engine.launch_step(pool, [(r, hi - 1) for r, _, hi in batch])
                fence = record_fence(engine.forward)
                pool.record_use([r.row for r, _, _ in batch], fence)
                launched = (fence, list(batch))
                steps += 1
            if prev is not None:
                await wait_fence(prev[0])
                for req, admission, hi in prev[1]:
                    if req.admission != admission or req not in running:
                        continue  # retracted since: recomputed at re-admission
                    if hi < req.target:
                        continue  # a prefill chunk short of the end: no token
                    req.done += 1
                    if req.done < req.output_len:
                        continue
                    running.remove(req)
                    engine.copy_out(pool, req)
                    pool.free([req.row], after=engine.copy)
                    finished.append(req)
            prev = launched
            await asyncio.sleep(0)
        for req in list(running):  # the run ends: the rest are let go
            running.remove(req)
            pool.free([req.row])
        engine.planned()
        async with asyncio.timeout(30):
            await pool.drain()
        engine.synchronize()
        elapsed = time.perf_counter() - t0
    finally:
        await pool.close()
        engine.close()

    bad_kv = bad_rows = 0
    for req in finished:
        n = req.last + 1
        kv_got, row_got = req.copied[-1]
        if [int(x) for x in kv_got.tolist()] != [req.value(p) for p in range(n)]:
            bad_kv += 1
        if [int(x) for x in row_got.tolist()] != [req.slot(p, ps) for p in range(n)]:
            bad_rows += 1
    bad_reads = int(engine.bad_reads)
    stats = pool.stats()
    pool.check_invariants()
    empty = stats.allocated == stats.pending == stats.pages_allocated == stats.pages_pending == 0
    where = "CUDA streams" if engine.cuda else "HostStream"
    mode = "verbatim" if args.verbatim else "counted"
    print(
        f"preempt_retry: {mode} retry on {args.rows} rows and {args.pages} pages of {ps}, "
        f"{steps} steps, {retractions} retractions, {most} most in a step, "
        f"{len(finished)} finished, on {where}"
    )
    if bad_kv == bad_rows == bad_reads == 0 and empty:
        print(
            f"preempt_retry: OK: 0 corrupted reads, 0 corrupted KV, 0 corrupted rows, "
            f"pool empty, {elapsed:.2f} s"
        )
        return 0
    print(
        f"preempt_retry: FAILED: {bad_reads} corrupted reads, {bad_kv} corrupted KV, "
        f"{bad_rows} corrupted rows, {stats.allocated} rows and {stats.pages_allocated} "
        f"pages still allocated, {stats.pending} rows and {stats.pages_pending} pages pending"
    )
    return 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    p.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio")
    p.add_argument("--steps", type=int, default=1000, help="steps to run")
    p.add_argument("--rows", type=int, default=32, help="rows in the pool (row 0 excluded)")
    p.add_argument("--pages", type=int, default=512, help="KV pages (page 0 excluded)")
    p.add_argument("--page-size", type=int, default=4, help="token slots a page")
    p.add_argument("--budget", type=int, default=64, help="tokens a step computes at most")
    p.add_argument("--priorities", type=int, default=4, help="priority levels")
    p.add_argument("--forward-ms", type=float, default=0.0, help="the forward's time per step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--verbatim",
        action="store_true",
        help="vLLM's loop as is: retract and retry at once until it fits or retracts itself",
    )
    p.add_argument(
        "--free-at-once",
        action="store_true",
        help="give a victim's pages back with no fence (the bug): reused while a step reads them",
    )
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available here")
    if min(args.rows, args.page_size, args.budget, args.priorities) < 1 or args.steps < 0:
        p.error("--rows, --page-size, --budget, --priorities: at least 1; --steps: at least 0")
    if not 0 <= args.forward_ms < float("inf"):
        p.error("--forward-ms must be a finite number >= 0")
    # The longest request's steps compute positions 0..MAX_LEN - 2.
    least = -(-(MAX_LEN - 1) // args.page_size)
    if args.pages < least:  # it would retract itself for ever
        p.error(f"--pages must be at least {least} here")
    return run_loop(run(args), args.loop)


if __name__ == "__main__":
    sys.exit(main())
