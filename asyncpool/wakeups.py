"""A pool's fence wake-ups: completions reach the loop and serve the waiters.

A fence's completion is noticed off the loop's thread (a ``HostFence``'s
done callback, the :class:`~asyncpool.watcher.FenceWatcher`'s stream and
poller threads) and reaches the loop as one coalesced callback,
:meth:`FenceWakeups.on_fences_done`, which reclaims the pool's ledgers,
watches again the fences of unknown origin the poller let go of while they
still hold memory, and runs the grant loop. Nobody calls the pool for it.

Thread rules. The watcher's threads and the fences' callbacks call only
:meth:`FenceWakeups.fence_done_threadsafe` (through :attr:`notify`, which
holds this object weakly); it reads the pool's loop and the coalescing
flag and hands over with ``loop.call_soon_threadsafe``. Everything else
runs on the pool's loop thread: :meth:`watch` (from the ledgers' pending
hook), the wake-up and its retries and delayed re-watches (timer
callbacks, each keyed to the loop it was queued on: one on a loop the pool
has left does nothing), and the pool's calls on a loop move, a hand-over
and ``close``.

A ``query()`` that raises what is not an ``Exception`` inside the reclaim
leaves its batch as it was (the ledgers' rule); the wake-up still grants
what it reclaimed, logs the error once (``KeyboardInterrupt`` and
``SystemExit`` propagate, stopping the loop) and retries itself, 1 ms
doubling to 0.1 s, until a reclaim is not interrupted. A fence the poller
let go of that the reclaim finds still open is watched again: at once the
first time, then after 1 ms doubling to 10 ms each time it comes back so.

What it needs from the pool, passed in (:class:`FenceWakeups`' arguments):
the pool's loop and whether it is closed (read at each use), closing the
unchecked fast paths (``_fast``) before a reclaim, the reclaim of every
ledger, the grant loop, the ledgers themselves (only to ask which fences
they wait on) and the pool's log. It knows nothing of rows, pages,
tensors or admission, nor of the pool's thread binding: the pool decides
which loop it is on and tells this object when it moves.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from .deferral import Deferrals
from .fences import CudaFence, Fence, HostFence
from .naming import Log
from .watcher import FenceWatcher

__all__ = ["FenceWakeups"]

#: A fence wake-up whose reclaim a ``query()`` interrupted (it raised what is
#: not an ``Exception``) is retried after this, doubling while each retry is
#: interrupted again, up to the cap (see ``on_fences_done``).
_WAKE_RETRY_MIN_S = 1e-3
_WAKE_RETRY_MAX_S = 0.1
#: A fence the poller let go of (it answered done there, or raised) that the
#: wake-up's reclaim finds still open is watched again: at once the first
#: time, then after this, doubling to the cap each time it comes back so,
#: until it is no longer waited for (see ``_rewatch_dropped``).
_REWATCH_MIN_S = 1e-3
_REWATCH_MAX_S = 0.01
#: How many such fences' counts the pool remembers (by id, ints only); past
#: that it forgets them all, and each is watched again at once once more.
_BOUNCES_REMEMBERED = 1024
#: What a fence wake-up lets out: the loop must stop for these.
_STOPS = (KeyboardInterrupt, SystemExit)


class _Wake:
    """A pool's fence wake-up, as handed to fences and to its watcher.

    It holds the wake-ups weakly (they and their pool hold each other, and
    are collected together). A ``HostFence`` keeps its done callbacks until
    it completes, and the watcher's threads keep their ``notify`` while they
    run, so a strong reference would keep a pool that nothing else holds
    alive as long as any of its fences is open: for ever behind a fence that never completes
    (a stuck stream; a transfer whose peer died, with the poller waking a
    thousand times a second to ask it), closed, ``force_release``-d or not.
    A collected pool's wake-ups do nothing, and its watcher's threads end
    at their next look (:meth:`alive`). Like any asyncio object, a pool is
    kept alive by whoever uses it: the tasks that await it hold it (keep
    references to your tasks, as asyncio requires).
    """

    __slots__ = ("_wakeups",)

    def __init__(self, wakeups: FenceWakeups) -> None:
        self._wakeups = weakref.ref(wakeups)

    def __call__(self) -> None:
        wakeups = self._wakeups()
        if wakeups is not None:
            wakeups.fence_done_threadsafe()

    def alive(self) -> bool:
        """Whether the pool still exists (the watcher's threads end once not)."""
        return self._wakeups() is not None


def _retry_wake_of(wakeups_ref: weakref.ref[FenceWakeups], loop: Any) -> None:
    """A retried fence wake-up's timer callback, holding its pool weakly.
    One on a loop the pool has left (bind() to another thread) does nothing:
    it must not touch the pool from that thread (a retry queued on the new
    loop would be lost)."""
    wakeups = wakeups_ref()
    if wakeups is not None and wakeups._loop() is loop and wakeups._wake_retry is loop:
        wakeups._wake_retry = None
        wakeups.on_fences_done(loop)


def _rewatch_due_of(wakeups_ref: weakref.ref[FenceWakeups], loop: Any) -> None:
    """A delayed re-watch's timer callback, holding its pool weakly; one on
    a loop the pool has left does nothing (as :func:`_retry_wake_of`)."""
    wakeups = wakeups_ref()
    if wakeups is not None and wakeups._loop() is loop and wakeups._rewatch_timer is loop:
        wakeups._rewatch_timer = None
        wakeups._rewatch_due_now()


class FenceWakeups:
    """The fence wake-ups of one pool (see the module docstring).

    ``loop``: the pool's loop now, or None (read at each use: the pool
    moves). ``closed``: whether the pool is closed (no watcher is started
    then, no retry queued). ``close_fast_paths``: close the pool's
    unchecked fast paths; called before every reclaim, so that no unchecked
    call from another thread interleaves with it. ``reclaim``: reclaim every
    ledger of the pool. ``grant``: run the grant loop. ``ledgers``: the
    pool's ledgers, asked only which of the fences the poller let go of
    they still wait for (and which fences hold memory). ``log``: the pool's
    log (its lines, named as the pool's). ``device``: the index of the
    pool's CUDA device, made current on the watcher's poller thread
    (None off CUDA; see :class:`~asyncpool.watcher.FenceWatcher`).

    Loop thread only, but for :meth:`fence_done_threadsafe` (and
    :attr:`notify`, which calls it), which any thread may call.
    """

    def __init__(
        self,
        *,
        loop: Callable[[], asyncio.AbstractEventLoop | None],
        closed: Callable[[], bool],
        close_fast_paths: Callable[[], None],
        reclaim: Callable[[], object],
        grant: Callable[[], None],
        ledgers: Sequence[Deferrals[Any]],
        log: Log,
        pool_name: str | None = None,
        device: int | None = None,
    ) -> None:
        self._loop = loop
        self._device = device
        self._closed = closed
        self._close_fast_paths = close_fast_paths
        self._reclaim = reclaim
        self._grant = grant
        self._ledgers = tuple(ledgers)
        self._log = log
        self._pool_name = pool_name
        #: What fences and the watcher call back (holds this object weakly).
        self.notify: _Wake = _Wake(self)
        #: The watcher of fences without callbacks, started at the first
        #: such fence; None before, and after :meth:`close`.
        self.watcher: FenceWatcher | None = None
        # The loop a coalesced fence wake-up is queued on, or None. Keyed to
        # the loop: a wake-up queued on a loop that stopped without running
        # it must not suppress the wake-ups of the loop the pool moved to.
        self._wake_scheduled: asyncio.AbstractEventLoop | None = None
        # Fences the poller let go of that the reclaim found still open
        # (see _rewatch_dropped): how many times in a row each came back so
        # (by id), those waiting for a delayed re-watch, and the loop whose
        # timer will re-watch them (keyed as _wake_retry is).
        self._bounces: dict[int, int] = {}
        self._rewatch_due: list[Fence] = []
        self._rewatch_timer: asyncio.AbstractEventLoop | None = None
        # Fence wake-ups in a row whose reclaim a query() interrupted, and the
        # loop a retry of them is queued on (keyed as _wake_scheduled is).
        self._wake_raises = 0
        self._wake_retry: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------ the pool's calls

    def watch(self, fence: Fence) -> None:
        """Be told when ``fence`` completes: its done callback (a host
        fence), else the watcher, started at the first such fence (not on a
        closed pool: no thread close() would never stop; drain() still
        reclaims). Loop thread (the pool's pending hook)."""
        if fence.__class__ is HostFence:
            fence.add_done_callback(self.notify)
            return
        watcher = self.watcher
        if watcher is None:
            if self._closed():
                return  # no thread close() would never stop; drain() still reclaims
            # A named pool's threads carry its name (a process with several
            # pools runs a poller per pool: a thread dump tells them apart).
            name = "asyncpool-fence-watcher"
            if self._pool_name is not None:
                name = f"{name} {self._pool_name!r}"
            watcher = self.watcher = FenceWatcher(
                self.notify,
                name,
                alive=self.notify.alive,
                pool_name=self._pool_name,
                keep_dropped=True,
                device=self._device,
            )
        try:
            watcher.watch(fence)
        except RuntimeError:
            pass  # closed: drain() and calls into the pool still reclaim

    def unwatch(self, fences: Sequence[Fence]) -> None:
        """Stop asking ``fences`` (``force_release``: nothing waits on them)."""
        watcher = self.watcher
        if watcher is not None:
            for f in fences:
                watcher.unwatch(f)  # nothing waits on it: stop asking
                self._bounces.pop(id(f), None)  # a later fence may bear its id

    def close(self) -> FenceWatcher | None:
        """Stop the watcher (the pool closes) and return it, if any: the
        caller waits for its threads that are not inside a fence's
        ``synchronize()`` to exit (``settled``), without blocking its loop.
        Forgets the fences a delayed re-watch holds and the bounce counts:
        nothing re-watches on a closed pool."""
        watcher, self.watcher = self.watcher, None
        if watcher is not None:
            watcher.stop()
        # Nothing re-watches after this (no watcher is started on a closed
        # pool): the fences a delayed re-watch holds and every bounce count
        # would stay for the pool's life. The timer, if armed, finds none.
        self._rewatch_due = []
        self._bounces.clear()
        return watcher

    def handed_over(self) -> None:
        """The pool was handed to another thread (``bind()``) with nothing
        pending: nothing to wake."""
        self._wake_scheduled = None  # nothing is pending, so nothing to wake
        # Nor to retry: a retry timer left on the old loop finds the pool
        # moved and does nothing. Forget that loop (the note would keep it,
        # closed or not, alive) and the interrupted wake-ups it counted.
        self._wake_retry = None
        self._wake_raises = 0
        # Nor to re-watch: a delayed re-watch's timer on the old loop does
        # nothing, and the fences it held wait for nothing now. Forget them
        # (a CUDA event or a transfer handle kept alive for no one, until a
        # re-watch that may never come), that loop, and their bounce counts
        # (kept by id, which a fence of the new owner may bear: it would be
        # re-watched late, not at once).
        self._rewatch_timer = None
        self._rewatch_due = []
        self._bounces.clear()

    def left_loop(self) -> None:
        """The pool moved to another loop (set already): drop what is tied
        to the old one."""
        # A wake-up or a wake-up's retry queued there that may never run
        # (nor could: a timer there finds the pool moved). Dropped, not kept
        # until a retry is queued here: the note would keep the old loop
        # alive. _wake_raises stays: a wake-up below re-watches what the
        # poller let go of.
        self._wake_scheduled = None
        self._wake_retry = None
        self._rewatch_timer = None
        if self._rewatch_due:
            self._rewatch_due_now()  # their timer on the old loop does nothing

    def wake_soon(self, loop: asyncio.AbstractEventLoop) -> None:
        """Queue a wake-up on ``loop``, the pool's new loop, with memory
        pending: fences that completed while their wake-up went to the old
        loop (or to none) would wait for an unrelated call."""
        self._wake_scheduled = loop
        loop.call_soon(self.on_fences_done, loop)

    # ------------------------------------------------------------ the wake-up

    def fence_done_threadsafe(self) -> None:
        """A fence completed (any thread): queue one wake-up on the loop."""
        # Any thread. Coalesce a burst of completions into one loop callback.
        # Benign race: the flag is cleared before reclaim queries the fences,
        # and a fence is marked done before its callbacks run, so a completion
        # that sees the flag still set is seen by that reclaim. No loop bound
        # (set-up code, a bind() outside a loop): nothing to wake, and the
        # next call into the pool reclaims the fence.
        loop = self._loop()
        if loop is None or self._wake_scheduled is loop:
            return
        self._wake_scheduled = loop
        try:
            loop.call_soon_threadsafe(self.on_fences_done, loop)
        except RuntimeError:  # the loop is closed: nobody is left to wake
            self._wake_scheduled = None

    def on_fences_done(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """The fence wake-up: reclaim both ledgers, watch again what the
        poller let go of while the pool still waits for it, serve the waiters.

        ``loop``: the loop this wake-up was queued on. One the pool has left
        (stopped, then run again after a hand-over) does nothing: the pool
        may belong to another thread now, and its own loop is told.

        A ``query()`` that raises what is not an ``Exception`` (a transfer
        handle's ``CancelledError``, a ``KeyboardInterrupt``) interrupts the
        reclaim, leaving its batch as it was (the ledgers' rule), and the
        poller may already have let go of that fence (it answered True there,
        or raised). Nobody called the pool, so nobody would look again:
        :meth:`_wake_interrupted` serves the waiters with what the reclaim
        released before the raise and queues a retry of this wake-up (1 ms,
        doubling to 0.1 s while retries are interrupted too), which once a
        reclaim is no longer interrupted watches again every pending fence of
        unknown origin the poller let go of. The error is logged, not raised
        (no caller to raise it to), except ``KeyboardInterrupt`` and
        ``SystemExit``, which still leave the callback and stop the loop.
        So a handle that raises on every call costs a few reclaims a second
        (it is not polled meanwhile), never a loop of poller, wake-up and
        reclaim as fast as the threads can hand over.
        """
        if loop is not None and loop is not self._loop():
            return
        self._wake_scheduled = None
        self._close_fast_paths()  # no unchecked call may interleave with this one
        try:
            self._reclaim()
            watcher = self.watcher
            if watcher is not None and (self._wake_raises or watcher.dropped):
                self._rewatch_dropped(watcher)
            self._wake_raises = 0
            self._grant()
        except Exception:
            raise  # as before: the loop's exception handler reports it
        except BaseException as exc:
            self._wake_interrupted(exc)
            if isinstance(exc, _STOPS):
                raise

    def _wake_interrupted(self, exc: BaseException) -> None:
        # A query() raised ``exc`` (not an Exception) inside a fence wake-up:
        # see on_fences_done. The fences the poller let go of stay unwatched
        # until a retry's reclaim is no longer interrupted, so a handle that
        # raises on every call is not polled, dropped and reclaimed in a loop.
        self._wake_raises += 1
        raises = self._wake_raises
        try:
            # Rows or pages released before the raise. Its own reclaim (a
            # head that does not fit) may meet the same fence: the retry
            # covers that too.
            self._grant()
        except (Exception, *_STOPS):
            self._retry_wake_later(raises)
            raise
        except BaseException:
            pass  # the same kind of raise again: the retry below covers it
        self._retry_wake_later(raises)
        if isinstance(exc, _STOPS):
            return  # it propagates: no need to log it
        log = self._log
        if raises == 1:
            log.warning(
                "a fence's query() raised %r in the pool's background reclaim (a fence "
                "wake-up): the memory behind it stays pending, the waiters were served "
                "with what was reclaimed, and the wake-up is retried (at most every %g s) "
                "until a reclaim no longer raises",
                exc,
                _WAKE_RETRY_MAX_S,
                exc_info=exc,
            )
        elif not raises & (raises - 1):  # the 2nd, 4th, 8th ... in a row
            log.debug("the pool's background reclaim raised %r again (%d in a row)", exc, raises)

    def _retry_wake_later(self, raises: int) -> None:
        loop = self._loop()
        if self._closed() or loop is None or loop.is_closed() or self._wake_retry is loop:
            return  # closed: drain() and calls into the pool still reclaim
        delay = min(_WAKE_RETRY_MAX_S, _WAKE_RETRY_MIN_S * 2.0 ** min(raises - 1, 16))
        self._wake_retry = loop
        loop.call_later(delay, _retry_wake_of, weakref.ref(self), loop)

    # ------------------------------------------------------------ re-watching

    def _rewatch_dropped(self, watcher: FenceWatcher) -> None:
        """Watch again the fences the poller let go of that the pool still
        waits for; after the reclaim of a fence wake-up.

        The poller drops a fence once its ``query()`` answered done there,
        or raised (or answered neither yes nor no); the reclaim just now
        asked it again, released its memory (done) or quarantined it (it
        raised here too). One that answered "not done" here (a status poll
        that failed once, a handle that answers done and then not done)
        still holds memory: done and then not done is not done, so it is
        watched again, or its completion would wake nobody. At once the
        first time; a fence that comes back so again and again (its
        ``query()`` raises, or answers done, on the poller's thread and
        "not done" on the loop's) after ``_REWATCH_MIN_S``, doubling to
        ``_REWATCH_MAX_S``: watched again at once every time, it made a
        loop of poller, wake-up and reclaim as fast as the threads hand
        over. Its waiter is then served within about ``_REWATCH_MAX_S`` of
        it settling. O(fences dropped + the ledgers' side lists), the order
        of the reclaim itself.

        After wake-ups whose reclaim a ``query()`` interrupted
        (:meth:`on_fences_done`): every pending fence of unknown origin the
        poller let go of then, done there or not, at once.
        """
        dropped = watcher.take_dropped()
        if self._wake_raises:
            pending = [
                fence
                for fence in self._pending_fences()
                if fence.__class__ is not HostFence and fence.__class__ is not CudaFence
            ]
            if pending:
                self._rewatch(watcher, pending)
            return
        if not dropped:
            return
        again = self._waited_on(dropped)
        bounces = self._bounces
        if bounces or again:
            open_ids = {id(fence) for fence in again}
            for fence in dropped:
                if id(fence) not in open_ids:
                    bounces.pop(id(fence), None)  # settled: done, or quarantined
        if not again:
            return
        if len(bounces) + len(again) > _BOUNCES_REMEMBERED:
            bounces.clear()
        now: list[Fence] = []
        later: list[Fence] = []
        worst = 0
        for fence in again:
            n = bounces[id(fence)] = bounces.get(id(fence), 0) + 1
            if n == 1:
                now.append(fence)
            else:
                later.append(fence)
                worst = max(worst, n)
        if now:
            self._rewatch(watcher, now)
        if later:
            self._rewatch_later(later, worst)

    def _pending_fences(self) -> list[Fence]:
        """The fences holding memory, ledger by ledger (rows, then pages)."""
        fences: list[Fence] = []
        for led in self._ledgers:
            fences.extend(led.pending_fences())
        return fences

    def _waited_on(self, fences: list[Fence]) -> list[Fence]:
        """Those of ``fences`` that rows or pages wait for now (each once)."""
        found: list[Fence] = []
        for led in self._ledgers:
            if led.pending:
                found.extend(led.waiting_on(fences))
        if len(found) > 1:
            found = list({id(fence): fence for fence in found}.values())
        return found

    def _rewatch(self, watcher: FenceWatcher, fences: list[Fence]) -> None:
        try:
            watcher.rewatch(fences)
        except RuntimeError:  # stopped: the pool is closed (drain() reclaims)
            pass

    def _rewatch_later(self, fences: list[Fence], bounces: int) -> None:
        # Re-watch ``fences`` after a backoff for the ``bounces``-th time in a
        # row (see _rewatch_dropped); one timer for whatever waits.
        self._rewatch_due.extend(fences)
        loop = self._loop()
        if self._rewatch_timer is loop or loop is None or loop.is_closed():
            return
        delay = min(_REWATCH_MAX_S, _REWATCH_MIN_S * 2.0 ** min(bounces - 2, 16))
        self._rewatch_timer = loop
        loop.call_later(delay, _rewatch_due_of, weakref.ref(self), loop)

    def _rewatch_due_now(self) -> None:
        # The delayed re-watch: those of the fences it holds still waited for.
        fences, self._rewatch_due = self._rewatch_due, []
        watcher = self.watcher
        if watcher is None:
            # Gone (the pool closed): nothing re-watches these, so nothing
            # reads their counts again; kept, they stayed (by id) for the
            # pool's life, and a fence bearing one's id was re-watched late.
            bounces = self._bounces
            for fence in fences:
                bounces.pop(id(fence), None)
            return
        if fences:
            again = self._waited_on(fences)
            if len(again) < len(fences):
                # Settled meanwhile (reclaimed by a call into the pool): never
                # dropped by the poller again, so _rewatch_dropped would never
                # forget their counts, which stayed (by id) until the bulk
                # clear, and a later fence bearing the id of one was re-watched
                # late at its first bounce instead of at once.
                open_ids = {id(fence) for fence in again}
                bounces = self._bounces
                for fence in fences:
                    if id(fence) not in open_ids:
                        bounces.pop(id(fence), None)
            if again:
                self._rewatch(watcher, again)
