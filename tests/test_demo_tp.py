"""``scheduler_demo --tp N``: replicated schedulers build the same batches."""

from __future__ import annotations

import pytest

from scheduler_demo.config import DemoConfig
from scheduler_demo.tp import TPMismatchError, check_agreed, format_summary, run_tp


@pytest.mark.timeout(240)
def test_two_ranks_build_identical_batches() -> None:
    cfg = DemoConfig(num_requests=60, progress=False, timeout_s=120.0)
    res = run_tp(cfg, 2)
    assert res["mismatches"] == 0
    assert res["checks"] > res["steps"] > 50
    hashes = {r["batch_hash"] for r in res["ranks"]}
    assert len(hashes) == 1
    for r in res["ranks"]:
        rep = r["report"]
        assert rep["corruptions"] == 0 and rep["kv_corruptions"] == 0
        assert rep["completed"] + rep["aborts"] == rep["requests"] == 60
    # Same decisions, same outcome on every rank.
    same = ("completed", "aborts", "aborts_in_transfer", "aborts_in_decode", "retractions",
            "steps", "transfers", "output_tokens", "computed_tokens")
    a, b = (r["report"] for r in res["ranks"])
    assert {k: a[k] for k in same} == {k: b[k] for k in same}
    assert "0 mismatches" in format_summary(res)


def test_the_check_names_what_differs() -> None:
    assert check_agreed([5, -5, 2, -2, 1, 0]) is None
    assert check_agreed([5, -7, 2, -2]) == "batch hashes 5..7"
    assert check_agreed([5, -5, 1, -2]) == "transfers in flight 1..2"


@pytest.mark.timeout(240)
def test_auto_pools_diverge_and_the_check_says_so() -> None:
    """The control: the same replicas with reclaim="auto" pools decide by
    local fence timing; the per-iteration check fails every rank."""
    cfg = DemoConfig(num_requests=100, progress=False, timeout_s=120.0)
    with pytest.raises(TPMismatchError, match="ranks diverged"):
        run_tp(cfg, 2, reclaim="auto")
