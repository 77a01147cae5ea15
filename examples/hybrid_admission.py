"""KV groups for a hybrid model: window slides and retraction, in a program that checks itself.

An overlap loop over one ``AsyncReqToTokenPool`` with three KV groups, as a
model with full-attention, sliding-window (``--window`` tokens) and Mamba
layers needs them (``kv={"full": ..., "swa": ..., "mamba": KVPagePool(rows + 1, 1)}``):

* each request is a task that awaits ``pool.admit({"full": n, "swa": w,
  "mamba": 1})``: a row, its prompt's pages, the pages of the prompt's last
  window and a state slot, all or nothing (backpressure when short);
* each step grows both attention groups at page boundaries in one call,
  oldest request first (``extend_fitting(rows, {"full": 1, "swa": 1})``):
  every row of the run it answers got its page in both groups, or none;
* when the run stops short, the groups that stopped it are those whose free
  pages miss a page; the newest requests are retracted until what they give
  back *in those groups* covers the stalled rows (a sliding-window row gives
  back its window only), freed behind the step in flight and re-admitted
  for recompute, ahead of new requests, while a ``hold_grants()`` hold
  keeps the queued admissions from taking those pages first;
* the step is launched, one fence recorded and the batch tied to it
  (``record_use`` covers every group); then ``drop_pages(rows, below,
  group="swa")`` gives back the swa pages that slid out of the next step's
  window, behind that fence (the step in flight may still read the last of
  them); a finished request's ``free`` returns its row and every group's
  pages behind the same fences.

The pools are tight (``--full-pages``, ``--swa-pages``), so both groups come
up short and the run retracts (the report counts it, by the group that was
short); the swa pool holds windows, not whole contexts: the report shows how
many swa pages the run would have held without the drops. Retraction
here is frequent (about 1.7 a request at the defaults: every request awaits
its own ``admit``, so the pages a hold's release frees are admitted away
at once); an engine that retracts rarely admits with headroom for growth
(SGLang's ``new_token_ratio``, vLLM's watermark), from its loop with
``try_admit``, as ``examples/paged_admission.py`` does. The forward
writes each position's KV, tagged with its owner, in every group, and
checks that all it reads (the context, the window, the state) carries its
own tag. ``--no-record-use`` leaves the fences out (the bug): freed,
retracted and dropped pages and slots go to new requests while a step still
reads them, and the check reports corruptions. Runs on
:class:`~asyncpool.HostStream` without a GPU, on a CUDA stream when there is
one (``--device cpu`` forces the host). ``--loop uvloop`` runs it on
uvloop. Exit status: 0 when nothing was corrupted and every row and page
came back, 1 otherwise. Public API only.
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

from asyncpool import (
    AsyncReqToTokenPool,
    GrantHold,
    HostStream,
    KVPagePool,
    record_fence,
    wait_fence,
)

from _engine import run_loop

MAX_LEN = 128
GROUPS = ("full", "swa", "mamba")
GROWN = ("full", "swa")  # the groups a decode step grows (the Mamba state never grows)


@dataclass(eq=False)
class Request:
    id: int
    prompt_len: int  # prefilled at admission (after a retraction, with what it generated)
    output_len: int  # still to generate
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

    def retract(self) -> None:
        """Back to the queue for recompute: what it generated becomes prompt,
        and the token of its step in flight is lost."""
        self.prompt_len, self.output_len = self.prompt_len + self.done, self.output_len - self.done
        self.done = self.launched = 0


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
        "full": KVPagePool(args.full_pages + 1, ps),  # short of whole contexts: retractions
        "swa": KVPagePool(args.swa_pages + 1, ps),  # windows only
        "mamba": KVPagePool(args.rows + 1, 1),  # one state slot a request
    }
    pool = AsyncReqToTokenPool(
        args.rows + 1, MAX_LEN, device=device, kv=kv, stream=forward if cuda else None
    )
    engine = Engine(device, kv, forward)
    requests = [Request(i, rng.randint(4, 40), rng.randint(8, 80)) for i in range(args.requests)]
    running: list[Request] = []  # oldest admission first
    arrived = asyncio.Event()

    def lo(pos: int) -> int:  # the first position the step at ``pos`` reads in the window
        return max(0, pos - window + 1)

    def slots(req: Request, g: str, positions: Iterable[int]) -> list[int]:
        """The slots (in the engine's tensor) of the request's ``positions`` in group ``g``."""
        if g == "mamba":  # one state, whatever the position
            return [engine.offset[g] + req.pages[g][0]]
        pages, base = req.pages[g], req.base[g]
        return [engine.offset[g] + pages[q // ps - base] * ps + q % ps for q in positions]

    async def admit(req: Request, priority: int = 0) -> None:
        p = req.prompt_len
        n = -(-p // ps)  # the prompt's pages; the swa group's from its last window on
        req.base = {"full": 0, "swa": lo(p) // ps, "mamba": 0}
        need = {"full": n, "swa": n - req.base["swa"], "mamba": 1}
        grant = await pool.admit(need, priority=priority, timeout=30)
        req.row = grant.row
        req.pages = {g: [int(x) for x in grant.pages[g].tolist()] for g in GROUPS}
        spans = {"full": range(p), "swa": range(lo(p), p), "mamba": [p]}
        written = [x for g in GROUPS for x in slots(req, g, spans[g])]
        engine.launch([], [], written, [req.tag] * len(written), 0, on_host=True)  # prefill
        running.append(req)
        arrived.set()

    def gives_back(row: int, g: str) -> int:
        """The pages a retraction of ``row`` returns in group ``g``: a
        full-attention row its context, a sliding-window row its window."""
        return len(pool.pages_of(row, host=True, group=g)) - pool.pages_dropped(row, group=g)

    tasks = {asyncio.create_task(admit(r)) for r in requests}
    prev: tuple[Any, list[Request]] | None = None
    hold: GrantHold | None = None  # held from a short growth until nothing is stalled
    steps = finished = retractions = 0
    short_in = dict.fromkeys(GROWN, 0)  # growths that this group stopped
    peak = dict.fromkeys(GROUPS, 0)  # pages allocated or pending, at the most
    undropped = 0  # the most swa pages the running rows would hold without drop_pages
    t0 = time.perf_counter()
    try:
        while finished < len(requests):
            # Growth first, at page boundaries: both attention groups cross one
            # at the same position, so one call grows both, oldest first, and
            # stops at the first row that some group cannot cover.
            grow = [r for r in running if r.pos // ps == len(r.pages["full"])]
            stalled: list[Request] = []
            if grow:
                m, got = pool.extend_fitting([r.row for r in grow], dict.fromkeys(GROWN, 1))
                for g, new in got.items():  # (m, 1): the run's pages, in each group
                    for r, page in zip(grow[:m], new[:, 0].tolist(), strict=True):
                        r.pages[g].append(int(page))
                stalled = grow[m:]
            if stalled:
                # Before any free: a free with nothing to wait for grants the
                # queued admissions at once, which would then need growth too.
                if hold is None:
                    hold = pool.hold_grants()
                # The call answers how far it got, not why: the groups that
                # stopped it are those whose free pages (its reclaim done)
                # miss the next row's page. Only pages given back there help.
                short = [g for g in GROWN if kv[g].available_size() < 1]
                for g in short:
                    short_in[g] += 1
                back = dict.fromkeys(short, 0)
                while stalled and any(back[g] < len(stalled) for g in short):
                    victim = running.pop()  # the newest: the least work lost
                    for g in short:
                        back[g] += gives_back(victim.row, g)
                    # Row and pages, behind its recorded use (the step in
                    # flight reads them); a copy stream that still read them
                    # would add after=copy_stream.
                    pool.free([victim.row])
                    if victim in stalled:
                        stalled.remove(victim)
                    if prev is not None and victim in prev[1]:
                        prev[1].remove(victim)  # its token there is discarded
                    victim.retract()
                    tasks.add(asyncio.create_task(admit(victim, priority=-1)))
                    retractions += 1
            # The stalled rows sit this step out: their pages come back when
            # the step in flight completes, and they grow next pass.
            batch, launched = [r for r in running if r not in stalled], None
            if batch:
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
                # the window. Step t may still read the last of them: after record_use,
                # so they wait for it (before it, only for step t - 1).
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
            if hold is not None and not any(r in running for r in stalled):
                hold.release()  # nobody stalled (and never idle with the hold held)
                hold = None
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
        f"{retractions} retractions (growth short in full {short_in['full']} times, "
        f"in swa {short_in['swa']}), window {window}, pages of {ps}, "
        f"on {'CUDA stream' if cuda else 'HostStream'}"
    )
    for g in GROUPS:
        note = f" ({undropped} without window drops)" if g == "swa" else ""
        print(
            f"hybrid_admission: {g}: peak {peak[g]} pages in circulation{note}, "
            f"pool of {kv[g].capacity}"
        )
    if bad == 0 and empty:
        print(
            f"hybrid_admission: OK: corruptions=0, pool empty (every row and page back), "
            f"{retractions} retractions, {elapsed:.2f} s"
        )
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
    p.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio")
    p.add_argument("--requests", type=int, default=120)
    p.add_argument("--rows", type=int, default=8, help="rows in the pool (row 0 excluded)")
    p.add_argument("--window", type=int, default=16, help="sliding window, in tokens")
    p.add_argument("--page-size", type=int, default=4, help="token slots a page")
    p.add_argument(
        "--full-pages",
        type=int,
        help="the full group's pages (default 12 a row: short of whole contexts)",
    )
    p.add_argument(
        "--swa-pages",
        type=int,
        help="the swa group's pages (default a window's a row, and 4: short at times)",
    )
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
    # The longest request must fit alone (with the step in flight when it
    # finishes, and in swa the pages its last drops leave pending), or it
    # would retract itself and be re-admitted for ever.
    alone = {"full": -(-MAX_LEN // args.page_size), "swa": -(-args.window // args.page_size) + 3}
    default = {"full": 12 * args.rows, "swa": (alone["swa"] - 3) * args.rows + 4}
    for g in GROWN:
        flag = f"--{g}-pages"
        given = getattr(args, f"{g}_pages")
        if given is None:
            setattr(args, f"{g}_pages", max(default[g], alone[g]))
        elif given < alone[g]:
            p.error(f"{flag} must be at least {alone[g]} (the longest request alone)")
    return run_loop(run(args), args.loop)


if __name__ == "__main__":
    sys.exit(main())
