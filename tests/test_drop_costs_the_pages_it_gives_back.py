"""A drop costs the pages it gives back, not the row's record.

A sliding window drops the page that slid out and grows one every few
steps, on every row. A drop checks only the pages it gives back against
their seal, as a trim does (the kept ones are checked where they are given
back: the row's free, a later drop or trim), so that a window's step costs
the same on a row of 1,024 pages as on one of 32,768. A trim of a row never
grown cuts its seal once into a bytearray, then in place, instead of
copying it up to ``keep`` at every trim.

The differential test runs seeded random admissions, growths, trims,
drops (one row or many, past ``_JOINED_CHECK``; one ``below`` or one per
row; behind fences left pending; on one kv and on a KV group, a mapping
``{group: below}`` too), frees, held views and writes into records against
a twin pool whose drops check each row's whole record first (the path
before) and a shadow of positions: the same pages handed out, the same
answers, the same page ledgers, the invariants, and every view handed out
reading what it read. A write into a kept page leaves the drop as the
twin's (unwritten) drop and is refused where that page is given back,
nothing changed; a write into a page a drop gives back refuses the drop,
nothing changed.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
from helpers import EventFence, kv_snapshot
from helpers import page_ids as ids

from asyncpool import AsyncReqToTokenPool, InvalidSlotError, KVPagePool
from asyncpool.row_pages import _JOINED_CHECK, RowPages

ROWS = _JOINED_CHECK + 4  # a drop of every row takes _group_many


def make(grouped: bool, rows: int = ROWS, pages: int = ROWS * 24) -> AsyncReqToTokenPool:
    if grouped:
        return AsyncReqToTokenPool(
            rows + 1,
            1 << 12,
            kv={"full": KVPagePool(pages + 1, 16), "swa": KVPagePool(pages + 1, 16)},
        )
    return AsyncReqToTokenPool(rows + 1, 1 << 12, kv=KVPagePool(pages + 1, 1))


def row_pages(pool: AsyncReqToTokenPool, group: str | None) -> RowPages:
    rp = pool._pages if group is None else pool._pages_or_none(group, "test")
    assert rp is not None
    return rp


def kv_pools(pool: AsyncReqToTokenPool) -> list[KVPagePool]:
    groups = pool.kv_groups
    if groups is not None:
        return [groups[name] for name in sorted(groups)]
    assert pool.kv is not None
    return [pool.kv]


def ledger_state(kv: KVPagePool) -> tuple[Any, ...]:
    """A page ledger's states, its free ring from the head and counters
    (not the ring's slots past its free ones, never read)."""
    snap = kv_snapshot(kv)
    led = kv.ledger
    ring = np.roll(led._ring, -led._head)[: led.free_count]
    return snap[0], snap[1], snap[3], ring.tobytes(), snap[6:9]


def table(pool: AsyncReqToTokenPool, row: int, group: str | None = None) -> list[int]:
    """The row's positions read without lending a view (a fresh table)."""
    t, counts = pool.pages_of_rows([row], group=group)
    return ids(t)[: int(counts[0])]


def whole_record_checks(rp: RowPages) -> None:
    """The twin's drops check each dropping row's whole record first, as
    every drop did before."""
    prepare = rp.prepare_free

    def prepare_free(rows: Any, uses: Any, keeps: Any = None, belows: Any = None) -> Any:
        if belows is not None:
            for row, below in zip(rows, belows, strict=True):
                if rp.owned[row] is not None and below > rp.holes.get(row, 0):
                    rp.check_record(row)
        return prepare(rows, uses, keeps, belows)

    rp.prepare_free = prepare_free  # type: ignore[method-assign]


@pytest.mark.parametrize("rows", [1, ROWS])
@pytest.mark.parametrize("grouped", [False, True], ids=["one-kv", "groups"])
async def test_a_write_into_a_kept_page_is_refused_where_it_is_given_back_not_at_the_drop(
    rows: int, grouped: bool
):
    """The drop gives back only its head, checked against the seal; the
    kept page written into (against the contract) is the row's still: the
    row's free, a drop past it and a trim of it refuse it, nothing changed,
    until it is restored."""
    group = "swa" if grouped else None
    pool = make(grouped)
    want: Any = {"full": 1, "swa": 6} if grouped else 6
    grants = [pool.try_admit(want) for _ in range(rows)]
    seq = [g.row for g in grants if g is not None]
    assert len(seq) == rows
    for row in seq:
        assert pool.extend(row, 1, group=group) is not None  # in a growth buffer
    victim = seq[-1]
    record = row_pages(pool, group).owned[victim]  # what a view handed out reads
    assert record is not None
    kept = int(record[4])
    record[4] = int(record[0])  # a kept page now lists a dropped one
    assert pool.drop_pages(seq, 2, group=group) == 2 * rows
    kvs = kv_pools(pool)
    before = ([kv_snapshot(kv) for kv in kvs], table(pool, victim, group))
    with pytest.raises(InvalidSlotError, match=f"row {victim}"):
        pool.free([victim])
    for calls in ([victim], seq):  # the loop for a few rows, the joined check for many
        with pytest.raises(InvalidSlotError, match=f"row {victim}"):
            pool.drop_pages(calls, 5, group=group)
        with pytest.raises(InvalidSlotError, match=f"row {victim}"):
            pool.trim_pages(calls, 4, group=group)
    if grouped:
        with pytest.raises(InvalidSlotError, match=f"row {victim}"):
            pool.drop_pages(seq, {"full": 1, "swa": 5})
    assert ([kv_snapshot(kv) for kv in kvs], table(pool, victim, group)) == before
    assert pool.drop_pages(seq, 4, group=group) == 2 * rows  # the written page kept still
    record[4] = kept  # restored (through the view the write went through)
    assert pool.drop_pages(seq, 5, group=group) == rows
    pool.check_invariants()
    pool.free(seq)
    assert all(kv.available_size() == kv.capacity for kv in kvs)
    pool.check_invariants()


async def test_a_trim_of_a_row_never_grown_cuts_its_seal_in_place_after_the_first():
    pool = make(False)
    rp = row_pages(pool, None)
    g = pool.try_admit(pages=12)
    assert g is not None
    assert rp.sealed[g.row].__class__ is bytes
    assert pool.trim_pages(g.row, 10) == 2
    seal = rp.sealed[g.row]
    assert seal.__class__ is bytearray
    for keep in (8, 5, 1):
        pool.trim_pages(g.row, keep)
        assert rp.sealed[g.row] is seal  # cut in place, not copied up to keep
        assert table(pool, g.row) == ids(g.pages)[:keep]
        pool.check_invariants()
    assert pool.drop_pages(g.row, 1) == 1
    assert table(pool, g.row) == [0]
    grown = pool.extend(g.row, 2)
    assert grown is not None
    assert table(pool, g.row) == [0, *ids(grown)]
    pool.free([g.row])
    pool.check_invariants()


def _run(seed: int, grouped: bool) -> None:
    rnd = random.Random(seed)
    pool, twin = make(grouped), make(grouped)
    names: list[str | None] = ["swa", "full"] if grouped else [None]
    for g in names:
        whole_record_checks(row_pages(twin, g))
    kvs, twin_kvs = kv_pools(pool), kv_pools(twin)
    shadow: dict[int, dict[str | None, list[int]]] = {}  # row: group: positions, dropped 0
    held: list[tuple[Any, list[int]]] = []  # views handed out and what they read
    fences: list[EventFence] = []  # drops left pending behind them

    def admit() -> None:
        counts = {g: rnd.randrange(0, 5) for g in names}
        want: Any = counts if grouped else counts[None]
        a, b = pool.try_admit(want), twin.try_admit(want)
        assert (a is None) == (b is None)
        if a is not None and b is not None:
            assert a.row == b.row
            got = a.pages if grouped else {None: a.pages}
            other = b.pages if grouped else {None: b.pages}
            shadow[a.row] = {g: ids(got[g]) for g in names}
            assert shadow[a.row] == {g: ids(other[g]) for g in names}
            held.extend((t, ids(t)) for t in got.values())

    def drop(rows: list[int], below: Any, group: str | None, fence: Any) -> None:
        if isinstance(below, dict):
            a = pool.drop_pages(rows, below, fence)
            b = twin.drop_pages(rows, below, fence)
        else:
            a = pool.drop_pages(rows, below, fence, group=group)
            b = twin.drop_pages(rows, below, fence, group=group)
        assert a == b
        plan = below if isinstance(below, dict) else {group: below}
        for g, value in plan.items():
            each = value if isinstance(value, list) else [value] * len(rows)
            for row, b_ in zip(rows, each, strict=True):
                shadow[row][g] = [0] * b_ + shadow[row][g][b_:]

    for _ in range(ROWS - 2):  # "every row" past _JOINED_CHECK, and room to admit
        admit()
    for _step in range(140):
        rows = sorted(shadow)
        g = names[0] if rnd.random() < 0.8 else names[-1]
        op = rnd.random()
        if not rows or op < 0.07:
            admit()
        elif op < 0.30:  # a window's step: grow, then drop what slid out
            pick = sorted(rnd.sample(rows, rnd.randrange(1, min(len(rows), 8) + 1)))
            k = rnd.randrange(1, 3)
            a, b = pool.extend_rows(pick, k, group=g), twin.extend_rows(pick, k, group=g)
            assert (a is None) == (b is None)
            if a is not None:
                got = ids(a)
                assert got == ids(b)
                held.append((a, got))
                for i, row in enumerate(pick):
                    shadow[row][g] += got[i * k : i * k + k]
                drop(pick, [pool.pages_dropped(r, group=g) + 1 for r in pick], g, None)
        elif op < 0.50:  # a slide of a few rows or every row, one below or one a row
            pick = rows if rnd.random() < 0.4 else sorted(rnd.sample(rows, min(len(rows), 3)))
            fence = None
            if rnd.random() < 0.3:
                fence = EventFence()
                fences.append(fence)
            if grouped and rnd.random() < 0.3:
                below: Any = {
                    n: [rnd.randrange(0, len(shadow[r][n]) + 1) for r in pick] for n in names
                }
            elif rnd.random() < 0.5:
                below = [rnd.randrange(0, len(shadow[r][g]) + 1) for r in pick]
            else:
                below = rnd.randrange(0, min(len(shadow[r][g]) for r in pick) + 1)
            drop(pick, below, g, fence)
        elif op < 0.60:  # a rollback
            pick = sorted(rnd.sample(rows, min(len(rows), 3)))
            keeps = [max(0, len(shadow[r][g]) - rnd.randrange(0, 4)) for r in pick]
            a_ = pool.trim_pages(pick, keeps, group=g)
            assert a_ == twin.trim_pages(pick, keeps, group=g)
            for row, keep in zip(pick, keeps, strict=True):
                shadow[row][g] = shadow[row][g][:keep]
        elif op < 0.68:  # a step's block table, held across later steps
            row = rnd.choice(rows)
            for p in (pool, twin):
                view = p.pages_of(row, host=rnd.random() < 0.5, group=g)
                held.append((view, ids(view)))
        elif op < 0.80:  # a write into a kept page: the drop is the twin's
            row = rnd.choice(rows)
            live = [i for i, page in enumerate(shadow[row][g]) if page]
            if len(live) < 2:
                continue
            at, below = live[-1], rnd.randrange(live[0] + 1, live[-1] + 1)
            record = row_pages(pool, g).owned[row]
            assert record is not None
            first = live[0]
            place = at - first  # the record lists the live positions only
            written = record[place] = shadow[row][g][first]  # a page the drop gives back
            pick = rows if rnd.random() < 0.5 else [row]
            drop(pick, [below if r == row else 0 for r in pick], g, None)
            snap = [ledger_state(kv) for kv in kvs]
            with pytest.raises(InvalidSlotError, match=f"row {row}"):
                pool.free([row])
            with pytest.raises(InvalidSlotError, match=f"row {row}"):
                pool.drop_pages(row, at + 1, group=g)
            assert [ledger_state(kv) for kv in kvs] == snap
            assert table(pool, row, g)[at] == written
            record[place] = shadow[row][g][at]  # restored
        elif op < 0.88:  # a write into a page the drop gives back: refused
            row = rnd.choice(rows)
            live = [i for i, page in enumerate(shadow[row][g]) if page]
            if len(live) < 2:
                continue
            record = row_pages(pool, g).owned[row]
            assert record is not None
            was = int(record[0])
            record[0] = int(record[len(live) - 1])
            snap = [ledger_state(kv) for kv in kvs]
            for pick in ([row], rows):
                with pytest.raises(InvalidSlotError, match=f"row {row}"):
                    pool.drop_pages(pick, [live[0] + 1 if r == row else 0 for r in pick], group=g)
            assert [ledger_state(kv) for kv in kvs] == snap
            record[0] = was
        elif op < 0.94 and fences:  # a step completes
            fences.pop(rnd.randrange(len(fences))).set()
            assert pool.reclaim() == twin.reclaim()  # a pool's page pools only read
        else:
            row = rnd.choice(rows)
            assert pool.free([row]) == twin.free([row])
            del shadow[row]
        for row, groups in shadow.items():
            for n, positions in groups.items():
                assert table(pool, row, n) == positions == table(twin, row, n)
                dropped = next((i for i, p in enumerate(positions) if p), len(positions))
                assert pool.pages_dropped(row, group=n) == dropped
        for kv, kv_twin in zip(kvs, twin_kvs, strict=True):
            assert kv.available_size() == kv_twin.available_size()
            assert kv.pending_size() == kv_twin.pending_size()
            assert ledger_state(kv) == ledger_state(kv_twin)
        for view, read in held:
            assert ids(view) == read
        pool.check_invariants()
        twin.check_invariants()
    for fence in fences:
        fence.set()
    assert pool.free(list(shadow)) == twin.free(list(shadow))
    assert pool.reclaim() == twin.reclaim()
    for kv, kv_twin in zip(kvs, twin_kvs, strict=True):
        assert kv.available_size() == kv.capacity == kv_twin.available_size()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("grouped", [False, True], ids=["one-kv", "groups"])
async def test_drops_trims_and_growths_match_the_twin_that_checks_whole_records(
    seed: int, grouped: bool
):
    _run(seed, grouped)
