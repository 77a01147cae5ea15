"""A batch behind a long ``fence=`` sequence asks each fence O(1) times.

Memory freed behind n fences of unknown origin (``free(rows, fence=[t0,
..., tn-1])`` with n transfer handles) waits in one batch: a head fence and
the rest. When the head completed, every other fence was asked again, and
the batch moved behind the first still open: fences that land one by one in
list order, a reclaim after each, cost n + (n-1) + ... queries, O(n^2) in
all (n = 1,000: 501,500 ``query()`` calls). Now the walk stops at the first
fence still open and never asks again one found complete: O(n + passes).

Counted, not timed (``tests/test_fence_sequence_costs.py`` times single
calls): every case counts ``query()`` calls on each fence, on the row pool,
the page pool and the async pool that owns both. The semantics stay: the
memory returns only when every fence of its batch is done, one that faults
quarantines it, ``force_release`` of one element frees nothing alone, and
an explicit pool asks nothing.
"""

from __future__ import annotations

import random
import threading
from typing import Any

import pytest
from helpers import FakeStream, bounded

from asyncpool import AsyncReqToTokenPool, KVPagePool, ReqToTokenPool

N = 300


class Counted:
    """A transfer handle (a fence of unknown origin) that counts the queries
    made from the thread that built it (the async pool's poller thread also
    asks a batch's head, as often as its backoff allows: not counted)."""

    __slots__ = ("__weakref__", "fault", "landed", "owner", "queries")

    def __init__(self) -> None:
        self.landed = False
        self.fault = False
        self.queries = 0
        self.owner = threading.get_ident()

    def query(self) -> bool:
        if threading.get_ident() == self.owner:
            self.queries += 1
        if self.fault:
            raise RuntimeError("transfer failed")
        return self.landed

    def synchronize(self) -> None:
        raise AssertionError("never called by the pool")


def _total(fences: list[Counted]) -> int:
    return sum(f.queries for f in fences)


def _rows_pool(fences: list[Counted]) -> tuple[Any, Any]:
    pool = ReqToTokenPool(4, 4)
    rows = pool.alloc(2)
    assert pool.free(rows, fence=fences) == 0
    return pool, lambda: (pool.reclaim(), pool.pending_size())[1]


def _pages_pool(fences: list[Counted]) -> tuple[Any, Any]:
    kv = KVPagePool(9, 4)
    pages = kv.alloc(4)
    assert kv.free(pages, fence=fences) == 0
    return kv, lambda: (kv.reclaim(), kv.pending_size())[1]


MAKERS = {"rows": _rows_pool, "pages": _pages_pool}


@pytest.mark.parametrize("which", list(MAKERS))
def test_fences_landing_in_list_order_are_asked_a_few_times_each(which: str) -> None:
    fences = [Counted() for _ in range(N)]
    pool, pending = MAKERS[which](fences)
    asked_at_free = _total(fences)
    assert asked_at_free == N  # the free asks each once: all open
    for i, f in enumerate(fences):
        f.landed = True
        left = pending()
        pool.check_invariants()
        # Every fence of the batch must be done before anything returns.
        assert (left == 0) == (i == N - 1), (i, left)
    # Per pass: the head that landed once more and the next one, still open.
    assert _total(fences) <= asked_at_free + 2 * N
    assert max(f.queries for f in fences) <= 3
    # Nothing is asked once the batch is gone.
    before = _total(fences)
    pending()
    assert _total(fences) == before


@pytest.mark.parametrize("which", list(MAKERS))
@pytest.mark.parametrize("seed", [0, 1])
def test_fences_landing_in_any_order_cost_linear_queries(which: str, seed: int) -> None:
    """Each fence is asked once at the free, once when the walk passes it
    done, and once a pass while it is the head: O(n + passes)."""
    fences = [Counted() for _ in range(N)]
    pool, pending = MAKERS[which](fences)
    order = list(range(N))
    random.Random(seed).shuffle(order)
    passes = 0
    for i in order:
        fences[i].landed = True
        passes += 1
        assert (pending() == 0) == all(f.landed for f in fences)
    pool.check_invariants()
    assert pending() == 0
    assert _total(fences) <= 2 * N + 2 * (passes + 1)


def test_the_last_fence_landing_first_releases_nothing_until_the_head_lands() -> None:
    fences = [Counted() for _ in range(N)]
    pool, pending = _rows_pool(fences)
    for f in reversed(fences[1:]):
        f.landed = True
        assert pending() == 2
    # Only the head was asked on each of those passes.
    assert all(f.queries == 1 for f in fences[1:])
    fences[0].landed = True
    assert pending() == 0
    assert pool.available_size() == 3
    assert _total(fences) <= 2 * N + N + 1


@pytest.mark.parametrize("which", list(MAKERS))
def test_a_fence_that_faults_mid_sequence_quarantines_the_batch(which: str) -> None:
    fences = [Counted() for _ in range(10)]
    pool, pending = MAKERS[which](fences)
    fences[5].fault = True
    for f in fences[:4]:
        f.landed = True
        assert pending() > 0  # held, not released, while the walk has not met it
    assert fences[5].queries == 1  # asked at the free only: behind an open fence
    # The walk passes fences[4] and reaches the faulted one: quarantined.
    fences[4].landed = True
    assert pending() == 0
    stats = pool.stats()
    assert stats.quarantined == (2 if which == "rows" else 4)
    assert stats.fence_errors == 1
    for f in fences:
        f.landed = True
        f.fault = False
    pool.reclaim()
    assert pool.available_size() == (1 if which == "rows" else 4)
    pool.check_invariants()


def test_force_release_of_a_fence_behind_the_head_still_waits_for_the_others() -> None:
    fences = [Counted() for _ in range(10)]
    pool, pending = _rows_pool(fences)
    for f in fences[:3]:
        f.landed = True
    assert pending() == 2  # the batch waits behind fences[3] now
    assert pool.force_release(fences[6]) == 0  # behind the head: frees nothing alone
    for f in fences[3:9]:
        if f is not fences[6]:
            f.landed = True
    assert pending() == 2  # fences[9] is still open
    assert fences[6].queries == 1  # asked at the free only: released by force
    assert pool.force_release(fences[9]) == 2
    assert pool.available_size() == 3
    pool.check_invariants()


def test_an_explicit_pool_asks_no_fence_of_a_long_sequence() -> None:
    """Ordered fences of many streams, retired one by one: no query(), and
    the rows return at the last retirement only."""
    streams = [FakeStream() for _ in range(50)]
    fences = [s.record() for s in streams]
    asked = [0]

    def count(f: Any) -> Any:
        real = f.query

        def query() -> bool:
            asked[0] += 1
            return bool(real())

        return query

    for f in fences:
        f.query = count(f)
    pool = ReqToTokenPool(4, 4, reclaim="explicit")
    rows = pool.alloc(2)
    assert pool.free(rows, fence=fences) == 0
    for i, f in enumerate(fences):
        released = pool.retire(f)
        assert released == (2 if i == len(fences) - 1 else 0)
    assert asked[0] == 0
    pool.check_invariants()


async def test_the_async_pool_asks_each_fence_of_a_sequence_a_few_times() -> None:
    """Rows and pages behind n transfers that land in order, the pool
    reclaimed after each (no await between: no wake-up asks anything)."""
    pool = AsyncReqToTokenPool(3, 4, kv=KVPagePool(9, 4))
    g = pool.try_admit(pages=4)
    assert g is not None
    fences = [Counted() for _ in range(N)]
    assert pool.free([g.row], fence=fences) == 0
    assert _total(fences) == N  # asked once for the row and its pages together
    for i, f in enumerate(fences):
        f.landed = True
        pool.reclaim()
        stats = pool.stats()
        assert (stats.pending, stats.pages_pending) == ((0, 0) if i == N - 1 else (1, 4))
    # Two ledgers, each: the head once more and the next, once a pass.
    assert _total(fences) <= N + 4 * N
    assert max(f.queries for f in fences) <= 5
    async with bounded():
        again = await pool.admit(pages=8)
    pool.free([again.row])
    pool.check_invariants()
    async with bounded():
        await pool.close()
