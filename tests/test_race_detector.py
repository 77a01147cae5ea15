"""Race detector at pool level: a lagging forward must never write a reused row.

Each cycle plays overlap scheduling on a tiny pool (capacity 4):

1. request A gets ``k`` rows and writes its mark into ``verified_lens``;
2. one or two forward steps that touch A's rows are launched on a
   ``HostStream``; each is held by a gate (``threading.Event``) and, once
   released, writes ``verified_lens`` for A's rows, as a lagging forward does;
3. the scheduler retracts A while those steps are in flight, protecting the
   free with ``record_use`` + ``free``, ``free(fence=)`` or
   ``free(after=stream)``;
4. request B asks for the whole pool, so it can only get A's rows back, and
   writes its own mark the moment it is granted;
5. the gates open (the first one alone first: B must still wait for the
   newest step), B's rows are checked: a late write shows up as A's value.

Fenced, B is never granted while a gate is closed and never sees a late
write, over 10^4 such retract-and-reuse cycles. The unsafe variant frees
without ``record_use``/fences and must observe the late write in every
cycle: the detector proves it can fail. Gates make it deterministic.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from typing import Any

import pytest
from helpers import LONG_S, bounded

from asyncpool import AsyncReqToTokenPool, HostFence, HostStream

CAP = 4
FENCED_CYCLES = 10_000
UNSAFE_CYCLES = 300


async def fence_done(fence: HostFence) -> None:
    """Await a HostFence from the loop without blocking it."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()

    def settle() -> None:
        if not fut.done():
            fut.set_result(None)

    fence.add_done_callback(lambda: loop.call_soon_threadsafe(settle))
    async with asyncio.timeout(10):
        await fut


def _lagging_forward(gate: threading.Event, lens: Any, rows: list[int], value: int) -> None:
    gate.wait()
    for r in rows:  # per-row writes, as a kernel touching the batch's rows
        lens[r] = value


async def _settle(n: int = 3) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


class Outcome:
    def __init__(self) -> None:
        self.cycles = 0
        self.reused = 0
        self.early_grants: list[str] = []
        self.late_writes: list[str] = []
        self.dirty_grants: list[str] = []
        self.modes: dict[str, int] = {}


def _grab_b(
    out: Outcome, task: asyncio.Task[list[int]], lens: Any, cycle: int, mark: int, when: str
) -> list[int] | None:
    """If B was granted, check its rows read zero and write B's mark into them.

    ``when`` names the moment when being granted is already a violation.
    """
    if not task.done():
        return None
    rows = task.result()
    if any(lens[rows].tolist()):
        out.dirty_grants.append(f"cycle {cycle}: rows {rows} not zero at grant")
    lens[rows] = mark
    if when:
        out.early_grants.append(f"cycle {cycle}: B granted {rows} {when}")
    return rows


async def run_cycles(cycles: int, *, fenced: bool, seed: int) -> Outcome:
    rng = random.Random(seed)
    out = Outcome()
    stream = HostStream("lagging-forward")
    pool = AsyncReqToTokenPool(CAP + 1, 8)
    lens = pool.verified_lens
    gates: list[threading.Event] = []
    try:
        for cycle in range(cycles):
            a_mark = 2 * cycle + 1  # odd: A's value, written by its lagging forward
            b_mark = 2 * cycle + 2  # even: B's value, written by B at grant
            async with bounded():
                a_rows = await pool.alloc(rng.randint(1, CAP))
            lens[a_rows] = a_mark
            # one or two in-flight forward steps touch A's rows
            steps = rng.choice((1, 1, 2))
            gates = [threading.Event() for _ in range(steps)]
            fences = []
            for gate in gates:
                stream.launch(_lagging_forward, gate, lens, a_rows, a_mark)
                fences.append(stream.record())
            # retract A while the steps are in flight
            if not fenced:
                mode = "unsafe"
                pool.free(a_rows)
            else:
                mode = rng.choice(("record_use", "record_use", "fence", "after"))
                if mode == "record_use":
                    for f in fences:
                        pool.record_use(a_rows, f)
                    pool.free(a_rows)
                elif mode == "fence":
                    pool.free(a_rows, fence=fences[-1])
                else:
                    pool.free(a_rows, after=stream)
            out.modes[mode] = out.modes.get(mode, 0) + 1

            # B wants the whole pool: it can only get A's rows back
            b_task = asyncio.create_task(pool.alloc(CAP))
            b_rows: list[int] | None = None

            async with bounded():
                await _settle()
            b_rows = _grab_b(
                out, b_task, lens, cycle, b_mark, "while every forward step was still gated"
            )
            if steps == 2:
                gates[0].set()
                async with bounded():
                    await fence_done(fences[0])
                    await _settle()
                if b_rows is None:
                    b_rows = _grab_b(
                        out,
                        b_task,
                        lens,
                        cycle,
                        b_mark,
                        "after the first step only (the newest was still gated)",
                    )
            for gate in gates:
                gate.set()
            async with bounded():
                await fence_done(fences[-1])
            async with asyncio.timeout(10):
                rows_now = await b_task
            if b_rows is None:
                b_rows = _grab_b(out, b_task, lens, cycle, b_mark, "")
            assert b_rows == rows_now
            # let anything still queued on the stream land before checking
            async with bounded():
                await fence_done(stream.record())
            if set(a_rows) & set(b_rows):
                out.reused += 1
            got = lens[b_rows].tolist()
            bad = [(r, v) for r, v in zip(b_rows, got, strict=True) if v != b_mark]
            if bad:
                out.late_writes.append(
                    f"cycle {cycle} ({mode}): B's rows got A's late writes {bad} (B wrote {b_mark})"
                )
            pool.free(b_rows)
            out.cycles += 1
        pool.check_invariants()
        st = pool.stats()
        assert st.allocated == 0 and st.quarantined == 0 and st.waiters == 0
    finally:
        for gate in gates:
            gate.set()
        async with bounded():
            await pool.drain()
            await pool.close()
        stream.close()
    return out


def _report(capsys: pytest.CaptureFixture[str], request: pytest.FixtureRequest, text: str) -> None:
    loop = request.node.callspec.id if hasattr(request.node, "callspec") else "?"
    with capsys.disabled():
        print(f"\nrace-detector[{loop}]: {text}")


async def test_fenced_rows_never_receive_late_writes(
    capsys: pytest.CaptureFixture[str], request: pytest.FixtureRequest, record_property: Any
) -> None:
    t0 = time.perf_counter()
    async with bounded(LONG_S):
        out = await run_cycles(FENCED_CYCLES, fenced=True, seed=1)
    elapsed = time.perf_counter() - t0
    _report(
        capsys,
        request,
        f"fenced: {out.cycles} retract-and-reuse cycles ({out.reused} reused A's rows) "
        f"in {elapsed:.1f}s, modes={out.modes}, early grants={len(out.early_grants)}, "
        f"late writes={len(out.late_writes)}",
    )
    record_property("race_fenced_cycles", out.reused)
    assert not out.early_grants, "\n".join(out.early_grants[:10])
    assert not out.late_writes, "\n".join(out.late_writes[:10])
    assert not out.dirty_grants, "\n".join(out.dirty_grants[:10])
    assert out.reused >= 10_000


async def test_unsafe_frees_are_caught(
    capsys: pytest.CaptureFixture[str], request: pytest.FixtureRequest
) -> None:
    """Without fences the detector must see the corruption, every cycle."""
    async with bounded(LONG_S):
        out = await run_cycles(UNSAFE_CYCLES, fenced=False, seed=2)
    _report(
        capsys,
        request,
        f"unsafe: {out.cycles} cycles, early grants={len(out.early_grants)}, "
        f"late writes observed={len(out.late_writes)}",
    )
    assert len(out.early_grants) == UNSAFE_CYCLES
    assert len(out.late_writes) == UNSAFE_CYCLES, "the detector missed late writes"
    assert not out.dirty_grants  # the reset at take still happens; the write comes later
