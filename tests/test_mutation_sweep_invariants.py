"""Gaps found by a mechanical mutation sweep of the invariant checks
(``PageLedger.check_invariants`` and ``KVPagePool.check_invariants`` in
``asyncpool/kv_pages.py``, ``SlotLedger.check_invariants``) and of
``SlotLedger.__init__`` and its count properties (``asyncpool/ledger.py``).

The stress and stateful tests trust ``check_invariants`` to find a leak or
a double hand-out: a check that stopped raising would let a broken state
pass silently. Each test here corrupts one thing on purpose, in a ledger
that holds pages (rows) in every state at once, and expects the check that
guards it to raise ``AssertionError`` naming what broke. Pinned:

* pages: page 0 not reserved; a page in a state no page can be in
  (reserved, a row's used state, the transient checking mark, a byte past
  the last state); the free ring's head past either end and its free count
  below 0 or past the capacity; a page in the free ring twice (another free
  page missing from it); a ring entry that is not free with the counts
  agreeing; a ring shorter than the FREE pages; a pending batch holding an
  int32, a 2-D or a ring-sharing array; a page pending in two batches (the
  counts agreeing); a batch listing an allocated page; the quarantined
  count off by one; a page above the taken mark (never handed out) that is
  not free, exactly one past the mark; the peak below the allocated count.
  A healthy ledger whose ring head wrapped, whose free count is 0 or the
  whole capacity, and which holds pages in every state passes;
* ``KVPagePool.check_invariants`` of a served page pool runs its owner's
  thread guard; ``check_invariants`` of a row pool (sync and async) runs
  its row ledger's check;
* rows: the same kinds of corruption of :class:`SlotLedger` (row 0, a row
  marked reserved or checking, the free queue, the clean count past either
  end, pending batches, the quarantined count, a recorded use without the
  used state and the used state without one);
* ``SlotLedger(size)`` starts with every row ``1..size - 1`` free and
  clean, row 0 reserved, no hand-outs and no peak (a peak of 1 survived:
  ``peak_allocated`` would stay 1 on a pool that never held a row);
* ``MAX_ROWS_SIZE`` is ``2**31``: the largest ``size`` accepted.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from helpers import EventFence, FakeStream, bounded, in_thread

from asyncpool import (
    AsyncReqToTokenPool,
    CapacityError,
    KVPagePool,
    ReqToTokenPool,
    WrongThreadError,
)
from asyncpool.kv_pages import OWNED, PageLedger
from asyncpool.ledger import (
    _CHECKING,
    ALLOCATED,
    FREE,
    MAX_ROWS_SIZE,
    PENDING,
    RESERVED,
    USED,
    SlotLedger,
    check_size,
)

# ------------------------------------------------------------------ pages


def _pages(n: int = 17) -> tuple[PageLedger, dict[str, list[int]]]:
    """A page ledger (capacity ``n - 1``) holding pages in every state: two
    pending batches of one page each, one quarantined page, ALLOCATED and
    OWNED pages, free pages, and pages never handed out."""
    led = PageLedger(n)
    allocated = led.take(3)
    owned = led.take(2, OWNED)
    p1, p2, q = led.take(1), led.take(1), led.take(1)
    assert allocated is not None and owned is not None
    assert p1 is not None and p2 is not None and q is not None
    led.free(p1, [EventFence()])
    led.free(p2, [EventFence()])
    faulted = FakeStream()
    fence = faulted.record()
    faulted.fault()
    led.free(q, [fence])
    gone = led.take(2)
    assert gone is not None
    assert led.free(gone) == 2  # free again, at the ring's tail
    led.check_invariants()
    groups = {
        "allocated": [int(p) for p in allocated],
        "owned": [int(p) for p in owned],
        "pending": [int(p1[0]), int(p2[0])],
        "quarantined": [int(q[0])],
        "free": [int(p) for p in led._ring[(led._head + np.arange(led.free_count)) % led.capacity]],
    }
    assert led.quarantined == 1 and led.pending == 2 and led.allocated == 5
    return led, groups


def _batches(led: PageLedger) -> list:  # type: ignore[type-arg]
    return sorted(led._batches(), key=lambda b: b.did)


def test_a_healthy_page_ledger_in_every_state_passes() -> None:
    led, groups = _pages()
    assert led._taken < led.capacity  # pages never handed out remain
    states = led.states()
    assert {int(states[p]) for p in groups["owned"]} == {OWNED}
    # Head wrapped past the ring's end, free count 0, free count = capacity.
    led2 = PageLedger(9)
    for _ in range(3):
        pages = led2.take(5)
        assert pages is not None
        led2.free(pages)
        led2.check_invariants()
    everything = led2.take(8)
    assert everything is not None and led2.free_count == 0
    led2.check_invariants()
    led2.free(everything)
    assert led2.free_count == led2.capacity
    led2.check_invariants()


def test_page_0_not_reserved_is_caught() -> None:
    led, _ = _pages()
    led._state[0] = FREE
    with pytest.raises(AssertionError, match="page 0 is not reserved"):
        led.check_invariants()


@pytest.mark.parametrize("bad", [RESERVED, USED, _CHECKING, OWNED + 1])
def test_a_page_in_an_impossible_state_is_caught(bad: int) -> None:
    led, groups = _pages()
    led._state[groups["allocated"][0]] = bad
    with pytest.raises(AssertionError, match="impossible states"):
        led.check_invariants()


@pytest.mark.parametrize("head", [-1, "capacity"])
def test_a_ring_head_out_of_range_is_caught(head: int | str) -> None:
    led, _ = _pages()
    led._head = led.capacity if head == "capacity" else head  # type: ignore[assignment]
    with pytest.raises(AssertionError, match="out of range"):
        led.check_invariants()


@pytest.mark.parametrize("delta", [-1, +1])
def test_a_free_count_out_of_range_is_caught(delta: int) -> None:
    led, _ = _pages()
    led.free_count = led.capacity + 1 if delta > 0 else -1
    with pytest.raises(AssertionError, match="out of range"):
        led.check_invariants()


def test_a_page_twice_in_the_free_ring_is_caught() -> None:
    led, _ = _pages()
    head = led._head
    # The second free page's slot now repeats the first: that page is FREE
    # but out of the ring, and the counts still agree.
    led._ring[(head + 1) % led.capacity] = led._ring[head]
    with pytest.raises(AssertionError, match="in the free ring twice"):
        led.check_invariants()


def test_an_allocated_page_in_the_free_ring_is_caught() -> None:
    led, groups = _pages()
    # Swap a free page for an allocated one in the ring: as many FREE pages
    # as ring entries, no duplicate, but one entry is not free.
    led._ring[led._head] = groups["allocated"][0]
    with pytest.raises(AssertionError, match="free ring"):
        led.check_invariants()


def test_a_ring_shorter_than_the_free_pages_is_caught() -> None:
    led, _ = _pages()
    led.free_count -= 1
    with pytest.raises(AssertionError, match="free ring"):
        led.check_invariants()


@pytest.mark.parametrize("kind", ["int32", "2-D", "ring view"])
def test_a_pending_batch_of_a_bad_array_is_caught(kind: str) -> None:
    led, groups = _pages()
    batch = _batches(led)[0]
    page = groups["pending"][0]
    if kind == "int32":
        arr = np.array([page], dtype=np.int32)
    elif kind == "2-D":
        arr = np.array([[page]], dtype=np.int64)
    else:
        # A view of the ring's memory: the free page there is swapped for
        # the pending one (and back into the ring in its place elsewhere).
        at = (led._head + led.free_count) % led.capacity
        saved = int(led._ring[at])
        led._ring[at] = page
        arr = led._ring[at : at + 1]
        assert saved != page
    batch.items = [arr]
    with pytest.raises(AssertionError, match="private 1-D int64"):
        led.check_invariants()


def test_a_page_pending_in_two_batches_is_caught() -> None:
    led, groups = _pages()
    _, second = _batches(led)
    # The second batch now lists the first's page: its own page is PENDING
    # in none, and the counts (2 listed, 2 PENDING) still agree.
    second.items = [np.array([groups["pending"][0]], dtype=np.int64)]
    with pytest.raises(AssertionError, match="pending in two batches"):
        led.check_invariants()


def test_a_batch_listing_an_allocated_page_is_caught() -> None:
    led, groups = _pages()
    second = _batches(led)[1]
    second.items = [np.array([groups["allocated"][0]], dtype=np.int64)]
    with pytest.raises(AssertionError, match="pending batches"):
        led.check_invariants()


def test_a_pending_page_no_batch_lists_is_caught() -> None:
    led, groups = _pages()
    led._state[groups["allocated"][0]] = PENDING
    led.pending += 1
    with pytest.raises(AssertionError):
        led.check_invariants()


def test_a_handed_out_page_above_the_taken_mark_is_caught() -> None:
    led, _ = _pages()
    # Pages are taken in id order at first: every page above _taken is
    # free. The mark just below the highest page not free leaves exactly
    # that page above it.
    top = int(np.flatnonzero(led._state != FREE).max())
    assert 1 < top <= led._taken and (led._state[top + 1 :] == FREE).all()
    led._taken = top - 1
    with pytest.raises(AssertionError, match="never handed out is not free"):
        led.check_invariants()


def test_a_peak_below_the_allocated_count_is_caught() -> None:
    led, _ = _pages()
    led.peak_allocated = led.allocated - 1
    with pytest.raises(AssertionError, match="peak"):
        led.check_invariants()
    led.peak_allocated = led.allocated  # equal is fine
    led.check_invariants()


async def test_the_served_page_pools_check_runs_its_owners_thread_guard() -> None:
    kv = KVPagePool(9, 4)
    async with bounded(), AsyncReqToTokenPool(4, 8, kv=kv):
        kv.check_invariants()
        with pytest.raises(WrongThreadError):
            in_thread(kv.check_invariants)


# ------------------------------------------------------------------ rows


def _rows() -> tuple[SlotLedger, dict[str, list[int]]]:
    """A row ledger holding rows in every state: allocated, used (a recorded
    use), pending (two batches of one row), quarantined, free (some dirty)."""
    led = SlotLedger(12)
    rows = led.take(7)
    assert rows is not None
    allocated, used, p1, p2, q, freed = rows[0:2], rows[2:3], rows[3], rows[4], rows[5], rows[6]
    led.record_use(used, EventFence())
    led.free([p1], EventFence())
    led.free([p2], EventFence())
    faulted = FakeStream()
    fence = faulted.record()
    faulted.fault()
    led.free([q], fence)
    led.free([freed])
    led.check_invariants()
    assert led.pending == 2 and led.quarantined == 1 and 0 < led._clean < led.free_count
    return led, {"allocated": allocated, "used": used, "pending": [p1, p2], "free": list(led._free)}


def test_a_healthy_row_ledger_in_every_state_passes() -> None:
    led, groups = _rows()
    assert led._state[groups["used"][0]] == USED
    led._clean = 0
    led.check_invariants()
    led._clean = led.free_count
    led.check_invariants()


def test_row_0_not_reserved_is_caught() -> None:
    led, _ = _rows()
    led._state[0] = FREE
    with pytest.raises(AssertionError, match="row 0 is not reserved"):
        led.check_invariants()


@pytest.mark.parametrize("bad", [RESERVED, _CHECKING])
def test_a_row_in_an_impossible_state_is_caught(bad: int) -> None:
    led, groups = _rows()
    led._state[groups["allocated"][0]] = bad
    with pytest.raises(AssertionError, match="impossible states"):
        led.check_invariants()


def test_a_row_twice_in_the_free_queue_is_caught() -> None:
    led, _ = _rows()
    led._free[1] = led._free[0]
    with pytest.raises(AssertionError, match="free queue twice"):
        led.check_invariants()


def test_an_allocated_row_in_the_free_queue_is_caught() -> None:
    led, groups = _rows()
    led._free[0] = groups["allocated"][0]
    with pytest.raises(AssertionError, match="free queue"):
        led.check_invariants()


def test_a_free_queue_shorter_than_the_free_rows_is_caught() -> None:
    led, _ = _rows()
    led._free.pop()
    led._clean = min(led._clean, len(led._free))
    with pytest.raises(AssertionError, match="free queue"):
        led.check_invariants()


@pytest.mark.parametrize("clean", [-1, "free+1"])
def test_a_clean_count_out_of_range_is_caught(clean: int | str) -> None:
    led, _ = _rows()
    led._clean = led.free_count + 1 if clean == "free+1" else clean  # type: ignore[assignment]
    with pytest.raises(AssertionError, match="clean count"):
        led.check_invariants()


def test_a_row_pending_in_two_batches_is_caught() -> None:
    led, groups = _rows()
    _, second = sorted(led._batches(), key=lambda b: b.did)
    second.items = [groups["pending"][0]]
    with pytest.raises(AssertionError, match="pending in two batches"):
        led.check_invariants()


def test_a_batch_listing_an_allocated_row_is_caught() -> None:
    led, groups = _rows()
    second = sorted(led._batches(), key=lambda b: b.did)[1]
    second.items = [groups["allocated"][0]]
    with pytest.raises(AssertionError, match="pending batches"):
        led.check_invariants()


@pytest.mark.parametrize("delta", [-1, +1])
@pytest.mark.parametrize("build", [_pages, _rows], ids=["pages", "rows"])
def test_a_quarantined_count_off_by_one_is_caught(
    build: Callable[[], tuple[PageLedger | SlotLedger, object]], delta: int
) -> None:
    led, _ = build()
    led.quarantined += delta
    with pytest.raises(AssertionError, match="quarantined count"):
        led.check_invariants()


def test_a_recorded_use_without_the_used_state_is_caught() -> None:
    led, groups = _rows()
    led._state[groups["used"][0]] = ALLOCATED
    with pytest.raises(AssertionError, match="carries a recorded use"):
        led.check_invariants()


def test_the_used_state_without_a_recorded_use_is_caught() -> None:
    led, groups = _rows()
    led._state[groups["allocated"][0]] = USED
    with pytest.raises(AssertionError, match="carries none"):
        led.check_invariants()


# ------------------------------------------------------------------ SlotLedger.__init__


def test_a_fresh_row_ledgers_figures() -> None:
    resets: list[list[int]] = []
    led = SlotLedger(6, on_reset=resets.append)
    assert (led.size, led.capacity) == (6, 5)
    assert led.state_of(0) == "reserved"
    assert [led.state_of(r) for r in range(1, 6)] == ["free"] * 5
    assert list(led._free) == [1, 2, 3, 4, 5]
    assert [led.generation(r) for r in range(6)] == [0] * 6
    assert (led.free_count, led.allocated, led.allocs, led.granted) == (5, 0, 0, 0)
    assert (led.returned, led.frees, led.peak_allocated, led.resets) == (0, 0, 0, 0)
    assert (led.pending, led.quarantined, led._popped) == (0, 0, 0)
    led.check_invariants()
    # Every row starts clean: handing them all out resets nothing.
    rows = led.take(5)
    assert rows == [1, 2, 3, 4, 5] and resets == [] and led.resets == 0
    assert [led.generation(r) for r in rows] == [5] * 5
    assert (led.peak_allocated, led.granted, led._popped) == (5, 5, 5)


def test_the_largest_row_pool_size_is_2_pow_31() -> None:
    assert MAX_ROWS_SIZE == 2**31
    check_size(2**31)
    with pytest.raises(CapacityError):
        check_size(2**31 + 1)


async def test_a_pools_check_runs_its_row_ledgers() -> None:
    sync = ReqToTokenPool(5, 8)
    assert sync.alloc(2) is not None
    sync.check_invariants()
    sync._ledger.quarantined += 1
    with pytest.raises(AssertionError, match="quarantined count"):
        sync.check_invariants()
    async with bounded(), AsyncReqToTokenPool(5, 8) as pool:
        rows = await pool.alloc(2)
        pool.check_invariants()
        pool._ledger._state[rows[0]] = FREE
        with pytest.raises(AssertionError, match="free queue"):
            pool.check_invariants()
        pool._ledger._state[rows[0]] = ALLOCATED
        pool.free(rows)
