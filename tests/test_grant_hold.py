"""``pool.hold_grants()``: growth first, against admissions queued in tasks.

Grant at hand-over gives the memory a free or a completed fence returns to
the queued ``alloc``/``admit`` waiters at once; a scheduler whose running
requests come up short of pages for decode growth, and whose new requests
await ``admit`` in tasks, retracts a victim only to see its pages go to the
next admission (a new engine developer's trial cancelled and re-queued its
admissions some 1,650 times per 300 requests to get round it). A hold gates
the grant loop: while it is held the memory stays free for ``extend`` and
``extend_rows``, ``try_alloc``/``try_admit`` answer None, ``alloc``/``admit``
queue, and releasing the last hold runs the grant loop. Holds nest, release
is idempotent, the gate of ``release_memory`` and ``close`` outlives a hold,
and only the loop's thread may hold or release. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest
from helpers import Streams, bounded, in_thread, spin, until, warnings_seen
from helpers import page_ids as ids

from asyncpool import (
    AsyncReqToTokenPool,
    GrantHold,
    KVPagePool,
    PoolBusyError,
    PoolClosedError,
    WrongThreadError,
)
from asyncpool.lifecycle import _warn_if_held


def paged(rows: int = 4, pages: int = 8) -> AsyncReqToTokenPool:
    return AsyncReqToTokenPool(rows + 1, 64, kv=KVPagePool(pages + 1, 4))


async def test_a_free_under_a_hold_grants_no_waiter_and_growth_takes_the_pages() -> None:
    async with bounded(), paged(rows=4, pages=8) as pool:
        running = await pool.admit(pages=4)
        victim = await pool.admit(pages=4)
        queued = asyncio.ensure_future(pool.admit(pages=4))
        await spin()
        assert not queued.done()
        assert pool.extend(running.row, 4) is None  # growth comes up short
        with pool.hold_grants() as hold:
            assert isinstance(hold, GrantHold) and hold.held and pool.grants_held
            victim_pages = ids(pool.pages_of(victim.row))
            pool.free([victim.row])  # the retraction
            await spin()
            assert not queued.done()  # grant at hand-over would have given it them
            grown = pool.extend(running.row, 4)
            assert grown is not None and sorted(ids(grown)) == sorted(victim_pages)
        assert not hold.held and not pool.grants_held
        await spin()
        assert not queued.done()  # the pages went to growth: nothing left for it
        pool.free([running.row])
        got = await queued
        assert len(ids(got.pages)) == 4
        pool.free([got.row])
        pool.check_invariants()


async def test_memory_a_fence_returns_under_a_hold_waits_for_growth() -> None:
    with Streams() as streams:
        step = streams.stream("forward")
        async with bounded(), paged(rows=4, pages=8) as pool:
            running = await pool.admit(pages=4)
            victim = await pool.admit(pages=4)
            gate = streams.gate(step)
            pool.record_use([running.row, victim.row], step.record())  # the step in flight
            queued = asyncio.ensure_future(pool.admit(pages=2))
            hold = pool.hold_grants()
            pool.free([victim.row])  # pending behind the step
            gate.open()
            # The watcher's wake-up reclaims on the loop with nobody calling the pool.
            await until(lambda: pool.kv is not None and pool.kv.pending_size() == 0)
            await spin()
            assert not queued.done()
            assert pool.extend(running.row, 4) is not None
            hold.release()
            await spin()
            assert not queued.done()
            pool.free([running.row])
            got = await queued
            pool.free([got.row])
            pool.check_invariants()


async def test_under_a_hold_new_calls_queue_and_try_calls_answer_none() -> None:
    async with bounded(), AsyncReqToTokenPool(3, 8) as pool:
        pool.free(await pool.alloc(1))  # opens the unchecked one-row paths
        hold = pool.hold_grants()
        row_task = asyncio.ensure_future(pool.alloc(1))  # first: any checked call closes them
        await spin()
        assert not row_task.done() and pool.waiting() == 1
        assert pool.try_alloc(1) is None
        hold.release()
        rows = await row_task
        assert len(rows) == 1
        pool.free(rows)
    async with bounded(), paged() as pool:
        hold = pool.hold_grants()
        assert pool.try_admit(pages=1) is None
        admit_task = asyncio.ensure_future(pool.admit(pages=1))
        await spin()
        assert not admit_task.done()
        hold.release()
        got = await admit_task
        pool.free([got.row])


async def test_a_one_row_free_under_a_hold_grants_nobody() -> None:
    async with bounded(), AsyncReqToTokenPool(2, 8) as pool:
        (row,) = await pool.alloc(1)
        waiter = asyncio.ensure_future(pool.alloc(1))
        await spin()
        hold = pool.hold_grants()
        assert pool.free([row]) == 1
        await spin()
        assert not waiter.done() and pool.available_size() == 1
        hold.release()
        assert await waiter == [row]
        pool.free([row])


async def test_holds_nest_and_release_is_idempotent() -> None:
    async with bounded(), AsyncReqToTokenPool(3, 8) as pool:
        first, second = pool.hold_grants(), pool.hold_grants()
        waiter = asyncio.ensure_future(pool.alloc(1))
        await spin()
        first.release()
        first.release()  # does not end the other hold
        await spin()
        assert pool.grants_held and not waiter.done()
        second.release()
        assert not pool.grants_held
        pool.free(await waiter)
        assert repr(first) == "<GrantHold released>"


async def test_a_cancelled_or_timed_out_waiter_under_a_hold_holds_nothing() -> None:
    async with bounded(), paged(rows=2, pages=4) as pool:
        with pool.hold_grants():
            cancelled = asyncio.ensure_future(pool.admit(pages=2))
            timed_out = asyncio.ensure_future(pool.admit(pages=2, timeout=0.001))
            await spin()
            cancelled.cancel()
            with pytest.raises(asyncio.CancelledError):
                await cancelled
            with pytest.raises(TimeoutError):
                await timed_out
            assert pool.waiting() == 0
        assert pool.available_size() == 2 and pool.kv is not None
        assert pool.kv.available_size() == 4
        pool.check_invariants()


async def test_release_memory_and_close_outlast_a_hold() -> None:
    async with bounded(), AsyncReqToTokenPool(3, 8) as pool:
        hold = pool.hold_grants()
        await pool.release_memory()
        hold.release()  # the pool is still released: still gated
        assert pool.try_alloc(1) is None
        waiter = asyncio.ensure_future(pool.alloc(1))
        await spin()
        assert not waiter.done()
        await pool.resume_memory()
        pool.free(await waiter)
        # and the other way round: resumed while held stays gated
        await pool.release_memory()
        hold = pool.hold_grants()
        waiter = asyncio.ensure_future(pool.alloc(1))
        await spin()
        await pool.resume_memory()
        await spin()
        assert not waiter.done() and pool.try_alloc(1) is None
        hold.release()
        pool.free(await waiter)
    # a release_memory() that fails (cancelled in its drain) leaves the hold's gate
    with Streams() as streams:
        step = streams.stream("forward")
        async with bounded(), AsyncReqToTokenPool(3, 8) as pool:
            gate = streams.gate(step)
            pool.free(await pool.alloc(1), fence=step.record())  # pending behind the gate
            hold = pool.hold_grants()
            waiter = asyncio.ensure_future(pool.alloc(1))
            release = asyncio.ensure_future(pool.release_memory())
            await spin()
            release.cancel()
            with pytest.raises(asyncio.CancelledError):
                await release
            await spin()
            assert not pool.released and not waiter.done()
            hold.release()
            pool.free(await waiter)
            gate.open()
    async with bounded(), AsyncReqToTokenPool(3, 8) as pool:
        (row,) = await pool.alloc(1)
        hold = pool.hold_grants()
        waiter = asyncio.ensure_future(pool.alloc(1))
        await spin()
        await pool.close()
        with pytest.raises(PoolClosedError):
            await waiter
        hold.release()  # the last hold: the pool stays closed, gated for good
        pool.free([row])  # allowed after close; must not reopen a fast path
        with pytest.raises(PoolClosedError):
            await pool.alloc(1)
        with pytest.raises(PoolClosedError):
            pool.try_alloc(1)
        with pool.hold_grants():  # allowed after close; holds nothing
            pass


async def test_unloading_a_pool_with_requests_queued_takes_a_hold_before_the_frees() -> None:
    """The documented way to release a pool's memory while requests queue
    for it (a multi-model server unloading a model): without a hold, freeing
    the running requests hands their memory to the queued ones at once, so
    ``release_memory`` refuses; with one taken before the frees it releases,
    the queued keep their places, and ``resume_memory`` serves them."""
    async with bounded(), AsyncReqToTokenPool(3, 8, kv=KVPagePool(9, 4)) as pool:
        running = [await pool.admit(pages=4) for _ in range(2)]
        queued = [asyncio.ensure_future(pool.admit(pages=4)) for _ in range(2)]
        await spin()
        pool.free([g.row for g in running])  # no hold: granted at hand-over
        with pytest.raises(PoolBusyError, match="allocated"):
            await pool.release_memory()
        assert not pool.released
        running = [await w for w in queued]
        queued = [asyncio.ensure_future(pool.admit(pages=4)) for _ in range(2)]
        await spin()
        hold = pool.hold_grants()  # before the frees
        pool.free([g.row for g in running])
        await pool.release_memory()
        hold.release()  # released: the queued still wait
        await spin()
        assert pool.released and not any(w.done() for w in queued)
        assert pool.waiting() == 2
        await pool.resume_memory()
        pool.free([(await w).row for w in queued])
        pool.check_invariants()


async def test_only_the_loops_thread_holds_or_releases() -> None:
    async with bounded(), AsyncReqToTokenPool(3, 8) as pool:
        pool.free(await pool.alloc(1))  # bind
        with pytest.raises(WrongThreadError):
            in_thread(pool.hold_grants)
        assert not pool.grants_held and pool.try_alloc(1) is not None
        hold = pool.hold_grants()
        with pytest.raises(WrongThreadError):
            in_thread(hold.release)
        assert hold.held and pool.grants_held
        hold.release()
        assert not pool.grants_held


async def test_a_held_pool_says_so_and_its_gate_is_checked() -> None:
    async with bounded(), AsyncReqToTokenPool(3, 8) as pool:
        hold = pool.hold_grants()
        assert "held" in repr(pool)
        pool.check_invariants()
        pool._waiters.gated = False  # a gate opened under a hold
        with pytest.raises(AssertionError, match="not gated with closed=False released=False"):
            pool.check_invariants()
        pool._waiters.gated = True
        hold.release()
        assert "open" in repr(pool)
        pool._waiters.gated = True  # a gate nobody holds
        with pytest.raises(AssertionError, match="holds=0"):
            pool.check_invariants()
        pool._waiters.gated = False
        pool.check_invariants()


async def test_a_hold_shows_in_stats_and_the_metrics() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from asyncpool.metrics import PoolCollector

    async with bounded(), AsyncReqToTokenPool(3, 8) as pool:
        registry = CollectorRegistry()
        registry.register(PoolCollector(pool, name="decode"))

        def gauge(name: str = "grants_held") -> str:
            text = generate_latest(registry).decode()
            (line,) = [ln for ln in text.splitlines() if ln.startswith(f"asyncpool_{name}{{")]
            return line.rsplit(" ", 1)[1]

        assert not pool.stats().grants_held and gauge() == "0.0"
        with pool.hold_grants():
            assert pool.stats().grants_held and gauge() == "1.0"
            with pool.hold_grants():  # nested: the 0/1 gauge stays 1, the count is 2
                assert pool.grant_holds == pool.stats().grant_holds == 2
                assert gauge() == "1.0" and gauge("grant_holds") == "2.0"
            assert pool.grant_holds == pool.stats().grant_holds == 1
            assert pool.stats().grants_held and gauge() == gauge("grant_holds") == "1.0"
        assert not pool.stats().grants_held and gauge() == gauge("grant_holds") == "0.0"
        assert pool.grant_holds == pool.stats().grant_holds == 0


async def test_a_hold_collected_while_held_says_so_and_stays_held(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with bounded(), AsyncReqToTokenPool(3, 8) as pool:
        with caplog.at_level("ERROR", logger="asyncpool.lifecycle"):
            pool.hold_grants()  # the handle dropped at once
            gc.collect()
            kept = pool.hold_grants()
            kept.release()
            del kept
            gc.collect()
        errors = [r for r in caplog.records if "collected while held" in r.getMessage()]
        assert len(errors) == 1 and errors[0].levelname == "ERROR"
        assert pool.grants_held and pool.try_alloc(1) is None  # nothing releases it


async def test_a_hold_released_by_a_pass_that_finds_nothing_running() -> None:
    # The recipe's edge (a trial's reproducer): the stalled request finishes
    # while the hold is held, so no step is planned; the scheduler must still
    # release at that pass, or the re-queued victim waits for ever.
    async with bounded(), paged(rows=2, pages=2) as pool:
        a = await pool.admit(pages=1)
        b = await pool.admit(pages=1)
        assert pool.extend(a.row, 1) is None  # A stalls
        hold = pool.hold_grants()  # before retracting
        pool.free([b.row])
        b_again = asyncio.ensure_future(pool.admit(pages=1))
        pool.free([a.row])  # A finishes: nothing runs, nothing is stalled
        await spin()
        assert not b_again.done()  # held: the pass must let go
        hold.release()
        got = await b_again
        pool.free([got.row])


async def test_a_hold_kept_past_warn_after_warns_once_naming_the_waiters() -> None:
    # The trial's hang: its loop idled with the hold held, and nothing said so.
    async with bounded(), AsyncReqToTokenPool(3, 8) as pool:
        rows = await pool.alloc(2)
        with warnings_seen("hold_grants() hold") as seen:
            hold = pool.hold_grants(warn_after=0.01)
            waiter = asyncio.ensure_future(pool.alloc(1))
            await seen.event.wait()
            (message,) = seen.messages
            assert "held for 0.01 s, 1 waiters queued" in message
            assert hold.held
            other = pool.hold_grants(warn_after=None)  # no timer at all
            assert other._timer is None
            other.release()
            hold.release()
        pool.free(rows)
        pool.free(await waiter)


async def test_a_hold_released_in_time_cancels_its_warning() -> None:
    async with bounded(), AsyncReqToTokenPool(3, 8) as pool:
        with pool.hold_grants() as hold:  # the default: 10 s
            timer = hold._timer
            assert timer is not None and not timer.cancelled()
            # Float loop times (uvloop's are whole milliseconds): 10 s later can
            # read as 10.000000000001 s, so the upper bound has a tolerance.
            assert 9 < timer.when() - asyncio.get_running_loop().time() <= 10 + 1e-6
        assert timer.cancelled() and hold._timer is None


@pytest.mark.parametrize("bad", [0, -1, float("inf"), float("nan"), True, "1", [1]])
async def test_a_bad_warn_after_is_refused_and_holds_nothing(bad: object) -> None:
    async with bounded(), AsyncReqToTokenPool(3, 8) as pool:
        with pytest.raises(ValueError, match="warn_after must be None or a finite number > 0"):
            pool.hold_grants(warn_after=bad)  # type: ignore[arg-type]
        assert pool.grant_holds == 0 and not pool.grants_held
        assert pool.try_alloc(1) is not None


def test_a_hold_taken_with_no_running_loop_has_no_warning_timer() -> None:
    pool = AsyncReqToTokenPool(3, 8)
    hold = pool.hold_grants()
    assert hold._timer is None and pool.grants_held and pool.try_alloc(1) is None
    hold.release()
    assert pool.try_alloc(1) is not None


async def test_a_hold_carried_over_by_bind_is_released_without_touching_its_timer() -> None:
    # A review's find: release() from the thread bind() handed the pool to
    # cancelled the old loop's timer handle from that thread (asyncio's
    # handles are not thread-safe). The timer is left to its loop, and
    # finds the hold released when it fires.
    pool = AsyncReqToTokenPool(3, 8)
    hold = pool.hold_grants(warn_after=30)
    timer = hold._timer
    assert timer is not None

    def scheduler_thread() -> None:
        pool.bind()
        hold.release()

    in_thread(scheduler_thread, name="scheduler")
    assert not hold.held and not pool.grants_held and not timer.cancelled()
    with warnings_seen("hold_grants() hold") as seen:
        _warn_if_held(weakref.ref(hold), 30)  # what the timer runs, 30 s on
        assert seen.messages == []
    timer.cancel()  # (from its own loop: the test ends before it fires)


async def test_a_hold_on_a_closed_pool_arms_no_warning_and_a_close_silences_one() -> None:
    pool = AsyncReqToTokenPool(3, 8)
    held_before = pool.hold_grants(warn_after=30)
    timer = held_before._timer
    assert timer is not None
    await pool.close()
    after = pool.hold_grants(warn_after=30)
    assert after._timer is None  # it holds nothing there
    with warnings_seen("hold_grants() hold") as seen:
        _warn_if_held(weakref.ref(held_before), 30)  # the pool is closed now
        assert seen.messages == []
    timer.cancel()
    held_before.release()
    after.release()
