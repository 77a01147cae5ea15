"""*n samples of one prompt* under tight memory: lock a node at its sample's grant
(docs/api.md, *n samples of one prompt*).

Found by a trial that wrote an RL-rollout (GRPO) engine on the recipe against the
installed package (trialPin): with the node's lock taken for each sample before
its admission, as the recipe said, queued samples pin their prompts' pages. When
the head of the queue is a sample short of pages and every cached node is locked
by samples that still queue, nothing runs, no eviction is allowed, and the
awaited admission waits for ever (the trial stalled for good in 36 of 36 runs on
both loops, after 5 to 7,947 grants). Locked at grant instead, a node whose
samples all queue can be evicted for the head, and a sample re-checks its node
when granted (a node evicted meanwhile is the engine's to refetch). The pool
behaves as documented; these tests pin the recipe's order. Every await that
could hang is bounded.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import torch
from helpers import bounded, page_ids, spin

from asyncpool import AsyncReqToTokenPool, Fence, HostStream, KVPagePool, record_fence

FULL = 5  # each prompt's full pages (the node's)
SAMPLE = 3  # a sample's own pages: the prompt's partial last page and its output


@dataclass
class Node:
    pages: torch.Tensor
    read_fence: Fence
    lock: int = 0
    evicted: bool = False


async def two_nodes(
    stream: HostStream,
) -> tuple[AsyncReqToTokenPool, KVPagePool, dict[str, Node]]:
    """Prefill prompts A and B on rows of their own and hand their full pages to
    two nodes, as the recipe does: 10 of the pool's 12 pages pinned, 2 free."""
    kv = KVPagePool(13, 4)
    pool = AsyncReqToTokenPool(8, 64, kv=kv)
    nodes = {}
    for name in "AB":
        async with bounded():
            g = await pool.admit(pages=FULL + 1)
        fence = record_fence(stream)  # the prefill step
        pool.record_use([g.row], fence)
        pool.trim_pages(g.row, FULL)  # the partial page, behind the prefill step
        nodes[name] = Node(pool.detach_pages(g.row), fence)
        pool.free([g.row])
    async with bounded():
        await asyncio.to_thread(stream.record().synchronize)
    assert pool.kv is kv and kv.available_size() == 2
    return pool, kv, nodes


def evict_for_the_head(pool: AsyncReqToTokenPool, kv: KVPagePool, nodes: dict[str, Node]) -> int:
    """One scheduling pass's eviction: ``pool.pages_short()`` pages of the
    unlocked nodes, behind each one's newest reader; the pages it evicted."""
    short, evicted = pool.pages_short(), 0
    for node in nodes.values():
        if evicted >= short:
            break
        if node.lock == 0 and not node.evicted:
            node.evicted = True
            kv.free(node.pages, fence=node.read_fence)
            evicted += len(node.pages)
    return evicted


async def test_locks_taken_while_samples_queue_stall_for_good() -> None:
    """The order the recipe gave before: each sample locks its node before it
    queues. The head sample lacks one page, every node is locked by samples
    that queue, nothing runs: every eviction pass finds nothing to evict."""
    with HostStream() as stream:
        pool, kv, nodes = await two_nodes(stream)
        for node in nodes.values():
            node.lock += 2  # two samples each, locked before their admission
        samples = [asyncio.ensure_future(pool.admit(pages=SAMPLE)) for _ in range(4)]
        await spin()
        head = pool.queue_head()
        assert head is not None and head.pages == SAMPLE and head.pages_short == 1
        stalled = False
        try:
            async with asyncio.timeout(0.3):
                while not samples[0].done():
                    assert evict_for_the_head(pool, kv, nodes) == 0
                    await asyncio.sleep(0.005)  # the engine's next pass
        except TimeoutError:
            stalled = True
        assert stalled and not any(s.done() for s in samples)
        assert kv.available_size() == 2 and pool.pages_short() == 1
        for s in samples:
            s.cancel()
        await asyncio.gather(*samples, return_exceptions=True)
        for node in nodes.values():
            kv.free(node.pages, fence=node.read_fence)
        pool.check_invariants()


async def test_locks_taken_at_grant_let_the_head_evict_and_each_grant_rechecks() -> None:
    """Locked at grant, a node whose samples only queue is unlocked: the pass
    evicts it for the head and the samples are granted. Each re-checks its
    node: one still cached takes the lock (its steps may read it); one
    evicted meanwhile needs the prompt's pages again: ``extend`` never waits,
    and on ``None`` the row is freed at once (nothing ran on it) and the
    sample requeued as a plain request, which the next passes' evictions
    serve once the running sample has finished."""
    with HostStream() as stream:
        pool, kv, nodes = await two_nodes(stream)
        sample_a = asyncio.ensure_future(pool.admit(pages=SAMPLE))  # the head
        sample_b = asyncio.ensure_future(pool.admit(pages=SAMPLE))
        await spin()
        assert pool.pages_short() == 1 and not sample_a.done()
        assert evict_for_the_head(pool, kv, nodes) == FULL  # node A: unlocked
        async with bounded():
            ga, gb = await sample_a, await sample_b
        assert nodes["A"].evicted and not nodes["B"].evicted
        nodes["B"].lock += 1  # B's sample: its node is cached, lock it now
        assert pool.extend(ga.row, FULL) is None  # A's: 1 page free, nothing taken
        assert kv.available_size() == 1
        pool.free([ga.row])  # nothing ran on it: back at once
        plain = asyncio.ensure_future(pool.admit(pages=FULL + SAMPLE))  # requeued
        await spin()
        assert evict_for_the_head(pool, kv, nodes) == 0  # B is locked: not evictable
        assert kv.available_size() == 4  # 1 + the freed row's 3
        assert not plain.done() and pool.pages_short() == FULL + SAMPLE - 4
        fence = record_fence(stream)  # B's sample's step reads its row and node B
        pool.record_use([gb.row], fence)
        nodes["B"].read_fence = fence
        pool.free([gb.row])  # it finished: its row and pages behind that step
        nodes["B"].lock -= 1
        async with bounded():
            while not plain.done():
                evict_for_the_head(pool, kv, nodes)
                await asyncio.sleep(0.001)  # the engine's next pass
        assert nodes["B"].evicted
        g = plain.result()
        assert len(page_ids(g.pages)) == FULL + SAMPLE
        pool.free([g.row])
        async with bounded():
            await asyncio.to_thread(stream.record().synchronize)
        pool.check_invariants()
