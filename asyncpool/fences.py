"""Fences: "has the stream run past this point yet?"

A fence is any object with ``query()`` (non-blocking: has it completed?
``True``/``False``, or an int 0/1 as C-extension transfer engines answer:
:data:`FenceAnswer`) and ``synchronize() -> None`` (block until it has). Two kinds are
built in, and both *know their stream and their place on it*, which is what
lets the ledger reclaim in O(completed) rather than O(pending):

* :class:`HostFence`, recorded on a :class:`HostStream`, the CPU stand-in for
  a CUDA stream (one worker thread running launched work in order);
* :class:`CudaFence`, a small wrapper around a pooled ``torch.cuda.Event``
  recorded on a ``torch.cuda.Stream``.

:func:`record_fence` records one of either kind on a stream. Any other object
with ``query()``/``synchronize()`` is accepted by the pool as a fence of
unknown origin and is polled in full.

Thread rules: a :class:`HostStream` may be used from any thread. Its
fences' ``query``/``synchronize``/``add_done_callback`` are thread-safe; done
callbacks run on the stream's worker thread (or on the caller's thread when
the fence had already completed) and must not block.
"""

from __future__ import annotations

import collections
import inspect
import itertools
import logging
import operator
import os
import queue
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import (
    TYPE_CHECKING,
    Any,
    NoReturn,
    Protocol,
    Self,
    SupportsIndex,
    TypeAlias,
    TypeGuard,
    runtime_checkable,
)

import numpy as np

from . import forks
from .errors import FenceError

if TYPE_CHECKING:
    import torch

__all__ = [
    "CudaFence",
    "Fence",
    "FenceAnswer",
    "Fences",
    "HostFence",
    "HostStream",
    "OrderedFence",
    "fence_list",
    "is_done",
    "new_stream_key",
    "record_fence",
]

logger: logging.Logger = logging.getLogger(__name__)

# Stream keys are ints shared by both stream kinds and by new_stream_key();
# each stream gets one the first time a fence is recorded on it. They start
# far from the small ints a caller might pick for a stream of its own.
_stream_keys = itertools.count(1 << 32)


def new_stream_key() -> int:
    """A stream key no other stream has: for an ordered fence of your own.

    Fences that share a ``stream_key`` are taken to complete in ``seq``
    order, so the pool waits only for the newest of them. A key a caller
    makes up may be one a :class:`HostStream` or a CUDA stream already uses,
    and then a fence of the caller's stream would be skipped for a newer
    fence of that other stream: memory handed out while the caller's
    transfer still writes. Take one key per stream from here. Thread-safe.
    """
    return next(_stream_keys)


#: What a fence's ``query()`` may be typed to return: the types whose
#: values :func:`is_done` can read as a yes or no. ``bool``; an int
#: (``SupportsIndex``: a plain ``int``, a numpy integer, an ``IntEnum``, a
#: tensor), as transfer engines written in C answer 0 or 1; a numpy bool;
#: an array or tensor of one element. The pool reads the *value*, never its
#: truthiness: only ``True``/``False``, 0 and 1 (or one such element) are
#: answers; any other int (a status code), like any other value, is a fault
#: of the fence at run time, whatever its static type.
FenceAnswer: TypeAlias = bool | SupportsIndex | np.bool_


@runtime_checkable
class Fence(Protocol):
    """The fence protocol: a point on some stream that completes once."""

    def query(self) -> FenceAnswer:
        """Answer at once whether the fence has completed; never blocks.

        ``True`` (or 1) once it has, ``False`` (or 0) while not: see
        :data:`FenceAnswer` (a handle typed ``-> int`` fits). Raises (for a
        faulted stream) instead of answering True.
        """
        ...

    def synchronize(self) -> None:
        """Block until the fence has completed; raise if it faulted."""
        ...


@runtime_checkable
class OrderedFence(Fence, Protocol):
    """A fence that knows its stream and its place on it.

    Fences with the same ``stream_key`` complete in ``seq`` order: when one
    has completed, so has every fence of that stream with a smaller ``seq``.
    Both must be ints. Take ``stream_key`` from :func:`new_stream_key`, one
    per stream: a key shared with another stream by accident lets the pool
    skip a fence that has not completed. Read-only members: a frozen
    dataclass or properties fit as well as plain attributes.
    """

    @property
    def stream_key(self) -> int: ...

    @property
    def seq(self) -> int: ...


_PENDING, _DONE, _FAULTED = 0, 1, 2


class HostFence:
    """A point on a :class:`HostStream`; completes when the worker reaches it.

    If work launched before the fence raised, the stream is faulted and the
    fence reports that fault: ``query()`` and ``synchronize()`` raise
    :class:`FenceError` (chained to the work's exception) instead of
    completing, as a CUDA event on a stream with a sticky error does.

    ``repr()`` and the fault name the stream by ``stream_name`` (the name
    its :class:`HostStream` was given, None for none) as well as by key, so
    an overdue or fault line says which stream (a pipeline's stage) is stuck.
    """

    __slots__ = (
        "_callbacks",
        "_error",
        "_event",
        "_lock",
        "_state",
        "seq",
        "stream_key",
        "stream_name",
    )

    def __init__(self, stream_key: int, seq: int, stream_name: str | None = None) -> None:
        self.stream_key: int = stream_key
        self.seq: int = seq
        self.stream_name: str | None = stream_name
        self._state = _PENDING
        self._error: BaseException | None = None
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], object]] | None = []

    def __repr__(self) -> str:
        state = ("pending", "done", "faulted")[self._state]
        return f"<HostFence stream={self._stream()} seq={self.seq} {state}>"

    def _stream(self) -> str:
        """The stream's key, and its name when it was given one."""
        name = self.stream_name
        return str(self.stream_key) if name is None else f"{self.stream_key} ({name!r})"

    def query(self) -> bool:
        """Return True when completed; raise :class:`FenceError` if faulted."""
        state = self._state
        if state == _DONE:
            return True
        if state == _FAULTED:
            raise self._fault()
        return False

    def synchronize(self) -> None:
        """Block the calling thread until the fence completes; raise
        :class:`FenceError` if it faulted."""
        self._event.wait()
        if self._state == _FAULTED:
            raise self._fault()

    def wait(self, timeout: float | None = None) -> bool:
        """Like :meth:`synchronize` with a timeout; False if it ran out.

        A timeout past what a thread can wait (``threading.TIMEOUT_MAX``:
        ``inf``, ``1e300``, ``10**30``) waits for ever, as ``None`` does.
        """
        try:
            forever = timeout is not None and timeout > threading.TIMEOUT_MAX
        except TypeError:  # not a number: threading says so, as before
            forever = False
        if forever:
            timeout = None
        if not self._event.wait(timeout):
            return False
        if self._state == _FAULTED:
            raise self._fault()
        return True

    @property
    def error(self) -> BaseException | None:
        """The exception that faulted the stream, or None."""
        return self._error

    def add_done_callback(self, fn: Callable[[], object]) -> None:
        """Call ``fn()`` once the fence completes or faults.

        Runs on the stream's worker thread, or at once on the caller's thread
        when the fence is already settled. ``fn`` must be quick and must not
        raise (an exception is logged and dropped).
        """
        with self._lock:
            callbacks = self._callbacks
            if callbacks is not None:
                callbacks.append(fn)
                return
        _run_callback(fn)

    def remove_done_callback(self, fn: Callable[[], object]) -> bool:
        """Forget ``fn`` if it is still waiting to run; True if it was.

        For a waiter that gives up (a timeout, a cancellation): without it,
        every wait on a fence that never completes would leave one callback
        behind.
        """
        with self._lock:
            callbacks = self._callbacks
            if callbacks is not None:
                for i, cb in enumerate(callbacks):
                    if cb is fn:
                        del callbacks[i]
                        return True
        return False

    @classmethod
    def _settled(
        cls, stream_key: int, seq: int, error: BaseException | None, stream_name: str | None = None
    ) -> HostFence:
        """A fence that is already complete (or faulted) when it is made."""
        fence = cls(stream_key, seq, stream_name)
        fence._callbacks = None
        if error is not None:
            fence._error = error
            fence._state = _FAULTED
        else:
            fence._state = _DONE
        fence._event.set()
        return fence

    def _settle(self, error: BaseException | None, stream: _Worker | None = None) -> None:
        # Called once, by the stream's worker thread.
        if error is not None:
            self._error = error
            self._state = _FAULTED
        else:
            self._state = _DONE
        # Counted done before waiters wake: once synchronize() returns, the
        # stream is idle and the next record() is complete at once.
        if stream is not None:
            stream.done += 1
        self._event.set()
        with self._lock:
            callbacks, self._callbacks = self._callbacks, None
        for fn in callbacks or ():
            _run_callback(fn, BaseException)

    def __reduce_ex__(self, protocol: SupportsIndex) -> NoReturn:
        forks.refuse_copy(self)

    def _fault(self) -> FenceError:
        err = FenceError(
            f"HostStream {self._stream()} faulted before fence {self.seq}: {self._error!r}; "
            "the fault is sticky (every later fence of this stream reports it, and what "
            "is freed behind one is quarantined): record on a new HostStream"
        )
        err.__cause__ = self._error
        return err


def _run_callback(fn: Callable[[], object], catch: type[BaseException] = Exception) -> None:
    # On a HostStream's worker ``catch`` is BaseException: nothing may stop
    # the thread, or a callback raising SystemExit would leave every later
    # fence of the stream unsettled and every callback behind it unrun.
    try:
        fn()
    except catch:
        logger.exception("fence done-callback %r raised", fn)


class _Closed:
    """Sentinel put on a HostStream's queue by close(), or once it is collected."""


_CLOSE = _Closed()


class _Worker:
    """What a :class:`HostStream`'s worker thread shares with the stream.

    The thread holds this, never the stream, so a stream dropped without
    ``close()`` can be collected; its finalizer then queues the close, and
    the worker ends after the work queued so far (as ``close()`` does,
    without the join). ``done`` counts the items the worker finished
    (written by the worker only; a fence counts once settled, before its
    done-callbacks run); ``error`` is the stream's sticky fault.
    """

    __slots__ = ("cancel", "done", "error", "name", "queue")

    def __init__(self, name: str) -> None:
        self.name = name
        self.queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.cancel = False
        self.error: BaseException | None = None
        self.done = 0

    def run(self) -> None:
        _on_worker.worker = True  # close() from here never joins (see close)
        get = self.queue.get
        while True:
            item = get()
            if item is _CLOSE:
                return
            if item.__class__ is HostFence:
                if self.cancel and self.error is None:
                    self.error = RuntimeError(f"{self.name} was closed with this fence queued")
                item._settle(self.error, self)  # counts itself done
                continue
            if self.error is None and not self.cancel:  # else: faulted or cancelled: skip
                fn, args = item
                try:
                    fn(*args)
                except BaseException as exc:  # a fault of the stream
                    # Kept for every later fence, with its traceback (where it
                    # raised), but not the finished frames' locals: the work's
                    # frame may hold the stream (a bound method of its owner,
                    # the stream as an argument), which would then never be
                    # collected, nor this worker end.
                    _clear_frames(exc)
                    self.error = exc
                    logger.error("%s faulted: work %r raised %r", self.name, fn, exc)
                # Drop the work before waiting for the next item: it may
                # hold what its caller has long let go of (the stream too).
                del fn, args
            # Last, after the item's effects (its fault included) are visible.
            self.done += 1
            del item


#: Set on every HostStream worker thread (see HostStream.close).
_on_worker = threading.local()

#: Code flags of frames that may be suspended, not finished (a generator or
#: coroutine paused at a yield): clearing one would close it.
_SUSPENDABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


def _clear_frames(exc: BaseException) -> None:
    """Drop the locals of the finished frames in ``exc``'s tracebacks and in
    those of the exceptions it chains (``__cause__``, ``__context__``, an
    exception group's members); the lines stay. Frames still running and
    those of generators or coroutines (which may only be paused: clearing
    would close them under their owner) are left as they are."""
    for err in chained(exc, members=True):
        tb = err.__traceback__
        while tb is not None:
            frame = tb.tb_frame
            if not frame.f_code.co_flags & _SUSPENDABLE:
                try:
                    frame.clear()
                except RuntimeError:  # still executing
                    pass
            tb = tb.tb_next


def chained(exc: BaseException, *, members: bool = False) -> Iterator[BaseException]:
    """``exc`` and every exception it chains (``__cause__``, ``__context__``,
    and with ``members`` an exception group's members), each once, cycles
    included."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        err = todo.pop()
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        yield err
        todo.extend((err.__cause__, err.__context__))
        if members and isinstance(err, BaseExceptionGroup):
            todo.extend(err.exceptions)


class HostStream:
    """A CPU stand-in for a CUDA stream: one worker thread, in-order work.

    ``launch(fn, *args)`` queues ``fn(*args)`` and returns at once; the
    worker runs launched work strictly in launch order. ``record()`` returns a
    :class:`HostFence` that completes when everything launched before it has
    run; on an idle stream (everything queued so far has already run) that
    fence is complete when ``record()`` returns, so ``free(after=stream)``
    defers nothing. Work that raises faults the stream (sticky, as a CUDA error is):
    later work is skipped and every later fence reports the fault.

    ``close()`` lets queued work finish (pass ``cancel_pending=True`` to drop
    it, faulting the fences still queued), then joins the worker. A stream is
    also a context manager that closes on exit. A stream dropped without
    ``close()`` is collected like a CUDA stream: its worker runs the work
    queued so far and ends (it holds the stream's state, not the stream).
    All methods are thread-safe.

    torch's intra-op thread count is per thread: work that runs torch ops on
    the worker may want ``stream.launch(torch.set_num_threads, 1)`` first, so
    it does not fight the event loop's thread for the cores.

    Made before ``os.fork()``, a stream refuses new work in the child (its
    worker exists only in the parent; ``RuntimeError``) and its fences
    still pending there fault (:mod:`asyncpool.forks`); pickling or copying
    it is a ``TypeError``.
    """

    def __init__(self, name: str | None = None) -> None:
        self.key: int = next(_stream_keys)
        self.name: str = name or f"host-stream-{self.key}"
        self._fence_name: str | None = name or None  # what its fences' repr() names
        self._worker = worker = _Worker(self.name)
        self._queue = worker.queue
        self._seq = 0
        self._lock = threading.Lock()
        self._closed = False
        # Items put on the queue (under _lock); the worker counts those it
        # finished in ``worker.done``. Equal under _lock means the stream is
        # idle: nothing launched or recorded is still to run.
        self._queued = 0
        self._thread = threading.Thread(target=worker.run, name=self.name, daemon=True)
        self._thread.start()
        # Dropped without close(): end the worker after the queued work.
        # SimpleQueue.put may run inside a finalizer (it is reentrant).
        weakref.finalize(self, worker.queue.put, _CLOSE)
        forks.track(self)  # refused in a forked child (asyncpool.forks)

    #: The pid of the process the stream was made in, once it finds itself
    #: in a forked child (None in its own process).
    _forked_from: int | None = None

    def _after_fork_in_child(self, parent_pid: int) -> None:
        # The worker thread does not exist here, and a parent thread may have
        # held the lock: renew it, refuse new work as closed (the check every
        # launch and record already makes), and fault the fences still queued
        # (they would never complete). Their done-callbacks are the parent's
        # (its pools' wake-ups): dropped, not run. Only this thread exists.
        if self._forked_from is None:  # a grandchild names the maker too
            self._forked_from = parent_pid
        self._lock = threading.Lock()
        self._closed = True
        error = RuntimeError(
            f"{self.name} was made in process {self._forked_from}; its worker thread does not "
            f"exist in this forked child (process {os.getpid()})"
        )
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item.__class__ is HostFence and item._state == _PENDING:
                item._lock = threading.Lock()
                item._callbacks = None
                item._error = error
                item._state = _FAULTED
                item._event = threading.Event()
                item._event.set()

    def __reduce_ex__(self, protocol: SupportsIndex) -> NoReturn:
        forks.refuse_copy(self)

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("faulted" if self._worker.error else "open")
        return f"<HostStream {self.name} {state} fences={self._seq}>"

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def error(self) -> BaseException | None:
        """The exception that faulted the stream, or None."""
        return self._worker.error

    @property
    def _done(self) -> int:
        """Items the worker has finished with (see ``_queued``)."""
        return self._worker.done

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._closed

    def launch(self, fn: Callable[..., object], *args: object) -> None:
        """Queue ``fn(*args)`` to run on the worker after earlier work.

        ``TypeError`` for an ``fn`` that is not callable, queueing nothing
        (as ``loop.call_soon`` does): on the worker it would fault the
        stream for good. ``RuntimeError`` on a closed stream.
        """
        if not callable(fn):
            raise TypeError(
                f"launch() needs a callable, got {fn!r} of type {type(fn).__name__}: "
                "run on the worker, it would fault the stream"
            )
        with self._lock:
            self._check_open()
            self._queued += 1
            self._queue.put((fn, args))

    def record(self) -> HostFence:
        """Record a fence after all work launched so far.

        If everything launched or recorded before this call has already run,
        the fence is returned complete (or faulted, on a faulted stream)
        without a trip through the worker. Work launched concurrently from
        another thread is either ordered before this call (and covered by
        the fence) or after it; ``launch`` and ``record`` take the same lock.
        ``RuntimeError`` on a closed stream.
        """
        with self._lock:
            self._check_open()
            self._seq += 1
            worker = self._worker
            if worker.done == self._queued:
                # Idle: the worker has finished every item queued so far, so
                # the fence's point on the stream is already behind it.
                return HostFence._settled(self.key, self._seq, worker.error, self._fence_name)
            fence = HostFence(self.key, self._seq, self._fence_name)
            self._queued += 1
            self._queue.put(fence)
        return fence

    def wait(self, fence: Fence) -> None:
        """Make later work on this stream wait for ``fence`` (cross-stream order).

        If ``fence`` faults, this stream faults too, for good (the fault is
        sticky: what is freed behind its later fences is quarantined), so
        before making a stream that serves many requests wait for a
        transfer handle that may fail, ask the handle (``query()``) and
        launch the work once it has landed. ``TypeError``, queueing
        nothing, for an object without a callable ``synchronize()`` and for
        a stream (this one or another; :func:`is_stream`): waiting for a
        stream would mean "until it is idle" when the wait *runs*, so
        ``s.wait(s)`` would stop ``s`` for ever and two streams that wait
        for each other would deadlock. Pass ``record_fence(other)`` (the
        work queued on it so far).
        """
        if is_stream(fence):
            raise TypeError(
                f"wait() got {fence!r:.120} of type {type(fence).__name__}, a stream, not a "
                "fence: waiting for it would mean until it is idle when the wait runs (for "
                "ever for the stream itself). To wait for the work queued on it so far, "
                "pass record_fence(stream)"
            )
        synchronize = getattr(fence, "synchronize", None)
        if not callable(synchronize):
            raise TypeError(
                f"wait() needs a fence (an object with a callable synchronize()), got "
                f"{fence!r} of type {type(fence).__name__}"
            )
        self.launch(synchronize)

    def synchronize(self) -> None:
        """Block until all work launched so far has run; :class:`FenceError`
        if the stream faulted, ``RuntimeError`` if it is closed."""
        self.record().synchronize()

    def close(self, *, cancel_pending: bool = False) -> None:
        """Stop the worker after the queued work (or dropping it); idempotent.

        Joins the worker, so it returns only once the work running now has
        returned (a second ``close()`` too), also with
        ``cancel_pending=True`` (a thread cannot be interrupted); called on
        a stream's worker thread (work, or a fence callback, of this stream
        or another) it does not wait, since that worker may be what this one
        waits for: a stream blocked in work that never returns (a
        ``wait`` on a fence that never completes) never closes. Queued work
        is then never started, and the worker, a daemon thread, does not
        keep the process alive.
        """
        with self._lock:
            if not self._closed:
                self._closed = True
                self._worker.cancel = cancel_pending
                self._queue.put(_CLOSE)
        # Joined by every caller, also one that finds the stream closed
        # already (a second close() returns only once the worker ended, as
        # the first does), except on a stream's worker thread (this one's, or
        # another's: work or a fence callback there waiting for a worker
        # that may wait for that very stream would deadlock them).
        if not getattr(_on_worker, "worker", False):
            self._thread.join()

    def _check_open(self) -> None:
        if self._closed:
            if self._forked_from is not None:
                raise RuntimeError(
                    f"{self.name} was made in process {self._forked_from} and this is a "
                    f"forked child of it (process {os.getpid()}): its worker thread exists "
                    "only there. Make streams (and pools) in the process that uses them, "
                    "after the fork"
                )
            raise RuntimeError(f"{self.name} is closed; no more work can be launched")


class _EventPool:
    """A free list of ``torch.cuda.Event`` objects, per device.

    Creating CUDA events costs a driver call; PyTorch's allocator pools them
    and so do we. An event returns to the pool only when the
    :class:`CudaFence` wrapping it is garbage-collected, so an event that any
    waiter, ledger entry or user still holds is never re-recorded.
    """

    def __init__(self) -> None:
        self._free: dict[int, collections.deque[torch.cuda.Event]] = collections.defaultdict(
            collections.deque
        )
        self.created = 0

    def take(self, device_index: int) -> torch.cuda.Event:
        free = self._free[device_index]
        try:
            return free.pop()
        except IndexError:
            import torch

            self.created += 1
            # blocking=True: synchronize() sleeps in the driver instead of
            # spinning a core, which is what the pool's watcher thread wants.
            return torch.cuda.Event(enable_timing=False, blocking=True)  # type: ignore[no-untyped-call]

    def give_back(self, device_index: int, event: torch.cuda.Event) -> None:
        self._free[device_index].append(event)


_event_pool = _EventPool()
# The stream key of each CUDA stream, and the last seq recorded on it.
#
# PyTorch's own streams (the default stream, the per-thread default and the
# streams of its fixed per-device pool: a few hundred per device at most)
# live as long as the process: keyed by (device, raw handle), and bounded
# by that pool. An external stream (``torch.cuda.ExternalStream``: NCCL's,
# TensorRT's, a transfer engine's) may be destroyed with work still queued
# on it, and its handle's value given to a new stream: keyed by handle, a
# fence of the new stream (seq 6) would pass for a later point of the old
# one, and once it completed the pool would take the old stream's open
# fence (seq 5) for done: memory handed out while that work still writes.
# So an external stream is keyed by its Python wrapper instead, while the
# wrapper lives (_cuda_external: id(wrapper) -> (weak reference, key)),
# and its seq goes with it: both are dropped when the wrapper is
# collected, so the three dicts hold PyTorch's streams and the live
# external wrappers, whatever comes and goes. One wrapper per stream
# lifetime keeps its fences ordered; a new wrapper each record gives each
# fence a key of its own (correct, each waited for alone).
_cuda_stream_keys: dict[tuple[int, int], int] = {}
_cuda_seqs: dict[int, int] = {}
_cuda_external: dict[int, tuple[weakref.ref[Any], int]] = {}
_cuda_lock = threading.Lock()


class CudaFence:
    """A pooled ``torch.cuda.Event`` recorded on a CUDA stream, with its place.

    Built by :func:`record_fence`; the event goes back to the pool when this
    wrapper is collected, never earlier.
    """

    __slots__ = ("_device_index", "event", "seq", "stream_key")

    def __init__(self, event: torch.cuda.Event, device_index: int, stream_key: int, seq: int):
        self.event: torch.cuda.Event = event
        self._device_index = device_index
        self.stream_key: int = stream_key
        self.seq: int = seq

    def __repr__(self) -> str:
        return f"<CudaFence stream={self.stream_key} seq={self.seq}>"

    def query(self) -> bool:
        """True once the event's work on its stream has completed; never blocks."""
        return bool(self.event.query())  # type: ignore[no-untyped-call]

    def synchronize(self) -> None:
        """Block the calling thread until the event's work has completed."""
        self.event.synchronize()

    @property
    def device_index(self) -> int:
        """The CUDA device of the stream the event was recorded on."""
        return self._device_index

    def __del__(self) -> None:
        try:
            _event_pool.give_back(self._device_index, self.event)
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


def use_device(device_index: int) -> None:
    """Make CUDA device ``device_index`` current on the calling thread; never raises.

    For the pool's own threads (the watcher's), before they ask a CUDA
    event anything. A new thread starts on device 0, and its first CUDA
    runtime call (``cudaEventSynchronize``, ``cudaEventQuery``) creates a
    primary context there, about 500 MiB of GPU 0, in a process whose pool
    lives on ``cuda:3`` (each rank of a tensor-parallel job, say, on a
    host where every process sees every GPU). A failure is logged: the
    fence is still asked, and a fault shows there.
    """
    try:
        import torch

        torch.cuda.set_device(device_index)
    except Exception as exc:
        logger.debug("could not make cuda:%d current on this thread: %r", device_index, exc)


def _record_cuda(stream: torch.cuda.Stream) -> CudaFence:
    device_index = stream.device.index or 0
    handle = int(stream.cuda_stream)
    with _cuda_lock:
        # An external stream's stream_id is its handle (a native one's is
        # a small packed index, the default stream's 0): see _cuda_external.
        if handle and stream.stream_id == handle:
            key = _external_key(stream)
        else:
            ident = (device_index, handle)
            known = _cuda_stream_keys.get(ident)
            if known is None:
                known = _cuda_stream_keys[ident] = next(_stream_keys)
            key = known
        seq = _cuda_seqs[key] = _cuda_seqs.get(key, 0) + 1
        event = _event_pool.take(device_index)
        event.record(stream)
    return CudaFence(event, device_index, key, seq)


def _external_key(stream: torch.cuda.Stream) -> int:
    """The stream key of external stream wrapper ``stream``, made at its
    first fence and forgotten (with its seq) once it is collected. Called
    under ``_cuda_lock``."""
    entry = _cuda_external.get(id(stream))
    if entry is not None and entry[0]() is stream:
        return entry[1]
    key = next(_stream_keys)
    wid = id(stream)

    def forget(ref: weakref.ref[Any]) -> None:
        # No lock: the collection may run inside _record_cuda on this
        # thread; each pop is atomic, and a wrapper being recorded on is
        # alive, so nothing else touches these two entries now.
        if _cuda_external.get(wid, (None,))[0] is ref:
            del _cuda_external[wid]
        _cuda_seqs.pop(key, None)

    _cuda_external[wid] = (weakref.ref(stream, forget), key)
    return key


def record_fence(stream: HostStream | torch.cuda.Stream | torch.Stream) -> OrderedFence:
    """Record a fence on ``stream`` after all work queued on it so far.

    A :class:`HostStream` gives a :class:`HostFence`; a ``torch.cuda.Stream``
    (or a ``torch.Stream`` of type ``cuda``) gives a :class:`CudaFence` around
    a pooled event. Both carry ``stream_key`` and ``seq``. Fences of one CUDA
    stream are ordered by the order of ``record_fence`` calls, so record from
    one thread per stream (the scheduler's), as a CUDA stream is used anyway.
    An external stream (``torch.cuda.ExternalStream``), whose handle may be
    destroyed and its value reused by a new stream, is ordered per wrapper
    object: keep one wrapper per stream for as long as the stream lives (a
    wrapper made per record gives each fence a stream of its own: correct,
    each is waited for alone). The bookkeeping is bounded: PyTorch's own
    streams (a fixed per-device pool) and the external wrappers alive.
    ``TypeError`` for anything else; ``RuntimeError`` for a closed
    :class:`HostStream`.
    """
    if isinstance(stream, HostStream):
        return stream.record()
    if _is_cuda_stream(stream):
        import torch

        if not isinstance(stream, torch.cuda.Stream):
            stream = torch.cuda.Stream(  # type: ignore[no-untyped-call]
                stream_id=stream.stream_id,
                device_index=stream.device_index,
                device_type=stream.device_type,
            )
        return _record_cuda(stream)
    raise TypeError(
        f"record_fence() needs a HostStream or a CUDA stream, got {type(stream).__name__}"
    )


def _is_cuda_stream(obj: object) -> bool:
    """True for a ``torch.cuda.Stream`` (``ExternalStream`` included) or a
    ``torch.Stream`` on a CUDA device; not for any other object whose
    ``.device`` is CUDA (a CUDA tensor passed by mistake), which has no
    stream to record an event on."""
    import torch

    if isinstance(obj, torch.cuda.Stream):
        return True
    stream_cls = getattr(torch, "Stream", None)
    return (
        stream_cls is not None
        and isinstance(obj, stream_cls)
        and getattr(getattr(obj, "device", None), "type", None) == "cuda"
    )


def check_after(after: object) -> None:
    """Raise ``TypeError`` unless a fence can be recorded on ``after`` (a
    HostStream, a ``torch.cuda.Stream`` or a ``torch.Stream`` of type
    ``cuda``; an object that merely has a CUDA ``.device``, such as a CUDA
    tensor, is refused): the check of every ``after=`` parameter, made
    before anything changes. ``RuntimeError`` for a closed HostStream."""
    if isinstance(after, HostStream):
        if after.closed:
            raise RuntimeError(
                f"after= is {after.name}, a HostStream that is closed: no fence can be "
                "recorded on it, so nothing was freed"
            )
        return
    if not _is_cuda_stream(after):
        raise TypeError(
            f"after= must be a HostStream or a CUDA stream to record a fence on, "
            f"got {after!r} of type {type(after).__name__}"
        )


def is_fence(obj: object) -> TypeGuard[Fence]:
    """True if ``obj`` has callable ``query`` and ``synchronize`` and is
    neither a class (``fence=HostFence`` instead of a fence would fault when
    asked) nor a stream (:func:`is_stream`: as a fence, a stream would mean
    "once it is idle", which a busy forward stream may never be)."""
    cls = obj.__class__
    if cls is HostFence or cls is CudaFence:  # __slots__: nothing to override
        return True
    # is_stream() inlined, less its HostStream test (a HostStream has no
    # query()): a transfer handle, on the one-fence path of every free,
    # pays one attribute lookup that misses, not a call.
    return (
        callable(getattr(obj, "query", None))
        and callable(getattr(obj, "synchronize", None))
        and not isinstance(obj, type)
        and not (
            callable(getattr(obj, "wait_stream", None))
            and callable(getattr(obj, "record_event", None))
        )
    )


def is_stream(obj: object) -> bool:
    """True for a stream, which a ``fence=`` argument refuses: a
    :class:`HostStream`, or an object with callable ``wait_stream`` and
    ``record_event`` (``torch.Stream``, ``torch.cuda.Stream`` and
    ``ExternalStream``, the XPU and other device streams that follow
    torch's stream API). A torch stream has ``query()`` and
    ``synchronize()`` too, so it would pass as a fence of unknown origin
    that completes only when the stream is idle: memory held for as long as
    the stream stays busy, where the caller almost certainly meant the work
    queued on it so far (``after=stream``)."""
    if isinstance(obj, HostStream):
        return True
    return (
        callable(getattr(obj, "wait_stream", None))
        and callable(getattr(obj, "record_event", None))
        and not isinstance(obj, type)
    )


def stream_is_no_fence(value: object, label: str = "fence=") -> TypeError:
    """The ``TypeError`` for a stream passed where a fence is taken
    (``label``: where, as ``"fence="`` or ``"fence=[2]"``), saying what to
    pass instead."""
    return TypeError(
        f"{label} got {value!r:.120} of type {type(value).__name__}, a stream, not a "
        "fence: as a fence it would complete only once the stream is idle. To wait for "
        "the work queued on it so far, pass after=stream (free, kv.free, trim_pages: "
        "it records a fence on the stream now) or fence=record_fence(stream)"
    )


#: What a call that holds memory behind fences takes as ``fence=``: one
#: fence, or a sequence of fences (a list, a tuple, any other
#: ``collections.abc.Sequence`` but text and bytes): the memory waits for
#: every one of them; an empty one is no fence, as ``None``. Other
#: iterables are refused (``TypeError``): a set's order follows the fences'
#: ids, so replicas that make the same calls would pick different fences
#: to wait on first, and an iterator would be spent by the checks before
#: the pool read it.
Fences = Fence | Sequence[Fence]

#: Sequences that are not sequences of fences, refused whole (their
#: elements are characters or ints).
_NOT_FENCES = (str, bytes, bytearray, memoryview)


def fence_list(value: object, name: str = "fence") -> tuple[Fence, ...]:
    """The fences a ``fence=`` argument names, checked: ``()`` for None or
    an empty sequence, ``(value,)`` for one fence, else the elements of a
    sequence of fences (:data:`Fences`), in order.

    An object with ``query()`` and ``synchronize()`` is one fence, whatever
    else it is, but a stream (:func:`is_stream`): a ``TypeError`` that says
    to pass ``after=stream`` or ``record_fence(stream)``, for the value or
    an element. ``TypeError`` for anything else: an element that is not a
    fence is named by its position and value (``fence=[1]``), and a value
    that is neither a fence nor a sequence (a set, an iterator, text) by
    its value and type. Changes nothing, so a caller checks before it
    records or defers.
    """
    if value is None:
        return ()
    if is_fence(value):
        return (value,)
    if is_stream(value):
        raise stream_is_no_fence(value, f"{name}=")
    if not isinstance(value, Sequence) or isinstance(value, _NOT_FENCES):
        hint = ""
        if hasattr(value, "__iter__") and not isinstance(value, _NOT_FENCES):
            hint = (
                " (other iterables are refused: a set's order follows the fences' ids, "
                "an iterator is spent by the checks)"
            )
        raise TypeError(
            f"{name}= must be a fence (an object with query() and synchronize()) or a "
            f"sequence of fences (a list or tuple), got {value!r} of type "
            f"{type(value).__name__}{hint}"
        )
    for i, f in enumerate(value):
        if not is_fence(f):
            if is_stream(f):
                raise stream_is_no_fence(f, f"{name}=[{i}]")
            raise TypeError(
                f"{name}=[{i}] must be a fence (an object with query() and synchronize()), "
                f"got {f!r} of type {type(f).__name__}"
            )
    return tuple(value)


def fence_arg(value: object, name: str = "fence") -> Fence | tuple[Fence, ...] | None:
    """A ``fence=`` argument that is not one fence (the caller asked
    :func:`is_fence` first, the one-fence path's only check), as the
    ledgers take it: None for an empty sequence, its fence for one of one,
    else a tuple of two or more fences (the only tuple a ledger reads as
    several fences). ``TypeError`` as :func:`fence_list`."""
    fences = fence_list(value, name)
    if not fences:
        return None
    return fences[0] if len(fences) == 1 else fences


def is_done(answer: object) -> bool:
    """A fence's ``query()`` answer as a bool; ``TypeError`` if it is not yes or no.

    The answers taken: ``True`` and ``False``, numpy bools, the ints 0 and 1
    (anything ``operator.index`` takes but a bool: numpy integers, an
    ``IntEnum``), and an array or tensor of exactly one bool or integer 0
    or 1. Anything else is refused, truthy or not: an awaitable (an ``async
    def query``: a coroutine is truthy), a string (a status word such as
    ``"PENDING"``), any other int (a status code), ``None``, a float, a
    list, a dict, an array of several answers or of floats. Taken for
    "done", it would free memory a transfer may still write; taken for "not
    done", it would hold memory for ever. The pool treats a refused answer
    as a fault of the fence: the memory is quarantined, not freed.
    """
    if answer is True:
        return True
    if answer is False:
        return False
    if isinstance(answer, (str, bytes)) or hasattr(answer, "__await__"):
        close = getattr(answer, "close", None)
        if close is not None and hasattr(answer, "cr_frame"):
            close()  # a coroutine never awaited: no RuntimeWarning
        raise TypeError(
            f"query() answered {answer!r}, not True or False: a fence answers at once "
            "whether it has completed"
        )
    dtype = getattr(answer, "dtype", None)
    if dtype is not None:  # a numpy scalar, an array or a tensor
        value = _one_element(answer, dtype)
    else:
        try:
            value = operator.index(answer)  # type: ignore[arg-type]
        except Exception:
            raise TypeError(
                f"query() answered {answer!r:.80} of type {type(answer).__name__}, not "
                "True or False"
            ) from None
    if value.__class__ is bool:
        return bool(value)
    if value != 0 and value != 1:
        raise TypeError(f"query() answered {answer!r:.80}, not True or False (a status code?)")
    return value == 1


def _one_element(answer: Any, dtype: object) -> int | bool:
    """The one bool or integer of a numpy scalar, array or tensor answer;
    ``TypeError`` for any other."""
    numel = answer.numel() if callable(getattr(answer, "numel", None)) else answer.size
    kind = getattr(dtype, "kind", None)  # numpy: "b", "i", "u"
    if kind is None:
        name = str(dtype)  # torch
        kind = (
            "b"
            if name == "torch.bool"
            else "i"
            if name.startswith(("torch.int", "torch.uint"))
            else "?"
        )
    if numel != 1 or kind not in ("b", "i", "u"):
        raise TypeError(
            f"query() answered {answer!r:.80}, not True or False: an answer is one bool "
            f"or integer 0/1, not {numel} elements of {dtype}"
        )
    try:
        value = answer.item()
    except Exception as exc:  # a meta tensor: nothing to read
        raise TypeError(f"query() answered {answer!r:.80}, which holds no value") from exc
    assert isinstance(value, int)
    return value
