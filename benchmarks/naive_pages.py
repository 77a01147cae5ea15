"""A seed-style KV page allocator: the peer the page benchmark always has.

Written in the manner of SGLang's ``PagedTokenToKVPoolAllocator`` (the
allocator tokenspeed's seed pairs with its ``ReqToTokenPool``), so the page
benchmark has a reference even where neither SGLang nor vLLM is installed:

* the free list is a 1-D ``torch.int64`` tensor of page ids, ``1 ..
  num_pages - 1`` (page 0 is reserved padding);
* ``alloc(n)`` slices it twice (``free_pages[:n]`` handed out as a view,
  ``free_pages[n:]`` kept): two torch ops whatever ``n`` is;
* ``free(pages)`` puts the pages back in front with ``torch.cat``, a copy of
  the whole free list per call, so freed pages are reused first (LIFO), as
  SGLang's unsorted path does.

It takes and returns page ids, like ``asyncpool.KVPagePool``, rather than
SGLang's token slot ids, so it leaves out SGLang's per-call
``torch.unique(slots // page_size)`` in ``free`` and the page-to-slot
expansion in ``alloc``: it is a lower bound on that design's cost. Like the
seed, it validates nothing (a double free duplicates a page in the free
list) and has no fences: a page is reusable the moment it is freed.
"""

from __future__ import annotations

import torch

__all__ = ["NaivePagePool"]


class NaivePagePool:
    """Torch free-list tensor, sliced on alloc, concatenated on free."""

    def __init__(self, num_pages: int, page_size: int, device: str = "cpu") -> None:
        if num_pages < 2:
            raise ValueError(f"num_pages must be at least 2 (page 0 is padding), got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.device = device
        self.free_pages: torch.Tensor = torch.empty(0, dtype=torch.int64)
        self.clear()

    def available_size(self) -> int:
        return len(self.free_pages)

    def alloc(self, n: int) -> torch.Tensor | None:
        if n > len(self.free_pages):
            return None
        out = self.free_pages[:n]
        self.free_pages = self.free_pages[n:]
        return out

    def free(self, pages: torch.Tensor) -> None:
        if pages.numel() == 0:
            return
        self.free_pages = torch.cat((pages, self.free_pages))

    def clear(self) -> None:
        self.free_pages = torch.arange(1, self.num_pages, dtype=torch.int64, device=self.device)
