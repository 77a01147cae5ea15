"""Fences: HostStream ordering, HostFence query/synchronize/wait/callbacks,
faults, cross-stream waits, close semantics, record_fence, and CudaFence."""

from __future__ import annotations

import gc
import logging
import threading
import weakref

import pytest
import torch
from helpers import WAIT_S, bounded, gpu_busy

from asyncpool import (
    CudaFence,
    Fence,
    FenceError,
    HostFence,
    HostStream,
    OrderedFence,
    new_stream_key,
    record_fence,
)
from asyncpool.fences import is_fence


def test_launched_work_runs_in_launch_order(kit):
    s = kit.stream()
    out: list[int] = []
    for i in range(200):
        s.launch(out.append, i)
    s.synchronize()
    assert out == list(range(200))


def test_work_runs_on_the_worker_thread(kit):
    s = kit.stream("named-worker")
    names: list[str] = []
    s.launch(lambda: names.append(threading.current_thread().name))
    s.synchronize()
    assert names == ["named-worker"]
    assert threading.current_thread().name != "named-worker"


def test_record_query_synchronize(kit):
    s = kit.stream()
    gate = kit.gate(s)
    ran: list[str] = []
    s.launch(ran.append, "work")
    f = s.record()
    assert isinstance(f, HostFence)
    assert f.stream_key == s.key
    assert f.seq == 1
    assert f.query() is False
    assert f.wait(0.05) is False  # the gate holds it
    assert ran == []
    gate.open()
    f.synchronize()
    assert f.query() is True
    assert ran == ["work"]
    assert f.wait(0) is True
    assert f.error is None
    assert "done" in repr(f)


def test_seq_increases_per_stream_and_keys_differ(kit):
    a, b = kit.stream(), kit.stream()
    fa = [a.record() for _ in range(3)]
    fb = b.record()
    assert [f.seq for f in fa] == [1, 2, 3]
    assert {f.stream_key for f in fa} == {a.key}
    assert fb.seq == 1 and fb.stream_key == b.key != a.key
    b.synchronize()
    a.synchronize()
    assert all(f.query() for f in fa)


def test_gate_holds_every_later_fence_until_opened(kit):
    s = kit.stream()
    gate = kit.gate(s)
    out: list[int] = []
    fences = []
    for i in range(5):
        s.launch(out.append, i)
        fences.append(s.record())
    assert not fences[0].wait(0.05)
    assert not any(f.query() for f in fences)
    assert out == []
    gate.open()
    assert fences[-1].wait(WAIT_S)
    assert all(f.query() for f in fences)
    assert out == list(range(5))


def test_fences_complete_in_record_order(kit):
    s = kit.stream()
    seen: list[int] = []
    gate = kit.gate(s)
    fences = [s.record() for _ in range(20)]
    for f in fences:
        # Callback order on the worker is the record order.
        f.add_done_callback(lambda f=f: seen.append(f.seq))
    # Waiters wake before a fence's callbacks run; the worker runs them before
    # it settles the next fence: wait on one queued behind the twenty.
    behind = s.record()
    gate.open()
    assert behind.wait(WAIT_S)
    assert seen == list(range(1, 21))


def test_fault_makes_later_fences_raise_but_earlier_ones_completed(kit, caplog):
    s = kit.stream()
    ran: list[str] = []
    boom = ValueError("kernel fault")

    def bad() -> None:
        raise boom

    s.launch(ran.append, "before")
    before = s.record()
    with caplog.at_level(logging.CRITICAL, logger="asyncpool.fences"):
        s.launch(bad)
        after1 = s.record()
        s.launch(ran.append, "skipped")  # sticky fault: later work is skipped
        after2 = s.record()
        before.synchronize()
        assert before.query() is True
        with pytest.raises(FenceError) as ei:
            after1.synchronize()
    assert ei.value.__cause__ is boom
    assert after1.error is boom
    with pytest.raises(FenceError):
        after1.query()
    with pytest.raises(FenceError):
        after1.wait(WAIT_S)
    with pytest.raises(FenceError):
        after2.synchronize()
    with pytest.raises(FenceError):
        after2.query()
    assert ran == ["before"]
    assert s.error is boom
    assert "faulted" in repr(s)
    # Fences recorded after the fault report it too; so does synchronize().
    with pytest.raises(FenceError):
        s.synchronize()
    assert before.query() is True  # an earlier fence stays completed


def test_done_callback_runs_on_completion_on_the_worker(kit):
    s = kit.stream("cb-worker")
    gate = kit.gate(s)
    f = s.record()
    fired = threading.Event()
    where: list[str] = []

    def cb() -> None:
        where.append(threading.current_thread().name)
        fired.set()

    f.add_done_callback(cb)
    assert not fired.is_set()
    gate.open()
    assert fired.wait(WAIT_S)
    assert where == ["cb-worker"]


def test_done_callback_on_completed_fence_runs_at_once_on_caller(kit):
    s = kit.stream()
    f = s.record()
    f.synchronize()
    where: list[str] = []
    f.add_done_callback(lambda: where.append(threading.current_thread().name))
    assert where == [threading.current_thread().name]


def test_done_callback_runs_on_fault_too(kit, caplog):
    s = kit.stream()
    gate = kit.gate(s)
    s.launch(lambda: 1 / 0)
    f = s.record()
    fired = threading.Event()
    f.add_done_callback(fired.set)
    with caplog.at_level(logging.CRITICAL, logger="asyncpool.fences"):
        gate.open()
        assert fired.wait(WAIT_S)
    with pytest.raises(FenceError):
        f.query()


def test_raising_done_callback_is_logged_and_others_still_run(kit, caplog):
    s = kit.stream()
    gate = kit.gate(s)
    f = s.record()
    fired = threading.Event()

    def bad() -> None:
        raise RuntimeError("callback bug")

    f.add_done_callback(bad)
    f.add_done_callback(fired.set)
    with caplog.at_level(logging.ERROR, logger="asyncpool.fences"):
        gate.open()
        assert fired.wait(WAIT_S)
        s.synchronize()
    assert any("callback" in r.getMessage() for r in caplog.records)
    assert f.query() is True


def test_stream_wait_orders_work_across_streams(kit):
    a, b = kit.stream(), kit.stream()
    gate = kit.gate(a)
    order: list[str] = []
    a.launch(order.append, "a")
    fa = a.record()
    b.wait(fa)
    b.launch(order.append, "b")
    fb = b.record()
    # b is held by a's gate through the wait.
    assert not fb.wait(0.05)
    assert order == []
    gate.open()
    assert fb.wait(WAIT_S)
    assert order == ["a", "b"]


def test_stream_wait_on_faulted_fence_faults_the_waiting_stream(kit, caplog):
    a, b = kit.stream(), kit.stream()
    with caplog.at_level(logging.CRITICAL, logger="asyncpool.fences"):
        a.launch(lambda: 1 / 0)
        fa = a.record()
        b.wait(fa)
        ran: list[str] = []
        b.launch(ran.append, "b")
        fb = b.record()
        with pytest.raises(FenceError):
            fb.synchronize()
    assert ran == []
    assert isinstance(b.error, FenceError)


def test_close_runs_queued_work_before_returning():
    s = HostStream()
    ev = threading.Event()
    s.launch(ev.wait)
    ran: list[int] = []
    for i in range(3):
        s.launch(ran.append, i)
    f = s.record()
    closer = threading.Thread(target=s.close)
    closer.start()
    try:
        assert not f.wait(0.05)
        assert ran == []
    finally:
        ev.set()
        closer.join(WAIT_S)
    assert not closer.is_alive()
    assert f.query() is True
    assert ran == [0, 1, 2]
    assert s.closed
    assert not s._thread.is_alive()
    s.close()  # idempotent


def test_close_cancel_pending_faults_queued_fences():
    s = HostStream()
    ev = threading.Event()
    ran: list[str] = []
    s.launch(ev.wait)
    done_before = s.record()
    # Closing from the worker itself does not join; the work and fence queued
    # behind it must be dropped and faulted.
    s.launch(lambda: s.close(cancel_pending=True))
    s.launch(ran.append, "dropped")
    dropped = s.record()
    ev.set()
    with pytest.raises(FenceError):
        dropped.wait(WAIT_S)
    assert done_before.query() is True
    assert ran == []
    s._thread.join(WAIT_S)
    assert not s._thread.is_alive()
    s.close()


def test_launch_and_record_after_close_raise():
    s = HostStream()
    s.close()
    with pytest.raises(RuntimeError, match="closed"):
        s.launch(print)
    with pytest.raises(RuntimeError, match="closed"):
        s.record()
    with pytest.raises(RuntimeError, match="closed"):
        record_fence(s)
    assert "closed" in repr(s)


def test_context_manager_closes_the_stream():
    with HostStream() as s:
        f = s.record()
    assert s.closed
    assert f.query() is True
    assert not s._thread.is_alive()


def test_launch_from_many_threads_is_safe(kit):
    s = kit.stream()
    out: list[int] = []
    start = threading.Barrier(4)

    def producer(base: int) -> None:
        start.wait(WAIT_S)
        for i in range(250):
            s.launch(out.append, base + i)

    threads = [threading.Thread(target=producer, args=(k * 1000,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    s.synchronize()
    assert sorted(out) == sorted(k * 1000 + i for k in range(4) for i in range(250))
    for k in range(4):  # each producer's own items stay in order
        mine = [x for x in out if k * 1000 <= x < k * 1000 + 1000]
        assert mine == sorted(mine)


def test_record_fence_on_host_stream(kit):
    s = kit.stream()
    gate = kit.gate(s)
    f = record_fence(s)
    assert isinstance(f, HostFence)
    assert isinstance(f, OrderedFence) and isinstance(f, Fence)
    assert f.stream_key == s.key and f.seq == 1
    assert not f.query()
    gate.open()
    assert f.wait(WAIT_S)


# Explicit ids: conftest skips items whose keywords contain "cuda", and a
# parameter id "cuda" would be one.
@pytest.mark.parametrize(
    "bad",
    [object(), None, "cuda", 3, torch.device("cpu")],
    ids=["object", "none", "str", "int", "cpu-device"],
)
def test_record_fence_rejects_non_streams(bad):
    with pytest.raises(TypeError, match="HostStream or a CUDA stream"):
        record_fence(bad)


def test_is_fence_duck_typing(kit):
    class Duck:
        def query(self) -> bool:
            return True

        def synchronize(self) -> None:
            pass

    assert is_fence(kit.stream().record())
    assert is_fence(Duck())
    assert not is_fence(object())
    assert not is_fence(type("Half", (), {"query": lambda self: True})())


# ---------------------------------------------------------------- CUDA


@pytest.mark.cuda
def test_cuda_fence_query_synchronize_on_a_real_stream():
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        gpu_busy(300)  # a step in flight
    f = record_fence(stream)
    assert isinstance(f, CudaFence)
    assert isinstance(f, OrderedFence)
    assert f.query() is False
    f.synchronize()
    assert f.query() is True


@pytest.mark.cuda
def test_cuda_fences_carry_stream_key_and_record_order():
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    a1, a2 = record_fence(s1), record_fence(s1)
    b1 = record_fence(s2)
    assert a1.stream_key == a2.stream_key != b1.stream_key
    assert a2.seq == a1.seq + 1
    # A generic torch.Stream of type cuda works too and maps to the same key.
    generic = torch.Stream(
        stream_id=s1.stream_id, device_index=s1.device_index, device_type=s1.device_type
    )
    a3 = record_fence(generic)
    assert a3.stream_key == a1.stream_key and a3.seq == a2.seq + 1
    torch.cuda.synchronize()
    assert a1.query() and a2.query() and a3.query() and b1.query()


@pytest.mark.cuda
def test_cuda_event_not_reused_while_its_fence_is_referenced():
    from asyncpool.fences import _event_pool

    stream = torch.cuda.Stream()
    held = record_fence(stream)
    held_event = held.event
    others = [record_fence(stream) for _ in range(8)]
    assert all(o.event is not held_event for o in others)
    stream.synchronize()
    del others
    gc.collect()
    # Events of collected fences are reused; the held one is not.
    created = _event_pool.created
    again = [record_fence(stream) for _ in range(8)]
    assert _event_pool.created == created  # all from the pool
    assert all(f.event is not held_event for f in again)
    stream.synchronize()
    # Once the wrapper is dropped its event goes back and is reused.
    del held
    gc.collect()
    reused = record_fence(stream)
    assert reused.event is held_event
    assert _event_pool.created == created
    stream.synchronize()
    assert reused.query()


# --------------------------------------------------------------- idle streams


def test_record_on_an_idle_stream_is_complete_at_once(kit):
    s = kit.stream("idle-worker")
    fresh = s.record()  # nothing ever launched
    assert fresh.query() is True and fresh.wait(0) is True
    s.launch(int)
    s.synchronize()
    after_work = s.record()  # everything launched has run
    assert after_work.query() is True
    assert [fresh.seq, after_work.seq] == [1, 3]  # seq still counts every fence
    assert fresh.stream_key == after_work.stream_key == s.key
    where: list[str] = []
    after_work.add_done_callback(lambda: where.append(threading.current_thread().name))
    assert where == [threading.current_thread().name]  # settled: runs on the caller


def test_record_after_unfinished_work_is_pending_even_if_the_last_fence_completed(kit):
    # Idle means "nothing queued is still to run", not "the last fence is done":
    # work launched after a completed fence must still be covered.
    s = kit.stream()
    s.record().synchronize()
    gate = kit.gate(s)  # launched after the last fence, not yet run
    f = s.record()
    assert f.query() is False
    assert f.wait(0.05) is False
    gate.open()
    assert f.wait(WAIT_S)


def test_record_covers_work_launched_just_before_from_another_thread(kit):
    # A fence that is complete when record() returns means the work launched
    # before it (here, by another thread) has run: never an early "done".
    s = kit.stream()
    out: list[int] = []
    for i in range(300):
        t = threading.Thread(target=s.launch, args=(out.append, i))
        t.start()
        t.join(WAIT_S)
        f = s.record()
        if f.query():
            assert out and out[-1] == i
        else:
            assert f.wait(WAIT_S)
            assert out[-1] == i


def test_record_on_an_idle_faulted_stream_is_faulted_at_once(kit, caplog):
    s = kit.stream()
    boom = ValueError("kernel fault")

    def bad() -> None:
        raise boom

    with caplog.at_level(logging.CRITICAL, logger="asyncpool.fences"):
        s.launch(bad)
        with pytest.raises(FenceError):
            s.synchronize()
    f = s.record()
    assert f.error is boom
    with pytest.raises(FenceError):
        f.query()


async def test_free_after_an_idle_stream_defers_nothing(kit):
    from asyncpool import AsyncReqToTokenPool

    s = kit.stream()
    pool = AsyncReqToTokenPool(5, 8)
    async with bounded():
        rows = await pool.alloc(2)
    assert pool.free(rows, after=s) == 2
    assert pool.pending_size() == 0 and pool.available_size() == 4
    async with bounded(), pool.lease(2, after=s):
        pass
    assert pool.pending_size() == 0 and pool.available_size() == 4
    gate = kit.gate(s)  # busy: the rows must wait for the stream
    async with bounded():
        rows = await pool.alloc(2)
    assert pool.free(rows, after=s) == 0
    assert pool.pending_size() == 2
    gate.open()
    s.synchronize()
    assert pool.reclaim() == 2
    async with bounded():
        await pool.close()


def test_a_callback_raising_system_exit_does_not_stop_the_stream(kit, caplog):
    """A done-callback raising what is not an Exception (SystemExit) killed
    the worker: the callbacks behind it (a pool's wake-up) never ran and no
    later fence of the stream ever completed."""
    caplog.set_level(logging.CRITICAL, logger="asyncpool")
    s = kit.stream()
    gate = kit.gate(s)
    f = s.record()
    ran: list[str] = []

    def exits() -> None:
        raise SystemExit(3)

    f.add_done_callback(exits)
    f.add_done_callback(lambda: ran.append("second"))
    gate.open()
    assert f.wait(WAIT_S)
    s.launch(ran.append, "later work")
    assert s.record().wait(WAIT_S)
    assert ran == ["second", "later work"]


def test_new_stream_keys_are_distinct_and_no_stream_uses_them(kit):
    keys = {new_stream_key() for _ in range(100)}
    assert len(keys) == 100 and all(isinstance(k, int) for k in keys)
    s = kit.stream()
    gate = kit.gate(s)
    assert s.record().stream_key not in keys
    gate.open()


def test_a_made_up_small_stream_key_never_meets_a_builtin_stream(kit):
    """A caller's ordered fence with a small key of its own choosing (0, 1,
    2, ...) was merged with the HostStream that had the same key, and the
    pool waited only for the newer of the two: a row went back while the
    caller's transfer still ran. Built-in streams take keys far from them."""
    from asyncpool import ReqToTokenPool

    class Transfer:
        def __init__(self, key: int) -> None:
            self.stream_key, self.seq, self.done = key, 1, False

        def query(self) -> bool:
            return self.done

        def synchronize(self) -> None:
            pass

    streams = [kit.stream() for _ in range(3)]
    for stream in streams:
        gate = kit.gate(stream)
        assert stream.record().stream_key >= 2**16  # not a key anyone makes up
        gate.open()
    for key in range(4):
        pool = ReqToTokenPool(4, 4)
        rows = pool.alloc(1)
        assert rows is not None
        transfer = Transfer(key)
        pool.record_use(rows, transfer)
        for stream in streams:
            gate = kit.gate(stream)
            fence = stream.record()  # seq > 1 on its stream
            pool.record_use(rows, fence)
            gate.open()
            assert fence.wait(WAIT_S)
        assert pool.free(rows) == 0  # the transfer still runs
        assert pool.reclaim() == 0
        transfer.done = True
        assert pool.reclaim() == 1


class _DoneAtSet(threading.Event):
    """A fence's event that notes how many items its stream had finished
    when the fence woke its waiters."""

    def __init__(self, stream: HostStream) -> None:
        super().__init__()
        self.stream = stream
        self.done_at_set: int | None = None

    def set(self) -> None:
        self.done_at_set = self.stream._done
        super().set()


def test_a_fence_counts_its_stream_idle_before_its_waiters_wake(kit):
    """Once ``synchronize()`` on a fence returns, the stream is idle, so the
    next ``record()`` is complete at once: the fence counts itself done
    before it wakes its waiters (the mutant woke them first, so a waiter
    could record a fence left pending behind nothing)."""
    s = kit.stream()
    gate = kit.gate(s)  # item 1
    fence = s.record()  # item 2, pending behind the gate
    spy = _DoneAtSet(s)
    fence._event = spy
    gate.open()
    assert fence.wait(WAIT_S)
    assert spy.done_at_set == 2
    assert s.record().query() is True


def test_a_stream_held_by_the_frame_of_its_failing_work_is_collected_once_dropped():
    """The stream's sticky fault keeps the work's traceback but not its
    frames' locals: work that held the stream (here as an argument) and
    raised must not keep it alive, or a stream dropped without ``close()``
    is never collected and its worker never ends (the mutant kept the
    locals)."""
    stream = HostStream("held-by-its-fault")

    def work(s: HostStream) -> None:
        raise ValueError(f"{s.name} failed")

    stream.launch(work, stream)
    fence = stream.record()
    with pytest.raises(FenceError):
        fence.wait(WAIT_S)
    thread = stream._thread
    ref = weakref.ref(stream)
    del stream, fence
    gc.collect()
    assert ref() is None, "the faulted stream was kept alive by its work's frame"
    thread.join(WAIT_S)
    assert not thread.is_alive()


def test_a_fault_leaves_a_paused_generator_in_its_chain_running(kit):
    """Clearing the locals of a fault's frames skips the frames of
    generators: one that caught the chained exception and is paused at a
    yield is its owner's, and clearing its frame would close it (the mutant
    cleared every frame, and the generator ended under its owner)."""
    saved: list[BaseException] = []

    def gen():
        try:
            raise KeyError("inner")
        except KeyError as exc:
            saved.append(exc)
            yield 1
        yield 2

    paused = gen()
    assert next(paused) == 1

    def work() -> None:
        raise ValueError("outer") from saved[0]

    s = kit.stream()
    s.launch(work)
    with pytest.raises(FenceError):
        s.record().wait(WAIT_S)
    assert next(paused) == 2
