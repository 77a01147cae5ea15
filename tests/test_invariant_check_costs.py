"""``check_invariants`` of a pool with a million owned pages is vectorised.

page_size 1 (a token a page, SGLang's default) gives a long-context pool
millions of pages. The pool's ``check_invariants`` (for tests, soaks and an
engine's debug mode) went through the rows' owned pages in a Python pass a
page (a list of every id, a set of them, one ``state_of`` a page) and
proved the free ring and the pending pages distinct with ``np.unique``,
whose hashing under numpy 2 took 0.7 s a million ids: 1.3 s in all for a
pool of a million pages all owned. Now every step is an array operation
and distinctness one sort. Counted here: ``state_of`` calls (one a page
before) and ``np.unique`` calls (two before); what the checks catch is
``tests/test_mutation_sweep_row_pages.py``'s and
``tests/test_mutation_sweep_invariants.py``'s.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from helpers import kv_of

from asyncpool import AsyncReqToTokenPool, HostStream, KVPagePool
from asyncpool.kv_pages import PageLedger

ROWS, PAGES = 8, 512


def test_check_invariants_takes_no_step_a_page(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = AsyncReqToTokenPool(ROWS + 1, 8, kv=KVPagePool(ROWS * PAGES + 64, 1))
    rows = []
    for _ in range(ROWS):
        grant = pool.try_admit(pages=PAGES // 2)
        assert grant is not None
        assert pool.extend(grant.row, PAGES // 2) is not None
        rows.append(grant.row)
    stream = HostStream("forward")
    gate = threading.Event()
    try:
        stream.launch(gate.wait)  # the step in flight
        step = stream.record()
        pool.record_use(rows[:2], step)
        pool.free(rows[:2])  # 1,024 pages pending behind the step
        assert kv_of(pool).pending_size() == 2 * PAGES
        calls = {"state_of": 0, "unique": 0}
        state_of, unique = PageLedger.state_of, np.unique

        def counted_state_of(self: PageLedger, page: int) -> str:
            calls["state_of"] += 1
            return state_of(self, page)

        def counted_unique(*args: object, **kwargs: object) -> object:
            calls["unique"] += 1
            return unique(*args, **kwargs)  # type: ignore[call-overload]

        monkeypatch.setattr(PageLedger, "state_of", counted_state_of)
        monkeypatch.setattr(np, "unique", counted_unique)
        pool.check_invariants()
        assert calls == {"state_of": 0, "unique": 0}  # was 3,072 and 2
        monkeypatch.undo()
        gate.set()
        step.synchronize()
        pool.reclaim()
        assert kv_of(pool).pending_size() == 0
        pool.check_invariants()
    finally:
        gate.set()
        stream.close()


def test_a_failed_check_leaves_the_rows_seals_growable() -> None:
    """A failed ``check_invariants`` keeps its frame alive in the error's
    traceback (``pytest.raises``, a soak's log of it): the vectorised check
    held zero-copy views of the rows' seals (bytearrays once grown) in a
    local there, and a bytearray with a view on it cannot be resized, so the
    row's next in-place growth raised ``BufferError`` after it had grown
    the record but not the seal, leaving the row refused as written into."""
    pool = AsyncReqToTokenPool(4, 8, kv=KVPagePool(64, 1))
    grant, other = pool.try_admit(pages=2), pool.try_admit(pages=2)
    assert grant is not None and other is not None
    row = grant.row
    assert pool.extend(row, 1) is not None  # its seal is a bytearray now, with room
    pages = pool._pages
    assert pages is not None and isinstance(pages.sealed[row], bytearray)
    kept = pages.sealed[other.row]
    assert kept is not None
    pages.sealed[other.row] = bytes(pages.sealed[row][:8]) + kept[8:]  # a page listed twice
    with pytest.raises(AssertionError, match="two rows") as failed:
        pool.check_invariants()
    pages.sealed[other.row] = kept  # repaired; the error (and its traceback) still held
    assert pool.extend(row, 1) is not None
    assert pool.pages_of(row, host=True).shape[0] == 4
    pool.check_invariants()
    pool.free([row, other.row])
    pool.check_invariants()
    del failed
