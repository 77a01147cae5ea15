"""Threads that notice fence completions for fences with no callback of their own.

CUDA events and fences of unknown origin (a KV-transfer handle, anything with
``query()``/``synchronize()``) cannot call back into the event loop, so the
pool hands them to a :class:`FenceWatcher`, which calls ``notify()`` (it must
be thread-safe; the pool passes a function that schedules its reclaim with
``loop.call_soon_threadsafe``, coalesced per burst) soon after each completes.
``notify`` says only "some watched fence completed or faulted": the pool's
reclaim queries the fences itself, and quarantines the rows of a faulted one.

No fence may delay another fence's wake-up, and no fence may hold up
shutdown. Two kinds of thread, both daemons:

* **Stream threads, for** :class:`~asyncpool.fences.CudaFence`. Fences of one
  CUDA stream complete in record order, so one thread per stream with
  pending fences blocks in ``synchronize()`` on that stream's oldest fence
  (the events are recorded with ``blocking=True``: the thread sleeps in the
  driver, it does not spin), notifies, and moves to the next. A slow fence
  delays only the fences of its own stream, which could not have completed
  earlier anyway. A fence older than the one the thread is already blocked
  in (handed over out of record order) goes to the poller below instead.
  A thread with nothing to wait for exits after ``_STREAM_LINGER_S`` idle
  seconds, so streams used once cost no thread for long.
* **One poller, for every other fence.** A fence of unknown origin may take
  seconds or never complete, and its ``synchronize()`` cannot be
  interrupted, so the watcher never calls it: one thread polls every such
  fence's ``query()`` and sleeps between passes with an exponential backoff
  (``_POLL_MIN_S`` = 50 µs, doubling to ``_POLL_MAX_S`` = 1 ms while nothing
  completes, back to 50 µs after a completion or a new fence). With no
  fence to poll it exits after ``_STREAM_LINGER_S`` idle seconds, as a
  stream thread does, so a pool that is drained but never closed does not
  keep a thread. A fence that
  completes is therefore noticed within about 1 ms while up to a few
  hundred slow or stuck fences are watched. A pass costs about 0.2-0.5 µs per fence (one
  ``query()``); when it would cost more than ``_POLL_MAX_DUTY`` (5 %) of the
  time between passes, the sleep is stretched, so the passes never take
  more than about 5 % of a core, and thousands of stuck fences lengthen the
  wake-up delay instead. The thread's own wake-ups (about 900 a second at
  the 1 ms backoff) come on top: with 100 stuck fences watched the whole
  thread measured 3.7-6.2 % of a core (``python -m benchmarks --only wake``).

Owners: ``notify`` should hold its owner weakly (the pool's does), or the
threads keep the owner alive as long as a fence stays open; with
``alive=``, the threads end at their next look once it answers False (the
pool was collected), however many stuck fences they watch.

Thread rules: :meth:`~FenceWatcher.watch`, :meth:`~FenceWatcher.unwatch` and
:meth:`~FenceWatcher.stop` may be called from any thread and never block on
a fence. ``stop`` only signals; :meth:`~FenceWatcher.join` waits (bounded)
for the threads that are not inside a fence's ``synchronize()``. A stream
thread stuck in a CUDA event that never completes stays blocked, as a daemon:
it cannot keep the process alive.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

from . import forks
from .fences import CudaFence, Fence, is_done, use_device
from .naming import pool_log

__all__ = ["FenceWatcher"]

logger: logging.Logger = logging.getLogger(__name__)

#: Poller backoff: first sleep after a change, cap while nothing completes.
_POLL_MIN_S = 50e-6
_POLL_MAX_S = 1e-3
#: The poller sleeps at least (pass time) / this, so it stays under ~5 % CPU.
_POLL_MAX_DUTY = 0.05
#: The poller checks for stop() every this many queries within one pass.
_STOP_CHECK_EVERY = 64
#: An idle stream thread exits after this long with nothing to wait for.
_STREAM_LINGER_S = 1.0

_perf_counter = time.perf_counter


class _Stream:
    """The CUDA fences of one stream in ``seq`` order, and its thread."""

    __slots__ = ("busy", "cond", "fences", "key", "thread")

    def __init__(self, key: int, lock: threading.Lock) -> None:
        self.key = key
        self.fences: collections.deque[CudaFence] = collections.deque()
        self.cond = threading.Condition(lock)
        self.thread: threading.Thread | None = None
        self.busy = False  # inside fences[0].synchronize()


class FenceWatcher:
    """Notice completions of handed-over fences on daemon threads; notify after each.

    See the module docstring for the thread model. ``alive()``, when given,
    is asked (outside the lock) before each poller pass and after each
    stream fence; once it answers False the watcher stops itself.
    ``watched`` counts the fences handed over; ``polls`` the poller's
    passes (for tests and the CPU figure). ``pool_name``: the owning
    pool's name, which starts every line logged (None: the lines as they
    always were). ``keep_dropped``: keep the fences the poller lets go of
    in ``dropped`` for the owner, who must then take them
    (:meth:`take_dropped`) after each notify. ``device``: the CUDA device
    index of the owner's memory, which the poller makes current on its
    thread before it asks any fence (None: none is made current but a
    CUDA fence's own): a fence of unknown origin (a bare
    ``torch.cuda.Event``, a transfer engine's handle) asked from a new
    thread, which is on device 0, would create a CUDA context on GPU 0 in
    a process whose pool lives on another (``fences.use_device``).
    """

    def __init__(
        self,
        notify: Callable[[], None],
        name: str = "asyncpool-fence-watcher",
        *,
        alive: Callable[[], bool] | None = None,
        pool_name: str | None = None,
        keep_dropped: bool = False,
        device: int | None = None,
    ) -> None:
        self._notify = notify
        self._device = device
        self._keep_dropped = keep_dropped
        self._log = pool_log(logger, pool_name)
        # False once nobody is left to notify (the owning pool was collected):
        # the threads then end at their next look instead of asking fences
        # that may never complete for ever. Called outside the lock.
        self._alive = alive
        self._name = name
        self._lock = threading.Lock()
        self._stopped = False
        # Poller state, guarded by _lock; the poller queries outside it.
        self._polled: dict[int, Fence] = {}  # id(fence) -> fence
        self._poll_cond = threading.Condition(self._lock)
        self._kicked = False  # a fence was added: restart the backoff
        self._thread: threading.Thread | None = None  # the poller
        self._streams: dict[int, _Stream] = {}
        self.watched: int = 0
        self.polls: int = 0
        # Fences the poller dropped because their query() raised or gave an
        # answer that is not a yes or no (for tests and diagnostics; the owner
        # learns which through ``dropped``).
        self.faults: int = 0
        #: With ``keep_dropped``: the fences the poller let go of (answered
        #: done, or faulted) since the owner last took them
        #: (:meth:`take_dropped`), appended under
        #: the lock before the notify. A fence's answer may differ between
        #: the poller and the owner (a status poll that flakes, a handle
        #: that answers per thread): the owner asks each again and watches
        #: again those it still waits for. Emptied by :meth:`stop`.
        self.dropped: list[Fence] = []
        forks.track(self)  # forgets the parent's threads in a forked child

    def _after_fork_in_child(self, parent_pid: int) -> None:
        # asyncpool.forks: only the forking thread exists here, and a parent
        # thread may have held the lock. Renew the lock and its conditions
        # and forget the threads, so the next watch() starts new ones (they
        # then ask every fence still watched). Nothing is started here.
        lock = self._lock = threading.Lock()
        self._poll_cond = threading.Condition(lock)
        self._thread = None
        for stream in self._streams.values():
            stream.cond = threading.Condition(lock)
            stream.thread = None
            stream.busy = False

    def __repr__(self) -> str:
        state = "stopped" if self._stopped else "running"
        return (
            f"<FenceWatcher {state} polled={len(self._polled)} "
            f"streams={len(self._streams)} watched={self.watched}>"
        )

    @property
    def running(self) -> bool:
        """Whether any of the watcher's threads is alive."""
        return any(t.is_alive() for t in self._threads())

    @property
    def polled(self) -> int:
        """How many fences the poller is watching."""
        return len(self._polled)

    def watch(self, fence: Fence) -> None:
        """Notify once ``fence`` completes (or faults). Never blocks on it.

        Raises ``RuntimeError`` after :meth:`stop`.
        """
        with self._lock:
            if self._stopped:
                raise RuntimeError("the fence watcher was stopped")
            self.watched += 1
            if fence.__class__ is CudaFence:
                self._watch_ordered(fence)
            else:
                self._watch_polled(fence)

    def polling(self, fence: Fence) -> bool:
        """Whether the poller still watches ``fence`` (it drops a fence once
        its ``query()`` answered done or raised)."""
        with self._lock:
            return id(fence) in self._polled

    def rewatch(self, fences: list[Fence]) -> int:
        """Poll again each of ``fences`` (of unknown origin) that the poller
        no longer polls; return how many. One lock for the lot.

        Raises ``RuntimeError`` after :meth:`stop`.
        """
        again = 0
        with self._lock:
            if self._stopped:
                raise RuntimeError("the fence watcher was stopped")
            for fence in fences:
                if id(fence) not in self._polled:
                    self.watched += 1
                    self._watch_polled(fence)
                    again += 1
        return again

    def take_dropped(self) -> list[Fence]:
        """The fences the poller let go of since the last call (see
        ``dropped``), oldest first; they are no longer polled. An empty list
        without taking the lock when there are none: a fence dropped just
        after that look is followed by its own notify."""
        if not self.dropped:
            return []
        with self._lock:
            dropped, self.dropped = self.dropped, []
        return dropped

    def unwatch(self, fence: Fence) -> bool:
        """Stop polling ``fence`` (say, one an operator gave up on); True if it was.

        A CUDA fence a stream thread already waits on cannot be taken back.
        """
        with self._lock:
            return self._polled.pop(id(fence), None) is not None

    def stop(self) -> None:
        """Tell every thread to exit; return at once (never waits for a fence).

        Idle threads exit within microseconds; a stream thread blocked in a
        CUDA event's ``synchronize()`` exits when that returns (a daemon, it
        never keeps the process alive). Idempotent.
        """
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            self.dropped = []  # nobody will take them: keep no fence alive
            self._poll_cond.notify_all()
            for stream in self._streams.values():
                stream.cond.notify_all()

    @property
    def settled(self) -> bool:
        """After :meth:`stop`: whether every thread not blocked in a fence's
        ``synchronize()`` has exited (what :meth:`join` waits for), without
        waiting: an owner on an event loop polls it between awaits."""
        with self._lock:
            threads = [self._thread] if self._thread is not None else []
            threads += [s.thread for s in self._streams.values() if s.thread and not s.busy]
        return not any(t.is_alive() for t in threads if t is not threading.current_thread())

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the threads not blocked in a fence to exit.

        For after :meth:`stop`. Threads inside a fence's ``synchronize()`` are
        not waited for. Returns True when no thread of the watcher is alive.
        """
        deadline = _perf_counter() + timeout
        with self._lock:
            threads = [self._thread] if self._thread is not None else []
            threads += [s.thread for s in self._streams.values() if s.thread and not s.busy]
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - _perf_counter()))
        return not self.running

    # ------------------------------------------------------------ internals

    def _threads(self) -> list[threading.Thread]:
        with self._lock:
            threads = [self._thread] if self._thread is not None else []
            threads += [s.thread for s in self._streams.values() if s.thread is not None]
            return threads

    def _orphaned(self) -> bool:
        """True (and the watcher stopped) once ``alive()`` answers False."""
        if self._alive is None or self._alive():
            return False
        self.stop()
        return True

    def _fire(self) -> None:
        try:
            self._notify()
        except Exception:
            self._log.exception("fence watcher notify failed")

    def _watch_polled(self, fence: Fence) -> None:
        # Under _lock.
        self._polled[id(fence)] = fence
        self._kicked = True
        if self._thread is None:
            self._thread = threading.Thread(target=self._poll, name=self._name, daemon=True)
            self._thread.start()
        else:
            self._poll_cond.notify()

    def _watch_ordered(self, fence: CudaFence) -> None:
        # Under _lock. Keep the stream's fences in seq order (frees usually
        # arrive in it: scan from the tail), so the thread waits the oldest.
        key = fence.stream_key
        stream = self._streams.get(key)
        if stream is None:
            stream = self._streams[key] = _Stream(key, self._lock)
        fences = stream.fences
        if stream.busy and fences[0].seq > fence.seq:
            # Older than the fence the stream's thread is blocked in (handed
            # out of record order, or that newer one's waiter gave up): in
            # the queue it would be noticed only once the newer completes,
            # and never if that one never does. The poller asks it instead.
            self._watch_polled(fence)
            return
        index = len(fences)
        while index > (1 if stream.busy else 0) and fences[index - 1].seq > fence.seq:
            index -= 1
        fences.insert(index, fence)
        if stream.thread is None:
            stream.thread = threading.Thread(
                target=self._wait_stream,
                args=(stream,),
                name=f"{self._name}-stream-{key}",
                daemon=True,
            )
            stream.thread.start()
        else:
            stream.cond.notify()

    def _wait_stream(self, stream: _Stream) -> None:
        lock = self._lock
        fences = stream.fences
        device = -1  # none made current yet: a new thread is on device 0
        fence: CudaFence | None = None
        while True:
            with lock:
                while not fences and not self._stopped:
                    if not stream.cond.wait(_STREAM_LINGER_S) and not fences:
                        # Idle for a while: end; a later watch() starts anew.
                        if self._streams.get(stream.key) is stream:
                            del self._streams[stream.key]
                        stream.thread = None
                        return
                if self._stopped:
                    return
                fence = fences[0]
                stream.busy = True
            if fence.device_index != device:
                # Once per thread (a stream's fences share its device):
                # asked from device 0, the event would create a CUDA
                # context on GPU 0 (fences.use_device).
                device = fence.device_index
                use_device(device)
            try:
                fence.synchronize()
            except BaseException as exc:  # the pool's reclaim quarantines its rows
                # BaseException too: a CancelledError or SystemExit from a
                # fence must not end the thread that watches every other.
                self._log.debug("watched fence %r faulted: %r", fence, exc)
            with lock:
                stream.busy = False
                fences.popleft()
            fence = None  # not kept (its pooled event) while the thread idles
            if self._orphaned():
                return
            self._fire()

    def _poll(self) -> None:
        lock = self._lock
        cond = self._poll_cond
        polled = self._polled
        delay = _POLL_MIN_S
        sleep = 0.0
        device = -1  # the CUDA device made current here (see _wait_stream)
        fence: Fence | None = None
        if self._device is not None:
            # Before the first fence of unknown origin is asked (see the
            # class docstring); a CUDA fence makes its own device current.
            device = self._device
            use_device(device)
        while True:
            with lock:
                if sleep and not self._kicked and not self._stopped:
                    cond.wait(sleep)
                while not polled and not self._stopped:
                    if not cond.wait(_STREAM_LINGER_S) and not polled and not self._stopped:
                        # Idle for a while: end (the thread holds the pool
                        # through notify); a later watch() starts anew.
                        if self._thread is threading.current_thread():
                            self._thread = None
                        return
                if self._stopped:
                    return
                if self._kicked:
                    self._kicked = False
                    delay = _POLL_MIN_S
                fences = list(polled.values())
            if self._orphaned():
                return
            t0 = _perf_counter()
            done: list[Fence] = []
            faulted = 0
            for i, fence in enumerate(fences):
                if i % _STOP_CHECK_EVERY == _STOP_CHECK_EVERY - 1 and self._stopped:
                    return
                if isinstance(fence, CudaFence) and fence.device_index != device:
                    # One handed over out of record order (see _watch_ordered).
                    device = fence.device_index
                    use_device(device)
                try:
                    if is_done(fence.query()):
                        done.append(fence)
                except BaseException as exc:  # faulted: the pool's reclaim quarantines
                    # BaseException too (see _wait_stream): the poller serves
                    # every fence of unknown origin and must not end.
                    self._log.debug("watched fence %r faulted: %r", fence, exc)
                    done.append(fence)
                    faulted += 1
            cost = _perf_counter() - t0
            self.polls += 1
            if done:
                with lock:
                    for fence in done:
                        polled.pop(id(fence), None)
                    if self._keep_dropped and not self._stopped:
                        self.dropped.extend(done)
                    # Counted once they are off the poll list and before the
                    # notify: an owner that sees the count move (see rewatch)
                    # finds them dropped, whichever wake-up it runs in.
                    self.faults += faulted
                self._fire()
                delay = _POLL_MIN_S  # others may follow soon
            # Let go of this pass's fences before sleeping: held by these
            # locals, the last pass's fences (transfer handles with their
            # staging buffers, long reclaimed by the pool) stayed alive while
            # the poller idled, up to _STREAM_LINGER_S, or until its next pass.
            fences = done = []
            fence = None
            sleep = max(delay, cost / _POLL_MAX_DUTY)
            delay = min(delay * 2, _POLL_MAX_S)
