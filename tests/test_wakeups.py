"""``FenceWakeups`` on its own: the contract a pool relies on, with the
pool's side (its loop, closed, the fast-path gate, reclaim, grant) played
by a recorder, so each rule is pinned without rows, pages or a ledger.

* completions in a burst queue one wake-up, which closes the fast paths,
  then reclaims, then grants, in that order;
* a completion that lands while the wake-up reclaims queues another one
  (the flag is cleared before the reclaim asks the fences);
* a wake-up, a retry timer or a delayed re-watch timer queued on a loop the
  pool has left does nothing and touches nothing;
* a hand-over (``bind()``) forgets a delayed re-watch left on the old
  loop: its fences, that loop and the bounce counts;
* what fences hold (``notify``) holds the wake-ups weakly;
* a closed pool starts no watcher; an open one's watcher wakes it when a
  fence of unknown origin completes; ``close`` stops it.

Async tests run on asyncio and uvloop (conftest); every wait is bounded.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import weakref
from collections.abc import Callable

from helpers import EventFence, spin, until

from asyncpool import wakeups as wakeups_mod
from asyncpool.wakeups import FenceWakeups


class _Pool:
    """The pool's side of the contract, recording each call."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None) -> None:
        self.loop = loop
        self.closed = False
        self.calls: list[str] = []

    def reclaim(self) -> bool:
        self.calls.append("reclaim")
        return False

    def wakeups(self, reclaim: Callable[[], object] | None = None) -> FenceWakeups:
        return FenceWakeups(
            loop=lambda: self.loop,
            closed=lambda: self.closed,
            close_fast_paths=lambda: self.calls.append("close fast paths"),
            reclaim=self.reclaim if reclaim is None else reclaim,
            grant=lambda: self.calls.append("grant"),
            ledgers=(),
            log=logging.getLogger("asyncpool.pool"),
        )


ONE_WAKE_UP = ["close fast paths", "reclaim", "grant"]


async def test_a_burst_of_completions_queues_one_wake_up_in_order() -> None:
    pool = _Pool(asyncio.get_running_loop())
    wakeups = pool.wakeups()
    wakeups.notify()
    wakeups.notify()  # before the loop runs: coalesced
    await spin()
    assert pool.calls == ONE_WAKE_UP


async def test_a_completion_during_the_reclaim_queues_another_wake_up() -> None:
    pool = _Pool(asyncio.get_running_loop())

    def reclaim() -> bool:
        pool.reclaim()
        if pool.calls.count("reclaim") == 1:
            wakeups.notify()  # a fence completes after the reclaim asked it
        return False

    wakeups = pool.wakeups(reclaim)
    wakeups.notify()
    await spin()
    assert pool.calls == ONE_WAKE_UP * 2


async def test_a_wake_up_queued_on_a_loop_the_pool_left_does_nothing() -> None:
    pool = _Pool(asyncio.get_running_loop())
    wakeups = pool.wakeups()
    other = asyncio.new_event_loop()
    try:
        wakeups.notify()  # queued on this loop
        pool.loop = other  # the pool moves (bind() elsewhere) before it runs
        await spin()
        assert pool.calls == []
    finally:
        other.close()


async def test_timers_left_on_a_loop_the_pool_left_touch_nothing() -> None:
    """The timer callbacks run on the old loop's thread: they must not
    clear the notes the new loop's thread may be setting."""
    here = asyncio.get_running_loop()
    pool = _Pool(here)
    wakeups = pool.wakeups()
    fence = EventFence()
    wakeups._wake_retry = here
    wakeups._rewatch_timer = here
    wakeups._rewatch_due = [fence]
    other = asyncio.new_event_loop()
    try:
        pool.loop = other
        wakeups_mod._retry_wake_of(weakref.ref(wakeups), here)
        wakeups_mod._rewatch_due_of(weakref.ref(wakeups), here)
        assert pool.calls == []
        assert wakeups._wake_retry is here and wakeups._rewatch_timer is here
        assert wakeups._rewatch_due == [fence]
    finally:
        other.close()


def test_a_hand_over_forgets_the_old_loops_delayed_rewatch() -> None:
    """bind() with nothing pending: a delayed re-watch armed on the old loop
    (which stopped before its timer fired) holds fences nobody waits for
    any more, that loop, and bounce counts by id: all forgotten."""
    old = asyncio.new_event_loop()
    try:
        pool = _Pool(old)
        wakeups = pool.wakeups()
        fence = EventFence()
        wakeups._rewatch_timer = old
        wakeups._rewatch_due = [fence]
        wakeups._bounces[id(fence)] = 3
        fence_ref = weakref.ref(fence)
        del fence
        pool.loop = None  # bind() outside any loop
        wakeups.handed_over()
        gc.collect()
        assert fence_ref() is None
        assert wakeups._rewatch_timer is None
        assert wakeups._rewatch_due == [] and wakeups._bounces == {}
    finally:
        old.close()


def test_what_fences_hold_does_not_keep_the_wake_ups_alive() -> None:
    wakeups = _Pool(None).wakeups()
    notify, ref = wakeups.notify, weakref.ref(wakeups)
    assert notify.alive()
    del wakeups
    gc.collect()
    assert ref() is None and not notify.alive()
    notify()  # a late completion: nothing to wake, no error


async def test_the_watcher_starts_on_an_open_pool_wakes_it_and_stops_at_close() -> None:
    pool = _Pool(asyncio.get_running_loop())
    wakeups = pool.wakeups()
    pool.closed = True
    wakeups.watch(EventFence())
    assert wakeups.watcher is None  # no thread that close() would never stop
    pool.closed = False
    fence = EventFence()
    wakeups.watch(fence)
    watcher = wakeups.watcher
    assert watcher is not None and watcher.polling(fence)
    fence.set()
    await until(lambda: pool.calls == ONE_WAKE_UP)
    assert wakeups.close() is watcher
    assert wakeups.watcher is None and wakeups.close() is None
    assert watcher.join(1.0) and watcher.settled
