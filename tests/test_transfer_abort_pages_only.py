"""An abort mid-transfer that holds back only the pages (docs/cuda.md).

Found by a trial that ported a vLLM-shaped scheduler with a KV connector:
``pool.free([row], fence=transfer)``, the documented abort, ties the row to
the transfer as well as its pages, so a transfer that fails (routine in
disaggregated serving) quarantines a row for the pool's life although the
transfer only writes pages: with 2 rows, two failed loads of aborted
requests left the pool unable to admit anything. Detaching the pages first
and freeing them behind the transfer keeps the row in circulation. The
pool behaves as documented either way; these tests pin the idiom the docs
now name.
"""

from __future__ import annotations

import threading

import pytest
from helpers import bounded

from asyncpool import AsyncReqToTokenPool, KVPagePool


class Load:
    """A KV connector's load handle: lands or fails when the test says."""

    def __init__(self) -> None:
        self.state = "running"
        self.lock = threading.Lock()

    def query(self) -> bool:
        with self.lock:
            if self.state == "failed":
                raise RuntimeError("KV load failed")
            return self.state == "done"

    def synchronize(self) -> None:
        if not self.query():
            raise AssertionError("synchronize() before the test settled the load")


@pytest.mark.parametrize("outcome", ["failed", "done"])
async def test_detached_pages_wait_for_the_load_and_the_row_does_not(outcome: str) -> None:
    kv = KVPagePool(9, 4)
    pool = AsyncReqToTokenPool(3, 32, kv=kv)  # two rows
    grant = pool.try_admit(pages=8)
    assert grant is not None
    load = Load()
    pages = pool.detach_pages(grant.row, host=True)
    assert kv.free(pages, fence=load) == 0  # pending behind the load
    assert pool.free([grant.row]) == 1  # the row waits for nothing
    assert pool.available_size() == 2
    assert pool.try_admit(pages=1) is None  # the pages are still the load's
    load.state = outcome
    pool.reclaim()
    stats = pool.stats()
    assert stats.quarantined == 0 and pool.available_size() == 2
    if outcome == "failed":
        assert stats.pages_quarantined == 8 and kv.available_size() == 0
    else:
        assert stats.pages_quarantined == 0
        async with bounded():
            regrant = await pool.admit(pages=8)
        assert sorted(regrant.pages.tolist()) == sorted(pages.tolist())
    pool.check_invariants()


async def test_free_behind_a_failed_load_quarantines_the_row_too() -> None:
    # The documented abort, for contrast: row and pages both wait for the
    # load, and its fault takes both out of circulation for good.
    kv = KVPagePool(9, 4)
    pool = AsyncReqToTokenPool(3, 32, kv=kv)
    grant = pool.try_admit(pages=2)
    assert grant is not None
    load = Load()
    assert pool.free([grant.row], fence=load) == 0
    load.state = "failed"
    pool.reclaim()
    stats = pool.stats()
    assert stats.quarantined == 1 and stats.pages_quarantined == 2
    assert pool.available_size() == 1
    pool.check_invariants()
