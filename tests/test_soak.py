"""A short soak (``benchmarks/soak.py``): nothing the pools keep grows with use.

``python -m benchmarks.soak`` runs the pool's whole surface for millions of
operations and measures, at a quiet point after each round, the length of
every container reachable from the pools and of the library's module-level
ones (docs/testing.md has its figures). Here a short version of it: ten
rounds of about 500 pool calls, on each loop. A dict, list or set that
gains an entry per grant, per fence, per waiter, per stream or per overdue
fence and is never trimmed is longer at round 10 than at round 2; the
second test shows the check sees one (a list that gains an entry per
grant, installed on each pool).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from benchmarks import soak as soak_mod

OPS = 5000
ROUNDS = 10


# Overdue transfers, force_release() and faults each log a line.
pytestmark = pytest.mark.usefixtures("quiet_asyncpool_logs")


async def test_a_short_soak_leaves_every_structure_as_long_at_round_10_as_at_round_2() -> None:
    async with asyncio.timeout(60):
        result = await soak_mod.soak(OPS, ROUNDS)
    assert len(result.rounds) == ROUNDS
    # The walk reaches the pools' insides: ledgers, waiter queues, the
    # page pools' ledgers, the collector, the library's modules.
    sizes = result.rounds[-1].sizes
    assert len(sizes) > 100
    for path in ("paged._ledger._uses", "hybrid._waiters.tiers", "collector._last"):
        assert path in sizes, path
    assert any(k.startswith("paged._wakeups.watcher.") for k in sizes)
    assert any(k.startswith("asyncpool.fences.") for k in sizes)
    # Every path was taken: queued calls timed out and were cancelled, frees
    # were deferred, growth was refused, overdue transfers were released,
    # faulted ones quarantined, grants held, streams used once.
    for name, n in result.touched.items():
        assert n > 0, f"the soak never took the path of {name!r}: {result.touched}"
    assert soak_mod.grown(result) == {}
    # The windows (recent latencies, waits) stay within their bound.
    for one in result.rounds:
        assert all(n <= cap for n, cap in one.windows.values())
    # Idle, the fence watchers' threads ended; closed and dropped: no pool,
    # page pool, stream or watcher thread left.
    assert result.watchers_idle == []
    assert result.threads_left == []
    assert result.objects_left == {}


async def test_the_short_soak_sees_a_list_that_gains_an_entry_per_grant() -> None:
    def leak(pool: Any) -> None:
        kept: list[object] = []
        pool.leaked = kept
        for name in ("try_admit", "try_alloc"):
            real = getattr(pool, name)

            def counting(*args: Any, _real: Any = real, **kw: Any) -> Any:
                got = _real(*args, **kw)
                if got is not None:
                    kept.append(got)
                return got

            setattr(pool, name, counting)

    async with asyncio.timeout(60):
        result = await soak_mod.soak(OPS // 2, 4, on_pool=leak)
    grew = soak_mod.grown(result)
    assert set(grew) == {"rows.leaked", "paged.leaked", "hybrid.leaked"}, grew


@pytest.mark.parametrize("ends", ["ran", "raised"])
def test_the_soak_program_puts_the_library_log_level_back(
    ends: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``python -m benchmarks.soak`` quiets the library's lines for its run
    only: left at CRITICAL, every later test in the process that waits for
    a warning (a ``force_release`` line) failed."""

    class Stop(Exception):
        pass

    def run_on(kind: str, main: Any) -> Any:
        if ends == "raised":
            raise Stop
        return soak_mod.Soak([_round(), _round()], [], [], {}, {}, 0)

    def _round() -> soak_mod.Round:
        return soak_mod.Round(0, 0, 0.0, 0, None, 1, {}, {}, {}, [])

    log = logging.getLogger("asyncpool")
    log.setLevel(logging.NOTSET)
    monkeypatch.setattr(soak_mod, "run_on", run_on)
    if ends == "raised":
        with pytest.raises(Stop):
            soak_mod.main(["--loop", "asyncio", "--ops", "30", "--rounds", "3"])
    else:
        assert soak_mod.main(["--loop", "asyncio", "--ops", "30", "--rounds", "3"]) == 0
        assert "no container grew" in capsys.readouterr().out
    assert log.level == logging.NOTSET


async def test_what_other_code_keeps_alive_is_not_counted_as_left_by_the_soak() -> None:
    """In a test suite's process, pools (and their watchers) other tests
    keep alive are theirs: only what outlives the soak's own counts."""
    from asyncpool import AsyncReqToTokenPool, KVPagePool

    kept = AsyncReqToTokenPool(3, 8, kv=KVPagePool(5, 4))
    async with asyncio.timeout(60):
        result = await soak_mod.soak(600, 3)
    assert result.objects_left == {}
    await kept.close()
