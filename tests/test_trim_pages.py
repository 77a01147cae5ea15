"""``pool.trim_pages(row, keep, fence=None, *, after=None)``: a row gives
back its pages past the first ``keep`` and keeps the rest.

Speculative decoding grows a row for its draft tokens and rolls back what
the verify step rejected; a scheduler under memory pressure may shrink a
request instead of preempting it. The pages given back wait, as at
``free``, for the row's recorded uses plus ``fence``/``after``: the step in
flight may still write them (the race test below hands them out early
when the row's use is left out). A bad call raises a typed error and
changes nothing.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from helpers import BAD_COUNTS_FOR_TWO_ROWS, EventFence, Streams, bounded, kv_pool_state, spin
from helpers import page_ids as ids

from asyncpool import (
    AsyncReqToTokenPool,
    CapacityError,
    InvalidSlotError,
    KVPagePool,
    ReqToTokenPoolInfo,
    wait_fence,
)


def make(rows: int = 4, pages: int = 16, **kw: object) -> AsyncReqToTokenPool:
    return AsyncReqToTokenPool(rows + 1, 64, kv=KVPagePool(pages + 1, 4), **kw)  # type: ignore[arg-type]


state = kv_pool_state


async def test_the_tail_waits_for_the_rows_use_and_is_never_handed_out_before(kit: Streams):
    """The race: a step still writes the row's draft pages when the CPU
    rolls them back. Trimmed behind the row's recorded use, no admission
    gets them until that step's fence completes."""
    stream = kit.stream()
    gate = kit.gate(stream)
    async with make(rows=2, pages=6) as pool:
        g = await pool.admit(pages=6)
        step = stream.record()  # the step in flight writes all six pages
        pool.record_use([g.row], step)
        tail = ids(g.pages)[2:]
        assert pool.trim_pages(g.row, 2) == 0
        assert ids(pool.pages_of(g.row)) == ids(g.pages)[:2]
        kv = pool.kv
        assert kv is not None
        assert kv.pending_size() == 4 and kv.available_size() == 0
        assert pool.try_admit(pages=1) is None  # not before the step ends
        waiter = asyncio.ensure_future(pool.admit(pages=4))
        await spin()
        assert not waiter.done()
        gate.open()
        async with bounded():
            got = await waiter
        assert sorted(ids(got.pages)) == sorted(tail)
        pool.free([got.row])
        pool.free([g.row])
        pool.check_invariants()


async def test_without_the_rows_use_the_tail_is_free_at_once():
    """What the race test guards against: no recorded use, no fence: the
    tail is free at once and goes to a queued admission in the call."""
    async with make(rows=2, pages=6) as pool:
        g = await pool.admit(pages=6)
        waiter = asyncio.ensure_future(pool.admit(pages=3))
        await spin()
        assert pool.waiting() == 1
        assert pool.trim_pages(g.row, 3) == 3
        assert pool.waiting() == 0  # granted inside the call
        async with bounded():
            got = await waiter
        assert sorted(ids(got.pages)) == sorted(ids(g.pages)[3:])


async def test_fence_and_after_are_waited_for_as_well(kit: Streams):
    stream = kit.stream()
    gate = kit.gate(stream)
    transfer = kit.event_fence()
    async with make(rows=1, pages=4) as pool:
        g = await pool.admit(pages=4)
        assert pool.trim_pages(g.row, 1, transfer, after=stream) == 0
        kv = pool.kv
        assert kv is not None
        assert kv.pending_size() == 3
        transfer.set()
        pool.reclaim()
        assert kv.pending_size() == 3  # still behind the fence recorded on `after`
        gate.open()
        stream.synchronize()
        pool.reclaim()
        assert kv.pending_size() == 0 and kv.available_size() == 3


async def test_trim_to_nothing_then_free_frees_the_row_alone():
    async with make(rows=1, pages=4) as pool:
        g = await pool.admit(pages=4)
        assert pool.trim_pages(g.row, 0) == 4
        assert ids(pool.pages_of(g.row)) == []
        kv = pool.kv
        assert kv is not None
        assert kv.available_size() == 4
        assert pool.free([g.row]) == 1
        assert kv.available_size() == 4
        pool.check_invariants()
        kv.check_invariants()


async def test_keeping_as_many_or_more_than_the_row_owns_changes_nothing():
    async with make(rows=2, pages=4) as pool:
        g = await pool.admit(pages=2)
        before = state(pool)
        assert pool.trim_pages(g.row, 2) == 0
        assert pool.trim_pages(g.row, 100) == 0
        assert state(pool) == before
        empty = await pool.admit(pages=0)
        assert pool.trim_pages(empty.row, 0) == 0


async def test_a_trimmed_row_grows_again_without_touching_the_pending_tail(kit: Streams):
    """The record stays a view of the row's growth buffer, and a later
    extend writes over the cut places: the pages held behind the fence
    must be a copy, so that the tail released later is the one trimmed."""
    stream = kit.stream()
    gate = kit.gate(stream)
    async with make(rows=1, pages=12) as pool:
        g = await pool.admit(pages=1)
        grown = pool.extend(g.row, 5)  # the record now lives in a growth buffer
        assert grown is not None
        owned = ids(pool.pages_of(g.row))
        pool.record_use([g.row], stream.record())
        assert pool.trim_pages(g.row, 2) == 0
        again = pool.extend(g.row, 3)  # written over the cut places
        assert again is not None
        assert ids(pool.pages_of(g.row)) == owned[:2] + ids(again)
        assert not set(ids(again)) & set(owned)
        gate.open()
        stream.synchronize()
        kv = pool.kv
        assert kv is not None
        pool.reclaim()
        assert kv.pending_size() == 0
        free_now = kv.alloc(kv.available_size())
        assert free_now is not None
        assert set(owned[2:]) <= set(ids(free_now))  # the tail trimmed, not the new pages
        kv.free(free_now)
        assert pool.free([g.row]) == 1
        pool.check_invariants()
        kv.check_invariants()


async def test_a_granted_record_trims_and_frees_with_its_seal():
    """A row never extended keeps its grant's record (a bytes seal): the
    seal is cut with it, so the row's later free accepts the record."""
    async with make(rows=1, pages=4) as pool:
        g = await pool.admit(pages=3)
        assert pool.trim_pages(g.row, 1) == 2
        assert pool.extend(g.row, 1) is not None
        assert len(ids(pool.pages_of(g.row))) == 2
        pool.free([g.row])
        kv = pool.kv
        assert kv is not None
        assert kv.available_size() == 4
        pool.check_invariants()
        kv.check_invariants()


@pytest.mark.parametrize(
    ("keep", "error"),
    [
        (-1, CapacityError),
        (1.5, CapacityError),
        (True, CapacityError),
        ("2", CapacityError),
        (torch.tensor([1, 2]), CapacityError),
    ],
)
async def test_a_bad_keep_raises_and_changes_nothing(keep: object, error: type[Exception]):
    async with make(rows=1, pages=4) as pool:
        g = await pool.admit(pages=4)
        before = state(pool)
        with pytest.raises(error, match="keep"):
            pool.trim_pages(g.row, keep)  # type: ignore[arg-type]
        assert state(pool) == before


async def test_integer_scalars_are_taken_as_keep():
    import numpy as np

    async with make(rows=1, pages=4) as pool:
        g = await pool.admit(pages=4)
        assert pool.trim_pages(g.row, np.int64(3)) == 1  # type: ignore[arg-type]
        assert pool.trim_pages(g.row, torch.tensor(2)) == 1  # type: ignore[arg-type]
        assert len(ids(pool.pages_of(g.row))) == 2


async def test_bad_rows_fences_and_records_raise_and_change_nothing(kit: Streams):
    stream = kit.stream()
    kit.gate(stream)
    async with make(rows=2, pages=8) as pool:
        g = await pool.admit(pages=4)
        pool.record_use([g.row], stream.record())
        before = state(pool)
        for row in (0, 99, g.row + 1, True, 1.0):
            with pytest.raises(InvalidSlotError):
                pool.trim_pages(row, 1)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            pool.trim_pages(g.row, 1, fence=object())  # type: ignore[arg-type]
        with pytest.raises(TypeError):  # refused even where nothing would be trimmed
            pool.trim_pages(g.row, 10, fence=object())  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            pool.trim_pages(g.row, 10, after=object())
        with pytest.raises(TypeError):
            pool.trim_pages(g.row, 1, after=torch.zeros(1))
        seq = stream.record().seq
        record = pool.pages_of(g.row)
        last = int(record[3])
        record[3] = record[0]  # written into, against the contract
        with pytest.raises(InvalidSlotError, match="written into"):
            pool.trim_pages(g.row, 1)
        with pytest.raises(InvalidSlotError, match="written into"):
            pool.trim_pages(g.row, 1, after=stream)
        record[3] = last  # restored
        assert state(pool) == before
        assert stream.record().seq == seq + 1  # a refused call records no fence on `after`


async def test_a_pool_without_pages_refuses_clearly():
    async with AsyncReqToTokenPool(3, 8) as pool:
        rows = await pool.alloc(1)
        with pytest.raises(CapacityError, match="no KV pages"):
            pool.trim_pages(rows[0], 0)


async def test_an_explicit_pool_returns_the_tail_at_retire(kit: Streams):
    stream = kit.stream()
    async with make(rows=1, pages=4, reclaim="explicit") as pool:
        g = await pool.admit(pages=4)
        step = stream.record()
        pool.record_use([g.row], step)
        stream.synchronize()  # done, but an explicit pool waits for retire()
        assert pool.trim_pages(g.row, 1) == 0
        assert pool.retire(step) == (0, 3)


async def test_a_faulted_use_quarantines_the_tail():
    async with make(rows=1, pages=4) as pool:
        g = await pool.admit(pages=4)
        broken = EventFence()
        broken.error = RuntimeError("transfer failed")
        broken.set()
        pool.record_use([g.row], broken)
        assert pool.trim_pages(g.row, 2) == 0
        kv = pool.kv
        assert kv is not None
        assert kv.stats().quarantined == 2
        assert ids(pool.pages_of(g.row)) == ids(g.pages)[:2]


# ---------------------------------------------------------------- a step's rows at once


async def test_a_steps_rows_trim_in_one_call_each_to_its_own_keep(kit: Streams):
    stream = kit.stream()
    gate = kit.gate(stream)
    async with make(rows=3, pages=12) as pool:
        a, b, c = [await pool.admit(pages=4) for _ in range(3)]
        rows = [a.row, b.row, c.row]
        owned = {r: ids(pool.pages_of(r)) for r in rows}
        pool.record_use(rows, stream.record())  # the step in flight writes them all
        assert pool.trim_pages(rows, [1, 4, 0]) == 0
        assert ids(pool.pages_of(a.row)) == owned[a.row][:1]
        assert ids(pool.pages_of(b.row)) == owned[b.row]  # owns no more than it keeps
        assert ids(pool.pages_of(c.row)) == []
        kv = pool.kv
        assert kv is not None
        assert kv.pending_size() == 7
        assert len(kv.ledger.pending_batches()) == 1  # one deferral for the step's rows
        gate.open()
        stream.synchronize()
        pool.reclaim()
        assert kv.available_size() == 7
        assert pool.free(rows) == 3
        pool.check_invariants()
        kv.check_invariants()


async def test_rows_with_different_uses_each_wait_for_their_own(kit: Streams):
    stream = kit.stream()
    gate = kit.gate(stream)
    transfer = kit.event_fence()
    async with make(rows=2, pages=8) as pool:
        a, b = await pool.admit(pages=4), await pool.admit(pages=4)
        pool.record_use([a.row], transfer)  # a's KV still arrives by transfer
        pool.record_use([b.row], stream.record())
        assert pool.trim_pages([a.row, b.row], 2) == 0
        kv = pool.kv
        assert kv is not None
        assert kv.pending_size() == 4
        gate.open()
        stream.synchronize()
        pool.reclaim()
        assert kv.pending_size() == 2  # b's tail is back, a's waits for the transfer
        free_now = kv.alloc(kv.available_size())
        assert free_now is not None
        assert set(ids(b.pages)[2:]) <= set(ids(free_now))
        assert not set(ids(a.pages)[2:]) & set(ids(free_now))
        kv.free(free_now)
        transfer.set()
        pool.reclaim()
        assert kv.pending_size() == 0


@pytest.mark.parametrize("keep", BAD_COUNTS_FOR_TWO_ROWS)
async def test_a_bad_keep_per_row_raises_and_changes_nothing(keep: object):
    async with make(rows=2, pages=8) as pool:
        rows = [(await pool.admit(pages=4)).row for _ in range(2)]
        before = state(pool)
        with pytest.raises(CapacityError, match="keep"):
            pool.trim_pages(rows, keep)  # type: ignore[arg-type]
        assert state(pool) == before


async def test_keep_per_row_takes_arrays_and_tensors():
    import numpy as np

    async with make(rows=2, pages=8) as pool:
        rows = [(await pool.admit(pages=4)).row for _ in range(2)]
        assert pool.trim_pages(torch.tensor(rows), np.array([3, 2], dtype=np.int32)) == 3
        assert pool.trim_pages(rows, torch.tensor([1, 1])) == 3
        assert [len(ids(pool.pages_of(r))) for r in rows] == [1, 1]


async def test_duplicate_or_free_rows_raise_and_change_nothing():
    async with make(rows=3, pages=8) as pool:
        a = await pool.admit(pages=4)
        b = await pool.admit(pages=2)
        free_row = (await pool.admit(pages=0)).row
        pool.free([free_row])
        before = state(pool)
        with pytest.raises(InvalidSlotError):
            pool.trim_pages([a.row, a.row], 1)
        with pytest.raises(InvalidSlotError):
            pool.trim_pages([b.row, free_row], 1)
        assert state(pool) == before


async def test_one_written_record_among_the_rows_refuses_the_whole_call():
    async with make(rows=2, pages=8) as pool:
        a, b = await pool.admit(pages=3), await pool.admit(pages=3)
        before = state(pool)
        record = pool.pages_of(b.row)
        last = int(record[2])
        record[2] = int(a.pages[0])  # b's record now lists one of a's pages
        with pytest.raises(InvalidSlotError, match="written into"):
            pool.trim_pages([a.row, b.row], 1)
        record[2] = last
        assert state(pool) == before


@pytest.mark.parametrize("growth", ["extend", "extend_rows", "extend_rows_counts", "fitting"])
async def test_growth_after_a_trim_leaves_tensors_handed_out_before_as_they_read(
    growth: str,
) -> None:
    """Speculative decoding trims a row's rejected drafts and grows it again
    at the next step, while the step in flight still reads the block table
    it was given (``pages_of`` on a CPU pool: a view of the row's record).
    The new pages must not land in that tensor's places past ``keep``: it
    keeps what it read (the row's record grew in a buffer with room, and a
    growth there after the trim used to write them)."""
    pool = make(rows=2, pages=32)
    g = await pool.admit(2)
    other = await pool.admit(1)
    assert pool.extend(g.row, 3) is not None  # the record now lives in a growth buffer
    table = pool.pages_of(g.row)
    host = pool.pages_of(g.row, host=True)
    read = ids(table)
    assert pool.trim_pages([g.row, other.row], [2, 1]) == 3
    if growth == "extend":
        new = ids(pool.extend(g.row, 2))
    elif growth == "extend_rows":
        new = ids(pool.extend_rows([g.row], 2))
    elif growth == "extend_rows_counts":
        new = ids(pool.extend_rows([other.row, g.row], [0, 2]))
    else:
        m, got = pool.extend_fitting([g.row], 2)
        assert m == 1
        new = ids(got)
    assert ids(table) == read and ids(host) == read
    assert ids(pool.pages_of(g.row)) == read[:2] + new
    # Page by page (a decode step's one page a row) as well.
    table = pool.pages_of(g.row)
    read = ids(table)
    pool.trim_pages(g.row, 3)
    one = pool.extend_rows([g.row], 1)
    assert one is not None and ids(pool.pages_of(g.row)) == read[:3] + ids(one)
    assert ids(table) == read
    pool.check_invariants()
    pool.free([g.row, other.row])
    pool.check_invariants()


@pytest.mark.parametrize("keep_rule", ["step in flight counted", "verified length"])
async def test_an_overlap_rollback_keeps_what_the_step_in_flight_may_accept(
    kit: Streams, keep_rule: str
):
    """docs/cuda.md, *Growth and keep in an overlap loop*: processing step
    t-1 while step t (drafts at positions v..v+d) runs, a row keeps
    ceil((v + d + 1) / page_size) pages, and step t's KV stays in its row.
    Trimmed to ceil(v / page_size) instead, the fences still keep the
    trimmed page from everyone (the pool stays consistent), but step t
    writes its accepted tokens' KV into that page while the row's next
    growth lists a fresh one at those positions: the row reads no KV there."""
    ps, v, d = 2, 3, 2
    stream = kit.stream()
    gate = kit.gate(stream)
    async with AsyncReqToTokenPool(3, 16, kv=KVPagePool(9, ps)) as pool:
        kv = pool.kv
        assert kv is not None
        cache = torch.zeros(9 * ps, dtype=torch.int64)  # the KV: position + 1 per slot
        g = await pool.admit(pages=-(-(v + d + 1) // ps))
        slots = kv.slots(g.pages)
        pool.set_req_pool_info(g.row, ReqToTokenPoolInfo(v, len(slots), slots))
        cache[slots[:v]] = torch.arange(v) + 1
        rtt, pos = pool.req_to_token, torch.arange(v, v + d + 1)

        def step() -> None:  # step t reads the row's slots when it runs, as a kernel does
            cache[rtt[g.row, pos].long()] = pos + 1

        stream.launch(step)
        pool.record_use([g.row], stream.record())
        before = ids(pool.pages_of(g.row))
        keep = -(-(v + d + 1) // ps) if keep_rule == "step in flight counted" else -(-v // ps)
        assert pool.trim_pages(g.row, keep) == 0  # (what it trims waits for step t)
        trimmed = before[keep:]
        assert kv.pending_size() == len(trimmed)
        # Step t+1's growth (no drafts), its slots listed on the forward stream after step t.
        a = len(pool.pages_of(g.row)) * ps
        new = pool.extend(g.row, -(-(v + d + 1 + 1) // ps) - len(pool.pages_of(g.row)))
        assert new is not None
        listed = kv.slots(new)
        stream.launch(lambda: rtt.__setitem__((g.row, slice(a, a + len(listed))), listed))
        gate.open()
        async with bounded():
            await wait_fence(stream.record())
        pool.check_invariants()
        read = cache[rtt[g.row, : v + d + 1].long()]
        if keep_rule == "step in flight counted":
            assert trimmed == []
            assert read.tolist() == list(range(1, v + d + 2))
        else:
            lost = cache[kv.slots(trimmed)].tolist()
            assert lost == [5, 6]  # step t's KV of positions 4 and 5, in the page given back
            assert read.tolist() == [1, 2, 3, 4, 0, 0]  # the row reads none of it
        pool.free([g.row])
