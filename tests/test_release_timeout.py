"""``release_memory(timeout=)``: a weight update behind a stuck transfer
gives up after ``timeout`` seconds and leaves the pool serving, as a cancel
does; a bad ``timeout`` changes nothing. Every wait is bounded.
"""

from __future__ import annotations

import logging

import pytest
from helpers import EventFence, bounded

from asyncpool import AsyncReqToTokenPool, KVPagePool


@pytest.fixture(autouse=True)
def _quiet(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.CRITICAL, logger="asyncpool")


def make(reclaim: str = "auto") -> AsyncReqToTokenPool:
    return AsyncReqToTokenPool(4, 16, kv=KVPagePool(8, 4, reclaim=reclaim), reclaim=reclaim)


@pytest.mark.parametrize("reclaim", ["auto", "explicit"])
async def test_release_behind_a_stuck_fence_times_out_and_serves_again(reclaim: str) -> None:
    stuck = EventFence()
    pool = make(reclaim)
    try:
        grant = await pool.admit(pages=2)
        pool.free([grant.row], fence=stuck)  # a transfer that never lands
        async with bounded():
            with pytest.raises(TimeoutError, match=r"release_memory did not release.*1 row"):
                await pool.release_memory(timeout=0.02)
        assert not pool.released
        # Not gated: an admission that fits is granted at once.
        got = pool.try_admit(pages=1)
        assert got is not None
        pool.free([got.row])
        assert pool.pending_size() == 1 and pool.kv.pending_size() == 2  # still held
        stuck.set()
        async with bounded():
            await pool.release_memory(timeout=5)
        assert pool.released
        await pool.resume_memory()
        pool.check_invariants()
    finally:
        stuck.set()
        await pool.close()


async def test_release_with_nothing_pending_releases_under_a_zero_timeout() -> None:
    pool = make()
    try:
        async with bounded():
            await pool.release_memory(timeout=0)
        assert pool.released
        await pool.resume_memory()
    finally:
        await pool.close()


@pytest.mark.parametrize("timeout", [-1, float("nan"), "1", True])
async def test_a_bad_release_timeout_changes_nothing(timeout: object) -> None:
    stuck = EventFence()
    pool = make()
    try:
        grant = await pool.admit(pages=1)
        pool.free([grant.row], fence=stuck)
        with pytest.raises(ValueError, match="timeout"):
            await pool.release_memory(timeout=timeout)  # type: ignore[arg-type]
        assert not pool.released
        got = pool.try_admit(pages=1)  # not gated
        assert got is not None
        pool.free([got.row])
        assert pool.pending_size() == 1
    finally:
        stuck.set()
        await pool.close()
