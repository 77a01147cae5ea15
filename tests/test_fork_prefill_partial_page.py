"""n samples of one prompt: the prefill row's partial last page (trialJump).

docs/api.md's recipe hands the prompt's full pages to the node the samples
borrow; the partial last page is each sample's own. ``trim_pages(row,
full)`` before ``detach_pages`` gives that page back behind the prefill
step the row recorded (it still writes the page), so the node gets exactly
the full pages and the engine picks no fence by hand.
"""

from __future__ import annotations

import asyncio

from helpers import EventFence, doc_section, until

from asyncpool import AsyncReqToTokenPool, KVPagePool


async def test_trim_then_detach_hands_the_node_full_pages_and_holds_the_partial_one() -> None:
    kv = KVPagePool(9, 4)  # 8 pages of 4 slots
    pool = AsyncReqToTokenPool(5, 64, kv=kv)
    prompt, full = 10, 2  # 2 full pages and a partial one
    grant = pool.try_admit(pages=-(-prompt // 4))
    assert grant is not None
    pages = grant.pages.tolist()
    step = EventFence()  # the prefill step, still running
    pool.record_use([grant.row], step)
    assert pool.trim_pages(grant.row, full) == 0  # the partial page waits for the step
    node = pool.detach_pages(grant.row)
    assert node.tolist() == pages[:full]
    pool.free([grant.row])
    stats = pool.stats()
    assert (stats.pages_allocated, stats.pages_pending) == (full, 1)
    assert pages[full] not in kv.alloc(kv.available_size()).tolist()  # not handed out early
    step.set()
    async with asyncio.timeout(5):  # the watcher polls a fence of unknown origin
        await until(lambda: pool.stats().pages_pending == 0)
    assert kv.alloc(1).tolist() == [pages[full]]
    pool.check_invariants()
    await pool.close()


def test_the_recipe_says_so() -> None:
    text = " ".join(doc_section("docs/api.md", "## Admission in depth").split())
    assert "`trim_pages(row, full)` first" in text
    assert "`kv.free(pages[full:], fence=prefill_step_fence)`" in text
