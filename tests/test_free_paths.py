"""The ledger's free fast paths must never weaken the careful path."""

from __future__ import annotations

import threading

import pytest

from asyncpool import HostStream, InvalidSlotError, ReqToTokenPool


def test_explicit_fence_never_drops_an_open_recorded_use() -> None:
    pool = ReqToTokenPool(5, 4)
    gate = threading.Event()
    with HostStream() as stream, HostStream() as other:
        try:
            stream.launch(gate.wait)
            in_flight = stream.record()
            rows = pool.alloc(2)
            assert rows is not None
            pool.record_use(rows, in_flight)
            finished = other.record()
            finished.synchronize()
            pool.free(rows, fence=finished)  # complete: must still wait for the use
            assert pool.pending_size() == 2
            assert pool.reclaim() == 0
            gate.set()
            in_flight.synchronize()
            assert pool.reclaim() == 2
            pool.check_invariants()
        finally:
            gate.set()


def test_bulk_free_with_a_duplicate_changes_nothing() -> None:
    pool = ReqToTokenPool(9, 4)
    rows = pool.alloc(4)
    assert rows is not None
    before = pool.stats()
    with pytest.raises(InvalidSlotError, match=str(rows[1])):
        pool.free([rows[0], rows[1], rows[1]])
    assert pool.stats() == before
    pool.check_invariants()


def test_a_large_bulk_reset_zeroes_every_reused_row() -> None:
    pool = ReqToTokenPool(400, 4)  # enough dirty rows for the mask reset
    rows = pool.alloc(399)
    assert rows is not None
    pool.verified_lens[rows] = 3
    pool.alloced_lens[rows] = 4
    pool.alloced_lens_cpu[rows] = 4
    keep = rows[:10]
    pool.free(rows[10:])
    again = pool.alloc(389)
    assert again is not None
    assert int(pool.verified_lens[again].abs().sum()) == 0
    assert int(pool.alloced_lens_cpu[again].abs().sum()) == 0
    # rows still held keep their lengths: the reset touched only free rows
    assert pool.verified_lens[keep].tolist() == [3] * 10
    assert pool.alloced_lens[keep].tolist() == [4] * 10


@pytest.mark.parametrize("bad", [[0], [3, 3], [7]])
def test_a_refused_free_after_a_stream_records_no_fence_on_it(bad: list[int]) -> None:
    pool = ReqToTokenPool(8, 4)
    rows = pool.alloc(3)
    assert rows == [1, 2, 3]
    with HostStream() as stream:
        seq_before = stream.record().seq
        with pytest.raises(InvalidSlotError):
            pool.free(bad, after=stream)
        assert stream.record().seq == seq_before + 1  # only this probe
        assert pool.free([1], after=stream) in (0, 1)
        assert stream.record().seq == seq_before + 3  # the free's fence, then this probe
    pool.check_invariants()


@pytest.mark.parametrize(
    "refused",
    [
        lambda pool, rows, fence: pool.free([*rows, 7]),  # then a row never allocated
        lambda pool, rows, fence: pool.record_use([*rows, 0], fence),
        lambda pool, rows, fence: pool.free([*rows, *rows]),  # a repeat
    ],
    ids=["free-never", "record_use-row-0", "free-repeat"],
)
def test_a_refused_call_keeps_each_rows_recorded_use(refused) -> None:
    # A row with a recorded use is marked so by its state byte (USED): a
    # refused call that checked it must put that mark back, or the next
    # free would take the fast path and skip the open use.
    pool = ReqToTokenPool(8, 4)
    gate = threading.Event()
    with HostStream() as stream:
        try:
            stream.launch(gate.wait)
            in_flight = stream.record()
            rows = pool.alloc(2)
            assert rows is not None
            pool.record_use(rows, in_flight)
            with pytest.raises(InvalidSlotError):
                refused(pool, rows, in_flight)
            pool.check_invariants()
            assert pool.free(rows) == 0  # both wait for the open use
            assert pool.pending_size() == 2
            gate.set()
            in_flight.synchronize()
            assert pool.reclaim() == 2
            pool.check_invariants()
        finally:
            gate.set()
