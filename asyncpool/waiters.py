"""Prioritised FIFO waiter queues and the grant loop, generic over the need.

A waiter asks for a *need* (the pool's ``alloc`` asks for ``n`` rows, its
``admit`` for one row and ``k`` pages); this module never looks inside one.
It queues waiters FIFO within a priority (lower number first), and its grant
loop hands resources over in that order through three callables the owner
supplies:

* ``take(need) -> grant | None``: take everything ``need`` asks for *now*,
  all or nothing, reclaiming memory whose fences completed before it
  concludes that it is short (None: it does not fit yet, nothing was taken);
* ``give_back(grant)``: undo a ``take`` whose waiter was cancelled before it
  could resume (the resources return as if never taken);
* optionally ``supply``: a container that every need draws at least one item
  from (the pool's free rows). Once it is empty after a grant the loop ends
  without probing the next head, which could only be served by reclaiming
  memory whose fences completed, and each such completion runs the loop
  itself. Under saturation this saves a failed ``take`` per grant.

The rules that every waiting call shares live here, once (the design follows
``asyncio.Semaphore`` in CPython's ``Lib/asyncio/locks.py``, with the change
that removes its lost-wake-up and queue-jumping bugs):

* **grant at hand-over**: whoever makes memory free runs :meth:`WaiterQueues.grant`,
  which takes the head's need and resolves its future *with the grant*; a
  woken waiter never re-checks and competes;
* **the head blocks those behind it**, whatever they need: a head that does
  not fit ends the loop (no starvation of big requests, no bypass); a new
  request more urgent than every queued one becomes the head, and the loop
  runs for it at the event loop's next turn (it may fit what is free);
* **cancelled or timed out means nothing was granted**; a waiter cancelled
  after its grant gives everything back and the loop runs again; a cancelled
  or expired head re-runs the loop too, since smaller waiters behind it may
  fit now;
* **bounded**: past ``max_waiters`` a new waiter is refused with
  :class:`PoolBusyError` at once (load shedding);
* **gate**: while :attr:`WaiterQueues.gated` is set (the owner's memory is
  released, the owner closed, or its scheduler holds the grants) the loop
  grants nothing; :meth:`fail_all` fails every waiter (close).

Thread rules: loop-affine, like the pool that owns it; not thread-safe,
but for :meth:`WaiterQueues.oldest_wait`, a read that any thread may make
(a metrics scrape).
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import time
from collections.abc import Callable, Sized
from typing import Any

from .errors import CapacityError, PoolBusyError
from .stats import MAX_PRIORITIES, Histogram, HistogramSnapshot

__all__ = ["PriorityFigures", "Waiter", "WaiterQueues"]

_perf_counter = time.perf_counter
_bisect_left = bisect.bisect_left

# Dead waiters (see WaiterQueues._dequeue) are swept out of the queues once
# they outnumber the live ones and number at least this many: the memory
# they hold stays O(waiters queued), the sweep rare.
_COMPACT_MIN = 64

# A queued request is the tuple (need, future, enqueue time, priority, wait
# window, wait histogram): cheaper to build than an object, and the future
# says whether it is still wanted. Each grant records its wait in the
# waiter's own window and histogram (the owner's), so an owner can keep one
# pair per kind of request; the owner picks the histogram of the waiter's
# priority (PriorityFigures) at enqueue, so the grant pays nothing for the
# figures per priority.
Waiter = tuple[Any, "asyncio.Future[Any]", float, int, "collections.deque[float]", Histogram]


def _waiters(n: int) -> str:
    return "1 waiter" if n == 1 else f"{n} waiters"


class PriorityFigures:
    """One priority's lifetime figures (or those of every priority past
    :data:`~asyncpool.stats.MAX_PRIORITIES`, together): the waits of its
    calls that queued, one histogram per kind of call the owner counts
    apart (the pool: ``alloc``'s, ``admit``'s), and its timeouts,
    cancellations, rejections and unfittable calls (:meth:`WaiterQueues.unfit`).
    Written on the owner's thread; a scrape on another reads them (ints, and
    histograms copied in one C-level step).
    """

    __slots__ = ("cancellations", "histograms", "rejections", "timeouts", "unfittable")

    def __init__(self, kinds: int) -> None:
        self.histograms: tuple[Histogram, ...] = tuple(Histogram() for _ in range(kinds))
        self.timeouts: int = 0
        self.cancellations: int = 0
        self.rejections: int = 0
        self.unfittable: int = 0


class WaiterQueues:
    """Waiters queued FIFO within priority, and the grant loop that serves them.

    See the module docstring for the rules. ``count`` (waiters queued) and
    ``gated`` are plain attributes so an owner's fast path can read them
    cheaply: a caller may skip the queue only while both are falsy.
    """

    __slots__ = (
        "_dead",
        "_describe",
        "_give_back",
        "_gone",
        "_granting",
        "_kinds",
        "_max",
        "_prios",
        "_queues",
        "_supply",
        "_take",
        "_who",
        "cancellations",
        "count",
        "gated",
        "other",
        "rejections",
        "tiers",
        "timeouts",
        "unfittable",
    )

    def __init__(
        self,
        take: Callable[[Any], Any | None],
        give_back: Callable[[Any], None],
        describe: Callable[[Any], tuple[str, str]],
        max_waiters: int | None = None,
        supply: Sized | None = None,
        kinds: int = 1,
        who: Callable[[], str] | None = None,
    ) -> None:
        """``kinds``: how many kinds of call the owner keeps wait histograms
        for apart, per priority (:meth:`figures`); ``who``: the owner as its
        error messages name it (``AsyncReqToTokenPool 'decode'``)."""
        self._take = take
        self._supply = supply
        self._give_back = give_back
        self._describe = describe
        self._max = max_waiters
        self._queues: dict[int, collections.deque[Waiter]] = {}
        self._prios: list[int] = []  # sorted keys of _queues
        # Cancelled waiters left in place in the middle of their queue (their
        # futures), no longer counted: the grant loop drops each as it reaches
        # it (see _dequeue). And cancelled waiters that the grant loop or the
        # refusal path took off before their tasks unwound: cancelled() finds
        # them here, gone, instead of searching for them.
        self._dead: set[asyncio.Future[Any]] = set()
        self._gone: set[asyncio.Future[Any]] = set()
        # The grant loop under way: 0 (none), 1 (running), 2 (running, and
        # asked to run again by a grant() made inside its take; see grant).
        self._granting = 0
        self.count: int = 0
        self.gated: bool = False
        self.timeouts: int = 0
        self.cancellations: int = 0
        self.rejections: int = 0
        self.unfittable: int = 0
        # Figures per priority (see PriorityFigures), for the first
        # MAX_PRIORITIES priorities; those past it share ``other``.
        self._kinds = kinds
        self._who = who
        self.tiers: dict[int, PriorityFigures] = {}
        self.other: PriorityFigures | None = None

    # ------------------------------------------------------------ per priority

    def figures(self, priority: int) -> PriorityFigures:
        """The figures ``priority``'s calls count in: its own, made on
        first use for the first :data:`~asyncpool.stats.MAX_PRIORITIES`
        priorities, else those of every later priority together
        (:attr:`other`). The owner's thread; one dict lookup once made."""
        figures = self.tiers.get(priority)
        if figures is None:
            if len(self.tiers) < MAX_PRIORITIES:
                figures = self.tiers[priority] = PriorityFigures(self._kinds)
            else:
                figures = self.other
                if figures is None:
                    figures = self.other = PriorityFigures(self._kinds)
        return figures

    def wait_snapshot(self, kind: int = 0, zeros: int = 0) -> HistogramSnapshot:
        """Every priority's ``kind`` histogram summed, with ``zeros`` extra
        zero waits (calls granted without queueing): the owner's histogram
        of that kind of call. Any thread (a scrape): each histogram's counts
        are copied in one C-level step and only grow, so the sum's buckets
        and count agree and never go down between reads."""
        hists = [one.histograms[kind] for one in list(self.tiers.values())]  # a C-level copy
        other = self.other
        if other is not None:
            hists.append(other.histograms[kind])
        if not hists:
            return Histogram().snapshot(zeros)
        snaps = [h.snapshot() for h in hists]  # each one C-level copy of its counts
        counts = [sum(bucket) for bucket in zip(*(s.counts for s in snaps), strict=True)]
        counts[0] += zeros
        total_s = sum(s.sum_s for s in snaps)
        return HistogramSnapshot(snaps[0].bounds, tuple(counts), sum(counts), total_s)

    def _who_prefix(self) -> str:
        return "" if self._who is None else f"{self._who()}: "

    # ------------------------------------------------------------ waiting

    def enqueue(
        self,
        need: Any,
        priority: int,
        timeout: float | None,
        loop: asyncio.AbstractEventLoop,
        window: collections.deque[float],
        histogram: Histogram,
    ) -> tuple[Waiter, asyncio.TimerHandle | None]:
        """Queue a request for ``need``; return it and its timeout handle.

        The caller awaits ``waiter[1]`` (the future: it resolves with the
        grant), calls :meth:`cancelled` if that await is cancelled, adds one
        to ``timeouts`` if it raises ``TimeoutError``, and cancels the
        handle when done. A request more urgent than every one
        queued becomes the head: the grant loop runs for it at the loop's
        next turn, since it may fit in what is free now. :meth:`wait` does exactly this; a hot
        caller may inline it to save a coroutine frame per wait. The wait,
        from now to the grant, goes to ``window`` and ``histogram``. Raises
        :class:`PoolBusyError` (queueing nothing) past ``max_waiters``, where a
        waiter cancelled but not yet unwound does not count.
        """
        if self._max is not None and self.count >= self._max and self._drop_cancelled():
            self.rejections += 1
            self.figures(priority).rejections += 1
            raise PoolBusyError(
                f"{self._who_prefix()}{_waiters(self.count)} already queued, the limit set by "
                f"max_waiters={self._max}; refusing to queue {self._describe(need)[0]} "
                f"at priority {priority}"
            )
        fut: asyncio.Future[Any] = loop.create_future()
        waiter: Waiter = (need, fut, _perf_counter(), priority, window, histogram)
        # The timer first: if the loop refuses it (asyncio's call_later
        # raises OverflowError for a delay past the float range), nothing is
        # queued, where a waiter queued before would stay with nobody
        # awaiting it and be granted memory that is never given back.
        handle = (
            None if timeout is None else loop.call_later(timeout, self._expire, waiter, timeout)
        )
        queue = self._queues.get(priority)
        if queue is None:
            queue = self._queues[priority] = collections.deque()
            bisect.insort(self._prios, priority)
            if self.count and (self._prios[0] == priority or self._dead):
                # A new head, ahead of waiters that were blocked: it may fit
                # in what is free now, and no free may come to run the loop.
                # Run it from the loop, not here: a grant resumes its task
                # only after the row resets it schedules (see grant()).
                loop.call_soon(self._new_head, waiter)
        elif self._dead and self.count:
            # Only dead waiters may stand ahead of it (in its queue or a more
            # urgent one): then it is the head. The loop's next run says.
            loop.call_soon(self._new_head, waiter)
        queue.append(waiter)
        self.count += 1
        return waiter, handle

    def _drop_cancelled(self) -> bool:
        """Take off the queues the waiters cancelled whose tasks have not run
        yet (they no longer queue; :meth:`cancelled` finds them gone when
        their tasks unwind) and the dead ones, then answer whether
        ``max_waiters`` still queue. O(waiters queued): the refusal path,
        and the sweep of the dead once they outnumber the live
        (:meth:`_dequeue`). Never changes who is served next."""
        dead = self._dead
        gone = self._gone
        for prio in list(self._prios):
            queue = self._queues[prio]
            live = [w for w in queue if not w[1].cancelled()]
            if len(live) == len(queue):
                continue
            for waiter in queue:
                fut = waiter[1]
                if fut in dead:
                    dead.discard(fut)  # no longer counted already
                elif fut.cancelled():
                    gone.add(fut)
                    self.count -= 1
            if live:
                # In place (a scrape's copy of the index stays valid), the
                # live put in front before the old entries go from the back:
                # a scrape reading from the front (oldest_wait, another
                # thread) finds the oldest live waiter at every step, where
                # emptying the queue first let it read 0.0 with waiters queued.
                old = len(queue)
                queue.extendleft(reversed(live))
                for _ in range(old):
                    queue.pop()
            else:
                del self._queues[prio]
                self._prios.remove(prio)
        return self._max is not None and self.count >= self._max

    def serve_soon(self, waiter: Waiter, loop: asyncio.AbstractEventLoop) -> None:
        """Run the grant loop for ``waiter`` at the loop's next turn, if it
        still waits then: for an owner that queued it without trying to take
        for it first (it found waiters queued that were dropped meanwhile)."""
        loop.call_soon(self._new_head, waiter)

    def _new_head(self, waiter: Waiter) -> None:
        # Only while the new head still waits: then the owner has not moved
        # to another loop or thread (a waiter pins it), and a grant is due.
        if not waiter[1].done():
            self.grant()

    def cancelled(self, waiter: Waiter) -> None:
        """The task awaiting ``waiter`` was cancelled: settle what it held.

        Not yet granted: it leaves the queue. Granted but not resumed: the
        grant is given back. Either way the grant loop runs again, since the
        head may have changed or memory may be free.
        """
        self.cancellations += 1
        self.figures(waiter[3]).cancellations += 1
        fut = waiter[1]
        if fut.cancelled():
            if fut in self._gone:
                self._gone.discard(fut)  # taken off already, uncounted
            else:
                self._dequeue(waiter, lazy=True)
        elif fut.exception() is None:
            self._give_back(fut.result())
        self.grant()

    async def wait(
        self,
        need: Any,
        priority: int,
        timeout: float | None,
        loop: asyncio.AbstractEventLoop,
        window: collections.deque[float],
        histogram: Histogram,
        serve: bool = False,
    ) -> Any:
        """Queue for ``need`` and return its grant once the loop hands it over.

        With ``serve``, the grant loop runs for the new waiter at the loop's
        next turn (:meth:`serve_soon`: the owner just dropped waiters that
        may have blocked it). Raises ``TimeoutError`` after ``timeout``
        seconds, the owner's error if it fails the waiter (:meth:`fail_all`,
        :meth:`shed`: counted in ``unfittable`` if a
        :class:`~asyncpool.CapacityError`), and :class:`PoolBusyError` past ``max_waiters``. On
        any exception, cancellation included, nothing was granted.
        """
        waiter, handle = self.enqueue(need, priority, timeout, loop, window, histogram)
        if serve:
            self.serve_soon(waiter, loop)
        try:
            return await waiter[1]
        except asyncio.CancelledError:
            self.cancelled(waiter)
            raise
        except TimeoutError:
            self.timed_out(waiter)
            raise
        except CapacityError:
            self.unfit(waiter[3])  # shed(): counted where the call raises it
            raise
        finally:
            if handle is not None:
                handle.cancel()
            # The waiter holds the future, which holds a timeout's or a close's
            # error, whose traceback holds this frame: a cycle that would keep
            # the caller's frames (and their locals) until the cycle collector.
            del waiter

    def timed_out(self, waiter: Waiter) -> None:
        """The call awaiting ``waiter`` raised its ``TimeoutError``: count
        it (pool-wide and at its priority). Counted where the call raises
        it, not at expiry: a task cancelled before it resumes raises
        ``CancelledError`` instead and counts as a cancellation."""
        self.timeouts += 1
        self.figures(waiter[3]).timeouts += 1

    def unfit(self, priority: int) -> None:
        """A call at ``priority`` raised :class:`~asyncpool.CapacityError`
        because its need can never be met (more than the owner has, or than
        quarantine leaves it): count it (pool-wide and at its priority).
        The owner calls it once per such call: where it refuses one at
        once, or where a waiter that :meth:`shed` failed raises the error,
        as for :meth:`timed_out` (a task cancelled before it resumes
        raises ``CancelledError`` instead and counts as a cancellation).
        The failing paths only; the owner's thread."""
        self.unfittable += 1
        self.figures(priority).unfittable += 1

    def _dequeue(self, waiter: Waiter, lazy: bool = False) -> None:
        """Take ``waiter`` off its queue, if it is still there.

        O(1) at either end of its priority's queue: the head (the oldest,
        as a timeout common to every waiter expires them) and the tail (the
        newest, cancelled at once or in reverse order). In the middle, a
        ``lazy`` caller (a cancelled waiter, still queued: its future is
        cancelled) leaves it in place, *dead*: no longer counted, dropped by
        the grant loop when it reaches it (O(1) each), or swept out with
        the rest once the dead outnumber the live (a head that stays
        blocked keeps the grant loop from ever reaching them); otherwise it
        costs a search of its own queue. ``deque.remove`` alone walked the whole
        queue for the newest waiter (0.4 ms a cancel with 16,384 queued),
        and a disconnect storm cancelling half of 16,000 queued waiters at
        random cost 0.7 s of searches.
        """
        priority = waiter[3]
        queue = self._queues.get(priority)
        if queue is None:
            return
        if queue[0] is waiter:
            queue.popleft()
        elif queue[-1] is waiter:
            queue.pop()
        elif lazy:
            dead = self._dead
            dead.add(waiter[1])
            self.count -= 1
            if not self.count:
                self._clear_dead()
            elif len(dead) > self.count and len(dead) >= _COMPACT_MIN:
                # More dead than live: sweep them out. Behind a head that
                # stays blocked the grant loop never reaches them, and a
                # run of cancels (clients that give up while a big request
                # blocks) would grow them without bound. Amortised O(1) a
                # cancel: the sweep costs O(queued) < 2 x the dead it drops.
                self._drop_cancelled()
            return
        else:
            try:
                queue.remove(waiter)
            except ValueError:
                return  # already taken off by the grant loop, expiry or close
        self.count -= 1
        if not queue:
            del self._queues[priority]
            self._prios.remove(priority)
        if not self.count and self._dead:
            self._clear_dead()

    def _clear_dead(self) -> None:
        """Nobody counted is queued: whatever the queues still hold is dead."""
        self._queues.clear()
        self._prios.clear()
        self._dead.clear()

    def _expire(self, waiter: Waiter, timeout: float) -> None:
        fut = waiter[1]
        if fut.done():
            return
        self._dequeue(waiter)
        # Not counted here: the task may be cancelled before it resumes, and
        # then the call raises CancelledError and counts as a cancellation.
        # The awaiting call counts the timeout when it raises it.
        call, what = self._describe(waiter[0])
        fut.set_exception(
            TimeoutError(
                f"{self._who_prefix()}{call} timed out after {timeout} s: {what} could not "
                f"be granted in time at priority {waiter[3]}"
            )
        )
        self.grant()

    # ------------------------------------------------------------ the grant loop

    def grant(self) -> None:
        """Hand memory to waiters in order until the head does not fit.

        Runs synchronously and resolves each granted waiter's future with its
        grant, so nobody else can take it in between. A cancelled head still
        queued (its task has not run its handler yet) is dropped on the way.

        Re-entrant calls are safe. ``take`` may run code that is not the
        owner's: reclaiming asks fences' ``query()``, and a ``query()`` may
        call the owner (a free, a close, a cancel of the head's task), or
        create a task that does, which under ``asyncio.eager_task_factory``
        (Python 3.12+) runs at once, inside this loop. A ``grant()`` made
        meanwhile only asks this loop to run again once its ``take``
        returns (two loops would grant one head twice); a head cancelled or
        failed meanwhile, or a gate closed, gets nothing: what was taken for
        it is given back.
        """
        if not self.count or self.gated:
            return
        if self._granting:
            self._granting = 2  # the loop under way runs again (see above)
            return
        self._granting = 1
        try:
            take = self._take
            queues = self._queues
            prios = self._prios
            supply = self._supply
            now = 0.0
            while self.count and not self.gated:
                prio = prios[0]
                queue = queues[prio]
                need, fut, t0, _, window, histogram = queue[0]
                if fut.done():
                    # Cancelled: dead (uncounted already), or its task has not
                    # run its handler yet (then it finds the waiter gone).
                    queue.popleft()
                    if fut in self._dead:
                        self._dead.discard(fut)
                    else:
                        self.count -= 1
                        self._gone.add(fut)
                    if not queue:
                        del queues[prio]
                        prios.pop(0)
                    continue
                got = take(need)
                if got is None:
                    if self._granting == 2:
                        # A grant() inside the take: memory came back there,
                        # after the take looked. Ask the head again.
                        self._granting = 1
                        continue
                    return  # the head does not fit: it blocks those behind it
                if fut.done() or self.gated:
                    # take() ran code that cancelled or failed the head (a
                    # close), or closed the gate: the grant is nobody's.
                    self._give_back(got)
                    continue
                queue.popleft()
                self.count -= 1
                if not queue:
                    del queues[prio]
                    # Not pop(0): take() may have queued a more urgent waiter.
                    prios.remove(prio)
                fut.set_result(got)
                if not now:
                    now = _perf_counter()
                waited = now - t0
                window.append(waited)
                # Histogram.observe, inlined (a call is a third of its cost here).
                histogram._counts[_bisect_left(histogram.bounds, waited)] += 1
                histogram._sum += waited
                if supply is not None and not supply:
                    break  # nothing left to take without a reclaim (see above)
            if self._dead and not self.count:
                self._clear_dead()  # nobody counted is left: the rest is dead
        finally:
            self._granting = 0

    # ------------------------------------------------------------ failing waiters

    def shed(self, error_for: Callable[[Any], BaseException | None]) -> int:
        """Fail every waiter whose need ``error_for`` answers with an error.

        For needs that can never be met any more (memory quarantined behind
        faulted fences); then runs the grant loop, since a failed head may
        have blocked others. Returns how many waiters were failed. Counts
        nothing: each awaiting call counts its error as it raises it
        (:meth:`unfit`), so a task cancelled before it resumes counts once,
        as a cancellation.
        """
        failed = 0
        for prio in list(self._prios):
            for waiter in list(self._queues.get(prio, ())):
                fut = waiter[1]
                if fut.done():
                    continue
                error = error_for(waiter[0])
                if error is not None:
                    self._dequeue(waiter)
                    fut.set_exception(error)
                    failed += 1
        self.grant()
        return failed

    def fail_all(self, error: BaseException) -> None:
        """Gate the loop for good and fail every queued waiter with ``error``."""
        self.gated = True
        for queue in self._queues.values():
            for waiter in queue:
                fut = waiter[1]
                # A future of a closed loop cannot be failed (its callbacks
                # cannot be scheduled) and its task never resumes: skip it.
                if not fut.done() and not fut.get_loop().is_closed():
                    fut.set_exception(error)
        self.drop_all()

    def drop_all(self) -> int:
        """Forget every queued waiter without touching its future; return how
        many. For waiters whose event loop was closed under them: their
        tasks can never resume, and a future of a closed loop cannot be
        resolved (its callbacks cannot be scheduled)."""
        dropped = self.count
        self._queues.clear()
        self._prios.clear()
        self._dead.clear()
        self._gone.clear()
        self.count = 0
        return dropped

    # ------------------------------------------------------------ views

    def _head(self) -> Waiter | None:
        """The waiter the grant loop serves next (the first queued one not
        yet cancelled), or None when nobody waits."""
        for p in self._prios:
            for w in self._queues[p]:
                if not w[1].done():
                    return w
        return None

    def head(self) -> Any | None:
        """The need the grant loop serves next (the first queued waiter not
        yet cancelled), or None when nobody waits."""
        w = self._head()
        return None if w is None else w[0]

    def head_wait(self) -> tuple[Any, int, float] | None:
        """The next-served waiter's need, priority and the seconds it has
        queued so far (``time.perf_counter``, from its :meth:`enqueue`: the
        clock its wait is recorded with at the grant), or None when nobody
        waits. A read: it drops nothing, not even a cancelled waiter."""
        w = self._head()
        if w is None:
            return None
        return w[0], w[3], _perf_counter() - w[2]

    def oldest_wait(self) -> float:
        """Seconds the longest-queued live waiter has waited so far (its
        :meth:`enqueue` to now, on the clock :meth:`head_wait` reads), of
        any priority; 0.0 when nobody waits.

        Within a priority the queue is FIFO, so its oldest live waiter is
        its first not cancelled; the figure is the oldest of those across
        the priorities (at least the head's wait, more when a less urgent
        waiter queued before the head). Not live, so stepped over: a waiter
        whose future is done (cancelled, its task not yet unwound: it stays
        queued until its task resumes, the loop's next turn, or the grant
        loop or a timeout drops it) and one whose event loop was closed
        under it (dropped by the pool's next call that looks at the queue).
        So neither holds the figure up.

        Safe from any thread, with no lock: it copies the priorities' queues
        in one C-level step, reads each queue by index (an entry the owner
        takes off meanwhile ends that queue's scan, or moves it to a younger
        entry) and reads futures' states, never changing anything. From
        another thread the figure may be a few operations apart from the
        queue's, and may then read a live waiter's younger neighbour, never
        a waiter that left long ago. O(priorities) but for the cancelled
        waiters not yet unwound, which it steps over.
        """
        if not self.count:
            return 0.0
        oldest: float | None = None
        for queue in list(self._queues.values()):  # one C-level copy
            i = 0
            while True:
                try:
                    waiter = queue[i]
                except IndexError:  # the end, or the owner emptied it meanwhile
                    break
                fut = waiter[1]
                if not fut.done() and not fut.get_loop().is_closed():
                    t0 = waiter[2]
                    if oldest is None or t0 < oldest:
                        oldest = t0
                    break
                i += 1
        if oldest is None:
            return 0.0
        return max(0.0, _perf_counter() - oldest)

    def by_priority(self) -> dict[int, int]:
        """Live waiters per priority, most urgent first: ``{priority: count}``,
        priorities with none left out. Not live, so not counted: a waiter
        cancelled whose task has not unwound yet, and one whose event loop
        was closed under it (``count`` still holds both). The owner's
        thread (it iterates the queues); O(waiters queued)."""
        counts: dict[int, int] = {}
        for prio in self._prios:
            n = 0
            for waiter in self._queues[prio]:
                fut = waiter[1]
                if not fut.done() and not fut.get_loop().is_closed():
                    n += 1
            if n:
                counts[prio] = n
        return counts

    def queued_through(self, priority: int) -> bool:
        """True while a live waiter of ``priority`` or a more urgent one
        queues: what a ``try_`` call at ``priority`` must not pass. Steps
        over waiters cancelled (their tasks not yet unwound); O(more urgent
        priorities) but for those. The owner's thread."""
        for prio in self._prios:
            if prio > priority:
                return False
            for waiter in self._queues[prio]:
                if not waiter[1].done():
                    return True
        return False

    def needs(self) -> list[Any]:
        """The needs of the queued waiters, in grant order (for tests and repr)."""
        return [w[0] for p in self._prios for w in self._queues[p] if not w[1].done()]

    def check_invariants(self) -> None:
        """Raise AssertionError unless the queues and their index agree."""
        queued = sum(len(q) for q in self._queues.values())
        dead = len(self._dead)
        if queued != self.count + dead:
            raise AssertionError(
                f"waiter count {self.count} != queued {queued - dead}"
                + (f" (besides {dead} dead)" if dead else "")
            )
        if self._dead and not self.count:
            raise AssertionError("only dead waiters are queued: they should be cleared")
        queued_futs = {w[1] for q in self._queues.values() for w in q}
        if not self._dead <= queued_futs:
            raise AssertionError("a dead waiter is not queued")
        if self._gone & queued_futs:
            raise AssertionError("a waiter taken off is still queued")
        if any(not fut.cancelled() for fut in self._dead):
            raise AssertionError("a dead waiter's future is not cancelled")
        if sorted(self._queues) != self._prios:
            raise AssertionError("priority index out of sync with the queues")
        figures = [*self.tiers.values(), *([] if self.other is None else [self.other])]
        if len(self.tiers) > MAX_PRIORITIES or (self.other is not None and not self.tiers):
            raise AssertionError(f"{len(self.tiers)} priorities kept apart, past the cap")
        for what in ("timeouts", "cancellations", "rejections", "unfittable"):
            total = getattr(self, what)
            per = sum(getattr(one, what) for one in figures)
            if per != total:
                raise AssertionError(f"{what}: {total} in all, {per} summed over the priorities")
        for queue in self._queues.values():
            if not queue:
                raise AssertionError("an empty priority queue is still indexed")
            for need, fut, *_ in queue:
                # A cancelled future stays queued until its task resumes and
                # dequeues it (legal); a granted or failed one never does.
                if fut.done() and not fut.cancelled():
                    raise AssertionError(f"a settled waiter is still queued: {need!r}")
