"""docs/api.md's overlap scheduler step, as a small program that checks itself.

An engine-shaped loop over :class:`asyncpool.AsyncReqToTokenPool`:

* requests arrive as tasks that ``await pool.alloc(1)`` (backpressure: more
  requests than rows) and write their prefix with ``set_req_pool_info``;
* each step launches the "forward" on the forward stream (it writes the next
  token slot of every running row), records **one fence right after the
  launch** and ties every row of the batch to it with ``record_use``;
* then it processes the *previous* step (overlap: the step just launched is
  still running): requests that finished have their row copied out on a copy
  stream and are freed in one ``free(rows, after=copy_stream)`` (the copies were
  launched after the step's fence, so the step's fence does not cover them);
  some requests are retracted and freed with a plain ``free(row)``, and
  re-queued;
* every finished request's copied-out row is compared with the host's own
  record of what was written. A row handed to a new request while the old
  step still wrote into it would show up as a mismatch.

Runs on a :class:`~asyncpool.HostStream` (a worker thread standing in for a
CUDA stream) without a GPU and on CUDA streams when ``torch.cuda.is_available()``
(``--device cpu`` forces the host stream). ``--no-record-use`` leaves out the
``record_use`` call, as an engine that forgets it would: rows are then reused
while the step still writes them, and the check reports corrupted rows.
(That is on the host stream, where the scheduler writes a new owner's prefix
from its own thread. On CUDA the prefix is written on the forward stream, so
stream order alone puts the old step's late write first; see docs/cuda.md,
"What stream order does and does not cover".)

``--loop uvloop`` runs it on uvloop. Exit status: 0 when every row checks
out and the pool ends empty, 1 otherwise. Public API only; see docs/cuda.md
for the CUDA wiring.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncpool import (
    AsyncReqToTokenPool,
    HostStream,
    ReqToTokenPoolInfo,
    record_fence,
    wait_fence,
)

from _engine import run_loop

MAX_LEN = 128


def token(req_id: int, pos: int) -> int:
    """The token slot a request holds at ``pos`` (what the forward writes there)."""
    return req_id * MAX_LEN + pos + 1


@dataclass
class Request:
    id: int
    prompt_len: int
    output_len: int
    done: int = 0  # output tokens whose step has been processed
    launched: int = 0  # output tokens whose step has been launched (>= done)
    admission: int = 0  # bumped at each (re-)admission
    row: int = -1
    copied: list[Any] = field(default_factory=list)  # the row, copied out at finish

    @property
    def length(self) -> int:
        return self.prompt_len + self.done


class Streams:
    """The forward stream and a copy stream: HostStreams, or CUDA streams."""

    def __init__(self, device: torch.device, forward_ms: float) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.forward_s = forward_ms / 1e3
        self.forward: Any
        self.copy: Any
        if self.cuda:
            self.forward = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            self.copy = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        else:
            self.forward = HostStream("forward")
            self.copy = HostStream("copy")
            # torch's intra-op threads are per thread: keep the workers to one.
            self.forward.launch(torch.set_num_threads, 1)
            self.copy.launch(torch.set_num_threads, 1)

    def launch_step(self, pool: AsyncReqToTokenPool, batch: list[Request]) -> None:
        """The forward of one step: write each row's next token slot."""
        rows = torch.tensor([r.row for r in batch])
        pos = torch.tensor([r.prompt_len + r.launched for r in batch])
        tok = torch.tensor(
            [token(r.id, r.prompt_len + r.launched) for r in batch], dtype=torch.int32
        )
        if self.cuda:
            with torch.cuda.stream(self.forward):
                rows, pos, tok = (t.to(self.device) for t in (rows, pos, tok))
                # about forward_ms of GPU time (cycles, ~1-2 GHz)
                torch.cuda._sleep(int(self.forward_s * 1.5e9))  # type: ignore[no-untyped-call]
                _write_step(pool.req_to_token, pool.verified_lens, rows, pos, tok)
        else:
            self.forward.launch(
                _host_step, self.forward_s, pool.req_to_token, pool.verified_lens, rows, pos, tok
            )

    def copy_out(self, pool: AsyncReqToTokenPool, req: Request) -> None:
        """Copy a finished request's row to the host, on the copy stream."""
        src = pool.req_to_token[req.row, : req.length]
        if self.cuda:
            dst = torch.empty(req.length, dtype=src.dtype, pin_memory=True)
            with torch.cuda.stream(self.copy):
                dst.copy_(src, non_blocking=True)
            req.copied.append(dst)
        else:
            self.copy.launch(lambda: req.copied.append(src.clone()))

    def write_prefix(self, pool: AsyncReqToTokenPool, req: Request) -> None:
        """Write a newly admitted request's prefix into its row.

        On CUDA this runs on the forward stream (also the pool's ``stream=``,
        where row resets are launched), so it is ordered after the row's reset
        and before the first forward that reads it.
        """
        slots = torch.tensor([token(req.id, p) for p in range(req.length)], dtype=torch.int32)
        info = ReqToTokenPoolInfo(req.length, req.length, slots)
        if self.cuda:
            with torch.cuda.stream(self.forward):
                pool.set_req_pool_info(req.row, info)
        else:
            pool.set_req_pool_info(req.row, info)

    def synchronize(self) -> None:
        self.forward.synchronize()
        self.copy.synchronize()

    def close(self) -> None:
        if not self.cuda:
            self.forward.close()
            self.copy.close()


def _write_step(
    req_to_token: torch.Tensor,
    verified_lens: torch.Tensor,
    rows: torch.Tensor,
    pos: torch.Tensor,
    tok: torch.Tensor,
) -> None:
    req_to_token[rows, pos] = tok
    verified_lens[rows] = (pos + 1).to(verified_lens.dtype)


def _host_step(delay_s: float, *args: torch.Tensor) -> None:
    time.sleep(delay_s)  # the forward's compute, on the stream's worker
    _write_step(*args)


async def run(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    rng = random.Random(args.seed)
    streams = Streams(device, args.forward_ms)
    pool = AsyncReqToTokenPool(
        args.rows + 1, MAX_LEN, device=device, stream=streams.forward if streams.cuda else None
    )
    requests = [Request(i, rng.randint(16, 48), rng.randint(2, 24)) for i in range(args.requests)]
    running: list[Request] = []
    finished: list[Request] = []
    arrived = asyncio.Event()
    retractions = 0

    async def admit(req: Request) -> None:
        # One task per request; more requests than rows, so most wait here.
        (req.row,) = await pool.alloc(1, timeout=30)
        req.admission += 1
        req.launched = req.done
        streams.write_prefix(pool, req)
        running.append(req)
        arrived.set()

    admissions = {asyncio.create_task(admit(r)) for r in requests}
    # The step in flight: its fence and its batch, as (request, admission).
    prev: tuple[Any, list[tuple[Request, int]]] | None = None
    steps = 0
    t0 = time.perf_counter()
    try:
        while len(finished) < len(requests):
            batch = list(running)
            launched = None
            if batch:
                streams.launch_step(pool, batch)  # step t, on the forward stream
                fence = record_fence(streams.forward)  # one fence per step, right after
                if args.record_use:
                    pool.record_use([r.row for r in batch], fence)  # every row it touches
                for req in batch:
                    req.launched += 1
                launched = (fence, [(r, r.admission) for r in batch])
                steps += 1
            # Process step t-1 while step t runs.
            if prev is not None:
                prev_fence, prev_batch = prev
                await wait_fence(prev_fence)  # its results are ready; the loop runs on
                done_rows: list[int] = []
                for req, admission in prev_batch:
                    if req.admission != admission or req not in running:
                        continue  # retracted since: that step's token is discarded
                    req.done += 1
                    if req.done == req.output_len:  # finished
                        running.remove(req)
                        streams.copy_out(pool, req)  # launched after step t's fence
                        done_rows.append(req.row)
                        finished.append(req)
                    elif rng.random() < args.retract:  # retracted: re-queued
                        running.remove(req)
                        pool.free([req.row])  # pending until step t's fence completes
                        retractions += 1
                        admissions.add(asyncio.create_task(admit(req)))
                if done_rows:  # one free for the step's finished rows (docs/cuda.md)
                    pool.free(done_rows, after=streams.copy)  # so wait for the copies too
            prev = launched
            if not running and len(finished) < len(requests):
                arrived.clear()
                async with asyncio.timeout(30):
                    await arrived.wait()
            else:
                await asyncio.sleep(0)  # let granted requests write their prefix
        async with asyncio.timeout(30):
            await asyncio.gather(*admissions)
            await pool.drain()
        streams.synchronize()
        elapsed = time.perf_counter() - t0
    finally:
        await pool.close()
        streams.close()

    corrupted = 0
    for req in finished:
        got = [int(x) for x in req.copied[-1].tolist()]
        want = [token(req.id, p) for p in range(req.prompt_len + req.output_len)]
        if got != want:
            corrupted += 1
    stats = pool.stats()
    pool.check_invariants()
    ok = corrupted == 0 and stats.allocated == 0 and stats.pending == 0
    where = "CUDA streams" if streams.cuda else "HostStream"
    print(
        f"overlap_step: {len(requests)} requests on {args.rows} rows, {steps} steps, "
        f"{retractions} retractions, {stats.deferred_frees} deferred frees, on {where}"
    )
    if ok:
        print(f"overlap_step: OK: 0 corrupted rows, pool empty, {elapsed:.2f} s")
        return 0
    print(
        f"overlap_step: FAILED: {corrupted} corrupted rows, {stats.allocated} rows still "
        f"allocated, {stats.pending} pending"
    )
    return 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    p.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio")
    p.add_argument("--requests", type=int, default=120)
    p.add_argument("--rows", type=int, default=8, help="rows in the pool (row 0 excluded)")
    p.add_argument("--forward-ms", type=float, default=1.0, help="the forward's time per step")
    p.add_argument("--retract", type=float, default=0.02, help="retraction probability")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--no-record-use",
        dest="record_use",
        action="store_false",
        help="leave out record_use (the bug): rows are reused too soon",
    )
    args = p.parse_args(argv)
    # Refused with exit 2, not a traceback and exit 1 (the status of
    # corruption found).
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available here")
    if args.rows < 1 or args.requests < 0:
        p.error("--rows must be at least 1 and --requests at least 0")
    if not (0 <= args.forward_ms < float("inf") and 0 <= args.retract <= 1):
        p.error("--forward-ms must be a finite number >= 0 and --retract a probability")
    return run_loop(run(args), args.loop)


if __name__ == "__main__":
    sys.exit(main())
