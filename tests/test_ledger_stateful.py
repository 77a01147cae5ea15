"""Hypothesis stateful test of SlotLedger against a small reference model.

The machine owns fake fences whose completion and faults it controls: ordered
fences (``stream_key``/``seq``, completing in order per stream) and fences of
unknown origin (no ``stream_key``, completing in any order). Rules are
synchronous (hypothesis#4107); the ledger has no event loop anyway.

The model is deliberately naive: a row is FREE, ALLOCATED, PENDING (with the
set of fences it waits for: the newest per stream among its recorded uses
and the free's fence, plus every unordered one) or QUARANTINED. The free queue
is a list of blocks: one-row blocks for rows freed at once (exact order) and
one block per ``reclaim()`` (the rows it released, in any order), so FIFO
reuse is checked exactly where the contract fixes the order.
"""

from __future__ import annotations

import pytest
from helpers import FakeFence, FakeStream, ledger_snapshot
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

from asyncpool import DoubleFreeError, FenceError, InvalidSlotError
from asyncpool.ledger import SlotLedger

SIZE = 9
MAX_STREAMS = 3

# Faults log at ERROR: quiet, for these tests only (conftest).
pytestmark = pytest.mark.usefixtures("quiet_asyncpool_logs")


class LooseFence:
    """A fence of unknown origin: no ``stream_key``; the machine settles it."""

    def __init__(self, ident: int) -> None:
        self.ident = ident
        self.status = "pending"

    def __repr__(self) -> str:
        return f"<LooseFence {self.ident} {self.status}>"

    def query(self) -> bool:
        if self.status == "faulted":
            raise FenceError(f"loose fence {self.ident} faulted")
        return self.status == "done"

    def synchronize(self) -> None:  # pragma: no cover - the ledger never blocks
        raise AssertionError("the ledger must not block on a fence")


def status(f: FakeFence | LooseFence) -> str:
    return f.status


class LedgerMachine(RuleBasedStateMachine):
    fences = Bundle("fences")

    def __init__(self) -> None:
        super().__init__()
        self.led = SlotLedger(SIZE, on_reset=self._on_reset)
        self.streams: list[FakeStream] = [FakeStream()]
        self.loose: list[LooseFence] = []
        # model
        self.blocks: list[set[int]] = [{r} for r in range(1, SIZE)]
        self.allocated: set[int] = set()
        self.pending: dict[int, list[FakeFence | LooseFence]] = {}
        self.quarantined: set[int] = set()
        self.uses: dict[int, list[FakeFence | LooseFence]] = {}
        self.gen = [0] * SIZE  # generation tags, as the ledger should have them
        self.handed_out = 0
        self.allocs = 0
        self.dirty: set[int] = set()

    # ------------------------------------------------------------ model helpers

    def _on_reset(self, rows: list[int]) -> None:
        free = set().union(*self.blocks) if self.blocks else set()
        assert set(rows) <= free, "reset handed rows that are not free"
        self.dirty.difference_update(rows)

    def _free_count(self) -> int:
        return sum(len(b) for b in self.blocks)

    def _consume(self, rows: list[int]) -> None:
        """The rows handed out must be the head of the FIFO, block by block."""
        i = 0
        while i < len(rows):
            block = self.blocks[0]
            chunk = rows[i : i + len(block)]
            assert set(chunk) <= block, f"FIFO broken: took {rows}, head block {block}"
            if len(chunk) == len(block):
                self.blocks.pop(0)
            else:
                block.difference_update(chunk)
            i += len(chunk)

    @staticmethod
    def _newest(fences: list[FakeFence | LooseFence]) -> list[FakeFence | LooseFence]:
        newest: dict[int, FakeFence] = {}
        loose: list[LooseFence] = []
        for f in fences:
            if isinstance(f, FakeFence):
                cur = newest.get(f.stream_key)
                if cur is None or cur.seq < f.seq:
                    newest[f.stream_key] = f
            elif not any(g is f for g in loose):
                loose.append(f)
        return [*newest.values(), *loose]

    def _draw_rows(self, data, pool: set[int]) -> list[int]:
        return data.draw(st.lists(st.sampled_from(sorted(pool)), min_size=1, unique=True))

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
    def settle_loose(self, data, fault: bool) -> None:
        f = data.draw(st.sampled_from([f for f in self.loose if f.status == "pending"]))
        # Faults are rarer than completions.
        f.status = "faulted" if fault and data.draw(st.integers(0, 3)) == 0 else "done"

    @rule(s=st.integers(0, MAX_STREAMS - 1), roll=st.sampled_from(range(4)))
    def fault(self, s: int, roll: int) -> None:
        if roll == 3:  # faults are sticky: keep them rarer than completions
            self.streams[s % len(self.streams)].fault()

    # ------------------------------------------------------------ slots

    @rule(n=st.integers(1, SIZE - 1))
    def take(self, n: int) -> None:
        rows = self.led.take(n)
        if n > self._free_count():
            assert rows is None
            return
        assert rows is not None and len(rows) == n
        assert not set(rows) & self.dirty, "a dirty row was handed out"
        self._consume(rows)
        self.handed_out += n
        for r in rows:
            self.gen[r] = self.handed_out  # the tag: rows handed out so far
        self.allocated.update(rows)
        self.allocs += n

    @precondition(lambda self: self._free_count() > 0)
    @rule(data=st.data())
    def take_and_put_back(self, data) -> None:
        n = data.draw(st.integers(1, self._free_count()))
        rows = self.led.take(n)
        assert rows is not None
        self._consume(rows)
        self.led.put_back(rows)
        self.handed_out += n
        for r in rows:
            self.gen[r] = self.handed_out
        self.blocks[:0] = [{r} for r in rows]

    @precondition(lambda self: self.allocated)
    @rule(data=st.data(), fence=fences)
    def record_use(self, data, fence) -> None:
        rows = self._draw_rows(data, self.allocated)
        self.led.record_use(rows, fence)
        for r in rows:
            self.uses[r] = self._newest([*self.uses.get(r, []), fence])

    @precondition(lambda self: self.allocated)
    @rule(target=fences, s=st.integers(0, MAX_STREAMS - 1))
    def step(self, s: int) -> FakeFence:
        """A scheduler step: one fence, recorded as a use of every running row."""
        f = self.record(s)
        rows = sorted(self.allocated)
        self.led.record_use(rows, f)
        for r in rows:
            self.uses[r] = self._newest([*self.uses.get(r, []), f])
        return f

    @precondition(lambda self: self.allocated)
    @rule(data=st.data(), fence=st.none() | fences)
    def free(self, data, fence) -> None:
        self._free(self._draw_rows(data, self.allocated), fence)

    @precondition(lambda self: self.allocated)
    @rule(target=fences, data=st.data(), s=st.integers(0, MAX_STREAMS - 1))
    def free_after(self, data, s: int) -> FakeFence:
        """``free(rows, after=stream)``: a fresh fence, newer than any use there."""
        f = self.record(s)
        self._free(self._draw_rows(data, self.allocated), f)
        return f

    def _free(self, rows: list[int], fence) -> None:
        immediate = self.led.free(rows, fence)
        expect = 0
        for r in rows:
            self.allocated.discard(r)
            waits = self._newest([*self.uses.pop(r, []), *([fence] if fence else [])])
            statuses = [status(f) for f in waits]
            if "faulted" in statuses:
                self.quarantined.add(r)
            elif all(s == "done" for s in statuses):
                self.blocks.append({r})
                self.dirty.add(r)
                expect += 1
            else:
                self.pending[r] = waits
        assert immediate == expect

    @rule()
    def reclaim(self) -> None:
        released = self.led.reclaim()
        freed: set[int] = set()
        for r, waits in list(self.pending.items()):
            statuses = [status(f) for f in waits]
            if all(s == "done" for s in statuses):
                freed.add(r)
            elif "faulted" in statuses:
                if "pending" not in statuses or self.led.state_of(r) == "quarantined":
                    # Certain once nothing else is open; otherwise it depends on
                    # which fence the row sat behind (both outcomes are legal).
                    self.quarantined.add(r)
                else:
                    continue
            else:
                continue
            del self.pending[r]
        assert released == len(freed)
        if freed:
            self.blocks.append(freed)
            self.dirty.update(freed)

    @rule(data=st.data())
    def bad_free(self, data) -> None:
        """A free/record_use the model knows is bad raises and changes nothing."""
        choices = [r for r in range(-1, SIZE + 1) if r not in self.allocated]
        if self.allocated:
            choices.append(-100)  # marker: a duplicate of an allocated row
        pick = data.draw(st.sampled_from(choices))
        if pick == -100:
            r = data.draw(st.sampled_from(sorted(self.allocated)))
            rows, expect = [r, r], InvalidSlotError
        else:
            rows = [pick]
            free_or_pending = 0 < pick < SIZE and (
                pick in self.pending or any(pick in b for b in self.blocks)
            )
            expect = DoubleFreeError if free_or_pending and self.gen[pick] else InvalidSlotError
        before = ledger_snapshot(self.led)
        op = data.draw(st.sampled_from(["free", "record_use"]))
        try:
            if op == "free":
                self.led.free(rows)
            else:
                self.led.record_use(rows, self.streams[0].record())
        except InvalidSlotError as exc:
            if op == "free":
                assert type(exc) is expect, (rows, exc)
        else:
            raise AssertionError(f"{op}({rows}) did not raise")
        after = ledger_snapshot(self.led)
        assert after == before

    # ------------------------------------------------------------ invariants

    @invariant()
    def ledger_invariants_hold(self) -> None:
        self.led.check_invariants()

    @invariant()
    def states_match_the_model(self) -> None:
        led = self.led
        free = set().union(*self.blocks) if self.blocks else set()
        for r in range(1, SIZE):
            want = (
                "free"
                if r in free
                else "allocated"
                if r in self.allocated
                else "pending"
                if r in self.pending
                else "quarantined"
                if r in self.quarantined
                else None
            )
            assert want is not None, f"model lost row {r}"
            assert led.state_of(r) == want, (r, led.state_of(r), want)
            assert led.generation(r) == self.gen[r]
        assert led.free_count == len(free)
        assert led.pending == len(self.pending)
        assert led.quarantined == len(self.quarantined)
        assert led.allocated == len(self.allocated)
        assert led.allocs == self.allocs
        if self.quarantined:
            assert isinstance(led.last_fence_error, FenceError)

    @invariant()
    def fifo_order_matches_the_model(self) -> None:
        order = list(self.led._free)
        i = 0
        for block in self.blocks:
            assert set(order[i : i + len(block)]) == block, (order, self.blocks)
            i += len(block)
        assert i == len(order)


LedgerMachine.TestCase.settings = settings(
    max_examples=500,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestLedgerMachine = LedgerMachine.TestCase
