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
* ``make_explicit`` refuses a ledger with ids pending *or* quarantined,
  either alone (the mutant refused only both at once).

No test here awaits anything: the ledger is synchronous.
"""

from __future__ import annotations

import logging

import pytest
from helpers import EventFence, FakeStream

from asyncpool import FenceError
from asyncpool.deferral import Deferrals
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
