"""The overlap scheduler of a disaggregated decode engine.

A request's memory is one row of ``req_to_token`` and the KV pages its row
lists. Its prompt's KV is computed elsewhere and arrives by transfer
(:mod:`scheduler_demo.transfer`); the request joins the batch once the
transfer has landed. Admission is atomic by default (``admit(pages=n)``: a
row and the prompt's pages together), or row-first (a row at arrival, pages
when the budget allows, as engines do today). One asyncio task runs the loop;
per iteration::

    launch(step t)                  # on the stream; record_use(rows, fence)
    process(step t-1)               # await its fence, verify, finish/abort -> free
    schedule(step t+1)              # grow (extend_fitting; retract when short), admit,
                                    # join landed transfers, build the batch
    busy CPU work (sched_ms)

so while step t runs, the scheduler frees rows and pages that step t still
writes (requests found finished or aborted in step t-1, retracted requests),
and a client's abort frees a request whose transfer is still on its way.
Fenced, the pool keeps those rows and pages out of circulation until step t
and the transfer have landed (``record_use`` once per step; ``free(rows,
fence=transfer)`` for an abort). With ``unsafe`` they are freed at once, as
the seed and SGLang before #35049 do: the late writes land in the new owners'
rows and pages, and the verification counts them.

Verification: at each step's processing, every token of every request of the
batch must read, through its own row, the slot the host gave it
(``corruptions``: the row was overwritten), and that slot must hold the value
written for (request, position) (``kv_corruptions``: the page was
overwritten). Finished requests are checked once more at the end against the
copies taken when they finished (with a sliding window, of its last window
in the swa group too). Aborted requests are not verified; the requests that
receive their pages are.

``mode="sync"`` runs the same loop without overlap (launch, wait, process).

A hybrid model (``swa_window``): the pool has a "full" and a "swa" KV group;
admission and growth take pages in both, each step also writes and reads
back the window's KV in the swa group (the report's
``swa["kv_corruptions"]``), and the scheduler drops the swa pages that slid
out of the window right after launching each step
(:mod:`scheduler_demo.hybrid`).
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

import numpy as np
import torch

from asyncpool import AsyncReqToTokenPool, GrantHold, KVPagePool

from .config import DemoConfig
from .forward import Forward, Step, fill_gates, wait_fence
from .hybrid import SwaGroup
from .report import Sample
from .transfer import Transfer, TransferEngine
from .workload import RequestSpec

__all__ = ["RETRACTED_PRIORITY", "Scheduler", "kv_value"]

logger = logging.getLogger(__name__)

NEW_PRIORITY = 0
RETRACTED_PRIORITY = -1  # lower is served first

# Request states.
WAITING, ADMITTING, TRANSFER, READY, RUNNING, FINISHED, ABORTED = range(7)
# How a request enters the batch after admission.
DECODE, JOIN, PREFILL = range(3)

_POS_BITS = 20  # a KV value is (rid + 1) << 20 | position: never 0, never another's


def kv_value(rid: int, pos: int) -> int:
    """The value the KV slot of ``(rid, pos)`` holds once written."""
    return ((rid + 1) << _POS_BITS) | pos


class Req:
    """A request's host-side truth: what the device tables and KV must say."""

    __slots__ = (
        "admit_t0",
        "corrupted",
        "entry",
        "epoch",
        "generated",
        "kv_corrupted",
        "kv_len",
        "kv_snapshot",
        "n_pages",
        "row",
        "slots",
        "snapshot",
        "spec",
        "state",
        "swa_from",
        "transfer",
    )

    def __init__(self, spec: RequestSpec) -> None:
        self.spec = spec
        self.state = WAITING
        self.row = -1
        self.epoch = 0  # bumped at each retraction or abort: results of older steps are void
        self.generated = 0  # output tokens processed
        # Positions scheduled: the verified_len expected after the last launched step.
        self.kv_len = 0
        self.entry = JOIN
        # The KV slots of positions [0, kv_len) once finished (while live, they
        # are the scheduler's mirror of the request's row).
        self.slots: np.ndarray | None = None
        self.n_pages = 0
        self.transfer: Transfer | None = None
        self.snapshot: torch.Tensor | None = None  # the row's content when it finished
        # Its KV when it finished: positions [0, kv_len), then (a sliding
        # window) its last window in the swa group from position swa_from on.
        self.kv_snapshot: torch.Tensor | None = None
        self.swa_from = -1
        self.corrupted = False
        self.kv_corrupted = False
        self.admit_t0 = 0.0

    @property
    def base(self) -> int:
        return (self.spec.rid + 1) << _POS_BITS


class Scheduler:
    """Runs one workload to completion on ``pool`` (which owns ``kv``'s pages),
    ``forward`` and ``transfers``."""

    def __init__(
        self,
        cfg: DemoConfig,
        pool: AsyncReqToTokenPool,
        kv: KVPagePool,
        forward: Forward,
        transfers: TransferEngine,
        specs: list[RequestSpec],
        on_complete: Callable[[int], object] | None = None,
    ) -> None:
        self.cfg = cfg
        self.pool = pool
        self.kv = kv
        self.page_capacity = kv.capacity
        self.forward = forward
        self.transfers = transfers
        self.ps = kv.page_size
        max_slots = math.ceil(cfg.max_context_len / self.ps) * self.ps
        self.reqs = [Req(s) for s in specs]
        # The host's truth of req_to_token: mirror[row, pos] is the KV slot of
        # position pos of the request that holds the row.
        self._mirror = np.zeros((cfg.rows + 1, max_slots), dtype=np.int64)
        self.on_complete = on_complete
        self.overlap = cfg.mode == "overlap"
        self.fenced = not cfg.unsafe
        self.atomic = cfg.admission == "atomic"
        self.capacity = cfg.rows
        self._offsets = np.arange(self.ps, dtype=np.int64)
        self._arange = np.arange((cfg.rows + 2) * max_slots, dtype=np.int64)

        self.running: list[Req] = []
        # Waiting for the budget: atomic, with no row; row-first, holding one.
        self.waiting_retracted: collections.deque[Req] = collections.deque()
        self.waiting_new: collections.deque[Req] = collections.deque()
        self.ready_join: collections.deque[Req] = collections.deque()
        self.ready_prefill: collections.deque[Req] = collections.deque()
        self.pages_held = 0  # pages owned by live requests or promised to admissions
        self.step_id = 0
        # Gate mode: aborted transfers held back, with the KV slots they write.
        self._held: list[tuple[Transfer, set[int]]] = []

        # Results.
        self.completed = 0
        self.aborted = 0
        self.aborts_in_transfer = 0
        self.aborts_in_decode = 0
        self.abort_times: list[float] = []
        self.output_tokens = 0
        self.computed_tokens = 0
        self.steps = 0
        self.batch_total = 0
        self.retractions = 0
        self.stalls = 0
        self.corruptions = 0
        self.mismatches = 0
        self.kv_corruptions = 0
        self.kv_mismatches = 0
        self.admit_waits: list[float] = []
        self.timeline: list[Sample] = []
        self.t0 = 0.0
        self.elapsed = 0.0
        self.cpu_s = 0.0  # CPU time of the scheduler's thread (the event loop's)

        self._tasks: set[asyncio.Task[None]] = set()
        # Held while decode growth is short: the pool grants its queued
        # admissions nothing until the stalled requests have grown.
        self._growth_hold: GrantHold | None = None
        self._timers: set[asyncio.TimerHandle] = set()
        self._wake = asyncio.Event()
        self._error: BaseException | None = None
        self._gated: collections.deque[Step] = collections.deque()

        # A hybrid model's sliding-window group: its host record, the
        # requests whose window it found overwritten, its checks that failed.
        self.swa: SwaGroup | None = None
        if cfg.swa_window:
            offset = kv.num_pages * self.ps  # its slots follow the full group's
            self.swa = SwaGroup(cfg.swa_window, self.ps, cfg.rows, max_slots, offset)
        self.swa_corrupted: set[int] = set()
        self.swa_mismatches = 0
        # Gate mode: transfers started that may write a gated step's window.
        self._started: list[Transfer] = []
        self._must_land: set[Transfer] = set()

    @property
    def done(self) -> int:
        return self.completed + self.aborted

    # -- the loop ------------------------------------------------------------

    async def run(self) -> None:
        """Serve every request; return when all have finished or been aborted."""
        self.t0 = time.perf_counter()
        cpu0 = time.thread_time()
        prev: Step | None = None
        cur: Step | None = None
        self._spawn(self._arrivals())
        try:
            while True:
                if self._error is not None:
                    raise self._error
                if cur is not None:
                    self._launch(cur)
                if prev is not None:
                    if prev.gate is not None:
                        # Worst-case lag, deterministic: the step's writes land
                        # only after everything this iteration freed was handed
                        # out again (and its new owners ran).
                        await asyncio.sleep(0)
                        if self.swa is not None:
                            await self._land_into_reads(prev)
                        prev.open_gate()
                    await self._process(prev)
                if cur is not None and not self.overlap:
                    cur.open_gate()
                    await self._process(cur)
                    cur = None
                prev = cur
                # Let admission tasks that were granted rows run.
                await asyncio.sleep(0)
                cur = self._schedule()
                if cur is not None or prev is not None:
                    self._busy(self.cfg.sched_ms / 1e3)
                    self._sample()
                    continue
                if self.done == len(self.reqs):
                    break
                await self._idle()
            self.elapsed = time.perf_counter() - self.t0
            self.cpu_s = time.thread_time() - cpu0
        finally:
            fill_gates([prev, cur, *self._gated])
            for t, _ in self._held:
                self.transfers.release(t)
            self._held.clear()
            self._hold_for_growth(False)  # a run given up mid-stall leaves no hold
            await self._stop_tasks()
        self._final_check()

    async def _idle(self) -> None:
        """Nothing to launch: wait for an arrival, a grant, a landed transfer.

        Fenced, gated transfers are let go first: their pages are held behind
        them, so the scheduler may be waiting for exactly those. (Unsafe,
        they hold nothing back: they stay held until a new owner of their
        pages has been verified, or the end.) Pages behind a fence wake
        nobody here, so the wait is bounded by a short poll.
        """
        if self._held and self.fenced:
            for t, _ in self._held:
                self.transfers.release(t)
            self._held.clear()
        self._sample()
        if not self._wake.is_set():
            try:
                await asyncio.wait_for(self._wake.wait(), 0.002)
            except TimeoutError:
                pass
        self._wake.clear()

    def _busy(self, seconds: float) -> None:
        """The scheduler's own CPU work per step, simulated (holds the GIL)."""
        if seconds <= 0:
            return
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    def _sample(self) -> None:
        free = self.pool.available_size()
        pending = self.pool.pending_size()
        p_free = self.kv.available_size()
        p_pending = self.kv.pending_size()
        p_alloc = self.page_capacity - p_free - p_pending
        self.timeline.append(
            Sample(
                time.perf_counter() - self.t0,
                self.capacity - free - pending,
                pending,
                free,
                self.pool.waiting() + len(self.waiting_new) + len(self.waiting_retracted),
                len(self.running),
                p_alloc,
                p_pending,
                p_free,
                self.retractions,
                self.completed,
                self.aborted,
            )
        )

    # -- arrivals and admission ----------------------------------------------

    async def _arrivals(self) -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        for req in self.reqs:
            delay = start + req.spec.arrival_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            req.admit_t0 = time.perf_counter()
            self._enqueue(req, NEW_PRIORITY)

    def _enqueue(self, req: Req, priority: int) -> None:
        """``req`` wants memory: atomic, it waits for the budget holding
        nothing; row-first, it takes a row now and waits for pages holding it."""
        if self.atomic:
            (self.waiting_retracted if priority < NEW_PRIORITY else self.waiting_new).append(req)
            self._wake.set()
        else:
            self._spawn(self._alloc_row(req, priority))

    async def _alloc_row(self, req: Req, priority: int) -> None:
        req.state = ADMITTING
        req.row = (await self.pool.alloc(1, priority=priority))[0]
        req.state = WAITING
        (self.waiting_retracted if priority < NEW_PRIORITY else self.waiting_new).append(req)
        self._wake.set()

    def _need_pages(self, req: Req) -> int:
        # Positions [0, prompt + generated] for the first step.
        return (req.spec.prompt_len + req.generated) // self.ps + 1

    def _swa_admission(self, req: Req) -> tuple[int, int]:
        """The swa group's first page and count for ``req``'s admission."""
        assert self.swa is not None
        # The first step's last position: the joining token, or the last
        # one a prefill recomputes.
        q0 = req.spec.prompt_len + max(req.generated - 1, 0)
        return self.swa.admission(q0, self._need_pages(req))

    def _counts(self, req: Req, n: int) -> Any:
        """What admission asks the pool for: ``n`` pages, or with a sliding
        window ``{"full": n, "swa": m}``."""
        if self.swa is None:
            return n
        return {"full": n, "swa": self._swa_admission(req)[1]}

    def _admit_more(self) -> None:
        """Admit waiting requests while the pages held stay under the budget,
        keeping a page per ``page_size`` running requests for decode growth."""
        limit = self.cfg.admit_watermark * self.page_capacity
        reserve = len(self.running) // self.ps + 1
        for queue, priority in (
            (self.waiting_retracted, RETRACTED_PRIORITY),
            (self.waiting_new, NEW_PRIORITY),
        ):
            while queue:
                req = queue[0]
                n = self._need_pages(req)
                if self.pages_held and self.pages_held + n + reserve > limit:
                    return
                if self.atomic:
                    queue.popleft()
                    self.pages_held += n
                    grant = self.pool.try_admit(pages=self._counts(req, n))
                    if grant is not None:
                        req.row = grant.row
                        self._granted(req, grant.pages)
                    else:  # waits in the pool's queue for a fence to release memory
                        req.state = ADMITTING
                        self._spawn(self._admit(req, n, priority))
                    continue
                pages = self.pool.extend(req.row, self._counts(req, n))
                if pages is None:
                    return  # pages still behind a fence: next iteration
                queue.popleft()
                self.pages_held += n
                self._granted(req, pages)
            # FIFO: the head that does not fit blocks those behind it.

    async def _admit(self, req: Req, n: int, priority: int) -> None:
        grant = await self.pool.admit(pages=self._counts(req, n), priority=priority)
        req.row = grant.row
        self._granted(req, grant.pages)

    def _hold_for_growth(self, stalled: bool) -> None:
        """Growth goes first: hold the pool's grant loop while requests stall.

        The pool grants freed pages to its queued admissions as soon as their
        fence completes, before a stalled request can ``extend`` again; a
        victim retracted for that request would take its pages straight back
        (livelock). Held, the victims' pages stay free for the stalled
        requests, across the steps until their fence completes; the queued
        admissions keep their places and are granted once growth has what
        it needs.
        """
        if stalled:
            if self._growth_hold is None:
                self._growth_hold = self.pool.hold_grants()
        elif self._growth_hold is not None:
            self._growth_hold.release()
            self._growth_hold = None

    def _granted(self, req: Req, pages: torch.Tensor | dict[str, torch.Tensor]) -> None:
        """``req`` holds its row and first pages: start its transfer, or queue
        its prefill (a retracted request recomputes its KV locally, unless
        it was retracted before producing its first token: nothing of it was
        computed here, so its prompt's KV is transferred again)."""
        self.admit_waits.append(time.perf_counter() - req.admit_t0)
        if isinstance(pages, dict):  # the full and swa groups
            assert self.swa is not None
            base, _ = self._swa_admission(req)
            self.swa.start(req.row, base, pages["swa"].tolist())
            pages = pages["full"]
        self._add_pages(req, pages)
        if req.generated == 0:
            req.entry = JOIN
            self._start_transfer(req)
        else:
            req.entry = PREFILL
            req.state = READY
            self.ready_prefill.append(req)
        self._wake.set()

    def _add_pages(self, req: Req, pages: torch.Tensor) -> None:
        self._add_page_ids(req, pages.tolist())

    def _add_page_ids(self, req: Req, ids: list[int]) -> None:
        ps = self.ps
        at = req.n_pages * ps
        for p in ids:
            self._mirror[req.row, at : at + ps] = p * ps + self._offsets
            at += ps
        req.n_pages += len(ids)

    def _start_transfer(self, req: Req) -> None:
        n = req.spec.prompt_len
        slots = torch.from_numpy(self._mirror[req.row, :n].copy())
        values = torch.arange(req.base, req.base + n, dtype=torch.int64)
        if self.swa is not None:  # and the window of the first step, in the swa group
            lo = self.swa.lo(n)
            swa_slots = torch.from_numpy(self.swa.slots(req.row, lo, n).copy())
            slots = torch.cat([slots, swa_slots])
            values = torch.cat([values, values[lo:]])
        t = self.transfers.start(req.spec.rid, slots, values)
        if self.swa is not None and self.cfg.gate:
            self._started.append(t)
        req.transfer = t
        req.state = TRANSFER
        self._spawn(self._await_transfer(req, t))
        if req.spec.abort == "transfer":
            self._call_later(req.spec.abort_at * t.duration_s, self._client_abort, req, t)

    def _call_later(self, delay: float, callback: Callable[..., None], *args: Any) -> None:
        """``callback(*args)`` after ``delay`` seconds, cancelled by
        :meth:`_stop_tasks` if still pending; a fired timer leaves ``_timers``."""
        timer: asyncio.TimerHandle

        def fire() -> None:
            self._timers.discard(timer)
            callback(*args)

        timer = asyncio.get_running_loop().call_later(delay, fire)
        self._timers.add(timer)

    async def _await_transfer(self, req: Req, t: Transfer) -> None:
        await wait_fence(t)
        if req.state == TRANSFER and req.transfer is t:
            req.state = READY
            self.ready_join.append(req)
            self._wake.set()

    def _client_abort(self, req: Req, t: Transfer) -> None:
        """The client of ``req`` went away (a timer, while its KV was on its way)."""
        if req.transfer is not t or req.state not in (TRANSFER, READY, RUNNING):
            return
        if req.state == RUNNING:
            self._abort(req, "decode")  # the timer fired late: it was decoding by then
            return
        in_transfer = req.state == TRANSFER
        if req.state == READY:
            # Landed, not joined yet (or, the timer being late, retracted since
            # and waiting for its prefill).
            (self.ready_join if req in self.ready_join else self.ready_prefill).remove(req)
        if in_transfer and self.cfg.gate and t not in self._must_land and self.transfers.hold(t):
            # Deterministic worst case: it lands only after a new owner of
            # one of its pages has written it (or when the scheduler idles).
            self._held.append((t, set(t.slots.tolist())))
        self._abort(req, "transfer" if in_transfer else "decode", fence=t)

    def _abort(self, req: Req, phase: str, fence: Any = None) -> None:
        """Free an aborted request's row and pages behind the step in flight
        (its recorded use) and ``fence`` (its transfer); unsafe, at once."""
        if req.state == RUNNING:
            self.running.remove(req)
        self.pages_held -= req.n_pages
        self.pool.free([req.row], fence=fence if self.fenced else None)
        req.state = ABORTED
        req.epoch += 1
        req.row = -1
        self.aborted += 1
        if phase == "transfer":
            self.aborts_in_transfer += 1
        else:
            self.aborts_in_decode += 1
        self.abort_times.append(time.perf_counter() - self.t0)
        if self.on_complete is not None:
            self.on_complete(1)
        self._wake.set()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and self._error is None:
            self._error = task.exception()
            self._wake.set()

    async def _stop_tasks(self) -> None:
        for timer in self._timers:
            timer.cancel()
        self._timers.clear()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    # -- scheduling ----------------------------------------------------------

    def _schedule(self) -> Step | None:
        """Build the next batch: grow (retract when short), admit, join."""
        stalled = self._grow()
        if not stalled:
            self._hold_for_growth(False)
            self._admit_more()
        joined: list[Req] = list(self.ready_join)
        self.ready_join.clear()
        prefill = 0
        while self.ready_prefill:
            req = self.ready_prefill[0]
            k = req.spec.prompt_len + req.generated
            if prefill and prefill + k > self.cfg.max_prefill_tokens:
                break
            self.ready_prefill.popleft()
            joined.append(req)
            prefill += k
        for req in joined:
            req.state = RUNNING
            self.running.append(req)
        batch = [r for r in self.running if r not in stalled] if stalled else self.running
        if not batch:
            return None
        return self._build(batch)

    def _grow(self) -> set[Req]:
        """Give every decoding request the page its next token needs.

        One ``extend_fitting`` for the step: it never waits, and grows the
        requests in running order as far as the free pages go; those it
        cannot serve sit this step out, and requests are retracted until
        their pages cover those stalled. A victim's pages are behind the step
        in flight (fenced), so they serve the stalled requests from the next
        step on.
        """
        ps = self.ps
        growing = [
            req for req in self.running if req.entry == DECODE and req.kv_len >= req.n_pages * ps
        ]
        if not growing:
            return set()
        rows = [req.row for req in growing]
        if self.swa is None:
            m, pages = self.pool.extend_fitting(rows, 1)
        else:  # both groups cross the boundary at the same position
            m, grown = self.pool.extend_fitting(rows, {"full": 1, "swa": 1})
            pages = grown["full"]
            for req, page in zip(growing, grown["swa"][:, 0].tolist(), strict=False):
                self.swa.add(req.row, [page])
        self.pages_held += m
        for req, page in zip(growing, pages[:, 0].tolist(), strict=False):
            self._add_page_ids(req, [page])
        stalled = growing[m:]
        if not stalled:
            return set()
        self._hold_for_growth(True)  # before a retraction frees anything
        self.stalls += len(stalled)
        short = len(stalled)
        while short > 0 and len(self.running) > 1:
            victim = self._victim()
            short -= victim.n_pages
            if victim in stalled:
                stalled.remove(victim)
                short -= 1
            self._retract(victim)
        return set(stalled)

    def _victim(self) -> Req:
        # Like sglang's retract_decode: the fewest output tokens, then the
        # longest prompt (the least progress lost, the most KV given back).
        return min(self.running, key=lambda r: (r.generated, -r.spec.prompt_len))

    def _retract(self, req: Req) -> None:
        self.running.remove(req)
        self.pages_held -= req.n_pages
        row = req.row
        # The row and pages are in the step in flight; the pool defers them
        # behind that step's recorded use (or, unsafe, hands them out at once).
        self.pool.free([row])
        req.row = -1
        req.kv_len = 0
        req.n_pages = 0
        req.epoch += 1
        req.state = WAITING
        req.admit_t0 = time.perf_counter()
        self.retractions += 1
        self._enqueue(req, RETRACTED_PRIORITY)

    def _build(self, batch: list[Req]) -> Step:
        """The step's inputs, vectorised: one Python pass collects a few
        scalars per request, numpy does the per-token work."""
        n = len(batch)
        entries: list[tuple[Any, int, int]] = []
        rows: list[int] = [0] * n
        starts: list[int] = [0] * n
        ks: list[int] = [0] * n
        kv_froms: list[int] = [0] * n
        bases: list[int] = [0] * n
        for i, req in enumerate(batch):
            entry = req.entry
            if entry == DECODE:
                start, k, kv_from = req.kv_len, 1, req.kv_len
            elif entry == JOIN:
                start, k, kv_from = 0, req.spec.prompt_len + 1, req.spec.prompt_len
            else:
                start, k, kv_from = 0, req.spec.prompt_len + req.generated, 0
            req.entry = DECODE
            end = start + k
            req.kv_len = end
            rows[i] = req.row
            starts[i] = start
            ks[i] = k
            kv_froms[i] = kv_from
            bases[i] = (req.spec.rid + 1) << _POS_BITS
            entries.append((req, req.epoch, end))
        ar = self._arange
        i64 = np.int64
        rows_a = np.array(rows, dtype=i64)
        starts_a = np.array(starts, dtype=i64)
        ks_a = np.array(ks, dtype=i64)
        bases_a = np.array(bases, dtype=i64)
        # New req_to_token entries: one per position [start, start + k) per request.
        tokens = int(ks_a.sum())
        row_idx = np.repeat(rows_a, ks_a)
        offs = ar[:tokens] - np.repeat(np.cumsum(ks_a) - ks_a, ks_a)
        pos = np.repeat(starts_a, ks_a) + offs
        slots = self._mirror[row_idx, pos]
        # Of those, the ones whose KV this step computes.
        kv_mask = pos >= np.repeat(np.array(kv_froms, dtype=i64), ks_a)
        kv_idx = np.flatnonzero(kv_mask)
        kv_vals = np.repeat(bases_a, ks_a)[kv_idx] + pos[kv_idx]
        # Verification: every position [0, end) of every request.
        ends_a = starts_a + ks_a
        total = int(ends_a.sum())
        v_cols = ar[:total] - np.repeat(np.cumsum(ends_a) - ends_a, ends_a)
        v_rows = np.repeat(rows_a, ends_a)
        v_slots = self._mirror[v_rows, v_cols]
        v_vals = np.repeat(bases_a, ends_a) + v_cols
        swa = None
        if self.swa is not None:
            kv_from_a = np.array(kv_froms, dtype=i64)
            swa = self.swa.build(rows_a, ends_a, kv_from_a, bases_a)
        self.step_id += 1
        gate = threading.Event() if (self.cfg.gate and self.overlap) else None
        return Step(
            self.step_id,
            entries,
            rows,
            ks,
            row_idx,
            offs,
            slots,
            kv_idx,
            kv_vals,
            (v_rows, v_cols, v_slots, v_vals),
            gate,
            swa,
        )

    def _launch(self, step: Step) -> None:
        fence = self.forward.launch(step)
        if self.fenced:
            # One fence per step, covering every row (and its pages) the step touches.
            self.pool.record_use(step.rows, fence)
        if self.swa is not None:
            # The pages no later step reads go back, behind the use just
            # recorded (unsafe: none was, so at once).
            self.swa.drop(self.pool, step.rows, step.exp_lens)
        if step.gate is not None:
            self._gated.append(step)
        self.steps += 1
        self.batch_total += len(step.rows)
        self.computed_tokens += step.kv_tokens

    # -- results -------------------------------------------------------------

    async def _process(self, step: Step) -> None:
        await wait_fence(step.fence)
        if self._gated and self._gated[0] is step:
            self._gated.popleft()
        self._verify(step)
        for req, epoch, length in step.entries:
            if req.epoch != epoch or req.state != RUNNING:
                continue  # retracted, finished or aborted after this step was launched
            req.generated += 1
            self.output_tokens += 1
            if req.generated >= req.spec.output_len:
                self._finish(req, length)
            elif req.spec.abort == "decode" and req.generated >= req.spec.abort_after:
                self._abort(req, "decode")
        if self._held:
            await self._land_held(step)

    async def _land_into_reads(self, step: Step) -> None:
        """Gate mode with a sliding window: before the gated ``step`` reads its
        windows, land every transfer started since that writes a slot they
        read (the worst lag: the forward slower than the transfers). Fenced,
        there is none: the pages a step still reads are behind its fence;
        unsafe, a page dropped after its launch can already have a new owner,
        whose prompt KV lands over what the step reads."""
        assert step.swa is not None
        self._started = [t for t in self._started if not t.query()]
        if not self._started:
            return
        reads = set(step.swa.v_slots.tolist())
        for t in self._started:
            if reads.isdisjoint(t.slots.tolist()):
                continue
            self._must_land.add(t)  # an abort may no longer hold it back
            for item in [item for item in self._held if item[0] is t]:
                self._held.remove(item)
            self.transfers.release(t)
            await wait_fence(t)
            self._must_land.discard(t)

    async def _land_held(self, step: Step) -> None:
        """Gate mode: let a held (aborted) transfer land once a new owner has
        written, and had verified, one of the slots it writes; wait until it
        has landed, so the owner's next verification sees it."""
        owners = [
            (r, end) for r, epoch, end in step.entries if r.epoch == epoch and r.state == RUNNING
        ]
        owned = [self._owned_slots(r, end) for r, end in owners]
        for item in list(self._held):
            t, slots = item
            if any(slots.intersection(o) for o in owned):
                self._held.remove(item)
                self.transfers.release(t)
                await wait_fence(t)

    def _owned_slots(self, req: Req, end: int) -> list[int]:
        """The KV slots a running request's next verification reads: its row's
        positions ``[0, end)`` and, with a sliding window, the window's."""
        slots: list[int] = self._mirror[req.row, :end].tolist()
        if self.swa is not None:
            slots += self.swa.live_window(req.row, end).tolist()
        return slots

    def _verify(self, step: Step) -> None:
        """Compare the step's view of the rows and the KV with the host's truth.

        The clean case is three vectorised compares. Mismatches are counted
        per (request, step); details are built only when debug logging is on,
        so a run full of corruption is not slowed down by reporting it.
        """
        out_lens, out_row, out_kv = step.out_lens, step.out_row, step.out_kv
        assert out_lens is not None and out_row is not None and out_kv is not None
        if step.swa is not None:
            self._verify_swa(step)
        exp_lens = torch.tensor(step.exp_lens, dtype=out_lens.dtype)
        v_slots = torch.from_numpy(step.v_slots)
        v_vals = torch.from_numpy(step.v_vals)
        lens_bad = not torch.equal(out_lens, exp_lens)
        row_bad = not torch.equal(out_row.long(), v_slots)
        kv_bad = not torch.equal(out_kv, v_vals)
        if not (lens_bad or row_bad or kv_bad):
            return
        ends = list(itertools.accumulate(step.exp_lens))
        bad: set[int] = set()
        if lens_bad:
            bad.update(torch.nonzero(out_lens != exp_lens).flatten().tolist())
        if row_bad:
            bad.update(_entries_read_wrong(out_row.long(), v_slots, ends))
        kv_bad_entries = _entries_read_wrong(out_kv, v_vals, ends) if kv_bad else set()
        debug = logger.isEnabledFor(logging.DEBUG)
        for i in sorted(bad | kv_bad_entries):
            req, epoch, _ = step.entries[i]
            if req.epoch != epoch or req.state != RUNNING:
                continue  # the host no longer expects anything of that row
            if i in bad:
                self._corrupt(req)
            if i in kv_bad_entries:
                self._kv_corrupt(req)
            if debug:
                logger.debug(
                    "corruption: request %d, step %d, row %d: %s",
                    req.spec.rid,
                    step.step_id,
                    step.rows[i],
                    _describe(step, i, ends, out_lens, out_row, out_kv),
                )

    def _verify_swa(self, step: Step) -> None:
        """The window each request of ``step`` read back from the swa group."""
        assert step.swa is not None and step.out_swa is not None
        expected = torch.from_numpy(step.swa.v_vals)
        if torch.equal(step.out_swa, expected):
            return
        ends = list(itertools.accumulate(step.swa.v_counts.tolist()))
        for i in sorted(_entries_read_wrong(step.out_swa, expected, ends)):
            req, epoch, _ = step.entries[i]
            if req.epoch != epoch or req.state != RUNNING:
                continue
            self.swa_mismatches += 1
            self.swa_corrupted.add(req.spec.rid)
            logger.debug("swa kv corruption: request %d, step %d", req.spec.rid, step.step_id)

    def _corrupt(self, req: Req) -> None:
        self.mismatches += 1
        if not req.corrupted:
            req.corrupted = True
            self.corruptions += 1

    def _kv_corrupt(self, req: Req) -> None:
        self.kv_mismatches += 1
        if not req.kv_corrupted:
            req.kv_corrupted = True
            self.kv_corruptions += 1

    def _finish(self, req: Req, length: int) -> None:
        # Columns [0, length) are the request's content; a step in flight may
        # still write column `length` (its extra, unneeded token).
        req.slots = self._mirror[req.row, :length].copy()
        kv_slots = req.slots
        if self.swa is not None:
            # And its last window's swa slots that its pages still hold: the
            # same read, so its swa pages are freed behind it too.
            req.swa_from, swa_slots = self.swa.final_window(req.row, length)
            kv_slots = np.concatenate([kv_slots, swa_slots])
        # The final check's copies of the row and its KV, queued on the
        # forward stream: a read of the memory, so the row and its pages are
        # freed behind it as behind the steps' writes (unsafe: at once).
        req.snapshot, req.kv_snapshot, read = self.forward.snapshot(
            req.row, length, torch.from_numpy(kv_slots)
        )
        req.kv_len = length
        self.running.remove(req)
        self.pages_held -= req.n_pages
        req.state = FINISHED
        self.pool.free([req.row], fence=read if self.fenced else None)
        self.completed += 1
        if self.on_complete is not None:
            self.on_complete(1)

    def _final_check(self) -> None:
        """Every finished request's row and KV (with a sliding window, its
        last window's swa KV too), as they were when it finished."""
        self.forward.synchronize()
        for req in self.reqs:
            if req.snapshot is None or req.kv_snapshot is None or req.slots is None:
                continue
            n = req.kv_len
            expected = torch.from_numpy(req.slots.astype(np.int32))
            found = req.snapshot.cpu()
            if not torch.equal(found, expected):
                self._corrupt(req)
                where = torch.nonzero(found != expected).flatten()
                logger.debug(
                    "corruption: request %d, final check of its row: %d column(s) differ, "
                    "first col %d",
                    req.spec.rid,
                    where.numel(),
                    int(where[0]),
                )
            values = torch.arange(req.base, req.base + n, dtype=torch.int64)
            kv_found = req.kv_snapshot.cpu()
            if not torch.equal(kv_found[:n], values):
                self._kv_corrupt(req)
                logger.debug("kv corruption: request %d, final check of its KV", req.spec.rid)
            if req.swa_from >= 0 and not torch.equal(kv_found[n:], values[req.swa_from :]):
                self.swa_mismatches += 1
                self.swa_corrupted.add(req.spec.rid)
                logger.debug(
                    "swa kv corruption: request %d, final check of its window", req.spec.rid
                )


def _entries_read_wrong(found: torch.Tensor, expected: torch.Tensor, ends: list[int]) -> set[int]:
    """The batch entries (indexes into a step's ``entries``) with a token
    whose ``found`` value is not the ``expected`` one; entry ``i`` holds the
    tokens from ``ends[i - 1]`` (0 for the first) up to ``ends[i]``."""
    tokens = torch.nonzero(found != expected).flatten().tolist()
    return {bisect.bisect_right(ends, t) for t in tokens}


def _describe(
    step: Step,
    i: int,
    ends: list[int],
    out_lens: torch.Tensor,
    out_row: torch.Tensor,
    out_kv: torch.Tensor,
) -> str:
    """What entry ``i`` of ``step`` should have read, and what it read."""
    parts = []
    if int(out_lens[i]) != step.exp_lens[i]:
        parts.append(f"verified_len expected {step.exp_lens[i]}, found {int(out_lens[i])}")
    start = ends[i - 1] if i else 0
    for t in range(start, ends[i]):
        if int(out_row[t]) != int(step.v_slots[t]):
            parts.append(
                f"req_to_token[{step.rows[i]}, {t - start}] expected {int(step.v_slots[t])}, "
                f"found {int(out_row[t])}"
            )
            break  # the first wrong column is enough
    for t in range(start, ends[i]):
        if int(out_kv[t]) != int(step.v_vals[t]):
            found = int(out_kv[t])
            parts.append(
                f"kv[{int(step.v_slots[t])}] (position {t - start}) expected "
                f"{int(step.v_vals[t])}, found request {(found >> _POS_BITS) - 1} "
                f"position {found & ((1 << _POS_BITS) - 1)}"
            )
            break
    return "; ".join(parts)
