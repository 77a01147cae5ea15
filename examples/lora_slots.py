"""Multi-tenant LoRA adapter slots as a KV group of the pool: a program that checks itself.

docs/api.md's *Several resources: a request's row, pages and an adapter
slot*, as an engine's overlap loop over ``AsyncReqToTokenPool(kv={"kv":
KVPagePool(...), "lora": KVPagePool(slots + 1, 1, name="lora")})``:

* tenants in two tiers (paid: priority 0, free: priority 1), each with a
  quota of requests in flight taken *before* the request queues in the pool
  (a count: nothing is held while it waits); each tenant's requests use its
  own adapters;
* a request queues with ``admit({"kv": n, "lora": 1})`` when its adapter is
  not cached (a miss), ``{"kv": n, "lora": 0}`` when it is (a hit); it
  locks its adapter *at its grant*, after reconciling the cache: a hit
  whose adapter was evicted meanwhile takes a slot with ``extend(row, 1,
  group="lora")`` (never waits; when it answers None the row is freed at
  once, nothing ran on it, and the request requeues as a miss), a miss
  whose adapter another request loaded meanwhile gives its unread slot
  back unfenced (a *surplus* slot);
* a slot is detached to the engine's adapter cache (``detach_pages(row,
  group="lora")``) and the adapter loaded into it on a load stream of its
  own; the forward waits for the load's fence;
* unlocked adapters are evicted for the queue's head, ``pages_short(
  group="lora")`` slots, those with no request queued first, least recently
  read first, behind the newest step that read them *and* the load:
  ``kv_groups["lora"].free(slot, fence=[newest_reader, load])``.

The loop overlaps: a request's last step is known only once its result
is processed, after the next step is launched with the request still in it
(as an engine that samples end-of-sequence on the device); that step reads
the adapter after the request has finished and unlocked it.

Every step checks what it reads: each request's KV context through its row
(``corrupted reads``) and its adapter's slot, which the load wrote with the
adapter's id (``corrupted adapter reads``: another adapter's id). At each
grant the row, KV pages and slot handed out are checked against the fences
of their last users (``early hand-outs``). At the end every request must
have finished and the pool must be empty.

Two flags put the documented bugs back, and the run must then fail (the
second on host streams; on CUDA whether the load overtakes the step in
flight is timing):

* ``--lock-at-queue``: a hit locks its adapter when it queues. A miss at
  the head of the queue waits for a slot while the hits queued behind it
  (FIFO within a priority) hold the locks on every cached adapter: no grant
  for ``--stall-steps`` passes with requests queued and every cached
  adapter locked is reported as STALLED (bounded by passes, never a hang);
* ``--evict-unfenced``: an evicted slot is freed with no fence; it goes to
  the next miss at once, whose load overwrites it while the step in flight
  still reads it: corrupted adapter reads and early hand-outs.

On host streams a step reads only once the scheduler has written the next
step's prompts and its loads have landed (``PagedEngine``'s gate), so a
hand-out too early is caught every time, not by timing. Runs on CUDA streams
when ``torch.cuda.is_available()`` (``--device cpu`` forces host streams).
Exit status: 0 when everything checks out, 1 otherwise. Public API only.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncpool import AsyncReqToTokenPool, Grant, GroupGrant, KVPagePool, record_fence, wait_fence

from _engine import PagedEngine, step

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
    queued_at: int = 0  # the pass it first queued in
    hit: bool = False  # queued as a hit (no slot asked for)
    locked: bool = False  # holds a lock on its adapter
    row: int = -1
    pages: list[int] = field(default_factory=list)  # its KV pages
    done: int = 0  # output tokens whose step has been processed
    launched: int = 0  # steps launched
    fence: Any = None  # the newest step it was in
    finished: bool = False

    def value(self, pos: int) -> int:
        return self.id * MAX_LEN + pos + 1

    def context_sum(self, n: int) -> int:
        return n * self.id * MAX_LEN + n * (n + 1) // 2


@dataclass
class Adapter:
    """A cached adapter: its slot, detached to the engine, and its fences."""

    id: int
    slot: torch.Tensor
    load: Any  # the load's fence
    reader: Any = None  # the newest step that read it
    last_read: int = -1
    lock: int = 0  # requests that read it (granted; queued too with --lock-at-queue)


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
        self.loader: Any = self.new_stream("load")

    def load_adapter(self, slot: int, adapter: int) -> Any:
        """Load ``adapter`` into ``slot`` on the load stream; its fence."""
        if self.cuda:
            with torch.cuda.stream(self.loader):
                torch.cuda._sleep(int(self.load_s * 1.5e9))  # type: ignore[no-untyped-call]
                self.lora[slot : slot + 1].fill_(adapter + 1)
        else:
            self.loader.launch(_host_load, self.lora, slot, adapter + 1, self.load_s)
        return record_fence(self.loader)

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


async def run(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    rng = random.Random(args.seed)
    ps: int = args.page_size
    engine = Engine(device, args.pages + 1, ps, args.slots + 1, args)
    lora = KVPagePool(args.slots + 1, 1, name="lora")
    pool = AsyncReqToTokenPool(
        args.rows + 1,
        MAX_LEN,
        device=device,
        kv={"kv": KVPagePool(args.pages + 1, ps), "lora": lora},
        stream=engine.forward if engine.cuda else None,
    )
    per = args.adapters // args.tenants  # a tenant's adapters
    backlog: list[deque[Request]] = [deque() for _ in range(args.tenants)]
    for i in range(args.requests):
        t = rng.randrange(args.tenants)
        backlog[t].append(
            Request(
                i,
                t,
                0 if t < args.paid else 1,
                t * per + min(int(rng.expovariate(1.0)), per - 1),
                rng.randint(1, MAX_PROMPT),
                rng.randint(1, MAX_OUTPUT),
            )
        )
    in_flight = [0] * args.tenants  # each tenant's quota taken
    cache: dict[int, Adapter] = {}
    queued = [0] * args.adapters  # requests queued for each adapter
    running: list[Request] = []
    granted: list[tuple[Request, GroupGrant]] = []
    tasks: list[asyncio.Task[None]] = []
    wake = asyncio.Event()
    last_use: dict[tuple[str, int], list[Any]] = {}  # the fences of each row, page, slot's users
    waits: list[list[int]] = [[], []]
    c = dict.fromkeys(
        ["grants", "requeues", "surplus", "loads", "evictions", "early", "checked", "finished"], 0
    )
    passes = steps = 0

    async def admit(req: Request) -> None:
        n = -(-(req.prompt_len + req.output_len + 1) // ps)  # and the step past its end
        grant = await pool.admit({"kv": n, "lora": 0 if req.hit else 1}, priority=req.tier)
        granted.append((req, grant))
        wake.set()

    def submit(req: Request) -> None:
        req.hit = req.adapter in cache
        if req.hit and args.lock_at_queue and not req.locked:
            cache[req.adapter].lock += 1  # the bug: locked while it queues
            req.locked = True
        queued[req.adapter] += 1
        tasks.append(asyncio.ensure_future(admit(req)))

    def arrive() -> None:
        for t in range(args.tenants):
            while in_flight[t] < args.quota and backlog[t]:
                in_flight[t] += 1  # the quota, taken before it queues
                req = backlog[t].popleft()
                req.queued_at = passes
                submit(req)

    def check(kind: str, ids: list[int]) -> None:
        """Each id handed out: its last users' fences must have completed."""
        for i in ids:
            c["checked"] += 1
            if any(not f.query() for f in last_use.pop((kind, i), ())):
                c["early"] += 1

    def start(req: Request, grant: Grant | GroupGrant, loads: list[Any]) -> None:
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
            loads.append(entry.load)
            c["loads"] += 1
        if not req.locked:
            entry.lock += 1  # at its grant: its steps read the slot
            req.locked = True
        c["grants"] += 1
        waits[req.tier].append(passes - req.queued_at)
        req.pages = pool.pages_of(row, host=True, group="kv").tolist()
        check("kv", req.pages)
        n = req.prompt_len
        slots = torch.tensor([req.pages[p // ps] * ps + p % ps for p in range(n)])
        engine.write(pool, row, slots, torch.tensor([req.value(p) for p in range(n)]), 0)
        running.append(req)

    def finish(req: Request) -> None:
        running.remove(req)
        req.finished = True
        pool.free([req.row])  # behind its recorded uses: the step in flight too
        for key in [("row", req.row)] + [("kv", p) for p in req.pages]:
            last_use[key] = [req.fence]
        cache[req.adapter].lock -= 1
        req.locked = False
        in_flight[req.tenant] -= 1
        c["finished"] += 1

    def evict_for(short: int, everything: bool = False) -> None:
        """Evict unlocked adapters, those with no request queued first, least
        recently read first, until ``short`` slots are evicted (or all, at
        the end of the run)."""
        idle = [e for e in cache.values() if e.lock == 0 or everything]
        for entry in sorted(idle, key=lambda e: (queued[e.id] > 0, e.last_read))[:short]:
            del cache[entry.id]
            fences = [f for f in (entry.reader, entry.load) if f is not None]
            if args.evict_unfenced:
                lora.free(entry.slot)  # the bug: no fence at all
            else:
                lora.free(entry.slot, fence=fences)  # behind the newest reader and the load
            last_use[("lora", int(entry.slot[0]))] = fences
            c["evictions"] += 1

    prev: tuple[Any, list[Request]] | None = None
    last_grant = 0
    stalled = ""
    t0 = time.perf_counter()
    try:
        while c["finished"] < args.requests:
            pool.reclaim()
            arrive()
            grants, granted[:] = list(granted), []
            loads: list[Any] = []
            for req, grant in grants:
                start(req, grant, loads)
            if grants:
                last_grant = passes
            if loads and not engine.cuda:
                await wait_fence(loads)  # (host: landed before the step in flight reads)
            engine.planned()
            batch = list(running)
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
                launched = (fence, batch)
                steps += 1
            if prev is not None:
                await wait_fence(prev[0])
                for r in prev[1]:
                    if not r.finished:
                        r.done += 1
                        if r.done == r.output_len:
                            finish(r)
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
        f"lora_slots: {args.requests} requests of {args.tenants} tenants ({args.paid} paid) on "
        f"{args.adapters} adapters, {args.slots} slots, {args.rows} rows, {args.pages} pages "
        f"of {ps}, {steps} steps, {c['grants']} grants, {c['requeues']} requeues, "
        f"{c['surplus']} surplus slots, {c['loads']} loads, {c['evictions']} evictions, "
        f"{c['checked']} hand-outs checked, {c['early']} early, {c['finished']} finished, "
        f"wait p50 {p50[0]:g} steps paid, {p50[1]:g} free, on {where}"
    )
    if stalled:
        print(f"lora_slots: {stalled}")
    clean = bad_reads == bad_lora == c["early"] == 0 and not stalled
    if clean and empty and c["finished"] == args.requests:
        print(
            f"lora_slots: OK: 0 corrupted adapter reads, 0 corrupted reads, 0 early hand-outs, "
            f"no stall, every request finished, pool empty, {elapsed:.2f} s"
        )
        return 0
    print(
        f"lora_slots: FAILED: {bad_lora} corrupted adapter reads, {bad_reads} corrupted reads, "
        f"{c['early']} early hand-outs, {'a' if stalled else 'no'} stall, "
        f"{args.requests - c['finished']} unfinished, {st.allocated} rows and "
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
    p.add_argument("--quota", type=int, default=4, help="a tenant's requests in flight at most")
    p.add_argument("--adapters", type=int, default=18, help="adapters, split among the tenants")
    p.add_argument("--slots", type=int, default=6, help="adapter slots (slot 0 excluded)")
    p.add_argument("--rows", type=int, default=12, help="rows in the pool (row 0 excluded)")
    p.add_argument("--pages", type=int, default=160, help="KV pages (page 0 excluded)")
    p.add_argument("--page-size", type=int, default=4, help="token slots a page")
    p.add_argument("--forward-ms", type=float, default=0.0, help="the forward's time per step")
    p.add_argument("--load-ms", type=float, default=0.0, help="an adapter load's time")
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
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available here")
    if min(args.tenants, args.quota, args.slots, args.rows, args.page_size, args.requests) < 1:
        p.error("--tenants, --quota, --slots, --rows, --page-size, --requests: at least 1")
    if args.adapters < args.tenants or not 0 <= args.paid <= args.tenants:
        p.error("--adapters at least --tenants; --paid between 0 and --tenants")
    if args.stall_steps <= MAX_OUTPUT + 2:
        p.error(f"--stall-steps must be more than {MAX_OUTPUT + 2} (a request's steps)")
    if not (0 <= args.forward_ms < float("inf") and 0 <= args.load_ms < float("inf")):
        p.error("--forward-ms and --load-ms must be finite numbers >= 0")
    if args.pages < -(-MAX_LEN // args.page_size):
        p.error(f"--pages must be at least {-(-MAX_LEN // args.page_size)} here")
    if args.loop == "uvloop":
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(run(args))
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
