"""``await wait_fence(fence)``: a coroutine waits for fences, the loop runs on.

The pools wait for their own fences. A scheduler also waits for some itself:
the step whose outputs it must read before it builds the next batch, a
transfer it must see land. ``fence.synchronize()`` inside ``async def``
blocks the event loop for the whole wait (every other task, the pool's
waiters included, stands still), and ``run_in_executor(None,
fence.synchronize)`` leaves a thread of the default executor blocked for
ever on a fence that never completes (and the interpreter joins those
threads at exit). :func:`wait_fence` does neither:

* a :class:`~asyncpool.fences.HostFence` calls back into the loop when it
  completes (``add_done_callback``);
* a CUDA event or a fence of unknown origin (a transfer handle) is watched
  by a :class:`~asyncpool.watcher.FenceWatcher`, one per event loop, the
  threads the pools use: daemons, one per CUDA stream sleeping in the
  driver, one poller calling ``query()`` with a 50 µs to 1 ms backoff; none
  ever calls an unknown fence's ``synchronize()``, none keeps the process
  alive.

Knows nothing of pools.
"""

from __future__ import annotations

import asyncio
import os
import threading
import weakref
from collections.abc import Sequence
from typing import Any

from .errors import FenceError
from .fences import (
    CudaFence,
    Fence,
    Fences,
    HostFence,
    fence_list,
    is_done,
    is_fence,
    is_stream,
    stream_is_no_fence,
)
from .watcher import FenceWatcher

__all__ = ["wait_fence"]


async def wait_fence(fence: Fences) -> None:
    """Wait until ``fence`` completes, without blocking the event loop.

    ``fence`` may also be a sequence of fences (:data:`~asyncpool.Fences`,
    as ``fence=`` takes them: a step's fence and a transfer that reads the
    same memory): the wait ends when every one has completed, and raises
    what the first one in order that faults raises (the fences before it
    have completed; those after it are not asked). The sequence is checked
    before anything is waited for: an element that is not a fence is a
    ``TypeError`` naming its position, a set, an iterator or text a
    ``TypeError``; an empty sequence returns at once. A stream (a
    ``torch.Stream``, a ``HostStream``: :func:`~asyncpool.fences.is_stream`)
    is a ``TypeError`` too, alone or in a sequence: as a fence it would mean
    "once the stream is idle"; wait for ``record_fence(stream)`` instead.

    When it has completed already it returns after one pass of the event
    loop (``asyncio.sleep(0)``), not without suspending: an overlap
    loop whose only await is this wait for the step before lets the other
    tasks (an admission granted at hand-over) and the pool's wake-ups run
    each step even when the device finished that step first; so does an
    empty sequence, and a sequence whose fences had all completed. Raises what its ``query()``
    raises (:class:`~asyncpool.FenceError` for a faulted stream, a transfer
    handle's own error; a ``CancelledError``, ``StopIteration`` or
    ``StopAsyncIteration`` from ``query()``, which would pass for a
    cancellation or end the coroutine, becomes a ``FenceError`` chained to
    it) and ``TypeError`` for an object that is not a fence (no callable
    ``query()`` and ``synchronize()``) or whose ``query()`` answers
    something other than yes or no (see :func:`~asyncpool.fences.is_done`).

    Cancellation: cancelling the await (or an ``asyncio.timeout`` around it,
    the way to bound a wait on a fence that may never complete) stops the
    wait and nothing else: the fence is not touched, and nothing of the
    wait stays behind (its callback is removed, its fence no longer
    polled, unless another task waits for the same fence). A CUDA fence
    is the exception: once handed over it stays watched until it completes
    (a stream thread blocked in it cannot give it back), and a later wait
    for it is not handed over again.

    Thread rules: call it in a coroutine on a running loop. Any number of
    tasks may wait for the same fence.
    """
    if not is_fence(fence):
        if is_stream(fence):
            raise stream_is_no_fence(fence, "wait_fence() fence=")
        if isinstance(fence, Sequence) and not isinstance(fence, (str, bytes, bytearray)):
            suspended = False
            for one in fence_list(fence, "wait_fence() fence"):
                suspended = await _wait(one) or suspended
            if not suspended:
                await asyncio.sleep(0)  # the loop runs once, as below
            return
        raise TypeError(
            f"wait_fence() needs a fence (an object with query() and synchronize()) or "
            f"a sequence of fences, got {type(fence).__name__}"
        )
    if not await _wait(fence):
        # Completed already: still let the loop run once. An overlap loop's
        # only await is often this wait for the step before, which a fast
        # device has finished by then; returning without suspending would
        # starve every other task (an admission granted at hand-over never
        # resumes) and the pool's queued wake-ups, step after step.
        await asyncio.sleep(0)


async def _wait(fence: Fence) -> bool:
    """Wait for one fence (checked); True when it suspended, False when
    the fence had completed at the first ask."""
    done, error = _ask(fence)
    if error is not None:
        raise error
    if done:
        return False
    loop = asyncio.get_running_loop()
    if fence.__class__ is HostFence:
        await _wait_host(loop, fence)
    else:
        await _LoopWaits.of(loop).wait(fence)
    return True


async def _wait_host(loop: asyncio.AbstractEventLoop, fence: HostFence) -> None:
    """Wait for a host fence through its own completion callback.

    The callback holds the future, and through it the waiting task, as
    asyncio's own primitives hold their waiters: a task nobody else
    references still runs on once the fence completes.
    """
    done: asyncio.Future[None] = loop.create_future()

    def settle() -> None:  # on the loop
        if not done.done():
            done.set_result(None)

    def on_done() -> None:  # on the stream's worker thread, or here when settled
        try:
            loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the loop is closed: nobody is left to wake
            pass

    fence.add_done_callback(on_done)
    try:
        await done
    finally:
        fence.remove_done_callback(on_done)
    fence.query()  # raises if the fence faulted


class _LoopWaits:
    """The waits of one event loop on fences with no callback of their own.

    Loop-thread state (``_waiting``) is touched on the loop only; the
    watcher's threads only call :meth:`_notify`, which schedules one
    :meth:`_check` per burst of completions.
    """

    _by_loop: dict[int, _LoopWaits] = {}
    _registry_lock = threading.Lock()

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        # Weak: a closed loop that nobody holds is collected, not kept by
        # the registry (or the watcher's threads) until another loop waits.
        self._loop_ref = weakref.ref(loop)
        # id(fence) -> the fence and the futures of the tasks waiting for
        # it. Held strongly, as asyncio's primitives hold their waiters: a
        # future's callbacks hold its task, so a task nobody else references
        # (fire and forget, or shielded past a timeout) still runs on.
        self._waiting: dict[int, tuple[Fence, list[asyncio.Future[None]]]] = {}
        # CUDA fences handed to the watcher and not yet seen done: a stream
        # thread cannot give one back (unwatch), so a wait given up and taken
        # up again must not hand it over twice. Held, so no id is reused.
        self._cuda_handed: dict[int, Fence] = {}
        self._scheduled = False  # a _check is queued on the loop
        self._watcher = FenceWatcher(self._notify, name="asyncpool-wait-fence", alive=self._open)

    def _open(self) -> bool:
        loop = self._loop_ref()
        return loop is not None and not loop.is_closed()

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> _LoopWaits:
        """The waits of ``loop``, made on its first wait (entries of closed
        loops are dropped then)."""
        key = id(loop)
        with cls._registry_lock:
            waits = cls._by_loop.get(key)
            if waits is None or waits._loop_ref() is not loop:
                for stale in [k for k, w in cls._by_loop.items() if not w._open()]:
                    cls._by_loop.pop(stale)._watcher.stop()
                waits = cls._by_loop[key] = cls(loop)
            return waits

    async def wait(self, fence: Fence) -> None:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        key = id(fence)
        cuda = fence.__class__ is CudaFence
        entry = self._waiting.get(key)
        if entry is None:
            if not cuda or key not in self._cuda_handed:
                self._watcher.watch(fence)
            if cuda:
                self._cuda_handed[key] = fence
            self._waiting[key] = (fence, [done])
        else:
            entry[1].append(done)
        try:
            await done
        finally:
            entry = self._waiting.get(key)
            if entry is not None and done in entry[1]:
                entry[1].remove(done)
                if not entry[1]:  # the last waiter gave up
                    del self._waiting[key]
                    if not cuda:  # a CUDA fence stays handed over (see above)
                        self._watcher.unwatch(fence)

    def _notify(self) -> None:  # on a watcher thread
        if self._scheduled:
            return
        self._scheduled = True
        loop = self._loop_ref()
        if loop is None:  # collected: nobody is left to wake
            return
        try:
            loop.call_soon_threadsafe(self._check)
        except RuntimeError:  # the loop is closed
            pass

    def _check(self) -> None:  # on the loop
        # Cleared before the fences are asked: a fence that completes while
        # this runs schedules another check instead of being lost.
        self._scheduled = False
        for key, cuda in list(self._cuda_handed.items()):
            if key not in self._waiting and _settled(cuda):
                del self._cuda_handed[key]  # the watcher is done with it
        for key, (fence, futures) in list(self._waiting.items()):
            done, error = _ask(fence)
            if not done:
                # Notified for another fence. A fence the poller dropped
                # (its query() raised there, not here) is watched again.
                if fence.__class__ is not CudaFence and not self._watcher.polling(fence):
                    self._watcher.watch(fence)
                continue
            del self._waiting[key]
            self._cuda_handed.pop(key, None)
            for fut in futures:
                if fut.done():
                    continue
                if error is None:
                    fut.set_result(None)
                else:
                    fut.set_exception(error)


def _after_fork_in_child() -> None:
    # The parent's loops cannot be waited on here, and a parent thread may
    # have held the registry's lock (asyncpool.forks).
    _LoopWaits._registry_lock = threading.Lock()
    _LoopWaits._by_loop = {}


os.register_at_fork(after_in_child=_after_fork_in_child)


def _ask(fence: Fence) -> tuple[bool, BaseException | None]:
    """``(done, error)`` from one ``fence.query()``: a query that raises is
    done with its error; one raising what no future (or ``await``) can carry
    (``StopIteration``, ``StopAsyncIteration``, ``CancelledError``, which
    would pass for the waiter's own cancellation) is a :class:`FenceError`.
    ``KeyboardInterrupt`` and ``SystemExit`` propagate."""
    try:
        return is_done(fence.query()), None
    except (StopIteration, StopAsyncIteration) as exc:
        return True, _fault(fence, exc)
    except Exception as exc:
        return True, exc
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # CancelledError from a query(): a fault
        return True, _fault(fence, exc)


def _fault(fence: Fence, exc: BaseException) -> FenceError:
    """A FenceError for a ``query()`` that raised what no future can carry."""
    error = FenceError(f"{fence!r}.query() raised {type(exc).__name__}")
    error.__cause__ = exc
    return error


def _settled(fence: Fence) -> bool:
    """Whether a CUDA fence's watcher thread is done with it (completed, or
    its query raises: faulted)."""
    try:
        return bool(fence.query())
    except Exception:
        return True


def _pending_waits(loop: Any) -> int:
    """How many fences ``loop``'s waits watch (for tests)."""
    waits = _LoopWaits._by_loop.get(id(loop))
    return 0 if waits is None or waits._loop_ref() is not loop else len(waits._waiting)
