"""Gaps found by mutation testing of kv_pages.py and row_pages.py.

* Every call of a served page pool that makes pages free (``reclaim``,
  ``retire``, ``agree``, a fenced ``free`` whose fence already completed)
  runs the owning pool's grant loop inside the call: a queued admission is
  granted before the call returns, with no wake-up from anywhere else.
* The ledger's no-fence fast frees (:meth:`PageLedger.free_owned`,
  :meth:`PageLedger._free_now_small`) change nothing when a page is not in
  the state the owner expects, for a row's OWNED pages as for ALLOCATED ones.
* ``extend`` reclaims a completed page fence itself (the older test let the
  watcher get there first); rows freed together with different recorded
  uses keep their own fences.
* Two bugs, each failing before its fix: ``slots()`` of more ids than the
  capacity (pages repeated across a batch) raised a bare AssertionError, and
  ``alloc`` of a count with several elements raised numpy's or torch's
  ambiguous-truth error instead of CapacityError.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
import torch
from helpers import FakeStream, caller_pages_behind, granted_in_call, kv_of, spin
from helpers import page_ids as ids

from asyncpool import AsyncReqToTokenPool, CapacityError, InvalidSlotError, KVPagePool
from asyncpool.kv_pages import OWNED
from asyncpool.ledger import ALLOCATED

# ------------------------------------------------ a served page pool's frees wake its waiters


async def test_page_pool_reclaim_grants_a_queued_admission_inside_the_call() -> None:
    s = FakeStream()
    async with AsyncReqToTokenPool(3, 8, kv=KVPagePool(5, 4)) as pool:
        pages, waiter = await caller_pages_behind(pool, s.record())
        s.complete()  # the watcher may notice, but cannot run before the call below
        assert kv_of(pool).reclaim() == 4
        await granted_in_call(pool, waiter, pages)


async def test_page_pool_retire_grants_a_queued_admission_inside_the_call() -> None:
    s = FakeStream()
    pool = AsyncReqToTokenPool(3, 8, kv=KVPagePool(5, 4), reclaim="explicit")
    f = s.record()
    pages, waiter = await caller_pages_behind(pool, f)
    assert kv_of(pool).retire(f) == 4
    await granted_in_call(pool, waiter, pages)


async def test_page_pool_agree_grants_a_queued_admission_inside_the_call(group: Any) -> None:
    s = FakeStream()
    pool = AsyncReqToTokenPool(3, 8, kv=KVPagePool(5, 4), reclaim="explicit")
    pages, waiter = await caller_pages_behind(pool, s.record())
    s.complete()
    assert kv_of(pool).agree(group) == 4
    await granted_in_call(pool, waiter, pages)


async def test_a_fenced_page_free_that_is_free_at_once_grants_a_queued_admission() -> None:
    s = FakeStream()
    async with AsyncReqToTokenPool(3, 8, kv=KVPagePool(5, 4)) as pool:
        kv = kv_of(pool)
        g = await pool.admit(pages=4)
        pages = pool.detach_pages(g.row)
        pool.free([g.row])
        waiter = asyncio.ensure_future(pool.admit(pages=4))
        await spin()
        assert pool.waiting() == 1
        done = s.record()
        s.complete()
        assert kv.free(pages, fence=done) == 4  # the fence completed: free at once
        await granted_in_call(pool, waiter, pages)


async def test_extend_reclaims_a_completed_page_fence_itself() -> None:
    # The fence completes with no loop step before extend: neither the watcher
    # nor any callback can have reclaimed its pages; extend must.
    s = FakeStream()
    async with AsyncReqToTokenPool(3, 8, kv=KVPagePool(5, 4)) as pool:
        kv = kv_of(pool)
        a = await pool.admit(pages=3)
        b = await pool.admit(pages=1)
        pool.free([a.row], fence=s.record())
        assert kv.pending_size() == 3
        assert pool.extend(b.row, 3) is None  # behind the fence
        s.complete()
        more = pool.extend(b.row, 3)
        assert more is not None and sorted(ids(more)) == sorted(ids(a.pages))
        assert len(pool.pages_of(b.row)) == 4 and kv.pending_size() == 0
        pool.free([b.row])
        pool.check_invariants()
        kv.check_invariants()


# ------------------------------------------------ each row's pages wait for that row's own use


@pytest.mark.parametrize("order", ["unfenced first", "fenced first"])
async def test_rows_freed_together_with_different_uses_keep_their_own_fences(order: str) -> None:
    s = FakeStream()
    async with AsyncReqToTokenPool(4, 8, kv=KVPagePool(7, 4)) as pool:
        kv = kv_of(pool)
        a = await pool.admit(pages=2)  # no recorded use: free at once
        b = await pool.admit(pages=2)  # its step still writes its pages
        c = await pool.admit(pages=2)  # no recorded use either
        a_pages, b_pages, c_pages = ids(a.pages), ids(b.pages), ids(c.pages)
        f = s.record()
        pool.record_use([b.row], f)
        rows = [a.row, b.row, c.row] if order == "unfenced first" else [b.row, a.row, c.row]
        pool.free(rows)
        led = kv.ledger
        assert {led.state_of(p) for p in b_pages} == {"pending"}
        assert {led.state_of(p) for p in a_pages + c_pages} == {"free"}
        assert kv.pending_size() == 2 and kv.available_size() == 4
        taken = kv.alloc(4)  # everything free now: never one of b's pages
        assert taken is not None and sorted(ids(taken)) == sorted(a_pages + c_pages)
        assert kv.alloc(1) is None  # b's pages are behind f (alloc reclaims first)
        kv.free(taken)
        s.complete()
        assert kv.reclaim() == 2
        pool.check_invariants()
        kv.check_invariants()


# ------------------------------------------------ the ledger's fast frees change nothing on refusal


def _owned_and_stray(n: int) -> tuple[KVPagePool, np.ndarray, int]:
    """``n`` pages taken OWNED (as a row's) and one more page that is not."""
    kv = KVPagePool(32, 1)
    led = kv.ledger
    owned = led.take(n, OWNED)
    assert owned is not None
    stray = led.take(1)  # ALLOCATED: not a row's
    assert stray is not None
    return kv, owned, int(stray[0])


@pytest.mark.parametrize("n", [3, 12])
def test_free_owned_refuses_a_page_not_in_the_expected_state_and_changes_nothing(n: int) -> None:
    kv, owned, stray = _owned_and_stray(n)
    led = kv.ledger
    before = (led.states().tobytes(), led.free_count, led._ring.tobytes(), led._head)
    record = np.append(owned, stray)
    assert led.free_owned(record, OWNED) is False
    assert led.free_owned(owned, ALLOCATED) is False
    assert (led.states().tobytes(), led.free_count, led._ring.tobytes(), led._head) == before
    assert led.free_owned(owned, OWNED) is True
    assert {led.state_of(int(p)) for p in owned} == {"free"}
    kv.check_invariants()


def test_free_now_small_puts_back_owned_marks_on_a_late_bad_id() -> None:
    kv, owned, stray = _owned_and_stray(3)
    led = kv.ledger
    before = (led.states().tobytes(), led.free_count, led._ring.tobytes(), led._head)
    assert led._free_now_small([*owned.tolist(), stray], OWNED) is False
    assert {led.state_of(int(p)) for p in owned} == {"owned by a row"}
    assert (led.states().tobytes(), led.free_count, led._ring.tobytes(), led._head) == before
    assert led._free_now_small(owned.tolist(), OWNED) is True
    kv.check_invariants()


@pytest.mark.parametrize("form", ["list", "tensor"])
def test_prepare_of_a_few_pages_checks_the_expected_state(form: str) -> None:
    kv, owned, stray = _owned_and_stray(2)
    led = kv.ledger

    def as_form(pages: list[int]) -> Any:
        return pages if form == "list" else torch.tensor(pages, dtype=torch.int64)

    before = (led.states().tobytes(), led.free_count, led._ring.tobytes(), led._head)
    with pytest.raises(InvalidSlotError, match="not owned by a row"):
        led.prepare(as_form([stray]), "freed", OWNED)
    with pytest.raises(InvalidSlotError, match="owned by a row"):
        led.prepare(as_form(owned.tolist()), "freed", ALLOCATED)
    with pytest.raises(InvalidSlotError, match="owned by a row"):
        led.put_back(as_form(owned.tolist()))  # ALLOCATED expected by default
    assert (led.states().tobytes(), led.free_count, led._ring.tobytes(), led._head) == before
    ids_, _ = led.prepare(as_form(owned.tolist()), "freed", OWNED)
    assert sorted(int(p) for p in ids_) == sorted(owned.tolist())
    led.put_back(as_form(owned.tolist()), OWNED)
    kv.check_invariants()


# ------------------------------------------------ two bugs (each failed before its fix)


def test_slots_of_more_page_ids_than_the_capacity_with_repeats() -> None:
    kv = KVPagePool(3, 2)  # capacity 2
    assert kv.slots([1, 2]).tolist() == [2, 3, 4, 5]
    # Any page id in 1..num_pages - 1 is accepted whatever its state, repeats included
    # (pages shared by the rows of a batch, prefix caching); three ids > capacity.
    assert kv.slots([1, 1, 2]).tolist() == [2, 3, 2, 3, 4, 5]


@pytest.mark.parametrize("bad", [np.array([1, 2]), torch.tensor([1, 1])], ids=["numpy", "torch"])
def test_alloc_refuses_a_count_of_several_elements_with_capacity_error(bad: Any) -> None:
    kv = KVPagePool(9, 2)
    with pytest.raises(CapacityError):
        kv.alloc(bad)
    assert kv.available_size() == 8
    kv.check_invariants()
