"""A request's memory as the scheduler sees it: one row and the KV pages it lists.

The scheduler is written against the pool's second-stage API::

    grant = await memory.admit(pages=n, priority=p)   # a row and n pages, together
    row = await memory.alloc_row(priority=p)          # row-first: a row alone ...
    pages = memory.extend(row, k)                     # ... pages later; never waits
    memory.record_use(rows, fence)                    # once per step
    memory.free(rows, fence=transfer)                 # rows and their pages, fenced

:class:`Memory` maps those calls onto ``AsyncReqToTokenPool(..., kv=...)``
when the pool has ``admit`` (atomic admission in the pool: one waiter queue
over rows and pages). Until then it is an adapter over a row pool and a page
pool it holds itself, and it emulates atomic admission: a FIFO queue (within
priority) that :meth:`Memory.pump` grants when a row and the pages are both
free, called by the scheduler after its frees and once per iteration.

Thread rules: loop-affine, like the pool; call everything from the loop's
thread.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from asyncpool import AsyncReqToTokenPool, KVPagePool

__all__ = ["AllOf", "Grant", "Memory", "make_page_pool"]


class Grant(NamedTuple):
    """What an admission hands over: one row and its first pages."""

    row: int
    pages: torch.Tensor


class AllOf:
    """A fence that completes when every fence it holds has completed.

    Used by the adapter to free pages behind both the row's newest recorded
    use and an explicit fence (a transfer); the pool sees a fence of unknown
    origin.
    """

    __slots__ = ("fences",)

    def __init__(self, fences: Sequence[Any]) -> None:
        self.fences = tuple(fences)

    def query(self) -> bool:
        return all(f.query() for f in self.fences)

    def synchronize(self) -> None:
        for f in self.fences:
            f.synchronize()


def make_page_pool(
    num_pages: int, page_size: int, device: str, reclaim: str = "auto"
) -> KVPagePool:
    """The KV page pool: ``num_pages`` pages (page 0 is padding) of ``page_size`` slots."""
    return KVPagePool(num_pages, page_size, device=device, reclaim=reclaim)


class Memory:
    """Rows and pages for the scheduler; see the module docstring."""

    def __init__(self, pool: AsyncReqToTokenPool, kv: KVPagePool) -> None:
        self.pool = pool
        self.kv = kv
        self.native = hasattr(pool, "admit")
        self.page_size: int = kv.page_size
        self.page_capacity: int = kv.num_pages - 1
        # Adapter state (unused when native).
        self._pages: dict[int, list[torch.Tensor]] = {}
        self._uses: dict[int, Any] = {}
        self._waiters: list[tuple[int, int, int, asyncio.Future[Grant]]] = []
        self._seq = itertools.count()

    # -- admission -------------------------------------------------------------

    async def admit(self, pages: int, *, priority: int = 0) -> Grant:
        """One row and ``pages`` pages, granted together (FIFO within priority)."""
        if self.native:
            grant = await self.pool.admit(pages=pages, priority=priority)  # type: ignore[attr-defined,unused-ignore]
            return Grant(int(grant.row), grant.pages)
        if not self._waiters:
            got = self._try_admit(pages)
            if got is not None:
                return got
        fut: asyncio.Future[Grant] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (priority, next(self._seq), pages, fut))
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                g = fut.result()
                self.free([g.row])  # granted, then cancelled: give both back
            raise

    def try_admit(self, pages: int) -> Grant | None:
        """A row and ``pages`` pages now, or None (also while admissions queue)."""
        if self.native:
            grant = self.pool.try_admit(pages=pages)  # type: ignore[attr-defined,unused-ignore]
            return None if grant is None else Grant(int(grant.row), grant.pages)
        if any(not w[3].done() for w in self._waiters):
            return None
        return self._try_admit(pages)

    def _try_admit(self, pages: int) -> Grant | None:
        if self.pool.available_size() < 1 or self.kv.available_size() < pages:
            self.kv.reclaim()
            if self.pool.available_size() < 1 or self.kv.available_size() < pages:
                return None
        rows = self.pool.try_alloc(1)
        if rows is None:
            return None
        got = self.kv.alloc(pages)
        if got is None:
            self.pool.free(rows)
            return None
        self._pages[rows[0]] = [got]
        return Grant(rows[0], got)

    def pump(self) -> None:
        """Adapter only: grant queued admissions that now fit, head first."""
        if self.native:
            return
        waiters = self._waiters
        while waiters:
            _, _, pages, fut = waiters[0]
            if fut.done():
                heapq.heappop(waiters)
                continue
            got = self._try_admit(pages)
            if got is None:
                return  # the head blocks those behind it
            heapq.heappop(waiters)
            fut.set_result(got)

    def waiting(self) -> int:
        """Admissions queued in the pool (rows and pages) or in the adapter."""
        return self.pool.waiting() + sum(not w[3].done() for w in self._waiters)

    async def alloc_row(self, *, priority: int = 0) -> int:
        """Row-first admission: a row alone; its pages come from :meth:`extend`."""
        rows = await self.pool.alloc(1, priority=priority)
        if not self.native:
            self._pages[rows[0]] = []
        return rows[0]

    # -- pages of a row --------------------------------------------------------

    def extend(self, row: int, k: int) -> torch.Tensor | None:
        """``k`` more pages for ``row``, or None when short; never waits."""
        if self.native:
            got: torch.Tensor | None = self.pool.extend(row, k)  # type: ignore[attr-defined,unused-ignore]
            return got
        got = self.kv.alloc(k)
        if got is not None:
            self._pages[row].append(got)
        return got

    def record_use(self, rows: list[int], fence: Any) -> None:
        """``rows`` (and their pages) are touched by work ending with ``fence``."""
        self.pool.record_use(rows, fence)
        if not self.native:
            uses = self._uses
            for row in rows:
                uses[row] = fence

    def free(self, rows: list[int], *, fence: Any = None) -> None:
        """Free ``rows`` and their pages behind each row's newest use and ``fence``."""
        if self.native:
            self.pool.free(rows, fence=fence)
            return
        self.pool.free(rows, fence=fence)
        for row in rows:
            use = self._uses.pop(row, None)
            fences = [f for f in (use, fence) if f is not None and not f.query()]
            held = None if not fences else fences[0] if len(fences) == 1 else AllOf(fences)
            pages = self._pages.pop(row)
            if not pages:
                continue
            allp = pages[0] if len(pages) == 1 else torch.cat(pages)
            self.kv.free(allp, fence=held)
        self.pump()

    # -- figures ---------------------------------------------------------------

    def page_counts(self) -> tuple[int, int, int]:
        """(allocated, pending behind a fence, free) pages."""
        if not self.native:
            self.kv.reclaim()  # nobody else reclaims the adapter's pages
        free = self.kv.available_size()
        pending = self.kv.pending_size()
        return self.page_capacity - free - pending, pending, free

    def deferred_pages(self) -> int:
        """Pages whose free waited behind a fence, so far."""
        return int(self.kv.stats().deferred_frees)
