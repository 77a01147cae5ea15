"""Written pages are refused where they are given back: a seeded model.

perfdrop (a31a120) cut ``drop_pages``' check to the pages it gives back, as
perftrim cut ``trim_pages``', and made a trim of a never-grown row turn its
bytes seal into a bytearray, cut in place after. The contract
(docs/api.md, "The row's record"): a caller may write into a view of a
row's record handed out; a written page is refused (``InvalidSlotError``,
nothing changed) where that page is given back, by the row's free, a drop,
a trim, and nowhere else; ``detach_pages`` hands out the row's own pages.

These seeded random runs (one kv and KV groups; page size 1 and 16) write
random values (another page of the row, another row's page, a page given
back, 0, an id out of range) into random tensors handed out (grants,
growths, ``pages_of`` views held across steps: whether each aliases a
record is the pool's business) and into records directly (a row beheaded
by earlier drops hands out fresh tensors only), restore some, and mix that
with admissions, every growth form, drops and trims of a few rows or of
every row (past ``_JOINED_CHECK``, where only some rows give pages back
too; one count or one a row; a mapping ``{group: value}`` on KV groups),
frees (the bare int's fast path too), detaches, recorded uses and fences
left pending. The model keeps every row's positions as granted; a
position is *written* where the pool's fresh table (``pages_of_rows``,
read after each write) differs from the model. Before every give-back the
model says whether it is refused: exactly when a written position is among
those it gives back. A refused call must leave ``pool.stats()``, the row
ledger, every page ledger and every record and seal (their bytes, their
object, the dropped counts) as they were; an accepted one must give back
exactly the model's pages. After every call: each page's state is the
model's, each row's table is the model's positions with the writes, and
the invariants hold.

A differential against a twin pool would share the defect it looks for;
the model is the contract itself. ``_run`` takes any seed: the review ran
120 seeds of each of the four pool kinds (480 runs of 220 steps, called
outside a loop: 33,034 give-backs, 5,122 of them refused, 8,472 past
``_JOINED_CHECK``), all as the model says; the suite keeps 3 seeds a kind,
on both loops.

Mutation sweep (review57) of a31a120's lines in ``row_pages.py``: 32
hand-made mutants, each run (pytest -x, asyncio only) against
tests/test_drop_pages.py, test_drop_costs_the_pages_it_gives_back.py,
test_trim_pages.py, test_trim_costs_the_pages_it_gives_back.py,
test_batch_count_fast_paths.py, test_kept_buffer_adversarial.py,
test_grouped_growth_and_slide_differential.py and
stress/test_kv_groups_shadow.py, then against this file alone: 30 killed
by those files and by this one alone too, 2 equivalent, no gap. "caught
by" names the file that failed first.

=====  ========================================================  ==================
id     mutant (prepare_free's loop L, _group_many J, free T,      caught by: test_*
       _behead B)
=====  ========================================================  ==================
L1     drop check misses the last page dropped                   drop_pages
L2     drop check misses the first page dropped                  drop_pages
L3     the kept pages compared, not the dropped                  drop_pages
L4     no drop check                                             drop_pages
L5     the whole record checked (the code before)                drop_costs_...
L6     half the dropped bytes compared                           drop_costs_...
L7     one page more given back than checked                     drop_pages
L8     the dropped positions not subtracted                      drop_pages
L9     the seal slice one page on                                drop_pages
J1     a drop's run one page short                               drop_costs_...
J2     a drop's run one page long                                drop_costs_...
J3     the seal slice one page on                                drop_costs_...
J4     the seal slice taken from the record (self-compare)       drop_costs_...
J5     no joined compare                                         drop_costs_...
J6     the joined compare skipped for a drop                     drop_costs_...
J7     a drop's parts as whole records (the trim-only test)      drop_costs_...
J8     the dropped positions not subtracted                      drop_costs_...
J9     rows with nothing below picked (``n >= 0``)               drop_costs_...
J10    the seal slice ignores the dropped positions              drop_costs_...
J11    one group's pages read from the joined seals              equivalent
J12    one group's pages a view of the joined bytes (no copy)    equivalent
T1     a never-grown trim cuts the seal one page short           drop_costs_...
T2     a never-grown trim leaves the seal uncut                  drop_costs_...
T3     ... the seal a memoryview of the old bytes                drop_costs_...
T4     ... the seal made from the record (a write sealed)        trim_costs_...
T5     ... the seal a view of the record's memory                drop_costs_...
T6     a grown trim cuts the bytearray one page long             drop_pages
T7     a grown trim reseals from the record                      drop_costs_...
T8     one bytearray shared by two rows of a trim                drop_costs_...
B1     a bytes seal beheaded: made from the record               drop_costs_...
B2     ... a memoryview of the old bytes                         drop_pages
B3     a bytearray seal beheaded: made from the record           drop_pages
=====  ========================================================  ==================

Equivalent: J11 (reached only when the joined records equal the joined
seals); J12 (the page ledger's ``prepare`` takes a numpy array as the
caller's memory, never fresh, and nothing writes a batch's ids).

Off a31a120's lines the sweep found one defect: ``detach_pages`` held a
numpy view of a bytearray seal while it made its tensor, so a raised
error's traceback pinned it and the row's next growth, trim or drop raised
``BufferError`` halfway (tests/test_detach_failure_leaves_the_seal_resizable.py;
none of the files above fails on it).
"""

from __future__ import annotations

import collections
import random
from typing import Any

import numpy as np
import pytest
from helpers import FakeStream, kv_snapshot, pool_snapshot
from helpers import page_ids as ids

from asyncpool import AsyncReqToTokenPool, InvalidSlotError, KVPagePool
from asyncpool.kv_pages import OWNED
from asyncpool.ledger import ALLOCATED, FREE, PENDING
from asyncpool.row_pages import _JOINED_CHECK, RowPages

ROWS = _JOINED_CHECK + 12  # a give-back of every row takes _group_many
PAGES = ROWS * 32


class _Model:
    def __init__(self, seed: int, grouped: bool, page_size: int) -> None:
        self.rnd = random.Random(seed)
        self.grouped = grouped
        self.names: list[str | None] = ["full", "swa"] if grouped else [None]
        if grouped:
            kv: Any = {
                "full": KVPagePool(PAGES + 1, page_size),
                "swa": KVPagePool(PAGES // 2 + 1, page_size),
            }
        else:
            kv = KVPagePool(PAGES + 1, page_size)
        self.pool = AsyncReqToTokenPool(ROWS + 1, 1 << 12, kv=kv)
        self.stream = FakeStream()
        # Per group: row -> positions as granted (dropped ones as 0).
        self.shadow: dict[str | None, dict[int, list[int]]] = {g: {} for g in self.names}
        # Per group: row -> {position: what its record reads there} where it
        # differs from the shadow (written into, against the contract).
        self.written: dict[str | None, dict[int, dict[int, int]]] = {g: {} for g in self.names}
        self.pending: dict[str | None, dict[int, set[int]]] = {g: {} for g in self.names}
        self.detached: dict[str | None, set[int]] = {g: set() for g in self.names}
        self.use: dict[int, int] = {}
        self.views: list[Any] = []  # int64 tensors handed out, written at random
        #: (call, past _JOINED_CHECK, refused) -> how many: what a run exercised.
        self.tally: collections.Counter[tuple[str, bool, bool]] = collections.Counter()

    # ---------------------------------------------------------------- helpers

    def kv(self, g: str | None) -> KVPagePool:
        groups = self.pool.kv_groups
        kv = self.pool.kv if g is None else (groups[g] if groups is not None else None)
        assert kv is not None
        return kv

    def rp(self, g: str | None) -> RowPages:
        rp = self.pool._pages if g is None else self.pool._pages_or_none(g, "test")
        assert rp is not None
        return rp

    @property
    def rows(self) -> list[int]:
        return sorted(self.shadow[self.names[0]])

    def hand(self, t: Any) -> None:
        if t.dim() == 1 and t.numel():
            self.views.append(t)
            del self.views[:-64]

    def fence(self) -> tuple[Any, int]:
        if self.rnd.random() < 0.4:
            f = self.stream.record()
            return f, f.seq
        return None, 0

    def give_back(self, g: str | None, row: int, pages: list[int], seq: int) -> None:
        pages = [p for p in pages if p]
        if pages:
            wait = max(self.use.get(row, 0), seq)
            if wait > self.stream.done:
                self.pending[g].setdefault(wait, set()).update(pages)

    def table(self, g: str | None, rows: list[int]) -> list[list[int]]:
        t, counts = self.pool.pages_of_rows(rows, group=g)
        return [line[: int(c)] for line, c in zip(t.tolist(), counts.tolist(), strict=True)]

    def reads(self, g: str | None, row: int) -> list[int]:
        """What the model says the row's record reads, by position."""
        out = list(self.shadow[g][row])
        for at, value in self.written[g].get(row, {}).items():
            out[at] = value
        return out

    def learn_writes(self) -> None:
        """After a write: which positions now read other than granted."""
        rows = self.rows
        for g in self.names:
            self.written[g] = {}
            for row, line in zip(rows, self.table(g, rows) if rows else [], strict=True):
                want = self.shadow[g][row]
                assert len(line) == len(want)
                diff = {i: v for i, (v, w) in enumerate(zip(line, want, strict=True)) if v != w}
                if diff:
                    self.written[g][row] = diff

    def dirty(self, g: str | None, row: int, lo: int, hi: int) -> bool:
        return any(lo <= at < hi for at in self.written[g].get(row, {}))

    def state(self) -> tuple[Any, ...]:
        """Everything a refused call must leave as it was."""
        records = []
        for g in self.names:
            rp = self.rp(g)
            for row in range(len(rp.owned)):
                pages, seal = rp.owned[row], rp.sealed[row]
                records.append(
                    (
                        None if pages is None else pages.tobytes(),
                        None if seal is None else (bytes(seal), id(seal), seal.__class__),
                        rp.grown[row] is None,
                    )
                )
            records.append(dict(rp.holes))
        return (
            pool_snapshot(self.pool),
            [kv_snapshot(self.kv(g)) for g in self.names],
            records,
        )

    def give(self, what: str, rows: list[int], refused: bool, call: Any) -> None:
        """Make the give-back ``call``; if the model says ``refused``, it
        must raise and leave everything as it was."""
        self.tally[what, len(rows) > _JOINED_CHECK, refused] += 1
        if not refused:
            call()
            return
        before = self.state()
        with pytest.raises(InvalidSlotError, match="written into"):
            call()
        assert self.state() == before

    # ---------------------------------------------------------------- checks

    def check(self) -> None:
        for g in self.names:
            want = np.full(self.kv(g).ledger.num_pages, FREE, dtype=np.uint8)
            want[0] = self.kv(g).ledger.states()[0]
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
            rows = self.rows
            if rows:
                for row, line in zip(rows, self.table(g, rows), strict=True):
                    assert line == self.reads(g, row), f"group {g} row {row}"
                    positions = self.shadow[g][row]
                    dropped = next((i for i, p in enumerate(positions) if p), len(positions))
                    assert self.pool.pages_dropped(row, group=g) == dropped
        self.pool.check_invariants()

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
        self.use.pop(row, None)
        got = grant.pages if self.grouped else {None: grant.pages}
        for g in self.names:
            self.shadow[g][row] = ids(got[g])
            self.hand(got[g])

    def grow(self, g: str | None) -> None:
        pool, rnd, shadow = self.pool, self.rnd, self.shadow[g]
        rows = sorted(rnd.sample(self.rows, min(len(self.rows), rnd.randrange(1, 9))))
        form = rnd.randrange(4)
        if form == 0:
            got = pool.extend(rows[0], rnd.randrange(1, 4), group=g)
            if got is not None:
                shadow[rows[0]] += ids(got)
                self.hand(got)
        elif form == 1:
            k = rnd.randrange(1, 3)
            got = pool.extend_rows(rows, k, group=g)
            if got is not None:
                new = ids(got)
                for i, row in enumerate(rows):
                    shadow[row] += new[i * k : i * k + k]
                self.hand(got.reshape(-1))
        elif form == 2:
            counts = [rnd.randrange(0, 3) for _ in rows]
            if not sum(counts):
                return
            got = pool.extend_rows(rows, counts, group=g)
            if got is not None:
                new, at = ids(got), 0
                for row, k in zip(rows, counts, strict=True):
                    shadow[row] += new[at : at + k]
                    at += k
                self.hand(got)
        else:
            k = rnd.randrange(1, 3)
            m, got = pool.extend_fitting(rows, k, group=g)
            new = ids(got)
            for i, row in enumerate(rows[:m]):
                shadow[row] += new[i * k : i * k + k]
            self.hand(got.reshape(-1))

    def batch(self) -> list[int]:
        """A few rows, or every row (past ``_JOINED_CHECK`` when enough are)."""
        rows = self.rows
        if self.rnd.random() < 0.4:
            return rows
        return sorted(self.rnd.sample(rows, min(len(rows), self.rnd.randrange(1, 4))))

    def drop(self, g: str | None) -> None:
        rnd = self.rnd
        rows = self.batch()
        if self.written[g] and rnd.random() < 0.3:  # a row written into, alone
            rows = [rnd.choice(sorted(self.written[g]))]
        names = self.names if self.grouped and rnd.random() < 0.3 else [g]
        belows: dict[str | None, list[int]] = {}
        for name in names:
            line = []
            for row in rows:
                positions = self.shadow[name][row]
                done = self.pool.pages_dropped(row, group=name)
                r = rnd.random()
                if r < 0.4:  # nothing more (a batch in which only some rows drop)
                    line.append(rnd.randrange(0, done + 1))
                elif r < 0.7:  # one page slid out
                    line.append(min(len(positions), done + 1))
                else:
                    line.append(rnd.randrange(done, len(positions) + 1))
            belows[name] = line
        one = rnd.random() < 0.3 and all(len(set(v)) == 1 for v in belows.values())
        args: dict[str | None, Any] = {n: (v[0] if one and v else v) for n, v in belows.items()}
        fence, seq = self.fence()
        if names == [g]:
            call = lambda: self.pool.drop_pages(rows, args[g], fence, group=g)  # noqa: E731
        else:
            call = lambda: self.pool.drop_pages(rows, args, fence)  # noqa: E731
        refused = any(
            self.dirty(n, row, 0, b) for n in names for row, b in zip(rows, belows[n], strict=True)
        )
        self.give("drop", rows, refused, call)
        if refused:
            return
        for n in names:
            for row, b in zip(rows, belows[n], strict=True):
                positions = self.shadow[n][row]
                if b > 0:
                    self.give_back(n, row, positions[:b], seq)
                    self.shadow[n][row] = [0] * b + positions[b:]

    def trim(self, g: str | None) -> None:
        rnd = self.rnd
        rows = self.batch()
        names = self.names if self.grouped and rnd.random() < 0.3 else [g]
        keeps = {
            n: [max(0, len(self.shadow[n][row]) - rnd.randrange(0, 4)) for row in rows]
            for n in names
        }
        fence, seq = self.fence()
        if names == [g]:
            call = lambda: self.pool.trim_pages(rows, keeps[g], fence, group=g)  # noqa: E731
        else:
            call = lambda: self.pool.trim_pages(rows, keeps, fence)  # noqa: E731
        refused = any(
            self.dirty(n, row, k, 1 << 30)
            for n in names
            for row, k in zip(rows, keeps[n], strict=True)
        )
        self.give("trim", rows, refused, call)
        if refused:
            return
        for n in names:
            for row, k in zip(rows, keeps[n], strict=True):
                self.give_back(n, row, self.shadow[n][row][k:], seq)
                self.shadow[n][row] = self.shadow[n][row][:k]

    def free(self) -> None:
        rnd = self.rnd
        rows = self.rows if rnd.random() < 0.1 else self.batch()[:3]
        fence, seq = self.fence()
        if len(rows) == 1 and fence is None and rnd.random() < 0.5:
            call = lambda: self.pool.free(rows[0])  # noqa: E731  (the bare int's fast path)
        else:
            call = lambda: self.pool.free(rows, fence)  # noqa: E731
        refused = any(self.written[g].get(row) for g in self.names for row in rows)
        self.give("free", rows, refused, call)
        if refused:
            return
        for row in rows:
            for g in self.names:
                self.give_back(g, row, self.shadow[g].pop(row), seq)
            self.use.pop(row, None)
        if not self.rows:  # every row went: the next batches join again
            for _ in range(ROWS - 2):
                self.admit()

    def detach(self, g: str | None) -> None:
        row = self.rnd.choice(self.rows)
        t = self.pool.detach_pages(row, host=self.rnd.random() < 0.5, group=g)
        live = [p for p in self.shadow[g][row] if p]
        assert ids(t) == live  # the row's own pages, whatever its record reads
        self.detached[g].update(live)
        self.shadow[g][row] = []
        self.written[g].pop(row, None)

    def free_detached(self, g: str | None) -> None:
        if self.detached[g]:
            self.kv(g).free(sorted(self.detached[g]))
            self.detached[g].clear()

    def view(self, g: str | None) -> None:
        row = self.rnd.choice(self.rows)
        self.hand(self.pool.pages_of(row, host=self.rnd.random() < 0.5, group=g))

    def value(self, g: str | None) -> int:
        r = self.rnd.random()
        shadow = self.shadow[g]
        live = [p for positions in shadow.values() for p in positions if p]
        if r < 0.6 and live:
            return self.rnd.choice(live)  # a page of this row or another's
        if r < 0.8:
            return self.rnd.randrange(1, self.kv(g).ledger.num_pages)  # free, pending, any
        return self.rnd.choice([0, -1, self.kv(g).ledger.num_pages + 3])

    def write_view(self, g: str | None) -> None:
        """A write into a tensor handed out at random (it may alias a record
        or be a stale copy: the pool's business)."""
        if not self.views:
            return
        t = self.rnd.choice(self.views)
        if t.is_inference() or not t.numel():
            return
        t[self.rnd.randrange(t.numel())] = self.value(g)
        self.learn_writes()

    def write_record(self, g: str | None) -> None:
        """A write straight into a row's record (as a view of it would, for a
        row beheaded by earlier drops, which hands out fresh tensors only)."""
        row = self.rnd.choice(self.rows)
        record = self.rp(g).owned[row]
        if record is None:
            return
        record[self.rnd.randrange(len(record))] = self.value(g)
        self.learn_writes()

    def restore(self) -> None:
        g = self.rnd.choice(self.names)
        if not self.written[g]:
            return
        row = self.rnd.choice(sorted(self.written[g]))
        at = self.rnd.choice(sorted(self.written[g][row]))
        record = self.rp(g).owned[row]
        assert record is not None
        record[at - self.pool.pages_dropped(row, group=g)] = self.shadow[g][row][at]
        self.learn_writes()

    def restore_all(self) -> None:
        """Every write restored (the caller mends its bug): the batches of
        every row that follow give back again."""
        for g in self.names:
            for row, places in self.written[g].items():
                record = self.rp(g).owned[row]
                assert record is not None
                d = self.pool.pages_dropped(row, group=g)
                for at in places:
                    record[at - d] = self.shadow[g][row][at]
        self.learn_writes()

    def record_use(self) -> None:
        rows = self.rnd.sample(self.rows, min(len(self.rows), self.rnd.randrange(1, 6)))
        f = self.stream.record()
        self.pool.record_use(rows, f)
        for row in rows:
            self.use[row] = f.seq

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
        if (
            len(self.rows) < 2
            or op < 0.08
            or (len(self.rows) <= _JOINED_CHECK and rnd.random() < 0.3)  # back past it
        ):
            self.admit()
        elif op < 0.25:
            self.grow(g)
        elif op < 0.40:
            self.drop(g)
        elif op < 0.52:
            self.trim(g)
        elif op < 0.57:
            self.view(g)
        elif op < 0.66:
            self.write_view(g)
        elif op < 0.74:
            self.write_record(g)
        elif op < 0.78:
            self.restore()
        elif op < 0.80:
            self.restore_all()
        elif op < 0.82:
            self.detach(g)
        elif op < 0.84:
            self.free_detached(g)
        elif op < 0.87:
            self.record_use()
        elif op < 0.92:
            self.complete()
        else:
            self.free()
        self.check()

    def finish(self) -> None:
        self.restore_all()
        self.pool.free(self.rows)
        for g in self.names:
            self.free_detached(g)
        self.stream.complete()
        self.pool.reclaim()
        for g in self.names:
            assert self.kv(g).available_size() == self.kv(g).capacity
        self.pool.check_invariants()


def _run(seed: int, grouped: bool, page_size: int, steps: int = 220) -> _Model:
    m = _Model(seed, grouped, page_size)
    for _ in range(ROWS - 2):
        m.admit()
    m.check()
    for _ in range(steps):
        m.step()
    m.finish()
    return m


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("grouped", [False, True], ids=["one_kv", "kv_groups"])
async def test_a_written_page_is_refused_exactly_where_it_is_given_back(
    grouped: bool, page_size: int
):
    tally: collections.Counter[tuple[str, bool, bool]] = collections.Counter()
    for seed in range(3):
        tally.update(_run(seed, grouped, page_size).tally)
    # Both sides of the contract, in the loop for a few rows and in the
    # joined check, for a drop and a trim.
    for call in ("drop", "trim"):
        for joined in (False, True):
            for refused in (False, True):
                assert tally[call, joined, refused], (call, joined, refused)
