"""Faulted fences of unknown origin are logged a few per window, not one each.

A transfer peer that dies faults every transfer handle in flight to it at
once, and each handle is its own fence of unknown origin. The rule for
streams (the first faulted fence an ERROR, the second a WARNING, the rest
at DEBUG) saw each handle as a stream of its own, so 256 transfers with
their pages logged 512 ERRORs (a trial's on-call harness). Now at most 3 of
them are ERRORs within a second of the first, the fourth is one WARNING
saying the rest of that second goes to DEBUG, and the first ERROR after it
says how many went there; ``fence_errors`` still counts every one.
"""

from __future__ import annotations

import logging

import pytest

import asyncpool.deferral as deferral
from asyncpool import AsyncReqToTokenPool, KVPagePool
from asyncpool.ledger import SlotLedger

DEFERRAL = "asyncpool.deferral"


class PeerGone:
    """A transfer handle whose peer died: ``query()`` raises."""

    def __init__(self, i: int) -> None:
        self.i = i

    def query(self) -> bool:
        raise ConnectionResetError(f"peer reset (transfer {self.i})")

    def synchronize(self) -> None:
        raise ConnectionResetError(f"peer reset (transfer {self.i})")

    def __repr__(self) -> str:
        return f"<transfer {self.i}>"


def by_level(caplog: pytest.LogCaptureFixture, level: int, name: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == DEFERRAL and r.levelno == level and f"'{name}'" in r.getMessage()
    ]


async def test_a_dead_peer_faulting_256_transfers_logs_a_few_lines(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The whole burst in one window, however slow the machine.
    monkeypatch.setattr(deferral, "_UNORDERED_FAULT_WINDOW_S", 1e9, raising=False)
    caplog.set_level(logging.DEBUG, logger="asyncpool")
    pool = AsyncReqToTokenPool(300, 8, kv=KVPagePool(1025, 4, name="kv"), name="decode")
    grants = [await pool.admit(pages=2) for _ in range(256)]
    for i, g in enumerate(grants):
        pool.free([g.row], fence=PeerGone(i))
    st = pool.stats()
    assert (st.fence_errors, st.page_fence_errors) == (256, 256)
    assert (st.quarantined, st.pages_quarantined) == (256, 512)
    for name, unit in (("decode", "rows"), ("kv", "pages")):
        errors = by_level(caplog, logging.ERROR, name)
        warnings = by_level(caplog, logging.WARNING, name)
        debug = by_level(caplog, logging.DEBUG, name)
        assert len(errors) == 3, errors
        assert all("<transfer" in e and f"quarantined {unit}" in e for e in errors)
        assert len(warnings) == 1, warnings
        assert "<transfer 3>" in warnings[0] and "logged at DEBUG" in warnings[0]
        assert "peer reset (transfer 3)" in warnings[0]
        faulted = [d for d in debug if "faulted (" in d]
        assert len(faulted) == 252
        assert "(253 faulted fences of unknown origin" in faulted[-1]
    pool.check_invariants()
    await pool.close()


def test_the_first_error_after_the_window_counts_what_went_to_debug(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="asyncpool")
    now = [100.0]
    led = SlotLedger(16, clock=lambda: now[0])
    rows = led.take(12)
    assert rows is not None

    def fault(row: int, i: int) -> None:
        led.free([row], PeerGone(i))

    for i in range(6):  # 3 errors, 1 warning, 2 at DEBUG
        fault(rows[i], i)
    now[0] += 0.5  # still the same window
    fault(rows[6], 6)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(errors) == 3 and len(warnings) == 1
    now[0] += 0.6  # past the window: an ERROR again, saying what went to DEBUG
    fault(rows[7], 7)
    fault(rows[8], 8)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 5
    assert "<transfer 7>" in errors[3]
    assert "(4 more faulted fences of unknown origin were logged at DEBUG" in errors[3]
    assert "more faulted" not in errors[4]
    assert led.fence_errors == 9 and led.quarantined == 9
    led.check_invariants()


def test_streams_keep_their_own_rule(caplog: pytest.LogCaptureFixture) -> None:
    # Ordered fences of many streams are still one ERROR per stream: their
    # faults are sticky per stream, not per window.
    from asyncpool import HostStream

    caplog.set_level(logging.WARNING, logger="asyncpool")
    led = SlotLedger(16)
    rows = led.take(6)
    assert rows is not None
    streams = [HostStream() for _ in range(6)]
    try:
        for row, s in zip(rows, streams, strict=True):
            s.launch(_boom)
            f = s.record()
            try:
                f.synchronize()
            except Exception:
                pass
            led.free([row], f)
    finally:
        for s in streams:
            s.close()
    errors = [r for r in caplog.records if r.name == DEFERRAL and r.levelno == logging.ERROR]
    assert len(errors) == 6
    assert led.fence_errors == 6


def _boom() -> None:
    raise RuntimeError("device fault (simulated)")
