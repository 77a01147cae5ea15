"""The overlap scheduler: launch step t, then process step t-1's results.

One asyncio task runs the loop; every request is admitted by its own small
task that ``await``\\ s ``pool.alloc(1)`` (backpressure: it waits FIFO, within
priority, for a row). The loop, per iteration::

    launch(step t)                  # on the stream; record_use(rows, fence)
    process(step t-1)               # await its fence, verify, finish -> free
    schedule(step t+1)              # retract if the KV budget is exceeded,
                                    # admit ready requests, build the batch
    busy CPU work (sched_ms)

so while step t runs, the scheduler frees rows that step t still writes:
requests found finished in step t-1 (they were scheduled into step t before
anyone knew, as with EOS) and requests it retracts. With the fences
(``record_use`` once per step) the pool keeps such a row out of circulation
until step t has landed. With ``unsafe`` the rows are freed at once, as the
seed pool does, the pool hands them to a waiting request, and step t's late
writes land in the new owner's row: the verification counts it.

``mode="sync"`` runs the same loop without overlap (launch, wait, process).
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

import torch

from asyncpool import AsyncReqToTokenPool

from .config import DemoConfig
from .forward import Forward, Step, fill_gates, wait_fence
from .report import Sample
from .workload import RequestSpec

__all__ = ["RETRACTED_PRIORITY", "Scheduler"]

logger = logging.getLogger(__name__)

NEW_PRIORITY = 0
RETRACTED_PRIORITY = -1  # lower is served first

WAITING, READY, RUNNING, FINISHED = range(4)


class Req:
    """A request's host-side truth: what the device tables must say."""

    __slots__ = (
        "corrupted",
        "epoch",
        "generated",
        "kv_len",
        "row",
        "slots",
        "snapshot",
        "spec",
        "state",
    )

    def __init__(self, spec: RequestSpec) -> None:
        self.spec = spec
        self.state = WAITING
        self.row = -1
        self.epoch = 0  # bumped at each retraction: results of older steps are void
        self.generated = 0  # output tokens processed
        # KV positions scheduled: the verified_len expected after the last launched step.
        self.kv_len = 0
        self.slots: list[int] = []  # expected req_to_token[row, :kv_len]
        self.snapshot: torch.Tensor | None = None  # the row's content when it finished
        self.corrupted = False


class Scheduler:
    """Runs one workload to completion on ``pool`` and ``forward``."""

    def __init__(
        self,
        cfg: DemoConfig,
        pool: AsyncReqToTokenPool,
        forward: Forward,
        specs: list[RequestSpec],
        on_complete: Callable[[int], object] | None = None,
    ) -> None:
        self.cfg = cfg
        self.pool = pool
        self.forward = forward
        self.reqs = [Req(s) for s in specs]
        self.on_complete = on_complete
        self.overlap = cfg.mode == "overlap"
        self.fenced = not cfg.unsafe
        self.capacity = cfg.rows

        self.running: list[Req] = []
        self.ready_retracted: collections.deque[Req] = collections.deque()
        self.ready_new: collections.deque[Req] = collections.deque()
        self.kv_used = 0
        self.next_slot = 1  # KV slot ids handed out in order, never reused: a misplaced one shows
        self.step_id = 0

        # Results.
        self.completed = 0
        self.output_tokens = 0
        self.computed_tokens = 0
        self.steps = 0
        self.batch_total = 0
        self.retractions = 0
        self.corruptions = 0
        self.mismatches = 0
        self.alloc_waits: list[float] = []
        self.timeline: list[Sample] = []
        self.t0 = 0.0
        self.elapsed = 0.0
        self.cpu_s = 0.0  # CPU time of the scheduler's thread (the event loop's)

        self._tasks: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        self._error: BaseException | None = None
        self._gated: collections.deque[Step] = collections.deque()

    # -- the loop ------------------------------------------------------------

    async def run(self) -> None:
        """Serve every request; return when all have finished."""
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
                if self.completed == len(self.reqs):
                    break
                await self._wake.wait()
                self._wake.clear()
            self.elapsed = time.perf_counter() - self.t0
            self.cpu_s = time.thread_time() - cpu0
        finally:
            fill_gates([prev, cur, *self._gated])
            await self._stop_tasks()
        self._final_check()

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
        self.timeline.append(
            Sample(
                time.perf_counter() - self.t0,
                self.capacity - free - pending,
                pending,
                free,
                self.pool.waiting(),
                len(self.running),
                self.kv_used,
                self.retractions,
                self.completed,
            )
        )

    # -- admission -----------------------------------------------------------

    async def _arrivals(self) -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        for req in self.reqs:
            delay = start + req.spec.arrival_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            self._spawn(self._admit(req, NEW_PRIORITY))

    async def _admit(self, req: Req, priority: int) -> None:
        t0 = time.perf_counter()
        rows = await self.pool.alloc(1, priority=priority)
        self.alloc_waits.append(time.perf_counter() - t0)
        req.row = rows[0]
        req.state = READY
        (self.ready_retracted if priority < NEW_PRIORITY else self.ready_new).append(req)
        self._wake.set()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and self._error is None:
            self._error = task.exception()
            self._wake.set()

    async def _stop_tasks(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    # -- scheduling ----------------------------------------------------------

    def _schedule(self) -> Step | None:
        """Build the next batch: retract to fit the KV budget, then admit."""
        cfg = self.cfg
        need = len(self.running)  # every running request decodes one token
        while need > 1 and self.kv_used + need > cfg.kv_budget:
            self._retract(self._victim())
            need -= 1

        limit = cfg.kv_budget * cfg.admit_watermark
        admitted: list[Req] = []
        prefill = 0
        for queue in (self.ready_retracted, self.ready_new):
            while queue:
                req = queue[0]
                k = req.spec.prompt_len + req.generated
                busy = bool(self.running or admitted)
                if busy and self.kv_used + need + k > limit:
                    break
                if admitted and prefill + k > cfg.max_prefill_tokens:
                    break
                queue.popleft()
                admitted.append(req)
                need += k
                prefill += k
            if queue:
                break  # FIFO: the head that does not fit blocks those behind it
        for req in admitted:
            req.state = RUNNING
            self.running.append(req)
        if not self.running:
            return None
        return self._build(admitted_from=len(self.running) - len(admitted))

    def _victim(self) -> Req:
        # Like sglang's retract_decode: the fewest output tokens, then the
        # longest prompt (the least progress lost, the most KV given back).
        return min(self.running, key=lambda r: (r.generated, -r.spec.prompt_len))

    def _retract(self, req: Req) -> None:
        self.running.remove(req)
        self.kv_used -= req.kv_len
        row = req.row
        req.row = -1
        req.kv_len = 0
        req.slots = []
        req.epoch += 1
        req.state = WAITING
        self.retractions += 1
        # The row is in the step in flight; the pool defers it behind that
        # step's recorded use (or, unsafe, hands it out at once).
        self.pool.free([row])
        self._spawn(self._admit(req, RETRACTED_PRIORITY))

    def _build(self, admitted_from: int) -> Step:
        entries: list[tuple[Any, int, int]] = []
        rows: list[int] = []
        n_new: list[int] = []
        exp_lens: list[int] = []
        exp_cols: list[int] = []
        offs: list[int] = []
        row_idx: list[int] = []
        slot_start = slot = self.next_slot
        for i, req in enumerate(self.running):
            k = 1 if i < admitted_from else req.spec.prompt_len + req.generated
            start = req.kv_len
            end = start + k
            row = req.row
            rows.append(row)
            n_new.append(k)
            exp_lens.append(end)
            entries.append((req, req.epoch, end))
            if k == 1:
                exp_cols.append(start)
                offs.append(0)
                row_idx.append(row)
                req.slots.append(slot)
            else:
                exp_cols.extend(range(start, end))
                offs.extend(range(k))
                row_idx.extend([row] * k)
                req.slots.extend(range(slot, slot + k))
            req.kv_len = end
            slot += k
        self.next_slot = slot
        tokens = slot - slot_start
        self.kv_used += tokens
        self.step_id += 1
        gate = threading.Event() if (self.cfg.gate and self.overlap) else None
        return Step(
            self.step_id, entries, rows, n_new, slot_start, exp_lens, exp_cols, offs, row_idx, gate
        )

    def _launch(self, step: Step) -> None:
        fence = self.forward.launch(step)
        if self.fenced:
            # One fence per step, covering every row the step touches.
            self.pool.record_use(step.rows, fence)
        if step.gate is not None:
            self._gated.append(step)
        self.steps += 1
        self.batch_total += len(step.rows)
        self.computed_tokens += step.tokens

    # -- results -------------------------------------------------------------

    async def _process(self, step: Step) -> None:
        await wait_fence(step.fence)
        if self._gated and self._gated[0] is step:
            self._gated.popleft()
        self._verify(step)
        for req, epoch, length in step.entries:
            if req.epoch != epoch or req.state != RUNNING:
                continue  # retracted or finished after this step was launched
            req.generated += 1
            self.output_tokens += 1
            if req.generated >= req.spec.output_len:
                self._finish(req, length)

    def _verify(self, step: Step) -> None:
        """Compare the step's view of the device tables with the host's truth.

        The clean case is two vectorised compares. Mismatches are counted per
        (request, step); details are built only when debug logging is on, so
        a run full of corruption is not slowed down by reporting it.
        """
        out_lens, out_slots = step.out_lens, step.out_slots
        assert out_lens is not None and out_slots is not None
        exp_lens = torch.tensor(step.exp_lens, dtype=out_lens.dtype)
        slots = step.inputs[4].to(out_slots.device)
        lens_bad = not torch.equal(out_lens, exp_lens)
        slots_bad = not torch.equal(out_slots, slots)
        if not (lens_bad or slots_bad):
            return
        bad: set[int] = set()
        if lens_bad:
            bad.update(torch.nonzero(out_lens != exp_lens).flatten().tolist())
        bad_tokens: list[int] = []
        if slots_bad:
            bad_tokens = torch.nonzero(out_slots != slots).flatten().tolist()
            ends = list(itertools.accumulate(step.n_new))
            bad.update(bisect.bisect_right(ends, t) for t in bad_tokens)
        debug = logger.isEnabledFor(logging.DEBUG)
        for i in sorted(bad):
            req, epoch, _ = step.entries[i]
            if req.epoch != epoch or req.state != RUNNING:
                continue  # the host no longer expects anything of that row
            self._corrupt(req)
            if debug:
                logger.debug(
                    "corruption: request %d, step %d, row %d: %s",
                    req.spec.rid,
                    step.step_id,
                    step.rows[i],
                    _describe(step, i, out_lens, out_slots, slots, bad_tokens),
                )

    def _corrupt(self, req: Req) -> None:
        self.mismatches += 1
        if not req.corrupted:
            req.corrupted = True
            self.corruptions += 1

    def _finish(self, req: Req, length: int) -> None:
        # Columns [0, length) are the request's content; a step in flight may
        # still write column `length` (its extra, unneeded token).
        req.snapshot = self.forward.snapshot(req.row, length)
        del req.slots[length:]
        self.running.remove(req)
        self.kv_used -= req.kv_len
        req.state = FINISHED
        self.pool.free([req.row])
        self.completed += 1
        if self.on_complete is not None:
            self.on_complete(1)

    def _final_check(self) -> None:
        """Every finished request's row content, as it was when it finished."""
        self.forward.synchronize()
        for req in self.reqs:
            if req.snapshot is None:
                continue
            expected = torch.tensor(req.slots, dtype=torch.int32)
            found = req.snapshot.cpu()
            if not torch.equal(found, expected):
                self._corrupt(req)
                where = torch.nonzero(found != expected).flatten()
                col = int(where[0])
                logger.debug(
                    "corruption: request %d, final check of row %d: %d column(s) differ, "
                    "first col %d: expected %d, found %d",
                    req.spec.rid,
                    req.row,
                    where.numel(),
                    col,
                    int(expected[col]),
                    int(found[col]),
                )


def _describe(
    step: Step,
    i: int,
    out_lens: torch.Tensor,
    out_slots: torch.Tensor,
    slots: torch.Tensor,
    bad_tokens: list[int],
) -> str:
    """What entry ``i`` of ``step`` should have read, and what it read."""
    parts = []
    if int(out_lens[i]) != step.exp_lens[i]:
        parts.append(f"verified_len expected {step.exp_lens[i]}, found {int(out_lens[i])}")
    start = sum(step.n_new[:i])
    for t in bad_tokens:
        if start <= t < start + step.n_new[i]:
            parts.append(
                f"req_to_token[{step.rows[i]}, {step.exp_cols[t]}] expected {int(slots[t])}, "
                f"found {int(out_slots[t])}"
            )
            break  # the first wrong column is enough
    return "; ".join(parts)
