"""Prefix caching for a hybrid model: a radix tree over two KV groups, checking itself.

docs/api.md's *Prefix caching* recipe on the *KV groups* of a model with
full-attention and sliding-window layers (``kv={"full": ..., "swa": ...}``,
a window of ``--window`` tokens that ends at the query), in an overlap loop,
the way SGLang's SWA radix cache keeps it:

* a cache node keeps, for each of its pages, the full group's page and,
  where the request that cached it still had it, the swa group's page; a
  position whose window page slid out (or was never admitted) has none
  (SGLang's *tombstone*). A hit at page ``m`` needs the full pages of the
  whole prefix and the swa pages of the window before position ``m * ps``
  (what the prefill of the rest attends to): the match is cut back to the
  deepest page boundary whose window is all there (SGLang cuts it to the
  deepest node so), and the request recomputes from there, both groups;
* a request admits from the loop with one count per group,
  ``try_admit({"full": n, "swa": w})``: ``n`` the pages past the hit, ``w``
  those of its first step's window past the hit (a prompt longer than the
  window admits only its window's swa pages, as ``hybrid_admission.py``
  does). Short, the cache evicts in the group that is short (full: least
  recently used unlocked leaves, both groups' pages; swa: the swa pages of
  the least recently used unlocked nodes, which keep their full pages),
  then it tries again; still short, the request waits for a later pass
  (the shortfall counts the free pages only: the pending ones come back
  once the step in flight is done, and evicting now lets the head in at
  once);
* at its grant a request locks every node of its path (one count that
  covers both groups); each step reads its context through the full group
  (every position) and its window through the swa group (on its first step
  from the window before the hit, the prefill's), and every node on its
  path keeps the step's fence as its newest reader; the swa pages that slid
  out of the next step's window go back with ``drop_pages(rows, below,
  group="swa")`` behind the step's fence;
* a finished (or aborted) request's pages go in by ``detach_pages`` of each
  group, the swa group's live ones counted from ``pages_dropped`` (the
  positions the slide left): the prompt's full pages the tree lacks become
  a leaf with the swa pages it still had, a node already cached that lacks
  a position's swa page takes the request's (SGLang revives a tombstone
  so), and the rest is freed behind the newest step;
* decode growth, before admission, takes a page in both groups at once
  (``extend(row, {"full": 1, "swa": 1})``); short, the request sits the
  step out, the cache evicts in the group that was short, with nothing to
  evict the newest request is retracted, and nothing is admitted that pass
  (what comes back goes to growth first).

Every step checks what it reads: each position of the full context and of
the window must hold the KV of its position's prefix (``corrupted reads``:
slots read that did not); every page the pool hands out (a grant's, a
growth's) is checked against the steps still running that used it
(``early hand-outs``). Also checked: no stall (no token for
``--stall-passes`` passes), the tree's pages plus the rows' agree with each
group's count in ``stats().kv_groups`` at every pass, no free refused, and
the pool empty once everything is evicted at the end.

Two flags put bugs back, and the checks must then fail:

* ``--evict-window-unfenced``: a node's swa pages are evicted with no
  fence, as if a window that slid on were read by nobody: the step in
  flight still reads the window of the request that cached them (and of a
  borrower that finished with it), and a request granted this pass
  writes its prompt there first: 127-250 corrupted reads and 61-108 early
  hand-outs a run at the defaults (seeds 0-5, both loops, debug mode too);
* ``--keep-slid-out``: the engine's table of a request's swa pages is not
  cleared where ``drop_pages`` gave them back, and the node is built from
  that table: it lists pages the pool already freed and handed on. A hit
  reads another request's KV through them, and their eviction frees pages
  the tree does not own (refused frees, or pages another node holds):
  100-658 corrupted reads and 17-36 refused frees a run, and a stall on
  the pages those refusals kept.

Runs on :class:`~asyncpool.HostStream` workers without a GPU and on a CUDA
stream when ``torch.cuda.is_available()`` (``--device cpu`` forces the host
streams). On host streams a step reads only once the scheduler has written
the prompts of the next pass's grants, so a page handed out while a step
still reads it is caught every time, not by timing (on CUDA the prompts are
written on the forward stream, whose order puts the old step first: the
flags are checked on host streams). ``--loop uvloop`` runs it on uvloop.
Exit status: 0 when everything checks out, 1 otherwise. Public API only.
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

from asyncpool import AsyncReqToTokenPool, InvalidSlotError, KVPagePool, record_fence, wait_fence

from _engine import HASH_MOD, PagedEngine, make_requests, run_loop

MAX_LEN = 96
GROUPS = ("full", "swa")

Chunk = tuple[int, ...]  # the tokens of one page: a tree key's unit


@dataclass(eq=False)
class Node:
    """Whole pages of a cached prefix, keyed by their tokens; the engine's."""

    key: list[Chunk]
    full: list[int]  # the full group's page of each chunk
    swa: list[int | None]  # the swa group's, where the node has it (None: a tombstone)
    parent: Node | None
    read_fence: Any = None  # the newest step that read any of its pages
    last_use: int = 0  # its newest use (a grant's match, a leaf put under it): LRU
    lock: int = 0  # running requests whose path goes through it (both groups)
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
    row: int = -1
    hit: int = 0  # pages its path in the tree holds: the first of its tables
    last: Node | None = None  # the deepest node it borrows (None: no hit)
    full: list[int] = field(default_factory=list)  # full pages by position: borrowed, own
    swa: list[int | None] = field(default_factory=list)  # swa pages by position (None: none)
    swa_base: int = 0  # the position of the row's first own swa page
    prefill_from: int | None = None  # first step: the window before the hit, from here
    ended: str = ""  # finished, aborted

    @property
    def prompt_len(self) -> int:
        return len(self.tokens)

    @property
    def length(self) -> int:
        return self.prompt_len + self.done


def chunks(tokens: list[int], page_size: int) -> list[Chunk]:
    """The prompt's full pages, as tree keys."""
    return [
        tuple(tokens[i : i + page_size]) for i in range(0, len(tokens) - page_size + 1, page_size)
    ]


def _common(key: list[Chunk], keys: list[Chunk], i: int) -> int:
    j = 0
    while j < len(key) and i + j < len(keys) and key[j] == keys[i + j]:
        j += 1
    return j


class HybridRadixCache:
    """A radix tree of whole pages over two KV groups of one pool.

    Each node holds its full pages and, where it has them, its swa pages;
    the pool counts them as allocated and knows nothing of the tree.
    ``window_unfenced=True`` is the bug, on purpose.
    """

    def __init__(
        self, kv: dict[str, KVPagePool], window: int, *, window_unfenced: bool = False
    ) -> None:
        self.kv = kv
        self.ps = kv["full"].page_size
        self.window = window
        self.window_unfenced = window_unfenced
        self.root = Node([], [], [], None)
        self.pages = dict.fromkeys(GROUPS, 0)  # pages the tree holds, by group
        self.nodes = 0
        self.evicted = dict.fromkeys(GROUPS, 0)  # pages evicted, by group
        self.evictions = self.tombstoned = self.revived = self.splits = 0
        self.non_leaf_evictions = 0
        self.refused: list[str] = []  # frees the pool refused (pages it did not own)
        self.in_flight = 0  # swa pages evicted while a step that read them still ran

    def lo(self, pos: int) -> int:
        """The first position the query at ``pos`` reads in the window."""
        return max(0, pos - self.window + 1)

    def _walk(self, keys: list[Chunk]) -> list[int | None]:
        """The swa pages (None where absent) of the longest cached prefix of
        ``keys``, page by page, changing nothing."""
        node, i, out = self.root, 0, []
        while i < len(keys) and (child := node.children.get(keys[i])) is not None:
            j = _common(child.key, keys, i)
            out += child.swa[:j]
            i += j
            if j < len(child.key):
                break
            node = child
        return out

    def peek(self, keys: list[Chunk]) -> int:
        """The usable hit for ``keys``: the deepest page boundary ``m`` of the
        cached prefix whose window (positions ``lo(m * ps)`` to ``m * ps``)
        has every swa page. Changes nothing."""
        swa = self._walk(keys)
        for m in range(len(swa), 0, -1):
            if all(p is not None for p in swa[self.lo(m * self.ps) // self.ps : m]):
                return m
        return 0

    def match(self, keys: list[Chunk]) -> Node:
        """The node that ends exactly at ``len(keys)`` pages, all of them
        cached (a node the prefix leaves midway is split there)."""
        node, i = self.root, 0
        while i < len(keys):
            child = node.children[keys[i]]
            j = _common(child.key, keys, i)
            if j < len(child.key):
                return self._split(child, j)
            node, i = child, i + j
        return node

    def _split(self, node: Node, j: int) -> Node:
        """Split ``node`` after its first ``j`` pages; return the new top,
        which takes its locks, fence and last use (an ancestor of all its
        borrowers)."""
        assert node.parent is not None
        top = Node(
            node.key[:j],
            node.full[:j],
            node.swa[:j],
            node.parent,
            node.read_fence,
            node.last_use,
            node.lock,
        )
        node.parent.children[top.key[0]] = top
        node.key, node.full, node.swa, node.parent = (
            node.key[j:],
            node.full[j:],
            node.swa[j:],
            top,
        )
        top.children[node.key[0]] = node
        self.nodes += 1
        self.splits += 1
        return top

    @staticmethod
    def table(node: Node) -> tuple[list[int], list[int | None]]:
        """The full and swa pages of the path down to ``node``, root first."""
        path = list(reversed(node.path()))
        return [p for n in path for p in n.full], [p for n in path for p in n.swa]

    def insert(
        self,
        keys: list[Chunk],
        hit: int,
        full: list[int],
        swa: dict[int, int],
        fence: Any,
        step: int,
    ) -> tuple[list[int], list[int]]:
        """Cache a finished request's prompt pages: ``full`` its own full
        pages (positions from ``hit`` on), ``swa`` its own live swa pages by
        position. Returns the full and swa pages the tree does not take.
        ``fence``: the newest step that read them."""
        node, m = self.root, 0
        while m < len(keys) and (child := node.children.get(keys[m])) is not None:
            j = _common(child.key, keys, m)
            if j < len(child.key):
                node, m = self._split(child, j), m + j
                break
            node, m = child, m + j
        if m < hit:  # its path was evicted under it: never, with every node locked
            return full, list(swa.values())
        taken_full: set[int] = set()
        taken_swa: set[int] = set()
        pos = 0
        for n in reversed(node.path()):  # revive the tombstones it can fill
            for j in range(len(n.swa)):
                if hit <= pos + j and n.swa[j] is None and pos + j in swa:
                    n.swa[j] = swa[pos + j]
                    taken_swa.add(pos + j)
                    n.read_fence = fence  # its newest reader read that page too
                    self.pages["swa"] += 1
                    self.revived += 1
            pos += len(n.swa)
        if m < len(keys):
            for n in node.path():  # a new leaf's ancestors are at least as new
                n.last_use = step
            span = range(m, len(keys))
            leaf = Node(
                keys[m:],
                [full[k - hit] for k in span],
                [swa.get(k) for k in span],
                node,
                fence,
                step,
            )
            node.children[keys[m]] = leaf
            taken_full.update(span)
            taken_swa.update(k for k in span if k in swa)
            self.pages["full"] += len(span)
            self.pages["swa"] += sum(1 for k in span if k in swa)
            self.nodes += 1
        rest_full = [p for i, p in enumerate(full) if hit + i not in taken_full]
        rest_swa = [p for k, p in swa.items() if k not in taken_swa]
        return rest_full, rest_swa

    def _nodes(self) -> list[tuple[Node, int]]:
        out, stack = [], [(c, 1) for c in self.root.children.values()]
        while stack:
            node, depth = stack.pop()
            out.append((node, depth))
            stack.extend((c, depth + 1) for c in node.children.values())
        return out

    def free(self, group: str, pages: list[int], fence: Any, *, evict: bool = False) -> None:
        """Free ``pages`` of ``group`` behind ``fence``; a refusal (pages the
        caller does not own) frees nothing and is kept in ``refused``."""
        if not pages:
            return
        ids = torch.tensor(pages, dtype=torch.int64)
        if evict and group == "swa" and fence is not None and not fence.query():
            self.in_flight += len(pages)
        try:
            if evict and group == "swa" and self.window_unfenced:  # the bug: a slid window
                self.kv[group].free(ids)
            else:  # behind its newest reader
                self.kv[group].free(ids, fence=fence)
        except InvalidSlotError as e:  # pages the tree does not own: nothing freed
            self.refused.append(f"{group}: {e}")

    def evict_swa(self, pages: int) -> int:
        """Free the swa pages of unlocked nodes, least recently used first
        (deepest first on a tie), keeping their full pages (tombstones),
        until ``pages`` are freed; return how many were."""
        got = 0
        order = sorted(
            (nd for nd in self._nodes() if nd[0].lock == 0 and any(nd[0].swa)),
            key=lambda nd: (nd[0].last_use, -nd[1]),
        )
        for node, _ in order:
            if got >= pages:
                break
            live = [p for p in node.swa if p is not None]
            self.free("swa", live, node.read_fence, evict=True)
            node.swa = [None] * len(node.swa)
            got += len(live)
            self.pages["swa"] -= len(live)
            self.evicted["swa"] += len(live)
            self.tombstoned += 1
        return got

    def evict_full(self, pages: int, *, everything: bool = False) -> int:
        """Evict unlocked nodes, least recently used first (deepest first on
        a tie), each with the nodes under it and both groups' pages, until
        ``pages`` full pages are; return how many were. ``everything``: the
        end of the run, every node."""
        got = 0
        order = sorted(
            (nd for nd in self._nodes() if everything or nd[0].lock == 0),
            key=lambda nd: (nd[0].last_use, -nd[1]),
        )
        for node, _ in order:
            if got >= pages and not everything:
                break
            if node.parent is None:  # evicted already, under an evicted ancestor
                continue
            if node.children:
                self.non_leaf_evictions += 1  # never, with every ancestor locked
            del node.parent.children[node.key[0]]
            stack = [node]
            while stack:
                n = stack.pop()
                stack.extend(n.children.values())
                n.children, n.parent = {}, None
                live = [p for p in n.swa if p is not None]
                self.free("full", n.full, n.read_fence, evict=True)
                self.free("swa", live, n.read_fence, evict=True)
                got += len(n.full)
                for g, k in (("full", len(n.full)), ("swa", len(live))):
                    self.pages[g] -= k
                    self.evicted[g] += k
                self.nodes -= 1
                self.evictions += 1
        return got


def _step(
    kv_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    verified_lens: torch.Tensor,
    bad_reads: torch.Tensor,
    reads: torch.Tensor,
    expected: torch.Tensor,
    writes: torch.Tensor,
    values: torch.Tensor,
) -> None:
    """One step: count the slots read that do not hold what they should,
    then write each request's next position in both groups."""
    bad_reads += (kv_cache[reads] != expected).sum()
    kv_cache[writes] = values


class Engine(PagedEngine):
    """Both groups' KV in one tensor (the swa group's pages after the full
    group's), and the forward stream (a HostStream or CUDA)."""

    def __init__(
        self,
        device: torch.device,
        full_pages: int,
        swa_pages: int,
        page_size: int,
        window: int,
        forward_ms: float,
    ) -> None:
        super().__init__(device, full_pages + swa_pages, page_size, forward_ms)
        self.swa_offset = full_pages * page_size
        self.window = window
        self.users: dict[tuple[str, int], Any] = {}  # (group, page): the newest step using it
        self.stepped: set[tuple[str, int]] = set()  # the pages of the step just launched
        self.checked = self.early = 0  # pages handed out; of them while a user still ran

    def used_by(self, fence: Any) -> None:
        """The step just launched (``fence``) is the newest user of its pages."""
        for page in self.stepped:
            self.users[page] = fence

    def handed_out(self, group: str, pages: list[int]) -> None:
        """Pages the pool handed out: count those that a step still running
        reads or writes (none, behind the right fences)."""
        for p in pages:
            fence = self.users.pop((group, p), None)
            self.checked += 1
            self.early += fence is not None and not fence.query()

    def slots(self, req: Request, group: str, positions: range) -> list[int]:
        """The slots of ``positions`` in ``group`` (page 0, which holds
        nothing, where the request has no page)."""
        ps = self.page_size
        if group == "full":
            return [req.full[p // ps] * ps + p % ps for p in positions]
        return [self.swa_offset + (req.swa[p // ps] or 0) * ps + p % ps for p in positions]

    @staticmethod
    def value(req: Request, group: str, pos: int) -> int:
        """The KV of position ``pos`` in ``group``: the hash of its prefix."""
        return req.marks[pos] + (HASH_MOD if group == "swa" else 0)

    def write_prompt(self, req: Request) -> None:
        """Prefill: the KV of the positions past the hit (in the swa group,
        those of its own pages: the first step's window)."""
        slots, values = [], []
        for g, lo in (("full", req.hit * self.page_size), ("swa", req.swa_base * self.page_size)):
            span = range(lo, req.length)
            slots += self.slots(req, g, span)
            values += [self.value(req, g, p) for p in span]
        s, v = torch.tensor(slots, dtype=torch.int64), torch.tensor(values, dtype=torch.int64)
        if self.cuda:
            with torch.cuda.stream(self.forward):
                self.kv_cache[s.to(self.device)] = v.to(self.device)
        else:  # from the scheduler's thread, outside the forward's order
            self.kv_cache[s] = v

    def launch_step(self, pool: AsyncReqToTokenPool, batch: list[Request]) -> None:
        """Each request reads its full context and its window, then writes
        its next position in both groups."""
        self.stepped = set()
        reads: list[int] = []
        expected: list[int] = []
        writes: list[int] = []
        values: list[int] = []
        ps = self.page_size
        for r in batch:
            q = r.prompt_len + r.launched
            lo = max(0, q - self.window + 1)
            spans = [("full", range(q)), ("swa", range(lo, q))]
            if r.prefill_from is not None:  # the prefill read the window before the hit
                spans.append(("swa", range(r.prefill_from, min(r.hit * ps, lo))))
            for g, span in spans:
                reads += self.slots(r, g, span)
                expected += [self.value(r, g, p) for p in span]
                table = r.full if g == "full" else r.swa
                for k in {p // ps for p in span}:
                    if (page := table[k]) is not None:
                        self.stepped.add((g, page))
            for g, page in (("full", r.full[q // ps]), ("swa", r.swa[q // ps])):
                if page is not None:
                    self.stepped.add((g, page))
                writes += self.slots(r, g, range(q, q + 1))
                values.append(self.value(r, g, q))
        tensors = (reads, expected, writes, values)
        self.launch_kernel(
            pool, *(torch.tensor(t, dtype=torch.int64) for t in tensors), kernel=_step
        )


async def run(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    rng = random.Random(args.seed)
    ps = args.page_size
    engine = Engine(
        device, args.full_pages + 1, args.swa_pages + 1, ps, args.window, args.forward_ms
    )
    kv = {"full": KVPagePool(args.full_pages + 1, ps), "swa": KVPagePool(args.swa_pages + 1, ps)}
    pool = AsyncReqToTokenPool(
        args.rows + 1, MAX_LEN, device=device, kv=kv, stream=engine.forward if engine.cuda else None
    )
    cache = HybridRadixCache(kv, args.window, window_unfenced=args.evict_window_unfenced)
    lo = cache.lo
    requests = make_requests(args, rng, MAX_LEN, Request)
    keys = {r.id: chunks(r.tokens, ps) for r in requests}
    waiting: deque[Request] = deque(requests)  # retracted ones go back in front
    running: list[Request] = []  # oldest admission first
    counts = dict.fromkeys(
        [
            "finished",
            "aborted",
            "hits",
            "hit_pages",
            "cut_hits",
            "retractions",
            "agreement_checks",
        ],
        0,
    )
    disagreements: list[str] = []

    def need(req: Request, hit: int) -> dict[str, int]:
        """Pages past ``hit`` through its first step's position, in each
        group (the swa group's from its first step's window on)."""
        end = -(-(req.length + 1) // ps)
        return {"full": end - hit, "swa": end - max(hit, lo(req.length) // ps)}

    def start(req: Request, full: list[int], swa: list[int], row: int, hit: int) -> None:
        """A grant: lock the path of the hit, build both tables, prefill."""
        node = cache.match(keys[req.id][:hit])
        req.row, req.hit, req.admission = row, hit, req.admission + 1
        req.last = node if hit else None
        for n in node.path():  # every node of the path: locked, and used now
            n.lock += 1
            n.last_use = steps
        cached_full, cached_swa = cache.table(node)
        req.swa_base = max(hit, lo(req.length) // ps)
        req.full = cached_full + full
        req.swa = cached_swa + [None] * (req.swa_base - hit) + list[int | None](swa)
        assert len(req.full) == len(req.swa), (len(req.full), len(req.swa))
        req.prefill_from = lo(hit * ps) if hit else None
        req.launched = req.done
        if hit:
            counts["hits"] += 1
            counts["hit_pages"] += hit
        if len(cache._walk(keys[req.id])) > hit:
            counts["cut_hits"] += 1  # a longer prefix cached, its window not all there
        engine.write_prompt(req)
        running.append(req)

    def unlock(req: Request) -> None:
        running.remove(req)
        if req.last is not None:
            for n in req.last.path():
                n.lock -= 1
        req.last = None

    def short_of(k: dict[str, int]) -> dict[str, int]:
        """What ``k`` lacks in each group past the free pages. (Not past the
        pending ones too: those come back once the step in flight is done,
        a pass later, and evicting now lets the head in at once.)"""
        return {g: k[g] - kv[g].available_size() for g in GROUPS}

    def admit() -> None:
        """Admit from the queue's head while it fits, the cache evicting in
        the group that comes up short."""
        while waiting and pool.available_size() > 0:
            req = waiting[0]
            prompt_keys = keys[req.id][: req.prompt_len // ps]
            hit = cache.peek(prompt_keys)
            k = need(req, hit)
            grant = pool.try_admit(k)
            if grant is None:
                short = short_of(k)
                if short["full"] > 0:
                    cache.evict_full(short["full"])  # both groups' pages
                    hit = cache.peek(prompt_keys)  # (it may have taken its own)
                    k = need(req, hit)
                if (swa_short := short_of(k)["swa"]) > 0:
                    cache.evict_swa(swa_short)  # windows only: the full pages stay
                    hit = cache.peek(prompt_keys)
                    k = need(req, hit)
                grant = pool.try_admit(k)
                if grant is None:  # pending behind their readers: a later pass
                    return
            waiting.popleft()
            pages = {g: pool.pages_of(grant.row, host=True, group=g).tolist() for g in GROUPS}
            for g in GROUPS:
                engine.handed_out(g, pages[g])
            start(req, pages["full"], pages["swa"], grant.row, hit)

    def finish(req: Request, how: str, newest: Any) -> None:
        """Into the cache: each group's own pages detached, the prompt's
        full pages the tree lacks cached with the swa pages they still
        have, the rest freed behind ``newest`` (the step in flight)."""
        unlock(req)
        full = pool.detach_pages(req.row, host=True, group="full").tolist()
        dropped = pool.pages_dropped(req.row, group="swa")  # the positions the slide left
        live = pool.detach_pages(req.row, host=True, group="swa").tolist()
        swa = {req.swa_base + dropped + i: int(p) for i, p in enumerate(live)}
        table = {k: p for k, p in enumerate(req.swa) if k >= req.swa_base and p is not None}
        if table != swa:
            if args.keep_slid_out:  # the bug: the engine's table, slid-out pages and all
                swa = table
            else:
                disagreements.append(f"request {req.id}: swa table {table}, the pool's {swa}")
        rest_full, rest_swa = cache.insert(keys[req.id], req.hit, full, swa, newest, steps)
        cache.free("full", rest_full, newest)
        cache.free("swa", rest_swa, newest)
        pool.free([req.row])  # the row alone: it owns no pages now
        assert not req.ended, f"request {req.id} ended twice"
        req.ended = how
        counts[how] += 1

    prev: tuple[Any, list[tuple[Request, int]]] | None = None
    steps = passes = last_progress = 0
    stall = ""
    t0 = time.perf_counter()
    try:
        while sum(1 for r in requests if r.ended) < len(requests):
            passes += 1
            pool.reclaim()
            # 1. Decode growth, a page in both groups at once; short: evict in
            #    the group that is short, with nothing to evict retract the newest.
            sitting_out: set[int] = set()
            for req in list(running):
                if req not in running or req.prompt_len + req.launched < len(req.full) * ps:
                    continue
                got = pool.extend(req.row, {"full": 1, "swa": 1})
                if got is not None:
                    req.full.append(int(got["full"][0]))
                    req.swa.append(int(got["swa"][0]))
                    for g in GROUPS:
                        engine.handed_out(g, [int(got[g][0])])
                    continue
                sitting_out.add(req.id)  # its pages come next pass
                short = {g: 1 - kv[g].available_size() - kv[g].pending_size() for g in GROUPS}
                freed = 1
                if short["full"] > 0:
                    freed = cache.evict_full(1)
                if short["swa"] > 0 and freed:
                    freed = cache.evict_swa(1) or cache.evict_full(1)
                if not freed:
                    victim = running[-1]  # the newest: the least work lost
                    unlock(victim)
                    pool.free([victim.row])  # both groups, behind its recorded uses
                    counts["retractions"] += 1
                    waiting.appendleft(victim)  # recomputed, ahead of the new ones
            # 2. Admit from the loop, unless growth came up short (what comes
            #    back goes to growth first); the prompts are written before any
            #    step goes.
            if not sitting_out:
                admit()
            engine.planned()  # (host streams: the step in flight may go now)
            # 3. Launch step t: record_use covers both groups' own pages, every
            #    node of a borrower's path keeps the step as its newest reader,
            #    and the swa pages that slid out of the next window go back.
            batch = [r for r in running if r.id not in sitting_out]
            launched = None
            if batch:
                engine.launch_step(pool, batch)
                fence = record_fence(engine.forward)
                engine.used_by(fence)
                pool.record_use([r.row for r in batch], fence)
                below = []
                for req in batch:
                    req.launched += 1
                    req.prefill_from = None
                    if req.last is not None:
                        for n in req.last.path():
                            n.read_fence = fence
                    slid = max(0, lo(req.prompt_len + req.launched) // ps - req.swa_base)
                    below.append(slid)
                    if not args.keep_slid_out:  # (the bug leaves them listed)
                        for k in range(req.swa_base, req.swa_base + slid):
                            req.swa[k] = None
                pool.drop_pages([r.row for r in batch], below, group="swa")
                launched = (fence, [(r, r.admission) for r in batch])
                steps += 1
            # 4. Process step t-1 while step t runs.
            if prev is not None:
                prev_fence, prev_batch = prev
                await wait_fence(prev_fence)
                newest = launched[0] if launched is not None else prev_fence
                for req, admission in prev_batch:
                    if req.admission != admission or req not in running:
                        continue  # retracted since: that step's token is discarded
                    req.done += 1
                    last_progress = passes
                    if req.done >= req.output_len:
                        finish(req, "finished", newest)
                    elif rng.random() < args.abort:
                        req.output_len = req.done  # the client went away
                        finish(req, "aborted", newest)
            prev = launched
            # Checks: progress, and the tree's pages against each group's count.
            if passes - last_progress > args.stall_passes:
                stall = (
                    f"no token for {args.stall_passes} passes ({len(running)} running, "
                    f"{len(waiting)} queued, free full {kv['full'].available_size()} swa "
                    f"{kv['swa'].available_size()}, cached full {cache.pages['full']} swa "
                    f"{cache.pages['swa']})"
                )
                break
            counts["agreement_checks"] += 1
            groups = pool.stats().kv_groups
            for g in GROUPS:
                own = sum(
                    len(pool.pages_of(r.row, host=True, group=g))
                    - pool.pages_dropped(r.row, group=g)
                    for r in running
                )
                if cache.pages[g] + own != groups[g].allocated:
                    disagreements.append(
                        f"pass {passes}, {g}: {cache.pages[g]} cached + {own} of the rows, "
                        f"the pool {groups[g].allocated}"
                    )
            if batch:
                await asyncio.sleep(0)
            else:  # nothing runs: pages pending behind fences come back
                await asyncio.sleep(0.001)
        leaked_locks = sum(n.lock for n, _ in cache._nodes()) if not stall else 0
        for req in list(running):  # (a stall's leftovers)
            unlock(req)
            pool.free([req.row])
        cache.evict_full(0, everything=True)
        engine.planned()
        async with asyncio.timeout(30):
            await pool.drain()
        elapsed = time.perf_counter() - t0
    finally:
        await pool.close()
        engine.close()

    bad_reads, early = int(engine.bad_reads), engine.early
    stats = pool.stats()
    pool.check_invariants()
    empty = (
        stats.allocated == stats.pending == 0 and stats.pages_allocated == stats.pages_pending == 0
    )
    where = "CUDA streams" if engine.cuda else "HostStream"
    c = counts
    print(
        f"hybrid_prefix: {len(requests)} requests on {args.rows} rows, {args.full_pages} full "
        f"and {args.swa_pages} swa pages of {ps}, window {args.window}, {steps} steps, "
        f"{c['hits']} hits, {c['hit_pages']} pages borrowed, {c['cut_hits']} hits cut short "
        f"for a window, {cache.evictions} evictions, {cache.evicted['full']} full pages and "
        f"{cache.evicted['swa']} swa pages evicted, {cache.tombstoned} windows evicted, "
        f"{cache.in_flight} swa pages evicted under a step in flight, "
        f"{cache.revived} swa pages revived, {cache.non_leaf_evictions} evictions of inner "
        f"nodes, {cache.splits} splits, {c['retractions']} retractions, {c['aborted']} aborts, "
        f"{c['agreement_checks']} agreement checks, on {where}"
    )
    for line in disagreements[:3] + cache.refused[:3]:
        print(f"hybrid_prefix: {line}")
    if stall:
        print(f"hybrid_prefix: stalled: {stall}")
    clean = bad_reads == early == 0 and not disagreements and not cache.refused and not leaked_locks
    if clean and empty and not stall:
        print(
            f"hybrid_prefix: OK: 0 corrupted reads, 0 early hand-outs of {engine.checked}, "
            f"0 refused frees, no stall, cache and pool agree, pool empty, {elapsed:.2f} s"
        )
        return 0
    print(
        f"hybrid_prefix: FAILED: {bad_reads} corrupted reads, {early} early hand-outs of "
        f"{engine.checked}, {len(cache.refused)} refused "
        f"frees, {'a' if stall else 'no'} stall, {len(disagreements)} disagreements, "
        f"{leaked_locks} locks leaked, {stats.pages_allocated} pages still allocated"
    )
    return 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    p.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--rows", type=int, default=16, help="rows in the pool (row 0 excluded)")
    p.add_argument("--full-pages", type=int, default=60, help="full group's pages (0 excluded)")
    p.add_argument("--swa-pages", type=int, default=28, help="swa group's pages (0 excluded)")
    p.add_argument("--page-size", type=int, default=4, help="token slots a page")
    p.add_argument("--window", type=int, default=16, help="sliding window, in tokens")
    p.add_argument("--depth", type=int, default=3, help="levels of the shared token-block tree")
    p.add_argument("--branch", type=int, default=2, help="children of each block of that tree")
    p.add_argument("--tail", type=int, default=3, help="a prompt's own tokens: 1 to this")
    p.add_argument("--max-output", type=int, default=12, help="output tokens: 2 to this")
    p.add_argument("--forward-ms", type=float, default=0.2, help="the forward's time per step")
    p.add_argument("--abort", type=float, default=0.01, help="a client's abort chance a token")
    p.add_argument(
        "--stall-passes", type=int, default=300, help="passes with no token that make a stall"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--evict-window-unfenced",
        action="store_true",
        help="evict a node's swa pages with no fence, not behind its newest reader (bug)",
    )
    p.add_argument(
        "--keep-slid-out",
        action="store_true",
        help="cache the swa pages from a table that still lists those dropped (bug)",
    )
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available here")
    if min(args.rows, args.page_size, args.branch, args.tail, args.stall_passes) < 1:
        p.error("--rows, --page-size, --branch, --tail and --stall-passes must be at least 1")
    if min(args.requests, args.depth) < 0 or args.max_output < 2 or args.window < 1:
        p.error("--requests and --depth at least 0, --max-output at least 2, --window 1")
    if not 0 <= args.abort <= 1:
        p.error("--abort must be a probability")
    if not 0 <= args.forward_ms < float("inf"):
        p.error("--forward-ms must be finite and >= 0")
    # The longest request: every block of two pages, its tail, its output,
    # and the step in flight when it finishes writes one past them.
    longest = 2 * args.depth * args.page_size + args.tail + args.max_output + 1
    if longest > MAX_LEN:
        p.error(f"a request may reach {longest} positions; a row holds {MAX_LEN}")
    least = {"full": -(-longest // args.page_size), "swa": -(-args.window // args.page_size) + 2}
    for g in GROUPS:
        if getattr(args, f"{g}_pages") < least[g]:
            p.error(f"--{g}-pages must be at least {least[g]} here")
    return run_loop(run(args), args.loop)


if __name__ == "__main__":
    sys.exit(main())
