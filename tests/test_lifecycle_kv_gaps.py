"""Lifecycle gaps with ``kv=`` that a trial found (each test fails without
its fix):

* a ``KVPagePool`` whose pages were already pending behind a fence when it
  was handed to a pool: the pool never watched that fence, so its
  completion woke no queued ``admit`` (docs/api.md: "a page fence completing
  wakes an admit waiter with nobody calling the pool");
* the poller thread of fences of unknown origin waited for ever once idle,
  holding the pool (through its wake-up callback) alive until ``close()``:
  a pool drained but never closed was never collected. It now exits after
  the same idle linger as a stream thread, and a later fence starts it
  again;
* one page pool serves one row pool for life, closed or not (a clear
  ``ValueError``; it was documented only in a docstring);
* the ``PoolBusyError`` of ``release_memory`` with one page allocated reads
  as a sentence.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref

import pytest
from helpers import EventFence, bounded, spin

import asyncpool.watcher as watcher_mod
from asyncpool import AsyncReqToTokenPool, HostStream, KVPagePool, PoolBusyError


async def test_pages_pending_before_the_hand_over_wake_an_admission() -> None:
    kv = KVPagePool(5, 16)  # 4 pages
    gate = threading.Event()
    stream = HostStream()
    try:
        stream.launch(gate.wait)
        fence = stream.record()
        kv.free(kv.alloc(4), fence=fence)  # every page pending behind it
        pool = AsyncReqToTokenPool(4, 64, kv=kv)
        waiter = asyncio.ensure_future(pool.admit(pages=2))
        await spin()
        assert not waiter.done()
        gate.set()  # the page fence completes; nobody calls the pool
        async with bounded():
            grant = await waiter
        assert len(grant.pages) == 2
        pool.free([grant.row])
        await pool.close()
    finally:
        gate.set()
        stream.close()


async def test_an_unknown_fence_pending_before_the_hand_over_is_watched() -> None:
    kv = KVPagePool(5, 16)
    fence = EventFence()
    kv.free(kv.alloc(4), fence=fence)
    pool = AsyncReqToTokenPool(4, 64, kv=kv)
    waiter = asyncio.ensure_future(pool.admit(pages=4))
    await spin()
    fence.set()
    async with bounded():
        grant = await waiter
    pool.free([grant.row])
    await pool.close()


async def test_an_idle_poller_exits_and_lets_the_pool_go(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(watcher_mod, "_STREAM_LINGER_S", 0.01)
    pool = AsyncReqToTokenPool(3, 64, kv=KVPagePool(9, 16))
    fence = EventFence()
    grant = await pool.admit(pages=1)
    pool.free([grant.row], fence=fence)
    watcher = pool._wakeups.watcher
    assert watcher is not None
    poller = watcher._thread
    assert poller is not None and poller.is_alive()
    fence.set()
    async with bounded():
        await pool.drain()
    poller.join(5)  # idle: it ends by itself, no close()
    assert not poller.is_alive()
    # A later fence of unknown origin starts a poller again and is noticed.
    later = EventFence()
    grant = await pool.admit(pages=1)
    pool.free([grant.row], fence=later)
    waiter = asyncio.ensure_future(pool.admit(pages=8))
    await spin()
    later.set()
    async with bounded():
        grant = await waiter
    pool.free([grant.row])
    async with bounded():
        await pool.drain()
    ref = weakref.ref(pool)
    del pool, grant, waiter, watcher
    for thread in [t for t in threading.enumerate() if t.name == "asyncpool-fence-watcher"]:
        thread.join(5)
    gc.collect()
    assert ref() is None  # nothing (no thread) keeps a drained pool alive


async def test_a_page_pool_serves_one_pool_for_life() -> None:
    kv = KVPagePool(9, 16)
    first = AsyncReqToTokenPool(3, 64, kv=kv)
    with pytest.raises(ValueError, match="already serves a pool"):
        AsyncReqToTokenPool(3, 64, kv=kv)
    await first.close()
    with pytest.raises(ValueError, match="closed or not"):
        AsyncReqToTokenPool(3, 64, kv=kv)


async def test_release_with_one_page_allocated_reads_as_a_sentence() -> None:
    pool = AsyncReqToTokenPool(3, 64, kv=KVPagePool(9, 16))
    pages = pool.kv.alloc(1)  # type: ignore[union-attr]
    with pytest.raises(PoolBusyError, match="while 1 KV page of the kv pool is still allocated"):
        await pool.release_memory()
    pool.kv.free(pages)  # type: ignore[union-attr]
    await pool.close()
