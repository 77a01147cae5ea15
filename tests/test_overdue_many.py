"""Many stuck fences at once: a few lines, a list to act on, one call to end them.

An engine whose transfer peer died has hundreds of transfer handles
(fences of unknown origin) stuck at once. The overdue check names the
first few newly overdue fences at WARNING (oldest first), sums the rest in
one more WARNING and names them at DEBUG with a running count; after a
check that logged, the pool checks again no sooner than a pause later, so
fences turning overdue one after another are logged together.
``pool.overdue_fences()`` lists every overdue fence, oldest first, and
``force_release`` takes that list: validated whole before anything is
released, one log line for the call, the summed ``(rows, pages)``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from helpers import ManualClock, bounded, warnings_seen

from asyncpool import AsyncReqToTokenPool
from asyncpool.kv_pages import PageLedger
from asyncpool.ledger import SlotLedger
from asyncpool.overdue import OVERDUE_NAMED, OverdueFences

TIMEOUT = 10.0


class Transfer:
    """A transfer handle whose peer died: a fence of unknown origin that
    never lands (unless told to)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.landed = False

    def __repr__(self) -> str:
        return f"<Transfer {self.name}>"

    def query(self) -> bool:
        return self.landed

    def synchronize(self) -> None:  # never called by the pool on such a fence
        raise AssertionError("the pool must not block in a transfer's synchronize()")


class Records(logging.Handler):
    """Every record of the ``asyncpool`` logger, DEBUG and up."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def at(self, level: int) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno == level]


@pytest.fixture
def records() -> Iterator[Records]:
    handler = Records()
    log = logging.getLogger("asyncpool")
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def full_line(fence: Any, held: str) -> str:
    return (
        f"fence {fence!r} is overdue: pending for more than {TIMEOUT:.3g} s (fence_timeout), "
        f"holding {held}; the memory stays held (a late write may still land); call "
        "force_release(fence) only if its writer is known to be dead"
    )


def _stuck_ledgers(n: int) -> tuple[SlotLedger, PageLedger, OverdueFences, ManualClock, list[Any]]:
    """``n`` transfers, each holding a row and two pages, deferred one
    second apart, newest first in the side list's order of frees: fence
    ``i`` was freed at ``t = n - 1 - i`` (so the oldest is the last)."""
    clock = ManualClock()
    rows_led = SlotLedger(n + 4, clock=clock)
    pages_led = PageLedger(2 * n + 8, clock=clock)
    overdue = OverdueFences(TIMEOUT, [rows_led, pages_led], clock=clock)
    fences = [Transfer(f"t{i}") for i in range(n)]
    for fence in reversed(fences):  # t{n-1} first: the oldest
        rows = rows_led.take(1)
        pages = pages_led.take(2)
        assert rows is not None and pages is not None
        rows_led.free(rows, fence)
        pages_led.free(pages, [fence])
        clock.now += 1.0
    return rows_led, pages_led, overdue, clock, fences


# ------------------------------------------------------------ the check's lines


def test_many_newly_overdue_fences_log_a_few_lines_and_a_sum(records: Records) -> None:
    n = 256
    _, _, overdue, clock, fences = _stuck_ledgers(n)
    clock.now = n + TIMEOUT  # every one is overdue, all found by one check
    assert overdue.check() is None
    warnings = records.at(logging.WARNING)
    oldest = fences[::-1]
    assert warnings[:OVERDUE_NAMED] == [full_line(f, "1 row and 2 pages") for f in oldest[:3]]
    rest = n - OVERDUE_NAMED
    assert warnings[OVERDUE_NAMED:] == [
        f"and {rest} more fences are overdue in this check, holding {rest} rows and "
        f"{2 * rest} pages (the memory stays held); they are logged at DEBUG; "
        "overdue_fences() lists every overdue fence, and force_release takes a list of fences"
    ]
    debug = records.at(logging.DEBUG)
    assert len(debug) == rest
    assert (
        debug[0]
        == f"fence {oldest[3]!r} is overdue (4 of {n} in this check), holding 1 row and 2 pages"
    )
    assert (
        debug[-1]
        == f"fence {oldest[-1]!r} is overdue ({n} of {n} in this check), holding 1 row and 2 pages"
    )
    assert all(r.funcName == "check" for r in records.records)
    # Logged once: the next check finds nothing new.
    records.records.clear()
    assert overdue.check() is None
    assert records.records == []


def test_debug_lines_are_not_formatted_while_debug_is_off(records: Records) -> None:
    _, _, overdue, clock, fences = _stuck_ledgers(6)
    asked: list[str] = []

    class Counted(Transfer):
        def __repr__(self) -> str:
            asked.append(self.name)
            return super().__repr__()

    for fence in fences:
        fence.__class__ = Counted
    logging.getLogger("asyncpool").setLevel(logging.INFO)
    clock.now = 6 + TIMEOUT
    overdue.check()
    assert len(records.at(logging.WARNING)) == OVERDUE_NAMED + 1
    assert set(asked) == {"t3", "t4", "t5"}  # the three named; the rest never formatted


@pytest.mark.parametrize("n", [1, 2, OVERDUE_NAMED])
def test_a_few_overdue_fences_each_log_their_line_as_before(records: Records, n: int) -> None:
    _, _, overdue, clock, fences = _stuck_ledgers(n)
    clock.now = n + TIMEOUT
    overdue.check()
    assert records.at(logging.WARNING) == [full_line(f, "1 row and 2 pages") for f in fences[::-1]]
    assert records.at(logging.DEBUG) == []


def test_one_more_overdue_after_a_flood_logs_its_own_line(records: Records) -> None:
    rows_led, _, overdue, clock, _ = _stuck_ledgers(8)
    clock.now = 8 + TIMEOUT
    overdue.check()
    records.records.clear()
    late = Transfer("late")
    rows = rows_led.take(1)
    assert rows is not None
    rows_led.free(rows, late)
    clock.now += TIMEOUT
    overdue.check()
    assert records.at(logging.WARNING) == [full_line(late, "1 row")]


async def test_after_a_check_that_logged_the_next_one_waits(records: Records) -> None:
    """Fences deferred a little apart turn overdue a little apart: the
    check after one that logged comes a pause later (1 s), so the next
    ones are logged together rather than a few lines a check."""
    clock = ManualClock()
    pool = AsyncReqToTokenPool(8, 4, fence_timeout=0.05)
    pool._ledger._clock = clock
    overdue = pool._overdue
    assert overdue is not None
    overdue._clock = clock
    first, second = Transfer("first"), Transfer("second")
    async with bounded():
        rows = await pool.alloc(2)
    with warnings_seen("is overdue") as seen:
        pool.free(rows[:1], fence=first)
        clock.now = 0.03
        pool.free(rows[1:], fence=second)
        clock.now = 0.06  # the first overdue when the timer fires; the second in 0.02 s
        async with bounded():
            await seen.event.wait()
    assert seen.messages == [full_line(first, "1 row").replace("10 s", "0.05 s")]
    timer = overdue.timer
    assert timer is not None
    assert timer.when() - asyncio.get_running_loop().time() > 0.5  # not 0.021 s
    for fence in (first, second):
        pool.force_release(fence)
    await pool.close()


def test_agree_logs_many_agreed_overdue_fences_the_same_way(group: Any, records: Records) -> None:
    pool = AsyncReqToTokenPool(8, 4, fence_timeout=1e-9, reclaim="explicit", name="tp")
    fences = [Transfer(f"t{i}") for i in range(5)]
    for fence in fences:
        rows = pool.try_alloc(1)
        assert rows is not None
        pool.free(rows, fence=fence)
    assert pool.agree(group) == (0, 0)
    warnings = [r for r in records.records if r.levelno == logging.WARNING]
    assert [r.getMessage()[:30] for r in warnings[:OVERDUE_NAMED]] == [
        f"pool 'tp': fence {f!r}"[:30] for f in fences[:OVERDUE_NAMED]
    ]
    assert (
        warnings[OVERDUE_NAMED]
        .getMessage()
        .startswith("pool 'tp': and 2 more fences are overdue in this check, holding 2 rows")
    )
    assert len(warnings) == OVERDUE_NAMED + 1
    assert all(r.funcName == "agree" for r in records.records)
    for fence in fences:
        fence.landed = True
    assert pool.agree(group) == (5, 0)
