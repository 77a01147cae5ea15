"""``PoolCollector`` used from several threads at once.

``add()`` checked that a name was free, then inserted: two threads adding
one name at once could both pass the check, and the second pool silently
replaced the first (exported under its label, the first lost for good, no
error). Two scrapes at once could likewise both read a counter's last
exported value before either wrote its own, and the lower write could land
last: a later scrape could then export a counter below one already
exported (Prometheus takes that for a restart). A lock now guards the
check-then-insert of ``add`` and ``remove``'s pop, and the read-compare-write
of a counter's last value; never held across a pool's ``stats()``.

Each test forces the interleaving that broke, with a barrier where the old
code let another thread in, so it fails on the old code every run; on the
new one the lock keeps the second thread out, the barrier times out, and
the calls run one after the other.
"""

from __future__ import annotations

import gc
import threading
from typing import Any

from helpers import in_thread

from asyncpool import AsyncReqToTokenPool
from asyncpool.metrics import PoolCollector

_MEET_S = 0.5  # long enough for two free threads to meet, short when one is locked out


def _meet(barrier: threading.Barrier) -> None:
    """Wait for the other thread at ``barrier``, for at most ``_MEET_S``: a
    thread kept out by the lock never comes, and this one goes on alone."""
    try:
        barrier.wait(_MEET_S)
    except threading.BrokenBarrierError:
        pass


class _SlowLookup:
    """A pool whose ``stats`` lookup, which ``add()`` makes between its
    check of the name and its insert, waits for the other adder first."""

    def __init__(self, barrier: threading.Barrier) -> None:
        self._barrier = barrier
        self._pool = AsyncReqToTokenPool(3, 4)

    @property
    def stats(self) -> Any:
        _meet(self._barrier)
        return self._pool.stats


def _both(first: Any, second: Any) -> list[BaseException | None]:
    """Run the two calls in two threads at once; what each raised (or None)."""
    out: list[BaseException | None] = [None, None]

    def run(i: int, call: Any) -> None:
        try:
            call()
        except BaseException as exc:
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate((first, second))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
        assert not t.is_alive(), "an add() hung"
    return out


def test_two_threads_adding_one_name_at_once_one_is_refused() -> None:
    barrier = threading.Barrier(2)
    one, two = _SlowLookup(barrier), _SlowLookup(barrier)
    collector = PoolCollector()
    errors = _both(lambda: collector.add(one, "decode"), lambda: collector.add(two, "decode"))
    refused = [e for e in errors if e is not None]
    assert len(refused) == 1, f"both adds of one name passed: {errors}"
    assert isinstance(refused[0], ValueError) and "'decode'" in str(refused[0])
    assert collector.names == ("decode",)
    kept = one if errors[1] is not None else two
    assert collector._pools["decode"][0] is kept  # the one that was not refused
    fams = [f for f in collector.collect() if f.name == "asyncpool_capacity_rows"]
    assert [s.labels["pool"] for s in fams[0].samples] == ["decode"]


class _MeetingLast(dict):  # type: ignore[type-arg]
    """A counter's last values, where each of two scrapes' reads waits for
    the other's, and the lower write waits for the higher one's: the
    interleaving that let a counter go down."""

    def __init__(self, barrier: threading.Barrier, higher_wrote: threading.Event) -> None:
        super().__init__()
        self._barrier = barrier
        self._higher_wrote = higher_wrote

    def get(self, key: Any, default: Any = None) -> Any:
        value = super().get(key, default)
        _meet(self._barrier)  # read: now the other thread reads too
        return value

    def __setitem__(self, key: Any, value: Any) -> None:
        if value == 3.0:  # the lower one: after the higher one, when both read first
            self._higher_wrote.wait(_MEET_S)
        super().__setitem__(key, value)
        if value == 5.0:
            self._higher_wrote.set()


def test_two_scrapes_at_once_never_export_a_counter_lower_later() -> None:
    collector = PoolCollector()
    collector._last = _MeetingLast(threading.Barrier(2), threading.Event())
    key = ("alloc_calls", object())
    errors = _both(lambda: collector._never_down(key, 3.0), lambda: collector._never_down(key, 5.0))
    assert errors == [None, None]
    # 5 was exported: a later scrape that reads 4 (skew) must export 5 again.
    assert in_thread(lambda: collector._never_down(key, 4.0)) == 5.0


class _CollectsInLock(dict):  # type: ignore[type-arg]
    """A counter's last values whose scan (``_forget``'s, which ``remove``
    makes holding the lock) is where the cyclic GC happens to run, as it
    may at any allocation: it closes a scrape let go of in a reference
    cycle, whose ``finally`` takes the lock too."""

    def __iter__(self) -> Any:
        gc.collect()
        return super().__iter__()


def test_a_scrape_the_gc_closes_under_the_lock_does_not_deadlock() -> None:
    """A scrape stopped early and left in a reference cycle (an exception
    kept with its traceback, say) is closed by the cyclic GC, at whatever
    allocation comes next: on a thread inside the collector's lock, its
    ``finally`` blocked on that lock for good, and every later scrape,
    add and remove with it. The lock is reentrant: it goes through."""
    collector = PoolCollector(AsyncReqToTokenPool(3, 4), "a")
    collector.add(AsyncReqToTokenPool(3, 4), "b")
    scrape = collector.collect()
    next(scrape)  # suspended in its try: closing it takes the lock
    cycle: list[Any] = [scrape]
    cycle.append(cycle)  # only the cyclic GC frees it now
    del scrape, cycle
    collector._last = _CollectsInLock(collector._last)
    in_thread(lambda: collector.remove("b"), daemon=True)
    assert collector.names == ("a",)
    fams = [f for f in collector.collect() if f.name == "asyncpool_capacity_rows"]
    assert [s.labels["pool"] for s in fams[0].samples] == ["a"]
