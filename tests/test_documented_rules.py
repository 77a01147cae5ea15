"""Rules the README states (now docs/api.md, where its depth moved) that no
other test pinned (a claims audit found them).

* the thread rule on a pool with ``kv=``: admission, growth, page and
  lifecycle calls from a foreign thread raise :class:`WrongThreadError` and
  change nothing, ``check_invariants()`` included (it walks every record,
  which the owner may have half updated), while the scrape's reads answer;
* ``kv.reclaim()`` on the page pool of an ``AsyncReqToTokenPool`` returns
  pages only, never the rows whose fences completed with them;
* a timeout imposed from outside (``asyncio.wait_for``) is a cancellation
  of the wait: counted as one, not as a timeout, and nothing is allocated;
* *Prefix caching*: ``detach_pages`` leaves the row's recorded fences with
  the row, and a borrowing row's ``record_use`` does not cover the pages it
  borrows: cached pages freed behind the fence of the step that wrote them
  are handed out while a step that reads them still runs; behind the newest
  reader's fence they are not. The pool counts cached pages as allocated,
  and a queued ``admit`` does not make anything evict.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import pytest
from helpers import WAIT_S, EventFence, bounded, spin

from asyncpool import AsyncReqToTokenPool, KVPagePool, WrongThreadError, record_fence


def _in_other_thread(call: Callable[[], Any]) -> tuple[Any, BaseException | None]:
    """Run ``call`` in a new thread; return its result and what it raised."""
    out: dict[str, Any] = {"result": None, "error": None}

    def run() -> None:
        try:
            out["result"] = call()
        except BaseException as exc:  # handed back to the test
            out["error"] = exc

    th = threading.Thread(target=run, name="intruder")
    th.start()
    th.join(WAIT_S)
    assert not th.is_alive()
    return out["result"], out["error"]


def _snapshot(pool: AsyncReqToTokenPool) -> tuple[Any, ...]:
    stats = pool.stats(summaries=False)
    kv = pool.kv
    assert kv is not None
    return (
        stats,
        pool.available_size(),
        pool.pending_size(),
        kv.available_size(),
        kv.pending_size(),
        pool.closed,
        pool.released,
    )


FOREIGN_CALLS: dict[str, Callable[[AsyncReqToTokenPool, int], Any]] = {
    "try_admit": lambda pool, row: pool.try_admit(pages=1),
    "extend": lambda pool, row: pool.extend(row, 1),
    "extend_rows": lambda pool, row: pool.extend_rows([row], 1),
    "pages_of": lambda pool, row: pool.pages_of(row),
    "pages_of_rows": lambda pool, row: pool.pages_of_rows([row]),
    "trim_pages": lambda pool, row: pool.trim_pages([row], 0),
    "drop_pages": lambda pool, row: pool.drop_pages([row], 1),
    "detach_pages": lambda pool, row: pool.detach_pages(row),
    "force_release": lambda pool, row: pool.force_release(EventFence()),
    "check_invariants": lambda pool, row: pool.check_invariants(),
    "kv.check_invariants": lambda pool, row: pool.kv.check_invariants(),  # type: ignore[union-attr]
    "kv.alloc": lambda pool, row: pool.kv.alloc(1),  # type: ignore[union-attr]
    "kv.reclaim": lambda pool, row: pool.kv.reclaim(),  # type: ignore[union-attr]
    "kv.free": lambda pool, row: pool.kv.free([1]),  # type: ignore[union-attr]
    "admit": lambda pool, row: asyncio.run(pool.admit(pages=1)),
    "close": lambda pool, row: asyncio.run(pool.close()),
    "release_memory": lambda pool, row: asyncio.run(pool.release_memory()),
    "resume_memory": lambda pool, row: asyncio.run(pool.resume_memory()),
    "drain": lambda pool, row: asyncio.run(pool.drain()),
}


@pytest.mark.parametrize("name", sorted(FOREIGN_CALLS))
async def test_admission_and_lifecycle_calls_from_a_foreign_thread_are_refused(name: str) -> None:
    async with bounded(), AsyncReqToTokenPool(4, 8, kv=KVPagePool(9, 4)) as pool:
        grant = await pool.admit(pages=1)  # binds the pool to this thread
        before = _snapshot(pool)
        _, error = _in_other_thread(lambda: FOREIGN_CALLS[name](pool, grant.row))
        assert isinstance(error, WrongThreadError), (name, error)
        assert "intruder" in str(error)
        assert _snapshot(pool) == before
        pool.check_invariants()  # and from the owner's thread it still answers
        pool.free([grant.row])


async def test_the_scrape_reads_answer_from_a_foreign_thread() -> None:
    async with bounded(), AsyncReqToTokenPool(4, 8, kv=KVPagePool(9, 4)) as pool:
        grant = await pool.admit(pages=2)
        kv = pool.kv
        assert kv is not None
        reads = {
            "stats": lambda: pool.stats().allocated,
            "available_size": pool.available_size,
            "pending_size": pool.pending_size,
            "allocated_size": pool.allocated_size,
            "quarantined_size": pool.quarantined_size,
            "waiting": pool.waiting,
            "generation": lambda: pool.generation(grant.row),
            "kv.slots": lambda: kv.slots([1]).tolist(),
            "kv.available_size": kv.available_size,
            "kv.pending_size": kv.pending_size,
            "kv.allocated_size": kv.allocated_size,
            "kv.quarantined_size": kv.quarantined_size,
            "kv.stats": lambda: kv.stats().allocated,
        }
        answers = {}
        for name, read in reads.items():
            answers[name], error = _in_other_thread(read)
            assert error is None, (name, error)
        assert answers == {
            "stats": 1,
            "available_size": 2,
            "pending_size": 0,
            "allocated_size": 1,
            "quarantined_size": 0,
            "waiting": 0,
            "generation": pool.generation(grant.row),
            "kv.slots": [4, 5, 6, 7],
            "kv.available_size": 6,
            "kv.pending_size": 0,
            "kv.allocated_size": 2,
            "kv.quarantined_size": 0,
            "kv.stats": 2,
        }
        pool.free([grant.row])


async def test_kv_reclaim_returns_the_pages_only(kit: Any) -> None:
    async with bounded(), AsyncReqToTokenPool(4, 8, kv=KVPagePool(9, 4)) as pool:
        kv = pool.kv
        assert kv is not None
        grant = await pool.admit(pages=2)
        stream = kit.stream()
        gate = kit.gate(stream)
        fence = stream.record()
        assert pool.free([grant.row], fence=fence) == 0
        assert (pool.pending_size(), kv.pending_size()) == (1, 2)
        gate.open()
        # Waited in the loop's own thread, so the pool's wake-up (queued by
        # the fence) cannot run before the reclaim below.
        fence.synchronize()
        assert kv.reclaim() == 2
        assert (pool.pending_size(), kv.pending_size()) == (1, 0)  # the row still waits
        assert pool.reclaim() == 1
        assert pool.pending_size() == 0


@pytest.mark.parametrize("call", ["alloc", "admit"])
async def test_a_timeout_from_outside_is_a_cancellation(call: str) -> None:
    async with bounded(), AsyncReqToTokenPool(2, 8, kv=KVPagePool(3, 4)) as pool:
        held = await pool.admit(pages=2)  # the only row and every page
        wait = pool.alloc(1) if call == "alloc" else pool.admit(pages=1)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(wait, 0.01)
        await spin()
        stats = pool.stats(summaries=False)
        assert (stats.timeouts, stats.cancellations, stats.waiters) == (0, 1, 0)
        assert stats.allocated == 1
        pool.free([held.row])
        assert pool.available_size() == 1


async def test_detach_pages_leaves_the_rows_fences_with_the_row(kit: Any) -> None:
    async with bounded(), AsyncReqToTokenPool(4, 8, kv=KVPagePool(3, 4)) as pool:
        kv = pool.kv
        assert kv is not None
        forward = kit.stream("forward")
        grant = await pool.admit(pages=2)
        gate = kit.gate(forward)  # the row's step, still running
        pool.record_use([grant.row], record_fence(forward))
        pages = pool.detach_pages(grant.row)
        assert kv.free(pages) == 2  # free at once: the caller passes the fences
        assert pool.free([grant.row]) == 0  # the row itself still waits
        assert (pool.pending_size(), kv.pending_size()) == (1, 0)
        gate.open()
        await pool.drain()


@pytest.mark.parametrize("behind", ["write", "newest read"])
async def test_borrowed_pages_are_covered_only_by_the_fence_the_cache_passes(
    kit: Any, behind: str
) -> None:
    async with bounded(), AsyncReqToTokenPool(4, 16, kv=KVPagePool(3, 4)) as pool:
        kv = pool.kv
        assert kv is not None
        forward = kit.stream("forward")
        a = await pool.admit(pages=2)  # the request whose step writes the prefix
        written = record_fence(forward)
        pool.record_use([a.row], written)
        written.synchronize()
        cached = pool.detach_pages(a.row)  # the cache takes its pages
        pool.free([a.row])
        assert pool.stats().pages_allocated == 2  # cached pages count as allocated
        b = await pool.admit(pages=0)  # a hit: b borrows them
        pool.req_to_token[b.row, :8] = kv.slots(cached).to(pool.req_to_token.dtype)
        gate = kit.gate(forward)  # b's step, reading the cached pages
        read = record_fence(forward)
        pool.record_use([b.row], read)
        queued = asyncio.ensure_future(pool.admit(pages=1))
        await spin()
        assert not queued.done()  # a queued admit does not make the cache evict
        kv.free(cached, fence=written if behind == "write" else read)
        if behind == "write":
            async with bounded(WAIT_S):
                g = await queued
            assert not read.query()  # handed out while b's step still reads it
        else:
            await spin()
            assert not queued.done()  # waits for b's step
            gate.open()
            async with bounded(WAIT_S):
                g = await queued
        gate.open()
        assert g.pages.tolist()[0] in cached.tolist()
        pool.free([b.row, g.row])
        await pool.drain()


async def test_a_transfer_handle_is_polled_from_another_thread_and_never_synchronized() -> None:
    """docs/cuda.md, *A transfer handle as a fence*: ``query()`` is asked from
    the watcher's thread (so it must be thread-safe), ``synchronize()`` never
    (the watcher and ``drain`` poll a fence of unknown origin)."""

    class Handle:
        def __init__(self) -> None:
            self.landed = threading.Event()
            self.asked_from: set[int] = set()

        def query(self) -> bool:
            self.asked_from.add(threading.get_ident())
            return self.landed.is_set()

        def synchronize(self) -> None:
            raise AssertionError("the pool called synchronize() on a transfer handle")

    pool = AsyncReqToTokenPool(2, 8, kv=KVPagePool(5, 4))
    grant = await pool.admit(pages=2)
    handle = Handle()
    pool.free([grant.row], fence=handle)  # an abort while the KV is arriving
    waiter = asyncio.ensure_future(pool.admit(pages=4))
    await spin()
    assert pool.waiting() == 1
    handle.landed.set()
    async with bounded():
        again = await waiter
    assert handle.asked_from - {threading.get_ident()}, "never asked from the watcher"
    pool.free([again.row], fence=handle)
    async with bounded():
        await pool.drain()
    await pool.close()
