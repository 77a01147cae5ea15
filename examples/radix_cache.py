"""A radix-tree prefix cache on the pool, in an overlap loop: a program that checks itself.

docs/api.md's *Prefix caching* recipe, as an engine's loop over
``AsyncReqToTokenPool(kv=KVPagePool(...))`` with a real radix tree on top:

* prompts share prefixes of several depths: each is a path down a small
  seeded tree of token blocks (one or two pages each) and a tail of its
  own, so cached nodes nest, and a node splits where a new prompt leaves
  it (matching is page-granular: a node holds whole pages, keyed by their
  tokens);
* new requests' admissions are awaited in tasks of their own
  (``admit(pages=k)``, ``k`` the pages of the prompt past its cached
  prefix, counted when it queues); some carry a ``timeout=`` and retry when
  it expires, some clients cancel while they queue. Retracted requests (and
  those requeued below) go back first, admitted from the loop with
  ``try_admit(pages=k, priority=0)``, the cache evicting when free pages
  come up short;
* at its grant a request matches the tree again and locks the nodes of its
  path, every ancestor included: the cache changed while it queued, so a
  prefix evicted meanwhile grows the row (``extend``, never waits; None:
  the row goes back at once and the request queues again) and a longer hit
  found only now gives the surplus pages back (``trim_pages``);
* each step's ``record_use`` covers the rows' own pages; every node on a
  borrower's path keeps the step's fence as its newest *reader*;
* a finished (or aborted) request's pages go in by ``detach_pages``: the
  prompt's full pages past what the tree holds become a new leaf whose read
  fence is the newest step; the rest (duplicates of what another request
  cached meanwhile, the partial page, the output) are freed behind that
  step and the copy stream;
* each pass evicts ``pool.pages_short()`` pages for the queue's head, and
  growth that comes up short evicts too (or retracts the newest request):
  unlocked nodes, least recently used first (a node's last use: the newest
  grant whose match took it, or a leaf inserted under it), each with
  ``kv.free(node.pages, fence=node.read_fence, after=copy_stream)``. The
  unlocked nodes are kept as one LRU order, as vLLM keeps its free blocks,
  with no leaf test: because every ancestor of a borrowed node is locked
  with it, and used whenever it is, the least recently used
  unlocked node is always a leaf (the run counts evictions of inner nodes: 0).

Every step checks what it reads: each request's context, read through its
row (the borrowed nodes' pages, then its own), must sum to the KV markers of
its positions (``corrupted reads``); every finished request's KV and row,
copied out on the copy stream, are compared with what its steps wrote. Also
checked: no stall (no token produced for
``--stall-passes`` passes), every request ends once (finished, aborted or
cancelled), the cache's pages plus the rows' agree with the pool's count
(``stats()``) whenever no admission is in flight, and the pool is empty
once everything is evicted at the end.

Three flags put documented bugs back, and the checks must then fail:

* ``--evict-behind-write-fence``: a node is evicted behind its writer's
  fence (the step that wrote its pages: for a leaf, the first step of the
  request that cached it, which wrote its prompt), not its newest
  reader's: a step still reading it (the one in flight when its last
  borrower, or the request that cached it, finished) reads a new
  request's prompt, written into its pages by a grant of the next pass.
  23-41 corrupted reads a run at the defaults (seeds 0-5, and in debug
  mode). (Taking the fence at insert as the writer's, the newest step,
  made it bite only where an older node was evicted: 1-10 reads a run, and
  1 run in 12 clean in debug mode.)
* ``--evict-locked-ancestor``: a borrower locks, and marks read, only the
  deepest node of its path, not its ancestors: an ancestor looks unlocked,
  and once it is the least recently used it is evicted (with the nodes under it) while its
  borrowers still read it. (An evictor that tests for leaves would not
  evict it, and the stale read fences would then matter only in the step
  after the last borrower ends.)
* ``--await-inline``: the loop admits by itself, ``try_admit`` while
  requests run and an awaited ``admit`` when none does, and evicts nothing:
  the pages the head lacks are held by the cache, and nothing frees them
  while the loop waits. The wait is bounded (``--stall-s``) and reported as
  a stall (or, where growth comes up short first, requests retracted and
  re-admitted with no token produced: a stall after ``--stall-passes``).

Runs on :class:`~asyncpool.HostStream` workers without a GPU and on CUDA
streams when ``torch.cuda.is_available()`` (``--device cpu`` forces host
streams). On host streams a step reads and writes only once the scheduler
has written the prompts of the next step's requests (a ``threading.Event``
per step), and the grants that a pass's evictions make are written before
that, so a page handed out while a step still reads it is caught every
time, not by timing (on CUDA the prompt is written on the forward stream,
whose order puts the old step first: the first two flags are checked on the
host streams). ``--loop uvloop`` runs it on uvloop. Exit status: 0 when
everything checks out, 1 otherwise. Public API only.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections import deque
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

from _engine import PagedEngine, make_requests, run_loop

MAX_LEN = 96

Chunk = tuple[int, ...]  # the tokens of one page: a tree key's unit


@dataclass(eq=False)
class Node:
    """Whole pages of a cached prefix, keyed by their tokens; the engine's."""

    key: list[Chunk]
    pages: list[int]  # one a chunk, detached from the request that wrote them
    parent: Node | None
    read_fence: Any = None  # the newest step that read the pages
    write_fence: Any = None  # its writer's: the step that wrote its pages (what the bug waits for)
    last_use: int = 0  # its newest use (a grant's match, a leaf put under it): LRU
    lock: int = 0  # running requests whose path goes through it
    children: dict[Chunk, Node] = field(default_factory=dict)

    def path(self) -> list[Node]:
        """This node and its ancestors, root excluded, deepest first."""
        out = []
        node: Node | None = self
        while node is not None and node.parent is not None:
            out.append(node)
            node = node.parent
        return out


@dataclass(eq=False)
class Request:
    id: int
    tokens: list[int]  # the prompt
    output_len: int
    marks: list[int]  # the KV marker of each position (prompt, then output)
    done: int = 0  # output tokens whose step has been processed
    launched: int = 0  # output tokens whose step has been launched (>= done)
    admission: int = 0  # bumped at each (re-)admission
    prefill: Any = None  # the fence of its first step since then: its prompt's writer
    row: int = -1
    hit: int = 0  # pages its path in the tree holds: the first of its table
    last: Node | None = None  # the deepest node it borrows (None: no hit)
    own: list[int] = field(default_factory=list)  # the pages its row owns, in order
    table: list[int] = field(default_factory=list)  # borrowed pages, then its own
    queued_hit: int = 0  # the hit counted when it queued
    ended: str = ""  # finished, aborted, cancelled
    copied: list[Any] = field(default_factory=list)

    @property
    def prompt_len(self) -> int:
        return len(self.tokens)

    @property
    def length(self) -> int:
        return self.prompt_len + self.done

    def slot(self, pos: int, page_size: int) -> int:
        return self.table[pos // page_size] * page_size + pos % page_size


def chunks(tokens: list[int], page_size: int) -> list[Chunk]:
    """The prompt's full pages, as tree keys."""
    return [
        tuple(tokens[i : i + page_size]) for i in range(0, len(tokens) - page_size + 1, page_size)
    ]


class RadixCache:
    """A radix tree of whole pages over a :class:`KVPagePool`.

    The pool counts these pages as allocated and knows nothing of the tree:
    the scheduler evicts. ``lock_ancestors=False`` and
    ``behind_write_fence=True`` are the bugs, on purpose.
    """

    def __init__(
        self, kv: KVPagePool, copy: Any, *, lock_ancestors: bool, behind_write_fence: bool
    ) -> None:
        self.kv = kv
        self.copy = copy
        self.lock_ancestors = lock_ancestors
        self.behind_write_fence = behind_write_fence
        self.root = Node([], [], None)
        self.pages = 0  # pages the tree holds
        self.nodes = 0
        self.evictions = self.evicted_pages = self.non_leaf_evictions = self.splits = 0

    def peek(self, keys: list[Chunk]) -> int:
        """How many of ``keys`` the tree holds, changing nothing."""
        node, i = self.root, 0
        while i < len(keys) and (child := node.children.get(keys[i])) is not None:
            j = _common(child.key, keys, i)
            i += j
            if j < len(child.key):
                break
            node = child
        return i

    def match(self, keys: list[Chunk]) -> tuple[Node, int]:
        """The deepest node of the longest cached prefix of ``keys`` and its
        length in pages; a node the prefix leaves midway is split there."""
        node, i = self.root, 0
        while i < len(keys) and (child := node.children.get(keys[i])) is not None:
            j = _common(child.key, keys, i)
            if j < len(child.key):  # the prefix leaves it midway: split it there
                return self._split(child, j), i + j
            node, i = child, i + j
        return node, i

    def _split(self, node: Node, j: int) -> Node:
        """Split ``node`` after its first ``j`` pages; return the new top.

        The old node keeps the bottom (its borrowers' deepest node stays
        theirs); the top is an ancestor of all of them, so it takes their
        locks (when ancestors are locked), fences and last use."""
        assert node.parent is not None
        top = Node(
            node.key[:j],
            node.pages[:j],
            node.parent,
            node.read_fence,
            node.write_fence,
            node.last_use,
            node.lock if self.lock_ancestors else 0,
        )
        node.parent.children[top.key[0]] = top
        node.key, node.pages, node.parent = node.key[j:], node.pages[j:], top
        top.children[node.key[0]] = node
        self.nodes += 1
        self.splits += 1
        return top

    def borrowed(self, node: Node | None) -> list[Node]:
        """The nodes a request whose path ends at ``node`` locks and marks read."""
        if node is None:
            return []
        return node.path() if self.lock_ancestors else [node]  # the bug: the deepest only

    def table(self, node: Node) -> list[int]:
        """The pages of the path down to ``node``, root first."""
        return [p for n in reversed(node.path()) for p in n.pages]

    def insert(
        self,
        keys: list[Chunk],
        own: list[int],
        hit: int,
        fence: Any,
        step: int,
        written: Any = None,
    ) -> list[int]:
        """Cache the pages of ``keys`` that the tree lacks, taken from
        ``own`` (the pages of positions from ``hit`` pages on: a request's
        own, detached); return the pages of ``own`` it does not take.
        ``fence``: the newest step that read them; ``written``: the step
        that wrote them (the request's first since its admission wrote its
        prompt), kept only for the bug (None: ``fence``)."""
        node, m = self.match(keys)
        take: range = range(0)
        if hit <= m < len(keys):  # (m < hit: its path was evicted under it, the bug)
            for n in node.path():  # a new leaf's ancestors are at least as new
                n.last_use = step
            take = range(m - hit, len(keys) - hit)
            writer = fence if written is None else written
            leaf = Node(keys[m:], [own[i] for i in take], node, fence, writer, step)
            node.children[keys[m]] = leaf
            self.pages += len(take)
            self.nodes += 1
        return [p for i, p in enumerate(own) if i not in take]

    def _nodes(self) -> list[tuple[Node, int]]:
        out, stack = [], [(c, 1) for c in self.root.children.values()]
        while stack:
            node, depth = stack.pop()
            out.append((node, depth))
            stack.extend((c, depth + 1) for c in node.children.values())
        return out

    def evict(self, pages: int, *, everything: bool = False) -> int:
        """Evict unlocked nodes, least recently used first (deepest first on
        a tie), until ``pages`` pages are evicted; return how many were.
        ``everything``: the end of the run, every node whatever its locks."""
        got = 0
        order = sorted(
            (n for n in self._nodes() if everything or n[0].lock == 0),
            key=lambda nd: (nd[0].last_use, -nd[1]),
        )
        for node, _ in order:
            if got >= pages and not everything:
                break
            if node.parent is None:  # evicted already, under an evicted ancestor
                continue
            if node.children:
                self.non_leaf_evictions += 1  # never, with every ancestor locked
            got += self._evict(node)
        return got

    def _evict(self, node: Node) -> int:
        """Take ``node`` and every node under it out of the tree and free
        their pages, each behind its newest reader and the copy stream."""
        assert node.parent is not None
        del node.parent.children[node.key[0]]
        got, stack = 0, [node]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            n.children, n.parent = {}, None
            pages = torch.tensor(n.pages, dtype=torch.int64)
            if self.behind_write_fence:  # the bug: as if its writer were all that mattered
                self.kv.free(pages, fence=n.write_fence)
            else:  # behind every reader: the newest step, and a copy-out reading it
                self.kv.free(pages, fence=n.read_fence, after=self.copy)
            got += len(n.pages)
            self.pages -= len(n.pages)
            self.nodes -= 1
            self.evictions += 1
        self.evicted_pages += got
        return got


def _common(key: list[Chunk], keys: list[Chunk], i: int) -> int:
    j = 0
    while j < len(key) and i + j < len(keys) and key[j] == keys[i + j]:
        j += 1
    return j


class Engine(PagedEngine):
    """The KV cache and the forward and copy streams (HostStreams or CUDA)."""

    def __init__(
        self, device: torch.device, num_pages: int, page_size: int, forward_ms: float
    ) -> None:
        super().__init__(device, num_pages, page_size, forward_ms)
        self.copy: Any = self.new_stream("copy")

    def write_prompt(self, pool: AsyncReqToTokenPool, req: Request) -> None:
        """Prefill: the row's slots of positions ``0..length-1`` and the KV
        of those past the borrowed pages."""
        n, ps = req.length, self.page_size
        cached = req.hit * ps
        slots = torch.tensor([req.slot(p, ps) for p in range(n)])
        values = torch.tensor(req.marks[cached:n], dtype=torch.int64)
        self.write(pool, req.row, slots, values, cached)

    def launch_step(self, pool: AsyncReqToTokenPool, batch: list[Request]) -> None:
        """One step: each request reads its context through its row, then
        writes its next KV slot and row entry."""
        ps = self.page_size
        pos_list = [r.prompt_len + r.launched for r in batch]
        rows = torch.tensor([r.row for r in batch])
        pos = torch.tensor(pos_list)
        slots = torch.tensor([r.slot(p, ps) for r, p in zip(batch, pos_list, strict=True)])
        values = torch.tensor([r.marks[p] for r, p in zip(batch, pos_list, strict=True)])
        sums = torch.tensor([sum(r.marks[:p]) for r, p in zip(batch, pos_list, strict=True)])
        self.launch_kernel(pool, rows, pos, slots, values, sums)

    def copy_out(self, pool: AsyncReqToTokenPool, req: Request) -> None:
        """Copy a finished request's KV and row to the host, on the copy stream."""
        n = req.prompt_len + req.output_len
        slots = torch.tensor([req.slot(p, self.page_size) for p in range(n)])
        self.copy_to_host(self.copy, pool, req.row, slots, req.copied)


async def run(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    rng = random.Random(args.seed)
    ps = args.page_size
    engine = Engine(device, args.pages + 1, ps, args.forward_ms)
    kv = KVPagePool(args.pages + 1, ps)
    pool = AsyncReqToTokenPool(
        args.rows + 1, MAX_LEN, device=device, kv=kv, stream=engine.forward if engine.cuda else None
    )
    cache = RadixCache(
        kv,
        engine.copy,
        lock_ancestors=not args.evict_locked_ancestor,
        behind_write_fence=args.evict_behind_write_fence,
    )
    requests = make_requests(args, rng, MAX_LEN, Request)
    keys = {r.id: chunks(r.tokens, ps) for r in requests}
    seen: set[tuple[Chunk, ...]] = set()  # page prefixes computed once already
    running: list[Request] = []
    granted: list[tuple[Request, Grant, int]] = []
    waiting: deque[Request] = deque()  # --await-inline: the loop's own queue
    retry: deque[Request] = deque()  # retracted and requeued: admitted from the loop
    tasks: dict[Request, asyncio.Task[None]] = {}
    wake = asyncio.Event()
    counts = dict.fromkeys(
        [
            "finished",
            "aborted",
            "cancelled",
            "timeouts",
            "hits",
            "hit_pages",
            "recomputed",
            "retractions",
            "requeues",
            "trims",
            "extends",
            "grants",
            "agreement_checks",
        ],
        0,
    )
    disagreements: list[str] = []

    def need(req: Request, hit: int) -> int:
        """Pages past ``hit`` for its prompt (so far) and its next token."""
        return int(-(-(req.length + 1) // ps)) - hit

    async def queue(req: Request, priority: int, timeout: float | None) -> None:
        while True:
            req.queued_hit = cache.peek(keys[req.id])
            k = need(req, req.queued_hit)
            try:
                grant = await pool.admit(pages=k, priority=priority, timeout=timeout)
            except TimeoutError:  # the client retries, without a deadline
                counts["timeouts"] += 1
                timeout = None
                continue
            granted.append((req, grant, k))
            wake.set()
            return

    def submit(req: Request, priority: int) -> None:
        if args.await_inline:
            waiting.append(req)
            return
        if priority == 0:  # retracted or requeued: the loop admits it, ahead
            retry.append(req)
            return
        timeout = args.admit_timeout if rng.random() < args.timeout_share else None
        task = asyncio.ensure_future(queue(req, priority, timeout))
        tasks[req] = task
        task.add_done_callback(lambda t: tasks.pop(req) if tasks.get(req) is t else None)

    def start(req: Request, grant: Grant, k: int) -> None:
        """A grant: match again, lock the path, fix the row for what changed."""
        counts["grants"] += 1
        node, hit = cache.match(keys[req.id][: req.prompt_len // ps])
        if hit < req.queued_hit:  # evicted while it queued: grow the row
            counts["extends"] += 1
            if pool.extend(grant.row, req.queued_hit - hit) is None:
                pool.free([grant.row])  # nothing ran on the row: back at once
                counts["requeues"] += 1
                submit(req, 0)
                return
        elif hit > req.queued_hit:  # cached while it queued: give the surplus back
            counts["trims"] += 1
            pool.trim_pages(grant.row, k - (hit - req.queued_hit))
        req.row, req.hit, req.admission = grant.row, hit, req.admission + 1
        req.prefill = None
        req.last = node if hit else None
        for n in cache.borrowed(req.last):
            n.lock += 1
        for n in node.path():  # matched: its path's newest use
            n.last_use = steps
        req.own = pool.pages_of(grant.row, host=True).tolist()
        req.table = (cache.table(node) if hit else []) + req.own
        req.launched = req.done
        if hit:
            counts["hits"] += 1
            counts["hit_pages"] += hit
        for i in range(hit, req.prompt_len // ps):  # the prompt's full pages it computes
            prefix = tuple(keys[req.id][: i + 1])
            counts["recomputed"] += prefix in seen  # computed before, evicted since
            seen.add(prefix)
        engine.write_prompt(pool, req)
        running.append(req)

    def unlock(req: Request) -> None:
        running.remove(req)
        for n in cache.borrowed(req.last):
            n.lock -= 1
        req.last = None

    def end(req: Request, how: str) -> None:
        assert not req.ended, f"request {req.id} ended twice"
        req.ended = how
        counts[how] += 1

    total = len(requests)
    for req in requests:
        submit(req, 1)

    prev: tuple[Any, list[tuple[Request, int]]] | None = None
    steps = passes = progress = last_progress = 0
    stall = ""
    hold: GrantHold | None = None
    t0 = time.perf_counter()
    try:
        while sum(1 for r in requests if r.ended) < total:
            passes += 1
            pool.reclaim()
            # 1. Evict what the queue's head lacks, then let the grants that
            #    makes land: their prompts are written before any step goes.
            if hold is None and not args.await_inline:
                short = pool.pages_short()
                if short:
                    cache.evict(short)  # pending until their readers are done
                await asyncio.sleep(0)
            # 2. The grants: each matches again and locks its path.
            grants, granted[:] = list(granted), []
            for req, grant, k in grants:
                if req.ended:  # (cancelled after its task returned: never here)
                    pool.free([grant.row])
                    continue
                start(req, grant, k)
            for _ in range(len(retry)):
                # Retracted and requeued requests go back first, admitted from
                # the loop (try_admit at priority 0 passes the queued new
                # ones); short of free pages, the cache evicts for them.
                req = retry[0]
                req.queued_hit = cache.peek(keys[req.id])
                k = need(req, req.queued_hit)
                if k > kv.available_size():
                    cache.evict(k - kv.available_size())  # pending behind their readers
                    req.queued_hit = cache.peek(keys[req.id])  # (it may have taken its own)
                    k = need(req, req.queued_hit)
                    if k > kv.available_size():
                        break
                got_now = pool.try_admit(pages=k, priority=0)
                if got_now is None:
                    break
                retry.popleft()
                grants.append((req, got_now, k))
                start(req, got_now, k)
            if args.await_inline:
                # The bug: the loop admits the head itself, from the loop
                # while requests run and by awaiting admit when none does,
                # and evicts nothing for it: what it lacks, the cache holds.
                while waiting:
                    req = waiting[0]
                    req.queued_hit = cache.peek(keys[req.id])
                    k = need(req, req.queued_hit)
                    got_now = pool.try_admit(pages=k)
                    if got_now is not None:
                        grant = got_now
                    elif running:
                        break
                    else:
                        engine.planned()  # (the step in flight holds pages too)
                        if hold is not None:  # nothing runs: nothing to grow
                            hold.release()
                            hold = None
                        try:
                            async with asyncio.timeout(args.stall_s):
                                grant = await pool.admit(pages=k)
                        except TimeoutError:
                            stall = (
                                f"the loop awaited admit(pages={k}) for {args.stall_s} s with "
                                f"nothing running: {kv.available_size()} pages free, "
                                f"{cache.pages} cached"
                            )
                            break
                    waiting.popleft()
                    grants.append((req, grant, k))
                    start(req, grant, k)
                if stall:
                    break
            # 3. Decode growth, a page each; short: evict, else retract.
            sitting_out: set[int] = set()
            for req in list(running):
                if req not in running or req.prompt_len + req.launched < len(req.table) * ps:
                    continue
                got = pool.extend(req.row, 1)
                if got is not None:
                    req.own.append(int(got[0]))
                    req.table.append(int(got[0]))
                    continue
                sitting_out.add(req.id)
                if hold is None:  # what comes back goes to growth first
                    hold = pool.hold_grants()
                if args.await_inline or not cache.evict(1):  # (the bug evicts nothing)
                    victim = running[-1]
                    unlock(victim)
                    pool.free([victim.row])  # row and pages, behind its recorded uses
                    counts["retractions"] += 1
                    submit(victim, 0)
            if hold is not None and (not sitting_out or not running):
                hold.release()
                hold = None
            # 4. Clients that go away while they queue.
            if tasks and rng.random() < args.cancel:
                req = rng.choice(sorted(tasks, key=lambda r: r.id))
                if not tasks[req].done():
                    tasks[req].cancel()  # a grant it got meanwhile goes back
                    end(req, "cancelled")
            engine.planned()  # (host streams: the steps in flight may go now)
            # 5. Launch step t; record_use covers the rows' own pages, every
            #    borrowed node keeps the step as its newest reader.
            batch = [r for r in running if r.id not in sitting_out]
            launched = None
            if batch:
                engine.launch_step(pool, batch)
                fence = record_fence(engine.forward)
                pool.record_use([r.row for r in batch], fence)
                for req in batch:
                    req.launched += 1
                    if req.prefill is None:  # the step that writes its prompt's KV
                        req.prefill = fence
                    for n in cache.borrowed(req.last):
                        n.read_fence = fence
                launched = (fence, [(r, r.admission) for r in batch])
                steps += 1
            # 6. Process step t-1 while step t runs.
            done_tokens = 0
            if prev is not None:
                prev_fence, prev_batch = prev
                await wait_fence(prev_fence)
                newest = launched[0] if launched is not None else prev_fence
                for req, admission in prev_batch:
                    if req.admission != admission or req not in running:
                        continue  # retracted since: that step's token is discarded
                    req.done += 1
                    done_tokens += 1
                    how = "finished"
                    if req.done < req.output_len:
                        if rng.random() >= args.abort:
                            continue
                        req.output_len, how = req.done, "aborted"  # the client went away
                    unlock(req)
                    engine.copy_out(pool, req)  # launched after step t's fence...
                    own = pool.detach_pages(req.row, host=True).tolist()
                    rest = cache.insert(keys[req.id], own, req.hit, newest, steps, req.prefill)
                    kv.free(torch.tensor(rest, dtype=torch.int64), fence=newest, after=engine.copy)
                    pool.free([req.row], after=engine.copy)  # ...so the frees wait for it too
                    end(req, how)
            prev = launched
            # Checks: progress, and the cache's pages against the pool's.
            if done_tokens:  # (grants alone are no progress: retract, re-admit, ...)
                progress, last_progress = progress + 1, passes
            elif passes - last_progress > args.stall_passes:
                stall = (
                    f"no token for {args.stall_passes} passes ({len(running)} running, "
                    f"{len(tasks) + len(retry) + len(waiting)} queued, {kv.available_size()} "
                    f"pages free, {cache.pages} cached)"
                )
                break
            if not tasks and not granted:  # no admission in flight: all is known
                counts["agreement_checks"] += 1
                stats = pool.stats()
                own_pages = sum(len(r.own) for r in running)
                if (cache.pages + own_pages, len(running)) != (
                    stats.pages_allocated,
                    stats.allocated,
                ):
                    disagreements.append(
                        f"pass {passes}: {cache.pages} cached + {own_pages} pages of "
                        f"{len(running)} rows, the pool {stats.pages_allocated} pages of "
                        f"{stats.allocated} rows"
                    )
            if batch or grants:
                await asyncio.sleep(0)
                continue
            wake.clear()  # nothing runs: wait for a grant, bounded
            try:
                async with asyncio.timeout(0.002):
                    await wake.wait()
            except TimeoutError:
                pass
        if hold is not None:
            hold.release()
        leaked_locks = sum(n.lock for n, _ in cache._nodes()) if not stall else 0
        for task in list(tasks.values()):
            task.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        for req in list(running):  # (a stall's leftovers)
            unlock(req)
            pool.free([req.row])
        for _, grant, _ in granted:
            pool.free([grant.row])
        cache.evict(0, everything=True)
        engine.planned()
        async with asyncio.timeout(30):
            await pool.drain()
        elapsed = time.perf_counter() - t0
    finally:
        await pool.close()
        engine.close()

    bad_kv = bad_rows = 0
    for req in requests:
        if req.ended not in ("finished", "aborted"):
            continue
        written = req.prompt_len + req.output_len
        kv_got, row_got = req.copied[-1]
        if [int(x) for x in kv_got.tolist()] != req.marks[:written]:
            bad_kv += 1
        if [int(x) for x in row_got.tolist()] != [req.slot(p, ps) for p in range(written)]:
            bad_rows += 1
    bad_reads = int(engine.bad_reads)
    stats = pool.stats()
    pool.check_invariants()
    empty = (
        stats.allocated == stats.pending == 0 and stats.pages_allocated == stats.pages_pending == 0
    )
    unended = sum(1 for r in requests if not r.ended)
    where = "CUDA streams" if engine.cuda else "HostStream"
    c = counts
    print(
        f"radix_cache: {total} requests on {args.rows} rows and {args.pages} pages of {ps}, "
        f"{steps} steps, {c['hits']} hits, {c['hit_pages']} pages borrowed, "
        f"{cache.evictions} evictions, {cache.evicted_pages} pages evicted, "
        f"{cache.non_leaf_evictions} evictions of inner nodes, {c['recomputed']} recomputed "
        f"pages, {cache.splits} splits, {c['retractions']} retractions, {c['aborted']} aborts, "
        f"{c['cancelled']} cancelled, {c['timeouts']} timeouts, {c['requeues']} requeues, "
        f"{c['extends']} extends, {c['trims']} trims, {c['agreement_checks']} agreement "
        f"checks, on {where}"
    )
    for line in disagreements[:3]:
        print(f"radix_cache: disagreement: {line}")
    if stall:
        print(f"radix_cache: stalled: {stall}")
    clean = bad_kv == bad_rows == bad_reads == 0 and not disagreements and not leaked_locks
    if clean and empty and not stall and unended == 0:
        print(
            "radix_cache: OK: 0 corrupted reads, 0 corrupted KV, 0 corrupted rows, no stall, "
            f"every request ended, cache and pool agree, pool empty, {elapsed:.2f} s"
        )
        return 0
    print(
        f"radix_cache: FAILED: {bad_reads} corrupted reads, {bad_kv} corrupted KV, "
        f"{bad_rows} corrupted rows, {'a' if stall else 'no'} stall, {unended} requests "
        f"unended, {len(disagreements)} disagreements, {leaked_locks} locks leaked, "
        f"{stats.allocated} rows and {stats.pages_allocated} pages still allocated"
    )
    return 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    p.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--rows", type=int, default=8, help="rows in the pool (row 0 excluded)")
    p.add_argument("--pages", type=int, default=24, help="KV pages (page 0 excluded)")
    p.add_argument("--page-size", type=int, default=4, help="token slots a page")
    p.add_argument("--depth", type=int, default=3, help="levels of the shared token-block tree")
    p.add_argument("--branch", type=int, default=2, help="children of each block of that tree")
    p.add_argument("--tail", type=int, default=3, help="a prompt's own tokens: 1 to this")
    p.add_argument("--max-output", type=int, default=16, help="output tokens: 2 to this")
    p.add_argument("--forward-ms", type=float, default=0.2, help="the forward's time per step")
    p.add_argument("--abort", type=float, default=0.01, help="a client's abort chance a token")
    p.add_argument(
        "--cancel", type=float, default=0.03, help="a queued client's cancel chance a pass"
    )
    p.add_argument(
        "--timeout-share", type=float, default=0.2, help="admissions that carry a timeout="
    )
    p.add_argument("--admit-timeout", type=float, default=0.005, help="that timeout, in seconds")
    p.add_argument(
        "--stall-passes",
        type=int,
        default=300,
        help="passes with no token produced that make a stall",
    )
    p.add_argument("--stall-s", type=float, default=1.0, help="--await-inline's bounded wait")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--evict-behind-write-fence",
        action="store_true",
        help="evict a node behind the fence it had when cached, not its newest reader's (bug)",
    )
    p.add_argument(
        "--evict-locked-ancestor",
        action="store_true",
        help="lock (and mark read) only a borrower's deepest node, not its ancestors (bug)",
    )
    p.add_argument(
        "--await-inline",
        action="store_true",
        help="await each admission in the loop itself, evicting nothing meanwhile (bug)",
    )
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available here")
    if min(args.rows, args.page_size, args.branch, args.tail, args.stall_passes) < 1:
        p.error("--rows, --page-size, --branch, --tail and --stall-passes must be at least 1")
    if min(args.requests, args.depth) < 0 or args.max_output < 2:
        p.error("--requests and --depth must be at least 0, --max-output at least 2")
    if not all(0 <= x <= 1 for x in (args.abort, args.cancel, args.timeout_share)):
        p.error("--abort, --cancel and --timeout-share must be probabilities")
    if not (0 <= args.forward_ms < float("inf") and args.admit_timeout > 0 and args.stall_s > 0):
        p.error("--forward-ms must be finite and >= 0, --admit-timeout and --stall-s > 0")
    # The longest request: every block of two pages, its tail, its output,
    # and the step in flight when it finishes writes one past them.
    longest = 2 * args.depth * args.page_size + args.tail + args.max_output + 1
    if longest > MAX_LEN:
        p.error(f"a request may reach {longest} positions; a row holds {MAX_LEN}")
    least = -(-longest // args.page_size)
    if args.pages < least:
        p.error(f"--pages must be at least {least} here")
    return run_loop(run(args), args.loop)


if __name__ == "__main__":
    sys.exit(main())
