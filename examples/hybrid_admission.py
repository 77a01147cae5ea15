"""KV groups for a hybrid model, with sliding-window early frees: a program that checks itself.

An overlap loop over one ``AsyncReqToTokenPool`` with three KV groups, as a
model with full-attention, sliding-window (``--window`` tokens) and Mamba
layers needs them (``kv={"full": ..., "swa": ..., "mamba": KVPagePool(rows + 1, 1)}``):

* each request is a task that awaits ``pool.admit({"full": n, "swa": w,
  "mamba": 1})``: a row, its prompt's pages, the pages of the prompt's last
  window and a state slot, all or nothing (backpressure when short);
* each step grows both attention groups at page boundaries in one
  all-or-nothing call (``extend_rows(rows, {"full": 1, "swa": 1})``),
  launches the forward, records one
  fence and ties the batch to it (``record_use`` covers every group);
* then ``drop_pages(rows, below, group="swa")`` gives back the swa pages
  that slid out of the window, behind that fence (the step in flight may
  still read the last of them); a finished request's ``free`` returns its
  row and every group's pages behind the same fences.

The swa pool is sized for windows (a window's pages and two a row), not for
whole contexts: the report shows how many swa pages the run would have held
without the drops. The forward writes each position's KV, tagged with its
owner, in every group, and checks that all it reads (the context, the
window, the state) carries its own tag. ``--no-record-use`` leaves the
fences out (the bug): freed pages and slots go to new requests while a step
still reads them, and the check reports corruptions (in the Mamba group, a
pool with no slack; the attention groups reuse the oldest-freed page first,
which hides most of theirs, dropped ones included). Runs on
:class:`~asyncpool.HostStream` without a GPU, on a CUDA stream when there is
one (``--device cpu`` forces the host). Exit status: 0 when nothing was
corrupted and the pool ends empty, 1 otherwise. Public API only.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncpool import AsyncReqToTokenPool, HostStream, KVPagePool, record_fence, wait_fence

MAX_LEN = 128
GROUPS = ("full", "swa", "mamba")


@dataclass
class Request:
    id: int
    prompt_len: int
    output_len: int
    row: int = -1
    done: int = 0  # output tokens whose step has been processed
    launched: int = 0  # output tokens whose step has been launched (>= done)
    base: dict[str, int] = field(default_factory=dict)  # position of a group's first page
    pages: dict[str, list[int]] = field(default_factory=dict)  # each group's, in order

    @property
    def pos(self) -> int:  # the position its next step writes
        return self.prompt_len + self.launched

    @property
    def tag(self) -> int:  # what its KV holds, in every group
        return self.id + 1


class Engine:
    """Every group's page tensor (one tensor here, a group at each offset) and
    the forward stream: a HostStream, or a CUDA stream."""

    def __init__(self, device: torch.device, groups: dict[str, KVPagePool], forward: Any) -> None:
        self.cuda, self.forward = device.type == "cuda", forward
        sizes = [p.num_pages * p.page_size for p in groups.values()]
        self.offset = dict(zip(groups, [sum(sizes[:i]) for i in range(len(sizes))], strict=True))
        self.kv = torch.zeros(sum(sizes), dtype=torch.int64, device=device)  # owners' tags
        self.bad = torch.zeros((), dtype=torch.int64, device=device)  # corrupted reads
        if self.cuda:
            forward.wait_stream(torch.cuda.current_stream(device))  # the zero fills first

    def launch(
        self,
        reads: list[int],
        owners: list[int],
        writes: list[int],
        tags: list[int],
        delay_s: float,
        on_host: bool = False,
    ) -> None:
        """Check that the ``reads`` hold their ``owners``' tags, then write ``tags``
        at ``writes``: a step on the forward stream, or (``on_host``) a prefill
        from the scheduler's thread (on CUDA, queued on the forward stream)."""
        args = [torch.tensor(x, dtype=torch.int64) for x in (reads, owners, writes, tags)]
        if self.cuda:
            with torch.cuda.stream(self.forward):
                torch.cuda._sleep(int(delay_s * 1.5e9))  # type: ignore[no-untyped-call]
                _forward(self.kv, self.bad, *(t.to(self.kv.device) for t in args))
        elif on_host:
            _forward(self.kv, self.bad, *args)
        else:
            self.forward.launch(_host_forward, delay_s, self.kv, self.bad, *args)


def _forward(
    kv: torch.Tensor,
    bad: torch.Tensor,
    reads: torch.Tensor,
    owners: torch.Tensor,
    writes: torch.Tensor,
    tags: torch.Tensor,
) -> None:
    bad += (kv[reads] != owners).sum()  # a read of another owner's KV is a corruption
    kv[writes] = tags


def _host_forward(delay_s: float, *args: torch.Tensor) -> None:
    time.sleep(delay_s)  # the forward's compute, on the stream's worker
    _forward(*args)


async def run(args: argparse.Namespace) -> int:
    device, ps, window = torch.device(args.device), int(args.page_size), int(args.window)
    rng = random.Random(args.seed)
    cuda = device.type == "cuda"
    forward: Any
    if cuda:
        forward = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    else:
        forward = HostStream("forward")
        forward.launch(torch.set_num_threads, 1)  # torch's intra-op threads are per thread
    # Page ids live on the host (the scheduler computes slots from them); the
    # page tensors are the engine's, on its device.
    kv = {
        "full": KVPagePool(args.rows * -(-MAX_LEN // ps) + 1, ps),  # whole contexts
        "swa": KVPagePool(args.rows * (-(-window // ps) + 2) + 1, ps),  # windows only
        "mamba": KVPagePool(args.rows + 1, 1),  # one state slot a request
    }
    pool = AsyncReqToTokenPool(
        args.rows + 1, MAX_LEN, device=device, kv=kv, stream=forward if cuda else None
    )
    engine = Engine(device, kv, forward)
    requests = [Request(i, rng.randint(4, 40), rng.randint(8, 80)) for i in range(args.requests)]
    running: list[Request] = []
    arrived = asyncio.Event()

    def lo(pos: int) -> int:  # the first position the step at ``pos`` reads in the window
        return max(0, pos - window + 1)

    def slots(req: Request, g: str, positions: Iterable[int]) -> list[int]:
        """The slots (in the engine's tensor) of the request's ``positions`` in group ``g``."""
        if g == "mamba":  # one state, whatever the position
            return [engine.offset[g] + req.pages[g][0]]
        pages, base = req.pages[g], req.base[g]
        return [engine.offset[g] + pages[q // ps - base] * ps + q % ps for q in positions]

    async def admit(req: Request) -> None:
        p = req.prompt_len
        n = -(-p // ps)  # the prompt's pages; the swa group's from its last window on
        req.base = {"full": 0, "swa": lo(p) // ps, "mamba": 0}
        grant = await pool.admit({"full": n, "swa": n - req.base["swa"], "mamba": 1}, timeout=30)
        req.row = grant.row
        req.pages = {g: [int(x) for x in grant.pages[g].tolist()] for g in GROUPS}
        spans = {"full": range(p), "swa": range(lo(p), p), "mamba": [p]}
        written = [x for g in GROUPS for x in slots(req, g, spans[g])]
        engine.launch([], [], written, [req.tag] * len(written), 0, on_host=True)  # prefill
        running.append(req)
        arrived.set()

    tasks = {asyncio.create_task(admit(r)) for r in requests}
    prev: tuple[Any, list[Request]] | None = None
    steps = finished = 0
    peak = dict.fromkeys(GROUPS, 0)  # pages allocated or pending, at the most
    undropped = 0  # the most swa pages the running rows would hold without drop_pages
    t0 = time.perf_counter()
    try:
        while finished < len(requests):
            batch, launched = list(running), None
            if batch:
                # Growth first, at page boundaries: both attention groups cross one
                # at the same position, so one call grows both, all or nothing.
                grow = [r for r in batch if r.pos // ps == len(r.pages["full"])]
                if grow:
                    got = pool.extend_rows([r.row for r in grow], {"full": 1, "swa": 1})
                    if got is None:  # sized so that it never is (an engine would
                        raise RuntimeError("short of pages")  # retract: paged_admission.py)
                    for g, new in got.items():
                        for r, page in zip(grow, new[:, 0].tolist(), strict=True):
                            r.pages[g].append(int(page))
                reads: list[int] = []
                owners: list[int] = []
                writes: list[int] = []
                for r in batch:  # attention's context in each group, and the Mamba state
                    q = r.pos
                    for g, span in (("full", range(q)), ("swa", range(lo(q), q)), ("mamba", [q])):
                        seen = slots(r, g, span)
                        reads, owners = reads + seen, owners + [r.tag] * len(seen)
                        writes += slots(r, g, [q])
                    r.launched += 1
                tags = [r.tag for r in batch for _ in GROUPS]
                engine.launch(reads, owners, writes, tags, args.forward_ms / 1e3)  # step t
                fence = record_fence(forward)  # one fence per step, right after the launch
                if args.record_use:
                    pool.record_use([r.row for r in batch], fence)  # every group's pages too
                # Step t + 1 reads from lo(its position): the swa pages below slid out of
                # the window. Step t may still read the last of them: behind its fence.
                below = [lo(r.pos) // ps - r.base["swa"] for r in batch]
                pool.drop_pages([r.row for r in batch], below, group="swa")
                for g, group in kv.items():
                    gs = group.stats()
                    peak[g] = max(peak[g], gs.allocated + gs.pending)
                undropped = max(undropped, sum(-(-r.pos // ps) for r in batch))
                launched = (fence, batch)
                steps += 1
            if prev is not None:  # process step t-1 while step t runs
                await wait_fence(prev[0])
                for r in prev[1]:
                    r.done += 1
                    if r.done == r.output_len:
                        running.remove(r)
                        pool.free([r.row])  # every group's pages, behind step t's fence
                        finished += 1
            prev = launched
            if not running and finished < len(requests):
                arrived.clear()
                async with asyncio.timeout(30):
                    await arrived.wait()
            else:
                await asyncio.sleep(0)  # let granted requests write their prompts
        async with asyncio.timeout(30):
            await asyncio.gather(*tasks)
            await pool.drain()
        forward.synchronize()
        elapsed = time.perf_counter() - t0
    finally:
        for task in tasks:
            task.cancel()
        await pool.close()
        if not cuda:
            forward.close()

    bad, st = int(engine.bad), pool.stats()
    pool.check_invariants()
    empty = st.allocated == st.pending == st.pages_allocated == st.pages_pending == 0
    print(
        f"hybrid_admission: {len(requests)} requests on {args.rows} rows, {steps} steps, "
        f"window {window}, pages of {ps}, on {'CUDA stream' if cuda else 'HostStream'}"
    )
    for g in GROUPS:
        note = f" ({undropped} without window drops)" if g == "swa" else ""
        print(
            f"hybrid_admission: {g}: peak {peak[g]} pages in circulation{note}, "
            f"pool of {kv[g].capacity}"
        )
    if bad == 0 and empty:
        print(f"hybrid_admission: OK: corruptions=0, pool empty, {elapsed:.2f} s")
        return 0
    print(
        f"hybrid_admission: FAILED: corruptions={bad} (corrupted reads of another owner's KV), "
        f"{st.allocated} rows and {st.pages_allocated} pages still allocated, "
        f"{st.pending} rows and {st.pages_pending} pages pending"
    )
    return 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    p.add_argument("--requests", type=int, default=120)
    p.add_argument("--rows", type=int, default=8, help="rows in the pool (row 0 excluded)")
    p.add_argument("--window", type=int, default=16, help="sliding window, in tokens")
    p.add_argument("--page-size", type=int, default=4, help="token slots a page")
    p.add_argument("--forward-ms", type=float, default=1.0, help="the forward's time per step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--no-record-use",
        dest="record_use",
        action="store_false",
        help="leave out record_use (the bug): dropped and freed pages are reused too soon",
    )
    args = p.parse_args(argv)
    # Refused with exit 2, not a traceback and exit 1 (the status of corruption found).
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available here")
    if min(args.rows, args.window, args.page_size) < 1 or args.requests < 0:
        p.error("--rows, --window and --page-size must be at least 1, --requests at least 0")
    if not 0 <= args.forward_ms < float("inf"):
        p.error("--forward-ms must be a finite number >= 0")
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
