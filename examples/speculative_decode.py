"""Speculative decoding's page rollback in an overlap loop: a program that checks itself.

An EAGLE/MTP-style scheduler over ``AsyncReqToTokenPool(kv=KVPagePool(...))``.
A step verifies each request's ``--draft`` drafts: it writes the KV of
positions ``C..C+k``, ``C`` the verified length it reads on the device (the
host cannot know it: the step before is still running). Each step:

1. **growth**: each running request gets pages for the step in flight at its
   best (every draft accepted) plus its own drafts, in ONE ``extend_rows(rows,
   counts)``, all or nothing. On None the scheduler speculates less (if any
   request still does), else retracts its newest; the growing sit it out;
2. **admission**: ``try_admit(pages=k)``, keeping ``--headroom`` pages free;
3. **launch** step t on the forward stream, ONE fence, ``record_use`` the batch;
4. **process** step t-1 while step t runs: how far each request got; finished
   ones are copied out and freed behind the copy. Under memory pressure
   (growth came up short, or under ``--low-water`` free pages) half of those
   that speculate stop: their step in flight's drafts are dropped (its
   verified length capped, on the forward stream), and ONE ``trim_pages(rows,
   keeps)`` gives back the pages past what each row still needs: step t may
   still write drafts into them, so they wait for its fence. (While a request
   speculates, its next drafts reuse the rejected pages: nothing to trim.)

The forward checks what it reads and writes: the KV it attends to must hold
its request's markers (``corrupted reads``), every page it writes must be its
request's (``foreign writes``: the scheduler notes each page's owner as it
hands it out), and finished requests' KV is compared (``corrupted KV``). On
:class:`~asyncpool.HostStream` a step runs only once the scheduler has handed
out the next step's pages (a ``threading.Event``), so a page handed out too
early is caught each time; CUDA streams are used when available (``--device
cpu`` forces host ones), where the scheduler writes on the forward stream,
whose order puts a late write first (docs/cuda.md). ``--no-record-use`` leaves
out ``record_use``: trimmed pages go back at once while the step in flight
still writes them, and the checks must report it. ``--loop uvloop`` runs
it on uvloop. Exit status: 0 when all checks out and the pool ends empty, 1
otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import sys
import threading
import time
from collections.abc import Callable
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
    wait_fence,
)

from _engine import run_loop

MAX_LEN = 128
TALLIES = ["steps", "retractions", "speculation turned off", "pages rolled back"]
TALLIES += ["of them under the step in flight", "pages free at once"]


@dataclass
class Request:
    id: int
    final: int  # prompt + output: done when this many positions are verified
    verified: int  # positions whose KV the processed steps verified (C)
    spec: bool = True  # drafts in its next step
    inflight: int | None = None  # drafts in the step in flight (None: not in it)
    cap: int | None = None  # the verified length that step may reach at most
    admission: int = 0  # bumped at each (re-)admission
    row: int = -1
    pages: list[int] = field(default_factory=list)
    copied: list[Any] = field(default_factory=list)  # its KV, copied out at finish

    def pages_needed(self, drafts: int, ps: int) -> int:
        """Pages for the step in flight at its best, then a step of ``drafts``."""
        top = self.verified + (0 if self.inflight is None else self.inflight + 1)
        top = min(top, self.final, self.cap if self.cap is not None else top)
        return -(-(top + drafts + 1) // ps)


class Engine:
    """The KV cache, the page owners and the forward stream (HostStream or CUDA)."""

    def __init__(self, device: torch.device, pages: int, ps: int, forward_ms: float) -> None:
        self.device, self.cuda, self.ps = device, device.type == "cuda", ps
        self.forward_s = forward_ms / 1e3
        self.kv_cache = torch.zeros(pages * ps, dtype=torch.int64, device=device)
        self.owner = torch.zeros(pages, dtype=torch.int64, device=device)  # request id + 1
        self.bad = torch.zeros(2, dtype=torch.int64, device=device)  # reads, writes
        self.gates: list[threading.Event] = []  # host work launched, not yet let through
        self.forward: Any
        if self.cuda:
            self.forward = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            # The zero fills above are queued on the current stream, which
            # the forward stream does not wait for by itself.
            self.forward.wait_stream(torch.cuda.current_stream(device))
        else:
            self.forward = HostStream("forward")
            self.forward.launch(torch.set_num_threads, 1)

    def host(self, fn: Callable[[], object], ordered: bool = False) -> None:
        """Run ``fn``: on CUDA on the forward stream; on host streams from the
        scheduler's thread, outside the forward's order, unless ``ordered``."""
        if self.cuda:
            with torch.cuda.stream(self.forward):
                fn()
        elif ordered:  # no sooner than the next planned(), as a step
            gate = threading.Event()
            self.gates.append(gate)
            self.forward.launch(_gated, gate, fn)
        else:
            fn()

    def slots(self, pages: list[int]) -> torch.Tensor:
        return (torch.tensor(pages)[:, None] * self.ps + torch.arange(self.ps)).flatten()

    def give(self, pool: AsyncReqToTokenPool, req: Request, pages: list[int]) -> None:
        """Pages handed to ``req``: their owner and its row's slots; at admission
        (it had none) also its lengths and the KV of its verified positions."""
        first, slots, dev = len(req.pages) * self.ps, self.slots(pages), self.device
        req.pages += pages
        rtt, owner, kv_cache, n = pool.req_to_token, self.owner, self.kv_cache, req.verified
        values = torch.arange(n) + req.id * MAX_LEN + 1

        def write() -> None:
            owner[torch.tensor(pages, device=dev)] = req.id + 1
            if first:
                rtt[req.row, first : first + len(slots)] = slots.to(dev, rtt.dtype)
            else:
                kv_cache[slots[:n].to(dev)] = values.to(dev)
                pool.set_req_pool_info(req.row, ReqToTokenPoolInfo(n, len(slots), slots.to(dev)))

        self.host(write)

    def launch_step(
        self, pool: AsyncReqToTokenPool, batch: list[tuple[Request, int, int]], rng: random.Random
    ) -> torch.Tensor:
        """Step t: verify each request's drafts; returns its verified lengths (on the device)."""
        k = max(d for _, _, d in batch)
        # rows, request ids, drafts, how many the verifier accepts, final lengths
        ins = [(r.row, r.id, d, rng.randint(0, d), r.final) for r, _, d in batch]
        tensors = [torch.tensor(x) for x in zip(*ins, strict=True)]
        state = (self.kv_cache, self.owner, pool.req_to_token, pool.verified_lens, self.bad)
        if self.cuda:
            with torch.cuda.stream(self.forward):
                # Made on the forward stream, which writes it (every element):
                # torch.zeros outside this block queues its fill on the
                # default stream, unordered with the step, where it may land
                # after the step's write and zero the verified lengths.
                out = torch.empty(len(batch), dtype=torch.int64, device=self.device)
                moved = [t.to(self.device) for t in tensors]
                torch.cuda._sleep(int(self.forward_s * 1.5e9))  # type: ignore[no-untyped-call]
                _step(k, self.ps, *state, out, *moved)
            return out
        out = torch.empty(len(batch), dtype=torch.int64)
        self.forward.launch(time.sleep, self.forward_s)  # its compute, on the worker
        self.host(lambda: _step(k, self.ps, *state, out, *tensors), ordered=True)
        return out

    def cap(self, pool: AsyncReqToTokenPool, reqs: list[Request]) -> None:
        """Drop the drafts of the step in flight: cap its verified lengths, after it."""
        rows, caps = torch.tensor([r.row for r in reqs]), torch.tensor([r.cap for r in reqs])
        lens, dev = pool.verified_lens, self.device

        def cap() -> None:
            lens[rows.to(dev)] = torch.minimum(lens[rows.to(dev)], caps.to(dev, lens.dtype))

        self.host(cap, ordered=True)

    def copy_out(self, req: Request) -> None:
        """Copy a finished request's KV out, after the step in flight."""
        slots, kv_cache = self.slots(req.pages)[: req.final], self.kv_cache
        dst = torch.empty(len(slots), dtype=torch.int64, pin_memory=self.cuda)
        req.copied.append(dst)
        self.host(lambda: dst.copy_(kv_cache[slots.to(kv_cache.device)], non_blocking=True), True)

    def planned(self) -> None:
        """The next step's pages are handed out: the host steps launched may run now."""
        for gate in self.gates:
            gate.set()
        self.gates.clear()

    def close(self) -> None:
        self.planned()
        self.forward.synchronize()
        if not self.cuda:
            self.forward.close()


def _step(k: int, ps: int, *tensors: torch.Tensor) -> None:
    kv_cache, owner, rtt, lens, bad, out, rows, ids, drafts, accepts, finals = tensors
    c = lens[rows].long()  # verified so far: the previous step's result, on the device
    # Attention: positions 0..c-1 through the row must hold the request's markers.
    ctx = kv_cache[rtt[rows].long()]
    before = torch.arange(ctx.shape[1], device=c.device) < c[:, None]
    want = c * ids * MAX_LEN + c * (c + 1) // 2
    bad[0] += (torch.where(before, ctx, 0).sum(1) != want).sum()
    # Verify: write positions c..c+drafts, into pages that must be the request's.
    j = torch.arange(k + 1, device=c.device)
    pos, mine = c[:, None] + j, j <= drafts[:, None]
    slots = rtt[rows[:, None], pos].long()
    bad[1] += ((owner[slots // ps] != ids[:, None] + 1) & mine).sum()
    kv_cache[slots[mine]] = (ids[:, None] * MAX_LEN + pos + 1)[mine]
    new = torch.minimum(c + torch.minimum(accepts, drafts) + 1, finals)
    lens[rows] = new.to(lens.dtype)
    out.copy_(new)


def _gated(gate: threading.Event, fn: Callable[[], object]) -> None:
    gate.wait()  # the scheduler has handed out the next step's pages
    fn()


async def run(args: argparse.Namespace) -> int:
    device, rng = torch.device(args.device), random.Random(args.seed)
    ps, draft = args.page_size, args.draft
    engine = Engine(device, args.pages + 1, ps, args.forward_ms)
    kv = KVPagePool(args.pages + 1, ps)
    pool = AsyncReqToTokenPool(
        args.rows + 1, MAX_LEN, device=device, kv=kv, stream=engine.forward if engine.cuda else None
    )
    prompts = [(i, rng.randint(8, 40)) for i in range(args.requests)]
    requests = [Request(i, p + rng.randint(8, 40), p) for i, p in prompts]  # outputs 8..40
    waiting = collections.deque(requests)
    running: list[Request] = []
    finished: list[Request] = []
    n: collections.Counter[str] = collections.Counter()

    def drafts(req: Request) -> int:
        return draft if req.spec else 0

    def start(req: Request, grant: Grant) -> None:
        req.row, req.pages, req.admission = grant.row, [], req.admission + 1
        engine.give(pool, req, pool.pages_of(grant.row, host=True).tolist())  # no read-back
        running.append(req)

    prev: tuple[torch.Tensor, list[tuple[Request, int, int]]] | None = None
    pressure, t0 = False, time.perf_counter()
    try:
        while len(finished) < len(requests):
            # 1. Growth: the step in flight at its best plus each one's drafts, one call.
            counts = [max(0, r.pages_needed(drafts(r), ps) - len(r.pages)) for r in running]
            sitting_out: set[int] = set()
            if any(counts):
                got = pool.extend_rows([r.row for r in running], counts)
                if got is None:  # short: speculate less, or retract; the growing sit out
                    sitting_out = {r.id for r, c in zip(running, counts, strict=True) if c}
                    if any(r.spec for r in running):
                        pressure = True
                    else:
                        victim = running.pop()
                        pool.free([victim.row])  # row and pages, behind its recorded uses
                        victim.inflight = victim.cap = None
                        waiting.appendleft(victim)
                        n["retractions"] += 1
                else:
                    flat = got.tolist()
                    for r, c in zip(running, counts, strict=True):
                        if c:
                            engine.give(pool, r, flat[:c])
                            flat = flat[c:]
            # 2. Admission, keeping --headroom pages free for growth.
            pool.reclaim()
            while waiting and not sitting_out:
                need = waiting[0].pages_needed(draft, ps)
                if need + args.headroom > kv.available_size():
                    break
                grant = pool.try_admit(pages=need)
                if grant is None:
                    break
                start(waiting.popleft(), grant)
            engine.planned()  # (host streams: step t-1 may run now)
            if not running and waiting:
                req = waiting.popleft()
                start(req, await pool.admit(pages=req.pages_needed(draft, ps), timeout=30))
            # 3. Launch step t; one fence; record_use ties the batch's rows and pages to it.
            batch = [(r, r.admission, drafts(r)) for r in running if r.id not in sitting_out]
            launched = None
            cut = record_fence(engine.forward)  # step t-1 and what followed it
            if batch:
                out = engine.launch_step(pool, batch, rng)
                fence = record_fence(engine.forward)
                if args.record_use:
                    pool.record_use([r.row for r, _, _ in batch], fence)
                launched = (out, batch)
                n["steps"] += 1
            for r in running:
                r.inflight = None if r.id in sitting_out else drafts(r)
            # 4. Process step t-1 while step t runs.
            await wait_fence(cut)  # step t-1's results are in; the loop runs on
            if prev is not None:
                prev_out, prev_batch = prev
                for (req, admission, _), got_to in zip(prev_batch, prev_out.tolist(), strict=True):
                    if req.admission != admission or req not in running:
                        continue  # retracted since: that step's tokens are discarded
                    if req.cap is not None:  # its drafts were dropped
                        got_to, req.cap = min(got_to, req.cap), None
                    req.verified = got_to
                    if req.verified >= req.final:
                        running.remove(req)
                        engine.copy_out(req)  # launched after step t's fence...
                        pool.free([req.row], after=engine.forward)  # ...so wait for it too
                        finished.append(req)
            # 5. Memory pressure: half of those that speculate stop, and the drafts of
            #    their step in flight are dropped; back on one at a time.
            pool.reclaim()
            spec, off = [r for r in reversed(running) if r.spec], [r for r in running if not r.spec]
            if spec and (pressure or kv.available_size() < args.low_water):
                capped = spec[: max(1, len(spec) // 2)]
                for r in capped:
                    r.spec, r.cap = False, r.verified + 1 if r.inflight is not None else None
                n["speculation turned off"] += len(capped)
                if any(r.cap is not None for r in capped):
                    engine.cap(pool, [r for r in capped if r.cap is not None])
            elif off and kv.available_size() >= args.high_water:  # one back on
                off[0].spec = True
            pressure = False
            # 6. Roll back the pages past what step t and the next may use: ONE call.
            keeps = [r.pages_needed(drafts(r), ps) for r in running]
            if running:
                n["pages free at once"] += pool.trim_pages([r.row for r in running], keeps)
            for r, keep in zip(running, keeps, strict=True):
                if len(r.pages) > keep:
                    n["pages rolled back"] += len(r.pages) - keep
                    if r.inflight is not None:  # step t still writes up to verified + inflight
                        written = (r.verified + r.inflight) // ps + 1
                        n["of them under the step in flight"] += max(0, written - keep)
                    del r.pages[keep:]
            prev = launched
            await asyncio.sleep(0)
        engine.planned()
        async with asyncio.timeout(30):
            await pool.drain()
        elapsed = time.perf_counter() - t0
    finally:
        await pool.close()
        engine.close()

    want = [torch.arange(r.final) + r.id * MAX_LEN + 1 for r in finished]
    bad_kv = sum(not torch.equal(r.copied[-1], w) for r, w in zip(finished, want, strict=True))
    bad_reads, bad_writes = engine.bad.tolist()
    stats = pool.stats()
    pool.check_invariants()
    ok = bad_kv == bad_reads == bad_writes == 0
    ok &= stats.allocated == stats.pending == stats.pages_allocated == stats.pages_pending == 0
    tallies = ", ".join(f"{n[k]} {k}" for k in TALLIES)
    where = "CUDA streams" if engine.cuda else "HostStream"
    print(f"speculative_decode: {len(requests)} requests, {draft} drafts, {tallies}, on {where}")
    left = f"{stats.allocated} rows and {stats.pages_allocated} pages still allocated, "
    left += f"{stats.pending} rows and {stats.pages_pending} pages pending"
    print(
        f"speculative_decode: {'OK' if ok else 'FAILED'}: {bad_kv} corrupted KV, {bad_reads} "
        f"corrupted reads, {bad_writes} foreign writes, "
        + (f"pool empty, {elapsed:.2f} s" if ok else left)
    )
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    p.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio")
    p.add_argument("--requests", type=int, default=120)
    p.add_argument("--rows", type=int, default=8, help="rows in the pool (row 0 excluded)")
    p.add_argument("--pages", type=int, default=64, help="KV pages (page 0 excluded)")
    p.add_argument("--page-size", type=int, default=4, help="token slots a page")
    p.add_argument("--draft", type=int, default=3, help="draft tokens a step verifies")
    p.add_argument("--forward-ms", type=float, default=1.0, help="the forward's time per step")
    p.add_argument("--headroom", type=int, default=4, help="free pages kept at admission")
    p.add_argument("--low-water", type=int, default=3, help="fewer free pages: speculate less")
    p.add_argument("--high-water", type=int, default=16, help="this many free: speculate more")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--no-record-use",
        dest="record_use",
        action="store_false",
        help="leave out record_use (the bug): trimmed pages are reused too soon",
    )
    args = p.parse_args(argv)
    # Refused with exit 2, not a traceback and exit 1 (the status of
    # corruption found).
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available here")
    if args.rows < 1 or min(args.requests, args.headroom, args.low_water, args.high_water) < 0:
        p.error(
            "--rows must be at least 1; --requests, --headroom, --low-water and "
            "--high-water at least 0"
        )
    if not 0 <= args.forward_ms < float("inf"):
        p.error("--forward-ms must be a finite number >= 0")
    if args.page_size < 1 or args.draft < 0:
        p.error("--page-size must be at least 1 and --draft at least 0")
    if args.draft + args.page_size > 48:  # a row holds MAX_LEN slots
        p.error("--draft plus --page-size must be at most 48")
    # The longest request (80 positions) with the step in flight at its best
    # and the next drafts must fit the pool alone.
    least = -(-(81 + args.draft) // args.page_size)
    if args.pages < least:
        p.error(f"--pages must be at least {least} here")
    return run_loop(run(args), args.loop)


if __name__ == "__main__":
    sys.exit(main())
