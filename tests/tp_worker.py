"""One tensor-parallel rank's scheduler loop, for tests/test_tp.py.

Every rank runs the same seeded overlap-scheduling loop (the shared RNG
decides arrivals, lengths, aborts and finishes), on its own HostStream, with
delays drawn from a per-rank RNG: the forward step sleeps, KV transfers land
after a random delay. Each step the ranks all-gather a running hash of every
grant made so far (row and page ids per request, step by step) and stop at
the first step where they differ. Each rank writes a JSON summary.

The loop per step t (overlap: batch t is built while batch t-1 runs):

1. schedule batch t: client aborts (a request whose prompt KV is still
   arriving frees its row and pages behind the transfer fence), decode
   growth (a page when a request crosses a page boundary; when short, the
   newest running request is retracted behind the step in flight),
   admissions (a row and its prompt pages, all or nothing, FIFO);
2. launch batch t on the forward stream, record fence f_t, record_use;
3. process batch t-1's outputs: f_{t-1}.synchronize(); requests that hit
   their length finish (freed behind f_t: batch t already uses them);
   explicit mode: retire(f_{t-1}) and agree(group).

In "auto" mode the pools reclaim when fences happen to be done here: the
control, whose grants must diverge across ranks.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from asyncpool import HostStream, KVPagePool, ReqToTokenPool
from asyncpool.agreement import agree

PAGE = 4


class Transfer:
    """A KV transfer handle: a fence of unknown origin (no stream_key) that
    completes ``delay`` seconds after it starts."""

    __slots__ = ("deadline",)

    def __init__(self, delay: float) -> None:
        self.deadline = time.monotonic() + delay

    def query(self) -> bool:
        return time.monotonic() >= self.deadline

    def synchronize(self) -> None:
        left = self.deadline - time.monotonic()
        if left > 0:
            time.sleep(left)


@dataclass
class Req:
    rid: int
    prompt: int
    out: int
    transfer_steps: int  # steps until its prompt KV has landed
    row: int = 0
    pages: list[int] = field(default_factory=list)
    tokens: int = 0
    transfer: Transfer | None = None
    ready_at: int = 0
    last: Any = None  # fence of the last batch that used it


class RowsAndPages:
    """Rows from a ReqToTokenPool, pages from a KVPagePool: two calls per admission."""

    def __init__(self, c: Config) -> None:
        self.rows = ReqToTokenPool(c.rows, 8, reclaim=c.reclaim)
        self.kv = KVPagePool(c.pages, PAGE, reclaim=c.reclaim)
        self.ops = 0

    def admit(self, pages: int) -> tuple[int, list[int]] | None:
        row = self.rows.alloc(1)
        self.ops += 1
        if row is None:
            return None
        got = self.kv.alloc(pages)
        self.ops += 1
        if got is None:
            self.rows.free(row)  # never touched: free at once in both modes
            self.ops += 1
            return None
        return row[0], got.tolist()

    def extend(self, row: int) -> list[int] | None:
        self.ops += 1
        got = self.kv.alloc(1)
        return None if got is None else got.tolist()

    def use(self, rows: list[int], fence: Any) -> None:
        self.rows.record_use(rows, fence)

    def release(self, req: Req) -> None:
        """The row behind its recorded uses; the pages behind the last batch
        that touched them, or the request's open transfer."""
        self.rows.free([req.row])
        fence = req.transfer if req.transfer is not None else req.last
        self.kv.free(req.pages, fence=fence)
        self.ops += 2

    def retire(self, fence: Any) -> None:
        self.rows.retire(fence)
        self.kv.retire(fence)

    def agree(self, group: Any) -> None:
        # One tensor for both ledgers (what the pool's agree() does with kv=).
        agree(group, [self.rows._ledger, self.kv.ledger])

    def check(self) -> None:
        self.rows.check_invariants()
        self.kv.check_invariants()


class Admission:
    """AsyncReqToTokenPool(kv=KVPagePool(...)): admit(pages=n), extend, free."""

    def __init__(self, c: Config) -> None:
        from asyncpool import AsyncReqToTokenPool

        kv = KVPagePool(c.pages, PAGE, reclaim=c.reclaim)
        self.pool: Any = AsyncReqToTokenPool(c.rows, 8, kv=kv, reclaim=c.reclaim)
        self.ops = 0

    def admit(self, pages: int) -> tuple[int, list[int]] | None:
        self.ops += 1
        g = self.pool.try_admit(pages=pages)
        return None if g is None else (int(g.row), g.pages.tolist())

    def extend(self, row: int) -> list[int] | None:
        self.ops += 1
        got = self.pool.extend(row, 1)
        return None if got is None else got.tolist()

    def use(self, rows: list[int], fence: Any) -> None:
        self.pool.record_use(rows, fence)  # covers the rows' pages too

    def release(self, req: Req) -> None:
        self.pool.free([req.row])  # and its pages, behind the row's uses
        self.ops += 1

    def retire(self, fence: Any) -> None:
        self.pool.retire(fence)

    def agree(self, group: Any) -> None:
        self.pool.agree(group)

    def check(self) -> None:
        self.pool.check_invariants()


#: the memory APIs this checkout has ("admit" once the pool can admit)
APIS = (
    ("rows", "admit")
    if hasattr(__import__("asyncpool").AsyncReqToTokenPool, "admit")
    else ("rows",)
)


@dataclass
class Config:
    steps: int = 500
    rows: int = 40
    pages: int = 240
    reclaim: str = "explicit"
    fwd_delay_s: float = 0.0006  # rank r sleeps up to r * this per step
    transfer_delay_s: float = 0.002  # rank r's transfers land within (r + 1) * this
    seed: int = 1234
    api: str = "rows"  # or "admit" (see APIS)


def _join_group(rank: int, world: int, init_file: str) -> None:
    """This rank's gloo group over a file:// rendezvous; a rank that never
    comes fails the others within a minute, not gloo's 30."""
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )


def _exit_without_finalizing() -> None:
    """End a rank whose outcome is on disk without interpreter finalization.

    About one run in six, a rank aborted there ("terminate called without
    an active exception", SIGABRT, no Python frame on any thread) after its
    work and its output were done: torch's C++ teardown after
    ``destroy_process_group`` (seen before this session's changes too; 0
    in 30 runs with this exit). ``mp.spawn`` reads exit code 0 as success.
    """
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_rank(rank: int, world: int, init_file: str, out_dir: str, cfg: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    c = Config(**cfg)
    _join_group(rank, world, init_file)
    try:
        if c.api == "admit":
            # The pool is loop-affine: run the (synchronous) loop inside one.
            async def main() -> dict[str, Any]:
                return _loop(rank, world, c)

            summary = asyncio.run(main())
        else:
            summary = _loop(rank, world, c)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(summary, f)
    _exit_without_finalizing()


def _loop(rank: int, world: int, c: Config) -> dict[str, Any]:
    shared = random.Random(c.seed)  # same on every rank: the workload
    local = random.Random(c.seed * 1000 + rank)  # this rank's timing
    explicit = c.reclaim == "explicit"
    mem: RowsAndPages | Admission = Admission(c) if c.api == "admit" else RowsAndPages(c)
    stream = HostStream(f"forward-{rank}")
    group = dist.group.WORLD
    waiting: deque[Req] = deque()
    running: list[Req] = []
    h = hashlib.blake2b(digest_size=8)
    next_rid = 0
    prev: Any = None
    diverged_at = -1
    agree_s = 0.0
    mine = torch.zeros(1, dtype=torch.int64)
    gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    step = 0

    def release(req: Req) -> None:
        mem.release(req)
        req.row, req.pages, req.last, req.transfer = 0, [], None, None

    try:
        for step in range(c.steps):
            events: list[tuple[Any, ...]] = []
            # -- 1. arrivals and aborts (shared RNG) ------------------------
            for _ in range(shared.choice((0, 1, 2, 3, 4))):
                waiting.append(
                    Req(
                        next_rid,
                        shared.randint(4, 40),
                        shared.randint(4, 48),
                        shared.choice((0, 0, 1, 2, 3)),
                    )
                )
                next_rid += 1
            if running and shared.random() < 0.2:
                victim = running.pop(shared.randrange(len(running)))
                events.append(("abort", victim.rid, victim.row))
                release(victim)
            # -- decode growth: a page per boundary; retract when short -----
            for req in list(running):
                if req not in running or step < req.ready_at:
                    continue
                if req.tokens + 1 > len(req.pages) * PAGE:
                    got = mem.extend(req.row)
                    while got is None and running[-1] is not req:
                        newest = running.pop()
                        events.append(("retract", newest.rid, newest.row))
                        release(newest)
                        newest.tokens = 0
                        waiting.appendleft(newest)
                        got = mem.extend(req.row)
                    if got is None:
                        continue  # stalls this step
                    req.pages.extend(got)
                    events.append(("extend", req.rid, got))
                req.tokens += 1
            # -- admissions: a row and the prompt's pages, all or nothing ----
            while waiting:
                req = waiting[0]
                got = mem.admit(-(-req.prompt // PAGE))
                if got is None:
                    break
                waiting.popleft()
                req.row, req.pages, req.tokens = got[0], got[1], req.prompt
                req.ready_at = step + req.transfer_steps
                if req.transfer_steps:
                    # Its prompt KV arrives from another engine: the pages
                    # are written by the transfer until it lands.
                    req.transfer = Transfer(local.uniform(0, c.transfer_delay_s * (rank + 1)))
                    mem.use([req.row], req.transfer)
                running.append(req)
                events.append(("admit", req.rid, req.row, req.pages))
            # -- 2. launch batch t ------------------------------------------
            stream.launch(time.sleep, local.uniform(0, c.fwd_delay_s * rank))
            fence = stream.record()
            batch = [r for r in running if step >= r.ready_at]
            if batch:
                mem.use([r.row for r in batch], fence)
                for r in batch:
                    r.last = fence
            # -- 3. process batch t-1 ---------------------------------------
            if prev is not None:
                prev.synchronize()
            for req in list(running):
                if req.transfer is not None and step + 1 >= req.ready_at:
                    req.transfer.synchronize()  # batch t+1 reads its prompt KV
                    req.transfer = None
                if step >= req.ready_at and req.tokens >= req.prompt + req.out:
                    running.remove(req)
                    events.append(("finish", req.rid, req.row))
                    release(req)
            if explicit:
                t0 = time.perf_counter()
                if prev is not None:
                    mem.retire(prev)
                mem.agree(group)
                agree_s += time.perf_counter() - t0
            prev = fence
            h.update(repr((step, events)).encode())
            mine[0] = int.from_bytes(h.digest(), "little", signed=True)
            dist.all_gather(gathered, mine, group=group)
            if len({int(g.item()) for g in gathered}) != 1:
                diverged_at = step
                break
        mem.check()
    finally:
        stream.close()
    return {
        "rank": rank,
        "steps": step + 1,
        "ops": mem.ops,
        "diverged_at": diverged_at,
        "hash": h.hexdigest(),
        "requests": next_rid,
        "agree_s": agree_s,
    }


def disagree_rank(
    rank: int, world: int, init_file: str, out_dir: str, same_count: bool = False
) -> None:
    """Rank 1 makes one more deferred free than the others (``same_count``:
    as many, of another row); every rank's agree() must raise AgreementError
    (and none may hang)."""
    from asyncpool import AgreementError

    _join_group(rank, world, init_file)
    try:
        rows = ReqToTokenPool(8, 4, reclaim="explicit")
        if same_count:
            got = rows.alloc(2)
            assert got is not None
            rows.free([got[rank % 2]], fence=Transfer(10.0))  # row 1 here, row 2 there
        else:
            got = rows.alloc(2 if rank == 1 else 1)
            assert got is not None
            rows.free(got, fence=Transfer(10.0))
            if rank == 1:
                rows.free(rows.alloc(1) or [], fence=Transfer(10.0))
        try:
            rows.agree(dist.group.WORLD)
            outcome = "agreed"
        except AgreementError as exc:
            outcome = f"AgreementError: {exc}"
        rows.check_invariants()
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write(outcome)
    _exit_without_finalizing()


class _Handle:
    """A transfer handle whose state the scenario sets: done, pending, failed
    or interrupt (its query() raises KeyboardInterrupt)."""

    __slots__ = ("state",)

    def __init__(self, state: str) -> None:
        self.state = state

    def query(self) -> bool:
        if self.state == "failed":
            raise RuntimeError("the RDMA peer is gone")
        if self.state == "interrupt":
            raise KeyboardInterrupt
        return self.state == "done"

    def synchronize(self) -> None:
        if self.state == "failed":
            raise RuntimeError("the RDMA peer is gone")


def one_rank_differs_rank(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """Scenarios where one rank sees or holds something the others do not.

    * ``fault``: a transfer fails on rank 1 only (done on rank 0): its row
      and pages are quarantined on every rank at the same agree();
    * ``stuck``: a transfer never completes on rank 1 only: counted overdue
      on every rank, its memory held;
    * ``wide``: more pending batches than the first all-reduce carries, one
      failed and one stuck on rank 1 in each all-reduce: the same verdicts;
    * ``kv``: rank 0's pool has ``kv=``, rank 1's not: every rank raises
      AgreementError (the all-reduced tensor is as long on every rank);
    * ``interrupt``: a transfer's ``query()`` raises ``KeyboardInterrupt``
      on rank 1 only: rank 1 raises it after the collective, rank 0 raises
      AgreementError at the same call (neither waits in an all-reduce
      alone, both leave it), the memory stays pending on both, and a later
      agree() releases it on both;
    * ``drain_split``: a transfer fails on rank 1 only and both ranks
      ``drain()`` (local verdicts: released on rank 0, quarantined on rank
      1), then allocate every free row: the next agree() raises
      AgreementError on every rank (free and pending counts match; the
      quarantined counts do not).

    Writes one JSON object of outcomes per rank.
    """
    import logging

    from asyncpool import AgreementError, AsyncReqToTokenPool

    records: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("asyncpool").addHandler(_Keep(logging.WARNING))
    _join_group(rank, world, init_file)
    out: dict[str, Any] = {}

    def pool(kv: bool = True, fence_timeout: float | None = None) -> AsyncReqToTokenPool:
        pages = KVPagePool(17, PAGE, reclaim="explicit") if kv else None
        return AsyncReqToTokenPool(5, 64, kv=pages, reclaim="explicit", fence_timeout=fence_timeout)

    async def scenarios() -> None:
        for case, state in (("fault", "failed"), ("stuck", "pending")):
            p = pool(fence_timeout=1e-9)
            g = p.try_admit(pages=3)
            assert g is not None
            p.free([g.row], fence=_Handle("done" if rank == 0 else state))
            del records[:]
            rows, pages = p.agree()
            st = p.stats()
            out[case] = {
                "released": [rows, pages],
                "quarantined": [p.quarantined_size(), p.kv.quarantined_size()],  # type: ignore[union-attr]
                "pending": [p.pending_size(), p.kv.pending_size()],  # type: ignore[union-attr]
                "overdue": [st.overdue_fences, st.overdue_rows, st.overdue_pages],
                "log": list(records),
            }
            p.check_invariants()
            await p.close()
        # More batches than ride in the first all-reduce: one fails on
        # rank 1 and one sticks there, both within the first WIDTH and past it.
        from asyncpool.agreement import WIDTH

        n = WIDTH + 6
        wide = ReqToTokenPool(n + 1, PAGE, reclaim="explicit")
        rows = wide.alloc(n)
        assert rows is not None
        odd = {3: "failed", n - 2: "failed", 5: "pending", n - 1: "pending"}
        for i, row in enumerate(rows):
            wide.free([row], fence=_Handle(odd.get(i, "done") if rank == 1 else "done"))
        res = agree(dist.group.WORLD, [wide._ledger], overdue_after=1e-9)
        out["wide"] = {
            "collectives": res.collectives,
            "released": list(res.released),
            "quarantined": res.quarantined,
            "newly_overdue": res.newly_overdue,
            "pending": wide.pending_size(),
        }
        wide.check_invariants()
        # A query() that raises KeyboardInterrupt on rank 1 only.
        p = pool()
        g = p.try_admit(pages=3)
        assert g is not None
        handle = _Handle("done" if rank == 0 else "interrupt")
        p.free([g.row], fence=handle)
        try:
            rows, pages = p.agree()
            first = f"agreed {rows} {pages}"
        except KeyboardInterrupt:
            first = "KeyboardInterrupt"
        except AgreementError as exc:
            first = f"AgreementError: {exc}"
        pending = [p.pending_size(), p.kv.pending_size()]  # type: ignore[union-attr]
        handle.state = "done"
        out["interrupt"] = {"first": first, "pending": pending, "then": list(p.agree())}
        p.check_invariants()
        await p.close()
        # drain() settles by what it sees here: a fence that faulted on rank
        # 1 only splits the ranks, and agree() must say so even once both
        # have allocated what they hold free.
        p = pool()
        g = p.try_admit(pages=3)
        assert g is not None
        p.free([g.row], fence=_Handle("done" if rank == 0 else "failed"))
        await p.drain(timeout=10)
        taken = p.try_alloc(p.available_size())
        kv = p.kv
        assert kv is not None
        held = kv.alloc(kv.available_size())
        try:
            p.agree()
            out["drain_split"] = "agreed"
        except AgreementError as exc:
            out["drain_split"] = f"AgreementError: {exc}"
        if taken:
            p.free(taken)
        if held is not None:
            kv.free(held)
        p.check_invariants()
        await p.close()
        p = pool(kv=rank == 0)
        g = p.try_admit(pages=2) if rank == 0 else None
        row = g.row if g is not None else (await p.alloc(1))[0]
        p.free([row], fence=_Handle("done"))
        try:
            p.agree()
            out["kv"] = "agreed"
        except AgreementError as exc:
            out["kv"] = f"AgreementError: {exc}"
        p.check_invariants()
        await p.close()

    try:
        asyncio.run(scenarios())
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    _exit_without_finalizing()
