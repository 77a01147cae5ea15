"""A seeded random model of the waiter queues, through the pool's public API.

Random arrivals (``alloc`` with priorities, timeouts, ``max_waiters``),
frees, cancels at random points (before a task starts, while it queues, in
the middle of its queue, in the same tick as its grant), ``hold_grants``
holds and a final ``close``, against a shadow of the queue: FIFO within a
priority, lower priority number first, the head blocks everyone behind it.
After every step the loop is let run until it is quiet, and then:

* nobody is left unserved: unless grants are held, the head (the first
  live waiter, by priority then arrival) does not fit in the free rows;
* ``waiting()``, ``waiting_by_priority()`` and ``queue_head()`` agree with
  the shadow, ``check_invariants()`` holds and no row is lost;
* at each grant (checked as the granted call returns), no live waiter that
  queued ahead of it still waits: no bypass, no queue jumping;
* a refusal for ``max_waiters`` comes exactly when that many live calls
  queue (cancelled calls not unwound yet, and dead ones, do not count);
* a call cancelled in the same tick as its grant raises ``CancelledError``
  and its rows go back (the conservation check).

The storm of 74d6cf1 leaves cancelled waiters dead in the middle of their
queue; this model drives every path that makes a dead waiter the head.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest
from helpers import bounded

from asyncpool import AsyncReqToTokenPool, GrantHold, PoolBusyError, PoolClosedError

ROWS = 4  # rows the pool serves (size 5: row 0 is reserved)
STEPS = 1500


@dataclasses.dataclass(eq=False)
class _Call:
    seq: int
    n: int
    prio: int
    timeout: float | None
    task: asyncio.Task[None] | None = None
    started: bool = False
    step: int = 0  # the model's step in which it started
    since: float = 0.0  # loop.time() when it started
    rows: list[int] | None = None
    outcome: str = ""  # "granted", "busy", "timeout", "closed"

    def order(self) -> tuple[int, int]:
        return self.prio, self.seq


class _Model:
    def __init__(self, rng: random.Random, max_waiters: int | None, timeouts: bool) -> None:
        self.rng = rng
        self.max = max_waiters
        self.timeouts = timeouts
        self.pool = AsyncReqToTokenPool(ROWS + 1, 16, max_waiters=max_waiters)
        self.calls: list[_Call] = []
        self.holding: list[_Call] = []
        self.holds: list[GrantHold] = []
        self.seq = 0
        self.step = 0
        self.grants = 0
        self.refusals = 0
        self.same_tick_cancels = 0
        self.most_dead = 0
        self.errors: list[str] = []

    # ------------------------------------------------------------ the shadow

    def queued(self, but: _Call | None = None) -> list[_Call]:
        """Live calls queued now, in grant order: started, not returned, not
        cancelled (a call cancelled but not unwound is no longer wanted)."""
        live = [
            c
            for c in self.calls
            if c is not but
            and c.started
            and c.task is not None
            and not c.task.done()
            and not c.task.cancelling()
            and not c.outcome
        ]
        return sorted(live, key=_Call.order)

    async def client(self, call: _Call) -> None:
        call.started = True
        call.step = self.step
        call.since = asyncio.get_running_loop().time()
        try:
            rows = await self.pool.alloc(call.n, priority=call.prio, timeout=call.timeout)
        except PoolBusyError:
            call.outcome = "busy"
            self.refusals += 1
            n = len(self.queued(but=call))
            if self.max is None or n < self.max:
                self.errors.append(f"refused with {n} live queued, max_waiters={self.max}")
            return
        except TimeoutError:
            call.outcome = "timeout"
            return
        except PoolClosedError:
            call.outcome = "closed"
            return
        call.outcome = "granted"
        call.rows = rows
        self.grants += 1
        self.holding.append(call)
        # Queued at its grant for sure: those that arrived before it, and
        # those that arrived in an earlier step (a grant reaches its task
        # within the step). A later arrival of this step may have come
        # after the grant (a timer fired first). Not one whose timeout may
        # have fired: it leaves the queue before its task unwinds (uvloop
        # runs due timers before the calls ready, so an arrival after it
        # may find nobody queued and take the fast path).
        now = asyncio.get_running_loop().time()
        ahead = [
            c
            for c in self.queued(but=call)
            if c.order() < call.order()
            and (c.seq < call.seq or c.step < self.step)
            and (c.timeout is None or now + 0.002 < c.since + c.timeout)  # timer slack
        ]
        if ahead:
            self.errors.append(
                f"call {call.order()} granted while {[c.order() for c in ahead]} queued ahead"
            )

    def arrive(self) -> None:
        for _ in range(self.rng.randrange(1, 4)):
            timeout: float | None = None
            if self.timeouts:
                r = self.rng.random()
                if r < 0.3:
                    timeout = self.rng.choice([0.0002, 0.001, 0.005])
                elif r < 0.45:
                    timeout = 60.0  # never fires: its handle is cancelled
            self.seq += 1
            call = _Call(self.seq, self.rng.choice([1, 1, 2, 3]), self.rng.randrange(3), timeout)
            call.task = asyncio.create_task(self.client(call))
            self.calls.append(call)

    def free_one(self) -> None:
        if self.holding:
            call = self.holding.pop(self.rng.randrange(len(self.holding)))
            assert call.rows is not None
            self.pool.free(call.rows)

    def cancel_some(self) -> None:
        pending = [c for c in self.calls if c.task is not None and not c.task.done()]
        for c in pending:
            if self.rng.random() < 0.25:
                assert c.task is not None
                c.task.cancel()

    def free_and_cancel_in_the_same_tick(self) -> None:
        """A free grants the head at once; cancel it (and maybe others)
        before its task resumes: it must raise CancelledError, its rows
        given back and granted on."""
        heads = self.queued()[:2]
        self.free_one()
        for c in heads:
            if self.rng.random() < 0.7:
                assert c.task is not None
                c.task.cancel()
                self.same_tick_cancels += 1

    def hold_or_release(self) -> None:
        if self.holds and (len(self.holds) > 1 or self.rng.random() < 0.9):
            self.holds.pop(self.rng.randrange(len(self.holds))).release()
        elif not self.holds or self.rng.random() < 0.3:
            self.holds.append(self.pool.hold_grants())

    def release_all_holds(self) -> None:
        while self.holds:
            self.holds.pop().release()

    # ------------------------------------------------------------ checks

    async def settle(self) -> None:
        """Let the loop run until every grant, timeout and cancel has
        reached its task: the queue's count equals the shadow's unreturned
        calls for two turns running."""
        async with bounded():
            quiet = 0
            while quiet < 2:
                await asyncio.sleep(0)
                unreturned = sum(1 for c in self.calls if c.task is not None and not c.task.done())
                quiet = quiet + 1 if self.pool.waiting() == unreturned else 0

    def check(self) -> None:
        pool = self.pool
        assert not self.errors, self.errors
        pool.check_invariants()
        queued = self.queued()
        assert pool.waiting() == len(queued)
        by_prio: dict[int, int] = {}
        for c in queued:
            by_prio[c.prio] = by_prio.get(c.prio, 0) + 1
        assert pool.waiting_by_priority() == dict(sorted(by_prio.items()))
        head = pool.queue_head()
        if not queued:
            assert head is None
        else:
            assert head is not None
            assert (head.priority, head.rows) == (queued[0].prio, queued[0].n)
            if not self.holds:  # the head blocks only while it does not fit
                assert queued[0].n > pool.available_size(), (queued[0].n, pool.available_size())
        waiters = pool._waiters  # the dead stay O(live): see test_cancel_storm.py
        entries = sum(len(q) for q in waiters._queues.values())
        assert entries <= 2 * waiters.count + 64, (entries, waiters.count)
        self.most_dead = max(self.most_dead, len(waiters._dead))
        held = sum(len(c.rows or ()) for c in self.holding)
        assert pool.available_size() + held == ROWS
        for c in self.calls:
            if c.task is not None and c.task.done() and not c.task.cancelled():
                c.task.result()  # no error escaped a client
        self.calls = [c for c in self.calls if c.task is not None and not c.task.done()]

    async def run(self, steps: int) -> None:
        rng = self.rng
        actions = [
            (self.arrive, 5),
            (self.free_one, 4),
            (self.cancel_some, 2),
            (self.free_and_cancel_in_the_same_tick, 2),
            (self.hold_or_release, 1),
            (self.release_all_holds, 1),
        ]
        fns = [a for a, _ in actions]
        weights = [w for _, w in actions]
        for self.step in range(1, steps + 1):
            (action,) = rng.choices(fns, weights)
            action()
            if rng.random() < 0.15:
                self.cancel_some()  # cancels in the same tick as the step's
            await self.settle()
            self.check()
        # Close with waiters queued (some behind dead ones, maybe held).
        pending = [c for c in self.calls if c.task is not None]
        await self.pool.close()
        async with bounded():
            await asyncio.gather(*(c.task for c in pending if c.task), return_exceptions=True)
        for c in pending:
            assert c.task is not None
            assert c.task.cancelled() or c.outcome in {"closed", "granted", "timeout", "busy"}
        for hold in self.holds:
            hold.release()
        for c in self.holding:
            assert c.rows is not None
            self.pool.free(c.rows)
        assert self.pool.available_size() == ROWS and self.pool.waiting() == 0
        assert not self.pool._waiters._dead and not self.pool._waiters._gone
        self.pool.check_invariants()


@pytest.mark.parametrize(
    ("seed", "max_waiters", "timeouts"),
    [
        (0, None, True),
        (1, None, True),
        (2, None, True),
        (3, None, False),
        (4, None, False),
        (5, 6, False),
        (6, 3, False),
        (7, 1, False),
    ],
)
async def test_the_waiter_queues_follow_the_shadow_model(seed, max_waiters, timeouts):
    model = _Model(random.Random(seed), max_waiters, timeouts)
    await model.run(STEPS)
    assert model.grants > 50 and model.same_tick_cancels > 5
    if max_waiters is not None:
        assert model.refusals > 0
