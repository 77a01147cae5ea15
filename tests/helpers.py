"""Shared test helpers: gated host streams, controllable fake fences, snapshots.

Plain classes and functions (no fixtures), so test modules import what they
use without pytest plugin wiring:

* :class:`Streams` opens :class:`HostStream` objects and gates on them, and on
  exit opens every gate and closes every stream (the suite runs ``-W error``
  and must not leave a worker thread blocked);
* :class:`FakeStream` hands out :class:`FakeFence` objects with a
  ``stream_key`` and ``seq`` whose completion (and fault) the test controls,
  and which count their ``query()`` calls;
* :class:`EventFence` is a fence of unknown origin (no ``stream_key``),
  backed by a ``threading.Event``;
* :func:`ledger_snapshot` / :func:`pool_snapshot` capture everything a
  raising call must leave unchanged;
* :func:`bounded` bounds an await that could hang (``asyncio.timeout``), so a
  lost wake-up fails in seconds with a message instead of hanging the suite;
* :data:`PROSE_DOCS` and :func:`doc_text` name and read the documents that
  state what the project does: the README (the front page) and the pages
  under docs/ its depth moved to.
"""

from __future__ import annotations

import asyncio
import collections.abc
import contextlib
import dataclasses
import importlib.util
import itertools
import logging
import sys
import threading
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import numpy as np
import pytest
import torch

from asyncpool import AsyncReqToTokenPool, FenceError, Grant, HostStream, KVPagePool
from asyncpool import fences as fences_mod
from asyncpool.ledger import SlotLedger

WAIT_S = 5.0  # bound on every wait for another thread
LONG_S = 120.0  # bound on a whole demo or benchmark run awaited by a test

#: Page counts per row for two rows that every call taking one count per row
#: (``extend_rows``, ``extend_fitting``, ``trim_pages``' ``keep``) refuses with
#: ``CapacityError``: one validator reads them all. Too few or too many, a
#: negative, a float, a bool, 2-D, float and bool arrays and tensors.
BAD_COUNTS_FOR_TWO_ROWS: list[object] = [
    [1],
    [1, 1, 1],
    [1, 2, 3],
    [1, -1],
    [1, 1.5],
    [True, 1],
    torch.tensor([[1, 1]]),
    np.array([1.0, 1.0]),
    torch.tensor([1.0, 1.0]),
    torch.tensor([True, True]),
]


#: The repository root (tests/ sits under it).
ROOT = Path(__file__).resolve().parent.parent
#: The README and the pages its depth lives in (docs/demo.md, docs/api.md,
#: docs/tp.md, docs/performance.md, docs/testing.md), in the README's order:
#: a statement the README once made is in one of them.
PROSE_DOCS = (
    "README.md",
    "docs/demo.md",
    "docs/api.md",
    "docs/tp.md",
    "docs/performance.md",
    "docs/testing.md",
)


def doc_text(name: str) -> str:
    """The text of a document, by its path from the repository root
    (``"README.md"``, ``"docs/api.md"``)."""
    return (ROOT / name).read_text(encoding="utf-8")


def doc_section(name: str, heading: str) -> str:
    """One section of a document: from the line ``heading`` (whole, with its
    ``#`` marks) to the next heading of the same or a higher level, or the
    end. A heading that is not there is a ``LookupError``."""
    lines = doc_text(name).split("\n")
    level = len(heading) - len(heading.lstrip("#"))
    try:
        start = lines.index(heading)
    except ValueError:
        raise LookupError(f"{name}: no heading {heading!r}") from None
    fenced = False
    for i in range(start + 1, len(lines)):
        if lines[i].startswith("```"):
            fenced = not fenced
        marks = len(lines[i]) - len(lines[i].lstrip("#"))
        if not fenced and 0 < marks <= level and lines[i][marks : marks + 1] == " ":
            return "\n".join(lines[start + 1 : i])
    return "\n".join(lines[start + 1 :])


@contextlib.contextmanager
def tracing(tracer: Any) -> Iterator[None]:
    """``sys.settrace(tracer)`` for the block, then the trace function found
    before it put back (a coverage run's: ``sys.settrace(None)`` would end the
    measurement of every later test; tests/conftest.py checks it)."""
    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        yield
    finally:
        sys.settrace(previous)


def in_thread(fn: Callable[[], Any], *, name: str = "foreign", daemon: bool = False) -> Any:
    """Run ``fn`` in a fresh thread named ``name`` (not the pool's); return
    its result or re-raise its error here. Bounded by ``WAIT_S``: a call
    still running then fails the test (a ``daemon`` thread left behind
    cannot keep the process alive)."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # re-raised below, in the test's thread
            out["error"] = exc

    th = threading.Thread(target=run, name=name, daemon=daemon)
    th.start()
    th.join(WAIT_S)
    assert not th.is_alive(), f"the call in thread {name!r} hung"
    if "error" in out:
        raise out["error"]
    return out.get("value")


class _Bounded:
    """``asyncio.timeout(seconds)`` whose expiry fails the test with a message."""

    __slots__ = ("_cm", "_seconds")

    def __init__(self, seconds: float) -> None:
        self._seconds = seconds
        self._cm = asyncio.timeout(seconds)

    async def __aenter__(self) -> None:
        await self._cm.__aenter__()

    async def __aexit__(self, et: Any, exc: Any, tb: Any) -> bool | None:
        try:
            return await self._cm.__aexit__(et, exc, tb)
        except TimeoutError as err:
            if not self._cm.expired():
                raise  # a TimeoutError of the code under test, not ours
            raise AssertionError(
                f"not done within {self._seconds:g} s: a lost wake-up, or a hang"
            ) from err


def bounded(seconds: float = WAIT_S) -> _Bounded:
    """``async with bounded():`` around an await that could hang.

    Expiry raises ``AssertionError`` naming the bound; a ``TimeoutError``
    raised by the awaited code itself passes through unchanged.
    """
    return _Bounded(seconds)


async def until(cond: Callable[[], bool], poll_s: float = 0.001) -> None:
    """Poll ``cond`` from the loop, for state that another thread or time
    changes (there is no event to await); bounded as :func:`bounded` is."""
    async with bounded():
        for _ in itertools.count():
            if cond():
                return
            await asyncio.sleep(poll_s)


class ManualClock:
    """A clock the test moves by hand: calling it reads ``now``."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Gate:
    """Work on a stream that blocks it until :meth:`open` (holds later fences)."""

    def __init__(self, stream: HostStream) -> None:
        self.event = threading.Event()
        self.stream = stream
        stream.launch(self.event.wait)

    def open(self) -> None:
        self.event.set()

    @property
    def is_open(self) -> bool:
        return self.event.is_set()


class Streams:
    """Context manager owning host streams and gates for one test."""

    def __init__(self) -> None:
        self._streams: list[HostStream] = []
        self._gates: list[Gate] = []
        self._events: list[threading.Event] = []

    def __enter__(self) -> Streams:
        return self

    def __exit__(self, *exc: object) -> None:
        for gate in self._gates:
            gate.open()
        for ev in self._events:
            ev.set()
        for stream in self._streams:
            stream.close()

    def stream(self, name: str | None = None) -> HostStream:
        s = HostStream(name)
        self._streams.append(s)
        return s

    def gate(self, stream: HostStream) -> Gate:
        g = Gate(stream)
        self._gates.append(g)
        return g

    def event(self) -> threading.Event:
        """A plain event, set on exit (a gate launched by the test itself)."""
        ev = threading.Event()
        self._events.append(ev)
        return ev

    def event_fence(self) -> EventFence:
        f = EventFence()
        self._events.append(f.event)
        return f


class EventFence:
    """A fence of unknown origin: no ``stream_key``, completes on ``set()``."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.queries = 0
        self.error: BaseException | None = None

    def set(self) -> None:
        self.event.set()

    def query(self) -> bool:
        self.queries += 1
        if self.error is not None and self.event.is_set():
            raise self.error
        return self.event.is_set()

    def synchronize(self) -> None:
        # Bounded so a forgotten fence cannot hang the watcher thread forever.
        self.event.wait(30)
        if self.error is not None:
            raise self.error


class NoSyncFence(EventFence):
    """A fence of unknown origin whose ``synchronize()`` must never be called
    (it counts the calls in ``synchronized``)."""

    def __init__(self) -> None:
        super().__init__()
        self.synchronized = 0

    def synchronize(self) -> None:
        self.synchronized += 1
        super().synchronize()


_fake_keys = itertools.count(1_000_000)  # far from HostStream / CUDA keys


class FakeStream:
    """A stream whose fences complete (in order) only when the test says so."""

    def __init__(self) -> None:
        self.key = next(_fake_keys)
        self.seq = 0
        self.done = 0  # fences with seq <= done have completed
        self.fault_at: int | None = None  # fences with seq >= fault_at fault
        self.fences: list[FakeFence] = []

    def record(self) -> FakeFence:
        self.seq += 1
        f = FakeFence(self, self.seq)
        self.fences.append(f)
        return f

    def complete(self, upto: int | None = None) -> None:
        upto = self.seq if upto is None else upto
        if self.fault_at is not None:
            upto = min(upto, self.fault_at - 1)
        self.done = max(self.done, upto)

    def fault(self) -> None:
        """Fault every fence not yet completed (sticky, like a CUDA error)."""
        if self.fault_at is None:
            self.fault_at = self.done + 1

    def status(self, seq: int) -> str:
        if seq <= self.done:
            return "done"
        if self.fault_at is not None and seq >= self.fault_at:
            return "faulted"
        return "pending"


class FakeFence:
    """An ordered fence (``stream_key``, ``seq``) of a :class:`FakeStream`."""

    def __init__(self, stream: FakeStream, seq: int) -> None:
        self.stream = stream
        self.stream_key = stream.key
        self.seq = seq
        self.queries = 0
        self.override: bool | None = None  # force query()'s answer (order tests)

    def __repr__(self) -> str:
        return f"<FakeFence {self.stream_key}:{self.seq} {self.status}>"

    @property
    def status(self) -> str:
        return self.stream.status(self.seq)

    def query(self) -> bool:
        self.queries += 1
        if self.override is not None:
            return self.override
        status = self.status
        if status == "faulted":
            raise FenceError(f"fake stream {self.stream_key} faulted at {self.stream.fault_at}")
        return status == "done"

    def synchronize(self) -> None:
        if not self.query():
            raise AssertionError("FakeFence.synchronize() on a fence the test has not completed")


def ledger_snapshot(led: SlotLedger) -> tuple[Any, ...]:
    """Everything observable about a ledger (for "a raising call changed nothing")."""
    return (
        list(led._free),
        led._clean,
        bytes(led._state),
        list(led._gen),
        led._granted,
        list(led._uses),
        {
            k: [(b.fence, b.seq, b.rest, b.did, b.n, list(b.items)) for b in q]
            for k, q in led._streams.items()
        },
        [(b.fence, b.rest, b.did, b.n, list(b.items)) for b in led._unordered],
        led._next_did,
        led.pending,
        led.quarantined,
        led.peak_allocated,
        led.deferred_frees,
        led.reclaimed,
        led.resets,
        led.fence_errors,
    )


def pool_snapshot(pool: Any) -> tuple[Any, ...]:
    """Stats (minus timing summaries and the oldest wait), sizes and the ledger's full state."""
    stats = dataclasses.asdict(pool.stats())
    stats.pop("wait_time", None)
    stats.pop("fence_latency", None)
    stats.pop("oldest_wait_s", None)  # moves with the clock while a waiter queues
    pool.check_invariants()
    waiting = pool.waiting() if hasattr(pool, "waiting") else 0
    return (
        stats,
        pool.available_size(),
        pool.pending_size(),
        waiting,
        ledger_snapshot(pool._ledger),
    )


def unfittable_apart(snap: tuple[Any, ...]) -> tuple[tuple[int, dict[int, int]], tuple[Any, ...]]:
    """A :func:`pool_snapshot` as its count of calls that can never be
    served (``stats().unfittable``, and each priority's not 0) and the rest
    of it, the figures per priority left out: a call refused for asking
    more than the pool has counts there, and changes nothing else."""
    stats = dict(snap[0])
    total = stats.pop("unfittable")
    tiers = stats.pop("by_priority")
    per = {p: one["unfittable"] for p, one in tiers.items() if one["unfittable"]}
    return (total, per), (stats, *snap[1:])


async def caller_pages_behind(pool: Any, fence: Any) -> tuple[Any, asyncio.Future[Any]]:
    """Every page of ``pool``'s KV pool admitted, detached and freed to the
    page pool behind ``fence``, and an admission queued for all of them;
    returns the pages and the queued admission."""
    kv = kv_of(pool)
    g = await pool.admit(pages=kv.capacity)
    pages = pool.detach_pages(g.row)
    pool.free([g.row])
    assert kv.free(pages, fence=fence) == 0
    assert kv.pending_size() == kv.capacity
    waiter = asyncio.ensure_future(pool.admit(pages=kv.capacity))
    await spin()
    assert pool.waiting() == 1
    return pages, waiter


async def granted_in_call(pool: Any, waiter: asyncio.Future[Any], pages: Any) -> None:
    """The admission ``waiter`` was granted ``pages`` inside the call just
    made (no loop step between that call and this check); free its row."""
    assert pool.waiting() == 0
    async with bounded():
        got = await waiter
    assert sorted(page_ids(got.pages)) == sorted(page_ids(pages))
    pool.free([got.row])
    pool.check_invariants()
    kv_of(pool).check_invariants()


def counter_values(collector: Any) -> dict[str, float]:
    """Each pool-wide counter family's one ``_total`` sample of a
    ``PoolCollector`` scrape, by family name (the per-priority families,
    labelled ``priority`` as well, are left out: a sample per priority,
    none before a call queued)."""
    out = {}
    for fam in collector.collect():
        if fam.type == "counter" and not fam.name.endswith(_PER_PRIORITY):
            (sample,) = [s for s in fam.samples if s.name.endswith("_total")]
            out[fam.name] = sample.value
    return out


_PER_PRIORITY = (
    "priority_timeouts",
    "priority_cancellations",
    "priority_rejections",
    "priority_unfittable",
)


def kv_of(pool: Any) -> Any:
    """The ``KVPagePool`` a pool was built with (asserting it has one)."""
    kv = pool.kv
    assert kv is not None
    return kv


def grouped_pool(rows: int = 4, swa: int = 8, full: int = 12, **kw: Any) -> AsyncReqToTokenPool:
    """An ``AsyncReqToTokenPool`` of ``rows`` rows with two KV groups,
    ``swa`` and ``full`` pages (of 4 slots): the KV-groups tests' pool."""
    return AsyncReqToTokenPool(
        rows + 1, 64, kv={"swa": KVPagePool(swa + 1, 4), "full": KVPagePool(full + 1, 4)}, **kw
    )


def kv_group(pool: AsyncReqToTokenPool, name: str) -> KVPagePool:
    """The ``KVPagePool`` of a pool's KV group ``name`` (asserting it has groups)."""
    groups = pool.kv_groups
    assert groups is not None
    return groups[name]


def count_wake_ups(pool: AsyncReqToTokenPool) -> list[int]:
    """Count the pool's fence wake-ups from now on: ``[n]``, read as it grows."""
    calls = [0]
    real = pool._wakeups.on_fences_done

    def counting(loop: asyncio.AbstractEventLoop | None = None) -> None:
        calls[0] += 1
        real(loop)

    pool._wakeups.on_fences_done = counting  # type: ignore[method-assign]
    return calls


def assert_granted(side: str, result: Any) -> None:
    """``result`` is what a waiter for one row (``side == "rows"``) or one
    row and two pages (an ``admit(pages=2)``) was granted."""
    if side == "rows":
        assert isinstance(result, list) and len(result) == 1
    else:
        assert isinstance(result, Grant) and len(result.pages) == 2


def page_ids(t: Any) -> list[int]:
    """Page ids of a tensor of any shape, as Python ints, in order."""
    return [int(x) for x in t.reshape(-1).tolist()]


def kv_snapshot(kv: Any) -> tuple[Any, ...]:
    """Everything observable about a page pool (for "a raising call changed nothing")."""
    led = kv.ledger
    kv.check_invariants()
    stats = dataclasses.asdict(kv.stats())
    stats.pop("fence_latency")
    return (
        led.free_count,  # not available_size(): it reclaims completed fences
        kv.pending_size(),
        stats,
        led.states().tobytes(),
        led._ring.tobytes(),
        led._head,
        led._taken,
        led._returned,
        led._next_did,
        {
            k: [(b.fence, b.rest, b.did, b.n, [p.tobytes() for p in b.items]) for b in q]
            for k, q in led._streams.items()
        },
        [(b.fence, b.rest, b.did, b.n, [p.tobytes() for p in b.items]) for b in led._unordered],
    )


def kv_pool_state(pool: Any) -> tuple[Any, ...]:
    """Everything a refused call on a pool with ``kv`` must leave as it was:
    stats (minus timing summaries), page counts and each row's pages; the
    invariants of both pools are checked on the way."""
    kv = kv_of(pool)
    kv.check_invariants()
    pool.check_invariants()
    stats = dataclasses.replace(pool.stats(), fence_latency=None, wait_time=None, admit_wait=None)
    owned = {r: page_ids(pool.pages_of(r)) for r in pool._ledger.allocated_rows()}
    return stats, kv.available_size(), kv.pending_size(), owned


def assert_pages_conserved(pool: Any) -> None:
    """:func:`assert_conserved`, and no page leaked either: the page ledger's
    invariants hold and its counts add up."""
    assert_conserved(pool)
    kv_of(pool).check_invariants()
    st = pool.stats()
    assert st.pages_free + st.pages_allocated + st.pages_pending + st.pages_quarantined == (
        st.pages_capacity
    )


def assert_conserved(pool: Any) -> None:
    """No row leaked: every row is in exactly one state and the counts add up."""
    pool.check_invariants()
    st = pool.stats()
    assert st.free == pool.available_size()
    assert st.pending == pool.pending_size()
    assert st.free + st.allocated + st.pending + st.quarantined == st.capacity == pool.size - 1


async def spin(n: int = 5) -> None:
    """Step the event loop ``n`` times (no timed sleeps)."""
    for _ in range(n):
        await asyncio.sleep(0)


@contextlib.contextmanager
def calling_from_a_thread(call: Callable[[], object]) -> Iterator[None]:
    """Call ``call`` over and over on another thread (a metrics scrape, say)
    while the block runs; on the way out stop and join it (bounded). If the
    block finished, assert the thread raised nothing (``call`` may assert)
    and stopped; if the block raised, that error propagates as it is."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def loop() -> None:
        try:
            while not stop.is_set():
                call()
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    thread = threading.Thread(target=loop, name="calling-from-a-thread", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(WAIT_S)
    assert not errors, f"the thread raised: {errors!r}"
    assert not thread.is_alive(), "the thread did not stop"


def usage_error(run: Callable[[list[str]], object], argv: list[str], capsys: Any) -> str:
    """Run a program's ``main(argv)``, which must refuse it as argparse does
    (exit status 2); return what it wrote to stderr."""
    with pytest.raises(SystemExit) as exc:
        run(argv)
    assert exc.value.code == 2, argv
    err: str = capsys.readouterr().err
    return err


_T = TypeVar("_T")


async def queued_call(call: Coroutine[Any, Any, _T]) -> asyncio.Task[_T]:
    """``call`` as a task, stepped until it waits (it must not finish)."""
    task = asyncio.ensure_future(call)
    await spin()
    assert not task.done()
    return task


async def settled(task: asyncio.Future[Any]) -> Any:
    """The task's result, or the exception it ended with (its cancellation
    included); bounded."""
    async with bounded():
        await asyncio.wait([task])
    if task.cancelled():
        return asyncio.CancelledError()
    return task.exception() or task.result()


_cycles_per_ms: float | None = None


def gpu_busy(ms: float) -> None:
    """Queue a kernel that keeps the current CUDA stream busy for about ``ms``.

    The tests that need "a step still in flight" hold a stream with this and
    must finish their host-side work well inside ``ms``; keep ``ms`` in the
    hundreds: a worker of ``pytest -n 8`` can be descheduled, or load a
    kernel's module lazily, for tens of milliseconds (seen on an H200).
    """
    import torch

    global _cycles_per_ms
    if _cycles_per_ms is None:
        # One untimed spin first: an idle GPU clocks low (345 MHz against
        # 1980 on an H200), and cycles counted at the low clock would make
        # every later spin several times shorter than asked.
        # The shortest of three timed spins: on a GPU other processes share,
        # a spin's events also time their turns, which would make later
        # spins shorter than asked.
        torch.cuda._sleep(50_000_000)
        torch.cuda.synchronize()
        cycles = 50_000_000
        shortest = float("inf")
        for _ in range(3):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
            shortest = min(shortest, start.elapsed_time(end))
        _cycles_per_ms = cycles / max(shortest, 1e-3)
    torch.cuda._sleep(int(ms * _cycles_per_ms))


EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _load_module(name: str, path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """A fresh module ``name`` from ``path``, in ``sys.modules`` while the
    test runs (an example's dataclasses need it there while it loads)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)
    spec.loader.exec_module(mod)
    return mod


def load_example(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """A fresh copy of ``examples/<name>.py``, and of the ``_engine`` and
    ``_router`` modules it may import (run as a script it finds
    ``examples/_engine.py`` beside it, its folder being first on
    ``sys.path``; the tests' is not)."""
    _load_module("_engine", EXAMPLES / "_engine.py", monkeypatch)
    _load_module("_router", EXAMPLES / "_router.py", monkeypatch)
    return _load_module(f"example_{name}", EXAMPLES / f"{name}.py", monkeypatch)


class WarningsSeen(logging.Handler):
    """The ``asyncpool`` logger's warnings (records of ``level`` and up)
    whose message contains ``text``: kept in ``messages``, and ``event``
    set (emitted from the loop's thread)."""

    def __init__(self, text: str, level: int = logging.WARNING) -> None:
        super().__init__(level)
        self.text = text
        self.event = asyncio.Event()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if self.text in message:
            self.messages.append(message)
            self.event.set()


@contextlib.contextmanager
def warnings_seen(text: str, level: int = logging.WARNING) -> Iterator[WarningsSeen]:
    """A :class:`WarningsSeen` on the ``asyncpool`` logger while the block
    runs (its handler is removed after)."""
    handler = WarningsSeen(text, level)
    logger = logging.getLogger("asyncpool")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


@contextlib.contextmanager
def overdue_warnings() -> Iterator[asyncio.Event]:
    """An event set on every overdue-fence warning the ``asyncpool`` logger
    emits while the block runs (its handler is removed after)."""
    with warnings_seen("overdue") as seen:
        yield seen.event


#: A device index no real CUDA device has: the stand-in events that
#: CudaFence.__del__ gives back land in a free list nobody takes from
#: (:func:`forget_stand_in_events` empties it).
FAKE_DEVICE = -1


class StandInEvent:
    """What :class:`CudaFence` calls on a ``torch.cuda.Event``, gated by the
    test: done once ``gate`` is set. ``synchronize()`` waits for the gate,
    for at most ``wait_s`` seconds (None: for ever)."""

    def __init__(self, gate: threading.Event, wait_s: float | None = None) -> None:
        self.gate = gate
        self.wait_s = wait_s
        self.entered = threading.Event()  # a thread is blocked in synchronize()

    def query(self) -> bool:
        return self.gate.is_set()

    def synchronize(self) -> None:
        self.entered.set()
        self.gate.wait(self.wait_s)


def forget_stand_in_events() -> None:
    """Drop the stand-in events CudaFence.__del__ gave back to the pool."""
    fences_mod._event_pool._free.pop(FAKE_DEVICE, None)


# ------------------------------------------------ tasks started as an eager factory starts them

HAS_EAGER = hasattr(asyncio, "eager_task_factory")
HOW = [
    "by hand",
    pytest.param(
        "eager",
        marks=pytest.mark.skipif(
            not HAS_EAGER, reason="asyncio.eager_task_factory needs Python 3.12+"
        ),
    ),
]


@contextlib.contextmanager
def eager_tasks(how: str) -> Iterator[None]:
    """The running loop's task factory is the eager one while the block runs
    (``how == "eager"``); put back after."""
    loop = asyncio.get_running_loop()
    before = loop.get_task_factory()
    if how == "eager":
        loop.set_task_factory(asyncio.eager_task_factory)  # type: ignore[attr-defined,unused-ignore]
        _check_eager_factory(loop, before)
    try:
        yield
    finally:
        loop.set_task_factory(before)


async def _nothing() -> None:
    pass


def _check_eager_factory(loop: asyncio.AbstractEventLoop, before: Any) -> None:
    """Skip the test where this loop cannot run the eager factory at all:
    uvloop 0.22+ passes ``eager_start=`` to a task factory, and
    ``asyncio.eager_task_factory`` takes it only from Python 3.14 (on
    3.13.0 every ``create_task`` then raises ``TypeError``, the pool or
    not). That pairing is uvloop's and CPython's to settle; the eager
    cases run wherever the two agree (3.12 on either loop, 3.13 on
    asyncio)."""
    why = eager_factory_refused(loop)
    if why is not None:
        loop.set_task_factory(before)
        pytest.skip(why)


def eager_factory_refused(loop: asyncio.AbstractEventLoop) -> str | None:
    """Why ``loop``, its task factory the eager one, cannot create a task
    at all (see :func:`_check_eager_factory`), or None. A probe task it
    creates is run to its end (at once on a running loop: it never
    suspends). Also tests/conftest.py's check for ASYNCPOOL_TEST_EAGER."""
    probe = _nothing()
    try:
        task = loop.create_task(probe)
    except TypeError as exc:
        probe.close()  # never started: closed, not left unawaited
        if "eager_start" not in str(exc):
            raise
        return (
            f"{type(loop).__module__} passes eager_start= to the task factory, which "
            f"asyncio.eager_task_factory on Python {sys.version.split()[0]} does not take"
        )
    if not loop.is_running():
        loop.run_until_complete(task)
    return None


def start_task(coro: Coroutine[Any, Any, Any], how: str) -> asyncio.Future[Any]:
    """A task of ``coro`` started as the eager factory starts one: its code
    runs now, up to its first suspension. ``eager``: ``create_task`` on the
    eager loop. ``by hand``: the coroutine is stepped here, then a task
    carries it on from where it stopped (:class:`_Stepped`)."""
    loop = asyncio.get_running_loop()
    if how == "eager":
        return loop.create_task(coro)
    try:
        yielded = coro.send(None)
    except StopIteration as stop:
        done = loop.create_future()
        done.set_result(stop.value)
        return done
    return loop.create_task(_Stepped(coro, yielded))


class _Stepped(collections.abc.Coroutine):  # type: ignore[type-arg]
    """A coroutine already stepped once, for a task to carry on as if it had
    run that step: the task's first step is handed what the coroutine
    yielded (the future it waits on, which the task then watches: a
    ``cancel()`` reaches that future, and the coroutine resumes after the
    callbacks queued before it completed, as in a task), every later one
    goes to the coroutine. A cancel before that first step cancels the
    future, as it would have in a task suspended on it (or, the future
    done, is thrown in)."""

    def __init__(self, coro: Coroutine[Any, Any, Any], yielded: Any) -> None:
        self._coro = coro
        self._yielded: Any = yielded
        self._first = True

    def send(self, value: Any) -> Any:
        if self._first:
            self._first = False
            return self._yielded
        return self._coro.send(value)

    def __next__(self) -> Any:  # a task sends None through tp_iternext
        return self.send(None)

    def throw(self, *exc: Any) -> Any:
        if self._first:
            self._first = False
            fut = self._yielded
            if isinstance(exc[0], asyncio.CancelledError) and fut is not None and fut.cancel():
                return self._coro.send(None)  # it reads the cancelled future
        return self._coro.throw(*exc)

    def close(self) -> None:
        self._coro.close()

    def __await__(self) -> Any:
        return self

    def __iter__(self) -> Any:
        return self
