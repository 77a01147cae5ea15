"""Gaps found by a hand-made mutation sweep of ``scheduler_demo``.

The demo's point is to show the hazards: unsafe runs must corrupt rows and
KV pages and its checker must see it, fenced runs must show none, and the
figures it reports must be the ones it measured. Each test pins one
behaviour that a hand-made mutant broke while every test file that
exercises the demo still passed:

* the checker skips the entries of a request that *finished* after the step
  was launched (same epoch, no longer running), as it skips retracted ones
  (the mutant tested the epoch only, so unsafe runs over-counted);
* the checker reads back every position ``[0, end)`` of every request, not
  only the positions the step writes (the mutant verified ``[0, k)``: a
  decode step checked position 0 alone), and reads the KV at the slot the
  host gave each position, not through the device's row (the mutant counted
  every row corruption as a KV corruption too);
* the forward clamps a stale ``verified_lens`` past the row's end instead
  of faulting the stream (the mutant dropped the clamp);
* a client-abort timer acts only on the transfer it was set for (the mutant
  aborted a request's later life, its prompt re-transferred after a
  retraction, on the first transfer's timer), and an abort mid-transfer is
  counted as one, with the request's row held behind its transfer;
* gate mode: an idle scheduler lets held transfers go only when fenced
  (unsafe, they wait for a new owner of their pages to be verified; the
  mutant released them too), and ``_land_held`` returns only once the
  released transfer has landed (the mutant returned at the release);
* the scheduler's shutdown cancels the abort timers still pending (the
  mutants kept no record of them, or did not cancel them);
* ``wait_fence`` re-raises a fault of the stream that lands while it waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any, cast

import numpy as np
import pytest
import torch
from helpers import bounded

from asyncpool import AsyncReqToTokenPool, FenceError, HostStream, KVPagePool
from scheduler_demo import DemoConfig
from scheduler_demo.forward import Forward, Step, wait_fence
from scheduler_demo.scheduler import ABORTED, FINISHED, RUNNING, TRANSFER, Scheduler, kv_value
from scheduler_demo.transfer import TransferEngine
from scheduler_demo.workload import RequestSpec

# ---------------------------------------------------------------- the checker


def _checker_scheduler() -> Scheduler:
    """A demo scheduler over two running requests (rid 0 on row 1, rid 1 on
    row 2), for driving its checker and timers by hand; no pool or stream."""
    cfg = DemoConfig(
        num_requests=2, rows=4, max_context_len=16, kv_pages=8, page_size=4, progress=False
    )
    specs = [RequestSpec(0, 0.0, 2, 4), RequestSpec(1, 0.0, 1, 4)]
    sched = Scheduler(
        cfg, cast(Any, None), KVPagePool(9, 4), cast(Any, None), cast(Any, None), specs
    )
    for row, req in enumerate(sched.reqs, start=1):
        req.row, req.state = row, RUNNING
    return sched


def _clean_step(sched: Scheduler) -> Step:
    """A step of request 0 (3 tokens, slots 10..12) and request 1 (2 tokens,
    slots 20..21) whose outputs are what the host expects."""
    a, b = sched.reqs
    v_rows = np.array([a.row] * 3 + [b.row] * 2, dtype=np.int64)
    v_cols = np.array([0, 1, 2, 0, 1], dtype=np.int64)
    v_slots = np.array([10, 11, 12, 20, 21], dtype=np.int64)
    v_vals = np.array(
        [kv_value(0, p) for p in range(3)] + [kv_value(1, p) for p in range(2)], dtype=np.int64
    )
    empty = np.zeros(0, dtype=np.int64)
    step = Step(
        1,
        [(a, a.epoch, 3), (b, b.epoch, 2)],
        [a.row, b.row],
        [1, 1],
        empty,
        empty,
        empty,
        empty,
        empty,
        (v_rows, v_cols, v_slots, v_vals),
    )
    step.out_lens = torch.tensor([3, 2], dtype=torch.int32)
    step.out_row = torch.from_numpy(v_slots).to(torch.int32)
    step.out_kv = torch.from_numpy(v_vals.copy())
    return step


def test_checker_skips_entries_of_a_request_that_finished_since_the_launch() -> None:
    """A request found finished while the step was in flight (its epoch
    unchanged) no longer owns its row and pages: what the step read there
    counts nothing, while the running request's bad entries still count
    (mutant: the skip tested the epoch only, counting finished requests'
    rows reused by new owners in unsafe runs)."""
    sched = _checker_scheduler()
    a, b = sched.reqs
    step = _clean_step(sched)
    b.state = FINISHED  # processed in step t-1, its row freed
    step.out_row[4] = 99
    step.out_kv[4] = kv_value(0, 7)
    step.out_lens[1] = 5
    sched._verify(step)
    assert (sched.corruptions, sched.kv_corruptions) == (0, 0)
    assert not b.corrupted and not b.kv_corrupted
    step.out_row[0] = 99  # the running request's row: counted
    sched._verify(step)
    assert (sched.corruptions, sched.mismatches, sched.kv_corruptions) == (1, 1, 0)
    assert a.corrupted and not b.corrupted


@contextlib.contextmanager
def _forward_rig() -> Iterator[tuple[Scheduler, Forward, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The checker's scheduler with a CPU forward over tables of its own:
    request 0 on row 1 holds pages 2 and 3 (slots 8..15), decoding, with
    positions 0..2 written (row entries, ``verified_lens`` and KV). Yields
    the scheduler, the forward, ``req_to_token``, ``verified_lens`` and the
    KV; steps are run by :func:`_run_step`, synchronously on this thread."""
    from scheduler_demo.scheduler import DECODE

    forward = Forward("cpu", 0.0, 0.0)
    try:
        sched = _checker_scheduler()
        sched.forward = forward
        a = sched.reqs[0]
        cfg = sched.cfg
        r2t = torch.zeros((cfg.rows + 1, cfg.max_context_len), dtype=torch.int32)
        lens = torch.zeros(cfg.rows + 1, dtype=torch.int32)
        kv = torch.zeros((cfg.kv_pages + 1) * cfg.page_size, dtype=torch.int64)
        forward.attach(r2t, lens, kv)
        sched._add_page_ids(a, [2, 3])
        a.entry, a.kv_len = DECODE, 3
        r2t[a.row, :3] = torch.tensor([8, 9, 10], dtype=torch.int32)
        lens[a.row] = 3
        kv[8:11] = torch.tensor([kv_value(0, p) for p in range(3)])
        yield sched, forward, r2t, lens, kv
    finally:
        forward.close()


def _run_step(sched: Scheduler, forward: Forward) -> None:
    """Build the next step of request 0, run it, verify it."""
    step = sched._build([sched.reqs[0]])
    step.inputs = forward._inputs(step)
    forward._run(step)
    sched._verify(step)


def _counts(sched: Scheduler) -> tuple[int, int, int, int]:
    return sched.corruptions, sched.mismatches, sched.kv_corruptions, sched.kv_mismatches


def test_checker_reads_back_every_position_of_a_decoding_request() -> None:
    """The checker verifies every position ``[0, end)`` of every request at
    every step, not only the tokens the step writes: a late write into an
    old position of a decoding request (its KV slot now holding another
    request's value) is a KV corruption of that request (mutant: the
    read-back covered ``[0, k)``, so a decode step checked position 0 only)."""
    with _forward_rig() as (sched, forward, _, _, kv):
        _run_step(sched, forward)  # position 3: clean
        assert _counts(sched) == (0, 0, 0, 0)
        kv[9] = kv_value(1, 0)  # a late write of request 1 into position 1
        _run_step(sched, forward)  # position 4 is clean; position 1 is not
        assert _counts(sched) == (0, 0, 1, 1)
        assert sched.reqs[0].kv_corrupted


def test_checker_reads_the_kv_at_the_hosts_slot_not_through_the_device_row() -> None:
    """A row entry overwritten (it lists another slot) is a row corruption;
    the KV is read at the slot the host gave the position, which still holds
    the right value: no KV corruption on top (mutant: the KV read through
    the device's row, so every row corruption also counted as a KV one)."""
    with _forward_rig() as (sched, forward, r2t, _, _):
        r2t[sched.reqs[0].row, 1] = 13  # a stale write into the row: slot 13 is empty
        _run_step(sched, forward)
        assert _counts(sched) == (1, 1, 0, 0)


def test_a_stale_verified_len_past_the_row_does_not_fault_the_forward() -> None:
    """An unsafe run can leave a row's device ``verified_lens`` past the end
    of the row (a late ``+= k`` on a reused row): the step's write positions
    are clamped to the last column, so the forward stream does not fault and
    the checker counts the corruption (mutant: no clamp, an IndexError on
    the stream)."""
    with _forward_rig() as (sched, forward, _, lens, _):
        lens[sched.reqs[0].row] = sched.cfg.max_context_len
        _run_step(sched, forward)
        assert sched.corruptions == 1 and sched.reqs[0].corrupted


# ---------------------------------------------------------------- client aborts


@contextlib.asynccontextmanager
async def _in_transfer(
    unsafe: bool = False, gate: bool = False
) -> AsyncIterator[tuple[Scheduler, Any]]:
    """A demo scheduler (fenced unless ``unsafe``) whose only request holds a
    row and pages and waits for a transfer that is not due during the test;
    on the way out every transfer lands (so the pool's fence watcher is not
    left waiting on one) and the streams close."""
    cfg = DemoConfig(
        unsafe=unsafe,
        gate=gate,
        num_requests=1,
        rows=4,
        max_context_len=64,
        kv_pages=16,
        page_size=4,
        transfer_ms=600_000.0,
        progress=False,
    )
    kv_pages = KVPagePool(cfg.kv_pages + 1, cfg.page_size)
    kv = torch.zeros((cfg.kv_pages + 1) * cfg.page_size, dtype=torch.int64)
    forward = Forward("cpu", 0.0, 0.0)
    transfers = TransferEngine("cpu", cfg.transfer_ms, 8.0)
    specs = [RequestSpec(0, 0.0, 8, 4, "transfer", 0.5)]
    try:
        async with AsyncReqToTokenPool(cfg.rows + 1, cfg.max_context_len, kv=kv_pages) as pool:
            forward.attach(pool.req_to_token, pool.verified_lens, kv)
            transfers.attach(kv)
            sched = Scheduler(cfg, pool, kv_pages, forward, transfers, specs)
            req = sched.reqs[0]
            n = sched._need_pages(req)
            grant = pool.try_admit(pages=n)
            assert grant is not None
            req.row = grant.row
            sched.pages_held += n
            sched._granted(req, grant.pages)
            assert req.state == TRANSFER and req.transfer is not None
            try:
                yield sched, req
            finally:
                await sched._stop_tasks()
                transfers.flush()
                transfers.synchronize()
                async with bounded():
                    await pool.drain()
    finally:
        forward.close()
        transfers.close()


async def test_an_abort_timer_acts_only_on_the_transfer_it_was_set_for() -> None:
    """A request retracted before its first token fetches its prompt's KV
    again, with a timer of its own; the first transfer's timer, firing
    later, must leave it alone (mutant: no ``req.transfer is t`` test, which
    aborted the request's second life). Its own transfer's timer aborts it
    mid-transfer: counted as such, its row freed behind the transfer."""
    async with bounded(), _in_transfer() as (sched, req):
        row = req.row
        sched._client_abort(req, object())  # an earlier transfer's handle
        assert req.state == TRANSFER and req.row == row
        assert sched.aborted == 0 and sched.pool.pending_size() == 0
        sched._client_abort(req, req.transfer)
        assert req.state == ABORTED and req.row == -1
        assert (sched.aborted, sched.aborts_in_transfer, sched.aborts_in_decode) == (1, 1, 0)
        assert sched.pool.pending_size() == 1  # behind the transfer still on its way


async def test_shutdown_cancels_the_abort_timers_still_pending() -> None:
    """A run that ends (or is given up) with an abort timer pending cancels
    it: it would otherwise fire into a scheduler whose pool is closed
    (mutants: the timer not kept in ``_timers``; kept but not cancelled)."""
    sched = _checker_scheduler()
    fired: list[int] = []
    sched._call_later(3600.0, fired.append, 1)
    assert len(sched._timers) == 1
    (timer,) = sched._timers
    async with bounded():
        await sched._stop_tasks()
    assert timer.cancelled() and not sched._timers and not fired


@pytest.mark.parametrize("unsafe", [False, True], ids=["fenced", "unsafe"])
async def test_idling_lets_held_transfers_go_only_when_fenced(unsafe: bool) -> None:
    """Gate mode holds an aborted request's transfer back. Fenced, its pages
    wait behind it, so an idle scheduler lets it go; unsafe, its pages were
    freed at once and it stays held until a new owner of them has been
    verified, so that its late write is seen (mutant: released when idling
    in unsafe runs too)."""
    async with bounded(), _in_transfer(unsafe=unsafe, gate=True) as (sched, req):
        t = req.transfer
        sched._client_abort(req, t)
        assert [held for held, _ in sched._held] == [t] and t.held
        sched._wake.set()  # the idle wait returns at once
        await sched._idle()
        assert bool(sched._held) == unsafe and t.held == unsafe


async def test_a_released_held_transfer_has_landed_before_the_next_verification() -> None:
    """Gate mode: once a new owner has written and verified one of the slots
    a held transfer writes, ``_land_held`` releases the transfer and returns
    only once it has landed, so the owner's next verification reads the late
    write (mutant: it returned at the release, the write still queued)."""
    sched = _checker_scheduler()
    engine = TransferEngine("cpu", transfer_ms=600_000.0, mean_tokens=1.0)
    kv = torch.zeros(32, dtype=torch.int64)
    engine.attach(kv)
    sched.transfers = engine
    gate = threading.Event()
    try:
        a = sched.reqs[0]
        sched._mirror[a.row, :3] = [10, 11, 12]  # what the step verified for request 0
        t = engine.start(9, torch.tensor([11]), torch.tensor([kv_value(9, 0)]))
        assert engine.hold(t)
        assert t.timer is not None
        t.timer.cancel()
        t.is_due = True  # due while held
        sched._held.append((t, {11}))
        engine.stream.launch(gate.wait, 5.0)  # the transfer stream is busy
        task = asyncio.get_running_loop().create_task(sched._land_held(_clean_step(sched)))
        await asyncio.sleep(0)  # one loop pass: the task runs to its first wait
        assert t.launched and not sched._held
        assert not task.done()  # waiting for the late write to land
        gate.set()
        async with bounded():
            await task
        assert t.query() and int(kv[11]) == kv_value(9, 0)
    finally:
        gate.set()
        engine.flush()
        engine.close()


# ---------------------------------------------------------------- fences


async def test_wait_fence_reraises_a_fault_that_lands_while_it_waits() -> None:
    """The step's work faults the stream while ``wait_fence`` waits for its
    fence: the wait raises ``FenceError`` rather than returning as if the
    step had run (mutant: the last ``query()`` dropped)."""
    gate = threading.Event()

    def step() -> None:
        gate.wait(5.0)
        raise RuntimeError("the step faulted")

    stream = HostStream("faulting")
    try:
        stream.launch(step)
        fence = stream.record()
        assert not fence.query()  # the wait below does not start on a done fence
        gate.set()
        with pytest.raises(FenceError):
            async with bounded():
                await wait_fence(fence)
    finally:
        gate.set()
        stream.close()
