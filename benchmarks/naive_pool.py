"""A seed-style request-slot pool: the reference the benchmarks beat.

This reproduces what ``shared/seed/req_to_token_pool.py`` does, without its
tokenspeed imports, so the benchmarks measure asyncpool against the code it
replaces rather than against a straw man:

* the free list is a Python ``list``, and every ``alloc`` slices it twice
  (``free_slots[:n]`` and ``free_slots[n:]``), an O(size) copy per call;
* ``alloc`` zeroes ``verified_lens``, ``alloced_lens`` and
  ``alloced_lens_cpu`` for the selected rows with one list-indexed tensor
  write each (three torch ops per call, whatever ``n`` is);
* ``free`` extends the free list and zeroes the same three tensors one row
  at a time (three torch ops per row).

Like the seed, it does no validation (a double free corrupts the free list)
and has no fences: a row is reusable the moment it is freed, which is the
race asyncpool exists to close. Only ``pin_memory`` differs: the seed pins
``alloced_lens_cpu``, which needs CUDA, so here it is pinned only when CUDA
is available.
"""

from __future__ import annotations

import torch

__all__ = ["NaiveReqToTokenPool"]


class NaiveReqToTokenPool:
    """Seed-equivalent pool: list free list, per-row zeroing on free."""

    def __init__(self, size: int, max_context_len: int, device: str = "cpu") -> None:
        self.size = size
        self.max_context_len = max_context_len
        self.device = device
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int32, device=device)
        self.verified_lens = torch.zeros(size, dtype=torch.int32, device=device)
        self.alloced_lens = torch.zeros(size, dtype=torch.int32, device=device)
        self.alloced_lens_cpu = torch.zeros(
            size, dtype=torch.int32, pin_memory=torch.cuda.is_available()
        )
        # Slot 0 is padding and never handed out, as in the seed.
        self.free_slots: list[int] = list(range(size))[1:]

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, need_size: int) -> list[int] | None:
        if need_size > len(self.free_slots):
            return None
        select_index = self.free_slots[:need_size]
        self.free_slots = self.free_slots[need_size:]
        # The seed zeroes on alloc because a retracted request's row may still
        # be written by the forward step in flight (its admitted race).
        self.verified_lens[select_index] = 0
        self.alloced_lens[select_index] = 0
        self.alloced_lens_cpu[select_index] = 0
        return select_index

    def free(self, free_index: int | list[int]) -> None:
        free_indices = [free_index] if isinstance(free_index, int) else free_index
        self.free_slots.extend(free_indices)
        for index in free_indices:
            self.verified_lens[index] = 0
            self.alloced_lens[index] = 0
            self.alloced_lens_cpu[index] = 0

    def clear(self) -> None:
        self.free_slots = list(range(self.size))[1:]
        self.verified_lens.zero_()
        self.alloced_lens.zero_()
        self.alloced_lens_cpu.zero_()
