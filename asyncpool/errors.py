"""The exceptions raised by asyncpool.

Every error is a :class:`PoolError`, so ``except PoolError`` catches all of
them. Several also derive from the builtin that a caller would reach for
first: a bad size is a ``ValueError``, a closed pool a ``RuntimeError``.
A call that raises any of these has changed nothing in the pool, with
these exceptions, each documented where it happens: ``lease``'s exit frees
the rows its body did not free before raising :class:`DoubleFreeError` for
those it did; ``bind()`` and ``release_memory()`` return memory behind
completed fences to circulation before they refuse, and so may ``alloc``,
``admit`` and the calls that reclaim when short (a :class:`PoolBusyError` or
:class:`CapacityError` that follows a reclaim keeps it); and a queued waiter
failed by :class:`CapacityError` or :class:`PoolClosedError` holds
nothing.
"""

from __future__ import annotations

__all__ = [
    "AgreementError",
    "CapacityError",
    "DeviceError",
    "DoubleFreeError",
    "FenceError",
    "InvalidSlotError",
    "MemorySaverError",
    "PoolBusyError",
    "PoolClosedError",
    "PoolError",
    "WrongProcessError",
    "WrongThreadError",
]


class PoolError(Exception):
    """Base class of every error raised by asyncpool."""


class CapacityError(PoolError, ValueError):
    """A requested count of rows or pages can never be met.

    Not an int in ``1..capacity`` (pages: ``0..kv.capacity``), or more than
    the memory that is not quarantined: raised at once, rather than queued
    forever. A waiter already queued gets it too, when a fence that faults
    quarantines memory so that its request can no longer fit.
    """


class InvalidSlotError(PoolError, ValueError):
    """A row id passed to the pool is not one the caller may pass.

    Row 0 (reserved padding), ids outside ``1..size-1``, non-int ids, rows
    that are not allocated, and the same row twice in one call.
    """


class DoubleFreeError(InvalidSlotError):
    """A row was freed that is already free or waiting behind a fence."""


class PoolClosedError(PoolError, RuntimeError):
    """The pool was closed; allocation is no longer possible."""


class PoolBusyError(PoolError):
    """The pool refuses the call in its current state.

    ``max_waiters`` waiters already queue (load shedding);
    ``release_memory()`` while rows or pages are allocated;
    ``resume_memory()`` while a release still drains; ``bind()`` while
    anyone waits or anything is pending behind a fence; ``clear()`` of a
    ``KVPagePool`` that serves a row pool (``kv=``).
    """


class FenceError(PoolError):
    """A fence reported a fault (a faulted stream, or ``query()`` raised).

    Rows behind a faulted fence are quarantined: they never return to
    circulation, since the work that wrote them may have stopped anywhere.
    """


class MemorySaverError(PoolError, RuntimeError):
    """The torch-memory-saver region was asked for where it cannot work.

    It needs CUDA; on a machine without it, ``enable_memory_saver=True`` is
    refused with this error rather than silently ignored.
    """


class DeviceError(PoolError, RuntimeError):
    """The pool was asked for a device this process cannot use.

    ``device="cuda"`` where ``torch.cuda.is_available()`` is False is refused
    with this error at construction, instead of torch's ``AssertionError``.
    """


class WrongThreadError(PoolError, RuntimeError):
    """A pool was called from a thread other than the one that owns it.

    The pool is not thread-safe, like every asyncio object: call it from its
    event loop's thread, or hand work over with ``loop.call_soon_threadsafe``
    (``alloc_threadsafe`` / ``admit_threadsafe`` for a wait).
    """


class WrongProcessError(WrongThreadError):
    """A pool built in another process was called in a forked child.

    ``os.fork()`` (multiprocessing's ``"fork"`` start method) copies a pool
    but not its threads, its event loop's waiters or its fence watchers: in
    the child it would hang or lose rows. Build the pool in the process that
    uses it, after the fork (see :mod:`asyncpool.forks`). A
    :class:`WrongThreadError`, as a call from a thread of another process.
    """


class AgreementError(PoolError, RuntimeError):
    """Tensor-parallel replicas of a pool disagree about their state.

    Raised by ``agree(group)`` on every rank at once, changing nothing, when
    the ranks' pools hold different pending batches (or counts), or were
    built otherwise (``kv=`` on some ranks only): the ranks did not make the
    same pool calls in the same order, so their admission decisions have
    already diverged.
    """
