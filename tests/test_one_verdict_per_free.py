"""One ``free`` (or ``trim_pages``) asks each fence once.

A pool with ``kv`` frees a row's pages through the page ledger and the row
through the row ledger, and the pages in groups (by the rows' recorded
uses): each used to ask the fence afresh. A fence whose ``query()`` raised
once and then answered True got the pages quarantined and the row freed,
its fault counted for pages only (found by a review); one that answered
False and then True left the pages pending and the row free. Now every id
behind a fence gets the first answer of the call.

The tests run outside any event loop (``try_admit``).
"""

from __future__ import annotations

import logging
import threading

import pytest
from helpers import FakeStream

from asyncpool import AsyncReqToTokenPool, Grant, KVPagePool


class Fickle:
    """A transfer handle whose answers the test scripts: each ``query()``
    from the test's thread takes the next (an exception is raised); the last
    one repeats. The pool's watcher thread, which polls a pending handle,
    is told False and takes none."""

    def __init__(self, *answers: object) -> None:
        self.answers = list(answers)
        self.calls = 0
        self.owner = threading.get_ident()

    def query(self) -> bool:
        if threading.get_ident() != self.owner:
            return False
        answer = self.answers[min(self.calls, len(self.answers) - 1)]
        self.calls += 1
        if isinstance(answer, BaseException):
            raise answer
        assert isinstance(answer, bool)
        return answer

    def synchronize(self) -> None:
        pass


def _pool() -> AsyncReqToTokenPool:
    return AsyncReqToTokenPool(5, 8, kv=KVPagePool(17, 4))


def _admit(pool: AsyncReqToTokenPool, k: int) -> Grant:
    grant = pool.try_admit(pages=k)
    assert grant is not None
    return grant


def test_a_fault_then_done_quarantines_the_row_and_its_pages(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pool = _pool()
    grant = _admit(pool, 3)
    fence = Fickle(RuntimeError("the status poll failed"), True)
    with caplog.at_level(logging.CRITICAL, logger="asyncpool"):
        assert pool.free([grant.row], fence=fence) == 0
    stats = pool.stats()
    assert fence.calls == 1
    assert (stats.quarantined, stats.pages_quarantined) == (1, 3)
    assert (stats.fence_errors, stats.page_fence_errors) == (1, 1)
    pool.check_invariants()


def test_not_done_then_done_leaves_the_row_and_its_pages_pending() -> None:
    pool = _pool()
    grants = [_admit(pool, 2) for _ in range(2)]
    stream = FakeStream()
    pool.record_use([grants[0].row], stream.record())  # two groups of pages
    stream.complete()
    fence = Fickle(False, True)
    assert pool.free([g.row for g in grants], fence=fence) == 0
    assert fence.calls == 1
    assert (pool.pending_size(), pool.kv.pending_size()) == (2, 4)
    assert pool.reclaim() == 2 and pool.kv.pending_size() == 0
    pool.check_invariants()


def test_trim_pages_asks_once_for_every_group(caplog: pytest.LogCaptureFixture) -> None:
    pool = _pool()
    grants = [_admit(pool, 3) for _ in range(2)]
    stream = FakeStream()
    pool.record_use([grants[0].row], stream.record())  # the rows' pages in two groups
    stream.complete()
    fence = Fickle(RuntimeError("the status poll failed"), True)
    with caplog.at_level(logging.CRITICAL, logger="asyncpool"):
        assert pool.trim_pages([g.row for g in grants], 1, fence=fence) == 0
    assert fence.calls == 1
    assert pool.kv.stats().quarantined == 4  # both rows' two trimmed pages
    assert pool.kv.stats().fence_errors == 1
    for grant in grants:
        assert pool.pages_of(grant.row).tolist() == grant.pages[:1].tolist()
    pool.check_invariants()


def test_the_next_free_asks_again() -> None:
    """The answers last for one call: a fence not done at one free is asked
    again at the next, and at reclaim (once by each ledger there: a reclaim
    settles each ledger's batches on its own)."""
    pool = _pool()
    a, b = _admit(pool, 1), _admit(pool, 1)
    fence = Fickle(False, False, True)
    assert pool.free([a.row], fence=fence) == 0
    assert pool.free([b.row], fence=fence) == 0
    assert fence.calls == 2
    assert pool.reclaim() == 2 and fence.calls == 4
    assert pool.kv.pending_size() == 0
    pool.check_invariants()
