"""Gaps found by a mechanical mutation sweep of ``asyncpool/row_pages.py``.

Each test pins one behaviour that an ``ast``-generated mutant of
``row_pages.py`` broke while every test file that exercises the module
still passed:

* a page count given as an integer scalar (numpy, a 0-d tensor) may be
  exactly the KV pool's capacity, as a Python int may: ``admit`` and
  ``extend`` take the whole pool (the mutant refused ``k == capacity`` on
  the scalar path only);
* ``detach_pages`` of a row that owns no pages (admitted with none, or
  detached already) hands back an empty int64 tensor and changes nothing
  (the mutants returned None, or reached the seal of a row without one);
* ``trim_pages`` leaves a row that owns ``keep`` pages or fewer as it is
  whichever path the call takes: given in a list (or with ``after=``),
  such a row's record is not checked, so a record written into does not
  refuse a call that does not touch it, and nothing is recorded on
  ``after`` when nothing is trimmed, as for ``trim_pages(row, keep)``
  (the mutant checked and recorded for rows it left alone).

Async tests run on asyncio and uvloop (conftest); every wait that could hang
is bounded.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import Streams, bounded, kv_pool_state
from helpers import page_ids as ids

from asyncpool import AsyncReqToTokenPool, KVPagePool


def make(rows: int = 4, pages: int = 8) -> AsyncReqToTokenPool:
    return AsyncReqToTokenPool(rows + 1, 64, kv=KVPagePool(pages + 1, 4))


@pytest.mark.parametrize("scalar", [np.int64, torch.tensor], ids=["numpy", "tensor"])
async def test_a_scalar_page_count_may_be_the_whole_pool(scalar: type) -> None:
    async with make(rows=2, pages=8) as pool:
        kv = pool.kv
        assert kv is not None
        async with bounded():
            g = await pool.admit(pages=scalar(kv.capacity))
        assert len(ids(g.pages)) == kv.capacity
        pool.free([g.row])
        async with bounded():
            empty = await pool.admit(pages=0)
        got = pool.extend(empty.row, scalar(kv.capacity))
        assert got is not None and len(ids(got)) == kv.capacity
        pool.free([empty.row])
        pool.check_invariants()
        kv.check_invariants()


async def test_detaching_a_row_without_pages_gives_an_empty_tensor() -> None:
    async with make(rows=2, pages=4) as pool:
        async with bounded():
            empty = await pool.admit(pages=0)
            g = await pool.admit(pages=3)
        before = kv_pool_state(pool)
        out = pool.detach_pages(empty.row)
        assert isinstance(out, torch.Tensor)
        assert out.dtype == torch.int64 and out.shape == (0,)
        assert kv_pool_state(pool) == before
        taken = pool.detach_pages(g.row)
        assert sorted(ids(taken)) == sorted(ids(g.pages))
        again = pool.detach_pages(g.row)  # detached already: owns none now
        assert isinstance(again, torch.Tensor) and again.shape == (0,)
        pool.check_invariants()
        kv = pool.kv
        assert kv is not None
        kv.free(taken)
        pool.free([empty.row, g.row])
        pool.check_invariants()
        kv.check_invariants()


async def test_a_trim_in_a_list_leaves_a_row_owning_no_more_than_keep_alone(
    kit: Streams,
) -> None:
    stream = kit.stream()
    async with make(rows=2, pages=8) as pool:
        async with bounded():
            short = await pool.admit(pages=2)
            long = await pool.admit(pages=4)
        record = pool.pages_of(short.row)
        first = int(record[0])
        record[0] = int(long.pages[3])  # written into, against the contract
        # The one-row call leaves the row alone without reading its record:
        assert pool.trim_pages(short.row, 2) == 0
        # and so does the list form, which trims the other row.
        assert pool.trim_pages([short.row, long.row], 2) == 2
        assert ids(pool.pages_of(long.row)) == ids(long.pages)[:2]
        # Nothing to trim: nothing recorded on `after`, as for a bad call.
        seq = stream.record().seq
        assert pool.trim_pages([short.row, long.row], 2, after=stream) == 0
        assert pool.trim_pages(short.row, 5, after=stream) == 0
        assert stream.record().seq == seq + 1
        record[0] = first  # restored
        pool.free([short.row, long.row])
        pool.check_invariants()
        kv = pool.kv
        assert kv is not None
        kv.check_invariants()


def _corrupt(pool: AsyncReqToTokenPool, how: str, a: int, b: int, spare: int) -> str:
    """Break one invariant of the pool's row pages, so that exactly one of
    ``check_invariants``' checks can see it; returns what it must say."""
    rp = pool._pages
    assert rp is not None
    rec = rp.owned[a]
    assert rec is not None
    if how == "seal without pages":
        rp.sealed[spare] = b""
        return "owns no pages but has a seal"
    if how == "buffer without pages":
        rp.grown[spare] = np.zeros(4, dtype=np.int64)
        return "owns no pages but has a seal or buffer"
    if how == "pages of a free row":  # a's pages moved, whole, to a free row
        rp.owned[spare], rp.sealed[spare], rp.grown[spare] = rec, rp.sealed[a], rp.grown[a]
        rp.owned[a] = rp.sealed[a] = rp.grown[a] = None
        return "is not allocated"
    if how == "strided record":  # the same ids, every other int64
        rp.owned[a] = np.repeat(rec, 2)[::2]
        rp.grown[a] = None
        return "not a 1-D contiguous int64 array"
    if how == "foreign buffer":
        rp.grown[a] = np.zeros(len(rec), dtype=np.int64)
        return "not a view of its buffer"
    other = rp.owned[b]
    assert other is not None
    if how == "a page in two rows":  # b lists one of a's pages instead of its own
        forged = other.copy()
        forged[0] = rec[0]
        rp.owned[b], rp.sealed[b], rp.grown[b] = forged, forged.tobytes(), None
        return "owned by two rows"
    assert how == "a free page in a row"  # a lists a free page instead of its own
    kv = pool.kv
    assert kv is not None
    held = set(rec.tolist()) | set(other.tolist())
    free_page = next(p for p in range(1, kv.capacity + 1) if p not in held)
    forged = rec.copy()
    forged[0] = free_page
    rp.owned[a], rp.sealed[a], rp.grown[a] = forged, forged.tobytes(), None
    return "is owned by a row but is free"


@pytest.mark.parametrize(
    "how",
    [
        "seal without pages",
        "buffer without pages",
        "pages of a free row",
        "strided record",
        "foreign buffer",
        "a page in two rows",
        "a free page in a row",
    ],
)
async def test_check_invariants_sees_each_broken_row_pages_invariant(how: str) -> None:
    """``check_invariants`` is the proof the other tests lean on: each
    check of the row pages catches its own corruption (the others pass)."""
    async with make(rows=3, pages=12) as pool:
        async with bounded():
            a = await pool.admit(pages=2)
            b = await pool.admit(pages=2)
        assert pool.extend(a.row, 1) is not None  # a's record in a growth buffer
        spare = next(r for r in range(1, 4) if r not in (a.row, b.row))
        pool.check_invariants()
        rp = pool._pages
        assert rp is not None
        saved = (list(rp.owned), list(rp.sealed), list(rp.grown))
        message = _corrupt(pool, how, a.row, b.row, spare)
        try:
            with pytest.raises(AssertionError, match=message):
                pool.check_invariants()
        finally:
            rp.owned[:], rp.sealed[:], rp.grown[:] = saved
        pool.check_invariants()
        pool.free([a.row, b.row])
