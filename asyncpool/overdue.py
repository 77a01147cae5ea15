"""Fences that hold memory too long: counted, logged once, never released.

A fence that never completes (a stuck KV transfer, a hung stream) must
neither free its memory (a late write may still land) nor hang a pool
silently. Past ``fence_timeout`` seconds since it started holding ids, a
pending fence is *overdue*: :class:`OverdueFences` logs it once, at WARNING,
naming the fence and what it holds in each ledger, and counts it for
``stats()``. The memory stays held; releasing it is an operator's explicit
call (``force_release``).

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

from .deferral import Deferrals, held_words, remember_fence, remembers_fence
from .fences import Fence
from .naming import pool_log

__all__ = ["OverdueFences", "check_fence_timeout"]

logger = logging.getLogger(__name__)

_t0_of = operator.attrgetter("t0")


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
        self.timeout = timeout
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
        now = self._clock()
        cutoff = now - self.timeout
        groups = [(led, g) for led in self._ledgers if led.pending for g in led.batch_groups()]
        # First the late batches, with one C-speed pass per queue for its
        # oldest batch: usually none is late, and nothing more is read.
        overdue: dict[int, tuple[Fence, dict[str, int]]] = {}
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
                overdue.setdefault(id(batch.fence), (batch.fence, {}))
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
        return overdue, due

    def counts(self, *, agreed: bool = False) -> tuple[int, dict[str, int]]:
        """(overdue fences, the ids they hold per unit); ``agreed`` as in :meth:`scan`."""
        overdue, _ = self.scan(agreed=agreed)
        held: dict[str, int] = {}
        for _, per_unit in overdue.values():
            for unit, n in per_unit.items():
                held[unit] = held.get(unit, 0) + n
        return len(overdue), held

    def check(self) -> float | None:
        """Log each newly overdue fence once; return when to check again."""
        overdue, due = self.scan()
        for key in [k for k in self._logged if k not in overdue]:
            del self._logged[key]  # no longer pending: forget it
        for fence, held in overdue.values():
            if remembers_fence(self._logged, fence):
                continue
            remember_fence(self._logged, fence)
            what = held_words(held)
            self._log.warning(
                "fence %r is overdue: pending for more than %.3g s (fence_timeout), holding "
                "%s; the memory stays held (a late write may still land); call "
                "force_release(fence) only if its writer is known to be dead",
                fence,
                self.timeout,
                what,
            )
        return due

    def forget(self, fence: Fence) -> None:
        self._logged.pop(id(fence), None)
