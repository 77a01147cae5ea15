"""Identical admission decisions on every tensor-parallel rank (issue 12).

Spawns 2 and 4 processes over gloo (a file:// rendezvous in a tmp dir); each
runs tests/tp_worker.py's seeded scheduler loop with its own HostStream and
rank-dependent delays, and all-gathers a running hash of every grant each
step. In "explicit" mode (retire + agree) the hashes agree at every step; in
"auto" mode (reclaim when a fence happens to be done here) they diverge:
that is the control, showing the test sees what it guards against.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch.multiprocessing as mp
from tp_worker import APIS, disagree_rank, one_rank_differs_rank, run_rank


def _run(tmp_path: Path, world: int, **cfg: Any) -> list[dict[str, Any]]:
    init = tmp_path / "init"
    mp.spawn(run_rank, args=(world, str(init), str(tmp_path), cfg), nprocs=world, join=True)
    out = []
    for rank in range(world):
        with open(tmp_path / f"rank{rank}.json") as f:
            out.append(json.load(f))
    return out


# The newest memory API on 2 and 4 ranks; the older one (rows + a separate
# KVPagePool) on 2, to keep the run short.
_CASES = [(2, api) for api in APIS] + [(4, APIS[-1])]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("world", "api"), _CASES)
def test_explicit_mode_grants_identically_on_every_rank(
    tmp_path: Path, world: int, api: str
) -> None:
    res = _run(tmp_path, world, reclaim="explicit", api=api)
    assert [r["diverged_at"] for r in res] == [-1] * world
    assert len({r["hash"] for r in res}) == 1
    assert all(r["ops"] >= 10_000 for r in res), [r["ops"] for r in res]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("api", APIS)
def test_auto_mode_diverges(tmp_path: Path, api: str) -> None:
    """The control: the same loop reclaiming by local fence timing diverges.

    Its ranks' timings differ by more than the defaults (rank 1's forward
    sleeps up to 5 ms a step, rank 0's not at all): on a loaded machine a
    slow step let the default 0.6 ms settle before every decision on both
    ranks, and once in a while they never diverged."""
    res = _run(tmp_path, 2, reclaim="auto", api=api, fwd_delay_s=0.005, transfer_delay_s=0.01)
    steps = {r["diverged_at"] for r in res}
    assert len(steps) == 1 and steps != {-1}, res


@pytest.mark.timeout(120)
@pytest.mark.parametrize("same_count", [False, True])
def test_ranks_that_disagree_all_raise(tmp_path: Path, same_count: bool) -> None:
    """Different pending batches on one rank: every rank raises AgreementError
    at the same call, none hangs in a collective of another size. As many
    batches but of other rows passed before (counts only were compared), and
    the ranks then handed out different rows."""
    world = 2
    args = (world, str(tmp_path / "init"), str(tmp_path), same_count)
    mp.spawn(disagree_rank, args=args, nprocs=world)
    outcomes = [(tmp_path / f"rank{r}.txt").read_text() for r in range(world)]
    for text in outcomes:
        assert text.startswith("AgreementError"), outcomes
        if same_count:
            assert "rows pending ids (crc32)" in text and "pending batches" not in text
        else:
            assert "rows pending batches 1..2" in text


@pytest.fixture(scope="module")
def one_rank_differs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Two ranks run tests/tp_worker.py's one_rank_differs_rank once."""
    tmp = tmp_path_factory.mktemp("one_rank_differs")
    mp.spawn(one_rank_differs_rank, args=(2, str(tmp / "init"), str(tmp)), nprocs=2)
    out = []
    for rank in range(2):
        with open(tmp / f"rank{rank}.json") as f:
            out.append(json.load(f))
    return out


@pytest.mark.timeout(120)
def test_a_transfer_that_fails_on_one_rank_is_quarantined_on_every_rank(
    one_rank_differs: list[dict[str, Any]],
) -> None:
    """Rank 1's transfer raised, rank 0's completed: MIN of "faulted" would
    keep the row and pages held on both ranks for good, unreported."""
    here, there = (r["fault"] for r in one_rank_differs)
    for r in (here, there):
        assert r["released"] == [0, 0]
        assert r["quarantined"] == [1, 3] and r["pending"] == [0, 0]
    # Each rank logs the fault; the one where it happened names its error.
    assert any("faulted on another rank (not here)" in m for m in here["log"]), here
    assert any("the RDMA peer is gone" in m for m in there["log"]), there


@pytest.mark.timeout(120)
def test_a_transfer_stuck_on_one_rank_is_overdue_on_every_rank(
    one_rank_differs: list[dict[str, Any]],
) -> None:
    """Rank 1's transfer never completes, rank 0's did: MIN of "overdue"
    would report nothing anywhere while the memory stays held."""
    for r in (r["stuck"] for r in one_rank_differs):
        assert r["released"] == [0, 0] and r["pending"] == [1, 3]
        assert r["overdue"] == [1, 1, 3]
        assert any("not done on at least one rank" in m for m in r["log"]), r
        assert any("(its work may still write or read it)" in m for m in r["log"]), r


@pytest.mark.timeout(120)
def test_pools_built_otherwise_raise_agreement_error_on_every_rank(
    one_rank_differs: list[dict[str, Any]],
) -> None:
    """kv= on rank 0 only: the tensors were of different lengths, and gloo
    aborted the processes; now every rank raises AgreementError."""
    for r in one_rank_differs:
        assert r["kv"].startswith("AgreementError"), r
        assert "ledger 2 holds nothing on one rank and pages on another" in r["kv"]


@pytest.mark.timeout(120)
def test_a_query_interrupt_on_one_rank_leaves_no_rank_in_a_collective(
    one_rank_differs: list[dict[str, Any]],
) -> None:
    """Rank 1's transfer raised KeyboardInterrupt from query(): it used to
    leave agree() before the all-reduce, and rank 0 waited in it until the
    group's timeout (the fixture's ranks would fail after 60 s). Now both
    leave the same call, rank 0 with AgreementError, nothing changed."""
    here, there = (r["interrupt"] for r in one_rank_differs)
    assert there["first"] == "KeyboardInterrupt"
    assert here["first"].startswith("AgreementError") and "interrupted" in here["first"]
    for r in (here, there):
        assert r["pending"] == [1, 3]  # not done on rank 1: held on both
        assert r["then"] == [1, 3]  # done on both now: released on both


@pytest.mark.timeout(120)
def test_a_drain_split_by_a_one_rank_fault_is_caught_by_the_next_agree(
    one_rank_differs: list[dict[str, Any]],
) -> None:
    """drain() quarantined on rank 1 what it released on rank 0. Once both
    ranks allocated every free row and page, free and pending counts agreed
    and the next agree() passed; the quarantined counts now tell them
    apart."""
    for r in one_rank_differs:
        assert r["drain_split"].startswith("AgreementError"), r
        assert "rows quarantined ids 0..1" in r["drain_split"], r
        assert "pages quarantined ids 0..3" in r["drain_split"], r
        assert "free ids" not in r["drain_split"], r


@pytest.mark.timeout(120)
def test_faults_and_stuck_transfers_beyond_the_first_all_reduce(
    one_rank_differs: list[dict[str, Any]],
) -> None:
    """The flags of batches past WIDTH ride in a second all-reduce, negated
    as in the first: one failed and one stuck on rank 1 in each."""
    for r in one_rank_differs:
        assert r["wide"] == {
            "collectives": 2,
            "released": [66],
            "quarantined": 2,
            "newly_overdue": 2,
            "pending": 2,
        }, r
