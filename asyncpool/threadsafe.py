"""A wait on the pool's loop submitted from another thread, whose cancel never leaks.

``asyncio.run_coroutine_threadsafe(pool.admit(...), loop)`` loses memory when
the caller's ``cancel()`` races the grant: ``cancel()`` answers True once the
concurrent future is cancelled, but the task on the loop may already have
been granted its row (at once, on the fast path, or at hand-over); the
result is then dropped by asyncio, and nobody frees the row and its pages.

:func:`submit_wait` closes that window: the concurrent future stays pending
until the grant is delivered, and delivery takes the future's own lock
(``set_running_or_notify_cancel``). Either the caller's ``cancel()`` wins
(True: the queued wait is cancelled on the loop, or a grant that came first
is given back there, at once, never used) or the delivery does (``cancel()``
answers False and ``result()`` has the grant). Nothing else here knows rows
or pages: the pool passes the wait and how to give its result back.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["submit_wait"]

T = TypeVar("T")


def submit_wait(
    loop: asyncio.AbstractEventLoop,
    make: Callable[[], Coroutine[Any, Any, T]],
    give_back: Callable[[T], None],
) -> concurrent.futures.Future[T]:
    """Run ``make()`` as a task on ``loop``; answer a concurrent future of its result.

    Callable from any thread. ``cancel()`` on the future answers True while
    the result has not been delivered: the task is cancelled on the loop
    (``make()`` raising ``CancelledError`` there must have taken nothing),
    or, when its result came first, ``give_back(result)`` runs on the loop.
    An exception of ``make()`` is the future's; a ``CancelledError`` that
    the caller did not ask for (the loop shutting down) cancels the future.
    Raises ``RuntimeError`` at once when ``loop`` is closed; a loop that is
    not running runs the task when it runs again (bound your wait:
    ``future.result(timeout=...)``).
    """
    if loop.is_closed():
        raise RuntimeError("the pool's event loop is closed: bind() the pool in its new loop first")
    out: concurrent.futures.Future[T] = concurrent.futures.Future()
    loop.call_soon_threadsafe(_start, loop, out, make, give_back)
    return out


# The task and the future refer to each other only while the wait runs: the
# task's done callback holds the future until it has run (asyncio drops a
# task's callbacks when it ends), the future's holds the task through a list
# the task's end empties, and _run holds the future in a local it deletes
# before it raises. A task's CancelledError, or the future's error, keeps
# _run's frame in its traceback; a future held there, whose done callback
# held the task, made a cycle that kept the task, the future and the
# caller's frames until the cycle collector ran.


def _start(
    loop: asyncio.AbstractEventLoop,
    out: concurrent.futures.Future[T],
    make: Callable[[], Coroutine[Any, Any, T]],
    give_back: Callable[[T], None],
) -> None:
    if out.cancelled():
        return  # cancelled before the loop got to it: nothing asked, nothing taken
    task = loop.create_task(_run(out, make, give_back))
    running = [task]  # emptied when the task ends

    def task_done(t: asyncio.Task[None]) -> None:
        running.clear()
        if t.cancelled():
            out.cancel()  # nothing was delivered (a no-op when the caller cancelled)

    def out_done(fut: concurrent.futures.Future[T]) -> None:
        if fut.cancelled():
            for t in running[:]:  # empty once the task ended: nothing to cancel
                try:
                    loop.call_soon_threadsafe(t.cancel)  # a no-op once the task is done
                except RuntimeError:
                    pass  # the loop is closed: the task can never run again

    task.add_done_callback(task_done)
    out.add_done_callback(out_done)


async def _run(
    out: concurrent.futures.Future[T],
    make: Callable[[], Coroutine[Any, Any, T]],
    give_back: Callable[[T], None],
) -> None:
    try:
        result = await make()
    except asyncio.CancelledError:
        del out  # the error's traceback holds this frame (see above)
        raise  # asked for, or the loop's own: the task's done callback cancels `out`
    except BaseException as exc:
        if out.set_running_or_notify_cancel():
            out.set_exception(exc)
        del out
        if not isinstance(exc, Exception):
            raise
        return
    if out.set_running_or_notify_cancel():
        out.set_result(result)
    else:
        give_back(result)  # the caller cancelled after the grant: never used
