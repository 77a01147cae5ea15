"""Gaps found by a hand-made mutation sweep of the last session's library
code (a7a2b12..bba3b82): the one-page growth's fast path for beheaded rows
(``RowPages._append_one_each``) and ``_append``'s buffer reuse, the batched
drop (``_behead`` over a group's rows, ``_group_many``'s drop form and its
records gathered by ``itemgetter``), ``_per_row``'s int fast path,
``KVPagePool.forget_stream`` refused on a pool-owned page pool, a closed
pool's ``alloc_threadsafe``/``admit_threadsafe`` (``_closed_answer``),
``TokenTables.write``'s cast, and growth.py's singular/plural refusals.
The trim's code (``free`` with ``keep``, ``prepare_free``, ``_group_many``'s
trim form) was left alone: another helper reworks it.

58 mutants, each run against the test files that exercise its code
(pytest -x, a 60 s timeout a test): 46 killed, 8 equivalent, 4 gaps (the
tests below; each fails on its mutant and passes on the code). No library
defect. "caught by" names the test file that failed first (pytest -x).

=====  =====================================================  =========================  ==========
id     mutant (file: change)                                  caught by: tests/test_*    verdict
=====  =====================================================  =========================  ==========
R1     _append_one_each: a beheaded row sent to _append                                  equivalent
R2     _append_one_each: buf.base's ``is not None`` dropped                              equivalent
R3     _append_one_each: every row with a buffer taken fast                              equivalent
R4     _append_one_each: room test ``<=``                     drop_pages                 killed
R5     _append_one_each: room measured on the base buffer     drop_pages                 killed
R6     _append_one_each: the seal not grown                   drop_pages                 killed
R7     _append_one_each: the record one page short            drop_pages                 killed
R8     _append_one_each: the record cut from the base         drop_pages                 killed
R9     _append: ``end`` one page whatever arr's length        drop_pages                 killed
R10    _append: a beheaded row's buffer never reused          drop_pages                 killed
B1     _behead: ``n > len`` (an emptied record kept, empty)   drop_pages                 killed
B2     _behead: the bytearray seal cut one page short         drop_pages                 killed
B3     _behead: a bytes seal cut as bytes, not bytearray                                 equivalent
B4     _behead: holes set to the live count dropped           drop_pages                 killed
B5     _behead: the earlier drops not subtracted              drop_pages                 killed
B6     _behead: the growth buffer let go                      drop_pages                 killed
B7     _behead: a fully dropped row keeps its buffer          batched_pages              killed
B8     _behead: the buffer's view not moved                   drop_pages                 killed
B9     free: only the group's first row beheaded              drop_pages                 killed
B10    _behead: a fully dropped row's holes not set           drop_pages                 killed
D1     _group_many: a drop picks rows with nothing below      batch_count_fast_paths     killed
D2     _group_many: a drop's run one place long               batch_count_fast_paths     killed
D3     _group_many: a drop's cut takes one place past         batch_count_fast_paths     killed
D4     _group_many: a drop's cut misses its first place       batch_count_fast_paths     killed
D5     _group_many: mixed uses, a drop gives whole records    batch_count_fast_paths     killed
D6     _group_many: mixed uses, a drop's run one short        batch_count_fast_paths     killed
D7     _group_many: itemgetter's one record read as many      (below)                    GAP
D8     _group_many: two rows' tuple read as one record        (below)                    GAP
D9     _group_many: the seals gathered from the records       batch_count_fast_paths     killed
D10    _group_many: one row's use read as row 0's             (below)                    GAP
D11    _group_many: one row's seal gathered from its record   (below)                    GAP
D12    _group_many: a drop's cut through the trim's ``lo``    batch_count_fast_paths     killed
A1     _per_row: an int taken as per row                      kv_groups_extend           killed
A2     _per_row: the int fast path removed                                               equivalent
A3     _per_row: ``isinstance(counts, int)`` (bools too)                                 equivalent
K1     KVPagePool.forget_stream: an owned pool not refused    bounded_bookkeeping        killed
K2     KVPagePool.forget_stream: a bare pool refused          bounded_bookkeeping        killed
K3     KVPagePool.forget_stream: forgotten, then refused      bounded_bookkeeping        killed
K4     KVPagePool.forget_stream: refused before the guard     sweep_stage2_54            killed
C1     alloc_threadsafe: the closed check skipped             threadsafe_submit          killed
C2     admit_threadsafe: the closed check skipped             threadsafe_submit          killed
C3     _closed_answer: a result of None, not the error        threadsafe_submit          killed
C4     _closed_answer: raised on the caller's thread          threadsafe_submit          killed
C5     _closed_answer: a RuntimeError                         threadsafe_submit          killed
C6     alloc_threadsafe: admit's message                      threadsafe_submit          killed
C7     _closed_answer: a future never resolved                threadsafe_submit          killed
T1     write: no cast                                         inputs_and_handoff         killed
T2     write: cast to int64                                   inputs_and_handoff         killed
T3     write: cast only when the dtypes match                 inputs_and_handoff         killed
T4     write: any value cast (no tensor check)                sync_drop_in_differential  killed
T5     write: the resets not waited for first                 sweep_stage2_52            killed
G1     extend_rows: "1 rows" in the each refusal                                         equivalent
G2     extend_rows: "1 pages each"                            extend_rows                killed
G3     _extend_each: "1 rows"                                 extend_rows                killed
G4     _extend_groups: "1 rows"                                                          equivalent
G5     _extend_groups: "1 pages each"                         extend_rows                killed
G6     _extend_groups_each: "1 rows"                          extend_rows                killed
G7     _extend_groups_each: the group's name left out         kv_groups_extend_each      killed
=====  =====================================================  =========================  ==========

Equivalent: R1/R3 (under ``check_invariants`` a row with a buffer has its
record a view of that buffer, or of its base from where the buffer's view
starts, so the test only restates the invariant; a beheaded row sent to
``_append`` grows in the same buffer, only slower); R2 (both bases None
would need a record that is not a view of its buffer); B3 (a bytes seal
means no growth buffer, so the next growth takes ``_append``, which makes
the seal a bytearray; the copy only saves the next drop's); A2/A3 (an int,
or a bool, is no sequence and no array: ``False`` either way); G1/G4 (one
row past the pool's pages needs a count past them, which the count check
refuses first, with its own message).

The gaps: a batch past ``_JOINED_CHECK`` rows of which only one or two give
pages back (a free among rows without pages in the group, a drop or a trim
among rows that give nothing): ``itemgetter`` answers one item for one row
and a tuple for more, and no test had a batch that picked fewer than three
(D7, D8); that one row's pages wait for its own recorded use (D10) and its
written record is refused, nothing changed (D11).

No GPU here. Every call below is synchronous; nothing waits.
"""

from __future__ import annotations

from typing import Any

import pytest
from helpers import EventFence, grouped_pool, kv_group, page_ids

from asyncpool import AsyncReqToTokenPool, InvalidSlotError
from asyncpool.row_pages import _JOINED_CHECK

#: A batch past the joined check, so ``_group_many`` takes it.
N = _JOINED_CHECK + 4


def _few_give(picked: int) -> tuple[AsyncReqToTokenPool, list[int]]:
    """A pool of ``N`` rows, only the first ``picked`` holding pages in
    group "swa" (3 each); the rest hold none there."""
    pool = grouped_pool(rows=N, swa=3 * N, full=4)
    rows = []
    for i in range(N):
        g = pool.try_admit({"swa": 3 if i < picked else 0, "full": 0})
        assert g is not None
        rows.append(g.row)
    return pool, rows


def _state(pool: AsyncReqToTokenPool, rows: list[int]) -> tuple[Any, ...]:
    swa = kv_group(pool, "swa")
    return (
        swa.available_size(),
        swa.pending_size(),
        [page_ids(pool.pages_of(r, group="swa")) for r in rows],
    )


def _give(pool: AsyncReqToTokenPool, rows: list[int], call: str, picked: int) -> int:
    """The batch call ``call`` over every row, in which each of the first
    ``picked`` rows gives back 2 of its 3 pages (a free: all 3), the rest
    nothing. Returns the pages given back."""
    rest = [0] * (N - picked)
    if call == "free":
        pool.free(rows)
        return 3 * picked
    if call == "drop":
        pool.drop_pages(rows, [2] * picked + rest, group="swa")
    else:
        pool.trim_pages(rows, [1] * picked + rest, group="swa")
    return 2 * picked


@pytest.mark.parametrize("picked", [1, 2])
@pytest.mark.parametrize("call", ["free", "drop", "trim"])
def test_a_batch_in_which_one_or_two_rows_give_pages_back(picked: int, call: str) -> None:
    """Many rows, only one or two of which give pages back: exactly their
    pages go back, and each keeps what it should (one mutant read
    ``itemgetter``'s one record as a sequence of records, one read its
    tuple of two as one record: ``TypeError`` either way)."""
    pool, rows = _few_give(picked)
    swa = kv_group(pool, "swa")
    before = [page_ids(pool.pages_of(r, group="swa")) for r in rows[:picked]]
    free = swa.available_size()
    given = _give(pool, rows, call, picked)
    assert swa.available_size() == free + given and swa.pending_size() == 0
    if call != "free":
        want = [[0, 0, b[2]] if call == "drop" else b[:1] for b in before]
        assert [page_ids(pool.pages_of(r, group="swa")) for r in rows[:picked]] == want
    pool.check_invariants()


@pytest.mark.parametrize("picked", [1, 2])
@pytest.mark.parametrize("call", ["free", "drop", "trim"])
def test_the_few_rows_that_give_pages_back_wait_for_their_own_use(picked: int, call: str) -> None:
    """The rows giving pages back carry a recorded use not yet done: their
    pages wait behind it, however few of the batch's rows they are (the
    mutant grouped one row's pages under row 0's use, none: free at
    once)."""
    pool, rows = _few_give(picked)
    fence = EventFence()
    pool.record_use(rows[:picked], fence)
    swa = kv_group(pool, "swa")
    free = swa.available_size()
    given = _give(pool, rows, call, picked)
    assert swa.available_size() == free and swa.pending_size() == given
    fence.set()
    swa.reclaim()
    assert swa.available_size() == free + given and swa.pending_size() == 0
    pool.check_invariants()


@pytest.mark.parametrize("picked", [1, 2])
@pytest.mark.parametrize("call", ["free", "drop", "trim"])
def test_a_written_record_among_few_that_give_is_refused(picked: int, call: str) -> None:
    """The last row giving pages back had its record written into (its
    first page over its second, a place every call here gives back; a trim
    checks only the places it gives back): the batch is refused, naming it,
    and nothing changes, however few rows give pages (the mutant checked one
    row's record against itself: a trim gave back the row's kept page, and
    a free or a drop failed on the page listed twice, not naming the
    write)."""
    pool, rows = _few_give(picked)
    written = rows[picked - 1]
    record = pool.pages_of(written, group="swa")
    second = int(record[1])
    record[1] = int(record[0])
    before = _state(pool, rows)
    with pytest.raises(InvalidSlotError, match=f"pages of row {written} were written into"):
        _give(pool, rows, call, picked)
    assert _state(pool, rows) == before
    record[1] = second
    pool.check_invariants()
