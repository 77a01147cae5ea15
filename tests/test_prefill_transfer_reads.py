"""The prefill side of a disaggregated deployment (docs/cuda.md, *The
prefill side: a transfer that reads the pages*).

Found by a trial that wrote a prefill server against the installed package
(trialPrefill): the docs named the transfer as a writer only, and a prefill
server's transfer engine reads the pages it ships. Pages handed to a new
request while the transfer reads them ship the new owner's KV (the trial's
variant that freed without the transfer's fence: 29-55 mismatched transfers
in 3,000 requests). The pool behaves as documented; these tests pin the
recipe the docs now give: the abort behind the step and the transfer, a
rejected request's pages kept without its row for a retry, and a hung
transfer made overdue and released by the operator once the engine has
confirmed it can no longer read.
"""

from __future__ import annotations

import asyncio
import threading

from helpers import bounded, page_ids, until

from asyncpool import AsyncReqToTokenPool, HostStream, KVPagePool, record_fence, wait_fence
from asyncpool.metrics import PoolCollector


class Read:
    """A transfer engine's read of a request's pages, settled by the test."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.state = "reading"  # reading | done | cancelled | broken
        self.lock = threading.Lock()

    def query(self) -> bool:
        with self.lock:
            if self.state == "broken":
                raise RuntimeError(f"{self.name}: peer state unknown")
            return self.state in ("done", "cancelled")

    def synchronize(self) -> None:
        if not self.query():
            raise AssertionError("synchronize() before the test settled the read")

    def cancel(self) -> bool:
        """The operator's cancel: True once the read can no longer happen."""
        with self.lock:
            if self.state == "reading":
                self.state = "cancelled"
            return self.state != "broken"

    def __repr__(self) -> str:
        return f"Read({self.name})"


def overdue_sample(collector: PoolCollector, family: str) -> float:
    (fam,) = [f for f in collector.collect() if f.name == family]
    (sample,) = fam.samples
    return sample.value


async def test_an_abort_mid_transfer_holds_the_pages_not_the_row() -> None:
    kv = KVPagePool(9, 4)
    pool = AsyncReqToTokenPool(3, 32, kv=kv)  # two rows, eight pages
    forward = HostStream(name="forward")
    try:
        grant = pool.try_admit(pages=8)
        assert grant is not None
        step = record_fence(forward)  # the prefill step that wrote the pages
        pool.record_use([grant.row], step)
        async with bounded():
            await wait_fence(step)  # the transfer starts once the step is done
        read = Read("req 1")
        pages = pool.detach_pages(grant.row, host=True)
        assert kv.free(pages, fence=[step, read]) == 0  # the client aborts
        assert pool.free([grant.row]) == 1  # the row waits for nothing
        assert pool.stats().pages_pending == 8
        waiter = asyncio.ensure_future(pool.admit(pages=8))
        try:
            await asyncio.sleep(0)
            assert not waiter.done()  # the transfer still reads every page
            read.state = "done"
            async with bounded():
                regrant = await waiter
        finally:
            waiter.cancel()
        assert sorted(page_ids(regrant.pages)) == sorted(page_ids(pages))
        pool.free([regrant.row])
        pool.check_invariants()
    finally:
        forward.close()
        await pool.close()


async def test_a_rejected_request_keeps_its_pages_and_gives_its_row_back() -> None:
    kv = KVPagePool(9, 4)
    pool = AsyncReqToTokenPool(2, 32, kv=kv)  # one row
    grant = pool.try_admit(pages=4)
    assert grant is not None
    first = Read("req 1 attempt 1")
    first.state = "done"  # shipped; the decode server answers "later"
    pages = pool.detach_pages(grant.row, host=True)
    pool.free([grant.row])
    other = pool.try_admit(pages=4)  # the row serves another request meanwhile
    assert other is not None and other.row == grant.row
    assert not set(page_ids(other.pages)) & set(page_ids(pages))
    retry = Read("req 1 attempt 2")  # a new wrapper for the retry
    assert kv.free(pages, fence=retry) == 0  # aborted while the retry reads
    assert pool.try_admit(pages=0) is None  # (no row: the other request's)
    pool.free([other.row])
    assert pool.try_admit(pages=8) is None  # the retry's pages are still read
    retry.state = "done"
    again = pool.try_admit(pages=8)
    assert again is not None
    pool.free([again.row])
    pool.check_invariants()
    await pool.close()


async def test_a_hung_transfer_turns_overdue_and_the_operator_releases_it() -> None:
    kv = KVPagePool(9, 4)
    pool = AsyncReqToTokenPool(3, 32, kv=kv, fence_timeout=0.01, name="prefill")
    collector = PoolCollector(pool)
    hung = Read("req 7")
    grant = pool.try_admit(pages=6)
    assert grant is not None
    # The server's deadline on the transfer passed: give the request up.
    assert kv.free(pool.detach_pages(grant.row, host=True), fence=hung) == 0
    pool.free([grant.row])
    await until(lambda: pool.stats().overdue_fences == 1)
    stats = pool.stats()
    assert stats.overdue_pages == 6 and stats.pages_pending == 6
    assert overdue_sample(collector, "asyncpool_overdue_fences") == 1
    assert overdue_sample(collector, "asyncpool_overdue_pages") == 6
    waiter = asyncio.ensure_future(pool.admit(pages=8))
    try:
        await asyncio.sleep(0)
        assert not waiter.done()
        # The operator's path: cancel each overdue transfer in the engine,
        # then release those it confirmed can no longer read.
        overdue = pool.overdue_fences()
        assert overdue == [hung]
        confirmed = [f for f in overdue if isinstance(f, Read) and f.cancel()]
        rows, released = pool.force_release(confirmed)
        assert (rows, released) in ((0, 0), (0, 6))  # (0, 0): the poller saw the cancel first
        async with bounded():
            regrant = await waiter
    finally:
        waiter.cancel()
    assert len(regrant.pages) == 8 and pool.stats().overdue_fences == 0
    pool.free([regrant.row])
    pool.check_invariants()
    await pool.close()


async def test_a_transfer_that_may_still_read_quarantines_only_its_pages() -> None:
    kv = KVPagePool(9, 4)
    pool = AsyncReqToTokenPool(3, 32, kv=kv)
    grant = pool.try_admit(pages=3)
    assert grant is not None
    broken = Read("req 9")
    broken.state = "broken"
    assert kv.free(pool.detach_pages(grant.row, host=True), fence=broken) == 0
    pool.free([grant.row])
    stats = pool.stats()
    assert stats.pages_quarantined == 3 and stats.quarantined == 0
    assert pool.available_size() == 2 and kv.available_size() == 5
    pool.check_invariants()
    await pool.close()
