"""The pool under structured concurrency: ``asyncio.timeout``, ``TaskGroup``,
level-triggered cancel scopes (anyio's on asyncio: a stand-in that makes
the re-cancel at every turn explicit, and anyio's own ``CancelScope``),
``asyncio.shield``, cancel messages and a runner that ends with calls queued.

``test_async_races.py`` covers a bare ``task.cancel()`` (and one
``asyncio.timeout``) meeting a grant on ``alloc``; here each waiting call
(``alloc``, ``admit`` with one ``kv``, ``admit`` with KV groups, ``lease``)
meets the ways engines cancel in practice. In every test: the call ends the
way the canceller expects (``TimeoutError`` from its own block, the
``CancelledError`` with its message), the task's ``cancelling()`` count is
back where it was, nothing is allocated that no one holds, no waiter is
left, and the next call is served.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import anyio
import pytest
import uvloop
from helpers import WAIT_S, assert_conserved, bounded, grouped_pool, spin

from asyncpool import AsyncReqToTokenPool, KVPagePool

KINDS = ["rows", "pages", "groups"]


def make(kind: str) -> AsyncReqToTokenPool:
    """Two rows; with ``kv``, four pages; with groups, two pages in each."""
    if kind == "rows":
        return AsyncReqToTokenPool(3, 16)
    if kind == "pages":
        return AsyncReqToTokenPool(3, 16, kv=KVPagePool(5, 4))
    return grouped_pool(rows=2, swa=2, full=2)


def exhaust(pool: AsyncReqToTokenPool, kind: str) -> list[int]:
    """Take every row (and every page) at once; return the rows taken."""
    if kind == "rows":
        rows = pool.try_alloc(2)
        assert rows is not None
        return rows
    grant = pool.try_admit(4 if kind == "pages" else {"swa": 2, "full": 2})
    rest = pool.try_alloc(1)
    assert grant is not None and rest is not None
    return [grant.row, *rest]


def full(kind: str) -> tuple[AsyncReqToTokenPool, list[int]]:
    """A new pool of the kind with everything taken: the pool and the rows held."""
    pool = make(kind)
    return pool, exhaust(pool, kind)


def this_task() -> asyncio.Task[Any]:
    """The running task (whose ``cancelling()`` count the tests check)."""
    task = asyncio.current_task()
    assert task is not None
    return task


async def ask(pool: AsyncReqToTokenPool, kind: str, timeout: float | None = None) -> list[int]:
    """The kind's waiting call for one row (and pages); the rows granted."""
    if kind == "rows":
        return await pool.alloc(1, timeout=timeout)
    if kind == "pages":
        return [(await pool.admit(2, timeout=timeout)).row]
    return [(await pool.admit({"swa": 1, "full": 1}, timeout=timeout)).row]


async def lease_one(pool: AsyncReqToTokenPool, kind: str, timeout: float | None = None) -> None:
    """``lease`` waiting for its row, then a body that suspends once."""
    async with pool.lease(1, timeout=timeout):
        await asyncio.sleep(0)


CALLS: dict[str, Callable[..., Awaitable[Any]]] = {"ask": ask, "lease": lease_one}


def assert_settled(pool: AsyncReqToTokenPool, held: list[int]) -> None:
    """Only ``held`` (rows, with the pages they own) is allocated; nobody waits."""
    assert_conserved(pool)
    assert pool.allocated_size() == len(held)
    assert pool.waiting() == 0
    groups: dict[str | None, KVPagePool] = dict(pool.kv_groups or {})
    if pool.kv is not None and not groups:
        groups[None] = pool.kv
    for name, kv in groups.items():
        kv.check_invariants()
        owned = sum(pool.pages_of(row, group=name).numel() for row in held)
        assert kv.allocated_size() == owned, name


async def assert_serves(pool: AsyncReqToTokenPool, kind: str, held: list[int]) -> None:
    """Free ``held``: then everything is free and the next call is served."""
    pool.free(held)
    assert_settled(pool, [])
    async with bounded():
        rows = await ask(pool, kind)
    pool.free(rows)
    assert_settled(pool, [])


# ---------------------------------------------------------------- asyncio.timeout


@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("own", [None, WAIT_S], ids=["no-own-timeout", "longer-own-timeout"])
async def test_an_outer_timeout_raises_its_own_timeout_error(kind, call, own):
    """The block's deadline comes first: the queued call raises the
    ``CancelledError`` that ``asyncio.timeout`` turns into its
    ``TimeoutError`` (a call that raised anything else would pass through
    unconverted), and the task's cancel count is back at 0."""
    async with bounded():
        pool, held = full(kind)
        task = this_task()
        with pytest.raises(TimeoutError) as caught:
            async with asyncio.timeout(0.01) as cm:
                await CALLS[call](pool, kind, timeout=own)
        assert cm.expired()
        assert isinstance(caught.value.__cause__, asyncio.CancelledError)
        assert task.cancelling() == 0
        assert pool.stats().cancellations == 1 and pool.stats().timeouts == 0
        assert_settled(pool, held)
        await assert_serves(pool, kind, held)


@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("kind", KINDS)
async def test_the_pools_own_shorter_timeout_passes_through_an_outer_one(kind, call):
    """``timeout=`` shorter than the block: the pool's ``TimeoutError``
    comes out, the block never expired, and nothing was cancelled."""
    async with bounded():
        pool, held = full(kind)
        task = this_task()
        with pytest.raises(TimeoutError, match=r"timed out after 0\.01 s") as caught:
            async with asyncio.timeout(WAIT_S) as cm:
                await CALLS[call](pool, kind, timeout=0.01)
        assert not cm.expired() and caught.value.__cause__ is None
        assert task.cancelling() == 0
        assert pool.stats().timeouts == 1 and pool.stats().cancellations == 0
        assert_settled(pool, held)
        await assert_serves(pool, kind, held)


@pytest.mark.parametrize("kind", KINDS)
async def test_nested_timeouts_each_raise_where_they_expired(kind):
    """An inner block expiring around a queued call raises its own
    ``TimeoutError``, which the outer block (not expired) lets through;
    the cancel count is 0 at both levels."""
    async with bounded():
        pool, held = full(kind)
        task = this_task()
        with pytest.raises(TimeoutError) as caught:
            async with asyncio.timeout(WAIT_S) as outer:
                try:
                    async with asyncio.timeout(0.01) as inner:
                        await ask(pool, kind)
                finally:
                    assert task.cancelling() == 0
        assert inner.expired() and not outer.expired()
        assert isinstance(caught.value.__cause__, asyncio.CancelledError)  # the inner block's
        assert task.cancelling() == 0
        assert_settled(pool, held)
        await assert_serves(pool, kind, held)


@pytest.mark.parametrize("kind", KINDS)
async def test_a_timeout_firing_after_the_grant_before_the_task_resumes(kind):
    """The block expires in the turn after the grant, before the waiter
    runs: the waiter gives the grant back and the block raises its
    ``TimeoutError`` (``test_async_races.py`` pins this for ``alloc``)."""
    async with bounded():
        pool, held = full(kind)
        loop = asyncio.get_running_loop()
        blocks: list[asyncio.Timeout] = []

        async def waiter() -> list[int]:
            async with asyncio.timeout(None) as cm:
                blocks.append(cm)
                return await ask(pool, kind)

        task = asyncio.create_task(waiter())
        await spin()
        assert pool.waiting() == 1
        # Next turn: the free grants (queueing the waiter's wake-up) and
        # then the timeout fires, before the waiter runs.
        loop.call_soon(pool.free, held)
        blocks[0].reschedule(loop.time())
        with pytest.raises(TimeoutError):
            await task
        assert pool.stats().cancellations == 1
        assert_settled(pool, [])
        await assert_serves(pool, kind, [])


@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("kind", KINDS)
async def test_a_cancel_in_the_turn_a_timeout_expires_is_not_eaten(kind, call):
    """The task is cancelled from outside in the turn its block expires
    around a queued call: two cancels requested, one the block's. The
    block takes back only its own, so the task ends cancelled, not with
    ``TimeoutError``: the pool must not take back (``uncancel``) or
    swallow the cancellation it re-raises."""
    async with bounded():
        pool, held = full(kind)
        loop = asyncio.get_running_loop()
        blocks: list[asyncio.Timeout] = []

        async def waiter() -> None:
            async with asyncio.timeout(None) as cm:
                blocks.append(cm)
                await CALLS[call](pool, kind)

        task = asyncio.create_task(waiter())
        await spin()
        blocks[0].reschedule(loop.time())  # expires next turn ...
        loop.call_soon(task.cancel, "shutdown")  # ... and so does the outside cancel
        with pytest.raises(asyncio.CancelledError):
            await task
        assert blocks[0].expired() and task.cancelled()
        assert_settled(pool, held)
        await assert_serves(pool, kind, held)


# ---------------------------------------------------------------- TaskGroup


@pytest.mark.parametrize("kind", KINDS)
async def test_a_failing_sibling_ends_the_queued_waiters_of_its_task_group(kind):
    """Waiters queued in a ``TaskGroup`` whose sibling fails in the turn
    their grant lands: each ends cancelled, gives its grant back, and a
    waiter queued outside the group behind them is served."""
    async with bounded():
        pool, held = full(kind)
        loop = asyncio.get_running_loop()
        ended: list[str] = []

        async def member() -> None:
            try:
                await ask(pool, kind)
            except asyncio.CancelledError:
                ended.append("cancelled")
                raise
            ended.append("granted")

        async def sibling() -> None:
            await spin()
            # The free runs before the group's cancels: every member is
            # granted (or cancelled) with its wake-up still queued.
            loop.call_soon(pool.free, held)
            raise KeyError("sibling")

        async def group() -> None:
            async with asyncio.TaskGroup() as tg:
                for _ in range(2):
                    tg.create_task(member())
                tg.create_task(sibling())

        grouped = asyncio.create_task(group())
        await spin(2)
        outside = asyncio.create_task(ask(pool, kind))
        with pytest.raises(ExceptionGroup) as caught:
            await grouped
        assert [type(e) for e in caught.value.exceptions] == [KeyError]
        assert ended == ["cancelled", "cancelled"]
        rows = await outside
        assert pool.stats().cancellations == 2
        assert_settled(pool, rows)
        await assert_serves(pool, kind, rows)


@pytest.mark.parametrize("kind", KINDS)
async def test_a_timeout_around_a_task_group_of_waiters(kind):
    """``asyncio.timeout`` around a ``TaskGroup`` of queued calls (and
    leases): the group's members are cancelled, the block raises
    ``TimeoutError``, and nothing stays queued or allocated."""
    async with bounded():
        pool, held = full(kind)
        task = this_task()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.01), asyncio.TaskGroup() as tg:
                for call in (ask, lease_one, ask):
                    tg.create_task(call(pool, kind))
        assert task.cancelling() == 0
        assert pool.stats().cancellations == 3
        assert_settled(pool, held)
        await assert_serves(pool, kind, held)


# ---------------------------------------------------------------- level-triggered scopes


class LevelCancel:
    """A cancel scope as anyio's is on asyncio: once cancelled, it cancels
    its task again at every turn of the loop until the block exits (level
    triggered), then takes back every cancel it made (``uncancel``) and
    swallows the ``CancelledError``. A cleanup that awaits inside the block
    is cancelled again there."""

    def __init__(self) -> None:
        self._task: asyncio.Task[Any] | None = None
        self._handle: asyncio.Handle | None = None
        self.cancels = 0

    def __enter__(self) -> LevelCancel:
        self._task = asyncio.current_task()
        return self

    def cancel(self) -> None:
        assert self._task is not None
        self._task.cancel("level-triggered")
        self.cancels += 1
        self._handle = asyncio.get_running_loop().call_soon(self.cancel)

    def __exit__(self, et: Any, exc: Any, tb: Any) -> bool:
        assert self._task is not None
        if self._handle is not None:
            self._handle.cancel()
        for _ in range(self.cancels):
            self._task.uncancel()
        return et is asyncio.CancelledError and self.cancels > 0


@contextlib.contextmanager
def level_cancel_after(turns: int) -> Iterator[LevelCancel]:
    """:class:`LevelCancel`, cancelled ``turns`` loop turns from now."""
    with LevelCancel() as scope:
        loop = asyncio.get_running_loop()

        def later(n: int) -> None:
            if n:
                loop.call_soon(later, n - 1)
            else:
                scope.cancel()

        later(turns)
        yield scope


@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("kind", KINDS)
async def test_a_level_triggered_scope_around_a_queued_call(kind, call):
    """The scope re-cancels the task at every turn: the call's own cleanup
    (leave the queue, give a grant back, free a lease's rows) runs without
    awaiting, so it is done before the first re-cancel."""
    async with bounded():
        pool, held = full(kind)
        task = this_task()
        with level_cancel_after(3) as scope:
            await CALLS[call](pool, kind)
        assert scope.cancels >= 1 and task.cancelling() == 0
        assert_settled(pool, held)
        await assert_serves(pool, kind, held)


@pytest.mark.parametrize("kind", KINDS)
async def test_a_level_triggered_scope_cancelling_in_the_grant_turn(kind):
    """The scope is cancelled in the turn the grant lands and keeps
    cancelling: the grant is given back, or (a lease) its body is
    cancelled and its exit frees the rows."""
    async with bounded():
        pool, held = full(kind)
        scopes: list[LevelCancel] = []

        async def waiter(call: Callable[..., Awaitable[Any]]) -> None:
            with LevelCancel() as scope:
                scopes.append(scope)
                await call(pool, kind)
                await asyncio.sleep(WAIT_S)  # cancelled here if granted first

        tasks = [asyncio.create_task(waiter(call)) for call in (ask, lease_one)]
        await spin()
        pool.free(held)
        for scope in scopes:
            scope.cancel()
        await asyncio.gather(*tasks)
        assert_settled(pool, [])
        await assert_serves(pool, kind, [])


async def test_a_level_triggered_scope_around_a_lease_body():
    """A body cancelled by the scope: the exit frees the rows at once,
    though the scope keeps cancelling while the exit runs."""
    async with bounded():
        pool = make("pages")
        with level_cancel_after(1):
            async with pool.lease(2):
                await asyncio.sleep(WAIT_S)
        assert_settled(pool, [])
        await assert_serves(pool, "pages", [])


@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("kind", KINDS)
async def test_anyios_own_scope_around_a_queued_call(kind, call):
    """:class:`LevelCancel` above stands in for anyio's scope; this is the
    real one (anyio on the running asyncio or uvloop loop), cancelled while
    the call waits in the queue."""
    async with bounded():
        pool, held = full(kind)
        task = this_task()
        with anyio.CancelScope() as scope:
            asyncio.get_running_loop().call_soon(scope.cancel)
            await CALLS[call](pool, kind)
        assert scope.cancelled_caught and task.cancelling() == 0
        assert_settled(pool, held)
        await assert_serves(pool, kind, held)


@pytest.mark.parametrize("kind", KINDS)
async def test_anyios_own_scope_cancelled_in_the_grant_turn(kind):
    """anyio's scope cancelled in the turn the grant lands: the granted
    call's result is delivered (anyio does not cancel a task whose awaited
    future is done, as docs/api.md says) and the task's next await is
    cancelled; a lease's exit frees its rows. Either way nothing stays
    allocated."""
    async with bounded():
        pool, held = full(kind)
        scopes: list[anyio.CancelScope] = []
        got: list[list[int]] = []

        async def asker() -> None:
            with anyio.CancelScope() as scope:
                scopes.append(scope)
                rows = await ask(pool, kind)
                got.append(rows)
                try:
                    await asyncio.sleep(WAIT_S)  # cancelled here when granted first
                finally:
                    pool.free(rows)

        async def leaser() -> None:
            with anyio.CancelScope() as scope:
                scopes.append(scope)
                await lease_one(pool, kind)

        tasks = [asyncio.create_task(asker()), asyncio.create_task(leaser())]
        await spin()
        pool.free(held)
        for scope in scopes:
            scope.cancel()
        await asyncio.gather(*tasks)
        assert all(scope.cancelled_caught for scope in scopes)
        assert got, "the first waiter's grant, made in the cancel's turn, was delivered"
        assert_settled(pool, [])
        await assert_serves(pool, kind, [])


# ---------------------------------------------------------------- shield, messages


@pytest.mark.parametrize("kind", KINDS)
async def test_a_shielded_call_keeps_its_place_and_grants_the_task_kept(kind):
    """``asyncio.shield`` of a task the caller keeps: cancelling the outer
    await leaves the call queued, and its grant reaches the kept task, a
    grant like any other (no cancellation counted). docs/api.md: shielding
    a bare coroutine loses the grant; keep the task and free what it got."""
    async with bounded():
        pool, held = full(kind)
        inner = asyncio.ensure_future(ask(pool, kind))

        async def outer() -> list[int]:
            return await asyncio.shield(inner)

        shielded = asyncio.create_task(outer())
        await spin()
        shielded.cancel()
        with pytest.raises(asyncio.CancelledError):
            await shielded
        assert not inner.done() and pool.waiting() == 1
        # The documented recipe: whoever gave up frees what the task got.
        inner.add_done_callback(
            lambda t: None if t.cancelled() or t.exception() else pool.free(t.result())
        )
        pool.free(held)
        await inner
        assert pool.stats().cancellations == 0
        await spin(1)
        assert_settled(pool, [])
        await assert_serves(pool, kind, [])


@pytest.mark.parametrize("granted", [False, True], ids=["queued", "granted"])
@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("kind", KINDS)
async def test_a_cancel_message_survives_the_pool(kind, call, granted):
    """``task.cancel(msg)`` on a queued call (or one granted that has not
    resumed): the ``CancelledError`` raised in the task, and by awaiting
    it, carries ``msg``: the pool re-raises the cancellation it got."""
    async with bounded():
        pool, held = full(kind)
        seen: list[tuple[Any, ...]] = []

        async def waiter() -> None:
            try:
                await CALLS[call](pool, kind)
            except asyncio.CancelledError as exc:
                seen.append(exc.args)
                raise

        task = asyncio.create_task(waiter())
        await spin()
        if granted:
            pool.free(held)
            held = []
        task.cancel("client went away")
        with pytest.raises(asyncio.CancelledError) as caught:
            await task
        assert seen == [("client went away",)]
        assert caught.value.args == ("client went away",)
        assert_settled(pool, held)
        await assert_serves(pool, kind, held)


# ---------------------------------------------------------------- the loop ends


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "factory", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"]
)
def test_a_runner_closing_with_calls_queued_cancels_them_cleanly(kind, factory, caplog):
    """``asyncio.Runner`` (as ``asyncio.run``) ends with calls queued: it
    cancels them as it closes, each leaves the queue (no hang, no warning,
    no error logged), and only what the main task took stays allocated."""
    pool = make(kind)
    taken: list[int] = []
    queued: list[asyncio.Task[Any]] = []

    async def main() -> None:
        taken.extend(exhaust(pool, kind))
        queued.extend(asyncio.create_task(call(pool, kind)) for call in (ask, ask, lease_one))
        await spin()
        assert pool.waiting() == 3

    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main())
    assert all(task.cancelled() for task in queued)
    assert pool.waiting() == 0
    assert pool.stats().cancellations == 3
    assert_settled(pool, taken)
    assert not [r for r in caplog.records if r.levelname in ("WARNING", "ERROR")]
