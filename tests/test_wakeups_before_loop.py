"""Fences deferred before any event loop ran still wake later waiters."""

from __future__ import annotations

import asyncio
import threading

from helpers import bounded

from asyncpool import AsyncReqToTokenPool, HostStream


def test_rows_deferred_before_the_loop_wake_a_waiter_when_the_gate_opens() -> None:
    pool = AsyncReqToTokenPool(3, 4)
    stream = HostStream()
    gate = threading.Event()
    stream.launch(gate.wait)
    rows = pool.try_alloc(2)  # no loop runs yet
    assert rows is not None
    pool.record_use(rows, stream.record())
    pool.free(rows)
    assert pool.pending_size() == 2

    async def main() -> list[int]:
        waiter = asyncio.ensure_future(pool.alloc(2))
        await asyncio.sleep(0)
        assert pool.waiting() == 1
        # Only the stream moves now: nobody calls into the pool.
        threading.Thread(target=gate.set).start()
        async with asyncio.timeout(5):
            got = await waiter
        pool.free(got)
        async with bounded():
            await pool.close()
        return got

    try:
        assert sorted(asyncio.run(main())) == sorted(rows)
    finally:
        gate.set()
        stream.close()


def test_one_faulted_fence_counts_one_error_however_many_rows_it_held() -> None:
    pool = AsyncReqToTokenPool(6, 4)
    stream = HostStream()

    def boom() -> None:
        raise RuntimeError("device fault")

    try:
        rows = pool.try_alloc(4)
        assert rows is not None
        stream.launch(boom)
        fence = stream.record()
        pool.record_use(rows, fence)
        try:
            fence.synchronize()
        except Exception:
            pass
        pool.free(rows)
        stats = pool.stats()
        assert stats.quarantined == 4
        assert stats.fence_errors == 1
        pool.check_invariants()
    finally:
        stream.close()
