"""What a soak trial (a long-running process: millions of operations, pools
made and dropped) found kept alive for too long; each test fails without
its fix:

* the error kept in ``last_fence_error`` carried the traceback of the
  faulted ``query()``, whose frames reach, through ``f_back``, every frame
  of the call that met the fault: the faulted fence itself (remembered
  only weakly on purpose) and the engine's step that freed the request,
  with all its locals (a batch's tensors), until the next fault;
* a pool's fence wake-ups held it strongly: a ``HostFence`` keeps its done
  callbacks until it completes, and the watcher's poller keeps its
  ``notify`` while it runs. A pool dropped without ``close()`` while a
  transfer handle that never completes was pending was never collected,
  and its poller asked that handle a thousand times a second for ever; a
  pool closed and drained after ``force_release`` of a ``HostFence`` on a
  stuck stream stayed alive as long as that stream (the callback stayed on
  the fence). The wake-ups hold the pool weakly now, and the watcher's
  threads end once it is collected;
* a ``HostStream`` dropped without ``close()`` was never collected: its
  worker thread ran a bound method of the stream, so stream and thread
  lived for ever (a CUDA stream dropped is freed). The worker holds the
  stream's state only, and a finalizer queues the close. It also let go of
  the last work it ran (and that work's arguments) only at the next launch;
* a fence logged overdue was kept (strongly) until the next overdue check,
  which is armed only when memory goes pending again: an overdue transfer
  that completed later, with its staging buffer, stayed alive for as long
  as the pool then saw no fenced free. It is remembered weakly now, as the
  ledgers remember faulted fences;
* every ``alloc``/``admit`` that timed out (or was failed by ``close()``)
  left a reference cycle: its waiter held the future, the future the
  error, the error's traceback the waiting frame and its callers' frames.
  Under load (admission timeouts by the thousand) the callers' frames and
  locals lived until the cycle collector ran. The wait drops its waiter;
* the fence poller kept its last pass's fences (transfer handles the pool
  had reclaimed, thousands under load) in its locals while it slept, until
  its next pass or until it ended, idle, a second later;
* a flaky handle (done on the poller's thread, open on the loop's)
  reclaimed while its delayed re-watch waited left its bounce count, by
  id, until the table's bulk clear.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import weakref
from collections.abc import Iterator

import pytest
from helpers import WAIT_S, EventFence, Streams, bounded, until

from asyncpool import (
    AsyncReqToTokenPool,
    FenceError,
    HostStream,
    KVPagePool,
    PoolClosedError,
    ReqToTokenPool,
)
from asyncpool import watcher as watcher_mod
from asyncpool.ledger import SlotLedger
from asyncpool.overdue import OverdueFences


class _StepState:
    """What an engine's step holds in its locals (a batch's tensors)."""


class _Faulting:
    """A transfer handle whose peer died: ``query()`` raises."""

    def query(self) -> bool:
        raise RuntimeError("peer died (simulated)")

    def synchronize(self) -> None:
        raise RuntimeError("peer died (simulated)")


def _sync_step(pool: ReqToTokenPool, refs: list[weakref.ref[object]]) -> None:
    state = _StepState()
    fence = _Faulting()
    refs += [weakref.ref(state), weakref.ref(fence)]
    rows = pool.alloc(1)
    assert rows is not None
    pool.free(rows, fence=fence)  # meets the fault here


def test_a_kept_fence_error_keeps_no_frame_of_the_sync_step(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.CRITICAL, logger="asyncpool")
    pool = ReqToTokenPool(5, 8)
    refs: list[weakref.ref[object]] = []
    _sync_step(pool, refs)
    gc.collect()
    assert [r() for r in refs] == [None, None]  # the step's locals, the fence
    err = pool._ledger.last_fence_error
    assert isinstance(err, FenceError) and "peer died" in str(err.__cause__)
    assert pool.stats().fence_errors == 1


async def _async_step(pool: AsyncReqToTokenPool, refs: list[weakref.ref[object]]) -> None:
    state = _StepState()
    fence = _Faulting()
    refs += [weakref.ref(state), weakref.ref(fence)]
    grant = await pool.admit(pages=2)
    pool.free([grant.row], fence=fence)  # meets the fault for the row and its pages


async def test_a_kept_fence_error_keeps_no_frame_of_the_async_step(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.CRITICAL, logger="asyncpool")
    pool = AsyncReqToTokenPool(5, 8, kv=KVPagePool(9, 4))
    refs: list[weakref.ref[object]] = []
    await _async_step(pool, refs)
    gc.collect()
    assert [r() for r in refs] == [None, None]
    for led in (pool._ledger, pool.kv.ledger):  # type: ignore[union-attr]
        assert isinstance(led.last_fence_error, FenceError)
    st = pool.stats()
    assert (st.fence_errors, st.page_fence_errors, st.quarantined) == (1, 1, 1)
    await pool.close()


def test_a_chained_error_inside_query_keeps_no_frame_either(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # query() raises while handling another error: that error's traceback
    # (query()'s frame, and through it the caller's) goes too; the message
    # chain stays.
    caplog.set_level(logging.CRITICAL, logger="asyncpool")

    class Chained(_Faulting):
        def query(self) -> bool:
            try:
                raise ConnectionError("socket closed")
            except ConnectionError as exc:
                raise RuntimeError("transfer failed") from exc

    pool = ReqToTokenPool(5, 8)
    box = [_StepState()]
    ref = weakref.ref(box[0])

    def step() -> None:
        held = box.pop()  # noqa: F841  (a local of the step)
        rows = pool.alloc(1)
        assert rows is not None
        pool.free(rows, fence=Chained())

    step()
    gc.collect()
    assert ref() is None
    err = pool._ledger.last_fence_error
    assert err is not None and isinstance(err.__cause__, RuntimeError)
    assert isinstance(err.__cause__.__cause__, ConnectionError)


async def test_a_fault_from_another_thread_keeps_its_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A traceback that does not reach the calling stack is kept: a
    # HostStream's work raised on its worker thread, and the HostFence
    # reports that error as the cause of a fresh FenceError.
    caplog.set_level(logging.CRITICAL, logger="asyncpool")

    def forward() -> None:
        raise RuntimeError("illegal memory access (simulated)")

    with HostStream("soak-faulty") as stream:
        stream.launch(forward)
        fence = stream.record()
        with pytest.raises(FenceError):
            fence.synchronize()
        pool = AsyncReqToTokenPool(5, 8)
        rows = await pool.alloc(1)
        pool.free(rows, fence=fence)
        err = pool._ledger.last_fence_error
        assert isinstance(err, FenceError) and err.__cause__ is stream.error
        assert stream.error is not None and stream.error.__traceback__ is not None
        assert err.__traceback__ is None  # raised through this stack: dropped
        await pool.close()


async def test_a_dropped_pool_with_a_stuck_transfer_is_collected_and_its_poller_ends() -> None:
    stuck = EventFence()  # a transfer whose peer died: never completes
    pool = AsyncReqToTokenPool(5, 8)
    rows = await pool.alloc(2)
    pool.free(rows, fence=stuck)
    watcher = pool._wakeups.watcher
    assert watcher is not None and watcher._thread is not None
    poller = watcher._thread
    ref = weakref.ref(pool)
    del pool, watcher
    gc.collect()
    assert ref() is None  # nothing but the poller and the fence held it
    poller.join(WAIT_S)
    assert not poller.is_alive()  # it noticed its pool is gone
    stuck.set()


async def test_a_dropped_pool_with_fence_timeout_is_collected_before_the_timeout() -> None:
    """The overdue check's timer holds its pool weakly, as the wake-ups do
    (a review found a pool with fence_timeout=3 alive for 3 s after its last
    reference went, its poller asking the stuck fence all the while)."""
    stuck = EventFence()
    pool = AsyncReqToTokenPool(5, 8, fence_timeout=600.0)
    pool.free(await pool.alloc(2), fence=stuck)  # arms the overdue check
    assert pool._overdue is not None and pool._overdue.timer is not None
    watcher = pool._wakeups.watcher
    assert watcher is not None and watcher._thread is not None
    poller = watcher._thread
    ref = weakref.ref(pool)
    del pool, watcher
    gc.collect()
    assert ref() is None  # the armed timer did not keep it
    poller.join(WAIT_S)
    assert not poller.is_alive()
    stuck.set()


async def test_force_release_of_a_stuck_host_fence_keeps_no_pool_alive(kit: Streams) -> None:
    stream = kit.stream("soak-stuck")
    kit.gate(stream)  # the stream is stuck until teardown
    fence = stream.record()
    pool = AsyncReqToTokenPool(5, 8)
    rows = await pool.alloc(2)
    pool.free(rows, fence=fence)
    assert pool.force_release(fence) == (2, 0)
    async with bounded():
        await pool.drain()
    await pool.close()
    ref = weakref.ref(pool)
    del pool
    gc.collect()
    assert ref() is None  # the fence, still queued on the stuck stream, keeps no pool
    assert not fence.query()


async def test_a_pool_held_only_by_its_waiting_task_is_still_woken() -> None:
    # Weak wake-ups keep no pool alive, so a pool must be held by whoever
    # uses it: here only by the task awaiting it (held, as asyncio asks).
    async def request(pool: AsyncReqToTokenPool) -> list[int]:
        return await pool.alloc(2)

    fence = EventFence()
    pool = AsyncReqToTokenPool(3, 8)  # capacity 2
    rows = await pool.alloc(2)
    pool.free(rows, fence=fence)
    task = asyncio.ensure_future(request(pool))
    del pool, rows
    await asyncio.sleep(0)
    gc.collect()
    fence.set()  # the poller notices; the wake-up reaches the pool through the task
    async with bounded():
        assert sorted(await task) == [1, 2]


def test_a_dropped_host_stream_is_collected_and_its_worker_ends() -> None:
    ran = threading.Event()
    stream = HostStream("soak-dropped")
    stream.launch(ran.wait, WAIT_S)  # work still queued when it is dropped
    fence = stream.record()
    thread = stream._thread
    ref = weakref.ref(stream)
    del stream
    gc.collect()
    assert ref() is None
    ran.set()
    thread.join(WAIT_S)
    assert not thread.is_alive()
    assert fence.query()  # what was queued before the drop still ran


class _Engine:
    """Owns a stream; its step raises (a kernel that failed)."""

    def __init__(self) -> None:
        self.stream = HostStream("soak-engine")

    def step(self) -> None:
        raise RuntimeError("the kernel failed (simulated)")

    def step_chained(self) -> None:
        try:
            self._launch()
        except ValueError as exc:
            raise RuntimeError("the step failed (simulated)") from exc

    def _launch(self) -> None:
        raise ValueError("the launch failed (simulated)")  # this frame holds self

    def step_grouped(self) -> None:
        errors: list[Exception] = []
        try:
            self._launch()
        except ValueError as exc:
            errors.append(exc)
        # Raised outside the handler: its members are reached only as members.
        raise ExceptionGroup("the step failed (simulated)", errors)


def _fails_with(stream: HostStream) -> None:
    raise ValueError(f"work on {stream.name} failed (simulated)")


@pytest.mark.parametrize(
    "how",
    [
        "a bound method of its owner",
        "the stream as an argument",
        "a chained error",
        "an exception group",
    ],
)
def test_a_dropped_faulted_stream_is_collected_and_its_worker_ends(
    how: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The fault a stream keeps (for every later fence) keeps its traceback
    but not the finished frames' locals: the failed work's frame held the
    stream, so a dropped faulted stream was never collected and its worker
    never ended (found by a review)."""
    caplog.set_level(logging.CRITICAL, logger="asyncpool")
    engine = _Engine()
    stream = engine.stream
    if how == "a bound method of its owner":
        stream.launch(engine.step)
    elif how == "a chained error":
        stream.launch(engine.step_chained)  # the cause's frames hold it too
    elif how == "an exception group":
        stream.launch(engine.step_grouped)  # so do its members' frames
    else:
        stream.launch(_fails_with, stream)
    with pytest.raises(FenceError):
        stream.synchronize()  # the fault happened
    assert stream.error is not None and stream.error.__traceback__ is not None
    thread = stream._thread
    ref = weakref.ref(stream)
    del stream, engine
    gc.collect()
    assert ref() is None
    thread.join(WAIT_S)
    assert not thread.is_alive()


def test_a_fault_chained_to_a_paused_generator_leaves_the_generator_alive(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Clearing the kept fault's frames skips generator frames: one in a
    chained error's traceback may be paused at a yield, and clearing it
    would close the generator under its owner (found by a review)."""
    caplog.set_level(logging.CRITICAL, logger="asyncpool")

    def attempts() -> Iterator[KeyError]:  # hands out the errors it caught
        while True:
            try:
                raise KeyError("probe failed")
            except KeyError as exc:
                yield exc  # paused here: this frame is in exc.__traceback__

    probes = attempts()

    def work() -> None:
        raise RuntimeError("the step failed (simulated)") from next(probes)

    with HostStream("soak-generator") as stream:
        stream.launch(work)
        with pytest.raises(FenceError):
            stream.synchronize()
    assert isinstance(next(probes), KeyError)  # still running, not closed


def test_a_close_from_another_streams_worker_does_not_wait_for_it() -> None:
    """Stream A's work waits for a fence of stream B; a fence callback on
    B's worker closes A again (A closed already): waiting there for A's
    worker, which waits for B, deadlocked both. close() joins from any
    thread but a stream's worker (found by a review)."""
    a, b = HostStream("soak-a"), HostStream("soak-b")
    gate = threading.Event()
    b.launch(gate.wait, WAIT_S)  # B busy until the gate opens
    early = b.record()
    b.launch(lambda: None)
    later = b.record()
    a.wait(later)  # A's worker will wait for B's later fence
    early.add_done_callback(a.close)  # runs on B's worker
    owner = threading.Thread(target=a.close, name="soak-owner")
    owner.start()  # the first close: joins A's worker
    gate.set()
    owner.join(WAIT_S)
    assert not owner.is_alive() and later.query()
    b.close()


def test_a_second_close_returns_once_the_worker_ended() -> None:
    """Work that closes its own stream does not wait for itself; the owner's
    close() after it found the stream closed and returned at once, with the
    work still running. Every close() but the worker's own joins it."""
    stream = HostStream("soak-closes-itself")
    entered, gate = threading.Event(), threading.Event()
    log: list[str] = []

    def work() -> None:
        stream.close()  # from the worker: returns without joining
        entered.set()
        gate.wait(WAIT_S)
        log.append("work done")

    stream.launch(work)
    assert entered.wait(WAIT_S)

    def owner() -> None:
        stream.close()
        log.append("owner's close returned")

    closer = threading.Thread(target=owner)
    closer.start()
    closer.join(0.5)  # bounded: it must still be waiting for the worker
    gate.set()
    closer.join(WAIT_S)
    assert not closer.is_alive()
    assert log == ["work done", "owner's close returned"]


def test_an_idle_host_stream_keeps_no_work_it_ran() -> None:
    class Batch:
        pass

    batch = Batch()
    ref = weakref.ref(batch)
    with HostStream("soak-idle") as stream:
        stream.launch(lambda b: None, batch)
        stream.synchronize()
        del batch
        gc.collect()
        assert ref() is None  # the idle worker holds neither the work nor its args


class _Transfer:
    """A slow transfer handle that owns a staging buffer (weakly referable)."""

    def __init__(self) -> None:
        self.done = False
        self.buffer = bytearray(1 << 16)

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        pass


def test_an_overdue_fence_that_completes_is_not_kept_until_the_next_check(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.CRITICAL, logger="asyncpool")  # a kept record holds it
    clock = [0.0]
    led = SlotLedger(8, clock=lambda: clock[0])
    overdue = OverdueFences(1.0, [led], clock=lambda: clock[0])
    fence = _Transfer()
    ref = weakref.ref(fence)
    rows = led.take(1)
    assert rows is not None
    led.free(rows, fence=fence)
    clock[0] = 2.0
    assert overdue.check() is None  # logged once; nothing else pending: not re-armed
    fence.done = True
    assert led.reclaim() == 1
    del fence
    gc.collect()
    assert ref() is None  # no check ran since, and none is due


async def test_a_pool_keeps_no_overdue_transfer_after_it_completed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.CRITICAL, logger="asyncpool")
    pool = AsyncReqToTokenPool(5, 8, fence_timeout=0.01)
    fence = _Transfer()
    ref = weakref.ref(fence)
    pool.free(await pool.alloc(2), fence=fence)
    await until(lambda: pool.stats().overdue_fences == 1)  # time must pass
    fence.done = True
    del fence
    await until(lambda: not pool.pending_size())  # the poller notices, the loop reclaims
    watcher = pool._wakeups.watcher
    assert watcher is not None and watcher._thread is not None
    watcher._thread.join(WAIT_S)  # idle: it ends, dropping the fences of its last pass
    rows = await pool.alloc(1)  # unfenced traffic arms no overdue check
    pool.free(rows)
    gc.collect()
    assert ref() is None
    await pool.close()


@pytest.mark.parametrize("how", ["alloc", "admit", "close"])
async def test_a_failed_wait_leaves_no_cycle_holding_the_caller(how: str) -> None:
    pool = AsyncReqToTokenPool(3, 8, kv=KVPagePool(9, 4))
    held = await pool.alloc(2)  # full: the next wait queues

    async def request(refs: list[weakref.ref[object]]) -> None:
        state = _StepState()  # a request's locals
        refs.append(weakref.ref(state))
        try:
            if how == "admit":
                await pool.admit(pages=1, timeout=0.001)
            else:
                await pool.alloc(1, timeout=None if how == "close" else 0.001)
        except (TimeoutError, PoolClosedError):
            pass

    refs: list[weakref.ref[object]] = []
    gc.collect()
    gc.disable()  # reference counting alone must free the caller's frame
    try:
        task = asyncio.ensure_future(request(refs))
        if how == "close":
            await asyncio.sleep(0)
            await pool.close()
        async with bounded():
            await task
        del task
        assert [r() for r in refs] == [None]
    finally:
        gc.enable()
    pool.free(held)
    await pool.close()


async def test_an_idle_poller_keeps_no_fence_of_its_last_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The poller lingers (here: for longer than the test's bound) before it
    # ends; meanwhile it must not hold the transfer handles of its last pass,
    # which the pool reclaimed long ago (a soak run found thousands, with
    # their staging buffers, alive in its locals between passes).
    monkeypatch.setattr(watcher_mod, "_STREAM_LINGER_S", 600.0)
    pool = AsyncReqToTokenPool(5, 8)
    fence = _Transfer()
    ref = weakref.ref(fence)
    pool.free(await pool.alloc(2), fence=fence)
    watcher = pool._wakeups.watcher
    assert watcher is not None
    await until(lambda: watcher.polls > 0)  # the poller asked it at least once
    fence.done = True
    del fence
    await until(lambda: not pool.pending_size())  # the poller notices, the loop reclaims
    assert watcher._thread is not None  # still there, idle: it lingers
    await until(lambda: gc.collect() >= 0 and ref() is None)
    await pool.close()


class _TwoFacedTransfer:
    """Answers done on any thread but the loop's until it is done (a status
    poll that flakes): the poller lets go of it, the loop finds it open."""

    def __init__(self) -> None:
        self.done = False
        self._loop_thread = threading.get_ident()

    def query(self) -> bool:
        return self.done or threading.get_ident() != self._loop_thread

    def synchronize(self) -> None:
        pass


async def test_flaky_handles_leave_no_bounce_counts_behind() -> None:
    # Each handle bounces (done on the poller, open on the loop) until its
    # re-watch is delayed; it completes then, and a call into the pool
    # reclaims it while that re-watch waits. Every count must go with its
    # fence: before, each stayed, by id, until the bulk clear (a soak of
    # flaky handles left about one in six).
    pool = AsyncReqToTokenPool(5, 8)
    wakeups = pool._wakeups
    for _ in range(50):
        handle = _TwoFacedTransfer()
        pool.free(await pool.alloc(1), fence=handle)
        await until(lambda h=handle: h in wakeups._rewatch_due)  # its second bounce
        handle.done = True
        assert pool.reclaim() == 1
        await until(lambda: not wakeups._rewatch_due)  # the delayed re-watch ran
    assert wakeups._bounces == {}
    await pool.close()
