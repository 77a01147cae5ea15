"""A free of nothing ``after=`` a stream records no fence on it.

A scheduler frees a step's finished requests every step, ``free(finished,
after=forward)``, and most steps finish none: each such call recorded a
fence (on CUDA, a pooled event recorded on the forward stream) that tied
nothing. Every free form skips the record when it has nothing to tie, and
still refuses an ``after=`` that is not a stream or a closed ``HostStream``
as before (checked first, changing nothing). The record is counted by the
stream's fence sequence: the next fence recorded by hand must be the one
right after the last.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import grouped_pool, kv_of

from asyncpool import AsyncReqToTokenPool, HostStream, KVPagePool, ReqToTokenPool


def _records(stream: HostStream, free: Callable[[], object]) -> int:
    """How many fences ``free()`` recorded on ``stream``."""
    before = stream.record().seq
    free()
    return stream.record().seq - before - 1


def _empties() -> list[Any]:
    return [[], (), torch.empty(0, dtype=torch.int64)]


@pytest.mark.parametrize("empty", _empties(), ids=["list", "tuple", "tensor"])
def test_sync_pool_empty_free_records_nothing(empty: Any) -> None:
    pool = ReqToTokenPool(5, 4)
    with HostStream() as s:
        assert _records(s, lambda: pool.free(empty, after=s)) == 0
        row = pool.alloc(1)
        assert row is not None
        assert _records(s, lambda: pool.free(row, after=s)) == 1  # not empty: it ties
    pool.check_invariants()


@pytest.mark.parametrize("empty", _empties(), ids=["list", "tuple", "tensor"])
async def test_rows_empty_free_records_nothing(empty: Any) -> None:
    async with AsyncReqToTokenPool(5, 4) as pool:
        with HostStream() as s:
            assert _records(s, lambda: pool.free(empty, after=s)) == 0
            rows = await pool.alloc(2)
            assert _records(s, lambda: pool.free(rows, after=s)) == 1
        pool.check_invariants()


@pytest.mark.parametrize("empty", _empties(), ids=["list", "tuple", "tensor"])
async def test_pool_with_pages_empty_free_records_nothing(empty: Any) -> None:
    async with AsyncReqToTokenPool(5, 4, kv=KVPagePool(9, 4)) as pool:
        with HostStream() as s:
            assert _records(s, lambda: pool.free(empty, after=s)) == 0
            grant = await pool.admit(2)
            assert _records(s, lambda: pool.free([grant.row], after=s)) == 1
        pool.check_invariants()


@pytest.mark.parametrize("empty", _empties(), ids=["list", "tuple", "tensor"])
async def test_grouped_pool_empty_free_records_nothing(empty: Any) -> None:
    async with grouped_pool() as pool:
        with HostStream() as s:
            assert _records(s, lambda: pool.free(empty, after=s)) == 0
            grant = await pool.admit({"swa": 1, "full": 2})
            assert _records(s, lambda: pool.free([grant.row], after=s)) == 1
        pool.check_invariants()


@pytest.mark.parametrize("empty", _empties(), ids=["list", "tuple", "tensor"])
def test_page_pool_empty_free_records_nothing(empty: Any) -> None:
    kv = KVPagePool(9, 4)
    with HostStream() as s:
        assert _records(s, lambda: kv.free(empty, after=s)) == 0
        pages = kv.alloc(2)
        assert pages is not None
        assert _records(s, lambda: kv.free(pages, after=s)) == 1
    kv.check_invariants()


async def test_empty_free_still_refuses_a_bad_after() -> None:
    async with AsyncReqToTokenPool(5, 4, kv=KVPagePool(9, 4)) as pool:
        closed = HostStream()
        closed.close()
        for free in (pool.free, kv_of(pool).free):
            with pytest.raises(TypeError, match="after="):
                free([], after=object())
            with pytest.raises(RuntimeError, match="closed"):
                free([], after=closed)
        pool.check_invariants()
