"""ReqToTokenPool (the seed's synchronous API): seed parity, fence-deferred
frees, clear(), lazy resets, quarantine, bad input atomicity."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from helpers import WAIT_S, FakeStream, assert_conserved, pool_snapshot
from torch.utils._python_dispatch import TorchDispatchMode

from asyncpool import (
    CapacityError,
    DoubleFreeError,
    FenceError,
    InvalidSlotError,
    PoolStats,
    ReqToTokenPool,
    ReqToTokenPoolInfo,
)


@pytest.fixture(autouse=True)
def _quiet_fault_logs(caplog):
    caplog.set_level(logging.CRITICAL, logger="asyncpool")


def make(size: int = 9, ctx: int = 16) -> ReqToTokenPool:
    return ReqToTokenPool(size, ctx, device="cpu", enable_memory_saver=False)


def fill(pool: ReqToTokenPool, row: int, verified: int, alloced: int) -> None:
    slots = torch.arange(100, 100 + alloced, dtype=torch.int32)
    pool.set_req_pool_info(row, ReqToTokenPoolInfo(verified, alloced, slots))


def lens(pool: ReqToTokenPool, row: int) -> tuple[int, int, int]:
    return (
        int(pool.verified_lens[row]),
        int(pool.alloced_lens[row]),
        int(pool.alloced_lens_cpu[row]),
    )


# ---------------------------------------------------------------- seed parity


def test_seed_parity_shapes_and_start_state():
    pool = make(9, 16)
    assert pool.available_size() == 8 == pool.size - 1 == pool.capacity
    assert pool.pending_size() == 0 and pool.allocated_size() == 0
    assert pool.req_to_token.shape == (9, 16) and pool.req_to_token.dtype == torch.int32
    for t in (pool.verified_lens, pool.alloced_lens, pool.alloced_lens_cpu):
        assert t.shape == (9,) and t.dtype == torch.int32
        assert int(t.abs().sum()) == 0
    assert pool.alloc(3) == [1, 2, 3]
    assert pool.available_size() == 5


def test_alloc_returns_none_when_short_and_changes_nothing():
    pool = make(5)
    pool.alloc(3)
    before = pool_snapshot(pool)
    assert pool.alloc(2) is None
    assert pool_snapshot(pool) == before
    assert pool.alloc(1) == [4]
    assert pool.alloc(1) is None


@pytest.mark.parametrize("n", [0, -1, 9, 100, 1.0, True, None, "2"])
def test_alloc_bad_sizes_raise_capacity_error_and_change_nothing(n):
    pool = make(9)
    pool.alloc(2)
    before = pool_snapshot(pool)
    with pytest.raises(CapacityError):
        pool.alloc(n)
    assert pool_snapshot(pool) == before


def test_fifo_reuse_through_the_pool():
    pool = make(5)
    rows = pool.alloc(4)
    for r in (3, 1, 4, 2):
        pool.free([r])
    assert pool.alloc(4) == [3, 1, 4, 2]
    assert rows == [1, 2, 3, 4]


def test_free_accepts_int_list_tuple_range():
    pool = make(9)
    pool.alloc(8)
    assert pool.free(1) == 1
    assert pool.free([2, 3]) == 2
    assert pool.free((4,)) == 1
    assert pool.free(range(5, 7)) == 2
    assert pool.free(iter([7, 8])) == 2
    assert pool.available_size() == 8
    assert_conserved(pool)


def test_reallocated_row_reads_zero_lengths():
    pool = make(4)
    [row] = pool.alloc(1)
    fill(pool, row, 3, 5)
    assert lens(pool, row) == (3, 5, 5)
    assert pool.req_to_token[row, :5].tolist() == [100, 101, 102, 103, 104]
    pool.free([row])
    # Cycle until FIFO hands the same row out again.
    for _ in range(3):
        got = pool.alloc(1)
        if got == [row]:
            break
        pool.free(got)
    else:
        pytest.fail("row never came back")
    assert lens(pool, row) == (0, 0, 0)


def test_every_reallocated_row_reads_zero_over_many_cycles():
    pool = make(17)
    cap = pool.capacity
    for i in range(5 * cap):
        rows = pool.alloc(1 + i % 4)
        assert rows is not None
        for r in rows:
            assert lens(pool, r) == (0, 0, 0), (i, r)
            fill(pool, r, 1 + i % 3, 3)
        pool.free(rows)


def test_lazy_reset_one_bulk_op_per_capacity_frees():
    pool = make(33)
    cap = pool.capacity
    resets0 = pool._ledger.resets

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    with Count():
        for _ in range(10 * cap):
            rows = pool.alloc(1)
            pool.free(rows)
    resets = pool._ledger.resets - resets0
    assert 1 <= resets <= 10
    # No torch op per alloc/free: only the bulk resets touch tensors.
    assert Count.ops <= 4 * resets
    assert pool.stats().resets == pool._ledger.resets


# ---------------------------------------------------------------- fences


def test_row_behind_gate_not_reused_until_gate_opens(kit):
    pool = make(5)
    s = kit.stream()
    gate = kit.gate(s)
    rows = pool.alloc(3)
    victim = rows[0]
    # The in-flight step writes the row after the gate, as a forward would.
    s.launch(pool.verified_lens.__setitem__, victim, 99)
    f = s.record()
    pool.record_use(rows, f)
    assert pool.free([victim]) == 0
    assert pool.pending_size() == 1
    assert pool.alloc(2) is None
    assert pool.alloc(1) == [4]
    assert pool.alloc(1) is None
    assert pool.reclaim() == 0
    gate.open()
    assert f.wait(WAIT_S)
    assert int(pool.verified_lens[victim]) == 99  # the late write landed...
    assert pool.alloc(1) == [victim]  # ...and alloc reclaimed right after
    assert lens(pool, victim) == (0, 0, 0)  # ...and the new owner reads zero
    assert_conserved(pool)


def test_without_fence_the_late_write_corrupts_the_new_owner(kit):
    """Control for the test above: the same schedule with the protection off
    (free without the step's fence) lets the late write land in a reused row."""
    pool = make(2)
    s = kit.stream()
    gate = kit.gate(s)
    [row] = pool.alloc(1)
    s.launch(pool.verified_lens.__setitem__, row, 99)
    f = s.record()
    pool.free([row])  # seed behaviour: no record_use
    assert pool.alloc(1) == [row]  # reused at once
    assert lens(pool, row) == (0, 0, 0)
    gate.open()
    assert f.wait(WAIT_S)
    assert int(pool.verified_lens[row]) == 99  # corruption the fence prevents


def test_alloc_reclaims_completed_fences_before_answering_none():
    pool = make(3)
    fs = FakeStream()
    rows = pool.alloc(2)
    pool.free(rows, fs.record())
    assert pool.alloc(2) is None
    fs.complete()
    assert pool.alloc(2) == rows
    assert pool.stats().reclaimed == 2


def test_free_after_stream_records_a_fence(kit):
    pool = make(5)
    s = kit.stream()
    gate = kit.gate(s)
    rows = pool.alloc(2)
    seq_before = s._seq
    assert pool.free(rows, after=s) == 0
    assert s._seq == seq_before + 1
    assert pool.pending_size() == 2
    gate.open()
    s.synchronize()
    assert pool.reclaim() == 2
    assert pool.available_size() == 4


def test_free_iterator_with_after_frees_every_row(kit):
    """Regression: record_use consumed the iterator and free() freed nothing."""
    pool = make(5)
    s = kit.stream()
    rows = pool.alloc(3)
    pool.free(iter(rows), after=s)
    s.synchronize()
    pool.reclaim()
    assert pool.allocated_size() == 0
    assert pool.available_size() == 4
    assert_conserved(pool)


def test_free_fence_and_after_both_waited_for(kit):
    pool = make(5)
    a, b = kit.stream(), kit.stream()
    ga, gb = kit.gate(a), kit.gate(b)
    fa = a.record()
    rows = pool.alloc(2)
    pool.free(rows, fa, after=b)
    gb.open()
    b.synchronize()
    assert pool.reclaim() == 0
    ga.open()
    assert fa.wait(WAIT_S)
    assert pool.reclaim() == 2


def test_record_use_waits_for_newest_of_three_inflight_steps(kit):
    pool = make(4)
    s = kit.stream()
    gates, fences = [], []
    for _ in range(3):
        gates.append(kit.gate(s))
        fences.append(s.record())
    [row] = pool.alloc(1)
    for f in fences:
        pool.record_use([row], f)
    pool.free([row])
    for i in range(2):
        gates[i].open()
        assert fences[i].wait(WAIT_S)
        assert pool.reclaim() == 0
        assert pool.pending_size() == 1
    gates[2].open()
    assert fences[2].wait(WAIT_S)
    assert pool.reclaim() == 1


def test_faulted_stream_quarantines_and_pool_keeps_serving(kit):
    pool = make(6)
    s = kit.stream()
    gate = kit.gate(s)
    s.launch(lambda: 1 / 0)
    f = s.record()
    bad = pool.alloc(2)
    pool.record_use(bad, f)
    pool.free(bad)
    gate.open()
    with pytest.raises(FenceError):
        f.wait(WAIT_S)
    assert pool.reclaim() == 0
    st = pool.stats()
    assert st.quarantined == 2 and st.pending == 0 and st.fence_errors == 1
    assert pool.quarantined_size() == 2
    assert isinstance(pool._ledger.last_fence_error, FenceError)
    good = pool.alloc(3)
    assert not set(good) & set(bad)
    assert pool.alloc(1) is None  # 5 rows, 2 quarantined: 3 usable
    pool.free(good)
    assert pool.alloc(3) is not None
    assert_conserved(pool)


# ---------------------------------------------------------------- clear


def test_clear_restores_everything_and_zeroes_the_lengths():
    pool = make(9)
    rows = pool.alloc(5)
    for r in rows:
        fill(pool, r, 2, 4)
    pool.free(rows[:2])
    pool.clear()
    assert pool.available_size() == 8
    assert pool.allocated_size() == 0 and pool.pending_size() == 0
    for t in (pool.verified_lens, pool.alloced_lens, pool.alloced_lens_cpu):
        assert int(t.abs().sum()) == 0
    assert pool.alloc(8) == list(range(1, 9))  # fresh row order
    assert_conserved(pool)


def test_clear_leaves_a_row_behind_an_open_fence_pending(kit):
    pool = make(5)
    s = kit.stream()
    gate = kit.gate(s)
    rows = pool.alloc(3)
    f = s.record()
    pool.record_use(rows[:1], f)
    pool.free(rows[1:2], f)
    pool.clear()
    assert pool.pending_size() == 2
    assert pool.available_size() == 2
    assert pool._ledger.state_of(rows[0]) == "pending"
    assert pool.alloc(3) is None
    pool.clear()  # still never releases them
    assert pool.pending_size() == 2
    gate.open()
    assert f.wait(WAIT_S)
    got = pool.alloc(4)
    assert got is not None and set(rows[:2]) <= set(got)
    assert_conserved(pool)


# ---------------------------------------------------------------- bad input


def test_bad_frees_raise_typed_errors_and_change_nothing():
    pool = make(9)
    fs = FakeStream()
    a, b, c = pool.alloc(3)
    pool.free([b])
    pool.free([c], fs.record())
    cases = [
        ([0], InvalidSlotError),
        ([-1], InvalidSlotError),
        ([9], InvalidSlotError),
        ([1.0], InvalidSlotError),
        ([True], InvalidSlotError),
        ([8], InvalidSlotError),  # never allocated
        ([a, a], InvalidSlotError),
        ([b], DoubleFreeError),
        ([c], DoubleFreeError),
        ([a, b], DoubleFreeError),
        ("x", InvalidSlotError),
    ]
    for rows, exc in cases:
        before = pool_snapshot(pool)
        with pytest.raises(exc):
            pool.free(rows)
        assert pool_snapshot(pool) == before, rows
    before = pool_snapshot(pool)
    with pytest.raises(TypeError):
        pool.free([a], fence=object())
    with pytest.raises(TypeError):
        pool.free([a], after=object())
    with pytest.raises(TypeError):
        pool.record_use([a], object())
    with pytest.raises(InvalidSlotError):
        pool.record_use([b], fs.record())
    assert pool_snapshot(pool) == before
    assert pool._ledger.state_of(a) == "allocated"


def test_set_req_pool_info_on_rows_not_allocated_raises():
    pool = make(5)
    [row] = pool.alloc(1)
    info = ReqToTokenPoolInfo(1, 2, torch.tensor([5, 6], dtype=torch.int32))
    for bad in (0, 4, 5, -1, "1"):
        before = pool_snapshot(pool)
        with pytest.raises(InvalidSlotError):
            pool.set_req_pool_info(bad, info)
        assert pool_snapshot(pool) == before
    pool.set_req_pool_info(row, info)
    assert lens(pool, row) == (1, 2, 2)


# ---------------------------------------------------------------- stats


def test_stats_is_frozen_and_adds_up(kit):
    pool = make(9)
    s = kit.stream()
    gate = kit.gate(s)
    rows = pool.alloc(5)
    pool.free(rows[:1])
    pool.free(rows[1:3], after=s)
    st = pool.stats()
    assert isinstance(st, PoolStats)
    with pytest.raises(dataclasses.FrozenInstanceError):
        st.free = 0  # type: ignore[misc]
    assert (st.capacity, st.free, st.allocated, st.pending, st.quarantined) == (8, 4, 2, 2, 0)
    assert st.allocs == 5 and st.frees == 3 and st.deferred_frees == 2
    assert st.peak_allocated == 5 and st.waiters == 0
    gate.open()
    s.synchronize()
    pool.reclaim()
    st2 = pool.stats()
    assert st2.reclaimed == 2 and st2.pending == 0
    assert st2.fence_latency.count == 1 and st2.fence_latency.max_s >= 0
    assert "free=6" in repr(pool) and "allocated=2" in repr(pool)
