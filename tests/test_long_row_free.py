"""Freeing a long row's pages checks their state, not their distinctness.

A row's record is sealed: its ids are distinct and in range by
construction (``RowPages``), and its free compares the record with the
seal first. The no-fence fast free of one row then only checks that each
page is still OWNED (``PageLedger.free_owned``), but a free behind a
recorded use (every free in an overlap loop) or of a row given as an int
ran the page ledger's full check of arbitrary input: distinctness by a
scatter and a gather of the whole record, about half of the free of a
128k-page row (page_size 1, a long context) and twice its allocations.
Now one row's record of more than a few pages gets the state check only,
on every path; a page not OWNED any more is still refused, with the
checked path's error, nothing changed.
"""

from __future__ import annotations

import pytest
from helpers import kv_of

from asyncpool import AsyncReqToTokenPool, DoubleFreeError, HostStream, KVPagePool
from asyncpool.kv_pages import PageLedger

PAGES = 4096


def _long_row_pool() -> tuple[AsyncReqToTokenPool, int]:
    pool = AsyncReqToTokenPool(4, 8, kv=KVPagePool(PAGES + 8, 1))
    grant = pool.try_admit(pages=0)
    assert grant is not None
    for _ in range(8):  # chunked prefill: the row grows chunk by chunk
        assert pool.extend(grant.row, PAGES // 8) is not None
    return pool, grant.row


def _count_checked(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many ids the page ledger's full check (distinctness included) saw."""
    seen: list[int] = []
    original = PageLedger._checked

    def spy(self: PageLedger, arr: object, *args: object, **kwargs: object) -> object:
        seen.append(len(arr))  # type: ignore[arg-type]
        return original(self, arr, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(PageLedger, "_checked", spy)
    return seen


@pytest.mark.parametrize("form", ["recorded use", "int row", "fence="])
def test_a_long_rows_free_skips_the_distinctness_check(
    form: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool, row = _long_row_pool()
    stream = HostStream("forward")
    try:
        fence = stream.record()
        fence.synchronize()
        seen = _count_checked(monkeypatch)
        if form == "recorded use":
            pool.record_use([row], fence)
            pool.free([row])
        elif form == "int row":
            pool.free(row)
        else:
            pool.free([row], fence)
        assert seen == []  # was [4096]: the whole record through the full check
        pool.reclaim()
        assert kv_of(pool).available_size() == kv_of(pool).capacity
        pool.check_invariants()
    finally:
        stream.close()


def test_a_long_record_whose_page_is_not_owned_is_still_refused() -> None:
    pool, row = _long_row_pool()
    pages = pool.pages_of(row)
    led = kv_of(pool).ledger
    page = int(pages[100])
    led._state[page] = 0  # FREE behind the row's back (no public call can)
    before = (pool.available_size(), kv_of(pool).available_size(), pool.pages_of(row).tolist())
    with pytest.raises(DoubleFreeError):
        pool.free(row)
    assert (pool.available_size(), kv_of(pool).available_size()) == before[:2]
    assert pool.pages_of(row).tolist() == before[2]
