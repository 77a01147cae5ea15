"""Gaps found by a mechanical mutation sweep of ``sync_pool.py``.

Each test pins one behaviour that an ``ast``-generated mutant broke while
every test file that exercises the module still passed:

* a synchronous pool's ``stats()`` reports no queue: ``waiters``,
  ``timeouts``, ``cancellations`` and ``rejections`` are 0, and it is
  neither ``closed`` nor ``released`` (it has no ``close()`` or
  ``release_memory()``), before and after traffic that includes an
  ``alloc`` answered ``None``, deferred frees and ``clear()`` (the mutants
  reported one timeout, cancellation or rejection, or a closed or released
  pool, to every scrape).
"""

from __future__ import annotations

from helpers import Streams

from asyncpool import ReqToTokenPool


def _no_queue(pool: ReqToTokenPool) -> None:
    st = pool.stats()
    assert (st.waiters, st.timeouts, st.cancellations, st.rejections) == (0, 0, 0, 0)
    assert st.closed is False and st.released is False


def test_a_sync_pool_reports_no_queue_and_is_never_closed_or_released(kit: Streams) -> None:
    pool = ReqToTokenPool(5, 4)
    _no_queue(pool)
    s = kit.stream()
    gate = kit.gate(s)
    rows = pool.alloc(4)
    assert rows is not None
    assert pool.alloc(1) is None  # short: the seed's answer, not a wait
    pool.free(rows[:2], after=s)
    pool.free(rows[2:])
    _no_queue(pool)
    gate.open()
    s.synchronize()
    assert pool.alloc(4) is not None
    pool.clear()
    _no_queue(pool)
    st = pool.stats(summaries=False)
    assert st.alloc_calls == st.wait_histogram.count == 2
