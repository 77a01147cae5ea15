"""``KVPagePool``: a fenced, vectorised allocator of KV-cache page ids.

A request holds a row of ``req_to_token`` *and* the KV-cache pages whose
token slots that row lists; a page freed while a write into it is still in
flight (a forward, a prefill-to-decode transfer) must not reach its next
owner before that write lands. This module gives pages the row pool's
guarantees, with bookkeeping that costs a few array operations per call
whatever the number of pages:

* :class:`PageLedger`: one byte of state per page (a numpy view of a
  ``bytearray``), a FIFO ring of free page ids (a numpy view of an
  ``array.array``), and pending batches that hold numpy arrays of page ids.
  Its fence machinery (per-stream queues in record order, the side list for
  fences of unknown origin, quarantine, fault accounting) is the row
  ledger's: both are :class:`~asyncpool.deferral.Deferrals`;
* :class:`KVPagePool`: the synchronous API, the page counterpart of
  :class:`~asyncpool.ReqToTokenPool`. It hands out page ids only; the KV
  tensors stay the engine's.

Each page moves through::

    FREE --take--> ALLOCATED --free--> FREE                  (no open fence)
                            \\--free--> PENDING --fences done--> FREE
                                              \\--a fence faulted--> QUARANTINED

Page 0 is reserved padding: never handed out, never accepted. Token slot
``o`` of page ``p`` is ``p * page_size + o`` (what ``req_to_token`` rows
hold). Free pages are reused oldest-freed first.

Every public method is atomic: one that raises an ``Exception`` has changed
nothing. A fence's ``query()`` raising what is not an ``Exception``
(``KeyboardInterrupt``, ``CancelledError``) propagates and leaves every page
decided or as it was (the rule in docs/api.md's contracts): :meth:`clear` interrupted in its
reclaim has already freed the allocated pages. Not thread-safe: call a pool
from one thread (the scheduler's).

Cost (issue 9): an ``alloc(n)`` + ``free`` cycle is mostly fixed per-call
overhead (making and dropping one tensor is about 1 us), so the hot paths
keep numpy calls and Python frames few: ``alloc(1)`` is ``take(1)`` inlined
over a one-id ``array.array`` (``torch.frombuffer``); ``take`` marks up to
``_TINY_MARK`` pages with Python steps; ``free`` of a tensor without fences
skips :meth:`PageLedger.prepare`: one page is checked and freed inline, up
to ``_TINY`` pages of an int64 tensor in one pass
(:meth:`PageLedger._free_now_small`, which a duplicate fails on its own
mark), more through the vectorised check of the tensor's zero-copy numpy
view. Anything a fast path refuses goes the checked way, which raises the
same error as for any other input form (tests/test_kv_pages_fast.py).

A host pool also remembers each tensor of two or more pages it hands out
(``alloc``, and ``detach_pages`` of an owning row pool), with the array
under it and the bytes it held then (:meth:`KVPagePool._hand_out`). Freeing
that very tensor object, unchanged, skips the tensor-to-Python conversion
and the distinctness check: only "still ALLOCATED" is checked (0.8 us of a
3.9 us ``alloc(16)`` + ``free``, measured). Anything else (a view, a copy, a
list, the tensor written into, or freed already in another form) goes the
checked way. The pages of tensors freed in another form are forgotten in
bulk once they outnumber the allocated pages (:meth:`KVPagePool._trim_handed`).
"""

from __future__ import annotations

import array
import itertools
import logging
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn, SupportsIndex, TypeAlias

import numpy as np
import numpy.typing as npt
import torch

from .agreement import agree, check_explicit, check_reclaim_mode, forget_stream
from .base import force_release_fences, log_force_release, log_force_release_many
from .deferral import Deferrals, check_ordered
from .errors import CapacityError, DoubleFreeError, InvalidSlotError, PoolBusyError
from .fences import Fence, Fences, HostStream, check_after, fence_list, record_fence
from .forks import refuse_copy
from .ledger import (
    _CHECKING,
    _NOT_IDS,
    ALLOCATED,
    FREE,
    PENDING,
    QUARANTINED,
    RESERVED,
    STATE_NAMES,
    Rows,
    SlotLedger,
    _attributes,
    as_index,
    describe,
    device_fault,
    index_or_error,
    integral,
)
from .naming import check_name, pool_log, repr_head
from .stats import LatencySummary
from .tables import ID_DTYPES, check_device, host_to_device

__all__ = ["OWNED", "KVGroupStats", "KVPagePool", "KVPageStats", "PageLedger"]

logger: logging.Logger = logging.getLogger(__name__)

PageArray: TypeAlias = npt.NDArray[np.int64]
#: Validated page ids: a short list of Python ints, or an int64 array.
PageIds: TypeAlias = "list[int] | PageArray"

# Up to this many pages, free checks and returns Python ints instead of
# making numpy calls (reading a tensor or an int64 array with tolist() and a
# Python step per page beat numpy's per-call overhead there; measured
# crossover 16-32). A row's short record and a trimmed draft take this pass.
_TINY = 16
# Up to this many pages, take marks them ALLOCATED with a Python step per
# page (one numpy fancy assignment costs about as much as eight of those).
_TINY_MARK = 8
_I64 = np.dtype(np.int64)
# KVPagePool remembers the tensors it hands out; past this many of their
# pages beyond its allocated pages it forgets them (KVPagePool._trim_handed).
_HANDED_SLACK = 1024


def _state_0d(state: int) -> npt.NDArray[np.uint8]:
    # A fancy assignment of a 0-d uint8 array skips the conversion of a
    # Python int (about 130 ns of 530 for 256 pages). Read-only: shared.
    value = np.array(state, dtype=np.uint8)
    value.flags.writeable = False
    return value


#: A page a row of the served AsyncReqToTokenPool owns (taken by ``admit``
#: or ``extend``): allocated, but only that row's ``free`` (or
#: ``detach_pages``, which makes it ALLOCATED) may give it back;
#: ``KVPagePool.free`` refuses it, as it would skip the row's fences.
OWNED = 7
PAGE_STATE_NAMES = (*STATE_NAMES, "owned by a row")

_ALLOCATED_0D = _state_0d(ALLOCATED)
_OWNED_0D = _state_0d(OWNED)
_FREE_0D = _state_0d(FREE)
_CHECKING_0D = _state_0d(_CHECKING)
_TOP_BYTE = 7 if sys.byteorder == "little" else 0  # of an int64's eight


def _dtype_error(dtype: object) -> InvalidSlotError:
    return InvalidSlotError(f"page ids must be integers, got an array of dtype {dtype}")


def _index(value: object) -> int:
    """One page id from a list element: an int, a numpy or 0-d torch integer
    scalar (the row pool's :func:`~asyncpool.ledger.as_index`); bools and
    floats are refused."""
    return index_or_error(value, "page ids must be integers")


#: The largest ``num_pages``: the vectorised checks number a call's pages
#: in int32 (``PageLedger._mark``), and the ledger keeps a ring of int64 ids
#: and a state byte per page.
MAX_NUM_PAGES = 2**31
#: The bound of ``num_pages * page_size``: token slot ids
#: (``page * page_size + offset``, :meth:`KVPagePool.slots`) are what
#: ``req_to_token`` rows hold, in int32.
MAX_SLOTS = 2**31


def has_duplicates(ids: npt.NDArray[np.int64]) -> bool:
    """True if an id occurs twice in ``ids`` (1-D): one sort, for the
    invariant checks (numpy 2's hashing ``np.unique`` took 0.7 s for a
    million ids where the sort takes 10 ms)."""
    if len(ids) < 2:
        return False
    ordered = np.sort(ids)
    return bool((ordered[1:] == ordered[:-1]).any())


def check_num_pages(num_pages: object) -> int:
    """``num_pages`` as a Python int; :class:`CapacityError` unless it is an
    integer (any type :func:`~asyncpool.ledger.integral` converts) in
    ``2..MAX_NUM_PAGES`` (page 0 is reserved)."""
    num_pages = integral(num_pages)
    if num_pages.__class__ is not int or num_pages < 2:
        raise CapacityError(
            f"num_pages must be an int >= 2 (page 0 is reserved), got {describe(num_pages)}"
            + ("" if isinstance(num_pages, int) else f" of type {type(num_pages).__name__}")
        )
    assert isinstance(num_pages, int)
    if num_pages > MAX_NUM_PAGES:
        raise CapacityError(
            f"num_pages must be at most 2**31 (a call's pages are numbered in int32), "
            f"got {num_pages!r}"
        )
    return num_pages


class PageLedger(Deferrals[PageArray]):
    """Bookkeeping for ``num_pages - 1`` pages; see the module docstring.

    For an owning pool: :meth:`take` hands out page ids as an array,
    :meth:`free` takes them back behind fences, :meth:`put_back` returns ids
    taken but never given to anyone. ``on_pending(fence)`` is called once for
    each batch that starts waiting behind ``fence``; ``on_fault(fence,
    error)`` when a fence faults (its pages are quarantined). The pending
    queues, :meth:`reclaim` and the fault counters come from
    :class:`~asyncpool.deferral.Deferrals`.
    """

    unit = "pages"

    def __init__(
        self,
        num_pages: int,
        *,
        on_pending: Callable[[Fence], None] | None = None,
        on_fault: Callable[[Fence, BaseException], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        latency_window: int = 4096,
    ) -> None:
        num_pages = check_num_pages(num_pages)
        super().__init__(
            on_pending=on_pending, on_fault=on_fault, clock=clock, latency_window=latency_window
        )
        self.num_pages: int = num_pages
        capacity = num_pages - 1
        self.capacity: int = capacity
        # One byte of state per page: the bytearray for Python-int steps, the
        # numpy view (same memory) for vectorised ones.
        self._state_bytes = bytearray(num_pages)
        self._state_bytes[0] = RESERVED
        self._state = np.frombuffer(self._state_bytes, dtype=np.uint8)
        # The FIFO ring of free ids: ``free_count`` ids from ``_head`` on,
        # wrapping at ``capacity``. Same two views.
        # Built from numpy's bytes: a quarter of the time of array("q",
        # range(...)) (4M pages: 30-40 ms against 140-160 ms).
        self._ring_ids = array.array("q", np.arange(1, num_pages, dtype=np.int64).tobytes())
        self._ring = np.frombuffer(self._ring_ids, dtype=np.int64)
        self._head = 0
        self.free_count: int = capacity
        # Pages taken from the ring over the pool's life, and those of them
        # put back. The ring starts as 1..capacity and pages never taken sit
        # behind every other free page in id order (frees go to the tail,
        # put-backs to the head, both of pages taken before), so the k-th
        # never-taken page leaves at the k-th take or later: a page above
        # ``_taken`` was never handed out. No per-page history needed.
        self._taken = 0
        self._returned = 0
        self.peak_allocated: int = 0
        # Scratch for vectorised checks.
        self._all_allocated = bytes([ALLOCATED]) * capacity
        self._all_owned = bytes([OWNED]) * capacity
        self._zero_bytes = bytes(capacity)
        self._mark = np.zeros(num_pages, dtype=np.int32)
        self._iota = np.arange(capacity, dtype=np.int32)
        self._iota_bytes = self._iota.tobytes()

    # ------------------------------------------------------------------ counts

    @property
    def allocated(self) -> int:
        return self.capacity - self.free_count - self.pending - self.quarantined

    @property
    def allocs(self) -> int:
        """Pages handed out over the pool's life (not counting put-backs)."""
        return self._taken - self._returned

    @property
    def frees(self) -> int:
        """Pages given back over the pool's life (each handed-out page once)."""
        return self.allocs - self.allocated

    def state_of(self, page: int) -> str:
        """The state of ``page`` by name (for messages and tests)."""
        return PAGE_STATE_NAMES[self._state_bytes[page]]

    def states(self) -> npt.NDArray[np.uint8]:
        """Every page's state, one byte per page (a read-only copy)."""
        return self._state.copy()

    # ------------------------------------------------------------------ take

    def check_n(self, n: object) -> int:
        """Validate a requested page count; raise :class:`CapacityError`.

        Accepts a Python int or an integer scalar (numpy, a 0-d torch
        tensor), as the row pool does; returns it as a Python int. Floats and
        bools are refused.
        """
        if n.__class__ is not int:
            try:
                n = as_index(n)
            except TypeError:
                raise CapacityError(
                    f"a page count must be an integer, got {describe(n)} of type {type(n).__name__}"
                ) from None
        assert isinstance(n, int)
        if n < 1:
            raise CapacityError(f"cannot allocate {n} pages: a request needs at least 1 page")
        if n > self.capacity:
            raise CapacityError(
                f"cannot allocate {n} pages: the pool has only {self.capacity} "
                "(num_pages - 1, page 0 is reserved)"
            )
        return n

    def take(self, n: int, mark: int = ALLOCATED) -> PageArray | None:
        """Hand out the ``n`` oldest-freed pages as a fresh int64 array (never
        a view of the ring), or None when fewer are free.

        ``n`` must already be validated (an int in ``1..capacity``). Does not
        reclaim: the caller decides when to. ``mark``: the state they take,
        ALLOCATED, or OWNED for a row's pages.
        """
        free_count = self.free_count
        if n > free_count:
            return None
        capacity = self.capacity
        head = self._head
        end = head + n
        ring = self._ring
        if end < capacity:
            out = ring[head:end].copy()
            self._head = end
        elif end == capacity:
            out = ring[head:].copy()
            self._head = 0
        else:
            out = np.concatenate((ring[head:], ring[: end - capacity]))
            self._head = end - capacity
        if n == 1:
            self._state_bytes[self._ring_ids[head]] = mark
        elif n <= _TINY_MARK:
            state = self._state_bytes
            for page in out.tolist():
                state[page] = mark
        else:
            self._state[out] = _OWNED_0D if mark == OWNED else _ALLOCATED_0D
        self.free_count = free_count = free_count - n
        self._taken += n
        allocated = capacity - free_count - self.pending - self.quarantined
        if allocated > self.peak_allocated:
            self.peak_allocated = allocated
        return out

    def put_back(self, pages: object, expect: int = ALLOCATED) -> None:
        """Return pages handed out by :meth:`take` but never given to anyone.

        They go back to the head of the free ring in the order given, ahead
        of every other free page (for a waiter cancelled after its grant:
        the next taker gets them first). Raises as
        :meth:`free` does, changing nothing, unless they are distinct
        allocated pages.
        """
        ids, _ = self.prepare(pages, "put back", expect)
        n = len(ids)
        if not n:
            return
        arr = np.asarray(ids, dtype=np.int64)
        capacity = self.capacity
        head = self._head - n
        if head < 0:
            head += capacity
        end = head + n
        if end <= capacity:
            self._ring[head:end] = arr
        else:
            split = capacity - head
            self._ring[head:] = arr[:split]
            self._ring[: end - capacity] = arr[split:]
        self._state[arr] = _FREE_0D
        self._head = head
        self.free_count += n
        self._returned += n

    # ------------------------------------------------------------------ free

    @staticmethod
    def check_fence(fence: object, name: str = "fence") -> None:
        """Raise TypeError unless ``fence`` has ``query()`` and ``synchronize()``."""
        SlotLedger.check_fence(fence, name)

    def free(self, pages: object, fences: Sequence[Fence] = ()) -> int:
        """Return allocated pages; return how many are free at once.

        The pages wait for every fence in ``fences`` (the newest per stream);
        with none incomplete they are free at once, else PENDING until
        :meth:`reclaim` sees the fences done. A fence already faulted
        quarantines them. Raises, changing nothing, for a non-fence, and as
        :meth:`prepare` does for bad page ids.
        """
        for f in fences:
            self.check_fence(f)
        ids, owned = self.prepare(pages)
        return self.free_prepared(ids, owned, fences)

    def prepare(
        self, pages: object, what: str = "freed", expect: int = ALLOCATED
    ) -> tuple[PageIds, bool]:
        """Validate pages about to be freed; return ``(ids, owned)``.

        ``pages`` is a 1-D integer tensor or numpy array, a list, tuple or
        other iterable of ints (numpy or 0-d torch integers accepted per
        element), or a single int. ``ids`` are distinct allocated page ids,
        a list of ints for a few pages or an int64 array; ``owned`` says the
        array is a fresh copy the caller may keep (else it may alias the
        caller's memory). Raises :class:`InvalidSlotError` for page 0, ids
        out of range, non-integer ids or dtypes, duplicates and pages not
        allocated, :class:`DoubleFreeError` for pages already free or
        pending. ``expect``: the state they must be in (OWNED for a row's
        own pages). Changes nothing.
        """
        cls = pages.__class__
        if cls is torch.Tensor:
            assert isinstance(pages, torch.Tensor)
            try:
                shape = pages.shape
            except RuntimeError:  # a nested tensor has no shape
                raise InvalidSlotError(
                    f"pages {what} must be a 1-D sequence of page ids, got a nested "
                    f"{_attributes(pages)}"
                ) from None
            if len(shape) == 1 and shape[0] > self.capacity:
                return self._too_many(pages, what, expect)
            if len(shape) == 1 and shape[0] <= _TINY and pages.layout is torch.strided:
                try:
                    small = pages.tolist()
                except (RuntimeError, NotImplementedError) as exc:
                    if device_fault(pages, exc):
                        raise  # a device fault (CUDA) is not bad input: as it is
                    small = None  # meta, quantized, sub-byte: _tensor_array refuses it
                if small is not None and self._small_ok(small, expect):
                    return small, True
            try:
                arr = pages.numpy()  # zero-copy on the CPU
            except (TypeError, RuntimeError):  # on a device, needs grad, or no numpy dtype
                return self._checked(*self._tensor_array(pages), what, expect)
            if arr.dtype is _I64 and arr.strides == (8,):  # 1-D, contiguous int64: as is
                return self._checked(arr, False, what, expect)
            return self._checked(*self._numpy_array(arr, owned=False), what, expect)
        if cls is np.ndarray:
            assert isinstance(pages, np.ndarray)
            if pages.dtype is _I64 and len(pages.shape) == 1 and pages.shape[0] <= _TINY:
                # A few int64 ids (a row's short record, a trimmed draft):
                # the one Python pass, as for a short tensor or list.
                small = pages.tolist()
                if self._small_ok(small, expect):
                    return small, True
            if pages.ndim == 1 and pages.shape[0] > self.capacity:
                return self._too_many(pages, what, expect)
            return self._checked(*self._numpy_array(pages, owned=False), what, expect)
        if cls is list or cls is tuple:
            assert isinstance(pages, (list, tuple))
            if len(pages) <= _TINY and self._small_ok(pages, expect):
                return list(pages), True
            return self._checked(self._list_array(pages, what), True, what, expect)
        if cls is int:
            assert isinstance(pages, int)
            return self._checked(self._list_array([pages], what), True, what, expect)
        if isinstance(pages, torch.Tensor):  # a subclass
            return self._checked(*self._tensor_array(pages), what, expect)
        if isinstance(pages, np.ndarray):
            return self._checked(*self._numpy_array(pages, owned=False), what, expect)
        if isinstance(pages, (np.integer, int)) and not isinstance(pages, bool):
            return self._checked(self._list_array([pages], what), True, what, expect)
        if isinstance(pages, Iterable) and not isinstance(pages, _NOT_IDS):
            # At most capacity + 1 ids read: more cannot be distinct pages
            # (range(1, 2**40) is refused, not listed until memory runs out).
            seq = list(itertools.islice(pages, self.capacity + 1))
            return self._checked(self._list_array(seq, what), True, what, expect)
        raise InvalidSlotError(
            "pages must be a 1-D integer tensor or numpy array, or a sequence of ints, "
            f"got {type(pages).__name__}"
        )

    def _too_many(self, pages: Any, what: str, expect: int) -> tuple[PageIds, bool]:
        """Raise the error for a 1-D tensor or array of more than ``capacity`` ids.

        They cannot all be distinct pages in range, and neither can their
        first ``capacity + 1``: checking those (a slice: a view, no copy)
        raises the error the whole call would, for its first bad id, without
        converting the rest (a zero-stride ``expand`` of 2**40 ids made an
        8 TiB copy and raised ``MemoryError``).
        """
        head = self.capacity + 1
        if isinstance(pages, torch.Tensor):
            if pages.layout is not torch.strided:  # sparse: refused whole, uncopied
                return self._checked(*self._tensor_array(pages), what, expect)
            return self._checked(*self._tensor_array(pages[:head]), what, expect)
        return self._checked(*self._numpy_array(pages[:head], owned=False), what, expect)

    def free_prepared(
        self, ids: PageIds, owned: bool, fences: Sequence[Fence] = (), hold: int | None = None
    ) -> int:
        """:meth:`free` for ids that :meth:`prepare` returned, fences checked.

        ``hold``: the state the ids are in (``ALLOCATED``), for a caller
        whose ids nothing else holds while the fences are asked: they are
        marked CHECKING meanwhile, so that a call made from a ``query()``
        (code not ours, which may call the pool back) that frees them
        again is refused as the double free it is (:meth:`_page_error`),
        not deferred twice. A row's pages need no hold: their row is held
        (:meth:`SlotLedger.hold`), and only it may give them back.
        """
        n = len(ids)
        if not n:
            return 0
        if fences:
            if hold is not None and not self.explicit:
                waits, faulted, error = self._open_fences_holding(ids, fences, hold)
            else:
                waits, faulted, error = self._open_fences(fences)
            if faulted is not None:
                self._fault([self._own(ids, owned)], n, faulted, error)
                return 0
            if waits:
                arr = self._own(ids, owned)
                self._state[arr] = PENDING
                self._defer(waits[0], [arr], n, self._clock(), tuple(waits[1:]))
                return 0
        self._push(ids)
        return n

    def _open_fences_holding(
        self, ids: PageIds, fences: Sequence[Fence], hold: int
    ) -> tuple[list[Fence], Fence | None, Any]:
        """:meth:`_open_fences` with ``ids`` marked CHECKING while the
        fences are asked (the caller then marks them PENDING, FREE or
        QUARANTINED); put back in ``hold`` if a ``query()`` raises what is
        not an ``Exception``, which propagates."""
        state = self._state_bytes
        if ids.__class__ is list:
            for page in ids:
                state[page] = _CHECKING
        else:
            self._state[ids] = _CHECKING_0D
        try:
            return self._open_fences(fences)
        except BaseException:
            if ids.__class__ is list:
                for page in ids:
                    state[page] = hold
            else:
                self._state[ids] = _state_0d(hold)
            raise

    @staticmethod
    def _own(ids: PageIds, owned: bool) -> PageArray:
        if ids.__class__ is list:
            return np.array(ids, dtype=np.int64)
        assert isinstance(ids, np.ndarray)
        return ids if owned else ids.copy()

    def _push(self, ids: PageIds) -> None:
        """Append ids to the tail of the free ring and mark them FREE."""
        n = len(ids)
        capacity = self.capacity
        tail = self._head + self.free_count
        if tail >= capacity:
            tail -= capacity
        if ids.__class__ is list:
            state = self._state_bytes
            ring = self._ring_ids
            for page in ids:
                state[page] = FREE
                ring[tail] = page
                tail += 1
                if tail == capacity:
                    tail = 0
        else:
            end = tail + n
            if end <= capacity:
                self._ring[tail:end] = ids
            else:
                split = capacity - tail
                self._ring[tail:] = ids[:split]
                self._ring[: end - capacity] = ids[split:]
            self._state[ids] = _FREE_0D
        self.free_count += n

    def free_owned(self, arr: PageArray, expect: int = ALLOCATED) -> bool:
        """Free pages an owner took and kept unchanged (no fence); True if done.

        For an owner's own record, as :meth:`take` made it and verified
        unchanged since (its bytes equal those it had): a 1-D contiguous
        int64 array of distinct in-range ids. Only what can change behind
        the owner's back is checked: every page is still ALLOCATED (not
        freed in another form). Vectorised, well under 1 us for any count;
        returns False, having changed nothing, if the check fails, so that
        the caller's checked path (:meth:`prepare`) raises the error for it.
        """
        every = self._all_owned if expect == OWNED else self._all_allocated
        if not every.startswith(self._state[arr].tobytes()):
            return False
        self._push(arr)
        return True

    def all_in(self, arr: PageArray, expect: int = OWNED) -> bool:
        """True if every page of ``arr`` is in state ``expect``; changes nothing.

        For an owner's own record, verified unchanged (its bytes equal those
        it had, so its ids are distinct and in range): the one check
        :meth:`free_owned` makes, for a free behind fences, in place of
        :meth:`prepare`'s (which also proves the ids distinct: a scatter and
        a gather of the whole array, about half a long record's free).
        """
        every = self._all_owned if expect == OWNED else self._all_allocated
        return every.startswith(self._state[arr].tobytes())

    def unfree(self, ids: PageArray, expect: int = ALLOCATED) -> None:
        """Undo the no-fence fast free of ``ids`` (:meth:`free_owned` or
        :meth:`_free_now_small` answering True) that was this ledger's last
        change: they leave the tail of the free ring and take ``expect``
        again, as before that free. For an owner freeing several ledgers'
        pages all or nothing (a row with KV groups), one of whose later
        fast frees refused: nothing else may have touched this ledger
        since, so the ring's tail holds exactly these ids. The ring's slots
        past its free ones keep what that free wrote there: never read
        (:meth:`take` reads from the head, :meth:`_push` writes first)."""
        self.free_count -= len(ids)
        self._state[ids] = _OWNED_0D if expect == OWNED else _ALLOCATED_0D

    def _free_now_small(self, ids: list[Any], expect: int = ALLOCATED) -> bool:
        """Free a few pages at once (no fence) in one pass; True if done.

        ``ids`` is what ``tolist()`` of an int64 tensor gave: Python ints,
        or nested lists for a tensor of more than one dimension. One pass
        checks each page (``0 < page``, ALLOCATED, not seen earlier in the
        call: the pass has just marked it FREE) and marks it FREE; on the
        first bad one it puts back every mark it made and returns False,
        having changed nothing, so that the caller's checked path
        (:meth:`prepare`) raises the error for it.
        """
        state = self._state_bytes
        done = 0
        try:
            for page in ids:
                if page <= 0 or state[page] != expect:  # IndexError past the end
                    break
                state[page] = FREE
                done += 1
        except (TypeError, IndexError):  # a nested list, an id past the end
            pass
        n = len(ids)
        if done != n:
            for page in ids[:done]:
                state[page] = expect
            return False
        capacity = self.capacity
        tail = self._head + self.free_count
        if tail >= capacity:
            tail -= capacity
        if n == 1:
            self._ring_ids[tail] = ids[0]
        elif tail + n <= capacity:
            self._ring_ids[tail : tail + n] = array.array("q", ids)
        else:
            ring = self._ring_ids
            for page in ids:
                ring[tail] = page
                tail += 1
                if tail == capacity:
                    tail = 0
        self.free_count += n
        return True

    # ------------------------------------------------------------------ checks

    def _small_ok(self, ids: Sequence[Any], expect: int = ALLOCATED) -> bool:
        """True if a few ids are distinct pages in state ``expect`` (Python ints)."""
        state = self._state_bytes
        num_pages = self.num_pages
        for page in ids:
            if page.__class__ is not int or not 0 < page < num_pages or state[page] != expect:
                return False
        n = len(ids)
        return n < 2 or len(set(ids)) == n

    @staticmethod
    def _tensor_array(pages: torch.Tensor) -> tuple[PageArray, bool]:
        try:
            arr = pages.numpy()  # a float, bool or complex dtype is refused below
        except (TypeError, RuntimeError):  # on a device, needs grad, or no numpy dtype
            if pages.dtype not in ID_DTYPES:  # bool, float, complex, quantized, sub-byte
                if pages.dim() == 1 and not pages.numel():
                    return np.empty(0, dtype=np.int64), True  # no pages
                raise _dtype_error(pages.dtype) from None
            # A negative view (torch._neg_view) reads negated: resolve it.
            try:
                arr = pages.detach().cpu().resolve_neg().numpy()
            except (TypeError, RuntimeError, NotImplementedError) as exc:
                if device_fault(pages, exc):
                    raise  # a device fault (CUDA) is not bad input: as it is
                raise InvalidSlotError(
                    "pages must be a strided integer tensor with data, got a "
                    f"{pages.layout} tensor of {pages.dtype} on {pages.device}"
                ) from None
        return PageLedger._numpy_array(arr, owned=False)

    @staticmethod
    def _numpy_array(arr: npt.NDArray[Any], owned: bool) -> tuple[PageArray, bool]:
        if arr.dtype is _I64 and arr.strides == (8,):  # 1-D, contiguous int64: as is
            return arr, owned
        kind = arr.dtype.kind
        if kind != "i" and kind != "u":
            if arr.ndim == 1 and not arr.size:
                # No ids whatever the dtype (np.array([]) is float64), as
                # for the rows: no pages.
                return np.empty(0, dtype=np.int64), True
            raise _dtype_error(arr.dtype)
        if arr.ndim != 1:
            if arr.ndim:
                raise InvalidSlotError(f"pages must be a 1-D array, got shape {arr.shape}")
            arr = arr.reshape(1)
        if arr.dtype != _I64 or not arr.flags.c_contiguous:
            # uint64 ids past 2**63 wrap negative here and are refused below.
            return arr.astype(np.int64), True
        return arr, owned

    def _list_array(self, seq: Sequence[Any], what: str | None) -> PageArray:
        if not all(v.__class__ is int for v in seq):
            seq = [_index(v) for v in seq]
        try:
            return np.array(seq, dtype=np.int64)
        except OverflowError:  # an id past int64: out of range
            ids = list(seq)
            raise (self._page_error(ids, what) if what else self._range_error(ids)) from None

    def _checked(
        self, arr: PageArray, owned: bool, what: str, expect: int = ALLOCATED
    ) -> tuple[PageArray, bool]:
        """Vectorised check that ``arr`` (int64, 1-D, contiguous) holds distinct
        pages in state ``expect``; raise the error for the first bad id otherwise."""
        n = arr.shape[0]
        if not n:
            return arr, owned
        # No negative id and none past 2**56: every top byte is zero.
        # (x.startswith(y), x a constant at least as long as y: y == x[:len(y)]
        # without the slice.)
        ok = self._zero_bytes.startswith(arr.tobytes()[_TOP_BYTE::8])
        if ok:
            try:
                states = self._state[arr]  # IndexError past num_pages
            except IndexError:
                ok = False
            else:
                every = self._all_owned if expect == OWNED else self._all_allocated
                ok = every.startswith(states.tobytes())  # page 0 is RESERVED
        if ok and n > 1:
            mark = self._mark
            mark[arr] = self._iota[:n]
            ok = self._iota_bytes.startswith(mark[arr].tobytes())
        if not ok:
            raise self._page_error(arr.tolist(), what, expect)
        return arr, owned

    def _page_error(self, ids: list[int], what: str, expect: int = ALLOCATED) -> InvalidSlotError:
        """The error for the first bad id of a call (in the call's order)."""
        seen: set[int] = set()
        for page in ids:
            if page == 0:
                return InvalidSlotError(f"page 0 is reserved padding and cannot be {what}")
            if not 0 < page < self.num_pages:
                return InvalidSlotError(f"page {page} is out of range 1..{self.num_pages - 1}")
            if page in seen:
                return InvalidSlotError(f"page {page} appears more than once in one call")
            seen.add(page)
            state = self._state_bytes[page]
            if state == expect:
                continue
            if state == OWNED:
                return InvalidSlotError(
                    f"page {page} is owned by a row of the AsyncReqToTokenPool this "
                    f"KVPagePool serves and cannot be {what} here (it would skip the "
                    "row's fences): free the row, which frees its pages behind them, "
                    "or take them with detach_pages(row) first"
                )
            if state == ALLOCATED and expect == OWNED:
                return InvalidSlotError(
                    f"page {page} is not owned by a row (handed out by KVPagePool.alloc "
                    f"or detached) and cannot be {what} with one"
                )
            if state == _CHECKING:
                under_way = (
                    f"page {page} is being given back by a call under way (it asked a "
                    "fence's query(), which called the pool back)"
                )
                if what == "freed":
                    return DoubleFreeError(f"double free: {under_way}")
                return InvalidSlotError(f"{under_way} and cannot be {what}")
            if state == FREE and page > self._taken:
                return InvalidSlotError(f"page {page} was never allocated and cannot be {what}")
            if state in (FREE, PENDING):
                where = "is already free" if state == FREE else "is already pending behind a fence"
                if what == "freed":
                    return DoubleFreeError(f"double free: page {page} {where}")
                return InvalidSlotError(f"page {page} {where} (not allocated) and cannot be {what}")
            return InvalidSlotError(f"page {page} is {STATE_NAMES[state]} and cannot be {what}")
        raise AssertionError(f"no bad page among {ids}")  # pragma: no cover

    def check_ids(self, pages: object) -> PageArray:
        """Page ids as an int64 array, each in ``1..num_pages - 1`` (any state).

        Raises :class:`InvalidSlotError` for page 0, ids out of range and
        non-integer ids or dtypes.
        """
        if isinstance(pages, torch.Tensor):
            arr, _ = self._tensor_array(pages)
        elif isinstance(pages, np.ndarray):
            arr, _ = self._numpy_array(pages, owned=False)
        elif isinstance(pages, (int, np.integer)) and not isinstance(pages, bool):
            arr = self._list_array([pages], None)
        elif isinstance(pages, Iterable) and not isinstance(pages, _NOT_IDS):
            arr = self._list_array(list(pages), None)
        else:
            raise InvalidSlotError(
                "pages must be a 1-D integer tensor or numpy array, or a sequence of ints, "
                f"got {type(pages).__name__}"
            )
        n = arr.shape[0]
        # No negative id and none past 2**56: every top byte is zero. (Not
        # against _zero_bytes: pages may repeat here, so n may pass capacity.)
        ok = arr.tobytes()[_TOP_BYTE::8].count(0) == n
        if ok:
            try:
                ok = bytes([RESERVED]) not in self._state[arr].tobytes()
            except IndexError:
                ok = False
        if not ok:
            raise self._range_error(arr.tolist())
        return arr

    def _range_error(self, ids: list[int]) -> InvalidSlotError:
        for page in ids:
            if page == 0:
                return InvalidSlotError("page 0 is reserved padding and has no slots")
            if not 0 < page < self.num_pages:
                return InvalidSlotError(f"page {page} is out of range 1..{self.num_pages - 1}")
        raise AssertionError(f"no bad page among {ids}")  # pragma: no cover

    def disown(self, pages: PageArray) -> None:
        """Make a row's OWNED pages ALLOCATED: ``detach_pages`` handed them to
        the caller, who frees them with :meth:`KVPagePool.free`."""
        if pages.shape[0] <= _TINY_MARK:
            state = self._state_bytes
            for page in pages.tolist():
                state[page] = ALLOCATED
        else:
            self._state[pages] = _ALLOCATED_0D

    # ------------------------------------------------------------------ deferral hooks

    def _release_items(self, items: list[PageArray]) -> None:
        self._push(items[0] if len(items) == 1 else np.concatenate(items))

    def _quarantine_items(self, items: list[PageArray]) -> None:
        state = self._state
        for part in items:
            state[part] = QUARANTINED

    def _count_items(self, items: list[PageArray]) -> int:
        return sum(len(part) for part in items)

    # ------------------------------------------------------------------ bulk

    def free_all_allocated(self) -> int:
        """Free every allocated page at once, in page-id order (for ``clear``)."""
        pages = np.flatnonzero(self._state == ALLOCATED).astype(np.int64)
        if len(pages):
            self._push(pages)
        return len(pages)

    # ------------------------------------------------------------------ proof

    def check_invariants(self) -> None:
        """Raise AssertionError unless every invariant of the module holds."""

        def fail(msg: str) -> None:
            raise AssertionError(f"page ledger invariant broken: {msg}")

        state = self._state
        capacity = self.capacity
        if state[0] != RESERVED:
            fail("page 0 is not reserved")
        counts = np.bincount(state[1:], minlength=len(PAGE_STATE_NAMES))
        impossible = counts[RESERVED] or counts[len(STATE_NAMES) - 1] or counts[_CHECKING]
        if impossible or len(counts) > len(PAGE_STATE_NAMES):
            fail(f"pages in impossible states: {counts.tolist()}")
        if not 0 <= self._head < capacity or not 0 <= self.free_count <= capacity:
            fail(f"ring head {self._head} / free count {self.free_count} out of range")
        free_ids = self._ring[(self._head + np.arange(self.free_count)) % capacity]
        if has_duplicates(free_ids):
            fail("a page is in the free ring twice")
        if len(free_ids) != counts[FREE] or (len(free_ids) and (state[free_ids] != FREE).any()):
            fail(f"free ring ({len(free_ids)}) != FREE pages ({counts[FREE]})")
        parts = [part for items in self._check_deferrals(fail) for part in items]
        for part in parts:
            if part.dtype != _I64 or part.ndim != 1 or np.may_share_memory(part, self._ring):
                fail("a pending batch holds an array that is not a private 1-D int64 array")
        pending = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        if has_duplicates(pending):
            fail("a page is pending in two batches")
        if len(pending) != counts[PENDING] or (len(pending) and (state[pending] != PENDING).any()):
            fail(f"pending batches ({len(pending)}) != PENDING pages ({counts[PENDING]})")
        if self.quarantined != counts[QUARANTINED]:
            fail(f"quarantined count {self.quarantined} != {counts[QUARANTINED]}")
        if self.allocated != counts[ALLOCATED] + counts[OWNED]:
            fail(f"allocated count {self.allocated} != {counts[ALLOCATED] + counts[OWNED]}")
        if int(counts[:4].sum()) + int(counts[OWNED]) != capacity:
            fail("states do not add up to capacity")
        if self._taken < capacity and (state[self._taken + 1 :] != FREE).any():
            fail("a page never handed out is not free")
        if self.peak_allocated < self.allocated:
            fail(f"peak {self.peak_allocated} below allocated {self.allocated}")


@dataclass(frozen=True, slots=True)
class KVPageStats:
    """A snapshot of a :class:`KVPagePool`'s state and lifetime totals.

    ``free + allocated + pending + quarantined == capacity`` always holds.
    ``allocs``/``frees`` count pages handed out / given back over the pool's
    life; ``deferred_frees`` pages that had to wait for a fence,
    ``reclaimed`` pages a completed fence returned, ``fence_errors`` faulted
    fences, ``pending_fences`` the batches waiting now, ``force_released``
    pages that ``force_release`` returned without their fence completing
    (not in ``reclaimed`` nor in ``fence_latency``).
    """

    num_pages: int
    page_size: int
    capacity: int
    free: int
    allocated: int
    pending: int
    quarantined: int
    peak_allocated: int
    allocs: int
    frees: int
    deferred_frees: int
    reclaimed: int
    fence_errors: int
    pending_fences: int
    fence_latency: LatencySummary = field(default_factory=LatencySummary)
    force_released: int = 0


@dataclass(frozen=True, slots=True)
class KVGroupStats(KVPageStats):
    """One KV group's figures in its row pool's ``stats().kv_groups``.

    Every figure of the group's own :meth:`KVPagePool.stats` (a
    :class:`KVPageStats`, read in the same way: the four states add up to
    ``capacity``; ``fence_latency`` is empty when the row pool's ``stats``
    was asked for no summaries), plus ``growth_refusals``: the
    ``extend``/``extend_rows`` calls answered None and ``extend_fitting``
    calls that grew fewer rows than given in which this group was short of
    pages (after reclaiming its completed fences), total: those with
    ``group=`` this group, and grouped ones (``{group: count}``) that it
    could not cover, counted in every group short in them (a dashboard
    per group shows each bottleneck). The row pool's ``growth_refusals``
    counts each call once: their sum less those repeats.
    """

    growth_refusals: int = 0


class KVPagePool:
    """A fenced pool of ``num_pages - 1`` KV-cache pages of ``page_size`` slots.

    ``alloc(n)`` hands out the ``n`` oldest-freed pages as a 1-D int64
    tensor on ``device``; ``free(pages, fence=..., after=...)`` returns them,
    at once or once the fences complete (:meth:`reclaim`, which
    :meth:`alloc` runs before answering ``None``). Page ids only: the KV
    tensors are the engine's; :meth:`slots` maps pages to the token slot ids
    ``req_to_token`` rows hold.

    On a CUDA ``device`` the returned tensors are copied to the device (one
    host-to-device copy per call), and freeing a device tensor reads it back
    (which waits for the current stream): keep and free the host ids where
    that matters. Not thread-safe: call it from one thread.

    ``reclaim="explicit"`` (one scheduler replica per tensor-parallel rank):
    the pool never asks a fence whether it completed, not even in
    :meth:`alloc`; pending pages come back through :meth:`retire` and
    :meth:`agree` only, identically on every rank that makes the same calls.

    Bounds, checked before anything is built (:class:`CapacityError`):
    ``num_pages`` in ``2..2**31`` (a call's pages are numbered in int32),
    ``page_size >= 1`` with ``num_pages * page_size <= 2**31`` (token slot
    ids must fit ``req_to_token``'s int32). ``device`` must be one torch parses, not ``meta`` (ids
    handed out there could never be read back, so never freed) and not CUDA
    without CUDA (:class:`~asyncpool.DeviceError`).

    ``name`` (keyword only; None, the default, for none): a label for an
    engine that runs several page pools (a hybrid-attention model's
    sliding-window and full layers), shown in ``repr()`` (``<KVPagePool
    'swa' num_pages=...>``) and at the start of every line the pool and its
    ledger log (``pool 'swa': fence ... faulted; quarantined pages ...``),
    also while it serves an ``AsyncReqToTokenPool`` (``kv=``): its page
    faults are logged under its own name, and the row pool's own lines
    (overdue fences, ``force_release``) under the row pool's. Without one
    the lines are as they always were, except that a page pool serving a
    named ``AsyncReqToTokenPool`` logs its faults under that pool's name
    (its ``repr()`` and :attr:`name` stay unnamed). A non-empty ``str`` of at most 64
    printable characters (no control characters or newlines, which could
    forge log lines): ``TypeError`` for a non-str, ``ValueError``
    otherwise, checked first, nothing built. Read back as :attr:`name`;
    ``alloc`` and ``free`` never read it.
    """

    def __init__(
        self,
        num_pages: SupportsIndex,
        page_size: SupportsIndex,
        device: str | torch.device = "cpu",
        *,
        reclaim: str = "auto",
        name: str | None = None,
    ) -> None:
        name = check_name(name)
        num_pages = check_num_pages(num_pages)
        page_size = integral(page_size)  # type: ignore[assignment]
        if page_size.__class__ is not int or page_size < 1:
            raise CapacityError(f"page_size must be an int >= 1, got {page_size!r}")
        if num_pages * page_size > MAX_SLOTS:
            raise CapacityError(
                f"page_size={page_size} with num_pages={num_pages} is too large: token "
                "slot ids (page * page_size + offset) must fit req_to_token's int32, so "
                "num_pages * page_size must be at most 2**31"
            )
        explicit = check_reclaim_mode(reclaim)
        self.device: torch.device = check_device(device)
        self._ledger = PageLedger(num_pages)
        self._ledger.set_log_name(name)
        self._name = name
        if explicit:
            self._ledger.make_explicit()
        self.num_pages: int = num_pages
        self.page_size: int = page_size
        self._on_host = self.device.type == "cpu"
        self._offsets = np.arange(page_size, dtype=np.int64)
        # The pool's device gets its offsets for slots() now, before any
        # step is in flight (see _offsets_on).
        if self.device.type == "cuda":
            _offsets_on(self.device, page_size)
        self._on_free: Callable[[], None] | None = None
        self._guard: Callable[[], None] | None = None
        # Tensors handed out on the host, by id(): the tensor itself (which
        # keeps the id unique while remembered), its data pointer, the array
        # under it, its bytes when handed out and its length (see
        # _hand_out); and how many pages they hold, trimmed past
        # _handed_limit.
        self._handed: dict[int, tuple[torch.Tensor, int, PageArray, bytes, int]] = {}
        self._handed_pages = 0
        self._handed_limit = _HANDED_SLACK

    def __reduce_ex__(self, protocol: SupportsIndex) -> NoReturn:
        # A live object (asyncpool.forks): a shallow copy would share the
        # ledger behind two objects' cached counts, a pickled one lose its
        # fences and the pool it serves. Build another from the arguments.
        refuse_copy(self)

    def __repr__(self) -> str:
        led = self._ledger
        return (
            f"{repr_head('KVPagePool', self._name)}num_pages={self.num_pages} "
            f"page_size={self.page_size} "
            f"free={led.free_count} allocated={led.allocated} pending={led.pending} "
            f"quarantined={led.quarantined}>"
        )

    @property
    def name(self) -> str | None:
        """The pool's name (the constructor's ``name=``), or None: shown in
        ``repr()`` and at the start of every line the pool logs. Read-only."""
        return self._name

    @property
    def ledger(self) -> PageLedger:
        """The page ledger, for an owning pool that wires its hooks
        (:meth:`~asyncpool.deferral.Deferrals.set_hooks`) and holds pages per row."""
        return self._ledger

    def set_on_free(
        self, hook: Callable[[], None] | None, guard: Callable[[], None] | None = None
    ) -> None:
        """Call ``hook()`` after :meth:`free` or :meth:`reclaim` made pages
        free (for an owning pool: its queued waiters may fit now). The hook
        runs on the caller's thread, inside the call.

        ``guard()``, when given, runs first in every call that changes the
        pool (``alloc``, ``free``, ``reclaim``, ``retire``, ``agree``) and
        may raise to refuse it, changing nothing: an owning pool refuses a
        thread that is not its own (:class:`WrongThreadError`), since its
        hook would run that pool's grant loop there.
        """
        self._on_free = hook
        self._guard = guard

    @property
    def capacity(self) -> int:
        """Pages that can be handed out: ``num_pages - 1`` (page 0 is reserved)."""
        return self._ledger.capacity

    # ------------------------------------------------------------------ alloc

    def alloc(self, n: SupportsIndex, *, host: bool = False) -> torch.Tensor | None:
        """Take the ``n`` oldest-freed pages, or None when short.

        Reclaims completed fences before answering None. Returns a fresh 1-D
        int64 tensor (it never aliases the pool's memory), on ``device``; with
        ``host=True`` on the CPU, with no copy to the device (on a CUDA pool:
        ids that :meth:`free` and :meth:`slots` take without reading
        anything back). On a page pool
        that serves an ``AsyncReqToTokenPool`` (``kv=``) this bypasses that
        pool's queue, its close and its memory release: allocate through the
        pool (``admit``, ``extend``) unless pages outside any row are meant. Raises
        :class:`CapacityError` for ``n`` that is not an integer in
        ``1..capacity`` (numpy and 0-d torch integers are accepted).
        """
        if self._guard is not None:
            self._guard()
        led = self._ledger
        if n.__class__ is int and n == 1 and led.free_count and self._on_host:
            # take(1), inlined: one page is the commonest request (decode),
            # and the call is 5% of an alloc(1) + free. Kept step for step
            # with take (tests/test_kv_pages_fast.py compares the two).
            head = led._head
            ring = led._ring_ids
            # A one-id array.array of its own under the tensor: a fresh
            # buffer (never the ring's), and 10% cheaper to make and drop
            # than a numpy copy under from_numpy.
            one = ring[head : head + 1]
            led._state_bytes[ring[head]] = ALLOCATED
            head += 1
            led._head = 0 if head == led.capacity else head
            led._taken += 1
            led.free_count = free_count = led.free_count - 1
            allocated = led.capacity - free_count - led.pending - led.quarantined
            if allocated > led.peak_allocated:
                led.peak_allocated = allocated
            return torch.frombuffer(one, dtype=torch.int64)
        if n.__class__ is not int or not 0 < n <= led.capacity:
            n = led.check_n(n)
        pages = led.take(n)
        if pages is None:
            if not (led.pending and led.reclaim()):
                return None
            pages = led.take(n)
            if pages is None:
                return None
        if self._on_host:
            # _hand_out, inlined.
            out = torch.from_numpy(pages)
            self._handed[id(out)] = (out, out.data_ptr(), pages, pages.tobytes(), n)
            remembered = self._handed_pages + n
            self._handed_pages = remembered
            if remembered > self._handed_limit:
                self._trim_handed()
            return out
        if host:
            return torch.from_numpy(pages)
        try:
            return host_to_device(torch.from_numpy(pages), self.device)
        except BaseException:
            # The staging or the device allocation failed (a CUDA OOM): the
            # pages were taken for a tensor nobody got, so nobody could ever
            # free them. Back to the head of the free ring, as never taken.
            led.put_back(pages)
            raise

    def _hand_out(self, pages: PageArray) -> torch.Tensor:
        """The tensor over ``pages`` (distinct ids the pool owns, in a private
        array), remembered so that :meth:`free` of that very tensor can
        trust it. Host pools only.

        The entry keeps the tensor, and so ``pages``, alive: its id names
        no other object and no other buffer takes its address while it is
        remembered. :meth:`free` trusts a tensor found by id only while it
        still lies over that address, int64, 1-D contiguous and as long
        (``.data =`` and in-place reshapes change those), and its bytes are
        as handed out (nobody wrote into it); its ids are then still
        distinct and in range, and free only checks that each is still
        ALLOCATED.
        """
        out = torch.from_numpy(pages)
        n: int = pages.shape[0]
        self._handed[id(out)] = (out, out.data_ptr(), pages, pages.tobytes(), n)
        self._handed_pages += n
        if self._handed_pages > self._handed_limit:
            self._trim_handed()
        return out

    def _trim_handed(self) -> None:
        """Forget every handed-out tensor once some must be stale.

        A tensor freed in another form (a list, a slice, its numpy copy)
        leaves its entry behind. The tensors still out hold distinct
        allocated pages, so once the remembered ones hold more pages than
        are allocated, some are stale: forget them all (a live one's free
        then takes the checked path, as any other input does). Checked once
        per ``_HANDED_SLACK`` pages remembered, so the cost is O(1)
        amortised, and what is remembered stays within the allocated pages
        plus twice the slack (a few tens of bytes a page).
        """
        if self._handed_pages > self._ledger.allocated + _HANDED_SLACK:
            self._handed.clear()
            self._handed_pages = 0
        self._handed_limit = self._handed_pages + _HANDED_SLACK

    # ------------------------------------------------------------------ free

    def free(
        self,
        pages: Rows,
        *,
        fence: Fences | None = None,
        after: HostStream | torch.Stream | None = None,
    ) -> int:
        """Return allocated pages; return how many are free at once.

        ``pages`` (typed :data:`~asyncpool.Rows`, as the row calls): a 1-D
        integer tensor or numpy array, a list, tuple or other iterable of
        ints (numpy or 0-d torch integers accepted per element), or one int.
        With
        ``fence`` (any object with ``query()``/``synchronize()``: a
        :class:`HostFence`, a ``CudaFence``, a transfer handle; or a
        sequence of such fences, a list or tuple, as for cached pages that
        both the newest step and a transfer read: an empty one is no fence,
        a set or an iterator a ``TypeError``) and/or
        ``after`` (a stream: a fence is recorded on it now, after the pages
        are checked), the pages wait for every such fence (the newest per
        stream); any one faulting quarantines them.

        Raises, changing nothing: ``TypeError`` for a non-fence (naming a
        bad element of a sequence by its position) or an
        ``after`` that is not a stream, ``RuntimeError`` for a closed
        ``HostStream`` as ``after``, :class:`InvalidSlotError` for page 0, ids
        out of range, non-integer ids or dtypes, duplicates, pages not
        allocated (or quarantined) and pages a row of the served pool owns
        (``kv=``: free the row, or detach them first),
        :class:`DoubleFreeError` for pages already free or pending;
        :class:`WrongThreadError` from another thread than the served pool's. A call
        with one bad id among good ones frees none. Pages carry no
        generation (rows do): a stale id of a page that was freed and
        handed out again is allocated, so freeing it frees the new owner's
        page, unseen. Keep one owner per page (``free`` the tensor ``alloc``
        gave, once), as with any allocator of bare ids.
        """
        if self._guard is not None:
            self._guard()
        led = self._ledger
        if fence is None and after is None:
            # What alloc handed out (an int64 tensor) skips a few steps: a
            # few pages are checked and freed in one Python pass; anything
            # that pass refuses goes the checked way, which raises for it.
            if type(pages) is not torch.Tensor:
                pass
            elif (entry := self._handed.pop(id(pages), None)) is not None:
                # The very tensor this pool handed out (_hand_out): over the
                # same memory and unchanged since, its ids are distinct and
                # in range; check they are still ALLOCATED (not freed in
                # another form) and push them.
                _, ptr, arr, handed_bytes, numel = entry
                self._handed_pages -= numel
                if (
                    pages.data_ptr() == ptr
                    and pages.dtype is torch.int64
                    and pages.stride() == (1,)
                    and pages.numel() == numel
                    and not pages.is_neg()  # a negated view reads other ids
                    and arr.tobytes() == handed_bytes
                    # free_owned, inlined
                    and led._all_allocated.startswith(led._state[arr].tobytes())
                ):
                    led._push(arr)
                    if self._on_free is not None:
                        self._on_free()
                    return numel
                # Changed since, or freed already: the checked path (below)
                # says why.
            elif pages.numel() <= _TINY:
                try:
                    small = pages.tolist()
                except (RuntimeError, NotImplementedError):  # meta or sparse
                    small = None  # the checked path (below) refuses it
                # Not for the int of a 0-d tensor, nor for [] (an empty
                # tensor of any shape: the checked path refuses one of more
                # than one dimension).
                if small.__class__ is list:
                    if len(small) == 1:
                        # _free_now_small of one page, inlined (decode frees
                        # one page at a time). The int test refuses what a
                        # bool, float or complex tensor gives and [p] (from a
                        # 2-D tensor); an integer tensor of another dtype gives
                        # an int the checked path would accept as well.
                        page = small[0]
                        state = led._state_bytes
                        if (
                            page.__class__ is int
                            and 0 < page < led.num_pages
                            and state[page] == ALLOCATED
                        ):
                            state[page] = FREE
                            tail = led._head + led.free_count
                            if tail >= led.capacity:
                                tail -= led.capacity
                            led._ring_ids[tail] = page
                            led.free_count += 1
                            if self._on_free is not None:  # an owning pool's waiters
                                self._on_free()
                            return 1
                    elif small and pages.dtype is torch.int64 and led._free_now_small(small):
                        if self._on_free is not None:
                            self._on_free()
                        return len(small)
            elif pages.dtype is torch.int64:
                try:
                    arr = pages.numpy()  # zero-copy
                except (TypeError, RuntimeError):  # on a device: the checked path copies
                    pass
                else:
                    if arr.strides == (8,):  # 1-D and contiguous: prepare's fast case
                        led._checked(arr, False, "freed")
                        led._push(arr)
                        if self._on_free is not None and len(arr):
                            self._on_free()
                        return len(arr)
            ids, owned = led.prepare(pages)
            n = len(ids)
            if n:
                led._push(ids)  # free_prepared without fences
                if self._on_free is not None:
                    self._on_free()
            return n
        if after is not None:
            check_after(after)  # before anything changes, with the pool's message
        fences = [] if fence is None else [*fence_list(fence)]
        ids, owned = led.prepare(pages)
        if self._handed and (entry := self._handed.pop(id(pages), None)) is not None:
            self._handed_pages -= entry[4]  # checked above, not trusted
        if after is not None and len(ids):  # an empty free records no fence
            fences.append(record_fence(after))
        n = led.free_prepared(ids, owned, fences, ALLOCATED)
        if n and self._on_free is not None:
            self._on_free()
        return n

    @property
    def reclaim_mode(self) -> str:
        """``"auto"`` or ``"explicit"`` (the constructor's ``reclaim``)."""
        return "explicit" if self._ledger.explicit else "auto"

    def reclaim(self) -> int:
        """Return pages whose fences completed; the number made free.

        With ``reclaim="explicit"`` it asks no fence and returns 0: pages
        come back through :meth:`retire` and :meth:`agree` only. On the page
        pool of an ``AsyncReqToTokenPool`` it returns pages only (and grants
        that pool's waiters); rows freed behind the same fences come back
        with ``pool.reclaim()``, which reclaims both.
        """
        if self._guard is not None:
            self._guard()
        n = self._ledger.reclaim()
        if n and self._on_free is not None:
            self._on_free()
        return n

    def retire(self, fence: Fence) -> int:
        """The scheduler processed the step ``fence`` ends (``reclaim="explicit"``).

        Returns to circulation exactly the pages behind fences of
        ``fence``'s stream up to it, in record order; never calls
        ``query()``. Returns the pages made free. Raises ``TypeError`` for a
        fence that is not ordered, ``RuntimeError`` on an ``"auto"`` pool;
        either way nothing changes.
        """
        if self._guard is not None:
            self._guard()
        led = self._ledger
        check_explicit(led, "retire")
        check_ordered(fence)
        n = led.retire(fence)
        if n and self._on_free is not None:
            self._on_free()  # an owning pool's grant loop
        return n

    def forget_stream(self, stream_key: int) -> bool:
        """Forget that stream ``stream_key`` was retired, on the pages.

        ``reclaim="explicit"`` only. The contract is
        :meth:`AsyncReqToTokenPool.forget_stream
        <asyncpool.AsyncReqToTokenPool.forget_stream>`'s, on this pool's
        pages: a mark (about 32 B) stays per stream key :meth:`retire` ever
        retired until this is called, once the stream is done with, at the
        same point on every rank (the pool never prunes one itself); True if
        a mark was dropped; ``TypeError`` or ``RuntimeError`` (batches still
        wait for a fence of the stream) as there, nothing changed.
        ``RuntimeError`` on the page pool of an ``AsyncReqToTokenPool``
        (``kv=``), nothing changed: its rows' recorded uses of the stream,
        which their pages' frees wait for too, go only with that pool's
        ``forget_stream``, which forgets the rows' and the pages' marks
        together (this pool's mark forgotten alone left a row's retired use
        in place, and its pages, freed with the row, waited for a retire of
        a stream done with).
        """
        if self._guard is not None:
            self._guard()
        if self._on_free is not None:
            raise RuntimeError(
                "this KVPagePool serves an AsyncReqToTokenPool: call that pool's "
                "forget_stream(key), which forgets the stream on its rows and pages together "
                "(the rows' recorded uses of it, which their pages wait for too); nothing "
                "was changed"
            )
        return forget_stream([self._ledger], stream_key)

    def force_release(self, fence: Fences) -> int:
        """Return the pages held behind ``fence``, done or not (logged).

        The escape hatch ``ReqToTokenPool.force_release`` is for rows, for a
        page pool used beside it: an operator who knows the work behind a
        stuck fence (a transfer whose peer died) will never write or read
        again has the pages waiting on ``fence`` treated as if it had
        completed (free, or still waiting for their other fences). Never
        asks ``fence`` anything, in either reclaim mode (with
        ``"explicit"``, call it at the same point on every rank, as every
        call that changes what is free). Pages quarantined behind a fence
        that *faulted* stay quarantined (its faulted work may still write or
        read them). Returns the pages made free: 0 when none is, which
        includes pages that still wait for other fences (they no longer wait
        for this one). ``fence`` may also be a sequence of fences: all of
        them at once, one log line, the pages summed (an
        empty one: 0, nothing logged). Raises ``TypeError`` for a non-fence,
        or a sequence with one (named by its position) or another iterable,
        and ``RuntimeError`` on the page pool of an ``AsyncReqToTokenPool``
        (``kv=``: its ``force_release`` returns the rows and pages behind the
        fence together, and keeps its overdue counts); either way nothing
        changes.
        """
        if self._on_free is not None:
            raise RuntimeError(
                "this KVPagePool serves an AsyncReqToTokenPool: call that pool's "
                "force_release(fence), which returns the rows and pages behind it together"
            )
        fences = force_release_fences(fence)
        if not fences:
            return 0
        led = self._ledger
        held = led.holds_any(fences)
        pages = led.force_release_all(fences)
        log = pool_log(logger, self._name)
        if len(fences) > 1:
            log_force_release_many(
                log, fences, None, pages, held, remembers_fault=led.remembers_fault
            )
        else:
            faulted = not pages and not held and led.remembers_fault(fences[0])
            log_force_release(log, fences[0], "page", pages, held, faulted=faulted)
        return pages

    def agree(self, group: Any = None) -> int:
        """Settle pending fences identically on every rank of ``group``
        (``reclaim="explicit"``; see :mod:`asyncpool.agreement`). A
        collective: every rank calls it at the same point. Returns the pages
        made free; raises :class:`AgreementError` on every rank, changing
        nothing, when the ranks' pools disagree or a fence's ``query()`` was
        interrupted on another rank (that rank raises its ``KeyboardInterrupt``
        or ``SystemExit``). ``RuntimeError`` on an
        ``"auto"`` pool or without an initialised ``torch.distributed``, and
        ``TypeError``/``ValueError`` for a bad ``group``, raise on this rank
        alone, before the collective (the other ranks then wait in it).
        """
        if self._guard is not None:
            self._guard()
        check_explicit(self._ledger, "agree")
        n = agree(group, [self._ledger], pool_name=self._name).released[0]
        if n and self._on_free is not None:
            self._on_free()  # an owning pool's grant loop
        return n

    def clear(self) -> None:
        """Flush: free every allocated page at once and reclaim completed fences.

        Never releases a page behind an incomplete fence: pages already
        pending stay pending and return through :meth:`reclaim` once their
        fences complete (``reclaim="explicit"``: through :meth:`retire` or
        :meth:`agree`); quarantined pages stay quarantined. Allocated pages
        carry no fence the pool knows of, so call this only when no work in
        flight still writes them. Raises :class:`PoolBusyError`, changing
        nothing, while the pool serves an ``AsyncReqToTokenPool`` (``kv=``):
        its rows own pages, which only the row pool may free.
        """
        if self._on_free is not None:
            raise PoolBusyError(
                "this KVPagePool serves an AsyncReqToTokenPool whose rows own pages; free "
                "the rows through that pool instead of clearing the page pool"
            )
        led = self._ledger
        led.free_all_allocated()
        led.reclaim()
        self._handed.clear()
        self._handed_pages = 0

    # ------------------------------------------------------------------ views

    def available_size(self) -> int:
        """Pages free right now (not counting pages pending behind fences).

        A page pool of its own first returns pages whose fences completed
        (only while some are pending; with ``reclaim="explicit"`` it asks no
        fence): a seed-style scheduler sizes its batch by this count before
        it calls :meth:`alloc`, and nothing else reclaims such a pool. A
        page pool serving an ``AsyncReqToTokenPool`` only reads: that
        pool's fence wake-ups reclaim and grant, when its event loop runs.
        """
        led = self._ledger
        if led.pending and self._on_free is None:
            led.reclaim()
        return led.free_count

    def pending_size(self) -> int:
        """Pages freed but waiting for their fences to complete."""
        return self._ledger.pending

    def quarantined_size(self) -> int:
        """Pages kept out of circulation because their fence faulted."""
        return self._ledger.quarantined

    def allocated_size(self) -> int:
        """Pages handed out and not yet freed (a row's pages included)."""
        return self._ledger.allocated

    def slots(self, pages: Rows) -> torch.Tensor:
        """The token slot ids of ``pages``: ``page * page_size + offset``.

        ``pages`` as :meth:`free` takes them (typed :data:`~asyncpool.Rows`):
        a 1-D integer tensor or numpy array, an iterable of ints, or one int.
        A 1-D int64 tensor on ``device`` of ``len(pages) * page_size``
        slots, page by page. Any page id in ``1..num_pages - 1`` is accepted
        whatever its state; page 0 and ids out of range raise
        :class:`InvalidSlotError`.

        On a CUDA pool nothing here waits for the device. Host ids are
        checked, then copied through pinned memory. A CUDA tensor of ids
        (``grant.pages``, ``pages_of``, ``alloc``'s) becomes slots on the
        GPU, queued on the current stream: its dtype and shape are checked,
        its ids are not (reading them back would wait for the stream, and
        with it for the step in flight), as ``set_req_pool_info`` does not
        check device slots. (The first such call with ids on a CUDA device
        other than the pool's makes that device's offsets and waits once
        for them.)
        """
        if not self._on_host and isinstance(pages, torch.Tensor) and pages.is_cuda:
            return self._device_slots(pages).to(self.device, non_blocking=True)
        arr = self._ledger.check_ids(pages)
        slots = (arr[:, None] * self.page_size + self._offsets).reshape(-1)
        if self._on_host:
            return torch.from_numpy(slots)
        return host_to_device(torch.from_numpy(slots), self.device)

    def _device_slots(self, pages: torch.Tensor) -> torch.Tensor:
        """:meth:`slots` of a tensor of ids, computed where it lies, its ids
        unread: only its dtype, shape and layout are checked."""
        if pages.dtype not in ID_DTYPES or pages.dim() > 1 or pages.layout is not torch.strided:
            raise InvalidSlotError(
                f"page ids must be a 1-D integer tensor, got shape {tuple(pages.shape)}, "
                f"dtype {pages.dtype}, layout {pages.layout}"
            )
        offsets = _DEVICE_OFFSETS.get((pages.device, self.page_size))
        if offsets is None:
            offsets = _offsets_on(pages.device, self.page_size)
        return (pages.reshape(-1, 1).to(torch.int64) * self.page_size + offsets).reshape(-1)

    def stats(self) -> KVPageStats:
        """A snapshot of the page counts and totals; changes nothing, and may
        be read from another thread (a metrics scrape)."""
        return KVPageStats(**self._figures(True))

    def _figures(self, summaries: bool) -> dict[str, Any]:
        """:meth:`stats`'s figures as keyword arguments (a row pool's
        ``stats()`` builds each KV group's :class:`KVGroupStats` from them);
        ``summaries=False`` leaves ``fence_latency`` empty (sorting its
        window is the costly part). O(pending batches): ``pending_fences``
        counts them. Changes nothing."""
        led = self._ledger
        # As PoolStats: the lifetime total first, then each count read once
        # and allocated derived from them, so that the four add up to
        # capacity (and frees never runs ahead) when read from another thread.
        allocs = led.allocs
        free, pending, quarantined = led.free_count, led.pending, led.quarantined
        allocated = led.capacity - free - pending - quarantined
        return {
            "num_pages": self.num_pages,
            "page_size": self.page_size,
            "capacity": led.capacity,
            "free": free,
            "allocated": allocated,
            "pending": pending,
            "quarantined": quarantined,
            "peak_allocated": led.peak_allocated,
            "allocs": allocs,
            "frees": allocs - allocated,
            "deferred_frees": led.deferred_frees,
            "reclaimed": led.reclaimed,
            "fence_errors": led.fence_errors,
            "pending_fences": len(led.pending_fences()),
            "force_released": led.force_released,
            "fence_latency": (
                LatencySummary.of(led.fence_latencies) if summaries else LatencySummary()
            ),
        }

    def check_invariants(self) -> None:
        """Raise AssertionError unless every bookkeeping invariant holds.

        On the page pool of an ``AsyncReqToTokenPool``, from that pool's
        thread only (:class:`WrongThreadError` otherwise), as every call
        that changes the pool (the reads a metrics scrape makes are not
        checked).
        """
        if self._guard is not None:
            self._guard()
        self._ledger.check_invariants()


#: ``arange(page_size)`` per (CUDA device, page size), for the slots of a
#: CUDA tensor of ids. Kept for the process, never freed: the kernels that
#: read them run on any stream, after the call returns, so a tensor of a
#: pool's own could go back to torch's caching allocator (the pool
#: collected) and be handed to work on another stream while such a kernel
#: is still queued. A few kilobytes per device and page size.
_DEVICE_OFFSETS: dict[tuple[torch.device, int], torch.Tensor] = {}


def _offsets_on(device: torch.device, page_size: int) -> torch.Tensor:
    """The offsets for ``device``, made on first use and written before this
    returns (it waits once, for the stream they were made on: a kernel on
    another stream must never read them unwritten), kept under the device
    they landed on (``cuda`` resolves to ``cuda:N``, the key a tensor's
    ``.device`` looks them up by)."""
    offsets = torch.arange(page_size, dtype=torch.int64, device=device)
    if offsets.is_cuda:
        torch.cuda.current_stream(offsets.device).synchronize()
    return _DEVICE_OFFSETS.setdefault((offsets.device, page_size), offsets)
