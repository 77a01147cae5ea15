"""A trim that keeps the row's growth buffer, against everything else.

perftrim's trim keeps a row's growth buffer unless ``pages_of`` lent a view
of it (``RowPages.lent``), so the growth after a trim writes the cut places
of the same buffer. These seeded random runs (one page pool and KV groups)
mix that with what else hands out or keeps page ids: grants, every growth
form (``extend``, ``extend_rows`` with one count and with per-row counts,
``extend_fitting``), ``pages_of`` views held across steps, ``pages_of_rows``
tables, ``detach_pages``, drops, recorded uses, frees and trims behind
fences that stay incomplete for many steps (their pages pending while the
kept buffer grows over the places they were cut from), writes into kept
pages (refused at the row's free, nothing changed, until restored), and the
fences' completions. After every call:

* every page's state in each page ledger is the model's: owned by the row
  whose positions list it, pending behind the fence its give-back waits
  for, allocated while detached, free otherwise (a pending batch that
  aliased a kept buffer would return the wrong pages at its reclaim);
* every tensor handed out still reads what it read;
* no tensor handed out shares memory with a row's growth buffer unless the
  row is ``lent`` (the structural form of "a kept buffer is nobody's");
* the pool's invariants hold.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
from helpers import FakeStream
from helpers import page_ids as ids

from asyncpool import AsyncReqToTokenPool, InvalidSlotError, KVPagePool
from asyncpool.kv_pages import OWNED
from asyncpool.ledger import ALLOCATED, FREE, PENDING

ROWS = 60  # past RowPages' _JOINED_CHECK (56): a trim of every row takes _group_many
PAGES = ROWS * 16


class _Run:
    def __init__(self, seed: int, grouped: bool) -> None:
        self.rnd = random.Random(seed)
        self.grouped = grouped
        self.names: list[str | None] = ["a", "b"] if grouped else [None]
        if grouped:
            kv: Any = {"a": KVPagePool(PAGES + 1, 1), "b": KVPagePool(PAGES // 2 + 1, 1)}
        else:
            kv = KVPagePool(PAGES + 1, 1)
        self.pool = AsyncReqToTokenPool(ROWS + 1, 1 << 12, kv=kv)
        self.stream = FakeStream()
        # Per group: row -> positions (dropped ones as 0).
        self.shadow: dict[str | None, dict[int, list[int]]] = {g: {} for g in self.names}
        # Per group: seq of the fence a give-back waits for -> its pages.
        self.pending: dict[str | None, dict[int, set[int]]] = {g: {} for g in self.names}
        self.detached: dict[str | None, set[int]] = {g: set() for g in self.names}
        self.rows: set[int] = set()
        self.use: dict[int, int] = {}  # row -> its newest recorded use (seq)
        self.held: list[tuple[Any, list[int]]] = []

    # ---------------------------------------------------------------- helpers

    def kv(self, g: str | None) -> KVPagePool:
        if g is None:
            kv = self.pool.kv
        else:
            groups = self.pool.kv_groups
            assert groups is not None
            kv = groups[g]
        assert kv is not None
        return kv

    def row_pages(self, g: str | None) -> Any:
        rp = self.pool._pages if g is None else self.pool._groups[g]  # type: ignore[index]
        assert rp is not None
        return rp

    def hold(self, t: Any) -> None:
        self.held.append((t, ids(t)))

    def fence(self) -> tuple[Any, int]:
        if self.rnd.random() < 0.5:
            f = self.stream.record()
            return f, f.seq
        return None, 0

    def give_back(self, g: str | None, row: int, pages: list[int], seq: int) -> None:
        """The model of pages a row gives back behind ``seq`` (0: none)."""
        pages = [p for p in pages if p]
        if not pages:
            return
        wait = max(self.use.get(row, 0), seq)
        if wait > self.stream.done:
            self.pending[g].setdefault(wait, set()).update(pages)

    def pick(self, n: int) -> list[int]:
        rows = sorted(self.rows)
        return self.rnd.sample(rows, min(len(rows), n))

    # ---------------------------------------------------------------- checks

    def check(self) -> None:
        pool = self.pool
        for g in self.names:
            want = np.full(self.kv(g).ledger.num_pages, FREE, dtype=np.uint8)
            want[0] = self.kv(g).ledger.states()[0]  # reserved
            for positions in self.shadow[g].values():
                for p in positions:
                    if p:
                        assert want[p] == FREE, f"page {p} listed twice by the model"
                        want[p] = OWNED
            for pages in self.pending[g].values():
                for p in pages:
                    want[p] = PENDING
            for p in self.detached[g]:
                want[p] = ALLOCATED
            got = self.kv(g).ledger.states()
            bad = np.flatnonzero(got != want)
            assert not len(bad), (
                f"group {g}: page {int(bad[0])} is {int(got[bad[0]])}, the model says "
                f"{int(want[bad[0]])}"
            )
            for row, positions in self.shadow[g].items():
                t, counts = pool.pages_of_rows([row], group=g)
                assert ids(t)[: int(counts[0])] == positions
        for t, read in self.held:
            assert ids(t) == read
        # Structural: a tensor handed out aliases a growth buffer only if
        # the row is lent (else a trim keeps that buffer and writes it).
        arrays = [t.numpy() for t, _ in self.held]
        for g in self.names:
            rp = self.row_pages(g)
            for row, buf in enumerate(rp.grown):
                if buf is None or row in rp.lent:
                    continue
                whole = buf if buf.base is None else buf.base
                for arr in arrays:
                    assert not np.may_share_memory(arr, whole), (
                        f"group {g}: a tensor handed out views row {row}'s growth "
                        "buffer, which is not lent"
                    )
        pool.check_invariants()

    # ---------------------------------------------------------------- ops

    def admit(self) -> None:
        if self.grouped:
            want: Any = {g: self.rnd.randrange(0, 5) for g in self.names}
        else:
            want = self.rnd.randrange(0, 5)
        grant = self.pool.try_admit(pages=want)
        if grant is None:
            return
        row = grant.row
        self.rows.add(row)
        self.use.pop(row, None)
        if self.grouped:
            for g in self.names:
                assert g is not None
                self.shadow[g][row] = ids(grant.pages[g])
                self.hold(grant.pages[g])
        else:
            self.shadow[None][row] = ids(grant.pages)
            self.hold(grant.pages)

    def grow(self, g: str | None) -> None:
        pool, rnd, shadow = self.pool, self.rnd, self.shadow[g]
        rows = self.pick(rnd.randrange(1, 9))
        form = rnd.randrange(4)
        if form == 0:
            row, k = rows[0], rnd.randrange(1, 4)
            got = pool.extend(row, k, group=g)
            if got is not None:
                shadow[row] += ids(got)
                self.hold(got)
        elif form == 1:
            k = rnd.randrange(1, 4)
            got = pool.extend_rows(rows, k, group=g)
            if got is not None:
                new = ids(got)
                for i, row in enumerate(rows):
                    shadow[row] += new[i * k : i * k + k]
                self.hold(got)
        elif form == 2:
            counts = [rnd.randrange(0, 4) for _ in rows]
            if not sum(counts):
                return
            got = pool.extend_rows(rows, counts, group=g)
            if got is not None:
                new, at = ids(got), 0
                for row, k in zip(rows, counts, strict=True):
                    shadow[row] += new[at : at + k]
                    at += k
                self.hold(got)
        else:
            k = rnd.randrange(1, 3)
            m, got = pool.extend_fitting(rows, k, group=g)
            new = ids(got)
            for i, row in enumerate(rows[:m]):
                shadow[row] += new[i * k : i * k + k]
            self.hold(got)

    def trim(self, g: str | None) -> None:
        rnd = self.rnd
        rows = sorted(self.rows) if rnd.random() < 0.3 else self.pick(3)
        rows.sort()
        # Every group at once (a mapping: a hybrid model's rollback), or one.
        names = self.names if self.grouped and rnd.random() < 0.4 else [g]
        keeps = {
            name: [max(0, len(self.shadow[name][row]) - rnd.randrange(0, 5)) for row in rows]
            for name in names
        }
        fence, seq = self.fence()
        if names == [g]:
            self.pool.trim_pages(rows, keeps[g], fence, group=g)
        else:
            self.pool.trim_pages(rows, keeps, fence)
        for name in names:
            shadow = self.shadow[name]
            for row, keep in zip(rows, keeps[name], strict=True):
                self.give_back(name, row, shadow[row][keep:], seq)
                shadow[row] = shadow[row][:keep]

    def long_trim(self, g: str | None) -> None:
        """A long draft rejected: more pages than the page ledger's one
        Python pass (16) given back by one row behind a fence, so that its
        pending batch is built from the record's tail (a view of the kept
        buffer) and the growth after it writes those places."""
        row = self.pick(1)[0]
        got = self.pool.extend(row, self.rnd.randrange(17, 25), group=g)
        if got is None:
            return
        positions = self.shadow[g][row]
        positions += ids(got)
        keep = max(0, len(positions) - self.rnd.randrange(17, 25))
        fence, seq = self.fence()
        self.pool.trim_pages(row, keep, fence, group=g)
        self.give_back(g, row, positions[keep:], seq)
        self.shadow[g][row] = positions[:keep]
        got = self.pool.extend(row, self.rnd.randrange(17, 25), group=g)
        if got is not None:
            self.shadow[g][row] += ids(got)

    def drop(self, g: str | None) -> None:
        row = self.pick(1)[0]
        positions = self.shadow[g][row]
        below = self.rnd.randrange(0, len(positions) + 1)
        fence, seq = self.fence()
        self.pool.drop_pages(row, below, fence, group=g)
        self.give_back(g, row, positions[:below], seq)
        self.shadow[g][row] = [0] * below + positions[below:]

    def view(self, g: str | None) -> None:
        row = self.pick(1)[0]
        if self.rnd.random() < 0.7:
            self.hold(self.pool.pages_of(row, host=self.rnd.random() < 0.5, group=g))
        else:
            rows = self.pick(4)
            t, counts = self.pool.pages_of_rows(rows, group=g)
            self.hold(t)
            self.hold(counts)

    def detach(self, g: str | None) -> None:
        row = self.pick(1)[0]
        t = self.pool.detach_pages(row, host=self.rnd.random() < 0.5, group=g)
        live = [p for p in self.shadow[g][row] if p]
        assert ids(t) == live
        self.hold(t)
        self.detached[g].update(live)
        self.shadow[g][row] = []

    def free_detached(self, g: str | None) -> None:
        if self.detached[g]:
            pages = sorted(self.detached[g])
            self.kv(g).free(pages)
            self.detached[g].clear()

    def record_use(self) -> None:
        rows = self.pick(self.rnd.randrange(1, 6))
        f = self.stream.record()
        self.pool.record_use(rows, f)
        for row in rows:
            self.use[row] = f.seq

    def free(self) -> None:
        rnd = self.rnd
        rows = self.pick(rnd.randrange(1, 4))
        fence, seq = self.fence()
        if len(rows) == 1 and fence is None and rnd.random() < 0.5:
            self.pool.free(rows[0])  # the bare int: the fast path when unused
        else:
            self.pool.free(rows, fence)
        for row in rows:
            for g in self.names:
                self.give_back(g, row, self.shadow[g].pop(row), seq)
            self.rows.discard(row)
            self.use.pop(row, None)

    def write_kept(self, g: str | None) -> None:
        """A write into a kept page: the trim gives back its tail, a growth
        may follow, the free refuses the row, nothing changed; restored
        through a fresh view, the row goes on."""
        row = self.pick(1)[0]
        positions = self.shadow[g][row]
        if len(positions) < 2 or not positions[0]:
            return  # a row that dropped pages reads a fresh tensor, not its record
        at, keep = self.rnd.randrange(len(positions) - 1), len(positions) - 1
        view = self.pool.pages_of(row, group=g)
        view[at] = positions[keep]
        fence, seq = self.fence()
        self.pool.trim_pages(row, keep, fence, group=g)
        self.give_back(g, row, positions[keep:], seq)
        self.shadow[g][row] = positions = positions[:keep]
        if self.rnd.random() < 0.5:
            got = self.pool.extend(row, 1, group=g)
            if got is not None:
                positions += ids(got)
                self.hold(got)
        before = [self.kv(name).ledger.states().tobytes() for name in self.names]
        with pytest.raises(InvalidSlotError, match="written into"):
            self.pool.free([row])
        with pytest.raises(InvalidSlotError, match="written into"):
            self.pool.free(row)  # the bare int's fast path refuses it too
        assert [self.kv(name).ledger.states().tobytes() for name in self.names] == before
        fresh = self.pool.pages_of(row, group=g)  # the record as it is now
        fresh[at] = positions[at]
        view[at] = positions[at]  # the old record, if the growth moved it
        self.hold(fresh)

    def complete(self) -> None:
        s = self.stream
        s.complete(self.rnd.randrange(s.done, s.seq + 1))
        self.pool.reclaim()
        for g in self.names:
            for seq in [q for q in self.pending[g] if q <= s.done]:
                del self.pending[g][seq]

    def step(self) -> None:
        rnd = self.rnd
        op = rnd.random()
        g = rnd.choice(self.names)
        if not self.rows or op < 0.07:
            self.admit()
        elif op < 0.27:
            self.grow(g)
        elif op < 0.30:
            self.long_trim(g)
        elif op < 0.52:
            self.trim(g)
        elif op < 0.57:
            self.drop(g)
        elif op < 0.65:
            self.view(g)
        elif op < 0.68:
            self.detach(g)
        elif op < 0.71:
            self.free_detached(g)
        elif op < 0.76:
            self.record_use()
        elif op < 0.84:
            self.write_kept(g)
        elif op < 0.90:
            self.complete()
        else:
            self.free()
        self.check()

    def finish(self) -> None:
        self.pool.free(sorted(self.rows))
        for g in self.names:
            self.free_detached(g)
        self.stream.complete()
        self.pool.reclaim()
        for g in self.names:
            kv = self.kv(g)
            assert kv.available_size() == kv.capacity
        self.pool.check_invariants()


@pytest.mark.parametrize("grouped", [False, True], ids=["one_kv", "kv_groups"])
@pytest.mark.parametrize("seed", range(4))
async def test_kept_buffers_never_change_what_was_handed_out_or_held(seed: int, grouped: bool):
    run = _Run(seed, grouped)
    for _ in range(ROWS // 2):
        run.admit()
    run.check()
    for _ in range(250):
        run.step()
    run.finish()
