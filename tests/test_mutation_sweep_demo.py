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
* the report's ``tokens_per_s`` is output tokens over the elapsed time and
  its ``computed_tokens`` the tokens whose KV the steps computed (the
  mutants divided the computed tokens, or counted every table entry), and
  its ``row_utilization`` is requests running over rows allocated, read
  from the same samples (the mutant divided the mean batch per step);
* the report's ``aborts_in_transfer`` / ``aborts_in_decode``,
  ``deferred_frees`` / ``deferred_page_frees`` and ``transfers`` are the
  scheduler's, the row pool's, the page pool's and the transfer engine's
  figures, each in its own field (the mutants swapped them, or never
  counted a transfer);
* ``--tp``'s exit status counts every rank's KV corruptions, not only its
  row corruptions, and the ranks' batch-hash mismatches;
* ``compare`` exits 1 when an unsafe run of *any* round found no KV
  corruption, or when the fenced row-first run (alone) was corrupted;
* a run given up at ``--timeout`` exits 1, alone and under ``compare``;
* ``wait_fence`` re-raises a fault of the stream that lands while it waits;
* a cache of exactly ``max_context_len`` token slots is accepted;
* ``percentile`` is nearest-rank.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from typing import Any, cast

import numpy as np
import pytest
import torch
from helpers import LONG_S, bounded
from test_demo import SMALL as DEMO_SMALL
from test_demo_tp import ONE_REQUEST_IN_TRANSFER, grant_first_request

from asyncpool import AsyncReqToTokenPool, FenceError, HostStream, KVPagePool
from scheduler_demo import DemoConfig, Report, run_demo
from scheduler_demo.forward import Forward, Step, wait_fence
from scheduler_demo.scheduler import ABORTED, FINISHED, RUNNING, TRANSFER, Scheduler, kv_value
from scheduler_demo.transfer import TransferEngine
from scheduler_demo.workload import RequestSpec

#: A short clean run: 6 requests at once on plenty of rows and pages (no
#: retraction), none aborted.
TINY = DemoConfig(
    num_requests=6,
    rate=0.0,
    prompt_len="const:5",
    output_len="const:4",
    abort_rate=0.0,
    seed=1,
    rows=8,
    max_context_len=32,
    kv_pages=32,
    page_size=4,
    transfer_ms=0.5,
    forward_ms=0.1,
    forward_us_per_token=0.0,
    sched_ms=0.0,
    progress=False,
    timeout_s=60.0,
)

#: The demo tests' hazard workload (admission waits, requests are retracted
#: and aborted mid-transfer and mid-decode), gated.
SMALL = replace(DEMO_SMALL, gate=True)


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
    cfg = replace(ONE_REQUEST_IN_TRANSFER, unsafe=unsafe, gate=gate)
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
            req = grant_first_request(sched, pool)
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


# ---------------------------------------------------------------- the report's figures


async def test_computed_tokens_counts_the_tokens_whose_kv_a_step_computed() -> None:
    """``computed_tokens`` is the tokens whose KV the steps computed: in a
    sync run with no retraction nor abort, one per output token (a joining
    request's prompt KV arrived by transfer; mutant: every new table entry
    counted, the prompt's included)."""
    async with bounded(LONG_S):
        report = await run_demo(replace(TINY, mode="sync"))
    assert report.completed == TINY.num_requests and report.retractions == 0
    assert report.output_tokens == TINY.num_requests * 4
    assert report.computed_tokens == report.output_tokens


async def test_tokens_per_s_counts_output_tokens() -> None:
    """``tokens_per_s`` is output tokens over the elapsed time (mutant: the
    computed tokens, which retracted requests' prefills make more)."""
    async with bounded(LONG_S):
        report = await run_demo(SMALL)
    assert report.retractions > 0 and report.computed_tokens > report.output_tokens
    assert report.tokens_per_s == pytest.approx(report.output_tokens / report.elapsed_s)


async def test_row_utilization_is_running_over_allocated_from_the_same_samples() -> None:
    """``row_utilization`` is the mean of requests running over the mean of
    rows allocated, both read from the timeline's samples (mutant: the mean
    batch per step over the rows per sample, which reads above 1 in sync
    runs and only then fails the older bound)."""
    async with bounded(LONG_S):
        report = await run_demo(SMALL)
    tl = report.trace.timeline
    running = sum(s.running for s in tl) / len(tl)
    allocated = sum(s.allocated for s in tl) / len(tl)
    assert report.mean_batch_size != pytest.approx(running)  # the run tells them apart
    assert report.row_utilization == pytest.approx(running / allocated)


async def test_the_report_gives_each_abort_phase_in_its_own_field() -> None:
    """``aborts_in_transfer`` and ``aborts_in_decode`` are the scheduler's
    two counts, not swapped (mutant). The counts are set by hand at the end
    of a short run, two different numbers."""

    class Counted(Scheduler):
        def _final_check(self) -> None:
            super()._final_check()
            self.aborts_in_transfer, self.aborts_in_decode = 2, 5

    async with bounded(LONG_S):
        report = await run_demo(TINY, scheduler_factory=Counted)
    assert (report.aborts_in_transfer, report.aborts_in_decode) == (2, 5)


async def test_the_report_takes_deferred_frees_from_each_pool() -> None:
    """``deferred_frees`` is the row pool's count and ``deferred_page_frees``
    the page pool's (mutant: both from the row pool; in a gated fenced run
    both are positive, so only their values tell them apart)."""
    pools: list[Any] = []

    def factory(*args: Any, **kwargs: Any) -> Scheduler:
        pools.extend(args[1:3])  # the row pool and the page pool
        return Scheduler(*args, **kwargs)

    async with bounded(LONG_S):
        report = await run_demo(SMALL, scheduler_factory=factory)
    pool, kv_pages = pools
    rows, pages = pool.stats().deferred_frees, kv_pages.stats().deferred_frees
    assert rows != pages  # the run tells the two apart
    assert (report.deferred_frees, report.deferred_page_frees) == (rows, pages)


async def test_the_report_counts_every_transfer_started() -> None:
    """``transfers`` is the number of prompt-KV transfers started, one per
    admission of a request with no token yet (mutant: the engine never
    counted one, so the report said 0)."""
    started: list[int] = []

    class Counting(Scheduler):
        def _start_transfer(self, req: Any) -> None:
            started.append(req.spec.rid)
            super()._start_transfer(req)

    async with bounded(LONG_S):
        report = await run_demo(SMALL, scheduler_factory=Counting)
    assert len(started) >= SMALL.num_requests - report.aborts_in_transfer
    assert report.transfers == len(started)


# ---------------------------------------------------------------- exit statuses


def _tp_summary(kv_corruptions: list[int], mismatches: int) -> dict[str, object]:
    return {
        "world": len(kv_corruptions),
        "steps": 10,
        "checks": 20,
        "mismatches": mismatches,
        "agree_ms_per_step": 0.1,
        "agree_fraction": 0.01,
        "step_ms": 10.0,
        "exchange_ms_per_step": 0.2,
        "ranks": [{"report": {"corruptions": 0, "kv_corruptions": c}} for c in kv_corruptions],
    }


@pytest.mark.parametrize(
    ("kv_corruptions", "mismatches", "status"),
    [([0, 0], 0, 0), ([0, 2], 0, 1), ([3, 0], 0, 1), ([0, 0], 1, 1)],
)
def test_the_tp_exit_status_counts_kv_corruptions_and_batch_mismatches(
    monkeypatch: pytest.MonkeyPatch, kv_corruptions: list[int], mismatches: int, status: int
) -> None:
    """A fenced ``--tp`` run exits 1 when a rank found KV corruption (and no
    row corruption), or when the ranks' final batch hashes differ (mutants:
    only the row corruptions counted; the mismatches ignored)."""
    from scheduler_demo import cli
    from scheduler_demo import tp as tpm

    summary = _tp_summary(kv_corruptions, mismatches)
    monkeypatch.setattr(tpm, "run_tp", lambda cfg, world, reclaim: summary)
    assert cli.main(["--tp", "2", "--no-progress"]) == status


def _report(unsafe: bool, kv_corruptions: int) -> Report:
    """A report of a run that served its 4 requests, every other figure 1."""
    given: dict[str, Any] = {
        "mode": "overlap",
        "unsafe": unsafe,
        "device": "cpu",
        "admission": "atomic",
        "requests": 4,
        "completed": 4,
        "aborts": 0,
        "corruptions": 0,
        "kv_corruptions": kv_corruptions,
    }
    rest = {f.name: 1 for f in dataclasses.fields(Report) if f.name not in given}
    del rest["config"], rest["trace"], rest["swa"]  # the optional fields
    return Report(**given, **rest)


@pytest.mark.parametrize(
    ("unsafe_kv", "row_first_kv", "status"),
    [([3, 3], [0, 0], 0), ([3, 0], [0, 0], 1), ([3, 3], [0, 2], 1)],
    ids=["clean-and-caught", "second-unsafe-round-missed", "row-first-corrupted"],
)
def test_compare_exit_status_looks_at_every_round_and_every_fenced_variant(
    monkeypatch: pytest.MonkeyPatch, unsafe_kv: list[int], row_first_kv: list[int], status: int
) -> None:
    """Over two rounds, ``compare`` exits 0 only if *every* unsafe run found
    KV corruption and *every* fenced run, row-first included, is clean
    (mutants: any unsafe run enough; the row-first runs left out)."""
    from scheduler_demo import compare

    unsafe_left, row_first_left = list(unsafe_kv), list(row_first_kv)

    async def fake_run_demo(cfg: DemoConfig) -> Report:
        if cfg.unsafe:
            return _report(True, unsafe_left.pop(0))
        if cfg.admission == "row-first":
            return _report(False, row_first_left.pop(0))
        return _report(False, 0)

    monkeypatch.setattr(compare, "run_demo", fake_run_demo)
    assert compare.main(["--rounds=2", "--no-progress"]) == status
    assert unsafe_left == row_first_left == []


async def _gives_up(cfg: DemoConfig) -> Report:
    raise TimeoutError


def test_a_run_given_up_at_timeout_exits_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run cut short by ``--timeout`` proved nothing: exit 1 with the
    message (mutant: exit 0)."""
    from scheduler_demo import cli

    monkeypatch.setattr(cli, "run_demo", _gives_up)
    assert cli.main(["--timeout", "5", "--no-progress"]) == 1
    assert "gave up after --timeout 5.0 s" in capsys.readouterr().err


def test_compare_exits_1_when_a_run_is_given_up_at_timeout(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``compare`` stops at a run given up at ``--timeout`` and exits 1
    (mutant: exit 0)."""
    from scheduler_demo import compare

    monkeypatch.setattr(compare, "run_demo", _gives_up)
    assert compare.main(["--rounds=1", "--timeout", "5", "--no-progress"]) == 1
    assert "gave up after --timeout 5.0 s" in capsys.readouterr().err


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


# ---------------------------------------------------------------- config and report


def test_a_cache_of_exactly_max_context_len_slots_is_accepted() -> None:
    """One request may use the whole cache: ``kv_pages * page_size ==
    max_context_len`` is valid, one slot fewer is not (mutant: ``<=``)."""
    DemoConfig(kv_pages=64, page_size=16, max_context_len=1024).validate()
    with pytest.raises(ValueError, match="kv_pages \\* page_size"):
        DemoConfig(kv_pages=64, page_size=16, max_context_len=1025).validate()


def test_percentile_is_nearest_rank() -> None:
    """``percentile`` picks the ``ceil(q/100 * n)``-th smallest sample
    (mutant: one rank too high)."""
    from scheduler_demo.report import percentile

    data = [float(i) for i in range(100, 0, -1)]
    assert percentile(data, 50) == 50.0
    assert percentile(data, 99) == 99.0
    assert percentile(data, 100) == 100.0
    assert percentile([7.0, 3.0], 50) == 3.0
    assert percentile([], 50) == 0.0
