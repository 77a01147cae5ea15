"""KV groups: the rules docs/api.md's *What the KV-groups recipe leaves to the
engine* states, from a hybrid-engine trial (sliding window, full attention,
Mamba state in an overlap loop).

A grouped ``extend_fitting`` answers the run's length, not the group that
stopped it: the groups whose free pages, read right after the call, no
longer cover the next row's count are the short ones (those whose
``growth_refusals`` figure the call raised), including after the call's own
reclaim. A mapping that mixes an int with one count per row answers flat in
every group. A drop is not undone by a rollback: a ``trim_pages`` to fewer
positions than were dropped leaves page 0 where the window was.
"""

from __future__ import annotations

from helpers import Streams, page_ids
from helpers import grouped_pool as grouped
from helpers import kv_group as kv


def refusals(pool: object) -> dict[str, int]:
    stats = pool.stats()  # type: ignore[attr-defined]
    return {g: s.growth_refusals for g, s in stats.kv_groups.items()}


def short_groups(pool: object, counts: dict[str, list[int]], m: int) -> set[str]:
    """The recipe: the groups whose free pages miss ``rows[m]``'s count."""
    return {
        g
        for g, each in counts.items()
        if m < len(each) and kv(pool, g).available_size() < each[m]  # type: ignore[arg-type]
    }


async def test_the_groups_whose_free_pages_miss_the_next_row_are_the_short_ones() -> None:
    # full: 5 free, 2 a row: rows 0 and 1 fit, row 2 does not; swa covers every row.
    pool = grouped(rows=4, swa=12, full=8)
    rows = [(await pool.admit({"swa": 0, "full": 1})).row for _ in range(3)]
    counts = {"full": [2, 2, 2], "swa": [1, 1, 1]}
    before = refusals(pool)
    m, got = pool.extend_fitting(rows, counts)
    assert m == 2 and len(got["full"]) == 4 and len(got["swa"]) == 2
    assert short_groups(pool, counts, m) == {"full"}
    after = refusals(pool)
    assert {g for g in after if after[g] > before[g]} == {"full"}
    # The other way round, and both at once.
    counts = {"full": [0, 1], "swa": [9, 2]}  # swa: 10 free, full: 1
    m, _ = pool.extend_fitting(rows[:2], counts)
    assert m == 1 and short_groups(pool, counts, m) == {"swa"}
    counts = {"full": [1, 1], "swa": [1, 1]}  # full 1 free, swa 1 free
    m, _ = pool.extend_fitting(rows[1:], counts)
    assert m == 1 and short_groups(pool, counts, m) == {"full", "swa"}
    counts = {"full": [0], "swa": [0]}
    m, _ = pool.extend_fitting(rows[:1], counts)
    assert m == 1 and short_groups(pool, counts, m) == set()  # every row grew
    pool.free(rows)
    pool.check_invariants()


async def test_the_short_groups_are_read_after_the_calls_own_reclaim(kit: Streams) -> None:
    pool = grouped(rows=4, swa=4, full=12)
    stream = kit.stream()
    gate = kit.gate(stream)
    a = await pool.admit({"swa": 4, "full": 1})
    b = await pool.admit({"swa": 0, "full": 1})
    fence = stream.record()
    pool.record_use([a.row], fence)
    assert pool.drop_pages([a.row], {"swa": 3}) == 0  # pending behind the fence
    assert kv(pool, "swa").available_size() == 0
    gate.open()
    fence.synchronize()  # completed; no loop turn, so the pool has not looked
    # The call's own reclaim finds the 3 pages; b's 2 are taken, a's 2 miss.
    counts = {"full": [1, 1], "swa": [2, 2]}
    m, _ = pool.extend_fitting([b.row, a.row], counts)
    assert m == 1
    assert kv(pool, "swa").available_size() == 1
    assert short_groups(pool, counts, m) == {"swa"}
    pool.free([a.row, b.row])
    pool.check_invariants()


async def test_a_mapping_mixing_an_int_and_counts_per_row_answers_flat_in_every_group() -> None:
    pool = grouped(rows=4, swa=12, full=12)
    a = await pool.admit({"swa": 1, "full": 1})
    b = await pool.admit({"swa": 1, "full": 1})
    m, got = pool.extend_fitting([a.row, b.row], {"full": 1, "swa": [1, 2]})
    assert m == 2 and got["full"].shape == (2,) and got["swa"].shape == (3,)
    assert page_ids(pool.pages_of(b.row, group="full"))[1:] == page_ids(got["full"])[1:]
    grown = pool.extend_rows([a.row, b.row], {"full": 1, "swa": [0, 1]})
    assert grown is not None and grown["full"].shape == (2,) and grown["swa"].shape == (1,)
    # An int mapping alone keeps the (rows, count) shape.
    m, got = pool.extend_fitting([a.row, b.row], {"full": 1, "swa": 1})
    assert m == 2 and got["full"].shape == (2, 1) and got["swa"].shape == (2, 1)
    pool.free([a.row, b.row])
    pool.check_invariants()


async def test_a_rollback_past_a_drop_leaves_page_zero_where_the_window_was() -> None:
    # A speculative step's drop computed from the drafted length, then a
    # rollback to the accepted one: the pages the next step reads are gone.
    pool = grouped(rows=4, swa=12, full=12)
    g = await pool.admit({"swa": 6, "full": 6})
    assert pool.drop_pages([g.row], {"swa": 4}) == 4  # below the drafted length's window
    assert pool.trim_pages([g.row], {"swa": 3, "full": 3}) == 2 + 3  # accepted: 3 positions
    assert page_ids(pool.pages_of(g.row, group="swa")) == [0, 0, 0]
    assert pool.pages_dropped(g.row, group="swa") == 3
    grown = pool.extend(g.row, {"swa": 1, "full": 1})
    assert grown is not None
    assert page_ids(pool.pages_of(g.row, group="swa")) == [0, 0, 0, *page_ids(grown["swa"])]
    pool.free([g.row])
    pool.check_invariants()
