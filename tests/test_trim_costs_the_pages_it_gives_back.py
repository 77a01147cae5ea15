"""A trim costs the pages it gives back, not the row's record.

Speculative decoding grows a row by its drafts and trims the rejected tail
every step. A trim checks only the pages it gives back against their seal
(the kept ones are checked where they are given back: the row's free, a
drop, a later trim), and it keeps the row's growth buffer unless a view of
it was handed out (``pages_of`` on the host), so the next growth writes the
cut places instead of copying the whole record into a new buffer.

The differential test runs seeded random growths, trims, drops, frees,
admissions, held views and writes into records against a twin pool whose
trims let every buffer go (the code path before: ``lent`` answering every
row) and a shadow of each row's positions: the same pages handed out, the
same answers, the same page counts, the invariants, and every view handed
out reading what it read. A write into a kept page leaves the trim as the
twin's (unwritten) trim and is refused at the row's free, nothing changed.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from helpers import page_ids as ids

from asyncpool import AsyncReqToTokenPool, InvalidSlotError, KVPagePool

ROWS = 60  # past RowPages' _JOINED_CHECK (56): a trim of every row takes _group_many


class _EveryRow:
    """``RowPages.lent`` for the twin: every row lent, so every trim lets
    the row's buffer go, as every trim did before."""

    def __contains__(self, row: object) -> bool:
        return True

    def add(self, row: int) -> None:
        pass

    def discard(self, row: int) -> None:
        pass


def make(rows: int = 2, pages: int = 64) -> AsyncReqToTokenPool:
    return AsyncReqToTokenPool(rows + 1, 1 << 12, kv=KVPagePool(pages + 1, 1))


def table(pool: AsyncReqToTokenPool, row: int) -> list[int]:
    """The row's positions read without lending a view (a fresh table)."""
    t, counts = pool.pages_of_rows([row])
    return ids(t)[: int(counts[0])]


async def test_a_trim_keeps_the_buffer_and_the_growth_after_it_writes_there():
    pool = make()
    rp = pool._pages
    assert rp is not None
    g = pool.try_admit(pages=4)
    assert g is not None
    assert pool.extend(g.row, 4) is not None  # the record now lives in a growth buffer
    buf = rp.grown[g.row]
    assert buf is not None
    for _ in range(3):  # a speculative step's rollback and the next step's growth
        assert pool.trim_pages(g.row, 6) == 2
        assert rp.grown[g.row] is buf
        new = pool.extend(g.row, 2)
        assert new is not None
        assert rp.grown[g.row] is buf  # grown in place: no copy of the record
        assert table(pool, g.row)[6:] == ids(new)
    pool.check_invariants()
    # A view handed out lends the buffer: the trim lets it go, the view
    # keeps what it read, and the growth after it copies into a new one.
    view = pool.pages_of(g.row)
    read = ids(view)
    assert pool.trim_pages(g.row, 5) == 3
    assert rp.grown[g.row] is None
    new = pool.extend(g.row, 3)
    assert new is not None and ids(view) == read
    assert table(pool, g.row) == read[:5] + ids(new)
    fresh = rp.grown[g.row]
    assert fresh is not None and fresh is not buf
    assert pool.trim_pages(g.row, 6) == 2  # not lent since the new buffer
    assert rp.grown[g.row] is fresh
    pool.free([g.row])
    pool.check_invariants()


@pytest.mark.parametrize("rows", [1, ROWS])
async def test_a_write_into_a_kept_page_is_refused_at_the_rows_free_not_at_the_trim(rows: int):
    """The trim gives back only its tail, checked against the seal; the
    kept head written into (against the contract) is the row's still, and
    its free refuses it, nothing changed, until it is restored."""
    pool = make(rows=ROWS, pages=ROWS * 8)
    grants = [pool.try_admit(pages=6) for _ in range(rows)]
    assert all(g is not None for g in grants)
    seq = [g.row for g in grants if g is not None]
    victim = seq[-1]
    record = pool.pages_of(victim)
    first = int(record[0])
    record[0] = int(record[5])  # a kept page now lists a trimmed one
    assert pool.trim_pages(seq, 3) == 3 * rows
    kv = pool.kv
    assert kv is not None
    before = (kv.available_size(), table(pool, victim))
    with pytest.raises(InvalidSlotError, match="written into"):
        pool.free([victim])
    with pytest.raises(InvalidSlotError, match="written into"):
        pool.drop_pages(victim, 1)
    assert (kv.available_size(), table(pool, victim)) == before
    record[0] = first  # restored: the row frees as granted, less its tail
    pool.free(seq)
    assert kv.available_size() == kv.capacity
    pool.check_invariants()


async def test_a_write_into_a_trimmed_page_is_refused_by_the_trim():
    pool = make(rows=ROWS, pages=ROWS * 8)
    grants = [pool.try_admit(pages=6) for _ in range(ROWS)]
    seq = [g.row for g in grants if g is not None]
    for g in grants:
        assert g is not None
        assert pool.extend(g.row, 1) is not None
    record = pool.pages_of(seq[-1])
    kept = int(record[4])
    record[4] = int(record[0])
    before = [table(pool, row) for row in seq]
    for rows in ([seq[-1]], seq):  # the loop for a few rows, the joined check for many
        with pytest.raises(InvalidSlotError, match=f"row {seq[-1]}"):
            pool.trim_pages(rows, 4)
    assert [table(pool, row) for row in seq] == before
    record[4] = kept
    assert pool.trim_pages(seq, 4) == 3 * ROWS
    pool.check_invariants()


def _run(seed: int) -> None:
    rnd = random.Random(seed)
    pool = make(rows=ROWS, pages=ROWS * 24)
    twin = make(rows=ROWS, pages=ROWS * 24)
    assert twin._pages is not None
    twin._pages.lent = _EveryRow()  # type: ignore[assignment]
    kv, kv_twin = pool.kv, twin.kv
    assert kv is not None and kv_twin is not None
    shadow: dict[int, list[int]] = {}  # row: its positions, dropped ones as 0
    held: list[tuple[Any, list[int]]] = []  # views handed out and what they read

    def admit() -> None:
        k = rnd.randrange(0, 5)
        a, b = pool.try_admit(pages=k), twin.try_admit(pages=k)
        assert (a is None) == (b is None)
        if a is not None and b is not None:
            assert a.row == b.row and ids(a.pages) == ids(b.pages)
            shadow[a.row] = ids(a.pages)

    for _ in range(ROWS // 2):
        admit()
    for _step in range(160):
        rows = list(shadow)
        op = rnd.random()
        if not rows or op < 0.08:
            admit()
        elif op < 0.36:  # the drafts' growth
            pick = rnd.sample(rows, rnd.randrange(1, min(len(rows), 8) + 1))
            k = rnd.randrange(1, 4)
            if rnd.random() < 0.5:
                a, b = pool.extend_rows(pick, k), twin.extend_rows(pick, k)
            else:
                pick = pick[:1]
                a, b = pool.extend(pick[0], k), twin.extend(pick[0], k)
            assert (a is None) == (b is None)
            if a is not None:
                got = ids(a)
                assert got == ids(b)
                for i, row in enumerate(pick):
                    shadow[row] += got[i * k : i * k + k]
        elif op < 0.64:  # the rollback: a few rows, or every row (one joined check)
            pick = rows if rnd.random() < 0.3 else rnd.sample(rows, min(len(rows), 3))
            pick.sort()
            keeps = [max(0, len(shadow[row]) - rnd.randrange(0, 4)) for row in pick]
            assert pool.trim_pages(pick, keeps) == twin.trim_pages(pick, keeps)
            for row, keep in zip(pick, keeps, strict=True):
                shadow[row] = shadow[row][:keep]
        elif op < 0.70:  # a window's slide
            row = rnd.choice(rows)
            below = rnd.randrange(0, len(shadow[row]) + 1)
            assert pool.drop_pages(row, below) == twin.drop_pages(row, below)
            shadow[row] = [0] * below + shadow[row][below:] if below else shadow[row]
        elif op < 0.80:  # a step's block table, held across later steps
            row = rnd.choice(rows)
            for p in (pool, twin):
                view = p.pages_of(row, host=rnd.random() < 0.5)
                held.append((view, ids(view)))
        elif op < 0.88:  # a write into a kept page: the trim is the twin's
            row = rnd.choice(rows)
            live = [i for i, page in enumerate(shadow[row]) if page]
            if len(live) < 2:
                continue
            at, keep = live[0], live[-1]
            written = shadow[row][keep]  # a page the trim gives back
            view = pool.pages_of(row)
            view[at] = written
            assert pool.trim_pages(row, keep) == twin.trim_pages(row, keep)
            shadow[row] = shadow[row][:keep]
            available = kv.available_size()
            with pytest.raises(InvalidSlotError, match="written into"):
                pool.free([row])
            assert kv.available_size() == available
            assert table(pool, row) == [*shadow[row][:at], written, *shadow[row][at + 1 :]]
            view[at] = shadow[row][at]
        elif op < 0.94:  # a write into a page the trim gives back: refused
            row = rnd.choice(rows)
            live = [i for i, page in enumerate(shadow[row]) if page]
            if len(live) < 2:
                continue
            at = live[-1]
            view = pool.pages_of(row)
            view[at] = shadow[row][live[0]]
            available = kv.available_size()
            with pytest.raises(InvalidSlotError, match="written into"):
                pool.trim_pages(row, at)
            assert kv.available_size() == available
            view[at] = shadow[row][at]
            assert table(pool, row) == shadow[row]
        else:
            row = rnd.choice(rows)
            assert pool.free([row]) == twin.free([row])
            del shadow[row]
        for row, positions in shadow.items():
            assert table(pool, row) == positions == table(twin, row)
        assert kv.available_size() == kv_twin.available_size()
        for view, read in held:
            assert ids(view) == read
        pool.check_invariants()
        twin.check_invariants()
    assert pool.free(list(shadow)) == twin.free(list(shadow))
    assert kv.available_size() == kv.capacity == kv_twin.available_size()


@pytest.mark.parametrize("seed", range(6))
async def test_trims_and_growths_match_the_twin_that_lets_every_buffer_go(seed: int):
    _run(seed)
