"""Differential: a grouped growth against the same work done group by group,
and a window's slide dropped in one call against the same drops row by row.

Seeded random runs (the same draws every run) on two pools built alike: one
takes the call under test, the other the reference work, and after every
step both must agree on everything observable: the pages handed out, each
row's positions and dropped count in each group, the row ledger and every
group's page ledger (its free ring included, so the next take agrees too),
and the errors of bad input (the same type and message, both pools as they
were). A model of each row's positions, kept by the test from the pages it
was handed, checks both; every tensor handed out is kept and must still
read what it read when handed out (a drop or a growth writes nothing a
caller holds). Batches reach past ``_JOINED_CHECK`` rows, where the
give-back checks and cuts the rows' records at once, and the growth after a
drop takes the one-page-a-row fast path (its buffer a view past the
dropped places).
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from helpers import kv_snapshot, ledger_snapshot, page_ids

from asyncpool import AsyncReqToTokenPool, CapacityError, InvalidSlotError, KVPagePool
from asyncpool.row_pages import _JOINED_CHECK

ROWS = _JOINED_CHECK + 24
GROUPS = ("full", "swa")
SEEDS = [1, 2, 3]


def make(full: int, swa: int) -> AsyncReqToTokenPool:
    return AsyncReqToTokenPool(
        ROWS + 1, 1 << 12, kv={"full": KVPagePool(full + 1, 4), "swa": KVPagePool(swa + 1, 4)}
    )


def state(pool: AsyncReqToTokenPool) -> tuple[Any, ...]:
    """Everything the two pools must agree on (invariants checked on the way)."""
    pool.check_invariants()
    groups = pool.kv_groups
    assert groups is not None
    rows = pool._ledger.allocated_rows()
    per = tuple(
        (r, g, page_ids(pool.pages_of(r, group=g)), pool.pages_dropped(r, group=g))
        for r in rows
        for g in GROUPS
    )
    kvs = []
    for g in GROUPS:
        snap = list(kv_snapshot(groups[g]))
        snap[2] = {k: v for k, v in snap[2].items() if k != "growth_refusals"}
        kvs.append(tuple(snap))
    return ledger_snapshot(pool._ledger), tuple(kvs), per


class Model:
    """Each row's positions per group (0: dropped), from the pages handed out,
    and every tensor handed out with what it read then."""

    def __init__(self) -> None:
        self.pos: dict[int, dict[str, list[int]]] = {}
        self.handed: list[tuple[torch.Tensor, list[int]]] = []

    def hand(self, t: torch.Tensor) -> None:
        self.handed.append((t, page_ids(t)))

    def admit(self, row: int, pages: dict[str, torch.Tensor]) -> None:
        self.pos[row] = {g: page_ids(pages[g]) for g in GROUPS}
        for t in pages.values():
            self.hand(t)

    def check(self, pool: AsyncReqToTokenPool) -> None:
        for row, groups in self.pos.items():
            for g, want in groups.items():
                assert page_ids(pool.pages_of(row, group=g)) == want
                dropped = next((i for i, p in enumerate(want) if p), len(want))
                assert pool.pages_dropped(row, group=g) == dropped
        for t, read in self.handed:
            assert page_ids(t) == read, "a tensor handed out changed under its holder"


def admit_all(pools: list[AsyncReqToTokenPool], model: Model, rng: random.Random) -> None:
    for _ in range(ROWS):
        want = {"full": rng.randint(0, 2), "swa": rng.randint(1, 2)}
        grants = [p.try_admit(want) for p in pools]
        assert all(gr is not None for gr in grants)
        assert len({gr.row for gr in grants if gr is not None}) == 1
        first = grants[0]
        assert first is not None
        for gr in grants[1:]:
            assert gr is not None
            for g in GROUPS:
                assert page_ids(gr.pages[g]) == page_ids(first.pages[g])
        model.admit(first.row, first.pages)


def count_draw(rng: random.Random, n: int) -> int | list[int]:
    if rng.random() < 0.5:
        return rng.randint(0, 2)
    return [rng.randint(0, 3) for _ in range(n)]


def rows_draw(rng: random.Random, allocated: list[int]) -> list[int]:
    n = rng.choice([1, 3, _JOINED_CHECK - 1, _JOINED_CHECK + 1, len(allocated)])
    return rng.sample(allocated, min(n, len(allocated)))


def apply_growth(model: Model, rows: list[int], counts: dict[str, Any], got: Any) -> None:
    """Record a grouped growth's answer in the model, checking its form."""
    flat = any(not isinstance(k, int) for k in counts.values())
    for g, k in counts.items():
        t = got[g]
        each = [k] * len(rows) if isinstance(k, int) else k
        if flat:
            assert t.dim() == 1 and t.shape[0] == sum(each)
        else:
            assert tuple(t.shape) == (len(rows), k)
        ids = page_ids(t)
        model.hand(t)
        at = 0
        for row, c in zip(rows, each, strict=True):
            model.pos[row][g] += ids[at : at + c]
            at += c


@pytest.mark.parametrize("seed", SEEDS)
async def test_a_grouped_growth_is_the_same_work_group_by_group(seed: int) -> None:
    rng = random.Random(seed)
    grouped, apart = make(full=ROWS * 9, swa=ROWS * 7), make(full=ROWS * 9, swa=ROWS * 7)
    model = Model()
    admit_all([grouped, apart], model, rng)
    rows_all = list(model.pos)
    for step in range(60):
        rows = rows_draw(rng, rows_all)
        n = len(rows)
        names = rng.choice([GROUPS, ("full",), ("swa",)])
        counts = {g: count_draw(rng, n) for g in names}
        action = rng.random()
        if action < 0.1:
            # Bad input in one group: the same error from both, nothing changed.
            bad = dict(counts)
            bad[rng.choice(names)] = rng.choice([-1, ROWS * 100, 1.5])
            before = state(grouped)
            with pytest.raises(CapacityError) as caught:
                grouped.extend_rows(rows, bad)
            assert "KV group" in str(caught.value)
            assert state(grouped) == before
            continue
        if action < 0.15:
            free_row = rows_all[0]
            grouped.free([free_row])
            apart.free([free_row])
            before = state(grouped)
            with_freed = [*rows, free_row] if free_row not in rows else rows
            with pytest.raises(InvalidSlotError) as a:
                grouped.extend_rows(with_freed, {g: 1 for g in names})
            with pytest.raises(InvalidSlotError) as b:
                apart.extend_rows(with_freed, 1, group=names[0])
            assert str(a.value) == str(b.value)
            assert state(grouped) == before
            again = {g: 1 for g in GROUPS}
            ga, gb = grouped.try_admit(again), apart.try_admit(again)
            assert ga is not None and gb is not None and ga.row == gb.row == free_row
            model.admit(ga.row, ga.pages)
            continue
        if action < 0.3:
            # Give some back (a trim or a window's drop), alike in both.
            keep = {g: rng.randint(0, 6) for g in GROUPS}
            for pool in (grouped, apart):
                pool.trim_pages(rows, keep)
            for row in rows:
                for g in GROUPS:
                    del model.pos[row][g][keep[g] :]
            continue
        each = {g: [k] * n if isinstance(k, int) else k for g, k in counts.items()}
        groups = apart.kv_groups
        assert groups is not None
        short = any(sum(each[g]) > groups[g].available_size() for g in names)
        before = state(grouped)
        got = grouped.extend_rows(rows, counts)
        if short:
            assert got is None
            assert state(grouped) == before  # nothing taken in any group
            continue
        assert got is not None
        flat = any(not isinstance(k, int) for k in counts.values())
        for g in names:
            k = counts[g]
            ref: Any
            if isinstance(k, int) and not flat:
                ref = apart.extend_rows(rows, k, group=g) if k else torch.zeros((n, 0))
            else:
                ref = apart.extend_rows(rows, [k] * n if isinstance(k, int) else k, group=g)
            assert ref is not None
            assert page_ids(got[g]) == page_ids(ref), (step, g)
        apply_growth(model, rows, counts, got)
        assert state(grouped) == state(apart), step
        model.check(grouped)
    model.check(grouped)
    model.check(apart)


@pytest.mark.parametrize("seed", SEEDS)
async def test_a_window_slide_in_one_call_is_the_same_as_row_by_row(seed: int) -> None:
    rng = random.Random(seed)
    batched, by_row = make(full=ROWS * 50, swa=ROWS * 70), make(full=ROWS * 50, swa=ROWS * 70)
    model = Model()
    admit_all([batched, by_row], model, rng)
    rows_all = list(model.pos)
    for step in range(80):
        # A decode step: every row grows a swa page (one call, the fast path
        # after a drop), some a full page.
        if rng.random() < 0.7:
            grow = {"swa": 1, "full": rng.randint(0, 1)}
            outs = [p.extend_rows(rows_all, grow) for p in (batched, by_row)]
            assert outs[0] is not None and outs[1] is not None
            for g in GROUPS:
                assert page_ids(outs[0][g]) == page_ids(outs[1][g])
            apply_growth(model, rows_all, grow, outs[0])
        rows = rows_draw(rng, rows_all)
        positions = {r: len(model.pos[r]["swa"]) for r in rows}
        belows = [rng.randint(max(0, positions[r] - 3), positions[r]) for r in rows]
        bad = rng.random()
        if bad < 0.1:
            # One row's below past its positions: the same error, nothing dropped.
            i = rng.randrange(len(rows))
            belows[i] = positions[rows[i]] + rng.randint(1, 3)
            before = state(batched)
            with pytest.raises(CapacityError) as a:
                batched.drop_pages(rows, {"swa": belows})
            with pytest.raises(CapacityError) as b:
                by_row.drop_pages([rows[i]], {"swa": belows[i]})
            assert str(a.value) == str(b.value)
            assert state(batched) == before == state(by_row)
            continue
        if bad < 0.2:
            # A record written into: the same refusal, nothing dropped.
            victim = next((r for r in rows if any(model.pos[r]["swa"])), None)
            if victim is None:
                continue
            for pool in (batched, by_row):
                record = pool._groups["swa"].owned[victim]
                assert record is not None and len(record)
                record[0] += 1
            before = state(batched)
            with pytest.raises(InvalidSlotError) as a:
                batched.drop_pages(rows, {"swa": [positions[r] for r in rows]})
            with pytest.raises(InvalidSlotError) as b:
                by_row.drop_pages([victim], {"swa": positions[victim]})
            assert str(a.value) == str(b.value)
            assert state(batched) == before
            for pool in (batched, by_row):
                record = pool._groups["swa"].owned[victim]
                assert record is not None
                record[0] -= 1
            continue
        freed_a = batched.drop_pages(rows, {"swa": belows})
        freed_b = sum(by_row.drop_pages([r], {"swa": b}) for r, b in zip(rows, belows, strict=True))
        assert freed_a == freed_b
        for r, b in zip(rows, belows, strict=True):
            line = model.pos[r]["swa"]
            line[: min(b, len(line))] = [0] * min(b, len(line))
        assert state(batched) == state(by_row), step
        model.check(batched)
    model.check(by_row)
