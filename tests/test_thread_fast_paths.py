"""The unchecked fast paths: safe from a foreign thread, closed where unsafe.

``alloc(1)`` of a clean row and ``free`` of one row while nobody waits do not
ask which thread calls them (as asyncio's ``call_soon`` does not outside debug
mode); the pool's module docstring says why a foreign call there cannot
corrupt it. These tests hold the pool to that: a foreign call on a fast path
completes as the owner's would, everything else is refused, debug mode and
``kv`` pools close the fast paths, a waiter queued while a foreign free landed
is still served, and two threads hammering the pool with a tiny switch
interval never hand one row to two holders nor break an invariant.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
import uvloop
from helpers import WAIT_S, EventFence, bounded, in_thread, pool_snapshot

from asyncpool import (
    AsyncReqToTokenPool,
    DoubleFreeError,
    HostStream,
    InvalidSlotError,
    KVPagePool,
    WrongThreadError,
)
from asyncpool.waiters import WaiterQueues


@pytest.fixture
def tiny_switch_interval() -> Iterator[None]:
    """Make the GIL switch threads as often as it can (about every 1 us)."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


async def test_foreign_fast_free_completes_as_the_owners_would() -> None:
    async with bounded(), AsyncReqToTokenPool(5, 4) as pool:
        rows = await pool.alloc(2)  # binds; the fast paths are open
        assert in_thread(lambda: pool.free(rows[:1])) == 1
        pool.check_invariants()
        assert pool.available_size() == 3
        # Not a fast path (two rows, a fence, nothing allocated): refused.
        with pytest.raises(WrongThreadError):
            in_thread(lambda: pool.free(rows))
        with pytest.raises(WrongThreadError):
            in_thread(lambda: pool.try_alloc(1))
        before = pool_snapshot(pool)
        with pytest.raises(WrongThreadError):
            in_thread(lambda: pool.free(rows[:1]))  # already free: checked path
        assert pool_snapshot(pool) == before
        pool.free(rows[1:])
        assert pool.available_size() == 4


async def test_a_bare_int_takes_the_one_row_fast_free() -> None:
    """``free(row)``, the seed's callers' form, is the fast path as
    ``free([row])`` is (it was the general path, about 2.5x the cost): a
    foreign call completes as the owner's would, and the checks stay."""
    async with bounded(), AsyncReqToTokenPool(5, 4) as pool:
        rows = await pool.alloc(2)
        assert in_thread(lambda: pool.free(rows[0])) == 1  # was WrongThreadError
        pool.check_invariants()
        assert pool.available_size() == 3
        before = pool_snapshot(pool)
        with pytest.raises(DoubleFreeError):
            pool.free(rows[0])
        with pytest.raises(InvalidSlotError, match="True"):
            pool.free(True)  # type: ignore[arg-type]
        assert pool_snapshot(pool) == before
        waiter = asyncio.create_task(pool.alloc(4))
        await asyncio.sleep(0)
        assert pool.waiting() == 1
        with pytest.raises(WrongThreadError):  # someone waits: checked, refused
            in_thread(lambda: pool.free(rows[1]))
        assert pool.free(rows[1]) == 1  # the owner's grants the waiter
        assert sorted(await waiter) == [1, 2, 3, 4]


@pytest.mark.parametrize("form", ["np.int64", "torch scalar", "fence=", "after=", "two rows"])
async def test_a_foreign_free_off_the_one_int_form_is_refused(form: str) -> None:
    """docs/api.md (*threads*): only ``free(row)`` or ``free([row])`` of one
    int row, unfenced, skips the thread check; ``free(np.int64(5))``, a
    fenced free or two rows from another thread raise, nothing changed."""
    async with bounded(), AsyncReqToTokenPool(5, 4) as pool:
        rows = await pool.alloc(2)  # binds; the fast paths are open
        stream = HostStream()
        try:
            call = {
                "np.int64": lambda: pool.free(np.int64(rows[0])),
                "torch scalar": lambda: pool.free(torch.tensor(rows[0])),
                "fence=": lambda: pool.free(rows[0], fence=EventFence()),
                "after=": lambda: pool.free(rows[0], after=stream),
                "two rows": lambda: pool.free(rows),
            }[form]
            # No checked call first: it would close the fast paths itself.
            with pytest.raises(WrongThreadError):
                in_thread(call)
            assert pool.available_size() == 2 and pool.pending_size() == 0
            assert pool.free(rows) == 2  # both still allocated: nothing changed
            pool.check_invariants()
        finally:
            stream.close()


async def test_foreign_fast_alloc_takes_a_row_of_its_own() -> None:
    async with bounded(), AsyncReqToTokenPool(5, 4) as pool:
        mine = await pool.alloc(1)
        pool.free(mine)  # the general path opened alloc's fast path
        theirs = in_thread(lambda: asyncio.run(pool.alloc(1)))
        assert len(theirs) == 1 and theirs != mine
        pool.check_invariants()
        assert pool.stats().allocated == 1
        pool.free(theirs)


async def test_a_foreign_free_never_runs_the_grant_loop() -> None:
    # While anyone waits the fast free is closed: a foreign free is refused,
    # changing nothing, and the waiter is not granted from that thread.
    async with bounded(), AsyncReqToTokenPool(2, 4) as pool:
        held = await pool.alloc(1)
        waiter = asyncio.create_task(pool.alloc(1))
        await asyncio.sleep(0)
        assert pool.waiting() == 1
        before = pool_snapshot(pool)
        with pytest.raises(WrongThreadError):
            in_thread(lambda: pool.free(held))
        assert pool_snapshot(pool) == before and not waiter.done()
        pool.free(held)
        assert await waiter == held


async def test_a_foreign_free_cannot_land_between_a_short_take_and_the_enqueue(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An unchecked free grants nobody, so one that landed after alloc found
    # nothing free and before it queued would leave that waiter asleep next
    # to a free row. alloc's checked path closes the unchecked ones first:
    # a foreign free in that window (run from inside enqueue) is refused,
    # changing nothing, and the waiter is served by the owner's free.
    async with bounded(), AsyncReqToTokenPool(2, 4) as pool:
        held = await pool.alloc(1)
        pool.free(held)
        held = await pool.alloc(1)  # fast paths open
        real_enqueue = WaiterQueues.enqueue
        refused: list[BaseException] = []

        def enqueue_after_a_foreign_free(self: WaiterQueues, *args: Any) -> Any:
            monkeypatch.setattr(WaiterQueues, "enqueue", real_enqueue)
            before = pool_snapshot(pool)
            try:
                in_thread(lambda: pool.free(held))
            except WrongThreadError as exc:
                refused.append(exc)
            assert pool_snapshot(pool) == before
            return real_enqueue(self, *args)

        monkeypatch.setattr(WaiterQueues, "enqueue", enqueue_after_a_foreign_free)
        waiter = asyncio.create_task(pool.alloc(1))
        await asyncio.sleep(0)
        assert refused and pool.waiting() == 1 and not waiter.done()
        pool.free(held)
        assert await waiter == held
        pool.check_invariants()
        pool.free(held)


async def test_debug_mode_closes_the_fast_paths() -> None:
    asyncio.get_running_loop().set_debug(True)
    async with bounded(), AsyncReqToTokenPool(5, 4) as pool:
        rows = await pool.alloc(2)
        pool.free(await pool.alloc(1))
        before = pool_snapshot(pool)
        with pytest.raises(WrongThreadError):
            in_thread(lambda: pool.free(rows[:1]))
        with pytest.raises(WrongThreadError):
            in_thread(lambda: asyncio.run(pool.alloc(1)))
        assert pool_snapshot(pool) == before
        pool.free(rows)


LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


@pytest.mark.parametrize("loop", LOOPS)
def test_a_debug_loop_closes_the_fast_paths_of_a_pool_bound_outside_any_loop(
    loop: str,
) -> None:
    """bind() in set-up code, then a loop in debug mode that never waits,
    pends or reads a count: the fast paths were decided without a loop (the
    environment says no debug mode) and stayed open, so a foreign alloc(1)
    went through where debug mode promises every call is checked (found by
    a trial of the thread rules). They now open only once a loop is
    attached, by its own flag."""
    pool = AsyncReqToTokenPool(5, 4)
    pool.bind()

    async def serve() -> None:
        rows = await pool.alloc(2)
        pool.free(await pool.alloc(1))  # nothing waits, pends or reads a count
        with pytest.raises(WrongThreadError):
            in_thread(lambda: asyncio.run(pool.alloc(1)))
        with pytest.raises(WrongThreadError):
            in_thread(lambda: pool.free(rows[:1]))
        assert pool.allocated_size() == 2
        pool.free(rows)

    debug = LOOPS[loop]()
    debug.set_debug(True)
    try:
        debug.run_until_complete(serve())
    finally:
        debug.close()


@pytest.mark.parametrize("loop", LOOPS)
def test_a_pool_bound_outside_any_loop_opens_its_fast_paths_once_a_loop_is_attached(
    loop: str,
) -> None:
    """The same pool on a loop out of debug mode: checked until a loop is
    attached, here by a fenced free (an engine's every step), then the fast
    paths open (a foreign alloc(1) completes as the owner's would)."""
    pool = AsyncReqToTokenPool(5, 4)
    pool.bind()

    async def serve() -> None:
        rows = await pool.alloc(2)
        with pytest.raises(WrongThreadError):  # no loop attached yet: checked
            in_thread(lambda: asyncio.run(pool.alloc(1)))
        gate = threading.Event()
        with HostStream() as stream:
            stream.launch(gate.wait, WAIT_S)
            pool.free(rows, after=stream)  # pending: attaches this loop
            gate.set()
            stream.synchronize()
        assert pool.reclaim() == 2  # no wait and no count read attach it here
        pool.free(await pool.alloc(1))  # a checked call reopens the fast paths
        theirs = in_thread(lambda: asyncio.run(pool.alloc(1)))
        assert len(theirs) == 1 and pool.allocated_size() == 1
        pool.free(theirs)

    plain = LOOPS[loop]()
    plain.set_debug(False)  # out of debug mode even in CI's debug-mode run
    try:
        plain.run_until_complete(serve())
    finally:
        plain.close()


async def test_a_kv_pool_checks_every_call() -> None:
    async with bounded(), AsyncReqToTokenPool(5, 4, kv=KVPagePool(9, 4)) as pool:
        rows = await pool.alloc(1)
        pool.free(await pool.alloc(1))
        before = pool_snapshot(pool)
        with pytest.raises(WrongThreadError):
            in_thread(lambda: pool.free(rows))
        with pytest.raises(WrongThreadError):
            in_thread(lambda: asyncio.run(pool.alloc(1)))
        assert pool_snapshot(pool) == before
        pool.free(rows)


async def test_bind_reopens_the_fast_paths_for_the_new_owner_only() -> None:
    pool = AsyncReqToTokenPool(5, 4)
    pool.free(await pool.alloc(1))

    async def serve() -> list[int]:
        pool.bind()
        got = await pool.alloc(1)
        pool.free(got)
        return await pool.alloc(1)

    theirs = in_thread(lambda: asyncio.run(serve()))
    # Back here the old owner's calls take the checked path and are refused.
    with pytest.raises(WrongThreadError, match="'foreign'"):
        pool.free([*theirs, *(r for r in range(1, 5) if r not in theirs)][:2])
    pool.bind()
    pool.free(theirs)
    pool.check_invariants()
    await pool.close()


# ------------------------------------------------------------ two threads at once


def _hammer(
    pool: AsyncReqToTokenPool,
    holders: dict[int, str],
    me: str,
    cycles: int,
    problems: list[str],
    stranded: list[int],
) -> None:
    """``cycles`` of alloc(1) + free on the fast paths, checking each grant.

    A free refused with WrongThreadError changed nothing: the row is still
    this thread's, left in ``stranded`` for the owner to free.
    """

    async def run() -> None:
        alloc, free = pool.alloc, pool.free
        for _ in range(cycles):
            rows = await alloc(1)
            row = rows[0]
            # setdefault is atomic: a row held by two holders at once shows.
            if holders.setdefault(row, me) != me:
                problems.append(f"row {row} granted to {me} while {holders[row]} held it")
            if pool._ledger._state[row] != 1:
                problems.append(f"row {row} granted to {me} but not marked allocated")
            del holders[row]
            try:
                free(rows)
            except WrongThreadError:
                stranded.extend(rows)
                raise

    asyncio.run(run())


@pytest.mark.parametrize("clean", [True, False], ids=["clean-rows", "resets-too"])
async def test_two_threads_on_the_fast_paths_never_share_a_row(
    tiny_switch_interval: None, clean: bool
) -> None:
    # The owner's loop and a foreign thread's loop both allocate and free
    # through the unchecked paths, switched about every microsecond. With a
    # small pool the rows run out of clean ones and resets (checked paths)
    # interleave too; the foreign side then gets WrongThreadError there,
    # which is the contract, and stops.
    cycles = 20_000
    size = 2 * cycles + 2 if clean else 9  # clean: never runs out of clean rows
    pool = AsyncReqToTokenPool(size, 4)
    pool.free(await pool.alloc(1))  # bind here; open alloc's fast path
    holders: dict[int, str] = {}
    problems: list[str] = []
    foreign_error: list[BaseException] = []
    stranded: list[int] = []

    def foreign() -> None:
        try:
            _hammer(pool, holders, "foreign", cycles, problems, stranded)
        except WrongThreadError as exc:
            foreign_error.append(exc)

    th = threading.Thread(target=foreign, name="foreign")
    th.start()
    # The owner's side runs in this loop's thread, as a worker thread of its
    # own would not: the owner must keep calling from its bound thread.
    alloc, free = pool.alloc, pool.free
    for i in range(cycles):
        rows = await alloc(1)
        row = rows[0]
        if holders.setdefault(row, "owner") != "owner":
            problems.append(f"row {row} granted to owner while {holders[row]} held it")
        del holders[row]
        free(rows)
        if i % 1000 == 0:
            await asyncio.sleep(0)
    th.join(WAIT_S)
    assert not th.is_alive(), "the foreign thread hung"
    assert not problems, problems[:5]
    if clean:
        assert not foreign_error, "a clean-row pool kept both threads on the fast paths"
    pool.check_invariants()
    if stranded:
        pool.free(stranded)
    stats = pool.stats()
    assert stats.allocated == 0 and stats.free == size - 1
    await pool.close()


async def test_a_double_free_race_between_threads_frees_the_row_once(
    tiny_switch_interval: None,
) -> None:
    # Both threads free the same row at the same moment, on the unchecked
    # path, many times: exactly one free succeeds each time; the other is
    # refused (DoubleFreeError for the owner, WrongThreadError for the
    # foreign thread) and the row is in the free queue once. A switch point
    # between the fast free's checks and its commit lets both succeed.
    pool = AsyncReqToTokenPool(3, 4)
    pool.free(await pool.alloc(1))
    rounds = 2_000
    start = threading.Barrier(2)
    done = threading.Barrier(2)
    box: list[list[int]] = [[]]
    outcomes: list[tuple[str, str]] = []

    def attempt(who: str) -> None:
        try:
            pool.free(box[0])
            outcomes.append((who, "freed"))
        except (DoubleFreeError, WrongThreadError) as exc:
            outcomes.append((who, type(exc).__name__))

    def foreign() -> None:
        for _ in range(rounds):
            start.wait(WAIT_S)
            attempt("foreign")
            done.wait(WAIT_S)

    th = threading.Thread(target=foreign, name="foreign")
    th.start()
    for r in range(rounds):
        box[0] = await pool.alloc(1)  # leaves the unchecked paths open
        assert pool._fast, "the race needs both frees on the unchecked path"
        start.wait(WAIT_S)
        attempt("owner")
        done.wait(WAIT_S)
        pair = outcomes[2 * r : 2 * r + 2]
        assert [o for _, o in pair].count("freed") == 1, pair
        pool.check_invariants()
    th.join(WAIT_S)
    assert pool.available_size() == 2
    await pool.close()
