"""The synchronous ``ReqToTokenPool`` as a drop-in for the seed's pool.

A plain, synchronous scheduler loop written against the seed's API
(``alloc(n)`` returning ``None`` when short, ``write``, ``free``,
``available_size``), with the two lines asyncpool adds:

    fence = record_fence(forward_stream)     # right after launching the step
    pool.record_use(batch_rows, fence)       # every row the step touches

While a step runs, clients abort requests (their rows are freed at once, as
the seed does) and new requests are admitted into free rows. With the
recorded use, an aborted row stays *pending* until the step has run past it,
so a new request never gets a row the step still writes; ``alloc`` reclaims
completed fences by itself before answering ``None``. Every finished
request's row is compared with the host's record of what was written.

Runs on a :class:`~asyncpool.HostStream` without a GPU and on a CUDA stream
when ``torch.cuda.is_available()`` (``--device cpu`` forces the host stream).
``--no-record-use`` drops the ``record_use`` line, which is the seed's
behaviour: aborted rows are reused under the running step and the check
reports corrupted rows.
(That is on the host stream, where the scheduler writes a new owner's prefix
from its own thread. On CUDA the prefix is written on the forward stream, so
stream order alone puts the old step's late write first; see docs/cuda.md,
"What stream order does and does not cover".) Exit status 0 when all is well, 1 otherwise.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from asyncpool import HostStream, ReqToTokenPool, record_fence

MAX_LEN = 128


def token(req_id: int, pos: int) -> int:
    return req_id * MAX_LEN + pos + 1


@dataclass
class Request:
    id: int
    prompt_len: int
    output_len: int
    done: int = 0
    row: int = -1

    @property
    def length(self) -> int:
        return self.prompt_len + self.done


def _step(
    delay_s: float,
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    pos: torch.Tensor,
    tok: torch.Tensor,
) -> None:
    if delay_s:
        time.sleep(delay_s)  # the forward's compute, on the host stream's worker
    req_to_token[rows, pos] = tok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    p.add_argument("--requests", type=int, default=120)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--forward-ms", type=float, default=1.0)
    p.add_argument("--abort", type=float, default=0.03, help="abort probability per step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-record-use", dest="record_use", action="store_false")
    args = p.parse_args(argv)
    # Refused with exit 2, not a traceback and exit 1 (the status of
    # corruption found).
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available here")
    if args.rows < 1 or args.requests < 0:
        p.error("--rows must be at least 1 and --requests at least 0")
    if not (0 <= args.forward_ms < float("inf") and 0 <= args.abort <= 1):
        p.error("--forward-ms must be a finite number >= 0 and --abort a probability")

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    stream: Any = torch.cuda.Stream(device) if cuda else HostStream("forward")  # type: ignore[no-untyped-call]
    rng = random.Random(args.seed)
    # The seed's constructor; on CUDA the pool's stream is the forward stream,
    # so row resets are ordered before the forward that reads the rows.
    pool = ReqToTokenPool(args.rows + 1, MAX_LEN, device=device, stream=stream if cuda else None)
    queue = deque(Request(i, rng.randint(16, 48), rng.randint(2, 24)) for i in range(args.requests))
    running: list[Request] = []
    finished = aborted = corrupted = steps = 0
    t0 = time.perf_counter()

    def admit() -> None:
        while queue:
            rows = pool.alloc(1)  # None when short, as the seed's
            if rows is None:
                return
            req = queue.popleft()
            req.row = rows[0]
            slots = torch.tensor([token(req.id, i) for i in range(req.length)], dtype=torch.int32)
            if cuda:
                with torch.cuda.stream(stream):
                    pool.write((req.row, slice(0, req.length)), slots)
            else:
                pool.write((req.row, slice(0, req.length)), slots)
            running.append(req)

    try:
        admit()
        while running:
            # Launch the step (it writes each row's next token slot).
            rows_t = torch.tensor([r.row for r in running])
            pos_t = torch.tensor([r.length for r in running])
            tok_t = torch.tensor([token(r.id, r.length) for r in running], dtype=torch.int32)
            if cuda:
                with torch.cuda.stream(stream):
                    torch.cuda._sleep(int(args.forward_ms * 1.5e6))  # type: ignore[no-untyped-call]
                    _step(0.0, pool.req_to_token, *(t.to(device) for t in (rows_t, pos_t, tok_t)))
            else:
                stream.launch(_step, args.forward_ms / 1e3, pool.req_to_token, rows_t, pos_t, tok_t)
            fence = record_fence(stream)
            if args.record_use:
                pool.record_use([r.row for r in running], fence)
            steps += 1
            # While it runs: aborts free rows at once, and new requests are admitted.
            for req in [r for r in running if rng.random() < args.abort]:
                running.remove(req)
                pool.free(req.row)
                aborted += 1
            batch = list(running)
            admit()
            fence.synchronize()  # synchronous scheduling: wait for the step
            for req in batch:
                req.done += 1
                if req.done == req.output_len:
                    got = pool.req_to_token[req.row, : req.length].tolist()
                    if got != [token(req.id, i) for i in range(req.length)]:
                        corrupted += 1
                    running.remove(req)
                    pool.free(req.row)
                    finished += 1
            admit()
        pool.reclaim()
        pool.check_invariants()
        empty = pool.available_size() == args.rows and pool.pending_size() == 0
    finally:
        if not cuda:
            stream.close()
    elapsed = time.perf_counter() - t0
    where = "a CUDA stream" if cuda else "HostStream"
    print(
        f"sync_dropin: {finished} finished, {aborted} aborted, {steps} steps, "
        f"{pool.stats().deferred_frees} deferred frees, on {where}"
    )
    if corrupted == 0 and empty:
        print(f"sync_dropin: OK: 0 corrupted rows, pool empty, {elapsed:.2f} s")
        return 0
    print(f"sync_dropin: FAILED: {corrupted} corrupted rows, pool empty: {empty}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
