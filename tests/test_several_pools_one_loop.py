"""Several pools on one event loop (a server hosting several models, each
its own pool, loaded and unloaded at run time): closing one never stalls the
loop that serves the others."""

from __future__ import annotations

import asyncio
import threading

import pytest
from helpers import WAIT_S, bounded, spin

from asyncpool import AsyncReqToTokenPool, KVPagePool, lifecycle


class HangingQuery:
    """A transfer handle whose ``query()`` on the pool's poller thread blocks
    until ``gate`` is set, as a status poll over a slow link does (against
    the protocol, but it happens); on the loop's thread it answers at once."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.loop_thread = threading.get_ident()

    def query(self) -> bool:
        if threading.get_ident() != self.loop_thread:
            self.entered.set()
            self.gate.wait(WAIT_S)
        return False

    def synchronize(self) -> None:
        self.gate.wait(WAIT_S)


async def test_closing_a_pool_whose_poller_is_in_a_query_never_stalls_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``close()`` waited (up to 50 ms) for the pool's poller thread by a
    thread join on the loop's thread: every other pool on the loop stalled
    meanwhile (measured 10-42 ms with three handles whose ``query()`` takes
    10 ms). It now awaits between looks: the pool is closed at once, the
    loop runs other tasks meanwhile, and the thread is gone when it returns.
    Its 50 ms bound is widened here: a loaded machine that took longer
    between the close and the checks would end the wait and fail them."""
    monkeypatch.setattr(lifecycle, "_CLOSE_JOIN_S", WAIT_S)
    unloaded = AsyncReqToTokenPool(4, 8, name="unloaded")
    other = AsyncReqToTokenPool(4, 8, kv=KVPagePool(9, 2), name="other")
    handle = HangingQuery()
    async with bounded():
        rows = await unloaded.alloc(1)
    unloaded.free(rows, fence=handle)
    assert handle.entered.wait(WAIT_S)  # the poller is inside query()
    (poller,) = [t for t in threading.enumerate() if "'unloaded'" in t.name]
    closing = asyncio.ensure_future(unloaded.close())
    await asyncio.sleep(0)  # close() runs up to its first await
    assert unloaded.closed and not closing.done()  # closed, and the loop is ours
    async with bounded():
        grant = await other.admit(pages=2)  # the other pool serves meanwhile
    assert not closing.done()
    handle.gate.set()
    async with bounded():
        await closing
    assert not poller.is_alive()  # close() returned once the query() did
    other.free([grant.row])
    async with bounded():
        await other.close()


async def test_a_second_close_waits_for_the_threads_as_the_first_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``close()`` is idempotent, and each call returns with the pool's
    watcher threads gone (or its 50 ms spent): a second call made while the
    first waits for them, or after the first was cancelled in that wait (an
    ``asyncio.timeout`` around an unload), returned at once with the poller
    still running. Each now waits for them, within the first call's bound
    (widened here so that no load on the machine ends it)."""
    monkeypatch.setattr(lifecycle, "_CLOSE_JOIN_S", WAIT_S)
    pool = AsyncReqToTokenPool(4, 8, name="twice")
    handle = HangingQuery()
    try:
        async with bounded():
            rows = await pool.alloc(1)
        pool.free(rows, fence=handle)
        assert handle.entered.wait(WAIT_S)  # the poller is inside query()
        (poller,) = [t for t in threading.enumerate() if "'twice'" in t.name]
        first = asyncio.ensure_future(pool.close())
        await spin()
        second = asyncio.ensure_future(pool.close())
        await spin()
        assert pool.closed and not first.done() and not second.done()
        first.cancel()
        await spin()
        assert first.cancelled() and not second.done()
        third = asyncio.ensure_future(pool.close())  # after a cancelled one
        await spin()
        assert not third.done() and poller.is_alive()
    finally:
        handle.gate.set()
    async with bounded():
        await second
        assert not poller.is_alive()  # gone when close() returns
        await third
        await pool.close()  # nothing left to wait for: at once
