"""``scheduler_demo --tp N``: replicated schedulers build the same batches."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
import torch
from helpers import bounded

from scheduler_demo.config import DemoConfig
from scheduler_demo.tp import TPMismatchError, check_agreed, format_summary, run_tp


@pytest.mark.timeout(240)
def test_two_ranks_build_identical_batches() -> None:
    cfg = DemoConfig(num_requests=60, progress=False, timeout_s=120.0)
    res = run_tp(cfg, 2)
    assert res["mismatches"] == 0
    assert res["checks"] > res["steps"] > 50
    hashes = {r["batch_hash"] for r in res["ranks"]}
    assert len(hashes) == 1
    for r in res["ranks"]:
        rep = r["report"]
        assert rep["corruptions"] == 0 and rep["kv_corruptions"] == 0
        assert rep["completed"] + rep["aborts"] == rep["requests"] == 60
    # Same decisions, same outcome on every rank.
    same = (
        "completed",
        "aborts",
        "aborts_in_transfer",
        "aborts_in_decode",
        "retractions",
        "steps",
        "transfers",
        "output_tokens",
        "computed_tokens",
    )
    a, b = (r["report"] for r in res["ranks"])
    assert {k: a[k] for k in same} == {k: b[k] for k in same}
    assert "0 mismatches" in format_summary(res)
    assert "tensor parallel: 2 ranks," in format_summary(res)
    assert "tensor parallel: 1 rank," in format_summary({**res, "world": 1})


def test_the_check_names_what_differs() -> None:
    assert check_agreed([5, -5, 2, -2, 1, 0]) is None
    assert check_agreed([5, -7, 2, -2]) == "batch hashes 5..7"
    assert check_agreed([5, -5, 1, -2]) == "transfers in flight 1..2"


def _rank_with_a_slower_forward(
    rank: int, world: int, init: str, out_dir: str, cfg: dict[str, object], reclaim: str
) -> None:
    """Rank 1's forward steps take three times as long: its fences complete
    later than rank 0's, as a slower GPU's or a busier host's would."""
    from scheduler_demo import tp as tpm

    if rank == 1:
        cfg = {**cfg, "forward_ms": 3 * float(cfg["forward_ms"])}  # type: ignore[arg-type]
    tpm._rank_main(rank, world, init, out_dir, cfg, reclaim)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("reclaim", ["auto", "explicit"])
def test_auto_pools_diverge_and_the_check_says_so(
    reclaim: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The control: the same replicas with reclaim="auto" pools decide by
    local fence timing; the per-iteration check fails every rank. Rank 1 is
    made slower, so the control fails by construction, not by the luck of
    the two ranks' timing (the natural skew missed once in a CI run); the
    explicit pools agree all the same."""
    from scheduler_demo import tp as tpm

    monkeypatch.setattr(tpm, "_rank_main", _rank_with_a_slower_forward)
    cfg = DemoConfig(num_requests=100, progress=False, timeout_s=120.0)
    if reclaim == "auto":
        with pytest.raises(TPMismatchError, match="ranks diverged"):
            run_tp(cfg, 2, reclaim="auto")
    else:
        assert run_tp(cfg, 2)["mismatches"] == 0


def _rank_with_reversed_pages(rank: int, *args: object) -> None:
    """A rank 1 that lays out each request's pages in reverse: its batches
    name the same rows and lengths, but other KV slots."""
    from scheduler_demo import tp as tpm

    add_pages = tpm.TPScheduler._add_pages

    def reversed_pages(self: object, req: object, pages: object) -> None:
        if getattr(self, "rank", 0) == 1 and pages.numel() > 1:  # type: ignore[attr-defined]
            pages = pages.flip(0)  # type: ignore[attr-defined]
        add_pages(self, req, pages)  # type: ignore[arg-type]

    tpm.TPScheduler._add_pages = reversed_pages  # type: ignore[method-assign,assignment]
    tpm._rank_main(rank, *args)  # type: ignore[arg-type]


@pytest.mark.timeout(240)
def test_the_batch_check_sees_the_kv_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    """The batch hash named rows and lengths only: ranks writing different
    KV pages passed with 0 mismatches."""
    from scheduler_demo import tp as tpm

    monkeypatch.setattr(tpm, "_rank_main", _rank_with_reversed_pages)
    cfg = DemoConfig(num_requests=40, progress=False, timeout_s=120.0)
    with pytest.raises(TPMismatchError, match="batch hashes"):
        run_tp(cfg, 2)


@pytest.mark.timeout(120)
def test_timeout_is_kept_over_all_ranks() -> None:
    """Each rank blocks its loop in collectives, so a rank cannot time itself
    out: --timeout under --tp waited for gloo's own 120 s."""
    import time

    cfg = DemoConfig(num_requests=100_000, progress=False, timeout_s=2.0)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"--timeout 2\.0"):
        run_tp(cfg, 2)
    assert time.monotonic() - t0 < 60


def _rank_that_serves_for_a_minute(*args: object) -> None:
    import time

    time.sleep(60)


@contextlib.contextmanager
def _ranks_that_sleep(
    monkeypatch: pytest.MonkeyPatch, on_third_join: Callable[[], None]
) -> Iterator[list[Any]]:
    """``run_tp`` spawns ranks that sleep for a minute, and ``on_third_join``
    runs in the parent's third wait for them; yields the spawn contexts
    started, whose ranks are killed afterwards whatever happened."""
    import sys

    from scheduler_demo import tp as tpm

    spawn_module = sys.modules["torch.multiprocessing.spawn"]
    real_spawn = spawn_module.spawn
    started: list[Any] = []

    def spawn_and_hook(*args: Any, **kwargs: Any) -> Any:
        context = real_spawn(*args, **kwargs)
        started.append(context)
        join = context.join
        calls = [0]

        def hooked_join(timeout: float | None = None) -> bool:
            calls[0] += 1
            if calls[0] == 3:
                on_third_join()
            return bool(join(timeout))

        context.join = hooked_join
        return context

    monkeypatch.setattr(tpm, "_rank_main", _rank_that_serves_for_a_minute)
    monkeypatch.setattr(spawn_module, "spawn", spawn_and_hook)
    try:
        yield started
    finally:
        for context in started:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                process.join()


def _ctrl_c() -> None:
    raise KeyboardInterrupt  # Ctrl-C while the ranks run


@pytest.mark.timeout(120)
def test_an_interrupted_run_leaves_no_rank_running(monkeypatch: pytest.MonkeyPatch) -> None:
    """A KeyboardInterrupt (or any error) in the waiting parent kills the
    ranks: they used to keep serving, and the interrupted parent, at its
    exit, waited for them (multiprocessing joins the children it started)."""
    cfg = DemoConfig(num_requests=10, progress=False, timeout_s=100.0)
    with _ranks_that_sleep(monkeypatch, _ctrl_c) as started:
        with pytest.raises(KeyboardInterrupt):
            run_tp(cfg, 2)
        (context,) = started
        assert [p.is_alive() for p in context.processes] == [False, False]


@pytest.mark.timeout(120)
def test_a_sigterm_to_the_parent_leaves_no_rank_running(monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM used to end the parent on the spot, the ranks orphaned and
    serving on; while they run it raises SystemExit(143) in the parent, whose
    cleanup kills them, and the previous handler is back afterwards."""
    import os
    import signal

    def before(signum: int, frame: object) -> None:
        raise AssertionError("the run's own handler should have been in place")

    def kill_parent() -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # `kill <parent pid>`

    previous = signal.signal(signal.SIGTERM, before)
    cfg = DemoConfig(num_requests=10, progress=False, timeout_s=100.0)
    try:
        with _ranks_that_sleep(monkeypatch, kill_parent) as started:
            with pytest.raises(SystemExit) as exc:
                run_tp(cfg, 2)
            assert exc.value.code == 143
            (context,) = started
            assert [p.is_alive() for p in context.processes] == [False, False]
            assert signal.getsignal(signal.SIGTERM) is before
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.timeout(120)
def test_a_second_signal_while_the_ranks_are_reaped_still_restores_sigterm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A second Ctrl-C (or SIGTERM) while the cleanup reaps the ranks ends
    it early, but the SIGTERM handler run_tp installed must not outlive the
    call: it would turn any later SIGTERM to this process into a
    SystemExit raised wherever the main thread happens to be."""
    import signal
    import sys

    from scheduler_demo import tp as tpm

    spawn_module = sys.modules["torch.multiprocessing.spawn"]
    real_spawn = spawn_module.spawn
    real_kill = tpm._kill_ranks
    started: list[Any] = []

    def spawn_then_interrupt(*args: Any, **kwargs: Any) -> Any:
        context = real_spawn(*args, **kwargs)
        started.append(context)

        def interrupted_join(timeout: float | None = None) -> bool:
            raise KeyboardInterrupt  # the first Ctrl-C

        context.join = interrupted_join
        return context

    def kill_then_interrupted(processes: list[Any]) -> None:
        real_kill(processes)
        raise KeyboardInterrupt  # the second, while reaping

    def before(signum: int, frame: object) -> None:
        raise AssertionError("not called")

    previous = signal.signal(signal.SIGTERM, before)
    monkeypatch.setattr(tpm, "_rank_main", _rank_that_serves_for_a_minute)
    monkeypatch.setattr(tpm, "_kill_ranks", kill_then_interrupted)
    monkeypatch.setattr(spawn_module, "spawn", spawn_then_interrupt)
    cfg = DemoConfig(num_requests=10, progress=False, timeout_s=100.0)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_tp(cfg, 2)
        assert signal.getsignal(signal.SIGTERM) is before
    finally:
        signal.signal(signal.SIGTERM, previous)
        for context in started:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                process.join()


def _summary(corruptions: list[int]) -> dict[str, object]:
    return {
        "world": len(corruptions),
        "steps": 10,
        "checks": 20,
        "mismatches": 0,
        "agree_ms_per_step": 0.1,
        "agree_fraction": 0.01,
        "step_ms": 10.0,
        "exchange_ms_per_step": 0.2,
        "ranks": [{"report": {"corruptions": c, "kv_corruptions": 0}} for c in corruptions],
    }


@pytest.mark.parametrize(
    "corruptions, unsafe, status",
    [([0, 0], False, 0), ([0, 1], False, 1), ([0, 0], True, 1), ([1, 0], False, 1)],
)
def test_the_tp_exit_status_counts_every_rank(
    monkeypatch: pytest.MonkeyPatch, corruptions: list[int], unsafe: bool, status: int
) -> None:
    """It read rank 0's report only, and exited 0 for a clean --unsafe run."""
    from scheduler_demo import cli
    from scheduler_demo import tp as tpm

    monkeypatch.setattr(tpm, "run_tp", lambda cfg, world, reclaim: _summary(corruptions))
    argv = ["--tp", "2", "--no-progress"] + (["--unsafe"] if unsafe else [])
    assert cli.main(argv) == status


# -- the two guards on a client abort, driven by hand on one rank ---------------
# A TP run cannot reach them on demand (a timer fires between iterations, a
# retraction happens inside one), so these drive a one-rank TPScheduler
# directly: a request admitted and in transfer, its abort timer's callback
# called by hand, the per-iteration exchange run by hand.


#: One request on a small pool, whose transfer is not due while a test runs:
#: it holds its row and pages in transfer until the test lands it.
ONE_REQUEST_IN_TRANSFER = DemoConfig(
    num_requests=1,
    rows=4,
    max_context_len=64,
    kv_pages=16,
    page_size=4,
    transfer_ms=600_000.0,
    progress=False,
)


def grant_first_request(sched: Any, pool: Any) -> Any:
    """Admit ``sched``'s first request now, as the scheduler's
    ``_admit_more`` does when ``try_admit`` answers: it holds its row and its
    first pages, and its prompt's KV transfer has started."""
    from scheduler_demo.scheduler import TRANSFER

    req = sched.reqs[0]
    n = sched._need_pages(req)
    grant = pool.try_admit(pages=n)
    assert grant is not None
    req.row = grant.row
    sched.pages_held += n
    sched._granted(req, grant.pages)
    assert req.state == TRANSFER and req.transfer is not None
    return req


@contextlib.asynccontextmanager
async def _one_rank_in_transfer(group: Any) -> AsyncIterator[tuple[Any, Any]]:
    """A one-rank TPScheduler whose only request holds a row and pages and
    waits for a transfer that does not land during the test."""
    from asyncpool import AsyncReqToTokenPool, KVPagePool
    from scheduler_demo.forward import Forward
    from scheduler_demo.tp import TPScheduler
    from scheduler_demo.transfer import TransferEngine
    from scheduler_demo.workload import RequestSpec

    cfg = ONE_REQUEST_IN_TRANSFER
    specs = [RequestSpec(0, 0.0, 8, 4)]
    forward = Forward("cpu")
    transfers = TransferEngine("cpu", cfg.transfer_ms, 8.0)
    kv_pages = KVPagePool(cfg.kv_pages + 1, cfg.page_size, reclaim="explicit")
    kv = torch.zeros((cfg.kv_pages + 1) * cfg.page_size, dtype=torch.int64)
    try:
        async with AsyncReqToTokenPool(
            cfg.rows + 1, cfg.max_context_len, kv=kv_pages, reclaim="explicit"
        ) as pool:
            forward.attach(pool.req_to_token, pool.verified_lens, kv)
            transfers.attach(kv)
            sched = TPScheduler(
                cfg, pool, kv_pages, forward, transfers, specs, group=group, rank=0, world=1
            )
            req = grant_first_request(sched, pool)
            try:
                yield sched, req
            finally:
                await sched._stop_tasks()
    finally:
        forward.close()
        transfers.close()


async def test_rank0_queues_an_abort_only_for_the_requests_current_transfer(
    group: Any,
) -> None:
    """Rank 0 broadcasts a fired abort timer only if its transfer is still the
    request's (a timer of an earlier transfer is stale; mutant: no
    ``req.transfer is t`` test), and no other rank queues one (they learn of
    aborts from rank 0)."""
    async with bounded(), _one_rank_in_transfer(group) as (sched, req):
        stale = object()  # the handle of a transfer the request no longer has
        sched._client_abort(req, stale)
        assert sched._aborted == []
        sched.rank = 1
        sched._client_abort(req, req.transfer)
        assert sched._aborted == []
        sched.rank = 0
        sched._client_abort(req, req.transfer)
        assert sched._aborted == [(req.spec.rid, req.epoch)]


async def test_the_exchange_applies_an_abort_only_to_the_epoch_it_fired_in(
    group: Any,
) -> None:
    """An abort broadcast with an epoch the request has left (retracted since
    the timer fired) is dropped on every rank alike (mutant: no
    ``req.epoch == epoch`` test, which aborts the request's new life); one
    with the current epoch aborts the request and frees its row."""
    from scheduler_demo.scheduler import ABORTED, TRANSFER

    async with bounded(), _one_rank_in_transfer(group) as (sched, req):
        row, epoch = req.row, req.epoch
        sched._aborted = [(req.spec.rid, epoch - 1)]
        sched._exchange()
        assert req.state == TRANSFER and req.row == row
        assert sched.aborted == 0 and sched.pool.stats().allocated == 1
        sched._aborted = [(req.spec.rid, epoch)]
        sched._exchange()
        assert req.state == ABORTED and req.row == -1
        assert sched.aborted == 1 and sched.aborts_in_transfer == 1
        assert sched.pool.stats().allocated == 0


async def test_the_exchange_is_timed_with_auto_pools_too(group: Any) -> None:
    """``--tp-reclaim auto`` reported 0 ms of exchange: the auto path
    returned before adding the broadcast's and all-reduce's time."""
    async with bounded(), _one_rank_in_transfer(group) as (sched, _):
        sched.explicit = False  # what an "auto" pool makes it
        sched._exchange()
        assert sched.exchange_s > 0.0 and sched.iterations == 1
