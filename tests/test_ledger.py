"""SlotLedger directly: states, FIFO reuse, fences, reclaim cost, faults,
lazy resets, bad input atomicity."""

from __future__ import annotations

import collections
import logging

import pytest
from helpers import WAIT_S, FakeStream, ledger_snapshot

from asyncpool import CapacityError, DoubleFreeError, FenceError, InvalidSlotError
from asyncpool.ledger import SlotLedger


@pytest.fixture(autouse=True)
def _quiet_fault_logs(caplog):
    # Faults are logged at ERROR on purpose; keep the test output readable.
    caplog.set_level(logging.CRITICAL, logger="asyncpool")


def states(led: SlotLedger) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for row in range(1, led.size):
        out.setdefault(led.state_of(row), set()).add(row)
    return out


# ---------------------------------------------------------------- basics


def test_row_zero_is_never_handed_out():
    led = SlotLedger(9)
    assert led.capacity == 8
    assert led.state_of(0) == "reserved"
    rows = led.take(8)
    assert sorted(rows) == list(range(1, 9))
    assert led.take(1) is None
    for _ in range(5):
        led.free(rows)
        rows = led.take(8)
        assert 0 not in rows
    led.check_invariants()


@pytest.mark.parametrize("size", [0, 1, -3, 2.0, True, None])
def test_size_must_leave_at_least_one_row(size):
    with pytest.raises(CapacityError):
        SlotLedger(size)


def test_fresh_order_is_row_order():
    led = SlotLedger(6)
    assert led.take(2) == [1, 2]
    assert led.take(3) == [3, 4, 5]


def test_take_is_all_or_nothing():
    led = SlotLedger(5)
    first = led.take(3)
    before = ledger_snapshot(led)
    assert led.take(2) is None
    assert ledger_snapshot(led) == before
    assert led.free_count == 1
    assert led.take(1) == [4]
    assert first == [1, 2, 3]


def test_fifo_reuse_oldest_freed_first():
    led = SlotLedger(7)
    rows = led.take(6)
    order = [4, 1, 6, 2, 5, 3]
    for r in order:
        led.free([r])
    assert led.take(6) == order
    # Interleaved: a row freed later is reused later.
    led.free([2])
    led.free([6, 1])
    assert led.take(1) == [2]
    led.free([4])
    assert led.take(3) == [6, 1, 4]
    assert rows  # keep the first batch alive for readability
    led.check_invariants()


def test_generation_tags_hand_outs_and_stats():
    led = SlotLedger(4)
    assert [led.generation(r) for r in (1, 2, 3)] == [0, 0, 0]
    a = led.take(2)
    # The tag of a hand-out: rows handed out so far, shared by the batch.
    assert led.generation(1) == led.generation(2) == led.granted == 2
    led.free(a)
    assert led.generation(1) == 2  # a free keeps the tag: a double free is told apart
    led.take(3)
    assert [led.generation(r) for r in (1, 2, 3)] == [5, 5, 5]
    assert led.granted == 5
    assert led.allocs == 5
    assert led.frees == 2
    assert led.peak_allocated == 3
    assert led.allocated_rows() == [1, 2, 3]


def test_put_back_returns_rows_to_the_head_clean_and_uncounted():
    led = SlotLedger(6)
    led.free(led.take(5))  # all dirty now, row order 1..5
    resets = led.resets
    rows = led.take(2)
    assert led.resets == resets + 1
    allocs = led.allocs
    led.put_back(rows)
    assert led.allocs == allocs - 2
    assert led.take(2) == rows  # back at the head, in the same order
    assert led.resets == resets + 1  # they were clean: no new reset
    led.check_invariants()


# ---------------------------------------------------------------- fences


def test_row_behind_open_gate_is_not_handed_out_until_reclaim(kit):
    led = SlotLedger(4)
    s = kit.stream()
    gate = kit.gate(s)
    rows = led.take(3)
    f = s.record()
    assert led.free([rows[0]], f) == 0
    assert led.state_of(rows[0]) == "pending"
    assert led.pending == 1 and led.deferred_frees == 1
    led.free(rows[1:])
    got = led.take(2)
    assert rows[0] not in got
    assert led.take(1) is None  # the pending row is not free
    assert led.reclaim() == 0
    assert led.take(1) is None
    gate.open()
    assert f.wait(WAIT_S)
    assert led.reclaim() == 1
    assert led.take(1) == [rows[0]]
    assert led.reclaimed == 1
    led.check_invariants()


def test_free_with_completed_fence_is_immediate(kit):
    led = SlotLedger(4)
    s = kit.stream()
    f = s.record()
    assert f.wait(WAIT_S)
    rows = led.take(2)
    assert led.free(rows, f) == 2
    assert led.pending == 0 and led.free_count == 3
    assert led.deferred_frees == 0


def test_record_use_then_free_waits_for_newest_use():
    led = SlotLedger(4)
    fs = FakeStream()
    f1, f2, f3 = fs.record(), fs.record(), fs.record()
    [row] = led.take(1)
    # Recorded out of order: f3 stays the newest.
    led.record_use([row], f1)
    led.record_use([row], f3)
    led.record_use([row], f2)
    assert led.free([row]) == 0
    fs.complete(2)
    assert led.reclaim() == 0
    assert led.state_of(row) == "pending"
    fs.complete(3)
    assert led.reclaim() == 1
    assert led.state_of(row) == "free"
    led.check_invariants()


def test_row_whose_uses_completed_frees_at_once():
    led = SlotLedger(4)
    fs = FakeStream()
    f1, f2 = fs.record(), fs.record()
    a, b = led.take(2)
    led.record_use([a, b], f1)
    led.record_use([b], f2)
    fs.complete(1)
    # a's only use is done: free at once; b's newest is not: pending.
    assert led.free([a, b]) == 1
    assert led.state_of(a) == "free" and led.state_of(b) == "pending"
    led.check_invariants()


def test_record_use_is_dropped_when_the_row_is_freed():
    led = SlotLedger(3)
    fs = FakeStream()
    f = fs.record()
    [row] = led.take(1)
    led.record_use(row, f)
    assert led.free([row]) == 0
    assert led._uses[row] is None
    fs.complete()
    assert led.reclaim() == 1
    assert led.take(1) == [2]  # FIFO: row 2 was free before `row` came back
    assert led.take(1) == [row]
    assert led._uses[row] is None
    assert led.free([row]) == 1  # a new owner's free does not wait on old uses


def test_explicit_fence_adds_to_recorded_use_never_weakens():
    led = SlotLedger(5)
    fs = FakeStream()
    f1, f2 = fs.record(), fs.record()
    a, b = led.take(2)
    led.record_use([a], f2)  # newer use
    led.free([a], f1)  # older explicit fence: must still wait for f2
    led.record_use([b], f1)
    led.free([b], f2)  # newer explicit fence: waits for it
    fs.complete(1)
    assert led.reclaim() == 0
    assert led.state_of(a) == "pending" and led.state_of(b) == "pending"
    fs.complete(2)
    assert led.reclaim() == 2
    led.check_invariants()


def test_row_used_on_two_streams_waits_for_both_either_order():
    """Regression: releasing such a row requeues it on the other stream while
    reclaim iterates the stream dict (RuntimeError / lost batch before the fix)."""
    for first in ("a", "b"):
        led = SlotLedger(5)
        sa, sb = FakeStream(), FakeStream()
        fa, fb = sa.record(), sb.record()
        [row] = led.take(1)
        led.record_use([row], fa)
        led.record_use([row], fb)
        assert led.free([row]) == 0
        (sa if first == "a" else sb).complete()
        assert led.reclaim() == 0
        led.check_invariants()
        assert led.state_of(row) == "pending"
        (sb if first == "a" else sa).complete()
        assert led.reclaim() == 1
        assert led.state_of(row) == "free"
        led.check_invariants()


def test_one_record_use_over_rows_holding_different_uses_keeps_each_rows_own():
    """``record_use`` works out a row's new use once per distinct previous use
    (a step's rows mostly share one): rows holding different uses in the
    same call must each keep their own newest per stream."""
    led = SlotLedger(8)
    sa, sb = FakeStream(), FakeStream()
    f1, f2, f3 = sa.record(), sa.record(), sa.record()
    g1 = sb.record()
    a, b, c, d, e, f = led.take(6)
    led.record_use([b, f], f1)  # older than the new use on the same stream
    led.record_use([c], f3)  # newer than it: stays
    led.record_use([d, e], g1)  # another stream: both kept
    led.record_use([a, b, c, d, e, f], f2)
    assert led.free([a, b, c, d, e, f]) == 0
    sa.complete(2)
    assert led.reclaim() == 3
    assert [led.state_of(r) for r in (a, b, f)] == ["free"] * 3
    assert [led.state_of(r) for r in (c, d, e)] == ["pending"] * 3
    sb.complete()
    assert led.reclaim() == 2
    assert led.state_of(c) == "pending"
    sa.complete()
    assert led.reclaim() == 1
    led.check_invariants()


def test_requeued_row_survives_an_emptied_stream_queue():
    """Regression: a stream queue emptied in one reclaim pass, then refilled by
    a requeue from another stream in the same pass, was deleted with the row."""
    led = SlotLedger(5)
    sb, sa = FakeStream(), FakeStream()
    fb1 = sb.record()
    fb2 = sb.record()
    fa = sa.record()
    r1, r2 = led.take(2)
    led.free([r1], fb1)  # stream b's queue is created first
    led.record_use([r2], fa)
    led.record_use([r2], fb2)
    led.free([r2])  # head on a, then b
    sb.complete(1)
    sa.complete()
    assert led.reclaim() == 1  # r1
    led.check_invariants()
    assert led.state_of(r2) == "pending"
    sb.complete(2)
    assert led.reclaim() == 1
    assert led.state_of(r2) == "free"
    led.check_invariants()


def test_reclaim_stops_at_first_incomplete_fence_and_does_not_look_past():
    led = SlotLedger(101)
    fs = FakeStream()
    fences = [fs.record() for _ in range(100)]
    rows = led.take(100)
    for row, f in zip(rows, fences, strict=True):
        led.free([row], f)
    for f in fences:
        f.queries = 0
    assert led.reclaim() == 0
    assert fences[0].queries == 1
    assert sum(f.queries for f in fences[1:]) == 0  # O(streams), not O(pending)
    # A later fence that (wrongly) claims completion is never even asked.
    fences[5].override = True
    assert led.reclaim() == 0
    assert fences[5].queries == 0
    assert led.state_of(rows[5]) == "pending"
    fences[5].override = None
    for f in fences:
        f.queries = 0
    fs.complete(50)
    assert led.reclaim() == 50
    assert all(f.queries == 1 for f in fences[:51])
    assert sum(f.queries for f in fences[51:]) == 0
    assert led.pending == 50
    led.check_invariants()


def test_out_of_record_order_free_reclaims_each_row_when_its_own_fence_completes():
    led = SlotLedger(6)
    fs = FakeStream()
    f1, f2, f3 = fs.record(), fs.record(), fs.record()
    a, b, c = led.take(3)
    led.record_use([a], f3)
    led.record_use([b], f1)
    led.record_use([c], f2)
    assert led.free([a, b, c]) == 0  # one call, rows behind f3, f1, f2
    led.check_invariants()  # the stream queue is kept in record order
    assert [bt.seq for bt in led._streams[fs.key]] == [1, 2, 3]
    fs.complete(1)
    assert led.reclaim() == 1
    assert states(led)["pending"] == {a, c}
    fs.complete(2)
    assert led.reclaim() == 1
    assert states(led)["pending"] == {a}
    fs.complete(3)
    assert led.reclaim() == 1
    assert led.pending == 0
    led.check_invariants()


def test_separate_frees_out_of_order_and_merge_into_one_batch():
    led = SlotLedger(8)
    fs = FakeStream()
    f1, f2 = fs.record(), fs.record()
    rows = led.take(6)
    led.free(rows[:2], f2)
    led.free(rows[2:4], f1)
    led.free(rows[4:], f2)  # same fence: joins the existing batch
    q = led._streams[fs.key]
    assert [b.seq for b in q] == [1, 2]
    assert sorted(q[1].items) == sorted(rows[:2] + rows[4:])
    assert led.deferred_frees == 6
    fs.complete(1)
    assert led.reclaim() == 2
    fs.complete(2)
    assert led.reclaim() == 4
    led.check_invariants()


def test_unordered_fences_are_polled_in_full(kit):
    led = SlotLedger(5)
    e1, e2 = kit.event_fence(), kit.event_fence()
    a, b = led.take(2)
    led.free([a], e1)
    led.free([b], e2)
    e2.set()  # completes "out of order": no head-of-line blocking
    assert led.reclaim() == 1
    assert led.state_of(b) == "free" and led.state_of(a) == "pending"
    assert e1.queries >= 1
    e1.set()
    assert led.reclaim() == 1
    led.check_invariants()


def test_pending_hook_called_once_per_fence_holding_rows():
    seen = []
    led = SlotLedger(8, on_pending=seen.append)
    fs = FakeStream()
    f1, f2 = fs.record(), fs.record()
    rows = led.take(4)
    led.free(rows[:2], f1)
    led.free(rows[2:3], f1)
    led.free(rows[3:], f2)
    assert seen == [f1, f2]


def test_fence_latency_uses_the_clock():
    now = [10.0]
    led = SlotLedger(4, clock=lambda: now[0])
    fs = FakeStream()
    f = fs.record()
    led.free(led.take(2), f)
    now[0] = 10.25
    fs.complete()
    led.reclaim()
    assert list(led.fence_latencies) == [0.25]


# ---------------------------------------------------------------- faults


def test_faulted_stream_quarantines_its_rows_and_the_rest_keeps_serving(kit):
    faults = []
    led = SlotLedger(6, on_fault=lambda f, e: faults.append((f, e)))
    s = kit.stream()
    gate = kit.gate(s)
    boom = RuntimeError("device assert")

    def bad() -> None:
        raise boom

    s.launch(bad)
    f = s.record()
    bad_rows = led.take(2)
    led.free(bad_rows, f)
    gate.open()
    with pytest.raises(FenceError):
        f.wait(WAIT_S)
    assert led.reclaim() == 0
    assert led.quarantined == 2
    assert led.pending == 0
    assert led.fence_errors == 1
    assert isinstance(led.last_fence_error, FenceError)
    assert led.last_fence_error.__cause__ is boom
    assert faults and faults[0][0] is f
    assert all(led.state_of(r) == "quarantined" for r in bad_rows)
    led.check_invariants()
    # The rest of the pool keeps serving, quarantined rows never come back.
    for _ in range(10):
        rows = led.take(3)
        assert not set(rows) & set(bad_rows)
        led.free(rows)
    assert led.take(4) is None
    with pytest.raises(InvalidSlotError) as ei:
        led.free([bad_rows[0]])
    assert not isinstance(ei.value, DoubleFreeError)
    led.check_invariants()


def test_free_behind_already_faulted_fence_quarantines_at_once():
    led = SlotLedger(4)
    fs = FakeStream()
    f = fs.record()
    fs.fault()
    rows = led.take(2)
    led.record_use(rows[:1], f)
    assert led.free(rows[:1]) == 0
    assert led.free(rows[1:], f) == 0
    assert led.quarantined == 2 and led.pending == 0
    assert isinstance(led.last_fence_error, FenceError)
    led.check_invariants()


def test_fault_after_a_good_fence_only_quarantines_later_rows():
    led = SlotLedger(6)
    fs = FakeStream()
    f1, f2 = fs.record(), fs.record()
    a = led.take(2)
    b = led.take(2)
    led.free(a, f1)
    led.free(b, f2)
    fs.complete(1)
    fs.fault()
    assert led.reclaim() == 2
    assert led.quarantined == 2
    assert {led.state_of(r) for r in a} == {"free"}
    assert {led.state_of(r) for r in b} == {"quarantined"}
    led.check_invariants()


def test_faulted_unordered_fence_quarantines(kit):
    led = SlotLedger(4)
    e = kit.event_fence()
    rows = led.take(2)
    led.free(rows, e)
    e.error = RuntimeError("bad")
    e.set()
    assert led.reclaim() == 0
    assert led.quarantined == 2
    assert isinstance(led.last_fence_error, FenceError)
    led.check_invariants()


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("n", [0, -1, 1.0, 2.5, True, False, None, "1", [1], 9])
def test_check_n_rejects(n):
    led = SlotLedger(9)
    before = ledger_snapshot(led)
    with pytest.raises(CapacityError) as ei:
        led.check_n(n)
    assert isinstance(ei.value, ValueError)
    assert ledger_snapshot(led) == before


def test_check_n_accepts_one_to_capacity():
    led = SlotLedger(9)
    assert led.check_n(1) == 1 and led.check_n(8) == 8


def _bad_free_cases(led: SlotLedger, fs: FakeStream):
    a, b, c, d = led.take(4)
    led.free([b])  # b: allocated before, now free
    led.free([c], fs.record())  # c: pending
    never = led.size - 1  # never allocated (take(4) of 8)
    return a, [
        ([0], InvalidSlotError),
        ([-1], InvalidSlotError),
        ([led.size], InvalidSlotError),
        ([led.size + 10], InvalidSlotError),
        ([1.0], InvalidSlotError),
        ([True], InvalidSlotError),
        (["1"], InvalidSlotError),
        ([None], InvalidSlotError),
        ([never], InvalidSlotError),
        ([a, a], InvalidSlotError),
        ([a, d, a], InvalidSlotError),
        ([b], DoubleFreeError),
        ([c], DoubleFreeError),
        ([a, b], DoubleFreeError),  # one good row first: still nothing changes
        ([a, 0], InvalidSlotError),
        ("12", InvalidSlotError),
        (b"1", InvalidSlotError),
        (3.0, InvalidSlotError),
    ]


@pytest.mark.parametrize("op", ["free", "free_fenced", "record_use"])
def test_bad_rows_raise_typed_errors_and_change_nothing(op):
    led = SlotLedger(9)
    fs = FakeStream()
    good, cases = _bad_free_cases(led, fs)
    f = fs.record()
    for rows, exc in cases:
        if op == "record_use" and exc is DoubleFreeError:
            exc = InvalidSlotError  # using a free or pending row is no double free
        before = ledger_snapshot(led)
        with pytest.raises(exc) as raised:
            if op == "free":
                led.free(rows)
            elif op == "free_fenced":
                led.free(rows, f)
            else:
                led.record_use(rows, f)
        assert type(raised.value) is exc, (rows, raised.value)
        assert ledger_snapshot(led) == before, rows
        led.check_invariants()
    # Never-allocated is not a double free; a freed row is.
    with pytest.raises(InvalidSlotError) as ei:
        led.free([led.size - 1])
    assert type(ei.value) is InvalidSlotError
    assert led.state_of(good) == "allocated"


@pytest.mark.parametrize("bad_fence", [object(), 1, "fence", type("Q", (), {"query": 1})()])
def test_non_fence_raises_type_error_and_changes_nothing(bad_fence):
    led = SlotLedger(5)
    rows = led.take(2)
    before = ledger_snapshot(led)
    with pytest.raises(TypeError):
        led.free(rows, bad_fence)
    with pytest.raises(TypeError):
        led.record_use(rows, bad_fence)
    assert ledger_snapshot(led) == before


def test_check_invariants_catches_corruption():
    led = SlotLedger(5)
    rows = led.take(2)
    led.check_invariants()
    led._state[rows[0]] = 0  # FREE but not in the free queue
    with pytest.raises(AssertionError):
        led.check_invariants()
    led._state[rows[0]] = 1
    led._free.append(led._free[0])  # a row twice in the free queue
    with pytest.raises(AssertionError):
        led.check_invariants()
    led._free.pop()
    led.pending += 1
    with pytest.raises(AssertionError):
        led.check_invariants()
    led.pending -= 1
    led.check_invariants()


# ---------------------------------------------------------------- lazy resets


@pytest.mark.parametrize("max_n", [1, 3])
def test_lazy_reset_batches_and_no_dirty_row_is_handed_out(max_n):
    calls: list[list[int]] = []
    dirty: set[int] = set()

    def on_reset(rows: list[int]) -> None:
        assert all(led.state_of(r) == "free" for r in rows)
        calls.append(rows)
        dirty.difference_update(rows)

    led = SlotLedger(33, on_reset=on_reset)
    cap = led.capacity
    freed = 0
    for i in range(10 * cap):
        n = 1 + i % max_n
        rows = led.take(n)
        assert rows is not None
        assert not dirty & set(rows), "a dirty row was handed out"
        led.free(rows)
        dirty.update(rows)
        freed += n
    # About one bulk reset per `capacity` frees, not one per free.
    assert led.resets == len(calls)
    assert 1 <= led.resets <= freed // (cap - max_n) + 1
    if max_n == 1:
        assert led.resets <= 10
    assert sum(len(c) for c in calls) >= freed - 2 * cap
    led.check_invariants()


def test_reset_covers_rows_that_came_back_from_a_fence():
    reset: list[int] = []
    led = SlotLedger(4, on_reset=reset.extend)
    fs = FakeStream()
    rows = led.take(3)
    led.free(rows, fs.record())
    fs.complete()
    led.reclaim()
    assert led.take(3) == rows
    assert sorted(reset) == sorted(rows)


def test_clear_order_helpers():
    led = SlotLedger(6)
    led.free(list(reversed(led.take(5))))
    assert list(led._free) == [5, 4, 3, 2, 1]
    led.restore_fresh_order()
    assert list(led._free) == [1, 2, 3, 4, 5]
    resets = led.resets
    assert led.take(5) == [1, 2, 3, 4, 5]
    assert led.resets == resets  # restore_fresh_order marks them clean


def test_free_all_allocated_respects_recorded_uses():
    led = SlotLedger(6)
    fs = FakeStream()
    f = fs.record()
    _a, b, _c = led.take(3)
    led.record_use([b], f)
    assert led.free_all_allocated() == 2
    assert led.state_of(b) == "pending"
    assert led.free_all_allocated() == 0
    assert led.pending_fences() == [f]
    fs.complete()
    assert led.reclaim() == 1
    led.check_invariants()


class _UnwalkableDeque(collections.deque):  # type: ignore[type-arg]
    """A free queue that fails the test if a free walks it."""

    def __iter__(self):  # type: ignore[no-untyped-def]
        raise AssertionError("free() walked the free queue")


@pytest.mark.parametrize("order", ["used first", "used last", "used alone"])
def test_freeing_a_row_with_a_recorded_use_does_not_walk_the_free_queue(order: str) -> None:
    """The fast pass of ``free`` gives way to the careful path at a row with a
    recorded use (every row of an overlap engine) and undoes the marks it
    made. Undone by walking the free queue, each such free cost O(free rows):
    2 ms a free on a 65,536-row pool. It must cost the rows marked."""
    led = SlotLedger(64)
    fs = FakeStream()
    done = fs.record()
    fs.complete()
    a, b = led.take(2)
    led.record_use([b], done)
    rows = {"used first": [b, a], "used last": [a, b], "used alone": [b]}[order]
    free_before = len(led._free)
    led._free = _UnwalkableDeque(led._free)
    assert led.free(rows) == len(rows)
    assert len(led._free) == free_before + len(rows)
    assert [led.state_of(r) for r in rows] == ["free"] * len(rows)


class _Unwalkable(list):  # type: ignore[type-arg]
    """A side list that refuses to be walked once it holds several batches."""

    def __iter__(self):  # type: ignore[no-untyped-def]
        if len(self) > 1:
            raise AssertionError("the side list of fences of unknown origin was walked")
        return super().__iter__()


def test_a_free_behind_a_fence_of_unknown_origin_does_not_walk_the_side_list(kit):
    """Joining the batch already behind a transfer handle (or starting one)
    costs O(1), not O(transfers in flight): the side list was walked on
    every such free (0.9 ms a free with 16,384 transfers pending)."""
    led = SlotLedger(16)
    led._unordered = _Unwalkable()
    fences = [kit.event_fence() for _ in range(4)]
    rows = led.take(8)
    for row, fence in zip(rows[:4], fences, strict=True):
        assert led.free([row], fence) == 0
    assert led.free([rows[4], rows[5]], fences[1]) == 0  # joins fences[1]'s batch
    assert len(led._unordered) == 4
    led._unordered = led._unordered[:]  # a plain list: walkable again (the index is rebuilt)
    assert led.free([rows[6]], fences[1]) == 0
    assert len(led._unordered) == 4
    led.check_invariants()
    fences[1].set()
    assert led.reclaim() == 4
    assert led._solo_of is led._unordered  # carried over, not rebuilt at the next free
    assert led.free([rows[7]], fences[1]) == 1  # completed: free at once
    fences[0].set()
    assert led.reclaim() == 1
    assert led.free(led.take(1), fences[2]) == 0  # joins after the list was replaced
    led.check_invariants()
