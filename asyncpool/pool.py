"""``AsyncReqToTokenPool``: awaitable, fence-safe allocation of request rows.

Allocation waits in bounded, prioritised FIFO queues; frees are deferred
behind fences; completed fences return rows to waiters without anyone
calling the pool. The design follows ``asyncio.Semaphore`` (CPython
``Lib/asyncio/locks.py``) with one change that removes its class of
lost-wake-up and queue-jumping bugs: **grant at hand-over**. Whoever makes
rows free (``free``, a completed fence, a cancelled or timed-out head,
``resume_memory``, the release of the last ``hold_grants()`` hold) runs the
grant loop, which takes the rows for the waiters
at the head of the queues and resolves their futures *with the rows*. A woken
waiter never re-checks and competes; ``try_alloc`` answers ``None`` while
anyone waits. With a :class:`~asyncpool.KVPagePool` (``kv=``), ``admit``
grants a request its row and its KV pages in one await, in the same queue.
The queues and the grant loop live in :mod:`asyncpool.waiters`; this class
supplies what a need means (rows; a row and pages) and composes the ledgers,
the tables, the waiters and the wake-ups.

Cancellation contract: if ``alloc`` raises (``CancelledError``,
``TimeoutError``, ``PoolClosedError``), nothing was allocated to the caller.
A waiter cancelled after its grant gives the rows back (to the head of the
free queue, clean) and re-runs the grant loop; a cancelled head that was not
granted re-runs it too, since smaller waiters behind it may now fit.

Wake-ups: a completed fence reaches the loop as the wake-up of
:mod:`asyncpool.wakeups` (a host fence's callback, the watcher's threads),
which reclaims both ledgers, watches again the fences of unknown origin the
poller let go of while they still hold memory, and runs the grant loop. A
``query()`` that raises what is not an ``Exception`` there leaves its batch
as it was (the ledgers' rule); the wake-up still grants what it reclaimed,
logs the error (``KeyboardInterrupt`` and ``SystemExit`` propagate,
stopping the loop) and retries itself with a backoff until a reclaim is not
interrupted (see ``FenceWakeups.on_fences_done``). The pool keeps the
ledgers' pending hook (``_on_pending``: which loop, the overdue timer) and
tells the wake-ups when it moves to another loop or thread; the wake-up
closes the ``_fast`` gate (below) before it reclaims.

Thread rules: the pool is loop-affine like every asyncio object. It binds to
the thread of the first call made *inside a running event loop* (and to that
loop); calls from another thread then raise :class:`WrongThreadError`,
changing nothing. Synchronous calls made while no loop runs (building and
warming a pool in a set-up thread) do not bind, so an engine may build the
pool in one thread and run its scheduler in another.
:meth:`AsyncReqToTokenPool.bind` hands a bound pool over explicitly.
A pool built before ``os.fork()`` refuses every checked call in the child
with :class:`WrongProcessError` (:mod:`asyncpool.forks`: build the pool in
the process that uses it, after the fork); pickling or copying it is a
``TypeError``.
Another thread submits waits with ``alloc_threadsafe`` / ``admit_threadsafe``
(a ``concurrent.futures.Future`` whose ``cancel()`` never loses a grant). Fence
completions on other threads reach the loop only through
``loop.call_soon_threadsafe``. A pool outlives its loop: a call from a new
running loop moves it there when its own loop is closed, or stopped with
nobody waiting on it, and so does a count read (``available_size``,
``pending_size``, ``quarantined_size``, ``stats``) on the owner's thread,
the only call a scheduler that sizes its batches by the counts may make
there; reads from other threads only read.

Like asyncio (whose ``call_soon`` checks the thread only in debug mode), the
two hottest paths do not ask which thread calls them: ``alloc(1)`` of a
clean row and ``free`` of one row with no fence while nobody waits. They
cannot corrupt the pool from a foreign thread either:

* each is straight-line code from its gate (``_fast``) to its commit, with
  no call in between, and on a GIL build of CPython 3.10+ a thread switches
  only at a call, a backward jump or a function entry; the row a fast
  ``alloc`` commits to is one that ``deque.popleft`` gave it alone;
* every checked call closes the gate before it reads the ledger, so no
  unchecked call can interleave with one (a reset in progress, a batched
  free, the grant loop); the gate is closed while anyone waits, so a fast
  ``free`` never runs the grant loop, and none can land between an
  ``alloc`` that found too little and its enqueue (a lost wake-up).

So a foreign call there completes as the owner's would have (only the
``peak_allocated`` statistic, updated after the commit, may then miss a
peak); everything else
(waiting, the grant loop, fences, pages, ``try_alloc``) raises
:class:`WrongThreadError`, changing nothing. In asyncio's debug mode (the
loop's ``get_debug()`` when the pool binds, ``PYTHONASYNCIODEBUG=1``,
``-X dev``), on a free-threaded build and with ``kv`` the gate never opens,
so every call from a foreign thread raises. ``tests/test_thread_interleavings.py``
runs a foreign call at every switch point of the owner's call in turn (a
profile hook sees them as ``call`` and ``c_return`` events), and
``tests/test_thread_fast_paths.py`` hammers the paths from two real threads
with a 1 us switch interval.

This module builds the pool and holds what the rules above are about: the
thread binding, ``alloc``/``try_alloc``/``free``/``record_use``/``lease``,
the thread-safe submissions and the grant loop's supply of rows. The rest
of the class is mixins with no state of their own, one job each:
:mod:`asyncpool.admission`, :mod:`asyncpool.growth`,
:mod:`asyncpool.give_back`, :mod:`asyncpool.lifecycle`,
:mod:`asyncpool.fence_control` (explicit reclaim, ``agree``,
``force_release``, the ledgers' pending hook and the overdue timer, the
fault hooks) and :mod:`asyncpool.figures` (the counts, ``stats``,
``overdue_fences``, ``check_invariants``).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import logging
import operator
import os
import sys
import threading
import weakref
from collections.abc import Mapping, Sequence
from types import MappingProxyType, TracebackType
from typing import Any, Self, SupportsIndex, overload

import torch

from . import forks
from .admission import Admission, Need
from .agreement import check_reclaim_mode
from .base import PoolCore, int_arg
from .base import check_wait_args as _check_wait_args
from .base import count_of as _count
from .deferral import Deferrals
from .errors import (
    CapacityError,
    DoubleFreeError,
    PoolBusyError,
    PoolClosedError,
    WrongProcessError,
    WrongThreadError,
)
from .fence_control import FenceControl
from .fences import Fence, Fences, HostStream, check_after
from .figures import Figures
from .give_back import GiveBack
from .growth import Growth
from .kv_pages import KVPagePool
from .ledger import ALLOCATED, FREE, USED, Rows, as_index, describe
from .lifecycle import GrantHold, Lifecycle
from .naming import check_name, repr_head
from .overdue import OverdueFences, check_fence_timeout
from .row_pages import Grant, GroupGrant, RowPages
from .tables import PoolInfo
from .threadsafe import submit_wait
from .waiters import WaiterQueues
from .wakeups import FenceWakeups
from .watcher import FenceWatcher

__all__ = ["AsyncReqToTokenPool", "Lease"]

logger: logging.Logger = logging.getLogger(__name__)

_get_ident = threading.get_ident
#: The owner of a pool in a forked child: no thread's ident (idents are >= 0).
_NO_THREAD = -1
_get_running_loop = asyncio.get_running_loop
_peek_running_loop = asyncio._get_running_loop  # None outside a loop; never raises

# The unchecked fast paths rely on the GIL's switch points (see the module
# docstring): closed on a free-threaded build, where every call is checked.
_GIL = bool(getattr(sys, "_is_gil_enabled", lambda: True)())


def _describe(need: Need, groups: Sequence[str] = ()) -> tuple[str, str]:
    """A need as (the call, what it asks for), for the waiter module's
    messages; ``groups`` names the KV groups in order (a grouped need holds
    one count per group, in that order), so the call reads as it was made:
    ``admit(pages={'swa': 2, 'full': 1})``."""
    if need.__class__ is int:
        assert isinstance(need, int)
        return f"alloc({need})", _count(need, "row")
    assert isinstance(need, tuple)
    k = need[1]
    if isinstance(k, tuple):  # KV groups: one count per group, in group order
        named = dict(zip(groups, k, strict=True))
        per_group = ", ".join(f"{_count(n, 'page')} of {name!r}" for name, n in named.items())
        return f"admit(pages={named})", f"1 row and {per_group}"
    return f"admit(pages={k})", f"1 row and {_count(k, 'page')}"


#: The most KV groups one pool takes (a mapping ``kv=``): a hybrid model's
#: sliding-window and full-attention pages, a Mamba state slot, one more.
MAX_KV_GROUPS = 4


def _closed_answer(message: str) -> concurrent.futures.Future[Any]:
    """A thread-safe submission's answer from a closed pool: a future that
    raises ``PoolClosedError(message)``, set here, on the caller's thread
    (closing is for good, so the answer needs no loop)."""
    answer: concurrent.futures.Future[Any] = concurrent.futures.Future()
    answer.set_exception(PoolClosedError(message))
    return answer


def _check_one_kv(kv: object, explicit: bool, what: str) -> None:
    """The rules for one page pool a pool is built with (``what`` names it)."""
    if not isinstance(kv, KVPagePool):
        raise TypeError(f"{what} must be a KVPagePool, got {type(kv).__name__}")
    if kv.ledger._on_pending is not None:
        raise ValueError(
            f"{kv!r} already serves a pool (for life, closed or not: its pages "
            "may still be held by that pool's rows and fences); give each pool "
            "its own"
        )
    if kv.ledger.explicit and not explicit:
        raise ValueError(
            f'{kv!r} is reclaim="explicit" and would never return pages to a '
            'reclaim="auto" pool; build both with the same mode'
        )
    if explicit and not kv.ledger.explicit and (kv.ledger.pending or kv.ledger.quarantined):
        raise ValueError(
            f'{kv!r} has pages behind fences; a reclaim="explicit" pool needs a '
            'fresh page pool (or one built with reclaim="explicit")'
        )


def _check_kv(kv: object, explicit: bool) -> dict[str, KVPagePool] | None:
    """The constructor's ``kv=`` checked before anything is built: the
    groups (name -> page pool, in the mapping's order) for a mapping, None
    for one page pool or none. ``TypeError``/``ValueError`` otherwise."""
    if kv is None:
        return None
    if not isinstance(kv, Mapping):
        if not isinstance(kv, KVPagePool):
            raise TypeError(
                "kv must be a KVPagePool (or a mapping of group names to KVPagePools), "
                f"got {type(kv).__name__}"
            )
        _check_one_kv(kv, explicit, "kv")
        return None
    groups: dict[str, KVPagePool] = {}
    for name, one in kv.items():
        try:
            checked = check_name(name)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"a KV group name: {exc}") from None
        assert checked is not None or name is None
        if checked is None:
            raise TypeError("a KV group name must be a str, got None")
        _check_one_kv(one, explicit, f"kv[{checked!r}]")
        for other, seen in groups.items():
            if seen is one:
                raise ValueError(
                    f"kv[{checked!r}] and kv[{other!r}] are the same KVPagePool; each "
                    "group needs its own"
                )
        if checked in groups:
            raise ValueError(f"the KV group name {checked!r} is given twice")
        groups[checked] = one
    if not 1 <= len(groups) <= MAX_KV_GROUPS:
        raise ValueError(
            f"kv as a mapping needs 1 to {MAX_KV_GROUPS} groups (name -> KVPagePool), "
            f"got {len(groups)}"
        )
    return groups


class AsyncReqToTokenPool(FenceControl, Figures, PoolCore, Admission, Growth, GiveBack, Lifecycle):
    """A request-row pool whose allocation is awaitable and fence-safe.

    Parameters
    ----------
    size, max_context_len, device, enable_memory_saver
        As the seed's ``ReqToTokenPool``; ``size - 1`` rows can be handed
        out (row 0 is reserved padding). ``enable_memory_saver=True`` needs
        CUDA and raises :class:`MemorySaverError` without it. Bounds and the
        devices refused: see :class:`~asyncpool.base.PoolCore`.
    stream
        The pool's stream: on CUDA, row resets are launched on it (a
        ``torch.cuda.Stream``). Off CUDA a ``HostStream`` or a torch stream
        is accepted and unused (resets run at once), so code shared with a
        GPU build passes its forward stream either way; anything else raises
        ``TypeError``.
    max_waiters
        At most this many ``alloc``/``admit`` calls may queue; one more raises
        :class:`PoolBusyError` at once (load shedding). ``None``: unbounded;
        otherwise an int >= 0 (``ValueError``).
    kv
        A :class:`KVPagePool` whose pages this pool hands out with its rows
        (:meth:`admit`); it then serves this pool only (``TypeError`` for
        anything else, ``ValueError`` for a page pool that already serves
        another). Without it the pool manages rows only, exactly as fast as
        before. For a hybrid model, a mapping of KV groups instead, group
        name -> :class:`KVPagePool` (1 to :data:`MAX_KV_GROUPS`, names as
        ``name=``, each a distinct page pool that serves no other, all in
        the pool's reclaim mode; ``TypeError``/``ValueError`` otherwise,
        nothing built): :meth:`admit` then takes ``{group: count}`` and
        grants a :class:`~asyncpool.GroupGrant`, all or nothing across the
        row and every group, and the per-row page calls take ``group=``.
        :attr:`kv` is None there; :attr:`kv_groups` maps the groups.
    fence_timeout
        Seconds after which a fence still holding rows or pages is
        *overdue*: logged once at WARNING and counted in :meth:`stats`; its
        memory stays held (see :meth:`force_release`). ``None``: never;
        otherwise a finite number > 0 (``ValueError``). With
        ``reclaim="explicit"`` a fence is overdue when :meth:`agree` finds
        it not done past the timeout on some rank, counted at the same call
        on every rank.
    reclaim
        ``"auto"`` (default): memory returns as soon as its fences complete
        (fence callbacks, watcher threads, reclaim inside ``alloc``).
        ``"explicit"``, for engines that run one scheduler replica per
        tensor-parallel rank: the pool never asks a fence whether it has
        completed; memory returns through :meth:`retire` (the scheduler has
        processed that step) and :meth:`agree` (a collective over the ranks
        for fences the scheduler does not observe), so ranks that make the
        same calls make the same grants. ``kv`` follows the pool's mode (a
        fresh ``"auto"`` page pool is switched to explicit). See
        docs/tp.md (the README's tensor-parallel section links it). Anything else: ``ValueError``.
    name
        Keyword only; None (the default) for none. A label for an engine
        that runs several pools (prefill and decode), shown in ``repr()``
        (``<AsyncReqToTokenPool 'decode' open size=...>``) and at the start
        of every line the pool logs, its ledger, overdue check, fence
        watcher and lifecycle included (``pool 'decode': fence ... is
        overdue ...``); without one the lines are as they always were. The
        ``kv=`` page pool's own fault lines carry that pool's name, or this
        pool's when it has none (an unnamed group's: ``'decode/swa'``). A
        non-empty ``str`` of at most 64 printable characters
        (no control characters or newlines, which could forge log lines):
        ``TypeError`` for a non-str, ``ValueError`` otherwise, nothing
        built. Read back as :attr:`name`; ``alloc``, ``free`` and ``admit``
        never read it. ``PoolCollector(pool)`` labels the pool with it.

    ``async with pool:`` returns the pool and calls :meth:`close` on exit.
    """

    def __init__(
        self,
        size: SupportsIndex,
        max_context_len: SupportsIndex,
        device: str | torch.device = "cpu",
        enable_memory_saver: bool = False,
        stream: HostStream | torch.Stream | None = None,
        max_waiters: SupportsIndex | None = None,
        kv: KVPagePool | Mapping[str, KVPagePool] | None = None,
        fence_timeout: float | None = None,
        *,
        reclaim: str = "auto",
        name: str | None = None,
    ) -> None:
        if max_waiters is not None and (max_waiters.__class__ is not int or max_waiters < 0):
            converted = int_arg(max_waiters)  # an IntEnum, a numpy int: as an int
            if converted is None or converted < 0:
                raise ValueError(
                    f"max_waiters must be None or an int >= 0, got {describe(max_waiters)}"
                )
            max_waiters = converted
        timeout_s = check_fence_timeout(fence_timeout)
        explicit = check_reclaim_mode(reclaim)
        groups = _check_kv(kv, explicit)
        super().__init__(size, max_context_len, device, enable_memory_saver, stream, name=name)
        led = self._ledger
        # Every page pool served (checked above: a KVPagePool or a mapping of them).
        kvs: list[KVPagePool] = [kv] if isinstance(kv, KVPagePool) else []
        if groups is not None:
            kvs = list(groups.values())
        if explicit:
            led.make_explicit()
            for one in kvs:
                if not one.ledger.explicit:
                    one.ledger.make_explicit()
        self._capacity = led.capacity
        self._take = led.take
        # The single-row fast paths of alloc() and free() below work on the
        # ledger's containers directly (a method call costs as much as the
        # whole operation); they keep the ledger's invariants exactly as
        # SlotLedger.take and SlotLedger.free do.
        self._free_q = led._free
        self._state = led._state
        self._gen = led._gen
        self._uses = led._uses
        # The bound of free()'s one-row fast path: 0 (never) with kv, where a
        # row may own pages, so that check costs rows-only pools nothing.
        self._rows_end = led.size if kv is None else 0
        assert ALLOCATED == 1 and FREE == 0 and USED == 6  # the literals in the fast paths
        self._owner: int | None = None
        self._owner_name = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        # Whether the unchecked fast paths may open (see the module
        # docstring): decided when the pool binds (_choose_fast_paths).
        self._unchecked = False
        # The waiter queues and the grant loop (asyncpool.waiters), gated
        # while closed, released or held (no fast path, no grants).
        # Two kinds of wait per priority: alloc's (0) and admit's (1).
        self._waiters = WaiterQueues(
            self._take_for_waiter,
            self._give_back,
            self._describe,
            max_waiters,
            supply=led._free,
            kinds=2,
            who=self._who,
        )
        self._closed = False
        self._released = False
        self._releasing: asyncio.Future[None] | None = None  # release_memory() draining
        self._holds = 0  # hold_grants() holds not yet released
        # The stopped fence watcher whose threads close() waits for, and the
        # deadline of that wait (every close() call shares it); None else.
        self._stopping: tuple[FenceWatcher, float] | None = None
        # The holds still held whose handle is alive (release_grant_holds ends
        # them); a hold collected while held leaves only its count in _holds.
        self._live_holds: weakref.WeakSet[GrantHold] = weakref.WeakSet()
        # True while the unchecked fast paths of alloc and free are open:
        # bound, nobody queued, not gated, unchecked paths allowed, and no
        # checked call under way. Every checked call clears it before it
        # reads the ledger (so no unchecked call from another thread can
        # interleave with it); a successful general alloc, and a checked
        # one-row free with nobody waiting, reopen it (stale False is only
        # slower).
        self._fast = False
        self._wait_times: collections.deque[float] = collections.deque(maxlen=4096)
        # Queued allocs' waits are histogrammed at grant, per priority
        # (self._waiters.figures(priority).histograms[0]); stats() sums them.
        # Allocs granted without queueing (zero waits), except those of the
        # two inlined single-row paths of alloc(): they are derived at stats
        # time (_zero_wait_allocs), so the hottest path counts nothing.
        self._fast_allocs = 0
        self._zero_waits_seen = 0  # the largest _zero_wait_allocs() reported
        self._unreset: list[int] = []  # granted rows whose reset is scheduled
        self._unwatched: list[Fence] = []  # deferred before any loop ran
        # Admission (kv=...): the pages each row owns, and the page ledger,
        # whose pending fences and frees wake waiters as the row ledger's do.
        # A single kv: _pages is its RowPages. KV groups (a mapping kv=):
        # _pages is None and _groups maps each name to its RowPages. Either
        # way _page_sets holds every RowPages (empty without kv): a test of
        # "has pages at all" reads it, never _pages.
        self._pages: RowPages | None = None
        self._groups: dict[str, RowPages] | None = None
        if groups is not None:
            self._groups = {
                name: RowPages(one, self.size, self._ledger) for name, one in groups.items()
            }
            for name, one in groups.items():
                if one.name is None:
                    # An unnamed group's page lines (a fault, a quarantine)
                    # would not say which group they are about: they carry
                    # the group's name, after this pool's ("decode/swa").
                    one.ledger.set_log_name(name if self._name is None else f"{self._name}/{name}")
            self._page_sets: tuple[RowPages, ...] = tuple(self._groups.values())
            # (name, RowPages, capacity) a group, in order: the grouped
            # admission's fast path reads it (Admission._admit_groups_fast).
            self._group_items: tuple[tuple[str, RowPages, int], ...] = tuple(
                (name, pages, pages.capacity) for name, pages in self._groups.items()
            )
        elif kv is not None:
            self._pages = RowPages(kvs[0], self.size, self._ledger)
            if kvs[0].name is None and self._name is not None:
                # An unnamed page pool's lines (a fault, a quarantine) would
                # not say whose pages they are about, where every row line
                # does: several named pools each with an unnamed kv= would log
                # page faults no operator could tell apart. They carry this
                # pool's name (as an unnamed group's carry "decode/swa").
                kvs[0].ledger.set_log_name(self._name)
            self._page_sets = (self._pages,)
            self._group_items = ()
        else:
            self._page_sets = ()
            self._group_items = ()
        ledgers: list[Deferrals[Any]] = [led, *(pages.ledger for pages in self._page_sets)]
        # The fence wake-ups (asyncpool.wakeups): what fences and the watcher
        # call back, the watcher itself, the coalesced wake-up and its retries.
        self._wakeups = FenceWakeups(
            loop=lambda: self._loop,
            closed=lambda: self._closed,
            close_fast_paths=self._close_fast_paths,
            reclaim=self._reclaim_both,
            grant=self._waiters.grant,
            ledgers=ledgers,
            log=self._log_to(logger),
            pool_name=self._name,
            device=self._tables.device.index if self._tables.device.type == "cuda" else None,
        )
        # stats().page_fence_errors counts a fence once, however many groups
        # it held pages in: each group's ledger counts it in its own
        # fence_errors, and a group's first count of a fence that another
        # group has counted (and remembers) is a repeat, subtracted from the
        # sum. _group_faults_seen: each group's fence_errors last seen.
        self._page_fault_repeats = 0
        # stats().growth_refusals counts a refused call once, however many
        # groups were short in it: each short group counts the call in its
        # own growth_refusals, and the counts past the first in one call are
        # repeats, subtracted from the sum (written before the groups' own
        # counts and read after them, so a scrape on another thread can only
        # read the figure short, never ahead of the truth).
        self._growth_refusal_repeats = 0
        self._group_faults_seen = [one.ledger.fence_errors for one in kvs]
        for i, one in enumerate(kvs):
            on_fault = (
                self._on_fault if groups is None else functools.partial(self._on_group_fault, i)
            )
            one.ledger.set_hooks(on_pending=self._on_pending, on_fault=on_fault)
            # The caller freed detached pages: run the grant loop. Only from
            # the pool's thread: the guard refuses any other.
            one.set_on_free(self._on_pages_freed, self._guard_kv)
        self._overdue: OverdueFences | None = None
        # Explicit mode without a timeout here: overdue is still what agree()
        # agreed (another rank's timeout, MAX over ranks), logged by agree()
        # and counted by stats() alike on every rank. Only counted: no timer.
        self._agreed_overdue: OverdueFences | None = None
        if timeout_s is not None:
            self._overdue = OverdueFences(timeout_s, ledgers, pool_name=self._name)
        elif explicit:
            self._agreed_overdue = OverdueFences(float("inf"), ledgers, pool_name=self._name)
        seen: set[int] = set()
        for one in kvs:
            if one.ledger.pending and not explicit:
                # Pages the page pool deferred before it was handed over were
                # announced to no hook: watch their fences as if freed now, or a
                # completion would wake no admission. Not in explicit mode: its
                # pool never asks a fence (retire() and agree() return memory).
                for fence in one.ledger.pending_fences():
                    if id(fence) not in seen:
                        seen.add(id(fence))
                        self._on_pending(fence)
        forks.track(self)  # refuses every checked call in a forked child

    #: The pid of the process the pool was built in, once it finds itself in
    #: a forked child (None in its own process): see :mod:`asyncpool.forks`.
    _forked_from: int | None = None

    def _after_fork_in_child(self, parent_pid: int) -> None:
        # os.register_at_fork (asyncpool.forks): the threads, waiters and loop
        # this pool knows are the parent's. An owner no thread has sends
        # every checked call to _bind_thread, which refuses; the unchecked
        # fast paths close for good (_unchecked never reopens them). No
        # per-call cost: those calls already compare the owner.
        if self._forked_from is None:  # a grandchild names the builder too
            self._forked_from = parent_pid
        self._owner = _NO_THREAD
        self._owner_name = f"a thread of process {self._forked_from}"
        self._unchecked = False
        self._fast = False

    def _refuse_forked(self) -> WrongProcessError:
        return WrongProcessError(
            f"{self._who()} was built in process {self._forked_from} and this is a forked "
            f"child of it (process {os.getpid()}): its fence watchers, stream threads and "
            "waiters exist only there. Build the pool in the process that uses it, after "
            "the fork (multiprocessing 'fork' or os.fork), or start workers with 'spawn'"
        )

    def __repr__(self) -> str:
        led = self._ledger
        if self._closed:
            state = "closed"
        elif self._releasing is not None:
            state = "releasing"
        else:
            state = "released" if self._released else "held" if self._holds else "open"
        return (
            f"{repr_head('AsyncReqToTokenPool', self._name)}{state} size={self.size} "
            f"free={led.free_count} "
            f"allocated={led.allocated} pending={led.pending} "
            f"quarantined={led.quarantined} waiters={self._waiters.count}>"
        )

    @property
    def kv(self) -> KVPagePool | None:
        """The :class:`KVPagePool` whose pages :meth:`admit` hands out, or None."""
        return self._pages.kv if self._pages is not None else None

    @property
    def kv_groups(self) -> Mapping[str, KVPagePool] | None:
        """The KV groups of a pool built with a mapping ``kv=``: a read-only
        mapping, group name -> :class:`KVPagePool`, in the order given; None
        for a pool built with one page pool (see :attr:`kv`) or none. On a
        grouped pool :attr:`kv` is None: no group is "the" page pool."""
        groups = self._groups
        if groups is None:
            return None
        return MappingProxyType({name: pages.kv for name, pages in groups.items()})

    async def __aenter__(self) -> Self:
        self._check_thread()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # ------------------------------------------------------------ affinity

    def _check_thread(self) -> None:
        # The prologue of every checked call: refuse a foreign thread, then
        # close the unchecked fast paths before reading the ledger. alloc,
        # admit and free inline it (their general paths are hot).
        if self._owner != _get_ident():
            self._bind_thread()
        self._fast = False  # no unchecked call may interleave with this one

    def _close_fast_paths(self) -> None:
        # For the fence wake-up (FenceWakeups), before it reclaims: as a
        # checked call's prologue, no unchecked call may interleave with it.
        self._fast = False

    def _guard_kv(self) -> None:
        # The KVPagePool's guard (set_on_free): _check_thread, with an error
        # that says why a page pool call is refused.
        try:
            self._check_thread()
        except WrongProcessError:
            raise
        except WrongThreadError as exc:
            raise WrongThreadError(
                f"this KVPagePool serves an AsyncReqToTokenPool, so it too may be "
                f"called only from that pool's thread: {exc}"
            ) from None

    def _who(self) -> str:
        """The pool in an error message: its class, and its name if it has
        one (a process with several pools, each on its own thread, must
        tell which one was called from the wrong thread)."""
        name = self._name
        return "AsyncReqToTokenPool" if name is None else f"AsyncReqToTokenPool {name!r}"

    def _bind_thread(self) -> None:
        # Off the fast path: the pool is unbound, or called from a thread
        # that does not own it (or from a forked child: _after_fork_in_child).
        if self._forked_from is not None:
            raise self._refuse_forked()
        ident = _get_ident()
        owner = self._owner
        if owner is None:
            try:
                loop = _get_running_loop()
            except RuntimeError:
                return  # set-up code outside any loop: do not bind
            if self._loop is None:
                self._loop = loop
            self._set_owner(loop)
            return
        if owner != ident:
            here = threading.current_thread().name
            raise WrongThreadError(
                f"{self._who()} is bound to thread {self._owner_name!r} (ident {owner}) "
                f"and was called from thread {here!r} (ident {ident}); call it from its own "
                "thread (loop.call_soon_threadsafe; alloc_threadsafe / admit_threadsafe for a "
                "wait), or hand it over with pool.bind() called in the new thread"
            )

    def bind(self) -> None:
        """Bind the pool to the calling thread and its running loop, if any.

        The explicit hand-off: build and warm a pool in one thread, then call
        ``bind()`` in the scheduler's thread (or in its event loop) before
        using it there. Without a running loop only the thread is bound; the
        first ``alloc`` that has to wait, fenced free or count read binds the
        loop, and until then every call is checked (the unchecked fast paths
        open only once the loop's debug flag is known). From then on, calls
        from any other thread raise :class:`WrongThreadError`, except on the
        two unchecked fast paths (``alloc(1)`` of a clean row, ``free(row)``
        or ``free([row])`` of one unfenced row while nobody waits; the
        module docstring says why a foreign call there is safe).

        The previous thread must have stopped calling the pool. Raises
        :class:`PoolBusyError` while an ``alloc`` or ``admit`` waits or a row
        or page is pending behind a fence (their wake-ups belong to the old
        loop); free or drain first. Fences that completed are reclaimed
        first, and waiters of a loop that was closed under them (their tasks
        can never resume) are dropped, not counted. A :meth:`hold_grants`
        hold carries over: the new thread releases it.

        :class:`WrongProcessError` in a forked child of the process that
        built the pool (:mod:`asyncpool.forks`): build one there instead.
        """
        if self._forked_from is not None:
            raise self._refuse_forked()
        self._drop_dead_waiters()
        self._reclaim_both()  # fences done while no loop could be told
        if self._waiters.count or self._pending_any():
            pages = sum(ps.ledger.pending for ps in self._page_sets)
            held = _count(self._ledger.pending, "row") + (
                f" and {_count(pages, 'page')}" if pages else ""
            )
            raise PoolBusyError(
                f"cannot bind the pool to thread {threading.current_thread().name!r} while "
                f"{_count(self._waiters.count, 'waiter')} queue and "
                f"{held} wait behind fences; "
                "let them finish (await pool.drain()) first"
            )
        # Fences deferred while no loop ran hold nothing now (nothing is
        # pending): none is left to watch.
        self._unwatched = []
        self._flush_resets()  # a flush queued on the old loop must not be needed
        try:
            self._loop = _get_running_loop()
        except RuntimeError:
            self._loop = None
        self._set_owner(self._loop)
        # Nothing is pending, so nothing to wake, nor to retry (a retry timer
        # left on the old loop finds the pool moved and does nothing).
        self._wakeups.handed_over()
        if self._overdue is not None:
            # A check armed on the old loop stays that loop's (not cancelled
            # from this thread): it finds the pool moved and does nothing.
            # Nothing is pending, so the next deferral arms one here.
            self._overdue.timer = None

    def _set_owner(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """Bind to the calling thread; open or close the unchecked fast paths."""
        self._owner = _get_ident()
        self._owner_name = threading.current_thread().name
        self._choose_fast_paths(loop)

    def _choose_fast_paths(self, loop: asyncio.AbstractEventLoop | None) -> None:
        # Open the unchecked fast paths only where they are safe and wanted:
        # a rows-only pool, a GIL build, asyncio not in debug mode. Bound
        # with no loop (bind() in set-up code), the pool stays checked until
        # a loop is attached (a wait, a fenced free, a count read): only
        # that loop's own flag says whether it runs in debug mode.
        self._fast = False
        self._unchecked = loop is not None and not self._page_sets and _GIL and not loop.get_debug()

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        return loop

    def set_req_pool_info(self, req_pool_idx: SupportsIndex, metadata: PoolInfo) -> None:
        """Write a row's lengths and token slots (for chunked prefill).

        From the pool's thread only (:class:`WrongThreadError` otherwise): it
        checks that the row is allocated, which another thread could change.
        """
        self._check_thread()
        super().set_req_pool_info(req_pool_idx, metadata)

    def write(self, indices: Any, values: Any) -> None:
        """``req_to_token[indices] = values``, as the seed does; from the pool's
        thread only (:class:`WrongThreadError` otherwise)."""
        self._check_thread()
        super().write(indices, values)

    # ------------------------------------------------------------ allocation

    async def alloc(
        self, n: SupportsIndex, *, priority: SupportsIndex = 0, timeout: float | None = None
    ) -> list[int]:
        """Allocate ``n`` rows, waiting until they can all be granted at once.

        Returns at once, without suspending, when nobody is queued, ``n``
        rows are free (reclaiming completed fences when short), the memory
        is not released (see :meth:`release_memory`) and no
        :meth:`hold_grants` hold is held. Otherwise waits FIFO within ``priority`` (lower number
        first; the head of the most urgent queue blocks everyone behind it,
        so large requests do not starve). Rows that are only pending behind a
        fence are waited for, not treated as exhaustion.

        Raises :class:`CapacityError` at once for ``n`` that is not an int in
        ``1..capacity`` or more rows than are not quarantined, and to a
        waiter whose request quarantine makes impossible while it waits;
        ``TypeError`` for a ``priority`` that is not an integer (a bool, a
        float), ``ValueError`` for a ``timeout`` that is not a number >= 0;
        :class:`PoolBusyError` when ``max_waiters`` already queue,
        :class:`PoolClosedError` when the pool is (or gets) closed,
        ``TimeoutError`` after ``timeout`` seconds. On any exception,
        cancellation included, nothing was allocated.
        """
        if (
            n.__class__ is int  # first: `n == 1` of an array has no truth value
            and n == 1
            and self._fast
            and timeout is None
            and priority.__class__ is int
        ):
            # Bound, nobody queued, not gated, no owner call under way: one
            # clean row. Unchecked for the thread, and safe from any (module
            # docstring): no call from the test of _fast to the popleft that
            # gives this call its row alone.
            led = self._ledger
            clean = led._clean
            if clean:
                # Inlined SlotLedger.take(1) for a clean row.
                led._clean = clean - 1
                free = self._free_q
                row = free.popleft()
                self._state[row] = 1  # ALLOCATED
                tag = led._granted + 1
                led._granted = tag
                self._gen[row] = tag
                if len(free) < led._peak_bound:
                    led._note_peak()
                return [row]  # counted at stats time (see _zero_wait_allocs)
        if self._owner != _get_ident():
            self._bind_thread()
        self._fast = False  # no unchecked call may interleave with this one
        if n.__class__ is not int or not 0 < n <= self._capacity:
            n = self._check_alloc_n(n, priority, timeout)
        if timeout is not None or priority.__class__ is not int:
            priority, timeout = _check_wait_args(priority, timeout)
        waiters = self._waiters
        if not waiters.count and not waiters.gated:
            led = self._ledger
            rows = self._take(n)
            if rows is None and led.pending:
                # Capacity only waiting on a fence is not exhaustion. Taken
                # again whatever the reclaim answers: see try_alloc.
                led.reclaim()
                rows = None if self._passed_meanwhile(priority) else self._take(n)
            if rows is not None:
                self._fast_allocs += 1
                self._fast = self._unchecked  # reopen the fast paths
                return rows
        # Slow path: queue and wait for a grant. WaiterQueues.wait() inlined
        # (enqueue, await, cancelled): no nested coroutine per wait; the
        # rules stay in asyncpool.waiters.
        if self._closed:
            raise PoolClosedError("the pool is closed; no rows can be allocated")
        if n > self._capacity - self._ledger.quarantined:
            waiters.unfit(priority)
            raise self._unfittable(n)
        loop = _get_running_loop()
        dropped = False
        if loop is not self._loop or self._unwatched:
            dropped = self._prepare_to_queue(loop)
        # _fast stays False from the check above: no unchecked free can land
        # between the take that came up short and this enqueue (it would
        # grant nobody), so nothing needs re-checking.
        # The histogram of the call's priority, picked here, once (figures()
        # inlined for a priority seen before): the grant observes only it.
        figures = waiters.tiers.get(priority) or waiters.figures(priority)
        waiter, handle = waiters.enqueue(
            n, priority, timeout, loop, self._wait_times, figures.histograms[0]
        )
        if dropped:
            waiters.serve_soon(waiter, loop)
        try:
            granted: list[int] = await waiter[1]
            return granted
        except asyncio.CancelledError:
            waiters.cancelled(waiter)
            raise
        except TimeoutError:
            waiters.timed_out(waiter)  # counted where the call raises it (see _expire)
            raise
        except CapacityError:
            waiters.unfit(priority)  # failed by _shed_unfittable: counted where raised
            raise
        finally:
            if handle is not None:
                handle.cancel()
            # The waiter holds the future, which holds a timeout's or a close's
            # error, whose traceback holds this frame: a cycle that would keep
            # the caller's frames (and their locals) until the cycle collector.
            del waiter

    def _check_alloc_n(self, n: object, priority: object, timeout: object) -> int:
        """``n`` as an int in ``1..capacity`` (:meth:`SlotLedger.check_n`);
        its :class:`CapacityError` for more rows than the pool has counts the
        call in ``unfittable`` (at ``priority``, if ``priority`` and
        ``timeout`` are valid; a count that is not an int >= 1 is bad input,
        and counts nothing)."""
        try:
            return self._ledger.check_n(n)
        except CapacityError:
            self._count_oversized(n, self._capacity, priority, timeout)
            raise

    def _count_oversized(
        self, count: object, capacity: int, priority: object, timeout: object
    ) -> None:
        """Count an ``alloc``/``admit`` refused for asking more than
        ``capacity`` (``count`` an integer past it, ``priority`` and
        ``timeout`` valid): a call that can never be served. Anything else
        is bad input, and counts nothing (the size is refused first, so a
        bad ``timeout`` must not let the call count). The failing path
        only."""
        try:
            k = as_index(count)
            prio = _check_wait_args(priority, timeout)[0]
        except (TypeError, ValueError):
            return
        if k > capacity:
            self._waiters.unfit(prio)

    def _prepare_wait(self, loop: asyncio.AbstractEventLoop) -> asyncio.AbstractEventLoop:
        """Bind the running ``loop`` and watch fences deferred before it ran."""
        if loop is not self._loop:
            self._rebind_loop(loop)
        if self._unwatched:
            unwatched, self._unwatched = self._unwatched, []
            for pending_fence in unwatched:
                self._on_pending(pending_fence)
        return loop

    def _prepare_to_queue(self, loop: asyncio.AbstractEventLoop) -> bool:
        """:meth:`_prepare_wait` for a call about to queue (``alloc``,
        ``admit``). True if the waiters that kept it from taking were all of a
        loop closed under them, dropped by the move to ``loop``: nobody is
        ahead now and what is free may fit, so the caller has its waiter
        served at the loop's next turn (``WaiterQueues.serve_soon``; a free
        may never come)."""
        queued = self._waiters.count
        self._prepare_wait(loop)
        return queued > 0 and not self._waiters.count

    def _rebind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        # Move to ``loop``. Refused while the old loop is open and still runs
        # or has waiters (their futures are its own). Pending fences move
        # along: a wake-up reads the pool's loop when it fires.
        old = self._loop
        if old is not None and not old.is_closed() and (old.is_running() or self._waiters.count):
            raise WrongThreadError(
                f"{self._who()} is bound to another event loop that is still "
                "running or has waiters; a pool is loop-affine"
            )
        self._drop_dead_waiters()
        # A reset queued on the old loop may never run: do it now, or a row
        # granted here would be taken for one whose reset is scheduled.
        self._flush_resets()
        self._loop = loop
        self._choose_fast_paths(loop)
        # State tied to the old loop: the wake-ups' (a wake-up or a retry
        # queued there, a delayed re-watch: FenceWakeups.left_loop), and an
        # overdue-fence timer that may never fire.
        self._wakeups.left_loop()
        pending = self._pending_any()
        overdue = self._overdue
        if overdue is not None and overdue.timer is not None:
            overdue.timer.cancel()
            overdue.timer = None
            if pending:
                self._check_overdue()  # logs what is overdue now, re-arms here
        if pending:
            # Fences that completed while their wake-up went to the old loop
            # (or to none) would wait for an unrelated call: look now.
            self._wakeups.wake_soon(loop)

    # ------------------------------------------------------------ grants
    # The supply side of the waiter queues (asyncpool.waiters): what a need
    # means, how it is taken at hand-over and given back after a cancel.

    def _drop_dead_waiters(self) -> bool:
        """Drop every waiter if the pool's loop was closed under them (their
        tasks can never resume); True if that loop is closed."""
        loop = self._loop
        if loop is None or not loop.is_closed():
            return False
        if self._waiters.count:
            self._drop_stale_waiters()
        return True

    def _drop_stale_waiters(self) -> None:
        dropped = self._waiters.drop_all()
        self._log_to(logger).warning(
            "the event loop of %r was closed with %s queued; they are dropped (their "
            "tasks can never resume) and nothing was granted to them",
            self,
            _count(dropped, "waiter"),
        )

    def _take_for_waiter(self, need: Need) -> list[int] | Grant | GroupGrant | None:
        """Take what a waiter needs at hand-over, or None if it does not fit.

        Short, it first reclaims completed fences (capacity only waiting on
        a fence is not exhaustion).

        Rows that need a reset are zeroed by one callback scheduled *before*
        the waiter's future is resolved: callbacks run in order, so every
        granted task resumes after its rows read zero, and a burst of grants
        costs one tensor op.

        A waiter whose loop was closed under it (a free made on another loop
        runs this) is dropped with every other, before anything is taken.
        """
        loop = self._loop
        if loop is not None and loop.is_closed():  # _drop_dead_waiters, inlined: per grant
            self._drop_stale_waiters()
            return None
        if need.__class__ is not int:
            k: Any = need[1]  # type: ignore[index]
            if k.__class__ is tuple:  # KV groups: one count per group
                return self._take_group_admission(k)
            pled = self._pages.ledger  # type: ignore[union-attr]
            if (not self._free_q or k > pled.free_count) and not (
                self._ledger.pending or pled.pending
            ):
                return None  # short, with nothing to reclaim: the usual probe
            return self._take_admission(k)
        n: int = need
        free = self._free_q
        led = self._ledger
        if n > len(free) and not (led.pending and led.reclaim() and n <= len(free)):
            return None
        if n == 1:
            # Inlined SlotLedger.take_unreset(1): under saturation the row
            # was freed a moment ago and is still dirty.
            led._popped += 1  # as SlotLedger._pop counts, and before _granted
            tag = led._granted + 1
            led._granted = tag
            row = free.popleft()
            self._state[row] = 1  # ALLOCATED
            self._gen[row] = tag
            if len(free) < led._peak_bound:
                led._note_peak()
            clean = led._clean
            if clean:
                led._clean = clean - 1
            else:
                if not self._unreset:
                    self._running_loop().call_soon(self._flush_resets)
                self._unreset.append(row)
            return [row]
        rows, dirty = led.take_unreset(n)
        if dirty:
            if not self._unreset:
                self._running_loop().call_soon(self._flush_resets)
            self._unreset.extend(dirty)
        return rows

    def _describe(self, need: Need) -> tuple[str, str]:
        """:func:`_describe` with this pool's KV group names (read at the
        call: the waiter queues are built before the groups)."""
        return _describe(need, () if self._groups is None else tuple(self._groups))

    def _give_back(self, granted: list[int] | Grant | GroupGrant) -> None:
        # A waiter cancelled after its grant (WaiterQueues.cancelled): a
        # checked change of the ledger like any other, so the unchecked paths
        # close first. They may be open: the grant emptied the queue and a
        # call since reopened them (the module docstring's rule; a foreign
        # alloc(1) inside put_back's clean count lost its decrement, and a
        # dirty row went out as clean).
        self._fast = False
        if granted.__class__ is Grant:
            assert self._pages is not None and isinstance(granted, Grant)
            self._pages.give_back(granted.row)
            rows = [granted.row]
        elif granted.__class__ is GroupGrant:
            assert isinstance(granted, GroupGrant)
            for pages in self._page_sets:
                pages.give_back(granted.row)
            rows = [granted.row]
        else:
            assert isinstance(granted, list)
            rows = granted
        # Their reset may still be scheduled: do it now, since put_back
        # files them as clean rows at the head of the free queue.
        self._flush_resets()
        self._ledger.put_back(rows)

    def _reclaim_both(self) -> bool:
        """Reclaim every ledger (rows, and each group's pages); True if
        anything was made free."""
        return self._reclaim_all()[1]

    def _reclaim_all(self) -> tuple[int, bool]:
        """Reclaim every ledger (rows, and each group's pages): the rows
        made free, and whether anything (rows or pages) was. Says so for a
        fence logged overdue that landed since."""
        released = self._ledger.reclaim()
        made = bool(released)
        for pages in self._page_sets:
            if pages.ledger.pending and pages.ledger.reclaim():
                made = True
        overdue = self._overdue
        if made and overdue is not None and overdue.reported:
            overdue.settled()
        return released, made

    def _flush_resets(self) -> None:
        """Zero the lengths of the rows granted since the last flush.

        Scheduled (``call_soon``) before the first of their waiters' futures
        is resolved, so it runs before any of those tasks resumes. If the
        batched op raises (on CUDA it copies an index to the device, which
        can fail for memory), the rows are zeroed one by one through views
        before this returns: the tasks resume right after it, and must not
        read their rows' last owner's lengths. Only if that fails too does
        the error reach the caller (the loop's exception handler).
        """
        rows = self._unreset
        if rows:
            self._unreset = []
            self._ledger.resets += 1
            try:
                self._tables.reset_rows(rows)
            except Exception:
                self._log_to(logger).warning(
                    "the batched reset of %d granted rows raised; zeroing them one by one",
                    len(rows),
                    exc_info=True,
                )
                self._tables.reset_rows_each(rows)

    def _passed_meanwhile(self, priority: int | None) -> bool:
        """For a call that serves at once (``try_alloc``, ``try_admit``;
        ``alloc`` and ``admit`` with nobody queued), after the reclaim it
        made when short: True if it must not take now. A ``query()`` that
        reclaim asked may have queued a call (a transfer handle's task, run
        at once by an eager task factory), held the grants or closed the
        pool. The memory the reclaim returned goes first to the calls
        queued there, by the grant loop, run here: taken by this call, it
        would jump their queue and leave what remains to nobody until the
        next free or wake-up. Only calls of ``priority`` (the call's own)
        or a more urgent one hold it back (``None``, a ``try_`` call's
        without one: any), as they would have queued ahead of it; a less
        urgent one queued there that the grant loop could not serve does
        not. The slow path only (a take came up short)."""
        waiters = self._waiters
        if waiters.count and not waiters.gated:
            waiters.grant()
        return self._closed or self._try_must_wait(priority)

    def _try_must_wait(self, priority: int | None = None) -> bool:
        """For ``try_alloc``/``try_admit``: True while anyone is queued (no
        queue jumping; with ``priority``, anyone of that priority or a more
        urgent one), the memory is released or the grants are held.
        Waiters of a loop closed under them are dropped first: they are not
        queued, they can never resume."""
        waiters = self._waiters
        if waiters.count:
            self._drop_dead_waiters()
        if self._released or self._holds:
            return True
        if not waiters.count:
            return False
        return priority is None or waiters.queued_through(priority)

    def alloc_threadsafe(
        self, n: SupportsIndex, *, priority: SupportsIndex = 0, timeout: float | None = None
    ) -> concurrent.futures.Future[list[int]]:
        """``alloc`` submitted from another thread (an API server's worker).

        Any thread; runs ``alloc(n, priority=, timeout=)`` on the pool's event
        loop and answers a ``concurrent.futures.Future`` of its rows (its
        errors raised by ``result()``). Unlike ``run_coroutine_threadsafe``,
        whose ``cancel()`` can answer True after the task was granted (the
        rows then lost), ``cancel()`` here answers True only if the caller
        gets nothing: the queued wait is cancelled, or rows granted first
        are freed on the loop at once (counted in ``cancellations``).
        ``cancel()`` False: ``result()`` has the rows. Free them on the loop
        (``loop.call_soon_threadsafe``). ``RuntimeError`` at once while the
        pool has no event loop (``bind()`` it in its loop first) or its loop
        is closed, unless the pool is closed: a closed pool answers at once
        a future whose ``result()`` raises ``PoolClosedError``, as ``alloc``
        would, whatever its loop (a replica shut down and its loop closed
        reads as closed, not as a pool to bind again); a stopped loop runs
        the call when it runs again, and a loop closed with the call queued
        (``loop.close()`` without cancelling its tasks) never resolves it, as
        with ``run_coroutine_threadsafe``: bound the wait
        (``result(timeout=...)``). On the loop's own thread, await
        :meth:`alloc` instead (blocking on the future there deadlocks).
        """
        if self._closed:
            return _closed_answer("the pool is closed; no rows can be allocated")
        return submit_wait(
            self._loop_for_submit(),
            lambda: self.alloc(n, priority=priority, timeout=timeout),
            lambda rows: self._give_back_undelivered(rows, priority),
        )

    @overload
    def admit_threadsafe(
        self, pages: SupportsIndex, *, priority: SupportsIndex = 0, timeout: float | None = None
    ) -> concurrent.futures.Future[Grant]: ...

    @overload
    def admit_threadsafe(
        self,
        pages: Mapping[str, SupportsIndex],
        *,
        priority: SupportsIndex = 0,
        timeout: float | None = None,
    ) -> concurrent.futures.Future[GroupGrant]: ...

    def admit_threadsafe(
        self,
        pages: SupportsIndex | Mapping[str, SupportsIndex],
        *,
        priority: SupportsIndex = 0,
        timeout: float | None = None,
    ) -> concurrent.futures.Future[Grant] | concurrent.futures.Future[GroupGrant]:
        """``admit`` submitted from another thread: as :meth:`alloc_threadsafe`.

        ``cancel()`` True: nothing is the caller's (a grant that came first
        is freed on the loop, row and pages, at once); False: ``result()``
        has the :class:`Grant` (or :class:`GroupGrant`).
        """
        if self._closed:
            return _closed_answer("the pool is closed; nothing can be admitted")
        fut: concurrent.futures.Future[Grant | GroupGrant] = submit_wait(
            self._loop_for_submit(),
            lambda: self.admit(pages, priority=priority, timeout=timeout),
            lambda grant: self._give_back_undelivered([grant.row], priority),
        )
        return fut  # type: ignore[return-value]

    def _loop_for_submit(self) -> asyncio.AbstractEventLoop:
        if self._forked_from is not None:
            raise self._refuse_forked()  # the loop is the parent's: nothing would run
        loop = self._loop
        if loop is None:
            raise RuntimeError(
                f"{self._who()} has no event loop yet: call pool.bind() inside its "
                "scheduler's running loop before submitting from other threads"
            )
        return loop

    def _give_back_undelivered(self, rows: list[int], priority: SupportsIndex) -> None:
        # A grant whose thread-safe caller cancelled first: never used, so it
        # frees at once; counted as a waiter cancelled after its grant is
        # (its priority was checked by the call that was granted).
        self._waiters.cancellations += 1
        self._waiters.figures(operator.index(priority)).cancellations += 1
        self.free(rows)

    def try_alloc(
        self, n: SupportsIndex, *, priority: SupportsIndex | None = None
    ) -> list[int] | None:
        """Allocate ``n`` rows now, or return None; never waits.

        Returns None while anyone is queued (no queue jumping), while the
        memory is released or while the grants are held
        (:meth:`hold_grants`); otherwise, when the free rows are short, it
        reclaims completed fences before answering None. With ``priority``
        only waiters of that priority or a more urgent one (a lower number)
        hold it back: it takes what :meth:`alloc` at that priority would be
        granted at once, ahead of less urgent waiters (a paid tier's call
        while batch jobs queue).
        Raises :class:`CapacityError` for bad ``n`` and, as :meth:`alloc`
        does, for more rows than are not quarantined (a None there would
        be answered for ever); ``TypeError`` for a ``priority`` that is not
        None or an integer (a bool, a float); :class:`PoolClosedError`
        after :meth:`close`. Each changes nothing.
        """
        self._check_thread()
        led = self._ledger
        if n.__class__ is not int or not 0 < n <= self._capacity:
            n = led.check_n(n)
        prio = None if priority is None else _check_wait_args(priority, None)[0]
        if self._closed:
            raise PoolClosedError("the pool is closed; no rows can be allocated")
        if led.quarantined and n > self._capacity - led.quarantined:
            raise self._unfittable(n)
        if self._try_must_wait(prio):
            return None
        rows = self._take(n)
        if rows is None and led.pending:
            # Taken again whatever the reclaim answers: a fence's query() it
            # asks may free rows at once (a transfer handle's code, or a task
            # an eager task factory runs there), which it does not count.
            led.reclaim()
            if self._passed_meanwhile(prio):
                return None
            rows = self._take(n)
        if rows is not None:
            self._fast_allocs += 1
        return rows

    # ------------------------------------------------------------ free

    def record_use(self, rows: Rows, fence: Fences) -> None:
        """Note that ``rows`` are touched by work that completes with ``fence``.

        Call it once per scheduler step, right after launching the step, with
        the one fence recorded after that launch (a step that ends with
        several, on several streams: a sequence of them, as one call
        per fence would record). A later :meth:`free` of a row then waits
        for the newest use recorded for it (per stream) and for each fence
        of unknown origin (a transfer handle) recorded for it that has not
        completed: once a row's uses grow past a few, a record asks some of
        its handles in turn (two per handle it adds) and drops those that
        landed, so a row recorded with ``[step, transfer]`` every step does
        not keep every transfer (with ``reclaim="explicit"`` no fence is
        asked, and a row keeps every handle until its free). A handle
        whose ``query()`` raises stays, for the free to quarantine behind
        it. Raises, changing nothing: :class:`InvalidSlotError` unless
        every row is allocated, ``TypeError`` for a ``fence`` that is not a
        fence or a sequence of fences (naming a bad element by its
        position), None included (a use needs its fence; ``[]`` records
        none); a ``query()`` raising what is not an ``Exception``
        propagates, every row recorded or as it was.
        """
        self._check_thread()
        self._ledger.record_use(rows, fence)

    def free(
        self,
        rows: Rows,
        fence: Fences | None = None,
        *,
        after: HostStream | torch.Stream | None = None,
    ) -> int:
        """Return rows to the pool; never awaits.

        Each row goes back to circulation once its newest recorded use and
        ``fence`` (and a fence recorded now on ``after``, when given) have
        completed; a row with nothing incomplete is free at once and goes to
        the waiters. ``fence``: one fence, or a sequence of fences, a list
        or tuple (memory also read by a transfer: the row waits for every
        one of them, any one faulting quarantines it, the newest per stream
        counts; an empty one is no fence; a set or an iterator is refused).
        Returns the number of rows free at once. The signature
        is :meth:`ReqToTokenPool.free`'s: ``free(rows)``, ``free(rows, fence)``
        or ``free(rows, fence=fence)``, and ``after=`` by keyword. ``rows``: an
        int, a list of ints, integer scalars or a 1-D integer tensor or array.
        Raises,
        changing nothing, for row 0, out-of-range or non-int ids, rows not
        allocated (:class:`DoubleFreeError` for one already freed),
        duplicates, a ``fence`` that is not a fence or a sequence of
        fences (``TypeError``, naming a bad element by its position), an
        ``after`` that is not a stream (``TypeError``) or a closed
        ``HostStream`` (``RuntimeError``), and, with ``kv``, a row whose page
        record was written into (:class:`InvalidSlotError`). Allowed after
        :meth:`close`.
        """
        if fence is None and after is None:
            # Inlined SlotLedger.free fast path: one row (``[row]``, or the
            # bare int the seed's callers pass), no fence, no use, no pages
            # (_rows_end is 0 with kv, so it never matches there).
            row = (rows[0] if len(rows) == 1 else None) if rows.__class__ is list else rows
            if (
                row.__class__ is int
                and 0 < row < self._rows_end
                and self._state[row] == 1  # ALLOCATED (USED: a recorded use)
            ):
                if self._fast:
                    # Unchecked for the thread, and safe from any (module
                    # docstring): no call between the checks and the commit.
                    self._state[row] = 0  # FREE
                    self._free_q.append(row)
                    return 1
                # Checked. The unchecked paths are closed, so no foreign
                # call can change this row during the thread check.
                if self._owner != _get_ident():
                    self._bind_thread()
                self._state[row] = 0  # FREE
                self._free_q.append(row)
                waiters = self._waiters
                if waiters.count:
                    waiters.grant()  # the owner's thread only
                elif not waiters.gated:
                    self._fast = self._unchecked  # reopen the fast paths
                return 1
        if self._owner != _get_ident():
            self._bind_thread()
        self._fast = False  # no unchecked call may interleave with this one
        if self._page_sets:
            return self._free_with_pages(rows, after, fence)
        led = self._ledger
        if after is not None:
            rows = self._use_until_now(rows, after, fence)
        immediate = led.free(rows, fence)
        if immediate and self._waiters.count:
            self._waiters.grant()
        return immediate

    def _on_pages_freed(self) -> None:
        # KVPagePool.free/reclaim called by the caller (detached pages) made
        # pages free: the same grant loop as any other free.
        if self._waiters.count:
            self._waiters.grant()

    # ------------------------------------------------------------ leases

    def lease(
        self,
        n: SupportsIndex,
        *,
        priority: SupportsIndex = 0,
        timeout: float | None = None,
        after: HostStream | torch.Stream | None = None,
    ) -> Lease:
        """``async with pool.lease(n) as rows:`` allocate, then always free.

        On exit (normal, exception or cancellation) the rows granted are
        freed, whatever the body did to the list it got, behind a fence
        recorded on ``after`` at exit when given. If the body
        freed any of the rows itself, whether or not they were handed out
        again since, exit frees the rows the lease still owns and then raises
        :class:`DoubleFreeError` naming the others: it never frees a row
        twice, nor another owner's row. If the body raised, that exception
        is the new error's ``__context__``; if it was cancelled (or
        interrupted: a ``BaseException`` that is not an ``Exception``), its
        ``CancelledError`` goes on unreplaced, carrying the exit's error as a
        note (and logged at WARNING), so that ``asyncio.timeout`` and
        ``TaskGroup`` still see the cancellation. An ``after`` that no fence can be
        recorded on raises here, before anything is allocated (found at
        exit, it would leave the rows only their recorded uses):
        ``TypeError`` for one that is not a stream, ``RuntimeError`` for a
        ``HostStream`` closed already;
        one that fails at exit (a ``HostStream`` closed in the body) raises
        ``RuntimeError`` there, its rows freed behind their recorded uses
        alone (the message names them, and any the body freed itself). A
        ``Lease`` is entered once at a time: entering it again while it
        holds or awaits rows (another task's ``async with`` of the same
        object) raises ``RuntimeError`` (one after another is fine). A lease held
        while another is awaited is hold-and-wait, as with any two
        allocations: nested leases that together exceed what is free wait
        for ever unless something else frees rows (take one lease of the
        sum, or ``admit`` for a row with its pages).
        """
        if after is not None:
            check_after(after)
        return Lease(self, n, priority, timeout, after)


class Lease:
    """The async context manager returned by :meth:`AsyncReqToTokenPool.lease`."""

    __slots__ = (
        "_after",
        "_entered",
        "_gens",
        "_held",
        "_n",
        "_pool",
        "_priority",
        "_timeout",
        "rows",
    )

    def __init__(
        self,
        pool: AsyncReqToTokenPool,
        n: SupportsIndex,
        priority: SupportsIndex,
        timeout: float | None,
        after: Any | None,
    ) -> None:
        self._pool = pool
        self._n = n
        self._priority = priority
        self._timeout = timeout
        self._after = after
        self._gens: list[int] = []
        # The rows granted, kept apart from the list the body gets (which it
        # may change): exit frees exactly these.
        self._held: tuple[int, ...] = ()
        self._entered = False  # from __aenter__'s start to __aexit__
        self.rows: list[int] = []

    async def __aenter__(self) -> list[int]:
        if self._entered:
            # Its exit frees one grant: a second would be lost for good.
            raise RuntimeError(
                "this lease is entered already (it holds or awaits rows): a Lease is "
                "entered once at a time (take pool.lease(n) again for another)"
            )
        self._entered = True  # before the await: two tasks may enter at once
        pool = self._pool
        try:
            self.rows = await pool.alloc(self._n, priority=self._priority, timeout=self._timeout)
        except BaseException:
            self._entered = False
            raise
        self._held = tuple(self.rows)
        self._gens = [pool.generation(r) for r in self._held]
        return self.rows

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        pool = self._pool
        led = pool._ledger
        held, self._held = self._held, ()  # entered again later: a fresh grant
        gens, self._gens = self._gens, []
        self._entered = False
        stale = [
            r
            for r, g in zip(held, gens, strict=True)
            if pool.generation(r) != g or led.state_of(r) != "allocated"
        ]
        rows = [r for r in held if r not in stale] if stale else list(held)
        stale_error = (
            DoubleFreeError(
                f"lease rows {stale} were freed inside the lease body, so the lease "
                "does not free them again (they may belong to another request now)"
            )
            if stale
            else None
        )
        problem: BaseException | None = stale_error
        if rows:
            try:
                pool.free(rows, after=self._after)
            except Exception as error:
                # No fence could be recorded on `after` (say, a HostStream
                # closed in the body: its work has run or been dropped). Never
                # leak the rows: free them behind their recorded uses, then
                # say so (the error said nothing was freed: true of that
                # call), with the rows the body freed itself, if any.
                if not all(led.state_of(r) == "allocated" for r in rows):
                    raise
                pool.free(rows)
                problem = RuntimeError(
                    f"lease exit: {error}; the lease freed its rows {rows} behind their "
                    "recorded uses alone" + ("" if stale_error is None else f" ({stale_error})")
                )
                problem.__cause__ = error
        if problem is None:
            return
        if exc is not None and not isinstance(exc, Exception):
            # A cancellation (or KeyboardInterrupt, SystemExit) goes on as it
            # came: replaced, it would break the caller's cancel scopes
            # (asyncio.timeout and TaskGroup read the CancelledError). The
            # problem rides along as a note, and in the log.
            exc.add_note(f"lease exit: {problem}")
            pool._log_to(logger).warning(
                "lease exit while %s propagates: %s", type(exc).__name__, problem
            )
            return
        raise problem
