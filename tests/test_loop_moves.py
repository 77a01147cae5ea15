"""A pool that outlives its event loop: ``asyncio.run`` twice in one thread,
a hand-over with ``bind()``, a loop stopped with a fence wake-up queued.

Each test runs its own loops (not pytest-asyncio's), on asyncio and uvloop.
Found by a review of the fence machinery; each test failed before its fix:

* a wake-up queued on a loop that stopped without running it left the
  coalescing flag set, and every later fence completion was dropped (the
  waiter hung); a stale done-callback of a force-released fence, firing
  while ``bind()`` had left the pool without a loop, did the same;
* ``drain()`` on a second loop built its wait on the first, closed one;
* the ``fence_timeout`` timer armed on a closed loop was never re-armed, so
  overdue fences on the next loop were never logged.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import pytest
import torch
import uvloop
from helpers import WAIT_S, Streams, bounded, overdue_warnings, until

from asyncpool import (
    AsyncReqToTokenPool,
    HostStream,
    KVPagePool,
    ReqToTokenPoolInfo,
    WrongThreadError,
)

LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "asyncio": asyncio.new_event_loop,
    "uvloop": uvloop.new_event_loop,
}


def run(factory: Callable[[], asyncio.AbstractEventLoop], coro: Coroutine[Any, Any, Any]) -> Any:
    loop = factory()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


async def _waiter_is_woken_by(
    pool: AsyncReqToTokenPool, stream: HostStream, gate: threading.Event
) -> None:
    """Every row pending behind a gated fence; a waiter; the gate opens: the
    waiter must be granted by the fence's wake-up alone."""
    rows = await pool.alloc(pool.capacity)
    stream.launch(gate.wait)
    fence = stream.record()
    pool.record_use(rows, fence)
    pool.free(rows)
    waiter = asyncio.ensure_future(pool.alloc(1))
    await asyncio.sleep(0)
    assert not waiter.done()
    gate.set()
    async with bounded():
        assert len(await waiter) == 1


async def _free_two_rows_behind_a_gated_step(
    pool: AsyncReqToTokenPool, stream: HostStream, gate: threading.Event
) -> Any:
    """Two rows allocated, used by a step on ``stream`` that waits for
    ``gate``, and freed: pending behind that step's fence (returned)."""
    rows = await pool.alloc(2)
    stream.launch(gate.wait)
    fence = stream.record()
    pool.record_use(rows, fence)
    pool.free(rows)
    return fence


@pytest.mark.parametrize("loop", LOOPS)
def test_a_wake_up_lost_with_a_stopped_loop_does_not_silence_the_next(
    loop: str, kit: Streams
) -> None:
    factory = LOOPS[loop]
    pool = AsyncReqToTokenPool(3, 8)
    stream = kit.stream()
    gate = kit.event()

    stopped = factory()
    fence = stopped.run_until_complete(_free_two_rows_behind_a_gated_step(pool, stream, gate))
    gate.set()
    fence.synchronize()  # its wake-up is queued on a loop that no longer runs
    stopped.close()
    run(factory, _waiter_is_woken_by(pool, stream, kit.event()))


@pytest.mark.parametrize("loop", LOOPS)
def test_a_stale_callback_after_bind_does_not_silence_wake_ups(
    loop: str, caplog: pytest.LogCaptureFixture, kit: Streams
) -> None:
    caplog.set_level(logging.ERROR, logger="asyncpool")  # force_release warns
    factory = LOOPS[loop]
    pool = AsyncReqToTokenPool(3, 8)
    stream = kit.stream()
    gate = kit.event()
    errors: list[BaseException] = []

    async def first() -> None:
        rows = await pool.alloc(1)
        stream.launch(gate.wait)
        fence = stream.record()
        pool.record_use(rows, fence)
        pool.free(rows)
        pool.force_release(fence)  # its done-callback stays on the fence

    run(factory, first())

    def server() -> None:
        try:
            pool.bind()  # no loop in this thread yet
            gate.set()
            stream.synchronize()  # the stale callback has run
            run(factory, _waiter_is_woken_by(pool, stream, kit.event()))
        except BaseException as exc:  # reported to the test's thread
            errors.append(exc)

    thread = threading.Thread(target=server, name="server")
    thread.start()
    thread.join(30)
    assert not thread.is_alive()
    if errors:
        raise errors[0]


@pytest.mark.parametrize("loop", LOOPS)
def test_drain_on_a_second_loop(loop: str, kit: Streams) -> None:
    factory = LOOPS[loop]
    pool = AsyncReqToTokenPool(3, 8)
    stream = kit.stream()
    gate = kit.event()

    async def first() -> None:
        pool.free(await pool.alloc(1))

    async def second() -> None:
        rows = await pool.alloc(1)
        stream.launch(gate.wait)
        pool.record_use(rows, stream.record())
        pool.free(rows)
        asyncio.get_running_loop().call_soon(gate.set)
        async with bounded():
            await pool.drain()  # raised "Event loop is closed" before
        assert pool.pending_size() == 0

    run(factory, first())
    run(factory, second())


class _Transfer:
    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        pass


@pytest.mark.parametrize("loop", LOOPS)
def test_overdue_fences_are_logged_on_the_next_loop(
    loop: str, caplog: pytest.LogCaptureFixture
) -> None:
    factory = LOOPS[loop]
    caplog.set_level(logging.WARNING, logger="asyncpool")
    # Long enough that the first loop ends with its timer still armed.
    # (1 s: at 0.2 s a slow first loop could see its transfer overdue.)
    pool = AsyncReqToTokenPool(3, 8, fence_timeout=1.0)

    async def first() -> None:
        transfer = _Transfer()
        pool.free(await pool.alloc(1), fence=transfer)  # arms the overdue timer here
        transfer.done = True
        async with bounded():
            await pool.drain()

    async def second() -> _Transfer:
        with overdue_warnings() as logged:  # the timer runs on this loop's thread
            transfer = _Transfer()
            pool.free(await pool.alloc(1), fence=transfer)
            async with bounded():
                await logged.wait()
        return transfer

    run(factory, first())
    assert not any("overdue" in r.getMessage() for r in caplog.records)
    transfer = run(factory, second())
    assert pool.stats().overdue_fences == 1
    transfer.done = True
    assert pool.reclaim() == 1
    run(factory, pool.close())  # stops the watcher thread that polled the transfers


async def _bind_and_see_a_fence_overdue(pool: AsyncReqToTokenPool) -> _Transfer:
    """bind() here, free a row behind a transfer that does not complete, and
    wait for its overdue warning (logged on this loop's thread)."""
    pool.bind()
    with overdue_warnings() as logged:
        transfer = _Transfer()
        pool.free(await pool.alloc(1), fence=transfer)
        async with bounded():
            await logged.wait()
    return transfer


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("where", ["another thread", "this thread"])
def test_overdue_fences_are_logged_after_bind(loop: str, where: str) -> None:
    """Warmed up (a fenced free arms the overdue check on the warm-up loop),
    then handed over with bind(): overdue fences are logged on the new loop.
    A review found none logged: bind() kept the old loop's timer as armed,
    so no check was armed on the new loop."""
    factory = LOOPS[loop]
    pool = AsyncReqToTokenPool(3, 8, fence_timeout=1.0)

    async def warm_up() -> None:
        transfer = _Transfer()
        pool.free(await pool.alloc(1), fence=transfer)  # arms the check here
        transfer.done = True
        async with bounded():
            await pool.drain()

    if where == "another thread":
        warm = threading.Thread(target=run, args=(factory, warm_up()))
        warm.start()
        warm.join(WAIT_S)
        assert not warm.is_alive()
    else:
        run(factory, warm_up())

    transfer = run(factory, _bind_and_see_a_fence_overdue(pool))
    assert pool.stats().overdue_fences == 1
    transfer.done = True
    assert pool.reclaim() == 1
    run(factory, pool.close())


def test_an_overdue_check_left_on_a_running_loop_does_nothing_there() -> None:
    """The old loop still runs in its thread after bind(): the check armed
    there finds the pool moved and does nothing on that thread (it used to
    check the ledgers there and arm a timer on the new loop from it)."""
    pool = AsyncReqToTokenPool(3, 8, fence_timeout=0.2)
    old = asyncio.new_event_loop()
    armed = threading.Event()
    errors: list[dict[str, Any]] = []

    def old_thread() -> None:
        async def warm_up() -> None:
            transfer = _Transfer()
            pool.free(await pool.alloc(1), fence=transfer)  # arms the check here
            transfer.done = True
            assert pool.reclaim() == 1

        old.set_exception_handler(lambda loop, ctx: errors.append(ctx))
        old.run_until_complete(warm_up())
        old.call_soon(armed.set)
        old.run_forever()  # running past the timer, until the test stops it

    thread = threading.Thread(target=old_thread, name="old-loop-thread")
    thread.start()
    try:
        assert armed.wait(WAIT_S)
        checks: list[str] = []
        real = pool._overdue.check  # type: ignore[union-attr]

        def check() -> float | None:
            # Only once the pool moved: before bind() the old loop's check
            # is legitimately its own (a stalled test may let it fire then).
            if pool._owner_name != "old-loop-thread":
                checks.append(threading.current_thread().name)
            return real()

        pool._overdue.check = check  # type: ignore[union-attr, method-assign]

        async def serve() -> None:
            transfer = await _bind_and_see_a_fence_overdue(pool)
            transfer.done = True
            assert pool.reclaim() == 1

        run(asyncio.new_event_loop, serve())
        assert "old-loop-thread" not in checks and checks
    finally:
        old.call_soon_threadsafe(old.stop)
        thread.join(WAIT_S)
        old.close()
    assert not errors
    run(asyncio.new_event_loop, pool.close())


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("kind", ["alloc", "admit"])
@pytest.mark.parametrize("then", ["free", "wait, then free"])
def test_waiters_of_a_closed_loop_are_dropped_not_granted(
    loop: str, kind: str, then: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A waiter left queued on a loop closed under it: the next free, on
    another loop, ran the grant loop for it, whose reset (or future) needed
    the closed loop. The free raised mid-grant, leaving the row (and an
    admission's pages, taken first) held by nobody."""
    from asyncpool import KVPagePool

    caplog.set_level(logging.ERROR)  # the abandoned task, destroyed pending
    factory = LOOPS[loop]
    kv = KVPagePool(9, 4)
    pool = AsyncReqToTokenPool(2, 8, kv=kv)  # one row

    abandoned: list[asyncio.Future[Any]] = []

    async def first() -> int:
        grant = pool.try_admit(pages=2)
        assert grant is not None
        waiter = pool.alloc(1) if kind == "alloc" else pool.admit(pages=3)
        abandoned.append(asyncio.ensure_future(waiter))
        await asyncio.sleep(0)
        assert pool.waiting() == 1
        return grant.row

    closed = factory()
    row = closed.run_until_complete(first())
    closed.close()  # the waiting task is abandoned, still queued

    async def second() -> None:
        if then == "wait, then free":
            # The new loop's waiter queues behind nobody: binding the pool
            # to this loop dropped the dead one.
            live = asyncio.ensure_future(pool.alloc(1))
            await asyncio.sleep(0)
            assert pool.waiting() == 1
            pool.free([row])
            async with bounded():
                pool.free(await live)
            return
        assert pool.free([row]) == 1  # raised RuntimeError before
        assert pool.waiting() == 0 and pool.available_size() == 1
        assert kv.available_size() == 8
        pool.check_invariants()
        async with bounded():
            got = await pool.admit(pages=8)
        pool.free([got.row])

    run(factory, second())
    pool.check_invariants()


def _abandon_a_waiter(factory: Callable[[], asyncio.AbstractEventLoop], setup: Any) -> None:
    """Run ``setup`` (which leaves a waiter queued) on a loop, then close
    that loop without cancelling the waiter's task."""
    abandoned: list[asyncio.Future[Any]] = []

    async def body() -> None:
        abandoned.append(asyncio.ensure_future(setup()))
        await asyncio.sleep(0)
        await asyncio.sleep(0)

    loop = factory()
    loop.run_until_complete(body())
    loop.close()


def _pool_with_a_waiter_abandoned(
    factory: Callable[[], asyncio.AbstractEventLoop],
    pages_held: int,
    queue: Callable[[AsyncReqToTokenPool], Awaitable[Any]],
) -> AsyncReqToTokenPool:
    """A pool of 3 rows and 8 pages, two admissions of ``pages_held`` pages
    each granted, then ``queue(pool)`` (which must wait) abandoned with its
    closed loop."""
    pool = AsyncReqToTokenPool(4, 8, kv=KVPagePool(9, 4))

    async def setup() -> None:
        await pool.admit(pages=pages_held)
        await pool.admit(pages=pages_held)
        await queue(pool)

    _abandon_a_waiter(factory, setup)
    return pool


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("kind", ["alloc", "admit"])
def test_a_request_behind_only_dead_waiters_is_granted_what_is_free(
    loop: str, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A waiter abandoned with its closed loop kept the next loop's request
    from taking what was free (it saw a queue); moving to the new loop then
    dropped the dead waiter, and the request, queued alone, waited for a
    free that might never come (found by a review). It is served at the
    loop's next turn now."""
    caplog.set_level(logging.ERROR)
    factory = LOOPS[loop]
    # 1 row free: alloc(2) queued, then abandoned with its loop
    pool = _pool_with_a_waiter_abandoned(factory, 2, lambda p: p.alloc(2))
    assert pool.available_size() == 1 and pool.waiting() == 1

    async def second() -> Any:
        async with bounded():
            if kind == "alloc":
                return await pool.alloc(1)
            return await pool.admit(pages=2)

    got = run(factory, second())
    assert (got == [3]) if kind == "alloc" else (got.row == 3 and len(got.pages) == 2)
    assert pool.waiting() == 0
    pool.check_invariants()


@pytest.mark.parametrize("loop", LOOPS)
def test_a_grouped_admission_behind_only_dead_waiters_is_granted_what_is_free(
    loop: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The same on a pool with KV groups, whose admit waits through
    ``WaiterQueues.wait(serve=True)``: served at the loop's next turn."""
    caplog.set_level(logging.ERROR)
    factory = LOOPS[loop]
    pool = AsyncReqToTokenPool(4, 8, kv={"full": KVPagePool(9, 4), "swa": KVPagePool(5, 4)})

    async def setup() -> None:
        await pool.admit({"full": 2, "swa": 1})
        await pool.admit({"full": 2, "swa": 1})
        await pool.alloc(2)  # 1 row free: queued, then abandoned with its loop

    _abandon_a_waiter(factory, setup)
    assert pool.available_size() == 1 and pool.waiting() == 1

    async def second() -> Any:
        async with bounded():
            return await pool.admit({"full": 2, "swa": 1})

    got = run(factory, second())
    assert got.row == 3 and len(got.pages["full"]) == 2 and len(got.pages["swa"]) == 1
    assert pool.waiting() == 0
    pool.check_invariants()


@pytest.mark.parametrize("loop", LOOPS)
def test_pages_short_counts_no_waiter_abandoned_with_its_loop(
    loop: str, caplog: pytest.LogCaptureFixture
) -> None:
    """An admission abandoned with its closed loop will never be served:
    ``pages_short()`` drops it before reading the head, or the engine would
    evict its prefix cache for a request that is gone."""
    caplog.set_level(logging.ERROR)
    factory = LOOPS[loop]
    # no page free: admit(pages=3) queued, then abandoned with its loop
    pool = _pool_with_a_waiter_abandoned(factory, 4, lambda p: p.admit(pages=3))
    assert pool.waiting() == 1 and pool.available_size() == 1
    assert pool.pages_short() == 0
    assert pool.waiting() == 0
    pool.check_invariants()


@pytest.mark.parametrize("loop", LOOPS)
def test_a_completion_missed_while_the_loop_was_closed_is_seen_on_the_next(
    loop: str, caplog: pytest.LogCaptureFixture, kit: Streams
) -> None:
    """The fence completed while no loop could be told (its wake-up met a
    closed loop and was dropped); the next loop's alloc queued behind it and
    waited for an unrelated call. Moving to a loop now looks at once."""
    caplog.set_level(logging.ERROR)
    factory = LOOPS[loop]
    pool = AsyncReqToTokenPool(2, 8)  # one row
    stream = kit.stream()
    gate = kit.event()

    async def setup() -> None:
        rows = await pool.alloc(1)
        stream.launch(gate.wait)
        pool.free(rows, fence=stream.record())
        await pool.alloc(1)  # queued; abandoned with its loop

    _abandon_a_waiter(factory, setup)
    gate.set()
    stream.synchronize()  # completed: its wake-up had no loop to go to

    async def second() -> None:
        async with bounded():
            assert await pool.alloc(1) == [1]
        pool.check_invariants()

    run(factory, second())


class _Dying:
    def __init__(self) -> None:
        self.dead = False

    def query(self) -> bool:
        if self.dead:
            raise OSError("the transfer's peer died")
        return False

    def synchronize(self) -> None:
        pass


@pytest.mark.parametrize("loop", LOOPS)
def test_a_fault_with_waiters_of_a_closed_loop_keeps_the_ledger_whole(
    loop: str, caplog: pytest.LogCaptureFixture
) -> None:
    """_on_fault scheduled its shed on the closed loop: RuntimeError from
    inside the ledger's reclaim, the batch half settled."""
    caplog.set_level(logging.CRITICAL)
    factory = LOOPS[loop]
    pool = AsyncReqToTokenPool(4, 8)
    dying = _Dying()

    async def setup() -> None:
        pool.free(await pool.alloc(2), fence=dying)
        await pool.alloc(3)  # queued; abandoned with its loop

    _abandon_a_waiter(factory, setup)
    dying.dead = True
    assert pool.reclaim() == 0  # raised RuntimeError before
    pool.check_invariants()
    assert pool.stats().quarantined == 2 and pool.waiting() == 0
    run(factory, pool.close())  # stops the watcher that polled the dying fence


@pytest.mark.parametrize("loop", LOOPS)
def test_close_and_bind_with_waiters_of_a_closed_loop(
    loop: str, caplog: pytest.LogCaptureFixture
) -> None:
    """close() failed the dead waiter's future, whose loop was closed: it
    raised half-way (marked closed, the watcher left running); bind() from
    another thread counted the dead waiter and refused."""
    caplog.set_level(logging.ERROR)
    factory = LOOPS[loop]
    for then in ("close", "bind"):
        pool = AsyncReqToTokenPool(2, 8)

        async def setup(pool: AsyncReqToTokenPool = pool) -> None:
            await pool.alloc(1)
            await pool.alloc(1)  # queued; abandoned with its loop

        _abandon_a_waiter(factory, setup)
        if then == "close":
            run(factory, pool.close())  # raised RuntimeError before
            assert pool.closed and pool.waiting() == 0
        else:
            errors: list[BaseException] = []

            def other(
                pool: AsyncReqToTokenPool = pool, errors: list[BaseException] = errors
            ) -> None:
                try:
                    pool.bind()  # refused with PoolBusyError before
                    pool.check_invariants()  # the new owner's call
                except BaseException as exc:
                    errors.append(exc)

            thread = threading.Thread(target=other, name="new-owner")
            thread.start()
            thread.join(WAIT_S)
            assert not thread.is_alive()
            assert not errors, errors
            assert pool.waiting() == 0
            continue
        pool.check_invariants()


@pytest.mark.parametrize("loop", LOOPS)
def test_a_warm_up_loop_left_open_does_not_keep_the_pool(loop: str, kit: Streams) -> None:
    """Warmed up on loop A (left open, nobody waiting), served on loop B: a
    fenced free on B was filed under A, and B's next alloc that had to wait
    raised WrongThreadError though B made every pending fence."""
    factory = LOOPS[loop]
    pool = AsyncReqToTokenPool(2, 8)
    stream = kit.stream()
    gate = kit.event()
    warm = factory()
    try:

        async def warm_up() -> None:
            pool.free(await pool.alloc(1))

        warm.run_until_complete(warm_up())  # stopped, not closed

        async def serve() -> None:
            rows = await pool.alloc(1)
            stream.launch(gate.wait)
            pool.free(rows, fence=stream.record())
            asyncio.get_running_loop().call_soon(gate.set)
            async with bounded():
                assert await pool.alloc(1) == [1]

        run(factory, serve())
    finally:
        warm.close()


def test_a_stale_wake_up_does_nothing_on_the_loop_the_pool_left(kit: Streams) -> None:
    """A wake-up queued on loop A (stopped, open) ran when A ran again, after
    the pool was handed to another thread and loop: it reclaimed and granted
    on the wrong thread (a row held by nobody, the waiter timed out)."""
    pool = AsyncReqToTokenPool(3, 8)
    stream = kit.stream()
    gate = kit.event()
    a = asyncio.new_event_loop()
    try:

        async def first() -> None:
            rows = await pool.alloc(1)
            stream.launch(gate.wait)
            pool.free(rows, fence=stream.record())

        a.run_until_complete(first())
        gate.set()
        stream.synchronize()  # its wake-up is queued on A, which is stopped
        pool.reclaim()
        reclaims: list[str] = []
        real = pool._wakeups._reclaim  # the wake-up's reclaim (the pool's _reclaim_both)

        def spy() -> object:
            reclaims.append(threading.current_thread().name)
            return real()

        pool._wakeups._reclaim = spy
        done = threading.Event()

        def other() -> None:
            async def serve() -> None:
                pool.bind()
                done.set()

            asyncio.run(serve())

        thread = threading.Thread(target=other, name="new-owner")
        thread.start()
        thread.join(WAIT_S)
        assert done.is_set()
        a.run_until_complete(asyncio.sleep(0))  # the stale wake-up runs here
        assert threading.current_thread().name not in reclaims
    finally:
        a.close()


@pytest.mark.parametrize("loop", LOOPS)
def test_try_calls_drop_the_waiters_of_a_closed_loop(
    loop: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A waiter left queued on a loop closed under it can never resume:
    try_alloc and try_admit answered None for good while it was counted
    (docs/api.md's scheduler admits with try_admit, and waits for nothing)."""
    factory = LOOPS[loop]
    pool = AsyncReqToTokenPool(5, 8, kv=KVPagePool(9, 4))

    async def setup() -> None:
        await pool.alloc(2)
        await pool.alloc(3)  # queued: 2 rows free; abandoned with its loop

    _abandon_a_waiter(factory, setup)

    async def next_loop() -> None:
        with caplog.at_level(logging.WARNING, logger="asyncpool.pool"):
            rows = pool.try_alloc(1)
        assert rows is not None and pool.waiting() == 0
        assert any("closed with 1 waiter" in r.getMessage() for r in caplog.records)
        grant = pool.try_admit(pages=1)
        assert grant is not None
        pool.check_invariants()

    run(factory, next_loop())


@pytest.mark.parametrize("loop", LOOPS)
def test_a_row_granted_after_a_move_reads_zero_lengths(loop: str) -> None:
    """A grant's reset was queued on a loop stopped before it ran; the pool
    moved to the next loop with that row still listed as awaiting its reset,
    so grants there scheduled no reset of their own (asyncio: the next owner
    read the previous one's lengths)."""
    factory = LOOPS[loop]
    pool = AsyncReqToTokenPool(3, 8)
    old = factory()
    stranded: list[asyncio.Future[list[int]]] = []
    try:

        async def setup() -> list[int]:
            rows = await pool.alloc(2)
            stranded.append(asyncio.ensure_future(pool.alloc(1)))  # never resumes
            await asyncio.sleep(0)
            return rows

        a, b = old.run_until_complete(setup())

        async def shutdown() -> None:
            pool.free([a])  # granted to the waiter; its reset queued on this loop
            old.stop()  # in the same iteration: neither the reset nor the waiter runs

        old.create_task(shutdown())
        old.run_forever()

        async def next_loop() -> int:
            pool.set_req_pool_info(b, ReqToTokenPoolInfo(5, 5, torch.arange(5)))
            async with bounded():
                waiter = asyncio.ensure_future(pool.alloc(1))
                await asyncio.sleep(0)
                pool.free([b])  # granted to the waiter on this loop
                [row] = await waiter
            return row

        row = run(factory, next_loop())
        assert row == b
        assert (int(pool.verified_lens[row]), int(pool.alloced_lens[row])) == (0, 0)
        assert int(pool.verified_lens[a]) == 0  # its reset ran at the move too
    finally:
        for task in asyncio.all_tasks(old):
            task.cancel()
        old.run_until_complete(asyncio.sleep(0))
        old.close()


def _rows_pending_behind_a_done_fence(
    factory: Callable[[], asyncio.AbstractEventLoop], kit: Streams, *, close: bool
) -> tuple[AsyncReqToTokenPool, asyncio.AbstractEventLoop]:
    """A pool whose two rows were freed on loop A behind a fence that
    completed after A ended (its wake-up went to A: closed, or stopped and
    never run again). Returns the pool and A (closed or left open)."""
    pool = AsyncReqToTokenPool(3, 8)
    stream = kit.stream()
    gate = kit.event()

    old = factory()
    # The step still runs when the loop ends.
    old.run_until_complete(_free_two_rows_behind_a_gated_step(pool, stream, gate))
    if close:
        old.close()
    gate.set()
    stream.synchronize()
    assert pool.pending_size() == 2
    return pool, old


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("old_loop", ["closed", "left open"])
def test_a_read_on_the_next_loop_sees_memory_whose_fence_completed_between(
    loop: str, old_loop: str, kit: Streams
) -> None:
    """A trial found a scheduler that sizes its batches by the counts and
    awaits once per step never got back rows freed behind a fence that
    completed after the warm-up loop ended: the wake-up went to that loop
    (dropped when closed, stuck when left open), and reads never moved the
    pool, so `available_size()` read 0 for good. A read on the owner's
    thread from the next loop moves the pool there and looks at its fences
    at once, as any call does."""
    factory = LOOPS[loop]
    pool, old = _rows_pending_behind_a_done_fence(factory, kit, close=old_loop == "closed")
    try:

        async def serve() -> None:
            await asyncio.sleep(0)  # a step awaited: nothing reads yet
            assert pool.available_size() == 2
            assert pool.pending_size() == 0
            pool.check_invariants()

        run(factory, serve())
    finally:
        old.close()


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("read", ["available_size", "pending_size", "quarantined_size", "stats"])
def test_every_count_moves_the_pool_to_the_next_loop(loop: str, read: str, kit: Streams) -> None:
    """Each read a scheduler may size its batches by moves the pool when
    the pool's own loop is gone, and a fence that completes afterwards wakes
    the pool on the new loop with nobody calling it (awaiting is enough)."""
    factory = LOOPS[loop]
    pool = AsyncReqToTokenPool(3, 8)
    stream = kit.stream()
    gate = kit.event()

    run(factory, _free_two_rows_behind_a_gated_step(pool, stream, gate))

    async def serve() -> None:
        getattr(pool, read)()
        gate.set()  # completes after the move: its wake-up comes here
        # Steps, and nothing calls the pool: the ledger's own count is
        # watched, since every public count would move the pool itself.
        await until(lambda: pool._ledger.free_count == 2)

    run(factory, serve())
    pool.check_invariants()


@pytest.mark.parametrize("loop", LOOPS)
def test_a_read_from_another_thread_does_not_move_the_pool(loop: str, kit: Streams) -> None:
    """A metrics scrape from another thread, inside that thread's own loop,
    only reads: the pool stays on its loop and its wake-ups still come
    there."""
    factory = LOOPS[loop]
    pool, old = _rows_pending_behind_a_done_fence(factory, kit, close=True)
    seen: list[int] = []

    async def scrape() -> None:
        seen.append(pool.available_size())
        seen.append(pool.stats().free)

    reader = threading.Thread(target=run, args=(factory, scrape()))
    reader.start()
    reader.join(WAIT_S)
    assert not reader.is_alive()
    assert seen == [0, 0]  # the rows stay pending: only the owner's loop may look
    assert pool._loop is old  # not moved to the reader's loop

    async def serve() -> None:
        assert pool.available_size() == 2  # the owner's next loop looks

    run(factory, serve())


@pytest.mark.parametrize("loop", LOOPS)
def test_a_read_on_the_next_loop_logs_what_is_overdue(loop: str, kit: Streams) -> None:
    """A transfer that never completes, freed behind on a loop that ended:
    the overdue check armed there never fires. The next loop's first read
    moves the pool and the check runs there (logged once)."""
    factory = LOOPS[loop]
    pool = AsyncReqToTokenPool(3, 8, fence_timeout=0.05)
    transfer = _Transfer()

    async def warm_up() -> None:
        pool.free(await pool.alloc(1), fence=transfer)  # arms the check on this loop

    run(factory, warm_up())

    async def serve() -> None:
        with overdue_warnings() as logged:
            pool.available_size()
            async with bounded():
                await logged.wait()

    run(factory, serve())
    assert pool.stats().overdue_fences == 1
    transfer.done = True
    assert pool.reclaim() == 1
    run(factory, pool.close())


@pytest.mark.parametrize("loop", LOOPS)
def test_a_read_never_raises_where_a_call_would(loop: str, kit: Streams) -> None:
    """The pool's loop was left open with a waiter queued on it (its task
    may still resume there): an alloc that must wait on another loop raises
    WrongThreadError; a read there only reads, and the pool stays."""
    factory = LOOPS[loop]
    pool = AsyncReqToTokenPool(2, 8)  # one row
    old = factory()
    queued: list[asyncio.Future[list[int]]] = []

    async def queue_a_waiter() -> None:
        await pool.alloc(1)
        queued.append(asyncio.ensure_future(pool.alloc(1)))  # waits for the row
        await asyncio.sleep(0)

    try:
        old.run_until_complete(queue_a_waiter())
        assert pool.waiting() == 1

        async def read() -> None:
            assert pool.available_size() == 0
            assert pool.pending_size() == 0
            assert pool.quarantined_size() == 0
            assert pool.stats().waiters == 1
            with pytest.raises(WrongThreadError):
                await pool.alloc(1)

        run(factory, read())
        assert pool._loop is old
    finally:
        for task in queued:
            task.cancel()
        old.run_until_complete(asyncio.gather(*queued, return_exceptions=True))
        old.close()
