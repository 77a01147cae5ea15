"""The decode server of a disaggregated deployment and its transfers: a program that checks itself.

docs/cuda.md's *A transfer handle as a fence*, whole. A decode server's
overlap loop over ``AsyncReqToTokenPool(kv=KVPagePool(...),
fence_timeout=...)`` serves requests whose prompt was computed elsewhere.
Each request's task awaits its admission (a row and the pages of its
context, ``admit``, bounded) and hands the page ids to a transfer engine, a
thread of its own that WRITES the request's KV into them (markers: whose
request, which position), in pieces over the transfer's time, as an RDMA
write from the prefill server would. Its handles (``status()``, ``wait()``)
are wrapped in docs/cuda.md's ``TransferFence`` (``query()``,
``synchronize()``: fences of unknown origin, which the pool polls), one
wrapper per transfer, kept with the request. Once its transfer lands the
request joins the decode batch: each step reads its KV through its row and
pages and checks every position (a *corrupted read*: a page that another
request's late transfer wrote),
writes its next token's KV, grows with ``extend`` (a short pool retracts
the newest request: it is admitted again, its KV sent again) and ends
finished or aborted by its client (``free([row])``, behind the steps). Each
try of a transfer, seeded, is:

* *landed* (most);
* *failed cleanly*: the engine confirms that it stopped writing, so it
  answers ``True``; the request is retried with a new admission (three
  tries, then dropped), its memory freed at once;
* *faulted* (``--faults`` a run, since their memory is quarantined for the
  pool's life): ``query()`` raises and one late write still comes;
* *hung*: never lands. The server gives it up at its deadline; it turns
  overdue after ``fence_timeout``; the operator task has the engine cancel
  it, which confirms it can no longer write, then calls ``force_release``;
* *slow*: stalls, then writes at the usual pace and lands after the
  deadline, given up the same way; still writing when overdue, it is
  cancelled and released as a hung one.

A client may abort while its transfer is in flight. An abort, a give-up or
a fault frees behind the transfer, half of them the whole row
(``pool.free([row], fence=transfer)``: a fault quarantines the row too),
half the pages only (``kv.free(pool.detach_pages(row, host=True),
fence=transfer)``, then ``pool.free([row])``). Checks: 0 corrupted reads;
no page granted while a live transfer may still write it (the engine's
book, at each grant); every row and page back at the end but the
quarantined ones, as many as the faulted transfers held. Two flags put a
bug in, and the run must then fail:

* ``--free-without-transfer-fence``: an abort, a give-up or a fault frees
  without the transfer's fence: the next admission gets pages that the late
  transfer then overwrites;
* ``--force-release-unconfirmed``: the operator force-releases the overdue
  transfers without having the engine cancel them: a slow one still writes.

Runs on :class:`~asyncpool.HostStream` workers without a GPU and on CUDA
streams when ``torch.cuda.is_available()`` (``--device cpu`` forces the host
streams); the transfer engine is a host thread either way (on CUDA it writes
on a stream of its own). ``--loop uvloop`` runs it on uvloop. Every wait is
bounded. Exit status: 0 when everything checks out, 1 otherwise. Public API
only.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import logging
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncpool import AsyncReqToTokenPool, KVPagePool, record_fence, wait_fence

from _engine import DueThread, PagedEngine, run_loop

Chunk = tuple[torch.Tensor, torch.Tensor]  # a piece: its slots, its values

MAX_LEN = 64
MARK = 1 << 20  # the KV of request i's position p: (i + 1) * MARK + p
#: Per try of a transfer, seeded: its kind and probability (the rest land;
#: --faults first tries fault instead, since their memory is quarantined for life).
MIX = {"failed": 0.04, "hung": 0.01, "slow": 0.06}
KINDS = ("landed", "failed", "faulted", "hung", "slow")
TRIES = 3  # a request whose transfer failed this often is dropped
PIECES = 3  # a transfer writes its pages in up to this many pieces


class TransferError(RuntimeError):
    """A transfer's peer state is unknown: it may still write."""


class Transfer:
    """The engine's handle of one write of a request's KV (one a try).

    ``state``: writing, done, failed (stopped writing: the engine confirms
    it), cancelled (by the operator, confirmed), faulted (its peer's state
    unknown: one late write still comes). ``status()`` answers at once,
    ``wait()`` blocks; both from any thread.
    """

    def __init__(self, engine: TransferEngine, id: str, kind: str, pages: list[int]) -> None:
        self.engine, self.id, self.kind, self.pages = engine, id, kind, pages
        self.state = "writing"

    def status(self) -> str:
        with self.engine.cond:
            return self.state

    def wait(self) -> bool:
        """Block until settled (for ever if hung); False if it faulted."""
        with self.engine.cond:
            self.engine.cond.wait_for(lambda: self.state != "writing")
            return self.state != "faulted"


class TransferFence:
    """docs/cuda.md's wrapper: a transfer handle as a fence. A transfer that
    stopped writing (failed, cancelled) answers True; one whose peer state is
    unknown raises, and what waits on it is quarantined."""

    def __init__(self, handle: Transfer) -> None:
        self.handle = handle

    def query(self) -> bool:
        state = self.handle.status()  # non-blocking
        if state == "faulted":
            raise TransferError(f"KV transfer {self.handle.id} failed")
        return state != "writing"

    def synchronize(self) -> None:
        if not self.handle.wait():  # blocking
            raise TransferError(f"KV transfer {self.handle.id} failed")

    def __repr__(self) -> str:  # what the overdue and fault logs print
        return f"TransferFence({self.handle.id}, {self.handle.kind})"


class TransferEngine:
    """A thread that writes each transfer's pieces when due and settles it.

    ``live`` counts, per page, the transfers that may still write it (the
    book each grant is checked against).
    """

    def __init__(self, engine: PagedEngine) -> None:
        self.kv_cache, self.device = engine.kv_cache, engine.device
        self.clock = DueThread(engine.device)
        self.cond = self.clock.cond
        self.live: collections.Counter[int] = collections.Counter()
        self.hung: list[Transfer] = []
        self.pieces = 0  # pieces written

    def start(
        self,
        name: str,
        kind: str,
        pages: list[int],
        slots: torch.Tensor,
        values: torch.Tensor,
        duration_s: float,
        idle_s: float = 0.0,
    ) -> Transfer:
        """Write ``values`` into ``slots`` (the pages') in pieces spread over
        ``duration_s`` past ``idle_s`` (a slow peer's stall), then settle (a
        hung one stops before its last piece; a failed one after its first)."""
        t = Transfer(self, name, kind, pages)
        n = min(PIECES, len(slots))
        chunks = list(zip(slots.tensor_split(n), values.tensor_split(n), strict=True))
        if kind == "failed":
            chunks = chunks[:1]
        now = time.monotonic()
        with self.cond:
            self.live.update(pages)
            for i, chunk in enumerate(chunks[:-1] if kind == "hung" else chunks):
                due = now + idle_s + duration_s * (i + 1) / (n + 1)
                self.clock.at(due, functools.partial(self._piece, t, chunk))
            if kind == "hung":
                self.hung.append(t)
            else:
                end = now + idle_s + duration_s
                self.clock.at(end, functools.partial(self._end, t, chunks))
        return t

    def writing(self, pages: list[int]) -> int:
        """How many of ``pages`` a live transfer may still write."""
        with self.cond:
            return sum(1 for p in pages if self.live[p])

    def cancel(self, t: Transfer) -> bool:
        """The operator's cancel: True once ``t`` can no longer write."""
        with self.cond:
            if t.state == "writing":
                self._settle(t, "cancelled")
            return t.state != "faulted"

    def _settle(self, t: Transfer, state: str) -> None:  # under the lock
        t.state = state
        self.live.subtract(t.pages)
        self.cond.notify_all()

    def _write(self, slots: torch.Tensor, values: torch.Tensor) -> None:  # under the lock
        if self.device.type == "cuda":
            self.kv_cache[slots.to(self.device)] = values.to(self.device)
            torch.cuda.current_stream(self.device).synchronize()  # landed before it says so
        else:
            self.kv_cache[slots] = values
        self.pieces += 1

    def _piece(self, t: Transfer, chunk: Chunk) -> None:  # on the clock's thread, locked
        if t.state == "writing":
            self._write(*chunk)

    def _end(self, t: Transfer, chunks: list[Chunk]) -> None:  # on the clock's thread, locked
        if t.state == "faulted":  # the late write, after query() raised
            for chunk in chunks:
                self._write(*chunk)
            self.live.subtract(t.pages)
        elif t.state == "writing" and t.kind == "faulted":
            t.state = "faulted"
            self.cond.notify_all()
            late = functools.partial(self._end, t, chunks)
            self.clock.at(time.monotonic() + 0.005, late)
        elif t.state == "writing":
            self._settle(t, "failed" if t.kind == "failed" else "done")

    def close(self) -> int:
        """Let every due write happen, then cancel what hangs; the pages a
        live transfer still held then (0 unless one was hung)."""
        self.clock.close()
        with self.cond:
            held = sum(self.live.values())
        for t in self.hung:
            self.cancel(t)
        return held


@dataclass(eq=False)
class Request:
    id: int
    prompt_len: int
    output_len: int
    rng: random.Random  # its own: its tries do not depend on the others' timing
    abort: str  # "", "transfer" or "decode"
    abort_at: float  # mid-transfer: when in the first try (a fraction); mid-decode: the token
    whole_row: bool  # frees behind a transfer: the whole row, or the pages only
    fault: bool  # its first try faults
    done: int = 0  # output tokens processed
    launched: int = 0  # output tokens whose step was launched
    admission: int = 0
    row: int = -1
    pages: list[int] = field(default_factory=list)
    transfer: Any = None  # its transfer's TransferFence
    outcome: asyncio.Future[str] | None = None

    @property
    def length(self) -> int:
        return self.prompt_len + self.done

    def slots(self, lo: int, hi: int, page_size: int) -> torch.Tensor:
        pos = torch.arange(lo, hi)
        return torch.tensor(self.pages)[pos // page_size] * page_size + pos % page_size


def decode(
    kv_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    verified_lens: torch.Tensor,
    bad_reads: torch.Tensor,
    rows: torch.Tensor,
    pos: torch.Tensor,
    slots: torch.Tensor,
    base: torch.Tensor,
) -> None:
    """One decode step: each request reads its KV (positions ``0..pos-1``)
    through its row and checks every position, then writes its next KV."""
    context = kv_cache[req_to_token[rows].long()]
    arange = torch.arange(context.shape[1], device=pos.device)
    wrong = (context != base[:, None] + arange) & (arange < pos[:, None])
    bad_reads += wrong.any(1).sum()
    kv_cache[slots] = base + pos
    req_to_token[rows, pos] = slots.to(req_to_token.dtype)
    verified_lens[rows] = (pos + 1).to(verified_lens.dtype)


async def run(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    rng = random.Random(args.seed)
    ps = args.page_size
    engine = PagedEngine(device, args.pages + 1, ps, args.forward_ms)
    xfer = TransferEngine(engine)
    kv = KVPagePool(args.pages + 1, ps)
    pool = AsyncReqToTokenPool(
        args.rows + 1,
        MAX_LEN,
        device=device,
        kv=kv,
        stream=engine.forward if engine.cuda else None,
        fence_timeout=args.fence_timeout_ms / 1e3,
    )
    loop = asyncio.get_running_loop()
    faults = set(rng.sample(range(args.requests), min(args.faults, args.requests)))
    requests = []
    for i in range(args.requests):
        a = rng.random()
        abort = "transfer" if a < args.abort / 2 else "decode" if a < args.abort else ""
        prompt, out = rng.randint(2, args.max_prompt), rng.randint(4, args.max_output)
        at = rng.uniform(0.05, 0.5) if abort == "transfer" else rng.randrange(1, out)
        r = random.Random(rng.getrandbits(64))
        requests.append(Request(i, prompt, out, r, abort, at, rng.random() < 0.5, i in faults))
    waiting = collections.deque(requests)
    running: list[Request] = []
    kinds: collections.Counter[str] = collections.Counter()  # tries by kind
    ends: collections.Counter[str] = collections.Counter()  # requests by how they ended
    frees: collections.Counter[str] = collections.Counter()  # frees behind a transfer
    early = reads = retractions = retries = 0
    quarantine = [0, 0]  # rows, pages expected quarantined
    overdue_seen: set[Any] = set()  # the fences themselves (ids are reused)
    released: set[Any] = set()
    released_pages = 0
    bug = args.free_without_transfer_fence
    joined = asyncio.Event()

    def give_up(req: Request, how: str) -> None:
        """An abort, the deadline or a fault: free behind the transfer (the
        bug: behind nothing), the whole row or the pages only."""
        ends[how] += 1
        fence = [] if bug else [req.transfer]
        faulted = req.transfer.handle.kind == "faulted" and not bug
        if req.whole_row:
            frees["whole-row"] += 1
            quarantine[0] += faulted
            quarantine[1] += len(req.pages) * faulted
            pool.free([req.row], fence=fence)
            return
        frees["pages-only"] += 1
        quarantine[1] += len(req.pages) * faulted
        kv.free(pool.detach_pages(req.row, host=True), fence=fence)
        pool.free([req.row])

    def transfer_kind(req: Request) -> tuple[str, float, float]:
        """A try's kind, the time it writes and how long it idles first (a
        slow one: landing 0.5-4 fence timeouts past the deadline)."""
        x, kind = req.rng.random(), "landed"
        for name, p in MIX.items():
            if x < p:
                kind = name
                break
            x -= p
        if req.fault and req.admission == 1:
            kind = "faulted"
        ms, idle = args.transfer_ms * req.rng.uniform(0.3, 1.7), 0.0
        if kind == "slow":
            idle = args.deadline_ms + req.rng.uniform(0.5, 4) * args.fence_timeout_ms - ms
        return kind, ms / 1e3, max(idle, 0.0) / 1e3

    async def serve(req: Request) -> None:
        """Admit, transfer, decode (the scheduler's part) until it ends."""
        nonlocal early, retries
        tries = 0
        while True:
            n = req.length
            grant = await pool.admit(
                pages=-(-(n + 1) // ps), priority=-1 if tries or req.done else 0, timeout=30
            )
            req.row, req.admission = grant.row, req.admission + 1
            req.pages = pool.pages_of(grant.row, host=True).tolist()
            early += xfer.writing(req.pages)
            slots = req.slots(0, n, ps)
            engine.write(pool, req.row, slots, torch.zeros(0, dtype=torch.int64), n)  # the row
            kind, duration, idle = transfer_kind(req)
            kinds[kind] += 1
            values = (req.id + 1) * MARK + torch.arange(n)
            handle = xfer.start(
                f"req {req.id} try {req.admission}", kind, req.pages, slots, values, duration, idle
            )
            req.transfer = TransferFence(handle)  # one wrapper per transfer
            limit = loop.time() + args.deadline_ms / 1e3
            aborting = req.abort == "transfer" and req.admission == 1
            abort_at = loop.time() + req.abort_at * duration if aborting else limit
            try:
                async with asyncio.timeout_at(min(limit, abort_at)):
                    await wait_fence(req.transfer)
            except TimeoutError:
                return give_up(req, "aborted mid-transfer" if abort_at < limit else "given up")
            except TransferError:
                return give_up(req, "faulted")
            if handle.status() == "failed":  # stopped writing: free at once, retry
                pool.free([req.row])
                tries += 1
                if tries == TRIES:
                    ends["dropped"] += 1
                    return
                retries += 1
                continue
            req.launched = req.done
            req.outcome = loop.create_future()
            running.append(req)
            joined.set()
            async with asyncio.timeout(60):
                how = await req.outcome
            if how != "retracted":
                ends[how] += 1
                return

    async def operator(stop: asyncio.Event) -> None:
        """For each overdue fence: have the engine cancel it, release it once
        confirmed (``--force-release-unconfirmed``: release it as it is)."""
        nonlocal released_pages
        while not stop.is_set():
            overdue = pool.overdue_fences()
            overdue_seen.update(overdue)
            confirmed = [
                f
                for f in overdue
                if isinstance(f, TransferFence)
                and (args.force_release_unconfirmed or xfer.cancel(f.handle))
            ]
            if confirmed:
                released.update(confirmed)
                released_pages += pool.force_release(confirmed)[1]
            await asyncio.sleep(args.operator_ms / 1e3)

    def end(req: Request, how: str) -> None:
        running.remove(req)
        pool.free([req.row])  # row and pages, behind its recorded uses
        assert req.outcome is not None
        req.outcome.set_result(how)

    stop = asyncio.Event()
    operator_task = asyncio.create_task(operator(stop))
    serving: set[asyncio.Task[None]] = set()
    errors: list[BaseException] = []

    def served(task: asyncio.Task[None]) -> None:
        serving.discard(task)
        joined.set()
        if not task.cancelled() and task.exception() is not None:
            errors.append(task.exception())  # type: ignore[arg-type]

    prev: tuple[Any, list[tuple[Request, int]]] | None = None
    steps = 0
    t0 = time.perf_counter()
    try:
        while waiting or serving or prev is not None:
            while waiting and len(serving) < args.clients:  # clients arrive
                task = asyncio.create_task(serve(waiting.popleft()))
                serving.add(task)
                task.add_done_callback(served)
            # Growth first: a page for each request whose next token starts one.
            # Short: retract the newest request, once a step (its memory comes
            # back behind the step in flight); the growing ones sit this step out.
            sitting_out: set[Request] = set()
            for req in [r for r in running if r.prompt_len + r.launched >= len(r.pages) * ps]:
                got = None if sitting_out or req not in running else pool.extend(req.row, 1)
                if got is None:
                    if not sitting_out:
                        retractions += 1
                        end(running[-1], "retracted")
                    sitting_out.add(req)
                    continue
                req.pages += got.tolist()
                early += xfer.writing(got.tolist())
            engine.planned()  # (host streams: step t-1 may run now)
            batch = [r for r in running if r not in sitting_out]
            launched = None
            if batch:
                pos = torch.tensor([r.prompt_len + r.launched for r in batch])
                slots = torch.tensor(
                    [
                        r.pages[p // ps] * ps + p % ps
                        for r, p in zip(batch, pos.tolist(), strict=True)
                    ]
                )
                base = torch.tensor([(r.id + 1) * MARK for r in batch])
                engine.launch_kernel(
                    pool, torch.tensor([r.row for r in batch]), pos, slots, base, kernel=decode
                )
                fence = record_fence(engine.forward)
                pool.record_use([r.row for r in batch], fence)
                for req in batch:
                    req.launched += 1
                launched = (fence, [(r, r.admission) for r in batch])
                reads += len(batch)
                steps += 1
            if prev is not None:
                await wait_fence(prev[0])
                for req, admission in prev[1]:
                    if req.admission != admission or req not in running:
                        continue  # retracted since: that step's token is discarded
                    req.done += 1
                    if req.done == req.output_len:
                        end(req, "finished")
                    elif req.abort == "decode" and req.done == req.abort_at:
                        end(req, "aborted mid-decode")
            prev = launched
            if errors:
                raise errors[0]
            if prev is None and not running and serving:  # nothing to step: wait for a join
                joined.clear()
                async with asyncio.timeout(60):
                    await joined.wait()
            await asyncio.sleep(0)
        engine.planned()
        async with asyncio.timeout(30):  # the operator releases what hangs
            await pool.drain()
        elapsed = time.perf_counter() - t0
    finally:
        stop.set()
        await operator_task
        for task in list(serving):
            task.cancel()
        await pool.close()
        engine.close()
        held = xfer.close()

    stats = pool.stats()
    pool.check_invariants()
    corrupted = int(engine.bad_reads)
    back = (
        stats.allocated == stats.pending == 0
        and stats.pages_allocated == stats.pages_pending == 0
        and stats.free + stats.quarantined == args.rows
        and stats.pages_free + stats.pages_quarantined == stats.pages_capacity
        and [stats.quarantined, stats.pages_quarantined] == quarantine
        and sum(ends.values()) == len(requests)
    )
    where = "CUDA streams" if engine.cuda else "HostStream"
    print(
        f"disagg_decode: {len(requests)} requests on {args.rows} rows and {args.pages} pages "
        f"of {ps}, {steps} decode steps, {reads} reads, {sum(kinds.values())} transfers: "
        + ", ".join(f"{kinds[k]} {k}" for k in KINDS)
        + f", {xfer.pieces} pieces written, on {where}"
    )
    how = ("finished", "dropped", "aborted mid-transfer", "aborted mid-decode", "given up")
    print(
        f"disagg_decode: requests {', '.join(f'{ends[h]} {h}' for h in (*how, 'faulted'))}, "
        f"{retries} retries, {retractions} retractions, frees behind a transfer: "
        f"{frees['whole-row']} whole-row, {frees['pages-only']} pages-only, "
        f"{len(overdue_seen)} overdue fences seen, {len(released)} fences force released, "
        f"{released_pages} pages force released, {stats.quarantined} rows quarantined, "
        f"{stats.pages_quarantined} pages quarantined"
    )
    if corrupted == early == held == 0 and back:
        print(
            f"disagg_decode: OK: 0 corrupted reads, 0 pages granted while written, every row and "
            f"page back but {stats.quarantined} rows and {stats.pages_quarantined} pages "
            f"quarantined, {elapsed:.2f} s"
        )
        return 0
    print(
        f"disagg_decode: FAILED: {corrupted} corrupted reads, {early} pages granted while "
        f"written, {held} pages held by hung transfers, {stats.allocated} rows and "
        f"{stats.pages_allocated} pages still allocated, {stats.pending} rows and "
        f"{stats.pages_pending} pages pending, {stats.quarantined} rows and "
        f"{stats.pages_quarantined} pages quarantined ({quarantine[0]} and {quarantine[1]} "
        f"expected)"
    )
    return 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--rows", type=int, default=16, help="rows in the pool (row 0 excluded)")
    p.add_argument("--pages", type=int, default=88, help="KV pages (page 0 excluded)")
    p.add_argument("--page-size", type=int, default=4, help="token slots a page")
    p.add_argument("--max-prompt", type=int, default=20, help="tokens of the longest prompt")
    p.add_argument("--max-output", type=int, default=24, help="tokens of the longest output")
    p.add_argument("--clients", type=int, default=24, help="requests served at once")
    p.add_argument("--forward-ms", type=float, default=1.0, help="a decode step's time")
    p.add_argument("--transfer-ms", type=float, default=10.0, help="a transfer's mean time")
    p.add_argument("--deadline-ms", type=float, default=40.0, help="the server's deadline")
    p.add_argument("--fence-timeout-ms", type=float, default=20.0, help="the pool's fence_timeout")
    p.add_argument("--operator-ms", type=float, default=5.0, help="the operator's period")
    p.add_argument("--abort", type=float, default=0.1, help="the share of requests aborted")
    p.add_argument("--faults", type=int, default=3, help="transfers that raise (seeded requests)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio")
    p.add_argument("--verbose", action="store_true", help="show the pool's log lines")
    p.add_argument(
        "--free-without-transfer-fence",
        action="store_true",
        help="free behind no transfer's fence (the bug): its late writes land in reused pages",
    )
    p.add_argument(
        "--force-release-unconfirmed",
        action="store_true",
        help="force-release overdue transfers uncancelled (the bug): slow ones still write",
    )
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available here")
    if min(args.rows, args.page_size, args.clients) < 1 or args.requests < 0:
        p.error("--rows, --page-size and --clients must be at least 1, --requests at least 0")
    if args.max_prompt < 2 or args.max_output < 4 or args.faults < 0:
        p.error("--max-prompt must be at least 2, --max-output 4, --faults 0")
    longest = args.max_prompt + args.max_output + 1  # the step in flight writes one past
    most = -(-longest // args.page_size)
    if longest > MAX_LEN or args.pages < (args.faults + 1) * most:
        p.error(
            f"a request must fit: --max-prompt plus --max-output at most {MAX_LEN - 1}, --pages "
            f"at least {(args.faults + 1) * most} (its pages times --faults + 1)"
        )
    if args.rows <= args.faults:
        p.error("--rows must exceed --faults (a fault may quarantine a row)")
    times = (args.forward_ms, args.transfer_ms, args.deadline_ms)
    if not all(0 <= x < float("inf") for x in times) or not 0 <= args.abort <= 1:
        p.error("--forward-ms, --transfer-ms and --deadline-ms must be finite, --abort in [0, 1]")
    if not (0 < args.fence_timeout_ms < float("inf") and 0 < args.operator_ms < float("inf")):
        p.error("--fence-timeout-ms and --operator-ms must be finite and positive")
    if args.verbose:
        logging.basicConfig(level=logging.INFO)
    else:  # the summary counts what the pool logs
        logging.getLogger("asyncpool").setLevel(logging.CRITICAL)
    return run_loop(run(args), args.loop)


if __name__ == "__main__":
    sys.exit(main())
