"""``fence=`` as a list or tuple of fences: memory waits for every one of them.

Every call that holds memory behind a fence takes several at once
(``free``, ``kv.free``, ``trim_pages``, ``record_use``, on both pools): a
detached prefix-cache node or an aborted request's row read both by the
step in flight and by a transfer handle waits for both, without a
hand-made combined fence (polled as a fence of unknown origin, and refused
by ``retire`` in explicit mode). Checked here: rows and pages come back
only once the last fence completes, in either order, and a queued waiter is
then woken with nobody calling the pool; one fence faulting quarantines
them; a bad element is a ``TypeError`` naming it that changes nothing; an
empty list is no fence; ordered fences of one stream collapse to the
newest; ``force_release`` of one element, overdue accounting and explicit
mode treat the batch as they treat a row used on two streams.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any

import pytest
from helpers import (
    FakeStream,
    ManualClock,
    Streams,
    bounded,
    kv_pool_state,
    kv_snapshot,
    page_ids,
    pool_snapshot,
    spin,
    warnings_seen,
)

from asyncpool import (
    AsyncReqToTokenPool,
    HostFence,
    KVPagePool,
    ReqToTokenPool,
    wait_fence,
)
from asyncpool.ledger import SlotLedger
from asyncpool.overdue import OverdueFences


class Transfer:
    """A transfer handle as an engine's transfer engine hands it out: a
    plain object with ``query()``/``synchronize()`` (a fence of unknown
    origin, polled by the pool's watcher), landed or failed on cue."""

    def __init__(self, name: str = "transfer") -> None:
        self.name = name
        self.landed = False
        self.failed = False

    def __repr__(self) -> str:
        return f"<Transfer {self.name}>"

    def query(self) -> bool:
        if self.failed:
            raise RuntimeError(f"{self.name} failed")
        return self.landed

    def synchronize(self) -> None:  # never called by the pool on such a fence
        raise AssertionError("the pool must not block in a transfer's synchronize()")


def _gated(kit: Streams) -> tuple[HostFence, Any]:
    """A host fence that completes when the test opens its gate."""
    stream = kit.stream()
    gate = kit.gate(stream)
    return stream.record(), gate


# ------------------------------------------------------------ the sync pool


@pytest.mark.parametrize("first", ["step", "transfer"])
def test_rows_come_back_once_the_last_fence_completes(kit: Streams, first: str) -> None:
    pool = ReqToTokenPool(4, 4)
    step, gate = _gated(kit)
    transfer = Transfer()
    rows = pool.alloc(2)
    assert rows is not None
    assert pool.free(rows, [step, transfer]) == 0
    assert pool.pending_size() == 2
    if first == "step":
        gate.open()
        step.synchronize()
    else:
        transfer.landed = True
    assert pool.reclaim() == 0  # the other one is still open
    assert pool.pending_size() == 2
    assert pool.alloc(3) is None
    if first == "step":
        transfer.landed = True
    else:
        gate.open()
        step.synchronize()
    assert pool.reclaim() == 2
    assert pool.available_size() == 3
    pool.check_invariants()


def test_a_tuple_or_another_sequence_is_taken_as_a_list_is(kit: Streams) -> None:
    pool = ReqToTokenPool(5, 4)
    step, gate = _gated(kit)
    transfer = Transfer()
    a, b, c = (pool.alloc(1) for _ in range(3))
    assert a is not None and b is not None and c is not None
    assert pool.free(a, (step, transfer)) == 0
    assert pool.free(b, fence=[transfer, step]) == 0
    assert pool.free(c, collections.deque([step, transfer])) == 0
    gate.open()
    step.synchronize()
    assert pool.reclaim() == 0
    transfer.landed = True
    assert pool.reclaim() == 3
    pool.check_invariants()


def test_after_adds_its_fence_to_the_list(kit: Streams) -> None:
    pool = ReqToTokenPool(4, 4)
    copy_stream = kit.stream()
    copy_gate = kit.gate(copy_stream)
    step, gate = _gated(kit)
    transfer = Transfer()
    rows = pool.alloc(2)
    assert rows is not None
    # The same transfer twice is waited for once.
    assert pool.free(rows, [transfer, step, transfer], after=copy_stream) == 0
    transfer.landed = True
    gate.open()
    step.synchronize()
    assert pool.reclaim() == 0  # the copy queued behind the free still runs
    copy_gate.open()
    copy_stream.synchronize()
    assert pool.reclaim() == 2
    pool.check_invariants()


def test_ordered_fences_of_one_stream_collapse_to_the_newest() -> None:
    pool = ReqToTokenPool(4, 4)
    stream = FakeStream()
    older, newer = stream.record(), stream.record()
    rows = pool.alloc(1)
    assert rows is not None
    assert pool.free(rows, [newer, older]) == 0
    stream.complete(upto=1)
    assert pool.reclaim() == 0
    stream.complete()
    assert pool.reclaim() == 1
    assert older.queries == 0  # never asked: the newer one covers it


def test_a_steps_rows_freed_behind_a_list_ask_each_fence_once() -> None:
    """The rows of a step share their recorded use, so behind the same list
    they wait for the same fences: worked out once per call (as one fence
    is), not once per row, and every row gets the same verdict."""
    pool = ReqToTokenPool(40, 4)
    forward, side = FakeStream(), FakeStream()
    step, copied = forward.record(), side.record()
    rows = pool.alloc(32)
    assert rows is not None
    pool.record_use(rows, step)
    transfer = Transfer()
    asked = 0
    query = transfer.query

    def counted() -> bool:
        nonlocal asked
        asked += 1
        return query()

    transfer.query = counted  # type: ignore[method-assign]
    assert pool.free(rows, [copied, transfer]) == 0
    assert (step.queries, copied.queries, asked) == (1, 1, 1)
    assert len(pool._ledger.pending_batches()) == 1  # one batch for the step's rows
    forward.complete()
    side.complete()
    transfer.landed = True
    assert pool.reclaim() == 32
    pool.check_invariants()


def test_a_faulted_element_quarantines_as_one_fence_does(kit: Streams) -> None:
    pool = ReqToTokenPool(4, 4)
    step, gate = _gated(kit)
    transfer = Transfer()
    rows = pool.alloc(2)
    assert rows is not None
    assert pool.free(rows, [step, transfer]) == 0
    transfer.failed = True  # while the step still runs
    gate.open()
    step.synchronize()
    assert pool.reclaim() == 0
    stats = pool.stats()
    assert (stats.pending, stats.quarantined, stats.fence_errors) == (0, 2, 1)
    assert "transfer failed" in str(pool._ledger.last_fence_error)
    # Already faulted when freed: quarantined at once.
    more = pool.alloc(1)
    assert more is not None
    assert pool.free(more, [Transfer("healthy"), transfer]) == 0
    assert pool.stats().quarantined == 3
    pool.check_invariants()


def test_an_empty_list_or_tuple_is_no_fence(kit: Streams) -> None:
    pool = ReqToTokenPool(4, 4)
    rows = pool.alloc(3)
    assert rows is not None
    assert pool.free(rows[:1], []) == 1
    assert pool.free(rows[1:2], fence=()) == 1
    # A row's recorded use is still waited for, as with fence=None.
    step, gate = _gated(kit)
    pool.record_use(rows[2:], step)
    assert pool.free(rows[2:], []) == 0
    gate.open()
    step.synchronize()
    assert pool.reclaim() == 1
    pool.check_invariants()


def test_record_use_of_a_list_records_every_fence(kit: Streams) -> None:
    pool = ReqToTokenPool(4, 4)
    step, gate = _gated(kit)
    transfer = Transfer()
    rows = pool.alloc(2)
    assert rows is not None
    pool.record_use(rows, [step, transfer])
    # As one call per fence would have recorded them.
    twin = ReqToTokenPool(4, 4)
    twin_rows = twin.alloc(2)
    assert twin_rows is not None
    twin.record_use(twin_rows, step)
    twin.record_use(twin_rows, transfer)
    assert pool._ledger._uses == twin._ledger._uses
    assert pool.free(rows) == 0
    transfer.landed = True
    assert pool.reclaim() == 0
    gate.open()
    step.synchronize()
    assert pool.reclaim() == 2
    pool.record_use(pool.alloc(1), [])  # records nothing
    pool.check_invariants()


@pytest.mark.parametrize(
    "call",
    [
        "free",
        "free(after=)",
        "record_use",
        "free(set)",
        "free(generator)",
        "free(text)",
    ],
)
def test_a_bad_element_is_a_type_error_that_changes_nothing(kit: Streams, call: str) -> None:
    pool = ReqToTokenPool(4, 4)
    rows = pool.alloc(2)
    assert rows is not None
    step, _ = _gated(kit)
    stream = kit.stream()
    pool.record_use(rows, step)
    before = pool_snapshot(pool)
    seq_before = stream.record().seq
    if call == "free":
        with pytest.raises(TypeError, match=r"fence=\[1\] must be a fence.*got 3 of type int"):
            pool.free(rows, [step, 3])
    elif call == "free(after=)":
        with pytest.raises(TypeError, match=r"fence=\[0\] .*got None"):
            pool.free(rows, [None, step], after=stream)
    elif call == "record_use":
        with pytest.raises(TypeError, match=r"fence=\[2\] .*'x'"):
            pool.record_use(rows, (step, Transfer(), "x"))
    elif call == "free(set)":
        with pytest.raises(TypeError, match=r"sequence of fences.*set"):
            pool.free(rows, {step})
    elif call == "free(generator)":
        with pytest.raises(TypeError, match=r"sequence of fences.*generator"):
            pool.free(rows, (f for f in [step]))
    else:  # a sequence, but of characters: refused whole, not by its first one
        with pytest.raises(TypeError, match=r"fence= must be .* got 'done' of type str$"):
            pool.free(rows, "done")
    assert pool_snapshot(pool) == before  # rows still allocated, nothing deferred
    assert stream.record().seq == seq_before + 1  # only this probe: nothing recorded


def test_force_release_of_one_element_leaves_the_other(kit: Streams) -> None:
    pool = ReqToTokenPool(4, 4)
    step, gate = _gated(kit)
    transfer = Transfer()
    rows = pool.alloc(2)
    assert rows is not None
    pool.free(rows, [step, transfer])
    with warnings_seen("still wait for other fences") as seen:
        assert pool.force_release(transfer) == 0
    assert seen.messages
    assert pool.pending_size() == 2
    gate.open()
    step.synchronize()
    assert pool.reclaim() == 2  # the transfer no longer counts
    pool.check_invariants()


def test_explicit_mode_retires_each_stream_of_the_list(kit: Streams) -> None:
    pool = ReqToTokenPool(4, 4, reclaim="explicit")
    forward, copy = kit.stream(), kit.stream()
    step, out = forward.record(), copy.record()
    step.synchronize()
    out.synchronize()
    rows = pool.alloc(2)
    assert rows is not None
    assert pool.free(rows, [step, out]) == 0  # explicit: done or not, asked nothing
    assert pool.retire(step) == 0  # the copy is not retired yet
    assert pool.pending_size() == 2
    assert pool.retire(out) == 2
    pool.check_invariants()


def test_explicit_mode_retires_the_step_and_agrees_on_the_transfer(
    kit: Streams, group: Any
) -> None:
    pool = ReqToTokenPool(4, 4, reclaim="explicit")
    step = kit.stream().record()
    step.synchronize()
    transfer = Transfer()
    rows = pool.alloc(2)
    assert rows is not None
    assert pool.free(rows, [transfer, step]) == 0
    assert pool.retire(step) == 0  # a combined fence was refused here (unordered)
    assert pool.agree(group) == 0  # the transfer has not landed
    transfer.landed = True
    assert pool.retire(step) == 0  # retire settles streams only
    assert pool.agree(group) == 2
    pool.check_invariants()


def test_overdue_names_the_fence_still_open_and_keeps_the_first_deferral_time() -> None:
    """A batch behind [step, transfer] is overdue as a row used on both
    (its uses recorded, then freed) is: measured from the free, named by
    the fence it waits for now, the memory held."""
    clock = ManualClock()
    led = SlotLedger(8, clock=clock)
    overdue = OverdueFences(10.0, [led], clock=clock)
    stream = FakeStream()
    step, transfer = stream.record(), Transfer()
    rows = led.take(4)
    assert rows is not None
    listed, used = rows[:2], rows[2:]
    assert led.free(listed, [step, transfer]) == 0
    led.record_use(used, step)
    led.record_use(used, transfer)
    assert led.free(used) == 0
    clock.now = 6.0
    stream.complete()
    assert led.reclaim() == 0  # both batches move behind the transfer
    assert overdue.counts() == (0, {})
    clock.now = 10.0
    found, _ = overdue.scan()
    assert [fence for fence, _ in found.values()] == [transfer]
    assert overdue.counts() == (1, {"rows": 4})
    transfer.landed = True
    assert led.reclaim() == 4
    assert overdue.counts() == (0, {})


# ------------------------------------------------------------ the async pool


@pytest.mark.parametrize("first", ["step", "transfer"])
async def test_a_queued_alloc_is_woken_by_the_last_fence_alone(kit: Streams, first: str) -> None:
    pool = AsyncReqToTokenPool(3, 4)
    step, gate = _gated(kit)
    transfer = Transfer()
    rows = await pool.alloc(2)
    assert pool.free(rows, [step, transfer]) == 0
    waiter = asyncio.ensure_future(pool.alloc(2))
    await spin()
    assert pool.waiting() == 1
    if first == "step":
        gate.open()
        async with bounded():
            await wait_fence(step)
    else:
        transfer.landed = True
    await spin()
    assert not waiter.done()
    assert pool.pending_size() == 2
    # The last one completes; nobody calls the pool: its wake-up grants.
    if first == "step":
        transfer.landed = True
    else:
        gate.open()
    async with bounded():
        got = await waiter
    assert sorted(got) == sorted(rows)
    pool.free(got)
    pool.check_invariants()


async def test_two_transfers_are_watched_in_turn(kit: Streams) -> None:
    pool = AsyncReqToTokenPool(2, 4)
    first, second = Transfer("first"), Transfer("second")
    rows = await pool.alloc(1)
    pool.free(rows, [first, second])
    waiter = asyncio.ensure_future(pool.alloc(1))
    second.landed = True  # not the one watched: nothing yet
    await spin()
    assert not waiter.done()
    first.landed = True
    async with bounded():
        assert await waiter == rows
    pool.free(rows)


async def test_a_row_and_its_pages_wait_for_every_fence(kit: Streams) -> None:
    pool = AsyncReqToTokenPool(2, 4, kv=KVPagePool(5, 4))
    step, gate = _gated(kit)
    transfer = Transfer()
    g = await pool.admit(pages=4)
    pool.record_use([g.row], step)
    assert pool.free([g.row], fence=[transfer]) == 0  # a list of one: that fence
    stats = pool.stats()
    assert (stats.pending, stats.pages_pending) == (1, 4)
    waiter = asyncio.ensure_future(pool.admit(pages=4))
    transfer.landed = True
    await spin()
    assert not waiter.done()
    gate.open()
    async with bounded():
        again = await waiter
    assert again.row == g.row
    assert sorted(page_ids(again.pages)) == sorted(page_ids(g.pages))
    pool.free([again.row])
    pool.check_invariants()


async def test_detached_pages_behind_the_step_and_a_transfer(kit: Streams) -> None:
    """A prefix-cache node read by the step in flight and by a transfer
    (disaggregated serving) is evicted behind both."""
    kv = KVPagePool(5, 4)
    pool = AsyncReqToTokenPool(3, 4, kv=kv)
    step, gate = _gated(kit)
    transfer = Transfer()
    g = await pool.admit(pages=4)
    pages = pool.detach_pages(g.row)
    pool.free([g.row])
    assert kv.free(pages, fence=[step, transfer]) == 0
    assert kv.pending_size() == 4
    waiter = asyncio.ensure_future(pool.admit(pages=4))
    await spin()
    gate.open()
    async with bounded():
        await wait_fence(step)
    await spin()
    assert not waiter.done()
    assert kv.pending_size() == 4
    transfer.landed = True
    async with bounded():
        again = await waiter
    assert sorted(page_ids(again.pages)) == sorted(page_ids(pages))
    pool.free([again.row])
    pool.check_invariants()
    kv.check_invariants()


async def test_trim_pages_gives_pages_back_behind_every_fence(kit: Streams) -> None:
    pool = AsyncReqToTokenPool(2, 4, kv=KVPagePool(6, 4))
    step, gate = _gated(kit)
    transfer = Transfer()
    g = await pool.admit(pages=5)
    assert pool.trim_pages(g.row, 2, [step, transfer]) == 0
    assert page_ids(pool.pages_of(g.row)) == page_ids(g.pages)[:2]
    stats = pool.stats()
    assert (stats.pages_pending, stats.pages_free) == (3, 0)
    gate.open()
    async with bounded():
        await wait_fence(step)
    await spin()
    assert pool.stats().pages_pending == 3
    transfer.landed = True
    assert pool.extend(g.row, 3) is not None  # short: its reclaim finds them
    pool.free([g.row])
    pool.check_invariants()


async def test_a_faulted_element_quarantines_a_row_and_its_pages(kit: Streams) -> None:
    pool = AsyncReqToTokenPool(3, 4, kv=KVPagePool(5, 4))
    step, gate = _gated(kit)
    transfer = Transfer()
    g = await pool.admit(pages=2)
    assert pool.free([g.row], [step, transfer]) == 0
    transfer.failed = True
    gate.open()
    async with bounded():
        await wait_fence(step)
    await spin()
    stats = pool.stats()
    assert (stats.quarantined, stats.pages_quarantined) == (1, 2)
    assert (stats.fence_errors, stats.page_fence_errors) == (1, 1)
    assert (stats.pending, stats.pages_pending) == (0, 0)
    pool.check_invariants()


@pytest.mark.parametrize("call", ["free", "free(after=)", "trim_pages", "record_use", "kv.free"])
async def test_a_bad_element_changes_neither_rows_nor_pages(kit: Streams, call: str) -> None:
    kv = KVPagePool(9, 4)
    pool = AsyncReqToTokenPool(4, 4, kv=kv)
    step, _ = _gated(kit)
    stream = kit.stream()
    g = await pool.admit(pages=4)
    loose = kv.alloc(2)
    assert loose is not None
    pool.record_use([g.row], step)
    before = (kv_pool_state(pool), kv_snapshot(kv))
    seq_before = stream.record().seq
    bad = [step, Transfer(), object()]
    with pytest.raises(TypeError, match=r"fence=\[2\] must be a fence.*object"):
        if call == "free":
            pool.free([g.row], bad)
        elif call == "free(after=)":
            pool.free([g.row], bad, after=stream)
        elif call == "trim_pages":
            pool.trim_pages(g.row, 1, fence=bad, after=stream)
        elif call == "record_use":
            pool.record_use([g.row], bad)
        else:
            kv.free(loose, fence=bad, after=stream)
    assert (kv_pool_state(pool), kv_snapshot(kv)) == before
    assert stream.record().seq == seq_before + 1  # nothing recorded on after=


async def test_empty_lists_are_no_fence_on_every_call(kit: Streams) -> None:
    kv = KVPagePool(9, 4)
    pool = AsyncReqToTokenPool(4, 4, kv=kv)
    g = await pool.admit(pages=4)
    pool.record_use([g.row], [])
    assert pool.trim_pages(g.row, 2, []) == 2
    loose = kv.alloc(2)
    assert loose is not None
    assert kv.free(loose, fence=()) == 2
    assert pool.free([g.row], fence=[]) == 1
    rows = await pool.alloc(2)
    assert pool.free(rows, ()) == 2
    stats = pool.stats()
    assert (stats.pending, stats.pages_pending, stats.pages_free) == (0, 0, 8)
    pool.check_invariants()


async def test_record_use_of_a_step_ending_on_two_streams(kit: Streams) -> None:
    pool = AsyncReqToTokenPool(3, 4, kv=KVPagePool(5, 4))
    forward, gate = _gated(kit)
    copy_stream = kit.stream()
    copy_gate = kit.gate(copy_stream)
    copied = copy_stream.record()
    g = await pool.admit(pages=2)
    pool.record_use([g.row], (forward, copied))
    assert pool.free([g.row]) == 0
    waiter = asyncio.ensure_future(pool.admit(pages=4))
    gate.open()
    async with bounded():
        await wait_fence(forward)
    await spin()
    assert not waiter.done()
    copy_gate.open()
    async with bounded():
        again = await waiter
    pool.free([again.row])
    pool.check_invariants()


async def test_force_release_of_either_element(kit: Streams) -> None:
    """Released element by element as a row used on two streams is: the
    other fence still holds the memory, and still wakes the waiter."""
    pool = AsyncReqToTokenPool(3, 4, kv=KVPagePool(5, 4))
    step, gate = _gated(kit)
    transfer = Transfer()
    g = await pool.admit(pages=4)
    pool.free([g.row], [step, transfer])
    waiter = asyncio.ensure_future(pool.admit(pages=4))
    await spin()
    # The head (the step): the batch moves behind the transfer, watched.
    assert pool.force_release(step) == (0, 0)
    assert pool.pending_size() == 1
    transfer.landed = True
    async with bounded():
        again = await waiter
    # The other way round: the transfer, while the step runs.
    other = Transfer("other")
    pool.free([again.row], [step, other])
    waiter = asyncio.ensure_future(pool.admit(pages=4))
    await spin()
    assert pool.force_release(other) == (0, 0)
    await spin()
    assert not waiter.done()
    gate.open()
    async with bounded():
        last = await waiter
    pool.free([last.row])
    assert other.query() is False  # never landed: released without it
    pool.check_invariants()
