"""Paged KV in an overlap loop, admitted atomically: a program that checks itself.

An engine-shaped loop over ``AsyncReqToTokenPool(kv=KVPagePool(...))``, the
second stage's API in the order a scheduler calls it, with a small prefix
cache on top: each prompt starts with one of ``--prefixes`` shared prefixes
(a system prompt of ``--prefix-pages`` full pages). Each step:

1. **growth first**: the running requests whose next token starts a page get
   one page each from one ``extend_rows(rows, 1)``. It never waits: when the
   pool is short it returns None, and the scheduler evicts from its prefix
   cache or, if nothing is evictable, retracts its newest request
   (``free([row])``, back to the front of the queue); that memory returns
   once the steps that use it are done, so the growing requests sit this
   step out;
2. **admission**: a waiting request whose prefix is cached *borrows* the
   cached pages: it is admitted with the pages of the rest of its prompt
   only (``try_admit(pages=k)``, a row and its own pages in one call, all or
   nothing, keeping ``--headroom`` pages free for growth), and its row of
   ``req_to_token`` lists the cached pages' slots, then its own; only the
   uncached part's KV is written. When short, the cache evicts first. When
   nothing runs, the scheduler empties the cache and then awaits
   ``pool.admit(pages=k)``, which the completion of the fences holding that
   memory wakes (a queued ``admit`` cannot make the cache evict: the pool
   knows nothing of the cache);
3. **launch** step t on the forward stream: for each request it reads the
   KV of its context through its row (attention), then writes its next KV
   slot and ``req_to_token`` entry. One fence is recorded right after it;
   ``record_use`` ties every row of the batch, and so the pages the rows
   own, to it; every cache entry that a request of the batch borrows keeps
   it as its newest *reader* fence, since ``record_use`` does not cover
   borrowed pages;
4. **process** step t-1 while step t runs: a finished (or client-aborted)
   request's KV and row are copied out on a copy stream and the row is freed
   with ``free([row], after=copy_stream)``: its own pages go with it, behind
   the row's recorded uses and the copy. If its prefix is not cached yet,
   the cache first takes the row's pages (``detach_pages``, which drops the
   row's fences for them: the cache carries the row's newest step fence
   along), keeps the prefix pages and frees the rest with
   ``kv.free(rest, fence=newest_step, after=copy_stream)``.

The cache evicts the entries no running request borrows, least recently read
first, with ``kv.free(pages, fence=newest_reader, after=copy_stream)``: step
t may still read an entry whose last borrower finished or was retracted at
t-1 (the loop discards that token, but the step reads the pages all the
same), and the copy stream may still read it for a finished request.

Every step checks what it read: each request's context, read through its
row, must sum to what the request's positions hold (``corrupted reads``).
At the end every finished request's copied KV and row are compared with what
its steps wrote: a page or row handed to a new request while an old step
still used it shows up as a mismatch.

Runs on :class:`~asyncpool.HostStream` workers without a GPU and on CUDA
streams when ``torch.cuda.is_available()`` (``--device cpu`` forces the host
streams). On the host streams a step reads and writes only once the
scheduler has written the prompts of the next step's requests (a
``threading.Event`` per step), so a page or row handed to a new request
while a step still uses it is caught each time the scheduler writes into
it, not by luck of timing. Two
flags put a bug in, and the checks must then report corruptions (on the host
streams, where the scheduler writes a new owner's prompt from its own
thread; on CUDA the prompt is written on the forward stream, whose order
puts the old step first: docs/cuda.md):

* ``--no-record-use`` leaves out ``record_use``, as an engine that forgets
  it would: a retracted or finished request's row and pages are reused
  while the step in flight still uses them;
* ``--evict-behind-write-fence`` evicts a cache entry behind the fence it
  had when the cache took it (the newest step of the row that wrote it), as
  if the writer were all that mattered: its pages go to a new request, whose
  prompt is written into them while a step (or a copy) still reads them.

On host streams the copies of the requests finished in a step land before
the next admissions (the earliest a copy can end), so a row or page freed
behind the copy alone is reused while a step still reads it every run, not
by the copy thread's timing. The test runs each with ``--requests 300``.
``--loop uvloop`` runs it on uvloop. Exit status: 0 when everything checks
out and the pool ends empty, 1 otherwise. Public API only.
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
    KVPagePool,
    record_fence,
    wait_fence,
)

from _engine import DecodeEngine, run_loop

MAX_LEN = 128


@dataclass
class Entry:
    """A cached prefix: its pages and the fences its eviction may need."""

    pages: torch.Tensor  # detached from the request that wrote them
    written: Any  # the newest step fence of that request's row (the write fence)
    read: Any  # the newest step fence of any row that read them since
    last_read: int  # that step's number (least recently read goes first)
    users: int = 0  # running requests that borrow the pages: not evictable


@dataclass
class Request:
    id: int
    prefix: int  # which shared prefix its prompt starts with
    prefix_len: int
    prompt_len: int
    output_len: int
    done: int = 0  # output tokens whose step has been processed
    launched: int = 0  # output tokens whose step has been launched (>= done)
    admission: int = 0  # bumped at each (re-)admission
    row: int = -1
    pages: list[int] = field(default_factory=list)  # its KV pages, in order (borrowed first)
    borrowed: Entry | None = None  # the cache entry whose pages it reads
    copied: list[Any] = field(default_factory=list)  # (KV, row) copied out at finish

    @property
    def length(self) -> int:
        return self.prompt_len + self.done

    def value(self, pos: int) -> int:
        """What the KV holds at ``pos``: the shared prefix's, then its own."""
        if pos < self.prefix_len:
            return -(self.prefix * MAX_LEN + pos + 1)
        return self.id * MAX_LEN + pos + 1

    def slot(self, pos: int, page_size: int) -> int:
        """The KV slot of position ``pos``: its page's first slot + offset."""
        return self.pages[pos // page_size] * page_size + pos % page_size


class PrefixCache:
    """Shared prefixes, keyed by prefix id: a radix tree of one level.

    The pool counts these pages as allocated and knows nothing of the cache:
    the scheduler evicts, before it admits. A borrowing row's ``record_use``
    does not cover the pages it borrows, so each entry keeps the fence of
    the newest step that read it, and an eviction waits for it.
    """

    def __init__(self, kv: KVPagePool, copy: Any, behind_write_fence: bool) -> None:
        self.kv = kv
        self.copy = copy
        self.behind_write_fence = behind_write_fence  # the bug, on purpose
        self.entries: dict[int, Entry] = {}
        self.evicted = 0

    def insert(self, prefix: int, pages: torch.Tensor, fence: Any, step: int) -> None:
        """Cache ``pages`` (detached): ``fence`` is the newest step of the row
        that wrote them, which ``detach_pages`` no longer keeps for them."""
        self.entries[prefix] = Entry(pages, fence, fence, step)

    def evict(self, pages: int, keep: Entry | None = None) -> int:
        """Evict unborrowed entries, least recently read first, until
        ``pages`` pages are evicted; return how many were."""
        evicted = 0
        idle = [(e.last_read, p) for p, e in self.entries.items() if e.users == 0 and e is not keep]
        for _, prefix in sorted(idle):
            if evicted >= pages:
                break
            e = self.entries.pop(prefix)
            if self.behind_write_fence:  # the bug: as if only their writer mattered
                self.kv.free(e.pages, fence=e.written)
            else:  # behind every reader: the newest step, and the copies of
                #     finished requests that read them on the copy stream
                self.kv.free(e.pages, fence=e.read, after=self.copy)
            evicted += len(e.pages)
            self.evicted += 1
        return evicted


class Engine(DecodeEngine):
    """The KV cache and the forward and copy streams (HostStreams or CUDA);
    the prefill (``write_prompt``) and steps are ``DecodeEngine``'s."""

    def __init__(
        self, device: torch.device, num_pages: int, page_size: int, forward_ms: float
    ) -> None:
        super().__init__(device, num_pages, page_size, forward_ms)
        self.copy: Any = self.new_stream("copy")

    def copy_out(self, pool: AsyncReqToTokenPool, req: Request) -> None:
        """Copy a finished request's KV and row to the host, on the copy stream."""
        n = req.prompt_len + req.output_len
        slots = torch.tensor([req.slot(p, self.page_size) for p in range(n)])
        self.copy_to_host(self.copy, pool, req.row, slots, req.copied)


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
    pool = AsyncReqToTokenPool(
        args.rows + 1, MAX_LEN, device=device, kv=kv, stream=engine.forward if engine.cuda else None
    )
    cache = PrefixCache(kv, engine.copy, args.evict_behind_write_fence)
    prefix_len = args.prefix_pages * ps
    requests = [
        Request(
            i,
            rng.randrange(max(args.prefixes, 1)),
            prefix_len,
            prefix_len + rng.randint(1, 24),
            rng.randint(2, 24),
        )
        for i in range(args.requests)
    ]
    waiting = collections.deque(requests)
    running: list[Request] = []
    finished: list[Request] = []
    retractions = hits = aborts = 0

    def lookup(req: Request) -> Entry | None:
        return cache.entries.get(req.prefix)

    def need(req: Request, entry: Entry | None) -> int:
        return admission_pages(req, ps) - (len(entry.pages) if entry is not None else 0)

    def start(req: Request, grant: Grant, entry: Entry | None) -> None:
        nonlocal hits
        req.row = grant.row
        req.pages = pool.pages_of(grant.row, host=True).tolist()  # host ids: no read-back
        req.admission += 1
        req.launched = req.done
        cached = 0
        if entry is not None:  # a hit: borrow the cached pages
            entry.users += 1  # not evictable while it runs
            req.borrowed = entry
            req.pages = entry.pages.tolist() + req.pages
            cached = len(entry.pages) * ps
            hits += 1
        engine.write_prompt(pool, req, cached)
        running.append(req)

    def stop(req: Request) -> None:
        running.remove(req)
        if req.borrowed is not None:
            req.borrowed.users -= 1
            req.borrowed = None

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
                    # Short: evict from the prefix cache if it can, else
                    # retract the newest request (back to the front of the
                    # queue). The memory returns once the steps that use it
                    # are done, so the growing requests sit this step out.
                    if not cache.evict(len(growing)):
                        victim = running[-1]
                        stop(victim)
                        pool.free([victim.row])  # row and pages, behind its recorded uses
                        waiting.appendleft(victim)
                        retractions += 1
                    sitting_out = {r.id for r in growing}
                else:
                    for req, page in zip(growing, got[:, 0].tolist(), strict=True):
                        req.pages.append(page)
            # 2. Admission: a row and the pages of the uncached prompt and its
            #    first token in one call, keeping --headroom pages free for
            #    growth (engines reserve decode budget the same way); the
            #    cache evicts when short; none while growth came up short.
            if not engine.cuda:
                # Host streams: the copies of the requests finished last step
                # land first, as early as a copy can, so a row freed behind
                # the copy alone (the --no-record-use bug) goes to a new
                # request before the step still reading it runs: caught every
                # time, not by how soon the copy thread gets a core.
                engine.copy.synchronize()
            pool.reclaim()  # the counts below only read: take what completed first
            while waiting and not sitting_out:
                entry = lookup(waiting[0])
                short = need(waiting[0], entry) + args.headroom - kv.available_size()
                if short > 0:
                    cache.evict(short, keep=entry)  # pending until their readers are done
                    if need(waiting[0], entry) + args.headroom > kv.available_size():
                        break
                grant = pool.try_admit(pages=need(waiting[0], entry))
                if grant is None:
                    break
                start(waiting.popleft(), grant, entry)
            engine.planned()  # (host streams: step t-1 may read and write now)
            if not running and waiting:
                # Nothing runs: await the admission. The pool cannot make the
                # cache evict, so evict first; the fences of the memory it
                # needs wake it.
                cache.evict(args.pages)
                req = waiting.popleft()
                start(req, await pool.admit(pages=need(req, None), timeout=30), None)
            # 3. Launch step t; tie its rows (and so their own pages) to its
            #    fence, and the cache entries they borrow as well.
            batch = [r for r in running if r.id not in sitting_out]
            launched = None
            if batch:
                engine.launch_step(pool, batch)  # on the forward stream
                fence = record_fence(engine.forward)  # one fence per step, right after
                if args.record_use:
                    pool.record_use([r.row for r in batch], fence)  # rows and their pages
                for req in batch:
                    req.launched += 1
                    if req.borrowed is not None:  # borrowed pages: the cache's
                        req.borrowed.read, req.borrowed.last_read = fence, steps
                launched = (fence, [(r, r.admission) for r in batch])
                steps += 1
            # 4. Process step t-1 while step t runs.
            if prev is not None:
                prev_fence, prev_batch = prev
                await wait_fence(prev_fence)  # its results are ready; the loop runs on
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
                    stop(req)  # finished (or aborted)
                    engine.copy_out(pool, req)  # launched after step t's fence...
                    if args.prefixes and req.prefix not in cache.entries:
                        # The cache takes its prefix pages. detach_pages drops
                        # the row's fences, so the cache carries the newest
                        # along (step t may still use the row), and the rest
                        # are freed behind it and the copy.
                        pages, k = pool.detach_pages(req.row, host=True), args.prefix_pages
                        cache.insert(req.prefix, pages[:k], newest, steps)
                        kv.free(pages[k:], fence=newest, after=engine.copy)
                    pool.free([req.row], after=engine.copy)  # ...so the free waits for it too
                    finished.append(req)
            prev = launched
            await asyncio.sleep(0)  # the scheduler is one task among the engine's
        cache.evict(args.pages)
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
        n = req.prompt_len + req.output_len
        kv_got, row_got = req.copied[-1]
        if [int(x) for x in kv_got.tolist()] != [req.value(p) for p in range(n)]:
            bad_kv += 1
        if [int(x) for x in row_got.tolist()] != [req.slot(p, ps) for p in range(n)]:
            bad_rows += 1
    bad_reads = int(engine.bad_reads)
    stats = pool.stats()
    pool.check_invariants()
    empty = (
        stats.allocated == stats.pending == 0 and stats.pages_allocated == stats.pages_pending == 0
    )
    where = "CUDA streams" if engine.cuda else "HostStream"
    print(
        f"paged_admission: {len(requests)} requests on {args.rows} rows and {args.pages} "
        f"pages of {ps}, {steps} steps, {retractions} retractions, {aborts} aborts, "
        f"{hits} prefix hits, {cache.evicted} evictions, {stats.deferred_frees} deferred "
        f"row frees, on {where}"
    )
    if bad_kv == bad_rows == bad_reads == 0 and empty:
        print(
            f"paged_admission: OK: 0 corrupted rows, 0 corrupted KV, 0 corrupted reads, "
            f"pool empty, {elapsed:.2f} s"
        )
        return 0
    print(
        f"paged_admission: FAILED: {bad_rows} corrupted rows, {bad_kv} corrupted KV, "
        f"{bad_reads} corrupted reads, {stats.allocated} rows and {stats.pages_allocated} "
        f"pages still allocated, {stats.pending} rows and {stats.pages_pending} pages pending"
    )
    return 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    p.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio")
    p.add_argument("--requests", type=int, default=120)
    p.add_argument("--rows", type=int, default=8, help="rows in the pool (row 0 excluded)")
    p.add_argument("--pages", type=int, default=24, help="KV pages (page 0 excluded)")
    p.add_argument("--page-size", type=int, default=8, help="token slots a page")
    p.add_argument("--forward-ms", type=float, default=1.0, help="the forward's time per step")
    p.add_argument(
        "--prefixes", type=int, default=4, help="shared prompt prefixes (0: no prefix cache)"
    )
    p.add_argument("--prefix-pages", type=int, default=2, help="pages of a shared prefix")
    p.add_argument(
        "--headroom", type=int, default=0, help="free pages kept for decode growth when admitting"
    )
    p.add_argument(
        "--abort",
        type=float,
        default=0.01,
        help="probability that a client aborts after each token",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--no-record-use",
        dest="record_use",
        action="store_false",
        help="leave out record_use (the bug): rows and pages are reused too soon",
    )
    p.add_argument(
        "--evict-behind-write-fence",
        action="store_true",
        help="evict cached pages behind the fence of the row that wrote them, "
        "not their newest reader's (the bug): reused while still read",
    )
    args = p.parse_args(argv)
    # Refused with exit 2, not a traceback and exit 1 (the status of
    # corruption found).
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available here")
    if min(args.rows, args.page_size) < 1 or min(args.requests, args.prefixes) < 0:
        p.error("--rows and --page-size must be at least 1, --requests and --prefixes at least 0")
    if min(args.prefix_pages, args.headroom) < 0:
        p.error("--prefix-pages and --headroom must be at least 0")
    if not (0 <= args.forward_ms < float("inf") and 0 <= args.abort <= 1):
        p.error("--forward-ms must be a finite number >= 0 and --abort a probability")
    # The longest request: a prompt of the prefix and 24 tokens, 24 output
    # tokens, and the step in flight when it finishes writes one past them:
    # positions 0..longest - 1, each in its row and in a page of its own.
    longest = args.prefix_pages * args.page_size + 24 + 24 + 1
    if longest > MAX_LEN:  # a row holds MAX_LEN slots
        p.error(f"--prefix-pages times --page-size must be at most {MAX_LEN - 49}")
    least = -(-longest // args.page_size)  # the page of position longest - 1 included
    if args.pages < least:
        # Its tokens would not fit even alone: it would be retracted and
        # re-admitted for ever (growing for that last step, it retracts itself).
        p.error(f"--pages must be at least {least} here")
    return run_loop(run(args), args.loop)


if __name__ == "__main__":
    sys.exit(main())
