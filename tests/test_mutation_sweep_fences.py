"""Gaps found by a mechanical mutation sweep of ``fences.py`` and ``watcher.py``.

Each test pins one behaviour that an ``ast``-generated mutant broke while
every test file that exercises the module still passed.

``fences.py``:

* ``check_after`` and ``record_fence`` refuse a ``torch.Stream`` on the CPU
  with the ``TypeError`` (the mutant took every ``torch.Stream`` whose
  device is *not* CUDA for a CUDA stream, so ``free(after=)`` passed its
  check and then failed recording a CUDA event);
* ``check_after`` takes a ``torch.Stream`` whose device is CUDA (the mutants
  refused every generic ``torch.Stream``; on a machine without a GPU only a
  stand-in subclass has a CUDA device).

``watcher.py``, driven directly with :class:`CudaFence` wrappers around
stand-in events (so the per-stream threads run without a GPU):

* a stream's fences are kept in ``seq`` order whatever order they are
  watched in, before the stream thread has taken any (the mutants appended
  out of order, moved two places at a time, compared with the wrong
  neighbour, never moved, spun for ever under the lock, or took an idle
  stream for a busy one);
* while the thread waits in a fence's ``synchronize()``, a fence with a
  lower ``seq`` goes right behind that fence, never in front of it (the
  mutants put it in front, so the thread later popped a fence it never
  waited for, or queued it last);
* once the thread is out of ``synchronize()`` the stream is idle again: a
  fence watched from ``notify`` goes to the head when its ``seq`` is
  lowest (the mutants kept the stream marked busy);
* a fence watched while the stream thread idles wakes the thread at once,
  not at the end of its linger (the mutant did not notify the thread);
* ``stop`` wakes an idle stream thread and ``join`` waits for it (the
  mutants left it asleep until its linger ran out, or did not join stream
  threads at all); ``join`` does not wait for a thread blocked in a fence's
  ``synchronize()`` (the mutants waited for it, or only for it), and gives
  up at its deadline (the mutant waited far past it);
* a stream thread whose owner is gone (``alive()`` answers False) ends
  without calling ``notify`` (the mutant notified first);
* a stream thread that idles past its linger ends and the watcher forgets
  its stream (the mutants kept the stream, or kept the thread looping);
* ``unwatch`` answers True for a polled fence, False for one it does not
  poll (the mutants answered None, or the opposite).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from helpers import (
    FAKE_DEVICE,
    WAIT_S,
    EventFence,
    StandInEvent,
    forget_stand_in_events,
    in_thread,
)

from asyncpool import fences as fences_mod
from asyncpool import watcher as watcher_mod
from asyncpool.fences import CudaFence, check_after, record_fence
from asyncpool.watcher import FenceWatcher

# --------------------------------------------------------------- fences.py


def test_a_torch_stream_on_the_cpu_is_not_a_cuda_stream() -> None:
    cpu_stream = torch.Stream(device="cpu")
    with pytest.raises(TypeError, match="HostStream or a CUDA stream"):
        check_after(cpu_stream)
    with pytest.raises(TypeError, match="HostStream or a CUDA stream"):
        record_fence(cpu_stream)  # type: ignore[arg-type]


class _CudaDeviceStream(torch.Stream):
    """A generic ``torch.Stream`` that says its device is CUDA (a stand-in:
    this machine may have no GPU to make a real one on)."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", 0)


def test_check_after_takes_a_generic_torch_stream_on_a_cuda_device() -> None:
    check_after(_CudaDeviceStream(device="cpu"))  # no TypeError


# -------------------------------------------------------------- watcher.py


class _SignallingCondition(threading.Condition):
    """A condition that says when a thread starts waiting on it."""

    def __init__(self, lock: Any = None) -> None:
        super().__init__(lock)
        self.waiting = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        # Set while the waiter still holds the lock: a thread that takes the
        # lock after seeing it set finds the waiter inside wait().
        self.waiting.set()
        return super().wait(timeout)


class _Shim:
    """Stands in for ``threading`` inside ``asyncpool.watcher`` only.

    Its threads run their target once ``go`` is set (set at first), and with
    ``hold_exit`` stay alive after the target returns until someone joins
    them; its conditions say when a thread waits on them.
    """

    def __init__(self) -> None:
        self.go = threading.Event()
        self.go.set()
        self.hold_exit = False
        self.threads: list[threading.Thread] = []
        shim = self

        class Thread(threading.Thread):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                self.joined = threading.Event()
                shim.threads.append(self)

            def run(self) -> None:
                shim.go.wait(WAIT_S)
                try:
                    super().run()
                finally:
                    if shim.hold_exit:
                        self.joined.wait(WAIT_S)

            def join(self, timeout: float | None = None) -> None:
                self.joined.set()
                super().join(timeout)

        self.Thread = Thread
        self.Condition = _SignallingCondition
        self.Lock = threading.Lock
        self.current_thread = threading.current_thread


class _Kit:
    """A watcher on stand-in CUDA fences, with its gates and notifications."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.monkeypatch = monkeypatch
        self.gates: list[threading.Event] = []
        self.notified = threading.Semaphore(0)
        self.on_notify: Callable[[], None] | None = None
        self.watcher: FenceWatcher | None = None
        self.shim: _Shim | None = None
        self.key = fences_mod.new_stream_key()

    def use_shim(self) -> _Shim:
        self.shim = _Shim()
        self.monkeypatch.setattr(watcher_mod, "threading", self.shim)
        return self.shim

    def notify(self) -> None:
        if self.on_notify is not None:
            self.on_notify()
        self.notified.release()

    def make(self, alive: Callable[[], bool] | None = None) -> FenceWatcher:
        self.watcher = FenceWatcher(self.notify, name="sweep-watcher", alive=alive)
        return self.watcher

    def fence(self, seq: int, *, done: bool = False) -> CudaFence:
        gate = threading.Event()
        if done:
            gate.set()
        self.gates.append(gate)
        return CudaFence(StandInEvent(gate, WAIT_S), FAKE_DEVICE, self.key, seq)  # type: ignore[arg-type]

    def seqs(self) -> list[int]:
        assert self.watcher is not None
        return [f.seq for f in self.watcher._streams[self.key].fences]

    def stream(self) -> Any:
        assert self.watcher is not None
        return self.watcher._streams[self.key]

    def wait_notified(self, n: int = 1) -> None:
        for _ in range(n):
            assert self.notified.acquire(timeout=WAIT_S), "no notify"

    def close(self) -> None:
        """Open every gate, stop the watcher and join its threads; bounded,
        on a daemon thread (a watcher stuck holding its lock is left behind)."""
        for gate in self.gates:
            gate.set()
        if self.shim is not None:
            self.shim.go.set()

        def stop() -> None:
            if self.watcher is not None:
                self.watcher.stop()
                self.watcher.join(WAIT_S)
            if self.shim is not None:
                for thread in self.shim.threads:
                    thread.join(WAIT_S)

        closer = threading.Thread(target=stop, name="sweep-close", daemon=True)
        closer.start()
        closer.join(WAIT_S)
        forget_stand_in_events()


@pytest.fixture
def wk(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Kit]:
    kit = _Kit(monkeypatch)
    try:
        yield kit
    finally:
        kit.close()


def _stand_in(fence: CudaFence) -> StandInEvent:
    event = fence.event
    assert isinstance(event, StandInEvent)
    return event


def _bounded_call(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on a daemon thread; fail if it has not returned in WAIT_S
    (a call that spins or blocks for ever is left behind, as a daemon)."""
    return in_thread(fn, name="sweep-bounded", daemon=True)


def test_stream_fences_are_kept_in_seq_order_whatever_order_they_arrive(wk: _Kit) -> None:
    shim = wk.use_shim()
    shim.go.clear()  # the stream thread takes nothing until the test says so
    watcher = wk.make()
    fences = {seq: wk.fence(seq, done=True) for seq in (3, 5, 6, 7, 4, 1)}

    def watch_all() -> None:
        for fence in fences.values():
            watcher.watch(fence)

    _bounded_call(watch_all)
    assert wk.seqs() == [1, 3, 4, 5, 6, 7]
    shim.go.set()
    wk.wait_notified(6)
    assert wk.seqs() == []


def test_an_older_fence_than_the_one_being_waited_for_is_polled(wk: _Kit) -> None:
    """Never put before the fence the thread is inside (nor behind it, where
    it would be noticed only once that one completes): polled, and noticed
    while the newer one still blocks the stream's thread."""
    watcher = wk.make()
    head = wk.fence(2)
    watcher.watch(head)
    assert _stand_in(head).entered.wait(WAIT_S)  # the thread is inside synchronize()
    watcher.watch(wk.fence(3, done=True))
    watcher.watch(wk.fence(1, done=True))
    assert wk.seqs() == [2, 3]
    wk.wait_notified(1)  # fence 1, by the poller
    assert not _stand_in(head).gate.is_set() and wk.seqs() == [2, 3]
    assert watcher.polled == 0  # done: the poller dropped it
    _stand_in(head).gate.set()
    wk.wait_notified(2)
    assert wk.seqs() == []


def test_the_stream_is_idle_again_once_out_of_synchronize(wk: _Kit) -> None:
    watcher = wk.make()
    seen: list[list[int]] = []

    def on_notify() -> None:  # on the stream thread, after the first fence
        wk.on_notify = None
        watcher.watch(wk.fence(3))
        watcher.watch(wk.fence(2))
        seen.append(wk.seqs())

    wk.on_notify = on_notify
    watcher.watch(wk.fence(1, done=True))
    wk.wait_notified()
    assert seen == [[2, 3]]


def test_a_fence_watched_while_the_stream_thread_idles_wakes_it(wk: _Kit) -> None:
    wk.monkeypatch.setattr(watcher_mod, "_STREAM_LINGER_S", 60.0)
    wk.use_shim()  # for its signalling conditions
    watcher = wk.make()
    stream_cond: list[_SignallingCondition] = []

    def on_notify() -> None:
        wk.on_notify = None
        cond = wk.stream().cond
        cond.waiting.clear()
        stream_cond.append(cond)

    wk.on_notify = on_notify
    watcher.watch(wk.fence(1, done=True))
    wk.wait_notified()
    assert stream_cond[0].waiting.wait(WAIT_S)  # idle, lingering for 60 s
    watcher.watch(wk.fence(2, done=True))
    wk.wait_notified()  # at once, not after the linger


def test_stop_wakes_an_idle_stream_thread_and_join_waits_for_it(wk: _Kit) -> None:
    wk.monkeypatch.setattr(watcher_mod, "_STREAM_LINGER_S", 60.0)
    shim = wk.use_shim()
    shim.hold_exit = True  # alive until joined: join must join it
    watcher = wk.make()
    conds: list[_SignallingCondition] = []

    def on_notify() -> None:
        wk.on_notify = None
        cond = wk.stream().cond
        cond.waiting.clear()
        conds.append(cond)

    wk.on_notify = on_notify
    watcher.watch(wk.fence(1, done=True))
    wk.wait_notified()
    assert conds[0].waiting.wait(WAIT_S)
    watcher.stop()
    assert watcher.join(WAIT_S) is True
    assert not watcher.running


def test_join_does_not_wait_for_a_thread_blocked_in_a_fence(wk: _Kit) -> None:
    watcher = wk.make()
    stuck = wk.fence(1)
    watcher.watch(stuck)
    assert _stand_in(stuck).entered.wait(WAIT_S)
    watcher.stop()
    assert _bounded_call(lambda: watcher.join(60.0)) is False


def test_join_gives_up_at_its_deadline(wk: _Kit) -> None:
    watcher = wk.make()
    stuck = EventFence()  # polled, never completes; nobody stops the poller
    watcher.watch(stuck)
    assert _bounded_call(lambda: watcher.join(0.01)) is False
    assert watcher.running


def test_a_stream_thread_whose_owner_is_gone_ends_without_notifying(wk: _Kit) -> None:
    watcher = wk.make(alive=lambda: False)
    watcher.watch(wk.fence(1, done=True))
    thread = wk.stream().thread
    assert thread is not None
    thread.join(WAIT_S)
    assert not thread.is_alive()
    assert not wk.notified.acquire(blocking=False)
    with pytest.raises(RuntimeError, match="stopped"):
        watcher.watch(wk.fence(2))


def test_an_idle_stream_thread_ends_and_its_stream_is_forgotten(wk: _Kit) -> None:
    # Long enough that the thread is still there when looked up below on a
    # loaded machine (at 0.01 s a 30 ms stall read KeyError).
    wk.monkeypatch.setattr(watcher_mod, "_STREAM_LINGER_S", 0.5)
    watcher = wk.make()
    watcher.watch(wk.fence(1, done=True))
    thread = wk.stream().thread
    assert thread is not None
    wk.wait_notified()
    thread.join(WAIT_S)
    assert not thread.is_alive()
    assert wk.key not in watcher._streams
    assert not watcher.running


def test_unwatch_says_whether_the_fence_was_polled(wk: _Kit) -> None:
    watcher = wk.make()
    polled, other = EventFence(), EventFence()
    watcher.watch(polled)
    assert watcher.unwatch(polled) is True
    assert watcher.unwatch(polled) is False
    assert watcher.unwatch(other) is False
    assert watcher.polled == 0
