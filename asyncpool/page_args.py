"""What admission, growth and give-back share: the pool state they read and
the checks of their arguments.

:class:`PageArgs` is the base of the pool's three page mixins
(:class:`~asyncpool.admission.Admission`, :class:`~asyncpool.growth.Growth`,
:class:`~asyncpool.give_back.GiveBack`): the declarations of the pool's state
they read and drive (the pool composes it; a mixin has no state of its own),
and the argument checks all three need: which KV group a call names
(``group=``, a ``{group: count}`` mapping), that a row is allocated, page
counts (one for every row, or one per row) and rows whose order matters. It
changes nothing: every helper here reads, and raises a typed error for bad
input before the caller moves anything.

Thread rules: the pool's (:mod:`asyncpool.pool`). Every call here is
checked: a pool with ``kv`` never opens the unchecked fast paths. Nothing
here awaits, so nothing here is cancelled part way.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, SupportsIndex

import numpy as np
import numpy.typing as npt
import torch

from .errors import CapacityError, InvalidSlotError
from .fences import Fence
from .ledger import SlotLedger, _attributes, as_index, describe, device_fault
from .row_pages import RowPages, check_page_count
from .waiters import WaiterQueues

__all__ = ["Counts", "PageArgs"]

#: Page counts: one for every row, or one per row.
Counts = SupportsIndex | Sequence[SupportsIndex] | npt.NDArray[np.integer[Any]] | torch.Tensor


#: The element types :func:`_page_counts` takes in one pass (not ``bool``).
_INT_ONLY = frozenset((int,))


def _page_counts(value: object, n: int, name: str) -> list[int]:
    """``value`` as one page count >= 0 per row (``n`` rows): one integer
    (Python, numpy, a 0-d tensor; never a bool) for every row, or a
    sequence, 1-D array or 1-D tensor of ``n`` of them. ``name`` is the
    parameter's (``keep`` for ``trim_pages``, ``k`` for ``extend_rows``);
    :class:`CapacityError` otherwise."""
    cls = value.__class__
    if cls is int:  # one count for every row (never a bool: its class is bool)
        if value < 0:  # type: ignore[operator]
            raise CapacityError(f"{name} must be a page count >= 0, got {value}")
        return [value] * n  # type: ignore[list-item]
    if cls is list or cls is tuple:
        # Counts per row, told apart without as_index's TypeError (about 1
        # us a call to raise and catch): as the sequence branch below.
        items: list[object] = list(value)  # type: ignore[call-overload]
    elif isinstance(value, torch.Tensor | np.ndarray) and value.ndim:
        # Likewise for an array or tensor of one or more dimensions, which
        # as_index refuses: the branch below takes or refuses it.
        items = _array_counts(value, name)
    else:
        try:
            one = as_index(value)
        except TypeError:
            pass
        else:
            if one < 0:
                raise CapacityError(f"{name} must be a page count >= 0, got {one}")
            return [one] * n
        if isinstance(value, torch.Tensor | np.ndarray):
            items = _array_counts(value, name)
        elif _per_row(value):  # a sequence: list, tuple, range, deque, array.array
            items = list(value)  # type: ignore[call-overload]
        else:
            raise CapacityError(
                f"{name} must be a page count (an integer) or one per row, got "
                f"{describe(value)} of type {type(value).__name__}"
            )
    return _checked_counts(items, n, name)


def _array_counts(value: torch.Tensor | npt.NDArray[Any], name: str) -> list[object]:
    """A 1-D integer array's or tensor's counts as a list (``tolist()``,
    checked by :func:`_checked_counts`); :class:`CapacityError` for any
    other array or tensor (as :func:`_page_counts` refuses it)."""
    if value.ndim != 1 or value.dtype in (torch.bool, np.bool_):
        raise CapacityError(
            f"{name} must be a page count or one per row (1-D, integers), got a "
            f"{value.ndim}-D {value.dtype} {type(value).__name__}"
        )
    try:
        items: list[object] = value.tolist()
    except (RuntimeError, NotImplementedError) as exc:
        # Meta, sparse, quantized, sub-byte: bad input, as for rows. A
        # strided integer tensor reads unless its device faulted.
        if device_fault(value, exc):
            raise
        raise CapacityError(
            f"{name} must be page counts in a tensor with data (strided, on a real "
            f"device) of an integer dtype, got {_attributes(value)}"
        ) from None
    return items


def _checked_counts(items: list[object], n: int, name: str) -> list[int]:
    """``items`` (a fresh list, the caller's counts) as ``n`` page counts
    >= 0; :class:`CapacityError` naming the first bad one otherwise."""
    if len(items) != n:
        raise CapacityError(f"{name} lists {len(items)} page counts for {n} rows")
    if set(map(type, items)) <= _INT_ONLY:
        # Python ints only (what a list of ints and an integer array's or
        # tensor's tolist() give; never a bool): one C pass for the types
        # and one for the least count, where as_index per count cost about
        # 0.3 us a row. Anything else takes the pass below, for its error.
        if items and min(items) < 0:  # type: ignore[type-var,operator]
            k = next(k for k in items if k < 0)  # type: ignore[operator]
            raise CapacityError(f"{name} must hold page counts >= 0, got {k}")
        return items  # type: ignore[return-value]  # a fresh list: ours
    counts = []
    for item in items:
        try:
            k = as_index(item)
        except TypeError:
            raise CapacityError(
                f"{name} must hold page counts (integers), got {describe(item)} of type "
                f"{type(item).__name__}"
            ) from None
        if k < 0:
            raise CapacityError(f"{name} must hold page counts >= 0, got {k}")
        counts.append(k)
    return counts


def _per_row(counts: object) -> bool:
    """Whether ``counts`` gives one page count per row (a sequence other
    than text or bytes, a 1-D array or tensor) rather than one for all."""
    if counts.__class__ is int:
        # The usual count, before the isinstance checks (an ABC's among
        # them): a grouped call asks once per group, about 1 us each.
        return False
    if isinstance(counts, torch.Tensor | np.ndarray):
        return bool(counts.ndim)
    return isinstance(counts, Sequence) and not isinstance(
        counts, str | bytes | bytearray | memoryview
    )


def _check_ordered(rows: object, what: str) -> None:
    """:class:`InvalidSlotError` for rows in a ``set`` or ``frozenset``,
    whose order is arbitrary, where ``what`` gives the order a meaning;
    other forms of rows are checked as usual later."""
    if isinstance(rows, set | frozenset):
        raise InvalidSlotError(
            f"{what} pairs rows with their order, and a {type(rows).__name__} has none: "
            "give the rows as a list, tuple, 1-D array or tensor"
        )


class PageArgs:
    """The pool's state and argument checks that its page mixins share.

    The attributes and methods below are the pool's; see
    :class:`~asyncpool.AsyncReqToTokenPool` for the public contract of each
    call its mixins define.
    """

    _ledger: SlotLedger
    _pages: RowPages | None
    _groups: dict[str, RowPages] | None
    _page_sets: tuple[RowPages, ...]
    _group_items: tuple[tuple[str, RowPages, int], ...]
    _waiters: WaiterQueues
    _free_q: collections.deque[int]
    _state: list[int]
    _uses: list[Any]
    _owner: int | None
    _fast: bool
    _closed: bool
    _released: bool
    _loop: asyncio.AbstractEventLoop | None
    _unwatched: list[Fence]
    _take: Callable[[int], list[int] | None]
    _growth_refusal_repeats: int
    size: int

    if TYPE_CHECKING:

        def _check_thread(self) -> None: ...

    def _group_words(self) -> str:
        assert self._groups is not None
        return "(" + ", ".join(map(repr, self._groups)) + ")"

    def _group_named(self, group: object, call: str) -> RowPages:
        """The pages of KV group ``group``; ``ValueError`` for a pool
        without groups or a name that is not one of them."""
        groups = self._groups
        if groups is None:
            built = "one KVPagePool" if self._pages is not None else "no kv"
            raise ValueError(
                f"{call}: group= names a KV group, and this pool has none (built with "
                f"{built}): leave group out"
            )
        pages = groups.get(group) if isinstance(group, str) else None
        if pages is None:
            raise ValueError(
                f"{call}: unknown KV group {describe(group)}; this pool's groups are "
                f"{self._group_words()}"
            )
        return pages

    def _pages_or_none(self, group: object, call: str) -> RowPages | None:
        """The pages ``group=`` picks: the pool's one ``kv`` (``group``
        None), a group's (by name, on a pool with groups, where it is
        required), or None on a pool without ``kv`` (``group`` None).
        ``ValueError`` for ``group=`` misused."""
        if group is None:
            pages = self._pages
            if pages is not None or self._groups is None:
                return pages
            raise ValueError(
                f"{call}: this pool has KV groups {self._group_words()}: name one with group="
            )
        return self._group_named(group, call)

    def _pages_for(self, group: object, call: str, purpose: str) -> RowPages:
        """:meth:`_pages_or_none`, with :class:`CapacityError` for a pool
        without ``kv`` (as :meth:`_kv_pages`)."""
        pages = self._pages_or_none(group, call)
        if pages is None:
            raise CapacityError(
                f"this pool has no KV pages: build it with kv=KVPagePool(...) to {purpose}"
            )
        return pages

    @staticmethod
    def _count_for(pages: RowPages, k: Any, least: int) -> int:
        if k.__class__ is int and least <= k <= pages.capacity:
            return k
        return check_page_count(k, pages.capacity, least=least)

    def _allocated_row(self, row: object, what: str) -> int:
        """``row`` as an int if it is an allocated row id (integer scalars
        and 0-d tensors accepted, as ``free`` does); InvalidSlotError otherwise."""
        if row.__class__ is not int:
            try:
                row = as_index(row)  # refuses bools and floats
            except TypeError:
                raise self._ledger._row_error(row, what) from None
        assert isinstance(row, int)
        if 0 < row < self.size and self._state[row] in (1, 6):
            return row  # ALLOCATED or USED
        raise self._ledger._row_error(row, what)

    def _named_groups(
        self, call: str, counts: Mapping[Any, Any], group: object
    ) -> dict[str, RowPages]:
        """The pool's groups, once a grouped growth's mapping ``counts`` is
        checked to name only them: ``ValueError`` for ``group=`` given too
        and for a name that is not one of the pool's groups;
        :class:`CapacityError` on a pool without KV groups."""
        if group is not None:
            raise ValueError(
                f"{call}: group= names the group of one page count, and a mapping "
                "{group: count} names its groups itself: give one or the other"
            )
        groups = self._groups
        if groups is None:
            # A pool with one kv comes here only with group= (refused above):
            # without it, its count check refuses a mapping (_growth_count).
            raise CapacityError(
                "this pool has no KV pages: build it with kv={group: KVPagePool(...)} "
                f"to {call} by group"
            )
        unknown = [key for key in counts if not isinstance(key, str) or key not in groups]
        if unknown:
            raise ValueError(
                f"unknown KV group {describe(unknown[0])} in the page counts; this pool's "
                f"groups are {self._group_words()}"
            )
        return groups
