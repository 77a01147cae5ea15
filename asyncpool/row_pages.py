"""Which KV pages each request row owns: the page side of admission.

A request holds a row of ``req_to_token`` and the KV pages that row lists.
While the row is allocated its pages belong to it: :class:`RowPages` keeps,
per row, the pages granted with it (``admit``), grown for decode
(``extend``), or handed to the caller (``detach``), and frees them with the
row, behind the same fences.

Knows the page ledger (:class:`~asyncpool.kv_pages.PageLedger`) and the row
ledger's recorded uses; knows nothing of asyncio, waiting, or tensors beyond
wrapping page-id arrays (``torch.from_numpy``, no torch op on the host).

Not thread-safe: the owning pool serialises calls.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import sys
from collections.abc import Sequence
from operator import itemgetter
from typing import Any, Literal, NamedTuple

import numpy as np
import numpy.typing as npt
import torch

from .errors import CapacityError, InvalidSlotError
from .fences import Fence
from .kv_pages import OWNED, KVPagePool, PageLedger, has_duplicates
from .ledger import SlotLedger, as_index, describe
from .tables import host_to_device

__all__ = ["Grant", "GroupGrant", "RowPages", "check_page_count"]

_EMPTY = np.zeros(0, dtype=np.int64)
#: A row's sealed record of more pages than this is freed after a
#: vectorised state check only (:meth:`PageLedger.all_in`); up to this
#: many, through the page ledger's one Python pass.
_TRUSTED_PASS = 16
#: A give-back of more rows than this checks their records against their
#: seals in one joined compare and cuts a group's pages from the joined
#: records with numpy (:meth:`RowPages._group_many`); up to this many, a
#: compare and a slice a row. Measured even between 48 and 64 rows (its
#: fixed numpy cost against the slices it saves), 30 % faster at 256.
_JOINED_CHECK = 56
#: The byte order of an int64 array's ``tobytes()`` (native), for seals
#: grown from Python ints.
_BYTEORDER: Literal["little", "big"] = "little" if sys.byteorder == "little" else "big"


class Grant(NamedTuple):
    """What ``admit`` grants: one row and the pages it owns (frozen).

    ``pages`` is a 1-D int64 tensor of page ids (on the ``KVPagePool``'s
    device): the pages granted at admission, which belong to the row until
    the row is freed or the pages are detached. It does not grow with the
    row: after ``extend``, ``pool.pages_of(row)`` lists them all. A grant
    never starts with dropped positions, and ``drop_pages`` never writes
    into it. Unpacks as ``row, pages = grant``.
    """

    row: int
    pages: torch.Tensor


class GroupGrant(NamedTuple):
    """What ``admit`` grants on a pool built with KV groups (a mapping
    ``kv=``): one row and, per group name, the pages it owns there (frozen).

    ``pages[name]`` is a 1-D int64 tensor of that group's page ids (on its
    ``KVPagePool``'s device), as :attr:`Grant.pages` is for one pool; every
    group of the pool is a key (an empty tensor for a count of 0). Unpacks
    as ``row, pages = grant``. The dict is the caller's; the tensors are
    read-only, as ``Grant.pages``.
    """

    row: int
    pages: dict[str, torch.Tensor]


_new_grant = tuple.__new__

_from_numpy = torch.from_numpy


def check_page_count(k: Any, capacity: int, *, least: int) -> int:
    """``k`` as an int in ``least..capacity``; :class:`CapacityError` otherwise.

    Accepts a Python int or an integer scalar (numpy, a 0-d torch tensor),
    as :func:`~asyncpool.ledger.as_index` does; never a bool (a bool tensor
    included) nor a tensor or array of one or more dimensions.
    """
    if k.__class__ is not int:
        try:
            k = as_index(k)
        except TypeError:
            raise CapacityError(
                f"a page count must be an integer, got {describe(k)} of type {type(k).__name__}"
            ) from None
    assert isinstance(k, int)
    if k < least:
        raise CapacityError(f"cannot allocate {k} pages: at least {least} needed")
    if k > capacity:
        raise CapacityError(
            f"cannot allocate {k} pages: the KV pool has only {capacity} "
            "(num_pages - 1, page 0 is reserved)"
        )
    return k


def table_zeros(n: int, width: int) -> npt.NDArray[np.int64]:
    """A zeroed ``(n, width)`` int64 block table; :class:`CapacityError`
    (not numpy's ``MemoryError`` or ``ValueError``) for a ``width`` whose
    table cannot be made: a row's positions have no fixed bound, so the
    width is checked by making the table."""
    try:
        return np.zeros((n, width), dtype=np.int64)
    except (MemoryError, ValueError) as exc:
        raise CapacityError(
            f"width {width}: a ({n}, {width}) table of int64 page ids cannot be made ({exc})"
        ) from None


class RowPages:
    """The pages each allocated row owns, over one :class:`KVPagePool`.

    ``owned[row]`` is the row's page ids as a private int64 array, or None.
    Every page held here is OWNED in the page ledger (``KVPagePool.free``
    refuses it: only the row's free or :meth:`detach` gives it back) and
    owned by exactly one row (:meth:`check_invariants`).

    ``sealed[row]`` is the bytes of ``owned[row]`` as this class made it
    (None: no pages). The caller sees the record through a zero-copy tensor
    and may write into it, against the contract; a record that differs from
    its seal lists pages the pool cannot vouch for (another row's, say), so
    freeing its row raises (:meth:`check_record`) until the caller detaches
    the pages or restores them. A trim or a drop checks only the pages it
    gives back (:meth:`prepare_free`: it costs those, not the pages kept);
    a write into a kept page is refused where that page is given back. A
    record as sealed lists distinct in-range ids, extended or not:
    :meth:`take` and :meth:`extend` take FREE pages only, and nothing but
    this class makes an OWNED page anything else (a page freed behind the
    row's back and taken again by ``extend``, listed twice, was possible
    before pages were OWNED). So freeing it only checks that each is still
    OWNED (:meth:`PageLedger.free_owned`), and ``detach`` may vouch for it
    to the page pool.

    ``holes[row]`` counts the row's leading positions given back early
    (:meth:`prepare_free` with ``belows``, then :meth:`free`): ``owned``
    lists the live pages after them, never page 0, so every check above
    holds unchanged; :meth:`of` puts the holes back as page 0. A row's
    count goes when its pages do (free, detach, give back; a trim cuts it).
    A drop writes nothing and copies no kept page (:meth:`_behead`).
    """

    def __init__(self, kv: KVPagePool, size: int, rows: SlotLedger) -> None:
        self.kv: KVPagePool = kv
        #: The pool's row ledger: a growth holds its rows there while it
        #: reclaims (:meth:`_reclaim_holding`).
        self.rows: SlotLedger = rows
        self.ledger: PageLedger = kv.ledger
        self.capacity: int = kv.capacity
        self.owned: list[npt.NDArray[np.int64] | None] = [None] * size
        self.sealed: list[bytes | bytearray | None] = [None] * size
        #: An extended row's record is a view of a buffer with room to grow
        #: (capacity doubling), so a decode step's extend copies only its
        #: new pages, not the whole record; None for a row never extended.
        #: The view of that buffer from the record's first place: the
        #: buffer itself, or after a drop (:meth:`_behead`) its rest past
        #: the dropped pages' places, so that the record still starts it.
        self.grown: list[npt.NDArray[np.int64] | None] = [None] * size
        #: Rows whose record may be read by a view :meth:`of` handed out
        #: (``pages_of`` on the host, or a pool on the CPU) since the record
        #: was last copied into a new growth buffer (:meth:`_append`, which
        #: forgets the row): a trim lets such a row's buffer go, since
        #: growing in it would write places that view reads. Any other
        #: row's buffer holds no place past its record that anything
        #: handed out reads (grants and growths hand out the pages taken,
        #: never the buffer), so a trim keeps it and the next growth
        #: writes there: a trim and a growth cost the pages they move.
        #: An entry of a row with no buffer means nothing.
        self.lent: set[int] = set()
        #: Leading positions a row gave back early (:meth:`drop`, a sliding
        #: window's pages that slid out), for the rows with any: ``owned``
        #: lists only the pages after them, and :meth:`of` reads them as
        #: page 0. Empty unless some row dropped: the hot paths test only
        #: its truth.
        self.holes: dict[int, int] = {}
        self._device = kv.device
        self._on_host = kv.device.type == "cpu"
        self.fast_admits: int = 0  # granted without queueing (zero waits)
        #: ``extend``/``extend_rows`` calls answered None, short of pages:
        #: each is a retraction the scheduler made.
        self.growth_refusals: int = 0
        #: Waits of admissions granted after queueing (seconds): a recent
        #: window (the histograms of all of them are the pool's waiter
        #: queues', one per priority).
        self.waits: collections.deque[float] = collections.deque(maxlen=4096)

    # ------------------------------------------------------------ handing out

    def out(self, pages: npt.NDArray[np.int64], host: bool = False) -> torch.Tensor:
        """The caller's view of page ids: a tensor on the KV pool's device,
        or with ``host`` on the CPU (there a zero-copy view of the pool's
        record: read only)."""
        if self._on_host or host:
            return torch.from_numpy(pages)
        return host_to_device(torch.from_numpy(pages), self._device)

    def take(self, k: int) -> npt.NDArray[np.int64] | None:
        """``k`` pages (empty for 0), or None when short.

        Does not reclaim; ``k`` must be validated.
        """
        if not k:
            return _EMPTY
        return self.ledger.take(k, OWNED)

    def grant(self, row: int, pages: npt.NDArray[np.int64]) -> Grant:
        """Attach ``pages`` (from :meth:`take`) to the newly granted ``row``.

        The caller's tensor is made first: if that raises (on CUDA, the
        staging or the device allocation of the copy), nothing is recorded
        and the caller gives row and pages back.
        """
        # out(), inlined on the host.
        out = _from_numpy(pages) if self._on_host else self.out(pages)
        if pages.shape[0]:
            self.owned[row] = pages
            self.sealed[row] = pages.tobytes()
        return _new_grant(Grant, (row, out))

    def give_back(self, row: int) -> None:
        """Undo :meth:`grant` for a waiter cancelled before it resumed: the
        pages return to the head of the free ring, as if never taken."""
        pages = self.owned[row]
        self.owned[row] = None
        self.sealed[row] = None
        self.grown[row] = None
        if self.holes:
            self.holes.pop(row, None)
        if pages is not None:
            self.ledger.put_back(pages, OWNED)

    def extend(self, row: int, k: int) -> torch.Tensor | None:
        """Add ``k`` free pages to ``row`` (reclaiming first if short), or None.

        Amortised O(k): the record grows inside a buffer that doubles when
        full (``grown``), and the seal grows in place, so a request grown a
        page per decode step to n pages costs O(n) in all, not O(n**2).
        """
        arr = self._take_reclaiming(k, row)
        if arr is None:
            return None
        try:
            out = self.out(arr)  # first: see _put_back_for
        except BaseException:
            self._put_back_for(arr)
            raise
        self._append(row, arr)
        return out

    def extend_rows(self, rows: Sequence[int], k: int) -> torch.Tensor | None:
        """Add ``k`` pages to each of ``rows`` (distinct, validated), all or
        nothing; a ``(len(rows), k)`` tensor, row i's pages in line i, or None.

        One take from the page ledger and one tensor for the whole batch.
        """
        arr = self._take_reclaiming(len(rows) * k, rows)
        if arr is None:
            return None
        try:
            out = self.out(arr.reshape(len(rows), k))  # first: see _put_back_for
        except BaseException:
            self._put_back_for(arr)
            raise
        self._append_lines(rows, arr, k)
        return out

    def extend_each(self, rows: Sequence[int], counts: Sequence[int]) -> torch.Tensor | None:
        """Add ``counts[i]`` pages to ``rows[i]`` (distinct, validated; counts
        >= 0 with a sum in ``1..capacity``), all or nothing; a 1-D tensor of
        the new pages in row order, or None.

        One take from the page ledger and one tensor for the batch.
        """
        arr = self._take_reclaiming(sum(counts), rows)
        if arr is None:
            return None
        try:
            out = self.out(arr)  # first: see _put_back_for
        except BaseException:
            self._put_back_for(arr)
            raise
        self._append_counts(rows, counts, arr)
        return out

    def _put_back_for(self, arr: npt.NDArray[np.int64]) -> None:
        """Return pages a growth took when the caller's tensor of them could
        not be made (on CUDA, a device allocation): each growth makes that
        tensor before it records the pages, so that it takes nothing if it
        raises."""
        self.ledger.put_back(arr, OWNED)

    def extend_fitting(self, rows: Sequence[int], k: int) -> tuple[int, torch.Tensor]:
        """Add ``k`` pages to each of the first ``m`` of ``rows`` (distinct,
        validated; ``k >= 1``), the most the free pages cover (reclaiming
        first if they cover fewer than all); ``(m, pages)``, an ``(m, k)``
        tensor, row i's pages in line i.

        One take from the page ledger for the run.
        """
        led = self.ledger
        n = len(rows)
        if n * k > led.free_count and led.pending:
            self._reclaim_holding(rows)
        m = min(n, led.free_count // k)
        if not m:
            return 0, self.out(_EMPTY.reshape(0, k))
        arr = led.take(m * k, OWNED)
        assert arr is not None  # m * k <= free_count
        try:
            out = self.out(arr.reshape(m, k))  # first: see _put_back_for
        except BaseException:
            self._put_back_for(arr)
            raise
        self._append_lines(rows, arr, k)
        return m, out

    def extend_fitting_each(
        self, rows: Sequence[int], counts: Sequence[int]
    ) -> tuple[int, torch.Tensor]:
        """Add ``counts[i]`` pages to ``rows[i]`` (distinct, validated; counts
        >= 0) for the longest run ``rows[:m]`` whose sum the free pages cover
        (reclaiming first if they cover fewer than all); ``(m, pages)``, a
        1-D tensor of the new pages in row order (empty when none were taken).

        One take from the page ledger for the run.
        """
        led = self.ledger
        ends = list(itertools.accumulate(counts))  # ends[i]: the run rows[: i + 1]'s pages
        if ends and ends[-1] > led.free_count and led.pending:
            self._reclaim_holding(rows)
        m = bisect.bisect_right(ends, led.free_count)  # ends never decrease
        need = ends[m - 1] if m else 0
        if not need:
            return m, self.out(_EMPTY)
        arr = led.take(need, OWNED)
        assert arr is not None  # need <= free_count
        try:
            out = self.out(arr)  # first: see _put_back_for
        except BaseException:
            self._put_back_for(arr)
            raise
        self._append_counts(rows[:m], counts[:m], arr)
        return m, out

    def record_lines(self, rows: Sequence[int], arr: npt.NDArray[np.int64], k: int) -> None:
        """Record pages the owner took (:meth:`take`, counted free) for a
        growth it made the tensor of: ``rows[i]`` gets ``arr[i * k : i * k
        + k]`` (``k >= 1``), as :meth:`extend_rows` records them. A grouped
        growth takes and makes every group's tensor first, then records
        each group here."""
        self._append_lines(rows, arr, k)

    def record_counts(
        self, rows: Sequence[int], counts: Sequence[int], arr: npt.NDArray[np.int64]
    ) -> None:
        """Record pages the owner took (:meth:`take`, counted free) for a
        growth with one count per row: ``rows[i]`` gets the next
        ``counts[i]`` pages of ``arr``, as :meth:`extend_each` records
        them (a grouped growth with per-row counts)."""
        self._append_counts(rows, counts, arr)

    def _append_lines(self, rows: Sequence[int], arr: npt.NDArray[np.int64], k: int) -> None:
        """Append ``arr[i * k : i * k + k]`` to ``rows[i]`` for each of the
        ``len(arr) // k`` first rows (pages just taken OWNED)."""
        if k == 1:
            self._append_one_each(rows, arr)
            return
        append = self._append
        for i in range(len(arr) // k):
            append(rows[i], arr[i * k : i * k + k])

    def _append_counts(
        self, rows: Sequence[int], counts: Sequence[int], arr: npt.NDArray[np.int64]
    ) -> None:
        """Append the next ``counts[i]`` pages of ``arr`` to ``rows[i]``, in
        row order (pages just taken OWNED; ``sum(counts)`` of them)."""
        append = self._append
        at = 0
        for row, k in zip(rows, counts, strict=True):
            if k:
                append(row, arr[at : at + k])
                at += k

    def _append_one_each(self, rows: Sequence[int], arr: npt.NDArray[np.int64]) -> None:
        """``_append(rows[i], arr[i : i + 1])`` for each i: a decode step's
        growth, one page a row. Step for step :meth:`_append` where a row's
        buffer has room (the usual case under doubling), with the page as a
        Python int (no slice of ``arr``, no array-to-array copy, the seal
        grown by the id's bytes); anything else takes :meth:`_append`. The
        buffer tests are :meth:`_append`'s: the record a view of the row's
        buffer, ``grown`` that buffer or, for a row that dropped pages
        (:meth:`_behead`), its view from the record's start (a sliding
        window's row, grown every step and beheaded every few, stays here:
        through :meth:`_append` its growth cost 1.4-1.6x)."""
        owned, grown, sealed = self.owned, self.grown, self.sealed
        for i, page in enumerate(arr.tolist()):
            row = rows[i]
            old = owned[row]
            buf = grown[row]
            # The usual row's test first (its buffer is grown itself), then
            # a beheaded row's (grown a view of the record's base).
            if (
                old is not None
                and buf is not None
                and (old.base is buf or old.base is buf.base is not None)
            ):
                n = len(old)  # len(): a third of .shape[0]'s cost
                if n < len(buf):  # room left (else a new buffer, below)
                    buf[n] = page
                    owned[row] = buf[: n + 1]
                    # A row with a buffer was grown by _append, which made
                    # its seal a bytearray: grown in place here. (Were it
                    # bytes, the seal would not grow and the row's free
                    # would refuse its record: caught, never unsafe.)
                    seal: bytearray = sealed[row]  # type: ignore[assignment]
                    seal += page.to_bytes(8, _BYTEORDER)  # a page id is > 0
                    continue
            self._append(row, arr[i : i + 1])

    def _take_reclaiming(self, n: int, rows: int | Sequence[int]) -> npt.NDArray[np.int64] | None:
        """``n`` pages for a growth of ``rows`` (one row or several),
        reclaiming completed fences first when short; None if still short."""
        led = self.ledger
        arr = led.take(n, OWNED)
        if arr is None and led.pending and self._reclaim_holding(rows):
            arr = led.take(n, OWNED)
        return arr

    def _reclaim_holding(self, rows: int | Sequence[int]) -> int:
        """Reclaim the page ledger's completed fences for a growth of
        ``rows`` (validated allocated, nothing run since), held meanwhile
        (:meth:`SlotLedger.hold`): a fence's ``query()`` may call the pool
        back, and a call there that freed, trimmed or detached one of them
        would leave the growth appending pages to a row that no longer owns
        what it did (a free row's record: pages owned by nobody). The pages
        made free."""
        held: Sequence[int] = (rows,) if rows.__class__ is int else rows  # type: ignore[assignment]
        ledger = self.rows
        ledger.hold(held)
        try:
            return self.ledger.reclaim()
        finally:
            ledger.unhold(held)

    def _append(self, row: int, arr: npt.NDArray[np.int64]) -> None:
        """Grow ``row``'s record and seal by ``arr`` (pages just taken OWNED)."""
        old = self.owned[row]
        if old is None:
            self.owned[row] = arr
            self.sealed[row] = arr.tobytes()
            return
        n = len(old)  # len(): a third of .shape[0]'s cost
        end = n + len(arr)
        buf: npt.NDArray[np.int64] | None = self.grown[row]
        if (
            buf is None
            or end > len(buf)
            # The record a view of the row's buffer: ``grown`` that buffer
            # or, for a row that dropped pages, its view from the record's
            # start (a window's drops and growths move along it). The same
            # test as _append_one_each's.
            or not (old.base is buf or old.base is buf.base is not None)
        ):
            # A new buffer: the record as it reads now is copied (a write
            # into it stays visible against the seal) to its start; earlier
            # views of the record keep the old memory. At most the pool's
            # page count.
            buf = np.empty(min(max(2 * end, 16), self.capacity), dtype=np.int64)
            buf[:n] = old
            self.grown[row] = buf
            # No view of the new buffer handed out yet (of() lends one).
            self.lent.discard(row)
        assert buf is not None  # for mypy: `is not` widened it to old.base's type
        buf[n:end] = arr
        self.owned[row] = buf[:end]
        # The seal grows from the old seal, not from the record as it reads
        # now: a write into the record is still seen. In place: a bytearray.
        seal = self.sealed[row]
        assert seal is not None
        if seal.__class__ is bytes:
            seal = self.sealed[row] = bytearray(seal)
        seal += arr.tobytes()

    def of(self, row: int, host: bool = False) -> torch.Tensor:
        """``row``'s pages by position (``pages_of``): on the host, a view
        of its record unless it dropped pages (then :meth:`positions`), and
        the row is noted ``lent`` (a trim keeps its buffer no more)."""
        pages = self.owned[row]
        if self.holes and row in self.holes:
            return self.out(self.positions(row), host)
        if pages is None:
            return self.out(_EMPTY, host)
        if self._on_host or host:
            self.lent.add(row)
        return self.out(pages, host)

    def table(
        self, rows: Sequence[int], width: int | None, host: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The pages of ``rows`` (validated) by position as one block table:
        ``(table, counts)``, ``table`` an ``(len(rows), width)`` int64
        tensor whose line i is :meth:`of` ``rows[i]`` padded with page 0,
        ``counts`` line i's positions (dropped ones included). ``width``
        None: the most positions of any row. A fresh array each call (never
        a record), filled by one concatenation and one masked write, so two
        tensors whatever the count of rows. :class:`CapacityError` (nothing
        changed: a read) for a row with more positions than ``width``."""
        owned = self.owned
        n = len(rows)
        records = [owned[row] for row in rows]
        ends = np.fromiter(
            (0 if pages is None else pages.shape[0] for pages in records), np.int64, n
        )
        holes = self.holes
        starts = None
        if holes:
            starts = np.fromiter((holes.get(row, 0) for row in rows), np.int64, n)
            ends += starts
        most = int(ends.max()) if n else 0
        if width is None:
            width = most
        elif most > width:
            i = int(ends.argmax())
            raise CapacityError(
                f"row {rows[i]} has {most} page positions (dropped ones included), past "
                f"the table's width {width}"
            )
        out = table_zeros(n, width)
        parts = [pages for pages in records if pages is not None]
        if parts:
            places = np.arange(width)
            mask = places < ends[:, None]
            if starts is not None:
                mask &= places >= starts[:, None]
            # Row-major: line by line, positions in order, as the parts are.
            out[mask] = np.concatenate(parts) if len(parts) > 1 else parts[0]
        return self.out(out, host), self.out(ends, host)

    def positions(self, row: int) -> npt.NDArray[np.int64]:
        """``row``'s pages by position, its dropped ones as page 0: a fresh
        array (never the record)."""
        pages = self.owned[row]
        live = 0 if pages is None else pages.shape[0]
        d = self.holes.get(row, 0)
        out = np.zeros(d + live, dtype=np.int64)
        if pages is not None:
            out[d:] = pages
        return out

    def forget(self, rows: Sequence[int]) -> None:
        """Drop the dropped counts of ``rows`` (freed, or their pages detached)."""
        holes = self.holes
        for row in rows:
            holes.pop(row, None)

    def trim_holes(self, rows: Sequence[int], keeps: Sequence[int]) -> None:
        """After a trim: a row keeps at most ``keeps[i]`` positions, so at
        most that many dropped ones."""
        holes = self.holes
        for row, keep in zip(rows, keeps, strict=True):
            d = holes.get(row)
            if d is not None and keep < d:
                if keep:
                    holes[row] = keep
                else:
                    del holes[row]

    def detach(self, row: int, host: bool = False) -> torch.Tensor:
        """Hand ``row``'s pages to the caller; the tensor is theirs (on the
        host the page pool remembers it, so freeing it there is cheap). The
        tensor is made before anything changes: if that raises (on CUDA, a
        device allocation), the row keeps its pages."""
        pages = self.owned[row]
        if pages is None:
            empty = self.out(_EMPTY, host)
            self.grown[row] = None
            self.sealed[row] = None
            if self.holes:
                self.holes.pop(row, None)
            return empty
        # The row's pages are the caller's now, and KVPagePool.free takes
        # them. They are the seal's: a record written into may list others
        # (another holder's page, which kv.free would then take from it),
        # so the caller gets a fresh copy of the row's own pages instead.
        # No view of the seal outlives that copy: a seal grown or cut in
        # place is a bytearray, and a view of it held by this frame's
        # traceback (the tensor below raising; the row keeps its pages)
        # would make its next growth, trim or drop raise BufferError
        # halfway (pages taken or freed, the seal not cut).
        sealed = self.sealed[row]
        assert sealed is not None
        if pages.tobytes() != sealed:
            pages = np.frombuffer(sealed, dtype=np.int64).copy()
        elif pages.base is not None:
            # A view of the row's doubling buffer (up to twice its pages) or
            # of an extend_rows batch array (which the caller holds too): the
            # caller keeps detached pages for long (a prefix cache), so they
            # get an exact-size array of their own, pinning neither.
            pages = pages.copy()
        remembered = self._on_host and pages.shape[0] > 1
        out: torch.Tensor | None = None if remembered else self.out(pages, host)
        self.owned[row] = None
        self.grown[row] = None
        self.sealed[row] = None
        if self.holes:
            self.holes.pop(row, None)
        self.ledger.disown(pages)  # the seal's pages, whichever array holds them
        if out is None:
            return self.kv._hand_out(pages)  # distinct and in range: vouched for
        return out

    def written_error(self, row: int) -> InvalidSlotError:
        return InvalidSlotError(
            f"the pages of row {row} were written into since they were granted "
            "(grant.pages, pages_of() and the tensors extend() and extend_rows() "
            "return are read-only: they may be views of the row's record); "
            f"the pool cannot vouch for them: restore them, or take them with "
            f"detach_pages({row}) and free them to the KVPagePool yourself"
        )

    def check_record(self, row: int) -> None:
        """Raise :class:`InvalidSlotError` if ``row``'s record differs from its seal."""
        pages = self.owned[row]
        if pages is not None and pages.tobytes() != self.sealed[row]:
            raise self.written_error(row)

    # ------------------------------------------------------------ freeing with rows

    def _group_many(
        self,
        rows: Sequence[int],
        uses: Sequence[Any],
        keeps: Sequence[int] | None,
        belows: Sequence[int] | None,
        groups: dict[int, tuple[Any, list[int], list[npt.NDArray[np.int64]]]],
    ) -> None:
        """:meth:`prepare_free`'s checks and grouping for a batch of more
        than ``_JOINED_CHECK`` rows, its per-row Python work cut: the rows
        that give pages back and the places they give (a free: all of a
        row's record; a trim or a drop: a run of it) in one loop a form,
        then every record (a trim's or a drop's: only the pages it gives
        back, as :meth:`prepare_free` checks them) against its seal in one
        joined compare and, when the rows share one recorded use (none, or
        the step's, as the usual step's do), one group whose pages are the
        joined records, no slice and no lookup a row after the first loop.
        Its one part lists many rows' pages, so :meth:`prepare_free` checks
        them distinct as it does several parts. The same checks, answers
        and errors as the loop for a few rows."""
        owned = self.owned
        sealed = self.sealed
        holes = self.holes
        # The rows that give pages back; a trim's and a drop's with the
        # pages they give back (a trim's past keep, a drop's below its
        # live ones' first kept place) and those pages' seal, checked alone
        # (O(pages given back): prepare_free); a free's, all of each record.
        picked: list[int] = []
        records: Sequence[Any]
        seals: Sequence[Any]
        used: Sequence[Any]
        parts: list[Any] = []  # int64 arrays
        part_seals: list[bytes | bytearray] = []
        if keeps is not None:
            for i, row in enumerate(rows):  # enumerate: zip(strict=True) costs 3x
                pages = owned[row]
                if pages is None:
                    continue
                keep = keeps[i]
                if holes:
                    keep = max(0, keep - holes.get(row, 0))
                if len(pages) > keep:
                    picked.append(row)
                    parts.append(pages[keep:])
                    part_seals.append(sealed[row][keep * 8 :])  # type: ignore[index]
        elif belows is not None:
            for i, row in enumerate(rows):
                pages = owned[row]
                if pages is None:
                    continue
                n = belows[i] - holes.get(row, 0) if holes else belows[i]  # live pages below
                if n > 0:  # at most its live pages (_check_below)
                    picked.append(row)
                    parts.append(pages[:n])
                    part_seals.append(sealed[row][: n * 8])  # type: ignore[index]
        else:
            picked = [row for row in rows if owned[row] is not None]
        if not picked:
            return
        # A record and its seal are equally long (check_invariants), so the
        # joined bytes are equal only if each pair is; else the first row
        # written into is found for its error (check_record). The rows'
        # records, seals and uses gathered by itemgetter (in C: a third of
        # a comprehension's cost a row); it answers one item for one row.
        gather = itemgetter(*picked)
        used = gather(uses) if len(picked) > 1 else [gather(uses)]
        if keeps is not None or belows is not None:
            records, seals = parts, part_seals
        elif len(picked) > 1:
            records, seals = gather(owned), gather(sealed)
        else:
            records, seals = [gather(owned)], [gather(sealed)]
        joined = b"".join(records)
        if joined != b"".join(seals):
            for row, pages, seal in zip(picked, records, seals, strict=True):
                if pages.tobytes() != seal:
                    raise self.written_error(row)
        if len(set(map(id, used))) == 1:
            # One group: its pages are the joined records (a trim's: its
            # joined tails; a drop's: its joined heads), no slice a row; a
            # fresh array, as the concatenation of slices was.
            part = np.frombuffer(joined, dtype=np.int64).copy()
            first = used[0]
            groups[id(first)] = (first, picked, [part])
            return
        for i, row in enumerate(picked):
            pages = records[i]
            use = used[i]
            entry = groups.get(id(use))
            if entry is None:
                groups[id(use)] = (use, [row], [pages])
            else:
                entry[1].append(row)
                entry[2].append(pages)

    def prepare_free(
        self,
        rows: Sequence[int],
        uses: Sequence[Any],
        keeps: Sequence[int] | None = None,
        belows: Sequence[int] | None = None,
    ) -> list[tuple[Any, Any, bool, tuple[Fence, ...]]]:
        """Check the pages of ``rows`` before they are freed; change nothing.

        Raises for a record written into (:meth:`check_record`); a trim
        or a drop checks only the pages it gives back against their seal,
        so that it costs the pages trimmed or dropped, not those kept:
        those are the row's still, and a write into them is refused where
        they are given back (the row's free, a later drop or trim; a
        detach hands out the seal's pages), with nothing changed, as ever.
        Groups the rows' pages by the rows' recorded use (one group for the
        usual step whose rows share one fence) and validates each group with
        the page ledger, so pages freed behind the pool's back raise here; with
        several groups, their pages together must be distinct as well (a page
        freed behind one row's back and taken by another is listed by both).
        With ``keeps`` (a trim), ``rows[i]`` gives back only its pages past its
        first ``keeps[i]`` positions (dropped ones included), and a row that
        has no more is left out. With ``belows`` (a drop), ``rows[i]`` gives
        back only its pages at positions below ``belows[i]`` (at most its
        positions: the caller checks), and a row with none there is left out.
        Returns ``[(rows, ids, owned, use_fences)]`` for :meth:`free`.
        """
        owned = self.owned
        sealed = self.sealed
        holes = self.holes
        groups: dict[int, tuple[Any, list[int], list[npt.NDArray[np.int64]]]] = {}
        if len(rows) > _JOINED_CHECK:
            self._group_many(rows, uses, keeps, belows, groups)
        else:
            for i, row in enumerate(rows):
                pages = owned[row]
                if pages is None:
                    continue
                if keeps is not None:
                    keep = keeps[i]
                    if holes:
                        keep = max(0, keep - holes.get(row, 0))
                    if pages.shape[0] <= keep:
                        continue
                    pages = pages[keep:]
                    # The pages given back only (O(pages trimmed)): the kept
                    # ones stay the row's, checked by whatever gives them
                    # back (the row's free, a detach, a drop, a later trim).
                    if pages.tobytes() != sealed[row][keep * 8 :]:  # type: ignore[index]
                        raise self.written_error(row)
                elif belows is not None:
                    n = belows[i] - holes.get(row, 0)  # live pages below
                    if n <= 0:
                        continue
                    pages = pages[:n]
                    # The pages given back only (O(pages dropped)), as a
                    # trim's: the kept ones are checked where they are
                    # given back (the row's free, a later drop or trim).
                    if pages.tobytes() != sealed[row][: n * 8]:  # type: ignore[index]
                        raise self.written_error(row)
                else:
                    self.check_record(row)
                use = uses[row]
                entry = groups.get(id(use))
                if entry is None:
                    groups[id(use)] = (use, [row], [pages])
                else:
                    entry[1].append(row)
                    entry[2].append(pages)
        prepared = []
        prepare = self.ledger.prepare
        trusted = self.ledger.all_in
        ids: npt.NDArray[np.int64] | list[int]
        for use, group_rows, parts in groups.values():
            if len(group_rows) == 1:
                part = parts[0]
                # One row's record (or a slice of it), its seal checked
                # above: distinct in-range ids, so only their state is
                # checked, as the no-fence fast free does (free_owned); a
                # few go through prepare's one Python pass, and a failed
                # check there too, for its error.
                if part.shape[0] > _TRUSTED_PASS and trusted(part, OWNED):
                    ids, fresh = part, False
                else:
                    ids, fresh = prepare(part, "freed", OWNED)
            else:
                # Many rows' pages (one part when _group_many cut them at
                # once): checked distinct as well.
                ids, fresh = prepare(
                    np.concatenate(parts) if len(parts) > 1 else parts[0], "freed", OWNED
                )
            if use is None:
                fences: tuple[Fence, ...] = ()
            elif use.__class__ is tuple:
                fences = use
            else:
                fences = (use,)
            prepared.append((group_rows, ids, fresh, fences))
        if len(groups) > 1:
            everything = np.concatenate([part for _, _, parts in groups.values() for part in parts])
            self.ledger.prepare(everything, "freed", OWNED)  # raises for a page listed twice
        return prepared

    def free(
        self,
        prepared: list[tuple[Any, Any, bool, tuple[Fence, ...]]],
        extra: tuple[Fence, ...],
        keep: dict[int, int] | None = None,
        below: dict[int, int] | None = None,
    ) -> int:
        """Free what :meth:`prepare_free` checked, each group behind its use
        fences plus ``extra`` (the free's ``fence=`` and ``after=``).

        With ``keep`` (a trim: ``{row: pages it keeps}``, its dropped
        positions not counted), each row's record and seal are cut to its
        first pages instead of dropped, O(pages trimmed) a row (a seal
        never grown nor cut before, still bytes, is copied to a bytearray
        of its first pages once: O(pages kept) that once); nothing is
        written. The row's
        growth buffer stays, so the next :meth:`extend` writes the cut
        places in it, unless :meth:`of` lent a view of it (``lent``): then
        it is let go and the next growth copies the record into a new
        buffer instead of writing over the cut places, which that view
        (``pages_of`` on the host) still reads. The caller then cuts the
        dropped counts (:meth:`trim_holes`). With ``below`` (a drop:
        ``{row: positions dropped from now on}``), each row's record loses
        its first pages instead (:meth:`_behead`). Returns the pages free
        at once.
        """
        owned = self.owned
        sealed = self.sealed
        grown = self.grown
        lent = self.lent
        free_prepared = self.ledger.free_prepared
        immediate = 0
        for group_rows, ids, fresh, fences in prepared:
            # Freed first, then disowned: a fence's query() raising what is
            # not an Exception leaves this group's pages with their rows.
            immediate += free_prepared(ids, fresh, fences + extra)
            # One loop a form, hoisted out of the rows: a batch's per-row cost.
            if below is not None:
                self._behead(group_rows, below)
            elif keep is not None:
                for row in group_rows:
                    k = keep[row]
                    if k:
                        # The record and seal cut to the first k pages;
                        # nothing is written. The row's growth buffer is
                        # kept (the next growth writes the places past k)
                        # unless a view of it was handed out (lent): those
                        # places are what it still reads, an in-flight
                        # step's block table, so the buffer is let go and
                        # the next growth copies the record into a new one.
                        pages = owned[row]
                        assert pages is not None
                        owned[row] = pages[:k]
                        if row in lent:
                            grown[row] = None
                        seal = sealed[row]
                        if seal.__class__ is bytearray:  # grown or cut before: in place
                            assert isinstance(seal, bytearray)
                            del seal[k * 8 :]
                        else:
                            # A seal never grown (bytes) becomes a bytearray
                            # of its first k pages, once: later trims cut it
                            # in place, not copying it up to keep each time.
                            assert isinstance(seal, bytes)
                            sealed[row] = bytearray(memoryview(seal)[: k * 8])
                    else:
                        owned[row] = None
                        sealed[row] = None
                        grown[row] = None
            else:
                for row in group_rows:
                    owned[row] = None
                    sealed[row] = None
                    grown[row] = None
        return immediate

    def _behead(self, rows: Sequence[int], below: dict[int, int]) -> None:
        """Drop each of ``rows``' pages at positions below ``below[row]``
        (more than it had dropped, at most its positions) from its record
        and seal.

        O(pages dropped), not O(pages kept): the record becomes the view of
        its rest and nothing is written, so the tensors handed out before
        (``grant.pages``, ``pages_of``, an extend's) keep what they read.
        Its growth buffer's view (``grown``) moves past the dropped places
        with it, and :meth:`_append` keeps growing the record there (into a
        new buffer, from its start, at the end: amortised O(1) a page). The
        seal becomes a bytearray cut from its front (CPython moves its
        start: no copy), once copied from bytes. One loop for the rows, its
        lookups hoisted: a window's slide pays it every few steps for every
        row."""
        owned, sealed, grown, holes = self.owned, self.sealed, self.grown, self.holes
        for row in rows:
            pages = owned[row]
            assert pages is not None
            b = below[row]
            n = b - holes.get(row, 0)
            if n >= len(pages):
                owned[row] = None
                sealed[row] = None
                grown[row] = None
            else:
                owned[row] = pages[n:]
                seal = sealed[row]
                if seal.__class__ is bytearray:
                    del seal[: n * 8]
                else:  # never grown nor cut: copied once (one copy, not two)
                    assert seal is not None
                    sealed[row] = bytearray(memoryview(seal)[n * 8 :])
                buf = grown[row]
                if buf is not None:  # the record starts it (check_invariants)
                    grown[row] = buf[n:]
            holes[row] = b

    # ------------------------------------------------------------ proof

    def check_invariants(self, allocated_rows: Sequence[int]) -> None:
        allocated = set(allocated_rows)
        for row, d in self.holes.items():
            if row not in allocated:
                raise AssertionError(f"row {row} has dropped positions but is not allocated")
            if d.__class__ is not int or d <= 0:
                raise AssertionError(f"row {row}'s dropped count {d!r} is not an int > 0")
        seals: list[bytes | bytearray] = []
        for row, pages in enumerate(self.owned):
            if pages is None:
                if self.sealed[row] is not None or self.grown[row] is not None:
                    raise AssertionError(f"row {row} owns no pages but has a seal or buffer")
                continue
            if row not in allocated:
                raise AssertionError(f"row {row} owns pages but is not allocated")
            if pages.dtype != np.int64 or pages.ndim != 1 or pages.strides != (8,):
                raise AssertionError(f"row {row}'s record is not a 1-D contiguous int64 array")
            seal = self.sealed[row]
            if seal is None or len(seal) != pages.nbytes:
                raise AssertionError(
                    f"row {row}'s seal is missing or not as long as its record "
                    f"({pages.shape[0]} pages)"
                )
            buf = self.grown[row]
            if buf is not None:
                whole = buf if buf.base is None else buf.base
                if len(whole) > self.capacity or pages.base is not whole:
                    raise AssertionError(
                        f"row {row}'s record is not a view of its buffer, or that is too big"
                    )
                if pages.ctypes.data != buf.ctypes.data:
                    raise AssertionError(
                        f"row {row}'s record does not start where its buffer's view does"
                    )
            # The seal, not the record: the caller may have written into the
            # record (against the contract; the row's free refuses it), which
            # leaves the pool's own state, the seal and the ledger, intact.
            seals.append(seal)
        # Vectorised: a million owned pages (page_size 1, long contexts)
        # took about a second as a Python pass a page. One joined copy, no
        # views of the seals: a view of a bytearray seal, kept alive by a
        # failed check's traceback, would stop the row's growth resizing it
        # (BufferError once the record had grown and the seal not).
        seen = np.frombuffer(b"".join(seals), dtype=np.int64) if seals else _EMPTY
        if has_duplicates(seen):
            raise AssertionError("a page is owned by two rows")
        state = self.ledger._state
        owned_pages = int(np.count_nonzero(state == OWNED))
        if owned_pages != len(seen):
            raise AssertionError(
                f"{owned_pages} pages are OWNED but the rows' seals list {len(seen)}"
            )
        in_range = (seen >= 0) & (seen < len(state))
        wrong = np.flatnonzero(~in_range)
        if not len(wrong):
            wrong = np.flatnonzero(state[seen] != OWNED)
        if len(wrong):
            page = int(seen[wrong[0]])
            what = self.ledger.state_of(page) if 0 <= page < len(state) else "out of range"
            raise AssertionError(f"page {page} is owned by a row but is {what}")
