"""Gaps found by hand-made mutation testing of fences.py, tables.py, base.py
and errors.py: each test here fails on one mutant that the rest of the suite
let through.

It pins HostFence's callback removal (the callback asked for, not the
first); the HostStream worker's handling of faults and closes (a
``SystemExit`` from launched work faults the stream instead of killing the
worker, ``close(cancel_pending=True)`` keeps a fault that was already there,
``close()`` from work on the stream itself does not fault it) and its daemon
thread; the strict yes-or-no reading of ``query()`` answers (bytes, ints
other than 0 and 1, coroutines closed, float arrays by truth value);
``record_fence``'s refusal of non-CUDA devices; the memory-saver adapter's
calls into the saver (with a stand-in saver, so no CUDA is needed: region
without CPU backup, always exited, open failures wrapped, pause/resume
forwarded, tables zeroed after resume) and its CPU-only message;
``set_req_pool_info``'s slot checks (bool, complex, sparse, too many slots,
none at all, the dtype's largest id); ``zero_tokens`` on the padding row;
``count_of(0)``; an exact-int priority; every error a ``PoolError``.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from helpers import WAIT_S, Streams

from asyncpool import (
    FenceError,
    HostStream,
    InvalidSlotError,
    MemorySaverError,
    PoolError,
    ReqToTokenPool,
    ReqToTokenPoolInfo,
    errors,
    record_fence,
)
from asyncpool import tables as tables_module
from asyncpool.base import check_wait_args, count_of
from asyncpool.fences import is_done
from asyncpool.tables import KV_CACHE_TAG, MemorySaverAdapter, TokenTables

# ---------------------------------------------------------------- fences


def test_remove_done_callback_removes_the_callback_asked_for(kit: Streams) -> None:
    """``remove_done_callback(fn)`` forgets ``fn`` itself, wherever it sits
    in the list: the callbacks registered before it still run."""
    s = kit.stream()
    gate = kit.gate(s)
    fence = s.record()
    ran: list[str] = []
    fence.add_done_callback(lambda: ran.append("first"))

    def second() -> None:
        ran.append("second")

    fence.add_done_callback(second)
    assert fence.remove_done_callback(second) is True
    # Queued behind ``fence``: the worker runs ``fence``'s callbacks before
    # it reaches this one, so once it completes they have run.
    behind = s.record()
    gate.open()
    assert behind.wait(WAIT_S)
    assert ran == ["first"]


def test_work_raising_system_exit_faults_the_stream_instead_of_stopping_it(
    kit: Streams, caplog: pytest.LogCaptureFixture
) -> None:
    """Launched work that raises ``SystemExit`` faults the stream like any
    other exception: the fence behind it raises ``FenceError`` (chained to
    it) instead of never completing because the worker thread died."""
    caplog.set_level(logging.CRITICAL, logger="asyncpool")
    s = kit.stream()

    def exits() -> None:
        raise SystemExit(3)

    s.launch(exits)
    fence = s.record()
    with pytest.raises(FenceError) as ei:
        assert fence.wait(WAIT_S), "the worker died: the fence never settled"
    assert isinstance(ei.value.__cause__, SystemExit)
    assert isinstance(s.error, SystemExit)


def test_close_cancel_pending_keeps_the_fault_that_was_already_there(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A fence dropped by ``close(cancel_pending=True)`` on an already
    faulted stream reports the stream's original fault, not "closed"."""
    caplog.set_level(logging.CRITICAL, logger="asyncpool")
    boom = ValueError("kernel fault")
    s = HostStream()
    recorded = threading.Event()

    def close_then_fault() -> None:
        recorded.wait(WAIT_S)
        s.close(cancel_pending=True)  # from the worker: does not join
        raise boom

    try:
        s.launch(close_then_fault)
        queued = s.record()  # queued behind the work: pending
        recorded.set()
        with pytest.raises(FenceError) as ei:
            queued.wait(WAIT_S)
        assert ei.value.__cause__ is boom
        assert queued.error is boom and s.error is boom
    finally:
        recorded.set()
        s.close()
        s._thread.join(WAIT_S)


def test_close_from_work_on_the_stream_lets_the_queued_fences_complete(kit: Streams) -> None:
    """``close()`` called by work running on the stream's own worker does
    not join (a thread cannot join itself), so it does not fault the stream:
    the fence queued behind it still completes, and the stream is closed."""
    s = kit.stream()
    gate = kit.gate(s)
    s.launch(s.close)
    queued = s.record()  # before the close runs: pending behind the gate
    gate.open()
    assert queued.wait(WAIT_S) is True
    assert s.error is None and s.closed
    with pytest.raises(RuntimeError, match="closed"):
        s.launch(int)


def test_an_unclosed_stream_does_not_keep_the_process_alive() -> None:
    """The worker is a daemon thread (as ``close()``'s docstring says): a
    process that never closes a stream blocked in work still exits."""
    code = textwrap.dedent(
        """
        import threading
        from asyncpool import HostStream
        s = HostStream()
        s.launch(threading.Event().wait)  # blocks the worker forever
        print("exiting")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "exiting"


class _DeviceStream:
    """Not a stream: an object with a ``device`` that is not CUDA."""

    def __init__(self, device: str) -> None:
        self.device = torch.device(device)


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_record_fence_refuses_an_object_on_a_device_that_is_not_cuda(device: str) -> None:
    """``record_fence`` takes a HostStream or a CUDA stream: anything else
    with a ``device`` (a meta or CPU one) is refused with the TypeError."""
    with pytest.raises(TypeError, match="HostStream or a CUDA stream"):
        record_fence(_DeviceStream(device))  # type: ignore[arg-type]


async def _async_query() -> bool:
    return True


@pytest.mark.parametrize(
    "answer",
    [b"done", b"", -1, 2, -(2**40)],
    ids=["bytes", "empty bytes", "minus one", "two", "big negative"],
)
def test_is_done_refuses_bytes_and_ints_other_than_0_and_1(answer: object) -> None:
    """Bytes (a status word) and any int but 0 and 1 (a status code, -1
    included) are not a yes-or-no answer: ``TypeError``."""
    with pytest.raises(TypeError, match="not True or False"):
        is_done(answer)


def test_is_done_closes_a_coroutine_it_refuses() -> None:
    """An ``async def query`` answers a coroutine: refused, and closed so no
    "never awaited" warning follows (the suite runs with ``-W error``)."""
    coro = _async_query()
    with pytest.raises(TypeError, match="not True or False"):
        is_done(coro)
    assert coro.cr_frame is None  # closed, not merely dropped


@pytest.mark.parametrize(
    ("answer", "want"),
    [
        (np.False_, False),
        (np.True_, True),
        (torch.tensor(False), False),
        (np.array([False]), False),
        (np.array([1]), True),
        (torch.tensor([0]), False),
    ],
    ids=["np.False_", "np.True_", "tensor False", "array [False]", "array [1]", "tensor [0]"],
)
def test_is_done_reads_other_yes_or_no_types(answer: object, want: bool) -> None:
    """Numpy bools and one-element bool or integer arrays and tensors are
    yes-or-no answers (float arrays are not: tests/test_bad_input_trial.py)."""
    assert is_done(answer) is want


# ---------------------------------------------------------------- memory saver


class _FakeRegion:
    def __init__(self, saver: _FakeSaver, tag: str, enable_cpu_backup: bool) -> None:
        self.saver = saver
        saver.calls.append(("region", tag, enable_cpu_backup))

    def __enter__(self) -> None:
        self.saver.calls.append(("enter",))

    def __exit__(self, *exc: object) -> None:
        self.saver.calls.append(("exit",))


class _FakeSaver:
    """Stands in for ``torch_memory_saver``: records what it is asked."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.on_resume: list[Any] = []

    def region(self, tag: str, enable_cpu_backup: bool) -> _FakeRegion:
        return _FakeRegion(self, tag, enable_cpu_backup)

    def pause(self, tag: str) -> None:
        self.calls.append(("pause", tag))

    def resume(self, tag: str) -> None:
        self.calls.append(("resume", tag))
        for fn in self.on_resume:
            fn()


class _BrokenSaver(_FakeSaver):
    def region(self, tag: str, enable_cpu_backup: bool) -> _FakeRegion:
        raise OSError("no hook")


def test_memory_saver_region_opens_without_cpu_backup_and_always_closes() -> None:
    """An enabled adapter opens the saver's region for the tag with no CPU
    backup (the content is discarded and zeroed on resume), and closes it
    when the block exits, also by an exception."""
    saver = _FakeSaver()
    m = MemorySaverAdapter(saver)
    assert m.enabled
    with m.region("kv_cache"):
        assert saver.calls == [("region", "kv_cache", False), ("enter",)]
    assert saver.calls[-1] == ("exit",)
    saver.calls.clear()
    with pytest.raises(KeyError), m.region("kv_cache"):
        raise KeyError("boom")
    assert saver.calls == [("region", "kv_cache", False), ("enter",), ("exit",)]


def test_memory_saver_region_that_cannot_open_raises_memory_saver_error() -> None:
    """A saver whose region cannot open raises :class:`MemorySaverError`,
    chained to the saver's error."""
    m = MemorySaverAdapter(_BrokenSaver())
    with pytest.raises(MemorySaverError, match="could not open") as ei, m.region("kv_cache"):
        pass  # pragma: no cover - never entered
    assert isinstance(ei.value.__cause__, OSError)


def test_memory_saver_pause_and_resume_reach_the_saver() -> None:
    """An enabled adapter forwards ``pause``/``resume`` with the tag."""
    saver = _FakeSaver()
    m = MemorySaverAdapter(saver)
    m.pause("kv_cache")
    m.resume("kv_cache")
    assert saver.calls == [("pause", "kv_cache"), ("resume", "kv_cache")]


class _FakeCdll:
    def __init__(self) -> None:
        self.marks: list[bool] = []

    def tms_set_interesting_region(self, value: bool) -> None:
        self.marks.append(value)


def _initialised_saver(hook_mode: str) -> Any:
    cdll = _FakeCdll()
    impl = SimpleNamespace(_hook_mode=hook_mode, _binary_wrapper=SimpleNamespace(cdll=cdll))
    return SimpleNamespace(_impl=impl), cdll


def test_exit_guard_marks_the_thread_in_a_region_only_in_torch_hook_mode(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """At exit the guard marks the thread as inside a region when the saver
    runs torch's allocator hooks (whose free calls ``exit(1)`` outside one;
    on a GPU, test_cuda's exit test shows it), and does nothing for the
    preload hooks, a saver never initialised, or one of another shape (it
    logs that at debug and never raises at exit)."""
    saver, cdll = _initialised_saver("torch")
    tables_module._mark_main_thread_in_region(saver)
    assert cdll.marks == [True]

    saver, cdll = _initialised_saver("preload")
    tables_module._mark_main_thread_in_region(saver)
    assert cdll.marks == []

    tables_module._mark_main_thread_in_region(SimpleNamespace(_impl=None))
    with caplog.at_level(logging.DEBUG, logger="asyncpool.tables"):
        tables_module._mark_main_thread_in_region(object())
    assert "exit guard not applied" in caplog.text


def test_exit_guard_is_registered_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    registered: list[tuple[Any, ...]] = []
    monkeypatch.setattr(tables_module, "_exit_guard_registered", False)
    monkeypatch.setattr(tables_module.atexit, "register", lambda *a: registered.append(a))
    saver = object()
    tables_module._let_the_saver_free_its_region_at_exit(saver)
    tables_module._let_the_saver_free_its_region_at_exit(saver)
    assert registered == [(tables_module._mark_main_thread_in_region, saver)]


@pytest.mark.usefixtures("without_cuda")
@pytest.mark.parametrize("device", ["cpu", "cpu:0"])  # "meta" is a DeviceError now
def test_memory_saver_without_cuda_says_the_machine_has_none(device: str) -> None:
    """On a machine without CUDA, ``enable_memory_saver=True`` is refused
    for the missing CUDA device, not with advice to move the tables to
    ``device='cuda'``, which cannot work here."""
    for make in (
        lambda: TokenTables(4, 4, device, True),
        lambda: ReqToTokenPool(4, 4, device, True),
    ):
        with pytest.raises(MemorySaverError, match="this machine has no CUDA device"):
            make()


@contextmanager
def _tables_with_saver(size: int = 4, ctx: int = 4) -> Iterator[tuple[TokenTables, _FakeSaver]]:
    t = TokenTables(size, ctx)
    saver = _FakeSaver()
    t.memory_saver = MemorySaverAdapter(saver)
    yield t, saver


def test_tables_pause_and_resume_use_the_kv_cache_region_and_zero_after_resume() -> None:
    """``pause``/``resume`` act on the ``kv_cache`` region; after
    ``resume`` every length and token slot reads zero, even when the memory
    handed back holds garbage (zeroed after the saver restored it, not
    before)."""
    with _tables_with_saver() as (t, saver):
        for r in range(1, 4):
            t.set_req_pool_info(r, ReqToTokenPoolInfo(1, 2, torch.tensor([5, 6])))
        t.pause()
        assert saver.calls == [("pause", KV_CACHE_TAG)]

        def garbage() -> None:  # the restored pages' old content
            t._lens.fill_(9)
            t.req_to_token.fill_(9)

        saver.on_resume.append(garbage)
        t.resume()
        assert saver.calls[-1] == ("resume", KV_CACHE_TAG)
        for x in (t.verified_lens, t.alloced_lens, t.alloced_lens_cpu, t.req_to_token):
            assert not x.any()


def test_tables_on_cuda_synchronise_their_device_before_the_saver_unmaps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A row reset may still be queued on the device when memory is
    released; the saver unmaps without waiting for it, so the tables wait
    for their device first (CUDA only: on CPU a reset has run already)."""
    with _tables_with_saver() as (t, saver):
        monkeypatch.setattr(t, "_on_cuda", True)
        monkeypatch.setattr(
            torch.cuda, "synchronize", lambda device=None: saver.calls.append(("sync", device))
        )
        t.pause()
        assert saver.calls == [("sync", t.device), ("pause", KV_CACHE_TAG)]


def test_the_pools_cuda_stream_waits_for_the_tables_zero_fills(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The tables are zeroed on the stream current at construction; the
    pool's own stream (the forward stream: resets, the first forward) is
    made to wait for it, or a forward's first writes could be zeroed late."""
    waited: list[object] = []

    class Stream:
        def wait_stream(self, other: object) -> None:
            waited.append(other)

    current = object()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    t = TokenTables(4, 4)
    assert waited == []  # no CUDA stream: nothing to order
    t._cuda_stream = Stream()
    t._allocate()
    assert waited == [current]


# ---------------------------------------------------------------- tables


@pytest.mark.parametrize(
    "slots",
    [
        torch.tensor([True, False]),
        torch.tensor([1 + 0j, 2 + 0j]),
        torch.tensor([1, 2]).to_sparse(),
    ],
    ids=["bool", "complex", "sparse"],
)
def test_set_req_pool_info_refuses_slots_that_are_not_plain_integer_tensors(
    slots: torch.Tensor,
) -> None:
    """Bool, complex and sparse ``alloced_slots`` are refused with
    :class:`InvalidSlotError`, writing nothing."""
    t = TokenTables(4, 8)
    with pytest.raises(InvalidSlotError, match="1-D integer tensor"):
        t.set_req_pool_info(1, ReqToTokenPoolInfo(1, 2, slots))
    assert not t._lens.any() and not t.req_to_token.any()


def test_set_req_pool_info_refuses_more_slots_than_alloced_len() -> None:
    """``alloced_slots`` must have exactly ``alloced_len`` entries: more is
    refused too, not only fewer."""
    t = TokenTables(4, 8)
    with pytest.raises(InvalidSlotError, match="expected alloced_len=2"):
        t.set_req_pool_info(1, ReqToTokenPoolInfo(1, 2, torch.tensor([1, 2, 3])))
    assert not t._lens.any() and not t.req_to_token.any()


def test_set_req_pool_info_with_no_slots_writes_zero_lengths() -> None:
    """``alloced_len=0`` with an empty slot tensor is valid: the lengths are
    set to zero and the row's slots left alone."""
    t = TokenTables(4, 8)
    t.set_req_pool_info(1, ReqToTokenPoolInfo(3, 3, torch.tensor([4, 5, 6])))
    t.set_req_pool_info(1, ReqToTokenPoolInfo(0, 0, torch.empty(0, dtype=torch.int64)))
    assert [int(t.verified_lens[1]), int(t.alloced_lens[1]), int(t.alloced_lens_cpu[1])] == [0] * 3
    assert t.req_to_token[1, :3].tolist() == [4, 5, 6]


def test_set_req_pool_info_accepts_the_largest_slot_id_the_table_holds() -> None:
    """A slot id equal to ``req_to_token``'s dtype maximum fits and is kept."""
    t = TokenTables(4, 8)
    top = torch.iinfo(torch.int32).max
    t.set_req_pool_info(2, ReqToTokenPoolInfo(1, 2, torch.tensor([0, top])))
    assert t.req_to_token[2, :2].tolist() == [0, top]


def test_zero_tokens_zeroes_the_padding_row_too() -> None:
    """``zero_tokens`` (resume: the region's content is gone) zeroes every
    row of ``req_to_token``, the padding row 0 included."""
    t = TokenTables(3, 4)
    t.req_to_token.fill_(7)
    t.zero_tokens()
    assert not t.req_to_token.any()


# ---------------------------------------------------------------- base.py


def test_count_of_uses_the_plural_for_zero() -> None:
    """Messages read as sentences: "0 rows", "1 row", "2 rows"."""
    assert [count_of(n, "row") for n in (0, 1, 2)] == ["0 rows", "1 row", "2 rows"]


@pytest.mark.parametrize("priority", [True, False, np.bool_(True), 1.0], ids=str)
def test_check_wait_args_refuses_a_priority_that_is_not_an_integer(priority: object) -> None:
    """A priority must be an int: a bool (an int subclass, but no priority
    anyone means) is refused like a float (a numpy int is accepted:
    tests/test_bad_input_trial.py)."""
    with pytest.raises(TypeError, match="priority must be an int"):
        check_wait_args(priority, None)
    check_wait_args(-3, None)


# ---------------------------------------------------------------- errors.py


def test_every_public_error_is_a_pool_error() -> None:
    """``except PoolError`` catches every error asyncpool raises, as the
    errors module promises (``PoolBusyError`` included)."""
    assert errors.__all__
    for name in errors.__all__:
        assert issubclass(getattr(errors, name), PoolError), name


# ---------------------------------------------------------------- bug fix


def test_the_stream_is_idle_as_soon_as_synchronize_returns(kit: Streams) -> None:
    """Once ``synchronize()`` on the last fence returns, everything queued
    has run and the next ``record()`` is complete at once (``free(after=
    stream)`` defers nothing), even while the worker still runs that fence's
    done-callbacks. The worker counted the fence done only after its
    callbacks, so in that window the next fence came back pending: a rare
    failure of ``test_record_on_an_idle_stream_is_complete_at_once``."""
    s = kit.stream()
    gate = kit.gate(s)
    fence = s.record()
    in_callback = threading.Event()
    release = kit.event()

    def slow_callback() -> None:  # holds the worker between settle and the next item
        in_callback.set()
        release.wait(WAIT_S)

    fence.add_done_callback(slow_callback)
    gate.open()
    assert in_callback.wait(WAIT_S)
    fence.synchronize()
    assert s.record().query() is True
    release.set()
