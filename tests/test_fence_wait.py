"""``await wait_fence(fence)``: a coroutine waits for a fence, the loop runs on.

Every wait is bounded (``bounded()``); a wait that blocked the loop would
also block ``asyncio.timeout``, so the tests that prove the loop runs have a
watchdog thread complete the fence after a few seconds and check that the
loop had run before that.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref
from collections.abc import Iterator

import pytest
import uvloop
from helpers import (
    FAKE_DEVICE,
    EventFence,
    NoSyncFence,
    StandInEvent,
    Streams,
    bounded,
    forget_stand_in_events,
)

from asyncpool import CudaFence, FenceError, HostStream, new_stream_key, wait_fence
from asyncpool.fence_wait import _LoopWaits, _pending_waits

WATCHDOG_S = 5.0


@pytest.fixture
def watchdog() -> Iterator[list[threading.Timer]]:
    """Timers that complete a fence if the test never does (cancelled at exit)."""
    timers: list[threading.Timer] = []
    yield timers
    for t in timers:
        t.cancel()


def _arm(timers: list[threading.Timer], fn: object) -> None:
    t = threading.Timer(WATCHDOG_S, fn)  # type: ignore[arg-type]
    t.daemon = True
    t.start()
    timers.append(t)


async def _cancel(task: asyncio.Task[None]) -> None:
    """Cancel ``task`` and see it end cancelled, within the bound."""
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        async with bounded():
            await task


async def _ticks_while(cond: object, n: int = 50) -> int:
    """Yield to the loop ``n`` times while ``cond()`` holds; how many ran."""
    ran = 0
    for _ in range(n):
        if not cond():  # type: ignore[operator]
            break
        await asyncio.sleep(0)
        ran += 1
    return ran


async def test_a_completed_fence_returns_at_once(kit: Streams) -> None:
    idle = kit.stream().record()  # nothing launched: complete at once
    done = EventFence()
    done.set()
    async with bounded():
        await wait_fence(idle)
        await wait_fence(done)
    assert _pending_waits(asyncio.get_running_loop()) == 0


async def test_a_host_fence_wakes_its_waiter_and_the_loop_runs_meanwhile(
    kit: Streams, watchdog: list[threading.Timer]
) -> None:
    stream = kit.stream()
    gate = kit.gate(stream)
    fence = stream.record()
    _arm(watchdog, gate.open)
    waiter = asyncio.create_task(wait_fence(fence))
    ran = await _ticks_while(lambda: not gate.is_open)
    # fence.synchronize() in the coroutine would have held the loop until
    # the watchdog opened the gate
    assert ran == 50 and not gate.is_open and not waiter.done()
    gate.open()
    async with bounded():
        await waiter
    assert fence.query() and not fence._callbacks  # type: ignore[attr-defined]


async def test_an_unknown_fence_is_polled_never_synchronized(
    watchdog: list[threading.Timer],
) -> None:
    fence = NoSyncFence()
    _arm(watchdog, fence.set)
    waiter = asyncio.create_task(wait_fence(fence))
    ran = await _ticks_while(lambda: not fence.event.is_set())
    assert ran == 50 and not fence.event.is_set() and not waiter.done()
    threading.Thread(target=fence.set).start()  # a transfer lands, elsewhere
    async with bounded():
        await waiter
    assert fence.synchronized == 0 and fence.queries >= 2
    assert _pending_waits(asyncio.get_running_loop()) == 0


async def test_every_task_waiting_for_a_fence_is_woken(kit: Streams) -> None:
    host_stream = kit.stream()
    gate = kit.gate(host_stream)
    host, other = host_stream.record(), kit.event_fence()
    waiters = [asyncio.create_task(wait_fence(f)) for f in (host, host, other, other)]
    quitter = asyncio.create_task(wait_fence(other))
    await asyncio.sleep(0)
    quitter.cancel()
    gate.open()
    other.set()
    async with bounded():
        await asyncio.gather(*waiters)
    assert quitter.cancelled()


@pytest.mark.parametrize("kind", ["host", "unknown"])
async def test_cancelled_or_timed_out_leaves_nothing_behind(kit: Streams, kind: str) -> None:
    loop = asyncio.get_running_loop()
    if kind == "host":
        stream = kit.stream()
        kit.gate(stream)
        fence: object = stream.record()
    else:
        fence = kit.event_fence()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.02):
            await wait_fence(fence)  # type: ignore[arg-type]
    task = asyncio.create_task(wait_fence(fence))  # type: ignore[arg-type]
    await asyncio.sleep(0)
    await _cancel(task)
    assert _pending_waits(loop) == 0
    if kind == "host":
        assert not fence._callbacks  # type: ignore[attr-defined]
    else:
        assert not _LoopWaits.of(loop)._watcher.polling(fence)  # type: ignore[arg-type]
    assert not fence.query()  # type: ignore[attr-defined]  # untouched, still pending


async def test_a_cuda_fence_waited_for_again_and_again_is_handed_over_once() -> None:
    """A stream thread cannot give a CUDA fence back: five waits given up
    (timeouts) and a sixth that sees it complete hand it to the watcher once,
    and once it has completed nothing of it is kept."""
    loop = asyncio.get_running_loop()
    gate = threading.Event()
    key = new_stream_key()
    fence = CudaFence(StandInEvent(gate, 10.0), FAKE_DEVICE, key, 1)  # type: ignore[arg-type]
    waits = _LoopWaits.of(loop)
    try:
        for _ in range(5):
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.005):
                    await wait_fence(fence)
        assert waits._watcher.watched == 1 and len(waits._cuda_handed) == 1
        last = asyncio.create_task(wait_fence(fence))
        await asyncio.sleep(0)
        gate.set()
        async with bounded():
            await last
        assert waits._watcher.watched == 1
        assert not waits._cuda_handed  # dropped by the check that saw it done
        assert _pending_waits(loop) == 0
    finally:
        gate.set()
        del fence
        forget_stand_in_events()


@pytest.mark.parametrize("raised", [StopIteration, StopAsyncIteration])
async def test_a_query_raising_what_no_future_takes_is_a_fault(raised: type) -> None:
    fence, other = EventFence(), EventFence()
    fence.error = raised()
    waiters = [asyncio.create_task(wait_fence(f)) for f in (fence, other)]
    await asyncio.sleep(0)
    fence.set()
    other.set()
    async with bounded():
        results = await asyncio.gather(*waiters, return_exceptions=True)
    assert isinstance(results[0], FenceError) and raised.__name__ in str(results[0])
    assert results[1] is None  # the same pass went on to the next fence


@pytest.mark.parametrize("raised", [asyncio.CancelledError, StopIteration, StopAsyncIteration])
async def test_a_first_query_raising_what_no_future_takes_is_a_fault(raised: type) -> None:
    """A transfer handle that has already failed so, before any waiting: a
    ``FenceError`` too, not the waiter's task cancelled in silence (a
    ``CancelledError``) nor PEP 479's ``RuntimeError`` (a ``StopIteration``)."""
    fence = EventFence()
    fence.error = raised()
    fence.set()
    waiter = asyncio.create_task(wait_fence(fence))
    async with bounded():
        results = await asyncio.gather(waiter, return_exceptions=True)
    assert not waiter.cancelled()
    assert isinstance(results[0], FenceError) and raised.__name__ in str(results[0])
    assert isinstance(results[0].__cause__, raised)
    assert _pending_waits(asyncio.get_running_loop()) == 0


async def test_a_faulted_host_stream_raises_fence_error() -> None:
    stream = HostStream("faulty")
    try:
        gate = threading.Event()
        stream.launch(gate.wait)

        def boom() -> None:
            raise ValueError("kernel failed")

        stream.launch(boom)
        fence = stream.record()
        waiter = asyncio.create_task(wait_fence(fence))
        await asyncio.sleep(0)
        gate.set()
        with pytest.raises(FenceError):
            async with bounded():
                await waiter
    finally:
        stream.close(cancel_pending=True)


@pytest.mark.parametrize(
    "raised, expected, match",
    [
        # a transfer that fails: its own error
        (ConnectionResetError("peer gone"), ConnectionResetError, "peer gone"),
        # a CancelledError from query() is a fault, not a cancellation
        (asyncio.CancelledError(), FenceError, "CancelledError"),
    ],
    ids=["transfer error", "cancelled error"],
)
async def test_a_query_that_raises_fails_the_waiter(
    raised: BaseException, expected: type[BaseException], match: str
) -> None:
    fence = EventFence()
    fence.error = raised
    waiter = asyncio.create_task(wait_fence(fence))
    await asyncio.sleep(0)
    fence.set()
    with pytest.raises(expected, match=match):
        async with bounded():
            await waiter
    assert _pending_waits(asyncio.get_running_loop()) == 0


@pytest.mark.parametrize(
    "bad", [object(), None, HostStream, type("Half", (), {"query": lambda self: False})()]
)
async def test_what_is_not_a_fence_is_refused_and_nothing_watched(bad: object) -> None:
    with pytest.raises(TypeError, match="needs a fence"):
        await wait_fence(bad)  # type: ignore[arg-type]
    assert _pending_waits(asyncio.get_running_loop()) == 0


async def test_a_query_answering_a_status_word_is_refused() -> None:
    class Wordy:
        def query(self) -> str:
            return "PENDING"

        def synchronize(self) -> None:
            pass

    with pytest.raises(TypeError, match="not True or False"):
        await wait_fence(Wordy())  # type: ignore[arg-type]


async def test_a_fence_completing_while_the_check_runs_is_not_lost() -> None:
    """``_check`` clears its "scheduled" flag before it asks the fences. A
    completion reported while it runs (here: while it asks ``first``) must
    schedule another check; with the flag cleared after the pass, that
    report is dropped and the waiter of ``late`` hangs.

    ``late`` answers done only on the loop thread, so the watcher's poller
    never reports it: the report made during the check is its only one.
    """
    loop = asyncio.get_running_loop()
    loop_thread = threading.current_thread()
    waits = _LoopWaits.of(loop)

    class LateFence(EventFence):
        def query(self) -> bool:
            return self.event.is_set() and threading.current_thread() is loop_thread

    late = LateFence()

    class FirstFence(EventFence):
        def query(self) -> bool:
            done = super().query()
            if done and threading.current_thread() is loop_thread and not late.event.is_set():
                late.set()  # completes while the check runs...
                waits._notify()  # ...and is reported then, as a watcher thread would
            return done

    first = FirstFence()
    try:
        late_waiter = asyncio.create_task(wait_fence(late))  # asked first in the pass
        await asyncio.sleep(0)
        first_waiter = asyncio.create_task(wait_fence(first))
        await asyncio.sleep(0)
        first.set()
        async with bounded(5):
            await first_waiter
            await late_waiter
    finally:
        late.set()
        first.set()


@pytest.mark.parametrize(
    "factory", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"]
)
def test_a_closed_loop_is_not_kept_by_its_waits(factory: object) -> None:
    """The per-loop waits hold their loop weakly: once a loop that waited
    for a fence is closed and dropped, it is collected (the registry, the
    watcher's threads and its ``alive`` check keep no reference)."""
    fence = EventFence()

    async def main() -> weakref.ref[asyncio.AbstractEventLoop]:
        waiter = asyncio.create_task(wait_fence(fence))
        await asyncio.sleep(0)
        fence.set()
        async with bounded():
            await waiter
        return weakref.ref(asyncio.get_running_loop())

    with asyncio.Runner(loop_factory=factory) as runner:  # type: ignore[arg-type]
        ref = runner.run(main())
    del runner
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("newer_wait", ["given up", "still waiting", "older retried"])
async def test_an_older_cuda_fence_is_not_stuck_behind_a_newer_one(newer_wait: str) -> None:
    """The stream thread blocks in the first CUDA fence handed to it. A wait
    for an *older* fence of that stream, handed after (a newer wait given
    up, or two tasks waiting out of record order), is woken when that older
    fence completes, not when (or if ever) the newer one does; also when
    the older one's first wait was given up and a second one taken up (it
    was handed over once, and stays watched)."""
    loop = asyncio.get_running_loop()
    key = new_stream_key()
    g_old, g_new = threading.Event(), threading.Event()
    new_event = StandInEvent(g_new, 10.0)
    old = CudaFence(StandInEvent(g_old, 10.0), FAKE_DEVICE, key, 1)  # type: ignore[arg-type]
    new = CudaFence(new_event, FAKE_DEVICE, key, 2)  # type: ignore[arg-type]
    try:
        newer = asyncio.create_task(wait_fence(new))
        # the stream thread is in new.synchronize()
        assert await asyncio.to_thread(new_event.entered.wait, WATCHDOG_S)
        if newer_wait == "given up":
            await _cancel(newer)
        older = asyncio.create_task(wait_fence(old))
        await asyncio.sleep(0)
        if newer_wait == "older retried":
            await _cancel(older)
            older = asyncio.create_task(wait_fence(old))
            await asyncio.sleep(0)
        g_old.set()
        async with bounded():
            await older
        assert not newer.done() or newer.cancelled()
        assert _LoopWaits.of(loop)._cuda_handed.get(id(new)) is new  # still in its thread
    finally:
        g_old.set()
        g_new.set()
        if not newer.done():
            async with bounded():
                await newer
        del old, new
        forget_stand_in_events()


@pytest.mark.parametrize("kind", ["host fence", "polled fence", "cuda fence"])
async def test_a_task_nobody_holds_runs_on_once_its_fence_completes(
    kit: Streams, kind: str
) -> None:
    """The wait holds its task, as asyncio's own primitives hold their
    waiters: a task nobody references (fire and forget, or shielded past a
    timeout) survives a garbage collection and runs what follows the wait
    once the fence completes (say, freeing pages once a transfer landed)."""
    ran = asyncio.Event()
    gate = threading.Event()
    fence: object
    if kind == "host fence":
        stream = kit.stream()
        stream.launch(gate.wait)
        fence = stream.record()
    elif kind == "polled fence":
        fence = kit.event_fence()
        gate = fence.event  # type: ignore[attr-defined]
    else:
        fence = CudaFence(StandInEvent(gate, 10.0), FAKE_DEVICE, new_stream_key(), 1)  # type: ignore[arg-type]

    async def then_run_on(f: object) -> None:
        await wait_fence(f)  # type: ignore[arg-type]
        ran.set()

    asyncio.ensure_future(then_run_on(fence))  # noqa: RUF006  (not kept, on purpose)
    for _ in range(3):
        await asyncio.sleep(0)  # the wait is under way
    gc.collect()
    gate.set()
    try:
        async with bounded():
            await ran.wait()
    finally:
        del fence
        forget_stand_in_events()
