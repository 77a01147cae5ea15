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
from asyncpool.row_pages import _JOINED_CHECK

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


#: Batch sizes on both sides of the joined record check (_JOINED_CHECK).
SIZES = [3, _JOINED_CHECK + 4]


def _trim_pool(n: int = 3) -> tuple[AsyncReqToTokenPool, list[int]]:
    pool = grouped_pool(rows=n, swa=4 * n, full=4 * n)
    rows = []
    for _ in range(n):
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


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("written", ["first", "last"])
def test_a_written_record_among_many_is_named_and_nothing_changes(n: int, written: str) -> None:
    """A few records are checked one by one, many at once; either way the
    error names the first row written into, and only rows that give pages
    back are checked."""
    pool, rows = _trim_pool(n)
    at = 1 if written == "first" else n - 1
    other = rows[0] if at else rows[1]
    record = pool.pages_of(rows[at], group="swa")
    last = int(record[2])
    record[2] = int(pool.pages_of(other, group="swa")[0])
    before = _state(pool)
    name = f"pages of row {rows[at]} were written into"
    with pytest.raises(InvalidSlotError, match=name):
        pool.trim_pages(rows, {"full": 1, "swa": 1})
    with pytest.raises(InvalidSlotError, match=name):  # the written page among those dropped
        pool.drop_pages(rows, 3, group="swa")
    with pytest.raises(InvalidSlotError, match=name):
        pool.free(rows)
    assert _state(pool) == before
    # The written row gives nothing back here (keep past its pages): not checked.
    keeps = [1] * n
    keeps[at] = 3
    assert pool.trim_pages(rows, keeps, group="swa") == 2 * (n - 1)
    record[2] = last
    pool.check_invariants()


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("held", ["one", "all but one"])
def test_rows_with_different_uses_wait_each_for_their_own(n: int, held: str) -> None:
    """One recorded use for all the rows is one group; rows whose uses
    differ still give their pages back behind their own fences."""
    pool, rows = _trim_pool(n)
    fence = EventFence()
    behind = [rows[1]] if held == "one" else rows[1:]
    pool.record_use(behind, fence)
    swa = kv_group(pool, "swa")
    free = swa.available_size()
    at_once = 2 * (n - len(behind))
    assert pool.drop_pages(rows, 2, group="swa") == at_once
    assert swa.pending_size() == 2 * len(behind)  # behind their step
    assert swa.available_size() == free + at_once
    fence.set()
    swa.reclaim()
    assert swa.pending_size() == 0
    assert swa.available_size() == free + 2 * n
    pool.check_invariants()


def test_rows_sharing_one_use_wait_for_it_together() -> None:
    pool, rows = _trim_pool(_JOINED_CHECK + 4)
    fence = EventFence()
    pool.record_use(rows, fence)
    swa = kv_group(pool, "swa")
    free = swa.available_size()
    assert pool.trim_pages(rows, 1, group="swa") == 0
    assert swa.pending_size() == 2 * len(rows)
    fence.set()
    swa.reclaim()
    assert swa.available_size() == free + 2 * len(rows)
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


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("mixed", [False, True], ids=["one use", "mixed uses"])
def test_batched_drops_and_trims_give_back_exactly_each_rows_places(n: int, mixed: bool) -> None:
    """A window's drops and a rollback's trims over many steps, rows with
    dropped places among them: after each batched call every row reads
    as the same call per row would leave it, and exactly the places given
    back went back to the page pool."""
    rng = np.random.default_rng(n + mixed)
    pool = grouped_pool(rows=n, swa=40 * n, full=8)
    rows = []
    for _ in range(n):
        g = pool.try_admit({"swa": 4, "full": 0})
        assert g is not None
        rows.append(g.row)
    swa = kv_group(pool, "swa")
    fence = EventFence()
    fence.set()  # complete: pages behind it go back at the next reclaim
    for step in range(12):
        drafts = [int(x) for x in rng.integers(0, 4, n)]
        pool.extend_rows(rows, {"swa": drafts})
        if mixed:
            pool.record_use(rows[::3], fence)
        before = {r: page_ids(pool.pages_of(r, group="swa")) for r in rows}
        free = swa.available_size()
        if step % 2:
            keeps = [int(rng.integers(0, len(before[r]) + 1)) for r in rows]
            pool.trim_pages(rows, {"swa": keeps})
            want = {r: before[r][:k] for r, k in zip(rows, keeps, strict=True)}
        else:
            belows = [int(rng.integers(0, len(before[r]) + 1)) for r in rows]
            pool.drop_pages(rows, belows, group="swa")
            want = {}
            for r, b in zip(rows, belows, strict=True):
                d = sum(1 for p in before[r] if p == 0)
                want[r] = [0] * max(b, d) + before[r][max(b, d) :]
        got = {r: page_ids(pool.pages_of(r, group="swa")) for r in rows}
        assert got == want
        given = sorted(p for r in rows for p in before[r] if p and p not in set(want[r]))
        swa.reclaim()
        assert swa.available_size() - free == len(given)
        pool.check_invariants()


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("call", ["trim", "drop", "free"])
def test_a_page_two_rows_list_is_refused_for_the_whole_batch(n: int, call: str) -> None:
    """The pool's own bookkeeping gone wrong (two rows' sealed records
    listing one page; only a bug could do it): a batch's give-back checks
    its pages distinct across rows, however many rows, and refuses."""
    pool = grouped_pool(rows=n, swa=6 * n, full=8)
    rows = []
    for _ in range(n):
        g = pool.try_admit({"swa": 5, "full": 0})
        assert g is not None
        rows.append(g.row)
    pages = pool._groups["swa"]  # type: ignore[index]
    a, b = rows[0], rows[-1]
    pages.owned[b] = pages.owned[a].copy()
    pages.sealed[b] = pages.owned[b].tobytes()
    swa = kv_group(pool, "swa")
    free = swa.available_size()
    with pytest.raises(InvalidSlotError, match="more than once"):
        if call == "trim":
            pool.trim_pages(rows, 0, group="swa")
        elif call == "drop":
            pool.drop_pages(rows, 5, group="swa")
        else:
            pool.free(rows)
    assert swa.available_size() == free
    assert page_ids(pool.pages_of(b, group="swa")) == page_ids(pool.pages_of(a, group="swa"))
