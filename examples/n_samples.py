"""n samples of one prompt (GRPO-style rollouts) in an overlap loop: a program that checks itself.

docs/api.md's *n samples of one prompt* recipe, as an engine's loop over
``AsyncReqToTokenPool(kv=KVPagePool(...))``:

* each prompt is prefilled on a row of its own (``admit(pages=s)`` at
  priority 1); right after the prefill step is launched,
  ``trim_pages(row, full)`` gives the partial last page back behind that
  step and ``detach_pages(row)`` hands the ``full`` full pages to a cache
  *node* whose read fence is the prefill step's; the row is freed;
* the prompt's n samples are then admitted at priority 0 (ahead of new
  prompts), each with its own pages only (the prompt's partial last page
  and its first output tokens); a sample's block table is the node's pages,
  then its row's own; it grows with ``extend`` (short, it holds the grant
  loop with ``hold_grants()`` so that what comes back goes to growth, and
  evicts a node or retracts its newest sample) and each step's
  ``record_use`` covers its row, while the node keeps the step's fence as
  its newest reader (``record_use`` does not cover borrowed pages);
* a sample locks its node *at its grant*, after re-checking it: a node
  evicted meanwhile is no longer there, so the sample grows its row by the
  prompt's full pages (``extend(row, full)``, never waits) and prefills the
  prompt again, or, when that answers None, frees its row at once (nothing
  ran on it) and requeues as a plain request of ``full`` more pages;
* unlocked nodes are evicted for the queue's head, ``pages_short()``
  pages, those with no sample queued first, least recently read first, with
  ``kv.free(node.pages, fence=node.read_fence)``; a node is evicted as well
  when its last sample finishes (or is aborted).

Every step checks what it reads: each sample's context, read through its
row (the prompt's values from the node's pages, then its own), must sum to
what its positions hold, so a page handed to another request while a step
still reads or writes it, or a read of an evicted node, shows up as a
corrupted read. A stall (no sample finished and no prompt prefilled for
``--stall-passes`` passes) is detected and ends the run. At the end every sample
of every prompt must have finished and the pool must be empty.

Three flags put old bugs back, and the checks must then fail:

* ``--lock-before-admit``: the order the recipe once gave (each sample
  locks its node before it queues). Queued samples pin their prompts'
  pages; when the head of the queue is a sample short of pages and every
  node is locked by samples that still queue, nothing runs, nothing may be
  evicted, and the admission waits for ever: a stall;
* ``--no-recheck``: a granted sample locks its node without re-checking
  it, and its steps read a node evicted while it queued: corrupted reads;
* ``--no-hold``: growth that comes up short retracts without the
  ``hold_grants()`` hold (the example's first version): what a retraction
  frees goes to the queue's head, a sample that is granted, grows short and
  is retracted in turn; grants go on and nothing finishes, a livelock the
  stall check reports (with the grants made in those passes).

``--stall-breaker`` is a policy, not a bug: each sample locks its node
before it queues (it keeps its prompt's pages; retracted, it keeps the
lock), and a lock held by queued samples gives way only when otherwise
nothing could move: when no row is allocated and the queue's head is short
with every cached node locked (the stall above), or when the one sample
running grows short with nothing to evict (retracted instead, a lone runner
may be granted, grow short and be retracted for ever). The engine then cancels the
queued samples of the newest node that only they lock (a cancelled
admission holds nothing; one granted but not resumed gives its row and
pages back), awaits them, and requeues them to lock at their grant after
the re-check, so the node may be evicted. It recomputes far less than the
lock at grant (docs/changes.md).
``--min-full``, ``--max-full``, ``--max-samples``, ``--pages``,
``--page-size`` and ``--rows`` size the run; the tally ``samples
recomputed`` counts the samples that prefilled their prompt again.
Every prompt queues at the start unless ``--burst N``: then prompts arrive
in bursts of 1 to N (seeded, a generator of their own, so the prompts are
the same) every ``--burst-every`` passes, and passes spent idle waiting for
the next burst are no stall.

Runs on :class:`~asyncpool.HostStream` without a GPU and on CUDA streams
when ``torch.cuda.is_available()`` (``--device cpu`` forces host streams).
On host streams a step reads and writes only once the scheduler has
written the prompts of the next step's requests (a ``threading.Event`` per
step), so memory handed out too early is caught every time, not by timing.
``--loop uvloop`` runs it on uvloop. Exit status: 0 when everything checks
out, 1 otherwise. Public API only.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncpool import (
    AsyncReqToTokenPool,
    Grant,
    GrantHold,
    KVPagePool,
    record_fence,
    wait_fence,
)

from _engine import PagedEngine, run_loop

MAX_LEN = 64  # a row's slots, at least (more when the sizes need them)
STRIDE = 1 << 12  # a request's values: its id times this, plus the position


@dataclass
class Prompt:
    id: int
    length: int  # tokens; its last page is partial
    full: int  # full pages: the node's
    outputs: list[int]  # each sample's output length
    row: int = -1
    pages: list[int] = field(default_factory=list)

    def value(self, pos: int) -> int:
        return -(self.id * STRIDE + pos + 1)


@dataclass
class Node:
    """A prompt's full pages, detached from its prefill row; the engine's."""

    prompt: Prompt
    pages: torch.Tensor
    read_fence: Any  # the newest step that read the pages
    last_read: int  # that step's number (least recently read goes first)
    remaining: int  # samples not finished yet
    lock: int = 0  # samples granted that read it (at grant; before admission with the bug
    # or with --stall-breaker)
    queued: int = 0  # samples that queue and will lock it at their grant
    evicted: bool = False


@dataclass
class Sample:
    id: int
    node: Node
    output_len: int
    done: int = 0  # output tokens whose step has been processed
    launched: int = 0  # output tokens whose step has been launched
    admission: int = 0  # bumped at each (re-)admission
    row: int = -1
    pages: list[int] = field(default_factory=list)  # block table: node pages, then its own
    locked: bool = False  # holds a lock on its node
    plain: bool = False  # requeued with the prompt's pages of its own
    task: asyncio.Task[None] | None = None  # its admission's, while it queues

    @property
    def prompt_len(self) -> int:
        return self.node.prompt.length

    def value(self, pos: int) -> int:
        if pos < self.prompt_len:
            return self.node.prompt.value(pos)
        return self.id * STRIDE + pos + 1


Req = Prompt | Sample


def slot(pages: list[int], pos: int, page_size: int) -> int:
    return pages[pos // page_size] * page_size + pos % page_size


class Engine(PagedEngine):
    """The KV cache and the forward stream (a HostStream or CUDA)."""

    def write_prompt(
        self, pool: AsyncReqToTokenPool, row: int, pages: list[int], values: list[int], lo: int
    ) -> None:
        """Prefill: the row's slots of positions ``0..len(values)-1`` and the
        KV of the positions from ``lo`` on (those before are the node's)."""
        n = len(values)
        slots = torch.tensor([slot(pages, p, self.page_size) for p in range(n)])
        vals = torch.tensor(values[lo:], dtype=torch.int64)
        self.write(pool, row, slots, vals, lo)

    def launch_step(
        self, pool: AsyncReqToTokenPool, batch: list[tuple[Req, int, bool]], values: Any
    ) -> None:
        """One step: each entry ``(req, pos, writes)`` reads its context
        ``0..pos-1`` through its row; a sample then writes position ``pos``."""
        ps = self.page_size
        rows = torch.tensor([r.row for r, _, _ in batch])
        pos = torch.tensor([p for _, p, _ in batch])
        writes = torch.tensor([w for _, _, w in batch])
        slots = torch.tensor([slot(r.pages, p, ps) if w else 0 for r, p, w in batch])
        vals = torch.tensor([values(r, p) if w else 0 for r, p, w in batch])
        sums = torch.tensor([sum(values(r, q) for q in range(p)) for r, p, _ in batch])
        self.launch_kernel(pool, rows, pos, writes, slots, vals, sums, kernel=_step)


def _step(
    kv_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    verified_lens: torch.Tensor,
    bad_reads: torch.Tensor,
    rows: torch.Tensor,
    pos: torch.Tensor,
    writes: torch.Tensor,
    slots: torch.Tensor,
    values: torch.Tensor,
    sums: torch.Tensor,
) -> None:
    """``_engine.step``, but only the entries that ``writes`` marks (the
    samples') write; a prompt's entry only reads its context."""
    context = kv_cache[req_to_token[rows].long()]
    before = torch.arange(context.shape[1], device=pos.device) < pos[:, None]
    bad_reads += (torch.where(before, context, 0).sum(1) != sums).sum()
    kv_cache[slots[writes]] = values[writes]
    req_to_token[rows[writes], pos[writes]] = slots[writes].to(req_to_token.dtype)
    verified_lens[rows[writes]] = (pos[writes] + 1).to(verified_lens.dtype)


def _value(req: Req, pos: int) -> int:
    return req.value(pos)


async def run(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    rng = random.Random(args.seed)
    ps = args.page_size
    engine = Engine(device, args.pages + 1, ps, args.forward_ms)
    kv = KVPagePool(args.pages + 1, ps)
    pool = AsyncReqToTokenPool(
        args.rows + 1,
        max(MAX_LEN, _longest(args)),
        device=device,
        kv=kv,
        stream=engine.forward if engine.cuda else None,
    )
    # Locked before its admission: the old bug, or the stall breaker's policy.
    lock_queued = args.lock_before_admit or args.stall_breaker
    prompts = []
    for i in range(args.prompts):
        full = rng.randint(args.min_full, args.max_full)
        prompts.append(
            Prompt(
                i,
                full * ps + rng.randint(1, ps - 1),
                full,
                [rng.randint(2, args.max_output) for _ in range(rng.randint(2, args.max_samples))],
            )
        )
    total = sum(len(p.outputs) for p in prompts)
    nodes: list[Node] = []
    running: list[Sample] = []
    granted: list[tuple[Req, Grant]] = []
    wake = asyncio.Event()
    tasks: list[asyncio.Task[None]] = []
    counts = dict(
        finished=0,
        aborted=0,
        recomputes=0,
        requeues=0,
        retractions=0,
        evictions=0,
        grants=0,
        breaks=0,
        unlocked=0,
    )
    recomputed: set[int] = set()  # the samples that prefilled their prompt again
    finished_per_prompt = [0] * len(prompts)
    samples_made: list[Sample] = []

    async def queue(req: Req, pages: int, priority: int) -> None:
        grant = await pool.admit(pages=pages, priority=priority)
        granted.append((req, grant))
        wake.set()

    def submit(req: Req, pages: int, priority: int) -> None:
        task = asyncio.ensure_future(queue(req, pages, priority))
        tasks.append(task)
        if isinstance(req, Sample):
            req.task = task

    def own_pages(s: Sample) -> int:
        """A sample's own pages at admission: the prompt's partial last page
        and its first ``--reserve`` output tokens."""
        return int(-(-(s.prompt_len + args.reserve) // ps) - s.node.prompt.full)

    def evict(node: Node) -> None:
        node.evicted = True
        kv.free(node.pages, fence=node.read_fence)  # behind its newest reader
        counts["evictions"] += 1

    def evict_for(short: int) -> int:
        """Evict unlocked nodes, those with no sample queued first, least
        recently read first, until ``short`` pages are evicted."""
        idle = [n for n in nodes if not n.evicted and n.lock == 0]
        got = 0
        for node in sorted(idle, key=lambda n: (n.queued > 0, n.last_read)):
            if got >= short:
                break
            evict(node)
            got += len(node.pages)
        return got

    def start_sample(s: Sample, grant: Grant) -> None:
        node = s.node
        own = pool.pages_of(grant.row, host=True).tolist()
        s.row, s.admission, s.done, s.launched = grant.row, s.admission + 1, 0, 0
        values = [s.value(p) for p in range(s.prompt_len)]
        if s.plain:  # requeued: the prompt's full pages are its own, first
            s.pages = own
            engine.write_prompt(pool, s.row, s.pages, values, 0)
        elif s.locked:  # locked before it queued: the node is still cached
            s.pages = node.pages.tolist() + own
            engine.write_prompt(pool, s.row, s.pages, values, node.prompt.full * ps)
        elif not node.evicted or not args.recheck:
            node.queued -= 1
            node.lock += 1  # locked at its grant: its steps read the node
            s.locked = True
            s.pages = node.pages.tolist() + own
            engine.write_prompt(pool, s.row, s.pages, values, node.prompt.full * ps)
        else:
            node.queued -= 1  # evicted while it queued: the prompt is gone
            counts["recomputes"] += 1
            recomputed.add(s.id)
            got = pool.extend(s.row, node.prompt.full)  # never waits
            if got is None:  # nothing ran on the row: back at once, requeue
                pool.free([s.row])
                s.plain = True
                counts["requeues"] += 1
                submit(s, node.prompt.full + own_pages(s), 0)
                return
            s.pages = got.tolist() + own
            engine.write_prompt(pool, s.row, s.pages, values, 0)
        running.append(s)

    def stop(s: Sample, finished: bool) -> None:
        running.remove(s)
        pool.free([s.row])  # its row and own pages, behind its recorded uses
        node = s.node
        if s.locked and (finished or not lock_queued):
            node.lock -= 1  # (retracted, it keeps a lock taken before it queued)
            s.locked = False
        if finished:
            node.remaining -= 1
            counts["finished"] += 1
            finished_per_prompt[node.prompt.id] += 1
            if node.remaining == 0 and not node.evicted:
                evict(node)  # its last sample: nothing reads it any more
        else:  # retracted: queue again
            if not s.plain and not s.locked:
                node.queued += 1
            submit(s, node.prompt.full + own_pages(s) if s.plain else own_pages(s), 0)

    def queue_locked(node: Node) -> list[Sample]:
        """The node's samples that queue holding a lock on it."""
        return [
            s
            for s in samples_made
            if s.node is node and s.locked and s.task is not None and not s.task.done()
        ]

    def revocable() -> tuple[Node, list[Sample]] | None:
        """The newest cached node locked by samples that queue and by no
        other (none runs on it, none is granted), and those samples."""
        for node in reversed(nodes):
            if not node.evicted and node.lock:
                waiting = queue_locked(node)
                if len(waiting) == node.lock:
                    return node, waiting
        return None

    async def break_lock(node: Node, waiting: list[Sample]) -> None:
        """Cancel the node's queued samples, which unlocks it (it may be
        evicted), and requeue them, to lock at their grant after a re-check."""
        for s in waiting:
            assert s.task is not None
            s.task.cancel()  # granted at hand-over, it gives its row and pages back
        async with asyncio.timeout(30):
            await asyncio.gather(*(s.task for s in waiting if s.task), return_exceptions=True)
        for s in waiting:
            s.locked = False
            node.lock -= 1
            node.queued += 1
            submit(s, own_pages(s), 0)
        counts["breaks"] += 1
        counts["unlocked"] += len(waiting)

    # Arrivals: every prompt at the start, or (--burst N) bursts of 1 to N
    # prompts every --burst-every passes, drawn from a generator of their own
    # (the prompts are the same either way).
    arriving = list(prompts)
    arrivals = random.Random(f"burst-{args.seed}")
    next_burst = 0

    def arrive() -> None:
        nonlocal next_burst
        if not args.burst:
            for p in arriving:
                submit(p, p.full + 1, 1)
            arriving.clear()
        elif arriving and passes >= next_burst:  # the next burst is due
            n = arrivals.randint(1, args.burst)
            for p in arriving[:n]:
                submit(p, p.full + 1, 1)
            del arriving[:n]
            next_burst = passes + args.burst_every

    prev: tuple[Any, list[tuple[Sample, int]]] | None = None
    steps = passes = progress = last_progress = grants_then = 0
    stalled = False
    hold: GrantHold | None = None
    t0 = time.perf_counter()
    try:
        arrive()  # (all of them, by default)
        while counts["finished"] < total:
            arrive()
            pool.reclaim()
            # 1. Evict for the queue's head what it lacks (pending pages count).
            short = pool.pages_short()
            # With the stall breaker, a stall for good: the head is still short
            # (pending pages count), no row is allocated (nothing runs, no grant
            # waits to be resumed) and every cached node is locked by samples
            # that queue.
            if (
                short
                and evict_for(short) < short
                and args.stall_breaker
                and pool.allocated_size() == 0
                and (found := revocable()) is not None
            ):
                await break_lock(*found)
            # 2. The grants: a prompt prefills; a sample re-checks its node.
            new_prompts: list[Prompt] = []
            grants, granted[:] = list(granted), []
            for req, grant in grants:
                counts["grants"] += 1
                if isinstance(req, Prompt):
                    req.row = grant.row
                    req.pages = pool.pages_of(grant.row, host=True).tolist()
                    values = [req.value(q) for q in range(req.length)]
                    engine.write_prompt(pool, req.row, req.pages, values, 0)
                    new_prompts.append(req)
                else:
                    start_sample(req, grant)
            # 3. Decode growth, one page each; short: evict, else retract.
            sitting_out: set[int] = set()
            for s in list(running):
                if s not in running or s.prompt_len + s.launched < len(s.pages) * ps:
                    continue
                got = pool.extend(s.row, 1)
                if got is not None:
                    s.pages.append(int(got[0]))
                    continue
                sitting_out.add(s.id)
                if hold is None and args.hold:  # growth first: what comes back is growth's
                    hold = pool.hold_grants()  # (before a retraction's free)
                if evict_for(1):
                    continue
                if args.stall_breaker and len(running) == 1 and (found := revocable()):
                    # A lone runner's growth beats a lock that queued samples
                    # hold (retracted instead, it can be granted, grow short
                    # and be retracted for ever while they pin every node);
                    # with others running, a retraction lets them grow.
                    await break_lock(*found)
                    evict_for(1)
                else:
                    victim = running[-1]
                    stop(victim, finished=False)
                    counts["retractions"] += 1
            if hold is not None and (not sitting_out or not running):
                hold.release()  # nobody stalled (or nobody left to grow)
                hold = None
            engine.planned()
            # 4. Launch step t: the prefills and the samples.
            batch: list[tuple[Req, int, bool]] = [(p, p.length, False) for p in new_prompts]
            batch += [
                (s, s.prompt_len + s.launched, True) for s in running if s.id not in sitting_out
            ]
            launched = None
            if batch:
                engine.launch_step(pool, batch, _value)
                fence = record_fence(engine.forward)
                pool.record_use([r.row for r, _, _ in batch], fence)
                samples = [r for r, _, _ in batch if isinstance(r, Sample)]
                for s in samples:
                    s.launched += 1
                    if s.locked:
                        s.node.read_fence, s.node.last_read = fence, steps
                for p in new_prompts:  # the node takes the full pages
                    pool.trim_pages(p.row, p.full)  # the partial one, behind the prefill
                    node = Node(
                        p, pool.detach_pages(p.row, host=True), fence, steps, len(p.outputs)
                    )
                    pool.free([p.row])
                    nodes.append(node)
                    for out in p.outputs:
                        s = Sample(len(samples_made), node, out)
                        samples_made.append(s)
                        if lock_queued:
                            node.lock += 1  # locked before it queues (the bug, alone)
                            s.locked = True
                        else:
                            node.queued += 1
                        submit(s, own_pages(s), 0)
                launched = (fence, [(s, s.admission) for s in samples])
                steps += 1
            # 5. Process step t-1 while step t runs.
            if prev is not None:
                await wait_fence(prev[0])
                for s, admission in prev[1]:
                    if s.admission != admission or s not in running:
                        continue  # retracted since
                    s.done += 1
                    if s.done >= s.output_len:
                        stop(s, finished=True)
                    elif rng.random() < args.abort:
                        counts["aborted"] += 1
                        stop(s, finished=True)
            prev = launched
            passes += 1
            if counts["finished"] + len(nodes) > progress:
                progress, last_progress = counts["finished"] + len(nodes), passes
                grants_then = counts["grants"]
            elif arriving and not running and not granted and pool.queue_head() is None:
                last_progress = passes  # idle, the next burst not due yet: no stall
            elif passes - last_progress > args.stall_passes:
                stalled = True  # no sample finished, no prompt prefilled
                break
            if batch or grants:
                await asyncio.sleep(0)
                continue
            # Nothing runs and nothing was granted: wait for a grant, bounded.
            wake.clear()
            try:
                async with asyncio.timeout(0.002):
                    await wake.wait()
            except TimeoutError:
                pass
        if hold is not None:
            hold.release()
        head = pool.queue_head()
        locked = sum(n.lock > 0 and not n.evicted for n in nodes)
        cached = sum(not n.evicted for n in nodes)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in running:  # (a stall's leftovers)
            pool.free([s.row])
        for node in nodes:
            if not node.evicted:
                evict(node)
        for _, grant in granted:
            pool.free([grant.row])
        engine.planned()
        async with asyncio.timeout(30):
            await pool.drain()
        elapsed = time.perf_counter() - t0
    finally:
        await pool.close()
        engine.close()

    bad_reads = int(engine.bad_reads)
    stats = pool.stats()
    pool.check_invariants()
    empty = (
        stats.allocated == stats.pending == 0 and stats.pages_allocated == stats.pages_pending == 0
    )
    unfinished = sum(
        1 for p, n in zip(prompts, finished_per_prompt, strict=True) if n < len(p.outputs)
    )
    where = "CUDA streams" if engine.cuda else "HostStream"
    print(
        f"n_samples: {len(prompts)} prompts, {total} samples on {args.rows} rows and "
        f"{args.pages} pages of {ps}, {steps} steps, {counts['grants']} grants, "
        f"{counts['recomputes']} recomputes, {len(recomputed)} samples recomputed, "
        f"{counts['requeues']} requeues, {counts['breaks']} stall breaks, "
        f"{counts['unlocked']} samples unlocked, "
        f"{counts['evictions']} evictions, {counts['retractions']} retractions, "
        f"{counts['aborted']} aborted, on {where}"
    )
    if stalled:
        print(
            f"n_samples: stalled after {counts['grants']} grants: no sample finished and no "
            f"prompt prefilled for {args.stall_passes} passes ({len(running)} samples "
            f"running); queue head {head}, "
            f"{locked} of {cached} cached nodes locked, "
            f"{counts['grants'] - grants_then} grants in those passes"
        )
    if bad_reads == 0 and empty and not stalled and unfinished == 0:
        print(
            f"n_samples: OK: 0 corrupted reads, no stall, every prompt's samples finished, "
            f"pool empty, {elapsed:.2f} s"
        )
        return 0
    print(
        f"n_samples: FAILED: {bad_reads} corrupted reads, {'a' if stalled else 'no'} stall, "
        f"{unfinished} prompts unfinished, {stats.allocated} rows and {stats.pages_allocated} "
        f"pages still allocated"
    )
    return 1


def _longest(args: argparse.Namespace) -> int:
    """The most positions a sample may reach: its prompt, its output, one more."""
    return int((args.max_full + 1) * args.page_size + max(args.max_output, args.reserve) + 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    p.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio")
    p.add_argument("--prompts", type=int, default=40)
    p.add_argument("--max-samples", type=int, default=6, help="samples a prompt: 2 to this")
    p.add_argument("--min-full", type=int, default=1, help="a prompt's full pages: this at least")
    p.add_argument("--max-full", type=int, default=5, help="a prompt's full pages: at most this")
    p.add_argument("--max-output", type=int, default=16, help="a sample's output: 2 to this")
    p.add_argument(
        "--reserve", type=int, default=12, help="output tokens a sample's admission reserves"
    )
    p.add_argument("--rows", type=int, default=12, help="rows in the pool (row 0 excluded)")
    p.add_argument("--pages", type=int, default=12, help="KV pages (page 0 excluded)")
    p.add_argument("--page-size", type=int, default=4, help="token slots a page")
    p.add_argument("--forward-ms", type=float, default=0.2, help="the forward's time per step")
    p.add_argument("--abort", type=float, default=0.01, help="a sample's abort chance a token")
    p.add_argument(
        "--stall-passes",
        type=int,
        default=300,
        help="passes with no sample finished and no prompt prefilled that make a stall",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--burst",
        type=int,
        default=0,
        help="prompts arrive in bursts of 1 to this (seeded), one every --burst-every "
        "passes; 0 (the default): every prompt queues at the start",
    )
    p.add_argument(
        "--burst-every", type=int, default=8, help="passes between two bursts (with --burst)"
    )
    p.add_argument(
        "--lock-before-admit",
        action="store_true",
        help="lock the node before each sample queues (the old recipe): stalls",
    )
    p.add_argument(
        "--stall-breaker",
        action="store_true",
        help="lock the node before each sample queues; when nothing could move "
        "otherwise (nothing allocated and the head short, or the lone runner's "
        "growth short, with every node locked), requeue the queued samples of the newest node only "
        "they lock, to lock at their grant (unlocking it)",
    )
    p.add_argument(
        "--no-hold",
        dest="hold",
        action="store_false",
        help="retract on short growth without holding the grant loop: livelocks",
    )
    p.add_argument(
        "--no-recheck",
        dest="recheck",
        action="store_false",
        help="lock the node at the grant without re-checking it: reads evicted nodes",
    )
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available here")
    if args.page_size < 2 or min(args.rows, args.min_full, args.reserve, args.stall_passes) < 1:
        p.error("--page-size must be at least 2; --rows, --min-full, --reserve, --stall-passes 1")
    if min(args.burst, args.burst_every - 1) < 0:
        p.error("--burst must be at least 0 and --burst-every at least 1")
    if args.max_full < args.min_full:
        p.error("--max-full must be at least --min-full")
    if args.lock_before_admit and args.stall_breaker:
        p.error("--stall-breaker and --lock-before-admit: pick one")
    if min(args.prompts, args.max_samples - 2, args.max_output - 2) < 0:
        p.error("--prompts must be at least 0, --max-samples and --max-output at least 2")
    if not (0 <= args.forward_ms < float("inf") and 0 <= args.abort <= 1):
        p.error("--forward-ms must be a finite number >= 0 and --abort a probability")
    longest = _longest(args)
    if longest > STRIDE:
        p.error(f"a sample may reach {longest} positions; the example's values allow {STRIDE}")
    if args.pages < -(-longest // args.page_size):
        p.error(f"--pages must be at least {-(-longest // args.page_size)} here")
    return run_loop(run(args), args.loop)


if __name__ == "__main__":
    sys.exit(main())
