"""``alloc_threadsafe`` / ``admit_threadsafe``: waits submitted from a frontend thread.

An API server's worker threads admit requests into a pool whose loop runs in
the scheduler's thread. ``asyncio.run_coroutine_threadsafe(pool.admit(...))``
loses the row and its pages when the worker's ``cancel()`` races the grant
(``cancel()`` answers True, the task was granted, asyncio drops the result).
These tests hold the thread-safe entries to their contract: ``cancel()`` True
means nothing is the caller's (the queued wait cancelled, or a grant that came
first given back on the loop), False means ``result()`` has the grant.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import random
import threading
import weakref

import pytest
from helpers import WAIT_S, bounded, in_thread, until

from asyncpool import (
    AsyncReqToTokenPool,
    CapacityError,
    Grant,
    KVPagePool,
    PoolClosedError,
)


def _admit_pool() -> AsyncReqToTokenPool:
    return AsyncReqToTokenPool(3, 4, kv=KVPagePool(8, 2))  # 2 rows, 7 pages


async def test_a_grant_that_came_before_the_cancel_is_given_back() -> None:
    async with bounded(), _admit_pool() as pool:
        held = [await pool.admit(pages=1), await pool.admit(pages=1)]  # every row
        fut = await asyncio.to_thread(pool.admit_threadsafe, pages=2)
        await until(lambda: pool.waiting() == 1)
        pool.free([held[0].row])  # granted at hand-over; its task resumes next turn
        assert pool.stats().allocated == 2  # the waiter's grant, not yet delivered
        assert in_thread(fut.cancel) is True  # the frontend gives up first
        await until(lambda: pool.stats().allocated == 1)
        stats = pool.stats()
        assert (stats.pages_allocated, stats.cancellations, stats.waiters) == (1, 1, 0)
        assert fut.cancelled()
        pool.check_invariants()
        assert pool.try_admit(pages=6) is not None  # row and pages free again


async def test_cancel_of_a_queued_wait_cancels_it_on_the_loop() -> None:
    async with bounded(), _admit_pool() as pool:
        held = [await pool.admit(pages=1), await pool.admit(pages=1)]
        fut = await asyncio.to_thread(pool.admit_threadsafe, pages=1)
        await until(lambda: pool.waiting() == 1)
        assert in_thread(fut.cancel) is True
        await until(lambda: pool.waiting() == 0)
        pool.free([held[0].row])
        stats = pool.stats()
        assert (stats.allocated, stats.pages_allocated, stats.cancellations) == (1, 1, 1)


async def test_a_delivered_grant_cannot_be_cancelled() -> None:
    async with bounded(), _admit_pool() as pool:
        pool.bind()
        fut = await asyncio.to_thread(pool.admit_threadsafe, pages=3)
        grant = await asyncio.wrap_future(fut)
        assert isinstance(grant, Grant) and len(grant.pages) == 3
        assert in_thread(fut.cancel) is False
        assert fut.result() is grant
        assert pool.stats().allocated == 1
        pool.free([grant.row])
        assert pool.stats().pages_allocated == 0


async def test_alloc_threadsafe_rows_and_errors() -> None:
    async with bounded(), AsyncReqToTokenPool(3, 4) as pool:
        pool.bind()
        rows = await asyncio.wrap_future(await asyncio.to_thread(pool.alloc_threadsafe, 2))
        assert sorted(rows) == [1, 2]
        bad = await asyncio.to_thread(pool.alloc_threadsafe, 3)  # past the capacity
        with pytest.raises(CapacityError):
            await asyncio.wrap_future(bad)
        late = await asyncio.to_thread(pool.alloc_threadsafe, 1, timeout=0.001)
        with pytest.raises(TimeoutError):
            await asyncio.wrap_future(late)
        queued = await asyncio.to_thread(pool.alloc_threadsafe, 1)
        await until(lambda: pool.waiting() == 1)
        loop = asyncio.get_running_loop()
        closing = await asyncio.to_thread(asyncio.run_coroutine_threadsafe, pool.close(), loop)
        await asyncio.wrap_future(closing)  # close() submitted from another thread
        with pytest.raises(PoolClosedError):
            await asyncio.wrap_future(queued)
        assert pool.stats().allocated == 2


def test_no_loop_yet_or_a_closed_loop_is_a_runtime_error() -> None:
    pool = _admit_pool()
    with pytest.raises(RuntimeError, match="bind"):
        pool.admit_threadsafe(pages=1)
    pool.bind()  # outside any loop: the thread is bound, no loop is known yet
    with pytest.raises(RuntimeError, match="running loop"):
        pool.admit_threadsafe(pages=1)
    loop = asyncio.new_event_loop()

    async def bind() -> None:
        pool.bind()

    loop.run_until_complete(bind())
    loop.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.alloc_threadsafe(1)
    assert pool.stats().allocated == 0


def test_a_closed_pool_answers_pool_closed_whatever_its_loop() -> None:
    # A replica shut down for good, its loop closed after: a router thread's
    # submission reads as closed (what alloc and admit raise), not as a pool
    # to bind() again; the same on a closed pool that never had a loop.
    pool = _admit_pool()
    loop = asyncio.new_event_loop()

    async def bind_and_close() -> None:
        pool.bind()
        await pool.close()

    loop.run_until_complete(bind_and_close())
    loop.close()
    never_bound = _admit_pool()
    asyncio.run(never_bound.close())
    for closed in (pool, never_bound):
        for submitted, what in (
            (in_thread(lambda p=closed: p.alloc_threadsafe(1)), "no rows can be allocated"),
            (in_thread(lambda p=closed: p.admit_threadsafe(pages=1)), "nothing can be admitted"),
        ):
            assert submitted.done()
            with pytest.raises(PoolClosedError, match=what):
                submitted.result(timeout=0)
        assert closed.stats().allocated == 0


@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_frontend_threads_cancelling_at_random_leak_nothing(seed: int) -> None:
    async with bounded(4 * WAIT_S), _admit_pool() as pool:
        pool.bind()
        loop = asyncio.get_running_loop()
        delivered: list[Grant] = []
        lock = threading.Lock()
        outcomes = {"cancelled": 0, "delivered": 0}

        def frontend(wid: int) -> None:
            rng = random.Random(seed * 10 + wid)
            for _ in range(150):
                fut = pool.admit_threadsafe(pages=rng.randint(1, 3))
                try:
                    fut.result(timeout=rng.choice([0.0, 0.0005, 0.002]))
                except concurrent.futures.TimeoutError:
                    pass
                if fut.cancel():
                    with lock:
                        outcomes["cancelled"] += 1
                    continue
                grant = fut.result(timeout=WAIT_S)
                with lock:
                    outcomes["delivered"] += 1
                loop.call_soon_threadsafe(pool.free, [grant.row])
                with lock:
                    delivered.append(grant)

        workers = [threading.Thread(target=frontend, args=(w,)) for w in range(3)]
        for th in workers:
            th.start()
        await until(lambda: not any(th.is_alive() for th in workers))
        await until(lambda: pool.waiting() == 0 and pool.stats().allocated == 0)
        stats = pool.stats()
        assert outcomes["cancelled"] + outcomes["delivered"] == 450
        assert len(delivered) == outcomes["delivered"]
        assert (stats.allocated, stats.pages_allocated) == (0, 0)
        assert stats.admits >= outcomes["delivered"]
        pool.check_invariants()


async def _settled_without_cycles(pool: AsyncReqToTokenPool, end: str) -> tuple[bool, bool]:
    """Submit a thread-safe wait that queues, end it (``end``), drop every
    reference the test holds, and answer whether its task and its future
    are still alive with the cycle collector off."""
    fut = await asyncio.to_thread(
        pool.alloc_threadsafe, 1, timeout=0.01 if end == "timeout" else 60.0
    )

    def queued(f: concurrent.futures.Future[list[int]] = fut) -> bool:
        return pool.waiting() == 1 or f.done()

    await until(queued)
    del queued  # it holds the future
    (task,) = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    task_ref, fut_ref = weakref.ref(task), weakref.ref(fut)
    if end == "cancel":
        assert in_thread(fut.cancel) is True
    elif end == "close":
        await pool.close()
    async with bounded():
        await asyncio.wait([task])
    assert fut.done()
    del task, fut
    await asyncio.sleep(0)
    return task_ref() is not None, fut_ref() is not None


@pytest.mark.parametrize("end", ["cancel", "timeout", "close"])
async def test_an_ended_wait_leaves_no_reference_cycle(end: str) -> None:
    """A cancelled, timed-out or failed thread-safe wait is freed when the
    caller drops its future, not at the cycle collector's next run: its
    task's CancelledError (or the future's error) held the submitting
    frame, which held the future, whose done callback held the task."""
    async with bounded(), AsyncReqToTokenPool(2, 16) as pool:
        held = await pool.alloc(1)
        gc.disable()
        try:
            alive = await _settled_without_cycles(pool, end)
        finally:
            gc.enable()
        assert alive == (False, False)
        pool.free(held)
