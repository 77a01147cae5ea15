"""The batched page calls' one-pass paths: page counts read in C passes
(``_page_counts``: Python ints, an integer array's or tensor's
``tolist()``) and a give-back's records checked and grouped at once
(``RowPages.prepare_free``).

Each path must answer exactly as the per-element pass it skips: the same
counts, the same typed error naming the same element, nothing changed
after a refusal. No timing here: ``python -m benchmarks.batch_calls``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from helpers import EventFence, grouped_pool, kv_group, kv_pool_state, page_ids

from asyncpool import AsyncReqToTokenPool, CapacityError, InvalidSlotError, KVPagePool
from asyncpool.page_args import _page_counts

GOOD: list[tuple[object, list[int]]] = [
    ([2, 0, 1], [2, 0, 1]),
    ((2, 0, 1), [2, 0, 1]),
    (range(3), [0, 1, 2]),
    (np.array([2, 0, 1], dtype=np.int64), [2, 0, 1]),
    (np.array([2, 0, 1], dtype=np.uint8), [2, 0, 1]),
    (torch.tensor([2, 0, 1]), [2, 0, 1]),
    (torch.tensor([2, 0, 1], dtype=torch.int16), [2, 0, 1]),
    # Integer scalars of other types: the per-element pass reads them.
    ([np.int64(2), torch.tensor(0), np.uint8(1)], [2, 0, 1]),
    ([2, np.int32(0), 1], [2, 0, 1]),
]


@pytest.mark.parametrize(("value", "want"), GOOD)
def test_counts_read_as_python_ints(value: object, want: list[int]) -> None:
    got = _page_counts(value, 3, "keep")
    assert got == want
    assert all(k.__class__ is int for k in got)


def test_counts_are_a_fresh_list_the_caller_cannot_change_under_the_call() -> None:
    counts = [1, 2]
    got = _page_counts(counts, 2, "keep")
    assert got is not counts
    counts[0] = -5
    assert got == [1, 2]


def test_no_rows_no_counts() -> None:
    assert _page_counts([], 0, "k") == []
    assert _page_counts(np.zeros(0, dtype=np.int64), 0, "k") == []
    assert _page_counts(torch.zeros(0, dtype=torch.int64), 0, "k") == []
    with pytest.raises(CapacityError, match="lists 0 page counts for 2 rows"):
        _page_counts([], 2, "k")


BAD: list[tuple[object, str]] = [
    # A bool is an int subclass: the one pass must not take it.
    ([1, True, 1], r"must hold page counts \(integers\), got True of type bool"),
    ([1, np.bool_(True), 1], r"integers"),
    ([1, 1.0, 1], r"got 1\.0 of type float"),
    ([1, torch.tensor(1.0), 1], r"integers"),
    ([1, torch.tensor([1]), 1], r"integers"),
    # The first bad element in order names the error, as before.
    ([1, -2, -3], r"page counts >= 0, got -2"),
    ([-1, 1.5, 1], r"page counts >= 0, got -1"),
    ([1.5, -1, 1], r"got 1\.5 of type float"),
    (np.array([1, -2, -3]), r"page counts >= 0, got -2"),
    (torch.tensor([0, 0, -1]), r"page counts >= 0, got -1"),
    ([1, np.int64(-4), 1], r"page counts >= 0, got -4"),
    ([1, 2], r"lists 2 page counts for 3 rows"),
]


@pytest.mark.parametrize(("value", "match"), BAD)
def test_bad_counts_name_the_first_bad_one(value: object, match: str) -> None:
    with pytest.raises(CapacityError, match=match):
        _page_counts(value, 3, "keep")


def _trim_pool() -> tuple[AsyncReqToTokenPool, list[int]]:
    pool = grouped_pool(rows=3, swa=12, full=12)
    rows = []
    for _ in range(3):
        g = pool.try_admit({"full": 3, "swa": 3})
        assert g is not None
        rows.append(g.row)
    return pool, rows


def _state(pool: AsyncReqToTokenPool) -> tuple[Any, ...]:
    pool.check_invariants()
    return tuple(
        (
            name,
            kv.available_size(),
            kv.pending_size(),
            [page_ids(pool.pages_of(r, group=name)) for r in pool._ledger.allocated_rows()],
        )
        for name, kv in (pool.kv_groups or {}).items()
    )


@pytest.mark.parametrize(
    "keep",
    [[1, True, 1], [1, -1, 1], [1, 1.0, 1], np.array([1, -1, 1]), torch.tensor([1, 1, -1])],
    ids=["bool", "negative", "float", "numpy-negative", "torch-negative"],
)
def test_a_bad_count_in_the_second_group_changes_no_group(keep: object) -> None:
    pool, rows = _trim_pool()
    before = _state(pool)
    with pytest.raises(CapacityError, match="KV group 'full'"):
        pool.trim_pages(rows, {"swa": [1, 1, 1], "full": keep})
    with pytest.raises(CapacityError, match="KV group 'swa'"):
        pool.drop_pages(rows, {"full": [1, 1, 1], "swa": keep})
    assert _state(pool) == before


def test_counts_as_arrays_and_tensors_trim_as_a_list_does() -> None:
    pool, rows = _trim_pool()
    full, swa = kv_group(pool, "full"), kv_group(pool, "swa")
    free = full.available_size(), swa.available_size()
    assert (
        pool.trim_pages(rows, {"full": np.array([2, 0, 3]), "swa": torch.tensor([1, 3, 0])})
        == 4 + 5
    )
    assert [len(page_ids(pool.pages_of(r, group="full"))) for r in rows] == [2, 0, 3]
    assert [len(page_ids(pool.pages_of(r, group="swa"))) for r in rows] == [1, 3, 0]
    assert (full.available_size(), swa.available_size()) == (free[0] + 4, free[1] + 5)
    pool.check_invariants()


def test_a_written_record_among_many_is_named_and_nothing_changes() -> None:
    """The records are checked at once; the error still names the row
    written into, and only rows that give pages back are checked."""
    pool, rows = _trim_pool()
    record = pool.pages_of(rows[2], group="swa")
    last = int(record[2])
    record[2] = int(pool.pages_of(rows[0], group="swa")[0])
    before = _state(pool)
    with pytest.raises(InvalidSlotError, match=f"pages of row {rows[2]} were written into"):
        pool.trim_pages(rows, {"full": 1, "swa": 1})
    with pytest.raises(InvalidSlotError, match=f"pages of row {rows[2]} were written into"):
        pool.drop_pages(rows, 1, group="swa")
    assert _state(pool) == before
    # Row 2 gives nothing back here (keep past its pages): not checked.
    assert pool.trim_pages(rows, [1, 1, 3], group="swa") == 4
    record[2] = last
    pool.check_invariants()


def test_rows_with_different_uses_wait_each_for_their_own() -> None:
    """One recorded use for all the rows is one group; rows whose uses
    differ still give their pages back behind their own fences."""
    pool, rows = _trim_pool()
    fence = EventFence()
    pool.record_use([rows[1]], fence)
    swa = kv_group(pool, "swa")
    free = swa.available_size()
    assert pool.drop_pages(rows, 2, group="swa") == 4  # rows 0 and 2: at once
    assert swa.pending_size() == 2  # row 1's, behind its step
    assert swa.available_size() == free + 4
    fence.set()
    swa.reclaim()
    assert swa.pending_size() == 0
    assert swa.available_size() == free + 6
    pool.check_invariants()


def test_one_kv_batch_free_checks_every_record() -> None:
    pool = AsyncReqToTokenPool(4, 64, kv=KVPagePool(13, 4))
    rows = []
    for _ in range(3):
        g = pool.try_admit(pages=3)
        assert g is not None
        rows.append(g.row)
    before = kv_pool_state(pool)
    record = pool.pages_of(rows[1])
    last = int(record[0])
    record[0] = int(pool.pages_of(rows[0])[0])
    with pytest.raises(InvalidSlotError, match=f"pages of row {rows[1]} were written into"):
        pool.free(rows)
    record[0] = last
    assert kv_pool_state(pool) == before
    assert pool.free(rows) == 3
    pool.check_invariants()
