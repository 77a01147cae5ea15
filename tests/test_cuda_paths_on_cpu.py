"""CUDA-only code paths, driven on the CPU with stand-ins and spies.

* The watcher's threads make a CUDA fence's device current before they ask
  its event anything: a new thread is on device 0, where its first CUDA
  call would create a context (hundreds of MiB of GPU 0 per process).
* ``kv.alloc`` on a device pool makes its tensor before it keeps the pages
  taken: a failed copy (a CUDA OOM) gives them back.
* ``device="cuda"`` is the device current when the pool is built, not the
  one current at each later call.
* A CUDA pool refuses a ``stream=`` of another device (needs two GPUs).
* ``set_req_pool_info``/``write`` from another stream wait for the pool's
  resets through one event of the tables', recorded at each call, not a
  new CUDA event per call.
* A CUDA pool's poller asks fences of unknown origin with the pool's
  device current.
* The pooled events are blocking (a watcher thread sleeps in the driver)
  and keep no timing.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from typing import Any

import pytest
import torch
from helpers import StandInEvent

import asyncpool.fences as fences_mod
import asyncpool.kv_pages as kv_pages_mod
from asyncpool import AsyncReqToTokenPool, DeviceError, KVPagePool, ReqToTokenPoolInfo
from asyncpool.fences import CudaFence, new_stream_key
from asyncpool.tables import TokenTables, check_device
from asyncpool.wakeups import FenceWakeups
from asyncpool.watcher import FenceWatcher

WAIT_S = 10.0
DEVICE = 3  # a device index no test uses for a real event


def _until(cond: Any, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


def test_watcher_threads_make_the_fences_device_current_before_asking_its_event(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Both kinds of watcher thread (the stream's, and the poller for a
    fence handed over out of record order) ask a fence of cuda:3 only once
    cuda:3 is current on that thread."""
    current: dict[int, int] = {}  # thread -> the device it made current
    asked: list[tuple[str, int | None]] = []
    monkeypatch.setattr(
        torch.cuda, "set_device", lambda d: current.__setitem__(threading.get_ident(), d)
    )

    class Event(StandInEvent):
        def query(self) -> bool:
            asked.append(("query", current.get(threading.get_ident())))
            return super().query()

        def synchronize(self) -> None:
            asked.append(("synchronize", current.get(threading.get_ident())))
            super().synchronize()

    key = new_stream_key()
    g_new, g_old = threading.Event(), threading.Event()
    new = CudaFence(Event(g_new, WAIT_S), DEVICE, key, 2)  # type: ignore[arg-type]
    old = CudaFence(Event(g_old, WAIT_S), DEVICE, key, 1)  # type: ignore[arg-type]
    watcher = FenceWatcher(lambda: None, name="test-device-watcher")
    try:
        watcher.watch(new)
        assert new.event.entered.wait(WAIT_S)  # type: ignore[attr-defined]
        watcher.watch(old)  # older than the one waited on: polled
        _until(lambda: any(kind == "query" for kind, _ in asked), "the poller's query")
        g_old.set()
        _until(lambda: watcher.polled == 0, "the poller to drop the old fence")
        g_new.set()
    finally:
        g_new.set()
        g_old.set()
        watcher.stop()
        watcher.join(WAIT_S)
        del new, old
        gc.collect()
        fences_mod._event_pool._free.pop(DEVICE, None)  # the stand-ins given back
    assert ("synchronize", DEVICE) in asked and ("query", DEVICE) in asked
    assert all(device == DEVICE for _, device in asked), asked


def test_a_cuda_page_alloc_whose_tensor_raises_takes_no_page(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The host-to-device copy of ``kv.alloc`` (on CUDA: pinned staging and
    a device allocation) may raise; the pages it took then go back, first
    in line, instead of staying allocated with no id handed to anyone."""
    kv = KVPagePool(9, 4)
    kv._on_host = False  # the CUDA path, its copy replaced below
    calls: list[list[int]] = []

    def copy(host: torch.Tensor, device: torch.device) -> torch.Tensor:
        calls.append(host.tolist())
        if len(calls) == 1:
            raise torch.OutOfMemoryError("no memory for the pages' tensor")
        return host.clone()

    monkeypatch.setattr(kv_pages_mod, "host_to_device", copy)
    for n in (1, 3):
        calls.clear()
        with pytest.raises(torch.OutOfMemoryError):
            kv.alloc(n)
        assert kv.available_size() == 8 and kv.allocated_size() == 0
        kv.check_invariants()
        pages = kv.alloc(n)  # the very pages the failed call had taken
        assert pages is not None and pages.tolist() == calls[0] and len(calls[0]) == n
        assert kv.free(pages) == n
    kv.check_invariants()


def test_device_cuda_is_the_device_current_when_the_pool_is_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    assert check_device("cuda") == torch.device("cuda", 2)
    assert check_device(torch.device("cuda")) == torch.device("cuda", 2)
    assert check_device("cuda:1") == torch.device("cuda", 1)
    assert check_device("cpu") == torch.device("cpu")


@pytest.mark.cuda
def test_cuda_device_cuda_follows_the_current_device_at_construction() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    with torch.cuda.device(1):
        t = TokenTables(4, 4, device="cuda")
        kv = KVPagePool(5, 2, device="cuda")
    assert t.device == t.req_to_token.device == torch.device("cuda", 1)
    t.reset_rows([1, 2])  # its index on cuda:1 too, with cuda:0 current
    pages = kv.alloc(2)
    assert pages is not None and pages.device == torch.device("cuda", 1)
    torch.cuda.synchronize(1)


@pytest.mark.cuda
def test_cuda_a_pool_refuses_a_stream_of_another_device() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    other = torch.cuda.Stream(device=0)  # type: ignore[no-untyped-call]
    with pytest.raises(DeviceError, match="stream= is on cuda:0"):
        TokenTables(4, 4, device="cuda:1", stream=other)
    TokenTables(4, 4, device="cuda:0", stream=other)  # its own device's: fine


class _SpyEvent:
    """``torch.cuda.Event`` as the writes' ordering uses it: counts the
    events made and logs each record."""

    made = 0

    def __init__(self, log: list[tuple[str, str, int]]) -> None:
        type(self).made += 1
        self.log = log
        self.ident = type(self).made

    def record(self, stream: _SpyStream) -> None:
        self.log.append(("record", stream.name, self.ident))


class _SpyStream:
    """A CUDA stream's ordering calls, as torch 2.13 defines them:
    ``wait_stream(s)`` is ``self.wait_event(s.record_event())`` and
    ``record_event()`` makes a new ``torch.cuda.Event()``."""

    def __init__(self, name: str, log: list[tuple[str, str, int]]) -> None:
        self.name = name
        self.log = log

    def record_event(self, event: Any = None) -> Any:
        if event is None:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self)
        return event

    def wait_event(self, event: _SpyEvent) -> None:
        self.log.append(("wait", self.name, event.ident))

    def wait_stream(self, stream: _SpyStream) -> None:
        self.wait_event(stream.record_event())


def test_writes_wait_for_the_pools_resets_through_one_event_not_one_per_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``set_req_pool_info`` and ``write`` from a stream other than the
    pool's make the current stream wait for the resets queued on the pool's
    stream: each call records an event there and waits for it, in that
    order. The event is the tables' own, made once: ``wait_stream`` made a
    new CUDA event (a driver create and destroy) per call. From the pool's
    own stream nothing is recorded or waited for."""
    log: list[tuple[str, str, int]] = []
    _SpyEvent.made = 0
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: _SpyEvent(log))
    pool_stream, scheduler = _SpyStream("pool", log), _SpyStream("scheduler", log)
    current = [scheduler]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    tables = TokenTables(4, 8)
    tables._cuda_stream = pool_stream  # the CUDA path's ordering, its tensors on the CPU
    slots = torch.arange(1, 4, dtype=torch.int64)
    for row in (1, 2, 3):
        tables.set_req_pool_info(row, ReqToTokenPoolInfo(2, 3, slots))
        tables.write((row, slice(3, 5)), torch.tensor([7, 8], dtype=torch.int32))
    assert _SpyEvent.made == 1, f"{_SpyEvent.made} events made for 6 writes"
    assert log == [("record", "pool", 1), ("wait", "scheduler", 1)] * 6
    assert tables.req_to_token[3, :5].tolist() == [1, 2, 3, 7, 8]
    log.clear()
    current[0] = pool_stream  # on the pool's stream: ordered already
    tables.set_req_pool_info(1, ReqToTokenPoolInfo(0, 0, torch.tensor([])))
    tables.write((1, 0), 5)
    assert log == [] and _SpyEvent.made == 1


def test_the_pooled_events_sleep_in_the_driver_and_keep_no_timing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The events ``record_fence`` pools are made ``blocking=True`` (a
    stream thread's ``synchronize()`` sleeps in the driver instead of
    spinning a core) and ``enable_timing=False`` (a cheaper record); one is
    made only when the device's free list is empty. Checked here without
    a clock, where the GPU test prints the CPU figure."""
    made: list[dict[str, Any]] = []

    class Event:
        def __init__(self, **kwargs: Any) -> None:
            made.append(kwargs)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    pool = fences_mod._EventPool()
    first = pool.take(DEVICE)
    assert made == [{"enable_timing": False, "blocking": True}]
    pool.give_back(DEVICE, first)
    assert pool.take(DEVICE) is first and pool.created == 1 and len(made) == 1


def test_a_cuda_pools_poller_asks_fences_of_unknown_origin_on_the_pools_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fence of unknown origin (a bare ``torch.cuda.Event``, a transfer
    handle) has no device to read, and its ``query()`` on the poller's
    thread, new and so on device 0, made that thread's first CUDA call
    there: a context on GPU 0 for a pool on cuda:3. A CUDA pool's watcher
    is given the pool's device, which the poller makes current before it
    asks any fence; a CPU pool's makes none current."""
    current: dict[int, int] = {}  # thread -> the device it made current
    asked: list[int | None] = []
    monkeypatch.setattr(
        torch.cuda, "set_device", lambda d: current.__setitem__(threading.get_ident(), d)
    )
    gate = threading.Event()

    class Handle:  # a transfer handle: query() and synchronize(), no stream
        def query(self) -> bool:
            asked.append(current.get(threading.get_ident()))
            return gate.is_set()

        def synchronize(self) -> None:
            gate.wait(WAIT_S)

    handle = Handle()
    wakeups = FenceWakeups(
        loop=lambda: None,
        closed=lambda: False,
        close_fast_paths=lambda: None,
        reclaim=lambda: None,
        grant=lambda: None,
        ledgers=(),
        log=logging.getLogger(__name__),
        device=DEVICE,
    )
    try:
        wakeups.watch(handle)
        _until(lambda: bool(asked), "the poller's first query")
        gate.set()
        watcher = wakeups.watcher
        assert watcher is not None
        _until(lambda: not watcher.polling(handle), "the poller to drop the handle")
    finally:
        gate.set()
        closed = wakeups.close()
        if closed is not None:
            closed.join(WAIT_S)
    assert asked and all(device == DEVICE for device in asked), asked
    assert AsyncReqToTokenPool(2, 4)._wakeups._device is None  # a CPU pool's
