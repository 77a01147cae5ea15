"""Fences that hold memory too long: counted, logged once, never released.

A fence that never completes (a stuck KV transfer, a hung stream) must
neither free its memory (its work may still write or read it) nor hang a pool
silently. Past ``fence_timeout`` seconds since it started holding ids, a
pending fence is *overdue*: :class:`OverdueFences` logs it once, at WARNING,
naming the fence and what it holds in each ledger, and counts it for
``stats()``. The memory stays held; releasing it is an operator's explicit
call (``force_release``, which takes one fence or a list of them), and
:meth:`OverdueFences.fences` lists the overdue fences to act on.

A fence logged overdue that later completes (or faults) is logged once
more, at INFO, when the pool's next reclaim that releases memory (or its
next check) finds it holds nothing (:meth:`OverdueFences.settled`).

A check that finds many newly overdue fences at once (hundreds of transfers
whose peer died) does not log a line each: the first
:data:`OVERDUE_NAMED` are named at WARNING, one more WARNING sums the rest
(how many, what they hold) and points to the list, and the rest are named
at DEBUG with a running count (:func:`log_overdue`; ``agree()`` logs what
the ranks agreed overdue the same way). One overdue fence logs one line,
as it always did.

Knows the ledgers' pending batches (:class:`~asyncpool.deferral.Deferrals`)
and a clock; knows nothing of asyncio (the owning pool arms the timer that
calls :meth:`OverdueFences.check`) or of what the ids are.
"""

from __future__ import annotations

import logging
import numbers
import operator
import time
from collections.abc import Callable, Sequence
from typing import Any

from .deferral import Deferrals, held_fence, held_words, remember_fence, remembers_fence
from .fences import Fence
from .naming import Log, pool_log

__all__ = ["OVERDUE_NAMED", "OverdueFences", "check_fence_timeout", "log_overdue", "oldest_first"]

logger: logging.Logger = logging.getLogger(__name__)

_t0_of = operator.attrgetter("t0")


def oldest_first(
    overdue: dict[int, tuple[Fence, dict[str, int]]], since: dict[int, float]
) -> list[tuple[Fence, dict[str, int]]]:
    """``overdue``'s entries (by ``id(fence)``: the fence and what it holds
    per unit), oldest first: by ``since[id(fence)]``, when the oldest batch
    late behind it was deferred (ties in the dict's order)."""
    return [entry for _, entry in sorted(overdue.items(), key=lambda item: since[item[0]])]


#: How many newly overdue fences one check names at WARNING; past that, one
#: more WARNING sums the rest and they are named at DEBUG.
OVERDUE_NAMED = 3


def log_overdue(
    log: Log,
    found: Sequence[tuple[Fence, dict[str, int]]],
    fmt: str,
    arg: object,
    *,
    where: str = "overdue_fences()",
) -> None:
    """Log the fences one check found newly overdue (oldest first), with
    what each holds per unit: the first :data:`OVERDUE_NAMED` at WARNING as
    ``fmt % (fence, arg, what it holds)``; if there are more, one WARNING
    that sums them (how many, what they hold together, that ``where``
    lists them all), then each of them at DEBUG with a running count (not
    formatted at all while DEBUG is off). ``log``: the pool's logger, through
    :func:`~asyncpool.naming.pool_log`; the records name the caller's
    function, as if it had logged them itself."""
    for fence, held in found[:OVERDUE_NAMED]:
        log.warning(fmt, fence, arg, held_words(held), stacklevel=2)
    rest = found[OVERDUE_NAMED:]
    if not rest:
        return
    total: dict[str, int] = {}
    for _, held in rest:
        for unit, n in held.items():
            total[unit] = total.get(unit, 0) + n
    log.warning(
        "and %d more fences are overdue in this check, holding %s (the memory stays "
        "held); they are logged at DEBUG; %s lists every overdue fence, and "
        "force_release takes a list of fences",
        len(rest),
        held_words(total),
        where,
        stacklevel=2,
    )
    if log.isEnabledFor(logging.DEBUG):
        for i, (fence, held) in enumerate(rest, OVERDUE_NAMED + 1):
            log.debug(
                "fence %r is overdue (%d of %d in this check), holding %s",
                fence,
                i,
                len(found),
                held_words(held),
                stacklevel=2,
            )


def check_fence_timeout(timeout: object, name: str = "fence_timeout") -> float | None:
    """``timeout`` (a real number: an int, a float, a numpy integer or float;
    not a bool) as a positive finite float, or None; ValueError (naming the
    parameter ``name``) otherwise."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):  # numpy's are
        value = 0.0
    else:
        try:
            value = float(timeout)
        except OverflowError:  # an int or Fraction past the float range: not finite
            value = float("inf")
    if not 0 < value < float("inf"):  # False for NaN
        raise ValueError(f"{name} must be None or a finite number > 0, got {timeout!r}")
    return value


class OverdueFences:
    """Overdue pending fences across ledgers; see the module docstring.

    A fence is overdue once a batch of ids has waited for it (as the fence
    it waits for now) longer than ``timeout``; it then counts with
    everything it holds in every ledger.

    ``ledgers`` are the ledgers to watch (each with a ``unit``: "rows",
    "pages"); their clock must be ``clock``. ``pool_name``: the owning
    pool's name, which starts every warning logged (None: the lines as
    they always were).
    """

    def __init__(
        self,
        timeout: float,
        ledgers: Sequence[Deferrals[Any]],
        clock: Callable[[], float] = time.perf_counter,
        *,
        pool_name: str | None = None,
    ) -> None:
        self.timeout: float = timeout
        self._log = pool_log(logger, pool_name)
        self._ledgers = list(ledgers)
        self._clock = clock
        # Fences already reported, by id: a weak reference where the fence
        # takes one, else the fence itself (so that its id is not reused
        # while it is in here). Weakly, as the ledgers remember faulted
        # fences: an overdue transfer that completes later may own a large
        # buffer, and the next check that prunes this may be far off (it is
        # armed only when memory goes pending again).
        self._logged: dict[int, Any] = {}
        #: The owner's pending check (an ``asyncio.TimerHandle``), if armed.
        self.timer: Any = None
        #: How many newly overdue fences the last :meth:`check` logged (the
        #: owner checks again no sooner than a pause later when it logged
        #: any: fences turning overdue one after another are then logged
        #: together, :data:`OVERDUE_NAMED` of them by name, not a few a check).
        self.logged: int = 0

    def scan(
        self, *, agreed: bool = False
    ) -> tuple[dict[int, tuple[Fence, dict[str, int]]], float | None]:
        """Overdue fences now, with everything each holds per unit; and the
        seconds until the next pending fence becomes overdue (None: none
        pending that is not overdue yet). O(pending batches), at C speed
        (one ``min`` per queue) while none is overdue.

        ``agreed`` (``reclaim="explicit"``): overdue means ``agree()`` agreed
        so, every rank alike (not done on some rank past the timeout: the
        ledgers' ``agreed_overdue``), not this process's clock.
        """
        overdue, due, _ = self._scan(agreed)
        return overdue, due

    def _scan(
        self, agreed: bool
    ) -> tuple[dict[int, tuple[Fence, dict[str, int]]], float | None, dict[int, float]]:
        # scan(), and when each overdue fence's oldest late batch was
        # deferred (by id(fence)): the order fences() and check() report in.
        now = self._clock()
        cutoff = now - self.timeout
        groups = [(led, g) for led in self._ledgers if led.pending for g in led.batch_groups()]
        # First the late batches, with one C-speed pass per queue for its
        # oldest batch: usually none is late, and nothing more is read.
        overdue: dict[int, tuple[Fence, dict[str, int]]] = {}
        since: dict[int, float] = {}
        oldest: list[float] = []
        for led, group in groups:
            first = min(map(_t0_of, group))
            oldest.append(first)
            if agreed:
                marked = led.agreed_overdue
                late = [b for b in group if b.did in marked] if marked else []
            else:
                late = [b for b in group if b.t0 <= cutoff] if first <= cutoff else []
            for batch in late:  # the fence it waits for now is overdue
                key = id(batch.fence)
                overdue.setdefault(key, (batch.fence, {}))
                t0 = since.get(key)
                if t0 is None or batch.t0 < t0:
                    since[key] = batch.t0
        if not overdue:
            next_t0 = min(oldest) if oldest else None
        else:
            next_t0 = None
            for led, group in groups:
                for batch in group:
                    entry = overdue.get(id(batch.fence))
                    if entry is not None:  # all it holds, in every ledger
                        entry[1][led.unit] = entry[1].get(led.unit, 0) + batch.n
                    elif next_t0 is None or batch.t0 < next_t0:
                        next_t0 = batch.t0
        due = None if next_t0 is None else max(0.0, next_t0 + self.timeout - now)
        return overdue, due, since

    def counts(self, *, agreed: bool = False) -> tuple[int, dict[str, int]]:
        """(overdue fences, the ids they hold per unit); ``agreed`` as in :meth:`scan`."""
        overdue, _ = self.scan(agreed=agreed)
        held: dict[str, int] = {}
        for _, per_unit in overdue.values():
            for unit, n in per_unit.items():
                held[unit] = held.get(unit, 0) + n
        return len(overdue), held

    def held_in(self, ledger: Deferrals[Any], *, agreed: bool = False) -> int:
        """How many of ``ledger``'s ids wait behind overdue fences now (a
        batch counts when the fence it waits for now is overdue, as in
        :meth:`scan`, which decides across every ledger); ``agreed`` as
        there. O(pending batches), as :meth:`scan`."""
        overdue, _ = self.scan(agreed=agreed)
        if not overdue:
            return 0
        return sum(
            batch.n
            for group in ledger.batch_groups()
            for batch in group
            if id(batch.fence) in overdue
        )

    def fences(self, *, agreed: bool = False) -> list[Fence]:
        """The overdue fences now, oldest first (by when the oldest batch
        late behind each was deferred; ties in scan order); ``agreed`` as in
        :meth:`scan`. A new list; O(pending batches), as :meth:`scan`."""
        overdue, _, since = self._scan(agreed)
        return [fence for fence, _ in oldest_first(overdue, since)]

    def check(self) -> float | None:
        """Log each newly overdue fence once (oldest first; past
        :data:`OVERDUE_NAMED` of them, as :func:`log_overdue` says); return
        when to check again."""
        self.settled()  # reported fences that hold nothing now: say so, forget them
        overdue, due, since = self._scan(False)
        for key in [k for k in self._logged if k not in overdue]:
            del self._logged[key]  # pending, no longer overdue (moved to a later fence)
        found: list[tuple[Fence, dict[str, int]]] = []
        for fence, held in oldest_first(overdue, since):
            if remembers_fence(self._logged, fence):
                continue
            remember_fence(self._logged, fence)
            found.append((fence, held))
        self.logged = len(found)
        if found:
            log_overdue(
                self._log,
                found,
                "fence %r is overdue: pending for more than %.3g s (fence_timeout), holding "
                "%s; the memory stays held (its work may still write or read it); call "
                "force_release(fence) only if that work is known to be dead",
                self.timeout,
            )
        return due

    @property
    def reported(self) -> bool:
        """Whether a fence logged overdue is still remembered (see :meth:`settled`)."""
        return bool(self._logged)

    def settled(self) -> None:
        """Log, at INFO, each fence logged overdue that holds nothing now,
        and forget it: it completed (what it held is back in circulation)
        or faulted (quarantined; the ledger logged the fault). Without this
        an operator told a fence is overdue heard nothing when it landed
        late. A fence ``force_release`` let go of is forgotten there, not
        logged here. O(pending batches) while a reported fence is
        remembered: the owner calls it after a reclaim that released
        something (a fault releases nothing: the next such reclaim, or the
        next :meth:`check`, says it), and :meth:`check` calls it first."""
        if not self._logged:
            return
        pending = {id(f) for led in self._ledgers if led.pending for f in led.pending_fences()}
        for key in [k for k in self._logged if k not in pending]:
            fence = held_fence(self._logged.pop(key))
            if fence is None:
                continue  # collected: it held nothing (a pending batch keeps its fence)
            if any(led.remembers_fault(fence) for led in self._ledgers):
                self._log.info(
                    "fence %r, logged overdue, holds nothing now: it faulted (what it held "
                    "is quarantined; see the fault logged)",
                    fence,
                )
            else:
                self._log.info(
                    "fence %r, logged overdue, completed: what it held is back in circulation",
                    fence,
                )

    def forget(self, fence: Fence) -> None:
        """Forget that ``fence`` was logged (``force_release``: should it
        hold memory again later and turn overdue, it is logged again)."""
        self._logged.pop(id(fence), None)
