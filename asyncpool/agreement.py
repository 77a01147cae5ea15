"""The same reclaim decisions on every tensor-parallel rank.

Engines that run one scheduler replica per rank (SGLang: one scheduler
process per rank, fed the same requests) must build the same batch on every
rank at every step. A pool that reclaims when a fence *happens* to have
completed decides by timing, and timing differs across ranks. With
``reclaim="explicit"`` a pool never asks a fence anything on its own; ids come
back through two calls that every rank makes at the same point of its loop:

* ``retire(fence)`` (no communication): the scheduler has processed the step
  ``fence`` ends, so everything behind fences up to it on its stream returns,
  in record order (:meth:`~asyncpool.deferral.Deferrals.retire`);
* ``agree(group)`` (this module): for fences the scheduler does not observe
  (KV transfers, offload copies), each rank asks its pending fences locally,
  the flags are all-reduced with MIN over ``group``, and every rank acts on
  exactly the agreed result.

What :func:`agree` sends: ONE int64 tensor per call in the common case::

    [header, -header, flags of the first WIDTH batches (zero padded), interrupted]

``header`` has seven numbers for each of two ledger slots, whatever the
caller passes (a pool with ``kv=`` fills both, one without fills the
first, a bare ``KVPagePool`` the first with pages): what the slot holds
(none, rows, pages), pending batches, deferral counter, pending ids, free
ids, a CRC-32 of the pending batches' sizes and ids in deferral order, quarantined ids (with
free and pending, they fix the allocated count: a rank that quarantined
what another released, a drain's local verdict on a fence that faulted
on one rank only, is caught even once both have allocated the rest). So
the tensor has the same length on every rank, and MIN of ``header`` and of ``-header`` gives
the least and the greatest value across ranks: a rank that made different
calls (hence holds different batches), or whose pool was built otherwise
(``kv=`` on one rank only), is detected *before* any flag is trusted, and
every rank raises :class:`AgreementError` at the same call (the reduced
values are identical everywhere), instead of a collective hanging or
aborting on mismatched sizes. Flags are three per pending batch, in
deferral order (the ``did`` each batch got when it was created: identical
across ranks that made the same calls): ``done`` (every fence it waits for
completed here), ``overdue`` (not done here, and pending for
``fence_timeout`` or more) and ``faulted`` (a fence raised here, an
interrupt aside), the last two sent negated, so that MIN reduces them to the MAX over ranks. Agreed:
faulted on any rank -> quarantined on every rank (a transfer that failed on
one rank only must not hold its memory forever unseen; quarantine never
frees early); else done on every rank -> released; else overdue on any
rank -> counted and logged once as overdue on every rank (the memory stays
held; ``force_release`` is the operator's call). Batches beyond ``WIDTH``
go in a second all-reduce whose size every rank knows from the checked
header. The first tensor ends with one more word, -1 on a rank where a
fence's ``query()`` raised ``KeyboardInterrupt`` or ``SystemExit`` (an
interrupt): then no rank settles anything, that rank raises its interrupt
and the others :class:`AgreementError`.

Which fences: every pending batch, ordered fences not yet retired included
(an offload copy on a side stream is ordered but nobody retires it; for the
forward stream agreement merely returns rows a little before ``retire``
would, and identically on every rank). ``agree`` is the one call of an
explicit pool that asks fences ``query()``.

With gloo the tensor lives on the CPU; with NCCL on the current CUDA device
(NCCL path untested here: no GPU in CI). Synchronous: call it from the
scheduler's thread, every rank at the same point, as for any collective.
"""

from __future__ import annotations

import array
import logging
import threading
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .deferral import Deferrals, Deferred
from .errors import AgreementError
from .fences import Fence
from .naming import pool_log
from .overdue import log_overdue, oldest_first

__all__ = ["WIDTH", "Agreement", "agree", "check_explicit", "check_reclaim_mode"]

logger: logging.Logger = logging.getLogger(__name__)

#: Pending batches whose flags ride in the first (always sent) all-reduce.
WIDTH = 64
#: Ledgers one agreement covers at most (a pool's rows and its pages).
SLOTS = 2
_HEADER = (
    "ledger kind",
    "pending batches",
    "deferral counter",
    "pending ids",
    "free ids",
    "pending ids (crc32)",
    "quarantined ids",
)
# What a header slot holds (its "ledger kind"), and the words for each.
_KINDS = {"rows": 1, "pages": 2}
_KIND_WORDS = {0: "nothing", 1: "rows", 2: "pages", 3: "ids"}


def check_reclaim_mode(reclaim: object) -> bool:
    """``reclaim`` as a flag (True: explicit); ValueError for anything but
    ``"auto"`` or ``"explicit"``."""
    if reclaim == "explicit" and reclaim.__class__ is str:
        return True
    if reclaim == "auto" and reclaim.__class__ is str:
        return False
    raise ValueError(f'reclaim must be "auto" or "explicit", got {reclaim!r}')


def check_explicit(ledger: Deferrals[Any], call: str) -> None:
    """Raise RuntimeError unless ``ledger`` is in explicit mode."""
    if not ledger.explicit:
        raise RuntimeError(
            f'{call}() is for pools built with reclaim="explicit"; this one reclaims '
            'by itself (reclaim="auto"), so its decisions follow fence timing'
        )


def forget_stream(ledgers: Sequence[Deferrals[Any]], stream_key: object) -> bool:
    """The pools' ``forget_stream``: drop the retired mark of ``stream_key``
    on every ledger of ``ledgers`` (all in explicit mode); True if any had
    one. ``TypeError`` for a key that is not an int, ``RuntimeError`` for
    an ``"auto"`` pool or while batches still wait for a fence of that
    stream (queued behind it, or waiting for it after another stream's
    fence: :meth:`Deferrals.waits_on_stream`) or while an allocated row
    carries a recorded use of it not yet retired; either way nothing
    changes. The recorded uses its retire covers are dropped with the mark
    (``SlotLedger.forget_stream``): a free of their rows stays free of them
    at once, as with the mark."""
    check_explicit(ledgers[0], "forget_stream")
    if stream_key.__class__ is bool or not isinstance(stream_key, int):
        raise TypeError(
            f"forget_stream() takes a stream key (an int: a fence's stream_key, or "
            f"one from new_stream_key()), got {stream_key!r} of type "
            f"{type(stream_key).__name__}"
        )
    waiting = sum(led.waits_on_stream(stream_key) for led in ledgers)
    if waiting:
        raise RuntimeError(
            f"forget_stream({stream_key}): {waiting} batch(es) still wait for a fence of "
            "that stream (behind it, or after another stream's fence); retire what they "
            "wait for first (a stream is forgotten once done with), "
            "nothing was changed"
        )
    using = sum(led.stream_uses(stream_key)[1] for led in ledgers)
    if using:
        raise RuntimeError(
            f"forget_stream({stream_key}): {using} allocated row(s) carry a recorded use "
            "of that stream not yet retired (their free would wait behind it); retire it "
            "or free them first (a stream is forgotten once done with), nothing was changed"
        )
    forgot = False
    for led in ledgers:
        forgot = led.forget_stream(stream_key) or forgot
    return forgot


@dataclass(frozen=True, slots=True)
class Agreement:
    """What one :func:`agree` call did, the same on every rank.

    ``released``: ids released per ledger (in ledger order); ``quarantined``:
    ids quarantined because their fence faulted on some rank;
    ``newly_overdue``: batches now agreed overdue (first time: not done on
    some rank past the timeout);
    ``batches``: pending batches the call covered; ``collectives``: how many
    all-reduces it ran (1, or 2 beyond ``WIDTH`` batches); ``seconds``: its
    wall time here.
    """

    released: tuple[int, ...]
    quarantined: int
    newly_overdue: int
    batches: int
    collectives: int
    seconds: float


def _free_count(led: Deferrals[Any]) -> int:
    return int(getattr(led, "free_count", 0))


def _digest(batches: Sequence[Deferred[Any]]) -> int:
    """A CRC-32 of the pending batches' sizes and ids, in deferral order:
    ranks whose batches are as many but hold different rows or pages, or
    the same ones cut into batches at other places, disagree."""
    crc = 0
    for batch in batches:
        crc = zlib.crc32(batch.n.to_bytes(8, "little"), crc)
        items = batch.items
        if items and items[0].__class__ is int:  # row ids
            crc = zlib.crc32(array.array("q", items).tobytes(), crc)
        else:  # arrays of page ids
            for part in items:
                crc = zlib.crc32(part.tobytes(), crc)
    return crc


def _device_for(group: Any) -> torch.device:
    import torch.distributed as dist

    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class _ThreadBuffers(threading.local):
    """Reused all-reduce buffers of the calling thread, per (device, length):
    gloo pays a few hundred microseconds to set up a tensor it has not seen
    (measured: a fresh first-round tensor, then of 112 elements, per call
    cost 0.7-0.9 ms against 0.5-0.6 ms for a reused one, 2 ranks on one
    host), and the first round always has the same length, so a thread
    keeps one pair per device it agreed on. Thread-local: the buffers die
    with their thread (a dict keyed by ``threading.get_ident()`` kept those
    of every thread a thread pool ever ran agree() on, and handed a dead
    thread's to a new one that was given its ident)."""

    def __init__(self) -> None:
        self.by_shape: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}


_buffers = _ThreadBuffers()


def _all_reduce_min(
    values: list[int], group: Any, device: torch.device, *, reuse: bool = True
) -> list[int]:
    import torch.distributed as dist

    key = (str(device), len(values))
    kept = _buffers.by_shape
    bufs = kept.get(key) if reuse else None
    if bufs is None:
        host = torch.zeros(len(values), dtype=torch.int64)
        bufs = (host, host if device.type == "cpu" else host.to(device))
        if reuse:
            kept[key] = bufs
    host, t = bufs
    host.numpy()[:] = values
    if t is not host:
        t.copy_(host)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    out: list[int] = t.tolist()
    return out


def check_group(group: Any) -> None:
    """Raise unless torch.distributed is initialised and ``group`` is a
    process group (or None, the default group)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "agree() needs torch.distributed initialised (dist.init_process_group) "
            "with the same group on every rank"
        )
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            "agree() was given a group this rank is not a member of (dist.new_group "
            "returns GroupMember.NON_GROUP_MEMBER to ranks outside it); call agree() "
            "on the ranks of the group only, with the group each of them got"
        )
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"agree() takes a torch.distributed ProcessGroup (or None for the default "
            f"group), got {group!r} of type {type(group).__name__}"
        )


def agree(
    group: Any,
    ledgers: Sequence[Deferrals[Any]],
    *,
    overdue_after: float | None = None,
    pool_name: str | None = None,
    page_groups: Sequence[str] | None = None,
) -> Agreement:
    """Settle the pending fences of ``ledgers`` identically on every rank of ``group``.

    A collective: every rank of ``group`` must call it at the same point,
    on pools built alike, driven by the same calls. See the module docstring
    for what is sent and how the flags are agreed. Raises
    :class:`AgreementError` on every rank, changing nothing, when the
    ranks' ledgers disagree (what they are, different pending batches,
    deferral counters, pending, free or quarantined counts, or a CRC-32 of
    the pending batches: as many batches holding other rows or pages, or
    the same ones cut at other places): the
    ranks did not make the same calls, or their pools were built otherwise.
    The order of the free queues is not compared, nor which request holds
    what (a pool does not know its requests): ranks that hand the same rows
    to different requests pass. What is checked before the collective
    raises on the calling rank only (``ValueError`` for more than
    :data:`SLOTS` ledgers, the same ledger twice or a group this rank is
    not in, ``TypeError`` for a non-group, ``RuntimeError`` without
    torch.distributed), and the other ranks then wait in the all-reduce
    until the group's timeout. A fence's ``query()`` that raises
    ``KeyboardInterrupt`` or ``SystemExit`` on some rank interrupts the
    agreement on every rank at the same call, changing nothing anywhere:
    no other fence is asked there, the first all-reduce still runs (it
    carries an "interrupted" word), that rank raises its interrupt and
    every other rank :class:`AgreementError`. No rank is left in a
    collective alone, and all of them leave the call alike. A
    ``CancelledError`` from a ``query()`` (a handle wrapping a cancelled
    future: its own state, which repeats) is a fault, as any exception.
    A fault seen at an agreement that settles nothing (it raised, or was
    interrupted) is still a fault at the next one, whatever the fence
    answers then. Errors of the collective itself (a rank gone, a timeout
    of the group) propagate as torch raises them, but on an interrupted
    rank the interrupt is raised instead (the error as its context).
    ``pool_name``: the calling pool's name, which starts every overdue
    warning logged (None: the lines as they always were).

    ``page_groups``: a pool with KV groups passes its group names, and
    ``ledgers`` is then its row ledger followed by one page ledger per
    group, in that order. The groups share the second header slot (so the
    tensor has the same length on every rank, whatever its pool's
    layout): its kind encodes the group count and names, its counts are
    sums, and its CRC-32 covers each group's pending batches and counts, so
    ranks built with other groups, or whose groups hold other pages,
    raise :class:`AgreementError` like any other disagreement.
    """
    if page_groups is not None:
        if len(ledgers) != 1 + len(page_groups) or not page_groups:
            raise ValueError(
                f"agree() with page groups takes the row ledger and one page ledger per "
                f"group: {len(page_groups)} groups, {len(ledgers)} ledgers"
            )
    elif len(ledgers) > SLOTS:
        raise ValueError(f"agree() covers at most {SLOTS} ledgers, got {len(ledgers)}")
    if len({id(led) for led in ledgers}) < len(ledgers):
        # Each slot would settle the same batches: every id released twice.
        raise ValueError("agree() was given the same ledger twice")
    check_group(group)
    t0 = time.perf_counter()
    views: list[list[Deferred[Any]]] = [led.pending_batches() for led in ledgers]
    # A query() asked below may call the pool (a transfer handle's
    # watchdog force-releasing): apply_agreement then leaves the batches
    # that settled meanwhile.
    marks = [led.settled_mark() for led in ledgers]
    cache: dict[int, tuple[Fence, int, BaseException | None]] = {}
    # A query() that raised KeyboardInterrupt or SystemExit here: the
    # agreement still runs its first collective, so no other rank waits in
    # it alone, and every rank then leaves the call, nothing changed.
    interrupted: list[BaseException] = []
    device = _device_for(group)
    header: list[int] = []
    flags: list[int] = []
    for led, batches in zip(ledgers, views, strict=True):
        if page_groups is None or led is ledgers[0]:
            header.extend(
                (
                    _KINDS.get(led.unit, 3),
                    len(batches),
                    led.deferral_counter,
                    led.pending,
                    _free_count(led),
                    _digest(batches),
                    led.quarantined,
                )
            )
        flags.extend(led.agreement_flags(batches, cache, overdue_after, led._clock(), interrupted))
    if page_groups is not None:
        header.extend(_groups_slot(page_groups, ledgers[1:], views[1:]))
    _flip(flags)  # overdue and faulted negated: their MIN is -MAX
    header.extend([0] * (len(_HEADER) * SLOTS - len(header)))  # empty slots
    total = sum(len(b) for b in views)
    first = flags[: 3 * WIDTH]
    first.extend([0] * (3 * WIDTH - len(first)))
    # The last word: -1 where a query() was interrupted (MIN: on any rank).
    stop = -1 if interrupted else 0
    try:
        reduced = _all_reduce_min([*header, *(-h for h in header), *first, stop], group, device)
    except Exception:
        if interrupted:  # the interrupt, with the collective's error as its context
            raise interrupted[0]  # noqa: B904
        raise
    collectives = 1
    nh = len(header)
    low, high = reduced[:nh], [-v for v in reduced[nh : 2 * nh]]
    if interrupted:
        raise interrupted[0]  # every other rank raises AgreementError below
    if low != high:
        raise AgreementError(_disagreement(ledgers, low, high))
    if reduced[-1]:
        raise AgreementError(
            "agree(): a fence's query() was interrupted (KeyboardInterrupt or "
            "SystemExit) on another rank, which raised it; nothing was changed "
            "on any rank"
        )
    agreed = reduced[2 * nh : 2 * nh + 3 * min(total, WIDTH)]
    if total > WIDTH:
        agreed.extend(_all_reduce_min(flags[3 * WIDTH :], group, device, reuse=False))
        collectives = 2
    _flip(agreed)  # back: overdue and faulted are their MAX over ranks
    released: list[int] = []
    quarantined = 0
    newly = 0
    offset = 0
    # One warning per fence (past OVERDUE_NAMED of them, one for the rest),
    # naming what it holds in every ledger; oldest first.
    overdue: dict[int, tuple[Fence, dict[str, int]]] = {}
    since: dict[int, float] = {}
    for led, batches, mark in zip(ledgers, views, marks, strict=True):
        k = len(batches)
        before = led.quarantined
        n, new = led.apply_agreement(batches, agreed[3 * offset : 3 * (offset + k)], cache, mark)
        offset += k
        released.append(n)
        quarantined += led.quarantined - before
        newly += len(new)
        for batch in new:
            key = id(batch.fence)
            held = overdue.setdefault(key, (batch.fence, {}))[1]
            held[led.unit] = held.get(led.unit, 0) + batch.n
            since[key] = min(since.get(key, batch.t0), batch.t0)
    # Overdue is agreed (MAX over ranks): a rank without a timeout logs a
    # fence that another rank's timeout made overdue.
    when = (
        "past another rank's fence timeout (none here)"
        if overdue_after is None
        else f"{overdue_after:.3g} s after the free"
    )
    if overdue:
        log_overdue(
            pool_log(logger, pool_name),
            oldest_first(overdue, since),
            "fence %r is overdue: not done on at least one rank %s; "
            "held on every rank: %s (its work may still write or read it); "
            "force_release(fence) on every rank only if that work is known to be dead",
            when,
        )
    return Agreement(
        released=tuple(released),
        quarantined=quarantined,
        newly_overdue=newly,
        batches=total,
        collectives=collectives,
        seconds=time.perf_counter() - t0,
    )


#: The "ledger kind" of a header slot that holds KV groups: this, plus 8
#: times a CRC-32 of the group names (with their count, below 8).
_GROUPS_KIND = 8


def _groups_slot(
    names: Sequence[str], ledgers: Sequence[Deferrals[Any]], views: Sequence[list[Deferred[Any]]]
) -> tuple[int, ...]:
    """The second header slot for KV groups: a kind that names the groups
    (how many, their names in order), summed counts, and a CRC-32 over
    every group's batches and counts in group order."""
    kind = _GROUPS_KIND + len(names) + 8 * zlib.crc32("\0".join(names).encode())
    crc = 0
    for led, batches in zip(ledgers, views, strict=True):
        part = (
            _digest(batches),
            len(batches),
            led.deferral_counter,
            led.pending,
            _free_count(led),
            led.quarantined,
        )
        crc = zlib.crc32(array.array("q", part).tobytes(), crc)
    return (
        kind,
        sum(len(b) for b in views),
        sum(led.deferral_counter for led in ledgers),
        sum(led.pending for led in ledgers),
        sum(_free_count(led) for led in ledgers),
        crc,
        sum(led.quarantined for led in ledgers),
    )


def _kind_words(kind: int) -> str:
    if kind >= _GROUPS_KIND:
        return f"{(kind - _GROUPS_KIND) % 8} KV groups (names crc {kind // 8})"
    return _KIND_WORDS.get(kind, "?")


def _flip(flags: list[int]) -> None:
    """Negate, in place, the overdue and faulted flag of every ``[done,
    overdue, faulted]`` triple (its own inverse)."""
    for i in range(1, len(flags), 3):
        flags[i] = -flags[i]
        flags[i + 1] = -flags[i + 1]


def _disagreement(ledgers: Sequence[Deferrals[Any]], low: list[int], high: list[int]) -> str:
    parts = []
    width = len(_HEADER)
    for i in range(SLOTS):
        if low[width * i] != high[width * i]:
            parts.append(
                f"ledger {i + 1} holds {_kind_words(low[width * i])} on one rank "
                f"and {_kind_words(high[width * i])} on another"
            )
            continue
        unit = ledgers[i].unit if i < len(ledgers) else f"ledger {i + 1}"
        for j, name in enumerate(_HEADER[1:], start=1):
            k = width * i + j
            if low[k] != high[k]:
                parts.append(f"{unit} {name} {low[k]}..{high[k]}")
    return (
        "agree(): the ranks' pools disagree before agreement ("
        + ", ".join(parts)
        + "): the ranks did not make the same pool calls in the same order, or their "
        "pools were built otherwise (sizes, kv= on some ranks only), so their "
        "decisions have already diverged; nothing was changed"
    )
