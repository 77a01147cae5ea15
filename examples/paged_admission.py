"""Paged KV in an overlap loop, admitted atomically: a program that checks itself.

An engine-shaped loop over ``AsyncReqToTokenPool(kv=KVPagePool(...))``, the
second stage's API in the order a scheduler calls it, each step:

1. **growth first**: the running requests whose next token starts a page get
   one page each from one ``extend_rows(rows, 1)``. It never waits: when the
   pool is short it returns None, and the scheduler empties its prefix cache
   or retracts its newest request (``free([row])``, back to the front of the
   queue); that memory returns once the step in flight is past it, so the
   growing requests sit this step out;
2. **admission**: waiting requests get a row and the pages of their prompt in
   one call, all or nothing (``try_admit(pages=n)``, keeping ``--headroom``
   pages free for growth, as engines reserve decode budget); when nothing
   runs, the scheduler awaits ``pool.admit(pages=n)`` instead, which the
   completion of the fences holding that memory wakes. A new request's
   prompt KV and its row of ``req_to_token`` are written at once;
3. **launch** step t on the forward stream (it writes each request's next KV
   slot and ``req_to_token`` entry), record one fence right after it and
   ``record_use`` every row of the batch: that one call covers the rows'
   pages too;
4. **process** step t-1 while step t runs: a finished (or client-aborted)
   request's KV and row are copied out on a copy stream and the row is freed
   with ``free([row], after=copy_stream)``: its pages go with it, behind the
   row's recorded uses and the copy. Every ``--detach``-th one first hands its
   pages to a one-entry prefix cache (``detach_pages``), which frees them to
   the ``KVPagePool`` when it evicts them, behind the newest step that may
   write them and the copy (``kv.free(pages, fence=..., after=copy_stream)``).

At the end every finished request's copied KV and row are compared with what
its steps wrote: a page or row handed to a new request while an old step
still wrote into it shows up as a mismatch.

Runs on :class:`~asyncpool.HostStream` workers without a GPU and on CUDA
streams when ``torch.cuda.is_available()`` (``--device cpu`` forces the host
streams). ``--no-record-use`` leaves out ``record_use``, as an engine that
forgets it would: a retracted or finished request's row and pages are then
reused while the step in flight still writes them, and the check reports
corruptions (on the host streams, where the scheduler writes a new owner's
prompt from its own thread; on CUDA the prompt is written on the forward
stream, whose order puts the late write first: docs/cuda.md). The test runs
it with ``--requests 300 --forward-ms 3`` for a wider window.

Exit status: 0 when everything checks out and the pool ends empty, 1
otherwise. Public API only.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncpool import (
    AsyncReqToTokenPool,
    Grant,
    HostStream,
    KVPagePool,
    ReqToTokenPoolInfo,
    record_fence,
)

MAX_LEN = 128


def token(req_id: int, pos: int) -> int:
    """What the request's KV holds at ``pos`` (what its steps write there)."""
    return req_id * MAX_LEN + pos + 1


@dataclass
class Request:
    id: int
    prompt_len: int
    output_len: int
    done: int = 0  # output tokens whose step has been processed
    launched: int = 0  # output tokens whose step has been launched (>= done)
    admission: int = 0  # bumped at each (re-)admission
    row: int = -1
    pages: list[int] = field(default_factory=list)  # its KV pages, in order
    copied: list[Any] = field(default_factory=list)  # (KV, row) copied out at finish

    @property
    def length(self) -> int:
        return self.prompt_len + self.done

    def slot(self, pos: int, page_size: int) -> int:
        """The KV slot of position ``pos``: its page's first slot + offset."""
        return self.pages[pos // page_size] * page_size + pos % page_size


class Engine:
    """The KV cache and the forward and copy streams (HostStreams or CUDA)."""

    def __init__(self, device: torch.device, num_pages: int, page_size: int,
                 forward_ms: float) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.page_size = page_size
        self.forward_s = forward_ms / 1e3
        # The engine's KV cache, one value a slot; page 0 is the pool's padding.
        self.kv_cache = torch.zeros(num_pages * page_size, dtype=torch.int64, device=device)
        self.forward: Any
        self.copy: Any
        if self.cuda:
            self.forward = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            self.copy = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        else:
            self.forward = HostStream("forward")
            self.copy = HostStream("copy")
            # torch's intra-op threads are per thread: keep the workers to one.
            self.forward.launch(torch.set_num_threads, 1)
            self.copy.launch(torch.set_num_threads, 1)

    def write_prompt(self, pool: AsyncReqToTokenPool, req: Request) -> None:
        """Prefill: the KV of positions ``0..length-1`` and the row's slots."""
        n = req.length
        slots = torch.tensor([req.slot(p, self.page_size) for p in range(n)])
        values = torch.tensor([token(req.id, p) for p in range(n)])
        info = ReqToTokenPoolInfo(n, n, slots.to(torch.int32))
        if self.cuda:
            with torch.cuda.stream(self.forward):
                self.kv_cache[slots.to(self.device)] = values.to(self.device)
                pool.set_req_pool_info(req.row, info)
        else:
            self.kv_cache[slots] = values
            pool.set_req_pool_info(req.row, info)

    def launch_step(self, pool: AsyncReqToTokenPool, batch: list[Request]) -> None:
        """The forward of one step: each request's next KV slot and row entry."""
        ps = self.page_size
        pos_list = [r.prompt_len + r.launched for r in batch]
        rows = torch.tensor([r.row for r in batch])
        pos = torch.tensor(pos_list)
        slots = torch.tensor([r.slot(p, ps) for r, p in zip(batch, pos_list, strict=True)])
        values = torch.tensor([token(r.id, p) for r, p in zip(batch, pos_list, strict=True)])
        args = (self.kv_cache, pool.req_to_token, pool.verified_lens)
        if self.cuda:
            with torch.cuda.stream(self.forward):
                rows, pos, slots, values = (t.to(self.device) for t in (rows, pos, slots, values))
                torch.cuda._sleep(int(self.forward_s * 1.5e9))  # type: ignore[no-untyped-call]
                _write_step(*args, rows, pos, slots, values)
        else:
            self.forward.launch(_host_step, self.forward_s, *args, rows, pos, slots, values)

    def copy_out(self, pool: AsyncReqToTokenPool, req: Request) -> None:
        """Copy a finished request's KV and row to the host, on the copy stream."""
        n = req.prompt_len + req.output_len
        slots = torch.tensor([req.slot(p, self.page_size) for p in range(n)])
        row = pool.req_to_token[req.row, :n]
        if self.cuda:
            kv_host = torch.empty(n, dtype=torch.int64, pin_memory=True)
            row_host = torch.empty(n, dtype=row.dtype, pin_memory=True)
            with torch.cuda.stream(self.copy):
                kv_host.copy_(self.kv_cache[slots.to(self.device)], non_blocking=True)
                row_host.copy_(row, non_blocking=True)
            req.copied.append((kv_host, row_host))
        else:
            kv_cache = self.kv_cache
            self.copy.launch(lambda: req.copied.append((kv_cache[slots], row.clone())))

    def synchronize(self) -> None:
        self.forward.synchronize()
        self.copy.synchronize()

    def close(self) -> None:
        if not self.cuda:
            self.forward.close()
            self.copy.close()


def _write_step(kv_cache: torch.Tensor, req_to_token: torch.Tensor,
                verified_lens: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor,
                slots: torch.Tensor, values: torch.Tensor) -> None:
    kv_cache[slots] = values
    req_to_token[rows, pos] = slots.to(req_to_token.dtype)
    verified_lens[rows] = (pos + 1).to(verified_lens.dtype)


def _host_step(delay_s: float, *args: torch.Tensor) -> None:
    time.sleep(delay_s)  # the forward's compute, on the stream's worker
    _write_step(*args)


def admission_pages(req: Request, page_size: int) -> int:
    """Pages for a request's prompt (its length so far) and its first new token."""
    return -(-(req.length + 1) // page_size)


async def run(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    rng = random.Random(args.seed)
    ps = args.page_size
    engine = Engine(device, args.pages + 1, ps, args.forward_ms)
    # Page ids live on the host (the scheduler computes slots from them); the
    # KV cache is the engine's, on its device.
    kv = KVPagePool(args.pages + 1, ps)
    pool = AsyncReqToTokenPool(args.rows + 1, MAX_LEN, device=device, kv=kv,
                               stream=engine.forward if engine.cuda else None)
    requests = [Request(i, rng.randint(8, 40), rng.randint(2, 24)) for i in range(args.requests)]
    waiting = collections.deque(requests)
    running: list[Request] = []
    finished: list[Request] = []
    prefix_cache: list[tuple[torch.Tensor, Any]] = []  # (detached pages, newest step fence)
    retractions = detached = aborts = 0

    def start(req: Request, grant: Grant) -> None:
        req.row = grant.row
        req.pages = grant.pages.tolist()
        req.admission += 1
        req.launched = req.done
        engine.write_prompt(pool, req)
        running.append(req)

    def evict_all() -> None:
        # The cache owns these pages: each entry goes back behind the newest
        # step that wrote it and the copy that read it.
        while prefix_cache:
            pages, fence = prefix_cache.pop(0)
            kv.free(pages, fence=fence, after=engine.copy)

    # The step in flight: its fence and its batch, as (request, admission).
    prev: tuple[Any, list[tuple[Request, int]]] | None = None
    steps = 0
    t0 = time.perf_counter()
    try:
        while len(finished) < len(requests):
            # 1. Decode growth first: a page for each request whose next token
            #    starts one, all at once; never waits.
            growing = [r for r in running if r.prompt_len + r.launched >= len(r.pages) * ps]
            sitting_out: set[int] = set()
            if growing:
                got = pool.extend_rows([r.row for r in growing], 1)
                if got is None:
                    # Short: empty the prefix cache if it holds anything, else
                    # retract the newest request (back to the front of the
                    # queue). The memory returns once the step in flight is
                    # past it, so the growing requests sit this step out.
                    if prefix_cache:
                        evict_all()
                    else:
                        victim = running.pop()
                        pool.free([victim.row])  # row and pages, behind its recorded uses
                        waiting.appendleft(victim)
                        retractions += 1
                    sitting_out = {r.id for r in growing}
                else:
                    for req, page in zip(growing, got[:, 0].tolist(), strict=True):
                        req.pages.append(page)
            # 2. Admission: a row and the pages of the prompt and its first
            #    token in one call, keeping --headroom pages free for growth
            #    (engines reserve decode budget the same way); none while
            #    growth came up short. When nothing runs, await the next
            #    admission: the fences of the memory it needs wake it.
            while waiting and not sitting_out:
                need = admission_pages(waiting[0], ps)
                if kv.available_size() - need < args.headroom:
                    break
                grant = pool.try_admit(pages=need)
                if grant is None:
                    break
                start(waiting.popleft(), grant)
            if not running and waiting:
                evict_all()
                req = waiting.popleft()
                start(req, await pool.admit(pages=admission_pages(req, ps), timeout=30))
            # 3. Launch step t and tie its rows (and so their pages) to its fence.
            batch = [r for r in running if r.id not in sitting_out]
            launched = None
            if batch:
                engine.launch_step(pool, batch)           # on the forward stream
                fence = record_fence(engine.forward)      # one fence per step, right after
                if args.record_use:
                    pool.record_use([r.row for r in batch], fence)  # rows and their pages
                for req in batch:
                    req.launched += 1
                launched = (fence, [(r, r.admission) for r in batch])
                steps += 1
            # 4. Process step t-1 while step t runs.
            if prev is not None:
                prev_fence, prev_batch = prev
                prev_fence.synchronize()   # its results are ready
                newest = launched[0] if launched is not None else prev_fence
                for req, admission in prev_batch:
                    if req.admission != admission or req not in running:
                        continue  # retracted since: that step's token is discarded
                    req.done += 1
                    if req.done < req.output_len:
                        if rng.random() >= args.abort:
                            continue
                        # The client went away: it ends here, as if finished
                        # (what it got so far is checked too).
                        req.output_len = req.done
                        aborts += 1
                    running.remove(req)                   # finished (or aborted)
                    engine.copy_out(pool, req)            # launched after step t's fence...
                    if args.detach and len(finished) % args.detach == 0:
                        # Prefix caching: the cache takes the pages; step t may
                        # still write the last one, so it keeps step t's fence.
                        evict_all()  # a cache of one entry
                        prefix_cache.append((pool.detach_pages(req.row), newest))
                        detached += 1
                    pool.free([req.row], after=engine.copy)  # ...so the free waits for it too
                    finished.append(req)
            prev = launched
            await asyncio.sleep(0)  # the scheduler is one task among the engine's
        evict_all()
        async with asyncio.timeout(30):
            await pool.drain()
        engine.synchronize()
        elapsed = time.perf_counter() - t0
    finally:
        await pool.close()
        engine.close()

    bad_kv = bad_rows = 0
    for req in finished:
        n = req.prompt_len + req.output_len
        kv_got, row_got = req.copied[-1]
        if [int(x) for x in kv_got.tolist()] != [token(req.id, p) for p in range(n)]:
            bad_kv += 1
        if [int(x) for x in row_got.tolist()] != [req.slot(p, ps) for p in range(n)]:
            bad_rows += 1
    stats = pool.stats()
    pool.check_invariants()
    empty = (stats.allocated == stats.pending == 0
             and stats.pages_allocated == stats.pages_pending == 0)
    where = "CUDA streams" if engine.cuda else "HostStream"
    print(f"paged_admission: {len(requests)} requests on {args.rows} rows and {args.pages} "
          f"pages of {ps}, {steps} steps, {retractions} retractions, {aborts} aborts, "
          f"{detached} detached, {stats.deferred_frees} deferred row frees, on {where}")
    if bad_kv == 0 and bad_rows == 0 and empty:
        print(f"paged_admission: OK: 0 corrupted rows, 0 corrupted KV, pool empty, "
              f"{elapsed:.2f} s")
        return 0
    print(f"paged_admission: FAILED: {bad_rows} corrupted rows, {bad_kv} corrupted KV, "
          f"{stats.allocated} rows and {stats.pages_allocated} pages still allocated, "
          f"{stats.pending} rows and {stats.pages_pending} pages pending")
    return 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--requests", type=int, default=120)
    p.add_argument("--rows", type=int, default=8, help="rows in the pool (row 0 excluded)")
    p.add_argument("--pages", type=int, default=24, help="KV pages (page 0 excluded)")
    p.add_argument("--page-size", type=int, default=8, help="token slots a page")
    p.add_argument("--forward-ms", type=float, default=1.0, help="the forward's time per step")
    p.add_argument("--detach", type=int, default=3,
                   help="every N-th finished request goes to the prefix cache (0: none)")
    p.add_argument("--headroom", type=int, default=0,
                   help="free pages kept for decode growth when admitting")
    p.add_argument("--abort", type=float, default=0.01,
                   help="probability that a client aborts after each token")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-record-use", dest="record_use", action="store_false",
                   help="leave out record_use (the bug): rows and pages are reused too soon")
    args = p.parse_args(argv)
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
