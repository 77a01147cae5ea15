"""The page reuse race, caught: a write still in flight into an aborted
request's pages lands in the next owner's pages unless the free waits.

A gated :class:`HostStream` plays the forward stream (or a KV transfer
engine) that still writes request A's KV through A's token slots when the
scheduler aborts A. Request B then allocates pages and writes its own KV
through its slots. With page deferral switched off (``free`` without the
fence) B is handed A's pages at once and the late write corrupts them; with
it (``after=stream`` or ``fence=`` a transfer handle) B gets no page before
the write has landed, then exactly A's pages, and never a corrupted slot.
"""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import Streams

from asyncpool import KVPagePool

PAGE = 4


class TransferHandle:
    """A transfer engine's handle: only ``query()``/``synchronize()``."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def query(self) -> bool:
        return self.event.is_set()

    def synchronize(self) -> None:
        self.event.wait(30)


def run_once(kit: Streams, *, protect: bool, n_pages: int, via: str) -> int:
    """One abort-and-reuse; returns how many of B's slots were corrupted."""
    kv = KVPagePool(n_pages + 1, PAGE)  # no slack: B can only get A's pages
    cache = torch.zeros((n_pages + 1) * PAGE, dtype=torch.int64)
    stream = kit.stream("kv-writer")
    gate = kit.gate(stream)  # the write is still in flight

    a = kv.alloc(n_pages)
    assert a is not None
    slots_a = kv.slots(a)
    stream.launch(cache.index_fill_, 0, slots_a, 1)  # A's KV, written late
    handle = TransferHandle()
    stream.launch(handle.event.set)

    # The scheduler aborts A while its write is in flight.
    if not protect:
        kv.free(a)  # deferral off: the bug every engine ships
    elif via == "after":
        assert kv.free(a, after=stream) == 0
    else:
        assert kv.free(a, fence=handle) == 0

    b = kv.alloc(n_pages)
    if protect:
        # Not handed out before the write lands ...
        assert b is None and kv.pending_size() == n_pages
        gate.open()
        stream.synchronize()
        # ... and handed out right after, the very same pages.
        b = kv.alloc(n_pages)
        assert b is not None and sorted(b.tolist()) == sorted(a.tolist())
    assert b is not None
    slots_b = kv.slots(b)
    cache[slots_b] = 2  # B's prefill writes its KV
    gate.open()
    stream.synchronize()
    kv.check_invariants()
    return int((cache[slots_b] != 2).sum())


@pytest.mark.parametrize("via", ["after", "transfer-handle"])
@pytest.mark.parametrize("n_pages", [3, 64])  # the Python-int path and the numpy path
def test_unfenced_page_free_corrupts_the_next_owner(kit, via, n_pages):
    corrupted = run_once(kit, protect=False, n_pages=n_pages, via=via)
    assert corrupted == n_pages * PAGE  # every slot of B overwritten by A's late write


@pytest.mark.parametrize("via", ["after", "transfer-handle"])
@pytest.mark.parametrize("n_pages", [3, 64])
def test_fenced_page_free_never_corrupts(kit, via, n_pages):
    for _ in range(20):
        assert run_once(kit, protect=True, n_pages=n_pages, via=via) == 0
