"""KVPagePool and its PageLedger: states, FIFO reuse, fences, reclaim cost,
faults, input forms, bad input atomicity, slots, stats, clear."""

from __future__ import annotations

import dataclasses
import gc
import logging
from typing import Any

import numpy as np
import pytest
import torch
from helpers import WAIT_S, FakeStream, gpu_busy
from helpers import kv_snapshot as snapshot

from asyncpool import (
    CapacityError,
    DoubleFreeError,
    FenceError,
    InvalidSlotError,
    KVPagePool,
    KVPageStats,
    PoolError,
)
from asyncpool.kv_pages import _DEVICE_OFFSETS, PageLedger


@pytest.fixture(autouse=True)
def _quiet_fault_logs(caplog):
    caplog.set_level(logging.CRITICAL, logger="asyncpool")


def ids(t: torch.Tensor) -> list[int]:
    return t.tolist()  # type: ignore[no-any-return]


# ---------------------------------------------------------------- basics


def test_page_zero_is_never_handed_out_and_capacity_is_num_pages_minus_one():
    kv = KVPagePool(9, 4)
    assert kv.capacity == 8
    assert kv.ledger.state_of(0) == "reserved"
    pages = kv.alloc(8)
    assert pages is not None and sorted(ids(pages)) == list(range(1, 9))
    assert kv.alloc(1) is None
    kv.check_invariants()


def test_alloc_returns_a_fresh_1d_int64_tensor_that_never_aliases_the_ring():
    kv = KVPagePool(64, 4)
    for n in (1, 3, 16, 40):  # tiny and vectorised paths
        pages = kv.alloc(n)
        assert pages is not None
        assert pages.dtype == torch.int64 and pages.dim() == 1 and len(pages) == n
        assert pages.device.type == "cpu"
        assert not np.may_share_memory(pages.numpy(), kv.ledger._ring)
        before = kv.ledger._ring.copy()
        pages[:] = 0  # the caller may scribble on it
        assert np.array_equal(kv.ledger._ring, before)
        kv.check_invariants()


@pytest.mark.parametrize("num_pages", [0, 1, -3, 2.0, True, None, "8"])
def test_num_pages_must_leave_one_page(num_pages):
    with pytest.raises(CapacityError):
        KVPagePool(num_pages, 16)


@pytest.mark.parametrize("page_size", [0, -1, 1.5, None, True])
def test_page_size_must_be_a_positive_int(page_size):
    with pytest.raises(CapacityError):
        KVPagePool(8, page_size)


@pytest.mark.parametrize(
    "n", [0, -1, 1.0, 2.5, True, False, None, "1", [1], np.float32(2), torch.tensor(2.0), 8]
)
def test_alloc_rejects_bad_counts_and_changes_nothing(n):
    kv = KVPagePool(8, 4)
    kept = kv.alloc(2)
    before = snapshot(kv)
    with pytest.raises(CapacityError) as ei:
        kv.alloc(n)
    assert isinstance(ei.value, ValueError)
    assert snapshot(kv) == before
    assert kept is not None


def test_alloc_accepts_integer_scalars_as_the_row_pool_does():
    kv = KVPagePool(8, 4)
    for n in (np.int64(2), torch.tensor(1), np.int32(3)):
        pages = kv.alloc(n)  # type: ignore[arg-type]
        assert pages is not None and len(pages) == int(n)
    kv.check_invariants()


def test_fresh_order_then_fifo_reuse_oldest_freed_first():
    kv = KVPagePool(11, 2)
    a = kv.alloc(3)
    b = kv.alloc(3)
    assert ids(a) == [1, 2, 3] and ids(b) == [4, 5, 6]
    kv.free(b)
    kv.free(torch.tensor([3, 1]))
    rest = kv.alloc(4)
    assert ids(rest) == [7, 8, 9, 10]  # never-used pages first
    assert ids(kv.alloc(5)) == [4, 5, 6, 3, 1]  # then in the order freed
    kv.check_invariants()


def test_ring_wraps_around_in_both_paths():
    kv = KVPagePool(41, 1)
    for n in (7, 33, 2, 39, 1, 40, 17):
        pages = kv.alloc(n)
        assert pages is not None and len(set(ids(pages))) == n
        kv.check_invariants()
        kv.free(pages)
        kv.check_invariants()


def test_alloc_is_all_or_nothing():
    kv = KVPagePool(6, 4)
    kv.alloc(3)
    before = snapshot(kv)
    assert kv.alloc(3) is None
    assert snapshot(kv) == before


# ---------------------------------------------------------------- input forms


@pytest.mark.parametrize(
    "convert",
    [
        pytest.param(lambda p: p, id="tensor"),
        pytest.param(lambda p: p.to(torch.int32), id="int32-tensor"),
        pytest.param(lambda p: p.numpy(), id="ndarray"),
        pytest.param(lambda p: p.numpy().astype(np.uint16), id="uint16-ndarray"),
        pytest.param(lambda p: p.tolist(), id="list"),
        pytest.param(lambda p: tuple(p.tolist()), id="tuple"),
        pytest.param(lambda p: [np.int64(x) for x in p.tolist()], id="numpy-scalars"),
        pytest.param(lambda p: [torch.tensor(x) for x in p.tolist()], id="torch-scalars"),
        pytest.param(lambda p: iter(p.tolist()), id="iterator"),
        pytest.param(lambda p: torch.stack([p, p])[0], id="tensor-view"),
        pytest.param(lambda p: torch.repeat_interleave(p, 2)[::2], id="strided-tensor"),
    ],
)
@pytest.mark.parametrize("n", [1, 5, 40])
def test_free_accepts_every_input_form(convert, n):
    kv = KVPagePool(64, 4)
    pages = kv.alloc(n)
    assert pages is not None
    assert kv.free(convert(pages)) == n
    assert kv.available_size() == 63
    kv.check_invariants()


def test_free_accepts_a_single_int_and_scalars():
    kv = KVPagePool(8, 4)
    a, b, c, _ = ids(kv.alloc(4))
    assert kv.free(a) == 1
    assert kv.free(np.int32(b)) == 1
    assert kv.free(torch.tensor(c)) == 1
    assert kv.free([]) == 0 and kv.free(np.zeros(0, np.int64)) == 0
    kv.check_invariants()


def test_free_does_not_alias_the_callers_array_when_deferred():
    kv = KVPagePool(64, 4)
    fs = FakeStream()
    f = fs.record()
    for n in (3, 40):
        pages = kv.alloc(n)
        assert pages is not None
        arr = pages.numpy()
        kept = arr.copy()
        assert kv.free(arr, fence=f) == 0
        arr[:] = 0  # the caller reuses its buffer
        kv.check_invariants()
        fs.complete()
        assert kv.reclaim() == n
        assert {kv.ledger.state_of(p) for p in kept.tolist()} == {"free"}
        f = fs.record()


# ---------------------------------------------------------------- bad input

BAD_INPUTS: list[Any] = [
    # (description, builder(good_pages) -> argument, expected error)
    ("page 0", lambda g: [0], InvalidSlotError),
    ("page 0 among good", lambda g: [*g, 0], InvalidSlotError),
    ("negative", lambda g: [-1], InvalidSlotError),
    ("negative wraps to a real page", lambda g: np.array([g[0] - 64]), InvalidSlotError),
    ("out of range", lambda g: [64], InvalidSlotError),
    ("huge", lambda g: [2**40], InvalidSlotError),
    ("past int64", lambda g: [2**70], InvalidSlotError),
    ("uint64 past 2**63", lambda g: np.array([2**64 - 1], dtype=np.uint64), InvalidSlotError),
    ("duplicate", lambda g: [g[0], g[0]], InvalidSlotError),
    ("duplicate, vectorised", lambda g: torch.tensor([*g, g[3]]), InvalidSlotError),
    ("duplicate, tiny tensor", lambda g: torch.tensor([g[1], g[1]]), InvalidSlotError),
    ("duplicate, tiny tensor, far apart", lambda g: torch.tensor([*g[:3], g[0]]), InvalidSlotError),
    ("never allocated", lambda g: [60], InvalidSlotError),
    # One-page tensors (free's inline path) and tiny int64 tensors.
    ("page 0, one-page tensor", lambda g: torch.tensor([0]), InvalidSlotError),
    ("negative, one-page tensor", lambda g: torch.tensor([-1]), InvalidSlotError),
    ("out of range, one-page tensor", lambda g: torch.tensor([64]), InvalidSlotError),
    ("already free, one-page tensor", lambda g: torch.tensor([50]), DoubleFreeError),
    ("already free, tiny tensor", lambda g: torch.tensor([*g[:3], 50]), DoubleFreeError),
    ("never allocated, tiny tensor", lambda g: torch.tensor([g[0], 60]), InvalidSlotError),
    ("bool, one-page tensor", lambda g: torch.tensor([True]), InvalidSlotError),
    ("2-D (1, 1) tensor", lambda g: torch.tensor([[g[0]]]), InvalidSlotError),
    ("empty 2-D tensor", lambda g: torch.zeros(0, 3, dtype=torch.int64), InvalidSlotError),
    ("2-D long tensor", lambda g: torch.tensor([g, g]), InvalidSlotError),
    ("already free", lambda g: [50], DoubleFreeError),
    ("already free among good", lambda g: np.array([*g, 50]), DoubleFreeError),
    ("float", lambda g: [1.0], InvalidSlotError),
    ("float among good", lambda g: [*g[:2], 2.0], InvalidSlotError),
    ("bool", lambda g: [True], InvalidSlotError),
    ("numpy bool", lambda g: [np.True_], InvalidSlotError),
    ("bool tensor element", lambda g: [torch.tensor(True)], InvalidSlotError),
    ("float tensor element", lambda g: [torch.tensor(1.0)], InvalidSlotError),
    ("string element", lambda g: ["1"], InvalidSlotError),
    ("None element", lambda g: [None], InvalidSlotError),
    ("float tensor", lambda g: torch.tensor(g, dtype=torch.float32), InvalidSlotError),
    ("bfloat16 tensor", lambda g: torch.tensor(g, dtype=torch.bfloat16), InvalidSlotError),
    ("bool tensor", lambda g: torch.ones(3, dtype=torch.bool), InvalidSlotError),
    ("float ndarray", lambda g: np.array(g, dtype=np.float64), InvalidSlotError),
    ("bool ndarray", lambda g: np.ones(2, dtype=bool), InvalidSlotError),
    ("2-D tensor", lambda g: torch.tensor([g[:2], g[2:4]]), InvalidSlotError),
    ("2-D ndarray", lambda g: np.array([g[:2], g[2:4]]), InvalidSlotError),
    ("a string", lambda g: "12", InvalidSlotError),
    ("a dict", lambda g: {g[0]: 1}, InvalidSlotError),
    ("None", lambda g: None, InvalidSlotError),
    ("a float", lambda g: 3.0, InvalidSlotError),
    ("bool scalar", lambda g: True, InvalidSlotError),
]


@pytest.mark.parametrize("build, expected", [pytest.param(b, e, id=d) for d, b, e in BAD_INPUTS])
@pytest.mark.parametrize("with_fence", [False, True])
def test_bad_free_raises_typed_error_and_changes_nothing(build, expected, with_fence):
    kv = KVPagePool(64, 4)
    good = ids(kv.alloc(20))
    spare = kv.alloc(30)  # pages 21..50 allocated; 51..63 never allocated
    assert spare is not None
    kv.free(torch.tensor([50]))  # 50: already free
    fs = FakeStream()
    pending = kv.alloc(2)
    kv.free(pending, fence=fs.record())  # some pending state to keep
    before = snapshot(kv)
    fence = fs.record() if with_fence else None
    with pytest.raises(expected) as ei:
        kv.free(build(good), fence=fence)
    assert isinstance(ei.value, PoolError) and isinstance(ei.value, ValueError)
    assert snapshot(kv) == before
    # Still serving, and the good pages are still allocated.
    assert kv.free(good) == len(good)
    kv.check_invariants()


def test_double_free_and_free_of_pending_raise_double_free_error():
    kv = KVPagePool(16, 4)
    fs = FakeStream()
    a = kv.alloc(3)
    b = kv.alloc(20 // 2)
    kv.free(a)
    kv.free(b, fence=fs.record())
    before = snapshot(kv)
    for bad in (a, a[:1], b, b[2:3], [*ids(b)[:1]]):
        with pytest.raises(DoubleFreeError):
            kv.free(bad)
        assert snapshot(kv) == before
    with pytest.raises(DoubleFreeError, match="pending"):
        kv.free(b[:1])


def test_never_allocated_page_is_not_called_a_double_free():
    kv = KVPagePool(16, 4)
    kv.alloc(3)
    with pytest.raises(InvalidSlotError, match="never allocated") as ei:
        kv.free([9])
    assert not isinstance(ei.value, DoubleFreeError)


def test_mixed_call_with_one_bad_id_frees_none_of_them():
    kv = KVPagePool(300, 4)
    pages = kv.alloc(200)
    assert pages is not None
    bad = torch.cat([pages[:150], torch.tensor([0]), pages[150:]])
    before = snapshot(kv)
    with pytest.raises(InvalidSlotError, match="page 0"):
        kv.free(bad)
    assert snapshot(kv) == before
    # The first bad id in call order is the one reported.
    with pytest.raises(InvalidSlotError, match="page 300 is out of range"):
        kv.free([*ids(pages[:3]), 300, 0])
    assert snapshot(kv) == before


@pytest.mark.parametrize("fence", [object(), 3, "f", lambda: True])
def test_non_fence_is_a_type_error_and_changes_nothing(fence):
    kv = KVPagePool(8, 4)
    pages = kv.alloc(2)
    before = snapshot(kv)
    with pytest.raises(TypeError):
        kv.free(pages, fence=fence)
    assert snapshot(kv) == before


def test_bad_after_stream_is_a_type_error_and_changes_nothing():
    kv = KVPagePool(8, 4)
    pages = kv.alloc(2)
    before = snapshot(kv)
    with pytest.raises(TypeError):
        kv.free(pages, after=object())
    assert snapshot(kv) == before


def test_refused_free_records_no_fence_on_the_after_stream(kit):
    kv = KVPagePool(8, 4)
    s = kit.stream()
    kv.alloc(2)
    seq_before = s._seq
    with pytest.raises(InvalidSlotError):
        kv.free([0], after=s)
    assert s._seq == seq_before


# ---------------------------------------------------------------- fences


def test_gated_host_stream_holds_pages_until_the_gate_opens(kit):
    kv = KVPagePool(5, 4)  # 4 pages: no slack to hide a reuse
    s = kit.stream()
    gate = kit.gate(s)
    mine = kv.alloc(4)
    assert mine is not None
    assert kv.free(mine, after=s) == 0
    assert kv.pending_size() == 4 and kv.available_size() == 0
    for _ in range(3):
        assert kv.alloc(1) is None  # not before the fence: alloc reclaims, finds nothing
    assert all(kv.ledger.state_of(p) == "pending" for p in ids(mine))
    gate.open()
    s.synchronize()
    got = kv.alloc(4)  # right after: alloc's reclaim finds the fence done
    assert got is not None and ids(got) == ids(mine)
    st = kv.stats()
    assert st.deferred_frees == 4 and st.reclaimed == 4 and st.pending == 0
    assert st.fence_latency.count == 1
    kv.check_invariants()


def test_explicit_fence_and_after_stream_both_hold_the_pages(kit):
    kv = KVPagePool(6, 4)
    s1, s2 = kit.stream(), kit.stream()
    g1, g2 = kit.gate(s1), kit.gate(s2)
    pages = kv.alloc(3)
    f1 = s1.record()
    assert kv.free(pages, fence=f1, after=s2) == 0
    [batch] = kv.ledger.pending_batches()
    assert len(batch.rest) == 1  # one batch waiting on two fences
    g1.open()
    f1.wait(WAIT_S)
    assert kv.reclaim() == 0 and kv.pending_size() == 3
    g2.open()
    s2.synchronize()
    assert kv.reclaim() == 3
    kv.check_invariants()


def test_two_fences_on_one_stream_wait_for_the_newest_only():
    kv = KVPagePool(6, 4)
    fs = FakeStream()
    f1, f2 = fs.record(), fs.record()
    kv.free(kv.alloc(2), fence=f2)
    [batch] = kv.ledger.pending_batches()
    assert batch.fence is f2 and batch.rest == ()
    led = kv.ledger
    pages = led.take(2)
    assert pages is not None
    assert led.free(pages, [f1, f2]) == 0
    assert all(not b.rest for b in led.pending_batches())
    fs.complete(1)
    assert kv.reclaim() == 0
    fs.complete(2)
    assert kv.reclaim() == 4


def test_out_of_record_order_frees_on_one_stream_reclaim_in_order():
    kv = KVPagePool(10, 4)
    fs = FakeStream()
    f1, f2, f3 = fs.record(), fs.record(), fs.record()
    a, b, c = kv.alloc(2), kv.alloc(2), kv.alloc(2)
    kv.free(a, fence=f3)
    kv.free(b, fence=f1)
    kv.free(c, fence=f2)
    q = kv.ledger._streams[fs.key]
    assert [bt.seq for bt in q] == [1, 2, 3]
    assert [bt.did for bt in q] == [1, 2, 0]  # deferral ids keep the order of the frees
    kv.check_invariants()
    fs.complete(1)
    assert kv.reclaim() == 2
    assert kv.ledger.state_of(ids(b)[0]) == "free" and kv.ledger.state_of(ids(c)[0]) == "pending"
    fs.complete(2)
    assert kv.reclaim() == 2
    fs.complete(3)
    assert kv.reclaim() == 2
    assert ids(kv.alloc(9)[-6:]) == ids(b) + ids(c) + ids(a)  # FIFO in reclaim order


def test_frees_behind_one_fence_join_one_batch():
    kv = KVPagePool(40, 4)
    fs = FakeStream()
    seen: list[Any] = []
    kv.ledger.set_hooks(on_pending=seen.append, on_fault=None)
    f = fs.record()
    for _ in range(5):
        kv.free(kv.alloc(7), fence=f)
    [batch] = kv.ledger.pending_batches()
    assert batch.n == 35 and len(batch.items) == 5
    assert seen == [f]  # one wake-up arrangement per batch
    fs.complete()
    assert kv.reclaim() == 35
    kv.check_invariants()


def test_reclaim_looks_only_at_each_streams_head():
    kv = KVPagePool(201, 1)
    fs = FakeStream()
    fences = [fs.record() for _ in range(100)]
    for f in fences:
        kv.free(kv.alloc(2), fence=f)
    for f in fences:
        f.queries = 0
    assert kv.reclaim() == 0
    assert fences[0].queries == 1 and sum(f.queries for f in fences[1:]) == 0
    fences[7].override = True  # a later fence wrongly claiming completion: never asked
    assert kv.reclaim() == 0 and fences[7].queries == 0
    fences[7].override = None
    fs.complete(50)
    assert kv.reclaim() == 100
    assert sum(f.queries for f in fences[51:]) == 0
    kv.check_invariants()


class TransferHandle:
    """A KV transfer's handle: a plain object with query()/synchronize()."""

    def __init__(self) -> None:
        self.done = False
        self.error: BaseException | None = None

    def query(self) -> bool:
        if self.error is not None:
            raise self.error
        return self.done

    def synchronize(self) -> None:  # pragma: no cover - the pool never blocks
        raise AssertionError("the pool must not block on a transfer")


def test_transfer_handle_is_a_fence_of_unknown_origin_polled_in_full():
    kv = KVPagePool(10, 4)
    t1, t2 = TransferHandle(), TransferHandle()
    a, b = kv.alloc(3), kv.alloc(3)
    assert kv.free(a, fence=t1) == 0
    assert kv.free(b, fence=t2) == 0
    assert len(kv.ledger._unordered) == 2
    t2.done = True  # completes out of order: no head-of-line blocking
    assert kv.reclaim() == 3
    assert kv.ledger.state_of(ids(b)[0]) == "free" and kv.ledger.state_of(ids(a)[0]) == "pending"
    t1.done = True
    assert kv.reclaim() == 3
    kv.check_invariants()


def test_completed_fence_frees_at_once():
    kv = KVPagePool(8, 4)
    fs = FakeStream()
    f = fs.record()
    fs.complete()
    assert kv.free(kv.alloc(3), fence=f) == 3
    assert kv.pending_size() == 0 and kv.stats().deferred_frees == 0


# ---------------------------------------------------------------- faults


def test_faulted_fence_quarantines_counts_and_the_pool_keeps_serving(kit):
    faults: list[Any] = []
    kv = KVPagePool(9, 4)
    kv.ledger.set_hooks(on_pending=None, on_fault=lambda f, e: faults.append((f, e)))
    s = kit.stream()
    gate = kit.gate(s)
    boom = RuntimeError("transfer engine died")

    def bad() -> None:
        raise boom

    s.launch(bad)
    doomed = kv.alloc(3)
    assert kv.free(doomed, after=s) == 0
    gate.open()
    with pytest.raises(FenceError):
        s.synchronize()
    assert kv.reclaim() == 0
    st = kv.stats()
    assert st.quarantined == 3 and st.pending == 0 and st.fence_errors == 1
    assert isinstance(kv.ledger.last_fence_error, FenceError)
    assert faults and isinstance(faults[0][1], FenceError)
    kv.check_invariants()
    for _ in range(10):  # keeps serving, never hands out a quarantined page
        pages = kv.alloc(5)
        assert pages is not None and not set(ids(pages)) & set(ids(doomed))
        kv.free(pages)
    assert kv.alloc(6) is None
    with pytest.raises(InvalidSlotError, match="quarantined") as ei:
        kv.free(doomed[:1])
    assert not isinstance(ei.value, DoubleFreeError)


def test_free_behind_an_already_faulted_transfer_quarantines_at_once():
    kv = KVPagePool(8, 4)
    t = TransferHandle()
    t.error = RuntimeError("nixl: remote gone")
    assert kv.free(kv.alloc(3), fence=t) == 0
    assert kv.quarantined_size() == 3 and kv.pending_size() == 0
    assert kv.stats().fence_errors == 1
    kv.check_invariants()


def test_fault_of_a_second_fence_quarantines_a_batch_whose_head_completed():
    kv = KVPagePool(8, 4)
    sa, sb = FakeStream(), FakeStream()
    pages = kv.alloc(3)
    kv.free(pages, fence=sa.record(), after=None)
    led = kv.ledger
    more = led.take(2)
    assert more is not None
    led.free(more, [sa.record(), sb.record()])
    sa.complete()
    sb.fault()
    assert kv.reclaim() == 3
    assert kv.quarantined_size() == 2 and kv.stats().fence_errors == 1
    kv.check_invariants()


def test_fault_is_logged_with_the_pages(caplog):
    caplog.set_level(logging.ERROR, logger="asyncpool")
    kv = KVPagePool(40, 4)
    t = TransferHandle()
    t.error = RuntimeError("gone")
    kv.free(kv.alloc(30), fence=t)
    [rec] = [r for r in caplog.records if "quarantined pages" in r.getMessage()]
    assert "(30 in all)" in rec.getMessage()


# ---------------------------------------------------------------- slots


def test_slots_are_page_times_page_size_plus_offset():
    kv = KVPagePool(16, 4)
    pages = kv.alloc(3)
    assert pages is not None
    slots = kv.slots(pages)
    assert slots.dtype == torch.int64 and slots.shape == (12,)
    expect = [p * 4 + o for p in ids(pages) for o in range(4)]
    assert slots.tolist() == expect
    assert kv.slots(ids(pages)).tolist() == expect
    assert kv.slots(np.array(ids(pages), dtype=np.int32)).tolist() == expect
    assert kv.slots(7).tolist() == [28, 29, 30, 31]
    assert kv.slots([]).shape == (0,)


@pytest.mark.parametrize("bad", [[0], [16], [-1], [1.5], torch.tensor([1.0]), "x", None])
def test_slots_refuses_page_zero_and_out_of_range(bad):
    kv = KVPagePool(16, 4)
    with pytest.raises(InvalidSlotError):
        kv.slots(bad)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8])
def test_device_slots_match_the_checked_slots_without_reading_ids(dtype):
    """The arithmetic a CUDA pool runs on a device tensor of ids (where reading
    them would wait for the stream), here on host tensors: the same slots as
    the checked path, for every shape slots() takes."""
    kv = KVPagePool(16, 4)
    for pages in ([3, 1, 9], [7], []):
        t = torch.tensor(pages, dtype=dtype)
        assert kv._device_slots(t).tolist() == kv.slots(pages).tolist()
    assert kv._device_slots(torch.tensor(7, dtype=dtype)).tolist() == [28, 29, 30, 31]
    assert kv._device_slots(torch.tensor([2], dtype=dtype)).dtype == torch.int64


@pytest.mark.parametrize(
    "bad", [torch.tensor([1.0]), torch.tensor([True]), torch.ones(2, 2, dtype=torch.int64)]
)
def test_device_slots_refuse_what_is_not_a_1d_integer_tensor(bad):
    kv = KVPagePool(16, 4)
    with pytest.raises(InvalidSlotError, match="1-D integer tensor"):
        kv._device_slots(bad)


@pytest.mark.cuda
def test_slots_of_a_cuda_tensor_are_computed_on_the_gpu_without_waiting() -> None:
    from asyncpool import record_fence

    # As in a fresh process: the pool must make the offsets when built, for
    # made at the first slots() they would wait for the busy stream below.
    # (Nothing queued reads the old ones once synchronized.)
    torch.cuda.synchronize()
    _DEVICE_OFFSETS.clear()
    kv = KVPagePool(16, 4, device="cuda")
    pages = kv.alloc(3)
    assert pages is not None and pages.is_cuda
    host = pages.tolist()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        gpu_busy(300)  # a step in flight on the current stream
        busy = record_fence(stream)
        slots = kv.slots(pages)
        assert not busy.query()  # not read back: nothing waited for the stream
    torch.cuda.synchronize()
    assert slots.is_cuda and slots.tolist() == kv.slots(host).tolist()
    # The offsets those kernels read are the process's, not the pool's: a
    # pool collected with such a kernel still queued gives nothing back to
    # torch's allocator for another stream to reuse, and pools share them.
    key = (slots.device, 4)
    offsets = _DEVICE_OFFSETS[key]
    del kv, pages, slots
    gc.collect()
    assert _DEVICE_OFFSETS[key] is offsets
    again = KVPagePool(32, 4, device="cuda")
    assert _DEVICE_OFFSETS[key] is offsets and again.slots(again.alloc(1)).is_cuda


# ---------------------------------------------------------------- stats, clear, put_back


def test_stats_snapshot_is_frozen_and_adds_up():
    kv = KVPagePool(20, 8)
    fs = FakeStream()
    a = kv.alloc(10)
    kv.free(a[:4], fence=fs.record())
    st = kv.stats()
    assert isinstance(st, KVPageStats)
    assert (st.num_pages, st.page_size, st.capacity) == (20, 8, 19)
    assert (st.free, st.allocated, st.pending, st.quarantined) == (9, 6, 4, 0)
    assert st.free + st.allocated + st.pending + st.quarantined == st.capacity
    assert (st.peak_allocated, st.allocs, st.frees, st.deferred_frees) == (10, 10, 4, 4)
    assert st.pending_fences == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        st.free = 0  # type: ignore[misc]


def test_clear_frees_allocated_pages_but_never_one_behind_an_open_fence(kit):
    kv = KVPagePool(10, 4)
    s = kit.stream()
    gate = kit.gate(s)
    kv.alloc(3)
    behind = kv.alloc(2)
    kv.free(behind, after=s)
    kv.clear()
    assert kv.allocated_size() == 0
    assert kv.pending_size() == 2 and kv.available_size() == 7
    gate.open()
    s.synchronize()
    kv.clear()
    assert kv.available_size() == 9
    kv.check_invariants()


def test_put_back_returns_pages_to_the_head_as_if_never_given():
    led = PageLedger(10)
    first = led.take(3)
    assert first is not None
    led.put_back(first)
    assert led.allocs == 0 and led.free_count == 9
    again = led.take(3)
    assert again is not None and again.tolist() == first.tolist()
    with pytest.raises(InvalidSlotError):
        led.put_back([9])  # never taken
    led.check_invariants()


def test_page_ledger_take_and_free_for_an_owning_pool():
    led = PageLedger(300)
    fs = FakeStream()
    pages = led.take(256)
    assert isinstance(pages, np.ndarray) and pages.dtype == np.int64
    assert led.free(pages, [fs.record()]) == 0
    with pytest.raises(TypeError):
        led.free(pages, [object()])  # type: ignore[list-item]
    fs.complete()
    assert led.reclaim() == 256
    led.check_invariants()


def test_alloc_reclaims_before_answering_none():
    kv = KVPagePool(5, 4)
    fs = FakeStream()
    kv.free(kv.alloc(4), fence=fs.record())
    assert kv.alloc(1) is None
    fs.complete()
    assert kv.alloc(4) is not None


def test_repr_mentions_the_counts():
    kv = KVPagePool(5, 4)
    kv.alloc(1)
    assert "allocated=1" in repr(kv)


# ---------------------------------------------------------------- CUDA


@pytest.mark.cuda
@pytest.mark.parametrize("n", [4, 64])
def test_pages_on_cuda_wait_for_a_cuda_fence_and_the_late_write_misses_the_next_owner(n):
    from asyncpool import record_fence

    stream = torch.cuda.Stream()
    kv = KVPagePool(n + 1, 4, device="cuda")
    cache = torch.zeros((n + 1) * 4, dtype=torch.int64, device="cuda")
    a = kv.alloc(n)
    assert a is not None and a.is_cuda
    slots_a = kv.slots(a)
    assert slots_a.is_cuda
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        gpu_busy(300)
        # the late write of a step in flight (a kernel: `cache[slots_a] = 1`
        # copies the 1 from the host, a copy that waits for the stream)
        cache.index_fill_(0, slots_a, 1)
    assert kv.free(a, fence=record_fence(stream)) == 0
    assert kv.alloc(1) is None
    stream.synchronize()
    b = kv.alloc(n)
    assert b is not None and sorted(b.tolist()) == sorted(a.tolist())
    cache[kv.slots(b)] = 2
    torch.cuda.synchronize()
    assert bool((cache[kv.slots(b)] == 2).all())
    kv.check_invariants()
