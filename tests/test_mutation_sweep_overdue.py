"""Gaps found by a mechanical mutation sweep of ``asyncpool/overdue.py``.

Each test pins one behaviour that an ``ast``-generated mutant of
``overdue.py`` broke while every test file that exercises the module still
passed:

* ``fence_timeout`` must be a number > 0: 0 (and -0.0, a bool, inf, NaN,
  a string) raises ``ValueError`` at construction (no test passed a bad
  one; the mutant accepted 0, which would call every pending fence
  overdue at once);
* a fence once reported overdue is forgotten by the next check after it is
  no longer pending: the report does not keep it alive. A fence without
  weak references is remembered by a strong one; without the pruning
  (the mutants deleted it) a completed transfer handle, and whatever
  buffer it owns, would stay alive for the life of the pool.
"""

from __future__ import annotations

import gc
import logging
import math

import pytest
from helpers import ManualClock

from asyncpool import AsyncReqToTokenPool
from asyncpool.ledger import SlotLedger
from asyncpool.overdue import OverdueFences, check_fence_timeout


@pytest.fixture(autouse=True)
def _quiet_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.CRITICAL, logger="asyncpool")


@pytest.mark.parametrize("timeout", [0, 0.0, -0.0, -1, True, math.inf, math.nan, "1"])
def test_a_fence_timeout_that_is_not_a_number_above_zero_is_refused(timeout: object) -> None:
    with pytest.raises(ValueError, match="fence_timeout"):
        AsyncReqToTokenPool(3, 4, fence_timeout=timeout)  # type: ignore[arg-type]


def test_the_smallest_positive_fence_timeout_is_taken() -> None:
    assert check_fence_timeout(5e-324) == 5e-324  # as given, not rounded or refused
    pool = AsyncReqToTokenPool(3, 4, fence_timeout=5e-324)
    pool.check_invariants()


class _SlotsFence:
    """A transfer handle without weak references that says when it is
    collected (``dropped``)."""

    __slots__ = ("done", "dropped")

    def __init__(self, dropped: list[str]) -> None:
        self.done = False
        self.dropped = dropped

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True

    def __del__(self) -> None:
        self.dropped.append("collected")


def test_a_reported_fence_is_not_kept_alive_once_it_completes() -> None:
    clock = ManualClock()
    led = SlotLedger(8, clock=clock)
    overdue = OverdueFences(10.0, [led], clock=clock)
    dropped: list[str] = []
    rows = led.take(2)
    assert rows is not None
    fence = _SlotsFence(dropped)
    led.free(rows[:1], fence=fence)
    clock.now = 10.0
    overdue.check()  # reported (remembered: it takes no weak reference)
    assert overdue.counts() == (1, {"rows": 1})
    fence.done = True
    led.reclaim()
    assert overdue.counts() == (0, {})
    del fence
    other = _SlotsFence([])
    led.free(rows[1:], fence=other)
    clock.now = 20.0
    overdue.check()  # another overdue fence: the first is no longer pending
    gc.collect()
    assert dropped == ["collected"]
    other.done = True
    led.reclaim()
