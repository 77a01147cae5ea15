"""Gaps found by mutation testing of ``KVPagePool``, the ``--tp`` demo and the examples.

Each test fails with one hand-made mutant of the code it names (and passes
on the code as it is):

* A handed-out tensor changed *in place* keeps its ``id()``: reshaped
  (``unsqueeze_``), shrunk (``resize_``) or given a float dtype over the same
  memory (``.data = t.view(torch.float64)``), ``free`` must not trust it. It
  frees what the tensor holds now, or refuses it as any such tensor, changing
  nothing. (The older tests used views, new objects the pool never trusts.)
  A float view of more than ``_TINY`` pages is refused too.
* What is remembered is counted exactly: tensors that ``detach_pages``
  hands out count as ``alloc``'s do (so those freed in another form are
  forgotten in bulk), and freeing the very tensor uncounts it (so a pool
  whose tensors all come back as handed out never forgets a live one).
* A page pool serving an ``AsyncReqToTokenPool``: a large plain-tensor
  ``free`` grants a queued admission inside the call; ``available_size``
  only reads (no reclaim that would bypass the grant loop).
* ``repr`` tells pending from quarantined pages; ``check_invariants``
  checks the ledger.
* ``scheduler_demo --tp``: the per-iteration ``agree`` returns what waits
  behind transfers during the run; ``run_tp`` compares the final batch
  hashes; a config ``TPScheduler`` cannot run is refused by every rank
  (API) and with status 2 (CLI).
* The examples check what they claim: overlap_step's and sync_dropin's
  "pool empty", overlap_step's output tokens, and overlap_step's
  ``free(row, after=copy_stream)`` (a row is not reused before its
  copy-out has read it).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
import torch
from helpers import (
    WAIT_S,
    FakeStream,
    bounded,
    caller_pages_behind,
    granted_in_call,
    kv_of,
    load_example,
    spin,
)
from helpers import page_ids as ids
from test_kv_pages import snapshot

from asyncpool import AsyncReqToTokenPool, InvalidSlotError, KVPagePool, ReqToTokenPool
from asyncpool.kv_pages import _HANDED_SLACK, _TINY
from scheduler_demo.config import DemoConfig
from scheduler_demo.tp import format_summary, run_tp


def _remembered(kv: KVPagePool) -> int:
    return sum(entry[4] for entry in kv._handed.values())


# ------------------------------------------------------- in-place changes


def test_a_handed_out_tensor_reshaped_in_place_is_refused_as_2d() -> None:
    """``unsqueeze_`` keeps the object, its memory and its length but makes it
    2-D: free refuses it as it refuses any 2-D tensor, changing nothing."""
    kv = KVPagePool(64, 4)
    pages = kv.alloc(4)
    assert pages is not None
    pages.unsqueeze_(0)
    before = snapshot(kv)
    with pytest.raises(InvalidSlotError):
        kv.free(pages)
    assert snapshot(kv) == before
    assert kv.allocated_size() == 4
    pages.squeeze_(0)
    assert kv.free(pages) == 4
    kv.check_invariants()


def test_a_handed_out_tensor_shrunk_in_place_frees_only_what_it_holds() -> None:
    """``resize_`` to fewer pages keeps the object and its address: free
    takes the pages it lists now, not all it was handed."""
    kv = KVPagePool(64, 4)
    pages = kv.alloc(6)
    assert pages is not None
    kept = pages[2:].tolist()
    pages.resize_(2)
    assert kv.free(pages) == 2
    assert kv.allocated_size() == 4
    assert all(kv.ledger.state_of(p) == "allocated" for p in kept)
    kv.check_invariants()


def test_a_handed_out_tensor_given_a_float_dtype_in_place_is_refused() -> None:
    """``t.data = t.view(torch.float64)``: same object, address, length and
    bytes, but not an integer tensor: refused (InvalidSlotError), nothing
    freed."""
    kv = KVPagePool(64, 4)
    pages = kv.alloc(4)
    assert pages is not None
    pages.data = pages.view(torch.float64)
    before = snapshot(kv)
    with pytest.raises(InvalidSlotError):
        kv.free(pages)
    assert snapshot(kv) == before
    kv.check_invariants()


@pytest.mark.parametrize("n", [_TINY + 1, 40])
def test_a_float_view_of_many_pages_is_refused(n: int) -> None:
    """A float64 view of more than ``_TINY`` handed-out pages has int64's
    strides and the same bytes (small ids read as denormals), but it is not an
    integer tensor: refused with InvalidSlotError, nothing freed. (The older
    test viewed 8 pages, which the small-tensor path refuses.)"""
    kv = KVPagePool(64, 4)
    pages = kv.alloc(n)
    assert pages is not None
    before = snapshot(kv)
    with pytest.raises(InvalidSlotError):
        kv.free(pages.view(torch.float64))
    assert snapshot(kv) == before
    assert kv.free(pages) == n
    kv.check_invariants()


# ------------------------------------------------------- detach_pages


async def test_detached_tensors_freed_in_another_form_are_forgotten_in_bulk() -> None:
    """``detach_pages`` remembers its tensor (``_hand_out``) and counts its
    pages; tensors freed as lists leave entries behind, which a trim forgets:
    the remembered pages stay within the allocated ones plus twice the slack,
    and the count matches the entries."""
    kv = KVPagePool(64, 4)
    async with AsyncReqToTokenPool(3, 8, kv=kv) as pool:
        most = 0
        for _ in range(3 * _HANDED_SLACK // 4):
            g = pool.try_admit(pages=4)
            assert g is not None
            pages = pool.detach_pages(g.row)
            assert id(pages) in kv._handed or not kv._handed  # or just trimmed
            pool.free([g.row])
            assert kv.free(pages.tolist()) == 4  # the entry stays behind
            assert kv._handed_pages == _remembered(kv)
            most = max(most, len(kv._handed))
        assert most * 4 <= 4 + 2 * _HANDED_SLACK  # allocated at a trim + twice the slack
        kv.check_invariants()


def test_tensors_freed_as_handed_out_are_never_forgotten(monkeypatch: pytest.MonkeyPatch) -> None:
    """Freeing the very tensor takes its pages off the remembered count: with
    every tensor freed as handed out none is stale, so no trim forgets a live
    one, and a long-held tensor still frees without the id checks."""
    kv = KVPagePool(64, 4)
    held = kv.alloc(3)
    assert held is not None
    for _ in range(2 * _HANDED_SLACK):
        pages = kv.alloc(4)
        assert pages is not None
        assert kv.free(pages) == 4
        assert kv._handed_pages == _remembered(kv) == 3
    assert id(held) in kv._handed

    def broken(*args: object, **kwargs: object) -> None:
        raise AssertionError("a check the handed-out path skips was run")

    for name in ("prepare", "_free_now_small", "_checked"):
        monkeypatch.setattr(kv.ledger, name, broken)
    assert kv.free(held) == 3
    monkeypatch.undo()
    kv.check_invariants()


# ------------------------------------------------------- a served page pool


async def test_a_large_tensor_free_to_a_served_page_pool_grants_a_queued_admission() -> None:
    """``free`` of more than ``_TINY`` pages as a plain int64 tensor (not the
    one handed out: a copy) runs the owning pool's grant loop inside the
    call, as every other path that frees pages does."""
    n = _TINY + 4
    async with AsyncReqToTokenPool(3, 8, kv=KVPagePool(n + 1, 4)) as pool:
        kv = kv_of(pool)
        g = await pool.admit(pages=n)
        pages = pool.detach_pages(g.row)
        pool.free([g.row])
        waiter = asyncio.ensure_future(pool.admit(pages=n))
        await spin()
        assert pool.waiting() == 1
        assert kv.free(pages.clone()) == n
        assert pool.waiting() == 0  # granted inside the call
        async with bounded():
            got = await waiter
        assert sorted(ids(got.pages)) == sorted(ids(pages))
        pool.free([got.row])
        pool.check_invariants()
        kv.check_invariants()


async def test_available_size_of_a_served_page_pool_only_reads() -> None:
    """A page pool serving an ``AsyncReqToTokenPool`` does not reclaim in
    ``available_size`` (its owner's wake-ups reclaim and grant): pages behind
    a completed fence stay pending until a call that grants, and the queued
    admission is granted by that call."""
    s = FakeStream()
    async with AsyncReqToTokenPool(3, 8, kv=KVPagePool(5, 4)) as pool:
        kv = kv_of(pool)
        pages, waiter = await caller_pages_behind(pool, s.record())
        s.complete()  # no loop step before the calls below
        assert kv.available_size() == 0
        assert kv.pending_size() == 4 and pool.waiting() == 1
        assert kv.reclaim() == 4
        await granted_in_call(pool, waiter, pages)


# ------------------------------------------------------- repr, check_invariants


def test_repr_names_pending_and_quarantined_pages_apart() -> None:
    """The repr shows the pages pending behind a fence as pending, and the
    ones a faulted fence quarantined as quarantined."""
    kv = KVPagePool(16, 4)
    s = FakeStream()
    pending, bad = kv.alloc(3), kv.alloc(2)
    assert pending is not None and bad is not None
    kv.free(pending, fence=s.record())
    faulted = FakeStream()
    f = faulted.record()
    faulted.fault()
    assert kv.free(bad, fence=f) == 0  # faulted already: quarantined at once
    assert kv.pending_size() == 3 and kv.quarantined_size() == 2
    assert repr(kv) == (
        "<KVPagePool num_pages=16 page_size=4 free=10 allocated=0 pending=3 quarantined=2>"
    )


def test_check_invariants_of_the_pool_checks_its_ledger() -> None:
    """``KVPagePool.check_invariants`` raises AssertionError when the ledger's
    bookkeeping is broken (here a free count one too high)."""
    kv = KVPagePool(16, 4)
    assert kv.alloc(3) is not None
    kv.check_invariants()
    kv.ledger.free_count += 1
    with pytest.raises(AssertionError):
        kv.check_invariants()


# ------------------------------------------------------- scheduler_demo --tp


def _rank_counting_agreements(rank: int, *args: object) -> None:
    """A rank whose summary adds what ``agree`` made free during the run."""
    from asyncpool import AsyncReqToTokenPool as Pool
    from scheduler_demo import tp as tpm

    freed = [0, 0]
    agree = Pool.agree

    def counting(self: Pool, group: object = None) -> tuple[int, int]:
        rows, pages = agree(self, group)
        freed[0] += rows
        freed[1] += pages
        return rows, pages

    summary = tpm.TPScheduler.tp_summary

    def with_agreed(self: tpm.TPScheduler) -> dict[str, object]:
        return {**summary(self), "agreed": list(freed)}

    Pool.agree = counting  # type: ignore[method-assign]
    tpm.TPScheduler.tp_summary = with_agreed  # type: ignore[method-assign]
    tpm._rank_main(rank, *args)  # type: ignore[arg-type]


@pytest.mark.timeout(240)
def test_the_tp_scheduler_settles_transfer_fences_by_agreement(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An aborted request's row and pages wait behind its transfer, a fence
    the explicit pools never ask and ``retire`` (the forward's fences) does
    not cover: the per-iteration ``agree`` returns them during the run (the
    final drain would hide a scheduler that never agreed)."""
    from scheduler_demo import tp as tpm

    monkeypatch.setattr(tpm, "_rank_main", _rank_counting_agreements)
    cfg = DemoConfig(num_requests=40, abort_rate=0.5, progress=False, timeout_s=120.0)
    res = run_tp(cfg, 2)
    assert res["mismatches"] == 0
    for r in res["ranks"]:
        assert r["report"]["aborts"] > 0
        rows, pages = r["agreed"]
        assert rows > 0 and pages > 0, r["agreed"]


def _rank_reporting_another_final_hash(rank: int, *args: object) -> None:
    """A rank 1 whose final batch hash differs: as if it launched other
    batches after the last per-iteration check."""
    from scheduler_demo import tp as tpm

    summary = tpm.TPScheduler.tp_summary

    def other_hash(self: tpm.TPScheduler) -> dict[str, object]:
        out = summary(self)
        if self.rank == 1:
            out["batch_hash"] = "0" * 16
        return out

    tpm.TPScheduler.tp_summary = other_hash  # type: ignore[method-assign]
    tpm._rank_main(rank, *args)  # type: ignore[arg-type]


@pytest.mark.timeout(240)
def test_run_tp_compares_the_final_batch_hashes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches launched after the last per-iteration check are compared
    once more at the end: ranks whose final hashes differ count a mismatch
    (and the CLI exits 1), though every check during the run passed."""
    from scheduler_demo import tp as tpm

    monkeypatch.setattr(tpm, "_rank_main", _rank_reporting_another_final_hash)
    cfg = DemoConfig(num_requests=10, progress=False, timeout_s=120.0)
    res = run_tp(cfg, 2)
    assert all(r["mismatches"] == 0 for r in res["ranks"])
    assert res["mismatches"] == 1
    assert "1 mismatches" in format_summary(res)


@pytest.mark.timeout(120)
def test_run_tp_refuses_a_config_the_tp_scheduler_cannot_run() -> None:
    """``TPScheduler`` needs atomic admission and no gate; called with
    ``gate=True`` through the API (the CLI checks first), every rank raises
    that ValueError instead of running a scheduler that cannot agree."""
    from torch.multiprocessing.spawn import ProcessRaisedException

    cfg = DemoConfig(num_requests=5, gate=True, progress=False, timeout_s=60.0)
    with pytest.raises(ProcessRaisedException, match="needs atomic admission and no --gate"):
        run_tp(cfg, 1)


@pytest.mark.parametrize("extra", [["--gate"], ["--admission", "row-first"]])
def test_the_tp_cli_refuses_gate_and_non_atomic_admission_with_status_2(
    extra: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """``--tp`` with ``--gate`` or non-atomic admission is a usage error
    (status 2, a message naming both needs), not a failed run (1)."""
    from scheduler_demo import cli

    assert cli.main(["--tp", "2", "--no-progress", *extra]) == 2
    assert "--tp needs --admission atomic and no --gate" in capsys.readouterr().err


# ------------------------------------------------------- examples


_SMALL = ["--device", "cpu", "--requests", "12", "--rows", "4", "--forward-ms", "0"]


def test_overlap_step_fails_when_a_row_is_never_freed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """overlap_step's "pool empty" check is real: a pool that loses the first
    finished request's free ends with a row allocated, and the example exits 1
    saying so, though no row is corrupted."""
    mod = load_example("overlap_step", monkeypatch)

    class Leaky(AsyncReqToTokenPool):
        leaked = 0

        def free(self, rows: Any, **kw: Any) -> Any:
            if "after" in kw and not Leaky.leaked:
                Leaky.leaked += 1
                return 0
            return super().free(rows, **kw)

    monkeypatch.setattr(mod, "AsyncReqToTokenPool", Leaky)
    assert mod.main(_SMALL) == 1
    assert Leaky.leaked == 1
    out = capsys.readouterr().out
    assert "overlap_step: FAILED: 0 corrupted rows, 1 rows still allocated" in out


def test_overlap_step_checks_the_output_tokens_too(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """overlap_step compares every token of a finished request's row, the
    ones the steps wrote as well as the prefix: a forward that writes a wrong
    output token is reported as a corrupted row (exit 1)."""
    mod = load_example("overlap_step", monkeypatch)
    write = mod._write_step

    def wrong(req_to_token: Any, verified_lens: Any, rows: Any, pos: Any, tok: Any) -> None:
        write(req_to_token, verified_lens, rows, pos, tok + 1)

    monkeypatch.setattr(mod, "_write_step", wrong)
    assert mod.main(_SMALL) == 1
    out = capsys.readouterr().out
    assert "overlap_step: FAILED: 12 corrupted rows, 0 rows still allocated" in out


def test_sync_dropin_fails_when_a_row_is_never_freed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """sync_dropin's "pool empty" check is real: a pool that loses one free
    ends short of its rows, and the example exits 1 saying so."""
    mod = load_example("sync_dropin", monkeypatch)

    class Leaky(ReqToTokenPool):
        leaked = 0

        def free(self, rows: Any, *args: Any, **kw: Any) -> Any:
            if not Leaky.leaked:
                Leaky.leaked += 1
                return 0
            return super().free(rows, *args, **kw)

    monkeypatch.setattr(mod, "ReqToTokenPool", Leaky)
    assert mod.main([*_SMALL, "--abort", "0"]) == 1
    assert Leaky.leaked == 1
    out = capsys.readouterr().out
    assert "sync_dropin: FAILED: 0 corrupted rows, pool empty: False" in out


def test_overlap_step_frees_a_finished_row_after_its_copy_out(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A finished request's row is copied out on the copy stream, launched
    after the step's fence: ``free(row, after=copy)`` keeps the row from a
    new owner until the copy has read it. The first copy-out is held until
    one of two things is known: the row is still pending once the forward
    stream is idle and every completed fence reclaimed (only the held copy
    keeps it), or a new owner has written its prefix into it (freed without
    ``after=``, the row went to the next request as soon as the forward
    finished, and the copy read that request's prefix)."""
    mod = load_example("overlap_step", monkeypatch)
    proceed = threading.Event()
    first: list[int] = []
    streams: list[Any] = []
    copy_out, write_prefix = mod.Streams.copy_out, mod.Streams.write_prefix

    def held_copy_out(self: Any, pool: Any, req: Any) -> None:
        if not first:
            first.append(req.row)
            streams.append(self)
            self.copy.launch(proceed.wait, WAIT_S)
        copy_out(self, pool, req)

    def noting_prefix(self: Any, pool: Any, req: Any) -> None:
        write_prefix(self, pool, req)
        if first and req.row == first[0]:
            proceed.set()  # reused: the held copy now reads the new prefix

    class NotingPool(mod.AsyncReqToTokenPool):  # type: ignore[name-defined,misc]
        def free(self, rows: Any, *args: Any, **kwargs: Any) -> int:
            now = super().free(rows, *args, **kwargs)
            if first and list(rows) == first and not proceed.is_set():
                streams[0].forward.synchronize()  # every use of the row has landed
                self.reclaim()  # (frees the row here unless the copy holds it)
                if self.pending_size():
                    proceed.set()  # only the held copy keeps it: nobody can take it
            return now

    monkeypatch.setattr(mod.Streams, "copy_out", held_copy_out)
    monkeypatch.setattr(mod.Streams, "write_prefix", noting_prefix)
    monkeypatch.setattr(mod, "AsyncReqToTokenPool", NotingPool)
    argv = [
        "--device",
        "cpu",
        "--requests",
        "3",
        "--rows",
        "1",
        "--forward-ms",
        "0",
        "--retract",
        "0",
    ]
    assert mod.main(argv) == 0, capsys.readouterr().out
    assert proceed.is_set()  # released by an event, not by the bound
