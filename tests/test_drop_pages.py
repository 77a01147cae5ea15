"""``drop_pages``: a sliding window's early pages given back while the row runs.

Positions count from a row's first page; the dropped ones stay positions
(``pages_of`` reads them as page 0, ``pages_dropped`` counts them, ``extend``
appends after the last, ``trim_pages`` counts them), and the pages given back
wait behind the row's recorded uses plus ``fence=``/``after=`` as a trim's
do. Bad input: a typed error and the pool exactly as it was.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
import torch
from helpers import Streams, bounded, page_ids, pool_snapshot, spin

from asyncpool import (
    AsyncReqToTokenPool,
    CapacityError,
    InvalidSlotError,
    KVPagePool,
    wait_fence,
)


def single(pages: int = 12, rows: int = 4) -> tuple[AsyncReqToTokenPool, KVPagePool]:
    kv = KVPagePool(pages + 1, 4)
    return AsyncReqToTokenPool(rows + 1, 64, kv=kv), kv


def grouped(swa: int = 8, full: int = 12) -> AsyncReqToTokenPool:
    return AsyncReqToTokenPool(
        5, 64, kv={"swa": KVPagePool(swa + 1, 4), "full": KVPagePool(full + 1, 4)}
    )


def snap(pool: AsyncReqToTokenPool) -> tuple[Any, ...]:
    """Stats, ledger, and every row's positions and dropped count in every group."""
    rows = pool._ledger.allocated_rows()
    names: list[Any] = list(pool.kv_groups or {}) or [None]
    per = tuple(
        (r, g, page_ids(pool.pages_of(r, group=g)), pool.pages_dropped(r, group=g))
        for r in rows
        for g in names
    )
    return pool_snapshot(pool), per


# ---------------------------------------------------------------- positions


async def test_dropped_positions_read_as_page_zero_and_their_pages_come_back() -> None:
    pool, kv = single()
    g = await pool.admit(pages=4)
    first = page_ids(g.pages)
    new = pool.extend(g.row, 2)
    assert new is not None
    whole = first + page_ids(new)
    assert pool.drop_pages(g.row, 3) == 3  # no recorded use: free at once
    assert page_ids(pool.pages_of(g.row)) == [0, 0, 0, *whole[3:]]
    assert page_ids(pool.pages_of(g.row, host=True)) == [0, 0, 0, *whole[3:]]
    assert pool.pages_dropped(g.row) == 3
    assert page_ids(g.pages) == first  # the grant's tensor is never written
    stats = pool.stats()
    assert (stats.pages_allocated, stats.pages_free) == (3, 9)
    pool.check_invariants()
    kv.check_invariants()
    # Already dropped: nothing to do, whatever the fence.
    assert pool.drop_pages(g.row, 2) == 0
    assert pool.drop_pages(g.row, 0) == 0
    assert pool.drop_pages([g.row], [3]) == 0
    assert pool.pages_dropped(g.row) == 3
    # Extend continues after the last position and returns only the new pages.
    more = pool.extend(g.row, 1)
    assert more is not None and len(more) == 1
    assert page_ids(pool.pages_of(g.row)) == [0, 0, 0, *whole[3:], *page_ids(more)]
    pool.free(g.row)
    pool.check_invariants()
    assert pool.stats().pages_free == 12


async def test_dropping_every_position_leaves_holes_only_then_growth_continues() -> None:
    pool, _ = single()
    g = await pool.admit(pages=3)
    assert pool.drop_pages(g.row, 3) == 3
    assert page_ids(pool.pages_of(g.row)) == [0, 0, 0]
    assert pool.stats().pages_allocated == 0
    pool.check_invariants()
    new = pool.extend_rows([g.row], [2])
    assert new is not None
    assert page_ids(pool.pages_of(g.row)) == [0, 0, 0, *page_ids(new)]
    m, more = pool.extend_fitting([g.row], 1)
    assert m == 1
    assert page_ids(pool.pages_of(g.row))[-1] == page_ids(more)[0]
    assert pool.drop_pages(g.row, 5) == 2
    assert page_ids(pool.pages_of(g.row)) == [0] * 5 + page_ids(more)
    pool.check_invariants()


async def test_earlier_tensors_keep_what_they_read() -> None:
    pool, _ = single()
    g = await pool.admit(pages=0)
    new = pool.extend(g.row, 4)  # a row that owned no pages: its record
    assert new is not None
    seen = pool.pages_of(g.row, host=True)
    before = page_ids(new)
    pool.drop_pages(g.row, 2)
    assert page_ids(new) == before and page_ids(seen) == before
    out = pool.pages_of(g.row, host=True)  # a fresh tensor, not the record
    out[3] = 0
    pool.free(g.row)  # the record was not written into
    pool.check_invariants()


@pytest.mark.parametrize("below", [[2, 1], np.array([2, 1]), torch.tensor([2, 1]), (2, 1)], ids=str)
async def test_one_below_per_row(below: Any) -> None:
    pool, _ = single()
    a = await pool.admit(pages=3)
    b = await pool.admit(pages=3)
    assert pool.drop_pages([a.row, b.row], below) == 3
    assert pool.pages_dropped(a.row) == 2 and pool.pages_dropped(b.row) == 1
    assert page_ids(pool.pages_of(b.row)) == [0, *page_ids(b.pages)[1:]]
    pool.check_invariants()


# ---------------------------------------------------------------- trim, detach, free


async def test_trim_counts_positions_with_the_holes() -> None:
    pool, _ = single()
    g = await pool.admit(pages=6)
    ids = page_ids(g.pages)
    pool.drop_pages(g.row, 2)
    assert pool.trim_pages(g.row, 6) == 0  # 6 positions: nothing past them
    assert pool.trim_pages(g.row, 4) == 2  # positions 4 and 5
    assert page_ids(pool.pages_of(g.row)) == [0, 0, *ids[2:4]]
    assert pool.trim_pages(g.row, 1) == 2  # keep <= dropped: every live page
    assert page_ids(pool.pages_of(g.row)) == [0]
    assert pool.pages_dropped(g.row) == 1
    assert pool.stats().pages_allocated == 0
    pool.check_invariants()
    assert pool.trim_pages(g.row, 1) == 0
    assert pool.trim_pages([g.row], [0]) == 0  # holes only: positions cut
    assert pool.pages_dropped(g.row) == 0
    assert page_ids(pool.pages_of(g.row)) == []
    pool.check_invariants()


async def test_detach_hands_over_the_live_pages_only() -> None:
    pool, kv = single()
    g = await pool.admit(pages=5)
    ids = page_ids(g.pages)
    pool.drop_pages(g.row, 2)
    assert pool.pages_dropped(g.row) == 2  # read before detaching: the offset
    pages = pool.detach_pages(g.row, host=True)
    assert page_ids(pages) == ids[2:]
    assert pool.pages_dropped(g.row) == 0 and page_ids(pool.pages_of(g.row)) == []
    pool.check_invariants()
    kv.free(pages)
    pool.free(g.row)
    pool.check_invariants()
    assert pool.stats().pages_free == 12


@pytest.mark.parametrize("how", ["fast", "fence", "rows", "after"])
async def test_free_gives_back_the_live_pages_and_forgets_the_holes(kit: Streams, how: str) -> None:
    pool, kv = single(rows=1)
    g = await pool.admit(pages=4)
    pool.drop_pages(g.row, 1)
    stream = kit.stream()
    if how == "fast":
        pool.free(g.row)
    elif how == "fence":
        pool.free([g.row], fence=stream.record())
    elif how == "rows":
        pool.free([g.row])
    else:
        pool.free([g.row], after=stream)
    stream.synchronize()
    pool.check_invariants()
    kv.check_invariants()
    again = await pool.admit(pages=12)  # every page, the same (only) row
    assert again.row == g.row
    assert pool.pages_dropped(again.row) == 0
    assert page_ids(pool.pages_of(again.row)) == page_ids(again.pages)
    assert 0 not in page_ids(again.pages)


async def test_a_row_that_dropped_everything_frees_clean() -> None:
    pool, _ = single(rows=1)
    g = await pool.admit(pages=2)
    pool.drop_pages(g.row, 2)
    pool.free([g.row])
    pool.check_invariants()
    again = await pool.admit(pages=1)
    assert pool.pages_dropped(again.row) == 0
    assert len(pool.pages_of(again.row)) == 1


async def test_a_record_written_into_is_refused_changing_nothing() -> None:
    pool, _ = single()
    g = await pool.admit(pages=3)
    g.pages[0] = 7  # against the contract: the record
    before = snap(pool)
    with pytest.raises(InvalidSlotError, match="written into"):
        pool.drop_pages(g.row, 1)
    assert snap(pool) == before
    pool.detach_pages(g.row)


async def test_allowed_after_close() -> None:
    pool, _ = single()
    g = await pool.admit(pages=3)
    async with bounded():
        await pool.close()
    assert pool.drop_pages(g.row, 2) == 2
    pool.check_invariants()


# ---------------------------------------------------------------- fences


async def test_dropped_pages_wait_for_the_rows_use_before_any_admit_or_extend(
    kit: Streams,
) -> None:
    """The race: the step in flight still reads the dropped pages."""
    pool, kv = single(pages=4)
    g = await pool.admit(pages=4)
    ids = page_ids(g.pages)
    stream = kit.stream()
    gate = kit.gate(stream)
    step = stream.record()
    pool.record_use([g.row], step)
    assert pool.drop_pages(g.row, 2) == 0
    stats = pool.stats()
    assert (stats.pages_pending, stats.pages_free) == (2, 0)
    assert pool.try_admit(1) is None
    assert pool.extend(g.row, 1) is None
    waiter = asyncio.ensure_future(pool.admit(pages=2))
    await spin()
    assert not waiter.done()
    gate.open()
    async with bounded():
        await wait_fence(step)
        other = await waiter
    assert sorted(page_ids(other.pages)) == sorted(ids[:2])
    pool.check_invariants()
    kv.check_invariants()


@pytest.mark.parametrize("how", ["fence", "fences", "after"])
async def test_dropped_pages_wait_for_fence_and_after(kit: Streams, how: str) -> None:
    pool, _ = single(pages=4)
    g = await pool.admit(pages=3)
    stream = kit.stream()
    gate = kit.gate(stream)
    if how == "fence":
        assert pool.drop_pages([g.row], 2, stream.record()) == 0
    elif how == "fences":
        assert pool.drop_pages([g.row], 2, fence=[stream.record()]) == 0
    else:
        assert pool.drop_pages([g.row], 2, after=stream) == 0
    assert pool.stats().pages_pending == 2
    assert pool.extend(g.row, 2) is None  # one free page only
    gate.open()
    stream.synchronize()
    assert pool.extend(g.row, 3) is not None  # its reclaim finds them
    assert page_ids(pool.pages_of(g.row))[:2] == [0, 0]
    pool.check_invariants()


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("rows", "below", "error", "match"),
    [
        ("row", -1, CapacityError, "below must be a page count >= 0"),
        ("row", 1.0, CapacityError, "below must be a page count"),
        ("row", True, CapacityError, "below must be a page count"),
        ("row", 5, CapacityError, "only 4 page positions"),
        ("rows", [1], CapacityError, "lists 1 page counts for 2 rows"),
        ("rows", [1, 9], CapacityError, "only 3 page positions"),
        ("rows", [[1, 1]], CapacityError, "below"),
        ("set", [1, 1], InvalidSlotError, "has none"),
        ("dup", 1, InvalidSlotError, "row"),
        (0, 1, InvalidSlotError, "row"),
        (3, 1, InvalidSlotError, "row"),
    ],
)
async def test_bad_input_changes_nothing(rows: Any, below: Any, error: Any, match: str) -> None:
    pool, _ = single()
    a = await pool.admit(pages=4)
    b = await pool.admit(pages=3)
    pool.drop_pages(a.row, 1)
    form = {
        "row": a.row,
        "rows": [a.row, b.row],
        "set": {a.row, b.row},
        "dup": [a.row, a.row],
    }
    before = snap(pool)
    with pytest.raises(error, match=match):
        pool.drop_pages(form.get(rows, rows), below)
    assert snap(pool) == before


async def test_a_non_fence_and_group_misuse_change_nothing() -> None:
    pool, _ = single()
    g = await pool.admit(pages=3)
    before = snap(pool)
    with pytest.raises(TypeError):
        pool.drop_pages(g.row, 1, fence=object())  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        pool.drop_pages(g.row, 1, after=object())  # type: ignore[arg-type]
    for call in (
        lambda: pool.drop_pages(g.row, 1, group="swa"),
        lambda: pool.pages_dropped(g.row, group="swa"),
    ):
        with pytest.raises(ValueError, match="this pool has none"):
            call()
    with pytest.raises(InvalidSlotError):
        pool.pages_dropped(3)
    assert snap(pool) == before
    rows_only = AsyncReqToTokenPool(3, 8)
    r = (await rows_only.alloc(1))[0]
    with pytest.raises(CapacityError, match="no KV pages"):
        rows_only.drop_pages(r, 0)
    assert rows_only.pages_dropped(r) == 0


async def test_grouped_pool_drops_in_its_group_only() -> None:
    pool = grouped()
    g = await pool.admit({"swa": 3, "full": 4})
    before = snap(pool)
    for call in (
        lambda: pool.drop_pages(g.row, 1),
        lambda: pool.pages_dropped(g.row),
        lambda: pool.drop_pages(g.row, 1, group="mamba"),
    ):
        with pytest.raises(ValueError):
            call()
    assert snap(pool) == before
    assert pool.drop_pages([g.row], 2, group="swa") == 2
    assert pool.pages_dropped(g.row, group="swa") == 2
    assert pool.pages_dropped(g.row, group="full") == 0
    assert page_ids(pool.pages_of(g.row, group="swa"))[:2] == [0, 0]
    assert 0 not in page_ids(pool.pages_of(g.row, group="full"))
    groups = pool.kv_groups
    assert groups is not None
    assert groups["swa"].stats().free == 7
    pool.check_invariants()
    pool.free(g.row)
    pool.check_invariants()
    again = await pool.admit({"swa": 8, "full": 1})
    assert pool.pages_dropped(again.row, group="swa") == 0


async def test_check_invariants_sees_a_stray_dropped_count() -> None:
    pool, _ = single()
    g = await pool.admit(pages=2)
    pages = pool._pages
    assert pages is not None
    pages.holes[3] = 1  # row 3 is not allocated
    with pytest.raises(AssertionError, match="not allocated"):
        pool.check_invariants()
    pages.holes.pop(3)
    pages.holes[g.row] = 0
    with pytest.raises(AssertionError, match="dropped count"):
        pool.check_invariants()


async def test_check_invariants_sees_a_record_out_of_its_place() -> None:
    pool, _ = single()
    g = await pool.admit(pages=1)
    assert pool.extend(g.row, 5) is not None  # the record in its growth buffer
    pages = pool._pages
    assert pages is not None
    buf = pages.grown[g.row]
    assert buf is not None
    pool.drop_pages(g.row, 2)
    view = pages.grown[g.row]
    assert view is not None and view.base is buf and len(view) == len(buf) - 2
    pool.check_invariants()
    pages.grown[g.row] = buf[1:]  # not where the record starts
    with pytest.raises(AssertionError, match="does not start where"):
        pool.check_invariants()
    pages.grown[g.row] = view.copy()  # not the record's buffer
    with pytest.raises(AssertionError, match="not a view of its buffer"):
        pool.check_invariants()
    pages.grown[g.row] = view
    pool.check_invariants()


# ---------------------------------------------------------------- cost


async def test_a_drop_costs_the_pages_dropped_not_the_pages_kept() -> None:
    """A sliding window's step drops a page from a long row and grows one:
    the rest stays where it is, in the row's growth buffer, and the seal
    is cut and grown in place (the old drop copied both, 2 x 24 KB here,
    each step). The check that the record was not written into still reads
    it whole, as at free and trim."""
    kv = KVPagePool(4001, 4)
    pool = AsyncReqToTokenPool(2, 64, kv=kv)
    g = await pool.admit(pages=1)
    assert pool.extend(g.row, 3000) is not None  # the record in its growth buffer
    pages = pool._pages
    assert pages is not None
    buf, seal = pages.grown[g.row], pages.sealed[g.row]
    assert buf is not None and seal is not None
    for below in range(1, 11):
        assert pool.drop_pages(g.row, below) == 1
        assert pool.extend(g.row, 1) is not None  # room left in the buffer
        record, view = pages.owned[g.row], pages.grown[g.row]
        assert record is not None and record.base is buf
        assert view is not None and view.base is buf and len(view) == len(buf) - below
        assert pages.sealed[g.row] is seal
    assert pool.pages_dropped(g.row) == 10
    assert len(pool.pages_of(g.row)) == 3011
    pool.check_invariants()
    pool.free(g.row)
    assert kv.available_size() == 4000
    pool.check_invariants()


async def test_a_window_sliding_past_its_buffer_moves_to_a_new_one() -> None:
    """Drop one and grow one a step, many times over the buffer's length:
    each move copies the window to the start of a new buffer; every
    position reads as it should, and tensors handed out keep what they read."""
    pool, kv = single(pages=40, rows=2)
    g = await pool.admit(pages=8)
    model = page_ids(g.pages)
    held = [(g.pages, list(model))]
    for step in range(100):
        new = pool.extend(g.row, 1) if step % 2 else pool.extend_rows([g.row], 1)
        assert new is not None
        model += page_ids(new)
        held.append((new, page_ids(new)))
        assert pool.drop_pages(g.row, step + 1) == 1
        model[step] = 0
        out = pool.pages_of(g.row, host=True)
        assert page_ids(out) == model
        held.append((out, list(model)))
        pool.check_invariants()
    assert all(page_ids(t) == seen for t, seen in held)
    assert kv.available_size() == 40 - 8
    pool.free(g.row)
    pool.check_invariants()


@pytest.mark.cuda
async def test_device_form_reads_holes_as_page_zero() -> None:
    kv = KVPagePool(9, 4, device="cuda")
    pool = AsyncReqToTokenPool(3, 64, kv=kv)
    g = await pool.admit(pages=3)
    pool.drop_pages(g.row, 1)
    out = pool.pages_of(g.row)
    assert out.device.type == "cuda"
    assert out.tolist() == [0, *g.pages.tolist()[1:]]
    assert pool.detach_pages(g.row).tolist() == g.pages.tolist()[1:]
