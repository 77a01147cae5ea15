"""What asyncpool's objects do across process boundaries (fork, spawn, pickle).

A pool is a live object: it is bound to a thread and an event loop, its
fences are watched by daemon threads, a :class:`~asyncpool.HostStream` runs
its work on a worker thread, and locks guard what those threads share.
``os.fork()`` (multiprocessing's ``"fork"`` start method, the default on
Linux before Python 3.14) copies the memory but not the threads: in the
child, a stream's worker and the watcher's poller do not exist, a lock a
parent thread held at the fork stays held, and the waiters queued in the
parent belong to the parent's event loop. Used there, a pool would hang
(a fence nobody watches), deadlock, or hand rows to waiters that do not
exist in the child. The rule: **build the pool (and its streams) in the
process that uses it, after the fork.**

So, registered with :func:`os.register_at_fork` (``after_in_child``), with
no cost on any call:

* an :class:`~asyncpool.AsyncReqToTokenPool` built before the fork refuses
  every call that changes it, or waits, in the child with
  :class:`~asyncpool.WrongProcessError` (a :class:`~asyncpool.WrongThreadError`):
  its owner becomes a thread id no thread has, so the check every such call
  already makes sends it to the refusal, and the unchecked fast paths stay
  closed; the counts (``available_size()``, ``stats()``, ...) still read
  the child's copy. Its ``kv=`` page pool refuses with it;
* a :class:`~asyncpool.HostStream` made before the fork refuses ``launch``,
  ``record``, ``wait`` and ``synchronize`` in the child with a
  ``RuntimeError`` that says so, and its fences still pending at the fork
  fault (:class:`~asyncpool.FenceError`) instead of never completing;
* a :class:`~asyncpool.watcher.FenceWatcher` forgets the parent's threads
  and renews its locks, so the process-wide one behind
  :func:`~asyncpool.wait_fence` starts a new thread at its next watch.

The synchronous :class:`~asyncpool.ReqToTokenPool` and a standalone
:class:`~asyncpool.KVPagePool` have no thread, loop or lock: their copy in
the child is an ordinary, consistent object (the parent's fences excepted).

Pickling or copying (``copy.copy``, ``copy.deepcopy``) a pool, a page pool,
a stream or a host fence raises ``TypeError`` naming this rule (spawn
pickles a process's arguments): pass the arguments to build one instead.
A shallow copy would share the ledgers behind two objects' fast-path caches
and a deep one the parent's threads and wake-ups. Values
(:class:`~asyncpool.Grant`, :class:`~asyncpool.PoolStats`) pickle.
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import Any, NoReturn, Protocol

__all__ = ["refuse_copy", "track"]

logger: logging.Logger = logging.getLogger(__name__)


class _ForkAware(Protocol):
    def _after_fork_in_child(self, parent_pid: int) -> None: ...


#: Every live object that must know it is now in a forked child.
_tracked: weakref.WeakSet[Any] = weakref.WeakSet()
#: The process the objects were made in (updated in each child).
_pid = os.getpid()


def track(obj: _ForkAware) -> None:
    """Have ``obj._after_fork_in_child(parent_pid)`` called in a forked child.

    At construction only (a ``WeakSet`` add): nothing on any per-call path.
    """
    _tracked.add(obj)


def _after_fork_in_child() -> None:
    # Only the thread that forked exists here: no lock of ours can be taken
    # safely (a parent thread may have held it), so each object renews its
    # own without taking the old ones. Nothing may raise out of this hook.
    global _pid
    parent, _pid = _pid, os.getpid()
    for obj in list(_tracked):
        try:
            obj._after_fork_in_child(parent)
        except Exception:  # pragma: no cover - a hook must never break fork
            logger.exception("asyncpool: %r could not prepare for the forked child", obj)


os.register_at_fork(after_in_child=_after_fork_in_child)


def refuse_copy(obj: object) -> NoReturn:
    """The ``TypeError`` of ``pickle``, ``copy.copy`` and ``copy.deepcopy``
    for a live object (a pool, a page pool, a stream, a fence)."""
    what = type(obj).__name__
    raise TypeError(
        f"{what} cannot be pickled or copied: it is a live object of this process "
        "(its threads, event loop, locks and fences cannot go with it). Build one in "
        "the process that uses it, after any fork, from the same arguments "
        "(multiprocessing 'spawn' pickles a process's arguments: pass those instead)"
    )
