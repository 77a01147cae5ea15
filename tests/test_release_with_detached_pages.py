"""An RL rollout engine's weight sync: release_memory with a prefix cache's pages.

Between two rollout batches the trainer pushes new weights: the engine frees
its rows, evicts its prefix cache (the KV it holds was computed with the old
weights) and releases the memory. Pages that ``detach_pages`` handed to the
engine (a prompt's prefix shared by its n samples) are allocated with no row
owning them, so ``release_memory`` refuses; the refusal names them as the
caller's and the call that returns them (``kv.free``; a group's own page pool
on a grouped pool), not "free them", which sent an engine to ``pool.free``
with no row left to free. The refusal changes nothing: after the eviction
the release goes through, and the queued next batch is served after resume.
"""

from __future__ import annotations

import asyncio

import pytest

from asyncpool import AsyncReqToTokenPool, KVPagePool, PoolBusyError


async def test_release_names_detached_pages_and_the_call_that_returns_them() -> None:
    kv = KVPagePool(17, 4)
    pool = AsyncReqToTokenPool(5, 64, kv=kv)
    grant = pool.try_admit(pages=3)
    assert grant is not None
    prefix = pool.detach_pages(grant.row)  # the prompt's shared prefix, the engine's now
    pool.free([grant.row])
    before = pool.stats()
    with pytest.raises(PoolBusyError) as info:
        async with asyncio.timeout(5):
            await pool.release_memory(timeout=1)
    message = str(info.value)
    assert "3 KV pages of the kv pool are still allocated" in message
    assert "held by no row" in message and "detach_pages" in message
    assert "evict them with kv.free first" in message
    assert pool.stats() == before and not pool.released  # refused: nothing changed
    kv.free(prefix)
    async with asyncio.timeout(5):
        await pool.release_memory(timeout=1)
        await pool.resume_memory()
    pool.check_invariants()
    await pool.close()


async def test_one_detached_page_of_a_group_names_the_groups_page_pool() -> None:
    pool = AsyncReqToTokenPool(5, 64, kv={"full": KVPagePool(9, 4), "swa": KVPagePool(9, 4)})
    grant = pool.try_admit({"full": 0, "swa": 1})
    assert grant is not None
    page = pool.detach_pages(grant.row, group="swa")
    pool.free([grant.row])
    with pytest.raises(PoolBusyError) as info:
        async with asyncio.timeout(5):
            await pool.release_memory()
    message = str(info.value)
    assert "1 KV page of KV group 'swa' is still allocated, held by no row" in message
    assert "evict it with pool.kv_groups['swa'].free first" in message
    pool.kv_groups["swa"].free(page)  # type: ignore[index]
    async with asyncio.timeout(5):
        await pool.release_memory()
    assert pool.released
    await pool.close()
