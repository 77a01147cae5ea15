"""Gaps found by a mechanical mutation sweep of ``asyncpool/ledger.py``
(``SlotLedger``'s free paths, recorded uses, hand-out and give-back, and the
input helpers).

Each test pins one behaviour that a generated mutant broke while every test
file that exercises the ledger still passed:

* ``free`` interrupted by a fence's ``query()`` raising what is not an
  ``Exception`` (``CancelledError``) still files the rows it had already
  decided: a row left pending behind an open fence earlier in the call sits
  in a batch (reclaimed once its fence completes), and a row quarantined
  behind a faulted fence earlier in the call is reported (counted, handed to
  ``on_fault``), before the exception propagates;
* the error of a faulted fence is not carried over to the next distinct
  fence of the same call: rows behind a completed fence met after a faulted
  one, two in a row, go free, not to quarantine;
* ``forget_use`` drops the fence from every row's recorded uses, a row
  holding several uses among them: a row that carried only that fence is
  plain allocated again (free at once, invariants hold), a row that carried
  it with others waits for the others only, a row that never carried it is
  untouched (no error for a row holding one other fence); the count returned
  is the rows it touched; forgetting each of a row's two uses in turn
  leaves it plain allocated;
* a row used on several streams keeps the newest use of each stream only:
  a newer fence of a stream replaces the older one in its uses (so a free
  waits for the newer, not only for the older), an older fence recorded
  late does not replace the newer, and recording the same fence again adds
  nothing: the uses stay one per stream plus each unordered fence once,
  however many steps record them (no growth per step);
* ``put_back`` files the rows it returns as clean on top of the clean rows
  already free: handing out every free row afterwards resets nothing;
* ``take_unreset`` of clean rows only leaves the other clean rows clean
  (no needless reset of them later) and counts the rows it took as no
  longer clean (a row freed since is reset before its next owner gets it);
* ``check_size`` takes ``MAX_ROWS_SIZE`` itself and refuses one more (the
  pool tests of a huge size would build the ledger's lists for minutes, and
  fill memory, if the bound stopped refusing);
* ``as_index`` of a 0-d scalar of a library with no ``is_meta`` (not torch:
  cupy, say) whose ``item()`` raises lets that device error through as it
  is, as for a torch tensor: it is not bad input.

The ledger is plain synchronous bookkeeping: nothing here awaits.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from helpers import EventFence, FakeStream

from asyncpool import CapacityError, FenceError
from asyncpool.fences import Fence
from asyncpool.ledger import ALLOCATED, MAX_ROWS_SIZE, SlotLedger, as_index, check_size


@pytest.fixture(autouse=True)
def _quiet_fault_logs(caplog: pytest.LogCaptureFixture) -> None:
    # Faults are logged at ERROR on purpose; keep the test output readable.
    caplog.set_level(logging.CRITICAL, logger="asyncpool")


class _Cancelling:
    """A fence of unknown origin whose ``query()`` raises ``CancelledError``."""

    def query(self) -> bool:
        raise asyncio.CancelledError

    def synchronize(self) -> None:
        pass


@pytest.mark.parametrize("earlier", ["pending", "faulted"])
def test_a_cancelled_query_mid_free_files_the_rows_already_decided(earlier: str) -> None:
    faults: list[tuple[Fence, BaseException]] = []
    led = SlotLedger(6, on_fault=lambda f, e: faults.append((f, e)))
    rows = led.take(3)
    assert rows == [1, 2, 3]
    stream = FakeStream()
    first: Any = stream.record()
    if earlier == "faulted":
        stream.fault()
    led.record_use([1], first)
    led.record_use([2], _Cancelling())
    with pytest.raises(asyncio.CancelledError):
        led.free(rows)
    led.check_invariants()
    assert led.state_of(2) == "allocated" and led.state_of(3) == "allocated"
    if earlier == "pending":
        assert led.state_of(1) == "pending" and led.pending == 1
        stream.complete()
        assert led.reclaim() == 1
        assert led.state_of(1) == "free"
    else:
        assert led.state_of(1) == "quarantined" and led.quarantined == 1
        assert led.fence_errors == 1 and isinstance(led.last_fence_error, FenceError)
        assert [f for f, _ in faults] == [first]
    led.check_invariants()


def test_a_faulted_fence_error_does_not_stick_to_the_next_fence() -> None:
    led = SlotLedger(6)
    rows = led.take(4)
    assert rows == [1, 2, 3, 4]
    bad, good = FakeStream(), FakeStream()
    faulted = bad.record()
    bad.fault()
    completed = good.record()
    good.complete()
    led.record_use([1], faulted)
    led.record_use([2, 3, 4], completed)
    assert led.free(rows) == 3
    assert [led.state_of(r) for r in rows] == ["quarantined", "free", "free", "free"]
    assert led.quarantined == 1 and led.fence_errors == 1
    led.check_invariants()


def test_forget_use_drops_the_fence_from_single_and_several_uses() -> None:
    led = SlotLedger(8)
    rows = led.take(6)
    assert rows == [1, 2, 3, 4, 5, 6]
    a, b, c = EventFence(), EventFence(), EventFence()
    led.record_use([1, 2, 3], a)
    led.record_use([2, 3, 4], b)
    led.record_use([3], c)
    led.record_use([5], FakeStream().record())
    assert led.forget_use(a) == 3
    led.check_invariants()
    assert [led.state_of(r) for r in rows] == ["allocated"] * 6
    assert led.forget_use(a) == 0
    assert led.free(rows) == 2  # rows 1 and 6; 5 waits on its own fence
    assert [led.state_of(r) for r in rows] == [
        "free",
        "pending",
        "pending",
        "pending",
        "pending",
        "free",
    ]
    b.set()
    assert led.reclaim() == 2  # rows 2 and 4: a is not waited for
    c.set()
    assert led.reclaim() == 1
    assert led.state_of(3) == "free" and led.pending == 1
    led.check_invariants()


def test_forgetting_each_of_two_uses_in_turn_leaves_the_row_plain_allocated() -> None:
    # Forgetting one of two uses leaves the other as a single use (not a
    # one-fence tuple): forgetting that one as well then drops it, and the
    # row is plain allocated, free at once.
    led = SlotLedger(4)
    rows = led.take(2)
    assert rows == [1, 2]
    a, b = EventFence(), EventFence()
    led.record_use(rows, a)
    led.record_use(rows, b)
    assert led.forget_use(a) == 2
    assert [led.state_of(r) for r in rows] == ["allocated"] * 2
    led.check_invariants()
    assert led.forget_use(b) == 2
    for row in rows:  # no recorded use left, not an empty one
        assert led._uses[row] is None and led.state_bytes()[row] == ALLOCATED
    led.check_invariants()
    assert led.free(rows) == 2  # neither fence completed: nothing holds them
    assert [led.state_of(r) for r in rows] == ["free"] * 2
    led.check_invariants()


def test_a_row_used_on_several_streams_keeps_the_newest_use_of_each() -> None:
    led = SlotLedger(4)
    rows = led.take(2)
    assert rows == [1, 2]
    s1, s2 = FakeStream(), FakeStream()
    odd = EventFence()
    first = s1.record()
    for _ in range(50):  # steps of an overlap engine: both rows, both streams
        led.record_use(rows, s1.record())
        led.record_use(rows, s2.record())
        led.record_use(rows, odd)
    led.record_use(rows, first)  # older than what row 1 holds: no effect
    for row in rows:
        uses = led._uses[row]
        assert isinstance(uses, tuple) and len(uses) == 3
    assert led.forget_use(first) == 0  # superseded by the newer fences of s1
    assert led.free(rows) == 0
    s1.complete(s1.seq - 1)  # all but the newest fence of s1
    s2.complete()
    odd.set()
    assert led.reclaim() == 0  # the rows still wait for the newest of s1
    s1.complete()
    assert led.reclaim() == 2
    led.check_invariants()


def test_put_back_keeps_every_clean_row_clean() -> None:
    resets: list[list[int]] = []
    led = SlotLedger(6, on_reset=resets.append)
    taken = led.take(5)
    assert taken is not None
    led.free(taken)  # all dirty now, row order 1..5
    rows = led.take(2)
    assert rows == [1, 2] and resets == [[1, 2, 3, 4, 5]]
    led.put_back(rows)
    led.check_invariants()
    assert led.take(5) == [1, 2, 3, 4, 5]
    assert resets == [[1, 2, 3, 4, 5]] and led.resets == 1  # all were clean
    led.check_invariants()


def test_take_unreset_keeps_the_clean_count_true() -> None:
    resets: list[list[int]] = []
    led = SlotLedger(6, on_reset=resets.append)
    assert led.take_unreset(2) == ([1, 2], [])  # clean rows only
    led.check_invariants()
    assert led.take(2) == [3, 4]
    assert resets == []  # still clean: nothing to reset
    led.free([1, 2])  # the free queue: [5] clean, [1, 2] dirty
    assert led.take(3) == [5, 1, 2]
    assert resets == [[1, 2]]  # the rows freed since are reset, not the clean one
    led.check_invariants()


def test_check_size_takes_the_largest_size_and_refuses_one_more() -> None:
    check_size(MAX_ROWS_SIZE)
    with pytest.raises(CapacityError, match=r"at most 2\*\*31"):
        check_size(MAX_ROWS_SIZE + 1)


class _FaultedForeignScalar:
    """A 0-d device scalar of a library other than torch (no ``is_meta``)
    after a sticky fault: ``item()`` raises the device's error."""

    ndim = 0

    def item(self) -> int:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_a_device_error_of_a_foreign_scalar_is_not_bad_input() -> None:
    with pytest.raises(RuntimeError, match="illegal memory access"):
        as_index(_FaultedForeignScalar())
    led = SlotLedger(4)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        led.check_n(_FaultedForeignScalar())
