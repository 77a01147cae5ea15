"""Hypothesis stateful test of a pool's rows and the KV pages they own.

An ``AsyncReqToTokenPool(kv=KVPagePool(...))`` driven synchronously, with
no event loop (as set-up code would: nothing binds, the fences it defers
behind wait for a loop that never comes, and every call reclaims what it
needs itself), through everything that moves a row's pages: ``try_admit``,
``extend``, ``extend_rows``, ``trim_pages``, ``record_use``, ``free(rows,
fence=, after=)``, ``detach_pages`` with the caller's ``kv.free(pages,
fence=)``, ``reclaim()``, and a speculative-decoding step (draft pages for
every running row, the step's use, the rejected drafts trimmed while it is
in flight, the next step's drafts grown over the cut places). The machine
owns the fences (ordered fake fences of three streams, the third also the
``after=`` stream, and loose fences of unknown origin) and says when each
completes or faults. A second machine runs the same rules on
``reclaim="explicit"`` pools, where memory comes back only when the
scheduler ``retire``s a fence it saw done, and no fence is ever asked.

The model is naive on purpose. Each allocated row owns a list of pages, in
order, and carries its recorded uses (the newest per stream, each loose
fence once); a page is free, owned by a row, held by the caller (detached),
pending behind the fences it waits for, or quarantined; a row is free,
allocated, pending or quarantined. Frees and reclaims go to FIFO blocks, as
in ``test_ledger_stateful.py`` and ``test_kv_pages_stateful.py``: one-row
blocks for rows freed at once (exact order), one block per call for pages
freed at once and one per reclaim (any order inside). Above all, every row
and page handed out (``try_admit``, ``extend``, ``extend_rows``) is checked
against the fences the model last made it wait for: none may still be open.
Bad calls must raise their typed error and change nothing (a snapshot of
both ledgers, the rows' records and seals, and the fences recorded).

It catches a broken library: ``trim_pages`` leaving out the row's recorded
uses, its ``fence=`` or its ``after=`` (``trim_pages``' return value, then
the counts), ``trim`` keeping the seal or the record uncut or deferring a
view of the record that the next growth overwrites (``check_invariants``),
``free`` of a row forgetting the row's use for its pages or not recording
``after=`` as a use of the row (the counts; ``free``'s return), ``retire``
releasing one fence too far (``retire``'s return).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
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
from test_kv_pages import snapshot as kv_snapshot
from test_kv_pages_stateful import newest
from test_ledger_stateful import LooseFence

from asyncpool import (
    AsyncReqToTokenPool,
    CapacityError,
    DoubleFreeError,
    HostStream,
    InvalidSlotError,
    KVPagePool,
)

SIZE = 6  # rows 1..5
NUM_PAGES = 13  # pages 1..12
STREAMS = 3  # the last is also the after= stream

# Faults log at ERROR: quiet, for these tests only (conftest).
pytestmark = pytest.mark.usefixtures("quiet_asyncpool_logs")

AnyFence = FakeFence | LooseFence


class AfterStream(HostStream):
    """A stream to pass as ``after=`` whose fences are a :class:`FakeStream`'s:
    the machine says when they complete. No worker thread (``HostStream``'s
    ``__init__`` is not run); the pool only calls :meth:`record`."""

    def __init__(self, fake: FakeStream) -> None:  # no HostStream.__init__: no thread
        self.fake = fake

    def __repr__(self) -> str:
        return f"<AfterStream {self.fake.key}>"

    @property
    def closed(self) -> bool:  # asked by after='s check: never closed
        return False

    def record(self) -> FakeFence:  # type: ignore[override]
        return self.fake.record()


def ids(t: torch.Tensor) -> list[int]:
    return [int(x) for x in t.reshape(-1).tolist()]


class Fifo:
    """The free queue of rows or the free ring of pages, as blocks."""

    def __init__(self, items: range) -> None:
        self.blocks: list[set[int]] = [{i} for i in items]

    def count(self) -> int:
        return sum(len(b) for b in self.blocks)

    def all(self) -> set[int]:
        return set().union(*self.blocks) if self.blocks else set()

    def consume(self, taken: list[int]) -> None:
        """What was handed out must be the head of the queue, block by block."""
        i = 0
        while i < len(taken):
            assert self.blocks, f"handed out {taken}, but the model has nothing free"
            block = self.blocks[0]
            chunk = taken[i : i + len(block)]
            assert set(chunk) <= block, f"FIFO broken: took {taken}, head block {block}"
            if len(chunk) == len(block):
                self.blocks.pop(0)
            else:
                block.difference_update(chunk)
            i += len(chunk)

    def check(self, order: list[int], what: str) -> None:
        i = 0
        for block in self.blocks:
            assert set(order[i : i + len(block)]) == block, (what, order, self.blocks)
            i += len(block)
        assert i == len(order), (what, order, self.blocks)


class RowPagesMachine(RuleBasedStateMachine):
    fences = Bundle("fences")
    #: reclaim="explicit": the pool never asks a fence; ``retire`` returns
    #: what waits behind fences of a stream up to one the scheduler saw done.
    explicit = False

    def __init__(self) -> None:
        super().__init__()
        mode = "explicit" if self.explicit else "auto"
        self.kv = KVPagePool(NUM_PAGES, 4)
        self.pool = AsyncReqToTokenPool(SIZE, 64, kv=self.kv, reclaim=mode)
        self.retired: dict[int, int] = {}  # stream key -> newest seq retired
        self.streams = [FakeStream() for _ in range(STREAMS)]
        self.after = AfterStream(self.streams[-1])
        self.loose: list[LooseFence] = []
        # model: rows
        self.free_rows = Fifo(range(1, SIZE))
        self.owned: dict[int, list[int]] = {}  # allocated row -> its pages, in order
        self.uses: dict[int, list[AnyFence]] = {}  # allocated row -> newest uses
        self.pending_rows: dict[int, list[AnyFence]] = {}
        self.quarantined_rows: set[int] = set()
        self.ever_rows: set[int] = set()  # handed out at least once (a generation)
        # model: pages
        self.free_pages = Fifo(range(1, NUM_PAGES))
        self.detached: list[tuple[torch.Tensor, list[int]]] = []  # the caller's
        self.pending_pages: dict[int, list[AnyFence]] = {}
        self.quarantined_pages: set[int] = set()
        # What each row and page last waited for when it was freed: none of
        # it may be open when it is handed out again.
        self.row_waited: dict[int, list[AnyFence]] = {}
        self.page_waited: dict[int, list[AnyFence]] = {}

    # ------------------------------------------------------------ model helpers

    def status(self, f: AnyFence) -> str:
        """A fence as the pool sees it: asked (auto), or retired or not (explicit)."""
        if not self.explicit:
            return f.status
        assert isinstance(f, FakeFence)
        return "done" if self.retired.get(f.stream_key, 0) >= f.seq else "pending"

    def decide(self, fences: list[AnyFence]) -> tuple[str, list[AnyFence]]:
        """Where memory freed behind ``fences`` goes at the free: quarantined if
        one of the newest faulted, free if all are done, else pending."""
        waits = newest(fences)
        statuses = [self.status(f) for f in waits]
        if "faulted" in statuses:
            return "quarantined", waits
        if all(s == "done" for s in statuses):
            return "free", waits
        return "pending", waits

    def _settle(
        self, pending: dict[int, list[AnyFence]], state_of: Any
    ) -> tuple[set[int], set[int]]:
        """What a reclaim returns of ``pending`` (run after the real one: where
        an open fence and a faulted one both hold an item, it reads which of
        the two legal outcomes the pool chose)."""
        freed: set[int] = set()
        faulted: set[int] = set()
        for item, waits in list(pending.items()):
            statuses = [self.status(f) for f in waits]
            if all(s == "done" for s in statuses):
                freed.add(item)
            elif "faulted" in statuses and (
                "pending" not in statuses or state_of(item) == "quarantined"
            ):
                faulted.add(item)
            else:
                continue
            del pending[item]
        return freed, faulted

    def _reclaim_rows(self, *, retiring: bool = False) -> int:
        if self.explicit and not retiring:
            return 0  # an explicit pool reclaims nothing itself: retire() does
        freed, faulted = self._settle(self.pending_rows, self.pool._ledger.state_of)
        self.quarantined_rows |= faulted
        if freed:
            self.free_rows.blocks.append(freed)
        return len(freed)

    def _reclaim_pages(self, *, retiring: bool = False) -> int:
        if self.explicit and not retiring:
            return 0
        freed, faulted = self._settle(self.pending_pages, self.kv.ledger.state_of)
        self.quarantined_pages |= faulted
        if freed:
            self.free_pages.blocks.append(freed)
        return len(freed)

    def _hand_out_rows(self, rows: list[int]) -> None:
        for r in rows:
            open_ = [f for f in self.row_waited.get(r, []) if f.status != "done"]
            assert not open_, f"row {r} handed out while it waits for {open_}"
        self.free_rows.consume(rows)
        self.ever_rows.update(rows)

    def _hand_out_pages(self, pages: list[int]) -> None:
        for p in pages:
            open_ = [f for f in self.page_waited.get(p, []) if f.status != "done"]
            assert not open_, f"page {p} handed out while it waits for {open_}"
        self.free_pages.consume(pages)

    def _free_pages(self, pages: list[int], fences: list[AnyFence]) -> int:
        """Model a free of ``pages`` behind ``fences``; the pages free at once."""
        if not pages:
            return 0
        where, waits = self.decide(fences)
        for p in pages:
            self.page_waited[p] = waits
        if where == "quarantined":
            self.quarantined_pages.update(pages)
            return 0
        if where == "free":
            self.free_pages.blocks.append(set(pages))
            return len(pages)
        for p in pages:
            self.pending_pages[p] = waits
        return 0

    def _rows(self, data: st.DataObject, min_size: int = 1) -> list[int]:
        return data.draw(
            st.lists(st.sampled_from(sorted(self.owned)), min_size=min_size, unique=True)
        )

    def _after_fence(self, seq_before: int, used: bool) -> list[AnyFence]:
        """The fence the pool recorded on the after= stream in the last call
        (exactly one if ``used``, none otherwise)."""
        fake = self.after.fake
        assert fake.seq == seq_before + (1 if used else 0), "after= recorded wrongly"
        return [fake.fences[-1]] if used else []

    # ------------------------------------------------------------ fences

    @initialize(target=fences)
    def first_fence(self) -> FakeFence:
        return self.streams[0].record()

    @rule(target=fences, s=st.integers(0, STREAMS))
    def record(self, s: int) -> AnyFence:
        """A fence on stream ``s``, or (``s == STREAMS``, auto pools) a loose
        one, a transfer handle (an explicit pool settles those by agree())."""
        if s < STREAMS or self.explicit:
            return self.streams[s % STREAMS].record()
        f = LooseFence(len(self.loose))
        self.loose.append(f)
        return f

    @rule(
        data=st.data(),
        s=st.integers(0, STREAMS - 1),
        how=st.sampled_from(["complete", "complete", "synchronize", "land", "fault"]),
    )
    def advance(self, data: st.DataObject, s: int, how: str) -> None:
        """Work completes: on stream ``s`` (a fence or two), everywhere (a
        synchronize: every stream runs dry, every transfer lands), one
        transfer (lands or, rarely, fails), or stream ``s`` faults (sticky,
        rarer than completions)."""
        stream = self.streams[s]
        if how == "complete":
            stream.complete(min(stream.seq, stream.done + data.draw(st.integers(1, 2))))
        elif how == "synchronize":
            for stream in self.streams:
                stream.complete()
            for f in self.loose:
                if f.status == "pending":
                    f.status = "done"
        elif how == "land":
            pending = [f for f in self.loose if f.status == "pending"]
            if pending:
                f = data.draw(st.sampled_from(pending))
                f.status = "faulted" if data.draw(st.integers(0, 7)) == 0 else "done"
        elif data.draw(st.integers(0, 2)) == 0:
            stream.fault()

    # ------------------------------------------------------------ admission and growth

    @rule(k=st.integers(0, 5))
    def try_admit(self, k: int) -> None:
        # Short of a row or of pages, try_admit reclaims both ledgers first.
        short = not self.free_rows.count() or k > self.free_pages.count()
        g = self.pool.try_admit(k)
        if short:
            self._reclaim_rows()
            self._reclaim_pages()
        if not self.free_rows.count() or k > self.free_pages.count():
            assert g is None
            return
        assert g is not None
        self._hand_out_rows([g.row])
        pages = ids(g.pages)
        assert len(pages) == k
        self._hand_out_pages(pages)
        self.owned[g.row] = pages
        self.uses[g.row] = []

    @precondition(lambda self: self.owned)
    @rule(data=st.data(), k=st.integers(1, 4))
    def extend(self, data: st.DataObject, k: int) -> None:
        row = data.draw(st.sampled_from(sorted(self.owned)))
        short = k > self.free_pages.count()  # extend reclaims pages (only) when short
        got = self.pool.extend(row, k)
        if short:
            self._reclaim_pages()
        if k > self.free_pages.count():
            assert got is None
            return
        assert got is not None
        pages = ids(got)
        assert len(pages) == k
        self._hand_out_pages(pages)
        self.owned[row] += pages

    @precondition(lambda self: self.owned)
    @rule(data=st.data(), k=st.integers(1, 2), form=st.sampled_from(["list", "tensor"]))
    def extend_rows(self, data: st.DataObject, k: int, form: str) -> None:
        self._extend_rows(self._rows(data, min_size=0), k, form)

    def _extend_rows(self, rows: list[int], k: int, form: str) -> bool:
        arg: Any = torch.tensor(rows, dtype=torch.int64) if form == "tensor" else rows
        total = len(rows) * k
        short = total > self.free_pages.count()
        got = self.pool.extend_rows(arg, k)
        if short:
            self._reclaim_pages()
        if total > self.free_pages.count():
            assert got is None
            return False
        assert got is not None and tuple(got.shape) == (len(rows), k)
        pages = ids(got)
        self._hand_out_pages(pages)
        for i, row in enumerate(rows):
            self.owned[row] += pages[i * k : i * k + k]
        return True

    @precondition(lambda self: self.owned)
    @rule(data=st.data(), counts=st.lists(st.integers(0, 3), min_size=1, max_size=6))
    def extend_fitting(self, data: st.DataObject, counts: list[int]) -> None:
        rows = self._rows(data, min_size=0)
        counts = (counts * len(rows))[: len(rows)]
        short = sum(counts) > self.free_pages.count()  # reclaims only when short
        m, got = self.pool.extend_fitting(rows, counts)
        if short:
            self._reclaim_pages()
        free = self.free_pages.count()
        fit = 0
        while fit < len(rows) and sum(counts[: fit + 1]) <= free:
            fit += 1
        assert m == fit and got.shape == (sum(counts[:m]),)
        pages = ids(got)
        self._hand_out_pages(pages)
        at = 0
        for row, k in zip(rows[:m], counts, strict=False):
            self.owned[row] += pages[at : at + k]
            at += k

    # ------------------------------------------------------------ uses, trims, frees

    @precondition(lambda self: self.owned)
    @rule(data=st.data(), fence=fences)
    def record_use(self, data: st.DataObject, fence: AnyFence) -> None:
        rows = self._rows(data)
        self.pool.record_use(rows, fence)
        for r in rows:
            self.uses[r] = newest([*self.uses[r], fence])

    @precondition(lambda self: self.owned)
    @rule(target=fences, s=st.integers(0, STREAMS - 1))
    def step(self, s: int) -> FakeFence:
        """A scheduler step: one fence, a use of every running row."""
        f = self.streams[s].record()
        rows = sorted(self.owned)
        self.pool.record_use(rows, f)
        for r in rows:
            self.uses[r] = newest([*self.uses[r], f])
        return f

    @precondition(lambda self: self.owned)
    @rule(data=st.data(), fence=st.none() | fences, use_after=st.booleans())
    def trim_pages(self, data: st.DataObject, fence: AnyFence | None, use_after: bool) -> None:
        row = data.draw(st.sampled_from(sorted(self.owned)))
        keep = data.draw(st.integers(0, len(self.owned[row]) + 1))
        self._trim(row, keep, fence, use_after)

    def _trim(self, row: int, keep: int, fence: AnyFence | None, use_after: bool) -> None:
        pages = self.owned[row]
        seq = self.after.fake.seq
        got = self.pool.trim_pages(row, keep, fence, after=self.after if use_after else None)
        trimmed = len(pages) > keep
        after = self._after_fence(seq, use_after and trimmed)
        if not trimmed:
            assert got == 0
            return
        self.owned[row] = pages[:keep]
        fences = [*self.uses[row], *([fence] if fence is not None else []), *after]
        assert got == self._free_pages(pages[keep:], fences)

    @precondition(lambda self: self.owned)
    @rule(
        target=fences,
        data=st.data(),
        s=st.integers(0, STREAMS - 1),
        k=st.integers(1, 3),
        use_after=st.booleans(),
    )
    def speculative_step(self, data: st.DataObject, s: int, k: int, use_after: bool) -> FakeFence:
        """Speculative decoding: every running row grows by ``k`` draft pages
        (one ``extend_rows``), the step that writes them is launched (one
        use of every row), and the rejected drafts are trimmed while it is
        still in flight; the next step grows the rows over the cut places."""
        rows = sorted(self.owned)
        k = min(k, (NUM_PAGES - 1) // len(rows))  # within what extend_rows takes
        f = self.streams[s].record()
        lens = [len(self.owned[r]) for r in rows]
        if not self._extend_rows(rows, k, "list"):
            return f
        self.pool.record_use(rows, f)
        for r in rows:
            self.uses[r] = newest([*self.uses[r], f])
        for r, n in zip(rows, lens, strict=True):
            self._trim(r, n + data.draw(st.integers(0, k)), None, use_after)
        return f

    @precondition(lambda self: self.owned)
    @rule(data=st.data(), fence=st.none() | fences, use_after=st.booleans())
    def free(self, data: st.DataObject, fence: AnyFence | None, use_after: bool) -> None:
        rows = self._rows(data)
        form = data.draw(
            st.sampled_from(["list", "tensor", "int"] if len(rows) == 1 else ["list", "tensor"])
        )
        arg: Any = (
            torch.tensor(rows, dtype=torch.int64)
            if form == "tensor"
            else rows[0]
            if form == "int"
            else rows
        )
        seq = self.after.fake.seq
        got = self.pool.free(arg, fence, after=self.after if use_after else None)
        after = self._after_fence(seq, use_after)
        expect = 0
        pages_now: list[int] = []
        for r in rows:
            fences = [*self.uses.pop(r), *([fence] if fence is not None else []), *after]
            where, waits = self.decide(fences)
            self.row_waited[r] = waits
            if where == "quarantined":
                self.quarantined_rows.add(r)
            elif where == "free":
                self.free_rows.blocks.append({r})
                expect += 1
            else:
                self.pending_rows[r] = waits
            pages = self.owned.pop(r)
            if pages:
                for p in pages:
                    self.page_waited[p] = waits
                if where == "quarantined":
                    self.quarantined_pages.update(pages)
                elif where == "free":
                    pages_now.extend(pages)
                else:
                    for p in pages:
                        self.pending_pages[p] = waits
        if pages_now:
            self.free_pages.blocks.append(set(pages_now))
        assert got == expect

    @precondition(lambda self: self.owned)
    @rule(data=st.data())
    def detach_pages(self, data: st.DataObject) -> None:
        row = data.draw(st.sampled_from(sorted(self.owned)))
        got = self.pool.detach_pages(row)
        assert ids(got) == self.owned[row]
        if self.owned[row]:
            self.detached.append((got, self.owned[row]))
        self.owned[row] = []

    @precondition(lambda self: self.detached)
    @rule(data=st.data(), fence=st.none() | fences, form=st.sampled_from(["tensor", "list"]))
    def kv_free(self, data: st.DataObject, fence: AnyFence | None, form: str) -> None:
        """The caller frees detached pages to the page pool: behind its fence only."""
        i = data.draw(st.integers(0, len(self.detached) - 1))
        tensor, pages = self.detached.pop(i)
        arg: Any = tensor if form == "tensor" else list(pages)
        got = self.kv.free(arg, fence=fence)
        assert got == self._free_pages(pages, [fence] if fence is not None else [])

    @rule(pages_only=st.booleans())
    def reclaim(self, pages_only: bool) -> None:
        """``pool.reclaim()``: rows and pages; ``kv.reclaim()``: pages only."""
        if pages_only:
            assert self.kv.reclaim() == self._reclaim_pages()
            return
        got = self.pool.reclaim()
        assert got == self._reclaim_rows()
        self._reclaim_pages()

    @precondition(lambda self: self.explicit)
    @rule(s=st.integers(0, STREAMS - 1), back=st.integers(0, 2))
    def retire(self, s: int, back: int) -> None:
        """The scheduler processed a step: it retires a fence it saw done
        (never one still open), maybe not the newest done."""
        stream = self.streams[s]
        seq = stream.done - back
        if seq < 1:
            return
        f = stream.fences[seq - 1]
        assert f.status == "done"
        got = self.pool.retire(f)
        key = f.stream_key
        self.retired[key] = max(self.retired.get(key, 0), seq)
        assert got == (self._reclaim_rows(retiring=True), self._reclaim_pages(retiring=True))

    # ------------------------------------------------------------ bad calls

    def _snapshot(self) -> tuple[Any, ...]:
        pool = self.pool
        rp = pool._pages
        assert rp is not None
        stats = dataclasses.replace(
            pool.stats(), wait_time=None, fence_latency=None, admit_wait=None
        )
        return (
            stats,
            ledger_snapshot(pool._ledger),
            kv_snapshot(self.kv),
            [None if a is None else a.tobytes() for a in rp.owned],
            [None if s is None else bytes(s) for s in rp.sealed],
            [None if b is None else len(b) for b in rp.grown],
            self.after.fake.seq,
            [(f.stream_key, f.seq) for s in self.streams for f in s.fences],
        )

    def _refused(self, call: Any, error: type[BaseException], match: str | None = None) -> None:
        before = self._snapshot()
        try:
            call()
        except error as exc:
            assert type(exc) is error, (error, exc)
            if match is not None:
                assert match in str(exc), (match, exc)
        else:
            raise AssertionError(f"{call} did not raise {error.__name__}")
        assert self._snapshot() == before, "a refused call changed something"

    def _not_allocated(self) -> list[int]:
        return [r for r in range(-1, SIZE + 1) if r not in self.owned]

    def _row_error(self, row: int, what: str) -> type[InvalidSlotError]:
        """The error a call on ``row`` (not allocated) raises: a double free
        of a row handed out before and free or pending now, else invalid."""
        again = row in self.ever_rows and (row in self.free_rows.all() or row in self.pending_rows)
        return DoubleFreeError if what == "free" and again else InvalidSlotError

    @rule(data=st.data(), kind=st.sampled_from(["row", "args", "record"]))
    def bad_call(self, data: st.DataObject, kind: str) -> None:
        """A call the model knows is bad: a typed error, nothing changed."""
        if kind == "row":
            self._bad_row(data)
        elif kind == "args" and self.owned:
            self._bad_args(data)
        elif kind == "record" and any(self.owned.values()):
            self._bad_record(
                data, data.draw(st.sampled_from(["trim", "trim-after", "free", "kv_free"]))
            )

    def _bad_row(self, data: st.DataObject) -> None:
        """Every call that takes a row refuses one that is not allocated."""
        row = data.draw(st.sampled_from(self._not_allocated()))
        pool = self.pool
        op = data.draw(
            st.sampled_from(
                ["trim", "extend", "extend_rows", "free", "record_use", "pages_of", "detach"]
            )
        )
        calls = {
            "trim": lambda: pool.trim_pages(row, 0),
            "extend": lambda: pool.extend(row, 1),
            "extend_rows": lambda: pool.extend_rows([*sorted(self.owned)[:1], row], 1),
            "free": lambda: pool.free([*sorted(self.owned)[:1], row]),
            "pages_of": lambda: pool.pages_of(row),
            "detach": lambda: pool.detach_pages(row),
        }
        if op == "record_use":
            # record_use records its fence before the call: snapshot after.
            fence = self.streams[0].record()
            self._refused(lambda: pool.record_use([row], fence), InvalidSlotError)
            return
        self._refused(calls[op], self._row_error(row, op))

    def _bad_args(self, data: st.DataObject) -> None:
        """Bad counts, repeated rows, non-fences: typed errors, nothing changed."""
        pool = self.pool
        row = data.draw(st.sampled_from(sorted(self.owned)))
        op = data.draw(
            st.sampled_from(
                [
                    "keep-negative",
                    "keep-float",
                    "keep-bool",
                    "trim-fence",
                    "trim-after",
                    "extend-zero",
                    "extend-too-many",
                    "extend_rows-twice",
                    "extend_rows-too-many",
                    "free-twice",
                    "free-fence",
                    "admit-too-many",
                    "retire",
                ]
            )
        )
        cap = NUM_PAGES - 1
        calls: dict[str, tuple[Any, type[BaseException]]] = {
            "keep-negative": (lambda: pool.trim_pages(row, -1), CapacityError),
            "keep-float": (lambda: pool.trim_pages(row, 1.0), CapacityError),  # type: ignore[arg-type]
            "keep-bool": (lambda: pool.trim_pages(row, False), CapacityError),  # type: ignore[arg-type]
            "trim-fence": (lambda: pool.trim_pages(row, 0, object()), TypeError),  # type: ignore[arg-type]
            "trim-after": (lambda: pool.trim_pages(row, 0, after=object()), TypeError),
            "extend-zero": (lambda: pool.extend(row, 0), CapacityError),
            "extend-too-many": (lambda: pool.extend(row, cap + 1), CapacityError),
            "extend_rows-twice": (lambda: pool.extend_rows([row, row], 1), InvalidSlotError),
            "extend_rows-too-many": (
                lambda: pool.extend_rows([row], cap + 1),
                CapacityError,
            ),
            "free-twice": (lambda: pool.free([row, row]), InvalidSlotError),
            "free-fence": (lambda: pool.free([row], object()), TypeError),  # type: ignore[arg-type]
            "admit-too-many": (lambda: pool.try_admit(cap + 1), CapacityError),
            # auto: retire() is for explicit pools; explicit: an ordered fence only
            "retire": (
                lambda: pool.retire(self.streams[0].fences[0] if not self.explicit else object()),  # type: ignore[arg-type]
                TypeError if self.explicit else RuntimeError,
            ),
        }
        call, error = calls[op]
        self._refused(call, error)

    def _bad_record(self, data: st.DataObject, op: str) -> None:
        """A row's record written into (against the contract) is refused by
        trim_pages and free; its pages are refused by ``kv.free`` (they are
        the row's, behind its fences); restored, nothing changed."""
        row = data.draw(st.sampled_from(sorted(r for r, p in self.owned.items() if p)))
        pool = self.pool
        pages = self.owned[row]
        if op == "kv_free":
            self._refused(lambda: self.kv.free(list(pages)), InvalidSlotError, "owned by a row")
            return
        record = pool.pages_of(row)
        i = data.draw(st.integers(0, len(pages) - 1))
        before = self._snapshot()
        record[i] = (pages[i] % (NUM_PAGES - 1)) + 1  # another id (maybe another's page)
        keep = data.draw(st.integers(0, i))  # the written page is in the tail or kept
        calls = {
            "trim": lambda: pool.trim_pages(row, keep),
            "trim-after": lambda: pool.trim_pages(row, keep, after=self.after),
            "free": lambda: pool.free([row]),
        }
        try:
            calls[op]()
        except InvalidSlotError as exc:
            assert "written into" in str(exc), exc
        else:
            raise AssertionError(f"{op} of a record written into did not raise")
        finally:
            record[i] = pages[i]
        assert self._snapshot() == before, "a refused call changed something"

    # ------------------------------------------------------------ invariants

    @invariant()
    def explicit_pools_ask_no_fence(self) -> None:
        if self.explicit:
            asked = [f for stream in self.streams for f in stream.fences if f.queries]
            assert not asked, f"an explicit pool asked {asked}"

    @invariant()
    def invariants_hold(self) -> None:
        self.pool.check_invariants()
        self.kv.check_invariants()

    @invariant()
    def records_match_the_model(self) -> None:
        pool = self.pool
        assert sorted(pool._ledger.allocated_rows()) == sorted(self.owned)
        for row, pages in self.owned.items():
            assert ids(pool.pages_of(row)) == pages, (row, pages)
            use = pool._uses[row]
            got = () if use is None else use if use.__class__ is tuple else (use,)
            if self.explicit:
                assert sorted(map(id, got)) == sorted(map(id, self.uses[row])), (row, got)
                continue
            # A record that grows a row's uses past a few may drop the loose
            # fences it finds landed (ledger._pruned): only those may be gone.
            held = set(map(id, got))
            assert len(held) == len(got) and held <= set(map(id, self.uses[row])), (row, got)
            gone = [f for f in self.uses[row] if id(f) not in held]
            assert all(isinstance(f, LooseFence) and f.status == "done" for f in gone), (row, gone)

    @invariant()
    def states_match_the_model(self) -> None:
        led = self.pool._ledger
        free_rows = self.free_rows.all()
        for r in range(1, SIZE):
            want = (
                "free"
                if r in free_rows
                else "allocated"
                if r in self.owned
                else "pending"
                if r in self.pending_rows
                else "quarantined"
                if r in self.quarantined_rows
                else None
            )
            assert want is not None, f"model lost row {r}"
            assert led.state_of(r) == want, (r, led.state_of(r), want)
        pled = self.kv.ledger
        free_pages = self.free_pages.all()
        owned = {p for pages in self.owned.values() for p in pages}
        detached = {p for _, pages in self.detached for p in pages}
        for p in range(1, NUM_PAGES):
            want = (
                "free"
                if p in free_pages
                else "owned by a row"
                if p in owned
                else "allocated"
                if p in detached
                else "pending"
                if p in self.pending_pages
                else "quarantined"
                if p in self.quarantined_pages
                else None
            )
            assert want is not None, f"model lost page {p}"
            assert pled.state_of(p) == want, (p, pled.state_of(p), want)

    @invariant()
    def counts_match_the_model(self) -> None:
        st_ = self.pool.stats()
        assert st_.free == self.free_rows.count() == self.pool.available_size()
        assert st_.allocated == len(self.owned)
        assert st_.pending == len(self.pending_rows) == self.pool.pending_size()
        assert st_.quarantined == len(self.quarantined_rows)
        owned = sum(len(p) for p in self.owned.values())
        detached = sum(len(p) for _, p in self.detached)
        assert st_.pages_free == self.free_pages.count() == self.kv.available_size()
        assert st_.pages_allocated == owned + detached
        assert st_.pages_pending == len(self.pending_pages) == self.kv.pending_size()
        assert st_.pages_quarantined == len(self.quarantined_pages)

    @invariant()
    def fifo_order_matches_the_model(self) -> None:
        self.free_rows.check(list(self.pool._ledger._free), "rows")
        pled = self.kv.ledger
        cap = pled.capacity
        ring = [int(pled._ring[(pled._head + i) % cap]) for i in range(pled.free_count)]
        self.free_pages.check(ring, "pages")


RowPagesMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestRowPagesMachine = RowPagesMachine.TestCase


class ExplicitRowPagesMachine(RowPagesMachine):
    explicit = True


ExplicitRowPagesMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestExplicitRowPagesMachine = ExplicitRowPagesMachine.TestCase
