"""A thread that waits on fences with no callback of their own.

CUDA events (and fences of unknown origin) cannot call back into the event
loop. The watcher runs one daemon thread that ``synchronize()``s each fence
handed to it, in order, and then calls ``notify()`` (which must be
thread-safe: the pool passes a function that schedules its reclaim with
``loop.call_soon_threadsafe``, coalesced per burst). CUDA fences are recorded
with blocking events, so the thread sleeps in the driver instead of spinning.

Thread rules: :meth:`watch` and :meth:`stop` may be called from any thread;
``stop`` joins, and so waits for the fence being synchronized to complete.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from .fences import Fence

__all__ = ["FenceWatcher"]

logger = logging.getLogger(__name__)

_STOP = object()


class FenceWatcher:
    """Synchronize handed-over fences on a thread and notify after each."""

    def __init__(self, notify: Callable[[], None], name: str = "asyncpool-fence-watcher") -> None:
        self._notify = notify
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._name = name
        self._lock = threading.Lock()
        self._stopped = False
        self.watched = 0

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def watch(self, fence: Fence) -> None:
        """Synchronize ``fence`` on the watcher thread, then notify."""
        with self._lock:
            if self._stopped:
                raise RuntimeError("the fence watcher was stopped")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self.watched += 1
            self._queue.put(fence)

    def stop(self) -> None:
        """Stop the thread after the fences already handed over; join it."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            thread = self._thread
            self._queue.put(_STOP)
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _run(self) -> None:
        get = self._queue.get
        while True:
            fence = get()
            if fence is _STOP:
                return
            try:
                fence.synchronize()  # type: ignore[attr-defined]
            except Exception as exc:  # the pool's reclaim quarantines its rows
                logger.debug("watched fence %r faulted: %r", fence, exc)
            try:
                self._notify()
            except Exception:
                logger.exception("fence watcher notify failed")
