"""A long ``fence=`` sequence costs time linear in its length.

An engine may hand one call thousands of transfer handles (a prefix-cache
node read by one transfer per peer and chunk). Every call that takes a
sequence, and the reclaim that settles a batch behind one, must cost
O(len): the fences of unknown origin were told apart by a scan of those
seen (``newest_per_stream``) and ``record_use`` merged the fences one by
one into each row's growing uses, both O(len^2): 8,000 transfer handles
took about 0.8 s a call where 500 took 3 ms.

Each case times one call at 500 and at 8,000 fences (the best of seven
tries each, the two sizes alternated, the collector off, on the calling
thread's CPU clock, so that other processes on a loaded machine and a
collection landing in one size's tries do not move the ratio) and checks
the ratio: about 16 for linear cost, about 256 for quadratic; the bound,
64, leaves room either way (wall time under three concurrent suites on two
cores once read 168x for linear code).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

import pytest

from asyncpool import KVPagePool, ReqToTokenPool

SMALL, LARGE = 500, 8_000
BOUND = 64.0


class Transfer:
    """A transfer handle (a fence of unknown origin), landed on cue."""

    __slots__ = ("__weakref__", "landed")

    def __init__(self) -> None:
        self.landed = False

    def query(self) -> bool:
        return self.landed

    def synchronize(self) -> None:
        raise AssertionError("never called by the pool")


def _free(n: int) -> Callable[[], object]:
    pool = ReqToTokenPool(4, 4)
    rows = pool.alloc(2)
    fences = [Transfer() for _ in range(n)]
    return lambda: pool.free(rows, fences)


def _record_use(n: int) -> Callable[[], object]:
    pool = ReqToTokenPool(4, 4)
    rows = pool.alloc(2)
    fences = [Transfer() for _ in range(n)]
    return lambda: pool.record_use(rows, fences)


def _free_recorded(n: int) -> Callable[[], object]:
    pool = ReqToTokenPool(4, 4)
    rows = pool.alloc(2)
    assert rows is not None
    pool.record_use(rows, [Transfer() for _ in range(n)])
    return lambda: pool.free(rows, Transfer())


def _kv_free(n: int) -> Callable[[], object]:
    kv = KVPagePool(9, 4)
    pages = kv.alloc(4)
    fences = [Transfer() for _ in range(n)]
    return lambda: kv.free(pages, fence=fences)


def _reclaim(n: int) -> Callable[[], object]:
    pool = ReqToTokenPool(4, 4)
    rows = pool.alloc(2)
    fences = [Transfer() for _ in range(n)]
    assert pool.free(rows, fences) == 0
    for f in fences:
        f.landed = True
    return pool.reclaim  # the head landed: every other fence is asked


CASES: dict[str, Callable[[int], Callable[[], object]]] = {
    "free": _free,
    "record_use": _record_use,
    "free of rows that recorded them": _free_recorded,
    "kv.free": _kv_free,
    "reclaim": _reclaim,
}


def _best_seconds(make: Callable[[int], Callable[[], object]], tries: int) -> tuple[float, float]:
    """The best of ``tries`` calls at SMALL and at LARGE fences, alternated."""
    best = {SMALL: float("inf"), LARGE: float("inf")}
    enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(tries):
            for n in (SMALL, LARGE):
                call = make(n)  # a fresh pool: each call is the first
                t0 = time.thread_time()
                call()
                best[n] = min(best[n], time.thread_time() - t0)
    finally:
        if enabled:
            gc.enable()
    return best[SMALL], best[LARGE]


@pytest.mark.parametrize("case", list(CASES))
def test_a_long_sequence_costs_linear_time(case: str) -> None:
    make = CASES[case]
    small, large = _best_seconds(make, 7)
    ratio = large / max(small, 1e-6)
    assert ratio < BOUND, (
        f"{case}: {LARGE} fences took {large * 1e3:.1f} ms, {SMALL} took "
        f"{small * 1e3:.2f} ms: {ratio:.0f}x for 16x the fences"
    )
