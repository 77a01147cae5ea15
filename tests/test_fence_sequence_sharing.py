"""The rows of a step keep sharing one recorded use, so a free decides them once.

``free`` behind several fences decides the rows that share a recorded use
once per call (83e42b3): each fence asked once, one verdict for all of
them, even when a fence completes half way through the call. That rests
on ``record_use`` storing one object for rows whose previous uses were one
object, which held only while those rows came one after the other:

* rows of two histories in turn (a decode batch that mixes requests
  admitted at different steps, or received through a transfer) got one new
  use per row at the next ``record_use``, and kept them for good;
* ``force_release`` of a fence the rows had recorded gave each row its own
  copy of what was left;
* ``free`` itself kept only the last use's verdict, so rows of uses A, B,
  A, B were decided one by one: each fence asked once per row, and a row of
  A could go free while another row of A waited.

Now each distinct previous use becomes one new use per call, whatever the
order of the rows, and ``free`` keeps the verdict of every use it met.
"""

from __future__ import annotations

from typing import Any

from helpers import FakeStream

from asyncpool import ReqToTokenPool


class Transfer:
    """A transfer handle (a fence of unknown origin) counting its queries;
    ``lands_after`` queries answered False, then True."""

    def __init__(self, lands_after: int | None = None) -> None:
        self.lands_after = lands_after
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.lands_after is not None and self.queries > self.lands_after

    def synchronize(self) -> None:
        raise AssertionError("never called by the pool")


def _distinct_uses(pool: ReqToTokenPool, rows: list[int]) -> int:
    return len({id(pool._ledger._uses[r]) for r in rows})


def _in_turns(first: list[int], second: list[int]) -> list[int]:
    return [r for pair in zip(first, second, strict=True) for r in pair]


def test_rows_of_two_histories_in_turn_keep_one_use_per_history() -> None:
    pool = ReqToTokenPool(40, 4)
    forward = FakeStream()
    earlier, later = pool.alloc(8), pool.alloc(8)
    assert earlier is not None and later is not None
    pool.record_use(earlier, [forward.record(), Transfer()])  # received by a transfer
    pool.record_use(later, FakeStream().record())
    batch = _in_turns(earlier, later)
    pool.record_use(batch, forward.record())  # one fence
    assert _distinct_uses(pool, earlier) == _distinct_uses(pool, later) == 1
    pool.record_use(batch, [forward.record(), Transfer()])  # a sequence
    assert _distinct_uses(pool, earlier) == _distinct_uses(pool, later) == 1
    assert _distinct_uses(pool, batch) == 2
    pool.check_invariants()


def test_force_release_leaves_a_steps_rows_sharing_their_use() -> None:
    pool = ReqToTokenPool(40, 4)
    step, copy = FakeStream().record(), FakeStream().record()
    dead = Transfer()
    rows = pool.alloc(32)
    assert rows is not None
    pool.record_use(rows, [step, copy, dead])
    pool.force_release(dead)  # its peer died
    assert _distinct_uses(pool, rows) == 1
    transfer = Transfer()
    assert pool.free(rows, [transfer]) == 0
    assert (step.queries, copy.queries, transfer.queries) == (1, 1, 1)
    pool.check_invariants()


def test_rows_of_two_uses_in_turn_get_their_uses_verdicts() -> None:
    """A transfer lands between two rows of one use: both rows still get the
    verdict the first one got (not one pending, the other free), and each
    fence is asked once per use, not once per row."""
    pool = ReqToTokenPool(40, 4)
    s1, s2 = FakeStream(), FakeStream()
    a_rows, b_rows = pool.alloc(4), pool.alloc(4)
    assert a_rows is not None and b_rows is not None
    pool.record_use(a_rows, s1.record())
    pool.record_use(b_rows, s2.record())
    s1.complete()
    s2.complete()
    landing = Transfer(lands_after=1)  # lands right after its first answer
    landed = Transfer(lands_after=0)
    assert pool.free(_in_turns(a_rows, b_rows), [landing, landed]) == len(b_rows)
    states: dict[str, Any] = {
        "a": {pool._ledger.state_of(r) for r in a_rows},
        "b": {pool._ledger.state_of(r) for r in b_rows},
    }
    assert states == {"a": {"pending"}, "b": {"free"}}
    assert landing.queries == 2  # once for A, once for B
    assert pool.reclaim() == len(a_rows)
    pool.check_invariants()
