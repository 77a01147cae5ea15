"""Hypothesis stateful test of a row's page positions against a list model.

A row's pages by position, as ``pages_of`` reads them, are modelled as a
plain list per row and group: its page ids in order, a dropped position as
0. Every call that changes a row's pages moves the model the naive way:
``try_admit`` (a new list; rows come back from ``free`` and are admitted
again), ``extend`` and ``extend_rows`` (one count, or one per row: appended
after the last position), ``drop_pages`` (the first ``below`` positions
read 0), ``trim_pages`` (cut to ``keep`` positions), ``detach_pages`` (the
live ids handed over, the list emptied; the caller frees them to the page
pool), and ``free``. No use is recorded, so every page given back is free
at once, and a growth is refused exactly when the model's free pages fall
short.

After every step, every allocated row's ``pages_of`` (device form and
``host=True``) and ``pages_dropped`` must read as the model does: a read
never stale after any mutation. The tensors the pool handed out
(``grant.pages``, ``extend``'s, ``pages_of``'s) must keep what they read,
except those of a row trimmed since (a trim keeps the record in its buffer,
and the next growth writes over the cut places: docs/api.md). ``pages_of`` of a
row with dropped positions is a fresh tensor: the caller writes into it
and nothing changes. A second machine runs the same rules on a pool with
two KV groups, each call naming its group.
"""

from __future__ import annotations

from typing import Any

import torch
from helpers import page_ids
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from asyncpool import AsyncReqToTokenPool, KVPagePool

SIZE = 4  # rows 1..3
NUM_PAGES = 17  # pages 1..16 per page pool

# (row, group, tensor, what it read when handed out)
Held = tuple[int, Any, torch.Tensor, list[int]]


class PositionsMachine(RuleBasedStateMachine):
    groups: tuple[Any, ...] = (None,)

    def __init__(self) -> None:
        super().__init__()
        if self.groups == (None,):
            self.pool = AsyncReqToTokenPool(SIZE, 64, kv=KVPagePool(NUM_PAGES, 2))
        else:
            self.pool = AsyncReqToTokenPool(
                SIZE, 64, kv={g: KVPagePool(NUM_PAGES, 2) for g in self.groups}
            )
        self.model: dict[int, dict[Any, list[int]]] = {}
        self.held: list[Held] = []

    # ------------------------------------------------------------ model

    def free_pages(self, group: Any) -> int:
        live = sum(1 for pos in self.model.values() for p in pos[group] if p)
        return NUM_PAGES - 1 - live

    def kv(self, group: Any) -> KVPagePool:
        if group is None:
            kv = self.pool.kv
            assert kv is not None
            return kv
        groups = self.pool.kv_groups
        assert groups is not None
        return groups[group]

    def hold(self, row: int, group: Any, t: torch.Tensor) -> None:
        self.held.append((row, group, t, page_ids(t)))

    def pick(self, data: st.DataObject) -> tuple[int, Any]:
        row = data.draw(st.sampled_from(sorted(self.model)), label="row")
        group = data.draw(st.sampled_from(self.groups), label="group")
        return row, group

    # ------------------------------------------------------------ rules

    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        counts = {g: data.draw(st.integers(0, 6), label=f"pages {g}") for g in self.groups}
        if self.groups == (None,):
            grant: Any = self.pool.try_admit(pages=counts[None])
        else:
            grant = self.pool.try_admit(counts)
        short = len(self.model) == SIZE - 1 or any(
            counts[g] > self.free_pages(g) for g in self.groups
        )
        assert (grant is None) == short
        if grant is None:
            return
        row = grant.row
        assert row not in self.model
        tensors = {None: grant.pages} if self.groups == (None,) else grant.pages
        self.model[row] = {g: page_ids(tensors[g]) for g in self.groups}
        for g in self.groups:
            self.hold(row, g, tensors[g])

    @precondition(lambda self: self.model)
    @rule(data=st.data(), k=st.integers(1, 4))
    def extend(self, data: st.DataObject, k: int) -> None:
        row, group = self.pick(data)
        new = self.pool.extend(row, k, group=group)
        assert (new is None) == (k > self.free_pages(group))
        if new is not None:
            self.model[row][group] += page_ids(new)
            self.hold(row, group, new)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def extend_rows(self, data: st.DataObject) -> None:
        rows = data.draw(st.lists(st.sampled_from(sorted(self.model)), min_size=1, unique=True))
        group = data.draw(st.sampled_from(self.groups), label="group")
        counts: Any = data.draw(
            st.integers(1, 2) | st.lists(st.integers(0, 2), min_size=len(rows), max_size=len(rows))
        )
        per = [counts] * len(rows) if isinstance(counts, int) else counts
        if not sum(per):
            return  # a sum of 0 is a CapacityError (tests/test_extend_rows.py)
        new = self.pool.extend_rows(rows, counts, group=group)
        assert (new is None) == (sum(per) > self.free_pages(group))
        if new is None:
            return
        self.hold(-1, group, new)  # no row's record after a trim is a view of it
        ids = page_ids(new)  # row by row, in order, for both forms
        at = 0
        for row, k in zip(rows, per, strict=True):
            self.model[row][group] += ids[at : at + k]
            at += k
        assert at == len(ids)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def drop(self, data: st.DataObject) -> None:
        row, group = self.pick(data)
        pos = self.model[row][group]
        below = data.draw(st.integers(0, len(pos)), label="below")
        gone = sum(1 for p in pos[:below] if p)
        assert self.pool.drop_pages(row, below, group=group) == gone
        pos[:below] = [0] * below

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def trim(self, data: st.DataObject) -> None:
        row, group = self.pick(data)
        pos = self.model[row][group]
        keep = data.draw(st.integers(0, len(pos) + 1), label="keep")
        gone = sum(1 for p in pos[keep:] if p)
        assert self.pool.trim_pages(row, keep, group=group) == gone
        del pos[keep:]
        # The next growth may write over the cut places of the row's buffer.
        self.held = [h for h in self.held if (h[0], h[1]) != (row, group)]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def detach(self, data: st.DataObject) -> None:
        row, group = self.pick(data)
        pos = self.model[row][group]
        out = self.pool.detach_pages(row, group=group)
        assert page_ids(out) == [p for p in pos if p]
        pos.clear()
        self.kv(group).free(out)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        row = data.draw(st.sampled_from(sorted(self.model)), label="row")
        assert self.pool.free(row) == 1
        del self.model[row]

    @precondition(lambda self: self.model)
    @rule(data=st.data(), host=st.booleans(), write=st.booleans())
    def read(self, data: st.DataObject, host: bool, write: bool) -> None:
        """``pages_of``, kept (it must keep what it read) or, for a row with
        dropped positions (a fresh tensor), written into by the caller."""
        row, group = self.pick(data)
        out = self.pool.pages_of(row, host=host, group=group)
        assert page_ids(out) == self.model[row][group]
        if write and self.pool.pages_dropped(row, group=group):
            out.fill_(1)
        else:
            self.hold(row, group, out)

    # ------------------------------------------------------------ checks

    @invariant()
    def reads_as_the_model(self) -> None:
        for row, groups in self.model.items():
            for group, pos in groups.items():
                assert page_ids(self.pool.pages_of(row, group=group)) == pos
                assert page_ids(self.pool.pages_of(row, host=True, group=group)) == pos
                lead = next((i for i, p in enumerate(pos) if p), len(pos))  # the zeros
                assert self.pool.pages_dropped(row, group=group) == lead

    @invariant()
    def handed_out_tensors_keep_what_they_read(self) -> None:
        for row, group, t, seen in self.held:
            assert page_ids(t) == seen, (row, group)

    @invariant()
    def pools_are_consistent(self) -> None:
        self.pool.check_invariants()
        for g in self.groups:
            self.kv(g).check_invariants()
            assert self.kv(g).available_size() == self.free_pages(g)


class GroupedPositionsMachine(PositionsMachine):
    groups = ("swa", "full")


_SETTINGS = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
PositionsMachine.TestCase.settings = _SETTINGS
GroupedPositionsMachine.TestCase.settings = _SETTINGS
TestPositionsMachine = PositionsMachine.TestCase
TestGroupedPositionsMachine = GroupedPositionsMachine.TestCase
