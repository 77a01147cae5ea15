"""Gaps found by a mechanical mutation sweep of the rest of ``asyncpool/deferral.py``.

The functions that settle batches were swept before
(``tests/test_mutation_sweep_deferral.py``); this sweep covered the others
(deferring, queueing, faults, views, explicit reclaim, agreement). Each
test pins one behaviour that an ``ast``-generated mutant broke while every
test that executes the mutated line still passed. They drive
:class:`~asyncpool.deferral.Deferrals` through a minimal ledger (ids are
ints, released and quarantined ids are recorded):

* ``pending_fences`` names the fence of every pending batch, each
  stream's head first, then the other batches of each stream queue, then
  the side list (the mutants named a stream's tail in place of its head,
  or skipped the second batch of a queue: a pool that adopts a page pool
  watches the fences this returns, so a fence left out would wake no
  admission when it completes);
* ``conclude`` of an ordered fence that raised quarantines the batches
  behind it in its stream queue, keeps the later batches of that queue and
  the other queues, removes a queue it empties, and reports the fault once
  (no test drove an explicit drain into a faulted *ordered* fence, so
  those lines never ran); ``conclude`` of an ordered fence that completed
  settles as ``retire`` would, every batch of its stream up to its ``seq``
  included, and marks the stream retired (the mutant took only the batches
  behind that very fence); ``conclude`` of a fence of unknown origin
  returns the ids it released (the mutant returned their negation); a
  faulted fence that heads several batches is handed to ``on_fault`` once
  for them all (the mutant reported each batch, then all of them again),
  and a batch agreed overdue that ``conclude`` quarantines leaves
  ``agreed_overdue`` (the mutant kept its deferral id there for good);
* ``agreement_flags`` skips a retired fence and goes on asking the
  batch's later fences (no test gave it a retired fence: the mutants
  stopped at it, calling the batch done while a later fence was open, or
  returned no flags at all);
* ``apply_agreement`` of a batch agreed done releases it even in explicit
  mode, where its other fences are not retired (the mutant left them to
  ``_settle``, which moved the batch behind them); of a batch agreed
  faulted where a fence raised here, it blames that fence, the first of
  the batch's fences that raised, and chains this rank's exception as the
  cause (the mutants blamed the head, the last faulted fence, or dropped
  the cause);
* a faulted fence that takes no weak reference is remembered itself and
  counted once however many frees meet it (the mutant remembered nothing
  for it, counting it again each time); the error kept in
  ``last_fence_error`` drops the traceback of an exception chained
  implicitly (``__context__``) inside ``query()`` too, which would pin
  ``query()``'s frame and its callers (the mutant followed ``__cause__``
  only);
* the side-list index, rebuilt at the first free after a call that
  dropped it, stays the ledger's: every later free behind a fence of
  unknown origin joins that fence's batch (the mutant kept the rebuilt
  index local to the one free, so the next free made a second batch and
  took a deferral id); an exception chain that loops (``__cause__``
  set by hand) ends the traceback cleanup (the mutant walked it for
  ever);
* ``remembers_fence`` answers for that very fence, not for another one
  that bears the id a remembered fence had (the mutant took any entry
  under the id);
* ``make_explicit`` refuses a ledger with ids pending *or* quarantined,
  either alone (the mutant refused only both at once).

A later hand-made sweep added:

* the side-list index, rebuilt, maps a fence to the *first* batch that
  waits for it alone, as the kept index does (a batch moved there behind
  it later is the second): a free joins the same batch whether or not a
  call dropped the index (the mutant rebuilt it with the last one);
* ``retire`` (and ``conclude``) of an older fence of a stream after a newer
  one keeps the newer mark: a free behind the newer fence waits for it no
  more (the mutant lowered the mark, and in explicit mode that free waited
  for a retire that had already come);
* the faults seen at agreements that settled nothing are kept up to
  ``_FAULTS_REMEMBERED``, not one fewer (the mutant forgot the oldest one
  early, and a fence that faulted then answered True would be released);
* a quarantine's log line lists up to sixteen ids in full and cuts more
  (the mutant cut exactly sixteen, with "(16 in all)").

No test here awaits anything: the ledger is synchronous.
"""

from __future__ import annotations

import logging

import pytest
from helpers import EventFence, FakeStream
from test_mutation_sweep_deferral import Ledger  # the smallest ledger

from asyncpool import FenceError
from asyncpool.deferral import _FAULTS_REMEMBERED, remember_fence, remembers_fence
from asyncpool.fences import Fence


@pytest.fixture(autouse=True)
def _quiet_fault_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.CRITICAL, logger="asyncpool")


def test_pending_fences_names_every_batch_heads_first() -> None:
    led = Ledger()
    a, b = FakeStream(), FakeStream()
    a1, a2, a3 = a.record(), a.record(), a.record()
    b1 = b.record()
    odd = EventFence()
    led.defer([1], a1)
    led.defer([2], a2)
    led.defer([3], a3)
    led.defer([4], b1)
    led.defer([5], odd)
    assert led.pending_fences() == [a1, b1, a2, a3, odd]


def test_conclude_of_a_faulted_ordered_fence_quarantines_what_waits_behind_it() -> None:
    led = Ledger()
    led.make_explicit()
    a, b = FakeStream(), FakeStream()
    a1, a2 = a.record(), a.record()
    b1 = b.record()
    led.defer([1, 2], a1)
    led.defer([3], a2)
    led.defer([4], b1)
    boom = FenceError("stream a faulted")
    assert led.conclude(a1, boom) == 0
    assert led.quarantined_ids == [1, 2] and led.quarantined == 2
    assert led.pending == 2 and led.released == []
    assert led.fence_errors == 1 and led.last_fence_error is boom
    assert [[batch.fence for batch in group] for group in led.batch_groups()] == [[a2], [b1]]
    assert led.conclude(a2, boom) == 0
    assert led.quarantined_ids == [1, 2, 3] and led.pending == 1
    assert [[batch.fence for batch in group] for group in led.batch_groups()] == [[b1]]
    assert a.key not in led._streams


def test_conclude_of_a_completed_ordered_fence_settles_as_retire_would() -> None:
    led = Ledger()
    led.make_explicit()
    a = FakeStream()
    a1, a2, a3 = a.record(), a.record(), a.record()
    led.defer([1], a1)
    led.defer([2], a2)
    led.defer([3], a3)
    assert led.conclude(a2, None) == 2
    assert led.released == [1, 2] and led.pending == 1
    assert led.is_retired(a1) and led.is_retired(a2) and not led.is_retired(a3)


def test_conclude_of_a_fence_of_unknown_origin_returns_the_ids_released() -> None:
    led = Ledger()
    led.make_explicit()
    odd, other = EventFence(), EventFence()
    led.defer([1, 2], odd)
    led.defer([3], other)
    assert led.conclude(odd, None) == 2
    assert led.released == [1, 2] and led.pending == 1
    assert led.pending_fences() == [other]


@pytest.mark.parametrize("what", ["pending", "quarantined"])
def test_make_explicit_refuses_ids_pending_or_quarantined_alone(what: str) -> None:
    led = Ledger()
    a = FakeStream()
    f = a.record()
    led.defer([1], f)
    if what == "quarantined":
        a.fault()
        led.reclaim()
        assert (led.pending, led.quarantined) == (0, 1)
    else:
        assert (led.pending, led.quarantined) == (1, 0)
    with pytest.raises(RuntimeError, match="nothing pending"):
        led.make_explicit()
    assert not led.explicit


def test_conclude_reports_a_fault_once_for_every_batch_it_heads() -> None:
    faults: list[tuple[Fence, BaseException]] = []
    led = Ledger(on_fault=lambda fence, err: faults.append((fence, err)))
    led.make_explicit()
    a, b = FakeStream(), FakeStream()
    a1, b1 = a.record(), b.record()
    led.defer([1], a1)
    led.defer([2], a1, b1)  # a second batch headed by a1
    boom = FenceError("stream a faulted")
    assert led.conclude(a1, boom) == 0
    assert sorted(led.quarantined_ids) == [1, 2] and led.pending == 0
    assert faults == [(a1, boom)]
    assert led.fence_errors == 1


def test_conclude_of_a_faulted_fence_forgets_an_agreed_overdue_batch() -> None:
    led = Ledger()
    led.make_explicit()
    odd = EventFence()
    led.defer([1], odd)
    [batch] = led.pending_batches()
    released, newly = led.apply_agreement([batch], [0, 1, 0], {})
    assert (released, newly) == (0, [batch])
    assert led.agreed_overdue == {batch.did}
    led.conclude(odd, FenceError("transfer failed"))
    assert led.quarantined_ids == [1]
    assert led.agreed_overdue == set()


def test_agreement_flags_asks_the_fences_after_a_retired_one() -> None:
    led = Ledger()
    led.make_explicit()
    a = FakeStream()
    a1 = a.record()
    head, later = EventFence(), EventFence()
    head.set()
    led.defer([1], head, a1, later)
    led.retire(a1)
    [batch] = led.pending_batches()
    assert led.agreement_flags([batch], {}, None, 0.0) == [0, 0, 0]
    later.set()
    assert led.agreement_flags([batch], {}, None, 0.0) == [1, 0, 0]


def test_apply_agreement_releases_a_done_batch_whatever_its_other_fences() -> None:
    led = Ledger()
    led.make_explicit()
    a = FakeStream()
    a1 = a.record()
    odd = EventFence()
    led.defer([1, 2], a1, odd)
    [batch] = led.pending_batches()
    assert led.apply_agreement([batch], [1, 0, 0], {}) == (2, [])
    assert led.released == [1, 2] and led.pending == 0
    assert led.pending_batches() == []


class _Raising(EventFence):
    def __init__(self, exc: BaseException) -> None:
        super().__init__()
        self.exc = exc

    def query(self) -> bool:
        raise self.exc


def test_apply_agreement_blames_the_first_fence_that_raised_here() -> None:
    faults: list[tuple[Fence, BaseException]] = []
    led = Ledger(on_fault=lambda fence, err: faults.append((fence, err)))
    led.make_explicit()
    head = EventFence()  # fine here
    first, second = _Raising(OSError("first")), _Raising(OSError("second"))
    led.defer([1], head, first, second)
    [batch] = led.pending_batches()
    cache: dict[int, tuple[Fence, int, BaseException | None]] = {}
    flags = led.agreement_flags([batch], cache, None, 0.0)
    assert flags == [0, 0, 1]
    assert led.apply_agreement([batch], flags, cache) == (0, [])
    assert led.quarantined_ids == [1] and led.pending == 0
    [(fence, err)] = faults
    assert fence is first
    assert isinstance(err, FenceError) and err.__cause__ is first.exc
    assert "faulted here" in str(err)


def test_apply_agreement_of_a_fault_seen_elsewhere_blames_the_head() -> None:
    faults: list[tuple[Fence, BaseException]] = []
    led = Ledger(on_fault=lambda fence, err: faults.append((fence, err)))
    led.make_explicit()
    head, other = EventFence(), EventFence()
    led.defer([1], head, other)
    [batch] = led.pending_batches()
    assert led.apply_agreement([batch], [0, 0, 1], {}) == (0, [])
    [(fence, err)] = faults
    assert fence is head and err.__cause__ is None
    assert "another rank" in str(err)


class _SlotsFence:
    """A fence of unknown origin that takes no weak reference."""

    __slots__ = ("queries",)

    def __init__(self) -> None:
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        raise OSError("transfer failed")

    def synchronize(self) -> None:
        raise OSError("transfer failed")


def test_a_fence_without_weak_references_is_counted_once() -> None:
    led = Ledger()
    fence = _SlotsFence()
    led.defer([1], fence)
    led.reclaim()
    led.defer([2], fence)
    led.reclaim()
    assert led.quarantined_ids == [1, 2]
    assert led.fence_errors == 1


class _Implicit(EventFence):
    """query() raises while handling another error, chained implicitly."""

    def query(self) -> bool:
        try:
            raise ConnectionError("socket closed")
        except ConnectionError:
            raise RuntimeError("transfer failed")  # noqa: B904


def test_a_kept_error_drops_an_implicitly_chained_traceback() -> None:
    led = Ledger()
    led.defer([1], _Implicit())
    led.reclaim()
    err = led.last_fence_error
    assert isinstance(err, FenceError) and isinstance(err.__cause__, RuntimeError)
    context = err.__cause__.__context__
    assert isinstance(context, ConnectionError)
    assert context.__traceback__ is None


def test_frees_after_the_side_list_index_is_rebuilt_join_their_batch() -> None:
    led = Ledger()
    x, y = EventFence(), EventFence()
    led.defer([1], x)
    led.defer([2], y)
    assert led.force_release(y) == 1  # drops the side-list index
    led.defer([3], x)  # rebuilds it
    led.defer([4], x)
    assert led.deferral_counter == 2
    [batch] = led.pending_batches()
    assert batch.fence is x and batch.items == [1, 3, 4] and batch.n == 3


def test_a_looping_exception_chain_ends_the_traceback_cleanup() -> None:
    first, second = OSError("transfer failed"), RuntimeError("peer gone")
    first.__cause__ = second
    second.__cause__ = first
    led = Ledger()
    led.defer([1], _Raising(first))
    led.reclaim()
    assert led.quarantined_ids == [1]
    err = led.last_fence_error
    assert isinstance(err, FenceError) and err.__cause__ is first


def test_remembers_fence_answers_for_that_very_fence_only() -> None:
    memory: dict[int, object] = {}
    f, g = EventFence(), EventFence()
    remember_fence(memory, f)
    assert remembers_fence(memory, f)
    memory[id(g)] = memory.pop(id(f))  # g bears the id f was remembered by
    assert not remembers_fence(memory, g)
    h, k = _SlotsFence(), _SlotsFence()  # remembered strongly
    remember_fence(memory, h)
    assert remembers_fence(memory, h)
    memory[id(k)] = memory.pop(id(h))
    assert not remembers_fence(memory, k)


def test_a_rebuilt_side_list_index_joins_the_first_batch_behind_the_fence() -> None:
    led = Ledger()
    a = FakeStream()
    head, x, other = a.record(), EventFence(), EventFence()
    led.defer([1], x)  # did 0: waits for x alone
    led.defer([2], head, x)  # did 1: moves behind x alone once head completes
    led.defer([3], other)
    a.complete()
    assert led.reclaim() == 0  # moved: two batches wait for x alone now
    led.defer([4], x)  # the kept index: joins the first of them
    assert led.force_release(other) == 1  # drops the side-list index
    led.defer([5], x)  # rebuilt: joins the same batch, as the kept index did
    assert led.deferral_counter == 3
    by_did = {batch.did: batch.items for batch in led.pending_batches()}
    assert by_did == {0: [1, 4, 5], 1: [2]}
    led.check()


def test_a_retire_of_an_older_fence_keeps_the_newer_mark() -> None:
    led = Ledger()
    led.make_explicit()
    a = FakeStream()
    f1, f2, f3 = a.record(), a.record(), a.record()
    led.defer([1], f2)
    assert led.retire(f2) == 1
    assert led.retire(f1) == 0  # older, after a newer one: nothing to settle
    assert led.conclude(f1, None) == 0  # a drain concluding it: the same
    assert led.is_retired(f1) and led.is_retired(f2) and not led.is_retired(f3)
    waits, faulted, _ = led._open_fences([f2, f3])  # a free behind both
    assert waits == [f3] and faulted is None  # waits for f3 alone
    led.check()


def test_faults_seen_at_agreements_that_settled_nothing_are_kept_to_the_bound() -> None:
    led = Ledger()
    led.make_explicit()
    fences = [EventFence() for _ in range(_FAULTS_REMEMBERED + 1)]
    for i, fence in enumerate(fences):
        fence.error = FenceError(f"transfer {i} failed")
        fence.set()
        led.defer([i], fence)
    batches = led.pending_batches()
    flags = led.agreement_flags(batches[:_FAULTS_REMEMBERED], {}, None, 0.0)
    assert flags == [0, 0, 1] * _FAULTS_REMEMBERED
    # Nothing applied: every one of them is still a fault, the oldest too.
    assert all(led.unagreed_fault(fence) is not None for fence in fences[:-1])
    led.agreement_flags(batches[-1:], {}, None, 0.0)  # one more: the oldest goes
    assert led.unagreed_fault(fences[0]) is None
    assert all(led.unagreed_fault(fence) is not None for fence in fences[1:])


@pytest.mark.parametrize("n", [16, 17])
def test_a_quarantine_log_lists_up_to_sixteen_ids_in_full(
    n: int, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="asyncpool")
    led = Ledger()
    fence = EventFence()
    led.defer(list(range(n)), fence)
    fence.error = FenceError("transfer failed")
    fence.set()
    assert led.reclaim() == 0 and led.quarantined == n
    [record] = [r for r in caplog.records if r.name == "asyncpool.deferral"]
    message = record.getMessage()
    if n == 16:
        assert f"quarantined rows {list(range(16))}:" in message
        assert "in all" not in message
    else:
        assert f"quarantined rows {str(list(range(16)))[:-1]}, ...] (17 in all):" in message
