"""An optional Prometheus collector for pools' statistics.

Needs the ``metrics`` extra (``prometheus-client``)::

    from prometheus_client import REGISTRY
    from asyncpool.metrics import PoolCollector

    collector = PoolCollector(decode_pool, name="decode")
    collector.add(prefill_pool, name="prefill")  # more pools: the same collector
    REGISTRY.register(collector)

One collector exports every pool of a process, each labelled
``pool="<name>"``: a metric family may come from one collector only (two
collectors emitting ``asyncpool_free_rows`` would give the scrape two
``# TYPE`` blocks for one name). :meth:`PoolCollector.describe` names every
family, so ``prometheus_client`` refuses a second collector with the same
names (``ValueError``), and :meth:`PoolCollector.add` refuses a pool name it
already has.

Names follow Prometheus' rules and the serving engines' conventions (vLLM's
``vllm:num_requests_waiting`` and ``vllm:request_queue_time_seconds``,
SGLang's ``sglang:num_queue_reqs``): base units in the name (``_seconds``,
``_rows``), ``_total`` on counters, calls and rows counted apart. The
table :data:`FAMILIES` lists them all (docs/api.md, *Metrics*, has the same table).

A pool with KV groups (``kv={"swa": ..., "full": ...}``) is exported as any
other (its page families carry the sums over its groups) and, in the
families of :data:`GROUP_FAMILIES` (``<prefix>_kv_group_...``), each group's
own figures, labelled ``group="<name>"`` too: which group runs short. The
summed families carry no ``group`` label (a sum over it would count every
page twice), and the per-group families are exported only while some pool
has groups (nothing new for a pool with one ``kv=`` or none: its page
families are its one page pool's figures).

Likewise each priority's own figures (``stats().by_priority``), in the
families of :data:`PRIORITY_FAMILIES` (``<prefix>_priority_...``), labelled
``priority="<int>"`` too (``"other"`` for every priority past
:data:`~asyncpool.stats.MAX_PRIORITIES`, together: the label's values are
bounded however many priorities callers use): whether tier 3 waits seconds
while tier 0 waits microseconds, and which tier takes the timeouts and the
shed load. New families, so the pool-wide ones keep their series (a
``priority`` label added to ``alloc_wait_seconds`` would have changed them);
exported for every pool that queues (an ``AsyncReqToTokenPool``), with no
samples until its calls queue.

Thread rules: a scrape runs on the HTTP server's thread. It calls
``pool.stats(summaries=False)``, which only reads ints and copies histogram
counts: it never mutates the pool, and costs microseconds whatever the
sample windows hold. Its figures may be a few operations apart from one
another (each histogram is consistent in itself: its ``+Inf`` bucket equals
its ``_count``). :meth:`PoolCollector.add`, :meth:`~PoolCollector.remove` and
:meth:`~PoolCollector.collect` may run on any threads at once: a lock
guards the collector's own state, never held across a pool's ``stats()``.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from .kv_pages import KVGroupStats, KVPagePool
from .naming import LOG_FIELD
from .stats import HistogramSnapshot, PoolStats, PriorityStats

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

logger: logging.Logger = logging.getLogger(__name__)

__all__ = [
    "FAMILIES",
    "GROUP_FAMILIES",
    "PRIORITY_FAMILIES",
    "Family",
    "GroupFamily",
    "PoolCollector",
    "PriorityFamily",
]


class _HasStats(Protocol):
    def stats(self, *, summaries: bool = True) -> PoolStats: ...


@dataclass(frozen=True, slots=True)
class Family:
    """One exported metric family: how to name, type, explain and read it.

    ``name`` is the full name after the prefix, without ``_total`` (which
    ``prometheus_client`` appends to counters) and ending in ``unit`` when
    there is one. ``get`` reads the value from a :class:`PoolStats`: a
    number for gauges and counters, a :class:`HistogramSnapshot` for
    histograms.
    """

    name: str
    type: str  # "gauge", "counter" or "histogram"
    unit: str
    help: str
    get: Callable[[PoolStats], Any]


#: Every exported family. Adding a figure is one line here (and a field on
#: :class:`PoolStats`).
FAMILIES: tuple[Family, ...] = (
    # gauges: state right now
    Family(
        "capacity_rows",
        "gauge",
        "rows",
        "Rows that can ever be handed out (size - 1).",
        lambda s: s.capacity,
    ),
    Family(
        "free_rows", "gauge", "rows", "Rows free right now, ready to hand out.", lambda s: s.free
    ),
    Family(
        "allocated_rows", "gauge", "rows", "Rows held by requests right now.", lambda s: s.allocated
    ),
    Family(
        "pending_rows",
        "gauge",
        "rows",
        "Rows freed but waiting for their fences to complete.",
        lambda s: s.pending,
    ),
    Family(
        "quarantined_rows",
        "gauge",
        "rows",
        "Rows kept out of circulation because their fence faulted.",
        lambda s: s.quarantined,
    ),
    Family(
        "peak_allocated_rows",
        "gauge",
        "rows",
        "Most rows held by requests at once.",
        lambda s: s.peak_allocated,
    ),
    Family(
        "waiting_requests",
        "gauge",
        "",
        "alloc() and admit() calls queued right now.",
        lambda s: s.waiters,
    ),
    Family(
        "queue_oldest_wait_seconds",
        "gauge",
        "seconds",
        "How long the longest-queued alloc() or admit() call still waiting has waited "
        "so far (0 when none waits): a stall in progress, which the wait histograms "
        "see only once it ends.",
        lambda s: s.oldest_wait_s,
    ),
    Family(
        "capacity_pages",
        "gauge",
        "pages",
        "KV pages the pool's KVPagePool can hand out (0 without kv=).",
        lambda s: s.pages_capacity,
    ),
    Family("free_pages", "gauge", "pages", "KV pages free right now.", lambda s: s.pages_free),
    Family(
        "allocated_pages",
        "gauge",
        "pages",
        "KV pages held right now, by rows or by callers that detached them.",
        lambda s: s.pages_allocated,
    ),
    Family(
        "pending_pages",
        "gauge",
        "pages",
        "KV pages freed but waiting for their fences to complete.",
        lambda s: s.pages_pending,
    ),
    Family(
        "quarantined_pages",
        "gauge",
        "pages",
        "KV pages kept out of circulation because their fence faulted.",
        lambda s: s.pages_quarantined,
    ),
    Family(
        "overdue_fences",
        "gauge",
        "",
        "Pending fences older than fence_timeout right now (their memory stays held).",
        lambda s: s.overdue_fences,
    ),
    Family(
        "overdue_rows",
        "gauge",
        "rows",
        "Rows held by overdue fences right now.",
        lambda s: s.overdue_rows,
    ),
    Family(
        "overdue_pages",
        "gauge",
        "pages",
        "KV pages held by overdue fences right now.",
        lambda s: s.overdue_pages,
    ),
    Family("closed", "gauge", "", "1 once the pool is closed, else 0.", lambda s: s.closed),
    Family(
        "released",
        "gauge",
        "",
        "1 while the pool's memory region is released, else 0.",
        lambda s: s.released,
    ),
    Family(
        "grants_held",
        "gauge",
        "",
        "1 while a hold_grants() hold keeps the queued waiters from grants, else 0.",
        lambda s: s.grants_held,
    ),
    Family(
        "grant_holds",
        "gauge",
        "",
        "hold_grants() holds held now (they nest; 0 when none).",
        lambda s: s.grant_holds,
    ),
    # counters: lifetime totals
    Family(
        "alloc_calls",
        "counter",
        "",
        "Allocation calls granted rows (alloc, successful try_alloc).",
        lambda s: s.alloc_calls,
    ),
    Family(
        "admit_calls",
        "counter",
        "",
        "admit() calls granted a row and its KV pages (admit, successful try_admit).",
        lambda s: s.admits,
    ),
    Family(
        "growth_refusals",
        "counter",
        "",
        "extend() and extend_rows() calls answered None, and extend_fitting() calls "
        "that grew fewer rows than given, short of pages: each a shortage the "
        "scheduler had to answer (for KV, a retraction).",
        lambda s: s.growth_refusals,
    ),
    Family(
        "rows_allocated",
        "counter",
        "",
        "Rows handed out (also those a waiter cancelled after its grant gave back).",
        lambda s: s.rows_granted,
    ),
    Family(
        "rows_freed",
        "counter",
        "",
        "Rows that left the allocated state: freed, or given back by a cancelled waiter.",
        lambda s: s.rows_granted - s.allocated,
    ),
    Family(
        "rows_deferred",
        "counter",
        "",
        "Freed rows that had to wait for a fence.",
        lambda s: s.deferred_frees,
    ),
    Family(
        "rows_reclaimed",
        "counter",
        "",
        "Rows returned to circulation by completed fences.",
        lambda s: s.reclaimed,
    ),
    Family(
        "rows_force_released",
        "counter",
        "",
        "Rows force_release() returned to circulation without their fence completing.",
        lambda s: s.force_released,
    ),
    Family(
        "pages_force_released",
        "counter",
        "",
        "KV pages force_release() returned to circulation without their fence completing.",
        lambda s: s.pages_force_released,
    ),
    Family(
        "alloc_timeouts",
        "counter",
        "",
        "alloc() and admit() calls that raised TimeoutError (their own "
        "timeout= fired while queued).",
        lambda s: s.timeouts,
    ),
    Family(
        "alloc_cancellations",
        "counter",
        "",
        "alloc() and admit() calls cancelled while queued (or granted, before resuming).",
        lambda s: s.cancellations,
    ),
    Family(
        "alloc_rejections",
        "counter",
        "",
        "alloc() and admit() calls refused because max_waiters calls already queued.",
        lambda s: s.rejections,
    ),
    Family(
        "alloc_unfittable",
        "counter",
        "",
        "alloc() and admit() calls refused with CapacityError because they can never "
        "be served: more rows or pages than the pool has, or than quarantine leaves it.",
        lambda s: s.unfittable,
    ),
    Family(
        "fence_errors",
        "counter",
        "",
        "Fences that faulted (their rows are quarantined).",
        lambda s: s.fence_errors,
    ),
    Family(
        "page_fence_errors",
        "counter",
        "",
        "Fences that faulted holding KV pages (their pages are quarantined).",
        lambda s: s.page_fence_errors,
    ),
    Family(
        "row_resets",
        "counter",
        "",
        "Bulk resets of freed rows' table entries (one vectorised op each).",
        lambda s: s.resets,
    ),
    # histograms: every event over the pool's life
    Family(
        "alloc_wait_seconds",
        "histogram",
        "seconds",
        "Wait of each granted allocation, from the call to its grant "
        "(0 when granted without queueing). Timed-out, rejected and "
        "cancelled-while-queued calls are not observed: see their counters.",
        lambda s: s.wait_histogram,
    ),
    Family(
        "admit_wait_seconds",
        "histogram",
        "seconds",
        "Wait of each granted admission (a row and its KV pages), from the call "
        "to its grant (0 when granted without queueing).",
        lambda s: s.admit_wait_histogram,
    ),
    Family(
        "fence_latency_seconds",
        "histogram",
        "seconds",
        "Latency of each completed fence batch, from the deferred free to the "
        "reclaim that saw the fence complete.",
        lambda s: s.fence_latency_histogram,
    ),
)


@dataclass(frozen=True, slots=True)
class GroupFamily:
    """One exported per-KV-group family, labelled ``pool`` and ``group``.

    As :class:`Family` (gauges and counters only), but ``get`` reads one
    group's :class:`~asyncpool.KVGroupStats` (a pool's
    ``stats().kv_groups[name]``). With ``label`` set, the family carries
    that label too and ``get`` gives ``(label value, number)`` pairs, one
    sample each (``state="free"`` and so on: they add up to the group's
    capacity); without it, one number.
    """

    name: str
    type: str  # "gauge" or "counter"
    unit: str
    help: str
    get: Callable[[KVGroupStats], Any]
    label: str | None = None


#: Every per-KV-group family: exported only for pools with KV groups.
GROUP_FAMILIES: tuple[GroupFamily, ...] = (
    GroupFamily(
        "kv_group_capacity_pages",
        "gauge",
        "pages",
        "KV pages the group's KVPagePool can hand out (num_pages - 1).",
        lambda g: g.capacity,
    ),
    GroupFamily(
        "kv_group_pages",
        "gauge",
        "pages",
        "The group's KV pages by state right now (free: ready to hand out; allocated: held "
        "by rows or by callers that detached them; pending: freed, waiting for their "
        "fences; quarantined: out of circulation after a fence faulted); they add up to "
        "the group's capacity.",
        lambda g: (
            ("free", g.free),
            ("allocated", g.allocated),
            ("pending", g.pending),
            ("quarantined", g.quarantined),
        ),
        label="state",
    ),
    GroupFamily(
        "kv_group_peak_allocated_pages",
        "gauge",
        "pages",
        "Most of the group's KV pages held at once.",
        lambda g: g.peak_allocated,
    ),
    GroupFamily(
        "kv_group_growth_refusals",
        "counter",
        "",
        "extend() and extend_rows() calls answered None, and extend_fitting() calls that "
        "grew fewer rows than given, in which the group was short of pages (a call short "
        "in several groups counts in each).",
        lambda g: g.growth_refusals,
    ),
    GroupFamily(
        "kv_group_fence_errors",
        "counter",
        "",
        "Fences that faulted holding the group's KV pages (their pages are quarantined).",
        lambda g: g.fence_errors,
    ),
)


@dataclass(frozen=True, slots=True)
class PriorityFamily:
    """One exported per-priority family, labelled ``pool`` and ``priority``.

    As :class:`Family` (counters and histograms), but ``get`` reads one
    priority's :class:`~asyncpool.PriorityStats` (a pool's
    ``stats().by_priority[p]``, or its ``other_priorities``).
    """

    name: str
    type: str  # "counter" or "histogram"
    unit: str
    help: str
    get: Callable[[PriorityStats], Any]


#: Every per-priority family: exported only while some pool's calls queued
#: (its ``by_priority``).
PRIORITY_FAMILIES: tuple[PriorityFamily, ...] = (
    PriorityFamily(
        "priority_timeouts",
        "counter",
        "",
        "alloc() and admit() calls at the priority that raised TimeoutError (their own "
        "timeout= fired while queued).",
        lambda p: p.timeouts,
    ),
    PriorityFamily(
        "priority_cancellations",
        "counter",
        "",
        "alloc() and admit() calls at the priority cancelled while queued (or granted, "
        "before resuming).",
        lambda p: p.cancellations,
    ),
    PriorityFamily(
        "priority_rejections",
        "counter",
        "",
        "alloc() and admit() calls at the priority refused because max_waiters calls "
        "already queued (load shed).",
        lambda p: p.rejections,
    ),
    PriorityFamily(
        "priority_unfittable",
        "counter",
        "",
        "alloc() and admit() calls at the priority refused with CapacityError because "
        "they can never be served: more rows or pages than the pool has, or than "
        "quarantine leaves it.",
        lambda p: p.unfittable,
    ),
    PriorityFamily(
        "priority_alloc_queue_wait_seconds",
        "histogram",
        "seconds",
        "Wait of each allocation at the priority that queued, from its queueing to its "
        "grant (calls granted without queueing are not observed here).",
        lambda p: p.wait_histogram,
    ),
    PriorityFamily(
        "priority_admit_queue_wait_seconds",
        "histogram",
        "seconds",
        "Wait of each admission at the priority that queued, from its queueing to its "
        "grant (calls granted without queueing are not observed here).",
        lambda p: p.admit_wait_histogram,
    ),
)


def _priorities(stats: PoolStats) -> list[tuple[str, PriorityStats]]:
    """A snapshot's priorities as (label value, figures), most urgent first,
    ``"other"`` last when some priority is past the cap."""
    out = [(str(prio), one) for prio, one in stats.by_priority.items()]
    if stats.other_priorities is not None:
        out.append(("other", stats.other_priorities))
    return out


_cumsum = itertools.accumulate


@functools.lru_cache(maxsize=16)
def _le_labels(bounds: tuple[float, ...]) -> tuple[str, ...]:
    """The ``le`` label values of ``bounds`` plus ``+Inf``, formatted once."""
    from prometheus_client.utils import floatToGoString

    fmt: Callable[[float], str] = floatToGoString  # untyped upstream
    return (*(fmt(b) for b in bounds), "+Inf")


class PoolCollector:
    """A ``prometheus_client`` custom collector for one or more pools.

    ``PoolCollector(pool, name="decode")`` exports ``pool`` with the label
    ``pool="decode"`` (``pool`` may be None: an empty collector); :meth:`add`
    adds more pools. Without ``name`` (or with None) the label is the pool's
    own name (``AsyncReqToTokenPool(..., name="decode")``), and
    ``"default"`` for a pool without one, as before pools had names. ``prefix``
    (default ``"asyncpool"``) starts every family's name:
    ``<prefix>_free_rows`` and so on. Register it once per
    registry: its :meth:`describe` names every family, so a second
    collector in the same registry raises ``ValueError`` at ``register``.

    :meth:`add`, :meth:`remove` and :meth:`collect` may run on any thread,
    at once (two adds of one name: one of them raises), also while a scrape
    runs (it exports the pools it found when it started). A lock guards
    the pools and the counters' last values, held for a dict operation at
    a time: never across a pool's ``stats()``, nor while a scrape builds
    its families (it takes it per counter sample, for the read and write
    of that counter's last value). It is reentrant: a scrape let go of in
    a reference cycle is closed by the cyclic GC, which may run on a thread
    inside it, and its clean-up takes it too.
    """

    def __init__(
        self,
        pool: _HasStats | None = None,
        name: str | None = None,
        prefix: str = "asyncpool",
    ) -> None:
        self._prefix = prefix
        # name -> (pool, token): the token is fresh at each add(), so a pool
        # added again under a name never inherits its predecessor's counters.
        self._pools: dict[str, tuple[_HasStats, object]] = {}
        # Last value exported per (counter, pool token), ((counter, group),
        # pool token) for a KV group's: a scrape on another
        # thread reads figures a few operations apart, and a counter must
        # never be seen to go down (Prometheus would take it for a restart).
        # Keyed by token, not name: a scrape that began before remove(name)
        # may still write its entries after remove() dropped them.
        self._last: dict[tuple[object, object], float] = {}
        # Guards _pools (check then insert, pop) and _last (read, compare,
        # write): taken for one such step at a time, never across a call
        # into a pool. Reentrant: the cyclic GC may run at any allocation
        # made under it and close a scrape let go of in a reference cycle,
        # whose finally takes it again on this thread (a plain Lock
        # deadlocked there, and every later scrape, add and remove behind
        # it). Each step under it leaves _pools and _last whole before it
        # allocates, so such a nested step finds them consistent.
        self._lock = threading.RLock()
        if pool is not None:
            self.add(pool, name)

    def add(self, pool: _HasStats, name: str | None = None) -> None:
        """Export ``pool`` too, labelled ``pool=name``.

        ``name`` None (or left out): the pool's own name (its ``name``
        attribute, when that is a ``str``), else ``"default"``. Raises
        ``ValueError`` if ``name`` is taken (two pools with one label would
        make an invalid scrape) or ``pool`` is exported already, under any
        name (its figures would count twice in every sum over pools),
        ``TypeError`` for a non-str name and for a ``pool`` with no
        ``stats()`` or a ``KVPagePool`` (its stats are another kind; one bad
        pool would fail every later scrape, for every pool): export a
        ``ReqToTokenPool`` or an ``AsyncReqToTokenPool``, whose stats carry
        the pages of its ``kv=``. Adds nothing on error.
        """
        given = name is not None
        if name is None:
            own = getattr(pool, "name", None)
            name = own if isinstance(own, str) else "default"
        if not isinstance(name, str):
            raise TypeError(f"a pool name must be a str, got {name!r}")
        if name in self._pools:
            raise ValueError(
                f"this collector already exports a pool named {name!r}"
                + ("" if given else "; name this pool (name=, here or when building it)")
            )
        if isinstance(pool, KVPagePool) or not callable(getattr(pool, "stats", None)):
            raise TypeError(
                f"cannot export {pool!r}: export a ReqToTokenPool or an AsyncReqToTokenPool "
                "(an object whose stats(summaries=False) returns PoolStats); a KVPagePool's "
                "pages are exported by the AsyncReqToTokenPool built with kv="
            )
        with self._lock:
            # The checks again, with the insert: another thread's add() may
            # have taken the name (or the pool) since the check above, which
            # gives the usual error early without the lock.
            if name in self._pools:
                raise ValueError(f"this collector already exports a pool named {name!r}")
            for taken, (exported, _) in self._pools.items():
                if exported is pool:
                    raise ValueError(
                        f"this collector already exports {pool!r} as {taken!r}; a pool is "
                        "exported once (its figures would count twice in a sum over pools)"
                    )
            self._pools[name] = (pool, object())

    def remove(self, name: str) -> None:
        """Stop exporting the pool labelled ``name`` (``KeyError`` if none).

        A pool added later under the same name starts its counters afresh.
        """
        with self._lock:
            _, token = self._pools.pop(name)
            self._forget(token)

    def _forget(self, token: object) -> None:
        """Drop ``token``'s last values; the caller holds the lock."""
        for key in [k for k in self._last if k[1] is token]:
            del self._last[key]

    @property
    def names(self) -> tuple[str, ...]:
        """The pool labels exported, in the order added."""
        with self._lock:
            return tuple(self._pools)

    def _families(self) -> list[Any]:
        return self._new_families(FAMILIES, lambda f: ["pool"])

    def _group_families(self) -> list[Any]:
        return self._new_families(
            GROUP_FAMILIES, lambda f: ["pool", "group"] + ([f.label] if f.label else [])
        )

    def _priority_families(self) -> list[Any]:
        return self._new_families(PRIORITY_FAMILIES, lambda f: ["pool", "priority"])

    def _new_families(
        self,
        specs: Sequence[Family] | Sequence[GroupFamily] | Sequence[PriorityFamily],
        labels: Callable[[Any], list[str]],
    ) -> list[Any]:
        """An empty metric family for each of ``specs``, named with the
        prefix, labelled ``labels(spec)``."""
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        kinds: dict[str, Any] = {
            "gauge": GaugeMetricFamily,
            "counter": CounterMetricFamily,
            "histogram": HistogramMetricFamily,
        }
        return [
            kinds[f.type](f"{self._prefix}_{f.name}", f.help, labels=labels(f), unit=f.unit)
            for f in specs
        ]

    def _never_down(self, key: tuple[object, object], v: float) -> float:
        """A counter's value ``v`` as exported: never below what ``key``
        (the family, and the group for a group family; the pool's token)
        last exported, since a value read lower is read skew, never a real
        decrease; on a first scrape (nothing kept yet), never below 0."""
        with self._lock:  # two scrapes at once: neither writes below the other
            last = self._last
            prev = last.get(key, 0.0)
            if v < prev:
                return prev
            last[key] = v
            return v

    def describe(self) -> list[Metric]:
        """Every family this collector exports now, without samples: those of
        :data:`FAMILIES`, those of :data:`GROUP_FAMILIES` while some
        pool it exports has KV groups (its ``kv_groups``), and those of
        :data:`PRIORITY_FAMILIES` while some is a pool that queues (an
        ``AsyncReqToTokenPool``: its ``waiting_by_priority``)."""
        families = self._families()
        with self._lock:
            pools = [pool for pool, _ in self._pools.values()]
        if any(getattr(pool, "kv_groups", None) for pool in pools):
            families += self._group_families()
        if any(_queues(pool) for pool in pools):
            families += self._priority_families()
        return families

    def collect(self) -> Iterator[Metric]:
        """One snapshot per pool (``stats(summaries=False)``), as families.

        A pool whose ``stats()`` raises or gives no ``PoolStats`` is left
        out of this scrape (a WARNING names it by its label, and carries the
        pool's own name, if it has one, as the record attribute
        ``asyncpool_pool``, as every line a named pool logs); the others are
        exported. The families of :data:`GROUP_FAMILIES` follow when some
        snapshot has KV groups (``stats().kv_groups``), with its groups'
        samples.
        """
        with self._lock:  # a copy: add() and remove() may run meanwhile
            # One allocation, before the copy: no GC (see _lock) in it.
            copied = self._pools.copy()
        pools = list(copied.items())
        snapshots: list[tuple[str, object, PoolStats]] = []
        for name, (pool, token) in pools:
            # One pool that cannot answer must not fail the scrape (an HTTP
            # 500) for every other: it is left out of this one, and said.
            try:
                stats = pool.stats(summaries=False)
            except Exception:
                logger.warning(
                    "pool %r left out of this scrape: stats() raised",
                    name,
                    exc_info=True,
                    extra=_log_extra(pool),
                )
                continue
            if not isinstance(stats, PoolStats):
                logger.warning(
                    "pool %r left out of this scrape: stats() gave %s, not PoolStats",
                    name,
                    type(stats).__name__,
                    extra=_log_extra(pool),
                )
                continue
            snapshots.append((name, token, stats))
        try:
            queueing = {name for name, (pool, _) in pools if _queues(pool)}
            yield from self._collect_snapshots(snapshots, queueing)
        finally:
            # A pool removed while this scrape ran: drop what it wrote since,
            # also when the scrape stops early (its consumer raised, or let
            # go of this generator: it is closed), or each such scrape left
            # a pool's counters behind for good.
            with self._lock:
                current = {token for _, token in self._pools.values()}
                for _, token, _ in snapshots:
                    if token not in current:
                        self._forget(token)

    def _collect_snapshots(
        self, snapshots: list[tuple[str, object, PoolStats]], queueing: set[str]
    ) -> Iterator[Metric]:
        """The families of :meth:`collect` from its snapshots (``queueing``:
        the names of the pools that queue calls)."""
        for fam, family in zip(FAMILIES, self._families(), strict=True):
            get = fam.get
            if fam.type == "histogram":
                for name, _, stats in snapshots:
                    _add_histogram(family, [name], get(stats))
            elif fam.type == "counter":
                for name, token, stats in snapshots:
                    family.add_metric(
                        [name], self._never_down((fam.name, token), float(get(stats)))
                    )
            else:
                for name, _, stats in snapshots:
                    family.add_metric([name], float(get(stats)))
            yield family
        grouped = [(name, token, stats) for name, token, stats in snapshots if stats.kv_groups]
        if grouped:
            yield from self._collect_groups(grouped)
        # The per-priority families come with every pool that queues, with
        # no samples before its calls queued: what describe() names.
        tiered = [s for s in snapshots if s[0] in queueing or s[2].by_priority]
        if tiered:
            yield from self._collect_priorities(tiered)

    def _collect_groups(self, snapshots: list[tuple[str, object, PoolStats]]) -> Iterator[Metric]:
        """The families of :data:`GROUP_FAMILIES`, one sample (or one per
        ``label`` value) per group of each snapshot; counters never go down,
        as in :meth:`collect`."""
        for fam, family in zip(GROUP_FAMILIES, self._group_families(), strict=True):
            get = fam.get
            for name, token, stats in snapshots:
                for group, one in stats.kv_groups.items():
                    if fam.label is not None:
                        for label, v in get(one):
                            family.add_metric([name, group, label], float(v))
                    elif fam.type == "counter":
                        v = self._never_down(((fam.name, group), token), float(get(one)))
                        family.add_metric([name, group], v)
                    else:
                        family.add_metric([name, group], float(get(one)))
            yield family

    def _collect_priorities(
        self, snapshots: list[tuple[str, object, PoolStats]]
    ) -> Iterator[Metric]:
        """The families of :data:`PRIORITY_FAMILIES`, one sample (a
        histogram's series) per priority of each snapshot; counters never
        go down, as in :meth:`collect`."""
        for fam, family in zip(PRIORITY_FAMILIES, self._priority_families(), strict=True):
            get = fam.get
            for name, token, stats in snapshots:
                for label, one in _priorities(stats):
                    if fam.type == "histogram":
                        _add_histogram(family, [name, label], get(one))
                    else:
                        v = self._never_down(((fam.name, label), token), float(get(one)))
                        family.add_metric([name, label], v)
            yield family


def _add_histogram(family: Any, labels: list[str], h: HistogramSnapshot) -> None:
    """One histogram sample of ``family``: ``h``'s cumulative buckets, by
    their ``le`` labels, and its sum."""
    les = _le_labels(h.bounds)
    family.add_metric(labels, list(zip(les, _cumsum(h.counts), strict=True)), h.sum_s)


def _queues(pool: object) -> bool:
    """Whether ``pool`` queues calls (has figures per priority to export)."""
    return callable(getattr(pool, "waiting_by_priority", None))


def _log_extra(pool: object) -> dict[str, str] | None:
    """The ``extra`` of a line about ``pool``: its own name as
    :data:`~asyncpool.naming.LOG_FIELD`, as every line a named pool logs;
    None for a pool without one (its lines carry no such attribute)."""
    try:
        own = getattr(pool, "name", None)
    except Exception:  # a pool that cannot answer: its line still goes out
        return None
    return {LOG_FIELD: own} if isinstance(own, str) else None
