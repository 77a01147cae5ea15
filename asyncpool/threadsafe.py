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

    async def run() -> None:
        try:
            result = await make()
        except asyncio.CancelledError:
            raise  # asked for, or the loop's own: the task's done callback cancels `out`
        except BaseException as exc:
            if out.set_running_or_notify_cancel():
                out.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        if out.set_running_or_notify_cancel():
            out.set_result(result)
        else:
            give_back(result)  # the caller cancelled after the grant: never used

    def start() -> None:
        if out.cancelled():
            return  # cancelled before the loop got to it: nothing asked, nothing taken
        task = loop.create_task(run())

        def task_done(t: asyncio.Task[None]) -> None:
            if t.cancelled():
                out.cancel()  # nothing was delivered (a no-op when the caller cancelled)

        def out_done(fut: concurrent.futures.Future[T]) -> None:
            if fut.cancelled():
                try:
                    loop.call_soon_threadsafe(task.cancel)  # a no-op once the task is done
                except RuntimeError:
                    pass  # the loop is closed: the task can never run again

        task.add_done_callback(task_done)
        out.add_done_callback(out_done)

    loop.call_soon_threadsafe(start)
    return out
