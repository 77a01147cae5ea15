"""The pool under ``asyncio.eager_task_factory`` (Python 3.12+), and code the
pool runs calling it back.

With the eager factory (engines turn it on for speed), ``create_task(coro)``
runs the coroutine at once, inside the caller, up to its first suspension. A
fence's ``query()`` that creates a task (a transfer handle that admits the
request once its transfer is done, say) then calls the pool from inside the
pool: from the grant loop's ``take``, which reclaims completed fences. Before
the grant loop was made re-entrant, such a call lost or doubled grants: a
free there ran a second grant loop that granted the head the first one was
taking for (``InvalidStateError`` out of the free, a waiter behind it never
granted), a cancel of the head's task left its grant to nobody (rows
allocated for ever), and a more urgent waiter queued there made the loop drop
the wrong priority from its index (the next grant hung or raised). And a
call there that reclaims (a ``try_alloc`` short of rows) ran a reclaim inside
the ledger's own: the outer one then popped the batch behind the one it had
asked, releasing a row whose fence was still open, and dropped a stream's
emptied queue twice (``KeyError``).

Each case runs twice: ``by hand``, the task's code started inside the
``query()`` by stepping its coroutine to its first suspension (what the
eager factory does; any Python, so CI's 3.11 runs it), and ``eager``, a real
``create_task`` on a loop with ``asyncio.eager_task_factory`` (3.12+; skipped
on 3.11, which has no eager factory). ``ASYNCPOOL_TEST_EAGER=1`` runs the
whole suite with the eager factory on every test loop (tests/conftest.py).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest
from helpers import (
    HAS_EAGER,
    HOW,
    WAIT_S,
    bounded,
    eager_tasks,
    in_thread,
    queued_call,
    settled,
    start_task,
    until,
)

from asyncpool import (
    AsyncReqToTokenPool,
    DoubleFreeError,
    FenceError,
    Grant,
    GroupGrant,
    InvalidSlotError,
    KVPagePool,
    new_stream_key,
)


class CallingFence:
    """A fence of unknown origin, done on :meth:`set`, whose ``query()`` on
    the loop's thread runs ``call`` once, the first time it answers done
    (``early``: the first time it is asked there; the fence watcher's
    threads only read it)."""

    def __init__(self, call: Callable[[], object] | None) -> None:
        self.call = call
        self.early = False  # run the call at the first query on the loop, done or not
        self.event = threading.Event()
        self.loop_thread = threading.get_ident()
        self.calls = 0
        self.error: Exception | None = None  # raised by every query() once set

    def set(self) -> None:
        self.event.set()

    def query(self) -> bool:
        done = self.event.is_set()
        if (
            (done or self.early)
            and self.call is not None
            and threading.get_ident() == self.loop_thread
        ):
            call, self.call = self.call, None
            self.calls += 1
            call()
        if self.error is not None:
            raise self.error
        return done

    def synchronize(self) -> None:
        self.event.wait(WAIT_S)


class CallingStreamFence(CallingFence):
    """:class:`CallingFence` of a stream: ordered (``stream_key``, ``seq``),
    so the ledger keeps it in its stream's queue, behind the one before."""

    def __init__(self, key: int, seq: int) -> None:
        super().__init__(None)
        self.stream_key, self.seq = key, seq


async def two_batches_on_a_stream(
    pool: AsyncReqToTokenPool,
) -> tuple[list[int], CallingStreamFence, CallingStreamFence]:
    """Three rows taken; the first freed behind one fence of a new stream,
    the second behind the next fence of that stream (the third kept)."""
    rows = await pool.alloc(3)
    key = new_stream_key()
    first, second = CallingStreamFence(key, 1), CallingStreamFence(key, 2)
    pool.free([rows[0]], first)
    pool.free([rows[1]], second)
    return rows, first, second


@pytest.mark.parametrize("how", HOW)
async def test_a_reclaim_inside_a_reclaim_releases_no_batch_before_its_fence(how: str) -> None:
    # The ledger's reclaim asks the head of a stream's queue, then pops it.
    # A query() whose code reclaimed too (a try_alloc short of rows) had
    # popped that head already: the outer pop took the next batch, its
    # fence never asked, and its row went free while the stream could
    # still write it (the ledger's invariant broken too).
    async with bounded(), AsyncReqToTokenPool(4, 4) as pool:
        rows, first, second = await two_batches_on_a_stream(pool)
        inner: list[Any] = []

        async def take_one() -> None:
            inner.append(pool.try_alloc(1))

        with eager_tasks(how):
            first.set()
            first.call = lambda: start_task(take_one(), how)
            assert pool.try_alloc(2) is None  # one row came back, and the inner call has it
        assert first.calls == 1
        assert inner == [[rows[0]]]
        pool.check_invariants()
        assert (pool.pending_size(), pool.available_size()) == (1, 0)  # rows[1] waits for `second`
        second.set()
        await pool.drain(timeout=WAIT_S)
        assert pool.try_alloc(1) == [rows[1]]


@pytest.mark.parametrize("how", HOW)
async def test_a_reclaim_inside_a_reclaim_that_empties_a_stream(how: str) -> None:
    # The inner reclaim settles the stream's last batch and drops its empty
    # queue; the outer one, done with the same stream, dropped it again
    # (KeyError out of the pool's call).
    async with bounded(), AsyncReqToTokenPool(3, 4) as pool:
        rows = await pool.alloc(2)
        only = CallingStreamFence(new_stream_key(), 1)
        pool.free([rows[0]], only)
        inner: list[Any] = []

        async def take_one() -> None:
            inner.append(pool.try_alloc(1))

        with eager_tasks(how):
            only.set()
            only.call = lambda: start_task(take_one(), how)
            assert pool.try_alloc(1) is None  # the inner call has the row
        assert inner == [[rows[0]]]
        pool.check_invariants()
        assert (pool.pending_size(), pool.stats().allocated) == (0, 2)
        pool.free([rows[1]], CallingStreamFence(only.stream_key, 2))  # the stream goes on
        assert pool.pending_size() == 1


@pytest.mark.parametrize("how", HOW)
async def test_a_force_release_inside_a_reclaim_releases_each_batch_once(how: str) -> None:
    # force_release rebuilt the stream's queue as a new deque; the reclaim
    # that asked the query() (a watchdog task there force-releasing its
    # dead transfer) walked the old one: it settled the batch again (the
    # same row handed out twice by one try_alloc), and the new queue kept
    # a batch it had settled (released a second time at a later reclaim).
    async with bounded(), AsyncReqToTokenPool(4, 4) as pool:
        rows, first, second = await two_batches_on_a_stream(pool)

        async def give_up() -> None:
            pool.force_release(first)

        with eager_tasks(how):
            first.set()
            first.call = lambda: start_task(give_up(), how)
            assert pool.try_alloc(2) is None  # one row back: rows[1] waits for `second`
        assert first.calls == 1
        pool.check_invariants()
        assert (pool.pending_size(), pool.available_size()) == (1, 1)
        assert pool.try_alloc(1) == [rows[0]]
        second.set()
        await pool.drain(timeout=WAIT_S)
        pool.check_invariants()
        assert pool.try_alloc(2) is None  # rows[1] only, once
        assert pool.try_alloc(1) == [rows[1]]
        pool.check_invariants()


def give_up_from_query(
    pool: AsyncReqToTokenPool, asker: CallingFence, dead: CallingFence, how: str
) -> list[tuple[int, int]]:
    """``asker``'s ``query()`` (the first time the loop asks it) starts a
    task that force-releases ``dead`` (a transfer's watchdog giving up on
    its dead peer); the returned list gets what that ``force_release``
    returned."""
    got: list[tuple[int, int]] = []

    async def give_up() -> None:
        got.append(pool.force_release(dead))

    asker.call, asker.early = (lambda: start_task(give_up(), how)), True
    return got


@pytest.mark.parametrize("which", ["its own", "a later", "an earlier"])
@pytest.mark.parametrize("how", HOW)
async def test_a_force_release_inside_a_reclaim_of_the_side_list_finds_the_batches_it_walks(
    how: str, which: str
) -> None:
    # The reclaim walks the side list (fences of unknown origin) as a list
    # of its own. A force_release made from a query() it asked looked for
    # the fence's batches in the queues and in the side list, empty during
    # the walk: it missed the batch the walk held (the one asked, or one
    # asked before or after it), which kept waiting for a fence that never
    # completes, though the operator had released it.
    async with bounded(), AsyncReqToTokenPool(4, 4) as pool:
        rows = await pool.alloc(3)
        fences = [CallingFence(None), CallingFence(None)]
        pool.free([rows[0]], fences[0])
        pool.free([rows[1]], fences[1])
        asker, dead = {"its own": (0, 0), "a later": (0, 1), "an earlier": (1, 0)}[which]
        with eager_tasks(how):
            got = give_up_from_query(pool, fences[asker], fences[dead], how)
            assert pool.try_alloc(2) is None  # one row came back: the dead fence's
        assert fences[asker].calls == 1
        assert got == [(1, 0)]
        pool.check_invariants()
        assert (pool.pending_size(), pool.available_size()) == (1, 1)
        assert pool.try_alloc(1) == [rows[dead]]
        fences[1 - dead].set()
        await pool.drain(timeout=WAIT_S)
        pool.check_invariants()
        assert pool.try_alloc(2) is None  # each row back once
        assert pool.try_alloc(1) == [rows[1 - dead]]
        pool.check_invariants()


@pytest.mark.parametrize("dead", ["the fence asked", "a fence after it"])
@pytest.mark.parametrize("how", HOW)
async def test_a_force_release_inside_a_reclaim_finds_the_batch_it_settles(
    how: str, dead: str
) -> None:
    # A row freed behind fences of three streams queues behind the first;
    # once that one completed, the reclaim takes the batch out of its queue
    # and asks the next ones in order. A force_release made from one of
    # those query() calls looked for the batch in the queues only: the fence
    # stayed among those it waits for, and the batch moved behind it (the
    # one asked, which never answers done, or the next, never asked again
    # by the operator's leave), held for good.
    async with bounded(), AsyncReqToTokenPool(4, 4) as pool:
        rows = await pool.alloc(3)
        a, b, c = (CallingStreamFence(new_stream_key(), 1) for _ in range(3))
        pool.free([rows[0]], [a, b, c])
        a.set()
        if dead == "the fence asked":
            c.set()
        else:
            b.set()
        with eager_tasks(how):
            got = give_up_from_query(pool, b, b if dead == "the fence asked" else c, how)
            assert pool.try_alloc(1) == [rows[0]]  # short: its reclaim asks b
        assert b.calls == 1
        # It made nothing free itself: the batch still waited for its other
        # fences then; the reclaim that asked b released it once that one was dropped.
        assert got == [(0, 0)]
        pool.check_invariants()
        assert (pool.pending_size(), pool.available_size()) == (0, 0)
        pool.free(rows)
        pool.check_invariants()
        assert pool.available_size() == 3


@pytest.mark.parametrize("how", HOW)
async def test_a_force_release_inside_a_reclaim_finds_the_rows_and_pages_it_walks(
    how: str,
) -> None:
    # The row ledger's walk held the row behind the dead fence; the page
    # ledger, not walking yet, gave back its pages: the force_release
    # returned the pages and not the row, which kept waiting.
    async with bounded(), AsyncReqToTokenPool(4, 4, kv=KVPagePool(8, 2)) as pool:
        first, second = (await pool.admit(pages=2)), (await pool.admit(pages=2))
        await pool.admit(pages=1)  # the third row: none left
        f1, f2 = CallingFence(None), CallingFence(None)
        pool.free([first.row], f1)
        pool.free([second.row], f2)
        with eager_tasks(how):
            got = give_up_from_query(pool, f1, f2, how)
            pool.reclaim()
        assert f1.calls == 1
        assert got == [(1, 2)]
        pool.check_invariants()
        stats = pool.stats()
        # The dead fence's row and pages are back; the first row's wait for f1.
        assert (stats.pending, stats.pages_pending, stats.free, stats.pages_free) == (1, 2, 1, 4)
        f1.set()
        await pool.drain(timeout=WAIT_S)
        pool.check_invariants()
        stats = pool.stats()
        assert (stats.allocated, stats.pages_allocated, stats.free, stats.pages_free) == (
            1,
            1,
            2,
            6,
        )


@pytest.mark.parametrize("how", HOW)
async def test_a_force_release_inside_a_reclaim_of_pages_finds_the_pages_it_walks(
    how: str,
) -> None:
    # The page ledger walks its side list as the row ledger does: pages
    # given back behind a fence of unknown origin (detached, then freed to
    # the page pool), the dead fence's held by the walk, kept waiting.
    async with bounded(), AsyncReqToTokenPool(4, 4, kv=KVPagePool(8, 2)) as pool:
        kv = pool.kv
        assert kv is not None
        a, b = (await pool.admit(pages=2)), (await pool.admit(pages=2))
        f1, f2 = CallingFence(None), CallingFence(None)
        kv.free(pool.detach_pages(a.row), fence=f1)
        kv.free(pool.detach_pages(b.row), fence=f2)
        with eager_tasks(how):
            got = give_up_from_query(pool, f1, f2, how)
            pool.reclaim()
        assert f1.calls == 1
        assert got == [(0, 2)]
        pool.check_invariants()
        stats = pool.stats()
        assert (stats.pages_pending, stats.pages_free) == (2, 5)
        f1.set()
        await pool.drain(timeout=WAIT_S)
        pool.check_invariants()
        assert pool.stats().pages_free == 7


@pytest.mark.parametrize("how", HOW)
async def test_a_force_release_inside_a_force_release_finds_the_batches_it_settles(
    how: str,
) -> None:
    # force_release(x) takes the batches behind x out of their queues, then
    # settles them in turn, asking each one's next fence. One made from such
    # a query() (y's, below) missed the batches the first had taken and not
    # settled yet: the one behind x and z kept z, was asked it, and moved
    # behind it, held for good.
    async with bounded(), AsyncReqToTokenPool(4, 4) as pool:
        rows = await pool.alloc(2)
        x, y, z = CallingFence(None), CallingFence(None), CallingFence(None)
        pool.free([rows[0]], [x, y])
        pool.free([rows[1]], [x, z])
        y.set()
        with eager_tasks(how):
            got = give_up_from_query(pool, y, z, how)
            assert pool.force_release(x) == (2, 0)
        assert y.calls == 1
        assert got == [(0, 0)]  # the batch it freed of z was the outer call's to settle
        pool.check_invariants()
        assert (pool.pending_size(), pool.available_size()) == (0, 3)
        assert pool.try_alloc(3) is not None
        pool.check_invariants()


@pytest.mark.parametrize("verdict", ["done", "faulted"])
@pytest.mark.parametrize("how", HOW)
async def test_a_force_release_inside_an_agreement_is_not_settled_again(
    how: str, verdict: str, group: Any
) -> None:
    # agree() reads the pending batches, asks their fences, agrees the
    # flags, then acts on the batches it read. A force_release made from
    # one of those query() calls released a batch it had read: the
    # agreement released its rows again (each in the free queue twice, to
    # be handed out twice) or quarantined rows already free.
    async with bounded(), AsyncReqToTokenPool(5, 4, reclaim="explicit") as pool:
        rows = await pool.alloc(4)
        t1, t2 = CallingFence(None), CallingFence(None)
        pool.free(rows[:2], t1)
        pool.free(rows[2:], t2)
        if verdict == "done":
            t2.set()
        else:
            t2.error = FenceError("the peer died")
        with eager_tasks(how):
            got = give_up_from_query(pool, t1, t2, how)
            assert pool.agree(group) == (0, 0)  # t2's rows: released by the force_release
        assert t1.calls == 1
        assert got == [(2, 0)]
        pool.check_invariants()
        stats = pool.stats()
        assert (stats.pending, stats.quarantined, stats.free) == (2, 0, 2)
        t1.set()
        assert pool.agree(group) == (2, 0)
        pool.check_invariants()
        assert sorted(pool.try_alloc(4) or []) == sorted(rows)


@pytest.mark.parametrize("how", HOW)
async def test_a_fault_seen_inside_a_reclaim_quarantines_only_its_own_batch(how: str) -> None:
    async with bounded(), AsyncReqToTokenPool(4, 4) as pool:
        rows, first, second = await two_batches_on_a_stream(pool)
        inner: list[Any] = []

        async def take_one() -> None:
            inner.append(pool.try_alloc(1))

        with eager_tasks(how):
            first.error = FenceError("the stream faulted")
            first.early = True
            first.call = lambda: start_task(take_one(), how)
            assert pool.try_alloc(1) is None  # the inner reclaim quarantined rows[0]
        assert first.calls == 1 and inner == [None]
        pool.check_invariants()
        # rows[1] still waits for `second`: not quarantined with the faulted batch.
        assert (pool.quarantined_size(), pool.pending_size()) == (1, 1)
        second.set()
        await pool.drain(timeout=WAIT_S)
        assert pool.try_alloc(1) == [rows[1]]


@pytest.mark.parametrize("how", HOW)
async def test_a_fenced_free_inside_a_fenced_free_quarantines_nothing(how: str) -> None:
    # A free with pages asks each fence once for the row and its pages
    # (the ledgers share the call's answers). A fenced free made from a
    # query() it asked ended that sharing on its way out: the outer call's
    # next fence failed to be asked (AssertionError, read as the fence
    # faulting), and the row's pages went to quarantine for good.
    async with bounded(), AsyncReqToTokenPool(4, 4, kv=KVPagePool(8, 2)) as pool:
        first, other = (await pool.admit(pages=2)), (await pool.admit(pages=1))

        async def free_other() -> None:
            pool.free([other.row], inner)

        inner = CallingFence(None)
        with eager_tasks(how):
            a = CallingFence(lambda: start_task(free_other(), how))
            b = CallingFence(None)
            a.set()
            pool.free([first.row], [a, b])  # waits for b
        assert a.calls == 1
        pool.check_invariants()
        stats = pool.stats()
        assert (stats.quarantined, stats.pages_quarantined, stats.fence_errors) == (0, 0, 0)
        assert (stats.pending, stats.pages_pending) == (2, 3)
        b.set()
        inner.set()
        await pool.drain(timeout=WAIT_S)
        pool.check_invariants()
        stats = pool.stats()
        assert (stats.allocated, stats.pages_allocated, stats.free, stats.pages_free) == (
            0,
            0,
            3,
            7,
        )


@pytest.mark.parametrize("how", HOW)
async def test_a_free_inside_a_reclaim_of_the_side_list_leaves_no_stale_index(how: str) -> None:
    # The reclaim walks the side list (fences of unknown origin) as a list
    # of its own; a free that a query() made indexed the list in use then,
    # which the walk then replaced: that index was kept, holding settled
    # batches and their fences alive (and the invariant check failed).
    async with bounded(), AsyncReqToTokenPool(5, 4) as pool:
        rows = await pool.alloc(4)
        first, second = CallingFence(None), CallingFence(None)
        pool.free([rows[0]], first)
        pool.force_release(CallingFence(None))  # holds nothing: the index is dropped

        async def free_one() -> None:
            pool.free([rows[1]], second)

        with eager_tasks(how):
            first.call, first.early = (lambda: start_task(free_one(), how)), True
            assert pool.try_alloc(4) is None
        assert first.calls == 1
        pool.check_invariants()
        assert pool.pending_size() == 2
        first.set()
        second.set()
        await pool.drain(timeout=WAIT_S)
        pool.check_invariants()
        assert sorted(pool.try_alloc(2) or []) == sorted(rows[:2])


@pytest.mark.parametrize("how", HOW)
async def test_a_free_inside_the_grant_loops_take_grants_each_waiter_once(how: str) -> None:
    async with bounded(), AsyncReqToTokenPool(4, 4) as pool:
        rows = await pool.alloc(3)  # every row
        a = await queued_call(pool.alloc(2))
        b = await queued_call(pool.alloc(1))

        async def free_last() -> None:
            pool.free([rows[2]])  # runs the grant loop, inside the one under way

        with eager_tasks(how):
            fence = CallingFence(lambda: start_task(free_last(), how))
            pool.free([rows[0]], fence)
            fence.set()
            # The grant loop: the head needs 2, one row is free, so its take
            # reclaims, and the fence's query() frees the third row.
            pool.free([rows[1]])
            # Granted at hand-over, both, by this free: not left for a
            # wake-up to find (the fence watcher's would, a moment later).
            assert pool.waiting() == 0
        assert fence.calls == 1
        got_a, got_b = await settled(a), await settled(b)
        assert isinstance(got_a, list) and isinstance(got_b, list), (got_a, got_b)
        assert len(got_a) == 2 and len(got_b) == 1
        assert sorted(got_a + got_b) == sorted(rows)
        pool.check_invariants()
        assert pool.stats().allocated == 3
        pool.free(got_a + got_b)
        assert pool.available_size() == 3


@pytest.mark.parametrize("how", HOW)
async def test_a_free_inside_a_take_that_came_up_short_is_granted_at_once(how: str) -> None:
    async with bounded(), AsyncReqToTokenPool(4, 4) as pool:
        rows = await pool.alloc(3)
        a = await queued_call(pool.alloc(2))

        async def free_last() -> None:
            pool.free([rows[2]])

        with eager_tasks(how):
            fence = CallingFence(None)
            pool.free([rows[0]], fence)  # pending: the take below asks it
            fence.call, fence.early = (lambda: start_task(free_last(), how)), True
            # The head needs 2, one is free: the take reclaims, the fence is
            # not done (the take comes up short), but its query() freed a
            # row, after the take counted the free ones. The loop asks again.
            pool.free([rows[1]])
            assert fence.calls == 1
            assert pool.waiting() == 0  # granted by this free, not by a later wake-up
        assert sorted(await settled(a)) == sorted(rows[1:])
        fence.set()
        await pool.drain(timeout=WAIT_S)
        pool.check_invariants()
        assert pool.stats().allocated == 2


@pytest.mark.parametrize("how", HOW)
async def test_a_head_cancelled_inside_the_grant_loops_take_gets_nothing(how: str) -> None:
    async with bounded(), AsyncReqToTokenPool(4, 4) as pool:
        rows = await pool.alloc(3)
        a = await queued_call(pool.alloc(2))

        async def cancel_head() -> None:
            a.cancel()  # the request gave up: the transfer handle cancels its admit

        with eager_tasks(how):
            fence = CallingFence(lambda: start_task(cancel_head(), how))
            pool.free([rows[0]], fence)
            fence.set()
            pool.free([rows[1]])  # take(2) for the head reclaims: the head is cancelled there
        assert fence.calls == 1
        assert isinstance(await settled(a), asyncio.CancelledError)
        pool.check_invariants()
        stats = pool.stats()
        assert (stats.allocated, stats.free, stats.waiters) == (1, 2, 0)  # nothing left to nobody
        assert pool.try_alloc(2) is not None


@pytest.mark.parametrize("how", HOW)
async def test_a_more_urgent_waiter_queued_inside_the_grant_loops_take(how: str) -> None:
    async with bounded(), AsyncReqToTokenPool(4, 4) as pool:
        rows = await pool.alloc(3)
        a = await queued_call(pool.alloc(2, priority=1))
        urgent: list[asyncio.Future[Any]] = []

        with eager_tasks(how):
            fence = CallingFence(lambda: urgent.append(start_task(pool.alloc(1, priority=0), how)))
            pool.free([rows[0]], fence)
            fence.set()
            # The head (priority 1) takes 2 rows; meanwhile a waiter queued at
            # priority 0, ahead of it, in a queue of its own.
            pool.free([rows[1]])
        assert fence.calls == 1 and len(urgent) == 1
        got_a = await settled(a)
        assert isinstance(got_a, list) and sorted(got_a) == sorted(rows[:2])
        pool.check_invariants()  # the priority index agrees with the queues
        assert pool.waiting() == 1 and not urgent[0].done()
        pool.free([rows[2]])  # the urgent waiter's row
        assert await settled(urgent[0]) == [rows[2]]
        pool.check_invariants()
        assert pool.waiting() == 0


@pytest.mark.parametrize("how", HOW)
async def test_a_hold_taken_inside_the_grant_loops_take_holds_that_grant(how: str) -> None:
    async with bounded(), AsyncReqToTokenPool(4, 4) as pool:
        rows = await pool.alloc(3)
        a = await queued_call(pool.alloc(2))
        holds: list[Any] = []

        async def hold() -> None:
            holds.append(pool.hold_grants())  # the scheduler holds for its growth

        with eager_tasks(how):
            fence = CallingFence(lambda: start_task(hold(), how))
            pool.free([rows[0]], fence)
            fence.set()
            pool.free([rows[1]])
            assert fence.calls == 1 and len(holds) == 1
            assert pool.waiting() == 1  # held: the rows taken for the head went back
        assert pool.try_alloc(1) is None  # the hold keeps them for growth
        pool.check_invariants()
        holds[0].release()  # the grant loop runs at once
        assert sorted(await settled(a)) == sorted(rows[:2])
        pool.check_invariants()


@pytest.mark.parametrize("how", HOW)
async def test_a_close_inside_the_grant_loops_take_fails_the_head_and_keeps_nothing(
    how: str,
) -> None:
    async with bounded(), AsyncReqToTokenPool(4, 4) as pool:
        rows = await pool.alloc(3)
        a = await queued_call(pool.alloc(2))
        closing: list[asyncio.Future[Any]] = []

        with eager_tasks(how):
            fence = CallingFence(lambda: closing.append(start_task(pool.close(), how)))
            pool.free([rows[0]], fence)
            fence.set()
            pool.free([rows[1]])
        assert fence.calls == 1
        await settled(closing[0])
        assert type(await settled(a)).__name__ == "PoolClosedError"
        pool.check_invariants()
        assert pool.stats().allocated == 1  # rows[2]: none to the failed head


@pytest.mark.skipif(not HAS_EAGER, reason="asyncio.eager_task_factory needs Python 3.12+")
async def test_threadsafe_waits_on_an_eager_loop() -> None:
    # submit_wait creates its task on the loop: eager, the wait runs inside
    # the hand-over callback, and one granted at once is delivered there.
    async with bounded(), AsyncReqToTokenPool(3, 4, kv=KVPagePool(8, 2)) as pool:
        with eager_tasks("eager"):
            pool.bind()
            fut = await asyncio.to_thread(pool.admit_threadsafe, pages=3)
            grant = await asyncio.wrap_future(fut)
            assert isinstance(grant, Grant) and len(grant.pages) == 3
            assert in_thread(fut.cancel) is False
            other = (await pool.admit(pages=1)).row
            queued = await asyncio.to_thread(pool.admit_threadsafe, pages=1)
            await until(lambda: pool.waiting() == 1)
            assert in_thread(queued.cancel) is True  # cancelled on the loop, nothing taken
            assert queued.cancelled()
            await until(lambda: pool.waiting() == 0)
            pool.free([grant.row, other])
            stats = pool.stats()
            assert (stats.allocated, stats.pages_allocated, stats.waiters) == (0, 0, 0)


# ---------------------------------------------------------------- held rows
#
# A call that gives a row's pages back (a fenced free, a trim, a drop) or
# grows a row asks fences while it changes that row: the give-back asks them
# as it defers the pages, a growth short of pages as it reclaims. Code run
# there that named the same row changed it under the call: a trim or free
# made there deferred the pages the outer trim was deferring a second time
# ("a page is pending in two batches", then the ring and the states
# disagreed), an extend there had its pages cut from the record by the
# outer trim (owned by nobody), a free there let the outer growth append
# its pages to a free row. The row is held while the call asks: every call
# there that names it is refused, changing nothing.

GIVE_BACKS: dict[str, Callable[[AsyncReqToTokenPool, int, Any], object]] = {
    "free": lambda pool, row, fence: pool.free([row], fence),
    "trim_pages": lambda pool, row, fence: pool.trim_pages([row], 1, fence),
    "drop_pages": lambda pool, row, fence: pool.drop_pages([row], 1, fence),
}
GROWTHS: dict[str, Callable[[AsyncReqToTokenPool, int], object]] = {
    "extend": lambda pool, row: pool.extend(row, 1),
    "extend_rows": lambda pool, row: pool.extend_rows([row], 1),
    "extend_fitting": lambda pool, row: pool.extend_fitting([row], 1),
}
ROW_CALLS: dict[str, Callable[[AsyncReqToTokenPool, int], object]] = {
    "free": lambda pool, row: pool.free([row]),
    "trim_pages": lambda pool, row: pool.trim_pages([row], 1),
    "drop_pages": lambda pool, row: pool.drop_pages([row], 1),
    "detach_pages": lambda pool, row: pool.detach_pages(row),
    "extend": lambda pool, row: pool.extend(row, 1),
    "record_use": lambda pool, row: pool.record_use([row], CallingFence(None)),
}


def calling_back(
    pool: AsyncReqToTokenPool, call: str, row: int, how: str, refused: list[Exception]
) -> Callable[[], object]:
    """What a fence's ``query()`` runs: a task (started as ``how`` starts
    one) that makes ``ROW_CALLS[call]`` on ``row``, its refusal kept."""

    async def call_back() -> None:
        try:
            ROW_CALLS[call](pool, row)
        except InvalidSlotError as exc:
            refused.append(exc)

    return lambda: start_task(call_back(), how)


async def all_back(pool: AsyncReqToTokenPool, free: int, pages_free: int) -> None:
    """Once every fence is done: nothing left pending or allocated, and
    every row and page free again."""
    await pool.drain(timeout=WAIT_S)
    pool.check_invariants()
    stats = pool.stats()
    assert (stats.allocated, stats.pages_allocated, stats.pending, stats.pages_pending) == (
        0,
        0,
        0,
        0,
    )
    assert (stats.free, stats.pages_free) == (free, pages_free)


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("inner", list(ROW_CALLS))
@pytest.mark.parametrize("outer", list(GIVE_BACKS))
async def test_a_call_inside_a_give_back_cannot_change_the_rows_it_gives_back(
    outer: str, inner: str, how: str
) -> None:
    async with bounded(), AsyncReqToTokenPool(4, 4, kv=KVPagePool(10, 2)) as pool:
        free, pages_free = pool.stats().free, pool.stats().pages_free
        grant = await pool.admit(pages=3)
        refused: list[Exception] = []
        with eager_tasks(how):
            fence = CallingFence(calling_back(pool, inner, grant.row, how, refused))
            fence.early = True  # asked as the call defers what it gives back
            GIVE_BACKS[outer](pool, grant.row, fence)
        assert fence.calls == 1
        assert len(refused) == 1 and "a call under way holds it" in str(refused[0])
        pool.check_invariants()
        first, *rest = grant.pages.tolist()
        if outer != "free":  # as the outer call alone leaves the row
            kept = [0, *rest] if outer == "drop_pages" else [first]
            assert pool.pages_of(grant.row).tolist() == kept
        fence.set()
        if outer != "free":
            pool.free([grant.row])
        await all_back(pool, free, pages_free)


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("inner", list(ROW_CALLS))
@pytest.mark.parametrize("outer", list(GROWTHS))
async def test_a_call_inside_a_growths_reclaim_cannot_change_the_rows_it_grows(
    outer: str, inner: str, how: str
) -> None:
    async with bounded(), AsyncReqToTokenPool(4, 4, kv=KVPagePool(4, 2)) as pool:
        free, pages_free = pool.stats().free, pool.stats().pages_free
        grown = await pool.admit(pages=1)
        other = await pool.admit(pages=pages_free - 1)  # every page taken
        fence = CallingFence(None)
        pool.free([other.row], fence)  # its pages wait for the fence
        refused: list[Exception] = []
        with eager_tasks(how):
            fence.call = calling_back(pool, inner, grown.row, how, refused)
            fence.early = True
            fence.set()
            got = GROWTHS[outer](pool, grown.row)  # short: it reclaims
        assert fence.calls == 1
        assert len(refused) == 1 and "a call under way holds it" in str(refused[0])
        pool.check_invariants()
        assert got is not None and len(pool.pages_of(grown.row)) == 2
        pool.free([grown.row])
        await all_back(pool, free, pages_free)


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("inner", list(ROW_CALLS))
@pytest.mark.parametrize("several", [False, True], ids=["one fence", "a list"])
async def test_a_call_inside_a_record_uses_prune_cannot_change_its_rows(
    several: bool, inner: str, how: str
) -> None:
    # A row recorded with a transfer handle every step asks its older
    # handles when its uses grow long (the prune). A free made there freed
    # the row under the record, which then gave the pending row new uses.
    async with bounded(), AsyncReqToTokenPool(4, 4, kv=KVPagePool(10, 2)) as pool:
        free, pages_free = pool.stats().free, pool.stats().pages_free
        grant = await pool.admit(pages=2)
        older = [CallingFence(None) for _ in range(8)]
        pool.record_use([grant.row], older)
        refused: list[Exception] = []
        with eager_tasks(how):
            for fence in older:
                fence.call, fence.early = calling_back(pool, inner, grant.row, how, refused), True
            newer = [CallingFence(None), CallingFence(None)] if several else CallingFence(None)
            pool.record_use([grant.row], newer)  # long enough: the older ones are asked
        asked = sum(fence.calls for fence in older)
        assert asked >= 1 and len(refused) == asked
        assert all("a call under way holds it" in str(exc) for exc in refused)
        pool.check_invariants()
        for fence in [*older, *(newer if isinstance(newer, list) else [newer])]:
            fence.set()
        pool.free([grant.row])
        await all_back(pool, free, pages_free)


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("uses", [1, 2])
@pytest.mark.parametrize("inner", ["free", "extend"])
@pytest.mark.parametrize("outer", list(GIVE_BACKS))
async def test_a_force_release_of_a_held_rows_uses_leaves_it_held(
    outer: str, inner: str, uses: int, how: str
) -> None:
    # force_release drops the fence from the rows' recorded uses, and a row
    # whose uses it emptied went back to ALLOCATED whatever its mark: made
    # from a query() a give-back asked, it ended that give-back's hold on
    # its row, and a call made next there changed the row under it (a free
    # there: the outer trim found the row's record gone, AssertionError).
    async with bounded(), AsyncReqToTokenPool(4, 4, kv=KVPagePool(10, 2)) as pool:
        free, pages_free = pool.stats().free, pool.stats().pages_free
        grant = await pool.admit(pages=3)
        dead = [CallingFence(None) for _ in range(uses)]  # one use, or a tuple of them
        pool.record_use([grant.row], dead)
        refused: list[Exception] = []
        got: list[tuple[int, int]] = []
        then = calling_back(pool, inner, grant.row, how, refused)

        async def give_up() -> None:
            got.append(pool.force_release(dead))

        with eager_tasks(how):
            fence = CallingFence(lambda: (start_task(give_up(), how), then()))
            fence.early = True
            GIVE_BACKS[outer](pool, grant.row, fence)
        assert fence.calls == 1 and len(got) == 1
        assert len(refused) == 1 and "a call under way holds it" in str(refused[0])
        pool.check_invariants()
        fence.set()
        for use in dead:  # the give-back read them before the force_release: it may wait
            use.set()
        if outer != "free":
            pool.free([grant.row])
        await all_back(pool, free, pages_free)


@pytest.mark.parametrize("inner", ["free", "trim_pages", "drop_pages"])
@pytest.mark.parametrize("how", HOW)
async def test_a_force_release_forgets_the_uses_before_its_settles_ask_fences(
    how: str, inner: str
) -> None:
    # force_release settled the batches behind the fence (asking the next
    # fence of a batch behind several) before it dropped the fence from the
    # rows' uses: a row freed (or pages given back) from such a query() was
    # deferred behind the released fence, held for good.
    async with bounded(), AsyncReqToTokenPool(4, 4, kv=KVPagePool(10, 2)) as pool:
        free, pages_free = pool.stats().free, pool.stats().pages_free
        other, grant = await pool.admit(pages=1), await pool.admit(pages=3)
        dead, after = CallingFence(None), CallingFence(None)
        pool.record_use([grant.row], dead)
        pool.free([other.row], [dead, after])  # settled by the force_release: asks `after`
        refused: list[Exception] = []
        with eager_tasks(how):
            after.call, after.early = calling_back(pool, inner, grant.row, how, refused), True
            assert pool.force_release(dead) == (0, 0)
        assert after.calls == 1 and not refused
        pool.check_invariants()
        stats = pool.stats()
        # Waiting: the other row and its page, behind `after`; nothing behind `dead`.
        assert (stats.pending, stats.pages_pending) == (1, 1)
        after.set()
        if inner != "free":
            pool.free([grant.row])
        await all_back(pool, free, pages_free)


@pytest.mark.parametrize("whose", ["its own", "another's"])
@pytest.mark.parametrize("how", HOW)
async def test_a_force_release_inside_a_record_uses_prune_is_not_undone(
    how: str, whose: str
) -> None:
    # A record_use whose row's uses grew long asks the older handles (the
    # prune) and works out the row's new uses from its old ones. A
    # force_release made from one of those query() calls dropped a handle
    # from the row's uses; the record then wrote back the uses it had
    # worked out, the released handle among them: a free of the row waited
    # for it, held for good.
    async with bounded(), AsyncReqToTokenPool(4, 4, kv=KVPagePool(10, 2)) as pool:
        free, pages_free = pool.stats().free, pool.stats().pages_free
        grant = await pool.admit(pages=2)
        older = [CallingFence(None) for _ in range(8)]
        pool.record_use([grant.row], older)
        dead = older[0] if whose == "its own" else older[1]
        with eager_tasks(how):
            got = give_up_from_query(pool, older[0], dead, how)
            newer = CallingFence(None)
            pool.record_use([grant.row], newer)  # long enough: older[0] and older[1] are asked
        assert older[0].calls == 1 and got == [(0, 0)]
        pool.check_invariants()
        for fence in [*older, newer]:
            if fence is not dead:
                fence.set()
        pool.free([grant.row])
        await all_back(pool, free, pages_free)


@pytest.mark.parametrize(
    ("call", "grouped"),
    [(c, False) for c in ("try_alloc", "alloc", "try_admit", "admit")]
    + [("try_admit", True), ("admit", True)],  # a pool with KV groups: its own admission
)
@pytest.mark.parametrize("how", HOW)
async def test_a_take_counts_what_its_reclaims_query_freed(
    how: str, call: str, grouped: bool
) -> None:
    # A take short of memory reclaims completed fences, and took again only
    # when the reclaim released something: a row (and its pages) freed at
    # once from a query() the reclaim asked went uncounted. try_alloc and
    # try_admit answered None with it free; alloc and admit queued for it,
    # waiting until something else ran the grant loop (here: never).
    kv: Any = {"full": KVPagePool(4, 2), "swa": KVPagePool(4, 2)} if grouped else KVPagePool(4, 2)

    def pages(n: int) -> Any:
        return {"full": n, "swa": n} if grouped else n

    async with bounded(), AsyncReqToTokenPool(3, 4, kv=kv) as pool:
        free, pages_free = pool.stats().free, pool.stats().pages_free
        pending, other = await pool.admit(pages=pages(1)), await pool.admit(pages=pages(2))
        assert pool.available_size() == 0 and pool.stats().pages_free == 0
        fence = CallingFence(None)
        pool.free([pending.row], fence)  # open: the take's reclaim asks it
        refused: list[Exception] = []
        with eager_tasks(how):
            fence.call, fence.early = calling_back(pool, "free", other.row, how, refused), True
            if call == "try_alloc":
                got: Any = pool.try_alloc(1)
            elif call == "alloc":
                got = await pool.alloc(1)
            elif call == "try_admit":
                got = pool.try_admit(pages=pages(2))
            else:
                got = await pool.admit(pages=pages(2))
        assert fence.calls == 1 and not refused
        row = got[0] if isinstance(got, list) else got.row
        assert row == other.row
        if isinstance(got, Grant):
            assert sorted(got.pages.tolist()) == sorted(other.pages.tolist())
        if isinstance(got, GroupGrant):
            assert got.pages.keys() == {"full", "swa"}
        pool.check_invariants()
        fence.set()
        pool.free([row])
        await all_back(pool, free, pages_free)


GROUPED_CALLS: dict[str, Callable[[AsyncReqToTokenPool, int, Any], object]] = {
    "free": lambda pool, row, fence: pool.free([row], fence),
    "trim_pages": lambda pool, row, fence: pool.trim_pages([row], {"full": 1}, fence),
    "drop_pages": lambda pool, row, fence: pool.drop_pages([row], {"swa": 1}, fence),
    "extend": lambda pool, row, _: pool.extend(row, {"full": 1, "swa": 1}),
    "extend_fitting": lambda pool, row, _: pool.extend_fitting([row], {"full": 1, "swa": 1}),
}


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("outer", list(GROUPED_CALLS))
async def test_a_call_inside_a_grouped_give_back_or_growth_cannot_change_its_rows(
    outer: str, how: str
) -> None:
    groups = {"full": KVPagePool(6, 2), "swa": KVPagePool(6, 2)}
    async with bounded(), AsyncReqToTokenPool(4, 4, kv=groups) as pool:
        free = pool.stats().free
        grant = await pool.admit(pages={"full": 2, "swa": 2})
        fence = CallingFence(None)
        if outer.startswith("extend"):  # every page taken, some behind the fence
            other = await pool.admit(pages={"full": 3, "swa": 3})
            pool.free([other.row], fence)
            fence.set()
        refused: list[Exception] = []
        with eager_tasks(how):
            fence.call, fence.early = calling_back(pool, "free", grant.row, how, refused), True
            got = GROUPED_CALLS[outer](pool, grant.row, fence)
        assert fence.calls == 1
        assert len(refused) == 1 and "a call under way holds it" in str(refused[0])
        pool.check_invariants()
        if outer.startswith("extend"):
            assert got is not None
        fence.set()
        if outer != "free":
            pool.free([grant.row])
        await pool.drain(timeout=WAIT_S)
        pool.check_invariants()
        stats = pool.stats()
        assert (stats.allocated, stats.free, stats.pending) == (0, free, 0)
        assert [one.available_size() for one in groups.values()] == [5, 5]


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("growth", ["extend", "extend_fitting"])
async def test_a_grouped_growth_counts_each_group_after_every_reclaim(
    growth: str, how: str
) -> None:
    # A grouped growth reclaims each short group, then takes. It counted a
    # group free before the next group's reclaim, whose query() may take
    # that group's pages (an admission): the take then found fewer pages
    # than counted (AssertionError). Now it counts after every reclaim.
    groups = {"full": KVPagePool(6, 2), "swa": KVPagePool(6, 2)}
    async with bounded(), AsyncReqToTokenPool(5, 4, kv=groups) as pool:
        grown = await pool.admit(pages={"full": 1, "swa": 1})
        full_only = await pool.admit(pages={"full": 4, "swa": 0})
        swa_only = await pool.admit(pages={"full": 0, "swa": 4})
        a, b = CallingFence(None), CallingFence(None)
        pool.free([full_only.row], a)
        pool.free([swa_only.row], b)
        a.set()
        b.set()
        admitted: list[asyncio.Future[Any]] = []
        with eager_tasks(how):
            # Asked by the second group's reclaim: takes the first group's pages.
            b.call = lambda: admitted.append(
                start_task(pool.admit(pages={"full": 2, "swa": 0}), how)
            )
            if growth == "extend":
                got: object = pool.extend(grown.row, {"full": 3, "swa": 1})
                assert got is None  # 2 pages of "full" left: short
            else:
                m, got = pool.extend_fitting([grown.row], {"full": 3, "swa": 1})
                assert m == 0
        assert b.calls == 1
        grant = await settled(admitted[0])
        assert isinstance(grant, GroupGrant) and len(grant.pages["full"]) == 2
        pool.check_invariants()
        assert pool.extend(grown.row, {"full": 2, "swa": 1}) is not None
        pool.check_invariants()


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("inner_fence", [False, True], ids=["at once", "fenced"])
async def test_a_page_free_inside_its_own_fenced_free_is_a_double_free(
    inner_fence: bool, how: str
) -> None:
    # Pages a prefix cache holds (detached) freed behind a fence whose
    # query() frees them again: the second free found them still
    # allocated, and the pages went free (or pending) twice: the free ring
    # and the states disagreed, or a page was pending in two batches.
    kv = KVPagePool(10, 2)
    async with bounded(), AsyncReqToTokenPool(4, 4, kv=kv) as pool:
        pages_free = kv.available_size()
        grant = await pool.admit(pages=3)
        cached = pool.detach_pages(grant.row, host=True)
        pool.free([grant.row])
        refused: list[Exception] = []

        async def free_again() -> None:
            try:
                kv.free(cached, fence=CallingFence(None) if inner_fence else None)
            except DoubleFreeError as exc:
                refused.append(exc)

        with eager_tasks(how):
            fence = CallingFence(lambda: start_task(free_again(), how))
            fence.early = True
            kv.free(cached, fence=fence)
        assert fence.calls == 1
        assert len(refused) == 1 and "a call under way" in str(refused[0])
        kv.check_invariants()
        assert kv.pending_size() == 3
        fence.set()
        await pool.drain(timeout=WAIT_S)
        kv.check_invariants()
        assert (kv.available_size(), kv.pending_size()) == (pages_free, 0)


def _kv_and_one_page(*, grouped: bool) -> tuple[Any, Any]:
    """A pool's ``kv=`` (one KV pool, or KV groups) and ``pages=`` for one
    page of each."""
    if grouped:
        return {"full": KVPagePool(10, 2), "swa": KVPagePool(10, 2)}, {"full": 1, "swa": 1}
    return KVPagePool(10, 2), 1


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize(
    "call", ["try_alloc", "alloc", "try_admit", "admit", "grouped try_admit", "grouped admit"]
)
async def test_a_call_queued_inside_a_direct_calls_reclaim_is_served_first(
    call: str, how: str
) -> None:
    # A call that serves at once (try_alloc, try_admit, or alloc and admit
    # with nobody queued) reclaims when short, then takes. A query() that
    # reclaim asks may queue an alloc (a transfer handle's task), which
    # finds nothing free: the reclaim walks the side list, out of reach of
    # the reclaim that alloc makes. The reclaim then returns two rows. The
    # direct call took the first, queued after it (a queue jump), and left
    # the second free with the alloc still queued, granted by nobody until
    # the next free or wake-up.
    kv, pages = _kv_and_one_page(grouped=call.startswith("grouped"))
    async with bounded(), AsyncReqToTokenPool(4, 4, kv=kv) as pool:
        rows = await pool.alloc(3)  # every row
        queued: list[asyncio.Future[Any]] = []
        with eager_tasks(how):
            fence = CallingFence(lambda: queued.append(start_task(pool.alloc(1), how)))
            other = CallingFence(None)
            pool.free([rows[0]], fence)  # both on the side list (fences of no stream)
            pool.free([rows[1]], other)
            fence.set()
            other.set()
            got: Any
            if call == "try_alloc":
                got = pool.try_alloc(1)
            elif call == "alloc":
                got = await pool.alloc(1)
            elif call.endswith("try_admit"):
                got = pool.try_admit(pages=pages)
            else:
                got = await pool.admit(pages=pages)
            assert fence.calls == 1 and len(queued) == 1
            assert pool.waiting() == 0  # served at once, not left to a wake-up
        got_row = got[0] if isinstance(got, list) else got.row
        assert got_row == rows[1]  # the queued alloc asked first: it got the first row back
        assert await settled(queued[0]) == [rows[0]]
        pool.check_invariants()
        assert pool.stats().allocated == 3


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("call", ["alloc", "admit", "grouped admit"])
async def test_a_less_urgent_call_queued_inside_a_direct_calls_reclaim_does_not_hold_it(
    call: str, how: str
) -> None:
    # As above, but the call a query() queues is less urgent (priority 5)
    # and wants more than the reclaim returns: queued ahead of nobody the
    # direct call (priority 0) would have passed, it must not make that
    # call queue (a turn of the loop, and a wait counted) for a row it may
    # take at once.
    kv, pages = _kv_and_one_page(grouped=call.startswith("grouped"))
    async with bounded(), AsyncReqToTokenPool(4, 4, kv=kv) as pool:
        rows = await pool.alloc(3)  # every row
        queued: list[asyncio.Future[Any]] = []
        with eager_tasks(how):
            fence = CallingFence(lambda: queued.append(start_task(pool.alloc(3, priority=5), how)))
            pool.free([rows[0]], fence)
            fence.set()
            coro = pool.alloc(1) if call == "alloc" else pool.admit(pages=pages)
            with pytest.raises(StopIteration) as done:  # served without suspending
                coro.send(None)
            assert fence.calls == 1 and len(queued) == 1
        got = done.value.value
        assert (got[0] if isinstance(got, list) else got.row) == rows[0]
        assert pool.waiting() == 1  # the less urgent call, still short
        queued[0].cancel()
        await asyncio.gather(queued[0], return_exceptions=True)
        pool.check_invariants()
