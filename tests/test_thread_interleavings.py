"""Every thread switch point of the unchecked fast paths, explored in turn.

On a GIL build of CPython a thread can lose the GIL only after a call
returns, at a function entry or at a backward jump. A profile hook sees the
first two as ``c_return`` and ``call`` events, so running a *foreign* call
from inside the hook at the k-th event reproduces, deterministically, what
another thread could do at that switch point. "Foreign" is simulated in this
thread by making the pool see another thread ident for the duration of the
call: it takes the unchecked paths where they are open and gets
``WrongThreadError`` everywhere else, as a real foreign thread would.

Each test runs the owner's call once per switch point k = 1, 2, ... until
the hook no longer fires, with the foreign call injected at k, and checks
that the pool is intact: invariants, no row held twice, a double free freed
once, no dirty row handed out. A call placed between a fast path's checks
and its commit (a new switch point there) fails these tests.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from asyncpool import AsyncReqToTokenPool, DoubleFreeError, WrongThreadError
from asyncpool import pool as pool_module

MAX_POINTS = 500  # far more switch points than any fast path has


def _run_sync(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine that must complete without suspending (a fast path)."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise AssertionError("the call suspended: it was not a fast path")


def _as_foreign(call: Callable[[], Any]) -> tuple[str, Any]:
    """``call`` as another thread would make it: ("ok", value) or ("refused", error)."""
    real = pool_module._get_ident
    pool_module._get_ident = lambda: -1  # type: ignore[assignment]  # not the owner
    try:
        return "ok", call()
    except (WrongThreadError, DoubleFreeError) as exc:
        return "refused", exc
    finally:
        pool_module._get_ident = real


class _Injector:
    """A profile hook that runs ``foreign`` at the ``at``-th switch point."""

    def __init__(self, at: int, foreign: Callable[[], Any]) -> None:
        self.at = at
        self.foreign = foreign
        self.seen = 0
        self.outcome: tuple[str, Any] | None = None

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event not in ("call", "c_return") or self.outcome is not None:
            return
        self.seen += 1
        if self.seen == self.at:
            sys.setprofile(None)
            self.outcome = _as_foreign(self.foreign)

    def run(self, owner: Callable[[], Any]) -> tuple[str, Any]:
        sys.setprofile(self)
        try:
            try:
                return "ok", owner()
            except (WrongThreadError, DoubleFreeError) as exc:
                return "refused", exc
        finally:
            sys.setprofile(None)


def _explore(
    setup: Callable[[], tuple[Any, Callable[[], Any], Callable[[], Any]]],
    check: Callable[[Any, tuple[str, Any], tuple[str, Any]], None],
) -> int:
    """Run setup/owner/foreign once per switch point; return how many there were."""
    for at in range(1, MAX_POINTS):
        state, owner, foreign = setup()
        injector = _Injector(at, foreign)
        mine = injector.run(owner)
        if injector.outcome is None:
            return at - 1  # the owner's call had fewer switch points than ``at``
        check(state, mine, injector.outcome)
    raise AssertionError("the owner's call never ran out of switch points")


async def _open_pool(size: int) -> AsyncReqToTokenPool:
    pool = AsyncReqToTokenPool(size, 4)
    pool.free(await pool.alloc(1))  # bound here, the unchecked paths open
    await pool.alloc(1)  # the general path reopened them; hold nothing else
    return pool


@pytest.mark.parametrize("form", ["list", "int", "mixed"])
async def test_a_free_racing_a_free_of_the_same_row_frees_it_once(form: str) -> None:
    """``free([row])`` and ``free(row)`` (the bare int takes the same
    unchecked path since 9e44193), the owner's and the foreign call in
    either form."""
    pools: list[AsyncReqToTokenPool] = []

    def setup() -> tuple[Any, Callable[[], Any], Callable[[], Any]]:
        pool = pools[-1]
        rows = _run_sync(pool.alloc(1))
        assert pool._fast
        row = rows[0]
        mine = (lambda: pool.free(rows)) if form == "list" else (lambda: pool.free(row))
        theirs = (lambda: pool.free(row)) if form == "int" else (lambda: pool.free(rows))
        return (pool, rows), mine, theirs

    def check(state: Any, mine: tuple[str, Any], theirs: tuple[str, Any]) -> None:
        pool, rows = state
        assert [mine[0], theirs[0]].count("ok") == 1, (mine, theirs)
        pool.check_invariants()
        assert list(pool._free_q).count(rows[0]) == 1

    pools.append(await _open_pool(8))
    points = _explore(setup, check)
    assert points >= 3  # the free really was interleaved with


async def test_an_alloc_racing_an_alloc_never_shares_a_row() -> None:
    pool = await _open_pool(4096)

    def setup() -> tuple[Any, Callable[[], Any], Callable[[], Any]]:
        assert pool._fast
        clean = pool._ledger._clean
        return (pool, clean), lambda: _run_sync(pool.alloc(1)), lambda: _run_sync(pool.alloc(1))

    def check(setup_state: Any, mine: tuple[str, Any], theirs: tuple[str, Any]) -> None:
        state, clean = setup_state
        assert mine[0] == "ok"
        granted = list(mine[1])
        if theirs[0] == "ok":
            granted += theirs[1]
        assert len(set(granted)) == len(granted), (mine, theirs)
        # Every row granted here was clean: the clean count fell by exactly
        # as many (a lost update would later hand out a dirty row as clean).
        assert state._ledger._clean == clean - len(granted), (mine, theirs)
        state.check_invariants()
        for row in granted:
            assert state._ledger.state_of(row) == "allocated"
            state.free([row])  # checked free; reopened by the next alloc
        _run_sync(state.alloc(1))  # general path at times: keeps the gate open
        state.free(_run_sync(state.alloc(1)))

    assert _explore(setup, check) >= 3


@pytest.mark.parametrize("foreign_kind", ["alloc", "free"])
async def test_a_checked_call_with_a_reset_keeps_foreign_calls_out(foreign_kind: str) -> None:
    # The owner's alloc runs the general path: no clean row is left, so it
    # resets the dirty ones (a tensor op; the GIL may drop inside it). A
    # foreign fast call at any switch point must be refused or complete
    # cleanly; no row may be handed out dirty, none twice.
    pool = AsyncReqToTokenPool(6, 4)
    held_for_free: list[list[int]] = []

    def setup() -> tuple[Any, Callable[[], Any], Callable[[], Any]]:
        # Every free row dirty, the gate open, one row held for a foreign free.
        for row in range(1, 6):
            if pool._ledger.state_of(row) == "allocated":
                pool.free([row])
        rows = [_run_sync(pool.alloc(1)) for _ in range(5)]
        for r in rows:
            pool.verified_lens[r[0]] = 7
        held = rows.pop()
        for r in rows:
            pool.free(r)
        held_for_free[:] = [held]
        assert pool._ledger._clean == 0 and pool._fast

        def foreign_alloc() -> list[int]:
            rows: list[int] = _run_sync(pool.alloc(1))
            pool.verified_lens[rows[0]] = 5  # the new owner writes at once
            return rows

        foreign: Callable[[], Any] = (
            foreign_alloc if foreign_kind == "alloc" else (lambda: pool.free(held))
        )
        return pool, lambda: _run_sync(pool.alloc(1)), foreign

    def check(state: Any, mine: tuple[str, Any], theirs: tuple[str, Any]) -> None:
        assert mine[0] == "ok"
        granted = list(mine[1])
        if foreign_kind == "alloc" and theirs[0] == "ok":
            granted += theirs[1]
        assert len(set(granted)) == len(granted), (mine, theirs)
        assert int(state.verified_lens[mine[1][0]]) == 0, "the owner's row was handed out dirty"
        if foreign_kind == "alloc" and theirs[0] == "ok":
            # Handed out clean and not reset under its new owner afterwards.
            assert int(state.verified_lens[theirs[1][0]]) == 5, "a reset clobbered a granted row"
        state.check_invariants()

    pool.free(await pool.alloc(1))
    assert _explore(setup, check) >= 3
    await pool.close()


async def test_a_give_back_after_a_cancelled_grant_keeps_foreign_calls_out() -> None:
    """A waiter granted rows and cancelled before it resumed gives them back
    (``WaiterQueues.cancelled`` -> the pool's ``_give_back``). The grant
    emptied the queue and a checked free reopened the unchecked paths, so a
    foreign ``alloc(1)`` could land inside ``put_back``'s ``_clean += k`` and
    lose its decrement: a dirty row was then counted clean and handed out
    with its last owner's lengths (found by a review; with tracing on, the
    only way CPython 3.11 keeps that switch point, it showed with real
    threads too). The give-back closes the unchecked paths first."""

    async def prepare() -> tuple[AsyncReqToTokenPool, Any]:
        pool = AsyncReqToTokenPool(12, 4)
        spare = await pool.alloc(1)  # bound here
        dirty = [_run_sync(pool.alloc(1)) for _ in range(4)]
        for rows in dirty:
            pool.verified_lens[rows[0]] = 7  # the last owner's lengths
            pool.free(rows)  # to the tail, dirty
        hold = pool.hold_grants(warn_after=None)
        loop = asyncio.get_running_loop()
        # What alloc(3) does when it must queue (enqueue is inlined there).
        hist = pool._waiters.figures(0).histograms[0]  # priority 0's alloc waits
        waiter, _ = pool._waiters.enqueue(3, 0, None, loop, pool._wait_times, hist)
        hold.release()  # the grant loop hands the waiter 3 rows
        assert waiter[1].done() and not pool.waiting()
        pool.free(spare)  # a checked one-row free, nobody waiting: reopens
        assert pool._fast
        return pool, waiter

    def check(state: Any, mine: tuple[str, Any], theirs: tuple[str, Any]) -> None:
        pool, clean_before = state
        led = pool._ledger
        took = 1 if theirs[0] == "ok" else 0
        assert led._clean == clean_before + 3 - took, (mine, theirs)
        if took:
            assert int(pool.verified_lens[theirs[1][0]]) == 0, "handed out dirty"
        pool.check_invariants()
        while led._clean:  # every row counted clean reads zero
            row = _run_sync(pool.alloc(1))[0]
            assert int(pool.verified_lens[row]) == 0, f"row {row} counted clean, dirty"

    points = 0
    for at in range(1, MAX_POINTS):
        pool, waiter = await prepare()
        clean_before = pool._ledger._clean
        injector = _Injector(at, lambda pool=pool: _run_sync(pool.alloc(1)))
        mine = injector.run(lambda pool=pool, waiter=waiter: pool._waiters.cancelled(waiter))
        if injector.outcome is None:
            points = at - 1
            break
        check((pool, clean_before), mine, injector.outcome)
        await pool.close()
    assert points >= 3
