"""``scheduler_demo --tp N``: one scheduler replica per tensor-parallel rank.

Each rank is a process (``torch.multiprocessing`` spawn) with its own pool,
KV pages, forward stream and transfer engine, joined in one
``torch.distributed`` group (gloo on CPU, NCCL with ``--device cuda``: then
one GPU per rank). Every rank runs :class:`TPScheduler`, the demo's scheduler
with what a replicated scheduler needs to build the same batch everywhere:

* the pools are ``reclaim="explicit"``: after processing step t-1 (its
  outputs are in) the scheduler calls ``retire(fence)``, and once per
  iteration ``agree(group)`` settles the fences it does not observe
  (transfers);
* inputs come from rank 0, as SGLang broadcasts the requests it received:
  each iteration rank 0 broadcasts the requests that arrived by its clock and
  the client aborts that fired on it;
* a transfer has landed when it has landed on every rank (an all-reduce MIN
  of landed flags, in one tensor with the batch-hash check below);
* admission only tries (``try_admit``) at the scheduling point and retries
  the head next iteration, instead of a task that waits in the pool's queue
  and resumes whenever the loop gets to it;
* every iteration the ranks all-reduce MIN of ``[h, -h]``, ``h`` a running
  hash of every batch launched so far (step id, rows, requests and their
  lengths): the minimum and maximum across ranks must be equal, or every
  rank raises :class:`TPMismatchError` at the same iteration. The report
  counts the checks, the mismatches (zero, or the run failed) and what the
  agreement cost per step.

CPU only is tested (gloo); the NCCL path (``--device cuda``) is untested here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from .config import DemoConfig
from .scheduler import NEW_PRIORITY, READY, RUNNING, TRANSFER, Req, Scheduler

__all__ = ["TPMismatchError", "TPScheduler", "check_agreed", "format_summary", "run_tp"]

_MASK = (1 << 62) - 1  # hashes stay far from int64's edges (we negate them)


class TPMismatchError(RuntimeError):
    """The tensor-parallel ranks built different batches."""


class TPScheduler(Scheduler):
    """The demo's scheduler, replicated on every rank of ``group``; see the module."""

    def __init__(
        self,
        *args: Any,
        group: Any,
        rank: int,
        world: int,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if not self.atomic or self.cfg.gate:
            raise ValueError("--tp needs atomic admission and no --gate")
        import torch.distributed as dist

        self._dist = dist
        self.group = group
        self.rank = rank
        self.world = world
        backend = str(dist.get_backend(group)).lower()
        self._device = (
            torch.device("cuda", torch.cuda.current_device())
            if "nccl" in backend
            else torch.device("cpu")
        )
        self._by_rid = {r.spec.rid: r for r in self.reqs}
        self._arrived: list[int] = []  # rank 0: arrived since the last broadcast
        self._aborted: list[tuple[int, int]] = []  # rank 0: (rid, epoch) of fired aborts
        self._in_transfer: dict[int, Req] = {}
        self._hash = hashlib.blake2b(digest_size=8)
        self._width = self.capacity + 4  # transfers in flight <= rows
        # "auto" pools only for the control run (--tp-reclaim auto): no
        # retire/agree, the pools reclaim by local fence timing, and the
        # ranks diverge.
        self.explicit = self.pool.reclaim_mode == "explicit"
        self.tp_checks = 0
        self.tp_mismatches = 0
        self.agree_s = 0.0
        self.exchange_s = 0.0
        self.iterations = 0

    # -- inputs: rank 0's, broadcast ---------------------------------------------

    async def _arrivals(self) -> None:
        if self.rank != 0:
            return  # the others learn of arrivals from rank 0's broadcast
        loop = asyncio.get_running_loop()
        start = loop.time()
        for req in self.reqs:
            delay = start + req.spec.arrival_s - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            self._arrived.append(req.spec.rid)
            self._wake.set()

    def _client_abort(self, req: Req, t: Any) -> None:
        # A timer fired: on rank 0 it is an input for every rank.
        if self.rank == 0 and req.transfer is t:
            self._aborted.append((req.spec.rid, req.epoch))
            self._wake.set()

    async def _await_transfer(self, req: Req, t: Any) -> None:
        return None  # landings are agreed in _exchange, not awaited here

    def _start_transfer(self, req: Req) -> None:
        super()._start_transfer(req)
        self._in_transfer[req.spec.rid] = req

    # -- admission: try at the scheduling point only -----------------------------

    def _admit_more(self) -> None:
        limit = self.cfg.admit_watermark * self.page_capacity
        reserve = len(self.running) // self.ps + 1
        for queue in (self.waiting_retracted, self.waiting_new):
            while queue:
                req = queue[0]
                n = self._need_pages(req)
                if self.pages_held and self.pages_held + n + reserve > limit:
                    return
                grant = self.pool.try_admit(pages=n)
                if grant is None:
                    return  # the head retries next iteration, on every rank alike
                queue.popleft()
                self.pages_held += n
                req.row = grant.row
                self._granted(req, grant.pages)

    # -- the per-iteration exchange ----------------------------------------------

    def _schedule(self) -> Any:
        self._exchange()
        return super()._schedule()

    def _exchange(self) -> None:
        dist = self._dist
        t0 = time.perf_counter()
        self.iterations += 1
        box: list[Any] = [(self._arrived, self._aborted)] if self.rank == 0 else [None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        arrived, aborted = box[0]
        if self.rank == 0:
            self._arrived, self._aborted = [], []
        inflight = [r for r in self._in_transfer.values() if r.state == TRANSFER]
        self._in_transfer = {r.spec.rid: r for r in inflight}
        h = int.from_bytes(self._hash.digest(), "little") & _MASK
        n = len(inflight)
        values = [h, -h, n, -n] + [_landed(r) for r in inflight]
        values += [0] * (self._width - len(values))
        t = torch.tensor(values, dtype=torch.int64, device=self._device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        agreed: list[int] = t.tolist()
        self.tp_checks += 1
        problem = check_agreed(agreed)
        if problem is not None:
            self.tp_mismatches += 1
            raise TPMismatchError(
                f"tensor-parallel ranks diverged before iteration {self.iterations} "
                f"(step {self.step_id}): {problem}"
            )
        now = time.perf_counter()
        for rid in arrived:
            req = self._by_rid[rid]
            req.admit_t0 = now
            self._enqueue(req, NEW_PRIORITY)
        for rid, epoch in aborted:
            req = self._by_rid[rid]
            handle = req.transfer
            if (
                req.epoch == epoch
                and handle is not None
                and req.state
                in (
                    TRANSFER,
                    READY,
                    RUNNING,
                )
            ):
                Scheduler._client_abort(self, req, handle)
        for req, landed in zip(inflight, agreed[4 : 4 + n], strict=True):
            if landed and req.state == TRANSFER:
                req.state = READY
                self.ready_join.append(req)
                del self._in_transfer[req.spec.rid]
        t1 = time.perf_counter()
        if self.explicit:  # "auto" pools have nothing to agree
            self.pool.agree(self.group)  # rows and pages, one all-reduce
        t2 = time.perf_counter()
        self.agree_s += t2 - t1
        self.exchange_s += t2 - t0

    # -- steps: hash what is launched, retire what is processed -----------------

    def _launch(self, step: Any) -> None:
        super()._launch(step)
        self._hash.update(
            repr(
                (step.step_id, step.rows, [(r.spec.rid, end) for r, _, end in step.entries])
            ).encode()
        )
        # The token slots the step writes: which KV pages each rank uses.
        self._hash.update(step.slots.tobytes())

    async def _process(self, step: Any) -> None:
        await super()._process(step)
        if not self.explicit:
            return
        # The scheduler has processed this step: what it held comes back.
        self.pool.retire(step.fence)  # rows and pages

    def tp_summary(self) -> dict[str, Any]:
        steps = max(self.steps, 1)
        return {
            "rank": self.rank,
            "world": self.world,
            "iterations": self.iterations,
            "steps": self.steps,
            "checks": self.tp_checks,
            "mismatches": self.tp_mismatches,
            "batch_hash": self._hash.hexdigest(),
            "agree_ms_per_step": self.agree_s / steps * 1e3,
            "exchange_ms_per_step": self.exchange_s / steps * 1e3,
            "step_ms": self.elapsed / steps * 1e3,
        }


def check_agreed(agreed: list[int]) -> str | None:
    """What differs across ranks, from the MIN-reduced ``[h, -h, n, -n, ...]``
    (``h`` the batch hash, ``n`` the transfers in flight); None if nothing."""
    problems = []
    if agreed[0] != -agreed[1]:
        problems.append(f"batch hashes {agreed[0]}..{-agreed[1]}")
    if agreed[2] != -agreed[3]:
        problems.append(f"transfers in flight {agreed[2]}..{-agreed[3]}")
    return ", ".join(problems) or None


def _landed(req: Req) -> int:
    t = req.transfer
    try:
        return 1 if t is not None and t.query() else 0
    except Exception:  # a faulted transfer never lands
        return 0


# -- processes -------------------------------------------------------------------


def _rank_main(
    rank: int, world: int, init: str, out_dir: str, cfg_dict: dict[str, Any], reclaim: str
) -> None:
    import torch.distributed as dist

    from .runner import run_demo

    cfg = DemoConfig(**cfg_dict)
    if cfg.device == "cuda":
        torch.cuda.set_device(rank % max(torch.cuda.device_count(), 1))
    if rank != 0:
        cfg = dataclasses.replace(cfg, progress=False)
    dist.init_process_group(
        "nccl" if cfg.device == "cuda" else "gloo",
        init_method=f"file://{init}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    holder: dict[str, TPScheduler] = {}

    def factory(*args: Any, **kwargs: Any) -> Scheduler:
        sched = TPScheduler(*args, group=dist.group.WORLD, rank=rank, world=world, **kwargs)
        holder["s"] = sched
        return sched

    try:
        report = _run(run_demo(cfg, reclaim=reclaim, scheduler_factory=factory))
        summary = holder["s"].tp_summary()
        summary["report"] = json.loads(json.dumps(report.to_dict(), default=str))
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(summary), encoding="utf-8")
        if rank == 0:
            print(report.table(), flush=True)
    finally:
        dist.destroy_process_group()


def _run(coro: Any) -> Any:
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        return asyncio.run(coro)
    return uvloop.run(coro)


def run_tp(cfg: DemoConfig, world: int, reclaim: str = "explicit") -> dict[str, Any]:
    """Run the demo on ``world`` ranks; return every rank's summary (rank
    order) plus the figures the CLI prints.

    ``reclaim="auto"`` is the control: the same replicas with pools that
    reclaim by local fence timing, which diverge. Raises
    :class:`TPMismatchError` when the ranks diverged, ``TimeoutError`` past
    ``cfg.timeout_s``, and whatever a rank raised otherwise; whatever it
    raises (a ``KeyboardInterrupt`` too), the ranks still running are killed
    first. The timeout is kept here, not in each rank: a rank blocked in
    a collective cannot time itself out.
    """
    from torch.multiprocessing.spawn import ProcessRaisedException, spawn

    if world < 1:
        raise ValueError(f"--tp must be >= 1, got {world}")
    if reclaim not in ("explicit", "auto"):
        raise ValueError(f'reclaim must be "explicit" or "auto", got {reclaim!r}')
    with tempfile.TemporaryDirectory() as tmp:
        args = (world, os.path.join(tmp, "init"), tmp, dataclasses.asdict(cfg), reclaim)
        context = spawn(_rank_main, args=args, nprocs=world, join=False)  # type: ignore[no-untyped-call]
        deadline = None if cfg.timeout_s is None else time.monotonic() + cfg.timeout_s
        restore = _sigterm_raises_in_main_thread()
        try:
            while not context.join(None if deadline is None else 0.05):
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"gave up after --timeout {cfg.timeout_s} s")
        except ProcessRaisedException as exc:
            text = str(exc)
            marker = "TPMismatchError: "
            if marker in text:
                raise TPMismatchError(text[text.rindex(marker) + len(marker) :].strip()) from exc
            raise
        finally:
            # However this ends (--timeout, a rank's error, a KeyboardInterrupt
            # or any other exception here), no rank outlives it: a rank left
            # running would serve its whole workload (or wait in a collective
            # for the group's timeout), and this process, at its exit, would
            # wait for it (multiprocessing joins the children it started).
            # The handler goes back even if a second signal (a SIGTERM, the
            # next Ctrl-C) interrupts the reaping.
            try:
                _kill_ranks(context.processes)
            finally:
                restore()
        ranks = [
            json.loads(Path(tmp, f"rank{r}.json").read_text(encoding="utf-8")) for r in range(world)
        ]
    hashes = {r["batch_hash"] for r in ranks}
    agree_ms = max(r["agree_ms_per_step"] for r in ranks)
    step_ms = max(r["step_ms"] for r in ranks)
    return {
        "world": world,
        "ranks": ranks,
        "mismatches": sum(r["mismatches"] for r in ranks) + (len(hashes) != 1),
        "checks": ranks[0]["checks"],
        "steps": ranks[0]["steps"],
        "agree_ms_per_step": agree_ms,
        "exchange_ms_per_step": max(r["exchange_ms_per_step"] for r in ranks),
        "step_ms": step_ms,
        "agree_fraction": agree_ms / step_ms if step_ms else 0.0,
    }


def _sigterm_raises_in_main_thread() -> Callable[[], object]:
    """Make a SIGTERM to this process raise ``SystemExit(143)`` (the exit
    status of a process killed by it) while the ranks run, so that
    :func:`run_tp`'s cleanup kills them; by default SIGTERM ends the
    process on the spot and leaves the ranks running. Returns the call that
    puts the previous handler back. Off the main thread (where no handler
    can be set) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def exit_143(signum: int, frame: object) -> None:
        raise SystemExit(128 + signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, exit_143)
    return lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def _kill_ranks(processes: list[Any]) -> None:
    """Kill the rank processes still running, then reap every one."""
    for process in processes:
        if process.is_alive():
            process.kill()
    for process in processes:
        process.join()


def format_summary(res: dict[str, Any]) -> str:
    return (
        f"tensor parallel: {res['world']} rank{'' if res['world'] == 1 else 's'}, "
        f"{res['steps']} steps, {res['checks']} batch-hash checks, "
        f"{res['mismatches']} mismatches; agree() "
        f"{res['agree_ms_per_step']:.3f} ms per step ({res['agree_fraction']:.1%} of a "
        f"{res['step_ms']:.2f} ms step), whole exchange {res['exchange_ms_per_step']:.3f} ms"
    )


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use: python -m scheduler_demo --tp N")
