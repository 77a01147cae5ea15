"""Gaps found by a mechanical mutation sweep of ``asyncpool/deferral.py``.

Each test pins one behaviour that an ``ast``-generated mutant of
``deferral.py`` broke while every test file that exercises the module
still passed. They drive :class:`~asyncpool.deferral.Deferrals` through a
minimal ledger (ids are ints, released and quarantined ids are recorded),
so what is pinned is the fence machinery itself:

* a batch released by its fence is observed in ``fence_histogram`` (the
  lifetime histogram the metrics export), not only in the latency window
  (the mutant dropped the observation);
* a batch whose head completed but that still waits for another fence
  *moves*: ``reclaim`` and ``retire`` report 0 ids released for it (the
  mutant reported -1), ``on_pending`` is told of its new head fence (the
  mutants announced nothing), and a batch that waits for three fences
  waits for each of them in turn (the mutant dropped the third when it
  moved behind the second);
* a ``query()`` that raises what is not an ``Exception`` while a batch
  moves leaves the batch behind its head, without announcing that head a
  second time (the mutant called ``on_pending`` again);
* a batch moved behind a fence of unknown origin sits in the side list
  with ``seq`` 0 (a documented attribute), and joins the side-list index
  when it waits for that fence alone: a later free behind the same fence
  joins its batch, as it would have joined a batch deferred there directly
  (the mutants left it out of the index, or indexed a batch that still
  waits for more, which held the later free behind a fence it never named);
* a batch moved behind a fence of a stream whose queue already holds a
  later fence's batch is inserted in record order, before it, so that
  ``reclaim``, which looks only at each queue's head, releases it when its
  fence completes (the mutants scanned for the place wrongly, or never
  ended the scan);
* ``retire`` leaves no empty queue behind for a stream it emptied (the
  mutants kept one per stream retired, for good);
* ``force_release`` of an ordered fence (not only of one of unknown
  origin) settles the batches behind it in every stream queue, keeps the
  later batches of the same queue and the queues it skips, drops the fence
  from the remaining fences of other batches, and removes a queue it
  empties (the mutants skipped the stream queues, stopped at the first
  queue or batch, lost the batches after the forced one, or kept a
  settled batch queued); it drops the fence from a side-list batch's
  remaining fences as well, and when a settle it starts is interrupted
  (a ``query()`` raising a BaseException) every batch not yet settled is
  queued again, unannounced (the mutants lost the third batch, or
  announced them again);
* a batch agreed overdue (``apply_agreement``) that then faults leaves
  ``agreed_overdue`` (the mutant kept its deferral id there for good);
* faulted fences are remembered, for counting each once, newest last: a
  fence met again becomes the newest, the oldest is forgotten past
  ``_FAULTS_REMEMBERED``, and a forgotten one is counted anew (the mutants
  did not refresh, did not forget, forgot the newest, or forgot one too
  early); a fault that is not a ``FenceError`` reaches ``last_fence_error``
  and ``on_fault`` as a ``FenceError`` whose cause is the original (the
  mutant dropped the cause);
* ``stream_key`` is a fence's stream only with an int ``stream_key`` *and*
  an int ``seq`` (the mutant took either);
* deferral ids count the batches created, one by one, joining a batch
  takes none, a batch that waits for more than one fence is never joined
  nor indexed, and a side-list batch has ``seq`` 0 (the mutants skipped
  ids, indexed a batch with more fences, or gave a side-list batch a
  non-zero ``seq``); batches behind one fence stay in deferral order in
  their queue, so they are released in it (the mutant queued a later
  free before an earlier batch of the same fence);
* ``reclaim`` quarantines every faulted batch of a stream queue at once,
  asks the side list past a faulted fence, drops the queues it empties
  (but not one a move refilled), faults a stream fence whose ``query()``
  answers neither yes nor no, and, interrupted by a BaseException from a
  side-list ``query()``, keeps every batch it did not settle (the mutants
  stopped at the first fault, kept empty queues, took "PENDING" for done,
  or lost a batch after the interruption).

No test here awaits anything: the ledger is synchronous.
"""

from __future__ import annotations

import logging

import pytest
from helpers import EventFence, FakeStream, ManualClock

from asyncpool import FenceError
from asyncpool.deferral import _FAULTS_REMEMBERED, Deferrals, stream_key
from asyncpool.fences import Fence


@pytest.fixture(autouse=True)
def _quiet_fault_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.CRITICAL, logger="asyncpool")


class Ledger(Deferrals[int]):
    """The smallest ledger: ids are ints, what leaves the queues is recorded."""

    unit = "rows"

    def __init__(self, **kw: object) -> None:
        self.announced: list[Fence] = []
        super().__init__(on_pending=self.announced.append, **kw)  # type: ignore[arg-type]
        self.released: list[int] = []
        self.quarantined_ids: list[int] = []

    def _release_items(self, items: list[int]) -> None:
        self.released.extend(items)

    def _quarantine_items(self, items: list[int]) -> None:
        self.quarantined_ids.extend(items)

    def _count_items(self, items: list[int]) -> int:
        return len(items)

    def defer(self, ids: list[int], fence: Fence, *rest: Fence, now: float = 0.0) -> None:
        self._defer(fence, list(ids), len(ids), now, tuple(rest))

    def check(self) -> None:
        def fail(msg: str) -> None:
            raise AssertionError(msg)

        self._check_deferrals(fail)


def test_a_release_is_observed_in_the_fence_histogram() -> None:
    clock = ManualClock(10.0)
    led = Ledger(clock=clock)
    s = FakeStream()
    f = s.record()
    led.defer([1, 2], f, now=clock())
    clock.now = 10.5
    s.complete()
    assert led.reclaim() == 2
    snap = led.fence_histogram.snapshot()
    assert snap.count == 1
    assert snap.sum_s == pytest.approx(0.5)
    assert list(led.fence_latencies) == [pytest.approx(0.5)]


def test_a_move_releases_nothing_and_announces_the_new_head() -> None:
    led = Ledger()
    a, b = FakeStream(), FakeStream()
    fa, fb = a.record(), b.record()
    led.defer([1], fa, fb)
    assert led.announced == [fa]
    a.complete()
    assert led.reclaim() == 0  # moved behind fb, nothing released
    assert led.pending == 1 and led.released == []
    assert led.announced == [fa, fb]
    [batch] = led.pending_batches()
    assert batch.fence is fb and batch.rest == ()
    led.check()
    b.complete()
    assert led.reclaim() == 1
    assert led.released == [1] and led.pending == 0


def test_retire_of_a_fence_that_moves_its_batch_releases_nothing() -> None:
    led = Ledger()
    led.make_explicit()
    a, b = FakeStream(), FakeStream()
    fa, fb = a.record(), b.record()
    led.defer([1], fa, fb)
    assert led.retire(fa) == 0
    assert led.pending == 1 and led.released == []
    assert led.retire(fb) == 1
    assert led.released == [1]


def test_a_batch_waits_for_each_of_three_fences_in_turn() -> None:
    led = Ledger()
    a, b, c = FakeStream(), FakeStream(), FakeStream()
    fa, fb, fc = a.record(), b.record(), c.record()
    led.defer([7], fa, fb, fc)
    a.complete()
    assert led.reclaim() == 0
    [batch] = led.pending_batches()
    assert batch.fence is fb and batch.rest == (fc,)
    b.complete()
    assert led.reclaim() == 0  # fc still open: the batch moves behind it
    assert led.released == [] and led.pending == 1
    assert led.announced == [fa, fb, fc]
    c.complete()
    assert led.reclaim() == 1
    assert led.released == [7]


class _Interrupt(BaseException):
    pass


class RaisingFence(EventFence):
    """A fence of unknown origin whose ``query()`` raises a BaseException."""

    def query(self) -> bool:
        raise _Interrupt


def test_a_baseexception_while_moving_keeps_the_batch_unannounced_again() -> None:
    led = Ledger()
    a = FakeStream()
    fa = a.record()
    odd = RaisingFence()
    led.defer([3], fa, odd)
    assert led.announced == [fa]
    a.complete()
    with pytest.raises(_Interrupt):
        led.reclaim()
    assert led.announced == [fa]  # its head was announced already
    [batch] = led.pending_batches()
    assert batch.fence is fa and batch.rest == (odd,)
    assert led.pending == 1
    led.check()


def test_a_batch_moved_to_the_side_list_has_seq_zero_and_joins_its_index() -> None:
    led = Ledger()
    a = FakeStream()
    fa = a.record()
    other, e = EventFence(), EventFence()
    led.defer([1], other)  # a side-list free: the side list is indexed
    led.defer([2], fa, e)
    a.complete()
    assert led.reclaim() == 0  # [2] moves behind e
    moved = next(b for b in led.pending_batches() if b.fence is e)
    assert moved.seq == 0 and moved.rest == ()
    led.check()
    led.defer([3], e)  # joins the batch waiting behind e alone
    assert len(led.pending_batches()) == 2
    assert sorted(moved.items) == [2, 3] and moved.n == 2
    led.check()
    e.set()
    assert led.reclaim() == 2
    assert sorted(led.released) == [2, 3]


def test_a_moved_batch_that_waits_for_more_is_not_joined() -> None:
    led = Ledger()
    a = FakeStream()
    fa = a.record()
    other, e, e2 = EventFence(), EventFence(), EventFence()
    led.defer([1], other)  # the side list is indexed
    led.defer([2], fa, e, e2)
    a.complete()
    assert led.reclaim() == 0  # [2] moves behind e, still waiting for e2
    led.check()
    led.defer([3], e)  # waits for e alone: a batch of its own
    led.check()
    e.set()
    assert led.reclaim() == 1
    assert led.released == [3]
    e2.set()
    assert led.reclaim() == 1
    assert led.released == [3, 2]


@pytest.mark.parametrize("moved", [1, 2], ids=["to-the-front", "between"])
def test_a_move_into_a_stream_queue_keeps_record_order(moved: int) -> None:
    led = Ledger()
    a, b = FakeStream(), FakeStream()
    fa = a.record()
    fb = [b.record() for _ in range(3)]
    for seq in (1, 2, 3):
        if seq != moved:
            led.defer([seq], fb[seq - 1])
    led.defer([moved], fa, fb[moved - 1])
    a.complete()
    assert led.reclaim() == 0  # the batch moves behind its fence of b
    queue = [bt.fence for bt in led.batch_groups()[0]]
    assert queue == fb
    led.check()
    for seq in (1, 2, 3):
        b.complete(upto=seq)
        assert led.reclaim() == 1
        assert led.released == list(range(1, seq + 1))


def test_retire_leaves_no_empty_stream_queue() -> None:
    led = Ledger()
    led.make_explicit()
    a = FakeStream()
    f1, f2 = a.record(), a.record()
    led.defer([1], f1)
    led.defer([2], f2)
    assert led.retire(f1) == 1
    assert list(led._streams) == [a.key]  # f2's batch still waits
    assert led.retire(f2) == 1
    assert led._streams == {}  # a retired stream costs nothing afterwards
    assert led.released == [1, 2] and led.pending == 0


def test_force_release_of_an_ordered_fence() -> None:
    led = Ledger()
    s1, s2, s3 = FakeStream(), FakeStream(), FakeStream()
    f1 = s1.record()
    f2a, f2b = s2.record(), s2.record()
    f3 = s3.record()
    led.defer([1], f1)  # a queue the call skips, scanned first
    led.defer([2], f2a)  # the fence forced
    led.defer([3], f2b)  # a later batch of the same queue, kept
    led.defer([4], f3, f2a)  # waits for f2a too: dropped from its rest
    assert led.holds(f2a)
    assert led.force_release(f2a) == 1
    assert led.released == [2]
    assert led.pending == 3
    assert not led.holds(f2a)
    assert f2a.queries == 0  # never asked
    led.check()
    by_fence = {b.fence: b for b in led.pending_batches()}
    assert set(by_fence) == {f1, f2b, f3}
    assert by_fence[f3].rest == ()
    s3.complete()
    assert led.reclaim() == 1
    assert led.released == [2, 4]
    s1.complete()
    s2.complete()
    assert led.reclaim() == 2
    assert sorted(led.released) == [1, 2, 3, 4] and led.pending == 0


def test_force_release_of_a_queue_s_only_fence_empties_it() -> None:
    led = Ledger()
    s = FakeStream()
    f = s.record()
    led.defer([5, 6], f)
    assert led.force_release(f) == 2
    assert led.pending == 0 and led.batch_groups() == []
    led.check()
    assert led.force_release(f) == 0  # holds nothing now
    assert led.released == [5, 6]


def test_force_release_interrupted_keeps_the_batches_not_yet_settled() -> None:
    led = Ledger()
    forced, odd = EventFence(), RaisingFence()
    led.defer([1], forced, odd)  # settling it asks odd, which raises
    led.defer([2], forced)  # more batches behind the forced fence
    led.defer([3], forced, EventFence())
    with pytest.raises(_Interrupt):
        led.force_release(forced)
    assert led.pending == 3 and led.released == []
    led.check()
    assert sorted(b.items[0] for b in led.pending_batches() if b.fence is forced) == [1, 2, 3]
    assert led.announced == [forced] * 3  # put back, not announced again


def test_force_release_drops_the_fence_from_a_side_list_batch() -> None:
    led = Ledger()
    forced, e, other = EventFence(), EventFence(), EventFence()
    led.defer([1], e, forced)
    led.defer([2], other, forced, e)
    assert led.force_release(forced) == 0
    by_fence = {b.fence: b for b in led.pending_batches()}
    assert by_fence[e].rest == ()
    assert by_fence[other].rest == (e,)
    assert not led.holds(forced)
    led.check()
    e.set()
    assert led.reclaim() == 1
    assert led.released == [1]


def test_a_batch_agreed_overdue_that_faults_leaves_agreed_overdue() -> None:
    led = Ledger()
    e = EventFence()
    led.defer([1], e)
    batches = led.pending_batches()
    released, newly = led.apply_agreement(batches, [0, 1, 0], {})
    assert released == 0 and newly == batches
    assert led.agreed_overdue == {batches[0].did}
    e.error = FenceError("stream died")
    e.set()
    assert led.reclaim() == 0
    assert led.quarantined_ids == [1] and led.quarantined == 1
    assert led.agreed_overdue == set()


def test_a_fault_met_again_is_remembered_as_the_newest() -> None:
    led = Ledger()
    keep: list[EventFence] = []

    def fault(fence: EventFence) -> None:
        led.defer([len(keep)], fence)
        fence.error = FenceError("faulted")
        fence.set()
        assert led.reclaim() == 0

    first = EventFence()
    keep.append(first)
    fault(first)
    for _ in range(_FAULTS_REMEMBERED - 1):  # remembered: first and these
        keep.append(EventFence())
        fault(keep[-1])
    assert led.fence_errors == _FAULTS_REMEMBERED
    fault(first)  # met again: counted once, now the newest remembered
    assert led.fence_errors == _FAULTS_REMEMBERED
    keep.append(EventFence())
    fault(keep[-1])  # one more: the oldest other one is forgotten, not first
    assert led.fence_errors == _FAULTS_REMEMBERED + 1
    fault(first)
    assert led.fence_errors == _FAULTS_REMEMBERED + 1
    fault(keep[1])  # the one forgotten: counted anew
    assert led.fence_errors == _FAULTS_REMEMBERED + 2


def test_a_fault_that_is_not_a_fence_error_is_wrapped_with_its_cause() -> None:
    faults: list[tuple[Fence, BaseException]] = []
    led = Ledger(on_fault=lambda f, e: faults.append((f, e)))
    e = EventFence()
    led.defer([1], e)
    cause = RuntimeError("device lost")
    e.error = cause
    e.set()
    assert led.reclaim() == 0
    err = led.last_fence_error
    assert isinstance(err, FenceError) and err.__cause__ is cause
    assert faults == [(e, err)]


class _Keyed:
    """A fence with a stream_key and the given seq (ordered only with an int seq)."""

    def __init__(self, key: object, seq: object) -> None:
        self.stream_key = key
        self.seq = seq

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        pass


def test_stream_key_needs_an_int_key_and_an_int_seq() -> None:
    assert stream_key(_Keyed(7, 3)) == 7
    assert stream_key(_Keyed(7, None)) is None
    assert stream_key(_Keyed(7, 3.0)) is None
    assert stream_key(_Keyed(None, 3)) is None
    assert stream_key(_Keyed("7", 3)) is None
    assert stream_key(EventFence()) is None
    s = FakeStream()
    assert stream_key(s.record()) == s.key


def test_deferral_ids_count_batches_one_by_one() -> None:
    led = Ledger()
    s = FakeStream()
    f1, f2 = s.record(), s.record()
    e1, e2 = EventFence(), EventFence()
    led.defer([1], f1)
    led.defer([2], e1)
    led.defer([3], f1)  # joins f1's batch: no new id
    led.defer([4], e1)  # joins e1's batch
    led.defer([5], f2)
    led.defer([6], e2)
    led.defer([7], e1, f2)  # more than one fence: a batch of its own
    assert sorted(b.did for b in led.pending_batches()) == [0, 1, 2, 3, 4]
    assert led.deferral_counter == 5
    assert sorted(b.seq for b in led.pending_batches() if stream_key(b.fence) is None) == [0] * 3
    led.check()


def test_batches_behind_one_fence_release_in_deferral_order() -> None:
    led = Ledger()
    s = FakeStream()
    f = s.record()
    e = EventFence()
    e.set()  # complete already: the first batch is released with f
    led.defer([1], f, e)
    led.defer([2], f)  # behind the same fence, deferred later
    assert [b.did for b in led.batch_groups()[0]] == [0, 1]
    s.complete()
    assert led.reclaim() == 2
    assert led.released == [1, 2]


def test_reclaim_quarantines_every_faulted_batch_of_a_queue_at_once() -> None:
    led = Ledger()
    s = FakeStream()
    f1, f2 = s.record(), s.record()
    led.defer([1], f1)
    led.defer([2], f2)
    s.fault()
    assert led.reclaim() == 0
    assert led.quarantined_ids == [1, 2] and led.pending == 0
    assert led._streams == {}  # no empty queue kept
    led.check()


def test_reclaim_asks_the_side_list_past_a_faulted_fence() -> None:
    led = Ledger()
    bad, good = EventFence(), EventFence()
    led.defer([1], bad)
    led.defer([2], good)
    bad.error = FenceError("faulted")
    bad.set()
    good.set()
    assert led.reclaim() == 1
    assert led.quarantined_ids == [1] and led.released == [2]
    assert led.pending == 0


def test_reclaim_drops_the_queues_it_empties() -> None:
    led = Ledger()
    a, b = FakeStream(), FakeStream()
    fa1, fa2, fb = a.record(), a.record(), b.record()
    led.defer([1], fa1)
    led.defer([2], fb, fa2)  # moves behind fa2 once fb completes
    a.complete(upto=1)
    b.complete()
    assert led.reclaim() == 1  # a's queue emptied, then refilled by the move
    assert list(led._streams) == [a.key]
    assert [bt.fence for bt in led.batch_groups()[0]] == [fa2]
    led.check()
    a.complete()
    assert led.reclaim() == 1
    assert led._streams == {}
    assert led.released == [1, 2]


class _Answering(_Keyed):
    def __init__(self, key: int, seq: int, answer: object) -> None:
        super().__init__(key, seq)
        self.answer = answer

    def query(self) -> bool:
        return self.answer  # type: ignore[return-value]


def test_reclaim_faults_a_stream_fence_that_answers_neither_yes_nor_no() -> None:
    led = Ledger()
    f = _Answering(5_000_000, 1, "PENDING")
    led.defer([1], f)
    assert led.reclaim() == 0
    assert led.released == [] and led.quarantined_ids == [1]
    assert isinstance(led.last_fence_error, FenceError)
    g = _Answering(5_000_001, 1, 1)  # an int 1 is a yes
    led.defer([2], g)
    assert led.reclaim() == 1 and led.released == [2]


def test_an_interrupted_side_list_reclaim_keeps_the_batches_not_settled() -> None:
    led = Ledger()
    waiting, bad, odd, later = EventFence(), EventFence(), RaisingFence(), EventFence()
    led.defer([0], waiting)  # asked, not done
    led.defer([1], bad)
    led.defer([2], odd)
    led.defer([3], later)
    bad.error = FenceError("faulted")
    bad.set()
    with pytest.raises(_Interrupt):
        led.reclaim()
    assert led.quarantined_ids == [1]
    assert led.pending == 3
    assert {b.fence for b in led.pending_batches()} == {waiting, odd, later}
    led.check()
