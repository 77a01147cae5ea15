"""Gaps found by a hand-made mutation sweep of the last session's code
(3f23e2d..b78067f): ``release_grant_holds``, ``close()`` awaiting the
watcher's threads (``FenceWatcher.settled``), the force_release lines of
faulted fences, the poller's CUDA device, and the tables' one reset event.

Each test pins one behaviour that a mutant broke while every test file that
exercises the code still passed (60 mutants: 42 killed by the existing
tests, 6 equivalent, 12 gaps: these tests; see docs/changes.md):

* ``release_grant_holds()`` with no hold held logs nothing;
* the holds it ended, and a hold released by hand, are no longer counted
  as live: a later ``release_grant_holds()`` says how many of its holds
  were lost, not fewer;
* it cancels the ``warn_after`` timers of the live holds it ends, as a
  hold's own ``release()`` does;
* a closed pool keeps no reference to its stopped fence watcher once
  ``close()`` has seen its threads gone;
* ``force_release`` of several fences that faulted only in the page ledger
  (pages detached, then freed behind a transfer) says they faulted;
* a pool on ``"cpu:0"`` (a device with an index, not CUDA) gives its poller
  no CUDA device to make current; a CUDA pool gives it its device index;
* the poller makes the pool's device current once: a CUDA fence of that
  device asked later does not set it again;
* ``FenceWatcher.settled`` leaves out a stream thread blocked in a fence's
  ``synchronize()`` (it exits only when that returns), as ``join`` does;
* a write from another stream asks the current stream of the tables' own
  device (not the thread's current device), and the reset event the
  tables make keeps no timing.

Async tests run on asyncio and uvloop (conftest); every wait is bounded.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
import weakref
from typing import Any

import pytest
import torch
from helpers import EventFence, StandInEvent, bounded, until

import asyncpool.base as base_mod
import asyncpool.fences as fences_mod
from asyncpool import AsyncReqToTokenPool, KVPagePool, ReqToTokenPoolInfo
from asyncpool.fences import CudaFence, new_stream_key
from asyncpool.tables import TokenTables
from asyncpool.watcher import FenceWatcher

WAIT_S = 10.0
DEVICE = 3  # a device index no test uses for a real event


def _until(cond: Any, what: str) -> None:
    """Poll ``cond`` from a test without a loop, bounded at ``WAIT_S``."""
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


def _recovery_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "release_grant_holds()" in r.getMessage()]


# ------------------------------------------------------- release_grant_holds


async def test_release_grant_holds_with_none_held_logs_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="asyncpool")
    async with bounded(), AsyncReqToTokenPool(3, 8) as pool:
        assert pool.release_grant_holds() == 0
        pool.hold_grants().release()
        assert pool.release_grant_holds() == 0
        assert _recovery_lines(caplog) == []


async def test_a_second_recovery_counts_only_its_own_live_holds(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The holds one ``release_grant_holds()`` ended are not live at the
    next: the next one's line says how many of its holds were lost."""
    caplog.set_level(logging.WARNING, logger="asyncpool")
    async with bounded(), AsyncReqToTokenPool(3, 8) as pool:
        first = pool.hold_grants()
        assert pool.release_grant_holds() == 1
        assert not first.held  # kept: still referenced
        second = pool.hold_grants()
        lost = pool.hold_grants()
        del lost
        gc.collect()  # collected while held: its count stays
        caplog.clear()
        assert pool.release_grant_holds() == 2
        (line,) = _recovery_lines(caplog)
        assert "ended 2 hold_grants() holds" in line and "(1 lost" in line, line
        assert not second.held and pool.grant_holds == 0
        pool.check_invariants()


async def test_a_hold_released_by_hand_is_no_longer_live(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="asyncpool")
    async with bounded(), AsyncReqToTokenPool(3, 8) as pool:
        done = pool.hold_grants()
        done.release()  # released, and still referenced
        held = pool.hold_grants()
        lost = pool.hold_grants()
        del lost
        gc.collect()
        caplog.clear()
        assert pool.release_grant_holds() == 2
        (line,) = _recovery_lines(caplog)
        assert "(1 lost" in line, line
        assert not held.held and not done.held and pool.grant_holds == 0


async def test_release_grant_holds_cancels_the_warn_after_timers() -> None:
    """A live hold's ``warn_after`` timer is cancelled when the recovery
    ends it, as its own ``release()`` cancels it: not left on the loop
    until it fires."""
    async with bounded(), AsyncReqToTokenPool(3, 8) as pool:
        hold = pool.hold_grants(warn_after=3600.0)
        timer = hold._timer
        assert timer is not None and not timer.cancelled()
        assert pool.release_grant_holds() == 1
        assert timer.cancelled() and hold._timer is None


# --------------------------------------------------------------------- close


async def test_a_closed_pool_keeps_no_stopped_watcher() -> None:
    """Once ``close()`` has seen the watcher's threads gone, the pool drops
    it (later calls return at once, with nothing to wait for)."""
    pool = AsyncReqToTokenPool(3, 8)
    fence = EventFence()
    async with bounded():
        rows = await pool.alloc(1)
    pool.free(rows, fence=fence)
    watcher = pool._wakeups.watcher
    assert watcher is not None
    ref = weakref.ref(watcher)
    del watcher
    fence.set()
    async with bounded():
        await pool.drain()
        await pool.close()
    gc.collect()
    assert ref() is None, "the closed pool still holds its stopped watcher"
    async with bounded():
        await pool.close()


# ------------------------------------------------------------- force_release


class DeadTransfer:
    """A transfer handle whose peer died: ``query()`` raises."""

    def query(self) -> bool:
        raise RuntimeError("KV transfer failed: peer gone")

    def synchronize(self) -> None:
        raise RuntimeError("KV transfer failed: peer gone")

    def __repr__(self) -> str:
        return "DeadTransfer()"


async def test_faulted_fences_of_detached_pages_released_together_say_they_faulted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Only the page ledger saw these faults (the pages-only abort): the
    line of several fences counts them too, as the one-fence line does."""
    caplog.set_level(logging.WARNING, logger="asyncpool")
    pool = AsyncReqToTokenPool(5, 8, kv=KVPagePool(9, 4))
    assert pool.kv is not None
    dead = [DeadTransfer(), DeadTransfer()]
    for fence in dead:
        grant = pool.try_admit(pages=2)
        assert grant is not None
        pool.kv.free(pool.detach_pages(grant.row, host=True), fence=fence)
        pool.free([grant.row])
    pool.reclaim()
    assert pool.stats().pages_quarantined == 4
    caplog.clear()
    assert pool.force_release(dead) == (0, 0)
    (msg,) = [r.getMessage() for r in caplog.records if "force_release" in r.getMessage()]
    assert "all of these fences faulted" in msg and "quarantined" in msg, msg
    assert "hold nothing" not in msg, msg
    assert pool.stats().pages_quarantined == 4
    await pool.close()


# ------------------------------------------------------ the poller's device


async def test_a_pool_on_cpu_0_makes_no_cuda_device_current(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``"cpu:0"`` has an index, but is no CUDA device: the poller of such a
    pool sets none (on a GPU host it would create a context on GPU 0)."""
    set_to: list[int] = []
    monkeypatch.setattr(torch.cuda, "set_device", set_to.append)
    pool = AsyncReqToTokenPool(3, 8, device="cpu:0")
    fence = EventFence()
    async with bounded():
        rows = await pool.alloc(1)
    pool.free(rows, fence=fence)
    await until(lambda: fence.queries > 0)  # the poller asked it
    fence.set()
    async with bounded():
        await pool.drain()
        await pool.close()
    assert set_to == []


def test_a_cuda_pool_hands_its_device_to_its_poller(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool's wakeups get the index of the tables' CUDA device (tables
    made on the CPU here and then read as ``cuda:3``)."""

    class OnCuda3(TokenTables):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.device = torch.device("cuda", DEVICE)

    monkeypatch.setattr(base_mod, "TokenTables", OnCuda3)
    assert AsyncReqToTokenPool(3, 8)._wakeups._device == DEVICE


def test_the_poller_makes_the_pools_device_current_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Made current when the poller starts, the pool's device is not set
    again for a CUDA fence of that device (once per thread)."""
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(
        torch.cuda, "set_device", lambda d: calls.append((threading.get_ident(), d))
    )
    key = new_stream_key()
    g_new, g_old = threading.Event(), threading.Event()
    new = CudaFence(StandInEvent(g_new, WAIT_S), DEVICE, key, 2)  # type: ignore[arg-type]
    old = CudaFence(StandInEvent(g_old, WAIT_S), DEVICE, key, 1)  # type: ignore[arg-type]
    watcher = FenceWatcher(lambda: None, name="test-once-watcher", device=DEVICE)
    try:
        watcher.watch(new)
        assert new.event.entered.wait(WAIT_S)  # type: ignore[attr-defined]
        watcher.watch(old)  # older than the one waited on: polled
        _until(lambda: watcher._thread is not None and watcher.polled == 1, "the poller")
        poller = watcher._thread
        assert poller is not None
        g_old.set()
        _until(lambda: watcher.polled == 0, "the poller to drop the old fence")
        assert [d for ident, d in calls if ident == poller.ident] == [DEVICE]
    finally:
        g_new.set()
        g_old.set()
        watcher.stop()
        watcher.join(WAIT_S)
        del new, old
        gc.collect()
        fences_mod._event_pool._free.pop(DEVICE, None)  # the stand-ins given back


def test_settled_leaves_out_a_stream_thread_inside_synchronize() -> None:
    """After ``stop()``, a stream thread blocked in a fence's
    ``synchronize()`` exits only when that returns: ``settled`` does not
    wait for it (``close()`` would spend its whole bound), as ``join``
    does not."""
    gate = threading.Event()
    fence = CudaFence(StandInEvent(gate, WAIT_S), DEVICE, new_stream_key(), 1)  # type: ignore[arg-type]
    watcher = FenceWatcher(lambda: None, name="test-settled-watcher")
    try:
        watcher.watch(fence)
        assert fence.event.entered.wait(WAIT_S)  # type: ignore[attr-defined]
        watcher.stop()
        _until(lambda: watcher.settled, "settled with the stream thread blocked")
        assert watcher.running  # the stream thread is still inside synchronize()
    finally:
        gate.set()
        _until(lambda: not watcher.running, "the stream thread to exit")
        del fence
        gc.collect()
        fences_mod._event_pool._free.pop(DEVICE, None)


# -------------------------------------------------------------------- tables


class _Stream:
    def __init__(self, name: str, log: list[tuple[str, str]]) -> None:
        self.name = name
        self.log = log

    def wait_event(self, event: Any) -> None:
        self.log.append(("wait", self.name))


class _Event:
    def __init__(self, log: list[tuple[str, str]]) -> None:
        self.log = log

    def record(self, stream: _Stream) -> None:
        self.log.append(("record", stream.name))


def _spied_tables(
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[TokenTables, list[tuple[str, str]], list[Any], list[dict[str, Any]]]:
    """Tables on the CPU with the CUDA path's ordering: the stream each
    ``current_stream`` call was asked for, and the arguments of each event
    made."""
    log: list[tuple[str, str]] = []
    asked: list[Any] = []
    made: list[dict[str, Any]] = []

    def event(*args: Any, **kwargs: Any) -> _Event:
        made.append({"args": args, **kwargs})
        return _Event(log)

    scheduler = _Stream("scheduler", log)

    def current_stream(device: Any = None) -> _Stream:
        asked.append(device)
        return scheduler

    monkeypatch.setattr(torch.cuda, "Event", event)
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    tables = TokenTables(4, 8)
    tables._cuda_stream = _Stream("pool", log)  # type: ignore[assignment]
    return tables, log, asked, made


def test_writes_ask_the_current_stream_of_the_tables_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the pool on cuda:1 and cuda:0 current on the writing thread,
    the stream to order is cuda:1's current one, not cuda:0's."""
    tables, log, asked, _ = _spied_tables(monkeypatch)
    tables.set_req_pool_info(1, ReqToTokenPoolInfo(2, 3, torch.arange(1, 4)))
    tables.write((1, slice(3, 5)), torch.tensor([7, 8], dtype=torch.int32))
    assert asked == [tables.device, tables.device]
    assert log == [("record", "pool"), ("wait", "scheduler")] * 2


def test_the_reset_event_keeps_no_timing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tables' one reset event is made untimed (a timed event costs a
    timestamp at every record), once."""
    tables, _, _, made = _spied_tables(monkeypatch)
    for row in (1, 2):
        tables.set_req_pool_info(row, ReqToTokenPoolInfo(0, 0, torch.tensor([])))
    assert made == [{"args": ()}]
