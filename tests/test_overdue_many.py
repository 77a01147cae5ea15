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
import collections
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from helpers import (
    FakeStream,
    ManualClock,
    bounded,
    in_thread,
    kv_pool_state,
    kv_snapshot,
    ledger_snapshot,
    overdue_warnings,
    spin,
    warnings_seen,
)

from asyncpool import AsyncReqToTokenPool, KVPagePool, ReqToTokenPool, WrongThreadError
from asyncpool.kv_pages import PageLedger
from asyncpool.ledger import SlotLedger
from asyncpool.overdue import OVERDUE_NAMED, OverdueFences

TIMEOUT = 10.0


class Transfer:
    """A transfer handle whose peer died: a fence of unknown origin that
    never lands (unless told to); counts the ``query()`` calls."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.landed = False
        self.queries = 0

    def __repr__(self) -> str:
        return f"<Transfer {self.name}>"

    def query(self) -> bool:
        self.queries += 1
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
        f"holding {held}; the memory stays held (its work may still write or read it); call "
        "force_release(fence) only if that work is known to be dead"
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
    assert pool.force_release([first, second]) == (2, 0)
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
    assert pool.overdue_fences() == fences  # what agree() agreed, oldest first
    for fence in fences:
        fence.landed = True
    assert pool.agree(group) == (5, 0)


# ------------------------------------------------------------ the pool: list, release


def _clocked_pool(**kwargs: Any) -> tuple[AsyncReqToTokenPool, ManualClock]:
    """A pool with pages whose ledgers and overdue check read a clock the
    test moves (its timer still runs on the loop's clock: never reached)."""
    clock = ManualClock()
    pool = AsyncReqToTokenPool(16, 8, kv=KVPagePool(64, 4), fence_timeout=TIMEOUT, **kwargs)
    pool._ledger._clock = clock
    assert pool._pages is not None
    pool._pages.ledger._clock = clock
    assert pool._overdue is not None
    pool._overdue._clock = clock
    return pool, clock


async def test_overdue_fences_lists_them_oldest_first() -> None:
    pool, clock = _clocked_pool()
    stream = FakeStream()
    late, t1, t2, step = Transfer("late"), Transfer("t1"), Transfer("t2"), stream.record()
    grants = []
    for fence in (t2, step, t1):  # freed at t = 0, 1, 2
        async with bounded():
            g = await pool.admit(pages=2)
        grants.append(g)
        pool.free([g.row], fence=fence)
        clock.now += 1.0
    g = await pool.admit(pages=1)
    pool.free([g.row], fence=late)  # t = 3
    assert pool.overdue_fences() == []
    clock.now = 2 + TIMEOUT  # the first three are overdue, not `late`
    listed = pool.overdue_fences()
    assert listed == [t2, step, t1]
    assert pool.stats().overdue_fences == 3
    listed.clear()  # a new list: the pool keeps none
    assert pool.overdue_fences() == [t2, step, t1]
    with pytest.raises(WrongThreadError):
        in_thread(pool.overdue_fences)
    clock.now = 3 + TIMEOUT
    assert pool.overdue_fences() == [t2, step, t1, late]
    assert pool.force_release(pool.overdue_fences()) == (4, 7)
    assert pool.overdue_fences() == []
    await pool.close()


async def test_without_a_fence_timeout_none_is_overdue() -> None:
    pool = AsyncReqToTokenPool(4, 8)
    rows = await pool.alloc(1)
    pool.free(rows, fence=Transfer("stuck"))
    assert pool.overdue_fences() == []
    await pool.close()


async def test_force_release_of_a_list_sums_logs_once_and_serves_waiters(
    records: Records,
) -> None:
    pool, clock = _clocked_pool()
    fences = [Transfer(f"t{i}") for i in range(5)]
    for fence in fences:
        async with bounded():
            g = await pool.admit(pages=12)
        pool.free([g.row], fence=fence)
    waiter = asyncio.ensure_future(pool.admit(pages=12))  # 4 pages free, 60 pending
    await spin()
    assert pool.waiting() == 1
    clock.now = TIMEOUT
    records.records.clear()
    assert pool.force_release(pool.overdue_fences()) == (5, 60)
    assert records.at(logging.WARNING) == [
        "force_release(5 fences: <Transfer t0>, <Transfer t1>, <Transfer t2> and 2 more): "
        "5 rows and 60 pages returned to circulation without the fences completing"
    ]
    async with bounded():
        g = await waiter
    assert pool.stats().overdue_fences == 0 and pool.pending_size() == 0
    assert pool._wakeups.watcher is not None
    assert not any(pool._wakeups.watcher.polling(f) for f in fences)  # no longer asked
    pool.free([g.row])
    pool.check_invariants()
    await pool.close()


async def test_a_fence_listed_twice_is_released_and_counted_once(records: Records) -> None:
    pool, _clock = _clocked_pool()
    fences = [Transfer(f"t{i}") for i in range(2)]
    for fence in fences:
        async with bounded():
            g = await pool.admit(pages=12)
        pool.free([g.row], fence=fence)
    records.records.clear()
    a, b = fences
    assert pool.force_release([a, b, a, b]) == (2, 24)
    assert records.at(logging.WARNING) == [
        "force_release(2 fences: <Transfer t0>, <Transfer t1>): "
        "2 rows and 24 pages returned to circulation without the fences completing"
    ]
    records.records.clear()
    assert pool.force_release([a, a]) == (0, 0)  # one fence: the one-fence line
    (line,) = records.at(logging.WARNING)
    assert line.startswith("force_release(<Transfer t0>)"), line
    pool.check_invariants()
    await pool.close()


async def test_a_batch_behind_two_stuck_fences_is_released_asking_neither(
    records: Records,
) -> None:
    """``free(rows, fence=[a, b])`` with both stuck: the batch waits for
    one at a time, so only ``a`` is overdue; releasing ``a`` lists ``b``
    at once (the batch keeps its free's time); releasing both at once
    asks neither (one line)."""
    pool, clock = _clocked_pool()
    a, b = Transfer("a"), Transfer("b")
    async with bounded():
        first = await pool.admit(pages=2)
        second = await pool.admit(pages=2)
    pool.free([first.row], fence=[a, b])
    pool.free([second.row], fence=[a, b])
    clock.now = TIMEOUT
    assert pool.overdue_fences() == [a]
    asked = b.queries  # by the frees; the poller watches `a` alone
    records.records.clear()
    assert pool.force_release([a, b]) == (2, 4)
    assert b.queries == asked  # not asked whether it completed: released with `a`
    assert len(records.at(logging.WARNING)) == 1
    assert pool.overdue_fences() == []
    await pool.close()


async def test_releasing_the_listed_fence_lists_the_next_at_once() -> None:
    pool, clock = _clocked_pool()
    a, b = Transfer("a"), Transfer("b")
    async with bounded():
        g = await pool.admit(pages=2)
    pool.free([g.row], fence=[a, b])
    clock.now = TIMEOUT
    assert pool.overdue_fences() == [a]
    assert pool.force_release(pool.overdue_fences()) == (0, 0)
    assert pool.overdue_fences() == [b]
    assert pool.force_release(pool.overdue_fences()) == (1, 2)
    await pool.close()


async def test_released_uses_are_all_forgotten() -> None:
    """Rows used on both fences of a list, allocated still: releasing the
    list drops both uses, so their free is immediate."""
    pool, _ = _clocked_pool()
    a, b = Transfer("a"), Transfer("b")
    async with bounded():
        rows = await pool.alloc(2)
    pool.record_use(rows, [a, b])
    assert pool.force_release((a, b)) == (0, 0)
    before = pool.available_size()
    pool.free(rows)
    assert pool.available_size() == before + 2 and pool.pending_size() == 0
    await pool.close()


@pytest.mark.parametrize(
    "bad, words",
    [
        (["ok", 1], r"fence=\[1\] must be a fence"),
        (["ok", "ok", None], r"fence=\[2\] must be a fence"),
        ({"ok"}, r"other iterables are refused"),
        (iter(["ok"]), r"other iterables are refused"),
        ("ab", r"must be a fence .* or a sequence of fences"),
    ],
)
async def test_a_bad_list_is_refused_whole(records: Records, bad: Any, words: str) -> None:
    pool, clock = _clocked_pool()
    ok = Transfer("ok")
    async with bounded():
        g = await pool.admit(pages=2)
    pool.free([g.row], fence=ok)
    clock.now = TIMEOUT
    if isinstance(bad, list):
        bad = [ok if x == "ok" else x for x in bad]
    elif isinstance(bad, set):
        bad = {ok}
    elif not isinstance(bad, str):
        bad = iter([ok])
    before = kv_pool_state(pool), ledger_snapshot(pool._ledger)
    records.records.clear()
    with pytest.raises(TypeError, match=words):
        pool.force_release(bad)
    assert (kv_pool_state(pool), ledger_snapshot(pool._ledger)) == before
    assert records.records == []
    assert pool.overdue_fences() == [ok]
    assert pool.force_release(collections.deque([ok])) == (1, 2)  # a deque is a sequence
    await pool.close()


async def test_none_is_no_fence_to_release(records: Records) -> None:
    """``fence=None`` is "no fence" to a free; to ``force_release`` it is
    the wrong object: a ``TypeError`` on every pool, nothing changed."""
    pool, _ = _clocked_pool()
    async with bounded():
        g = await pool.admit(pages=2)
    pool.free([g.row], fence=Transfer("stuck"))
    sync = ReqToTokenPool(4, 4)
    kv = KVPagePool(8, 4)
    before = kv_pool_state(pool), ledger_snapshot(sync._ledger), kv_snapshot(kv)
    for target in (pool, sync, kv):
        with pytest.raises(TypeError, match="got None"):
            target.force_release(None)  # type: ignore[arg-type]
    assert (kv_pool_state(pool), ledger_snapshot(sync._ledger), kv_snapshot(kv)) == before
    assert records.records == []
    await pool.close()


async def test_an_empty_list_releases_nothing_and_logs_nothing(records: Records) -> None:
    pool, _ = _clocked_pool()
    records.records.clear()
    assert pool.force_release([]) == (0, 0)
    assert pool.force_release(()) == (0, 0)
    assert records.records == []
    await pool.close()


# ------------------------------------------------------------ the sync pool and a bare page pool


def test_sync_pool_force_release_of_a_list(records: Records) -> None:
    pool = ReqToTokenPool(8, 4)
    a, b, never = Transfer("a"), Transfer("b"), Transfer("never")
    rows = pool.alloc(3)
    assert rows is not None
    pool.free(rows[:1], fence=a)
    pool.free(rows[1:], fence=[a, b])
    before = ledger_snapshot(pool._ledger)
    with pytest.raises(TypeError, match=r"fence=\[1\]"):
        pool.force_release([a, "b"])
    assert ledger_snapshot(pool._ledger) == before
    records.records.clear()
    assert pool.force_release([a, b, never]) == 3
    assert records.at(logging.WARNING) == [
        "force_release(3 fences: <Transfer a>, <Transfer b>, <Transfer never>): 3 rows "
        "returned to circulation without the fences completing"
    ]
    records.records.clear()
    assert pool.force_release([a, b]) == 0
    assert "these fences hold nothing pending in this pool" in records.at(logging.WARNING)[0]


def test_bare_page_pool_force_release_of_a_list(records: Records) -> None:
    kv = KVPagePool(16, 4)
    a, b = Transfer("a"), Transfer("b")
    pages = kv.alloc(4)
    assert pages is not None
    kv.free(pages[:2], fence=[a, b])
    kv.free(pages[2:], fence=b)
    before = kv_snapshot(kv)
    with pytest.raises(TypeError, match=r"other iterables are refused"):
        kv.force_release({a, b})
    assert kv_snapshot(kv) == before
    records.records.clear()
    assert kv.force_release([a, b]) == 4
    assert records.at(logging.WARNING) == [
        "force_release(2 fences: <Transfer a>, <Transfer b>): 4 pages returned to "
        "circulation without the fences completing"
    ]


# ------------------------------------------------------------ landed after all


def test_a_fence_logged_overdue_that_lands_later_is_logged_once_at_info(
    records: Records,
) -> None:
    """The operator told "overdue" heard nothing when the transfer landed
    late (the on-call trial): the next reclaim's ``settled()`` says it
    completed, once; one that faults says so instead; a fence still
    pending says nothing."""
    rows_led, pages_led, overdue, clock, fences = _stuck_ledgers(3)
    clock.now = 3 + TIMEOUT
    overdue.check()
    assert len(records.at(logging.WARNING)) == 3 and overdue.reported
    records.records.clear()
    fences[0].landed = True
    rows_led.reclaim()
    pages_led.reclaim()
    overdue.settled()
    assert records.at(logging.INFO) == [
        f"fence {fences[0]!r}, logged overdue, completed: what it held is back in circulation"
    ]
    records.records.clear()
    overdue.settled()  # once
    overdue.check()  # the check forgets nothing it should say again
    assert records.records == []

    def dead() -> bool:
        raise RuntimeError("peer died")

    fences[1].query = dead  # type: ignore[method-assign]
    rows_led.reclaim()
    pages_led.reclaim()
    records.records.clear()  # the ledgers' fault lines
    overdue.check()  # the check says it too, when it runs first
    assert records.at(logging.INFO) == [
        f"fence {fences[1]!r}, logged overdue, holds nothing now: it faulted (what it held "
        "is quarantined; see the fault logged)"
    ]
    assert overdue.reported  # fences[2] still pending, still remembered


async def test_the_pools_wake_up_logs_a_late_landing(records: Records) -> None:
    """End to end: nobody calls the pool; the fence wake-up's reclaim logs it."""
    late = Transfer("late")
    with overdue_warnings() as overdue, warnings_seen("completed", logging.INFO) as landed:
        async with bounded(), AsyncReqToTokenPool(4, 8, fence_timeout=0.02) as pool:
            rows = await pool.alloc(1)
            pool.free(rows, fence=late)
            await overdue.wait()  # the overdue timer (0.02 s)
            late.landed = True  # the poller sees it and wakes the loop
            await landed.event.wait()
            assert pool.available_size() == 3
    assert records.at(logging.INFO) == [
        f"fence {late!r}, logged overdue, completed: what it held is back in circulation"
    ]
