"""Gaps found by mutation testing of the waiter queues, deferral, overdue
fences and the fence watcher.

Each test pins one behaviour that a hand-written mutant of the library broke
while the rest of the suite still passed: a grant that must happen inside
the call that makes memory free, a waiter shed behind a faulted fence, the
row state ``force_release`` leaves, overdue accounting and its re-armed
check, and an idle poller woken by a new fence (the stress suite caught
that one only after a four-minute hang).

Async tests run on asyncio and uvloop (conftest); every wait that could hang
is bounded.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
import weakref

import pytest
from helpers import (
    WAIT_S,
    EventFence,
    FakeStream,
    ManualClock,
    assert_conserved,
    bounded,
    spin,
)

from asyncpool import AsyncReqToTokenPool, CapacityError
from asyncpool import watcher as watcher_mod
from asyncpool.ledger import SlotLedger
from asyncpool.overdue import OverdueFences
from asyncpool.watcher import FenceWatcher


@pytest.fixture(autouse=True)
def _quiet_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.CRITICAL, logger="asyncpool")


def make(size: int = 3, **kw) -> AsyncReqToTokenPool:
    return AsyncReqToTokenPool(size, 4, **kw)


async def queued(pool: AsyncReqToTokenPool, *specs: int) -> list[asyncio.Task]:
    """Start one ``alloc`` per spec and step until all of them are queued."""
    tasks = [asyncio.create_task(pool.alloc(n)) for n in specs]
    await spin()
    assert pool.waiting() == len(specs)
    return tasks


class _Seen(logging.Handler):
    """Collects the records containing ``word``; sets ``event`` at ``count``."""

    def __init__(self, word: str, count: int) -> None:
        super().__init__(logging.WARNING)
        self.word = word
        self.count = count
        self.event = asyncio.Event()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if self.word in record.getMessage():
            self.records.append(record)
            if len(self.records) >= self.count:
                self.event.set()  # logged on the loop's thread (a timer callback)


# ---------------------------------------------------------------- grants inside the freeing call


async def test_free_grants_a_head_that_fits_only_with_a_completed_fence():
    """The grant loop reclaims completed fences before it calls the head
    short: the head is served inside ``free()``, not on a later wake-up."""
    async with bounded(), make(3) as pool:  # 2 rows
        a, b = await pool.alloc(2)
        s = FakeStream()
        pool.free([a], fence=s.record())
        [w] = await queued(pool, 2)
        s.complete()  # its wake-up has not run: nothing yields below
        assert pool.free([b]) == 1
        assert pool.waiting() == 0  # granted within free()
        assert sorted(await w) == sorted([a, b])
        pool.free(await w)
        assert_conserved(pool)


async def test_reclaim_grants_waiters_inside_the_call():
    async with bounded(), make(3) as pool:
        rows = await pool.alloc(2)
        s = FakeStream()
        pool.free(rows, fence=s.record())
        [w] = await queued(pool, 2)
        s.complete()
        assert pool.reclaim() == 2
        assert pool.waiting() == 0  # not left to the watcher's wake-up
        assert sorted(await w) == sorted(rows)
        pool.free(rows)
        assert_conserved(pool)


# ---------------------------------------------------------------- cancelled waiters


async def test_a_waiter_cancelled_behind_a_blocked_head_leaves_the_queue_at_once():
    """Cancelled behind a head that does not fit, a waiter stops counting at
    once: waiting() and max_waiters see the queue as it is."""
    async with bounded(), make(3, max_waiters=2) as pool:
        held = await pool.alloc(1)
        head, behind = await queued(pool, 2, 1)
        behind.cancel()
        with pytest.raises(asyncio.CancelledError):
            await behind
        assert pool.waiting() == 1 and pool.stats().waiters == 1
        pool.check_invariants()
        late = asyncio.create_task(pool.alloc(1))
        await spin()
        assert not late.done() and pool.waiting() == 2  # queued, not refused
        assert pool.stats().rejections == 0
        pool.free(held)
        got = await head
        pool.free(got)
        pool.free(await late)
        assert_conserved(pool)


# ---------------------------------------------------------------- shedding after a fault


async def test_shedding_an_unfittable_head_serves_the_waiters_behind_it():
    """A fault makes the head's need impossible: it fails, and the smaller
    waiter behind it gets the free row at once (no other wake-up comes)."""
    async with bounded(), make(5) as pool:  # 4 rows
        held = await pool.alloc(3)
        s = FakeStream()
        pool.free(held[-1:], fence=s.record())  # one row free, one pending
        big, small = await queued(pool, 4, 1)
        s.fault()  # the watcher notices: one wake-up, before the shed
        with pytest.raises(CapacityError):
            await big
        [row] = await small
        assert row not in held and pool.stats().quarantined == 1
        pool.free([row, *held[:-1]])
        assert_conserved(pool)


# ---------------------------------------------------------------- force_release


async def test_force_release_of_a_fence_recorded_on_an_allocated_row_keeps_invariants():
    async with bounded(), make(3) as pool:
        [row] = await pool.alloc(1)
        stuck = FakeStream().record()
        pool.record_use([row], stuck)
        pool.force_release(stuck)
        assert_conserved(pool)  # the row is plain allocated again
        assert pool.free([row]) == 1
        assert_conserved(pool)


# ---------------------------------------------------------------- overdue fences


def _overdue_ledger(timeout: float) -> tuple[SlotLedger, OverdueFences, ManualClock]:
    clock = ManualClock()
    led = SlotLedger(8, clock=clock)
    return led, OverdueFences(timeout, [led], clock=clock), clock


def test_overdue_counts_every_batch_a_fence_holds():
    led, overdue, clock = _overdue_ledger(10.0)
    stuck, other = EventFence(), EventFence()
    rows = led.take(2)
    assert rows is not None
    a, b = rows
    led.free([a], fence=stuck)
    led.record_use([b], stuck)
    led.free([b], fence=other)  # a second batch whose head is `stuck`
    assert len(led.pending_batches()) == 2
    clock.now = 10.0  # exactly fence_timeout later: overdue
    assert overdue.counts() == (1, {"rows": 2})


def test_overdue_next_check_is_due_when_the_oldest_batch_turns_overdue():
    led, overdue, clock = _overdue_ledger(10.0)
    rows = led.take(2)
    assert rows is not None
    led.free(rows[:1], fence=EventFence())  # t0 = 0
    clock.now = 5.0
    led.free(rows[1:], fence=EventFence())  # t0 = 5
    clock.now = 6.0
    assert overdue.check() == pytest.approx(4.0)  # the oldest, at t = 10
    clock.now = 10.0
    assert overdue.counts() == (1, {"rows": 1})
    assert overdue.check() == pytest.approx(5.0)  # the other, at t = 15


def test_overdue_forgets_a_fence_once_it_holds_nothing():
    led, overdue, clock = _overdue_ledger(1.0)
    fence = EventFence()
    ref = weakref.ref(fence)
    rows = led.take(1)
    assert rows is not None
    led.free(rows, fence=fence)
    clock.now = 2.0
    overdue.check()  # logs it once
    fence.set()
    assert led.reclaim() == 1
    assert overdue.check() is None
    del fence
    gc.collect()
    assert ref() is None  # not kept alive by the log-once bookkeeping


async def test_a_later_fence_is_logged_overdue_without_another_free(caplog):
    """The overdue check re-arms itself for the next pending fence: a fence
    freed after the first check was armed is logged with no further call."""
    caplog.set_level(logging.WARNING, logger="asyncpool")
    seen = _Seen("overdue", count=2)
    log = logging.getLogger("asyncpool")
    log.addHandler(seen)
    first, second = EventFence(), EventFence()
    try:
        async with make(3, fence_timeout=0.2) as pool:
            a, b = await pool.alloc(2)
            pool.free([a], fence=first)  # arms the check for t = 0.2
            await asyncio.sleep(0.1)  # time passing, not synchronisation
            pool.free([b], fence=second)  # overdue at t = 0.3: a later check
            async with bounded():
                await seen.event.wait()
            one, two = (r.getMessage() for r in seen.records)
            assert repr(first) in one and repr(second) not in one
            assert repr(second) in two
            first.set()
            second.set()
            async with bounded():
                await pool.drain()
    finally:
        first.set()
        second.set()
        log.removeHandler(seen)


# ---------------------------------------------------------------- wake-ups


async def test_a_stale_wake_up_flag_of_another_loop_does_not_suppress_wake_ups(kit):
    """The coalescing flag is keyed to the loop. A completion that races a
    loop move (its thread read the old loop, then queued the wake-up there
    after the move reset the flag) leaves the old loop in the flag; set
    here directly. Wake-ups of the pool's own loop must still be queued."""
    stale = asyncio.new_event_loop()  # a loop the pool left; never runs again
    try:
        async with bounded(), make(3) as pool:
            rows = await pool.alloc(2)
            fence = kit.event_fence()
            pool.free(rows, fence=fence)
            [w] = await queued(pool, 2)
            pool._wakeups._wake_scheduled = stale
            fence.set()  # the watcher's wake-up is the only call into the pool
            assert sorted(await w) == sorted(rows)
            pool.free(rows)
            assert_conserved(pool)
    finally:
        stale.close()


# ---------------------------------------------------------------- the poller


class _IdleCondition(threading.Condition):
    """Says whether a thread is blocked in ``wait()`` (``inside``, read under
    the condition's lock, is True only while a waiter has released it), for
    how long (``timeout``: the poller's backoff sleep and its idle linger are
    both waits on this condition), and how each wait ended (``ended``: True
    notified, False timed out)."""

    def __init__(self, lock: threading.Lock) -> None:
        super().__init__(lock)
        self.inside = False
        self.timeout: float | None = None
        self.ended: list[bool] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.inside = True
        self.timeout = timeout
        try:
            notified = super().wait(timeout)
        finally:
            self.inside = False  # the lock is held again here
        self.ended.append(notified)
        return notified


def test_a_fence_watched_while_the_poller_idles_wakes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # The idle wait is told from the backoff sleep by its timeout, made long
    # so that it cannot time out while the test looks: in CI's first run the
    # test once took the 50 µs backoff sleep after the first fence's pass
    # (polled empty by then) for the idle wait, and that sleep timed out.
    linger = 60.0
    monkeypatch.setattr(watcher_mod, "_STREAM_LINGER_S", linger)
    fired = threading.Event()
    watcher = FenceWatcher(fired.set)
    cond = watcher._poll_cond = _IdleCondition(watcher._lock)
    try:
        first = EventFence()
        first.set()
        watcher.watch(first)
        assert fired.wait(WAIT_S)
        # Until the poller has run out of fences and blocks for new ones
        # (it lingers there for a second before it exits).
        deadline = time.monotonic() + WAIT_S
        while True:
            with watcher._lock:
                if cond.inside and cond.timeout == linger and not watcher.polled:
                    idle_wait = len(cond.ended)  # the wait it is blocked in
                    break
            assert time.monotonic() < deadline, "the poller never went idle"
            time.sleep(0.001)
        fired.clear()
        second = EventFence()
        second.set()
        watcher.watch(second)
        assert fired.wait(WAIT_S)
        # watch() woke the idle wait: it did not merely time out (a second
        # later) and find the fence then.
        assert cond.ended[idle_wait] is True, "the idle poller was not woken by watch()"
    finally:
        watcher.stop()
        assert watcher.join(WAIT_S)


def _on_rewatch(pool: AsyncReqToTokenPool) -> asyncio.Event:
    """An event set each time the pool's wake-up has re-watched the fences
    its poller let go of (``_rewatch_dropped`` ran)."""
    rewatched = asyncio.Event()
    real = pool._wakeups._rewatch_dropped

    def spy(watcher: FenceWatcher) -> None:
        real(watcher)
        rewatched.set()

    pool._wakeups._rewatch_dropped = spy  # type: ignore[method-assign]
    return rewatched


class _GlitchOnce:
    """A transfer handle whose status poll fails once, from the pool's
    poller thread, then answers: not done until the test lands it."""

    def __init__(self, first: object, armed: threading.Event | None = None) -> None:
        self.first = first  # what the poller's first query() gets
        self.armed = armed  # until set, the poller is told "not done"
        self.glitched = threading.Event()
        self.landed = threading.Event()
        self.owner = threading.get_ident()

    def query(self) -> bool:
        if (
            threading.get_ident() != self.owner
            and not self.glitched.is_set()
            and (self.armed is None or self.armed.is_set())
        ):
            self.glitched.set()
            if isinstance(self.first, BaseException):
                raise self.first
            return self.first  # type: ignore[return-value]
        return self.landed.is_set()

    def synchronize(self) -> None:
        self.landed.wait()


@pytest.mark.parametrize("first", ["raises", "answers None"])
async def test_a_fence_the_poller_dropped_on_a_glitch_is_watched_again(
    first: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The poller drops a fence whose query() raised there (or answered
    neither yes nor no) and wakes the pool; the pool's own query says "not
    done", so its memory stays pending, and the pool watches it again: its
    completion wakes the waiter with nobody calling the pool. A review found
    the waiter hanging: nothing watched the fence any more."""
    caplog.set_level(logging.CRITICAL, logger="asyncpool")
    pool = AsyncReqToTokenPool(2, 8)  # one row
    transfer = _GlitchOnce(ConnectionError("status poll failed") if first == "raises" else None)
    # The pool's wake-up for the glitch (it asks the fence, then watches it
    # again): the test lands the transfer only after it.
    rewatched = _on_rewatch(pool)
    pool.free(await pool.alloc(1), fence=transfer)
    waiter = asyncio.ensure_future(pool.alloc(1))
    async with bounded():
        await rewatched.wait()
    assert transfer.glitched.is_set()
    assert not waiter.done() and pool.pending_size() == 1 and pool.stats().quarantined == 0
    assert pool._wakeups.watcher is not None and pool._wakeups.watcher.polling(transfer)
    transfer.landed.set()
    async with bounded():
        assert await waiter == [1]
    await pool.close()


class _BlockingOnce:
    """A transfer handle whose first status poll, from the poller, blocks
    until the test releases it (then: not done, until landed)."""

    def __init__(self, armed: threading.Event) -> None:
        self.armed = armed  # until set, the poller is told "not done"
        self.entered = threading.Event()
        self.release = threading.Event()
        self.landed = threading.Event()
        self.owner = threading.get_ident()

    def query(self) -> bool:
        if (
            threading.get_ident() != self.owner
            and not self.entered.is_set()
            and self.armed.is_set()
        ):
            self.entered.set()
            self.release.wait(WAIT_S)
        return self.landed.is_set()

    def synchronize(self) -> None:
        self.landed.wait()


async def test_a_glitch_is_rewatched_when_another_wake_up_runs_mid_poll(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The poller counts a glitch only once the fence is off its list: a
    wake-up that ran while the poller still asked the other fences (here a
    slow one) saw the count move, found the glitched fence still polled,
    and took the count as handled; the poller's own wake-up then did
    nothing and the fence was never polled again (found by a review)."""
    caplog.set_level(logging.CRITICAL, logger="asyncpool")
    pool = AsyncReqToTokenPool(3, 8)  # two rows
    # Both misbehave only once both are watched, so that one poller pass
    # meets the glitch first and then blocks in the slow one.
    armed = threading.Event()
    glitch = _GlitchOnce(ConnectionError("status poll failed"), armed)
    slow = _BlockingOnce(armed)
    rows = await pool.alloc(2)
    pool.free(rows[:1], fence=glitch)  # polled first
    pool.free(rows[1:], fence=slow)  # then this one, which blocks the pass
    armed.set()
    waiter = asyncio.ensure_future(pool.alloc(2))
    async with bounded():
        await asyncio.to_thread(slow.entered.wait, WAIT_S)  # mid-pass
    assert glitch.glitched.is_set()
    pool._wakeups.notify()  # another wake-up (a host fence, a stream thread) runs now
    await spin()
    slow.release.set()  # the pass ends: the glitched fence leaves the list
    rewatched = _on_rewatch(pool)
    async with bounded():
        await rewatched.wait()
    assert pool._wakeups.watcher is not None and pool._wakeups.watcher.polling(glitch)
    glitch.landed.set()
    slow.landed.set()
    async with bounded():
        assert sorted(await waiter) == rows
    await pool.close()


def test_a_poller_that_ended_idle_is_started_again_by_the_next_watch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A poller with nothing to poll exits after its linger and forgets
    itself, so the next ``watch()`` starts a new one: a mutant that left the
    dead thread recorded only notified it, and the new fence was never
    polled (its completion woke nobody)."""
    monkeypatch.setattr(watcher_mod, "_STREAM_LINGER_S", 0.01)
    fired = threading.Semaphore(0)
    watcher = FenceWatcher(fired.release)
    try:
        first = EventFence()
        first.set()
        watcher.watch(first)
        assert fired.acquire(timeout=WAIT_S)
        thread = watcher._thread
        assert thread is not None
        thread.join(WAIT_S)  # ends once it has idled past its linger
        assert not thread.is_alive(), "the idle poller did not end"
        second = EventFence()
        second.set()
        watcher.watch(second)
        assert fired.acquire(timeout=WAIT_S), "a fence watched after the poller ended woke nobody"
    finally:
        watcher.stop()
        assert watcher.join(WAIT_S)


def test_rewatch_counts_only_the_fences_it_polls_again() -> None:
    """``rewatch`` polls again only the fences the poller no longer polls and
    returns how many: one still polled is neither counted nor watched twice
    (the mutant re-added every fence it was given)."""
    watcher = FenceWatcher(lambda: None)
    try:
        polled, dropped = EventFence(), EventFence()
        watcher.watch(polled)
        assert watcher.rewatch([polled]) == 0
        assert watcher.watched == 1
        assert watcher.rewatch([polled, dropped]) == 1
        assert watcher.watched == 2 and watcher.polling(dropped)
    finally:
        watcher.stop()
        assert watcher.join(WAIT_S)
