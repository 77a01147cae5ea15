"""A row recorded with a new transfer handle every step keeps only those still open.

A row's recorded uses keep the newest fence per stream, but every fence of
unknown origin (a transfer handle) recorded for it stayed in its uses until
the row was freed, landed or not. An engine that records ``record_use(rows,
[step, transfer])`` every step (disaggregated prefill sending KV chunk by
chunk, a layer-wise transfer per step) grew each row's uses by one a step:
5,000 steps left 5,001 fences on the row, a step's ``record_use`` took 30x
longer at the end than at the start (0.39 s of record_use over the
request's life), the free 1.1 ms, and every landed handle (which may own
buffers) stayed alive until the free.

Now a record that makes a row's uses longer than a few asks some of their
handles (two per handle it adds, in turn) and drops those that landed.
Checked here: the uses stay short over thousands of steps, on both record
paths and with rows of two histories still sharing one use per history; a
landed handle is collected; a handle still open stays and its row (and
the row's pages) waits for it at free; a faulting one stays, is not
counted until the free, and quarantines there; a ``query()`` raising what
is not an ``Exception`` leaves the rows' uses as they were; each handle is
asked once per call; an explicit pool asks nothing and drops nothing; a
step's ``record_use`` costs the same after thousands of steps.
"""

from __future__ import annotations

import asyncio
import gc
import time
import weakref
from typing import Any

import pytest
from helpers import FakeFence, FakeStream

from asyncpool import AsyncReqToTokenPool, KVPagePool, ReqToTokenPool, ledger

STEPS = 2_000
#: Uses longer than this after a record get some of their handles asked
#: (asyncpool.ledger._PRUNE_AT; the interruption test checks it).
PRUNE_AT = 8
#: A row recorded with one new handle a step keeps about twice its handles
#: still open plus PRUNE_AT: here one or two are open at a time.
BOUND = PRUNE_AT + 4

# Faults log at ERROR: quiet, for these tests only (conftest).
pytestmark = pytest.mark.usefixtures("quiet_asyncpool_logs")


class Transfer:
    """A transfer handle (a fence of unknown origin): landed, failed or
    interrupting on cue, counting its queries; weakly referenceable."""

    __slots__ = ("__weakref__", "answer", "landed", "queries", "raises")

    def __init__(self) -> None:
        self.landed = False
        self.raises: BaseException | None = None
        self.answer: Any = None  # not None: query() answers it (neither yes nor no)
        self.queries = 0

    def query(self) -> Any:
        self.queries += 1
        if self.raises is not None:
            raise self.raises
        if self.answer is not None:
            return self.answer
        return self.landed

    def synchronize(self) -> None:
        raise AssertionError("never called by the pool")


def _fences(use: Any) -> tuple[Any, ...]:
    return () if use is None else use if use.__class__ is tuple else (use,)


def _uses(pool: ReqToTokenPool | AsyncReqToTokenPool, row: int) -> tuple[Any, ...]:
    return _fences(pool._ledger._uses[row])


def _steps(
    pool: ReqToTokenPool | AsyncReqToTokenPool,
    rows: list[int],
    n: int,
    forward: FakeStream,
    how: str = "list",
) -> list[weakref.ref[Transfer]]:
    """``n`` steps, each recorded on ``rows`` with its forward fence and a
    transfer, which lands (with the step) before the next step is recorded;
    weak references to the transfers."""
    refs = []
    for _ in range(n):
        step, transfer = forward.record(), Transfer()
        if how == "list":
            pool.record_use(rows, [step, transfer])
        else:
            pool.record_use(rows, step)
            pool.record_use(rows, transfer)
        refs.append(weakref.ref(transfer))
        forward.complete()
        transfer.landed = True
        del transfer
    return refs


@pytest.mark.parametrize("how", ["list", "one by one"])
def test_a_rows_uses_stay_short_over_thousands_of_steps(how: str) -> None:
    pool = ReqToTokenPool(10, 4)
    rows = pool.alloc(8)
    assert rows is not None
    forward = FakeStream()
    longest = 0
    for _ in range(STEPS // 100):
        _steps(pool, rows, 100, forward, how)
        longest = max(longest, len(_uses(pool, rows[0])))
    assert longest <= BOUND, f"{longest} fences on a row after {STEPS} steps"
    assert len({id(pool._ledger._uses[r]) for r in rows}) == 1  # one use for the step's rows
    assert pool.free(rows) == len(rows)
    pool.check_invariants()


def test_landed_handles_are_not_kept_alive() -> None:
    pool = ReqToTokenPool(4, 4)
    rows = pool.alloc(2)
    assert rows is not None
    refs = _steps(pool, rows, STEPS, FakeStream())
    gc.collect()
    alive = sum(ref() is not None for ref in refs)
    assert alive <= BOUND, f"{alive} of {STEPS} landed handles still alive"
    assert refs[0]() is None


@pytest.mark.parametrize("pattern", ["in order", "in turn"])
def test_rows_of_two_histories_keep_one_short_use_each(pattern: str) -> None:
    """Rows admitted at different steps hold different uses; a batch of
    both, in either order, keeps one use per history, pruned once."""
    pool = ReqToTokenPool(20, 4)
    forward = FakeStream()
    early, late = pool.alloc(8), pool.alloc(8)
    assert early is not None and late is not None
    _steps(pool, early, 20, forward)
    pool.record_use(late, forward.record())
    if pattern == "in order":
        batch = early + late
    else:
        batch = [r for pair in zip(early, late, strict=True) for r in pair]
    _steps(pool, batch, STEPS, forward)
    for rows in (early, late):
        assert len({id(pool._ledger._uses[r]) for r in rows}) == 1
        assert len(_uses(pool, rows[0])) <= BOUND
    assert pool.free(batch) == len(batch)
    pool.check_invariants()


def test_each_handle_is_asked_once_per_call() -> None:
    """Two histories hold the same handles: one record asks each once."""
    pool = ReqToTokenPool(20, 4)
    forward = FakeStream()
    early, late = pool.alloc(4), pool.alloc(4)
    assert early is not None and late is not None
    pool.record_use(early, FakeStream().record())  # the two histories differ
    shared = [Transfer() for _ in range(PRUNE_AT)]
    pool.record_use(early + late, [forward.record(), *shared])
    for t in shared:
        t.landed = True
    pool.record_use(early + late, [forward.record(), Transfer()])  # asks 2 of them
    assert sorted(t.queries for t in shared) == [0] * (PRUNE_AT - 2) + [1, 1]
    for rows in (early, late):
        assert not any(f in shared[:2] for f in _uses(pool, rows[0]))
    pool.check_invariants()


def test_an_open_handle_stays_and_its_row_waits_for_it() -> None:
    pool = ReqToTokenPool(10, 4)
    rows = pool.alloc(8)
    assert rows is not None
    forward = FakeStream()
    stuck = Transfer()
    pool.record_use(rows, [forward.record(), stuck])
    _steps(pool, rows, STEPS, forward)
    uses = _uses(pool, rows[0])
    assert stuck in uses and len(uses) <= BOUND
    assert stuck.queries > 0  # asked, in turn, and kept
    assert pool.free(rows) == 0
    assert pool.reclaim() == 0
    stuck.landed = True
    assert pool.reclaim() == len(rows)
    pool.check_invariants()


async def test_a_rows_pages_wait_for_its_open_handle() -> None:
    kv = KVPagePool(9, 4)
    pool = AsyncReqToTokenPool(3, 4, kv=kv)
    g = pool.try_admit(4)
    assert g is not None
    forward = FakeStream()
    stuck = Transfer()
    pool.record_use([g.row], [forward.record(), stuck])
    _steps(pool, [g.row], STEPS // 4, forward)
    assert stuck in _uses(pool, g.row) and len(_uses(pool, g.row)) <= BOUND
    assert pool.free([g.row]) == 0
    assert (pool.stats().pending, kv.pending_size()) == (1, 4)
    stuck.landed = True
    assert pool.reclaim() == 1
    assert kv.pending_size() == 0
    pool.check_invariants()
    kv.check_invariants()


@pytest.mark.parametrize("fault", ["raises", "neither yes nor no"])
def test_a_faulting_handle_stays_and_quarantines_at_free(fault: str) -> None:
    pool = ReqToTokenPool(10, 4)
    rows = pool.alloc(8)
    assert rows is not None
    forward = FakeStream()
    failed = Transfer()
    if fault == "raises":
        failed.raises = RuntimeError("the peer is gone")
    else:
        failed.answer = "FAILED"  # a status string: a fault
    pool.record_use(rows, [forward.record(), failed])
    _steps(pool, rows, STEPS, forward)
    uses = _uses(pool, rows[0])
    assert failed in uses and len(uses) <= BOUND
    assert failed.queries > 0
    assert pool.stats().fence_errors == 0  # asked while recording: not yet a fault
    assert pool.free(rows) == 0
    stats = pool.stats()
    assert (stats.quarantined, stats.fence_errors) == (len(rows), 1)
    pool.check_invariants()


@pytest.mark.parametrize("error", [KeyboardInterrupt, asyncio.CancelledError])
@pytest.mark.parametrize("how", ["list", "one fence"])
def test_an_interrupted_prune_leaves_the_rows_uses_as_they_were(
    error: type[BaseException], how: str
) -> None:
    pool = ReqToTokenPool(10, 4)
    rows = pool.alloc(4)
    assert rows is not None
    forward = FakeStream()
    handles = [Transfer() for _ in range(PRUNE_AT - 1)]
    pool.record_use(rows, [forward.record(), *handles])
    led = pool._ledger
    before = [led._uses[r] for r in rows]
    assert len(_fences(before[0])) == PRUNE_AT
    state = led.state_bytes()
    handles[0].raises = error()
    added = Transfer()
    with pytest.raises(error):
        if how == "list":
            pool.record_use(rows, [forward.record(), added])
        else:
            pool.record_use(rows, added)
    assert getattr(ledger, "_PRUNE_AT", None) == PRUNE_AT  # that record grew past it
    assert all(led._uses[r] is use for r, use in zip(rows, before, strict=True))
    assert led.state_bytes() == state
    pool.check_invariants()
    # Asked again at the next record, once it answers.
    handles[0].raises = None
    handles[0].landed = True
    pool.record_use(rows, added)
    assert handles[0] not in _uses(pool, rows[0]) and added in _uses(pool, rows[0])
    pool.check_invariants()


def test_an_explicit_pool_asks_nothing_and_drops_nothing() -> None:
    """No fence is asked with reclaim="explicit" (the ranks must decide
    alike): a row keeps every handle recorded on it until its free, as
    before (the contracts' *fences* row in docs/api.md says so)."""
    pool = ReqToTokenPool(4, 4, reclaim="explicit")
    rows = pool.alloc(2)
    assert rows is not None
    forward = FakeStream()
    handles = []
    for _ in range(200):
        step, transfer = forward.record(), Transfer()
        pool.record_use(rows, [step, transfer])
        transfer.landed = True
        handles.append(transfer)
    assert len(_uses(pool, rows[0])) == 201
    assert not any(t.queries for t in handles)
    step = _uses(pool, rows[0])[0]
    assert isinstance(step, FakeFence)
    assert pool.free(rows) == 0
    assert not any(t.queries for t in handles)
    pool.check_invariants()


def _record_seconds(steps: int, tries: int) -> float:
    """The best time of a step's record_use after ``steps`` steps."""
    pool = ReqToTokenPool(66, 4)
    rows = pool.alloc(64)
    assert rows is not None
    forward = FakeStream()
    _steps(pool, rows, steps, forward)
    best = float("inf")
    for _ in range(tries):
        step, transfer = forward.record(), Transfer()
        t0 = time.thread_time()
        pool.record_use(rows, [step, transfer])
        best = min(best, time.thread_time() - t0)
        forward.complete()
        transfer.landed = True
    return best


def test_a_steps_record_costs_the_same_after_thousands_of_steps() -> None:
    """About 1x with the prune; about 30x before it (the uses copied whole
    at every record). Timed on the calling thread's CPU clock, which other
    processes on a loaded machine do not move; the bound leaves room."""
    early = _record_seconds(20, 9)
    late = _record_seconds(8_000, 9)
    ratio = late / max(early, 1e-7)
    assert ratio < 8, f"after 8,000 steps {late * 1e6:.1f} us, after 20 {early * 1e6:.1f} us"
