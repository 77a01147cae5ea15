"""Multi-tenant LoRA adapter slots as a KV group of the pool: a program that checks itself.

docs/api.md's *Several resources: a request's row, pages and an adapter
slot*, as an engine's overlap loop over ``AsyncReqToTokenPool(kv={"kv":
KVPagePool(...), "lora": KVPagePool(slots + 1, 1, name="lora")})``:

* tenants in two tiers (paid: priority 0, free: priority 1), each capped
  at ``--quota`` rows and ``--page-cap`` KV pages, counted *before* the
  request queues in the pool (nothing is held while it waits) and as it
  grows; each tenant's requests use its own adapters;
* a request queues with ``admit({"kv": n, "lora": 1})`` on a miss (its
  adapter not cached), ``"lora": 0`` on a hit, ``n`` the pages of its
  prompt and first step; it locks its adapter *at its grant*, after
  reconciling the cache: a hit evicted meanwhile takes a slot with
  ``extend(row, 1, group="lora")`` (when None, the row is freed at once and
  the request requeues as a miss); a miss loaded meanwhile gives its unread
  slot back unfenced (a *surplus* slot);
* it grows with ``extend(row, 1, group="kv")`` as it decodes: a tenant at
  its page cap retracts its own newest request; a pool short of pages
  holds the grant loop and retracts the lowest tier's newest request only
  until what the retractions will return covers it, the short request
  sitting the step out (docs/api.md, *Retraction*, *Growth and queued
  admissions*); a retracted request queues again and recomputes;
* seeded aborts (``--aborts``): while queued (its admit cancelled), at its
  grant before its first step (a slot it loaded is never read), mid-decode;
* a slot is detached to the engine's adapter cache (``detach_pages(row,
  group="lora")``), loaded on one of ``--load-streams`` streams; the forward
  waits for the loads it reads; unlocked adapters are evicted for the
  queue's head (``pages_short(group="lora")`` slots, those with no request
  queued first, least recently read first) behind the newest step that
  read them *and* the load: ``kv_groups["lora"].free(slot, fence=[reader,
  load])``.

The loop overlaps: a request's last step is known only once its result is
processed, after the next step is launched with it still in it; that step
reads the adapter after the request has finished and unlocked it. Every
step checks what it reads: each request's KV context through its row
(``corrupted reads``) and its adapter's id through its slot (``corrupted
adapter reads``); each row, page and slot handed out is checked against
its last users' fences, loads included (``early hand-outs``). At the end
every request must have finished or been aborted, the pool empty.
``--burst N`` (with ``--rate``, arrivals a step) adds N requests of paid
tenant 0 at step 0 and reports the other paid tenant's wait from arrival
to first grant, p50 and p99, in scheduling passes (steps); ``--no-caps``.

Three flags put documented bugs back; the run must then fail (on host
streams; on CUDA whether a load overtakes a step or a load is timing):

* ``--lock-at-queue``: a hit locks its adapter when it queues; a miss at
  the head waits for a slot while the hits behind it (FIFO within a
  priority) lock every cached adapter: no grant for ``--stall-steps``
  passes so is reported as STALLED (never a hang);
* ``--evict-unfenced``: an evicted slot is freed with no fence; the next
  miss's load overwrites it while the step in flight still reads it;
* ``--evict-loaded-unread-unfenced``: a slot loaded, never read, is freed
  with no fence (no reader, but not behind its load): the next miss's load,
  on the other stream, lands first, then the old one (``--load-ms`` > 0).

On host streams a step reads only once the scheduler has written the next
step's prompts and the loads it reads have landed (``PagedEngine``'s gate):
a hand-out too early is caught every time, not by timing. CUDA streams when
``torch.cuda.is_available()`` (``--device cpu`` forces host streams).
``--loop uvloop`` runs it on uvloop. Exit status: 0 when everything checks
out, 1 otherwise. Public API only.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncpool import AsyncReqToTokenPool, Grant, GroupGrant, KVPagePool, record_fence, wait_fence

from _engine import PagedEngine, run_loop, step

MAX_PROMPT = 24
MAX_OUTPUT = 24
MAX_LEN = MAX_PROMPT + MAX_OUTPUT + 1  # and the step in flight when it ends


@dataclass
class Request:
    id: int
    tenant: int
    tier: int  # its priority: 0 paid, 1 free
    adapter: int
    prompt_len: int
    output_len: int
    arrived: int = 0  # the pass it reached the engine (before its tenant's caps)
    abort: str = ""  # "queued", "granted" or "decode": aborted there (seeded)
    abort_at: int = 0  # queued: passes after it queues; decode: tokens done
    queued_at: int = 0  # the pass it last queued in
    hit: bool = False  # queued as a hit (no slot asked for)
    locked: bool = False  # holds a lock on its adapter
    counted: int = 0  # pages counted against its tenant's cap
    task: asyncio.Task[None] | None = None  # its admit
    row: int = -1
    seq: int = 0  # grant order: a tenant over its cap retracts its newest
    admission: int = 0  # bumped at each grant (a retraction recomputes)
    pages: list[int] = field(default_factory=list)  # its KV pages
    done: int = 0  # output tokens whose step has been processed
    launched: int = 0  # steps launched
    fence: Any = None  # the newest step it was in
    ended: bool = False  # finished or aborted
    first_wait: int = -1  # passes from its arrival to its first grant

    def value(self, pos: int) -> int:
        return self.id * MAX_LEN + pos + 1

    def context_sum(self, n: int) -> int:
        return n * self.id * MAX_LEN + n * (n + 1) // 2

    def first_pages(self, ps: int) -> int:
        """The pages its (re-)admission takes: its prompt and the tokens it
        made, and the position its first step writes."""
        return -(-(self.prompt_len + self.done + 1) // ps)


@dataclass
class Adapter:
    """A cached adapter: its slot, detached to the engine, and its fences."""

    id: int
    slot: torch.Tensor
    load: Any  # the load's fence
    reader: Any = None  # the newest step that read it
    last_read: int = -1
    lock: int = 0  # requests that read it (granted; queued too with --lock-at-queue)
    waited: bool = False  # a step waited for its load


def _host_load(lora: torch.Tensor, slot: int, value: int, delay_s: float) -> None:
    time.sleep(delay_s)  # the copy's time, on the load stream's worker
    lora[slot] = value


def _step(*args: torch.Tensor) -> None:
    """``_engine.step``, then each request reads its adapter through its slot."""
    *kv, lora, bad_lora, lora_slots, lora_ids = args
    step(*kv)
    bad_lora += (lora[lora_slots] != lora_ids).sum()


class Engine(PagedEngine):
    """The KV cache, the adapter slots and the forward and load streams."""

    def __init__(self, device: torch.device, pages: int, ps: int, slots: int, args: Any) -> None:
        super().__init__(device, pages, ps, args.forward_ms)
        self.load_s = args.load_ms / 1e3
        self.lora = torch.zeros(slots, dtype=torch.int64, device=device)  # an adapter id a slot
        self.bad_lora = torch.zeros((), dtype=torch.int64, device=device)
        self.loaders: list[Any] = [self.new_stream(f"load{i}") for i in range(args.load_streams)]
        self.loads = 0

    def load_adapter(self, slot: int, adapter: int) -> Any:
        """Load ``adapter`` into ``slot`` on the next load stream (round
        robin); its fence. Adapters of ranks 1-3 take 1-3 times --load-ms."""
        loader = self.loaders[self.loads % len(self.loaders)]
        self.loads += 1
        delay_s = self.load_s * (1 + adapter % 3)
        if self.cuda:
            with torch.cuda.stream(loader):
                torch.cuda._sleep(int(delay_s * 1.5e9))  # type: ignore[no-untyped-call]
                self.lora[slot : slot + 1].fill_(adapter + 1)
        else:
            loader.launch(_host_load, self.lora, slot, adapter + 1, delay_s)
        return record_fence(loader)

    def wait_load(self, fence: Any) -> None:
        """The forward waits for a load before its next step."""
        if self.cuda:
            self.forward.wait_event(fence.event)
        else:
            self.forward.wait(fence)

    def launch_step(self, pool: AsyncReqToTokenPool, batch: list[Request], slots: Any) -> None:
        ps = self.page_size
        pos = [r.prompt_len + r.launched for r in batch]  # each reads 0..pos-1, writes pos
        at = list(zip(batch, pos, strict=True))
        kv_slots = [r.pages[p // ps] * ps + p % ps for r, p in at]
        self.launch_kernel(
            pool,
            torch.tensor([r.row for r in batch]),
            torch.tensor(pos),
            torch.tensor(kv_slots),
            torch.tensor([r.value(p) for r, p in at]),
            torch.tensor([r.context_sum(p) for r, p in at]),
            self.lora,
            self.bad_lora,
            torch.tensor([slots(r) for r in batch]),
            torch.tensor([r.adapter + 1 for r in batch]),
            kernel=_step,
        )


def _pct(xs: list[int], q: float) -> float:
    """The ``q`` quantile of ``xs`` (nearest rank), 0 for none."""
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] if xs else 0


async def run(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    rng = random.Random(args.seed)
    ps: int = args.page_size
    engine = Engine(device, args.pages + 1, ps, args.slots + 1, args)
    kv = KVPagePool(args.pages + 1, ps)
    lora = KVPagePool(args.slots + 1, 1, name="lora")
    pool = AsyncReqToTokenPool(
        args.rows + 1,
        MAX_LEN,
        device=device,
        kv={"kv": kv, "lora": lora},
        stream=engine.forward if engine.cuda else None,
    )
    per = args.adapters // args.tenants  # a tenant's adapters
    total = args.burst + args.requests
    backlog: list[deque[Request]] = [deque() for _ in range(args.tenants)]
    every: list[Request] = []
    clock = 0.0  # --rate: arrivals over the run; else all at pass 0
    for i in range(total):
        t = 0 if i < args.burst else rng.randrange(args.tenants)  # the burst: tenant 0's
        if i >= args.burst and args.rate:
            clock += rng.expovariate(args.rate)
        req = Request(
            i,
            t,
            0 if t < args.paid else 1,
            t * per + min(int(rng.expovariate(1.0)), per - 1),
            rng.randint(1, MAX_PROMPT),
            rng.randint(1, MAX_OUTPUT),
            int(clock) if i >= args.burst else 0,
        )
        if rng.random() < args.aborts:  # aborted: while queued, at its grant or mid-decode
            req.abort = rng.choice(["queued", "granted", "decode"])
            req.abort_at = rng.randint(0, 3) if req.abort == "queued" else rng.randint(1, 23)
        backlog[t].append(req)
        every.append(req)
    rows_taken = [0] * args.tenants  # each tenant's rows and pages counted (its caps)
    pages_taken = [0] * args.tenants
    cache: dict[int, Adapter] = {}
    queued = [0] * args.adapters  # requests queued for each adapter
    running: list[Request] = []
    granted: list[tuple[Request, GroupGrant]] = []
    to_abort: list[Request] = []  # queued, to be aborted there
    tasks: list[asyncio.Task[None]] = []
    wake = asyncio.Event()
    last_use: dict[tuple[str, int], list[Any]] = {}  # the fences of each row, page, slot's users
    waits: list[list[int]] = [[], []]
    c: Counter[str] = Counter()  # what happened, by name
    passes = steps = 0
    hold: Any = None  # the grant loop held while growth is short

    async def admit(req: Request) -> None:
        want = {"kv": req.counted, "lora": 0 if req.hit else 1}
        grant = await pool.admit(want, priority=req.tier)
        granted.append((req, grant))
        wake.set()

    def submit(req: Request) -> None:
        req.hit = req.adapter in cache
        if req.hit and args.lock_at_queue and not req.locked:
            cache[req.adapter].lock += 1  # the bug: locked while it queues
            req.locked = True
        queued[req.adapter] += 1
        req.queued_at = passes
        req.task = asyncio.ensure_future(admit(req))
        tasks.append(req.task)
        if req.abort == "queued" and not req.admission and req not in to_abort:
            to_abort.append(req)

    def arrive() -> None:
        for t in range(args.tenants):
            q = backlog[t]
            while q and q[0].arrived <= passes:
                n = q[0].first_pages(ps)
                if not args.no_caps and (
                    rows_taken[t] >= args.quota or pages_taken[t] + n > args.page_cap
                ):
                    break  # its caps, counted before it queues (nothing held meanwhile)
                req = q.popleft()
                rows_taken[t] += 1
                pages_taken[t] += n
                req.counted = n
                submit(req)

    def check(kind: str, ids: list[int]) -> None:
        """Each id handed out: its last users' fences must have completed."""
        for i in ids:
            c["checked"] += 1
            if any(not f.query() for f in last_use.pop((kind, i), ())):
                c["early"] += 1

    def let_go(req: Request, how: str) -> None:
        """``req`` leaves: its row and pages freed behind their recorded uses
        (a step in flight too), its adapter unlocked, its tenant's counts
        back; ``how``: "finished", an abort's kind, or "retracted" (it
        queues again at the front of its tenant's backlog, to recompute)."""
        if req in running:
            running.remove(req)
        if req.row >= 0:
            pool.free([req.row])
            fences = [req.fence] if req.fence is not None else []
            for key in [("row", req.row)] + [("kv", p) for p in req.pages]:
                last_use[key] = fences
        else:
            queued[req.adapter] -= 1  # aborted while it queued
        if req.locked:
            cache[req.adapter].lock -= 1
            req.locked = False
        rows_taken[req.tenant] -= 1
        pages_taken[req.tenant] -= req.counted
        req.counted, req.row, req.pages, req.fence = 0, -1, [], None
        if how == "retracted":
            req.launched = req.done
            backlog[req.tenant].appendleft(req)
            return
        req.ended = True
        c["ended"] += 1
        c[how] += 1

    def start(req: Request, grant: Grant | GroupGrant) -> None:
        row = req.row = grant.row
        queued[req.adapter] -= 1
        check("row", [row])
        slot = pool.pages_of(row, host=True, group="lora").tolist()
        check("lora", slot)
        entry = cache.get(req.adapter)
        if entry is not None:
            if slot:  # loaded by another while it queued: give back, unread, unfenced
                lora.free(pool.detach_pages(row, host=True, group="lora"))
                c["surplus"] += 1
        elif not slot:  # evicted while it queued as a hit
            got = pool.extend(row, 1, group="lora")
            if got is None:  # no slot free: nothing ran on the row, free it and requeue
                pool.free([row])
                c["requeues"] += 1
                req.row = -1
                submit(req)
                return
            check("lora", got.tolist())
        if entry is None:
            s = pool.detach_pages(row, host=True, group="lora")
            entry = cache[req.adapter] = Adapter(
                req.adapter, s, engine.load_adapter(int(s[0]), req.adapter)
            )
            c["loads"] += 1
        if not req.locked:
            entry.lock += 1  # at its grant: its steps read the slot
            req.locked = True
        c["grants"] += 1
        c["seq"] += 1
        req.seq, req.admission = c["seq"], req.admission + 1
        waits[req.tier].append(passes - req.queued_at)
        if req.first_wait < 0:
            req.first_wait = passes - req.arrived
        req.pages = pool.pages_of(row, host=True, group="kv").tolist()
        check("kv", req.pages)
        if req.abort == "granted":  # before its first step: its slot maybe loaded, never read
            let_go(req, "grant_aborts")
            return
        n = req.prompt_len + req.done  # (re)computes the tokens it made
        slots = torch.tensor([req.pages[p // ps] * ps + p % ps for p in range(n)])
        engine.write(pool, row, slots, torch.tensor([req.value(p) for p in range(n)]), 0)
        running.append(req)

    def retract(victim: Request, batch: list[Request], why: str) -> int:
        """Retract ``victim`` for recompute; the pages its free will return."""
        if victim in batch:
            batch.remove(victim)
        row = victim.row
        back = len(pool.pages_of(row, group="kv")) - pool.pages_dropped(row, group="kv")
        let_go(victim, "retracted")
        c[why] += 1
        return back

    def grow() -> list[Request]:
        """Each running request's page for the position its next step
        writes: a tenant over its page cap retracts its own newest request;
        a pool short of pages retracts the lowest tier's newest only until
        what their frees will return covers it (docs/api.md, *Retraction*),
        and the short request sits the step out. The batch to launch."""
        nonlocal hold
        batch: list[Request] = []
        coming = retracted = 0  # pages this pass's retractions return, not yet promised
        stalled = False
        for r in list(running):
            if r not in running:
                continue  # retracted this pass
            k = (r.prompt_len + r.launched) // ps + 1 - len(r.pages)
            while k > 0 and not args.no_caps and pages_taken[r.tenant] + k > args.page_cap:
                own = [x for x in running if x.tenant == r.tenant]
                coming += retract(max(own, key=lambda x: x.seq), batch, "cap_retractions")
                retracted += 1
                if r not in running:
                    break
            if r not in running:
                continue
            if k > 0:
                got = pool.extend(r.row, k, group="kv")
                if got is None:
                    stalled = True
                    if hold is None:  # before retracting: the frees go to growth
                        hold = pool.hold_grants()
                    short = k - kv.available_size()
                    while coming < short and r in running:
                        victim = max(running, key=lambda x: (x.tier, x.seq))
                        coming += retract(victim, batch, "pool_retractions")
                        retracted += 1
                    if r in running:
                        coming -= short  # promised to r, which sits this step out
                    continue
                check("kv", got.tolist())
                r.pages += got.tolist()
                r.counted += k
                pages_taken[r.tenant] += k
            batch.append(r)
        if hold is not None and not stalled:
            hold.release()
            hold = None
        c["most"] = max(c["most"], retracted)
        return batch

    def evict_for(short: int, everything: bool = False) -> None:
        """Evict unlocked adapters, those with no request queued first, least
        recently read first, until ``short`` slots are evicted (or all, at
        the end of the run)."""
        idle = [e for e in cache.values() if e.lock == 0 or everything]
        for entry in sorted(idle, key=lambda e: (queued[e.id] > 0, e.last_read))[:short]:
            del cache[entry.id]
            fences = [f for f in (entry.reader, entry.load) if f is not None]
            c["unread"] += entry.reader is None
            if args.evict_unfenced or (args.evict_loaded_unread_unfenced and not entry.reader):
                lora.free(entry.slot)  # the bugs: no fence at all
            else:
                lora.free(entry.slot, fence=fences)  # behind the newest reader and the load
            last_use[("lora", int(entry.slot[0]))] = fences
            c["evictions"] += 1

    prev: tuple[Any, list[tuple[Request, int]]] | None = None
    last_grant = 0
    stalled = ""
    t0 = time.perf_counter()
    try:
        while c["ended"] < total:
            pool.reclaim()
            arrive()
            for req in [r for r in to_abort if passes >= r.queued_at + r.abort_at]:
                to_abort.remove(req)
                if not req.ended and req.task is not None and not req.task.done():
                    req.task.cancel()  # a grant handed over meanwhile comes back
                    let_go(req, "queued_aborts")
            grants, granted[:] = list(granted), []
            for req, grant in grants:
                if not req.ended:
                    start(req, grant)
            if grants:
                last_grant = passes
            batch = grow()
            read = {cache[r.adapter].id: cache[r.adapter] for r in batch}  # (no aborted load)
            loads = [e.load for e in read.values() if not e.waited]
            if loads and not engine.cuda:
                await wait_fence(loads)  # (host: landed before the step in flight reads)
            engine.planned()
            launched = None
            if batch:
                for fence in loads:
                    engine.wait_load(fence)
                engine.launch_step(pool, batch, lambda r: int(cache[r.adapter].slot[0]))
                fence = record_fence(engine.forward)
                pool.record_use([r.row for r in batch], fence)
                for r in batch:
                    r.launched += 1
                    r.fence = cache[r.adapter].reader = fence
                    cache[r.adapter].last_read = steps
                    cache[r.adapter].waited = True
                launched = (fence, [(r, r.admission) for r in batch])
                steps += 1
            if prev is not None:
                await wait_fence(prev[0])
                for r, admission in prev[1]:
                    if r.ended or r.admission != admission or r not in running:
                        continue  # ended, or retracted since: recomputed at re-admission
                    r.done += 1
                    if r.done == r.output_len:
                        let_go(r, "finished")
                    elif r.abort == "decode" and r.done == r.abort_at:
                        let_go(r, "decode_aborts")
            prev = launched
            evict_for(pool.pages_short(group="lora"))
            passes += 1
            locked = sum(e.lock > 0 for e in cache.values())
            if passes - last_grant > args.stall_steps and pool.waiting() and locked == len(cache):
                head = pool.queue_head()
                lacks = head.pages_short if head is not None else 0
                short = lacks if isinstance(lacks, int) else dict(lacks)
                stalled = (
                    f"STALLED after {c['grants']} grants: no grant for {args.stall_steps} steps "
                    f"with {pool.waiting()} requests queued, the head short of {short}, "
                    f"{locked} of {len(cache)} cached adapters locked"
                )
                break
            if batch or grants:
                await asyncio.sleep(0)
                continue
            wake.clear()  # nothing runs, nothing granted: wait for a grant, bounded
            try:
                async with asyncio.timeout(0.002):
                    await wake.wait()
            except TimeoutError:
                pass
        if hold is not None:
            hold.release()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for _, grant in granted:  # (a stall's leftovers)
            pool.free([grant.row])
        for req in running:
            pool.free([req.row])
        engine.planned()
        evict_for(len(cache), everything=True)
        async with asyncio.timeout(30):
            await pool.drain()
        elapsed = time.perf_counter() - t0
    finally:
        await pool.close()
        engine.close()

    bad_reads, bad_lora = int(engine.bad_reads), int(engine.bad_lora)
    st = pool.stats()
    pool.check_invariants()
    empty = st.allocated == st.pending == st.pages_allocated == st.pages_pending == 0
    p50 = [statistics.median(w) if w else 0 for w in waits]
    where = "CUDA streams" if engine.cuda else "HostStream"
    print(
        f"lora_slots: {total} requests of {args.tenants} tenants ({args.paid} paid) on "
        f"{args.adapters} adapters, {args.slots} slots, {args.rows} rows, {args.pages} pages "
        f"of {ps}, {steps} steps, {c['grants']} grants, {c['requeues']} requeues, "
        f"{c['surplus']} surplus slots, {c['loads']} loads, {c['evictions']} evictions, "
        f"{c['checked']} hand-outs checked, {c['early']} early, {c['finished']} finished, "
        f"wait p50 {p50[0]:g} steps paid, {p50[1]:g} free, on {where}"
    )
    print(
        f"lora_slots: {c['cap_retractions']} retractions at a tenant's page cap, "
        f"{c['pool_retractions']} for the pool, {c['most']} most in a step; aborts: "
        f"{c['queued_aborts']} queued, {c['grant_aborts']} at the grant, "
        f"{c['decode_aborts']} mid-decode; {c['unread']} slots evicted loaded, never read"
    )
    if args.burst:
        other, own = ([r.first_wait for r in every if r.tenant == t] for t in (1, 0))
        print(
            f"lora_slots: a burst of {args.burst} from paid tenant 0 at step 0: the other paid "
            f"tenant's {len(other)} requests waited p50 {_pct(other, 0.5):g}, p99 "
            f"{_pct(other, 0.99):g} steps from arrival to grant, tenant 0's p50 "
            f"{_pct(own, 0.5):g}, p99 {_pct(own, 0.99):g} ({'no caps' if args.no_caps else 'caps'})"
        )
    if stalled:
        print(f"lora_slots: {stalled}")
    clean = bad_reads == bad_lora == c["early"] == 0 and not stalled
    if clean and empty and c["ended"] == total:
        print(
            f"lora_slots: OK: 0 corrupted adapter reads, 0 corrupted reads, 0 early hand-outs, "
            f"no stall, every request finished or aborted, pool empty, {elapsed:.2f} s"
        )
        return 0
    print(
        f"lora_slots: FAILED: {bad_lora} corrupted adapter reads, {bad_reads} corrupted reads, "
        f"{c['early']} early hand-outs, {'a' if stalled else 'no'} stall, "
        f"{total - c['ended']} unfinished, {st.allocated} rows and "
        f"{st.pages_allocated} pages still allocated"
    )
    return 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    p.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio")
    p.add_argument("--requests", type=int, default=600, help="requests to run, in all")
    p.add_argument("--tenants", type=int, default=6)
    p.add_argument("--paid", type=int, default=2, help="tenants of the paid tier (priority 0)")
    p.add_argument("--quota", type=int, default=4, help="a tenant's rows (requests) at most")
    p.add_argument("--page-cap", type=int, default=28, help="a tenant's KV pages at most")
    p.add_argument("--no-caps", action="store_true", help="no tenant caps (rows or pages)")
    p.add_argument("--aborts", type=float, default=0.06, help="the fraction of requests aborted")
    p.add_argument("--rate", type=float, default=0.0, help="arrivals a step (0: all at step 0)")
    p.add_argument("--burst", type=int, default=0, help="requests at step 0 from paid tenant 0")
    p.add_argument("--adapters", type=int, default=18, help="adapters, split among the tenants")
    p.add_argument("--slots", type=int, default=6, help="adapter slots (slot 0 excluded)")
    p.add_argument("--rows", type=int, default=12, help="rows in the pool (row 0 excluded)")
    p.add_argument("--pages", type=int, default=64, help="KV pages (page 0 excluded)")
    p.add_argument("--page-size", type=int, default=4, help="token slots a page")
    p.add_argument("--forward-ms", type=float, default=0.0, help="the forward's time per step")
    p.add_argument("--load-ms", type=float, default=0.0, help="an adapter load's time (rank 1)")
    p.add_argument("--load-streams", type=int, default=2, help="streams adapters load on")
    p.add_argument("--stall-steps", type=int, default=200, help="passes with no grant: a stall")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--lock-at-queue", action="store_true", help="lock a hit's adapter while it queues: stalls"
    )
    p.add_argument(
        "--evict-unfenced",
        action="store_true",
        help="evict a slot with no fence (the bug): reloaded while a step reads it",
    )
    p.add_argument(
        "--evict-loaded-unread-unfenced",
        action="store_true",
        help="evict a slot loaded, never read, with no fence (the bug): not behind its load",
    )
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available here")
    if min(args.tenants, args.quota, args.slots, args.rows, args.page_size, args.requests) < 1:
        p.error("--tenants, --quota, --slots, --rows, --page-size, --requests: at least 1")
    if args.load_streams < 1 or args.burst < 0 or not 0 <= args.aborts <= 1:
        p.error("--load-streams at least 1, --burst at least 0, --aborts between 0 and 1")
    if args.burst and (args.paid < 2 or not args.rate):
        p.error("--burst needs two paid tenants (--paid 2 or more) and a --rate")
    if args.adapters < args.tenants or not 0 <= args.paid <= args.tenants:
        p.error("--adapters at least --tenants; --paid between 0 and --tenants")
    if args.stall_steps <= MAX_OUTPUT + 2:
        p.error(f"--stall-steps must be more than {MAX_OUTPUT + 2} (a request's steps)")
    if not all(0 <= x < float("inf") for x in (args.forward_ms, args.load_ms, args.rate)):
        p.error("--forward-ms, --load-ms and --rate must be finite numbers >= 0")
    if args.pages < -(-MAX_LEN // args.page_size):
        p.error(f"--pages must be at least {-(-MAX_LEN // args.page_size)} here")
    if args.page_cap < -(-MAX_LEN // args.page_size):  # it would retract itself for ever
        p.error(f"--page-cap must be at least {-(-MAX_LEN // args.page_size)} here")
    return run_loop(run(args), args.loop)


if __name__ == "__main__":
    sys.exit(main())
