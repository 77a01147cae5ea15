"""KV groups: a speculative step's growth, one page count per row in each group.

A speculative step on a hybrid model (full-attention and sliding-window
groups) grows each row by its own count of draft pages in every group.
``extend_rows(rows, {group: counts})`` and ``extend_fitting(rows, {group:
counts})`` take one count per row for a group (an int still counts for
every row) and grow every named group or none (``extend_fitting``: the
longest run of rows every group covers), so a scheduler short in the
second group has nothing to give back in the first: a rollback with
``trim_pages`` would hold the fresh pages behind the row's fences. These
tests cover the grant (pages in row order, in each group's record), the
refusal (nothing taken anywhere, counted once and in each short group),
the fitting run, the growth's own reclaim, and bad input (typed errors,
the pool exactly unchanged).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from helpers import grouped_pool as grouped
from helpers import kv_group as kv
from helpers import pool_snapshot
from test_kv_groups_extend import assert_one_refusal_only, ids, snapshot

from asyncpool import CapacityError, HostStream, InvalidSlotError, PoolClosedError


async def test_extend_rows_takes_one_count_per_row_in_each_group() -> None:
    pool = grouped(rows=4, swa=8, full=12)
    a = await pool.admit({"swa": 1, "full": 1})
    b = await pool.admit({"swa": 0, "full": 0})
    c = await pool.admit({"swa": 1, "full": 2})
    rows = [a.row, b.row, c.row]
    got = pool.extend_rows(rows, {"full": [2, 0, 1], "swa": np.array([1, 2, 0])})
    assert got is not None and list(got) == ["swa", "full"]  # the groups' order
    assert got["full"].shape == (3,) and got["swa"].shape == (3,)  # flat, row order
    full, swa = ids(got["full"]), ids(got["swa"])
    assert ids(pool.pages_of(a.row, group="full")) == ids(a.pages["full"]) + full[:2]
    assert ids(pool.pages_of(b.row, group="full")) == []
    assert ids(pool.pages_of(c.row, group="full")) == ids(c.pages["full"]) + full[2:]
    assert ids(pool.pages_of(a.row, group="swa")) == ids(a.pages["swa"]) + swa[:1]
    assert ids(pool.pages_of(b.row, group="swa")) == swa[1:]
    assert ids(pool.pages_of(c.row, group="swa")) == ids(c.pages["swa"])
    # An int counts for every row; a group left out grows by nothing.
    more = pool.extend_rows(torch.tensor([a.row, c.row]), {"full": torch.tensor([0, 1]), "swa": 1})
    assert more is not None and more["swa"].shape == (2,) and more["full"].shape == (1,)
    assert ids(pool.pages_of(c.row, group="swa"))[-1] == ids(more["swa"])[1]
    only = pool.extend_rows([b.row], {"full": (1,)})
    assert only is not None and list(only) == ["full"]
    assert kv(pool, "full").available_size() == 12 - 3 - 3 - 1 - 1
    assert kv(pool, "swa").available_size() == 8 - 2 - 3 - 2
    pool.check_invariants()
    assert pool.free(rows) == 3
    assert kv(pool, "swa").available_size() == 8 and kv(pool, "full").available_size() == 12
    pool.check_invariants()


async def test_short_in_the_second_group_takes_nothing_in_the_first() -> None:
    pool = grouped(rows=4, swa=3, full=12)
    a = await pool.admit({"swa": 1, "full": 1})
    b = await pool.admit({"swa": 1, "full": 1})
    before = snapshot(pool)
    got = pool.extend_rows([a.row, b.row], {"full": [2, 2], "swa": [1, 1]})  # swa: 1 free
    assert got is None
    assert_one_refusal_only(before, snapshot(pool), "swa")
    assert kv(pool, "full").pending_size() == 0  # nothing to give back behind a fence
    fitted = pool.extend_rows([a.row, b.row], {"full": [2, 2], "swa": [1, 0]})
    assert fitted is not None and ids(fitted["swa"]) == ids(pool.pages_of(a.row, group="swa"))[1:]
    pool.free([a.row, b.row])
    pool.check_invariants()


async def test_extend_fitting_grows_the_longest_run_every_group_covers() -> None:
    pool = grouped(rows=4, swa=4, full=12)
    a = await pool.admit({"swa": 1, "full": 1})
    b = await pool.admit({"swa": 0, "full": 1})
    c = await pool.admit({"swa": 0, "full": 1})
    rows = [a.row, b.row, c.row]
    before = snapshot(pool)
    # swa has 3 free: a's 1 and b's 2 fit, c's 1 does not; full covers all.
    m, got = pool.extend_fitting(rows, {"full": [1, 1, 1], "swa": [1, 2, 1]})
    assert m == 2 and got["full"].shape == (2,) and got["swa"].shape == (3,)
    assert ids(pool.pages_of(c.row, group="full")) == ids(c.pages["full"])  # c: nothing
    assert ids(pool.pages_of(b.row, group="swa")) == ids(got["swa"])[1:]
    assert ids(pool.pages_of(b.row, group="full"))[1:] == ids(got["full"])[1:]
    after = snapshot(pool)
    assert after[0][0]["growth_refusals"] == before[0][0]["growth_refusals"] + 1
    assert after[0][0]["kv_groups"]["swa"]["growth_refusals"] == 1
    assert after[0][0]["kv_groups"]["full"]["growth_refusals"] == 0
    # Every row fits: no refusal; nothing free in swa, a row asking 0 there still grows.
    m, got = pool.extend_fitting([c.row, a.row], {"full": [1, 0], "swa": [0, 0]})
    assert m == 2 and ids(got["full"]) == ids(pool.pages_of(c.row, group="full"))[1:]
    assert pool.stats().growth_refusals == 1
    m, got = pool.extend_fitting(rows, {"swa": [1, 0, 0]})  # swa empty: none grows
    assert m == 0 and got["swa"].shape == (0,)
    pool.free(rows)
    pool.check_invariants()


async def test_grouped_growth_each_reclaims_completed_fences() -> None:
    pool = grouped(rows=4, swa=2, full=12)
    a = await pool.admit({"swa": 2, "full": 1})
    b = await pool.admit({"swa": 0, "full": 1})
    stream = HostStream("step")
    try:
        fence = stream.record()
        fence.synchronize()
        pool.trim_pages(a.row, 0, fence=fence, group="swa")  # behind a completed fence
        got = pool.extend_rows([a.row, b.row], {"swa": [1, 1], "full": [0, 1]})
        assert got is not None and len(got["swa"]) == 2
        m, _ = pool.extend_fitting([a.row], {"swa": [1]})
        assert m == 0
    finally:
        stream.close()
    pool.free([a.row, b.row])
    pool.check_invariants()


async def test_released_and_closed() -> None:
    pool = grouped()
    await pool.release_memory()  # no row can be allocated: no rows to grow
    before = snapshot(pool)
    assert pool.extend_rows([], {"swa": []}) is None
    m, got = pool.extend_fitting([], {"swa": [], "full": 1})
    assert m == 0 and got["swa"].shape == (0,) and got["full"].shape == (0,)
    assert snapshot(pool) == before
    await pool.resume_memory()
    g = await pool.admit({"swa": 1, "full": 1})
    await pool.close()
    before = snapshot(pool)
    for call in ("extend_rows", "extend_fitting"):
        with pytest.raises(PoolClosedError):
            getattr(pool, call)([g.row], {"swa": [1]})
    assert snapshot(pool) == before


_BAD = [
    ({"full": [1]}, CapacityError, "KV group 'full': k lists 1 page counts for 2 rows"),
    ({"full": [1, -1]}, CapacityError, "KV group 'full'"),
    ({"swa": [1, 1.5]}, CapacityError, "KV group 'swa'"),
    ({"swa": [1, 1], "full": -1}, CapacityError, "KV group 'full'"),
    ({"swa": torch.ones(2, 1, dtype=torch.int64)}, CapacityError, "KV group 'swa'"),
    ({"swa": [1, 1], "mamba": [1, 1]}, ValueError, "unknown KV group 'mamba'"),
]


@pytest.mark.parametrize("call", ["extend_rows", "extend_fitting"])
@pytest.mark.parametrize(("counts", "error", "match"), _BAD)
async def test_bad_counts_change_nothing(call: str, counts: Any, error: type, match: str) -> None:
    pool = grouped()
    a = await pool.admit({"swa": 1, "full": 2})
    b = await pool.admit({"swa": 1, "full": 0})
    before = snapshot(pool)
    with pytest.raises(error, match=match):
        getattr(pool, call)([a.row, b.row], counts)
    assert snapshot(pool) == before
    pool.free([a.row, b.row])


async def test_bad_rows_and_totals_change_nothing() -> None:
    pool = grouped(swa=3)
    a = await pool.admit({"swa": 1, "full": 2})
    b = await pool.admit({"swa": 0, "full": 0})
    before = snapshot(pool)
    for call in ("extend_rows", "extend_fitting"):
        with pytest.raises(InvalidSlotError, match="a set has none"):
            getattr(pool, call)({a.row, b.row}, {"swa": [1, 1]})
        with pytest.raises(InvalidSlotError):
            getattr(pool, call)([a.row, a.row], {"swa": [1, 1]})
        with pytest.raises(InvalidSlotError):
            getattr(pool, call)([a.row, 3], {"swa": [1, 1]})  # 3: not allocated
        with pytest.raises(ValueError, match="give one or the other"):
            getattr(pool, call)([a.row], {"swa": [1]}, group="swa")
    with pytest.raises(CapacityError, match=r"KV group 'swa'.* 4 pages in all"):
        pool.extend_rows([a.row, b.row], {"swa": [2, 2]})  # past the group's 3
    with pytest.raises(CapacityError, match=r"KV group 'swa'.*could never grow"):
        pool.extend_fitting([a.row, b.row], {"swa": [0, 4]})
    assert snapshot(pool) == before
    pool.free([a.row, b.row])
    assert pool_snapshot(pool)[1] == 4  # every row free again
