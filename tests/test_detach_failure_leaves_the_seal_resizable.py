"""A detach whose tensor raises leaves the row's seal resizable.

``detach_pages`` makes the caller's tensor before anything changes: if that
raises (on CUDA, a staging or device allocation), the row keeps its pages.
It used to hold a numpy view of the row's seal while it made the tensor, so
the raised error's traceback, alive while the caller handles it (an
``except`` block that falls back to trimming or growing the row, or an
error kept for a log), pinned the seal's buffer. A seal grown in place (a
bytearray since the row's first growth, or since perfdrop's change its
first trim or drop) cannot be resized while a view of it lives: the row's
next growth raised ``BufferError`` with the pages taken and the record
grown but the seal not, and a trim or a drop with the pages freed but the
record and seal not cut (the invariants broken, the row's free refused for
good). Found by review57's sweep of perfdrop's seal changes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import page_ids as ids

from asyncpool import AsyncReqToTokenPool, KVPagePool


def _fail_detach_once(monkeypatch: pytest.MonkeyPatch, pool: AsyncReqToTokenPool) -> None:
    """Make the next detach make its tensor through ``out`` (as on CUDA),
    and that raise, once."""
    rp = pool._pages
    assert rp is not None
    real = rp.out
    monkeypatch.setattr(rp, "_on_host", False)  # no remembered host tensor: out() first

    def fail(*args: Any, **kwargs: Any) -> torch.Tensor:
        monkeypatch.setattr(rp, "out", real)
        monkeypatch.setattr(rp, "_on_host", True)
        raise torch.OutOfMemoryError("no memory for the detached pages")

    monkeypatch.setattr(rp, "out", fail)


# How the row's seal became a bytearray before the detach fails.
SEALS = {
    "trimmed": lambda pool, row: pool.trim_pages(row, 5),  # never grown (perfdrop)
    "dropped": lambda pool, row: pool.drop_pages(row, 1),
    "grown": lambda pool, row: pool.extend(row, 1),
}
# What the caller does with the row while it handles the error, and the
# positions it leaves (None: what the growth adds).
NEXT = {
    "extend": lambda pool, row: pool.extend(row, 2),
    "trim": lambda pool, row: pool.trim_pages(row, 3),
    "drop": lambda pool, row: pool.drop_pages(row, pool.pages_dropped(row) + 1),
}


@pytest.mark.parametrize("then", NEXT)
@pytest.mark.parametrize("seal", SEALS)
async def test_the_row_grows_trims_and_drops_while_the_detach_error_is_handled(
    monkeypatch: pytest.MonkeyPatch, seal: str, then: str
) -> None:
    pool = AsyncReqToTokenPool(4, 8, kv=KVPagePool(33, 1))
    grant = pool.try_admit(pages=6)
    assert grant is not None
    row = grant.row
    SEALS[seal](pool, row)
    assert pool._pages is not None
    assert pool._pages.sealed[row].__class__ is bytearray
    before = pool.pages_of_rows([row])[0].tolist()
    _fail_detach_once(monkeypatch, pool)
    try:
        pool.detach_pages(row)
    except torch.OutOfMemoryError:
        assert pool.pages_of_rows([row])[0].tolist() == before  # the row kept its pages
        got = NEXT[then](pool, row)  # the error (and its traceback) still alive here
        pool.check_invariants()
    else:
        raise AssertionError("the detach did not raise")
    positions = before[0]
    if then == "extend":
        assert got is not None
        assert pool.pages_of_rows([row])[0].tolist()[0] == positions + ids(got)
    pool.free([row])
    pool.check_invariants()
    assert pool.kv is not None and pool.kv.available_size() == pool.kv.capacity
