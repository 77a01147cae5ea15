"""The fence machinery both ledgers share: ids held back until fences complete.

A ledger (rows: :class:`~asyncpool.ledger.SlotLedger`, KV pages:
:class:`~asyncpool.kv_pages.PageLedger`) subclasses :class:`Deferrals` and
says what a batch of ids is and how to put one back into circulation; this
module owns everything about *waiting*:

* pending ids sit in :class:`Deferred` batches. A batch waits behind one
  fence (its *head*) and possibly more (``rest``: a row used on two streams,
  pages freed with ``fence=`` and ``after=``); it sits in the queue of its
  head's stream, or in the side list when the head has no ``stream_key``
  (a fence of unknown origin, such as a transfer handle);
* each stream's queue is kept in the stream's record order (``seq``), so
  :meth:`Deferrals.reclaim` looks only at each queue's head: fences of one
  stream complete in order. The side list is polled in full. The cost of a
  reclaim is O(completed + streams + unordered), never O(pending);
* when a batch's head completes, its other fences are asked in order, up to
  the first still open: all done, the ids are released
  (:meth:`Deferrals._release_items`); one still open, the batch moves behind
  it (keeping its ``did`` and ``t0``) and never asks again the fences it
  passed (done is for good), so a batch behind n fences that complete one by
  one costs O(n + reclaim passes) queries, not O(n^2);
* a fence that raises (a faulted stream) quarantines its batch for good
  (:meth:`Deferrals._quarantine_items`): the work that wrote those ids may
  have stopped anywhere. Faults are counted once per fence, logged, kept in
  ``last_fence_error`` and reported to the ``on_fault`` hook;
* ``on_pending(fence)`` is called once for each batch that starts waiting
  behind ``fence`` (first deferral or a move), so an owner can arrange a
  wake-up; ``fence_latencies`` keeps a window of defer-to-release times.

Every batch carries a *deferral id* ``did``: a counter per ledger, taken in
the order batches are created (ids freed behind a fence that already holds a
batch join it and share its ``did``). Ledgers driven by the same calls in the
same order number their batches alike, which is what lets replicas agree on
"everything deferred up to ``did``" without comparing fences; ``t0`` (the
first deferral) is what an overdue check measures from.

What a batch holds is the subclass's business: a list of parts (``items``)
plus their id count ``n``. The row ledger's parts are row ids (``int``), the
page ledger's parts are numpy arrays of page ids. Merging a new free into an
existing batch is ``items.extend(parts)``: no copy, whatever a part is.

Not thread-safe: the owning pool serialises calls.
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import sys
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from types import FrameType
from typing import Any, Generic, TypeVar, cast

from .errors import FenceError
from .fences import Fence, FenceAnswer, chained, is_done
from .naming import Log, pool_log
from .stats import Histogram

__all__ = [
    "Deferrals",
    "Deferred",
    "answer_once",
    "check_ordered",
    "held_words",
    "newest_per_stream",
    "stream_key",
]

logger: logging.Logger = logging.getLogger(__name__)

#: How many faulted fences a ledger remembers, to count and log each once.
_FAULTS_REMEMBERED = 256

#: Faulted fences of unknown origin (transfer handles) logged as ERRORs per
#: window: a dead peer faults every transfer in flight at once, each its own
#: fence, and must not log an ERROR per transfer.
_UNORDERED_FAULT_ERRORS = 3
_UNORDERED_FAULT_WINDOW_S = 1.0

T = TypeVar("T")


def _hold(fence: Fence) -> Any:
    """What remembers ``fence`` by id: a weak reference where the fence
    takes one (a transfer handle may own a large buffer, which the pool must
    not keep alive), else the fence itself (so that its id is not reused
    while it is remembered)."""
    try:
        return weakref.ref(fence)
    except TypeError:  # no weak references (__slots__ without one)
        return fence


def held_fence(held: Any) -> Any:
    """The fence ``held`` (see :func:`_hold`) remembers, or None once it
    was collected."""
    return held() if held.__class__ is weakref.ref else held


def _holds(held: Any, fence: Fence) -> bool:
    """Whether ``held`` (see :func:`_hold`) is this very fence, not another,
    collected one whose id it bore."""
    return held_fence(held) is fence


def remember_fence(memory: dict[int, Any], fence: Fence) -> None:
    """Remember ``fence`` in ``memory``, by id (see :func:`_hold`)."""
    memory[id(fence)] = _hold(fence)


def remembers_fence(memory: dict[int, Any], fence: Fence) -> bool:
    """Whether ``memory`` (see :func:`remember_fence`) holds this very fence,
    not another, collected one whose id it now bears."""
    entry = memory.get(id(fence))
    return entry is not None and _holds(entry, fence)


def held_words(held: dict[str, int]) -> str:
    """What a fence holds, per ledger unit, in words: ``{"rows": 1, "pages":
    2}`` reads "1 row and 2 pages"."""
    return " and ".join(
        f"{n} {unit[:-1] if n == 1 and unit.endswith('s') else unit}" for unit, n in held.items()
    )


def stream_key(fence: object) -> int | None:
    """The fence's stream, or None for a fence of unknown origin.

    Ordered (on a stream) means an int ``stream_key`` *and* an int ``seq``;
    anything else is polled as a fence of unknown origin.
    """
    key = getattr(fence, "stream_key", None)
    if key.__class__ is int and getattr(fence, "seq", None).__class__ is int:
        return key
    return None


def check_ordered(fence: object, what: str = "retire()") -> None:
    """Raise TypeError unless ``fence`` is an ordered fence (it has ``query()``,
    ``synchronize()``, an int ``stream_key`` and an int ``seq``)."""
    key = getattr(fence, "stream_key", None)
    seq = getattr(fence, "seq", None)
    if (
        key.__class__ is not int
        or seq.__class__ is not int
        or not callable(getattr(fence, "query", None))
        or not callable(getattr(fence, "synchronize", None))
    ):
        raise TypeError(
            f"{what} needs an ordered fence, one recorded on a stream (a HostFence or "
            f"CudaFence from record_fence(), with an int stream_key and seq), got {fence!r} "
            f"of type {type(fence).__name__}; fences of unknown origin (transfer handles) "
            "are settled by agree(group)"
        )


def newest_per_stream(fences: Sequence[Fence]) -> list[Fence]:
    """The fences worth waiting for: the newest of each stream, then each
    fence of unknown origin once (first-seen order for both).

    O(len(fences)): a ``fence=`` sequence may name thousands of transfer
    handles, so the ones of unknown origin are told apart by id (every one
    is alive in ``fences`` while this runs), not by a scan of those seen.
    """
    newest: dict[int, Fence] = {}
    unordered: dict[int, Fence] = {}
    for f in fences:
        key = stream_key(f)
        if key is None:
            unordered.setdefault(id(f), f)
        else:
            cur = newest.get(key)
            if cur is None or getattr(cur, "seq", 0) < getattr(f, "seq", 0):
                newest[key] = f
    return [*newest.values(), *unordered.values()]


def answer_once(answers: dict[int, tuple[Fence, Any]], fence: Fence) -> bool:
    """``fence.query()`` as a bool, asked once while ``answers`` (one call's
    answers, by fence id, each kept with its fence so no id is reused)
    lives: the first answer, or the ``Exception`` it raised, is given
    again. An answer that is not a yes or no raises, as a fault; what is
    not an ``Exception`` propagates and is not remembered."""
    known = answers.get(id(fence))
    if known is not None:
        if known[1].__class__ is bool:
            return bool(known[1])
        raise known[1]
    try:
        done = fence.query()
        if done is not True and done is not False:
            done = is_done(done)  # not a yes or no: a fault
    except Exception as exc:
        answers[id(fence)] = (fence, exc)
        raise
    answers[id(fence)] = (fence, done)
    return bool(done)


class Deferred(Generic[T]):
    """Ids that return to circulation once ``fence`` and every ``rest`` fence completed.

    ``seq`` is ``fence.seq`` (0 for a fence of unknown origin): the batch's
    place in its stream queue. ``did`` is its deferral id, ``t0`` the clock
    reading when it was created, ``n`` the number of ids its ``items`` hold.

    ``rest`` (the fences still to wait for after ``fence``, in order) is
    ``more[at:]``: a batch behind a long sequence that settles fence by
    fence moves ``at`` along ``more`` instead of copying what is left at
    each step (O(1) a step, not O(len)). ``more`` is empty exactly when
    nothing is left (``at`` is then 0): the hot paths test ``more``, not
    the property. Assigning ``rest`` stores the tuple with ``at`` 0.
    """

    __slots__ = ("at", "did", "fence", "items", "more", "n", "seq", "t0")

    def __init__(
        self,
        fence: Fence,
        seq: int,
        rest: tuple[Fence, ...],
        did: int,
        items: list[T],
        n: int,
        t0: float,
    ) -> None:
        self.fence: Fence = fence
        self.seq: int = seq
        self.more: tuple[Fence, ...] = rest
        self.at: int = 0
        self.did: int = did
        self.items: list[T] = items
        self.n: int = n
        self.t0: float = t0

    @property
    def rest(self) -> tuple[Fence, ...]:
        """The fences still to wait for after ``fence``, in order (a copy
        when the batch has moved along them: O(len), off the hot paths)."""
        at = self.at
        return self.more[at:] if at else self.more

    @rest.setter
    def rest(self, fences: tuple[Fence, ...]) -> None:
        self.more = fences
        self.at = 0

    def __repr__(self) -> str:
        left = len(self.more) - self.at
        more = f" +{left} fences" if left else ""
        return f"<Deferred did={self.did} n={self.n} behind {self.fence!r}{more}>"


class Deferrals(Generic[T]):
    """Pending queues, side list, quarantine and fault accounting of a ledger.

    A base class: the subclass implements :meth:`_release_items` (put ids
    back into circulation, FIFO at the tail), :meth:`_quarantine_items` (mark
    ids quarantined) and :meth:`_count_items` (for the invariant check), and
    calls :meth:`_defer` to hold ids behind fences. Public counters:
    ``pending`` and ``quarantined`` (ids), ``deferred_frees`` (ids ever
    deferred), ``reclaimed`` (ids released by a completed fence),
    ``force_released`` (ids released by :meth:`force_release`, their fence
    not completed), ``fence_errors`` (faulted fences), ``last_fence_error``,
    ``fence_latencies`` (seconds from deferral to release, a bounded window).
    """

    #: What the ids are, for messages ("rows", "pages").
    unit = "ids"

    #: Where the fault and quarantine lines go: this module's logger, or,
    #: once the owner named its pool (:meth:`set_log_name`), one that starts
    #: them with the pool's name. Read on the fault path only.
    log: Log = logger

    def __init__(
        self,
        *,
        on_pending: Callable[[Fence], None] | None = None,
        on_fault: Callable[[Fence, BaseException], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        latency_window: int = 4096,
    ) -> None:
        self._streams: dict[int, collections.deque[Deferred[T]]] = {}
        self._unordered: list[Deferred[T]] = []
        # The batches of _unordered that wait for one fence alone, by the
        # fence's id (the first such batch per fence): a free behind a fence
        # of unknown origin joins its batch without walking the side list,
        # which holds one batch per transfer in flight. Valid only while
        # _solo_of is the _unordered list: reclaim() carries it over to the
        # list it builds, dropping the batches that left; the rarer calls
        # that replace the list otherwise (force_release, conclude, agree:
        # O(pending batches) themselves) drop it (_drop_solo), and the next
        # such free rebuilds it.
        self._solo: dict[int, Deferred[T]] = {}
        self._solo_of: list[Deferred[T]] | None = None
        self._on_pending = on_pending
        self._on_fault = on_fault
        self._clock = clock
        self._next_did = 0
        self.pending: int = 0
        self.quarantined: int = 0
        self.deferred_frees: int = 0
        self.reclaimed: int = 0
        self.force_released: int = 0
        self.fence_errors: int = 0
        self.last_fence_error: BaseException | None = None
        # The faulted fences counted so far, the newest _FAULTS_REMEMBERED,
        # by id: a weak reference where the fence takes one (a transfer
        # handle may own a large buffer), else the fence itself (so that its
        # id is not reused while it is remembered).
        self._faulted: collections.OrderedDict[int, Any] = collections.OrderedDict()
        # Ids quarantined behind each remembered fence after its error, by
        # fence id (kept with _faulted): the first such quarantine is
        # logged as a warning, the rest at DEBUG with this running count.
        self._faulted_more: dict[int, int] = {}
        # Streams (by stream_key) with a faulted fence logged as an ERROR,
        # the newest _FAULTS_REMEMBERED: how many more of their fences
        # faulted since. A stream's fault is sticky (a HostStream, a CUDA
        # error), so every fence recorded on it later faults too: the
        # second is logged as a warning, the rest at DEBUG with this count.
        self._faulted_streams: collections.OrderedDict[int, int] = collections.OrderedDict()
        # Faults of fences of unknown origin (each its own "stream"), logged
        # per window of _UNORDERED_FAULT_WINDOW_S: the end of the current
        # window, the ERRORs logged in it (one more once the WARNING that
        # starts the DEBUG lines is out), and the faults logged at DEBUG
        # since the last ERROR (the next ERROR says how many).
        self._unordered_fault_until: float = -math.inf
        self._unordered_fault_errors: int = 0
        self._unordered_fault_quiet: int = 0
        # Explicit mode: faults agree() saw here that no agreement has acted
        # on yet (one that raised or was interrupted settles nothing), by
        # fence id: (the fence or a weak reference to it, its error). Kept
        # so that a fence that raised once and answers True later is still
        # quarantined, as auto mode would have at once.
        self._unagreed_faults: collections.OrderedDict[int, tuple[Any, BaseException]] = (
            collections.OrderedDict()
        )
        self.fence_latencies: collections.deque[float] = collections.deque(maxlen=latency_window)
        # Scheduler-driven reclaim (reclaim="explicit", see make_explicit):
        # the newest retired seq per stream, and the deferral ids of batches
        # agree() found overdue (not done on some rank past the timeout).
        self.explicit: bool = False
        self._retired: dict[int, int] = {}
        self.agreed_overdue: set[int] = set()
        self.fence_histogram: Histogram = Histogram()  # every batch's latency, for metrics
        # While an owner frees through several ledgers (or groups) in one
        # call, the answers of the fences asked so far in that call, by id
        # (the fence kept with its answer, so the id is not reused): each
        # fence is then asked once and every id behind it gets one verdict.
        # None (outside such a call): ask afresh. The owner sets one dict on
        # every ledger of the call and resets them to None in a finally.
        self.answers: dict[int, tuple[Fence, Any]] | None = None
        # The batches a call holds out of every queue while it asks fences
        # (whose query() may call force_release: a transfer handle's
        # watchdog giving up): the side list a reclaim walks, the batches a
        # force_release or conclude settles. One list per such call, in
        # call order; a slot is None once its batch left the holder's hands
        # (settled, or taken by a force_release made meanwhile, which
        # settles it itself). _taken counts those taken, so a holder tells
        # whether its index of the side list still holds. _settling: the
        # batches _settle is asking the further fences of (a
        # force_release drops its fences from their remaining ones there).
        # Empty outside such calls; read by force_release and holds only.
        self._held: list[list[Deferred[T] | None]] = []
        self._taken: int = 0
        self._settling: list[Deferred[T]] = []

    def set_hooks(
        self,
        *,
        on_pending: Callable[[Fence], None] | None,
        on_fault: Callable[[Fence, BaseException], None] | None,
    ) -> None:
        """Replace both hooks (None: no hook); for an owner that adopts a ledger.

        Batches already pending were announced to the old hook only: see
        :meth:`pending_fences`.
        """
        self._on_pending = on_pending
        self._on_fault = on_fault

    def set_log_name(self, name: str | None) -> None:
        """Label this ledger's log lines with its owner's pool name (None:
        none, the lines as they always were); the owner calls it once, at
        construction. A page ledger keeps its own page pool's name when a
        row pool adopts it (``kv=``)."""
        self.log = pool_log(logger, name)

    # ------------------------------------------------------------ subclass hooks

    def _release_items(self, items: list[T]) -> None:
        """Put the ids of a completed batch back into circulation (PENDING -> FREE)."""
        raise NotImplementedError

    def _quarantine_items(self, items: list[T]) -> None:
        """Mark ids QUARANTINED (from PENDING, or from ALLOCATED when a free
        finds its fence already faulted)."""
        raise NotImplementedError

    def _count_items(self, items: list[T]) -> int:
        """How many ids ``items`` hold (invariant checks only)."""
        raise NotImplementedError

    # ------------------------------------------------------------ deferring

    def _open_fences(self, fences: Sequence[Fence]) -> tuple[list[Fence], Fence | None, Any]:
        """Ask each fence worth waiting for (:func:`newest_per_stream`) once.

        Returns ``(open, faulted, error)``: the fences not yet complete, in
        order, and the first fence that raised with its exception (then
        ``open`` is meaningless: the ids must be quarantined).
        """
        if self.explicit:  # never ask a fence: only retire() says it is done
            return [f for f in newest_per_stream(fences) if not self.is_retired(f)], None, None
        waits: list[Fence] = []
        answers = self.answers
        for f in newest_per_stream(fences) if len(fences) > 1 else fences:
            try:
                if answers is None:
                    done = f.query()
                    if done is not True and done is not False:
                        done = is_done(done)  # not a yes or no: a fault
                else:
                    done = self.answer(f)
            except Exception as exc:  # a faulted stream
                return waits, f, exc
            if not done:
                waits.append(f)
        return waits, None, None

    def answer(self, fence: Fence) -> bool:
        """``fence.query()`` as a bool, asked once per call while
        :attr:`answers` is set (the first answer, or the exception it
        raised, is given again). An answer that is not a yes or no raises,
        as a fault. Auto mode only."""
        answers = self.answers
        assert answers is not None
        return answer_once(answers, fence)

    def _defer(
        self,
        fence: Fence,
        items: list[T],
        n: int,
        now: float,
        rest: tuple[Fence, ...] = (),
    ) -> None:
        """Hold ``n`` ids (``items``, already marked PENDING) behind ``fence``
        and every fence in ``rest``.

        Joins the batch already waiting behind exactly ``fence`` when there is
        one (no ``rest`` on either side), else creates a batch with the next
        deferral id and calls ``on_pending(fence)``.
        """
        self.pending += n
        self.deferred_frees += n
        key = stream_key(fence)
        if key is None:
            if not rest:
                solo = self._solo
                if self._solo_of is not self._unordered:
                    solo = self._index_solo()
                batch = solo.get(id(fence))
                if batch is not None:
                    batch.items.extend(items)
                    batch.n += n
                    return
            batch = Deferred(fence, 0, rest, self._next_did, items, n, now)
            self._next_did += 1
            self._unordered.append(batch)
            if not rest and self._solo_of is self._unordered:
                self._solo[id(fence)] = batch
        else:
            fseq: int = getattr(fence, "seq", 0)
            queue = self._streams.get(key)
            if queue is None:
                queue = self._streams[key] = collections.deque()
            # Keep the queue in record order; frees usually arrive in it, so
            # scan from the tail (O(1) in the common case).
            index = len(queue)
            while index > 0:
                tail = queue[index - 1]
                if tail.fence is fence and not rest and not tail.more:
                    tail.items.extend(items)
                    tail.n += n
                    return
                if tail.seq <= fseq:
                    break
                index -= 1
            batch = Deferred(fence, fseq, rest, self._next_did, items, n, now)
            self._next_did += 1
            queue.insert(index, batch)
        if self._on_pending is not None and not self.explicit:
            self._on_pending(fence)

    def _index_solo(self) -> dict[int, Deferred[T]]:
        """Index the side list's single-fence batches (see ``_solo``)."""
        solo: dict[int, Deferred[T]] = {}
        for batch in self._unordered:
            if not batch.more:
                solo.setdefault(id(batch.fence), batch)
        self._solo = solo
        self._solo_of = self._unordered
        return solo

    def _drop_solo(self) -> None:
        """The side list is being replaced: forget its index (which would
        otherwise keep settled batches, and their fences, alive)."""
        self._solo = {}
        self._solo_of = None

    def _enqueue(self, batch: Deferred[T], notify: bool = True) -> None:
        """Queue an existing batch behind its (new) head fence, in record order.

        ``notify=False`` puts back a batch taken out of its queue whose head
        is already watched (no second ``on_pending``).
        """
        key = stream_key(batch.fence)
        if key is None:
            batch.seq = 0
            self._unordered.append(batch)
            if not batch.more and self._solo_of is self._unordered:
                self._solo.setdefault(id(batch.fence), batch)
        else:
            fseq: int = getattr(batch.fence, "seq", 0)
            batch.seq = fseq
            queue = self._streams.get(key)
            if queue is None:
                queue = self._streams[key] = collections.deque()
            index = len(queue)
            while index > 0 and queue[index - 1].seq > fseq:
                index -= 1
            queue.insert(index, batch)
        if notify and self._on_pending is not None and not self.explicit:
            self._on_pending(batch.fence)

    # ------------------------------------------------------------ reclaim

    def reclaim(self) -> int:
        """Release every batch whose fences all completed; return the ids released.

        Looks only at the head of each stream's queue (fences of one stream
        complete in order) and at the side list: O(completed + streams +
        unordered), never O(pending). A fence that raises quarantines its
        batch. A batch whose head completed but that waits for more fences
        moves behind the next one. In explicit mode (:meth:`make_explicit`)
        it asks nothing and returns 0: only :meth:`retire`, :meth:`apply_agreement`
        and ``force_release`` return ids there.
        """
        if not self.pending or self.explicit:
            return 0
        released = 0
        empty: list[int] = []
        # A copy: moving a batch behind another stream's fence may add that
        # stream's queue to the dict.
        for key, queue in list(self._streams.items()):
            while queue:
                batch = queue[0]
                try:
                    done = batch.fence.query()
                    if done is not True and done is not False:
                        done = is_done(done)
                except Exception as exc:
                    if queue and queue[0] is batch:
                        queue.popleft()
                        self._fault_batch(batch, batch.fence, exc)
                    continue
                if not done:
                    break
                if not queue or queue[0] is not batch:
                    # The query() called the owner (or created a task that
                    # did: an eager task factory runs it inside the query),
                    # which reclaimed this batch in a reclaim of its own.
                    # Popping now would release the next batch, its fence
                    # not asked. Look at the head again.
                    continue
                queue.popleft()
                released += self._settle(batch)
            if not queue:
                empty.append(key)
        streams = self._streams
        for key in empty:
            # A move may have refilled it; a reclaim that a query() ran
            # (see above) may have dropped it already.
            if not streams.get(key, True):
                del streams[key]
        if self._unordered:
            # The index follows the list: the batches that leave it leave the
            # index (O(those), not a rebuild at the next free).
            solo = self._solo if self._solo_of is self._unordered else None
            self._drop_solo()
            # Walked as a list of its own, kept in self._held while the walk
            # holds it: a force_release that a query() makes finds the
            # batches in it there. A slot goes None when its batch leaves the
            # walk (settled here, or taken by such a force_release, which
            # settled it: then the walk settles it no more); the batches
            # left in it are those still waiting.
            unordered: list[Any] = self._unordered
            self._unordered = []
            held = self._held
            held.append(unordered)
            taken = self._taken
            keep: list[Deferred[T]] = []
            whole = False
            try:
                i = -1
                for side in unordered:
                    i += 1
                    if side is None:
                        continue  # taken by a force_release made in a query() here
                    fence = side.fence
                    try:
                        done = fence.query()
                        if done is not True and done is not False:
                            done = is_done(done)
                    except Exception as exc:
                        if unordered[i] is side:  # not taken in that query()
                            unordered[i] = None
                            if solo is not None and solo.get(id(fence)) is side:
                                del solo[id(fence)]
                            self._fault_batch(side, fence, exc)
                        continue
                    if not done:
                        keep.append(side)
                    elif unordered[i] is side:  # not taken in that query()
                        unordered[i] = None
                        if solo is not None and solo.get(id(fence)) is side:
                            del solo[id(fence)]
                        released += self._settle(side)
                whole = True
            finally:
                held.pop()
                # A batch moved here during the loop went to the new list;
                # after a BaseException from a query() the batches not yet
                # settled stay too (and the index is rebuilt when next needed).
                moved = self._unordered
                if not whole or self._taken != taken:
                    # Those kept, and those not asked: every slot left.
                    keep = [b for b in unordered if b is not None]
                keep.extend(moved)
                self._unordered = keep
                if whole and solo is not None and self._taken == taken:
                    for batch in moved:
                        if not batch.more:
                            solo.setdefault(id(batch.fence), batch)
                    self._solo, self._solo_of = solo, keep
                elif self._solo_of is not keep:
                    # A free that a query() made (or a task an eager
                    # factory ran there) indexed the list that was in use
                    # during the walk, gone now, or a force_release made
                    # there took batches the index names: drop that index,
                    # which would keep its batches (and their fences) alive.
                    self._drop_solo()
        return released

    def _settle(self, batch: Deferred[T], forced: bool = False) -> int:
        """``batch``'s head completed (it is out of its queue): release it, or
        move it behind its next open fence. Returns the ids released.
        ``forced``: the head did not complete, :meth:`force_release_all`
        passed it; what is released counts in ``force_released``, not in
        ``reclaimed`` and the fence latencies (no fence completed).

        The fences after the head are asked in order and the walk stops at
        the first still open, which becomes the head (in explicit mode:
        the first not retired; nothing is asked). Those found complete are
        passed for good (``at`` moves past them): a done fence stays done,
        so none is asked again, and a batch behind n fences that complete
        one by one costs O(n + reclaim passes) queries in all, not O(n^2).
        The fences behind the new head are not asked yet: one of them that
        faults quarantines the batch when the walk reaches it (as a faulted
        fence behind an open head always did). A fence that raises (an
        ``Exception``, or an answer that is not a yes or no) quarantines
        the batch; a ``query()`` raising what is not an ``Exception``
        (``KeyboardInterrupt``, ``CancelledError``) propagates and leaves
        the batch waiting as it did, behind its head.
        """
        more = batch.more
        if more:
            at = start = batch.at
            end = len(more)
            answers = self.answers
            explicit = self.explicit
            fence = batch.fence
            done: FenceAnswer  # a bool, or a query()'s 0/1 until is_done reads it
            # Out of every queue while its fences are asked: listed for a
            # force_release that a query() makes (it drops its fences from
            # this batch's remaining ones, read again below).
            settling = self._settling
            settling.append(batch)
            try:
                while at < end:
                    fence = more[at]
                    if explicit:
                        done = self.is_retired(fence)
                    elif answers is None:
                        done = fence.query()
                        if done is not True and done is not False:
                            done = is_done(done)  # not a yes or no: a fault
                    else:
                        done = self.answer(fence)
                    if batch.more is not more:
                        more, at = _after_force_release(batch, more, start, at, bool(done))
                        start, end = batch.at, len(more)
                        if not done and at < end and more[at] is fence:
                            break
                        continue
                    if not done:
                        break
                    at += 1
            except Exception as exc:  # a faulted stream
                self._fault_batch(batch, fence, exc)
                return 0
            except BaseException:
                # A query() raised what is not an Exception (KeyboardInterrupt,
                # CancelledError): the batch waits as it did, behind its head.
                self._enqueue(batch, notify=False)
                raise
            finally:
                settling.pop()
            if at < end:
                batch.fence = fence
                at += 1
                if at < end:
                    batch.at = at
                else:
                    batch.more = ()
                    batch.at = 0
                self._enqueue(batch)
                return 0
            batch.more = ()
            batch.at = 0
        n = batch.n
        if self.agreed_overdue:
            self.agreed_overdue.discard(batch.did)
        self.pending -= n
        if forced:
            self._release_items(batch.items)
            self.force_released += n
            return n
        latency = self._clock() - batch.t0
        self.fence_latencies.append(latency)
        self.fence_histogram.observe(latency)
        self._release_items(batch.items)
        self.reclaimed += n
        return n

    def _refill(
        self, key: int, queue: collections.deque[Deferred[T]], keep: list[Deferred[T]]
    ) -> None:
        """Stream ``key``'s ``queue`` holds ``keep`` now (dropped when empty).

        In place, never a new deque: a :meth:`reclaim` walking this queue
        may be under way, this call made from a ``query()`` it asked (or a
        task an eager task factory ran there). It holds the queue it walks
        and re-reads its head after each ``query()``: in place, it sees the
        batches taken out here; a new deque would leave it walking the old
        one, settling again a batch settled here (its ids handed out twice)
        and one left in the new queue (settled twice later).
        """
        queue.clear()
        if keep:
            queue.extend(keep)
        elif self._streams.get(key) is queue:
            del self._streams[key]

    # ------------------------------------------------------------ force release

    def force_release(self, fence: Fence) -> int:
        """Treat ``fence`` as completed for every batch waiting on it.

        The escape hatch for a fence known never to complete (its work is
        dead): batches waiting behind ``fence`` settle as if it had completed
        (released, or moved behind their next open fence) and ``fence`` is
        dropped from every other batch's remaining fences. Never asks
        ``fence`` anything. Returns the ids released; 0 if it held nothing.
        O(pending batches).

        Made from a ``query()`` that a call of this ledger asked (a reclaim
        walking its queues or side list, another force_release or a
        conclude settling its batches), it also finds the batches that call
        holds out of every queue: those waiting behind ``fence`` it settles
        itself (the holder then leaves them alone: no id is released
        twice), and ``fence`` is dropped from the rest's remaining fences,
        including a batch whose further fences are being asked, which that
        call then releases (counted there, not here) or moves behind its
        next open one.
        """
        return self.force_release_all((fence,))

    def force_release_all(self, fences: Sequence[Fence]) -> int:
        """:meth:`force_release` of every fence in ``fences`` at once: each
        is dropped from every batch's remaining fences before any batch
        settles, so none of them is asked anything (a batch behind two of
        them is released, not asked about the second). Returns the ids
        released. O(pending batches), however many fences.
        """
        ids = {id(f) for f in fences}
        for f in fences:
            self._unagreed_faults.pop(id(f), None)  # the operator's verdict now
        hits: list[Deferred[T]] = []
        for key, queue in list(self._streams.items()):
            if not any(id(b.fence) in ids or b.rest for b in queue):
                continue
            keep: list[Deferred[T]] = []
            for batch in queue:
                if batch.rest and any(id(f) in ids for f in batch.rest):
                    batch.rest = tuple(f for f in batch.rest if id(f) not in ids)
                if id(batch.fence) in ids:
                    hits.append(batch)
                    continue
                keep.append(batch)
            self._refill(key, queue, keep)
        if self._unordered:
            keep_list: list[Deferred[T]] = []
            for batch in self._unordered:
                if batch.rest and any(id(f) in ids for f in batch.rest):
                    batch.rest = tuple(f for f in batch.rest if id(f) not in ids)
                if id(batch.fence) in ids:
                    hits.append(batch)
                    continue
                keep_list.append(batch)
            self._unordered = keep_list
            self._drop_solo()
        if self._held or self._settling:
            self._take_held(ids, hits)
        return self._settle_held(hits, forced=True)

    def _take_held(self, ids: set[int], hits: list[Deferred[T]]) -> None:
        """:meth:`force_release_all` made while calls hold batches out of
        every queue (this one made from a ``query()`` they asked): drop the
        fences ``ids`` from those batches' remaining ones, and take the ones
        waiting behind one of them (their holder's slot goes None, so it
        settles them no more) into ``hits``. A batch :meth:`_settle` is
        asking the further fences of is past its head: it reads its
        remaining fences again. O(batches held)."""
        for batch in self._settling:
            if batch.more and any(id(f) in ids for f in batch.rest):
                batch.rest = tuple(f for f in batch.rest if id(f) not in ids)
        for held in self._held:
            for index, found in enumerate(held):
                if found is None:
                    continue
                if found.more and any(id(f) in ids for f in found.rest):
                    found.rest = tuple(f for f in found.rest if id(f) not in ids)
                if id(found.fence) in ids:
                    held[index] = None
                    hits.append(found)
                    self._taken += 1

    def _settle_held(self, hits: list[Deferred[T]], forced: bool = False) -> int:
        """:meth:`_settle` each of ``hits`` (out of every queue), in order;
        the ids released. ``hits`` is held (``_held``) meanwhile: a
        ``force_release`` that a ``query()`` asked here makes takes those
        not settled yet that it names (settling them itself), and they are
        skipped here."""
        released = 0
        held = cast("list[Deferred[T] | None]", hits)
        self._held.append(held)
        try:
            for index, batch in enumerate(held):
                if batch is None:
                    continue  # taken by a force_release made meanwhile
                held[index] = None
                try:
                    released += self._settle(batch, forced=forced)
                except BaseException:
                    # Mid-way (see _settle): the batches not yet settled wait as
                    # they did, behind the fence; those settled stay settled.
                    for later in held[index + 1 :]:
                        if later is not None:
                            self._enqueue(later, notify=False)
                    raise
        finally:
            self._held.pop()
        return released

    # ------------------------------------------------------------ faults

    def _fault_batch(self, batch: Deferred[T], fence: Fence, exc: BaseException) -> None:
        """Quarantine a pending batch (already out of its queue)."""
        if self.agreed_overdue:
            self.agreed_overdue.discard(batch.did)
        self.pending -= batch.n
        self._fault(batch.items, batch.n, fence, exc)

    def _fault(
        self,
        items: list[T],
        n: int,
        fence: Fence,
        exc: BaseException,
        *,
        report: bool = True,
    ) -> None:
        """Quarantine ``n`` ids because ``fence`` raised ``exc``, and report it.

        ``report=False`` quarantines only: a caller that meets one faulted
        fence for several ids in one call reports them together
        (:meth:`_report_fault`) once it has them all.
        """
        self._quarantine_items(items)
        self.quarantined += n
        if report:
            self._report_fault(fence, exc, items, n)

    def _report_fault(self, fence: Fence, exc: BaseException, items: list[T], n: int) -> None:
        """Count, log and hand to ``on_fault`` the ``n`` ids just quarantined.

        A fence is counted in ``fence_errors`` and logged as an error once,
        however many calls meet it (one faulted step fence holds a whole
        batch, freed request by request); the first call that quarantines
        more ids behind a fence already reported logs a warning, the later
        ones log at DEBUG with a running count (a batch of hundreds freed
        one by one must not log a line each). The last
        ``_FAULTS_REMEMBERED`` faulted fences are remembered, weakly where
        the fence allows it: a transfer handle may own a large buffer, which
        the pool must not keep alive. For the same reason the error kept
        in ``last_fence_error`` keeps no traceback that reaches the calling
        stack (:func:`_drop_pinning_tracebacks`). ``on_fault``
        runs every time: the owner sheds the waiters that can no longer
        fit, which more quarantine may add.
        """
        faulted = self._faulted
        if remembers_fence(faulted, fence):
            faulted.move_to_end(id(fence))
            err: BaseException = FenceError(f"fence {fence!r} faulted before: {exc!r}")
            before = self._faulted_more.get(id(fence), 0)
            self._faulted_more[id(fence)] = before + n
            if not before:
                self.log.warning(
                    "fence %r, which faulted before, quarantined %s %s more; more %s "
                    "quarantined behind it are logged at DEBUG (stats() counts them all)",
                    fence,
                    self.unit,
                    _describe(items, n),
                    self.unit,
                )
            elif self.log.isEnabledFor(logging.DEBUG):
                self.log.debug(
                    "fence %r, which faulted before, quarantined %s %s more (%d since its error)",
                    fence,
                    self.unit,
                    _describe(items, n),
                    before + n,
                )
        else:
            err = exc
            if not isinstance(exc, FenceError):
                err = FenceError(f"fence {fence!r} raised {exc!r}")
                err.__cause__ = exc
            remember_fence(faulted, fence)
            self._faulted_more.pop(id(fence), None)  # a collected fence's id, reused
            if len(faulted) > _FAULTS_REMEMBERED:
                self._faulted_more.pop(faulted.popitem(last=False)[0], None)
            self.fence_errors += 1
            _drop_pinning_tracebacks(err)
            self.last_fence_error = err
            self._log_new_fault(fence, exc, items, n)
        if self._on_fault is not None:
            self._on_fault(fence, err)

    def _log_new_fault(self, fence: Fence, exc: BaseException, items: list[T], n: int) -> None:
        """Log a fence's first fault: an ERROR, unless another fence of its
        stream faulted before.

        A faulted stream's fault is sticky (a ``HostStream`` whose work
        raised, a CUDA error): every fence recorded on it later faults too,
        and an engine that keeps recording on a dead stream would log an
        ERROR per fence. So per stream (``stream_key``; each fence of
        unknown origin is its own) the first faulted fence is an ERROR, the
        second a WARNING that says the later ones are logged at DEBUG, with
        a running count; ``fence_errors`` counts every one, and each
        quarantines its ids as always. The newest ``_FAULTS_REMEMBERED``
        faulted streams are remembered. Fences of unknown origin are
        limited per window instead (:meth:`_log_unordered_fault`). The
        records name the caller (``_report_fault``), as they did when it
        logged them itself.
        """
        key = stream_key(fence)
        if key is None:
            self._log_unordered_fault(fence, exc, items, n)
            return
        streams = self._faulted_streams
        before = streams.get(key)
        if before is None:
            streams[key] = 0
            if len(streams) > _FAULTS_REMEMBERED:
                streams.popitem(last=False)
            self.log.error(
                "fence %r faulted; quarantined %s %s: %s",
                fence,
                self.unit,
                _describe(items, n),
                exc,
                stacklevel=2,
            )
            return
        streams[key] = before + 1
        streams.move_to_end(key)
        if not before:
            self.log.warning(
                "fence %r faulted too, on stream %d, whose first faulted fence was logged "
                "as an error (a stream's fault is sticky); quarantined %s %s; later "
                "faulted fences of this stream are logged at DEBUG (stats() counts them all)",
                fence,
                key,
                self.unit,
                _describe(items, n),
                stacklevel=2,
            )
        elif self.log.isEnabledFor(logging.DEBUG):
            self.log.debug(
                "fence %r faulted (%d fences of stream %d since its first); quarantined %s %s",
                fence,
                before + 1,
                key,
                self.unit,
                _describe(items, n),
                stacklevel=2,
            )

    def _log_unordered_fault(
        self, fence: Fence, exc: BaseException, items: list[T], n: int
    ) -> None:
        """Log the first fault of a fence of unknown origin, a few per window.

        Each transfer handle is its own fence, and a peer that dies faults
        every transfer in flight to it at once: one ERROR each was a line
        per transfer and ledger (512 for 256 transfers with their pages).
        So at most ``_UNORDERED_FAULT_ERRORS`` are ERRORs within
        ``_UNORDERED_FAULT_WINDOW_S`` of the first; the next is one WARNING
        saying the rest of the window is logged at DEBUG, and the first
        ERROR after the window says how many went to DEBUG meanwhile.
        ``fence_errors`` counts every one, as always. Called by
        :meth:`_log_new_fault`; the records name ``_report_fault``, as
        its own do (``stacklevel=3``).
        """
        now = self._clock()
        if now >= self._unordered_fault_until:
            self._unordered_fault_until = now + _UNORDERED_FAULT_WINDOW_S
            self._unordered_fault_errors = 0
        logged = self._unordered_fault_errors
        if logged < _UNORDERED_FAULT_ERRORS:
            self._unordered_fault_errors = logged + 1
            quiet, self._unordered_fault_quiet = self._unordered_fault_quiet, 0
            self.log.error(
                "fence %r faulted; quarantined %s %s: %s%s",
                fence,
                self.unit,
                _describe(items, n),
                exc,
                f" ({quiet} more faulted fences of unknown origin were logged at DEBUG "
                "since the last one logged as an error)"
                if quiet
                else "",
                stacklevel=3,
            )
            return
        self._unordered_fault_quiet += 1
        if logged == _UNORDERED_FAULT_ERRORS:
            self._unordered_fault_errors = logged + 1
            self.log.warning(
                "fence %r faulted too: more than %d fences of unknown origin (transfer "
                "handles) faulted within %g s (a dead peer?); quarantined %s %s: %s; the "
                "next ones faulting within that time are logged at DEBUG (stats() "
                "counts them all)",
                fence,
                _UNORDERED_FAULT_ERRORS,
                _UNORDERED_FAULT_WINDOW_S,
                self.unit,
                _describe(items, n),
                exc,
                stacklevel=3,
            )
        elif self.log.isEnabledFor(logging.DEBUG):
            self.log.debug(
                "fence %r faulted (%d faulted fences of unknown origin at DEBUG since the "
                "last error); quarantined %s %s: %s",
                fence,
                self._unordered_fault_quiet,
                self.unit,
                _describe(items, n),
                exc,
                stacklevel=3,
            )

    # ------------------------------------------------------------ views

    def remembers_fault(self, fence: Fence) -> bool:
        """Whether this ledger counted ``fence`` in ``fence_errors`` and
        still remembers it (the newest ``_FAULTS_REMEMBERED`` faulted
        fences): an owner of several ledgers of one unit (KV groups) counts
        such a fence once."""
        return remembers_fence(self._faulted, fence)

    def pending_fences(self) -> list[Fence]:
        """The fences that hold ids: each stream's head first, then the rest.

        Reads copies (as :meth:`batch_groups`): ``KVPagePool.stats()`` counts
        these from a scrape's thread while the owner adds and drops queues.
        """
        queues = [list(q) for q in list(self._streams.values())]
        fences = [q[0].fence for q in queues if q]
        fences.extend(b.fence for q in queues for b in q[1:])
        fences.extend(b.fence for b in list(self._unordered))
        return fences

    def pending_batches(self) -> list[Deferred[T]]:
        """Every pending batch, in deferral order (``did``); O(pending batches)."""
        return sorted(self._batches(), key=lambda b: b.did)

    def batch_groups(self) -> list[list[Deferred[T]]]:
        """Every pending batch, as one list per queue (each stream's, then the
        side list), no list empty; copies, so safe to read from another
        thread while the owner changes the queues (as :meth:`_batches`)."""
        groups = [list(queue) for queue in list(self._streams.values())]
        groups.append(list(self._unordered))
        return [group for group in groups if group]

    def holds(self, fence: Fence) -> bool:
        """Whether any pending batch waits for ``fence`` (at its head or
        behind another fence); O(pending batches), for ``force_release``."""
        return any(
            b.fence is fence or any(f is fence for f in b.rest)
            for b in itertools.chain(self._batches(), self._held_batches())
        )

    def holds_any(self, fences: Sequence[Fence]) -> bool:
        """Whether any pending batch waits for one of ``fences`` (as
        :meth:`holds`); O(pending batches), however many fences."""
        ids = {id(f) for f in fences}
        return any(
            id(b.fence) in ids or any(id(f) in ids for f in b.rest)
            for b in itertools.chain(self._batches(), self._held_batches())
        )

    def _held_batches(self) -> Iterator[Deferred[T]]:
        """The batches calls hold out of every queue now (see ``_held``),
        empty but while a ``query()`` they asked runs: a batch held there
        waits for its fences as any other."""
        for held in self._held:
            yield from (b for b in held if b is not None)
        yield from self._settling

    def waiting_on(self, fences: Sequence[Fence]) -> list[Fence]:
        """Those of ``fences`` that a pending batch waits for now (as the
        fence it waits for, the one its owner watches): first those on a
        stream, then those of unknown origin, each in ``fences``' order.

        For the fence wake-up: the watcher's poller let go of ``fences``
        (done or faulted there) and the reclaim just asked them again; the
        ones still waited for answered "not done" here. O(len(fences) + the
        side list + the queues of the streams they name), the order of one
        :meth:`reclaim`, never a walk of every stream's queue.
        """
        found: list[Fence] = []
        unknown: list[Fence] = []
        for fence in fences:
            key = stream_key(fence)
            if key is None:
                unknown.append(fence)
            else:
                queue = self._streams.get(key)
                if queue and any(b.fence is fence for b in queue):
                    found.append(fence)
        if unknown and self._unordered:
            if len(unknown) == 1:
                # The usual case (one transfer landed): a plain loop, which
                # measured 4x faster than building the set below.
                fence = unknown[0]
                for batch in self._unordered:
                    if batch.fence is fence:
                        found.append(fence)
                        break
            else:
                side = {id(b.fence) for b in self._unordered}
                found.extend(fence for fence in unknown if id(fence) in side)
        return found

    def _batches(self) -> Iterator[Deferred[T]]:
        # Copies (each one C call, so atomic under the GIL): stats() may scan
        # from another thread while the owner changes the queues.
        for queue in list(self._streams.values()):
            yield from list(queue)
        yield from list(self._unordered)

    # ------------------------------------------------------------ explicit reclaim

    def make_explicit(self) -> None:
        """Switch to scheduler-driven reclaim (``reclaim="explicit"``).

        From now on the ledger never asks a fence whether it has completed:
        :meth:`reclaim` returns 0, a free waits behind every fence it names
        (the newest per stream) unless that fence was already retired, and
        ids return only through :meth:`retire`, :meth:`apply_agreement`,
        :meth:`conclude` and ``force_release``. The ``on_pending`` hook is
        no longer called (an owner must not arrange wake-ups). Call it on a
        fresh ledger (nothing pending).
        """
        if self.pending or self.quarantined:
            raise RuntimeError("make_explicit() needs a ledger with nothing pending")
        self.explicit = True

    @property
    def deferral_counter(self) -> int:
        """Deferral ids issued so far (the next batch gets this one)."""
        return self._next_did

    def is_retired(self, fence: Fence) -> bool:
        """Whether :meth:`retire` has covered ``fence`` (an ordered fence whose
        stream was retired up to its ``seq`` or past it)."""
        key = stream_key(fence)
        if key is None:
            return False
        mark = self._retired.get(key)
        return mark is not None and getattr(fence, "seq", 0) <= mark

    def retire(self, fence: Fence) -> int:
        """The scheduler processed the step ``fence`` ends: release what waits on it.

        ``fence`` must be ordered (``stream_key``/``seq``; the caller checks
        with :func:`check_ordered`). Every batch queued behind a fence of
        that stream with ``seq <= fence.seq`` settles in record order (it is
        released, or moves behind its next fence not yet retired), and later
        frees behind such fences are free at once. Never calls ``query()``.
        Returns the ids released (0 if nothing waited on it).
        """
        key = stream_key(fence)
        assert key is not None
        seq: int = getattr(fence, "seq", 0)
        mark = self._retired.get(key)
        if mark is None or seq > mark:
            self._retired[key] = seq
        queue = self._streams.get(key)
        if not queue:
            return 0
        released = 0
        while queue and queue[0].seq <= seq:
            released += self._settle(queue.popleft())
        if not queue and self._streams.get(key) is queue:
            del self._streams[key]
        return released

    def waits_on_stream(self, key: int) -> int:
        """How many batches wait behind a fence of stream ``key`` (explicit
        mode: until a :meth:`retire` of it): those queued behind one (their
        head), and those that wait for one after their head (a free behind
        fences of several streams queues behind the first; a retire of a
        later one only marks it, read when the walk reaches it). O(pending
        batches): for :meth:`forget_stream`'s check, not a hot path."""
        queue = self._streams.get(key)
        waiting = len(queue) if queue else 0
        for other in [*self._streams.values(), self._unordered]:
            if other is queue:
                continue  # their heads are of this stream: counted above
            for batch in other:
                if batch.more and any(stream_key(f) == key for f in batch.rest):
                    waiting += 1
        return waiting

    def stream_uses(self, key: int) -> tuple[list[Fence], int]:
        """The fences of stream ``key`` recorded as uses of allocated rows
        that a retire of it covers, and how many rows carry one it does
        not: see :meth:`SlotLedger.stream_uses`. None here (a ledger
        without recorded uses: pages)."""
        return [], 0

    def forget_stream(self, key: int) -> bool:
        """Drop the retired mark of stream ``key``; True if there was one.

        The marks are the only explicit-mode state that outlives the
        batches: one per stream key ever retired (about 32 B), so a
        ``new_stream_key()`` per connection, retired for weeks, grows them
        without bound unless its owner forgets each key it is done with.
        Nothing is pruned by the ledger itself: a mark forgotten on one
        rank only would make a later free behind an old fence of that
        stream free at once there and wait elsewhere. The owner checks
        :meth:`waits_on_stream` first (every ledger of the call, so a
        refusal changes nothing): a batch that still waits for a fence of
        the stream, as its head or after it, would otherwise lose the
        retire that covered it and wait for one that never comes. After
        it, a fence of that stream is no longer known retired: a free
        behind one waits, for a retire of the stream or for ``agree()``.
        """
        return self._retired.pop(key, None) is not None

    def conclude(self, fence: Fence, error: BaseException | None) -> int:
        """``fence`` was waited for (``synchronize()`` returned, or raised
        ``error``): settle every batch whose head it is, as :meth:`retire`
        would for an ordered fence; quarantine them if it raised. For an
        explicit owner's ``drain()``, whose outcome (nothing pending) does not
        depend on timing. Returns the ids released. O(pending batches).
        """
        self._unagreed_faults.pop(id(fence), None)  # settled here now
        if error is None and stream_key(fence) is not None:
            return self.retire(fence)
        hits: list[Deferred[T]] = []
        for key, queue in list(self._streams.items()):
            if any(b.fence is fence for b in queue):
                hits.extend(b for b in queue if b.fence is fence)
                self._refill(key, queue, [b for b in queue if b.fence is not fence])
        hits.extend(b for b in self._unordered if b.fence is fence)
        self._unordered = [b for b in self._unordered if b.fence is not fence]
        self._drop_solo()
        released = 0
        if error is None:
            released = self._settle_held(hits)
        elif hits:
            items: list[T] = []
            n = 0
            for batch in hits:
                self.agreed_overdue.discard(batch.did)
                self.pending -= batch.n
                self._fault(batch.items, batch.n, fence, error, report=False)
                items.extend(batch.items)
                n += batch.n
            self._report_fault(fence, error, items, n)
        return released

    # ------------------------------------------------------------ agreement

    def agreement_flags(
        self,
        batches: Sequence[Deferred[T]],
        cache: dict[int, tuple[Fence, int, BaseException | None]],
        overdue_after: float | None,
        now: float,
        interrupted: list[BaseException] | None = None,
    ) -> list[int]:
        """This replica's view of ``batches`` (in deferral order): three
        flags per batch, ``[done, overdue, faulted]`` each 0 or 1.

        ``done``: every fence the batch waits for is retired or answers
        ``query()`` True here; ``faulted``: one of them raised (an
        interrupt aside, below); ``overdue``: not done and pending for
        ``overdue_after`` seconds or more. Each fence is asked at most once
        per ``cache`` (shared by every ledger of one agreement; it keeps the
        fences alive while it lives). A ``CancelledError`` (or another
        ``BaseException`` but the two below) from a synchronous ``query()``
        is the handle's own state (a cancelled future it wraps), not this
        task's cancellation, and repeats: a fault, as for ``wait_fence``. A
        ``KeyboardInterrupt`` or ``SystemExit`` goes to ``interrupted`` and
        no fence is asked after it (the flags then mean nothing: the caller
        still joins the collective, the other ranks being in it, and
        settles nothing); without ``interrupted`` it propagates at once. A
        fault seen here stays a fault until an agreement acts on it, even
        if that fence answers True later.
        """
        out: list[int] = []
        for batch in batches:
            done = 1
            faulted = 0
            for f in (batch.fence, *batch.rest):
                if self.is_retired(f):
                    continue
                entry = cache.get(id(f))
                if entry is None:
                    seen = self.unagreed_fault(f)
                    if seen is not None:
                        entry = (f, 2, seen)
                    elif interrupted:  # nothing will be settled: ask nothing more
                        done = 0
                        break
                    else:
                        try:
                            entry = (f, 1 if is_done(f.query()) else 0, None)
                        except Exception as exc:  # a faulted stream
                            entry = (f, 2, exc)
                        except (KeyboardInterrupt, SystemExit) as exc:
                            if interrupted is None:
                                raise
                            interrupted.append(exc)
                            entry = (f, 0, None)
                        except BaseException as exc:  # CancelledError: a fault
                            entry = (f, 2, exc)
                    cache[id(f)] = entry
                if entry[1] == 2:
                    faulted = 1
                    done = 0
                    if entry[2] is not None and self.unagreed_fault(f) is None:
                        self._keep_unagreed_fault(f, entry[2])
                elif entry[1] == 0:
                    done = 0
            overdue = int(
                not done and overdue_after is not None and now - batch.t0 >= overdue_after
            )
            out.extend((done, overdue, faulted))
        return out

    def settled_mark(self) -> tuple[int, int, int]:
        """What moves whenever a pending batch leaves its wait (released by
        a fence or by ``force_release``, or quarantined): an agreement
        reads it with the batches it covers, and :meth:`apply_agreement`
        tells by it whether some of them left meanwhile."""
        return self.reclaimed, self.force_released, self.quarantined

    def unagreed_fault(self, fence: Fence) -> BaseException | None:
        """The error ``fence`` raised at an agreement that settled nothing
        (None if none): still a fault, whatever it answers now."""
        entry = self._unagreed_faults.get(id(fence))
        if entry is None:
            return None
        held, exc = entry
        return exc if _holds(held, fence) else None

    def _keep_unagreed_fault(self, fence: Fence, exc: BaseException) -> None:
        _drop_pinning_tracebacks(exc)
        faults = self._unagreed_faults
        faults[id(fence)] = (_hold(fence), exc)
        if len(faults) > _FAULTS_REMEMBERED:
            faults.popitem(last=False)

    def apply_agreement(
        self,
        batches: Sequence[Deferred[T]],
        flags: Sequence[int],
        cache: dict[int, tuple[Fence, int, BaseException | None]],
        mark: tuple[int, int, int] | None = None,
    ) -> tuple[int, list[Deferred[T]]]:
        """Act on flags agreed by every replica, in deferral order: per
        batch ``[done, overdue, faulted]`` of :meth:`agreement_flags`, done
        reduced by MIN over ranks, overdue and faulted by MAX.

        A batch agreed faulted (a fence raised on some rank) is quarantined,
        whatever other ranks saw; one agreed done is released (all its
        fences completed on every rank); one agreed overdue (and neither:
        not done on some rank past the timeout) joins
        :attr:`agreed_overdue`. Returns the ids released and the batches
        newly agreed overdue. O(pending batches).

        ``mark``: :meth:`settled_mark` when ``batches`` were read. If it
        moved since (code a ``query()`` ran while :meth:`agreement_flags`
        asked it, a ``force_release`` or ``retire``, settled some of them),
        the batches no longer pending are left alone: acting on them would
        release or quarantine their ids a second time.
        """
        skip: list[bool] | None = None
        if mark is not None and mark != self.settled_mark():
            live = {id(b) for b in self._batches()}
            skip = [id(b) not in live for b in batches]
        gone: set[int] = set()
        for i, batch in enumerate(batches):
            if skip is not None and skip[i]:
                continue
            if flags[3 * i] or flags[3 * i + 2]:
                gone.add(batch.did)
        if gone:
            for key, queue in list(self._streams.items()):
                if any(b.did in gone for b in queue):
                    self._refill(key, queue, [b for b in queue if b.did not in gone])
            self._unordered = [b for b in self._unordered if b.did not in gone]
            self._drop_solo()
        released = 0
        newly: list[Deferred[T]] = []
        for i, batch in enumerate(batches):
            if skip is not None and skip[i]:
                continue
            done, overdue, faulted = flags[3 * i : 3 * i + 3]
            if faulted:
                culprit = batch.fence
                local: BaseException | None = None
                for f in (batch.fence, *batch.rest):
                    entry = cache.get(id(f))
                    if entry is not None and entry[1] == 2:
                        culprit, local = f, entry[2]
                        break
                for f in (batch.fence, *batch.rest):
                    self._unagreed_faults.pop(id(f), None)  # acted on now
                if local is not None:
                    err = FenceError(f"fence {culprit!r} faulted here: {local!r}")
                    err.__cause__ = local
                else:
                    err = FenceError(
                        f"fence {batch.fence!r} or another this batch waits for "
                        "faulted on another rank (not here); quarantined on every rank"
                    )
                self._fault_batch(batch, culprit, err)
            elif done:
                batch.rest = ()
                released += self._settle(batch)
            elif overdue and batch.did not in self.agreed_overdue:
                self.agreed_overdue.add(batch.did)
                newly.append(batch)
        return released, newly

    # ------------------------------------------------------------ proof

    def _check_deferrals(self, fail: Callable[[str], None]) -> list[list[T]]:
        """Check the queues' own invariants; return every pending batch's items."""
        items: list[list[T]] = []
        dids: set[int] = set()
        total = 0
        for key, queue in self._streams.items():
            seqs = [b.seq for b in queue]
            if seqs != sorted(seqs):
                fail(f"stream {key} queue out of record order: {seqs}")
            for b in queue:
                if stream_key(b.fence) != key or b.seq != getattr(b.fence, "seq", 0):
                    fail(f"batch {b!r} sits in the queue of stream {key}")
        for b in self._unordered:
            if stream_key(b.fence) is not None:
                fail(f"batch {b!r} of an ordered fence sits in the side list")
        if self._solo_of is self._unordered:
            listed = {id(b) for b in self._unordered}
            for fid, b in self._solo.items():
                if id(b) not in listed or b.rest or id(b.fence) != fid:
                    fail(f"batch {b!r} is indexed as waiting for one fence of unknown origin")
        elif self._solo:
            fail("an index of a side list no longer in use is kept")
        for b in self._batches():
            if b.did in dids or not 0 <= b.did < self._next_did:
                fail(f"batch {b!r} has a duplicate or unissued deferral id")
            dids.add(b.did)
            if any(f is b.fence for f in b.rest):
                fail(f"batch {b!r} waits twice for its head fence")
            if not (0 <= b.at < len(b.more) if b.more else b.at == 0):
                fail(f"batch {b!r} has passed {b.at} of its {len(b.more)} further fences")
            if b.n <= 0 or self._count_items(b.items) != b.n:
                fail(f"batch {b!r} holds {self._count_items(b.items)} ids, not n={b.n}")
            total += b.n
            items.append(b.items)
        if total != self.pending:
            fail(f"pending count {self.pending} != ids in batches {total}")
        return items


def _after_force_release(
    batch: Deferred[Any], more: tuple[Fence, ...], start: int, at: int, done: bool
) -> tuple[tuple[Fence, ...], int]:
    """Where :meth:`Deferrals._settle` goes on once a ``query()`` it asked
    made a ``force_release`` that dropped fences from ``batch``'s remaining
    ones (``more[start:]``, the batch's ``rest`` when the settle began or
    last came here): the batch's new ``more`` and the place in it past the
    fences found complete so far (``more[start:at]``, and ``more[at]``
    when it answered ``done``). ``batch.more`` keeps the order of those
    fences, less the ones dropped, so those found complete that are left
    are its first. Off the hot paths: only after such a call.
    """
    passed = more[start : at + 1 if done else at]
    now = batch.more
    end = len(now)
    place = 0
    for f in passed:
        if place < end and now[place] is f:
            place += 1
    return now, place


def _drop_pinning_tracebacks(err: BaseException) -> None:
    """Drop the tracebacks in ``err``'s chain that pin the calling stack.

    The exception a fence's ``query()`` raised carries a traceback whose
    frames reach, through ``f_back``, every frame of the call that met the
    fault: the pool's and then the engine's (a scheduler step and its
    locals, the fence itself as ``query()``'s ``self``). Kept in
    ``last_fence_error`` it would keep all of that alive until the next
    fault. A traceback from another thread (a ``HostStream``'s worker, whose
    fault a ``HostFence`` reports as the cause) reaches none of this stack
    and is kept. Runs once per faulted fence, never on a hot path.
    """
    here: set[int] = set()
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        here.add(id(frame))
        frame = frame.f_back
    for exc in chained(err):
        tb = exc.__traceback__
        if tb is not None:
            # Its outermost frame's callers: every later frame of the
            # traceback was called from that one.
            frame = tb.tb_frame
            while frame is not None and id(frame) not in here:
                frame = frame.f_back
            if frame is not None:  # it reaches the calling stack
                exc.__traceback__ = None


def _describe(items: list[Any], n: int, limit: int = 16) -> str:
    """A short rendering of a batch's ``n`` ids for a log line."""
    flat: list[Any] = []
    for part in items:
        if isinstance(part, int):
            flat.append(part)
        else:
            # Only what is shown: a faulted batch may hold a million pages,
            # and this runs on the loop even with logging disabled.
            flat.extend(part[: limit + 1 - len(flat)].tolist())
        if len(flat) > limit:
            return f"{str(flat[:limit])[:-1]}, ...] ({n} in all)"
    return str(flat)
