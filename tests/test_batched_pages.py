"""Batched page calls: a step's block table in one call, every group's trim or drop in one.

A speculative-decoding engine (EAGLE/MTP) builds its block table from every
running request's pages each step and trims the rejected drafts' pages
after verify; on a hybrid model (full attention plus a sliding window) it
trims, and drops the window's early pages, in every KV group.

* ``pages_of_rows(rows)``: ``(table, counts)``, one line a row, what
  ``pages_of`` answers for it padded with page 0 (dropped positions read 0
  too), ``counts`` its positions; ``width=`` fixes the table's width. A
  fresh table, the caller's: writing into it changes nothing in the pool.
* ``trim_pages(rows, {group: keep})`` and ``drop_pages(rows, {group:
  below})``: every named group at once, as one call per group would, all
  checked before any group changes: bad input in any group is a typed error
  with every group exactly as it was.

Bad input: typed errors, and a full snapshot of the pool (stats, row
ledger, every group's page ledger, every row's positions in every group)
equal before and after.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from helpers import FakeStream, kv_snapshot, page_ids, pool_snapshot
from helpers import grouped_pool as grouped
from helpers import kv_group as kv

from asyncpool import (
    AsyncReqToTokenPool,
    CapacityError,
    InvalidSlotError,
    KVPagePool,
    WrongThreadError,
)


def single(pages: int = 24, rows: int = 6) -> AsyncReqToTokenPool:
    return AsyncReqToTokenPool(rows + 1, 64, kv=KVPagePool(pages + 1, 4))


def full_state(pool: AsyncReqToTokenPool) -> tuple[Any, ...]:
    """Everything a refused call must leave as it was: the pool's stats and
    row ledger, each page pool's whole ledger (states, free ring, pending
    batches), and every allocated row's positions and dropped count in
    every group (records and seals)."""
    rows = pool._ledger.allocated_rows()
    groups: dict[Any, KVPagePool] = dict(pool.kv_groups or {})
    if not groups and pool.kv is not None:
        groups = {None: pool.kv}
    per = []
    for name, one in groups.items():
        rp = pool._groups[name] if name is not None else pool._pages  # type: ignore[index]
        assert rp is not None
        per.append(
            (
                name,
                kv_snapshot(one),
                tuple(
                    (
                        r,
                        page_ids(pool.pages_of(r, group=name)),
                        pool.pages_dropped(r, group=name),
                        rp.sealed[r] and bytes(rp.sealed[r]),
                    )
                    for r in rows
                ),
            )
        )
    return pool_snapshot(pool), tuple(per)


async def _admitted(pool: AsyncReqToTokenPool, counts: list[Any]) -> list[int]:
    return [(await pool.admit(c)).row for c in counts]


# ---------------------------------------------------------------- pages_of_rows


async def test_pages_of_rows_is_pages_of_per_row_padded_with_page_zero() -> None:
    pool = single()
    rows = await _admitted(pool, [3, 0, 5, 1])
    grown = pool.extend_rows([rows[1], rows[3]], [2, 1])
    assert grown is not None
    order = [rows[2], rows[0], rows[3], rows[1]]  # the caller's order, not the rows'
    table, counts = pool.pages_of_rows(order)
    assert table.dtype == counts.dtype == torch.int64
    assert table.shape == (4, 5) and counts.shape == (4,)
    for i, row in enumerate(order):
        own = page_ids(pool.pages_of(row))
        assert page_ids(table[i]) == own + [0] * (5 - len(own))
        assert int(counts[i]) == len(own)
    assert counts.tolist() == [5, 3, 2, 2]
    # A fixed width (a CUDA graph's table), rows as a tensor, host=True.
    wide, again = pool.pages_of_rows(torch.tensor(order), width=7, host=True)
    assert wide.shape == (4, 7) and torch.equal(wide[:, :5], table)
    assert not wide[:, 5:].any() and torch.equal(again, counts)
    # No rows: a (0, width) table.
    empty, none = pool.pages_of_rows([], width=3)
    assert empty.shape == (0, 3) and none.shape == (0,)
    assert pool.pages_of_rows([])[0].shape == (0, 0)
    # One row that owns nothing.
    only, n = pool.pages_of_rows([(await pool.admit(0)).row])
    assert only.shape == (1, 0) and n.tolist() == [0]
    pool.check_invariants()


async def test_pages_of_rows_reads_dropped_positions_as_page_zero() -> None:
    pool = single()
    a, b, c = await _admitted(pool, [4, 3, 2])
    whole_a = page_ids(pool.pages_of(a))
    whole_b = page_ids(pool.pages_of(b))
    pool.drop_pages([a, b], [2, 3])  # b: every page dropped, 3 positions kept
    pool.trim_pages(c, 1)
    table, counts = pool.pages_of_rows([a, b, c])
    assert counts.tolist() == [4, 3, 1]
    assert page_ids(table[0]) == [0, 0, *whole_a[2:]]
    assert page_ids(table[1]) == [0, 0, 0, 0]
    assert page_ids(table[2])[:1] == page_ids(pool.pages_of(c)) and page_ids(table[2])[1:] == [
        0,
        0,
        0,
    ]
    for i, row in enumerate([a, b, c]):
        own = page_ids(pool.pages_of(row))
        assert page_ids(table[i])[: len(own)] == own
    assert whole_b  # pages it had
    pool.check_invariants()


async def test_the_table_is_the_callers_to_write_into() -> None:
    pool = single()
    rows = await _admitted(pool, [2, 3])
    before = full_state(pool)
    table, counts = pool.pages_of_rows(rows, host=True)
    table.fill_(7)  # slot arithmetic in place, say: not the pool's record
    counts.fill_(9)
    assert full_state(pool) == before
    assert pool.free(rows) == 2  # the records are as sealed: the free goes through
    pool.check_invariants()


async def test_pages_of_rows_takes_a_group_on_a_grouped_pool() -> None:
    pool = grouped(rows=4, swa=8, full=12)
    a = await pool.admit({"swa": 1, "full": 3})
    b = await pool.admit({"swa": 2, "full": 1})
    for name in ("swa", "full"):
        table, counts = pool.pages_of_rows([a.row, b.row], group=name)
        for i, g in enumerate((a, b)):
            own = page_ids(g.pages[name])
            assert page_ids(table[i])[: len(own)] == own
            assert not table[i, len(own) :].any() and int(counts[i]) == len(own)
    with pytest.raises(ValueError, match="name one with group="):
        pool.pages_of_rows([a.row])
    with pytest.raises(ValueError, match="unknown KV group"):
        pool.pages_of_rows([a.row], group="mamba")
    with pytest.raises(ValueError, match="this pool has none"):
        single().pages_of_rows([], group="swa")


async def test_pages_of_rows_on_a_pool_without_kv_is_zeros() -> None:
    pool = AsyncReqToTokenPool(4, 8)
    rows = await pool.alloc(2)
    table, counts = pool.pages_of_rows(rows, width=3)
    assert table.shape == (2, 3) and not table.any() and counts.tolist() == [0, 0]
    assert pool.pages_of_rows(rows)[0].shape == (2, 0)
    with pytest.raises(CapacityError, match="cannot be made"):
        pool.pages_of_rows(rows, width=10**18)  # a typed error, not numpy's


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ("dup", InvalidSlotError, "appears twice"),
        ("zero", InvalidSlotError, "row 0"),
        ("free", InvalidSlotError, "never allocated"),
        ("set", InvalidSlotError, "order"),
        ("bool", InvalidSlotError, "integers"),
        ("width -1", CapacityError, ">= 0"),
        ("width 1.5", CapacityError, "width"),
        ("width True", CapacityError, "width"),
        ("width [4]", CapacityError, "width"),
        ("width 2", CapacityError, "past the table's width 2"),
        ("width huge", CapacityError, "cannot be made"),
    ],
)
async def test_pages_of_rows_refuses_bad_input_changing_nothing(
    args: str, error: type[Exception], match: str
) -> None:
    pool = single()
    a, b = await _admitted(pool, [3, 1])
    pool.drop_pages(a, 1)
    calls = {
        "dup": lambda: pool.pages_of_rows([a, a]),
        "zero": lambda: pool.pages_of_rows([a, 0]),
        "free": lambda: pool.pages_of_rows([a, 5]),
        "set": lambda: pool.pages_of_rows({a, b}),
        "bool": lambda: pool.pages_of_rows([True]),
        "width -1": lambda: pool.pages_of_rows([a], width=-1),
        "width 1.5": lambda: pool.pages_of_rows([a], width=1.5),  # type: ignore[arg-type]
        "width True": lambda: pool.pages_of_rows([a], width=True),
        "width [4]": lambda: pool.pages_of_rows([a], width=[4]),  # type: ignore[arg-type]
        "width 2": lambda: pool.pages_of_rows([b, a], width=2),  # a has 3 positions
        "width huge": lambda: pool.pages_of_rows([a, b], width=10**18),  # no such memory
    }
    before = full_state(pool)
    with pytest.raises(error, match=match):
        calls[args]()
    assert full_state(pool) == before
    assert pool.pages_of_rows([a, b], width=np.int64(3))[1].tolist() == [3, 1]


async def test_pages_of_rows_agrees_with_pages_of_over_random_histories() -> None:
    rng = np.random.default_rng(7)
    pool = single(pages=60, rows=10)
    live: list[int] = []
    for _ in range(300):
        op = rng.integers(6)
        if op == 0 and len(live) < 10:
            g = pool.try_admit(int(rng.integers(0, 4)))
            if g is not None:
                live.append(g.row)
        elif op == 1 and live:
            pool.extend_rows(live, [int(x) for x in rng.integers(0, 3, len(live))])
        elif op == 2 and live:
            row = live[int(rng.integers(len(live)))]
            pool.drop_pages(row, int(rng.integers(0, pool.pages_of(row).shape[0] + 1)))
        elif op == 3 and live:
            pool.trim_pages(live, [int(x) for x in rng.integers(0, 6, len(live))])
        elif op == 4 and live:
            pool.free(live.pop(int(rng.integers(len(live)))))
        order = list(rng.permutation(live))
        table, counts = pool.pages_of_rows(order)
        for i, row in enumerate(order):
            own = page_ids(pool.pages_of(int(row)))
            assert int(counts[i]) == len(own)
            assert page_ids(table[i]) == own + [0] * (table.shape[1] - len(own))
    pool.check_invariants()


# ---------------------------------------------------------------- grouped trim and drop


def _twins() -> tuple[AsyncReqToTokenPool, AsyncReqToTokenPool]:
    return grouped(rows=4, swa=12, full=16), grouped(rows=4, swa=12, full=16)


async def _same_history(pools: tuple[AsyncReqToTokenPool, ...]) -> list[int]:
    rows: list[int] = []
    for pool in pools:
        rows = await _admitted(
            pool, [{"swa": 3, "full": 4}, {"swa": 2, "full": 2}, {"swa": 1, "full": 3}]
        )
        assert pool.extend_rows(rows, {"swa": [1, 2, 0], "full": 1}) is not None
    return rows


async def test_grouped_trim_is_one_trim_per_group_in_one_call() -> None:
    one, looped = _twins()
    rows = await _same_history((one, looped))
    keeps = {"swa": [2, 1, 0], "full": 3}
    assert one.trim_pages(rows, keeps) == 2 + 3 + 1 + 2 + 0 + 1
    for name, keep in keeps.items():
        looped.trim_pages(rows, keep, group=name)
    assert full_state(one) == full_state(looped)
    assert page_ids(one.pages_of(rows[2], group="swa")) == []
    # A group left out keeps every page.
    assert one.trim_pages(rows, {"full": 1}) == 2 + 2 + 2
    assert [len(one.pages_of(r, group="swa")) for r in rows] == [2, 1, 0]
    assert [len(one.pages_of(r, group="full")) for r in rows] == [1, 1, 1]
    # Nothing to trim anywhere: 0, nothing changed.
    before = full_state(one)
    assert one.trim_pages(rows, {"swa": 5, "full": np.int64(5)}) == 0
    assert one.trim_pages(rows, {}) == 0
    assert full_state(one) == before
    one.check_invariants()


async def test_grouped_drop_is_one_drop_per_group_in_one_call() -> None:
    one, looped = _twins()
    rows = await _same_history((one, looped))
    belows = {"swa": [2, 4, 1], "full": torch.tensor([0, 1, 0])}
    assert one.drop_pages(rows, belows) == 2 + 4 + 1 + 0 + 1 + 0
    for name, below in belows.items():
        looped.drop_pages(rows, below, group=name)
    assert full_state(one) == full_state(looped)
    assert [one.pages_dropped(r, group="swa") for r in rows] == [2, 4, 1]
    # A trim with keep under the dropped count, in both groups at once.
    assert one.trim_pages(rows, {"swa": 1, "full": 0}) == (2 + 0 + 0) + (5 + 2 + 4)
    looped.trim_pages(rows, 1, group="swa")
    looped.trim_pages(rows, 0, group="full")
    assert full_state(one) == full_state(looped)
    assert [one.pages_dropped(r, group="swa") for r in rows] == [1, 1, 1]
    one.check_invariants()


async def test_grouped_give_back_waits_behind_the_rows_fences_with_one_after() -> None:
    pool = grouped(rows=4, swa=12, full=16)
    rows = await _admitted(pool, [{"swa": 3, "full": 4}, {"swa": 2, "full": 2}])
    step, extra = FakeStream(), FakeStream()
    pool.record_use(rows, step.record())
    assert pool.trim_pages(rows, {"swa": 1, "full": [2, 1]}, fence=extra.record()) == 0
    assert pool.drop_pages(rows, {"swa": 1}) == 0
    swa, full = kv(pool, "swa"), kv(pool, "full")
    assert (swa.pending_size(), full.pending_size()) == (3 + 2, 2 + 1)
    # The trim waits for the step and `extra`; the drop for the step only.
    step.complete()
    pool.reclaim()
    assert (swa.pending_size(), full.pending_size()) == (3, 3)
    assert (swa.available_size(), full.available_size()) == (12 - 5 + 2, 16 - 6)
    extra.complete()
    pool.reclaim()
    assert (swa.pending_size(), full.pending_size()) == (0, 0)
    assert (swa.available_size(), full.available_size()) == (12, 16 - 3)
    pool.check_invariants()
    pool.free(rows)


async def test_grouped_trim_records_one_after_fence_for_every_group(kit: Any) -> None:
    pool = grouped(rows=4, swa=12, full=16)
    rows = await _admitted(pool, [{"swa": 3, "full": 4}])
    stream = kit.stream()
    gate = kit.gate(stream)
    assert pool.trim_pages(rows, {"swa": 1, "full": 1}, after=stream) == 0
    swa, full = kv(pool, "swa"), kv(pool, "full")
    assert (swa.pending_size(), full.pending_size()) == (2, 3)
    pending = [b.fence for led in (swa.ledger, full.ledger) for b in led._unordered]
    pending += [
        b.fence for led in (swa.ledger, full.ledger) for q in led._streams.values() for b in q
    ]
    assert len({id(f) for f in pending}) == 1  # one fence recorded on `after`
    gate.open()
    stream.synchronize()
    pool.reclaim()
    assert swa.available_size() == 11 and full.available_size() == 15
    pool.free(rows)


def _bad_give_backs(
    pool: AsyncReqToTokenPool, rows: list[int], free_row: int
) -> dict[str, tuple[Any, type[Exception], str]]:
    a, b = rows
    return {
        "trim: bad keep in the second group": (
            lambda: pool.trim_pages(rows, {"swa": 0, "full": [1, -1]}),
            CapacityError,
            "KV group 'full'.*>= 0",
        ),
        "trim: too few keeps": (
            lambda: pool.trim_pages(rows, {"swa": 0, "full": [1]}),
            CapacityError,
            "KV group 'full'",
        ),
        "trim: a float": (
            lambda: pool.trim_pages(rows, {"full": 0, "swa": 1.5}),
            CapacityError,
            "KV group 'swa'",
        ),
        "trim: a row not allocated": (
            lambda: pool.trim_pages([a, free_row], {"swa": 0, "full": 0}),
            InvalidSlotError,
            "not allocated",
        ),
        "trim: a row twice": (
            lambda: pool.trim_pages([a, a], {"swa": 0, "full": 0}),
            InvalidSlotError,
            "twice",
        ),
        "trim: a set with keeps per row": (
            lambda: pool.trim_pages({a, b}, {"swa": [0, 0]}),
            InvalidSlotError,
            "order",
        ),
        "trim: a non-fence": (
            lambda: pool.trim_pages(rows, {"swa": 0}, fence=object()),  # type: ignore[arg-type]
            TypeError,
            "fence",
        ),
        "trim: a record written into in the second group": (
            lambda: _written(pool, b, "full", lambda: pool.trim_pages(rows, {"swa": 0, "full": 0})),
            InvalidSlotError,
            "written into",
        ),
        "trim: unknown group": (
            lambda: pool.trim_pages(rows, {"swa": 0, "mamba": 0}),
            ValueError,
            "unknown KV group 'mamba'",
        ),
        "trim: group= with a mapping": (
            lambda: pool.trim_pages(rows, {"swa": 0}, group="swa"),
            ValueError,
            "one or the other",
        ),
        "drop: past a row's positions in the second group": (
            lambda: pool.drop_pages(rows, {"swa": 1, "full": [1, 9]}),
            CapacityError,
            "KV group 'full'.*row",
        ),
        "drop: a bool": (
            lambda: pool.drop_pages(rows, {"swa": True}),
            CapacityError,
            "KV group 'swa'",
        ),
        "drop: a record written into in the second group": (
            lambda: _written(pool, a, "full", lambda: pool.drop_pages(rows, {"swa": 1, "full": 1})),
            InvalidSlotError,
            "written into",
        ),
        "drop: a row not allocated": (
            lambda: pool.drop_pages([free_row], {"swa": 0}),
            InvalidSlotError,
            "not allocated",
        ),
    }


def _written(pool: AsyncReqToTokenPool, row: int, group: str, call: Any) -> Any:
    """Run ``call`` with ``row``'s record in ``group`` written into (against
    the contract), and restore it whatever happens."""
    record = pool.pages_of(row, group=group, host=True)
    was = int(record[0])
    record[0] = 0
    try:
        return call()
    finally:
        record[0] = was


async def _bad_pool() -> tuple[AsyncReqToTokenPool, list[int], int, FakeStream]:
    pool = grouped(rows=4, swa=12, full=16)
    rows = await _admitted(pool, [{"swa": 3, "full": 4}, {"swa": 2, "full": 2}])
    gone = (await pool.admit({"swa": 1, "full": 1})).row
    step = FakeStream()
    pool.record_use(rows, step.record())
    pool.drop_pages(rows, {"swa": 1}, fence=step.record())  # some pages pending, a hole each
    pool.free(gone)
    return pool, rows, gone, step


_BAD_NAMES = [
    "trim: bad keep in the second group",
    "trim: too few keeps",
    "trim: a float",
    "trim: a row not allocated",
    "trim: a row twice",
    "trim: a set with keeps per row",
    "trim: a non-fence",
    "trim: a record written into in the second group",
    "trim: unknown group",
    "trim: group= with a mapping",
    "drop: past a row's positions in the second group",
    "drop: a bool",
    "drop: a record written into in the second group",
    "drop: a row not allocated",
]


@pytest.mark.parametrize("name", _BAD_NAMES)
async def test_grouped_give_back_refuses_bad_input_in_any_group_changing_nothing(
    name: str,
) -> None:
    pool, rows, gone, step = await _bad_pool()
    call, error, match = _bad_give_backs(pool, rows, gone)[name]
    before = full_state(pool)
    with pytest.raises(error, match=match):
        call()
    assert full_state(pool) == before
    step.complete()
    pool.free(rows)
    pool.check_invariants()


def test_every_bad_give_back_is_parametrised() -> None:
    assert sorted(_bad_give_backs(grouped(), [1, 2], 3)) == sorted(_BAD_NAMES)


async def test_a_mapping_on_a_pool_without_groups_is_refused() -> None:
    pool = single()
    (row,) = await _admitted(pool, [2])
    before = full_state(pool)
    for call in (pool.trim_pages, pool.drop_pages):
        with pytest.raises(ValueError, match="no KV groups"):
            call([row], {"swa": 0})
    assert full_state(pool) == before
    bare = AsyncReqToTokenPool(4, 8)
    rows = await bare.alloc(1)
    with pytest.raises(CapacityError, match="no KV pages"):
        bare.trim_pages(rows, {"swa": 0})
    with pytest.raises(CapacityError, match="no KV pages"):
        bare.drop_pages(rows, {"swa": 0})


@pytest.mark.parametrize("call", ["pages_of_rows", "trim", "drop"])
async def test_the_batched_calls_refuse_a_foreign_thread(call: str) -> None:
    from helpers import in_thread

    pool = grouped()
    g = await pool.admit({"swa": 2, "full": 2})
    calls = {
        "pages_of_rows": lambda: pool.pages_of_rows([g.row], group="swa"),
        "trim": lambda: pool.trim_pages([g.row], {"swa": 0, "full": 0}),
        "drop": lambda: pool.drop_pages([g.row], {"swa": 1}),
    }
    before = full_state(pool)

    def attempt() -> Any:
        try:
            calls[call]()
        except WrongThreadError as exc:
            return exc
        return None

    assert isinstance(in_thread(attempt), WrongThreadError)
    assert full_state(pool) == before
