"""Gaps found by a mechanical mutation sweep of ``agreement.py``.

Each test pins one behaviour that an ``ast``-generated mutant broke while
every test file that exercises the module (the spawned gloo ranks of
``test_tp.py`` and ``test_demo_tp.py`` included) still passed, unless it
says otherwise.

Two ranks run here as two threads of this process (:class:`ThreadRanks`):
``torch.distributed.all_reduce`` is replaced by an exchange that gives each
rank the element-wise MIN of every rank's tensor, as gloo does across
processes, so ``agree()`` runs all of its own code on every rank.

* done is agreed by MIN over ranks, overdue and faulted by MAX, and every
  rank then hands out the same ids (the in-process counterpart of
  ``test_tp.py``'s spawned scenarios, which alone killed the mutants that
  negated no flag, or one flag of each triple, or the wrong ones);
* ranks with different batch counts, one of them past ``WIDTH`` and the
  other with more flags than two thirds of the first all-reduce, send
  tensors as long as each other and all raise ``AgreementError`` (the
  mutants sent more or fewer flags in the first all-reduce, so its length
  followed the batch count: gloo aborts or hangs on mismatched sizes);
* a rank whose first ledger holds rows and one whose first ledger holds
  pages disagree even when every count matches, and the error names what
  each ledger slot holds, for every slot that differs (the mutants gave
  rows and pages the same kind, so the ranks went on with different
  ledgers; named a kind by the wrong word; or stopped at the first slot);
* as many pending rows or pages, in as many batches, but other ones on
  each rank disagree, on the CRC-32 of the pending ids alone, and nothing
  changes (the mutants left page ids out of the CRC, so the ranks went on
  and later handed out different pages);
* a slot holding a ledger of plain ids on one rank and nothing on another
  is named so (the mutants named the kinds by the wrong words);
* a rank that has no timeout (``overdue_after=None``) logs a fence that
  another rank's timeout made overdue, naming it so (a library defect
  the sweep's reading found: the warning was formatted with ``"%.3g" %
  None`` and lost on that rank, a logging traceback in its place);
* ``Agreement.quarantined`` counts what this call quarantined, not what
  earlier ones did (the mutant added the ledger's earlier count);
* ``Agreement.seconds`` is the call's own wall time (the mutant added the
  clock's reading instead of subtracting it);
* the first all-reduce reuses one buffer per thread, call after call, and
  the second (its length follows the batches past ``WIDTH``) keeps none
  (the mutants built a fresh tensor each call, the cost the buffer saves,
  or kept one per length seen);
* a third ledger is refused with ``ValueError`` before any collective (the
  header has two slots, a pool's rows and its pages: the mutants went on
  with a header longer than its slots, or made room for three);
* the same ledger twice is refused with ``ValueError`` before any
  collective (a library defect the sweep's reading found: both slots
  settled the same batches, releasing every id twice, or quarantining it
  twice);
* without torch.distributed initialised ``agree()`` raises the
  ``RuntimeError`` that says so, whatever the order the tests run in (the
  test of ``test_explicit.py`` skips once a module's group is live, and
  the mutants then went on into ``dist.get_backend``);
* over NCCL the all-reduced tensor lives on the current CUDA device (the
  mutants put it on the CPU, or on no device at all); checked without a
  GPU by standing in for the backend's name and the current device.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import WAIT_S

import asyncpool.agreement as agreement
from asyncpool import AgreementError, KVPagePool, ReqToTokenPool
from asyncpool.agreement import WIDTH, agree
from asyncpool.deferral import Deferrals


class ThreadRanks:
    """``n`` ranks as threads of this process.

    While installed (the :func:`ranks` fixture), ``torch.distributed.all_reduce``
    with ``ReduceOp.MIN`` waits for every rank's tensor and gives each rank
    the element-wise minimum, as gloo does across processes; tensors of
    different lengths fail the call (gloo would abort or hang).
    """

    def __init__(self, n: int) -> None:
        self.n = n
        self._barrier = threading.Barrier(n, timeout=WAIT_S)
        self._sent: dict[int, torch.Tensor] = {}
        self._local = threading.local()

    def all_reduce(self, t: torch.Tensor, op: Any = None, group: Any = None) -> None:
        assert op == dist.ReduceOp.MIN
        rank: int = self._local.rank
        self._sent[rank] = t.clone()
        self._barrier.wait()
        lengths = {len(v) for v in self._sent.values()}
        out = torch.stack([self._sent[r] for r in range(self.n)]).min(dim=0).values
        self._barrier.wait()
        assert len(lengths) == 1, f"the ranks sent tensors of different lengths: {lengths}"
        t.copy_(out)

    def run(self, fn: Callable[[int], Any]) -> list[Any]:
        """Call ``fn(rank)`` on every rank at once; return each rank's result,
        or the exception it raised (as its result). Bounded by ``WAIT_S``."""
        out: list[Any] = [None] * self.n

        def body(rank: int) -> None:
            self._local.rank = rank
            try:
                out[rank] = fn(rank)
            except BaseException as exc:  # handed to the test, per rank
                out[rank] = exc

        threads = [threading.Thread(target=body, args=(r,), name=f"rank{r}") for r in range(self.n)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(WAIT_S)
        assert not any(th.is_alive() for th in threads), "a rank hung in agree()"
        return out


@pytest.fixture
def ranks(group: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[ThreadRanks]:
    """Two thread ranks over the one-rank gloo group (what ``agree()``
    checks it was given); the all-reduce is the threads' exchange."""
    tr = ThreadRanks(2)
    monkeypatch.setattr(dist, "all_reduce", tr.all_reduce)
    yield tr


def _disagreements(results: list[Any]) -> list[str]:
    for res in results:
        assert isinstance(res, AgreementError), results
    messages = [str(res) for res in results]
    assert len(set(messages)) == 1, messages  # the same words on every rank
    return messages


def _rows_freed_one_per_batch(
    ranks: ThreadRanks, pools: list[ReqToTokenPool], states: list[list[str]]
) -> None:
    """Rank ``r`` frees ``len(states[r])`` rows, one batch each, behind a
    handle in state ``states[r][i]``; the rows are the same on every rank."""

    def free(rank: int) -> list[int]:
        rows = pools[rank].alloc(len(states[rank]))
        assert rows is not None
        for row, state in zip(rows, states[rank], strict=True):
            pools[rank].free([row], fence=_Handle(state))
        return rows

    got = ranks.run(free)
    assert all(isinstance(rows, list) for rows in got), got


def test_each_flag_is_reduced_over_the_ranks_its_own_way(ranks: ThreadRanks, group: Any) -> None:
    # Per batch, (rank 0's transfer, rank 1's transfer).
    cases = [
        ("done", "done"),  # released
        ("done", "pending"),  # overdue (not done on rank 1)
        ("done", "failed"),  # quarantined (faulted on rank 1)
        ("failed", "pending"),  # quarantined (faulted on rank 0)
        ("pending", "pending"),  # overdue
    ]
    pools = [ReqToTokenPool(8, 4, reclaim="explicit") for _ in range(2)]
    _rows_freed_one_per_batch(ranks, pools, [[c[r] for c in cases] for r in range(2)])
    res = ranks.run(lambda r: agree(group, [pools[r]._ledger], overdue_after=0.0))
    for r, pool in enumerate(pools):
        assert not isinstance(res[r], BaseException), res
        assert (res[r].released, res[r].quarantined, res[r].newly_overdue) == ((1,), 2, 2)
        assert pool.pending_size() == 2 and pool.quarantined_size() == 2
        pool.check_invariants()
    left = ranks.run(lambda r: pools[r].alloc(pools[r].available_size()))
    assert left[0] == left[1] and len(left[0]) == 3


def test_a_rank_without_a_timeout_logs_the_fence_another_ranks_timeout_made_overdue(
    ranks: ThreadRanks, group: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # Overdue is agreed (MAX over ranks), so a rank that has no timeout
    # (overdue_after=None) learns of an overdue fence too; its warning was
    # formatted with "%.3g" % None and lost, a logging traceback instead.
    pools = [ReqToTokenPool(4, 4, reclaim="explicit") for _ in range(2)]
    _rows_freed_one_per_batch(ranks, pools, [["pending"], ["pending"]])
    timeouts = [None, 0.0]
    with caplog.at_level(logging.WARNING, logger="asyncpool.agreement"):
        res = ranks.run(lambda r: agree(group, [pools[r]._ledger], overdue_after=timeouts[r]))
    assert [r.newly_overdue for r in res] == [1, 1], res
    messages = [r.getMessage() for r in caplog.records]  # raises if unformattable
    assert len(messages) == 2
    for when in ("0 s after the free", "past another rank's fence timeout (none here)"):
        assert sum(f"not done on at least one rank {when}" in m for m in messages) == 1


@pytest.mark.parametrize("counts", [(1, 2), (WIDTH - 14, WIDTH + 6)], ids=["few", "wide"])
def test_different_batch_counts_disagree_in_a_tensor_as_long_on_every_rank(
    ranks: ThreadRanks, group: Any, counts: tuple[int, int]
) -> None:
    # The header is checked after the first all-reduce: its tensor must be
    # as long on every rank whatever the counts (more flags than the first
    # all-reduce carries on one rank, fewer on the other, included).
    pools = [ReqToTokenPool(WIDTH + 8, 4, reclaim="explicit") for _ in range(2)]
    _rows_freed_one_per_batch(ranks, pools, [["pending"] * n for n in counts])
    (msg, _) = _disagreements(ranks.run(lambda r: agree(group, [pools[r]._ledger])))
    assert f"rows pending batches {counts[0]}..{counts[1]}" in msg
    for pool, n in zip(pools, counts, strict=True):
        assert pool.pending_size() == n
        pool.check_invariants()


def test_rows_on_one_rank_and_pages_on_another_disagree_in_every_slot(
    ranks: ThreadRanks, group: Any
) -> None:
    # As many free ids in each, nothing pending: only the kind differs.
    rows = [ReqToTokenPool(9, 4, reclaim="explicit") for _ in range(2)]
    pages = [KVPagePool(9, 4, reclaim="explicit") for _ in range(2)]
    assert rows[0].available_size() == pages[0].available_size()
    order: list[list[Deferrals[Any]]] = [
        [rows[0]._ledger, pages[0].ledger],
        [pages[1].ledger, rows[1]._ledger],
    ]
    (msg, _) = _disagreements(ranks.run(lambda r: agree(group, order[r])))
    assert "ledger 1 holds rows on one rank and pages on another" in msg
    assert "ledger 2 holds rows on one rank and pages on another" in msg
    every: list[ReqToTokenPool | KVPagePool] = [*rows, *pages]
    for pool in every:
        assert pool.available_size() == 8
        pool.check_invariants()


@pytest.mark.parametrize("unit", ["rows", "pages"])
def test_as_many_pending_ids_but_other_ones_disagree(
    ranks: ThreadRanks, group: Any, unit: str
) -> None:
    pools: list[Any] = [
        ReqToTokenPool(9, 4, reclaim="explicit")
        if unit == "rows"
        else KVPagePool(9, 4, reclaim="explicit")
        for _ in range(2)
    ]
    fences = [_Handle("pending"), _Handle("pending")]

    def free_other_ids(rank: int) -> None:
        got = pools[rank].alloc(4)
        assert got is not None
        pools[rank].free(got[rank * 2 : rank * 2 + 2], fence=fences[rank])

    assert ranks.run(free_other_ids) == [None, None]
    ledgers = [pool._ledger for pool in pools]
    (msg, _) = _disagreements(ranks.run(lambda r: agree(group, [ledgers[r]])))
    assert f"{unit} pending ids (crc32)" in msg and "pending batches" not in msg
    for pool in pools:
        assert pool.pending_size() == 2 and pool.available_size() == 4
        pool.check_invariants()


@pytest.mark.parametrize("unit", ["rows", "pages"])
def test_the_same_ids_split_into_batches_differently_disagree(
    ranks: ThreadRanks, group: Any, unit: str
) -> None:
    """The same ids in the same order, in as many batches, but cut at other
    places: the first agreement would release other ids on each rank (one
    batch's fence done, the other's not), so the CRC covers each batch's
    size too. Found by a review: the ranks went on, apart, one call longer."""
    pools: list[Any] = [
        ReqToTokenPool(9, 4, reclaim="explicit")
        if unit == "rows"
        else KVPagePool(9, 4, reclaim="explicit")
        for _ in range(2)
    ]
    done, pending = [_Handle("done"), _Handle("done")], [_Handle("pending"), _Handle("pending")]

    def free_cut(rank: int) -> None:
        got = pools[rank].alloc(3)
        assert got is not None
        cut = 2 - rank  # rank 0: [1, 2] + [3]; rank 1: [1] + [2, 3]
        pools[rank].free(got[:cut], fence=done[rank])
        pools[rank].free(got[cut:], fence=pending[rank])

    assert ranks.run(free_cut) == [None, None]
    ledgers = [pool._ledger for pool in pools]
    (msg, _) = _disagreements(ranks.run(lambda r: agree(group, [ledgers[r]])))
    assert f"{unit} pending ids (crc32)" in msg and "pending batches" not in msg
    for pool in pools:
        assert pool.pending_size() == 3 and pool.available_size() == 5
        pool.check_invariants()


def test_plain_ids_on_one_rank_and_nothing_on_another_are_named(
    ranks: ThreadRanks, group: Any
) -> None:
    ledgers: list[list[Deferrals[Any]]] = [[Deferrals()], []]
    (msg, _) = _disagreements(ranks.run(lambda r: agree(group, ledgers[r])))
    assert "ledger 1 holds nothing on one rank and ids on another" in msg


def test_quarantined_counts_only_what_this_call_quarantined(group: Any) -> None:
    pool = ReqToTokenPool(8, 4, reclaim="explicit")
    rows = pool.alloc(3)
    assert rows is not None
    pool.free(rows[:2], fence=_Handle("failed"))
    assert agree(group, [pool._ledger]).quarantined == 2
    pool.free(rows[2:], fence=_Handle("failed"))
    assert agree(group, [pool._ledger]).quarantined == 1
    assert pool.quarantined_size() == 3


def test_seconds_is_the_calls_own_wall_time(group: Any) -> None:
    pool = ReqToTokenPool(8, 4, reclaim="explicit")
    t0 = time.perf_counter()
    res = agree(group, [pool._ledger])
    assert 0.0 <= res.seconds <= time.perf_counter() - t0


def test_the_first_all_reduce_reuses_one_buffer_and_the_second_keeps_none(
    group: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The first all-reduce always has the same length: one buffer per
    # thread, reused. The second has the length of what is past WIDTH:
    # a fresh tensor each time, none kept (else one per length seen).
    sent: list[torch.Tensor] = []
    real = dist.all_reduce

    def spy(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        sent.append(t)
        return real(t, *args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", spy)
    pool = ReqToTokenPool(WIDTH + 8, 4, reclaim="explicit")
    rows = pool.alloc(WIDTH + 2)
    assert rows is not None
    for row in rows[:WIDTH]:
        pool.free([row], fence=_Handle("pending"))
    agree(group, [pool._ledger])
    agree(group, [pool._ledger])
    assert len(sent) == 2 and sent[1] is sent[0]
    for row in rows[WIDTH:]:  # WIDTH + 1, then WIDTH + 2 batches
        pool.free([row], fence=_Handle("pending"))
        assert agree(group, [pool._ledger]).collectives == 2
    assert len(sent) == 6 and sent[2] is sent[0] and sent[4] is sent[0]
    assert {key[1] for key in agreement._buffers.by_shape} == {len(sent[0])}


def test_a_third_ledger_is_refused_before_any_collective(
    group: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_collective(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("agree() ran a collective")

    monkeypatch.setattr(dist, "all_reduce", no_collective)
    # Two slots (a pool's rows and its pages), as the header has: a third
    # ledger is refused.
    pools = [ReqToTokenPool(4, 4, reclaim="explicit") for _ in range(3)]
    rows = pools[0].alloc(1)
    assert rows is not None
    pools[0].free(rows, fence=_Handle("done"))
    with pytest.raises(ValueError, match="at most 2 ledgers"):
        agree(group, [p._ledger for p in pools])
    assert pools[0].pending_size() == 1


@pytest.mark.parametrize("unit", ["rows", "pages"])
def test_the_same_ledger_twice_is_refused_before_any_collective(
    group: Any, monkeypatch: pytest.MonkeyPatch, unit: str
) -> None:
    # Both slots settled the same batches: every id released twice (a row
    # in the free queue twice, pending counted below zero), or, behind a
    # faulted fence, quarantined twice.
    def no_collective(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("agree() ran a collective")

    monkeypatch.setattr(dist, "all_reduce", no_collective)
    pool: ReqToTokenPool | KVPagePool = (
        ReqToTokenPool(4, 4, reclaim="explicit")
        if unit == "rows"
        else KVPagePool(9, 4, reclaim="explicit")
    )
    for state in ("done", "failed"):
        got = pool.alloc(1)
        assert got is not None
        pool.free(got, fence=_Handle(state))
    with pytest.raises(ValueError, match="the same ledger twice"):
        agree(group, [pool._ledger, pool._ledger])
    assert pool.pending_size() == 2 and pool.quarantined_size() == 0
    pool.check_invariants()


def test_agree_without_an_initialised_group_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    pool = ReqToTokenPool(4, 4, reclaim="explicit")
    with pytest.raises(RuntimeError, match="init_process_group"):
        pool.agree(None)
    monkeypatch.setattr(dist, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="init_process_group"):
        pool.agree(None)


def test_the_tensor_lives_on_the_current_cuda_device_over_nccl(
    group: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dist, "get_backend", lambda g=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert agreement._device_for(group) == torch.device("cuda", 3)
    monkeypatch.setattr(dist, "get_backend", lambda g=None: "gloo")
    assert agreement._device_for(group) == torch.device("cpu")


class _Handle:
    """A transfer handle in the state the test sets: "done", "pending" or "failed"."""

    def __init__(self, state: str) -> None:
        self.state = state

    def query(self) -> bool:
        if self.state == "failed":
            raise RuntimeError("the transfer failed")
        return self.state == "done"

    def synchronize(self) -> None:
        raise AssertionError("nothing here waits for a transfer handle")
