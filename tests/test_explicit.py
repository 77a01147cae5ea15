"""reclaim="explicit": the pools never ask a fence; retire() and agree() decide.

Single process. The multi-process agreement test is tests/test_tp.py.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import FakeFence, FakeStream, bounded

from asyncpool import (
    AgreementError,
    AsyncReqToTokenPool,
    FenceError,
    HostStream,
    KVPagePool,
    ReqToTokenPool,
)
from asyncpool.agreement import WIDTH, agree
from asyncpool.deferral import check_ordered


class CountingFence:
    """A fence of unknown origin (a transfer handle) that counts query() calls."""

    def __init__(self, done: bool = False) -> None:
        self.done = done
        self.queries = 0
        self.error: BaseException | None = None

    def query(self) -> bool:
        self.queries += 1
        if self.error is not None:
            raise self.error
        return self.done

    def synchronize(self) -> None:
        # Only drain() waits for fences; the tests never make it wait long.
        if self.error is not None:
            raise self.error
        if not self.done:
            raise AssertionError("synchronize() on a fence the test has not completed")


def rows_pool(reclaim: str = "explicit", size: int = 9) -> ReqToTokenPool:
    return ReqToTokenPool(size, 4, reclaim=reclaim)


def kv_pool(reclaim: str = "explicit", num_pages: int = 65) -> KVPagePool:
    return KVPagePool(num_pages, 4, reclaim=reclaim)


def snapshot(pool: Any) -> tuple[Any, ...]:
    led = pool._ledger
    batches = [(b.did, b.fence, b.rest, b.n) for b in led.pending_batches()]
    free = list(led._free) if hasattr(led, "_free") else led._ring.tolist()
    return (free, led.pending, led.quarantined, batches, dict(led._retired))


# ---------------------------------------------------------------- construction


@pytest.mark.parametrize("bad", ["Explicit", "", None, 1, b"auto"])
def test_reclaim_mode_is_checked(bad: object) -> None:
    with pytest.raises(ValueError, match="reclaim must be"):
        ReqToTokenPool(4, 4, reclaim=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="reclaim must be"):
        KVPagePool(4, 4, reclaim=bad)  # type: ignore[arg-type]


def test_auto_is_the_default() -> None:
    assert ReqToTokenPool(4, 4).reclaim_mode == "auto"
    assert KVPagePool(4, 4).reclaim_mode == "auto"


# ---------------------------------------------------------------- never query


def test_explicit_rows_never_query_a_fence() -> None:
    pool = rows_pool()
    s = FakeStream()
    transfer = CountingFence(done=True)
    rows = pool.alloc(8)
    assert rows is not None
    f1 = s.record()
    pool.record_use(rows[:4], f1)
    s.complete()  # f1 is done, but nobody retired it
    assert pool.free(rows[:2]) == 0  # behind f1 even though it is done
    assert pool.free(rows[2:4], fence=transfer) == 0
    assert pool.free(rows[4:6], fence=f1) == 0
    # The synchronous pool's available_size() reclaims first in auto mode
    # (README, "Two pools"); in explicit mode it must not either.
    assert pool.available_size() == 0
    assert pool.alloc(3) is None  # no reclaim inside alloc
    assert pool.reclaim() == 0
    assert f1.queries == 0 and transfer.queries == 0
    pool.check_invariants()


def test_explicit_pages_never_query_a_fence() -> None:
    kv = kv_pool(num_pages=9)
    s = FakeStream()
    transfer = CountingFence(done=True)
    pages = kv.alloc(8)
    assert pages is not None
    f1 = s.record()
    s.complete()
    assert kv.free(pages[:3], fence=f1) == 0
    assert kv.free(pages[3:5], fence=transfer) == 0
    assert kv.free(pages[5:], fence=f1) == 0
    assert kv.alloc(1) is None  # alloc does not reclaim in explicit mode
    assert kv.reclaim() == 0
    assert f1.queries == 0 and transfer.queries == 0
    kv.check_invariants()


def test_auto_mode_does_query_the_same_fences() -> None:
    """The control for the tests above: in auto mode the same calls query."""
    pool = rows_pool("auto")
    s = FakeStream()
    rows = pool.alloc(2)
    assert rows is not None
    f1 = s.record()
    s.complete()
    assert pool.free(rows, fence=f1) == 2  # done: free at once
    assert f1.queries == 1


# ---------------------------------------------------------------- retire


def test_retire_returns_rows_in_record_order_up_to_the_fence() -> None:
    pool = rows_pool(size=9)
    s = FakeStream()
    f1, f2, f3 = s.record(), s.record(), s.record()
    rows = pool.alloc(8)
    assert rows is not None
    # Frees arrive out of record order: f3 first, then f1, then f2.
    pool.free(rows[0:2], fence=f3)
    pool.free(rows[2:4], fence=f1)
    pool.free(rows[4:6], fence=f2)
    assert pool.available_size() == 0
    assert pool.retire(f2) == 4
    # f1's rows first, then f2's: the free queue is in record order.
    assert list(pool._ledger._free) == rows[2:4] + rows[4:6]
    assert pool.pending_size() == 2
    assert pool.retire(f3) == 2
    assert list(pool._ledger._free) == rows[2:4] + rows[4:6] + rows[0:2]
    assert f1.queries == f2.queries == f3.queries == 0
    pool.check_invariants()


def test_retire_of_a_fence_with_nothing_behind_it() -> None:
    pool = rows_pool()
    kv = kv_pool()
    s = FakeStream()
    f = s.record()
    before = snapshot(pool)
    assert pool.retire(f) == 0
    assert kv.retire(f) == 0
    assert snapshot(pool)[:4] == before[:4]
    # A later free behind a retired fence (or an older one) is free at once:
    # every rank retired it at the same point, so this is deterministic.
    rows = pool.alloc(2)
    assert rows is not None
    pool.record_use(rows, f)
    assert pool.free(rows) == 2
    pages = kv.alloc(3)
    assert pages is not None
    assert kv.free(pages, fence=f) == 3
    g = s.record()
    rows = pool.alloc(1)
    assert rows is not None
    assert pool.free(rows, fence=g) == 0  # g is newer than what was retired
    assert f.queries == g.queries == 0


def test_a_retire_of_an_older_fence_after_a_newer_one_keeps_the_newer_retired() -> None:
    """Retiring (or a drain concluding) an older step's fence after a newer
    one must not take the newer back: a later free behind the newer fence is
    still free at once (it waited for a retire that had already come)."""
    pool = rows_pool()
    kv = kv_pool()
    s = FakeStream()
    f1, f2 = s.record(), s.record()
    for target in (pool, kv):
        assert target.retire(f2) == 0
        assert target.retire(f1) == 0
    rows = pool.alloc(2)
    assert rows is not None
    assert pool.free(rows, fence=f2) == 2
    pages = kv.alloc(3)
    assert pages is not None
    assert kv.free(pages, fence=f2) == 3
    assert pool.pending_size() == 0 and kv.pending_size() == 0
    assert f1.queries == f2.queries == 0
    pool.check_invariants()
    kv.check_invariants()


def test_retire_covers_only_its_own_stream() -> None:
    pool = rows_pool()
    a, b = FakeStream(), FakeStream()
    fa, fb = a.record(), b.record()
    rows = pool.alloc(4)
    assert rows is not None
    pool.free(rows[:2], fence=fa)
    pool.free(rows[2:], fence=fb)
    assert pool.retire(fa) == 2
    assert pool.pending_size() == 2
    assert pool.retire(fb) == 2


def test_row_used_on_two_streams_waits_for_both_retires() -> None:
    pool = rows_pool()
    a, b = FakeStream(), FakeStream()
    rows = pool.alloc(1)
    assert rows is not None
    fa, fb = a.record(), b.record()
    pool.record_use(rows, fa)
    pool.record_use(rows, fb)
    pool.free(rows)
    assert pool.retire(fa) == 0  # moved behind fb
    assert pool.pending_size() == 1
    assert pool.retire(fb) == 1
    pool.check_invariants()


def test_retire_then_transfer_fence_goes_to_agreement() -> None:
    """A row behind a step fence and a transfer: retire moves it behind the
    transfer, which only agree() settles."""
    pool = rows_pool()
    s = FakeStream()
    transfer = CountingFence(done=True)
    rows = pool.alloc(1)
    assert rows is not None
    f = s.record()
    pool.record_use(rows, f)
    pool.free(rows, fence=transfer)
    assert pool.retire(f) == 0
    assert pool.pending_size() == 1
    assert transfer.queries == 0


def test_retire_and_agree_on_an_auto_pool_are_errors() -> None:
    pool = rows_pool("auto")
    kv = kv_pool("auto")
    f = FakeStream().record()
    for target in (pool, kv):
        with pytest.raises(RuntimeError, match='reclaim="explicit"'):
            target.retire(f)
        with pytest.raises(RuntimeError, match='reclaim="explicit"'):
            target.agree(None)


@pytest.mark.parametrize(
    "bad",
    [CountingFence(), None, 3, object(), "fence"],
    ids=["unknown-origin", "none", "int", "object", "str"],
)
def test_retire_refuses_a_fence_not_from_an_ordered_stream(bad: object) -> None:
    pool = rows_pool()
    kv = kv_pool()
    s = FakeStream()
    f = s.record()
    rows = pool.alloc(2)
    pages = kv.alloc(2)
    assert rows is not None and pages is not None
    pool.free(rows, fence=f)
    kv.free(pages, fence=f)
    before_rows, before_pages = snapshot(pool), snapshot(kv)
    with pytest.raises(TypeError, match="needs an ordered fence"):
        pool.retire(bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="needs an ordered fence"):
        kv.retire(bad)  # type: ignore[arg-type]
    assert snapshot(pool) == before_rows
    assert snapshot(kv) == before_pages


def test_check_ordered_wants_int_stream_key_and_seq() -> None:
    f = FakeStream().record()
    check_ordered(f)
    f.seq = 1.0  # type: ignore[assignment]
    with pytest.raises(TypeError):
        check_ordered(f)


def test_pages_retire_in_record_order() -> None:
    kv = kv_pool(num_pages=9)
    s = FakeStream()
    f1, f2 = s.record(), s.record()
    pages = kv.alloc(8)
    assert pages is not None
    kv.free(pages[:4], fence=f2)
    kv.free(pages[4:], fence=f1)
    assert kv.retire(f1) == 4
    assert kv.retire(f2) == 4
    got = kv.alloc(8)
    assert got is not None
    assert got.tolist() == pages[4:].tolist() + pages[:4].tolist()
    kv.check_invariants()


# ---------------------------------------------------------------- agree (world size 1)


def test_agree_without_torch_distributed_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The module's group fixture may be live (test order): answer as a
    # process without one would, rather than skip.
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match="init_process_group"):
        rows_pool().agree(None)


def test_agree_releases_transfers_that_are_done(group: Any) -> None:
    pool = rows_pool()
    t1, t2 = CountingFence(done=True), CountingFence(done=False)
    rows = pool.alloc(4)
    assert rows is not None
    pool.free(rows[:2], fence=t1)
    pool.free(rows[2:], fence=t2)
    assert pool.agree(group) == 2
    assert t1.queries == 1 and t2.queries == 1
    assert pool.pending_size() == 2
    t2.done = True
    assert pool.agree(group) == 2
    assert pool.pending_size() == 0
    pool.check_invariants()


def test_agree_covers_ordered_fences_not_yet_retired(group: Any) -> None:
    kv = kv_pool()
    s = FakeStream()
    f1, f2 = s.record(), s.record()
    pages = kv.alloc(6)
    assert pages is not None
    kv.free(pages[:3], fence=f1)
    kv.free(pages[3:], fence=f2)
    s.complete(1)
    assert kv.agree(group) == 3
    assert kv.retire(f1) == 0  # already settled: nothing left behind it
    assert kv.retire(f2) == 3
    kv.check_invariants()


def test_agree_with_nothing_pending(group: Any) -> None:
    assert rows_pool().agree(group) == 0


def test_agree_quarantines_a_faulted_fence(group: Any) -> None:
    pool = rows_pool()
    t = CountingFence()
    t.error = RuntimeError("transfer failed")
    rows = pool.alloc(2)
    assert rows is not None
    pool.free(rows, fence=t)
    assert pool.agree(group) == 0
    assert pool.quarantined_size() == 2 and pool.pending_size() == 0
    assert isinstance(pool._ledger.last_fence_error, FenceError)
    pool.check_invariants()


def test_agree_marks_overdue_once_and_keeps_the_memory(
    group: Any, caplog: pytest.LogCaptureFixture
) -> None:
    pool = rows_pool()
    t = CountingFence()
    rows = pool.alloc(2)
    assert rows is not None
    pool.free(rows, fence=t)
    led = pool._ledger
    with caplog.at_level(logging.WARNING, logger="asyncpool.agreement"):
        res = agree(group, [led], overdue_after=1e-9)
        again = agree(group, [led], overdue_after=1e-9)
    assert res.newly_overdue == 1 and again.newly_overdue == 0
    assert len(led.agreed_overdue) == 1
    assert sum("not done on at least one rank" in r.message for r in caplog.records) == 1
    assert pool.pending_size() == 2
    t.done = True
    assert pool.agree(group) == 2
    assert not led.agreed_overdue


def test_agree_beyond_the_first_width_uses_a_second_collective(group: Any) -> None:
    n = WIDTH + 5
    pool = rows_pool(size=n + 1)
    rows = pool.alloc(n)
    assert rows is not None
    fences = [CountingFence(done=i % 2 == 0) for i in range(n)]
    for row, f in zip(rows, fences, strict=True):
        pool.free([row], fence=f)
    res = agree(group, [pool._ledger])
    assert res.batches == n and res.collectives == 2
    assert res.released == ((n + 1) // 2,)
    released = set(rows) - {b.items[0] for b in pool._ledger.pending_batches()}
    assert released == {rows[i] for i in range(0, n, 2)}


def test_agree_refuses_a_non_group(group: Any) -> None:
    pool = rows_pool()
    with pytest.raises(TypeError, match="ProcessGroup"):
        pool.agree("world")


def test_agree_refuses_a_group_this_rank_is_not_in(group: Any) -> None:
    # What dist.new_group returns to the ranks outside it.
    pool = rows_pool()
    with pytest.raises(ValueError, match="not a member of"):
        pool.agree(dist.GroupMember.NON_GROUP_MEMBER)


async def test_async_reclaim_is_a_no_op_on_an_explicit_pool() -> None:
    async with bounded(), AsyncReqToTokenPool(4, 4, reclaim="explicit") as pool:
        rows = await pool.alloc(2)
        t = CountingFence(done=True)
        assert pool.free(rows, fence=t) == 0
        assert pool.reclaim() == 0
        assert pool.pending_size() == 2 and t.queries == 0


class InterruptingFence:
    """A transfer handle whose query() raises ``error`` (not an Exception)
    until it is told it is done."""

    def __init__(self, error: type[BaseException]) -> None:
        self.error = error
        self.done = False

    def query(self) -> bool:
        if not self.done:
            raise self.error
        return True

    def synchronize(self) -> None:
        pass


@pytest.mark.parametrize("error", [KeyboardInterrupt, SystemExit])
def test_agree_raises_a_query_interrupt_only_after_the_collective(
    group: Any, monkeypatch: pytest.MonkeyPatch, error: type[BaseException]
) -> None:
    """A query() raising KeyboardInterrupt or SystemExit on one rank
    used to leave agree() before its all-reduce, and every other rank then
    waited in it until the group's timeout (gloo's default: 30 minutes).
    Now the first collective still runs (its last word says this rank was
    interrupted) and the interrupt is raised after it; nothing is released
    or quarantined."""
    import asyncpool.agreement as agreement

    pool = rows_pool()
    rows = pool.alloc(2)
    assert rows is not None
    f = InterruptingFence(error)
    pool.free(rows, fence=f)
    seen: list[list[int]] = []
    real = agreement._all_reduce_min

    def counted(values: list[int], g: Any, device: torch.device, **kw: Any) -> list[int]:
        seen.append(list(values))
        return real(values, g, device, **kw)

    monkeypatch.setattr(agreement, "_all_reduce_min", counted)
    with pytest.raises(error):
        pool.agree(group)
    assert len(seen) == 1  # the collective ran before the interrupt was raised
    nh = len(agreement._HEADER) * agreement.SLOTS
    assert seen[0][2 * nh : 2 * nh + 3] == [0, 0, 0]  # not done, overdue or faulted
    assert seen[0][-1] == -1  # the last word: interrupted here
    assert pool.pending_size() == 2 and pool.quarantined_size() == 0
    pool.check_invariants()
    f.done = True
    assert pool.agree(group) == 2  # ReqToTokenPool.agree: the rows released
    assert pool.available_size() == pool.capacity


async def test_an_interrupted_agreement_changes_nothing_even_what_was_done(group: Any) -> None:
    """Every rank leaves an interrupted agreement alike: nothing settled,
    not even a batch every rank saw done, so no grant loop runs anywhere;
    and no fence is asked after the interrupt."""
    kv = KVPagePool(9, 4, reclaim="explicit")
    pool = AsyncReqToTokenPool(3, 4, kv=kv, reclaim="explicit")
    stuck = InterruptingFence(KeyboardInterrupt)
    later = CountingFence(done=True)
    a = pool.try_admit(pages=4)
    b = pool.try_admit(pages=4)
    assert a is not None and b is not None
    pool.free([a.row], fence=stuck)
    pool.free([b.row], fence=later)
    waiter = asyncio.ensure_future(pool.admit(pages=4))
    for _ in range(3):
        await asyncio.sleep(0)
    before = snapshot(pool)
    with pytest.raises(KeyboardInterrupt):
        pool.agree(group)
    assert later.queries == 0  # asked nothing after the interrupt
    assert snapshot(pool) == before and pool.waiting() == 1
    assert pool.pending_size() == 2 and kv.pending_size() == 8
    stuck.done = True
    assert pool.agree(group) == (2, 8)
    async with bounded():
        g = await waiter
    pool.free([g.row])
    pool.check_invariants()
    await pool.close()


def test_kv_agree_interrupted_changes_nothing(group: Any) -> None:
    """A bare KVPagePool alike: nothing released, its owner's hook not
    called, until an agreement that is not interrupted."""
    kv = kv_pool()
    told: list[int] = []
    kv._on_free = lambda: told.append(1)
    done = CountingFence(done=True)
    stuck = InterruptingFence(KeyboardInterrupt)
    a, b = kv.alloc(2), kv.alloc(3)
    assert a is not None and b is not None
    kv.free(a, fence=done)
    kv.free(b, fence=stuck)
    with pytest.raises(KeyboardInterrupt):
        kv.agree(group)
    assert told == [] and kv.pending_size() == 5
    stuck.done = True
    assert kv.agree(group) == 5 and told == [1]


def test_an_interrupt_and_a_disagreement_raise_the_interrupt_changing_nothing(
    group: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The interrupted rank raises its interrupt whatever the others hold;
    they raise AgreementError (the header differs)."""
    pool = rows_pool()
    rows = pool.alloc(2)
    assert rows is not None
    pool.free(rows, fence=InterruptingFence(SystemExit))
    _simulate_peer(monkeypatch, _more_batches)
    before = snapshot(pool)
    with pytest.raises(SystemExit):
        pool.agree(group)
    assert snapshot(pool) == before


def test_a_keyboard_interrupt_in_the_collective_is_not_replaced(
    group: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C while in the all-reduce stays a KeyboardInterrupt, even on a
    rank whose query() was interrupted by a SystemExit before it."""
    import asyncpool.agreement as agreement

    pool = rows_pool()
    rows = pool.alloc(2)
    assert rows is not None
    pool.free(rows, fence=InterruptingFence(SystemExit))

    def ctrl_c(values: list[int], g: Any, device: torch.device) -> list[int]:
        raise KeyboardInterrupt

    monkeypatch.setattr(agreement, "_all_reduce_min", ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        pool.agree(group)
    assert pool.pending_size() == 2


def _more_batches(out: list[int], n: int) -> None:
    # The header: a slot per ledger, what it holds first, then its pending
    # batches; then the header negated. This rank: 1 batch; the other: 2.
    out[1] = min(out[1], 1)
    out[n + 1] = min(out[n + 1], -2)


def _one_quarantined(out: list[int], n: int) -> None:
    # The other rank quarantined a row this one released (a drain's local
    # verdict on a fence that faulted on one rank only) and has since
    # allocated the rest: as many free and pending rows, one quarantined.
    import asyncpool.agreement as agreement

    q = agreement._HEADER.index("quarantined ids")
    out[n + q] = min(out[n + q], -1)  # stored negated


def _interrupted(out: list[int], n: int) -> None:
    out[-1] = -1  # the last word: a query() was interrupted on some rank


def _simulate_peer(
    monkeypatch: pytest.MonkeyPatch, peer: Callable[[list[int], int], None]
) -> Callable[[], None]:
    """Make agree()'s all-reduce answer as if a second rank differed as
    ``peer`` says (it alters the reduced list; ``n`` is the header's
    length); return the undo."""
    import asyncpool.agreement as agreement

    real = agreement._all_reduce_min
    n = len(agreement._HEADER) * agreement.SLOTS

    def other_rank(values: list[int], g: Any, device: torch.device) -> list[int]:
        out = real(values, g, device)
        peer(out, n)
        return out

    monkeypatch.setattr(agreement, "_all_reduce_min", other_rank)
    return lambda: monkeypatch.setattr(agreement, "_all_reduce_min", real)


class FlakyFence:
    """A transfer handle that raises once, then answers True."""

    def __init__(self) -> None:
        self.raised = False

    def query(self) -> bool:
        if not self.raised:
            self.raised = True
            raise RuntimeError("the RDMA peer is gone")
        return True

    def synchronize(self) -> None:
        pass


def _fault_at_an_interrupted_agreement(
    pool: Any, rows: list[int], group: Any, monkeypatch: pytest.MonkeyPatch
) -> FlakyFence:
    """Free ``rows`` behind a FlakyFence and run an agree() that another
    rank interrupted: the fence raised there, and nothing was settled."""
    flaky = FlakyFence()
    pool.free(rows, fence=flaky)
    undo = _simulate_peer(monkeypatch, _interrupted)
    with pytest.raises(AgreementError, match="interrupted"):
        pool.agree(group)
    undo()
    assert flaky.raised and pool.pending_size() == len(rows)
    return flaky


def test_agree_takes_a_cancelled_error_from_query_for_a_fault(group: Any) -> None:
    """A synchronous query() cannot see this task's cancellation: a
    CancelledError from it is the handle's own state (a cancelled future
    it wraps) and repeats. Taken for an interrupt, it made every agree()
    fail on every rank for good; it is a fault, as wait_fence says."""
    pool = rows_pool()
    rows = pool.alloc(2)
    assert rows is not None
    done = CountingFence(done=True)
    other = pool.alloc(1)
    assert other is not None
    pool.free(rows, fence=InterruptingFence(asyncio.CancelledError))
    pool.free(other, fence=done)
    assert pool.agree(group) == 1  # the other batch is released as usual
    assert pool.quarantined_size() == 2 and pool.pending_size() == 0
    assert pool.stats().fence_errors == 1
    pool.check_invariants()


def test_a_fault_seen_at_an_agreement_that_settled_nothing_stays_a_fault(
    group: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The handle raised at an agreement another rank interrupted, then
    answers True: it used to be released at the next agree(), the failed
    transfer's target back in circulation on every rank. It is
    quarantined, as auto mode would have at once."""
    pool = rows_pool()
    rows = pool.alloc(2)
    assert rows is not None
    _fault_at_an_interrupted_agreement(pool, rows, group, monkeypatch)
    assert pool.agree(group) == 0
    assert pool.quarantined_size() == 2 and pool.pending_size() == 0
    assert pool._ledger._unagreed_faults == {}  # acted on: forgotten
    pool.check_invariants()


async def test_drain_after_an_interrupted_agreement_keeps_its_fault(
    group: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """drain() asks the fence itself; one that faulted at an agreement that
    settled nothing and answers True now is quarantined, not released, and
    forgotten once settled."""
    pool = AsyncReqToTokenPool(4, 4, reclaim="explicit")
    rows = await pool.alloc(2)
    _fault_at_an_interrupted_agreement(pool, rows, group, monkeypatch)
    async with bounded():
        await pool.drain(timeout=5)
    assert pool.quarantined_size() == 2 and pool.pending_size() == 0
    assert pool._ledger._unagreed_faults == {}
    pool.check_invariants()
    await pool.close()


def test_force_release_overrides_a_fault_an_agreement_did_not_act_on(
    group: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The operator's force_release is the verdict: the rows return, and
    the remembered fault is dropped (a handle armed again later is asked
    afresh)."""
    pool = rows_pool()
    rows = pool.alloc(2)
    assert rows is not None
    flaky = _fault_at_an_interrupted_agreement(pool, rows, group, monkeypatch)
    assert pool.force_release(flaky) == 2
    assert pool._ledger._unagreed_faults == {}
    again = pool.alloc(1)
    assert again is not None
    pool.free(again, fence=flaky)  # armed again: it answers True now
    assert pool.agree(group) == 1 and pool.quarantined_size() == 0
    pool.check_invariants()


@pytest.mark.parametrize(
    ("peer", "match"),
    [
        (_more_batches, r"rows pending batches 1\.\.2"),
        (_one_quarantined, r"rows quarantined ids 0\.\.1"),
        (_interrupted, r"interrupted .* on another rank"),
    ],
)
def test_agreement_error_when_a_peer_differs(
    group: Any,
    monkeypatch: pytest.MonkeyPatch,
    peer: Callable[[list[int], int], None],
    match: str,
) -> None:
    """A second rank simulated in the all-reduce's result: one holding
    another batch (MIN over ranks of the header then differs from MAX), one
    that quarantined what this one released (only the quarantined count
    tells them apart), one whose query() was interrupted. Every case:
    AgreementError, and nothing changed."""
    pool = rows_pool()
    rows = pool.alloc(2)
    assert rows is not None
    pool.free(rows, fence=CountingFence(done=True))
    _simulate_peer(monkeypatch, peer)
    before = snapshot(pool)
    with pytest.raises(AgreementError, match=match):
        pool.agree(group)
    assert snapshot(pool) == before


def test_agree_merges_both_ledgers_in_one_tensor(group: Any) -> None:
    pool = rows_pool()
    kv = kv_pool()
    t = CountingFence(done=True)
    rows = pool.alloc(1)
    pages = kv.alloc(2)
    assert rows is not None and pages is not None
    pool.free(rows, fence=t)
    kv.free(pages, fence=t)
    res = agree(group, [pool._ledger, kv._ledger])
    assert res.released == (1, 2) and res.collectives == 1
    assert t.queries == 1  # one question per fence per agreement
    assert kv.available_size() == kv.capacity and pool.available_size() == pool.capacity


def test_fake_fence_helper_counts_queries() -> None:
    f: FakeFence = FakeStream().record()
    f.query()
    assert f.queries == 1


# ---------------------------------------------------------------- the asyncio pool


async def test_async_explicit_pool_grants_a_waiter_on_retire() -> None:
    pool = AsyncReqToTokenPool(3, 4, reclaim="explicit")
    s = FakeStream()
    rows = await pool.alloc(2)
    f = s.record()
    pool.record_use(rows, f)
    s.complete()  # done, but the pool does not look
    pool.free(rows)
    waiter = asyncio.ensure_future(pool.alloc(2))
    for _ in range(3):
        await asyncio.sleep(0)
    assert not waiter.done()
    assert pool.try_alloc(1) is None
    assert pool.reclaim() == 0
    assert pool.retire(f) == (2, 0)
    # Granted inside retire(), at hand-over: nobody queues, nothing is free.
    assert pool.waiting() == 0 and pool.available_size() == 0
    async with bounded():
        assert sorted(await waiter) == sorted(rows)
    assert f.queries == 0
    assert pool._wakeups.watcher is None
    await pool.close()


async def test_async_explicit_pool_starts_no_watcher_and_registers_no_callback() -> None:
    pool = AsyncReqToTokenPool(4, 4, reclaim="explicit")
    with HostStream() as stream:
        gate = threading.Event()
        stream.launch(gate.wait)
        f = stream.record()
        t = CountingFence()
        rows = await pool.alloc(3)
        pool.free(rows[:1], fence=f)
        pool.free(rows[1:2], fence=t)
        pool.free(rows[2:], after=stream)
        assert pool._wakeups.watcher is None and t.queries == 0
        gate.set()
        stream.synchronize()
        for _ in range(3):
            await asyncio.sleep(0)
        assert pool.pending_size() == 3  # completion changed nothing
        await pool.close()


async def test_async_explicit_pool_agree_grants(group: Any) -> None:
    pool = AsyncReqToTokenPool(2, 4, reclaim="explicit")
    t = CountingFence()
    rows = await pool.alloc(1)
    pool.free(rows, fence=t)
    waiter = asyncio.ensure_future(pool.alloc(1))
    await asyncio.sleep(0)
    assert pool.agree(group) == (0, 0)
    t.done = True
    assert pool.agree(group) == (1, 0)
    async with bounded():
        assert await waiter == rows
    await pool.close()


async def test_async_explicit_drain_settles_everything() -> None:
    pool = AsyncReqToTokenPool(5, 4, reclaim="explicit")
    with HostStream() as stream:
        rows = await pool.alloc(4)
        f = stream.record()
        pool.record_use(rows[:2], f)
        t = CountingFence(done=True)
        bad = CountingFence()
        bad.error = RuntimeError("transfer failed")
        pool.free(rows[:2])
        pool.free(rows[2:3], fence=t)
        pool.free(rows[3:], fence=bad)
        async with bounded():
            await pool.drain()
    assert pool.pending_size() == 0
    assert pool.quarantined_size() == 1 and pool.available_size() == 3
    pool.check_invariants()
    await pool.close()


async def test_async_retire_bad_input_changes_nothing() -> None:
    pool = AsyncReqToTokenPool(3, 4, reclaim="explicit")
    auto = AsyncReqToTokenPool(3, 4)
    f = FakeStream().record()
    rows = await pool.alloc(2)
    pool.free(rows, fence=f)
    before = snapshot(pool)
    with pytest.raises(TypeError, match="ordered fence"):
        pool.retire(CountingFence())  # type: ignore[arg-type]
    assert snapshot(pool) == before
    with pytest.raises(RuntimeError, match='reclaim="explicit"'):
        auto.retire(f)
    with pytest.raises(ValueError, match="reclaim must be"):
        AsyncReqToTokenPool(3, 4, reclaim="manual")
    await pool.close()
    await auto.close()


@pytest.mark.cuda
def test_agree_over_nccl_uses_a_cuda_tensor(group: Any) -> None:
    """NCCL (one GPU, a one-rank NCCL group beside the gloo default group):
    the flags travel in a CUDA tensor and CUDA fences are settled."""
    from asyncpool import record_fence

    nccl = dist.new_group(ranks=[0], backend="nccl")
    try:
        stream = torch.cuda.Stream()
        pool = ReqToTokenPool(4, 4, device="cuda", reclaim="explicit")
        kv = KVPagePool(9, 4, device="cuda", reclaim="explicit")
        rows = pool.alloc(2)
        pages = kv.alloc(4)
        assert rows is not None and pages is not None
        with torch.cuda.stream(stream):
            torch.cuda._sleep(1_000_000)
        f = record_fence(stream)
        pool.record_use(rows, f)
        pool.free(rows)
        kv.free(pages, fence=f)
        stream.synchronize()
        res = agree(nccl, [pool._ledger, kv.ledger])
        assert res.released == (2, 4)
        pool.check_invariants()
        kv.check_invariants()
    finally:  # a failure must not leave the subgroup to later tests
        dist.destroy_process_group(nccl)


async def test_a_rank_without_fence_timeout_counts_what_another_ranks_made_overdue(
    group: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Overdue is agreed (MAX over ranks): a rank built without
    ``fence_timeout`` logs a fence that another rank's timeout made overdue,
    and its stats() count it too, as every rank's do (docs/api.md: counted on
    every rank). The other rank's flag is faked into the single-rank
    collective."""
    import asyncpool.agreement as agreement

    pool = AsyncReqToTokenPool(4, 8, kv=KVPagePool(9, 4), reclaim="explicit")
    g = pool.try_admit(pages=3)
    assert g is not None
    transfer = CountingFence()
    pool.free([g.row], fence=transfer)
    real = agreement._all_reduce_min
    nh = len(agreement._HEADER) * agreement.SLOTS

    def overdue_on_another_rank(values: list[int], g: Any, dev: torch.device, **kw: Any) -> Any:
        out = real(values, g, dev, **kw)
        for i in range(2 * nh + 1, len(out) - 1, 3):  # [done, -overdue, -faulted] each
            out[i] = -1
        return out

    monkeypatch.setattr(agreement, "_all_reduce_min", overdue_on_another_rank)
    with caplog.at_level(logging.WARNING, logger="asyncpool"):
        assert pool.agree(group) == (0, 0)
    assert "not done on at least one rank past another rank's fence timeout" in caplog.text
    st = pool.stats()
    assert (st.overdue_fences, st.overdue_rows, st.overdue_pages) == (1, 1, 3)
    monkeypatch.setattr(agreement, "_all_reduce_min", real)
    transfer.done = True
    assert pool.agree(group) == (1, 3)
    st = pool.stats()
    assert (st.overdue_fences, st.overdue_rows, st.overdue_pages) == (0, 0, 0)
    pool.check_invariants()
    await pool.close()
