"""Hypothesis stateful test of KVPagePool (and its PageLedger) against a model.

Same house pattern as ``test_ledger_stateful.py``: the machine owns fake
fences whose completion and faults it controls (ordered fences of up to
three streams, and loose fences of unknown origin), rules are synchronous,
and the model is deliberately naive: a page is FREE, ALLOCATED, PENDING
(with the fences it waits for: the newest per stream, each loose one once)
or QUARANTINED. The free ring is a list of blocks: one-page blocks for pages
freed at once (exact order) and one block per reclaim (any order inside), so
FIFO reuse is checked exactly where the contract fixes the order.

Two machines run: one with the ledger's defaults (calls of a few pages take
the Python-int path), one with that path switched off, so every call takes
the vectorised numpy path.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from helpers import FakeFence, FakeStream
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from test_kv_pages import snapshot
from test_ledger_stateful import LooseFence

import asyncpool.kv_pages as kv_pages
from asyncpool import DoubleFreeError, FenceError, InvalidSlotError, KVPagePool

NUM_PAGES = 24
MAX_STREAMS = 3

# Faults log at ERROR: quiet, for these tests only (conftest).
pytestmark = pytest.mark.usefixtures("quiet_asyncpool_logs")

AnyFence = FakeFence | LooseFence

FORMS = ["tensor", "int32-tensor", "ndarray", "list", "numpy-scalars"]


def as_form(pages: list[int], form: str) -> Any:
    if form == "tensor":
        return torch.tensor(pages, dtype=torch.int64)
    if form == "int32-tensor":
        return torch.tensor(pages, dtype=torch.int32)
    if form == "ndarray":
        return np.array(pages, dtype=np.int64)
    if form == "numpy-scalars":
        return [np.int64(p) for p in pages]
    return list(pages)


def newest(fences: list[AnyFence]) -> list[AnyFence]:
    by_stream: dict[int, FakeFence] = {}
    loose: list[LooseFence] = []
    for f in fences:
        if isinstance(f, FakeFence):
            cur = by_stream.get(f.stream_key)
            if cur is None or cur.seq < f.seq:
                by_stream[f.stream_key] = f
        elif not any(g is f for g in loose):
            loose.append(f)
    return [*by_stream.values(), *loose]


class PageMachine(RuleBasedStateMachine):
    fences = Bundle("fences")
    tiny = kv_pages._TINY

    def __init__(self) -> None:
        super().__init__()
        self._saved_tiny = kv_pages._TINY
        kv_pages._TINY = self.tiny
        self.kv = KVPagePool(NUM_PAGES, 4)
        self.streams: list[FakeStream] = [FakeStream()]
        self.loose: list[LooseFence] = []
        # model
        self.blocks: list[set[int]] = [{p} for p in range(1, NUM_PAGES)]
        self.allocated: set[int] = set()
        self.pending: dict[int, list[AnyFence]] = {}
        self.quarantined: set[int] = set()
        self.taken = 0  # pages ever taken from the ring (put-backs included)
        self.allocs = 0
        self.deferred = 0

    def teardown(self) -> None:
        kv_pages._TINY = self._saved_tiny

    # ------------------------------------------------------------ model helpers

    def _free_count(self) -> int:
        return sum(len(b) for b in self.blocks)

    def _consume(self, pages: list[int]) -> None:
        i = 0
        while i < len(pages):
            block = self.blocks[0]
            chunk = pages[i : i + len(block)]
            assert set(chunk) <= block, f"FIFO broken: took {pages}, head block {block}"
            if len(chunk) == len(block):
                self.blocks.pop(0)
            else:
                block.difference_update(chunk)
            i += len(chunk)

    def _model_reclaim(self) -> int:
        freed: set[int] = set()
        for p, waits in list(self.pending.items()):
            statuses = [f.status for f in waits]
            if all(s == "done" for s in statuses):
                freed.add(p)
            elif "faulted" in statuses:
                if "pending" not in statuses or self.kv.ledger.state_of(p) == "quarantined":
                    # Certain once nothing else is open; otherwise it depends
                    # on which fence the batch sat behind (both are legal).
                    self.quarantined.add(p)
                else:
                    continue
            else:
                continue
            del self.pending[p]
        if freed:
            self.blocks.append(freed)
        return len(freed)

    # ------------------------------------------------------------ fences

    @initialize(target=fences)
    def first_fence(self) -> FakeFence:
        return self.streams[0].record()

    @rule(target=fences, s=st.integers(0, MAX_STREAMS - 1))
    def record(self, s: int) -> FakeFence:
        if s >= len(self.streams):
            self.streams.append(FakeStream())
            s = len(self.streams) - 1
        return self.streams[s].record()

    @rule(target=fences)
    def record_loose(self) -> LooseFence:
        f = LooseFence(len(self.loose))
        self.loose.append(f)
        return f

    @rule(s=st.integers(0, MAX_STREAMS - 1), k=st.integers(1, 2))
    def complete(self, s: int, k: int) -> None:
        stream = self.streams[s % len(self.streams)]
        stream.complete(min(stream.seq, stream.done + k))

    @precondition(lambda self: any(f.status == "pending" for f in self.loose))
    @rule(data=st.data(), fault=st.booleans())
    def settle_loose(self, data: st.DataObject, fault: bool) -> None:
        f = data.draw(st.sampled_from([f for f in self.loose if f.status == "pending"]))
        f.status = "faulted" if fault and data.draw(st.integers(0, 3)) == 0 else "done"

    @rule(s=st.integers(0, MAX_STREAMS - 1), roll=st.sampled_from(range(4)))
    def fault(self, s: int, roll: int) -> None:
        if roll == 3:
            self.streams[s % len(self.streams)].fault()

    # ------------------------------------------------------------ pages

    @rule(n=st.integers(1, NUM_PAGES - 1))
    def alloc(self, n: int) -> None:
        short = n > self._free_count() and bool(self.pending)  # alloc reclaims first
        pages = self.kv.alloc(n)
        if short:
            self._model_reclaim()  # after: it reads which of two legal outcomes happened
        if n > self._free_count():
            assert pages is None
            return
        assert pages is not None and pages.dtype == torch.int64 and len(pages) == n
        got = pages.tolist()
        self._consume(got)
        self.allocated.update(got)
        self.taken += n
        self.allocs += n

    @precondition(lambda self: self._free_count() > 0)
    @rule(data=st.data())
    def take_and_put_back(self, data: st.DataObject) -> None:
        n = data.draw(st.integers(1, self._free_count()))
        led = self.kv.ledger
        pages = led.take(n)
        assert pages is not None
        got = pages.tolist()
        self._consume(got)
        self.taken += n
        order = data.draw(st.permutations(got))
        led.put_back(as_form(list(order), data.draw(st.sampled_from(FORMS))))
        self.blocks[:0] = [{p} for p in order]

    @precondition(lambda self: self.allocated)
    @rule(data=st.data(), fence=st.none() | fences, form=st.sampled_from(FORMS))
    def free(self, data: st.DataObject, fence: AnyFence | None, form: str) -> None:
        pages = self._draw_allocated(data)
        self._free(pages, [fence] if fence is not None else [], form)

    @precondition(lambda self: self.allocated)
    @rule(data=st.data(), a=fences, b=fences, form=st.sampled_from(FORMS))
    def free_behind_two(self, data: st.DataObject, a: AnyFence, b: AnyFence, form: str) -> None:
        """``free(fence=a, after=...)``: one batch waiting on two fences."""
        pages = self._draw_allocated(data)
        self._free(pages, [a, b], form)

    def _draw_allocated(self, data: st.DataObject) -> list[int]:
        pool = st.sampled_from(sorted(self.allocated))
        return data.draw(st.lists(pool, min_size=1, unique=True))

    def _free(self, pages: list[int], fences: list[AnyFence], form: str) -> None:
        arg = as_form(pages, form)
        if len(fences) == 1:
            immediate = self.kv.free(arg, fence=fences[0])
        elif fences:
            immediate = self.kv.ledger.free(arg, fences)
        else:
            immediate = self.kv.free(arg)
        waits = newest(fences)
        statuses = [f.status for f in waits]
        self.allocated.difference_update(pages)
        if "faulted" in statuses:
            self.quarantined.update(pages)
            assert immediate == 0
        elif all(s == "done" for s in statuses):
            self.blocks.extend({p} for p in pages)
            assert immediate == len(pages)
        else:
            for p in pages:
                self.pending[p] = waits
            self.deferred += len(pages)
            assert immediate == 0

    @rule()
    def reclaim(self) -> None:
        # The real reclaim first: for a page behind an open fence and a
        # faulted one, the model reads which of the two legal outcomes the
        # ledger chose, and that choice is made by this reclaim.
        got = self.kv.reclaim()
        assert got == self._model_reclaim()

    @rule()
    def available_size(self) -> None:
        # A page pool of its own reclaims first (only while pages are pending).
        pending = self.kv.ledger.pending
        got = self.kv.available_size()
        if pending:
            self._model_reclaim()
        assert got == sum(len(b) for b in self.blocks)

    @rule()
    def clear(self) -> None:
        self.kv.clear()
        self.blocks.append(set(self.allocated))
        self.allocated.clear()
        self._model_reclaim()
        self.blocks = [b for b in self.blocks if b]

    @rule(data=st.data(), form=st.sampled_from(FORMS), with_fence=st.booleans())
    def bad_free(self, data: st.DataObject, form: str, with_fence: bool) -> None:
        """A free the model knows is bad raises the right error and changes nothing."""
        choices = [p for p in range(-2, NUM_PAGES + 2) if p not in self.allocated]
        if self.allocated:
            choices.append(-100)  # marker: a duplicate of an allocated page
        pick = data.draw(st.sampled_from(choices))
        good = sorted(self.allocated)[: data.draw(st.integers(0, 3))]
        if pick == -100:
            p = data.draw(st.sampled_from(sorted(self.allocated)))
            expect = InvalidSlotError
            pages = [*good, p, p] if p not in good else [*good, p]
        else:
            free_or_pending = 0 < pick < NUM_PAGES and (
                pick in self.pending or any(pick in b for b in self.blocks)
            )
            never = free_or_pending and pick not in self.pending and pick > self.taken
            expect = DoubleFreeError if free_or_pending and not never else InvalidSlotError
            pages = [*good, pick]
        before = snapshot(self.kv)
        fence = self.streams[0].record() if with_fence else None
        try:
            self.kv.free(as_form(pages, form), fence=fence)
        except InvalidSlotError as exc:
            assert type(exc) is expect, (pages, exc)
        else:
            raise AssertionError(f"free({pages}) did not raise")
        assert snapshot(self.kv) == before

    # ------------------------------------------------------------ invariants

    @invariant()
    def ledger_invariants_hold(self) -> None:
        self.kv.check_invariants()

    @invariant()
    def states_match_the_model(self) -> None:
        led = self.kv.ledger
        free = set().union(*self.blocks) if self.blocks else set()
        for p in range(1, NUM_PAGES):
            want = (
                "free"
                if p in free
                else "allocated"
                if p in self.allocated
                else "pending"
                if p in self.pending
                else "quarantined"
                if p in self.quarantined
                else None
            )
            assert want is not None, f"model lost page {p}"
            assert led.state_of(p) == want, (p, led.state_of(p), want)
        st_ = self.kv.stats()
        assert st_.free == len(free) == led.free_count  # (available_size reclaims: a rule)
        assert st_.pending == len(self.pending) == self.kv.pending_size()
        assert st_.quarantined == len(self.quarantined)
        assert st_.allocated == len(self.allocated)
        assert st_.allocs == self.allocs
        assert st_.deferred_frees == self.deferred
        if self.quarantined:
            assert isinstance(led.last_fence_error, FenceError)

    @invariant()
    def fifo_order_matches_the_model(self) -> None:
        led = self.kv.ledger
        cap = led.capacity
        order = [int(led._ring[(led._head + i) % cap]) for i in range(led.free_count)]
        i = 0
        for block in self.blocks:
            assert set(order[i : i + len(block)]) == block, (order, self.blocks)
            i += len(block)
        assert i == len(order)


class VectorisedPageMachine(PageMachine):
    tiny = 0  # every call takes the numpy path


_SETTINGS = dict(
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
PageMachine.TestCase.settings = settings(max_examples=500, **_SETTINGS)  # type: ignore[arg-type]
VectorisedPageMachine.TestCase.settings = settings(max_examples=150, **_SETTINGS)  # type: ignore[arg-type]
TestPageMachine = PageMachine.TestCase
TestVectorisedPageMachine = VectorisedPageMachine.TestCase
