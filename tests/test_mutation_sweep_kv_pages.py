"""Gaps found by a mechanical mutation sweep of ``asyncpool/kv_pages.py``
(``PageLedger`` and ``KVPagePool``).

Each test pins one behaviour that a generated mutant broke while the focused
page-pool test files still passed:

* ``check_num_pages`` accepts exactly ``MAX_NUM_PAGES`` (2**31) pages and
  refuses one more (the bound, not one below it); the smallest pool, of 2
  pages (one page and the reserved page 0), is accepted and works;
* a fresh pool's ``peak_allocated`` is 0;
* ``PageLedger`` checks ``num_pages`` itself, as ``KVPagePool`` does: a
  ledger of no pages (or of a non-int count) is a ``CapacityError``, not a
  ledger of capacity 0;
* ``free_all_allocated`` returns how many pages it freed;
* a 0-d integer tensor or numpy array of a subclass frees its one page, as
  a plain one does (the subclass paths of ``prepare``, not the iterable
  fallback, which cannot iterate a 0-d array);
* ``take`` counts quarantined pages out of the allocated ones when it
  raises the peak (``peak_allocated`` is what was really allocated);
* ``alloc`` of a numpy or 0-d torch integer count equal to the capacity
  (validated by ``check_n``) hands out every page;
* ``retire`` and ``agree`` of the page pool of an ``AsyncReqToTokenPool``
  (``reclaim="explicit"``) refuse a foreign thread, changing nothing, as
  ``free``, ``alloc`` and ``reclaim`` do (each would run that pool's grant
  loop off its thread);
* a fenced ``free`` of a tensor ``alloc`` handed out forgets it *and* its
  pages in the count of remembered pages (else the count drifts up and the
  pool forgets live tensors early);
* the peak counts neither pending nor quarantined pages, on either take path
  (``take`` and the inlined ``alloc(1)``);
* a fenced ``free`` keeps its own copy of the ids of a long int64 tensor, a
  0-d one and a tensor or ndarray subclass: the caller may reuse its buffer
  while the pages wait;
* a 0-d int64 numpy array frees its page (``prepare``'s short-array pass is
  for 1-D ones) and an empty 2-D one is refused;
* an empty 1-D float tensor that ``numpy()`` refuses (requiring grad,
  bfloat16) is no pages, in ``slots`` and in ``free`` of a subclass; a
  non-empty one, or an empty 2-D one, is the dtype error;
* ``slots`` of many pages with ids past one byte (``check_ids``' top-byte
  test);
* ``alloc`` answers None when a reclaim freed pages but still too few;
* ``slots``, ``free`` and ``put_back`` name the bad page (page 0 as reserved
  padding, not a good page before it) and say why a free or pending page
  cannot be put back;
* an empty ``free`` behind a fence returns 0 (not None), from
  ``KVPagePool.free`` and ``PageLedger.free``;
* an unfenced ``free`` of detached pages as a list or a numpy array (the
  checked path, not the handed-out tensor's) wakes the serving pool's
  queued admission.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
import torch
from helpers import FakeStream, bounded, in_thread, kv_of, spin

from asyncpool import (
    AsyncReqToTokenPool,
    CapacityError,
    InvalidSlotError,
    KVPagePool,
    WrongThreadError,
)
from asyncpool.kv_pages import MAX_NUM_PAGES, PageLedger, check_num_pages


def test_check_num_pages_accepts_the_bound_and_refuses_one_more() -> None:
    assert MAX_NUM_PAGES == 2**31
    check_num_pages(2**31)  # capacity 2**31 - 1: numbered in int32
    with pytest.raises(CapacityError, match="at most 2"):
        check_num_pages(2**31 + 1)


def test_the_smallest_pool_has_one_page_and_a_peak_of_zero() -> None:
    kv = KVPagePool(2, 4)
    assert kv.capacity == 1 and kv.stats().peak_allocated == 0
    pages = kv.alloc(1)
    assert pages is not None and pages.tolist() == [1] and kv.alloc(1) is None
    assert kv.stats().peak_allocated == 1
    assert kv.free(pages) == 1
    kv.check_invariants()


@pytest.mark.parametrize("num_pages", [1, 0, 2.0, True])
def test_a_page_ledger_checks_its_page_count(num_pages: object) -> None:
    with pytest.raises(CapacityError, match="num_pages must be an int >= 2"):
        PageLedger(num_pages)  # type: ignore[arg-type]


def test_free_all_allocated_returns_the_pages_it_freed() -> None:
    led = PageLedger(8)
    pages = led.take(5)
    assert pages is not None
    assert led.free(pages[:2]) == 2
    assert led.free_all_allocated() == 3
    assert led.free_all_allocated() == 0
    assert led.allocated == 0 and led.free_count == 7
    led.check_invariants()


class _TensorSub(torch.Tensor):
    pass


class _ArraySub(np.ndarray):
    pass


@pytest.mark.parametrize(
    "make",
    [
        lambda page: torch.tensor(page).as_subclass(_TensorSub),
        lambda page: np.array(page).view(_ArraySub),
    ],
    ids=["tensor-subclass", "ndarray-subclass"],
)
def test_a_zero_d_page_id_of_a_subclass_frees_its_page(make: Any) -> None:
    kv = KVPagePool(8, 2)
    pages = kv.alloc(3)
    assert pages is not None
    page = int(pages[1])
    assert kv.free(make(page)) == 1
    assert kv.ledger.state_of(page) == "free"
    kv.check_invariants()


def test_a_fenced_free_of_a_handed_out_tensor_uncounts_its_pages() -> None:
    kv = KVPagePool(64, 4)
    fs = FakeStream()
    kept = kv.alloc(3)
    pages = kv.alloc(5)
    assert kept is not None and pages is not None
    assert kv._handed_pages == 8
    assert kv.free(pages, fence=fs.record()) == 0
    assert kv._handed_pages == 3 and id(kept) in kv._handed
    fs.complete()
    assert kv.reclaim() == 5
    kv.check_invariants()


def _three_quarantined() -> KVPagePool:
    """A pool of 9 pages, 3 of them quarantined behind a faulted fence (the
    peak is 3: they were allocated), none allocated now."""
    kv = KVPagePool(10, 1)  # capacity 9
    fs = FakeStream()
    first = kv.alloc(3)
    assert first is not None
    fence = fs.record()
    fs.fault()
    assert kv.free(first, fence=fence) == 0  # logged as an error, quarantined
    assert kv.quarantined_size() == 3
    return kv


def test_the_peak_does_not_count_quarantined_pages() -> None:
    kv = _three_quarantined()
    assert kv.alloc(2) is not None  # take (2 pages): 2 allocated, 3 quarantined
    assert kv.stats().peak_allocated == 3
    assert kv.alloc(4) is not None
    assert kv.stats().peak_allocated == 6
    kv.check_invariants()


@pytest.mark.parametrize("form", [np.int64, torch.tensor], ids=["np.int64", "0-d tensor"])
def test_alloc_of_a_scalar_count_equal_to_the_capacity(form: Any) -> None:
    kv = KVPagePool(6, 2)  # capacity 5
    pages = kv.alloc(form(5))
    assert pages is not None and pages.tolist() == [1, 2, 3, 4, 5]
    with pytest.raises(CapacityError, match="the pool has only 5"):
        kv.alloc(form(6))
    kv.check_invariants()


@pytest.mark.parametrize("call", ["retire", "agree"])
async def test_retire_and_agree_of_a_served_page_pool_refuse_a_foreign_thread(
    call: str, group: Any
) -> None:
    s = FakeStream()
    async with (
        bounded(),
        AsyncReqToTokenPool(3, 8, kv=KVPagePool(5, 4), reclaim="explicit") as pool,
    ):
        kv = kv_of(pool)
        g = await pool.admit(pages=4)
        pages = pool.detach_pages(g.row)
        pool.free([g.row])
        fence = s.record()
        assert kv.free(pages, fence=fence) == 0
        s.complete()
        act = {"retire": lambda: kv.retire(fence), "agree": lambda: kv.agree(group)}[call]
        with pytest.raises(WrongThreadError, match="this KVPagePool serves"):
            in_thread(act)
        assert kv.pending_size() == 4 and kv.available_size() == 0
        assert act() == 4  # from the pool's own thread
        kv.check_invariants()


def test_the_peak_does_not_count_pending_pages() -> None:
    kv = KVPagePool(10, 1)  # capacity 9
    fs = FakeStream()
    first = kv.alloc(3)
    assert first is not None
    assert kv.free(first, fence=fs.record()) == 0
    assert kv.pending_size() == 3
    assert kv.alloc(1) is not None  # the inlined take(1): 1 allocated, 3 pending
    assert kv.stats().peak_allocated == 3
    assert kv.alloc(2) is not None  # take (2 pages): 3 allocated, 3 pending
    assert kv.stats().peak_allocated == 3
    assert kv.alloc(3) is not None
    assert kv.stats().peak_allocated == 6
    fs.complete()
    kv.check_invariants()


def test_a_zero_d_int64_array_frees_its_page_and_an_empty_2d_one_is_refused() -> None:
    kv = KVPagePool(8, 2)
    pages = kv.alloc(3)
    assert pages is not None
    page = int(pages[1])
    assert kv.free(np.array(page)) == 1
    assert kv.ledger.state_of(page) == "free"
    with pytest.raises(InvalidSlotError, match=r"1-D array, got shape \(0, 2\)"):
        kv.free(np.zeros((0, 2), np.int64))
    kv.check_invariants()


@pytest.mark.parametrize(
    "form",
    [
        lambda ids: torch.tensor(ids),  # 1-D int64, past the short pass: numpy() aliases it
        lambda ids: torch.tensor(ids[0]),  # 0-d int64: numpy() aliases it, reshaped
        lambda ids: torch.tensor(ids).as_subclass(_TensorSub),  # the subclass paths
        lambda ids: np.array(ids).view(_ArraySub),
    ],
    ids=["tensor-of-20", "0-d-tensor", "tensor-subclass", "ndarray-subclass"],
)
def test_a_fenced_free_keeps_its_own_copy_of_the_callers_ids(form: Any) -> None:
    kv = KVPagePool(64, 2)
    fs = FakeStream()
    freed = kv.alloc(20)
    kept = kv.alloc(20)
    assert freed is not None and kept is not None
    ids = freed.tolist()
    pages = form(ids)
    n = pages.size if isinstance(pages, np.ndarray) else pages.numel()
    assert kv.free(pages, fence=fs.record()) == 0
    # The caller reuses its buffer while the pages wait behind the fence.
    pages[...] = kept[0].item()
    fs.complete()
    assert kv.reclaim() == n
    assert all(kv.ledger.state_of(p) == "free" for p in ids[:n])
    assert all(kv.ledger.state_of(p) == "allocated" for p in kept.tolist())
    kv.check_invariants()


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.zeros(0, requires_grad=True),  # numpy() refuses it
        lambda: torch.zeros(0, dtype=torch.bfloat16),  # no numpy dtype
    ],
    ids=["float-requires-grad", "bfloat16"],
)
def test_an_empty_float_tensor_numpy_refuses_is_no_pages(make: Any) -> None:
    kv = KVPagePool(8, 2)
    assert kv.alloc(2) is not None
    assert kv.slots(make()).tolist() == []
    assert kv.free(make().as_subclass(_TensorSub)) == 0
    with pytest.raises(InvalidSlotError, match="page ids must be integers"):
        kv.slots(torch.ones(1, dtype=make().dtype))
    with pytest.raises(InvalidSlotError, match="page ids must be integers"):
        kv.free(torch.zeros(0, 3, dtype=make().dtype, requires_grad=True))
    assert kv.allocated_size() == 2
    kv.check_invariants()


def test_slots_of_many_pages() -> None:
    kv = KVPagePool(1024, 2)
    assert kv.alloc(299) is not None
    pages = kv.alloc(20)  # pages 300..319: ids past one byte
    assert pages is not None
    ids = pages.tolist()
    assert ids == list(range(300, 320))
    assert kv.slots(pages).tolist() == [s for p in ids for s in (2 * p, 2 * p + 1)]
    assert kv.slots(np.array(ids * 3)).shape == (120,)  # repeats are fine here


def test_the_inlined_alloc_one_peak_does_not_count_quarantined_pages() -> None:
    kv = _three_quarantined()
    assert kv.alloc(1) is not None  # 1 allocated, 3 quarantined
    assert kv.stats().peak_allocated == 3
    assert [kv.alloc(1) for _ in range(3)].count(None) == 0
    assert kv.stats().peak_allocated == 4
    kv.check_invariants()


def test_alloc_short_after_a_reclaim_that_freed_too_few_answers_none() -> None:
    kv = KVPagePool(6, 1)  # capacity 5
    fs = FakeStream()
    first = kv.alloc(2)
    assert first is not None and kv.alloc(2) is not None
    assert kv.free(first, fence=fs.record()) == 0
    fs.complete()
    assert kv.alloc(4) is None  # reclaims the 2 pending pages: 3 free, still short
    assert kv.pending_size() == 0 and kv.available_size() == 3
    assert kv.alloc(3) is not None
    kv.check_invariants()


@pytest.mark.parametrize(
    ("pages", "message"),
    [
        ([1, 3, 0], r"page 0 is reserved padding and has no slots"),
        ([1, 3, 8], r"page 8 is out of range 1\.\.7"),
        ([1, 3, -1], r"page -1 is out of range 1\.\.7"),
    ],
)
def test_slots_names_the_bad_page_not_a_good_one_before_it(pages: list[int], message: str) -> None:
    kv = KVPagePool(8, 2)
    with pytest.raises(InvalidSlotError, match=message):
        kv.slots(pages)


def test_free_and_put_back_name_page_0_and_a_page_not_allocated() -> None:
    kv = KVPagePool(8, 2)
    pages = kv.alloc(2)
    assert pages is not None
    with pytest.raises(InvalidSlotError, match="page 0 is reserved padding and cannot be freed"):
        kv.free([*pages.tolist(), 0])
    led = kv.ledger
    free_page = 7  # never handed out: the "never allocated" case comes first
    with pytest.raises(InvalidSlotError, match="page 7 was never allocated"):
        led.put_back([free_page])
    fs = FakeStream()
    assert kv.free(pages[:1], fence=fs.record()) == 0
    assert kv.free(pages[1:]) == 1
    with pytest.raises(
        InvalidSlotError, match=r"is already free \(not allocated\) and cannot be put back"
    ):
        led.put_back(pages[1:])
    with pytest.raises(InvalidSlotError, match=r"already pending behind a fence \(not allocated\)"):
        led.put_back(pages[:1])
    fs.complete()
    kv.check_invariants()


def test_an_empty_free_behind_a_fence_returns_zero() -> None:
    kv = KVPagePool(8, 2)
    fs = FakeStream()
    assert kv.free([], fence=fs.record()) == 0
    assert kv.free(torch.zeros(0, dtype=torch.int64), fence=fs.record()) == 0
    led = PageLedger(8)
    assert led.free([]) == 0
    assert led.free(np.zeros(0, np.int64), [fs.record()]) == 0
    assert kv.pending_size() == 0 and led.pending == 0
    kv.check_invariants()
    led.check_invariants()


@pytest.mark.parametrize("form", [list, np.array], ids=["list", "ndarray"])
async def test_an_unfenced_checked_free_of_detached_pages_wakes_an_admission(form: Any) -> None:
    async with bounded(), AsyncReqToTokenPool(3, 8, kv=KVPagePool(3, 4)) as pool:
        kv = kv_of(pool)
        g = await pool.admit(pages=2)
        pages = pool.detach_pages(g.row)
        pool.free([g.row])
        waiter = asyncio.create_task(pool.admit(pages=2))
        await spin()
        assert pool.waiting() == 1
        assert kv.free(form(pages.tolist())) == 2
        got = await waiter  # granted by that free, nobody else calls the pool
        assert sorted(got.pages.tolist()) == sorted(pages.tolist())
        pool.free([got.row])
        kv.check_invariants()
