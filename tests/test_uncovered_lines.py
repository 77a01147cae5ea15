"""Gaps found by a coverage run of the whole CPU test suite: library lines
that no test executed. Each test here executes one of them and fails if the
line is deleted (or, for a ``return X``, made to return None). Pinned:

* ``Deferred.__repr__`` (``asyncpool/deferral.py``) names a batch's deferral
  id, its count and its head fence, and ``+N fences`` for the fences it
  waits for besides its head (none for a batch behind its head alone);
* ``_check_deferrals`` (the part of ``check_invariants`` that both ledgers,
  rows and pages, share) catches each corruption of the deferral queues,
  the named check being the one that fires: a stream queue out of record
  order; a queue filed under another stream's key; a batch of an ordered
  fence in the side list; a side-list index entry for a batch not in the
  list, for a batch that waits for more than one fence, or under another
  fence's id; an index kept for a side list no longer in use; a duplicate,
  negative or not yet issued deferral id; a batch waiting twice for its
  head fence; a batch whose ``n`` differs from the ids it holds;
* the allocated-count checks of ``PageLedger`` and ``SlotLedger`` catch a
  capacity one past what the states add up to (every other count is
  cross-checked first, so only the capacity can disagree here);
* ``WaiterQueues.check_invariants`` catches a waiter count that is not the
  number queued, a priority index that lost a queued priority, an empty
  priority queue still indexed, and a granted waiter still queued (a
  cancelled one still queued is legal);
* ``free`` of one row of a pool with ``kv``, whose record is as sealed but
  one of whose pages is no longer OWNED in the page ledger (only a
  corrupted ledger gets there: nothing but ``RowPages`` makes an OWNED page
  anything else), falls back from the fast check (the one-pass check of a
  few pages, the vectorised one of more) to the checked path, which raises
  the documented ``InvalidSlotError`` naming the page, changing nothing;
* ``FenceWatcher.__repr__`` says running or stopped; a ``notify`` that
  raises is logged ("fence watcher notify failed", with the error) and the
  poller keeps serving; ``stop()`` during a poller pass over many fences
  ends the pass at the next stop check (every ``_STOP_CHECK_EVERY``
  fences): the fences after it are not asked;
* ``wait_fence``'s notify, run by the watcher's poller after the event loop
  it would wake was collected, returns quietly instead of raising.

Not tested, and why:

* ``AsyncReqToTokenPool.extend`` answering None while the memory is
  released (``asyncpool/growth.py``, ``if self._released: return None``)
  is unreachable: ``extend`` first requires an allocated row, and
  ``release_memory`` refuses while any row is allocated, then gates every
  allocation (the grant loop, ``alloc``/``admit`` fast paths, ``try_*``;
  the unchecked foreign-thread ``alloc(1)`` path never opens on a pool
  with ``kv``, and ``extend`` needs ``kv``) until ``resume_memory``, so no
  row is allocated while ``_released`` is set;
* in ``free``'s one-row fast path, the slow path's ``free_prepared`` after
  ``prepare`` is unreachable: the fast check fails only when a page of the
  sealed record is not OWNED, and then ``prepare(..., OWNED)`` always
  raises (the ``prepare`` line itself is pinned above);
* "states do not add up to capacity" (``PageLedger`` and ``SlotLedger``)
  can never fire: once the free, pending and quarantined counts are
  checked, the allocated count check just before it is the same equation
  (``allocated`` is ``capacity - free - pending - quarantined``);
* ``PageLedger.put_back`` of no pages returning early is an equivalent
  mutant: without the ``return`` the rest does nothing for zero pages.

Async tests run on asyncio and uvloop (conftest); every wait for another
thread is bounded.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import gc
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import uvloop
from helpers import WAIT_S, EventFence, FakeStream, bounded, page_ids

from asyncpool import AsyncReqToTokenPool, InvalidSlotError, KVPagePool
from asyncpool import watcher as watcher_mod
from asyncpool.deferral import Deferrals, Deferred
from asyncpool.fence_wait import _LoopWaits
from asyncpool.kv_pages import OWNED, PageLedger
from asyncpool.ledger import ALLOCATED, SlotLedger
from asyncpool.stats import Histogram
from asyncpool.waiters import WaiterQueues
from asyncpool.watcher import FenceWatcher

# ------------------------------------------------------------------ Deferred.__repr__


def test_a_batchs_repr_counts_the_fences_besides_its_head() -> None:
    led = PageLedger(9)
    one, two = FakeStream(), FakeStream()
    head, other = one.record(), two.record()
    both = led.take(2)
    alone = led.take(1)
    assert both is not None and alone is not None
    assert led.free(both, [head, other]) == 0
    assert led.free(alone, [one.record()]) == 0
    first, second = sorted(led._batches(), key=lambda b: b.did)
    assert first.rest == (other,)
    assert repr(first) == f"<Deferred did=0 n=2 behind {head!r} +1 fences>"
    assert repr(second) == f"<Deferred did=1 n=1 behind {second.fence!r}>"


# ------------------------------------------------------------------ _check_deferrals


def _deferring(kind: str) -> tuple[Deferrals[Any], FakeStream, EventFence]:
    """A row or page ledger with two batches in one stream's queue (behind
    fences 1 and 2 of ``stream``) and one in the side list, behind a fence
    of unknown origin, indexed as a single-fence batch."""
    stream = FakeStream()
    unknown = EventFence()
    led: Deferrals[Any]
    if kind == "rows":
        rows = SlotLedger(12)
        got = rows.take(4)
        assert got is not None
        rows.free([got[0]], stream.record())
        rows.free([got[1]], stream.record())
        rows.free([got[2]], unknown)
        rows.check_invariants()
        led = rows
    else:
        pages = PageLedger(13)
        taken = [pages.take(1) for _ in range(4)]
        assert all(t is not None for t in taken)
        pages.free(taken[0], [stream.record()])
        pages.free(taken[1], [stream.record()])
        pages.free(taken[2], [unknown])
        pages.check_invariants()
        led = pages
    assert [b.seq for b in led._streams[stream.key]] == [1, 2]
    assert len(led._unordered) == 1 and led._solo_of is led._unordered
    assert list(led._solo) == [id(unknown)]
    return led, stream, unknown


KINDS = pytest.mark.parametrize("kind", ["rows", "pages"])


def _check(led: Deferrals[Any]) -> None:
    assert isinstance(led, (SlotLedger, PageLedger))
    led.check_invariants()


@KINDS
def test_a_stream_queue_out_of_record_order_is_caught(kind: str) -> None:
    led, stream, _ = _deferring(kind)
    led._streams[stream.key].reverse()
    with pytest.raises(AssertionError, match=r"queue out of record order: \[2, 1\]"):
        _check(led)


@KINDS
def test_a_queue_filed_under_another_streams_key_is_caught(kind: str) -> None:
    led, stream, _ = _deferring(kind)
    other = FakeStream()
    led._streams[other.key] = led._streams.pop(stream.key)
    with pytest.raises(AssertionError, match=f"sits in the queue of stream {other.key}"):
        _check(led)


@KINDS
def test_a_batch_of_an_ordered_fence_in_the_side_list_is_caught(kind: str) -> None:
    led, stream, _ = _deferring(kind)
    moved = led._streams[stream.key].pop()
    led._unordered.append(moved)
    with pytest.raises(AssertionError, match="of an ordered fence sits in the side list"):
        _check(led)


@KINDS
@pytest.mark.parametrize("how", ["not listed", "more fences", "another fence's id"])
def test_a_wrong_side_list_index_entry_is_caught(kind: str, how: str) -> None:
    led, stream, unknown = _deferring(kind)
    (batch,) = led._unordered
    if how == "not listed":
        # A batch that left the side list (settled) but is still indexed.
        led._solo[id(unknown)] = Deferred(unknown, 0, (), batch.did, batch.items, batch.n, 0.0)
    elif how == "more fences":
        batch.rest = (EventFence(),)
    else:
        del led._solo[id(unknown)]
        led._solo[id(stream)] = batch
    with pytest.raises(AssertionError, match="indexed as waiting for one fence of unknown origin"):
        _check(led)


@KINDS
def test_an_index_of_a_side_list_no_longer_in_use_is_caught(kind: str) -> None:
    led, _, _ = _deferring(kind)
    led._unordered = list(led._unordered)  # replaced, the index kept
    with pytest.raises(AssertionError, match="an index of a side list no longer in use is kept"):
        _check(led)


@KINDS
@pytest.mark.parametrize("did", ["duplicate", "negative", "unissued"])
def test_a_bad_deferral_id_is_caught(kind: str, did: str) -> None:
    led, stream, _ = _deferring(kind)
    first, second = led._streams[stream.key]
    assert (first.did, second.did, led._next_did) == (0, 1, 3)
    second.did = {"duplicate": 0, "negative": -1, "unissued": 3}[did]
    with pytest.raises(AssertionError, match="has a duplicate or unissued deferral id"):
        _check(led)


@KINDS
def test_a_batch_waiting_twice_for_its_head_fence_is_caught(kind: str) -> None:
    led, stream, _ = _deferring(kind)
    batch = led._streams[stream.key][0]
    batch.rest = (batch.fence,)
    with pytest.raises(AssertionError, match="waits twice for its head fence"):
        _check(led)


@KINDS
@pytest.mark.parametrize("n", [0, 2])
def test_a_batch_whose_n_is_not_its_id_count_is_caught(kind: str, n: int) -> None:
    led, stream, _ = _deferring(kind)
    batch = led._streams[stream.key][0]
    led.pending += n - batch.n  # the pending count agrees: only n is off
    batch.n = n
    with pytest.raises(AssertionError, match=f"holds 1 ids, not n={n}"):
        _check(led)


# ------------------------------------------------------------------ allocated counts


def test_a_page_ledgers_allocated_count_off_its_states_is_caught() -> None:
    led = PageLedger(17)
    assert led.take(3) is not None and led.take(2, OWNED) is not None
    pending, quarantined = led.take(1), led.take(1)
    assert pending is not None and quarantined is not None
    led.free(pending, [EventFence()])
    faulted = FakeStream()
    fence = faulted.record()
    faulted.fault()
    led.free(quarantined, [fence])
    # The free ring has never wrapped (its ids end at the capacity), so a
    # capacity one larger reads the same ring and counts the same pages.
    assert led._head + led.free_count == led.capacity
    assert (led.allocated, led.pending, led.quarantined) == (5, 1, 1)
    led.check_invariants()
    led.capacity += 1
    with pytest.raises(AssertionError, match=r"allocated count 6 != 5"):
        led.check_invariants()


def test_a_row_ledgers_allocated_count_off_its_states_is_caught() -> None:
    led = SlotLedger(12)
    rows = led.take(6)
    assert rows is not None
    led.record_use(rows[1:2], EventFence())
    led.free(rows[2:3], EventFence())
    faulted = FakeStream()
    fence = faulted.record()
    faulted.fault()
    led.free(rows[3:4], fence)
    assert (led.allocated, led.pending, led.quarantined) == (4, 1, 1)
    led.check_invariants()
    led.capacity += 1
    with pytest.raises(AssertionError, match=r"allocated count 5 != 4"):
        led.check_invariants()


# ------------------------------------------------------------------ WaiterQueues


def _queues() -> WaiterQueues:
    def describe(need: Any) -> tuple[str, str]:
        return f"alloc({need})", f"{need} rows"

    return WaiterQueues(lambda need: None, lambda grant: None, describe)


def _enqueue(queues: WaiterQueues, need: int, priority: int = 0) -> Any:
    loop = asyncio.get_running_loop()
    window: collections.deque[float] = collections.deque()
    waiter, handle = queues.enqueue(need, priority, None, loop, window, Histogram())
    assert handle is None
    return waiter


async def test_a_waiter_count_off_the_queues_is_caught() -> None:
    async with bounded():
        queues = _queues()
        _enqueue(queues, 3)
        queues.check_invariants()
        queues.count += 1
        with pytest.raises(AssertionError, match="waiter count 2 != queued 1"):
            queues.check_invariants()
        queues.count -= 1
        assert queues.drop_all() == 1


async def test_a_priority_index_out_of_sync_is_caught() -> None:
    async with bounded():
        queues = _queues()
        _enqueue(queues, 3, priority=0)
        _enqueue(queues, 4, priority=2)
        assert queues._prios == [0, 2]
        queues.check_invariants()
        queues._prios.remove(2)
        with pytest.raises(AssertionError, match="priority index out of sync with the queues"):
            queues.check_invariants()
        assert queues.drop_all() == 2


async def test_an_empty_priority_queue_still_indexed_is_caught() -> None:
    async with bounded():
        queues = _queues()
        _enqueue(queues, 3)
        queues._queues[5] = collections.deque()
        bisect.insort(queues._prios, 5)
        with pytest.raises(AssertionError, match="an empty priority queue is still indexed"):
            queues.check_invariants()
        assert queues.drop_all() == 1


async def test_a_granted_waiter_still_queued_is_caught() -> None:
    async with bounded():
        queues = _queues()
        cancelled = _enqueue(queues, 2)
        granted = _enqueue(queues, 3)
        cancelled[1].cancel()  # legal: it leaves when its task resumes
        queues.check_invariants()
        granted[1].set_result([1, 2, 3])
        with pytest.raises(AssertionError, match="a settled waiter is still queued: 3"):
            queues.check_invariants()
        assert queues.drop_all() == 2


# ------------------------------------------------------------------ free's slow page path


@pytest.mark.parametrize("k", [3, 12], ids=["one-pass check", "vectorised check"])
async def test_freeing_a_row_whose_page_is_no_longer_owned_raises_changing_nothing(
    k: int,
) -> None:
    kv = KVPagePool(17, 4)
    async with bounded(), AsyncReqToTokenPool(4, 64, kv=kv) as pool:
        grant = await pool.admit(pages=k)
        pages = page_ids(pool.pages_of(grant.row))
        assert len(pages) == k
        led = kv.ledger
        # Corrupt the page ledger: the record and its seal are intact, but
        # its last page is ALLOCATED (as if detached behind the row's back).
        bad = pages[-1]
        led._state[bad] = ALLOCATED
        free_before = kv.available_size()
        with pytest.raises(InvalidSlotError, match=f"page {bad} is not owned by a row"):
            pool.free([grant.row])
        assert pool._ledger.state_of(grant.row) == "allocated"
        assert page_ids(pool.pages_of(grant.row)) == pages
        assert [led.state_of(p) for p in pages[:-1]] == ["owned by a row"] * (k - 1)
        assert kv.available_size() == free_before
        led._state[bad] = OWNED
        assert pool.free([grant.row]) == 1
        assert kv.available_size() == kv.capacity
        pool.check_invariants()
        kv.check_invariants()


# ------------------------------------------------------------------ FenceWatcher


def test_a_watchers_repr_says_running_or_stopped() -> None:
    watcher = FenceWatcher(lambda: None)
    assert repr(watcher) == "<FenceWatcher running polled=0 streams=0 watched=0>"
    watcher.stop()
    assert repr(watcher) == "<FenceWatcher stopped polled=0 streams=0 watched=0>"
    assert watcher.join(WAIT_S)


class _Signal(logging.Handler):
    """Keeps each record with message ``message`` and sets ``event`` then
    (caplog's handler, on the root logger, sees a record only after this
    one: no use for waiting on)."""

    def __init__(self, message: str) -> None:
        super().__init__()
        self.message = message
        self.records: list[logging.LogRecord] = []
        self.event = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage() == self.message:
            self.records.append(record)
            self.event.set()


def test_a_notify_that_raises_is_logged_and_the_poller_serves_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="asyncpool.watcher")  # whatever a test set before
    signal = _Signal("fence watcher notify failed")
    logger = logging.getLogger("asyncpool.watcher")
    logger.addHandler(signal)
    calls: list[int] = []
    again = threading.Event()

    def notify() -> None:
        calls.append(len(calls))
        if len(calls) == 1:
            raise RuntimeError("notify failed (simulated)")
        again.set()

    watcher = FenceWatcher(notify)
    try:
        first = EventFence()
        first.set()
        watcher.watch(first)
        assert signal.event.wait(WAIT_S), "the failing notify was not logged"
        (record,) = signal.records
        assert record.levelno == logging.ERROR and record.exc_info is not None
        assert isinstance(record.exc_info[1], RuntimeError)
        second = EventFence()
        second.set()
        watcher.watch(second)
        assert again.wait(WAIT_S), "the poller stopped serving after a failing notify"
        assert calls == [0, 1]
    finally:
        logger.removeHandler(signal)
        watcher.stop()
        assert watcher.join(WAIT_S)


class _CountingFence:
    """A fence of unknown origin that never completes; counts its queries."""

    def __init__(self) -> None:
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return False

    def synchronize(self) -> None:  # pragma: no cover - the watcher never calls it
        raise AssertionError("the poller called synchronize()")


class _BlockingFence(_CountingFence):
    """Blocks its second ``query()`` until ``release`` is set (``inside``
    set meanwhile): the poller's pass is held at this fence."""

    def __init__(self) -> None:
        super().__init__()
        self.inside = threading.Event()
        self.release = threading.Event()

    def query(self) -> bool:
        super().query()
        if self.queries == 2:
            self.inside.set()
            assert self.release.wait(WAIT_S)
        return False


def test_stop_during_a_poller_pass_ends_it_at_the_next_stop_check() -> None:
    every = watcher_mod._STOP_CHECK_EVERY
    entered, added = threading.Event(), threading.Event()
    asked: list[int] = []

    def alive() -> bool:
        # Asked before each pass: the first holds the poller until every
        # fence is watched, so the second pass lists them all, in order.
        asked.append(len(asked))
        if len(asked) == 1:
            entered.set()
            assert added.wait(WAIT_S)
        return True

    head = _BlockingFence()
    others = [_CountingFence() for _ in range(3 * every)]
    watcher = FenceWatcher(lambda: None, alive=alive)
    try:
        watcher.watch(head)  # the first pass lists this fence alone
        assert entered.wait(WAIT_S)
        for fence in others:
            watcher.watch(fence)
        added.set()
        assert head.inside.wait(WAIT_S), "the second pass never reached its first fence"
        watcher.stop()
        head.release.set()
        assert watcher.join(WAIT_S), "the poller did not exit after stop()"
        # Fences 1 .. every - 2 of the pass were asked; the stop check before
        # fence every - 1 ended it: no fence from there on was asked, and
        # the pass was not counted.
        assert [f.queries for f in others] == [1] * (every - 2) + [0] * (2 * every + 2)
        assert head.queries == 2 and watcher.polls == 1
    finally:
        head.release.set()
        added.set()
        watcher.stop()
        watcher.join(WAIT_S)


# ------------------------------------------------------------------ wait_fence


class _GateFence(_CountingFence):
    """Its first ``query()`` blocks until ``release`` is set, then answers done."""

    def __init__(self) -> None:
        super().__init__()
        self.inside = threading.Event()
        self.release = threading.Event()

    def query(self) -> bool:
        super().query()
        self.inside.set()
        assert self.release.wait(WAIT_S)
        return True


@pytest.mark.parametrize(
    "new_loop", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"]
)
def test_wait_fence_notify_after_its_loop_was_collected_returns_quietly(
    new_loop: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    loop = new_loop()
    waits = _LoopWaits(loop)
    watcher = waits._watcher
    errors: list[BaseException] = []
    notified = threading.Event()
    notify = watcher._notify

    def spy() -> None:  # what the poller calls once a fence completes
        try:
            notify()
        except BaseException as exc:
            errors.append(exc)
            raise
        finally:
            notified.set()

    watcher._notify = spy
    fence = _GateFence()
    try:
        watcher.watch(fence)
        # The poller asked alive() (the loop was open) and is in the fence's
        # query(): the loop goes away before it answers done.
        assert fence.inside.wait(WAIT_S)
        gone = weakref.ref(loop)
        loop.close()
        del loop
        gc.collect()
        assert gone() is None, "the event loop was not collected"
        fence.release.set()
        assert notified.wait(WAIT_S), "the poller never notified"
        assert errors == []
        assert waits._scheduled  # marked, with nothing to schedule it on
    finally:
        fence.release.set()
        watcher.stop()
        assert watcher.join(WAIT_S)
