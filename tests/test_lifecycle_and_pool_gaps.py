"""Gaps found by hand-made mutation testing of the pool's lifecycle half
(``drain``, ``close``, ``release_memory``/``resume_memory``) and of the parts
of ``AsyncReqToTokenPool`` outside the grant loop (thread binding, loop
moves, ``free``'s checked paths, ``reclaim``, ``retire``, ``force_release``,
``lease``, fence wake-ups, shedding, ``stats``, ``check_invariants``).

Each test pins one behaviour that the rest of the suite let a one-line
change break unnoticed. Every await that could hang is bounded.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import pytest
import torch
from helpers import FakeStream, Streams, bounded, overdue_warnings, spin

from asyncpool import (
    AsyncReqToTokenPool,
    CapacityError,
    HostFence,
    KVPagePool,
    PoolClosedError,
    WrongThreadError,
)
from asyncpool.ledger import SlotLedger


class CountdownFence:
    """A fence of unknown origin that completes at its ``n``-th ``query()``."""

    def __init__(self, n: int) -> None:
        self.left = n

    def query(self) -> bool:
        self.left -= 1
        return self.left <= 0

    def synchronize(self) -> None:  # pragma: no cover - drain never blocks on a fence
        raise AssertionError("synchronize() called on a polled fence")


def _in_thread(fn: Any) -> Any:
    """Run ``fn()`` in a fresh thread; return its result or re-raise its error."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:
            out["error"] = exc

    th = threading.Thread(target=run, name="foreign")
    th.start()
    th.join(10)
    assert not th.is_alive(), "the foreign thread did not finish"
    if "error" in out:
        raise out["error"]
    return out.get("value")


async def _after_wake_ups(fence: HostFence) -> None:
    """Return once ``fence`` has settled and every loop wake-up it queued
    before this one (the pool's, registered earlier) has run."""
    loop = asyncio.get_running_loop()
    seen = asyncio.Event()
    fence.add_done_callback(lambda: loop.call_soon_threadsafe(seen.set))
    async with bounded():
        await seen.wait()


# ------------------------------------------------------------------ drain


def test_drain_from_a_foreign_thread_is_refused() -> None:
    """drain() checks the calling thread: a pool bound (with bind(), outside
    any loop) to this thread refuses a drain from another thread's loop
    rather than moving itself there."""
    pool = AsyncReqToTokenPool(4, 4)
    pool.bind()
    with pytest.raises(WrongThreadError):
        _in_thread(lambda: asyncio.run(pool.drain()))


@pytest.mark.parametrize("timeout", [-1, -0.5, float("nan"), "1"])
async def test_drain_rejects_a_bad_timeout_even_with_nothing_pending(timeout: Any) -> None:
    """drain(timeout) raises ValueError for a timeout that is not None or a
    number >= 0, before looking at what is pending."""
    pool = AsyncReqToTokenPool(4, 4)
    with pytest.raises(ValueError):
        await pool.drain(timeout=timeout)
    await pool.close()


def test_a_drain_that_times_out_still_watches_fences_deferred_between_loops() -> None:
    """Rows freed behind a fence while no loop runs (the pool's first loop
    has been closed) are watched once a drain runs in the next loop: when
    the fence completes after that drain gave up, the rows come back with
    nobody calling the pool."""
    pool = AsyncReqToTokenPool(4, 4)

    async def first() -> list[int]:
        return await pool.alloc(2)

    rows = asyncio.run(first())  # binds the pool to a loop that then closes
    with Streams() as kit:
        stream = kit.stream()
        gate = kit.gate(stream)
        fence = stream.record()
        pool.free(rows, fence=fence)  # no loop runs here
        assert pool.pending_size() == 2

        async def second() -> None:
            with pytest.raises(TimeoutError):
                await pool.drain(timeout=0)
            gate.open()
            await _after_wake_ups(fence)  # only the fence's own wake-up reclaims
            assert pool.stats().pending == 0 and pool.stats().free == 3
            await pool.close()

        asyncio.run(second())


async def test_drain_notices_a_polled_fence_soon_after_a_long_wait() -> None:
    """drain() polls a fence with no done callback with a backoff capped at
    1 ms: a fence that completes only at its 25th query is noticed within a
    few tens of ms, not after an exponentially grown sleep."""
    pool = AsyncReqToTokenPool(4, 4)
    rows = await pool.alloc(2)
    await pool.close()  # no watcher thread: only drain asks the fence
    pool.free(rows, fence=CountdownFence(25))
    assert pool.pending_size() == 2
    async with bounded(2.0):
        await pool.drain()
    assert pool.available_size() == 3


async def test_an_explicit_drain_grants_the_waiters_it_frees_rows_for() -> None:
    """With reclaim="explicit", rows that drain() settles go to the queued
    waiters at once (nothing else would ever grant them)."""
    pool = AsyncReqToTokenPool(3, 4, reclaim="explicit")
    fs = FakeStream()
    rows = await pool.alloc(2)
    pool.free(rows, fence=fs.record())
    waiter = asyncio.ensure_future(pool.alloc(2))
    await spin()
    assert pool.waiting() == 1
    fs.complete()
    async with bounded():
        await pool.drain()
        got = await waiter
    assert sorted(got) == sorted(rows)
    pool.free(got)
    await pool.close()


# ------------------------------------------------------------------ close


async def test_a_second_close_does_nothing(caplog: pytest.LogCaptureFixture) -> None:
    """close() is idempotent: a second call neither logs nor touches anything."""
    caplog.set_level(logging.DEBUG, logger="asyncpool")
    pool = AsyncReqToTokenPool(4, 4)
    await pool.close()
    first = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("closed") for m in first)
    caplog.clear()
    await pool.close()
    assert pool.closed
    assert [r.getMessage() for r in caplog.records] == []


async def test_close_cancels_the_overdue_fence_timer(kit: Streams) -> None:
    """close() cancels the pending overdue-fence check, so a closed pool
    schedules nothing more on its loop."""
    pool = AsyncReqToTokenPool(4, 4, fence_timeout=60.0)
    stream = kit.stream()
    kit.gate(stream)
    rows = await pool.alloc(2)
    pool.free(rows, fence=stream.record())
    assert pool._overdue is not None
    timer = pool._overdue.timer
    assert timer is not None and not timer.cancelled()
    await pool.close()
    assert timer.cancelled()
    assert pool._overdue.timer is None


# ------------------------------------------------------------------ release / resume


async def test_release_memory_on_a_released_pool_does_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A second release_memory() while released returns at once: the memory
    region is not paused again and nothing is logged."""
    caplog.set_level(logging.INFO, logger="asyncpool")
    pool = AsyncReqToTokenPool(4, 4)
    paused: list[int] = []
    pause = pool._tables.pause

    def counting_pause() -> None:
        paused.append(1)
        pause()

    pool._tables.pause = counting_pause  # type: ignore[method-assign]
    async with bounded():
        await pool.release_memory()
    assert pool.released and len(paused) == 1
    caplog.clear()
    async with bounded():
        await pool.release_memory()
    assert pool.released and len(paused) == 1
    assert [r.getMessage() for r in caplog.records] == []
    await pool.resume_memory()
    await pool.close()


async def test_rows_freed_before_a_release_need_no_second_reset_after_resume() -> None:
    """resume_memory() zeroes the whole table, so the rows it leaves free are
    clean: handing them out afterwards costs no further row reset."""
    pool = AsyncReqToTokenPool(4, 4)
    rows = await pool.alloc(3)
    pool.free(rows)  # dirty now
    async with bounded():
        await pool.release_memory()
    await pool.resume_memory()
    resets = pool.stats().resets
    again = await pool.alloc(3)
    assert pool.stats().resets == resets
    assert sorted(again) == sorted(rows)
    pool.free(again)
    await pool.close()


async def test_resume_after_close_keeps_the_pool_closed() -> None:
    """A pool closed while its memory was released stays closed after
    resume_memory(): alloc and try_alloc still raise PoolClosedError."""
    pool = AsyncReqToTokenPool(4, 4)
    async with bounded():
        await pool.release_memory()
    await pool.close()
    await pool.resume_memory()
    assert pool.closed and not pool.released
    with pytest.raises(PoolClosedError):
        async with bounded():
            await pool.alloc(1)
    with pytest.raises(PoolClosedError):
        pool.try_alloc(1)
    assert pool.available_size() == 3


async def test_resume_on_a_pool_that_was_not_released_changes_nothing() -> None:
    """resume_memory() without a release is a no-op: the tables of allocated
    rows keep what was written to them."""
    pool = AsyncReqToTokenPool(4, 4)
    rows = await pool.alloc(2)
    pool.write((rows[0], slice(0, 4)), torch.tensor([5, 6, 7, 8], dtype=torch.int32))
    before = pool.req_to_token.clone()
    stats = pool.stats().resets
    await pool.resume_memory()
    assert torch.equal(pool.req_to_token, before)
    assert pool.stats().resets == stats
    pool.free(rows)
    await pool.close()


# ------------------------------------------------------------------ binding


def test_the_first_checked_call_in_a_loop_binds_that_loop_for_fence_wake_ups() -> None:
    """A pool first called (try_alloc) inside a running loop binds to that
    loop too: a fence deferred during set-up, before any loop ran, then
    returns its rows through its own wake-up, with nobody calling the pool."""
    pool = AsyncReqToTokenPool(4, 4)
    with Streams() as kit:
        rows = pool.try_alloc(2)  # set-up: binds nothing
        assert rows is not None
        stream = kit.stream()
        gate = kit.gate(stream)
        fence = stream.record()
        pool.free(rows, fence=fence)

        async def main() -> None:
            one = pool.try_alloc(1)  # binds the thread and this loop
            assert one is not None
            gate.open()
            await _after_wake_ups(fence)  # only the fence's own wake-up reclaims
            assert pool.stats().pending == 0
            pool.free(one)
            await pool.close()

        asyncio.run(main())


def test_bind_reclaims_fences_that_completed_while_no_loop_could_be_told() -> None:
    """bind() reclaims completed fences before deciding whether rows are still
    pending: a fence that completed during set-up does not block the hand-off."""
    pool = AsyncReqToTokenPool(4, 4)
    with Streams() as kit:
        rows = pool.try_alloc(2)
        assert rows is not None
        stream = kit.stream()
        gate = kit.gate(stream)
        fence = stream.record()
        pool.free(rows, fence=fence)
        gate.open()
        fence.synchronize()
        assert pool.pending_size() == 2  # nobody was told
        _in_thread(pool.bind)
        assert pool.pending_size() == 0
        assert pool.available_size() == 3


def test_bind_runs_a_row_reset_queued_on_the_old_loop() -> None:
    """A grant made outside any loop queues its row reset on the pool's
    (stopped) loop; bind() runs it, so the row's lengths read zero for its
    new owner."""
    pool = AsyncReqToTokenPool(3, 4)
    loop = asyncio.new_event_loop()
    try:

        async def setup() -> tuple[list[int], asyncio.Task[list[int]]]:
            rows = await pool.alloc(2)
            pool.alloced_lens[rows[0]] = 4
            pool.verified_lens[rows[0]] = 3
            waiter = asyncio.ensure_future(pool.alloc(1))
            await spin()
            assert pool.waiting() == 1
            return rows, waiter

        rows, waiter = loop.run_until_complete(setup())
        pool.free([rows[0]])  # no loop runs: grants the dirty row to the waiter
        assert pool.waiting() == 0
        pool.bind()
        assert int(pool.alloced_lens[rows[0]]) == int(pool.verified_lens[rows[0]]) == 0
        got = loop.run_until_complete(waiter)
        assert got == [rows[0]]
        pool.free([*got, rows[1]])
        loop.run_until_complete(pool.close())
    finally:
        loop.close()


def test_a_kv_pool_refuses_a_foreign_alloc_even_after_a_fast_one() -> None:
    """With kv, the unchecked fast paths never open: after the owner's own
    alloc succeeds, alloc(1) from another thread still raises WrongThreadError."""
    pool = AsyncReqToTokenPool(4, 4, kv=KVPagePool(16, 4))

    async def owner() -> list[int]:
        return await pool.alloc(1)

    loop = asyncio.new_event_loop()
    try:
        rows = loop.run_until_complete(owner())
        with pytest.raises(WrongThreadError):
            _in_thread(lambda: asyncio.run(pool.alloc(1)))
        assert pool.available_size() == 2
        pool.free(rows)
        loop.run_until_complete(pool.close())
    finally:
        loop.close()


# ------------------------------------------------------------------ loop moves


def test_a_pool_with_waiters_on_a_stopped_loop_refuses_to_move() -> None:
    """A pool whose (stopped, still open) loop has waiters refuses to move to
    another loop, changing nothing: those waiters' futures belong to the old
    loop, which may run again."""
    pool = AsyncReqToTokenPool(3, 4)
    old = asyncio.new_event_loop()
    try:

        async def setup() -> tuple[list[int], asyncio.Task[list[int]]]:
            rows = await pool.alloc(2)
            waiter = asyncio.ensure_future(pool.alloc(1))
            await spin()
            return rows, waiter

        rows, waiter = old.run_until_complete(setup())
        assert pool.waiting() == 1

        async def elsewhere() -> None:
            with pytest.raises(WrongThreadError):
                async with bounded():
                    await pool.alloc(1)
            with pytest.raises(WrongThreadError):
                async with bounded():
                    await pool.drain()

        new = asyncio.new_event_loop()
        try:
            new.run_until_complete(elsewhere())
        finally:
            new.close()
        assert pool.waiting() == 1 and pool._loop is old
        pool.free([rows[0]])  # the old loop's waiter is served on the old loop
        got = old.run_until_complete(waiter)
        assert got == [rows[0]]
        pool.free([*got, rows[1]])
        old.run_until_complete(pool.close())
    finally:
        old.close()


def test_moving_to_a_debug_loop_closes_the_fast_paths() -> None:
    """A pool that moves from a normal loop to one in asyncio debug mode
    decides its unchecked fast paths afresh: from then on alloc(1) from a
    foreign thread raises WrongThreadError."""
    pool = AsyncReqToTokenPool(4, 4)

    async def use() -> None:
        pool.free(await pool.alloc(1))

    first = asyncio.new_event_loop()
    try:
        first.run_until_complete(use())
    finally:
        first.close()

    async def in_debug() -> list[int]:
        async with bounded():
            await pool.drain()  # moves the pool to this loop
        return await pool.alloc(1)  # the owner's alloc: would reopen fast paths

    debug = asyncio.new_event_loop()
    debug.set_debug(True)
    try:
        rows = debug.run_until_complete(in_debug())
        with pytest.raises(WrongThreadError):
            _in_thread(lambda: asyncio.run(pool.alloc(1)))
        assert pool.available_size() == 2
        pool.free(rows)
        debug.run_until_complete(pool.close())
    finally:
        debug.close()


def test_a_pool_that_moves_loops_keeps_checking_for_overdue_fences() -> None:
    """An overdue-fence check armed on a loop the pool leaves is moved to the
    new loop (cancelled there, armed here), so a fence still pending is
    still checked, and reported once overdue, while the pool runs there."""
    pool = AsyncReqToTokenPool(4, 4, fence_timeout=60.0)
    overdue = pool._overdue
    assert overdue is not None
    with Streams() as kit:
        stream = kit.stream()
        gate = kit.gate(stream)

        async def take() -> list[int]:
            return await pool.alloc(2)

        old = asyncio.new_event_loop()
        try:
            rows = old.run_until_complete(take())
            # Between runs of the pool's loop: the check is armed on that
            # loop, which never runs again.
            pool.free(rows, fence=stream.record())
            stale = overdue.timer
            assert stale is not None

            async def elsewhere() -> None:
                drain = asyncio.create_task(pool.drain())  # moves the pool here
                await spin()
                assert stale.cancelled()
                timer = overdue.timer
                assert timer is not None and timer is not stale and not timer.cancelled()
                gate.open()
                async with bounded():
                    await drain
                await pool.close()

            asyncio.run(elsewhere())
        finally:
            old.close()


def test_a_wake_up_left_queued_on_a_loop_the_pool_left_does_not_mute_it_on_return() -> None:
    """A fence wake-up queued on a stopped loop that never ran it is
    forgotten when the pool moves to another loop; when the pool later moves
    back to the first loop, new fence completions still wake its waiters."""
    pool = AsyncReqToTokenPool(4, 4)
    with Streams() as kit:
        s1, s2 = kit.stream(), kit.stream()
        gate1, gate2 = kit.gate(s1), kit.gate(s2)
        first = asyncio.new_event_loop()
        try:

            async def defer() -> None:
                pool.free(await pool.alloc(2), fence=s1.record())

            first.run_until_complete(defer())
            told = threading.Event()
            fence1 = pool._ledger.pending_fences()[0]
            assert isinstance(fence1, HostFence)
            fence1.add_done_callback(told.set)  # runs after the pool's callback
            gate1.open()
            assert told.wait(5)  # the pool queued its wake-up on the stopped loop
            one = pool.try_alloc(3)  # reclaims the rows: nothing pending now
            assert one is not None
            pool.free(one)

            async def visit() -> None:
                async with bounded():
                    await pool.drain()  # moves the pool to this loop

            asyncio.run(visit())

            async def back() -> list[int]:
                async with bounded():
                    await pool.drain()  # moves the pool back, nothing pending
                rows = await pool.alloc(3)
                pool.free(rows[:2], fence=s2.record())
                waiter = asyncio.ensure_future(pool.alloc(2))
                await spin()
                assert pool.waiting() == 1
                gate2.open()  # only this fence's wake-up can serve the waiter
                async with bounded():
                    got = await waiter
                pool.free(got + rows[2:])
                await pool.close()
                return got

            assert len(first.run_until_complete(back())) == 2
        finally:
            first.close()


# ------------------------------------------------------------------ free


async def test_a_one_row_free_after_close_does_not_reopen_allocation() -> None:
    """Freeing single rows after close() leaves the pool closed to every
    alloc, the one-row alloc included."""
    pool = AsyncReqToTokenPool(4, 4)
    rows = await pool.alloc(2)
    await pool.close()
    assert pool.free([rows[0]]) == 1
    with pytest.raises(PoolClosedError):
        async with bounded():
            await pool.alloc(1)
    assert pool.free([rows[1]]) == 1
    with pytest.raises(PoolClosedError):
        async with bounded():
            await pool.alloc(1)
    assert pool.available_size() == 3


# ------------------------------------------------------------ reclaim / force_release


def test_reclaim_returns_pages_whose_fence_completed_unseen() -> None:
    """reclaim() returns both the rows and the KV pages behind fences that
    completed while nobody could be told (no loop bound yet)."""
    pool = AsyncReqToTokenPool(4, 4, kv=KVPagePool(16, 4))
    with Streams() as kit:
        stream = kit.stream()
        gate = kit.gate(stream)
        g = pool.try_admit(pages=3)
        assert g is not None
        fence = stream.record()
        pool.free([g.row], fence=fence)
        gate.open()
        fence.synchronize()
        st = pool.stats()
        assert (st.pending, st.pages_pending) == (1, 3)
        assert pool.reclaim() == 1
        st = pool.stats()
        assert (st.pending, st.pages_pending) == (0, 0)
        assert st.pages_free == st.pages_capacity


async def test_force_release_is_logged_at_warning(
    kit: Streams, caplog: pytest.LogCaptureFixture
) -> None:
    """force_release() logs at WARNING what it returned without the fence."""
    caplog.set_level(logging.WARNING, logger="asyncpool")
    pool = AsyncReqToTokenPool(4, 4)
    stream = kit.stream()
    kit.gate(stream)
    rows = await pool.alloc(2)
    stuck = stream.record()
    pool.free(rows, fence=stuck)
    assert pool.force_release(stuck) == (2, 0)
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("force_release" in m and "2 rows" in m for m in msgs), msgs
    # Of a fence that holds nothing here (the operator's wrong object, or
    # this one again): said plainly, not "0 rows and 0 pages returned".
    caplog.clear()
    assert pool.force_release(stuck) == (0, 0)
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(msgs) == 1 and "holds no row and no page of this pool" in msgs[0], msgs
    await pool.close()


async def test_a_force_released_fence_that_holds_rows_again_is_reported_again(
    kit: Streams, caplog: pytest.LogCaptureFixture
) -> None:
    """Once force_release() let go of a stuck fence, it is a new incident
    when that same fence holds rows again and goes overdue: warned again."""
    caplog.set_level(logging.WARNING, logger="asyncpool")
    pool = AsyncReqToTokenPool(4, 4, fence_timeout=0.05)
    stream = kit.stream()
    kit.gate(stream)
    stuck = stream.record()
    with overdue_warnings() as seen:
        pool.free(await pool.alloc(2), fence=stuck)
        async with bounded():
            await seen.wait()
        assert pool.force_release(stuck) == (2, 0)
        seen.clear()
        pool.free(await pool.alloc(1), fence=stuck)
        async with bounded():
            await seen.wait()
        assert pool.force_release(stuck) == (1, 0)
    await pool.close()


# ------------------------------------------------------------------ fence wake-ups


def test_a_fence_deferred_in_the_first_loop_after_bind_wakes_the_pool() -> None:
    """A pool bound with bind() outside any loop adopts the loop in which a
    fence first starts holding its rows: that fence's completion returns
    the rows with nobody calling the pool."""
    pool = AsyncReqToTokenPool(4, 4)
    pool.bind()  # the thread only: no loop runs
    with Streams() as kit:
        stream = kit.stream()
        gate = kit.gate(stream)

        async def main() -> None:
            rows = await pool.alloc(2)  # no wait: binds no loop
            fence = stream.record()
            pool.free(rows, fence=fence)
            gate.open()
            await _after_wake_ups(fence)  # only the fence's own wake-up reclaims
            assert pool.stats().pending == 0
            await pool.close()

        asyncio.run(main())


# ------------------------------------------------------------------ shedding


class _DeviceLost(RuntimeError):
    pass


def _boom() -> None:
    raise _DeviceLost("illegal memory access (simulated)")


async def test_an_admit_waiter_fails_once_every_row_is_quarantined(
    kit: Streams, caplog: pytest.LogCaptureFixture
) -> None:
    """An admit() queued while every row of the pool ends up quarantined
    behind a faulted fence fails with CapacityError instead of waiting
    forever for a row that can never be free again."""
    caplog.set_level(logging.CRITICAL, logger="asyncpool")
    pool = AsyncReqToTokenPool(3, 4, kv=KVPagePool(16, 4))  # 2 rows
    stream = kit.stream()
    gate = kit.gate(stream)
    stream.launch(_boom)
    faulted = stream.record()
    a = await pool.admit(pages=1)
    b = await pool.admit(pages=1)
    pool.free([a.row, b.row], fence=faulted)
    waiter = asyncio.ensure_future(pool.admit(pages=1))
    await spin()
    assert pool.waiting() == 1
    gate.open()
    with pytest.raises(CapacityError, match="cannot allocate 1 row"):
        async with bounded():
            await waiter
    assert pool.stats().quarantined == 2
    await pool.close()


async def test_an_admit_waiter_that_still_fits_the_pages_left_is_kept(
    kit: Streams, caplog: pytest.LogCaptureFixture
) -> None:
    """Pages quarantined behind a faulted fence fail only the admit() waiters
    that need more pages than can ever be free again: one that needs exactly
    what is left keeps waiting and is served once those pages are freed."""
    caplog.set_level(logging.CRITICAL, logger="asyncpool")
    pool = AsyncReqToTokenPool(4, 4, kv=KVPagePool(16, 4))
    cap = pool.stats().pages_capacity
    stream = kit.stream()
    gate = kit.gate(stream)
    stream.launch(_boom)
    faulted = stream.record()
    lost = await pool.admit(pages=5)
    rest = await pool.admit(pages=cap - 5)
    pool.free([lost.row], fence=faulted)
    waiter = asyncio.ensure_future(pool.admit(pages=cap - 5))
    await spin()
    assert pool.waiting() == 1
    gate.open()
    await _after_wake_ups(faulted)
    assert pool.stats().pages_quarantined == 5
    await spin()  # the shedding runs on the next loop iteration
    assert pool.waiting() == 1 and not waiter.done()
    pool.free([rest.row])
    async with bounded():
        got = await waiter
    pool.free([got.row])
    await pool.close()


# ------------------------------------------------------------------ hand-off (a fix)


def test_bind_hands_over_once_a_fence_deferred_between_loops_has_completed() -> None:
    """bind() in a new thread succeeds once the fence of rows freed while no
    loop ran (the pool's first loop closed) has completed: it reclaims them
    and nothing is pending, so nothing blocks the hand-off. It used to refuse
    with "0 waiters queue and 0 rows wait behind fences", for good."""
    pool = AsyncReqToTokenPool(4, 4)

    async def first() -> list[int]:
        return await pool.alloc(2)

    rows = asyncio.run(first())
    with Streams() as kit:
        stream = kit.stream()
        gate = kit.gate(stream)
        fence = stream.record()
        pool.free(rows, fence=fence)  # no loop runs: watched by the next one
        gate.open()
        fence.synchronize()

        def scheduler() -> list[int]:
            pool.bind()
            assert pool.pending_size() == 0 and pool.available_size() == 3

            async def serve() -> list[int]:
                got = await pool.alloc(3)
                pool.free(got)
                await pool.close()
                return got

            return asyncio.run(serve())

        assert len(_in_thread(scheduler)) == 3


# ------------------------------------------------------------------ stats / invariants


async def test_the_zero_wait_count_never_goes_down_when_a_scrape_races_a_hand_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """stats().alloc_calls never goes down between scrapes, even for a scrape
    (from another thread) that reads the granted total just before the
    owner hands out a row and the rest just after: simulated here by a
    hand-out made right after that read."""
    pool = AsyncReqToTokenPool(8, 4)
    held = [await pool.alloc(2), await pool.alloc(1)]  # zero-wait allocs
    before = pool.stats().alloc_calls
    assert before == 2
    taken: list[int] = []
    real = SlotLedger.granted

    def racing(led: SlotLedger) -> int:
        value: int = real.fget(led)  # type: ignore[attr-defined]
        if not taken:
            got = led.take(1)  # the owner hands out a row right after the read
            assert got is not None
            taken.extend(got)
        return value

    monkeypatch.setattr(SlotLedger, "granted", property(racing))
    assert pool.stats().alloc_calls >= before
    monkeypatch.undo()
    assert taken and pool.stats().alloc_calls == before
    pool.free(taken)
    for rows in held:
        pool.free(rows)
    await pool.close()


async def test_check_invariants_sees_a_waiter_count_out_of_step() -> None:
    """check_invariants() checks the waiter queues too: a waiter count that
    disagrees with what is queued is reported."""
    pool = AsyncReqToTokenPool(4, 4)
    pool.check_invariants()
    pool._waiters.count += 1
    try:
        with pytest.raises(AssertionError, match="waiter count"):
            pool.check_invariants()
    finally:
        pool._waiters.count -= 1
    await pool.close()


async def test_check_invariants_sees_a_reset_scheduled_for_a_row_not_allocated() -> None:
    """check_invariants() reports a row whose scheduled reset is still due
    while the row is no longer allocated (it would be zeroed under its next
    owner)."""
    pool = AsyncReqToTokenPool(4, 4)
    rows = await pool.alloc(1)
    pool.free(rows)
    pool._unreset.append(rows[0])
    try:
        with pytest.raises(AssertionError, match="awaits its reset"):
            pool.check_invariants()
    finally:
        pool._unreset.clear()
    await pool.close()
