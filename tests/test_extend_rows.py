"""``pool.extend_rows(rows, k)``: a decode step's growth in one call.

All or nothing, never waits, one take and one tensor for the batch; the
same rules as ``extend`` for each row (the pages belong to it, are freed with
it behind its fences, and a write into its record is caught).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import numpy as np
import pytest
import torch
from helpers import (
    BAD_COUNTS_FOR_TWO_ROWS,
    assert_pages_conserved,
    grouped_pool,
    kv_of,
    kv_pool_state,
)
from helpers import page_ids as ids

from asyncpool import (
    AsyncReqToTokenPool,
    CapacityError,
    InvalidSlotError,
    KVPagePool,
    PoolClosedError,
)


def make(rows: int = 4, pages: int = 16) -> AsyncReqToTokenPool:
    return AsyncReqToTokenPool(rows + 1, 64, kv=KVPagePool(pages + 1, 4))


state = kv_pool_state


def memory(pool: AsyncReqToTokenPool) -> tuple[Any, ...]:
    """``state`` less the growth-refusal counter, which a None answer bumps
    (tests/test_growth_refusals.py): the memory a short growth leaves alone."""
    stats, *rest = state(pool)
    return (dataclasses.replace(stats, growth_refusals=0), *rest)


def conserved(pool: AsyncReqToTokenPool) -> None:
    assert_pages_conserved(pool)
    kv = kv_of(pool)
    assert kv.available_size() + kv.pending_size() + kv.allocated_size() == kv.capacity


async def test_each_row_gets_its_line_of_pages_in_one_call():
    async with make(rows=3, pages=16) as pool:
        a = await pool.admit(pages=2)
        b = await pool.admit(pages=0)  # a row with no pages yet
        c = await pool.admit(pages=1)
        got = pool.extend_rows([a.row, b.row, c.row], 2)
        assert got is not None and got.shape == (3, 2) and got.dtype == torch.int64
        assert ids(pool.pages_of(a.row)) == ids(a.pages) + ids(got[0])
        assert ids(pool.pages_of(b.row)) == ids(got[1])
        assert ids(pool.pages_of(c.row)) == ids(c.pages) + ids(got[2])
        every = ids(pool.pages_of(a.row)) + ids(pool.pages_of(b.row)) + ids(pool.pages_of(c.row))
        assert len(set(every)) == len(every) == 9
        kv = pool.kv
        assert kv is not None and kv.available_size() == 16 - 9
        with pytest.raises(InvalidSlotError, match="owned by a row"):
            kv.free(got[1].clone())  # the row's now
        pool.free([a.row, b.row, c.row])
        assert kv.available_size() == 16
        conserved(pool)


async def test_short_of_pages_it_answers_none_and_changes_nothing():
    async with make(rows=3, pages=6) as pool:
        rows = [(await pool.admit(pages=1)).row for _ in range(3)]
        before = memory(pool)
        assert pool.extend_rows(rows, 2) is None  # 6 needed, 3 free: none taken
        assert memory(pool) == before and pool.stats().growth_refusals == 1
        got = pool.extend_rows(rows, 1)  # 3 fit
        assert got is not None and got.shape == (3, 1)
        pool.free(rows)
        conserved(pool)


async def test_it_reclaims_completed_page_fences_first_and_serves_waiters(kit):
    stream = kit.stream()
    gate = kit.gate(stream)
    async with make(rows=3, pages=6) as pool:
        a = await pool.admit(pages=4)
        b = await pool.admit(pages=1)
        pool.free([a.row], after=stream)
        assert pool.extend_rows([b.row], 2) is None  # behind the gate
        gate.open()
        await asyncio.wait_for(asyncio.to_thread(stream.synchronize), 10)
        got = pool.extend_rows([b.row], 2)
        assert got is not None and len(pool.pages_of(b.row)) == 3
        pool.free(b.row)
        conserved(pool)


async def test_the_pages_are_freed_with_their_rows_behind_the_rows_fences(kit):
    stream = kit.stream()
    gate = kit.gate(stream)
    async with make(rows=2, pages=4) as pool:
        a = await pool.admit(pages=1)
        got = pool.extend_rows([a.row], 3)
        assert got is not None
        pool.record_use([a.row], stream.record())  # the step still writes them
        pool.free(a.row)
        kv = pool.kv
        assert kv is not None and kv.available_size() == 0 and kv.pending_size() == 4
        gate.open()
        await asyncio.wait_for(asyncio.to_thread(stream.synchronize), 10)
        pool.reclaim()  # (or the pool's own wake-up did, already)
        assert kv.available_size() == 4 and kv.pending_size() == 0
        conserved(pool)


async def test_a_write_into_the_returned_pages_of_a_row_without_pages_is_caught():
    # Such a row's record is its line of the returned tensor, as extend's
    # tensor is a row's record when it had no pages.
    async with make(rows=2, pages=8) as pool:
        a = await pool.admit(pages=0)
        b = await pool.admit(pages=0)
        got = pool.extend_rows([a.row, b.row], 2)
        assert got is not None
        own = ids(got[0])
        got[0, 0] = got[1, 0]
        with pytest.raises(InvalidSlotError, match="written into"):
            pool.free([a.row])
        assert sorted(ids(pool.detach_pages(a.row))) == sorted(own)
        pool.free([a.row, b.row])
        kv = pool.kv
        assert kv is not None
        kv.free(torch.tensor(own))
        conserved(pool)


async def test_rows_in_every_form_free_takes_and_no_rows_is_an_empty_batch():
    async with make(rows=3, pages=16) as pool:
        rows = [(await pool.admit(pages=1)).row for _ in range(2)]
        for form in (torch.tensor(rows), np.array(rows), [np.int64(r) for r in rows], tuple(rows)):
            got = pool.extend_rows(form, 1)
            assert got is not None and got.shape == (2, 1)
        one = pool.extend_rows(rows[0], 1)  # one row, as free takes it
        assert one is not None and one.shape == (1, 1)
        empty = pool.extend_rows([], 3)
        assert empty is not None and empty.shape == (0, 3)
        assert [len(pool.pages_of(r)) for r in rows] == [1 + 4 + 1, 1 + 4]
        pool.free(rows)
        conserved(pool)


# extend_fitting (tests/test_extend_fitting.py) takes rows and counts as
# extend_rows does: the refusals below are both's, but for a total past the
# KV pool's capacity, which only extend_rows refuses (the run stops there).
GROWS = ("extend_rows", "extend_fitting")
BAD_INPUT = [
    ("both", 0, CapacityError),
    ("both", -1, CapacityError),
    ("both", 1.0, CapacityError),
    ("both", True, CapacityError),
    ("both", 17, CapacityError),
    ("duplicate", 1, InvalidSlotError),
    ("row 0", 1, InvalidSlotError),
    ("out of range", 1, InvalidSlotError),
    ("a free row", 1, InvalidSlotError),
    ("a freed row", 1, InvalidSlotError),  # DoubleFreeError is for frees
    ("a float", 1, InvalidSlotError),
]


@pytest.mark.parametrize(
    ("grow", "rows", "k", "error"),
    [(grow, *case) for grow in GROWS for case in BAD_INPUT]
    + [("extend_rows", "both", 9, CapacityError)],  # 18 pages of 16: never fits
)
async def test_bad_input_raises_typed_and_changes_nothing(grow, rows, k, error):
    # The bad row is the last: checked though extend_fitting's run would
    # stop before it.
    async with make(rows=4, pages=16) as pool:
        a = await pool.admit(pages=1)
        b = await pool.admit(pages=1)
        gone = await pool.admit(pages=0)
        pool.free(gone.row)
        arg = {
            "both": [a.row, b.row],
            "duplicate": [a.row, a.row],
            "row 0": [a.row, 0],
            "out of range": [a.row, 99],
            "a free row": [a.row, 4],
            "a freed row": [a.row, gone.row],
            "a float": [a.row, 2.0],
        }[rows]
        before = state(pool)
        with pytest.raises(error):
            getattr(pool, grow)(arg, k)
        assert state(pool) == before
        pool.free([a.row, b.row])
        conserved(pool)


@pytest.mark.parametrize("k", [1, [1]], ids=["one count", "a count per row"])
@pytest.mark.parametrize("grow", GROWS)
async def test_after_close_it_raises_and_a_pool_without_kv_refuses(grow, k):
    pool = make(rows=2, pages=4)
    g = await pool.admit(pages=1)
    await pool.close()
    before = state(pool)
    with pytest.raises(PoolClosedError):
        getattr(pool, grow)([g.row], k)
    assert state(pool) == before
    pool.free(g.row)
    conserved(pool)
    async with AsyncReqToTokenPool(3, 8) as rows_only:
        row = await rows_only.alloc(1)
        with pytest.raises(CapacityError, match="no KV pages"):
            getattr(rows_only, grow)(row, k)
        rows_only.free(row)


async def test_many_steps_of_batched_growth_keep_every_record_whole():
    async with make(rows=4, pages=4 * 101) as pool:
        grants = [await pool.admit(pages=1) for _ in range(4)]
        rows = [g.row for g in grants]
        expected = {g.row: ids(g.pages) for g in grants}
        for step in range(100):
            batch = rows[step % 2 :] if step % 3 else rows  # rows come and go
            got = pool.extend_rows(batch, 1)
            assert got is not None
            for row, line in zip(batch, got.tolist(), strict=True):
                expected[row] += line
        for row in rows:
            assert ids(pool.pages_of(row)) == expected[row]
        pool.check_invariants()
        pool.free(rows)
        conserved(pool)


async def test_slot_math_in_place_on_extends_tensor_is_refused_naming_extend():
    # A row admitted with no pages (a full prefix hit) grows by extend or
    # extend_rows, and the engine turns the returned page ids into first
    # slots in place: that tensor was the row's record, so free refuses the
    # row. The error must name the call whose tensor was written into, not
    # only grant.pages and pages_of(), which the engine never touched.
    async with make(rows=2, pages=8) as pool:
        a = await pool.admit(pages=0)
        b = await pool.admit(pages=0)
        one = pool.extend(a.row, 2)
        rows = pool.extend_rows([b.row], 1)
        assert one is not None and rows is not None
        own_a, own_b = ids(one), ids(rows[0])
        one.mul_(4)
        rows.mul_(4)
        for row in (a.row, b.row):
            with pytest.raises(InvalidSlotError, match=r"extend\(\) and extend_rows\(\)"):
                pool.free([row])
        one.div_(4, rounding_mode="floor")  # restored: the rows free again
        rows.div_(4, rounding_mode="floor")
        assert ids(pool.pages_of(a.row)) == own_a and ids(pool.pages_of(b.row)) == own_b
        pool.free([a.row, b.row])
        conserved(pool)


# ---------------------------------------------------------------- one count per row


async def test_one_count_per_row_grows_each_by_its_own_in_row_order():
    """A speculative step (or a chunked prefill) needs different counts per
    row: one call, all or nothing, a flat tensor in row order."""
    async with make(rows=3, pages=16) as pool:
        a, b, c = [await pool.admit(pages=1) for _ in range(3)]
        got = pool.extend_rows([a.row, b.row, c.row], [2, 0, 3])
        assert got is not None and got.shape == (5,) and got.dtype == torch.int64
        assert ids(pool.pages_of(a.row)) == ids(a.pages) + ids(got[0:2])
        assert ids(pool.pages_of(b.row)) == ids(b.pages)
        assert ids(pool.pages_of(c.row)) == ids(c.pages) + ids(got[2:5])
        every = [p for g in (a, b, c) for p in ids(pool.pages_of(g.row))]
        assert len(set(every)) == len(every) == 8
        pool.free([a.row, b.row, c.row])
        conserved(pool)


async def test_one_count_per_row_is_all_or_nothing():
    async with make(rows=2, pages=8) as pool:
        a, b = await pool.admit(pages=2), await pool.admit(pages=2)
        before = memory(pool)
        assert pool.extend_rows([a.row, b.row], [3, 2]) is None  # 5 of 4 free
        assert memory(pool) == before and pool.stats().growth_refusals == 1
        zero = pool.extend_rows([a.row, b.row], (0, 0))
        assert zero is not None and zero.shape == (0,)
        assert memory(pool) == before and pool.stats().growth_refusals == 1


async def test_counts_as_arrays_and_tensors():
    async with make(rows=2, pages=8) as pool:
        a, b = await pool.admit(pages=0), await pool.admit(pages=0)
        got = pool.extend_rows(torch.tensor([a.row, b.row]), np.array([1, 2], dtype=np.int32))
        assert got is not None and got.shape == (3,)
        got = pool.extend_rows([a.row, b.row], torch.tensor([2, 1]))
        assert got is not None and got.shape == (3,)
        assert [len(ids(pool.pages_of(r))) for r in (a.row, b.row)] == [3, 3]
        pool.free([a.row, b.row])
        conserved(pool)


@pytest.mark.parametrize(
    ("grow", "k"),
    [(grow, k) for grow in GROWS for k in BAD_COUNTS_FOR_TWO_ROWS]
    + [("extend_rows", [9, 8])],  # 17 pages of 16: extend_fitting stops short
)
async def test_bad_counts_per_row_raise_typed_and_change_nothing(grow, k):
    async with make(rows=2, pages=16) as pool:
        a, b = await pool.admit(pages=1), await pool.admit(pages=1)
        before = state(pool)
        with pytest.raises(CapacityError):
            getattr(pool, grow)([a.row, b.row], k)
        assert state(pool) == before


async def test_a_refusal_names_one_row_or_one_page_in_the_singular() -> None:
    # "cannot extend 1 rows" read as a slip: a count of one is named in the
    # singular, on the one-kv and the grouped paths, and nothing changes.
    pool = make(rows=5, pages=4)
    row = (await pool.admit(pages=1)).row
    five = [row, *await pool.alloc(4)]
    before = state(pool)
    with pytest.raises(CapacityError, match=r"cannot extend 1 row by 9 pages in all"):
        pool.extend_rows([row], [9])
    with pytest.raises(CapacityError, match=r"cannot extend 5 rows by 1 page each: 5 pages"):
        pool.extend_rows(five, 1)
    assert state(pool) == before
    grouped = grouped_pool(rows=5, swa=4, full=4)
    grow = (await grouped.admit(pages={"swa": 1, "full": 1})).row
    rows = [grow, *await grouped.alloc(4)]
    with pytest.raises(CapacityError, match=r"cannot extend 1 row by 9 pages in all"):
        grouped.extend_rows([grow], {"swa": [9], "full": [0]})
    with pytest.raises(CapacityError, match=r"cannot extend 5 rows by 1 page each in KV group"):
        grouped.extend_rows(rows, {"swa": 1, "full": 0})
    await pool.close()
    await grouped.close()
