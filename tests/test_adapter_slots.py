"""Several resources: a request's row, its KV pages and a LoRA adapter slot
(docs/api.md, *Several resources: a request's row, pages and an adapter slot*).

Found by a trial that wrote a multi-tenant LoRA engine against the installed
package (trialTenant): the adapter slots as a KV group "lora" of the model's
pool, detached to the engine's adapter cache and evicted behind their
readers, hold no defect, but the recipe leaves the engine four decisions
that the trial got wrong first or had to measure: when to lock an adapter
(a lock taken while the request queues stalled the engine for good after
56 and 118 grants: a queued miss at the head blocks the hits behind it,
which hold the locks), what to do when the cache changed while the
request queued, which fences an eviction waits for when adapters load on
a stream of their own, and what the pool-wide figures mean with a group
of slots in them. The pool behaves as documented; these tests pin what the
recipe relies on. Every await that could hang is bounded.
"""

from __future__ import annotations

import asyncio

import pytest
from helpers import Streams, bounded, page_ids, spin

from asyncpool import AsyncReqToTokenPool, KVPagePool
from asyncpool.metrics import PoolCollector


def lora_pool(slots: int = 2) -> tuple[AsyncReqToTokenPool, KVPagePool]:
    lora = KVPagePool(slots + 1, 1, name="lora")
    return AsyncReqToTokenPool(8, 64, kv={"kv": KVPagePool(64, 4), "lora": lora}), lora


async def test_a_queued_miss_at_the_head_blocks_the_hits_behind_it() -> None:
    """A lock taken at queue time deadlocks: the hits that hold the locks
    queue behind the miss that needs one of their slots, even though they
    fit, so the slot the head waits for can only come from an unlocked
    adapter's eviction."""
    pool, lora = lora_pool()
    async with bounded():
        a = await pool.admit({"kv": 4, "lora": 1})
        b = await pool.admit({"kv": 4, "lora": 1})
    cache = {
        "A": pool.detach_pages(a.row, group="lora"),
        "B": pool.detach_pages(b.row, group="lora"),
    }
    pool.free([a.row, b.row])
    miss = asyncio.ensure_future(pool.admit({"kv": 4, "lora": 1}))  # adapter C, the head
    hit = asyncio.ensure_future(pool.admit({"kv": 4, "lora": 0}))  # adapter A: fits now
    await spin()
    assert not miss.done() and not hit.done()
    head = pool.queue_head()
    assert head is not None and dict(head.pages_short) == {"kv": 0, "lora": 1}
    assert pool.pages_short(group="lora") == 1
    assert pool.available_size() == 7 and pool.kv_groups["kv"].available_size() > 8  # type: ignore[index]
    assert lora.free(cache.pop("B")) == 1  # evict B (nobody runs or queues for it)
    async with bounded():
        c, h = await miss, await hit
    assert page_ids(c.pages["lora"]) == [2] and page_ids(h.pages["lora"]) == []
    pool.free([c.row, h.row])
    lora.free(cache.pop("A"))
    pool.check_invariants()


async def test_the_cache_changed_while_the_request_queued() -> None:
    """At the grant, a hit whose adapter was evicted meanwhile takes a slot
    with ``extend(row, 1, group="lora")`` (never waits: ``None`` and nothing
    taken when none is free, counted as a growth refusal of the group), and
    a miss whose adapter another request loaded meanwhile gives its unread
    slot back with no fence: free at once, to the next queued miss."""
    pool, lora = lora_pool()
    async with bounded():
        a = await pool.admit({"kv": 4, "lora": 1})
        b = await pool.admit({"kv": 4, "lora": 1})
        hit = await pool.admit({"kv": 4, "lora": 0})  # queued as a hit on adapter C
    cache = {
        "A": pool.detach_pages(a.row, group="lora"),
        "B": pool.detach_pages(b.row, group="lora"),
    }
    kv_free = pool.kv_groups["kv"].available_size()  # type: ignore[index]
    assert pool.extend(hit.row, 1, group="lora") is None  # C evicted meanwhile, no slot free
    assert pool.kv_groups["kv"].available_size() == kv_free  # type: ignore[index]
    st = pool.stats()
    assert st.kv_groups["lora"].growth_refusals == 1 and st.growth_refusals == 1
    pool.free([hit.row])  # nothing ran on it: free at once; the engine requeues it
    assert lora.free(cache.pop("A")) == 1  # an unlocked adapter evicted (nothing read it)
    async with bounded():
        again = await pool.admit({"kv": 4, "lora": 0})
    got = pool.extend(again.row, 1, group="lora")
    assert got is not None and page_ids(got) == [1]
    cache["C"] = pool.detach_pages(again.row, group="lora")
    # Two misses on adapter D queue; the first granted loads it, the second's slot is surplus.
    first = asyncio.ensure_future(pool.admit({"kv": 4, "lora": 1}))
    second = asyncio.ensure_future(pool.admit({"kv": 4, "lora": 1}))
    third = asyncio.ensure_future(pool.admit({"kv": 4, "lora": 1}))  # adapter E
    await spin()
    assert not first.done() and pool.pages_short(group="lora") == 1
    assert lora.free(cache.pop("B")) == 1  # evicted for the head
    async with bounded():
        d = await first
    cache["D"] = pool.detach_pages(d.row, group="lora")
    assert lora.free(cache.pop("C")) == 1  # evicted for the next head
    async with bounded():
        d2 = await second
    spare = pool.detach_pages(d2.row, group="lora")
    await spin()
    assert not third.done()
    assert lora.free(spare) == 1  # D is loaded already: the slot is unread, free at once
    async with bounded():
        e = await third
    assert page_ids(e.pages["lora"]) == page_ids(spare)
    pool.free([a.row, b.row, again.row, d.row, d2.row, e.row])
    lora.free(cache.pop("D"))
    pool.check_invariants()


async def test_an_evicted_slot_waits_for_its_load_and_its_reader() -> None:
    """Adapters load on a stream of their own: a slot evicted behind the
    newest step that read it only would go to the next load while its own
    load may still write it (a slot loaded and never read has no reader at
    all). ``fence=[reader, load]`` keeps it until both have completed."""
    pool, lora = lora_pool(slots=1)
    async with bounded():
        a = await pool.admit({"kv": 4, "lora": 1})
    slot = pool.detach_pages(a.row, group="lora")
    with Streams() as streams:
        forward, loader = streams.stream("forward"), streams.stream("loader")
        load_gate, step_gate = streams.gate(loader), streams.gate(forward)
        load = loader.record()
        forward.wait(load)  # the step that reads the slot runs after its load
        reader = forward.record()
        pool.record_use([a.row], reader)
        pool.free([a.row])
        assert lora.free(slot, fence=[reader, load]) == 0
        waiter = asyncio.ensure_future(pool.admit({"kv": 4, "lora": 1}))
        await spin()
        assert lora.pending_size() == 1 and not waiter.done()
        load_gate.open()
        async with bounded():
            await asyncio.to_thread(load.synchronize)
        await spin()
        assert lora.pending_size() == 1 and not waiter.done()  # the reader still runs
        step_gate.open()
        async with bounded():
            g = await waiter
    assert page_ids(g.pages["lora"]) == [1]
    pool.free([g.row])
    pool.check_invariants()


async def test_aging_by_timeout_requeues_behind_the_urgent_tier() -> None:
    """The queues do not age: a free-tier admission that times out holds
    nothing, and re-admitted at the paid tier's priority it queues behind
    every paid call already queued (FIFO within a priority)."""
    pool = AsyncReqToTokenPool(2, 64, kv=KVPagePool(16, 4))  # one row
    async with bounded():
        first = await pool.admit(pages=2)
    paid = asyncio.ensure_future(pool.admit(pages=2, priority=0))
    await spin()
    with pytest.raises(TimeoutError):
        async with bounded():
            await pool.admit(pages=2, priority=1, timeout=0.01)
    assert pool.waiting() == 1 and pool.kv.available_size() == 13  # type: ignore[union-attr]
    aged = asyncio.ensure_future(pool.admit(pages=2, priority=0))
    await spin()
    pool.free([first.row])
    async with bounded():
        p = await paid
    assert not aged.done()
    pool.free([p.row])
    async with bounded():
        q = await aged
    pool.free([q.row])
    st = pool.stats()
    assert st.by_priority[1].timeouts == 1
    pool.check_invariants()


async def test_the_pool_wide_page_figures_count_the_slots() -> None:
    """With the slots a group of the pool, the pool-wide page figures and
    families add slots to KV pages; each group's own are apart."""
    pool, lora = lora_pool(slots=3)
    async with bounded():
        a = await pool.admit({"kv": 4, "lora": 1})
    slot = pool.detach_pages(a.row, group="lora")
    st = pool.stats()
    kv_free, lora_free = st.kv_groups["kv"].free, st.kv_groups["lora"].free
    assert (kv_free, lora_free) == (59, 2) and st.pages_free == kv_free + lora_free
    samples = {
        (s.name, s.labels.get("group"), s.labels.get("state")): s.value
        for fam in PoolCollector(pool).collect()
        for s in fam.samples
    }
    assert samples[("asyncpool_free_pages", None, None)] == 61
    assert samples[("asyncpool_kv_group_pages", "lora", "free")] == 2
    assert samples[("asyncpool_kv_group_pages", "lora", "allocated")] == 1
    pool.free([a.row])
    lora.free(slot)
    pool.check_invariants()
