"""``pool.extend_fitting(rows, k)``: grow rows in order, as many as fit.

For a scheduler that orders its running requests and retracts from the
back: ``rows[:m]`` grow, the rest get nothing, one take for the run. The
rules of ``extend_rows`` otherwise (validation of every row, reclaiming
completed fences first, the pages belong to their row); its bad-input,
close and no-``kv`` refusals are tested with ``extend_rows``'s, in
tests/test_extend_rows.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import numpy as np
import pytest
import torch
from helpers import FakeStream, assert_pages_conserved, bounded, kv_of, kv_pool_state, spin
from helpers import page_ids as ids

from asyncpool import (
    AsyncReqToTokenPool,
    CapacityError,
    KVPagePool,
)


def make(rows: int = 4, pages: int = 16) -> AsyncReqToTokenPool:
    return AsyncReqToTokenPool(rows + 1, 64, kv=KVPagePool(pages + 1, 4))


state = kv_pool_state


def memory(pool: AsyncReqToTokenPool) -> tuple[Any, ...]:
    """``state`` less the growth-refusal counter, which a short run bumps."""
    stats, *rest = state(pool)
    return (dataclasses.replace(stats, growth_refusals=0), *rest)


async def test_the_rows_grow_in_order_until_the_pages_run_out():
    async with make(rows=4, pages=7) as pool:
        grants = [await pool.admit(pages=1) for _ in range(4)]  # 3 pages free
        rows = [g.row for g in reversed(grants)]  # an order of the caller's
        m, got = pool.extend_fitting(rows, 1)
        assert m == 3 and got.shape == (3, 1) and got.dtype == torch.int64
        for i, row in enumerate(rows[:3]):
            assert ids(pool.pages_of(row)) == ids(grants[3 - i].pages) + ids(got[i])
        assert ids(pool.pages_of(rows[3])) == ids(grants[0].pages)  # nothing
        kv = kv_of(pool)
        assert kv.available_size() == 0
        assert pool.stats().growth_refusals == 1  # a retraction to make
        pool.free(rows)
        assert_pages_conserved(pool)


async def test_the_run_stops_at_the_first_row_that_does_not_fit():
    # Rows after it that would fit stay as they are: the order is the rule.
    async with make(rows=3, pages=8) as pool:
        a, b, c = [await pool.admit(pages=1) for _ in range(3)]  # 5 free
        m, got = pool.extend_fitting([a.row, b.row, c.row], [2, 4, 1])
        assert m == 1 and ids(got) == ids(pool.pages_of(a.row))[1:]
        assert len(pool.pages_of(b.row)) == len(pool.pages_of(c.row)) == 1
        assert kv_of(pool).available_size() == 3
        pool.free([a.row, b.row, c.row])
        assert_pages_conserved(pool)


async def test_a_row_that_needs_no_pages_right_after_the_run_is_in_it():
    async with make(rows=3, pages=5) as pool:
        a, b, c = [await pool.admit(pages=1) for _ in range(3)]  # 2 free
        m, got = pool.extend_fitting([a.row, b.row, c.row], [2, 0, 4])
        assert m == 2 and got.shape == (2,)  # b "grew" by none; c did not fit
        assert ids(pool.pages_of(a.row))[1:] == ids(got)
        assert len(pool.pages_of(c.row)) == 1
        pool.free([a.row, b.row, c.row])
        assert_pages_conserved(pool)


async def test_when_every_row_fits_it_grows_them_all_as_extend_rows_does():
    async with make(rows=3, pages=16) as pool:
        rows = [(await pool.admit(pages=1)).row for _ in range(3)]
        m, got = pool.extend_fitting(rows, 2)
        assert m == 3 and got.shape == (3, 2)
        assert [ids(pool.pages_of(r))[1:] for r in rows] == [ids(line) for line in got]
        m, got = pool.extend_fitting(rows, np.array([0, 3, 1]))
        assert m == 3 and got.shape == (4,)
        assert ids(pool.pages_of(rows[1]))[3:] == ids(got[:3])
        assert ids(pool.pages_of(rows[2]))[3:] == ids(got[3:])
        m, got = pool.extend_fitting(rows, [2, 0, 1])  # as many pages as rows
        assert m == 3 and got.shape == (3,)
        assert ids(pool.pages_of(rows[0]))[3:] == ids(got[:2])
        assert len(pool.pages_of(rows[1])) == 6
        assert ids(pool.pages_of(rows[2]))[4:] == ids(got[2:])
        assert pool.stats().growth_refusals == 0
        pool.free(rows)
        assert_pages_conserved(pool)


async def test_nothing_fits_answers_zero_rows_and_changes_no_memory():
    async with make(rows=2, pages=2) as pool:
        a, b = await pool.admit(pages=1), await pool.admit(pages=1)
        before = memory(pool)
        m, got = pool.extend_fitting([a.row, b.row], 1)
        assert m == 0 and got.shape == (0, 1)
        m, got = pool.extend_fitting([a.row, b.row], [1, 0])
        assert m == 0 and got.shape == (0,)
        assert memory(pool) == before and pool.stats().growth_refusals == 2


async def test_a_total_past_the_kv_capacity_is_no_error_here():
    async with make(rows=3, pages=4) as pool:
        rows = [(await pool.admit(pages=0)).row for _ in range(3)]
        with pytest.raises(CapacityError):
            pool.extend_rows(rows, 2)  # 6 > 4: extend_rows refuses it
        m, got = pool.extend_fitting(rows, 2)
        assert m == 2 and got.shape == (2, 2)
        pool.free(rows)
        assert_pages_conserved(pool)


@pytest.mark.parametrize(
    "counts", [[5, 0, 0], [0, 0, 5], [1, 9, 1], np.array([0, 5, 0]), torch.tensor([0, 0, 5])]
)
async def test_one_rows_count_past_the_kv_capacity_is_refused_changing_nothing(counts):
    """A row whose own count is past the pool can never grow, however many
    rows are retracted for it: a CapacityError naming it, as an int ``k``
    past the capacity is, not a refusal counted as a retraction to make
    (found by the scheduler-port trial: ``extend_fitting(rows, [100, 0])``
    on an 8-page pool answered ``(0, ...)`` and counted a growth refusal)."""
    async with make(rows=3, pages=4) as pool:
        rows = [(await pool.admit(pages=0)).row for _ in range(3)]
        before = state(pool)
        i = next(i for i, c in enumerate(counts) if c > 4)
        with pytest.raises(CapacityError, match=rf"k\[{i}\] asks \d+ pages for row {rows[i]},"):
            pool.extend_fitting(rows, counts)
        assert state(pool) == before  # growth_refusals included
        assert pool.extend_fitting(rows, [4, 0, 0])[0] == 3  # at the capacity: taken
        pool.free(rows)
        assert_pages_conserved(pool)


async def test_one_groups_count_past_its_capacity_is_refused_per_row_too():
    kv = {"full": KVPagePool(9, 4), "swa": KVPagePool(3, 4)}
    async with AsyncReqToTokenPool(4, 64, kv=kv) as pool:
        rows = [(await pool.admit({"full": 0, "swa": 0})).row for _ in range(2)]

        def snap() -> tuple[Any, ...]:
            owned = [ids(pool.pages_of(r, group=g)) for r in rows for g in kv]
            return (pool.stats(summaries=False), owned)

        before = snap()
        with pytest.raises(CapacityError, match=r"k\[1\] asks 3 pages .* only 2"):
            pool.extend_fitting(rows, [0, 3], group="swa")
        assert snap() == before
        assert pool.extend_fitting(rows, [0, 3], group="full")[0] == 2
        pool.free(rows)


@pytest.mark.parametrize("form", ["one count", "a count per row"])
async def test_it_reclaims_completed_fences_first_and_serves_waiters_in_the_call(form):
    s = FakeStream()
    async with make(rows=3, pages=6) as pool:
        a = await pool.admit(pages=4)
        b = await pool.admit(pages=1)  # 1 page free
        pool.free([a.row], fence=s.record())
        waiter = asyncio.ensure_future(pool.admit(pages=3))
        await spin()
        assert pool.waiting() == 1
        k: Any = 2 if form == "one count" else [2]
        assert pool.extend_fitting([b.row], k)[0] == 0  # behind the fence
        s.complete()  # no loop step before the call below: it reclaims itself
        m, got = pool.extend_fitting([b.row], k)
        assert m == 1 and ids(got) == ids(pool.pages_of(b.row))[1:]
        assert pool.waiting() == 0  # what was left went to the admission, in the call
        async with bounded():
            g = await waiter
        assert len(g.pages) == 3
        pool.free([b.row, g.row])
        assert_pages_conserved(pool)


async def test_while_released_no_row_grows():
    async with make(rows=2, pages=4) as pool:
        g = await pool.admit(pages=0)
        # release_memory refuses while a row is allocated: poke the flag to
        # reach the branch (the pool's invariants do not hold meanwhile).
        pool._released = True
        try:
            m, got = pool.extend_fitting([g.row], 1)
        finally:
            pool._released = False
        assert m == 0 and got.shape == (0, 1)
        assert kv_of(pool).available_size() == 4 and len(pool.pages_of(g.row)) == 0
        pool.free(g.row)


async def test_no_rows_is_an_empty_run():
    async with make(rows=2, pages=4) as pool:
        before = memory(pool)
        m, got = pool.extend_fitting([], 3)
        assert m == 0 and got.shape == (0, 3) and memory(pool) == before
        assert pool.stats().growth_refusals == 0


async def test_on_an_explicit_pool_it_reclaims_only_what_was_retired():
    # Tensor parallel: every rank must grow the same rows, whatever fences
    # happen to have completed on it.
    s = FakeStream()
    pool = AsyncReqToTokenPool(4, 64, kv=KVPagePool(5, 4, reclaim="explicit"), reclaim="explicit")
    async with pool:
        a = await pool.admit(pages=3)
        b = await pool.admit(pages=1)
        f = s.record()
        pool.free([a.row], fence=f)
        s.complete()  # done on this rank, perhaps not on another
        m, got = pool.extend_fitting([b.row], 1)
        assert m == 0 and got.shape == (0, 1)
        pool.retire(f)
        m, got = pool.extend_fitting([b.row], 3)
        assert m == 1 and got.shape == (1, 3)
        pool.free([b.row])
        assert_pages_conserved(pool)
